use super::*;

use axum::body::Body;
use axum::http::Request;
use http_body_util::BodyExt;
use tower::ServiceExt;

/// The value of the sample line starting with `prefix` (name plus labels).
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(prefix)?;
        let value = rest.strip_prefix(' ')?;
        value.split(' ').next()?.parse().ok()
    })
}

#[test]
fn buckets_match_upstream() {
    let sync = sync_duration_buckets();
    assert_eq!(sync.len(), 15);
    assert_eq!(sync[0], 0.001);
    assert_eq!(sync[14], 0.001 * 2f64.powi(14));

    let np = network_programming_buckets();
    assert_eq!(np.len(), 1 + 2 + 59 + 12 + 7);
    assert_eq!(&np[..4], &[0.0, 0.25, 0.5, 1.0]);
    assert_eq!(np[61], 59.0);
    assert_eq!(np[62], 60.0);
    assert_eq!(np[73], 115.0);
    assert_eq!(np[74], 120.0);
    assert_eq!(*np.last().unwrap(), 300.0);
    assert!(np.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn kube_proxy_names_are_exposed() {
    let m = Metrics::new();
    m.observe_sync_duration(Duration::from_millis(3));
    m.sync_succeeded(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    m.sync_queued(UNIX_EPOCH + Duration::from_millis(1_700_000_001_500));
    m.observe_network_programming(Duration::from_millis(1500));
    m.endpoint_changes(3);
    m.endpoint_changes(2);
    m.set_endpoint_changes_pending(4);
    m.service_changes(7);
    m.set_service_changes_pending(1);
    m.set_no_local_endpoints(2, 5);
    m.proxy_healthz(200);
    m.proxy_healthz(200);
    m.proxy_healthz(503);
    m.proxy_livez(200);
    let text = m.encode();

    assert!(
        text.contains("# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram"),
        "{text}"
    );
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_duration_seconds_count"),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.002\"}"
        ),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &text,
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_last_timestamp_seconds"),
        Some(1_700_000_000.0)
    );
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds"),
        Some(1_700_000_001.5)
    );
    assert!(text.contains("# TYPE kubeproxy_network_programming_duration_seconds histogram"));
    assert_eq!(
        sample(
            &text,
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"1.0\"}"
        ),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &text,
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"2.0\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "kubeproxy_network_programming_duration_seconds_sum"),
        Some(1.5)
    );

    assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_endpoint_changes counter"));
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_endpoint_changes_total"),
        Some(5.0)
    );
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_endpoint_changes_pending"),
        Some(4.0)
    );
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_service_changes_total"),
        Some(7.0)
    );
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_service_changes_pending"),
        Some(1.0)
    );

    assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge"));
    assert_eq!(
        sample(
            &text,
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"}"
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &text,
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"}"
        ),
        Some(5.0)
    );

    assert!(text.contains("# TYPE kubeproxy_proxy_healthz counter"));
    assert_eq!(
        sample(&text, "kubeproxy_proxy_healthz_total{code=\"200\"}"),
        Some(2.0)
    );
    assert_eq!(
        sample(&text, "kubeproxy_proxy_healthz_total{code=\"503\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "kubeproxy_proxy_livez_total{code=\"200\"}"),
        Some(1.0)
    );
    assert_eq!(sample(&text, "kubeproxy_proxy_livez_total{code=\"503\"}"), None);
    assert!(text.ends_with("# EOF\n"));
}

#[test]
fn fresh_registry_shows_unlabelled_metrics_and_policy_gauges() {
    let text = Metrics::new().encode();
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_endpoint_changes_total"),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_duration_seconds_count"),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &text,
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"}"
        ),
        Some(0.0)
    );
    // Labelled families without samples are left out, as client_golang does.
    assert!(!text.contains("kubeproxy_proxy_healthz"));
    assert!(!text.contains("lb_datapath_events"));
}

