//! Packet fixtures for the tc programs, run with BPF_PROG_TEST_RUN against scratch maps programmed
//! by the agent's own pipeline. Every output is compared byte for byte with an independently built
//! expected packet, and every checksum is verified by recomputation.
//!
//! Written once for both families: the Services are dual-stack (`Svc::dual_stack`, an IPv6
//! EndpointSlice beside each IPv4 one), the node has an address of each family, and a test runs
//! its steps `for f in FAMILIES` with IPv4 literals that `Family::ip` maps to their IPv6
//! counterparts (`10.96.0.10` is `fd00:10:96::10`). What only one family has (IPv4 options,
//! IPv6 extension headers and atomic fragments, neighbour discovery) has tests of its own.

use std::net::{IpAddr, Ipv4Addr};

use lb_agent::{
    datapath::{OBJECT, TcRun},
    node::NodeSettings,
    plan::maglev::HashSeed,
    trace::ScratchDatapath,
    watch::ClusterState,
};
use lb_common::{
    conntrack::{CtKey, CtValue},
    stats::Counter,
};
use lb_tests::{
    fixtures::{Slice, State, Svc, maglev_pick, service, slice},
    packet::{
        self, DSTOPTS, ETH_HLEN, FAMILIES, Family, Fragment, HOPOPTS, IcmpError, ROUTING, Spec, patched,
        rewritten, summary, verify_checksums,
    },
    require_root,
};

const OK: i32 = 0;
const SHOT: i32 = 2;
const REDIRECT: i32 = 7;
/// The node's address (and, through `Family::ip`, its IPv6 one).
const NODE_IP: &str = "192.168.50.11";
const CLIENT: &str = "192.168.50.100";

/// Adds a dual-stack Service, and its endpoints (a slice written with IPv4 addresses) in both
/// families.
fn add(s: &mut ClusterState, svc: Svc, endpoints: Option<Slice>) {
    s.add_service(svc.dual_stack().build());
    for family in FAMILIES {
        if let Some(sl) = &endpoints {
            s.add_slice(sl.clone().in_family(family).build());
        }
    }
}

fn state() -> ClusterState {
    let mut s = ClusterState::default();
    add(
        &mut s,
        service("t", "web")
            .cluster_ip("10.96.0.10")
            .port("http", "TCP", 80, 8080),
        Some(
            slice("t", "web", "web-1")
                .endpoint("10.244.1.5", "node-a", State::Ready)
                .port("http", "TCP", 8080),
        ),
    );
    add(
        &mut s,
        service("t", "np")
            .cluster_ip("10.96.0.11")
            .port("http", "TCP", 80, 8080)
            .node_port(30080),
        Some(
            slice("t", "np", "np-1")
                .endpoint("10.244.2.7", "node-b", State::Ready)
                .port("http", "TCP", 8080),
        ),
    );
    add(
        &mut s,
        service("t", "local")
            .cluster_ip("10.96.0.12")
            .port("http", "TCP", 80, 8080)
            .node_port(30081)
            .external_traffic_policy("Local"),
        Some(
            slice("t", "local", "local-1")
                .endpoint("10.244.1.6", "node-a", State::Ready)
                .endpoint("10.244.2.8", "node-b", State::Ready)
                .port("http", "TCP", 8080),
        ),
    );
    add(
        &mut s,
        service("t", "local-none")
            .cluster_ip("10.96.0.13")
            .port("http", "TCP", 80, 8080)
            .node_port(30082)
            .external_traffic_policy("Local"),
        Some(
            slice("t", "local-none", "ln-1")
                .endpoint("10.244.2.9", "node-b", State::Ready)
                .port("http", "TCP", 8080),
        ),
    );
    add(
        &mut s,
        service("t", "empty")
            .cluster_ip("10.96.0.14")
            .port("http", "TCP", 80, 8080)
            .port("dns", "UDP", 53, 5353),
        None,
    );
    add(
        &mut s,
        service("t", "lb")
            .cluster_ip("10.96.0.15")
            .port("http", "TCP", 80, 8080)
            .node_port(30083)
            .load_balancer_ip("203.0.113.10")
            .source_ranges(&["198.51.100.0/24"]),
        Some(
            slice("t", "lb", "lb-1")
                .endpoint("10.244.1.5", "node-a", State::Ready)
                .port("http", "TCP", 8080),
        ),
    );
    add(
        &mut s,
        service("t", "dns")
            .cluster_ip("10.96.0.16")
            .port("dns", "UDP", 53, 5353),
        Some(
            slice("t", "dns", "dns-1")
                .endpoint("10.244.1.5", "node-a", State::Ready)
                .port("dns", "UDP", 5353),
        ),
    );
    s
}

fn settings(cluster_cidr: bool) -> NodeSettings {
    NodeSettings {
        cluster_cidrs: if cluster_cidr {
            FAMILIES.map(|f| f.net("10.244.0.0/16").parse().unwrap()).to_vec()
        } else {
            vec![]
        },
        ..NodeSettings::new("node-a")
    }
}

fn scratch_with(state: &ClusterState, cluster_cidr: bool) -> ScratchDatapath {
    require_root();
    assert!(
        !OBJECT.is_empty(),
        "lb-agent was built without the eBPF object: run through ./x test"
    );
    let node_ips: Vec<IpAddr> = FAMILIES.iter().map(|f| f.ip(NODE_IP)).collect();
    ScratchDatapath::new(state, settings(cluster_cidr), &node_ips, OBJECT).expect("scratch data path")
}

fn scratch(cluster_cidr: bool) -> ScratchDatapath {
    scratch_with(&state(), cluster_cidr)
}

/// The scratch data path with a new-flow table (`lb4_ct_new`, `lb6_ct_new`) of `capacity` entries.
fn scratch_with_new_flow_capacity(capacity: u32) -> ScratchDatapath {
    let node_ips: Vec<IpAddr> = FAMILIES.iter().map(|f| f.ip(NODE_IP)).collect();
    let caps = lb_common::catalog::Capacities {
        conntrack_new: capacity,
        ..lb_agent::trace::SCRATCH_CAPACITIES
    };
    ScratchDatapath::with_capacities(&state(), settings(true), &node_ips, OBJECT, caps)
        .expect("scratch data path")
}

fn ingress(s: &mut ScratchDatapath, pkt: &[u8]) -> TcRun {
    s.datapath.test_run_tc("lb_tc_ingress", pkt, 1).expect("test run")
}

fn egress(s: &mut ScratchDatapath, pkt: &[u8]) -> TcRun {
    s.datapath.test_run_tc("lb_tc_egress", pkt, 1).expect("test run")
}

fn egress_marked(s: &mut ScratchDatapath, pkt: &[u8], mark: u32) -> TcRun {
    s.datapath
        .test_run_tc_with_mark("lb_tc_egress", pkt, mark)
        .expect("egress")
}

fn counter(s: &ScratchDatapath, c: Counter) -> u64 {
    s.maps().counter(c as u32)
}

/// A TCP packet of family `f` between the counterparts of two IPv4 literals.
fn tcp(f: Family, src: &str, sport: u16, dst: &str, dport: u16) -> Spec {
    packet::tcp(&f.addr(src), sport, &f.addr(dst), dport)
}

fn udp(f: Family, src: &str, sport: u16, dst: &str, dport: u16) -> Spec {
    packet::udp(&f.addr(src), sport, &f.addr(dst), dport)
}

/// `packet::rewritten`, the addresses given as IPv4 literals of family `f`.
fn nat(f: Family, pkt: &[u8], src: Option<(&str, u16)>, dst: Option<(&str, u16)>) -> Vec<u8> {
    let src = src.map(|(a, p)| (f.addr(a), p));
    let dst = dst.map(|(a, p)| (f.addr(a), p));
    rewritten(
        pkt,
        src.as_ref().map(|(a, p)| (a.as_str(), *p)),
        dst.as_ref().map(|(a, p)| (a.as_str(), *p)),
    )
}

/// `packet::patched` (a quote's translation), the addresses given as IPv4 literals of `f`.
fn quote_nat(f: Family, pkt: &[u8], src: Option<(&str, u16)>, dst: Option<(&str, u16)>) -> Vec<u8> {
    let src = src.map(|(a, p)| (f.addr(a), p));
    let dst = dst.map(|(a, p)| (f.addr(a), p));
    patched(
        pkt,
        src.as_ref().map(|(a, p)| (a.as_str(), *p)),
        dst.as_ref().map(|(a, p)| (a.as_str(), *p)),
    )
}

fn assert_bytes(actual: &[u8], expected: &[u8], what: impl std::fmt::Display) {
    verify_checksums(actual).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(
        actual,
        expected,
        "{what}: got {:?}, expected {:?}",
        summary(actual),
        summary(expected)
    );
}

/// Byte-for-byte, for packets that are not TCP/UDP (ICMP errors).
fn assert_same(actual: &[u8], expected: &[u8], what: impl std::fmt::Display) {
    verify_checksums(actual).unwrap_or_else(|e| panic!("{what}: {e}"));
    packet::verify_quoted_ip_checksum(actual).unwrap_or_else(|e| panic!("{what}: {e}"));
    if let Some(i) = (0..actual.len().max(expected.len())).find(|i| actual.get(*i) != expected.get(*i)) {
        panic!(
            "{what}: byte {i} differs (lengths {} and {})\n  got      {}\n  expected {}",
            actual.len(),
            expected.len(),
            hex(actual),
            hex(expected)
        );
    }
}

fn hex(p: &[u8]) -> String {
    p.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn syn_to_a_cluster_ip_is_translated_to_the_backend() {
    let mut s = scratch(true);
    for f in FAMILIES {
        // A pod on another node calls the ClusterIP through this node: no masquerade (a pod
        // source).
        let syn = tcp(f, "10.244.2.20", 40000, "10.96.0.10", 80).build();
        let out = ingress(&mut s, &syn);
        assert_eq!(out.action, OK, "{f:?}");
        assert_bytes(
            &out.packet,
            &nat(f, &syn, None, Some(("10.244.1.5", 8080))),
            format!("{f:?} DNAT"),
        );
        // Leaving towards the backend: nothing to masquerade.
        let out2 = egress(&mut s, &out.packet);
        assert_bytes(&out2.packet, &out.packet, format!("{f:?} egress of a pod's flow"));
    }
}

#[test]
fn an_established_flow_keeps_its_backend_when_endpoints_change() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let syn = tcp(f, "10.244.2.20", 40001, "10.96.0.10", 80).build();
        assert_eq!(summary(&ingress(&mut s, &syn).packet).dst, f.ip("10.244.1.5"));
        // The endpoint (of this family) is replaced.
        let mut changed = state();
        changed.add_slice(
            slice("t", "web", "web-1")
                .endpoint("10.244.1.99", "node-a", State::Ready)
                .port("http", "TCP", 8080)
                .in_family(f)
                .build(),
        );
        s.program(&changed).unwrap();
        let data = tcp(f, "10.244.2.20", 40001, "10.96.0.10", 80)
            .data(b"GET / HTTP/1.1\r\n\r\n")
            .build();
        let out = ingress(&mut s, &data);
        assert_bytes(
            &out.packet,
            &nat(f, &data, None, Some(("10.244.1.5", 8080))),
            format!("{f:?} established flow"),
        );
        // A new connection goes to the new endpoint.
        let syn2 = tcp(f, "10.244.2.20", 40002, "10.96.0.10", 80).build();
        assert_eq!(summary(&ingress(&mut s, &syn2).packet).dst, f.ip("10.244.1.99"));
    }
}

#[test]
fn replies_get_the_frontend_back_on_the_way_out() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let syn = tcp(f, "10.244.2.20", 40003, "10.96.0.10", 80).build();
        ingress(&mut s, &syn);
        let reply = tcp(f, "10.244.1.5", 8080, "10.244.2.20", 40003)
            .data(b"HTTP/1.1 200 OK\r\n")
            .build();
        // At ingress (from the backend's veth) the reply passes: reverse NAT is for the egress
        // side.
        let at_ingress = ingress(&mut s, &reply);
        assert_bytes(&at_ingress.packet, &reply, format!("{f:?} reply at ingress"));
        let out = egress(&mut s, &reply);
        assert_eq!(out.action, OK);
        assert_bytes(
            &out.packet,
            &nat(f, &reply, Some(("10.96.0.10", 80)), None),
            format!("{f:?} reverse NAT"),
        );
    }
}

#[test]
fn nodeport_from_outside_is_translated_and_masqueraded_both_ways() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let syn = tcp(f, CLIENT, 41000, NODE_IP, 30080).build();
        let dnat = ingress(&mut s, &syn);
        assert_bytes(
            &dnat.packet,
            &nat(f, &syn, None, Some(("10.244.2.7", 8080))),
            format!("{f:?} NodePort DNAT"),
        );
        // Routed towards node b: the source becomes this node (its address of the family).
        let snat = egress(&mut s, &dnat.packet);
        let port = summary(&snat.packet).sport;
        assert!((20_000..=29_999).contains(&port), "masquerade port {port}");
        assert_bytes(
            &snat.packet,
            &nat(f, &dnat.packet, Some((NODE_IP, port)), None),
            format!("{f:?} SNAT"),
        );
        // The reply comes back to this node's address and masquerade port...
        let reply = tcp(f, "10.244.2.7", 8080, NODE_IP, port).data(b"pong").build();
        let unsnat = ingress(&mut s, &reply);
        assert_bytes(
            &unsnat.packet,
            &nat(f, &reply, None, Some((CLIENT, 41000))),
            format!("{f:?} un-SNAT"),
        );
        // ... and leaves from the NodePort the client called: egress sees the mark ingress set
        // (handed over explicitly, as the kernel would carry it on the skb).
        assert_ne!(unsnat.mark, 0, "ingress marks un-SNATed replies");
        let out = egress_marked(&mut s, &unsnat.packet, unsnat.mark);
        assert_eq!(out.mark, 0, "egress clears the mark");
        assert_bytes(
            &out.packet,
            &nat(f, &unsnat.packet, Some((NODE_IP, 30080)), None),
            format!("{f:?} reverse NAT to the NodePort"),
        );
        // A second connection from the same client gets its own masquerade port.
        let syn2 = tcp(f, CLIENT, 41001, NODE_IP, 30080).build();
        let dnat2 = ingress(&mut s, &syn2).packet;
        let snat2 = egress(&mut s, &dnat2);
        assert_ne!(summary(&snat2.packet).sport, port);
    }
}

/// Issue 21: a masqueraded flow gets the address of the interface its backend is routed by, as
/// MASQUERADE does, not one address for the whole node. In a namespace of its own (the programs'
/// route lookup is the calling thread's namespace's), interface d0 has the node IP's subnet and
/// d1 two others; `lb_masq_addrs` holds each one's addresses and the programs are told to look
/// routes up. A NodePort flow to a backend routed by d1 through a gateway in its first subnet
/// leaves with d1's first address, one through a gateway in its second subnet with the second
/// (the address whose subnet holds the next hop); the reply to that address is un-SNATed. A
/// backend without a route gets the fallback, the node IP, and is counted.
#[test]
fn masquerade_takes_the_address_of_the_interface_the_backend_is_routed_by() {
    use lb_agent::{apply::MapOps, family::PerFamily, node::masquerade};
    let mut state = state();
    for (name, port, backend) in [("far", 30090, "10.244.3.9"), ("nowhere", 30091, "10.244.9.9")] {
        add(
            &mut state,
            service("t", name)
                .cluster_ip(if port == 30090 { "10.96.0.30" } else { "10.96.0.31" })
                .port("http", "TCP", 80, 8080)
                .node_port(port),
            Some(
                slice("t", name, &format!("{name}-1"))
                    .endpoint(backend, "node-b", State::Ready)
                    .port("http", "TCP", 8080),
            ),
        );
    }
    let mut s = scratch_with(&state, true);
    let ns = lb_tests::netns::NetNs::new("lbfib");
    ns.sysctl("net.ipv4.ip_forward=1");
    ns.sysctl("net.ipv6.conf.all.forwarding=1");
    let interfaces = [
        ("d0", &["192.168.50.11/24"][..]),
        ("d1", &["192.168.60.11/24", "172.16.0.11/16"][..]),
    ];
    let mut candidates = std::collections::BTreeMap::new();
    // Veths to a namespace of their own (a kernel may lack dummy interfaces).
    let peer = lb_tests::netns::NetNs::new("lbfibp");
    for (dev, nets) in interfaces {
        lb_tests::netns::veth(&ns, dev, None, &peer, &format!("{dev}p"), None);
        for net in nets {
            for f in FAMILIES {
                let net = f.net(net);
                match f {
                    Family::V4 => ns.ip(&["addr", "add", &net, "dev", dev]),
                    Family::V6 => ns.ip(&["-6", "addr", "add", &net, "dev", dev, "nodad"]),
                }
                candidates
                    .entry(ns.ifindex(dev))
                    .or_insert_with(Vec::new)
                    .push(net.parse::<ipnet::IpNet>().unwrap());
            }
        }
    }
    for f in FAMILIES {
        let six: &[&str] = if f == Family::V6 { &["-6"] } else { &[] };
        for (to, via) in [("10.244.2.0/24", "192.168.60.1"), ("10.244.3.0/24", "172.16.0.1")] {
            let (to, via) = (f.net(to), f.addr(via));
            ns.ip(&[six, &["route", "add", &to, "via", &via]].concat());
        }
    }
    // Each family's part in the kernel's order: IPv4 first here, as `masquerade_candidates` does
    // per family.
    let fallback = PerFamily {
        v4: Some(Family::V4.ip(NODE_IP)),
        v6: Some(Family::V6.ip(NODE_IP)),
    };
    let entries = masquerade::masquerade_entries(&candidates, &fallback);
    s.maps_mut()
        .put_masquerade_addrs(&entries)
        .expect("lb_masq_addrs");
    let mut cfg = s.maps().config.get(&0, 0).expect("config");
    cfg.flags |= lb_common::config::flags::MASQUERADE_BY_INTERFACE;
    s.maps_mut().put_config(&cfg).expect("config");

    ns.run(|| {
        for f in FAMILIES {
            for (node_port, sport, backend, masquerade) in [
                (30080, 42000, "10.244.2.7", "192.168.60.11"),
                (30090, 42001, "10.244.3.9", "172.16.0.11"),
                (30091, 42002, "10.244.9.9", NODE_IP),
            ] {
                let unknown = counter(&s, Counter::TcMasqueradeRouteUnknown);
                let syn = tcp(f, CLIENT, sport, NODE_IP, node_port).build();
                let dnat = ingress(&mut s, &syn);
                assert_bytes(
                    &dnat.packet,
                    &nat(f, &syn, None, Some((backend, 8080))),
                    format!("{f:?} DNAT to {backend}"),
                );
                let snat = egress(&mut s, &dnat.packet);
                let port = summary(&snat.packet).sport;
                assert_bytes(
                    &snat.packet,
                    &nat(f, &dnat.packet, Some((masquerade, port)), None),
                    format!("{f:?} to {backend}: masqueraded with {masquerade}"),
                );
                let routed = backend != "10.244.9.9";
                assert_eq!(
                    counter(&s, Counter::TcMasqueradeRouteUnknown) - unknown,
                    u64::from(!routed),
                    "{f:?} to {backend}: tc_masquerade_route_unknown"
                );
                // The reply to that address and port is un-SNATed back to the client.
                let reply = tcp(f, backend, 8080, masquerade, port).data(b"pong").build();
                let unsnat = ingress(&mut s, &reply);
                assert_bytes(
                    &unsnat.packet,
                    &nat(f, &reply, None, Some((CLIENT, sport))),
                    format!("{f:?} un-SNAT from {masquerade}"),
                );
            }
        }
    });
}

