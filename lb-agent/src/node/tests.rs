//! The node view for the shapes of Node objects and flags that take different fallbacks.

use std::{collections::BTreeMap, net::Ipv6Addr};

use k8s_openapi::{
    api::core::v1::{NodeAddress, NodeSpec, NodeStatus, Taint},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
};
use lb_common::family::In6Addr;

use super::*;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn ip6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

fn settings(nodeport_addresses: &[&str], bind_address: Option<&str>) -> NodeSettings {
    NodeSettings {
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        nodeport_addresses: nodeport_addresses.iter().map(|s| s.parse().unwrap()).collect(),
        bind_address: bind_address.map(ip),
        ..NodeSettings::new("node-a")
    }
}

fn node(addresses: &[(&str, &str)]) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some("node-a".into()),
            labels: Some(BTreeMap::from([(ZONE_LABEL.into(), "zone-a".into())])),
            ..ObjectMeta::default()
        },
        status: Some(NodeStatus {
            addresses: Some(
                addresses
                    .iter()
                    .map(|(kind, address)| NodeAddress {
                        type_: (*kind).into(),
                        address: (*address).into(),
                    })
                    .collect(),
            ),
            ..NodeStatus::default()
        }),
        ..Node::default()
    }
}

/// The interfaces of the test node: an uplink, a second uplink and loopback.
const LOCAL: [&str; 3] = ["127.0.0.1", "192.168.1.10", "172.16.0.10"];

fn local() -> LocalNetwork {
    network(&LOCAL, false)
}

fn network(addresses: &[&str], ipv6_disabled: bool) -> LocalNetwork {
    LocalNetwork {
        addresses: addresses.iter().map(|s| ip(s)).collect(),
        ipv6_disabled,
        links: Vec::new(),
        interface_addresses: Vec::new(),
    }
}

/// A dual-stack node's interfaces: both families' uplinks, a pod-network address of each family
/// and loopback of each.
const LOCAL_DUAL: [&str; 8] = [
    "127.0.0.1",
    "::1",
    "192.168.1.10",
    "172.16.0.10",
    "2001:db8::10",
    "2001:db8:1::10",
    "fe80::1",
    "fd00:10:244::1",
];

fn both(v4: Option<&str>, v6: Option<&str>) -> PerFamily<Option<IpAddr>> {
    PerFamily {
        v4: v4.map(ip),
        v6: v6.map(ip),
    }
}

#[test]
fn internal_ip_is_primary_and_the_masquerade_address() {
    let n = node(&[("InternalIP", "192.168.1.10"), ("Hostname", "node-a")]);
    let v = settings(&[], None).view(Some(&n), &local());
    assert_eq!(
        v.info,
        NodeInfo {
            name: "node-a".into(),
            zone: Some("zone-a".into())
        }
    );
    assert_eq!(v.context.node_ips, vec![ip("192.168.1.10")]);
    assert_eq!(v.masquerade, both(Some("192.168.1.10"), None));
    assert_eq!(
        v.context.nodeport_addresses,
        vec![ip("172.16.0.10"), ip("192.168.1.10")]
    );
    assert!(v.context.localhost_nodeports);
    assert_eq!(v.context.detect_local, PerFamily { v4: true, v6: false });
    assert_eq!(v.context.serves, PerFamily { v4: true, v6: true });
}

/// kube-proxy `detectNodeIPs`: a (specified) `--bind-address` overrides the Node object's
/// primary IP of its family.
#[test]
fn the_bind_address_overrides_the_primary_ip_of_its_family() {
    let n = node(&[("InternalIP", "192.168.1.10")]);
    let v = settings(&[], Some("172.16.0.10")).view(Some(&n), &local());
    assert_eq!(v.context.node_ips, vec![ip("172.16.0.10")]);
    assert_eq!(v.masquerade, both(Some("172.16.0.10"), None));
    // Unspecified means unset, in either family.
    for unset in ["0.0.0.0", "::"] {
        let v = settings(&[], Some(unset)).view(Some(&n), &local());
        assert_eq!(v.context.node_ips, vec![ip("192.168.1.10")], "{unset}");
    }
}

