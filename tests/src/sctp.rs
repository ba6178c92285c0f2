//! Whether the running kernel has SCTP, for the tests that need real SCTP sockets: the protocol
//! is often a module (`sctp.ko`) that nothing has loaded yet, so this loads it, from the
//! machine's own modules or from an extracted kernel package's. A guest of `cargo xtask
//! kernel-test` sees this machine's filesystem, whose `/lib/modules` holds no directory of the
//! guest's release unless virtme-ng links one in (1.42 does): the xtask also names the extracted
//! package's module root in `LB_KERNEL_MODULES_ROOT` (the directory holding
//! `lib/modules/<release>/`), tried when `modprobe sctp` finds nothing. Where there is no SCTP,
//! [`sctp_available`] says what was tried, so that a test can skip saying why.

use std::{ffi::OsStr, process::Command, sync::OnceLock};

/// The directory that holds `lib/modules/<release>/` for the running kernel, when its modules are
/// not under `/`.
pub const MODULES_ROOT_ENV: &str = "LB_KERNEL_MODULES_ROOT";

/// `Ok` when an SCTP socket can be made, after loading the module if it has to; else what was
/// tried and how it failed. Asked once per process (loading a module is for the whole kernel).
pub fn sctp_available() -> Result<(), String> {
    static AVAILABLE: OnceLock<Result<(), String>> = OnceLock::new();
    AVAILABLE.get_or_init(probe_and_load).clone()
}

/// socket(AF_INET, SOCK_STREAM, IPPROTO_SCTP), closed at once.
fn sctp_socket() -> std::io::Result<()> {
    socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::STREAM,
        Some(socket2::Protocol::from(libc::IPPROTO_SCTP)),
    )
    .map(drop)
}

fn probe_and_load() -> Result<(), String> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|r| r.trim().to_string())
        .unwrap_or_else(|_| "?".into());
    const SOCKET: &str = "socket(AF_INET, SOCK_STREAM, IPPROTO_SCTP)";
    let mut tried = Vec::new();
    match sctp_socket() {
        Ok(()) => return Ok(()),
        // The one error a module can cure.
        Err(e) if e.raw_os_error() == Some(libc::EPROTONOSUPPORT) => tried.push(format!("{SOCKET}: {e}")),
        Err(e) => return Err(format!("{SOCKET} on Linux {release}: {e}")),
    }
    let mut loaded = match modprobe(&["sctp".as_ref()]) {
        Ok(()) => true,
        Err(why) => {
            tried.push(why);
            false
        }
    };
    if !loaded {
        match std::env::var_os(MODULES_ROOT_ENV) {
            Some(root) => match modprobe(&["-d".as_ref(), &root, "sctp".as_ref()]) {
                Ok(()) => loaded = true,
                Err(why) => tried.push(why),
            },
            None => tried.push(format!(
                "{MODULES_ROOT_ENV} unset (no extracted kernel's modules to load from)"
            )),
        }
    }
    if loaded {
        match sctp_socket() {
            Ok(()) => return Ok(()),
            Err(e) => tried.push(format!("{SOCKET} after loading the module: {e}")),
        }
    }
    Err(format!("no SCTP on Linux {release}: {}", tried.join("; ")))
}

/// Runs `modprobe ARGS`; on failure, the command and what it said.
fn modprobe(args: &[&OsStr]) -> Result<(), String> {
    let shown = args
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let out = Command::new("modprobe")
        .args(args)
        .output()
        .map_err(|e| format!("`modprobe {shown}`: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "`modprobe {shown}` failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

#[cfg(test)]
mod tests {
    use super::sctp_available;
    use crate::{
        netns::{NetNs, veth},
        probe,
        process::Place,
    };

    /// `lb-probe sctp` reaches `lb-probe serve --sctp` in another namespace, in both families, and
    /// the server names itself and the client's address (its port too, when the client fixes it).
    #[test]
    fn an_sctp_association_between_two_namespaces_gets_the_servers_answer() {
        if let Err(why) = sctp_available() {
            eprintln!("skipped: {why}");
            return;
        }
        crate::require_root();
        let (client, server) = (NetNs::new("lbsctp"), NetNs::new("lbsctp"));
        veth(
            &client,
            "eth0",
            Some("10.99.0.1/24"),
            &server,
            "eth0",
            Some("10.99.0.2/24"),
        );
        // Usable at once: no duplicate address detection.
        client.ip(&["-6", "addr", "add", "fd00:99::1/64", "dev", "eth0", "nodad"]);
        server.ip(&["-6", "addr", "add", "fd00:99::2/64", "dev", "eth0", "nodad"]);
        let _server = probe::server_with_sctp(
            Place::netns(&server),
            "sctp-server",
            &[],
            &[],
            &["0.0.0.0:9132", "[::]:9133"],
        );
        for (to, client_ip) in [
            ("10.99.0.2:9132", "10.99.0.1"),
            ("[fd00:99::2]:9133", "fd00:99::1"),
        ] {
            let results = probe::sctp(Place::netns(&client), to, 2);
            assert_eq!(results.len(), 2, "{results:?}");
            for r in &results {
                assert_eq!(r["ok"], true, "{r}");
                assert_eq!(probe::server_of(r), Some("sctp-server"), "{r}");
                assert_eq!(r["peer"], to, "{r}");
                let seen: std::net::SocketAddr = r["reply"]["client"]
                    .as_str()
                    .and_then(|c| c.parse().ok())
                    .unwrap_or_else(|| panic!("no client address in {r}"));
                assert_eq!(seen.ip().to_string(), client_ip, "{r}");
            }
            eprintln!("{to}: {}", results[0]);
        }
        let fixed = probe::sctp_from(Place::netns(&client), "10.99.0.2:9132", 40132);
        assert_eq!(fixed["ok"], true, "{fixed}");
        assert_eq!(fixed["reply"]["client"], "10.99.0.1:40132", "{fixed}");
        eprintln!("from port 40132: {fixed}");
    }
}
