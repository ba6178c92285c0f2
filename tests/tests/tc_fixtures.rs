//! Packet fixtures for the tc programs, run with BPF_PROG_TEST_RUN against scratch maps programmed
//! by the agent's own pipeline. Every output is compared byte for byte with an independently built
//! expected packet, and every checksum is verified by recomputation.

use std::net::Ipv4Addr;

use etherparse::{Icmpv4Type, icmpv4::DestUnreachableHeader};
use lb_agent::{
    datapath::{OBJECT, TcRun},
    node::NodeSettings,
    trace::ScratchDatapath,
    watch::ClusterState,
};
use lb_tests::{
    fixtures::{State, service, slice},
    packet::{self, rewritten, summary, verify_checksums},
    require_root,
};

const OK: i32 = 0;
const SHOT: i32 = 2;
const REDIRECT: i32 = 7;
const NODE_IP: &str = "192.168.50.11";
const CLIENT: &str = "192.168.50.100";

fn state() -> ClusterState {
    let mut s = ClusterState::default();
    let add = |s: &mut ClusterState,
               svc: k8s_openapi::api::core::v1::Service,
               sl: Option<k8s_openapi::api::discovery::v1::EndpointSlice>| {
        s.add_service(svc);
        if let Some(sl) = sl {
            s.add_slice(sl);
        }
    };
    add(
        &mut s,
        service("t", "web")
            .cluster_ip("10.96.0.10")
            .port("http", "TCP", 80, 8080)
            .build(),
        Some(
            slice("t", "web", "web-1")
                .endpoint("10.244.1.5", "node-a", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
        ),
    );
    add(
        &mut s,
        service("t", "np")
            .cluster_ip("10.96.0.11")
            .port("http", "TCP", 80, 8080)
            .node_port(30080)
            .build(),
        Some(
            slice("t", "np", "np-1")
                .endpoint("10.244.2.7", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
        ),
    );
    add(
        &mut s,
        service("t", "local")
            .cluster_ip("10.96.0.12")
            .port("http", "TCP", 80, 8080)
            .node_port(30081)
            .external_traffic_policy("Local")
            .build(),
        Some(
            slice("t", "local", "local-1")
                .endpoint("10.244.1.6", "node-a", State::Ready)
                .endpoint("10.244.2.8", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
        ),
    );
    add(
        &mut s,
        service("t", "local-none")
            .cluster_ip("10.96.0.13")
            .port("http", "TCP", 80, 8080)
            .node_port(30082)
            .external_traffic_policy("Local")
            .build(),
        Some(
            slice("t", "local-none", "ln-1")
                .endpoint("10.244.2.9", "node-b", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
        ),
    );
    add(
        &mut s,
        service("t", "empty")
            .cluster_ip("10.96.0.14")
            .port("http", "TCP", 80, 8080)
            .port("dns", "UDP", 53, 5353)
            .build(),
        None,
    );
    add(
        &mut s,
        service("t", "lb")
            .cluster_ip("10.96.0.15")
            .port("http", "TCP", 80, 8080)
            .node_port(30083)
            .load_balancer_ip("203.0.113.10")
            .source_ranges(&["198.51.100.0/24"])
            .build(),
        Some(
            slice("t", "lb", "lb-1")
                .endpoint("10.244.1.5", "node-a", State::Ready)
                .port("http", "TCP", 8080)
                .build(),
        ),
    );
    add(
        &mut s,
        service("t", "dns")
            .cluster_ip("10.96.0.16")
            .port("dns", "UDP", 53, 5353)
            .build(),
        Some(
            slice("t", "dns", "dns-1")
                .endpoint("10.244.1.5", "node-a", State::Ready)
                .port("dns", "UDP", 5353)
                .build(),
        ),
    );
    s
}

fn settings(cluster_cidr: bool) -> NodeSettings {
    NodeSettings {
        node_name: "node-a".into(),
        cluster_cidrs: if cluster_cidr {
            vec!["10.244.0.0/16".parse().unwrap()]
        } else {
            vec![]
        },
        nodeport_addresses: vec![],
        masquerade_all: false,
        localhost_nodeports: true,
        bind_address: None,
    }
}

fn scratch_with(state: &ClusterState, cluster_cidr: bool) -> ScratchDatapath {
    require_root();
    assert!(
        !OBJECT.is_empty(),
        "lb-agent was built without the eBPF object: run through ./x test"
    );
    ScratchDatapath::new(state, settings(cluster_cidr), &[NODE_IP.parse().unwrap()], OBJECT)
        .expect("scratch data path")
}

fn scratch(cluster_cidr: bool) -> ScratchDatapath {
    scratch_with(&state(), cluster_cidr)
}

fn ingress(s: &mut ScratchDatapath, pkt: &[u8]) -> TcRun {
    s.datapath.test_run_tc("lb_tc_ingress", pkt, 1).expect("test run")
}

fn egress(s: &mut ScratchDatapath, pkt: &[u8]) -> TcRun {
    s.datapath.test_run_tc("lb_tc_egress", pkt, 1).expect("test run")
}

fn assert_bytes(actual: &[u8], expected: &[u8], what: &str) {
    verify_checksums(actual).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(
        actual,
        expected,
        "{what}: got {:?}, expected {:?}",
        summary(actual),
        summary(expected)
    );
}

#[test]
fn syn_to_a_cluster_ip_is_translated_to_the_backend() {
    let mut s = scratch(true);
    // A pod on another node calls the ClusterIP through this node: no masquerade (a pod source).
    let syn = packet::tcp("10.244.2.20", 40000, "10.96.0.10", 80).build();
    let out = ingress(&mut s, &syn);
    assert_eq!(out.action, OK);
    assert_bytes(
        &out.packet,
        &rewritten(&syn, None, Some(("10.244.1.5", 8080))),
        "DNAT",
    );
    // Leaving towards the backend: nothing to masquerade.
    let out2 = egress(&mut s, &out.packet);
    assert_bytes(&out2.packet, &out.packet, "egress of a pod's flow");
}

#[test]
fn an_established_flow_keeps_its_backend_when_endpoints_change() {
    let mut s = scratch(true);
    let syn = packet::tcp("10.244.2.20", 40001, "10.96.0.10", 80).build();
    assert_eq!(
        summary(&ingress(&mut s, &syn).packet).dst,
        "10.244.1.5".parse::<Ipv4Addr>().unwrap()
    );
    // The endpoint is replaced.
    let mut changed = state();
    changed.add_slice(
        slice("t", "web", "web-1")
            .endpoint("10.244.1.99", "node-a", State::Ready)
            .port("http", "TCP", 8080)
            .build(),
    );
    s.program(&changed).unwrap();
    let data = packet::tcp("10.244.2.20", 40001, "10.96.0.10", 80)
        .data(b"GET / HTTP/1.1\r\n\r\n")
        .build();
    let out = ingress(&mut s, &data);
    assert_bytes(
        &out.packet,
        &rewritten(&data, None, Some(("10.244.1.5", 8080))),
        "established flow",
    );
    // A new connection goes to the new endpoint.
    let syn2 = packet::tcp("10.244.2.20", 40002, "10.96.0.10", 80).build();
    assert_eq!(
        summary(&ingress(&mut s, &syn2).packet).dst,
        "10.244.1.99".parse::<Ipv4Addr>().unwrap()
    );
}

#[test]
fn replies_get_the_frontend_back_on_the_way_out() {
    let mut s = scratch(true);
    let syn = packet::tcp("10.244.2.20", 40003, "10.96.0.10", 80).build();
    ingress(&mut s, &syn);
    let reply = packet::tcp("10.244.1.5", 8080, "10.244.2.20", 40003)
        .data(b"HTTP/1.1 200 OK\r\n")
        .build();
    // At ingress (from the backend's veth) the reply passes: reverse NAT is for the egress side.
    let at_ingress = ingress(&mut s, &reply);
    assert_bytes(&at_ingress.packet, &reply, "reply at ingress");
    let out = egress(&mut s, &reply);
    assert_eq!(out.action, OK);
    assert_bytes(
        &out.packet,
        &rewritten(&reply, Some(("10.96.0.10", 80)), None),
        "reverse NAT",
    );
}

#[test]
fn nodeport_from_outside_is_translated_and_masqueraded_both_ways() {
    let mut s = scratch(true);
    let syn = packet::tcp(CLIENT, 41000, NODE_IP, 30080).build();
    let dnat = ingress(&mut s, &syn);
    assert_bytes(
        &dnat.packet,
        &rewritten(&syn, None, Some(("10.244.2.7", 8080))),
        "NodePort DNAT",
    );
    // Routed towards node b: the source becomes this node.
    let snat = egress(&mut s, &dnat.packet);
    let port = summary(&snat.packet).sport;
    assert!((20_000..=29_999).contains(&port), "masquerade port {port}");
    assert_bytes(
        &snat.packet,
        &rewritten(&dnat.packet, Some((NODE_IP, port)), None),
        "SNAT",
    );
    // The reply comes back to this node's address and masquerade port...
    let reply = packet::tcp("10.244.2.7", 8080, NODE_IP, port)
        .data(b"pong")
        .build();
    let unsnat = ingress(&mut s, &reply);
    assert_bytes(
        &unsnat.packet,
        &rewritten(&reply, None, Some((CLIENT, 41000))),
        "un-SNAT",
    );
    // ... and leaves from the NodePort the client called: egress sees the mark ingress set
    // (handed over explicitly, as the kernel would carry it on the skb).
    assert_ne!(unsnat.mark, 0, "ingress marks un-SNATed replies");
    let out = s
        .datapath
        .test_run_tc_with_mark("lb_tc_egress", &unsnat.packet, unsnat.mark)
        .expect("egress");
    assert_eq!(out.mark, 0, "egress clears the mark");
    assert_bytes(
        &out.packet,
        &rewritten(&unsnat.packet, Some((NODE_IP, 30080)), None),
        "reverse NAT to the NodePort",
    );
    // A second connection from the same client gets its own masquerade port.
    let syn2 = packet::tcp(CLIENT, 41001, NODE_IP, 30080).build();
    let dnat2 = ingress(&mut s, &syn2).packet;
    let snat2 = egress(&mut s, &dnat2);
    assert_ne!(summary(&snat2.packet).sport, port);
}

#[test]
fn a_nodeport_to_a_host_network_endpoint_of_this_node_keeps_the_client_and_reverses_the_reply() {
    // A hostNetwork endpoint of this node has the node's address: DNAT delivers the packet
    // locally, so it never reaches egress to be masqueraded. As with kube-proxy (whose
    // POSTROUTING MASQUERADE a locally delivered packet never meets), the server sees the client
    // and its reply leaves with the NodePort as its source. (Upstream e2e: "Networking Granular
    // Checks: Services should function for service endpoints using hostNetwork".)
    let mut state = ClusterState::default();
    state.add_service(
        service("t", "hostnet")
            .cluster_ip("10.96.0.20")
            .port("http", "TCP", 80, 8083)
            .node_port(30084)
            .build(),
    );
    state.add_slice(
        slice("t", "hostnet", "hostnet-1")
            .endpoint(NODE_IP, "node-a", State::Ready)
            .port("http", "TCP", 8083)
            .build(),
    );
    let mut s = scratch_with(&state, true);
    let syn = packet::tcp(CLIENT, 41000, NODE_IP, 30084).build();
    let dnat = ingress(&mut s, &syn);
    assert_bytes(
        &dnat.packet,
        &rewritten(&syn, None, Some((NODE_IP, 8083))),
        "NodePort DNAT to this node's own address",
    );
    assert_eq!(dnat.mark, 0, "nothing to un-SNAT later");
    let reply = packet::tcp(NODE_IP, 8083, CLIENT, 41000).data(b"pong").build();
    let out = egress(&mut s, &reply);
    assert_bytes(
        &out.packet,
        &rewritten(&reply, Some((NODE_IP, 30084)), None),
        "the reply leaves from the NodePort the client called",
    );
    // Its ClusterIP from outside (routed to this node) is the same: the client stays.
    let syn = packet::tcp(CLIENT, 41001, "10.96.0.20", 80).build();
    let dnat = ingress(&mut s, &syn);
    assert_bytes(
        &dnat.packet,
        &rewritten(&syn, None, Some((NODE_IP, 8083))),
        "ClusterIP DNAT to this node's own address",
    );
    let reply = packet::tcp(NODE_IP, 8083, CLIENT, 41001).build();
    assert_bytes(
        &egress(&mut s, &reply).packet,
        &rewritten(&reply, Some(("10.96.0.20", 80)), None),
        "the reply leaves from the ClusterIP",
    );
}

#[test]
fn local_policy_keeps_the_client_source_and_uses_local_endpoints_only() {
    let mut s = scratch(true);
    for sport in 42000..42020 {
        let syn = packet::tcp(CLIENT, sport, NODE_IP, 30081).build();
        let out = ingress(&mut s, &syn);
        assert_bytes(
            &out.packet,
            &rewritten(&syn, None, Some(("10.244.1.6", 8080))),
            "ETP=Local",
        );
        let leaving = egress(&mut s, &out.packet);
        assert_eq!(
            summary(&leaving.packet).src,
            CLIENT.parse::<Ipv4Addr>().unwrap(),
            "client IP preserved"
        );
    }
    // A pod (cluster CIDR) calling the same NodePort is short-circuited to all endpoints.
    let mut seen = std::collections::BTreeSet::new();
    for sport in 43000..43060 {
        let syn = packet::tcp("10.244.3.3", sport, NODE_IP, 30081).build();
        seen.insert(summary(&ingress(&mut s, &syn).packet).dst);
    }
    assert_eq!(
        seen.len(),
        2,
        "pod traffic uses the cluster-wide endpoints: {seen:?}"
    );
}

#[test]
fn a_client_port_reused_on_another_frontend_is_not_masqueraded_by_the_old_flow() {
    // Two NodePorts share a backend: 30090 masquerades (Cluster policy), 30081 keeps the client
    // address (Local). The client reuses its source port from the first for the second.
    let mut st = state();
    st.add_service(
        service("t", "shared")
            .cluster_ip("10.96.0.20")
            .port("http", "TCP", 80, 8080)
            .node_port(30090)
            .build(),
    );
    st.add_slice(
        slice("t", "shared", "shared-1")
            .endpoint("10.244.1.6", "node-a", State::Ready)
            .port("http", "TCP", 8080)
            .build(),
    );
    let mut s = scratch_with(&st, true);
    let first = ingress(&mut s, &packet::tcp(CLIENT, 44000, NODE_IP, 30090).build()).packet;
    let masqueraded = egress(&mut s, &first);
    assert_eq!(
        summary(&masqueraded.packet).src,
        NODE_IP.parse::<Ipv4Addr>().unwrap(),
        "the Cluster-policy NodePort masquerades"
    );
    // Same client tuple after DNAT (CLIENT:44000 -> 10.244.1.6:8080), but through the Local one.
    let syn = packet::tcp(CLIENT, 44000, NODE_IP, 30081).build();
    let dnat = ingress(&mut s, &syn);
    assert_bytes(
        &dnat.packet,
        &rewritten(&syn, None, Some(("10.244.1.6", 8080))),
        "ETP=Local DNAT",
    );
    let leaving = egress(&mut s, &dnat.packet);
    assert_bytes(&leaving.packet, &dnat.packet, "client address preserved");
    // Its replies go back as the Local NodePort.
    let reply = packet::tcp("10.244.1.6", 8080, CLIENT, 44000).build();
    let out = egress(&mut s, &reply);
    assert_bytes(
        &out.packet,
        &rewritten(&reply, Some((NODE_IP, 30081)), None),
        "reverse NAT to the Local NodePort",
    );
}

#[test]
fn local_policy_without_local_endpoints_drops() {
    let mut s = scratch(true);
    let syn = packet::tcp(CLIENT, 42100, NODE_IP, 30082).build();
    let out = ingress(&mut s, &syn);
    assert_eq!(out.action, SHOT);
}

#[test]
fn a_service_without_endpoints_is_rejected_with_icmp_port_unreachable() {
    let mut s = scratch(true);
    let mut with_options = packet::tcp(CLIENT, 42202, "10.96.0.14", 80);
    with_options.options = vec![7, 7, 4, 0, 0, 0, 0, 0]; // record route (one slot), EOL padding
    for syn in [
        packet::tcp(CLIENT, 42200, "10.96.0.14", 80).build(),
        packet::udp(CLIENT, 42201, "10.96.0.14", 53).build(),
        // The quote carries the whole IP header, options included.
        with_options.build(),
    ] {
        let out = ingress(&mut s, &syn);
        assert_eq!(
            out.action, REDIRECT,
            "sent back out of the interface it came in on"
        );
        let expected = {
            let mut e = packet::icmp_error(
                "10.96.0.14",
                CLIENT,
                Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Port),
                &syn,
            );
            // The program sends it back: Ethernet addresses swapped, TOS 0xc0 (internetwork
            // control, as the kernel's ICMP errors), no DF, id 0.
            e[0..6].copy_from_slice(&packet::CLIENT_MAC);
            e[6..12].copy_from_slice(&packet::NODE_MAC);
            e
        };
        verify_checksums(&out.packet).unwrap();
        assert_eq!(&out.packet[..12], &expected[..12], "Ethernet addresses swapped");
        assert_eq!(
            &out.packet[14 + 12..14 + 20],
            &expected[14 + 12..14 + 20],
            "from the frontend to the client"
        );
        assert_eq!(
            &out.packet[34..],
            &expected[34..],
            "ICMP port unreachable quoting the packet"
        );
    }
}

#[test]
fn a_reject_never_answers_a_source_icmp_errors_may_not_go_to() {
    let mut s = scratch(true);
    for src in [
        "255.255.255.255",
        "0.0.0.0",
        "0.1.2.3",
        "224.0.0.5",
        "239.1.1.1",
        "240.0.0.1",
        "127.0.0.1",
    ] {
        let p = packet::udp(src, 5000, "10.96.0.14", 53).build();
        let out = ingress(&mut s, &p);
        assert_eq!(out.action, SHOT, "the packet from {src} is dropped unanswered");
    }
    // A unicast source in a link-layer broadcast frame (RFC 1122 3.2.2 too).
    let mut p = packet::udp(CLIENT, 5000, "10.96.0.14", 53).build();
    p[0..6].copy_from_slice(&[0xff; 6]);
    assert_eq!(ingress(&mut s, &p).action, SHOT, "link-layer broadcast");
    let unanswerable = s
        .maps()
        .counter(lb_common::stats::Counter::TcRejectUnanswerable as u32);
    assert_eq!(unanswerable, 8);
}

#[test]
fn reject_answers_are_rate_limited_like_the_kernels_icmp_errors() {
    use lb_common::ratelimit::{REJECT_BURST, REJECT_RATE_PER_SEC};
    let mut s = scratch(true);
    let flood = 400u16;
    let started = std::time::Instant::now();
    let mut answered = 0u64;
    for i in 0..flood {
        let p = packet::udp(CLIENT, 10_000 + i, "10.96.0.14", 53).build();
        match ingress(&mut s, &p).action {
            REDIRECT => answered += 1,
            SHOT => {}
            other => panic!("verdict {other}"),
        }
    }
    let elapsed_ms = started.elapsed().as_millis() as u64;
    // One bucket per CPU: a full burst on the first CPU the test runs on, and at most a burst per
    // CPU plus the refill over the time the flood took.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let ceiling = cpus * REJECT_BURST + (elapsed_ms + 1) * REJECT_RATE_PER_SEC / 1000 * cpus;
    assert!(
        answered >= REJECT_BURST,
        "{answered} answers: less than one burst"
    );
    assert!(
        answered <= ceiling.min(u64::from(flood)),
        "{answered} answers in {elapsed_ms} ms (ceiling {ceiling})"
    );
    let limited = s
        .maps()
        .counter(lb_common::stats::Counter::TcRejectRateLimited as u32);
    assert_eq!(
        limited,
        u64::from(flood) - answered,
        "every unanswered packet is counted"
    );
}

#[test]
fn load_balancer_source_ranges_are_enforced() {
    let mut s = scratch(true);
    let denied = packet::tcp(CLIENT, 42300, "203.0.113.10", 80).build();
    assert_eq!(ingress(&mut s, &denied).action, SHOT);
    let allowed = packet::tcp("198.51.100.7", 42301, "203.0.113.10", 80).build();
    let out = ingress(&mut s, &allowed);
    assert_bytes(
        &out.packet,
        &rewritten(&allowed, None, Some(("10.244.1.5", 8080))),
        "allowed source",
    );
    // NodePorts are not filtered by source ranges (kube-proxy).
    let np = packet::tcp(CLIENT, 42302, NODE_IP, 30083).build();
    assert_eq!(
        summary(&ingress(&mut s, &np).packet).dst,
        "10.244.1.5".parse::<Ipv4Addr>().unwrap()
    );
}

#[test]
fn hairpin_is_masqueraded() {
    let mut s = scratch(true);
    // The backend pod calls its own Service.
    let syn = packet::tcp("10.244.1.5", 44000, "10.96.0.10", 80).build();
    let dnat = ingress(&mut s, &syn);
    assert_bytes(
        &dnat.packet,
        &rewritten(&syn, None, Some(("10.244.1.5", 8080))),
        "hairpin DNAT",
    );
    let snat = egress(&mut s, &dnat.packet);
    let s2 = summary(&snat.packet);
    assert_eq!(
        s2.src,
        NODE_IP.parse::<Ipv4Addr>().unwrap(),
        "the pod sees the node, not itself"
    );
    assert_bytes(
        &snat.packet,
        &rewritten(&dnat.packet, Some((NODE_IP, s2.sport)), None),
        "hairpin SNAT",
    );
}

#[test]
fn off_cluster_sources_to_a_cluster_ip_are_masqueraded_when_a_cluster_cidr_is_set() {
    let mut s = scratch(true);
    let syn = packet::tcp(CLIENT, 44100, "10.96.0.10", 80).build();
    let dnat = ingress(&mut s, &syn).packet;
    let out = egress(&mut s, &dnat);
    assert_eq!(summary(&out.packet).src, NODE_IP.parse::<Ipv4Addr>().unwrap());
    // Without a local-traffic detector, kube-proxy does not masquerade cluster IP traffic.
    let mut s = scratch(false);
    let syn = packet::tcp(CLIENT, 44101, "10.96.0.10", 80).build();
    let dnat = ingress(&mut s, &syn).packet;
    let out = egress(&mut s, &dnat);
    assert_eq!(summary(&out.packet).src, CLIENT.parse::<Ipv4Addr>().unwrap());
}

#[test]
fn non_service_traffic_passes_untouched() {
    let mut s = scratch(true);
    for pkt in [
        packet::tcp(CLIENT, 45000, "10.244.1.5", 8080).build(),
        packet::tcp(CLIENT, 45001, "10.96.0.10", 81).build(),
        packet::udp(CLIENT, 45002, "10.96.0.10", 80).build(),
        packet::tcp(CLIENT, 45003, NODE_IP, 22).build(),
    ] {
        for run in [ingress(&mut s, &pkt), egress(&mut s, &pkt)] {
            assert_eq!(run.action, OK);
            assert_eq!(run.packet, pkt);
        }
    }
}

#[test]
fn truncated_and_fragmented_packets_pass_untouched() {
    let mut s = scratch(true);
    let full = packet::tcp(CLIENT, 45100, "10.96.0.10", 80).build();
    // BPF_PROG_TEST_RUN refuses an IPv4 frame shorter than its IP header (kernel 6.18), so the
    // truncation cases start inside the TCP header.
    for len in [34, 40, 47, 53] {
        let cut = &full[..len];
        let out = ingress(&mut s, cut);
        assert_eq!(out.action, OK, "truncated to {len}");
        assert_eq!(out.packet, cut, "truncated to {len}");
    }
    let mut frag = packet::udp(CLIENT, 45101, "10.96.0.16", 53);
    frag.more_fragments = true;
    let frag = frag.build();
    let out = ingress(&mut s, &frag);
    assert_eq!(
        (out.action, out.packet),
        (OK, frag),
        "fragments are never translated"
    );
}

#[test]
fn ip_options_are_handled() {
    let mut s = scratch(true);
    let mut spec = packet::tcp("10.244.2.20", 45200, "10.96.0.10", 80);
    spec.options = vec![1, 1, 1, 0]; // NOP, NOP, NOP, EOL
    let syn = spec.build();
    let out = ingress(&mut s, &syn);
    assert_bytes(
        &out.packet,
        &rewritten(&syn, None, Some(("10.244.1.5", 8080))),
        "DNAT with IP options",
    );
}

#[test]
fn udp_is_translated_and_a_zero_checksum_stays_zero() {
    let mut s = scratch(true);
    let dgram = packet::udp("10.244.2.20", 45300, "10.96.0.16", 53).build();
    let out = ingress(&mut s, &dgram);
    assert_bytes(
        &out.packet,
        &rewritten(&dgram, None, Some(("10.244.1.5", 5353))),
        "UDP DNAT",
    );
    let mut no_csum = packet::udp("10.244.2.20", 45301, "10.96.0.16", 53).build();
    no_csum[40] = 0;
    no_csum[41] = 0;
    let out = ingress(&mut s, &no_csum);
    assert_eq!(&out.packet[40..42], &[0, 0], "no checksum stays no checksum");
    assert_eq!(
        summary(&out.packet).dst,
        "10.244.1.5".parse::<Ipv4Addr>().unwrap()
    );
}

#[test]
fn a_udp_flow_whose_backend_is_removed_moves_to_a_live_one() {
    let mut st = state();
    st.add_slice(
        slice("t", "dns", "dns-1")
            .endpoint("10.244.1.5", "node-a", State::Ready)
            .port("dns", "UDP", 5353)
            .build(),
    );
    let mut s = scratch_with(&st, true);
    let dgram = packet::udp("10.244.2.20", 45400, "10.96.0.16", 53).build();
    assert_eq!(
        summary(&ingress(&mut s, &dgram).packet).dst,
        "10.244.1.5".parse::<Ipv4Addr>().unwrap()
    );
    st.add_slice(
        slice("t", "dns", "dns-1")
            .endpoint("10.244.1.77", "node-a", State::Ready)
            .port("dns", "UDP", 5353)
            .build(),
    );
    s.program(&st).unwrap();
    assert_eq!(
        summary(&ingress(&mut s, &dgram).packet).dst,
        "10.244.1.77".parse::<Ipv4Addr>().unwrap(),
        "the next datagram of the same flow goes to the live backend"
    );
}

#[test]
fn icmp_errors_for_a_masqueraded_flow_are_translated_back() {
    let mut s = scratch(true);
    let syn = packet::tcp(CLIENT, 46000, NODE_IP, 30080).build();
    let dnat = ingress(&mut s, &syn);
    let snat = egress(&mut s, &dnat.packet);
    let port = summary(&snat.packet).sport;
    // A router between the nodes cannot forward the (masqueraded) packet without fragmenting it.
    let frag_needed = packet::icmp_error(
        "10.244.2.1",
        NODE_IP,
        Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::FragmentationNeeded { next_hop_mtu: 1400 }),
        &snat.packet,
    );
    let back = ingress(&mut s, &frag_needed);
    assert_eq!(back.action, OK);
    verify_checksums(&back.packet).unwrap();
    packet::verify_quoted_ip_checksum(&back.packet).unwrap();
    let outer = &back.packet[14..34];
    assert_eq!(
        &outer[16..20],
        &CLIENT.parse::<Ipv4Addr>().unwrap().octets(),
        "addressed to the client"
    );
    let q = packet::quoted_summary(&back.packet);
    assert_eq!(
        (q.src, q.sport),
        (CLIENT.parse().unwrap(), 46000),
        "quotes the client's own source"
    );
    assert_eq!((q.dst, q.dport), ("10.244.2.7".parse().unwrap(), 8080));
    // Leaving towards the client, the quote names the NodePort the client called.
    let out = s
        .datapath
        .test_run_tc_with_mark("lb_tc_egress", &back.packet, back.mark)
        .expect("egress");
    verify_checksums(&out.packet).unwrap();
    packet::verify_quoted_ip_checksum(&out.packet).unwrap();
    let q = packet::quoted_summary(&out.packet);
    assert_eq!(
        (q.src, q.sport, q.dst, q.dport),
        (CLIENT.parse().unwrap(), 46000, NODE_IP.parse().unwrap(), 30080)
    );
    assert!((20_000..=29_999).contains(&port));
}

/// Regression: the entries of closed connections held their masquerade ports until LRU eviction
/// (only once the whole map was full), so after as many connections as the SNAT range has ports
/// every new NodePort connection to that backend was dropped. The programs now mark FIN and RST,
/// and the agent's conntrack GC frees ended flows.
#[test]
fn closed_masqueraded_flows_give_their_ports_back_through_the_conntrack_gc() {
    use lb_agent::{apply::MapOps, datapath::conntrack};
    use lb_common::stats::Counter;
    use packet::Close;

    let mut s = scratch(true);
    // A masquerade range of two ports.
    let mut cfg = s.maps().config.get(&0, 0).expect("config");
    cfg.snat_port_min = 20_000;
    cfg.snat_port_max = 20_001;
    s.maps_mut().put_config(&cfg).expect("config");
    let mut ct = s.datapath.take_conntrack().expect("conntrack map");
    const BACKEND: &str = "10.244.2.7";

    // Opens a NodePort connection from `cport`; its masquerade port, or None when dropped.
    let connect = |s: &mut ScratchDatapath, cport: u16| -> Option<u16> {
        let dnat = ingress(s, &packet::tcp(CLIENT, cport, NODE_IP, 30080).build());
        if dnat.action == SHOT {
            return None;
        }
        assert_eq!(summary(&dnat.packet).dst.to_string(), BACKEND);
        let snat = egress(s, &dnat.packet);
        Some(summary(&snat.packet).sport)
    };
    let a = connect(&mut s, 41000).expect("first connection");
    let b = connect(&mut s, 41001).expect("second connection");
    assert_eq!([a.min(b), a.max(b)], [20_000, 20_001]);
    let exhausted = |s: &ScratchDatapath| s.maps().counter(Counter::TcSnatPortsExhausted as u32);
    assert_eq!(connect(&mut s, 41002), None, "both ports taken: dropped");
    assert_eq!(exhausted(&s), 1);

    // A is closed by both sides (FIN from the client, translated on the way in; FIN from the
    // backend, un-SNATed on the way back); B only by its client.
    let fin = ingress(
        &mut s,
        &packet::tcp(CLIENT, 41000, NODE_IP, 30080)
            .closing(Close::Fin)
            .build(),
    );
    assert_eq!(summary(&fin.packet).dst.to_string(), BACKEND);
    let reply_fin = ingress(
        &mut s,
        &packet::tcp(BACKEND, 8080, NODE_IP, a).closing(Close::Fin).build(),
    );
    assert_eq!(summary(&reply_fin.packet).dst.to_string(), CLIENT);
    ingress(
        &mut s,
        &packet::tcp(CLIENT, 41001, NODE_IP, 30080)
            .closing(Close::Fin)
            .build(),
    );

    // Within the FIN timeout nothing goes; after it, A's three entries do, B's stay.
    let timeouts = conntrack::GcTimeouts::default();
    let now = lb_agent::time::monotonic_coarse_ns();
    let early = conntrack::collect(&mut ct, now, &timeouts).expect("gc");
    assert!(early.deleted.is_empty(), "{early:?}");
    let later = now + timeouts.tcp_fin_timeout.as_nanos() as u64 + 1_000_000_000;
    let report = conntrack::collect(&mut ct, later, &timeouts).expect("gc");
    assert_eq!(report.deleted, vec![(conntrack::Reason::Closed, 3)], "{report:?}");

    // A's port serves a new connection; B's is still taken.
    assert_eq!(connect(&mut s, 41002), Some(a));
    assert_eq!(connect(&mut s, 41003), None, "B still holds its port");

    // A reset by the backend ends B at once (after the timeout).
    ingress(
        &mut s,
        &packet::tcp(BACKEND, 8080, NODE_IP, b).closing(Close::Rst).build(),
    );
    let later =
        lb_agent::time::monotonic_coarse_ns() + timeouts.tcp_fin_timeout.as_nanos() as u64 + 1_000_000_000;
    let report = conntrack::collect(&mut ct, later, &timeouts).expect("gc");
    assert_eq!(report.deleted, vec![(conntrack::Reason::Closed, 3)], "{report:?}");
    assert_eq!(connect(&mut s, 41003), Some(b));
}

/// The kernel maps write runs of service and backend entries with BPF_MAP_UPDATE_BATCH; a run
/// that does not fit stops exactly where the kernel refused, so the writer's mirror stays true.
#[test]
fn batched_map_writes_report_exactly_what_was_written() {
    use lb_agent::apply::MapOps;
    use lb_common::catalog::Capacities;
    use lb_common::{
        backend::Backend4Value,
        service::{Svc4Key, Svc4Value},
    };
    require_root();
    let caps = Capacities {
        services: 4,
        backends: 64,
        ..Capacities::default()
    };
    let mut dp = lb_agent::datapath::Datapath::load_unpinned(&caps, OBJECT).expect("load");
    let mut maps = dp.take_maps().expect("maps");

    let backends: Vec<(u32, Backend4Value)> = (1..=40u32)
        .map(|id| {
            let value = Backend4Value {
                addr: [10, 244, 0, id as u8],
                port: 8080,
                proto: lb_common::proto::TCP,
                ..Default::default()
            };
            (id, value)
        })
        .collect();
    maps.put_backends(&backends).expect("40 backends fit");
    let snap = maps.snapshot().expect("snapshot");
    assert_eq!(snap.backends.len(), 40);
    assert!(backends.iter().all(|(id, v)| snap.backends.get(id) == Some(v)));

    let services: Vec<(Svc4Key, Svc4Value)> = (0..6u16)
        .map(|slot| {
            let key = Svc4Key {
                addr: [10, 96, 0, 10],
                port: 80,
                slot,
                proto: lb_common::proto::TCP,
                ..Default::default()
            };
            (key, Svc4Value::default())
        })
        .collect();
    let err = maps.put_services(&services).expect_err("6 entries in a map of 4");
    assert_eq!(err.done, 4, "{err:?}");
    assert!(err.error.is_full(), "{err:?}");
    let snap = maps.snapshot().expect("snapshot");
    let written: Vec<u16> = snap.services.keys().map(|k| k.slot).collect();
    assert_eq!(written, vec![0, 1, 2, 3]);
}