#[test]
fn external_ip_only_is_primary() {
    let n = node(&[("ExternalIP", "172.16.0.10")]);
    let v = settings(&[], None).view(Some(&n), &local());
    assert_eq!(v.context.node_ips, vec![ip("172.16.0.10")]);
    assert_eq!(v.masquerade.v4, Some(ip("172.16.0.10")));
}

#[test]
fn internal_ip_wins_over_external_ip() {
    let n = node(&[("ExternalIP", "172.16.0.10"), ("InternalIP", "192.168.1.10")]);
    let v = settings(&[], None).view(Some(&n), &local());
    assert_eq!(v.context.node_ips, vec![ip("192.168.1.10")]);
    assert_eq!(v.masquerade.v4, Some(ip("192.168.1.10")));
}

#[test]
fn without_node_addresses_the_bind_address_is_primary() {
    let v = settings(&[], Some("172.16.0.10")).view(Some(&node(&[])), &local());
    assert_eq!(v.context.node_ips, vec![ip("172.16.0.10")]);
    assert_eq!(v.masquerade.v4, Some(ip("172.16.0.10")));
    let v = settings(&[], Some("172.16.0.10")).view(None, &local());
    assert_eq!(v.masquerade.v4, Some(ip("172.16.0.10")));
}

#[test]
fn without_a_primary_ip_the_first_nodeport_address_masquerades() {
    let v = settings(&[], None).view(None, &local());
    assert!(v.context.node_ips.is_empty());
    assert_eq!(v.masquerade, both(Some("172.16.0.10"), None));
    let v = settings(&["192.168.0.0/16"], None).view(None, &local());
    assert_eq!(v.masquerade.v4, Some(ip("192.168.1.10")));
    assert!(
        !v.context.localhost_nodeports,
        "loopback is not in 192.168.0.0/16"
    );
    // Per family: a Node object without an IPv6 address leaves IPv6 to the first IPv6 NodePort
    // address.
    let n = node(&[("InternalIP", "192.168.1.10")]);
    let v = settings(&[], None).view(Some(&n), &network(&LOCAL_DUAL, false));
    assert_eq!(v.masquerade, both(Some("192.168.1.10"), Some("2001:db8::10")));
}

/// `GetNodeHostIPs`: the first InternalIP (else ExternalIP) of each family, whatever the order.
#[test]
fn a_dual_stack_node_has_a_primary_ip_per_family() {
    let n = node(&[
        ("InternalIP", "2001:db8::10"),
        ("ExternalIP", "192.0.2.10"),
        ("InternalIP", "192.168.1.10"),
        ("InternalIP", "2001:db8:1::10"),
    ]);
    let s = settings(&[], None);
    let v = s.view(Some(&n), &network(&LOCAL_DUAL, false));
    assert_eq!(v.context.node_ips, vec![ip("192.168.1.10"), ip("2001:db8::10")]);
    assert_eq!(v.masquerade, both(Some("192.168.1.10"), Some("2001:db8::10")));
    // Every address of both families but loopback and IPv6 link-local.
    assert_eq!(
        v.context.nodeport_addresses,
        vec![
            ip("172.16.0.10"),
            ip("192.168.1.10"),
            ip("2001:db8::10"),
            ip("2001:db8:1::10"),
            ip("fd00:10:244::1"),
        ]
    );
    let v = settings(&["primary"], None).view(Some(&n), &network(&LOCAL_DUAL, false));
    assert_eq!(
        v.context.nodeport_addresses,
        vec![ip("192.168.1.10"), ip("2001:db8::10")]
    );
    // Per family, as kube-proxy: IPv6 entries only leave IPv4 NodePorts on every IPv4 address.
    let v = settings(&["2001:db8::/64"], None).view(Some(&n), &network(&LOCAL_DUAL, false));
    assert_eq!(
        v.context.nodeport_addresses,
        vec![ip("172.16.0.10"), ip("192.168.1.10"), ip("2001:db8::10")]
    );
    let v = settings(&["2001:db8::/64", "192.168.1.0/24"], None).view(Some(&n), &network(&LOCAL_DUAL, false));
    assert_eq!(
        v.context.nodeport_addresses,
        vec![ip("192.168.1.10"), ip("2001:db8::10")]
    );
    assert!(!v.context.localhost_nodeports);
}

