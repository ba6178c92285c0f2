//! The real `lb-agent` binary, run by a test inside the test's "node" network namespace, with its
//! pins in the test's private bpffs and its socket programs on the test's cgroup.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::{
    cgroup::Cgroup,
    netns::NetNs,
    process::{Place, Proc, workspace_bin},
};

/// The log line the agent prints after a sync that wrote something (or a full one).
pub const SYNCED: &str = "data path programmed";
/// The debug line the agent prints after a sync that had nothing to write.
pub const UP_TO_DATE: &str = "data path up to date";
/// The log line the agent prints once its programs are attached (after the first sync).
pub const ATTACHED: &str = "data path attached";

pub struct AgentOptions<'a> {
    pub netns: &'a NetNs,
    pub cgroup: &'a Cgroup,
    pub bpf_root: PathBuf,
    pub node_name: String,
    /// `--manifests DIR` (static mode) ...
    pub manifests: Option<PathBuf>,
    /// ... or `--kubeconfig FILE`.
    pub kubeconfig: Option<PathBuf>,
    pub extra_args: Vec<String>,
}

pub struct Agent {
    proc: Proc,
    log: Arc<Mutex<Vec<String>>>,
    /// Set when the agent's stderr closes (it exited).
    exited: Arc<std::sync::atomic::AtomicBool>,
}

/// How long an agent may take to load, program and attach its data path: 30 s, or 600 s in an
/// emulated guest of `cargo xtask kernel-test` (`LB_TEST_EMULATED`), where the verifier alone
/// takes 25 s or more (Linux 6.1 walks `lb_tc_ingress` and the two SCTP programs for about 1.4M
/// steps in all, docs/kernels.md), and minutes when the host is busy: in a `./x test` of
/// 2026-12-03 beside other work, the third agent of `sctp_associations_through_the_tc_path` took
/// 168 s to load its data path and missed 240 s to attach it. A bound for a hung start, not a
/// speed target; each guest's own cap (xtask/src/kernel) bounds the whole run.
pub fn start_timeout() -> Duration {
    if std::env::var_os("LB_TEST_EMULATED").is_some() {
        Duration::from_secs(600)
    } else {
        Duration::from_secs(30)
    }
}

impl Agent {
    /// Starts the agent and waits for its first sync.
    pub fn start(opts: AgentOptions<'_>) -> Agent {
        let agent = Agent::spawn(opts);
        agent.wait_for_line(ATTACHED, start_timeout());
        agent
    }

    /// Starts the agent without waiting for anything (a test that acts on its start-up).
    pub fn spawn(opts: AgentOptions<'_>) -> Agent {
        let mut cmd = Command::new(workspace_bin("lb-agent"));
        cmd.arg("--bpf-root")
            .arg(&opts.bpf_root)
            .arg("--cgroup-root")
            .arg(opts.cgroup.path())
            .arg("--hostname-override")
            .arg(&opts.node_name)
            .arg("--sync-period")
            .arg("200ms")
            .args(&opts.extra_args)
            .env(
                "RUST_LOG",
                // lb_agent::agent at debug: a sync that changes nothing says so at debug only.
                std::env::var("LB_AGENT_LOG").unwrap_or_else(|_| "info,lb_agent::agent=debug".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(dir) = &opts.manifests {
            cmd.arg("--manifests").arg(dir);
        }
        if let Some(kubeconfig) = &opts.kubeconfig {
            cmd.arg("--kubeconfig").arg(kubeconfig);
        }
        // Inside the cgroup it attaches to, as the DaemonSet's agent is inside the node's: on
        // kernels without SO_NETNS_COOKIE it finds its namespace through its own connect().
        Place::new(opts.netns, opts.cgroup).apply(&mut cmd);
        let mut proc = Proc::spawn_command(cmd);
        let stderr = proc.child_mut().stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let exited = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let exited_flag = exited.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if std::env::var_os("LB_TEST_VERBOSE").is_some() {
                    eprintln!("[lb-agent] {line}");
                }
                sink.lock().expect("log lock").push(line);
            }
            exited_flag.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        Agent { proc, log, exited }
    }

    /// Number of completed syncs so far.
    pub fn syncs(&self) -> usize {
        self.log
            .lock()
            .expect("log lock")
            .iter()
            .filter(|l| l.contains(SYNCED) || l.contains(UP_TO_DATE))
            .count()
    }

    /// Waits until at least `n` syncs have completed.
    pub fn wait_for_syncs(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.syncs() < n {
            assert!(
                !self.exited.load(std::sync::atomic::Ordering::SeqCst),
                "lb-agent exited; log:\n{}",
                self.log()
            );
            assert!(
                Instant::now() < deadline,
                "lb-agent did not sync {n} time(s) within {timeout:?}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the log has a line containing `text`.
    pub fn wait_for_line(&self, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self
            .log
            .lock()
            .expect("log lock")
            .iter()
            .any(|l| l.contains(text))
        {
            assert!(
                !self.exited.load(std::sync::atomic::Ordering::SeqCst),
                "lb-agent exited; log:\n{}",
                self.log()
            );
            assert!(
                Instant::now() < deadline,
                "lb-agent logged no {text:?} within {timeout:?}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the sync after now (so a change written now has been applied).
    pub fn wait_for_next_sync(&self) {
        let now = self.syncs();
        // Two syncs: the one running now may have read the old state.
        self.wait_for_syncs(now + 2, Duration::from_secs(30));
    }

    pub fn log(&self) -> String {
        self.log.lock().expect("log lock").join("\n")
    }

    pub fn running(&mut self) -> bool {
        self.proc.running()
    }

    /// SIGTERM, then wait for the exit.
    pub fn stop(mut self) -> std::process::ExitStatus {
        self.proc.signal(libc::SIGTERM);
        self.proc
            .wait_timeout(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("lb-agent did not stop; log:\n{}", self.log()))
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
}

/// A directory under `root` for the agent's pins.
pub fn bpf_root_in(root: &Path) -> PathBuf {
    root.join("lb")
}

/// `lb-agent <cmd> -o json --bpf-root <bpf_root>` (services, backends, conntrack, stats...), or
/// why it failed.
pub fn inspect(bpf_root: &Path, cmd: &str) -> Result<serde_json::Value, String> {
    let out = Command::new(workspace_bin("lb-agent"))
        .args([cmd, "-o", "json", "--bpf-root"])
        .arg(bpf_root)
        .output()
        .map_err(|e| format!("lb-agent {cmd}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "lb-agent {cmd}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("lb-agent {cmd}: not JSON: {e}"))
}

/// The data path's non-zero event counters (`lb-agent stats`) under `bpf_root`, for failure
/// messages: a lost request next to `tc_snat_ports_exhausted`, `tc_no_masquerade_address` or
/// `tc_ct_insert_failed` says why.
pub fn datapath_events(bpf_root: &Path) -> serde_json::Value {
    match inspect(bpf_root, "stats") {
        Ok(serde_json::Value::Object(all)) => all.into_iter().filter(|(_, v)| v != 0).collect(),
        Ok(other) => other,
        Err(e) => e.into(),
    }
}
