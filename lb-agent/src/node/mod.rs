//! This node's facts, the first input of the line (watch -> model -> plan -> maps -> programs
//! all read them): its name and zone (`NodeInfo`, for topology), and what the plan and the
//! programs are told about it (`NodeContext`, the `lb_config` entry), derived from the settings,
//! its Node object and its interface addresses by [`NodeSettings::view`], the one derivation the
//! agent and `lb-agent trace` share.
//!
//! - `object`: what is read from the Node object (zone, primary addresses of each family);
//! - `addresses`: the interface addresses, whether IPv6 is on, and `--nodeport-addresses`;
//! - `interfaces`: the links, and which are pod interfaces (the interface local-traffic detectors).

pub mod addresses;
pub mod interfaces;
pub mod masquerade;
pub mod object;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

pub use addresses::{
    LocalNetwork, LocalNetworkCache, NodePortAddress, NodePortSelection, host_addresses, local_network,
    select_nodeport_addresses,
};
pub use interfaces::{InterfaceDetector, Link, LinkEvents};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use lb_common::{
    config::{self as dpconfig, Cidr, DatapathConfig, FamilyConfig, FamilySettings, MAX_CLUSTER_CIDRS},
    family::{V4, V6},
};
pub use object::ZONE_LABEL;

use crate::family::{IpFamily, KernelFamily, PerFamily};

/// What the model knows about its own node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// `--hostname-override`, or the hostname: compared with `EndpointSlice.endpoints[].nodeName`.
    pub name: String,
    /// The `topology.kubernetes.io/zone` label, if any.
    pub zone: Option<String>,
}

/// Node-wide facts and settings the plan depends on, both families.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    /// Addresses NodePorts are served on (`--nodeport-addresses` applied to this node's addresses),
    /// both families, not including loopback.
    pub nodeport_addresses: Vec<IpAddr>,
    /// Serve NodePorts on 127.0.0.1 (`--nodeport-addresses` covers loopback and
    /// `--iptables-localhost-nodeports` is on; IPv4 only, as kube-proxy).
    pub localhost_nodeports: bool,
    /// The node's primary IPs, at most one per family (for kube-proxy's `allowFromNode`
    /// source-range rule).
    pub node_ips: Vec<IpAddr>,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// Which families have a local-traffic detector (`--cluster-cidr` of the family, or an
    /// interface detector for both; kube-proxy's proxier of a family without one masquerades no
    /// cluster-IP traffic).
    pub detect_local: PerFamily<bool>,
    /// Which families the node serves (IPv6 is off on a node whose kernel or sysctls disable it).
    pub serves: PerFamily<bool>,
    /// The node IPs and every address of this node's interfaces but loopback and link-local
    /// ones, sorted: an endpoint at one of them (hostNetwork) is delivered locally
    /// (`backend::flags::HOST`). Link-local addresses are left out: each pod veth has its own
    /// IPv6 one, and every pod's arrival would otherwise change the node facts.
    pub host_addresses: Vec<IpAddr>,
    /// `--bpf-lb-algorithm`, `--bpf-lb-maglev-table-size`, `--bpf-lb-maglev-hash-seed` (issue 17).
    pub load_balancing: LoadBalancing,
    /// Why SCTP is not translated on this node, if it is not (`NodeSettings::sctp_refused`): each
    /// SCTP port of a Service is reported.
    pub sctp_refused: Option<String>,
}

/// How external frontends pick backends for new flows unless a Service's annotation says
/// otherwise, and the size and seed of each Maglev table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadBalancing {
    pub algorithm: crate::model::LbAlgorithm,
    pub maglev_table_size: crate::plan::maglev::TableSize,
    /// Also the flow hash's (`lb_config`'s `maglev_seed`).
    pub maglev_hash_seed: crate::plan::maglev::HashSeed,
}

