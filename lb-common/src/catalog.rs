//! The map catalog: every map's name (the kernel name and the pin file name are the same, at most
//! 15 bytes), its default capacity, and [`Capacities`], the sizes the agent creates the maps with. `lb-ebpf/src/maps.rs` declares each map with the same literal name; a test in
//! `tests/` checks that every constant here names a map in the object.
//!
//! Service and backend state lives in plain hash maps: an LRU map evicts before it is full, which
//! would silently drop a Service. Only flow state (socket reverse NAT, affinity, conntrack) is LRU.
//!
//! Maps that hold addresses exist once per family (`lb4_*`, `lb6_*`, [`FamilyMaps`]); ids
//! (backend ids, reverse-NAT ids) are one space across both families, so the maps keyed by an id
//! alone and the family-free ones (`lb_svc_names`, `lb_aff_match`, `lb_config`, counters) are
//! shared.

use crate::family::{Family, V4, V6};

/// Frontends and their backend slots: `Svc4Key` -> `Svc4Entry` (layout 2: the slot carries its
/// backend's entry). Written by the agent only.
pub const SERVICES: &str = "lb4_services";
/// Backends by id: `u32` -> `Backend4Value`. Written by the agent only.
pub const BACKENDS: &str = "lb4_backends";
/// Frontend address by reverse-NAT id: `u32` -> `RevNat4Value`. Written by the agent only.
pub const REVNAT: &str = "lb4_revnat";
/// The IPv6 twins of the maps above and below (same keys and values, `F = V6`).
pub const SERVICES6: &str = "lb6_services";
pub const BACKENDS6: &str = "lb6_backends";
pub const REVNAT6: &str = "lb6_revnat";
pub const SOCK_REVNAT6: &str = "lb6_sock_revnat";
pub const SOCK_REVNAT_SK6: &str = "lb6_sock_rev_sk";
pub const SOCK_CONN6: &str = "lb6_sock_conn";
pub const AFFINITY6: &str = "lb6_affinity";
pub const SOURCE_RANGES6: &str = "lb6_src_range";
pub const CONNTRACK6: &str = "lb6_ct";
pub const CONNTRACK_NEW6: &str = "lb6_ct_new";
pub const FRAGMENTS6: &str = "lb6_frags";
pub const CLUSTER_IPS6: &str = "lb6_cluster_ips";
pub const SERVICE_RANGES6: &str = "lb6_svc_ranges";
/// Service identity by reverse-NAT id: `u32` -> `SvcName`, for operators (CLI, bpftool); the
/// programs never read it.
pub const SVC_NAMES: &str = "lb_svc_names";
/// Per-socket reverse NAT of unconnected UDP sockets for recvmsg4 (LRU): `SockRevNat4Key` ->
/// `SockRevNat4Value`.
pub const SOCK_REVNAT: &str = "lb4_sock_revnat";
/// Per-socket reverse NAT of connected sockets (TCP, connected UDP and SCTP): an array of
/// `revnat::CONN_SLOTS` `SockConnSlot<V4>`, indexed by the low bits of the socket cookie
/// (`revnat::conn_slot`). Claimed by connect, read by recvmsg and getpeername, freed by
/// `lb_sock_release` when the socket closes. Fixed size.
pub const SOCK_CONN: &str = "lb4_sock_conn";
/// The fallback of [`SOCK_CONN`] for a socket whose slot another live socket holds, and what
/// sockets connected by a release before it keep (socket storage, `BPF_MAP_TYPE_SK_STORAGE`):
/// the socket -> `SockRevNat4Sk`. Not dumpable by bpftool (its key is a socket).
pub const SOCK_REVNAT_SK: &str = "lb4_sock_rev_sk";
/// ClientIP session affinity (LRU): `Affinity4Key` -> `AffinityValue`.
pub const AFFINITY: &str = "lb4_affinity";
/// Which backends may still serve an affinity entry, both families: `AffinityMatchKey` -> `u8`.
/// Written by the agent.
pub const AFFINITY_MATCH: &str = "lb_aff_match";
/// loadBalancerSourceRanges (LPM trie): `SrcRange4` prefix -> `u8`. Written by the agent.
pub const SOURCE_RANGES: &str = "lb4_src_range";
/// Connection tracking and NAT of the tc path (LRU): `Ct4Key` -> `Ct4Value`.
pub const CONNTRACK: &str = "lb4_ct";
/// The tc path's flows not yet established (LRU), same layout as `lb4_ct`: a new flow's entries
/// until its client goes past the handshake (`crate::conntrack`, "two tables").
pub const CONNTRACK_NEW: &str = "lb4_ct_new";
/// The ports of fragmented datagrams, from their first fragment (LRU, `crate::fragment`):
/// `Frag4Key` -> `FragPorts`. Written by the tc programs.
pub const FRAGMENTS: &str = "lb4_frags";
/// kube-proxy's cluster-ips-check (LPM trie, `crate::cluster_ip`): each cluster IP (host prefix)
/// and Service CIDR -> `cluster_ip::action`. Written by the agent.
pub const CLUSTER_IPS: &str = "lb4_cluster_ips";
/// The few prefixes covering every entry of `lb4_cluster_ips` (array, one
/// `cluster_ip::ServiceRanges`), checked before the trie. Written by the agent.
pub const SERVICE_RANGES: &str = "lb4_svc_ranges";
/// The tc programs' prefilter (`crate::prefilter`), an array of `prefilter::WORDS` 64-bit words:
/// `u32` -> `u64`. Written by the agent.
pub const PREFILTER: &str = "lb4_prefilter";
pub const PREFILTER6: &str = "lb6_prefilter";
/// The egress flow filter (`crate::ct_filter`, memory-mappable array of `ct_filter::WORDS` 64-bit
/// words): `u32` -> `u64`. Bytes set by the tc programs, cleared by the agent's conntrack GC.
pub const CT_FILTER: &str = "lb4_ct_filter";
pub const CT_FILTER6: &str = "lb6_ct_filter";
/// Datapath configuration, one entry: `u32` 0 -> `DatapathConfig`. Written by the agent.
pub const CONFIG: &str = "lb_config";
/// The node's pod interfaces under `--detect-local-mode` BridgeInterface or InterfaceNamePrefix
/// (kube-proxy's `-i` detectors): ifindex `u32` -> `u8` 1. Written by the agent at every sync.
pub const POD_INTERFACES: &str = "lb_pod_ifaces";
/// The masquerade addresses of the node's interfaces (`config::MasqueradeAddrs`): ifindex `u32`
/// -> both families' candidates, key 0 the fallback. Written by the agent when they change.
pub const MASQ_ADDRS: &str = "lb_masq_addrs";
/// What a listening `lb-agent monitor` asks for (`monitor::MonitorControl`): `u32` 0 -> the lease
/// and the event types. Written by the monitor only; read by the programs where an event could be.
pub const MONITOR: &str = "lb_monitor";
/// The programs' events for `lb-agent monitor` (ring buffer of `monitor::MonitorEvent`, written
/// only while a monitor listens).
pub const EVENTS: &str = "lb_events";
/// Maglev lookup tables (hash of maps, `crate::maglev`): rev_nat_id `u32` -> the frontend's own
/// inner array of `MaglevChunk`s. Written by the agent (a whole table swapped in at once).
pub const MAGLEV: &str = "lb_maglev";
/// The tc programs' tail calls (program array): [`TAIL_SCTP_INGRESS`] -> `lb_tc_sctp_in`, SCTP at
/// tc ingress; [`TAIL_SCTP_EGRESS`] -> `lb_tc_sctp_out`, the node's own SCTP to a frontend at tc
/// egress. Written by the agent after it loads the programs.
pub const TC_TAIL: &str = "lb_tc_tail";
/// `lb_tc_tail`'s slot of SCTP's ingress program.
pub const TAIL_SCTP_INGRESS: u32 = 0;
/// `lb_tc_tail`'s slot of SCTP's egress program (the node's own associations).
pub const TAIL_SCTP_EGRESS: u32 = 1;
/// `lb_tc_tail`'s size.
pub const TAIL_SLOTS: u32 = 2;
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
    SOCK_CONN,
    SOCK_REVNAT_SK,
    AFFINITY,
    AFFINITY_MATCH,
    SOURCE_RANGES,
    CONNTRACK,
    CONNTRACK_NEW,
    FRAGMENTS,
    CLUSTER_IPS,
    SERVICE_RANGES,
    PREFILTER,
    CT_FILTER,
    CONFIG,
    POD_INTERFACES,
    MASQ_ADDRS,
    MONITOR,
    EVENTS,
    STATS,
    REJECT_LIMIT,
    MAGLEV,
    TC_TAIL,
    SERVICES6,
    BACKENDS6,
    REVNAT6,
    SOCK_REVNAT6,
    SOCK_CONN6,
    SOCK_REVNAT_SK6,
    AFFINITY6,
    SOURCE_RANGES6,
    CONNTRACK6,
    CONNTRACK_NEW6,
    FRAGMENTS6,
    CLUSTER_IPS6,
    SERVICE_RANGES6,
    PREFILTER6,
    CT_FILTER6,
];

