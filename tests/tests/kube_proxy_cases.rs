//! kube-proxy's own packet-flow cases, asked of `lb-agent trace`: the Services, EndpointSlices,
//! node addresses and flags of a kube-proxy unit test, and for each packet of its
//! `runPacketFlowTests` table the endpoints it may reach and whether it is masqueraded. The cases
//! are `TestNodePorts` of `pkg/proxy/nftables/proxier_test.go` (the same table as the iptables
//! proxier's), in both families: kube-proxy runs one proxier per family, and its IPv6 cases are
//! what this agent's IPv6 path must answer.
//!
//! One difference in kind, not in result: kube-proxy masquerades "node to nodePort" packets
//! (`masq: true`); here a socket of the node is translated at connect() and its source is already
//! a node address, so `trace` says path `socket`, masquerade `false` (the backend sees a node
//! address either way).

use std::{fs, process::Command};

use lb_tests::{process::workspace_bin, require_root};
use serde_json::Value;

/// `testNodeName`, `testNodeIPs` and the fake proxier's defaults (`NewFakeProxier`): its pod CIDR
/// per family, and NodePorts on the primary node IP of each family only.
const NODE_NAME: &str = "test-node";
const NODE_IPS: &str = "192.168.0.2,192.168.1.2,192.168.99.11,2001:db8::1,2001:db8:1::2";
const POD_CIDRS: &str = "10.0.0.0/8,fd00:10::/64";
const DEFAULT_NODEPORT_ADDRESSES: &str = "192.168.0.2/32,2001:db8::1/128";

/// One family's addresses in `TestNodePorts`.
struct Family {
    name: &'static str,
    svc_ip: &'static str,
    ep1: &'static str,
    ep2: &'static str,
    node_ip: &'static str,
    alt_node_ip: &'static str,
    pod_ip: &'static str,
    external_client: &'static str,
}

const IPV4: Family = Family {
    name: "IPv4",
    svc_ip: "172.30.0.41",
    ep1: "10.180.0.1",
    ep2: "10.180.2.1",
    node_ip: "192.168.0.2",
    alt_node_ip: "192.168.1.2",
    pod_ip: "10.0.0.2",
    external_client: "203.0.113.2",
};

const IPV6: Family = Family {
    name: "IPv6",
    svc_ip: "fd00:172:30::41",
    ep1: "fd00:10:180::1",
    ep2: "fd00:10:180::2:1",
    node_ip: "2001:db8::1",
    alt_node_ip: "2001:db8:1::2",
    pod_ip: "fd00:10::2",
    external_client: "2600:5200::1",
};

/// `svc1` (NodePort 3001 -> port 80) and its slice, of one family, as `TestNodePorts` makes them.
fn manifests(f: &Family) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = format!(
        r#"---
apiVersion: v1
kind: Service
metadata: {{name: svc1, namespace: ns1}}
spec:
  type: NodePort
  ipFamilies: [{family}]
  clusterIP: "{svc_ip}"
  clusterIPs: ["{svc_ip}"]
  ports: [{{name: p80, port: 80, protocol: TCP, nodePort: 3001}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: svc1-1
  namespace: ns1
  labels: {{kubernetes.io/service-name: svc1}}
addressType: {family}
ports: [{{name: p80, port: 80, protocol: TCP}}]
endpoints:
- addresses: ["{ep1}"]
  nodeName: other-node
- addresses: ["{ep2}"]
  nodeName: {NODE_NAME}
"#,
        family = f.name,
        svc_ip = f.svc_ip,
        ep1 = f.ep1,
        ep2 = f.ep2,
    );
    fs::write(dir.path().join("svc1.yaml"), yaml).expect("write manifests");
    dir
}

/// One packet of a `runPacketFlowTests` table.
struct Flow<'a> {
    name: &'a str,
    source: &'a str,
    dest: &'a str,
    port: u16,
    /// The endpoints it may reach ("" when it is not a Service's).
    output: String,
    masq: bool,
}

