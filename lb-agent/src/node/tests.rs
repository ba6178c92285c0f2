//! The node view for the shapes of Node objects and flags that take different fallbacks.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::core::v1::{NodeAddress, NodeSpec, NodeStatus, Taint},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
};

use super::*;

fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

fn settings(nodeport_addresses: &[&str], bind_address: Option<&str>) -> NodeSettings {
    NodeSettings {
        node_name: "node-a".into(),
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        nodeport_addresses: nodeport_addresses.iter().map(|s| s.parse().unwrap()).collect(),
        masquerade_all: false,
        localhost_nodeports: true,
        bind_address: bind_address.map(ip),
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

fn local() -> Vec<Ipv4Addr> {
    LOCAL.iter().map(|s| ip(s)).collect()
}

#[test]
fn internal_ip_is_primary_and_the_masquerade_address() {
    let n = node(&[("InternalIP", "192.168.1.10"), ("Hostname", "node-a")]);
    let v = settings(&[], Some("172.16.0.10")).view(Some(&n), &local());
    assert_eq!(
        v.info,
        NodeInfo {
            name: "node-a".into(),
            zone: Some("zone-a".into())
        }
    );
    assert_eq!(v.context.node_ips, vec![ip("192.168.1.10")]);
    assert_eq!(v.masquerade_address, ip("192.168.1.10"));
    assert_eq!(
        v.context.nodeport_addresses,
        vec![ip("172.16.0.10"), ip("192.168.1.10")]
    );
    assert!(v.context.localhost_nodeports);
    assert!(v.context.cluster_cidr_configured);
}

#[test]
fn external_ip_only_is_primary() {
    let n = node(&[("ExternalIP", "172.16.0.10")]);
    let v = settings(&[], None).view(Some(&n), &local());
    assert_eq!(v.context.node_ips, vec![ip("172.16.0.10")]);
    assert_eq!(v.masquerade_address, ip("172.16.0.10"));
}

#[test]
fn internal_ip_wins_over_external_ip() {
    let n = node(&[("ExternalIP", "172.16.0.10"), ("InternalIP", "192.168.1.10")]);
    let v = settings(&[], None).view(Some(&n), &local());
    assert_eq!(v.context.node_ips, vec![ip("192.168.1.10")]);
    assert_eq!(v.masquerade_address, ip("192.168.1.10"));
}

#[test]
fn without_node_addresses_the_bind_address_is_primary() {
    let v = settings(&[], Some("172.16.0.10")).view(Some(&node(&[])), &local());
    assert_eq!(v.context.node_ips, vec![ip("172.16.0.10")]);
    assert_eq!(v.masquerade_address, ip("172.16.0.10"));
    let v = settings(&[], Some("172.16.0.10")).view(None, &local());
    assert_eq!(v.masquerade_address, ip("172.16.0.10"));
}

#[test]
fn without_a_primary_ip_the_first_nodeport_address_masquerades() {
    let v = settings(&[], None).view(None, &local());
    assert!(v.context.node_ips.is_empty());
    assert_eq!(v.masquerade_address, ip("172.16.0.10"));
    let v = settings(&["192.168.0.0/16"], None).view(None, &local());
    assert_eq!(v.masquerade_address, ip("192.168.1.10"));
    assert!(
        !v.context.localhost_nodeports,
        "loopback is not in 192.168.0.0/16"
    );
}

#[test]
fn an_address_of_the_other_family_is_skipped() {
    let n = node(&[("InternalIP", "2001:db8::10"), ("InternalIP", "192.168.1.10")]);
    let v = settings(&["2001:db8::/64", "primary"], None).view(Some(&n), &local());
    assert_eq!(v.context.node_ips, vec![ip("192.168.1.10")]);
    assert_eq!(v.context.nodeport_addresses, vec![ip("192.168.1.10")]);
    let v = settings(&["2001:db8::/64"], None).view(Some(&node(&[("InternalIP", "2001:db8::10")])), &local());
    assert!(v.context.node_ips.is_empty() && v.context.nodeport_addresses.is_empty());
    assert_eq!(
        v.masquerade_address,
        Ipv4Addr::UNSPECIFIED,
        "nothing of this family to masquerade with"
    );
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
    assert_eq!(cfg.snat_addr, [192, 168, 1, 10]);
    assert_eq!(cfg.host_netns_cookie, 42);
    assert_eq!(cfg.flags, dpconfig::flags::SOCK_HOSTNS_ONLY);
    assert_eq!(cfg.cluster_cidr_count, 1);
    assert_eq!(cfg.is_pod_address([10, 244, 3, 4]), Some(true));
    assert_eq!(
        (cfg.snat_port_min, cfg.snat_port_max),
        (dpconfig::SNAT_PORT_MIN, dpconfig::SNAT_PORT_MAX)
    );
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
