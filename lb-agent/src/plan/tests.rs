//! The plan against kube-proxy's documented behaviour, one case per rule.

use std::net::Ipv4Addr;

use lb_common::service::{SCOPE_EXTERNAL, SCOPE_INTERNAL};

use super::*;
use crate::model::test_support::service_port;
use crate::{
    family::{IpFamily, PerFamily},
    model::{CategorizedEndpoints, Endpoint, Protocol, ServicePortInfo},
    node::NodeContext,
};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn svc(name: &str) -> ServicePortInfo {
    service_port("ns", name, "http", "10.96.0.10")
}

fn ep(addr: &str, local: bool) -> Endpoint {
    Endpoint {
        ip: ip(addr),
        port: 8080,
        ready: true,
        serving: true,
        terminating: false,
        is_local: local,
        node_name: Some(if local { "me" } else { "other" }.into()),
        zone: None,
        zone_hints: Default::default(),
        node_hints: Default::default(),
    }
}

fn cat(cluster: &[Endpoint], local: &[Endpoint], has_any: bool) -> CategorizedEndpoints {
    CategorizedEndpoints {
        cluster: cluster.to_vec(),
        local: local.to_vec(),
        all_reachable: cluster.to_vec(),
        has_any,
    }
}

fn ctx() -> NodeContext {
    NodeContext {
        nodeport_addresses: vec![ip("192.168.1.10")],
        localhost_nodeports: true,
        node_ips: vec![ip("192.168.1.10")],
        masquerade_all: false,
        detect_local: PerFamily::default(),
        serves: PerFamily { v4: true, v6: true },
        host_addresses: vec![ip("192.168.1.10"), ip("192.168.2.10")],
        load_balancing: Default::default(),
        sctp_refused: None,
    }
}

fn fe(addr: &str, port: u16) -> Frontend {
    Frontend {
        addr: ip(addr),
        port,
        proto: Protocol::Tcp,
    }
}

fn backends(list: &[&str]) -> Vec<BackendAddr> {
    list.iter()
        .map(|a| BackendAddr {
            addr: ip(a),
            port: 8080,
            proto: Protocol::Tcp,
        })
        .collect()
}

#[test]
fn cluster_ip_uses_ready_cluster_endpoints_sorted() {
    let eps = [ep("10.244.2.2", false), ep("10.244.1.1", true)];
    let (d, problems) = plan(&[(svc("web"), cat(&eps, &eps[1..], true))], &ctx());
    assert!(problems.is_empty());
    let p = &d.frontends[&fe("10.96.0.10", 80)];
    assert_eq!(p.kind, FrontendKind::ClusterIp);
    assert_eq!(p.scopes.len(), 1);
    assert_eq!(p.scopes[0].scope, SCOPE_EXTERNAL);
    assert_eq!(p.scopes[0].flags, flags::CLUSTER_IP);
    assert_eq!(p.scopes[0].backends, backends(&["10.244.1.1", "10.244.2.2"]));
    assert_eq!(d.backends.len(), 2);
    assert_eq!(
        d.backends[&backends(&["10.244.1.1"])[0]],
        lb_common::backend::flags::LOCAL
    );
}

#[test]
fn no_endpoints_at_all_rejects() {
    let (d, _) = plan(&[(svc("web"), cat(&[], &[], false))], &ctx());
    let s = &d.frontends[&fe("10.96.0.10", 80)].scopes[0];
    assert!(s.backends.is_empty());
    assert_eq!(
        s.flags & flags::DROP_IF_EMPTY,
        0,
        "kube-proxy REJECTs a Service without endpoints"
    );
}

#[test]
fn internal_policy_local_without_local_endpoints_drops() {
    let mut s = svc("web");
    s.internal_policy_local = true;
    let remote = [ep("10.244.2.2", false)];
    let (d, _) = plan(&[(s, cat(&remote, &[], true))], &ctx());
    let scope = &d.frontends[&fe("10.96.0.10", 80)].scopes[0];
    assert!(scope.backends.is_empty());
    assert_ne!(
        scope.flags & flags::DROP_IF_EMPTY,
        0,
        "has no local endpoints -> DROP"
    );
}

#[test]
fn internal_policy_local_uses_local_endpoints() {
    let mut s = svc("web");
    s.internal_policy_local = true;
    let eps = [ep("10.244.1.1", true), ep("10.244.2.2", false)];
    let (d, _) = plan(&[(s, cat(&eps, &eps[..1], true))], &ctx());
    assert_eq!(
        d.frontends[&fe("10.96.0.10", 80)].scopes[0].backends,
        backends(&["10.244.1.1"])
    );
    assert_eq!(d.backends.len(), 1, "a backend no frontend uses is not written");
}

