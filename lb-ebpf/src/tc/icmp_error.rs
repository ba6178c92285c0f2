//! ICMP errors about translated flows (fragmentation needed, TTL exceeded, unreachable): the
//! quoted packet and the outer destination translated like the flow, at ingress and at egress.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use lb_common::{
    conntrack::{dir, flags as ct},
    proto,
    stats::Counter,
};
use network_types::ip::Ipv4Hdr;

use super::{
    conntrack::{MARK_ID, MARK_MAGIC, marked_reply},
    ipv4::{
        self, ICMP_CHECK, ICMP_DEST_UNREACH, ICMP_PARAMETER_PROBLEM, ICMP_TIME_EXCEEDED, IP_CHECK, IP_DADDR,
        IP_SADDR, csum_fold,
    },
    parse::{ETH_HLEN, Flow, L4_DPORT, L4_SPORT},
};
use crate::{maps::CONNTRACK, stats::count};

/// The embedded packet of an ICMP error: its tuple and where its fields are.
struct Quoted {
    flow: Flow,
    /// Offset of the quoted IP header.
    ip: usize,
    /// Offset of the quoted L4 header.
    l4: usize,
    /// Offset of the ICMP header.
    icmp: usize,
}

#[inline(always)]
fn parse_icmp_error(ctx: &TcContext, icmp: usize) -> Option<Quoted> {
    // ICMP errors are rare: read them through helpers, whatever the offsets.
    let header = ctx.load::<[u8; ipv4::ICMP_HLEN]>(icmp).ok()?;
    if !matches!(
        header[0],
        ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM
    ) {
        return None;
    }
    let ip_off = icmp + ipv4::ICMP_HLEN;
    let inner = ctx.load::<Ipv4Hdr>(ip_off).ok()?;
    if inner.vihl != ipv4::VIHL_NO_OPTIONS || (inner.proto != proto::TCP && inner.proto != proto::UDP) {
        return None;
    }
    let l4 = ip_off + ipv4::HLEN;
    let ports = ctx.load::<[u8; 4]>(l4).ok()?;
    let flow = Flow {
        saddr: inner.src_addr,
        daddr: inner.dst_addr,
        sport: u16::from_be_bytes([ports[0], ports[1]]),
        dport: u16::from_be_bytes([ports[2], ports[3]]),
        proto: inner.proto,
    };
    Some(Quoted {
        flow,
        ip: ip_off,
        l4,
        icmp,
    })
}

/// Rewrites an address (`source`: the quoted source, else destination) and port of the quoted
/// packet, fixing the quoted IP checksum and the ICMP checksum (which covers the quote). The
/// quoted L4 checksum is left alone: receivers do not check it, and it is usually cut off.
#[inline(always)]
fn rewrite_quoted(ctx: &TcContext, q: &Quoted, source: bool, addr: [u8; 4], port: u16) -> Result<(), ()> {
    let (old_addr, old_port, addr_off, port_off) = if source {
        (q.flow.saddr, q.flow.sport, q.ip + IP_SADDR, q.l4 + L4_SPORT)
    } else {
        (q.flow.daddr, q.flow.dport, q.ip + IP_DADDR, q.l4 + L4_DPORT)
    };
    let icmp_csum = q.icmp + ICMP_CHECK;
    if old_addr != addr {
        let old_check = ctx.load::<[u8; 2]>(q.ip + IP_CHECK).map_err(|_| ())?;
        let old_check = u16::from_be_bytes(old_check);
        // RFC 1624: HC' = ~(~HC + ~m + m').
        let mut sum = (!old_check) as u32;
        sum += (!u16::from_be_bytes([old_addr[0], old_addr[1]])) as u32
            + (!u16::from_be_bytes([old_addr[2], old_addr[3]])) as u32;
        sum += u16::from_be_bytes([addr[0], addr[1]]) as u32 + u16::from_be_bytes([addr[2], addr[3]]) as u32;
        let new_check = csum_fold(sum);
        let (from, to) = (
            u32::from_ne_bytes(old_addr) as u64,
            u32::from_ne_bytes(addr) as u64,
        );
        ctx.l4_csum_replace(icmp_csum, from, to, 4).map_err(|_| ())?;
        ctx.l4_csum_replace(icmp_csum, old_check.to_be() as u64, new_check.to_be() as u64, 2)
            .map_err(|_| ())?;
        ctx.store(addr_off, &addr, 0).map_err(|_| ())?;
        ctx.store(q.ip + IP_CHECK, &new_check.to_be_bytes(), 0)
            .map_err(|_| ())?;
    }
    if old_port != port {
        ctx.l4_csum_replace(icmp_csum, old_port.to_be() as u64, port.to_be() as u64, 2)
            .map_err(|_| ())?;
        ctx.store(port_off, &port.to_be_bytes(), 0).map_err(|_| ())?;
    }
    Ok(())
}

