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
    let mut answer =
        json!({"verdict": verdict, "backends": backends, "masquerade": masquerade, "path": path});
    if masquerade {
        // No Node object and no --bind-address: the first NodePort address, the only uplink.
        answer["masquerade_source"] = NODE_IP.into();
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

/// One shape of node: what its Node object says of its addresses, and the agent's flags.
struct NodeShape {
    name: &'static str,
    /// `status.addresses` of the Node object: (type, address).
    node_addresses: &'static [(&'static str, &'static str)],
    flags: &'static [&'static str],
    /// The masquerade address kube-proxy's rules give this node.
    masquerade: &'static str,
}

/// The node's interfaces carry both of these (and loopback).
const UPLINKS: [&str; 2] = ["192.168.50.11", "172.16.0.11"];

const SHAPES: &[NodeShape] = &[
    NodeShape {
        name: "InternalIP only",
        node_addresses: &[("InternalIP", "192.168.50.11"), ("Hostname", "node-a")],
        flags: &[],
        masquerade: "192.168.50.11",
    },
    NodeShape {
        name: "ExternalIP only",
        node_addresses: &[("ExternalIP", "172.16.0.11")],
        flags: &[],
        masquerade: "172.16.0.11",
    },
    NodeShape {
        name: "both: InternalIP first",
        node_addresses: &[("ExternalIP", "192.168.50.11"), ("InternalIP", "172.16.0.11")],
        flags: &[],
        masquerade: "172.16.0.11",
    },
    NodeShape {
        name: "no addresses, --nodeport-addresses set",
        node_addresses: &[],
        flags: &["--nodeport-addresses", "172.16.0.0/16"],
        masquerade: "172.16.0.11",
    },
    NodeShape {
        name: "no addresses, --bind-address",
        node_addresses: &[],
        flags: &["--bind-address", "172.16.0.11"],
        masquerade: "172.16.0.11",
    },
    NodeShape {
        name: "an address of the other family",
        node_addresses: &[("InternalIP", "2001:db8::11"), ("ExternalIP", "172.16.0.11")],
        flags: &["--nodeport-addresses", "2001:db8::/64,primary"],
        masquerade: "172.16.0.11",
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
        let mut flags = vec!["--hostname-override", "node-a", "--cluster-cidr", "10.244.0.0/16"];
        flags.extend_from_slice(shape.flags);

        // The node's uplink: one end of a veth pair (the other in a namespace of its own).
        let ns = NetNs::new("lbshape");
        let peer = NetNs::new("lbpeer");
        veth(&ns, "up0", None, &peer, "up0p", None);
        for addr in UPLINKS {
            ns.ip(&["addr", "add", &format!("{addr}/24"), "dev", "up0"]);
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
            .expect("the agent's pinned maps");
        let agent_snap = pinned.snapshot().expect("snapshot");
        let agent_config = pinned.config.get(&0, 0).expect("lb_config");

        let cli =
            <Cli as clap::Parser>::try_parse_from(std::iter::once("lb-agent").chain(flags.iter().copied()))
                .expect("flags");
        let settings = cli.run.node.settings().expect("settings");
        let loaded = manifests::load_dir(dir.path(), "node-a").expect("manifests");
        let uplinks: Vec<std::net::Ipv4Addr> = UPLINKS.iter().map(|a| a.parse().unwrap()).collect();
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
        assert_eq!(
            backends_text(&scratch_snap),
            backends_text(&agent_snap),
            "{}: trace's backends differ from the agent's",
            shape.name
        );
        let host_cookie_aside = |mut c: lb_common::config::DatapathConfig| {
            c.host_netns_cookie = 0;
            c
        };
        assert_eq!(
            host_cookie_aside(scratch_config),
            host_cookie_aside(agent_config),
            "{}: trace's lb_config differs from the agent's",
            shape.name
        );
        assert_eq!(
            std::net::Ipv4Addr::from(agent_config.snat_addr).to_string(),
            shape.masquerade,
            "{}: the agent's masquerade address",
            shape.name
        );

        // And what the command says: a NodePort from outside is masqueraded with that address.
        let nodeport_address = if shape.masquerade == "172.16.0.11" {
            "172.16.0.11"
        } else {
            "192.168.50.11"
        };
        let mut cmd = Command::new(workspace_bin("lb-agent"));
        cmd.arg("trace").arg("--manifests").arg(dir.path());
        for addr in UPLINKS {
            cmd.args(["--node-ip", addr]);
        }
        cmd.args(&flags).args([
            "--src",
            "203.0.113.7",
            "--dst",
            nodeport_address,
            "--dport",
            "30080",
            "-o",
            "json",
        ]);
        let out = cmd.output().expect("lb-agent trace");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let answer: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(answer["verdict"], "dnat", "{}: {answer}", shape.name);
        assert_eq!(
            answer["masquerade_source"], shape.masquerade,
            "{}: trace's masquerade address",
            shape.name
        );
        agent.stop();
    }
}
