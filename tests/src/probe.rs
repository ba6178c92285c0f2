//! Drives `lb-probe` (the traffic helper binary of this package) from tests.

use std::{process::Stdio, time::Duration};

use serde_json::Value;

use crate::process::{Place, Proc, run_in, workspace_bin};

fn probe() -> std::path::PathBuf {
    workspace_bin("lb-probe")
}

/// Starts `lb-probe serve` and waits until it listens.
pub fn server(place: Place<'_>, name: &str, tcp: &[&str], udp: &[&str]) -> Proc {
    server_with_sctp(place, name, tcp, udp, &[])
}

/// [`server`] with SCTP listeners too (the kernel must have SCTP: `crate::sctp::sctp_available`).
pub fn server_with_sctp(place: Place<'_>, name: &str, tcp: &[&str], udp: &[&str], sctp: &[&str]) -> Proc {
    let mut cmd = std::process::Command::new(probe());
    cmd.arg("serve")
        .arg("--name")
        .arg(name)
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    for a in tcp {
        cmd.arg("--tcp").arg(a);
    }
    for a in udp {
        cmd.arg("--udp").arg(a);
    }
    for a in sctp {
        cmd.arg("--sctp").arg(a);
    }
    place.apply(&mut cmd);
    let mut proc = Proc::spawn_command(cmd);
    proc.wait_for_line(Duration::from_secs(10), |l| l.contains("\"ready\""));
    proc
}

fn json_lines(out: &std::process::Output) -> Vec<Value> {
    assert!(
        out.status.success(),
        "lb-probe failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("lb-probe printed {l:?}: {e}")))
        .collect()
}

/// `count` TCP connections to `to`, one JSON result each.
pub fn tcp(place: Place<'_>, to: &str, count: u32) -> Vec<Value> {
    json_lines(&run_in(
        place,
        probe(),
        &["tcp", "--connect", to, "--count", &count.to_string()],
    ))
}

/// One TCP connection that sends `payload` bytes and gets their checksum back.
pub fn tcp_bulk(place: Place<'_>, to: &str, payload: usize) -> Value {
    let out = run_in(
        place,
        probe(),
        &[
            "tcp",
            "--connect",
            to,
            "--payload",
            &payload.to_string(),
            "--timeout-ms",
            "20000",
        ],
    );
    json_lines(&out).remove(0)
}

/// `count` SCTP associations to `to`, one JSON result each (as [`tcp`]'s).
pub fn sctp(place: Place<'_>, to: &str, count: u32) -> Vec<Value> {
    json_lines(&run_in(
        place,
        probe(),
        &["sctp", "--connect", to, "--count", &count.to_string()],
    ))
}

/// One SCTP association to `to` from local port `source_port`: runs with the same port have the
/// same addresses and ports.
pub fn sctp_from(place: Place<'_>, to: &str, source_port: u16) -> Value {
    let port = source_port.to_string();
    let args = ["sctp", "--connect", to, "--source-port", &port];
    json_lines(&run_in(place, probe(), &args)).remove(0)
}

/// `count` UDP exchanges with `to`, from a connected or an unconnected socket.
pub fn udp(place: Place<'_>, to: &str, count: u32, connected: bool) -> Vec<Value> {
    let count = count.to_string();
    let mut args = vec!["udp", "--to", to, "--count", &count];
    if connected {
        args.push("--connected");
    }
    json_lines(&run_in(place, probe(), &args))
}

/// One UDP exchange with `to` from local port `source_port`: runs with the same port are one
/// flow (its 5-tuple), as a client's long-lived socket would send.
pub fn udp_from(place: Place<'_>, to: &str, source_port: u16) -> Value {
    let port = source_port.to_string();
    let args = ["udp", "--to", to, "--source-port", &port];
    json_lines(&run_in(place, probe(), &args)).remove(0)
}

/// One UDP datagram of `payload` bytes (a pattern) and its answer, as large: past the MTU both go
/// in IP fragments. `intact` in the result: the server got every byte, and the answer came whole.
pub fn udp_payload(place: Place<'_>, to: &str, payload: usize) -> Value {
    let payload = payload.to_string();
    let args = ["udp", "--to", to, "--payload", &payload, "--timeout-ms", "2000"];
    json_lines(&run_in(place, probe(), &args))
        .into_iter()
        .next()
        .unwrap_or(Value::Null)
}

/// Starts `lb-probe hold`: one long-lived TCP connection exchanging a message every 50 ms.
pub fn hold(place: Place<'_>, to: &str, seconds: u64) -> Proc {
    hold_every(place, to, seconds, 50, 2000)
}

/// `lb-probe hold` exchanging a message every `interval_ms` (a mostly idle connection when long).
/// `read_timeout_ms`: how long one exchange may wait for its reply before the connection counts
/// as broken.
pub fn hold_every(place: Place<'_>, to: &str, seconds: u64, interval_ms: u64, read_timeout_ms: u64) -> Proc {
    let mut cmd = std::process::Command::new(probe());
    cmd.args([
        "hold",
        "--connect",
        to,
        "--interval-ms",
        &interval_ms.to_string(),
        "--seconds",
        &seconds.to_string(),
        "--read-timeout-ms",
        &read_timeout_ms.to_string(),
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped());
    place.apply(&mut cmd);
    Proc::spawn_command(cmd)
}

/// Starts `lb-probe resolve`: a resolver's loop on one long-lived connected UDP socket, a query
/// every 50 ms for `seconds` (a new socket after any error but a timeout).
pub fn resolve(place: Place<'_>, to: &str, seconds: u64) -> Proc {
    let mut cmd = std::process::Command::new(probe());
    cmd.args(["resolve", "--to", to, "--seconds", &seconds.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    place.apply(&mut cmd);
    Proc::spawn_command(cmd)
}

/// Waits (up to `timeout`) for an `lb-probe resolve` to end: its last line (`{"done", "queries",
/// "sockets"}`) and one line per query.
pub fn resolved(resolver: &mut Proc, timeout: std::time::Duration) -> (Value, Vec<Value>) {
    let done = resolver.wait_for_line(timeout, |l| l.contains("\"done\""));
    let done: Value = serde_json::from_str(&done).expect("a JSON line");
    let queries = resolver
        .stdout_lines()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("seq").is_some())
        .collect();
    (done, queries)
}

/// The server name in a successful result.
pub fn server_of(result: &Value) -> Option<&str> {
    result.pointer("/reply/server").and_then(Value::as_str)
}

/// One HTTP GET to `to` (host:port) from `place`: {"ok", "status", "headers", "body"}.
pub fn http_get(place: Place<'_>, to: &str, path: &str) -> Value {
    json_lines(&run_in(place, probe(), &["http", "--to", to, "--path", path])).remove(0)
}
