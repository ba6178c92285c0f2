//! Property-based tests of the model on arbitrary API objects, hostile ones included: IPv4, IPv6
//! and dual-stack Services, slices of both families, invalid, wrong-family and special IPs, ports
//! 0, negative or huge, duplicate ports and names, names at and beyond the 63/253-byte limits,
//! unknown types, protocols and policies, random conditions and hints, slices of every address
//! type, thousands of (duplicate) endpoints. Whatever the input, the model must not panic and what
//! it returns must be well formed.
//!
//! The generators are shared with `plan::proptests` (planner, `plan::from_scratch`, map writer).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use k8s_openapi::{
    api::{
        core::v1::{
            ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, Node, NodeAddress, NodeStatus, Service,
            ServicePort, ServiceSpec, ServiceStatus, SessionAffinityConfig,
        },
        discovery::v1::{
            Endpoint as SliceEndpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice,
            ForNode, ForZone,
        },
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use proptest::{collection::vec, option, prelude::*, sample::select};

use super::{
    Endpoint, ServicePortInfo, categorize_endpoints, endpoints_by_port_with_problems, service_ports,
};
use crate::{
    family::IpFamily,
    node::NodeInfo,
    watch::{ClusterState, LABEL_SERVICE_NAME, Slice},
};

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// The IPv6 twin of an IPv4 address: `fd00::/96` with the IPv4 address as its last 32 bits. The
/// IPv6 pools are the twins of the IPv4 ones, so that IPv6 Services and endpoints collide as the
/// IPv4 ones do.
pub(crate) fn twin(ip: Ipv4Addr) -> Ipv6Addr {
    Ipv6Addr::from((0xfd00_u128 << 112) | u128::from(u32::from(ip)))
}

/// `text` with a plain IPv4 address replaced by its [`twin`] (for `IPv6`) or a twin by its IPv4
/// address (for `IPv4`); anything else is kept as written.
fn retarget_text(text: &str, family: IpFamily) -> String {
    match (family, text.parse::<IpAddr>()) {
        (IpFamily::V6, Ok(IpAddr::V4(v4))) => twin(v4).to_string(),
        (IpFamily::V4, Ok(IpAddr::V6(v6))) if u128::from(v6) >> 32 == 0xfd00_u128 << 80 => {
            Ipv4Addr::from(u128::from(v6) as u32).to_string()
        }
        _ => text.to_owned(),
    }
}

/// An IPv4 address from the small pools Services and endpoints are drawn from.
fn pooled_v4() -> impl Strategy<Value = Ipv4Addr> {
    prop_oneof![
        4 => (0u8..2, 0u8..6).prop_map(|(a, b)| Ipv4Addr::new(10, 96, a, b)),
        4 => (1u8..3, 0u8..8).prop_map(|(a, b)| Ipv4Addr::new(10, 244, a, b)),
        1 => (0u8..3).prop_map(|b| Ipv4Addr::new(192, 168, 1, 10 + b)),
    ]
}

/// An IP address as a user may write it: mostly valid IPv4 and IPv6 from small pools (so that
/// Services and endpoints collide), else anything: random IPv4 and IPv6, special addresses,
/// sloppy and non-canonical forms, garbage.
pub(crate) fn ip_text() -> impl Strategy<Value = String> {
    prop_oneof![
        9 => pooled_v4().prop_map(|ip| ip.to_string()),
        4 => pooled_v4().prop_map(|ip| twin(ip).to_string()),
        2 => any::<u32>().prop_map(|v| Ipv4Addr::from(v).to_string()),
        1 => any::<u128>().prop_map(|v| Ipv6Addr::from(v).to_string()),
        3 => select(strings(&[
            "0.0.0.0", "255.255.255.255", "127.0.0.1", "224.0.0.1", "169.254.169.254",
            "010.096.000.001", "10.96.0.1 ", " 10.96.0.1", "::ffff:10.96.0.1", "::ffff:127.0.0.1",
            "fd00::1", "::", "::1", "fe80::1", "ff02::1", "2001:db8::10", "2001:db8::11",
            "FD00::A60:1", "fd00:0:0:0:0:0:a60:1", "[fd00::a60:1]", "fd00::a60:1%eth0",
            "fd00::a60:1/128", "::10.96.0.1", "", "  ", "None", "1.2.3", "1.2.3.4.5",
            "256.1.1.1", "1.2.3.4/32", "-1.2.3.4", "0x0a.0.0.1", "10.96.0.1%eth0",
            "\u{ff11}.\u{ff12}.\u{ff13}.\u{ff14}", "1.2.3.0004", "00000000001.2.3.4",
        ])),
        1 => "\\PC{0,24}",
    ]
}

/// A CIDR as a user may write it.
fn cidr_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => (ip_text(), 0u8..40).prop_map(|(ip, p)| format!("{ip}/{p}")),
        2 => select(strings(&[
            "0.0.0.0/0", "10.0.0.0/8", " 192.168.0.0/16 ", "198.51.100.0/24", "fd00::/8", "::/0",
            "2001:db8::/32", " 2001:db8::/64 ", "fd00::c633:6400/120", "fd00::/96", "::ffff:10.0.0.0/104",
            "2001:db8::/129", "garbage", "1.2.3.4", "1.2.3.4/033", "1.2.3.4/", "1.2.3.4/-1", "1.2.3.4/ 8", "",
        ])),
    ]
}

