//! What the agent keeps of Services and its Node: the fields kube-proxy's rules read, nothing
//! else. Objects are pruned as they arrive (before a store holds them), because most of an
//! object's memory is what no proxy reads: `managedFields` (a JSON tree per field manager),
//! `kubectl.kubernetes.io/last-applied-configuration`, a Node's image list and conditions.
//! EndpointSlices, the bulk of a cluster, are kept in the model's own compact form instead
//! (`model::Slice`).
//!
//! Kept, by reader:
//! - Service: name, namespace, uid and resourceVersion (Events), labels (the informer selector's
//!   labels), the topology annotations (`model::service`), the `spec` but its `selector`, and
//!   `status.loadBalancer`;
//! - Node: name, uid, labels (the topology zone), `deletionTimestamp` and `spec.taints` (the
//!   health server's `NodeEligible`), `status.addresses` (the node IPs).

use k8s_openapi::{
    api::core::v1::{Node, NodeSpec, NodeStatus, Service, ServiceStatus},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use crate::model::service::{ANNOTATION_TOPOLOGY_AWARE_HINTS, ANNOTATION_TOPOLOGY_MODE};

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
        &[ANNOTATION_TOPOLOGY_AWARE_HINTS, ANNOTATION_TOPOLOGY_MODE],
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
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{
        api::core::v1::{LoadBalancerIngress, LoadBalancerStatus, NodeAddress, ServiceSpec, Taint},
        apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry},
    };

    use super::*;
    use crate::{
        model,
        sync::{node_info, node_primary_ips},
    };

    fn meta(annotations: &[(&str, &str)]) -> ObjectMeta {
        ObjectMeta {
            name: Some("web".into()),
            namespace: Some("shop".into()),
            uid: Some("u-1".into()),
            resource_version: Some("42".into()),
            labels: Some(BTreeMap::from([(
                "kubernetes.io/service-name".into(),
                "web".into(),
            )])),
            annotations: Some(
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            managed_fields: Some(vec![ManagedFieldsEntry {
                manager: Some("kubectl".into()),
                fields_v1: Some(FieldsV1(serde_json::json!({"f:spec": {"f:ports": {}}}))),
                ..Default::default()
            }]),
            owner_references: Some(vec![]),
            generation: Some(3),
            ..Default::default()
        }
    }

    #[test]
    fn a_service_keeps_what_the_model_reads_and_loses_the_rest() {
        let mut svc = Service {
            metadata: meta(&[
                (ANNOTATION_TOPOLOGY_MODE, "Auto"),
                ("kubectl.kubernetes.io/last-applied-configuration", "{...}"),
            ]),
            spec: Some(ServiceSpec {
                cluster_ip: Some("10.96.0.10".into()),
                cluster_ips: Some(vec!["10.96.0.10".into()]),
                ports: Some(vec![k8s_openapi::api::core::v1::ServicePort {
                    name: Some("http".into()),
                    port: 80,
                    ..Default::default()
                }]),
                type_: Some("LoadBalancer".into()),
                selector: Some(BTreeMap::from([("app".into(), "web".into())])),
                ..Default::default()
            }),
            status: Some(ServiceStatus {
                load_balancer: Some(LoadBalancerStatus {
                    ingress: Some(vec![LoadBalancerIngress {
                        ip: Some("192.0.2.1".into()),
                        ..Default::default()
                    }]),
                }),
                conditions: Some(vec![]),
            }),
        };
        let before = model::service_ports(&svc).unwrap();
        service(&mut svc);
        assert_eq!(model::service_ports(&svc).unwrap(), before);
        let m = &svc.metadata;
        assert_eq!(m.managed_fields, None);
        assert_eq!(m.owner_references, None);
        assert_eq!(m.generation, None);
        assert_eq!(
            m.annotations,
            Some(BTreeMap::from([(ANNOTATION_TOPOLOGY_MODE.into(), "Auto".into())]))
        );
        assert_eq!(
            (m.uid.as_deref(), m.resource_version.as_deref()),
            (Some("u-1"), Some("42"))
        );
        assert_eq!(svc.spec.as_ref().unwrap().selector, None);
        let status = svc.status.unwrap();
        assert!(status.load_balancer.is_some() && status.conditions.is_none());
    }

    #[test]
    fn a_node_keeps_its_zone_addresses_taints_and_deletion() {
        let mut n = Node {
            metadata: ObjectMeta {
                name: Some("node-a".into()),
                labels: Some(BTreeMap::from([(
                    crate::sync::ZONE_LABEL.into(),
                    "zone-a".into(),
                )])),
                deletion_timestamp: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                )),
                ..meta(&[])
            },
            spec: Some(NodeSpec {
                pod_cidr: Some("10.244.1.0/24".into()),
                taints: Some(vec![Taint {
                    key: crate::health::TO_BE_DELETED_TAINT.into(),
                    effect: "NoSchedule".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                addresses: Some(vec![NodeAddress {
                    type_: "InternalIP".into(),
                    address: "192.168.50.11".into(),
                }]),
                images: Some(vec![Default::default(); 3]),
                ..Default::default()
            }),
        };
        node(&mut n);
        assert_eq!(node_info("node-a", Some(&n)).zone.as_deref(), Some("zone-a"));
        assert_eq!(
            node_primary_ips(Some(&n)),
            vec!["192.168.50.11".parse::<std::net::Ipv4Addr>().unwrap()]
        );
        assert!(!crate::health::node_eligible(&n));
        assert!(n.status.unwrap().images.is_none());
        assert!(n.spec.unwrap().pod_cidr.is_none());
    }
}
