//! The map entries of one frontend, built from its plan ([`entries_for`]), and the conversions
//! between the plan's names and what the maps store (`lb_svc_names`, backend values).

use std::{
    collections::{BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;
use lb_common::{
    affinity::AffinityMatchKey,
    revnat::{NAME_LEN, PORT_NAME_LEN, SvcName},
    service::SvcValue,
};

use crate::{
    family::IpFamily,
    model::{Protocol, ServicePortName},
    plan::{
        BackendAddr, Frontend, FrontendPlan,
        maglev::{self, HashSeed, Member, TableParams, TableSize},
    },
};

/// A key of `lb4_services` or `lb6_services` (`SvcKey<F>`, the family in the address): a
/// frontend entry (slot 0) or one of its backend slots. The writer works on entries of either
/// family alike; `KernelMaps` turns them into their family's map key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceMapKey {
    pub addr: IpAddr,
    pub port: u16,
    /// 0 is the frontend entry; 1..=count are backend slots.
    pub slot: u16,
    pub proto: u8,
    /// `SCOPE_EXTERNAL` or `SCOPE_INTERNAL`.
    pub scope: u8,
}

impl ServiceMapKey {
    pub fn new(addr: IpAddr, port: u16, proto: u8, scope: u8, slot: u16) -> Self {
        ServiceMapKey {
            addr,
            port,
            slot,
            proto,
            scope,
        }
    }

    /// The same frontend and scope at another slot.
    pub fn with_slot(self, slot: u16) -> Self {
        ServiceMapKey { slot, ..self }
    }

    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.addr)
    }
}

/// A value of `lb4_services` or `lb6_services` (`SvcEntry<F>`): the entry, and in a backend slot
/// a copy of its backend's entry (the programs pick a backend without a lookup of the backends
/// map); `None` in a frontend entry (zero in the map).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceMapValue {
    pub entry: SvcValue,
    pub backend: Option<BackendEntry>,
}

impl ServiceMapValue {
    /// A frontend entry (slot 0).
    pub fn frontend(entry: SvcValue) -> Self {
        ServiceMapValue { entry, backend: None }
    }

    /// Backend slot of `rev_nat_id`'s frontend: backend `id`, whose entry is `backend`.
    pub fn slot(rev_nat_id: u32, id: u32, backend: BackendEntry) -> Self {
        ServiceMapValue {
            entry: SvcValue::slot(rev_nat_id, id),
            backend: Some(backend),
        }
    }
}

/// A value of `lb4_backends` or `lb6_backends` (`BackendValue<F>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendEntry {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
    /// `lb_common::backend::flags::*`.
    pub flags: u8,
}

/// A value of `lb4_revnat` or `lb6_revnat` (`RevNatValue<F>`): the frontend a reverse-NAT id
/// stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RevNatEntry {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
}

impl RevNatEntry {
    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.addr)
    }
}

/// An entry of `lb4_src_range` or `lb6_src_range`: one loadBalancerSourceRanges prefix of a
/// frontend (the trie key is the id then the prefix, `SrcRange<F>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SourceRange {
    pub rev_nat_id: u32,
    /// Normalised: no host bits (what the trie stores and gives back).
    pub net: IpNet,
}

impl SourceRange {
    pub fn new(rev_nat_id: u32, net: IpNet) -> Self {
        SourceRange {
            rev_nat_id,
            net: net.trunc(),
        }
    }

    pub fn family(&self) -> IpFamily {
        IpFamily::of_net(&self.net)
    }
}

/// Everything the maps hold for one frontend (its `lb_svc_names` entry is `svc_name(&service)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct FrontendEntries {
    pub rev_nat_id: u32,
    pub service: ServicePortName,
    pub services: SvcEntries,
    pub revnat: RevNatEntry,
    pub affinity_match: BTreeSet<AffinityMatchKey>,
    pub source_ranges: BTreeSet<SourceRange>,
    /// The external scope's Maglev table (`lb_maglev` at `rev_nat_id`), with `flags::MAGLEV`.
    pub maglev: Option<MaglevEntry>,
}

