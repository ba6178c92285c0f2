//! Maglev consistent hashing (Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load
//! Balancer", NSDI 2016, section 3.4), the lookup table for issue 17's algorithm setting: a flow
//! from outside the cluster hashed to `table[hash % M]` reaches the same backend on every node
//! that has the same endpoints, and removing one of N backends moves little more than that
//! backend's flows.
//!
//! Node independence is the point (an ECMP router may send one flow to any node), so the table
//! depends only on what every node sees alike: the backends' (address, port), put in one order
//! before the fill, the table size and a fixed seed. Backend ids, which each agent assigns, never
//! enter it; the table holds indices into the sorted backends, turned into ids when written.
//!
//! Each backend's preference list is the permutation `offset + j * skip (mod M)` of the table's
//! slots, `offset` and `skip` from a SHA-256 of the seed and its (address, port) (SHA-256: already
//! the agent's hash for names every node must compute alike). The fill goes round by round; in
//! each round every backend takes its most preferred free slot, until the table is full. With
//! equal weights every backend gets `floor(M / N)` or `ceil(M / N)` slots. Weights (EndpointSlices
//! carry none today) give a backend a turn in a round when its weight's share of the rounds so
//! far has grown past another whole turn, so its slots are proportional to its weight.

use std::net::IpAddr;

use sha2::{Digest, Sha256};

/// The table sizes allowed (primes, as Maglev requires, each about twice the one before; Cilium
/// offers the same ones). The paper's evaluation uses 65537, Cilium's default is 16381: at most
/// ~1/100 of the table per backend up to ~160 backends keeps the spread within 1%.
pub const TABLE_SIZES: [u32; 10] = [251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071];
/// The default table size (Cilium's `--bpf-lb-maglev-table-size` default).
pub const DEFAULT_TABLE_SIZE: u32 = 16381;
/// The seed every node uses unless configured otherwise: a fixed value, so every agent of every
/// release builds the same table from the same backends.
pub const DEFAULT_SEED: [u8; 16] = *b"lb-ebpf maglev/1";

/// What a scope's table is built with besides its backends: the node's
/// `--bpf-lb-maglev-table-size` and `--bpf-lb-maglev-hash-seed`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableParams {
    pub size: TableSize,
    pub seed: HashSeed,
}

/// `--bpf-lb-maglev-hash-seed` (Cilium's flag and format: 12 bytes in base64, `head -c12
/// /dev/urandom | base64 -w0`), as one word both the tables and the flow hash derive from
/// (`lb_config`'s `maglev_seed`, which the tc programs read): every node given the same seed
/// computes the same tables and hashes, and clusters with different seeds spread flows
/// differently. 0 is the fixed seed ([`DEFAULT_SEED`], the flow hash's own), which a flag never
/// yields. Of the operator's 96 bits, the tables and the hash tell apart only this word's 32
/// (Cilium derives two 32-bit jhash seeds from them; one word is what the tc flow hash takes).
/// Changing the seed moves flows between backends, as changing the table size does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HashSeed(u32);

impl HashSeed {
    /// The seed of an agent without the flag (and of every release before it).
    pub const FIXED: Self = Self(0);

    /// The seed `lb_config` names (`maglev_seed`).
    pub const fn from_word(word: u32) -> Self {
        Self(word)
    }

    /// The word `lb_config` holds for the programs.
    pub const fn word(self) -> u32 {
        self.0
    }

    /// The seed of each backend's table permutation (`lookup_table`).
    pub fn table_seed(self) -> [u8; 16] {
        if self == Self::FIXED {
            return DEFAULT_SEED;
        }
        let mut seed = *b"lb-ebpf maglev/2";
        seed[12..].copy_from_slice(&self.0.to_le_bytes());
        seed
    }
}

impl std::str::FromStr for HashSeed {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        use base64::Engine;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(s.trim())
            .map_err(|e| format!("the Maglev hash seed {s:?} is not base64: {e}"))?;
        if bytes.len() != 12 {
            return Err(format!(
                "the Maglev hash seed {s:?} is {} bytes; it must be 12 (head -c12 /dev/urandom | base64 -w0)",
                bytes.len()
            ));
        }
        let mut hash = Sha256::new();
        hash.update(b"lb-agent maglev hash seed\0");
        hash.update(&bytes);
        let digest = hash.finalize();
        let word = u32::from_le_bytes(digest[..4].try_into().expect("4 bytes"));
        // 0 is the fixed seed's word.
        Ok(Self(word.max(1)))
    }
}

