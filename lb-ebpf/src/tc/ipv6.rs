//! IPv6 and ICMPv6 on the tc path ([`Ip`] for `V6`): the fixed header, extension headers
//! (hop-by-hop, routing, destination options, authentication walked over; a fragment header
//! makes the packet a fragment, first or later: `super::fragment`), no header checksum (an address change shows only in the L4 and
//! ICMPv6 checksums, through their pseudo-header), ICMPv6's port unreachable and error types
//! (Packet Too Big included: IPv6 routers never fragment, so PMTU discovery depends on it), and
//! which sources may get an ICMPv6 error. Neighbour discovery and router advertisements are
//! ICMPv6 too, and pass untouched.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_PSEUDO_HDR, TC_ACT_SHOT, bpf_fib_lookup},
    helpers::{bpf_csum_diff, bpf_csum_update, bpf_redirect, bpf_skb_load_bytes},
    programs::TcContext,
};
use lb_common::{
    family::{Family, In6Addr, V6},
    proto,
    stats::Counter,
};

use super::{
    fragment,
    icmp_error::Quoted,
    ip::{Ip, csum_add_bytes, csum_add_range, csum_fold},
    parse::{ETH_HLEN, Flow, ICMP_CHECK, ICMP_HLEN, Packet, Parsed, parse_l4, port_changed, ptr_at, skb},
};
use crate::stats::count;
use core::ffi::c_void;

/// Length of the fixed IPv6 header.
const HLEN: usize = 40;
/// Offsets inside the IPv6 header.
const IP6_PAYLOAD_LEN: usize = 4;
const IP6_NEXT: usize = 6;
const IP6_SADDR: usize = 8;
const IP6_DADDR: usize = 24;

/// Extension headers (next-header values).
const HOPOPTS: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const AUTH: u8 = 51;
const DSTOPTS: u8 = 60;
const MOBILITY: u8 = 135;
/// Extension headers walked before giving up on a packet (it passes untranslated).
const MAX_EXT_HEADERS: usize = 4;
/// The fragment offset and more-fragments bits of a fragment header (RFC 8200 4.5); a fragment
/// header with neither is an atomic fragment (RFC 6946), a whole packet.
const FRAG_OFFSET_AND_MORE: u16 = 0xfff9;
/// The fragment offset alone.
const FRAG_OFFSET: u16 = 0xfff8;

/// ICMPv6 types and codes (RFC 4443).
const ICMP6_DEST_UNREACH: u8 = 1;
const ICMP6_PACKET_TOO_BIG: u8 = 2;
const ICMP6_TIME_EXCEEDED: u8 = 3;
const ICMP6_PARAM_PROBLEM: u8 = 4;
const ICMP6_PORT_UNREACH: u8 = 4;
/// The hop limit of the ICMPv6 answers this node builds.
const HOP_LIMIT: u8 = 64;

/// The source and destination addresses at `at` in the packet, copied by `bpf_skb_load_bytes`
/// into aligned memory (read in place, the unaligned bytes would each take a register).
#[inline(always)]
fn addrs_at(ctx: &TcContext, at: usize) -> Option<[In6Addr; 2]> {
    ctx.load::<[In6Addr; 2]>(at).ok()
}

/// The one's-complement difference between two addresses, for `l4_csum_replace` with size 0.
#[inline(always)]
fn csum_diff(from: &In6Addr, to: &In6Addr) -> u64 {
    let mut from = from.words();
    let mut to = to.words();
    // SAFETY: both buffers are 16 bytes on the stack, as the sizes say.
    let diff = unsafe { bpf_csum_diff(from.as_mut_ptr(), 16, to.as_mut_ptr(), 16, 0) };
    diff as u32 as u64
}

/// An address of the pseudo-header changed by `diff`: the L4 (or ICMPv6) checksum at `csum_off`
/// follows it. With `BPF_F_PSEUDO_HDR` the kernel also takes `diff` off `skb->csum` of a
/// CHECKSUM_COMPLETE packet, which is right for IPv4 (whose header checksum changes too) but not
/// for IPv6, where the address and the L4 checksum changes cancel out in the packet's sum (kernels
/// from 6.16 fix it with `BPF_F_IPV6`; older ones refuse that flag): `diff` is given back, else
/// the stack would recompute every such packet's checksum and log "hw csum failure".
#[inline(always)]
fn pseudo_header_changed(ctx: &TcContext, csum_off: usize, diff: u64, flags: u64) -> Result<(), ()> {
    ctx.l4_csum_replace(csum_off, 0, diff, BPF_F_PSEUDO_HDR as u64 | flags)
        .map_err(|_| ())?;
    // SAFETY: the context's skb; the helper only adjusts skb->csum of CHECKSUM_COMPLETE packets.
    unsafe { bpf_csum_update(ctx.as_ptr() as *mut _, diff as u32) };
    Ok(())
}

