//! The per-Service health-check NodePort servers (`service_health.go`): what each port reports
//! ([`HealthCheckService`], [`targets_from_health_checks`]), its HTTP answer, and the set of listeners
//! ([`ServiceHealthServers`]).

use std::{
    collections::BTreeMap,
    fmt, io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, RwLock},
};

use axum::{
    Router,
    extract::State,
    http::{HeaderValue, StatusCode},
    response::Response,
    routing::any,
};
use tokio_util::sync::CancellationToken;

use super::{ProxyHealth, proxy::json_response};
use crate::{
    family::{IpFamily, PerFamily},
    plan::HealthCheck,
};

/// A health-check NodePort of one family: kube-proxy runs one proxier per family, each with its
/// own listeners (`tcp4` on IPv4 addresses, `tcp6` on IPv6 ones) reporting its family's
/// endpoints, so a dual-stack Service's port is open twice.
pub type HealthCheckPort = (IpFamily, u16);

/// What one health-check NodePort reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheckService {
    pub namespace: String,
    pub name: String,
    /// Ready endpoints of the Service on this node.
    pub local_endpoints: usize,
}

/// Groups the plan's health checks (one per Service port and family) by family and port, summing
/// the local endpoint counts of a Service's ports. Should two Services claim the same port (the API
/// server prevents it), the first one listed keeps it.
pub fn targets_from_health_checks(checks: &[HealthCheck]) -> BTreeMap<HealthCheckPort, HealthCheckService> {
    let mut out: BTreeMap<HealthCheckPort, HealthCheckService> = BTreeMap::new();
    for check in checks {
        let (port, service) = (check.node_port, &check.service);
        match out.get_mut(&(check.family, port)) {
            Some(target) if target.namespace == service.namespace && target.name == service.name => {
                target.local_endpoints += check.local_ready;
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
                    (check.family, port),
                    HealthCheckService {
                        namespace: service.namespace.clone(),
                        name: service.name.clone(),
                        local_endpoints: check.local_ready,
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

/// The set of per-Service health-check listeners (upstream's `ServiceHealthServer`, one per
/// family).
pub struct ServiceHealthServers {
    addresses: PerFamily<Vec<IpAddr>>,
    health: ProxyHealth,
    servers: BTreeMap<HealthCheckPort, RunningServer>,
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
    /// A family's listeners will bind each of its `addresses` (none of a family: every address of
    /// it, `0.0.0.0` or `::`).
    pub fn new(addresses: Vec<IpAddr>, health: ProxyHealth) -> Self {
        let addresses = PerFamily::from_fn(|family| {
            let mine: Vec<IpAddr> = addresses
                .iter()
                .filter(|ip| IpFamily::of(ip) == family)
                .copied()
                .collect();
            if !mine.is_empty() {
                return mine;
            }
            vec![match family {
                IpFamily::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpFamily::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            }]
        });
        Self {
            addresses,
            health,
            servers: BTreeMap::new(),
        }
    }

    /// The ports currently open.
    pub fn ports(&self) -> Vec<HealthCheckPort> {
        self.servers.keys().copied().collect()
    }

    /// The addresses actually bound for `port` (differs from the port when it was 0).
    pub fn local_addrs(&self, port: HealthCheckPort) -> Option<&[SocketAddr]> {
        self.servers
            .get(&port)
            .map(|server| server.local_addrs.as_slice())
    }

    /// Makes the open listeners match `wanted` (health-check port -> Service and local endpoints): closes
    /// ports no longer wanted, updates the others in place, opens new ones. Ports that cannot be opened are
    /// returned (and tried again by the next call). Must be called within a Tokio runtime.
    pub fn sync(
        &mut self,
        wanted: &BTreeMap<HealthCheckPort, HealthCheckService>,
    ) -> Vec<ServiceHealthError> {
        let removed: Vec<HealthCheckPort> = self
            .servers
            .keys()
            .filter(|port| !wanted.contains_key(port))
            .copied()
            .collect();
        for key in removed {
            if let Some(server) = self.servers.remove(&key) {
                tracing::debug!(port = key.1, family = %key.0, "closing health check");
                server.stop.cancel();
            }
        }
        let mut errors = Vec::new();
        for (&key, service) in wanted {
            if let Some(server) = self.servers.get(&key) {
                let mut current = server.service.write().unwrap_or_else(|p| p.into_inner());
                if *current != *service {
                    *current = service.clone();
                }
                continue;
            }
            match self.open(key, service) {
                Ok(server) => {
                    let name = format!("{}/{}", service.namespace, service.name);
                    tracing::debug!(port = key.1, family = %key.0, service = %name, "opened health check");
                    self.servers.insert(key, server);
                }
                Err(e) => errors.push(e),
            }
        }
        errors
    }

    fn open(
        &self,
        (family, port): HealthCheckPort,
        service: &HealthCheckService,
    ) -> Result<RunningServer, ServiceHealthError> {
        let addresses = self.addresses.get(family);
        let mut listeners = Vec::with_capacity(addresses.len());
        for ip in addresses {
            let address = SocketAddr::new(*ip, port);
            let bound = listen(address).map_err(|error| ServiceHealthError {
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

/// A listener on `address` of its family only: an IPv6 one is `IPV6_V6ONLY`, so `[::]:port` and
/// `0.0.0.0:port` coexist (upstream's `tcp6` and `tcp4`).
fn listen(address: SocketAddr) -> io::Result<tokio::net::TcpListener> {
    let socket = match address {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => {
            let socket = tokio::net::TcpSocket::new_v6()?;
            nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Ipv6V6Only, &true)?;
            socket
        }
    };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(1024)
}

impl Drop for ServiceHealthServers {
    fn drop(&mut self) {
        self.close_all();
    }
}

#[cfg(test)]
mod tests;
