//! `mlxb launch`: starts one mlxb process per rank with the environment `mlx.launch` gives its
//! ranks (`MLX_RANK`, `MLX_HOSTFILE` for the ring backend), so users need no Python to run
//! `generate` or `serve` across ranks. Local ranks are child processes; a hostfile's other
//! hosts are reached over ssh, as `mlx.launch` reaches them. The launcher watches the ranks:
//! when one fails, it stops the others and says which one.

use crate::engine::distributed::{HOSTFILE_ENV, RANK_ENV};
use crate::engine::error::EngineError;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// A signal the launcher received and has not yet passed on to the ranks (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn note_signal(sig: libc::c_int) {
    RECEIVED.store(sig, Ordering::SeqCst);
}

/// Arguments of `mlxb launch`.
#[derive(Debug, Args)]
#[command(trailing_var_arg = true)]
pub struct LaunchArgs {
    /// Number of local ranks (without --hostfile)
    #[arg(short = 'n', long = "ranks", default_value_t = 2)]
    pub ranks: usize,
    /// `mlx.launch`'s JSON hostfile: one entry per rank, `{"ssh": host, "ips": [address]}`
    /// (a list, or an object with `hosts` and optional `envs`); hosts other than this machine
    /// are started over ssh
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// First TCP port of the ring; rank r listens on this port + r (`mlx.launch`'s default)
    #[arg(long, default_value_t = 32323)]
    pub starting_port: u16,
    /// The subcommand each rank runs, with its arguments (`generate ...` or `serve ...`)
    #[arg(required = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// One rank: where it runs and the address its ring neighbours reach it at.
#[derive(Debug, Clone, PartialEq)]
struct RankHost {
    ssh: String,
    ip: String,
}

/// The ranks a hostfile names, and the environment it sets on each.
#[derive(Debug, PartialEq)]
struct Plan {
    hosts: Vec<RankHost>,
    envs: Vec<(String, String)>,
}

fn bad_hostfile(path: &Path, why: &str) -> EngineError {
    EngineError::file(
        path,
        format!("{why}; see `mlxb launch --help` for the format"),
    )
}

/// Reads `mlx.launch`'s hostfile format.
fn read_hostfile(path: &Path) -> Result<Plan, EngineError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EngineError::file(path, format!("cannot read the hostfile ({e})")))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| bad_hostfile(path, &format!("the hostfile is not valid JSON ({e})")))?;
    let (hosts, envs) = match &value {
        serde_json::Value::Array(hosts) => (hosts.clone(), Vec::new()),
        serde_json::Value::Object(o) => {
            if let Some(b) = o.get("backend").and_then(|b| b.as_str()) {
                if !b.is_empty() && b != "ring" {
                    return Err(bad_hostfile(
                        path,
                        &format!("backend \"{b}\" is not one mlxb launch starts (it starts the ring backend)"),
                    ));
                }
            }
            let hosts = o
                .get("hosts")
                .and_then(|h| h.as_array())
                .cloned()
                .ok_or_else(|| bad_hostfile(path, "`hosts` is missing or not a list"))?;
            let envs = o
                .get("envs")
                .and_then(|e| e.as_array())
                .cloned()
                .unwrap_or_default();
            (hosts, envs)
        }
        _ => {
            return Err(bad_hostfile(
                path,
                "the hostfile must be a list of hosts or an object with `hosts`",
            ))
        }
    };
    let mut plan = Plan {
        hosts: Vec::new(),
        envs: Vec::new(),
    };
    for (rank, h) in hosts.iter().enumerate() {
        let ssh = h.get("ssh").and_then(|s| s.as_str());
        let ip = h
            .get("ips")
            .and_then(|i| i.as_array())
            .and_then(|i| i.first())
            .and_then(|i| i.as_str());
        match (ssh, ip) {
            (Some(ssh), Some(ip)) if !ssh.is_empty() && !ip.is_empty() => plan.hosts.push(RankHost {
                ssh: ssh.to_owned(),
                ip: ip.to_owned(),
            }),
            _ => {
                return Err(bad_hostfile(
                    path,
                    &format!("host {rank} needs `ssh` (a host name) and `ips` (at least one address the other ranks reach it at)"),
                ))
            }
        }
    }
    if plan.hosts.len() < 2 {
        return Err(bad_hostfile(path, "the hostfile names fewer than 2 hosts"));
    }
    for e in envs {
        match e.as_str().and_then(|e| e.split_once('=')) {
            Some((k, v))
                if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                plan.envs.push((k.to_owned(), v.to_owned()))
            }
            _ => {
                return Err(bad_hostfile(
                    path,
                    &format!("`envs` entry {e} is not NAME=value"),
                ))
            }
        }
    }
    Ok(plan)
}