/// A table size that is one of [`TABLE_SIZES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableSize(u32);

impl TableSize {
    pub fn new(m: u32) -> Result<Self, String> {
        if TABLE_SIZES.contains(&m) {
            Ok(Self(m))
        } else {
            Err(format!(
                "Maglev table size {m} is not one of the supported primes {TABLE_SIZES:?}"
            ))
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

impl Default for TableSize {
    fn default() -> Self {
        Self(DEFAULT_TABLE_SIZE)
    }
}

/// A backend as the table sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    pub addr: IpAddr,
    pub port: u16,
    /// Relative weight; 0 takes no slot. Every endpoint has weight 1 today.
    pub weight: u32,
}

/// The lookup table: for each of its `M` slots, an index into `members` as sorted by
/// [`lookup_table`] (returned alongside). Empty when no member has a weight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub members: Vec<Member>,
    pub slots: Vec<u32>,
}

/// A member's place in the permutation: its first preferred slot and its stride.
fn offset_and_skip(seed: &[u8; 16], member: &Member, m: u64) -> (u64, u64) {
    let mut hasher = Sha256::new();
    hasher.update(seed);
    match member.addr {
        IpAddr::V4(a) => hasher.update(a.octets()),
        IpAddr::V6(a) => hasher.update(a.octets()),
    }
    hasher.update(member.port.to_be_bytes());
    let digest = hasher.finalize();
    let word = |i: usize| u64::from_le_bytes(digest[i..i + 8].try_into().expect("8 bytes"));
    (word(0) % m, word(8) % (m - 1) + 1)
}

/// The next slot of a preference list: `(slot + skip) % m` for `slot, skip < m`.
#[inline]
fn step(slot: u64, skip: u64, m: u64) -> u64 {
    let next = slot + skip;
    if next >= m { next - m } else { next }
}

/// Builds the table of size `m` for `members` (in any order: they are sorted first).
pub fn lookup_table(members: &[Member], m: TableSize, seed: &[u8; 16]) -> Table {
    let mut members: Vec<Member> = members.to_vec();
    members.sort();
    members.dedup_by(|a, b| a.addr == b.addr && a.port == b.port);
    let size = u64::from(m.get());
    let weighted: Vec<usize> = (0..members.len()).filter(|i| members[*i].weight > 0).collect();
    if weighted.is_empty() {
        return Table {
            members,
            slots: Vec::new(),
        };
    }
    let max_weight = weighted
        .iter()
        .map(|i| u64::from(members[*i].weight))
        .max()
        .unwrap_or(1);
    // Per member: (the slot its list is at, skip). The list is `offset + j * skip (mod M)`;
    // stepping by `skip` with one conditional subtraction walks it without a multiply or a
    // division per step (the fill takes a few hundred thousand steps at M = 16381).
    let mut cursor: Vec<(u64, u64)> = weighted
        .iter()
        .map(|i| offset_and_skip(seed, &members[*i], size))
        .collect();
    const FREE: u32 = u32::MAX;
    let mut slots = vec![FREE; size as usize];
    let mut filled = 0u64;
    let mut round = 0u64;
    'fill: loop {
        for (k, i) in weighted.iter().enumerate() {
            let weight = u64::from(members[*i].weight);
            // A turn this round when the weight's share of rounds 0..=round passes a whole turn.
            if (round + 1) * weight / max_weight == round * weight / max_weight {
                continue;
            }
            let (slot, skip) = &mut cursor[k];
            // The first free slot on the member's list; a permutation, so one exists while any
            // slot is free.
            while slots[*slot as usize] != FREE {
                *slot = step(*slot, *skip, size);
            }
            slots[*slot as usize] = *i as u32;
            *slot = step(*slot, *skip, size);
            filled += 1;
            if filled == size {
                break 'fill;
            }
        }
        round += 1;
    }
    Table { members, slots }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn member(i: u32) -> Member {
        Member {
            addr: IpAddr::from([10, 244, (i >> 8) as u8, i as u8]),
            port: 8080,
            weight: 1,
        }
    }

