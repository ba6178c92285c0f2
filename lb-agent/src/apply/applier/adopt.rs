//! A restarted agent's writer adopts what the maps hold ([`Applier::recover`]): the mirror is
//! rebuilt from a snapshot and the ids are reserved, so they stay stable and the next apply writes
//! only the difference.

use std::collections::{BTreeMap, BTreeSet};

use super::{Applier, FrontendEntries, protocol_from, service_port_name};
use crate::apply::entries::{BackendCopy, MaglevEntry, SvcEntries, SvcEntry};
use crate::{
    apply::{MapOps, RevNatEntry, ServiceMapValue, Snapshot},
    family::IpFamily,
    model::ServicePortName,
    plan::{BackendAddr, Frontend},
};

impl<M: MapOps> Applier<M> {
    pub(super) fn adopt(&mut self, snap: Snapshot) {
        self.adopted_maglev_seed = snap.maglev_seed;
        for (id, value) in &snap.backends {
            let Some(proto) = protocol_from(value.proto) else {
                continue;
            };
            // An id outside its family's range (the maps were sized differently) is not adopted:
            // the next apply writes the backend anew and deletes the stray entry.
            if self.backend_ids.get_mut(IpFamily::of(&value.addr)).reserve(*id) {
                let addr = BackendAddr {
                    addr: value.addr,
                    port: value.port,
                    proto,
                };
                self.backends.insert(addr, (*id, value.flags));
                self.backend_addrs.insert(*id, addr);
                // Adopted backends no slot points at are deleted by the next apply.
                self.maybe_unused.push(*id);
            }
        }
        // Each frontend's entries by reverse-NAT id; the frontend is the address, port and
        // protocol of the first entry with that id.
        let mut by_rev: BTreeMap<u32, (Frontend, FrontendEntries)> = BTreeMap::new();
        let mut strays = Vec::new();
        for (key, value) in &snap.services {
            let Some(protocol) = protocol_from(key.proto) else {
                continue;
            };
            let frontend = Frontend {
                addr: key.addr,
                port: key.port,
                proto: protocol,
            };
            let (owner, entries) = by_rev.entry(value.entry.rev_nat_id).or_insert_with(|| {
                let entries = FrontendEntries {
                    rev_nat_id: value.entry.rev_nat_id,
                    service: ServicePortName {
                        namespace: String::new(),
                        name: String::new(),
                        port: String::new(),
                        protocol,
                    },
                    services: SvcEntries::default(),
                    revnat: RevNatEntry {
                        addr: key.addr,
                        port: key.port,
                        proto: key.proto,
                    },
                    affinity_match: BTreeSet::new(),
                    source_ranges: BTreeSet::new(),
                    maglev: None,
                };
                (frontend, entries)
            });
            if *owner != frontend {
                // Another frontend's reverse-NAT id: no writer leaves this (an id is reused only
                // once its frontend's entries are gone), and no apply would name it again.
                strays.push(*key);
                continue;
            }
            entries.services.insert(SvcEntry {
                scope: key.scope,
                slot: key.slot,
                value: value.entry,
                copy: adopted_copy(value, &snap),
            });
        }
        strays.sort_by_key(|k| (k.slot != 0, k.scope, k.slot));
        for key in strays {
            if let Err(e) = self.maps.delete_service(&key) {
                tracing::warn!(?key, error = %e, "deleting a service entry of another frontend's reverse-NAT id");
            }
        }
        for (id, revnat) in &snap.revnat {
            if let Some((_, entries)) = by_rev.get_mut(id)
                && entries.revnat.family() == revnat.family()
            {
                entries.revnat = *revnat;
                if let Some(name) = snap.names.get(id) {
                    entries.service = service_port_name(name, revnat.proto);
                }
            }
        }
        for key in &snap.affinity_match {
            if let Some((_, entries)) = by_rev.get_mut(&key.rev_nat_id) {
                entries.affinity_match.insert(*key);
            }
        }
        for range in &snap.source_ranges {
            if let Some((_, entries)) = by_rev.get_mut(&range.rev_nat_id)
                && entries.revnat.family() == range.family()
            {
                entries.source_ranges.insert(*range);
            }
        }
        for (id, positions) in &snap.maglev {
            match by_rev.get_mut(id) {
                Some((_, entries)) => {
                    let family = entries.revnat.family();
                    entries.maglev = MaglevEntry::adopted(positions, snap.maglev_seed, |id| {
                        snap.backends
                            .get(&id)
                            .filter(|b| IpFamily::of(&b.addr) == family)
                            .map(|b| (b.addr, b.port))
                    });
                }
                // The table of a frontend a killed writer removed (it deletes the frontend's
                // entries first): nothing reads it.
                None => {
                    if let Err(e) = self.maps.delete_maglev(*id) {
                        tracing::warn!(rev_nat_id = id, error = %e, "deleting a Maglev table without a frontend");
                    }
                }
            }
        }
        for (id, (frontend, entries)) in by_rev {
            if !self.rev_ids.get_mut(IpFamily::of(&frontend.addr)).reserve(id) {
                continue;
            }
            self.count_frontend(&entries, 1);
            self.frontends.insert(frontend, entries);
        }
        for family in IpFamily::ALL {
            *self.occupancy.backends.get_mut(family) = self
                .backends
                .keys()
                .filter(|a| IpFamily::of(&a.addr) == family)
                .count() as u32;
        }
    }
}

/// What an adopted entry holds for its backend: a slot's copy is kept as its flags when it is
/// the entry of the backend its id names (the rest of it is that backend's address), else as
/// foreign, which the next apply rewrites.
fn adopted_copy(value: &ServiceMapValue, snap: &Snapshot) -> BackendCopy {
    let Some(copy) = value.backend else {
        return BackendCopy::None;
    };
    match snap.backends.get(&value.entry.backend_id) {
        Some(b) if (b.addr, b.port, b.proto) == (copy.addr, copy.port, copy.proto) => {
            BackendCopy::Flags(copy.flags)
        }
        _ => BackendCopy::Foreign,
    }
}
