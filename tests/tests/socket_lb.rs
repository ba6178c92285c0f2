//! Socket-level load balancing with real sockets: the real lb-agent programs a test cgroup and a
//! private bpffs from manifests; clients run inside the cgroup, in the node's namespace (host
//! processes) or in a pod's namespace; servers run in pod namespaces.

use std::process::Command;

use lb_tests::{
    agent::{Agent, AgentOptions, bpf_root_in},
    bpffs::BpfFs,
    cgroup::Cgroup,
    fixtures::{State, service, slice, write_manifests},
    kernel, probe,
    process::{Place, Proc},
    require_root,
    topo::{Lan, Node},
};
use serde_json::Value;

const NODE: &str = "node-a";

/// One node with `pods` pod namespaces, each serving TCP :8080 and UDP :5353 under its own name,
/// an agent, and a cgroup for clients.
struct Fixture {
    _servers: Vec<Proc>,
    agent: Option<Agent>,
    manifests: tempfile::TempDir,
    cgroup: Cgroup,
    node: Node,
    _lan: Lan,
    bpffs: BpfFs,
}

impl Fixture {
    fn new(pods: u8) -> Fixture {
        require_root();
        let bpffs = BpfFs::new();
        let cgroup = Cgroup::new("lbsock");
        let lan = Lan::new();
        let mut node = Node::new(1);
        node.attach_lan(&lan);
        for n in 0..pods {
            node.add_pod(n + 2);
        }
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
        let manifests = tempfile::tempdir().expect("tempdir");
        Fixture {
            _servers: servers,
            agent: None,
            manifests,
            cgroup,
            node,
            _lan: lan,
            bpffs,
        }
    }

    fn pod_ip(&self, i: usize) -> String {
        self.node.pods[i].ip.to_string()
    }

    fn start_agent(&mut self, extra: &[&str]) {
        self.agent = Some(Agent::start(AgentOptions {
            netns: &self.node.ns,
            cgroup: &self.cgroup,
            bpf_root: bpf_root_in(self.bpffs.path()),
            node_name: NODE.into(),
            manifests: Some(self.manifests.path().to_path_buf()),
            kubeconfig: None,
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
        }));
    }

    /// A host process of the node (node namespace, test cgroup).
    fn host(&self) -> Place<'_> {
        Place::new(&self.node.ns, &self.cgroup)
    }

    /// A process in pod `i`'s namespace (and the test cgroup, as a pod's processes would be).
    fn pod(&self, i: usize) -> Place<'_> {
        Place::new(&self.node.pods[i].ns, &self.cgroup)
    }

    /// Replaces the manifests and, once the agent runs, waits until it applied them.
    fn write(
        &self,
        services: &[k8s_openapi::api::core::v1::Service],
        slices: &[k8s_openapi::api::discovery::v1::EndpointSlice],
    ) {
        write_manifests(self.manifests.path(), "objects.yaml", services, slices);
        if let Some(agent) = &self.agent {
            agent.wait_for_next_sync();
        }
    }

    /// A slice of the "web" Service with the given pods ready, port "http" 8080 and "dns" 5353.
    fn web_slice(&self, pods: &[usize]) -> k8s_openapi::api::discovery::v1::EndpointSlice {
        let mut s = slice("demo", "web", "web-1");
        for i in pods {
            s = s.endpoint(&self.pod_ip(*i), NODE, State::Ready);
        }
        s.port("http", "TCP", 8080).port("dns", "UDP", 5353).build()
    }
}

const ECONNREFUSED: i64 = 111;
const EHOSTUNREACH: i64 = 113;

fn web() -> lb_tests::fixtures::Svc {
    service("demo", "web")
        .cluster_ip("10.96.0.20")
        .port("http", "TCP", 80, 8080)
        .port("dns", "UDP", 53, 5353)
}

fn servers(results: &[Value]) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for r in ok(results) {
        *counts
            .entry(probe::server_of(r).unwrap_or_default().to_string())
            .or_insert(0) += 1;
    }
    counts
}

fn ok(results: &[Value]) -> Vec<&Value> {
    for r in results {
        assert_eq!(r["ok"], true, "failed: {r}");
    }
    results.iter().collect()
}

