//! Step 3 of watch -> model -> plan -> maps -> programs: the desired content of the maps, as plain
//! data, computed from the model. Every kube-proxy rule that decides *what* the data path does
//! (which endpoints each kind of traffic may use, reject or drop, when to masquerade, source
//! ranges, affinity) is decided here, so the eBPF programs stay mechanical and this file can be
//! tested exhaustively without a kernel.
//!
//! kube-proxy references are to `pkg/proxy/iptables/proxier.go` (`syncProxyRules`) unless noted.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::Ipv4Addr,
    sync::Arc,
};

use ipnet::Ipv4Net;
use lb_common::{
    backend,
    service::{SCOPE_EXTERNAL, SCOPE_INTERNAL, flags},
};

use crate::model::{CategorizedEndpoints, Endpoint, Protocol, ServicePortInfo, ServicePortName};

/// A frontend: what a client addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.addr, self.port, self.proto.as_str())
    }
}

/// A backend: where a frontend's traffic goes. One map entry (and id) per distinct backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendAddr {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: Protocol,
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.addr, self.port, self.proto.as_str())
    }
}

/// Kinds of frontend, in the priority order used when two Services claim the same one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrontendKind {
    ClusterIp,
    NodePort,
    /// `127.0.0.1:<nodePort>` (iptables mode's localhost NodePorts), reachable from sockets only.
    LocalhostNodePort,
    LoadBalancer,
    ExternalIp,
}

impl FrontendKind {
    pub const fn flag(self) -> u16 {
        match self {
            FrontendKind::ClusterIp => flags::CLUSTER_IP,
            FrontendKind::NodePort => flags::NODE_PORT,
            FrontendKind::LocalhostNodePort => flags::NODE_PORT | flags::LOCALHOST,
            FrontendKind::LoadBalancer => flags::LOAD_BALANCER,
            FrontendKind::ExternalIp => flags::EXTERNAL_IP,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "ClusterIP",
            FrontendKind::NodePort => "NodePort",
            FrontendKind::LocalhostNodePort => "NodePort(localhost)",
            FrontendKind::LoadBalancer => "LoadBalancer",
            FrontendKind::ExternalIp => "ExternalIP",
        }
    }

    /// kube-proxy's "external destinations" (served through the KUBE-EXT chain).
    pub const fn is_external(self) -> bool {
        !matches!(self, FrontendKind::ClusterIp)
    }
}

/// The entries of one scope of a frontend: the frontend entry's flags and the backend slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScopePlan {
    pub scope: u8,
    pub flags: u16,
    /// In slot order (slot 1 first); sorted, so an unchanged set costs no writes.
    pub backends: Vec<BackendAddr>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendPlan {
    pub service: ServicePortName,
    pub kind: FrontendKind,
    /// sessionAffinity ClientIP timeout in seconds; 0 without affinity.
    pub affinity_timeout: u32,
    /// The external scope first; the internal scope when `flags::TWO_SCOPES` is set.
    pub scopes: Vec<ScopePlan>,
    /// loadBalancerSourceRanges (plus the LB IPs themselves when a range contains the node IP).
    pub source_ranges: Vec<Ipv4Net>,
}

impl FrontendPlan {
    /// Every backend either scope may use.
    pub fn backends(&self) -> impl Iterator<Item = &BackendAddr> {
        self.scopes.iter().flat_map(|s| s.backends.iter())
    }
}

/// The whole desired state of the service maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    /// Shared with the claims they come from (`Claim::plan`): a plan is kept once, however many
    /// indexes refer to it.
    pub frontends: BTreeMap<Frontend, Arc<FrontendPlan>>,
    /// Every backend some frontend uses, with its `lb_common::backend::flags`.
    pub backends: BTreeMap<BackendAddr, u8>,
}

/// Node-wide facts and settings the plan depends on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    /// Addresses NodePorts are served on (`--nodeport-addresses` applied to this node's addresses),
    /// not including loopback.
    pub nodeport_addresses: Vec<Ipv4Addr>,
    /// Serve NodePorts on 127.0.0.1 (`--nodeport-addresses` covers loopback and
    /// `--iptables-localhost-nodeports` is on).
    pub localhost_nodeports: bool,
    /// The node's primary IPs (for kube-proxy's `allowFromNode` source-range rule).
    pub node_ips: Vec<Ipv4Addr>,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// A local-traffic detector is configured (`--cluster-cidr`).
    pub cluster_cidr_configured: bool,
}

