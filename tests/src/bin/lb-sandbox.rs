//! The sandbox (README command 1): a small cluster on this machine, for real.
//!
//! - a real etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback;
//! - one real node (kubelet, containerd, runc, the CNI bridge; `lb_tests::kubelet`) running
//!   lb-agent as the DaemonSet of `manifests/`, applied as an operator does: the Deployments a
//!   user creates with kubectl run there, with EndpointSlices from the real controller;
//! - beside it, two fast "nodes" in network namespaces on the same LAN, each running lb-agent as
//!   a process against the API server, each with pods (HTTP on :8080, UDP echo on :5353) behind
//!   veths, in the node's cgroup; every node routes the others' Pod ranges over the LAN;
//! - an external client host on the LAN;
//! - the example Services of `manifests/examples/`, with EndpointSlices the sandbox writes itself
//!   for the netns pods (which are not Pod objects), and LoadBalancer status it fills in;
//! - traffic from a pod and from the external client to every example frontend, from a client on
//!   the real node to the ClusterIP of every Service created while it runs (`kubectl expose`),
//!   and a live table per Service: frontend, backends (pod names) and requests per backend,
//!   errors, whether the client IP was kept.
//!
//! It runs until Ctrl-C (SIGINT), SIGTERM, SIGHUP or `--duration`, then tears everything down; a
//! run that crashed is cleaned up by the next one (fixed names under `/run/lb-sandbox` and
//! `/tmp/lb-sandbox`, the `lb-sandbox` cgroup and `lbsb-*` namespaces; the real node and the LAN
//! are named after the run's pid and swept by `lb_tests::sweep` once it is dead). It never
//! touches the machine's interfaces or root cgroup.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::{BufRead, BufReader, IsTerminal, Write},
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicI32, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::Parser;
use k8s_openapi::{
    api::{
        core::v1::{Node, NodeAddress, NodeSpec, NodeStatus, Service, Taint},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use lb_tests::{
    bpffs::BpfFs,
    cgroup::{self, Cgroup},
    control_plane::ControlPlane,
    kubelet::{self, KubeletNode, NodeConfig},
    netns::{NetNs, PortForward},
    process::{Place, Proc, workspace_bin},
    topo::Lan,
};

const STATE_DIR: &str = "/run/lb-sandbox";
/// The temporary directory of the control plane and the real node (their data, logs and
/// processes' command lines, by which a later run finds a crashed one's). Not under `/run`,
/// `/var/lib` or `/var/log`, which the real node's mount namespace replaces with its own.
const WORK_DIR: &str = "/tmp/lb-sandbox";
const CGROUP: &str = "lb-sandbox";
const LB_POOL: [u8; 3] = [203, 0, 113];
/// The netns nodes are 1 and 2 (192.168.50.1<i>, Pods in 10.244.<i>.0/24); the real node takes
/// the next index.
const REAL_NODE_INDEX: u8 = 3;
/// The taint that keeps Pods off the netns nodes, which have no kubelet.
const NETNS_TAINT: &str = "node.lb.example/netns";
/// How often the sandbox looks for Services created or deleted while it runs.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

#[derive(Parser)]
#[command(
    name = "lb-sandbox",
    about = "A local cluster (real control plane, one real kubelet node, fast netns nodes) running lb-agent, with live traffic"
)]
struct Args {
    /// Stop after this long (e.g. 60s, 5m); default: until Ctrl-C.
    #[arg(long, value_parser = lb_agent::cli::parse_duration)]
    duration: Option<Duration>,
    /// Folder of example manifests to apply.
    #[arg(long, default_value = "manifests/examples")]
    examples: PathBuf,
    /// Requests per second per traffic flow.
    #[arg(long, default_value_t = 5)]
    rate: u32,
    /// Write the figures of every flow as JSON to this file, every second while running and a
    /// last time at the end (for tests).
    #[arg(long)]
    summary_json: Option<PathBuf>,
}

static STOP: AtomicBool = AtomicBool::new(false);
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Whether stdout and stderr are terminals (set at start, read by the signal handler).
static TTY_OUT: AtomicBool = AtomicBool::new(false);
static TTY_ERR: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    if sig == libc::SIGHUP {
        // The terminal is gone: what was written to it goes nowhere from here on, rather than
        // failing (children inherit stderr; a failed write must not stop the teardown).
        // SAFETY: open, dup2 and close are async-signal-safe.
        unsafe {
            let fd = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
            if fd >= 0 {
                if TTY_OUT.load(Ordering::SeqCst) {
                    libc::dup2(fd, 1);
                }
                if TTY_ERR.load(Ordering::SeqCst) {
                    libc::dup2(fd, 2);
                }
                libc::close(fd);
            }
        }
    }
    SIGNAL.store(sig, Ordering::SeqCst);
    STOP.store(true, Ordering::SeqCst);
}

/// Prints to stderr, never panicking (the terminal may be gone).
fn say(message: &str) {
    let _ = writeln!(std::io::stderr(), "{message}");
}

fn step(message: &str) {
    say(&format!("==> {message}"));
}

/// Fails when a signal asked the sandbox to stop while it was starting.
fn check_stop() -> Result<()> {
    if STOP.load(Ordering::SeqCst) {
        bail!(Interrupted);
    }
    Ok(())
}

/// Stopped by a signal before it was ready (not a failure).
#[derive(Debug)]
struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped while starting")
    }
}

