//! The sandbox (README command 1) as a new user runs it: every example Service balanced correctly
//! from a pod and from the external client, the dual-stack one over both families; the kubectl
//! commands it prints (create a Deployment, expose it, scale it, make it dual-stack) followed by
//! its live table, whose rows show the Deployment's Pods (on the real node) answering by name, old
//! and new, over IPv4 and then IPv6 too; a deleted Service leaves the table; and, stopped by
//! closing its terminal (a hang-up: SIGHUP from the kernel and from the shell), it leaves nothing
//! behind. SIGTERM and Ctrl-C stop it through the same handler.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use lb_tests::{control_plane::Binaries, process::workspace_bin, require_root};
use serde_json::Value;

/// How long the sandbox may take to be ready (about 15 s once the images are cached).
const READY_TIMEOUT: Duration = Duration::from_secs(180);
/// How long the table may take to show a change made with kubectl.
const FOLLOW_TIMEOUT: Duration = Duration::from_secs(90);
/// The least traffic the example flows run before the checks.
const EXAMPLE_TRAFFIC: Duration = Duration::from_secs(12);

fn flows<'a>(summary: &'a Value, service: &str) -> Vec<&'a Value> {
    summary["flows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["service"].as_str().unwrap().starts_with(service))
        .collect()
}

fn backends(flow: &Value) -> BTreeSet<String> {
    flow["per_backend"].as_object().unwrap().keys().cloned().collect()
}

/// The running sandbox: its stderr as read so far; stopped with SIGTERM (then SIGKILL) if the test
/// fails before it stops it.
struct Sandbox {
    child: Child,
    /// The controlling terminal's master side: closing it hangs the terminal up, as closing a
    /// terminal window does.
    terminal: Option<std::os::fd::OwnedFd>,
    stderr: Arc<Mutex<String>>,
    stdout: Arc<Mutex<String>>,
}