/// A DNS-1123 name, or a hostile one: empty, at and beyond the 63- and 253-byte limits, random.
pub(crate) fn name_text() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => select(strings(&["web", "api", "dns"])),
        1 => Just(String::new()),
        1 => select(vec![62usize, 63, 64, 252, 253, 254, 1000]).prop_map(|n| "n".repeat(n)),
        1 => "[a-z0-9.-]{0,70}",
        1 => "\\PC{0,16}",
    ]
}

fn namespace_text() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        10 => select(strings(&["default", "ns1"])).prop_map(Some),
        1 => Just(None),
        1 => Just(Some(String::new())),
        1 => select(vec![63usize, 64]).prop_map(|n| Some("s".repeat(n))),
    ]
}

/// A port name (IANA_SVC_NAME: at most 15 bytes), or a hostile one.
fn port_name() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        8 => select(strings(&["http", "dns", ""])).prop_map(|s| (!s.is_empty()).then_some(s)),
        1 => Just(Some(String::new())),
        1 => select(vec![15usize, 16, 64]).prop_map(|n| Some("p".repeat(n))),
        1 => "\\PC{0,8}".prop_map(Some),
    ]
}

/// A port number: mostly a few valid ones (so that ports collide), else 0, negative, huge.
fn port_num() -> impl Strategy<Value = i32> {
    prop_oneof![
        8 => select(vec![80, 443, 53, 8080]),
        1 => select(vec![0, -1, 1, 65_535, 65_536, 100_000, i32::MAX, i32::MIN]),
        1 => any::<i32>(),
    ]
}

fn node_port_num() -> impl Strategy<Value = i32> {
    prop_oneof![
        6 => 30_000..30_004i32,
        1 => select(vec![0, -30_000, 1, 65_535, 65_536, 70_000, i32::MIN]),
        1 => any::<i32>(),
    ]
}

fn protocol() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        3 => Just(None),
        6 => select(strings(&["TCP", "UDP"])).prop_map(Some),
        1 => select(strings(&["SCTP", "tcp", "ICMP", "", "TCP "])).prop_map(Some),
    ]
}

fn service_port() -> impl Strategy<Value = ServicePort> {
    (port_name(), port_num(), protocol(), option::of(node_port_num())).prop_map(
        |(name, port, protocol, node_port)| ServicePort {
            name,
            port,
            protocol,
            node_port,
            ..Default::default()
        },
    )
}

fn labels() -> impl Strategy<Value = Option<BTreeMap<String, String>>> {
    prop_oneof![
        24 => Just(None),
        1 => Just(Some(BTreeMap::from([(
            crate::watch::LABEL_SERVICE_PROXY_NAME.to_owned(),
            "other-proxy".to_owned(),
        )]))),
        1 => Just(Some(BTreeMap::from([(crate::watch::LABEL_HEADLESS.to_owned(), String::new())]))),
    ]
}

