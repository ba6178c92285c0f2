//! IPv4 and ICMPv4 facts of the tc path, in one place: header layout, the header checksum, the
//! ICMPv4 types, and which sources an ICMP error may go to. (IPv6 gets an `ipv6.rs` beside it.)

use network_types::ip::Ipv4Hdr;

/// The Ethernet type of IPv4.
pub(super) const ETH_P_IP: u16 = 0x0800;
/// The IP version in the upper nibble of the first header byte.
pub(super) const VERSION: u8 = 4;
/// The first header byte of an IPv4 header without options: version 4, 5 words.
pub(super) const VIHL_NO_OPTIONS: u8 = 0x45;
/// Length of the IPv4 header without options.
pub(super) const HLEN: usize = Ipv4Hdr::LEN;
/// More-fragments flag and fragment offset, in the header's flags/offset field.
pub(super) const FRAG_MASK: u16 = 0x3fff;
/// Offsets inside the IPv4 header.
pub(super) const IP_CHECK: usize = 10;
pub(super) const IP_SADDR: usize = 12;
pub(super) const IP_DADDR: usize = 16;

/// ICMPv4 types and codes.
pub(super) const ICMP_DEST_UNREACH: u8 = 3;
pub(super) const ICMP_PORT_UNREACH: u8 = 3;
pub(super) const ICMP_TIME_EXCEEDED: u8 = 11;
pub(super) const ICMP_PARAMETER_PROBLEM: u8 = 12;
/// Length of the ICMP header (type, code, checksum and 4 bytes that depend on the type).
pub(super) const ICMP_HLEN: usize = 8;
/// Offset of the checksum inside the ICMP header.
pub(super) const ICMP_CHECK: usize = 2;

/// The header length in bytes, from the header's first byte (version and IHL).
#[inline(always)]
pub(super) fn header_len(vihl: u8) -> usize {
    ((vihl & 0x0f) as usize) << 2
}

/// One's-complement sum of big-endian 16-bit words.
#[inline(always)]
pub(super) fn csum_add_bytes<const N: usize>(mut sum: u32, bytes: &[u8; N]) -> u32 {
    let mut i = 0;
    while i + 1 < N {
        sum += u16::from_be_bytes([bytes[i], bytes[i + 1]]) as u32;
        i += 2;
    }
    sum
}

#[inline(always)]
pub(super) fn csum_fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// Whether an ICMP error may be sent to `addr` (RFC 1122 3.2.2): not unspecified (0/8), loopback
/// (127/8), multicast (224/4) or reserved/broadcast (240/4).
#[inline(always)]
pub(super) fn answerable(addr: [u8; 4]) -> bool {
    !matches!(addr[0], 0 | 127 | 224..=255)
}
