//! The engine thread: it alone owns the model, its caches and the drafter (MLX streams are
//! not thread-safe). It takes jobs off the queue one at a time, runs them through the
//! shared generation loop and sends token events back to the HTTP handler that asked.

use super::batching;
use super::error::ApiError;
use super::metrics::{Finished, Metrics};
use super::prefix::PrefixCache;
use super::ranks;
use super::request::CompletionRequest;
use super::stop::StopMatcher;
use super::types::{Timings, Usage};
use crate::engine::distributed::{self, Group};
use crate::engine::error::{EngineError, Result};
use crate::engine::forks::Forks;
use crate::engine::generate::Speculator;
use crate::engine::generate::{Flow, GenerateConfig, Step};
use crate::engine::runtime;
use crate::engine::session::Session;
use crate::engine::startup::StartupTrace;
use crate::engine::text::{generate_text, TextEvent, TextParams};
use crate::spec::draft_gate::DraftGate;
use crate::spec::executor::Speculation;
use crate::spec::factory::{open_source, SpecOptions};
use crate::spec::policy::DraftPolicy;
use crate::spec::source::DraftSource;
use mlx_rs::Dtype;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A generated token's logprob and the best alternatives (ids), for `logprobs`.
#[derive(Debug, Clone)]
pub struct TokenScore {
    /// The generated token.
    pub id: u32,
    /// Its logprob.
    pub logprob: f32,
    /// The most likely tokens, best first.
    pub top: Vec<(u32, f32)>,
}

/// How a finished request ended.
#[derive(Debug, Clone)]
pub struct Summary {
    /// `stop` or `length`.
    pub finish_reason: &'static str,
    /// Token counts.
    pub usage: Usage,
    /// llama.cpp timings.
    pub timings: Timings,
    /// Generated ids (EOS included when it ended the generation).
    pub token_ids: Vec<u32>,
    /// The request's stop string that ended the generation, if one did.
    pub stop_sequence: Option<String>,
}

/// What the engine sends back for a job, in order: deltas, then one `Done` or `Error`.
#[derive(Debug)]
pub enum Event {
    /// Text released (stop strings already cut) and, with logprobs, the token behind it.
    Delta {
        /// New text (may be empty when only a logprob is reported).
        text: String,
        /// The token's logprob, when asked for.
        token: Option<TokenScore>,
    },
    /// The generation finished.
    Done(Box<Summary>),
    /// The request failed; nothing else follows.
    Error(ApiError),
}

/// One request for the engine.
pub struct Job {
    /// The validated request.
    pub request: CompletionRequest,
    /// Its prompt, tokenized.
    pub prompt_ids: Vec<u32>,
    /// Where the events go; a dropped receiver (client gone) stops the generation.
    pub events: UnboundedSender<Event>,
    /// When the HTTP request arrived (TTFT and queue time start here).
    pub arrived: Instant,
}

/// What the engine thread loads.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Model directory.
    pub dir: PathBuf,
    /// The drafter every request decodes with, if any.
    pub spec: Option<SpecOptions>,
    /// Prompt tokens per prefill forward.
    pub prefill_step_size: usize,
    /// Reuse the previous request's KV for a shared prompt prefix (see `server::prefix`).
    pub prefix_reuse: bool,
    /// The forks the model is opened with.
    pub forks: Forks,
    /// optiq's per-layer KV allocation given with `--kv-config`.
    pub kv_config: Option<PathBuf>,
    /// Where opening the model and each generation mark their start-up steps.
    pub startup: StartupTrace,
    /// Most requests decoded at once (`--max-batch`; 1: one at a time).
    pub max_batch: usize,
    /// Most bytes of prompt prefixes the batch keeps for reuse (`--prompt-cache-bytes`).
    pub prompt_cache_bytes: usize,
    /// Most prompts prefilled together (`--prompt-concurrency`).
    pub prompt_concurrency: usize,
    /// How batched drafting steps size their verify blocks (`--draft-policy`).
    pub draft_policy: DraftPolicy,
}

