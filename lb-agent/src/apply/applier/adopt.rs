//! A restarted agent's writer adopts what the maps hold ([`Applier::recover`]): the mirror is
//! rebuilt from a snapshot and the ids are reserved, so they stay stable and the next apply writes
//! only the difference.

use std::collections::{BTreeMap, BTreeSet};

use super::{Applier, FrontendEntries, protocol_from, service_port_name};
use crate::apply::entries::MaglevEntry;
use crate::{
    apply::{MapOps, RevNatEntry, Snapshot},
    family::IpFamily,
    model::{Protocol, ServicePortName},
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
                self.maybe_unused.insert(*id);
            }
        }
        let mut by_rev: BTreeMap<u32, FrontendEntries> = BTreeMap::new();
        for (key, value) in &snap.services {
            let entries = by_rev
                .entry(value.entry.rev_nat_id)
                .or_insert_with(|| FrontendEntries {
                    rev_nat_id: value.entry.rev_nat_id,
                    service: ServicePortName {
                        namespace: String::new(),
                        name: String::new(),
                        port: String::new(),
                        protocol: protocol_from(key.proto).unwrap_or(Protocol::Tcp),
                    },
                    services: BTreeMap::new(),
                    revnat: RevNatEntry {
                        addr: key.addr,
                        port: key.port,
                        proto: key.proto,
                    },
                    affinity_match: BTreeSet::new(),
                    source_ranges: BTreeSet::new(),
                    maglev: None,
                });
            entries.services.insert(*key, *value);
        }
        for (id, revnat) in &snap.revnat {
            if let Some(entries) = by_rev.get_mut(id)
                && entries.revnat.family() == revnat.family()
            {
                entries.revnat = *revnat;
                if let Some(name) = snap.names.get(id) {
                    entries.service = service_port_name(name, revnat.proto);
                }
            }
        }
        for key in &snap.affinity_match {
            if let Some(entries) = by_rev.get_mut(&key.rev_nat_id) {
                entries.affinity_match.insert(*key);
            }
        }
        for range in &snap.source_ranges {
            if let Some(entries) = by_rev.get_mut(&range.rev_nat_id)
                && entries.revnat.family() == range.family()
            {
                entries.source_ranges.insert(*range);
            }
        }
        for (id, positions) in &snap.maglev {
            match by_rev.get_mut(id) {
                Some(entries) => {
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
        for (id, entries) in by_rev {
            let Some(proto) = protocol_from(entries.revnat.proto) else {
                continue;
            };
            if !self.rev_ids.get_mut(entries.revnat.family()).reserve(id) {
                continue;
            }
            let frontend = Frontend {
                addr: entries.revnat.addr,
                port: entries.revnat.port,
                proto,
            };
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