/// The most backend slots one scope of one frontend may have; a frontend whose scope would need
/// more is not programmed (reported as a [`PlanProblem`]) while the rest is.
///
/// Hard bound: a scope's slot count is `Svc4Value::count`, a `u16`, so 65,535 is the most the
/// data path can address at all. We stop well below it because every frontend repeats its slots:
/// a Service of this size with a cluster IP, NodePorts on two node addresses and the localhost
/// NodePort already takes 4 x 16,384 = 65,536 entries, a quarter of the default `lb4_services`
/// capacity (262,144), and a quarter of the default `lb4_backends` (65,536); one larger Service
/// would crowd out every other. Kubernetes' own envelope is far below this (SIG Scalability's
/// `thresholds.md` lists 250 endpoints per Service; one EndpointSlice holds at most 1,000), so
/// only a broken or hostile set of objects reaches it.
pub const MAX_BACKENDS_PER_SCOPE: usize = 16_384;

/// A problem with one Service, reported (log, Event) while the rest is programmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanProblem {
    pub service: ServicePortName,
    pub message: String,
}

/// One service port's claim on a frontend (its plan for it), before other Services are
/// considered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    pub kind: FrontendKind,
    pub frontend: Frontend,
    pub plan: Arc<FrontendPlan>,
}

impl Claim {
    /// Two Services may claim one frontend (externalIPs and LB IPs are not allocated by the API
    /// server): the claim first in this order wins, deterministically, and the others are
    /// reported.
    pub fn priority(&self) -> (FrontendKind, &ServicePortName) {
        (self.kind, &self.plan.service)
    }

    /// The problem reported for a claim that lost to `owner`'s.
    pub fn lost_to(&self, owner: &ServicePortName) -> PlanProblem {
        lost_claim(self.kind, &self.frontend, &self.plan.service, owner)
    }
}

/// The problem reported for `loser`'s claim on `frontend`, which `owner` holds.
pub fn lost_claim(
    kind: FrontendKind,
    frontend: &Frontend,
    loser: &ServicePortName,
    owner: &ServicePortName,
) -> PlanProblem {
    PlanProblem {
        service: loser.clone(),
        message: format!(
            "{} {frontend} is already served for {owner}; this claim is ignored",
            kind.as_str()
        ),
    }
}

/// What one service port asks of the maps on its own: its claims, the problem of frontends too
/// large to program, and its endpoints (for the backend flags, merged across Services).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortPlan {
    pub claims: Vec<Claim>,
    pub problem: Option<PlanProblem>,
    /// Every endpoint of the port's cluster and local lists: (backend, local, terminating).
    pub endpoints: Vec<(BackendAddr, bool, bool)>,
}

/// Computes the desired state. `services` holds each service port with its categorized
/// endpoints; the result does not depend on their order. A frontend that would need more than
/// [`MAX_BACKENDS_PER_SCOPE`] slots in a scope is left out and reported; the rest is planned.
pub fn plan(
    services: &[(ServicePortInfo, CategorizedEndpoints)],
    node: &NodeContext,
) -> (DesiredState, Vec<PlanProblem>) {
    let ports: Vec<PortPlan> = services
        .iter()
        .map(|(svc, endpoints)| plan_port(svc, endpoints, node))
        .collect();
    let mut problems: Vec<PlanProblem> = ports.iter().filter_map(|p| p.problem.clone()).collect();
    let (desired, conflicts) = merge(&ports);
    problems.extend(conflicts);
    (desired, problems)
}

/// Plans one service port on its own (see [`PortPlan`]).
pub fn plan_port(svc: &ServicePortInfo, endpoints: &CategorizedEndpoints, node: &NodeContext) -> PortPlan {
    let mut claims = Vec::new();
    // Frontends too large for the maps, skipped (and reported once per service port).
    let mut too_large: BTreeSet<Frontend> = BTreeSet::new();
    let mut largest = 0;
    for (kind, frontend) in frontends_of(svc, node) {
        let plan = plan_frontend(svc, endpoints, kind, node);
        let size = plan.scopes.iter().map(|s| s.backends.len()).max().unwrap_or(0);
        if size > MAX_BACKENDS_PER_SCOPE {
            largest = largest.max(size);
            too_large.insert(frontend);
            continue;
        }
        claims.push(Claim {
            kind,
            frontend,
            plan: Arc::new(plan),
        });
    }
    let problem = (!too_large.is_empty()).then(|| {
        let list: Vec<String> = too_large.iter().map(Frontend::to_string).collect();
        PlanProblem {
            service: svc.name.clone(),
            message: format!(
                "{}: {largest} endpoints in one scope, more than the {MAX_BACKENDS_PER_SCOPE} a \
                 frontend can hold; not programmed: {}",
                svc.name,
                list.join(", ")
            ),
        }
    });
    let endpoints = endpoints
        .cluster
        .iter()
        .chain(&endpoints.local)
        .map(|ep| (backend_addr(ep, svc.name.protocol), ep.is_local, ep.terminating))
        .collect();
    // Kept between syncs for every Service port: no spare capacity.
    claims.shrink_to_fit();
    PortPlan {
        claims,
        problem,
        endpoints,
    }
}

