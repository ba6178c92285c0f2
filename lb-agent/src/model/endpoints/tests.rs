use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, Ipv6Addr},
};

use k8s_openapi::{
    api::discovery::v1::{EndpointConditions, EndpointHints, EndpointPort, ForNode, ForZone},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::*;
use crate::model::test_support::port_name;
use crate::{
    model::Protocol,
    watch::{LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME, SliceHints, SlicePort},
};

// The cases are written as API objects, as upstream's; the model reads them compacted, as
// the agent keeps them.
type SliceEndpoint = k8s_openapi::api::discovery::v1::Endpoint;

fn compact(slices: &[&EndpointSlice]) -> Vec<Slice> {
    slices.iter().map(|s| Slice::from(*s)).collect()
}

/// The IPv4 proxier's view, which most cases are about.
fn endpoints_by_port(
    namespace: &str,
    service: &str,
    slices: &[&EndpointSlice],
    node: &NodeInfo,
) -> BTreeMap<ServicePortName, Vec<Endpoint>> {
    endpoints_by_port_with_problems(namespace, service, slices, node).0
}

fn endpoints_by_port_with_problems(
    namespace: &str,
    service: &str,
    slices: &[&EndpointSlice],
    node: &NodeInfo,
) -> (BTreeMap<ServicePortName, Vec<Endpoint>>, Vec<SliceError>) {
    endpoints_in(IpFamily::V4, namespace, service, slices, node)
}

/// The view of `family`'s proxier.
fn endpoints_in(
    family: IpFamily,
    namespace: &str,
    service: &str,
    slices: &[&EndpointSlice],
    node: &NodeInfo,
) -> (BTreeMap<ServicePortName, Vec<Endpoint>>, Vec<SliceError>) {
    let compacted = compact(slices);
    let refs: Vec<&Slice> = compacted.iter().collect();
    super::endpoints_by_port_with_problems(namespace, service, &refs, node, family)
}

fn slice_is_proxied(slice: &EndpointSlice) -> bool {
    super::slice_is_proxied(&Slice::from(slice), IpFamily::V4)
}

fn slice_service_name(slice: &EndpointSlice) -> Result<(String, String), SliceError> {
    super::slice_service_name(&Slice::from(slice))
}

fn node(name: &str) -> NodeInfo {
    NodeInfo {
        name: name.to_owned(),
        zone: Some("zone-a".to_owned()),
    }
}

fn slice(name: &str, service: &str, namespace: &str) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some([(LABEL_SERVICE_NAME.to_owned(), service.to_owned())].into()),
            ..Default::default()
        },
        address_type: "IPv4".to_owned(),
        endpoints: Some(vec![]),
        ports: Some(vec![]),
    }
}

fn slice_port(name: Option<&str>, port: Option<i32>, protocol: Option<&str>) -> EndpointPort {
    EndpointPort {
        name: name.map(str::to_owned),
        port,
        protocol: protocol.map(str::to_owned),
        app_protocol: None,
    }
}

/// An EndpointSlice endpoint builder: `ep("10.0.0.1")` has nil conditions.
fn ep(address: &str) -> SliceEndpoint {
    SliceEndpoint {
        addresses: vec![address.to_owned()],
        ..Default::default()
    }
}

trait EpExt {
    fn conditions(self, ready: Option<bool>, serving: Option<bool>, terminating: Option<bool>) -> Self;
    fn node(self, name: &str) -> Self;
    fn zone(self, zone: &str) -> Self;
    fn hints(self, zones: &[&str], nodes: &[&str]) -> Self;
}

impl EpExt for SliceEndpoint {
    fn conditions(mut self, ready: Option<bool>, serving: Option<bool>, terminating: Option<bool>) -> Self {
        self.conditions = Some(EndpointConditions {
            ready,
            serving,
            terminating,
        });
        self
    }
    fn node(mut self, name: &str) -> Self {
        self.node_name = Some(name.to_owned());
        self
    }
    fn zone(mut self, zone: &str) -> Self {
        self.zone = Some(zone.to_owned());
        self
    }
    fn hints(mut self, zones: &[&str], nodes: &[&str]) -> Self {
        self.hints = Some(EndpointHints {
            for_zones: Some(
                zones
                    .iter()
                    .map(|z| ForZone {
                        name: (*z).to_owned(),
                    })
                    .collect(),
            ),
            for_nodes: Some(
                nodes
                    .iter()
                    .map(|n| ForNode {
                        name: (*n).to_owned(),
                    })
                    .collect(),
            ),
        });
        self
    }
}

