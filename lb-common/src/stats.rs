//! `lb_stats`: per-CPU counters the programs bump instead of failing or logging on the hot path.
//! The agent sums the CPUs for `/metrics` (`lb_datapath_events_total{event=...}`) and the CLI.

macro_rules! counters {
    ($($(#[$doc:meta])* $variant:ident => $name:literal,)+) => {
        /// Index into `lb_stats`. Append only: a pinned map keeps its indexes across upgrades.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Counter {
            $($(#[$doc])* $variant,)+
        }

        impl Counter {
            /// Every counter, in index order.
            pub const ALL: &'static [Counter] = &[$(Counter::$variant,)+];

            /// The metric label, snake_case.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)+
                }
            }
        }
    };
}

counters! {
    /// A socket's destination was translated to a backend.
    SockTranslated => "sock_translated",
    /// Connect/sendmsg refused: the Service has no endpoints (kube-proxy REJECT).
    SockRejected => "sock_rejected",
    /// Connect/sendmsg refused: a Local traffic policy has no local endpoint (kube-proxy DROP).
    SockDropped => "sock_dropped",
    /// A frontend entry pointed at a missing slot or backend (a concurrent update); not translated.
    SockNoBackend => "sock_no_backend",
    /// recvmsg4/getpeername4 restored the frontend address.
    SockRevNatHit => "sock_revnat_hit",
    /// A socket reverse-NAT entry belonged to a frontend that changed; ignored and deleted.
    SockRevNatStale => "sock_revnat_stale",
    /// Writing a socket reverse-NAT entry failed (the reply would show the backend address).
    SockRevNatUpdateFailed => "sock_revnat_update_failed",
    /// A ClientIP affinity entry chose the backend.
    AffinityHit => "affinity_hit",
    /// Writing an affinity entry failed.
    AffinityUpdateFailed => "affinity_update_failed",
    /// A socket of another network namespace was skipped (`--bpf-lb-sock-hostns-only`).
    SockSkippedNetns => "sock_skipped_netns",
    /// loadBalancerSourceRanges did not allow the client (dropped).
    SourceRangeDenied => "source_range_denied",
    /// tc: a new flow to a frontend was translated (destination NAT).
    TcNewFlow => "tc_new_flow",
    /// tc: a new flow was also masqueraded (source NAT to the node IP).
    TcMasqueraded => "tc_masqueraded",
    /// tc: a flow to a Service without endpoints was rejected (ICMP port unreachable).
    TcRejected => "tc_rejected",
    /// tc: a flow to a Local-policy frontend without local endpoints was dropped.
    TcDropped => "tc_dropped",
    /// tc: a frontend entry pointed at a missing slot or backend; the packet passed untouched.
    TcNoBackend => "tc_no_backend",
    /// tc: the connection-tracking map refused an entry (full); the packet was dropped.
    TcCtInsertFailed => "tc_ct_insert_failed",
    /// tc: no free masquerade port for the destination; the packet was dropped.
    TcSnatPortsExhausted => "tc_snat_ports_exhausted",
    /// tc: an IP fragment left untranslated: a later fragment whose first fragment was not seen
    /// (reordered, or lost), or a fragment of a protocol other than TCP and UDP (SCTP's checksum
    /// covers the whole datagram); passed untouched.
    TcFragment => "tc_fragment",
    /// tc: a packet too short for its headers; passed untouched.
    TcTruncated => "tc_truncated",
    /// tc: SCTP while `lb_tc_tail` has no program for it (at ingress, or the node's own SCTP to a
    /// frontend at egress: the agent has not loaded the SCTP programs, or the kernel refused
    /// them); passed untouched.
    TcUnsupportedProtocol => "tc_unsupported_protocol",
    /// tc: an ICMP error about a translated flow was translated back.
    TcIcmpErrorTranslated => "tc_icmp_error_translated",
    /// tc: a UDP (or SCTP) flow whose backend was removed moved to a live backend.
    TcStaleUdpMoved => "tc_stale_udp_moved",
    /// tc: rewriting a packet failed (checksum or store helper error); dropped.
    TcRewriteFailed => "tc_rewrite_failed",
    /// Bumped by connect4 only in the test build of the programs (`--cfg lb_test_variant`), which
    /// the upgrade tests load to prove that an upgrade replaced the running programs. Always zero
    /// in a production build.
    TestVariant => "test_variant",
    /// tc: a flow to a Service without endpoints came from an address no ICMP error may go to
    /// (unspecified, loopback, multicast, broadcast, or a link-layer broadcast); dropped unanswered.
    TcRejectUnanswerable => "tc_reject_unanswerable",
    /// tc: a flow to a Service without endpoints was dropped unanswered: the ICMP answer rate
    /// (`lb_common::ratelimit`) was exceeded.
    TcRejectRateLimited => "tc_reject_rate_limited",
    /// tc egress: a packet carried this project's reply mark but its flow's forward entry does not
    /// name it: another component's mark, or a reply ingress un-SNATed whose forward entry went
    /// meanwhile (LRU eviction takes a new flow's entries one at a time: under a flood, the
    /// backends' SYN-ACK retransmissions for spoofed SYNs). Left untouched, mark included.
    TcForeignMark => "tc_foreign_mark",
    /// tc: a flow to masquerade, but the node has no address of the flow's family to masquerade
    /// with (an IPv6 NodePort reached on a node without an IPv6 node IP, say); dropped.
    TcNoMasqueradeAddress => "tc_no_masquerade_address",
    /// tc: every masquerade port a new flow tried was held, and it took one back from a flow done
    /// with it (a TCP handshake not completed within a second, a spoofed SYN's; a UDP flow silent
    /// both ways for 2 s), as netfilter's early drop does with unassured connections.
    TcSnatPortReclaimed => "tc_snat_port_reclaimed",
    /// tc: a new flow's client went past the handshake (a TCP packet without SYN or RST, a second
    /// UDP datagram), and its entries moved from the new-flow table (`lb4_ct_new`) to the
    /// established one (`lb4_ct`), out of a flood's reach.
    TcFlowEstablished => "tc_flow_established",
    /// tc (ingress and egress): a later fragment of a TCP or UDP datagram got its ports from the
    /// datagram's first fragment (`lb_common::fragment`) and went the way the first one did.
    TcFragmentFollowed => "tc_fragment_followed",
    /// connect/sendmsg refused (ECONNREFUSED): a cluster IP on a port no Service has (kube-proxy's
    /// "Reject traffic to invalid ports of ClusterIPs", `lb_common::cluster_ip`).
    SockClusterIpBadPort => "sock_cluster_ip_bad_port",
    /// connect/sendmsg refused (EHOSTUNREACH): an address of a Service CIDR no Service holds
    /// (kube-proxy's "Drop traffic to unallocated ClusterIPs").
    SockUnallocatedClusterIp => "sock_unallocated_cluster_ip",
    /// tc: a new flow to a cluster IP on a port no Service has; rejected (ICMP port unreachable,
    /// within the answers' rate).
    TcClusterIpBadPort => "tc_cluster_ip_bad_port",
    /// tc: a new flow to an address of a Service CIDR no Service holds; dropped.
    TcUnallocatedClusterIp => "tc_unallocated_cluster_ip",
    /// tc: a masqueraded new flow's post-DNAT tuple (client -> backend) was a live flow's of
    /// another frontend (the client's port reused towards another frontend with that backend):
    /// its SNAT entry was tagged and its packets marked (`lb_common::conntrack::snat_tag`).
    TcSnatTagged => "tc_snat_tagged",
    /// tc: a new flow's route (`bpf_fib_lookup` towards its backend) was not found (no route,
    /// unreachable, forwarding off): were it masqueraded, it gets the node's primary IP
    /// (`lb_masq_addrs` key 0) instead of its interface's address.
    TcMasqueradeRouteUnknown => "tc_masquerade_route_unknown",
    /// An event a listening `lb-agent monitor` wanted found the ring buffer (`lb_events`) full
    /// and was lost (the monitor reads this counter and reports the losses).
    MonitorEventsLost => "monitor_events_lost",
    /// tc egress: the node's own SCTP to a frontend could not be sent to its backend: no route to
    /// the backend (`bpf_fib_lookup`), or the backend is at one of the node's own addresses (a
    /// host-network endpoint of this node, reached through loopback, where no tc program runs
    /// for the replies); dropped.
    TcLocalSctpUnrouted => "tc_local_sctp_unrouted",
    /// tc: a new flow's establishing packet (`tc_flow_established`) found one of the flow's other
    /// entries gone (evicted from a full `lb4_ct_new`), so that its replies could not be
    /// translated back: the packet started the flow again as a new one, as netfilter does when a
    /// conntrack entry is gone.
    TcFlowRestarted => "tc_flow_restarted",
    /// connect found the socket's slot of `lb4_sock_conn` (`lb6_sock_conn`) held by another open
    /// socket (one whose cookie is a multiple of `revnat::CONN_SLOTS` away) and kept the socket's
    /// reverse NAT in its socket storage instead (`lb4_sock_rev_sk`): the same answers, a slower
    /// connect.
    SockConnSlotBusy => "sock_conn_slot_busy",
}

/// Number of counters (`lb_stats` max_entries).
pub const COUNT: u32 = Counter::ALL.len() as u32;

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
