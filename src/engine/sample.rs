//! Samplers and logits processors with mlx-lm 0.32.2 semantics (`mlx_lm/sample_utils.py`).
//!
//! Every step issues the same MLX ops with the same dtypes as mlx-lm, keeps its compile
//! boundaries (each sampler filter and the categorical draw is its own non-shapeless
//! compiled function that threads the random state), and splits the random key exactly as
//! Python's global key does, so a seeded run draws bit-identical tokens.
//!
//! User-supplied scalars are `f64`, like Python floats: mlx-lm folds `1.0 / temp` and
//! `math.log(min_p)` in double precision before rounding to f32, and doing that arithmetic
//! on an f32 copy of the flag gives different bits for common values (temp 1.1, min_p 0.9).

use std::cell::RefCell;

use half::{bf16, f16};
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{
    argmax_axis, Ellipsis, IndexUpdateError, TryIndexMutOp, TryIndexOp, TryIndexUpdateOp,
    UpdateMode,
};
use mlx_rs::ops::{self, argpartition_axis, sort_axis};
use mlx_rs::random::{self, RandomState};
use mlx_rs::transforms::compile::compile_with_state;
use mlx_rs::{Array, Dtype};

use super::error::{EngineError, Result};
use super::logprobs::host_argmax;

type MlxResult<T> = std::result::Result<T, Exception>;

/// A compiled sampler stage: `f(random_state, logprobs) -> logprobs' or tokens`.
type Stage = Box<dyn for<'a> FnMut(&mut RandomState, &'a Array) -> MlxResult<Array>>;

thread_local! {
    /// The key all samplers draw from: the equivalent of Python's `mx.random.state`. mlx-rs
    /// keeps its own default state private, and `compile_with_state` needs a `&mut`, so the
    /// samplers share this one (per thread, like mlx-rs's) and [`seed`] seeds both.
    static SAMPLER_RNG: RefCell<Option<RandomState>> = const { RefCell::new(None) };
}

/// Seeds the random state the samplers draw from, as `mx.random.seed(seed)` does in mlx-lm,
/// so a seeded run reproduces Python's tokens. Also seeds mlx-rs's own default state, which
/// un-keyed `mlx_rs::random` calls use. Both states are per thread.
pub fn seed(seed: u64) -> Result<()> {
    random::seed(seed)?;
    let state = RandomState::with_seed(seed)?;
    SAMPLER_RNG.with_borrow_mut(|slot| *slot = Some(state));
    Ok(())
}

/// Runs `f` on the shared sampler state, creating a clock-seeded one if nobody seeded it
/// (Python likewise seeds its global key from the clock at import).
fn with_rng<T>(f: impl FnOnce(&mut RandomState) -> Result<T>) -> Result<T> {
    SAMPLER_RNG.with_borrow_mut(|slot| {
        let state = match slot {
            Some(state) => state,
            None => slot.insert(RandomState::new()?),
        };
        f(state)
    })
}

/// A Python scalar operand as MLX sees it ("weak" type): the f64 rounded to f32, then to
/// `dtype`, built directly as a constant of that dtype (`array(float(v), dtype)`).
fn weak(v: f64, dtype: Dtype) -> MlxResult<Array> {
    let v = v as f32;
    match dtype {
        Dtype::Float32 => Ok(Array::from_f32(v)),
        Dtype::Bfloat16 => Ok(Array::from_slice(&[bf16::from_f32(v)], &[])),
        Dtype::Float16 => Ok(Array::from_slice(&[f16::from_f32(v)], &[])),
        other => Array::from_f32(v).as_dtype(other),
    }
}

/// Wraps `f` as mlx-lm's `@partial(mx.compile, inputs=mx.random.state,
/// outputs=mx.random.state)` does: compiled once, not shapeless, random state threaded.
fn compiled<F>(f: F) -> Stage
where
    F: FnMut(&mut RandomState, &Array) -> MlxResult<Array> + 'static,
{
    let mut c = compile_with_state::<F, RandomState, &'static Array, Array, Exception>(f, false);
    Box::new(move |state, x| c(state, x))
}

