//! Connection tracking on existing flows: the conntrack lookups of TCP/UDP packets at ingress (an
//! established flow, or a reply to a masqueraded one; anything else is a `new_flow`) and at egress
//! (SNAT, reverse DNAT), close and liveness notes on entries, and the un-SNAT mark.

use aya_ebpf::{
    helpers::{bpf_ktime_get_coarse_ns, bpf_ktime_get_ns},
    programs::TcContext,
};
use lb_common::{
    conntrack::{CtKey, CtValue, FORWARD_MARK, dir, flags as ct, snat_tag},
    family::Family,
    proto,
    revnat::RevNatValue,
    stats::Counter,
};

use super::{
    ct_filter,
    ip::Ip,
    nat::apply,
    parse::{Flow, Packet},
};
use crate::{family::insert_used, features, lb, stats::count};

/// skb->mark set by ingress on an un-SNATed reply so that egress restores the frontend as its
/// source: `MARK_MAGIC | rev_nat_id`. Cleared by egress.
pub const MARK_MAGIC: u32 = 0x5EA0_0000;
pub const MARK_MASK: u32 = 0xFFF0_0000;
pub const MARK_ID: u32 = 0x000F_FFFF;
// Both families' reverse-NAT ids fit the mark (the agent caps each family's count).
const _: () = assert!(2 * lb_common::catalog::MAX_REVNAT_PER_FAMILY <= MARK_ID);

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
/// How often a UDP reply refreshes its entry's `last_seen_ns` (the GC's idle clock).
const UDP_REPLY_REFRESH_NS: u64 = 1_000_000_000;
/// A SYN on a tracked TCP tuple older than this starts a new connection (a port reused after
/// close); a younger one is a retransmission and keeps its backend. Also the age after which a
/// flow whose handshake has not completed may lose its masquerade port (`snat::reclaim_port`).
pub(super) const SYN_REUSE_NS: u64 = 1_000_000_000;

#[inline(always)]
pub(super) fn now_ns() -> u64 {
    // Both read CLOCK_MONOTONIC; the coarse one is cheaper and precise enough for timeouts.
    if features::ktime_coarse() {
        unsafe { bpf_ktime_get_coarse_ns() }
    } else {
        unsafe { bpf_ktime_get_ns() }
    }
}

/// What `l4_ingress` returns for a packet no conntrack entry keeps: the programs call
/// `new_flow` with it, beside (not below) this path, so that the stack frames of the two never
/// add up.
pub(super) const NEW_FLOW: i32 = i32::MIN + 1;

/// What `l4_ingress` returns for the packet that establishes a new flow: the programs call
/// [`establish`] with it, beside this path as with `new_flow`.
pub(super) const ESTABLISH: i32 = i32::MIN + 4;

/// A flow's entry at `key`, from either table: the established flows' first (the packets of
/// almost every lookup that hits), then the new flows'.
#[inline(always)]
pub(super) fn lookup<F: Ip>(key: &CtKey<F>) -> Option<*mut CtValue<F>> {
    F::conntrack()
        .get_ptr_mut(key)
        .or_else(|| F::conntrack_new().get_ptr_mut(key))
}