/// kube-proxy's `--detect-local-mode`: what tells pod traffic from other traffic (the masquerade
/// decision for cluster IPs, and pod traffic to external frontends using every endpoint).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DetectLocalMode {
    /// Sources in `--cluster-cidr` (each family's).
    #[default]
    ClusterCidr,
    /// Sources in this node's pod CIDRs (`spec.podCIDRs` of its Node object): traffic from
    /// another node's pods counts as off the node, as with kube-proxy.
    NodeCidr,
    /// Packets that came in by the pods' bridge (`--pod-bridge-interface`) or one of its ports.
    BridgeInterface,
    /// Packets that came in by an interface named `--pod-interface-name-prefix`*.
    InterfaceNamePrefix,
}

impl DetectLocalMode {
    /// kube-proxy's spelling (`ClusterCIDR`, `NodeCIDR`).
    pub fn as_str(self) -> &'static str {
        match self {
            DetectLocalMode::ClusterCidr => "ClusterCIDR",
            DetectLocalMode::NodeCidr => "NodeCIDR",
            DetectLocalMode::BridgeInterface => "BridgeInterface",
            DetectLocalMode::InterfaceNamePrefix => "InterfaceNamePrefix",
        }
    }
}

impl std::str::FromStr for DetectLocalMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "" | "ClusterCIDR" => Ok(DetectLocalMode::ClusterCidr),
            "NodeCIDR" => Ok(DetectLocalMode::NodeCidr),
            "BridgeInterface" => Ok(DetectLocalMode::BridgeInterface),
            "InterfaceNamePrefix" => Ok(DetectLocalMode::InterfaceNamePrefix),
            other => Err(format!(
                "unknown mode {other:?} (ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix)"
            )),
        }
    }
}

/// The node's settings, from flags and the config file (`cli::NodeArgs::settings`).
#[derive(Clone, Debug)]
pub struct NodeSettings {
    pub node_name: String,
    /// `--cluster-cidr`: at most [`MAX_CLUSTER_CIDRS`] per family.
    pub cluster_cidrs: Vec<IpNet>,
    /// `--detect-local-mode`.
    pub detect_local_mode: DetectLocalMode,
    /// `--pod-bridge-interface` (BridgeInterface mode).
    pub pod_bridge_interface: String,
    /// `--pod-interface-name-prefix` (InterfaceNamePrefix mode).
    pub pod_interface_name_prefix: String,
    pub nodeport_addresses: Vec<NodePortAddress>,
    pub masquerade_all: bool,
    pub localhost_nodeports: bool,
    /// kube-proxy's `--bind-address`: overrides the node's primary IP of its family.
    pub bind_address: Option<IpAddr>,
    /// `--bpf-lb-algorithm`, `--bpf-lb-maglev-table-size`, `--bpf-lb-maglev-hash-seed`.
    pub load_balancing: LoadBalancing,
    /// Why this node's data path cannot translate SCTP (the kernel refused `lb_tc_sctp_in`,
    /// `Datapath::sctp_refused`), if so. Not a flag: set once the data path is loaded.
    pub sctp_refused: Option<String>,
}

/// Everything derived about this node at one sync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView {
    pub info: NodeInfo,
    pub context: NodeContext,
    /// The source address masqueraded flows of each family get at tc (`lb_config`): the node's
    /// primary IP of the family, else its first NodePort address of the family; none (no
    /// masquerading possible in that family) when it has neither.
    pub masquerade: PerFamily<Option<IpAddr>>,
    /// The local-traffic detector's CIDRs, at most [`MAX_CLUSTER_CIDRS`] per family:
    /// `--cluster-cidr`, or the Node's pod CIDRs in NodeCIDR mode (none of a family until the
    /// Node has one).
    pub local_cidrs: Vec<IpNet>,
    /// The interface detector's pod interfaces (ifindexes, `lb_pod_ifaces`); `None` when the
    /// detector is by source address.
    pub pod_interfaces: Option<BTreeSet<u32>>,
    /// MASQUERADE's candidates on each interface (`lb_masq_addrs`, `masquerade::masquerade_candidates`):
    /// a masqueraded flow gets the address of the interface it leaves by, `masquerade` when that
    /// interface has none of its family.
    pub masquerade_by_interface: BTreeMap<u32, Vec<IpNet>>,
}