fn ingress() -> impl Strategy<Value = LoadBalancerIngress> {
    (
        option::of(prop_oneof![
            3 => (0u8..3).prop_map(|b| format!("203.0.113.{b}")),
            2 => (0u8..3).prop_map(|b| twin(Ipv4Addr::new(203, 0, 113, b)).to_string()),
            1 => ip_text(),
        ]),
        option::of(select(strings(&["VIP", "Proxy", "Bogus", ""]))),
        option::of(select(strings(&["lb.example.com", ""]))),
    )
        .prop_map(|(ip, ip_mode, hostname)| LoadBalancerIngress {
            ip,
            ip_mode,
            hostname,
            ports: None,
        })
}

/// An arbitrary v1 Service.
pub(crate) fn service() -> impl Strategy<Value = Service> {
    let meta = (
        namespace_text(),
        prop_oneof![24 => name_text().prop_map(Some), 1 => Just(None)],
        labels(),
        option::of(select(strings(&["Auto", "auto", "Disabled", ""]))),
    );
    let cluster_ip = prop_oneof![
        20 => (0u8..2, 0u8..6).prop_map(|(a, b)| Some(format!("10.96.{a}.{b}"))),
        4 => (0u8..2, 0u8..6).prop_map(|(a, b)| Some(twin(Ipv4Addr::new(10, 96, a, b)).to_string())),
        1 => Just(Some("None".to_owned())),
        1 => Just(Some(String::new())),
        1 => Just(None),
        3 => ip_text().prop_map(Some),
    ];
    // (clusterIP, clusterIPs, ipFamilies): as the API server writes them for each family policy,
    // or anything.
    let cluster_ips = prop_oneof![
        3 => ((0u8..2, 0u8..6), 0u8..4).prop_map(|((a, b), layout)| {
            let v4 = Ipv4Addr::new(10, 96, a, b);
            let (v4, v6) = (v4.to_string(), twin(v4).to_string());
            let (ips, families) = match layout {
                0 => (vec![v4], vec!["IPv4"]),
                1 => (vec![v6], vec!["IPv6"]),
                2 => (vec![v4, v6], vec!["IPv4", "IPv6"]),
                _ => (vec![v6, v4], vec!["IPv6", "IPv4"]),
            };
            (Some(ips[0].clone()), Some(ips), Some(strings(&families)))
        }),
        4 => (
            cluster_ip,
            prop_oneof![4 => Just(None), 1 => option::of(vec(ip_text(), 0..3))],
            prop_oneof![
                4 => Just(None),
                1 => option::of(vec(select(strings(&["IPv4", "IPv6", "IPv5"])), 0..3)),
            ],
        ),
    ];
    let addresses = (
        cluster_ips,
        prop_oneof![
            3 => Just(None),
            1 => option::of(vec(
                prop_oneof![
                    3 => (0u8..3).prop_map(|b| format!("198.51.100.{b}")),
                    2 => (0u8..3).prop_map(|b| twin(Ipv4Addr::new(198, 51, 100, b)).to_string()),
                    1 => ip_text(),
                ],
                0..4,
            )),
        ],
        prop_oneof![3 => Just(None), 1 => option::of(vec(ingress(), 0..3))],
        prop_oneof![3 => Just(None), 1 => option::of(vec(cidr_text(), 0..3))],
    );
    let policies = (
        option::of(select(strings(&[
            "ClusterIP",
            "ClusterIP",
            "NodePort",
            "NodePort",
            "LoadBalancer",
            "LoadBalancer",
            "ExternalName",
            "Weird",
            "",
        ]))),
        option::of(select(strings(&["None", "ClientIP", "ClientIP", "Sticky", ""]))),
        option::of(select(vec![
            0,
            -1,
            1,
            30,
            10_800,
            86_400,
            86_401,
            i32::MAX,
            i32::MIN,
        ])),
        option::of(select(strings(&["Local", "Cluster", "local", ""]))),
        option::of(select(strings(&["Local", "Cluster", "local", ""]))),
        option::of(node_port_num()),
        option::of(select(strings(&["PreferClose", "PreferSameNode", "Bogus"]))),
    );
    let ports = prop_oneof![
        1 => Just(None),
        24 => vec(service_port(), 1..6).prop_map(Some),
        1 => Just(Some(vec![])),
    ];
    (meta, addresses, policies, ports).prop_map(
        |(
            (namespace, name, labels, topology),
            ((cluster_ip, cluster_ips, ip_families), external_ips, ingress, source_ranges),
            (type_, affinity, timeout, itp, etp, hc_port, distribution),
            ports,
        )| Service {
            metadata: ObjectMeta {
                namespace,
                name,
                labels,
                annotations: topology
                    .map(|t| BTreeMap::from([(crate::watch::ANNOTATION_TOPOLOGY_MODE.to_owned(), t)])),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                type_,
                cluster_ip,
                cluster_ips,
                ip_families,
                external_ips,
                load_balancer_source_ranges: source_ranges,
                session_affinity: affinity,
                session_affinity_config: timeout.map(|t| SessionAffinityConfig {
                    client_ip: Some(ClientIPConfig {
                        timeout_seconds: Some(t),
                    }),
                }),
                internal_traffic_policy: itp,
                external_traffic_policy: etp,
                health_check_node_port: hc_port,
                traffic_distribution: distribution,
                ports,
                ..Default::default()
            }),
            status: ingress.map(|ingress| ServiceStatus {
                load_balancer: Some(LoadBalancerStatus {
                    ingress: Some(ingress),
                }),
                ..Default::default()
            }),
        },
    )
}