#[test]
fn a_nodeport_to_a_host_network_endpoint_of_this_node_keeps_the_client_and_reverses_the_reply() {
    // A hostNetwork endpoint of this node has the node's address: DNAT delivers the packet
    // locally, so it never reaches egress to be masqueraded. As with kube-proxy (whose
    // POSTROUTING MASQUERADE a locally delivered packet never meets), the server sees the client
    // and its reply leaves with the NodePort as its source. (Upstream e2e: "Networking Granular
    // Checks: Services should function for service endpoints using hostNetwork".)
    let mut state = ClusterState::default();
    add(
        &mut state,
        service("t", "hostnet")
            .cluster_ip("10.96.0.20")
            .port("http", "TCP", 80, 8083)
            .node_port(30084),
        Some(
            slice("t", "hostnet", "hostnet-1")
                .endpoint(NODE_IP, "node-a", State::Ready)
                .port("http", "TCP", 8083),
        ),
    );
    let mut s = scratch_with(&state, true);
    for f in FAMILIES {
        let syn = tcp(f, CLIENT, 41000, NODE_IP, 30084).build();
        let dnat = ingress(&mut s, &syn);
        assert_bytes(
            &dnat.packet,
            &nat(f, &syn, None, Some((NODE_IP, 8083))),
            format!("{f:?} NodePort DNAT to this node's own address"),
        );
        assert_eq!(dnat.mark, 0, "nothing to un-SNAT later");
        let reply = tcp(f, NODE_IP, 8083, CLIENT, 41000).data(b"pong").build();
        let out = egress(&mut s, &reply);
        assert_bytes(
            &out.packet,
            &nat(f, &reply, Some((NODE_IP, 30084)), None),
            format!("{f:?} the reply leaves from the NodePort the client called"),
        );
        // Its ClusterIP from outside (routed to this node) is the same: the client stays.
        let syn = tcp(f, CLIENT, 41001, "10.96.0.20", 80).build();
        let dnat = ingress(&mut s, &syn);
        assert_bytes(
            &dnat.packet,
            &nat(f, &syn, None, Some((NODE_IP, 8083))),
            format!("{f:?} ClusterIP DNAT to this node's own address"),
        );
        let reply = tcp(f, NODE_IP, 8083, CLIENT, 41001).build();
        assert_bytes(
            &egress(&mut s, &reply).packet,
            &nat(f, &reply, Some(("10.96.0.20", 80)), None),
            format!("{f:?} the reply leaves from the ClusterIP"),
        );
    }
}

#[test]
fn local_policy_keeps_the_client_source_and_uses_local_endpoints_only() {
    let mut s = scratch(true);
    for f in FAMILIES {
        for sport in 42000..42020 {
            let syn = tcp(f, CLIENT, sport, NODE_IP, 30081).build();
            let out = ingress(&mut s, &syn);
            assert_bytes(
                &out.packet,
                &nat(f, &syn, None, Some(("10.244.1.6", 8080))),
                format!("{f:?} ETP=Local"),
            );
            let leaving = egress(&mut s, &out.packet);
            assert_eq!(summary(&leaving.packet).src, f.ip(CLIENT), "client IP preserved");
        }
        // A pod (cluster CIDR) calling the same NodePort is short-circuited to all endpoints.
        let mut seen = std::collections::BTreeSet::new();
        for sport in 43000..43060 {
            let syn = tcp(f, "10.244.3.3", sport, NODE_IP, 30081).build();
            seen.insert(summary(&ingress(&mut s, &syn).packet).dst);
        }
        assert_eq!(
            seen.len(),
            2,
            "{f:?}: pod traffic uses the cluster-wide endpoints: {seen:?}"
        );
    }
}

/// Two flows of one client port through two masquerading NodePorts that share a backend: both
/// leave as CLIENT:44100 -> 10.244.1.6:8080 after DNAT, which egress alone cannot tell apart.
/// The second flow's SNAT entry is tagged and its packets marked at ingress, so each flow keeps
/// its own masquerade port both ways and neither takes the other's (before, the second took the
/// tuple over and the first connection stalled: the flood scenario of docs/reliability.md
/// caught it, a "new connections" client reusing an established connection's port).
#[test]
fn two_masqueraded_flows_sharing_a_post_dnat_tuple_keep_their_own_ports() {
    let mut st = state();
    for (name, node_port) in [("shared", 30090), ("shared2", 30091)] {
        add(
            &mut st,
            service("t", name)
                .cluster_ip(if node_port == 30090 {
                    "10.96.0.20"
                } else {
                    "10.96.0.21"
                })
                .port("http", "TCP", 80, 8080)
                .node_port(node_port),
            Some(
                slice("t", name, &format!("{name}-1"))
                    .endpoint("10.244.1.6", "node-a", State::Ready)
                    .port("http", "TCP", 8080),
            ),
        );
    }
    let mut s = scratch_with(&st, true);
    for f in FAMILIES {
        // One packet of `node_port`'s flow through ingress then egress (the mark handed over,
        // as the kernel carries it on the skb): the masquerade port it left with.
        let out_of = |s: &mut ScratchDatapath, node_port: u16, data: bool| -> (u16, u32) {
            let mut spec = tcp(f, CLIENT, 44100, NODE_IP, node_port);
            if data {
                spec = spec.data(b"ping");
            }
            let pkt = spec.build();
            let dnat = ingress(s, &pkt);
            assert_eq!(
                summary(&dnat.packet).dst,
                f.ip("10.244.1.6"),
                "{f:?} :{node_port} DNAT"
            );
            let snat = egress_marked(s, &dnat.packet, dnat.mark);
            assert_eq!(snat.mark, 0, "{f:?}: egress clears the forward mark");
            let out = summary(&snat.packet);
            assert_eq!(out.src, f.ip(NODE_IP), "{f:?} :{node_port} masqueraded");
            (out.sport, dnat.mark)
        };
        let (first, unmarked) = out_of(&mut s, 30090, false);
        assert_eq!(unmarked, 0, "the first flow owns the untagged tuple");
        let tagged = counter(&s, Counter::TcSnatTagged);
        let (second, marked) = out_of(&mut s, 30091, false);
        assert_eq!(counter(&s, Counter::TcSnatTagged), tagged + 1, "{f:?}: counted");
        assert_ne!(first, second, "{f:?}: each flow its own masquerade port");
        // Later packets of both, interleaved: each keeps its port.
        for _ in 0..2 {
            assert_eq!(
                out_of(&mut s, 30090, true).0,
                first,
                "{f:?}: the first flow's port"
            );
            assert_eq!(
                out_of(&mut s, 30091, true).0,
                second,
                "{f:?}: the second flow's port"
            );
        }
        assert_ne!(marked, 0, "{f:?}: the second flow's packets are marked");
        // Replies to each port go back to the client from the NodePort it called.
        for (port, node_port) in [(first, 30090), (second, 30091)] {
            let reply = tcp(f, "10.244.1.6", 8080, NODE_IP, port).data(b"pong").build();
            let unsnat = ingress(&mut s, &reply);
            assert_eq!(
                (summary(&unsnat.packet).dst, summary(&unsnat.packet).dport),
                (f.ip(CLIENT), 44100),
                "{f:?}: un-SNAT of port {port}"
            );
            let out = egress_marked(&mut s, &unsnat.packet, unsnat.mark);
            assert_eq!(
                (summary(&out.packet).src, summary(&out.packet).sport),
                (f.ip(NODE_IP), node_port),
                "{f:?}: the reply to port {port} leaves as :{node_port}"
            );
        }
    }
}

#[test]
fn a_client_port_reused_on_another_frontend_is_not_masqueraded_by_the_old_flow() {
    // Two NodePorts share a backend: 30090 masquerades (Cluster policy), 30081 keeps the client
    // address (Local). The client reuses its source port from the first for the second.
    let mut st = state();
    add(
        &mut st,
        service("t", "shared")
            .cluster_ip("10.96.0.20")
            .port("http", "TCP", 80, 8080)
            .node_port(30090),
        Some(
            slice("t", "shared", "shared-1")
                .endpoint("10.244.1.6", "node-a", State::Ready)
                .port("http", "TCP", 8080),
        ),
    );
    let mut s = scratch_with(&st, true);
    for f in FAMILIES {
        let first = ingress(&mut s, &tcp(f, CLIENT, 44000, NODE_IP, 30090).build()).packet;
        let masqueraded = egress(&mut s, &first);
        assert_eq!(
            summary(&masqueraded.packet).src,
            f.ip(NODE_IP),
            "the Cluster-policy NodePort masquerades"
        );
        // Same client tuple after DNAT (CLIENT:44000 -> 10.244.1.6:8080), but through the Local
        // one.
        let syn = tcp(f, CLIENT, 44000, NODE_IP, 30081).build();
        let dnat = ingress(&mut s, &syn);
        assert_bytes(
            &dnat.packet,
            &nat(f, &syn, None, Some(("10.244.1.6", 8080))),
            format!("{f:?} ETP=Local DNAT"),
        );
        let leaving = egress(&mut s, &dnat.packet);
        assert_bytes(
            &leaving.packet,
            &dnat.packet,
            format!("{f:?} client address preserved"),
        );
        // Its replies go back as the Local NodePort.
        let reply = tcp(f, "10.244.1.6", 8080, CLIENT, 44000).build();
        let out = egress(&mut s, &reply);
        assert_bytes(
            &out.packet,
            &nat(f, &reply, Some((NODE_IP, 30081)), None),
            format!("{f:?} reverse NAT to the Local NodePort"),
        );
    }
}

#[test]
fn client_ip_affinity_keeps_a_client_on_one_backend() {
    let mut st = state();
    add(
        &mut st,
        service("t", "sticky")
            .cluster_ip("10.96.0.30")
            .port("http", "TCP", 80, 8080)
            .client_ip_affinity(60),
        Some(
            slice("t", "sticky", "sticky-1")
                .endpoint("10.244.2.30", "node-b", State::Ready)
                .endpoint("10.244.2.31", "node-b", State::Ready)
                .port("http", "TCP", 8080),
        ),
    );
    let mut s = scratch_with(&st, true);
    for f in FAMILIES {
        let backend_of = |s: &mut ScratchDatapath, client: &str, sport: u16| {
            summary(&ingress(s, &tcp(f, client, sport, "10.96.0.30", 80).build()).packet).dst
        };
        // One client, many connections: one backend.
        let first = backend_of(&mut s, CLIENT, 48000);
        for sport in 48001..48030 {
            assert_eq!(backend_of(&mut s, CLIENT, sport), first, "{f:?}: affinity");
        }
        // Many clients: both backends (all twenty on one: 2^-19).
        let seen: std::collections::BTreeSet<IpAddr> = (101..121)
            .map(|host| backend_of(&mut s, &format!("192.168.50.{host}"), 48100))
            .collect();
        assert_eq!(seen, [f.ip("10.244.2.30"), f.ip("10.244.2.31")].into(), "{f:?}");
    }
}

/// A Maglev NodePort (the `lb-agent.io/lb-algorithm` annotation) with `backends` endpoints on
/// other nodes, and `before` filler Services added first (they take the first backend ids, as
/// another node's history would).
fn maglev_state(backends: &[u8], before: usize, affinity: bool) -> ClusterState {
    maglev_state_with(backends, &[], before, affinity)
}

/// [`maglev_state`] with `terminating` endpoints (serving and terminating) beside `backends`.
fn maglev_state_with(backends: &[u8], terminating: &[u8], before: usize, affinity: bool) -> ClusterState {
    let mut st = ClusterState::default();
    for i in 0..before {
        add(
            &mut st,
            service("t", &format!("filler{i}"))
                .cluster_ip(&format!("10.96.1.{}", i + 1))
                .port("http", "TCP", 80, 8080),
            Some(
                slice("t", &format!("filler{i}"), &format!("filler{i}-1"))
                    .endpoint(&format!("10.244.3.{}", i + 1), "node-b", State::Ready)
                    .port("http", "TCP", 8080),
            ),
        );
    }
    let mut svc = service("t", "mg")
        .cluster_ip("10.96.0.40")
        .port("http", "TCP", 80, 8080)
        .node_port(30090)
        .annotation("lb-agent.io/lb-algorithm", "maglev");
    if affinity {
        svc = svc.client_ip_affinity(60);
    }
    let mut endpoints = slice("t", "mg", "mg-1");
    for b in backends {
        endpoints = endpoints.endpoint(&format!("10.244.2.{b}"), "node-b", State::Ready);
    }
    for b in terminating {
        endpoints = endpoints.endpoint(&format!("10.244.2.{b}"), "node-b", State::Terminating);
    }
    add(&mut st, svc, Some(endpoints.port("http", "TCP", 8080)));
    st
}

/// The backend Maglev gives a flow from `CLIENT:sport` to the NodePort (`fixtures::maglev_pick`).
fn maglev_expected(f: Family, backends: &[u8], sport: u16) -> IpAddr {
    let members: Vec<(IpAddr, u16)> = backends
        .iter()
        .map(|b| (f.ip(&format!("10.244.2.{b}")), 8080))
        .collect();
    maglev_pick(
        HashSeed::FIXED,
        f.ip(CLIENT),
        sport,
        f.ip(NODE_IP),
        30090,
        6,
        &members,
    )
    .0
}

/// Issue 17: a Maglev NodePort sends each flow to the backend at its hash's position in the
/// table, on every node alike: two data paths whose backend ids differ (one programmed 40 other
/// Services first) pick the backend user space computes, for flows of both families. Removing
/// one of five backends moves only a small share of the other backends' flows.
#[test]
fn maglev_gives_a_flow_the_same_backend_on_every_node() {
    const BACKENDS: [u8; 5] = [40, 41, 42, 43, 44];
    let mut node_a = scratch_with(&maglev_state(&BACKENDS, 0, false), true);
    let mut node_b = scratch_with(&maglev_state(&BACKENDS, 40, false), true);
    let fewer = [40, 41, 43, 44];
    let mut shrunk = scratch_with(&maglev_state(&fewer, 0, false), true);
    for f in FAMILIES {
        let mut seen = std::collections::BTreeSet::new();
        let (mut others, mut moved) = (0, 0);
        for sport in 40_000..40_200 {
            let syn = tcp(f, CLIENT, sport, NODE_IP, 30090).build();
            let want = maglev_expected(f, &BACKENDS, sport);
            let on_a = summary(&ingress(&mut node_a, &syn).packet).dst;
            let on_b = summary(&ingress(&mut node_b, &syn).packet).dst;
            assert_eq!((on_a, on_b), (want, want), "{f:?} sport {sport}");
            seen.insert(on_a);
            let after = summary(&ingress(&mut shrunk, &syn).packet).dst;
            assert_eq!(after, maglev_expected(f, &fewer, sport), "{f:?} sport {sport}");
            if want != f.ip("10.244.2.42") {
                others += 1;
                moved += usize::from(after != want);
            }
        }
        assert_eq!(seen.len(), BACKENDS.len(), "{f:?}: every backend gets flows");
        // The table's share at M = 16381, N = 5 is well under 5% (plan::maglev's tests measure
        // it); 200 flows leave room for sampling.
        assert!(
            moved * 10 <= others,
            "{f:?}: {moved} of {others} flows of the remaining backends moved"
        );
    }
}

/// `--bpf-lb-maglev-hash-seed`: nodes given one seed pick the backend user space computes with
/// it (the table's permutation and the tc program's flow hash both take it, the hash from
/// `lb_config`), whatever their backend ids; and the seed matters: some flows go elsewhere than
/// with the fixed seed.
#[test]
fn maglev_with_a_configured_seed_agrees_on_every_node() {
    const BACKENDS: [u8; 5] = [40, 41, 42, 43, 44];
    let seed: HashSeed = "JLfvgnHc2kaSUFaI".parse().unwrap();
    let seeded = |before: usize| {
        require_root();
        let mut settings = settings(true);
        settings.load_balancing.maglev_hash_seed = seed;
        let node_ips: Vec<IpAddr> = FAMILIES.iter().map(|f| f.ip(NODE_IP)).collect();
        ScratchDatapath::new(
            &maglev_state(&BACKENDS, before, false),
            settings,
            &node_ips,
            OBJECT,
        )
        .expect("scratch data path")
    };
    let (mut node_a, mut node_b) = (seeded(0), seeded(40));
    assert_eq!(node_a.maps().config.get(&0, 0).unwrap().maglev_seed, seed.word());
    for f in FAMILIES {
        let members: Vec<(IpAddr, u16)> = BACKENDS
            .iter()
            .map(|b| (f.ip(&format!("10.244.2.{b}")), 8080))
            .collect();
        let mut moved = 0;
        for sport in 40_000..40_100 {
            let syn = tcp(f, CLIENT, sport, NODE_IP, 30090).build();
            let want = maglev_pick(seed, f.ip(CLIENT), sport, f.ip(NODE_IP), 30090, 6, &members).0;
            let on_a = summary(&ingress(&mut node_a, &syn).packet).dst;
            let on_b = summary(&ingress(&mut node_b, &syn).packet).dst;
            assert_eq!((on_a, on_b), (want, want), "{f:?} sport {sport}");
            moved += usize::from(want != maglev_expected(f, &BACKENDS, sport));
        }
        // Another seed is another spread: about four flows in five change backend among five.
        assert!(
            moved >= 50,
            "{f:?}: only {moved} of 100 flows differ from the fixed seed's"
        );
    }
}

/// A Service port's external frontends share one Maglev table in the kernel: the NodePort on the
/// node's address and an external IP, in each family, are four `lb_maglev` keys over two inner
/// arrays (one per family: their endpoints differ), so the table's memory is paid once per
/// Service port and family. The external IP picks as the NodePort does.
#[test]
fn a_service_ports_frontends_share_one_maglev_table() {
    use aya::maps::IterableMap;
    const BACKENDS: [u8; 3] = [40, 41, 42];
    let mut st = ClusterState::default();
    let mut endpoints = slice("t", "mg", "mg-1");
    for b in BACKENDS {
        endpoints = endpoints.endpoint(&format!("10.244.2.{b}"), "node-b", State::Ready);
    }
    add(
        &mut st,
        service("t", "mg")
            .cluster_ip("10.96.0.40")
            .port("http", "TCP", 80, 8080)
            .node_port(30090)
            .external_ips(&["192.0.2.50"])
            .annotation("lb-agent.io/lb-algorithm", "maglev"),
        Some(endpoints.port("http", "TCP", 8080)),
    );
    let mut s = scratch_with(&st, true);
    let outer = s.maps().maglev.as_ref().expect("lb_maglev");
    let keys: Vec<u32> = outer.keys().collect::<Result<_, _>>().expect("keys");
    let inner_ids: std::collections::BTreeSet<u32> = keys
        .iter()
        .map(|k| {
            let inner = outer.get(k, 0).expect("a table");
            inner.map().info().expect("map info").id()
        })
        .collect();
    assert_eq!(keys.len(), 2 * FAMILIES.len(), "a table per external frontend");
    assert_eq!(
        inner_ids.len(),
        FAMILIES.len(),
        "one inner array per family: {inner_ids:?}"
    );
    for f in FAMILIES {
        for sport in 40_000..40_020 {
            let via_node_port =
                summary(&ingress(&mut s, &tcp(f, CLIENT, sport, NODE_IP, 30090).build()).packet).dst;
            let via_external_ip =
                summary(&ingress(&mut s, &tcp(f, CLIENT, sport, "192.0.2.50", 80).build()).packet).dst;
            let members: Vec<(IpAddr, u16)> = BACKENDS
                .iter()
                .map(|b| (f.ip(&format!("10.244.2.{b}")), 8080))
                .collect();
            let want = |dst: &str, dport| {
                maglev_pick(
                    HashSeed::FIXED,
                    f.ip(CLIENT),
                    sport,
                    f.ip(dst),
                    dport,
                    6,
                    &members,
                )
                .0
            };
            assert_eq!(via_node_port, want(NODE_IP, 30090), "{f:?} sport {sport}");
            assert_eq!(via_external_ip, want("192.0.2.50", 80), "{f:?} sport {sport}");
        }
    }
}

