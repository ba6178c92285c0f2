//! `lb_config`: one entry of node-wide settings the programs read on every decision. The agent
//! writes it at start and whenever a setting changes.

use crate::user_pod;

pub mod flags {
    /// Socket programs translate only sockets of the host network namespace (pods are left to the
    /// tc path), like Cilium's `--bpf-lb-sock-hostns-only`; needed under service meshes.
    pub const SOCK_HOSTNS_ONLY: u32 = 1 << 0;
}

/// Up to this many `--cluster-cidr` entries of one family (kube-proxy takes one per family).
pub const MAX_CLUSTER_CIDRS: usize = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cidr4 {
    pub addr: [u8; 4],
    pub prefix_len: u8,
    pub _pad: [u8; 3],
}

impl Cidr4 {
    pub const fn new(addr: [u8; 4], prefix_len: u8) -> Self {
        Self {
            addr,
            prefix_len,
            _pad: [0; 3],
        }
    }

    pub fn contains(&self, ip: [u8; 4]) -> bool {
        if self.prefix_len == 0 {
            return true;
        }
        let shift = 32 - u32::from(self.prefix_len.min(32));
        let mask = if shift == 32 { 0 } else { u32::MAX << shift };
        (u32::from_be_bytes(ip) & mask) == (u32::from_be_bytes(self.addr) & mask)
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatapathConfig {
    /// `bpf_get_netns_cookie()` of the host network namespace (the agent's own).
    pub host_netns_cookie: u64,
    /// `flags::*`.
    pub flags: u32,
    /// Number of valid entries in `cluster_cidrs`.
    pub cluster_cidr_count: u32,
    /// kube-proxy's local-traffic detector (`--cluster-cidr`): sources inside are pods.
    pub cluster_cidrs: [Cidr4; MAX_CLUSTER_CIDRS],
    /// The node IP masqueraded flows get as their source (tc path).
    pub snat_addr: [u8; 4],
    /// Source ports for masqueraded flows, inclusive; outside the kernel's ephemeral range so a
    /// masqueraded flow never collides with a connection of the node itself.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
}

/// Default masquerade port range (as Calico's `BPFPSNATPorts`).
pub const SNAT_PORT_MIN: u16 = 20_000;
pub const SNAT_PORT_MAX: u16 = 29_999;

impl DatapathConfig {
    /// Whether `ip` is a pod address per the local-traffic detector; `None` when no cluster CIDR
    /// is configured (kube-proxy then treats no traffic as pod traffic).
    pub fn is_pod_address(&self, ip: [u8; 4]) -> Option<bool> {
        if self.cluster_cidr_count == 0 {
            return None;
        }
        let mut i = 0;
        while i < MAX_CLUSTER_CIDRS {
            if i < self.cluster_cidr_count as usize && self.cluster_cidrs[i].contains(ip) {
                return Some(true);
            }
            i += 1;
        }
        Some(false)
    }
}

user_pod!(DatapathConfig, Cidr4);

#[cfg(test)]
mod tests {
    use core::mem::size_of;

    use super::*;

    #[test]
    fn layout() {
        assert_eq!(size_of::<Cidr4>(), 8);
        assert_eq!(size_of::<DatapathConfig>(), 16 + 8 * MAX_CLUSTER_CIDRS + 8);
    }

    #[test]
    fn cidr_contains() {
        let c = Cidr4::new([10, 244, 0, 0], 16);
        assert!(c.contains([10, 244, 3, 4]));
        assert!(!c.contains([10, 245, 0, 1]));
        assert!(Cidr4::new([0, 0, 0, 0], 0).contains([192, 168, 1, 1]));
        assert!(Cidr4::new([192, 168, 1, 1], 32).contains([192, 168, 1, 1]));
        assert!(!Cidr4::new([192, 168, 1, 1], 32).contains([192, 168, 1, 2]));
    }

    #[test]
    fn pod_address_detection() {
        let mut cfg = DatapathConfig::default();
        assert_eq!(cfg.is_pod_address([10, 244, 1, 1]), None);
        cfg.cluster_cidrs[0] = Cidr4::new([10, 244, 0, 0], 16);
        cfg.cluster_cidr_count = 1;
        assert_eq!(cfg.is_pod_address([10, 244, 1, 1]), Some(true));
        assert_eq!(cfg.is_pod_address([192, 168, 1, 1]), Some(false));
    }
}
