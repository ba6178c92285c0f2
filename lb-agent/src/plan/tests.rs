//! The plan against kube-proxy's documented behaviour, one case per rule.

use lb_common::service::{SCOPE_EXTERNAL, SCOPE_INTERNAL};

use super::*;
use crate::model::test_support::service_port;
use crate::{
    model::{CategorizedEndpoints, Endpoint, Protocol, ServicePortInfo},
    node::NodeContext,
};

fn ip(s: &str) -> Ipv4Addr {
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
        cluster_cidr_configured: false,
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
    c.cluster_cidr_configured = true;
    let (d, _) = plan(&[(svc("web"), cat(&eps, &eps, true))], &c);
    let f = d.frontends[&fe("10.96.0.10", 80)].scopes[0].flags;
    assert_ne!(f & flags::MASQUERADE_OFF_CLUSTER, 0);
    assert_eq!(f & flags::MASQUERADE, 0);
    c.masquerade_all = true;
    let (d, _) = plan(&[(svc("web"), cat(&eps, &eps, true))], &c);
    let f = d.frontends[&fe("10.96.0.10", 80)].scopes[0].flags;
    assert_ne!(f & flags::MASQUERADE, 0);
    c.masquerade_all = false;
    c.cluster_cidr_configured = false;
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
    assert_eq!(
        p.source_ranges,
        vec!["198.51.100.0/24".parse::<Ipv4Net>().unwrap()]
    );
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
            e.ip = Ipv4Addr::from(u32::from(ip("10.100.0.0")) + i as u32);
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