/// kube-proxy's terminating-endpoint fallback holds under Maglev: the table is built from the
/// endpoints the fallback leaves, so with one ready endpoint every flow goes to it, and with none
/// ready the serving terminating ones share the flows as the table spreads them.
#[test]
fn maglev_keeps_the_terminating_fallback() {
    let mut one_ready = scratch_with(&maglev_state_with(&[40], &[41, 42], 0, false), true);
    let mut none_ready = scratch_with(&maglev_state_with(&[], &[41, 42], 0, false), true);
    for f in FAMILIES {
        let mut fallback = std::collections::BTreeSet::new();
        for sport in 42_000..42_040 {
            let syn = tcp(f, CLIENT, sport, NODE_IP, 30090).build();
            assert_eq!(
                summary(&ingress(&mut one_ready, &syn).packet).dst,
                f.ip("10.244.2.40"),
                "{f:?}: the ready endpoint only"
            );
            let to = summary(&ingress(&mut none_ready, &syn).packet).dst;
            assert_eq!(to, maglev_expected(f, &[41, 42], sport), "{f:?} sport {sport}");
            fallback.insert(to);
        }
        assert_eq!(fallback.len(), 2, "{f:?}: both terminating endpoints serve");
    }
}

/// ClientIP affinity keeps precedence over Maglev: one client's flows all go to one backend.
#[test]
fn affinity_wins_over_maglev() {
    let mut s = scratch_with(&maglev_state(&[40, 41, 42, 43, 44], 0, true), true);
    for f in FAMILIES {
        let backends: std::collections::BTreeSet<IpAddr> = (41_000..41_040)
            .map(|sport| summary(&ingress(&mut s, &tcp(f, CLIENT, sport, NODE_IP, 30090).build()).packet).dst)
            .collect();
        assert_eq!(backends.len(), 1, "{f:?}: {backends:?}");
    }
}

#[test]
fn local_policy_without_local_endpoints_drops() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let syn = tcp(f, CLIENT, 42100, NODE_IP, 30082).build();
        let out = ingress(&mut s, &syn);
        assert_eq!(out.action, SHOT, "{f:?}");
    }
}

fn listen(s: &mut ScratchDatapath, types: u32, lease_ns: i64) {
    lb_tests::monitor::listen(&mut s.datapath, types, lease_ns);
}

fn events(s: &mut ScratchDatapath) -> Vec<lb_common::monitor::MonitorEvent> {
    lb_tests::monitor::events(&mut s.datapath)
}

/// An event's address of family `f` (the family's bytes first).
fn event_ip(f: Family, bytes: &[u8; 16]) -> IpAddr {
    match f {
        Family::V4 => IpAddr::from([bytes[0], bytes[1], bytes[2], bytes[3]]),
        Family::V6 => IpAddr::from(*bytes),
    }
}

/// Issue 24: while a monitor listens, tc ingress writes an event per new flow's outcome with
/// the flow (a translated and masqueraded NodePort flow with its backend and masquerade address;
/// a reject; a Local policy's drop), none for an established flow's packets, none of a type the
/// monitor did not ask for, and none once its lease has passed or before anyone listened. A full
/// ring buffer loses events, each counted: events read plus events lost is every event.
#[test]
fn a_listening_monitor_gets_each_new_flows_outcome_with_its_flow() {
    use lb_common::monitor::{hook, types};
    let mut s = scratch(true);
    for f in FAMILIES {
        let af = match f {
            Family::V4 => libc::AF_INET,
            Family::V6 => libc::AF_INET6,
        } as u8;
        // Nobody listens: nothing is written.
        let reject = tcp(f, CLIENT, 42600, "10.96.0.14", 80).build();
        ingress(&mut s, &reject);
        assert!(events(&mut s).is_empty(), "{f:?}: events without a monitor");

        listen(&mut s, types::ALL, 60_000_000_000);
        let before = lb_tests::monitor::boottime_ns();
        let syn = tcp(f, CLIENT, 42601, NODE_IP, 30080).build();
        let dnat = ingress(&mut s, &syn);
        let masquerade = egress(&mut s, &dnat.packet);
        let port = summary(&masquerade.packet).sport;
        ingress(
            &mut s,
            &tcp(f, CLIENT, 42601, NODE_IP, 30080).data(b"GET").build(),
        );
        ingress(&mut s, &tcp(f, CLIENT, 42602, "10.96.0.14", 80).build());
        ingress(&mut s, &tcp(f, CLIENT, 42603, NODE_IP, 30082).build());
        let seen = events(&mut s);
        assert_eq!(
            seen.iter()
                .map(|e| Counter::ALL.get(e.counter as usize).copied())
                .collect::<Vec<_>>(),
            [Counter::TcNewFlow, Counter::TcRejected, Counter::TcDropped].map(Some),
            "{f:?}: one event per new flow, none for the established packet"
        );
        for e in &seen {
            assert_eq!(
                (e.hook, e.family, e.protocol),
                (hook::TC_INGRESS, af, lb_common::proto::TCP),
                "{f:?}"
            );
            assert_eq!(event_ip(f, &e.src), f.ip(CLIENT), "{f:?}");
            assert!(
                e.time_ns >= before && e.time_ns <= lb_tests::monitor::boottime_ns(),
                "{f:?}"
            );
            assert_ne!(e.rev_nat_id, 0, "{f:?}: the frontend's id");
            assert_eq!(e.cgroup_id, 0);
        }
        let new_flow = &seen[0];
        assert_eq!((new_flow.src_port, new_flow.dst_port), (42601, 30080));
        assert_eq!(event_ip(f, &new_flow.dst), f.ip(NODE_IP));
        assert_eq!(
            (event_ip(f, &new_flow.backend), new_flow.backend_port),
            (f.ip("10.244.2.7"), 8080),
            "{f:?}"
        );
        assert_eq!(
            (event_ip(f, &new_flow.nat), new_flow.nat_port),
            (f.ip(NODE_IP), port),
            "{f:?}: the masquerade address and the port egress used"
        );
        assert_eq!(
            (seen[1].dst_port, seen[1].backend_port, seen[1].nat_port),
            (80, 0, 0)
        );
        assert_eq!(event_ip(f, &seen[2].dst), f.ip(NODE_IP));

        // Drops only: the reject is not written, the drop is.
        listen(&mut s, types::DROP, 60_000_000_000);
        ingress(&mut s, &tcp(f, CLIENT, 42604, "10.96.0.14", 80).build());
        ingress(&mut s, &tcp(f, CLIENT, 42605, NODE_IP, 30082).build());
        let seen = events(&mut s);
        assert_eq!(seen.len(), 1, "{f:?}");
        assert_eq!(
            Counter::ALL.get(seen[0].counter as usize),
            Some(&Counter::TcDropped)
        );
        assert_eq!(seen[0].src_port, 42605);

        // The lease has passed (a monitor killed without giving it back): nothing is written.
        listen(&mut s, types::ALL, -1);
        ingress(&mut s, &tcp(f, CLIENT, 42606, NODE_IP, 30082).build());
        assert!(events(&mut s).is_empty(), "{f:?}: events after the lease");
    }
    assert_eq!(counter(&s, Counter::MonitorEventsLost), 0);

    // Drops leave the packet as it was, so one test run repeats the same event: more than the
    // ring buffer holds, unread.
    listen(&mut s, types::DROP, 60_000_000_000);
    let drop = tcp(Family::V4, CLIENT, 42607, NODE_IP, 30082).build();
    let repeat = 12_000;
    s.datapath
        .test_run_tc("lb_tc_ingress", &drop, repeat)
        .expect("test run");
    let read = events(&mut s).len() as u64;
    let lost = counter(&s, Counter::MonitorEventsLost);
    assert!(read > 0 && lost > 0, "read {read}, lost {lost}");
    assert_eq!(
        read + lost,
        u64::from(repeat),
        "every event is read or counted lost"
    );
    listen(&mut s, 0, 0);
}

/// The port unreachable the program answers `pkt` (from `CLIENT_MAC` to `NODE_MAC`) with: from
/// the address the client called to the client, MAC addresses swapped, quoting the IP header
/// (IPv4 options or IPv6 extension headers included) and 8 bytes of L4, IPv6 rounding up to 8
/// bytes and quoting at most 64 (see `ipv6.rs`).
fn expected_port_unreachable(pkt: &[u8]) -> Vec<u8> {
    let l = packet::layout(pkt).expect("IP");
    let to_ports = l.l4 - ETH_HLEN + 8;
    let quote = match l.family {
        Family::V4 => to_ports,
        Family::V6 => to_ports.next_multiple_of(8).min(64),
    };
    let (kind, code, rest) = IcmpError::PortUnreachable.header(l.family);
    let mut e = packet::icmp_raw(l.dst, l.src, kind, code, rest, &pkt[ETH_HLEN..ETH_HLEN + quote]);
    e[0..6].copy_from_slice(&pkt[6..12]);
    e[6..12].copy_from_slice(&pkt[0..6]);
    e
}

#[test]
fn a_service_without_endpoints_is_rejected_with_icmp_port_unreachable() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let mut cases = vec![
            tcp(f, CLIENT, 42200, "10.96.0.14", 80),
            udp(f, CLIENT, 42201, "10.96.0.14", 53),
        ];
        match f {
            Family::V4 => {
                // The quote carries the whole IP header, options included.
                let mut with_options = tcp(f, CLIENT, 42202, "10.96.0.14", 80);
                with_options.options = vec![7, 7, 4, 0, 0, 0, 0, 0]; // record route, EOL padding
                cases.push(with_options);
            }
            Family::V6 => {
                // The quote carries the extension headers: 56 bytes, 64, and the first 64 of a
                // longer one (cut before the ports).
                cases.push(tcp(f, CLIENT, 42202, "10.96.0.14", 80).extension(DSTOPTS, 8));
                cases.push(
                    udp(f, CLIENT, 42203, "10.96.0.14", 53)
                        .extension(HOPOPTS, 8)
                        .extension(DSTOPTS, 8),
                );
                cases.push(tcp(f, CLIENT, 42204, "10.96.0.14", 80).extension(DSTOPTS, 40));
                // An authentication header of 12 bytes (a multiple of 4, not 8): the quote is
                // rounded up to keep the ports.
                cases.push(udp(f, CLIENT, 42205, "10.96.0.14", 53).extension(packet::AUTH, 12));
            }
        }
        for spec in cases {
            let syn = spec.build();
            let what = format!("{f:?} {:?} {:?}", spec.extensions, spec.options);
            let out = ingress(&mut s, &syn);
            assert_eq!(
                out.action, REDIRECT,
                "{what}: sent back out of the interface it came in on"
            );
            let expected = expected_port_unreachable(&syn);
            // Type 3/3 or 1/4, from the frontend to the client, Ethernet addresses swapped, the
            // packet quoted, TOS 0xc0 and no DF (IPv4) or traffic class 0 (IPv6), TTL 64.
            assert_same(&out.packet, &expected, format!("{what}: port unreachable"));
            let l = packet::layout(&out.packet).unwrap();
            assert_eq!(
                (l.src, l.dst, l.proto),
                (f.ip("10.96.0.14"), f.ip(CLIENT), f.icmp_proto())
            );
            if spec.extensions.iter().all(|e| e.1 <= 16) {
                let q = packet::quoted_summary(&out.packet);
                assert_eq!(
                    (q.sport, q.dport),
                    (spec.sport, spec.dport),
                    "{what}: ports quoted"
                );
            }
        }
    }
}

#[test]
fn a_reject_never_answers_a_source_icmp_errors_may_not_go_to() {
    let mut s = scratch(true);
    let mut expected = 0;
    for f in FAMILIES {
        let sources: &[&str] = match f {
            Family::V4 => &[
                "255.255.255.255",
                "0.0.0.0",
                "0.1.2.3",
                "224.0.0.5",
                "239.1.1.1",
                "240.0.0.1",
                "127.0.0.1",
            ],
            // RFC 4443 2.4 (e): multicast, unspecified; loopback never comes from the wire.
            Family::V6 => &["ff02::1", "ff05::1:3", "ff0e::101", "::", "::1"],
        };
        for src in sources {
            let p = packet::udp(src, 5000, &f.addr("10.96.0.14"), 53).build();
            let out = ingress(&mut s, &p);
            assert_eq!(out.action, SHOT, "the packet from {src} is dropped unanswered");
            let p = packet::tcp(src, 5000, &f.addr("10.96.0.14"), 80).build();
            assert_eq!(ingress(&mut s, &p).action, SHOT, "{src}, TCP");
            expected += 2;
        }
        // A unicast source in a link-layer broadcast or multicast frame (RFC 1122 3.2.2, RFC
        // 4443 2.4 (e.2)).
        for mac in [[0xff; 6], [0x33, 0x33, 0, 0, 0, 1], [0x01, 0, 0x5e, 0, 0, 1]] {
            let mut p = udp(f, CLIENT, 5000, "10.96.0.14", 53).build();
            p[0..6].copy_from_slice(&mac);
            assert_eq!(
                ingress(&mut s, &p).action,
                SHOT,
                "{f:?}: link-layer group {mac:x?}"
            );
            expected += 1;
        }
    }
    assert_eq!(counter(&s, Counter::TcRejectUnanswerable), expected);
    assert_eq!(counter(&s, Counter::TcRejectRateLimited), 0);
}

#[test]
fn reject_answers_are_rate_limited_like_the_kernels_icmp_errors() {
    use lb_common::ratelimit::{REJECT_BURST, REJECT_RATE_PER_SEC};
    let mut s = scratch(true);
    let flood = 400u16;
    let started = std::time::Instant::now();
    // One bucket for both families (as the kernel's global ICMP rate limit): the flood
    // alternates between them.
    let mut answered = [0u64; 2];
    for i in 0..flood {
        let f = FAMILIES[usize::from(i % 2)];
        let p = udp(f, CLIENT, 10_000 + i, "10.96.0.14", 53).build();
        match ingress(&mut s, &p).action {
            REDIRECT => answered[usize::from(i % 2)] += 1,
            SHOT => {}
            other => panic!("verdict {other}"),
        }
    }
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let total: u64 = answered.iter().sum();
    // One bucket per CPU: a full burst on the first CPU the test runs on, and at most a burst per
    // CPU plus the refill over the time the flood took.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let ceiling = cpus * REJECT_BURST + (elapsed_ms + 1) * REJECT_RATE_PER_SEC / 1000 * cpus;
    assert!(total >= REJECT_BURST, "{total} answers: less than one burst");
    assert!(
        total <= ceiling.min(u64::from(flood)),
        "{total} answers in {elapsed_ms} ms (ceiling {ceiling})"
    );
    assert!(
        answered.iter().all(|n| *n >= REJECT_BURST / 2 - 1),
        "both families are answered: {answered:?}"
    );
    assert_eq!(
        counter(&s, Counter::TcRejectRateLimited),
        u64::from(flood) - total,
        "every unanswered packet is counted"
    );
}

#[test]
fn load_balancer_source_ranges_are_enforced() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let denied = tcp(f, CLIENT, 42300, "203.0.113.10", 80).build();
        assert_eq!(ingress(&mut s, &denied).action, SHOT, "{f:?}");
        let allowed = tcp(f, "198.51.100.7", 42301, "203.0.113.10", 80).build();
        let out = ingress(&mut s, &allowed);
        assert_bytes(
            &out.packet,
            &nat(f, &allowed, None, Some(("10.244.1.5", 8080))),
            format!("{f:?} allowed source"),
        );
        // Just outside the range (the next /24, or /64 in IPv6).
        let outside = tcp(f, "198.51.101.7", 42302, "203.0.113.10", 80).build();
        assert_eq!(ingress(&mut s, &outside).action, SHOT, "{f:?}");
        // NodePorts are not filtered by source ranges (kube-proxy).
        let np = tcp(f, CLIENT, 42303, NODE_IP, 30083).build();
        assert_eq!(summary(&ingress(&mut s, &np).packet).dst, f.ip("10.244.1.5"));
    }
    assert_eq!(counter(&s, Counter::SourceRangeDenied), 4);
}

#[test]
fn hairpin_is_masqueraded() {
    let mut s = scratch(true);
    for f in FAMILIES {
        // The backend pod calls its own Service.
        let syn = tcp(f, "10.244.1.5", 44000, "10.96.0.10", 80).build();
        let dnat = ingress(&mut s, &syn);
        assert_bytes(
            &dnat.packet,
            &nat(f, &syn, None, Some(("10.244.1.5", 8080))),
            format!("{f:?} hairpin DNAT"),
        );
        let snat = egress(&mut s, &dnat.packet);
        let s2 = summary(&snat.packet);
        assert_eq!(s2.src, f.ip(NODE_IP), "the pod sees the node, not itself");
        assert_bytes(
            &snat.packet,
            &nat(f, &dnat.packet, Some((NODE_IP, s2.sport)), None),
            format!("{f:?} hairpin SNAT"),
        );
    }
}

#[test]
fn off_cluster_sources_to_a_cluster_ip_are_masqueraded_when_a_cluster_cidr_is_set() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let syn = tcp(f, CLIENT, 44100, "10.96.0.10", 80).build();
        let dnat = ingress(&mut s, &syn).packet;
        let out = egress(&mut s, &dnat);
        assert_eq!(summary(&out.packet).src, f.ip(NODE_IP), "{f:?}");
    }
    // Without a local-traffic detector, kube-proxy does not masquerade cluster IP traffic.
    let mut s = scratch(false);
    for f in FAMILIES {
        let syn = tcp(f, CLIENT, 44101, "10.96.0.10", 80).build();
        let dnat = ingress(&mut s, &syn).packet;
        let out = egress(&mut s, &dnat);
        assert_eq!(summary(&out.packet).src, f.ip(CLIENT), "{f:?}");
    }
}

/// `--detect-local-mode NodeCIDR` (kube-proxy's): the detector is this node's `spec.podCIDRs`, so
/// a pod of another node (inside the cluster CIDR, outside this node's range) reaching a cluster
/// IP through this node is masqueraded, where ClusterCIDR mode would keep its address; this
/// node's own pods keep theirs in both modes. Before the Node has pod CIDRs, there is no detector.
#[test]
fn node_cidr_mode_masquerades_other_nodes_pods_to_a_cluster_ip() {
    use k8s_openapi::api::core::v1::{Node, NodeSpec};
    use lb_agent::node::DetectLocalMode;

    let node = |pod_cidrs: Vec<String>| Node {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("node-a".into()),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidrs: Some(pod_cidrs),
            ..Default::default()
        }),
        ..Default::default()
    };
    let this_node = FAMILIES.map(|f| f.net("10.244.1.0/24")).to_vec();
    let source_after = |mode: DetectLocalMode, pod_cidrs: Vec<String>, f: Family, src: &str, sport: u16| {
        let mut state = state();
        state.node = Some(std::sync::Arc::new(node(pod_cidrs)));
        let mut settings = settings(true);
        settings.detect_local_mode = mode;
        let node_ips: Vec<IpAddr> = FAMILIES.iter().map(|f| f.ip(NODE_IP)).collect();
        let mut s = ScratchDatapath::new(&state, settings, &node_ips, OBJECT).expect("scratch data path");
        let syn = tcp(f, src, sport, "10.96.0.10", 80).build();
        let dnat = ingress(&mut s, &syn).packet;
        summary(&egress(&mut s, &dnat).packet).src
    };
    for f in FAMILIES {
        let (own_pod, other_pod) = (f.ip("10.244.1.9"), f.ip("10.244.2.20"));
        let node_cidr = |src: &str, port, cidrs: Vec<String>| {
            source_after(DetectLocalMode::NodeCidr, cidrs, f, src, port)
        };
        assert_eq!(
            node_cidr("10.244.1.9", 44200, this_node.clone()),
            own_pod,
            "{f:?}: this node's pod"
        );
        assert_eq!(
            node_cidr("10.244.2.20", 44201, this_node.clone()),
            f.ip(NODE_IP),
            "{f:?}: another node's pod"
        );
        assert_eq!(
            node_cidr(CLIENT, 44202, this_node.clone()),
            f.ip(NODE_IP),
            "{f:?}: off the cluster"
        );
        // No pod CIDRs yet: no detector, nothing masqueraded (as without --cluster-cidr).
        assert_eq!(
            node_cidr("10.244.2.20", 44203, vec![]),
            other_pod,
            "{f:?}: no pod CIDRs yet"
        );
        // ClusterCIDR mode keeps another node's pod's address.
        assert_eq!(
            source_after(
                DetectLocalMode::ClusterCidr,
                this_node.clone(),
                f,
                "10.244.2.20",
                44204
            ),
            other_pod,
            "{f:?}: ClusterCIDR mode"
        );
    }
}

