//! The family a program instance serves: the type of each map that exists once per family, and
//! which static serves which family ([`FamilyMaps`]). The socket and tc code is written once over
//! `F: FamilyMaps` and monomorphised for `V4` and `V6`.

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC, BPF_F_RDONLY_PROG},
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, SkStorage},
};
use lb_common::{
    affinity::{AffinityClient, AffinityKey, AffinityValue},
    backend::BackendValue,
    catalog::capacity,
    cluster_ip::{ClusterIpKey, ServiceRanges},
    config::FamilySettings,
    conntrack::{CtKey, CtValue},
    ct_filter,
    family::{V4, V6},
    fragment::{FragKey, FragPorts},
    prefilter,
    revnat::{self, RevNatValue, SockConnSlot, SockRevNatKey, SockRevNatSk, SockRevNatValue},
    service::{SrcRange, SvcEntry, SvcKey},
};

use crate::maps::{
    AFFINITY4, AFFINITY6, BACKENDS4, BACKENDS6, CLUSTER_IPS4, CLUSTER_IPS6, CONNTRACK_NEW4, CONNTRACK_NEW6,
    CONNTRACK4, CONNTRACK6, CT_FILTER4, CT_FILTER6, FRAGMENTS4, FRAGMENTS6, PREFILTER4, PREFILTER6, REVNAT4,
    REVNAT6, SERVICE_RANGES4, SERVICE_RANGES6, SERVICES4, SERVICES6, SOCK_CONN4, SOCK_CONN6, SOCK_REVNAT_SK4,
    SOCK_REVNAT_SK6, SOCK_REVNAT4, SOCK_REVNAT6, SOURCE_RANGES4, SOURCE_RANGES6,
};

pub const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;
/// The programs only read what the agent writes; the verifier enforces it.
pub const RDONLY_PROG: usize = BPF_F_RDONLY_PROG as usize;
/// The agent writes the array through a memory mapping (byte stores beside the programs' own).
pub const MMAPABLE: usize = BPF_F_MMAPABLE as usize;

pub type ServicesMap<F> =
    HashMap<SvcKey<F>, SvcEntry<F>, { capacity::SERVICES as usize }, { NO_PREALLOC | RDONLY_PROG }>;
pub type BackendsMap<F> =
    HashMap<u32, BackendValue<F>, { capacity::BACKENDS as usize }, { NO_PREALLOC | RDONLY_PROG }>;
pub type RevNatMap<F> =
    HashMap<u32, RevNatValue<F>, { capacity::REVNAT as usize }, { NO_PREALLOC | RDONLY_PROG }>;
pub type SockRevNatMap<F> =
    LruHashMap<SockRevNatKey<F>, SockRevNatValue<F>, { capacity::SOCK_REVNAT as usize }>;
pub type SockConnMap<F> = Array<SockConnSlot<F>, { revnat::CONN_SLOTS as usize }>;
pub type SockRevNatSkMap<F> = SkStorage<SockRevNatSk<F>>;
pub type AffinityMap<F> = LruHashMap<AffinityKey<F>, AffinityValue, { capacity::AFFINITY as usize }>;
pub type SourceRangesMap<F> =
    LpmTrie<SrcRange<F>, u8, { capacity::SOURCE_RANGES as usize }, { NO_PREALLOC | RDONLY_PROG }>;
pub type ConntrackMap<F> = LruHashMap<CtKey<F>, CtValue<F>, { capacity::CONNTRACK as usize }>;
pub type FragmentsMap<F> = LruHashMap<FragKey<F>, FragPorts, { capacity::FRAGMENTS as usize }>;
pub type PrefilterMap = Array<u64, { prefilter::WORDS as usize }, RDONLY_PROG>;
pub type CtFilterMap = Array<u64, { ct_filter::WORDS as usize }, MMAPABLE>;
pub type ClusterIpsMap<F> =
    LpmTrie<ClusterIpKey<F>, u8, { capacity::CLUSTER_IPS as usize }, { NO_PREALLOC | RDONLY_PROG }>;
pub type ServiceRangesMap<F> = Array<ServiceRanges<F>, 1, RDONLY_PROG>;

/// Writes `value` at `key` in an LRU map and marks the entry used: for every entry a later packet
/// needs (a flow's conntrack entries, an affinity, a datagram's reverse NAT). The kernel writes a
/// new LRU entry with its reference bit clear, and a CPU refilling its free list evicts
/// unreferenced entries first (or steals another CPU's): once every older entry has been
/// referenced, as after a flood, those are the newest, and a flow's un-SNAT entry went before
/// the reply that needed it. A program's lookup sets the bit.
#[inline(always)]
pub fn insert_used<K, V, const N: usize, const FLAGS: usize>(
    map: &LruHashMap<K, V, N, FLAGS>,
    key: &K,
    value: &V,
    flags: u64,
) -> Result<(), i32> {
    map.insert(key, value, flags)?;
    let _ = map.get_ptr(key);
    Ok(())
}

