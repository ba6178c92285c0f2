//! End to end: the real lb-agent, fed by a real kube-apiserver and etcd, programs a node made of
//! network namespaces. Services and EndpointSlices are created through the API (selector-less,
//! with hand-made slices pointing at pod namespaces; there is no kubelet), and traffic from a pod
//! and from the host must follow every change within a bound.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
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
use lb_tests::{
    agent::{Agent, AgentOptions, bpf_root_in},
    bpffs::BpfFs,
    cgroup::Cgroup,
    control_plane::ControlPlane,
    fixtures::{self, State, service, slice},
    netns::PortForward,
    probe,
    process::{Place, Proc, workspace_bin},
    require_root,
    topo::{Lan, Node as TopoNode},
};
use serde_json::Value;

const NS: &str = "e2e";
const NODE: &str = "node-a";
/// How long a change may take to reach the data path in these tests (the agent's own numbers are
/// measured by the benchmarks).
const CONVERGE: Duration = Duration::from_secs(15);

struct E2e {
    agent: Option<Agent>,
    _servers: Vec<Proc>,
    _forward: PortForward,
    node: TopoNode,
    _lan: Lan,
    cgroup: Cgroup,
    bpffs: BpfFs,
    client: kube::Client,
    cp: ControlPlane,
    rt: tokio::runtime::Runtime,
}

impl E2e {
    fn new() -> E2e {
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
        let mut node = TopoNode::new(1);
        let node_ip = node.attach_lan(&lan);
        for n in 2..5 {
            node.add_pod(n);
        }
        let servers = node
            .pods
            .iter()
            .map(|p| {
                probe::server(
                    Place::netns(&p.ns),
                    &p.ip.to_string(),
                    &["0.0.0.0:8080", "0.0.0.0:8081"],
                    &["0.0.0.0:5353"],
                )
            })
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
            _lan: lan,
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
                addresses: Some(vec![NodeAddress {
                    type_: "InternalIP".into(),
                    address: node_ip.to_string(),
                }]),
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
        self.agent = Some(Agent::start(AgentOptions {
            netns: &self.node.ns,
            cgroup: &self.cgroup,
            bpf_root: bpf_root_in(self.bpffs.path()),
            node_name: NODE.into(),
            manifests: None,
            kubeconfig: Some(self.cp.kubeconfig_path().to_path_buf()),
            extra_args: vec!["--cluster-cidr".into(), "10.244.0.0/16".into()],
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
    converge("the old port is gone", || {
        probe::tcp(e.host(), "10.96.100.10:80", 1)[0]["ok"] == false
    });

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

    // Delete: the cluster IP is not translated any more.
    e.delete_service("web");
    converge("a deleted Service is gone", || {
        probe::tcp(e.host(), "10.96.100.10:81", 1)[0]["ok"] == false
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