/// `--detect-local-mode` BridgeInterface and InterfaceNamePrefix (kube-proxy's `-i cbr0` and
/// `-i veth+`): what makes a packet a pod's is the interface it came in by, whatever its source
/// address. A packet to a cluster IP from a pod interface keeps its source; one from the uplink is
/// masqueraded, even from a pod-range address. The bridge's ports count as the bridge (a pod's
/// packet meets tc on its port first). Kernels before 5.15 cannot set the ingress interface of a
/// test run; tc_topology's flows cover them.
#[test]
fn interface_modes_tell_pods_by_the_interface_they_came_in_by() {
    use lb_agent::node::{DetectLocalMode, Link};

    let link = |name: &str, index: u32, controller: Option<u32>| Link {
        name: name.into(),
        index,
        controller,
        bridge_port: controller.is_some(),
        up: true,
        loopback: false,
    };
    let links = vec![
        link("eth0", 2, None),
        link("cbr0", 3, None),
        link("vethbr1", 4, Some(3)),
        link("lbpod1", 7, None),
    ];
    let scratch = |mode: DetectLocalMode| {
        require_root();
        let mut settings = settings(true);
        settings.detect_local_mode = mode;
        settings.pod_bridge_interface = "cbr0".into();
        settings.pod_interface_name_prefix = "lbpod".into();
        let node_ips: Vec<IpAddr> = FAMILIES.iter().map(|f| f.ip(NODE_IP)).collect();
        ScratchDatapath::with_links(&state(), settings, &node_ips, links.clone(), OBJECT)
            .expect("scratch data path")
    };
    let mut sport = 44300;
    let mut source_after = |s: &mut ScratchDatapath, f: Family, src: &str, ifindex: u32| {
        sport += 1;
        let syn = tcp(f, src, sport, "10.96.0.10", 80).build();
        let dnat = s
            .datapath
            .test_run_tc_from("lb_tc_ingress", &syn, ifindex)
            .map(|run| run.packet)
            .map_err(|e| e.to_string());
        dnat.map(|dnat| summary(&egress(s, &dnat).packet).src)
    };
    let mut bridge = scratch(DetectLocalMode::BridgeInterface);
    // Kernels before 5.15 refuse a test run's ingress interface (EINVAL).
    if let Err(e) = source_after(&mut bridge, Family::V4, CLIENT, 4) {
        let old = lb_agent::datapath::features::current().is_ok_and(|k| k.older_than(5, 15));
        assert!(old, "a test run from interface 4: {e}");
        eprintln!("skipped: this kernel's BPF_PROG_TEST_RUN cannot set ingress_ifindex (5.15+): {e}");
        return;
    }
    let mut prefix = scratch(DetectLocalMode::InterfaceNamePrefix);
    for f in FAMILIES {
        let (client, pod_range, node) = (f.ip(CLIENT), f.ip("10.244.1.9"), f.ip(NODE_IP));
        let mut seen = |s: &mut ScratchDatapath, src: &str, ifindex: u32| {
            source_after(s, f, src, ifindex).expect("test run")
        };
        assert_eq!(
            seen(&mut bridge, CLIENT, 4),
            client,
            "{f:?}: by a port of the bridge"
        );
        assert_eq!(seen(&mut bridge, CLIENT, 3), client, "{f:?}: by the bridge");
        assert_eq!(seen(&mut bridge, CLIENT, 2), node, "{f:?}: by the uplink");
        assert_eq!(
            seen(&mut bridge, "10.244.1.9", 2),
            node,
            "{f:?}: a pod address by the uplink"
        );
        assert_eq!(
            seen(&mut bridge, CLIENT, 7),
            node,
            "{f:?}: lbpod1 is no pod's in bridge mode"
        );
        assert_eq!(seen(&mut prefix, CLIENT, 7), client, "{f:?}: by lbpod1");
        assert_eq!(
            seen(&mut prefix, "10.244.1.9", 7),
            pod_range,
            "{f:?}: a pod by lbpod1"
        );
        assert_eq!(
            seen(&mut prefix, CLIENT, 4),
            node,
            "{f:?}: vethbr1 is no pod's in prefix mode"
        );
        assert_eq!(
            seen(&mut prefix, "10.244.1.9", 2),
            node,
            "{f:?}: a pod address by the uplink"
        );
    }
    // Links that went away leave the map at the next sync: lbpod1 is then the uplink's kind.
    prefix.links = vec![link("eth0", 2, None)];
    prefix.program(&state()).expect("programming");
    for f in FAMILIES {
        assert_eq!(
            source_after(&mut prefix, f, CLIENT, 7).expect("test run"),
            f.ip(NODE_IP),
            "{f:?}: lbpod1 is gone"
        );
    }
}

#[test]
fn non_service_traffic_passes_untouched() {
    let mut s = scratch(true);
    for f in FAMILIES {
        for pkt in [
            tcp(f, CLIENT, 45000, "10.244.1.5", 8080).build(),
            tcp(f, CLIENT, 45003, NODE_IP, 22).build(),
            // An external IP on a port no Service has: the cluster-ips-check is the cluster IPs'.
            tcp(f, CLIENT, 45004, "198.51.100.7", 81).build(),
        ] {
            for run in [ingress(&mut s, &pkt), egress(&mut s, &pkt)] {
                assert_eq!(run.action, OK);
                assert_eq!(run.packet, pkt);
            }
        }
    }
}

/// kube-proxy's cluster-ips-check (nftables mode): a new flow to a cluster IP on a port no
/// Service has is rejected (ICMP port unreachable), one to an address of a Service CIDR (here a
/// ServiceCIDR object among the manifests) that no Service holds is dropped; addresses outside
/// the CIDRs pass, and so does a Service another proxy serves (labelled
/// service.kubernetes.io/service-proxy-name). With the prefilter complete, as in production: the
/// unallocated addresses have no bit, the covering prefixes send them to the check.
#[test]
fn cluster_ip_ports_no_service_has_are_rejected_and_unallocated_service_addresses_dropped() {
    let mut state = state();
    let cidrs: Vec<String> = FAMILIES.iter().map(|f| f.net("10.96.0.0/16")).collect();
    lb_tests::fixtures::add_service_cidr(&mut state, "kubernetes", &cidrs);
    // A Service another proxy serves: kube-proxy checks after that proxy's DNAT; left alone.
    add(
        &mut state,
        service("t", "elsewhere")
            .cluster_ip("10.96.0.77")
            .port("http", "TCP", 80, 8080)
            .label("service.kubernetes.io/service-proxy-name", "other-proxy"),
        None,
    );
    let mut s = scratch_with(&state, true);
    for f in FAMILIES {
        // TCP and UDP to a port 10.96.0.10 (a Service's cluster IP) does not have.
        for spec in [
            tcp(f, CLIENT, 45101, "10.96.0.10", 81),
            udp(f, CLIENT, 45102, "10.96.0.10", 80),
        ] {
            let pkt = spec.build();
            let (before, answers) = (
                counter(&s, Counter::TcClusterIpBadPort),
                counter(&s, Counter::TcRejectRateLimited),
            );
            let out = ingress(&mut s, &pkt);
            assert_eq!(out.action, REDIRECT, "{f:?} {:?}: answered", summary(&pkt));
            assert_same(
                &out.packet,
                &expected_port_unreachable(&pkt),
                format!("{f:?}: port unreachable"),
            );
            assert_eq!(counter(&s, Counter::TcClusterIpBadPort), before + 1);
            assert_eq!(counter(&s, Counter::TcRejectRateLimited), answers);
        }
        // An address of the Service CIDR no Service holds: dropped, in both protocols.
        for spec in [
            tcp(f, CLIENT, 45103, "10.96.7.7", 80),
            udp(f, CLIENT, 45104, "10.96.200.1", 53),
        ] {
            let pkt = spec.build();
            let before = counter(&s, Counter::TcUnallocatedClusterIp);
            let out = ingress(&mut s, &pkt);
            assert_eq!(out.action, SHOT, "{f:?} {:?}: dropped", summary(&pkt));
            assert_eq!(counter(&s, Counter::TcUnallocatedClusterIp), before + 1);
        }
        let elsewhere = tcp(f, CLIENT, 45107, "10.96.0.77", 80).build();
        let run = ingress(&mut s, &elsewhere);
        assert_eq!(
            (run.action, &run.packet),
            (OK, &elsewhere),
            "{f:?}: another proxy's Service"
        );
        // Outside the CIDR, and the Service's own port: untouched by the check.
        let outside = tcp(f, CLIENT, 45105, "10.97.0.1", 80).build();
        let run = ingress(&mut s, &outside);
        assert_eq!(
            (run.action, &run.packet),
            (OK, &outside),
            "{f:?}: outside the CIDR"
        );
        let served = tcp(f, CLIENT, 45106, "10.96.0.10", 80).build();
        let run = ingress(&mut s, &served);
        assert_eq!(run.action, OK, "{f:?}: the Service's port");
        assert_eq!(
            packet::layout(&run.packet).unwrap().dst,
            f.ip("10.244.1.5"),
            "{f:?}: translated"
        );
    }
}

#[test]
fn truncated_packets_pass_untouched() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let full = tcp(f, CLIENT, 45100, "10.96.0.10", 80).build();
        let l4 = ETH_HLEN + f.ip_hlen();
        // BPF_PROG_TEST_RUN refuses a frame shorter than its IP header (kernel 6.18), so the
        // truncation cases start at the L4 header.
        let mut cut: Vec<Vec<u8>> = [l4, l4 + 6, l4 + 13, l4 + 19]
            .map(|len| full[..len].to_vec())
            .to_vec();
        if f == Family::V6 {
            // Cut inside an extension header, and inside the TCP header after one.
            let with_ext = tcp(f, CLIENT, 45100, "10.96.0.10", 80)
                .extension(DSTOPTS, 16)
                .build();
            cut.extend([l4 + 1, l4 + 4, l4 + 15, l4 + 16 + 10].map(|len| with_ext[..len].to_vec()));
        }
        let truncated = counter(&s, Counter::TcTruncated);
        for p in &cut {
            for run in [ingress(&mut s, p), egress(&mut s, p)] {
                assert_eq!(run.action, OK, "{f:?} truncated to {}", p.len());
                assert_eq!(&run.packet, p, "{f:?} truncated to {}", p.len());
            }
        }
        assert_eq!(
            counter(&s, Counter::TcTruncated) - truncated,
            cut.len() as u64,
            "{f:?}: counted at ingress"
        );
    }
}

/// `spec` as a fragment: the first (offset 0, more to come) or a later one (its bytes past the
/// IP headers are payload: the builder's L4 header there is data the programs must not touch).
fn fragment_of(mut spec: Spec, first: bool) -> Vec<u8> {
    spec.fragment = Some(Fragment {
        offset: if first { 0 } else { 185 },
        more: first,
    });
    spec.build()
}

/// A later fragment translated: its addresses (and the IPv4 header checksum), nothing past the IP
/// headers. `patched` with the packet's own ports rewrites the addresses alone.
fn readdressed(f: Family, pkt: &[u8], src: Option<&str>, dst: Option<&str>) -> Vec<u8> {
    let l4 = packet::layout(pkt).expect("an IP packet").l4;
    let port = |at: usize| u16::from_be_bytes([pkt[at], pkt[at + 1]]);
    quote_nat(f, pkt, src.map(|a| (a, port(l4))), dst.map(|a| (a, port(l4 + 2))))
}

/// A later fragment cut to `keep` bytes of payload past its IP headers, its lengths (and the IPv4
/// header checksum) made right.
fn shrunk_to(pkt: &[u8], keep: usize) -> Vec<u8> {
    let l = packet::layout(pkt).expect("an IP packet");
    let mut out = pkt[..l.l4 + keep].to_vec();
    match l.family {
        Family::V4 => {
            let total = (out.len() - ETH_HLEN) as u16;
            out[ETH_HLEN + 2..ETH_HLEN + 4].copy_from_slice(&total.to_be_bytes());
            out[ETH_HLEN + 10..ETH_HLEN + 12].fill(0);
            let c = packet::checksum(&out[ETH_HLEN..l.l4], 0);
            out[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&c.to_be_bytes());
        }
        Family::V6 => {
            let payload = (out.len() - ETH_HLEN - 40) as u16;
            out[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&payload.to_be_bytes());
        }
    }
    out
}

/// `pkt` (a later fragment too short for ports) with its destination address `dst` of family
/// `f`, and the IPv4 header checksum.
fn readdressed_ip_only(f: Family, pkt: &[u8], dst: &str) -> Vec<u8> {
    let l = packet::layout(pkt).expect("an IP packet");
    let mut out = pkt.to_vec();
    let (_, dst_at) = l.addr_offsets();
    match f.ip(dst) {
        IpAddr::V4(a) => out[dst_at..dst_at + 4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => out[dst_at..dst_at + 16].copy_from_slice(&a.octets()),
    }
    if f == Family::V4 {
        out[ETH_HLEN + 10..ETH_HLEN + 12].fill(0);
        let c = packet::checksum(&out[ETH_HLEN..l.l4], 0);
        out[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&c.to_be_bytes());
    }
    out
}

/// Byte-for-byte, for later fragments (no L4 header to verify; `readdressed` computed the IPv4
/// header checksum).
fn assert_fragment(actual: &[u8], expected: &[u8], what: impl std::fmt::Display) {
    if let Some(i) = (0..actual.len().max(expected.len())).find(|i| actual.get(*i) != expected.get(*i)) {
        panic!("{what}: byte {i} differs\n  got      {actual:02x?}\n  expected {expected:02x?}");
    }
}

/// Issue 21: only a datagram's first fragment carries its ports. The first fragment is
/// translated as any packet, the later ones the same way at L3, through the ports the first one
/// noted; in both directions, masqueraded or not. A later fragment whose first was not seen
/// passes untranslated, counted.
#[test]
fn fragments_follow_their_first_fragment() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let followed = counter(&s, Counter::TcFragmentFollowed);
        let untracked = counter(&s, Counter::TcFragment);

        // UDP from a pod to a ClusterIP (not masqueraded), and the reply.
        let dgram = udp(f, "10.244.2.20", 45600, "10.96.0.16", 53).data(&[0x5a; 64]);
        let first = fragment_of(dgram.clone(), true);
        assert_bytes(
            &ingress(&mut s, &first).packet,
            &nat(f, &first, None, Some(("10.244.1.5", 5353))),
            format!("{f:?} UDP first fragment: DNAT"),
        );
        let later = fragment_of(dgram, false);
        assert_fragment(
            &ingress(&mut s, &later).packet,
            &readdressed(f, &later, None, Some("10.244.1.5")),
            format!("{f:?} UDP later fragment: DNAT of its address"),
        );
        let reply = udp(f, "10.244.1.5", 5353, "10.244.2.20", 45600).data(&[0xa5; 64]);
        let first = fragment_of(reply.clone(), true);
        assert_bytes(
            &egress(&mut s, &first).packet,
            &nat(f, &first, Some(("10.96.0.16", 53)), None),
            format!("{f:?} UDP reply's first fragment: reverse NAT"),
        );
        let later = fragment_of(reply, false);
        assert_fragment(
            &egress(&mut s, &later).packet,
            &readdressed(f, &later, Some("10.96.0.16"), None),
            format!("{f:?} UDP reply's later fragment: reverse NAT of its address"),
        );

        // TCP from outside to a NodePort (masqueraded): the handshake whole, then a segment in
        // fragments, and the reply's.
        let syn = tcp(f, CLIENT, 45601, NODE_IP, 30080).build();
        let dnat = ingress(&mut s, &syn).packet;
        let port = summary(&egress(&mut s, &dnat).packet).sport;
        let data = tcp(f, CLIENT, 45601, NODE_IP, 30080).data(&[0x33; 64]);
        let first = fragment_of(data.clone(), true);
        let dnat = ingress(&mut s, &first).packet;
        assert_bytes(
            &dnat,
            &nat(f, &first, None, Some(("10.244.2.7", 8080))),
            format!("{f:?} TCP first fragment: DNAT"),
        );
        assert_bytes(
            &egress(&mut s, &dnat).packet,
            &nat(f, &dnat, Some((NODE_IP, port)), None),
            format!("{f:?} TCP first fragment: SNAT"),
        );
        let later = fragment_of(data, false);
        let dnat = ingress(&mut s, &later).packet;
        assert_fragment(
            &dnat,
            &readdressed(f, &later, None, Some("10.244.2.7")),
            format!("{f:?} TCP later fragment: DNAT of its address"),
        );
        assert_fragment(
            &egress(&mut s, &dnat).packet,
            &readdressed(f, &dnat, Some(NODE_IP), None),
            format!("{f:?} TCP later fragment: SNAT of its address"),
        );
        let reply = tcp(f, "10.244.2.7", 8080, NODE_IP, port).data(&[0x44; 64]);
        for first in [true, false] {
            let frag = fragment_of(reply.clone(), first);
            let unsnat = ingress(&mut s, &frag);
            assert_ne!(unsnat.mark, 0, "{f:?}: un-SNATed, marked for egress");
            let out = egress_marked(&mut s, &unsnat.packet, unsnat.mark);
            if first {
                assert_bytes(
                    &unsnat.packet,
                    &nat(f, &frag, None, Some((CLIENT, 45601))),
                    format!("{f:?} TCP reply's first fragment: un-SNAT"),
                );
                assert_bytes(
                    &out.packet,
                    &nat(f, &unsnat.packet, Some((NODE_IP, 30080)), None),
                    format!("{f:?} TCP reply's first fragment: reverse NAT"),
                );
            } else {
                assert_fragment(
                    &unsnat.packet,
                    &readdressed(f, &frag, None, Some(CLIENT)),
                    format!("{f:?} TCP reply's later fragment: un-SNAT of its address"),
                );
                // The node's address both ways: the NodePort is on the node's address.
                assert_fragment(
                    &out.packet,
                    &readdressed(f, &unsnat.packet, Some(NODE_IP), None),
                    format!("{f:?} TCP reply's later fragment: reverse NAT of its address"),
                );
            }
        }
        // ingress and egress each followed the UDP pair's, the segment's and the reply's.
        assert_eq!(counter(&s, Counter::TcFragmentFollowed) - followed, 6, "{f:?}");
        assert_eq!(counter(&s, Counter::TcFragment), untracked, "{f:?}");

        // A datagram's last fragment may carry a single byte: translated all the same.
        let tiny = shrunk_to(
            &fragment_of(udp(f, "10.244.2.20", 45600, "10.96.0.16", 53), false),
            1,
        );
        assert_fragment(
            &ingress(&mut s, &tiny).packet,
            &readdressed_ip_only(f, &tiny, "10.244.1.5"),
            format!("{f:?} a one-byte last fragment: DNAT of its address"),
        );

        // A later fragment whose first one never came (the builder gives every packet one IP id:
        // another source makes it another datagram): untouched, counted.
        let mut stray = udp(f, "10.244.2.21", 45602, "10.96.0.16", 53).data(&[1; 64]);
        stray.fragment = Some(Fragment {
            offset: 185,
            more: false,
        });
        let stray = stray.build();
        let out = ingress(&mut s, &stray);
        assert_eq!((out.action, out.packet), (OK, stray), "{f:?}: a stray fragment");
        assert_eq!(counter(&s, Counter::TcFragment) - untracked, 1, "{f:?}");
    }
}

#[test]
fn ip_options_are_handled() {
    let mut s = scratch(true);
    let f = Family::V4;
    let mut spec = tcp(f, "10.244.2.20", 45200, "10.96.0.10", 80);
    spec.options = vec![1, 1, 1, 0]; // NOP, NOP, NOP, EOL
    let syn = spec.build();
    let out = ingress(&mut s, &syn);
    assert_bytes(
        &out.packet,
        &nat(f, &syn, None, Some(("10.244.1.5", 8080))),
        "DNAT with IP options",
    );
}

