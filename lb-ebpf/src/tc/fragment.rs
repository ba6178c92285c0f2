//! IP fragments (`lb_common::fragment`): the first fragment of a TCP or UDP datagram carries its
//! ports and is translated as any packet; it notes the ports in `lb4_frags` under what every
//! fragment of the datagram repeats (addresses, protocol, IP id). A later fragment reads them
//! back and is rewritten as its flow's conntrack entries rewrote the first, at L3 only: it has
//! no L4 header, and the first fragment's L4 checksum, which covers the whole datagram, already
//! took every change. Each program notes what it sees, so egress finds a datagram under its
//! translated addresses.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use lb_common::{
    conntrack::{dir, flags as ct},
    fragment::{FragKey, FragPorts},
    proto,
    stats::Counter,
};

use super::{
    conntrack::{self, MARK_ID, MARK_MAGIC},
    ip::Ip,
    parse::{Flow, Parsed},
};
use crate::stats::count;

/// A fragment of a datagram: the first one (its L4 header parsed into `parsed`), noted.
#[inline(always)]
pub(super) fn first<F: Ip>(parsed: Parsed<F>, id: u32) -> Parsed<F> {
    match parsed {
        Parsed::L4(pkt) if pkt.flow.proto == proto::TCP || pkt.flow.proto == proto::UDP => {
            let ports = FragPorts {
                sport: pkt.flow.sport,
                dport: pkt.flow.dport,
            };
            // A full table evicts the oldest datagram's entry (LRU): at worst its later fragments
            // pass untranslated, counted.
            let _ = F::fragments().insert(&key_of(&pkt.flow, id), &ports, 0);
            Parsed::L4(pkt)
        }
        Parsed::Truncated => Parsed::Truncated,
        // SCTP, ICMP, other protocols: no ports to follow.
        _ => Parsed::Fragment,
    }
}

/// A later fragment of a datagram (`flow` without ports): [`Parsed::Later`] with the first
/// fragment's ports, or [`Parsed::Fragment`] when it was not seen.
#[inline(always)]
pub(super) fn later<F: Ip>(mut flow: Flow<F>, id: u32) -> Parsed<F> {
    if flow.proto != proto::TCP && flow.proto != proto::UDP {
        return Parsed::Fragment;
    }
    let Some(ports) = F::fragments().get_ptr(&key_of(&flow, id)) else {
        return Parsed::Fragment;
    };
    // SAFETY: a map value just looked up.
    unsafe {
        flow.sport = (*ports).sport;
        flow.dport = (*ports).dport;
    }
    count(Counter::TcFragmentFollowed);
    Parsed::Later(flow)
}

/// What [`ingress`] returns for a later fragment without an entry: `ingress_of` lets it pass
/// (`TC_ACT_OK`), counts it and reports it to a listening monitor (from its frame, not this
/// function's).
pub(super) const UNFOLLOWED: i32 = i32::MIN + 5;

/// A later fragment at ingress: its destination rewritten as its flow's entry (forward DNAT or
/// un-SNAT, in either table) rewrote the first fragment's, the un-SNAT mark included. Without
/// an entry it passes, counted: a later fragment never starts a flow, nor establishes one.
///
/// Its own BPF function, beside the packets' path rather than through it: a later fragment
/// taken through `l4_ingress` and `new_flow` made the verifier walk that whole path again for
/// it (the tc ingress program's verification grew by half, to 874k steps of the 1M limit).
#[inline(never)]
pub(super) fn ingress<F: Ip>(ctx: &mut TcContext, flow: &Flow<F>) -> i32 {
    let Some(entry) = conntrack::lookup::<F>(&flow.key(dir::INGRESS)) else {
        return UNFOLLOWED;
    };
    // SAFETY: a map value just looked up.
    let (nat_addr, flags, rev_nat_id) = unsafe { ((*entry).nat_addr, (*entry).flags, (*entry).rev_nat_id) };
    if flags & ct::REPLY != 0 {
        ctx.set_mark(MARK_MAGIC | (rev_nat_id & MARK_ID));
    } else {
        conntrack::mark_forward(ctx, flags, rev_nat_id);
    }
    readdress::<F>(ctx, false, flow.daddr, nat_addr)
}

/// A later fragment at egress: a reply ingress un-SNATed (the mark) gets its frontend back as
/// its source; a fragment of a flow with an egress entry (SNAT, un-DNAT) is rewritten as its
/// first fragment was.
#[inline(never)]
pub(super) fn egress<F: Ip>(ctx: &mut TcContext, flow: &Flow<F>, mark: u32, ours: bool) -> i32 {
    if ours {
        match conntrack::marked_reply::<F>(
            mark,
            (flow.daddr, flow.dport),
            (flow.saddr, flow.sport),
            flow.proto,
        ) {
            Some(frontend) => {
                ctx.set_mark(0);
                return readdress::<F>(ctx, true, flow.saddr, frontend.addr);
            }
            None => count(Counter::TcForeignMark),
        }
    }
    let mut key = flow.key(dir::EGRESS);
    if let Some(entry) = conntrack::tagged_snat::<F>(mark, &mut key) {
        ctx.set_mark(0);
        // SAFETY: a map value just looked up.
        return readdress::<F>(ctx, true, flow.saddr, unsafe { (*entry).nat_addr });
    }
    match conntrack::lookup::<F>(&key) {
        // SAFETY: a map value just looked up.
        Some(entry) => readdress::<F>(ctx, true, flow.saddr, unsafe { (*entry).nat_addr }),
        None => TC_ACT_OK,
    }
}

/// The source (or destination) address rewritten from `old` to `new`, as a verdict.
#[inline(always)]
fn readdress<F: Ip>(ctx: &TcContext, source: bool, old: F::Addr, new: F::Addr) -> i32 {
    if old == new {
        return TC_ACT_OK;
    }
    match F::rewrite_l3(ctx, source, old, new) {
        Ok(()) => TC_ACT_OK,
        Err(()) => {
            count(Counter::TcRewriteFailed);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn key_of<F: Ip>(flow: &Flow<F>, id: u32) -> FragKey<F> {
    FragKey {
        saddr: flow.saddr,
        daddr: flow.daddr,
        id,
        proto: flow.proto,
        _pad: [0; 3],
    }
}