#[test]
fn nodeport_cluster_policy_is_masqueraded_on_every_address() {
    let mut s = svc("web");
    s.node_port = Some(30080);
    let eps = [ep("10.244.1.1", true), ep("10.244.2.2", false)];
    let (d, _) = plan(&[(s, cat(&eps, &eps[..1], true))], &ctx());
    for (addr, kind) in [
        ("192.168.1.10", FrontendKind::NodePort),
        ("127.0.0.1", FrontendKind::LocalhostNodePort),
    ] {
        let p = &d.frontends[&fe(addr, 30080)];
        assert_eq!(p.kind, kind);
        assert_eq!(p.scopes.len(), 1);
        assert_ne!(
            p.scopes[0].flags & flags::MASQUERADE,
            0,
            "external destinations with ETP=Cluster are masqueraded"
        );
        assert_eq!(p.scopes[0].backends.len(), 2);
    }
    assert_eq!(d.frontends.len(), 3);
}

#[test]
fn nodeport_local_policy_splits_scopes() {
    let mut s = svc("web");
    s.node_port = Some(30080);
    s.external_policy_local = true;
    let eps = [ep("10.244.1.1", true), ep("10.244.2.2", false)];
    let (d, _) = plan(&[(s, cat(&eps, &eps[..1], true))], &ctx());
    let p = &d.frontends[&fe("192.168.1.10", 30080)];
    assert_eq!(p.scopes.len(), 2);
    let (ext, int) = (&p.scopes[0], &p.scopes[1]);
    assert_eq!((ext.scope, int.scope), (SCOPE_EXTERNAL, SCOPE_INTERNAL));
    assert_ne!(ext.flags & flags::TWO_SCOPES, 0);
    assert_eq!(
        ext.flags & flags::MASQUERADE,
        0,
        "ETP=Local keeps the client source"
    );
    assert_eq!(ext.backends, backends(&["10.244.1.1"]));
    assert_eq!(
        int.backends,
        backends(&["10.244.1.1", "10.244.2.2"]),
        "node and pod traffic use all endpoints"
    );
    // The cluster IP is not external: one scope.
    assert_eq!(d.frontends[&fe("10.96.0.10", 80)].scopes.len(), 1);
}

/// Issue 17: Maglev applies to the external scope of external frontends (the node's setting or
/// the Service's annotation, which wins), never to cluster IPs, the localhost NodePort (only
/// this node's sockets reach it), an internal scope or an empty scope.
#[test]
fn maglev_is_for_traffic_from_outside() {
    use crate::{
        model::LbAlgorithm,
        node::LoadBalancing,
        plan::maglev::{HashSeed, TableSize},
    };
    let seed: HashSeed = "JLfvgnHc2kaSUFaI".parse().unwrap();
    let maglev_ctx = NodeContext {
        load_balancing: LoadBalancing {
            algorithm: LbAlgorithm::Maglev,
            maglev_table_size: TableSize::new(1021).unwrap(),
            maglev_hash_seed: seed,
        },
        ..ctx()
    };
    let mut s = svc("web");
    s.node_port = Some(30080);
    s.external_ips = vec![ip("192.0.2.7")];
    let eps = [ep("10.244.1.1", true), ep("10.244.2.2", false)];
    let maglev_of = |p: &FrontendPlan| -> Vec<(u16, Option<u32>)> {
        p.scopes
            .iter()
            .map(|s| (s.flags & flags::MAGLEV, s.maglev.map(|m| m.size.get())))
            .collect()
    };
    // The node's seed goes with every table it plans.
    let seeds = |p: &FrontendPlan| -> Vec<Option<HashSeed>> {
        p.scopes.iter().map(|s| s.maglev.map(|m| m.seed)).collect()
    };
    let on = vec![(flags::MAGLEV, Some(1021))];
    let off = vec![(0, None)];

    let (d, _) = plan(&[(s.clone(), cat(&eps, &eps[..1], true))], &maglev_ctx);
    assert_eq!(maglev_of(&d.frontends[&fe("192.168.1.10", 30080)]), on);
    assert_eq!(maglev_of(&d.frontends[&fe("192.0.2.7", 80)]), on);
    assert_eq!(seeds(&d.frontends[&fe("192.0.2.7", 80)]), vec![Some(seed)]);
    assert_eq!(maglev_of(&d.frontends[&fe("10.96.0.10", 80)]), off);
    assert_eq!(maglev_of(&d.frontends[&fe("127.0.0.1", 30080)]), off);

    // The annotation wins over the node's setting, either way.
    let mut random = s.clone();
    random.lb_algorithm = Some(LbAlgorithm::Random);
    let (d, _) = plan(&[(random, cat(&eps, &eps[..1], true))], &maglev_ctx);
    assert_eq!(maglev_of(&d.frontends[&fe("192.168.1.10", 30080)]), off);
    let mut annotated = s.clone();
    annotated.lb_algorithm = Some(LbAlgorithm::Maglev);
    let (d, _) = plan(&[(annotated.clone(), cat(&eps, &eps[..1], true))], &ctx());
    assert_eq!(
        maglev_of(&d.frontends[&fe("192.168.1.10", 30080)]),
        vec![(flags::MAGLEV, Some(16381))],
        "the default table size"
    );

    // externalTrafficPolicy Local: the local endpoints' scope only; none local, no table.
    annotated.external_policy_local = true;
    let (d, _) = plan(&[(annotated.clone(), cat(&eps, &eps[..1], true))], &ctx());
    assert_eq!(
        maglev_of(&d.frontends[&fe("192.168.1.10", 30080)]),
        vec![(flags::MAGLEV, Some(16381)), (0, None)]
    );
    let (d, _) = plan(&[(annotated, cat(&eps[1..], &[], true))], &ctx());
    assert_eq!(
        maglev_of(&d.frontends[&fe("192.168.1.10", 30080)]),
        vec![(0, None), (0, None)]
    );
}

