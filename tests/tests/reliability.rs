//! Reliability scenarios, each under continuous load and each reporting its figures to
//! `target/reliability/<scenario>.json` (from which `cargo xtask test` writes docs/reliability.md):
//!
//! 1. agent restart (graceful stop, then kill -9): no failed connection, established connections
//!    survive on their backends, ids stable;
//! 2. upgrade: a new object (the test variant of the programs) and new map capacities replace the
//!    running data path in place: links kept, programs swapped, maps migrated, no failure;
//! 3. 30 s of API unavailability with changes made meanwhile: the data path keeps serving, and
//!    the agent converges when the API comes back;
//! 4. endpoint churn: no new connection reaches an endpoint after its removal was applied; UDP
//!    flows move off removed backends; programming latency is reported;
//! 6. map pressure: a full map skips whole Services (Event, metric) and they appear once there is
//!    room again.
//!
//! Scenarios run one at a time (they measure; running them together would measure contention).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
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
use lb_agent::apply::{KernelMaps, MapOps};
use lb_tests::{
    agent::{Agent, AgentOptions, bpf_root_in},
    bpffs::BpfFs,
    cgroup::Cgroup,
    control_plane::ControlPlane,
    fixtures::{self, State, service, slice, write_manifests},
    load::{Load, tally},
    netns::{NetNs, PortForward},
    probe,
    process::{Place, Proc, workspace_bin},
    require_root,
    topo::{Lan, Node as TopoNode, external_client},
};
use serde_json::{Value, json};

const NODE: &str = "node-a";

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

/// A node with pods on a LAN with an external client; servers on every pod.
struct Site {
    _servers: Vec<Proc>,
    client: (NetNs, Ipv4Addr),
    node: TopoNode,
    _lan: Lan,
    cgroup: Cgroup,
    bpffs: BpfFs,
}

impl Site {
    fn new(pods: u8) -> Site {
        require_root();
        let bpffs = BpfFs::new();
        let cgroup = Cgroup::new("lbrel");
        let lan = Lan::new();
        let mut node = TopoNode::new(1);
        node.attach_lan(&lan);
        for n in 0..pods {
            node.add_pod(n + 2);
        }
        let client = external_client(&lan, 1);
        let servers = node
            .pods
            .iter()
            .map(|p| {
                probe::server(
                    Place::netns(&p.ns),
                    &p.ip.to_string(),
                    &["0.0.0.0:8080"],
                    &["0.0.0.0:5353"],
                )
            })
            .collect();
        Site {
            _servers: servers,
            client,
            node,
            _lan: lan,
            cgroup,
            bpffs,
        }
    }

    fn pod_ip(&self, i: usize) -> String {
        self.node.pods[i].ip.to_string()
    }

    fn host(&self) -> Place<'_> {
        Place::new(&self.node.ns, &self.cgroup)
    }

    fn external(&self) -> Place<'_> {
        Place::netns(&self.client.0)
    }

    fn bpf_root(&self) -> PathBuf {
        bpf_root_in(self.bpffs.path())
    }

    fn agent(&self, manifests: Option<PathBuf>, kubeconfig: Option<PathBuf>, extra: &[&str]) -> Agent {
        let mut extra_args = vec!["--cluster-cidr".to_string(), "10.244.0.0/16".into()];
        extra_args.extend(extra.iter().map(|s| s.to_string()));
        Agent::start(AgentOptions {
            netns: &self.node.ns,
            cgroup: &self.cgroup,
            bpf_root: self.bpf_root(),
            node_name: NODE.into(),
            manifests,
            kubeconfig,
            extra_args,
        })
    }

    /// `lb-agent services -o json` and `backends -o json`: ids by frontend and by backend.
    fn ids(&self) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
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
        let out = Command::new("bpftool")
            .args(["-j", "link", "show"])
            .output()
            .unwrap();
        let links: Value = serde_json::from_slice(&out.stdout).unwrap_or(json!([]));
        let ours: BTreeSet<u64> = std::fs::read_dir(self.bpf_root().join("links"))
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|d| std::fs::read_dir(d.path()).into_iter().flatten().flatten())
            .filter_map(|f| {
                let out = Command::new("bpftool")
                    .args(["-j", "link", "show", "pinned"])
                    .arg(f.path())
                    .output()
                    .ok()?;
                serde_json::from_slice::<Value>(&out.stdout).ok()?["id"].as_u64()
            })
            .collect();
        links
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| {
                let id = l["id"].as_u64()?;
                ours.contains(&id)
                    .then(|| (id, l["prog_id"].as_u64().unwrap_or(0)))
            })
            .collect()
    }
}

