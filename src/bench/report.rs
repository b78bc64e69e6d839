//! Benchmark rows and their output formats: llama-bench's markdown table, JSON, JSONL, CSV.
//! Every row carries the setup it was measured on so rows from different setups are never
//! compared.

use super::stats;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where a row was measured (rows are only comparable within one setup).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Setup {
    /// mlxb version and commit.
    pub mlxb: String,
    /// MLX version of the loaded libmlx.
    pub mlx_version: String,
    /// cpu / metal / cuda.
    pub backend: String,
    /// The BLAS MLX calls.
    pub blas: String,
    /// CPU model name.
    pub cpu_info: String,
}

/// One measured test (or, in `--matrix`, one fork configuration that was skipped). A field
/// missing when parsed reads as its default (CSV leaves empty values empty).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Row {
    /// The setup.
    #[serde(flatten)]
    pub setup: Setup,
    /// Model directory name.
    pub model: String,
    /// Weight bytes.
    pub model_size: u64,
    /// Parameter count.
    pub model_n_params: u64,
    /// Configuration label (`vanilla`, a drafter, a fork setting).
    pub config: String,
    /// Test name (`pp512`, `tg128 @ d512`; empty for a skipped configuration).
    pub test: String,
    /// Prompt tokens per repetition.
    pub n_prompt: usize,
    /// Generated tokens per repetition.
    pub n_gen: usize,
    /// Context depth.
    pub n_depth: usize,
    /// Sequences decoded at once (`tg x B` tests; 0 otherwise).
    #[serde(default)]
    pub n_parallel: usize,
    /// Tokens in a verify block (`v` tests).
    #[serde(default)]
    pub n_verify: usize,
    /// Mean tokens/second.
    pub avg_ts: f64,
    /// Standard deviation of tokens/second.
    pub stddev_ts: f64,
    /// Per-repetition tokens/second.
    pub samples_ts: Vec<f64>,
    /// The baseline of a `vanilla` row (`mlx-lm`, or `llama.cpp` with its build), when one
    /// was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    /// Baseline per-repetition tokens/second, when measured (the baseline's for `vanilla`,
    /// vanilla mlxb for a drafter, L1 for a `--matrix` configuration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_samples_ts: Option<Vec<f64>>,
    /// Paired mean ratio of tokens/second, this row / its baseline (> 1 = faster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// 95% confidence interval of [`Row::ratio`] (needs two repetitions or more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio_ci: Option<[f64; 2]>,
    /// `v` tests: per repetition, the block's time over a one-token step's at the same depth.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub verify_cost_samples: Vec<f64>,
    /// `v` tests: the mlx-lm baseline's block cost in one-token steps, per repetition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub baseline_verify_cost_samples: Vec<f64>,
    /// `v` tests: mean of [`Row::verify_cost_samples`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify_cost: Option<f64>,
    /// `v` tests: mean of [`Row::baseline_verify_cost_samples`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_verify_cost: Option<f64>,
    /// Mean acceptance length for speculative configs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_acceptance_length: Option<f64>,
    /// `--matrix`: output of this configuration vs L1 (`identical`, `may change`, `changes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// `--matrix`: the strictest parity tier the configuration keeps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keeps: Option<String>,
    /// `--matrix`: why the configuration was not measured on this machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    /// `--matrix`: mean KL(L1 || config) of next-token distributions, in nats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_mean: Option<f64>,
    /// `--matrix`: largest single-step KL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_max: Option<f64>,
    /// `--matrix`: fraction of steps whose greedy token equals L1's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_top1: Option<f64>,
    /// `--matrix`: whether every compared step's logprobs were bit-identical to L1's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_identical: Option<bool>,
    /// `--matrix`: the mean KL is above `--kl-warn`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_warn: Option<bool>,
    /// `--matrix`: a configuration that keeps L2 with a per-layer KV allocation, compared with
    /// the L2 oracle (mlx-optiq) instead of a KL estimate: whether every step was identical.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l2_identical: Option<bool>,
}

impl Row {
    /// Fills mean/std (and the ratio when a baseline exists) from the samples.
    pub fn finish(&mut self) {
        self.avg_ts = stats::mean(&self.samples_ts);
        self.stddev_ts = stats::stddev(&self.samples_ts);
        let mean = |x: &[f64]| (!x.is_empty()).then(|| stats::mean(x));
        self.verify_cost = mean(&self.verify_cost_samples);
        self.baseline_verify_cost = mean(&self.baseline_verify_cost_samples);
        if let Some(b) = &self.baseline_samples_ts {
            let (r, lo, hi) = stats::paired_ratio(&self.samples_ts, b);
            self.ratio = Some(r);
            self.ratio_ci = (lo.is_finite() && hi.is_finite()).then_some([lo, hi]);
        }
    }