impl Ip for V6 {
    const HLEN: usize = HLEN;
    const SADDR: usize = IP6_SADDR;
    const DADDR: usize = IP6_DADDR;
    const PROTO: usize = 6;

    #[inline(always)]
    fn may_be_sctp(next_header: u8) -> bool {
        use lb_common::proto::{TCP, UDP};
        next_header != TCP && next_header != UDP && next_header != lb_common::proto::ICMPV6
    }

    #[inline(always)]
    fn parse(ctx: &TcContext) -> Parsed<V6> {
        let Some(ip) = ptr_at::<[u8; HLEN]>(ctx, ETH_HLEN) else {
            return Parsed::Truncated;
        };
        let ip = ip as *const u8;
        // SAFETY: `ip` is bounds-checked for the whole fixed header.
        let (version, mut next) = unsafe { (*ip >> 4, *ip.add(IP6_NEXT)) };
        if version != 6 {
            return Parsed::Skip;
        }
        let Some([saddr, daddr]) = addrs_at(ctx, ETH_HLEN + IP6_SADDR) else {
            return Parsed::Truncated;
        };
        let mut off = ETH_HLEN + HLEN;
        let mut walked = 0;
        let mut fragment_id = None;
        while walked < MAX_EXT_HEADERS {
            match next {
                HOPOPTS | ROUTING | DSTOPTS | MOBILITY => {
                    let Ok(h) = ctx.load::<[u8; 2]>(off) else {
                        return Parsed::Truncated;
                    };
                    next = h[0];
                    off += (h[1] as usize + 1) * 8;
                }
                AUTH => {
                    let Ok(h) = ctx.load::<[u8; 2]>(off) else {
                        return Parsed::Truncated;
                    };
                    next = h[0];
                    off += (h[1] as usize + 2) * 4;
                }
                FRAGMENT => {
                    let Ok(h) = ctx.load::<[u8; 8]>(off) else {
                        return Parsed::Truncated;
                    };
                    next = h[0];
                    off += 8;
                    let field = u16::from_be_bytes([h[2], h[3]]);
                    if field & FRAG_OFFSET_AND_MORE != 0 {
                        // A fragment of a larger datagram; its id is the header's last 4 bytes.
                        // What follows a first fragment's header is parsed as any packet's (only
                        // TCP and UDP directly after it are followed).
                        let id = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
                        if field & FRAG_OFFSET != 0 {
                            return fragment::later(Flow::without_ports(saddr, daddr, next), id);
                        }
                        fragment_id = Some(id);
                        break;
                    }
                }
                _ => break,
            }
            walked += 1;
        }
        if fragment_id.is_none() && matches!(next, HOPOPTS | ROUTING | DSTOPTS | MOBILITY | AUTH | FRAGMENT) {
            // More extension headers than a Service's traffic carries: left alone.
            return Parsed::Skip;
        }
        let flow = Flow::without_ports(saddr, daddr, next);
        match fragment_id {
            None => parse_l4::<V6>(ctx, off, flow, proto::ICMPV6),
            Some(id) => fragment::first(parse_l4::<V6>(ctx, off, flow, proto::ICMPV6), id),
        }
    }

    /// Only the L4 checksum covers the addresses (through its pseudo-header).
    #[inline(always)]
    fn rewrite(ctx: &TcContext, pkt: &Packet<V6>, source: bool, addr: In6Addr, port: u16) -> Result<(), ()> {
        let (old_addr, old_port, port_off) = pkt.endpoint(source);
        let ip_off = ETH_HLEN + if source { Self::SADDR } else { Self::DADDR };
        let (csum_off, mangled) = pkt.l4_csum();
        if old_addr != addr {
            pseudo_header_changed(ctx, csum_off, csum_diff(&old_addr, &addr), mangled)?;
            ctx.store(ip_off, &addr, 0).map_err(|_| ())?;
        }
        if old_port != port {
            port_changed(ctx, csum_off, mangled, old_port, port)?;
            ctx.store(port_off, &port.to_be_bytes(), 0).map_err(|_| ())?;
        }
        Ok(())
    }

    /// The payload length less the extension headers.
    #[inline(always)]
    fn l4_len(ctx: &TcContext, l4: usize) -> Option<u32> {
        let payload = u16::from_be_bytes(ctx.load::<[u8; 2]>(ETH_HLEN + IP6_PAYLOAD_LEN).ok()?) as u32;
        payload.checked_sub((l4 - ETH_HLEN - HLEN) as u32)
    }

