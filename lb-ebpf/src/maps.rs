//! Every map of the data path. Names match `lb_common::catalog`; capacities here are compile-time
//! defaults that the agent overrides before load (`EbpfLoader::map_max_entries`). The agent pins
//! the maps under `<bpf-root>/maps/<name>`; nothing is pinned by the object itself, so tests that
//! load it stay unpinned.

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_F_RDONLY_PROG},
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, SkStorage},
    macros::btf_map,
};
use lb_common::{
    affinity::{Affinity4Key, Affinity4Value, AffinityMatchKey},
    backend::Backend4Value,
    catalog::capacity,
    config::DatapathConfig,
    conntrack::{Ct4Key, Ct4Value},
    features::NetnsProbe,
    ratelimit::RateBucket,
    revnat::{RevNat4Value, SockRevNat4Key, SockRevNat4Sk, SockRevNat4Value, SvcName},
    service::{SrcRange4, Svc4Key, Svc4Value},
    stats,
};

const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;
/// The programs only read what the agent writes; the verifier enforces it.
const RDONLY_PROG: usize = BPF_F_RDONLY_PROG as usize;

/// Frontends and backend slots. Key: frontend (address, port, protocol, scope, slot). Value: slot 0
/// holds the frontend entry (count, flags, rev_nat_id), slots 1..=count a backend id each.
/// Writer: agent. Readers: every translating program.
#[btf_map(name = "lb4_services")]
pub static SERVICES: HashMap<
    Svc4Key,
    Svc4Value,
    { capacity::SERVICES as usize },
    { NO_PREALLOC | RDONLY_PROG },
> = HashMap::new();

/// Backend id -> address, port, protocol. Writer: agent. Readers: every translating program.
#[btf_map(name = "lb4_backends")]
pub static BACKENDS: HashMap<
    u32,
    Backend4Value,
    { capacity::BACKENDS as usize },
    { NO_PREALLOC | RDONLY_PROG },
> = HashMap::new();

/// rev_nat_id -> frontend address. Writer: agent. Readers: reverse translation (stale checks).
#[btf_map(name = "lb4_revnat")]
pub static REVNAT: HashMap<u32, RevNat4Value, { capacity::REVNAT as usize }, { NO_PREALLOC | RDONLY_PROG }> =
    HashMap::new();

/// rev_nat_id -> `namespace/name:port`, for operators. Never read by a program.
#[btf_map(name = "lb_svc_names")]
pub static SVC_NAMES: HashMap<u32, SvcName, { capacity::REVNAT as usize }, { NO_PREALLOC | RDONLY_PROG }> =
    HashMap::new();

/// (socket cookie, backend address, port) -> frontend. Writers: connect4, sendmsg4. Readers:
/// recvmsg4, getpeername4. LRU: an entry may go, the reply then shows the backend address.
#[btf_map(name = "lb4_sock_revnat")]
pub static SOCK_REVNAT: LruHashMap<SockRevNat4Key, SockRevNat4Value, { capacity::SOCK_REVNAT as usize }> =
    LruHashMap::new();

/// Socket -> the backend its connect() went to and the frontend it called. Writer: connect4.
/// Readers: recvmsg4, getpeername4 (before `lb4_sock_revnat`). Freed with the socket.
#[btf_map(name = "lb4_sock_rev_sk")]
pub static SOCK_REVNAT_SK: SkStorage<SockRevNat4Sk> = SkStorage::new();

/// (client, rev_nat_id) -> backend and last use. Writer and reader: the translating programs.
#[btf_map(name = "lb4_affinity")]
pub static AFFINITY: LruHashMap<Affinity4Key, Affinity4Value, { capacity::AFFINITY as usize }> =
    LruHashMap::new();

/// (backend id, rev_nat_id) pairs an affinity entry may still use. Writer: agent.
#[btf_map(name = "lb4_aff_match")]
pub static AFFINITY_MATCH: HashMap<
    AffinityMatchKey,
    u8,
    { capacity::AFFINITY_MATCH as usize },
    { NO_PREALLOC | RDONLY_PROG },
> = HashMap::new();

/// loadBalancerSourceRanges: (rev_nat_id, source prefix) -> 1. Writer: agent.
#[btf_map(name = "lb4_src_range")]
pub static SOURCE_RANGES: LpmTrie<
    SrcRange4,
    u8,
    { capacity::SOURCE_RANGES as usize },
    { NO_PREALLOC | RDONLY_PROG },
> = LpmTrie::new();

/// The tc path's NAT table: one entry per direction and rewrite of each flow (see
/// `lb_common::conntrack`). Writers: tc ingress (flows; close marks also at egress), the agent's
/// conntrack GC (deletes ended flows). Readers: tc ingress and egress. LRU: flow state.
#[btf_map(name = "lb4_ct")]
pub static CONNTRACK: LruHashMap<Ct4Key, Ct4Value, { capacity::CONNTRACK as usize }> = LruHashMap::new();

/// Node-wide settings, index 0. Writer: agent.
#[btf_map(name = "lb_config")]
pub static CONFIG: Array<DatapathConfig, 1, RDONLY_PROG> = Array::new();

/// Per-CPU event counters, indexed by `lb_common::stats::Counter`.
#[btf_map(name = "lb_stats")]
pub static STATS: PerCpuArray<u64, { stats::COUNT as usize }> = PerCpuArray::new();

/// Per-CPU token bucket of the ICMP port-unreachable answers (`lb_common::ratelimit`). Writer: tc
/// ingress.
#[btf_map(name = "lb_reject_rl")]
pub static REJECT_LIMIT: PerCpuArray<RateBucket, 1> = PerCpuArray::new();

/// The agent's own network namespace cookie on kernels without `SO_NETNS_COOKIE` (see
/// `lb_common::features::NetnsProbe`). Writers: the agent (socket cookie), `lb_probe_netns`
/// (netns cookie). Never pinned.
#[btf_map(name = "lb_netns_probe")]
pub static NETNS_PROBE: Array<NetnsProbe, 1> = Array::new();