/// Map names an earlier release pinned and this one no longer uses; the agent removes their pins
/// once its programs are attached (`lb4_aff_match` became the shared `lb_aff_match`).
pub const RETIRED: &[&str] = &["lb4_aff_match"];

/// Layout version of every pinned map: a pin's file name carries it (`pin_name`), so an agent never
/// reads a pin of another layout. Bump a map's version when its key or value layout changes (and
/// have the agent's `datapath::migrate` convert its entries if they must survive the upgrade).
///
/// `lb_config` is at version 2: IPv6 added each family's settings to its one entry (the agent
/// writes it at start, so nothing is converted).
pub const LAYOUTS: &[(&str, u32)] = &[
    (SERVICES, 2),
    (BACKENDS, 1),
    (REVNAT, 1),
    (SVC_NAMES, 1),
    (SOCK_REVNAT, 1),
    (SOCK_CONN, 1),
    (SOCK_REVNAT_SK, 1),
    (AFFINITY, 1),
    (AFFINITY_MATCH, 1),
    (SOURCE_RANGES, 1),
    (CONNTRACK, 1),
    (CONNTRACK_NEW, 1),
    (FRAGMENTS, 1),
    (CLUSTER_IPS, 1),
    (SERVICE_RANGES, 1),
    (PREFILTER, 1),
    (CT_FILTER, 1),
    (CONFIG, 2),
    (POD_INTERFACES, 1),
    (MASQ_ADDRS, 1),
    (MONITOR, 1),
    (EVENTS, 1),
    (STATS, 1),
    (REJECT_LIMIT, 1),
    (MAGLEV, 1),
    (TC_TAIL, 1),
    (SERVICES6, 2),
    (BACKENDS6, 1),
    (REVNAT6, 1),
    (SOCK_REVNAT6, 1),
    (SOCK_CONN6, 1),
    (SOCK_REVNAT_SK6, 1),
    (AFFINITY6, 1),
    (SOURCE_RANGES6, 1),
    (CONNTRACK6, 1),
    (CONNTRACK_NEW6, 1),
    (FRAGMENTS6, 1),
    (CLUSTER_IPS6, 1),
    (SERVICE_RANGES6, 1),
    (PREFILTER6, 1),
    (CT_FILTER6, 1),
];