/// Facts about the loaded model, for the ready card and request validation.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// `model_type` from config.json.
    pub model_type: String,
    /// The model's vocabulary size.
    pub vocab_size: usize,
    /// The drafter, described (`ngram, 3 tokens/round, match`), if any.
    pub drafter: Option<String>,
    /// Backend and MLX version (`cpu (MLX 0.32.4)`), read on the engine thread.
    pub backend: String,
    /// Whether prompt prefixes are reused across requests (off with `--no-prefix-reuse` or
    /// a drafter that reads the target's hidden states during prefill).
    pub prefix_reuse: bool,
    /// Most requests decoded at once (1 when batching is off).
    pub max_batch: usize,
    /// Why requests decode one at a time although `--max-batch` asked for more.
    pub batch_note: Option<String>,
}

/// The running engine thread.
pub struct Engine {
    /// What was loaded.
    pub info: EngineInfo,
    /// The thread; it ends when every queue sender is gone.
    pub handle: JoinHandle<()>,
}

/// Loads the model (and drafter) on a new thread, checks them with a short warm-up
/// generation, then serves `jobs` until the queue is closed. Returns once loading is done.
pub fn spawn(
    cfg: EngineConfig,
    jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
) -> anyhow::Result<Engine> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("mlxb-engine".into())
        .spawn(move || {
            let mut state = match State::open(&cfg) {
                Ok(state) => {
                    let _ = ready_tx.send(Ok(state.info.clone()));
                    state
                }
                Err(err) => {
                    let _ = ready_tx.send(Err(err));
                    return;
                }
            };
            let mut next = None;
            let ranks = state.ranks.clone();
            while let Some(job) = next.take().or_else(|| next_job(&jobs, ranks.as_deref())) {
                if state.info.max_batch > 1 && batching::fits_batch(&job, &state.session.tokenizer)
                {
                    next = batching::run(
                        &mut state.session,
                        &mut state.batching,
                        job,
                        &jobs,
                        &metrics,
                        &shutdown,
                    );
                } else {
                    state.serve(job, &metrics, &shutdown);
                }
            }
            if let Some(group) = ranks {
                if let Err(err) = ranks::send_end(&group) {
                    eprintln!("mlxb serve: {err}");
                }
            }
        })?;
    let info = ready_rx
        .recv()
        .map_err(|_| anyhow::anyhow!("the engine thread stopped while loading the model"))??;
    Ok(Engine { info, handle })
}

