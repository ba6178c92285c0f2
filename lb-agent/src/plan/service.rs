//! One Service planned on its own ([`ServicePlan`]: its model, then each port's plan), which the
//! [`super::Planner`] puts together with the others; and [`from_scratch`], the same over a whole
//! cluster at once, which the property tests hold the planner to.

use k8s_openapi::api::core::v1::Service;

use super::{PlanProblem, PortPlan};
use crate::{
    family::IpFamily,
    model::{self, Problem, ServicePortName, categorize_endpoints, service_ports},
    node::{NodeContext, NodeInfo},
    watch::Slice,
};
#[cfg(test)]
use {super::DesiredState, crate::watch::ClusterState};

/// How SCTP from the node's own network namespace is served, for `lb-agent trace`
/// (docs/architecture.md, SCTP).
pub const SCTP_FROM_NODE: &str = "the node's own SCTP: the kernel runs no socket hook for an SCTP \
    connect() or sendmsg(), so tc egress translates the packet (lb_tc_sctp_out), keeps its source \
    (a node address, what masquerade would give it) and routes it to the backend; the replies get \
    the frontend back at tc ingress";

/// What an SCTP port meets on a node whose kernel refused the SCTP program, for the planner's
/// Warning (followed by the node's name and the refusal).
pub const SCTP_REFUSED: &str = "SCTP is not load-balanced here: the kernel refused the SCTP \
    programs (lb_tc_sctp_in, lb_tc_sctp_out), so SCTP packets pass untranslated (counted as tc_unsupported_protocol) \
    while TCP and UDP are served";

/// What one Service contributes, computed from its object and its EndpointSlices alone (steps 2
/// and 3 short of putting Services together, which [`super::merge`] and [`super::Planner`] do).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServicePlan {
    /// Problems with the Service and its slices, and frontends too large to program.
    pub problems: Vec<Problem>,
    pub ports: Vec<PortPlan>,
    /// Endpoints seen (before policy and topology).
    pub endpoints: usize,
    pub health_checks: Vec<HealthCheck>,
    pub no_local_internal: usize,
    pub no_local_external: usize,
}

impl ServicePlan {
    /// Runs the model and plans each port of one Service, in each family the node serves (as
    /// kube-proxy's proxier of each family would: a dual-stack Service gets both families'
    /// frontends, under the same port names).
    pub fn compute(
        namespace: &str,
        name: &str,
        svc: &Service,
        slices: &[&Slice],
        node: &NodeInfo,
        ctx: &NodeContext,
    ) -> ServicePlan {
        let mut unit = ServicePlan::default();
        let report = |kind: &'static str, message: String| Problem {
            kind,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            message,
        };
        // The families the Service has that this node does not serve (IPv6 disabled): a problem
        // only when that leaves the Service with nothing here, since a dual-stack Service's
        // other family serves it as kube-proxy's single-stack proxier would.
        let mut unserved = Vec::new();
        let mut served = false;
        for family in IpFamily::ALL {
            let service = match service_ports(svc, family) {
                Ok(service) => service,
                Err(e) if e.is_skipped() => continue,
                Err(e) => {
                    unit.problems.push(report("Service", e.to_string()));
                    continue;
                }
            };
            if !*ctx.serves.get(family) {
                unserved.push(family);
                continue;
            }
            served = true;
            unit.problems
                .extend(service.warnings.iter().map(|w| report("Service", w.clone())));
            let (mut by_port, slice_problems) =
                model::endpoints::endpoints_by_port_with_problems(namespace, name, slices, node, family);
            unit.problems.extend(
                slice_problems
                    .into_iter()
                    .map(|p| report("EndpointSlice", p.to_string())),
            );
            for port in service.ports {
                if port.name.protocol == model::Protocol::Sctp
                    && let Some(reason) = &ctx.sctp_refused
                {
                    unit.problems.push(report(
                        "Service",
                        format!("{}: {SCTP_REFUSED} (node {}: {reason})", port.name, node.name),
                    ));
                }
                let endpoints = by_port.remove(&port.name).unwrap_or_default();
                unit.endpoints += endpoints.len();
                let categorized = categorize_endpoints(&endpoints, &port, node);
                if categorized.local.is_empty() && categorized.has_any {
                    unit.no_local_internal += usize::from(port.internal_policy_local);
                    unit.no_local_external += usize::from(port.external_policy_local);
                }
                if let Some(node_port) = port.health_check_node_port {
                    // kube-proxy's health check counts local *ready* endpoints
                    // (LocalReadyEndpoints), so a node whose pods are all terminating answers 503
                    // and is drained.
                    let local_ready = endpoints.iter().filter(|e| e.is_local && e.ready).count();
                    unit.health_checks.push(HealthCheck {
                        family,
                        node_port,
                        service: port.name.clone(),
                        local_ready,
                    });
                }
                let planned = super::plan_port(&port, &categorized, ctx);
                if let Some(p) = &planned.problem {
                    unit.problems.push(report("Service", p.message.clone()));
                }
                unit.ports.push(planned);
            }
        }
        if !served && let Some(family) = unserved.first() {
            unit.problems.push(report(
                "Service",
                format!(
                    "{family} is off on node {} (disabled in its kernel or sysctls): the \
                     Service has no frontend here",
                    node.name
                ),
            ));
        }
        // A problem both families' passes find (a malformed port, say) is one problem.
        let mut seen = std::collections::BTreeSet::new();
        unit.problems.retain(|p| seen.insert(p.clone()));
        // Kept between syncs for every Service: no spare capacity.
        unit.ports.shrink_to_fit();
        unit.problems.shrink_to_fit();
        unit
    }
}

