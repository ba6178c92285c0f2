//! Whether a Service's new entries fit the maps, and in which order and manner its frontends
//! are written ([`Applier::plan_writes`]): make-before-break where the maps have room for the
//! transient peak, break-before-make where only the net result fits.

use lb_common::catalog;

use super::{Applier, FrontendEntries};
use crate::{
    apply::{MapOps, entries::SvcEntry},
    family::IpFamily,
    plan::Frontend,
};

/// The maps whose room `plan_writes` counts: each family's services and source-range maps have
/// a capacity of their own; `lb_aff_match` is shared.
const ROOMS: usize = 5;

fn room_name(room: usize) -> &'static str {
    match room {
        0 => IpFamily::V4.maps().services,
        1 => IpFamily::V6.maps().services,
        2 => catalog::AFFINITY_MATCH,
        3 => IpFamily::V4.maps().source_ranges,
        _ => IpFamily::V6.maps().source_ranges,
    }
}

/// The rooms of a family's services and source-range maps.
fn family_rooms(family: IpFamily) -> (usize, usize) {
    match family {
        IpFamily::V4 => (0, 3),
        IpFamily::V6 => (1, 4),
    }
}

impl<M: MapOps> Applier<M> {
    /// The order and the manner in which to write a group of frontends (one Service), or why they
    /// do not fit the maps.
    ///
    /// Make-before-break writes a frontend's new entries before it deletes its stale ones, so it
    /// transiently needs room for both: a NodePort going from externalTrafficPolicy=Local (1 + 3
    /// slots) to Cluster (5 slots) needs 4 more entries for a moment although its size does not
    /// change. The peak is what must fit, map by map, counted in write order (a frontend's
    /// deletions happen before the next frontend's writes).
    ///
    /// When the net result fits but the peak does not, the choice is between leaving the Service
    /// as it was for as long as the map stays full (a stale policy, source ranges or backends,
    /// with no end in sight) and rewriting it with a brief gap. We rewrite: the frontends whose
    /// peak does not fit are written break-before-make ([`WriteMode::BreakBeforeMake`]): their
    /// slot-0 entries are deleted first, so lookups miss the frontend exactly as if it were being
    /// removed (never a count pointing at missing slots, never a frontend without its source
    /// ranges), then the stale entries, then it is written as new. Only new connections to that
    /// frontend during those few writes are affected; established flows keep their conntrack
    /// entries, reverse-NAT id and backends. Shrinking frontends are written first then, to make
    /// room. A group whose net result does not fit is refused, as before.
    pub(super) fn plan_writes(
        &self,
        built: Vec<(Frontend, FrontendEntries)>,
    ) -> Result<Vec<(Frontend, FrontendEntries, WriteMode)>, String> {
        let deltas: Vec<[Delta; ROOMS]> = built
            .iter()
            .map(|(frontend, new)| {
                let old = self.frontends.get(frontend);
                let (services, source_ranges) = family_rooms(IpFamily::of(&frontend.addr));
                let mut d = [Delta::default(); ROOMS];
                d[services] = delta(
                    new.services.iter().map(SvcEntry::position),
                    old.into_iter()
                        .flat_map(|o| o.services.iter().map(SvcEntry::position)),
                );
                d[2] = delta(
                    new.affinity_match.iter(),
                    old.into_iter().flat_map(|o| o.affinity_match.iter()),
                );
                d[source_ranges] = delta(
                    new.source_ranges.iter(),
                    old.into_iter().flat_map(|o| o.source_ranges.iter()),
                );
                d
            })
            .collect();
        let occupancy = &self.occupancy;
        let used = [
            occupancy.services.v4,
            occupancy.services.v6,
            occupancy.affinity_match,
            occupancy.source_ranges.v4,
            occupancy.source_ranges.v6,
        ]
        .map(i64::from);
        let caps = [
            self.caps.services,
            self.caps.services,
            self.caps.affinity_match,
            self.caps.source_ranges,
            self.caps.source_ranges,
        ]
        .map(i64::from);
        // 1. Make-before-break throughout, in the usual order.
        let mut running = used;
        let mut fits = true;
        for d in &deltas {
            for m in 0..ROOMS {
                fits &= running[m] + d[m].added <= caps[m];
                running[m] += d[m].net();
            }
        }
        if fits {
            return Ok(built
                .into_iter()
                .map(|(f, e)| (f, e, WriteMode::MakeBeforeBreak))
                .collect());
        }
        // 2. Shrinking frontends first; break-before-make where the peak does not fit. A frontend
        //    written break-before-make never holds more than max(before, after) entries.
        let mut order: Vec<usize> = (0..built.len()).collect();
        order.sort_by_key(|&i| deltas[i][0].net() + deltas[i][1].net());
        let mut running = used;
        let mut modes = vec![WriteMode::MakeBeforeBreak; built.len()];
        let mut peak = used;
        for &i in &order {
            let d = &deltas[i];
            if (0..ROOMS).any(|m| running[m] + d[m].added > caps[m]) {
                modes[i] = WriteMode::BreakBeforeMake;
            }
            for m in 0..ROOMS {
                running[m] += d[m].net();
                peak[m] = peak[m].max(running[m]);
            }
        }
        if let Some(m) = (0..ROOMS).find(|&m| peak[m] > caps[m]) {
            return Err(format!(
                "map {} is full ({} of {} entries used, {} more needed)",
                room_name(m),
                used[m],
                caps[m],
                peak[m] - used[m]
            ));
        }
        let mut built: Vec<Option<(Frontend, FrontendEntries)>> = built.into_iter().map(Some).collect();
        Ok(order
            .into_iter()
            .filter_map(|i| built[i].take().map(|(f, e)| (f, e, modes[i])))
            .collect())
    }
}

/// How a frontend is rewritten (see [`Applier::plan_writes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WriteMode {
    /// New entries first, slot 0 last, then the stale ones: lookups see the old or the new
    /// frontend, never a gap; needs room for both for a moment.
    MakeBeforeBreak,
    /// Slot 0 and the stale entries first, then the new ones: lookups miss the frontend for a
    /// moment; needs no more room than the larger of the old and new frontend.
    BreakBeforeMake,
}

/// How one frontend changes the entry count of one map.
#[derive(Clone, Copy, Debug, Default)]
struct Delta {
    /// Keys the new entries have and the old ones do not.
    added: i64,
    /// Keys the old entries have and the new ones do not.
    removed: i64,
}

impl Delta {
    fn net(self) -> i64 {
        self.added - self.removed
    }
}

/// Counts the keys only in `new` (added) and only in `old` (removed), from two sorted sequences.
fn delta<K: Ord>(new: impl Iterator<Item = K>, old: impl Iterator<Item = K>) -> Delta {
    let (mut new, mut old) = (new.peekable(), old.peekable());
    let mut d = Delta::default();
    loop {
        let step = match (new.peek(), old.peek()) {
            (Some(a), Some(b)) => a.cmp(b),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => return d,
        };
        match step {
            std::cmp::Ordering::Less => {
                d.added += 1;
                new.next();
            }
            std::cmp::Ordering::Greater => {
                d.removed += 1;
                old.next();
            }
            std::cmp::Ordering::Equal => {
                new.next();
                old.next();
            }
        }
    }
}