/// Puts the service ports' plans together: claims resolved (see [`Claim::priority`]; the losing
/// claims are returned as problems), and the backends the kept frontends use, with their flags
/// merged across Services.
pub fn merge(ports: &[PortPlan]) -> (DesiredState, Vec<PlanProblem>) {
    let mut problems = Vec::new();
    let mut claims: Vec<&Claim> = ports.iter().flat_map(|p| &p.claims).collect();
    claims.sort_by(|a, b| a.priority().cmp(&b.priority()));
    let mut desired = DesiredState::default();
    for claim in claims {
        if let Some(owner) = desired.frontends.get(&claim.frontend) {
            if owner.service != claim.plan.service {
                problems.push(claim.lost_to(&owner.service));
            }
            continue;
        }
        desired.frontends.insert(claim.frontend, claim.plan.clone());
    }
    // Only backends that a kept frontend uses are written. One address may be an endpoint of
    // several Service ports, whose slices need not agree on its node or conditions: the flags are
    // merged, whatever the order of the input (see [`BackendVotes`]).
    let used: BTreeSet<BackendAddr> = desired
        .frontends
        .values()
        .flat_map(|p| p.backends().copied())
        .collect();
    let mut votes: BTreeMap<BackendAddr, BackendVotes> = BTreeMap::new();
    for (addr, local, terminating) in ports.iter().flat_map(|p| &p.endpoints) {
        if used.contains(addr) {
            votes.entry(*addr).or_default().add(*local, *terminating, 1);
        }
    }
    desired.backends = votes.into_iter().map(|(addr, v)| (addr, v.flags())).collect();
    (desired, problems)
}

/// What the endpoints sharing one backend address say about it: local if any says so,
/// terminating only if all do (kube-proxy prefers a running copy of a duplicate endpoint).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendVotes {
    pub endpoints: i64,
    pub local: i64,
    pub running: i64,
}

impl BackendVotes {
    /// Adds (`sign` 1) or withdraws (`sign` -1) one endpoint's vote.
    pub fn add(&mut self, local: bool, terminating: bool, sign: i64) {
        self.endpoints += sign;
        self.local += sign * i64::from(local);
        self.running += sign * i64::from(!terminating);
    }

    pub fn flags(&self) -> u8 {
        backend_flags(self.local > 0, self.running == 0)
    }
}

/// The frontends of one service port: every cluster IP, the NodePort on every NodePort address
/// (and 127.0.0.1 with localhost NodePorts), every external IP and load-balancer IP.
fn frontends_of(svc: &ServicePortInfo, node: &NodeContext) -> Vec<(FrontendKind, Frontend)> {
    let proto = svc.name.protocol;
    let at = |addr: Ipv4Addr, port: u16| Frontend { addr, port, proto };
    let mut out = Vec::new();
    out.extend(
        svc.cluster_ips
            .iter()
            .map(|ip| (FrontendKind::ClusterIp, at(*ip, svc.port))),
    );
    if let Some(node_port) = svc.node_port {
        out.extend(
            node.nodeport_addresses
                .iter()
                .map(|ip| (FrontendKind::NodePort, at(*ip, node_port))),
        );
        if node.localhost_nodeports {
            out.push((
                FrontendKind::LocalhostNodePort,
                at(Ipv4Addr::LOCALHOST, node_port),
            ));
        }
    }
    out.extend(
        svc.external_ips
            .iter()
            .map(|ip| (FrontendKind::ExternalIp, at(*ip, svc.port))),
    );
    out.extend(
        svc.load_balancer_ips
            .iter()
            .map(|ip| (FrontendKind::LoadBalancer, at(*ip, svc.port))),
    );
    out
}

