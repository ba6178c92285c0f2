//! kube-proxy's proxy health (`proxy_health.go`): the shared [`ProxyHealth`] state the sync loop
//! updates, the JSON bodies of `/healthz` and `/livez`, and their HTTP router and server.

use std::{
    collections::BTreeMap,
    fmt,
    net::SocketAddr,
    sync::{Arc, RwLock},
    time::{Duration, SystemTime},
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

use super::format_go_time;
use crate::metrics::Metrics;
use crate::node::object::node_eligible;

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

pub(super) fn json_response(
    code: StatusCode,
    body: String,
    extra: Option<(&'static str, HeaderValue)>,
) -> Response {
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

#[cfg(test)]
mod tests;
