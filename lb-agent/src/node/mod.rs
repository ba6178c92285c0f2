//! This node's facts, the first input of the line (watch -> model -> plan -> maps -> programs
//! all read them): its name and zone (`NodeInfo`, for topology), and what the plan and the
//! programs are told about it (`NodeContext`, the `lb_config` entry), derived from the settings,
//! its Node object and its interface addresses by [`NodeSettings::view`], the one derivation the
//! agent and `lb-agent trace` share.
//!
//! - `object`: what is read from the Node object (zone, primary addresses);
//! - `addresses`: the interface addresses and `--nodeport-addresses`.

pub mod addresses;
pub mod object;

use std::net::Ipv4Addr;

pub use addresses::{NodePortAddress, NodePortSelection, local_addresses, select_nodeport_addresses};
use ipnet::Ipv4Net;
use k8s_openapi::api::core::v1::Node;
use lb_common::config::{self as dpconfig, Cidr4, DatapathConfig, MAX_CLUSTER_CIDRS};
pub use object::ZONE_LABEL;

/// What the model knows about its own node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// `--hostname-override`, or the hostname: compared with `EndpointSlice.endpoints[].nodeName`.
    pub name: String,
    /// The `topology.kubernetes.io/zone` label, if any.
    pub zone: Option<String>,
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

/// The node's settings, from flags and the config file (`cli::NodeArgs::settings`).
#[derive(Clone, Debug)]
pub struct NodeSettings {
    pub node_name: String,
    pub cluster_cidrs: Vec<Ipv4Net>,
    pub nodeport_addresses: Vec<NodePortAddress>,
    pub masquerade_all: bool,
    pub localhost_nodeports: bool,
    /// kube-proxy's `--bind-address`: the primary IP when the Node object gives none.
    pub bind_address: Option<Ipv4Addr>,
}

/// Everything derived about this node at one sync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView {
    pub info: NodeInfo,
    pub context: NodeContext,
    /// The source address masqueraded flows get at tc (`lb_config`'s `snat_addr`): the node's
    /// primary IP, else its first NodePort address; unspecified (no masquerading possible) when it
    /// has neither.
    pub masquerade_address: Ipv4Addr,
}

impl NodeSettings {
    /// Derives this node's view from its Node object (when known) and the addresses on its
    /// interfaces: the node's primary IPs are the Node object's (kube-proxy `GetNodeHostIPs`),
    /// else `--bind-address`.
    pub fn view(&self, node: Option<&Node>, local_addresses: &[Ipv4Addr]) -> NodeView {
        let mut primary = object::primary_ips(node);
        if primary.is_empty() {
            primary.extend(self.bind_address);
        }
        let selection = select_nodeport_addresses(&self.nodeport_addresses, local_addresses, &primary);
        let masquerade_address = primary
            .first()
            .or(selection.addresses.first())
            .copied()
            .unwrap_or(Ipv4Addr::UNSPECIFIED);
        NodeView {
            info: NodeInfo {
                name: self.node_name.clone(),
                zone: object::zone(node),
            },
            context: NodeContext {
                nodeport_addresses: selection.addresses,
                localhost_nodeports: selection.loopback && self.localhost_nodeports,
                node_ips: primary,
                masquerade_all: self.masquerade_all,
                cluster_cidr_configured: !self.cluster_cidrs.is_empty(),
            },
            masquerade_address,
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
            snat_addr: view.masquerade_address.octets(),
            snat_port_min: dpconfig::SNAT_PORT_MIN,
            snat_port_max: dpconfig::SNAT_PORT_MAX,
            ..DatapathConfig::default()
        };
        if sock_hostns_only {
            cfg.flags |= dpconfig::flags::SOCK_HOSTNS_ONLY;
        }
        for (slot, cidr) in cfg.cluster_cidrs.iter_mut().zip(&self.cluster_cidrs) {
            *slot = Cidr4::new(cidr.network().octets(), cidr.prefix_len());
        }
        cfg.cluster_cidr_count = self.cluster_cidrs.len().min(MAX_CLUSTER_CIDRS) as u32;
        cfg
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
