//! `lb_config`: one entry of node-wide settings the programs read on every decision. The agent
//! writes it at start and whenever a setting changes.

use crate::{
    family::{Family, V4, V6, prefix_contains},
    user_pod,
};

pub mod flags {
    /// Socket programs translate only sockets of the host network namespace (pods are left to the
    /// tc path), like Cilium's `--bpf-lb-sock-hostns-only`; needed under service meshes.
    pub const SOCK_HOSTNS_ONLY: u32 = 1 << 0;
    /// The prefilter's bits are complete (`crate::prefilter`): the tc programs may pass a packet
    /// whose bit is clear without looking further. Until the agent sets it, they look at every
    /// packet.
    pub const PREFILTER: u32 = 1 << 1;
    /// The local-traffic detector is the interface a packet came in by (`--detect-local-mode`
    /// BridgeInterface or InterfaceNamePrefix, both families): a packet is a pod's when its
    /// ingress ifindex is in `lb_pod_ifaces`; the cluster CIDRs are then unused.
    pub const DETECT_LOCAL_BY_INTERFACE: u32 = 1 << 2;
}

/// Up to this many `--cluster-cidr` entries of one family (kube-proxy takes one per family).
pub const MAX_CLUSTER_CIDRS: usize = 4;

/// A prefix of one family.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cidr<F: Family> {
    pub addr: F::Addr,
    pub prefix_len: u8,
    pub _pad: [u8; 3],
}

pub type Cidr4 = Cidr<V4>;
pub type Cidr6 = Cidr<V6>;

impl<F: Family> Cidr<F> {
    pub const fn new(addr: F::Addr, prefix_len: u8) -> Self {
        Self {
            addr,
            prefix_len,
            _pad: [0; 3],
        }
    }

    #[inline(always)]
    pub fn contains(&self, ip: &F::Addr) -> bool {
        prefix_contains(self.addr.as_ref(), self.prefix_len, ip.as_ref())
    }
}

/// The settings of one family.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FamilyConfig<F: Family> {
    /// The node address masqueraded flows of this family get as their source (tc path);
    /// unspecified when the node has none (such flows are dropped and counted).
    pub snat_addr: F::Addr,
    /// Number of valid entries in `cluster_cidrs`.
    pub cluster_cidr_count: u8,
    pub _pad: [u8; 3],
    /// kube-proxy's local-traffic detector of this family (`--cluster-cidr`): sources inside are
    /// pods.
    pub cluster_cidrs: [Cidr<F>; MAX_CLUSTER_CIDRS],
}

impl<F: Family> FamilyConfig<F> {
    /// Nothing configured: no masquerade address, no local-traffic detector.
    pub const EMPTY: Self = FamilyConfig {
        snat_addr: F::UNSPECIFIED,
        cluster_cidr_count: 0,
        _pad: [0; 3],
        cluster_cidrs: [Cidr::new(F::UNSPECIFIED, 0); MAX_CLUSTER_CIDRS],
    };

    /// Whether `ip` is a pod address per the local-traffic detector; `None` when no cluster CIDR
    /// of this family is configured (kube-proxy then treats no traffic as pod traffic).
    #[inline(always)]
    pub fn is_pod_address(&self, ip: &F::Addr) -> Option<bool> {
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

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatapathConfig {
    /// `bpf_get_netns_cookie()` of the host network namespace (the agent's own).
    pub host_netns_cookie: u64,
    /// `flags::*`.
    pub flags: u32,
    /// Source ports for masqueraded flows, inclusive; outside the kernel's ephemeral range so a
    /// masqueraded flow never collides with a connection of the node itself.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    pub v4: FamilyConfig<V4>,
    pub v6: FamilyConfig<V6>,
    pub _pad: [u8; 4],
}

impl DatapathConfig {
    /// What `lb_config` holds before the agent first writes it.
    pub const UNCONFIGURED: Self = DatapathConfig {
        host_netns_cookie: 0,
        flags: 0,
        snat_port_min: 0,
        snat_port_max: 0,
        v4: FamilyConfig::EMPTY,
        v6: FamilyConfig::EMPTY,
        _pad: [0; 4],
    };
}

/// Default masquerade port range (as Calico's `BPFPSNATPorts`).
pub const SNAT_PORT_MIN: u16 = 20_000;
pub const SNAT_PORT_MAX: u16 = 29_999;

/// The part of [`DatapathConfig`] that belongs to one family.
pub trait FamilySettings: Family {
    fn settings(cfg: &DatapathConfig) -> &FamilyConfig<Self>;
    fn settings_mut(cfg: &mut DatapathConfig) -> &mut FamilyConfig<Self>;
}

impl FamilySettings for V4 {
    #[inline(always)]
    fn settings(cfg: &DatapathConfig) -> &FamilyConfig<V4> {
        &cfg.v4
    }
    fn settings_mut(cfg: &mut DatapathConfig) -> &mut FamilyConfig<V4> {
        &mut cfg.v4
    }
}

impl FamilySettings for V6 {
    #[inline(always)]
    fn settings(cfg: &DatapathConfig) -> &FamilyConfig<V6> {
        &cfg.v6
    }
    fn settings_mut(cfg: &mut DatapathConfig) -> &mut FamilyConfig<V6> {
        &mut cfg.v6
    }
}

user_pod!(DatapathConfig);

#[cfg(test)]
mod tests {
    use core::mem::size_of;

    use super::*;
    use crate::family::In6Addr;

    #[test]
    fn layout() {
        assert_eq!(size_of::<Cidr4>(), 8);
        assert_eq!(size_of::<Cidr6>(), 20);
        assert_eq!(size_of::<FamilyConfig<V4>>(), 8 + 8 * MAX_CLUSTER_CIDRS);
        assert_eq!(size_of::<FamilyConfig<V6>>(), 20 + 20 * MAX_CLUSTER_CIDRS);
        assert_eq!(size_of::<DatapathConfig>(), 16 + 40 + 100 + 4);
    }

    #[test]
    fn cidr_contains() {
        let c = Cidr4::new([10, 244, 0, 0], 16);
        assert!(c.contains(&[10, 244, 3, 4]));
        assert!(!c.contains(&[10, 245, 0, 1]));
        assert!(Cidr4::new([0, 0, 0, 0], 0).contains(&[192, 168, 1, 1]));
        assert!(Cidr4::new([192, 168, 1, 1], 32).contains(&[192, 168, 1, 1]));
        assert!(!Cidr4::new([192, 168, 1, 1], 32).contains(&[192, 168, 1, 2]));
        let mut net = In6Addr::default();
        net.octets[..4].copy_from_slice(&[0xfd, 0, 0x10, 0x24]);
        let mut pod = net;
        pod.octets[15] = 9;
        assert!(Cidr6::new(net, 56).contains(&pod));
        assert!(!Cidr6::new(net, 56).contains(&In6Addr::new([0xfe; 16])));
    }

    #[test]
    fn pod_address_detection_per_family() {
        let mut cfg = DatapathConfig::default();
        assert_eq!(cfg.v4.is_pod_address(&[10, 244, 1, 1]), None);
        cfg.v4.cluster_cidrs[0] = Cidr4::new([10, 244, 0, 0], 16);
        cfg.v4.cluster_cidr_count = 1;
        assert_eq!(V4::settings(&cfg).is_pod_address(&[10, 244, 1, 1]), Some(true));
        assert_eq!(cfg.v4.is_pod_address(&[192, 168, 1, 1]), Some(false));
        assert_eq!(
            V6::settings(&cfg).is_pod_address(&In6Addr::new([0xfd; 16])),
            None,
            "no IPv6 detector"
        );
    }
}
