//! kube-proxy's REJECT: a packet to a Service without endpoints turned into the family's ICMP
//! port unreachable for its client (`Ip::port_unreachable` builds it). Like the kernel's
//! `icmp_send` behind iptables' REJECT, it never answers a source an ICMP error may not go to, and
//! answers at a bounded rate; either way the packet itself is dropped.

use aya_ebpf::{bindings::TC_ACT_SHOT, programs::TcContext};
use lb_common::stats::Counter;

use super::{conntrack::now_ns, ip::Ip};
use crate::{maps::REJECT_LIMIT, stats::count};

/// What the new-flow path returns for a packet to reject: the programs call [`reject`] with it,
/// beside (not below) the new-flow path, so that the stack frames of the two never add up.
pub(super) const REJECT: i32 = i32::MIN;

/// Not inlined: rare, and with a frame of its own for its buffers. `l4` (the offset of the L4
/// header, which sizes the quote) comes in a register rather than through the caller's stack:
/// read from the caller's `Packet`, Linux 6.1 quoted 48 bytes of every IPv6 packet, extension
/// headers or not (what a verifier does when it prunes on a caller's stack slot it did not mark
/// precise: the other branches look dead and are hard-wired away). In a register it is right on
/// every kernel of the matrix (`tc_fixtures`, docs/kernels.md).
#[inline(never)]
pub(super) fn reject<F: Ip>(ctx: &TcContext, l4: usize, saddr: &F::Addr) -> i32 {
    let Ok(dst_mac) = ctx.load::<[u8; 1]>(0) else {
        return TC_ACT_SHOT;
    };
    // A link-layer broadcast or multicast frame (group bit of the destination MAC).
    if dst_mac[0] & 1 != 0 || !F::answerable(saddr) {
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
    F::port_unreachable(ctx, l4)
}

/// The Ethernet header of an answer to the frame whose addresses are `macs` (destination then
/// source): the addresses swapped, the family's type.
#[inline(always)]
pub(super) fn reply_ethernet(macs: &[u8; 12], ether_type: u16) -> [u8; 14] {
    [
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
        (ether_type >> 8) as u8,
        ether_type as u8,
    ]
}