#[test]
fn local_policy_without_local_endpoints_drops_external_traffic_only() {
    let mut s = svc("web");
    s.node_port = Some(30080);
    s.external_policy_local = true;
    let remote = [ep("10.244.2.2", false)];
    let (d, _) = plan(&[(s, cat(&remote, &[], true))], &ctx());
    let p = &d.frontends[&fe("192.168.1.10", 30080)];
    assert!(p.scopes[0].backends.is_empty());
    assert_ne!(p.scopes[0].flags & flags::DROP_IF_EMPTY, 0);
    assert_eq!(p.scopes[1].backends, backends(&["10.244.2.2"]));
    assert_eq!(p.scopes[1].flags & flags::DROP_IF_EMPTY, 0);
}

#[test]
fn cluster_ip_masquerade_rules() {
    let eps = [ep("10.244.1.1", true)];
    let mut c = ctx();
    c.detect_local.v4 = true;
    let (d, _) = plan(&[(svc("web"), cat(&eps, &eps, true))], &c);
    let f = d.frontends[&fe("10.96.0.10", 80)].scopes[0].flags;
    assert_ne!(f & flags::MASQUERADE_OFF_CLUSTER, 0);
    assert_eq!(f & flags::MASQUERADE, 0);
    c.masquerade_all = true;
    let (d, _) = plan(&[(svc("web"), cat(&eps, &eps, true))], &c);
    let f = d.frontends[&fe("10.96.0.10", 80)].scopes[0].flags;
    assert_ne!(f & flags::MASQUERADE, 0);
    c.masquerade_all = false;
    c.detect_local.v4 = false;
    let (d, _) = plan(&[(svc("web"), cat(&eps, &eps, true))], &c);
    assert_eq!(
        d.frontends[&fe("10.96.0.10", 80)].scopes[0].flags
            & (flags::MASQUERADE | flags::MASQUERADE_OFF_CLUSTER),
        0
    );
}

#[test]
fn load_balancer_source_ranges() {
    let mut s = svc("web");
    s.load_balancer_ips = vec![ip("203.0.113.7")];
    s.load_balancer_source_ranges = vec!["198.51.100.0/24".parse().unwrap()];
    let eps = [ep("10.244.1.1", true)];
    let (d, _) = plan(&[(s.clone(), cat(&eps, &eps, true))], &ctx());
    let p = &d.frontends[&fe("203.0.113.7", 80)];
    assert_eq!(p.kind, FrontendKind::LoadBalancer);
    assert_ne!(p.scopes[0].flags & flags::SOURCE_RANGES, 0);
    assert_eq!(p.scopes[0].flags & flags::SOURCE_RANGES_ALLOW_NODE, 0);
    assert_eq!(p.source_ranges, vec!["198.51.100.0/24".parse::<IpNet>().unwrap()]);
    // Source ranges never apply to the cluster IP or NodePorts.
    assert_eq!(
        d.frontends[&fe("10.96.0.10", 80)].scopes[0].flags & flags::SOURCE_RANGES,
        0
    );

    // A range containing the node IP admits the node, and traffic sourced from the LB IP.
    s.load_balancer_source_ranges
        .push("192.168.0.0/16".parse().unwrap());
    let (d, _) = plan(&[(s, cat(&eps, &eps, true))], &ctx());
    let p = &d.frontends[&fe("203.0.113.7", 80)];
    assert_ne!(p.scopes[0].flags & flags::SOURCE_RANGES_ALLOW_NODE, 0);
    assert!(p.source_ranges.contains(&"203.0.113.7/32".parse().unwrap()));
}