    /// The ratio as `1.234 (1.100–1.300)`, or `1.234` without a CI; empty without a ratio.
    pub fn ratio_text(&self) -> String {
        match (self.ratio, self.ratio_ci) {
            (Some(m), Some([lo, hi])) => format!("{m:.3} ({lo:.3}–{hi:.3})"),
            (Some(m), None) => format!("{m:.3}"),
            _ => String::new(),
        }
    }
}

fn human_size(bytes: u64) -> String {
    let mib = bytes as f64 / (1u64 << 20) as f64;
    if mib >= 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else {
        format!("{mib:.2} MiB")
    }
}

fn human_params(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2} B", n as f64 / 1e9)
    } else {
        format!("{:.2} M", n as f64 / 1e6)
    }
}

/// llama-bench's markdown table, plus baseline / ratio / acceptance columns when present.
pub fn markdown(rows: &[Row]) -> String {
    let base = rows.iter().any(|r| r.baseline_samples_ts.is_some());
    let spec = rows.iter().any(|r| r.mean_acceptance_length.is_some());
    let verify = rows.iter().any(|r| r.verify_cost.is_some());
    let mut out = String::from("| model | size | params | backend | config | test | t/s |");
    if base {
        out.push_str(" baseline t/s | ratio (95% CI) |");
    }
    if spec {
        out.push_str(" mean acc. len |");
    }
    if verify {
        out.push_str(if base {
            " steps per block | baseline steps |"
        } else {
            " steps per block |"
        });
    }
    out.push('\n');
    let cols = 7
        + if base { 2 } else { 0 }
        + usize::from(spec)
        + if verify { 1 + usize::from(base) } else { 0 };
    out.push_str(&"|---".repeat(cols));
    out.push_str("|\n");
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.model,
            human_size(r.model_size),
            human_params(r.model_n_params),
            r.setup.backend,
            r.config,
            r.test,
            mean_std(&r.samples_ts),
        ));
        if base {
            match &r.baseline_samples_ts {
                Some(b) => out.push_str(&format!(" {} | {} |", mean_std(b), r.ratio_text())),
                None => out.push_str(" | |"),
            }
        }
        if spec {
            match r.mean_acceptance_length {
                Some(l) => out.push_str(&format!(" {l:.2} |")),
                None => out.push_str(" |"),
            }
        }
        if verify {
            let cost = |c: Option<f64>| c.map(|c| format!(" {c:.2} |")).unwrap_or(" |".into());
            out.push_str(&cost(r.verify_cost));
            if base {
                out.push_str(&cost(r.baseline_verify_cost));
            }
        }
        out.push('\n');
    }
    if base || spec {
        let named = rows.iter().find_map(|r| r.baseline.as_deref());
        out.push_str(&format!(
            "\nbaseline: {} for `vanilla` rows, vanilla mlxb (same repetitions) for `draft` rows; ratio = paired mean of per-repetition t/s ratios.\n",
            named.unwrap_or("mlx-lm")
        ));
    }
    if verify {
        out.push_str("\nvN: one forward of an N-token block with all of its logits (a speculative verify); steps per block = its time over a one-token step at the same depth, in the same repetition.\n");
    }
    out
}

fn mean_std(x: &[f64]) -> String {
    format!("{:.2} ± {:.2}", stats::mean(x), stats::stddev(x))
}

/// The `--matrix` table: every fork configuration against L1, with its speedup, its output
/// class and KL divergence, and the reason for every configuration that could not run here.
pub fn matrix_markdown(rows: &[Row]) -> String {
    let mut out = String::from(
        "| config | output | keeps | test | L1 t/s | t/s | speedup (95% CI) | mean KL | max KL | top-1 | note |\n",
    );
    out.push_str(&"|---".repeat(11));
    out.push_str("|\n");
    let num = |v: Option<f64>, f: fn(f64) -> String| v.map(f).unwrap_or_default();
    for r in rows {
        let note = match (&r.skipped, r.kl_warn, r.l2_identical) {
            (Some(why), _, _) => format!("skipped: {why}"),
            (None, _, Some(true)) => "identical to L2 (mlx-optiq)".into(),
            (None, _, Some(false)) => "DIFFERS from L2 (mlx-optiq)".into(),
            (None, Some(true), _) => "WARN: mean KL above --kl-warn".into(),
            _ => String::new(),
        };
        let measured = r.skipped.is_none();
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.config,
            r.output.as_deref().unwrap_or(""),
            r.keeps.as_deref().unwrap_or(""),
            r.test,
            r.baseline_samples_ts
                .as_deref()
                .map(mean_std)
                .unwrap_or_default(),
            if measured {
                mean_std(&r.samples_ts)
            } else {
                String::new()
            },
            r.ratio_text(),
            num(r.kl_mean, |v| format!("{v:.2e}")),
            num(r.kl_max, |v| format!("{v:.2e}")),
            num(r.kl_top1, |v| format!("{v:.3}")),
            note.replace('|', "\\|"),
        ));
    }
    out.push_str("\nspeedup = paired mean of per-repetition t/s ratios config / L1 (> 1 = faster); KL(L1 || config) in nats over the fixed prompt set, teacher-forced on L1's greedy tokens; empty for configurations whose output is identical to L1 by the fork table, and for L2 configurations with a per-layer KV allocation, which are compared with the L2 oracle (mlx-optiq) bit for bit instead.\n");
    out
}

