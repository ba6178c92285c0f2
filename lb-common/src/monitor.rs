//! `lb-agent monitor`'s contract with the programs: what a listening monitor asks for
//! (`lb_monitor`, one [`MonitorControl`]) and the events the programs then write into the ring
//! buffer `lb_events` ([`MonitorEvent`]).
//!
//! An event is a counted outcome (`stats::Counter`) of one socket call or one packet, with the
//! flow it happened to: socket translations, rejects and drops with their reason, the tc path's
//! new flows with their NAT and masquerade, conntrack and masquerade-port failures, packets left
//! untranslated. Established flows never produce one.
//!
//! When nobody listens the programs emit nothing: at the points where an event could be written,
//! they read `lb_monitor` (one array lookup) and find no [`MonitorControl::types`]. A monitor holds
//! a lease (`until_ns`, on the clock of `bpf_ktime_get_boot_ns`, CLOCK_BOOTTIME) that it renews
//! every second; a monitor killed without cleaning up stops the events within the lease.

use crate::{stats::Counter, user_pod};

/// Event types, the bits of [`MonitorControl::types`] (`lb-agent monitor --type`).
pub mod types {
    /// A socket call's destination rewritten to a backend.
    pub const TRANSLATE: u32 = 1 << 0;
    /// A tc new flow translated to a backend (DNAT), masqueraded or not.
    pub const NAT: u32 = 1 << 1;
    /// Refused as kube-proxy's REJECT: ECONNREFUSED, or an ICMP port unreachable.
    pub const REJECT: u32 = 1 << 2;
    /// Dropped (or, at the socket, EHOSTUNREACH): a policy's drop, a full table, no free port.
    pub const DROP: u32 = 1 << 3;
    /// Let through untranslated though it concerned a frontend: truncated, a fragment whose
    /// first fragment was not seen, SCTP at tc, a frontend entry mid-update.
    pub const UNTRANSLATED: u32 = 1 << 4;
    pub const ALL: u32 = TRANSLATE | NAT | REJECT | DROP | UNTRANSLATED;
    /// Every type with its `--type` name, in bit order.
    pub const NAMED: &[(u32, &str)] = &[
        (TRANSLATE, "translate"),
        (NAT, "nat"),
        (REJECT, "reject"),
        (DROP, "drop"),
        (UNTRANSLATED, "untranslated"),
    ];
}

/// The event type of a counted outcome; 0 for counters that are never an event (established
/// flows' bookkeeping, reverse translation, counters of the agent's own concerns).
#[inline(always)]
pub const fn event_type(counter: Counter) -> u32 {
    use Counter::*;
    match counter {
        SockTranslated => types::TRANSLATE,
        TcNewFlow => types::NAT,
        SockRejected | SockClusterIpBadPort | TcRejected | TcClusterIpBadPort => types::REJECT,
        SockDropped
        | SockUnallocatedClusterIp
        | SourceRangeDenied
        | TcDropped
        | TcUnallocatedClusterIp
        | TcCtInsertFailed
        | TcSnatPortsExhausted
        | TcNoMasqueradeAddress
        | TcLocalSctpUnrouted => types::DROP,
        SockNoBackend | TcNoBackend | TcFragment | TcTruncated | TcUnsupportedProtocol => types::UNTRANSLATED,
        _ => 0,
    }
}

/// [`event_type`] of every counter, by index: a table the programs read with the index they hold
/// (one load, where a `match` would be a chain of branches the verifier walks on every path).
pub const EVENT_TYPES: [u8; crate::stats::COUNT as usize] = {
    let mut table = [0; crate::stats::COUNT as usize];
    let mut i = 0;
    while i < table.len() {
        table[i] = event_type(Counter::ALL[i]) as u8;
        i += 1;
    }
    table
};

/// `lb_monitor`'s one entry, written by `lb-agent monitor` only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorControl {
    /// The lease: events are written while `bpf_ktime_get_boot_ns()` is below it.
    pub until_ns: u64,
    /// The `types::*` the monitor wants; 0: nobody listens.
    pub types: u32,
    /// The listening monitor's process id (in its own PID namespace), for the next one's message.
    pub pid: u32,
}

/// [`MonitorEvent::hook`]: where the event happened. The socket hooks are `trace::hook`'s.
pub mod hook {
    pub use crate::trace::hook::{CONNECT4, CONNECT6, SENDMSG4, SENDMSG6};
    /// tc ingress (the interface is [`super::MonitorEvent::ifindex`]).
    pub const TC_INGRESS: u32 = 8;
    /// tc egress: the node's own SCTP to a frontend (`lb_tc_sctp_out`; the interface is the one
    /// it was leaving by).
    pub const TC_EGRESS: u32 = 9;
}

/// One event in `lb_events`. Addresses are the family's bytes first (an IPv4 address in the first
/// 4), network order; ports in host order; ids as the maps hold them (0: none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorEvent {
    /// `bpf_ktime_get_boot_ns()` when it happened.
    pub time_ns: u64,
    /// The socket path: the calling task's cgroup (v2 id, its directory's inode); tc: 0.
    pub cgroup_id: u64,
    /// The outcome, a `stats::Counter` index (counted as well).
    pub counter: u32,
    /// [`hook`]`::*`.
    pub hook: u32,
    /// tc ingress: the interface the packet came in by; tc egress: the one it was leaving by; the
    /// socket path: 0.
    pub ifindex: u32,
    /// The frontend's reverse-NAT id (its Service port: `lb_svc_names`).
    pub rev_nat_id: u32,
    /// The chosen backend's id (translated events).
    pub backend_id: u32,
    /// `AF_INET` or `AF_INET6`: the family of the addresses (an IPv4-mapped call on an IPv6
    /// socket is `AF_INET`).
    pub family: u8,
    /// IPPROTO.
    pub protocol: u8,
    /// The client's port (tc; 0 at the socket, where it is not chosen yet).
    pub src_port: u16,
    /// The destination's port: the frontend's.
    pub dst_port: u16,
    /// The backend's port (translated events).
    pub backend_port: u16,
    /// The masquerade port (tc new flows that are masqueraded; else 0).
    pub nat_port: u16,
    pub _pad: u16,
    /// The client (tc: the packet's source; the socket path: its bound source, if any).
    pub src: [u8; 16],
    /// The destination the call or packet named: the frontend (or a cluster IP no frontend has).
    pub dst: [u8; 16],
    /// The backend (translated events).
    pub backend: [u8; 16],
    /// The masquerade address (masqueraded tc new flows).
    pub nat: [u8; 16],
}

user_pod!(MonitorControl, MonitorEvent);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Counter;

    #[test]
    fn layouts() {
        assert_eq!(size_of::<MonitorControl>(), 16);
        assert_eq!(size_of::<MonitorEvent>(), 112);
        assert_eq!(core::mem::offset_of!(MonitorEvent, src), 48);
    }

    #[test]
    fn every_event_type_has_counters_and_a_name() {
        for (bit, name) in types::NAMED {
            assert!(
                Counter::ALL.iter().any(|c| event_type(*c) == *bit),
                "{name} has no counter"
            );
        }
        assert_eq!(types::NAMED.iter().fold(0, |all, (bit, _)| all | bit), types::ALL);
        // Bookkeeping of established flows is never an event.
        assert_eq!(event_type(Counter::TcFlowEstablished), 0);
        assert_eq!(event_type(Counter::SockRevNatHit), 0);
    }
}
