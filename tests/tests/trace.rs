//! `lb-agent trace --manifests`: the data path's answer for one packet, for the cases kube-proxy
//! documents (cluster IP from a pod and from off-cluster, NodePort from outside and from the node,
//! LoadBalancer source ranges, both traffic policies, terminating endpoints, no endpoints), in
//! both families, and for a dual-stack socket naming an IPv4 Service by its IPv4-mapped address.

use std::process::Command;

use lb_tests::{
    fixtures::{State, maglev_pick, service, slice, write_manifests},
    process::workspace_bin,
    require_root,
};
use serde_json::{Value, json};

const NODE_IP: &str = "192.168.50.11";
/// The node's IPv6 address (the trace node is dual-stack).
const NODE_IP6: &str = "fd00:192:168:50::11";
/// The cluster CIDRs given with a local-traffic detector.
const CLUSTER_CIDRS: &str = "10.244.0.0/16,fd00:10:244::/48";

fn manifests() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_manifests(
        dir.path(),
        "objects.yaml",
        &[
            service("t", "web")
                .cluster_ip("10.96.0.10")
                .port("http", "TCP", 80, 8080)
                .node_port(30080)
                .build(),
            service("t", "local")
                .cluster_ip("10.96.0.11")
                .port("http", "TCP", 80, 8080)
                .node_port(30081)
                .external_traffic_policy("Local")
                .build(),
            service("t", "remote-only")
                .cluster_ip("10.96.0.12")
                .port("http", "TCP", 80, 8080)
                .node_port(30082)
                .external_traffic_policy("Local")
                .build(),
            service("t", "lb")
                .cluster_ip("10.96.0.13")
                .port("http", "TCP", 80, 8080)
                .node_port(30083)
                .load_balancer_ip("203.0.113.10")
                .source_ranges(&["198.51.100.0/24"])
                .build(),
            service("t", "draining")
                .cluster_ip("10.96.0.14")
                .port("http", "TCP", 80, 8080)
                .build(),
            service("t", "mixed")
                .cluster_ip("10.96.0.15")
                .port("http", "TCP", 80, 8080)
                .build(),
            service("t", "empty")
                .cluster_ip("10.96.0.16")
                .port("dns", "UDP", 53, 5353)
                .build(),
            service("t", "itp")
                .cluster_ip("10.96.0.17")
                .port("http", "TCP", 80, 8080)
                .internal_traffic_policy("Local")
                .build(),
            service("t", "ext")
                .cluster_ip("10.96.0.18")
                .port("http", "TCP", 80, 8080)
                .external_ips(&["198.51.100.50"])
                .build(),
            // Dual-stack and IPv6 Services.
            service("t", "web6")
                .cluster_ips(&["10.96.0.20", "fd00:10:96::20"])
                .port("http", "TCP", 80, 8080)
                .node_port(30090)
                .port("dns", "UDP", 53, 5353)
                .build(),
            service("t", "empty6")
                .cluster_ips(&["fd00:10:96::16"])
                .port("dns", "UDP", 53, 5353)
                .build(),
            service("t", "itp6")
                .cluster_ips(&["fd00:10:96::17"])
                .port("http", "TCP", 80, 8080)
                .internal_traffic_policy("Local")
                .build(),
        ],
        &[
            slice("t", "web", "web-1")
                .endpoint("10.244.1.5", "node-a", State::Ready)
                .endpoint("10.244.2.5", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
            slice("t", "local", "local-1")
                .endpoint("10.244.1.6", "node-a", State::Ready)
                .endpoint("10.244.2.6", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
            slice("t", "remote-only", "ro-1")
                .endpoint("10.244.2.7", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
            slice("t", "lb", "lb-1")
                .endpoint("10.244.1.8", "node-a", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
            slice("t", "draining", "d-1")
                .endpoint("10.244.1.9", "node-a", State::Terminating)
                .endpoint("10.244.2.9", "node-b", State::NotReady)
                .port("http", "TCP", 8080)
                .build(),
            slice("t", "mixed", "m-1")
                .endpoint("10.244.1.10", "node-a", State::Ready)
                .endpoint("10.244.2.10", "node-b", State::Terminating)
                .port("http", "TCP", 8080)
                .build(),
            slice("t", "itp", "i-1")
                .endpoint("10.244.2.11", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
            slice("t", "ext", "e-1")
                .endpoint("10.244.2.12", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
            slice("t", "web6", "web6-v4")
                .endpoint("10.244.1.20", "node-a", State::Ready)
                .endpoint("10.244.2.20", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .port("dns", "UDP", 5353)
                .build(),
            slice("t", "web6", "web6-v6")
                .endpoint("fd00:10:244:1::20", "node-a", State::Ready)
                .endpoint("fd00:10:244:2::20", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .port("dns", "UDP", 5353)
                .build(),
            slice("t", "itp6", "itp6-1")
                .endpoint("fd00:10:244:2::21", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
        ],
    );
    dir
}

fn trace(
    dir: &tempfile::TempDir,
    src: &str,
    dst: &str,
    dport: u16,
    protocol: &str,
    cluster_cidr: bool,
) -> Value {
    let out = trace_command(dir, src, dst, dport, protocol, cluster_cidr, "json", &[]);
    assert!(
        out.status.success(),
        "lb-agent trace failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// `lb-agent trace --manifests` on the trace node (both its addresses given with `--node-ip`),
/// with `extra` flags.
#[allow(clippy::too_many_arguments)]
fn trace_command(
    dir: &tempfile::TempDir,
    src: &str,
    dst: &str,
    dport: u16,
    protocol: &str,
    cluster_cidr: bool,
    output: &str,
    extra: &[&str],
) -> std::process::Output {
    require_root();
    let mut cmd = Command::new(workspace_bin("lb-agent"));
    cmd.arg("trace").arg("--manifests").arg(dir.path());
    cmd.args([
        "--node-ip",
        NODE_IP,
        "--node-ip",
        NODE_IP6,
        "--hostname-override",
        "node-a",
        "--src",
        src,
        "--dst",
        dst,
        "--dport",
        &dport.to_string(),
        "--protocol",
        protocol,
        "-o",
        output,
    ]);
    if cluster_cidr {
        cmd.args(["--cluster-cidr", CLUSTER_CIDRS]);
    }
    cmd.args(extra);
    cmd.output().expect("run lb-agent trace")
}

/// The table `lb-agent trace` prints.
fn trace_table(dir: &tempfile::TempDir, src: &str, dst: &str, dport: u16, protocol: &str) -> String {
    let out = trace_command(dir, src, dst, dport, protocol, true, "table", &[]);
    assert!(
        out.status.success(),
        "lb-agent trace failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Why `lb-agent trace` refused the request (it must).
fn trace_refused(dir: &tempfile::TempDir, src: &str, dst: &str, dport: u16) -> String {
    let out = trace_command(dir, src, dst, dport, "tcp", true, "json", &[]);
    assert!(
        !out.status.success(),
        "lb-agent trace --src {src} --dst {dst} answered: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn expect(verdict: &str, backends: &[&str], masquerade: bool, path: &str) -> Value {
    let mut answer =
        json!({"verdict": verdict, "backends": backends, "masquerade": masquerade, "path": path});
    if masquerade {
        // No Node object and no --bind-address: the first NodePort address, the only uplink.
        answer["masquerade_source"] = NODE_IP.into();
    }
    answer
}

/// [`expect`] for an IPv6 packet: masqueraded with the node's IPv6 address.
fn expect6(verdict: &str, backends: &[&str], masquerade: bool, path: &str) -> Value {
    let mut answer = expect(verdict, backends, masquerade, path);
    if masquerade {
        answer["masquerade_source"] = NODE_IP6.into();
    }
    answer
}

#[test]
fn cluster_ip() {
    let d = manifests();
    let both = ["10.244.1.5:8080", "10.244.2.5:8080"];
    // From a pod (in the cluster CIDR): DNAT, no masquerade.
    assert_eq!(
        trace(&d, "10.244.3.3", "10.96.0.10", 80, "tcp", true),
        expect("dnat", &both, false, "tc")
    );
    // From outside the cluster CIDR, with a local-traffic detector: masqueraded.
    assert_eq!(
        trace(&d, "172.16.0.9", "10.96.0.10", 80, "tcp", true),
        expect("dnat", &both, true, "tc")
    );
    // Without a detector kube-proxy does not masquerade cluster IP traffic.
    assert_eq!(
        trace(&d, "172.16.0.9", "10.96.0.10", 80, "tcp", false),
        expect("dnat", &both, false, "tc")
    );
    // From the node itself: the socket programs translate it.
    assert_eq!(
        trace(&d, NODE_IP, "10.96.0.10", 80, "tcp", true),
        expect("dnat", &both, false, "socket")
    );
    // A port or protocol the Service does not have: kube-proxy's cluster-ips-check rejects it.
    assert_eq!(
        trace(&d, "10.244.3.3", "10.96.0.10", 81, "tcp", true),
        expect("reject", &[], false, "tc")
    );
    assert_eq!(
        trace(&d, "10.244.3.3", "10.96.0.10", 80, "udp", true),
        expect("reject", &[], false, "tc")
    );
    assert_eq!(
        trace(&d, NODE_IP, "10.96.0.10", 81, "tcp", true),
        expect("reject", &[], false, "socket")
    );
    // An address that is no Service's: untouched without Service CIDRs (none among these
    // manifests, no --service-cluster-ip-range).
    assert_eq!(
        trace(&d, "10.244.3.3", "10.96.7.7", 80, "tcp", true),
        expect("pass", &[], false, "tc")
    );
}

/// kube-proxy's cluster-ips-check, explained: the table says which check refused a flow; an
/// unallocated address of `--service-cluster-ip-range` is dropped on both paths, and a ServiceCIDR
/// object among the manifests wins over the flag, as the API server's objects do.
#[test]
fn the_cluster_ips_check_is_named() {
    let d = manifests();
    let range = ["--service-cluster-ip-range", "10.96.0.0/16,fd00:10:96::/64"];
    let json = |src: &str, dst: &str, dir: &tempfile::TempDir| -> Value {
        let out = trace_command(dir, src, dst, 80, "tcp", true, "json", &range);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    assert_eq!(
        json("10.244.3.3", "10.96.7.7", &d),
        expect("drop", &[], false, "tc")
    );
    assert_eq!(
        json(NODE_IP, "10.96.7.7", &d),
        expect("drop", &[], false, "socket")
    );
    assert_eq!(
        json("fd00:10:244:3::3", "fd00:10:96::77", &d),
        expect6("drop", &[], false, "tc")
    );
    assert_eq!(
        json("10.244.3.3", "10.97.0.1", &d),
        expect("pass", &[], false, "tc"),
        "outside the range"
    );
    let table = |src: &str, dst: &str, dport: u16, dir: &tempfile::TempDir| -> String {
        let out = trace_command(dir, src, dst, dport, "tcp", true, "table", &range);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = table("10.244.3.3", "10.96.0.10", 81, &d);
    assert!(
        text.contains("a cluster IP on a port no Service has (kube-proxy's cluster-ips-check)"),
        "{text}"
    );
    let text = table(NODE_IP, "10.96.7.7", 80, &d);
    assert!(
        text.contains("an address of a Service CIDR that no Service holds") && text.contains("EHOSTUNREACH"),
        "{text}"
    );
    // A ServiceCIDR object among the manifests (10.100.0.0/24) replaces the flag's ranges.
    std::fs::write(
        d.path().join("cidr.yaml"),
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.100.0.0/24]}\n",
    )
    .unwrap();
    assert_eq!(
        json("10.244.3.3", "10.100.0.9", &d),
        expect("drop", &[], false, "tc")
    );
    assert_eq!(
        json("10.244.3.3", "10.96.7.7", &d),
        expect("pass", &[], false, "tc"),
        "the flag's range is not used"
    );
}

/// `--detect-local-mode InterfaceNamePrefix` (kube-proxy's `-i lo+` here: the one link every
/// namespace has): `--in-interface` says which interface the traced packet comes in by, and a
/// pod interface's packet is not masqueraded whatever its source, any other one is.
#[test]
fn the_interface_detectors_decide_by_in_interface() {
    let d = manifests();
    let both = ["10.244.1.5:8080", "10.244.2.5:8080"];
    let traced = |src: &str, in_interface: Option<&str>| {
        let mut extra = vec![
            "--detect-local-mode",
            "InterfaceNamePrefix",
            "--pod-interface-name-prefix",
            "lo",
        ];
        if let Some(name) = in_interface {
            extra.extend(["--in-interface", name]);
        }
        trace_command(&d, src, "10.96.0.10", 80, "tcp", true, "json", &extra)
    };
    let out = traced("172.16.0.9", Some("lo"));
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let old = lb_agent::datapath::features::current().is_ok_and(|k| k.older_than(5, 15));
        assert!(
            old && err.contains("5.15"),
            "lb-agent trace --in-interface lo failed: {err}"
        );
        eprintln!("skipped: this kernel's BPF_PROG_TEST_RUN cannot set ingress_ifindex (5.15+): {err}");
        return;
    }
    let json = |out: std::process::Output| -> Value {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("JSON")
    };
    // By a pod interface: kept, even from outside the cluster CIDR (the CIDR is not the detector).
    assert_eq!(json(out), expect("dnat", &both, false, "tc"));
    // By no interface given (or any other): masqueraded, even from inside the cluster CIDR.
    assert_eq!(
        json(traced("172.16.0.9", None)),
        expect("dnat", &both, true, "tc")
    );
    assert_eq!(
        json(traced("10.244.3.3", None)),
        expect("dnat", &both, true, "tc")
    );
    // An interface that is not there is an error, not a guess.
    let out = traced("10.244.3.3", Some("lbnosuchif0"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--in-interface lbnosuchif0"));
}

#[test]
fn node_port_and_external_ip() {
    let d = manifests();
    let both = ["10.244.1.5:8080", "10.244.2.5:8080"];
    // From outside: externalTrafficPolicy=Cluster masquerades.
    assert_eq!(
        trace(&d, "192.168.50.100", NODE_IP, 30080, "tcp", true),
        expect("dnat", &both, true, "tc")
    );
    // From the node, on its address and on localhost.
    assert_eq!(
        trace(&d, NODE_IP, NODE_IP, 30080, "tcp", true),
        expect("dnat", &both, false, "socket")
    );
    assert_eq!(
        trace(&d, "127.0.0.1", "127.0.0.1", 30080, "tcp", true),
        expect("dnat", &both, false, "socket")
    );
    // An external IP is an external destination too.
    assert_eq!(
        trace(&d, "192.168.50.100", "198.51.100.50", 80, "tcp", true),
        expect("dnat", &["10.244.2.12:8080"], true, "tc")
    );
}

/// The backend Maglev gives a TCP flow from `client:sport` to `NODE_IP:node_port` among
/// `backends` (`ip`, port 8080), as `ip:port`.
fn maglev_choice(client: &str, sport: u16, node_port: u16, backends: &[&str]) -> String {
    let members: Vec<(std::net::IpAddr, u16)> = backends.iter().map(|b| (b.parse().unwrap(), 8080)).collect();
    let (addr, port) = maglev_pick(
        lb_agent::plan::maglev::HashSeed::FIXED,
        client.parse().unwrap(),
        sport,
        NODE_IP.parse().unwrap(),
        node_port,
        6,
        &members,
    );
    format!("{addr}:{port}")
}

/// Issue 17: with `--bpf-lb-algorithm maglev` a packet from outside to a NodePort is traced to its
/// own flow's backend: the JSON names the algorithm, and the table's CHOSEN is the backend the
/// Maglev table gives its source port (`--sport`), whatever the run. A cluster IP stays random.
#[test]
fn maglev_traces_the_flows_own_backend() {
    let d = manifests();
    let both = ["10.244.1.5:8080", "10.244.2.5:8080"];
    let maglev = ["--bpf-lb-algorithm", "maglev"];
    let out = trace_command(&d, "192.168.50.100", NODE_IP, 30080, "tcp", true, "json", &maglev);
    let mut want = expect("dnat", &both, true, "tc");
    want["algorithm"] = "maglev".into();
    assert_eq!(serde_json::from_slice::<Value>(&out.stdout).unwrap(), want);
    let mut chosen = std::collections::BTreeSet::new();
    for sport in 40_000..40_012u16 {
        let port = sport.to_string();
        let out = trace_command(
            &d,
            "192.168.50.100",
            NODE_IP,
            30080,
            "tcp",
            true,
            "table",
            &[maglev[0], maglev[1], "--sport", &port],
        );
        let table = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = table
            .lines()
            .find(|l| l.starts_with("CHOSEN"))
            .unwrap_or_default();
        let want = maglev_choice("192.168.50.100", sport, 30080, &["10.244.1.5", "10.244.2.5"]);
        assert_eq!(line, format!("CHOSEN    {want}"), "{table}");
        assert!(table.contains("NOTE      Maglev"), "{table}");
        chosen.insert(want);
    }
    assert_eq!(chosen.len(), 2, "source ports spread over both backends");
    let out = trace_command(&d, "10.244.1.5", "10.96.0.10", 80, "tcp", true, "json", &maglev);
    let cluster_ip: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(cluster_ip.get("algorithm"), None, "{cluster_ip}");
}

#[test]
fn external_traffic_policy_local() {
    let d = manifests();
    // From outside: local endpoints only, client source kept.
    assert_eq!(
        trace(&d, "192.168.50.100", NODE_IP, 30081, "tcp", true),
        expect("dnat", &["10.244.1.6:8080"], false, "tc")
    );
    // From a pod: short-circuited to every endpoint.
    assert_eq!(
        trace(&d, "10.244.3.3", NODE_IP, 30081, "tcp", true),
        expect("dnat", &["10.244.1.6:8080", "10.244.2.6:8080"], false, "tc")
    );
    // From the node: every endpoint too.
    assert_eq!(
        trace(&d, NODE_IP, NODE_IP, 30081, "tcp", true),
        expect("dnat", &["10.244.1.6:8080", "10.244.2.6:8080"], false, "socket")
    );
    // No local endpoint: external traffic is dropped, pod traffic still served.
    assert_eq!(
        trace(&d, "192.168.50.100", NODE_IP, 30082, "tcp", true),
        expect("drop", &[], false, "tc")
    );
    assert_eq!(
        trace(&d, "10.244.3.3", NODE_IP, 30082, "tcp", true),
        expect("dnat", &["10.244.2.7:8080"], false, "tc")
    );
}

#[test]
fn load_balancer_source_ranges() {
    let d = manifests();
    assert_eq!(
        trace(&d, "198.51.100.7", "203.0.113.10", 80, "tcp", true),
        expect("dnat", &["10.244.1.8:8080"], true, "tc")
    );
    assert_eq!(
        trace(&d, "192.168.50.100", "203.0.113.10", 80, "tcp", true),
        expect("drop", &[], false, "tc")
    );
    // The NodePort of the same Service is not filtered.
    assert_eq!(
        trace(&d, "192.168.50.100", NODE_IP, 30083, "tcp", true),
        expect("dnat", &["10.244.1.8:8080"], true, "tc")
    );
}

#[test]
fn endpoint_conditions_and_empty_services() {
    let d = manifests();
    // Only a serving, terminating endpoint: it takes new connections (KEP-1669); the not-ready
    // one never does.
    assert_eq!(
        trace(&d, "10.244.3.3", "10.96.0.14", 80, "tcp", true),
        expect("dnat", &["10.244.1.9:8080"], false, "tc")
    );
    // A ready endpoint wins over a terminating one.
    assert_eq!(
        trace(&d, "10.244.3.3", "10.96.0.15", 80, "tcp", true),
        expect("dnat", &["10.244.1.10:8080"], false, "tc")
    );
    // No endpoints: rejected, on both paths.
    assert_eq!(
        trace(&d, "10.244.3.3", "10.96.0.16", 53, "udp", true),
        expect("reject", &[], false, "tc")
    );
    assert_eq!(
        trace(&d, NODE_IP, "10.96.0.16", 53, "udp", true),
        expect("reject", &[], false, "socket")
    );
    // internalTrafficPolicy=Local with no local endpoint: dropped.
    assert_eq!(
        trace(&d, "10.244.3.3", "10.96.0.17", 80, "tcp", true),
        expect("drop", &[], false, "tc")
    );
    assert_eq!(
        trace(&d, NODE_IP, "10.96.0.17", 80, "tcp", true),
        expect("drop", &[], false, "socket")
    );
}

#[test]
fn table_output_names_the_service() {
    let d = manifests();
    require_root();
    let out = Command::new(workspace_bin("lb-agent"))
        .arg("trace")
        .arg("--manifests")
        .arg(d.path())
        .args([
            "--node-ip",
            NODE_IP,
            "--hostname-override",
            "node-a",
            "--src",
            "192.168.50.100",
            "--dst",
            NODE_IP,
            "--dport",
            "30080",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("t/web:http"), "{text}");
    assert!(text.contains("VERDICT   dnat"), "{text}");
}

#[test]
fn ipv6_cluster_ip_and_node_port() {
    let d = manifests();
    let both = ["[fd00:10:244:1::20]:8080", "[fd00:10:244:2::20]:8080"];
    // From a pod (in the IPv6 cluster CIDR): an IPv6 packet at tc, DNAT, no masquerade.
    assert_eq!(
        trace(&d, "fd00:10:244:3::3", "fd00:10:96::20", 80, "tcp", true),
        expect6("dnat", &both, false, "tc")
    );
    // From outside the cluster CIDRs, with a local-traffic detector: masqueraded with the node's
    // IPv6 address; without a detector, not.
    assert_eq!(
        trace(&d, "fd00:172:16::9", "fd00:10:96::20", 80, "tcp", true),
        expect6("dnat", &both, true, "tc")
    );
    assert_eq!(
        trace(&d, "fd00:172:16::9", "fd00:10:96::20", 80, "tcp", false),
        expect6("dnat", &both, false, "tc")
    );
    // From the node, on its IPv6 address or unbound (::1): the socket programs (connect6,
    // sendmsg6) translate it.
    for src in [NODE_IP6, "::1"] {
        assert_eq!(
            trace(&d, src, "fd00:10:96::20", 80, "tcp", true),
            expect6("dnat", &both, false, "socket"),
            "from {src}"
        );
    }
    assert_eq!(
        trace(&d, NODE_IP6, "fd00:10:96::20", 53, "udp", true),
        expect6(
            "dnat",
            &["[fd00:10:244:1::20]:5353", "[fd00:10:244:2::20]:5353"],
            false,
            "socket"
        )
    );
    // The NodePort on the node's IPv6 address: from outside (masqueraded) and from the node.
    assert_eq!(
        trace(&d, "fd00:192:168:50::100", NODE_IP6, 30090, "tcp", true),
        expect6("dnat", &both, true, "tc")
    );
    assert_eq!(
        trace(&d, NODE_IP6, NODE_IP6, 30090, "tcp", true),
        expect6("dnat", &both, false, "socket")
    );
    // The IPv4 side of the same dual-stack Service has the IPv4 endpoints.
    assert_eq!(
        trace(&d, NODE_IP, "10.96.0.20", 80, "tcp", true),
        expect("dnat", &["10.244.1.20:8080", "10.244.2.20:8080"], false, "socket")
    );
    // The table names the Service and shows the backend connect6 chose.
    let table = trace_table(&d, NODE_IP6, "fd00:10:96::20", 80, "tcp");
    assert!(table.contains("t/web6:http"), "{table}");
    assert!(
        both.iter().any(|b| table.contains(&format!("CHOSEN    {b}\n"))),
        "{table}"
    );
}

/// A dual-stack socket on the node calling `::ffff:10.96.0.10` goes through connect6 onto the
/// IPv4 maps: the IPv4 Service's answer, with IPv4 backends.
#[test]
fn ipv4_mapped_destination_takes_the_ipv4_maps() {
    let d = manifests();
    let both = ["10.244.1.5:8080", "10.244.2.5:8080"];
    // The source as an IPv4 address, IPv4-mapped (as getsockname shows it on such a socket) or
    // unbound.
    for src in [NODE_IP, "::ffff:192.168.50.11", "127.0.0.1"] {
        assert_eq!(
            trace(&d, src, "::ffff:10.96.0.10", 80, "tcp", true),
            expect("dnat", &both, false, "socket"),
            "from {src}"
        );
    }
    // The backend chosen is shown as the IPv4 address it is.
    let table = trace_table(&d, NODE_IP, "::ffff:10.96.0.10", 80, "tcp");
    assert!(table.contains("t/web:http"), "{table}");
    assert!(
        both.iter().any(|b| table.contains(&format!("CHOSEN    {b}\n"))),
        "{table}"
    );
    // An IPv4 Service without endpoints refuses the mapped call too (sendmsg).
    assert_eq!(
        trace(&d, NODE_IP, "::ffff:10.96.0.16", 53, "udp", true),
        expect("reject", &[], false, "socket")
    );
    // Not on the node: what leaves a dual-stack socket for a mapped address is an IPv4 packet,
    // and tc answers for it as for any IPv4 packet.
    for src in ["10.244.3.3", "::ffff:10.244.3.3"] {
        assert_eq!(
            trace(&d, src, "::ffff:10.96.0.10", 80, "tcp", true),
            expect("dnat", &both, false, "tc"),
            "from {src}"
        );
    }
}

#[test]
fn ipv6_reject_and_drop() {
    let d = manifests();
    // No endpoints: rejected on both paths.
    assert_eq!(
        trace(&d, "fd00:10:244:3::3", "fd00:10:96::16", 53, "udp", true),
        expect6("reject", &[], false, "tc")
    );
    assert_eq!(
        trace(&d, NODE_IP6, "fd00:10:96::16", 53, "udp", true),
        expect6("reject", &[], false, "socket")
    );
    let table = trace_table(&d, NODE_IP6, "fd00:10:96::16", 53, "udp");
    assert!(table.contains("ECONNREFUSED"), "{table}");
    // internalTrafficPolicy=Local with no local endpoint: dropped.
    assert_eq!(
        trace(&d, "fd00:10:244:3::3", "fd00:10:96::17", 80, "tcp", true),
        expect6("drop", &[], false, "tc")
    );
    assert_eq!(
        trace(&d, NODE_IP6, "fd00:10:96::17", 80, "tcp", true),
        expect6("drop", &[], false, "socket")
    );
}

/// A packet has one family: a request mixing them is refused with a clear error, never answered.
#[test]
fn mixed_families_are_refused() {
    let d = manifests();
    for (src, dst) in [
        ("10.244.3.3", "fd00:10:96::20"),
        (NODE_IP, "fd00:10:96::20"),
        ("fd00:10:244:3::3", "10.96.0.10"),
        (NODE_IP6, "10.96.0.10"),
        // An IPv6 source cannot call an IPv4-mapped address either (the kernel refuses it).
        (NODE_IP6, "::ffff:10.96.0.10"),
        ("fd00:10:244:3::3", "::ffff:10.96.0.10"),
    ] {
        let error = trace_refused(&d, src, dst, 80);
        assert!(
            error.contains("different IP families") && error.contains(src) && error.contains(dst),
            "--src {src} --dst {dst}: {error}"
        );
    }
}

/// One shape of node: what its Node object says of its addresses, and the agent's flags.
struct NodeShape {
    name: &'static str,
    /// `status.addresses` of the Node object: (type, address).
    node_addresses: &'static [(&'static str, &'static str)],
    flags: &'static [&'static str],
    /// The masquerade address kube-proxy's rules give this node, per family.
    masquerade: &'static str,
    masquerade6: &'static str,
}

/// The node's interfaces carry these (and loopback; no link-local address).
const UPLINKS: [&str; 4] = [
    "192.168.50.11",
    "172.16.0.11",
    "fd00:192:168:50::11",
    "fd00:172:16::11",
];

/// Without an IPv6 primary address, the first IPv6 NodePort address: the lower uplink.
const FIRST_UPLINK6: &str = "fd00:172:16::11";

const SHAPES: &[NodeShape] = &[
    NodeShape {
        name: "InternalIP only",
        node_addresses: &[("InternalIP", "192.168.50.11"), ("Hostname", "node-a")],
        flags: &[],
        masquerade: "192.168.50.11",
        masquerade6: FIRST_UPLINK6,
    },
    NodeShape {
        name: "ExternalIP only",
        node_addresses: &[("ExternalIP", "172.16.0.11")],
        flags: &[],
        masquerade: "172.16.0.11",
        masquerade6: FIRST_UPLINK6,
    },
    NodeShape {
        name: "both: InternalIP first",
        node_addresses: &[("ExternalIP", "192.168.50.11"), ("InternalIP", "172.16.0.11")],
        flags: &[],
        masquerade: "172.16.0.11",
        masquerade6: FIRST_UPLINK6,
    },
    NodeShape {
        name: "no addresses, --nodeport-addresses set",
        node_addresses: &[],
        flags: &["--nodeport-addresses", "172.16.0.0/16"],
        masquerade: "172.16.0.11",
        masquerade6: FIRST_UPLINK6,
    },
    NodeShape {
        name: "no addresses, --bind-address",
        node_addresses: &[],
        flags: &["--bind-address", "172.16.0.11"],
        masquerade: "172.16.0.11",
        masquerade6: FIRST_UPLINK6,
    },
    NodeShape {
        name: "an address of the other family",
        node_addresses: &[("InternalIP", "2001:db8::11"), ("ExternalIP", "172.16.0.11")],
        flags: &["--nodeport-addresses", "2001:db8::/64,primary"],
        masquerade: "172.16.0.11",
        masquerade6: "2001:db8::11",
    },
    NodeShape {
        name: "dual-stack: an InternalIP of each family",
        node_addresses: &[
            ("InternalIP", "192.168.50.11"),
            ("InternalIP", "fd00:192:168:50::11"),
        ],
        flags: &[],
        masquerade: "192.168.50.11",
        masquerade6: "fd00:192:168:50::11",
    },
    NodeShape {
        name: "dual-stack: --bind-address overrides the IPv6 one",
        node_addresses: &[("InternalIP", "172.16.0.11"), ("InternalIP", "fd00:172:16::11")],
        flags: &[
            "--bind-address",
            "fd00:192:168:50::11",
            "--nodeport-addresses",
            "primary",
        ],
        masquerade: "172.16.0.11",
        masquerade6: "fd00:192:168:50::11",
    },
];

fn node_object(addresses: &[(&str, &str)]) -> String {
    let list: Vec<Value> = addresses
        .iter()
        .map(|(kind, address)| json!({"type": kind, "address": address}))
        .collect();
    let node = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-a"}},
        "status": {"addresses": list},
    });
    format!("---\n{node}\n")
}

/// `lb-agent trace` and the agent program the same maps: for node shapes whose derivation takes
/// different fallbacks, the real agent (in a namespace whose interfaces carry `UPLINKS`) and
/// trace's scratch data path (told the same flags and `--node-ip`s) hold the same frontends,
/// backends and `lb_config`, and trace reports the masquerade address the agent programmed.
#[test]
fn trace_and_the_agent_agree_on_every_node_shape() {
    use lb_agent::{
        apply::MapOps,
        cli::Cli,
        datapath::{OBJECT, PinPaths},
        inspect::{backends_text, services_text},
        trace::ScratchDatapath,
        watch::manifests,
    };
    use lb_tests::{
        agent::{Agent, AgentOptions, bpf_root_in},
        bpffs::BpfFs,
        cgroup::Cgroup,
        netns::{NetNs, veth},
    };

    require_root();
    for shape in SHAPES {
        let dir = manifests();
        std::fs::write(dir.path().join("node.yaml"), node_object(shape.node_addresses)).unwrap();
        let mut flags = vec!["--hostname-override", "node-a", "--cluster-cidr", CLUSTER_CIDRS];
        flags.extend_from_slice(shape.flags);

        // The node's uplink: one end of a veth pair (the other in a namespace of its own).
        let ns = NetNs::new("lbshape");
        let peer = NetNs::new("lbpeer");
        veth(&ns, "up0", None, &peer, "up0p", None);
        // Exactly UPLINKS: no link-local address (the agent would serve NodePorts there too),
        // and IPv6 addresses usable at once (no duplicate address detection).
        ns.ip(&["link", "set", "up0", "addrgenmode", "none"]);
        ns.ip(&["-6", "addr", "flush", "dev", "up0", "scope", "link"]);
        for addr in UPLINKS {
            if addr.contains(':') {
                ns.ip(&["-6", "addr", "add", &format!("{addr}/64"), "dev", "up0", "nodad"]);
            } else {
                ns.ip(&["addr", "add", &format!("{addr}/24"), "dev", "up0"]);
            }
        }
        let cgroup = Cgroup::new("lbshape");
        let bpffs = BpfFs::new();
        let bpf_root = bpf_root_in(bpffs.path());
        let agent = Agent::start(AgentOptions {
            netns: &ns,
            cgroup: &cgroup,
            bpf_root: bpf_root.clone(),
            node_name: "node-a".into(),
            manifests: Some(dir.path().to_path_buf()),
            kubeconfig: None,
            extra_args: flags.iter().skip(2).map(|s| s.to_string()).collect(),
        });
        let pinned = lb_agent::apply::KernelMaps::from_pins(&PinPaths::new(&bpf_root).maps())
            .unwrap_or_else(|e| panic!("{}: the agent's pinned maps: {e}", shape.name));
        let agent_snap = pinned.snapshot().expect("snapshot");
        let agent_config = pinned.config.get(&0, 0).expect("lb_config");

        let cli =
            <Cli as clap::Parser>::try_parse_from(std::iter::once("lb-agent").chain(flags.iter().copied()))
                .expect("flags");
        let settings = cli.run.node.settings().expect("settings");
        let loaded = manifests::load_dir(dir.path(), "node-a").expect("manifests");
        let uplinks: Vec<std::net::IpAddr> = UPLINKS.iter().map(|a| a.parse().unwrap()).collect();
        let scratch = ScratchDatapath::new(&loaded.state, settings, &uplinks, OBJECT).expect("scratch");
        let scratch_snap = scratch.maps().snapshot().expect("snapshot");
        let scratch_config = scratch.maps().config.get(&0, 0).expect("lb_config");

        let flows = Default::default();
        assert_eq!(
            services_text(&scratch_snap, &flows),
            services_text(&agent_snap, &flows),
            "{}: trace's frontends differ from the agent's",
            shape.name
        );
        // Backend ids aside: IPv6 ids start after the IPv4 range, whose size is the backends
        // map's capacity, and trace's scratch maps are smaller than the agent's.
        let without_ids = |text: String| -> Vec<String> {
            text.lines()
                .map(|l| {
                    l.split_once(' ')
                        .map_or(l, |(_, rest)| rest)
                        .trim_start()
                        .to_string()
                })
                .collect()
        };
        assert_eq!(
            without_ids(backends_text(&scratch_snap)),
            without_ids(backends_text(&agent_snap)),
            "{}: trace's backends differ from the agent's",
            shape.name
        );
        // Aside too: whether the programs look routes up for per-interface masquerade addresses
        // (`MASQUERADE_BY_INTERFACE`). The agent reads its interfaces' addresses; trace's scratch
        // data path stands for the node without its interfaces, so its flows are masqueraded
        // with the node IP, the address asserted below.
        let host_cookie_aside = |mut c: lb_common::config::DatapathConfig| {
            c.host_netns_cookie = 0;
            c.flags &= !lb_common::config::flags::MASQUERADE_BY_INTERFACE;
            c
        };
        assert_eq!(
            host_cookie_aside(scratch_config),
            host_cookie_aside(agent_config),
            "{}: trace's lb_config differs from the agent's",
            shape.name
        );
        assert_eq!(
            std::net::Ipv4Addr::from(agent_config.v4.snat_addr).to_string(),
            shape.masquerade,
            "{}: the agent's masquerade address",
            shape.name
        );
        assert_eq!(
            std::net::Ipv6Addr::from(agent_config.v6.snat_addr).to_string(),
            shape.masquerade6,
            "{}: the agent's IPv6 masquerade address",
            shape.name
        );

        // And what the command says: a NodePort from outside is masqueraded with that address.
        let nodeport_address = if shape.masquerade == "172.16.0.11" {
            "172.16.0.11"
        } else {
            "192.168.50.11"
        };
        // The same in IPv6: the dual-stack Service's NodePort on the node's IPv6 masquerade
        // address (a NodePort address in every shape).
        for (src, dst, port, masquerade) in [
            ("203.0.113.7", nodeport_address, "30080", shape.masquerade),
            ("fd00:203::7", shape.masquerade6, "30090", shape.masquerade6),
        ] {
            let mut cmd = Command::new(workspace_bin("lb-agent"));
            cmd.arg("trace").arg("--manifests").arg(dir.path());
            for addr in UPLINKS {
                cmd.args(["--node-ip", addr]);
            }
            cmd.args(&flags)
                .args(["--src", src, "--dst", dst, "--dport", port, "-o", "json"]);
            let out = cmd.output().expect("lb-agent trace");
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let answer: Value = serde_json::from_slice(&out.stdout).expect("JSON");
            assert_eq!(answer["verdict"], "dnat", "{}: {dst}: {answer}", shape.name);
            assert_eq!(
                answer["masquerade_source"], masquerade,
                "{}: trace's masquerade address for {dst}",
                shape.name
            );
        }
        agent.stop();
    }
}

/// Issue 17: SCTP is traced through the tc path, like any packet the node's sockets do not send:
/// from a pod and from outside, translated (masqueraded from outside); from the node itself
/// (no socket hook runs for SCTP) through tc egress's `lb_tc_sctp_out`, translated, not
/// masqueraded, with the note saying how (and why it is dropped, not rejected, without endpoints).
#[test]
fn sctp_is_traced_through_tc_and_from_the_node_explained() {
    let dir = tempfile::tempdir().unwrap();
    write_manifests(
        dir.path(),
        "sctp.yaml",
        &[
            service("t", "diameter")
                .cluster_ip("10.96.0.40")
                .port("diameter", "SCTP", 3868, 13868)
                .node_port(30868)
                .build(),
            service("t", "sctp-empty")
                .cluster_ip("10.96.0.41")
                .port("s", "SCTP", 9, 9)
                .build(),
        ],
        &[slice("t", "diameter", "diameter-1")
            .endpoint("10.244.2.7", "node-b", State::Ready)
            .port("diameter", "SCTP", 13868)
            .build()],
    );
    let backend = ["10.244.2.7:13868"];
    assert_eq!(
        trace(&dir, "10.244.3.3", "10.96.0.40", 3868, "sctp", true),
        expect("dnat", &backend, false, "tc")
    );
    assert_eq!(
        trace(&dir, "192.168.50.100", NODE_IP, 30868, "sctp", true),
        expect("dnat", &backend, true, "tc")
    );
    assert_eq!(
        trace(&dir, NODE_IP, "10.96.0.40", 3868, "sctp", true),
        expect("dnat", &backend, false, "tc")
    );
    let table = trace_table(&dir, NODE_IP, "10.96.0.40", 3868, "sctp");
    assert!(
        table.contains("NOTE") && table.contains("no socket hook") && table.contains("lb_tc_sctp_out"),
        "{table}"
    );
    // Without endpoints the node's own SCTP is dropped, not answered: the note says why.
    assert_eq!(
        trace(&dir, NODE_IP, "10.96.0.41", 9, "sctp", true)["verdict"],
        "reject"
    );
    let table = trace_table(&dir, NODE_IP, "10.96.0.41", 9, "sctp");
    assert!(table.contains("dropped at tc egress"), "{table}");
}