/// `--bind-address` of one family leaves the other family's primary IP alone.
#[test]
fn the_bind_address_overrides_its_family_only() {
    let n = node(&[("InternalIP", "192.168.1.10"), ("InternalIP", "2001:db8::10")]);
    let local = network(&LOCAL_DUAL, false);
    let v = settings(&[], Some("2001:db8:1::10")).view(Some(&n), &local);
    assert_eq!(v.context.node_ips, vec![ip("192.168.1.10"), ip("2001:db8:1::10")]);
    assert_eq!(v.masquerade, both(Some("192.168.1.10"), Some("2001:db8:1::10")));
    let v = settings(&[], Some("172.16.0.10")).view(Some(&n), &local);
    assert_eq!(v.context.node_ips, vec![ip("172.16.0.10"), ip("2001:db8::10")]);
    assert_eq!(v.masquerade, both(Some("172.16.0.10"), Some("2001:db8::10")));
    // A single-stack IPv4 node with an IPv6 --bind-address: IPv4 from the Node object, IPv6 from
    // the flag.
    let n = node(&[("InternalIP", "192.168.1.10")]);
    let v = settings(&["primary"], Some("2001:db8::10")).view(Some(&n), &local);
    assert_eq!(v.context.node_ips, vec![ip("192.168.1.10"), ip("2001:db8::10")]);
    assert_eq!(
        v.context.nodeport_addresses,
        vec![ip("192.168.1.10"), ip("2001:db8::10")]
    );
}

/// A single-stack IPv6 node: no IPv4 address to masquerade with, and no IPv4 primary IP (kube-proxy
/// assumes 127.0.0.1, which `primary` skips, so its IPv4 proxier serves every IPv4 address).
#[test]
fn an_ipv6_only_node() {
    let n = node(&[("InternalIP", "2001:db8::10")]);
    let local = network(&["127.0.0.1", "::1", "2001:db8::10"], false);
    let v = settings(&["primary"], None).view(Some(&n), &local);
    assert_eq!(v.context.node_ips, vec![ip("2001:db8::10")]);
    assert_eq!(v.context.nodeport_addresses, vec![ip("2001:db8::10")]);
    assert_eq!(v.masquerade, both(None, Some("2001:db8::10")));
    assert!(v.context.localhost_nodeports);
    let v = settings(&["2001:db8::/64", "127.0.0.0/8"], None).view(Some(&n), &local);
    assert_eq!(v.context.nodeport_addresses, vec![ip("2001:db8::10")]);
    assert!(v.context.localhost_nodeports);
    let v = settings(&["2001:db8::/64", "10.0.0.0/8"], None).view(Some(&n), &local);
    assert!(!v.context.localhost_nodeports);
}

/// A node whose kernel has IPv6 off serves no IPv6 (kube-proxy runs its IPv4 proxier only): no
/// IPv6 masquerade address, even with an IPv6 primary IP in the Node object.
#[test]
fn ipv6_off_serves_ipv4_only() {
    let n = node(&[("InternalIP", "192.168.1.10"), ("InternalIP", "2001:db8::10")]);
    let v = settings(&[], None).view(Some(&n), &network(&LOCAL, true));
    assert_eq!(v.context.serves, PerFamily { v4: true, v6: false });
    assert_eq!(v.masquerade, both(Some("192.168.1.10"), None));
    let cfg = settings(&[], None).datapath_config(&v, 1, false);
    assert_eq!(cfg.v6.snat_addr, In6Addr::default());
}

