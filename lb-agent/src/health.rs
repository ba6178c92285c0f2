//! Whether the agent is healthy, over HTTP: kube-proxy's proxy health server (`/healthz`, `/livez` on
//! `--healthz-bind-address`, `pkg/proxy/healthcheck/proxy_health.go`) and the per-Service health-check
//! NodePort servers that cloud load balancers probe for `externalTrafficPolicy: Local` Services
//! (`pkg/proxy/healthcheck/service_health.go`).
//!
//! # Proxy health ([`ProxyHealth`], [`serve_proxy_health`])
//!
//! As upstream:
//!
//! * [`ProxyHealth::queued_update`] is called when a change that needs a sync is received: it records the
//!   time of the oldest pending update (only when none is pending); [`ProxyHealth::updated`] is called after
//!   a successful sync: it records the time and clears the pending update;
//! * the proxy is **healthy** unless an update has been pending for `health_timeout` or longer; kube-proxy
//!   uses `2 × syncPeriod` (`cmd/kube-proxy/app/server.go`; see [`health_timeout_for`]). Before the first
//!   successful sync the proxy counts as healthy ("healthy while it's starting up");
//! * `/healthz` additionally requires the node to be **eligible**: a Node with a `deletionTimestamp` or
//!   the `ToBeDeletedByClusterAutoscaler` taint is not, so load balancers drain the node before it goes
//!   away. `/livez` ignores eligibility;
//! * both answer `200` or `503` with `Content-Type: application/json` and `X-Content-Type-Options: nosniff`
//!   and a JSON body of upstream's `ProxyHealth` type (field order as upstream, times in Go's RFC 3339
//!   with nanoseconds, UTC):
//!   `{"lastUpdated":"…","currentTime":"…","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"…","healthy":true}}}`.
//!   `nodeEligible` only appears on `/healthz`, `status` only after the first sync; when healthy,
//!   `lastUpdated` is the current time (upstream keeps this for compatibility with older releases);
//! * each answer increments `kubeproxy_proxy_healthz_total{code}` / `kubeproxy_proxy_livez_total{code}` when
//!   a [`Metrics`] handle is attached ([`ProxyHealth::with_metrics`]).
//!
//! Differences: the agent is IPv4-only, so there is a single proxier (`IPv4`) in `status`. Upstream's current
//! code reads the Node from its node manager and reports the node ineligible while it has none; here the node
//! is eligible until [`ProxyHealth::set_node`] says otherwise (the behaviour of older releases, whose
//! `SyncNode` started from "eligible"), because the agent can run from manifests without any Node. Upstream retries a failed bind every 5 s unless
//! `bindAddressHardFail`; [`serve_proxy_health`] returns the error and leaves the policy to the caller.
//!
//! # Service health checks ([`ServiceHealthServers`])
//!
//! One HTTP listener per `healthCheckNodePort`, answering **every** path and method with
//! `{"service": {"namespace": …, "name": …}, "localEndpoints": N, "serviceProxyHealthy": bool}` (upstream's
//! tab-indented layout), `200` when `N > 0` and the proxy is healthy ([`ProxyHealth::is_healthy`], node
//! eligibility not included, as upstream) and `503` otherwise, plus the headers above and upstream's newer
//! `X-Load-Balancing-Endpoint-Weight: N`. [`ServiceHealthServers::sync`] opens new ports, closes removed
//! ones and updates the others in place (open connections keep working). Listeners bind the given
//! addresses (upstream: the node IPs selected by `nodePortAddresses`, or `0.0.0.0` when that matches
//! everything). A port that cannot be bound is reported in the returned list, not fatal, and retried by the
//! next `sync` (upstream logs it and emits a `FailedToStartServiceHealthcheck` event).
//!
//! Upstream keys these servers by Service and counts a Service's local ready endpoints across its ports
//! (`EndpointsMap.LocalReadyEndpoints`: distinct `ip:port` strings); here they are keyed by port, and
//! [`targets_from_health_checks`] sums the per-port counts of `sync::Computed::health_checks`, which is
//! the same number unless two ports of a Service target the same endpoint port.

