//! `mlxb train-dspark`: regenerates responses with the target, caches its hidden states, and
//! trains a DSpark drafter (dspark-spec.md §2) with resumable checkpoints.
//!
//! Stages, each resumable: the target cache (`--cache`, default `OUT/cache`), then training
//! (`OUT/model.safetensors` + `dspark.json` + `train-state.safetensors` every
//! `--checkpoint-every` steps; `--resume` continues from the last one bit for bit).

use super::common::{resolve_model, PromptFileArgs};
use crate::cmd::dspark_init::ShapeArgs;
use crate::engine::error::EngineError;
use crate::engine::forks::Forks;
use crate::engine::session::Session;
use crate::spec::dspark::checkpoint::{self, DsparkConfig, TargetFacts};
use crate::train::data::{
    build_cache, regenerate_all, sequences_header, train_prompts, RegenOptions, REGEN_TEMP,
};
use crate::train::draft_vocab;
use crate::train::forward::{DraftHead, Frozen, Params};
use crate::train::init::{init_for_session, scale_fc_to_unit_features, set_qk_norm_gains};
use crate::train::loss::LossWeights;
use crate::train::optim::{AdamW, TrainOptions};
use crate::train::prompts::PromptFile;
use crate::train::sequences::SequenceFile;
use crate::train::state::{load_state, STATE_FILE};
use crate::train::trainer::Trainer;
use clap::Args;
use mlx_rs::{Array, Dtype};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Flags of `mlxb train-dspark`.
#[derive(Debug, Args)]
pub struct TrainDsparkArgs {
    /// Target model directory (or built-in name).
    #[arg(long)]
    pub model: Option<String>,
    /// Prompt file (JSONL: `prompt`, `messages` or `prompt_ids` per line).
    #[arg(long)]
    pub data: PathBuf,
    #[command(flatten)]
    pub prompt_file: PromptFileArgs,
    /// Output checkpoint directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Target-cache directory (default `OUT/cache`).
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// The regenerated sequences (JSONL of token ids, default `CACHE/sequences.jsonl`): a
    /// stopped run resumes it; a copy lets another machine skip regeneration.
    #[arg(long, value_name = "FILE")]
    pub sequences: Option<PathBuf>,
    /// Only regenerate the sequences (the slow stage), then stop.
    #[arg(long, conflicts_with = "cache_only")]
    pub sequences_only: bool,
    /// The shape of a new drafter (ignored with --resume).
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Train on a reduced draft vocabulary: the N most frequent reply tokens of the sequences,
    /// saved as the drafter's `d2t`/`t2d` (as `mlxb dspark-vocab` chooses them). The output
    /// head's work per step shrinks to those rows. With --resume the checkpoint's own
    /// vocabulary is kept.
    #[arg(long, value_name = "N")]
    pub draft_vocab: Option<usize>,
    /// How a new drafter's context projection `fc` starts: `normal` (the Hugging Face init, as
    /// `dspark-init` writes it) or `rms` (each input column divided by that tapped feature's
    /// root-mean-square over the cached sequences, so every tapped layer and dimension starts
    /// with an equal share of the context features). Ignored with --resume.
    #[arg(long, value_enum, default_value_t = FcInit::Normal)]
    pub fc_init: FcInit,
    /// A new drafter's attention q/k norm gains start at this value instead of 1 (scores scale
    /// by its square: a sharper attention from the first step). Ignored with --resume.
    #[arg(long, default_value_t = 1.0)]
    pub qk_norm_init: f32,
    /// Optimizer steps (default: --epochs over the cached sequences).
    #[arg(long)]
    pub iters: Option<u64>,
    /// Epochs over the cached sequences when --iters is not given.
    #[arg(long, default_value_t = 1)]
    pub epochs: u64,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Anchors sampled per sequence.
    #[arg(long, default_value_t = 32)]
    pub anchors: usize,
    /// Peak learning rate (warm-up 4%, cosine to 0).
    #[arg(long, default_value_t = 6e-4)]
    pub lr: f64,
    /// Weights of the loss terms CE,L1,CONF[,KL]: cross-entropy, L1 to the target's
    /// distribution, confidence BCE, KL from the target's distribution (default DeepSpec's).
    #[arg(long, value_name = "CE,L1,CONF[,KL]", default_value = "0.1,0.9,1.0")]
    pub loss_weights: LossWeights,
    /// Checkpoint every this many steps.
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: u64,
    /// Tokens per regenerated reply at most.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Replies regenerated together by the batched engine (1: one at a time), in seeded groups
    /// of 8 batch widths. A sequences file records it: the same seed gives other replies at
    /// another batch size.
    #[arg(long, default_value_t = 1)]
    pub regen_batch: usize,
    /// Sampling temperature of the regenerated replies (top-p 0.8, top-k 20); 0 = greedy, the
    /// replies greedy decoding gives (for a lookup table that drafts greedy decoding). A
    /// sequences file records it.
    #[arg(long, default_value_t = REGEN_TEMP, allow_negative_numbers = true)]
    pub regen_temp: f64,
    /// Seed (init, data regeneration, sequence order and anchors).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Only build the target cache, then stop.
    #[arg(long)]
    pub cache_only: bool,
    /// Continue the training state in --out.
    #[arg(long)]
    pub resume: bool,
    /// Start from this drafter's weights (and its draft vocabulary) instead of a new one, with a
    /// new optimizer and learning-rate schedule: a longer run after a finished one, or a shipped
    /// drafter trained further on other data. The shape flags are ignored.
    #[arg(long, value_name = "DRAFTER", conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
}