#[test]
fn first_slice_tcp_to_a_virtual_ip_reaches_the_backend() {
    let mut f = Fixture::new(1);
    let backend = f.pod_ip(0);
    write_manifests(
        f.manifests.path(),
        "web.yaml",
        &[service("demo", "web")
            .cluster_ip("10.96.0.10")
            .port("http", "TCP", 80, 8080)
            .build()],
        &[slice("demo", "web", "web-1")
            .endpoint(&backend, NODE, State::Ready)
            .port("http", "TCP", 8080)
            .build()],
    );
    f.start_agent(&[]);

    let results = probe::tcp(f.host(), "10.96.0.10:80", 3);
    for r in ok(&results) {
        assert_eq!(probe::server_of(r), Some(backend.as_str()), "{r}");
        assert_eq!(
            r["peer"], "10.96.0.10:80",
            "getpeername shows the Service, not the backend: {r}"
        );
        // The backend saw the node's own address as the client: nothing was masqueraded.
        assert!(
            r["reply"]["client"].as_str().unwrap().starts_with("10.244.1.1:"),
            "{r}"
        );
    }

    // A process outside the cgroup is not translated (programs are attached to the test cgroup
    // only): the virtual IP is not routable there.
    let outside = probe::tcp(Place::netns(&f.node.ns), "10.96.0.10:80", 1);
    assert_eq!(outside[0]["ok"], false, "{}", outside[0]);

    // SREs read the maps with bpftool: named fields thanks to BTF.
    let pin = bpf_root_in(f.bpffs.path()).join("maps/lb4_services");
    let dump = Command::new("bpftool")
        .args(["map", "dump", "pinned"])
        .arg(&pin)
        .output()
        .expect("bpftool");
    let text = String::from_utf8_lossy(&dump.stdout);
    assert!(
        dump.status.success(),
        "bpftool: {}",
        String::from_utf8_lossy(&dump.stderr)
    );
    for field in [
        "\"addr\"",
        "\"port\": 80",
        "\"slot\"",
        "\"backend_id\"",
        "\"count\": 1",
        "\"rev_nat_id\"",
    ] {
        assert!(text.contains(field), "bpftool output lacks {field}:\n{text}");
    }
    let status = f.agent.take().map(Agent::stop);
    assert!(
        status.is_some_and(|s| s.success()),
        "the agent exits cleanly on SIGTERM"
    );
}

#[test]
fn every_frontend_type_from_the_host_and_from_a_pod() {
    let mut f = Fixture::new(4);
    let backends = [f.pod_ip(0), f.pod_ip(1), f.pod_ip(2)];
    let svc = service("demo", "web")
        .cluster_ip("10.96.0.20")
        .port("http", "TCP", 80, 8080)
        .node_port(30080)
        .port("dns", "UDP", 53, 5353)
        .node_port(30053)
        .external_ips(&["198.51.100.20"])
        .load_balancer_ip("203.0.113.20")
        .build();
    f.write(&[svc], &[f.web_slice(&[0, 1, 2])]);
    f.start_agent(&[]);
    let node_ip = f.node.ip.unwrap().to_string();

    let tcp_frontends = [
        "10.96.0.20:80".to_string(),
        format!("{node_ip}:30080"),
        "198.51.100.20:80".into(),
        "203.0.113.20:80".into(),
    ];
    let udp_frontends = [
        "10.96.0.20:53".to_string(),
        format!("{node_ip}:30053"),
        "198.51.100.20:53".into(),
    ];
    // Pod 3 is a client only (no Service selects it).
    for (who, place) in [("host", f.host()), ("pod", f.pod(3))] {
        for frontend in &tcp_frontends {
            for r in ok(&probe::tcp(place, frontend, 5)) {
                assert!(
                    backends.iter().any(|b| probe::server_of(r) == Some(b)),
                    "{who} -> {frontend}: {r}"
                );
                assert_eq!(
                    r["peer"],
                    frontend.as_str(),
                    "{who} -> {frontend}: getpeername shows the frontend"
                );
            }
        }
        for frontend in &udp_frontends {
            for connected in [false, true] {
                for r in ok(&probe::udp(place, frontend, 3, connected)) {
                    assert!(
                        backends.iter().any(|b| probe::server_of(r) == Some(b)),
                        "{who} -> {frontend}: {r}"
                    );
                    assert_eq!(
                        r["from"],
                        frontend.as_str(),
                        "{who} -> {frontend} (connected: {connected}): the reply comes from the frontend"
                    );
                    if connected {
                        assert_eq!(r["peer"], frontend.as_str());
                    }
                }
            }
        }
    }
    // 127.0.0.1:<nodePort> works from the node without route_localnet ...
    for r in ok(&probe::tcp(f.host(), "127.0.0.1:30080", 3)) {
        assert!(backends.iter().any(|b| probe::server_of(r) == Some(b)), "{r}");
        assert_eq!(r["peer"], "127.0.0.1:30080");
    }
    // ... but a pod's 127.0.0.1 is the pod's own loopback, as with kube-proxy.
    let r = &probe::tcp(f.pod(3), "127.0.0.1:30080", 1)[0];
    assert_eq!(r["ok"], false, "{r}");
    assert_eq!(
        r["errno"], ECONNREFUSED,
        "nothing listens on the pod's loopback: {r}"
    );
}