/// `sample_utils.apply_top_p`: drop the least likely tokens whose total mass is `1 - top_p`.
fn top_p_stage(top_p: f64) -> Stage {
    compiled(move |_: &mut RandomState, logprobs: &Array| {
        let sorted = sort_axis(logprobs, -1)?;
        let probs = sorted.as_dtype(Dtype::Float32)?.exp()?;
        let mass_above = probs.cumsum(-1, true, false)?;
        let total = mass_above
            .try_index((Ellipsis, ..1))?
            .add(probs.try_index((Ellipsis, ..1))?)?;
        let limit = total.multiply(weak(top_p, total.dtype())?)?;
        let num_dropped = mass_above.ge(&limit)?.sum_axis(-1, true)?;
        let threshold = sorted.take_along_axis(&num_dropped, -1)?;
        ops::select(
            logprobs.lt(&threshold)?,
            weak(f64::NEG_INFINITY, logprobs.dtype())?,
            logprobs,
        )
    })
}

/// `sample_utils.apply_min_p`: drop tokens below `min_p` times the top probability, keeping
/// at least `keep` tokens.
fn min_p_stage(min_p: f64, keep: i32) -> Stage {
    let log_min_p = min_p.ln();
    compiled(move |_: &mut RandomState, logprobs: &Array| {
        let top = logprobs.max_axis(-1, true)?;
        let scaled_min_p = top.add(weak(log_min_p, top.dtype())?)?;
        let mut remove = logprobs.lt(&scaled_min_p)?;
        if keep > 1 {
            let top_indices =
                argpartition_axis(logprobs, -keep, -1)?.try_index((Ellipsis, -keep..))?;
            remove = remove.put_along_axis(&top_indices, Array::from_bool(false), -1)?;
        }
        ops::select(
            &remove,
            weak(f64::NEG_INFINITY, logprobs.dtype())?,
            logprobs,
        )
    })
}

/// `sample_utils.apply_xtc`: with probability `probability`, exclude every token above
/// `threshold` except the least likely of them (and except the special tokens).
fn xtc_stage(probability: f64, threshold: f64, special: Vec<i32>) -> Stage {
    let special = (!special.is_empty()).then(|| {
        let n = special.len() as i32;
        Array::from_slice(&special, &[n])
    });
    compiled(move |state: &mut RandomState, logits: &Array| {
        let probs = ops::softmax_axis(logits, -1, false)?;
        let dt = probs.dtype();
        let above = probs.gt(weak(threshold, dt)?)?;
        let smallest_above =
            ops::select(&above, &probs, weak(f64::INFINITY, dt)?)?.min_axis(-1, true)?;
        let mut mask = probs.gt(&smallest_above)?;
        if let Some(special) = &special {
            mask.try_index_mut((Ellipsis, special), Array::from_bool(false))?;
        }
        let key = state.next_key()?;
        let draw = random::uniform::<_, f32>(0, 1, None, &key)?;
        let skip = draw.gt(weak(probability, draw.dtype())?)?;
        let excluded = ops::select(&mask, weak(f64::NEG_INFINITY, logits.dtype())?, logits)?;
        ops::select(&skip, logits, &excluded)
    })
}

/// `sample_utils.apply_top_k`: keep the `top_k` most likely tokens.
fn top_k_stage(top_k: i32) -> Stage {
    compiled(move |_: &mut RandomState, logprobs: &Array| {
        let mask_idx = argpartition_axis(logprobs.negative()?, top_k - 1, -1)?
            .try_index((Ellipsis, top_k..))?;
        logprobs.put_along_axis(&mask_idx, weak(f64::NEG_INFINITY, logprobs.dtype())?, -1)
    })
}