/// The start of a new drafter's `fc` (see [`TrainDsparkArgs::fc_init`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FcInit {
    /// As initialised (normal(0, std)).
    Normal,
    /// Input columns scaled to unit root-mean-square features.
    Rms,
}

/// A checkpoint and training state to continue, read and checked before any work starts.
struct ResumeState {
    config: DsparkConfig,
    tensors: HashMap<String, Array>,
    params: Params,
    opt: AdamW,
    opts: TrainOptions,
}

/// The configuration and weights of the drafter in `dir`; unreadable weights are an error
/// naming the file and what to do instead (`fix`).
fn read_drafter(dir: &Path, fix: &str) -> anyhow::Result<(DsparkConfig, HashMap<String, Array>)> {
    let (config, _) = checkpoint::read_config(dir)?;
    let weights = dir.join(checkpoint::WEIGHTS_FILE);
    let tensors = Array::load_safetensors(&weights).map_err(|e| {
        EngineError::file(&weights, format!("cannot read the weights ({e}); {fix}"))
    })?;
    Ok((config, tensors))
}

/// Reads the drafter in `out` and its training state; any broken file is an error naming it.
fn read_resume_state(out: &Path) -> anyhow::Result<ResumeState> {
    let (config, tensors) = read_drafter(out, "start without --resume")?;
    let mut params = Params::from_tensors(&config, &tensors)?;
    let (opt, opts) = load_state(out, &mut params)?;
    Ok(ResumeState {
        config,
        tensors,
        params,
        opt,
        opts,
    })
}

