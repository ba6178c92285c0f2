//! Builders the model's and the plan's unit tests share.

use std::net::IpAddr;

use super::{Protocol, ServicePortInfo, ServicePortName};
use crate::family::IpFamily;

/// kube-proxy's `ServicePortName` of `namespace/name:port`.
pub fn port_name(namespace: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName {
        namespace: namespace.into(),
        name: name.into(),
        port: port.into(),
        protocol,
    }
}

/// A TCP ClusterIP-only service port at `cluster_ip:80`, in the cluster IP's family, with every
/// option off (upstream's `&BaseServicePortInfo{}`); tests set the fields they are about.
pub fn service_port(namespace: &str, name: &str, port: &str, cluster_ip: &str) -> ServicePortInfo {
    let cluster_ip: IpAddr = cluster_ip.parse().unwrap();
    ServicePortInfo {
        name: port_name(namespace, name, port, Protocol::Tcp),
        family: IpFamily::of(&cluster_ip),
        cluster_ips: vec![cluster_ip],
        port: 80,
        node_port: None,
        external_ips: vec![],
        load_balancer_ips: vec![],
        load_balancer_source_ranges: vec![],
        session_affinity_timeout: None,
        internal_policy_local: false,
        external_policy_local: false,
        health_check_node_port: None,
        traffic_distribution: None,
        topology_mode: None,
        lb_algorithm: None,
    }
}