/// The pin file name of a map at its current layout version, as `Display`: the map's name at
/// version 1 (`lb4_services`), else suffixed (`lb_config_v2`).
pub fn pin_name(name: &str) -> PinName<'_> {
    let version = LAYOUTS.iter().find(|(n, _)| *n == name).map_or(1, |(_, v)| *v);
    PinName { name, version }
}

/// See [`pin_name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinName<'a> {
    pub name: &'a str,
    pub version: u32,
}

impl core::fmt::Display for PinName<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if self.version == 1 {
            f.write_str(self.name)
        } else {
            write!(f, "{}_v{}", self.name, self.version)
        }
    }
}

/// The names of the maps that exist once per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FamilyMapNames {
    pub services: &'static str,
    pub backends: &'static str,
    pub revnat: &'static str,
    pub sock_revnat: &'static str,
    pub sock_conn: &'static str,
    pub sock_revnat_sk: &'static str,
    pub affinity: &'static str,
    pub source_ranges: &'static str,
    pub conntrack: &'static str,
    pub conntrack_new: &'static str,
    pub fragments: &'static str,
    pub cluster_ips: &'static str,
    pub service_ranges: &'static str,
    pub prefilter: &'static str,
    pub ct_filter: &'static str,
}

/// The maps of a family, by name.
pub trait FamilyMaps: Family {
    const MAPS: FamilyMapNames;
}