    fn counts(table: &Table) -> BTreeMap<u32, usize> {
        let mut counts = BTreeMap::new();
        for s in &table.slots {
            *counts.entry(*s).or_default() += 1;
        }
        counts
    }

    /// The backend (address, port) behind each slot: what a flow hashed to it reaches.
    fn targets(table: &Table) -> Vec<(IpAddr, u16)> {
        table
            .slots
            .iter()
            .map(|s| {
                let m = table.members[*s as usize];
                (m.addr, m.port)
            })
            .collect()
    }

    #[test]
    fn only_primes_of_the_list() {
        assert!(TableSize::new(16381).is_ok());
        assert!(TableSize::new(16383).is_err());
        assert!(TableSize::new(0).is_err());
        for m in TABLE_SIZES {
            assert!(
                (2..m).take_while(|d| d * d <= m).all(|d| m % d != 0),
                "{m} is prime"
            );
        }
    }

    #[test]
    fn every_slot_is_filled_and_equal_weights_share_evenly() {
        let m = TableSize::new(251).unwrap();
        for n in [1u32, 2, 3, 7, 10, 100, 251, 300] {
            let members: Vec<Member> = (0..n).map(member).collect();
            let table = lookup_table(&members, m, &DEFAULT_SEED);
            assert_eq!(table.slots.len(), 251);
            assert!(table.slots.iter().all(|s| (*s as usize) < table.members.len()));
            let c = counts(&table);
            let (lo, hi) = (251 / n as usize, 251_usize.div_ceil(n as usize));
            assert!(
                c.values().all(|k| (lo..=hi).contains(k)),
                "{n} backends: {lo}..={hi} slots each, got {c:?}"
            );
        }
    }

    /// Every agent of every release must build the same table from the same endpoints (a rolling
    /// upgrade runs two releases side by side behind one ECMP router): the table of a fixed set is
    /// pinned here by its SHA-256.
    #[test]
    fn the_table_never_changes_across_releases() {
        let members: Vec<Member> = (0..10).map(member).collect();
        let table = lookup_table(&members, TableSize::new(1021).unwrap(), &DEFAULT_SEED);
        let mut hasher = Sha256::new();
        for (addr, port) in targets(&table) {
            hasher.update(addr.to_string());
            hasher.update(port.to_be_bytes());
        }
        let digest: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(digest, GOLDEN_TABLE);
    }

    const GOLDEN_TABLE: &str = "e4054680f54d2e79ba71eabdfd1e3096f265f3cdd8e0638c47163834be26b7e6";

    #[test]
    fn no_weight_no_table() {
        let mut members: Vec<Member> = (0..3).map(member).collect();
        for m in &mut members {
            m.weight = 0;
        }
        assert!(
            lookup_table(&members, TableSize::default(), &DEFAULT_SEED)
                .slots
                .is_empty()
        );
        assert!(
            lookup_table(&[], TableSize::default(), &DEFAULT_SEED)
                .slots
                .is_empty()
        );
    }

    #[test]
    fn weights_share_in_proportion() {
        let mut members: Vec<Member> = (0..3).map(member).collect();
        members[0].weight = 1;
        members[1].weight = 2;
        members[2].weight = 5;
        let table = lookup_table(&members, TableSize::new(16381).unwrap(), &DEFAULT_SEED);
        let c = counts(&table);
        let share = |i: u32| c[&i] as f64 / 16381.0;
        for (i, want) in [(0, 1.0 / 8.0), (1, 2.0 / 8.0), (2, 5.0 / 8.0)] {
            assert!(
                (share(i) - want).abs() < 0.01,
                "member {i}: {} vs {want}",
                share(i)
            );
        }
    }

    #[test]
    fn another_seed_is_another_table() {
        let members: Vec<Member> = (0..10).map(member).collect();
        let a = lookup_table(&members, TableSize::new(1021).unwrap(), &DEFAULT_SEED);
        let b = lookup_table(&members, TableSize::new(1021).unwrap(), b"another seed 123");
        assert_ne!(a.slots, b.slots);
    }