/// `sample_utils.categorical_sampling`: one draw from `softmax(logits / temp)`.
fn categorical_stage(temp: f64) -> Stage {
    let inv_temp = 1.0 / temp;
    compiled(move |state: &mut RandomState, logits: &Array| {
        let scaled = logits.multiply(weak(inv_temp, logits.dtype())?)?;
        let key = state.next_key()?;
        random::categorical(&scaled, -1, None, &key)
    })
}

/// Sampling settings, as the arguments of mlx-lm's `make_sampler` (same defaults).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplerConfig {
    /// Temperature; 0 means greedy argmax.
    pub temp: f64,
    /// Nucleus sampling mass; only applied when strictly between 0 and 1.
    pub top_p: f64,
    /// Minimum probability relative to the top token; 0 disables it.
    pub min_p: f64,
    /// Tokens min-p sampling always keeps.
    pub min_tokens_to_keep: usize,
    /// Keep only this many most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Probability of applying XTC at a step; 0 disables it.
    pub xtc_probability: f64,
    /// Probability a token needs to be excluded by XTC.
    pub xtc_threshold: f64,
    /// Token ids XTC never excludes (mlx-lm passes "\n" and the EOS ids).
    pub xtc_special_tokens: Vec<u32>,
}

impl Default for SamplerConfig {
    /// The defaults of `make_sampler`: greedy.
    fn default() -> Self {
        Self {
            temp: 0.0,
            top_p: 0.0,
            min_p: 0.0,
            min_tokens_to_keep: 1,
            top_k: 0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            xtc_special_tokens: Vec::new(),
        }
    }
}

/// Fails with an input error unless `lo <= v <= hi` (so NaN fails too).
fn check_range(flag: &str, v: f64, lo: f64, hi: f64) -> Result<()> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(EngineError::Input(format!(
            "`{flag}` must be between {lo} and {hi}, got {v}."
        )))
    }
}

/// Converts a token id to the int32 MLX uses for Python int lists.
fn token_i32(flag: &str, id: u32) -> Result<i32> {
    i32::try_from(id).map_err(|_| {
        EngineError::Input(format!(
            "`{flag}` token id {id} is too large (must be below 2^31)."
        ))
    })
}

enum SamplerKind {
    Greedy,
    Chain {
        filters: Vec<Stage>,
        top_k: Option<usize>,
        categorical: Stage,
    },
}

/// mlx-lm's `make_sampler` result: turns `[1, vocab]` log-probabilities into a token id.
/// Build it once per generation; its compiled stages are reused across steps.
pub struct Sampler {
    kind: SamplerKind,
    /// The temperature it samples at (0 = greedy).
    temp: f64,
}

impl Sampler {
    /// Validates `cfg` and builds the sampler chain mlx-lm would: greedy when `temp == 0`,
    /// else top-p → min-p → XTC → top-k (each only when enabled) → categorical.
    pub fn new(cfg: &SamplerConfig) -> Result<Self> {
        if !(cfg.temp >= 0.0 && cfg.temp.is_finite()) {
            return Err(EngineError::Input(format!(
                "`--temp` must be a finite number >= 0, got {}.",
                cfg.temp
            )));
        }
        check_range("--top-p", cfg.top_p, 0.0, 1.0)?;
        check_range("--min-p", cfg.min_p, 0.0, 1.0)?;
        check_range("--xtc-probability", cfg.xtc_probability, 0.0, 1.0)?;
        check_range("--xtc-threshold", cfg.xtc_threshold, 0.0, 0.5)?;
        if cfg.min_p != 0.0 && cfg.min_tokens_to_keep < 1 {
            return Err(EngineError::Input(
                "`--min-tokens-to-keep` must be at least 1.".to_string(),
            ));
        }
        let top_k = match cfg.top_k {
            0 => None,
            k if i32::try_from(k).is_ok() => Some(k),
            k => {
                return Err(EngineError::Input(format!(
                    "`--top-k` must be below the vocabulary size, got {k}."
                )))
            }
        };
        let special = cfg
            .xtc_special_tokens
            .iter()
            .map(|&t| token_i32("--xtc-special-tokens", t))
            .collect::<Result<Vec<_>>>()?;
        let keep = i32::try_from(cfg.min_tokens_to_keep).map_err(|_| {
            EngineError::Input(format!(
                "`--min-tokens-to-keep` is too large, got {}.",
                cfg.min_tokens_to_keep
            ))
        })?;

        if cfg.temp == 0.0 {
            return Ok(Self {
                kind: SamplerKind::Greedy,
                temp: 0.0,
            });
        }
        let mut filters = Vec::new();
        if 0.0 < cfg.top_p && cfg.top_p < 1.0 {
            filters.push(top_p_stage(cfg.top_p));
        }
        if cfg.min_p != 0.0 {
            filters.push(min_p_stage(cfg.min_p, keep));
        }
        if cfg.xtc_probability > 0.0 {
            filters.push(xtc_stage(cfg.xtc_probability, cfg.xtc_threshold, special));
        }
        if let Some(k) = top_k {
            filters.push(top_k_stage(k as i32));
        }
        Ok(Self {
            kind: SamplerKind::Chain {
                filters,
                top_k,
                categorical: categorical_stage(cfg.temp),
            },
            temp: cfg.temp,
        })
    }

