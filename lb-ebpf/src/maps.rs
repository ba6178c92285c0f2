//! Every map of the data path. Names match `lb_common::catalog`; capacities here are compile-time
//! defaults that the agent overrides before load (`EbpfLoader::map_max_entries`). The agent pins
//! the maps under `<bpf-root>/maps/<name>`; nothing is pinned by the object itself, so tests that
//! load it stay unpinned.
//!
//! A map that holds addresses exists once per family, declared from the one type of
//! `crate::family` (`lb4_services` and `lb6_services` are both a `ServicesMap<F>`).

use aya_ebpf::{
    bindings::BPF_F_INNER_MAP,
    btf_maps::{Array, HashMap, HashOfMaps, PerCpuArray, ProgramArray, RingBuf},
    macros::btf_map,
};
use lb_common::{
    affinity::AffinityMatchKey,
    catalog::capacity,
    config::{DatapathConfig, MasqueradeAddrs},
    family::{V4, V6},
    features::NetnsProbe,
    maglev::MaglevChunk,
    monitor::{MonitorControl, MonitorEvent},
    ratelimit::RateBucket,
    revnat::SvcName,
    stats,
};

use crate::family::{
    AffinityMap, BackendsMap, ClusterIpsMap, ConntrackMap, CtFilterMap, FragmentsMap, NO_PREALLOC,
    PrefilterMap, RDONLY_PROG, RevNatMap, ServiceRangesMap, ServicesMap, SockConnMap, SockRevNatMap,
    SockRevNatSkMap, SourceRangesMap,
};

/// Frontends and backend slots. Key: frontend (address, port, protocol, scope, slot). Value: slot 0
/// holds the frontend entry (count, flags, rev_nat_id), slots 1..=count a backend id each and a
/// copy of that backend's entry (pinned as `lb4_services_v2`, layout 2).
/// Writer: agent. Readers: every translating program.
#[btf_map(name = "lb4_services")]
pub static SERVICES4: ServicesMap<V4> = ServicesMap::new();
#[btf_map(name = "lb6_services")]
pub static SERVICES6: ServicesMap<V6> = ServicesMap::new();

/// Backend id -> address, port, protocol. Writer: agent. Readers: every translating program.
#[btf_map(name = "lb4_backends")]
pub static BACKENDS4: BackendsMap<V4> = BackendsMap::new();
#[btf_map(name = "lb6_backends")]
pub static BACKENDS6: BackendsMap<V6> = BackendsMap::new();

/// rev_nat_id -> frontend address. Writer: agent. Readers: reverse translation (stale checks).
#[btf_map(name = "lb4_revnat")]
pub static REVNAT4: RevNatMap<V4> = RevNatMap::new();
#[btf_map(name = "lb6_revnat")]
pub static REVNAT6: RevNatMap<V6> = RevNatMap::new();

/// rev_nat_id -> `namespace/name:port`, for operators, both families. Never read by a program.
#[btf_map(name = "lb_svc_names")]
pub static SVC_NAMES: HashMap<u32, SvcName, { capacity::REVNAT as usize }, { NO_PREALLOC | RDONLY_PROG }> =
    HashMap::new();

/// (socket cookie, backend address, port) -> frontend. Writers: connect, sendmsg. Readers:
/// recvmsg, getpeername. LRU: an entry may go, the reply then shows the backend address.
#[btf_map(name = "lb4_sock_revnat")]
pub static SOCK_REVNAT4: SockRevNatMap<V4> = SockRevNatMap::new();
#[btf_map(name = "lb6_sock_revnat")]
pub static SOCK_REVNAT6: SockRevNatMap<V6> = SockRevNatMap::new();

/// A slot per socket cookie (`lb_common::revnat::SockConnSlot`): the backend a connected socket's
/// connect() went to and the frontend it called. Claimer: connect. Readers: recvmsg,
/// getpeername (first). Freed by `lb_sock_release` when the socket closes. An AF_INET6 socket
/// talking IPv4 (IPv4-mapped addresses) keeps its record in the IPv4 map.
#[btf_map(name = "lb4_sock_conn")]
pub static SOCK_CONN4: SockConnMap<V4> = SockConnMap::new();
#[btf_map(name = "lb6_sock_conn")]
pub static SOCK_CONN6: SockConnMap<V6> = SockConnMap::new();