#[test]
fn session_affinity() {
    let mut s = svc("web");
    s.session_affinity_timeout = Some(30);
    let eps = [ep("10.244.1.1", true)];
    let (d, _) = plan(&[(s, cat(&eps, &eps, true))], &ctx());
    let p = &d.frontends[&fe("10.96.0.10", 80)];
    assert_eq!(p.affinity_timeout, 30);
    assert_ne!(p.scopes[0].flags & flags::AFFINITY, 0);
}

#[test]
fn two_services_claiming_one_external_ip() {
    let mut a = svc("alpha");
    a.external_ips = vec![ip("198.51.100.9")];
    let mut b = svc("beta");
    b.cluster_ips = vec![ip("10.96.0.11")];
    b.external_ips = vec![ip("198.51.100.9")];
    let eps = [ep("10.244.1.1", true)];
    let input = [
        (b.clone(), cat(&eps, &eps, true)),
        (a.clone(), cat(&eps, &eps, true)),
    ];
    let (d, problems) = plan(&input, &ctx());
    assert_eq!(
        d.frontends[&fe("198.51.100.9", 80)].service.name,
        "alpha",
        "the first claim by name wins, whatever the input order"
    );
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].service.name, "beta");
    assert!(
        problems[0].message.contains("198.51.100.9:80"),
        "{}",
        problems[0].message
    );
}

#[test]
fn protocols_are_separate_frontends() {
    let mut udp = svc("dns");
    udp.name.protocol = Protocol::Udp;
    let tcp = svc("dns");
    let eps = [ep("10.244.1.1", true)];
    let (d, problems) = plan(
        &[(tcp, cat(&eps, &eps, true)), (udp, cat(&eps, &eps, true))],
        &ctx(),
    );
    assert!(problems.is_empty());
    assert_eq!(d.frontends.len(), 2);
    assert_eq!(d.backends.len(), 2, "a backend is (address, port, protocol)");
}

/// `n` distinct ready endpoints 10.(100 + i / 65536).x.y:8080, local when `local`.
fn many(n: usize, local: bool) -> Vec<Endpoint> {
    (0..n)
        .map(|i| {
            let mut e = ep("10.0.0.0", local);
            e.ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 0)) + i as u32).into();
            e
        })
        .collect()
}

#[test]
fn a_scope_at_the_limit_is_programmed() {
    let eps = many(MAX_BACKENDS_PER_SCOPE, false);
    let (d, problems) = plan(&[(svc("big"), cat(&eps, &[], true))], &ctx());
    assert!(problems.is_empty(), "{problems:?}");
    let scope = &d.frontends[&fe("10.96.0.10", 80)].scopes[0];
    assert_eq!(scope.backends.len(), MAX_BACKENDS_PER_SCOPE);
    assert_eq!(d.backends.len(), MAX_BACKENDS_PER_SCOPE);
}

#[test]
fn a_scope_over_the_limit_is_refused_and_the_rest_is_programmed() {
    // Also beyond what a u16 slot count can say: the writer would have wrapped it to 1.
    for n in [MAX_BACKENDS_PER_SCOPE + 1, 65_536 + 1] {
        let big = many(n, false);
        let small = [ep("10.244.1.1", true)];
        let mut b = svc("big");
        b.node_port = Some(30080);
        let mut other = svc("web");
        other.cluster_ips = vec![ip("10.96.0.11")];
        let input = [(b, cat(&big, &[], true)), (other, cat(&small, &small, true))];
        let (d, problems) = plan(&input, &ctx());
        // Every frontend of the big Service uses the 'cluster' list: none is programmed.
        assert_eq!(
            d.frontends.keys().copied().collect::<Vec<_>>(),
            vec![fe("10.96.0.11", 80)],
            "n = {n}"
        );
        assert_eq!(
            d.backends.keys().copied().collect::<Vec<_>>(),
            backends(&["10.244.1.1"]),
            "the refused Service's backends are not written"
        );
        assert_eq!(problems.len(), 1, "one problem per service port: {problems:?}");
        let p = &problems[0];
        assert_eq!(p.service.name, "big");
        for needle in [
            "ns/big:http".to_string(),
            n.to_string(),
            MAX_BACKENDS_PER_SCOPE.to_string(),
            "10.96.0.10:80/TCP".into(),
            "192.168.1.10:30080/TCP".into(),
            "127.0.0.1:30080/TCP".into(),
        ] {
            assert!(
                p.message.contains(&needle),
                "{needle:?} missing from {:?}",
                p.message
            );
        }
    }
}