#[test]
fn ipv6_extension_headers_before_l4_are_handled() {
    let mut s = scratch(true);
    let f = Family::V6;
    let chains: [&[(u8, usize)]; 5] = [
        &[(HOPOPTS, 8)],
        &[(DSTOPTS, 8)],
        &[(HOPOPTS, 8), (DSTOPTS, 16)],
        &[(HOPOPTS, 16), (ROUTING, 8), (DSTOPTS, 24)],
        &[(packet::AUTH, 12)],
    ];
    for (i, chain) in chains.iter().enumerate() {
        let sport = 45200 + i as u16;
        let with = |mut spec: Spec| {
            spec.extensions = chain.to_vec();
            spec
        };
        // A new flow through the headers: DNAT, and (a NodePort) masquerade.
        let syn = with(tcp(f, "10.244.2.20", sport, "10.96.0.10", 80)).build();
        let out = ingress(&mut s, &syn);
        assert_bytes(
            &out.packet,
            &nat(f, &syn, None, Some(("10.244.1.5", 8080))),
            format!("{chain:?}: DNAT"),
        );
        let data = with(tcp(f, "10.244.2.20", sport, "10.96.0.10", 80))
            .data(b"more")
            .build();
        assert_bytes(
            &ingress(&mut s, &data).packet,
            &nat(f, &data, None, Some(("10.244.1.5", 8080))),
            format!("{chain:?}: the established flow"),
        );
        let reply = with(tcp(f, "10.244.1.5", 8080, "10.244.2.20", sport))
            .data(b"ok")
            .build();
        assert_bytes(
            &egress(&mut s, &reply).packet,
            &nat(f, &reply, Some(("10.96.0.10", 80)), None),
            format!("{chain:?}: reverse NAT"),
        );
        let np = with(udp(f, CLIENT, sport, "10.96.0.16", 53)).build();
        let dnat = ingress(&mut s, &np);
        assert_bytes(
            &dnat.packet,
            &nat(f, &np, None, Some(("10.244.1.5", 5353))),
            format!("{chain:?}: UDP DNAT"),
        );
        let snat = egress(&mut s, &dnat.packet);
        let port = summary(&snat.packet).sport;
        assert_bytes(
            &snat.packet,
            &nat(f, &dnat.packet, Some((NODE_IP, port)), None),
            format!("{chain:?}: UDP SNAT"),
        );
    }
    // More extension headers than the programs walk: left alone, not counted as anything.
    let counters = |s: &ScratchDatapath| {
        [Counter::TcTruncated, Counter::TcFragment, Counter::TcNewFlow].map(|c| counter(s, c))
    };
    let before = counters(&s);
    let mut spec = tcp(f, "10.244.2.20", 45300, "10.96.0.10", 80);
    spec.extensions = vec![
        (HOPOPTS, 8),
        (DSTOPTS, 8),
        (ROUTING, 8),
        (DSTOPTS, 8),
        (DSTOPTS, 8),
    ];
    let p = spec.build();
    for run in [ingress(&mut s, &p), egress(&mut s, &p)] {
        assert_eq!((run.action, &run.packet), (OK, &p), "five extension headers");
    }
    assert_eq!(counters(&s), before);
}

#[test]
fn an_ipv6_atomic_fragment_is_translated() {
    // A fragment header with offset 0 and M clear (RFC 6946): a whole packet, sent so by hosts
    // that were told of an MTU below 1280 (and by some middleboxes).
    let mut s = scratch(true);
    let f = Family::V6;
    let atomic = Fragment {
        offset: 0,
        more: false,
    };
    let fragments = counter(&s, Counter::TcFragment);
    for (i, chain) in [vec![], vec![(DSTOPTS, 8)]].into_iter().enumerate() {
        let sport = 45400 + i as u16;
        let mut syn = tcp(f, CLIENT, sport, NODE_IP, 30080);
        syn.fragment = Some(atomic);
        syn.extensions = chain.clone();
        let syn = syn.build();
        let l = packet::layout(&syn).unwrap();
        assert!(l.atomic_fragment && !l.fragment);
        let dnat = ingress(&mut s, &syn);
        assert_bytes(
            &dnat.packet,
            &nat(f, &syn, None, Some(("10.244.2.7", 8080))),
            format!("{chain:?}: DNAT of an atomic fragment"),
        );
        let snat = egress(&mut s, &dnat.packet);
        let port = summary(&snat.packet).sport;
        assert_bytes(
            &snat.packet,
            &nat(f, &dnat.packet, Some((NODE_IP, port)), None),
            format!("{chain:?}: SNAT of an atomic fragment"),
        );
        let mut dgram = udp(f, CLIENT, sport, "10.96.0.16", 53);
        dgram.fragment = Some(atomic);
        let dgram = dgram.build();
        assert_bytes(
            &ingress(&mut s, &dgram).packet,
            &nat(f, &dgram, None, Some(("10.244.1.5", 5353))),
            format!("{chain:?}: UDP atomic fragment"),
        );
    }
    assert_eq!(
        counter(&s, Counter::TcFragment),
        fragments,
        "not counted as fragments"
    );
}

#[test]
fn udp_is_translated_with_correct_checksums_in_both_families() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let dgram = udp(f, "10.244.2.20", 45300, "10.96.0.16", 53).build();
        let out = ingress(&mut s, &dgram);
        assert_bytes(
            &out.packet,
            &nat(f, &dgram, None, Some(("10.244.1.5", 5353))),
            format!("{f:?} UDP DNAT"),
        );
        let reply = udp(f, "10.244.1.5", 5353, "10.244.2.20", 45300).build();
        assert_bytes(
            &egress(&mut s, &reply).packet,
            &nat(f, &reply, Some(("10.96.0.16", 53)), None),
            format!("{f:?} UDP reverse NAT"),
        );
        // A zero checksum: IPv4's "none" stays none; in IPv6 it is invalid (RFC 8200 8.1) before
        // and after, and the receiver drops it as it would have.
        let mut no_csum = udp(f, "10.244.2.20", 45301, "10.96.0.16", 53).build();
        let at = packet::layout(&no_csum).unwrap().l4 + 6;
        no_csum[at..at + 2].fill(0);
        let out = ingress(&mut s, &no_csum);
        assert_eq!(&out.packet[at..at + 2], &[0, 0], "{f:?}: zero stays zero");
        assert_eq!(summary(&out.packet).dst, f.ip("10.244.1.5"));
        // A datagram whose checksum after translation sums to zero is sent with 0xffff (a zero
        // would mean "none" in IPv4, and be invalid in IPv6).
        let dst = f.addr("10.244.1.5");
        let word = (0..=u16::MAX)
            .find(|w| {
                let p = udp(f, "10.244.2.20", 45302, "10.96.0.16", 53)
                    .data(&w.to_be_bytes())
                    .build();
                let expected = rewritten(&p, None, Some((&dst, 5353)));
                expected[at..at + 2] == [0xff, 0xff]
            })
            .expect("a payload that makes the checksum zero");
        let p = udp(f, "10.244.2.20", 45302, "10.96.0.16", 53)
            .data(&word.to_be_bytes())
            .build();
        let out = ingress(&mut s, &p);
        assert_eq!(
            &out.packet[at..at + 2],
            &[0xff, 0xff],
            "{f:?}: a zero sum is sent as 0xffff"
        );
        assert_bytes(
            &out.packet,
            &nat(f, &p, None, Some(("10.244.1.5", 5353))),
            format!("{f:?} UDP DNAT to a zero sum"),
        );
    }
}

#[test]
fn a_udp_flow_whose_backend_is_removed_moves_to_a_live_one() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let mut st = state();
        let dns = |ip: &str| {
            slice("t", "dns", "dns-1")
                .endpoint(ip, "node-a", State::Ready)
                .port("dns", "UDP", 5353)
                .in_family(f)
                .build()
        };
        st.add_slice(dns("10.244.1.5"));
        s.program(&st).unwrap();
        let dgram = udp(f, "10.244.2.20", 45400, "10.96.0.16", 53).build();
        assert_eq!(summary(&ingress(&mut s, &dgram).packet).dst, f.ip("10.244.1.5"));
        st.add_slice(dns("10.244.1.77"));
        s.program(&st).unwrap();
        assert_eq!(
            summary(&ingress(&mut s, &dgram).packet).dst,
            f.ip("10.244.1.77"),
            "{f:?}: the next datagram of the same flow goes to the live backend"
        );
        assert_eq!(counter(&s, Counter::TcStaleUdpMoved), 1 + f as u64);
    }
}

#[test]
fn icmp_errors_for_a_masqueraded_flow_are_translated_back() {
    let mut s = scratch(true);
    for f in FAMILIES {
        let errors = [
            IcmpError::TooBig { mtu: 1400 },
            IcmpError::HostUnreachable,
            IcmpError::TimeExceeded,
        ];
        for (i, kind) in errors.into_iter().enumerate() {
            let cport = 46000 + i as u16;
            let what = format!("{f:?} {kind:?}");
            let syn = tcp(f, CLIENT, cport, NODE_IP, 30080).build();
            let dnat = ingress(&mut s, &syn).packet;
            egress(&mut s, &dnat);
            let data = tcp(f, CLIENT, cport, NODE_IP, 30080).data(&[0x55; 200]).build();
            let dnat = ingress(&mut s, &data);
            let snat = egress(&mut s, &dnat.packet);
            let port = summary(&snat.packet).sport;
            assert!((20_000..=29_999).contains(&port));
            // A router between the nodes cannot forward the (masqueraded) packet: it answers the
            // node's address, quoting the packet as it saw it (IPv6: all of it).
            let router = f.addr("10.244.2.1");
            let error = packet::icmp_error(&router, &f.addr(NODE_IP), kind, &snat.packet);
            let back = ingress(&mut s, &error);
            assert_eq!(back.action, OK, "{what}");
            assert_ne!(back.mark, 0, "{what}: marked for egress");
            // To the client, quoting its own source (the rest of the quote as it was: its L4
            // checksum is not the receiver's business).
            let quote = quote_nat(f, &snat.packet, Some((CLIENT, cport)), None);
            let expected = packet::icmp_error(&router, &f.addr(CLIENT), kind, &quote);
            assert_same(&back.packet, &expected, format!("{what} at ingress"));
            // Leaving towards the client, the quote names the NodePort the client called.
            let out = egress_marked(&mut s, &back.packet, back.mark);
            assert_eq!((out.action, out.mark), (OK, 0), "{what}");
            let quote = quote_nat(f, &quote, None, Some((NODE_IP, 30080)));
            let expected = packet::icmp_error(&router, &f.addr(CLIENT), kind, &quote);
            assert_same(&out.packet, &expected, format!("{what} at egress"));
            let q = packet::quoted_summary(&out.packet);
            assert_eq!(
                (q.src, q.sport, q.dst, q.dport),
                (f.ip(CLIENT), cport, f.ip(NODE_IP), 30080),
                "{what}"
            );
        }
    }
    assert_eq!(counter(&s, Counter::TcIcmpErrorTranslated), 2 * 3 * 2);
}

/// A masqueraded NodePort flow of `spec`'s protocol, `CLIENT:client_port` to
/// `NODE_IP:node_port`, backend `10.244.2.7:backend_port`, whose answer as it left the node (from
/// the NodePort) the client's side of the network cannot carry: the router's Packet Too Big (path
/// MTU discovery of the backend's answers) reaches the backend, quoting what the backend sent
/// (backend -> the node's masquerade address).
fn too_big_about_a_masqueraded_answer(
    s: &mut ScratchDatapath,
    f: Family,
    spec: fn(Family, &str, u16, &str, u16) -> Spec,
    (client_port, node_port, backend_port): (u16, u16, u16),
) {
    let first = spec(f, CLIENT, client_port, NODE_IP, node_port).build();
    let dnat = ingress(s, &first);
    let snat = egress(s, &dnat.packet);
    let port = summary(&snat.packet).sport;
    let answer = spec(f, "10.244.2.7", backend_port, NODE_IP, port)
        .data(&[0xaa; 300])
        .build();
    let unsnat = ingress(s, &answer);
    let sent = egress_marked(s, &unsnat.packet, unsnat.mark).packet;
    assert_eq!(
        summary(&sent).src,
        f.ip(NODE_IP),
        "the answer left as the NodePort"
    );
    let router = f.addr("192.168.50.1");
    let kind = IcmpError::TooBig { mtu: 1280 };
    let error = packet::icmp_error(&router, &f.addr(NODE_IP), kind, &sent);
    let back = ingress(s, &error);
    assert_eq!(back.action, OK, "{f:?}");
    let quote = quote_nat(
        f,
        &sent,
        Some(("10.244.2.7", backend_port)),
        Some((NODE_IP, port)),
    );
    let expected = packet::icmp_error(&router, &f.addr("10.244.2.7"), kind, &quote);
    assert_same(&back.packet, &expected, format!("{f:?} error about an answer"));
}

#[test]
fn icmp_errors_about_replies_are_translated_for_the_backend_and_the_client() {
    let mut s = scratch(true);
    for f in FAMILIES {
        too_big_about_a_masqueraded_answer(&mut s, f, tcp, (47000, 30080, 8080));

        // A flow that is not masqueraded (Local policy): the backend's own error about the
        // client's packet leaves towards the client naming the NodePort the client called.
        let syn = tcp(f, CLIENT, 47001, NODE_IP, 30081).build();
        let dnat = ingress(&mut s, &syn).packet;
        let error = packet::icmp_error(
            &f.addr("10.244.1.6"),
            &f.addr(CLIENT),
            IcmpError::PortUnreachable,
            &dnat,
        );
        let out = egress(&mut s, &error);
        assert_eq!(out.action, OK);
        let quote = quote_nat(f, &dnat, None, Some((NODE_IP, 30081)));
        let expected = packet::icmp_error(
            &f.addr("10.244.1.6"),
            &f.addr(CLIENT),
            IcmpError::PortUnreachable,
            &quote,
        );
        assert_same(&out.packet, &expected, format!("{f:?} the backend's error"));
    }
}

#[test]
fn neighbour_discovery_and_other_icmpv6_pass_untouched() {
    let mut s = scratch(true);
    let frontend = Family::V6.ip("10.96.0.10");
    let node = Family::V6.ip(NODE_IP);
    let ll = |s: &str| -> IpAddr { s.parse().unwrap() };
    let target = |ip: IpAddr| match ip {
        IpAddr::V6(a) => a.octets(),
        IpAddr::V4(_) => unreachable!(),
    };
    // (from, to, type, code, body after the 4 bytes that follow the checksum)
    let messages: Vec<(IpAddr, IpAddr, u8, u8, Vec<u8>)> = vec![
        // Neighbour solicitation for the cluster IP and the node, to the solicited-node group.
        (
            ll("fe80::1"),
            ll("ff02::1:ff00:10"),
            135,
            0,
            target(frontend).to_vec(),
        ),
        (ll("fe80::1"), node, 135, 0, target(node).to_vec()),
        // Neighbour advertisement of the cluster IP (a proxy-ARP-like answer).
        (ll("fe80::2"), ll("fe80::1"), 136, 0, target(frontend).to_vec()),
        // Router solicitation and advertisement.
        (ll("fe80::1"), ll("ff02::2"), 133, 0, vec![]),
        (ll("fe80::2"), ll("ff02::1"), 134, 0, vec![0; 8]),
        // Echo request and reply to and from a frontend.
        (Family::V6.ip(CLIENT), frontend, 128, 0, b"ping".to_vec()),
        (frontend, Family::V6.ip(CLIENT), 129, 0, b"pong".to_vec()),
        // An error of a type that quotes nothing the programs translate (parameter problem
        // about the neighbour solicitation above).
        (ll("fe80::2"), ll("fe80::1"), 4, 1, vec![]),
    ];
    // MLD listener report, after a hop-by-hop header (router alert), as hosts send them.
    let mut mld = packet::icmp_raw(ll("fe80::1"), ll("ff02::16"), 143, 0, [0; 4], &[]);
    let hbh = vec![packet::ICMPV6, 0, 5, 2, 0, 0, 1, 0];
    mld.splice(54..54, hbh);
    mld[ETH_HLEN + 6] = HOPOPTS;
    let payload = u16::from_be_bytes([mld[18], mld[19]]) + 8;
    mld[18..20].copy_from_slice(&payload.to_be_bytes());
    let mut frames: Vec<Vec<u8>> = messages
        .into_iter()
        .map(|(from, to, kind, code, body)| {
            let mut p = packet::icmp_raw(from, to, kind, code, [0; 4], &body);
            p[ETH_HLEN + 7] = 255; // hop limit, as neighbour discovery requires
            p
        })
        .collect();
    frames.push(mld);
    for p in &frames {
        for mark in [0, 0x5EA0_0001] {
            for run in [ingress(&mut s, p), egress_marked(&mut s, p, mark)] {
                assert_eq!(run.action, OK, "{}", hex(p));
                assert_eq!(&run.packet, p, "ICMPv6 type {} rewritten", p[54]);
            }
        }
    }
    assert_eq!(counter(&s, Counter::TcIcmpErrorTranslated), 0);
}

/// A scratch data path whose masquerade range is two ports (20000 and 20001), to exhaust.
fn scratch_with_two_snat_ports() -> ScratchDatapath {
    use lb_agent::apply::MapOps;
    let mut s = scratch(true);
    let mut cfg = s.maps().config.get(&0, 0).expect("config");
    cfg.snat_port_min = 20_000;
    cfg.snat_port_max = 20_001;
    s.maps_mut().put_config(&cfg).expect("config");
    s
}

/// Regression: the entries of closed connections held their masquerade ports until LRU eviction
/// (only once the whole map was full), so after as many connections as the SNAT range has ports
/// every new NodePort connection to that backend was dropped. The programs now mark FIN and RST,
/// and the agent's conntrack GC frees ended flows, in both families' maps.
#[test]
fn closed_masqueraded_flows_give_their_ports_back_through_the_conntrack_gc() {
    use lb_agent::datapath::conntrack;
    use packet::Close;

    for f in FAMILIES {
        let mut s = scratch_with_two_snat_ports();
        let mut ct = s.datapath.take_conntrack().expect("conntrack maps");
        const BACKEND: &str = "10.244.2.7";

        // Opens a NodePort connection from `cport`; its masquerade port, or None when dropped.
        let connect = |s: &mut ScratchDatapath, cport: u16| -> Option<u16> {
            let dnat = ingress(s, &tcp(f, CLIENT, cport, NODE_IP, 30080).build());
            if dnat.action == SHOT {
                return None;
            }
            assert_eq!(summary(&dnat.packet).dst, f.ip(BACKEND));
            let snat = egress(s, &dnat.packet);
            Some(summary(&snat.packet).sport)
        };
        let a = connect(&mut s, 41000).expect("first connection");
        let b = connect(&mut s, 41001).expect("second connection");
        assert_eq!([a.min(b), a.max(b)], [20_000, 20_001]);
        let exhausted = |s: &ScratchDatapath| counter(s, Counter::TcSnatPortsExhausted);
        assert_eq!(connect(&mut s, 41002), None, "both ports taken: dropped");
        assert_eq!(exhausted(&s), 1);

        // A is closed by both sides (FIN from the client, translated on the way in; FIN from the
        // backend, un-SNATed on the way back); B only by its client.
        let fin = ingress(
            &mut s,
            &tcp(f, CLIENT, 41000, NODE_IP, 30080).closing(Close::Fin).build(),
        );
        assert_eq!(summary(&fin.packet).dst, f.ip(BACKEND));
        let reply_fin = ingress(
            &mut s,
            &tcp(f, BACKEND, 8080, NODE_IP, a).closing(Close::Fin).build(),
        );
        assert_eq!(summary(&reply_fin.packet).dst, f.ip(CLIENT));
        ingress(
            &mut s,
            &tcp(f, CLIENT, 41001, NODE_IP, 30080).closing(Close::Fin).build(),
        );

        // Within the FIN timeout nothing goes; after it, A's three entries do, B's stay.
        let timeouts = conntrack::GcTimeouts::default();
        let now = lb_agent::time::monotonic_coarse_ns();
        let early = ct.collect(now, &timeouts).expect("gc");
        assert!(early.deleted.is_empty(), "{f:?} {early:?}");
        assert_eq!(early.scanned, 3 * 2, "{f:?}: two flows of three entries");
        let later = now + timeouts.tcp_fin_timeout.as_nanos() as u64 + 1_000_000_000;
        let report = ct.collect(later, &timeouts).expect("gc");
        assert_eq!(
            report.deleted,
            vec![(conntrack::Reason::Closed, 3)],
            "{f:?} {report:?}"
        );

        // A's port serves a new connection; B's is still taken.
        assert_eq!(connect(&mut s, 41002), Some(a));
        assert_eq!(connect(&mut s, 41003), None, "B still holds its port");

        // A reset by the backend ends B at once (after the timeout).
        ingress(
            &mut s,
            &tcp(f, BACKEND, 8080, NODE_IP, b).closing(Close::Rst).build(),
        );
        let later = lb_agent::time::monotonic_coarse_ns()
            + timeouts.tcp_fin_timeout.as_nanos() as u64
            + 1_000_000_000;
        let report = ct.collect(later, &timeouts).expect("gc");
        assert_eq!(
            report.deleted,
            vec![(conntrack::Reason::Closed, 3)],
            "{f:?} {report:?}"
        );
        assert_eq!(connect(&mut s, 41003), Some(b));
    }
}

