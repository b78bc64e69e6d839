//! The fork table: every switch that selects between implementations (compiled or eager
//! activations, fused or reference attention, quantized KV caches, output-changing kernels),
//! with its allowed values, its default in each parity tier, which oracle each value keeps
//! and whether it changes output. [`FORKS`] is the single source of truth: the clap flags
//! (`cmd::flags`), the `--l1/--l2/--l3` aliases, `mlxb flags` and the README table are all
//! generated from it, and the resolved [`Forks`] value is passed down explicitly.

use super::error::{EngineError, Result};
use std::fmt::Write as _;

/// A parity tier: a guarantee about which oracle the output reproduces bit for bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Bit-identical to mlx-lm 0.32.2 run with the same settings (incl. `--kv-bits`).
    L1,
    /// Bit-identical to mlx-optiq 0.7.7's `optiq eval` path with the same per-layer KV
    /// allocation (mixed per-layer KV precision).
    L2,
    /// No oracle: output-changing experiments.
    L3,
}

impl Tier {
    /// All tiers, strictest first.
    pub const ALL: [Tier; 3] = [Tier::L1, Tier::L2, Tier::L3];

    /// The flag name (`l1`, `l2`, `l3`).
    pub fn flag(self) -> &'static str {
        match self {
            Tier::L1 => "l1",
            Tier::L2 => "l2",
            Tier::L3 => "l3",
        }
    }

    /// Position in [`Tier::ALL`] (and in [`Fork::defaults`]).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The oracle this tier holds parity with.
    pub fn oracle(self) -> &'static str {
        match self {
            Tier::L1 => "mlx-lm 0.32.2 (same settings, incl. --kv-bits/--kv-group-size/--quantized-kv-start)",
            Tier::L2 => "mlx-optiq 0.7.7, `optiq eval` path (mixed per-layer KV precision from its kv_config.json)",
            Tier::L3 => "none (output-changing experiments)",
        }
    }

    /// The tier named by `l1`/`L1`/...
    pub fn parse(s: &str) -> Option<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| t.flag().eq_ignore_ascii_case(s))
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.flag().to_uppercase())
    }
}

/// How a fork value's output compares with the L1 default's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Bit-identical tokens and logprobs (tested).
    Identical,
    /// Not guaranteed bit-identical (e.g. another BLAS summation order); often equal in practice.
    MayChange,
    /// Different numerics by design.
    Changes,
}

impl Output {
    /// Short name for tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Output::Identical => "identical",
            Output::MayChange => "may change",
            Output::Changes => "changes",
        }
    }
}

/// One allowed value of a fork.
#[derive(Debug)]
pub struct Choice {
    /// The value as typed on the command line.
    pub value: &'static str,
    /// The strictest tier whose oracle this value keeps.
    pub keeps: Tier,
    /// Output compared with the L1 default run of the same oracle settings.
    pub output: Output,
}