fn web_manifests(site: &Site, dir: &std::path::Path, pods: &[usize]) {
    let mut sl = slice("rel", "web", "web-1");
    for i in pods {
        sl = sl.endpoint(&site.pod_ip(*i), NODE, State::Ready);
    }
    write_manifests(
        dir,
        "objects.yaml",
        &[service("rel", "web")
            .cluster_ip("10.96.50.10")
            .port("http", "TCP", 80, 8080)
            .node_port(30090)
            .port("dns", "UDP", 53, 5353)
            .node_port(30053)
            .build()],
        &[sl.port("http", "TCP", 8080).port("dns", "UDP", 5353).build()],
    );
}

/// Long-lived connections, each recording every exchange's server.
struct Holds(Vec<Proc>);

impl Holds {
    fn open(place: Place<'_>, to: &str, n: usize, seconds: u64) -> Holds {
        Holds(
            (0..n)
                .map(|_| {
                    let mut h = probe::hold(place, to, seconds);
                    h.wait_for_line(Duration::from_secs(5), |l| l.contains("\"seq\""));
                    h
                })
                .collect(),
        )
    }

    /// (exchanges, broken connections, connections that changed backend).
    fn verdict(mut self) -> (usize, usize, usize) {
        let (mut exchanges, mut broken, mut moved) = (0, 0, 0);
        for h in &mut self.0 {
            h.wait_for_line(Duration::from_secs(120), |l| {
                l.contains("\"done\"") || l.contains("\"ok\":false")
            });
            let lines = h.stdout_lines();
            if lines.iter().any(|l| l.contains("\"ok\":false")) {
                broken += 1;
            }
            let servers: BTreeSet<String> = lines
                .iter()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter_map(|v| {
                    v.pointer("/reply/server")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
                .collect();
            exchanges += lines.iter().filter(|l| l.contains("\"seq\"")).count();
            if servers.len() > 1 {
                moved += 1;
            }
        }
        (exchanges, broken, moved)
    }
}

#[test]
fn restart_under_load_loses_nothing() {
    let _one = serial();
    let site = Site::new(3);
    let manifests = tempfile::tempdir().unwrap();
    web_manifests(&site, manifests.path(), &[0, 1, 2]);
    let agent = site.agent(Some(manifests.path().into()), None, &[]);
    let node_ip = site.node.ip.unwrap();
    let np = format!("{node_ip}:30090");
    let loads = [
        (
            "socket path, TCP to the cluster IP",
            Load::start(site.host(), "10.96.50.10:80", "tcp", 10, false),
        ),
        (
            "socket path, UDP to the cluster IP",
            Load::start(site.host(), "10.96.50.10:53", "udp", 10, false),
        ),
        (
            "tc path, TCP to the NodePort",
            Load::start(site.external(), &np, "tcp", 10, false),
        ),
        (
            "tc path, UDP flow to the NodePort",
            Load::start(site.external(), &format!("{node_ip}:30053"), "udp", 10, true),
        ),
    ];
    let holds_sock = Holds::open(site.host(), "10.96.50.10:80", 3, 14);
    let holds_tc = Holds::open(site.external(), &np, 3, 14);
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
    let (ex_s, broken_s, moved_s) = holds_sock.verdict();
    let (ex_t, broken_t, moved_t) = holds_tc.verdict();
    drop(agent);
    record(
        "1-restart",
        json!({
            "scenario": "Agent restart under load: SIGTERM + start, then kill -9 + start",
            "load": per_load,
            "established": {"connections": 6, "exchanges": ex_s + ex_t, "broken": broken_s + broken_t, "moved_backend": moved_s + moved_t},
            "attempted": attempted,
            "failed": failed,
            "ids_stable": ids_before == ids_after_restart && ids_before == ids_after_kill,
        }),
    );
    assert_eq!(failed, 0, "no connection may fail across restarts: {failures:#?}");
    assert_eq!(
        (broken_s + broken_t, moved_s + moved_t),
        (0, 0),
        "established connections survive on their backends"
    );
    assert_eq!(
        ids_before, ids_after_restart,
        "ids stable across a graceful restart"
    );
    assert_eq!(ids_before, ids_after_kill, "ids stable across kill -9");
}

#[test]
fn upgrade_swaps_programs_and_migrates_maps_under_load() {
    let _one = serial();
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
    let site = Site::new(3);
    let manifests = tempfile::tempdir().unwrap();
    web_manifests(&site, manifests.path(), &[0, 1, 2]);
    let agent = site.agent(Some(manifests.path().into()), None, &[]);
    let node_ip = site.node.ip.unwrap();
    let np = format!("{node_ip}:30090");
    let loads = [
        (
            "socket path, TCP to the cluster IP",
            Load::start(site.host(), "10.96.50.10:80", "tcp", 10, false),
        ),
        (
            "tc path, TCP to the NodePort",
            Load::start(site.external(), &np, "tcp", 10, false),
        ),
    ];
    let holds = Holds::open(site.external(), &np, 3, 12);
    std::thread::sleep(Duration::from_secs(1));
    let links_before = site.links();
    let ids_before = site.ids();
    let services_capacity = |root: &PathBuf| -> u64 {
        let out = Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(root.join("maps/lb4_services"))
            .output()
            .unwrap();
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["max_entries"]
            .as_u64()
            .unwrap()
    };
    let capacity_before = services_capacity(&site.bpf_root());

    // The new agent: another object (the test variant) and a bigger services map.
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
    let capacity_after = services_capacity(&site.bpf_root());
    let variant_hits = KernelMaps::from_pins(&site.bpf_root().join("maps"))
        .unwrap()
        .counter(lb_common::stats::Counter::TestVariant as u32);

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
    let (exchanges, broken, moved) = holds.verdict();
    let log = upgraded.log();
    drop(upgraded);
    let same_links = links_before.keys().collect::<Vec<_>>() == links_after.keys().collect::<Vec<_>>();
    let all_swapped = links_before
        .iter()
        .all(|(link, prog)| links_after.get(link).is_some_and(|p| p != prog));
    record(
        "2-upgrade",
        json!({
            "scenario": "Upgrade under load: new eBPF programs (test variant) swapped into the pinned links; services map migrated to a new capacity",
            "load": per_load,
            "established": {"connections": 3, "exchanges": exchanges, "broken": broken, "moved_backend": moved},
            "attempted": attempted,
            "failed": failed,
            "links": links_before.len(),
            "links_kept": same_links,
            "programs_replaced": all_swapped,
            "services_map_capacity": {"before": capacity_before, "after": capacity_after},
            "new_program_ran": variant_hits > 0,
            "ids_stable": ids_before == ids_after,
        }),
    );
    assert!(
        log.contains("migrating the map"),
        "the capacity change is a migration:\n{log}"
    );
    assert_eq!(capacity_after, 300_000);
    assert!(
        same_links && all_swapped,
        "links kept, programs replaced: {links_before:?} -> {links_after:?}"
    );
    assert!(variant_hits > 0, "the new programs run");
    assert_eq!(
        failed, 0,
        "no connection may fail during the upgrade: {failures:#?}"
    );
    assert_eq!((broken, moved), (0, 0));
    assert_eq!(ids_before, ids_after);
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
    fn new(pods: u8) -> ApiSite {
        let site = Site::new(pods);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let cp = ControlPlane::start().expect("control plane");
        let client = rt.block_on(cp.client()).unwrap();
        let api: SocketAddr = cp.server_url().trim_start_matches("https://").parse().unwrap();
        let forward = PortForward::start(&site.node.ns, api, api);
        let node_ip = site.node.ip.unwrap();
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
                addresses: Some(vec![NodeAddress {
                    type_: "InternalIP".into(),
                    address: node_ip.to_string(),
                }]),
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

    fn delete_service(&self, name: &str) {
        let api: Api<Service> = Api::namespaced(self.client.clone(), "rel");
        let _ = self.rt.block_on(api.delete(name, &DeleteParams::default()));
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

#[test]
fn endpoint_churn_never_sends_new_connections_to_removed_endpoints() {
    let _one = serial();
    let s = ApiSite::new(6);
    let pods: Vec<String> = (0..6).map(|i| s.site.pod_ip(i)).collect();
    let _agent = s.agent(&[]);
    let set = |members: &[usize]| {
        let mut b = slice("rel", "web", "web-1");
        for i in members {
            b = b.endpoint(&pods[*i], NODE, State::Ready);
        }
        s.put_slice(b.port("http", "TCP", 8080).port("dns", "UDP", 5353));
    };
    s.put_service(
        service("rel", "web")
            .cluster_ip("10.96.50.10")
            .port("http", "TCP", 80, 8080)
            .node_port(30090)
            .port("dns", "UDP", 53, 5353)
            .node_port(30053),
    );
    set(&[0, 1]);
    converge("serving", Duration::from_secs(15), || {
        serves(
            s.site.host(),
            "10.96.50.10:80",
            &[pods[0].clone(), pods[1].clone()],
        )
    });

    // Watch the applied backend set through the pinned maps (every ~1 ms). The watcher may be
    // descheduled for a while on a busy machine, so each change is kept with the interval in which
    // it must have happened (see `Observed`), never with a single instant.
    let applied: Arc<Mutex<Vec<Observed>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (applied, stop, maps_dir) = (applied.clone(), stop.clone(), s.site.bpf_root().join("maps"));
        std::thread::spawn(move || {
            let maps = KernelMaps::from_pins(&maps_dir).unwrap();
            let mut last: Option<BTreeSet<String>> = None;
            let mut previous_start = now_us();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let start = now_us();
                let snap = maps.snapshot().unwrap();
                let end = now_us();
                // Backends of the TCP cluster IP frontend's slots.
                let current: BTreeSet<String> = snap
                    .services
                    .iter()
                    .filter(|(k, _)| k.addr == [10, 96, 50, 10] && k.port == 80 && k.slot > 0)
                    .filter_map(|(_, v)| {
                        snap.backends
                            .get(&v.backend_id)
                            .map(|b| Ipv4Addr::from(b.addr).to_string())
                    })
                    .collect();
                if last.as_ref() != Some(&current) {
                    let from_us = if last.is_none() { start } else { previous_start };
                    applied.lock().unwrap().push(Observed {
                        from_us,
                        seen_us: end,
                        set: current.clone(),
                    });
                    last = Some(current);
                }
                previous_start = start;
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    // The loads start only once the watcher has dated the first set: a connection made before
    // its first snapshot could not be judged against any applied set.
    let first_seen = Instant::now();
    while applied.lock().unwrap().is_empty() {
        assert!(
            first_seen.elapsed() < Duration::from_secs(10),
            "the map watcher took no snapshot in 10 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let node_ip = s.site.node.ip.unwrap();
    let tcp = Load::start(s.site.host(), "10.96.50.10:80", "tcp", 2, false);
    let udp_sock = Load::start(s.site.host(), "10.96.50.10:53", "udp", 20, true);
    let udp_tc = Load::start(s.site.external(), &format!("{node_ip}:30053"), "udp", 20, true);

    // Churn: every 250 ms one endpoint is replaced by another, for 20 s.
    let mut members = vec![0usize, 1];
    let mut writes: Vec<(u64, BTreeSet<String>)> = Vec::new();
    let churn_until = Instant::now() + Duration::from_secs(20);
    let mut next = 2;
    while Instant::now() < churn_until {
        members.remove(0);
        members.push(next % 6);
        next += 1;
        if members[0] == members[1] {
            members[1] = (members[1] + 1) % 6;
        }
        writes.push((now_us(), members.iter().map(|i| pods[*i].clone()).collect()));
        set(&members);
        std::thread::sleep(Duration::from_millis(250));
    }
    std::thread::sleep(Duration::from_secs(1));
    let tcp_results = tcp.stop();
    let udp_sock_results = udp_sock.stop();
    let udp_tc_results = udp_tc.stop();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    watcher.join().unwrap();
    let applied = std::mem::take(&mut *applied.lock().unwrap());

    // A connection started at t and done after `elapsed_us` chose its backend in between: it may
    // use a backend only if some applied set containing it can have been in the maps at some
    // moment of that window. `before` widens the window backwards: how long a client may act on
    // what it chose earlier (a UDP flow notices at its next datagram).
    let present = |server: &str, r: &Value, before: u64| -> bool {
        let (Some(t), Some(elapsed)) = (r["t_us"].as_u64(), r["elapsed_us"].as_u64()) else {
            return false;
        };
        lifetimes(&applied)
            .any(|(lo, hi, set)| set.contains(server) && lo <= t + elapsed && hi >= t.saturating_sub(before))
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
    let violations: Vec<String> = tcp_results
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
    let mut latencies: Vec<f64> = writes
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
    let (tcp_a, tcp_f) = tally(&tcp_results);
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
    let (us_a, us_f) = tally(&udp_sock_results);
    let (ut_a, ut_f) = tally(&udp_tc_results);
    let udp_sock_servers: BTreeSet<String> = udp_sock_results
        .iter()
        .filter_map(|r| {
            r.pointer("/reply/server")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .collect();
    let udp_tc_servers: BTreeSet<String> = udp_tc_results
        .iter()
        .filter_map(|r| {
            r.pointer("/reply/server")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .collect();
    record(
        "4-endpoint-churn",
        json!({
            "scenario": "Endpoint churn: one of two endpoints replaced every 250 ms for 20 s",
            "changes": writes.len(),
            "load": [
                {"load": "socket path, TCP every 2 ms", "attempted": tcp_a, "failed": tcp_f},
                {"load": "socket path, one UDP socket, every 20 ms", "attempted": us_a, "failed": us_f, "backends_seen": udp_sock_servers.len(), "answers_from_removed_backends": stale_udp(&udp_sock_results)},
                {"load": "tc path, one UDP flow, every 20 ms", "attempted": ut_a, "failed": ut_f, "backends_seen": udp_tc_servers.len(), "answers_from_removed_backends": stale_udp(&udp_tc_results)},
            ],
            "attempted": tcp_a + us_a + ut_a,
            "failed": tcp_f + us_f + ut_f,
            "new_connections_to_removed_endpoints": violations.len(),
            // How precisely the map watcher dated the changes (its polling gaps, scheduling).
            "watcher_uncertainty_ms_max": applied.iter().skip(1).map(|o| (o.seen_us - o.from_us) as f64 / 1000.0).fold(0.0, f64::max),
            "programming_latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": latencies.last().copied().unwrap_or(f64::NAN), "samples": latencies.len()},
        }),
    );
    assert!(
        violations.is_empty(),
        "new connections reached removed endpoints: {violations:?}"
    );
    assert!(
        udp_sock_servers.len() > 1 && udp_tc_servers.len() > 1,
        "UDP flows moved off removed backends"
    );
    assert_eq!(
        stale_udp(&udp_tc_results),
        0,
        "a tc UDP flow never keeps a removed backend"
    );
}

#[test]
fn full_maps_skip_whole_services_and_recover() {
    let _one = serial();
    let s = ApiSite::new(2);
    let (p0, p1) = (s.site.pod_ip(0), s.site.pod_ip(1));
    // Each Service below takes 3 entries (a frontend and two slots), the API server's own
    // `kubernetes` Service (no endpoints here) takes 1: 19 entries hold it and 6 of the 8.
    let _agent = s.agent(&["--bpf-lb-service-map-max", "19"]);
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
    let metrics = |s: &ApiSite| {
        probe::http_get(Place::netns(&s.site.node.ns), "127.0.0.1:10249", "/metrics")["body"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    converge(
        "the map fills and the rest is reported",
        Duration::from_secs(20),
        || metrics(&s).contains("lb_services_skipped{reason=\"map_full\"} 2"),
    );
    let served: Vec<bool> = (0..8)
        .map(|i| probe::tcp(s.site.host(), &format!("10.96.60.{}:80", 10 + i), 1)[0]["ok"] == true)
        .collect();
    let events =
        s.cp.kubectl(["get", "events", "-n", "rel", "-o", "json"])
            .unwrap_or_default();
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
        "a MapFull Event names the skipped Services"
    );
}