#[test]
fn only_the_frontends_whose_scope_is_too_large_are_refused() {
    // internalTrafficPolicy=Local: the cluster IP uses the (few) local endpoints and stays; the
    // NodePort uses every endpoint and is refused.
    let mut s = svc("big");
    s.internal_policy_local = true;
    s.node_port = Some(30080);
    let remote = many(MAX_BACKENDS_PER_SCOPE + 10, false);
    let local = [ep("10.244.1.1", true)];
    let all: Vec<Endpoint> = remote.iter().chain(&local).cloned().collect();
    let (d, problems) = plan(&[(s, cat(&all, &local, true))], &ctx());
    assert_eq!(
        d.frontends.keys().copied().collect::<Vec<_>>(),
        vec![fe("10.96.0.10", 80)]
    );
    assert_eq!(
        d.frontends[&fe("10.96.0.10", 80)].scopes[0].backends,
        backends(&["10.244.1.1"])
    );
    assert_eq!(problems.len(), 1);
    assert!(problems[0].message.contains("192.168.1.10:30080/TCP"));
    assert!(!problems[0].message.contains("10.96.0.10:80"));
}

#[test]
fn the_internal_scope_of_a_local_policy_counts_too() {
    // externalTrafficPolicy=Local: the external scope holds the local endpoints, the internal
    // scope (pod and node traffic) all of them; either one over the limit refuses the frontend.
    let mut s = svc("big");
    s.node_port = Some(30080);
    s.external_policy_local = true;
    s.cluster_ips = vec![];
    let remote = many(MAX_BACKENDS_PER_SCOPE + 1, false);
    let local = [ep("10.244.1.1", true)];
    let all: Vec<Endpoint> = remote.iter().chain(&local).cloned().collect();
    let (d, problems) = plan(&[(s, cat(&all, &local, true))], &ctx());
    assert!(d.frontends.is_empty(), "{:?}", d.frontends.keys());
    assert!(d.backends.is_empty());
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0]
            .message
            .contains(&(MAX_BACKENDS_PER_SCOPE + 2).to_string())
    );
}

#[test]
fn a_refused_claim_leaves_a_shared_external_ip_to_the_next_claimant() {
    let mut a = svc("alpha");
    a.external_ips = vec![ip("198.51.100.9")];
    let mut b = svc("beta");
    b.cluster_ips = vec![ip("10.96.0.11")];
    b.external_ips = vec![ip("198.51.100.9")];
    let big = many(MAX_BACKENDS_PER_SCOPE + 1, false);
    let small = [ep("10.244.1.1", true)];
    let (d, problems) = plan(
        &[(a, cat(&big, &[], true)), (b, cat(&small, &small, true))],
        &ctx(),
    );
    assert_eq!(d.frontends[&fe("198.51.100.9", 80)].service.name, "beta");
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].service.name, "alpha");
}

#[test]
fn backend_flags_do_not_depend_on_the_order_of_the_services() {
    // The same address in two Services' slices, which disagree on its node and conditions.
    let mut running = ep("10.244.1.1", false);
    running.ready = true;
    let mut terminating = ep("10.244.1.1", true);
    terminating.ready = false;
    terminating.terminating = true;
    let mut a = svc("alpha");
    a.cluster_ips = vec![ip("10.96.0.11")];
    let b = svc("beta");
    let input = [
        (a, cat(&[running.clone()], &[], true)),
        (b, cat(&[terminating.clone()], &[], true)),
    ];
    let (d1, _) = plan(&input, &ctx());
    let reversed = [input[1].clone(), input[0].clone()];
    let (d2, _) = plan(&reversed, &ctx());
    assert_eq!(d1, d2);
    assert_eq!(
        d1.backends[&backends(&["10.244.1.1"])[0]],
        lb_common::backend::flags::LOCAL,
        "local if any Service says so; terminating only if all do"
    );
}

