//! Continuous batching on the engine thread (`mlxb serve --max-batch N`, N > 1): requests join
//! the engine's [`BatchGenerator`] as they arrive (up to N decoding at once), are prefilled
//! between decode steps, and leave when they finish, stop, or their client goes away; every
//! step's tokens are routed to their requests' streams. Requests the batch cannot serve exactly
//! (logits processors, a fixed seed) wait for the batch to drain and then run alone through
//! the single-stream path, as does everything when the server's drafter cannot draft per slot.
//! With an n-gram drafter every request drafts for itself ([`SlotDrafters`]) and each decoding
//! step verifies all their blocks in one forward. Prompts the batch prefilled alone are kept in
//! a [`PrefixStore`] for later requests that share their start.

use super::error::ApiError;
use super::metrics::{Finished, Metrics};
use super::prefix_store::PrefixStore;
use super::stop::StopMatcher;
use super::types::{Timings, Usage};
use super::worker::{score, Event, Job, Summary};
use crate::engine::batch::{BatchGenerator, BatchSettings, BatchToken, PrefixKv, SequenceRequest};
use crate::engine::error::{EngineError, Result};
use crate::engine::generate::{GenerationStats, Step};
use crate::engine::sample::{LogitsProcessors, Sampler, SamplerConfig};
use crate::engine::session::Session;
use crate::engine::text::FinishReason;
use crate::engine::tokenizer::{StreamingDetokenizer, Tokenizer};
use crate::spec::factory::SpecOptions;
use crate::spec::metrics::SpecMetrics;
use crate::spec::policy::{DraftLengthPolicy, DraftPolicy};
use crate::spec::slots::SlotDrafters;
use crate::spec::source::DraftSource;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

/// One request in the batch.
struct Slot<'t> {
    job: Job,
    detok: StreamingDetokenizer<'t>,
    stopper: StopMatcher,
    ids: Vec<u32>,
    /// Prompt tokens reused from a kept prefix.
    cached: usize,
    admitted: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
}

/// Whether `job` can decode in a batch with the same tokens it would get alone (greedy or
/// sampled without a seed, no logits processors); `Some(sampler)` when it can (`None` inside:
/// the batch's shared greedy sampler).
fn batch_sampler(job: &Job, tokenizer: &Tokenizer) -> Result<Option<Option<Sampler>>> {
    let params = &job.request.params;
    if params.seed.is_some() || !LogitsProcessors::new(&params.processors)?.is_empty() {
        return Ok(None);
    }
    if params.sampler.temp == 0.0 {
        return Ok(Some(None));
    }
    let mut specials = tokenizer.encode("\n", false)?;
    specials.extend(tokenizer.eos_token_ids());
    let sampler = Sampler::new(&SamplerConfig {
        xtc_special_tokens: specials,
        ..params.sampler.clone()
    })?;
    Ok(Some(Some(sampler)))
}

/// Whether the engine serves requests in batches: more than one slot asked for and a model
/// whose caches batch. `Err` carries why not, for the ready card.
/// `drafting`: the drafter every slot drafts with, if any.
pub fn batch_size(
    session: &Session,
    max_batch: usize,
    drafting: Option<&SpecOptions>,
) -> std::result::Result<usize, String> {
    if max_batch <= 1 {
        return Ok(1);
    }
    let batching = Batching::new(max_batch, BatchSettings::default().prefill_step_size, 0);
    new_generator_for(&session.model, &session.tokenizer, &batching)
        .and_then(|gen| match drafting {
            Some(_) => gen.speculative(session.model.model.as_ref()),
            None => Ok(gen),
        })
        .map(|_| max_batch)
        .map_err(|e| e.to_string())
}

/// How the server batches, and the prompt prefixes it keeps between batches.
pub struct Batching {
    /// Most requests decoded at once (`--max-batch`).
    pub max_batch: usize,
    /// Most prompts prefilled together (`--prompt-concurrency`; 1 keeps every prompt for reuse).
    pub prompt_concurrency: usize,
    /// Prompt tokens per prefill forward (`--prefill-step-size`).
    pub prefill_step_size: usize,
    /// Prompt prefixes kept for reuse (`--prompt-cache-bytes`; see [`PrefixStore`]).
    pub store: PrefixStore,
    /// The drafter every request drafts with for itself, when it can draft per slot.
    pub drafting: Option<SlotDrafting>,
}

