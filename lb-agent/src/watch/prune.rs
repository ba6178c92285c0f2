//! What the agent keeps of Services and its Node: the fields kube-proxy's rules read, nothing
//! else. Objects are pruned as they arrive (before a store holds them), because most of an
//! object's memory is what no proxy reads: `managedFields` (a JSON tree per field manager),
//! `kubectl.kubernetes.io/last-applied-configuration`, a Node's image list and conditions.
//! EndpointSlices, the bulk of a cluster, are kept in the model's own compact form instead
//! (`model::Slice`).
//!
//! Kept, by reader:
//! - Service: name, namespace, uid and resourceVersion (Events), labels (the informer selector's
//!   labels), the topology and algorithm annotations (`model::service`), the `spec` but its `selector`, and
//!   `status.loadBalancer`;
//! - Node: name, uid, labels (the topology zone), `deletionTimestamp` and `spec.taints` (the
//!   health server's `NodeEligible`), `status.addresses` (the node IPs).

use k8s_openapi::{
    api::core::v1::{Node, NodeSpec, NodeStatus, Service, ServiceStatus},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::{
    ANNOTATION_LB_ALGORITHM, ANNOTATION_LB_ALGORITHM_CILIUM, ANNOTATION_TOPOLOGY_AWARE_HINTS,
    ANNOTATION_TOPOLOGY_MODE,
};

/// The metadata every kept object needs; `annotations` keeps only the keys listed.
fn prune_meta(meta: &mut ObjectMeta, keep_annotations: &[&str]) {
    let all = std::mem::take(meta);
    *meta = ObjectMeta {
        annotations: all
            .annotations
            .map(|mut annotations| {
                annotations.retain(|k, _| keep_annotations.contains(&k.as_str()));
                annotations
            })
            .filter(|kept| !kept.is_empty()),
        name: all.name,
        namespace: all.namespace,
        uid: all.uid,
        resource_version: all.resource_version,
        labels: all.labels,
        deletion_timestamp: all.deletion_timestamp,
        ..ObjectMeta::default()
    };
}

pub fn service(svc: &mut Service) {
    prune_meta(
        &mut svc.metadata,
        &[
            ANNOTATION_TOPOLOGY_AWARE_HINTS,
            ANNOTATION_TOPOLOGY_MODE,
            ANNOTATION_LB_ALGORITHM,
            ANNOTATION_LB_ALGORITHM_CILIUM,
        ],
    );
    // Which pods back a Service is the EndpointSlice controller's business, not a proxy's.
    if let Some(spec) = svc.spec.as_mut() {
        spec.selector = None;
    }
    svc.status = svc.status.take().and_then(|s| {
        s.load_balancer.map(|lb| ServiceStatus {
            load_balancer: Some(lb),
            ..ServiceStatus::default()
        })
    });
}

pub fn node(node: &mut Node) {
    prune_meta(&mut node.metadata, &[]);
    node.spec = node.spec.take().map(|s| NodeSpec {
        taints: s.taints,
        ..NodeSpec::default()
    });
    node.status = node.status.take().map(|s| NodeStatus {
        addresses: s.addresses,
        ..NodeStatus::default()
    });
}

#[cfg(test)]
mod tests;
