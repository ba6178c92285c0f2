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
//! addresses (upstream: the node IPs selected by `nodePortAddresses`, or `0.0.0.0` / `::` when that
//! matches everything), per family: a dual-stack Service's port is open on both, each reporting
//! its family's endpoints, as kube-proxy's two proxiers do. A port that cannot be bound is reported in the returned list, not fatal, and retried by the
//! next `sync` (upstream logs it and emits a `FailedToStartServiceHealthcheck` event).
//!
//! Upstream keys these servers by Service and counts a Service's local ready endpoints across its ports
//! (`EndpointsMap.LocalReadyEndpoints`: distinct `ip:port` strings); here they are keyed by family
//! and port, and [`targets_from_health_checks`] sums the per-port counts of the plan's
//! `HealthCheck`s, which is the same number unless two ports of a Service target the same endpoint
//! port.
//!
//! # Files
//!
//! This module owns node eligibility and the health timeout; one job per file below it: `proxy`
//! (`/healthz` and `/livez`), `service` (the per-Service health-check NodePorts) and `go_time` (Go's
//! time format for the JSON bodies).

use std::time::Duration;

mod go_time;
mod proxy;
mod service;
#[cfg(test)]
mod test_support;

pub use go_time::format_go_time;
pub use proxy::{
    HealthSnapshot, ProxierHealthBody, ProxyHealth, ProxyHealthBody, WallClock, proxy_health_router,
    serve_proxy_health, serve_proxy_health_on,
};
pub use service::{
    HealthCheckPort, HealthCheckService, ServiceHealthError, ServiceHealthServers, service_health_body,
    targets_from_health_checks,
};

/// kube-proxy's health timeout for a given `syncPeriod`: `2 × syncPeriod`.
pub fn health_timeout_for(sync_period: Duration) -> Duration {
    sync_period.saturating_mul(2)
}

#[cfg(test)]
mod tests;
