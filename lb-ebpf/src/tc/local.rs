//! The node's own SCTP to a frontend (host-network pods, node daemons): no socket hook runs for an
//! SCTP `connect()`, `sctp_connectx()` or `sendmsg()`, so such a packet reaches tc egress still
//! addressed to the frontend, past routing. `lb_tc_sctp_out` (a tail call from `lb_tc_egress`)
//! gives it the steps ingress gives a pod's packet (tracked flow, else new flow), with a socket
//! call's lookups (`internal`: an external frontend's cluster-wide scope, as kube-proxy's
//! `--src-type LOCAL` rules) and without masquerade (its source is a node address already), then
//! routes it again, to its backend (`bpf_fib_lookup`, `bpf_redirect_neigh`). The flow's un-DNAT
//! entry is marked `LOCAL_CLIENT`: its replies are delivered to the local socket and never cross
//! an egress, so `lb_tc_sctp_in` gives them their frontend back as the source at ingress
//! ([`reply`]).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, bpf_fib_lookup},
    helpers::bpf_redirect_neigh,
    programs::TcContext,
};
use lb_common::{
    conntrack::{dir, flags as ct},
    proto,
    stats::Counter,
};

use super::{
    Steps,
    conntrack::{self, note_reply},
    ip::Ip,
    nat::apply,
    new_flow,
    parse::{ETH_HLEN, Flow, Packet},
    snat::{ROUTED, route_lookup},
};
use crate::{monitor, stats::count};

/// What [`reply`] returns for a packet that is no reply to the node's own association.
pub(super) const NOT_LOCAL: i32 = i32::MIN + 5;

/// The node's own SCTP packet to a frontend, at egress: DNAT (a tracked flow's, else a new
/// flow's), then out towards the backend. A frontend without endpoints (or a cluster IP's port no
/// Service has) drops the packet, counted as REJECT's are (`tc_rejected`,
/// `tc_cluster_ip_bad_port`): SCTP takes an ICMP port unreachable only as a soft error
/// (`sctp_v4_err` reports it only to sockets with `IP_RECVERR`), so kube-proxy's REJECT and a
/// drop look the same to the association, which retransmits its INIT until it gives up.
#[inline(always)]
pub(super) fn forward<F: Steps>(ctx: &mut TcContext, pkt: &Packet<F>) -> i32 {
    let mut verdict = F::l4_ingress::<true>(ctx, pkt);
    if verdict == conntrack::ESTABLISH {
        verdict = conntrack::establish::<F, true>(ctx, pkt);
    }
    if verdict == conntrack::NEW_FLOW {
        verdict = new_flow::new_flow::<F, true, true>(ctx, pkt);
    }
    match verdict {
        TC_ACT_OK => match route::<F>(ctx, &pkt.flow) {
            UNROUTED => {
                count(Counter::TcLocalSctpUnrouted);
                if monitor::wanted(Counter::TcLocalSctpUnrouted as u32) {
                    new_flow::event::<F, true>(
                        ctx,
                        Some(&pkt.flow),
                        None,
                        Counter::TcLocalSctpUnrouted as u32,
                    );
                }
                TC_ACT_SHOT
            }
            verdict => verdict,
        },
        verdict => verdict,
    }
}

/// What [`route`] returns when the packet cannot be sent to its backend (counted and reported
/// by the caller, whose frame is shallower than `route`'s).
const UNROUTED: i32 = i32::MIN + 6;

/// Sends a translated packet (its forward entry names the backend, and the packet now goes to
/// it) out of the interface the route to the backend leaves by, to its next hop; an untranslated
/// one goes on as it was. The lookup is the forwarding one, from the interface the packet is on
/// (an output lookup would keep it to that interface); the kernel does the output route and the
/// neighbour itself in `bpf_redirect_neigh`.
#[inline(never)]
fn route<F: Ip>(ctx: &TcContext, flow: &Flow<F>) -> i32 {
    let Some(entry) = conntrack::lookup::<F>(&flow.key(dir::INGRESS)) else {
        return TC_ACT_OK;
    };
    // SAFETY: a map value just looked up.
    let backend = unsafe { (*entry).nat_addr };
    if ctx.load::<F::Addr>(ETH_HLEN + F::DADDR).ok() != Some(backend) {
        return TC_ACT_OK;
    }
    // SAFETY: an all-zero `bpf_fib_lookup` is a valid one (integers and unions of integers).
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    let rc = route_lookup::<F>(ctx, &mut params, &flow.saddr, &backend, proto::SCTP);
    // Not forwarded: no route, or the backend is at one of the node's own addresses (reached
    // through loopback, where no program runs to give its replies the frontend back).
    if !ROUTED.contains(&rc) {
        return UNROUTED;
    }
    // SAFETY: no parameters (the kernel resolves the next hop of the packet's new destination).
    unsafe { bpf_redirect_neigh(params.ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}

/// An SCTP packet at ingress that may come from a backend: a reply to the node's own association
/// (its un-DNAT entry says `LOCAL_CLIENT`) gets the frontend back as its source here, before it is
/// delivered to the socket; [`NOT_LOCAL`] for any other packet. Not inlined: its key and entry
/// take a frame of their own, beside the tracked and new-flow steps'.
#[inline(never)]
pub(super) fn reply<F: Ip>(ctx: &TcContext, pkt: &Packet<F>) -> i32 {
    let Some(ptr) = conntrack::lookup::<F>(&pkt.flow.key(dir::EGRESS)) else {
        return NOT_LOCAL;
    };
    // SAFETY: a map value just looked up.
    let entry = unsafe { *ptr };
    if entry.flags & ct::LOCAL_CLIENT == 0 {
        return NOT_LOCAL;
    }
    note_reply::<F, true>(ptr, pkt);
    apply::<F, true>(ctx, pkt, true, entry.nat_addr, entry.nat_port)
}
