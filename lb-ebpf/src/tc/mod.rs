//! Per-packet load balancing at tc, for traffic the socket programs never see: clients outside the
//! node (NodePort, LoadBalancer IPs, externalIPs, ClusterIPs routed to the node) and pods whose
//! sockets are not translated.
//!
//! Where it happens (see `lb_common::conntrack` for the table):
//! - ingress, before routing: DNAT of new and established flows to a frontend; un-SNAT of replies
//!   to masqueraded flows (their destination is this node), which also marks the packet so the
//!   egress side restores the frontend as the source;
//! - egress, after routing: SNAT of masqueraded flows to the node IP (after routing, so the kernel
//!   never sees a forwarded packet with a local source address, which it drops as martian); and
//!   reverse DNAT of replies on the client-facing side.
//!
//! The kernel routes in between: backends on other nodes are reached through the node's own
//! routing, neighbour tables and netfilter, so any CNI or overlay works unchanged.
//!
//! kube-proxy's decisions are carried by the frontend entry (`MASQUERADE`,
//! `MASQUERADE_OFF_CLUSTER`, `TWO_SCOPES`, `DROP_IF_EMPTY`, `SOURCE_RANGES`); hairpin (the chosen
//! backend is the client) is masqueraded too. A Service without endpoints is rejected with an
//! ICMP port unreachable (kube-proxy's REJECT); a Local policy without local endpoints and a source
//! outside loadBalancerSourceRanges are dropped.
//!
//! Anything that cannot be translated safely passes untouched and is counted: truncated packets,
//! fragments, SCTP (its CRC32c checksum cannot be updated incrementally), other protocols.
//!
//! One job per file; this one holds the two programs' dispatch only:
//! - `parse`: the packet (`Flow`, `Packet`, `parse`) and bounds-checked access to it;
//! - `ipv4`: the IPv4 and ICMPv4 facts (header layout and offsets, the header checksum sums, ICMP
//!   types, which sources may get an ICMP error);
//! - `conntrack`: packets of tracked flows at ingress and egress, close and liveness notes, the
//!   un-SNAT mark;
//! - `new_flow`: a new flow, from the frontend lookup to its conntrack entries;
//! - `snat`: masquerade port reservation;
//! - `nat`: address and port rewriting with checksum updates;
//! - `reject`: kube-proxy's REJECT (an ICMP port unreachable);
//! - `icmp_error`: ICMP errors about translated flows, at ingress and egress.
//!
//! Everything is `#[inline(always)]` into the two programs, whose code the verifiers of older
//! kernels are sensitive to. Moving code between these files is not free even so: a function's
//! symbol names its module, rustc orders the LLVM module's functions by symbol, and that order can
//! change stack slots and block layout. Compare the object's program sections before and after.

mod conntrack;
mod icmp_error;
mod ipv4;
mod nat;
mod new_flow;
mod parse;
mod reject;
mod snat;

use aya_ebpf::{bindings::TC_ACT_OK, programs::TcContext};
use lb_common::{proto, stats::Counter};

pub use self::conntrack::{MARK_ID, MARK_MAGIC, MARK_MASK};
use self::parse::{Parsed, parse, skb};
use crate::{
    lb::{self, Frontend},
    stats::count,
};

/// The tc ingress program.
#[inline(always)]
pub fn ingress(ctx: &mut TcContext) -> i32 {
    match parse(ctx) {
        Parsed::Skip => TC_ACT_OK,
        Parsed::Truncated => {
            count(Counter::TcTruncated);
            TC_ACT_OK
        }
        Parsed::Fragment => {
            count(Counter::TcFragment);
            TC_ACT_OK
        }
        Parsed::Icmp(l4, outer) => icmp_error::icmp_error_ingress(ctx, l4, &outer),
        Parsed::L4(pkt) if pkt.flow.proto == proto::SCTP => {
            if !matches!(
                lb::lookup_frontend(pkt.flow.daddr, pkt.flow.dport, proto::SCTP, false),
                Frontend::None
            ) {
                count(Counter::TcUnsupportedProtocol);
            }
            TC_ACT_OK
        }
        Parsed::L4(pkt) => conntrack::l4_ingress(ctx, &pkt),
    }
}

/// The tc egress program.
#[inline(always)]
pub fn egress(ctx: &mut TcContext) -> i32 {
    let mark = unsafe { (*skb(ctx)).mark };
    let ours = mark & MARK_MASK == MARK_MAGIC;
    match parse(ctx) {
        Parsed::L4(pkt) if pkt.flow.proto != proto::SCTP => {
            conntrack::established_egress(ctx, &pkt, mark, ours)
        }
        Parsed::Icmp(icmp, _) => icmp_error::icmp_error_egress(ctx, icmp, mark, ours),
        _ => TC_ACT_OK,
    }
}
