//! `lb_reject_rl`: the token bucket that limits the ICMP port-unreachable answers the tc programs
//! generate for Services without endpoints (kube-proxy's REJECT goes through the kernel's
//! `icmp_send`, which is limited by `net.ipv4.icmp_msgs_per_sec`/`icmp_msgs_burst`; without a
//! limit a spoofed flood would turn the node into a reflector). One bucket per CPU.

/// Answers per second, per CPU (the kernel's default `icmp_msgs_per_sec`).
pub const REJECT_RATE_PER_SEC: u64 = 1000;
/// Answers that may go out back to back (the kernel's default `icmp_msgs_burst`).
pub const REJECT_BURST: u64 = 50;

/// Nanoseconds of credit one answer costs.
const COST_NS: u64 = 1_000_000_000 / REJECT_RATE_PER_SEC;
const CAPACITY_NS: u64 = REJECT_BURST * COST_NS;

/// A token bucket measured in nanoseconds of credit. The zeroed value (a fresh map) is full.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateBucket {
    /// Credit left, in nanoseconds (capped at `REJECT_BURST` answers).
    pub credit_ns: u64,
    /// Monotonic time of the last refill (`bpf_ktime_get_ns`).
    pub last_ns: u64,
}
crate::user_pod!(RateBucket);

impl RateBucket {
    /// Refills for the time elapsed since the last call and takes one answer if there is credit.
    #[inline(always)]
    pub fn take(&mut self, now_ns: u64) -> bool {
        let elapsed = now_ns.saturating_sub(self.last_ns);
        let credit = self.credit_ns.saturating_add(elapsed);
        self.credit_ns = if credit > CAPACITY_NS { CAPACITY_NS } else { credit };
        self.last_ns = now_ns;
        if self.credit_ns >= COST_NS {
            self.credit_ns -= COST_NS;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_bucket_allows_the_burst_then_the_rate() {
        let mut b = RateBucket::default();
        let t0 = 5_000_000_000;
        let burst = (0..1000).filter(|_| b.take(t0)).count() as u64;
        assert_eq!(burst, REJECT_BURST);
        // One more per COST_NS afterwards, none in between.
        assert!(!b.take(t0 + COST_NS - 1));
        assert!(b.take(t0 + COST_NS));
        assert!(!b.take(t0 + COST_NS));
        // Over a second at a steady flood: the rate, give or take the one in flight.
        let mut allowed = 0;
        for i in 1..=10_000u64 {
            if b.take(t0 + COST_NS + i * 100_000) {
                allowed += 1;
            }
        }
        assert_eq!(allowed, REJECT_RATE_PER_SEC);
    }

    #[test]
    fn idle_time_refills_up_to_the_burst_only() {
        let mut b = RateBucket::default();
        let t0 = 1_000_000_000_000;
        while b.take(t0) {}
        let later = t0 + 3600 * 1_000_000_000;
        let allowed = (0..1000).filter(|_| b.take(later)).count() as u64;
        assert_eq!(allowed, REJECT_BURST);
    }

    #[test]
    fn a_clock_going_backwards_grants_nothing() {
        let mut b = RateBucket {
            credit_ns: 0,
            last_ns: 10_000_000_000,
        };
        assert!(!b.take(9_000_000_000));
    }

    #[test]
    fn layout() {
        assert_eq!(core::mem::size_of::<RateBucket>(), 16);
    }
}
