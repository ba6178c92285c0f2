//! Model step for traffic policies and topology: which of a Service port's endpoints each kind of
//! traffic may use on this node. This ports kube-proxy's `CategorizeEndpoints`,
//! `topologyModeFromHints` and `availableForTopology` (`pkg/proxy/topology.go`, as of Kubernetes
//! v1.35-v1.37, where `PreferSameTrafficDistribution` is GA): internal/external traffic policies
//! (KEP-2086, KEP-1672), falling back to serving-terminating endpoints (KEP-1669), and topology
//! from EndpointSlice hints (KEP-2433 topology-aware routing, KEP-4444/KEP-3015
//! trafficDistribution). As upstream, topology is driven by the hints alone: the EndpointSlice
//! controller only writes hints when `spec.trafficDistribution` or the topology annotation asks
//! for them, so `ServicePortInfo::traffic_distribution` and `topology_mode` are not consulted here.

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::{Endpoint, ServicePortInfo};
use crate::node::NodeInfo;

/// The endpoints of one Service port, sorted by use (kube-proxy `CategorizeEndpoints`' results).
///
/// Upstream returns nil for a list the Service never uses; here such a list is empty, and callers
/// tell "unused" from "no endpoint" with `ServicePortInfo::uses_cluster_endpoints` and
/// `uses_local_endpoints`. Every list keeps the order of the input.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CategorizedEndpoints {
    /// Endpoints for Cluster-policy traffic, topology applied; empty when the port never uses
    /// Cluster policy (`!uses_cluster_endpoints()`).
    pub cluster: Vec<Endpoint>,
    /// This node's endpoints for Local-policy traffic (no topology); empty when the port never uses
    /// Local policy (`!uses_local_endpoints()`).
    pub local: Vec<Endpoint>,
    /// The union of `cluster` and `local`: every endpoint this node may send traffic to.
    pub all_reachable: Vec<Endpoint>,
    /// Whether the Service has a usable endpoint anywhere in the cluster (even if none is
    /// reachable from this node): tells "drop, no endpoints" (reject) from "not here" (drop).
    pub has_any: bool,
}

/// Which endpoints Cluster-policy traffic may use: kube-proxy's topology modes, as returned by
/// `topologyModeFromHints` ("", `PreferSameZone`, `PreferSameNode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TopologyMode {
    /// No topology: every ready endpoint.
    #[default]
    None,
    /// Endpoints whose zone hints name this node's zone.
    PreferSameZone,
    /// Endpoints whose node hints name this node.
    PreferSameNode,
}

