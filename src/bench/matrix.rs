//! `mlxb bench --matrix`: every fork value and tier as a paired A/B against L1. The
//! configurations are derived from the fork table ([`FORKS`]): each fork at each value other
//! than its L1 default, then the `--l2` and `--l3` tiers. Each runs interleaved with L1 on the
//! same tests (the order alternates per repetition), giving a speedup with a CI; each whose
//! output is not identical to L1 by the table also gets the KL divergence of its next-token
//! distributions from L1's on a fixed prompt set. A value that cannot run here is a row with
//! the reason, never dropped.

use super::progress::Event;
use super::report::Row;
use super::runner::{measure, TestInputs, TestSpec};
use super::{row_template, test_row};
use crate::engine::error::{EngineError, Result};
use crate::engine::forks::{self, Domain, Fork, Forks, KvQuant, Output, Resolution, Tier, FORKS};
use crate::engine::models::{self, LoadedModel};
use crate::engine::plan::ForkPlan;
use crate::engine::session::Session;
use crate::oracle::{divergence, optiq};
use std::path::Path;

/// The quantized KV cache a value that only acts on one is measured with: 8 bits (mlx-lm's
/// `--kv-bits 8`, an L1 path) from the first token, since L1's `--quantized-kv-start 5000`
/// would leave a short benchmark's cache unquantized. A fork value that needs no quantized
/// cache runs alone.
pub const KV_CONTEXT: [(&str, &str); 2] = [("kv-quant", "8"), ("quantized-kv-start", "0")];

/// One configuration of the matrix.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Table label: `fused-decode on`, `perf-kernel on (with kv-quant 8, ...)`, `--l3`.
    pub label: String,
    /// The fork this entry varies (`None` for a tier).
    pub fork: Option<&'static str>,
    /// The fork's value, or the tier's flag.
    pub value: String,
    /// Output vs L1 (the worst over the configuration's values).
    pub output: Output,
    /// The strictest tier the configuration keeps.
    pub keeps: Tier,
    /// The resolved configuration, or why it cannot run here.
    pub run: std::result::Result<Resolution, String>,
}

/// The values of `fork` the matrix measures: every allowed value other than the L1 default
/// (for a count, the other tiers' defaults).
pub fn non_default_values(fork: &Fork) -> Vec<String> {
    let l1 = fork.default_in(Tier::L1);
    let values: Vec<String> = match &fork.domain {
        Domain::Choices(c) => c.iter().map(|c| c.value.to_owned()).collect(),
        Domain::Count => Tier::ALL
            .iter()
            .map(|t| fork.default_in(*t).to_owned())
            .collect(),
    };
    let mut unique: Vec<String> = Vec::new();
    for v in values {
        if v != l1 && !unique.contains(&v) {
            unique.push(v);
        }
    }
    unique
}

fn worst_output(r: &Resolution) -> Output {
    let has = |o: Output| r.values.iter().any(|v| v.output == o);
    if has(Output::Changes) {
        Output::Changes
    } else if has(Output::MayChange) {
        Output::MayChange
    } else {
        Output::Identical
    }
}

/// Why a resolution cannot be measured as it stands (a warning says a flag has no effect;
/// a quantized cache that starts late would not act in a short benchmark; `model` says what
/// the configuration does to the model at hand).
fn inert(r: &Resolution, model: Check) -> Option<String> {
    if let Some(w) = r.warnings.first() {
        return Some(w.clone());
    }
    let f = r.forks;
    if f.kv_quant != KvQuant::Off && f.quantized_kv_start > 0 {
        return Some(format!(
            "the KV cache is only quantized from token {}",
            f.quantized_kv_start
        ));
    }
    model(&f)
}

/// What a configuration does on one model: why it cannot act there, if so.
pub type Check<'a> = &'a dyn Fn(&Forks) -> Option<String>;