impl Sandbox {
    fn start(summary: &Path) -> Sandbox {
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/examples");
        // A terminal of its own, as in a terminal window: its session's controlling terminal, on
        // stdin (stdout and stderr stay pipes, read here).
        let pty = nix::pty::openpty(None, None).expect("openpty");
        let mut command = Command::new(workspace_bin("lb-sandbox"));
        // A cap: the test stops it by hanging up its terminal once done.
        command
            .args(["--duration", "240s", "--rate", "20", "--examples"])
            .arg(&examples)
            .arg("--summary-json")
            .arg(summary)
            .stdin(Stdio::from(pty.slave))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, || {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command.spawn().expect("run lb-sandbox");
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        let pipe = child.stderr.take().unwrap();
        thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let mut all = sink.lock().unwrap();
                all.push_str(&line);
                all.push('\n');
            }
        });
        let stdout = Arc::new(Mutex::new(String::new()));
        let sink = stdout.clone();
        let mut pipe = child.stdout.take().unwrap();
        thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Sandbox {
            child,
            terminal: Some(pty.master),
            stderr,
            stdout,
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// What it printed, for failure messages.
    fn output(&self) -> String {
        let stdout = self.stdout.lock().unwrap();
        let tail: Vec<&str> = stdout.lines().collect();
        format!(
            "--- stderr:\n{}\n--- stdout (last lines):\n{}",
            self.stderr(),
            tail[tail.len().saturating_sub(60)..].join("\n")
        )
    }

    /// Waits for a line of stderr satisfying `f`, failing if the sandbox exits first.
    fn wait_for_line(&mut self, what: &str, timeout: Duration, f: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.stderr().lines().find(|l| f(l)) {
                return line.to_string();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                thread::sleep(Duration::from_millis(200));
                panic!("lb-sandbox exited ({status}) before {what}:\n{}", self.output());
            }
            assert!(
                Instant::now() < deadline,
                "lb-sandbox: no {what} within {timeout:?}:\n{}",
                self.output()
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Closes its terminal, then waits for it to finish its teardown. The kernel sends SIGHUP to the
    /// session's leader (the sandbox) and the shell that ran it would send SIGHUP to its process
    /// group, so both are sent.
    fn hang_up(&mut self, timeout: Duration) -> std::process::ExitStatus {
        drop(self.terminal.take());
        // SAFETY: kill has no memory-safety preconditions (the group is the sandbox's session).
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGHUP) };
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                // Let the reader threads take the last lines.
                thread::sleep(Duration::from_millis(200));
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "lb-sandbox did not stop within {timeout:?} of its terminal's hang-up:\n{}",
                self.output()
            );
            thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
                thread::sleep(Duration::from_millis(100));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// kubectl as the user runs it: `KUBECONFIG` from what the sandbox printed.
struct Kubectl {
    bin: PathBuf,
    kubeconfig: String,
    cache: tempfile::TempDir,
}

impl Kubectl {
    fn run(&self, args: &[&str]) -> String {
        let out = Command::new(&self.bin)
            .arg("--cache-dir")
            .arg(self.cache.path())
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .stdin(Stdio::null())
            .output()
            .expect("run kubectl");
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// One of the example command lines the sandbox printed (`kubectl ...`), run as printed (as a
    /// shell would: words, single quotes removed).
    fn run_printed(&self, line: &str) -> String {
        let words: Vec<&str> = line
            .split_whitespace()
            .map(|w| {
                w.strip_prefix('\'')
                    .and_then(|w| w.strip_suffix('\''))
                    .unwrap_or(w)
            })
            .collect();
        assert_eq!(words.first(), Some(&"kubectl"), "{line}");
        self.run(&words[1..])
    }

    /// The Pods of `app=<app>` that run and are not being deleted.
    fn running_pods(&self, app: &str) -> BTreeSet<String> {
        let v: Value =
            serde_json::from_str(&self.run(&["get", "pods", "-l", &format!("app={app}"), "-o", "json"]))
                .unwrap();
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["status"]["phase"] == "Running" && p["metadata"]["deletionTimestamp"].is_null())
            .map(|p| p["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    }
}

fn read_summary(path: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// Whether a flow's frontend is an IPv6 one (`ClusterIP [fd00:10:96::1f]:80/TCP`).
fn is_ipv6(flow: &Value) -> bool {
    flow["frontend"].as_str().unwrap().contains('[')
}

/// The flow of the `hello` Service from the real node to its cluster IP of one family, once its
/// load runs.
fn hello_flow(summary: &Value, ipv6: bool) -> Option<Value> {
    flows(summary, "default/hello:")
        .into_iter()
        .find(|f| f["from"] == "real-node" && f["started"] == true && is_ipv6(f) == ipv6)
        .cloned()
}

/// Waits until the sandbox's summary shows every pod of `pods` answering the `hello` flow of one
/// family.
fn wait_for_backends(
    sandbox: &Sandbox,
    summary: &Path,
    kubectl: &Kubectl,
    want: usize,
    ipv6: bool,
) -> (BTreeSet<String>, Value) {
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    let (mut pods, mut last) = (BTreeSet::new(), None);
    while Instant::now() < deadline {
        pods = kubectl.running_pods("hello");
        last = read_summary(summary).as_ref().and_then(|s| hello_flow(s, ipv6));
        if pods.len() == want
            && let Some(flow) = &last
            && pods.is_subset(&backends(flow))
        {
            return (pods, flow.clone());
        }
        thread::sleep(Duration::from_millis(500));
    }
    let family = if ipv6 { "IPv6" } else { "IPv4" };
    panic!(
        "the table did not show the {want} pods of hello answering over {family} within {FOLLOW_TIMEOUT:?}: \
         pods {pods:?}, flow {last:?}\n{}",
        sandbox.output()
    );
}

#[test]
fn the_sandbox_balances_every_example_service_and_follows_kubectl() {
    require_root();
    let summary_file = tempfile::NamedTempFile::new().unwrap();
    let summary_path = summary_file.path().to_path_buf();
    let started = Instant::now();
    let mut sandbox = Sandbox::start(&summary_path);
    let pid = sandbox.child.id();
    sandbox.wait_for_line("ready line", READY_TIMEOUT, |l| l.contains("ready after"));
    let ready_s = started.elapsed().as_secs_f64();

    // How the sandbox says to talk to it.
    let export = sandbox.wait_for_line("KUBECONFIG line", Duration::from_secs(1), |l| {
        l.trim_start().starts_with("export KUBECONFIG=")
    });
    let kubeconfig = export.trim().trim_start_matches("export KUBECONFIG=").to_string();
    assert!(Path::new(&kubeconfig).is_file(), "{export}");
    let printed = |prefix: &str| -> String {
        sandbox
            .stderr()
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("the sandbox does not print `{prefix} ...`:\n{}", sandbox.stderr()))
            .to_string()
    };
    let create = printed("kubectl create deployment hello");
    let expose = printed("kubectl expose deployment hello");
    let scale = printed("kubectl scale deployment hello");
    let dual_stack = printed("kubectl patch service hello");
    let replicas: usize = scale
        .rsplit_once("--replicas=")
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or_else(|| panic!("{scale}"));
    let kubectl = Kubectl {
        bin: Binaries::locate().unwrap().kubectl,
        kubeconfig,
        cache: tempfile::tempdir().unwrap(),
    };

    // A Deployment and its Service, as printed: the table follows with the Pods' names.
    kubectl.run_printed(&create);
    kubectl.run_printed(&expose);
    let (first, _) = wait_for_backends(&sandbox, &summary_path, &kubectl, 2, false);
    let followed_s = started.elapsed().as_secs_f64() - ready_s;
    // Scaled: the new Pods' names appear beside the first ones.
    kubectl.run_printed(&scale);
    let (scaled, flow) = wait_for_backends(&sandbox, &summary_path, &kubectl, replicas, false);
    assert!(
        scaled.is_superset(&first) && scaled.len() > first.len(),
        "{first:?} -> {scaled:?}"
    );
    // Every Pod runs on the real node (the netns nodes are unschedulable), which the client is on:
    // no request failed, and its address was kept.
    assert_eq!(flow["errors"], 0, "no request may fail: {flow}");
    assert_eq!(flow["replaced_client_ip"], 0, "{flow}");
    let nodes = kubectl.run(&[
        "get",
        "pods",
        "-l",
        "app=hello",
        "-o",
        "jsonpath={.items[*].spec.nodeName}",
    ]);
    let real_node = read_summary(&summary_path).unwrap()["real_node"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        nodes.split_whitespace().all(|n| n == real_node),
        "hello's pods run on {nodes}, not all on the real node {real_node}"
    );
    // Made dual-stack, as printed: the real node is dual-stack (kubelet, CNI, the DaemonSet's
    // agent), so the Service's new IPv6 ClusterIP gets a row of its own, from the real node over
    // IPv6, with every Pod answering, none failing, the client's IPv6 address kept; the IPv4 row
    // stays.
    kubectl.run_printed(&dual_stack);
    let (pods6, flow6) = wait_for_backends(&sandbox, &summary_path, &kubectl, replicas, true);
    assert_eq!(pods6, scaled, "{flow6}");
    assert!(
        flow6["frontend"]
            .as_str()
            .unwrap()
            .starts_with("ClusterIP [fd00:10:96::"),
        "{flow6}"
    );
    assert_eq!(flow6["errors"], 0, "no request may fail: {flow6}");
    assert_eq!(flow6["replaced_client_ip"], 0, "{flow6}");
    assert!(
        read_summary(&summary_path)
            .as_ref()
            .and_then(|s| hello_flow(s, false))
            .is_some_and(|f| f["errors"] == 0),
        "the IPv4 row of hello stays, without errors:\n{}",
        sandbox.output()
    );

    // A deleted Service leaves the table.
    kubectl.run(&["delete", "service", "hello"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_summary(&summary_path).is_some_and(|s| !flows(&s, "default/hello:").is_empty()) {
        assert!(
            Instant::now() < deadline,
            "the hello rows stayed after the Service was deleted:\n{}",
            sandbox.output()
        );
        thread::sleep(Duration::from_millis(500));
    }

    // The example flows get at least as long as they always had (12 s at 20 requests/s).
    let ready_for = started.elapsed().as_secs_f64() - ready_s;
    if ready_for < EXAMPLE_TRAFFIC.as_secs_f64() {
        thread::sleep(EXAMPLE_TRAFFIC - Duration::from_secs_f64(ready_for));
    }
    // Stopped as closing its terminal window would.
    let status = sandbox.hang_up(Duration::from_secs(90));
    let stderr = sandbox.stderr();
    assert!(status.success(), "lb-sandbox failed:\n{}", sandbox.output());
    assert!(stderr.contains("tearing down (signal 1)"), "{stderr}");
    eprintln!(
        "sandbox ready after {ready_s:.1}s; hello followed {followed_s:.1}s after; whole run {:.1}s",
        started.elapsed().as_secs_f64()
    );

    let summary = read_summary(&summary_path).expect("the final summary");
    let all_web: BTreeSet<String> = ["web-1", "web-2", "web-3", "web-4"].map(String::from).into();

    for f in summary["flows"].as_array().unwrap() {
        let served: u64 = f["per_backend"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        if f["expect_denied"] == true {
            assert_eq!(
                served, 0,
                "a source outside loadBalancerSourceRanges is dropped: {f}"
            );
        } else {
            assert_eq!(f["errors"], 0, "no request may fail: {f}");
            assert!(served > 20, "traffic flowed: {f}");
        }
    }
    // Pods reach every ClusterIP with their own address; every web backend serves.
    for f in flows(&summary, "demo/web").iter().filter(|f| f["from"] == "pod") {
        assert_eq!(f["replaced_client_ip"], 0, "{f}");
        if !f["service"].as_str().unwrap().starts_with("demo/sticky") {
            assert_eq!(backends(f), all_web, "{f}");
        }
    }
    // externalTrafficPolicy Cluster: every backend, masqueraded.
    for f in flows(&summary, "demo/web-nodeport")
        .iter()
        .filter(|f| f["from"] == "external")
    {
        assert_eq!(backends(f), all_web, "{f}");
        assert_eq!(f["kept_client_ip"], 0, "{f}");
    }
    // externalTrafficPolicy Local: the node's own pods only, client IP kept.
    for f in flows(&summary, "demo/web-local")
        .iter()
        .filter(|f| f["from"] == "external")
    {
        let local: BTreeSet<String> = if f["frontend"].as_str().unwrap().contains("192.168.50.11:") {
            ["web-1", "web-2"].map(String::from).into()
        } else {
            ["web-3", "web-4"].map(String::from).into()
        };
        assert_eq!(backends(f), local, "{f}");
        assert_eq!(f["replaced_client_ip"], 0, "{f}");
    }
    // ClientIP affinity: one backend per client.
    for f in flows(&summary, "demo/sticky") {
        assert_eq!(backends(f).len(), 1, "{f}");
    }
    // UDP DNS-style: both DNS backends answer, from the Service address.
    for f in flows(&summary, "demo/dns") {
        assert_eq!(backends(f), ["dns-1", "dns-2"].map(String::from).into(), "{f}");
    }
    // Dual-stack: both families' ClusterIPs from a pod (client address kept), both families'
    // NodePorts on both nodes from the external client (masqueraded: externalTrafficPolicy
    // Cluster), every web backend over each; the frontends read as addresses do.
    let dual = flows(&summary, "demo/web-dual-stack:");
    for (from, frontends) in [
        ("pod", vec!["ClusterIP 10.96.", "ClusterIP [fd00:10:96::"]),
        (
            "external",
            vec![
                "NodePort 192.168.50.11:30083/TCP",
                "NodePort 192.168.50.12:30083/TCP",
                "NodePort [fd00:192:168:50::11]:30083/TCP",
                "NodePort [fd00:192:168:50::12]:30083/TCP",
            ],
        ),
    ] {
        for frontend in frontends {
            let f = dual
                .iter()
                .find(|f| f["from"] == from && f["frontend"].as_str().unwrap().starts_with(frontend))
                .unwrap_or_else(|| panic!("no {frontend} flow from the {from}: {dual:?}"));
            assert_eq!(backends(f), all_web, "{f}");
            let kept = if from == "pod" {
                "replaced_client_ip"
            } else {
                "kept_client_ip"
            };
            assert_eq!(f[kept], 0, "{f}");
        }
    }
    // The LoadBalancer IP is served to the allowed client.
    assert!(
        flows(&summary, "demo/web-lb").iter().any(|f| f["frontend"]
            .as_str()
            .unwrap()
            .starts_with("LoadBalancer")
            && f["from"] == "external")
    );

    // Nothing left behind: the namespaces (the fixed ones, and the LAN's and the real node's,
    // named after the sandbox's pid), the cgroups of every hierarchy, the directories, processes.
    let ours = |name: &str| {
        name.starts_with("lbsb-")
            || name.starts_with(&format!("lbk{}x", pid % 100_000))
            || name.starts_with(&format!("lblan{}x", pid % 100_000))
    };
    let netns = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    assert!(
        !netns
            .lines()
            .any(|l| ours(l.split_whitespace().next().unwrap_or_default())),
        "namespaces left: {netns}"
    );
    let cgroup2 = lb_tests::cgroup::cgroup2_mount();
    assert!(
        !cgroup2.join("lb-sandbox").exists(),
        "the lb-sandbox cgroup is left"
    );
    let hierarchies = std::fs::read_dir("/sys/fs/cgroup")
        .unwrap()
        .flatten()
        .map(|h| h.path());
    for parent in hierarchies.chain([cgroup2]).map(|h| h.join("lb-tests")) {
        for entry in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
            assert!(
                !ours(&entry.file_name().to_string_lossy()),
                "cgroup left: {}",
                entry.path().display()
            );
        }
    }
    assert!(!Path::new("/run/lb-sandbox").exists());
    assert!(!Path::new("/tmp/lb-sandbox").exists());
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        assert!(
            !cmdline.contains("/run/lb-sandbox") && !cmdline.contains("/tmp/lb-sandbox/"),
            "process left: {} {cmdline}",
            entry.file_name().to_string_lossy()
        );
    }
}
