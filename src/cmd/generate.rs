//! `mlxb generate`: one prompt in, streamed text out, with mlx-lm's footer or a JSON object.

use super::common::resolve_model;
use super::common::{ModelArgs, PromptArgs, SamplingArgs, SpecArgs};
use super::flags::{open_session, ForkArgs};
use crate::engine::error::EngineError;
use crate::engine::generate::Speculator;
use crate::engine::generate::{Flow, GenerationStats};
use crate::engine::session::Session;
use crate::engine::text::{generate_text, TextEvent};
use crate::spec::executor::Speculation;
use crate::spec::factory::open_source;
use crate::spec::metrics::SpecMetrics;
use crate::spec::policy::DraftPolicy;
use crate::spec::trace::JsonlTrace;
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
    #[command(flatten)]
    pub forks: ForkArgs,
    /// With a drafter: `cost` drafts only while drafting rounds hand out more tokens per second
    /// than plain decoding steps on this machine (it turns drafting off where speculation would
    /// be slower, and retries it now and then); `all` drafts every round. Either way the output
    /// is the target's own [default: cost; all with --spec-trace].
    // The bracket is clap's default-value convention in the help text, not a doc link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long, value_enum)]
    pub draft_policy: Option<DraftPolicy>,
    /// Print mlx-lm's separators and timing footer.
    #[arg(long)]
    pub verbose: bool,
    /// Across ranks (`mlxb launch`): whole layers per rank (pipeline parallelism, mlx-lm's
    /// `--pipeline`) instead of a slice of every layer
    #[arg(long)]
    pub pipeline: bool,
    /// Print one JSON object (text, token ids, timings) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// The prompt as token ids (`0,45,74,...`), fed as-is: no tokenizer, no chat template
    /// (replaces `--prompt`).
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub prompt_ids: Option<Vec<u32>>,
    /// Write one JSON object per speculative round to FILE (JSONL; see `spec::trace`).
    #[arg(long, value_name = "FILE")]
    pub spec_trace: Option<std::path::PathBuf>,
}

/// The prompt ids: `--prompt-ids` as given (each checked against the vocabulary), else the
/// tokenized `--prompt`.
fn prompt_ids(args: &GenerateArgs, session: &Session) -> anyhow::Result<Vec<u32>> {
    if let Some(ids) = &args.prompt_ids {
        let vocab = session.model.model.vocab_size();
        if ids.is_empty() {
            return Err(
                EngineError::Input("--prompt-ids is empty; give at least one id".into()).into(),
            );
        }
        if let Some(bad) = ids.iter().find(|&&t| t as i64 >= vocab as i64) {
            return Err(EngineError::Input(format!(
                "--prompt-ids has id {bad}, outside the model's vocabulary of {vocab} tokens"
            ))
            .into());
        }
        return Ok(ids.clone());
    }
    args.prompt.ids(&session.tokenizer)
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

/// The sampled token's logprob (f32, printed exactly), for `--json`.
fn chosen_logprob(step: &crate::engine::generate::Step) -> crate::engine::error::Result<f32> {
    use mlx_rs::ops::indexing::IndexOp;
    let lp = step.logprobs.reshape(&[-1])?.index(step.token as i32);
    Ok(lp.try_item_cast::<f32>()?)
}

/// Entry point of `mlxb generate`.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let spec_opts = args.spec.options()?;
    super::common::choose_split(args.pipeline, spec_opts.as_ref())?;
    let dir = resolve_model(args.model.model.as_deref())?;
    let (mut session, forks) = open_session(&dir, &args.forks)?;
    let mut prompt_ids = prompt_ids(&args, &session)?;
    if let Some(group) = crate::engine::distributed::world() {
        // Rank 0's prompt on every rank (`--prompt -` reads stdin, which only rank 0 has).
        let mine: Vec<u8> = prompt_ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        let shared = crate::engine::distributed::share_bytes(&group, Some(&mine))?;
        prompt_ids = shared
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
    }
    session.startup.mark("prompt tokenized");
    let needs_a_drafter = [
        (
            args.spec_trace.is_some(),
            "--spec-trace records speculative rounds",
        ),
        (
            args.draft_policy.is_some(),
            "--draft-policy decides which speculative rounds draft",
        ),
    ];
    if let (Some((_, what)), None) = (needs_a_drafter.iter().find(|n| n.0), &spec_opts) {
        return Err(EngineError::Input(format!(
            "{what}; give a drafter (--drafter, --draft-model, --draft-kind, --draft-layers)"
        ))
        .into());
    }
    // Across ranks, rank 0 alone prints (and writes the trace); every rank runs the same
    // generation.
    let ranks = crate::engine::distributed::world();
    let leader = ranks.as_ref().is_none_or(|g| g.is_leader());
    let mut trace = args
        .spec_trace
        .as_deref()
        .filter(|_| leader)
        .map(JsonlTrace::create)
        .transpose()?;
    let stream = !args.json && leader;
    if args.verbose && stream {
        println!("==========");
    }
    let mut spec = match spec_opts {
        Some(opts) => {
            let source = open_source(&opts, &session, forks, args.model.prefill_step_size)?;
            let policy = DraftPolicy::for_stream(args.draft_policy, args.spec_trace.is_some());
            let spec = Speculation::with_options(source, &opts).with_draft_policy(policy);
            Some(match trace.as_mut() {
                Some(t) => spec.with_trace(Box::new(t)),
                None => spec,
            })
        }
        None => None,
    };
    let mut stdout = std::io::stdout();
    let mut params = args.sampling.text_params(&args.model);
    if let Some(group) = &ranks {
        params.seed = Some(crate::engine::distributed::common_seed(group, params.seed)?);
    }
    let mut logprobs = Vec::new();
    let speculator = spec.as_mut().map(|s| -> &mut dyn Speculator { s });
    let startup = session.startup.clone();
    let _wait = ranks
        .as_ref()
        .map(|_| crate::engine::distributed::waiting());
    let outcome = generate_text(
        &mut session,
        &prompt_ids,
        &params,
        speculator,
        None,
        |event| {
            crate::engine::distributed::heard();
            let seg = match event {
                TextEvent::Token { text, step } => {
                    if args.json {
                        logprobs.push(chosen_logprob(step)?);
                    }
                    text
                }
                TextEvent::Tail(text) => text,
            };
            if stream && !seg.is_empty() {
                if matches!(event, TextEvent::Token { step, .. } if step.index == 0) {
                    startup.mark("first token out");
                }
                let _ = write!(stdout, "{seg}");
                let _ = stdout.flush();
            }
            Ok(Flow::Continue)
        },
    )?;
    let metrics = spec.map(|s| s.metrics);
    if let Some(t) = trace.as_mut() {
        t.flush()?;
    }
    if !leader {
        return Ok(());
    }
    if args.json {
        let s = &outcome.stats;
        let obj = serde_json::json!({
            "model": dir,
            "text": outcome.text,
            "prompt_token_ids": prompt_ids,
            "token_ids": outcome.token_ids,
            "token_logprobs": logprobs,
            "finish_reason": outcome.finish_reason.as_str(),
            "prompt_tokens": s.prompt_tokens,
            "prompt_tps": s.prompt_tps(),
            "generation_tokens": s.generation_tokens,
            "generation_tps": s.generation_tps(),
            "peak_memory_gb": s.peak_memory as f64 / 1e9,
            "speculative": metrics.as_ref().map(SpecMetrics::to_json),
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
            if let Some(m) = &metrics {
                println!("{}", m.footer());
            }
        }
    }
    Ok(())
}