    /// `--bpf-lb-maglev-hash-seed`: Cilium's format, one word per seed (pinned: every node and
    /// release must derive the same one), never the fixed seed's 0; a configured seed is another
    /// table, the fixed one the table of every release before the flag.
    #[test]
    fn a_configured_seed_is_its_own_word_and_table() {
        let seed: HashSeed = "JLfvgnHc2kaSUFaI".parse().unwrap();
        assert_eq!(seed.word(), GOLDEN_SEED_WORD);
        assert_eq!(" JLfvgnHc2kaSUFaI\n".parse::<HashSeed>(), Ok(seed));
        let other: HashSeed = "AAAAAAAAAAAAAAAA".parse().unwrap();
        assert_ne!(other, seed);
        assert_ne!(other, HashSeed::FIXED);
        assert_eq!(HashSeed::from_word(seed.word()), seed);
        assert_eq!(HashSeed::default(), HashSeed::FIXED);
        assert_eq!(HashSeed::FIXED.table_seed(), DEFAULT_SEED);
        assert_ne!(seed.table_seed(), other.table_seed());
        let members: Vec<Member> = (0..10).map(member).collect();
        let m = TableSize::new(1021).unwrap();
        assert_ne!(
            lookup_table(&members, m, &seed.table_seed()).slots,
            lookup_table(&members, m, &DEFAULT_SEED).slots
        );
        for bad in ["", "not base64!", "AAAA", "JLfvgnHc2kaSUFaIAAAA"] {
            let e = bad.parse::<HashSeed>().unwrap_err();
            assert!(e.contains("Maglev hash seed"), "{bad:?}: {e}");
        }
    }

    const GOLDEN_SEED_WORD: u32 = 775_789_030;

    /// The paper's disruption figure: removing one of N backends moves its own slots and a small
    /// share of the others'. Measured here for the default size at N = 10 and 100 (printed with
    /// `--nocapture`); bounded well under the share a modulo hash would move, (N-1)/N.
    #[test]
    fn removing_a_backend_moves_little_else() {
        for n in [10u32, 100] {
            let members: Vec<Member> = (0..n).map(member).collect();
            let m = TableSize::default();
            let before = targets(&lookup_table(&members, m, &DEFAULT_SEED));
            let gone = members[3];
            let after = targets(&lookup_table(
                &members[..3]
                    .iter()
                    .chain(&members[4..])
                    .copied()
                    .collect::<Vec<_>>(),
                m,
                &DEFAULT_SEED,
            ));
            let others: Vec<usize> = (0..before.len())
                .filter(|s| before[*s] != (gone.addr, gone.port))
                .collect();
            let moved = others.iter().filter(|s| before[**s] != after[**s]).count();
            let share = moved as f64 / others.len() as f64;
            eprintln!(
                "M = {}, N = {n}: {moved} of {} slots of the remaining backends moved ({:.2}%)",
                m.get(),
                others.len(),
                share * 100.0
            );
            assert!(
                share < 0.05,
                "{n} backends: {:.2}% of the others' slots moved",
                share * 100.0
            );
            assert!(after.iter().all(|t| *t != (gone.addr, gone.port)));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Two nodes that list the same endpoints in different orders build the same table.
        #[test]
        fn the_same_endpoints_give_the_same_table_on_every_node(
            hosts in proptest::collection::btree_set((0u8..=255, 0u8..=255, prop_oneof![Just(80u16), Just(8080), 1u16..]), 1..40),
            rotate in 0usize..40,
            v6 in any::<bool>(),
        ) {
            let members: Vec<Member> = hosts
                .iter()
                .map(|(a, b, port)| Member {
                    addr: if v6 {
                        IpAddr::from([0xfd00, 0x10, 0x244, 0, 0, 0, u16::from(*a), u16::from(*b)])
                    } else {
                        IpAddr::from([10, 244, *a, *b])
                    },
                    port: *port,
                    weight: 1,
                })
                .collect();
            let mut other_order = members.clone();
            other_order.rotate_left(rotate % members.len());
            other_order.reverse();
            let m = TableSize::new(1021).unwrap();
            let a = lookup_table(&members, m, &DEFAULT_SEED);
            let b = lookup_table(&other_order, m, &DEFAULT_SEED);
            prop_assert_eq!(targets(&a), targets(&b));
        }
    }
}