    /// Whether this sampler is plain argmax (it then draws no random numbers).
    pub fn is_greedy(&self) -> bool {
        matches!(self.kind, SamplerKind::Greedy)
    }

    /// The temperature it samples at (0 = greedy): rejection sampling needs the target
    /// distribution it draws from.
    pub fn temp(&self) -> f64 {
        self.temp
    }

    /// Samples from `logprobs` (`[1, vocab]`, the model dtype), returning the lazy uint32
    /// token array of shape `[1]` exactly as mlx-lm's sampler does; non-greedy sampling
    /// advances the shared random state.
    pub fn sample(&mut self, logprobs: &Array) -> Result<Array> {
        match &mut self.kind {
            // Logprobs the host computed are picked from there (no MLX operation to wait on).
            SamplerKind::Greedy => match host_argmax(logprobs) {
                Some(t) => Ok(Array::from_slice(&[t], &[1])),
                None => Ok(argmax_axis(logprobs, -1, false)?),
            },
            SamplerKind::Chain {
                filters,
                top_k,
                categorical,
            } => {
                check_top_k(*top_k, logprobs)?;
                with_rng(|state| {
                    let x = run_filters(filters, state, logprobs)?;
                    Ok(categorical(state, &x)?)
                })
            }
        }
    }

    /// Runs only the filter chain (top-p, min-p, XTC, top-k) and returns the masked
    /// log-probabilities the categorical draw would see, so tests and diagnostics can
    /// compare them bit for bit with mlx-lm's. XTC advances the shared random state; a
    /// greedy sampler returns `logprobs` unchanged.
    pub fn filter(&mut self, logprobs: &Array) -> Result<Array> {
        match &mut self.kind {
            SamplerKind::Greedy => Ok(logprobs.clone()),
            SamplerKind::Chain { filters, top_k, .. } => {
                check_top_k(*top_k, logprobs)?;
                with_rng(|state| run_filters(filters, state, logprobs))
            }
        }
    }
}

/// mlx-lm's `0 < top_k < vocab_size` check, which it makes when sampling.
fn check_top_k(top_k: Option<usize>, logprobs: &Array) -> Result<()> {
    if let Some(k) = top_k {
        let vocab = logprobs.shape().last().copied().unwrap_or(0);
        if k as i64 >= i64::from(vocab) {
            return Err(EngineError::Input(format!(
                "`--top-k` must be below the vocabulary size {vocab}, got {k}."
            )));
        }
    }
    Ok(())
}

