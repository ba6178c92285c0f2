//! The tc path in a real three-node topology: node namespaces with pod namespaces behind veths,
//! routes between the nodes' pod CIDRs over a shared LAN, an external client on the LAN, and the
//! real lb-agent on every node. Pods are not in the agents' cgroups, so their traffic goes through
//! tc too.

use std::{
    net::Ipv4Addr,
    path::PathBuf,
    time::{Duration, Instant},
};

use lb_tests::{
    agent::{Agent, AgentOptions, bpf_root_in, inspect},
    bpffs::BpfFs,
    cgroup::Cgroup,
    fixtures::{State, service, slice, write_manifests},
    netns::NetNs,
    probe,
    process::{Place, Proc},
    require_root,
    topo::{Lan, Node, external_client, ipv6_twin},
};
use serde_json::Value;

struct Cluster {
    agents: Vec<Option<Agent>>,
    _servers: Vec<Proc>,
    cgroups: Vec<Cgroup>,
    manifests: tempfile::TempDir,
    client: NetNs,
    client_ip: Ipv4Addr,
    nodes: Vec<Node>,
    _lan: Lan,
    _bpffs: BpfFs,
    /// Each node's --bpf-root.
    bpf_roots: Vec<PathBuf>,
}

impl Cluster {
    /// Starts node `index`'s agent (0-based) with the common flags and `extra`.
    fn start_agent(&mut self, index: usize, extra: &[&str]) {
        let node = &self.nodes[index];
        let mut extra_args: Vec<String> = vec![
            "--cluster-cidr".into(),
            "10.244.0.0/16".into(),
            "--bind-address".into(),
            node.ip.expect("on the LAN").to_string(),
            // Ended flows are freed within seconds (see external_traffic_through_the_tc_path).
            "--conntrack-gc-interval".into(),
            "1s".into(),
            "--bpf-ct-timeout-regular-tcp-fin".into(),
            "1s".into(),
        ];
        extra_args.extend(extra.iter().map(|a| a.to_string()));
        let agent = Agent::start(AgentOptions {
            netns: &node.ns,
            cgroup: &self.cgroups[index],
            bpf_root: self.bpf_roots[index].clone(),
            node_name: format!("node-{}", node.index),
            manifests: Some(self.manifests.path().to_path_buf()),
            kubeconfig: None,
            extra_args,
        });
        self.agents[index] = Some(agent);
    }

    /// Stops node `index`'s agent (its programs stay attached, as across a restart).
    fn stop_agent(&mut self, index: usize) {
        if let Some(agent) = self.agents[index].take() {
            agent.stop();
        }
    }

    /// `lb-agent conntrack -o json` on node `index` (0-based).
    fn conntrack(&self, index: usize) -> Vec<Value> {
        let flows = inspect(&self.bpf_roots[index], "conntrack").unwrap_or_else(|e| panic!("{e}"));
        flows.as_array().cloned().expect("a JSON array")
    }
}

const ETIMEDOUT: i64 = 110;
const EAGAIN: i64 = 11;

/// Node 1 has pod 10.244.1.2, node 2 has pod 10.244.2.2, node 3 has none.
fn cluster() -> Cluster {
    cluster_with(&[])
}

/// The cluster with `extra` flags for every agent.
fn cluster_with(extra: &[&str]) -> Cluster {
    cluster_and(extra, |_| {})
}