/// A frontend's entries in `lb4_services` or `lb6_services` as the writer keeps them, sorted by
/// scope and slot. Every key's address, port and protocol are the frontend's own, and a backend
/// slot's copy of its backend is that backend id's entry with the flags kept here (the writer
/// knows each id's address): 24 bytes an entry, where a key and value are 64. At 10,000
/// Services that is 110,000 entries, the writer's largest collection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct SvcEntries(Vec<SvcEntry>);

/// One entry of [`SvcEntries`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SvcEntry {
    /// `SCOPE_EXTERNAL` or `SCOPE_INTERNAL`.
    pub scope: u8,
    /// 0 is the frontend entry; 1..=count are backend slots.
    pub slot: u16,
    pub value: SvcValue,
    pub copy: BackendCopy,
}

/// What an entry holds where a slot keeps its backend's entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BackendCopy {
    /// Nothing (zero): a frontend entry.
    None,
    /// The entry of backend `value.backend_id`, with these flags.
    Flags(u8),
    /// Something else, found in the maps after a restart: equal to no wanted entry, so the next
    /// apply rewrites it.
    Foreign,
}

impl SvcEntry {
    /// Where it sits among its frontend's entries (the order of [`SvcEntries`]).
    pub fn position(&self) -> (u8, u16) {
        (self.scope, self.slot)
    }

    /// Its key in the map, as an entry of `frontend`.
    pub fn key(&self, frontend: &Frontend) -> ServiceMapKey {
        service_key(frontend, self.position())
    }

    /// Its value in the map; `backend` gives a backend id's address (`None` when the id has
    /// none: the entry cannot be written as it is).
    pub fn map_value(&self, backend: impl Fn(u32) -> Option<BackendAddr>) -> Option<ServiceMapValue> {
        let copy = match self.copy {
            BackendCopy::None => None,
            BackendCopy::Flags(flags) => Some(backend_value(&backend(self.value.backend_id)?, flags)),
            BackendCopy::Foreign => return None,
        };
        Some(ServiceMapValue {
            entry: self.value,
            backend: copy,
        })
    }
}

/// The key of `frontend`'s entry at `position` (scope, slot).
pub(super) fn service_key(frontend: &Frontend, (scope, slot): (u8, u16)) -> ServiceMapKey {
    ServiceMapKey::new(frontend.addr, frontend.port, frontend.proto.number(), scope, slot)
}

impl SvcEntries {
    pub fn with_capacity(n: usize) -> Self {
        SvcEntries(Vec::with_capacity(n))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// In order of scope, then slot.
    pub fn iter(&self) -> impl Iterator<Item = &SvcEntry> + '_ {
        self.0.iter()
    }

    pub fn get(&self, position: (u8, u16)) -> Option<&SvcEntry> {
        self.find(position).ok().map(|i| &self.0[i])
    }

    pub fn contains(&self, position: (u8, u16)) -> bool {
        self.find(position).is_ok()
    }

    /// Adds `entry`, or replaces the one at its position.
    pub fn insert(&mut self, entry: SvcEntry) {
        match self.find(entry.position()) {
            Ok(i) => self.0[i] = entry,
            Err(i) => self.0.insert(i, entry),
        }
    }

    pub fn remove(&mut self, position: (u8, u16)) {
        if let Ok(i) = self.find(position) {
            self.0.remove(i);
        }
    }

    fn find(&self, position: (u8, u16)) -> Result<usize, usize> {
        self.0.binary_search_by_key(&position, SvcEntry::position)
    }
}

/// A frontend's Maglev table, as what it is built from: its size, its seed and its members
/// (sorted by address and port, as `plan::maglev` sorts them) with this node's backend ids. The
/// table itself (`size` ids, 64 KiB at the default size) is computed only to be written
/// ([`Self::positions`]): the mirror of 10,000 Maglev frontends keeps kilobytes, not gigabytes.
/// Equal entries make equal tables (the fill is deterministic; a golden test pins it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MaglevEntry {
    pub size: u32,
    pub seed: HashSeed,
    pub members: Arc<[MaglevMember]>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MaglevMember {
    pub addr: IpAddr,
    pub port: u16,
    pub backend_id: u32,
}

