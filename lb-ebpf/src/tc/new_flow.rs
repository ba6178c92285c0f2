//! A new flow at ingress: frontend lookup, loadBalancerSourceRanges, REJECT or DROP of a frontend
//! without endpoints, backend selection, the masquerade decision, and the flow's conntrack
//! entries.

use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT},
    helpers::bpf_get_prandom_u32,
    programs::TcContext,
};
use lb_common::{
    affinity::kind,
    conntrack::{Ct4Value, dir, flags as ct},
    service::flags,
    stats::Counter,
    trace::{tc as trace_cb, verdict},
};

use super::{
    conntrack::now_ns,
    nat::apply,
    parse::{Flow, Packet},
    reject::reject,
    snat::reserve_snat_port,
};
use crate::{
    lb::{self, Frontend},
    maps::CONNTRACK,
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

/// A TCP/UDP packet at ingress that no conntrack entry keeps: a frontend's new flow is DNATed
/// (and masqueraded when kube-proxy would), rejected or dropped; anything else passes.
#[inline(always)]
pub(super) fn new_flow(ctx: &mut TcContext, pkt: &Packet) -> i32 {
    let flow = pkt.flow;
    let cfg = lb::datapath_config();
    // kube-proxy's local-traffic detector: pods (sources in the cluster CIDR) short-circuit a
    // Local-policy external frontend to the cluster-wide endpoints, and are not masqueraded when
    // they reach a cluster IP.
    let from_pod = cfg.is_pod_address(flow.saddr) == Some(true);
    let (key, frontend) = match lb::lookup_frontend(flow.daddr, flow.dport, flow.proto, from_pod) {
        Frontend::None => return TC_ACT_OK,
        Frontend::Incomplete => {
            count(Counter::TcNoBackend);
            return TC_ACT_OK;
        }
        Frontend::Found(key, entry) => (key, entry),
    };
    trace(ctx, trace_cb::CB_REV_NAT_ID, frontend.rev_nat_id);
    trace(ctx, trace_cb::CB_FRONTEND_FLAGS, frontend.flags as u32);
    trace(ctx, trace_cb::CB_SCOPE_FLAGS, key.scope as u32);

    if frontend.has(flags::SOURCE_RANGES) && !lb::source_in_ranges(&frontend, flow.saddr) {
        count(Counter::SourceRangeDenied);
        trace(ctx, trace_cb::CB_VERDICT, verdict::DROP);
        return TC_ACT_SHOT;
    }
    if frontend.count == 0 {
        if frontend.has(flags::DROP_IF_EMPTY) {
            count(Counter::TcDropped);
            trace(ctx, trace_cb::CB_VERDICT, verdict::DROP);
            return TC_ACT_SHOT;
        }
        count(Counter::TcRejected);
        trace(ctx, trace_cb::CB_VERDICT, verdict::REJECT);
        return reject(ctx, pkt);
    }

    let now = now_ns();
    let client = u32::from_ne_bytes(flow.saddr) as u64;
    let hash = unsafe { bpf_get_prandom_u32() };
    let Some((backend_id, backend)) = lb::select_backend(&key, &frontend, client, kind::ADDR, hash, now)
    else {
        count(Counter::TcNoBackend);
        return TC_ACT_OK;
    };
    // A backend at this node's own address (a hostNetwork endpoint) is delivered locally: the
    // packet never reaches egress, where masquerading happens. As with kube-proxy, whose
    // POSTROUTING MASQUERADE never sees a locally delivered packet, it keeps the client's address
    // and its replies get the frontend back on their way out.
    let local_backend = backend.addr == cfg.snat_addr;
    let mut masquerade = !local_backend
        && (frontend.has(flags::MASQUERADE)
            || (frontend.has(flags::MASQUERADE_OFF_CLUSTER) && !from_pod)
            // Hairpin: the reply must come back through this node to be translated.
            || backend.addr == flow.saddr);

    let base = Ct4Value {
        created_ns: now,
        last_seen_ns: now,
        nat_addr: [0; 4],
        nat_port: 0,
        flags: 0,
        rev_nat_id: frontend.rev_nat_id,
        backend_id,
    };
    let reply_tuple = Flow {
        saddr: backend.addr,
        daddr: flow.saddr,
        sport: backend.port,
        dport: flow.sport,
        proto: flow.proto,
    };
    // The tuple this flow has on the wire after DNAT; egress masquerades it when it carries an
    // SNAT entry.
    let fwd_after_dnat = Flow {
        saddr: flow.saddr,
        daddr: backend.addr,
        sport: flow.sport,
        dport: backend.port,
        proto: flow.proto,
    };
    if !masquerade {
        // Replies (backend -> client) get the frontend back as their source on the way out. If a
        // live flow already owns that tuple (the same client port to two frontends with a shared
        // backend), masquerade this one so both stay unambiguous.
        let undnat = Ct4Value {
            nat_addr: flow.daddr,
            nat_port: flow.dport,
            flags: ct::REPLY,
            ..base
        };
        let key = reply_tuple.key(dir::EGRESS);
        match CONNTRACK.insert(&key, &undnat, BPF_NOEXIST as u64) {
            Ok(()) => {}
            Err(e) if e as i64 == -EEXIST => {
                let same = CONNTRACK
                    .get_ptr(&key)
                    .map(|p| unsafe { *p })
                    .is_some_and(|old| old.nat_addr == flow.daddr && old.nat_port == flow.dport);
                if same {
                    let _ = CONNTRACK.insert(&key, &undnat, 0);
                } else {
                    masquerade = true;
                }
            }
            Err(_) => {
                count(Counter::TcCtInsertFailed);
                return TC_ACT_SHOT;
            }
        }
    }
    if !masquerade {
        // An earlier masqueraded flow from this client port to this backend through another
        // frontend leaves an SNAT entry for the same post-DNAT tuple; left in place it would
        // masquerade this flow too and its replies would go back as the wrong frontend. Egress
        // cannot tell two such flows apart, so the newest owns the tuple.
        let _ = CONNTRACK.remove(&fwd_after_dnat.key(dir::EGRESS));
    }
    if masquerade {
        let Some(port) = reserve_snat_port(&cfg, &reply_tuple, &flow, &base) else {
            count(Counter::TcSnatPortsExhausted);
            return TC_ACT_SHOT;
        };
        let snat = Ct4Value {
            nat_addr: cfg.snat_addr,
            nat_port: port,
            flags: ct::SNAT,
            ..base
        };
        if CONNTRACK
            .insert(&fwd_after_dnat.key(dir::EGRESS), &snat, 0)
            .is_err()
        {
            count(Counter::TcCtInsertFailed);
            return TC_ACT_SHOT;
        }
        count(Counter::TcMasqueraded);
    }
    let mut fwd_flags = if masquerade { ct::SNAT } else { 0 };
    if backend.addr == flow.saddr {
        fwd_flags |= ct::HAIRPIN;
    }
    let dnat = Ct4Value {
        nat_addr: backend.addr,
        nat_port: backend.port,
        flags: fwd_flags,
        ..base
    };
    if CONNTRACK.insert(&flow.key(dir::INGRESS), &dnat, 0).is_err() {
        count(Counter::TcCtInsertFailed);
        return TC_ACT_SHOT;
    }
    count(Counter::TcNewFlow);
    trace(ctx, trace_cb::CB_VERDICT, verdict::TRANSLATED);
    trace(ctx, trace_cb::CB_BACKEND_ID, backend_id);
    trace(
        ctx,
        trace_cb::CB_SCOPE_FLAGS,
        key.scope as u32 | if masquerade { trace_cb::MASQUERADED } else { 0 },
    );
    apply(ctx, pkt, false, backend.addr, backend.port)
}