/// A TCP or UDP packet at ingress: a tracked flow's, else [`NEW_FLOW`]; [`ESTABLISH`] for the
/// client's packet that moves a new flow to the established table. A step of [`super::Steps`]:
/// for IPv6 a frame of its own, so that the program's frame holds little more than the parsed
/// packet and each path beside this one has nearly the whole stack to itself.
#[inline(always)]
pub(super) fn l4_ingress<F: Ip, const SCTP: bool>(ctx: &mut TcContext, pkt: &Packet<F>) -> i32 {
    let key = pkt.flow.key(dir::INGRESS);
    let (ptr, established) = match F::conntrack().get_ptr_mut(&key) {
        Some(ptr) => (ptr, true),
        None => match F::conntrack_new().get_ptr_mut(&key) {
            Some(ptr) => (ptr, false),
            None => return NEW_FLOW,
        },
    };
    let entry = unsafe { *ptr };
    if entry.flags & ct::REPLY != 0 {
        // A reply to a masqueraded flow: back to the client, and egress restores the frontend.
        note_reply::<F, SCTP>(ptr, pkt);
        ctx.set_mark(MARK_MAGIC | (entry.rev_nat_id & MARK_ID));
        return apply::<F, SCTP>(ctx, pkt, false, entry.nat_addr, entry.nat_port);
    }
    // (`SCTP`, a constant of the program: its packets are all SCTP, which the verifier cannot
    // tell from the parsed packet; `nat::apply`.)
    let tcp = !SCTP && pkt.flow.proto == proto::TCP;
    let keep = if tcp {
        // A fresh SYN on an old tuple is a new connection; everything else keeps its backend.
        pkt.tcp_flags & (TCP_SYN | TCP_ACK) != TCP_SYN
            || now_ns().saturating_sub(entry.created_ns) < SYN_REUSE_NS
    } else {
        // UDP has no connection end: a flow whose backend is gone moves to a live one (the
        // stale-UDP-conntrack problem of kube-proxy). SCTP too: the new backend answers the
        // association it does not know with an ABORT, and the client learns at once.
        let alive = lb::lookup_backend::<F>(entry.backend_id)
            .is_some_and(|b| b.addr == entry.nat_addr && b.port == entry.nat_port);
        if alive {
            unsafe { (*ptr).last_seen_ns = now_ns() };
        } else {
            count(Counter::TcStaleUdpMoved);
        }
        alive
    };
    if !keep {
        if established {
            // The new flow's entries go to the new-flow table, looked up after this one: the old
            // forward entry would hide them.
            let _ = F::conntrack().remove(&key);
        }
        return NEW_FLOW;
    }
    // The client past the TCP handshake (no SYN, no RST), or a second UDP datagram: established.
    if !established && (!tcp || pkt.tcp_flags & (TCP_SYN | TCP_RST) == 0) {
        return ESTABLISH;
    }
    note_close::<F, SCTP>(ptr, pkt, ct::FIN_FORWARD);
    note_established::<F, SCTP>(ptr, entry.flags, pkt);
    mark_forward(ctx, entry.flags, entry.rev_nat_id);
    apply::<F, SCTP>(ctx, pkt, false, entry.nat_addr, entry.nat_port)
}

/// A `SNAT_TAGGED` flow's packet at ingress carries the forward mark, for egress to find its
/// tagged SNAT entry ([`tagged_snat`]).
#[inline(always)]
pub(super) fn mark_forward(ctx: &mut TcContext, flags: u16, rev_nat_id: u32) {
    if flags & ct::SNAT_TAGGED != 0 {
        ctx.set_mark(FORWARD_MARK | (rev_nat_id & MARK_ID));
    }
}

/// The tagged SNAT entry of the flow whose forward mark (`mark`) a packet at egress carries,
/// `key` being the packet's untagged SNAT key (client -> backend; left as it was): the entry of
/// the frontend the mark names. `None` without such a mark, or when there is no such entry (the
/// mark is then another component's, counted).
#[inline(always)]
pub(super) fn tagged_snat<F: Ip>(mark: u32, key: &mut CtKey<F>) -> Option<*mut CtValue<F>> {
    if mark & MARK_MASK != FORWARD_MARK {
        return None;
    }
    let id = mark & MARK_ID;
    key.tag = snat_tag(id);
    // SAFETY: a map value just looked up.
    let found = lookup::<F>(key)
        .filter(|p| unsafe { (**p).rev_nat_id & MARK_ID == id && (**p).flags & ct::REPLY == 0 });
    key.tag = 0;
    if found.is_none() {
        count(Counter::TcForeignMark);
    }
    found
}

