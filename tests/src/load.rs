//! Continuous load for the reliability scenarios: `lb-probe load` processes whose per-request
//! results (with their start time) are collected while they run.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
};

use serde_json::Value;

use crate::process::{Place, Proc, workspace_bin};

/// How long one request may take: long enough for one retransmitted SYN or segment (TCP's first
/// retransmission comes after 1 s, as for any real client), so a test process starved by a busy
/// machine is not taken for a lost request. Requests over `SLOW_US` are counted and shown.
pub const TIMEOUT_MS: u64 = 3000;
/// A request slower than this needed a retransmission (or waited for a CPU): reported as slow.
pub const SLOW_US: u64 = 1_000_000;

pub struct Load {
    proc: Proc,
    results: Arc<Mutex<Vec<Value>>>,
}

impl Load {
    /// `kind`: "tcp", "udp" or "http"; `persistent`: UDP from one long-lived socket.
    pub fn start(place: Place<'_>, to: &str, kind: &str, interval_ms: u64, persistent: bool) -> Load {
        let mut cmd = Command::new(workspace_bin("lb-probe"));
        cmd.args([
            "load",
            "--to",
            to,
            "--kind",
            kind,
            "--interval-ms",
            &interval_ms.to_string(),
            "--timeout-ms",
            &TIMEOUT_MS.to_string(),
        ]);
        if persistent {
            cmd.arg("--persistent");
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped());
        place.apply(&mut cmd);
        let mut proc = Proc::spawn_command(cmd);
        let stdout = proc.child_mut().stdout.take().expect("piped stdout");
        let results = Arc::new(Mutex::new(Vec::new()));
        let sink = results.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    sink.lock().expect("results lock").push(v);
                }
            }
        });
        Load { proc, results }
    }

    /// The `lb-probe load` process.
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// Results so far.
    pub fn results(&self) -> Vec<Value> {
        self.results.lock().expect("results lock").clone()
    }

    /// Stops the load and returns every result.
    pub fn stop(mut self) -> Vec<Value> {
        self.proc.signal(libc::SIGKILL);
        let _ = self.proc.wait_timeout(std::time::Duration::from_secs(5));
        std::thread::sleep(std::time::Duration::from_millis(50));
        self.results()
    }
}

/// (attempted, failed) over results.
pub fn tally(results: &[Value]) -> (u64, u64) {
    let failed = results.iter().filter(|r| r["ok"] != true).count() as u64;
    (results.len() as u64, failed)
}

/// Successful requests that took over `SLOW_US`.
pub fn slow(results: &[Value]) -> u64 {
    results
        .iter()
        .filter(|r| r["ok"] == true && r["elapsed_us"].as_u64().is_some_and(|us| us > SLOW_US))
        .count() as u64
}

/// A scenario's row for one load: attempted, failed, and slow (served after over a second).
pub fn row(what: &str, results: &[Value]) -> Value {
    let (attempted, failed) = tally(results);
    serde_json::json!({"load": what, "attempted": attempted, "failed": failed, "slow (> 1 s)": slow(results)})
}

/// The failed results, one line each (their start time in µs since the epoch, and the error), for
/// assertion messages: a rare failure is only understood with when and how it failed.
pub fn failures(what: &str, results: &[Value]) -> Vec<String> {
    results
        .iter()
        .filter(|r| r["ok"] != true)
        .map(|r| {
            format!(
                "{what}: at {} µs, after {} µs: {} (errno {})",
                r["t_us"], r["elapsed_us"], r["error"], r["errno"]
            )
        })
        .collect()
}
