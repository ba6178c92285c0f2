//! The upstream Kubernetes e2e suite against lb-agent (`cargo xtask e2e-upstream`, which builds
//! what this needs and writes docs/conformance.md from the report this leaves).
//!
//! The cluster: the real etcd, kube-apiserver, kube-controller-manager and kube-scheduler on
//! loopback (`lb_tests::control_plane`); three real nodes (kubelet, containerd, runc, the CNI
//! bridge; `lb_tests::kubelet`), each in its own network namespace and cgroup on one test LAN,
//! each routing the others' Pod ranges (the specs need two; one, the ExternalTrafficPolicy change
//! with HealthCheckNodePort, skips itself below three); lb-agent deployed from `manifests/` as a DaemonSet, as an
//! operator does; CoreDNS (`tests/manifests/coredns.yaml`) as the cluster DNS. No kube-proxy
//! runs: lb-agent is the only Service proxy. The images the specs run are built here under
//! their upstream names and imported into both nodes' containerd.
//!
//! Then `e2e.test` runs against it with the given focus and skip; its JSON report, its log, the
//! agents' logs and a description of the cluster land in `--report-dir`.
//!
//! Ctrl-C, SIGTERM and SIGHUP stop the suite and tear everything down; a run killed outright is
//! cleaned up by the next one (`lb_tests::sweep`: every name carries the run's pid).

use std::{
    fs,
    io::Write,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::{AtomicBool, AtomicI32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::Parser;
use lb_tests::{
    control_plane::ControlPlane,
    kubelet::{self, Image, KubeletNode, NodeConfig},
    topo::Lan,
};
use serde_json::json;

/// The cluster DNS Service's address (kubeadm's: the tenth of the Service range).
const CLUSTER_DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The nodes: address on the LAN and Pod range.
const NODES: [(Ipv4Addr, &str); 3] = [
    (Ipv4Addr::new(192, 168, 50, 21), "10.244.1.0/24"),
    (Ipv4Addr::new(192, 168, 50, 22), "10.244.2.0/24"),
    (Ipv4Addr::new(192, 168, 50, 23), "10.244.3.0/24"),
];
/// How long the agents and CoreDNS may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

#[derive(Parser)]
#[command(
    name = "lb-upstream-e2e",
    about = "Runs the upstream Kubernetes e2e suite on a three-node cluster where lb-agent is the only Service proxy"
)]
struct Args {
    /// The e2e.test binary (built by `cargo xtask e2e-upstream`).
    #[arg(long)]
    e2e_test: PathBuf,
    /// ginkgo's runner, which spreads the specs over parallel e2e.test processes.
    #[arg(long)]
    ginkgo: PathBuf,
    /// How many specs run at once (ginkgo's --procs; the specs are written for it: those that
    /// cannot share a cluster are [Serial], which the default skip leaves out).
    #[arg(long, default_value_t = 4)]
    procs: u32,
    /// Directories with an images.json of image archives to import into both nodes (ours from
    /// `cargo xtask images`, the upstream test images).
    #[arg(long = "images", required = true)]
    image_dirs: Vec<PathBuf>,
    /// Where the report, the logs and the cluster's description go.
    #[arg(long)]
    report_dir: PathBuf,
    /// The specs to run (ginkgo focus, a regular expression).
    #[arg(long)]
    focus: String,
    /// The specs to leave out (ginkgo skip).
    #[arg(long)]
    skip: String,
    /// The whole run's limit (ginkgo's --timeout).
    #[arg(long, default_value = "3h")]
    timeout: String,
    /// Extra arguments for e2e.test, after the ones this sets.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    extra: Vec<String>,
}

static STOP: AtomicBool = AtomicBool::new(false);
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
    STOP.store(true, Ordering::SeqCst);
}

fn step(message: &str) {
    let _ = writeln!(std::io::stderr(), "==> {message}");
}

fn check_stop() -> Result<()> {
    if STOP.load(Ordering::SeqCst) {
        bail!("stopped by signal {}", SIGNAL.load(Ordering::SeqCst));
    }
    Ok(())
}

