//! Id allocation for backends and frontends (reverse-NAT ids). Ids are handed out round-robin
//! rather than lowest-free, so an id freed by a deleted frontend is not immediately given to a
//! new one while flow state (socket reverse NAT, affinity) may still name it.
//!
//! Ids are one space across both families (the shared maps, `lb_svc_names` and `lb_aff_match`,
//! are keyed by them); each family allocates from its own range of it ([`family_ranges`]), as
//! large as its maps, so a family runs out exactly when its map is full.

use std::ops::RangeInclusive;

use crate::family::PerFamily;

/// Each family's ids for maps of `capacity` entries: IPv4 `1..=capacity`, IPv6 the next
/// `capacity`.
pub fn family_ranges(capacity: u32) -> PerFamily<RangeInclusive<u32>> {
    PerFamily {
        v4: 1..=capacity,
        v6: capacity.saturating_add(1)..=capacity.saturating_mul(2),
    }
}

/// Ids `first..=max` in a bitset.
#[derive(Clone, Debug)]
pub struct IdAllocator {
    used: Vec<u64>,
    first: u32,
    max: u32,
    next: u32,
    in_use: u32,
}

impl IdAllocator {
    /// Ids `1..=max`.
    pub fn new(max: u32) -> Self {
        Self::with_range(1..=max)
    }

    /// Ids in `range` (which must not contain 0: an id of 0 means "none" in the maps).
    pub fn with_range(range: RangeInclusive<u32>) -> Self {
        let (first, max) = (*range.start(), *range.end());
        Self {
            used: vec![0; (max as usize).div_ceil(64) + 1],
            first: first.max(1),
            max,
            next: first.max(1),
            in_use: 0,
        }
    }

    fn size(&self) -> u32 {
        (self.max + 1).saturating_sub(self.first)
    }

    /// Whether `id` is one this allocator hands out.
    pub fn owns(&self, id: u32) -> bool {
        (self.first..=self.max).contains(&id)
    }

    fn slot(id: u32) -> (usize, u64) {
        ((id / 64) as usize, 1u64 << (id % 64))
    }

    pub fn is_used(&self, id: u32) -> bool {
        let (w, b) = Self::slot(id);
        self.used.get(w).is_some_and(|word| word & b != 0)
    }

    /// Marks an id recovered from the maps as used.
    pub fn reserve(&mut self, id: u32) -> bool {
        if !self.owns(id) || self.is_used(id) {
            return false;
        }
        let (w, b) = Self::slot(id);
        self.used[w] |= b;
        self.in_use += 1;
        self.next = self.next.max(if id == self.max { self.first } else { id + 1 });
        true
    }

    pub fn alloc(&mut self) -> Option<u32> {
        if self.in_use >= self.size() {
            return None;
        }
        let mut id = self.next;
        loop {
            if !self.owns(id) {
                id = self.first;
            }
            if !self.is_used(id) {
                let (w, b) = Self::slot(id);
                self.used[w] |= b;
                self.in_use += 1;
                self.next = id + 1;
                return Some(id);
            }
            id += 1;
        }
    }

    pub fn free(&mut self, id: u32) {
        if self.is_used(id) {
            let (w, b) = Self::slot(id);
            self.used[w] &= !b;
            self.in_use -= 1;
        }
    }

    pub fn in_use(&self) -> u32 {
        self.in_use
    }

    pub fn available(&self) -> u32 {
        self.size() - self.in_use
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_and_exhaustion() {
        let mut ids = IdAllocator::new(3);
        assert_eq!(ids.alloc(), Some(1));
        assert_eq!(ids.alloc(), Some(2));
        ids.free(1);
        // 1 is free, but the cursor moves on first.
        assert_eq!(ids.alloc(), Some(3));
        assert_eq!(ids.alloc(), Some(1));
        assert_eq!(ids.alloc(), None);
        assert_eq!(ids.available(), 0);
    }

    #[test]
    fn a_range_of_its_own() {
        let ranges = family_ranges(3);
        let mut v4 = IdAllocator::with_range(ranges.v4);
        let mut v6 = IdAllocator::with_range(ranges.v6);
        assert_eq!(v6.alloc(), Some(4));
        assert_eq!(v6.alloc(), Some(5));
        assert_eq!(v6.alloc(), Some(6));
        assert_eq!(v6.alloc(), None, "IPv6 is full");
        assert_eq!(v4.alloc(), Some(1), "IPv4 is not");
        assert!(!v4.reserve(4), "an IPv6 id");
        assert!(!v6.reserve(1), "an IPv4 id");
        v6.free(5);
        assert_eq!(v6.alloc(), Some(5));
        assert_eq!(v6.available(), 0);
        assert_eq!(v4.available(), 2);
    }

    #[test]
    fn reserve_recovered_ids() {
        let mut ids = IdAllocator::new(100);
        assert!(ids.reserve(7));
        assert!(!ids.reserve(7));
        assert!(!ids.reserve(0));
        assert!(!ids.reserve(101));
        assert_eq!(ids.alloc(), Some(8));
        assert_eq!(ids.in_use(), 2);
    }
}
