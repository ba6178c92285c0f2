//! A new flow at ingress, in two steps: `choose` (frontend lookup, loadBalancerSourceRanges,
//! REJECT or DROP of a frontend without endpoints, backend selection) and `track` (the masquerade
//! decision, the flow's conntrack entries, DNAT). Each step is a BPF function of its own, called
//! one after the other: together their locals would not fit beside the program's in the 512 bytes
//! of stack a call chain may use (an IPv6 flow's conntrack key and entry alone take 88).

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_boot_ns},
    programs::TcContext,
};
use lb_common::{
    affinity::kind,
    backend::{BackendValue, flags as backend_flags},
    cluster_ip::action,
    config::flags as config_flags,
    conntrack::{CtKey, CtValue, dir, flags as ct, snat_tag},
    family::put_addr,
    maglev,
    monitor::hook,
    service::flags,
    stats::Counter,
    trace::{tc as trace_cb, verdict},
};

use super::{
    conntrack::{lookup, mark_forward, now_ns},
    ct_filter,
    ip::Ip,
    nat::{apply, apply_sctp_destination},
    parse::{Flow, Packet, skb},
    reject::{self, REJECT},
    snat::{masquerade_addr, masquerade_route, reclaim_port_for, reserve_snat_port},
};
use crate::{
    family::insert_used,
    lb::{self, Frontend},
    maps::POD_INTERFACES,
    monitor,
    stats::count,
};

const EEXIST: i64 = 17;

/// Records a decision in the skb's control block (`lb_common::trace::tc`), for the trace harness.
#[inline(always)]
fn trace(ctx: &mut TcContext, slot: usize, value: u32) {
    if slot < 5 {
        ctx.cb_mut()[slot] = value;
    }
}

/// A TCP, UDP or SCTP packet at ingress that no conntrack entry keeps: a frontend's new flow is
/// DNATed (and masqueraded when kube-proxy would), rejected or dropped; anything else passes.
/// `LOCAL`: the packet is the node's own, at egress (`local`): the frontend is looked up as for a
/// socket call (`internal`), and the flow is never masqueraded (its source is a node address)
/// but marked `LOCAL_CLIENT`.
#[inline(always)]
pub(super) fn new_flow<F: Ip, const SCTP: bool, const LOCAL: bool>(
    ctx: &mut TcContext,
    pkt: &Packet<F>,
) -> i32 {
    let mut choice = Choice::<F>::default();
    let verdict = decide::<F, SCTP, LOCAL>(ctx, pkt, &mut choice);
    if choice.outcome != NO_OUTCOME && monitor::wanted(choice.outcome as u32) {
        event::<F, LOCAL>(ctx, Some(&pkt.flow), Some(&choice), choice.outcome as u32);
    }
    // Last, after every step whose verification needs precise values (`ct_filter::note_bucket`).
    if choice.filter_bucket != ct_filter::NO_BUCKET {
        ct_filter::note_bucket::<F>(choice.filter_bucket);
    }
    verdict
}

