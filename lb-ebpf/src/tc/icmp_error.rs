//! ICMP errors about translated flows (fragmentation needed or Packet Too Big, TTL exceeded,
//! unreachable), in either family: the quoted packet and the outer destination translated like
//! the flow, at ingress and at egress. Reading and rewriting the quote is the family's
//! (`Ip::parse_icmp_error`, `Ip::rewrite_quoted_addr`, `Ip::rewrite_outer_dst`).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use lb_common::{
    conntrack::{dir, flags as ct},
    family::Family,
    stats::Counter,
};

use super::{
    conntrack::{MARK_ID, MARK_MAGIC, lookup, marked_reply},
    ip::Ip,
    parse::{Flow, ICMP_CHECK, L4_DPORT, L4_SPORT, port_changed},
};
use crate::stats::count;

/// The embedded packet of an ICMP error: its tuple and where its fields are.
pub(super) struct Quoted<F: Family> {
    pub(super) flow: Flow<F>,
    /// Offset of the quoted IP header.
    pub(super) ip: usize,
    /// Offset of the quoted L4 header.
    pub(super) l4: usize,
    /// Offset of the ICMP header.
    pub(super) icmp: usize,
}

impl<F: Family> Quoted<F> {
    /// The quote of the ICMP error at `icmp` whose IP header (at `ip`, `hlen` bytes, no options or
    /// extension headers) says `saddr` -> `daddr` over `proto`: its ports read from the packet.
    #[inline(always)]
    pub(super) fn read(
        ctx: &TcContext,
        icmp: usize,
        ip: usize,
        hlen: usize,
        (saddr, daddr, proto): (F::Addr, F::Addr, u8),
    ) -> Option<Quoted<F>> {
        let l4 = ip + hlen;
        let ports = ctx.load::<[u8; 4]>(l4).ok()?;
        let flow = Flow {
            saddr,
            daddr,
            sport: u16::from_be_bytes([ports[0], ports[1]]),
            dport: u16::from_be_bytes([ports[2], ports[3]]),
            proto,
        };
        Some(Quoted { flow, ip, l4, icmp })
    }
}

impl<F: Family> Clone for Quoted<F> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<F: Family> Copy for Quoted<F> {}

/// Rewrites an address (`source`: the quoted source, else destination) and port of the quoted
/// packet, with the ICMP checksum (and the quoted IP checksum, where there is one). The quoted
/// L4 checksum is left alone: what a client matches is the addresses and ports.
#[inline(always)]
fn rewrite_quoted<F: Ip>(
    ctx: &TcContext,
    q: &Quoted<F>,
    source: bool,
    addr: F::Addr,
    port: u16,
) -> Result<(), ()> {
    let (old_addr, old_port, addr_off, port_off) = if source {
        (q.flow.saddr, q.flow.sport, q.ip + F::SADDR, q.l4 + L4_SPORT)
    } else {
        (q.flow.daddr, q.flow.dport, q.ip + F::DADDR, q.l4 + L4_DPORT)
    };
    if old_addr != addr {
        F::rewrite_quoted_addr(ctx, q, addr_off, old_addr, addr)?;
    }
    if old_port != port {
        port_changed(ctx, q.icmp + ICMP_CHECK, 0, old_port, port)?;
        ctx.store(port_off, &port.to_be_bytes(), 0).map_err(|_| ())?;
    }
    Ok(())
}