/// Entry point of `mlxb train-dspark`.
pub fn run(args: TrainDsparkArgs) -> anyhow::Result<()> {
    // Check every input before anything is written.
    let prompts = PromptFile::read(&args.data)?;
    let exists = checkpoint::is_artifact(&args.out);
    if exists && !args.resume {
        return Err(EngineError::file(
            &args.out,
            "already holds a DSpark checkpoint; pass --resume to continue it or choose another --out",
        )
        .into());
    }
    if args.resume && !args.out.join(STATE_FILE).is_file() {
        return Err(EngineError::file(
            &args.out,
            "holds no training state to resume; run without --resume",
        )
        .into());
    }
    if args.batch == 0 || args.anchors == 0 || args.checkpoint_every == 0 {
        return Err(EngineError::Input(
            "--batch, --anchors and --checkpoint-every must be at least 1".into(),
        )
        .into());
    }
    if !(args.regen_temp.is_finite() && args.regen_temp >= 0.0) {
        return Err(EngineError::Input(format!(
            "--regen-temp {} is not a temperature; use 0 for greedy replies or a positive value",
            args.regen_temp
        ))
        .into());
    }
    if args.draft_vocab == Some(0) {
        return Err(EngineError::Input(
            "--draft-vocab must be at least 1 (or left out for the whole vocabulary)".into(),
        )
        .into());
    }
    // A resumed drafter and its training state are read in full here, so a broken one is
    // refused before the target cache is built.
    let resumed = if args.resume {
        Some(read_resume_state(&args.out)?)
    } else {
        None
    };
    let start_from = match &args.init_from {
        Some(d) => Some((
            d,
            read_drafter(d, "give --init-from a drafter directory mlxb wrote")?,
        )),
        None => None,
    };
    let dir = resolve_model(args.model.as_deref())?;
    let mut session =
        Session::open_traced(&dir, Forks::default(), super::progress::startup_trace())?;
    let prompts = train_prompts(&prompts, &session, args.prompt_file.use_chat_template())
        .map_err(|e| args.prompt_file.explain(e))?;
    let (config, tensors, resumed) = match resumed {
        Some(r) => {
            r.config
                .check_target(&TargetFacts::of(session.model.model.as_ref())?, &args.out)?;
            (r.config, r.tensors, Some((r.params, r.opt, r.opts)))
        }
        None => match start_from {
            Some((from, (config, tensors))) => {
                config.check_target(&TargetFacts::of(session.model.model.as_ref())?, from)?;
                (config, tensors, None)
            }
            None => {
                let opts = args.shape.init_options(args.seed);
                let (config, tensors) = init_for_session(&session, &dir, &opts)?;
                (config, tensors, None)
            }
        },
    };
    let save_dtype = tensors
        .get("fc.weight")
        .map_or(Dtype::Bfloat16, |a| a.dtype());
    let taps: Vec<usize> = config
        .target_layer_ids
        .iter()
        .map(|&t| t as usize)
        .collect();
    let cache = args.cache.clone().unwrap_or_else(|| args.out.join("cache"));
    let regen = RegenOptions {
        max_tokens: args.max_tokens,
        seed: args.seed,
        batch: args.regen_batch.max(1),
        temp: args.regen_temp,
    };
    let seq_path = args
        .sequences
        .clone()
        .unwrap_or_else(|| cache.join("sequences.jsonl"));
    let header = sequences_header(&session, &regen)?;
    let mut sequences = SequenceFile::open(&seq_path, &header, &prompts)?;
    let progress = super::progress::Terminal::default();
    regenerate_all(&mut session, &prompts, &mut sequences, &regen, &progress)?;
    if args.sequences_only {
        println!(
            "regenerated {} sequences in {} (sha256 of ids {})",
            sequences.done().len(),
            seq_path.display(),
            sequences.digest()
        );
        return Ok(());
    }
    let examples = build_cache(&mut session, &sequences, &taps, &cache, &progress)?;
    if args.cache_only {
        println!("cached {} sequences in {}", examples.len(), cache.display());
        return Ok(());
    }
    if examples.is_empty() {
        return Err(EngineError::Input(
            "no regenerated reply has enough loss tokens to train on; give more or longer prompts"
                .into(),
        )
        .into());
    }
    let mut opts = TrainOptions {
        steps: args
            .iters
            .unwrap_or(args.epochs * examples.len().div_ceil(args.batch) as u64),
        batch: args.batch,
        anchors: args.anchors,
        lr: args.lr,
        loss_weights: args.loss_weights,
        seed: args.seed,
        checkpoint_every: args.checkpoint_every,
        ..TrainOptions::default()
    };
    let (params, opt) = match resumed {
        Some((params, opt, saved)) => {
            if saved != opts {
                eprintln!("resuming with the saved training options (the flags given differ)");
            }
            opts = saved;
            (params, opt)
        }
        None => {
            let mut params = Params::from_tensors(&config, &tensors)?;
            // A drafter given by --init-from keeps its trained weights as they are.
            let fresh = args.init_from.is_none();
            if fresh && args.fc_init == FcInit::Rms {
                let spread = scale_fc_to_unit_features(&mut params, &examples)?;
                eprintln!(
                    "fc init: columns scaled to unit-RMS tapped features (their RMS spans {:.3} to {:.1})",
                    spread.0, spread.1
                );
            }
            if fresh && args.qk_norm_init != 1.0 {
                set_qk_norm_gains(&mut params, args.qk_norm_init)?;
            }
            let opt = AdamW::new(&params)?;
            (params, opt)
        }
    };
    let draft_ids = match (draft_vocab::ids_of(&tensors)?, args.draft_vocab) {
        (Some(ids), _) => Some(ids),
        (None, Some(size)) if !args.resume => {
            let choice = draft_vocab::choose(&seq_path, config.vocab_size, size)?;
            eprintln!(
                "draft vocabulary: {} of {} distinct reply tokens ({:.2} % of the reply tokens)",
                choice.ids.len(),
                choice.distinct,
                100.0 * choice.coverage
            );
            Some(choice.ids)
        }
        (None, _) => None,
    };
    let target = session.model.model.as_ref();
    let head = draft_ids
        .map(|ids| DraftHead::new(ids, target, &config))
        .transpose()?;
    let frozen = Frozen::new(&config, &params, target, head)?;
    let mut trainer = Trainer {
        frozen,
        params,
        opt,
        opts,
        out: args.out.clone(),
        save_dtype,
    };
    let start = Instant::now();
    let first = trainer.opt.step;
    while trainer.opt.step < trainer.opts.steps {
        let r = trainer.step(&examples)?;
        let per = start.elapsed().as_secs_f64() / (r.step - first) as f64;
        eprintln!(
            "step {}/{}: loss {:.4} (ce {:.3} l1 {:.3} conf {:.3} kl {:.3}) grad {:.2} lr {:.2e}, {:.1}s/step, ETA {:.0}s",
            r.step,
            trainer.opts.steps,
            r.loss,
            r.terms[0],
            r.terms[1],
            r.terms[2],
            r.terms[3],
            r.grad_norm,
            r.lr,
            per,
            per * (trainer.opts.steps - r.step) as f64
        );
        if r.step % trainer.opts.checkpoint_every == 0 || r.step == trainer.opts.steps {
            trainer.save()?;
        }
    }
    if trainer.opt.step == first {
        if !args.resume {
            trainer.save()?;
        } else if !trainer.drafter_matches(&tensors)? {
            // Killed between the final state and the final drafter: finish the second write.
            trainer.save_drafter()?;
        }
    }
    println!(
        "trained {} steps on {} sequences; drafter in {}",
        trainer.opt.step,
        examples.len(),
        args.out.display()
    );
    Ok(())
}