/// Upstream `generateEndpointSliceWithOffset` (endpointslicecache_test.go): endpoints
/// 10.0.{offset}.{1..=n}; `i % unready_mod == 0` -> not serving; `i % terminating_mod == 0`
/// -> terminating; ready = serving && !terminating; nodeName `hosts[i % len]`; ports
/// `port-{i}`/TCP.
#[allow(clippy::too_many_arguments)]
fn generate_slice_with_offset(
    service: &str,
    namespace: &str,
    slice_num: u32,
    offset: u32,
    num_endpoints: u32,
    unready_mod: u32,
    terminating_mod: u32,
    hosts: &[&str],
    port_nums: &[Option<i32>],
) -> EndpointSlice {
    let mut s = slice(&format!("{service}-{slice_num}"), service, namespace);
    s.ports = Some(
        port_nums
            .iter()
            .enumerate()
            .map(|(i, p)| slice_port(Some(&format!("port-{i}")), *p, Some("TCP")))
            .collect(),
    );
    s.endpoints = Some(
        (1..=num_endpoints)
            .map(|i| {
                let ready = i % unready_mod != 0;
                let terminating = i % terminating_mod == 0;
                let mut e = ep(&format!("10.0.{offset}.{i}")).conditions(
                    Some(ready && !terminating),
                    Some(ready),
                    Some(terminating),
                );
                if !hosts.is_empty() {
                    e = e.node(hosts[i as usize % hosts.len()]);
                }
                e
            })
            .collect(),
    );
    s
}

#[allow(clippy::too_many_arguments)]
fn generate_slice(
    service: &str,
    namespace: &str,
    slice_num: u32,
    num_endpoints: u32,
    unready_mod: u32,
    terminating_mod: u32,
    hosts: &[&str],
    port_nums: &[Option<i32>],
) -> EndpointSlice {
    generate_slice_with_offset(
        service,
        namespace,
        slice_num,
        slice_num,
        num_endpoints,
        unready_mod,
        terminating_mod,
        hosts,
        port_nums,
    )
}

fn spn(port: &str, protocol: Protocol) -> ServicePortName {
    port_name("ns1", "svc1", port, protocol)
}