/// Drafting per slot: the drafter's options, and the slots' drafters with the policy that
/// sizes each step's blocks, kept from one batch to the next (the step costs learnt and the
/// drafters forked stay).
pub struct SlotDrafting {
    /// The drafter every request drafts with for itself.
    pub opts: SpecOptions,
    /// Taken while a batch runs.
    drafters: Option<SlotDrafters>,
}

impl SlotDrafting {
    /// Drafting with `opts`, each slot's drafter forked from `template`, sized by `policy`:
    /// for [`DraftPolicy::Cost`], this machine's batched forward costs (up to
    /// `batching.max_batch` rows × `num_draft_tokens + 1` tokens) measured on the session's
    /// model.
    pub fn new(
        session: &mut Session,
        batching: &Batching,
        (opts, template): (&SpecOptions, Box<dyn DraftSource>),
        policy: DraftPolicy,
    ) -> Result<Self> {
        let gen = new_generator_for(&session.model, &session.tokenizer, batching)?;
        let policy = DraftLengthPolicy::for_batch(
            policy,
            &gen,
            session.model.model.as_mut(),
            batching.max_batch,
            opts.num_draft_tokens + 1,
        )?;
        Ok(Self {
            opts: opts.clone(),
            drafters: Some(SlotDrafters::new(opts, policy, template)),
        })
    }
}

impl Batching {
    /// Batches of at most `max_batch`, prefilled `prefill_step_size` tokens at a time, keeping
    /// at most `prompt_cache_bytes` of prompt prefixes.
    pub fn new(max_batch: usize, prefill_step_size: usize, prompt_cache_bytes: usize) -> Self {
        Self {
            max_batch,
            prompt_concurrency: BatchSettings::default().prefill_batch_size,
            prefill_step_size,
            store: PrefixStore::new(prompt_cache_bytes, prefill_step_size),
            drafting: None,
        }
    }
}

/// Whether `job` runs in the batch (else alone, once the batch has drained).
pub fn fits_batch(job: &Job, tokenizer: &Tokenizer) -> bool {
    // A request whose settings cannot even build a sampler fails inside the batch loop.
    batch_sampler(job, tokenizer).map_or(true, |s| s.is_some())
}

/// Serves `first` and whatever else arrives on `jobs` in batches of at most `max_batch` until
/// nothing is left running; returns the job that must run alone, if one arrived meanwhile
/// (taken off the queue in its turn, it runs before anything queued behind it).
pub fn run(
    session: &mut Session,
    batching: &mut Batching,
    first: Job,
    jobs: &Receiver<Job>,
    metrics: &Metrics,
    shutdown: &AtomicBool,
) -> Option<Job> {
    let mut drafters = batching.drafting.as_mut().and_then(|d| d.drafters.take());
    let deferred = serve_batch(
        session,
        batching,
        &mut drafters,
        first,
        jobs,
        metrics,
        shutdown,
    );
    // The step costs learnt while this batch ran, and the drafters, stay for the next one.
    if let (Some(mut d), Some(drafting)) = (drafters, batching.drafting.as_mut()) {
        d.end_batch();
        drafting.drafters = Some(d);
    }
    deferred
}