fn v6_ctx() -> NodeContext {
    NodeContext {
        nodeport_addresses: vec![ip("192.168.1.10"), ip("2001:db8::10"), ip("2001:db8:1::10")],
        node_ips: vec![ip("192.168.1.10"), ip("2001:db8::10")],
        ..ctx()
    }
}

/// kube-proxy's proxier of a family serves NodePorts on that family's node addresses only
/// (`NewNodePortAddresses(family, ...)`), and localhost NodePorts on 127.0.0.1 only.
#[test]
fn nodeports_are_served_on_node_addresses_of_the_ports_family() {
    let eps4 = [ep("10.244.1.1", true)];
    let mut s4 = svc("web");
    s4.node_port = Some(30080);
    let (d, problems) = plan(&[(s4, cat(&eps4, &eps4, true))], &v6_ctx());
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(
        d.frontends.keys().copied().collect::<Vec<_>>(),
        vec![
            fe("10.96.0.10", 80),
            fe("127.0.0.1", 30080),
            fe("192.168.1.10", 30080),
        ]
    );

    let mut eps6 = [ep("10.0.0.0", true)];
    eps6[0].ip = ip("fd00:10:244::5");
    let mut s6 = service_port("ns", "web", "http", "fd00:10:96::10");
    s6.node_port = Some(30080);
    let (d, problems) = plan(&[(s6.clone(), cat(&eps6, &eps6, true))], &v6_ctx());
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(
        d.frontends.keys().copied().collect::<Vec<_>>(),
        vec![
            fe("2001:db8::10", 30080),
            fe("2001:db8:1::10", 30080),
            fe("fd00:10:96::10", 80),
        ],
        "no ::1 NodePort: kube-proxy serves localhost NodePorts on IPv4 only"
    );
    for p in d.frontends.values() {
        assert_eq!(
            p.scopes[0].backends,
            vec![BackendAddr {
                addr: ip("fd00:10:244::5"),
                port: 8080,
                proto: Protocol::Tcp
            }]
        );
    }
    assert_eq!(
        d.frontends[&fe("2001:db8::10", 30080)].kind,
        FrontendKind::NodePort
    );
    assert_eq!(fe("2001:db8::10", 30080).to_string(), "[2001:db8::10]:30080/TCP");
    // A node without IPv6 NodePort addresses serves the IPv6 cluster IP only.
    let (d, _) = plan(&[(s6, cat(&eps6, &eps6, true))], &ctx());
    assert_eq!(
        d.frontends.keys().copied().collect::<Vec<_>>(),
        vec![fe("fd00:10:96::10", 80)]
    );
}

/// Each family's proxier has its own local-traffic detector (`--cluster-cidr` of the family).
#[test]
fn cluster_ip_masquerade_follows_the_familys_detector() {
    let eps4 = [ep("10.244.1.1", true)];
    let mut eps6 = [ep("10.0.0.0", true)];
    eps6[0].ip = ip("fd00:10:244::5");
    let s6 = service_port("ns", "web6", "http", "fd00:10:96::10");
    let mut c = ctx();
    c.detect_local = PerFamily { v4: false, v6: true };
    let (d, _) = plan(
        &[
            (svc("web"), cat(&eps4, &eps4, true)),
            (s6, cat(&eps6, &eps6, true)),
        ],
        &c,
    );
    let off_cluster = |f: Frontend| d.frontends[&f].scopes[0].flags & flags::MASQUERADE_OFF_CLUSTER;
    assert_eq!(off_cluster(fe("10.96.0.10", 80)), 0);
    assert_ne!(off_cluster(fe("fd00:10:96::10", 80)), 0);
}