/// Applies the compiled filters in order, as `sampler()` in `make_sampler` does.
fn run_filters(filters: &mut [Stage], state: &mut RandomState, logprobs: &Array) -> Result<Array> {
    let mut x = logprobs.clone();
    for filter in filters.iter_mut() {
        x = filter(state, &x)?;
    }
    Ok(x)
}

/// Logits-processor settings, as the arguments of mlx-lm's `make_logits_processors`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProcessorConfig {
    /// Additive bias per token id; a repeated id keeps its last value, as a Python dict.
    pub logit_bias: Vec<(u32, f64)>,
    /// Sign-aware multiplicative penalty for recent tokens; `None` or 0 disables it.
    pub repetition_penalty: Option<f64>,
    /// How many recent tokens the repetition penalty looks at (0 means all, as `[-0:]`).
    pub repetition_context_size: usize,
    /// Subtracted once from each recent token's logit; `None` or 0 disables it.
    pub presence_penalty: Option<f64>,
    /// How many recent tokens the presence penalty looks at.
    pub presence_context_size: usize,
    /// Subtracted from a logit once per recent occurrence; `None` or 0 disables it.
    pub frequency_penalty: Option<f64>,
    /// How many recent tokens the frequency penalty looks at.
    pub frequency_context_size: usize,
}

impl Default for ProcessorConfig {
    /// The defaults of `make_logits_processors`: nothing enabled, context sizes 20.
    fn default() -> Self {
        Self {
            logit_bias: Vec::new(),
            repetition_penalty: None,
            repetition_context_size: 20,
            presence_penalty: None,
            presence_context_size: 20,
            frequency_penalty: None,
            frequency_context_size: 20,
        }
    }
}

/// A penalty that is on, with the number of recent tokens it considers.
#[derive(Debug, Clone, Copy)]
struct Penalty {
    value: f64,
    context: usize,
}

impl Penalty {
    /// mlx-lm adds the processor only when `penalty is not None and penalty != 0`.
    fn from(value: Option<f64>, context: usize) -> Option<Self> {
        value
            .filter(|&v| v != 0.0)
            .map(|value| Penalty { value, context })
    }
}

/// The bias processor's `(indices int32, values float32)`, as `mx.array(list(...))` builds.
struct LogitBias {
    indices: Array,
    values: Array,
    max_id: i32,
}

/// mlx-lm's `make_logits_processors` result, applied in its order: logit bias, repetition,
/// presence, frequency.
pub struct LogitsProcessors {
    bias: Option<LogitBias>,
    repetition: Option<Penalty>,
    presence: Option<Penalty>,
    frequency: Option<Penalty>,
}

fn update_err(e: IndexUpdateError) -> EngineError {
    match e {
        IndexUpdateError::Exception(e) => EngineError::Mlx(e),
        other => EngineError::Runtime(other.to_string()),
    }
}

/// `tokens[-context:]` with Python's slice semantics (`[-0:]` is everything).
fn recent(tokens: &Array, len: i32, context: usize) -> Result<Array> {
    let start = match i32::try_from(context) {
        Ok(c) if c > 0 && c < len => len - c,
        _ => return Ok(tokens.clone()),
    };
    Ok(tokens.try_index(start..)?)
}