/// [`run`] with the slots' drafters (when requests draft for themselves).
fn serve_batch(
    session: &mut Session,
    batching: &mut Batching,
    drafters: &mut Option<SlotDrafters>,
    first: Job,
    jobs: &Receiver<Job>,
    metrics: &Metrics,
    shutdown: &AtomicBool,
) -> Option<Job> {
    let max_batch = batching.max_batch;
    let gen = match new_generator_for(&session.model, &session.tokenizer, batching) {
        Ok(gen) => gen,
        Err(e) => {
            metrics.started(first.arrived.elapsed());
            fail(first, metrics, &e);
            return None;
        }
    };
    // Drafters that read the target's hidden states (DSpark) are handed each row's; the
    // worker keeps no prefixes for them (a kept prefix has no tapped outputs).
    let taps = drafters
        .as_ref()
        .map_or(Vec::new(), SlotDrafters::tap_layers);
    // The assistant also reads each row's keys and values at its donor layers.
    let lent = drafters
        .as_ref()
        .map_or(Vec::new(), SlotDrafters::kv_layers);
    let mut gen = gen.tapping(taps).lending_kv(lent);
    let Session {
        model, tokenizer, ..
    } = session;
    let tokenizer: &Tokenizer = tokenizer;
    let mut slots: HashMap<usize, Slot<'_>> = HashMap::new();
    let mut next = Some(first);
    let mut deferred = None;
    loop {
        // Admission: jobs join while there is room, in queue order; one that must run alone
        // ends admission until the batch has drained.
        while deferred.is_none() && slots.len() < max_batch {
            let job = match next.take() {
                Some(job) => job,
                None => match jobs.try_recv() {
                    Ok(job) => job,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                },
            };
            match batch_sampler(&job, tokenizer) {
                Ok(Some(sampler)) => {
                    let prefix = batching.store.lookup(&job.prompt_ids);
                    let admission = Admission {
                        job,
                        sampler,
                        prefix,
                    };
                    let joined = admit(&mut gen, &mut slots, admission, tokenizer, metrics);
                    if let (Some(uid), Some(d)) = (joined, drafters.as_mut()) {
                        if let Err(e) = join_drafter(d, &slots, uid, batching, model) {
                            gen.remove(&[uid]).ok();
                            if let Some(slot) = slots.remove(&uid) {
                                fail(slot.job, metrics, &e);
                            }
                        }
                    }
                }
                Ok(None) => deferred = Some(job),
                Err(e) => {
                    metrics.started(job.arrived.elapsed());
                    fail(job, metrics, &e);
                }
            }
        }
        if slots.is_empty() {
            return deferred;
        }
        let stepped = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<BatchToken>> {
            let Some(d) = drafters.as_mut() else {
                return gen.next_tokens(model.model.as_mut());
            };
            let tokens = d.step(&mut gen, model.model.as_mut())?;
            if let Some(width) = d.step_width() {
                metrics.block_width(width);
            }
            Ok(tokens)
        }));
        let tokens = match stepped {
            Ok(Ok(tokens)) => tokens,
            Ok(Err(e)) => {
                fail_all(&mut slots, metrics, &e);
                gen = match new_generator_for(model, tokenizer, batching) {
                    Ok(g) => g,
                    Err(_) => return deferred,
                };
                continue;
            }
            Err(_) => {
                let e = EngineError::Runtime(
                    "the engine failed on this batch (internal panic); the server keeps serving"
                        .into(),
                );
                fail_all(&mut slots, metrics, &e);
                gen = match new_generator_for(model, tokenizer, batching) {
                    Ok(g) => g,
                    Err(_) => return deferred,
                };
                continue;
            }
        };
        let kept = gen.take_prefixes();
        if !kept.is_empty() {
            for (uid, prefix) in kept {
                if let Some(slot) = slots.get(&uid) {
                    batching.store.insert(&slot.job.prompt_ids, prefix);
                }
            }
            metrics.prompt_cache(batching.store.bytes());
        }
        let mut leaving = Vec::new();
        for token in tokens {
            let uid = token.uid;
            let Some(slot) = slots.get_mut(&uid) else {
                continue;
            };
            if let Some(done) = deliver(slot, &token, metrics, shutdown) {
                if token.finish.is_none() {
                    leaving.push(uid);
                }
                let spec = drafters.as_mut().and_then(|d| d.leave(uid));
                if let Some(slot) = slots.remove(&uid) {
                    conclude(slot, done, metrics, spec.as_ref());
                }
            }
        }
        if !leaving.is_empty() {
            if let Err(e) = gen.remove(&leaving) {
                fail_all(&mut slots, metrics, &e);
                gen = match new_generator_for(model, tokenizer, batching) {
                    Ok(g) => g,
                    Err(_) => return deferred,
                };
            }
        }
    }
}