    /// No IP header checksum: the address alone, and `skb->csum` of a CHECKSUM_COMPLETE packet
    /// follows it (no L4 checksum change cancels it out here).
    #[inline(always)]
    fn rewrite_l3(ctx: &TcContext, source: bool, old_addr: In6Addr, addr: In6Addr) -> Result<(), ()> {
        let ip_off = ETH_HLEN + if source { Self::SADDR } else { Self::DADDR };
        let diff = csum_diff(&old_addr, &addr);
        ctx.store(ip_off, &addr, 0).map_err(|_| ())?;
        // SAFETY: the context's skb; the helper only adjusts skb->csum of CHECKSUM_COMPLETE packets.
        unsafe { bpf_csum_update(ctx.as_ptr() as *mut _, diff as u32) };
        Ok(())
    }

    /// RFC 4443 2.4 (e): not the unspecified address, loopback or a multicast address.
    #[inline(always)]
    fn answerable(addr: &In6Addr) -> bool {
        const LOOPBACK: In6Addr = In6Addr::new([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        addr.octets[0] != 0xff && *addr != V6::UNSPECIFIED && *addr != LOOPBACK
    }

    /// The ICMPv6 payload quotes the original IPv6 header, its extension headers (up to 16 bytes)
    /// and the first 8 bytes of L4 (RFC 4443 asks for as much as fits in the minimum MTU; what a
    /// client needs to match its socket is the header and the ports); one fixed-size copy per
    /// length, within the stack a BPF function may use. The length is rounded up to 8 bytes: an
    /// authentication header is a multiple of 4 only, and rounding down would cut its ports off.
    #[inline(always)]
    fn port_unreachable(ctx: &TcContext, l4: usize) -> i32 {
        match (l4 - ETH_HLEN - HLEN).div_ceil(8) {
            0 => reject_quoting::<48>(ctx),
            1 => reject_quoting::<56>(ctx),
            // Longer extension headers: the first 64 bytes (the client cannot match a quote cut
            // before its ports, so it sees a timeout instead of a refusal: rare enough to accept).
            _ => reject_quoting::<64>(ctx),
        }
    }

    #[inline(always)]
    fn parse_icmp_error(ctx: &TcContext, icmp: usize) -> Option<Quoted<V6>> {
        let header = ctx.load::<[u8; ICMP_HLEN]>(icmp).ok()?;
        if !matches!(
            header[0],
            ICMP6_DEST_UNREACH | ICMP6_PACKET_TOO_BIG | ICMP6_TIME_EXCEEDED | ICMP6_PARAM_PROBLEM
        ) {
            return None;
        }
        let ip_off = icmp + ICMP_HLEN;
        let inner = ctx.load::<[u8; IP6_SADDR]>(ip_off).ok()?;
        // A quote with extension headers is not translated (the ports are not where they'd be).
        if inner[0] >> 4 != 6 || !matches!(inner[IP6_NEXT], proto::TCP | proto::UDP | proto::SCTP) {
            return None;
        }
        let [saddr, daddr] = addrs_at(ctx, ip_off + IP6_SADDR)?;
        Quoted::read(ctx, icmp, ip_off, HLEN, (saddr, daddr, inner[IP6_NEXT]))
    }

    /// Only the ICMPv6 checksum covers the quote (no pseudo-header part); the quoted L4 checksum
    /// is left alone, as for IPv4.
    #[inline(always)]
    fn rewrite_quoted_addr(
        ctx: &TcContext,
        q: &Quoted<V6>,
        addr_off: usize,
        old_addr: In6Addr,
        addr: In6Addr,
    ) -> Result<(), ()> {
        ctx.l4_csum_replace(q.icmp + ICMP_CHECK, 0, csum_diff(&old_addr, &addr), 0)
            .map_err(|_| ())?;
        ctx.store(addr_off, &addr, 0).map_err(|_| ())
    }

    /// The ICMPv6 checksum covers the outer destination through its pseudo-header.
    #[inline(always)]
    fn rewrite_outer_dst(ctx: &TcContext, outer: &Flow<V6>, icmp: usize, addr: In6Addr) -> Result<(), ()> {
        if outer.daddr == addr {
            return Ok(());
        }
        pseudo_header_changed(ctx, icmp + ICMP_CHECK, csum_diff(&outer.daddr, &addr), 0)?;
        ctx.store(ETH_HLEN + IP6_DADDR, &addr, 0).map_err(|_| ())
    }

    #[inline(always)]
    fn reclaim_port_for(backend_id: u32, proto: u8, masq_route: u32) -> u16 {
        super::snat::lb_reclaim_port6(backend_id, proto as u32, masq_route) as u16
    }

    #[inline(always)]
    fn fib_addresses(params: &mut bpf_fib_lookup, saddr: &In6Addr, daddr: &In6Addr) {
        params.family = V6::AF as u8;
        params.__bindgen_anon_3.ipv6_src = saddr.words();
        params.__bindgen_anon_4.ipv6_dst = daddr.words();
    }

    #[inline(always)]
    fn copy_addr(dst: &mut In6Addr, src: &In6Addr) {
        let (to, from) = (
            dst as *mut In6Addr as *mut u32,
            src as *const In6Addr as *const u32,
        );
        // SAFETY: both point at a 4-byte-aligned 16-byte address; volatile keeps the four word
        // copies from being merged back into a `memmove`.
        unsafe {
            for i in 0..4 {
                core::ptr::write_volatile(to.add(i), core::ptr::read_volatile(from.add(i)));
            }
        }
    }

    #[inline(always)]
    fn fib_next_hop(params: &bpf_fib_lookup) -> In6Addr {
        // SAFETY: a union of plain integers; the IPv6 member is the one an AF_INET6 lookup sets.
        In6Addr::from_words(unsafe { params.__bindgen_anon_4.ipv6_dst })
    }
}

/// An ICMPv6 port unreachable quoting `Q` bytes, laid out as it goes on the wire.
#[repr(C)]
struct PortUnreachable<const Q: usize> {
    eth: [u8; ETH_HLEN],
    ip: [u8; HLEN],
    icmp: [u8; ICMP_HLEN],
    quote: [u8; Q],
}

/// Copies `len` bytes of the packet at `offset` to `dst` (a buffer of at least `len` bytes).
#[inline(always)]
fn load_into(ctx: &TcContext, offset: usize, dst: *mut u8, len: usize) -> bool {
    // SAFETY: the caller's buffer holds `len` bytes; the helper checks the packet's bounds.
    unsafe {
        bpf_skb_load_bytes(
            ctx.as_ptr() as *const _,
            offset as u32,
            dst as *mut c_void,
            len as u32,
        ) == 0
    }
}

/// Builds the ICMPv6 port unreachable in place, quoting the first `Q` bytes of the IPv6 packet.
/// Not inlined: one frame per quote length, not all of them in `reject`'s. The answer is built
/// in one buffer, read into and written out whole, as small a frame as it can be.
#[inline(never)]
fn reject_quoting<const Q: usize>(ctx: &TcContext) -> i32 {
    let mut reply = PortUnreachable::<Q> {
        eth: [0; ETH_HLEN],
        ip: [0; HLEN],
        icmp: [ICMP6_DEST_UNREACH, ICMP6_PORT_UNREACH, 0, 0, 0, 0, 0, 0],
        quote: [0; Q],
    };
    if !load_into(ctx, ETH_HLEN, reply.quote.as_mut_ptr(), Q)
        || !load_into(ctx, 0, reply.eth.as_mut_ptr(), 12)
    {
        return TC_ACT_SHOT;
    }
    // Back to where the frame came from: the MAC addresses swapped.
    let mut i = 0;
    while i < 6 {
        reply.eth.swap(i, i + 6);
        i += 1;
    }
    reply.eth[12] = (V6::ETH_P >> 8) as u8;
    reply.eth[13] = V6::ETH_P as u8;
    let icmp_len = ICMP_HLEN + Q;
    reply.ip[0] = 0x60;
    reply.ip[4] = (icmp_len >> 8) as u8;
    reply.ip[5] = icmp_len as u8;
    reply.ip[IP6_NEXT] = proto::ICMPV6;
    reply.ip[7] = HOP_LIMIT;
    // From the address the client called, to the client.
    let mut i = 0;
    while i < 16 {
        reply.ip[IP6_SADDR + i] = reply.quote[IP6_DADDR + i];
        reply.ip[IP6_DADDR + i] = reply.quote[IP6_SADDR + i];
        i += 1;
    }
    // The pseudo-header (RFC 8200 8.1): source, destination, upper-layer length, next header.
    let pseudo = csum_add_range(0, &reply.ip, IP6_SADDR, 32) + icmp_len as u32 + proto::ICMPV6 as u32;
    let icmp_csum = csum_fold(csum_add_bytes(csum_add_bytes(pseudo, &reply.icmp), &reply.quote));
    reply.icmp[ICMP_CHECK] = (icmp_csum >> 8) as u8;
    reply.icmp[ICMP_CHECK + 1] = icmp_csum as u8;
    if ctx.change_tail((ETH_HLEN + HLEN + icmp_len) as u32, 0).is_err() || ctx.store(0, &reply, 0).is_err() {
        count(Counter::TcRewriteFailed);
        return TC_ACT_SHOT;
    }
    let ifindex = unsafe { (*skb(ctx)).ifindex };
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}