/// The ring's addresses (`MLX_HOSTFILE`'s content): per rank, `ip:port`, ports counted up from
/// `starting_port` as `mlx.launch` counts them.
fn ring_hostfile(hosts: &[RankHost], starting_port: u16) -> Result<String, EngineError> {
    let mut ring = Vec::new();
    for (rank, h) in hosts.iter().enumerate() {
        let port = u32::from(starting_port) + rank as u32;
        if port > u32::from(u16::MAX) {
            return Err(EngineError::Input(format!(
                "--starting-port {starting_port} leaves no port for rank {rank}; give a lower one"
            )));
        }
        ring.push(vec![format!("{}:{port}", h.ip)]);
    }
    Ok(serde_json::Value::from(ring).to_string())
}

fn is_local(host: &str) -> bool {
    matches!(host, "127.0.0.1" | "localhost" | "::1")
}

/// Single-quotes `s` for a POSIX shell.
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Starts one rank.
fn start_rank(
    rank: usize,
    host: &RankHost,
    ring: &str,
    ring_file: &Path,
    plan_envs: &[(String, String)],
    command: &[String],
) -> anyhow::Result<Child> {
    let exe = std::env::current_exe()?;
    let stdin = if rank == 0 {
        Stdio::inherit()
    } else {
        Stdio::null()
    };
    if is_local(&host.ssh) {
        let mut c = Command::new(&exe);
        c.args(command)
            .env(RANK_ENV, rank.to_string())
            .env(HOSTFILE_ENV, ring_file)
            .envs(plan_envs.iter().map(|(k, v)| (k, v)))
            .stdin(stdin);
        // A launcher that is killed (SIGKILL leaves it no time to stop its ranks) takes its
        // local ranks with it instead of leaving them waiting for each other.
        #[cfg(target_os = "linux")]
        // SAFETY: prctl is async-signal-safe; the closure runs in the child before exec.
        unsafe {
            use std::os::unix::process::CommandExt;
            c.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        return Ok(c.spawn()?);
    }
    // As mlx.launch does: the ring's addresses in a temporary file on the remote host, then
    // the same binary at the same path in the same directory.
    let cwd = std::env::current_dir()?;
    let mut script = format!(
        "cd {} 2>/dev/null; f=$(mktemp) && printf '%s' {} >\"$f\" && export {HOSTFILE_ENV}=\"$f\" {RANK_ENV}={rank}",
        quoted(&cwd.to_string_lossy()),
        quoted(ring)
    );
    for (k, v) in plan_envs {
        script.push_str(&format!(" {k}={}", quoted(v)));
    }
    script.push_str(&format!(" && exec {}", quoted(&exe.to_string_lossy())));
    for a in command {
        script.push(' ');
        script.push_str(&quoted(a));
    }
    let ssh = std::env::var_os("MLXB_SSH").unwrap_or_else(|| "ssh".into());
    Ok(Command::new(ssh)
        .args(["-o", "LogLevel=QUIET", &host.ssh, &script])
        .stdin(stdin)
        .spawn()?)
}

/// Entry point of `mlxb launch`.
pub fn run(args: LaunchArgs) -> anyhow::Result<()> {
    let sub = args.command.first().map(String::as_str).unwrap_or("");
    if !matches!(sub, "generate" | "serve") {
        return Err(EngineError::Input(format!(
            "mlxb launch runs `generate` or `serve` on every rank, not `{sub}`; write `mlxb launch -n 2 -- generate --model DIR ...`"
        ))
        .into());
    }
    let plan = match &args.hostfile {
        Some(path) => read_hostfile(path)?,
        None => {
            if args.ranks < 2 {
                return Err(EngineError::Input(
                    "-n must be at least 2 (one rank is `mlxb generate` or `mlxb serve` alone)"
                        .into(),
                )
                .into());
            }
            let local = RankHost {
                ssh: "127.0.0.1".into(),
                ip: "127.0.0.1".into(),
            };
            Plan {
                hosts: vec![local; args.ranks],
                envs: Vec::new(),
            }
        }
    };
    let ring = ring_hostfile(&plan.hosts, args.starting_port)?;
    let ring_file = tempfile::Builder::new()
        .prefix("mlxb-ring-")
        .suffix(".json")
        .tempfile()?;
    std::fs::write(ring_file.path(), &ring)?;
    // Ctrl-C or a SIGTERM to the launcher goes on to the ranks (a server's rank 0 shuts down
    // gracefully and ends the other ranks); the launcher waits for them.
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, note_signal as *const () as libc::sighandler_t);
        libc::signal(
            libc::SIGTERM,
            note_signal as *const () as libc::sighandler_t,
        );
    }
    let mut children: Vec<Option<Child>> = Vec::new();
    for (rank, host) in plan.hosts.iter().enumerate() {
        match start_rank(
            rank,
            host,
            &ring,
            ring_file.path(),
            &plan.envs,
            &args.command,
        ) {
            Ok(child) => children.push(Some(child)),
            Err(e) => {
                stop_all(&mut children);
                return Err(anyhow::anyhow!(
                    "could not start rank {rank} on {}: {e}",
                    host.ssh
                ));
            }
        }
    }
    // A server's other ranks end when its rank 0 tells them; a generation's ranks are stopped
    // alike.
    let signalled = if sub == "serve" { 1 } else { children.len() };
    supervise(&mut children, &plan.hosts, signalled)
}