/// The next job; across ranks, while none comes, rank 0 keeps the other ranks told that it is
/// alive. `None` once the queue is closed (or the other ranks are lost).
fn next_job(jobs: &Receiver<Job>, ranks: Option<&Group>) -> Option<Job> {
    let Some(group) = ranks else {
        return jobs.recv().ok();
    };
    loop {
        match jobs.recv_timeout(ranks::keep_alive_every()) {
            Ok(job) => return Some(job),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if let Err(err) = ranks::send_keep_alive(group) {
                    eprintln!("mlxb serve: {err}");
                    return None;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return None,
        }
    }
}

/// Runs this rank's side of a server whose rank 0 takes the requests: loads its share of the
/// model, then runs every generation rank 0 sends until rank 0 stops.
pub fn follow(cfg: &EngineConfig, group: &Group) -> Result<()> {
    let mut state = State::open(cfg)?;
    while let Some(order) = ranks::receive(group)? {
        let carry = state.prefix.prepare(&order.prompt_ids);
        let _wait = distributed::waiting();
        let outcome = generate_text(
            &mut state.session,
            &order.prompt_ids,
            &order.params,
            None,
            Some(carry),
            |_| ranks::following(group),
        );
        state.prefix.finish(&order.prompt_ids, outcome.is_ok());
        outcome?;
    }
    Ok(())
}

/// The engine thread's state.
struct State {
    /// The other ranks that run each generation with this one (rank 0), if any.
    ranks: Option<Arc<Group>>,
    session: Session,
    drafter: Option<(Box<dyn DraftSource>, SpecOptions)>,
    /// Whether a request decoded alone drafts its next round; it carries what it learnt from
    /// one request to the next.
    gate: DraftGate,
    info: EngineInfo,
    prefix: PrefixCache,
    batching: batching::Batching,
}

/// How a job ended.
enum Ran {
    /// Finished: the summary still to be sent.
    Finished(Box<Summary>),
    /// The client went away or shutdown cancelled it (already told, if anyone listens).
    Aborted,
}

impl State {
    fn open(cfg: &EngineConfig) -> Result<Self> {
        let mut session = Session::open_traced(&cfg.dir, cfg.forks, cfg.startup.clone())?;
        if let Some(path) = &cfg.kv_config {
            session.model.use_kv_config(path)?;
        }
        let drafter = match &cfg.spec {
            Some(opts) => Some((
                open_source(opts, &session, cfg.forks, cfg.prefill_step_size)?,
                opts.clone(),
            )),
            None => None,
        };
        // A tapping drafter (DSpark) must see the target's hidden states of every prompt
        // position, so its requests prefill in full.
        let prefix_reuse = cfg.prefix_reuse
            && drafter
                .as_ref()
                .is_none_or(|(s, _)| s.tap_layers().is_empty());
        let mut info = EngineInfo {
            model_type: session.model.model_type.clone(),
            vocab_size: usize::try_from(session.model.model.vocab_size()).unwrap_or(0),
            drafter: drafter.as_ref().map(|(s, o)| {
                format!(
                    "{}, {} tokens/round, {:?} verification",
                    s.name(),
                    o.num_draft_tokens,
                    o.verify
                )
                .to_lowercase()
            }),
            backend: format!(
                "{} (MLX {})",
                runtime::backend().name(),
                runtime::mlx_version().unwrap_or_else(|_| "?".into())
            ),
            prefix_reuse,
            max_batch: 1,
            batch_note: None,
        };
        let ranks = distributed::world();
        if let Some(group) = &ranks {
            let split = match distributed::split() {
                distributed::Split::Tensor => "tensor parallel",
                distributed::Split::Pipeline => "pipeline parallel",
            };
            info.backend = format!("{}, {} ranks ({split})", info.backend, group.size());
        }
        // Every drafter drafts per slot of a batch.
        if ranks.is_some() && cfg.max_batch > 1 {
            info.batch_note =
                Some("requests decode one at a time across ranks (as mlx-lm's server)".into());
        } else if cfg.max_batch > 1 {
            match batching::batch_size(&session, cfg.max_batch, cfg.spec.as_ref()) {
                Ok(n) => info.max_batch = n,
                Err(why) => info.batch_note = Some(why),
            }
        }
        let kept = if prefix_reuse {
            cfg.prompt_cache_bytes
        } else {
            0
        };
        let mut batching = batching::Batching::new(info.max_batch, cfg.prefill_step_size, kept);
        batching.prompt_concurrency = cfg.prompt_concurrency;
        if let (Some(opts), Some((source, _)), true) = (&cfg.spec, &drafter, info.max_batch > 1) {
            // Each slot's drafter is forked from one of the single-stream drafter's.
            let template = source.fork()?.ok_or_else(|| {
                EngineError::Runtime(format!(
                    "the {} drafter cannot draft per slot",
                    source.name()
                ))
            })?;
            batching.drafting = Some(batching::SlotDrafting::new(
                &mut session,
                &batching,
                (opts, template),
                cfg.draft_policy,
            )?);
        }
        let mut state = Self {
            ranks,
            session,
            drafter,
            gate: DraftGate::new(cfg.draft_policy),
            info,
            prefix: PrefixCache::new(cfg.prefill_step_size, prefix_reuse),
            batching,
        };
        state.warm_up()?;
        Ok(state)
    }

    /// A few greedy tokens through the same path requests take: catches drafter settings
    /// that only fail once a generation starts, and compiles the samplers.
    fn warm_up(&mut self) -> Result<()> {
        let mut prompt = self.session.tokenizer.encode("Hello, world", true)?;
        if prompt.is_empty() {
            prompt.push(0);
        }
        let params = TextParams {
            sampler: Default::default(),
            processors: Default::default(),
            generate: GenerateConfig {
                max_tokens: 4,
                prefill_step_size: 2048,
            },
            seed: None,
        };
        let mut spec = self
            .drafter
            .as_mut()
            .map(|(source, opts)| Speculation::with_options(Box::new(&mut **source), opts));
        let speculator = spec.as_mut().map(|s| -> &mut dyn Speculator { s });
        generate_text(
            &mut self.session,
            &prompt,
            &params,
            speculator,
            None,
            |_| Ok(Flow::Continue),
        )?;
        Ok(())
    }

    /// Runs one job, turning failures (and panics) into an error event; the engine keeps
    /// serving whatever happens to one request.
    /// The metrics are settled before the last event goes out, so a client that reads
    /// `/metrics` after its response sees its request counted.
    fn serve(&mut self, job: Job, metrics: &Metrics, shutdown: &AtomicBool) {
        metrics.started(job.arrived.elapsed());
        let events = job.events.clone();
        let last = match catch_unwind(AssertUnwindSafe(|| self.run(job, metrics, shutdown))) {
            Ok(Ok(Ran::Finished(summary))) => Some(Event::Done(summary)),
            Ok(Ok(Ran::Aborted)) => {
                metrics.aborted();
                None
            }
            Ok(Err(err)) => {
                if self.ranks.is_some() {
                    // The other ranks may have stopped at another point of this generation.
                    distributed::mark_broken(format!(
                        "a generation failed across ranks ({err}); the ranks may be out of step, restart the job"
                    ));
                }
                metrics.failed();
                Some(Event::Error(match &err {
                    EngineError::Input(msg) => ApiError::bad_request(msg.clone()),
                    other => ApiError::internal(format!("generation failed: {other}")),
                }))
            }
            Err(_) => {
                // The caches may be half-written: the next request starts fresh.
                self.prefix.finish(&[], false);
                metrics.failed();
                Some(Event::Error(ApiError::internal(
                    "the engine failed on this request (internal panic); the server keeps serving",
                )))
            }
        };
        metrics.ended();
        if let Some(event) = last {
            let _ = events.send(event);
        }
    }

    fn run(&mut self, job: Job, metrics: &Metrics, shutdown: &AtomicBool) -> Result<Ran> {
        if job.events.is_closed() {
            return Ok(Ran::Aborted);
        }
        let cancelled = || {
            let _ = job.events.send(Event::Error(ApiError::shutting_down(
                "the server is shutting down; the request was cancelled",
            )));
            Ok(Ran::Aborted)
        };
        if shutdown.load(Ordering::Relaxed) {
            return cancelled();
        }
        if let Some(why) = self.ranks.as_ref().and(distributed::broken()) {
            return Err(EngineError::Runtime(why.to_owned()));
        }
        let req = &job.request;
        let gate = self.gate.clone();
        let mut spec = self.drafter.as_mut().and_then(|(source, opts)| {
            let k = req.num_draft_tokens.unwrap_or(opts.num_draft_tokens);
            (k > 0).then(|| {
                let mut spec = Speculation::new(Box::new(&mut **source), k, opts.verify);
                spec.gate = gate;
                spec
            })
        });
        let mut stopper = StopMatcher::new(req.stop.clone());
        let mut last_token: Option<Instant> = None;
        let mut gone = false;
        let send = |event: Event| job.events.send(event).is_ok();
        let params = match self.ranks.as_deref() {
            Some(group) => {
                let params = ranks::seeded(&req.params);
                ranks::send(
                    group,
                    &ranks::Order {
                        prompt_ids: job.prompt_ids.clone(),
                        params: params.clone(),
                    },
                )?;
                params
            }
            None => req.params.clone(),
        };
        let carry = self.prefix.prepare(&job.prompt_ids);
        let cached_tokens = carry.reused;
        let _wait = self.ranks.as_ref().map(|_| distributed::waiting());
        let outcome = generate_text(
            &mut self.session,
            &job.prompt_ids,
            &params,
            spec.as_mut().map(|s| -> &mut dyn Speculator { s }),
            Some(carry),
            ranks::leading(self.ranks.as_deref(), |event| {
                let (text, step) = match event {
                    TextEvent::Token { step, text } => (text, Some(step)),
                    TextEvent::Tail(text) => (text, None),
                };
                if step.is_some() {
                    let now = Instant::now();
                    match last_token {
                        None => metrics.first_token(now - job.arrived),
                        Some(t) => metrics.inter_token(now - t),
                    }
                    last_token = Some(now);
                }
                let released = stopper.push(text);
                let token = match (step, req.logprobs) {
                    (Some(step), Some(top)) => Some(score(step, top)?),
                    _ => None,
                };
                if !released.is_empty() || token.is_some() {
                    gone |= !send(Event::Delta {
                        text: released,
                        token,
                    });
                }
                gone |= job.events.is_closed();
                let stop = gone || stopper.stopped() || shutdown.load(Ordering::Relaxed);
                Ok(if stop { Flow::Stop } else { Flow::Continue })
            }),
        );
        self.prefix.finish(&job.prompt_ids, outcome.is_ok());
        let outcome = outcome?;
        if gone {
            return Ok(Ran::Aborted);
        }
        if !stopper.stopped() && shutdown.load(Ordering::Relaxed) {
            return cancelled();
        }
        let rest = stopper.finish();
        if !rest.is_empty() {
            send(Event::Delta {
                text: rest,
                token: None,
            });
        }
        let finish_reason = if stopper.stopped() {
            "stop"
        } else {
            outcome.finish_reason.as_str()
        };
        let stats = &outcome.stats;
        let drafted = spec.map(|s| {
            self.gate = s.gate;
            s.metrics
        });
        metrics.finished(&Finished {
            finish_reason,
            prompt_tokens: stats.prompt_tokens,
            cached_tokens,
            generation_tokens: outcome.token_ids.len(),
            latency: job.arrived.elapsed(),
            decode_tps: stats.generation_tps(),
            spec: drafted.as_ref(),
        });
        Ok(Ran::Finished(Box::new(Summary {
            finish_reason,
            usage: Usage::new(stats.prompt_tokens, cached_tokens, outcome.token_ids.len()),
            timings: Timings::new(stats, drafted.as_ref()),
            token_ids: outcome.token_ids,
            stop_sequence: stopper.matched().map(str::to_owned),
        })))
    }
}

/// The generated token's logprob and the `top` most likely tokens at its position.
pub(super) fn score(step: &Step, top: usize) -> Result<TokenScore> {
    let lp = step.logprobs.as_dtype(Dtype::Float32)?;
    let values = lp
        .try_as_slice::<f32>()
        .map_err(|e| EngineError::Runtime(format!("reading logprobs: {e:?}")))?;
    let logprob = values
        .get(step.token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    let top = top.min(values.len());
    let mut ids: Vec<u32> = (0..values.len() as u32).collect();
    let by_value = |a: &u32, b: &u32| values[*b as usize].total_cmp(&values[*a as usize]);
    if top > 0 {
        ids.select_nth_unstable_by(top - 1, by_value);
        ids.truncate(top);
        ids.sort_by(by_value);
    } else {
        ids.clear();
    }
    Ok(TokenScore {
        id: step.token,
        logprob,
        top: ids.into_iter().map(|i| (i, values[i as usize])).collect(),
    })
}
