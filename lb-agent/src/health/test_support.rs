//! Helpers shared by the health tests: a clock that only moves when told to, a [`ProxyHealth`] on it,
//! one request through a router, and Node objects.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use axum::{
    Router,
    body::Body,
    http::{Method, Request, StatusCode},
};
use http_body_util::BodyExt;
use k8s_openapi::{
    api::core::v1::{Node, NodeSpec, Taint},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use tower::ServiceExt;

use super::{ProxyHealth, WallClock};

/// A wall clock that only moves when told to.
#[derive(Clone)]
pub(super) struct TestClock(Arc<Mutex<SystemTime>>);

impl TestClock {
    fn new() -> Self {
        Self(Arc::new(Mutex::new(
            UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        )))
    }
    pub(super) fn now(&self) -> SystemTime {
        *self.0.lock().unwrap()
    }
    pub(super) fn step(&self, by: Duration) {
        *self.0.lock().unwrap() += by;
    }
    fn wall(&self) -> WallClock {
        let me = self.clone();
        Arc::new(move || me.now())
    }
}

pub(super) const TIMEOUT: Duration = Duration::from_secs(10);

pub(super) fn setup() -> (TestClock, ProxyHealth) {
    let clock = TestClock::new();
    let health = ProxyHealth::with_clock(TIMEOUT, clock.wall());
    (clock, health)
}

pub(super) async fn get(
    router: Router,
    method: Method,
    path: &str,
) -> (StatusCode, axum::http::HeaderMap, String) {
    let response = router
        .oneshot(
            Request::builder()
                .method(method)
                .uri(path)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8(body.to_vec()).unwrap())
}

pub(super) fn node(tweak: impl FnOnce(&mut Node)) -> Node {
    let mut n = Node {
        metadata: ObjectMeta {
            name: Some("node-a".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    tweak(&mut n);
    n
}

pub(super) fn tainted(key: &str) -> impl FnOnce(&mut Node) + '_ {
    move |n| {
        n.spec
            .get_or_insert_with(NodeSpec::default)
            .taints
            .get_or_insert_with(Vec::new)
            .push(Taint {
                key: key.to_string(),
                effect: "NoSchedule".into(),
                ..Default::default()
            })
    }
}