/// `allowFromNode`: an IPv6 source range containing the node's IPv6 IP admits the node (and
/// traffic sourced from the LB IP); the node's IPv4 IP does not count for IPv6 ranges.
#[test]
fn ipv6_load_balancer_source_ranges() {
    let mut eps6 = [ep("10.0.0.0", true)];
    eps6[0].ip = ip("fd00:10:244::5");
    let mut s = service_port("ns", "web", "http", "fd00:10:96::10");
    s.load_balancer_ips = vec![ip("2001:db8:ff::7")];
    s.load_balancer_source_ranges = vec!["2001:db8:aa::/48".parse().unwrap()];
    let (d, _) = plan(&[(s.clone(), cat(&eps6, &eps6, true))], &v6_ctx());
    let p = &d.frontends[&fe("2001:db8:ff::7", 80)];
    assert_ne!(p.scopes[0].flags & flags::SOURCE_RANGES, 0);
    assert_eq!(p.scopes[0].flags & flags::SOURCE_RANGES_ALLOW_NODE, 0);
    assert_eq!(
        p.source_ranges,
        vec!["2001:db8:aa::/48".parse::<IpNet>().unwrap()]
    );

    s.load_balancer_source_ranges
        .push("2001:db8::/64".parse().unwrap());
    let (d, _) = plan(&[(s, cat(&eps6, &eps6, true))], &v6_ctx());
    let p = &d.frontends[&fe("2001:db8:ff::7", 80)];
    assert_ne!(p.scopes[0].flags & flags::SOURCE_RANGES_ALLOW_NODE, 0);
    assert!(p.source_ranges.contains(&"2001:db8:ff::7/128".parse().unwrap()));
}

mod from_objects {
    //! One Service planned from its API objects ([`ServicePlan::compute`]), in both families.