/// The values a fork accepts.
#[derive(Debug)]
pub enum Domain {
    /// One of a fixed list.
    Choices(&'static [Choice]),
    /// A non-negative integer; every value keeps L1 (the oracle is run with the same value).
    Count,
}

/// One row of the fork table.
#[derive(Debug)]
pub struct Fork {
    /// The flag name without dashes (`compiled-activations`).
    pub name: &'static str,
    /// Allowed values.
    pub domain: Domain,
    /// The default in each tier, indexed by [`Tier::index`].
    pub defaults: [&'static str; 3],
    /// One-line help (clap, `mlxb flags`, README).
    pub help: &'static str,
}

const fn keep(value: &'static str, keeps: Tier, output: Output) -> Choice {
    Choice {
        value,
        keeps,
        output,
    }
}

const ON_OFF_EXACT: &[Choice] = &[
    keep("on", Tier::L1, Output::Identical),
    keep("off", Tier::L1, Output::Identical),
];

/// The fork table (the single source of truth).
pub static FORKS: &[Fork] = &[
    Fork {
        name: "compiled-activations",
        domain: Domain::Choices(ON_OFF_EXACT),
        defaults: ["on", "on", "on"],
        help: "MLX-compile swiglu/geglu/gelu/softcap/clip_residual as mlx-lm does (off: eager; same bits on CPU)",
    },
    Fork {
        name: "compiled-decode",
        domain: Domain::Choices(ON_OFF_EXACT),
        defaults: ["off", "off", "off"],
        help: "Compile the cache-independent parts of each single-token step (q/k/v projections + norms + RoPE, output projection) and the logprobs tail; bit-exact",
    },
    Fork {
        name: "fused-sdpa",
        domain: Domain::Choices(ON_OFF_EXACT),
        defaults: ["on", "on", "on"],
        help: "MLX's fused scaled_dot_product_attention (off: op-by-op reference attention; bit-identical on the CPU backend, where MLX runs that same graph)",
    },
    Fork {
        name: "kv-quant",
        domain: Domain::Choices(&[
            keep("off", Tier::L1, Output::Identical),
            keep("4", Tier::L1, Output::Changes),
            keep("8", Tier::L1, Output::Changes),
            keep("config", Tier::L2, Output::Changes),
        ]),
        defaults: ["off", "config", "config"],
        help: "Quantized KV cache: 4|8 = mlx-lm's --kv-bits path bit for bit; config = per-layer bits and group sizes from mlx-optiq's kv_config.json (--kv-config FILE, else beside the model), else config.json `kv_quantization.layer_bits`",
    },
    Fork {
        name: "kv-group-size",
        domain: Domain::Choices(&[
            keep("32", Tier::L1, Output::Changes),
            keep("64", Tier::L1, Output::Identical),
            keep("128", Tier::L1, Output::Changes),
        ]),
        defaults: ["64", "64", "64"],
        help: "Group size of the quantized KV cache (mlx-lm --kv-group-size)",
    },
    Fork {
        name: "quantized-kv-start",
        domain: Domain::Count,
        defaults: ["5000", "0", "0"],
        help: "Quantize a layer's KV cache once it holds this many tokens (mlx-lm --quantized-kv-start)",
    },
    Fork {
        name: "fused-gelu",
        domain: Domain::Choices(&[
            keep("off", Tier::L1, Output::Identical),
            keep("on", Tier::L3, Output::MayChange),
        ]),
        defaults: ["off", "off", "off"],
        help: "Custom fused GELU kernel (a Metal/CUDA kernel; none is built in yet, so `on` is refused; on CPU the compiled gelu already is one fused kernel)",
    },
    Fork {
        name: "perf-kernel",
        domain: Domain::Choices(&[
            keep("off", Tier::L1, Output::Identical),
            keep("on", Tier::L3, Output::Changes),
        ]),
        defaults: ["off", "off", "on"],
        help: "Host CPU kernels: a quantized llama-family or qwen2 model runs each step on the host (SIMD mat-vec on the packed weights of every width, AVX-512/AVX2/scalar, dense f32 layers and biases beside them, prompts in 8-token blocks, KV read in place from the MLX cache); other quantized models run their 4-/8-bit layers' single-token and <= 8-token verify products there; not under --compiled-decode; with --kv-quant attention runs in f32 with an online softmax over 256-position chunks",
    },
    Fork {
        name: "host-matvec",
        domain: Domain::Choices(ON_OFF_EXACT),
        defaults: ["on", "on", "on"],
        help: "CPU backend: products through dense f32/bf16/f16 layers (up to 16 tokens; any number for 16-bit) and 2- to 8-bit layers with f32 or bf16 scales, and bf16 attention, run on the host (both cores, weights read in place) summed in the exact order MLX's CPU backend sums them (OpenBLAS's order for f32, MLX's own for 16-bit and quantized), so bit-identical; each weight shape and head layout is compared with MLX at first use and stays on MLX if it differs; not under --compiled-decode",
    },
    Fork {
        name: "host-elementwise",
        domain: Domain::Choices(ON_OFF_EXACT),
        defaults: ["on", "on", "on"],
        help: "CPU backend: f32 and bf16 element-wise work runs on the host computing exactly what MLX's CPU kernels compute, so bit-identical: the SwiGLU of llama-family MLPs (MLX's scalar sigmoid, its polynomial exp, in AVX-512 or AVX2 lanes: ~1/4 of a prompt's time on MLX), RMSNorms and residual adds whose input is already on the host (a decode step then waits for MLX once per layer, not three times), and the logprobs tail (logits - logsumexp) of logits the host step made; each compared with MLX once per process and left to MLX if it differs; not under --compiled-decode",
    },
    Fork {
        name: "host-step",
        domain: Domain::Choices(ON_OFF_EXACT),
        defaults: ["on", "on", "on"],
        help: "CPU backend, with --host-matvec and --host-elementwise on: a block of up to 8 tokens (a decode step, a speculative verify block) of a dense f32 or bf16 llama-family model runs whole on the host, embedding to logits (RoPE, attention over the cache read in place and every product, norm and SwiGLU in MLX's own order), so MLX is waited on once per block instead of once per layer; bit-identical, each part compared with MLX at first use and the per-layer path kept if one differs; not under --compiled-decode",
    },
    Fork {
        name: "fused-decode",
        domain: Domain::Choices(&[
            keep("off", Tier::L1, Output::Identical),
            keep("on", Tier::L3, Output::MayChange),
        ]),
        defaults: ["off", "off", "on"],
        help: "Single-token steps project q, k and v with one fused matmul over concatenated weights",
    },
];

/// The table row named `name`.
pub fn fork(name: &str) -> Option<&'static Fork> {
    FORKS.iter().find(|f| f.name == name)
}

impl Fork {
    /// The default value in `tier`.
    pub fn default_in(&self, tier: Tier) -> &'static str {
        self.defaults[tier.index()]
    }