/// An ICMP error about a translated flow (fragmentation needed, TTL exceeded, unreachable)
/// arriving at ingress, translated back so that path MTU discovery and errors reach the host that
/// sent the packet:
/// - about a masqueraded packet (node IP:port -> backend): to the client, quoting its own source,
///   and marked so that egress puts the frontend back in the quote;
/// - about a reply this node sent as the frontend: to the backend, quoting the packet it sent;
/// - about the node's own association (node address -> backend, `local`): quoting the frontend
///   the socket called, as the replies are given it at ingress.
///
/// Not inlined (rare; a frame of its own).
#[inline(never)]
pub(super) fn icmp_error_ingress<F: Ip>(ctx: &mut TcContext, icmp: usize, outer: &Flow<F>) -> i32 {
    let Some(q) = F::parse_icmp_error(ctx, icmp) else {
        return TC_ACT_OK;
    };
    // The quoted packet went from `q.flow.saddr` to `q.flow.daddr`; the flow's entries are keyed
    // the other way round, as for a packet coming back.
    let reversed = q.flow.reversed();
    // Read in place (rare path; the frame is what is scarce).
    let (entry, local) = match lookup::<F>(&reversed.key(dir::INGRESS)) {
        Some(p) => (unsafe { &*p }, false),
        // The node's own association: its un-DNAT entry names the frontend.
        None => match lookup::<F>(&reversed.key(dir::EGRESS)) {
            Some(p) if unsafe { (*p).flags } & ct::LOCAL_CLIENT != 0 => (unsafe { &*p }, true),
            _ => return TC_ACT_OK,
        },
    };
    let result = if local {
        rewrite_quoted::<F>(ctx, &q, false, entry.nat_addr, entry.nat_port)
    } else if entry.flags & ct::REPLY != 0 {
        // Quote: node IP:port -> backend. Make it client -> backend, addressed to the client.
        ctx.set_mark(MARK_MAGIC | (entry.rev_nat_id & MARK_ID));
        rewrite_quoted::<F>(ctx, &q, true, entry.nat_addr, entry.nat_port)
            .and_then(|()| F::rewrite_outer_dst(ctx, outer, icmp, entry.nat_addr))
    } else {
        // Quote: frontend -> client (a reply we translated). Make it what the backend sent:
        // backend -> client, or backend -> node IP:port when masqueraded.
        let mut result = rewrite_quoted::<F>(ctx, &q, true, entry.nat_addr, entry.nat_port);
        if result.is_ok() && entry.flags & ct::SNAT != 0 {
            let fwd = Flow::<F> {
                saddr: q.flow.daddr,
                daddr: entry.nat_addr,
                sport: q.flow.dport,
                dport: entry.nat_port,
                proto: q.flow.proto,
            };
            result = match lookup::<F>(&fwd.key(dir::EGRESS)).map(|p| unsafe { &*p }) {
                Some(snat) => {
                    let q2 = Quoted {
                        flow: Flow {
                            saddr: entry.nat_addr,
                            sport: entry.nat_port,
                            ..q.flow
                        },
                        ..q
                    };
                    rewrite_quoted::<F>(ctx, &q2, false, snat.nat_addr, snat.nat_port)
                }
                None => Err(()),
            };
        }
        result.and_then(|()| F::rewrite_outer_dst(ctx, outer, icmp, entry.nat_addr))
    };
    match result {
        Ok(()) => {
            count(Counter::TcIcmpErrorTranslated);
            TC_ACT_OK
        }
        Err(()) => {
            count(Counter::TcRewriteFailed);
            TC_ACT_SHOT
        }
    }
}

/// An ICMP error about a translated flow leaving at egress: the quote gets the frontend back as
/// its destination, as the client called it (`mark` and `ours`: the un-SNAT mark on the packet).
/// Not inlined (rare; a frame of its own).
#[inline(never)]
pub(super) fn icmp_error_egress<F: Ip>(ctx: &mut TcContext, icmp: usize, mark: u32, ours: bool) -> i32 {
    let Some(q) = F::parse_icmp_error(ctx, icmp) else {
        return TC_ACT_OK;
    };
    // Ingress made the quote client -> backend.
    let marked = if ours {
        let found = marked_reply::<F>(
            mark,
            (q.flow.saddr, q.flow.sport),
            (q.flow.daddr, q.flow.dport),
            q.flow.proto,
        );
        match found {
            Some(_) => ctx.set_mark(0),
            None => count(Counter::TcForeignMark),
        }
        found
    } else {
        None
    };
    let target = match marked {
        Some(f) => Some((f.addr, f.port)),
        None => {
            // Quote: client -> backend. The client called the frontend.
            let reply = q.flow.reversed();
            lookup::<F>(&reply.key(dir::EGRESS))
                .map(|p| unsafe { *p })
                .filter(|e| e.flags & ct::REPLY != 0)
                .map(|e| (e.nat_addr, e.nat_port))
        }
    };
    match target {
        Some((addr, port)) => match rewrite_quoted::<F>(ctx, &q, false, addr, port) {
            Ok(()) => {
                count(Counter::TcIcmpErrorTranslated);
                TC_ACT_OK
            }
            Err(()) => {
                count(Counter::TcRewriteFailed);
                TC_ACT_SHOT
            }
        },
        None => TC_ACT_OK,
    }
}