/// The same record in the socket's own storage, while another open socket holds its slot of
/// `lb4_sock_conn` (and for sockets an earlier release connected). Freed with the socket.
#[btf_map(name = "lb4_sock_rev_sk")]
pub static SOCK_REVNAT_SK4: SockRevNatSkMap<V4> = SockRevNatSkMap::new();
#[btf_map(name = "lb6_sock_rev_sk")]
pub static SOCK_REVNAT_SK6: SockRevNatSkMap<V6> = SockRevNatSkMap::new();

/// (client, rev_nat_id) -> backend and last use. Writer and reader: the translating programs.
#[btf_map(name = "lb4_affinity")]
pub static AFFINITY4: AffinityMap<V4> = AffinityMap::new();
#[btf_map(name = "lb6_affinity")]
pub static AFFINITY6: AffinityMap<V6> = AffinityMap::new();

/// (backend id, rev_nat_id) pairs an affinity entry may still use, both families. Writer: agent.
#[btf_map(name = "lb_aff_match")]
pub static AFFINITY_MATCH: HashMap<
    AffinityMatchKey,
    u8,
    { capacity::AFFINITY_MATCH as usize },
    { NO_PREALLOC | RDONLY_PROG },
> = HashMap::new();

/// loadBalancerSourceRanges: (rev_nat_id, source prefix) -> 1. Writer: agent.
#[btf_map(name = "lb4_src_range")]
pub static SOURCE_RANGES4: SourceRangesMap<V4> = SourceRangesMap::new();
#[btf_map(name = "lb6_src_range")]
pub static SOURCE_RANGES6: SourceRangesMap<V6> = SourceRangesMap::new();

/// The tc path's NAT table: one entry per direction and rewrite of each flow (see
/// `lb_common::conntrack`). Writers: tc ingress (flows; close marks also at egress), the agent's
/// conntrack GC (deletes ended flows). Readers: tc ingress and egress. LRU: flow state.
#[btf_map(name = "lb4_ct")]
pub static CONNTRACK4: ConntrackMap<V4> = ConntrackMap::new();
#[btf_map(name = "lb6_ct")]
pub static CONNTRACK6: ConntrackMap<V6> = ConntrackMap::new();

/// The same table for flows not yet established (`lb_common::conntrack`, "two tables"): a new
/// flow's entries are written here and move to `lb4_ct` when its client goes past the handshake,
/// so that a flood of unanswered SYNs or one-datagram UDP evicts only its own kind. Writers: tc
/// ingress, the agent's conntrack GC. Readers: tc ingress and egress, after `lb4_ct`.
#[btf_map(name = "lb4_ct_new")]
pub static CONNTRACK_NEW4: ConntrackMap<V4> = ConntrackMap::new();
#[btf_map(name = "lb6_ct_new")]
pub static CONNTRACK_NEW6: ConntrackMap<V6> = ConntrackMap::new();

/// The ports of fragmented datagrams (`lb_common::fragment`), from their first fragment, for the
/// later ones. Writers and readers: tc ingress and egress. LRU: a datagram's fragments arrive
/// within moments of each other.
#[btf_map(name = "lb4_frags")]
pub static FRAGMENTS4: FragmentsMap<V4> = FragmentsMap::new();
#[btf_map(name = "lb6_frags")]
pub static FRAGMENTS6: FragmentsMap<V6> = FragmentsMap::new();

/// kube-proxy's cluster-ips-check (`lb_common::cluster_ip`): cluster IPs (host prefixes) and Service
/// CIDRs -> reject or drop. Writer: agent. Readers: the socket programs and tc ingress, for traffic
/// no frontend matched.
#[btf_map(name = "lb4_cluster_ips")]
pub static CLUSTER_IPS4: ClusterIpsMap<V4> = ClusterIpsMap::new();
#[btf_map(name = "lb6_cluster_ips")]
pub static CLUSTER_IPS6: ClusterIpsMap<V6> = ClusterIpsMap::new();

/// The prefixes covering every entry of `lb4_cluster_ips`, read before it. Writer: agent.
#[btf_map(name = "lb4_svc_ranges")]
pub static SERVICE_RANGES4: ServiceRangesMap<V4> = ServiceRangesMap::new();
#[btf_map(name = "lb6_svc_ranges")]
pub static SERVICE_RANGES6: ServiceRangesMap<V6> = ServiceRangesMap::new();

/// The tc programs' prefilter (`lb_common::prefilter`): bit `b` is bit `b % 64` of word `b / 64`.
/// Writer: agent. Readers: tc ingress and egress.
#[btf_map(name = "lb4_prefilter")]
pub static PREFILTER4: PrefilterMap = PrefilterMap::new();
#[btf_map(name = "lb6_prefilter")]
pub static PREFILTER6: PrefilterMap = PrefilterMap::new();