    /// The allowed values as one string (`on|off`, `<N>`).
    pub fn values_hint(&self) -> String {
        match &self.domain {
            Domain::Choices(c) => c.iter().map(|c| c.value).collect::<Vec<_>>().join("|"),
            Domain::Count => "N".into(),
        }
    }

    /// Checks `value` against the domain; returns the tier it keeps and its output class.
    pub fn check(&self, value: &str) -> Result<(Tier, Output)> {
        match &self.domain {
            Domain::Choices(choices) => choices
                .iter()
                .find(|c| c.value == value)
                .map(|c| (c.keeps, c.output))
                .ok_or_else(|| {
                    EngineError::Input(format!(
                        "--{} {value:?} is not a valid value; use one of {}",
                        self.name,
                        self.values_hint()
                    ))
                }),
            Domain::Count => value
                .parse::<u32>()
                .map(|_| (Tier::L1, Output::Identical))
                .map_err(|_| {
                    EngineError::Input(format!(
                        "--{} {value:?} is not a valid value; give a non-negative integer",
                        self.name
                    ))
                }),
        }
    }
}

/// The KV cache quantization mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvQuant {
    /// Full-precision caches (mlx-lm's default).
    Off,
    /// Every plain KV cache quantized to this many bits (mlx-lm `--kv-bits`).
    Bits(i32),
    /// Per-layer bits from config.json `kv_quantization.layer_bits`.
    Config,
}

/// The value of every fork for one run. `Default` is tier L1's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forks {
    /// Compile activations with MLX like mlx-lm does (same bits either way on CPU).
    pub compiled_activations: bool,
    /// Compile the cache-independent parts of single-token steps (bit-exact).
    pub compiled_decode: bool,
    /// MLX's fused SDPA; false = op-by-op reference attention.
    pub fused_sdpa: bool,
    /// KV cache quantization.
    pub kv_quant: KvQuant,
    /// Group size of quantized KV caches.
    pub kv_group_size: i32,
    /// Tokens a cache holds before it is quantized.
    pub quantized_kv_start: usize,
    /// Custom fused GELU kernel (GPU only; refused on CPU).
    pub fused_gelu: bool,
    /// Host SIMD 4-bit mat-vec for quantized linears in small steps, and f32 online-softmax
    /// attention over quantized KV caches (L3).
    pub perf_kernel: bool,
    /// One fused q/k/v projection in single-token steps (L3).
    pub fused_decode: bool,
    /// Dense single-token products on the host in MLX's own summation order (bit-exact).
    pub host_matvec: bool,
    /// f32 SwiGLU, RMSNorm and residual adds on the host, operation for operation as MLX's CPU
    /// kernels (bit-exact).
    pub host_elementwise: bool,
    /// Whole f32 decode steps on the host in MLX's order (bit-exact).
    pub host_step: bool,
}

