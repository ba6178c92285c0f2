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

/// A packet at ingress to `daddr` may be a frontend's new flow, a tracked flow, a reply to a
/// masqueraded one, or a flow the cluster-ips-check refuses (an address of a Service CIDR, which
/// has no bit: `lb_common::cluster_ip`'s covering prefixes say so by arithmetic).
#[inline(always)]
pub(super) fn ingress<F: FamilyMaps>(daddr: &F::Addr) -> bool {
    !active()
        || is_set::<F>(prefilter::ingress_bit::<F>(daddr))
        || F::service_ranges().get(0).is_some_and(|r| r.may_contain(daddr))
}

/// Whether `end` ((address, port), the source or the destination of a packet at egress) may be a
/// backend's: a packet on a tracked flow has one end that is.
#[inline(always)]
pub(super) fn egress_end<F: FamilyMaps>(end: (&F::Addr, u16)) -> bool {
    !active() || is_set::<F>(prefilter::egress_bit::<F>(end.0, end.1))
}