use std::{
    collections::BTreeMap,
    fmt, io,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{Arc, RwLock},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context;
use axum::{
    Router,
    extract::State,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::any,
};
use k8s_openapi::api::core::v1::Node;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{metrics::Metrics, model::ServicePortName};

/// The taint the cluster autoscaler puts on a node it is about to delete
/// (`healthcheck.ToBeDeletedTaint`).
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// kube-proxy's health timeout for a given `syncPeriod`: `2 × syncPeriod`.
pub fn health_timeout_for(sync_period: Duration) -> Duration {
    sync_period.saturating_mul(2)
}

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

/// Formats a time as Go's `json.Marshal(time.Time)` does for a UTC time (`time.RFC3339Nano`: the fraction
/// without trailing zeros, and none when whole). `None` is Go's zero time, `0001-01-01T00:00:00Z`.
pub fn format_go_time(t: Option<SystemTime>) -> String {
    let Some(t) = t else {
        return "0001-01-01T00:00:00Z".to_string();
    };
    let nanos_since_epoch: i128 = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    };
    let secs = nanos_since_epoch.div_euclid(1_000_000_000) as i64;
    let nanos = nanos_since_epoch.rem_euclid(1_000_000_000) as u32;
    let days = secs.div_euclid(86_400);
    let second_of_day = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (
        second_of_day / 3600,
        (second_of_day % 3600) / 60,
        second_of_day % 60,
    );
    let mut out = format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}");
    if nanos != 0 {
        let fraction = format!("{nanos:09}");
        out.push('.');
        out.push_str(fraction.trim_end_matches('0'));
    }
    out.push('Z');
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A source of wall-clock time (injectable for tests).
pub type WallClock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

#[derive(Debug)]
struct HealthState {
    last_updated: Option<SystemTime>,
    oldest_pending: Option<SystemTime>,
    node_eligible: bool,
}

struct HealthInner {
    health_timeout: Duration,
    clock: WallClock,
    metrics: RwLock<Option<Metrics>>,
    state: RwLock<HealthState>,
}

/// The agent's health, shared between the sync loop and the HTTP servers (cheap to clone).
#[derive(Clone)]
pub struct ProxyHealth {
    inner: Arc<HealthInner>,
}

impl fmt::Debug for ProxyHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyHealth")
            .field("health_timeout", &self.inner.health_timeout)
            .field("state", &*self.read())
            .finish_non_exhaustive()
    }
}

/// The health of one proxier (upstream's `ProxierHealth`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxierHealthBody {
    pub last_updated: String,
    pub healthy: bool,
}

/// The body of `/healthz` and `/livez` (upstream's `ProxyHealth`, same field names and order).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyHealthBody {
    pub last_updated: String,
    pub current_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_eligible: Option<bool>,
    pub healthy: bool,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub status: BTreeMap<String, ProxierHealthBody>,
}

/// A snapshot of [`ProxyHealth`] (upstream's `Health()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthSnapshot {
    pub healthy: bool,
    pub last_updated: Option<SystemTime>,
    pub oldest_pending: Option<SystemTime>,
    pub current_time: SystemTime,
}

/// The single IP family this agent proxies, as named in upstream's `status` map.
const IP_FAMILY: &str = "IPv4";

impl ProxyHealth {
    /// Health on the system clock; `health_timeout` is usually [`health_timeout_for`]`(sync_period)`.
    pub fn new(health_timeout: Duration) -> Self {
        Self::with_clock(health_timeout, Arc::new(SystemTime::now))
    }

    pub fn with_clock(health_timeout: Duration, clock: WallClock) -> Self {
        Self {
            inner: Arc::new(HealthInner {
                health_timeout,
                clock,
                metrics: RwLock::new(None),
                state: RwLock::new(HealthState {
                    last_updated: None,
                    oldest_pending: None,
                    node_eligible: true,
                }),
            }),
        }
    }

    /// Counts `/healthz` and `/livez` answers in `metrics` (builder form of [`ProxyHealth::set_metrics`]).
    pub fn with_metrics(self, metrics: Metrics) -> Self {
        self.set_metrics(metrics);
        self
    }

