//! The two IP families as types. Every key and value that holds an address is generic over
//! `F: Family` (`SvcKey<F>`, `CtKey<F>`, ...), so one definition serves the `lb4_*` and the
//! `lb6_*` maps, and the programs and the agent are written once and monomorphised per family.
//!
//! The IPv4 instances keep the layouts the IPv4-only releases pinned (a running node upgrades
//! without losing a flow); the IPv6 ones are free of implicit padding (`Family::Pad` fills what an
//! address of 16 bytes leaves before an 8-byte-aligned end).

use core::{fmt::Debug, hash::Hash};

/// One IP family: its address type and the few layout facts that differ between families.
pub trait Family: Copy + Default + Debug + Eq + Ord + Hash + 'static {
    /// An address, network order, exactly as on the wire.
    type Addr: Copy
        + Default
        + Debug
        + Eq
        + Ord
        + Hash
        + AsRef<[u8]>
        + AsMut<[u8]>
        + crate::prefilter::Fold
        + crate::cluster_ip::MaskedDiff;
    /// The client of an affinity entry: an address (tc path) or a network-namespace cookie
    /// (socket path), whichever is larger.
    type Client: Copy + Default + Debug + Eq + Hash;
    /// Explicit padding at the end of a structure whose size an IPv6 address would otherwise leave
    /// unaligned (empty for IPv4).
    type Pad: Copy + Default + Debug + Eq + Ord + Hash;
    /// "IPv4" or "IPv6", as Kubernetes spells the families.
    const NAME: &'static str;
    /// `AF_INET` or `AF_INET6`.
    const AF: u32;
    /// The Ethernet type of its packets.
    const ETH_P: u16;
    /// Bits in an address (the longest prefix).
    const BITS: u8;
    /// The unspecified address (all zeros).
    const UNSPECIFIED: Self::Addr;
}

/// IPv4.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct V4;

/// IPv6.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct V6;

pub const AF_INET: u32 = 2;
pub const AF_INET6: u32 = 10;

impl Family for V4 {
    type Addr = [u8; 4];
    type Client = u64;
    type Pad = [u8; 0];
    const NAME: &'static str = "IPv4";
    const AF: u32 = AF_INET;
    const ETH_P: u16 = 0x0800;
    const BITS: u8 = 32;
    const UNSPECIFIED: [u8; 4] = [0; 4];
}

impl Family for V6 {
    type Addr = In6Addr;
    type Client = In6Addr;
    type Pad = [u8; 4];
    const NAME: &'static str = "IPv6";
    const AF: u32 = AF_INET6;
    const ETH_P: u16 = 0x86DD;
    const BITS: u8 = 128;
    const UNSPECIFIED: In6Addr = In6Addr::new([0; 16]);
}

/// An IPv6 address, network order, 4-byte aligned like the kernel's `struct in6_addr`. The
/// alignment is what keeps the programs' stack frames small: the compiler copies and compares an
/// aligned address as four 32-bit words, where a byte array becomes sixteen registers, each
/// spilled to 8 bytes of stack.
#[repr(C, align(4))]
#[derive(Clone, Copy, Default)]
pub struct In6Addr {
    pub octets: [u8; 16],
}

impl In6Addr {
    #[inline(always)]
    pub const fn new(octets: [u8; 16]) -> Self {
        In6Addr { octets }
    }

    /// The address as four 32-bit words, each holding its 4 bytes in memory order (the form of
    /// the kernel's `user_ip6` and `in6_addr.s6_addr32`).
    #[inline(always)]
    pub const fn words(&self) -> [u32; 4] {
        // SAFETY: the same 16 bytes; any bit pattern is a valid u32.
        unsafe { core::mem::transmute(self.octets) }
    }

    /// The address of four 32-bit words in the form [`Self::words`] returns.
    #[inline(always)]
    pub const fn from_words(words: [u32; 4]) -> Self {
        // SAFETY: as above.
        In6Addr {
            octets: unsafe { core::mem::transmute::<[u32; 4], [u8; 16]>(words) },
        }
    }
}

impl PartialEq for In6Addr {
    #[inline(always)]
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.words(), other.words());
        // Not short-circuiting: four compares and no branches between them.
        (a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) == 0
    }
}

impl Eq for In6Addr {}

impl PartialOrd for In6Addr {
    fn partial_cmp(&self, other: &Self) -> Option<core::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for In6Addr {
    fn cmp(&self, other: &Self) -> core::cmp::Ordering {
        self.octets.cmp(&other.octets)
    }
}

impl Hash for In6Addr {
    fn hash<H: core::hash::Hasher>(&self, state: &mut H) {
        self.octets.hash(state);
    }
}

impl Debug for In6Addr {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        core::net::Ipv6Addr::from(self.octets).fmt(f)
    }
}

impl AsRef<[u8]> for In6Addr {
    fn as_ref(&self) -> &[u8] {
        &self.octets
    }
}