fn trace(dir: &tempfile::TempDir, nodeport_addresses: &str, flow: &Flow) -> Value {
    let out = Command::new(workspace_bin("lb-agent"))
        .arg("trace")
        .arg("--manifests")
        .arg(dir.path())
        .args(["--node-ip", NODE_IPS, "--hostname-override", NODE_NAME])
        .args([
            "--cluster-cidr",
            POD_CIDRS,
            "--nodeport-addresses",
            nodeport_addresses,
        ])
        .args([
            "--src",
            flow.source,
            "--dst",
            flow.dest,
            "--dport",
            &flow.port.to_string(),
        ])
        .args(["-o", "json"])
        .output()
        .expect("run lb-agent trace");
    assert!(
        out.status.success(),
        "{}: lb-agent trace failed: {}",
        flow.name,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// Asserts `trace`'s answer for each flow: kube-proxy's endpoints, and its masquerade decision
/// where the packet crosses tc (see the module doc for packets from the node).
fn run_packet_flow_tests(case: &str, dir: &tempfile::TempDir, nodeport_addresses: &str, flows: &[Flow]) {
    for flow in flows {
        let got = trace(dir, nodeport_addresses, flow);
        let backends: Vec<&str> = got["backends"]
            .as_array()
            .expect("backends")
            .iter()
            .map(|b| b.as_str().expect("a string"))
            .collect();
        let what = format!(
            "{case}: {} ({} -> {}:{}): {got}",
            flow.name, flow.source, flow.dest, flow.port
        );
        assert_eq!(backends.join(", "), flow.output, "{what}");
        let expected_verdict = if flow.output.is_empty() { "pass" } else { "dnat" };
        assert_eq!(got["verdict"], expected_verdict, "{what}");
        if got["path"] == "tc" {
            assert_eq!(got["masquerade"], flow.masq, "{what}");
        } else {
            assert_eq!(got["path"], "socket", "{what}");
            assert_eq!(
                flow.source, flow.dest,
                "only node-to-node flows take the socket path: {what}"
            );
        }
    }
}

/// `[ep]:80` as Go's `net.JoinHostPort` writes it.
fn join_host_port(ip: &str) -> String {
    if ip.contains(':') {
        format!("[{ip}]:80")
    } else {
        format!("{ip}:80")
    }
}

/// `TestNodePorts`: its four cases (each family, with the default NodePort addresses and with a
/// list of CIDRs of both families), the same packets and answers.
#[test]
fn test_node_ports() {
    require_root();
    let cases: [(&str, &Family, Option<&str>, bool); 4] = [
        ("ipv4", &IPV4, None, false),
        (
            "ipv4, multiple nodeport-addresses",
            &IPV4,
            Some("192.168.0.0/24,192.168.1.0/24,2001:db8::/64"),
            true,
        ),
        ("ipv6", &IPV6, None, false),
        (
            "ipv6, multiple nodeport-addresses",
            &IPV6,
            Some("192.168.0.0/24,192.168.1.0/24,2001:db8::/64,2001:db8:1::2/128"),
            true,
        ),
    ];
    for (name, f, nodeport_addresses, allow_alt_node_ip) in cases {
        let dir = manifests(f);
        let nodeport_addresses = nodeport_addresses.unwrap_or(DEFAULT_NODEPORT_ADDRESSES);
        let output = format!("{}, {}", join_host_port(f.ep1), join_host_port(f.ep2));
        let mut flows = vec![
            Flow {
                name: "pod to cluster IP",
                source: f.pod_ip,
                dest: f.svc_ip,
                port: 80,
                output: output.clone(),
                masq: false,
            },
            Flow {
                name: "external to nodePort",
                source: f.external_client,
                dest: f.node_ip,
                port: 3001,
                output: output.clone(),
                masq: true,
            },
            Flow {
                name: "node to nodePort",
                source: f.node_ip,
                dest: f.node_ip,
                port: 3001,
                output: output.clone(),
                masq: true,
            },
        ];
        flows.push(if allow_alt_node_ip {
            Flow {
                name: "external to nodePort on secondary IP",
                source: f.external_client,
                dest: f.alt_node_ip,
                port: 3001,
                output,
                masq: true,
            }
        } else {
            Flow {
                name: "secondary nodeIP ignores NodePorts",
                source: f.external_client,
                dest: f.alt_node_ip,
                port: 3001,
                output: String::new(),
                masq: false,
            }
        });
        run_packet_flow_tests(name, &dir, nodeport_addresses, &flows);
    }
}