#[test]
fn protocols_must_match() {
    let mut f = Fixture::new(1);
    let svc = service("demo", "web")
        .cluster_ip("10.96.0.20")
        .port("http", "TCP", 80, 8080)
        .port("dns", "UDP", 53, 5353)
        .build();
    f.write(&[svc], &[f.web_slice(&[0])]);
    f.start_agent(&[]);
    // UDP to the TCP port and TCP to the UDP port are not translated: the virtual IP is not
    // routable, so they fail without reaching the backend.
    let r = &probe::udp(f.host(), "10.96.0.20:80", 1, false)[0];
    assert_eq!(r["ok"], false, "{r}");
    assert_ne!(r["errno"], ECONNREFUSED);
    let r = &probe::tcp(f.host(), "10.96.0.20:53", 1)[0];
    assert_eq!(r["ok"], false, "{r}");
    assert_ne!(r["errno"], ECONNREFUSED);
    // The right protocols are.
    ok(&probe::tcp(f.host(), "10.96.0.20:80", 1));
    ok(&probe::udp(f.host(), "10.96.0.20:53", 1, false));
}

#[test]
fn connections_spread_evenly_over_three_backends() {
    let mut f = Fixture::new(3);
    f.write(&[web().build()], &[f.web_slice(&[0, 1, 2])]);
    f.start_agent(&[]);
    let n = 3000;
    let counts = servers(&probe::tcp(f.host(), "10.96.0.20:80", n));
    assert_eq!(counts.len(), 3, "{counts:?}");
    // Pearson's chi-square against the uniform distribution, 2 degrees of freedom: 13.82 is the
    // 0.1% critical value, so a correct data path fails this once in a thousand runs.
    let expected = f64::from(n) / 3.0;
    let chi2: f64 = counts
        .values()
        .map(|&c| (c as f64 - expected).powi(2) / expected)
        .sum();
    assert!(chi2 < 13.82, "chi-square {chi2:.2} for {counts:?}");
    // UDP: each socket sticks to one backend, and sockets spread too.
    let udp = servers(&probe::udp(f.host(), "10.96.0.20:53", 300, false));
    assert_eq!(udp.len(), 3, "{udp:?}");
}