/// The client's packet that establishes a new flow (`l4_ingress` said [`ESTABLISH`]): the flow's
/// entries move from the new-flow table to the established one, its companions first and the
/// forward entry last, each inserted before it is deleted, so that every lookup finds each entry
/// in one table or the other throughout; then the packet is translated as any of the flow's.
/// [`NEW_FLOW`] if the entry or one of its companions went meanwhile (evicted by a flood).
#[inline(never)]
pub(super) fn establish<F: Ip, const SCTP: bool>(ctx: &mut TcContext, pkt: &Packet<F>) -> i32 {
    let flow = &pkt.flow;
    let mut key = flow.key(dir::INGRESS);
    let Some(ptr) = F::conntrack_new().get_ptr_mut(&key) else {
        return NEW_FLOW;
    };
    let (backend, backend_port, flags, rev_nat_id) =
        unsafe { ((*ptr).nat_addr, (*ptr).nat_port, (*ptr).flags, (*ptr).rev_nat_id) };
    // Its SNAT entry (client -> backend, at egress; tagged if the flow is), or its un-DNAT entry
    // (backend -> client).
    key.daddr = backend;
    key.dport = backend_port;
    key.dir = dir::EGRESS;
    if flags & ct::SNAT_TAGGED != 0 {
        key.tag = snat_tag(rev_nat_id);
    }
    let complete = if flags & ct::SNAT != 0 {
        match move_entry::<F>(&key) {
            // Its un-SNAT entry: backend -> node IP:port, at ingress.
            Some((snat_addr, snat_port)) => {
                key = CtKey {
                    saddr: backend,
                    daddr: snat_addr,
                    sport: backend_port,
                    dport: snat_port,
                    proto: flow.proto,
                    dir: dir::INGRESS,
                    tag: 0,
                };
                move_entry::<F>(&key).is_some()
            }
            None => false,
        }
    } else {
        key = CtKey {
            saddr: backend,
            daddr: flow.saddr,
            sport: backend_port,
            dport: flow.sport,
            proto: flow.proto,
            dir: dir::EGRESS,
            tag: 0,
        };
        move_entry::<F>(&key).is_some()
    };
    if !complete {
        // A companion went (evicted from a full `lb4_ct_new`): the flow's replies could no longer
        // be translated back, and a UDP client reusing its socket would wait on them for as long
        // as it sends. The packet starts the flow again, as netfilter's does when its conntrack
        // entry is gone; `new_flow` writes every entry anew (a TCP handshake's backend answers the
        // new tuple with a reset: at once, where the broken flow would have hung).
        count(Counter::TcFlowRestarted);
        return NEW_FLOW;
    }
    key = flow.key(dir::INGRESS);
    let Some(ptr) = F::conntrack_new().get_ptr_mut(&key) else {
        return NEW_FLOW;
    };
    note_close::<F, SCTP>(ptr, pkt, ct::FIN_FORWARD);
    note_established::<F, SCTP>(ptr, flags, pkt);
    if insert_used(F::conntrack(), &key, unsafe { &*ptr }, 0).is_ok() {
        let _ = F::conntrack_new().remove(&key);
        count(Counter::TcFlowEstablished);
    }
    mark_forward(ctx, flags, rev_nat_id);
    let verdict = apply::<F, SCTP>(ctx, pkt, false, backend, backend_port);
    // The egress entry moved gets its filter byte in the generation the programs write now: the
    // agent's scan may have missed it while it moved (`lb_common::ct_filter`). Last, after every
    // step whose verification needs precise values (`ct_filter::note_bucket`).
    let filter_bucket = if flags & ct::SNAT != 0 {
        ct_filter::bucket::<F>(&flow.saddr, &backend, flow.sport, backend_port, flow.proto)
    } else {
        ct_filter::bucket::<F>(&backend, &flow.saddr, backend_port, flow.sport, flow.proto)
    };
    ct_filter::note_bucket::<F>(filter_bucket);
    verdict
}

/// Moves the entry at `key` from the new-flow table to the established one (left where it is if
/// the established table refuses it). Its `(nat_addr, nat_port)`, if it was there.
#[inline(always)]
fn move_entry<F: Ip>(key: &CtKey<F>) -> Option<(F::Addr, u16)> {
    let ptr = F::conntrack_new().get_ptr(key)?;
    // SAFETY: `ptr` points into a map value just looked up; the kernel copies it on insert.
    let nat = unsafe { ((*ptr).nat_addr, (*ptr).nat_port) };
    if insert_used(F::conntrack(), key, unsafe { &*ptr }, 0).is_ok() {
        let _ = F::conntrack_new().remove(key);
    }
    Some(nat)
}

/// The source a TCP/UDP/SCTP packet at egress gets, if any: a reply ingress un-SNATed (its
/// `mark` ours) gets its frontend back; a packet on a tracked egress entry is SNATed or
/// reverse-DNATed. `from_backend`: the prefilter says the source may be a backend's. The program
/// rewrites the packet with it (`nat::apply_source`), one rewrite at the end: each inlined rewrite
/// of a family's addresses takes its own room in `egress_of`'s frame. (Four arguments and the
/// returned value's pointer: a BPF function has five registers for them, and LLVM passes a sixth
/// on the stack, which no kernel accepts.)
#[inline(always)]
pub(super) fn egress_rewrite<F: Ip>(
    ctx: &mut TcContext,
    pkt: &Packet<F>,
    mark: u32,
    from_backend: bool,
) -> Option<(F::Addr, u16)> {
    let ours = mark & MARK_MASK == MARK_MAGIC;
    let flow = pkt.flow;
    if ours {
        match marked_reply::<F>(
            mark,
            (flow.daddr, flow.dport),
            (flow.saddr, flow.sport),
            flow.proto,
        ) {
            Some(frontend) => {
                // A reply un-SNATed at ingress: the client called the frontend.
                ctx.set_mark(0);
                return Some((frontend.addr, frontend.port));
            }
            None => count(Counter::TcForeignMark),
        }
    }
    let mut key = flow.key(dir::EGRESS);
    // A tagged flow's packet (its client port is another flow's to the same backend).
    if let Some(ptr) = tagged_snat::<F>(mark, &mut key) {
        ctx.set_mark(0);
        // SAFETY: a map value just looked up.
        return unsafe { Some(((*ptr).nat_addr, (*ptr).nat_port)) };
    }
    // Of a TCP flow in its handshake (the new-flow table), the client's packets cross egress only
    // as SYNs: its first packet past the SYN moves the flow at ingress. The backend's may be
    // anything (a Fast Open server sends data before the client's ACK). So a TCP packet without
    // SYN or RST that misses the established table is looked up in the new-flow one only if it
    // may come from a backend: the socket path's connections (client -> backend, which pass the
    // prefilter by their destination) skip the second lookup.
    let tracked = F::conntrack().get_ptr_mut(&key).or_else(|| {
        if flow.proto != proto::TCP || pkt.tcp_flags & (TCP_SYN | TCP_RST) != 0 || from_backend {
            F::conntrack_new().get_ptr_mut(&key)
        } else {
            None
        }
    })?;
    let entry = unsafe { *tracked };
    if entry.flags & ct::REPLY != 0 {
        note_reply::<F, false>(tracked, pkt);
    }
    Some((entry.nat_addr, entry.nat_port))
}

