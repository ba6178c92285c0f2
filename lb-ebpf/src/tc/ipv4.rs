//! IPv4 and ICMPv4 on the tc path ([`Ip`] for `V4`): the header layout and offsets, options,
//! fragments (first or later, `super::fragment`), the header checksum (which IPv6 does not
//! have), ICMPv4's port unreachable and error types, and which sources may get an ICMP error.

use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, TC_ACT_SHOT, bpf_fib_lookup},
    helpers::bpf_redirect,
    programs::TcContext,
};
use lb_common::{
    family::{Family, V4},
    proto,
    stats::Counter,
};
use network_types::ip::Ipv4Hdr;

use super::{
    fragment,
    icmp_error::Quoted,
    ip::{Ip, csum_add_bytes, csum_fold},
    parse::{
        ETH_HLEN, Flow, ICMP_CHECK, ICMP_HLEN, L4_DPORT, L4_SPORT, Packet, Parsed, parse_l4, port_changed,
        ptr_at, skb,
    },
};
use crate::stats::count;

/// The IP version in the upper nibble of the first header byte.
const VERSION: u8 = 4;
/// The first header byte of an IPv4 header without options: version 4, 5 words.
const VIHL_NO_OPTIONS: u8 = 0x45;
/// Length of the IPv4 header without options.
const HLEN: usize = Ipv4Hdr::LEN;
/// More-fragments flag and fragment offset, in the header's flags/offset field.
const FRAG_MASK: u16 = 0x3fff;
/// The fragment offset alone.
const FRAG_OFFSET: u16 = 0x1fff;
/// Offsets inside the IPv4 header.
const IP_TOT_LEN: usize = 2;
const IP_CHECK: usize = 10;
const IP_SADDR: usize = 12;
const IP_DADDR: usize = 16;

/// ICMPv4 types and codes.
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;

/// The header length in bytes, from the header's first byte (version and IHL).
#[inline(always)]
fn header_len(vihl: u8) -> usize {
    ((vihl & 0x0f) as usize) << 2
}

impl Ip for V4 {
    const HLEN: usize = HLEN;
    const SADDR: usize = IP_SADDR;
    const DADDR: usize = IP_DADDR;
    const PROTO: usize = 9;

    #[inline(always)]
    fn may_be_sctp(proto: u8) -> bool {
        proto == lb_common::proto::SCTP
    }

    #[inline(always)]
    fn parse(ctx: &TcContext) -> Parsed<V4> {
        let Some(ip) = ptr_at::<Ipv4Hdr>(ctx, ETH_HLEN) else {
            return Parsed::Truncated;
        };
        let ip = unsafe { *ip };
        if ip.vihl >> 4 != VERSION {
            return Parsed::Skip;
        }
        let ihl = header_len(ip.vihl);
        if ihl < HLEN {
            return Parsed::Truncated;
        }
        let flow = Flow::without_ports(ip.src_addr, ip.dst_addr, ip.proto);
        let frags = u16::from_be_bytes(ip.frags);
        if frags & FRAG_MASK == 0 {
            return parse_l4::<V4>(ctx, ETH_HLEN + ihl, flow, proto::ICMP);
        }
        // A fragment: more-fragments set, or a non-zero offset.
        let id = u16::from_be_bytes(ip.id) as u32;
        if frags & FRAG_OFFSET == 0 {
            fragment::first(parse_l4::<V4>(ctx, ETH_HLEN + ihl, flow, proto::ICMP), id)
        } else {
            fragment::later(flow, id)
        }
    }