/// `new_flow`'s decision, its outcome's counter left in `choice.outcome`.
#[inline(always)]
fn decide<F: Ip, const SCTP: bool, const LOCAL: bool>(
    ctx: &mut TcContext,
    pkt: &Packet<F>,
    choice: &mut Choice<F>,
) -> i32 {
    let verdict = match choose::<F, LOCAL>(ctx, pkt, choice) {
        CHOSEN => {
            // Where the flow leaves the node, for its masquerade address: looked up for every new
            // flow, masqueraded or not yet (`track` may still masquerade one whose reply tuple a
            // live flow holds). Here rather than in `choose`: the verifier walks the lookup once
            // per state reaching it, and few reach this point.
            if !LOCAL {
                choice.masq_route =
                    masquerade_route::<F>(ctx, &pkt.flow.saddr, &choice.backend, pkt.flow.proto);
            }
            choice.held = held_tuples::<F>(&pkt.flow, &choice.backend);
            let verdict = match track::<F, SCTP, LOCAL>(ctx, pkt, choice) {
                // Every masquerade port tried is held: take one back if a flow is done with one,
                // and try again with it.
                NO_FREE_PORT => {
                    choice.snat_port =
                        reclaim_port_for::<F>(choice.backend_id, pkt.flow.proto, choice.masq_route);
                    match choice.snat_port {
                        0 => NO_FREE_PORT,
                        _ => track::<F, SCTP, LOCAL>(ctx, pkt, choice),
                    }
                }
                verdict => verdict,
            };
            match verdict {
                DNAT_PENDING if SCTP => apply_sctp_destination::<F>(ctx, pkt, &choice.backend),
                verdict => verdict,
            }
        }
        // The node's own packet is dropped: an ICMP error built here would leave by the egress
        // it is on (`local::forward` says why a drop does as well).
        REJECT if LOCAL => TC_ACT_SHOT,
        REJECT => reject::reject::<F>(ctx, pkt.l4, &pkt.flow.saddr),
        NOT_A_FRONTEND => match cluster_ip_check::<F>(ctx, &pkt.flow.daddr) {
            REJECT if LOCAL => {
                choice.outcome = Counter::TcClusterIpBadPort as u8;
                TC_ACT_SHOT
            }
            REJECT => {
                choice.outcome = Counter::TcClusterIpBadPort as u8;
                reject::reject::<F>(ctx, pkt.l4, &pkt.flow.saddr)
            }
            TC_ACT_SHOT => {
                choice.outcome = Counter::TcUnallocatedClusterIp as u8;
                TC_ACT_SHOT
            }
            verdict => verdict,
        },
        verdict => verdict,
    };
    if verdict == NO_FREE_PORT {
        choice.count(Counter::TcSnatPortsExhausted);
        return TC_ACT_SHOT;
    }
    verdict
}

/// The event of a packet for `lb-agent monitor`: `outcome` (a counter's index) with the packet's
/// flow and, for a new flow, its frontend, backend and masquerade. `EGRESS`: the node's own
/// packet at egress (`local`), reported with the interface it leaves by; else a packet at
/// ingress, with the one it came in by. Not inlined: its frame (the event and the lookups of the
/// backend and the masquerade address) is a sibling of the new flow's steps in the call chain,
/// under `ingress_of`, not inside them.
#[inline(never)]
pub(super) fn event<F: Ip, const EGRESS: bool>(
    ctx: &TcContext,
    flow: Option<&Flow<F>>,
    choice: Option<&Choice<F>>,
    outcome: u32,
) {
    // SAFETY: the context's skb pointer is valid for the program's run.
    let ifindex = unsafe {
        match EGRESS {
            true => (*skb(ctx)).ifindex,
            false => (*skb(ctx)).ingress_ifindex,
        }
    };
    monitor::emit(|event| {
        event.time_ns = unsafe { bpf_ktime_get_boot_ns() };
        event.counter = outcome;
        event.hook = match EGRESS {
            true => hook::TC_EGRESS,
            false => hook::TC_INGRESS,
        };
        event.ifindex = ifindex;
        event.family = F::AF as u8;
        if let Some(flow) = flow {
            event.protocol = flow.proto;
            put_addr::<F>(&mut event.src, &flow.saddr);
            put_addr::<F>(&mut event.dst, &flow.daddr);
            event.src_port = flow.sport;
            event.dst_port = flow.dport;
        }
        if let Some(choice) = choice {
            event.rev_nat_id = choice.rev_nat_id;
            event.backend_id = choice.backend_id;
            if outcome == Counter::TcNewFlow as u32 {
                put_addr::<F>(&mut event.backend, &choice.backend.addr);
                event.backend_port = choice.backend.port;
                if choice.snat_port != 0 {
                    if let Some(addr) = masquerade_addr::<F>(choice.masq_route) {
                        put_addr::<F>(&mut event.nat, addr);
                    }
                    event.nat_port = choice.snat_port;
                }
            }
        }
    });
}

