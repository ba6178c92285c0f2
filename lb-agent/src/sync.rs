//! One sync: watch state -> model -> plan (steps 1 to 3, all pure). The caller applies the result
//! to the maps (step 4). Used by the agent's loop and by `trace`, so both see the same decisions.

use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::{Node, Service};

use crate::{
    model::{self, NodeInfo, categorize_endpoints, service_ports},
    plan::{self, DesiredState, NodeContext, PortPlan},
    watch::ClusterState,
};

/// The node label kube-proxy reads its zone from.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Something wrong with one object, reported and skipped while the rest is programmed.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    /// "Service" or "EndpointSlice".
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
    pub message: String,
}

/// The result of steps 1 to 3.
#[derive(Clone, Debug, Default)]
pub struct Computed {
    pub desired: DesiredState,
    pub problems: Vec<Problem>,
    /// Service ports programmed.
    pub service_ports: usize,
    /// Endpoints seen (before policy and topology).
    pub endpoints: usize,
    /// Service ports with an externalTrafficPolicy=Local health-check NodePort: (port, name,
    /// local endpoints), for the health-check servers.
    pub health_checks: Vec<(u16, model::ServicePortName, usize)>,
    /// Service ports whose Local traffic policy has no local endpoint, as kube-proxy's
    /// `sync_proxy_rules_no_local_endpoints_total{traffic_policy}`.
    pub no_local_internal: usize,
    pub no_local_external: usize,
}

/// This node's name and zone, from its Node object when there is one.
pub fn node_info(name: &str, node: Option<&Node>) -> NodeInfo {
    let zone = node
        .and_then(|n| n.metadata.labels.as_ref())
        .and_then(|l| l.get(ZONE_LABEL))
        .cloned();
    NodeInfo {
        name: name.to_string(),
        zone,
    }
}

/// The node's primary IPv4 addresses from its Node object (kube-proxy `GetNodeHostIPs`: the first
/// InternalIP, else the first ExternalIP).
pub fn node_primary_ips(node: Option<&Node>) -> Vec<Ipv4Addr> {
    let Some(addresses) = node
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.addresses.as_ref())
    else {
        return Vec::new();
    };
    for kind in ["InternalIP", "ExternalIP"] {
        let ips: Vec<Ipv4Addr> = addresses
            .iter()
            .filter(|a| a.type_ == kind)
            .filter_map(|a| a.address.parse().ok())
            .collect();
        if let Some(first) = ips.first() {
            return vec![*first];
        }
    }
    Vec::new()
}

/// What one Service contributes, computed from its object and its EndpointSlices alone (steps 2
/// and 3 short of putting Services together, which `plan::merge` and [`Synchronizer`] do).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceUnit {
    /// Problems with the Service and its slices, and frontends too large to program.
    pub problems: Vec<Problem>,
    pub ports: Vec<PortPlan>,
    /// Endpoints seen (before policy and topology).
    pub endpoints: usize,
    pub health_checks: Vec<(u16, model::ServicePortName, usize)>,
    pub no_local_internal: usize,
    pub no_local_external: usize,
}

impl ServiceUnit {
    /// Runs the model and plans each port of one Service.
    pub fn compute(
        namespace: &str,
        name: &str,
        svc: &Service,
        slices: &[&model::Slice],
        node: &NodeInfo,
        ctx: &NodeContext,
    ) -> ServiceUnit {
        let mut unit = ServiceUnit::default();
        let report = |kind: &'static str, message: String| Problem {
            kind,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            message,
        };
        let service = match service_ports(svc) {
            Ok(service) => service,
            Err(e) if e.is_skipped() => return unit,
            Err(e) => {
                unit.problems.push(report("Service", e.to_string()));
                return unit;
            }
        };
        unit.problems
            .extend(service.warnings.iter().map(|w| report("Service", w.clone())));
        let (mut by_port, slice_problems) =
            model::endpoints::endpoints_by_port_with_problems(namespace, name, slices, node);
        unit.problems.extend(
            slice_problems
                .into_iter()
                .map(|p| report("EndpointSlice", p.to_string())),
        );
        for port in service.ports {
            let endpoints = by_port.remove(&port.name).unwrap_or_default();
            unit.endpoints += endpoints.len();
            let categorized = categorize_endpoints(&endpoints, &port, node);
            if categorized.local.is_empty() && categorized.has_any {
                unit.no_local_internal += usize::from(port.internal_policy_local);
                unit.no_local_external += usize::from(port.external_policy_local);
            }
            if let Some(hc_port) = port.health_check_node_port {
                // kube-proxy's health check counts local *ready* endpoints (LocalReadyEndpoints),
                // so a node whose pods are all terminating answers 503 and is drained.
                let local_ready = endpoints.iter().filter(|e| e.is_local && e.ready).count();
                unit.health_checks.push((hc_port, port.name.clone(), local_ready));
            }
            let planned = plan::plan_port(&port, &categorized, ctx);
            if let Some(p) = &planned.problem {
                unit.problems.push(report("Service", p.message.clone()));
            }
            unit.ports.push(planned);
        }
        // Kept between syncs for every Service: no spare capacity.
        unit.ports.shrink_to_fit();
        unit.problems.shrink_to_fit();
        unit
    }
}

/// Runs the model and the plan over `state`, from scratch.
pub fn compute(state: &ClusterState, node: &NodeInfo, ctx: &NodeContext) -> Computed {
    let slices = state.slices_by_service();
    let mut computed = Computed::default();
    let mut ports = Vec::new();
    for ((namespace, name), svc) in &state.services {
        let service_slices = slices
            .get(&(namespace.clone(), name.clone()))
            .map(Vec::as_slice)
            .unwrap_or_default();
        let unit = ServiceUnit::compute(namespace, name, svc, service_slices, node, ctx);
        computed.problems.extend(unit.problems);
        computed.service_ports += unit.ports.len();
        computed.endpoints += unit.endpoints;
        computed.health_checks.extend(unit.health_checks);
        computed.no_local_internal += unit.no_local_internal;
        computed.no_local_external += unit.no_local_external;
        ports.extend(unit.ports);
    }
    let (desired, conflicts) = plan::merge(&ports);
    computed.problems.extend(conflicts.iter().map(Problem::from_plan));
    computed.desired = desired;
    computed
}

impl Problem {
    pub fn from_plan(p: &plan::PlanProblem) -> Problem {
        Problem {
            kind: "Service",
            namespace: p.service.namespace.clone(),
            name: p.service.name.clone(),
            message: p.message.clone(),
        }
    }
}

mod incremental;
pub use incremental::{Changes, Outcome, ServiceInputs, Synchronizer, Totals};
