//! The kernel features the agent found (`lb_common::features`): a read-only global it writes
//! before load. The verifier reads a frozen read-only global as a constant, so the branch of a
//! missing feature is dead code it never checks.

use lb_common::features;

/// The feature bits; the name is `lb_common::features::GLOBAL`.
#[unsafe(no_mangle)]
static LB_FEATURES: u32 = 0;

#[inline(always)]
pub fn has(feature: u32) -> bool {
    // Volatile: the value is what the agent writes into .rodata, never the compiler's 0.
    let bits = unsafe { core::ptr::read_volatile(&LB_FEATURES) };
    bits & feature != 0
}

/// `bpf_set_retval` in cgroup sock_addr programs (5.18).
#[inline(always)]
pub fn set_retval() -> bool {
    has(features::SET_RETVAL)
}

/// `bpf_ktime_get_coarse_ns` (5.11).
#[inline(always)]
pub fn ktime_coarse() -> bool {
    has(features::KTIME_COARSE)
}