#[test]
fn client_ip_affinity_sticks_until_the_timeout() {
    let mut f = Fixture::new(3);
    f.write(&[web().client_ip_affinity(1).build()], &[f.web_slice(&[0, 1, 2])]);
    f.start_agent(&[]);
    // Within the timeout, every connection of this client goes to one backend.
    let burst = servers(&probe::tcp(f.host(), "10.96.0.20:80", 30));
    assert_eq!(burst.len(), 1, "{burst:?}");
    // Another client (a pod) has its own affinity.
    let other = servers(&probe::tcp(f.pod(0), "10.96.0.20:80", 10));
    assert_eq!(other.len(), 1, "{other:?}");
    // After the timeout the choice is made afresh: over 8 idle periods, some other backend shows
    // up (all 8 the same by chance: (1/3)^8 = 0.015%).
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..8 {
        std::thread::sleep(std::time::Duration::from_millis(1300));
        let r = servers(&probe::tcp(f.host(), "10.96.0.20:80", 1));
        seen.extend(r.into_keys());
    }
    assert!(seen.len() > 1, "affinity never expired: {seen:?}");

    // A backend leaving the Service takes its affinity with it.
    let sticky = servers(&probe::tcp(f.host(), "10.96.0.20:80", 1))
        .into_keys()
        .next()
        .unwrap();
    let remaining: Vec<usize> = (0..3).filter(|i| f.pod_ip(*i) != sticky).collect();
    f.write(&[web().client_ip_affinity(1).build()], &[f.web_slice(&remaining)]);
    let after = servers(&probe::tcp(f.host(), "10.96.0.20:80", 10));
    assert!(!after.contains_key(&sticky), "{after:?}");
    assert_eq!(after.len(), 1, "and sticks to its new backend: {after:?}");
}

#[test]
fn removed_endpoints_get_no_new_connections_while_established_ones_keep_working() {
    let mut f = Fixture::new(2);
    f.write(&[web().build()], &[f.web_slice(&[0, 1])]);
    f.start_agent(&[]);
    let (a, b) = (f.pod_ip(0), f.pod_ip(1));
    // Open long-lived connections until one lands on backend a.
    let mut holds = Vec::new();
    for _ in 0..10 {
        let mut h = probe::hold(f.host(), "10.96.0.20:80", 4);
        let first = h.wait_for_line(std::time::Duration::from_secs(5), |l| l.contains("\"seq\""));
        let v: Value = serde_json::from_str(&first).unwrap();
        let server = v["reply"]["server"].as_str().unwrap_or_default().to_string();
        holds.push((h, server));
        if holds.iter().any(|(_, s)| *s == a) {
            break;
        }
    }
    let (mut hold_a, _) = holds
        .into_iter()
        .find(|(_, s)| *s == a)
        .expect("a connection to backend a");
    // Backend a leaves the Service.
    f.write(&[web().build()], &[f.web_slice(&[1])]);
    let after = servers(&probe::tcp(f.host(), "10.96.0.20:80", 50));
    assert_eq!(
        after.keys().cloned().collect::<Vec<_>>(),
        vec![b],
        "no new connection to a removed endpoint"
    );
    // The established connection to a kept working throughout, still served by a.
    let done = hold_a.wait_for_line(std::time::Duration::from_secs(10), |l| {
        l.contains("\"done\"") || l.contains("\"ok\":false")
    });
    assert!(
        done.contains("\"done\""),
        "the established connection broke: {done}"
    );
    let lines = hold_a.stdout_lines();
    assert!(lines.len() > 20, "{lines:?}");
    for line in lines.iter().filter(|l| l.contains("\"seq\"")) {
        assert!(line.contains(&format!("\"server\":\"{a}\"")), "{line}");
    }
}