/// What `track` returns when no masquerade port was free (nothing written yet): `new_flow`
/// looks for one to take back, and drops the packet if there is none.
const NO_FREE_PORT: i32 = i32::MIN + 3;

/// What `choose` returns when no frontend has the packet's destination: `new_flow` applies the
/// cluster-ips-check next (a function of its own: inside `choose`, its trie key took the stack
/// past the 512 bytes a call chain may use).
const NOT_A_FRONTEND: i32 = i32::MIN + 4;

/// What `choose` returns when it filled in a [`Choice`].
const CHOSEN: i32 = i32::MIN + 2;

/// What an SCTP flow's `track` returns once its entries are in: the caller rewrites the
/// destination (`nat::apply_sctp_destination`). SCTP's port rewrite calls `lb_sctp_checksum`, a
/// frame of its own, which below `track` would take `lb_tc_sctp_in`'s call chain (the program,
/// `sctp_ingress_of`, `track`) past the 512 bytes Linux 5.10 and 6.1 allow it (each frame
/// rounded up to 32).
const DNAT_PENDING: i32 = i32::MIN + 5;

/// [`Choice::outcome`] before anything was counted.
const NO_OUTCOME: u8 = u8::MAX;

/// The backend a new flow goes to, and what `track` needs of its frontend.
pub(super) struct Choice<F: Ip> {
    backend_id: u32,
    /// The backend's entry as `choose` read it (the service slot's copy, or the backends map's
    /// for an affinity or Maglev choice): the later steps use it rather than look the backend up
    /// again, a dependent cache miss per new flow. Plain values, not a pointer to the entry: a
    /// map pointer kept across the BPF functions prunes poorly (6.18: `lb_tc_ingress` 636k ->
    /// 688k steps, and 5.10 did not finish verifying it in 8 minutes).
    backend: BackendValue<F>,
    rev_nat_id: u32,
    /// The frontend entry's `flags::*`.
    frontend_flags: u16,
    /// The scope whose entry was used (`SCOPE_EXTERNAL` or `SCOPE_INTERNAL`).
    scope: u8,
    /// The source is a pod per the family's local-traffic detector.
    from_pod: bool,
    /// Before `track`: a masquerade port taken back for this flow, tried first (0: none). After a
    /// translation: the flow's masquerade port (0: not masqueraded).
    snat_port: u16,
    /// Where the flow leaves the node, for its masquerade address (`snat::masquerade_route`).
    masq_route: u32,
    /// Which of the flow's egress tuples an entry may hold already (`ct_filter::new_flow_tuples`).
    held: u8,
    /// The counter the steps bumped for this flow, as an index (`Counter as u8`), for
    /// `lb-agent monitor`; [`NO_OUTCOME`] when none.
    outcome: u8,
    /// The egress flow filter's bucket of the egress entry `track` inserted
    /// (`ct_filter::NO_BUCKET`: none), noted by `new_flow` last.
    filter_bucket: u32,
}

impl<F: Ip> Choice<F> {
    /// The backend's address, read where it is used: loaded early, LLVM keeps it in `track`'s
    /// frame (16 bytes for IPv6, which that call chain's 512 bytes have no room for).
    #[inline(always)]
    fn backend_addr(&self) -> F::Addr {
        // SAFETY: a read of an initialized field of a live reference.
        unsafe { core::ptr::read_volatile(&self.backend.addr) }
    }

    /// Counts `counter` and remembers it as this flow's outcome (as `sock::Outcome::count`).
    #[inline(always)]
    fn count(&mut self, counter: Counter) {
        count(counter);
        self.outcome = counter as u8;
    }
}

impl<F: Ip> Default for Choice<F> {
    #[inline(always)]
    fn default() -> Self {
        Choice {
            backend_id: 0,
            backend: BackendValue::default(),
            rev_nat_id: 0,
            frontend_flags: 0,
            scope: 0,
            from_pod: false,
            snat_port: 0,
            masq_route: 0,
            held: 0,
            outcome: NO_OUTCOME,
            filter_bucket: ct_filter::NO_BUCKET,
        }
    }
}

