//! Counting instead of failing: every program outcome worth an operator's attention bumps a
//! per-CPU counter (`lb_stats`), which the agent exports as metrics.

use lb_common::stats::Counter;

use crate::maps::STATS;

#[inline(always)]
pub fn count(counter: Counter) {
    if let Some(value) = STATS.get_ptr_mut(counter as u32) {
        // SAFETY: a per-CPU slot is only written by programs running on this CPU, one at a time.
        unsafe { *value += 1 };
    }
}
