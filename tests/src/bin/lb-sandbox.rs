//! The sandbox (README command 1): a small cluster on this machine, for real.
//!
//! - a real etcd and kube-apiserver on loopback;
//! - two "nodes" in network namespaces on a shared LAN, each running lb-agent against the API
//!   server, each with pods (HTTP on :8080, UDP echo on :5353) behind veths, in the node's cgroup;
//! - an external client host on the LAN;
//! - the example Services of `manifests/examples/`, with EndpointSlices the sandbox writes itself
//!   (there is no controller manager or kubelet), and LoadBalancer status it fills in;
//! - traffic from a pod and from the external client to every frontend, and a live table per
//!   Service: frontend, backends and requests per backend, errors, whether the client IP was kept.
//!
//! It runs until Ctrl-C or `--duration`, then tears everything down; a run that crashed is
//! cleaned up by the next one (fixed names under `/run/lb-sandbox`, the `lb-sandbox` cgroup and
//! `lbsb-*` namespaces). It never touches the machine's interfaces or root cgroup.

use std::{
    collections::BTreeMap,
    fs,
    io::{BufRead, BufReader, IsTerminal, Write},
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::Parser;
use k8s_openapi::{
    api::{
        core::v1::{Node, NodeAddress, NodeStatus, Service},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use lb_tests::{
    bpffs::BpfFs,
    cgroup::{self, Cgroup},
    control_plane::ControlPlane,
    netns::{NetNs, PortForward},
    process::{Place, Proc, workspace_bin},
};

const STATE_DIR: &str = "/run/lb-sandbox";
const CGROUP: &str = "lb-sandbox";
const LB_POOL: [u8; 3] = [203, 0, 113];

#[derive(Parser)]
#[command(
    name = "lb-sandbox",
    about = "A local cluster in network namespaces running lb-agent, with live traffic"
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
    /// Write the final figures of every flow as JSON to this file (for tests).
    #[arg(long)]
    summary_json: Option<PathBuf>,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn step(message: &str) {
    eprintln!("==> {message}");
}

/// Kills whatever a crashed run left: processes (the control plane's, found by their command line
/// naming the state directory; everything else is in the sandbox cgroup), namespaces, the cgroup
/// tree, the bpffs mount.
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
            if String::from_utf8_lossy(&cmdline).contains(STATE_DIR) {
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
    let bpf = Path::new(STATE_DIR).join("bpf");
    while nix::mount::umount2(&bpf, nix::mount::MntFlags::MNT_DETACH).is_ok() {}
    let _ = fs::remove_dir_all(STATE_DIR);
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
    // Drop order: traffic, agents and pods first, then nodes, then the LAN, the cgroup, bpffs, and
    // the control plane last.
    flows: Vec<Flow>,
    pods: Vec<Pod>,
    nodes: Vec<SandboxNode>,
    external: (NetNs, Ipv4Addr, Cgroup),
    /// A second external client outside the LoadBalancer's source ranges.
    outsider: (NetNs, Ipv4Addr),
    _lan: NetNs,
    _root: Cgroup,
    _bpffs: BpfFs,
    cp: ControlPlane,
    rt: tokio::runtime::Runtime,
}

fn veth_to_lan(lan: &NetNs, port: &str, ns: &NetNs, dev: &str, addr: &str) {
    lb_tests::netns::veth(lan, port, None, ns, dev, Some(addr));
    lan.ip(&["link", "set", port, "master", "br0"]);
}

fn build(args: &Args) -> Result<Cluster> {
    fs::create_dir_all(Path::new(STATE_DIR).join("logs"))?;
    fs::create_dir_all(Path::new(STATE_DIR).join("tmp"))?;
    // The control plane's files (and so its processes' command lines) live under the state
    // directory, so a later run can find them if this one crashes.
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("TMPDIR", Path::new(STATE_DIR).join("tmp")) };
    step("starting etcd and kube-apiserver");
    let cp = ControlPlane::start()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let client = rt.block_on(cp.client())?;
    let api: SocketAddr = cp.server_url().trim_start_matches("https://").parse()?;

    step("creating the LAN, two nodes with pods, and an external client in network namespaces");
    let bpffs = BpfFs::at(&Path::new(STATE_DIR).join("bpf"));
    let root = Cgroup::at(CGROUP);
    let lan = NetNs::named("lbsb-lan");
    lan.ip(&["link", "add", "br0", "type", "bridge"]);
    lan.ip(&["link", "set", "br0", "up"]);
    let mut nodes = Vec::new();
    for index in 1..=2u8 {
        let ns = NetNs::named(&format!("lbsb-n{index}"));
        ns.sysctl("net.ipv4.ip_forward=1");
        ns.sysctl("net.ipv4.conf.all.rp_filter=0");
        ns.sysctl("net.ipv4.conf.default.rp_filter=0");
        let ip = Ipv4Addr::new(192, 168, 50, 10 + index);
        veth_to_lan(&lan, &format!("ln{index}"), &ns, "eth0", &format!("{ip}/24"));
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
    for a in &nodes {
        for b in &nodes {
            if a.index != b.index {
                a.ns.ip(&[
                    "route",
                    "add",
                    &format!("10.244.{}.0/24", b.index),
                    "via",
                    &b.ip.to_string(),
                ]);
            }
        }
    }
    let ext_ns = NetNs::named("lbsb-ext");
    let ext_ip = Ipv4Addr::new(192, 168, 50, 100);
    veth_to_lan(&lan, "lext", &ext_ns, "eth0", &format!("{ext_ip}/24"));
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
    veth_to_lan(&lan, "lout", &out_ns, "eth0", &format!("{out_ip}/24"));
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

    step("registering the nodes with the API server");
    rt.block_on(async {
        let api_nodes: Api<Node> = Api::all(client.clone());
        for node in &nodes {
            let obj = Node {
                metadata: ObjectMeta {
                    name: Some(node.name.clone()),
                    labels: Some(BTreeMap::from([(
                        "topology.kubernetes.io/zone".to_string(),
                        format!("zone-{}", node.index),
                    )])),
                    ..Default::default()
                },
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

    step("starting lb-agent on every node");
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
        external: (ext_ns, ext_ip, ext_cgroup),
        outsider: (out_ns, out_ip),
        _lan: lan,
        _root: root,
        _bpffs: bpffs,
        cp,
        rt,
    };
    step(&format!("applying {}", args.examples.display()));
    let out = cluster
        .cp
        .kubectl(["apply", "-f", &args.examples.display().to_string()])
        .context("kubectl apply")?;
    for line in out.lines() {
        eprintln!("    {line}");
    }
    cluster.program_endpoints_and_status(&client)?;
    Ok(cluster)
}

/// A traffic flow: one `lb-probe load` process and what it saw.
struct Flow {
    service: String,
    frontend: String,
    from: &'static str,
    /// Traffic the data path must drop (a source outside loadBalancerSourceRanges).
    expect_denied: bool,
    client_ip: Ipv4Addr,
    stats: Arc<Mutex<FlowStats>>,
    _proc: Proc,
}

#[derive(Default)]
struct FlowStats {
    per_backend: BTreeMap<String, u64>,
    errors: u64,
    last_error: Option<String>,
    kept_client_ip: u64,
    replaced_client_ip: u64,
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
    fn start_traffic(&mut self, client: &kube::Client, rate: u32) -> Result<()> {
        let services: Vec<Service> = self
            .rt
            .block_on(Api::<Service>::all(client.clone()).list(&ListParams::default()))?
            .items;
        let probe = workspace_bin("lb-probe");
        let interval = (1000 / rate.max(1)).to_string();
        let client_pod = self
            .pods
            .iter()
            .find(|p| p.app == "client")
            .context("client pod")?;
        for svc in services {
            let (Some(ns), Some(name)) = (svc.metadata.namespace.clone(), svc.metadata.name.clone()) else {
                continue;
            };
            if ns == "default" {
                continue; // the `kubernetes` Service has no endpoints here
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
                let kind = if port.protocol.as_deref() == Some("UDP") {
                    "udp"
                } else {
                    "http"
                };
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
                    let mut cmd = Command::new(&probe);
                    cmd.args([
                        "load",
                        "--to",
                        &to,
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
                    let stats = Arc::new(Mutex::new(FlowStats::default()));
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
                    let kind_label = match (spec.type_.as_deref(), from) {
                        (_, "pod") => "ClusterIP",
                        _ if lb_ips.iter().any(|ip| to.starts_with(ip.as_str())) => "LoadBalancer",
                        _ => "NodePort",
                    };
                    self.flows.push(Flow {
                        service: format!("{ns}/{name}:{}", port.name.clone().unwrap_or_default()),
                        frontend: format!(
                            "{kind_label} {to}/{}",
                            port.protocol.clone().unwrap_or_else(|| "TCP".into())
                        ),
                        from,
                        expect_denied,
                        client_ip,
                        stats,
                        _proc: proc,
                    });
                }
            }
        }
        Ok(())
    }

    fn render(&self, elapsed: Duration) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "lb sandbox: 2 nodes, {} pods, external clients {} and {} (outside the LB source ranges) — running for {:.0?}\n\n",
            self.pods.len(),
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
                let backends = if s.per_backend.is_empty() {
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

    /// The final figures of every flow, for `--summary-json`.
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
                    "per_backend": s.per_backend,
                    "errors": s.errors,
                    "last_error": s.last_error,
                    "kept_client_ip": s.kept_client_ip,
                    "replaced_client_ip": s.replaced_client_ip,
                })
            })
            .collect();
        serde_json::json!({ "flows": flows })
    }

    fn instructions(&self) -> String {
        let kubeconfig = self.cp.kubeconfig_path().display();
        let mut s = String::new();
        s.push_str("Poke at it while it runs:\n");
        s.push_str(&format!(
            "  kubectl --kubeconfig {kubeconfig} get svc,endpointslices -A\n"
        ));
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
            "  agent logs: {STATE_DIR}/logs/node-*.log   (Ctrl-C tears everything down)\n"
        ));
        s
    }
}

/// Waits (up to 20 s) until a frontend answers once, so the table starts from a programmed data
/// path rather than counting the agents' start-up as errors.
fn wait_until_served(place: Place<'_>, to: &str, kind: &str) {
    let probe = workspace_bin("lb-probe");
    let deadline = Instant::now() + Duration::from_secs(20);
    let args: Vec<&str> = if kind == "udp" {
        vec!["udp", "--to", to, "--timeout-ms", "300"]
    } else {
        vec!["tcp", "--connect", to, "--timeout-ms", "300"]
    };
    while Instant::now() < deadline {
        let out = lb_tests::process::run_in(place, &probe, &args);
        if String::from_utf8_lossy(&out.stdout).contains("\"ok\":true") {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("    {to} did not answer within 20s; counting from now anyway");
}

fn wait_for_agents(cluster: &mut Cluster) -> Result<()> {
    step("waiting for the agents' first sync");
    let deadline = Instant::now() + Duration::from_secs(60);
    for node in &mut cluster.nodes {
        let log = Path::new(STATE_DIR)
            .join("logs")
            .join(format!("{}.log", node.name));
        loop {
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
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the sandbox needs root (network namespaces, cgroups, BPF): run `sudo ./x sandbox`");
    }
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    clean_leftovers();
    let started = Instant::now();
    let mut cluster = build(&args)?;
    wait_for_agents(&mut cluster)?;
    let client = cluster.rt.block_on(cluster.cp.client())?;
    step("driving traffic from a pod and from the external client to every frontend");
    cluster.start_traffic(&client, args.rate)?;
    eprintln!("\n{}", cluster.instructions());
    let tty = std::io::stdout().is_terminal();
    let traffic_started = Instant::now();
    let mut last_print = Instant::now() - Duration::from_secs(60);
    while !STOP.load(Ordering::SeqCst) && args.duration.is_none_or(|d| traffic_started.elapsed() < d) {
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
        std::thread::sleep(Duration::from_millis(100));
    }
    // The final table, then an orderly teardown.
    println!("{}", cluster.render(traffic_started.elapsed()));
    if let Some(path) = &args.summary_json {
        fs::write(path, serde_json::to_string_pretty(&cluster.summary())?)?;
    }
    step("tearing down");
    for node in &mut cluster.nodes {
        if let Some(agent) = &node.agent {
            agent.signal(libc::SIGTERM);
        }
    }
    drop(cluster);
    let _ = fs::remove_dir_all(STATE_DIR);
    step(&format!(
        "done after {:.0?}",
        Duration::from_secs(started.elapsed().as_secs())
    ));
    Ok(())
}