/// Rewrites the outer destination of an ICMP error (the IP checksum only: ICMP has no pseudo
/// header).
#[inline(always)]
fn rewrite_outer_dst(ctx: &TcContext, outer: &Flow, addr: [u8; 4]) -> Result<(), ()> {
    if outer.daddr == addr {
        return Ok(());
    }
    let (from, to) = (
        u32::from_ne_bytes(outer.daddr) as u64,
        u32::from_ne_bytes(addr) as u64,
    );
    ctx.l3_csum_replace(ETH_HLEN + IP_CHECK, from, to, 4)
        .map_err(|_| ())?;
    ctx.store(ETH_HLEN + IP_DADDR, &addr, 0).map_err(|_| ())
}

/// An ICMP error about a translated flow (fragmentation needed, TTL exceeded, unreachable)
/// arriving at ingress, translated back so that path MTU discovery and errors reach the host that
/// sent the packet:
/// - about a masqueraded packet (node IP:port -> backend): to the client, quoting its own source,
///   and marked so that egress puts the frontend back in the quote;
/// - about a reply this node sent as the frontend: to the backend, quoting the packet it sent.
#[inline(always)]
pub(super) fn icmp_error_ingress(ctx: &mut TcContext, icmp: usize, outer: &Flow) -> i32 {
    let Some(q) = parse_icmp_error(ctx, icmp) else {
        return TC_ACT_OK;
    };
    // The quoted packet went from `q.flow.saddr` to `q.flow.daddr`; the flow's entries are keyed
    // the other way round, as for a packet coming back.
    let reversed = Flow {
        saddr: q.flow.daddr,
        daddr: q.flow.saddr,
        sport: q.flow.dport,
        dport: q.flow.sport,
        proto: q.flow.proto,
    };
    let Some(entry) = CONNTRACK
        .get_ptr(&reversed.key(dir::INGRESS))
        .map(|p| unsafe { *p })
    else {
        return TC_ACT_OK;
    };
    let result = if entry.flags & ct::REPLY != 0 {
        // Quote: node IP:port -> backend. Make it client -> backend, addressed to the client.
        ctx.set_mark(MARK_MAGIC | (entry.rev_nat_id & MARK_ID));
        rewrite_quoted(ctx, &q, true, entry.nat_addr, entry.nat_port)
            .and_then(|()| rewrite_outer_dst(ctx, outer, entry.nat_addr))
    } else {
        // Quote: frontend -> client (a reply we translated). Make it what the backend sent:
        // backend -> client, or backend -> node IP:port when masqueraded.
        let mut result = rewrite_quoted(ctx, &q, true, entry.nat_addr, entry.nat_port);
        if result.is_ok() && entry.flags & ct::SNAT != 0 {
            let fwd = Flow {
                saddr: q.flow.daddr,
                daddr: entry.nat_addr,
                sport: q.flow.dport,
                dport: entry.nat_port,
                proto: q.flow.proto,
            };
            result = match CONNTRACK.get_ptr(&fwd.key(dir::EGRESS)).map(|p| unsafe { *p }) {
                Some(snat) => {
                    let q2 = Quoted {
                        flow: Flow {
                            saddr: entry.nat_addr,
                            sport: entry.nat_port,
                            ..q.flow
                        },
                        ..q
                    };
                    rewrite_quoted(ctx, &q2, false, snat.nat_addr, snat.nat_port)
                }
                None => Err(()),
            };
        }
        result.and_then(|()| rewrite_outer_dst(ctx, outer, entry.nat_addr))
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
#[inline(always)]
pub(super) fn icmp_error_egress(ctx: &mut TcContext, icmp: usize, mark: u32, ours: bool) -> i32 {
    let Some(q) = parse_icmp_error(ctx, icmp) else {
        return TC_ACT_OK;
    };
    // Ingress made the quote client -> backend.
    let marked = if ours {
        let found = marked_reply(
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
            let reply = Flow {
                saddr: q.flow.daddr,
                daddr: q.flow.saddr,
                sport: q.flow.dport,
                dport: q.flow.sport,
                proto: q.flow.proto,
            };
            CONNTRACK
                .get_ptr(&reply.key(dir::EGRESS))
                .map(|p| unsafe { *p })
                .filter(|e| e.flags & ct::REPLY != 0)
                .map(|e| (e.nat_addr, e.nat_port))
        }
    };
    match target {
        Some((addr, port)) => match rewrite_quoted(ctx, &q, false, addr, port) {
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
