//! What the running kernel changes in what a test may observe, from the agent's own probes
//! (`lb_agent::datapath::features`), so a test expects exactly what the agent does on this kernel.

use lb_agent::datapath::features;

pub const EPERM: i64 = 1;

/// The errno of a connect() or sendmsg() the socket programs refuse with `errno`: that errno
/// where the kernel has `bpf_set_retval` (5.18), EPERM before.
pub fn refused_with(errno: i64) -> i64 {
    let set_retval = features::current()
        .unwrap_or_else(|e| panic!("probing the kernel: {e}"))
        .set_retval;
    if set_retval { errno } else { EPERM }
}
