//! kube-proxy's `cluster-ips-check` (nftables mode): a new flow to a cluster IP on a port no
//! Service has is rejected, and one to an address of a Service CIDR that no Service holds is
//! dropped, so a client fails at once instead of waiting on a route to nowhere. Both paths apply
//! it to traffic no frontend matched: the socket programs (a local `connect()` fails with
//! ECONNREFUSED or EHOSTUNREACH) and the tc ingress program (ICMP port unreachable, or a drop).
//!
//! Two maps per family, written by the agent:
//! - `lb4_cluster_ips` (LPM trie): every cluster IP as a host prefix -> [`action::REJECT`], every
//!   Service CIDR -> [`action::DROP`]. The longest match decides, so a cluster IP inside a CIDR
//!   is rejected, not dropped.
//! - `lb4_svc_ranges` (array, one [`ServiceRanges`]): a few prefixes covering every entry of the
//!   trie, checked by arithmetic first, so that traffic to no Service address (nearly all that is
//!   not translated) costs no trie walk. The Service CIDRs themselves, usually; the agent widens
//!   them when there are more than [`MAX_SERVICE_RANGES`] (a superset only costs lookups).

use crate::{
    family::{Family, In6Addr},
    user_pod,
};

/// Values of the trie.
pub mod action {
    /// A cluster IP: a port no Service has (kube-proxy's "Reject traffic to invalid ports of
    /// ClusterIPs").
    pub const REJECT: u8 = 1;
    /// Inside a Service CIDR, no Service's ("Drop traffic to unallocated ClusterIPs").
    pub const DROP: u8 = 2;
    /// A cluster IP of a Service another proxy serves (labelled
    /// `service.kubernetes.io/service-proxy-name`): left alone. kube-proxy checks after DNAT, so
    /// that proxy's translation comes first there; the programs check before it.
    pub const ALLOW: u8 = 3;
}

/// The trie's key data (after the kernel's prefix length): an address of the family.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterIpKey<F: Family> {
    pub addr: F::Addr,
}

/// The most prefixes [`ServiceRanges`] holds per family.
pub const MAX_SERVICE_RANGES: usize = 8;

/// Room `lb4_cluster_ips` keeps beside one entry per frontend (`Capacities::revnat`, which bounds
/// the cluster IPs) for the Service CIDRs.
pub const SERVICE_CIDR_ROOM: u32 = 256;

/// Prefix matching without a loop per byte: the bits of `addr` that differ from `net` under
/// `mask`, word by word (zero when `addr` is in the prefix). A byte loop as long as the prefix
/// (`Cidr::contains`) costs the verifier a walk per prefix length: over eight IPv6 ranges, more
/// than its million steps.
pub trait MaskedDiff {
    fn masked_diff(&self, net: &Self, mask: &Self) -> u32;
}

impl MaskedDiff for [u8; 4] {
    #[inline(always)]
    fn masked_diff(&self, net: &Self, mask: &Self) -> u32 {
        (u32::from_ne_bytes(*self) ^ u32::from_ne_bytes(*net)) & u32::from_ne_bytes(*mask)
    }
}

impl MaskedDiff for In6Addr {
    #[inline(always)]
    fn masked_diff(&self, net: &Self, mask: &Self) -> u32 {
        let (a, n, m) = (self.words(), net.words(), mask.words());
        ((a[0] ^ n[0]) & m[0]) | ((a[1] ^ n[1]) & m[1]) | ((a[2] ^ n[2]) & m[2]) | ((a[3] ^ n[3]) & m[3])
    }
}

/// One covering prefix: its network and mask (the mask spelled out, so that matching is
/// arithmetic), and its length for people reading the map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceRange<F: Family> {
    pub net: F::Addr,
    pub mask: F::Addr,
    pub prefix_len: u8,
    pub _pad: [u8; 3],
}

/// The prefixes every entry of the family's trie lies in.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceRanges<F: Family> {
    /// Number of valid entries in `ranges` (0: the check is off for the family).
    pub count: u8,
    pub _pad: [u8; 3],
    pub ranges: [ServiceRange<F>; MAX_SERVICE_RANGES],
}

