//! NAT as a verdict: a packet's source or destination address and port rewritten (`Ip::rewrite`
//! holds each family's checksum rules), or counted and dropped when that fails.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use lb_common::stats::Counter;

use super::{ip::Ip, parse::Packet};
use crate::stats::count;

#[inline(always)]
pub(super) fn apply<F: Ip>(ctx: &TcContext, pkt: &Packet<F>, source: bool, addr: F::Addr, port: u16) -> i32 {
    match F::rewrite(ctx, pkt, source, addr, port) {
        Ok(()) => TC_ACT_OK,
        Err(()) => {
            count(Counter::TcRewriteFailed);
            TC_ACT_SHOT
        }
    }
}
