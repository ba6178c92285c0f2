//! The kernel's clocks, as the programs read them: map entries carry times from
//! `bpf_ktime_get_coarse_ns` (conntrack) and `bpf_ktime_get_boot_ns` (affinity), and the agent
//! compares them with the same clocks.

use nix::time::{ClockId, clock_gettime};

/// Nanoseconds on `clock`, or 0 if the kernel lacks it (it never does on a supported kernel).
fn clock_ns(clock: ClockId) -> u64 {
    clock_gettime(clock).map_or(0, |ts| ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64)
}

/// `CLOCK_MONOTONIC_COARSE`: what `bpf_ktime_get_coarse_ns` reads (conntrack's `created_ns`,
/// `last_seen_ns`; on kernels without that helper the programs read `CLOCK_MONOTONIC`, which runs
/// at the same rate and differs from it by less than a tick).
pub fn monotonic_coarse_ns() -> u64 {
    clock_ns(ClockId::CLOCK_MONOTONIC_COARSE)
}

/// `CLOCK_BOOTTIME`: what `bpf_ktime_get_boot_ns` reads (affinity entries' `last_used_ns`).
pub fn boottime_ns() -> u64 {
    clock_ns(ClockId::CLOCK_BOOTTIME)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocks_advance() {
        let (a, b) = (monotonic_coarse_ns(), boottime_ns());
        assert!(a > 0 && b > 0);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(monotonic_coarse_ns() > a);
        assert!(boottime_ns() > b);
    }
}