/// kube-proxy's cluster-ips-check for a new flow no frontend matched (`lb_common::cluster_ip`):
/// [`REJECT`] to a cluster IP (a port no Service has), a drop to an unallocated address of a
/// Service CIDR, else the packet passes (it is no Service's).
#[inline(never)]
fn cluster_ip_check<F: Ip>(ctx: &mut TcContext, daddr: &F::Addr) -> i32 {
    match lb::cluster_ip_check::<F>(daddr) {
        Some(action::REJECT) => {
            count(Counter::TcClusterIpBadPort);
            trace(ctx, trace_cb::CB_VERDICT, verdict::REJECT);
            REJECT
        }
        Some(action::DROP) => {
            count(Counter::TcUnallocatedClusterIp);
            trace(ctx, trace_cb::CB_VERDICT, verdict::DROP);
            TC_ACT_SHOT
        }
        _ => TC_ACT_OK,
    }
}

/// The frontend of a new flow and its backend: [`CHOSEN`] with `choice` filled in, [`REJECT`],
/// [`NOT_A_FRONTEND`], or another verdict (denied by loadBalancerSourceRanges, no endpoints).
#[inline(never)]
fn choose<F: Ip, const LOCAL: bool>(ctx: &mut TcContext, pkt: &Packet<F>, choice: &mut Choice<F>) -> i32 {
    let flow = &pkt.flow;
    let cfg = lb::datapath_config();
    // kube-proxy's local-traffic detector: pods (sources in the family's cluster CIDRs, or packets
    // that came in by a pod interface) short-circuit a Local-policy external frontend to the
    // cluster-wide endpoints, and are not masqueraded when they reach a cluster IP.
    let from_pod = if cfg.flags & config_flags::DETECT_LOCAL_BY_INTERFACE != 0 {
        came_in_by_pod_interface(ctx)
    } else {
        F::settings(cfg).is_pod_address(&flow.saddr) == Some(true)
    };
    // The node's own packet: looked up as a socket call is (an external frontend's cluster-wide
    // scope, kube-proxy's `--src-type LOCAL` jump to the Service chain).
    let internal = from_pod || LOCAL;
    let (svc_key, frontend) = match lb::lookup_frontend::<F>(&flow.daddr, flow.dport, flow.proto, internal) {
        Frontend::None => return NOT_A_FRONTEND,
        Frontend::Incomplete => {
            choice.count(Counter::TcNoBackend);
            return TC_ACT_OK;
        }
        Frontend::Found(key, entry) => (key, entry),
    };
    choice.rev_nat_id = frontend.rev_nat_id;
    trace(ctx, trace_cb::CB_REV_NAT_ID, frontend.rev_nat_id);
    trace(ctx, trace_cb::CB_FRONTEND_FLAGS, frontend.flags as u32);
    trace(ctx, trace_cb::CB_SCOPE_FLAGS, svc_key.scope as u32);

    if frontend.has(flags::SOURCE_RANGES) && !lb::source_in_ranges::<F>(frontend, &flow.saddr) {
        choice.count(Counter::SourceRangeDenied);
        trace(ctx, trace_cb::CB_VERDICT, verdict::DROP);
        return TC_ACT_SHOT;
    }
    if frontend.count == 0 {
        if frontend.has(flags::DROP_IF_EMPTY) {
            choice.count(Counter::TcDropped);
            trace(ctx, trace_cb::CB_VERDICT, verdict::DROP);
            return TC_ACT_SHOT;
        }
        choice.count(Counter::TcRejected);
        trace(ctx, trace_cb::CB_VERDICT, verdict::REJECT);
        return REJECT;
    }

    let client = F::client_of_addr(&flow.saddr);
    // Maglev: the flow's own hash, the same on every node (with the cluster's seed); otherwise
    // any backend will do.
    let hash = if frontend.has(flags::MAGLEV) {
        maglev::flow_hash::<F>(
            cfg.maglev_seed,
            &flow.saddr,
            &flow.daddr,
            flow.sport,
            flow.dport,
            flow.proto,
        )
    } else {
        unsafe { bpf_get_prandom_u32() }
    };
    let Some((backend_id, backend)) =
        lb::select_backend::<F>(&svc_key, frontend, || client, kind::ADDR, hash, now_ns)
    else {
        choice.count(Counter::TcNoBackend);
        return TC_ACT_OK;
    };
    *choice = Choice {
        backend_id,
        backend: *backend,
        rev_nat_id: frontend.rev_nat_id,
        frontend_flags: frontend.flags,
        scope: svc_key.scope,
        from_pod,
        snat_port: 0,
        masq_route: 0,
        held: 0,
        outcome: NO_OUTCOME,
        filter_bucket: ct_filter::NO_BUCKET,
    };
    CHOSEN
}

