//! kube-proxy's rules, one service port at a time: which frontends a port has, and for each the
//! backends of each scope and the flags the programs act on ([`plan_port`]); then the ports of
//! every Service put together, claims on a shared frontend resolved ([`merge`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use ipnet::IpNet;
use lb_common::{
    backend,
    service::{SCOPE_EXTERNAL, SCOPE_INTERNAL, flags},
};

use super::{
    BackendAddr, Claim, DesiredState, EndpointVote, Frontend, FrontendKind, FrontendPlan,
    MAX_BACKENDS_PER_SCOPE, PlanProblem, PortPlan, ScopePlan,
};
use crate::{
    family::IpFamily,
    model::{CategorizedEndpoints, Endpoint, LbAlgorithm, Protocol, ServicePortInfo},
    node::NodeContext,
};

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
        .map(|ep| EndpointVote {
            addr: backend_addr(ep, svc.name.protocol),
            local: ep.is_local,
            terminating: ep.terminating,
            host: node.host_addresses.contains(&ep.ip),
        })
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
    for vote in ports.iter().flat_map(|p| &p.endpoints) {
        if used.contains(&vote.addr) {
            votes.entry(vote.addr).or_default().add(vote, 1);
        }
    }
    desired.backends = votes.into_iter().map(|(addr, v)| (addr, v.flags())).collect();
    (desired, problems)
}

/// What the endpoints sharing one backend address say about it: local if any says so,
/// terminating only if all do (kube-proxy prefers a running copy of a duplicate endpoint); at
/// one of the node's addresses (the same for all: it is the address's). Counts of endpoints, so
/// 32 bits each: the planner keeps one per backend address (100,000 at 10,000 Services).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendVotes {
    pub endpoints: i32,
    pub local: i32,
    pub running: i32,
    pub host: i32,
}

impl BackendVotes {
    /// Adds (`sign` 1) or withdraws (`sign` -1) one endpoint's vote.
    pub fn add(&mut self, vote: &EndpointVote, sign: i32) {
        self.endpoints += sign;
        self.local += sign * i32::from(vote.local);
        self.running += sign * i32::from(!vote.terminating);
        self.host += sign * i32::from(vote.host);
    }

    pub fn flags(&self) -> u8 {
        let mut f = 0;
        if self.local > 0 {
            f |= backend::flags::LOCAL;
        }
        if self.running == 0 {
            f |= backend::flags::TERMINATING;
        }
        if self.host > 0 {
            f |= backend::flags::HOST;
        }
        f
    }
}

/// The frontends of one service port in its family: every cluster IP, the NodePort on every
/// NodePort address of the family (and 127.0.0.1 with localhost NodePorts, IPv4 only), every
/// external IP and load-balancer IP.
fn frontends_of(svc: &ServicePortInfo, node: &NodeContext) -> Vec<(FrontendKind, Frontend)> {
    let proto = svc.name.protocol;
    let at = |addr: IpAddr, port: u16| Frontend { addr, port, proto };
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
                .filter(|ip| IpFamily::of(ip) == svc.family)
                .map(|ip| (FrontendKind::NodePort, at(*ip, node_port))),
        );
        if node.localhost_nodeports && svc.family == IpFamily::V4 {
            out.push((
                FrontendKind::LocalhostNodePort,
                at(IpAddr::V4(Ipv4Addr::LOCALHOST), node_port),
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
            source_ranges.extend(svc.load_balancer_ips.iter().map(|ip| IpNet::from(*ip)));
        }
        source_ranges.sort();
        source_ranges.dedup();
    }

    // Maglev (issue 17): traffic from outside reaches external frontends, whose external scope
    // then picks by the flow's hash. Not the localhost NodePort, which only this node's sockets
    // reach, nor an empty scope (rejected or dropped before any choice).
    let maglev = (kind.is_external()
        && kind != FrontendKind::LocalhostNodePort
        && svc.lb_algorithm.unwrap_or(node.load_balancing.algorithm) == LbAlgorithm::Maglev)
        .then_some(super::maglev::TableParams {
            size: node.load_balancing.maglev_table_size,
            seed: node.load_balancing.maglev_hash_seed,
        });
    let external = |flags: u16, backends: Vec<BackendAddr>| {
        let maglev = maglev.filter(|_| !backends.is_empty());
        ScopePlan {
            scope: SCOPE_EXTERNAL,
            flags: if maglev.is_some() {
                flags | flags::MAGLEV
            } else {
                flags
            },
            backends,
            maglev,
        }
    };

    let scopes = if !kind.is_external() {
        let backends = if svc.internal_policy_local {
            sorted_backends(&eps.local, proto)
        } else {
            sorted_backends(&eps.cluster, proto)
        };
        let mut f = common | empty_flag(&backends);
        if node.masquerade_all {
            f |= flags::MASQUERADE;
        } else if *node.detect_local.get(svc.family) {
            f |= flags::MASQUERADE_OFF_CLUSTER;
        }
        vec![external(f, backends)]
    } else if svc.external_policy_local {
        let local = sorted_backends(&eps.local, proto);
        let cluster = sorted_backends(&eps.cluster, proto);
        vec![
            external(common | flags::TWO_SCOPES | empty_flag(&local), local),
            ScopePlan {
                scope: SCOPE_INTERNAL,
                flags: common | empty_flag(&cluster),
                backends: cluster,
                maglev: None,
            },
        ]
    } else {
        let cluster = sorted_backends(&eps.cluster, proto);
        vec![external(
            common | flags::MASQUERADE | empty_flag(&cluster),
            cluster,
        )]
    };
    FrontendPlan {
        service: svc.name.clone(),
        kind,
        affinity_timeout,
        scopes,
        source_ranges,
    }
}