fn node_name() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => select(strings(&["node-a", "node-b"])),
        1 => select(strings(&["", "node-a ", "NODE-A"])),
        1 => Just("n".repeat(254)),
    ]
}

fn zone() -> impl Strategy<Value = String> {
    select(strings(&["z1", "z2", ""]))
}

fn slice_endpoint() -> impl Strategy<Value = SliceEndpoint> {
    (
        prop_oneof![1 => Just(vec![]), 12 => vec(ip_text(), 1..3)],
        option::of((
            option::of(any::<bool>()),
            option::of(any::<bool>()),
            option::of(any::<bool>()),
        )),
        option::of(node_name()),
        option::of(zone()),
        option::of((option::of(vec(zone(), 0..3)), option::of(vec(node_name(), 0..3)))),
    )
        .prop_map(|(addresses, conditions, node_name, zone, hints)| SliceEndpoint {
            addresses,
            conditions: conditions.map(|(ready, serving, terminating)| EndpointConditions {
                ready,
                serving,
                terminating,
            }),
            node_name,
            zone,
            hints: hints.map(|(zones, nodes)| EndpointHints {
                for_zones: zones.map(|z| z.into_iter().map(|name| ForZone { name }).collect()),
                for_nodes: nodes.map(|n| n.into_iter().map(|name| ForNode { name }).collect()),
            }),
            ..Default::default()
        })
}

/// A recipe for many endpoints at once (generating thousands one by one would be slow to
/// generate and to shrink): `count` addresses from `base`, `stride` apart (0: all the same
/// address; a stride that wraps within a /24 makes duplicates), with conditions, nodes and hints
/// cycling with periods `cycle`.
#[derive(Clone, Debug)]
pub(crate) struct Bulk {
    count: usize,
    base: u32,
    stride: u32,
    cycle: (usize, usize, usize, usize),
    hints: bool,
}

