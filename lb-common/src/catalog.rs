//! The map catalog: every map's name (the kernel name and the pin file name are the same, at most
//! 15 bytes), its default capacity, and [`Capacities`], the sizes the agent creates the maps with. `lb-ebpf/src/maps.rs` declares each map with the same literal name; a test in
//! `tests/` checks that every constant here names a map in the object.
//!
//! Service and backend state lives in plain hash maps: an LRU map evicts before it is full, which
//! would silently drop a Service. Only flow state (socket reverse NAT, affinity, conntrack) is LRU.

/// Frontends and their backend slots: `Svc4Key` -> `Svc4Value`. Written by the agent only.
pub const SERVICES: &str = "lb4_services";
/// Backends by id: `u32` -> `Backend4Value`. Written by the agent only.
pub const BACKENDS: &str = "lb4_backends";
/// Frontend address by reverse-NAT id: `u32` -> `RevNat4Value`. Written by the agent only.
pub const REVNAT: &str = "lb4_revnat";
/// Service identity by reverse-NAT id: `u32` -> `SvcName`, for operators (CLI, bpftool); the
/// programs never read it.
pub const SVC_NAMES: &str = "lb_svc_names";
/// Per-socket reverse NAT for recvmsg4/getpeername4 (LRU): `SockRevNat4Key` -> `SockRevNat4Value`.
pub const SOCK_REVNAT: &str = "lb4_sock_revnat";
/// Per-socket reverse NAT of connected sockets (socket storage, `BPF_MAP_TYPE_SK_STORAGE`): the
/// socket -> `SockRevNat4Sk`. Not dumpable by bpftool (its key is a socket).
pub const SOCK_REVNAT_SK: &str = "lb4_sock_rev_sk";
/// ClientIP session affinity (LRU): `Affinity4Key` -> `Affinity4Value`.
pub const AFFINITY: &str = "lb4_affinity";
/// Which backends may still serve an affinity entry: `AffinityMatchKey` -> `u8`. Written by the agent.
pub const AFFINITY_MATCH: &str = "lb4_aff_match";
/// loadBalancerSourceRanges (LPM trie): `SrcRange4` prefix -> `u8`. Written by the agent.
pub const SOURCE_RANGES: &str = "lb4_src_range";
/// Connection tracking and NAT of the tc path (LRU): `Ct4Key` -> `Ct4Value`.
pub const CONNTRACK: &str = "lb4_ct";
/// Datapath configuration, one entry: `u32` 0 -> `DatapathConfig`. Written by the agent.
pub const CONFIG: &str = "lb_config";
/// Per-CPU counters: `u32` (a `stats::Counter`) -> `u64`. Written by the programs.
pub const STATS: &str = "lb_stats";
/// Per-CPU token bucket for the ICMP answers of rejected flows: `u32` 0 -> `RateBucket`. Written by
/// the tc programs.
pub const REJECT_LIMIT: &str = "lb_reject_rl";

/// The agent's own network namespace cookie on kernels without `SO_NETNS_COOKIE`: `u32` 0 ->
/// `features::NetnsProbe`. Used for a moment at start-up; never pinned, so not in [`ALL`].
pub const NETNS_PROBE: &str = "lb_netns_probe";

/// Every pinned map, in the order the CLI and cleanup list them.
pub const ALL: &[&str] = &[
    SERVICES,
    BACKENDS,
    REVNAT,
    SVC_NAMES,
    SOCK_REVNAT,
    SOCK_REVNAT_SK,
    AFFINITY,
    AFFINITY_MATCH,
    SOURCE_RANGES,
    CONNTRACK,
    CONFIG,
    STATS,
    REJECT_LIMIT,
];

/// Default capacities. The agent overrides them with flags (`--bpf-lb-map-max` and friends) before
/// the maps are created; a pinned map keeps its size until it is migrated.
pub mod capacity {
    /// Frontends plus backend slots (10,000 Services x 10 endpoints need ~110,000).
    pub const SERVICES: u32 = 262_144;
    /// Distinct backends (ip, port, protocol) across all Services.
    pub const BACKENDS: u32 = 65_536;
    /// Frontends (one reverse-NAT id each).
    pub const REVNAT: u32 = 65_536;
    pub const SOCK_REVNAT: u32 = 262_144;
    pub const AFFINITY: u32 = 65_536;
    pub const AFFINITY_MATCH: u32 = 262_144;
    pub const SOURCE_RANGES: u32 = 16_384;
    /// Four entries per masqueraded flow, two per other flow.
    pub const CONNTRACK: u32 = 262_144;
}

/// Map capacities (`max_entries`): what the agent creates the maps with (flags such as
/// `--bpf-lb-map-max`), and what bounds the entries its writer may add.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    pub services: u32,
    pub backends: u32,
    pub revnat: u32,
    pub sock_revnat: u32,
    pub affinity: u32,
    pub affinity_match: u32,
    pub source_ranges: u32,
    pub conntrack: u32,
}

impl Capacities {
    /// The compiled-in defaults ([`capacity`]).
    pub const DEFAULT: Capacities = Capacities {
        services: capacity::SERVICES,
        backends: capacity::BACKENDS,
        revnat: capacity::REVNAT,
        sock_revnat: capacity::SOCK_REVNAT,
        affinity: capacity::AFFINITY,
        affinity_match: capacity::AFFINITY_MATCH,
        source_ranges: capacity::SOURCE_RANGES,
        conntrack: capacity::CONNTRACK,
    };
}

impl Default for Capacities {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Compile-time proof that every name fits the kernel's 15-byte object name.
const _: () = {
    let mut i = 0;
    while i < ALL.len() {
        assert!(ALL[i].len() <= 15, "map name longer than 15 bytes");
        i += 1;
    }
    assert!(NETNS_PROBE.len() <= 15, "map name longer than 15 bytes");
};
