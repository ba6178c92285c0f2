//! The egress flow filter (`lb4_ct_filter`, `lb6_ct_filter`): one byte per hashed 5-tuple that
//! says "some egress conntrack entry may have this tuple", so that the packets of flows the tc
//! programs never tracked pass egress after one array read instead of conntrack lookups that
//! miss.
//!
//! Why: the prefilter (`crate::prefilter`) passes a packet at egress as soon as one of its ends is
//! a backend's (address, port). Every packet of a connection the socket programs translated has
//! one (the client's goes to a backend, the backend's reply comes from one), so each took one or
//! two conntrack lookups that could only miss: the largest part of the egress program's cost in
//! the real stack for the node's most common traffic. Its egress entries (SNAT: client ->
//! backend; un-DNAT: backend -> client) are made by the tc programs alone, at a new flow, so the
//! programs themselves set a tuple's byte when they insert its entry (before the program returns,
//! so before any packet of the flow reaches egress), and again when `establish` moves it.
//!
//! Clearing is the agent's, after each conntrack GC pass, with two generations so that no program
//! write is ever lost: every bucket has two bytes side by side, one per generation, and a packet
//! tests both (one load). The control word says which generation the programs write. A pass
//! rewrites the other one (written by no program since the previous pass switched away from it,
//! an interval ago) to exactly the buckets of the entries it scanned, then switches the programs
//! to it. An entry the scan missed was made (or moved) after the scan began, in the generation
//! the programs wrote then, which this pass does not touch; the next pass scans it. The agent
//! activates the filter (`CONTROL_ACTIVE`) only after its first rebuild, which began after the
//! programs were attached: entries an earlier release's programs made have their bytes then.
//!
//! Layout: word 0 is the control word (byte 0: the generation the programs write, 0 or 1; byte 1:
//! 1 when the filter is active, else every packet takes the full path); words 1.. hold four
//! buckets each, two bytes per bucket (generation 0, generation 1). The agent writes through a
//! memory mapping (`BPF_F_MMAPABLE`): byte stores, which never overwrite the programs' bytes beside
//! them, as a whole-value map update would.

use crate::{
    conntrack::CtKey,
    family::Family,
    prefilter::{Fold, mix},
};

/// log2 of the buckets per family: 2^20 buckets, 2 MiB. At 100,000 tracked tuples a packet of an
/// untracked flow finds its bucket set one time in ten (and then takes the full path).
pub const BUCKETS_LOG2: u32 = 20;
pub const BUCKETS: u32 = 1 << BUCKETS_LOG2;
/// Buckets per 64-bit word (two bytes each).
pub const BUCKETS_PER_WORD: u32 = 4;
/// The array's entries: the control word and the buckets' words.
pub const WORDS: u32 = 1 + BUCKETS / BUCKETS_PER_WORD;
const _: () = assert!(BUCKETS.is_multiple_of(BUCKETS_PER_WORD));
/// The control word's index.
pub const CONTROL: u32 = 0;
/// The control word's byte holding the generation the programs write.
pub const CONTROL_GENERATION: usize = 0;
/// The control word's byte that is 1 while the filter is active.
pub const CONTROL_ACTIVE: usize = 1;

const SALT: u32 = 0x5EA0_0003;

/// The bucket of a packet's tuple (ports in host order, as in every key). The same for a
/// conntrack entry's key and the packets it rewrites at egress, whatever its `dir` and `tag`.
///
/// A tuple and its reverse are neighbours, `2k` and `2k + 1`, so in one word: a hash of the two
/// ends that is the same either way round picks the pair, and the sign of the difference of the
/// two ends' hashes (opposite either way round) picks its member. A new flow tests both of its
/// egress tuples (the reply's and the one after DNAT, `new_flow_tuples` in the programs), which
/// are each other's reverse: one cache line, one miss, rather than two in a 2 MiB array. Every bucket is still one tuple's share of the filter, so a
/// packet of an untracked flow finds its bucket set as often as before.
#[inline(always)]
pub fn bucket<F: Family>(saddr: &F::Addr, daddr: &F::Addr, sport: u16, dport: u16, proto: u8) -> u32 {
    let source = mix(saddr.fold(SALT), sport as u32);
    let destination = mix(daddr.fold(SALT), dport as u32);
    let pair = mix(source ^ destination, proto as u32);
    let pair = pair.wrapping_mul(0x85EB_CA6B) >> (32 - (BUCKETS_LOG2 - 1));
    // Without a branch (each would double the states the verifier walks after it): the sign of
    // the difference, opposite for the two orientations (unless the ends hash alike, when both
    // share one bucket: then a packet may take a lookup that misses, never skip one it needs).
    let member = source.wrapping_sub(destination) >> 31;
    pair << 1 | member
}

/// The bucket of a conntrack entry's tuple.
#[inline(always)]
pub fn key_bucket<F: Family>(key: &CtKey<F>) -> u32 {
    bucket::<F>(&key.saddr, &key.daddr, key.sport, key.dport, key.proto)
}

