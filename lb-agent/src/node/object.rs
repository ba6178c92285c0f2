//! What the agent reads from its own Node object: the zone label (topology), the primary
//! addresses of each family (kube-proxy's `GetNodeHostIPs`), its pod CIDRs (`detectLocalMode`
//! NodeCIDR) and whether it may receive load-balancer traffic.

use std::net::IpAddr;

use ipnet::IpNet;

use k8s_openapi::api::core::v1::Node;

use crate::family::IpFamily;

/// The node label kube-proxy reads its zone from.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// The node's `topology.kubernetes.io/zone` label, if any.
pub fn zone(node: Option<&Node>) -> Option<String> {
    node.and_then(|n| n.metadata.labels.as_ref())
        .and_then(|l| l.get(ZONE_LABEL))
        .cloned()
}

/// The node's primary addresses from its Node object, at most one per family (kube-proxy
/// `GetNodeHostIPs`: of each family, the first InternalIP, else the first ExternalIP).
pub fn primary_ips(node: Option<&Node>) -> Vec<IpAddr> {
    let Some(addresses) = node
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.addresses.as_ref())
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for family in IpFamily::ALL {
        for kind in ["InternalIP", "ExternalIP"] {
            let first = addresses
                .iter()
                .filter(|a| a.type_ == kind)
                .filter_map(|a| a.address.parse::<IpAddr>().ok())
                .find(|ip| IpFamily::of(ip) == family);
            if let Some(ip) = first {
                out.push(ip);
                break;
            }
        }
    }
    out
}

/// The node's pod CIDRs (`spec.podCIDRs`, else `spec.podCIDR`), normalised; unparsable entries are
/// skipped, as kube-proxy's NodeCIDR detector skips them.
pub fn pod_cidrs(node: Option<&Node>) -> Vec<IpNet> {
    let Some(spec) = node.and_then(|n| n.spec.as_ref()) else {
        return Vec::new();
    };
    let listed: Vec<&String> = match spec.pod_cidrs.as_deref() {
        Some(cidrs) if !cidrs.is_empty() => cidrs.iter().collect(),
        _ => spec.pod_cidr.iter().collect(),
    };
    listed
        .into_iter()
        .filter_map(|c| c.trim().parse::<IpNet>().ok())
        .map(|c| c.trunc())
        .collect()
}

/// The taint the cluster autoscaler puts on a node it is about to delete
/// (`healthcheck.ToBeDeletedTaint`).
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Whether the node may receive load-balancer traffic (`ProxyHealthServer.NodeEligible`): not being
/// deleted and not tainted for deletion by the cluster autoscaler.
pub fn node_eligible(node: &Node) -> bool {
    if node.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let taints = node
        .spec
        .as_ref()
        .and_then(|spec| spec.taints.as_deref())
        .unwrap_or_default();
    !taints.iter().any(|taint| taint.key == TO_BE_DELETED_TAINT)
}