/// [`new_generator`] from the session's parts (the loop holds them borrowed separately).
fn new_generator_for(
    model: &crate::engine::models::LoadedModel,
    tokenizer: &Tokenizer,
    batching: &Batching,
) -> Result<BatchGenerator> {
    let max_batch = batching.max_batch;
    let settings = BatchSettings {
        completion_batch_size: max_batch,
        prefill_batch_size: max_batch.min(batching.prompt_concurrency).max(1),
        prefill_step_size: batching.prefill_step_size.max(1),
    };
    let gen = BatchGenerator::new(
        model.model.as_ref(),
        &model.plan,
        Sampler::new(&SamplerConfig::default())?,
        tokenizer.eos_token_ids().iter().copied().collect(),
        settings,
    )?;
    let gen = if batching.store.enabled() {
        gen.capture_prefixes()
    } else {
        gen
    };
    match batching.drafting {
        Some(_) => gen.speculative(model.model.as_ref()),
        None => Ok(gen),
    }
}

/// A job the batch takes: its sampler (`None`: the batch's greedy one) and the kept prefix it
/// starts from.
struct Admission {
    job: Job,
    sampler: Option<Sampler>,
    prefix: Option<PrefixKv>,
}

/// Starts slot `uid`'s drafter: its request's `num_draft_tokens` (else the server's) per step.
fn join_drafter(
    drafters: &mut SlotDrafters,
    slots: &HashMap<usize, Slot<'_>>,
    uid: usize,
    batching: &Batching,
    model: &mut crate::engine::models::LoadedModel,
) -> Result<()> {
    let (Some(slot), Some(drafting)) = (slots.get(&uid), batching.drafting.as_ref()) else {
        return Ok(());
    };
    let opts = &drafting.opts;
    let req = &slot.job.request;
    let limit = req.num_draft_tokens.unwrap_or(opts.num_draft_tokens);
    if limit == 0 {
        // Speculation turned off for this request: it decodes as without a drafter.
        return Ok(());
    }
    let temp = req.params.sampler.temp;
    drafters.join(
        uid,
        &slot.job.prompt_ids,
        (temp, limit),
        model.model.as_mut(),
    )
}

/// Puts a job in the batch; its sequence id when it joined.
fn admit<'t>(
    gen: &mut BatchGenerator,
    slots: &mut HashMap<usize, Slot<'t>>,
    admission: Admission,
    tokenizer: &'t Tokenizer,
    metrics: &Metrics,
) -> Option<usize> {
    let Admission {
        job,
        sampler,
        prefix,
    } = admission;
    metrics.started(job.arrived.elapsed());
    if job.events.is_closed() {
        metrics.aborted();
        metrics.ended();
        return None;
    }
    let cached = prefix.as_ref().map_or(0, |p| p.len);
    let request = SequenceRequest {
        prompt: job.prompt_ids.clone(),
        max_tokens: job.request.params.generate.max_tokens,
        sampler,
        prefix,
    };
    match gen.insert(vec![request]) {
        Ok(uids) => {
            let stopper = StopMatcher::new(job.request.stop.clone());
            slots.insert(
                uids[0],
                Slot {
                    job,
                    detok: StreamingDetokenizer::new(tokenizer),
                    stopper,
                    ids: Vec::new(),
                    cached,
                    admitted: Instant::now(),
                    first: None,
                    last: None,
                },
            );
            Some(uids[0])
        }
        Err(e) => {
            fail(job, metrics, &e);
            None
        }
    }
}