/// Where a bucket's two bytes are: the word, and the byte offset of its generation-0 byte in the
/// word (its generation-1 byte follows).
#[inline(always)]
pub const fn position(bucket: u32) -> (u32, u32) {
    (1 + bucket / BUCKETS_PER_WORD, (bucket % BUCKETS_PER_WORD) * 2)
}

/// Whether a bucket's word (as loaded, native order) has either generation's byte set.
#[inline(always)]
pub const fn word_has(word: u64, offset: u32) -> bool {
    (word >> (offset * 8)) & 0xFFFF != 0
}

/// The control word's fields, from the word as loaded (native order, bytes as laid out above).
#[inline(always)]
pub const fn control(word: u64) -> (bool, u32) {
    let bytes = word.to_ne_bytes();
    (bytes[CONTROL_ACTIVE] != 0, (bytes[CONTROL_GENERATION] & 1) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        conntrack::dir,
        family::{In6Addr, V4, V6},
    };

    #[test]
    fn a_key_and_its_packets_share_a_bucket_whatever_the_direction_and_tag() {
        let key = CtKey::<V4> {
            saddr: [10, 244, 1, 5],
            daddr: [192, 168, 50, 100],
            sport: 8080,
            dport: 40000,
            proto: crate::proto::TCP,
            dir: dir::EGRESS,
            tag: 7,
        };
        let b = key_bucket(&key);
        assert!(b < BUCKETS);
        assert_eq!(
            b,
            bucket::<V4>(&key.saddr, &key.daddr, 8080, 40000, crate::proto::TCP)
        );
        // The reverse tuple, another port, another protocol: other buckets (for these values).
        let reverse = bucket::<V4>(&key.daddr, &key.saddr, 40000, 8080, crate::proto::TCP);
        assert_ne!(b, reverse);
        // The reverse is the neighbour, in the same word.
        assert_eq!(b ^ 1, reverse);
        assert_eq!(position(b).0, position(reverse).0);
        assert_ne!(
            b,
            bucket::<V4>(&key.saddr, &key.daddr, 8080, 40001, crate::proto::TCP)
        );
        assert_ne!(
            b,
            bucket::<V4>(&key.saddr, &key.daddr, 8080, 40000, crate::proto::UDP)
        );
        let v6 = In6Addr::new([0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        assert!(bucket::<V6>(&v6, &v6, 1, 2, crate::proto::UDP) < BUCKETS);
    }

    #[test]
    fn client_ports_of_one_backend_spread_over_the_buckets() {
        let mut parts = [0u32; 64];
        for port in 0..64_000u16 {
            let b = bucket::<V4>(&[10, 244, 1, 5], &[10, 0, 0, 1], 8080, port, crate::proto::TCP);
            parts[(b >> (BUCKETS_LOG2 - 6)) as usize] += 1;
        }
        // 1,000 per part on average.
        assert!(parts.iter().all(|n| (800..1200).contains(n)), "{parts:?}");
    }

    #[test]
    fn every_tuple_and_its_reverse_are_neighbours_and_tuples_fill_the_buckets_evenly() {
        extern crate std;
        // 100,000 tuples of varied addresses and ports (a fixed sequence), and their reverses.
        let mut seen = std::collections::HashSet::new();
        let mut low_bits = 0u32;
        let mut x = 0x1234_5678u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        const N: u32 = 100_000;
        for _ in 0..N {
            let (s, d, ports) = (next().to_ne_bytes(), next().to_ne_bytes(), next());
            let (sp, dp) = (ports as u16, (ports >> 16) as u16);
            let b = bucket::<V4>(&s, &d, sp, dp, crate::proto::TCP);
            assert!(b < BUCKETS);
            assert_eq!(bucket::<V4>(&d, &s, dp, sp, crate::proto::TCP), b ^ 1);
            low_bits += b & 1;
            seen.insert(b);
        }
        // Which member a tuple is: half the time each.
        assert!((N * 45 / 100..N * 55 / 100).contains(&low_bits), "{low_bits}");
        // As uniform hashing would: N(1 - e^(-n/N)) distinct buckets of N = 2^20, 95,395 here.
        let expected = f64::from(BUCKETS) * (1.0 - (-f64::from(N) / f64::from(BUCKETS)).exp());
        let distinct = seen.len() as f64;
        assert!(
            (distinct - expected).abs() < expected * 0.01,
            "{distinct} vs {expected}"
        );
    }

    #[test]
    fn positions_and_words_agree() {
        assert_eq!(position(0), (1, 0));
        assert_eq!(position(3), (1, 6));
        assert_eq!(position(4), (2, 0));
        assert_eq!(position(BUCKETS - 1), (WORDS - 1, 6));
        let mut bytes = [0u8; 8];
        bytes[6 + 1] = 1; // bucket 3, generation 1
        let word = u64::from_ne_bytes(bytes);
        assert!(word_has(word, 6));
        assert!(!word_has(word, 4));
        let mut control_bytes = [0u8; 8];
        control_bytes[CONTROL_GENERATION] = 1;
        assert_eq!(control(u64::from_ne_bytes(control_bytes)), (false, 1));
        control_bytes[CONTROL_ACTIVE] = 1;
        assert_eq!(control(u64::from_ne_bytes(control_bytes)), (true, 1));
    }
}