/// `--cluster-cidr` makes a local-traffic detector of each family it has a CIDR of (kube-proxy's
/// `getLocalDetectors`); a family without one has none.
#[test]
fn detect_local_per_family() {
    let n = node(&[("InternalIP", "192.168.1.10"), ("InternalIP", "2001:db8::10")]);
    let local = network(&LOCAL_DUAL, false);
    let cases: [(&[&str], PerFamily<bool>); 4] = [
        (&[], PerFamily { v4: false, v6: false }),
        (&["10.244.0.0/16"], PerFamily { v4: true, v6: false }),
        (&["fd00:10:244::/56"], PerFamily { v4: false, v6: true }),
        (
            &["10.244.0.0/16", "fd00:10:244::/56"],
            PerFamily { v4: true, v6: true },
        ),
    ];
    for (cidrs, want) in cases {
        let s = NodeSettings {
            cluster_cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            ..settings(&[], None)
        };
        let v = s.view(Some(&n), &local);
        assert_eq!(v.context.detect_local, want, "{cidrs:?}");
        let cfg = s.datapath_config(&v, 1, false);
        assert_eq!(
            cfg.v4.is_pod_address(&[10, 244, 3, 4]).is_some(),
            want.v4,
            "{cidrs:?}"
        );
        let pod6 = In6Addr::from(ip6("fd00:10:244::5"));
        assert_eq!(cfg.v6.is_pod_address(&pod6).is_some(), want.v6, "{cidrs:?}");
    }
}

#[test]
fn nodeport_addresses_primary_selects_the_primary_ip_only() {
    let n = node(&[("InternalIP", "192.168.1.10")]);
    let v = settings(&["primary"], None).view(Some(&n), &local());
    assert_eq!(v.context.nodeport_addresses, vec![ip("192.168.1.10")]);
    assert!(!v.context.localhost_nodeports);
}

#[test]
fn the_datapath_config_carries_the_view() {
    let s = settings(&[], None);
    let v = s.view(Some(&node(&[("InternalIP", "192.168.1.10")])), &local());
    let cfg = s.datapath_config(&v, 42, true);
    assert_eq!(cfg.v4.snat_addr, [192, 168, 1, 10]);
    assert_eq!(cfg.host_netns_cookie, 42);
    assert_eq!(cfg.flags, dpconfig::flags::SOCK_HOSTNS_ONLY);
    assert_eq!(cfg.v4.cluster_cidr_count, 1);
    assert_eq!(cfg.v4.is_pod_address(&[10, 244, 3, 4]), Some(true));
    assert_eq!(cfg.v6, FamilyConfig::EMPTY, "nothing of IPv6 configured");
    assert_eq!(
        (cfg.snat_port_min, cfg.snat_port_max),
        (dpconfig::SNAT_PORT_MIN, dpconfig::SNAT_PORT_MAX)
    );
}

/// Each family's cluster CIDRs and masquerade address go to its own part of `lb_config`.
#[test]
fn the_datapath_config_of_a_dual_stack_node() {
    let s = NodeSettings {
        cluster_cidrs: ["fd00:10:244::/56", "10.244.0.0/16", "fd00:10:245::/56"]
            .iter()
            .map(|c| c.parse().unwrap())
            .collect(),
        ..settings(&[], None)
    };
    let n = node(&[("InternalIP", "192.168.1.10"), ("InternalIP", "2001:db8::10")]);
    let v = s.view(Some(&n), &network(&LOCAL_DUAL, false));
    let cfg = s.datapath_config(&v, 42, false);
    assert_eq!(cfg.v4.snat_addr, [192, 168, 1, 10]);
    assert_eq!(cfg.v6.snat_addr, In6Addr::from(ip6("2001:db8::10")));
    assert_eq!(cfg.v4.cluster_cidr_count, 1);
    assert_eq!(cfg.v6.cluster_cidr_count, 2);
    assert_eq!(cfg.v4.is_pod_address(&[10, 244, 3, 4]), Some(true));
    assert_eq!(cfg.v4.is_pod_address(&[10, 245, 3, 4]), Some(false));
    for (addr, pod) in [
        ("fd00:10:244::5", true),
        ("fd00:10:245:ff::5", true),
        ("fd00:10:246::5", false),
        ("2001:db8::10", false),
    ] {
        assert_eq!(
            cfg.v6.is_pod_address(&In6Addr::from(ip6(addr))),
            Some(pod),
            "{addr}"
        );
    }
}