    /// Counts `/healthz` and `/livez` answers in `metrics`, for every clone of this handle.
    pub fn set_metrics(&self, metrics: Metrics) {
        *self.inner.metrics.write().unwrap_or_else(|p| p.into_inner()) = Some(metrics);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HealthState> {
        self.inner.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HealthState> {
        self.inner.state.write().unwrap_or_else(|p| p.into_inner())
    }

    fn now(&self) -> SystemTime {
        (self.inner.clock)()
    }

    pub fn health_timeout(&self) -> Duration {
        self.inner.health_timeout
    }

    /// A change that needs a sync was received (`QueuedUpdate`): remembers when, unless an earlier update
    /// is still pending.
    pub fn queued_update(&self) {
        let now = self.now();
        let mut state = self.write();
        if state.oldest_pending.is_none() {
            state.oldest_pending = Some(now);
        }
    }

    /// The data path now reflects everything received (`Updated`).
    pub fn updated(&self) {
        let now = self.now();
        let mut state = self.write();
        state.oldest_pending = None;
        state.last_updated = Some(now);
    }

    /// Updates node eligibility from this node's Node object (`SyncNode`).
    pub fn set_node(&self, node: &Node) {
        let eligible = node_eligible(node);
        self.write().node_eligible = eligible;
    }

    /// Sets node eligibility directly (for example `false` when the Node object is deleted).
    pub fn set_node_eligible(&self, eligible: bool) {
        self.write().node_eligible = eligible;
    }

    pub fn node_eligible(&self) -> bool {
        self.read().node_eligible
    }

    /// Upstream's `Health()`: healthy unless an update has been pending for `health_timeout` or more;
    /// always healthy before the first successful sync.
    pub fn health(&self) -> HealthSnapshot {
        let current_time = self.now();
        let state = self.read();
        let late = match (state.last_updated, state.oldest_pending) {
            (Some(_), Some(pending)) => {
                current_time.duration_since(pending).unwrap_or(Duration::ZERO) >= self.inner.health_timeout
            }
            _ => false,
        };
        HealthSnapshot {
            healthy: !late,
            last_updated: state.last_updated,
            oldest_pending: state.oldest_pending,
            current_time,
        }
    }

    /// Proxy health without node eligibility (what `/livez` and the Service health checks use).
    pub fn is_healthy(&self) -> bool {
        self.health().healthy
    }

    /// The status code and body of `/healthz` (`include_node = true`) or `/livez`.
    pub fn probe(&self, include_node: bool) -> (StatusCode, ProxyHealthBody) {
        let snapshot = self.health();
        let eligible = include_node.then(|| self.node_eligible());
        let healthy = snapshot.healthy && eligible.unwrap_or(true);
        let mut status = BTreeMap::new();
        if snapshot.last_updated.is_some() {
            status.insert(
                IP_FAMILY.to_string(),
                ProxierHealthBody {
                    last_updated: format_go_time(snapshot.last_updated),
                    healthy: snapshot.healthy,
                },
            );
        }
        // When healthy, "lastUpdated" is "now", as in older releases where it was the last loop run.
        let last_updated = if healthy {
            Some(snapshot.current_time)
        } else {
            snapshot.last_updated
        };
        let body = ProxyHealthBody {
            last_updated: format_go_time(last_updated),
            current_time: format_go_time(Some(snapshot.current_time)),
            node_eligible: eligible,
            healthy: snapshot.healthy,
            status,
        };
        let code = if healthy {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        if let Some(metrics) = &*self.inner.metrics.read().unwrap_or_else(|p| p.into_inner()) {
            if include_node {
                metrics.proxy_healthz(code.as_u16());
            } else {
                metrics.proxy_livez(code.as_u16());
            }
        }
        (code, body)
    }
}

fn json_response(code: StatusCode, body: String, extra: Option<(&'static str, HeaderValue)>) -> Response {
    let mut response = (code, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    if let Some((name, value)) = extra {
        headers.insert(name, value);
    }
    response
}

async fn healthz(State(health): State<ProxyHealth>) -> Response {
    let (code, body) = health.probe(true);
    json_response(code, serde_json::to_string(&body).unwrap_or_default(), None)
}

async fn livez(State(health): State<ProxyHealth>) -> Response {
    let (code, body) = health.probe(false);
    json_response(code, serde_json::to_string(&body).unwrap_or_default(), None)
}

/// The proxy health server's routes: `/healthz` and `/livez` (any method, as Go's `ServeMux`); anything
/// else is 404.
pub fn proxy_health_router(health: ProxyHealth) -> Router {
    Router::new()
        .route("/healthz", any(healthz))
        .route("/livez", any(livez))
        .fallback(|| async { StatusCode::NOT_FOUND })
        .with_state(health)
}

/// Serves `/healthz` and `/livez` on `addr` until `shutdown` is cancelled. A bind failure (port taken,
/// address not local) is returned at once, with the address in the message.
pub async fn serve_proxy_health(
    addr: SocketAddr,
    health: ProxyHealth,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to start proxy healthz on {addr}"))?;
    serve_proxy_health_on(listener, health, shutdown).await
}

/// As [`serve_proxy_health`], on a listener bound by the caller.
pub async fn serve_proxy_health_on(
    listener: tokio::net::TcpListener,
    health: ProxyHealth,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    tracing::info!(address = ?listener.local_addr().ok(), "serving /healthz and /livez");
    axum::serve(listener, proxy_health_router(health))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .context("proxy healthz server failed")
}

/// What one health-check NodePort reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheckService {
    pub namespace: String,
    pub name: String,
    /// Ready endpoints of the Service on this node.
    pub local_endpoints: usize,
}

/// Groups `sync::Computed::health_checks` (one entry per Service port) by health-check port, summing the
/// local endpoint counts of a Service's ports. Should two Services claim the same port (the API server
/// prevents it), the first one listed keeps it.
pub fn targets_from_health_checks(
    checks: &[(u16, ServicePortName, usize)],
) -> BTreeMap<u16, HealthCheckService> {
    let mut out: BTreeMap<u16, HealthCheckService> = BTreeMap::new();
    for (port, service, local) in checks {
        match out.get_mut(port) {
            Some(target) if target.namespace == service.namespace && target.name == service.name => {
                target.local_endpoints += local;
            }
            Some(_) => {
                tracing::warn!(
                    port,
                    service = %service,
                    "health-check node port already used by another Service"
                );
            }
            None => {
                out.insert(
                    *port,
                    HealthCheckService {
                        namespace: service.namespace.clone(),
                        name: service.name.clone(),
                        local_endpoints: *local,
                    },
                );
            }
        }
    }
    out
}

/// The body of a Service health check, byte for byte as upstream's `hcHandler` (tab-indented).
pub fn service_health_body(service: &HealthCheckService, proxy_healthy: bool) -> String {
    let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string());
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {},\n\t\"serviceProxyHealthy\": {}\n}}",
        quote(&service.namespace),
        quote(&service.name),
        service.local_endpoints,
        proxy_healthy
    )
}

#[derive(Clone)]
struct ServiceHealthState {
    service: Arc<RwLock<HealthCheckService>>,
    health: ProxyHealth,
}

async fn service_health(State(state): State<ServiceHealthState>) -> Response {
    let service = state.service.read().unwrap_or_else(|p| p.into_inner()).clone();
    let healthy = state.health.is_healthy();
    let code = if service.local_endpoints != 0 && healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let weight = HeaderValue::from(service.local_endpoints as u64);
    json_response(
        code,
        service_health_body(&service, healthy),
        Some(("x-load-balancing-endpoint-weight", weight)),
    )
}

fn service_health_router(service: Arc<RwLock<HealthCheckService>>, health: ProxyHealth) -> Router {
    Router::new()
        .fallback(any(service_health))
        .with_state(ServiceHealthState { service, health })
}

/// A health-check port that could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("failed to start health check for service {namespace}/{name} on {address}: {error}")]
pub struct ServiceHealthError {
    pub port: u16,
    pub namespace: String,
    pub name: String,
    pub address: SocketAddr,
    /// Part of the message, hence not also a `source()` (it would be printed twice in a chain).
    pub error: io::Error,
}

struct RunningServer {
    service: Arc<RwLock<HealthCheckService>>,
    stop: CancellationToken,
    local_addrs: Vec<SocketAddr>,
}

/// The set of per-Service health-check listeners (upstream's `ServiceHealthServer`).
pub struct ServiceHealthServers {
    addresses: Vec<IpAddr>,
    health: ProxyHealth,
    servers: BTreeMap<u16, RunningServer>,
}

impl fmt::Debug for ServiceHealthServers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceHealthServers")
            .field("addresses", &self.addresses)
            .field("ports", &self.ports())
            .finish_non_exhaustive()
    }
}

