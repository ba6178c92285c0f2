//! Reliability scenarios, each under continuous load and each reporting its figures to
//! `target/reliability/<scenario>.json` (from which `cargo xtask test` writes docs/reliability.md):
//!
//! 1. agent restart (graceful stop, then kill -9): no failed connection, established connections
//!    survive on their backends, ids stable;
//!    Also (1b) kill -9 at random points while the agent programs a large change (a cold start,
//!    a restart onto a changed cluster, a change applied live, a restart migrating maps),
//!    seeded: no Service half-programmed in the maps a packet sees, no failed request to a
//!    Service served before, convergence after the last start (`LB_CRASH_SERVICES=10000
//!    LB_CRASH_KILLS=25 cargo test -p lb-tests --test reliability kill_9` is the long run);
//! 2. upgrade: a new object (the test variant of the programs) and new map capacities replace the
//!    running data path in place: links kept, programs swapped, maps migrated, no failure; and
//!    the upgrade of an install of the IPv4-only release (its pins emulated, see
//!    [`upgrade_from_the_ipv4_only_release_keeps_every_connection`]), also when the new agent's
//!    first sync fails (the new programs wait for a sync that programs the maps);
//! 3. 30 s of API unavailability with changes made meanwhile: the data path keeps serving, and
//!    the agent converges when the API comes back;
//! 4. endpoint churn: no new connection reaches an endpoint after its removal was applied; UDP
//!    flows move off removed backends; programming latency is reported;
//! 6. map pressure: a full map skips whole Services (Event, metric) and they appear once there is
//!    room again;
//! 10. a flood of spoofed TCP SYNs and UDP datagrams from outside to NodePorts (bounded, only to
//!     the test's namespaces): established connections (active and idle) and legitimate new ones
//!     before, during and after it, with the data path's counters and state, for lb-agent at its
//!     default sizes, lb-agent with a conntrack map the flood fills, and kube-proxy (iptables,
//!     nf_conntrack) on the same node with the same flood.
//!
//! Scenarios 1, 2 and 4 run on a dual-stack node (`topo::Node::dual_stack`) with dual-stack
//! Services, and carry IPv6 load beside the IPv4 load, through the same paths (socket path from
//! the node, tc path from the external client), judged by the same rules; each family's figures
//! are reported apart (the IPv4 ones at the top level, as before; the IPv6 ones under `ipv6`).
//!
//! Scenarios run one at a time (they measure; running them together would measure contention).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use k8s_openapi::{
    api::{
        core::v1::{Namespace, Node, NodeAddress, NodeStatus, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use lb_agent::{
    apply::{KernelMaps, MapOps},
    family::IpFamily,
};
use lb_common::catalog;
use lb_tests::{
    agent::{Agent, AgentOptions, bpf_root_in},
    bpffs::BpfFs,
    bpftool,
    cgroup::Cgroup,
    control_plane::ControlPlane,
    fixtures::{self, State, service, slice, write_manifests},
    load::{Load, tally},
    netns::{NetNs, PortForward},
    probe,
    process::{Place, Proc, workspace_bin},
    require_root,
    topo::{Lan, Node as TopoNode, external_client, ipv6_twin},
};
use serde_json::{Value, json};

const NODE: &str = "node-a";

/// The pods' addresses (`topo`: `10.244.<node>.<n>`, and `fd00:10:244:<node>::<n>` on a
/// dual-stack node), one CIDR per family of the node as kube-proxy's `--cluster-cidr` takes them.
const CLUSTER_CIDR: &str = "10.244.0.0/16";
const CLUSTER_CIDR_DUAL: &str = "10.244.0.0/16,fd00:10:244::/48";

/// The `web` Service's cluster IP of `family`; the IPv6 one lies in the control plane's
/// `SERVICE_CIDR6` (fd00:10:96::/112), so the API server accepts it too.
fn web_ip(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "10.96.50.10",
        IpFamily::V6 => "fd00:10:96::5010",
    }
}

/// `ip:port` (`[ip]:port` for IPv6).
fn at(ip: &str, port: u16) -> String {
    SocketAddr::new(ip.parse().expect("an IP address"), port).to_string()
}

/// The family of an address as `lb-agent services|backends -o json` writes it (`10.0.0.1:80`,
/// `[fd00::1]:80`, with `/TCP` after a frontend).
fn family_of_label(label: &str) -> IpFamily {
    if label.starts_with('[') {
        IpFamily::V6
    } else {
        IpFamily::V4
    }
}

/// One scenario at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64
}

/// Writes a scenario's figures for the report.
fn record(name: &str, figures: Value) {
    lb_tests::report::record(name, &figures);
}

/// A scenario's figures: the IPv4 ones at the top level (as before the scenarios carried IPv6
/// load), the IPv6 ones under `ipv6` (rendered apart by `cargo xtask report`).
fn per_family(scenario: &str, mut v4: Value, v6: Value) -> Value {
    v4["scenario"] = scenario.into();
    v4["ipv6"] = v6;
    v4
}

/// A backend set seen by a map watcher that polls: the change to `set` happened after `from_us`
/// (the start of the last snapshot that still saw the previous set) and before `seen_us` (the end
/// of the first snapshot that saw this one). Polling late only widens the interval.
struct Observed {
    from_us: u64,
    seen_us: u64,
    set: BTreeSet<String>,
}

/// The longest each observed set can have been in the maps: from its change's `from_us` to the
/// next change's `seen_us` (open-ended for the last).
fn lifetimes(observed: &[Observed]) -> impl Iterator<Item = (u64, u64, &BTreeSet<String>)> {
    observed.iter().enumerate().map(|(i, o)| {
        let until = observed.get(i + 1).map_or(u64::MAX, |next| next.seen_us);
        (o.from_us, until, &o.set)
    })
}

/// Ids by frontend and by backend (`lb-agent services|backends -o json`).
type Ids = (BTreeMap<String, u64>, BTreeMap<String, u64>);

/// The ids of `family`'s frontends and backends.
fn ids_of(ids: &Ids, family: IpFamily) -> Ids {
    let keep = |m: &BTreeMap<String, u64>| -> BTreeMap<String, u64> {
        m.iter()
            .filter(|(label, _)| family_of_label(label) == family)
            .map(|(label, id)| (label.clone(), *id))
            .collect()
    };
    (keep(&ids.0), keep(&ids.1))
}

/// A node with pods on a LAN with an external client; servers on every pod. On a dual-stack node
/// every pod has a second server on its IPv6 address, named by it (an answer then tells the
/// family it was reached over), and the external client an IPv6 address too.
struct Site {
    _servers: Vec<Proc>,
    client: (NetNs, Ipv4Addr),
    node: TopoNode,
    lan: Lan,
    cgroup: Cgroup,
    bpffs: BpfFs,
}

impl Site {
    /// An IPv4 node.
    fn new(pods: u8) -> Site {
        Site::with_node(TopoNode::new(1), pods)
    }

    /// A dual-stack node.
    fn dual_stack(pods: u8) -> Site {
        Site::with_node(TopoNode::dual_stack(1), pods)
    }

    fn with_node(mut node: TopoNode, pods: u8) -> Site {
        require_root();
        let bpffs = BpfFs::new();
        let cgroup = Cgroup::new("lbrel");
        let lan = Lan::new();
        node.attach_lan(&lan);
        for n in 0..pods {
            node.add_pod(n + 2);
        }
        let client = external_client(&lan, 1);
        if node.dual_stack {
            // The client's IPv6 twin beside its IPv4 address (usable at once: no DAD).
            let ip6 = format!("{}/64", ipv6_twin(client.1));
            client.0.ip(&["-6", "addr", "add", &ip6, "dev", "eth0", "nodad"]);
        }
        let mut servers = Vec::new();
        for p in &node.pods {
            servers.push(probe::server(
                Place::netns(&p.ns),
                &p.ip.to_string(),
                &["0.0.0.0:8080"],
                &["0.0.0.0:5353"],
            ));
            if let Some(ip6) = p.ip6 {
                let ip6 = ip6.to_string();
                servers.push(probe::server(
                    Place::netns(&p.ns),
                    &ip6,
                    &[&at(&ip6, 8080)],
                    &[&at(&ip6, 5353)],
                ));
            }
        }
        Site {
            _servers: servers,
            client,
            node,
            lan,
            cgroup,
            bpffs,
        }
    }

    fn pod_ip(&self, i: usize) -> String {
        self.node.pods[i].ip.to_string()
    }

    /// Pod `i`'s address of `family` (the name its server of that family answers with).
    fn pod_addr(&self, i: usize, family: IpFamily) -> String {
        self.node.pods[i].addr(family).to_string()
    }

    /// `port` on the node's LAN address of `family` (a NodePort, from the external client).
    fn node_port(&self, family: IpFamily, port: u16) -> String {
        let ip = self.node.addr(family).expect("the node's address of the family");
        SocketAddr::new(ip, port).to_string()
    }

    fn host(&self) -> Place<'_> {
        Place::new(&self.node.ns, &self.cgroup)
    }

    /// A process of pod `i` (its namespace, in the test cgroup as a pod's processes are).
    fn pod(&self, i: usize) -> Place<'_> {
        Place::new(&self.node.pods[i].ns, &self.cgroup)
    }

    fn external(&self) -> Place<'_> {
        Place::netns(&self.client.0)
    }

    fn bpf_root(&self) -> PathBuf {
        bpf_root_in(self.bpffs.path())
    }

    /// `lb-agent cleanup`: the node as before any agent (links, programs and pins gone).
    fn cleanup(&self) {
        let out = Command::new(workspace_bin("lb-agent"))
            .args(["cleanup", "--bpf-root"])
            .arg(self.bpf_root())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cleanup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The agent with the node's pod CIDRs (one per family of the node).
    fn agent(&self, manifests: Option<PathBuf>, kubeconfig: Option<PathBuf>, extra: &[&str]) -> Agent {
        let cidr = if self.node.dual_stack {
            CLUSTER_CIDR_DUAL
        } else {
            CLUSTER_CIDR
        };
        self.agent_with(cidr, manifests, kubeconfig, extra)
    }

    fn agent_with(
        &self,
        cluster_cidr: &str,
        manifests: Option<PathBuf>,
        kubeconfig: Option<PathBuf>,
        extra: &[&str],
    ) -> Agent {
        Agent::start(self.agent_options(cluster_cidr, manifests, kubeconfig, extra))
    }

    fn agent_options(
        &self,
        cluster_cidr: &str,
        manifests: Option<PathBuf>,
        kubeconfig: Option<PathBuf>,
        extra: &[&str],
    ) -> AgentOptions<'_> {
        let mut extra_args = vec!["--cluster-cidr".to_string(), cluster_cidr.into()];
        extra_args.extend(extra.iter().map(|s| s.to_string()));
        AgentOptions {
            netns: &self.node.ns,
            cgroup: &self.cgroup,
            bpf_root: self.bpf_root(),
            node_name: NODE.into(),
            manifests,
            kubeconfig,
            extra_args,
        }
    }

    /// `lb-agent services -o json` and `backends -o json`: ids by frontend and by backend.
    fn ids(&self) -> Ids {
        let run = |cmd: &str| -> Value {
            lb_tests::agent::inspect(&self.bpf_root(), cmd).unwrap_or_else(|e| panic!("{e}"))
        };
        let frontends = run("services")
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                (
                    f["frontend"].as_str().unwrap().to_string(),
                    f["rev_nat_id"].as_u64().unwrap(),
                )
            })
            .collect();
        let backends = run("backends")
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                (
                    b["address"].as_str().unwrap().to_string(),
                    b["id"].as_u64().unwrap(),
                )
            })
            .collect();
        (frontends, backends)
    }

    /// The link ids and the program ids behind the agent's pinned links.
    fn links(&self) -> BTreeMap<u64, u64> {
        self.pinned_links().into_values().collect()
    }

    /// The agent's pinned links by pin path (relative to `links/`: `cgroup-<id>/<hook>`,
    /// `tc/<ifindex>-<device>/<hook>`): (link id, program id).
    fn pinned_links(&self) -> BTreeMap<String, (u64, u64)> {
        let out = Command::new("bpftool")
            .args(["-j", "link", "show"])
            .output()
            .unwrap();
        let links: Value = serde_json::from_slice(&out.stdout).unwrap_or(json!([]));
        let prog_of: BTreeMap<u64, u64> = links
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| Some((l["id"].as_u64()?, l["prog_id"].as_u64().unwrap_or(0))))
            .collect();
        let root = self.bpf_root().join("links");
        let mut pins = Vec::new();
        let mut dirs = vec![root.clone()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(entry.path());
                } else {
                    pins.push(entry.path());
                }
            }
        }
        pins.into_iter()
            .filter_map(|pin| {
                let out = Command::new("bpftool")
                    .args(["-j", "link", "show", "pinned"])
                    .arg(&pin)
                    .output()
                    .ok()?;
                let id = serde_json::from_slice::<Value>(&out.stdout).ok()?["id"].as_u64()?;
                let name = pin.strip_prefix(&root).ok()?.display().to_string();
                Some((name, (id, prog_of.get(&id).copied()?)))
            })
            .collect()
    }
}

/// The `web` Service (TCP 80 and UDP 53, each with a NodePort) with `pods` as its endpoints: of
/// each family of the node, a dual-stack Service with a slice per family on a dual-stack one.
fn web_manifests(site: &Site, dir: &Path, pods: &[usize]) {
    let families: &[IpFamily] = if site.node.dual_stack {
        &IpFamily::ALL
    } else {
        &[IpFamily::V4]
    };
    let web = web_service(families).build();
    let slices: Vec<EndpointSlice> = families
        .iter()
        .map(|family| web_slice(site, "web", *family, pods).build())
        .collect();
    write_manifests(dir, "objects.yaml", &[web], &slices);
}

/// The `web` Service of `families` (its cluster IPs in that order).
fn web_service(families: &[IpFamily]) -> fixtures::Svc {
    let ips: Vec<&str> = families.iter().map(|f| web_ip(*f)).collect();
    service("rel", "web")
        .cluster_ips(&ips)
        .port("http", "TCP", 80, 8080)
        .node_port(30090)
        .port("dns", "UDP", 53, 5353)
        .node_port(30053)
}

/// The EndpointSlice of `family` of Service `name` (ports http 8080 and dns 5353), with `pods`
/// ready; the EndpointSlice controller writes one per family, named apart.
fn web_slice(site: &Site, name: &str, family: IpFamily, pods: &[usize]) -> fixtures::Slice {
    let slice_name = match family {
        IpFamily::V4 => format!("{name}-1"),
        IpFamily::V6 => format!("{name}-1-ipv6"),
    };
    let mut s = slice("rel", name, &slice_name);
    for i in pods {
        s = s.endpoint(&site.pod_addr(*i, family), NODE, State::Ready);
    }
    s.port("http", "TCP", 8080).port("dns", "UDP", 5353)
}

/// Long-lived connections, each recording every exchange's server.
struct Holds(Vec<Proc>);

impl Holds {
    fn open(place: Place<'_>, to: &str, n: usize, seconds: u64) -> Holds {
        Holds::open_every(place, to, n, seconds, 50, 2000)
    }

    /// `n` connections exchanging a message every `interval_ms`; one broken when an exchange
    /// waits more than `read_timeout_ms` for its reply (or the connection is reset or closed).
    fn open_every(
        place: Place<'_>,
        to: &str,
        n: usize,
        seconds: u64,
        interval_ms: u64,
        read_timeout_ms: u64,
    ) -> Holds {
        Holds(
            (0..n)
                .map(|_| {
                    let mut h = probe::hold_every(place, to, seconds, interval_ms, read_timeout_ms);
                    h.wait_for_line(Duration::from_secs(5), |l| l.contains("\"seq\""));
                    h
                })
                .collect(),
        )
    }

    /// Waits for each connection's end and adds it to `v`.
    fn record(mut self, v: &mut HeldVerdict) {
        for h in &mut self.0 {
            h.wait_for_line(Duration::from_secs(120), |l| {
                l.contains("\"done\"") || l.contains("\"ok\":false")
            });
            let lines = h.stdout_lines();
            v.connections += 1;
            if let Some(failure) = lines.iter().find(|l| l.contains("\"ok\":false")) {
                v.broken += 1;
                v.failures
                    .push(serde_json::from_str(failure).unwrap_or_else(|_| Value::from(failure.as_str())));
            }
            let exchanges: Vec<Value> = lines
                .iter()
                .filter(|l| l.contains("\"seq\""))
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect();
            v.exchanges += lines.iter().filter(|l| l.contains("\"seq\"")).count();
            v.longest_us = exchanges
                .iter()
                .filter_map(|e| e["rtt_us"].as_u64())
                .fold(v.longest_us, u64::max);
            let servers: BTreeSet<&str> = exchanges
                .iter()
                .filter_map(|e| e.pointer("/reply/server").and_then(Value::as_str))
                .collect();
            if servers.len() > 1 {
                v.moved += 1;
            }
        }
    }
}

/// Established connections of one family, by path.
struct Established {
    holds: Vec<Holds>,
}

/// The verdict on a family's established connections.
#[derive(Default)]
struct HeldVerdict {
    exchanges: usize,
    broken: usize,
    moved: usize,
    connections: usize,
    /// The probe's line for each broken connection (error, errno, seq, at_us).
    failures: Vec<Value>,
    /// The longest exchange (request to reply) on any of them, µs.
    longest_us: u64,
}