impl MaglevEntry {
    /// The backend ids the table names.
    pub fn backend_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.members.iter().map(|m| m.backend_id)
    }

    /// The table: the backend id at each position. Built once per set of members and size while
    /// `tables` lives (a Service's frontends on several addresses share their endpoints).
    pub fn positions(&self, tables: &mut MaglevTables) -> Arc<[u32]> {
        tables
            .entry((self.members.clone(), self.size, self.seed))
            .or_insert_with(|| {
                let members: Vec<Member> = self
                    .members
                    .iter()
                    .map(|m| Member {
                        addr: m.addr,
                        port: m.port,
                        weight: 1,
                    })
                    .collect();
                let size = TableSize::new(self.size).expect("a planned table size");
                let table = maglev::lookup_table(&members, size, &self.seed.table_seed());
                // `lookup_table` sorts its members as `self.members` are sorted.
                debug_assert!(
                    table
                        .members
                        .iter()
                        .zip(self.members.iter())
                        .all(|(a, b)| a.addr == b.addr && a.port == b.port)
                );
                table
                    .slots
                    .iter()
                    .map(|s| self.members[*s as usize].backend_id)
                    .collect()
            })
            .clone()
    }

    /// The entry of a table read back from the kernel, given each id's (address, port) and the
    /// seed the maps were programmed with (`lb_config`'s `maglev_seed`, which the writer of the
    /// tables wrote); `None` when one of its ids is no backend (the table is then rewritten).
    pub fn adopted(
        positions: &[u32],
        seed: HashSeed,
        backend: impl Fn(u32) -> Option<(IpAddr, u16)>,
    ) -> Option<Self> {
        let ids: BTreeSet<u32> = positions.iter().copied().collect();
        let mut members = ids
            .into_iter()
            .map(|id| {
                backend(id).map(|(addr, port)| MaglevMember {
                    addr,
                    port,
                    backend_id: id,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        members.sort();
        Some(MaglevEntry {
            size: positions.len() as u32,
            seed,
            members: members.into(),
        })
    }
}

/// Tables built during one apply, by (members, size, seed).
pub(super) type MaglevTables = HashMap<(Arc<[MaglevMember]>, u32, HashSeed), Arc<[u32]>>;

/// `s` in a zero-padded field, cut at a character boundary: what is stored is valid UTF-8 and
/// reads back (`unfixed`) to a string that stores to the same bytes, so a restarted agent finds
/// its own names unchanged.
fn fixed<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    let mut n = s.len().min(N);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
    out
}

fn unfixed(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// The operator-facing name of a frontend.
pub fn svc_name(name: &ServicePortName) -> SvcName {
    SvcName {
        namespace: fixed::<NAME_LEN>(&name.namespace),
        name: fixed::<NAME_LEN>(&name.name),
        port_name: fixed::<PORT_NAME_LEN>(&name.port),
    }
}

/// Reads a `ServicePortName` back from the maps.
pub fn service_port_name(name: &SvcName, proto: u8) -> ServicePortName {
    ServicePortName {
        namespace: unfixed(&name.namespace),
        name: unfixed(&name.name),
        port: unfixed(&name.port_name),
        protocol: protocol_from(proto).unwrap_or(Protocol::Tcp),
    }
}

pub fn protocol_from(n: u8) -> Option<Protocol> {
    match n {
        lb_common::proto::TCP => Some(Protocol::Tcp),
        lb_common::proto::UDP => Some(Protocol::Udp),
        lb_common::proto::SCTP => Some(Protocol::Sctp),
        _ => None,
    }
}

pub(super) fn backend_value(addr: &BackendAddr, flags: u8) -> BackendEntry {
    BackendEntry {
        addr: addr.addr,
        port: addr.port,
        proto: addr.proto.number(),
        flags,
    }
}

/// Why a frontend's entries cannot be built.
#[derive(Debug)]
pub(super) enum EntriesError {
    /// A backend has no id (the backends map is full).
    NoBackendId(BackendAddr),
    /// A scope has more backends than `SvcValue::count` (a `u16`) can count. The plan never
    /// asks for this (`MAX_BACKENDS_PER_SCOPE`); checked here so that it could never wrap.
    TooManyBackends(usize),
}

/// The map entries of one frontend. `backend`: a backend's id and flags.
pub(super) fn entries_for(
    frontend: &Frontend,
    plan: &FrontendPlan,
    rev_nat_id: u32,
    backend: &dyn Fn(&BackendAddr) -> Option<(u32, u8)>,
) -> Result<FrontendEntries, EntriesError> {
    let backend_id = &|addr: &BackendAddr| backend(addr).map(|(id, _)| id);
    let proto = frontend.proto.number();
    let addr = frontend.addr;
    let slots: usize = plan.scopes.iter().map(|s| s.backends.len() + 1).sum();
    let mut services = SvcEntries::with_capacity(slots);
    let mut affinity_match = BTreeSet::new();
    let mut maglev_ids = None;
    for scope in &plan.scopes {
        let count = u16::try_from(scope.backends.len())
            .map_err(|_| EntriesError::TooManyBackends(scope.backends.len()))?;
        // The frontend entry's `backend_id` is the table size of a Maglev scope.
        let mut table_size = 0;
        if let Some(params) = scope.maglev {
            maglev_ids = Some(maglev_entry(&scope.backends, params, backend_id)?);
            table_size = params.size.get();
        }
        for (slot, member) in (1..=count).zip(&scope.backends) {
            let (id, flags) = backend(member).ok_or(EntriesError::NoBackendId(*member))?;
            services.insert(SvcEntry {
                scope: scope.scope,
                slot,
                value: SvcValue::slot(rev_nat_id, id),
                copy: BackendCopy::Flags(flags),
            });
            if plan.affinity_timeout > 0 {
                affinity_match.insert(AffinityMatchKey {
                    backend_id: id,
                    rev_nat_id,
                });
            }
        }
        services.insert(SvcEntry {
            scope: scope.scope,
            slot: 0,
            value: SvcValue {
                backend_id: table_size,
                ..SvcValue::frontend(rev_nat_id, count, scope.flags, plan.affinity_timeout)
            },
            copy: BackendCopy::None,
        });
    }
    let source_ranges = plan
        .source_ranges
        .iter()
        .map(|net| SourceRange::new(rev_nat_id, *net))
        .collect();
    Ok(FrontendEntries {
        rev_nat_id,
        service: plan.service.clone(),
        services,
        revnat: RevNatEntry {
            addr,
            port: frontend.port,
            proto,
        },
        affinity_match,
        source_ranges,
        maglev: maglev_ids,
    })
}

/// The Maglev entry of a scope: its size and its backends with their ids (the scope's backends
/// are sorted by address, then port, as the table's members are).
fn maglev_entry(
    backends: &[BackendAddr],
    params: TableParams,
    backend_id: &dyn Fn(&BackendAddr) -> Option<u32>,
) -> Result<MaglevEntry, EntriesError> {
    let mut members = backends
        .iter()
        .map(|b| {
            let id = backend_id(b).ok_or(EntriesError::NoBackendId(*b))?;
            Ok(MaglevMember {
                addr: b.addr,
                port: b.port,
                backend_id: id,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // One protocol per scope: (address, port) names a backend; sorted already, kept so.
    members.sort();
    members.dedup_by(|a, b| a.addr == b.addr && a.port == b.port);
    Ok(MaglevEntry {
        size: params.size.get(),
        seed: params.seed,
        members: members.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The writer keeps one per service-map entry (110,000 at 10,000 Services).
    #[test]
    fn a_mirrored_service_entry_stays_compact() {
        assert_eq!(std::mem::size_of::<SvcEntry>(), 24);
    }
}
