//! kube-proxy's REJECT: a packet to a Service without endpoints turned into an ICMP port
//! unreachable for its client.

use aya_ebpf::{bindings::TC_ACT_SHOT, helpers::bpf_redirect, programs::TcContext};
use lb_common::{proto, stats::Counter};

use super::{
    conntrack::now_ns,
    ipv4::{
        self, ETH_P_IP, ICMP_CHECK, ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, IP_CHECK, IP_DADDR, IP_SADDR,
        answerable, csum_add_bytes, csum_fold,
    },
    parse::{ETH_HLEN, Packet, skb},
};
use crate::{maps::REJECT_LIMIT, stats::count};

/// kube-proxy's REJECT: turn the packet into an ICMP port unreachable for the client and send it
/// back out of the interface it came in on. Like the kernel's `icmp_send` behind iptables' REJECT,
/// it never answers a source an ICMP error may not go to, and answers at a bounded rate; either
/// way the packet itself is dropped.
#[inline(always)]
pub(super) fn reject(ctx: &TcContext, pkt: &Packet) -> i32 {
    let Ok(head) = ctx.load::<[u8; ETH_HLEN + ipv4::HLEN]>(0) else {
        return TC_ACT_SHOT;
    };
    const SADDR_AT: usize = ETH_HLEN + IP_SADDR;
    let source = [
        head[SADDR_AT],
        head[SADDR_AT + 1],
        head[SADDR_AT + 2],
        head[SADDR_AT + 3],
    ];
    // A link-layer broadcast or multicast frame (group bit of the destination MAC).
    if head[0] & 1 != 0 || !answerable(source) {
        count(Counter::TcRejectUnanswerable);
        return TC_ACT_SHOT;
    }
    let allowed = REJECT_LIMIT
        .get_ptr_mut(0)
        .is_some_and(|bucket| unsafe { (*bucket).take(now_ns()) });
    if !allowed {
        count(Counter::TcRejectRateLimited);
        return TC_ACT_SHOT;
    }
    // The ICMP payload quotes the whole original IP header (options included) and the first 8
    // bytes of L4; one fixed-size copy per header length keeps the verifier happy.
    match (pkt.l4 - ETH_HLEN) / 4 {
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

/// Builds the port unreachable in place, quoting the first `Q` bytes of the IP packet.
#[inline(always)]
fn reject_quoting<const Q: usize>(ctx: &TcContext) -> i32 {
    // Fixed-size loads (a variable length could be zero, which the verifier refuses).
    let (Ok(quote), Ok(macs)) = (ctx.load::<[u8; Q]>(ETH_HLEN), ctx.load::<[u8; 12]>(0)) else {
        return TC_ACT_SHOT;
    };
    let icmp_len = ipv4::ICMP_HLEN + Q;
    let total_len = ETH_HLEN + ipv4::HLEN + icmp_len;
    if ctx.change_tail(total_len as u32, 0).is_err() {
        count(Counter::TcRewriteFailed);
        return TC_ACT_SHOT;
    }
    let eth = [
        macs[6],
        macs[7],
        macs[8],
        macs[9],
        macs[10],
        macs[11],
        macs[0],
        macs[1],
        macs[2],
        macs[3],
        macs[4],
        macs[5],
        (ETH_P_IP >> 8) as u8,
        ETH_P_IP as u8,
    ];
    let total = (ipv4::HLEN + icmp_len) as u16;
    let mut ip = [
        ipv4::VIHL_NO_OPTIONS,
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
        && ctx.store(ETH_HLEN + ipv4::HLEN, &icmp, 0).is_ok()
        && ctx
            .store(ETH_HLEN + ipv4::HLEN + ipv4::ICMP_HLEN, &quote, 0)
            .is_ok();
    if !stored {
        count(Counter::TcRewriteFailed);
        return TC_ACT_SHOT;
    }
    let ifindex = unsafe { (*skb(ctx)).ifindex };
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}