fn backend_addr(ep: &Endpoint, proto: Protocol) -> BackendAddr {
    BackendAddr {
        addr: ep.ip,
        port: ep.port,
        proto,
    }
}

fn backend_flags(local: bool, terminating: bool) -> u8 {
    let mut f = 0;
    if local {
        f |= backend::flags::LOCAL;
    }
    if terminating {
        f |= backend::flags::TERMINATING;
    }
    f
}

fn sorted_backends(eps: &[Endpoint], proto: Protocol) -> Vec<BackendAddr> {
    let mut v: Vec<BackendAddr> = eps.iter().map(|ep| backend_addr(ep, proto)).collect();
    v.sort();
    v.dedup();
    v
}

/// One frontend's scopes, following kube-proxy's chains:
/// - ClusterIP: the internal policy chain (`internalTrafficChain`): local endpoints with
///   internalTrafficPolicy=Local, else the cluster endpoints. Masquerade with `masqueradeAll`,
///   else off-cluster sources when a local detector is configured.
/// - External destinations, externalTrafficPolicy=Cluster: the cluster endpoints, always
///   masqueraded ("masquerade traffic for external destinations").
/// - External destinations, externalTrafficPolicy=Local: local endpoints for traffic from outside
///   (source kept); pod- and node-originated traffic is short-circuited to the cluster endpoints
///   (`SCOPE_INTERNAL`).
/// - No usable endpoint: REJECT when the Service has no endpoints at all (`!hasEndpoints`),
///   DROP when only the Local policy leaves none ("has no local endpoints").
fn plan_frontend(
    svc: &ServicePortInfo,
    eps: &CategorizedEndpoints,
    kind: FrontendKind,
    node: &NodeContext,
) -> FrontendPlan {
    let proto = svc.name.protocol;
    let mut common = kind.flag();
    let affinity_timeout = svc.session_affinity_timeout.unwrap_or(0);
    if affinity_timeout > 0 {
        common |= flags::AFFINITY;
    }
    let empty_flag = |backends: &[BackendAddr]| {
        if backends.is_empty() && eps.has_any {
            flags::DROP_IF_EMPTY
        } else {
            0
        }
    };

    let mut source_ranges = Vec::new();
    if kind == FrontendKind::LoadBalancer && !svc.load_balancer_source_ranges.is_empty() {
        common |= flags::SOURCE_RANGES;
        source_ranges = svc.load_balancer_source_ranges.clone();
        // kube-proxy `allowFromNode`: a range containing the node IP also admits the node's own
        // traffic, which may carry an LB IP as its source.
        if svc
            .load_balancer_source_ranges
            .iter()
            .any(|r| node.node_ips.iter().any(|ip| r.contains(ip)))
        {
            common |= flags::SOURCE_RANGES_ALLOW_NODE;
            source_ranges.extend(svc.load_balancer_ips.iter().map(|ip| Ipv4Net::from(*ip)));
        }
        source_ranges.sort();
        source_ranges.dedup();
    }

    let scopes = if !kind.is_external() {
        let backends = if svc.internal_policy_local {
            sorted_backends(&eps.local, proto)
        } else {
            sorted_backends(&eps.cluster, proto)
        };
        let mut f = common | empty_flag(&backends);
        if node.masquerade_all {
            f |= flags::MASQUERADE;
        } else if node.cluster_cidr_configured {
            f |= flags::MASQUERADE_OFF_CLUSTER;
        }
        vec![ScopePlan {
            scope: SCOPE_EXTERNAL,
            flags: f,
            backends,
        }]
    } else if svc.external_policy_local {
        let local = sorted_backends(&eps.local, proto);
        let cluster = sorted_backends(&eps.cluster, proto);
        vec![
            ScopePlan {
                scope: SCOPE_EXTERNAL,
                flags: common | flags::TWO_SCOPES | empty_flag(&local),
                backends: local,
            },
            ScopePlan {
                scope: SCOPE_INTERNAL,
                flags: common | empty_flag(&cluster),
                backends: cluster,
            },
        ]
    } else {
        let cluster = sorted_backends(&eps.cluster, proto);
        vec![ScopePlan {
            scope: SCOPE_EXTERNAL,
            flags: common | flags::MASQUERADE | empty_flag(&cluster),
            backends: cluster,
        }]
    };
    FrontendPlan {
        service: svc.name.clone(),
        kind,
        affinity_timeout,
        scopes,
        source_ranges,
    }
}

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
