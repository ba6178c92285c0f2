//! Continuous load for the reliability scenarios: `lb-probe load` processes whose per-request
//! results (with their start time) are collected while they run.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
};

use serde_json::Value;

use crate::process::{Place, Proc, workspace_bin};

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
            "1000",
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

/// The failed results, one line each (their start time in µs since the epoch, and the error), for
/// assertion messages: a rare failure is only understood with when and how it failed.
pub fn failures(what: &str, results: &[Value]) -> Vec<String> {
    results
        .iter()
        .filter(|r| r["ok"] != true)
        .map(|r| {
            format!(
                "{what}: at {} µs: {} (errno {})",
                r["t_us"], r["error"], r["errno"]
            )
        })
        .collect()
}
