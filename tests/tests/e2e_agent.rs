//! End to end: the real lb-agent, fed by a real kube-apiserver and etcd, programs a node made of
//! network namespaces. Services and EndpointSlices are created through the API (selector-less,
//! with hand-made slices pointing at pod namespaces; there is no kubelet), and traffic from a pod
//! and from the host must follow every change within a bound. The API server is dual-stack
//! (`control_plane::SERVICE_CIDR6`): one test runs a dual-stack node and Services of both
//! families, through both data paths, over both families.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{
        core::v1::{Namespace, Node, NodeAddress, NodeStatus, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use lb_agent::family::IpFamily;
use lb_tests::{
    agent::{Agent, AgentOptions, bpf_root_in},
    bpffs::BpfFs,
    cgroup::Cgroup,
    control_plane::ControlPlane,
    fixtures::{self, State, service, slice},
    kernel,
    netns::PortForward,
    probe,
    process::{Place, Proc, workspace_bin},
    require_root,
    topo::{Lan, Node as TopoNode, external_client, ipv6_twin},
};
use serde_json::Value;

const NS: &str = "e2e";
const ECONNREFUSED: i64 = 111;
const EHOSTUNREACH: i64 = 113;
const NODE: &str = "node-a";
/// How long a change may take to reach the data path in these tests (the agent's own numbers are
/// measured by the benchmarks).
const CONVERGE: Duration = Duration::from_secs(15);
/// The pods' addresses (`topo`: `10.244.<node>.<n>`, and `fd00:10:244:<node>::<n>` on a
/// dual-stack node).
const CLUSTER_CIDR: &str = "10.244.0.0/16";
const CLUSTER_CIDR_DUAL: &str = "10.244.0.0/16,fd00:10:244::/48";

struct E2e {
    agent: Option<Agent>,
    _servers: Vec<Proc>,
    _forward: PortForward,
    node: TopoNode,
    lan: Lan,
    cgroup: Cgroup,
    bpffs: BpfFs,
    client: kube::Client,
    cp: ControlPlane,
    rt: tokio::runtime::Runtime,
}

impl E2e {
    /// An IPv4 node.
    fn new() -> E2e {
        E2e::with_node(TopoNode::new(1))
    }

    /// A dual-stack node: pods and LAN address of both families, a Node object with an
    /// InternalIP of each.
    fn dual_stack() -> E2e {
        E2e::with_node(TopoNode::dual_stack(1))
    }

    fn with_node(mut node: TopoNode) -> E2e {
        require_root();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let cp = ControlPlane::start().expect("control plane");
        let client = rt.block_on(cp.client()).expect("client");
        let bpffs = BpfFs::new();
        let cgroup = Cgroup::new("lbe2e");
        let lan = Lan::new();
        node.attach_lan(&lan);
        for n in 2..5 {
            node.add_pod(n);
        }
        let servers = node
            .pods
            .iter()
            .map(|p| {
                // On the pod's own address(es): an answer then names the family and the address
                // the call reached, and IPv4 clients show as IPv4 (a dual-stack wildcard socket
                // would show them IPv4-mapped).
                let addrs: Vec<IpAddr> = [Some(IpAddr::from(p.ip)), p.ip6.map(IpAddr::from)]
                    .into_iter()
                    .flatten()
                    .collect();
                let on = |ports: &[u16]| -> Vec<String> {
                    ports
                        .iter()
                        .flat_map(|port| {
                            addrs
                                .iter()
                                .map(move |ip| SocketAddr::new(*ip, *port).to_string())
                        })
                        .collect()
                };
                let (tcp, udp) = (on(&[8080, 8081]), on(&[5353]));
                probe::server(
                    Place::netns(&p.ns),
                    &p.ip.to_string(),
                    &tcp.iter().map(String::as_str).collect::<Vec<_>>(),
                    &udp.iter().map(String::as_str).collect::<Vec<_>>(),
                )
            })
            .collect();
        // The Node object's InternalIPs: one per family of the node, IPv4 first.
        let node_ips: Vec<IpAddr> = [IpFamily::V4, IpFamily::V6]
            .into_iter()
            .filter_map(|family| node.addr(family))
            .collect();
        // The agent runs in the node's namespace and reaches the API server on "its" loopback.
        let api: SocketAddr = cp
            .server_url()
            .trim_start_matches("https://")
            .parse()
            .expect("api address");
        let forward = PortForward::start(&node.ns, api, api);
        let e = E2e {
            agent: None,
            _servers: servers,
            _forward: forward,
            node,
            lan,
            cgroup,
            bpffs,
            client,
            cp,
            rt,
        };
        e.rt.block_on(async {
            let namespaces: Api<Namespace> = Api::all(e.client.clone());
            namespaces
                .create(
                    &PostParams::default(),
                    &Namespace {
                        metadata: ObjectMeta {
                            name: Some(NS.into()),
                            ..Default::default()
                        },
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            let nodes: Api<Node> = Api::all(e.client.clone());
            let mut n = Node {
                metadata: ObjectMeta {
                    name: Some(NODE.into()),
                    labels: Some(BTreeMap::from([(
                        "topology.kubernetes.io/zone".to_string(),
                        "z1".to_string(),
                    )])),
                    ..Default::default()
                },
                ..Default::default()
            };
            nodes.create(&PostParams::default(), &n).await.unwrap();
            n.status = Some(NodeStatus {
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
            });
            nodes
                .patch_status(
                    NODE,
                    &PatchParams::default(),
                    &Patch::Merge(&serde_json::json!({"status": n.status})),
                )
                .await
                .unwrap();
        });
        e
    }

    fn start_agent(&mut self) {
        // One pod CIDR per family of the node, as kube-proxy's --cluster-cidr takes them.
        let cluster_cidr = if self.node.dual_stack {
            CLUSTER_CIDR_DUAL
        } else {
            CLUSTER_CIDR
        };
        self.agent = Some(Agent::start(AgentOptions {
            netns: &self.node.ns,
            cgroup: &self.cgroup,
            bpf_root: bpf_root_in(self.bpffs.path()),
            node_name: NODE.into(),
            manifests: None,
            kubeconfig: Some(self.cp.kubeconfig_path().to_path_buf()),
            extra_args: vec!["--cluster-cidr".into(), cluster_cidr.into()],
        }));
    }

    fn pod_ip(&self, i: usize) -> String {
        self.node.pods[i].ip.to_string()
    }

    fn host(&self) -> Place<'_> {
        Place::new(&self.node.ns, &self.cgroup)
    }

    fn pod(&self, i: usize) -> Place<'_> {
        Place::new(&self.node.pods[i].ns, &self.cgroup)
    }

    fn apply_service(&self, svc: Service) {
        let api: Api<Service> = Api::namespaced(self.client.clone(), NS);
        let name = svc.metadata.name.clone().unwrap();
        let mut svc = svc;
        svc.metadata.namespace = Some(NS.into());
        self.rt.block_on(async {
            match api.get_opt(&name).await.unwrap() {
                Some(old) => {
                    svc.metadata.resource_version = old.metadata.resource_version;
                    api.replace(&name, &PostParams::default(), &svc).await.unwrap();
                }
                None => {
                    api.create(&PostParams::default(), &svc).await.unwrap();
                }
            }
        });
    }

    fn apply_slice(&self, sl: EndpointSlice) {
        let api: Api<EndpointSlice> = Api::namespaced(self.client.clone(), NS);
        let name = sl.metadata.name.clone().unwrap();
        let mut sl = sl;
        sl.metadata.namespace = Some(NS.into());
        self.rt.block_on(async {
            match api.get_opt(&name).await.unwrap() {
                Some(old) => {
                    sl.metadata.resource_version = old.metadata.resource_version;
                    api.replace(&name, &PostParams::default(), &sl).await.unwrap();
                }
                None => {
                    api.create(&PostParams::default(), &sl).await.unwrap();
                }
            }
        });
    }

    fn delete_service(&self, name: &str) {
        let api: Api<Service> = Api::namespaced(self.client.clone(), NS);
        self.rt
            .block_on(api.delete(name, &DeleteParams::default()))
            .unwrap();
    }

    fn web_slice(&self, ready: &[usize], terminating: &[usize], not_ready: &[usize]) -> EndpointSlice {
        let mut s = slice(NS, "web", "web-1");
        for (list, state) in [
            (ready, State::Ready),
            (terminating, State::Terminating),
            (not_ready, State::NotReady),
        ] {
            for i in list {
                s = s.endpoint(&self.pod_ip(*i), NODE, state);
            }
        }
        s.port("http", "TCP", 8080).port("dns", "UDP", 5353).build()
    }
}

fn web(port: i32) -> fixtures::Svc {
    service(NS, "web")
        .cluster_ip("10.96.100.10")
        .port("http", "TCP", port, 8080)
        .node_port(30180)
        .port("dns", "UDP", 53, 5353)
        .node_port(30153)
}

/// Backends that answered, over `n` TCP connections (failures panic).
fn backends(place: Place<'_>, to: &str, n: u32) -> BTreeSet<String> {
    probe::tcp(place, to, n)
        .iter()
        .map(|r| {
            assert_eq!(r["ok"], true, "{to}: {r}");
            probe::server_of(r).unwrap().to_string()
        })
        .collect()
}

/// Polls until `check` holds; returns how long it took.
fn converge(what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !check() {
        assert!(
            started.elapsed() < CONVERGE,
            "{what}: not converged within {CONVERGE:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = started.elapsed();
    eprintln!("converged: {what} in {took:.2?}");
    took
}

fn reaches(place: Place<'_>, to: &str, expected: &[String]) -> bool {
    let results = probe::tcp(place, to, 12);
    let got: BTreeSet<String> = results
        .iter()
        .filter_map(|r| probe::server_of(r).map(str::to_string))
        .collect();
    results.iter().all(|r| r["ok"] == true) && got == expected.iter().cloned().collect()
}

#[test]
fn services_and_endpoints_follow_the_api() {
    let mut e = E2e::new();
    e.start_agent();
    let (p0, p1, p2) = (e.pod_ip(0), e.pod_ip(1), e.pod_ip(2));
    let node_ip = e.node.ip.unwrap();

    // Create: from a pod and from the host, to the cluster IP and the NodePort.
    e.apply_service(web(80).build());
    e.apply_slice(e.web_slice(&[0, 1], &[], &[]));
    converge("a new Service serves", || {
        reaches(e.host(), "10.96.100.10:80", &[p0.clone(), p1.clone()])
    });
    assert_eq!(
        backends(e.pod(2), "10.96.100.10:80", 12),
        [p0.clone(), p1.clone()].into()
    );
    assert_eq!(
        backends(e.host(), &format!("{node_ip}:30180"), 12),
        [p0.clone(), p1.clone()].into()
    );
    let udp = probe::udp(e.pod(2), "10.96.100.10:53", 3, false);
    assert!(
        udp.iter()
            .all(|r| r["ok"] == true && r["from"] == "10.96.100.10:53"),
        "{udp:?}"
    );

    // Update the port: the new one serves, the old one is gone.
    e.apply_service(web(81).build());
    converge("the new port serves", || {
        reaches(e.host(), "10.96.100.10:81", &[p0.clone(), p1.clone()])
    });
    // kube-proxy's cluster-ips-check: the old port is one no Service has, refused at once.
    let errno = |place: Place<'_>, to: &str| probe::tcp(place, to, 1)[0]["errno"].as_i64();
    let (refused, unreachable) = (
        kernel::refused_with(ECONNREFUSED),
        kernel::refused_with(EHOSTUNREACH),
    );
    converge(
        "the old port is gone (refused, as by kube-proxy's cluster-ips-check)",
        || errno(e.host(), "10.96.100.10:80") == Some(refused),
    );

    // Scale up, then down.
    e.apply_slice(e.web_slice(&[0, 1, 2], &[], &[]));
    converge("scaled up to three", || {
        reaches(e.host(), "10.96.100.10:81", &[p0.clone(), p1.clone(), p2.clone()])
    });
    e.apply_slice(e.web_slice(&[2], &[], &[]));
    converge("scaled down to one", || {
        reaches(e.host(), "10.96.100.10:81", std::slice::from_ref(&p2))
    });

    // Terminating: with no ready endpoint, serving+terminating ones take new connections.
    e.apply_slice(e.web_slice(&[], &[2], &[0]));
    converge("terminating fallback", || {
        reaches(e.pod(1), "10.96.100.10:81", std::slice::from_ref(&p2))
    });
    e.apply_slice(e.web_slice(&[1], &[2], &[0]));
    converge("ready endpoints win again", || {
        reaches(e.pod(1), "10.96.100.10:81", std::slice::from_ref(&p1))
    });

    // The operator's view.
    let out = std::process::Command::new(workspace_bin("lb-agent"))
        .args(["services", "-o", "json", "--bpf-root"])
        .arg(bpf_root_in(e.bpffs.path()))
        .output()
        .unwrap();
    let services: Value = serde_json::from_slice(&out.stdout).expect("services JSON");
    let web_rows: Vec<&Value> = services
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["service"] == "e2e/web:http")
        .collect();
    assert!(
        web_rows
            .iter()
            .any(|r| r["frontend"] == "10.96.100.10:81/TCP" && r["type"] == "ClusterIP"),
        "{services}"
    );
    assert!(
        web_rows
            .iter()
            .any(|r| r["frontend"] == format!("{node_ip}:30180/TCP") && r["type"] == "NodePort"),
        "{services}"
    );

    // Delete: the cluster IP is not translated any more; it is an unallocated address of the API
    // server's ServiceCIDR (its default object, from --service-cluster-ip-range), which fails
    // at once.
    e.delete_service("web");
    converge(
        "a deleted Service's address is unallocated (EHOSTUNREACH)",
        || errno(e.host(), "10.96.100.10:81") == Some(unreachable),
    );
    assert_eq!(
        errno(e.pod(1), "10.96.100.10:81"),
        Some(unreachable),
        "from a pod too"
    );
    // A ServiceCIDR created now is followed: its addresses are unallocated too; deleted, they are
    // no Service's business any more.
    let extra = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: e2e-extra}\nspec: {cidrs: [10.100.0.0/24]}\n";
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("servicecidr.yaml");
    std::fs::write(&manifest, extra).unwrap();
    e.cp.kubectl(["apply", "-f", manifest.to_str().unwrap()])
        .expect("kubectl apply ServiceCIDR");
    converge("a new ServiceCIDR's addresses are unallocated", || {
        errno(e.host(), "10.100.0.9:80") == Some(unreachable)
    });
    // A Service another proxy serves (kube-proxy's selector leaves it out): kube-proxy checks after
    // that proxy's DNAT, so its cluster IP is not refused here either.
    assert_eq!(
        errno(e.host(), "10.96.100.77:80"),
        Some(unreachable),
        "unallocated yet"
    );
    e.apply_service(
        service(NS, "delegated")
            .cluster_ip("10.96.100.77")
            .port("http", "TCP", 80, 8080)
            .label("service.kubernetes.io/service-proxy-name", "other-proxy")
            .build(),
    );
    converge("another proxy's Service is left to it", || {
        errno(e.host(), "10.96.100.77:80").is_some_and(|n| n != unreachable)
    });
    e.cp.kubectl(["delete", "servicecidr", "e2e-extra", "--wait=false"])
        .expect("kubectl delete ServiceCIDR");
    converge("a deleted ServiceCIDR is no Service range any more", || {
        errno(e.host(), "10.100.0.9:80").is_some_and(|n| n != unreachable)
    });
}

#[test]
fn restarts_and_api_outages_keep_traffic_flowing() {
    let mut e = E2e::new();
    e.start_agent();
    let (p0, p1, p2) = (e.pod_ip(0), e.pod_ip(1), e.pod_ip(2));
    e.apply_service(web(80).build());
    e.apply_slice(e.web_slice(&[0, 1], &[], &[]));
    converge("serving", || {
        reaches(e.host(), "10.96.100.10:80", &[p0.clone(), p1.clone()])
    });

    // kill -9 the agent: the pinned programs and maps keep serving while it is gone.
    let agent = e.agent.take().unwrap();
    unsafe { libc::kill(agent.pid() as i32, libc::SIGKILL) };
    drop(agent);
    assert_eq!(
        backends(e.host(), "10.96.100.10:80", 30),
        [p0.clone(), p1.clone()].into()
    );
    // A restarted agent adopts the maps (ids stable, nothing rewritten) and follows new changes.
    e.start_agent();
    let log = e.agent.as_ref().unwrap().log();
    assert!(
        log.contains("adopted ") && !log.contains("adopted 0 frontend"),
        "the restarted agent adopts the pinned state:\n{log}"
    );
    e.apply_slice(e.web_slice(&[0, 1, 2], &[], &[]));
    converge("a change after the restart", || {
        reaches(e.host(), "10.96.100.10:80", &[p0.clone(), p1.clone(), p2.clone()])
    });

    // The API server goes away for a while: the data path keeps serving the last state...
    e.cp.stop_apiserver();
    let until = Instant::now() + Duration::from_secs(5);
    let all: BTreeSet<String> = [p0.clone(), p1.clone(), p2.clone()].into();
    while Instant::now() < until {
        // Every connection succeeds and lands on one of the three.
        assert!(backends(e.pod(2), "10.96.100.10:80", 10).is_subset(&all));
    }
    // ... and changes made after it returns are applied.
    e.cp.start_apiserver().expect("apiserver restart");
    e.apply_slice(e.web_slice(&[2], &[], &[]));
    converge("a change after the API outage", || {
        reaches(e.host(), "10.96.100.10:80", std::slice::from_ref(&p2))
    });
    assert!(
        e.agent.as_mut().unwrap().running(),
        "the agent survived the outage"
    );
}

#[test]
fn health_metrics_events_and_health_check_node_ports() {
    let mut e = E2e::new();
    e.start_agent();
    let node_ip = e.node.ip.unwrap();
    // healthCheckNodePort is allocated for LoadBalancer Services with externalTrafficPolicy=Local.
    let local = service(NS, "local")
        .type_("LoadBalancer")
        .cluster_ip("10.96.100.20")
        .port("http", "TCP", 80, 8080)
        .node_port(30181)
        .external_traffic_policy("Local")
        .build();
    e.apply_service(local);
    let api: Api<Service> = Api::namespaced(e.client.clone(), NS);
    let hc_port =
        e.rt.block_on(api.get("local"))
            .unwrap()
            .spec
            .unwrap()
            .health_check_node_port
            .expect("healthCheckNodePort allocated");
    e.apply_slice(
        slice(NS, "local", "local-1")
            .endpoint(&e.pod_ip(0), NODE, State::Ready)
            .endpoint(&e.pod_ip(1), NODE, State::Ready)
            .port("http", "TCP", 8080)
            .build(),
    );
    converge("the Local Service serves", || {
        reaches(e.host(), "10.96.100.20:80", &[e.pod_ip(0), e.pod_ip(1)])
    });

    // kube-proxy's health check NodePort: 200 with the local endpoint count...
    let hc = format!("{node_ip}:{hc_port}");
    converge("health check NodePort answers 200", || {
        probe::http_get(Place::netns(&e.node.ns), &hc, "/")["status"] == 200
    });
    let r = probe::http_get(Place::netns(&e.node.ns), &hc, "/");
    let body: Value = serde_json::from_str(r["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["localEndpoints"], 2, "{body}");
    assert_eq!(body["service"]["name"], "local");
    // ... and 503 once no endpoint is on this node.
    e.apply_slice(
        slice(NS, "local", "local-1")
            .endpoint("10.244.9.9", "node-b", State::Ready)
            .port("http", "TCP", 8080)
            .build(),
    );
    converge("health check NodePort answers 503", || {
        probe::http_get(Place::netns(&e.node.ns), &hc, "/")["status"] == 503
    });

    // /healthz and /livez on :10256 with kube-proxy's JSON body.
    for path in ["/healthz", "/livez"] {
        let r = probe::http_get(Place::netns(&e.node.ns), "127.0.0.1:10256", path);
        assert_eq!(r["status"], 200, "{path}: {r}");
        let body: Value = serde_json::from_str(r["body"].as_str().unwrap()).unwrap();
        assert!(
            body["lastUpdated"].is_string() && body["currentTime"].is_string(),
            "{path}: {body}"
        );
    }

    // /metrics on 127.0.0.1:10249, with kube-proxy's names and ours.
    let r = probe::http_get(Place::netns(&e.node.ns), "127.0.0.1:10249", "/metrics");
    assert_eq!(r["status"], 200);
    let text = r["body"].as_str().unwrap();
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_network_programming_duration_seconds",
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "lb_map_entries{map=\"lb4_services\"}",
        "lb_datapath_events_total{event=\"sock_translated\"}",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}:\n{text}");
    }
    let translated: f64 = text
        .lines()
        .find(|l| l.starts_with("lb_datapath_events_total{event=\"sock_translated\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(translated > 0.0, "socket translations are counted");

    // Two Services claiming one external IP and port: one wins, the other is reported as an Event
    // on it, and everything else keeps serving.
    e.apply_service(
        service(NS, "claim-a")
            .cluster_ip("10.96.100.31")
            .port("http", "TCP", 80, 8080)
            .external_ips(&["198.51.100.77"])
            .build(),
    );
    e.apply_service(
        service(NS, "claim-b")
            .cluster_ip("10.96.100.32")
            .port("http", "TCP", 80, 8080)
            .external_ips(&["198.51.100.77"])
            .build(),
    );
    e.apply_slice(
        slice(NS, "claim-a", "claim-a-1")
            .endpoint(&e.pod_ip(0), NODE, State::Ready)
            .port("http", "TCP", 8080)
            .build(),
    );
    e.apply_slice(
        slice(NS, "claim-b", "claim-b-1")
            .endpoint(&e.pod_ip(1), NODE, State::Ready)
            .port("http", "TCP", 8080)
            .build(),
    );
    converge("an Event names the conflict", || {
        let out =
            e.cp.kubectl(["get", "events", "-n", NS, "-o", "json"])
                .unwrap_or_default();
        out.contains("198.51.100.77:80") && out.contains("claim-b")
    });
    converge("the winner serves the external IP", || {
        reaches(e.host(), "198.51.100.77:80", &[e.pod_ip(0)])
    });
    converge("the loser's cluster IP still serves", || {
        reaches(e.host(), "10.96.100.32:80", &[e.pod_ip(1)])
    });
}

/// `ip:port` as a socket address prints (and `lb-probe` reports) it: `[v6]:port` for IPv6.
fn at(ip: impl Into<IpAddr>, port: u16) -> String {
    SocketAddr::new(ip.into(), port).to_string()
}

/// The addresses the backends answered on over `n` TCP connections to `to` (which pod, and over
/// which family, each call reached), or the first failure.
fn answered_on(place: Place<'_>, to: &str, n: u32) -> Result<BTreeSet<IpAddr>, String> {
    probe::tcp(place, to, n)
        .iter()
        .map(|r| {
            r.pointer("/reply/local")
                .and_then(Value::as_str)
                .and_then(|local| local.parse::<SocketAddr>().ok())
                .map(|local| local.ip())
                .ok_or_else(|| format!("{to}: {r}"))
        })
        .collect()
}

/// Whether every call to `to` succeeds and exactly `expected` answer.
fn serves(place: Place<'_>, to: &str, expected: &BTreeSet<IpAddr>) -> bool {
    answered_on(place, to, 12).is_ok_and(|got| &got == expected)
}

/// Asserts that every call to `to` succeeds and lands on one of `expected`: a frontend a change
/// of the other family must not disturb.
fn undisturbed(place: Place<'_>, to: &str, expected: &BTreeSet<IpAddr>) {
    match answered_on(place, to, 6) {
        Ok(got) => assert!(
            got.is_subset(expected),
            "{to}: answered by {got:?}, not {expected:?}"
        ),
        Err(e) => panic!("{to} failed while the other family changed: {e}"),
    }
}

/// A long-lived TCP connection (`lb-probe hold`: an exchange every 50 ms for `seconds`), once its
/// first exchange succeeded.
fn held(place: Place<'_>, to: &str, seconds: u64) -> Proc {
    let mut hold = probe::hold(place, to, seconds);
    let first = hold.wait_for_line(Duration::from_secs(5), |l| l.contains("\"ok\""));
    assert!(first.contains("\"ok\":true"), "{to}: {first}");
    hold
}

/// Waits for the end of a [`held`] connection: every exchange succeeded.
fn held_throughout(mut hold: Proc, what: &str) {
    let last = hold.wait_for_line(Duration::from_secs(15), |l| {
        l.contains("\"done\"") || l.contains("\"ok\":false")
    });
    assert!(
        last.contains("\"done\""),
        "{what}: {last}\n{:?}",
        hold.stdout_lines()
    );
}

/// The RequireDualStack NodePort Service of [`dual_stack_services_follow_the_api_on_both_families`]:
/// a cluster IP of each family (IPv4 first, the cluster's primary), one nodePort per port.
fn dual_web() -> fixtures::Svc {
    service(NS, "dual")
        .cluster_ips(&["10.96.100.40", "fd00:10:96::40"])
        .port("http", "TCP", 80, 8080)
        .node_port(30190)
        .port("dns", "UDP", 53, 5353)
        .node_port(30191)
}

impl E2e {
    /// A process in pod `i`'s namespace outside the agent's cgroup: its connections are not
    /// translated at the socket, so they reach the node and its tc programs.
    fn pod_tc(&self, i: usize) -> Place<'_> {
        Place::netns(&self.node.pods[i].ns)
    }

    /// The addresses of `family` of `pods`.
    fn pod_addrs(&self, family: IpFamily, pods: &[usize]) -> BTreeSet<IpAddr> {
        pods.iter().map(|i| self.node.pods[*i].addr(family)).collect()
    }

    /// The EndpointSlice of `family` of Service `service` (ports http 8080 and dns 5353), with
    /// `pods` ready: the EndpointSlice controller writes one per family, named apart.
    fn slice_of(&self, service: &str, family: IpFamily, pods: &[usize]) -> EndpointSlice {
        let name = match family {
            IpFamily::V4 => format!("{service}-ipv4"),
            IpFamily::V6 => format!("{service}-ipv6"),
        };
        let mut s = slice(NS, service, &name);
        for addr in self.pod_addrs(family, pods) {
            s = s.endpoint(&addr.to_string(), NODE, State::Ready);
        }
        let sl = s.port("http", "TCP", 8080).port("dns", "UDP", 5353).build();
        let expected = match family {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        };
        assert_eq!(sl.address_type, expected, "a slice of {pods:?}");
        sl
    }
}

#[test]
fn dual_stack_services_follow_the_api_on_both_families() {
    let mut e = E2e::dual_stack();
    e.start_agent();
    let node4 = e.node.addr(IpFamily::V4).expect("on the LAN");
    let node6 = e.node.addr(IpFamily::V6).expect("dual-stack");
    // The external client of `topo` has an IPv4 address on the LAN only: its IPv6 twin beside it
    // (usable at once: no duplicate address detection).
    let (ext, ext_ip) = external_client(&e.lan, 1);
    ext.ip(&[
        "-6",
        "addr",
        "add",
        &format!("{}/64", ipv6_twin(ext_ip)),
        "dev",
        "eth0",
        "nodad",
    ]);
    let external = || Place::netns(&ext);
    let cluster_ip = |family: IpFamily| -> IpAddr {
        match family {
            IpFamily::V4 => "10.96.100.40".parse().unwrap(),
            IpFamily::V6 => "fd00:10:96::40".parse().unwrap(),
        }
    };
    let node_addr = |family: IpFamily| match family {
        IpFamily::V4 => node4,
        IpFamily::V6 => node6,
    };

    // A RequireDualStack NodePort Service with a slice per family, and an IPv6 single-stack
    // ClusterIP Service.
    e.apply_service(dual_web().build());
    e.apply_service(
        service(NS, "v6only")
            .cluster_ips(&["fd00:10:96::41"])
            .port("http", "TCP", 80, 8080)
            .build(),
    );
    e.apply_slice(e.slice_of("dual", IpFamily::V4, &[0, 1]));
    e.apply_slice(e.slice_of("dual", IpFamily::V6, &[0, 1]));
    e.apply_slice(e.slice_of("v6only", IpFamily::V6, &[2]));
    // The API server took both families (its --service-cluster-ip-range has one range each).
    let api: Api<Service> = Api::namespaced(e.client.clone(), NS);
    for (name, families) in [("dual", vec!["IPv4", "IPv6"]), ("v6only", vec!["IPv6"])] {
        let spec = e.rt.block_on(api.get(name)).unwrap().spec.unwrap();
        assert_eq!(
            spec.ip_families,
            Some(families.iter().map(|f| f.to_string()).collect()),
            "{name}"
        );
    }

    // Each family of the dual-stack Service: its cluster IP from the host (socket path) and from a
    // pod through tc, its NodePort on the node's address of the family from the external client
    // (tc, masqueraded to the node's address of the family); each reaches the pods over that
    // family.
    let both = [0, 1];
    for family in [IpFamily::V6, IpFamily::V4] {
        let want = e.pod_addrs(family, &both);
        let to = at(cluster_ip(family), 80);
        converge(&format!("{to} from the host (socket path)"), || {
            serves(e.host(), &to, &want)
        });
        converge(&format!("{to} from a pod through tc"), || {
            serves(e.pod_tc(2), &to, &want)
        });
        let node_port = at(node_addr(family), 30190);
        converge(&format!("NodePort {node_port} from the external client"), || {
            serves(external(), &node_port, &want)
        });
    }
    // The IPv6 tc flows as `lb-agent conntrack` shows them, held open meanwhile: a pod's, with its
    // own address, and the external client's, masqueraded as MASQUERADE would: with the address
    // of the interface it leaves by, the backend pod's veth, which carries the pod gateway's.
    let (v4, v6) = (at(cluster_ip(IpFamily::V4), 80), at(cluster_ip(IpFamily::V6), 80));
    let node_port6 = at(node6, 30190);
    let gateway6 = e.node.gateway_of(IpFamily::V6);
    let pod_flow = held(e.pod_tc(2), &v6, 1);
    let ext_flow = held(external(), &node_port6, 1);
    let flows = lb_tests::agent::inspect(&bpf_root_in(e.bpffs.path()), "conntrack")
        .unwrap_or_else(|err| panic!("{err}"));
    let client_prefix = |ip: IpAddr| format!("[{ip}]:");
    let pod2 = client_prefix(e.node.pods[2].addr(IpFamily::V6));
    let ext6 = client_prefix(ipv6_twin(ext_ip).into());
    let flow_rows = flows.as_array().expect("a JSON array");
    assert!(
        flow_rows.iter().any(|f| {
            f["client"].as_str().is_some_and(|c| c.starts_with(&pod2))
                && f["frontend"] == v6
                && f["masquerade"].is_null()
        }),
        "the pod's IPv6 flow through tc, not masqueraded: {flows}"
    );
    assert!(
        flow_rows.iter().any(|f| {
            f["client"].as_str().is_some_and(|c| c.starts_with(&ext6))
                && f["frontend"] == node_port6
                && f["masquerade"]
                    .as_str()
                    .is_some_and(|m| m.starts_with(&client_prefix(gateway6)))
        }),
        "the external client's IPv6 NodePort flow, masqueraded to {gateway6}: {flows}"
    );
    held_throughout(pod_flow, "a pod's IPv6 connection through tc");
    held_throughout(ext_flow, "the external client's IPv6 NodePort connection");
    // UDP over IPv6 from a pod's socket: the reply comes from the Service address (recvmsg6).
    let udp = probe::udp(e.pod(2), "[fd00:10:96::40]:53", 3, false);
    assert!(
        udp.iter()
            .all(|r| r["ok"] == true && r["from"] == "[fd00:10:96::40]:53"),
        "{udp:?}"
    );
    // The IPv6 single-stack Service, from the host and from a pod through tc.
    let v6only = e.pod_addrs(IpFamily::V6, &[2]);
    converge("the IPv6 single-stack Service from the host", || {
        serves(e.host(), "[fd00:10:96::41]:80", &v6only)
    });
    converge("the IPv6 single-stack Service from a pod through tc", || {
        serves(e.pod_tc(0), "[fd00:10:96::41]:80", &v6only)
    });

    // An endpoint removed from the IPv6 slice: IPv6 follows; IPv4 keeps both pods all along, new
    // connections and an established one through tc alike.
    let v4_both = e.pod_addrs(IpFamily::V4, &both);
    let v4_flow = held(e.pod_tc(2), &v4, 2);
    e.apply_slice(e.slice_of("dual", IpFamily::V6, &[1]));
    converge("an IPv6 endpoint removed", || {
        undisturbed(e.host(), &v4, &v4_both);
        serves(e.host(), &v6, &e.pod_addrs(IpFamily::V6, &[1]))
    });
    converge("IPv4 still has both endpoints", || {
        serves(e.host(), &v4, &v4_both)
    });
    held_throughout(v4_flow, "an IPv4 connection while the IPv6 slice changed");
    // An endpoint added to the IPv4 slice: IPv4 follows; IPv6 keeps its one pod all along.
    let v6_one = e.pod_addrs(IpFamily::V6, &[1]);
    let v6_flow = held(e.pod_tc(0), &v6, 2);
    e.apply_slice(e.slice_of("dual", IpFamily::V4, &[0, 1, 2]));
    converge("an IPv4 endpoint added", || {
        undisturbed(e.pod_tc(0), &v6, &v6_one);
        serves(e.host(), &v4, &e.pod_addrs(IpFamily::V4, &[0, 1, 2]))
    });
    held_throughout(v6_flow, "an IPv6 connection while the IPv4 slice changed");
    converge("the IPv6 NodePort follows its slice", || {
        serves(external(), &at(node6, 30190), &v6_one)
    });

    // The operator's view: both families' frontends, each with the backends of its family.
    let services = lb_tests::agent::inspect(&bpf_root_in(e.bpffs.path()), "services")
        .unwrap_or_else(|err| panic!("{err}"));
    let rows: Vec<&Value> = services.as_array().expect("a JSON array").iter().collect();
    let frontend = |service: &str, frontend: &str| -> Option<&Value> {
        rows.iter()
            .copied()
            .find(|r| r["service"] == service && r["frontend"] == frontend)
    };
    let backend_addrs = |row: &Value| -> BTreeSet<String> {
        row["scopes"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["backends"].as_array().into_iter().flatten())
            .filter_map(|b| b["address"].as_str().map(str::to_string))
            .collect()
    };
    let on_8080 = |family: IpFamily, pods: &[usize]| -> BTreeSet<String> {
        e.pod_addrs(family, pods)
            .into_iter()
            .map(|ip| at(ip, 8080))
            .collect()
    };
    for (front, kind, family, pods) in [
        (
            "10.96.100.40:80/TCP".to_string(),
            "ClusterIP",
            IpFamily::V4,
            &[0, 1, 2][..],
        ),
        (
            format!("{node4}:30190/TCP"),
            "NodePort",
            IpFamily::V4,
            &[0, 1, 2][..],
        ),
        (
            "[fd00:10:96::40]:80/TCP".to_string(),
            "ClusterIP",
            IpFamily::V6,
            &[1][..],
        ),
        (format!("[{node6}]:30190/TCP"), "NodePort", IpFamily::V6, &[1][..]),
    ] {
        let row = frontend("e2e/dual:http", &front).unwrap_or_else(|| panic!("no {front} row: {services}"));
        assert_eq!(row["type"], kind, "{row}");
        assert_eq!(backend_addrs(row), on_8080(family, pods), "{row}");
    }
    assert!(
        frontend("e2e/dual:dns", "[fd00:10:96::40]:53/UDP").is_some(),
        "{services}"
    );
    let v6only_rows: Vec<&&Value> = rows
        .iter()
        .filter(|r| r["service"] == "e2e/v6only:http")
        .collect();
    assert_eq!(
        v6only_rows
            .iter()
            .map(|r| r["frontend"].clone())
            .collect::<Vec<_>>(),
        vec![Value::from("[fd00:10:96::41]:80/TCP")],
        "the IPv6 single-stack Service has its IPv6 frontend only: {services}"
    );

    // Deleting the IPv6 single-stack Service leaves the dual-stack one serving on both families.
    e.delete_service("v6only");
    converge("a deleted IPv6 Service is gone", || {
        probe::tcp(e.host(), "[fd00:10:96::41]:80", 1)[0]["ok"] == false
    });
    undisturbed(e.host(), &v6, &v6_one);
    undisturbed(e.host(), &v4, &e.pod_addrs(IpFamily::V4, &[0, 1, 2]));
}