    #[inline(always)]
    fn rewrite(ctx: &TcContext, pkt: &Packet<V4>, source: bool, addr: [u8; 4], port: u16) -> Result<(), ()> {
        let (old_addr, old_port, port_off) = pkt.endpoint(source);
        let ip_off = ETH_HLEN + if source { Self::SADDR } else { Self::DADDR };
        let (csum_off, mangled) = pkt.l4_csum();
        let (from, to) = (
            u32::from_ne_bytes(old_addr) as u64,
            u32::from_ne_bytes(addr) as u64,
        );
        // The L4 checksum always goes through the helper: only the kernel knows how it holds it
        // (the full sum, or the pseudo-header sum of an offloaded packet) and keeps skb->csum
        // right.
        if old_addr != addr {
            ctx.l4_csum_replace(csum_off, from, to, BPF_F_PSEUDO_HDR as u64 | mangled | 4)
                .map_err(|_| ())?;
        }
        if old_port != port {
            port_changed(ctx, csum_off, mangled, old_port, port)?;
        }
        if pkt.l4 == ETH_HLEN + HLEN {
            // No IP options (the common case): the address, the IP header checksum (plain
            // software, never offloaded) and the port are written in place, which saves three
            // helper calls a packet. Taken after the helpers, which invalidate packet pointers.
            //
            // One pointer to the headers and offsets that are constants here (`source` is a
            // constant at every call site), never derived from `pkt.l4`: given an offset computed
            // from the IP header length, LLVM may rebuild the pointer from that variable, which
            // verifiers before 6.8 cannot bound ("R1 offset is outside of the packet" on 6.1).
            const L4_AT: usize = ETH_HLEN + HLEN;
            let port_at = if source {
                L4_AT + L4_SPORT
            } else {
                L4_AT + L4_DPORT
            };
            let Some(headers) = ptr_at::<[u8; L4_AT + 4]>(ctx, 0) else {
                return Err(());
            };
            let headers = headers as *mut u8;
            // SAFETY: every offset below is a constant inside the bounds-checked `headers`.
            unsafe {
                if old_addr != addr {
                    let check_at = headers.add(ETH_HLEN + IP_CHECK) as *mut [u8; 2];
                    let check = u16::from_be_bytes(*check_at);
                    // RFC 1624: HC' = ~(~HC + ~m + m').
                    let sum = csum_add_bytes(!check as u32, &addr) + csum_add_bytes(0, &old_addr.map(|b| !b));
                    *check_at = csum_fold(sum).to_be_bytes();
                    *(headers.add(ip_off) as *mut [u8; 4]) = addr;
                }
                if old_port != port {
                    *(headers.add(port_at) as *mut [u8; 2]) = port.to_be_bytes();
                }
            }
            return Ok(());
        }
        if old_addr != addr {
            ctx.l3_csum_replace(ETH_HLEN + IP_CHECK, from, to, 4)
                .map_err(|_| ())?;
            ctx.store(ip_off, &addr, 0).map_err(|_| ())?;
        }
        if old_port != port {
            ctx.store(port_off, &port.to_be_bytes(), 0).map_err(|_| ())?;
        }
        Ok(())
    }

    /// The total length less the header (options included).
    #[inline(always)]
    fn l4_len(ctx: &TcContext, l4: usize) -> Option<u32> {
        let total = u16::from_be_bytes(ctx.load::<[u8; 2]>(ETH_HLEN + IP_TOT_LEN).ok()?) as u32;
        total.checked_sub((l4 - ETH_HLEN) as u32)
    }

    /// Through the helpers, which take any length: a datagram's last fragment may carry one
    /// byte past its IP header.
    #[inline(always)]
    fn rewrite_l3(ctx: &TcContext, source: bool, old_addr: [u8; 4], addr: [u8; 4]) -> Result<(), ()> {
        let ip_off = ETH_HLEN + if source { Self::SADDR } else { Self::DADDR };
        let (from, to) = (
            u32::from_ne_bytes(old_addr) as u64,
            u32::from_ne_bytes(addr) as u64,
        );
        ctx.l3_csum_replace(ETH_HLEN + IP_CHECK, from, to, 4)
            .map_err(|_| ())?;
        ctx.store(ip_off, &addr, 0).map_err(|_| ())
    }

