//! The egress flow filter's agent side (`lb_common::ct_filter`, maps `lb4_ct_filter`,
//! `lb6_ct_filter`): after each conntrack GC pass, the generation the programs do not write is
//! rewritten to exactly the buckets of the egress entries the pass scanned, the programs are
//! switched to it, and the filter is active from the first such rebuild on. The agent deactivates
//! it at start, before its programs are attached: entries made meanwhile by programs that did not
//! set bytes (an earlier release's) get theirs at the first rebuild.
//!
//! The map is memory-mapped for each use: the agent's writes are byte stores, which never
//! overwrite the bytes the programs set beside them (a map update writes a whole 8-byte value).

use std::{
    io,
    os::fd::AsFd,
    ptr::NonNull,
    sync::atomic::{AtomicU8, Ordering},
};

use aya::maps::{Map, MapData};
use lb_common::{
    conntrack::{CtKey, dir},
    ct_filter::{self, BUCKETS, CONTROL_ACTIVE, CONTROL_GENERATION, WORDS},
    family::Family,
};

/// The buckets a GC pass found egress entries in, one bit each.
#[derive(Clone, Debug)]
pub struct FlowBuckets(Vec<u64>);

impl Default for FlowBuckets {
    fn default() -> Self {
        Self(vec![0; (BUCKETS / 64) as usize])
    }
}

impl FlowBuckets {
    /// Notes a conntrack entry: an egress one needs its bucket (ingress entries are never looked
    /// up at egress through the filter).
    pub fn note<F: Family>(&mut self, key: &CtKey<F>) {
        if key.dir == dir::EGRESS {
            self.insert(ct_filter::key_bucket(key));
        }
    }

    pub fn insert(&mut self, bucket: u32) {
        self.0[(bucket / 64) as usize] |= 1 << (bucket % 64);
    }

    pub fn contains(&self, bucket: u32) -> bool {
        self.0[(bucket / 64) as usize] & (1 << (bucket % 64)) != 0
    }

    pub fn len(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Both families' buckets, from one GC pass.
#[derive(Clone, Debug, Default)]
pub struct Tracked {
    pub v4: FlowBuckets,
    pub v6: FlowBuckets,
}

/// What a rebuild did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rebuilt {
    /// The generation rewritten, which the programs write from now on.
    pub generation: u32,
    /// Buckets set in it / cleared in it.
    pub set: u32,
    pub cleared: u32,
    /// Buckets it holds now.
    pub held: u32,
    /// Whether the filter was on before (off: this rebuild turned it on).
    pub was_active: bool,
}

/// The byte index of `bucket`'s byte of `generation` in the array's memory.
fn byte_of(bucket: u32, generation: u32) -> usize {
    let (word, offset) = ct_filter::position(bucket);
    (word * 8 + offset + generation) as usize
}

/// The filter's logic over its memory (the mapped array, or a test's bytes).
pub fn rebuild_bytes(bytes: &[AtomicU8], tracked: &FlowBuckets) -> Rebuilt {
    let (was_active, current) = control_bytes(bytes);
    let generation = 1 - current;
    let mut rebuilt = Rebuilt {
        generation,
        was_active,
        ..Default::default()
    };
    for bucket in 0..BUCKETS {
        let byte = &bytes[byte_of(bucket, generation)];
        let want = tracked.contains(bucket);
        let has = byte.load(Ordering::Relaxed) != 0;
        match (has, want) {
            (false, true) => {
                byte.store(1, Ordering::Relaxed);
                rebuilt.set += 1;
            }
            (true, false) => {
                byte.store(0, Ordering::Relaxed);
                rebuilt.cleared += 1;
            }
            _ => {}
        }
        rebuilt.held += u32::from(want);
    }
    // The rewritten generation complete before the programs write it and the filter trusts it.
    std::sync::atomic::fence(Ordering::Release);
    bytes[CONTROL_GENERATION].store(generation as u8, Ordering::Release);
    bytes[CONTROL_ACTIVE].store(1, Ordering::Release);
    rebuilt
}

/// Whether the filter is active, and the generation the programs write.
pub fn control_bytes(bytes: &[AtomicU8]) -> (bool, u32) {
    (
        bytes[CONTROL_ACTIVE].load(Ordering::Acquire) != 0,
        u32::from(bytes[CONTROL_GENERATION].load(Ordering::Acquire) & 1),
    )
}

/// One family's filter map, memory-mapped only while the agent reads or writes it (a rebuild
/// after each GC pass, start-up, `lb-agent stats`): the kernel maps all of the map's pages at
/// `mmap`, so a mapping kept open counted its 2 MiB in the agent's resident set for good.
pub struct CtFilter {
    map: MapData,
}

/// The map's memory, mapped for one use; unmapped on drop.
struct Mapping {
    region: NonNull<AtomicU8>,
    len: usize,
}

impl Mapping {
    fn bytes(&self) -> &[AtomicU8] {
        // SAFETY: `len` bytes mapped for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.region.as_ptr(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `CtFilter::mapped`.
        unsafe { libc::munmap(self.region.as_ptr().cast(), self.len) };
    }
}

impl CtFilter {
    /// Over `map` (an array of `ct_filter::WORDS` 64-bit words created with `BPF_F_MMAPABLE`),
    /// checked by mapping it once.
    pub fn new(map: Map) -> io::Result<Self> {
        let Map::Array(map) = map else {
            return Err(io::Error::other("the flow filter map is not an array"));
        };
        let filter = Self { map };
        filter.mapped()?;
        Ok(filter)
    }