/// The process's memory, read at the scrape: resident bytes as Go's process collector names them,
/// and the heap split the soak uses to tell a leak (`in_use` grows) from the allocator keeping
/// freed memory (`free` grows); memory the test holds shows in `in_use`.
#[test]
fn memory_is_read_at_each_scrape() {
    let m = Metrics::new();
    let before = m.encode();
    let rss = sample(&before, "process_resident_memory_bytes").expect("resident memory");
    assert!(rss > 1e6, "{rss}");
    assert!(before.contains("# TYPE process_resident_memory_bytes gauge"));
    assert!(sample(&before, "lb_agent_heap_bytes{state=\"free\"}").is_some());
    let in_use = |text: &str| sample(text, "lb_agent_heap_bytes{state=\"in_use\"}").expect("heap in use");
    // The heap is the whole test process's: tests on other threads allocate and free while this
    // one measures (CI once saw 13 of 16 MiB). So hold 64 MiB (in 4 KiB pieces, below glibc's
    // mmap threshold, touched), ask for half of it, and give three tries before failing.
    let mut seen = Vec::new();
    for _ in 0..3 {
        let before = in_use(&m.encode());
        let held: Vec<Vec<u8>> = (0..16384).map(|i| vec![i as u8; 4096]).collect();
        let after = in_use(&m.encode());
        drop(held);
        if after >= before + 32.0 * 1024.0 * 1024.0 {
            return;
        }
        seen.push(format!("{before} -> {after}"));
    }
    panic!("64 MiB held never showed in the heap's in-use bytes: {seen:?}");
}

#[test]
fn map_metrics() {
    let m = Metrics::new();
    m.set_map_occupancy("lb_services", 10, 65536);
    m.set_map_occupancy("lb_backends", 3, 65536);
    m.set_map_occupancy("lb_services", 12, 65536);
    m.map_write_errors("lb_backends", 2);
    m.map_write_errors("lb_backends", 1);
    let text = m.encode();
    assert_eq!(sample(&text, "lb_map_entries{map=\"lb_services\"}"), Some(12.0));
    assert_eq!(sample(&text, "lb_map_entries{map=\"lb_backends\"}"), Some(3.0));
    assert_eq!(
        sample(&text, "lb_map_capacity{map=\"lb_services\"}"),
        Some(65536.0)
    );
    assert!(text.contains("# TYPE lb_map_write_errors counter"));
    assert_eq!(
        sample(&text, "lb_map_write_errors_total{map=\"lb_backends\"}"),
        Some(3.0)
    );
}

#[test]
fn datapath_events_follow_absolute_totals() {
    let m = Metrics::new();
    m.set_datapath_events(&[("translated", 100), ("no_backend", 2)]);
    let text = m.encode();
    assert!(text.contains("# TYPE lb_datapath_events counter"), "{text}");
    assert_eq!(
        sample(&text, "lb_datapath_events_total{event=\"translated\"}"),
        Some(100.0)
    );
    assert_eq!(
        sample(&text, "lb_datapath_events_total{event=\"no_backend\"}"),
        Some(2.0)
    );

    // Growth is passed through; unlisted events keep their value.
    m.set_datapath_events(&[("translated", 150)]);
    let text = m.encode();
    assert_eq!(
        sample(&text, "lb_datapath_events_total{event=\"translated\"}"),
        Some(150.0)
    );
    assert_eq!(
        sample(&text, "lb_datapath_events_total{event=\"no_backend\"}"),
        Some(2.0)
    );

    // The stats map was recreated: totals restart from 0, the counter does not go down.
    m.set_datapath_events(&[("translated", 10)]);
    assert_eq!(
        sample(&m.encode(), "lb_datapath_events_total{event=\"translated\"}"),
        Some(160.0)
    );
    m.set_datapath_events(&[("translated", 15)]);
    assert_eq!(
        sample(&m.encode(), "lb_datapath_events_total{event=\"translated\"}"),
        Some(165.0)
    );
    // Same total again: no change.
    m.set_datapath_events(&[("translated", 15)]);
    assert_eq!(
        sample(&m.encode(), "lb_datapath_events_total{event=\"translated\"}"),
        Some(165.0)
    );
}