impl Default for Forks {
    fn default() -> Self {
        Forks::tier(Tier::L1)
    }
}

impl Forks {
    /// Every fork at `tier`'s default.
    pub fn tier(tier: Tier) -> Self {
        let values: Vec<&str> = FORKS.iter().map(|f| f.default_in(tier)).collect();
        Forks::build(&values)
    }

    /// Builds the typed value from one string per [`FORKS`] row, in table order, checking
    /// every value against its row.
    pub fn from_values(values: &[&str]) -> Result<Self> {
        if values.len() != FORKS.len() {
            return Err(EngineError::Runtime(format!(
                "{} fork values for {} forks",
                values.len(),
                FORKS.len()
            )));
        }
        for (f, v) in FORKS.iter().zip(values) {
            f.check(v)?;
        }
        Ok(Forks::build(values))
    }

    /// The typed value of already checked strings (a missing row reads as "").
    fn build(values: &[&str]) -> Self {
        let get = |name: &str| -> &str {
            FORKS
                .iter()
                .position(|f| f.name == name)
                .and_then(|i| values.get(i).copied())
                .unwrap_or("")
        };
        let on = |name: &str| get(name) == "on";
        let int = |name: &str| get(name).parse::<i64>().unwrap_or(0);
        Forks {
            compiled_activations: on("compiled-activations"),
            compiled_decode: on("compiled-decode"),
            fused_sdpa: on("fused-sdpa"),
            kv_quant: match get("kv-quant") {
                "off" => KvQuant::Off,
                "config" => KvQuant::Config,
                bits => KvQuant::Bits(bits.parse().unwrap_or(0)),
            },
            kv_group_size: int("kv-group-size") as i32,
            quantized_kv_start: int("quantized-kv-start") as usize,
            fused_gelu: on("fused-gelu"),
            perf_kernel: on("perf-kernel"),
            fused_decode: on("fused-decode"),
            host_matvec: on("host-matvec"),
            host_elementwise: on("host-elementwise"),
            host_step: on("host-step"),
        }
    }

    /// One string per [`FORKS`] row, in table order (the inverse of [`Forks::from_values`]).
    pub fn to_values(&self) -> Vec<String> {
        let on = |b: bool| if b { "on" } else { "off" }.to_owned();
        FORKS
            .iter()
            .map(|f| match f.name {
                "compiled-activations" => on(self.compiled_activations),
                "compiled-decode" => on(self.compiled_decode),
                "fused-sdpa" => on(self.fused_sdpa),
                "kv-quant" => match self.kv_quant {
                    KvQuant::Off => "off".into(),
                    KvQuant::Config => "config".into(),
                    KvQuant::Bits(b) => b.to_string(),
                },
                "kv-group-size" => self.kv_group_size.to_string(),
                "quantized-kv-start" => self.quantized_kv_start.to_string(),
                "fused-gelu" => on(self.fused_gelu),
                "perf-kernel" => on(self.perf_kernel),
                "fused-decode" => on(self.fused_decode),
                "host-matvec" => on(self.host_matvec),
                "host-elementwise" => on(self.host_elementwise),
                "host-step" => on(self.host_step),
                other => format!("<no field for {other}>"),
            })
            .collect()
    }

    /// Whether 4-bit linear layers run single-token steps on the host kernel
    /// ([`crate::engine::kernels`]): `--perf-kernel on`, except inside compiled steps.
    pub fn host_q4(&self) -> bool {
        self.perf_kernel && !self.compiled_decode
    }

    /// Whether dense layers run single-token products on the host in MLX's own order
    /// ([`crate::engine::kernels::dense`]): `--host-matvec on` on the CPU backend, except inside
    /// compiled steps.
    pub fn host_dense(&self) -> bool {
        self.cpu_host(self.host_matvec)
    }

    /// Whether f32 element-wise work runs on the host ([`crate::engine::kernels::elementwise`]):
    /// `--host-elementwise on` on the CPU backend, except inside compiled steps.
    pub fn host_elem(&self) -> bool {
        self.cpu_host(self.host_elementwise)
    }

