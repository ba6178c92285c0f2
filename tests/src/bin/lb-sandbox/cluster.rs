//! The sandbox's cluster: the control plane with its controllers, the LAN, two netns nodes
//! with their pods and lb-agent processes, the real kubelet node with lb-agent deployed from
//! `manifests/`, the external clients; built in order, and waited for until the agents serve.
//!
//! Everything is dual-stack, IPv4 first (the API server's primary family): every IPv4 address
//! `a.b.c.d` of the layout has its IPv6 twin `fd00:a:b:c::d` (`topo::ipv6_twin`: pods
//! `fd00:10:244:<node>::<n>`, the LAN `fd00:192:168:50::/64`), added without duplicate address
//! detection so it is usable at once.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use k8s_openapi::{
    api::core::v1::{Node, NodeAddress, NodeSpec, NodeStatus, Taint},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::api::{Api, Patch, PatchParams, PostParams};
use lb_tests::{
    bpffs::BpfFs,
    cgroup::{self, Cgroup},
    control_plane::ControlPlane,
    kubelet::{self, KubeletNode, NodeConfig, NodeIpv6},
    netns::{NetNs, PortForward},
    process::{Place, Proc, workspace_bin},
    topo::{Lan, ipv6_twin},
};

use crate::{
    Args, CGROUP, LB_POOL, NETNS_TAINT, REAL_NODE_INDEX, STATE_DIR, WORK_DIR,
    stop::{check_stop, say, step},
    traffic::Flow,
};

/// One pod: its namespace, addresses, labels and its server process.
pub(crate) struct Pod {
    pub(crate) node: String,
    pub(crate) ip: Ipv4Addr,
    pub(crate) ip6: Ipv6Addr,
    pub(crate) app: &'static str,
    pub(crate) ns: NetNs,
    _cgroup: Cgroup,
    _server: Option<Proc>,
}

/// One node: namespace, LAN addresses, cgroup, agent.
pub(crate) struct SandboxNode {
    pub(crate) name: String,
    pub(crate) index: u8,
    pub(crate) ip: Ipv4Addr,
    pub(crate) ip6: Ipv6Addr,
    pub(crate) ns: NetNs,
    pub(crate) cgroup: Cgroup,
    pub(crate) agent: Option<Proc>,
    _forward: Option<PortForward>,
}

pub(crate) struct Cluster {
    // Drop order: traffic, agents and pods first, then nodes, the real node (in the main thread,
    // where it was started), then the LAN, the cgroup, bpffs, and the control plane last.
    pub(crate) flows: Vec<Flow>,
    pub(crate) pods: Vec<Pod>,
    pub(crate) nodes: Vec<SandboxNode>,
    /// The cgroup of the real node's traffic clients, under the node's cgroup, so that the
    /// node's lb-agent (the DaemonSet's) balances their sockets as it does its Pods'.
    pub(crate) real_clients: Cgroup,
    pub(crate) real: KubeletNode,
    pub(crate) external: Host,
    /// A second external client outside the LoadBalancer's source ranges.
    pub(crate) outsider: Host,
    _lan: Lan,
    _root: Cgroup,
    _bpffs: BpfFs,
    pub(crate) cp: ControlPlane,
    pub(crate) rt: tokio::runtime::Runtime,
    /// The Services seen when the traffic started (the examples): their flows are the ones of
    /// `start_traffic`; any other Service gets a flow from the real node (`follow_services`).
    pub(crate) initial_services: BTreeSet<String>,
    pub(crate) rate: u32,
}

/// A host on the LAN outside the cluster: its namespace, its addresses, and the cgroup its
/// traffic runs in (where the sandbox puts it, so the client's sockets are not the test's).
pub(crate) struct Host {
    pub(crate) ns: NetNs,
    pub(crate) ip: Ipv4Addr,
    pub(crate) ip6: Ipv6Addr,
    pub(crate) cgroup: Option<Cgroup>,
}

impl Host {
    pub(crate) fn place(&self) -> Place<'_> {
        match &self.cgroup {
            Some(cgroup) => Place::new(&self.ns, cgroup),
            None => Place::netns(&self.ns),
        }
    }
}

/// The address of the family of `like` among an IPv4 address and its IPv6 twin.
pub(crate) fn of_family(like: IpAddr, ip: Ipv4Addr, ip6: Ipv6Addr) -> IpAddr {
    if like.is_ipv6() { ip6.into() } else { ip.into() }
}

impl Pod {
    /// The pod's address of the family of `like`.
    pub(crate) fn addr_like(&self, like: IpAddr) -> IpAddr {
        of_family(like, self.ip, self.ip6)
    }
}

impl SandboxNode {
    /// The node's LAN address of the family of `like`.
    pub(crate) fn addr_like(&self, like: IpAddr) -> IpAddr {
        of_family(like, self.ip, self.ip6)
    }
}

/// Connects `ns` to the LAN: `dev` gets `ip`/24 and its IPv6 twin /64.
fn veth_to_lan(lan: &NetNs, port: &str, ns: &NetNs, dev: &str, ip: Ipv4Addr) {
    lb_tests::netns::veth(lan, port, None, ns, dev, Some(&format!("{ip}/24")));
    lan.ip(&["link", "set", port, "master", "br0"]);
    add_ipv6(ns, &format!("{}/64", ipv6_twin(ip)), dev);
}