    fn mapped(&self) -> io::Result<Mapping> {
        let len = (WORDS as usize * 8).next_multiple_of(page_size());
        // SAFETY: a shared mapping of the map's memory, which the kernel sizes to whole pages;
        // unmapped when the `Mapping` drops.
        let region = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&self.map.fd().as_fd()),
                0,
            )
        };
        if region == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("cannot map the flow filter (a map created without BPF_F_MMAPABLE?): {e}"),
            ));
        }
        Ok(Mapping {
            region: NonNull::new(region.cast()).expect("mmap returned a pointer"),
            len,
        })
    }

    /// Every packet takes the full path until the next rebuild.
    pub fn deactivate(&self) -> io::Result<()> {
        self.mapped()?.bytes()[CONTROL_ACTIVE].store(0, Ordering::Release);
        Ok(())
    }

    pub fn rebuild(&self, tracked: &FlowBuckets) -> io::Result<Rebuilt> {
        Ok(rebuild_bytes(self.mapped()?.bytes(), tracked))
    }

    pub fn control(&self) -> io::Result<(bool, u32)> {
        Ok(control_bytes(self.mapped()?.bytes()))
    }

    /// Whether `bucket` holds either generation's byte.
    pub fn holds(&self, bucket: u32) -> io::Result<bool> {
        Ok(held_bytes(self.mapped()?.bytes(), bucket))
    }

    /// The buckets holding either generation's byte now (`lb-agent inspect stats`).
    pub fn held_buckets(&self) -> io::Result<u32> {
        let mapping = self.mapped()?;
        let bytes = mapping.bytes();
        Ok((0..BUCKETS).map(|b| u32::from(held_bytes(bytes, b))).sum())
    }
}

/// Whether `bucket` holds either generation's byte.
fn held_bytes(bytes: &[AtomicU8], bucket: u32) -> bool {
    (0..2).any(|g| bytes[byte_of(bucket, g)].load(Ordering::Relaxed) != 0)
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096).max(4096)
}

/// Both families' filters.
pub struct CtFilters {
    pub v4: CtFilter,
    pub v6: CtFilter,
}

impl CtFilters {
    pub fn deactivate(&self) -> io::Result<()> {
        self.v4.deactivate()?;
        self.v6.deactivate()
    }