#[test]
fn services_skipped_replaces_reasons() {
    let m = Metrics::new();
    m.set_services_skipped(&[("map full", 3), ("too many backends", 1)]);
    let text = m.encode();
    assert_eq!(
        sample(&text, "lb_services_skipped{reason=\"map full\"}"),
        Some(3.0)
    );
    assert_eq!(
        sample(&text, "lb_services_skipped{reason=\"too many backends\"}"),
        Some(1.0)
    );
    m.set_services_skipped(&[("map full", 1)]);
    let text = m.encode();
    assert_eq!(
        sample(&text, "lb_services_skipped{reason=\"map full\"}"),
        Some(1.0)
    );
    assert!(!text.contains("too many backends"), "{text}");
    m.set_services_skipped(&[]);
    assert!(!m.encode().contains("lb_services_skipped{"));
    // Reasons with characters that need escaping survive the round trip.
    m.set_services_skipped(&[("quote \" and \\ slash", 2)]);
    m.set_services_skipped(&[]);
    assert!(!m.encode().contains("lb_services_skipped{"));
}

#[test]
fn clones_share_state() {
    let m = Metrics::new();
    let other = m.clone();
    other.service_changes(4);
    assert_eq!(
        sample(&m.encode(), "kubeproxy_sync_proxy_rules_service_changes_total"),
        Some(4.0)
    );
}

#[tokio::test]
async fn router_serves_openmetrics() {
    let m = Metrics::new();
    m.endpoint_changes(1);
    let response = router(m.clone())
        .oneshot(Request::builder().uri("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()[header::CONTENT_TYPE], OPENMETRICS_CONTENT_TYPE);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_endpoint_changes_total"),
        Some(1.0)
    );

    let response = router(m)
        .oneshot(Request::builder().uri("/other").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn serve_metrics_on_a_real_listener() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let m = Metrics::new();
    m.service_changes(9);
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(serve_metrics_on(listener, m, shutdown.clone()));

    let response = crate::test_util::http_get(addr, "/metrics").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(
        response
            .to_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0")
    );
    assert!(response.contains("kubeproxy_sync_proxy_rules_service_changes_total 9"));

    // The address is taken now: a second server fails with the address in the message.
    let err = serve_metrics(addr, Metrics::new(), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains(&addr.to_string()), "{err:#}");

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[test]
fn prefilter_bits_per_family() {
    let m = Metrics::new();
    m.set_prefilter_bits("IPv4", 1234);
    m.set_prefilter_bits("IPv6", 0);
    let text = m.encode();
    assert_eq!(
        sample(&text, "lb_tc_prefilter_bits{ip_family=\"IPv4\"}"),
        Some(1234.0)
    );
    assert_eq!(
        sample(&text, "lb_tc_prefilter_bits{ip_family=\"IPv6\"}"),
        Some(0.0)
    );
    assert!(text.contains("# TYPE lb_tc_prefilter_bits gauge"), "{text}");
}

#[test]
fn ct_filter_buckets_per_family() {
    let m = Metrics::new();
    m.set_ct_filter_buckets("IPv4", 77);
    m.set_ct_filter_buckets("IPv6", 3);
    let text = m.encode();
    assert_eq!(
        sample(&text, "lb_tc_ct_filter_buckets{ip_family=\"IPv4\"}"),
        Some(77.0)
    );
    assert_eq!(
        sample(&text, "lb_tc_ct_filter_buckets{ip_family=\"IPv6\"}"),
        Some(3.0)
    );
    assert!(text.contains("# TYPE lb_tc_ct_filter_buckets gauge"), "{text}");
}