/// The maps of one family.
pub trait FamilyMaps: FamilySettings + AffinityClient {
    fn services() -> &'static ServicesMap<Self>;
    fn backends() -> &'static BackendsMap<Self>;
    fn revnat() -> &'static RevNatMap<Self>;
    fn sock_revnat() -> &'static SockRevNatMap<Self>;
    /// Connected sockets' reverse NAT, a slot per socket cookie (`lb4_sock_conn`).
    fn sock_conn() -> &'static SockConnMap<Self>;
    fn sock_revnat_sk() -> &'static SockRevNatSkMap<Self>;
    fn affinity() -> &'static AffinityMap<Self>;
    fn source_ranges() -> &'static SourceRangesMap<Self>;
    fn conntrack() -> &'static ConntrackMap<Self>;
    /// The conntrack table of flows not yet established (`lb4_ct_new`).
    fn conntrack_new() -> &'static ConntrackMap<Self>;
    /// The ports of fragmented datagrams (`lb4_frags`).
    fn fragments() -> &'static FragmentsMap<Self>;
    fn prefilter() -> &'static PrefilterMap;
    /// The egress flow filter (`lb4_ct_filter`, `lb_common::ct_filter`).
    fn ct_filter() -> &'static CtFilterMap;
    /// Cluster IPs and Service CIDRs (`lb4_cluster_ips`, `lb_common::cluster_ip`).
    fn cluster_ips() -> &'static ClusterIpsMap<Self>;
    /// The prefixes covering them (`lb4_svc_ranges`).
    fn service_ranges() -> &'static ServiceRangesMap<Self>;
}

macro_rules! family_maps {
    ($family:ty, $services:ident, $backends:ident, $revnat:ident, $sock_revnat:ident,
     $sock_conn:ident, $sock_revnat_sk:ident, $affinity:ident, $source_ranges:ident, $conntrack:ident,
     $conntrack_new:ident, $fragments:ident, $prefilter:ident, $cluster_ips:ident,
     $service_ranges:ident, $ct_filter:ident) => {
        #[inline(always)]
        fn services() -> &'static ServicesMap<$family> {
            &$services
        }
        #[inline(always)]
        fn backends() -> &'static BackendsMap<$family> {
            &$backends
        }
        #[inline(always)]
        fn revnat() -> &'static RevNatMap<$family> {
            &$revnat
        }
        #[inline(always)]
        fn sock_revnat() -> &'static SockRevNatMap<$family> {
            &$sock_revnat
        }
        #[inline(always)]
        fn sock_conn() -> &'static SockConnMap<$family> {
            &$sock_conn
        }
        #[inline(always)]
        fn sock_revnat_sk() -> &'static SockRevNatSkMap<$family> {
            &$sock_revnat_sk
        }
        #[inline(always)]
        fn affinity() -> &'static AffinityMap<$family> {
            &$affinity
        }
        #[inline(always)]
        fn source_ranges() -> &'static SourceRangesMap<$family> {
            &$source_ranges
        }
        #[inline(always)]
        fn conntrack() -> &'static ConntrackMap<$family> {
            &$conntrack
        }
        #[inline(always)]
        fn conntrack_new() -> &'static ConntrackMap<$family> {
            &$conntrack_new
        }
        #[inline(always)]
        fn fragments() -> &'static FragmentsMap<$family> {
            &$fragments
        }
        #[inline(always)]
        fn prefilter() -> &'static PrefilterMap {
            &$prefilter
        }
        #[inline(always)]
        fn ct_filter() -> &'static CtFilterMap {
            &$ct_filter
        }
        #[inline(always)]
        fn cluster_ips() -> &'static ClusterIpsMap<$family> {
            &$cluster_ips
        }
        #[inline(always)]
        fn service_ranges() -> &'static ServiceRangesMap<$family> {
            &$service_ranges
        }
    };
}

impl FamilyMaps for V4 {
    family_maps!(
        V4,
        SERVICES4,
        BACKENDS4,
        REVNAT4,
        SOCK_REVNAT4,
        SOCK_CONN4,
        SOCK_REVNAT_SK4,
        AFFINITY4,
        SOURCE_RANGES4,
        CONNTRACK4,
        CONNTRACK_NEW4,
        FRAGMENTS4,
        PREFILTER4,
        CLUSTER_IPS4,
        SERVICE_RANGES4,
        CT_FILTER4
    );
}

impl FamilyMaps for V6 {
    family_maps!(
        V6,
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
        PREFILTER6,
        CLUSTER_IPS6,
        SERVICE_RANGES6,
        CT_FILTER6
    );
}