/// How a request left the batch.
enum Done {
    /// It finished: `stop` or `length`.
    Finished(&'static str),
    /// Its client went away.
    Gone,
    /// The server is shutting down.
    Cancelled,
}

/// Hands one token to its request's stream; says whether the request is done.
fn deliver(
    slot: &mut Slot<'_>,
    token: &BatchToken,
    metrics: &Metrics,
    shutdown: &AtomicBool,
) -> Option<Done> {
    let now = Instant::now();
    match slot.last {
        None => {
            metrics.first_token(now - slot.job.arrived);
            slot.first = Some(now);
        }
        Some(t) => metrics.inter_token(now - t),
    }
    slot.last = Some(now);
    slot.ids.push(token.token);
    if token.finish == Some(FinishReason::Eos) {
        return Some(Done::Finished("stop"));
    }
    slot.detok.add_token(token.token);
    let released = slot.stopper.push(&slot.detok.last_segment());
    let req = &slot.job.request;
    let score = match req.logprobs {
        Some(top) => {
            let step = Step {
                index: slot.ids.len() - 1,
                token: token.token,
                logprobs: token.logprobs.clone(),
            };
            score(&step, top).ok()
        }
        None => None,
    };
    if (!released.is_empty() || score.is_some())
        && slot
            .job
            .events
            .send(Event::Delta {
                text: released,
                token: score,
            })
            .is_err()
    {
        return Some(Done::Gone);
    }
    if slot.job.events.is_closed() {
        return Some(Done::Gone);
    }
    if slot.stopper.stopped() {
        return Some(Done::Finished("stop"));
    }
    if shutdown.load(Ordering::Relaxed) {
        return Some(Done::Cancelled);
    }
    token.finish.map(|reason| Done::Finished(reason.as_str()))
}

/// Sends a finished request's tail and summary, and settles its metrics (`spec`: its drafter's
/// counters).
fn conclude(mut slot: Slot<'_>, done: Done, metrics: &Metrics, spec: Option<&SpecMetrics>) {
    let finish_reason = match done {
        Done::Gone => {
            metrics.aborted();
            metrics.ended();
            return;
        }
        Done::Cancelled => {
            metrics.aborted();
            metrics.ended();
            let _ = slot.job.events.send(Event::Error(ApiError::shutting_down(
                "the server is shutting down; the request was cancelled",
            )));
            return;
        }
        Done::Finished(reason) => reason,
    };
    if !slot.stopper.stopped() {
        slot.detok.finalize();
        let tail = slot.stopper.push(&slot.detok.last_segment());
        let rest = tail + &slot.stopper.finish();
        if !rest.is_empty() {
            let _ = slot.job.events.send(Event::Delta {
                text: rest,
                token: None,
            });
        }
    }
    let finish_reason = if slot.stopper.stopped() {
        "stop"
    } else {
        finish_reason
    };
    let (first, last) = (
        slot.first.unwrap_or(slot.admitted),
        slot.last.unwrap_or(slot.admitted),
    );
    let stats = GenerationStats {
        prompt_tokens: slot.job.prompt_ids.len(),
        prompt_time: first - slot.admitted,
        generation_tokens: slot.ids.len(),
        generation_time: last - first,
        peak_memory: 0,
    };
    metrics.finished(&Finished {
        finish_reason,
        prompt_tokens: stats.prompt_tokens,
        cached_tokens: slot.cached,
        generation_tokens: slot.ids.len(),
        latency: slot.job.arrived.elapsed(),
        decode_tps: stats.generation_tps(),
        spec,
    });
    metrics.ended();
    let _ = slot.job.events.send(Event::Done(Box::new(Summary {
        finish_reason,
        usage: Usage::new(stats.prompt_tokens, slot.cached, slot.ids.len()),
        timings: Timings::new(&stats, spec),
        stop_sequence: slot.stopper.matched().map(str::to_owned),
        token_ids: slot.ids,
    })));
}

/// Answers `job` with `err` (it was counted as started).
fn fail(job: Job, metrics: &Metrics, err: &EngineError) {
    metrics.failed();
    metrics.ended();
    let _ = job.events.send(Event::Error(match err {
        EngineError::Input(msg) => ApiError::bad_request(msg.clone()),
        other => ApiError::internal(format!("generation failed: {other}")),
    }));
}

/// Fails every request in the batch (after an engine error, the batch is rebuilt empty).
fn fail_all(slots: &mut HashMap<usize, Slot<'_>>, metrics: &Metrics, err: &EngineError) {
    for (_, slot) in slots.drain() {
        fail(slot.job, metrics, err);
    }
}