/// Which of the flow's egress tuples (with the backend's address and port) an entry may hold
/// already (`ct_filter::new_flow_tuples`). A BPF function of its own beside `track`: inside
/// `track`, or inline in the caller, the tuples' hashing grows a frame of IPv6's call chain past
/// its 512 bytes.
#[inline(never)]
fn held_tuples<F: Ip>(flow: &Flow<F>, backend: &BackendValue<F>) -> u8 {
    ct_filter::new_flow_tuples::<F>(
        ct_filter::bucket::<F>(&backend.addr, &flow.saddr, backend.port, flow.sport, flow.proto),
        ct_filter::bucket::<F>(&flow.saddr, &backend.addr, flow.sport, backend.port, flow.proto),
    )
}

/// kube-proxy's `-i <bridge>` / `-i <prefix>+` detectors: the interface the packet came in by is
/// one of the agent's `lb_pod_ifaces` (the skb's ingress ifindex; at tc ingress, the interface
/// the program is attached to).
#[inline(always)]
fn came_in_by_pod_interface(ctx: &TcContext) -> bool {
    // SAFETY: the context's skb pointer is valid for the program's run.
    let skb = ctx.as_ptr().cast::<__sk_buff>();
    let ifindex = unsafe { (*skb).ingress_ifindex };
    POD_INTERFACES.get_ptr(&ifindex).is_some()
}

