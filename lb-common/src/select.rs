//! Backend selection arithmetic shared by the programs and the agent's `trace` (one definition, so
//! what the CLI predicts is what the kernel does).

/// The backend slot (1..=count) for a random or hashed 32-bit value (1 when `count` is 0).
#[inline(always)]
pub const fn slot_for(value: u32, count: u16) -> u16 {
    // Never a division by zero (a panic path, which the verifier rejects): a frontend read in
    // place may have its count zeroed by the agent between the caller's check and here; slot 1
    // is then as good as any (its lookup fails or finds the last backend standing).
    match value.checked_rem(count as u32) {
        Some(rem) => rem as u16 + 1,
        None => 1,
    }
}

/// Whether an affinity entry last used at `last_used_ns` is still valid at `now_ns`
/// (kube-proxy: `-m recent --rcheck --seconds <timeout>`).
#[inline(always)]
pub const fn affinity_valid(last_used_ns: u64, now_ns: u64, timeout_secs: u32) -> bool {
    now_ns.saturating_sub(last_used_ns) <= timeout_secs as u64 * 1_000_000_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_cover_one_to_count() {
        assert_eq!(slot_for(0, 3), 1);
        assert_eq!(slot_for(2, 3), 3);
        assert_eq!(slot_for(3, 3), 1);
        assert_eq!(slot_for(u32::MAX, 1), 1);
    }

    #[test]
    fn affinity_expiry() {
        assert!(affinity_valid(0, 10_000_000_000, 10));
        assert!(!affinity_valid(0, 10_000_000_001, 10));
        assert!(affinity_valid(5, 3, 0), "clock going backwards keeps the entry");
    }
}
