//! Node eligibility and the health timeout.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;
use crate::health::test_support::{node, tainted};

#[test]
fn eligibility_follows_upstream() {
    assert!(node_eligible(&node(|_| {})));
    assert!(node_eligible(&node(tainted("other"))));
    assert!(!node_eligible(&node(tainted(TO_BE_DELETED_TAINT))));
    assert!(!node_eligible(&node(|n| {
        n.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH))
    })));
}
#[test]
fn health_timeout_is_twice_the_sync_period() {
    assert_eq!(
        health_timeout_for(Duration::from_secs(30)),
        Duration::from_secs(60)
    );
}
