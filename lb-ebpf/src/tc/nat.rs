//! NAT: rewriting the source or destination address and port of a TCP/UDP packet, with its IP and
//! L4 checksums updated incrementally.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use lb_common::{proto, stats::Counter};

use super::{
    ipv4::{self, IP_CHECK, IP_DADDR, IP_SADDR, csum_add_bytes, csum_fold},
    parse::{ETH_HLEN, L4_DPORT, L4_SPORT, Packet, ptr_at},
};
use crate::stats::count;

/// Offsets of the checksums inside TCP and UDP headers.
const TCP_CHECK: usize = 16;
const UDP_CHECK: usize = 6;

/// Rewrites the destination (`source == false`) or source address and port of a TCP/UDP packet,
/// with the IP and L4 checksums updated incrementally.
#[inline(always)]
pub(super) fn rewrite(
    ctx: &TcContext,
    pkt: &Packet,
    source: bool,
    addr: [u8; 4],
    port: u16,
) -> Result<(), ()> {
    let (old_addr, old_port, ip_off, port_off) = if source {
        (
            pkt.flow.saddr,
            pkt.flow.sport,
            ETH_HLEN + IP_SADDR,
            pkt.l4 + L4_SPORT,
        )
    } else {
        (
            pkt.flow.daddr,
            pkt.flow.dport,
            ETH_HLEN + IP_DADDR,
            pkt.l4 + L4_DPORT,
        )
    };
    let (csum_off, mangled) = if pkt.flow.proto == proto::UDP {
        // A UDP checksum of zero means "none" and must stay zero.
        (pkt.l4 + UDP_CHECK, BPF_F_MARK_MANGLED_0 as u64)
    } else {
        (pkt.l4 + TCP_CHECK, 0)
    };
    let (from, to) = (
        u32::from_ne_bytes(old_addr) as u64,
        u32::from_ne_bytes(addr) as u64,
    );
    // The L4 checksum always goes through the helper: only the kernel knows how it holds it (the
    // full sum, or the pseudo-header sum of an offloaded packet) and keeps skb->csum right.
    if old_addr != addr {
        ctx.l4_csum_replace(csum_off, from, to, BPF_F_PSEUDO_HDR as u64 | mangled | 4)
            .map_err(|_| ())?;
    }
    if old_port != port {
        ctx.l4_csum_replace(
            csum_off,
            old_port.to_be() as u64,
            port.to_be() as u64,
            mangled | 2,
        )
        .map_err(|_| ())?;
    }
    if pkt.l4 == ETH_HLEN + ipv4::HLEN {
        // No IP options (the common case): the address, the IP header checksum (plain software,
        // never offloaded) and the port are written in place, which saves three helper calls a
        // packet. Taken after the helpers, which invalidate packet pointers.
        //
        // One pointer to the headers and offsets that are constants here (`source` is a constant
        // at every call site), never derived from `pkt.l4`: given an offset computed from the
        // IP header length, LLVM may rebuild the pointer from that variable, which verifiers
        // before 6.8 cannot bound ("R1 offset is outside of the packet" on 6.1).
        const L4_AT: usize = ETH_HLEN + ipv4::HLEN;
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

/// `rewrite` as a verdict: a packet that cannot be rewritten is counted and dropped.
#[inline(always)]
pub(super) fn apply(ctx: &TcContext, pkt: &Packet, source: bool, addr: [u8; 4], port: u16) -> i32 {
    match rewrite(ctx, pkt, source, addr, port) {
        Ok(()) => TC_ACT_OK,
        Err(()) => {
            count(Counter::TcRewriteFailed);
            TC_ACT_SHOT
        }
    }
}
