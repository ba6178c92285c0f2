//! The services maps (`lb4_services`, `lb6_services`), modelled on Cilium's `lb4_key`/`lb4_service`.
//!
//! One frontend (address, port, protocol) owns up to two *scopes*, each a run of entries:
//! - slot 0: the frontend entry (`count`, `flags`, `rev_nat_id`, affinity timeout);
//! - slots 1..=count: one backend id each.
//!
//! Readers look up slot 0, pick `n` in `1..=count`, then look up slot `n`, which carries a copy of
//! its backend's entry ([`SvcEntry`]): choosing a backend costs two lookups, not three (each is a
//! likely cache and TLB miss in a real connection). Writers therefore write backends first, then
//! slots, then slot 0, then delete what is stale, so a reader never follows a slot to a missing
//! backend; a backend whose flags change has its slots rewritten with it (see
//! `lb-agent/src/apply/applier.rs`).

use crate::{
    backend::BackendValue,
    family::{Family, V4, V6},
    user_pod,
};

/// Traffic from outside this node (tc path); the only scope of most frontends.
pub const SCOPE_EXTERNAL: u8 = 0;
/// Traffic that starts on this node (sockets, and pods seen at tc) to a frontend with
/// externalTrafficPolicy=Local: kube-proxy sends it to the cluster-wide endpoints.
pub const SCOPE_INTERNAL: u8 = 1;

/// Frontend kinds, and what the frontend entry asks the programs to do.
pub mod flags {
    pub const CLUSTER_IP: u16 = 1 << 0;
    pub const NODE_PORT: u16 = 1 << 1;
    pub const EXTERNAL_IP: u16 = 1 << 2;
    pub const LOAD_BALANCER: u16 = 1 << 3;
    /// `127.0.0.1:<nodePort>`: reachable from this node's sockets only.
    pub const LOCALHOST: u16 = 1 << 4;
    /// Node- and pod-originated traffic must use the `SCOPE_INTERNAL` entries.
    pub const TWO_SCOPES: u16 = 1 << 5;
    /// sessionAffinity: ClientIP; the timeout is in `SvcValue::affinity_timeout`.
    pub const AFFINITY: u16 = 1 << 6;
    /// loadBalancerSourceRanges apply: the source must match `lb4_src_range` (`lb6_src_range`) for
    /// this rev_nat_id.
    pub const SOURCE_RANGES: u16 = 1 << 7;
    /// A source range contains a node IP, so this node's own sockets are allowed.
    pub const SOURCE_RANGES_ALLOW_NODE: u16 = 1 << 8;
    /// With `count == 0`: drop (a Local policy without local endpoints). Without it: reject, as
    /// kube-proxy rejects a Service that has no endpoints at all.
    pub const DROP_IF_EMPTY: u16 = 1 << 9;
    /// tc path: masquerade every packet translated through this entry (masqueradeAll, or an
    /// external destination with externalTrafficPolicy=Cluster).
    pub const MASQUERADE: u16 = 1 << 10;
    /// tc path: masquerade sources outside the cluster CIDR (kube-proxy's local-traffic detector).
    pub const MASQUERADE_OFF_CLUSTER: u16 = 1 << 11;
    /// Pick the backend of a new flow from the frontend's Maglev table (`lb_maglev` at its
    /// rev_nat_id; the table size is the frontend entry's `backend_id`) by the flow's 5-tuple hash
    /// (`crate::maglev`). Set on the external scope only; ClientIP affinity takes precedence.
    pub const MAGLEV: u16 = 1 << 12;

    /// The frontend kinds that come from outside the cluster network (kube-proxy's "external
    /// destinations").
    pub const EXTERNAL_KINDS: u16 = NODE_PORT | EXTERNAL_IP | LOAD_BALANCER;
}

/// A frontend's slot: (address, port, protocol, scope, slot).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcKey<F: Family> {
    /// Frontend address, network order.
    pub addr: F::Addr,
    /// Frontend port.
    pub port: u16,
    /// 0 is the frontend entry; 1..=count are backend slots.
    pub slot: u16,
    /// `proto::TCP`, `proto::UDP` or `proto::SCTP`.
    pub proto: u8,
    /// `SCOPE_EXTERNAL` or `SCOPE_INTERNAL`.
    pub scope: u8,
    pub _pad: [u8; 2],
}

pub type Svc4Key = SvcKey<V4>;
pub type Svc6Key = SvcKey<V6>;

impl<F: Family> SvcKey<F> {
    pub const fn new(addr: F::Addr, port: u16, proto: u8, scope: u8, slot: u16) -> Self {
        Self {
            addr,
            port,
            slot,
            proto,
            scope,
            _pad: [0; 2],
        }
    }

    /// The same frontend and scope at another slot.
    pub const fn with_slot(self, slot: u16) -> Self {
        Self { slot, ..self }
    }
}