impl AsMut<[u8]> for In6Addr {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.octets
    }
}

impl From<[u8; 16]> for In6Addr {
    fn from(octets: [u8; 16]) -> Self {
        In6Addr { octets }
    }
}

impl From<core::net::Ipv6Addr> for In6Addr {
    fn from(addr: core::net::Ipv6Addr) -> Self {
        In6Addr {
            octets: addr.octets(),
        }
    }
}

impl From<In6Addr> for core::net::Ipv6Addr {
    fn from(addr: In6Addr) -> Self {
        core::net::Ipv6Addr::from(addr.octets)
    }
}

/// Whether `addr` is inside `net`/`prefix_len` (both network order). A prefix longer than the
/// address is the whole address.
#[inline(always)]
pub fn prefix_contains(net: &[u8], prefix_len: u8, addr: &[u8]) -> bool {
    let mut left = prefix_len as usize;
    let mut i = 0;
    while i < net.len() && i < addr.len() && left > 0 {
        let bits = if left >= 8 { 8 } else { left };
        let mask = (0xffu16 << (8 - bits)) as u8;
        if net[i] & mask != addr[i] & mask {
            return false;
        }
        left -= bits;
        i += 1;
    }
    true
}

/// Writes `addr` of family `F` into the first bytes of `bytes`, 16 bytes in which the programs
/// hand an address of either family to userspace (`monitor::MonitorEvent`'s addresses); the rest is
/// left as it is. (`lb_sock_trace`'s `TracedCall::write` keeps its own copy of this loop: built on
/// this function, the harness's one frame went past 512 bytes.)
#[inline(always)]
pub fn put_addr<F: Family>(bytes: &mut [u8; 16], addr: &F::Addr) {
    let src = addr.as_ref();
    let mut i = 0;
    while i < src.len() && i < 16 {
        bytes[i] = src[i];
        i += 1;
    }
}

/// An IPv4 address in IPv6's IPv4-mapped form (`::ffff:a.b.c.d`, RFC 4291 2.5.5.2): what a
/// dual-stack (AF_INET6) socket names when it talks IPv4.
#[inline(always)]
pub const fn v4_mapped(addr: [u8; 4]) -> In6Addr {
    In6Addr::new([
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, addr[0], addr[1], addr[2], addr[3],
    ])
}

/// The IPv4 address of an IPv4-mapped IPv6 address, if it is one.
#[inline(always)]
pub const fn v4_unmapped(addr: &In6Addr) -> Option<[u8; 4]> {
    let addr = &addr.octets;
    if addr[0] == 0
        && addr[1] == 0
        && addr[2] == 0
        && addr[3] == 0
        && addr[4] == 0
        && addr[5] == 0
        && addr[6] == 0
        && addr[7] == 0
        && addr[8] == 0
        && addr[9] == 0
        && addr[10] == 0xff
        && addr[11] == 0xff
    {
        Some([addr[12], addr[13], addr[14], addr[15]])
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        assert!(prefix_contains(&[10, 244, 0, 0], 16, &[10, 244, 3, 4]));
        assert!(!prefix_contains(&[10, 244, 0, 0], 16, &[10, 245, 0, 1]));
        assert!(prefix_contains(&[0, 0, 0, 0], 0, &[192, 168, 1, 1]));
        assert!(prefix_contains(&[192, 168, 1, 1], 32, &[192, 168, 1, 1]));
        assert!(!prefix_contains(&[192, 168, 1, 1], 32, &[192, 168, 1, 2]));
        assert!(prefix_contains(&[10, 0, 0, 0], 9, &[10, 127, 0, 0]));
        assert!(!prefix_contains(&[10, 0, 0, 0], 9, &[10, 128, 0, 0]));
        let net = [0x20u8, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let mut inside = net;
        inside[15] = 7;
        assert!(prefix_contains(&net, 64, &inside));
        let mut outside = net;
        outside[3] = 0xb9;
        assert!(!prefix_contains(&net, 64, &outside));
        assert!(prefix_contains(&net, 200, &net));
    }

    #[test]
    fn ipv6_addresses_compare_and_print() {
        let a = In6Addr::from(core::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1));
        let mut b = a;
        assert_eq!(a, b);
        b.octets[15] = 2;
        assert_ne!(a, b);
        assert!(a < b);
        b.octets[15] = 1;
        b.octets[0] = 0;
        assert_ne!(a, b);
        assert_eq!(core::mem::align_of::<In6Addr>(), 4);
        assert_eq!(
            core::net::Ipv6Addr::from(a),
            core::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1)
        );
    }

    #[test]
    fn mapped_addresses() {
        let m = v4_mapped([10, 96, 0, 10]);
        assert_eq!(v4_unmapped(&m), Some([10, 96, 0, 10]));
        assert_eq!(v4_unmapped(&In6Addr::new([0; 16])), None);
        let mut not = m;
        not.octets[10] = 0;
        assert_eq!(v4_unmapped(&not), None);
    }
}