/// `fork value` resolved alone, or with [`KV_CONTEXT`] when alone it is refused or inert.
fn resolve_fork(fork: &'static Fork, value: &str, model: Check) -> Entry {
    let alone = vec![(fork.name.to_owned(), value.to_owned())];
    let (keeps, output) = fork.check(value).unwrap_or((Tier::L3, Output::MayChange));
    let mut entry = Entry {
        label: format!("{} {value}", fork.name),
        fork: Some(fork.name),
        value: value.to_owned(),
        output,
        keeps,
        run: Err(String::new()),
    };
    let reason = match forks::resolve(None, &alone) {
        Ok(r) => match inert(&r, model) {
            None => {
                entry.run = Ok(r);
                return entry;
            }
            Some(why) => why,
        },
        Err(e) => e.to_string(),
    };
    let context: Vec<(String, String)> = KV_CONTEXT
        .iter()
        .filter(|(name, _)| *name != fork.name)
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect();
    let with = [context.clone(), alone].concat();
    entry.run = match forks::resolve(None, &with) {
        Ok(r) => match inert(&r, model) {
            None => {
                let names: Vec<String> = context.iter().map(|(n, v)| format!("{n} {v}")).collect();
                entry.label = format!("{} (with {})", entry.label, names.join(", "));
                Ok(r)
            }
            Some(why) => Err(why),
        },
        Err(_) => Err(reason),
    };
    entry
}

/// The matrix, derived from [`FORKS`] alone: every fork at every non-default value, then
/// `--l2` and `--l3`. Configurations equal to L1 or to an earlier entry are skipped with the
/// reason.
pub fn plan() -> Vec<Entry> {
    plan_with(&|_| None)
}

/// [`plan`] for `loaded` (the model in `dir`): a fork value that would do nothing on this
/// model is measured with a quantized KV cache, or skipped with the model's reason.
pub fn plan_for(loaded: &LoadedModel, dir: &Path) -> Vec<Entry> {
    let config_path = dir.join("config.json");
    let layers = loaded.model.make_caches().len();
    plan_with(
        &|forks| match ForkPlan::new(*forks, &config_path, &loaded.config, layers) {
            Ok(p) => p.warnings.first().cloned(),
            Err(e) => Some(e.to_string()),
        },
    )
}

fn plan_with(model: Check) -> Vec<Entry> {
    let mut entries: Vec<Entry> = FORKS
        .iter()
        .flat_map(|f| {
            non_default_values(f)
                .into_iter()
                .map(move |v| resolve_fork(f, &v, model))
        })
        .collect();
    for tier in [Tier::L2, Tier::L3] {
        let run = forks::resolve(Some(tier), &[]).map_err(|e| e.to_string());
        entries.push(Entry {
            label: format!("--{}", tier.flag()),
            fork: None,
            value: tier.flag().to_owned(),
            output: run.as_ref().map_or(Output::MayChange, worst_output),
            keeps: run.as_ref().map_or(tier, Resolution::holds),
            run,
        });
    }
    let mut seen: Vec<(Forks, String)> = vec![(Forks::default(), "the L1 baseline".into())];
    for e in &mut entries {
        let Ok(r) = &e.run else { continue };
        e.output = worst_output(r);
        e.keeps = r.holds();
        match seen.iter().find(|(f, _)| *f == r.forks) {
            Some((_, same)) => e.run = Err(format!("same configuration as {same}")),
            None => seen.push((r.forks, format!("`{}`", e.label))),
        }
    }
    entries
}

/// What the matrix measures and how.
pub struct MatrixOptions {
    /// Tests in order (each is run for L1 and the configuration, interleaved).
    pub tests: Vec<TestSpec>,
    /// Repetitions after the warm-up.
    pub repetitions: usize,
    /// Prefill chunk size.
    pub prefill_step_size: usize,
    /// Greedy steps per prompt of the KL comparison.
    pub kl_steps: usize,
    /// Mean KL (nats) above which a row is flagged.
    pub kl_warn: f64,
}

impl MatrixOptions {
    /// Repetitions recorded if every planned configuration runs (what the progress counts).
    pub fn total_reps(&self, entries: &[Entry]) -> usize {
        entries.iter().filter(|e| e.run.is_ok()).count() * self.tests.len() * self.repetitions
    }
}

