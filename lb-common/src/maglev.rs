//! Maglev consistent hashing (issue 17): the lookup tables the agent writes into `lb_maglev` and
//! the flow hash that indexes them, computed alike by the tc programs and by the agent (trace,
//! tests).
//!
//! `lb_maglev` maps a frontend's reverse-NAT id to its table, an inner array map (one Service
//! port's frontends share one) the agent builds whole and swaps in with one update, so a packet sees the old table or the new
//! one, never a mix. A table of `size` entries (a prime, the frontend entry's `backend_id` field)
//! is stored in `chunks(size)` array elements of [`LANES`] backend ids each: one map update per
//! chunk instead of one per entry, and no element padding (an array element is rounded up to 8
//! bytes; a lone `u32` would double the memory).
//!
//! The hash covers only the packet's 5-tuple and a seed every node shares (a fixed one, or the
//! word `--bpf-lb-maglev-hash-seed` gives, `DatapathConfig::maglev_seed`), so every node computes
//! the same hash for a flow and, from the same endpoints, the same table
//! (`lb-agent/src/plan/maglev.rs`): a flow an ECMP router moves to another node reaches the same
//! backend there. Words are read in memory order, which is the same on every little-endian node
//! (x86-64, arm64).

use crate::{family::Family, prefilter::Fold, user_pod};

/// Backend ids per chunk (one inner-array element: 1 KiB).
pub const LANES: usize = 256;

/// The largest table size the data path accepts (Cilium's largest, 131,071).
pub const MAX_TABLE_SIZE: u32 = 131_071;

/// The seed of [`flow_hash`] with no seed configured (word 0): fixed, the same on every node and
/// across releases.
const SEED: u32 = 0x4D41_474C; // "MAGL"

/// One element of a Maglev inner array: backend ids of table positions
/// `index * LANES .. (index + 1) * LANES`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevChunk {
    pub backend_ids: [u32; LANES],
}

impl Default for MaglevChunk {
    fn default() -> Self {
        MaglevChunk {
            backend_ids: [0; LANES],
        }
    }
}

user_pod!(MaglevChunk);

/// Elements of the inner array of a table of `size` entries.
pub const fn chunks(size: u32) -> u32 {
    size.div_ceil(LANES as u32)
}

/// Where table position `index` is: (array element, lane within it).
#[inline(always)]
pub const fn position(index: u32) -> (u32, usize) {
    (index / LANES as u32, (index % LANES as u32) as usize)
}

/// The table position of a flow: its hash modulo the table size (`size` > 0).
#[inline(always)]
pub const fn index(hash: u32, size: u32) -> u32 {
    hash % size
}

/// The flow's hash: source and destination address and port, and protocol, with the cluster's
/// seed word (`DatapathConfig::maglev_seed`; 0: the fixed seed, as before seeds could be set).
#[inline(always)]
pub fn flow_hash<F: Family>(
    seed: u32,
    saddr: &F::Addr,
    daddr: &F::Addr,
    sport: u16,
    dport: u16,
    proto: u8,
) -> u32 {
    let h = saddr.fold(SEED ^ seed);
    let h = daddr.fold(h);
    let h = crate::prefilter::mix(h, ((sport as u32) << 16) | dport as u32);
    finish(crate::prefilter::mix(h, proto as u32))
}

/// MurmurHash3's finaliser: every input bit reaches every output bit, so `hash % size` for a
/// prime `size` spreads flows evenly.
#[inline(always)]
const fn finish(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^ (h >> 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::{In6Addr, V4, V6};

    #[test]
    fn chunk_layout() {
        assert_eq!(core::mem::size_of::<MaglevChunk>(), 1024);
        assert_eq!(chunks(16_381), 64);
        assert_eq!(chunks(251), 1);
        assert_eq!(chunks(MAX_TABLE_SIZE), 512);
        assert_eq!(position(0), (0, 0));
        assert_eq!(position(257), (1, 1));
        assert_eq!(position(16_380), (63, 252));
    }

    /// The hash is part of what every node must agree on, across releases too: a change to it
    /// moves flows between backends during a rolling upgrade. These values are fixed.
    #[test]
    fn the_hash_never_changes() {
        let v4 = flow_hash::<V4>(0, &[192, 0, 2, 10], &[10, 0, 0, 1], 40_000, 30_080, 6);
        let v6 = flow_hash::<V6>(
            0,
            &In6Addr::new([0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0a]),
            &In6Addr::new([0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01]),
            40_000,
            30_080,
            17,
        );
        assert_eq!((v4, v6), (GOLDEN_V4, GOLDEN_V6));
    }

    const GOLDEN_V4: u32 = 3_669_801_132;
    const GOLDEN_V6: u32 = 2_731_057_419;

    #[test]
    fn every_field_counts() {
        let base = flow_hash::<V4>(0, &[192, 0, 2, 10], &[10, 0, 0, 1], 40_000, 80, 6);
        for other in [
            flow_hash::<V4>(0, &[192, 0, 2, 11], &[10, 0, 0, 1], 40_000, 80, 6),
            flow_hash::<V4>(0, &[192, 0, 2, 10], &[10, 0, 0, 2], 40_000, 80, 6),
            flow_hash::<V4>(0, &[192, 0, 2, 10], &[10, 0, 0, 1], 40_001, 80, 6),
            flow_hash::<V4>(0, &[192, 0, 2, 10], &[10, 0, 0, 1], 40_000, 81, 6),
            flow_hash::<V4>(0, &[192, 0, 2, 10], &[10, 0, 0, 1], 40_000, 80, 17),
            flow_hash::<V4>(1, &[192, 0, 2, 10], &[10, 0, 0, 1], 40_000, 80, 6),
        ] {
            assert_ne!(base, other);
        }
    }

    /// A configured seed moves flows over the whole table: two seeds send a flow to the same
    /// position of a 251-entry table about one time in 251, not systematically.
    #[test]
    fn another_seed_is_another_hash() {
        const SIZE: u32 = 251;
        let same = (0..=u16::MAX)
            .filter(|sport| {
                let hash = |seed| flow_hash::<V4>(seed, &[192, 0, 2, 10], &[10, 0, 0, 1], *sport, 80, 6);
                index(hash(0), SIZE) == index(hash(0x1234_5678), SIZE)
            })
            .count();
        assert!(
            same < 2 * 65_536 / SIZE as usize,
            "{same} of 65,536 flows kept their position"
        );
    }

    /// Source ports spread evenly over a prime table: no position gets more than twice its share.
    #[test]
    fn source_ports_spread_over_the_table() {
        const SIZE: u32 = 251;
        let mut hits = [0u32; SIZE as usize];
        for sport in 0..=u16::MAX {
            let h = flow_hash::<V4>(0, &[192, 0, 2, 10], &[10, 0, 0, 1], sport, 80, 6);
            hits[index(h, SIZE) as usize] += 1;
        }
        let share = 65_536 / SIZE;
        assert!(hits.iter().all(|h| *h > share / 2 && *h < share * 2), "{hits:?}");
    }
}
