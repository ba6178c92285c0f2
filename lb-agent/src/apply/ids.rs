//! Id allocation for backends and frontends (reverse-NAT ids). Ids are handed out round-robin
//! rather than lowest-free, so an id freed by a deleted frontend is not immediately given to a
//! new one while flow state (socket reverse NAT, affinity) may still name it.

/// Ids `1..=max` in a bitset.
#[derive(Clone, Debug)]
pub struct IdAllocator {
    used: Vec<u64>,
    max: u32,
    next: u32,
    in_use: u32,
}

impl IdAllocator {
    pub fn new(max: u32) -> Self {
        Self {
            used: vec![0; (max as usize).div_ceil(64) + 1],
            max,
            next: 1,
            in_use: 0,
        }
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
        if id == 0 || id > self.max || self.is_used(id) {
            return false;
        }
        let (w, b) = Self::slot(id);
        self.used[w] |= b;
        self.in_use += 1;
        self.next = self.next.max(id % self.max + 1);
        true
    }

    pub fn alloc(&mut self) -> Option<u32> {
        if self.in_use >= self.max {
            return None;
        }
        let mut id = self.next;
        loop {
            if id == 0 || id > self.max {
                id = 1;
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
        self.max - self.in_use
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