/// The cluster with `extra` flags for every agent, and the manifests `more` writes into the
/// agents' folder before they start.
fn cluster_and(extra: &[&str], more: impl FnOnce(&std::path::Path)) -> Cluster {
    require_root();
    let bpffs = BpfFs::new();
    let lan = Lan::new();
    let mut nodes: Vec<Node> = (1..=3).map(Node::new).collect();
    for node in &mut nodes {
        node.attach_lan(&lan);
    }
    for i in 0..nodes.len() {
        for j in 0..nodes.len() {
            if i != j {
                nodes[i].route_to(&nodes[j]);
            }
        }
    }
    nodes[0].add_pod(2);
    nodes[1].add_pod(2);
    let (client, client_ip) = external_client(&lan, 1);
    let servers = [&nodes[0].pods[0], &nodes[1].pods[0]]
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

    let manifests = tempfile::tempdir().unwrap();
    write_manifests(
        manifests.path(),
        "cluster.yaml",
        &[
            service("demo", "web")
                .cluster_ip("10.96.0.20")
                .port("http", "TCP", 80, 8080)
                .node_port(30080)
                .port("dns", "UDP", 53, 5353)
                .node_port(30053)
                .build(),
            service("demo", "local")
                .cluster_ip("10.96.0.21")
                .port("http", "TCP", 80, 8080)
                .node_port(30081)
                .external_traffic_policy("Local")
                .build(),
            service("demo", "self")
                .cluster_ip("10.96.0.22")
                .port("http", "TCP", 80, 8080)
                .build(),
        ],
        &[
            slice("demo", "web", "web-1")
                .endpoint("10.244.2.2", "node-2", State::Ready)
                .port("http", "TCP", 8080)
                .port("dns", "UDP", 5353)
                .build(),
            slice("demo", "local", "local-1")
                .endpoint("10.244.1.2", "node-1", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
            slice("demo", "self", "self-1")
                .endpoint("10.244.1.2", "node-1", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
        ],
    );
    more(manifests.path());
    let mut cluster = Cluster {
        agents: nodes.iter().map(|_| None).collect(),
        _servers: servers,
        cgroups: nodes.iter().map(|_| Cgroup::new("lbtopo")).collect(),
        manifests,
        client,
        client_ip,
        bpf_roots: nodes
            .iter()
            .map(|node| bpf_root_in(bpffs.path()).join(format!("node{}", node.index)))
            .collect(),
        nodes,
        _lan: lan,
        _bpffs: bpffs,
    };
    for index in 0..cluster.nodes.len() {
        cluster.start_agent(index, extra);
    }
    cluster
}

fn ok(results: &[Value]) -> &[Value] {
    for r in results {
        assert_eq!(r["ok"], true, "{r}");
    }
    results
}

fn host_of(addr: &Value) -> String {
    host_of_str(addr.as_str().unwrap_or_default())
}

/// The host part of `host:port` (IPv4).
fn host_of_str(addr: &str) -> String {
    addr.rsplit_once(':')
        .map(|(h, _)| h.to_string())
        .unwrap_or_default()
}

#[test]
fn external_traffic_through_the_tc_path() {
    let c = cluster();
    let client = Place::netns(&c.client);
    let node1 = c.nodes[0].ip.unwrap();
    let node2 = c.nodes[1].ip.unwrap();
    let node3 = c.nodes[2].ip.unwrap();

    // `lb-agent monitor` on node 1 shows the first of these flows as it happens (issue 24).
    let mut monitor_cmd = std::process::Command::new(lb_tests::process::workspace_bin("lb-agent"));
    monitor_cmd
        .args([
            "monitor",
            "-o",
            "json",
            "--type",
            "nat",
            "--port",
            "30080",
            "--max-events",
            "1",
        ])
        .arg("--bpf-root")
        .arg(&c.bpf_roots[0])
        .stdout(std::process::Stdio::piped());
    Place::netns(&c.nodes[0].ns).apply(&mut monitor_cmd);
    let mut monitor = Proc::spawn_command(monitor_cmd);
    monitor.wait_for_line(Duration::from_secs(20), |l| l.contains(r#""type":"listening""#));

    // NodePort on node 1, backend on node 2: masqueraded to node 1's IP, the reply comes from the
    // NodePort the client called.
    for r in ok(&probe::tcp(client, &format!("{node1}:30080"), 5)) {
        assert_eq!(probe::server_of(r), Some("10.244.2.2"), "{r}");
        assert_eq!(
            host_of(&r["reply"]["client"]),
            node1.to_string(),
            "the backend sees node 1: {r}"
        );
        assert_eq!(r["peer"], format!("{node1}:30080"));
    }
    assert!(
        monitor
            .wait_timeout(Duration::from_secs(20))
            .is_some_and(|s| s.success()),
        "the monitor stops after one event: {:?}",
        monitor.stdout_lines()
    );
    let event: Value = serde_json::from_str(&monitor.stdout_lines()[1]).unwrap();
    assert_eq!(
        (&event["type"], &event["event"], &event["hook"]),
        (
            &Value::from("nat"),
            &Value::from("tc_new_flow"),
            &Value::from("tc-ingress")
        ),
        "{event}"
    );
    assert_eq!(host_of(&event["client"]), c.client_ip.to_string(), "{event}");
    assert_eq!(event["destination"], format!("{node1}:30080"), "{event}");
    assert_eq!(event["backend"], "10.244.2.2:8080", "{event}");
    assert_eq!(host_of(&event["masquerade"]), node1.to_string(), "{event}");
    assert_eq!(event["service"], "demo/web:http", "{event}");
    assert!(
        event["interface"]
            .as_str()
            .is_some_and(|i| !i.is_empty() && !i.starts_with("if")),
        "the interface the packet came in by, by name: {event}"
    );

    // The same NodePort on node 3, which has no pod at all.
    for r in ok(&probe::tcp(client, &format!("{node3}:30080"), 3)) {
        assert_eq!(host_of(&r["reply"]["client"]), node3.to_string(), "{r}");
    }

    // externalTrafficPolicy=Local on the node with the endpoint: the client's address is kept.
    for r in ok(&probe::tcp(client, &format!("{node1}:30081"), 5)) {
        assert_eq!(probe::server_of(r), Some("10.244.1.2"));
        assert_eq!(
            host_of(&r["reply"]["client"]),
            c.client_ip.to_string(),
            "client IP preserved: {r}"
        );
        assert_eq!(r["peer"], format!("{node1}:30081"));
    }
    // ... and on a node without one: dropped (no answer at all, as with kube-proxy).
    let r = &probe::tcp(client, &format!("{node2}:30081"), 1)[0];
    assert_eq!(r["ok"], false, "{r}");
    assert!(
        r["errno"] == ETIMEDOUT || r["errno"] == EAGAIN,
        "dropped, not refused: {r}"
    );

    // UDP both ways: the reply comes from the NodePort.
    for r in ok(&probe::udp(client, &format!("{node1}:30053"), 5, false)) {
        assert_eq!(probe::server_of(r), Some("10.244.2.2"));
        assert_eq!(r["from"], format!("{node1}:30053"));
    }

    // 10 MiB through the masqueraded path, checksummed end to end.
    let bulk = probe::tcp_bulk(client, &format!("{node1}:30080"), 10 * 1024 * 1024);
    assert_eq!(bulk["ok"], true, "{bulk}");
    assert_eq!(bulk["reply"]["extra"]["bytes"], 10 * 1024 * 1024);
    assert_eq!(
        bulk["reply"]["extra"]["fnv1a"], bulk["sent_fnv1a"],
        "the data arrived intact"
    );

    // Every TCP connection above has ended: the programs saw the FINs both ways, and the
    // conntrack GC (1 s here) frees their entries and masquerade ports. The UDP flows are within
    // their idle timeout and stay.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let flows = c.conntrack(0);
        let tcp: Vec<&Value> = flows.iter().filter(|f| f["protocol"] == "TCP").collect();
        let udp = flows.iter().filter(|f| f["protocol"] == "UDP").count();
        if tcp.is_empty() {
            assert!(udp > 0, "the live UDP flows stay: {flows:#?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "closed TCP flows still tracked on node 1 after 20 s: {tcp:#?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Issue 21: a UDP datagram larger than the MTU travels in IP fragments, and only the first
/// carries the ports. From a client outside a dual-stack node, 4,000-byte datagrams over the LAN's
/// 1,500-byte MTU to a NodePort and to a cluster IP routed to the node, in both families: the
/// backend receives each whole (its checksum matches) and its answer, as large, comes back whole.
#[test]
fn fragmented_udp_datagrams_reach_the_backend_whole_in_both_families() {
    require_root();
    let bpffs = BpfFs::new();
    let lan = Lan::new();
    let mut node = Node::dual_stack(1);
    let node_ip = node.attach_lan(&lan);
    node.add_pod(2);
    let (client, client_ip) = external_client(&lan, 1);
    let client6 = format!("{}/64", ipv6_twin(client_ip));
    client.ip(&["-6", "addr", "add", &client6, "dev", "eth0", "nodad"]);
    // Cluster IPs reach the node from outside as through a router's static route.
    client.ip(&["route", "add", "10.96.0.0/16", "via", &node_ip.to_string()]);
    let node_ip6 = ipv6_twin(node_ip).to_string();
    client.ip(&["-6", "route", "add", "fd00:10:96::/64", "via", &node_ip6]);
    let pod = &node.pods[0];
    let pod_ip6 = pod.ip6.expect("a dual-stack pod").to_string();
    let _servers = [
        probe::server(Place::netns(&pod.ns), &pod.ip.to_string(), &[], &["0.0.0.0:5353"]),
        probe::server(
            Place::netns(&pod.ns),
            &pod_ip6,
            &[],
            &[&format!("[{pod_ip6}]:5353")],
        ),
    ];
    let manifests = tempfile::tempdir().unwrap();
    let pod_ip = pod.ip.to_string();
    write_manifests(
        manifests.path(),
        "dns.yaml",
        &[service("demo", "dns")
            .cluster_ips(&["10.96.0.53", "fd00:10:96::53"])
            .port("dns", "UDP", 53, 5353)
            .node_port(30053)
            .build()],
        &[
            slice("demo", "dns", "dns-1")
                .endpoint(&pod_ip, "node-1", State::Ready)
                .port("dns", "UDP", 5353)
                .build(),
            slice("demo", "dns", "dns-1-ipv6")
                .endpoint(&pod_ip6, "node-1", State::Ready)
                .port("dns", "UDP", 5353)
                .build(),
        ],
    );
    let cgroup = Cgroup::new("lbtopo");
    let bpf_root = bpf_root_in(bpffs.path());
    let _agent = Agent::start(AgentOptions {
        netns: &node.ns,
        cgroup: &cgroup,
        bpf_root: bpf_root.clone(),
        node_name: "node-1".into(),
        manifests: Some(manifests.path().to_path_buf()),
        kubeconfig: None,
        extra_args: ["--cluster-cidr", "10.244.0.0/16,fd00:10:244::/48"]
            .map(String::from)
            .to_vec(),
    });
    let place = Place::netns(&client);
    let destinations = [
        format!("{node_ip}:30053"),
        "10.96.0.53:53".to_string(),
        format!("[{node_ip6}]:30053"),
        "[fd00:10:96::53]:53".to_string(),
    ];
    // Served at all (small datagrams) before the large ones.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !destinations
        .iter()
        .all(|to| probe::udp(place, to, 1, false)[0]["ok"] == true)
    {
        assert!(Instant::now() < deadline, "the Service is not served within 20 s");
        std::thread::sleep(Duration::from_millis(200));
    }
    let followed_before = stat(&bpf_root, "tc_fragment_followed");
    for to in &destinations {
        for _ in 0..3 {
            let r = probe::udp_payload(place, to, 4000);
            assert_eq!(
                (&r["ok"], &r["intact"], &r["sent_bytes"]),
                (&Value::Bool(true), &Value::Bool(true), &Value::from(4000)),
                "{to}: a 4,000-byte datagram and its answer, whole: {r}"
            );
        }
    }
    // Each datagram is 3 fragments each way (1,500-byte MTU): ingress and egress followed the
    // later ones of every request and answer.
    let followed = stat(&bpf_root, "tc_fragment_followed") - followed_before;
    assert!(
        followed >= 4 * 3 * 2 * 2,
        "later fragments followed through their first: {followed}"
    );
}

/// Issue 17: Maglev across real nodes. An external IP that every node serves (as an ECMP router
/// in front of them would spread it), annotated `maglev`, with both pods as endpoints. One UDP
/// flow (one client port) sent through node 1, then node 2, then node 3 (a route change moving
/// it, as ECMP does when a node joins or leaves) reaches the same backend through each, though
/// each agent numbers its backends its own way and node 3 has no pod; over 16 client ports both
/// backends get flows.
#[test]
fn maglev_keeps_a_flow_on_its_backend_whichever_node_it_enters() {
    let c = cluster_and(&[], |dir| {
        write_manifests(
            dir,
            "maglev.yaml",
            &[service("demo", "mg")
                .cluster_ip("10.96.0.30")
                .port("dns", "UDP", 53, 5353)
                .external_ips(&["192.0.2.50"])
                .annotation("lb-agent.io/lb-algorithm", "maglev")
                .build()],
            &[slice("demo", "mg", "mg-1")
                .endpoint("10.244.1.2", "node-1", State::Ready)
                .endpoint("10.244.2.2", "node-2", State::Ready)
                .port("dns", "UDP", 5353)
                .build()],
        )
    });
    let client = Place::netns(&c.client);
    let route_via = |i: usize| {
        let via = c.nodes[i].ip.expect("on the LAN").to_string();
        c.client.ip(&["route", "replace", "192.0.2.50/32", "via", &via]);
    };
    for i in 0..c.nodes.len() {
        route_via(i);
        let deadline = Instant::now() + Duration::from_secs(30);
        while probe::udp(client, "192.0.2.50:53", 1, false)[0]["ok"] != true {
            assert!(
                Instant::now() < deadline,
                "node {} does not serve the external IP",
                i + 1
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let mut backends = std::collections::BTreeSet::new();
    for port in 42_000..42_016 {
        let through: Vec<String> = (0..c.nodes.len())
            .map(|i| {
                route_via(i);
                let r = probe::udp_from(client, "192.0.2.50:53", port);
                assert_eq!(r["ok"], true, "port {port} through node {}: {r}", i + 1);
                probe::server_of(&r).unwrap_or_default().to_string()
            })
            .collect();
        assert!(
            through.iter().all(|b| *b == through[0]),
            "client port {port}: backends through nodes 1, 2, 3: {through:?}"
        );
        backends.insert(through[0].clone());
    }
    assert_eq!(backends.len(), 2, "both backends get flows: {backends:?}");
    // The CLI says so: the external IP picks by Maglev from an installed table; its cluster IP
    // (traffic from inside) picks at random.
    let services = inspect(&c.bpf_roots[0], "services").unwrap_or_else(|e| panic!("{e}"));
    let view = |frontend: &str| {
        services
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["frontend"] == frontend)
            .cloned()
            .unwrap_or_else(|| panic!("no frontend {frontend}: {services}"))
    };
    let external = view("192.0.2.50:53/UDP");
    assert_eq!(external["algorithm"], "maglev", "{external}");
    assert_eq!(
        external["maglev_table"],
        serde_json::json!({"size": 16381, "installed": true}),
        "{external}"
    );
    assert_eq!(view("10.96.0.30:53/UDP")["algorithm"], "random");
}

/// Issue 17: SCTP associations through the tc path, with real SCTP sockets (the kernel's `sctp`
/// module: skipped, with the reason, on a kernel without it, as this machine's own; the kernel
/// matrix runs it on Debian's kernels). A Diameter-like Service whose target port differs from its
/// port, so every translated packet has its CRC32c updated (a receiving SCTP stack drops a packet
/// whose checksum is wrong, unless the packet never left a checksum-offloading path). An external
/// client calls the NodePort of node 1, whose endpoint is on node 2: masqueraded, as kube-proxy
/// does; a pod on node 1 calls the cluster IP: not masqueraded. Node 1's own SCTP (no socket
/// hook runs for SCTP) is translated at its tc egress (`lb_tc_sctp_out`) and routed to the
/// backend, on node 2 and on node 1 itself, not masqueraded (its source is node 1's address);
/// the replies get the frontend back at node 1's ingress, so the socket's peer is the Service.
#[test]
fn sctp_associations_through_the_tc_path() {
    require_root();
    if let Err(reason) = lb_tests::sctp::sctp_available() {
        eprintln!("skipped: {reason}");
        return;
    }
    let c = cluster_and(&[], |dir| {
        write_manifests(
            dir,
            "sctp.yaml",
            &[
                service("demo", "diameter")
                    .cluster_ip("10.96.0.40")
                    .port("diameter", "SCTP", 3868, 13868)
                    .node_port(30868)
                    .build(),
                service("demo", "diameter-local")
                    .cluster_ip("10.96.0.41")
                    .port("diameter", "SCTP", 3869, 13868)
                    .build(),
            ],
            &[
                slice("demo", "diameter", "diameter-1")
                    .endpoint("10.244.2.2", "node-2", State::Ready)
                    .port("diameter", "SCTP", 13868)
                    .build(),
                slice("demo", "diameter-local", "diameter-local-1")
                    .endpoint("10.244.1.2", "node-1", State::Ready)
                    .port("diameter", "SCTP", 13868)
                    .build(),
            ],
        )
    });
    let _sctp_servers: Vec<Proc> = [&c.nodes[0].pods[0], &c.nodes[1].pods[0]]
        .iter()
        .map(|p| {
            probe::server_with_sctp(
                Place::netns(&p.ns),
                &p.ip.to_string(),
                &[],
                &[],
                &["0.0.0.0:13868"],
            )
        })
        .collect();
    let node1 = c.nodes[0].ip.expect("on the LAN");
    let nodeport = format!("{node1}:30868");
    let client = Place::netns(&c.client);
    let deadline = Instant::now() + Duration::from_secs(30);
    while probe::sctp(client, &nodeport, 1)[0]["ok"] != true {
        assert!(
            Instant::now() < deadline,
            "node 1 does not serve the SCTP NodePort"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for r in ok(&probe::sctp(client, &nodeport, 3)) {
        assert_eq!(probe::server_of(r), Some("10.244.2.2"), "{r}");
        assert_eq!(
            host_of(&r["reply"]["client"]),
            node1.to_string(),
            "masqueraded: {r}"
        );
        assert_eq!(r["peer"], nodeport.as_str(), "{r}");
    }
    // A pod's association to the cluster IP, through its node's tc ingress (no socket hook runs
    // for SCTP): the backend sees the pod.
    let pod1 = Place::netns(&c.nodes[0].pods[0].ns);
    for r in ok(&probe::sctp(pod1, "10.96.0.40:3868", 3)) {
        assert_eq!(probe::server_of(r), Some("10.244.2.2"), "{r}");
        assert_eq!(
            host_of(&r["reply"]["client"]),
            "10.244.1.2",
            "not masqueraded: {r}"
        );
        assert_eq!(r["peer"], "10.96.0.40:3868", "{r}");
    }
    // The node's own associations: no socket hook runs for them; node 1's tc egress translates
    // them and routes them to the backend. (The cluster IPs are routed through node 2, whose
    // neighbour entry resolves, where an on-link route would leave the INIT waiting for an ARP
    // answer that never comes, before tc: a node needs a route for the Service CIDR, as with
    // kube-proxy, whose OUTPUT chain runs after the socket's route lookup too.)
    let via = c.nodes[1].ip.expect("on the LAN").to_string();
    c.nodes[0].ns.ip(&["route", "add", "10.96.0.0/16", "via", &via]);
    let unsupported = stat(&c.bpf_roots[0], "tc_unsupported_protocol");
    let node1_host = Place::netns(&c.nodes[0].ns);
    for (frontend, backend) in [
        ("10.96.0.40:3868", "10.244.2.2"),
        ("10.96.0.41:3869", "10.244.1.2"),
    ] {
        for r in ok(&probe::sctp(node1_host, frontend, 3)) {
            assert_eq!(probe::server_of(r), Some(backend), "{r}");
            assert_eq!(
                host_of(&r["reply"]["client"]),
                node1.to_string(),
                "the node's own address, not masqueraded: {r}"
            );
            assert_eq!(r["peer"], frontend, "the replies come from the Service: {r}");
        }
    }
    assert_eq!(
        stat(&c.bpf_roots[0], "tc_unsupported_protocol"),
        unsupported,
        "node 1 serves its own SCTP"
    );
}

/// A data-path counter of `lb-agent stats -o json`.
fn stat(bpf_root: &std::path::Path, name: &str) -> u64 {
    let stats = inspect(bpf_root, "stats").unwrap_or_else(|e| panic!("{e}"));
    stats[name].as_u64().unwrap_or(0)
}

#[test]
fn pods_through_tc_cluster_ip_and_hairpin() {
    let c = cluster();
    let pod1 = Place::netns(&c.nodes[0].pods[0].ns);
    // A pod on node 1 calls a Service whose endpoint is on node 2: not masqueraded (pod source).
    for r in ok(&probe::tcp(pod1, "10.96.0.20:80", 3)) {
        assert_eq!(probe::server_of(r), Some("10.244.2.2"));
        assert_eq!(host_of(&r["reply"]["client"]), "10.244.1.2", "{r}");
        assert_eq!(r["peer"], "10.96.0.20:80");
    }
    // Hairpin: the pod calls a Service whose only endpoint is itself; it sees the node as the
    // client (the address of the interface the packet leaves by, as MASQUERADE: its own veth's,
    // the pod gateway), and the reply as coming from the Service.
    for r in ok(&probe::tcp(pod1, "10.96.0.22:80", 3)) {
        assert_eq!(probe::server_of(r), Some("10.244.1.2"));
        assert_eq!(
            host_of(&r["reply"]["client"]),
            c.nodes[0].gateway().to_string(),
            "masqueraded hairpin: {r}"
        );
        assert_eq!(r["peer"], "10.96.0.22:80");
    }
    // A pod calling a Local NodePort on another node: pod traffic uses all endpoints.
    let pod2 = Place::netns(&c.nodes[1].pods[0].ns);
    let r = &probe::tcp(pod2, &format!("{}:30081", c.nodes[0].ip.unwrap()), 1)[0];
    assert_eq!(r["ok"], true, "{r}");
}

/// Issue 21: a node with two uplinks on different subnets masquerades, as MASQUERADE does, with
/// the address of the interface a flow leaves by, not one address for the whole node. Node 1 has
/// eth0 on LAN A (192.168.50.0/24, its node IP) and eth1 on LAN B (192.168.60.0/24), where node 2
/// is; node 2 knows no route to LAN A, so a flow masqueraded with node 1's node IP could never
/// be answered. A client on each LAN calls the NodePort on node 1's address on its LAN: the
/// backend on node 2 sees eth1's address, and the reply reaches the client (which sits on one
/// LAN only) from the address it called, through the interface it came in by. A NodePort whose
/// backend is node 1's own pod is masqueraded with the pod veth's address (the pod gateway), as
/// MASQUERADE's out interface is that veth. A NodePort whose backend is a hostNetwork server of
/// node 1 at eth1's address (not the node IP) is delivered locally and, as with kube-proxy (whose
/// POSTROUTING never sees a locally delivered packet), not masqueraded: masqueraded with a local
/// address, its reply would be delivered locally too and never un-SNATed. An uplink added while
/// the agent runs gets the tc programs and serves the NodePort within seconds.
#[test]
fn a_node_with_two_uplinks_masquerades_through_each_with_its_address() {
    require_root();
    let bpffs = BpfFs::new();
    let (lan_a, lan_b, lan_c) = (Lan::new(), Lan::new(), Lan::new());
    let mut node1 = Node::new(1);
    let mut node2 = Node::new(2);
    lan_a.attach(&node1.ns, "eth0", "192.168.50.11/24");
    lan_b.attach(&node1.ns, "eth1", "192.168.60.11/24");
    node1.ip = Some(Ipv4Addr::new(192, 168, 50, 11));
    lan_b.attach(&node2.ns, "eth0", "192.168.60.12/24");
    node2.ip = Some(Ipv4Addr::new(192, 168, 60, 12));
    node1
        .ns
        .ip(&["route", "add", "10.244.2.0/24", "via", "192.168.60.12"]);
    node2
        .ns
        .ip(&["route", "add", "10.244.1.0/24", "via", "192.168.60.11"]);
    node1.add_pod(2);
    node2.add_pod(2);
    let _servers: Vec<Proc> = [&node1.pods[0], &node2.pods[0]]
        .iter()
        .map(|p| probe::server(Place::netns(&p.ns), &p.ip.to_string(), &["0.0.0.0:8080"], &[]))
        .chain([probe::server(
            Place::netns(&node1.ns),
            "node1-host",
            &["192.168.60.11:8081"],
            &[],
        )])
        .collect();
    let client_on = |lan: &Lan, ip: &str| {
        let ns = NetNs::new("lbext");
        lan.attach(&ns, "eth0", &format!("{ip}/24"));
        ns
    };
    let client_a = client_on(&lan_a, "192.168.50.101");
    let client_b = client_on(&lan_b, "192.168.60.101");
    let client_c = client_on(&lan_c, "192.168.70.101");

    let manifests = tempfile::tempdir().unwrap();
    write_manifests(
        manifests.path(),
        "cluster.yaml",
        &[
            service("demo", "remote")
                .cluster_ip("10.96.0.20")
                .port("http", "TCP", 80, 8080)
                .node_port(30080)
                .build(),
            service("demo", "here")
                .cluster_ip("10.96.0.21")
                .port("http", "TCP", 80, 8080)
                .node_port(30081)
                .build(),
            service("demo", "hostnet")
                .cluster_ip("10.96.0.22")
                .port("http", "TCP", 80, 8081)
                .node_port(30082)
                .build(),
        ],
        &[
            slice("demo", "remote", "remote-1")
                .endpoint("10.244.2.2", "node-2", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
            slice("demo", "here", "here-1")
                .endpoint("10.244.1.2", "node-1", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
            slice("demo", "hostnet", "hostnet-1")
                .endpoint("192.168.60.11", "node-1", State::Ready)
                .port("http", "TCP", 8081)
                .build(),
        ],
    );
    let cgroup = Cgroup::new("lbtopo");
    let bpf_root = bpf_root_in(bpffs.path()).join("node1");
    let agent = Agent::start(AgentOptions {
        netns: &node1.ns,
        cgroup: &cgroup,
        bpf_root: bpf_root.clone(),
        node_name: "node-1".into(),
        manifests: Some(manifests.path().to_path_buf()),
        kubeconfig: None,
        extra_args: [
            "--cluster-cidr",
            "10.244.0.0/16",
            "--bind-address",
            "192.168.50.11",
        ]
        .map(String::from)
        .to_vec(),
    });

    // Through each uplink to the backend behind eth1: masqueraded with eth1's address.
    for (client, called) in [(&client_a, "192.168.50.11"), (&client_b, "192.168.60.11")] {
        for r in ok(&probe::tcp(Place::netns(client), &format!("{called}:30080"), 3)) {
            assert_eq!(probe::server_of(r), Some("10.244.2.2"), "{r}");
            assert_eq!(
                host_of(&r["reply"]["client"]),
                "192.168.60.11",
                "the backend sees the address of the interface the flow left by: {r}"
            );
            assert_eq!(
                r["peer"],
                format!("{called}:30080"),
                "the reply from the address called: {r}"
            );
        }
    }
    // The node's own pod: masqueraded with its veth's address, the pod gateway.
    for (client, called) in [(&client_a, "192.168.50.11"), (&client_b, "192.168.60.11")] {
        for r in ok(&probe::tcp(Place::netns(client), &format!("{called}:30081"), 2)) {
            assert_eq!(probe::server_of(r), Some("10.244.1.2"), "{r}");
            assert_eq!(host_of(&r["reply"]["client"]), "10.244.1.1", "{r}");
            assert_eq!(r["peer"], format!("{called}:30081"), "{r}");
        }
    }
    // A hostNetwork backend at eth1's address: delivered locally with the client's address.
    for (client, called, from) in [
        (&client_a, "192.168.50.11", "192.168.50.101"),
        (&client_b, "192.168.60.11", "192.168.60.101"),
    ] {
        for r in ok(&probe::tcp(Place::netns(client), &format!("{called}:30082"), 2)) {
            assert_eq!(probe::server_of(r), Some("node1-host"), "{r}");
            assert_eq!(host_of(&r["reply"]["client"]), from, "not masqueraded: {r}");
            assert_eq!(r["peer"], format!("{called}:30082"), "{r}");
        }
    }
    let listed = inspect(&bpf_root, "backends").unwrap_or_else(|e| panic!("{e}"));
    let node_address = |addr: &str| {
        listed
            .as_array()
            .and_then(|rows| rows.iter().find(|b| b["address"] == addr))
            .map(|b| b["host"].clone())
    };
    assert_eq!(
        node_address("192.168.60.11:8081"),
        Some(true.into()),
        "{listed:#}"
    );
    assert_eq!(node_address("10.244.1.2:8080"), Some(false.into()), "{listed:#}");
    let flows = inspect(&bpf_root, "conntrack").unwrap_or_else(|e| panic!("{e}"));
    let masquerades: std::collections::BTreeSet<String> = flows
        .as_array()
        .expect("a JSON array")
        .iter()
        .filter_map(|f| f["masquerade"].as_str().map(host_of_str))
        .collect();
    assert_eq!(
        masquerades,
        ["10.244.1.1", "192.168.60.11"].map(String::from).into(),
        "`lb-agent conntrack` shows each flow's own masquerade address: {flows:#}"
    );
    // `lb-agent trace` on the node, against the live maps, names the address too.
    let mut trace = std::process::Command::new(lb_tests::process::workspace_bin("lb-agent"));
    trace
        .args(["trace", "-o", "json", "--bpf-root"])
        .arg(&bpf_root)
        .args([
            "--node-ip",
            "192.168.50.11,192.168.60.11",
            "--src",
            "192.168.50.101",
        ])
        .args(["--dst", "192.168.50.11", "--dport", "30080"]);
    Place::netns(&node1.ns).apply(&mut trace);
    let out = trace.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let traced: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(traced["masquerade_source"], "192.168.60.11", "{traced}");
    // `lb-agent interfaces` on the node: each interface's masquerade addresses, the node IP beside.
    let mut listing = std::process::Command::new(lb_tests::process::workspace_bin("lb-agent"));
    listing
        .args(["interfaces", "-o", "json", "--bpf-root"])
        .arg(&bpf_root);
    Place::netns(&node1.ns).apply(&mut listing);
    let out = listing.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let masquerade_of = |name: &str| {
        listed["interfaces"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["interface"] == name)
            .map(|i| i["masquerade"].clone())
    };
    assert_eq!(
        masquerade_of("eth0"),
        Some(serde_json::json!(["192.168.50.11/24"])),
        "{listed:#}"
    );
    assert_eq!(
        masquerade_of("eth1"),
        Some(serde_json::json!(["192.168.60.11/24"])),
        "{listed:#}"
    );
    assert_eq!(
        masquerade_of(&node1.pods[0].host_dev),
        Some(serde_json::json!(["10.244.1.1/32"])),
        "{listed:#}"
    );
    assert_eq!(
        listed["masquerade_fallback"],
        serde_json::json!(["192.168.50.11/32"]),
        "{listed:#}"
    );

    // An uplink that appears while the agent runs: the link and address watch syncs, the tc
    // programs attach to it and the NodePort is served on its address.
    lan_c.attach(&node1.ns, "eth2", "192.168.70.11/24");
    let deadline = Instant::now() + Duration::from_secs(30);
    let r = loop {
        let r = probe::tcp(Place::netns(&client_c), "192.168.70.11:30080", 1).remove(0);
        if r["ok"] == true {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "the NodePort on an uplink added 30 s ago does not answer: {r}\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(probe::server_of(&r), Some("10.244.2.2"), "{r}");
    assert_eq!(host_of(&r["reply"]["client"]), "192.168.60.11", "{r}");
    assert_eq!(r["peer"], "192.168.70.11:30080", "{r}");
    assert_eq!(stat(&bpf_root, "tc_masquerade_route_unknown"), 0);
    agent.stop();
}

/// `--detect-local-mode` InterfaceNamePrefix and BridgeInterface (kube-proxy's `-i veth+` and
/// `-i cbr0`), as flows through node 1's tc: a pod whose packets come in by a pod interface keeps
/// its address on the way to a cluster IP; one in the pod range behind any other interface is
/// masqueraded (ClusterCIDR mode, with 10.244.0.0/16, would keep both). A bridge's ports carry
/// no programs (issue 21: never pod veths where a bridge can stand for them): the bridged pod's
/// packet meets tc on the bridge, and a masqueraded NodePort flow to it is un-SNATed there.
#[test]
fn interface_detectors_tell_pods_by_the_interface_they_come_in_by() {
    let mut c = cluster();
    let node1 = c.nodes[0].ip.unwrap().to_string();
    c.stop_agent(0);
    // 10.244.1.2 is behind vp* (the topology's pod veths); 10.244.1.3 behind xp*; 10.244.1.4
    // a port of a bridge.
    c.nodes[0].add_pod_wired(3, "xp", None);
    let bridge = c.nodes[0].add_bridge("lbbr");
    c.nodes[0].add_pod_wired(4, "vb", Some(&bridge));
    let source_seen = |c: &Cluster, pod: usize| {
        let place = Place::netns(&c.nodes[0].pods[pod].ns);
        let results = probe::tcp(place, "10.96.0.20:80", 2);
        ok(&results)
            .iter()
            .map(|r| {
                assert_eq!(probe::server_of(r), Some("10.244.2.2"), "{r}");
                assert_eq!(r["peer"], "10.96.0.20:80", "{r}");
                host_of(&r["reply"]["client"])
            })
            .collect::<std::collections::BTreeSet<_>>()
    };
    let seen = |addr: &str| std::collections::BTreeSet::from([addr.to_string()]);

    c.start_agent(
        0,
        &[
            "--detect-local-mode",
            "InterfaceNamePrefix",
            "--pod-interface-name-prefix",
            "vp",
        ],
    );
    assert_eq!(source_seen(&c, 0), seen("10.244.1.2"), "by vp*: a pod's");
    assert_eq!(source_seen(&c, 1), seen(&node1), "by xp*: not a pod's");
    assert_eq!(source_seen(&c, 2), seen(&node1), "by the bridge: not a pod's");

    // The bridge carries the programs, its port does not; the ptp veths do (TCX links, or on
    // kernels without TCX clsact filters).
    let carries = |c: &Cluster, dev: &str| {
        all_pinned_links(c, 0).iter().any(|l| {
            l.split('/')
                .next()
                .is_some_and(|d| d.ends_with(&format!("-{dev}")))
        }) || !filters(&c.nodes[0], dev, "ingress").is_empty()
    };
    let port = c.nodes[0].pods[2].host_dev.clone();
    let ptp = c.nodes[0].pods[0].host_dev.clone();
    for (dev, expected) in [(&bridge, true), (&port, false), (&ptp, true)] {
        assert_eq!(carries(&c, dev), expected, "{dev}: {:?}", all_pinned_links(&c, 0));
    }

    // A NodePort to the bridged pod from outside: masqueraded with the bridge's address (the pod
    // gateway), whose replies the bridge's ingress un-SNATs.
    let _bridged_server = probe::server(
        Place::netns(&c.nodes[0].pods[2].ns),
        "bridged",
        &["0.0.0.0:8080"],
        &[],
    );
    write_manifests(
        c.manifests.path(),
        "bridged.yaml",
        &[service("demo", "bridged")
            .cluster_ip("10.96.0.23")
            .port("http", "TCP", 80, 8080)
            .node_port(30083)
            .build()],
        &[slice("demo", "bridged", "bridged-1")
            .endpoint("10.244.1.4", "node-1", State::Ready)
            .port("http", "TCP", 8080)
            .build()],
    );
    c.stop_agent(0);
    c.start_agent(
        0,
        &[
            "--detect-local-mode",
            "BridgeInterface",
            "--pod-bridge-interface",
            &bridge,
        ],
    );
    assert_eq!(source_seen(&c, 2), seen("10.244.1.4"), "by the bridge: a pod's");
    for r in ok(&probe::tcp(Place::netns(&c.client), &format!("{node1}:30083"), 2)) {
        assert_eq!(probe::server_of(r), Some("bridged"), "{r}");
        assert_eq!(host_of(&r["reply"]["client"]), "10.244.1.1", "{r}");
        assert_eq!(r["peer"], format!("{node1}:30083"), "{r}");
    }
    assert_eq!(source_seen(&c, 0), seen(&node1), "by vp*: not the bridge");
    assert_eq!(source_seen(&c, 1), seen(&node1), "by xp*: not the bridge");

    // A pod that joins the bridge while the agent runs: the link watch syncs, its port joins
    // `lb_pod_ifaces` (the bridge and its two ports, as /metrics tells an operator) and gets the
    // tc programs, and its packets, met there first, keep their source.
    c.nodes[0].add_pod_wired(5, "vb", Some(&bridge));
    let pod_interfaces = |c: &Cluster| {
        let metrics = probe::http_get(Place::netns(&c.nodes[0].ns), "127.0.0.1:10249", "/metrics");
        metrics["body"]
            .as_str()
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("lb_map_entries{map=\"lb_pod_ifaces\"} "))
            .map(str::to_string)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while pod_interfaces(&c).as_deref() != Some("3") {
        assert!(
            Instant::now() < deadline,
            "lb_pod_ifaces holds {:?} entries 30 s after a port joined the bridge; the agent wrote: {}",
            pod_interfaces(&c),
            c.agents[0]
                .as_ref()
                .map(|a| a
                    .log()
                    .lines()
                    .filter(|l| l.contains("pod interfaces"))
                    .collect::<Vec<_>>()
                    .join("\n"))
                .unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        source_seen(&c, 3),
        seen("10.244.1.5"),
        "by the new port of the bridge"
    );
}

/// One tc filter on a node's interface, from `tc filter show`.
#[derive(Debug, PartialEq)]
struct Filter {
    pref: String,
    handle: String,
    name: String,
    prog_id: String,
}

/// The filters on `dev`'s `hook` (ingress or egress) in `node`'s namespace.
fn filters(node: &Node, dev: &str, hook: &str) -> Vec<Filter> {
    let out = node.ns.exec("tc", &["filter", "show", "dev", dev, hook]);
    let text = String::from_utf8_lossy(&out.stdout);
    // `filter protocol all pref 1 bpf chain 0 handle 0x5ea lb_tc_ingress direct-action
    // not_in_hw id 42 name lb_tc_ingress tag ... jited`; the line without a handle is the
    // priority's header.
    text.lines()
        .filter(|l| l.contains(" handle "))
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = |key: &str| {
                words
                    .iter()
                    .position(|w| *w == key)
                    .and_then(|i| words.get(i + 1))
                    .map(|w| w.to_string())
                    .unwrap_or_default()
            };
            Filter {
                pref: after("pref"),
                handle: after("handle"),
                name: after("name"),
                prog_id: after("id"),
            }
        })
        .collect()
}

/// Our filters on node `index`'s LAN interface, ingress and egress; asserts there is at most
/// one per hook, at our priority and handle, running our program.
fn our_filters(c: &Cluster, index: usize) -> Vec<Filter> {
    let mut ours = Vec::new();
    for (hook, program) in [("ingress", "lb_tc_ingress"), ("egress", "lb_tc_egress")] {
        let found = filters(&c.nodes[index], "eth0", hook);
        assert!(found.len() <= 1, "one filter per hook at most: {found:#?}");
        for filter in found {
            assert_eq!(
                (filter.pref.as_str(), filter.handle.as_str(), filter.name.as_str()),
                ("1", "0x5ea", program),
                "{filter:?}"
            );
            ours.push(filter);
        }
    }
    ours
}

/// The TCX links node `index`'s agent pinned for its LAN interface.
fn pinned_links(c: &Cluster, index: usize) -> Vec<String> {
    let mut links = all_pinned_links(c, index);
    links.retain(|l| l.contains("eth0"));
    links
}

/// Every TCX link node `index`'s agent pinned, as `<ifindex>-<interface>/<hook>`, sorted.
fn all_pinned_links(c: &Cluster, index: usize) -> Vec<String> {
    let dir = c.bpf_roots[index].join("links/tc");
    let mut links = Vec::new();
    for device in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        for hook in std::fs::read_dir(device.path()).into_iter().flatten().flatten() {
            links.push(format!(
                "{}/{}",
                device.file_name().to_string_lossy(),
                hook.file_name().to_string_lossy()
            ));
        }
    }
    links.sort();
    links
}

/// Node 1's NodePort answers from node 2's pod, masqueraded: the tc programs run.
fn nodeport_works(c: &Cluster) {
    let node1 = c.nodes[0].ip.unwrap();
    for r in ok(&probe::tcp(Place::netns(&c.client), &format!("{node1}:30080"), 2)) {
        assert_eq!(probe::server_of(r), Some("10.244.2.2"), "{r}");
        assert_eq!(host_of(&r["reply"]["client"]), node1.to_string(), "{r}");
    }
}

/// The clsact attachment of kernels without TCX (forced here with --enable-tcx=false, so it is
/// tested on every kernel): one filter per hook at our priority and handle, its program replaced
/// in place by a restart, swapped with TCX links both ways without a second copy running, and
/// removed by `lb-agent cleanup`.
#[test]
fn clsact_filters_are_replaced_in_place_switched_and_cleaned_up() {
    let mut c = cluster_with(&["--enable-tcx=false"]);
    nodeport_works(&c);
    let first = our_filters(&c, 0);
    assert_eq!(first.len(), 2, "ingress and egress filters: {first:#?}");
    assert_eq!(pinned_links(&c, 0), Vec::<String>::new(), "no TCX links");

    // A restart replaces each filter's program; it does not add a filter.
    c.stop_agent(0);
    assert_eq!(our_filters(&c, 0), first, "the filters outlive the agent");
    c.start_agent(0, &["--enable-tcx=false"]);
    let second = our_filters(&c, 0);
    assert_eq!(second.len(), 2, "{second:#?}");
    for (old, new) in first.iter().zip(&second) {
        assert_ne!(
            old.prog_id, new.prog_id,
            "the new program replaced the old one in place"
        );
    }
    nodeport_works(&c);

    let tcx = lb_agent::datapath::features::current()
        .expect("probing the kernel")
        .tcx;
    if tcx {
        // To TCX: the links are pinned and the filters go.
        c.stop_agent(0);
        c.start_agent(0, &[]);
        assert_eq!(our_filters(&c, 0), Vec::new(), "the clsact filters were removed");
        assert_eq!(pinned_links(&c, 0).len(), 2, "{:?}", pinned_links(&c, 0));
        nodeport_works(&c);
        // And back: the filters come, the links go.
        c.stop_agent(0);
        c.start_agent(0, &["--enable-tcx=false"]);
        assert_eq!(our_filters(&c, 0).len(), 2);
        assert_eq!(
            pinned_links(&c, 0),
            Vec::<String>::new(),
            "the TCX links were removed"
        );
        nodeport_works(&c);
    } else {
        eprintln!("this kernel has no TCX: the switch to TCX links is not tested here");
    }

    // `lb-agent cleanup` removes the filters.
    c.stop_agent(0);
    let root = c.bpf_roots[0].to_string_lossy().to_string();
    let out = c.nodes[0].ns.exec(
        lb_tests::process::workspace_bin("lb-agent")
            .to_str()
            .expect("UTF-8 path"),
        &["cleanup", "--bpf-root", &root],
    );
    assert!(
        out.status.success(),
        "cleanup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    // Node 1 has two interfaces, the LAN's and its pod's veth, with two filters each.
    assert!(
        said.contains("and 4 clsact filter(s)"),
        "cleanup says what it removed: {said}"
    );
    assert!(filters(&c.nodes[0], &c.nodes[0].pods[0].host_dev, "ingress").is_empty());
    assert_eq!(our_filters(&c, 0), Vec::new(), "cleanup removed the filters");
}