impl ServiceHealthServers {
    /// Listeners will bind each of `addresses` (empty: `0.0.0.0`, every address).
    pub fn new(addresses: Vec<IpAddr>, health: ProxyHealth) -> Self {
        let addresses = if addresses.is_empty() {
            vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)]
        } else {
            addresses
        };
        Self {
            addresses,
            health,
            servers: BTreeMap::new(),
        }
    }

    /// The ports currently open.
    pub fn ports(&self) -> Vec<u16> {
        self.servers.keys().copied().collect()
    }

    /// The addresses actually bound for `port` (differs from the port when it was 0).
    pub fn local_addrs(&self, port: u16) -> Option<&[SocketAddr]> {
        self.servers
            .get(&port)
            .map(|server| server.local_addrs.as_slice())
    }

    /// Makes the open listeners match `wanted` (health-check port -> Service and local endpoints): closes
    /// ports no longer wanted, updates the others in place, opens new ones. Ports that cannot be opened are
    /// returned (and tried again by the next call). Must be called within a Tokio runtime.
    pub fn sync(&mut self, wanted: &BTreeMap<u16, HealthCheckService>) -> Vec<ServiceHealthError> {
        let removed: Vec<u16> = self
            .servers
            .keys()
            .filter(|port| !wanted.contains_key(port))
            .copied()
            .collect();
        for port in removed {
            if let Some(server) = self.servers.remove(&port) {
                tracing::debug!(port, "closing health check");
                server.stop.cancel();
            }
        }
        let mut errors = Vec::new();
        for (&port, service) in wanted {
            if let Some(server) = self.servers.get(&port) {
                let mut current = server.service.write().unwrap_or_else(|p| p.into_inner());
                if *current != *service {
                    *current = service.clone();
                }
                continue;
            }
            match self.open(port, service) {
                Ok(server) => {
                    let name = format!("{}/{}", service.namespace, service.name);
                    tracing::debug!(port, service = %name, "opened health check");
                    self.servers.insert(port, server);
                }
                Err(e) => errors.push(e),
            }
        }
        errors
    }

    fn open(&self, port: u16, service: &HealthCheckService) -> Result<RunningServer, ServiceHealthError> {
        let mut listeners = Vec::with_capacity(self.addresses.len());
        for ip in &self.addresses {
            let address = SocketAddr::new(*ip, port);
            let bound = std::net::TcpListener::bind(address)
                .and_then(|l| {
                    l.set_nonblocking(true)?;
                    tokio::net::TcpListener::from_std(l)
                })
                .map_err(|error| ServiceHealthError {
                    port,
                    namespace: service.namespace.clone(),
                    name: service.name.clone(),
                    address,
                    error,
                })?;
            // On error, the listeners bound so far are dropped (closed) on return.
            listeners.push(bound);
        }
        let shared = Arc::new(RwLock::new(service.clone()));
        let stop = CancellationToken::new();
        let mut local_addrs = Vec::with_capacity(listeners.len());
        for listener in listeners {
            if let Ok(addr) = listener.local_addr() {
                local_addrs.push(addr);
            }
            let router = service_health_router(shared.clone(), self.health.clone());
            let stop = stop.clone();
            tokio::spawn(async move {
                let addr = listener.local_addr().ok();
                if let Err(e) = axum::serve(listener, router)
                    .with_graceful_shutdown(stop.cancelled_owned())
                    .await
                {
                    tracing::error!(address = ?addr, "health check server failed: {e}");
                }
            });
        }
        Ok(RunningServer {
            service: shared,
            stop,
            local_addrs,
        })
    }

    /// Closes every listener.
    pub fn close_all(&mut self) {
        for (_, server) in std::mem::take(&mut self.servers) {
            server.stop.cancel();
        }
    }
}