/// The egress flow filter (`lb_common::ct_filter`): word 0 the control word, then two bytes per
/// bucket. Writers: tc ingress (a new flow's egress entries), the agent (clears, through a memory
/// mapping). Reader: tc egress.
#[btf_map(name = "lb4_ct_filter")]
pub static CT_FILTER4: CtFilterMap = CtFilterMap::new();
#[btf_map(name = "lb6_ct_filter")]
pub static CT_FILTER6: CtFilterMap = CtFilterMap::new();

/// Node-wide settings, index 0. Writer: agent.
#[btf_map(name = "lb_config")]
pub static CONFIG: Array<DatapathConfig, 1, RDONLY_PROG> = Array::new();

/// The node's pod interfaces (ifindex -> 1) when the local-traffic detector is the ingress
/// interface (`flags::DETECT_LOCAL_BY_INTERFACE`). Writer: agent. Reader: tc ingress (new flows).
#[btf_map(name = "lb_pod_ifaces")]
pub static POD_INTERFACES: HashMap<
    u32,
    u8,
    { capacity::POD_INTERFACES as usize },
    { NO_PREALLOC | RDONLY_PROG },
> = HashMap::new();

/// The masquerade addresses of the node's interfaces (ifindex -> both families' candidates; 0:
/// the node's primary IPs), read when `flags::MASQUERADE_BY_INTERFACE` is set. Writer: agent.
/// Reader: tc ingress (new flows, `tc/snat.rs`).
#[btf_map(name = "lb_masq_addrs")]
pub static MASQ_ADDRS: HashMap<
    u32,
    MasqueradeAddrs,
    { capacity::MASQ_ADDRS as usize },
    { NO_PREALLOC | RDONLY_PROG },
> = HashMap::new();

/// What a listening `lb-agent monitor` asks for (`lb_common::monitor`), index 0. Writer: the
/// monitor. Readers: every program, where an event could be written.
#[btf_map(name = "lb_monitor")]
pub static MONITOR: Array<MonitorControl, 1, RDONLY_PROG> = Array::new();

/// Events for `lb-agent monitor`, written only while one listens. Writers: the programs.
#[btf_map(name = "lb_events")]
pub static EVENTS: RingBuf<MonitorEvent, { capacity::EVENTS as usize }> = RingBuf::new();

/// Maglev lookup tables (`lb_common::maglev`): rev_nat_id -> the frontend's inner array of
/// backend-id chunks (shared by a Service port's frontends). Writer: agent (creates a table
/// whole, then swaps it in with one update).
/// Readers: the translating programs, for frontends with `flags::MAGLEV`.
#[btf_map(name = "lb_maglev")]
pub static MAGLEV: HashOfMaps<
    u32,
    MaglevTable,
    { 2 * capacity::REVNAT as usize },
    { NO_PREALLOC | RDONLY_PROG },
> = HashOfMaps::new();

/// The inner map's template: tables of any size share it (`BPF_F_INNER_MAP` lets an inner array
/// differ from it in `max_entries` only).
pub type MaglevTable = Array<MaglevChunk, 1, { BPF_F_INNER_MAP as usize | RDONLY_PROG }>;

/// Per-CPU event counters, indexed by `lb_common::stats::Counter`.
#[btf_map(name = "lb_stats")]
pub static STATS: PerCpuArray<u64, { stats::COUNT as usize }> = PerCpuArray::new();

/// Per-CPU token bucket of the ICMP port-unreachable answers (`lb_common::ratelimit`), both
/// families. Writer: tc ingress.
#[btf_map(name = "lb_reject_rl")]
pub static REJECT_LIMIT: PerCpuArray<RateBucket, 1> = PerCpuArray::new();

/// The agent's own network namespace cookie on kernels without `SO_NETNS_COOKIE` (see
/// `lb_common::features::NetnsProbe`). Writers: the agent (socket cookie), `lb_probe_netns`
/// (netns cookie). Never pinned.
#[btf_map(name = "lb_netns_probe")]
pub static NETNS_PROBE: Array<NetnsProbe, 1> = Array::new();

/// The tc programs' tail calls: `catalog::TAIL_SCTP_INGRESS` -> `lb_tc_sctp_in`,
/// `catalog::TAIL_SCTP_EGRESS` -> `lb_tc_sctp_out`. Writer: agent. Readers: `lb_tc_ingress`,
/// `lb_tc_egress`.
#[btf_map(name = "lb_tc_tail")]
pub static TC_TAIL: ProgramArray<{ lb_common::catalog::TAIL_SLOTS as usize }> = ProgramArray::new();