#[test]
fn eligibility_follows_upstream() {
    let tainted = |key: &str| Node {
        spec: Some(NodeSpec {
            taints: Some(vec![Taint {
                key: key.into(),
                effect: "NoSchedule".into(),
                ..Taint::default()
            }]),
            ..NodeSpec::default()
        }),
        ..node(&[])
    };
    assert!(object::node_eligible(&node(&[])));
    assert!(object::node_eligible(&tainted("other")));
    assert!(!object::node_eligible(&tainted(object::TO_BE_DELETED_TAINT)));
    let mut deleted = node(&[]);
    deleted.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
    assert!(!object::node_eligible(&deleted));
}

/// NodeCIDR mode: the detector is the Node's `spec.podCIDRs` (else `spec.podCIDR`), per family,
/// capped at what `lb_config` holds; no pod CIDRs (yet) means no detector, and `--cluster-cidr`
/// plays no part.
#[test]
fn node_cidr_mode_detects_the_nodes_pod_cidrs() {
    let local = network(&LOCAL_DUAL, false);
    let s = NodeSettings {
        detect_local_mode: DetectLocalMode::NodeCidr,
        ..settings(&[], None)
    };
    let with = |pod_cidrs: Option<Vec<&str>>, pod_cidr: Option<&str>| {
        let mut n = node(&[("InternalIP", "192.168.1.10")]);
        n.spec = Some(NodeSpec {
            pod_cidrs: pod_cidrs.map(|c| c.into_iter().map(String::from).collect()),
            pod_cidr: pod_cidr.map(String::from),
            ..NodeSpec::default()
        });
        s.view(Some(&n), &local)
    };
    let v = with(Some(vec!["10.244.1.0/24", "fd00:10:244:1::/64"]), None);
    assert_eq!(v.context.detect_local, PerFamily { v4: true, v6: true });
    let cfg = s.datapath_config(&v, 1, false);
    assert_eq!(
        cfg.v4.is_pod_address(&[10, 244, 1, 4]),
        Some(true),
        "this node's pod"
    );
    assert_eq!(
        cfg.v4.is_pod_address(&[10, 244, 2, 4]),
        Some(false),
        "another node's pod"
    );
    assert_eq!(
        cfg.v6.is_pod_address(&In6Addr::from(ip6("fd00:10:244:1::5"))),
        Some(true)
    );
    assert_eq!(
        cfg.v6.is_pod_address(&In6Addr::from(ip6("fd00:10:244:2::5"))),
        Some(false)
    );

    // The single-stack field of older clusters, when podCIDRs is empty.
    let v = with(Some(vec![]), Some("10.244.7.0/24"));
    assert_eq!(v.local_cidrs, vec!["10.244.7.0/24".parse::<IpNet>().unwrap()]);

    // None yet (the node controller has not assigned one): no detector in either family.
    for v in [with(None, None), s.view(None, &local)] {
        assert_eq!(v.context.detect_local, PerFamily { v4: false, v6: false });
        assert!(v.local_cidrs.is_empty());
    }

    // Garbage is skipped, and each family keeps at most MAX_CLUSTER_CIDRS.
    let many: Vec<String> = (0..MAX_CLUSTER_CIDRS + 2)
        .map(|i| format!("10.{i}.0.0/16"))
        .collect();
    let mut listed: Vec<&str> = many.iter().map(String::as_str).collect();
    listed.push("not-a-cidr");
    let v = with(Some(listed), None);
    assert_eq!(v.local_cidrs.len(), MAX_CLUSTER_CIDRS);
}

