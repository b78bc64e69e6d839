//! `mlxb generate`: one prompt in, streamed text out, with mlx-lm's footer or a JSON object.

use super::common::{ModelArgs, PromptArgs, SamplingArgs, SpecArgs};
use crate::engine::flags::Forks;
use crate::engine::generate::{Flow, GenerationStats, Generator, Speculation};
use crate::engine::sample::{self, LogitsProcessors, Sampler};
use crate::engine::session::{resolve_model, Session};
use crate::engine::tokenizer::StreamingDetokenizer;
use crate::spec::metrics::SpecMetrics;
use crate::spec::source::{open_source, DraftSource};
use clap::Args;
use std::io::Write;

/// Flags of `mlxb generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub prompt: PromptArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Print mlx-lm's separators and timing footer.
    #[arg(long)]
    pub verbose: bool,
    /// Print one JSON object (text, token ids, timings) instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

/// What one generation produced.
pub struct Outcome {
    /// Decoded text (EOS excluded).
    pub text: String,
    /// Generated ids (EOS included when it ended the generation).
    pub token_ids: Vec<u32>,
    /// "stop" (EOS) or "length".
    pub finish_reason: &'static str,
    /// Timings and memory.
    pub stats: GenerationStats,
    /// Acceptance metrics when a drafter was attached.
    pub spec: Option<SpecMetrics>,
}

/// Runs the generation, streaming text segments to `on_text` as they complete.
pub fn run_generation(
    session: &mut Session,
    prompt_ids: &[u32],
    sampling: &SamplingArgs,
    model_args: &ModelArgs,
    draft: Option<(Box<dyn DraftSource>, &SpecArgs)>,
    mut on_text: impl FnMut(&str),
) -> anyhow::Result<Outcome> {
    if let Some(s) = sampling.seed {
        sample::seed(s)?;
    }
    let eos = session.tokenizer.eos_token_ids();
    let mut specials = session.tokenizer.encode("\n", false)?;
    specials.extend(eos.iter().copied());
    let mut sampler = Sampler::new(&sampling.sampler(specials))?;
    let mut processors = LogitsProcessors::new(&sampling.processors())?;
    let cfg = sampling.generate_config(model_args);
    let mut detok = StreamingDetokenizer::new(&session.tokenizer);
    let mut ids = Vec::new();
    let mut text = String::new();
    let mut finish_reason = "length";
    let mut generator = Generator::new(session.model.model.as_mut(), &mut sampler, &mut processors);
    if let Some((source, spec)) = draft {
        generator = generator.with_speculation(Speculation {
            source,
            num_draft_tokens: spec.num_draft_tokens,
            verify: spec.spec_verify,
            temp: sampling.temp,
            metrics: SpecMetrics::default(),
        });
    }
    let (stats, spec_metrics) = generator.run(prompt_ids, &cfg, |step| {
        ids.push(step.token);
        if eos.contains(&step.token) {
            finish_reason = "stop";
            return Ok(Flow::Stop);
        }
        detok.add_token(step.token);
        let seg = detok.last_segment();
        if !seg.is_empty() {
            on_text(&seg);
            text.push_str(&seg);
        }
        Ok(Flow::Continue)
    })?;
    detok.finalize();
    let seg = detok.last_segment();
    if !seg.is_empty() {
        on_text(&seg);
        text.push_str(&seg);
    }
    Ok(Outcome {
        text,
        token_ids: ids,
        finish_reason,
        stats,
        spec: spec_metrics,
    })
}

/// mlx-lm's footer lines.
pub fn footer(stats: &GenerationStats) -> String {
    format!(
        "Prompt: {} tokens, {:.3} tokens-per-sec\nGeneration: {} tokens, {:.3} tokens-per-sec\nPeak memory: {:.3} GB",
        stats.prompt_tokens,
        stats.prompt_tps(),
        stats.generation_tokens,
        stats.generation_tps(),
        stats.peak_memory as f64 / 1e9
    )
}

/// Entry point of `mlxb generate`.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let dir = resolve_model(args.model.model.as_deref())?;
    let mut session = Session::open(&dir, Forks::default())?;
    let prompt = args.prompt.text()?;
    let use_template = !args.prompt.ignore_chat_template;
    let prompt_ids = session.tokenizer.prompt_ids(
        &prompt,
        args.prompt.system_prompt.as_deref(),
        use_template,
    )?;
    let stream = !args.json;
    if args.verbose && stream {
        println!("==========");
    }
    let draft = match args.spec.options() {
        Some(opts) => Some((
            open_source(
                &opts,
                &session,
                Forks::default(),
                args.model.prefill_step_size,
            )?,
            &args.spec,
        )),
        None => None,
    };
    let mut stdout = std::io::stdout();
    let outcome = run_generation(
        &mut session,
        &prompt_ids,
        &args.sampling,
        &args.model,
        draft,
        |seg| {
            if stream {
                let _ = write!(stdout, "{seg}");
                let _ = stdout.flush();
            }
        },
    )?;
    if args.json {
        let s = &outcome.stats;
        let obj = serde_json::json!({
            "model": dir,
            "text": outcome.text,
            "prompt_token_ids": prompt_ids,
            "token_ids": outcome.token_ids,
            "finish_reason": outcome.finish_reason,
            "prompt_tokens": s.prompt_tokens,
            "prompt_tps": s.prompt_tps(),
            "generation_tokens": s.generation_tokens,
            "generation_tps": s.generation_tps(),
            "peak_memory_gb": s.peak_memory as f64 / 1e9,
            "speculative": outcome.spec.as_ref().map(SpecMetrics::to_json),
        });
        println!("{obj}");
        return Ok(());
    }
    println!();
    if args.verbose {
        println!("==========");
        if outcome.text.is_empty() {
            println!("No text generated for this prompt");
        } else {
            println!("{}", footer(&outcome.stats));
            if let Some(m) = &outcome.spec {
                println!("{}", m.footer());
            }
        }
    }
    Ok(())
}