/// Kills whatever a crashed run left: processes (the control plane's and the real node's
/// containerd and kubelet, found by their command line naming the state directory; the netns
/// nodes' in the sandbox cgroup), namespaces, the cgroup trees, the bpffs mount. The real node's
/// containers, its cgroups (`lb-tests/lbk<pid>x<n>` in every hierarchy) and its namespace, and the
/// LAN's (`lblan<pid>x<n>`), are named after the dead run's pid: `lb_tests::sweep` removes them,
/// as it does for the tests.
fn clean_leftovers() {
    if let Ok(procs) = fs::read_dir("/proc") {
        for p in procs.flatten() {
            let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            if pid == std::process::id() as i32 {
                continue;
            }
            let cmdline = fs::read(p.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            if cmdline.contains(STATE_DIR) || cmdline.contains(&format!("{WORK_DIR}/")) {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    if let Ok(mount) = cgroup::cgroup2_mount().canonicalize() {
        let tree = mount.join(CGROUP);
        if tree.exists() {
            step("removing the cgroups of a previous run");
            cgroup::remove_tree(&tree);
        }
    }
    let listed = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for name in listed
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("lbsb-"))
    {
        let _ = Command::new("ip").args(["netns", "delete", name]).output();
    }
    let removed = lb_tests::sweep::leftovers_of_dead_runs();
    if !removed.is_empty() {
        step(&format!(
            "removed the leftovers of runs that died: {}",
            removed.join(", ")
        ));
    }
    let bpf = Path::new(STATE_DIR).join("bpf");
    while nix::mount::umount2(&bpf, nix::mount::MntFlags::MNT_DETACH).is_ok() {}
    // A dead real node's mounts are gone with its last process; give them a moment.
    for dir in [STATE_DIR, WORK_DIR] {
        for _ in 0..50 {
            if fs::remove_dir_all(dir).is_ok() || !Path::new(dir).exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// One pod: its namespace, address, labels and its server process.
struct Pod {
    node: String,
    ip: Ipv4Addr,
    app: &'static str,
    ns: NetNs,
    _cgroup: Cgroup,
    _server: Option<Proc>,
}

/// One node: namespace, LAN address, cgroup, agent.
struct SandboxNode {
    name: String,
    index: u8,
    ip: Ipv4Addr,
    ns: NetNs,
    cgroup: Cgroup,
    agent: Option<Proc>,
    _forward: Option<PortForward>,
}

struct Cluster {
    // Drop order: traffic, agents and pods first, then nodes, the real node (in the main thread,
    // where it was started), then the LAN, the cgroup, bpffs, and the control plane last.
    flows: Vec<Flow>,
    pods: Vec<Pod>,
    nodes: Vec<SandboxNode>,
    /// The cgroup of the real node's traffic clients, under the node's cgroup, so that the
    /// node's lb-agent (the DaemonSet's) balances their sockets as it does its Pods'.
    real_clients: Cgroup,
    real: KubeletNode,
    external: (NetNs, Ipv4Addr, Cgroup),
    /// A second external client outside the LoadBalancer's source ranges.
    outsider: (NetNs, Ipv4Addr),
    _lan: Lan,
    _root: Cgroup,
    _bpffs: BpfFs,
    cp: ControlPlane,
    rt: tokio::runtime::Runtime,
    /// The Services seen when the traffic started (the examples): their flows are the ones of
    /// `start_traffic`; any other Service gets a flow from the real node (`follow_services`).
    initial_services: BTreeSet<String>,
    rate: u32,
}

fn veth_to_lan(lan: &NetNs, port: &str, ns: &NetNs, dev: &str, addr: &str) {
    lb_tests::netns::veth(lan, port, None, ns, dev, Some(addr));
    lan.ip(&["link", "set", port, "master", "br0"]);
}

fn pod_cidr(index: u8) -> String {
    format!("10.244.{index}.0/24")
}

fn node_ip(index: u8) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 50, 10 + index)
}

fn build(args: &Args) -> Result<Cluster> {
    fs::create_dir_all(Path::new(STATE_DIR).join("logs"))?;
    fs::create_dir_all(WORK_DIR)?;
    // The control plane's and the real node's files (and so their processes' command lines) live
    // under a fixed directory, so a later run can find them if this one crashes.
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("TMPDIR", WORK_DIR) };
    // The real node's parts and images, before anything starts: a missing one is said at once.
    kubelet::NodeParts::locate()?;
    // What the real node runs: the Pods' sandbox, the DaemonSet's agent and the user's backends.
    let images = ["pause", "lb-agent", "lb-probe"]
        .into_iter()
        .map(kubelet::image)
        .collect::<Result<Vec<_>>>()?;
    step("starting etcd, kube-apiserver, kube-controller-manager and kube-scheduler");
    let cp = ControlPlane::start_with_controllers()?;
    check_stop()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let client = rt.block_on(cp.client())?;
    let api: SocketAddr = cp.server_url().trim_start_matches("https://").parse()?;

    step("creating the LAN, two nodes with pods, and an external client in network namespaces");
    let bpffs = BpfFs::at(&Path::new(STATE_DIR).join("bpf"));
    let root = Cgroup::at(CGROUP);
    // The LAN of `lb_tests::topo`, which the real node attaches to.
    let lan = Lan::new();
    let mut nodes = Vec::new();
    for index in 1..=2u8 {
        let ns = NetNs::named(&format!("lbsb-n{index}"));
        ns.sysctl("net.ipv4.ip_forward=1");
        ns.sysctl("net.ipv4.conf.all.rp_filter=0");
        ns.sysctl("net.ipv4.conf.default.rp_filter=0");
        let ip = node_ip(index);
        veth_to_lan(&lan.ns, &format!("ln{index}"), &ns, "eth0", &format!("{ip}/24"));
        nodes.push(SandboxNode {
            name: format!("node-{index}"),
            index,
            ip,
            ns,
            cgroup: root.child(&format!("node-{index}")),
            agent: None,
            _forward: None,
        });
    }
    // Every node routes the other nodes' Pod ranges (the real node's too) via their LAN address.
    let all_nodes: Vec<u8> = vec![1, 2, REAL_NODE_INDEX];
    for a in &nodes {
        for &b in &all_nodes {
            if a.index != b {
                a.ns.ip(&["route", "add", &pod_cidr(b), "via", &node_ip(b).to_string()]);
            }
        }
    }
    let ext_ns = NetNs::named("lbsb-ext");
    let ext_ip = Ipv4Addr::new(192, 168, 50, 100);
    veth_to_lan(&lan.ns, "lext", &ext_ns, "eth0", &format!("{ext_ip}/24"));
    // The load balancer announces its IPs at node-1 (as an L2 or BGP load balancer would).
    ext_ns.ip(&[
        "route",
        "add",
        &format!("{}.{}.{}.0/24", LB_POOL[0], LB_POOL[1], LB_POOL[2]),
        "via",
        &nodes[0].ip.to_string(),
    ]);
    let ext_cgroup = root.child("external");
    let out_ns = NetNs::named("lbsb-out");
    let out_ip = Ipv4Addr::new(192, 168, 50, 200);
    veth_to_lan(&lan.ns, "lout", &out_ns, "eth0", &format!("{out_ip}/24"));
    out_ns.ip(&[
        "route",
        "add",
        &format!("{}.{}.{}.0/24", LB_POOL[0], LB_POOL[1], LB_POOL[2]),
        "via",
        &nodes[0].ip.to_string(),
    ]);

    let probe = workspace_bin("lb-probe");
    let mut pods = Vec::new();
    let layout: [(&str, usize, u8, &'static str); 7] = [
        ("web-1", 0, 2, "web"),
        ("web-2", 0, 3, "web"),
        ("dns-1", 0, 4, "dns"),
        ("web-3", 1, 2, "web"),
        ("web-4", 1, 3, "web"),
        ("dns-2", 1, 4, "dns"),
        ("client", 0, 9, "client"),
    ];
    for (name, node_i, host, app) in layout {
        let node = &nodes[node_i];
        let ns = NetNs::named(&format!("lbsb-{name}"));
        let ip = Ipv4Addr::new(10, 244, node.index, host);
        let gw = format!("10.244.{}.1", node.index);
        let dev = format!("vp-{name}");
        node.ns.ip(&[
            "link",
            "add",
            &dev,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns.name(),
        ]);
        node.ns.ip(&["addr", "add", &format!("{gw}/32"), "dev", &dev]);
        node.ns.ip(&["link", "set", &dev, "up"]);
        node.ns.ip(&["route", "add", &format!("{ip}/32"), "dev", &dev]);
        ns.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"]);
        ns.ip(&["link", "set", "eth0", "up"]);
        ns.ip(&[
            "route",
            "add",
            &format!("{gw}/32"),
            "dev",
            "eth0",
            "scope",
            "link",
        ]);
        ns.ip(&["route", "add", "default", "via", &gw, "dev", "eth0"]);
        let pod_cgroup = node.cgroup.child(name);
        let server = (app != "client").then(|| {
            let mut cmd = Command::new(&probe);
            cmd.args([
                "serve",
                "--name",
                name,
                "--tcp",
                "0.0.0.0:8080",
                "--udp",
                "0.0.0.0:5353",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
            Place::new(&ns, &pod_cgroup).apply(&mut cmd);
            let mut p = Proc::spawn_command(cmd);
            p.wait_for_line(Duration::from_secs(10), |l| l.contains("ready"));
            p
        });
        pods.push(Pod {
            node: node.name.clone(),
            ip,
            app,
            ns,
            _cgroup: pod_cgroup,
            _server: server,
        });
    }
    check_stop()?;

    step("starting the real node (kubelet, containerd, runc, CNI bridge) on the LAN");
    // Started, and later dropped, in this (the main) thread: its processes are tied to it.
    let real = KubeletNode::start(
        &cp,
        &lan,
        NodeConfig {
            ip: node_ip(REAL_NODE_INDEX),
            pod_cidr: pod_cidr(REAL_NODE_INDEX),
            cluster_dns: None,
        },
        &images,
    )?;
    for node in &nodes {
        real.netns()
            .ip(&["route", "add", &pod_cidr(node.index), "via", &node.ip.to_string()]);
    }
    let real_clients = Cgroup::at(
        &real
            .cgroup2()
            .join("sandbox-clients")
            .strip_prefix(cgroup::cgroup2_mount())?
            .display()
            .to_string(),
    );
    check_stop()?;
    step(&format!(
        "deploying lb-agent on {} from manifests/ (kubectl apply -k, as an operator)",
        real.name()
    ));
    // The folder applied is no longer needed once applied.
    drop(kubelet::apply_agent_manifests(&cp, &real)?);

    step("registering the netns nodes with the API server");
    rt.block_on(async {
        let api_nodes: Api<Node> = Api::all(client.clone());
        for node in &nodes {
            // The netns nodes have no kubelet: unschedulable and tainted, so the scheduler puts
            // every Pod of a Deployment on the real node. Without the `kubernetes.io/os` label a
            // kubelet sets, the lb-agent DaemonSet (nodeSelector kubernetes.io/os: linux) skips
            // them too: their agent is the process the sandbox starts below.
            let obj = Node {
                metadata: ObjectMeta {
                    name: Some(node.name.clone()),
                    labels: Some(BTreeMap::from([(
                        "topology.kubernetes.io/zone".to_string(),
                        format!("zone-{}", node.index),
                    )])),
                    ..Default::default()
                },
                spec: Some(NodeSpec {
                    unschedulable: Some(true),
                    taints: Some(vec![Taint {
                        key: NETNS_TAINT.into(),
                        value: Some("true".into()),
                        effect: "NoSchedule".into(),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
                ..Default::default()
            };
            api_nodes.create(&PostParams::default(), &obj).await?;
            let status = NodeStatus {
                addresses: Some(vec![NodeAddress {
                    type_: "InternalIP".into(),
                    address: node.ip.to_string(),
                }]),
                ..Default::default()
            };
            api_nodes
                .patch_status(
                    &node.name,
                    &PatchParams::default(),
                    &Patch::Merge(&serde_json::json!({ "status": status })),
                )
                .await?;
        }
        anyhow::Ok(())
    })?;

    step("starting lb-agent on every netns node");
    let agent_bin = workspace_bin("lb-agent");
    for node in &mut nodes {
        node._forward = Some(PortForward::start(&node.ns, api, api));
        let log = fs::File::create(
            Path::new(STATE_DIR)
                .join("logs")
                .join(format!("{}.log", node.name)),
        )?;
        let mut cmd = Command::new(&agent_bin);
        cmd.args(["--kubeconfig"])
            .arg(cp.kubeconfig_path())
            .args([
                "--hostname-override",
                &node.name,
                "--cluster-cidr",
                "10.244.0.0/16",
                "--bpf-root",
            ])
            .arg(Path::new(STATE_DIR).join("bpf").join(&node.name))
            .arg("--cgroup-root")
            .arg(node.cgroup.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // The agent runs in the node's namespace and cgroup, as the DaemonSet's agent does.
        Place::new(&node.ns, &node.cgroup).apply(&mut cmd);
        node.agent = Some(Proc::spawn_command(cmd));
    }

    let mut cluster = Cluster {
        flows: Vec::new(),
        pods,
        nodes,
        real_clients,
        real,
        external: (ext_ns, ext_ip, ext_cgroup),
        outsider: (out_ns, out_ip),
        _lan: lan,
        _root: root,
        _bpffs: bpffs,
        cp,
        rt,
        initial_services: BTreeSet::new(),
        rate: args.rate,
    };
    step(&format!("applying {}", args.examples.display()));
    let out = cluster
        .cp
        .kubectl(["apply", "-f", &args.examples.display().to_string()])
        .context("kubectl apply")?;
    for line in out.lines() {
        say(&format!("    {line}"));
    }
    cluster.program_endpoints_and_status(&client)?;
    // A copy of the admin kubeconfig at a fixed path, for the user's kubectl (its certificate
    // paths are absolute).
    fs::copy(cluster.cp.kubeconfig_path(), kubeconfig_path())?;
    Ok(cluster)
}

/// The kubeconfig the sandbox prints for the user.
fn kubeconfig_path() -> PathBuf {
    Path::new(STATE_DIR).join("kubeconfig")
}

/// A traffic flow: one `lb-probe load` process and what it saw.
struct Flow {
    service: String,
    /// The Service's uid: its flows stop when it is deleted.
    uid: String,
    frontend: String,
    from: &'static str,
    /// Traffic the data path must drop (a source outside loadBalancerSourceRanges).
    expect_denied: bool,
    client_ip: Ipv4Addr,
    /// Where it sends to and how (`http` or `udp`).
    to: String,
    kind: &'static str,
    stats: Arc<Mutex<FlowStats>>,
    /// `None` until the frontend first answers (a Service created while the sandbox runs).
    proc: Option<Proc>,
}

#[derive(Default)]
struct FlowStats {
    per_backend: BTreeMap<String, u64>,
    errors: u64,
    last_error: Option<String>,
    kept_client_ip: u64,
    replaced_client_ip: u64,
}

/// `namespace/name:port-name`, or the port number for an unnamed port (`kubectl expose`).
fn service_label(ns: &str, name: &str, port: &k8s_openapi::api::core::v1::ServicePort) -> String {
    match port.name.as_deref() {
        Some(port_name) if !port_name.is_empty() => format!("{ns}/{name}:{port_name}"),
        _ => format!("{ns}/{name}:{}", port.port),
    }
}

/// `udp` for a UDP port, else `http` (every backend here is lb-probe, which serves both).
fn kind_of(port: &k8s_openapi::api::core::v1::ServicePort) -> &'static str {
    if port.protocol.as_deref() == Some("UDP") {
        "udp"
    } else {
        "http"
    }
}

/// Starts `lb-probe load` in `place` and a thread that tallies its results into `stats`.
fn spawn_load(
    place: Place<'_>,
    to: &str,
    kind: &str,
    rate: u32,
    client_ip: Ipv4Addr,
    stats: &Arc<Mutex<FlowStats>>,
) -> Result<Proc> {
    let interval = (1000 / rate.max(1)).to_string();
    let mut cmd = Command::new(workspace_bin("lb-probe"));
    cmd.args([
        "load",
        "--to",
        to,
        "--kind",
        kind,
        "--interval-ms",
        &interval,
        "--timeout-ms",
        "500",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped());
    place.apply(&mut cmd);
    let mut proc = Proc::spawn_command(cmd);
    let stdout = proc.child_mut().stdout.take().context("piped stdout")?;
    let sink = stats.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            let mut s = sink.lock().expect("stats lock");
            if v["ok"] == true {
                let server = v
                    .pointer("/reply/server")
                    .and_then(|x| x.as_str())
                    .unwrap_or("?")
                    .to_string();
                *s.per_backend.entry(server).or_default() += 1;
                let seen = v
                    .pointer("/reply/client")
                    .and_then(|x| x.as_str())
                    .unwrap_or("")
                    .rsplit_once(':')
                    .map(|(h, _)| h.to_string())
                    .unwrap_or_default();
                if seen == client_ip.to_string() {
                    s.kept_client_ip += 1;
                } else {
                    s.replaced_client_ip += 1;
                }
            } else {
                s.errors += 1;
                s.last_error = v["error"].as_str().map(str::to_string);
            }
        }
    });
    Ok(proc)
}

/// Whether a frontend answers one request now (300 ms at most).
fn served_once(place: Place<'_>, to: &str, kind: &str) -> bool {
    let args: Vec<&str> = if kind == "udp" {
        vec!["udp", "--to", to, "--timeout-ms", "300"]
    } else {
        vec!["tcp", "--connect", to, "--timeout-ms", "300"]
    };
    let out = lb_tests::process::run_in(place, workspace_bin("lb-probe"), &args);
    String::from_utf8_lossy(&out.stdout).contains("\"ok\":true")
}

impl Cluster {
    /// Plays the EndpointSlice controller (selector -> pods) and the load-balancer controller
    /// (an IP from 203.0.113.0/24 for each LoadBalancer Service).
    fn program_endpoints_and_status(&mut self, client: &kube::Client) -> Result<()> {
        let services: Vec<Service> = self
            .rt
            .block_on(Api::<Service>::all(client.clone()).list(&ListParams::default()))?
            .items;
        let mut next_lb = 10u8;
        for svc in services {
            let (Some(ns), Some(name)) = (svc.metadata.namespace.clone(), svc.metadata.name.clone()) else {
                continue;
            };
            let Some(spec) = &svc.spec else { continue };
            let Some(selector) = &spec.selector else { continue };
            let app = selector.get("app").cloned().unwrap_or_default();
            let endpoints: Vec<Endpoint> = self
                .pods
                .iter()
                .filter(|p| p.app == app)
                .map(|p| Endpoint {
                    addresses: vec![p.ip.to_string()],
                    conditions: Some(EndpointConditions {
                        ready: Some(true),
                        serving: Some(true),
                        terminating: Some(false),
                    }),
                    node_name: Some(p.node.clone()),
                    target_ref: None,
                    ..Default::default()
                })
                .collect();
            let ports: Vec<EndpointPort> = spec
                .ports
                .iter()
                .flatten()
                .map(|p| {
                    let protocol = p.protocol.clone().unwrap_or_else(|| "TCP".into());
                    let number = match &p.target_port {
                        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n)) => *n,
                        // Named target ports: the pods serve http on 8080 and dns on 5353.
                        _ => {
                            if protocol == "UDP" {
                                5353
                            } else {
                                8080
                            }
                        }
                    };
                    EndpointPort {
                        name: p.name.clone(),
                        protocol: Some(protocol),
                        port: Some(number),
                        ..Default::default()
                    }
                })
                .collect();
            let slice = EndpointSlice {
                metadata: ObjectMeta {
                    name: Some(format!("{name}-sandbox")),
                    namespace: Some(ns.clone()),
                    labels: Some(BTreeMap::from([
                        ("kubernetes.io/service-name".to_string(), name.clone()),
                        (
                            "endpointslice.kubernetes.io/managed-by".to_string(),
                            "lb-sandbox".to_string(),
                        ),
                    ])),
                    ..Default::default()
                },
                address_type: "IPv4".into(),
                endpoints: Some(endpoints),
                ports: Some(ports),
            };
            self.rt.block_on(
                Api::<EndpointSlice>::namespaced(client.clone(), &ns).create(&PostParams::default(), &slice),
            )?;
            if spec.type_.as_deref() == Some("LoadBalancer") {
                let ip = Ipv4Addr::new(LB_POOL[0], LB_POOL[1], LB_POOL[2], next_lb);
                next_lb += 1;
                let status = serde_json::json!({"status": {"loadBalancer": {"ingress": [{"ip": ip.to_string(), "ipMode": "VIP"}]}}});
                self.rt
                    .block_on(Api::<Service>::namespaced(client.clone(), &ns).patch_status(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(&status),
                    ))?;
            }
        }
        Ok(())
    }

    /// One load generator per (Service frontend, client): pods call cluster IPs, the external
    /// client calls NodePorts on both nodes and load-balancer IPs.
    fn start_traffic(&mut self, client: &kube::Client) -> Result<()> {
        let services: Vec<Service> = self
            .rt
            .block_on(Api::<Service>::all(client.clone()).list(&ListParams::default()))?
            .items;
        let client_pod = self
            .pods
            .iter()
            .find(|p| p.app == "client")
            .context("client pod")?;
        for svc in services {
            let (Some(ns), Some(name)) = (svc.metadata.namespace.clone(), svc.metadata.name.clone()) else {
                continue;
            };
            let uid = svc.metadata.uid.clone().unwrap_or_default();
            self.initial_services.insert(uid.clone());
            if ns == "default" {
                continue; // the `kubernetes` Service
            }
            let spec = svc.spec.clone().unwrap_or_default();
            let lb_ips: Vec<String> = svc
                .status
                .as_ref()
                .and_then(|s| s.load_balancer.as_ref())
                .and_then(|l| l.ingress.as_ref())
                .map(|i| i.iter().filter_map(|x| x.ip.clone()).collect())
                .unwrap_or_default();
            for port in spec.ports.iter().flatten() {
                let kind = kind_of(port);
                let mut targets: Vec<(String, &'static str)> = Vec::new();
                if let Some(cip) = spec.cluster_ip.as_deref().filter(|c| *c != "None") {
                    targets.push((format!("{cip}:{}", port.port), "pod"));
                }
                if let Some(np) = port.node_port {
                    for node in &self.nodes {
                        targets.push((format!("{}:{np}", node.ip), "external"));
                    }
                }
                for ip in &lb_ips {
                    targets.push((format!("{ip}:{}", port.port), "external"));
                    if !spec
                        .load_balancer_source_ranges
                        .clone()
                        .unwrap_or_default()
                        .is_empty()
                    {
                        targets.push((format!("{ip}:{}", port.port), "outsider"));
                    }
                }
                for (to, from) in targets {
                    let (place, client_ip) = match from {
                        "pod" => (Place::new(&client_pod.ns, &self.nodes[0].cgroup), client_pod.ip),
                        "outsider" => (Place::netns(&self.outsider.0), self.outsider.1),
                        _ => (Place::new(&self.external.0, &self.external.2), self.external.1),
                    };
                    let expect_denied = from == "outsider";
                    if !expect_denied {
                        wait_until_served(place, &to, kind);
                    }
                    let stats = Arc::new(Mutex::new(FlowStats::default()));
                    let proc = spawn_load(place, &to, kind, self.rate, client_ip, &stats)?;
                    let kind_label = match (spec.type_.as_deref(), from) {
                        (_, "pod") => "ClusterIP",
                        _ if lb_ips.iter().any(|ip| to.starts_with(ip.as_str())) => "LoadBalancer",
                        _ => "NodePort",
                    };
                    self.flows.push(Flow {
                        service: service_label(&ns, &name, port),
                        uid: uid.clone(),
                        frontend: format!(
                            "{kind_label} {to}/{}",
                            port.protocol.clone().unwrap_or_else(|| "TCP".into())
                        ),
                        from,
                        expect_denied,
                        client_ip,
                        to,
                        kind,
                        stats,
                        proc: Some(proc),
                    });
                }
            }
        }
        Ok(())
    }

    /// Follows the user's Services: a Service created while the sandbox runs (any namespace, with
    /// a ClusterIP) gets a flow per port from a client on the real node to its ClusterIP, started
    /// once it first answers; a deleted Service's flows stop and leave the table.
    fn follow_services(&mut self, client: &kube::Client) {
        let listed = self.rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(2),
                Api::<Service>::all(client.clone()).list(&ListParams::default()),
            )
            .await
        });
        // The API server busy or restarting: try again on the next round.
        let Ok(Ok(services)) = listed else { return };
        let mut wanted: BTreeMap<(String, String), (String, &'static str, String)> = BTreeMap::new();
        let mut live = BTreeSet::new();
        for svc in &services.items {
            let (Some(ns), Some(name), Some(uid)) = (
                svc.metadata.namespace.as_deref(),
                svc.metadata.name.as_deref(),
                svc.metadata.uid.as_deref(),
            ) else {
                continue;
            };
            live.insert(uid.to_string());
            if self.initial_services.contains(uid) || (ns == "default" && name == "kubernetes") {
                continue;
            }
            let spec = svc.spec.clone().unwrap_or_default();
            let Some(cip) = spec
                .cluster_ip
                .as_deref()
                .filter(|c| !c.is_empty() && *c != "None")
            else {
                continue;
            };
            for port in spec.ports.iter().flatten() {
                let protocol = port.protocol.clone().unwrap_or_else(|| "TCP".into());
                if protocol == "SCTP" {
                    continue;
                }
                wanted.insert(
                    (uid.to_string(), format!("{cip}:{}", port.port)),
                    (
                        service_label(ns, name, port),
                        kind_of(port),
                        format!("ClusterIP {cip}:{}/{protocol}", port.port),
                    ),
                );
            }
        }
        // Deleted Services (and ports): their loads stop with their flows.
        let mut gone = BTreeSet::new();
        self.flows.retain(|f| {
            let keep = live.contains(&f.uid)
                && (self.initial_services.contains(&f.uid)
                    || wanted.contains_key(&(f.uid.clone(), f.to.clone())));
            if !keep {
                gone.insert(f.service.clone());
            }
            keep
        });
        for service in gone {
            step(&format!("{service} is gone: its traffic stopped"));
        }
        let client_ip = kubelet_gateway(self.real.pod_cidr());
        for ((uid, to), (service, kind, frontend)) in wanted {
            if self.flows.iter().any(|f| f.uid == uid && f.to == to) {
                continue;
            }
            step(&format!(
                "following {service}: traffic from the real node to {to} once it answers"
            ));
            self.flows.push(Flow {
                service,
                uid,
                frontend,
                from: "real-node",
                expect_denied: false,
                client_ip,
                to,
                kind,
                stats: Arc::default(),
                proc: None,
            });
        }
        let place = Place::new(self.real.netns(), &self.real_clients);
        for flow in self.flows.iter_mut().filter(|f| f.proc.is_none()) {
            if served_once(place, &flow.to, flow.kind) {
                match spawn_load(place, &flow.to, flow.kind, self.rate, flow.client_ip, &flow.stats) {
                    Ok(proc) => flow.proc = Some(proc),
                    Err(e) => say(&format!("    {}: no load started: {e:#}", flow.service)),
                }
            }
        }
    }

    fn render(&self, elapsed: Duration) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "lb sandbox: 2 netns nodes with {} pods, real node {} (kubelet: your Deployments), external clients {} and {} (outside the LB source ranges) — running for {:.0?}\n\n",
            self.pods.len(),
            self.real.name(),
            self.external.1,
            self.outsider.1,
            Duration::from_secs(elapsed.as_secs())
        ));
        let mut by_service: BTreeMap<&str, Vec<&Flow>> = BTreeMap::new();
        for f in &self.flows {
            by_service.entry(&f.service).or_default().push(f);
        }
        for (service, flows) in by_service {
            out.push_str(&format!("{service}\n"));
            out.push_str(&format!(
                "  {:<36} {:<9} {:<48} {:>6}  {}\n",
                "FRONTEND", "FROM", "REQUESTS PER BACKEND", "ERRORS", "CLIENT IP"
            ));
            for f in flows {
                let s = f.stats.lock().expect("stats lock");
                let backends = if f.proc.is_none() {
                    "(waiting for a first answer)".to_string()
                } else if s.per_backend.is_empty() {
                    "-".to_string()
                } else {
                    s.per_backend
                        .iter()
                        .map(|(b, n)| format!("{b}:{n}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                };
                let kept = match (s.kept_client_ip, s.replaced_client_ip) {
                    (0, 0) => "-".to_string(),
                    (_, 0) => format!("preserved ({})", f.client_ip),
                    (0, _) => "masqueraded".to_string(),
                    _ => "mixed".to_string(),
                };
                let errors = match &s.last_error {
                    Some(e) if s.errors > 0 => {
                        format!("{} ({})", s.errors, e.chars().take(30).collect::<String>())
                    }
                    _ => s.errors.to_string(),
                };
                out.push_str(&format!(
                    "  {:<36} {:<9} {:<48} {:>6}  {}\n",
                    f.frontend, f.from, backends, errors, kept
                ));
            }
            out.push('\n');
        }
        out
    }

    /// The figures of every flow, for `--summary-json`.
    fn summary(&self) -> serde_json::Value {
        let flows: Vec<serde_json::Value> = self
            .flows
            .iter()
            .map(|f| {
                let s = f.stats.lock().expect("stats lock");
                serde_json::json!({
                    "service": f.service,
                    "frontend": f.frontend,
                    "from": f.from,
                    "client_ip": f.client_ip.to_string(),
                    "expect_denied": f.expect_denied,
                    "started": f.proc.is_some(),
                    "per_backend": s.per_backend,
                    "errors": s.errors,
                    "last_error": s.last_error,
                    "kept_client_ip": s.kept_client_ip,
                    "replaced_client_ip": s.replaced_client_ip,
                })
            })
            .collect();
        serde_json::json!({ "real_node": self.real.name(), "flows": flows })
    }

    fn write_summary(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("tmp");
        fs::write(&tmp, serde_json::to_string_pretty(&self.summary())?)?;
        fs::rename(&tmp, path)?;
        Ok(())
    }

    fn instructions(&self) -> String {
        let kubectl = if on_path("kubectl") {
            String::new()
        } else {
            format!(
                " (kubectl is not on your PATH: this one matches the cluster: {})",
                self.cp.binaries().kubectl.display()
            )
        };
        let mut s = String::new();
        s.push_str(&format!(
            "Use it with kubectl, as root from another terminal{kubectl}:\n"
        ));
        s.push_str(&format!("  export KUBECONFIG={}\n", kubeconfig_path().display()));
        s.push_str("  kubectl get nodes,pods,svc,endpointslices -A\n");
        s.push_str(&format!(
            "Pods run on the real node {} (the netns nodes have no kubelet); every Service you create gets a row:\n",
            self.real.name()
        ));
        for example in [
            "kubectl create deployment hello --image=localhost/lb-probe:dev --replicas=2",
            "kubectl expose deployment hello --port=80 --target-port=8080",
            "kubectl scale deployment hello --replicas=4",
            "kubectl delete pod -l app=hello",
        ] {
            s.push_str(&format!("  {example}\n"));
        }
        s.push_str("Look inside:\n");
        s.push_str(
            "  kubectl -n kube-system exec ds/lb-agent -- lb-agent services   (the real node's agent)\n",
        );
        for n in &self.nodes {
            s.push_str(&format!(
                "  nsenter --net=/run/netns/{} {} services --bpf-root {STATE_DIR}/bpf/{}\n",
                n.ns.name(),
                workspace_bin("lb-agent").display(),
                n.name
            ));
        }
        s.push_str(&format!(
            "  bpftool map dump pinned {STATE_DIR}/bpf/node-1/maps/lb4_services\n"
        ));
        s.push_str(&format!(
            "  logs: {STATE_DIR}/logs/node-*.log (netns agents), {}/kubelet.log   (Ctrl-C tears everything down)\n",
            self.real.dir().display()
        ));
        s
    }
}

/// The real node's bridge address (the first of its Pod range): the source address of its
/// connections to its own Pods.
fn kubelet_gateway(cidr: &str) -> Ipv4Addr {
    let net: Ipv4Addr = cidr
        .split_once('/')
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or(Ipv4Addr::UNSPECIFIED);
    Ipv4Addr::from(u32::from(net) + 1)
}

/// Whether `program` is on PATH.
fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Waits (up to 20 s) until a frontend answers once, so the table starts from a programmed data
/// path rather than counting the agents' start-up as errors.
fn wait_until_served(place: Place<'_>, to: &str, kind: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && !STOP.load(Ordering::SeqCst) {
        if served_once(place, to, kind) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    say(&format!(
        "    {to} did not answer within 20s; counting from now anyway"
    ));
}

fn wait_for_agents(cluster: &mut Cluster) -> Result<()> {
    step("waiting for the agents' first sync");
    let deadline = Instant::now() + Duration::from_secs(60);
    for node in &mut cluster.nodes {
        let log = Path::new(STATE_DIR)
            .join("logs")
            .join(format!("{}.log", node.name));
        loop {
            check_stop()?;
            if fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("data path attached")
            {
                break;
            }
            if node.agent.as_mut().is_some_and(|a| !a.running()) {
                bail!(
                    "lb-agent on {} exited:\n{}",
                    node.name,
                    fs::read_to_string(&log).unwrap_or_default()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "lb-agent on {} did not sync within 60s:\n{}",
                    node.name,
                    fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // The DaemonSet's Pod on the real node: Ready through its own probes, called by kubelet.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        check_stop()?;
        let pods = cluster.cp.kubectl([
            "-n",
            "kube-system",
            "get",
            "pods",
            "-l",
            "k8s-app=lb-agent",
            "-o",
            "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].status}",
        ]);
        if pods.as_deref().is_ok_and(|s| s.trim() == "True") {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the lb-agent Pod on {} was not Ready within 120s ({pods:?})\n{}",
                cluster.real.name(),
                cluster.real.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the sandbox needs root (network namespaces, cgroups, BPF): run `sudo ./x sandbox`");
    }
    TTY_OUT.store(std::io::stdout().is_terminal(), Ordering::SeqCst);
    TTY_ERR.store(std::io::stderr().is_terminal(), Ordering::SeqCst);
    // SAFETY: the handler only uses atomics and async-signal-safe calls.
    unsafe {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
    clean_leftovers();
    let started = Instant::now();
    let built = build(&args).and_then(|mut cluster| {
        wait_for_agents(&mut cluster)?;
        let client = cluster.rt.block_on(cluster.cp.client())?;
        step("driving traffic from a pod and from the external client to every example frontend");
        cluster.start_traffic(&client)?;
        check_stop()?;
        Ok((cluster, client))
    });
    let (mut cluster, client) = match built {
        Ok(built) => built,
        // Everything started so far was dropped on the way out (in this thread). A signal may
        // also have ended a child first (Ctrl-C and a hang-up reach the whole process group):
        // that is a stop too, not a failure.
        Err(e) if e.is::<Interrupted>() || STOP.load(Ordering::SeqCst) => {
            let _ = fs::remove_dir_all(STATE_DIR);
            let _ = fs::remove_dir_all(WORK_DIR);
            step(&format!(
                "stopped while starting (signal {}); everything removed",
                SIGNAL.load(Ordering::SeqCst)
            ));
            return Ok(());
        }
        Err(e) => {
            // The state directory keeps the netns agents' logs for a look; the next run removes
            // it. The control plane and the real node removed their directories.
            let _ = fs::remove_dir(WORK_DIR);
            return Err(e);
        }
    };
    say(&format!("\n{}", cluster.instructions()));
    step(&format!(
        "ready after {:.1}s: the table follows",
        started.elapsed().as_secs_f64()
    ));
    let tty = std::io::stdout().is_terminal();
    let traffic_started = Instant::now();
    let mut last_print = Instant::now() - Duration::from_secs(60);
    let mut last_follow = Instant::now();
    let mut last_summary = Instant::now() - Duration::from_secs(60);
    while !STOP.load(Ordering::SeqCst) && args.duration.is_none_or(|d| traffic_started.elapsed() < d) {
        if last_follow.elapsed() >= FOLLOW_EVERY {
            cluster.follow_services(&client);
            last_follow = Instant::now();
        }
        let every = if tty {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(10)
        };
        if last_print.elapsed() >= every {
            let table = cluster.render(traffic_started.elapsed());
            let mut stdout = std::io::stdout();
            if tty {
                let _ = write!(stdout, "\x1b[2J\x1b[H{table}{}", cluster.instructions());
            } else {
                let _ = writeln!(stdout, "{table}");
            }
            let _ = stdout.flush();
            last_print = Instant::now();
        }
        if let Some(path) = &args.summary_json
            && last_summary.elapsed() >= Duration::from_secs(1)
        {
            cluster.write_summary(path)?;
            last_summary = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // The final table, then an orderly teardown.
    let _ = writeln!(std::io::stdout(), "{}", cluster.render(traffic_started.elapsed()));
    if let Some(path) = &args.summary_json {
        cluster.write_summary(path)?;
    }
    match SIGNAL.load(Ordering::SeqCst) {
        0 => step("tearing down"),
        sig => step(&format!("tearing down (signal {sig})")),
    }
    let teardown = Instant::now();
    for node in &mut cluster.nodes {
        if let Some(agent) = &node.agent {
            agent.signal(libc::SIGTERM);
        }
    }
    drop(cluster);
    let _ = fs::remove_dir_all(STATE_DIR);
    let _ = fs::remove_dir_all(WORK_DIR);
    step(&format!(
        "done after {:.0?} (teardown {:.1}s)",
        Duration::from_secs(started.elapsed().as_secs()),
        teardown.elapsed().as_secs_f64()
    ));
    Ok(())
}