/// Close tracking for the agent's conntrack GC: the first FIN (in `fin` direction) or RST that
/// passes a TCP entry marks it, with the time. One map write per closing packet, none for others.
#[inline(always)]
fn note_close<F: Family, const SCTP: bool>(ptr: *mut CtValue<F>, pkt: &Packet<F>, fin: u16) {
    if SCTP || pkt.flow.proto != proto::TCP {
        return;
    }
    let mark = if pkt.tcp_flags & TCP_RST != 0 {
        ct::RESET
    } else if pkt.tcp_flags & TCP_FIN != 0 {
        fin
    } else {
        return;
    };
    // SAFETY: `ptr` points into a map value the caller just looked up.
    unsafe {
        if (*ptr).flags & mark == 0 {
            (*ptr).flags |= mark;
            (*ptr).last_seen_ns = now_ns();
        }
    }
}

/// The client's first TCP packet past the handshake (no SYN, no RST) marks its forward entry
/// `ESTABLISHED`: one map write per flow, none for other packets.
#[inline(always)]
fn note_established<F: Family, const SCTP: bool>(ptr: *mut CtValue<F>, flags: u16, pkt: &Packet<F>) {
    if !SCTP
        && pkt.flow.proto == proto::TCP
        && pkt.tcp_flags & (TCP_SYN | TCP_RST) == 0
        && flags & ct::ESTABLISHED == 0
    {
        // SAFETY: as in `note_close`.
        unsafe { (*ptr).flags |= ct::ESTABLISHED };
    }
}

/// A packet from the backend on one of its flow's reply entries: TCP closes are marked, and a
/// UDP or SCTP flow whose traffic is all replies stays alive for the GC (refreshed at most once a
/// second). (Written as two comparisons, not `!= TCP`: that spelling grew `ingress_of`'s frame
/// past the 512 bytes Linux 6.1 allows its call chain, rounded to 32 per frame.)
#[inline(always)]
pub(super) fn note_reply<F: Family, const SCTP: bool>(ptr: *mut CtValue<F>, pkt: &Packet<F>) {
    if SCTP || pkt.flow.proto == proto::UDP || pkt.flow.proto == proto::SCTP {
        let now = now_ns();
        // SAFETY: as in `note_close`.
        unsafe {
            if now.saturating_sub((*ptr).last_seen_ns) >= UDP_REPLY_REFRESH_NS {
                (*ptr).last_seen_ns = now;
            }
        }
    } else {
        note_close::<F, SCTP>(ptr, pkt, ct::FIN_REPLY);
    }
}

/// The frontend an un-SNAT mark names, if the packet (`backend` -> `client`) really is a reply
/// of the flow ingress un-SNATed: the client's forward entry to that frontend must point at this
/// backend. Other components use skb->mark too (Cilium keeps identities in the upper bits); a
/// mark that merely looks like ours must not rewrite anything.
#[inline(always)]
pub(super) fn marked_reply<F: Ip>(
    mark: u32,
    client: (F::Addr, u16),
    backend: (F::Addr, u16),
    proto: u8,
) -> Option<RevNatValue<F>> {
    if mark & MARK_MASK != MARK_MAGIC {
        return None;
    }
    let id = mark & MARK_ID;
    let frontend = F::revnat().get_ptr(&id).map(|p| unsafe { *p })?;
    let forward = Flow::<F> {
        saddr: client.0,
        daddr: frontend.addr,
        sport: client.1,
        dport: frontend.port,
        proto,
    };
    let entry = lookup::<F>(&forward.key(dir::INGRESS)).map(|p| unsafe { *p })?;
    let ours = entry.flags & ct::REPLY == 0
        && entry.rev_nat_id & MARK_ID == id
        && entry.nat_addr == backend.0
        && entry.nat_port == backend.1;
    ours.then_some(frontend)
}