    /// Whether a dense f32 decode step runs whole on the host in MLX's order
    /// ([`crate::engine::kernels::step`]): `--host-step on` with the two forks it is made of,
    /// on the CPU backend, except inside compiled steps.
    pub fn host_exact_step(&self) -> bool {
        self.cpu_host(self.host_step && self.host_matvec && self.host_elementwise)
    }

    /// An L1 host fork in effect: on, on the CPU backend (the host kernels read MLX's CPU
    /// buffers), and not inside compiled steps (a host call cannot be traced into a graph).
    fn cpu_host(&self, fork: bool) -> bool {
        fork && !self.compiled_decode && super::runtime::backend() == super::runtime::Backend::Cpu
    }

    /// The `(name, value)` pairs to pass on the command line to reproduce this value.
    pub fn to_args(&self) -> Vec<String> {
        FORKS
            .iter()
            .zip(self.to_values())
            .flat_map(|(f, v)| [format!("--{}", f.name), v])
            .collect()
    }
}

/// One fork's resolved value.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The table row.
    pub fork: &'static Fork,
    /// The value in effect.
    pub value: String,
    /// Whether it was given explicitly (otherwise it is the tier's default).
    pub explicit: bool,
    /// The strictest tier whose oracle this value keeps.
    pub keeps: Tier,
    /// Output class of this value.
    pub output: Output,
}

/// A tier plus explicit fork flags, resolved against the table.
#[derive(Debug, Clone)]
pub struct Resolution {
    /// The tier asked for (`--l1` when none was given).
    pub tier: Tier,
    /// Every fork, in table order.
    pub values: Vec<Resolved>,
    /// The typed value.
    pub forks: Forks,
    /// Documented warnings (a setting that has no effect), printed by the commands.
    pub warnings: Vec<String>,
}