/// A health-check NodePort of a Service port with externalTrafficPolicy Local, in one family:
/// what kube-proxy's health server of that family answers on it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HealthCheck {
    pub family: IpFamily,
    pub node_port: u16,
    pub service: ServicePortName,
    /// Local endpoints that are ready.
    pub local_ready: usize,
}

/// The result of [`from_scratch`].
#[cfg(test)]
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
    pub health_checks: Vec<HealthCheck>,
    /// Service ports whose Local traffic policy has no local endpoint, as kube-proxy's
    /// `sync_proxy_rules_no_local_endpoints_total{traffic_policy}`.
    pub no_local_internal: usize,
    pub no_local_external: usize,
}

/// Runs the model and the plan over `state`, from scratch: the reference the [`super::Planner`]'s
/// result is held to by the property tests.
#[cfg(test)]
pub fn from_scratch(state: &ClusterState, node: &NodeInfo, ctx: &NodeContext) -> Computed {
    let slices = state.slices_by_service();
    let mut computed = Computed::default();
    let mut ports = Vec::new();
    for ((namespace, name), svc) in &state.services {
        let service_slices = slices
            .get(&(namespace.clone(), name.clone()))
            .map(Vec::as_slice)
            .unwrap_or_default();
        let unit = ServicePlan::compute(namespace, name, svc, service_slices, node, ctx);
        computed.problems.extend(unit.problems);
        computed.service_ports += unit.ports.len();
        computed.endpoints += unit.endpoints;
        computed.health_checks.extend(unit.health_checks);
        computed.no_local_internal += unit.no_local_internal;
        computed.no_local_external += unit.no_local_external;
        ports.extend(unit.ports);
    }
    let (desired, conflicts) = super::merge(&ports);
    computed.problems.extend(conflicts.iter().map(Problem::from));
    computed.desired = desired;
    computed
}

impl From<&PlanProblem> for Problem {
    fn from(p: &PlanProblem) -> Problem {
        Problem {
            kind: "Service",
            namespace: p.service.namespace.clone(),
            name: p.service.name.clone(),
            message: p.message.clone(),
        }
    }
}