/// An expected endpoint, in upstream's terms: "ip:port", isLocal, ready, serving, terminating.
type Want = (&'static str, bool, bool, bool, bool);

fn summary(eps: &[Endpoint]) -> Vec<(String, bool, bool, bool, bool)> {
    eps.iter()
        .map(|e| {
            (
                format!("{}:{}", e.ip, e.port),
                e.is_local,
                e.ready,
                e.serving,
                e.terminating,
            )
        })
        .collect()
}

fn sorted_wants(want: &[Want]) -> Vec<(String, bool, bool, bool, bool)> {
    let mut v: Vec<_> = want
        .iter()
        .map(|(a, l, r, s, t)| ((*a).to_owned(), *l, *r, *s, *t))
        .collect();
    v.sort_by_key(|(a, ..)| {
        let (ip, port) = a.split_once(':').unwrap();
        (ip.parse::<IpAddr>().unwrap(), port.parse::<u16>().unwrap())
    });
    v
}

/// Upstream `TestEndpointsMapFromESC` and `TestEndpointInfoByServicePort`, case for case.
#[test]
fn endpoints_map_from_esc() {
    const R: (bool, bool, bool) = (true, true, false); // ready, serving, not terminating
    type Expected = Vec<(&'static str, Vec<Want>)>;
    let w = |a: &'static str, local: bool, (r, s, t): (bool, bool, bool)| (a, local, r, s, t);
    let cases: Vec<(&str, &str, Vec<EndpointSlice>, Expected)> = vec![
        (
            "1 slice, 2 hosts, ports 80,443",
            "host1",
            vec![generate_slice(
                "svc1",
                "ns1",
                1,
                3,
                999,
                999,
                &["host1", "host2"],
                &[Some(80), Some(443)],
            )],
            vec![
                (
                    "port-0",
                    vec![
                        w("10.0.1.1:80", false, R),
                        w("10.0.1.2:80", true, R),
                        w("10.0.1.3:80", false, R),
                    ],
                ),
                (
                    "port-1",
                    vec![
                        w("10.0.1.1:443", false, R),
                        w("10.0.1.2:443", true, R),
                        w("10.0.1.3:443", false, R),
                    ],
                ),
            ],
        ),
        (
            "2 slices, same port",
            "",
            vec![
                generate_slice("svc1", "ns1", 1, 3, 999, 999, &[], &[Some(80)]),
                generate_slice("svc1", "ns1", 2, 3, 999, 999, &[], &[Some(80)]),
            ],
            vec![(
                "port-0",
                vec![
                    w("10.0.1.1:80", false, R),
                    w("10.0.1.2:80", false, R),
                    w("10.0.1.3:80", false, R),
                    w("10.0.2.1:80", false, R),
                    w("10.0.2.2:80", false, R),
                    w("10.0.2.3:80", false, R),
                ],
            )],
        ),
        (
            // Both slices are named svc1-1: the second replaces the first.
            "2 overlapping slices, same port",
            "",
            vec![
                generate_slice("svc1", "ns1", 1, 3, 999, 999, &[], &[Some(80)]),
                generate_slice("svc1", "ns1", 1, 4, 999, 999, &[], &[Some(80)]),
            ],
            vec![(
                "port-0",
                vec![
                    w("10.0.1.1:80", false, R),
                    w("10.0.1.2:80", false, R),
                    w("10.0.1.3:80", false, R),
                    w("10.0.1.4:80", false, R),
                ],
            )],
        ),
        (
            "2 slices, overlapping endpoints, some endpoints unready in 1 or both",
            "",
            vec![
                generate_slice("svc1", "ns1", 1, 10, 3, 999, &[], &[Some(80)]),
                generate_slice("svc1", "ns1", 1, 10, 6, 999, &[], &[Some(80)]),
            ],
            vec![(
                "port-0",
                (1..=10)
                    .map(|i| {
                        let a: &'static str = format!("10.0.1.{i}:80").leak();
                        if i == 6 {
                            w(a, false, (false, false, false))
                        } else {
                            w(a, false, R)
                        }
                    })
                    .collect(),
            )],
        ),
        (
            "2 slices, overlapping endpoints, some endpoints unready and some endpoints terminating",
            "",
            vec![
                generate_slice("svc1", "ns1", 1, 10, 3, 5, &[], &[Some(80)]),
                generate_slice("svc1", "ns1", 1, 10, 6, 5, &[], &[Some(80)]),
            ],
            vec![(
                "port-0",
                (1..=10)
                    .map(|i| {
                        let a: &'static str = format!("10.0.1.{i}:80").leak();
                        match i {
                            5 | 10 => w(a, false, (false, true, true)),
                            6 => w(a, false, (false, false, false)),
                            _ => w(a, false, R),
                        }
                    })
                    .collect(),
            )],
        ),
        (
            "2 slices, overlapping endpoints, all unready",
            "",
            vec![
                generate_slice("svc1", "ns1", 1, 10, 1, 999, &[], &[Some(80)]),
                generate_slice("svc1", "ns1", 1, 10, 1, 999, &[], &[Some(80)]),
            ],
            vec![(
                "port-0",
                (1..=10)
                    .map(|i| w(format!("10.0.1.{i}:80").leak(), false, (false, false, false)))
                    .collect(),
            )],
        ),
        (
            "3 slices with different services and namespaces",
            "",
            vec![
                generate_slice("svc1", "ns1", 1, 3, 999, 999, &[], &[Some(80)]),
                generate_slice("svc2", "ns1", 2, 3, 999, 999, &[], &[Some(80)]),
                generate_slice("svc1", "ns2", 3, 3, 999, 999, &[], &[Some(80)]),
            ],
            vec![(
                "port-0",
                vec![
                    w("10.0.1.1:80", false, R),
                    w("10.0.1.2:80", false, R),
                    w("10.0.1.3:80", false, R),
                ],
            )],
        ),
        (
            "Nil port should not break anything",
            "host1",
            vec![generate_slice(
                "svc1",
                "ns1",
                1,
                3,
                999,
                999,
                &["host1", "host2"],
                &[None],
            )],
            vec![],
        ),
        (
            "Different endpoints with duplicate IPs should not be filtered",
            "host1",
            vec![
                generate_slice_with_offset(
                    "svc1",
                    "ns1",
                    1,
                    1,
                    2,
                    999,
                    999,
                    &["host1", "host2"],
                    &[Some(80)],
                ),
                generate_slice_with_offset(
                    "svc1",
                    "ns1",
                    2,
                    1,
                    2,
                    999,
                    999,
                    &["host1", "host2"],
                    &[Some(8080)],
                ),
            ],
            vec![(
                "port-0",
                vec![
                    w("10.0.1.1:80", false, R),
                    w("10.0.1.1:8080", false, R),
                    w("10.0.1.2:80", true, R),
                    w("10.0.1.2:8080", true, R),
                ],
            )],
        ),
    ];
    for (name, host, slices, expected) in cases {
        let refs: Vec<&EndpointSlice> = slices.iter().collect();
        let got = endpoints_by_port(
            "ns1",
            "svc1",
            &refs,
            &NodeInfo {
                name: host.into(),
                zone: None,
            },
        );
        let got: Vec<_> = got.iter().map(|(k, v)| (k.clone(), summary(v))).collect();
        let want: Vec<_> = expected
            .iter()
            .map(|(p, eps)| (spn(p, Protocol::Tcp), sorted_wants(eps)))
            .collect();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn ports_matched_by_name_and_protocol() {
    let mut s = slice("svc1-abc", "svc1", "ns1");
    s.ports = Some(vec![
        slice_port(Some("http"), Some(8080), Some("TCP")),
        slice_port(Some("https"), Some(8443), Some("TCP")),
        slice_port(Some("dns"), Some(53), Some("UDP")),
        slice_port(Some("dns"), Some(53), None), // protocol defaults to TCP
        slice_port(None, Some(9000), Some("SCTP")), // name defaults to ""
    ]);
    s.endpoints = Some(vec![ep("10.0.0.1")]);
    let got = endpoints_by_port("ns1", "svc1", &[&s], &node("n1"));
    let keys: Vec<_> = got.iter().map(|(k, v)| (k.clone(), v[0].port)).collect();
    assert_eq!(
        keys,
        vec![
            (spn("", Protocol::Sctp), 9000),
            (spn("dns", Protocol::Tcp), 53),
            (spn("dns", Protocol::Udp), 53),
            (spn("http", Protocol::Tcp), 8080),
            (spn("https", Protocol::Tcp), 8443),
        ]
    );
}

#[test]
fn endpoint_fields_and_conditions() {
    let mut s = slice("svc1-abc", "svc1", "ns1");
    s.ports = Some(vec![slice_port(Some(""), Some(80), Some("TCP"))]);
    s.endpoints = Some(vec![
        // nil conditions: ready, serving, not terminating
        ep("10.0.0.1")
            .node("n1")
            .zone("zone-a")
            .hints(&["zone-a"], &["n1"]),
        SliceEndpoint {
            conditions: None,
            ..ep("10.0.0.2").node("n2")
        },
        ep("10.0.0.3").conditions(Some(false), None, None),
        ep("10.0.0.4").conditions(Some(false), Some(true), Some(true)),
        ep("10.0.0.5").conditions(Some(false), Some(false), Some(true)),
        ep("10.0.0.6").conditions(Some(true), Some(true), Some(false)),
    ]);
    let got = endpoints_by_port("ns1", "svc1", &[&s], &node("n1"));
    let eps = &got[&spn("", Protocol::Tcp)];
    assert_eq!(
        eps[0],
        Endpoint {
            ip: "10.0.0.1".parse().unwrap(),
            port: 80,
            ready: true,
            serving: true,
            terminating: false,
            is_local: true,
            node_name: Some("n1".into()),
            zone: Some("zone-a".into()),
            zone_hints: BTreeSet::from(["zone-a".to_owned()]),
            node_hints: BTreeSet::from(["n1".to_owned()]),
        }
    );
    let flags: Vec<_> = eps
        .iter()
        .map(|e| (e.is_local, e.ready, e.serving, e.terminating))
        .collect();
    assert_eq!(
        flags,
        vec![
            (true, true, true, false),
            (false, true, true, false),
            (false, false, true, false),
            (false, false, true, true),
            (false, false, false, true),
            (false, true, true, false),
        ]
    );
    // No node name: nobody is local (upstream `isLocal` requires a non-empty host name).
    let mut s2 = s.clone();
    s2.endpoints = Some(vec![
        ep("10.0.0.1"),
        SliceEndpoint {
            node_name: Some(String::new()),
            ..ep("10.0.0.2")
        },
    ]);
    let got = endpoints_by_port("ns1", "svc1", &[&s2], &NodeInfo::default());
    assert!(got[&spn("", Protocol::Tcp)].iter().all(|e| !e.is_local));
}

/// `addEndpoints`: a later copy replaces an earlier one unless it is terminating.
#[test]
fn duplicate_endpoints_across_slices() {
    let mk = |name: &str, e: SliceEndpoint| {
        let mut s = slice(name, "svc1", "ns1");
        s.ports = Some(vec![slice_port(Some("http"), Some(80), Some("TCP"))]);
        s.endpoints = Some(vec![e]);
        s
    };
    let running = || {
        ep("10.0.0.1")
            .conditions(Some(true), Some(true), Some(false))
            .node("new")
    };
    let terminating = || {
        ep("10.0.0.1")
            .conditions(Some(false), Some(true), Some(true))
            .node("old")
    };
    // Whatever the slice (name) order, the running copy wins over the terminating one.
    for (a, b) in [("a", "b"), ("b", "a")] {
        let s1 = mk(a, running());
        let s2 = mk(b, terminating());
        for slices in [[&s1, &s2], [&s2, &s1]] {
            let got = endpoints_by_port("ns1", "svc1", &slices, &node("new"));
            let eps = &got[&spn("http", Protocol::Tcp)];
            assert_eq!(eps.len(), 1);
            assert!(eps[0].ready && eps[0].is_local && !eps[0].terminating, "{a} {b}");
        }
    }
    // Two non-terminating copies: the slice later in name order wins, whatever the input order.
    let s1 = mk(
        "a",
        ep("10.0.0.1").conditions(Some(true), None, None).zone("zone-a"),
    );
    let s2 = mk(
        "b",
        ep("10.0.0.1").conditions(Some(false), None, None).zone("zone-b"),
    );
    for slices in [[&s1, &s2], [&s2, &s1]] {
        let got = endpoints_by_port("ns1", "svc1", &slices, &node("n"));
        let eps = &got[&spn("http", Protocol::Tcp)];
        assert_eq!(eps.len(), 1);
        assert_eq!(eps[0].zone.as_deref(), Some("zone-b"));
    }
    // Two terminating copies: the first one stays.
    let s1 = mk(
        "a",
        ep("10.0.0.1")
            .conditions(Some(false), Some(true), Some(true))
            .zone("zone-a"),
    );
    let s2 = mk(
        "b",
        ep("10.0.0.1")
            .conditions(Some(false), Some(false), Some(true))
            .zone("zone-b"),
    );
    let got = endpoints_by_port("ns1", "svc1", &[&s2, &s1], &node("n"));
    assert_eq!(
        got[&spn("http", Protocol::Tcp)][0].zone.as_deref(),
        Some("zone-a")
    );
}

#[test]
fn slices_kube_proxy_ignores() {
    let mk = |name: &str, address_type: &str, address: &str| {
        let mut s = slice(name, "svc1", "ns1");
        s.address_type = address_type.to_owned();
        s.ports = Some(vec![slice_port(Some("http"), Some(80), Some("TCP"))]);
        s.endpoints = Some(vec![ep(address)]);
        s
    };
    let v4 = mk("v4", "IPv4", "10.0.0.1");
    let v6 = mk("v6", "IPv6", "fd00::1");
    let fqdn = mk("fqdn", "FQDN", "example.com");
    let mut proxy_name = mk("proxy-name", "IPv4", "10.0.0.2");
    proxy_name
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(LABEL_SERVICE_PROXY_NAME.into(), "other".into());
    let mut headless = mk("headless", "IPv4", "10.0.0.3");
    headless
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(LABEL_HEADLESS.into(), String::new());
    let mut unlabelled = mk("unlabelled", "IPv4", "10.0.0.4");
    unlabelled.metadata.labels = None;
    let mut other_ns = mk("other-ns", "IPv4", "10.0.0.5");
    other_ns.metadata.namespace = Some("ns2".into());

    let all = [&v4, &v6, &fqdn, &proxy_name, &headless, &unlabelled, &other_ns];
    let (got, problems) = endpoints_by_port_with_problems("ns1", "svc1", &all, &node("n"));
    let ips: Vec<_> = got.values().flatten().map(|e| e.ip.to_string()).collect();
    assert_eq!(ips, vec!["10.0.0.1"]);
    assert!(problems.is_empty(), "{problems:?}");
    assert!(!slice_is_proxied(&v6) && !slice_is_proxied(&fqdn) && !slice_is_proxied(&headless));
    // Only IPv6 slices: nothing.
    assert!(endpoints_by_port("ns1", "svc1", &[&v6], &node("n")).is_empty());
}

/// Regression: a slice labelled for the Service but without a namespace (or name) cannot be
/// tied to it; that used to be dropped silently, leaving the Service with no backends and
/// nothing reported.
#[test]
fn a_slice_that_cannot_be_tied_to_its_service_is_reported() {
    let mk = |name: &str| {
        let mut s = slice(name, "svc1", "ns1");
        s.ports = Some(vec![slice_port(Some("http"), Some(80), Some("TCP"))]);
        s.endpoints = Some(vec![ep("10.0.0.1")]);
        s
    };
    let mut no_ns = mk("svc1-a");
    no_ns.metadata.namespace = None;
    let mut no_name = mk("");
    no_name.metadata.name = None;
    let mut other = mk("other-a");
    other.metadata.namespace = None;
    other
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(LABEL_SERVICE_NAME.into(), "other".into());
    let (got, problems) =
        endpoints_by_port_with_problems("ns1", "svc1", &[&no_ns, &no_name, &other], &node("n"));
    assert!(got.is_empty());
    // One per slice labelled for svc1; not the slice of another Service.
    assert_eq!(
        problems,
        vec![SliceError::NoNameOrNamespace, SliceError::NoNameOrNamespace]
    );
}

#[test]
fn malformed_ports_and_endpoints_reported() {
    let mut s = slice("svc1-abc", "svc1", "ns1");
    s.ports = Some(vec![
        slice_port(Some("none"), None, Some("TCP")),
        slice_port(Some("zero"), Some(0), Some("TCP")),
        slice_port(Some("big"), Some(65536), Some("TCP")),
        slice_port(Some("icmp"), Some(7), Some("ICMP")),
        slice_port(Some("http"), Some(80), Some("TCP")),
    ]);
    s.endpoints = Some(vec![
        SliceEndpoint {
            addresses: vec![],
            ..Default::default()
        },
        ep("not-an-ip"),
        ep("fd00::1"),
        ep("010.000.000.001"), // ParseIPSloppy: 10.0.0.1
        SliceEndpoint {
            addresses: vec!["10.0.0.2".into(), "10.0.0.99".into()],
            ..Default::default()
        },
    ]);
    let (got, problems) = endpoints_by_port_with_problems("ns1", "svc1", &[&s], &node("n"));
    let eps: Vec<_> = got[&spn("http", Protocol::Tcp)]
        .iter()
        .map(|e| e.ip.to_string())
        .collect();
    assert_eq!(eps, vec!["10.0.0.1", "10.0.0.2"]);
    assert_eq!(got.len(), 1);
    let slice = || "svc1-abc".to_owned();
    assert_eq!(
        problems,
        vec![
            SliceError::NoAddress {
                slice: slice(),
                index: 0
            },
            SliceError::InvalidAddress {
                slice: slice(),
                index: 1,
                address: "not-an-ip".into(),
                family: IpFamily::V4,
            },
            SliceError::InvalidAddress {
                slice: slice(),
                index: 2,
                address: "fd00::1".into(),
                family: IpFamily::V4,
            },
            SliceError::InvalidPort {
                slice: slice(),
                index: 0
            },
            SliceError::InvalidPort {
                slice: slice(),
                index: 1
            },
            SliceError::InvalidPort {
                slice: slice(),
                index: 2
            },
            SliceError::UnsupportedProtocol {
                slice: slice(),
                index: 3,
                protocol: "ICMP".into()
            },
        ]
    );
}

#[test]
fn endpoints_at_special_addresses_are_reported_and_left_out() {
    let mut s = slice("svc1-abc", "svc1", "ns1");
    s.ports = Some(vec![slice_port(Some("http"), Some(80), Some("TCP"))]);
    s.endpoints = Some(vec![
        ep("127.0.0.1"),
        ep("0.0.0.0"),
        ep("224.0.0.1"),
        ep("169.254.1.1"),
        ep("255.255.255.255"),
        ep("10.244.1.2"),
    ]);
    let (got, problems) = endpoints_by_port_with_problems("ns1", "svc1", &[&s], &node("n"));
    let eps: Vec<_> = got[&spn("http", Protocol::Tcp)]
        .iter()
        .map(|e| e.ip.to_string())
        .collect();
    assert_eq!(eps, vec!["10.244.1.2"]);
    let indexes: Vec<usize> = problems
        .iter()
        .map(|p| match p {
            SliceError::SpecialAddress { index, .. } => *index,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(indexes, vec![0, 1, 2, 3, 4]);
    assert_eq!(
        problems[0].to_string(),
        "EndpointSlice svc1-abc: endpoints[0] address \"127.0.0.1\" is in the loopback range \
         (127.0.0.0/8), which an endpoint may not use; ignored"
    );
}

#[test]
fn sorted_numerically_and_empty_ports_left_out() {
    let mut s = slice("svc1-abc", "svc1", "ns1");
    s.ports = Some(vec![slice_port(Some("http"), Some(80), Some("TCP"))]);
    s.endpoints = Some(vec![
        ep("10.0.0.10"),
        ep("10.0.0.9"),
        ep("10.0.0.100"),
        ep("9.0.0.1"),
    ]);
    let got = endpoints_by_port("ns1", "svc1", &[&s], &node("n"));
    let ips: Vec<_> = got[&spn("http", Protocol::Tcp)]
        .iter()
        .map(|e| e.ip.to_string())
        .collect();
    assert_eq!(ips, vec!["9.0.0.1", "10.0.0.9", "10.0.0.10", "10.0.0.100"]);

    s.endpoints = Some(vec![]);
    assert!(endpoints_by_port("ns1", "svc1", &[&s], &node("n")).is_empty());
}

#[test]
fn same_named_slices_last_wins() {
    let mut old = slice("svc1-abc", "svc1", "ns1");
    old.ports = Some(vec![slice_port(Some("http"), Some(80), Some("TCP"))]);
    old.endpoints = Some(vec![ep("10.0.0.1")]);
    let mut new = old.clone();
    new.endpoints = Some(vec![ep("10.0.0.2")]);
    let got = endpoints_by_port("ns1", "svc1", &[&old, &new], &node("n"));
    let ips: Vec<_> = got.values().flatten().map(|e| e.ip.to_string()).collect();
    assert_eq!(ips, vec!["10.0.0.2"]);
}

/// `endpointSliceCacheKeys`.
#[test]
fn a_compacted_slice_keeps_what_the_model_reads() {
    let mut s = slice("svc1-1", "svc1", "ns1");
    let mut e = ep("10.0.0.1")
        .conditions(Some(false), Some(true), Some(true))
        .node("n1")
        .zone("zone-a")
        .hints(&["zone-a"], &["n1"]);
    e.addresses.push("10.0.0.2".into());
    e.hostname = Some("web-0".into());
    e.target_ref = Some(Default::default());
    s.endpoints = Some(vec![e, SliceEndpoint::default()]);
    s.ports = Some(vec![slice_port(Some("http"), Some(80), None)]);
    assert_eq!(
        Slice::from(&s),
        Slice {
            name: "svc1-1".into(),
            namespace: "ns1".into(),
            service_name: Some("svc1".into()),
            excluded: false,
            address_type: Some(IpFamily::V4),
            ports: vec![SlicePort {
                name: Some("http".into()),
                port: Some(80),
                protocol: None,
            }]
            .into(),
            endpoints: vec![
                super::SliceEndpoint {
                    address: Some(SliceAddress::V4(Ipv4Addr::new(10, 0, 0, 1))),
                    ready: Some(false),
                    serving: Some(true),
                    terminating: Some(true),
                    place: crate::watch::EndpointPlace::of(Some("n1"), Some("zone-a")),
                    hints: Some(Box::new(SliceHints {
                        zones: vec!["zone-a".into()].into(),
                        nodes: vec!["n1".into()].into(),
                    })),
                },
                super::SliceEndpoint::default(),
            ]
            .into(),
        }
    );
}

#[test]
fn slice_service_names() {
    let s = slice("svc1-abc", "svc1", "ns1");
    assert_eq!(slice_service_name(&s), Ok(("ns1".into(), "svc1".into())));
    let mut no_label = s.clone();
    no_label.metadata.labels = None;
    assert_eq!(
        slice_service_name(&no_label),
        Err(SliceError::NoServiceName {
            slice: "svc1-abc".into()
        })
    );
    let empty_label = slice("svc1-abc", "", "ns1");
    assert_eq!(
        slice_service_name(&empty_label),
        Err(SliceError::NoServiceName {
            slice: "svc1-abc".into()
        })
    );
    let mut no_ns = s.clone();
    no_ns.metadata.namespace = None;
    assert_eq!(slice_service_name(&no_ns), Err(SliceError::NoNameOrNamespace));
    let mut no_name = s;
    no_name.metadata.name = Some(String::new());
    assert_eq!(slice_service_name(&no_name), Err(SliceError::NoNameOrNamespace));
}

/// `EndpointsChangeTracker.EndpointSliceUpdate`: each proxier takes the slices of its own
/// `addressType`, so a dual-stack Service's IPv4 and IPv6 slices feed one family each, under the
/// same port names; FQDN slices feed neither.
#[test]
fn slices_feed_the_family_of_their_address_type() {
    let mk = |name: &str, address_type: &str, addresses: &[&str]| {
        let mut s = slice(name, "svc1", "ns1");
        s.address_type = address_type.to_owned();
        s.ports = Some(vec![slice_port(Some("http"), Some(8080), Some("TCP"))]);
        s.endpoints = Some(addresses.iter().map(|a| ep(a).node("n")).collect());
        s
    };
    let v4 = mk("svc1-v4", "IPv4", &["10.244.1.5"]);
    let v6 = mk("svc1-v6", "IPv6", &["fd00:10:244:1::5", "2001:db8::7"]);
    let fqdn = mk("svc1-fqdn", "FQDN", &["web.example.com"]);
    let all = [&v4, &v6, &fqdn];
    let ips = |family| {
        let (got, problems) = endpoints_in(family, "ns1", "svc1", &all, &node("n"));
        assert!(problems.is_empty(), "{family}: {problems:?}");
        assert_eq!(got.keys().collect::<Vec<_>>(), vec![&spn("http", Protocol::Tcp)]);
        got.values()
            .flatten()
            .map(|e| (e.ip.to_string(), e.port, e.is_local))
            .collect::<Vec<_>>()
    };
    assert_eq!(ips(IpFamily::V4), vec![("10.244.1.5".to_owned(), 8080, true)]);
    assert_eq!(
        ips(IpFamily::V6),
        vec![
            ("2001:db8::7".to_owned(), 8080, true),
            ("fd00:10:244:1::5".to_owned(), 8080, true),
        ]
    );
    for (s, v4_proxied, v6_proxied) in [(&v4, true, false), (&v6, false, true), (&fqdn, false, false)] {
        let compact = Slice::from(s);
        assert_eq!(
            super::slice_is_proxied(&compact, IpFamily::V4),
            v4_proxied,
            "{}",
            compact.name
        );
        assert_eq!(
            super::slice_is_proxied(&compact, IpFamily::V6),
            v6_proxied,
            "{}",
            compact.name
        );
    }
    // Only an IPv6 slice: nothing for IPv4, and the other way round.
    assert!(
        endpoints_in(IpFamily::V4, "ns1", "svc1", &[&v6], &node("n"))
            .0
            .is_empty()
    );
    assert!(
        endpoints_in(IpFamily::V6, "ns1", "svc1", &[&v4], &node("n"))
            .0
            .is_empty()
    );
    // The informers' label selector applies to IPv6 slices too.
    let mut headless = mk("svc1-h", "IPv6", &["fd00::9"]);
    headless
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(LABEL_HEADLESS.into(), String::new());
    assert!(!super::slice_is_proxied(&Slice::from(&headless), IpFamily::V6));
}

/// In an IPv6 slice, an address that is not IPv6 (ParseIPSloppy: an IPv4-mapped one is IPv4) or
/// is special is reported and left out; non-canonical IPv6 is parsed; endpoints are sorted
/// numerically.
#[test]
fn ipv6_endpoints_are_validated_and_sorted() {
    let mut s = slice("svc1-v6", "svc1", "ns1");
    s.address_type = "IPv6".into();
    s.ports = Some(vec![slice_port(Some("http"), Some(80), Some("TCP"))]);
    s.endpoints = Some(vec![
        ep("fd00::10"),
        ep("10.0.0.1"),
        ep("::ffff:10.0.0.2"),
        ep("::1"),
        ep("fe80::1"),
        ep("::"),
        ep("ff02::1"),
        ep("FD00:0:0::9"),
        ep("fd00::a"),
        ep("not-an-ip"),
    ]);
    let (got, problems) = endpoints_in(IpFamily::V6, "ns1", "svc1", &[&s], &node("n"));
    let eps: Vec<_> = got[&spn("http", Protocol::Tcp)]
        .iter()
        .map(|e| e.ip.to_string())
        .collect();
    assert_eq!(eps, vec!["fd00::9", "fd00::a", "fd00::10"]);
    let invalid = |index: usize, address: &str| SliceError::InvalidAddress {
        slice: "svc1-v6".into(),
        index,
        address: address.into(),
        family: IpFamily::V6,
    };
    assert_eq!(problems[0], invalid(1, "10.0.0.1"));
    assert_eq!(problems[1], invalid(2, "::ffff:10.0.0.2"));
    let special: Vec<usize> = problems
        .iter()
        .filter_map(|p| match p {
            SliceError::SpecialAddress { index, .. } => Some(*index),
            _ => None,
        })
        .collect();
    assert_eq!(special, vec![3, 4, 5, 6]);
    assert_eq!(problems.last(), Some(&invalid(9, "not-an-ip")));
    assert_eq!(problems.len(), 7);
    assert_eq!(
        problems[0].to_string(),
        "EndpointSlice svc1-v6: endpoints[1] address \"10.0.0.1\" is not an IPv6 address; ignored"
    );
}

#[test]
fn a_compacted_ipv6_slice() {
    let mut s = slice("svc1-v6", "svc1", "ns1");
    s.address_type = "IPv6".into();
    s.endpoints = Some(vec![ep("fd00::1"), ep("::ffff:10.0.0.1"), ep("FD00::2")]);
    let compact = Slice::from(&s);
    assert_eq!(compact.address_type, Some(IpFamily::V6));
    let addresses: Vec<_> = compact
        .endpoints
        .iter()
        .map(|e| e.address.clone().unwrap())
        .collect();
    assert_eq!(
        addresses,
        vec![
            SliceAddress::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1)),
            SliceAddress::Written("::ffff:10.0.0.1".into()),
            SliceAddress::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2)),
        ]
    );
    s.address_type = "FQDN".into();
    assert_eq!(Slice::from(&s).address_type, None);
}