impl LogitsProcessors {
    /// Validates `cfg` and builds the processors mlx-lm would build for it.
    pub fn new(cfg: &ProcessorConfig) -> Result<Self> {
        if let Some(p) = cfg.repetition_penalty {
            if !(p >= 0.0 && p.is_finite()) {
                return Err(EngineError::Input(format!(
                    "`--repetition-penalty` must be a finite number >= 0, got {p}."
                )));
            }
        }
        for (flag, p) in [
            ("--presence-penalty", cfg.presence_penalty),
            ("--frequency-penalty", cfg.frequency_penalty),
        ] {
            if let Some(p) = p.filter(|p| !p.is_finite()) {
                return Err(EngineError::Input(format!(
                    "`{flag}` must be a finite number, got {p}."
                )));
            }
        }
        let bias = if cfg.logit_bias.is_empty() {
            None
        } else {
            // Python dict semantics: first position wins, last value wins.
            let mut entries: Vec<(i32, f64)> = Vec::new();
            for &(id, v) in &cfg.logit_bias {
                let id = token_i32("--logit-bias", id)?;
                if !v.is_finite() {
                    return Err(EngineError::Input(format!(
                        "`--logit-bias` for token {id} must be a finite number, got {v}."
                    )));
                }
                match entries.iter_mut().find(|e| e.0 == id) {
                    Some(e) => e.1 = v,
                    None => entries.push((id, v)),
                }
            }
            let ids: Vec<i32> = entries.iter().map(|e| e.0).collect();
            let vals: Vec<f32> = entries.iter().map(|e| e.1 as f32).collect();
            let n = ids.len() as i32;
            Some(LogitBias {
                max_id: ids.iter().copied().max().unwrap_or(0),
                indices: Array::from_slice(&ids, &[n]),
                values: Array::from_slice(&vals, &[n]),
            })
        };
        Ok(Self {
            bias,
            repetition: Penalty::from(cfg.repetition_penalty, cfg.repetition_context_size),
            presence: Penalty::from(cfg.presence_penalty, cfg.presence_context_size),
            frequency: Penalty::from(cfg.frequency_penalty, cfg.frequency_context_size),
        })
    }

    /// Whether no processor is enabled (the generate loop then skips tracking tokens).
    pub fn is_empty(&self) -> bool {
        self.bias.is_none()
            && self.repetition.is_none()
            && self.presence.is_none()
            && self.frequency.is_none()
    }

    /// Applies the processors to `logits` (`[1, vocab]`), given every prompt and generated
    /// token id so far (`tokens`, 1-D integer), returning the new lazy logits.
    pub fn apply(&mut self, tokens: &Array, logits: &Array) -> Result<Array> {
        let mut logits = logits.clone();
        if let Some(bias) = &self.bias {
            let vocab = logits.shape().last().copied().unwrap_or(0);
            if bias.max_id >= vocab {
                return Err(EngineError::Input(format!(
                    "`--logit-bias` token id {} is outside the vocabulary (size {vocab}).",
                    bias.max_id
                )));
            }
            logits = logits
                .try_index_update((.., &bias.indices), &bias.values, UpdateMode::Add)
                .map_err(update_err)?;
        }
        if self.repetition.is_none() && self.presence.is_none() && self.frequency.is_none() {
            return Ok(logits);
        }
        if tokens.ndim() != 1 {
            return Err(EngineError::Runtime(format!(
                "logits processors need a 1-D token history, got shape {:?}",
                tokens.shape()
            )));
        }
        let len = tokens.dim(0);
        if len == 0 {
            return Ok(logits);
        }
        if let Some(p) = self.repetition {
            let ctx = recent(tokens, len, p.context)?;
            let selected = logits.try_index((.., &ctx))?;
            let dt = selected.dtype();
            let penalty = weak(p.value, dt)?;
            let selected = ops::select(
                selected.lt(weak(0.0, dt)?)?,
                selected.multiply(&penalty)?,
                selected.divide(&penalty)?,
            )?;
            logits.try_index_mut((.., &ctx), &selected)?;
        }
        if let Some(p) = self.presence {
            let ctx = recent(tokens, len, p.context)?;
            let selected = logits.try_index((.., &ctx))?;
            let selected = selected.subtract(weak(p.value, selected.dtype())?)?;
            logits.try_index_mut((.., &ctx), &selected)?;
        }
        if let Some(p) = self.frequency {
            let ctx = recent(tokens, len, p.context)?;
            // `.at[:, ctx].subtract(p)`: a scatter-add of `-p`, so repeats accumulate.
            let minus = weak(p.value, logits.dtype())?.negative()?;
            logits = logits
                .try_index_update((.., &ctx), &minus, UpdateMode::Add)
                .map_err(update_err)?;
        }
        Ok(logits)
    }
}