impl NodeSettings {
    /// The settings of a node named `node_name` with kube-proxy's defaults for every flag: no
    /// cluster CIDR, the ClusterCIDR detector, NodePorts on every local address, localhost
    /// NodePorts, no masquerade-all, no `--bind-address`.
    pub fn new(node_name: &str) -> Self {
        NodeSettings {
            node_name: node_name.into(),
            cluster_cidrs: Vec::new(),
            detect_local_mode: DetectLocalMode::default(),
            pod_bridge_interface: String::new(),
            pod_interface_name_prefix: String::new(),
            nodeport_addresses: Vec::new(),
            masquerade_all: false,
            localhost_nodeports: true,
            bind_address: None,
            load_balancing: LoadBalancing::default(),
            sctp_refused: None,
        }
    }

    /// Derives this node's view from its Node object (when known) and its own network: the
    /// node's primary IPs are the Node object's (kube-proxy `GetNodeHostIPs`), `--bind-address`
    /// overriding the one of its family (kube-proxy `detectNodeIPs`).
    pub fn view(&self, node: Option<&Node>, local: &LocalNetwork) -> NodeView {
        let mut primary = object::primary_ips(node);
        if let Some(bind) = self.bind_address.filter(|ip| !ip.is_unspecified()) {
            primary.retain(|ip| IpFamily::of(ip) != IpFamily::of(&bind));
            primary.push(bind);
            primary.sort();
        }
        let serves = PerFamily {
            v4: true,
            v6: !local.ipv6_disabled,
        };
        let selection = select_nodeport_addresses(&self.nodeport_addresses, &local.addresses, &primary);
        let mut local_cidrs = match self.detect_local_mode {
            DetectLocalMode::ClusterCidr => self.cluster_cidrs.clone(),
            DetectLocalMode::NodeCidr => object::pod_cidrs(node),
            DetectLocalMode::BridgeInterface | DetectLocalMode::InterfaceNamePrefix => Vec::new(),
        };
        let pod_interfaces = self.interface_detector().map(|d| d.pod_interfaces(&local.links));
        for family in IpFamily::ALL {
            let mut n = 0;
            local_cidrs.retain(|c| {
                n += usize::from(IpFamily::of_net(c) == family);
                IpFamily::of_net(c) != family || n <= MAX_CLUSTER_CIDRS
            });
        }
        let masquerade = PerFamily::from_fn(|family| {
            let of_family = |ips: &[IpAddr]| ips.iter().copied().find(|ip| IpFamily::of(ip) == family);
            of_family(&primary)
                .or_else(|| of_family(&selection.addresses))
                .filter(|_| *serves.get(family))
        });
        let masquerade_by_interface = masquerade::masquerade_candidates(&local.interface_addresses, &serves);
        NodeView {
            info: NodeInfo {
                name: self.node_name.clone(),
                zone: object::zone(node),
            },
            context: NodeContext {
                nodeport_addresses: selection.addresses,
                localhost_nodeports: selection.loopback && self.localhost_nodeports,
                masquerade_all: self.masquerade_all,
                // kube-proxy gives both families the one interface detector.
                detect_local: PerFamily::from_fn(|family| {
                    pod_interfaces.is_some() || local_cidrs.iter().any(|c| IpFamily::of_net(c) == family)
                }),
                serves,
                host_addresses: host_addresses(&local.addresses, &primary),
                node_ips: primary,
                load_balancing: self.load_balancing,
                sctp_refused: self.sctp_refused.clone(),
            },
            masquerade,
            local_cidrs,
            pod_interfaces,
            masquerade_by_interface,
        }
    }

