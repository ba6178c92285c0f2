//! What the tc path needs of an IP family, as a trait ([`Ip`]): parsing a packet, rewriting its
//! addresses and ports with their checksums, answering with an ICMP port unreachable, and reading
//! and rewriting the packet an ICMP error quotes. `ipv4.rs` and `ipv6.rs` implement it; every
//! other file of the tc path is written once over `F: Ip`. Also the one's-complement sums both
//! families' checksums use.

use aya_ebpf::{bindings::bpf_fib_lookup, programs::TcContext};

use super::{
    icmp_error::Quoted,
    parse::{Flow, Packet, Parsed},
};
use crate::family::FamilyMaps;

pub(super) trait Ip: FamilyMaps {
    /// Length of the IP header without options or extension headers.
    const HLEN: usize;
    /// Offsets of the source and destination addresses inside the IP header.
    const SADDR: usize;
    const DADDR: usize;
    /// Offset of the protocol (IPv4) or first next header (IPv6) inside the IP header.
    const PROTO: usize;
    /// Whether a packet whose IP header says `proto` there may be SCTP: IPv4's protocol, and
    /// for IPv6 anything but TCP, UDP and ICMPv6 (SCTP may come after extension headers).
    fn may_be_sctp(proto: u8) -> bool;

    /// Ethernet, IP and the L4 ports of the packet in `ctx`, whose Ethernet type is this family's.
    fn parse(ctx: &TcContext) -> Parsed<Self>;

    /// Rewrites the destination (`source == false`) or source address and port of a TCP/UDP
    /// packet (SCTP: `sctp::rewrite`), with every checksum that covers them updated incrementally.
    fn rewrite(
        ctx: &TcContext,
        pkt: &Packet<Self>,
        source: bool,
        addr: Self::Addr,
        port: u16,
    ) -> Result<(), ()>;

    /// The length of the L4 header at `l4` and its payload, from the IP header (not from the
    /// frame, which may carry Ethernet padding).
    fn l4_len(ctx: &TcContext, l4: usize) -> Option<u32>;

    /// Rewrites the destination (`source == false`) or source address of a later fragment (no
    /// L4 header; also of SCTP, whose checksum covers no address), with the IP header checksum
    /// where the family has one.
    fn rewrite_l3(ctx: &TcContext, source: bool, old_addr: Self::Addr, addr: Self::Addr) -> Result<(), ()>;

    /// Whether an ICMP error may be sent to `addr`.
    fn answerable(addr: &Self::Addr) -> bool;

    /// Turns the packet into the family's ICMP port unreachable for its source, sent back out of
    /// the interface it came in on (a verdict: `TC_ACT_REDIRECT`, or `TC_ACT_SHOT`).
    /// `l4`: the offset of the packet's L4 header (the quote ends 8 bytes into it).
    fn port_unreachable(ctx: &TcContext, l4: usize) -> i32;

    /// The packet an ICMP error at `icmp` quotes, when the error is one to translate (the types
    /// that quote a packet) and the quote is a TCP, UDP or SCTP packet.
    fn parse_icmp_error(ctx: &TcContext, icmp: usize) -> Option<Quoted<Self>>;

    /// Rewrites the quoted packet's address at `addr_off` from `old_addr` to `addr`, with the ICMP
    /// checksum (and the quoted IP checksum, where there is one); `icmp_error::rewrite_quoted`
    /// does the rest.
    fn rewrite_quoted_addr(
        ctx: &TcContext,
        q: &Quoted<Self>,
        addr_off: usize,
        old_addr: Self::Addr,
        addr: Self::Addr,
    ) -> Result<(), ()>;

    /// Rewrites the outer destination of the ICMP error at `icmp`, with every checksum that
    /// covers it.
    fn rewrite_outer_dst(
        ctx: &TcContext,
        outer: &Flow<Self>,
        icmp: usize,
        addr: Self::Addr,
    ) -> Result<(), ()>;

    /// `snat::reclaim_port_for`, through this family's global function.
    fn reclaim_port_for(backend_id: u32, proto: u8, masq_route: u32) -> u16;

    /// Sets the family and addresses of a route lookup (`bpf_fib_lookup`) from `saddr` to
    /// `daddr`.
    fn fib_addresses(params: &mut bpf_fib_lookup, saddr: &Self::Addr, daddr: &Self::Addr);

    /// The next hop a route lookup left in `params`: the route's gateway, else the destination.
    fn fib_next_hop(params: &bpf_fib_lookup) -> Self::Addr;

    /// `*dst = *src` where `src` points into a map: without a call to `memmove`, which LLVM emits
    /// for a 16-byte copy it cannot prove free of overlap, and whose frame (32 bytes on Linux 5.10,
    /// however small) the call chain below `new_flow::track` has no room for.
    fn copy_addr(dst: &mut Self::Addr, src: &Self::Addr);
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

/// One's-complement sum of the `len` bytes of `bytes` from `from` (constants at every call site).
#[inline(always)]
pub(super) fn csum_add_range<const N: usize>(mut sum: u32, bytes: &[u8; N], from: usize, len: usize) -> u32 {
    let mut i = from;
    while i + 1 < from + len && i + 1 < N {
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