/// Regression (issue 18's flood): spoofed SYNs to a NodePort held every masquerade port towards
/// the backend with flows whose handshake never completed, and every legitimate new connection
/// was dropped until the GC's timeouts. A new flow that finds every port it tries held now takes
/// one back from a TCP flow whose client never went past its SYN for a second, or from a UDP
/// flow silent both ways for 2 s (netfilter's early drop of unassured connections); never from
/// an established connection or a UDP flow still talking.
#[test]
fn a_flood_of_unfinished_handshakes_gives_its_masquerade_ports_back() {
    use std::time::Duration;

    for f in FAMILIES {
        let mut s = scratch_with_two_snat_ports();
        let reclaimed = |s: &ScratchDatapath| counter(s, Counter::TcSnatPortReclaimed);

        // A flow's first packet (a SYN, or a datagram); its masquerade port, or None if dropped.
        let open = |s: &mut ScratchDatapath, first: &Spec| -> Option<u16> {
            let dnat = ingress(s, &first.build());
            if dnat.action == SHOT {
                return None;
            }
            Some(summary(&egress(s, &dnat.packet).packet).sport)
        };
        let syn = |cport: u16| tcp(f, CLIENT, cport, NODE_IP, 30080);
        let a = open(&mut s, &syn(41000)).expect("A");
        let b = open(&mut s, &syn(41001)).expect("B");
        // A's client completes its handshake (its ACK, with data); B's never answers.
        let ack = ingress(&mut s, &syn(41000).data(b"GET /").build());
        assert_eq!(ack.action, OK);
        assert_eq!(
            open(&mut s, &syn(41002)),
            None,
            "{f:?}: handshakes under a second keep their ports"
        );
        assert_eq!(reclaimed(&s), 0);
        std::thread::sleep(Duration::from_millis(1_100));
        assert_eq!(
            open(&mut s, &syn(41002)),
            Some(b),
            "{f:?}: B's unfinished handshake gave its port back"
        );
        assert_eq!(reclaimed(&s), 1);
        assert_eq!(
            open(&mut s, &syn(41003)),
            None,
            "{f:?}: A is established, C is young"
        );
        // A still flows through its port.
        let more = ingress(&mut s, &syn(41000).data(b"more").build());
        assert_eq!(summary(&egress(&mut s, &more.packet).packet).sport, a);

        // UDP: two flows hold the two ports; after 2 s one has spoken again, the other is silent.
        let dgram = |cport: u16| udp(f, CLIENT, cport, "10.96.0.16", 53);
        let u = open(&mut s, &dgram(42000)).expect("U");
        let v = open(&mut s, &dgram(42001)).expect("V");
        assert_eq!(open(&mut s, &dgram(42002)), None, "{f:?}: both UDP ports held");
        std::thread::sleep(Duration::from_millis(2_100));
        assert_eq!(
            open(&mut s, &dgram(42000)),
            Some(u),
            "{f:?}: U speaks again on its port"
        );
        assert_eq!(
            open(&mut s, &dgram(42002)),
            Some(v),
            "{f:?}: silent V gave its port back"
        );
        assert_eq!(reclaimed(&s), 2);
        assert_eq!(
            open(&mut s, &dgram(42003)),
            None,
            "{f:?}: U is talking, W is young"
        );
    }
}

/// Issue 18's flood, second half: a flood that fills the conntrack table made LRU eviction take
/// established connections that had been idle for a few seconds (6 of 6 in scenario 10-flood at
/// `--bpf-ct-map-max 65536`), where nf_conntrack never early-drops an assured connection. A new
/// flow's entries now live in a table of their own (`lb4_ct_new`) until its client goes past the
/// handshake (a TCP packet without SYN, a second UDP datagram), then move to `lb4_ct`: a flood of
/// SYNs or one-datagram UDP that never completes evicts only its own kind.
#[test]
fn a_flood_evicts_only_flows_that_never_got_past_their_handshake() {
    const BACKEND: &str = "10.244.2.7";
    const NEW_FLOW_CAPACITY: u32 = 256;
    const FLOOD: u32 = 2_000;

    for f in FAMILIES {
        let mut s = scratch_with_new_flow_capacity(NEW_FLOW_CAPACITY);
        let ct = s.datapath.take_conntrack().expect("conntrack maps");
        // Entries of this family in the established table and in the new-flow table.
        let occupancy = || match f {
            Family::V4 => (ct.v4.keys().count(), ct.new_v4.keys().count()),
            Family::V6 => (ct.v6.keys().count(), ct.new_v6.keys().count()),
        };
        let established = |s: &ScratchDatapath| counter(s, Counter::TcFlowEstablished);

        // A: a NodePort connection, masqueraded, through its handshake.
        let syn = ingress(&mut s, &tcp(f, CLIENT, 41000, NODE_IP, 30080).build());
        assert_eq!(summary(&syn.packet).dst, f.ip(BACKEND));
        let port = summary(&egress(&mut s, &syn.packet).packet).sport;
        assert_eq!(occupancy(), (0, 3), "{f:?}: a SYN's flow is new");
        let syn_ack = ingress(&mut s, &tcp(f, BACKEND, 8080, NODE_IP, port).data(b"").build());
        assert_eq!(
            summary(&syn_ack.packet).dst,
            f.ip(CLIENT),
            "{f:?}: un-SNAT from the new table"
        );
        assert_eq!(
            occupancy(),
            (0, 3),
            "{f:?}: the backend's answer does not establish"
        );
        let ack = ingress(
            &mut s,
            &tcp(f, CLIENT, 41000, NODE_IP, 30080).data(b"GET /").build(),
        );
        assert_eq!(summary(&ack.packet).dst, f.ip(BACKEND));
        assert_eq!(summary(&egress(&mut s, &ack.packet).packet).sport, port);
        assert_eq!(
            occupancy(),
            (3, 0),
            "{f:?}: the client's ACK moved all three entries"
        );
        assert_eq!(established(&s), 1);

        // The flood: spoofed SYNs from FLOOD sources, eight times what the new-flow table holds.
        let new_flows = counter(&s, Counter::TcNewFlow);
        for i in 0..FLOOD {
            let src = format!("198.18.{}.{}", i / 250, i % 250 + 1);
            let out = ingress(&mut s, &tcp(f, &src, 40000, NODE_IP, 30080).build());
            assert_eq!(out.action, OK, "{f:?}: flood SYN {i}");
        }
        assert_eq!(counter(&s, Counter::TcNewFlow) - new_flows, u64::from(FLOOD));
        let (kept, new) = occupancy();
        assert_eq!(
            kept, 3,
            "{f:?}: the flood wrote nothing into the established table"
        );
        assert!(new <= NEW_FLOW_CAPACITY as usize, "{f:?}: {new}");

        // A, idle through the flood, goes on: same backend, same masquerade port, replies back.
        let new_flows = counter(&s, Counter::TcNewFlow);
        let more = ingress(
            &mut s,
            &tcp(f, CLIENT, 41000, NODE_IP, 30080).data(b"more").build(),
        );
        assert_eq!(summary(&more.packet).dst, f.ip(BACKEND));
        assert_eq!(summary(&egress(&mut s, &more.packet).packet).sport, port);
        let reply = ingress(&mut s, &tcp(f, BACKEND, 8080, NODE_IP, port).data(b"200").build());
        assert_eq!(summary(&reply.packet).dst, f.ip(CLIENT));
        assert_eq!(
            counter(&s, Counter::TcNewFlow),
            new_flows,
            "{f:?}: A is not a new flow"
        );

        // UDP: one datagram stays new; the client's second one establishes the flow.
        let dgram = || udp(f, CLIENT, 42000, "10.96.0.16", 53).build();
        let first = ingress(&mut s, &dgram());
        egress(&mut s, &first.packet);
        assert_eq!(occupancy().0, 3, "{f:?}: one datagram is a new flow");
        let second = ingress(&mut s, &dgram());
        assert_eq!(summary(&second.packet).dst, summary(&first.packet).dst);
        assert_eq!(established(&s), 2);
        let (kept, _) = occupancy();
        assert!(kept > 3, "{f:?}: the UDP flow's entries moved ({kept})");
    }
}

/// Regression (scenario 10-flood, a UDP request lost 1.5 s after the flood: its forward and SNAT
/// entries were in `lb4_ct_new`, its un-SNAT entry gone). The kernel writes a new LRU entry with
/// its reference bit clear, and a CPU refilling its free list evicts unreferenced entries first.
/// After a flood every older entry has been referenced (by its SYN-ACK, its retransmitted SYN),
/// so the unreferenced ones were the newest: a new flow's entries, written a moment before the
/// reply that would have referenced them. The programs now mark each entry used as they write it
/// (`family::insert_used`), so eviction takes the oldest flows, as an LRU should.
#[test]
fn a_new_flows_entries_outlive_a_full_table_until_its_reply() {
    const BACKEND: &str = "10.244.2.7";
    const NEW_FLOW_CAPACITY: u32 = 256;
    // Answered flows, more than the table holds: it ends full of referenced entries.
    const FLOOD: u32 = 200;
    // Unanswered SYNs written after the flow: a third of the table, so that the flow is still
    // among the newest entries when its reply comes.
    const AFTER: u32 = 30;

    // Every test run on one CPU, as a flood's packets mostly are: one local free list and its
    // pending entries, so that the refills below happen where the flow's entries wait.
    let mut cpus = nix::sched::CpuSet::new();
    let cpu = nix::sched::sched_getcpu().expect("sched_getcpu");
    cpus.set(cpu).expect("cpu set");
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &cpus).expect("sched_setaffinity");

    for f in FAMILIES {
        let mut s = scratch_with_new_flow_capacity(NEW_FLOW_CAPACITY);
        let syn = |src: &str, sport| tcp(f, src, sport, NODE_IP, 30080).build();
        let answer = |port| tcp(f, BACKEND, 8080, NODE_IP, port).data(b"").build();

        for i in 0..FLOOD {
            let src = format!("198.18.{}.{}", i / 250, i % 250 + 1);
            let first = ingress(&mut s, &syn(&src, 40000));
            let port = summary(&egress(&mut s, &first.packet).packet).sport;
            let syn_ack = ingress(&mut s, &answer(port));
            assert_eq!(
                summary(&syn_ack.packet).dst,
                f.ip(&src),
                "{f:?}: flood flow {i} answered"
            );
            ingress(&mut s, &syn(&src, 40000));
        }

        let first = ingress(&mut s, &syn(CLIENT, 41000));
        assert_eq!(summary(&first.packet).dst, f.ip(BACKEND));
        let port = summary(&egress(&mut s, &first.packet).packet).sport;
        for i in 0..AFTER {
            let src = format!("198.19.{}.{}", i / 250, i % 250 + 1);
            assert_eq!(ingress(&mut s, &syn(&src, 40001)).action, OK, "{f:?}: SYN {i}");
        }
        let syn_ack = ingress(&mut s, &answer(port));
        let got = summary(&syn_ack.packet);
        assert_eq!(
            (got.dst, got.dport),
            (f.ip(CLIENT), 41000),
            "{f:?}: the backend's answer is un-SNATed to the client"
        );
        let ack = ingress(
            &mut s,
            &tcp(f, CLIENT, 41000, NODE_IP, 30080).data(b"GET /").build(),
        );
        assert_eq!(
            summary(&ack.packet).dst,
            f.ip(BACKEND),
            "{f:?}: the flow keeps its backend"
        );
        assert_eq!(summary(&egress(&mut s, &ack.packet).packet).sport, port);
    }
}

/// A new flow whose un-SNAT entry went before it was established (evicted from a full
/// `lb4_ct_new`) had lost its replies for good: the client's next packet moved the rest of the
/// flow to `lb4_ct` and went on through the dead masquerade port, and a UDP client reusing its
/// socket waited on every answer for as long as it sent. Its establishing packet now starts the
/// flow again (`tc_flow_restarted`), with every entry written anew.
#[test]
fn a_new_flow_missing_an_entry_starts_again_at_its_next_packet() {
    const BACKEND: &str = "10.244.2.7";
    for f in FAMILIES {
        let mut s = scratch(true);
        let mut ct = s.datapath.take_conntrack().expect("conntrack maps");
        // Deletes the flow's un-SNAT entry from the new-flow table, as LRU eviction would.
        let mut evict_unsnat = || {
            let removed = match f {
                Family::V4 => remove_entries_where(&mut ct.new_v4, is_unsnat),
                Family::V6 => remove_entries_where(&mut ct.new_v6, is_unsnat),
            };
            assert_eq!(removed, 1, "{f:?}: one un-SNAT entry");
        };
        let restarted = |s: &ScratchDatapath| counter(s, Counter::TcFlowRestarted);

        // UDP from outside the cluster to a cluster IP: masqueraded (the masquerade address and
        // port read from the packet at egress); its un-SNAT entry goes; the answer is lost.
        let dgram = || udp(f, CLIENT, 42100, "10.96.0.16", 53).build();
        let answer =
            |to: (IpAddr, u16)| packet::udp(&f.addr("10.244.1.5"), 5353, &to.0.to_string(), to.1).build();
        let first = ingress(&mut s, &dgram());
        assert_eq!(summary(&first.packet).dst, f.ip("10.244.1.5"), "{f:?}: DNAT");
        let out = summary(&egress(&mut s, &first.packet).packet);
        evict_unsnat();
        let lost = ingress(&mut s, &answer((out.src, out.sport)));
        assert_eq!(summary(&lost.packet).dst, out.src, "{f:?}: no entry, no un-SNAT");
        // The client's next datagram from the same socket: a flow of its own, answered.
        let second = ingress(&mut s, &dgram());
        assert_eq!(restarted(&s), 1, "{f:?}: the flow started again");
        let out = summary(&egress(&mut s, &second.packet).packet);
        let got = summary(&ingress(&mut s, &answer((out.src, out.sport))).packet);
        assert_eq!((got.dst, got.dport), (f.ip(CLIENT), 42100), "{f:?}: answered");
        let third = ingress(&mut s, &dgram());
        assert_eq!(summary(&egress(&mut s, &third.packet).packet).sport, out.sport);
        assert_eq!(restarted(&s), 1, "{f:?}: a complete flow establishes as before");

        // TCP: the un-SNAT entry goes after the SYN-ACK; the ACK starts the flow again (the
        // backend resets the tuple it does not know) instead of leaving through the dead port.
        let answer = |to: (IpAddr, u16)| {
            packet::tcp(&f.addr(BACKEND), 8080, &to.0.to_string(), to.1)
                .data(b"")
                .build()
        };
        let syn = ingress(&mut s, &tcp(f, CLIENT, 41100, NODE_IP, 30080).build());
        let out = summary(&egress(&mut s, &syn.packet).packet);
        let syn_ack = ingress(&mut s, &answer((out.src, out.sport)));
        assert_eq!(summary(&syn_ack.packet).dst, f.ip(CLIENT));
        evict_unsnat();
        let new_flows = counter(&s, Counter::TcNewFlow);
        let ack = ingress(
            &mut s,
            &tcp(f, CLIENT, 41100, NODE_IP, 30080).data(b"GET /").build(),
        );
        assert_eq!(summary(&ack.packet).dst, f.ip(BACKEND));
        assert_eq!(restarted(&s), 2, "{f:?}");
        assert_eq!(
            counter(&s, Counter::TcNewFlow),
            new_flows + 1,
            "{f:?}: a new flow"
        );
        let out = summary(&egress(&mut s, &ack.packet).packet);
        let reply = ingress(&mut s, &answer((out.src, out.sport)));
        assert_eq!(
            summary(&reply.packet).dst,
            f.ip(CLIENT),
            "{f:?}: the new tuple's replies return"
        );
    }
}

/// A flow's un-SNAT entry (backend -> masquerade address:port, at ingress).
fn is_unsnat<F: lb_common::family::Family>(key: &CtKey<F>, value: &CtValue<F>) -> bool {
    key.dir == lb_common::conntrack::dir::INGRESS && value.flags & lb_common::conntrack::flags::REPLY != 0
}

/// Deletes the entries of a conntrack table that `doomed` picks, as LRU eviction would; how many.
fn remove_entries_where<F: lb_common::family::Family>(
    table: &mut aya::maps::HashMap<aya::maps::MapData, CtKey<F>, CtValue<F>>,
    doomed: impl Fn(&CtKey<F>, &CtValue<F>) -> bool,
) -> usize
where
    CtKey<F>: aya::Pod,
    CtValue<F>: aya::Pod,
{
    let keys: Vec<CtKey<F>> = table
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, v)| doomed(k, v))
        .map(|(k, _)| k)
        .collect();
    keys.iter().for_each(|k| table.remove(k).unwrap());
    keys.len()
}

/// A frontend whose write failed (its map full) holds no prefilter bit: the writer never deletes
/// what it did not write, so a bit held for it would never be released.
#[test]
fn a_batch_that_stops_early_holds_no_prefilter_bit_for_what_it_never_wrote() {
    use lb_agent::apply::{MapOps, ServiceMapKey, ServiceMapValue, prefilter::Owner};
    use lb_common::catalog::Capacities;
    require_root();
    let caps = Capacities {
        services: 2,
        ..Capacities::default()
    };
    let mut dp = lb_agent::datapath::Datapath::load_unpinned(&caps, OBJECT).expect("load");
    let mut maps = dp.take_maps().expect("maps");
    let key = |last: u8| {
        ServiceMapKey::new(
            IpAddr::V4(Ipv4Addr::new(10, 96, 0, last)),
            80,
            lb_common::proto::TCP,
            0,
            0,
        )
    };
    let entries: Vec<(ServiceMapKey, ServiceMapValue)> =
        (1..=3).map(|i| (key(i), ServiceMapValue::default())).collect();
    let err = maps
        .put_services(&entries)
        .expect_err("three frontends in a map of two");
    assert_eq!(err.done, 2, "{err:?}");
    // A frontend holds two bits: its address's and its (address, port)'s.
    let holds = |last: u8| {
        let owners: Vec<Owner> = Owner::frontend(&key(last)).map(|(o, _, _)| o).collect();
        assert_eq!(owners.len(), 2, "slot 0");
        owners.iter().map(|o| maps.prefilter.holds(o)).collect::<Vec<_>>()
    };
    assert_eq!(holds(1), [true, true], "written frontends hold their bits");
    assert_eq!(holds(2), [true, true], "written frontends hold their bits");
    assert_eq!(
        holds(3),
        [false, false],
        "the frontend that was never written holds nothing"
    );
}