    use k8s_openapi::{
        api::{
            core::v1::{Service, ServicePort, ServiceSpec},
            discovery::v1::{Endpoint as SliceEndpoint, EndpointPort, EndpointSlice},
        },
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;
    use crate::{
        model::Problem,
        node::NodeInfo,
        watch::{LABEL_SERVICE_NAME, Slice},
    };

    /// A LoadBalancer Service `ns/web` with NodePort 30080, externalTrafficPolicy Local and
    /// health-check NodePort 31000, of the given families.
    fn service(cluster_ips: &[&str], families: &[&str]) -> Service {
        let strings = |v: &[&str]| Some(v.iter().map(|s| (*s).to_owned()).collect());
        Service {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                type_: Some("LoadBalancer".into()),
                cluster_ip: cluster_ips.first().map(|s| (*s).to_owned()),
                cluster_ips: strings(cluster_ips),
                ip_families: strings(families),
                external_traffic_policy: Some("Local".into()),
                health_check_node_port: Some(31000),
                ports: Some(vec![ServicePort {
                    name: Some("http".into()),
                    port: 80,
                    node_port: Some(30080),
                    protocol: Some("TCP".into()),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            status: None,
        }
    }

    /// An EndpointSlice of `ns/web` of `address_type`: (address, node name) at port 8080.
    fn endpoint_slice(name: &str, address_type: &str, endpoints: &[(&str, &str)]) -> Slice {
        Slice::from(&EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                labels: Some([(LABEL_SERVICE_NAME.to_owned(), "web".to_owned())].into()),
                ..Default::default()
            },
            address_type: address_type.into(),
            endpoints: Some(
                endpoints
                    .iter()
                    .map(|(address, node)| SliceEndpoint {
                        addresses: vec![(*address).into()],
                        node_name: Some((*node).into()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ports: Some(vec![EndpointPort {
                name: Some("http".into()),
                port: Some(8080),
                protocol: Some("TCP".into()),
                app_protocol: None,
            }]),
        })
    }

    fn me() -> NodeInfo {
        NodeInfo {
            name: "me".into(),
            zone: None,
        }
    }

    fn slices() -> [Slice; 2] {
        [
            endpoint_slice("web-v4", "IPv4", &[("10.244.1.1", "me"), ("10.244.2.2", "other")]),
            endpoint_slice("web-v6", "IPv6", &[("fd00:10:244:2::2", "other")]),
        ]
    }

    fn compute(svc: &Service, ctx: &NodeContext) -> (ServicePlan, DesiredState) {
        let slices = slices();
        let refs: Vec<&Slice> = slices.iter().collect();
        let unit = ServicePlan::compute("ns", "web", svc, &refs, &me(), ctx);
        let (desired, conflicts) = merge(&unit.ports);
        assert!(conflicts.is_empty(), "{conflicts:?}");
        (unit, desired)
    }

    /// A dual-stack Service is planned by both families' rules, under one port name: each
    /// family's frontends use that family's endpoints, and NodePorts are on that family's node
    /// addresses.
    #[test]
    fn a_dual_stack_nodeport_service_has_frontends_in_both_families() {
        let svc = service(&["10.96.0.10", "fd00:10:96::10"], &["IPv4", "IPv6"]);
        let (unit, d) = compute(&svc, &v6_ctx());
        assert!(unit.problems.is_empty(), "{:?}", unit.problems);
        assert_eq!(unit.ports.len(), 2, "one port per family");
        assert_eq!(unit.endpoints, 3);
        assert_eq!(
            d.frontends.keys().copied().collect::<Vec<_>>(),
            vec![
                fe("10.96.0.10", 80),
                fe("127.0.0.1", 30080),
                fe("192.168.1.10", 30080),
                fe("2001:db8::10", 30080),
                fe("2001:db8:1::10", 30080),
                fe("fd00:10:96::10", 80),
            ]
        );
        for (f, p) in &d.frontends {
            assert_eq!(p.service.to_string(), "ns/web:http");
            for b in p.backends() {
                assert_eq!(IpFamily::of(&b.addr), IpFamily::of(&f.addr), "{f} -> {b}");
            }
        }
        // ETP Local: IPv4 has a local endpoint, IPv6 has none and drops external traffic.
        let ext = |f: Frontend| d.frontends[&f].scopes[0].clone();
        assert_eq!(ext(fe("192.168.1.10", 30080)).backends.len(), 1);
        let v6 = ext(fe("2001:db8::10", 30080));
        assert!(v6.backends.is_empty());
        assert_ne!(v6.flags & flags::DROP_IF_EMPTY, 0);
        assert_eq!(unit.no_local_external, 1);
    }

    /// kube-proxy's health check servers are per family, each counting its own family's local
    /// ready endpoints.
    #[test]
    fn health_checks_are_per_family() {
        let svc = service(&["fd00:10:96::10", "10.96.0.10"], &["IPv6", "IPv4"]);
        let (unit, _) = compute(&svc, &v6_ctx());
        let name = crate::model::test_support::port_name("ns", "web", "http", Protocol::Tcp);
        assert_eq!(
            unit.health_checks,
            vec![
                HealthCheck {
                    family: IpFamily::V4,
                    node_port: 31000,
                    service: name.clone(),
                    local_ready: 1,
                },
                HealthCheck {
                    family: IpFamily::V6,
                    node_port: 31000,
                    service: name,
                    local_ready: 0,
                },
            ]
        );
        // Single-stack: one health check, of its family.
        let (unit, _) = compute(&service(&["fd00:10:96::10"], &["IPv6"]), &v6_ctx());
        assert_eq!(unit.health_checks.len(), 1);
        assert_eq!(unit.health_checks[0].family, IpFamily::V6);
    }

    /// A family the node does not serve (IPv6 off): a dual-stack Service is served in IPv4 as a
    /// single-stack kube-proxy would; an IPv6-only Service is reported.
    #[test]
    fn a_family_the_node_does_not_serve() {
        let mut ctx = v6_ctx();
        ctx.serves.v6 = false;
        let (unit, d) = compute(
            &service(&["10.96.0.10", "fd00:10:96::10"], &["IPv4", "IPv6"]),
            &ctx,
        );
        assert!(unit.problems.is_empty(), "{:?}", unit.problems);
        assert!(
            d.frontends.keys().all(|f| f.addr.is_ipv4()),
            "{:?}",
            d.frontends.keys()
        );
        assert_eq!(unit.health_checks.len(), 1);

        let (unit, d) = compute(&service(&["fd00:10:96::10"], &["IPv6"]), &ctx);
        assert!(d.frontends.is_empty());
        assert!(unit.health_checks.is_empty());
        let messages: Vec<&Problem> = unit.problems.iter().collect();
        assert_eq!(messages.len(), 1, "{messages:?}");
        assert!(
            messages[0].message.contains("IPv6 is off on node me"),
            "{messages:?}"
        );
    }
}

/// A hostNetwork endpoint at one of the node's addresses, the node IP or another interface's,
/// is flagged `HOST` (tc delivers it locally, unmasqueraded); a pod's address is not, whatever
/// its node.
#[test]
fn endpoints_at_the_nodes_own_addresses_are_flagged_host() {
    let mut a = svc("alpha");
    a.cluster_ips = vec![ip("10.96.0.11")];
    let eps = [
        ep("192.168.2.10", true),
        ep("192.168.1.10", true),
        ep("10.244.1.1", true),
    ];
    let (d, _) = plan(&[(a, cat(&eps, &[], true))], &ctx());
    let flags_of = |addr: &str| d.backends[&backends(&[addr])[0]];
    let (local, host) = (lb_common::backend::flags::LOCAL, lb_common::backend::flags::HOST);
    assert_eq!(
        flags_of("192.168.2.10"),
        local | host,
        "another interface's address"
    );
    assert_eq!(flags_of("192.168.1.10"), local | host, "the node IP");
    assert_eq!(flags_of("10.244.1.1"), local, "a pod");
}