/// How a CSV cell encodes a JSON field.
#[derive(Clone, Copy)]
enum Cell {
    /// A string, quoted.
    Text,
    /// A JSON number or boolean.
    Scalar,
    /// A list of numbers joined by `;`.
    List,
}

/// The CSV columns: every field of [`Row`], with the JSON names.
const COLUMNS: &[(&str, Cell)] = &[
    ("mlxb", Cell::Text),
    ("mlx_version", Cell::Text),
    ("backend", Cell::Text),
    ("blas", Cell::Text),
    ("cpu_info", Cell::Text),
    ("model", Cell::Text),
    ("model_size", Cell::Scalar),
    ("model_n_params", Cell::Scalar),
    ("config", Cell::Text),
    ("test", Cell::Text),
    ("n_prompt", Cell::Scalar),
    ("n_gen", Cell::Scalar),
    ("n_depth", Cell::Scalar),
    ("n_verify", Cell::Scalar),
    ("n_parallel", Cell::Scalar),
    ("avg_ts", Cell::Scalar),
    ("stddev_ts", Cell::Scalar),
    ("samples_ts", Cell::List),
    ("baseline", Cell::Text),
    ("baseline_samples_ts", Cell::List),
    ("ratio", Cell::Scalar),
    ("ratio_ci", Cell::List),
    ("verify_cost_samples", Cell::List),
    ("baseline_verify_cost_samples", Cell::List),
    ("verify_cost", Cell::Scalar),
    ("baseline_verify_cost", Cell::Scalar),
    ("mean_acceptance_length", Cell::Scalar),
    ("output", Cell::Text),
    ("keeps", Cell::Text),
    ("skipped", Cell::Text),
    ("kl_mean", Cell::Scalar),
    ("kl_max", Cell::Scalar),
    ("kl_top1", Cell::Scalar),
    ("kl_identical", Cell::Scalar),
    ("kl_warn", Cell::Scalar),
    ("l2_identical", Cell::Scalar),
];