/// The cluster; dropping it (in the main thread) tears it down. Fields drop in this order: the
/// nodes first (their kubelets talk to the control plane until they stop), the control plane last.
struct Cluster {
    nodes: Vec<KubeletNode>,
    _lan: Lan,
    cp: ControlPlane,
}

fn build_cluster(images: &[Image]) -> Result<Cluster> {
    step("starting etcd, kube-apiserver, kube-controller-manager and kube-scheduler");
    let cp = ControlPlane::start_with_controllers()?;
    let lan = Lan::new();
    let mut cluster = Cluster {
        nodes: Vec::new(),
        _lan: lan,
        cp,
    };
    check_stop()?;
    for (ip, pod_cidr) in NODES {
        step(&format!(
            "starting a node at {ip} (Pods {pod_cidr}): containerd, kubelet, {} images imported",
            images.len()
        ));
        let node = KubeletNode::start(
            &cluster.cp,
            &cluster._lan,
            NodeConfig {
                ip,
                pod_cidr: pod_cidr.to_string(),
                cluster_dns: Some(CLUSTER_DNS),
                ipv6: None,
            },
            images,
        )?;
        cluster.nodes.push(node);
        check_stop()?;
    }
    // Every node routes the other nodes' Pod ranges over the LAN (what a flat routed network or
    // a CNI's routes give a real cluster).
    for node in &cluster.nodes {
        for other in cluster.nodes.iter().filter(|o| o.name() != node.name()) {
            node.netns()
                .ip(&["route", "add", other.pod_cidr(), "via", &other.ip().to_string()]);
        }
    }
    step("deploying lb-agent from manifests/ (kubectl apply -k, as an operator) and CoreDNS");
    let first = &cluster.nodes[0];
    let applied = kubelet::apply_agent_manifests(&cluster.cp, first)?;
    drop(applied);
    let coredns = Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/coredns.yaml");
    cluster
        .cp
        .kubectl(["apply", "-f", &coredns.display().to_string()])?;
    let want = cluster.nodes.len();
    let cp = &cluster.cp;
    for (what, selector, count) in [
        ("lb-agent on every node", "k8s-app=lb-agent", want),
        ("CoreDNS", "k8s-app=kube-dns", 2),
    ] {
        kubelet::wait_for(what, READY_TIMEOUT, || {
            check_stop()?;
            let ready = kubelet::pods(cp, "kube-system", selector)?
                .iter()
                .filter(|p| kubelet::is_ready(p))
                .count();
            Ok((ready >= count).then_some(()))
        })
        .map_err(|e| anyhow::anyhow!("{e:#}; kube-system's Pods:\n{}", describe_kube_system(cp)))?;
        step(&format!("{what}: ready"));
    }
    Ok(cluster)
}

/// What kube-system's Pods are doing, for an error message.
fn describe_kube_system(cp: &ControlPlane) -> String {
    cp.kubectl(["-n", "kube-system", "get", "pods", "-o", "wide"])
        .unwrap_or_else(|e| format!("(kubectl get pods failed: {e:#})"))
}

