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

/// A packet at ingress to `daddr` may be a frontend's new flow, a tracked flow or a reply to a
/// masqueraded one.
#[inline(always)]
pub(super) fn ingress<F: FamilyMaps>(daddr: &F::Addr) -> bool {
    !active() || is_set::<F>(prefilter::ingress_bit::<F>(daddr))
}

/// A packet at egress from `src` to `dst` ((address, port) each) may be on a tracked flow: one of
/// them is a backend's.
#[inline(always)]
pub(super) fn egress<F: FamilyMaps>(src: (&F::Addr, u16), dst: (&F::Addr, u16)) -> bool {
    !active()
        || is_set::<F>(prefilter::egress_bit::<F>(src.0, src.1))
        || is_set::<F>(prefilter::egress_bit::<F>(dst.0, dst.1))
}