    /// The local-traffic detector in a few words, for the start-up log.
    pub fn detector_description(&self) -> String {
        match self.detect_local_mode {
            DetectLocalMode::ClusterCidr if self.cluster_cidrs.is_empty() => {
                "none (no --cluster-cidr: cluster IP traffic is not masqueraded)".into()
            }
            DetectLocalMode::ClusterCidr => format!(
                "ClusterCIDR {}",
                self.cluster_cidrs
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            DetectLocalMode::NodeCidr => "NodeCIDR (the Node's spec.podCIDRs)".into(),
            DetectLocalMode::BridgeInterface => {
                format!("BridgeInterface {} and its ports", self.pod_bridge_interface)
            }
            DetectLocalMode::InterfaceNamePrefix => {
                format!("InterfaceNamePrefix {}*", self.pod_interface_name_prefix)
            }
        }
    }

    /// The interface local-traffic detector of the mode, if it is one.
    pub fn interface_detector(&self) -> Option<InterfaceDetector> {
        match self.detect_local_mode {
            DetectLocalMode::BridgeInterface => {
                Some(InterfaceDetector::Bridge(self.pod_bridge_interface.clone()))
            }
            DetectLocalMode::InterfaceNamePrefix => Some(InterfaceDetector::NamePrefix(
                self.pod_interface_name_prefix.clone(),
            )),
            DetectLocalMode::ClusterCidr | DetectLocalMode::NodeCidr => None,
        }
    }

    /// The `lb_config` entry for `view`. `host_netns_cookie` identifies the node's network
    /// namespace to the socket programs.
    pub fn datapath_config(
        &self,
        view: &NodeView,
        host_netns_cookie: u64,
        sock_hostns_only: bool,
    ) -> DatapathConfig {
        let mut cfg = DatapathConfig {
            host_netns_cookie,
            snat_port_min: dpconfig::SNAT_PORT_MIN,
            snat_port_max: dpconfig::SNAT_PORT_MAX,
            // The programmer's: the seed the Maglev tables are built with (`Programmer`).
            ..DatapathConfig::default()
        };
        if sock_hostns_only {
            cfg.flags |= dpconfig::flags::SOCK_HOSTNS_ONLY;
        }
        if view.pod_interfaces.is_some() {
            cfg.flags |= dpconfig::flags::DETECT_LOCAL_BY_INTERFACE;
        }
        if masquerade::differs_from_fallback(&view.masquerade_by_interface, &view.masquerade) {
            cfg.flags |= dpconfig::flags::MASQUERADE_BY_INTERFACE;
        }
        self.family_config::<V4>(view, V4::settings_mut(&mut cfg));
        self.family_config::<V6>(view, V6::settings_mut(&mut cfg));
        cfg
    }

    /// One family's part of `lb_config`: its masquerade address and local-traffic detector.
    fn family_config<F: KernelFamily>(&self, view: &NodeView, out: &mut FamilyConfig<F>) {
        if let Some(addr) = view.masquerade.get(F::FAMILY).and_then(|ip| F::kernel_addr(&ip)) {
            out.snat_addr = addr;
        }
        let cidrs = view
            .local_cidrs
            .iter()
            .filter_map(|c| Some((F::kernel_addr(&c.network())?, c.prefix_len())));
        for (slot, (addr, prefix)) in out.cluster_cidrs.iter_mut().zip(cidrs) {
            *slot = Cidr::new(addr, prefix);
            out.cluster_cidr_count += 1;
        }
        debug_assert!(usize::from(out.cluster_cidr_count) <= MAX_CLUSTER_CIDRS);
    }
}

/// The system hostname, lowercased as kube-proxy does: the node's name without
/// `--hostname-override`.
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_default()
        .trim()
        .to_lowercase()
}

#[cfg(test)]
mod tests;