/// The chosen backend's flow: the masquerade decision, its conntrack entries, and DNAT.
#[inline(never)]
fn track<F: Ip, const SCTP: bool, const LOCAL: bool>(
    ctx: &mut TcContext,
    pkt: &Packet<F>,
    choice: &mut Choice<F>,
) -> i32 {
    let flow = &pkt.flow;
    let cfg = lb::datapath_config();
    let has = |flag: u16| choice.frontend_flags & flag != 0;
    let backend_id = choice.backend_id;
    // The backend as `choose` read it: removed since (the agent deletes a backend after
    // unlinking its slots), the flow goes to it as if it had begun a moment earlier.
    let backend_port = choice.backend.port;
    let now = now_ns();
    // A backend at one of this node's own addresses (a hostNetwork endpoint at any interface's
    // address or the node IP; the agent flags them) is delivered locally: the packet never
    // reaches egress, where masquerading happens. As with kube-proxy, whose POSTROUTING
    // MASQUERADE never sees a locally delivered packet, it keeps the client's address and its
    // replies get the frontend back on their way out.
    let local_backend = choice.backend.flags & backend_flags::HOST != 0;
    // Hairpin: the reply must come back through this node to be translated.
    let wanted = has(flags::MASQUERADE)
        || (has(flags::MASQUERADE_OFF_CLUSTER) && !choice.from_pod)
        || choice.backend_addr() == flow.saddr;
    // `&` rather than `&&`: one branch fewer for the verifier to walk every state of the rest of
    // `track` through (Linux 6.1: 823,898 -> 758,224 steps for lb_tc_ingress). Making the three
    // tests above branch-free too saves more steps but spills past the 512-byte stack.
    // The node's own packet keeps its source, a node address: what MASQUERADE would give it (the
    // address of the interface the route to the backend leaves by; the one the route to the
    // frontend chose differs only on a node whose interfaces route differently).
    let mut masquerade = wanted & !local_backend & !LOCAL;

    // One entry and one key, rewritten for each of the flow's entries in turn: an IPv6 flow's
    // entries are 48 and 40 bytes, and copies of each would overflow the stack frame.
    let mut entry = CtValue::<F> {
        created_ns: now,
        last_seen_ns: now,
        nat_addr: flow.daddr,
        nat_port: flow.dport,
        flags: ct::REPLY | ct::HANDSHAKE_TRACKED | if LOCAL { ct::LOCAL_CLIENT } else { 0 },
        rev_nat_id: choice.rev_nat_id,
        backend_id,
        _pad: Default::default(),
    };
    // The reply tuple (backend -> client), as egress sees it.
    let mut key = CtKey::<F> {
        saddr: choice.backend_addr(),
        daddr: flow.saddr,
        sport: backend_port,
        dport: flow.sport,
        proto: flow.proto,
        dir: dir::EGRESS,
        tag: 0,
    };
    if !masquerade {
        // Replies (backend -> client) get the frontend back as their source on the way out. If a
        // live flow already owns that tuple (the same client port to two frontends with a shared
        // backend), masquerade this one so both stay unambiguous.
        // A new flow's entries go to the new-flow table; the tuple is taken if either table
        // holds it.
        let inserted = (choice.held & ct_filter::REPLY_MAY_BE_HELD == 0
            || F::conntrack().get_ptr(&key).is_none())
            && match insert_used(F::conntrack_new(), &key, &entry, BPF_NOEXIST as u64) {
                Ok(()) => true,
                Err(e) if e as i64 == -EEXIST => false,
                Err(_) => {
                    choice.count(Counter::TcCtInsertFailed);
                    return TC_ACT_SHOT;
                }
            };
        if !inserted {
            // Gone meanwhile counts as free.
            let same = lookup::<F>(&key)
                .is_none_or(|old| unsafe { (*old).nat_addr == flow.daddr && (*old).nat_port == flow.dport });
            if same {
                let _ = insert_used(F::conntrack_new(), &key, &entry, 0);
            } else if LOCAL {
                // The node's own socket cannot be masqueraded: its association through the
                // other frontend keeps the tuple.
                choice.count(Counter::TcCtInsertFailed);
                return TC_ACT_SHOT;
            } else {
                masquerade = true;
            }
        }
    }
    // The address of the interface the flow leaves by (or the node's primary IP), as MASQUERADE.
    let snat_addr = masquerade_addr::<F>(choice.masq_route);
    // The masquerade address, and the port (0 when not masqueraded): a value on every path. An
    // `Option`'s port is undefined on its `None` path, and LLVM then reads its stack slot before
    // testing the variant, which Linux 5.10's verifier refuses (a read of uninitialized stack).
    let (masquerade_to, snat_port) = match (masquerade, snat_addr) {
        (false, _) => (None, 0),
        (true, None) => {
            choice.count(Counter::TcNoMasqueradeAddress);
            return TC_ACT_SHOT;
        }
        (true, Some(snat_addr)) => {
            // The un-SNAT entry (backend -> snat_addr:port) holds the port: client as the NAT
            // target.
            entry.nat_addr = flow.saddr;
            entry.nat_port = flow.sport;
            entry.flags = ct::REPLY | ct::SNAT | ct::HANDSHAKE_TRACKED;
            match reserve_snat_port::<F>(cfg, &mut key, &entry, snat_addr, choice.snat_port) {
                Some(port) => (Some(snat_addr), port),
                None => return NO_FREE_PORT,
            }
        }
    };
    // The tuple this flow has on the wire after DNAT; egress masquerades it when it carries an
    // SNAT entry.
    key.saddr = flow.saddr;
    key.daddr = choice.backend_addr();
    key.sport = flow.sport;
    key.dport = backend_port;
    key.dir = dir::EGRESS;
    let forward_held = choice.held & ct_filter::FORWARD_MAY_BE_HELD != 0;
    let mut tagged = false;
    match masquerade_to {
        None => {
            // An earlier masqueraded flow from this client port to this backend through another
            // frontend leaves an SNAT entry for the same post-DNAT tuple; left in place it would
            // masquerade this flow too and its replies would go back as the wrong frontend.
            // Egress cannot tell two such flows apart, so the newest owns the tuple.
            // Rarely there: looked up first (a lookup takes no lock; a delete takes the bucket's,
            // with interrupts off).
            if forward_held && lookup::<F>(&key).is_some() {
                let _ = F::conntrack().remove(&key);
                let _ = F::conntrack_new().remove(&key);
            }
        }
        Some(snat_addr) => {
            // A masqueraded flow through another frontend (this client port, this backend) may
            // hold the tuple's SNAT entry, live: egress cannot tell the two flows' packets apart,
            // so this one's entry is tagged and its packets marked (`lb_common::conntrack`). An
            // entry of this frontend is an earlier flow of this very tuple, replaced.
            let other = |k: &CtKey<F>| {
                forward_held
                    && lookup::<F>(k).is_some_and(|old| unsafe { (*old).rev_nat_id != choice.rev_nat_id })
            };
            if other(&key) {
                key.tag = snat_tag(choice.rev_nat_id);
                // The tag taken too (ids 65,535 apart): the untagged entry is taken over, as
                // before tags.
                tagged = !other(&key);
                if tagged {
                    count(Counter::TcSnatTagged);
                } else {
                    key.tag = 0;
                }
            }
            F::copy_addr(&mut entry.nat_addr, snat_addr);
            entry.nat_port = snat_port;
            entry.flags = ct::SNAT | ct::HANDSHAKE_TRACKED;
            // Likewise: an SNAT entry there would be found before this one.
            if forward_held {
                let _ = F::conntrack().remove(&key);
            }
            if insert_used(F::conntrack_new(), &key, &entry, 0).is_err() {
                choice.count(Counter::TcCtInsertFailed);
                return TC_ACT_SHOT;
            }
            count(Counter::TcMasqueraded);
        }
    }
    entry.flags = ct::HANDSHAKE_TRACKED | if masquerade { ct::SNAT } else { 0 };
    if tagged {
        entry.flags |= ct::SNAT_TAGGED;
    }
    if choice.backend_addr() == flow.saddr {
        entry.flags |= ct::HAIRPIN;
    }
    entry.nat_addr = choice.backend_addr();
    entry.nat_port = backend_port;
    if insert_used(F::conntrack_new(), &flow.key(dir::INGRESS), &entry, 0).is_err() {
        choice.count(Counter::TcCtInsertFailed);
        return TC_ACT_SHOT;
    }
    // The egress entry this flow inserted: its SNAT entry (client -> backend, `key`'s tuple
    // whatever its tag), else its un-DNAT entry (backend -> client). Computed here, where few
    // values are live: earlier, `track`'s frame grew past what IPv6's call chain has room for.
    choice.filter_bucket = if masquerade {
        ct_filter::key_bucket(&key)
    } else {
        ct_filter::bucket::<F>(
            &choice.backend_addr(),
            &flow.saddr,
            backend_port,
            flow.sport,
            flow.proto,
        )
    };
    choice.count(Counter::TcNewFlow);
    choice.snat_port = snat_port;
    mark_forward(ctx, entry.flags, choice.rev_nat_id);
    trace(ctx, trace_cb::CB_VERDICT, verdict::TRANSLATED);
    trace(ctx, trace_cb::CB_BACKEND_ID, backend_id);
    trace(
        ctx,
        trace_cb::CB_SCOPE_FLAGS,
        choice.scope as u32 | if masquerade { trace_cb::MASQUERADED } else { 0 },
    );
    if SCTP {
        return DNAT_PENDING;
    }
    apply::<F, SCTP>(ctx, pkt, false, choice.backend_addr(), backend_port)
}