impl FamilyMaps for V4 {
    const MAPS: FamilyMapNames = FamilyMapNames {
        services: SERVICES,
        backends: BACKENDS,
        revnat: REVNAT,
        sock_revnat: SOCK_REVNAT,
        sock_conn: SOCK_CONN,
        sock_revnat_sk: SOCK_REVNAT_SK,
        affinity: AFFINITY,
        source_ranges: SOURCE_RANGES,
        conntrack: CONNTRACK,
        conntrack_new: CONNTRACK_NEW,
        fragments: FRAGMENTS,
        cluster_ips: CLUSTER_IPS,
        service_ranges: SERVICE_RANGES,
        prefilter: PREFILTER,
        ct_filter: CT_FILTER,
    };
}

impl FamilyMaps for V6 {
    const MAPS: FamilyMapNames = FamilyMapNames {
        services: SERVICES6,
        backends: BACKENDS6,
        revnat: REVNAT6,
        sock_revnat: SOCK_REVNAT6,
        sock_conn: SOCK_CONN6,
        sock_revnat_sk: SOCK_REVNAT_SK6,
        affinity: AFFINITY6,
        source_ranges: SOURCE_RANGES6,
        conntrack: CONNTRACK6,
        conntrack_new: CONNTRACK_NEW6,
        fragments: FRAGMENTS6,
        cluster_ips: CLUSTER_IPS6,
        service_ranges: SERVICE_RANGES6,
        prefilter: PREFILTER6,
        ct_filter: CT_FILTER6,
    };
}

/// Default capacities. The agent overrides them with flags (`--bpf-lb-map-max` and friends) before
/// the maps are created; a pinned map keeps its size until it is migrated.
pub mod capacity {
    /// Frontends plus backend slots (10,000 Services x 10 endpoints need ~110,000).
    pub const SERVICES: u32 = 262_144;
    /// Distinct backends (ip, port, protocol) across all Services.
    pub const BACKENDS: u32 = 65_536;
    /// Frontends (one reverse-NAT id each).
    pub const REVNAT: u32 = 65_536;
    /// Socket reverse NAT of unconnected UDP sockets (LRU).
    pub const SOCK_REVNAT: u32 = 262_144;
    pub const AFFINITY: u32 = 65_536;
    pub const AFFINITY_MATCH: u32 = 262_144;
    pub const SOURCE_RANGES: u32 = 16_384;
    /// Established flows: three entries per masqueraded flow, two per other flow.
    pub const CONNTRACK: u32 = 262_144;
    /// Flows in their handshake: a few seconds of new flows at a high rate, or of a flood.
    pub const CONNTRACK_NEW: u32 = 65_536;
    /// Fragmented datagrams in flight (their first fragment seen, a later one not yet): fixed,
    /// as Cilium's `--bpf-fragments-map-max` default.
    pub const FRAGMENTS: u32 = 8_192;
    /// Cluster IPs and Service CIDRs of one family: one per frontend at most, and room for the
    /// CIDRs (the agent creates it from `Capacities::revnat`).
    pub const CLUSTER_IPS: u32 = REVNAT + crate::cluster_ip::SERVICE_CIDR_ROOM;
    /// Pod interfaces of one node (a bridge and its ports, or every pod veth): fixed.
    pub const POD_INTERFACES: u32 = 16_384;
    /// Interfaces with an address (and the fallback entry): fixed, as `POD_INTERFACES`.
    pub const MASQ_ADDRS: u32 = 16_384;
    /// `lb_events`' bytes (a ring buffer's size is a power of two of pages): ~9,000 events of 112
    /// bytes and their 8-byte headers, a few seconds of a busy node's new flows for a monitor
    /// that reads every 100 ms at the latest.
    pub const EVENTS: u32 = 1 << 20;
}

/// The most frontends (reverse-NAT ids) a family may have: ids of both families
/// (`IPv6 = IPv4 capacity + 1 ..`) must fit the 20 bits of id the tc path's un-SNAT mark carries
/// (`lb-ebpf/src/tc/conntrack.rs::MARK_ID`).
pub const MAX_REVNAT_PER_FAMILY: u32 = 0x7_FFFF;

/// Map capacities (`max_entries`): what the agent creates the maps with (flags such as
/// `--bpf-lb-map-max`), and what bounds the entries its writer may add. A per-family map of each
/// family gets the capacity (`lb4_services` and `lb6_services` both `services`).
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
    pub conntrack_new: u32,
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
        conntrack_new: capacity::CONNTRACK_NEW,
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
