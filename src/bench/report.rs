//! Benchmark rows and their output formats: llama-bench's markdown table, JSON, JSONL, CSV.
//! Every row carries the setup it was measured on so rows from different setups are never
//! compared.

use super::stats;
use serde::{Deserialize, Serialize};

/// Where a row was measured (rows are only comparable within one setup).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// One measured test.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Test name (`pp512`, `tg128 @ d512`).
    pub test: String,
    /// Prompt tokens per repetition.
    pub n_prompt: usize,
    /// Generated tokens per repetition.
    pub n_gen: usize,
    /// Context depth.
    pub n_depth: usize,
    /// Mean tokens/second.
    pub avg_ts: f64,
    /// Standard deviation of tokens/second.
    pub stddev_ts: f64,
    /// Per-repetition tokens/second.
    pub samples_ts: Vec<f64>,
    /// Baseline (mlx-lm) per-repetition tokens/second, when measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_samples_ts: Option<Vec<f64>>,
    /// Paired ratio mlxb / baseline with its 95% CI, when a baseline ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio: Option<[f64; 3]>,
    /// Mean acceptance length for speculative configs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_acceptance_length: Option<f64>,
}

impl Row {
    /// Fills mean/std (and the ratio when a baseline exists) from the samples.
    pub fn finish(&mut self) {
        self.avg_ts = stats::mean(&self.samples_ts);
        self.stddev_ts = stats::stddev(&self.samples_ts);
        if let Some(b) = &self.baseline_samples_ts {
            let (r, lo, hi) = stats::paired_ratio(&self.samples_ts, b);
            self.ratio = Some([r, lo, hi]);
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
    let mut out = String::from("| model | size | params | backend | config | test | t/s |");
    if base {
        out.push_str(" baseline t/s | ratio (95% CI) |");
    }
    if spec {
        out.push_str(" mean acc. len |");
    }
    out.push('\n');
    let cols = 7 + if base { 2 } else { 0 } + usize::from(spec);
    out.push_str(&"|---".repeat(cols));
    out.push_str("|\n");
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.2} ± {:.2} |",
            r.model,
            human_size(r.model_size),
            human_params(r.model_n_params),
            r.setup.backend,
            r.config,
            r.test,
            r.avg_ts,
            r.stddev_ts
        ));
        if base {
            match (&r.baseline_samples_ts, r.ratio) {
                (Some(b), Some([m, lo, hi])) => out.push_str(&format!(
                    " {:.2} ± {:.2} | {m:.3} ({lo:.3}–{hi:.3}) |",
                    stats::mean(b),
                    stats::stddev(b)
                )),
                _ => out.push_str(" | |"),
            }
        }
        if spec {
            match r.mean_acceptance_length {
                Some(l) => out.push_str(&format!(" {l:.2} |")),
                None => out.push_str(" |"),
            }
        }
        out.push('\n');
    }
    if base || spec {
        out.push_str("\nbaseline: mlx-lm for `vanilla` rows, vanilla mlxb (same repetitions) for `draft` rows; ratio = paired mean of per-repetition t/s ratios.\n");
    }
    out
}

/// CSV with the JSON field names (samples joined by `;`).
pub fn csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "mlxb,mlx_version,backend,blas,cpu_info,model,model_size,model_n_params,config,test,n_prompt,n_gen,n_depth,avg_ts,stddev_ts,samples_ts\n",
    );
    let quote = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
    for r in rows {
        let samples: Vec<String> = r.samples_ts.iter().map(|v| format!("{v}")).collect();
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            quote(&r.setup.mlxb),
            quote(&r.setup.mlx_version),
            quote(&r.setup.backend),
            quote(&r.setup.blas),
            quote(&r.setup.cpu_info),
            quote(&r.model),
            r.model_size,
            r.model_n_params,
            quote(&r.config),
            quote(&r.test),
            r.n_prompt,
            r.n_gen,
            r.n_depth,
            r.avg_ts,
            r.stddev_ts,
            quote(&samples.join(";"))
        ));
    }
    out
}

/// Parses rows back from [`csv`] (for round-trip tests and comparisons).
pub fn parse_csv(text: &str) -> Option<Vec<Row>> {
    let mut rows = Vec::new();
    for line in text.lines().skip(1) {
        let f = split_csv(line)?;
        if f.len() != 16 {
            return None;
        }
        let samples_ts = if f[15].is_empty() {
            Vec::new()
        } else {
            f[15]
                .split(';')
                .map(|v| v.parse().ok())
                .collect::<Option<Vec<f64>>>()?
        };
        rows.push(Row {
            setup: Setup {
                mlxb: f[0].clone(),
                mlx_version: f[1].clone(),
                backend: f[2].clone(),
                blas: f[3].clone(),
                cpu_info: f[4].clone(),
            },
            model: f[5].clone(),
            model_size: f[6].parse().ok()?,
            model_n_params: f[7].parse().ok()?,
            config: f[8].clone(),
            test: f[9].clone(),
            n_prompt: f[10].parse().ok()?,
            n_gen: f[11].parse().ok()?,
            n_depth: f[12].parse().ok()?,
            avg_ts: f[13].parse().ok()?,
            stddev_ts: f[14].parse().ok()?,
            samples_ts,
            baseline_samples_ts: None,
            ratio: None,
            mean_acceptance_length: None,
        });
    }
    Some(rows)
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
            config: "vanilla".into(),
            test: "tg128 @ d512".into(),
            n_prompt: 0,
            n_gen: 128,
            n_depth: 512,
            avg_ts: 0.0,
            stddev_ts: 0.0,
            samples_ts: vec![17.25, 18.5, 17.875],
            baseline_samples_ts: Some(vec![16.0, 17.0, 16.5]),
            ratio: None,
            mean_acceptance_length: None,
        };
        r.finish();
        r
    }

    #[test]
    fn json_and_csv_round_trip() {
        let r = row();
        let back: Row = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        let parsed = parse_csv(&csv(std::slice::from_ref(&r))).unwrap();
        assert_eq!(parsed.len(), 1);
        let p = &parsed[0];
        assert_eq!(
            (p.avg_ts, p.stddev_ts, &p.samples_ts),
            (r.avg_ts, r.stddev_ts, &r.samples_ts)
        );
        assert_eq!(
            (&p.setup, &p.test, p.n_depth),
            (&r.setup, &r.test, r.n_depth)
        );
    }

    #[test]
    fn markdown_has_llama_bench_columns() {
        let md = markdown(&[row()]);
        assert!(md.starts_with("| model | size | params | backend | config | test | t/s |"));
        assert!(md.contains("tg128 @ d512") && md.contains("±") && md.contains("ratio (95% CI)"));
    }
}
