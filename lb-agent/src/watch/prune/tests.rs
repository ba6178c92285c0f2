use std::collections::BTreeMap;

use k8s_openapi::{
    api::core::v1::{NodeAddress, Taint},
    apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry},
};

use super::*;
use crate::node::object;

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
fn a_node_keeps_its_zone_addresses_taints_and_deletion() {
    let mut n = Node {
        metadata: ObjectMeta {
            name: Some("node-a".into()),
            labels: Some(BTreeMap::from([(
                crate::node::ZONE_LABEL.into(),
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
                key: crate::node::object::TO_BE_DELETED_TAINT.into(),
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
    assert_eq!(object::zone(Some(&n)).as_deref(), Some("zone-a"));
    assert_eq!(
        object::primary_ips(Some(&n)),
        vec!["192.168.50.11".parse::<std::net::Ipv4Addr>().unwrap()]
    );
    assert!(!crate::node::object::node_eligible(&n));
    assert!(n.status.unwrap().images.is_none());
    assert!(n.spec.unwrap().pod_cidr.is_none());
}