/// The kernel maps write runs of service and backend entries with BPF_MAP_UPDATE_BATCH, one run
/// per family; a run that does not fit stops exactly where the kernel refused, counted from the
/// start of the whole batch, so the writer's mirror stays true. What is written reads back as it
/// was, a slot's copy of its backend included.
#[test]
fn batched_map_writes_report_exactly_what_was_written() {
    use lb_agent::apply::{BackendEntry, MapOps, ServiceMapKey, ServiceMapValue};
    use lb_common::{catalog::Capacities, service::SvcValue};
    use std::net::Ipv6Addr;
    require_root();
    let caps = Capacities {
        services: 4,
        backends: 64,
        ..Capacities::default()
    };
    let mut dp = lb_agent::datapath::Datapath::load_unpinned(&caps, OBJECT).expect("load");
    let mut maps = dp.take_maps().expect("maps");

    // 40 IPv4 backends and 20 IPv6 ones, interleaved in runs of each family.
    let backends: Vec<(u32, BackendEntry)> = (1..=60u32)
        .map(|id| {
            let addr = if id % 20 < 10 {
                IpAddr::V4(Ipv4Addr::new(10, 244, 0, id as u8))
            } else {
                IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, id as u16))
            };
            let value = BackendEntry {
                addr,
                port: 8080,
                proto: lb_common::proto::TCP,
                flags: 0,
            };
            (id, value)
        })
        .collect();
    maps.put_backends(&backends).expect("60 backends fit");
    let snap = maps.snapshot().expect("snapshot");
    assert_eq!(snap.backends.len(), 60);
    assert!(backends.iter().all(|(id, v)| snap.backends.get(id) == Some(v)));

    // Two IPv6 entries (they fit), then six IPv4 ones in a map of four.
    let key = |addr: IpAddr, slot: u16| ServiceMapKey::new(addr, 80, lb_common::proto::TCP, 0, slot);
    let v4: IpAddr = Ipv4Addr::new(10, 96, 0, 10).into();
    let v6: IpAddr = "fd00:10:96::10".parse().unwrap();
    // Slot 0 a frontend entry, each other slot backend 1 of its family (ids 1 and 10).
    let value = |addr: IpAddr, slot: u16| {
        if slot == 0 {
            return ServiceMapValue::frontend(SvcValue::frontend(7, 5, 0, 0));
        }
        let id = if addr.is_ipv4() { 1 } else { 10 };
        ServiceMapValue::slot(7, id, backends[id as usize - 1].1)
    };
    let services: Vec<(ServiceMapKey, ServiceMapValue)> = (0..2u16)
        .map(|slot| (key(v6, slot), value(v6, slot)))
        .chain((0..6u16).map(|slot| (key(v4, slot), value(v4, slot))))
        .collect();
    let err = maps.put_services(&services).expect_err("6 entries in a map of 4");
    assert_eq!(err.done, 2 + 4, "{err:?}");
    assert!(err.error.is_full(), "{err:?}");
    assert!(err.error.to_string().contains("lb4_services"), "{err:?}");
    let snap = maps.snapshot().expect("snapshot");
    let written: Vec<(bool, u16)> = snap.services.keys().map(|k| (k.addr.is_ipv4(), k.slot)).collect();
    assert_eq!(
        written,
        vec![(true, 0), (true, 1), (true, 2), (true, 3), (false, 0), (false, 1)]
    );
    for (key, value) in &snap.services {
        assert_eq!(
            *value,
            services.iter().find(|(k, _)| k == key).unwrap().1,
            "{key:?}"
        );
    }
}

/// A conntrack GC pass, then the prefilter's rebuild from the bits its entries need (as the agent's
/// GC thread does).
fn gc_and_rebuild_prefilter(
    ct: &mut lb_agent::datapath::conntrack::ConntrackMaps,
    prefilter: &lb_agent::apply::prefilter::Prefilter,
) {
    let mut referenced = lb_agent::apply::prefilter::Referenced::default();
    ct.collect_noting(
        lb_agent::time::monotonic_coarse_ns(),
        &lb_agent::datapath::conntrack::GcTimeouts::default(),
        &mut referenced,
        &mut Default::default(),
    )
    .expect("gc");
    prefilter.rebuild(&referenced).unwrap();
}

/// The prefilter (`lb_common::prefilter`): the programs skip a packet whose bit is clear, so the
/// bits must outlive the Services whose flows still run. A deleted Service's established flow
/// keeps its translation while a conntrack entry names its frontend; a rebuild that ignored
/// conntrack would break it (shown here on purpose, then repaired by a real GC pass); once the
/// flow is gone, the next pass after the grace clears the bit.
#[test]
fn the_prefilter_keeps_the_bits_of_a_deleted_services_live_flows() {
    use lb_agent::{
        apply::prefilter::{RELEASE_GRACE, Referenced, ingress_bit},
        datapath::conntrack,
    };

    for f in FAMILIES {
        let mut s = scratch(true);
        let flags = s.maps().datapath_config().expect("config").flags;
        assert_ne!(
            flags & lb_common::config::flags::PREFILTER,
            0,
            "the scratch maps filter"
        );
        let prefilter = s.maps().prefilter.clone();
        let mut ct = s.datapath.take_conntrack().expect("conntrack maps");
        let frontend = f.ip("10.96.0.10");
        let (family, bit) = ingress_bit(&frontend);
        let data = || {
            tcp(f, "10.244.2.20", 40010, "10.96.0.10", 80)
                .data(b"GET / HTTP/1.1\r\n\r\n")
                .build()
        };
        let translated =
            |s: &mut ScratchDatapath| summary(&ingress(s, &data()).packet).dst == f.ip("10.244.1.5");
        let syn = tcp(f, "10.244.2.20", 40010, "10.96.0.10", 80).build();
        assert_eq!(summary(&ingress(&mut s, &syn).packet).dst, f.ip("10.244.1.5"));
        assert!(prefilter.is_set(family, bit));

        // The Service goes; its bit stays set (released, not cleared) and the flow runs on.
        let mut without = state();
        without.services.remove(&("t".to_string(), "web".to_string()));
        s.program(&without).unwrap();
        assert!(translated(&mut s), "{f:?}: released, the bit stays set");

        // A rebuild after the grace that saw no conntrack entry clears it: the programs then pass
        // the flow's packets untouched, which is why rebuilds only follow a GC pass.
        std::thread::sleep(RELEASE_GRACE);
        prefilter
            .rebuild(&Referenced {
                began: Some(std::time::Instant::now()),
                ..Default::default()
            })
            .unwrap();
        assert!(!prefilter.is_set(family, bit));
        let skipped = ingress(&mut s, &data());
        assert_eq!(skipped.action, OK);
        assert_bytes(
            &skipped.packet,
            &data(),
            format!("{f:?}: bit clear, packet untouched"),
        );

        // A GC pass names the flow's frontend: the rebuild sets the bit again.
        let gc_and_rebuild = |ct: &mut conntrack::ConntrackMaps| gc_and_rebuild_prefilter(ct, &prefilter);
        gc_and_rebuild(&mut ct);
        assert!(prefilter.is_set(family, bit));
        assert!(translated(&mut s), "{f:?}: the live flow is translated again");

        // The flow's entries go (as the GC does for an ended flow): the next pass clears the bit.
        let removed = match family {
            lb_agent::family::IpFamily::V4 => {
                let keys: Vec<_> = ct.v4.keys().filter_map(Result::ok).collect();
                keys.iter().for_each(|k| ct.v4.remove(k).unwrap());
                keys.len()
            }
            lb_agent::family::IpFamily::V6 => {
                let keys: Vec<_> = ct.v6.keys().filter_map(Result::ok).collect();
                keys.iter().for_each(|k| ct.v6.remove(k).unwrap());
                keys.len()
            }
        };
        assert!(removed > 0, "{f:?}: the flow had entries");
        gc_and_rebuild(&mut ct);
        assert!(!prefilter.is_set(family, bit), "{f:?}: nothing needs the bit");
        // The Service's other tuples were never needed by the flow; a frontend still present is.
        let (family, np_bit) = ingress_bit(&f.ip("10.96.0.11"));
        assert!(prefilter.is_set(family, np_bit));
    }
}

/// The prefilter's port bits (`lb_common::prefilter::ingress_port_bit`): a packet to a frontend
/// or masquerade address (here the node IP, both) takes the full path only on a frontend's port or
/// a masquerade port, so the node's own traffic to its address passes after the filter. Shown by
/// flows whose entries name ports no frontend has (a deleted NodePort's live flow, an un-SNAT
/// entry of a port outside today's masquerade range): the programs skip them while their port
/// bits are clear, and a GC pass that names them sets the bits, as at every start before the
/// programs are attached. A NodePort flow (its port's bit) and its masqueraded reply (a masquerade
/// port) are translated as ever.
#[test]
fn the_prefilter_passes_the_node_ips_other_ports_and_keeps_its_flows_ports() {
    use lb_agent::{
        apply::prefilter::{ingress_bit, ingress_port_bit},
        datapath::conntrack,
    };
    use lb_common::conntrack::{CtKey, CtValue, dir, flags as ct};

    let mut s = scratch(true);
    let prefilter = s.maps().prefilter.clone();
    let mut ct_maps = s.datapath.take_conntrack().expect("conntrack maps");
    let gc_and_rebuild =
        |ct_maps: &mut conntrack::ConntrackMaps| gc_and_rebuild_prefilter(ct_maps, &prefilter);
    // An entry keyed `key` (ingress) rewriting the destination to `to`, as the programs write
    // them (the flags say which kind).
    let insert = |ct_maps: &mut conntrack::ConntrackMaps,
                  (src, sport): (IpAddr, u16),
                  (dst, dport): (IpAddr, u16),
                  (to, to_port): (IpAddr, u16),
                  flags: u16| {
        let now = lb_agent::time::monotonic_coarse_ns();
        match (src, dst, to) {
            (IpAddr::V4(a), IpAddr::V4(b), IpAddr::V4(c)) => {
                let key = CtKey::<lb_common::family::V4> {
                    saddr: a.octets(),
                    daddr: b.octets(),
                    sport,
                    dport,
                    proto: lb_common::proto::TCP,
                    dir: dir::INGRESS,
                    tag: 0,
                };
                let value = CtValue::<lb_common::family::V4> {
                    created_ns: now,
                    last_seen_ns: now,
                    nat_addr: c.octets(),
                    nat_port: to_port,
                    flags,
                    ..Default::default()
                };
                ct_maps.v4.insert(&key, &value, 0).expect("insert");
            }
            (IpAddr::V6(a), IpAddr::V6(b), IpAddr::V6(c)) => {
                let key = CtKey::<lb_common::family::V6> {
                    saddr: a.into(),
                    daddr: b.into(),
                    sport,
                    dport,
                    proto: lb_common::proto::TCP,
                    dir: dir::INGRESS,
                    tag: 0,
                };
                let value = CtValue::<lb_common::family::V6> {
                    created_ns: now,
                    last_seen_ns: now,
                    nat_addr: c.into(),
                    nat_port: to_port,
                    flags,
                    ..Default::default()
                };
                ct_maps.v6.insert(&key, &value, 0).expect("insert");
            }
            _ => unreachable!(),
        }
    };
    for f in FAMILIES {
        let node = f.ip(NODE_IP);
        let (family, address) = ingress_bit(&node);
        assert!(
            prefilter.is_set(family, address),
            "{f:?}: the node IP's bit (NodePorts, masquerade)"
        );
        assert!(
            prefilter.is_set(family, ingress_port_bit(&node, 30080).1),
            "{f:?}: a NodePort's port"
        );

        // A NodePort flow and its masqueraded reply: translated as ever.
        let syn = tcp(f, CLIENT, 41100, NODE_IP, 30080).build();
        let dnat = ingress(&mut s, &syn);
        assert_eq!(
            summary(&dnat.packet).dst,
            f.ip("10.244.2.7"),
            "{f:?} NodePort DNAT"
        );
        let port = summary(&egress(&mut s, &dnat.packet).packet).sport;
        let reply = tcp(f, "10.244.2.7", 8080, NODE_IP, port).data(b"pong").build();
        assert_eq!(
            summary(&ingress(&mut s, &reply).packet).dst,
            f.ip(CLIENT),
            "{f:?} un-SNAT"
        );

        // A live flow to the node IP on a port no frontend has (a deleted NodePort's, 31999):
        // skipped while the port's bit is clear, translated once a GC pass names it.
        let (flow_port, unsnat_port) = (31_999, 10_251);
        assert!(!prefilter.is_set(family, ingress_port_bit(&node, flow_port).1));
        assert!(!prefilter.is_set(family, ingress_port_bit(&node, unsnat_port).1));
        insert(
            &mut ct_maps,
            (f.ip(CLIENT), 41101),
            (node, flow_port),
            (f.ip("10.244.2.7"), 8080),
            0,
        );
        // An un-SNAT entry of a port outside the masquerade ports (made by a release whose range
        // differed): the reply to it is the client's.
        insert(
            &mut ct_maps,
            (f.ip("10.244.2.7"), 8080),
            (node, unsnat_port),
            (f.ip(CLIENT), 41102),
            ct::REPLY | ct::SNAT,
        );
        let to_flow = tcp(f, CLIENT, 41101, NODE_IP, flow_port).data(b"GET").build();
        let to_unsnat = tcp(f, "10.244.2.7", 8080, NODE_IP, unsnat_port)
            .data(b"ok")
            .build();
        for pkt in [&to_flow, &to_unsnat] {
            let run = ingress(&mut s, pkt);
            assert_eq!(run.action, OK);
            assert_bytes(
                &run.packet,
                pkt,
                format!("{f:?}: the port's bit is clear: skipped"),
            );
        }
        gc_and_rebuild(&mut ct_maps);
        assert!(prefilter.is_set(family, ingress_port_bit(&node, flow_port).1));
        assert!(prefilter.is_set(family, ingress_port_bit(&node, unsnat_port).1));
        assert_eq!(
            summary(&ingress(&mut s, &to_flow).packet).dst,
            f.ip("10.244.2.7"),
            "{f:?}: the live flow, its port named by its entry"
        );
        assert_eq!(
            summary(&ingress(&mut s, &to_unsnat).packet).dst,
            f.ip(CLIENT),
            "{f:?}: the un-SNAT entry outside the masquerade ports"
        );
    }
}

/// The egress flow filter (`lb_common::ct_filter`): with it on, egress looks a packet up only if
/// its tuple's byte is set. A new flow sets the bytes of its egress entries itself (an un-DNAT
/// entry for a pod's flow, an SNAT entry for a masqueraded NodePort flow), so their packets are
/// translated as before; a packet on a tuple no entry has (a connection the socket programs
/// translated) passes untouched; a live flow whose byte were cleared would pass untranslated, which
/// is why only the agent's GC rebuild clears bytes, from the entries it scanned: after two rebuilds
/// (both generations rewritten) the live flows keep their bytes and an ended flow's are gone.
#[test]
fn the_egress_flow_filter_holds_every_tracked_tuple_and_only_those() {
    use lb_agent::datapath::{conntrack, ct_filter::Tracked};
    use lb_common::ct_filter::bucket;

    let mut s = scratch(true);
    let mut ct = s.datapath.take_conntrack().expect("conntrack maps");
    let filters = ct.filters.take().expect("the flow filter maps are memory-mapped");
    let timeouts = conntrack::GcTimeouts::default();
    let gc = |ct: &mut conntrack::ConntrackMaps| {
        let mut tracked = Tracked::default();
        ct.collect_noting(
            lb_agent::time::monotonic_coarse_ns(),
            &timeouts,
            &mut Default::default(),
            &mut tracked,
        )
        .expect("gc");
        filters.rebuild(&tracked).expect("flow filters rebuilt")
    };
    // On from the start in fresh maps (as the scratch data path of every fixture has it); a
    // rebuild switches the programs to the other generation.
    assert_eq!(filters.v4.control().unwrap(), (true, 0));
    gc(&mut ct);
    assert_eq!(filters.v4.control().unwrap(), (true, 1));
    assert_eq!(filters.v6.control().unwrap(), (true, 1));
    let held = |f: Family, src: (&str, u16), dst: (&str, u16)| {
        let proto = lb_common::proto::TCP;
        match (f.ip(src.0), f.ip(dst.0)) {
            (IpAddr::V4(a), IpAddr::V4(b)) => filters.v4.holds(bucket::<lb_common::family::V4>(
                &a.octets(),
                &b.octets(),
                src.1,
                dst.1,
                proto,
            )),
            (IpAddr::V6(a), IpAddr::V6(b)) => filters.v6.holds(bucket::<lb_common::family::V6>(
                &a.into(),
                &b.into(),
                src.1,
                dst.1,
                proto,
            )),
            _ => unreachable!(),
        }
        .expect("flow filter mapped")
    };
    for f in FAMILIES {
        // A pod's flow to a ClusterIP: its reply's tuple (backend -> client) is held, and the
        // reply gets the frontend back.
        let syn = tcp(f, "10.244.2.20", 40020, "10.96.0.10", 80).build();
        assert_eq!(summary(&ingress(&mut s, &syn).packet).dst, f.ip("10.244.1.5"));
        assert!(held(f, ("10.244.1.5", 8080), ("10.244.2.20", 40020)), "{f:?}");
        let reply = tcp(f, "10.244.1.5", 8080, "10.244.2.20", 40020)
            .data(b"ok")
            .build();
        assert_bytes(
            &egress(&mut s, &reply).packet,
            &nat(f, &reply, Some(("10.96.0.10", 80)), None),
            format!("{f:?} reverse NAT through the filter"),
        );
        // A masqueraded NodePort flow: its SNAT tuple (client -> backend) is held and SNATed.
        let np = tcp(f, CLIENT, 41020, NODE_IP, 30080).build();
        let dnat = ingress(&mut s, &np).packet;
        assert!(held(f, (CLIENT, 41020), ("10.244.2.7", 8080)), "{f:?}");
        let snat = egress(&mut s, &dnat);
        assert_eq!(
            summary(&snat.packet).src,
            f.ip(NODE_IP),
            "{f:?} SNAT through the filter"
        );
        // The socket path's connection (client -> backend, never seen by tc ingress) and its
        // reply: no byte, untouched (and no conntrack lookup).
        let direct = tcp(f, "10.244.2.21", 40021, "10.244.1.5", 8080).build();
        let back = tcp(f, "10.244.1.5", 8080, "10.244.2.21", 40021).build();
        assert!(!held(f, ("10.244.1.5", 8080), ("10.244.2.21", 40021)));
        assert_bytes(
            &egress(&mut s, &direct).packet,
            &direct,
            format!("{f:?} socket path out"),
        );
        assert_bytes(
            &egress(&mut s, &back).packet,
            &back,
            format!("{f:?} socket path reply"),
        );
    }

    // Two rebuilds: both generations rewritten from scans that found the flows.
    gc(&mut ct);
    let [r4, r6] = gc(&mut ct);
    assert!(r4.held >= 2 && r6.held >= 2, "{r4:?} {r6:?}");
    let pod_reply = |f| {
        tcp(f, "10.244.1.5", 8080, "10.244.2.20", 40020)
            .data(b"ok")
            .build()
    };
    let pod_flow_held = |f| held(f, ("10.244.1.5", 8080), ("10.244.2.20", 40020));
    let node_port_flow_held = |f| held(f, (CLIENT, 41020), ("10.244.2.7", 8080));
    for f in FAMILIES {
        assert!(
            pod_flow_held(f) && node_port_flow_held(f),
            "{f:?} live flows kept"
        );
        assert_bytes(
            &egress(&mut s, &pod_reply(f)).packet,
            &nat(f, &pod_reply(f), Some(("10.96.0.10", 80)), None),
            format!("{f:?} reverse NAT after rebuilds"),
        );
    }

    // The pod flow's entries go (as the GC does for an ended flow): after two rebuilds its byte
    // is gone, and its reply would now pass untouched: the filter is consulted, not decorative.
    let removed = remove_entries_where(&mut ct.new_v4, |k, _| k.sport == 40020 || k.dport == 40020)
        + remove_entries_where(&mut ct.new_v6, |k, _| k.sport == 40020 || k.dport == 40020);
    assert!(
        removed >= 4,
        "the pod flows' entries (in handshake: the new-flow table)"
    );
    gc(&mut ct);
    gc(&mut ct);
    for f in FAMILIES {
        assert!(!pod_flow_held(f), "{f:?} ended flow cleared");
        assert!(node_port_flow_held(f), "{f:?} the other flow kept");
        assert_bytes(
            &egress(&mut s, &pod_reply(f)).packet,
            &pod_reply(f),
            format!("{f:?} no byte: untouched"),
        );
    }
}

// SCTP (issue 17): the same path as TCP and UDP; a port rewrite keeps the CRC32c checksum valid,
// checked against a full recomputation by the `crc` crate (`packet::verify_checksums`).

fn sctp(f: Family, src: &str, sport: u16, dst: &str, dport: u16) -> Spec {
    packet::sctp(&f.addr(src), sport, &f.addr(dst), dport)
}