    /// RFC 1122 3.2.2: not unspecified (0/8), loopback (127/8), multicast (224/4) or
    /// reserved/broadcast (240/4).
    #[inline(always)]
    fn answerable(addr: &[u8; 4]) -> bool {
        !matches!(addr[0], 0 | 127 | 224..=255)
    }

    /// The ICMP payload quotes the whole original IP header (options included) and the first 8
    /// bytes of L4; one fixed-size copy per header length keeps the verifier happy.
    #[inline(always)]
    fn port_unreachable(ctx: &TcContext, l4: usize) -> i32 {
        match (l4 - ETH_HLEN) / 4 {
            5 => reject_quoting::<28>(ctx),
            6 => reject_quoting::<32>(ctx),
            7 => reject_quoting::<36>(ctx),
            8 => reject_quoting::<40>(ctx),
            9 => reject_quoting::<44>(ctx),
            10 => reject_quoting::<48>(ctx),
            11 => reject_quoting::<52>(ctx),
            12 => reject_quoting::<56>(ctx),
            13 => reject_quoting::<60>(ctx),
            14 => reject_quoting::<64>(ctx),
            15 => reject_quoting::<68>(ctx),
            _ => TC_ACT_SHOT,
        }
    }

    #[inline(always)]
    fn parse_icmp_error(ctx: &TcContext, icmp: usize) -> Option<Quoted<V4>> {
        // ICMP errors are rare: read them through helpers, whatever the offsets.
        let header = ctx.load::<[u8; ICMP_HLEN]>(icmp).ok()?;
        if !matches!(
            header[0],
            ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM
        ) {
            return None;
        }
        let ip_off = icmp + ICMP_HLEN;
        let inner = ctx.load::<Ipv4Hdr>(ip_off).ok()?;
        if inner.vihl != VIHL_NO_OPTIONS || !matches!(inner.proto, proto::TCP | proto::UDP | proto::SCTP) {
            return None;
        }
        Quoted::read(
            ctx,
            icmp,
            ip_off,
            HLEN,
            (inner.src_addr, inner.dst_addr, inner.proto),
        )
    }

    /// The quoted IP header has a checksum of its own: the quoted address changes it, and both
    /// changes show in the ICMP checksum.
    #[inline(always)]
    fn rewrite_quoted_addr(
        ctx: &TcContext,
        q: &Quoted<V4>,
        addr_off: usize,
        old_addr: [u8; 4],
        addr: [u8; 4],
    ) -> Result<(), ()> {
        let icmp_csum = q.icmp + ICMP_CHECK;
        let old_check = ctx.load::<[u8; 2]>(q.ip + IP_CHECK).map_err(|_| ())?;
        let old_check = u16::from_be_bytes(old_check);
        // RFC 1624: HC' = ~(~HC + ~m + m').
        let mut sum = (!old_check) as u32;
        sum += (!u16::from_be_bytes([old_addr[0], old_addr[1]])) as u32
            + (!u16::from_be_bytes([old_addr[2], old_addr[3]])) as u32;
        sum += u16::from_be_bytes([addr[0], addr[1]]) as u32 + u16::from_be_bytes([addr[2], addr[3]]) as u32;
        let new_check = csum_fold(sum);
        let (from, to) = (
            u32::from_ne_bytes(old_addr) as u64,
            u32::from_ne_bytes(addr) as u64,
        );
        ctx.l4_csum_replace(icmp_csum, from, to, 4).map_err(|_| ())?;
        ctx.l4_csum_replace(icmp_csum, old_check.to_be() as u64, new_check.to_be() as u64, 2)
            .map_err(|_| ())?;
        ctx.store(addr_off, &addr, 0).map_err(|_| ())?;
        ctx.store(q.ip + IP_CHECK, &new_check.to_be_bytes(), 0)
            .map_err(|_| ())
    }

