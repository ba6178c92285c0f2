//! Step 3 of watch -> model -> plan -> maps -> programs: the desired content of the maps, as plain
//! data, computed from the model. Every kube-proxy rule that decides *what* the data path does
//! (which endpoints each kind of traffic may use, reject or drop, when to masquerade, source
//! ranges, affinity) is decided here, so the eBPF programs stay mechanical and this file can be
//! tested exhaustively without a kernel.
//!
//! - this file: the plan's types, from a [`Frontend`] to the whole [`DesiredState`];
//! - `rules`: kube-proxy's rules, one service port at a time ([`plan_port`]), and putting ports
//!   together ([`merge`]);
//! - `service`: one Service's model and plan ([`ServicePlan`]);
//! - `cluster_ips`: kube-proxy's cluster-ips-check, from the ClusterIP frontends and the Service
//!   CIDRs ([`ClusterIpPlan`]);
//! - `planner`: the plan kept between syncs and updated one Service at a time ([`Planner`]),
//!   with what each update changed ([`Changes`]);
//! - `maglev`: Maglev lookup tables from a scope's backends (issue 17), for external frontends
//!   whose algorithm is Maglev (`rules` decides which; `apply::entries` builds the tables).
//!
//! kube-proxy references are to `pkg/proxy/iptables/proxier.go` (`syncProxyRules`) unless noted.

mod cluster_ips;
pub mod maglev;
mod planner;
mod rules;
mod service;

use std::{collections::BTreeMap, fmt, net::IpAddr, sync::Arc};

pub use cluster_ips::{ClusterIpPlan, covering};
use ipnet::IpNet;
use lb_common::service::flags;
pub use planner::{Changes, Outcome, Planner, Totals};
pub use rules::{BackendVotes, merge, plan, plan_port};
#[cfg(test)]
pub use service::{Computed, from_scratch};
pub use service::{HealthCheck, SCTP_FROM_NODE, SCTP_REFUSED, ServicePlan};

use crate::model::{Protocol, ServicePortName};

/// A frontend: what a client addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `[2001:db8::1]:80/TCP` for IPv6, as a socket address is written.
        write!(
            f,
            "{}/{}",
            std::net::SocketAddr::new(self.addr, self.port),
            self.proto.as_str()
        )
    }
}

/// A backend: where a frontend's traffic goes. One map entry (and id) per distinct backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendAddr {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Protocol,
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `[2001:db8::1]:80/TCP` for IPv6, as a socket address is written.
        write!(
            f,
            "{}/{}",
            std::net::SocketAddr::new(self.addr, self.port),
            self.proto.as_str()
        )
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
    /// With `flags::MAGLEV`: the size and seed of the scope's Maglev table (built from
    /// `backends` when the entries are, `apply::entries`).
    pub maglev: Option<maglev::TableParams>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendPlan {
    pub service: ServicePortName,
    pub kind: FrontendKind,
    /// sessionAffinity ClientIP timeout in seconds; 0 without affinity.
    pub affinity_timeout: u32,
    /// The external scope first; the internal scope when `flags::TWO_SCOPES` is set.
    pub scopes: Vec<ScopePlan>,
    /// loadBalancerSourceRanges (plus the LB IPs themselves when a range contains the node IP), of
    /// the frontend's family.
    pub source_ranges: Vec<IpNet>,
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
    /// Every endpoint of the port's cluster and local lists.
    pub endpoints: Vec<EndpointVote>,
}

/// What one endpoint says about its backend address (merged across Services, [`BackendVotes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointVote {
    pub addr: BackendAddr,
    /// Its `nodeName` is this node.
    pub local: bool,
    pub terminating: bool,
    /// Its address is one of this node's own (`NodeContext::host_addresses`).
    pub host: bool,
}

#[cfg(test)]
pub(crate) mod proptests;
#[cfg(test)]
mod tests;
