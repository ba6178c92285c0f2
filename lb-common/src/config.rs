//! `lb_config`: one entry of node-wide settings the programs read on every decision. The agent
//! writes it at start and whenever a setting changes.

use crate::{
    cluster_ip::MaskedDiff,
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
    /// Some interface has a masquerade address other than its family's `snat_addr`
    /// (`lb_masq_addrs`): a new flow's route is looked up (`bpf_fib_lookup`) and a masqueraded one
    /// gets the address of the interface it leaves by, as MASQUERADE does. Without it every
    /// masqueraded flow gets `snat_addr` and no route is looked up.
    pub const MASQUERADE_BY_INTERFACE: u32 = 1 << 3;
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
    /// `--bpf-lb-maglev-hash-seed` as the word both the Maglev tables and the flow hash derive
    /// from (`lb-agent/src/plan/maglev.rs::HashSeed`); 0: the fixed seed. In what was padding, so
    /// an earlier release's entry reads as 0, the seed it used.
    pub maglev_seed: u32,
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
        maglev_seed: 0,
    };
}

/// Default masquerade port range (as Calico's `BPFPSNATPorts`).
pub const SNAT_PORT_MIN: u16 = 20_000;
pub const SNAT_PORT_MAX: u16 = 29_999;

/// Up to this many masquerade candidates per interface and family (`InterfaceAddrs`).
pub const MAX_INTERFACE_ADDRS: usize = 4;

/// The addresses MASQUERADE may give a flow of one family leaving by one interface, in the
/// kernel's order: IPv4's primary addresses of universe scope (`inet_select_addr`), IPv6's global
/// ones that are not tentative, deprecated ones last. A value of `lb_masq_addrs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InterfaceAddrs<F: Family> {
    /// Number of valid entries in `addrs`; 0: the interface has none of this family.
    pub count: u8,
    pub _pad: [u8; 3],
    pub addrs: [InterfaceAddr<F>; MAX_INTERFACE_ADDRS],
}

/// One address of an interface, with its subnet's mask spelled out (matching a next hop is then
/// arithmetic, `cluster_ip::MaskedDiff`: a byte loop over the prefix length took Linux 5.10's
/// verifier past its million steps) and its prefix length for people reading the map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InterfaceAddr<F: Family> {
    pub addr: F::Addr,
    pub mask: F::Addr,
    pub prefix_len: u8,
    pub _pad: [u8; 3],
}

impl<F: Family> InterfaceAddrs<F> {
    /// The slot MASQUERADE takes for a packet whose next hop is `next_hop`: the first address
    /// whose subnet holds the next hop (`inet_ifa_match`; for IPv6 the longest-matching-prefix
    /// rule of source selection, RFC 6724 rule 8, where one prefix holds it), else the first. The
    /// loop runs `count` times, not a constant four (as `ServiceRanges::may_contain`).
    #[inline(always)]
    pub fn slot_for(&self, next_hop: &F::Addr) -> u8 {
        let n = if (self.count as usize) < MAX_INTERFACE_ADDRS {
            self.count as usize
        } else {
            MAX_INTERFACE_ADDRS
        };
        let mut i = 0;
        while i < n {
            let a = &self.addrs[i];
            if next_hop.masked_diff(&a.addr, &a.mask) == 0 {
                return i as u8;
            }
            i += 1;
        }
        0
    }

    /// The valid entries (at most [`MAX_INTERFACE_ADDRS`] whatever `count` says).
    pub fn valid(&self) -> &[InterfaceAddr<F>] {
        &self.addrs[..usize::from(self.count).min(MAX_INTERFACE_ADDRS)]
    }

    /// The address in `slot`, if the interface has one there (else its first, if any).
    #[inline(always)]
    pub fn get(&self, slot: u8) -> Option<&F::Addr> {
        let slot = slot as usize;
        if slot < MAX_INTERFACE_ADDRS && slot < self.count as usize {
            Some(&self.addrs[slot].addr)
        } else if self.count > 0 {
            Some(&self.addrs[0].addr)
        } else {
            None
        }
    }
}

/// One entry of `lb_masq_addrs`: ifindex `u32` -> the interface's masquerade candidates of both
/// families. Key 0 holds each family's `snat_addr` (the node's primary IP): what a flow gets when
/// its route is unknown or its interface has no address of the family, as MASQUERADE falls back
/// to another interface's address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MasqueradeAddrs {
    pub v4: InterfaceAddrs<V4>,
    pub v6: InterfaceAddrs<V6>,
}

/// The key of `lb_masq_addrs`' fallback entry.
pub const MASQUERADE_FALLBACK: u32 = 0;

/// The part of [`DatapathConfig`] (and of a [`MasqueradeAddrs`]) that belongs to one family.
pub trait FamilySettings: Family {
    fn settings(cfg: &DatapathConfig) -> &FamilyConfig<Self>;
    fn settings_mut(cfg: &mut DatapathConfig) -> &mut FamilyConfig<Self>;
    fn interface_addrs(addrs: &MasqueradeAddrs) -> &InterfaceAddrs<Self>;
    fn interface_addrs_mut(addrs: &mut MasqueradeAddrs) -> &mut InterfaceAddrs<Self>;
}

impl FamilySettings for V4 {
    #[inline(always)]
    fn settings(cfg: &DatapathConfig) -> &FamilyConfig<V4> {
        &cfg.v4
    }
    fn settings_mut(cfg: &mut DatapathConfig) -> &mut FamilyConfig<V4> {
        &mut cfg.v4
    }
    #[inline(always)]
    fn interface_addrs(addrs: &MasqueradeAddrs) -> &InterfaceAddrs<V4> {
        &addrs.v4
    }
    fn interface_addrs_mut(addrs: &mut MasqueradeAddrs) -> &mut InterfaceAddrs<V4> {
        &mut addrs.v4
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
    #[inline(always)]
    fn interface_addrs(addrs: &MasqueradeAddrs) -> &InterfaceAddrs<V6> {
        &addrs.v6
    }
    fn interface_addrs_mut(addrs: &mut MasqueradeAddrs) -> &mut InterfaceAddrs<V6> {
        &mut addrs.v6
    }
}

user_pod!(DatapathConfig);
user_pod!(MasqueradeAddrs);

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