/// Regression: a long-lived connection's reverse-NAT entry lived in the LRU `lb4_sock_revnat`,
/// so once other sockets had churned it out, getpeername showed the backend. Connected sockets now
/// keep it in their own storage (`lb4_sock_rev_sk`); here the LRU map holds 16 entries and 300
/// unconnected UDP sockets (which still use it) go through it while the connection lives.
#[test]
fn a_long_lived_connection_keeps_its_service_address_through_socket_churn() {
    let mut f = Fixture::new(1);
    f.write(&[web().build()], &[f.web_slice(&[0])]);
    f.start_agent(&["--bpf-sock-rev-map-max", "16"]);
    let mut hold = probe::hold(f.host(), "10.96.0.20:80", 6);
    let first = hold.wait_for_line(std::time::Duration::from_secs(5), |l| l.contains("\"seq\""));
    assert!(first.contains("\"peer\":\"10.96.0.20:80\""), "{first}");

    let churn = probe::udp(f.host(), "10.96.0.20:53", 300, false);
    assert_eq!(ok(&churn).len(), 300, "the unconnected UDP sockets are served");
    // Their replies come from the Service too, each socket's entry read back right after it was
    // written; the 16-entry LRU map was overrun many times over meanwhile.
    for r in &churn {
        assert_eq!(r["from"], "10.96.0.20:53", "{r}");
    }

    let done = hold.wait_for_line(std::time::Duration::from_secs(10), |l| {
        l.contains("\"done\"") || l.contains("\"ok\":false")
    });
    assert!(done.contains("\"done\""), "the connection broke: {done}");
    let exchanges: Vec<String> = hold
        .stdout_lines()
        .into_iter()
        .filter(|l| l.contains("\"seq\""))
        .collect();
    assert!(exchanges.len() > 20, "{exchanges:?}");
    for line in &exchanges {
        assert!(
            line.contains("\"peer\":\"10.96.0.20:80\""),
            "getpeername must show the Service for the connection's whole life: {line}"
        );
    }
}

#[test]
fn no_endpoints_rejects_and_local_policy_without_local_endpoints_drops() {
    let mut f = Fixture::new(1);
    let local_only = service("demo", "local")
        .cluster_ip("10.96.0.30")
        .port("http", "TCP", 80, 8080)
        .internal_traffic_policy("Local")
        .build();
    let remote = slice("demo", "local", "local-1")
        .endpoint("10.244.9.9", "node-b", State::Ready)
        .port("http", "TCP", 8080)
        .build();
    f.write(&[web().build(), local_only], &[remote]);
    f.start_agent(&[]);
    // No endpoints at all: kube-proxy REJECTs; connect() fails at once with ECONNREFUSED, and so
    // does a UDP send (EPERM on kernels without bpf_set_retval).
    let refused = kernel::refused_with(ECONNREFUSED);
    let r = &probe::tcp(f.host(), "10.96.0.20:80", 1)[0];
    assert_eq!(
        (r["ok"].clone(), r["errno"].clone()),
        (Value::from(false), Value::from(refused)),
        "{r}"
    );
    let r = &probe::udp(f.host(), "10.96.0.20:53", 1, false)[0];
    assert_eq!(r["errno"], refused, "{r}");
    // internalTrafficPolicy=Local with endpoints on other nodes only: kube-proxy DROPs; the
    // socket fails fast with EHOSTUNREACH instead of timing out.
    let r = &probe::tcp(f.host(), "10.96.0.30:80", 1)[0];
    assert_eq!(r["errno"], kernel::refused_with(EHOSTUNREACH), "{r}");
    // An endpoint appears: the Service serves.
    f.write(&[web().build()], &[f.web_slice(&[0])]);
    ok(&probe::tcp(f.host(), "10.96.0.20:80", 3));
}

#[test]
fn terminating_endpoints_serve_only_when_none_is_ready() {
    let mut f = Fixture::new(2);
    let (a, b) = (f.pod_ip(0), f.pod_ip(1));
    let mixed = slice("demo", "web", "web-1")
        .endpoint(&a, NODE, State::Ready)
        .endpoint(&b, NODE, State::Terminating)
        .port("http", "TCP", 8080)
        .port("dns", "UDP", 5353)
        .build();
    f.write(&[web().build()], &[mixed]);
    f.start_agent(&[]);
    assert_eq!(
        servers(&probe::tcp(f.host(), "10.96.0.20:80", 30))
            .into_keys()
            .collect::<Vec<_>>(),
        vec![a.clone()]
    );
    // Now a is not ready (and not serving): the serving, terminating b takes new connections.
    let fallback = slice("demo", "web", "web-1")
        .endpoint(&a, NODE, State::NotReady)
        .endpoint(&b, NODE, State::Terminating)
        .port("http", "TCP", 8080)
        .port("dns", "UDP", 5353)
        .build();
    f.write(&[web().build()], &[fallback]);
    assert_eq!(
        servers(&probe::tcp(f.host(), "10.96.0.20:80", 30))
            .into_keys()
            .collect::<Vec<_>>(),
        vec![b]
    );
}