/// Runs the matrix on `session` (opened with the L1 forks), in [`plan`] order: one row per
/// configuration and test, and one row per skipped configuration.
pub fn run(
    session: &mut Session,
    dir: &Path,
    entries: &[Entry],
    opts: &MatrixOptions,
    mut progress: impl FnMut(&Event),
) -> Result<Vec<Row>> {
    let template = row_template(session, dir)?;
    let prompts = divergence::default_prompts(&session.tokenizer)?;
    let mut rows = Vec::new();
    for e in entries {
        let base = Row {
            config: e.label.clone(),
            output: Some(e.output.name().to_owned()),
            keeps: Some(e.keeps.to_string()),
            ..template.clone()
        };
        let r = match &e.run {
            Ok(r) => r,
            Err(why) => {
                rows.push(Row {
                    skipped: Some(why.clone()),
                    ..base
                });
                continue;
            }
        };
        let mut recorded = 0;
        let ran = measure_entry(session, dir, e, r, &base, opts, &prompts, &mut |ev| {
            recorded += usize::from(matches!(ev, Event::Rep { .. }));
            progress(ev)
        });
        match ran {
            Ok(measured) => rows.extend(measured),
            // A configuration this model refuses (e.g. a KV group size that does not divide
            // its head dim) or leaves without effect is a skipped row, not a failed matrix.
            Err(Skip(why)) => {
                rows.push(Row {
                    skipped: Some(why),
                    ..base
                });
                progress(&Event::Dropped(
                    (opts.tests.len() * opts.repetitions).saturating_sub(recorded),
                ));
            }
            Err(Fail(err)) => return Err(err),
        }
    }
    Ok(rows)
}

/// Why a configuration did not produce rows.
enum Stop {
    /// This model cannot run it, or it does nothing here (the reason).
    Skip(String),
    /// Something broke (aborts the matrix).
    Fail(EngineError),
}
use Stop::{Fail, Skip};

impl From<EngineError> for Stop {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Input(_) | EngineError::File { .. } => Skip(e.to_string()),
            other => Fail(other),
        }
    }
}

/// KL and timing of one configuration against L1 (the session's model).
#[allow(clippy::too_many_arguments)]
fn measure_entry(
    session: &mut Session,
    dir: &Path,
    e: &Entry,
    r: &Resolution,
    base: &Row,
    opts: &MatrixOptions,
    prompts: &[Vec<u32>],
    progress: &mut dyn FnMut(&Event),
) -> std::result::Result<Vec<Row>, Stop> {
    progress(&Event::Phase(&format!("loading {}", e.label)));
    let mut other = models::load(dir, r.forks)?;
    let mut base = base.clone();
    if e.keeps == Tier::L2 && other.plan.per_layer_kv() {
        progress(&Event::Phase(&format!("{} against mlx-optiq", e.label)));
        base.l2_identical = Some(optiq::identical_to_l2(
            &mut other,
            dir,
            prompts,
            opts.kl_steps,
            opts.prefill_step_size,
        )?);
    } else if e.output != Output::Identical {
        progress(&Event::Phase(&format!("KL divergence of {}", e.label)));
        let kl =
            divergence::kl_to_l1(dir, r.forks, prompts, opts.kl_steps, opts.prefill_step_size)?;
        base.kl_mean = Some(kl.mean_kl);
        base.kl_max = Some(kl.max_kl);
        base.kl_top1 = Some(kl.top1_agreement);
        base.kl_identical = Some(kl.identical);
        base.kl_warn = Some(kl.mean_kl > opts.kl_warn);
    }
    let vocab = session.model.model.vocab_size() as u32;
    let step = opts.prefill_step_size;
    let mut rows = Vec::new();
    for (t_index, test) in opts.tests.iter().enumerate() {
        let inputs = TestInputs::new(test, vocab, t_index);
        let mut row = Row {
            baseline_samples_ts: Some(Vec::new()),
            ..test_row(&base, &e.label, test)
        };
        // Repetition 0 is the warm-up; the order alternates so neither side always runs
        // right after the other warmed the caches.
        for rep in 0..=opts.repetitions {
            let (l1, ours) = if rep % 2 == 0 {
                let l1 = measure(&mut session.model, test, &inputs, step)?;
                (l1, measure(&mut other, test, &inputs, step)?)
            } else {
                let ours = measure(&mut other, test, &inputs, step)?;
                (measure(&mut session.model, test, &inputs, step)?, ours)
            };
            if rep == 0 {
                continue;
            }
            row.samples_ts.push(ours);
            if let Some(b) = row.baseline_samples_ts.as_mut() {
                b.push(l1);
            }
            progress(&Event::Rep {
                rows: std::slice::from_ref(&row),
                rep,
                reps: opts.repetitions,
            });
        }
        row.finish();
        rows.push(row);
    }
    Ok(rows)
}
