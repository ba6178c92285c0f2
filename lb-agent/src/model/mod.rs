//! Step 2 of watch -> model -> plan -> maps -> programs: kube-proxy's semantics, as pure functions
//! of the objects the watch keeps. No kernel, no I/O; everything here is unit-tested against tables of
//! kube-proxy's own cases.
//!
//! - `service`: a v1 Service -> the `ServicePortInfo` of each port (kube-proxy
//!   `pkg/proxy/serviceport.go`, `servicechangetracker.go`, `proxyutil.ShouldSkipService`);
//! - `endpoints`: the EndpointSlices of a Service -> the `Endpoint`s of each port
//!   (`pkg/proxy/endpointslicecache.go`, `endpoint.go`);
//! - `topology`: which endpoints each kind of traffic may use (`pkg/proxy/topology.go`,
//!   `CategorizeEndpoints`).

use std::{collections::BTreeSet, fmt, net::IpAddr};

use ipnet::IpNet;

use crate::family::IpFamily;

pub mod endpoints;
#[cfg(test)]
pub(crate) mod proptests;
pub mod service;
#[cfg(test)]
pub(crate) mod test_support;
pub mod topology;

pub use endpoints::{SliceError, endpoints_by_port, endpoints_by_port_with_problems};
pub use service::{ServiceError, ServicePorts, service_ports};
pub use topology::{CategorizedEndpoints, categorize_endpoints};

/// How a new flow from outside the cluster picks its backend (issue 17; kube-proxy has only
/// `Random`). Cilium's `--bpf-lb-algorithm` names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LbAlgorithm {
    /// Any backend, as kube-proxy's `statistic --probability` rules.
    #[default]
    Random,
    /// Maglev consistent hashing of the flow's 5-tuple: the same backend on every node with the
    /// same endpoints (traffic spread over nodes by an ECMP router).
    Maglev,
}

impl LbAlgorithm {
    pub const fn as_str(self) -> &'static str {
        match self {
            LbAlgorithm::Random => "random",
            LbAlgorithm::Maglev => "maglev",
        }
    }
}

impl std::str::FromStr for LbAlgorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "random" => Ok(LbAlgorithm::Random),
            "maglev" => Ok(LbAlgorithm::Maglev),
            other => Err(format!("{other:?} is not an algorithm (random, maglev)")),
        }
    }
}

impl fmt::Display for LbAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// L4 protocol of a Service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// IANA protocol number, as stored in map keys.
    pub const fn number(self) -> u8 {
        match self {
            Protocol::Tcp => lb_common::proto::TCP,
            Protocol::Udp => lb_common::proto::UDP,
            Protocol::Sctp => lb_common::proto::SCTP,
        }
    }

    /// The Kubernetes spelling ("TCP", "UDP", "SCTP").
    pub const fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

/// The identity of a load-balanced port: kube-proxy's `ServicePortName`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    /// The Service port's name ("" for a single unnamed port).
    pub port: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    /// kube-proxy's form: `ns/name:port` (the `:port` part only when the port is named).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}/{}", self.namespace, self.name)
        } else {
            write!(f, "{}/{}:{}", self.namespace, self.name, self.port)
        }
    }
}

/// Something wrong with one object, reported (a log line once, a Warning Event) and skipped
/// while the rest is programmed.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    /// "Service" or "EndpointSlice".
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
    pub message: String,
}

/// One port of one Service in one IP family, with everything the data path needs: what
/// kube-proxy's proxier of that family knows of it (a dual-stack Service has one per family, under
/// the same name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortInfo {
    pub name: ServicePortName,
    /// The family of every address below, and of the NodePort addresses it is served on.
    pub family: IpFamily,
    /// `spec.clusterIPs` of the family (none when it is a special address such as 0.0.0.0, see
    /// [`service::special_address`]).
    pub cluster_ips: Vec<IpAddr>,
    pub port: u16,
    /// `spec.ports[].nodePort`, for NodePort and LoadBalancer Services.
    pub node_port: Option<u16>,
    /// `spec.externalIPs` of the family.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` whose `ipMode` is `VIP` or unset (ipMode `Proxy` is the
    /// load balancer's to serve, KEP-1860).
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges` of the family (applies to `load_balancer_ips` only); empty
    /// means every source is allowed (so does a zero-length prefix, which empties it).
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// `Some(timeoutSeconds)` for sessionAffinity ClientIP (default 10800).
    pub session_affinity_timeout: Option<u32>,
    /// internalTrafficPolicy: Local.
    pub internal_policy_local: bool,
    /// externalTrafficPolicy: Local on a Service that is externally accessible (kube-proxy decides
    /// this per Service, from its type and external IPs).
    pub external_policy_local: bool,
    /// `spec.healthCheckNodePort`, when externalTrafficPolicy is Local.
    pub health_check_node_port: Option<u16>,
    /// `spec.trafficDistribution` (PreferClose, PreferSameZone, PreferSameNode), as written.
    /// Informational, like `topology_mode`: the EndpointSlice controller turns it into hints.
    pub traffic_distribution: Option<String>,
    /// The topology annotation as written: the deprecated `service.kubernetes.io/topology-aware-hints`
    /// takes precedence over `service.kubernetes.io/topology-mode`, as upstream. Informational:
    /// since v1.35 kube-proxy decides topology from the EndpointSlice hints alone.
    pub topology_mode: Option<String>,
    /// The Service's algorithm annotation (`watch::ANNOTATION_LB_ALGORITHM`), when set and
    /// valid; the node's `--bpf-lb-algorithm` otherwise.
    pub lb_algorithm: Option<LbAlgorithm>,
}

impl ServicePortInfo {
    /// kube-proxy `ExternallyAccessible`: a NodePort, an external IP or a load-balancer IP.
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }

    /// kube-proxy `UsesClusterEndpoints`.
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_policy_local || self.externally_accessible()
    }

    /// kube-proxy `UsesLocalEndpoints`.
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.external_policy_local && self.externally_accessible())
    }
}

/// One endpoint of one Service port (kube-proxy's `BaseEndpointInfo`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub port: u16,
    /// `conditions.ready` (nil means true).
    pub ready: bool,
    /// `conditions.serving` (nil means true, as upstream's `addEndpoints`).
    pub serving: bool,
    /// `conditions.terminating` (nil means false).
    pub terminating: bool,
    /// `nodeName` equals this node's name.
    pub is_local: bool,
    pub node_name: Option<String>,
    pub zone: Option<String>,
    /// `hints.forZones[].name`.
    pub zone_hints: BTreeSet<String>,
    /// `hints.forNodes[].name`.
    pub node_hints: BTreeSet<String>,
}