impl Bulk {
    fn expand(&self) -> Vec<SliceEndpoint> {
        let (r, s, t, n) = self.cycle;
        (0..self.count)
            .map(|i| {
                let ip = Ipv4Addr::from(self.base.wrapping_add(self.stride.wrapping_mul(i as u32)));
                let node = if i % n == 0 { "node-a" } else { "node-b" };
                SliceEndpoint {
                    addresses: vec![ip.to_string()],
                    conditions: Some(EndpointConditions {
                        ready: Some(i % r != 0),
                        serving: Some(i % s != 0),
                        terminating: Some(i % t == 0),
                    }),
                    node_name: Some(node.to_owned()),
                    zone: Some(if i % 2 == 0 { "z1" } else { "z2" }.to_owned()),
                    hints: self.hints.then(|| EndpointHints {
                        for_zones: Some(vec![ForZone {
                            name: if i % 3 == 0 { "z2" } else { "z1" }.to_owned(),
                        }]),
                        for_nodes: None,
                    }),
                    ..Default::default()
                }
            })
            .collect()
    }
}

fn bulk() -> impl Strategy<Value = Bulk> {
    (
        select(vec![100usize, 500, 1_000, 3_000]),
        prop_oneof![
            3 => Just(u32::from(Ipv4Addr::new(10, 244, 1, 0))),
            1 => any::<u32>(),
        ],
        select(vec![0u32, 1, 1, 1, 2, 256, 0x0100_0001]),
        (2usize..8, 2usize..8, 2usize..8, 1usize..4),
        any::<bool>(),
    )
        .prop_map(|(count, base, stride, cycle, hints)| Bulk {
            count,
            base,
            stride,
            cycle,
            hints,
        })
}

fn slice_port() -> impl Strategy<Value = EndpointPort> {
    (
        port_name(),
        prop_oneof![
            6 => select(vec![8080, 5353, 9090]).prop_map(Some),
            1 => Just(None),
            1 => port_num().prop_map(Some),
        ],
        protocol(),
    )
        .prop_map(|(name, port, protocol)| EndpointPort {
            name,
            port,
            protocol,
            app_protocol: None,
        })
}

/// An arbitrary discovery/v1 EndpointSlice, usually of one of the generated Services.
pub(crate) fn endpoint_slice() -> impl Strategy<Value = EndpointSlice> {
    (
        namespace_text(),
        prop_oneof![
            8 => select(strings(&["s1", "s2", "s3"])).prop_map(Some),
            1 => Just(None),
            1 => name_text().prop_map(Some),
        ],
        prop_oneof![
            10 => name_text().prop_map(|svc| Some(BTreeMap::from([(
                LABEL_SERVICE_NAME.to_owned(),
                svc,
            )]))),
            1 => Just(None),
            1 => labels(),
            1 => name_text().prop_map(|svc| Some(BTreeMap::from([
                (LABEL_SERVICE_NAME.to_owned(), svc),
                (crate::watch::LABEL_SERVICE_PROXY_NAME.to_owned(), "x".to_owned()),
            ]))),
        ],
        prop_oneof![
            10 => Just("IPv4".to_owned()),
            6 => Just("IPv6".to_owned()),
            1 => select(strings(&["FQDN", "ipv4", "IPv5", ""])),
        ],
        prop_oneof![1 => Just(None), 10 => vec(slice_endpoint(), 0..8).prop_map(Some)],
        prop_oneof![6 => Just(None), 1 => bulk().prop_map(Some)],
        prop_oneof![1 => Just(None), 10 => vec(slice_port(), 0..4).prop_map(Some)],
    )
        .prop_map(
            |(namespace, name, labels, address_type, endpoints, bulk, ports)| {
                let endpoints = match (endpoints, bulk) {
                    (Some(mut eps), Some(b)) => {
                        eps.extend(b.expand());
                        Some(eps)
                    }
                    (None, Some(b)) => Some(b.expand()),
                    (eps, None) => eps,
                };
                let mut slice = EndpointSlice {
                    metadata: ObjectMeta {
                        namespace,
                        name,
                        labels,
                        ..Default::default()
                    },
                    address_type,
                    endpoints,
                    ports,
                };
                // The endpoints are drawn IPv4-first: an IPv6 slice gets their twins.
                if slice.address_type == "IPv6" {
                    retarget(&mut slice, IpFamily::V6);
                }
                slice
            },
        )
}