/// Adds an IPv6 address (CIDR notation) to `dev` in `ns`, usable at once (no duplicate address
/// detection).
fn add_ipv6(ns: &NetNs, addr: &str, dev: &str) {
    ns.ip(&["-6", "addr", "add", addr, "dev", dev, "nodad"]);
}

fn pod_cidr(index: u8) -> String {
    format!("10.244.{index}.0/24")
}

/// The IPv6 twin of [`pod_cidr`]: `fd00:10:244:<index>::/64`.
fn pod_cidr6(index: u8) -> String {
    format!("{}/64", ipv6_twin(Ipv4Addr::new(10, 244, index, 0)))
}

/// The pod CIDRs the agents are told: one per family.
fn cluster_cidr() -> String {
    format!("{},{}", kubelet::CLUSTER_CIDR, kubelet::CLUSTER_CIDR6)
}

fn node_ip(index: u8) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 50, 10 + index)
}

pub(crate) fn build(args: &Args) -> Result<Cluster> {
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
        ns.sysctl("net.ipv6.conf.all.forwarding=1");
        let ip = node_ip(index);
        veth_to_lan(&lan.ns, &format!("ln{index}"), &ns, "eth0", ip);
        nodes.push(SandboxNode {
            name: format!("node-{index}"),
            index,
            ip,
            ip6: ipv6_twin(ip),
            ns,
            cgroup: root.child(&format!("node-{index}")),
            agent: None,
            _forward: None,
        });
    }
    // Every node routes the other nodes' Pod ranges (the real node's too) via their LAN address,
    // in both families.
    let all_nodes: Vec<u8> = vec![1, 2, REAL_NODE_INDEX];
    for a in &nodes {
        for &b in &all_nodes {
            if a.index != b {
                a.ns.ip(&["route", "add", &pod_cidr(b), "via", &node_ip(b).to_string()]);
                let via6 = ipv6_twin(node_ip(b)).to_string();
                a.ns.ip(&["-6", "route", "add", &pod_cidr6(b), "via", &via6]);
            }
        }
    }
    let ext_ns = NetNs::named("lbsb-ext");
    let ext_ip = Ipv4Addr::new(192, 168, 50, 100);
    veth_to_lan(&lan.ns, "lext", &ext_ns, "eth0", ext_ip);
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
    veth_to_lan(&lan.ns, "lout", &out_ns, "eth0", out_ip);
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
        let ip6 = ipv6_twin(ip);
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
        // The same wiring in IPv6: the gateway's twin on the node side, the pod's /128.
        let gw6 = ipv6_twin(Ipv4Addr::new(10, 244, node.index, 1)).to_string();
        add_ipv6(&node.ns, &format!("{gw6}/128"), &dev);
        node.ns
            .ip(&["-6", "route", "add", &format!("{ip6}/128"), "dev", &dev]);
        add_ipv6(&ns, &format!("{ip6}/128"), "eth0");
        ns.ip(&["-6", "route", "add", &format!("{gw6}/128"), "dev", "eth0"]);
        ns.ip(&["-6", "route", "add", "default", "via", &gw6, "dev", "eth0"]);
        let pod_cgroup = node.cgroup.child(name);
        let server = (app != "client").then(|| {
            // On the pod's own addresses: IPv4 clients show as IPv4 (a dual-stack wildcard socket
            // would show them IPv4-mapped).
            let on = |ip: IpAddr, port: u16| SocketAddr::new(ip, port).to_string();
            let mut cmd = Command::new(&probe);
            cmd.args(["serve", "--name", name]);
            for ip in [IpAddr::from(ip), IpAddr::from(ip6)] {
                cmd.args(["--tcp", &on(ip, 8080), "--udp", &on(ip, 5353)]);
            }
            cmd.stdin(Stdio::null()).stdout(Stdio::piped());
            Place::new(&ns, &pod_cgroup).apply(&mut cmd);
            let mut p = Proc::spawn_command(cmd);
            p.wait_for_line(Duration::from_secs(10), |l| l.contains("ready"));
            p
        });
        pods.push(Pod {
            node: node.name.clone(),
            ip,
            ip6,
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
            ipv6: Some(NodeIpv6 {
                ip: ipv6_twin(node_ip(REAL_NODE_INDEX)),
                pod_cidr: pod_cidr6(REAL_NODE_INDEX),
            }),
        },
        &images,
    )?;
    for node in &nodes {
        real.netns()
            .ip(&["route", "add", &pod_cidr(node.index), "via", &node.ip.to_string()]);
        real.netns().ip(&[
            "-6",
            "route",
            "add",
            &pod_cidr6(node.index),
            "via",
            &node.ip6.to_string(),
        ]);
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
            // An InternalIP of each family, IPv4 first, as kubelet's `--node-ip` with two.
            let status = NodeStatus {
                addresses: Some(
                    [node.ip.to_string(), node.ip6.to_string()]
                        .into_iter()
                        .map(|address| NodeAddress {
                            type_: "InternalIP".into(),
                            address,
                        })
                        .collect(),
                ),
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
                &cluster_cidr(),
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
        external: Host {
            ns: ext_ns,
            ip: ext_ip,
            ip6: ipv6_twin(ext_ip),
            cgroup: Some(ext_cgroup),
        },
        outsider: Host {
            ns: out_ns,
            ip: out_ip,
            ip6: ipv6_twin(out_ip),
            cgroup: None,
        },
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
pub(crate) fn kubeconfig_path() -> PathBuf {
    Path::new(STATE_DIR).join("kubeconfig")
}

pub(crate) fn wait_for_agents(cluster: &mut Cluster) -> Result<()> {
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