/// kube-proxy `CategorizeEndpoints` (`pkg/proxy/topology.go`).
///
/// - No endpoints at all: everything empty, `has_any` false.
/// - Cluster (when `svc.uses_cluster_endpoints()`): ready endpoints that are available for the
///   topology mode chosen by [`topology_mode_from_hints`]; if there are none, every serving and
///   terminating endpoint, ignoring topology (by then no endpoint is ready anywhere: topology was
///   already turned off if this zone/node had no ready endpoint).
/// - Local (when `svc.uses_local_endpoints()`): this node's ready endpoints, else this node's
///   serving and terminating ones; never filtered by topology. `has_any` is set if any endpoint
///   anywhere is ready, or serving and terminating.
/// - `all_reachable`: `cluster` alone when it is a superset of `local` (no topology and no
///   terminating fallback for Local), else the union of both.
pub fn categorize_endpoints(
    endpoints: &[Endpoint],
    svc: &ServicePortInfo,
    node: &NodeInfo,
) -> CategorizedEndpoints {
    let mut out = CategorizedEndpoints::default();
    if endpoints.is_empty() {
        return out;
    }
    let node_name = node.name.as_str();
    let zone = node.zone.as_deref().unwrap_or_default();
    let mut mode = TopologyMode::None;

    if svc.uses_cluster_endpoints() {
        mode = topology_mode_from_hints(endpoints, node_name, zone);
        out.cluster = filter(endpoints, |ep| {
            ep.ready && available_for_topology(ep, mode, node_name, zone)
        });
        // If we didn't get any endpoints, try again using terminating endpoints. (Topology was
        // already ignored if there were no ready endpoints for it, so the problem here must be that
        // no endpoint is ready anywhere.)
        if out.cluster.is_empty() {
            out.cluster = filter(endpoints, |ep| ep.serving && ep.terminating);
        }
        out.has_any = !out.cluster.is_empty();
    }

    if !svc.uses_local_endpoints() {
        out.all_reachable = out.cluster.clone();
        return out;
    }

    // Pre-scan: which kind of endpoint Local policy will use, and whether any usable endpoint
    // exists anywhere in the cluster.
    let mut has_local_ready = false;
    let mut has_local_serving_terminating = false;
    for ep in endpoints {
        if ep.ready {
            out.has_any = true;
            has_local_ready |= ep.is_local;
        } else if ep.serving && ep.terminating {
            out.has_any = true;
            has_local_serving_terminating |= ep.is_local;
        }
    }
    let mut use_serving_terminating = false;
    if has_local_ready {
        out.local = filter(endpoints, |ep| ep.is_local && ep.ready);
    } else if has_local_serving_terminating {
        use_serving_terminating = true;
        out.local = filter(endpoints, |ep| ep.is_local && ep.serving && ep.terminating);
    }

    if !svc.uses_cluster_endpoints() {
        out.all_reachable = out.local.clone();
        return out;
    }
    if mode == TopologyMode::None && !use_serving_terminating {
        // `local` holds only ready endpoints and `cluster` every ready endpoint: a superset.
        out.all_reachable = out.cluster.clone();
        return out;
    }
    // `cluster` may hold remote endpoints that are not in `local`, and `local` terminating or
    // topologically-unavailable local endpoints that are not in `cluster`: merge (by ip:port, as
    // upstream keys it by `Endpoint.String()`), keeping the input order.
    let keys: BTreeSet<(IpAddr, u16)> = out
        .cluster
        .iter()
        .chain(&out.local)
        .map(|ep| (ep.ip, ep.port))
        .collect();
    out.all_reachable = filter(endpoints, |ep| keys.contains(&(ep.ip, ep.port)));
    out
}

/// kube-proxy `topologyModeFromHints`: looking at ready endpoints only,
/// - if every one has a node hint and at least one is hinted for `node_name` -> `PreferSameNode`
///   (`PreferSameTrafficDistribution`, GA since v1.35, so always on);
/// - otherwise, if every one has a zone hint and at least one is hinted for `zone` ->
///   `PreferSameZone` (an empty `zone`, a node without the zone label, matches no hint);
/// - otherwise (including: no ready endpoint) -> `None`.
pub fn topology_mode_from_hints(endpoints: &[Endpoint], node_name: &str, zone: &str) -> TopologyMode {
    let mut has_ready = false;
    let mut has_for_node = false;
    let mut all_have_node_hints = true;
    let mut has_for_zone = false;
    let mut all_have_zone_hints = true;
    for ep in endpoints.iter().filter(|ep| ep.ready) {
        has_ready = true;
        if ep.node_hints.is_empty() {
            all_have_node_hints = false;
        } else if ep.node_hints.contains(node_name) {
            has_for_node = true;
        }
        if ep.zone_hints.is_empty() {
            all_have_zone_hints = false;
        } else if ep.zone_hints.contains(zone) {
            has_for_zone = true;
        }
    }
    if !has_ready {
        TopologyMode::None
    } else if all_have_node_hints && has_for_node {
        TopologyMode::PreferSameNode
    } else if all_have_zone_hints && has_for_zone {
        TopologyMode::PreferSameZone
    } else {
        TopologyMode::None
    }
}

/// kube-proxy `availableForTopology`: whether `ep` may be used on this node in `mode` (no fallback
/// here; the fallback is in choosing the mode).
fn available_for_topology(ep: &Endpoint, mode: TopologyMode, node_name: &str, zone: &str) -> bool {
    match mode {
        TopologyMode::None => true,
        TopologyMode::PreferSameNode => ep.node_hints.contains(node_name),
        TopologyMode::PreferSameZone => ep.zone_hints.contains(zone),
    }
}

/// kube-proxy `filterEndpoints`.
fn filter(endpoints: &[Endpoint], predicate: impl Fn(&Endpoint) -> bool) -> Vec<Endpoint> {
    endpoints.iter().filter(|ep| predicate(ep)).cloned().collect()
}

#[cfg(test)]
mod tests;
