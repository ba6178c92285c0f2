//! Service health checks: the body, the router, grouping ports by Service, and real listeners.

use std::time::Duration;

use axum::http::{Method, header};

use super::*;
use crate::test_util::http_get;
use crate::{
    health::test_support::{TIMEOUT, get, setup},
    model::{Protocol, ServicePortName},
};

fn svc(namespace: &str, name: &str, local_endpoints: usize) -> HealthCheckService {
    HealthCheckService {
        namespace: namespace.into(),
        name: name.into(),
        local_endpoints,
    }
}
#[test]
fn service_body_is_upstreams_layout() {
    assert_eq!(
        service_health_body(&svc("default", "web", 2), true),
        "{\n\t\"service\": {\n\t\t\"namespace\": \"default\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
    );
    let parsed: serde_json::Value =
        serde_json::from_str(&service_health_body(&svc("a\"b", "c", 0), false)).unwrap();
    assert_eq!(parsed["service"]["namespace"], "a\"b");
    assert_eq!(parsed["localEndpoints"], 0);
    assert_eq!(parsed["serviceProxyHealthy"], false);
}
#[tokio::test]
async fn service_router_answers_every_path() {
    let (clock, health) = setup();
    let shared = Arc::new(RwLock::new(svc("ns", "web", 3)));
    let router = service_health_router(shared.clone(), health.clone());
    for path in ["/", "/healthz", "/anything/at/all?x=1"] {
        let (code, headers, body) = get(router.clone(), Method::GET, path).await;
        assert_eq!(code, StatusCode::OK, "{path}");
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
        assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert_eq!(headers["x-load-balancing-endpoint-weight"], "3");
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(json["service"]["name"], "web");
        assert_eq!(json["localEndpoints"], 3);
        assert_eq!(json["serviceProxyHealthy"], true);
    }
    assert_eq!(get(router.clone(), Method::HEAD, "/").await.0, StatusCode::OK);

    // No local endpoints: 503.
    shared.write().unwrap().local_endpoints = 0;
    let (code, headers, _) = get(router.clone(), Method::GET, "/").await;
    assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["x-load-balancing-endpoint-weight"], "0");

    // Endpoints, but the proxy is unhealthy: 503 too.
    shared.write().unwrap().local_endpoints = 1;
    health.updated();
    health.queued_update();
    clock.step(TIMEOUT);
    let (code, _, body) = get(router.clone(), Method::GET, "/").await;
    assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("\"serviceProxyHealthy\": false"));

    // Node eligibility does not matter for Service health checks.
    health.updated();
    health.set_node_eligible(false);
    assert_eq!(get(router, Method::GET, "/").await.0, StatusCode::OK);
}
#[test]
fn targets_group_ports_of_a_service() {
    let spn = |ns: &str, name: &str, port: &str| ServicePortName {
        namespace: ns.into(),
        name: name.into(),
        port: port.into(),
        protocol: Protocol::Tcp,
    };
    let check = |family, node_port, service, local_ready| HealthCheck {
        family,
        node_port,
        service,
        local_ready,
    };
    let (v4, v6) = (IpFamily::V4, IpFamily::V6);
    let targets = targets_from_health_checks(&[
        check(v4, 30001, spn("ns", "web", "http"), 2),
        check(v4, 30001, spn("ns", "web", "https"), 2),
        check(v6, 30001, spn("ns", "web", "http"), 1),
        check(v4, 30002, spn("ns", "dns", ""), 0),
        check(v4, 30002, spn("other", "intruder", ""), 5),
    ]);
    assert_eq!(targets.len(), 3);
    assert_eq!(targets[&(v4, 30001)], svc("ns", "web", 4));
    assert_eq!(
        targets[&(v6, 30001)],
        svc("ns", "web", 1),
        "each family counts its own endpoints"
    );
    assert_eq!(targets[&(v4, 30002)], svc("ns", "dns", 0));
}
async fn wait_closed(addr: SocketAddr) {
    tokio::time::timeout(Duration::from_secs(5), async {
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("listener closes");
}
#[tokio::test]
async fn service_servers_open_update_and_close_real_listeners() {
    let (_clock, health) = setup();
    let mut servers = ServiceHealthServers::new(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)], health);
    // Pick two free ports.
    let free = |_| {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let (p1, p2): (u16, u16) = (free(0), free(1));
    let (p1, p2) = ((IpFamily::V4, p1), (IpFamily::V4, p2));

    let mut wanted = BTreeMap::from([(p1, svc("ns", "a", 1)), (p2, svc("ns", "b", 0))]);
    let errors = servers.sync(&wanted);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(servers.ports().len(), 2);
    let a1 = servers.local_addrs(p1).unwrap()[0];
    let a2 = servers.local_addrs(p2).unwrap()[0];
    assert_eq!(a1.port(), p1.1);

    let r = http_get(a1, "/").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.contains("\"name\": \"a\""));
    assert!(http_get(a2, "/").await.starts_with("HTTP/1.1 503"));

    // Update in place: b gains an endpoint, a loses its own.
    wanted.insert(p2, svc("ns", "b", 4));
    wanted.insert(p1, svc("ns", "a", 0));
    assert!(servers.sync(&wanted).is_empty());
    assert_eq!(servers.local_addrs(p2).unwrap()[0], a2, "same listener");
    let r = http_get(a2, "/").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.contains("\"localEndpoints\": 4"));
    assert!(http_get(a1, "/").await.starts_with("HTTP/1.1 503"));

    // Remove a: its port closes, b stays.
    wanted.remove(&p1);
    assert!(servers.sync(&wanted).is_empty());
    assert_eq!(servers.ports(), vec![p2]);
    wait_closed(a1).await;
    assert!(http_get(a2, "/").await.starts_with("HTTP/1.1 200"));

    // Dropping the set closes everything.
    drop(servers);
    wait_closed(a2).await;
}
#[tokio::test]
async fn taken_port_is_reported_and_retried() {
    let (_clock, health) = setup();
    let blocker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = blocker.local_addr().unwrap().port();
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut servers = ServiceHealthServers::new(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)], health);
    let (taken, free) = ((IpFamily::V4, taken), (IpFamily::V4, free));
    let wanted = BTreeMap::from([(taken, svc("ns", "blocked", 1)), (free, svc("ns", "ok", 1))]);

    let errors = servers.sync(&wanted);
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].port, taken.1);
    assert_eq!(errors[0].error.kind(), io::ErrorKind::AddrInUse);
    let message = errors[0].to_string();
    assert!(
        message.contains("ns/blocked") && message.contains(&taken.1.to_string()),
        "{message}"
    );
    assert_eq!(servers.ports(), vec![free], "the other port still opens");

    // Once the port is free, the next sync opens it.
    drop(blocker);
    assert!(servers.sync(&wanted).is_empty());
    assert_eq!(servers.ports().len(), 2);
    let r = http_get(servers.local_addrs(taken).unwrap()[0], "/").await;
    assert!(r.contains("\"name\": \"blocked\""), "{r}");
    servers.close_all();
    assert!(servers.ports().is_empty());
}
#[test]
fn default_bind_address_is_every_address_of_each_family() {
    let (_clock, health) = setup();
    let servers = ServiceHealthServers::new(Vec::new(), health.clone());
    assert_eq!(servers.addresses.v4, vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)]);
    assert_eq!(servers.addresses.v6, vec![IpAddr::V6(Ipv6Addr::UNSPECIFIED)]);
    let only_v4 = ServiceHealthServers::new(vec!["10.0.0.1".parse().unwrap()], health);
    assert_eq!(only_v4.addresses.v4, vec!["10.0.0.1".parse::<IpAddr>().unwrap()]);
    assert_eq!(only_v4.addresses.v6, vec![IpAddr::V6(Ipv6Addr::UNSPECIFIED)]);
}

/// A dual-stack Service's health-check port is open once per family, on the same port number,
/// each answering with its own family's endpoints (the IPv6 listener is IPv6-only).
#[tokio::test]
async fn one_port_per_family() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("skipped: no IPv6 loopback here");
        return;
    }
    let (_clock, health) = setup();
    let mut servers = ServiceHealthServers::new(
        vec![IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)],
        health,
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let wanted = BTreeMap::from([
        ((IpFamily::V4, port), svc("ns", "dual", 2)),
        ((IpFamily::V6, port), svc("ns", "dual", 0)),
    ]);
    let errors = servers.sync(&wanted);
    assert!(errors.is_empty(), "{errors:?}");
    let v4 = servers.local_addrs((IpFamily::V4, port)).unwrap()[0];
    let v6 = servers.local_addrs((IpFamily::V6, port)).unwrap()[0];
    assert!(v4.is_ipv4() && v6.is_ipv6() && v4.port() == v6.port());
    assert!(http_get(v4, "/").await.starts_with("HTTP/1.1 200"));
    let r = http_get(v6, "/").await;
    assert!(
        r.starts_with("HTTP/1.1 503") && r.contains("\"localEndpoints\": 0"),
        "{r}"
    );
}