impl<F: Family> Default for ServiceRanges<F> {
    fn default() -> Self {
        ServiceRanges {
            count: 0,
            _pad: [0; 3],
            ranges: [ServiceRange::default(); MAX_SERVICE_RANGES],
        }
    }
}

impl<F: Family> ServiceRanges<F> {
    /// Whether `ip` may be a cluster IP or lie in a Service CIDR (then the trie decides). The
    /// loop runs `count` times, not a constant eight: unrolled, the compiler interleaves eight
    /// IPv6 comparisons and spills them to a frame the tc programs' call chains cannot spare.
    #[inline(always)]
    pub fn may_contain(&self, ip: &F::Addr) -> bool {
        let n = if (self.count as usize) < MAX_SERVICE_RANGES {
            self.count as usize
        } else {
            MAX_SERVICE_RANGES
        };
        let mut i = 0;
        while i < n {
            let range = &self.ranges[i];
            if ip.masked_diff(&range.net, &range.mask) == 0 {
                return true;
            }
            i += 1;
        }
        false
    }
}

user_pod!(
    ServiceRanges<crate::family::V4>,
    ServiceRanges<crate::family::V6>,
    ClusterIpKey<crate::family::V4>,
    ClusterIpKey<crate::family::V6>,
);

#[cfg(test)]
mod tests {
    use core::mem::size_of;

    use super::*;
    use crate::family::{V4, V6};

    #[test]
    fn layout() {
        assert_eq!(size_of::<ClusterIpKey<V4>>(), 4);
        assert_eq!(size_of::<ClusterIpKey<V6>>(), 16);
        assert_eq!(size_of::<ServiceRanges<V4>>(), 4 + 12 * MAX_SERVICE_RANGES);
        assert_eq!(size_of::<ServiceRanges<V6>>(), 4 + 36 * MAX_SERVICE_RANGES);
    }

    fn range4(net: [u8; 4], prefix_len: u8) -> ServiceRange<V4> {
        let mask = (u32::MAX.checked_shl(32 - prefix_len as u32).unwrap_or(0)).to_be_bytes();
        ServiceRange {
            net,
            mask,
            prefix_len,
            _pad: [0; 3],
        }
    }

    #[test]
    fn only_the_valid_ranges_contain() {
        let mut r = ServiceRanges::<V4>::default();
        assert!(!r.may_contain(&[10, 96, 0, 1]));
        assert!(
            !r.may_contain(&[0, 0, 0, 0]),
            "the unused zero ranges match nothing"
        );
        r.ranges[0] = range4([10, 96, 0, 0], 16);
        r.ranges[1] = range4([10, 100, 0, 7], 32);
        r.ranges[2] = range4([0, 0, 0, 0], 0);
        r.count = 2;
        assert!(r.may_contain(&[10, 96, 200, 1]));
        assert!(r.may_contain(&[10, 100, 0, 7]));
        assert!(!r.may_contain(&[10, 100, 0, 8]));
        assert!(!r.may_contain(&[10, 97, 0, 1]));
        assert!(!r.may_contain(&[192, 0, 2, 1]), "beyond the count");
        r.count = 3;
        assert!(r.may_contain(&[192, 0, 2, 1]), "the default route contains all");
        r.count = 200;
        assert!(
            r.may_contain(&[192, 0, 2, 1]),
            "a count past the array reads the array"
        );
    }

    #[test]
    fn ipv6_prefixes_match_word_by_word() {
        let net = In6Addr::new([0xfd, 0, 0, 0x10, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let mut mask = [0u8; 16];
        mask[..14].fill(0xff); // /112
        let mut r = ServiceRanges::<V6>::default();
        r.ranges[0] = ServiceRange {
            net,
            mask: In6Addr::new(mask),
            prefix_len: 112,
            _pad: [0; 3],
        };
        r.count = 1;
        let mut inside = net;
        inside.octets[15] = 0x42;
        inside.octets[14] = 0x01;
        assert!(r.may_contain(&inside));
        let mut outside = net;
        outside.octets[13] = 1;
        assert!(!r.may_contain(&outside));
    }
}