/// Makes `slice` a slice of `family`, its plain addresses of the other family replaced by their
/// twins (see [`retarget_text`]); slices of neither family are left alone.
fn retarget(slice: &mut EndpointSlice, family: IpFamily) {
    if IpFamily::parse(&slice.address_type).is_none() {
        return;
    }
    slice.address_type = family.as_str().to_owned();
    for ep in slice.endpoints.iter_mut().flatten() {
        for address in &mut ep.addresses {
            *address = retarget_text(address, family);
        }
    }
}

/// This node as the agent knows it.
pub(crate) fn node_info() -> impl Strategy<Value = NodeInfo> {
    (
        prop_oneof![6 => select(strings(&["node-a", "node-b"])), 1 => Just(String::new())],
        option::of(zone()),
    )
        .prop_map(|(name, zone)| NodeInfo { name, zone })
}

fn node_object() -> impl Strategy<Value = Node> {
    (
        option::of(zone()),
        vec(
            (
                select(strings(&["InternalIP", "ExternalIP", "Hostname"])),
                ip_text(),
            ),
            0..3,
        ),
    )
        .prop_map(|(zone, addresses)| Node {
            metadata: ObjectMeta {
                name: Some("node-a".to_owned()),
                labels: zone.map(|z| BTreeMap::from([(crate::node::ZONE_LABEL.to_owned(), z)])),
                ..Default::default()
            },
            status: Some(NodeStatus {
                addresses: Some(
                    addresses
                        .into_iter()
                        .map(|(type_, address)| NodeAddress { address, type_ })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        })
}

/// A whole cluster as the watch sees it: Services, slices that belong to them (same namespace,
/// the service-name label, usually the Service's port names and protocols) and stray slices.
pub(crate) fn cluster_state() -> impl Strategy<Value = ClusterState> {
    (
        vec(service(), 0..6),
        vec(
            (
                any::<prop::sample::Index>(),
                endpoint_slice(),
                prop_oneof![1 => Just(false), 3 => Just(true)],
                prop_oneof![1 => Just(false), 3 => Just(true)],
            ),
            0..8,
        ),
        vec(endpoint_slice(), 0..3),
        option::of(node_object()),
    )
        .prop_map(|(services, owned, stray, node)| {
            let mut state = ClusterState::default();
            for (n, (index, mut slice, copy_ports, follow_families)) in owned.into_iter().enumerate() {
                if services.is_empty() {
                    break;
                }
                let svc = index.get(&services);
                // Usually a slice of one of the Service's families, as the EndpointSlice
                // controller writes one per family: a dual-stack Service gets both.
                let families = svc
                    .spec
                    .as_ref()
                    .and_then(|s| s.ip_families.as_deref())
                    .unwrap_or_default();
                if follow_families
                    && !families.is_empty()
                    && let Some(family) = IpFamily::parse(&families[n % families.len()])
                {
                    retarget(&mut slice, family);
                }
                let name = svc.metadata.name.clone().unwrap_or_default();
                slice.metadata.namespace = svc.metadata.namespace.clone();
                slice.metadata.name = Some(format!("{name}-{n}"));
                slice
                    .metadata
                    .labels
                    .get_or_insert_with(BTreeMap::new)
                    .insert(LABEL_SERVICE_NAME.to_owned(), name);
                let ports = svc.spec.as_ref().and_then(|s| s.ports.as_ref());
                if copy_ports && let Some(ports) = ports {
                    slice.ports = Some(
                        ports
                            .iter()
                            .zip(slice.ports.take().unwrap_or_default().into_iter().chain(
                                std::iter::repeat_with(|| EndpointPort {
                                    port: Some(8080),
                                    ..Default::default()
                                }),
                            ))
                            .map(|(sp, ep)| EndpointPort {
                                name: sp.name.clone(),
                                protocol: sp.protocol.clone(),
                                ..ep
                            })
                            .collect(),
                    );
                }
                state.add_slice(slice);
            }
            for s in services {
                state.add_service(s);
            }
            for s in stray {
                state.add_slice(s);
            }
            state.node = node.map(std::sync::Arc::new);
            state
        })
}

/// `proptest` settings: `cases` cases, no persistence file in the source tree.
pub(crate) fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn key(ep: &Endpoint) -> (IpAddr, u16) {
    (ep.ip, ep.port)
}

proptest! {
    #![proptest_config(config(512))]

    /// `service_ports` never panics, and what it returns is usable as is, in each family:
    /// non-zero ports, unique names and (port, protocol) pairs, addresses and source ranges of
    /// the family only and none special, a sane affinity timeout, and warnings naming a field. A
    /// dual-stack Service has the same ports in both families.
    #[test]
    fn service_ports_is_total_and_well_formed(svc in service()) {
        let mut per_family = Vec::new();
        for family in IpFamily::ALL {
            let Ok(ports) = service_ports(&svc, family) else { continue };
            prop_assert!(!ports.ports.is_empty());
            let mut names = BTreeSet::new();
            let mut numbers = BTreeSet::new();
            for p in &ports.ports {
                prop_assert_eq!(p.family, family);
                prop_assert_ne!(p.port, 0);
                prop_assert_ne!(p.node_port, Some(0));
                prop_assert_ne!(p.health_check_node_port, Some(0));
                prop_assert!(names.insert(p.name.clone()), "duplicate port name {}", p.name);
                prop_assert!(numbers.insert((p.port, p.name.protocol)), "duplicate port {}", p.port);
                prop_assert!(p.cluster_ips.len() <= 1);
                for ip in p.cluster_ips.iter().chain(&p.external_ips).chain(&p.load_balancer_ips) {
                    prop_assert_eq!(IpFamily::of(ip), family, "{}", ip);
                    prop_assert!(super::service::special_address(*ip).is_none(), "{}", ip);
                }
                prop_assert_eq!(Some(&p.name.name), svc.metadata.name.as_ref());
                prop_assert_eq!(&p.name.namespace, &svc.metadata.namespace.clone().unwrap_or_default());
                if let Some(t) = p.session_affinity_timeout {
                    prop_assert!((1..=86_400).contains(&t));
                }
                prop_assert!(p.load_balancer_source_ranges.iter().all(|r| r.prefix_len() > 0));
                prop_assert!(p.load_balancer_source_ranges.iter().all(|r| IpFamily::of_net(r) == family));
            }
            for w in &ports.warnings {
                prop_assert!(w.starts_with("spec.") || w.starts_with("status."), "{w}");
            }
            per_family.push(ports);
        }
        if let [v4, v6] = &per_family[..] {
            let shape = |p: &ServicePortInfo| {
                (p.name.clone(), p.port, p.node_port, p.health_check_node_port, p.session_affinity_timeout)
            };
            prop_assert_eq!(
                v4.ports.iter().map(shape).collect::<Vec<_>>(),
                v6.ports.iter().map(shape).collect::<Vec<_>>()
            );
        }
    }

    /// `endpoints_by_port_with_problems` never panics; in each family, every port list is sorted,
    /// without duplicates, with non-zero ports, for this Service only, of addresses of the family
    /// only; it does not depend on the order of the slices (with distinct names).
    #[test]
    fn endpoints_by_port_is_total_well_formed_and_order_free(
        slices in vec(endpoint_slice(), 0..6),
        node in node_info(),
        namespace in select(strings(&["default", "ns1"])),
        service in select(strings(&["web", "api"])),
        seed in any::<u64>(),
    ) {
        let compact: Vec<Slice> = slices.iter().map(Slice::from).collect();
        let refs: Vec<&Slice> = compact.iter().collect();
        // Distinct names (a later slice of the same name replaces an earlier one by design).
        let mut seen = BTreeSet::new();
        let unique: Vec<&Slice> = refs
            .iter()
            .rev()
            .filter(|s| seen.insert(s.name.clone()))
            .copied()
            .collect();
        let mut shuffled = unique.clone();
        shuffle(&mut shuffled, seed);
        for family in IpFamily::ALL {
            let (by_port, _problems) = endpoints_by_port_with_problems(&namespace, &service, &refs, &node, family);
            for (name, eps) in &by_port {
                prop_assert_eq!(&name.namespace, &namespace);
                prop_assert_eq!(&name.name, &service);
                prop_assert!(!eps.is_empty());
                prop_assert!(eps.windows(2).all(|w| key(&w[0]) < key(&w[1])), "sorted and unique");
                for ep in eps {
                    prop_assert_ne!(ep.port, 0);
                    prop_assert_eq!(IpFamily::of(&ep.ip), family, "{}", ep.ip);
                    prop_assert_eq!(ep.is_local, !node.name.is_empty() && ep.node_name.as_deref() == Some(node.name.as_str()));
                }
            }
            let (a, pa) = endpoints_by_port_with_problems(&namespace, &service, &unique, &node, family);
            let (b, pb) = endpoints_by_port_with_problems(&namespace, &service, &shuffled, &node, family);
            prop_assert_eq!(a, b);
            prop_assert_eq!(pa, pb);
        }
    }

    /// `categorize_endpoints` never panics and keeps to kube-proxy's shape: `cluster` and `local`
    /// are drawn from the input, `local` holds only this node's endpoints, `all_reachable` is
    /// their union, unused lists are empty, and nothing is reachable without endpoints.
    #[test]
    fn categorize_endpoints_is_total_and_consistent(
        svc in service(),
        slices in vec(endpoint_slice(), 1..4),
        node in node_info(),
    ) {
        let ns = svc.metadata.namespace.clone().unwrap_or_default();
        let name = svc.metadata.name.clone().unwrap_or_default();
        // Whatever the labels say, use these slices as the Service's.
        let mut slices = slices;
        for s in &mut slices {
            s.metadata.namespace = Some(ns.clone());
            s.metadata.labels.get_or_insert_with(BTreeMap::new)
                .insert(LABEL_SERVICE_NAME.to_owned(), name.clone());
        }
        let compact: Vec<Slice> = slices.iter().map(Slice::from).collect();
        let refs: Vec<&Slice> = compact.iter().collect();
        for family in IpFamily::ALL {
            let Ok(ports) = service_ports(&svc, family) else { continue };
            let (by_port, _) = endpoints_by_port_with_problems(&ns, &name, &refs, &node, family);
            for port in &ports.ports {
                let eps = by_port.get(&port.name).cloned().unwrap_or_default();
                check_categorized(&eps, port, &node)?;
            }
        }
    }
}

fn check_categorized(eps: &[Endpoint], port: &ServicePortInfo, node: &NodeInfo) -> Result<(), TestCaseError> {
    let c = categorize_endpoints(eps, port, node);
    let input: BTreeSet<_> = eps.iter().map(key).collect();
    let cluster: BTreeSet<_> = c.cluster.iter().map(key).collect();
    let local: BTreeSet<_> = c.local.iter().map(key).collect();
    let all: BTreeSet<_> = c.all_reachable.iter().map(key).collect();
    prop_assert!(cluster.is_subset(&input));
    prop_assert!(local.is_subset(&input));
    prop_assert!(c.local.iter().all(|e| e.is_local));
    prop_assert_eq!(&all, &cluster.union(&local).copied().collect());
    if eps.is_empty() {
        prop_assert!(!c.has_any);
    }
    if !c.cluster.is_empty() || !c.local.is_empty() {
        prop_assert!(c.has_any);
    }
    if !port.uses_cluster_endpoints() {
        prop_assert!(c.cluster.is_empty());
    }
    if !port.uses_local_endpoints() {
        prop_assert!(c.local.is_empty());
    }
    // Only endpoints that may take traffic: ready, or serving and terminating (the fallback).
    for e in c.cluster.iter().chain(&c.local) {
        prop_assert!(e.ready || (e.serving && e.terminating), "{e:?}");
    }
    Ok(())
}

/// A deterministic Fisher-Yates shuffle (the seed comes from proptest, so failures replay).
pub(crate) fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        // xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
}
