//! NAT as a verdict: a packet's source or destination address and port rewritten (`Ip::rewrite`
//! holds each family's checksum rules for TCP and UDP, `sctp::rewrite` SCTP's), or counted and
//! dropped when that fails.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use lb_common::{backend::BackendValue, proto, stats::Counter};

use super::{ip::Ip, parse::Packet, sctp};
use crate::stats::count;

/// The rewrite at ingress (the destination, or the un-SNATed client). `SCTP`: whether the
/// program's packets are SCTP (`lb_tc_sctp_in`) or TCP and UDP (`lb_tc_ingress`), a constant: the
/// verifier cannot tell the protocol from the parsed packet on the stack, and walking both
/// rewrites after every step took each program past its million instructions.
#[inline(always)]
pub(super) fn apply<F: Ip, const SCTP: bool>(
    ctx: &TcContext,
    pkt: &Packet<F>,
    source: bool,
    addr: F::Addr,
    port: u16,
) -> i32 {
    let rewritten = if SCTP {
        if source {
            sctp::rewrite::<F, true>(ctx, pkt, addr, port)
        } else {
            sctp::rewrite::<F, false>(ctx, pkt, addr, port)
        }
    } else {
        F::rewrite(ctx, pkt, source, addr, port)
    };
    verdict(rewritten)
}

/// The rewrite of the source at egress, any protocol: SCTP's through a BPF function of its own
/// (`sctp::rewrite_source`), whose locals `egress_of`'s frame has no room for on 5.10 and 6.1.
#[inline(always)]
pub(super) fn apply_source<F: Ip>(ctx: &TcContext, pkt: &Packet<F>, addr: F::Addr, port: u16) -> i32 {
    let rewritten = if pkt.flow.proto == proto::SCTP {
        sctp::rewrite_source::<F>(ctx, pkt, addr, port)
    } else {
        F::rewrite(ctx, pkt, true, addr, port)
    };
    verdict(rewritten)
}

/// A new SCTP flow's DNAT, after `track` (`new_flow::DNAT_PENDING`), through a BPF function of
/// its own (`sctp::rewrite_destination`).
#[inline(always)]
pub(super) fn apply_sctp_destination<F: Ip>(
    ctx: &TcContext,
    pkt: &Packet<F>,
    backend: &BackendValue<F>,
) -> i32 {
    verdict(sctp::rewrite_destination::<F>(ctx, pkt, backend))
}

#[inline(always)]
fn verdict(rewritten: Result<(), ()>) -> i32 {
    match rewritten {
        Ok(()) => TC_ACT_OK,
        Err(()) => {
            count(Counter::TcRewriteFailed);
            TC_ACT_SHOT
        }
    }
}