/// CSV with the JSON field names (lists joined by `;`, absent fields empty).
pub fn csv(rows: &[Row]) -> String {
    let names: Vec<&str> = COLUMNS.iter().map(|(n, _)| *n).collect();
    let mut out = names.join(",");
    out.push('\n');
    for r in rows {
        let v = serde_json::to_value(r).unwrap_or_default();
        let cells: Vec<String> = COLUMNS
            .iter()
            .map(|(name, kind)| match (kind, v.get(name)) {
                (_, None | Some(Value::Null)) => String::new(),
                (Cell::Text, Some(Value::String(s))) => format!("\"{}\"", s.replace('"', "\"\"")),
                (Cell::List, Some(Value::Array(a))) => {
                    a.iter().map(Value::to_string).collect::<Vec<_>>().join(";")
                }
                (_, Some(other)) => other.to_string(),
            })
            .collect();
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}

/// Parses rows back from [`csv`] (round-trip tests, comparisons); the error names the line.
pub fn parse_csv(text: &str) -> Result<Vec<Row>, String> {
    let mut lines = text.lines();
    let header: Vec<&str> = COLUMNS.iter().map(|(n, _)| *n).collect();
    if lines.next() != Some(header.join(",").as_str()) {
        return Err("the header is not mlxb bench's CSV header".into());
    }
    let parse = |s: &str| serde_json::from_str::<Value>(s).map_err(|e| format!("{s:?}: {e}"));
    let mut rows = Vec::new();
    for (i, line) in lines.enumerate() {
        let at = |e: String| format!("line {}: {e}", i + 2);
        let f = split_csv(line).ok_or_else(|| at("unbalanced quotes".into()))?;
        if f.len() != COLUMNS.len() {
            return Err(at(format!(
                "{} fields, expected {}",
                f.len(),
                COLUMNS.len()
            )));
        }
        let mut obj = serde_json::Map::new();
        for ((name, kind), cell) in COLUMNS.iter().zip(f) {
            if cell.is_empty() {
                continue;
            }
            let value = match kind {
                Cell::Text => Value::String(cell),
                Cell::Scalar => parse(&cell).map_err(at)?,
                Cell::List => Value::Array(
                    cell.split(';')
                        .map(parse)
                        .collect::<Result<_, _>>()
                        .map_err(at)?,
                ),
            };
            obj.insert((*name).to_owned(), value);
        }
        rows.push(serde_json::from_value(Value::Object(obj)).map_err(|e| at(e.to_string()))?);
    }
    Ok(rows)
}

fn split_csv(line: &str) -> Option<Vec<String>> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => fields.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    if quoted {
        return None;
    }
    fields.push(cur);
    Some(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> Row {
        let mut r = Row {
            setup: Setup {
                mlxb: "0.1.0 (abc)".into(),
                mlx_version: "0.32.4".into(),
                backend: "cpu".into(),
                blas: "OpenBLAS 0.3.21".into(),
                cpu_info: "AMD EPYC, \"Zen 4\"".into(),
            },
            model: "smol".into(),
            model_size: 538_060_000,
            model_n_params: 134_515_008,
            config: "kv-quant 8 (quantized-kv-start 0)".into(),
            test: "tg128 @ d512".into(),
            n_gen: 128,
            n_depth: 512,
            samples_ts: vec![17.25, 18.5, 17.875],
            baseline: Some("llama.cpp abc1234".into()),
            baseline_samples_ts: Some(vec![16.0, 17.0, 16.5]),
            verify_cost_samples: vec![1.5, 1.25, 1.75],
            baseline_verify_cost_samples: vec![2.0, 2.5, 2.25],
            mean_acceptance_length: Some(2.5),
            output: Some("changes".into()),
            keeps: Some("L1".into()),
            kl_mean: Some(1.25e-4),
            kl_max: Some(0.1 + 0.2),
            kl_top1: Some(0.9375),
            kl_identical: Some(false),
            kl_warn: Some(false),
            ..Row::default()
        };
        r.finish();
        r
    }

    fn skipped() -> Row {
        Row {
            config: "fused-gelu on".into(),
            output: Some("may change".into()),
            keeps: Some("L3".into()),
            skipped: Some("no kernel, \"on\" is refused | here".into()),
            ..Row::default()
        }
    }

    #[test]
    fn every_field_has_a_csv_column() {
        let v = serde_json::to_value(row()).unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.extend(["skipped", "l2_identical"]);
        keys.sort_unstable();
        let mut cols: Vec<&str> = COLUMNS.iter().map(|(n, _)| *n).collect();
        cols.sort_unstable();
        assert_eq!(keys, cols);
    }

    #[test]
    fn json_and_csv_round_trip() {
        let rows = vec![row(), skipped()];
        assert!(rows[0].ratio.is_some() && rows[0].ratio_ci.is_some());
        let back: Vec<Row> = serde_json::from_str(&serde_json::to_string(&rows).unwrap()).unwrap();
        assert_eq!(back, rows);
        assert_eq!(parse_csv(&csv(&rows)).unwrap(), rows);
        assert!(parse_csv("a,b\n").is_err());
        let bad = csv(&rows).replacen("17.25", "x", 1);
        assert!(parse_csv(&bad).unwrap_err().starts_with("line 2:"));
    }

    #[test]
    fn one_repetition_has_a_ratio_but_no_interval() {
        let mut r = Row {
            samples_ts: vec![3.0],
            baseline_samples_ts: Some(vec![2.0]),
            ..Row::default()
        };
        r.finish();
        assert_eq!((r.ratio, r.ratio_ci), (Some(1.5), None));
        let back: Row = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn markdown_has_llama_bench_columns() {
        let md = markdown(&[row()]);
        assert!(md.starts_with("| model | size | params | backend | config | test | t/s |"));
        assert!(md.contains("tg128 @ d512") && md.contains("±") && md.contains("ratio (95% CI)"));
    }

    #[test]
    fn matrix_markdown_names_skips_and_warnings() {
        let mut warn = row();
        warn.kl_warn = Some(true);
        let md = matrix_markdown(&[warn, skipped()]);
        assert!(md.contains("WARN") && md.contains("skipped: no kernel"));
        assert!(md.contains("\\|"), "a | in a note is escaped: {md}");
        assert_eq!(md.lines().nth(2).unwrap().matches(" | ").count(), 10);
    }
}
