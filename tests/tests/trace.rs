//! `lb-agent trace --manifests`: the data path's answer for one packet, for the cases kube-proxy
//! documents (cluster IP from a pod and from off-cluster, NodePort from outside and from the node,
//! LoadBalancer source ranges, both traffic policies, terminating endpoints, no endpoints).

use std::process::Command;

use lb_tests::{
    fixtures::{State, service, slice, write_manifests},
    process::workspace_bin,
    require_root,
};
use serde_json::{Value, json};

const NODE_IP: &str = "192.168.50.11";

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
    require_root();
    let mut cmd = Command::new(workspace_bin("lb-agent"));
    cmd.arg("trace").arg("--manifests").arg(dir.path());
    cmd.args([
        "--node-ip",
        NODE_IP,
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
        "json",
    ]);
    if cluster_cidr {
        cmd.args(["--cluster-cidr", "10.244.0.0/16"]);
    }
    let out = cmd.output().expect("run lb-agent trace");
    assert!(
        out.status.success(),
        "lb-agent trace failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn expect(verdict: &str, backends: &[&str], masquerade: bool, path: &str) -> Value {
    json!({"verdict": verdict, "backends": backends, "masquerade": masquerade, "path": path})
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
    // A port or protocol the Service does not have: untouched.
    assert_eq!(
        trace(&d, "10.244.3.3", "10.96.0.10", 81, "tcp", true),
        expect("pass", &[], false, "tc")
    );
    assert_eq!(
        trace(&d, "10.244.3.3", "10.96.0.10", 80, "udp", true),
        expect("pass", &[], false, "tc")
    );
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
