//! IP fragments (`lb_common::fragment`): the first fragment of a TCP or UDP datagram carries its
//! ports and is translated as any packet; it notes the ports in `lb4_frags` under what every
//! fragment of the datagram repeats (addresses, protocol, IP id). A later fragment reads them
//! back and goes the same way through conntrack, rewritten at L3 only: it has no L4 header, and
//! the first fragment's L4 checksum, which covers the whole datagram, already took every change.
//! Each program notes what it sees, so egress finds a datagram under its translated addresses.

use lb_common::{
    fragment::{FragKey, FragPorts},
    proto,
    stats::Counter,
};

use super::{
    ip::Ip,
    parse::{Flow, Packet, Parsed},
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

/// A later fragment of a datagram (`flow` without ports; `l4` where its payload starts): a
/// packet with the first fragment's ports, or [`Parsed::Fragment`] when it was not seen.
#[inline(always)]
pub(super) fn later<F: Ip>(mut flow: Flow<F>, l4: usize, id: u32) -> Parsed<F> {
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
    Parsed::L4(Packet {
        l4,
        flow,
        tcp_flags: 0,
        later_fragment: true,
    })
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
