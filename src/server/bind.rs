//! Where the server may listen. Loopback is the default; any other address exposes the
//! model (and the machine's CPU) to the network, so it takes an explicit `--allow-remote`,
//! and doing it without `--api-key` is warned about on stderr.

use crate::engine::error::{EngineError, Result};
use std::net::{IpAddr, ToSocketAddrs};

/// Checks `--host` before anything is loaded: an error (exit code 2) for a host that does not
/// resolve, or one beyond loopback without `allow_remote`. Returns whether it is loopback.
pub fn check_host(host: &str, allow_remote: bool) -> Result<bool> {
    let ips: Vec<IpAddr> = (host, 0)
        .to_socket_addrs()
        .map_err(|e| {
            EngineError::Input(format!(
                "--host {host} does not resolve ({e}); give an IP address such as 127.0.0.1"
            ))
        })?
        .map(|a| a.ip())
        .collect();
    if ips.is_empty() {
        return Err(EngineError::Input(format!(
            "--host {host} resolves to no address; give an IP address such as 127.0.0.1"
        )));
    }
    let loopback = ips.iter().all(IpAddr::is_loopback);
    if !loopback && !allow_remote {
        return Err(EngineError::Input(format!(
            "--host {host} would accept connections from other machines; pass --allow-remote to do that on purpose (with --api-key), or keep the default 127.0.0.1"
        )));
    }
    Ok(loopback)
}

#[cfg(test)]
mod tests {
    use super::check_host;

    #[test]
    fn only_loopback_without_allow_remote() {
        assert!(check_host("127.0.0.1", false).unwrap());
        assert!(check_host("::1", false).unwrap());
        assert!(check_host("localhost", false).unwrap());
        for host in ["0.0.0.0", "::", "192.168.1.10"] {
            let err = check_host(host, false).unwrap_err().to_string();
            assert!(err.contains("--allow-remote"), "{err}");
            assert!(!check_host(host, true).unwrap());
        }
        assert!(check_host("no such host !", false).is_err());
    }
}