impl Drop for ServiceHealthServers {
    fn drop(&mut self) {
        self.close_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Mutex;

    use axum::body::Body;
    use axum::http::{Method, Request};
    use http_body_util::BodyExt;
    use k8s_openapi::{
        api::core::v1::{NodeSpec, Taint},
        apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    };
    use tower::ServiceExt;

    use crate::model::Protocol;

    /// A wall clock that only moves when told to.
    #[derive(Clone)]
    struct TestClock(Arc<Mutex<SystemTime>>);

    impl TestClock {
        fn new() -> Self {
            Self(Arc::new(Mutex::new(
                UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            )))
        }
        fn now(&self) -> SystemTime {
            *self.0.lock().unwrap()
        }
        fn step(&self, by: Duration) {
            *self.0.lock().unwrap() += by;
        }
        fn wall(&self) -> WallClock {
            let me = self.clone();
            Arc::new(move || me.now())
        }
    }

    const TIMEOUT: Duration = Duration::from_secs(10);

    fn setup() -> (TestClock, ProxyHealth) {
        let clock = TestClock::new();
        let health = ProxyHealth::with_clock(TIMEOUT, clock.wall());
        (clock, health)
    }

    async fn get(router: Router, method: Method, path: &str) -> (StatusCode, axum::http::HeaderMap, String) {
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

    fn node(tweak: impl FnOnce(&mut Node)) -> Node {
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

    fn tainted(key: &str) -> impl FnOnce(&mut Node) + '_ {
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

    #[test]
    fn go_time_format() {
        assert_eq!(format_go_time(None), "0001-01-01T00:00:00Z");
        assert_eq!(format_go_time(Some(UNIX_EPOCH)), "1970-01-01T00:00:00Z");
        assert_eq!(
            format_go_time(Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000))),
            "2023-11-14T22:13:20Z"
        );
        assert_eq!(
            format_go_time(Some(UNIX_EPOCH + Duration::new(1_700_000_000, 120_000_000))),
            "2023-11-14T22:13:20.12Z"
        );
        assert_eq!(
            format_go_time(Some(UNIX_EPOCH + Duration::new(951_782_400, 1))),
            "2000-02-29T00:00:00.000000001Z"
        );
        assert_eq!(
            format_go_time(Some(UNIX_EPOCH + Duration::from_secs(4_107_542_400))),
            "2100-03-01T00:00:00Z"
        );
        assert_eq!(
            format_go_time(Some(UNIX_EPOCH - Duration::from_secs(1))),
            "1969-12-31T23:59:59Z"
        );
    }

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
        let targets = targets_from_health_checks(&[
            (30001, spn("ns", "web", "http"), 2),
            (30001, spn("ns", "web", "https"), 2),
            (30002, spn("ns", "dns", ""), 0),
            (30002, spn("other", "intruder", ""), 5),
        ]);
        assert_eq!(targets.len(), 2);
        assert_eq!(targets[&30001], svc("ns", "web", 4));
        assert_eq!(targets[&30002], svc("ns", "dns", 0));
    }

