//! Proxy health: the pending-update rule, the `/healthz` and `/livez` bodies, routes, metrics, and a
//! real listener.

use axum::http::Method;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;
use crate::{
    health::test_support::{TIMEOUT, get, node, setup, tainted},
    node::object::TO_BE_DELETED_TAINT,
};

/// Upstream's `testProxyHealthUpdater`, for the single IPv4 proxier.
#[test]
fn health_follows_queued_and_updated() {
    let (clock, health) = setup();
    // Healthy by default, and while starting up even with a pending update.
    assert!(health.is_healthy());
    health.queued_update();
    clock.step(TIMEOUT * 3);
    assert!(health.is_healthy(), "healthy before the first sync");

    health.updated();
    assert_eq!(health.health().last_updated, Some(clock.now()));
    assert_eq!(health.health().oldest_pending, None);
    clock.step(Duration::from_secs(25));
    assert!(
        health.is_healthy(),
        "no update pending: healthy however long ago the last sync"
    );

    health.queued_update();
    let queued_at = clock.now();
    clock.step(TIMEOUT - Duration::from_millis(1));
    assert!(health.is_healthy(), "pending, but not late yet");
    // A second queued update does not move the pending time.
    health.queued_update();
    assert_eq!(health.health().oldest_pending, Some(queued_at));
    clock.step(Duration::from_millis(1));
    assert!(!health.is_healthy(), "pending for the whole timeout");

    health.updated();
    assert!(health.is_healthy());
}
#[tokio::test]
async fn healthz_and_livez_bodies() {
    let (clock, health) = setup();
    let metrics = Metrics::new();
    let health = health.with_metrics(metrics.clone());
    let router = proxy_health_router(health.clone());
    let start = clock.now();

    // Default: 200, no status yet, lastUpdated = now.
    let (code, headers, body) = get(router.clone(), Method::GET, "/healthz").await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(headers[header::CONTENT_TYPE], "application/json");
    assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    let now = format_go_time(Some(start));
    assert_eq!(
        body,
        format!(r#"{{"lastUpdated":"{now}","currentTime":"{now}","nodeEligible":true,"healthy":true}}"#)
    );
    let (code, _, body) = get(router.clone(), Method::GET, "/livez").await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(
        body,
        format!(r#"{{"lastUpdated":"{now}","currentTime":"{now}","healthy":true}}"#)
    );

    // After a sync: status shows the proxier's own lastUpdated; the top-level one is still "now".
    health.updated();
    clock.step(Duration::from_secs(5));
    let synced = format_go_time(Some(start));
    let now = format_go_time(Some(clock.now()));
    let (code, _, body) = get(router.clone(), Method::GET, "/healthz").await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(
        body,
        format!(
            r#"{{"lastUpdated":"{now}","currentTime":"{now}","nodeEligible":true,"healthy":true,"status":{{"IPv4":{{"lastUpdated":"{synced}","healthy":true}}}}}}"#
        )
    );

    // Late update: 503 on both, lastUpdated is the last sync.
    health.queued_update();
    clock.step(TIMEOUT);
    let now = format_go_time(Some(clock.now()));
    let (code, _, body) = get(router.clone(), Method::GET, "/healthz").await;
    assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        body,
        format!(
            r#"{{"lastUpdated":"{synced}","currentTime":"{now}","nodeEligible":true,"healthy":false,"status":{{"IPv4":{{"lastUpdated":"{synced}","healthy":false}}}}}}"#
        )
    );
    let (code, _, _) = get(router.clone(), Method::GET, "/livez").await;
    assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);

    let text = metrics.encode();
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_livez_total{code=\"200\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_livez_total{code=\"503\"} 1"),
        "{text}"
    );
}
/// Upstream's `TestHealthzServer` / `TestLivezServer` node cases.
#[tokio::test]
async fn node_eligibility_affects_healthz_only() {
    let (_clock, health) = setup();
    let router = proxy_health_router(health.clone());
    health.updated();

    for (tweak, eligible) in [
        (Box::new(tainted("other")) as Box<dyn FnOnce(&mut Node)>, true),
        (Box::new(tainted(TO_BE_DELETED_TAINT)), false),
        (Box::new(|_: &mut Node| {}), true),
        (
            Box::new(|n: &mut Node| {
                n.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH))
            }),
            false,
        ),
    ] {
        health.set_node(&node(tweak));
        assert_eq!(health.node_eligible(), eligible);
        let (code, _, body) = get(router.clone(), Method::GET, "/healthz").await;
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(json["nodeEligible"], eligible);
        // The proxy itself is healthy; only the status code reflects the node.
        assert_eq!(json["healthy"], true);
        assert_eq!(
            code,
            if eligible {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            }
        );
        let (code, _, body) = get(router.clone(), Method::GET, "/livez").await;
        assert_eq!(code, StatusCode::OK, "livez ignores the node");
        assert!(!body.contains("nodeEligible"));
    }
    health.set_node_eligible(false);
    assert!(!health.node_eligible());
}
#[tokio::test]
async fn proxy_health_routes() {
    let (_clock, health) = setup();
    let router = proxy_health_router(health);
    assert_eq!(
        get(router.clone(), Method::POST, "/healthz").await.0,
        StatusCode::OK
    );
    assert_eq!(
        get(router.clone(), Method::GET, "/").await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        get(router.clone(), Method::GET, "/healthz/extra").await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        get(router, Method::GET, "/metrics").await.0,
        StatusCode::NOT_FOUND
    );
}
#[tokio::test]
async fn metrics_attached_later_apply_to_every_clone() {
    let (_clock, health) = setup();
    let router = proxy_health_router(health.clone());
    let metrics = Metrics::new();
    health.set_metrics(metrics.clone());
    assert_eq!(get(router, Method::GET, "/livez").await.0, StatusCode::OK);
    assert!(
        metrics
            .encode()
            .contains("kubeproxy_proxy_livez_total{code=\"200\"} 1")
    );
}
#[tokio::test]
async fn proxy_health_server_on_a_real_listener() {
    let (_clock, health) = setup();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(serve_proxy_health_on(listener, health.clone(), shutdown.clone()));

    let response = crate::test_util::http_get(addr, "/livez").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("\"healthy\":true"));

    // Port taken: a clear error naming the address.
    let err = serve_proxy_health(addr, health, CancellationToken::new())
        .await
        .unwrap_err();
    let message = format!("{err:#}");
    assert!(
        message.contains("failed to start proxy healthz") && message.contains(&addr.to_string()),
        "{message}"
    );

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