/// The fixtures' Services plus three SCTP ones: Diameter-like (3868 to target port 13868, so the
/// checksum must follow; a NodePort too), M3UA-like (2905 to 2905: only addresses change, and
/// the checksum with them not at all), and one without endpoints.
fn sctp_state() -> ClusterState {
    let mut s = state();
    add(
        &mut s,
        service("t", "diameter")
            .cluster_ip("10.96.0.50")
            .port("diameter", "SCTP", 3868, 13868)
            .node_port(30868),
        Some(
            slice("t", "diameter", "diameter-1")
                .endpoint("10.244.2.7", "node-b", State::Ready)
                .port("diameter", "SCTP", 13868),
        ),
    );
    add(
        &mut s,
        service("t", "m3ua")
            .cluster_ip("10.96.0.51")
            .port("m3ua", "SCTP", 2905, 2905),
        Some(
            slice("t", "m3ua", "m3ua-1")
                .endpoint("10.244.1.5", "node-a", State::Ready)
                .port("m3ua", "SCTP", 2905),
        ),
    );
    add(
        &mut s,
        service("t", "sctp-empty")
            .cluster_ip("10.96.0.52")
            .port("s", "SCTP", 9, 9),
        None,
    );
    s
}

fn sctp_checksum_field(pkt: &[u8]) -> [u8; 4] {
    let l4 = packet::layout(pkt).unwrap().l4;
    pkt[l4 + 8..l4 + 12].try_into().unwrap()
}

#[test]
fn sctp_to_a_cluster_ip_is_translated_with_a_valid_crc32c_both_ways() {
    let mut s = scratch_with(&sctp_state(), true);
    for f in FAMILIES {
        let unsupported = counter(&s, Counter::TcUnsupportedProtocol);
        // A pod's association to the cluster IP: INIT, then DATA, each DNATed to the backend's
        // target port with the checksum updated.
        let init = sctp(f, "10.244.2.20", 40000, "10.96.0.50", 3868).build();
        let out = ingress(&mut s, &init);
        assert_eq!(out.action, OK);
        assert_bytes(
            &out.packet,
            &nat(f, &init, None, Some(("10.244.2.7", 13868))),
            format!("{f:?} SCTP INIT DNAT"),
        );
        for payload in [&b"CER"[..], &[0x5a; 1200][..]] {
            let data = sctp(f, "10.244.2.20", 40000, "10.96.0.50", 3868)
                .data(payload)
                .build();
            assert_bytes(
                &ingress(&mut s, &data).packet,
                &nat(f, &data, None, Some(("10.244.2.7", 13868))),
                format!("{f:?} SCTP DATA DNAT, {} bytes", payload.len()),
            );
        }
        // The backend's answers leave as the cluster IP and port.
        let reply = sctp(f, "10.244.2.7", 13868, "10.244.2.20", 40000)
            .data(b"CEA")
            .build();
        assert_bytes(
            &egress(&mut s, &reply).packet,
            &nat(f, &reply, Some(("10.96.0.50", 3868)), None),
            format!("{f:?} SCTP reverse NAT"),
        );
        // Trailing bytes past the IP length (Ethernet padding of a short frame) are outside the
        // checksum: the update uses the IP header's length, not the frame's.
        let mut padded = sctp(f, "10.244.2.20", 40000, "10.96.0.50", 3868)
            .data(b"x")
            .build();
        padded.extend_from_slice(&[0xee; 10]);
        assert_bytes(
            &ingress(&mut s, &padded).packet,
            &nat(f, &padded, None, Some(("10.244.2.7", 13868))),
            format!("{f:?} SCTP DATA with Ethernet padding"),
        );
        // A checksum the device is to compute (zero: CHECKSUM_PARTIAL from a local SCTP socket
        // over a veth) stays zero; the ports change, and the device computes over them.
        let mut offloaded = sctp(f, "10.244.2.20", 40000, "10.96.0.50", 3868)
            .data(b"CER")
            .build();
        let l4 = packet::layout(&offloaded).unwrap().l4;
        offloaded[l4 + 8..l4 + 12].fill(0);
        let out = ingress(&mut s, &offloaded);
        assert_eq!(sctp_checksum_field(&out.packet), [0; 4], "{f:?}: zero stays zero");
        assert_bytes(
            &out.packet,
            &nat(f, &offloaded, None, Some(("10.244.2.7", 13868))),
            format!("{f:?} SCTP DNAT of an offloaded checksum"),
        );
        // Same port: only the addresses change, which SCTP's checksum does not cover.
        let init = sctp(f, "10.244.2.20", 40001, "10.96.0.51", 2905).build();
        let out = ingress(&mut s, &init);
        assert_eq!(sctp_checksum_field(&out.packet), sctp_checksum_field(&init));
        assert_bytes(
            &out.packet,
            &nat(f, &init, None, Some(("10.244.1.5", 2905))),
            format!("{f:?} SCTP DNAT, same port"),
        );
        assert_eq!(
            counter(&s, Counter::TcUnsupportedProtocol),
            unsupported,
            "{f:?}: SCTP is served, not passed"
        );
    }
}

#[test]
fn sctp_nodeport_from_outside_is_translated_and_masqueraded_both_ways() {
    let mut s = scratch_with(&sctp_state(), true);
    for f in FAMILIES {
        let init = sctp(f, CLIENT, 41000, NODE_IP, 30868).build();
        let dnat = ingress(&mut s, &init);
        assert_bytes(
            &dnat.packet,
            &nat(f, &init, None, Some(("10.244.2.7", 13868))),
            format!("{f:?} SCTP NodePort DNAT"),
        );
        // Towards node b: masqueraded to this node, the source port (and the checksum) with it.
        let snat = egress(&mut s, &dnat.packet);
        let port = summary(&snat.packet).sport;
        assert!((20_000..=29_999).contains(&port), "masquerade port {port}");
        assert_bytes(
            &snat.packet,
            &nat(f, &dnat.packet, Some((NODE_IP, port)), None),
            format!("{f:?} SCTP SNAT"),
        );
        // The INIT ACK comes back to the masquerade address and port ...
        let reply = sctp(f, "10.244.2.7", 13868, NODE_IP, port)
            .data(b"init-ack")
            .build();
        let unsnat = ingress(&mut s, &reply);
        assert_bytes(
            &unsnat.packet,
            &nat(f, &reply, None, Some((CLIENT, 41000))),
            format!("{f:?} SCTP un-SNAT"),
        );
        // ... and leaves as the NodePort the client called.
        let out = egress_marked(&mut s, &unsnat.packet, unsnat.mark);
        assert_bytes(
            &out.packet,
            &nat(f, &unsnat.packet, Some((NODE_IP, 30868)), None),
            format!("{f:?} SCTP reverse NAT to the NodePort"),
        );
        // The client's next packets follow the association's entries.
        let data = sctp(f, CLIENT, 41000, NODE_IP, 30868).data(b"CER").build();
        let dnat = ingress(&mut s, &data).packet;
        let snat = egress(&mut s, &dnat).packet;
        assert_bytes(
            &snat,
            &nat(f, &data, Some((NODE_IP, port)), Some(("10.244.2.7", 13868))),
            format!("{f:?} SCTP DATA of the association"),
        );
    }
}

#[test]
fn sctp_to_a_service_without_endpoints_is_rejected_with_icmp_port_unreachable() {
    let mut s = scratch_with(&sctp_state(), true);
    for f in FAMILIES {
        let init = sctp(f, CLIENT, 42300, "10.96.0.52", 9).build();
        let out = ingress(&mut s, &init);
        assert_eq!(out.action, REDIRECT, "{f:?}: REJECT, as kube-proxy's");
        assert_same(
            &out.packet,
            &expected_port_unreachable(&init),
            format!("{f:?} SCTP port unreachable"),
        );
    }
}

#[test]
fn icmp_errors_about_sctp_flows_are_translated() {
    let mut s = scratch_with(&sctp_state(), true);
    for f in FAMILIES {
        // Path MTU discovery of a masqueraded NodePort association's answers.
        too_big_about_a_masqueraded_answer(&mut s, f, sctp, (47100, 30868, 13868));
    }
}

/// SCTP's checksum covers the whole packet, so the first fragment of a fragmented one cannot
/// have its port rewritten (the length the update needs is the reassembled one): its fragments
/// pass untranslated and are counted, as fragments whose first one was not seen.
#[test]
fn sctp_fragments_pass_untranslated_and_are_counted() {
    let mut s = scratch_with(&sctp_state(), true);
    for f in FAMILIES {
        let before = counter(&s, Counter::TcFragment);
        let mut first = sctp(f, "10.244.2.20", 40100, "10.96.0.50", 3868).data(&[1; 64]);
        first.more_fragments = true;
        let first = first.build();
        let out = ingress(&mut s, &first);
        assert_eq!((out.action, &out.packet), (OK, &first), "{f:?}: untouched");
        assert_eq!(counter(&s, Counter::TcFragment), before + 1, "{f:?}: counted");
    }
}

/// A node whose kernel refused the SCTP program (`Datapath::refuse_sctp`, what the load does
/// then): the tail call's slot is empty, so SCTP to a frontend passes untranslated, counted, in
/// both families, while TCP to a frontend is still translated.
/// The node's own SCTP to a frontend (no socket hook runs for SCTP): `lb_tc_egress` sends it to
/// `lb_tc_sctp_out` (a tail call a test run cannot reach: on loopback every packet is taken for a
/// forwarded one, so the program is run directly), which DNATs it without masquerade (its source
/// is a node address), marks the flow's un-DNAT entry `LOCAL_CLIENT` and redirects it to its
/// backend's route. In a namespace of its own (the route lookup is the calling thread's
/// namespace's): node b's pods are routed by d0. The backend's reply gets the frontend back at
/// ingress (`lb_tc_sctp_in`), as no egress runs for a locally delivered packet; the
/// association's next packet follows its entry, and an ICMP error about it (Packet Too Big)
/// quotes the frontend the socket called. A NodePort of the node's own address takes the
/// cluster-wide scope as a socket call does. A backend without a route (node a's m3ua pod here)
/// is dropped and counted; a frontend without endpoints is dropped (SCTP takes an ICMP error
/// only as a soft one). Nothing is counted as unsupported.
#[test]
fn the_nodes_own_sctp_is_translated_at_egress_and_routed_to_its_backend() {
    const SCTP_OUT: &str = "lb_tc_sctp_out";
    let mut s = scratch_with(&sctp_state(), true);
    let ns = lb_tests::netns::NetNs::new("lbsctpo");
    ns.sysctl("net.ipv4.ip_forward=1");
    ns.sysctl("net.ipv6.conf.all.forwarding=1");
    let peer = lb_tests::netns::NetNs::new("lbsctpop");
    lb_tests::netns::veth(&ns, "d0", None, &peer, "d0p", None);
    for f in FAMILIES {
        let six: &[&str] = if f == Family::V6 { &["-6"] } else { &[] };
        let net = f.net("192.168.50.11/24");
        let mut add: Vec<&str> = vec!["addr", "add", &net, "dev", "d0"];
        if f == Family::V6 {
            add.push("nodad");
        }
        ns.ip(&[six, &add[..]].concat());
        let (to, via) = (f.net("10.244.2.0/24"), f.addr("192.168.50.1"));
        ns.ip(&[six, &["route", "add", &to, "via", &via]].concat());
    }
    ns.run(|| {
        for f in FAMILIES {
            let (unsupported, unrouted) = (
                counter(&s, Counter::TcUnsupportedProtocol),
                counter(&s, Counter::TcLocalSctpUnrouted),
            );
            listen(&mut s, lb_common::monitor::types::ALL, 60_000_000_000);
            let mut out = |pkt: &[u8]| s.datapath.test_run_tc(SCTP_OUT, pkt, 1).expect("test run");
            // Each to node b's pod: DNATed with the source kept, and redirected to its route.
            let mut redirected = |pkt: Vec<u8>, what: &str| {
                let run = out(&pkt);
                assert_eq!(run.action, REDIRECT, "{f:?} {what}: to the backend's route");
                assert_bytes(
                    &run.packet,
                    &nat(f, &pkt, None, Some(("10.244.2.7", 13868))),
                    format!("{f:?} {what}: DNAT, the source kept"),
                );
                run.packet
            };
            redirected(
                sctp(f, NODE_IP, 45000, "10.96.0.50", 3868).build(),
                "the node's INIT",
            );
            let data = sctp(f, NODE_IP, 45000, "10.96.0.50", 3868).data(b"CER").build();
            let sent = redirected(data, "the association's DATA");
            redirected(
                sctp(f, NODE_IP, 45001, NODE_IP, 30868).build(),
                "its own NodePort",
            );
            let unroutable = sctp(f, NODE_IP, 45002, "10.96.0.51", 2905).build();
            assert_eq!(out(&unroutable).action, SHOT, "{f:?}: no route to 10.244.1.5");
            let empty = sctp(f, NODE_IP, 45003, "10.96.0.52", 9).build();
            assert_eq!(out(&empty).action, SHOT, "{f:?}: no endpoints");
            // Not a frontend: as it was.
            let other = sctp(f, NODE_IP, 45004, "10.244.2.7", 13868).build();
            let run = out(&other);
            assert_eq!((run.action, &run.packet), (OK, &other), "{f:?}");
            assert_eq!(
                counter(&s, Counter::TcLocalSctpUnrouted),
                unrouted + 1,
                "{f:?}: the unroutable backend is counted"
            );
            // A monitor sees each new flow where it was translated: at egress, on the interface
            // the packet was leaving by (PROG_TEST_RUN's: the namespace's loopback).
            let seen = events(&mut s);
            assert_eq!(
                seen.iter()
                    .map(|e| (Counter::ALL.get(e.counter as usize).copied(), e.dst_port))
                    .collect::<Vec<_>>(),
                [
                    (Some(Counter::TcNewFlow), 3868),
                    (Some(Counter::TcNewFlow), 30868),
                    (Some(Counter::TcNewFlow), 2905),
                    (Some(Counter::TcLocalSctpUnrouted), 2905),
                    (Some(Counter::TcRejected), 9),
                ],
                "{f:?}: one event per new flow, and the unroutable one's drop"
            );
            for e in &seen {
                assert_eq!(
                    (e.hook, e.ifindex, e.protocol, e.cgroup_id),
                    (lb_common::monitor::hook::TC_EGRESS, 1, lb_common::proto::SCTP, 0),
                    "{f:?}"
                );
                assert_eq!(event_ip(f, &e.src), f.ip(NODE_IP), "{f:?}");
            }
            assert_eq!(
                (
                    event_ip(f, &seen[0].backend),
                    seen[0].backend_port,
                    seen[0].nat_port
                ),
                (f.ip("10.244.2.7"), 13868, 0),
                "{f:?}: the backend, no masquerade"
            );
            listen(&mut s, lb_common::monitor::types::ALL, -1);
            // The replies are delivered locally: ingress gives them the frontend back.
            let reply = sctp(f, "10.244.2.7", 13868, NODE_IP, 45000).data(b"CEA").build();
            let back = ingress(&mut s, &reply);
            assert_eq!(back.action, OK, "{f:?}");
            assert_bytes(
                &back.packet,
                &nat(f, &reply, Some(("10.96.0.50", 3868)), None),
                format!("{f:?} the reply to the node's association"),
            );
            let reply = sctp(f, "10.244.2.7", 13868, NODE_IP, 45001).build();
            assert_bytes(
                &ingress(&mut s, &reply).packet,
                &nat(f, &reply, Some((NODE_IP, 30868)), None),
                format!("{f:?} the reply as the node's NodePort"),
            );
            // Path MTU discovery: a router's error about the DATA quotes the frontend the
            // socket called.
            let router = f.addr("192.168.50.1");
            let kind = IcmpError::TooBig { mtu: 1280 };
            let error = packet::icmp_error(&router, &f.addr(NODE_IP), kind, &sent);
            let back = ingress(&mut s, &error);
            assert_eq!(back.action, OK, "{f:?}");
            let quote = quote_nat(f, &sent, None, Some(("10.96.0.50", 3868)));
            let expected = packet::icmp_error(&router, &f.addr(NODE_IP), kind, &quote);
            assert_same(
                &back.packet,
                &expected,
                format!("{f:?} error about the node's DATA"),
            );
            // A pod's association to the same backend keeps its own path: its reply is
            // reverse-NATed at egress, not at ingress.
            let pod = sctp(f, "10.244.2.20", 45000, "10.96.0.50", 3868).build();
            ingress(&mut s, &pod);
            let pod_reply = sctp(f, "10.244.2.7", 13868, "10.244.2.20", 45000).build();
            assert_eq!(ingress(&mut s, &pod_reply).packet, pod_reply, "{f:?}");
            assert_eq!(
                counter(&s, Counter::TcUnsupportedProtocol),
                unsupported,
                "{f:?}: the node's SCTP is served"
            );
        }
    });
}

#[test]
fn without_the_sctp_program_sctp_passes_counted_and_tcp_is_still_served() {
    let mut s = scratch_with(&sctp_state(), true);
    assert_eq!(
        s.datapath.sctp_refused(),
        None,
        "this kernel verifies lb_tc_sctp_in"
    );
    s.datapath
        .refuse_sctp("refused for the test")
        .expect("the slot is emptied");
    assert_eq!(s.datapath.sctp_refused(), Some("refused for the test"));
    for f in FAMILIES {
        let unsupported = counter(&s, Counter::TcUnsupportedProtocol);
        let init = sctp(f, "10.244.2.20", 40000, "10.96.0.50", 3868).build();
        let out = ingress(&mut s, &init);
        assert_eq!(out.action, OK, "{f:?}");
        assert_eq!(out.packet, init, "{f:?}: SCTP left as it was");
        assert_eq!(
            counter(&s, Counter::TcUnsupportedProtocol),
            unsupported + 1,
            "{f:?}: the untranslated SCTP packet is counted"
        );
        let syn = tcp(f, "10.244.2.20", 40001, "10.96.0.10", 80).build();
        assert_ne!(
            packet::summary(&ingress(&mut s, &syn).packet).dst,
            f.ip("10.96.0.10"),
            "{f:?}: TCP to a cluster IP is still translated"
        );
    }
    // `lb-agent trace` says why: the kernel's refusal, not the Service.
    let req = lb_agent::trace::TraceRequest {
        src: "10.244.2.20".parse().unwrap(),
        dst: "10.96.0.50".parse().unwrap(),
        sport: 40002,
        dport: 3868,
        protocol: lb_agent::model::Protocol::Sctp,
        ingress_ifindex: 0,
    };
    // From a pod and from the node itself.
    for src in ["10.244.2.20", NODE_IP] {
        let req = lb_agent::trace::TraceRequest {
            src: src.parse().unwrap(),
            ..req
        };
        let (result, details) = s.trace(&req).expect("trace");
        assert_eq!(result.verdict, "pass", "from {src}");
        let note = details.note.expect("a note");
        assert!(
            note.contains(lb_agent::plan::SCTP_REFUSED) && note.contains("refused for the test"),
            "from {src}: {note}"
        );
    }
}

/// The SCTP program is loaded with the first SCTP Service, as the agent does (a second of
/// verification that nodes without SCTP never pay): before, SCTP passes untranslated, counted;
/// once a Service has an SCTP port, its packets are translated.
#[test]
fn the_sctp_program_is_loaded_with_the_first_sctp_service() {
    let mut s = scratch(true);
    let f = FAMILIES[0];
    // To a cluster IP with TCP ports only: past the prefilter, the tail call finds no program.
    let to_tcp_service = sctp(f, "10.244.2.20", 40000, "10.96.0.10", 80).build();
    let unsupported = counter(&s, Counter::TcUnsupportedProtocol);
    assert_eq!(
        ingress(&mut s, &to_tcp_service).packet,
        to_tcp_service,
        "no SCTP program yet"
    );
    assert_eq!(counter(&s, Counter::TcUnsupportedProtocol), unsupported + 1);
    s.program(&sctp_state()).expect("programming an SCTP Service");
    let init = sctp(f, "10.244.2.20", 40000, "10.96.0.50", 3868).build();
    assert_bytes(
        &ingress(&mut s, &init).packet,
        &nat(f, &init, None, Some(("10.244.2.7", 13868))),
        "SCTP INIT DNAT once the Service exists",
    );
}