    async fn http_get(addr: SocketAddr) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
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

        let mut wanted = BTreeMap::from([(p1, svc("ns", "a", 1)), (p2, svc("ns", "b", 0))]);
        let errors = servers.sync(&wanted);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(servers.ports().len(), 2);
        let a1 = servers.local_addrs(p1).unwrap()[0];
        let a2 = servers.local_addrs(p2).unwrap()[0];
        assert_eq!(a1.port(), p1);

        let r = http_get(a1).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.contains("\"name\": \"a\""));
        assert!(http_get(a2).await.starts_with("HTTP/1.1 503"));

        // Update in place: b gains an endpoint, a loses its own.
        wanted.insert(p2, svc("ns", "b", 4));
        wanted.insert(p1, svc("ns", "a", 0));
        assert!(servers.sync(&wanted).is_empty());
        assert_eq!(servers.local_addrs(p2).unwrap()[0], a2, "same listener");
        let r = http_get(a2).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.contains("\"localEndpoints\": 4"));
        assert!(http_get(a1).await.starts_with("HTTP/1.1 503"));

        // Remove a: its port closes, b stays.
        wanted.remove(&p1);
        assert!(servers.sync(&wanted).is_empty());
        assert_eq!(servers.ports(), vec![p2]);
        wait_closed(a1).await;
        assert!(http_get(a2).await.starts_with("HTTP/1.1 200"));

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
        let wanted = BTreeMap::from([(taken, svc("ns", "blocked", 1)), (free, svc("ns", "ok", 1))]);

        let errors = servers.sync(&wanted);
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].port, taken);
        assert_eq!(errors[0].error.kind(), io::ErrorKind::AddrInUse);
        let message = errors[0].to_string();
        assert!(
            message.contains("ns/blocked") && message.contains(&taken.to_string()),
            "{message}"
        );
        assert_eq!(servers.ports(), vec![free], "the other port still opens");

        // Once the port is free, the next sync opens it.
        drop(blocker);
        assert!(servers.sync(&wanted).is_empty());
        assert_eq!(servers.ports().len(), 2);
        let r = http_get(servers.local_addrs(taken).unwrap()[0]).await;
        assert!(r.contains("\"name\": \"blocked\""), "{r}");
        servers.close_all();
        assert!(servers.ports().is_empty());
    }

    #[test]
    fn default_bind_address_is_every_address() {
        let (_clock, health) = setup();
        let servers = ServiceHealthServers::new(Vec::new(), health);
        assert_eq!(servers.addresses, vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)]);
    }

    #[tokio::test]
    async fn proxy_health_server_on_a_real_listener() {
        let (_clock, health) = setup();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve_proxy_health_on(listener, health.clone(), shutdown.clone()));

        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
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
}