/// BridgeInterface and InterfaceNamePrefix (kube-proxy's `-i` detectors): one detector for both
/// families, no CIDR, the pod interfaces listed for `lb_pod_ifaces` and the flag that turns the
/// programs to them; a bridge that does not exist (yet) makes no interface a pod's.
#[test]
fn interface_detectors_list_pod_interfaces_for_both_families() {
    let links = vec![
        Link {
            name: "eth0".into(),
            index: 2,
            controller: None,
            bridge_port: false,
            up: true,
            loopback: false,
        },
        Link {
            name: "cbr0".into(),
            index: 3,
            controller: None,
            bridge_port: false,
            up: true,
            loopback: false,
        },
        Link {
            name: "veth1".into(),
            index: 4,
            controller: Some(3),
            bridge_port: true,
            up: true,
            loopback: false,
        },
        Link {
            name: "veth2".into(),
            index: 5,
            controller: None,
            bridge_port: false,
            up: true,
            loopback: false,
        },
    ];
    let local = LocalNetwork { links, ..local() };
    let n = node(&[("InternalIP", "192.168.1.10")]);
    for (mode, bridge, prefix, want) in [
        (DetectLocalMode::BridgeInterface, "cbr0", "", vec![3, 4]),
        (DetectLocalMode::BridgeInterface, "cni0", "", vec![]),
        (DetectLocalMode::InterfaceNamePrefix, "", "veth", vec![4, 5]),
    ] {
        let s = NodeSettings {
            detect_local_mode: mode,
            pod_bridge_interface: bridge.into(),
            pod_interface_name_prefix: prefix.into(),
            ..settings(&[], None)
        };
        let v = s.view(Some(&n), &local);
        assert_eq!(
            v.pod_interfaces,
            Some(want.into_iter().collect()),
            "{mode:?} {bridge}{prefix}"
        );
        assert!(
            v.local_cidrs.is_empty(),
            "--cluster-cidr is not the detector in {mode:?}"
        );
        assert_eq!(v.context.detect_local, PerFamily { v4: true, v6: true });
        let cfg = s.datapath_config(&v, 42, false);
        assert_eq!(cfg.flags, dpconfig::flags::DETECT_LOCAL_BY_INTERFACE);
        assert_eq!((cfg.v4.cluster_cidr_count, cfg.v6.cluster_cidr_count), (0, 0));
    }
    // The address detectors list no interface and leave the flag off.
    let v = settings(&[], None).view(Some(&n), &local);
    assert_eq!(v.pod_interfaces, None);
    assert_eq!(settings(&[], None).datapath_config(&v, 42, false).flags, 0);
}

#[test]
fn detect_local_mode_parses_kube_proxys_names() {
    assert_eq!("ClusterCIDR".parse(), Ok(DetectLocalMode::ClusterCidr));
    assert_eq!("".parse(), Ok(DetectLocalMode::ClusterCidr));
    assert_eq!("NodeCIDR".parse(), Ok(DetectLocalMode::NodeCidr));
    assert_eq!("BridgeInterface".parse(), Ok(DetectLocalMode::BridgeInterface));
    assert_eq!(
        "InterfaceNamePrefix".parse(),
        Ok(DetectLocalMode::InterfaceNamePrefix)
    );
    for mode in [
        DetectLocalMode::ClusterCidr,
        DetectLocalMode::NodeCidr,
        DetectLocalMode::BridgeInterface,
        DetectLocalMode::InterfaceNamePrefix,
    ] {
        assert_eq!(mode.as_str().parse(), Ok(mode));
    }
    assert!(
        "nodecidr"
            .parse::<DetectLocalMode>()
            .unwrap_err()
            .contains("unknown mode")
    );
}

/// A hostNetwork endpoint may sit at any of the node's addresses (`backend::flags::HOST`): the
/// node IPs and every interface's, never loopback or link-local (each pod veth's own IPv6 one
/// would make every pod's arrival a change of the node facts).
#[test]
fn host_addresses_are_the_node_ips_and_interface_addresses_but_loopback_and_link_local() {
    let mut local = network(&LOCAL_DUAL, false);
    local.addresses.push(ip("169.254.1.1"));
    let n = node(&[("InternalIP", "192.168.1.10"), ("InternalIP", "2001:db8::10")]);
    let v = settings(&[], None).view(Some(&n), &local);
    assert_eq!(
        v.context.host_addresses,
        [
            "172.16.0.10",
            "192.168.1.10",
            "2001:db8::10",
            "2001:db8:1::10",
            "fd00:10:244::1"
        ]
        .map(ip)
    );
    // A node IP no interface holds (`--bind-address` of a NAT'd address) still counts.
    let v = settings(&[], Some("198.51.100.7")).view(Some(&n), &network(&LOCAL, false));
    assert!(
        v.context.host_addresses.contains(&ip("198.51.100.7")),
        "{:?}",
        v.context.host_addresses
    );
    assert!(!v.context.host_addresses.contains(&ip("127.0.0.1")));
}
