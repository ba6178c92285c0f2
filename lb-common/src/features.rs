//! Kernel features the programs adapt to. The agent probes the running kernel and writes the bits
//! it found into the object's read-only global [`GLOBAL`] before loading it; the verifier reads
//! a frozen read-only global as a constant and skips the code of a missing feature, so one
//! object loads on every supported kernel (the helper of a skipped branch is never checked).

/// The name of the `u32` global (in `.rodata`) holding the feature bits.
pub const GLOBAL: &str = "LB_FEATURES";

/// `bpf_set_retval` in cgroup sock_addr programs (Linux 5.18): a refused connect() or sendmsg()
/// fails with ECONNREFUSED or EHOSTUNREACH. Without it the call fails with EPERM, as with
/// Cilium on such kernels.
pub const SET_RETVAL: u32 = 1 << 0;

/// `bpf_ktime_get_coarse_ns` (Linux 5.11): the tc path stamps conntrack entries with the coarse
/// monotonic clock (cheaper). Without it, `bpf_ktime_get_ns`: the same clock at full
/// resolution, so the agent's conntrack GC reads both alike.
pub const KTIME_COARSE: u32 = 1 << 1;

/// `lb_netns_probe`, index 0: how the agent learns its own network namespace's cookie on kernels
/// without `SO_NETNS_COOKIE` (before 5.14). The agent writes the cookie of one of its sockets,
/// attaches `lb_probe_netns` to the cgroup root for a moment and connects that socket; the
/// program records the socket's `bpf_get_netns_cookie`. Never pinned.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetnsProbe {
    /// `SO_COOKIE` of the agent's probe socket (0: nothing to record).
    pub socket_cookie: u64,
    /// Written by the program: the network namespace cookie of that socket.
    pub netns_cookie: u64,
}

crate::user_pod!(NetnsProbe);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netns_probe_layout() {
        assert_eq!(core::mem::size_of::<NetnsProbe>(), 16);
    }
}