impl Established {
    /// `n` connections to each of `to` (place, destination), held `seconds`.
    fn open(to: &[(Place<'_>, String)], n: usize, seconds: u64) -> Established {
        Established {
            holds: to
                .iter()
                .map(|(place, dest)| Holds::open(*place, dest, n, seconds))
                .collect(),
        }
    }

    fn verdict(self) -> HeldVerdict {
        let mut v = HeldVerdict::default();
        for h in self.holds {
            h.record(&mut v);
        }
        v
    }
}

impl HeldVerdict {
    fn json(&self) -> Value {
        let mut v = json!({"connections": self.connections, "exchanges": self.exchanges, "broken": self.broken, "moved_backend": self.moved, "longest_exchange_ms": self.longest_us / 1000});
        if !self.failures.is_empty() {
            v["failures"] = self.failures.clone().into();
        }
        v
    }
}

/// Named loads of one family.
type Loads = Vec<(&'static str, Load)>;

/// What a family's loads did.
struct Tally {
    rows: Vec<Value>,
    attempted: u64,
    failed: u64,
    failures: Vec<String>,
    /// Every result, by load.
    results: Vec<(&'static str, Vec<Value>)>,
}

/// Stops `loads` and tallies them.
fn stop_loads(loads: Loads) -> Tally {
    let mut t = Tally {
        rows: Vec::new(),
        attempted: 0,
        failed: 0,
        failures: Vec::new(),
        results: Vec::new(),
    };
    for (what, load) in loads {
        let results = load.stop();
        let (a, f) = tally(&results);
        t.failures.extend(lb_tests::load::failures(what, &results));
        t.attempted += a;
        t.failed += f;
        t.rows.push(lb_tests::load::row(what, &results));
        t.results.push((what, results));
    }
    t
}

impl Tally {
    /// The servers that answered the load `what`.
    fn servers(&self, what: &str) -> BTreeSet<String> {
        self.results
            .iter()
            .filter(|(w, _)| *w == what)
            .flat_map(|(_, results)| results.iter())
            .filter_map(|r| probe::server_of(r).map(str::to_string))
            .collect()
    }
}

/// The restart scenario's loads of `family`: TCP and UDP through the socket path (the node's own
/// sockets to the cluster IP) and through tc (the external client to the NodePorts).
fn web_loads(site: &Site, family: IpFamily, udp: bool) -> Loads {
    let cluster = |port| at(web_ip(family), port);
    let mut loads = vec![(
        "socket path, TCP to the cluster IP",
        Load::start(site.host(), &cluster(80), "tcp", 10, false),
    )];
    if udp {
        loads.push((
            "socket path, UDP to the cluster IP",
            Load::start(site.host(), &cluster(53), "udp", 10, false),
        ));
    }
    loads.push((
        "tc path, TCP to the NodePort",
        Load::start(site.external(), &site.node_port(family, 30090), "tcp", 10, false),
    ));
    if udp {
        loads.push((
            "tc path, UDP flow to the NodePort",
            Load::start(site.external(), &site.node_port(family, 30053), "udp", 10, true),
        ));
    }
    loads
}

#[test]
fn restart_under_load_loses_nothing() {
    let _one = serial();
    let site = Site::dual_stack(3);
    let manifests = tempfile::tempdir().unwrap();
    web_manifests(&site, manifests.path(), &[0, 1, 2]);
    let agent = site.agent(Some(manifests.path().into()), None, &[]);
    let loads = IpFamily::ALL.map(|family| web_loads(&site, family, true));
    let held = IpFamily::ALL.map(|family| {
        Established::open(
            &[
                (site.host(), at(web_ip(family), 80)),
                (site.external(), site.node_port(family, 30090)),
            ],
            3,
            14,
        )
    });
    std::thread::sleep(Duration::from_secs(1));
    let ids_before = site.ids();

    // Graceful stop and start.
    let stopped = agent.stop();
    assert!(stopped.success());
    std::thread::sleep(Duration::from_secs(2));
    let agent = site.agent(Some(manifests.path().into()), None, &[]);
    std::thread::sleep(Duration::from_secs(2));
    let ids_after_restart = site.ids();
    // kill -9 and start.
    unsafe { libc::kill(agent.pid() as i32, libc::SIGKILL) };
    drop(agent);
    std::thread::sleep(Duration::from_secs(2));
    let agent = site.agent(Some(manifests.path().into()), None, &[]);
    std::thread::sleep(Duration::from_secs(2));
    let ids_after_kill = site.ids();

    let [tally4, tally6] = loads.map(stop_loads);
    let [held4, held6] = held.map(Established::verdict);
    drop(agent);
    let figures = |family: IpFamily, t: &Tally, h: &HeldVerdict| {
        let ids = ids_of(&ids_before, family);
        json!({
            "load": t.rows,
            "established": h.json(),
            "attempted": t.attempted,
            "failed": t.failed,
            "ids_stable": ids == ids_of(&ids_after_restart, family) && ids == ids_of(&ids_after_kill, family),
        })
    };
    record(
        "1-restart",
        per_family(
            "Agent restart under load: SIGTERM + start, then kill -9 + start",
            figures(IpFamily::V4, &tally4, &held4),
            figures(IpFamily::V6, &tally6, &held6),
        ),
    );
    for (family, t, h) in [(IpFamily::V4, &tally4, &held4), (IpFamily::V6, &tally6, &held6)] {
        assert_eq!(
            t.failed, 0,
            "{family}: no connection may fail across restarts: {:#?}",
            t.failures
        );
        assert_eq!(
            (h.broken, h.moved),
            (0, 0),
            "{family}: established connections survive on their backends"
        );
        let ids = ids_of(&ids_before, family);
        assert!(
            !ids.0.is_empty() && !ids.1.is_empty(),
            "{family}: frontends and backends programmed: {ids_before:?}"
        );
        assert_eq!(
            ids,
            ids_of(&ids_after_restart, family),
            "{family}: ids stable across a graceful restart"
        );
        assert_eq!(
            ids,
            ids_of(&ids_after_kill, family),
            "{family}: ids stable across kill -9"
        );
    }
}

/// The test variant of the programs (`cargo xtask build-ebpf --variant`, which `./x test` runs).
fn variant_object() -> PathBuf {
    let variant = workspace_bin("lb-agent")
        .ancestors()
        .nth(2)
        .unwrap()
        .join("bpf/lb-ebpf-test-variant.o");
    assert!(
        variant.is_file(),
        "{} is missing: run through ./x test (cargo xtask build-ebpf --variant)",
        variant.display()
    );
    variant
}

/// `max_entries` of the map pinned at `pin`.
fn capacity_of(pin: &Path) -> u64 {
    map_info(pin)["max_entries"]
        .as_u64()
        .unwrap_or_else(|| panic!("{}: no max_entries", pin.display()))
}

/// `bpftool map show pinned <pin>`, as JSON.
fn map_info(pin: &Path) -> Value {
    bpftool::json(&["map", "show", "pinned", pin.to_str().unwrap()])
}

#[test]
fn upgrade_swaps_programs_and_migrates_maps_under_load() {
    let _one = serial();
    let variant = variant_object();
    let site = Site::dual_stack(3);
    let manifests = tempfile::tempdir().unwrap();
    web_manifests(&site, manifests.path(), &[0, 1, 2]);
    let agent = site.agent(Some(manifests.path().into()), None, &[]);
    let loads = IpFamily::ALL.map(|family| web_loads(&site, family, false));
    let held = IpFamily::ALL
        .map(|family| Established::open(&[(site.external(), site.node_port(family, 30090))], 3, 12));
    std::thread::sleep(Duration::from_secs(1));
    let links_before = site.links();
    let ids_before = site.ids();
    let services = |family: IpFamily| {
        site.bpf_root()
            .join("maps")
            .join(catalog::pin_name(family.maps().services).to_string())
    };
    let capacity_before = IpFamily::ALL.map(|family| capacity_of(&services(family)));

    // The new agent: another object (the test variant) and bigger services maps.
    assert!(agent.stop().success());
    let upgraded = site.agent(
        Some(manifests.path().into()),
        None,
        &[
            "--bpf-object",
            variant.to_str().unwrap(),
            "--bpf-lb-service-map-max",
            "300000",
        ],
    );
    std::thread::sleep(Duration::from_secs(3));
    let links_after = site.links();
    let ids_after = site.ids();
    let capacity_after = IpFamily::ALL.map(|family| capacity_of(&services(family)));
    let variant_hits = KernelMaps::from_pins(&site.bpf_root().join("maps"))
        .unwrap()
        .counter(lb_common::stats::Counter::TestVariant as u32);

    let [tally4, tally6] = loads.map(stop_loads);
    let [held4, held6] = held.map(Established::verdict);
    let log = upgraded.log();
    drop(upgraded);
    let same_links = links_before.keys().collect::<Vec<_>>() == links_after.keys().collect::<Vec<_>>();
    let all_swapped = links_before
        .iter()
        .all(|(link, prog)| links_after.get(link).is_some_and(|p| p != prog));
    let figures = |family: IpFamily, t: &Tally, h: &HeldVerdict| {
        let i = family as usize;
        json!({
            "load": t.rows,
            "established": h.json(),
            "attempted": t.attempted,
            "failed": t.failed,
            "services_map_capacity": {"before": capacity_before[i], "after": capacity_after[i]},
            "ids_stable": ids_of(&ids_before, family) == ids_of(&ids_after, family),
        })
    };
    let mut v4 = figures(IpFamily::V4, &tally4, &held4);
    v4["links"] = links_before.len().into();
    v4["links_kept"] = same_links.into();
    v4["programs_replaced"] = all_swapped.into();
    v4["new_program_ran"] = (variant_hits > 0).into();
    record(
        "2-upgrade",
        per_family(
            "Upgrade under load: new eBPF programs (test variant) swapped into the pinned links; services maps migrated to a new capacity",
            v4,
            figures(IpFamily::V6, &tally6, &held6),
        ),
    );
    assert!(
        log.contains("migrating the map"),
        "the capacity change is a migration:\n{log}"
    );
    assert_eq!(capacity_after, [300_000; 2], "lb4_services and lb6_services");
    assert!(
        same_links && all_swapped,
        "links kept, programs replaced: {links_before:?} -> {links_after:?}"
    );
    assert!(variant_hits > 0, "the new programs run");
    for (family, t, h) in [(IpFamily::V4, &tally4, &held4), (IpFamily::V6, &tally6, &held6)] {
        assert_eq!(
            t.failed, 0,
            "{family}: no connection may fail during the upgrade: {:#?}",
            t.failures
        );
        assert_eq!((h.broken, h.moved), (0, 0), "{family}: established connections");
        assert_eq!(
            ids_of(&ids_before, family),
            ids_of(&ids_after, family),
            "{family}: ids stable"
        );
    }
}

/// Pins under the root's `maps/` that no map of this release has (a migration's `-old`, say).
fn stray_pins(site: &Site) -> Vec<String> {
    pins_in(&site.bpf_root().join("maps"))
        .into_iter()
        .filter(|f| {
            !catalog::ALL
                .iter()
                .any(|n| catalog::pin_name(n).to_string() == *f)
        })
        .collect()
}

/// A start killed with SIGKILL while it migrates a map to a new capacity leaves the old pin moved
/// aside (`<pin>-old`), and perhaps the new map it had pinned: the next start puts the old one
/// back (the attached programs still serve from it), migrates again, and leaves no stray pin.
/// Both points a kill can leave are set up exactly as such a start leaves them; load runs
/// through the socket path and tc throughout, and no request may fail.
#[test]
fn a_start_killed_while_migrating_a_map_is_recovered_by_the_next() {
    let _one = serial();
    let site = Site::new(3);
    let manifests = tempfile::tempdir().unwrap();
    web_manifests(&site, manifests.path(), &[0, 1, 2]);
    let agent = site.agent(Some(manifests.path().into()), None, &[]);
    let loads = web_loads(&site, IpFamily::V4, true);
    let held = Established::open(&[(site.external(), site.node_port(IpFamily::V4, 30090))], 3, 12);
    std::thread::sleep(Duration::from_secs(1));
    let ids_before = site.ids();
    assert!(agent.stop().success());
    // The pin of the map's current layout (`lb4_services_v2`), and where a migration moves it.
    let pin = catalog::pin_name(catalog::SERVICES).to_string();
    let services = site.bpf_root().join("maps").join(&pin);
    let aside = site.bpf_root().join("maps").join(format!("{pin}-old"));
    let info = map_info(&services);
    let default_capacity = capacity_of(&services);

    // 1. Killed after moving the pin aside, before pinning the new map.
    std::fs::rename(&services, &aside).unwrap();
    let bigger = (default_capacity + 7).to_string();
    let agent = site.agent(
        Some(manifests.path().into()),
        None,
        &["--bpf-lb-service-map-max", &bigger],
    );
    let aside_only = (capacity_of(&services), stray_pins(&site), site.ids(), agent.log());
    assert!(agent.stop().success());

    // 2. Killed after pinning its new (still empty) map too.
    std::fs::rename(&services, &aside).unwrap();
    let key = info["bytes_key"].as_u64().unwrap().to_string();
    let value = info["bytes_value"].as_u64().unwrap().to_string();
    let flags = info["flags"].as_u64().unwrap().to_string();
    bpftool::run(&[
        "map",
        "create",
        services.to_str().unwrap(),
        "type",
        "hash",
        "key",
        &key,
        "value",
        &value,
        "entries",
        "4099",
        "name",
        catalog::SERVICES,
        "flags",
        &flags,
    ]);
    let agent = site.agent(Some(manifests.path().into()), None, &[]);
    let both = (capacity_of(&services), stray_pins(&site), site.ids(), agent.log());

    let tally = stop_loads(loads);
    let verdict = held.verdict();
    drop(agent);
    record(
        "1c-killed-migration",
        json!({
            "scenario": "the next start after a start killed while migrating lb4_services: with only the old map moved aside, and with the new map pinned too",
            "load": tally.rows,
            "established": verdict.json(),
            "attempted": tally.attempted,
            "failed": tally.failed,
            "stray_pins_after": {"aside_only": aside_only.1, "aside_and_new_map": both.1},
            "ids_stable": aside_only.2 == ids_before && both.2 == ids_before,
        }),
    );
    for (case, (capacity, stray, ids, log), want) in [
        ("moved aside only", &aside_only, default_capacity + 7),
        ("moved aside and a new map pinned", &both, default_capacity),
    ] {
        assert!(
            log.contains("the map it moved aside is back under its pin"),
            "{case}: the old map is put back:\n{log}"
        );
        assert!(
            log.contains("migrating the map"),
            "{case}: then migrated to the capacity asked for:\n{log}"
        );
        assert_eq!(*capacity, want, "{case}: lb4_services' capacity");
        assert!(stray.is_empty(), "{case}: pins left behind: {stray:?}");
        assert_eq!(*ids, ids_before, "{case}: every frontend and backend kept its id");
    }
    assert!(
        both.3.contains("replaced_a_new_map=true"),
        "the killed start's new map is dropped:\n{}",
        both.3
    );
    assert_eq!(tally.failed, 0, "no request may fail: {:#?}", tally.failures);
    assert_eq!((verdict.broken, verdict.moved), (0, 0), "established connections");
}

/// The pins of the IPv4-only release (the release before IPv6, whose `lb-common/src/catalog.rs`
/// listed exactly these maps): no `lb6_*` maps, `lb_config` at layout version 1 (so without a
/// version suffix), the affinity members in `lb4_aff_match`.
const IPV4_ONLY_RELEASE_PINS: &[&str] = &[
    "lb4_services",
    "lb4_backends",
    "lb4_revnat",
    "lb_svc_names",
    "lb4_sock_revnat",
    "lb4_sock_rev_sk",
    "lb4_affinity",
    "lb4_aff_match",
    "lb4_src_range",
    "lb4_ct",
    "lb_config",
    "lb_stats",
    "lb_reject_rl",
];
/// The IPv4-only release's `lb_config` value (`DatapathConfig` of layout 1: netns cookie, flags,
/// the cluster CIDR count, four IPv4 cluster CIDRs, the masquerade address and port range).
const IPV4_ONLY_CONFIG_SIZE: usize = 56;
/// The IPv4-only release sized `lb_svc_names` as the frontends (`--bpf-lb-map-max`'s revnat
/// capacity); this release holds the ids of both families, twice as many.
const IPV4_ONLY_SVC_NAMES_CAPACITY: u32 = catalog::capacity::REVNAT;
/// The socket hooks the IPv4-only release did not attach: the IPv6 ones, and `sock_release`
/// (`lb_sock_release`, which frees the connected sockets' slots).
const NEWER_SOCKET_HOOKS: [&str; 5] = ["connect6", "sendmsg6", "recvmsg6", "getpeername6", "sock_release"];

/// The `sticky` Service's cluster IP of `family` (ClientIP affinity).
fn sticky_ip(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "10.96.50.20",
        IpFamily::V6 => "fd00:10:96::5020",
    }
}

/// The load to the `sticky` Service (socket path): every connection must reach one backend.
const STICKY_LOAD: &str = "socket path, TCP to a ClientIP-affinity cluster IP";

/// `web` (as [`web_manifests`]) and `sticky` (ClientIP affinity, TCP 80) of `families`, each
/// with the three pods as endpoints.
fn upgrade_manifests(site: &Site, dir: &Path, families: &[IpFamily]) {
    let sticky_ips: Vec<&str> = families.iter().map(|f| sticky_ip(*f)).collect();
    let services = [
        web_service(families).build(),
        service("rel", "sticky")
            .cluster_ips(&sticky_ips)
            .port("http", "TCP", 80, 8080)
            .client_ip_affinity(600)
            .build(),
    ];
    let slices: Vec<EndpointSlice> = families
        .iter()
        .flat_map(|family| ["web", "sticky"].map(|name| web_slice(site, name, *family, &[0, 1, 2]).build()))
        .collect();
    write_manifests(dir, "objects.yaml", &services, &slices);
}

/// The IPv4-only release's `lb_config` entry for the same settings as `c` (its layout 1).
fn config_layout_1(c: &lb_common::config::DatapathConfig) -> [u8; IPV4_ONLY_CONFIG_SIZE] {
    let mut b = [0u8; IPV4_ONLY_CONFIG_SIZE];
    b[0..8].copy_from_slice(&c.host_netns_cookie.to_ne_bytes());
    // The IPv4-only release knew no prefilter.
    let flags = c.flags & !lb_common::config::flags::PREFILTER;
    b[8..12].copy_from_slice(&flags.to_ne_bytes());
    b[12..16].copy_from_slice(&u32::from(c.v4.cluster_cidr_count).to_ne_bytes());
    for (i, cidr) in c.v4.cluster_cidrs.iter().enumerate() {
        let at = 16 + 8 * i;
        b[at..at + 4].copy_from_slice(&cidr.addr);
        b[at + 4] = cidr.prefix_len;
    }
    b[48..52].copy_from_slice(&c.v4.snat_addr);
    b[52..54].copy_from_slice(&c.snat_port_min.to_ne_bytes());
    b[54..56].copy_from_slice(&c.snat_port_max.to_ne_bytes());
    b
}

/// The names of the pins in `dir`.
fn pins_in(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Turns the pins a stopped agent of this release left under `root` into the ones an agent of
/// the IPv4-only release leaves (see [`upgrade_from_the_ipv4_only_release_keeps_every_connection`]
/// for what this is, and is not): returns what it changed.
fn pin_the_ipv4_only_release(root: &Path) -> Vec<String> {
    let maps = root.join("maps");
    let mut changed = Vec::new();
    // lb_config at layout 1: a 56-byte array entry pinned as `lb_config`, holding the same
    // settings in that layout; this release's `lb_config_v2` did not exist.
    let config = KernelMaps::from_pins(&maps)
        .unwrap()
        .datapath_config()
        .expect("the agent wrote lb_config_v2");
    let v2 = maps.join("lb_config_v2");
    let flags = map_info(&v2)["flags"].as_u64().unwrap_or(0).to_string();
    std::fs::remove_file(&v2).unwrap();
    let v1 = maps.join(catalog::CONFIG);
    let value_size = IPV4_ONLY_CONFIG_SIZE.to_string();
    bpftool::run(&[
        "map",
        "create",
        v1.to_str().unwrap(),
        "type",
        "array",
        "key",
        "4",
        "value",
        &value_size,
        "entries",
        "1",
        "name",
        catalog::CONFIG,
        "flags",
        &flags,
    ]);
    let mut entry: aya::maps::Array<_, [u8; IPV4_ONLY_CONFIG_SIZE]> =
        aya::maps::Map::Array(aya::maps::MapData::from_pin(&v1).unwrap())
            .try_into()
            .unwrap();
    entry.set(0, &config_layout_1(&config), 0).unwrap();
    changed.push(format!(
        "lb_config_v2 -> lb_config of layout 1 ({IPV4_ONLY_CONFIG_SIZE}-byte value, the same settings)"
    ));
    // lb4_services at layout 1: the same entries without the slots' copies of their backends
    // (16-byte values), pinned as `lb4_services`; this release's `lb4_services_v2` did not exist.
    let services_v2 = maps.join(catalog::pin_name(catalog::SERVICES).to_string());
    let info = map_info(&services_v2);
    let services_v1 = maps.join(catalog::SERVICES);
    bpftool::run(&[
        "map",
        "create",
        services_v1.to_str().unwrap(),
        "type",
        "hash",
        "key",
        &info["bytes_key"].as_u64().unwrap().to_string(),
        "value",
        &std::mem::size_of::<lb_common::service::SvcValue>().to_string(),
        "entries",
        &info["max_entries"].as_u64().unwrap().to_string(),
        "name",
        catalog::SERVICES,
        "flags",
        &info["flags"].as_u64().unwrap_or(0).to_string(),
    ]);
    {
        use lb_common::service::{Svc4Entry, Svc4Key, SvcValue};
        let from: aya::maps::HashMap<_, Svc4Key, Svc4Entry> =
            aya::maps::Map::HashMap(aya::maps::MapData::from_pin(&services_v2).unwrap())
                .try_into()
                .unwrap();
        let mut to: aya::maps::HashMap<_, Svc4Key, SvcValue> =
            aya::maps::Map::HashMap(aya::maps::MapData::from_pin(&services_v1).unwrap())
                .try_into()
                .unwrap();
        for entry in from.iter() {
            let (key, value) = entry.unwrap();
            to.insert(&key, &value.value, 0).unwrap();
        }
    }
    std::fs::remove_file(&services_v2).unwrap();
    changed.push("lb4_services_v2 -> lb4_services of layout 1 (16-byte values, the same entries)".into());
    // The affinity members were in lb4_aff_match (same layout).
    std::fs::rename(maps.join(catalog::AFFINITY_MATCH), maps.join("lb4_aff_match")).unwrap();
    changed.push("lb_aff_match -> lb4_aff_match".into());
    // lb_svc_names at the IPv4-only release's capacity, with the same entries.
    let names = maps.join(catalog::SVC_NAMES);
    let info = map_info(&names);
    let old = maps.join("lb_svc_names_ipv4_only");
    bpftool::run(&[
        "map",
        "create",
        old.to_str().unwrap(),
        "type",
        "hash",
        "key",
        "4",
        "value",
        &info["bytes_value"].as_u64().unwrap().to_string(),
        "entries",
        &IPV4_ONLY_SVC_NAMES_CAPACITY.to_string(),
        "name",
        catalog::SVC_NAMES,
        "flags",
        &info["flags"].as_u64().unwrap_or(0).to_string(),
    ]);
    {
        type Names = aya::maps::HashMap<aya::maps::MapData, u32, lb_common::revnat::SvcName>;
        let from: Names = aya::maps::Map::HashMap(aya::maps::MapData::from_pin(&names).unwrap())
            .try_into()
            .unwrap();
        let mut to: Names = aya::maps::Map::HashMap(aya::maps::MapData::from_pin(&old).unwrap())
            .try_into()
            .unwrap();
        for entry in from.iter() {
            let (id, name) = entry.unwrap();
            to.insert(&id, &name, 0).unwrap();
        }
    }
    std::fs::remove_file(&names).unwrap();
    std::fs::rename(&old, &names).unwrap();
    changed.push(format!(
        "lb_svc_names at {IPV4_ONLY_SVC_NAMES_CAPACITY} entries (was {}), entries copied",
        info["max_entries"]
    ));
    // The IPv6 maps, the tc prefilter, the egress flow filter, the new-flow conntrack table, the
    // pod interfaces, the fragments' ports, the cluster-ips-check, the interfaces' masquerade
    // addresses, the monitor's maps, the Maglev tables, the tail calls and the connected
    // sockets' slots are newer than the IPv4-only release (which kept connected sockets' records
    // in socket storage, `lb4_sock_rev_sk`, still read after the slots).
    for family_map in pins_in(&maps).into_iter().filter(|p| {
        p.starts_with("lb6_")
            || [
                lb_common::catalog::PREFILTER,
                lb_common::catalog::CT_FILTER,
                lb_common::catalog::CONNTRACK_NEW,
                lb_common::catalog::POD_INTERFACES,
                lb_common::catalog::FRAGMENTS,
                lb_common::catalog::CLUSTER_IPS,
                lb_common::catalog::SERVICE_RANGES,
                lb_common::catalog::MASQ_ADDRS,
                lb_common::catalog::MONITOR,
                lb_common::catalog::EVENTS,
                lb_common::catalog::MAGLEV,
                lb_common::catalog::TC_TAIL,
                lb_common::catalog::SOCK_CONN,
            ]
            .contains(&p.as_str())
    }) {
        std::fs::remove_file(maps.join(&family_map)).unwrap();
        changed.push(format!("{family_map} removed"));
    }
    // The IPv4-only release attached no IPv6 socket hooks and no `sock_release` program (removing
    // a link's last pin detaches it).
    for dir in std::fs::read_dir(root.join("links")).unwrap().flatten() {
        for hook in NEWER_SOCKET_HOOKS {
            let pin = dir.path().join(hook);
            if pin.exists() {
                std::fs::remove_file(&pin).unwrap();
                changed.push(format!(
                    "link {} removed",
                    pin.strip_prefix(root).unwrap().display()
                ));
            }
        }
    }
    changed
}

/// Upgrading a running install of the IPv4-only release (the last release before IPv6) to this
/// one, under IPv4 load with established connections: no connection fails, established ones stay
/// on their backends, the IPv4 ids stay, the old pins are migrated or retired, and the IPv6 side
/// of the dual-stack Services starts being served.
///
/// What is emulated: the IPv4-only release's *pins*, not its *programs*. An agent of this release
/// first programs the Services' IPv4 side only (what the IPv4-only release programmed: its model
/// dropped IPv6 cluster IPs and slices) with only an IPv4 `--cluster-cidr` (the old release took
/// no other), is stopped, and its pins are turned into the old release's pin set
/// ([`pin_the_ipv4_only_release`], checked against [`IPV4_ONLY_RELEASE_PINS`]): `lb_config_v2`
/// becomes an `lb_config` of the old 56-byte layout holding the same settings, `lb_aff_match`
/// becomes `lb4_aff_match`, `lb_svc_names` is recreated at the old capacity with its entries, the
/// `lb6_*` pins, `lb4_sock_conn` and the links of the four IPv6 socket hooks and of `sock_release`
/// are removed, `lb4_services_v2` becomes
/// an `lb4_services` of layout 1 (no copy of a slot's backend) holding the same entries, whose
/// conversion back keeps every id. The other `lb4_*` maps are the old release's as they are (same
/// layouts: the IPv4-only release's layout tests give the same key and value sizes), so they keep
/// the established flows' state. The programs that keep serving
/// during the upgrade are this release's, held by the pinned links; a program reads the maps it
/// was loaded with (by reference, not by pin name), so what happens to the pins does not change
/// what they read, exactly as the old release's programs keep reading the old `lb_config` and
/// `lb4_aff_match` until they are replaced. IPv6 is left alone before the upgrade, as by the old
/// release: no IPv6 socket hook is attached, and the tc programs find nothing in their (empty,
/// unpinned) IPv6 maps.
///
/// Why: everything the new agent decides at an upgrade is derived from what is pinned (its
/// migration reads pin names, key and value sizes and capacities; ids and entries are adopted from
/// the maps; links are adopted by pin path and their programs replaced atomically), so the pins are
/// what must be faithful. Running the old release's own programs would mean building another
/// commit's eBPF object (a nightly build-std) and agent in a worktree of that commit, minutes
/// of building, well beyond the suite's time budget. Not covered therefore: differences between the two releases' programs in how they
/// write the shared `lb4_*` flow state (conntrack, socket reverse NAT, affinity) that the new
/// programs then read.
///
/// The IPv4 tc load from the external client is masqueraded (externalTrafficPolicy Cluster), so
/// it also tells whether the new programs ever ran with an unconfigured `lb_config_v2` (they
/// would drop masqueraded flows for want of a masquerade address), and the affinity load whether
/// they ever ran before the affinity members were rewritten into the new `lb_aff_match` (a client
/// would be moved to another backend).
#[test]
fn upgrade_from_the_ipv4_only_release_keeps_every_connection() {
    let _one = serial();
    let site = Site::dual_stack(3);
    let maps = site.bpf_root().join("maps");
    let manifests = tempfile::tempdir().unwrap();
    // What the IPv4-only release programmed: the IPv4 side of the Services.
    upgrade_manifests(&site, manifests.path(), &[IpFamily::V4]);
    let old = site.agent_with(CLUSTER_CIDR, Some(manifests.path().into()), None, &[]);
    let mut loads4 = web_loads(&site, IpFamily::V4, true);
    loads4.push((
        STICKY_LOAD,
        Load::start(site.host(), &at(sticky_ip(IpFamily::V4), 80), "tcp", 10, false),
    ));
    let held4 = Established::open(
        &[
            (site.host(), at(web_ip(IpFamily::V4), 80)),
            (site.external(), site.node_port(IpFamily::V4, 30090)),
        ],
        3,
        9,
    );
    std::thread::sleep(Duration::from_secs(1));
    let ids_before = ids_of(&site.ids(), IpFamily::V4);
    let snap = KernelMaps::from_pins(&maps).unwrap().snapshot().unwrap();
    let members_before: BTreeSet<_> = snap
        .affinity_match
        .iter()
        .map(|k| (k.backend_id, k.rev_nat_id))
        .collect();
    let names_before = snap.names;
    let config_before = KernelMaps::from_pins(&maps).unwrap().datapath_config().unwrap();
    assert!(old.stop().success());

    let emulated = pin_the_ipv4_only_release(&site.bpf_root());
    let pins_old = pins_in(&maps);
    assert_eq!(
        pins_old,
        IPV4_ONLY_RELEASE_PINS.iter().map(|p| p.to_string()).collect(),
        "the IPv4-only release's pin set ({emulated:?})"
    );
    let links_old = site.pinned_links();
    let ipv6_served_before = probe::tcp(site.host(), &at(web_ip(IpFamily::V6), 80), 1)[0]["ok"] == true;

    // The cluster's objects as they are: the Services are dual-stack (the old release ignored
    // their IPv6 side). This release's agent, as the DaemonSet would start it.
    upgrade_manifests(&site, manifests.path(), &IpFamily::ALL);
    let new = site.agent(Some(manifests.path().into()), None, &[]);
    let pins_new = pins_in(&maps);
    let links_new = site.pinned_links();
    let kernel = KernelMaps::from_pins(&maps).unwrap();
    let config_after = kernel.datapath_config().unwrap();
    let snap = kernel.snapshot().unwrap();
    let members_after: BTreeSet<_> = snap
        .affinity_match
        .iter()
        .map(|k| (k.backend_id, k.rev_nat_id))
        .collect();
    let names_kept = names_before
        .iter()
        .all(|(id, name)| snap.names.get(id) == Some(name));
    let names_capacity = capacity_of(&maps.join(catalog::SVC_NAMES));
    let ids_after = site.ids();

    // The IPv6 side is served now: the same loads over IPv6.
    let mut loads6 = web_loads(&site, IpFamily::V6, true);
    loads6.push((
        STICKY_LOAD,
        Load::start(site.host(), &at(sticky_ip(IpFamily::V6), 80), "tcp", 10, false),
    ));
    std::thread::sleep(Duration::from_secs(2));
    let tally6 = stop_loads(loads6);
    let held4 = held4.verdict();
    let tally4 = stop_loads(loads4);
    let log = new.log();
    drop(new);

    let expected_pins: BTreeSet<String> = catalog::ALL
        .iter()
        .map(|name| lb_common::catalog::pin_name(name).to_string())
        .collect();
    let old_pins_gone = !pins_new.contains("lb_config")
        && !pins_new.contains("lb4_aff_match")
        && !pins_new.contains(catalog::SERVICES);
    // Every link of the old release kept, its program replaced; the IPv6 hooks' links added.
    let links_kept = links_old
        .iter()
        .all(|(pin, (link, prog))| links_new.get(pin).is_some_and(|(l, p)| l == link && p != prog));
    let links_added: Vec<&String> = links_new
        .keys()
        .filter(|pin| !links_old.contains_key(*pin))
        .collect();
    let ipv6_hooks_attached = links_added.len() == NEWER_SOCKET_HOOKS.len()
        && NEWER_SOCKET_HOOKS
            .iter()
            .all(|hook| links_added.iter().any(|pin| pin.ends_with(&format!("/{hook}"))));
    let members_kept = members_before.is_subset(&members_after);
    let configured = config_after.v4 == config_before.v4
        && config_after.host_netns_cookie == config_before.host_netns_cookie
        && config_after != lb_common::config::DatapathConfig::UNCONFIGURED;
    let sticky_backends = |t: &Tally| t.servers(STICKY_LOAD).len();
    let pods6: BTreeSet<String> = (0..3).map(|i| site.pod_addr(i, IpFamily::V6)).collect();
    let served6 = tally6.servers("socket path, TCP to the cluster IP");
    let served6_tc = tally6.servers("tc path, TCP to the NodePort");
    let ids4_after = ids_of(&ids_after, IpFamily::V4);
    let ids6_after = ids_of(&ids_after, IpFamily::V6);
    record(
        "2b-upgrade-from-ipv4-only",
        per_family(
            "Upgrade of an install of the IPv4-only release under IPv4 load: its pins (lb_config of layout 1, \
             lb4_aff_match, lb_svc_names at the old capacity, no lb6_* maps, no IPv6 socket hooks) emulated from \
             this release's, whose programs keep serving from the pinned links; then this release's agent with the \
             Services dual-stack",
            json!({
                "load": tally4.rows,
                "established": held4.json(),
                "attempted": tally4.attempted,
                "failed": tally4.failed,
                "ids_stable": ids_before == ids4_after,
                "emulated_old_release": emulated,
                "old_pins_removed_after_attach": old_pins_gone,
                "pins_after": if pins_new == expected_pins { json!("this release's, nothing else") } else { json!(pins_new) },
                "config_written_before_attach": configured,
                "affinity_members": {"before": members_before.len(), "after": members_after.len(), "kept": members_kept},
                "affinity_clients_kept_their_backend": sticky_backends(&tally4) == 1,
                "service_names": {"capacity_before": IPV4_ONLY_SVC_NAMES_CAPACITY, "capacity_after": names_capacity, "kept": names_kept},
                "links": {"kept_with_programs_replaced": links_old.len(), "all_kept": links_kept, "added": links_added},
            }),
            json!({
                "load": tally6.rows,
                "attempted": tally6.attempted,
                "failed": tally6.failed,
                "served_before_upgrade": ipv6_served_before,
                "frontends_after": ids6_after.0.len(),
                "backends_after": ids6_after.1.len(),
                "served_by_pods": !served6.is_empty() && served6.is_subset(&pods6) && !served6_tc.is_empty() && served6_tc.is_subset(&pods6),
                "affinity_clients_kept_their_backend": sticky_backends(&tally6) == 1,
            }),
        ),
    );

    assert_eq!(
        tally4.failed,
        0,
        "no IPv4 connection may fail during the upgrade: {:#?}\ndata path events: {:#}\nagent log:\n{log}",
        tally4.failures,
        lb_tests::agent::datapath_events(&site.bpf_root())
    );
    assert_eq!(
        (held4.broken, held4.moved),
        (0, 0),
        "established IPv4 connections survive on their backends"
    );
    assert_eq!(
        sticky_backends(&tally4),
        1,
        "ClientIP affinity kept across the upgrade: {:?}",
        tally4.servers(STICKY_LOAD)
    );
    assert!(!ids_before.0.is_empty());
    assert_eq!(
        ids_before, ids4_after,
        "IPv4 ids adopted from the old release's maps"
    );
    assert!(!ipv6_served_before, "the IPv4-only release served no IPv6");
    // The old pins are gone once the new programs are attached; this release's pins, nothing
    // else, are left.
    assert!(
        old_pins_gone,
        "lb_config, lb4_aff_match and lb4_services removed after attach: {pins_new:?}"
    );
    assert_eq!(pins_new, expected_pins, "this release's pins, nothing else");
    for hint in [
        "a map of an earlier release is pinned",
        "a map of another layout version is pinned",
        "capacity changed: migrating",
        "entries migrated",
        "its entries are converted into the new layout",
        "entries converted to the new layout",
    ] {
        assert!(log.contains(hint), "the agent says {hint:?}:\n{log}");
    }
    assert!(configured, "lb_config_v2 holds the settings: {config_after:?}");
    assert!(
        !members_before.is_empty() && members_kept,
        "the affinity members are back in lb_aff_match: {members_before:?} -> {members_after:?}"
    );
    assert_eq!(names_capacity, u64::from(2 * catalog::capacity::REVNAT));
    assert!(names_kept, "lb_svc_names' entries migrated to its new capacity");
    assert!(
        links_kept && ipv6_hooks_attached,
        "the old release's links kept with their programs replaced, the IPv6 hooks and sock_release attached: {links_old:?} -> {links_new:?}"
    );
    // IPv6 is served from the upgrade on.
    assert_eq!(tally6.failed, 0, "IPv6 after the upgrade: {:#?}", tally6.failures);
    assert!(
        !ids6_after.0.is_empty() && !served6.is_empty() && served6.is_subset(&pods6),
        "IPv6 cluster IP served by the pods' IPv6 addresses: {served6:?}"
    );
    assert!(
        !served6_tc.is_empty() && served6_tc.is_subset(&pods6),
        "IPv6 NodePort served by the pods' IPv6 addresses: {served6_tc:?}"
    );
    assert_eq!(sticky_backends(&tally6), 1, "IPv6 ClientIP affinity");
}

/// The upgrade of [`upgrade_from_the_ipv4_only_release_keeps_every_connection`] when the new
/// agent's first sync fails before programming anything: its manifests folder is missing (a
/// volume mounted late) until a second after that failure. The new programs must not be swapped
/// in before a sync has programmed the maps: until then `lb_config_v2` is unconfigured (no
/// masquerade address: the external client's masqueraded flows would be dropped, counted as
/// `tc_no_masquerade_address`) and `lb_aff_match` empty (a ClientIP-affinity client would move).
/// The old programs keep serving meanwhile.
#[test]
fn upgrade_from_the_ipv4_only_release_attaches_only_once_programmed() {
    let _one = serial();
    let site = Site::dual_stack(3);
    let maps = site.bpf_root().join("maps");
    let manifests = tempfile::tempdir().unwrap();
    upgrade_manifests(&site, manifests.path(), &[IpFamily::V4]);
    let old = site.agent_with(CLUSTER_CIDR, Some(manifests.path().into()), None, &[]);
    let loads = vec![
        (
            "tc path, TCP to the NodePort",
            Load::start(
                site.external(),
                &site.node_port(IpFamily::V4, 30090),
                "tcp",
                10,
                false,
            ),
        ),
        (
            STICKY_LOAD,
            Load::start(site.host(), &at(sticky_ip(IpFamily::V4), 80), "tcp", 10, false),
        ),
    ];
    std::thread::sleep(Duration::from_secs(1));
    let exhausted =
        |kernel: &KernelMaps| kernel.counter(lb_common::stats::Counter::TcNoMasqueradeAddress as u32);
    let exhausted_before = exhausted(&KernelMaps::from_pins(&maps).unwrap());
    assert!(old.stop().success());
    pin_the_ipv4_only_release(&site.bpf_root());
    upgrade_manifests(&site, manifests.path(), &IpFamily::ALL);
    let elsewhere = tempfile::tempdir().unwrap();
    let aside = elsewhere.path().join("manifests");
    std::fs::rename(manifests.path(), &aside).unwrap();
    let new = Agent::spawn(site.agent_options(CLUSTER_CIDR_DUAL, Some(manifests.path().into()), None, &[]));
    new.wait_for_line("first sync: loading the manifests", Duration::from_secs(30));
    // A second of retries, during which nothing may be swapped in.
    std::thread::sleep(Duration::from_secs(1));
    let attached_while_unprogrammed = new.log().contains(lb_tests::agent::ATTACHED);
    let old_pins_kept = pins_in(&maps).contains("lb_config");
    std::fs::rename(&aside, manifests.path()).unwrap();
    new.wait_for_line(lb_tests::agent::ATTACHED, Duration::from_secs(30));
    let kernel = KernelMaps::from_pins(&maps).unwrap();
    let configured = kernel
        .datapath_config()
        .is_some_and(|c| c != lb_common::config::DatapathConfig::UNCONFIGURED);
    let members = kernel.snapshot().unwrap().affinity_match.len();
    std::thread::sleep(Duration::from_secs(1));
    let t = stop_loads(loads);
    let dropped = exhausted(&kernel) - exhausted_before;
    let log = new.log();
    drop(new);
    record(
        "2c-upgrade-first-sync-fails",
        json!({
            "scenario": "Upgrade of an install of the IPv4-only release (as 2b) whose new agent cannot read its manifests folder until a second after its first sync failed",
            "load": t.rows,
            "attempted": t.attempted,
            "failed": t.failed,
            "attached_before_a_sync_programmed_the_maps": attached_while_unprogrammed,
            "old_pins_kept_until_then": old_pins_kept,
            "config_written_before_attach": configured,
            "affinity_members_at_attach": members,
            "masqueraded_flows_dropped": dropped,
            "affinity_clients_kept_their_backend": t.servers(STICKY_LOAD).len() == 1,
        }),
    );
    assert!(
        !attached_while_unprogrammed && old_pins_kept,
        "nothing swapped in (nor old pins removed) before a sync programmed the maps:\n{log}"
    );
    assert!(
        log.contains("not programmed yet"),
        "the first sync was retried:\n{log}"
    );
    assert!(
        configured,
        "lb_config_v2 written before the programs were swapped in"
    );
    assert!(
        members > 0,
        "the affinity members rewritten before the programs were swapped in"
    );
    assert_eq!(
        dropped, 0,
        "no masqueraded flow dropped for want of a masquerade address"
    );
    assert_eq!(t.failed, 0, "{:#?}", t.failures);
    assert_eq!(
        t.servers(STICKY_LOAD).len(),
        1,
        "ClientIP affinity kept: {:?}",
        t.servers(STICKY_LOAD)
    );
}

/// The API-backed site: a control plane, the API reachable from the node through a forward that
/// can be cut.
struct ApiSite {
    site: Site,
    forward: PortForward,
    client: kube::Client,
    cp: ControlPlane,
    rt: tokio::runtime::Runtime,
}

impl ApiSite {
    /// An IPv4 node.
    fn new(pods: u8) -> ApiSite {
        ApiSite::with_site(Site::new(pods))
    }

    /// A dual-stack node, whose Node object has an InternalIP of each family.
    fn dual_stack(pods: u8) -> ApiSite {
        ApiSite::with_site(Site::dual_stack(pods))
    }

    fn with_site(site: Site) -> ApiSite {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let cp = ControlPlane::start().expect("control plane");
        let client = rt.block_on(cp.client()).unwrap();
        let api: SocketAddr = cp.server_url().trim_start_matches("https://").parse().unwrap();
        let forward = PortForward::start(&site.node.ns, api, api);
        // One InternalIP per family of the node, IPv4 first.
        let node_ips: Vec<IpAddr> = IpFamily::ALL
            .into_iter()
            .filter_map(|family| site.node.addr(family))
            .collect();
        rt.block_on(async {
            Api::<Namespace>::all(client.clone())
                .create(
                    &PostParams::default(),
                    &Namespace {
                        metadata: ObjectMeta {
                            name: Some("rel".into()),
                            ..Default::default()
                        },
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            let nodes: Api<Node> = Api::all(client.clone());
            nodes
                .create(
                    &PostParams::default(),
                    &Node {
                        metadata: ObjectMeta {
                            name: Some(NODE.into()),
                            ..Default::default()
                        },
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            let status = NodeStatus {
                addresses: Some(
                    node_ips
                        .iter()
                        .map(|ip| NodeAddress {
                            type_: "InternalIP".into(),
                            address: ip.to_string(),
                        })
                        .collect(),
                ),
                ..Default::default()
            };
            nodes
                .patch_status(
                    NODE,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({ "status": status })),
                )
                .await
                .unwrap();
        });
        ApiSite {
            site,
            forward,
            client,
            cp,
            rt,
        }
    }

    fn agent(&self, extra: &[&str]) -> Agent {
        self.site
            .agent(None, Some(self.cp.kubeconfig_path().into()), extra)
    }

    fn put<K>(&self, obj: K)
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + serde::Serialize
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let api: Api<K> = Api::namespaced(self.client.clone(), "rel");
        let name = obj.meta().name.clone().unwrap();
        self.rt
            .block_on(api.patch(
                &name,
                &PatchParams::apply("lb-reliability").force(),
                &Patch::Apply(&obj),
            ))
            .unwrap();
    }

    /// Deletes the Service and its EndpointSlices, as a cluster does: there the EndpointSlice
    /// controller's slices go with their Service (owner references); this control plane runs no
    /// controllers, and slices left behind would pile up in the agent's store (the soak deleted
    /// 5 Services a step: its agent's heap grew by their slices, about 1 KiB each).
    fn delete_service(&self, name: &str) {
        let api: Api<Service> = Api::namespaced(self.client.clone(), "rel");
        let _ = self.rt.block_on(api.delete(name, &DeleteParams::default()));
        let slices: Api<EndpointSlice> = Api::namespaced(self.client.clone(), "rel");
        let of_service =
            kube::api::ListParams::default().labels(&format!("kubernetes.io/service-name={name}"));
        let _ = self
            .rt
            .block_on(slices.delete_collection(&DeleteParams::default(), &of_service));
    }
}

fn with_kind<T: serde::Serialize>(obj: T, api_version: &str, kind: &str) -> Value {
    let mut v = serde_json::to_value(obj).unwrap();
    v["apiVersion"] = api_version.into();
    v["kind"] = kind.into();
    v
}

fn svc(s: fixtures::Svc) -> Service {
    let mut svc = s.build();
    svc.metadata.namespace = Some("rel".into());
    svc
}

fn sl(s: fixtures::Slice) -> EndpointSlice {
    let mut sl = s.build();
    sl.metadata.namespace = Some("rel".into());
    sl
}

impl ApiSite {
    fn put_service(&self, s: fixtures::Svc) {
        let v = with_kind(svc(s), "v1", "Service");
        let obj: Service = serde_json::from_value(v).unwrap();
        self.put(obj);
    }

    fn put_slice(&self, s: fixtures::Slice) {
        let v = with_kind(sl(s), "discovery.k8s.io/v1", "EndpointSlice");
        let obj: EndpointSlice = serde_json::from_value(v).unwrap();
        self.put(obj);
    }

    /// The dual-stack `web` Service with pods 0 and 1 as its endpoints (a slice per family),
    /// once served from the node in both families.
    fn serve_web_from_pods_0_and_1(&self) {
        self.put_service(web_service(&IpFamily::ALL));
        for family in IpFamily::ALL {
            self.put_slice(web_slice(&self.site, "web", family, &[0, 1]));
        }
        for family in IpFamily::ALL {
            let pods: Vec<String> = (0..2).map(|i| self.site.pod_addr(i, family)).collect();
            converge(&format!("{family} serving"), Duration::from_secs(15), || {
                serves(self.site.host(), &at(web_ip(family), 80), &pods)
            });
        }
    }
}

fn converge(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !check() {
        assert!(
            started.elapsed() < timeout,
            "{what}: not converged within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    started.elapsed()
}

fn serves(place: Place<'_>, to: &str, expected: &[String]) -> bool {
    let results = probe::tcp(place, to, 12);
    let got: BTreeSet<String> = results
        .iter()
        .filter_map(|r| probe::server_of(r).map(str::to_string))
        .collect();
    results.iter().all(|r| r["ok"] == true) && got == expected.iter().cloned().collect()
}

#[test]
fn api_outage_of_30s_keeps_serving_and_converges() {
    let _one = serial();
    let s = ApiSite::new(3);
    let (p0, p1, p2) = (s.site.pod_ip(0), s.site.pod_ip(1), s.site.pod_ip(2));
    let _agent = s.agent(&[]);
    s.put_service(
        service("rel", "web")
            .cluster_ip("10.96.50.10")
            .port("http", "TCP", 80, 8080)
            .node_port(30090),
    );
    s.put_slice(
        slice("rel", "web", "web-1")
            .endpoint(&p0, NODE, State::Ready)
            .endpoint(&p1, NODE, State::Ready)
            .port("http", "TCP", 8080),
    );
    converge("serving", Duration::from_secs(15), || {
        serves(s.site.host(), "10.96.50.10:80", &[p0.clone(), p1.clone()])
    });
    let node_ip = s.site.node.ip.unwrap();
    let loads = [
        (
            "socket path, TCP to the cluster IP",
            Load::start(s.site.host(), "10.96.50.10:80", "tcp", 10, false),
        ),
        (
            "tc path, TCP to the NodePort",
            Load::start(s.site.external(), &format!("{node_ip}:30090"), "tcp", 10, false),
        ),
    ];

    // The agent loses the API for 30 s; changes are made meanwhile.
    s.forward.pause();
    let outage = Instant::now();
    let outage_us = now_us();
    std::thread::sleep(Duration::from_secs(5));
    s.put_slice(
        slice("rel", "web", "web-1")
            .endpoint(&p0, NODE, State::Ready)
            .endpoint(&p1, NODE, State::Ready)
            .endpoint(&p2, NODE, State::Ready)
            .port("http", "TCP", 8080),
    );
    s.put_service(
        service("rel", "new")
            .cluster_ip("10.96.50.11")
            .port("http", "TCP", 80, 8080),
    );
    s.put_slice(
        slice("rel", "new", "new-1")
            .endpoint(&p2, NODE, State::Ready)
            .port("http", "TCP", 8080),
    );
    std::thread::sleep(Duration::from_secs(30).saturating_sub(outage.elapsed()));
    // During the outage the data path kept the last state: only p0 and p1.
    let during: BTreeSet<String> = probe::tcp(s.site.host(), "10.96.50.10:80", 20)
        .iter()
        .filter_map(|r| probe::server_of(r).map(str::to_string))
        .collect();
    s.forward.resume();
    let back = Instant::now();
    let back_us = now_us();
    let converged = converge("changes made during the outage", Duration::from_secs(60), || {
        serves(
            s.site.host(),
            "10.96.50.10:80",
            &[p0.clone(), p1.clone(), p2.clone()],
        ) && serves(s.site.host(), "10.96.50.11:80", std::slice::from_ref(&p2))
    });
    let _ = back;
    let mut per_load = Vec::new();
    let (mut attempted, mut failed) = (0, 0);
    let mut failures = Vec::new();
    for (what, load) in loads {
        let results = load.stop();
        let (a, f) = tally(&results);
        failures.extend(lb_tests::load::failures(what, &results));
        attempted += a;
        failed += f;
        per_load.push(lb_tests::load::row(what, &results));
    }
    record(
        "3-api-outage",
        json!({
            "scenario": "API server unreachable from the node for 30 s; an endpoint added and a Service created meanwhile",
            "load": per_load,
            "attempted": attempted,
            "failed": failed,
            "served_during_outage": during.len(),
            "converged_after_return_s": converged.as_secs_f64(),
        }),
    );
    assert_eq!(
        failed,
        0,
        "the data path keeps serving through the outage (outage from {outage_us} µs, API back at {back_us} µs): {failures:#?}\ndata path events: {:#}",
        lb_tests::agent::datapath_events(&s.site.bpf_root())
    );
    assert_eq!(
        during,
        [p0, p1].into_iter().collect(),
        "the last known state is served"
    );
}

/// The TCP cluster IP frontend of `web` in family `family`, as the map watcher matches it.
fn web_addr(family: IpFamily) -> IpAddr {
    web_ip(family).parse().unwrap()
}

/// One family's churn: what was written, what the watcher saw applied, and the loads' results.
struct Churn {
    writes: Vec<(u64, BTreeSet<String>)>,
    applied: Vec<Observed>,
    tcp: Vec<Value>,
    udp_sock: Vec<Value>,
    udp_tc: Vec<Value>,
}

/// The verdict on one family's churn.
struct ChurnVerdict {
    figures: Value,
    violations: Vec<String>,
    udp_sock_servers: BTreeSet<String>,
    udp_tc_servers: BTreeSet<String>,
    stale_udp_tc: usize,
}

impl Churn {
    fn judge(&self) -> ChurnVerdict {
        let applied = &self.applied;
        // A connection started at t and done after `elapsed_us` chose its backend in between: it
        // may use a backend only if some applied set containing it can have been in the maps at
        // some moment of that window. `before` widens the window backwards: how long a client may
        // act on what it chose earlier (a UDP flow notices at its next datagram).
        let present = |server: &str, r: &Value, before: u64| -> bool {
            let (Some(t), Some(elapsed)) = (r["t_us"].as_u64(), r["elapsed_us"].as_u64()) else {
                return false;
            };
            lifetimes(applied).any(|(lo, hi, set)| {
                set.contains(server) && lo <= t + elapsed && hi >= t.saturating_sub(before)
            })
        };
        let timeline_near = |t: u64| -> Vec<String> {
            applied
                .iter()
                .filter(|o| o.seen_us + 300_000 >= t && o.from_us <= t + 300_000)
                .map(|o| {
                    format!(
                        "changed in [{:+} ms, {:+} ms] to {:?}",
                        (o.from_us as i64 - t as i64) / 1000,
                        (o.seen_us as i64 - t as i64) / 1000,
                        o.set
                    )
                })
                .collect()
        };
        let violations: Vec<String> = self
            .tcp
            .iter()
            .filter(|r| r["ok"] == true)
            .filter_map(|r| {
                let server = probe::server_of(r)?.to_string();
                (!present(&server, r, 0)).then(|| {
                    let t = r["t_us"].as_u64().unwrap_or(0);
                    format!(
                        "{server}: connection started at {t} µs, took {} µs; applied sets around it: {:#?}",
                        r["elapsed_us"],
                        timeline_near(t)
                    )
                })
            })
            .collect();
        // Programming latency: API write -> the first snapshot that saw exactly what was written.
        let mut latencies: Vec<f64> = self
            .writes
            .iter()
            .filter_map(|(t, want)| {
                applied
                    .iter()
                    .find(|o| o.seen_us >= *t && o.set == *want)
                    .map(|o| (o.seen_us - t) as f64 / 1000.0)
            })
            .collect();
        latencies.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            latencies
                .get(((latencies.len() as f64 - 1.0) * p).round() as usize)
                .copied()
                .unwrap_or(f64::NAN)
        };
        let (tcp_a, tcp_f) = tally(&self.tcp);
        // UDP flows: after their backend left, the next answers come from live backends.
        let stale_udp = |results: &[Value]| -> usize {
            results
                .iter()
                .filter(|r| r["ok"] == true)
                .filter_map(|r| {
                    let server = r.pointer("/reply/server")?.as_str()?.to_string();
                    // One exchange interval (20 ms) for the flow to notice.
                    (!present(&server, r, 25_000)).then_some(())
                })
                .count()
        };
        let (us_a, us_f) = tally(&self.udp_sock);
        let (ut_a, ut_f) = tally(&self.udp_tc);
        let servers = |results: &[Value]| -> BTreeSet<String> {
            results
                .iter()
                .filter_map(|r| {
                    r.pointer("/reply/server")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
                .collect()
        };
        let (udp_sock_servers, udp_tc_servers) = (servers(&self.udp_sock), servers(&self.udp_tc));
        let figures = json!({
            "changes": self.writes.len(),
            "load": [
                {"load": "socket path, TCP every 2 ms", "attempted": tcp_a, "failed": tcp_f},
                {"load": "socket path, one UDP socket, every 20 ms", "attempted": us_a, "failed": us_f, "backends_seen": udp_sock_servers.len(), "answers_from_removed_backends": stale_udp(&self.udp_sock)},
                {"load": "tc path, one UDP flow, every 20 ms", "attempted": ut_a, "failed": ut_f, "backends_seen": udp_tc_servers.len(), "answers_from_removed_backends": stale_udp(&self.udp_tc)},
            ],
            "attempted": tcp_a + us_a + ut_a,
            "failed": tcp_f + us_f + ut_f,
            "new_connections_to_removed_endpoints": violations.len(),
            // How precisely the map watcher dated the changes (its polling gaps, scheduling).
            "watcher_uncertainty_ms_max": applied.iter().skip(1).map(|o| (o.seen_us - o.from_us) as f64 / 1000.0).fold(0.0, f64::max),
            "programming_latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": latencies.last().copied().unwrap_or(f64::NAN), "samples": latencies.len()},
        });
        ChurnVerdict {
            figures,
            violations,
            stale_udp_tc: stale_udp(&self.udp_tc),
            udp_sock_servers,
            udp_tc_servers,
        }
    }
}

#[test]
fn endpoint_churn_never_sends_new_connections_to_removed_endpoints() {
    let _one = serial();
    let s = ApiSite::dual_stack(6);
    let _agent = s.agent(&[]);
    let pods = |family: IpFamily| -> Vec<String> { (0..6).map(|i| s.site.pod_addr(i, family)).collect() };
    // A slice per family (as the EndpointSlice controller writes them), each written when asked:
    // returns when each family's write started.
    let set = |members: &[usize]| -> [u64; 2] {
        IpFamily::ALL.map(|family| {
            let t = now_us();
            s.put_slice(web_slice(&s.site, "web", family, members));
            t
        })
    };
    s.serve_web_from_pods_0_and_1();

    // Watch the applied backend sets of both families through the pinned maps (every ~1 ms).
    // The watcher may be descheduled for a while on a busy machine, so each change is kept with
    // the interval in which it must have happened (see `Observed`), never with a single instant.
    let applied: Arc<Mutex<[Vec<Observed>; 2]>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (applied, stop, maps_dir) = (applied.clone(), stop.clone(), s.site.bpf_root().join("maps"));
        std::thread::spawn(move || {
            let maps = KernelMaps::from_pins(&maps_dir).unwrap();
            let mut last: [Option<BTreeSet<String>>; 2] = [None, None];
            let mut previous_start = now_us();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let start = now_us();
                let snap = maps.snapshot().unwrap();
                let end = now_us();
                for family in IpFamily::ALL {
                    let i = family as usize;
                    // Backends of the TCP cluster IP frontend's slots.
                    let current: BTreeSet<String> = snap
                        .services
                        .iter()
                        .filter(|(k, _)| k.addr == web_addr(family) && k.port == 80 && k.slot > 0)
                        .filter_map(|(_, v)| {
                            snap.backends.get(&v.entry.backend_id).map(|b| b.addr.to_string())
                        })
                        .collect();
                    if last[i].as_ref() != Some(&current) {
                        let from_us = if last[i].is_none() { start } else { previous_start };
                        applied.lock().unwrap()[i].push(Observed {
                            from_us,
                            seen_us: end,
                            set: current.clone(),
                        });
                        last[i] = Some(current);
                    }
                }
                previous_start = start;
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    // The loads start only once the watcher has dated the first sets: a connection made before
    // its first snapshot could not be judged against any applied set.
    let first_seen = Instant::now();
    while applied.lock().unwrap().iter().any(Vec::is_empty) {
        assert!(
            first_seen.elapsed() < Duration::from_secs(10),
            "the map watcher took no snapshot in 10 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let loads = IpFamily::ALL.map(|family| {
        let cluster = |port| at(web_ip(family), port);
        [
            Load::start(s.site.host(), &cluster(80), "tcp", 2, false),
            Load::start(s.site.host(), &cluster(53), "udp", 20, true),
            Load::start(
                s.site.external(),
                &s.site.node_port(family, 30053),
                "udp",
                20,
                true,
            ),
        ]
    });

    // Churn: every 250 ms one endpoint is replaced by another, for 20 s (in both families' slices).
    let mut members = vec![0usize, 1];
    let mut writes: [Vec<(u64, BTreeSet<String>)>; 2] = Default::default();
    let churn_until = Instant::now() + Duration::from_secs(20);
    let mut next = 2;
    while Instant::now() < churn_until {
        members.remove(0);
        members.push(next % 6);
        next += 1;
        if members[0] == members[1] {
            members[1] = (members[1] + 1) % 6;
        }
        let started = set(&members);
        for family in IpFamily::ALL {
            let i = family as usize;
            let names = members.iter().map(|m| pods(family)[*m].clone()).collect();
            writes[i].push((started[i], names));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    std::thread::sleep(Duration::from_secs(1));
    let [r4, r6] = loads.map(|[tcp, udp_sock, udp_tc]| [tcp.stop(), udp_sock.stop(), udp_tc.stop()]);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    watcher.join().unwrap();
    let [a4, a6] = std::mem::take(&mut *applied.lock().unwrap());
    let [w4, w6] = writes;
    let judge = |writes, applied, [tcp, udp_sock, udp_tc]: [Vec<Value>; 3]| {
        Churn {
            writes,
            applied,
            tcp,
            udp_sock,
            udp_tc,
        }
        .judge()
    };
    let (v4, v6) = (judge(w4, a4, r4), judge(w6, a6, r6));
    record(
        "4-endpoint-churn",
        per_family(
            "Endpoint churn: one of two endpoints replaced every 250 ms for 20 s (in the IPv4 and the IPv6 slice of a dual-stack Service)",
            v4.figures.clone(),
            v6.figures.clone(),
        ),
    );
    for (family, v) in [(IpFamily::V4, &v4), (IpFamily::V6, &v6)] {
        assert!(
            v.violations.is_empty(),
            "{family}: new connections reached removed endpoints: {:?}",
            v.violations
        );
        assert!(
            v.udp_sock_servers.len() > 1 && v.udp_tc_servers.len() > 1,
            "{family}: UDP flows moved off removed backends"
        );
        assert_eq!(
            v.stale_udp_tc, 0,
            "{family}: a tc UDP flow never keeps a removed backend"
        );
    }
}

/// A CoreDNS rollout, as resolvers with long-lived connected UDP sockets see it: the two backends
/// of the Service's UDP port (53) are replaced one after the other while resolvers on two pods and
/// on the node query it every 50 ms over each family. The agent aborts the sockets connected to a
/// removed backend (`datapath/sockets.rs`); each resolver reconnects at its next query. The old
/// backends keep answering here, so a socket that was left alone would show.
#[test]
fn dns_rollout_moves_resolvers_with_connected_sockets_to_the_new_backends() {
    let _one = serial();
    let s = ApiSite::dual_stack(6);
    let agent = s.agent(&[]);
    if agent.log().contains("connected UDP sockets are not terminated") {
        eprintln!("skipped: this kernel cannot destroy sockets (the agent says so at start-up)");
        return;
    }
    let pods = |family: IpFamily| -> Vec<String> { (0..6).map(|i| s.site.pod_addr(i, family)).collect() };
    let set = |members: &[usize]| -> u64 {
        let t = now_us();
        for family in IpFamily::ALL {
            s.put_slice(web_slice(&s.site, "web", family, members));
        }
        t
    };
    s.serve_web_from_pods_0_and_1();
    // Resolvers on pods 4 and 5 and on the node, over each family.
    let places = [
        ("pod 4", s.site.pod(4)),
        ("pod 5", s.site.pod(5)),
        ("node", s.site.host()),
    ];
    let mut resolvers: Vec<(IpFamily, &str, Proc)> = Vec::new();
    for family in IpFamily::ALL {
        for (name, place) in &places {
            let p = probe::resolve(*place, &at(web_ip(family), 53), 14);
            resolvers.push((family, name, p));
        }
    }
    for (family, name, r) in &mut resolvers {
        r.wait_for_line(Duration::from_secs(5), |l| l.contains("\"ok\":true"));
        let _ = (family, name);
    }
    std::thread::sleep(Duration::from_secs(2));
    // The rollout: pod 0 replaced by pod 2, then pod 1 by pod 3, 4 s apart.
    let first = set(&[2, 1]);
    std::thread::sleep(Duration::from_secs(4));
    let second = set(&[2, 3]);
    let removed_at = |pod: usize| if pod == 0 { first } else { second };
    let mut figures: BTreeMap<IpFamily, Value> = BTreeMap::new();
    let mut problems = Vec::new();
    for family in IpFamily::ALL {
        let (mut queries, mut failed, mut aborted, mut stale) = (0u64, 0u64, 0u64, 0u64);
        let mut rows = Vec::new();
        for (_, name, r) in resolvers.iter_mut().filter(|(f, _, _)| *f == family) {
            let (done, lines) = probe::resolved(r, Duration::from_secs(30));
            // From the first answer on (a pod's IPv6 address may be tentative before it).
            let from = lines.iter().position(|v| v["ok"] == true).unwrap_or(lines.len());
            let lines = &lines[from..];
            let failures: Vec<&Value> = lines.iter().filter(|v| v["ok"] != true).collect();
            // An answer from a removed backend more than a second after its removal was written
            // (the agent applies it within its minimum sync period, then aborts the sockets).
            let stale_answers = lines
                .iter()
                .filter(|v| {
                    let by = probe::server_of(v).unwrap_or_default();
                    let t = v["t_us"].as_u64().unwrap_or(0);
                    [0usize, 1]
                        .iter()
                        .any(|p| by == pods(family)[*p] && t > removed_at(*p) + 1_000_000)
                })
                .count() as u64;
            let sockets = done["sockets"].as_u64().unwrap_or(0);
            let last = lines
                .iter()
                .rev()
                .find_map(|v| probe::server_of(v))
                .unwrap_or_default()
                .to_string();
            if !pods(family)[2..4].contains(&last) {
                problems.push(format!("{family} {name}: last answered by {last}"));
            }
            for f in &failures {
                let errno = f["errno"].as_i64().unwrap_or(0);
                if errno != i64::from(libc::ECONNABORTED) && errno != i64::from(libc::EDESTADDRREQ) {
                    problems.push(format!(
                        "{family} {name}: a query failed otherwise than by the abort: {f}"
                    ));
                }
            }
            if failures.len() as u64 > sockets.saturating_sub(1) {
                problems.push(format!(
                    "{family} {name}: {} queries failed for {} socket(s) aborted",
                    failures.len(),
                    sockets.saturating_sub(1)
                ));
            }
            queries += lines.len() as u64;
            failed += failures.len() as u64;
            aborted += sockets.saturating_sub(1);
            stale += stale_answers;
            rows.push(json!({
                "resolver": name,
                "queries": lines.len(),
                "failed": failures.len(),
                "sockets aborted": sockets.saturating_sub(1),
                "answers from a removed backend (> 1 s after its removal)": stale_answers,
                "last answered by": last,
            }));
        }
        if stale > 0 {
            problems.push(format!("{family}: {stale} answers from removed backends"));
        }
        figures.insert(
            family,
            json!({
                "attempted": queries,
                "failed": failed,
                "sockets aborted": aborted,
                "answers from a removed backend": stale,
                "resolvers": rows,
            }),
        );
    }
    let terminated = metric_values(&s.site)
        .get("lb_sockets_terminated_total")
        .copied()
        .unwrap_or(0.0);
    let mut v4 = figures.remove(&IpFamily::V4).unwrap();
    v4["lb_sockets_terminated_total (both families)"] = json!(terminated);
    v4["note"] = json!(
        "a failed query is the aborted socket's error, returned at once (EDESTADDRREQ on the next send, \
         ECONNABORTED on a receive in flight); the resolver's next query, on a new socket, is answered"
    );
    record(
        "4b-dns-rollout",
        per_family(
            "DNS rollout: the two backends of a UDP Service replaced one after the other, 4 s apart, under resolvers with long-lived connected UDP sockets (two pods and the node, each family)",
            v4,
            figures.remove(&IpFamily::V6).unwrap(),
        ),
    );
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn full_maps_skip_whole_services_and_recover() {
    let _one = serial();
    let s = ApiSite::new(2);
    let (p0, p1) = (s.site.pod_ip(0), s.site.pod_ip(1));
    // Each Service below takes 3 entries (a frontend and two slots), the API server's own
    // `kubernetes` Service (no endpoints here) takes 1: 19 entries hold it and 6 of the 8.
    // The objects exist before the agent starts, so its first sync sees each Service with its
    // endpoints. Started first, a sync could catch s5..s7 before their EndpointSlices: each then
    // takes one entry (a frontend that rejects), the map is full, and when their endpoints come
    // none of the three can grow, so each keeps that previous state and three are reported
    // skipped (by design: a Service that does not fit stays as it was, `apply::applier`).
    for i in 0..8 {
        s.put_service(
            service("rel", &format!("s{i}"))
                .cluster_ip(&format!("10.96.60.{}", 10 + i))
                .port("http", "TCP", 80, 8080),
        );
        s.put_slice(
            slice("rel", &format!("s{i}"), &format!("s{i}-1"))
                .endpoint(&p0, NODE, State::Ready)
                .endpoint(&p1, NODE, State::Ready)
                .port("http", "TCP", 8080),
        );
    }
    let _agent = s.agent(&["--bpf-lb-service-map-max", "19"]);
    let metrics = |s: &ApiSite| {
        probe::http_get(Place::netns(&s.site.node.ns), "127.0.0.1:10249", "/metrics")["body"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    // Not a timing figure: 20 s once ran out on a machine busy with a kernel matrix and
    // another agent's tests beside CI's.
    let mut skipped = String::new();
    let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        converge(
            "the map fills and the rest is reported",
            Duration::from_secs(60),
            || {
                let text = metrics(&s);
                skipped = text
                    .lines()
                    .filter(|l| l.starts_with("lb_services_skipped"))
                    .collect::<Vec<_>>()
                    .join("; ");
                text.contains("lb_services_skipped{reason=\"map_full\"} 2")
            },
        )
    }));
    assert!(waited.is_ok(), "the last /metrics said: {skipped:?}");
    let served: Vec<bool> = (0..8)
        .map(|i| probe::tcp(s.site.host(), &format!("10.96.60.{}:80", 10 + i), 1)[0]["ok"] == true)
        .collect();
    // The MapFull Event is posted after the sync that skipped the Services, by a task of its own
    // (`events.rs`): it may land after the metric, so it is waited for as the metric was (read
    // once, it raced the post and lost on a loaded machine).
    let events_of = |s: &ApiSite| {
        s.cp.kubectl(["get", "events", "-n", "rel", "-o", "json"])
            .unwrap_or_default()
    };
    let waiting = Instant::now();
    let mut events = events_of(&s);
    while !events.contains("MapFull") && waiting.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(200));
        events = events_of(&s);
    }
    let event_after = waiting.elapsed();
    // No Service is half programmed: each is entirely in the maps or not at all.
    let out = Command::new(workspace_bin("lb-agent"))
        .args(["services", "-o", "json", "--bpf-root"])
        .arg(s.site.bpf_root())
        .output()
        .unwrap();
    let views: Value = serde_json::from_slice(&out.stdout).unwrap();
    let half = views
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["service"].as_str().is_some_and(|n| n.starts_with("rel/")))
        .filter(|v| {
            v["scopes"].as_array().is_some_and(|sc| {
                sc.iter()
                    .any(|x| x["backends"].as_array().is_some_and(|b| b.len() != 2))
            })
        })
        .count();
    // Room again: two Services go away, the two skipped ones appear.
    s.delete_service("s0");
    s.delete_service("s1");
    let recovered = converge("the skipped Services appear", Duration::from_secs(20), || {
        (2..8).all(|i| probe::tcp(s.site.host(), &format!("10.96.60.{}:80", 10 + i), 1)[0]["ok"] == true)
    });
    record(
        "6-map-pressure",
        json!({
            "scenario": "lb4_services sized for 6 of 8 Services (--bpf-lb-service-map-max 19)",
            "served_while_full": served.iter().filter(|b| **b).count(),
            "skipped_while_full": served.iter().filter(|b| !**b).count(),
            "half_programmed": half,
            "event_reported": events.contains("MapFull"),
            "event_after_metric_s": event_after.as_secs_f64(),
            "metric_reported": true,
            "recovered_after_room_s": recovered.as_secs_f64(),
            "attempted": 0,
            "failed": 0,
        }),
    );
    assert_eq!(served.iter().filter(|b| **b).count(), 6, "{served:?}");
    assert_eq!(half, 0, "no Service is half programmed");
    assert!(
        events.contains("MapFull"),
        "a MapFull Event names the skipped Services (none within {event_after:?} of the metric): {events}"
    );
}

/// Filler Services of the crash scenario: `n` ClusterIP Services over the node's pods, their
/// endpoints a subset of the pods that depends on `variant` (so a new variant changes most of
/// them); every 7th with ClientIP affinity, every 13th a NodePort with externalTrafficPolicy Local
/// (two scopes). With the `web` Service, which never changes (the load runs against it).
fn crash_manifests(site: &Site, dir: &Path, n: usize, variant: u64) {
    let pods = site.node.pods.len();
    let mut services = vec![web_service(&[IpFamily::V4]).build()];
    let mut slices = vec![web_slice(site, "web", IpFamily::V4, &(0..pods).collect::<Vec<_>>()).build()];
    for i in 0..n {
        let name = format!("f{i}");
        let ip = format!("10.97.{}.{}", i / 250, i % 250 + 1);
        let mut svc = service("rel", &name)
            .cluster_ip(&ip)
            .port("http", "TCP", 80, 8080);
        if i % 7 == 0 {
            svc = svc.client_ip_affinity(60);
        }
        if i % 13 == 0 {
            svc = svc
                .type_("NodePort")
                .node_port(31000 + (i / 13) as i32)
                .external_traffic_policy("Local");
        }
        services.push(svc.build());
        // 1..=pods endpoints, chosen by (i, variant).
        let mix =
            (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ variant.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let mut s = slice("rel", &name, &format!("{name}-1"));
        for p in 0..pods {
            if (mix >> p) & 1 == 1 || p == (mix as usize >> 8) % pods {
                s = s.endpoint(&site.pod_ip(p), NODE, State::Ready);
            }
        }
        slices.push(s.port("http", "TCP", 8080).build());
    }
    write_manifests(dir, "objects.yaml", &services, &slices);
}

/// The maps a packet sees now: those of the programs behind the agent's pinned links (during a
/// migration, the old maps until the new programs are swapped in), and the pinned ones for maps
/// no attached program uses. Read into a snapshot through pins made for it under `scratch`.
/// `None` while no program is attached: a start killed before its first attach leaves pins a
/// packet never sees, possibly only some of them (aya pins each map as it creates it).
fn live_snapshot(site: &Site, scratch: &Path) -> Option<lb_agent::apply::Snapshot> {
    let links = site.pinned_links();
    let services = catalog::pin_name(catalog::SERVICES).to_string();
    if links.is_empty() || !site.bpf_root().join("maps").join(services).exists() {
        return None;
    }
    let _ = std::fs::remove_dir_all(scratch);
    std::fs::create_dir_all(scratch).unwrap();
    let mut pinned = BTreeSet::new();
    for (_, prog) in links.values() {
        let info = bpftool::json_or_null(&["prog", "show", "id", &prog.to_string()]);
        for map in info["map_ids"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
        {
            let name = bpftool::json_or_null(&["map", "show", "id", &map.to_string()])["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let Some(name) = catalog::ALL.iter().find(|n| **n == name) else {
                continue;
            };
            if pinned.insert(*name) {
                bpftool::run(&[
                    "map",
                    "pin",
                    "id",
                    &map.to_string(),
                    scratch
                        .join(catalog::pin_name(name).to_string())
                        .to_str()
                        .unwrap(),
                ]);
            }
        }
    }
    let maps = site.bpf_root().join("maps");
    for name in catalog::ALL.iter().filter(|n| !pinned.contains(*n)) {
        let pin = catalog::pin_name(name).to_string();
        if let Ok(map) = aya::maps::MapData::from_pin(maps.join(&pin)) {
            map.pin(scratch.join(&pin)).expect("pin for the snapshot");
        }
    }
    let snapshot = KernelMaps::from_pins(scratch)
        .unwrap_or_else(|e| {
            let missing: Vec<_> = catalog::ALL
                .iter()
                .filter(|n| !scratch.join(catalog::pin_name(n).to_string()).exists())
                .collect();
            panic!(
                "opening the maps a packet sees (neither an attached program's nor pinned: {missing:?}): {e}"
            )
        })
        .snapshot()
        .expect("reading the maps a packet sees");
    let _ = std::fs::remove_dir_all(scratch);
    Some(snapshot)
}

/// An env variable's number, or `default`.
fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// How long a start took: from spawn to its maps loaded ("data path loaded"), then to its
/// programs attached after the first sync programmed them.
#[derive(Clone, Copy)]
struct StartTimes {
    load: Duration,
    program: Duration,
}

/// Spawns the agent and waits until it has attached its programs.
fn start_attached(site: &Site, dir: &Path, extra: &[&str]) -> (Agent, StartTimes) {
    let started = Instant::now();
    let agent = Agent::spawn(site.agent_options(CLUSTER_CIDR, Some(dir.into()), None, extra));
    agent.wait_for_line("data path loaded", Duration::from_secs(300));
    let load = started.elapsed();
    agent.wait_for_line(lb_tests::agent::ATTACHED, Duration::from_secs(300));
    let program = started.elapsed() - load;
    (agent, StartTimes { load, program })
}

/// Where in its start a killed agent was, from its log.
fn reached(log: &str) -> &'static str {
    if log.contains(lb_tests::agent::ATTACHED) {
        "attached (a later sync)"
    } else if log.contains("data path loaded") {
        "first sync"
    } else {
        "loading"
    }
}

/// Issue 18: kill -9 at random points while the agent applies a large change, many times over
/// (seeded; the seed is printed), then start it again. Four kinds of change: a cold start on a
/// fresh node, a restart onto a changed cluster (a relist: most Services' endpoints differ), a
/// change applied by a running agent, and a restart that migrates the services maps to a new
/// capacity. After every kill, the maps a packet sees (those of the attached programs) hold no
/// half-programmed Service; throughout, the `web` Service, served before the first crash, loses
/// no request (TCP and UDP through the socket path and tc); after the last start the agent
/// converges to every Service. `LB_CRASH_SERVICES` (default 1000), `LB_CRASH_KILLS` (per kind,
/// default 4) and `LB_CRASH_SEED` set the run; 10,000 Services and many kills make the long one.
#[test]
fn kill_9_while_programming_never_leaves_a_service_half_programmed() {
    use rand::{RngExt, SeedableRng, rngs::StdRng};
    let _one = serial();
    let n: usize = env_or("LB_CRASH_SERVICES", 1000);
    let kills: usize = env_or("LB_CRASH_KILLS", 4);
    let seed: u64 = env_or("LB_CRASH_SEED", now_us());
    eprintln!(
        "crash scenario: seed {seed} (replay with LB_CRASH_SEED={seed}), {n} Services, {kills} kills per kind of change"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let site = Site::new(3);
    let manifests = tempfile::tempdir().unwrap();
    let dir = manifests.path();
    let scratch = site.bpffs.path().join("crash-live");
    let mut variant = 0;
    crash_manifests(&site, dir, n, variant);

    // The windows to kill in, measured: a cold start, a restart, a live change.
    let (agent, cold) = start_attached(&site, dir, &[]);
    let full = live_snapshot(&site, &scratch).expect("programmed");
    full.check_consistent().expect("a complete start is consistent");
    let frontends = |s: &lb_agent::apply::Snapshot| {
        s.services
            .keys()
            .filter(|k| k.slot == 0 && k.scope == lb_common::service::SCOPE_EXTERNAL)
            .count()
    };
    let expected_frontends = frontends(&full);
    drop(agent);
    let (agent, restart) = start_attached(&site, dir, &[]);
    drop(agent);

    let mut kills_json = Vec::new();
    let mut half_programmed = Vec::new();
    let mut check = |kind: &str, delay: Duration, log: &str, site: &Site| {
        let verdict = match live_snapshot(site, &scratch) {
            None => Ok(()),
            Some(snapshot) => snapshot.check_consistent(),
        };
        if let Err(e) = &verdict {
            half_programmed.push(format!("{kind}, killed {delay:?} after its start: {e}"));
        }
        kills_json.push(json!({
            "change": kind,
            "killed_after_ms": delay.as_millis() as u64,
            "reached": reached(log),
            "consistent": verdict.is_ok(),
        }));
    };
    // A quarter of the kills anywhere in the start (the object loading, maps created and
    // migrated), the rest while the first sync writes the maps.
    let spawn_and_kill = |extra: &[&str], window: StartTimes, rng: &mut StdRng| {
        let started = Instant::now();
        let agent = Agent::spawn(site.agent_options(CLUSTER_CIDR, Some(dir.into()), None, extra));
        if rng.random_bool(0.25) {
            std::thread::sleep((window.load + window.program).mul_f64(rng.random_range(0.0..1.1)));
        } else {
            agent.wait_for_line("data path loaded", Duration::from_secs(300));
            std::thread::sleep(window.program.mul_f64(rng.random_range(0.0..1.1)));
        }
        let delay = started.elapsed();
        let log = agent.log();
        drop(agent); // SIGKILL
        (delay, log)
    };

    // 1. Cold starts on a fresh node (nothing served yet: no load).
    for _ in 0..kills {
        site.cleanup();
        let (delay, log) = spawn_and_kill(&[], cold, &mut rng);
        check("cold start", delay, &log, &site);
    }
    let (agent, _) = start_attached(&site, dir, &[]);
    drop(agent);

    // The web Service is served from here on: load through both paths.
    let loads = web_loads(&site, IpFamily::V4, true);

    // 2. Restarts onto a changed cluster.
    for _ in 0..kills {
        variant += 1;
        crash_manifests(&site, dir, n, variant);
        let (delay, log) = spawn_and_kill(&[], restart, &mut rng);
        check("restart onto a changed cluster", delay, &log, &site);
    }

    // 3. A change applied by a running agent (its syncs run every 200 ms).
    for _ in 0..kills {
        let (agent, _) = start_attached(&site, dir, &[]);
        variant += 1;
        crash_manifests(&site, dir, n, variant);
        let delay = Duration::from_millis(rng.random_range(0..600));
        std::thread::sleep(delay);
        let log = agent.log();
        drop(agent);
        check("change applied by a running agent", delay, &log, &site);
    }

    // 4. Restarts that migrate the services maps to a new capacity (each a different one).
    for k in 0..kills {
        let capacity = (lb_common::catalog::capacity::SERVICES + 1 + k as u32).to_string();
        let (delay, log) = spawn_and_kill(&["--bpf-lb-service-map-max", &capacity], restart, &mut rng);
        check("restart migrating the services maps", delay, &log, &site);
    }

    // The last start, at the default capacity: how long until every Service is programmed.
    variant += 1;
    crash_manifests(&site, dir, n, variant);
    let (agent, converged) = start_attached(&site, dir, &[]);
    std::thread::sleep(Duration::from_secs(1));
    let last = live_snapshot(&site, &scratch).expect("programmed");
    let tally = stop_loads(loads);
    let filler_served = (1..4)
        .map(|i| format!("10.97.0.{}:80", i + 1))
        .filter(|to| probe::tcp(site.host(), to, 1)[0]["ok"] == true)
        .count();
    let stale_pins = stray_pins(&site);
    drop(agent);

    let consistent = kills_json.iter().filter(|k| k["consistent"] == true).count();
    record(
        "1b-crash-while-programming",
        json!({
            "scenario": format!(
                "kill -9 at random points while the agent programs {n} Services (seed {seed}): cold starts, restarts onto a changed cluster, changes applied live, restarts migrating the services maps; load on the web Service, served before the first crash"
            ),
            "load": tally.rows,
            "attempted": tally.attempted,
            "failed": tally.failed,
            "kills": kills_json.len(),
            "kills_leaving_maps_consistent": consistent,
            "half_programmed": half_programmed.len(),
            "cold_start_ms": (cold.load + cold.program).as_millis() as u64,
            "cold_start_first_sync_ms": cold.program.as_millis() as u64,
            "restart_ms": (restart.load + restart.program).as_millis() as u64,
            "convergence_after_last_restart_ms": (converged.load + converged.program).as_millis() as u64,
            "frontends_after_last_restart": frontends(&last),
            "frontends_expected": expected_frontends,
            "stale_pins": stale_pins,
            "attempts": kills_json,
        }),
    );
    assert!(
        half_programmed.is_empty(),
        "half-programmed Services after kill -9:\n{}",
        half_programmed.join("\n")
    );
    last.check_consistent().expect("the last start is consistent");
    assert_eq!(
        frontends(&last),
        expected_frontends,
        "every Service programmed after the last start"
    );
    assert_eq!(filler_served, 3, "the filler Services serve after the last start");
    assert_eq!(
        tally.failed, 0,
        "no request to a Service served before the crashes may fail: {:#?}",
        tally.failures
    );
    assert!(
        stale_pins.is_empty(),
        "pins left by interrupted starts: {stale_pins:?}"
    );
}

/// The agent's resident memory (KiB) and open file descriptors.
fn process_usage(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    (rss, fds)
}

/// The agent's `/metrics`: each sample line's value by its name and labels.
fn metric_values(site: &Site) -> BTreeMap<String, f64> {
    let body = probe::http_get(Place::netns(&site.node.ns), "127.0.0.1:10249", "/metrics")["body"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Issue 18's soak (not in `./x test`: `cargo xtask soak --duration 1h` runs it and writes
/// docs/soak.md). A real API server and etcd; steady TCP and UDP load on the `web` Service
/// through the socket path and tc; every `LB_SOAK_STEP_SECS` (20) one action, in a fixed cycle:
/// endpoint churn, Services created and deleted, API server restarts, etcd restarts, agent
/// restarts (SIGTERM), upgrades and downgrades (another object, other map capacities) and
/// kill -9. The last 30% of the run keeps one agent, so its memory and descriptors over that
/// stretch show any growth. Every 30 s: the agent's RSS and descriptors, each map's entries, the
/// conntrack GC's deletions. Nothing may fail; nothing may grow without bound.
///
/// `LB_SOAK_ACTIONS` (comma-separated names from the cycle) runs only those actions, in the
/// cycle's order, to tell which one a growth follows.
#[test]
#[ignore = "the soak runs for an hour: cargo xtask soak --duration 1h"]
fn soak() {
    use rand::{RngExt, SeedableRng, rngs::StdRng};
    let _one = serial();
    let duration = Duration::from_secs(env_or("LB_SOAK_SECS", 600));
    let step = Duration::from_secs(env_or("LB_SOAK_STEP_SECS", 20));
    let seed: u64 = env_or("LB_SOAK_SEED", now_us());
    eprintln!("soak: {duration:?}, an action every {step:?}, seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let variant = variant_object();
    let mut s = ApiSite::new(3);
    let pods: Vec<usize> = (0..3).collect();
    s.put_service(web_service(&[IpFamily::V4]));
    s.put_slice(web_slice(&s.site, "web", IpFamily::V4, &pods));
    const CHURNED: usize = 20;
    let pod_ips: Vec<String> = pods.iter().map(|p| s.site.pod_ip(*p)).collect();
    let churned_slice = |i: usize, rng: &mut StdRng| {
        let mut sl = slice("rel", &format!("churn{i}"), &format!("churn{i}-1"));
        for (p, ip) in pod_ips.iter().enumerate() {
            if rng.random_bool(0.6) || p == i % 3 {
                sl = sl.endpoint(ip, NODE, State::Ready);
            }
        }
        sl.port("http", "TCP", 8080)
    };
    for i in 0..CHURNED {
        s.put_service(
            service("rel", &format!("churn{i}"))
                .cluster_ip(&format!("10.96.70.{}", i + 1))
                .port("http", "TCP", 80, 8080),
        );
        s.put_slice(churned_slice(i, &mut rng));
    }
    let mut agent = s.agent(&[]);
    let mut generation = 1;
    let loads = web_loads(&s.site, IpFamily::V4, true);

    const CYCLE: [&str; 15] = [
        "endpoint churn",
        "Services created and deleted",
        "API server restart",
        "endpoint churn",
        "Services created and deleted",
        "etcd restart",
        "endpoint churn",
        "Services created and deleted",
        "agent restart (SIGTERM)",
        "endpoint churn",
        "Services created and deleted",
        "agent upgrade or downgrade",
        "endpoint churn",
        "Services created and deleted",
        "agent kill -9",
    ];
    let cycle: Vec<&str> = match std::env::var("LB_SOAK_ACTIONS") {
        Ok(list) => {
            let wanted: Vec<&str> = list.split(',').map(str::trim).filter(|a| !a.is_empty()).collect();
            for a in &wanted {
                assert!(
                    CYCLE.contains(a),
                    "LB_SOAK_ACTIONS: no action {a:?} (the cycle: {CYCLE:?})"
                );
            }
            CYCLE.iter().copied().filter(|k| wanted.contains(k)).collect()
        }
        Err(_) => CYCLE.to_vec(),
    };
    assert!(!cycle.is_empty(), "LB_SOAK_ACTIONS names no action");
    eprintln!("soak: actions {cycle:?}");
    let mut done: BTreeMap<&str, u64> = BTreeMap::new();
    let mut created: std::collections::VecDeque<usize> = Default::default();
    let mut next_created = 0usize;
    let mut upgraded = false;
    let mut samples = Vec::new();
    let started = Instant::now();
    let mut next_sample = started;
    let last_lifetime_from = duration.mul_f64(0.7);
    let mut last_lifetime_start: Option<usize> = None;
    let mut action = 0usize;
    // The actions since the previous sample: a step in the memory figures next to what caused it.
    let mut since_sample: Vec<&str> = Vec::new();
    while started.elapsed() < duration {
        let kind = cycle[action % cycle.len()];
        action += 1;
        // The last stretch keeps one agent: its restarts become steps that only hold the load.
        let kind = if kind.starts_with("agent") && started.elapsed() >= last_lifetime_from {
            "hold"
        } else {
            kind
        };
        match kind {
            "hold" => {}
            "endpoint churn" => {
                for i in 0..CHURNED {
                    s.put_slice(churned_slice(i, &mut rng));
                }
            }
            "Services created and deleted" => {
                for _ in 0..5 {
                    let n = next_created;
                    next_created += 1;
                    s.put_service(
                        service("rel", &format!("new{n}"))
                            .cluster_ip(&format!("10.96.{}.{}", 80 + (n / 250) % 20, n % 250 + 1))
                            .port("http", "TCP", 80, 8080),
                    );
                    s.put_slice(
                        slice("rel", &format!("new{n}"), &format!("new{n}-1"))
                            .endpoint(&pod_ips[n % 3], NODE, State::Ready)
                            .port("http", "TCP", 8080),
                    );
                    created.push_back(n);
                }
                while created.len() > 50 {
                    let n = created.pop_front().unwrap();
                    s.delete_service(&format!("new{n}"));
                }
            }
            "API server restart" => {
                s.cp.stop_apiserver();
                std::thread::sleep(Duration::from_secs(5));
                s.cp.start_apiserver().expect("kube-apiserver restarts");
            }
            "etcd restart" => s.cp.restart_etcd().expect("etcd restarts"),
            "agent restart (SIGTERM)" => {
                assert!(agent.stop().success());
                agent = s.agent(&[]);
                generation += 1;
            }
            "agent upgrade or downgrade" => {
                assert!(agent.stop().success());
                upgraded = !upgraded;
                agent = if upgraded {
                    s.agent(&[
                        "--bpf-object",
                        variant.to_str().unwrap(),
                        "--bpf-lb-service-map-max",
                        "300000",
                    ])
                } else {
                    s.agent(&[])
                };
                generation += 1;
            }
            "agent kill -9" => {
                drop(agent);
                agent = s.agent(&[]);
                generation += 1;
            }
            other => unreachable!("{other}"),
        }
        if kind != "hold" {
            *done.entry(kind).or_default() += 1;
            since_sample.push(kind);
        }
        let until = Instant::now() + step;
        while Instant::now() < until && started.elapsed() < duration {
            if Instant::now() >= next_sample {
                next_sample += Duration::from_secs(30);
                let (rss_kib, fds) = process_usage(agent.pid());
                let m = metric_values(&s.site);
                let entries = |map: &str| {
                    m.get(&format!("lb_map_entries{{map=\"{map}\"}}"))
                        .copied()
                        .unwrap_or(0.0) as u64
                };
                let gc: f64 = m
                    .iter()
                    .filter(|(k, _)| k.starts_with("lb_conntrack_gc_deleted_total"))
                    .map(|(_, v)| v)
                    .sum();
                if started.elapsed() >= last_lifetime_from && last_lifetime_start.is_none() {
                    last_lifetime_start = Some(samples.len());
                }
                // The agent's heap: a leak grows what it holds, allocator retention what it keeps
                // free (`lb_agent_heap_bytes`).
                let heap_kib = |state: &str| {
                    m.get(&format!("lb_agent_heap_bytes{{state=\"{state}\"}}"))
                        .map(|b| (b / 1024.0) as u64)
                };
                samples.push(json!({
                    "t_s": started.elapsed().as_secs(),
                    "agent": generation,
                    "rss_kib": rss_kib,
                    "heap_in_use_kib": heap_kib("in_use"),
                    "heap_free_kib": heap_kib("free"),
                    "actions": std::mem::take(&mut since_sample).join("; "),
                    "fds": fds,
                    "lb4_services": entries("lb4_services"),
                    "lb4_backends": entries("lb4_backends"),
                    "lb4_revnat": entries("lb4_revnat"),
                    "lb4_ct": entries("lb4_ct"),
                    "lb4_ct_new": entries("lb4_ct_new"),
                    "lb_aff_match": entries("lb_aff_match"),
                    "gc_deleted_total": gc as u64,
                }));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let tally = stop_loads(loads);
    drop(agent);

    // Growth over the last stretch, one agent throughout: its first sample a minute in against
    // its last.
    let last: Vec<&Value> = samples[last_lifetime_start.unwrap_or(samples.len().saturating_sub(2))..]
        .iter()
        .filter(|v| v["agent"] == samples.last().map_or(json!(0), |l| l["agent"].clone()))
        .collect();
    let (first, end) = (last.get(2).or(last.first()).copied(), last.last().copied());
    let grew = |key: &str| -> Value {
        match (first, end) {
            (Some(a), Some(b)) => json!({
                "from": a[key],
                "to": b[key],
                "over_s": b["t_s"].as_u64().unwrap_or(0).saturating_sub(a["t_s"].as_u64().unwrap_or(0)),
            }),
            _ => Value::Null,
        }
    };
    let figures = json!({
        "scenario": format!(
            "Soak of {}s (seed {seed}): steady TCP and UDP load on the web Service through both paths, an action every {}s",
            duration.as_secs(),
            step.as_secs()
        ),
        "load": tally.rows,
        "attempted": tally.attempted,
        "failed": tally.failed,
        "actions": done.iter().map(|(k, n)| json!({"action": k, "times": n})).collect::<Vec<_>>(),
        "last_agent_rss_kib": grew("rss_kib"),
        "last_agent_heap_in_use_kib": grew("heap_in_use_kib"),
        "last_agent_heap_free_kib": grew("heap_free_kib"),
        "last_agent_fds": grew("fds"),
        "last_agent_lb4_ct": grew("lb4_ct"),
        "last_agent_lb4_ct_new": grew("lb4_ct_new"),
        "samples": samples,
    });
    let dir = workspace_bin("lb-agent").ancestors().nth(2).unwrap().join("soak");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("soak.json"),
        serde_json::to_string_pretty(&figures).unwrap(),
    )
    .unwrap();
    assert_eq!(
        tally.failed, 0,
        "no request may fail during the soak: {:#?}",
        tally.failures
    );
    if let (Some(a), Some(b)) = (first, end) {
        let (rss_a, rss_b) = (a["rss_kib"].as_u64().unwrap(), b["rss_kib"].as_u64().unwrap());
        assert!(
            rss_b <= rss_a + rss_a / 4 + 8 * 1024,
            "the agent's memory grew from {rss_a} KiB to {rss_b} KiB over the last stretch"
        );
        let (fds_a, fds_b) = (a["fds"].as_u64().unwrap(), b["fds"].as_u64().unwrap());
        assert!(
            fds_b <= fds_a + 8,
            "the agent's descriptors grew from {fds_a} to {fds_b}"
        );
    }
}

/// Scenario 9's flood: from an attacker namespace on the LAN, TCP SYNs and UDP datagrams with
/// random sources (198.18.0.0/15, routed back through the attacker, which drops the replies as
/// an unreachable spoofed network does) to the node's NodePorts.
const FLOOD_SOURCES: &str = "198.18.0.0/15";

/// One flood sender: (what, NodePort, proto, packets).
const FLOODS: [(&str, u16, &str, u64); 3] = [
    ("TCP SYNs to the web NodePort", 30090, "tcp", 300_000),
    ("TCP SYNs to the sticky NodePort", 30091, "tcp", 100_000),
    ("UDP datagrams to the dns NodePort", 30053, "udp", 100_000),
];
/// The flood's bounds: each sender stops after its packets or this long, whichever comes first,
/// at this rate (the three together stay within what this 2-core VM forwards, so that what a
/// legitimate client sees is the proxy's doing, not a starved CPU's).
const FLOOD_SECONDS: u64 = 12;
const FLOOD_PPS: [u64; 3] = [25_000, 8_000, 8_000];
/// Before the flood, after it.
const CALM_SECONDS: u64 = 4;
const RECOVERY_SECONDS: u64 = 8;
/// An idle established connection exchanges a message this often (a keepalive-like client).
const IDLE_INTERVAL_MS: u64 = 4_000;
/// How long an established connection's exchange may wait for its reply during the flood before
/// it counts as broken. One CI run saw an idle connection's exchange wait over 2 s (the earlier
/// limit) as the flood started, at the default sizes: a stall TCP recovers from, not lost state.
const FLOOD_READ_TIMEOUT_MS: u64 = 10_000;

/// The legitimate loads during a flood phase: new TCP connections to the web NodePort, UDP
/// requests (a fresh socket each) to the dns NodePort, and new TCP connections to the sticky
/// (ClientIP affinity) NodePort, all from the external client.
fn flood_loads(site: &Site) -> Loads {
    vec![
        (
            "new TCP connections to the web NodePort",
            Load::start(
                site.external(),
                &site.node_port(IpFamily::V4, 30090),
                "tcp",
                20,
                false,
            ),
        ),
        (
            "UDP requests to the dns NodePort",
            Load::start(
                site.external(),
                &site.node_port(IpFamily::V4, 30053),
                "udp",
                50,
                false,
            ),
        ),
        (
            "new TCP connections to the sticky NodePort",
            Load::start(
                site.external(),
                &site.node_port(IpFamily::V4, 30091),
                "tcp",
                100,
                false,
            ),
        ),
    ]
}

/// Results of `results` started within [from_us, to_us): attempted, failed, slow.
fn window(results: &[Value], from_us: u64, to_us: u64) -> Value {
    let inside: Vec<Value> = results
        .iter()
        .filter(|r| r["t_us"].as_u64().is_some_and(|t| t >= from_us && t < to_us))
        .cloned()
        .collect();
    let (attempted, failed) = tally(&inside);
    json!({"attempted": attempted, "failed": failed, "slow (> 1 s)": lb_tests::load::slow(&inside)})
}

/// What the proxy under test exposes of its state during the flood.
trait FloodedProxy {
    /// Flow-state entries now (conntrack), and session-affinity entries now.
    fn state(&self) -> Value;
    /// Its drop and eviction counters now (what they count differs by proxy; diffs are reported).
    fn counters(&self) -> BTreeMap<String, u64>;
    /// The flow state it holds now for the client's connection `client` (address:port), to
    /// explain a broken one; null where it has none to show.
    fn flow_entries(&self, _client: &str) -> Value {
        Value::Null
    }
}

/// lb-agent's view: the entries of `lb4_ct` and `lb4_affinity`, and its data-path counters.
struct AgentFlooded<'a> {
    site: &'a Site,
}

/// The entries of a pinned hash map (one BPF_MAP_GET_NEXT_KEY per entry).
fn hash_entries<K: aya::Pod, V: aya::Pod>(pin: &Path) -> u64 {
    let data = aya::maps::MapData::from_pin(pin).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
    let map = aya::maps::Map::LruHashMap(data);
    let hash = aya::maps::HashMap::<_, K, V>::try_from(map).expect("a hash map");
    hash.keys().filter(Result::is_ok).count() as u64
}

impl FloodedProxy for AgentFlooded<'_> {
    fn state(&self) -> Value {
        let pin = |name: &str| {
            self.site
                .bpf_root()
                .join("maps")
                .join(catalog::pin_name(name).to_string())
        };
        json!({
            "conntrack entries": hash_entries::<lb_common::conntrack::Ct4Key, lb_common::conntrack::Ct4Value>(&pin(catalog::CONNTRACK)),
            "new-flow conntrack entries": hash_entries::<lb_common::conntrack::Ct4Key, lb_common::conntrack::Ct4Value>(&pin(catalog::CONNTRACK_NEW)),
            "affinity entries": hash_entries::<lb_common::affinity::AffinityKey<lb_common::family::V4>, lb_common::affinity::AffinityValue>(&pin(catalog::AFFINITY)),
        })
    }

    /// Every entry of both conntrack tables with the client's address and port on either side
    /// of its key or as its NAT target: a flow is whole when its forward, SNAT and un-SNAT
    /// entries are all in one table.
    fn flow_entries(&self, client: &str) -> Value {
        let Ok(client) = client.parse::<std::net::SocketAddrV4>() else {
            return Value::Null;
        };
        // Keys hold addresses as on the wire, ports in host order.
        let (addr, port) = (client.ip().octets(), client.port());
        let mut found = Vec::new();
        for table in [catalog::CONNTRACK, catalog::CONNTRACK_NEW] {
            let pin = self
                .site
                .bpf_root()
                .join("maps")
                .join(catalog::pin_name(table).to_string());
            let Ok(data) = aya::maps::MapData::from_pin(&pin) else {
                continue;
            };
            let Ok(hash) = aya::maps::HashMap::<
                _,
                lb_common::conntrack::Ct4Key,
                lb_common::conntrack::Ct4Value,
            >::try_from(aya::maps::Map::LruHashMap(data)) else {
                continue;
            };
            // The programs' clock (CLOCK_MONOTONIC, as bpf_ktime_get_ns).
            let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
                .map_or(0, |t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64);
            for (k, v) in hash.iter().filter_map(Result::ok) {
                // An unconnected UDP socket knows only its port (0.0.0.0:port): any address.
                let mentions = |a: [u8; 4], p: u16| (a == addr || addr == [0; 4]) && p == port;
                if mentions(k.saddr, k.sport)
                    || mentions(k.daddr, k.dport)
                    || mentions(v.nat_addr, v.nat_port)
                {
                    let sock = |a: [u8; 4], p: u16| format!("{}:{p}", std::net::Ipv4Addr::from(a));
                    found.push(json!({
                        "table": table,
                        "key": format!("{} -> {} proto {} dir {}", sock(k.saddr, k.sport), sock(k.daddr, k.dport), k.proto, k.dir),
                        "nat": sock(v.nat_addr, v.nat_port),
                        "flags": format!("{:#06x}", v.flags),
                        "age_s": now.saturating_sub(v.created_ns) as f64 / 1e9,
                        "created_ns": v.created_ns,
                    }));
                }
            }
        }
        found.into()
    }

    fn counters(&self) -> BTreeMap<String, u64> {
        let stats =
            lb_tests::agent::inspect(&self.site.bpf_root(), "stats").unwrap_or_else(|e| panic!("{e}"));
        stats
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| Some((k.clone(), v.as_u64()?)))
            .collect()
    }
}

/// kube-proxy's view: the node namespace's nf_conntrack (entries, and the per-CPU statistics
/// summed) and its `recent` lists (ClientIP affinity, one list per endpoint).
struct KubeProxyFlooded<'a> {
    site: &'a Site,
}

impl KubeProxyFlooded<'_> {
    fn read(&self, path: &str) -> String {
        self.site.node.ns.exec_ok("cat", &[path])
    }
}

impl FloodedProxy for KubeProxyFlooded<'_> {
    fn state(&self) -> Value {
        let lists = self
            .site
            .node
            .ns
            .exec_ok("sh", &["-c", "cat /proc/net/xt_recent/* 2>/dev/null | wc -l"]);
        json!({
            "conntrack entries": self.read("/proc/sys/net/netfilter/nf_conntrack_count").trim().parse::<u64>().unwrap_or(0),
            "affinity entries": lists.trim().parse::<u64>().unwrap_or(0),
        })
    }

    fn counters(&self) -> BTreeMap<String, u64> {
        // /proc/net/stat/nf_conntrack: a header of names, then one line of hex values per CPU.
        let text = self.read("/proc/net/stat/nf_conntrack");
        let mut lines = text.lines();
        let names: Vec<&str> = lines.next().unwrap_or_default().split_whitespace().collect();
        let mut sums = BTreeMap::new();
        for line in lines {
            for (name, value) in names.iter().zip(line.split_whitespace()) {
                if *name == "entries" {
                    continue;
                }
                *sums.entry(format!("nf_conntrack_{name}")).or_insert(0) +=
                    u64::from_str_radix(value, 16).unwrap_or(0);
            }
        }
        sums
    }
}

/// One proxy's run of the flood: established connections (active and idle) and legitimate
/// loads across calm, flood and recovery; the flood's senders; state and counters.
fn flood_phase(site: &Site, attacker: &NetNs, proxy: &dyn FloodedProxy) -> Value {
    let nodeport = site.node_port(IpFamily::V4, 30090);
    let hold_for = CALM_SECONDS + FLOOD_SECONDS + RECOVERY_SECONDS + 2;
    // A connection is broken when its state is gone (reset, closed) or an exchange waits
    // FLOOD_READ_TIMEOUT_MS: TCP retransmits through a stall, and how long the longest exchange
    // took is reported, not asserted.
    let held = |interval_ms| Established {
        holds: vec![Holds::open_every(
            site.external(),
            &nodeport,
            6,
            hold_for,
            interval_ms,
            FLOOD_READ_TIMEOUT_MS,
        )],
    };
    let (active, idle) = (held(50), held(IDLE_INTERVAL_MS));
    let loads = flood_loads(site);
    let counters_before = proxy.counters();
    std::thread::sleep(Duration::from_secs(CALM_SECONDS));

    let flood_from = now_us();
    let node_ip = site.node.ip.expect("the node's LAN address");
    let senders: Vec<(&str, Proc)> = FLOODS
        .iter()
        .zip(FLOOD_PPS)
        .enumerate()
        .map(|(i, ((what, port, proto, count), pps))| {
            let mut cmd = Command::new(workspace_bin("lb-probe"));
            cmd.args(["flood", "--to", &format!("{node_ip}:{port}"), "--proto", proto])
                .args(["--sources", FLOOD_SOURCES, "--count", &count.to_string()])
                .args(["--seconds", &FLOOD_SECONDS.to_string(), "--pps", &pps.to_string()])
                .args(["--seed", &(i + 1).to_string()])
                .stdout(std::process::Stdio::piped());
            Place::netns(attacker).apply(&mut cmd);
            (*what, Proc::spawn_command(cmd))
        })
        .collect();
    let mut flood = serde_json::Map::new();
    for (what, mut sender) in senders {
        let line = sender.wait_for_line(Duration::from_secs(FLOOD_SECONDS + 30), |l| {
            l.contains("\"sent\"")
        });
        flood.insert(what.into(), serde_json::from_str(&line).unwrap_or(json!(line)));
    }
    let flood_to = now_us();
    let state_at_flood_end = proxy.state();
    let counters_at_flood_end = proxy.counters();
    std::thread::sleep(Duration::from_secs(RECOVERY_SECONDS));
    let recovered_to = now_us();
    let state_after = proxy.state();
    let counters_after = proxy.counters();

    // The broken connections' flow state, before the GC frees it.
    let verdicts = [active.verdict(), idle.verdict()].map(|v| {
        let mut v = v.json();
        for failure in v["failures"].as_array_mut().into_iter().flatten() {
            if let Some(local) = failure["local"].as_str().map(str::to_string) {
                failure["entries"] = proxy.flow_entries(&local);
            }
        }
        v
    });
    let [active, idle] = verdicts;
    let tally = stop_loads(loads);
    let diff = |a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>| -> Value {
        b.iter()
            .filter_map(|(k, v)| {
                let d = v.saturating_sub(*a.get(k).unwrap_or(&0));
                (d > 0).then(|| (k.clone(), json!(d)))
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let windows: Vec<Value> = tally
        .results
        .iter()
        .map(|(what, results)| {
            let mut after = window(results, flood_to, recovered_to);
            // A request lost after the flood (none may be): when, how, and the flow state the
            // proxy holds for its client socket, to tell a lost entry from a slow machine.
            after["failures"] = results
                .iter()
                .filter(|r| r["ok"] != true)
                .filter_map(|r| {
                    let t = r["t_us"]
                        .as_u64()
                        .filter(|t| (flood_to..recovered_to).contains(t))?;
                    let entries = r["local"].as_str().map_or(Value::Null, |l| proxy.flow_entries(l));
                    Some(json!({
                        "after the flood's end (ms)": (t - flood_to) / 1000,
                        "took (ms)": r["elapsed_us"].as_u64().unwrap_or(0) / 1000,
                        "error": r["error"],
                        "local": r["local"],
                        "flow entries": entries,
                    }))
                })
                .collect::<Vec<_>>()
                .into();
            json!({
                "load": what,
                "before": window(results, 0, flood_from),
                "during": window(results, flood_from, flood_to),
                "after": after,
            })
        })
        .collect();
    // A ClientIP-affinity client keeps its backend across the flood, or the flood pushed it out.
    let sticky_backends = tally.servers("new TCP connections to the sticky NodePort");
    json!({
        "flood": flood,
        "flood_seconds": (flood_to - flood_from) as f64 / 1e6,
        "flood_from_us": flood_from,
        "established, active (a message every 50 ms)": active,
        "established, idle (a message every 4 s)": idle,
        "new connections": windows,
        "sticky client's backends": sticky_backends,
        "state at the flood's end": state_at_flood_end,
        "state after recovery": state_after,
        "counters during the flood": diff(&counters_before, &counters_at_flood_end),
        "counters during recovery": diff(&counters_at_flood_end, &counters_after),
    })
}

/// Each broken connection of a flood run's `kind` of held connections: how and when (against the
/// flood's start), then what the client's kernel (TCP_INFO) and the proxy's conntrack tables
/// showed of it, one line each.
fn broken_connections(run: &Value, kind: &str) -> Vec<(String, Vec<String>)> {
    let from = run["flood_from_us"].as_u64().unwrap_or(0) as f64;
    run[format!("established, {kind}")]["failures"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| {
            let at = f["at_us"].as_u64().map_or(String::new(), |at| {
                format!(" at {:+.1} s", (at as f64 - from) / 1e6)
            });
            let how = format!("{}{at}", f["error"].as_str().unwrap_or("?"));
            let mut detail = vec![format!("  from {}; TCP {}", f["local"], f["tcp_info"])];
            detail.extend(
                f["entries"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| format!("  {e}")),
            );
            (how, detail)
        })
        .collect()
}

/// The second lb-agent run of the flood: conntrack tables the flood fills.
const SMALL_TABLES: [&str; 4] = ["--bpf-ct-map-max", "65536", "--bpf-ct-new-map-max", "16384"];
const SMALL_NEW_FLOW_TABLE: u64 = 16_384;
const SMALL_TABLES_RUN: &str = "lb-agent, --bpf-ct-map-max 65536 --bpf-ct-new-map-max 16384";

/// Issue 18's flood from outside: lb-agent, then kube-proxy (iptables mode, nf_conntrack) on the
/// same node, the same Services and the same flood, both at their default table sizes
/// (`--bpf-ct-map-max` 262,144; nf_conntrack_max is global and read-only in a namespace, 262,144
/// on this VM), each from a clean start.
#[test]
fn flood_from_outside_keeps_established_flows() {
    let _one = serial();
    lb_tests::report::started("10-flood", "A flood of spoofed SYNs and UDP from outside");
    let s = ApiSite::new(3);
    let pods: Vec<String> = (0..3).map(|i| s.site.pod_ip(i)).collect();
    let (attacker, attacker_ip) = external_client(&s.site.lan, 2);
    s.site
        .node
        .ns
        .ip(&["route", "add", FLOOD_SOURCES, "via", &attacker_ip.to_string()]);
    s.put_service(
        service("rel", "web")
            .cluster_ip("10.96.50.10")
            .port("http", "TCP", 80, 8080)
            .node_port(30090)
            .port("dns", "UDP", 53, 5353)
            .node_port(30053),
    );
    s.put_service(
        service("rel", "sticky")
            .cluster_ip("10.96.50.20")
            .port("http", "TCP", 80, 8080)
            .node_port(30091)
            .client_ip_affinity(10800),
    );
    for name in ["web", "sticky"] {
        let mut sl = slice("rel", name, &format!("{name}-1"));
        for p in &pods {
            sl = sl.endpoint(p, NODE, State::Ready);
        }
        s.put_slice(sl.port("http", "TCP", 8080).port("dns", "UDP", 5353));
    }
    let nodeport = s.site.node_port(IpFamily::V4, 30090);
    let sticky = s.site.node_port(IpFamily::V4, 30091);

    // lb-agent at its default sizes, then with conntrack maps a quarter of that (65,536 entries
    // for established flows, 16,384 for new ones), which the flood fills: there LRU eviction, not
    // the masquerade ports, bounds it. Before new flows had a table of their own, that eviction
    // took idle established connections (6 of 6 at `--bpf-ct-map-max 65536`).
    let mut ours = Vec::new();
    for extra in [&[][..], &SMALL_TABLES[..]] {
        let mut flags = vec!["--conntrack-gc-interval", "2s"];
        flags.extend(extra);
        let agent = s.agent(&flags);
        converge("lb-agent serving", Duration::from_secs(20), || {
            serves(s.site.external(), &nodeport, &pods)
                && probe::tcp(s.site.external(), &sticky, 1)[0]["ok"] == true
        });
        let mut figures = flood_phase(&s.site, &attacker, &AgentFlooded { site: &s.site });
        figures["extra flags"] = json!(flags);
        ours.push(figures);
        drop(agent);
        s.site.cleanup();
    }

    let mut kube_proxy_cmd = Command::new(&s.cp.binaries().kube_proxy);
    let kube_proxy_flags = [
        format!("--kubeconfig={}", s.cp.kubeconfig_path().display()),
        "--proxy-mode=iptables".into(),
        format!("--hostname-override={NODE}"),
        format!("--cluster-cidr={CLUSTER_CIDR}"),
        // nf_conntrack_max is global: a namespace may not set it.
        "--conntrack-max-per-core=0".into(),
        "--metrics-bind-address=127.0.0.1:10249".into(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
    ];
    kube_proxy_cmd
        .args(&kube_proxy_flags)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    Place::netns(&s.site.node.ns).apply(&mut kube_proxy_cmd);
    let kube_proxy = Proc::spawn_command(kube_proxy_cmd);
    converge("kube-proxy serving", Duration::from_secs(60), || {
        serves(s.site.external(), &nodeport, &pods)
            && probe::tcp(s.site.external(), &sticky, 1)[0]["ok"] == true
    });
    let theirs = flood_phase(&s.site, &attacker, &KubeProxyFlooded { site: &s.site });
    kube_proxy.signal(libc::SIGTERM);
    drop(kube_proxy);

    // The figures as docs/reliability.md renders them: one table row per proxy run.
    let runs = [
        ("lb-agent", &ours[0]),
        (SMALL_TABLES_RUN, &ours[1]),
        ("kube-proxy iptables", &theirs),
    ];
    // How each broke, against the flood's start: a read timeout (errno 11: no reply within
    // FLOOD_READ_TIMEOUT_MS) is lost packets or an overloaded node; a reset or a close is state
    // the flood took.
    let held = |v: &Value, kind: &str| -> String {
        let h = &v[format!("established, {kind}")];
        let longest = format!("; longest exchange {} ms", h["longest_exchange_ms"]);
        let how: Vec<String> = broken_connections(v, kind)
            .into_iter()
            .map(|(how, _)| how)
            .collect();
        let mut text = format!("{} of {} broken", h["broken"], h["connections"]);
        if !how.is_empty() {
            text.push_str(&format!(" ({})", how.join("; ")));
        }
        text + &longest
    };
    let phases: Vec<Value> = runs
        .iter()
        .map(|(proxy, v)| {
            let sent: u64 = v["flood"]
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(_, f)| f["sent"].as_u64())
                .sum();
            json!({
                "proxy": proxy,
                "flood packets sent": sent,
                "established, active (a message every 50 ms)": held(v, "active (a message every 50 ms)"),
                "established, idle (a message every 4 s)": held(v, "idle (a message every 4 s)"),
                "sticky client's backends": v["sticky client's backends"].as_array().map_or(0, Vec::len),
                "state at the flood's end": v["state at the flood's end"],
                "state 8 s later": v["state after recovery"],
            })
        })
        .collect();
    let new_connections: Vec<Value> = runs
        .iter()
        .flat_map(|(proxy, v)| {
            v["new connections"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |mut row| {
                    row["proxy"] = json!(proxy);
                    row
                })
        })
        .collect();
    let counters: Vec<Value> = runs
        .iter()
        .map(|(proxy, v)| {
            json!({
                "proxy": proxy,
                "during the flood": v["counters during the flood"],
                "during recovery": v["counters during recovery"],
            })
        })
        .collect();
    // The summary row: lb-agent at its default sizes, the configuration operators run.
    let default_run = &ours[0];
    let (mut attempted, mut failed) = (0, 0);
    for row in default_run["new connections"].as_array().into_iter().flatten() {
        for w in ["before", "during", "after"] {
            attempted += row[w]["attempted"].as_u64().unwrap_or(0);
            failed += row[w]["failed"].as_u64().unwrap_or(0);
        }
    }
    let established = |field: &str| -> u64 {
        ["active (a message every 50 ms)", "idle (a message every 4 s)"]
            .iter()
            .map(|kind| {
                default_run[format!("established, {kind}")][field]
                    .as_u64()
                    .unwrap_or(0)
            })
            .sum()
    };
    let figures = json!({
        "scenario": "A flood of spoofed TCP SYNs and UDP from outside to NodePorts (lb-agent at its default sizes; then with conntrack tables the flood fills; then kube-proxy iptables on nf_conntrack)",
        "attempted": attempted,
        "failed": failed,
        "established": {"broken": established("broken"), "moved_backend": established("moved_backend")},
        "flood": format!(
            "from {FLOOD_SOURCES} (random addresses and ports), for {FLOOD_SECONDS} s at most, from a namespace on the LAN: {}",
            FLOODS.iter().zip(FLOOD_PPS).map(|((what, _, _, count), pps)| format!("{what} ({count} at most, {pps}/s)")).collect::<Vec<_>>().join(", ")
        ),
        "windows": format!("new connections are counted {CALM_SECONDS} s before the flood, during it, and {RECOVERY_SECONDS} s after it"),
        "runs": phases,
        "new connections": new_connections,
        "counters": counters,
        "nf_conntrack_max": s.site.node.ns.exec_ok("cat", &["/proc/sys/net/netfilter/nf_conntrack_max"]).trim(),
        "kube-proxy flags (besides --kubeconfig)": kube_proxy_flags[1..],
    });
    eprintln!(
        "10-flood details: {}",
        json!({"lb-agent": ours[0], SMALL_TABLES_RUN: ours[1], "kube-proxy iptables": theirs})
    );
    record("10-flood", figures.clone());
    // Established connections, active or idle, survive the flood at the default sizes: the
    // flood's flows never get past their handshake, so they live and are evicted in the new-flow
    // table only. Broken means reset, closed, or no reply within FLOOD_READ_TIMEOUT_MS; a stall
    // is reported (the longest exchange), not asserted. The small tables' run is reported, not
    // asserted: it lost none in a quiet run (6 of 6 idle connections before the new-flow table
    // existed), but 1 active and 2 idle connections in one fresh-clone CI run, then with a 2 s
    // limit, before the failure's kind was recorded.
    for kind in ["active (a message every 50 ms)", "idle (a message every 4 s)"] {
        let held = &default_run[format!("established, {kind}")];
        // How each broke first, then what the client's kernel and the conntrack tables showed of
        // it (CI shows a failure's first lines), then everything.
        let how: Vec<String> = broken_connections(default_run, kind)
            .into_iter()
            .flat_map(|(how, detail)| std::iter::once(how).chain(detail))
            .collect();
        assert_eq!(
            (held["broken"].as_u64(), held["moved_backend"].as_u64()),
            (Some(0), Some(0)),
            "{kind} established connections survive the flood at the default sizes:\n{}\n{figures:#}",
            how.join("\n")
        );
    }
    for phase in &ours {
        // The flood did fill something: the masquerade ports towards a backend (ports of
        // unfinished handshakes and of silent UDP flows are then taken back) or the new-flow
        // table (then LRU eviction frees them).
        let reclaimed = phase["counters during the flood"]["tc_snat_port_reclaimed"]
            .as_u64()
            .unwrap_or(0);
        let new_flows = phase["state at the flood's end"]["new-flow conntrack entries"]
            .as_u64()
            .unwrap_or(0);
        let capacity = if phase["extra flags"].to_string().contains("--bpf-ct-new-map-max") {
            SMALL_NEW_FLOW_TABLE
        } else {
            u64::from(catalog::capacity::CONNTRACK_NEW)
        };
        assert!(
            reclaimed > 0 || new_flows * 10 >= capacity * 9,
            "the flood exhausted the masquerade ports or filled the new-flow table ({}): {figures:#}",
            phase["extra flags"]
        );
    }
    for row in default_run["new connections"].as_array().into_iter().flatten() {
        let (during, after) = (&row["during"], &row["after"]);
        let share = |w: &Value| {
            w["failed"].as_u64().unwrap_or(0) as f64 / w["attempted"].as_u64().unwrap_or(0).max(1) as f64
        };
        assert!(
            share(during) <= 0.1 && after["failed"] == 0,
            "{}: legitimate new connections are served during the flood (at most 10% lost) and after it (none lost); lost after it: {:#}\n{figures:#}",
            row["load"],
            after["failures"]
        );
    }
}
