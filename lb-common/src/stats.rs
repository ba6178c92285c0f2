//! `lb_stats`: per-CPU counters the programs bump instead of failing or logging on the hot path.
//! The agent sums the CPUs for `/metrics` (`lb_datapath_events_total{event=...}`) and the CLI.

/// Index into `lb_stats`. Append only: the agent names counters by index.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// A socket's destination was translated to a backend.
    SockTranslated = 0,
    /// Connect/sendmsg refused: the Service has no endpoints (kube-proxy REJECT).
    SockRejected,
    /// Connect/sendmsg refused: a Local traffic policy has no local endpoint (kube-proxy DROP).
    SockDropped,
    /// A frontend entry pointed at a missing slot or backend (a concurrent update); not translated.
    SockNoBackend,
    /// recvmsg4/getpeername4 restored the frontend address.
    SockRevNatHit,
    /// A socket reverse-NAT entry belonged to a frontend that changed; ignored and deleted.
    SockRevNatStale,
    /// Writing a socket reverse-NAT entry failed (the reply would show the backend address).
    SockRevNatUpdateFailed,
    /// A ClientIP affinity entry chose the backend.
    AffinityHit,
    /// Writing an affinity entry failed.
    AffinityUpdateFailed,
    /// A socket of another network namespace was skipped (`--bpf-lb-sock-hostns-only`).
    SockSkippedNetns,
    /// loadBalancerSourceRanges did not allow the client.
    SourceRangeDenied,
}

/// Number of counters (`lb_stats` max_entries).
pub const COUNT: u32 = Counter::SourceRangeDenied as u32 + 1;

impl Counter {
    pub const ALL: [Counter; COUNT as usize] = [
        Counter::SockTranslated,
        Counter::SockRejected,
        Counter::SockDropped,
        Counter::SockNoBackend,
        Counter::SockRevNatHit,
        Counter::SockRevNatStale,
        Counter::SockRevNatUpdateFailed,
        Counter::AffinityHit,
        Counter::AffinityUpdateFailed,
        Counter::SockSkippedNetns,
        Counter::SourceRangeDenied,
    ];

    /// The metric label, snake_case.
    pub const fn name(self) -> &'static str {
        match self {
            Counter::SockTranslated => "sock_translated",
            Counter::SockRejected => "sock_rejected",
            Counter::SockDropped => "sock_dropped",
            Counter::SockNoBackend => "sock_no_backend",
            Counter::SockRevNatHit => "sock_revnat_hit",
            Counter::SockRevNatStale => "sock_revnat_stale",
            Counter::SockRevNatUpdateFailed => "sock_revnat_update_failed",
            Counter::AffinityHit => "affinity_hit",
            Counter::AffinityUpdateFailed => "affinity_update_failed",
            Counter::SockSkippedNetns => "sock_skipped_netns",
            Counter::SourceRangeDenied => "source_range_denied",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_is_in_index_order() {
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i, "{}", c.name());
        }
    }
}