/// Resolves `tier` (default L1) and explicit `(fork name, value)` pairs: the tier sets every
/// fork, an explicit flag overrides it. Unknown forks, bad values and contradictory
/// combinations are errors; settings without effect become warnings.
pub fn resolve(tier: Option<Tier>, explicit: &[(String, String)]) -> Result<Resolution> {
    let tier = tier.unwrap_or(Tier::L1);
    for (name, _) in explicit {
        if fork(name).is_none() {
            return Err(EngineError::Input(format!(
                "--{name} is not a fork; the forks are {}",
                FORKS
                    .iter()
                    .map(|f| format!("--{}", f.name))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    let cpu = super::runtime::backend() == super::runtime::Backend::Cpu;
    let mut values = Vec::with_capacity(FORKS.len());
    for f in FORKS {
        let given = explicit.iter().rev().find(|(n, _)| n == f.name);
        let value = given.map_or(f.default_in(tier), |(_, v)| v.as_str());
        let (mut keeps, mut output) = f.check(value)?;
        if f.name == "fused-sdpa" && value == "off" && !cpu {
            // Only MLX's CPU SDPA is the reference graph; GPU kernels sum in another order.
            (keeps, output) = (Tier::L3, Output::MayChange);
        }
        values.push(Resolved {
            fork: f,
            value: value.to_owned(),
            explicit: given.is_some(),
            keeps,
            output,
        });
    }
    let strs: Vec<&str> = values.iter().map(|r| r.value.as_str()).collect();
    let forks = Forks::from_values(&strs)?;
    let warnings = check_combination(&forks, &values)?;
    Ok(Resolution {
        tier,
        values,
        forks,
        warnings,
    })
}

/// Contradictions are errors; flags without effect are warnings.
fn check_combination(f: &Forks, values: &[Resolved]) -> Result<Vec<String>> {
    let explicit = |name: &str| values.iter().any(|r| r.fork.name == name && r.explicit);
    if f.fused_gelu {
        return Err(EngineError::Input(format!(
            "--fused-gelu on: mlxb has no custom fused GELU kernel for the {} backend (on CPU the compiled gelu of --compiled-activations on already runs as one fused kernel); use --fused-gelu off",
            super::runtime::backend().name()
        )));
    }
    let mut warnings = Vec::new();
    if f.perf_kernel && f.compiled_decode {
        warnings.push("--perf-kernel on with --compiled-decode on: the host 4-bit mat-vec cannot run inside a compiled MLX step, so quantized layers stay on MLX's kernels".into());
    }
    if f.kv_quant == KvQuant::Off {
        for name in ["kv-group-size", "quantized-kv-start"] {
            if explicit(name) {
                warnings.push(format!("--{name} has no effect while --kv-quant is off"));
            }
        }
    }
    if !f.compiled_activations && explicit("fused-gelu") {
        warnings.push("--fused-gelu off with --compiled-activations off: gelu runs eagerly".into());
    }
    Ok(warnings)
}

impl Resolution {
    /// The strictest tier every resolved value keeps (which oracle the combination matches).
    pub fn holds(&self) -> Tier {
        self.values
            .iter()
            .map(|r| r.keeps)
            .max()
            .unwrap_or(Tier::L1)
    }

    /// The forks whose value makes the combination leave the asked-for tier.
    pub fn leaving(&self) -> Vec<&Resolved> {
        self.values.iter().filter(|r| r.keeps > self.tier).collect()
    }

    /// The human-readable report of `mlxb flags`.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let width = FORKS.iter().map(|f| f.name.len()).max().unwrap_or(0) + 2;
        let _ = writeln!(s, "tier asked: --{}", self.tier.flag());
        for r in &self.values {
            let _ = writeln!(
                s,
                "  --{:<width$} {:<7} {:<15} keeps {}  output {}",
                r.fork.name,
                r.value,
                if r.explicit {
                    "(explicit)".to_owned()
                } else {
                    format!("(--{} default)", self.tier.flag())
                },
                r.keeps,
                r.output.name(),
            );
        }
        let holds = self.holds();
        let _ = writeln!(s, "parity: {holds} = {}", holds.oracle());
        let leaving = self.leaving();
        if leaving.is_empty() {
            let _ = writeln!(s, "stays in --{}", self.tier.flag());
        } else {
            let names: Vec<String> = leaving
                .iter()
                .map(|r| format!("--{} {} ({})", r.fork.name, r.value, r.keeps))
                .collect();
            let _ = writeln!(
                s,
                "leaves --{} because of: {}",
                self.tier.flag(),
                names.join(", ")
            );
        }
        for w in &self.warnings {
            let _ = writeln!(s, "warning: {w}");
        }
        s
    }

    /// The machine-readable report of `mlxb flags --json`.
    pub fn json(&self) -> serde_json::Value {
        let holds = self.holds();
        serde_json::json!({
            "tier": self.tier.flag(),
            "forks": self.values.iter().map(|r| serde_json::json!({
                "name": r.fork.name,
                "value": r.value,
                "explicit": r.explicit,
                "keeps": r.keeps.flag(),
                "output": r.output.name(),
            })).collect::<Vec<_>>(),
            "holds": holds.flag(),
            "oracle": holds.oracle(),
            "leaves_tier_because": self.leaving().iter().map(|r| r.fork.name).collect::<Vec<_>>(),
            "warnings": self.warnings,
        })
    }
}

/// The README flag table (Markdown), generated from [`FORKS`].
pub fn markdown_table() -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| flag | values | --l1 | --l2 | --l3 | keeps (per value) | output vs L1 | what it does |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for f in FORKS {
        let (keeps, output) = match &f.domain {
            Domain::Choices(c) => (
                c.iter()
                    .map(|c| format!("{}: {}", c.value, c.keeps))
                    .collect::<Vec<_>>()
                    .join(", "),
                c.iter()
                    .filter(|c| c.output != Output::Identical)
                    .map(|c| format!("{}: {}", c.value, c.output.name()))
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
            Domain::Count => ("any: L1".to_owned(), String::new()),
        };
        let cell = |t: &str| t.replace('|', "\\|");
        let _ = writeln!(
            s,
            "| `--{}` | `{}` | {} | {} | {} | {} | {} | {} |",
            f.name,
            cell(&f.values_hint()),
            f.defaults[0],
            f.defaults[1],
            f.defaults[2],
            keeps,
            if output.is_empty() {
                "identical".into()
            } else {
                output
            },
            cell(f.help)
        );
    }
    let _ = writeln!(s);
    for t in Tier::ALL {
        let _ = writeln!(s, "- `--{}`: {}", t.flag(), t.oracle());
    }
    s
}
