//! The prefilter (`lb_common::prefilter`): whether a packet may concern the programs at all, from
//! one bit of an array, before any hash lookup.

use lb_common::{config::flags, prefilter};

use crate::{family::FamilyMaps, lb};

/// Whether `bit` is set; a word that cannot be read counts as set (the full path decides).
#[inline(always)]
fn is_set<F: FamilyMaps>(bit: u32) -> bool {
    let (word, mask) = prefilter::word_of(bit);
    F::prefilter().get(word).is_none_or(|w| *w & mask != 0)
}

/// Whether the agent has completed the bits (before that, every packet takes the full path).
#[inline(always)]
fn active() -> bool {
    lb::datapath_config().flags & flags::PREFILTER != 0
}

/// A packet with ports at ingress to (`daddr`, `dport`) may be a frontend's new flow, a tracked
/// flow (keyed by its frontend's address and port), a reply to a masqueraded one (to a masquerade
/// address, on a masquerade port), or a flow the cluster-ips-check refuses (an address of a
/// Service CIDR, which has no bit: `lb_common::cluster_ip`'s covering prefixes say so by
/// arithmetic). The port's bit is in the address bit's cache line and tested only after it:
/// traffic to addresses no frontend has reads one line, as before port bits.
#[inline(always)]
pub(super) fn ingress<F: FamilyMaps>(daddr: &F::Addr, dport: u16) -> bool {
    if !active() {
        return true;
    }
    let address = prefilter::ingress_bit::<F>(daddr);
    (is_set::<F>(address) && (is_masquerade_port(dport) || port_is_set::<F>(address, dport)))
        || in_service_range::<F>(daddr)
}

/// The port's bit: inline for IPv4; a BPF function of its own for IPv6, whose `ingress_of` frame
/// has no 8 bytes to spare for the bit's shift kept across the lookup (5.10 and 6.1 round each
/// frame of a call chain up to 32 bytes and allow 512 in all; `ingress_of::<V6>` and `track`
/// use them to the byte).
#[inline(always)]
fn port_is_set<F: FamilyMaps>(address: u32, dport: u16) -> bool {
    if F::BITS == 32 {
        is_set::<F>(prefilter::ingress_port_bit(address, dport))
    } else {
        port_is_set_out_of_line::<F>(address, dport)
    }
}

#[inline(never)]
fn port_is_set_out_of_line<F: FamilyMaps>(address: u32, dport: u16) -> bool {
    is_set::<F>(prefilter::ingress_port_bit(address, dport))
}

/// Read again where needed rather than kept from `active`: a register held across the map
/// lookups would be spilled, and IPv6's `ingress_of` frame has no room to spare (5.10 and 6.1
/// allow its call chain 512 bytes).
#[inline(always)]
fn is_masquerade_port(port: u16) -> bool {
    let cfg = lb::datapath_config();
    prefilter::is_masquerade_port(port, cfg.snat_port_min, cfg.snat_port_max)
}

/// A later fragment at ingress (no ports) to `daddr`: [`ingress`] on the address alone.
#[inline(always)]
pub(super) fn ingress_address<F: FamilyMaps>(daddr: &F::Addr) -> bool {
    !active() || is_set::<F>(prefilter::ingress_bit::<F>(daddr)) || in_service_range::<F>(daddr)
}

#[inline(always)]
fn in_service_range<F: FamilyMaps>(daddr: &F::Addr) -> bool {
    F::service_ranges().get(0).is_some_and(|r| r.may_contain(daddr))
}

/// Whether `end` ((address, port), the source or the destination of a packet at egress) may be a
/// backend's: a packet on a tracked flow has one end that is.
#[inline(always)]
pub(super) fn egress_end<F: FamilyMaps>(end: (&F::Addr, u16)) -> bool {
    !active() || is_set::<F>(prefilter::egress_bit::<F>(end.0, end.1))
}