/// A value of the services maps: a frontend entry (slot 0) or a backend slot, and in a slot a copy
/// of its backend's `lb4_backends` (`lb6_backends`) entry, which the agent keeps equal to it (the
/// address, port and protocol never change under one id; a change of flags rewrites the slots).
/// Zero in a frontend entry. A Maglev table, an affinity entry and a conntrack entry name a
/// backend by id alone and read the backends map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SvcEntry<F: Family> {
    pub value: SvcValue,
    pub backend: BackendValue<F>,
}

pub type Svc4Entry = SvcEntry<V4>;
pub type Svc6Entry = SvcEntry<V6>;

/// The family-free part of a services map value ([`SvcEntry`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SvcValue {
    /// Backend slots: the backend id. Frontend entry: its Maglev table's size with
    /// `flags::MAGLEV`, else 0.
    pub backend_id: u32,
    /// Frontend entry: sessionAffinity ClientIP timeout in seconds (0: no affinity).
    pub affinity_timeout: u32,
    /// The frontend's reverse-NAT id (the same in every slot of the frontend).
    pub rev_nat_id: u32,
    /// Frontend entry: number of backend slots in this scope.
    pub count: u16,
    /// Frontend entry: `flags::*`.
    pub flags: u16,
}

impl SvcValue {
    pub const fn frontend(rev_nat_id: u32, count: u16, flags: u16, affinity_timeout: u32) -> Self {
        Self {
            backend_id: 0,
            affinity_timeout,
            rev_nat_id,
            count,
            flags,
        }
    }

    pub const fn slot(rev_nat_id: u32, backend_id: u32) -> Self {
        Self {
            backend_id,
            affinity_timeout: 0,
            rev_nat_id,
            count: 0,
            flags: 0,
        }
    }

    pub const fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// loadBalancerSourceRanges: the data of an LPM trie key (the trie's key is this plus a `u32`
/// prefix length). The prefix length counts the 32 bits of `rev_nat_id_be` plus the bits of the
/// source prefix, so one trie holds the ranges of every frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SrcRange<F: Family> {
    /// Big-endian so the trie matches the id before the address bits.
    pub rev_nat_id_be: [u8; 4],
    pub addr: F::Addr,
}

pub type SrcRange4 = SrcRange<V4>;
pub type SrcRange6 = SrcRange<V6>;

impl<F: Family> SrcRange<F> {
    pub const fn new(rev_nat_id: u32, addr: F::Addr) -> Self {
        Self {
            rev_nat_id_be: rev_nat_id.to_be_bytes(),
            addr,
        }
    }

    /// The trie prefix length for a source prefix of `prefix` bits.
    pub const fn prefix_len(prefix: u8) -> u32 {
        32 + prefix as u32
    }
}

user_pod!(
    SvcKey<V4>,
    SvcKey<V6>,
    SvcValue,
    SvcEntry<V4>,
    SvcEntry<V6>,
    SrcRange<V4>,
    SrcRange<V6>
);

#[cfg(test)]
mod layout {
    use core::mem::{offset_of, size_of};

    use super::*;

    #[test]
    fn svc4_key() {
        assert_eq!(size_of::<Svc4Key>(), 12);
        assert_eq!(offset_of!(Svc4Key, port), 4);
        assert_eq!(offset_of!(Svc4Key, slot), 6);
        assert_eq!(offset_of!(Svc4Key, proto), 8);
        assert_eq!(offset_of!(Svc4Key, scope), 9);
    }

    #[test]
    fn svc6_key() {
        assert_eq!(size_of::<Svc6Key>(), 24);
        assert_eq!(offset_of!(Svc6Key, port), 16);
        assert_eq!(offset_of!(Svc6Key, scope), 21);
    }

    #[test]
    fn svc_value() {
        assert_eq!(size_of::<SvcValue>(), 16);
        assert_eq!(offset_of!(SvcValue, count), 12);
        assert_eq!(offset_of!(SvcValue, flags), 14);
    }

    #[test]
    fn svc_entry() {
        assert_eq!(size_of::<Svc4Entry>(), 24);
        assert_eq!(offset_of!(Svc4Entry, backend), 16);
        assert_eq!(size_of::<Svc6Entry>(), 36);
        assert_eq!(offset_of!(Svc6Entry, backend), 16);
    }

    #[test]
    fn src_range() {
        assert_eq!(size_of::<SrcRange4>(), 8);
        assert_eq!(size_of::<SrcRange6>(), 20);
        let k = SrcRange4::new(7, [10, 0, 0, 0]);
        assert_eq!(SrcRange4::prefix_len(8), 40);
        assert_eq!(k.rev_nat_id_be, [0, 0, 0, 7]);
    }
}