    /// The IP checksum only: ICMP has no pseudo header.
    #[inline(always)]
    fn rewrite_outer_dst(ctx: &TcContext, outer: &Flow<V4>, _icmp: usize, addr: [u8; 4]) -> Result<(), ()> {
        if outer.daddr == addr {
            return Ok(());
        }
        let (from, to) = (
            u32::from_ne_bytes(outer.daddr) as u64,
            u32::from_ne_bytes(addr) as u64,
        );
        ctx.l3_csum_replace(ETH_HLEN + IP_CHECK, from, to, 4)
            .map_err(|_| ())?;
        ctx.store(ETH_HLEN + IP_DADDR, &addr, 0).map_err(|_| ())
    }

    #[inline(always)]
    fn reclaim_port_for(backend_id: u32, proto: u8, masq_route: u32) -> u16 {
        super::snat::lb_reclaim_port4(backend_id, proto as u32, masq_route) as u16
    }

    #[inline(always)]
    fn fib_addresses(params: &mut bpf_fib_lookup, saddr: &[u8; 4], daddr: &[u8; 4]) {
        params.family = V4::AF as u8;
        params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(*saddr);
        params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(*daddr);
    }

    #[inline(always)]
    fn copy_addr(dst: &mut [u8; 4], src: &[u8; 4]) {
        *dst = *src;
    }

    #[inline(always)]
    fn fib_next_hop(params: &bpf_fib_lookup) -> [u8; 4] {
        // SAFETY: a union of plain integers; the IPv4 member is the one an AF_INET lookup sets.
        unsafe { params.__bindgen_anon_4.ipv4_dst }.to_ne_bytes()
    }
}

/// Builds the port unreachable in place, quoting the first `Q` bytes of the IP packet.
#[inline(always)]
fn reject_quoting<const Q: usize>(ctx: &TcContext) -> i32 {
    // Fixed-size loads (a variable length could be zero, which the verifier refuses).
    let (Ok(quote), Ok(macs)) = (ctx.load::<[u8; Q]>(ETH_HLEN), ctx.load::<[u8; 12]>(0)) else {
        return TC_ACT_SHOT;
    };
    let icmp_len = ICMP_HLEN + Q;
    let total_len = ETH_HLEN + HLEN + icmp_len;
    if ctx.change_tail(total_len as u32, 0).is_err() {
        count(Counter::TcRewriteFailed);
        return TC_ACT_SHOT;
    }
    let eth = super::reject::reply_ethernet(&macs, V4::ETH_P);
    let total = (HLEN + icmp_len) as u16;
    let mut ip = [
        VIHL_NO_OPTIONS,
        0xc0,
        (total >> 8) as u8,
        total as u8,
        0,
        0,
        0,
        0,
        64,
        proto::ICMP,
        0,
        0,
        // From the address the client called, to the client.
        quote[IP_DADDR],
        quote[IP_DADDR + 1],
        quote[IP_DADDR + 2],
        quote[IP_DADDR + 3],
        quote[IP_SADDR],
        quote[IP_SADDR + 1],
        quote[IP_SADDR + 2],
        quote[IP_SADDR + 3],
    ];
    let ip_csum = csum_fold(csum_add_bytes(0, &ip));
    ip[IP_CHECK] = (ip_csum >> 8) as u8;
    ip[IP_CHECK + 1] = ip_csum as u8;
    let mut icmp = [ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, 0, 0, 0, 0, 0, 0];
    let icmp_csum = csum_fold(csum_add_bytes(csum_add_bytes(0, &icmp), &quote));
    icmp[ICMP_CHECK] = (icmp_csum >> 8) as u8;
    icmp[ICMP_CHECK + 1] = icmp_csum as u8;
    let stored = ctx.store(0, &eth, 0).is_ok()
        && ctx.store(ETH_HLEN, &ip, 0).is_ok()
        && ctx.store(ETH_HLEN + HLEN, &icmp, 0).is_ok()
        && ctx.store(ETH_HLEN + HLEN + ICMP_HLEN, &quote, 0).is_ok();
    if !stored {
        count(Counter::TcRewriteFailed);
        return TC_ACT_SHOT;
    }
    let ifindex = unsafe { (*skb(ctx)).ifindex };
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}