/// Runs e2e.test; returns its exit status' success. Stops it on a signal.
fn run_suite(args: &Args, cluster: &Cluster) -> Result<bool> {
    let report_dir = fs::canonicalize(&args.report_dir)?;
    let log_path = report_dir.join("e2e.log");
    let log = fs::File::create(&log_path)?;
    let mut cmd = Command::new(&args.ginkgo);
    cmd.arg(format!("--procs={}", args.procs))
        .args(["--no-color", "-v"])
        .arg(format!("--focus={}", args.focus))
        .arg(format!("--skip={}", args.skip))
        .arg(format!("--timeout={}", args.timeout))
        .arg(format!("--output-dir={}", report_dir.display()))
        .args(["--json-report=report.json", "--junit-report=junit.xml"])
        .arg(&args.e2e_test)
        .arg("--")
        .arg(format!("--kubeconfig={}", cluster.cp.kubeconfig_path().display()))
        // The specs run kubectl (exec into Pods): the release's own, never one on PATH.
        .arg(format!(
            "--kubectl-path={}",
            cluster.cp.binaries().kubectl.display()
        ))
        .arg(format!("--num-nodes={}", cluster.nodes.len()))
        .args([
            "--provider=skeleton",
            // Every node must be schedulable and ready; the suite's own check.
            "--allowed-not-ready-nodes=0",
        ])
        .arg(format!("--report-dir={}", report_dir.display()))
        .args(&args.extra)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    step(&format!(
        "running {} with {} parallel processes (log: {})",
        args.e2e_test.display(),
        args.procs,
        log_path.display()
    ));
    let started = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("starting {cmd:?}"))?;
    let mut last_progress = Instant::now();
    let mut reported = 0;
    loop {
        if let Some(status) = child.try_wait()? {
            step(&format!(
                "e2e.test finished ({status}) after {:.0?}",
                Duration::from_secs(started.elapsed().as_secs())
            ));
            return Ok(status.success());
        }
        if STOP.load(Ordering::SeqCst) {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && child.try_wait()?.is_none() {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
            bail!("stopped by signal {}", SIGNAL.load(Ordering::SeqCst));
        }
        if last_progress.elapsed() >= Duration::from_secs(30) {
            // Progress: the specs the log shows finished so far.
            let text = fs::read_to_string(&log_path).unwrap_or_default();
            let done = text.matches("• [").count() + text.matches("S [SKIPPED]").count();
            if done != reported {
                step(&format!(
                    "{done} specs done after {:.0?}",
                    Duration::from_secs(started.elapsed().as_secs())
                ));
                reported = done;
            }
            last_progress = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The agents' logs and the cluster's description, beside the report.
fn collect(args: &Args, cluster: &Cluster, images: &[Image]) -> Result<()> {
    let dir = &args.report_dir;
    let cp = &cluster.cp;
    for pod in kubelet::pods(cp, "kube-system", "k8s-app=lb-agent")? {
        let name = pod["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
        let logs = cp
            .kubectl(["-n", "kube-system", "logs", &name, "-c", "lb-agent"])
            .unwrap_or_else(|e| format!("(no logs: {e:#})"));
        fs::write(dir.join(format!("lb-agent-{node}.log")), logs)?;
    }
    let version = cp.kubectl(["version", "-o", "json"]).unwrap_or_default();
    let description = json!({
        "kubernetes": serde_json::from_str::<serde_json::Value>(&version).unwrap_or_default()["serverVersion"]["gitVersion"],
        "nodes": cluster.nodes.iter().map(|n| json!({"name": n.name(), "ip": n.ip().to_string(), "pod_cidr": n.pod_cidr()})).collect::<Vec<_>>(),
        "images": images.iter().map(|i| json!({"ref": i.reference, "digest": i.manifest_digest})).collect::<Vec<_>>(),
        "service_proxy": "lb-agent (DaemonSet from manifests/); no kube-proxy",
        "cluster_dns": CLUSTER_DNS.to_string(),
        "focus": args.focus,
        "flags": format!("--provider=skeleton --num-nodes={} --procs={}", cluster.nodes.len(), args.procs),
        "skip": args.skip,
        "kernel": fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
    });
    fs::write(
        dir.join("cluster.json"),
        serde_json::to_string_pretty(&description)?,
    )?;
    Ok(())
}

/// Errors end with their causes, without a backtrace (the run's own output says where it was).
fn main() {
    if let Err(error) = run(Args::parse()) {
        let _ = writeln!(std::io::stderr(), "error: {error:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    lb_tests::require_root();
    // SAFETY: the handler only stores to atomics.
    unsafe {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
    for left in lb_tests::sweep::leftovers_of_dead_runs() {
        step(&format!("removed a dead run's leftover: {left}"));
    }
    fs::create_dir_all(&args.report_dir)?;
    let mut images = Vec::new();
    for dir in &args.image_dirs {
        images.extend(kubelet::images_in(dir)?);
    }
    let started = Instant::now();
    let cluster = build_cluster(&images)?;
    step(&format!(
        "cluster ready after {:.0?}",
        Duration::from_secs(started.elapsed().as_secs())
    ));
    let passed = run_suite(&args, &cluster);
    if let Err(e) = collect(&args, &cluster, &images) {
        step(&format!("collecting the agents' logs failed: {e:#}"));
    }
    step("tearing down");
    drop(cluster);
    match passed? {
        true => step("every selected spec passed"),
        false => step("some specs failed: see the report"),
    }
    Ok(())
}