    /// Rebuilds both from one GC pass's buckets (`Tracked`); see the module doc.
    pub fn rebuild(&self, tracked: &Tracked) -> io::Result<[Rebuilt; 2]> {
        Ok([self.v4.rebuild(&tracked.v4)?, self.v6.rebuild(&tracked.v6)?])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::family::V4;

    fn memory() -> Vec<AtomicU8> {
        (0..WORDS as usize * 8).map(|_| AtomicU8::new(0)).collect()
    }

    fn set_by_program(bytes: &[AtomicU8], bucket: u32) {
        let (_, generation) = control_bytes(bytes);
        bytes[byte_of(bucket, generation)].store(1, Ordering::Relaxed);
    }

    #[test]
    fn bytes_land_where_the_programs_test_them() {
        // The programs test `word_has(word, offset)` of the word at `position(bucket)`.
        let bytes = memory();
        for bucket in [0, 1, 2, 3, 4, 77_777, BUCKETS - 1] {
            for generation in 0..2 {
                bytes[byte_of(bucket, generation)].store(1, Ordering::Relaxed);
                let (word, offset) = ct_filter::position(bucket);
                let w = u64::from_ne_bytes(std::array::from_fn(|i| {
                    bytes[word as usize * 8 + i].load(Ordering::Relaxed)
                }));
                assert!(
                    ct_filter::word_has(w, offset),
                    "bucket {bucket} generation {generation}"
                );
                bytes[byte_of(bucket, generation)].store(0, Ordering::Relaxed);
                assert!(!ct_filter::word_has(
                    u64::from_ne_bytes(std::array::from_fn(
                        |i| bytes[word as usize * 8 + i].load(Ordering::Relaxed)
                    )),
                    offset
                ));
            }
        }
    }

    #[test]
    fn a_rebuild_activates_rewrites_the_idle_generation_and_switches_to_it() {
        let bytes = memory();
        assert_eq!(control_bytes(&bytes), (false, 0));
        // Programs wrote generation 0: a flow that ended (5) and one that lives (9).
        set_by_program(&bytes, 5);
        set_by_program(&bytes, 9);
        // An entry an earlier release made (no byte): the scan finds it with 9.
        let mut tracked = FlowBuckets::default();
        tracked.insert(9);
        tracked.insert(42);
        let r = rebuild_bytes(&bytes, &tracked);
        assert_eq!(
            r,
            Rebuilt {
                generation: 1,
                set: 2,
                cleared: 0,
                held: 2,
                was_active: false,
            }
        );
        assert_eq!(control_bytes(&bytes), (true, 1));
        assert!(held_bytes(&bytes, 42) && held_bytes(&bytes, 9));
        // 5 is still held by generation 0, which the programs wrote until just now.
        assert!(held_bytes(&bytes, 5));
        // A flow made between the scan and the switch wrote generation 0 too (bucket 7): the next
        // pass scans it, and rewrites generation 0 only.
        bytes[byte_of(7, 0)].store(1, Ordering::Relaxed);
        let mut next = FlowBuckets::default();
        next.insert(9);
        next.insert(7);
        let r = rebuild_bytes(&bytes, &next);
        assert_eq!(
            (r.generation, r.set, r.cleared, r.held, r.was_active),
            (0, 0, 1, 2, true)
        );
        assert!(
            !held_bytes(&bytes, 5),
            "an ended flow's byte goes after two passes"
        );
        assert!(held_bytes(&bytes, 7) && held_bytes(&bytes, 9));
        // 42 ended too: still in generation 1 until the next pass rewrites it.
        assert!(held_bytes(&bytes, 42));
        let r = rebuild_bytes(&bytes, &next);
        assert_eq!((r.generation, r.cleared), (1, 1));
        assert!(!held_bytes(&bytes, 42));
        assert!(held_bytes(&bytes, 7) && held_bytes(&bytes, 9));
    }

    #[test]
    fn a_live_flow_is_never_unheld_whatever_the_interleaving() {
        // A flow made at any point between passes writes the generation current then; every
        // rebuild afterwards scans it. Check every live flow stays held after each step.
        let bytes = memory();
        let mut live: Vec<u32> = Vec::new();
        let mut next_bucket = 1000;
        for pass in 0..6 {
            // Flows made before this pass's scan.
            for _ in 0..3 {
                set_by_program(&bytes, next_bucket);
                live.push(next_bucket);
                next_bucket += 17;
            }
            let mut scanned = FlowBuckets::default();
            for b in &live {
                scanned.insert(*b);
            }
            // One made after the scan, before the switch: not scanned by this pass.
            set_by_program(&bytes, next_bucket);
            live.push(next_bucket);
            next_bucket += 17;
            // Some flows end.
            if pass % 2 == 1 {
                live.remove(0);
            }
            rebuild_bytes(&bytes, &scanned);
            for b in &live {
                assert!(held_bytes(&bytes, *b), "pass {pass}: live bucket {b} lost");
            }
        }
    }

    #[test]
    fn only_egress_entries_need_a_bucket() {
        let mut key = CtKey::<V4> {
            saddr: [10, 244, 1, 5],
            daddr: [10, 0, 0, 1],
            sport: 8080,
            dport: 40000,
            proto: lb_common::proto::TCP,
            dir: dir::INGRESS,
            tag: 0,
        };
        let mut t = FlowBuckets::default();
        t.note(&key);
        assert!(t.is_empty());
        key.dir = dir::EGRESS;
        t.note(&key);
        assert!(t.contains(ct_filter::key_bucket(&key)));
        assert_eq!(t.len(), 1);
    }
}