/// Waits for every rank; the first to fail stops the others and sets the exit status. A signal
/// the launcher receives goes on to the first `signalled` ranks.
fn supervise(
    children: &mut [Option<Child>],
    hosts: &[RankHost],
    signalled: usize,
) -> anyhow::Result<()> {
    loop {
        let sig = RECEIVED.swap(0, Ordering::SeqCst);
        if sig != 0 {
            for child in children.iter().take(signalled).flatten() {
                // SAFETY: signalling a child process this launcher started and has not reaped.
                unsafe {
                    libc::kill(child.id() as i32, sig);
                }
            }
        }
        let mut running = 0;
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait()? {
                None => running += 1,
                Some(status) if status.success() => *slot = None,
                Some(status) => {
                    *slot = None;
                    stop_all(children);
                    let code = status.code().unwrap_or(1);
                    eprintln!(
                        "mlxb launch: rank {rank} ({}) {}; the other ranks were stopped",
                        hosts[rank].ssh,
                        match status.code() {
                            Some(c) => format!("exited with code {c}"),
                            None => "was killed by a signal".to_owned(),
                        }
                    );
                    std::process::exit(code.clamp(1, 255));
                }
            }
        }
        if running == 0 {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stops the ranks still running: SIGTERM, then SIGKILL after five seconds.
fn stop_all(children: &mut [Option<Child>]) {
    for child in children.iter_mut().flatten() {
        // SAFETY: signalling a child process this launcher started and has not reaped.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for child in children.iter_mut().flatten() {
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn reads_both_hostfile_forms_and_numbers_ports_like_mlx_launch() {
        let list =
            write(r#"[{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2", "x"]}]"#);
        let plan = read_hostfile(list.path()).unwrap();
        assert_eq!(plan.hosts[1].ip, "10.0.0.2");
        assert_eq!(
            ring_hostfile(&plan.hosts, 32323).unwrap(),
            r#"[["10.0.0.1:32323"],["10.0.0.2:32324"]]"#
        );
        let object = write(
            r#"{"backend": "ring", "envs": ["A_B=1"], "hosts": [{"ssh": "a", "ips": ["1.1.1.1"]}, {"ssh": "b", "ips": ["2.2.2.2"]}]}"#,
        );
        let plan = read_hostfile(object.path()).unwrap();
        assert_eq!(plan.envs, vec![("A_B".to_owned(), "1".to_owned())]);
    }

    #[test]
    fn bad_hostfiles_name_the_fault() {
        for (text, needle) in [
            ("{", "not valid JSON"),
            (
                r#"[{"ssh": "a", "ips": []}, {"ssh": "b", "ips": ["1"]}]"#,
                "host 0 needs",
            ),
            (r#"[{"ssh": "a", "ips": ["1"]}]"#, "fewer than 2"),
            (r#"{"backend": "mpi", "hosts": []}"#, "backend \"mpi\""),
            (
                r#"{"envs": ["=1"], "hosts": [{"ssh": "a", "ips": ["1"]}, {"ssh": "b", "ips": ["2"]}]}"#,
                "not NAME=value",
            ),
        ] {
            let f = write(text);
            let err = read_hostfile(f.path()).unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(quoted("it's"), r"'it'\''s'");
    }
}
