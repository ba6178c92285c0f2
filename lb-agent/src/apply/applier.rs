//! The map writer: keeps a mirror of what it applied, diffs the desired state against it, and
//! writes only the difference, in an order that never lets a concurrent lookup see a half-written
//! Service (Cilium's `bpf_reconciler.go` order, make-before-break):
//!
//! 1. backends that a frontend is about to use;
//! 2. frontends that disappeared (their frontend entry first, so lookups miss, then the rest);
//! 3. per frontend: reverse NAT, source ranges and affinity members, then the backend slots, then
//!    the frontend entry (slot 0) last — the internal scope before the external one, whose
//!    `TWO_SCOPES` flag points at it — then the stale slots;
//! 4. the apply's Maglev tables, together (`writes::flush_maglev`): a frontend entry asks for
//!    its table (`MAGLEV`) only once the table is in, so a new table's entry is written without
//!    the flag in step 3 and rewritten with it here;
//! 5. backends nothing uses any more.
//!
//! A change to one Service costs writes proportional to that change. A Service whose entries do
//! not fit the maps is skipped as a whole (its previous state stays) and reported, never written
//! half-way. "Fit" counts the peak of each write sequence, not only its net growth: make-before-break
//! writes a frontend's new entries before it deletes its stale ones. When only that transient peak
//! is too much, the frontend is withdrawn first and rewritten (break-before-make, see
//! [`Applier::plan_writes`], `fit`). Ids are recovered from the maps on restart, so they stay stable.

mod adopt;
mod fit;
mod writes;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use lb_common::catalog::Capacities;

use self::fit::WriteMode;
use super::{
    entries::{
        EntriesError, FrontendEntries, MaglevEntry, MaglevTables, backend_value, entries_for, protocol_from,
        service_port_name, svc_name,
    },
    ids::{IdAllocator, family_ranges},
    ops::{MapError, MapOps},
};
use crate::{
    family::{IpFamily, PerFamily},
    model::ServicePortName,
    plan::{BackendAddr, Changes, DesiredState, Frontend, FrontendPlan},
};

/// What one `apply` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub writes: usize,
    pub deletes: usize,
    /// Services left as they were because their entries do not fit (map full), with the reason.
    pub skipped: Vec<(ServicePortName, String)>,
    /// Frontends that a full map left no room to rewrite in place: they were withdrawn (absent
    /// for new connections for the few writes it takes) and written anew. Worth a warning.
    pub withdrawn: Vec<(ServicePortName, Frontend)>,
    /// Map operations that failed unexpectedly.
    pub errors: Vec<String>,
    /// Backends deleted because no frontend uses them any more (their connected sockets are
    /// terminated, `datapath::sockets`).
    pub removed_backends: Vec<BackendAddr>,
}

impl ApplyReport {
    pub fn is_clean(&self) -> bool {
        self.skipped.is_empty() && self.errors.is_empty()
    }
}

/// Entries currently in each map, as the writer knows them (per family for the maps each family
/// has).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    pub services: PerFamily<u32>,
    pub backends: PerFamily<u32>,
    pub revnat: PerFamily<u32>,
    pub source_ranges: PerFamily<u32>,
    pub affinity_match: u32,
    /// Maglev tables in `lb_maglev` (both families).
    pub maglev: u32,
}

pub struct Applier<M> {
    maps: M,
    caps: Capacities,
    /// The mirror of the maps: what each frontend's entries are.
    frontends: BTreeMap<Frontend, FrontendEntries>,
    /// Each backend's id and the flags its entry holds (the rest of the entry is its address).
    backends: BTreeMap<BackendAddr, (u32, u8)>,
    backend_addrs: HashMap<u32, BackendAddr>,
    /// How many backend slots point at each backend id.
    backend_refs: HashMap<u32, u32>,
    /// Backend ids that may have lost their last slot since the last apply (repeats allowed).
    maybe_unused: Vec<u32>,
    /// Frontends an apply could not bring to their desired state (skipped, or a write failed):
    /// the next `apply_changes` looks at them again.
    retry: BTreeSet<Frontend>,
    /// Each family's backend and reverse-NAT ids (`ids::family_ranges`).
    backend_ids: PerFamily<IdAllocator>,
    rev_ids: PerFamily<IdAllocator>,
    occupancy: Occupancy,
    /// Maglev tables step 3 wrote entries for, to put in step 4, and the tables of frontend
    /// entries that no longer ask for one (or are gone), to delete there.
    pending_maglev: Vec<writes::PendingTable>,
    doomed_maglev: Vec<u32>,
    /// The seed the adopted Maglev tables were built with (`Snapshot::maglev_seed`).
    adopted_maglev_seed: crate::plan::maglev::HashSeed,
}

impl<M: MapOps> Applier<M> {
    /// A writer for empty maps.
    pub fn new(maps: M, caps: Capacities) -> Self {
        Self {
            maps,
            caps,
            frontends: BTreeMap::new(),
            backends: BTreeMap::new(),
            backend_addrs: HashMap::new(),
            backend_refs: HashMap::new(),
            maybe_unused: Vec::new(),
            retry: BTreeSet::new(),
            backend_ids: ids(caps.backends),
            rev_ids: ids(caps.revnat),
            occupancy: Occupancy::default(),
            pending_maglev: Vec::new(),
            doomed_maglev: Vec::new(),
            adopted_maglev_seed: crate::plan::maglev::HashSeed::FIXED,
        }
    }

    /// The seed of the Maglev tables this writer adopted (the fixed one for empty maps).
    pub fn adopted_maglev_seed(&self) -> crate::plan::maglev::HashSeed {
        self.adopted_maglev_seed
    }

    /// A writer that adopts what the maps already hold (after a restart): ids stay stable and
    /// the next `apply` writes only the difference, so no Service disappears in between.
    pub fn recover(mut maps: M, caps: Capacities) -> Result<Self, MapError> {
        let snap = maps.snapshot()?;
        maps.adopted(&snap)?;
        let mut applier = Self::new(maps, caps);
        applier.adopt(snap);
        Ok(applier)
    }

    /// Whether any frontend in the maps is of `proto`.
    pub fn serves_protocol(&self, proto: crate::model::Protocol) -> bool {
        self.frontends.keys().any(|f| f.proto == proto)
    }

    pub fn maps(&self) -> &M {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut M {
        &mut self.maps
    }

    pub fn occupancy(&self) -> Occupancy {
        self.occupancy
    }

    pub fn capacities(&self) -> Capacities {
        self.caps
    }

    /// The reverse-NAT id of a frontend, if applied.
    pub fn rev_nat_id(&self, frontend: &Frontend) -> Option<u32> {
        self.frontends.get(frontend).map(|e| e.rev_nat_id)
    }

    /// Repacks the mirror's ordered maps, which a full apply filled in order ([`crate::compact`]).
    pub fn repack(&mut self) {
        crate::compact::repack(&mut self.frontends);
        crate::compact::repack(&mut self.backends);
    }

    /// The id of a backend, if applied.
    pub fn backend_id(&self, backend: &BackendAddr) -> Option<u32> {
        self.backends.get(backend).map(|(id, _)| *id)
    }

    /// Counts a frontend's entries in (`sign` 1) or out (-1) of the occupancy and the backend
    /// reference counts; called whenever the mirror gains or loses a frontend's entries.
    fn count_frontend(&mut self, entries: &FrontendEntries, sign: i64) {
        let add = |v: &mut u32, n: usize| *v = (*v as i64 + sign * n as i64).max(0) as u32;
        let family = entries.revnat.family();
        add(self.occupancy.services.get_mut(family), entries.services.len());
        add(self.occupancy.revnat.get_mut(family), 1);
        add(&mut self.occupancy.affinity_match, entries.affinity_match.len());
        add(&mut self.occupancy.maglev, usize::from(entries.maglev.is_some()));
        add(
            self.occupancy.source_ranges.get_mut(family),
            entries.source_ranges.len(),
        );
        // Backends a slot or the Maglev table names (the table's are the external scope's, but
        // a failed write can leave the two apart for a while).
        let slot_ids = entries
            .services
            .iter()
            .filter(|e| e.slot > 0)
            .map(|e| e.value.backend_id);
        let table_ids = entries.maglev.iter().flat_map(MaglevEntry::backend_ids);
        for id in slot_ids.chain(table_ids) {
            if sign > 0 {
                *self.backend_refs.entry(id).or_default() += 1;
            } else if let Some(n) = self.backend_refs.get_mut(&id) {
                *n -= 1;
                if *n == 0 {
                    self.backend_refs.remove(&id);
                    self.maybe_unused.push(id);
                }
            }
        }
    }

    /// Brings the maps to `desired`, looking at every frontend and backend.
    pub fn apply(&mut self, desired: &DesiredState) -> ApplyReport {
        let frontends: BTreeSet<Frontend> = desired
            .frontends
            .keys()
            .chain(self.frontends.keys())
            .copied()
            .collect();
        // A sorted list rather than a set: the 100,000 backends of 10,000 Services as one
        // allocation, not thousands of tree nodes freed among the mirror's new ones.
        let mut backends: Vec<BackendAddr> = desired
            .backends
            .keys()
            .chain(self.backends.keys())
            .copied()
            .collect();
        backends.sort_unstable();
        backends.dedup();
        self.retry.clear();
        self.maybe_unused
            .extend(self.backends.values().map(|(id, _)| *id));
        self.apply_to(desired, frontends, &backends)
    }

    /// Brings the maps to `desired` where `changes` says it differs from the last state given
    /// (plus whatever an earlier apply could not write: skipped Services are retried, so they
    /// appear once there is room). Work is proportional to the change, not to the maps.
    pub fn apply_changes(&mut self, desired: &DesiredState, changes: &Changes) -> ApplyReport {
        let mut frontends = changes.frontends.clone();
        frontends.append(&mut self.retry);
        let backends: Vec<BackendAddr> = changes.backends.iter().copied().collect();
        self.apply_to(desired, frontends, &backends)
    }

    /// The ordered writes (see the module doc) for the given frontends and backends.
    fn apply_to(
        &mut self,
        desired: &DesiredState,
        mut frontends: BTreeSet<Frontend>,
        backends: &[BackendAddr],
    ) -> ApplyReport {
        let mut report = ApplyReport::default();
        // Frontends whose slots copy a backend whose flags change are rewritten with it.
        frontends.extend(self.copying_changed_flags(desired, backends));
        // 1. Ids for new backends (their entries are written per Service, just before use).
        let new_backend_ids = self.allocate_backend_ids(desired, &frontends);
        // 2. Frontends that are gone.
        for frontend in frontends.iter().filter(|f| !desired.frontends.contains_key(f)) {
            self.remove_frontend(frontend, &mut report);
        }
        // 3. Desired frontends, one Service at a time.
        let by_service = by_service(desired, &frontends);
        for group in by_service.chunk_by(|a, b| same_service(a.1, b.1)) {
            self.write_service(group, desired, &new_backend_ids, &mut report);
        }
        // 3b. Backends whose flags changed while their frontends did not (another Service's
        //     endpoint at the same address started or stopped terminating, say).
        for addr in backends {
            if let (Some(flags), Some((id, _))) = (desired.backends.get(addr), self.backends.get(addr)) {
                let id = *id;
                self.put_backend(*addr, id, *flags, &mut report);
            }
        }
        // 4. The Maglev tables, in batches, and the frontend entries that wait for them.
        self.flush_maglev(&mut report);
        // 5. Backends nothing references any more.
        self.delete_unused_backends(&mut report);
        // Ids allocated for backends that ended up unused (their Service was skipped).
        for (addr, id) in new_backend_ids {
            if !self.backends.contains_key(&addr) {
                self.backend_ids.get_mut(IpFamily::of(&addr.addr)).free(id);
            }
        }
        report
    }

    /// The desired frontends whose slots hold a copy of one of `backends` whose flags differ from
    /// the desired ones (another Service's endpoint at the same address started terminating, a
    /// node address came or went): each is rewritten, or its slots would keep the old flags. One
    /// pass over the mirror, only when some flags changed.
    fn copying_changed_flags(&self, desired: &DesiredState, backends: &[BackendAddr]) -> BTreeSet<Frontend> {
        let changed: BTreeSet<u32> = backends
            .iter()
            .filter_map(|addr| {
                let (id, written) = self.backends.get(addr)?;
                let flags = desired.backends.get(addr)?;
                (written != flags).then_some(*id)
            })
            .collect();
        if changed.is_empty() {
            return BTreeSet::new();
        }
        self.frontends
            .iter()
            .filter(|(frontend, entries)| {
                desired.frontends.contains_key(frontend)
                    && entries
                        .services
                        .iter()
                        .any(|e| e.slot > 0 && changed.contains(&e.value.backend_id))
            })
            .map(|(frontend, _)| *frontend)
            .collect()
    }

    /// An id for every backend of the given desired frontends that has none yet.
    fn allocate_backend_ids(
        &mut self,
        desired: &DesiredState,
        frontends: &BTreeSet<Frontend>,
    ) -> HashMap<BackendAddr, u32> {
        let mut new_backend_ids = HashMap::new();
        for addr in frontends
            .iter()
            .filter_map(|f| desired.frontends.get(f))
            .flat_map(|plan| plan.backends())
        {
            if !self.backends.contains_key(addr)
                && !new_backend_ids.contains_key(addr)
                && let Some(id) = self.backend_ids.get_mut(IpFamily::of(&addr.addr)).alloc()
            {
                new_backend_ids.insert(*addr, id);
            }
        }
        new_backend_ids
    }

    /// Returns reverse-NAT ids allocated for a Service that was not written.
    fn free_rev_ids(&mut self, ids: impl IntoIterator<Item = (IpFamily, u32)>) {
        for (family, id) in ids {
            self.rev_ids.get_mut(family).free(id);
        }
    }

    /// Writes one Service's frontends (`group`), all or none: their entries are built and checked
    /// to fit the maps first; a Service that does not fit is skipped (reported, retried by the
    /// next apply) and keeps what it had.
    fn write_service(
        &mut self,
        group: &[(&Frontend, &FrontendPlan)],
        desired: &DesiredState,
        new_backend_ids: &HashMap<BackendAddr, u32>,
        report: &mut ApplyReport,
    ) {
        let service = group[0].1.service.clone();
        let (built, new_rev_ids) = self.build_entries(group, &desired.backends, new_backend_ids);
        let writes = match built.and_then(|built| self.plan_writes(built)) {
            Ok(writes) => writes,
            Err(reason) => {
                self.free_rev_ids(new_rev_ids);
                report.skipped.push((service, reason));
                self.retry.extend(group.iter().map(|(f, _)| **f));
                return;
            }
        };
        // Backends this Service needs that are new or changed.
        let needed: BTreeSet<BackendAddr> = group
            .iter()
            .flat_map(|(_, plan)| plan.backends().copied())
            .collect();
        let backends: Vec<(BackendAddr, u32, u8)> = needed
            .iter()
            .map(|addr| {
                let flags = desired.backends.get(addr).copied().unwrap_or(0);
                let id = self
                    .backends
                    .get(addr)
                    .map(|(id, _)| *id)
                    .or_else(|| new_backend_ids.get(addr).copied())
                    .expect("ids were checked by entries_for");
                (*addr, id, flags)
            })
            .collect();
        if !self.put_backends(&backends, report) {
            // Nothing of this Service was written: its new ids go back, or every retry of a
            // failing write would take more until none were left.
            self.free_rev_ids(new_rev_ids);
            report.skipped.push((service, "writing a backend failed".into()));
            self.retry.extend(group.iter().map(|(f, _)| **f));
            return;
        }
        for (frontend, entries, mode) in writes {
            let errors = report.errors.len();
            if self.write_frontend(frontend, entries, mode, report) {
                report.withdrawn.push((service.clone(), frontend));
            }
            if report.errors.len() > errors {
                self.retry.insert(frontend);
            }
        }
    }

    /// The entries of each frontend of `group`, with their ids (reverse-NAT ids allocated for new
    /// frontends are returned, so a skipped Service gives them back), or why they cannot be built.
    fn build_entries(
        &mut self,
        group: &[(&Frontend, &FrontendPlan)],
        backend_flags: &BTreeMap<BackendAddr, u8>,
        new_backend_ids: &HashMap<BackendAddr, u32>,
    ) -> (Result<Vec<FrontendWrite>, String>, NewRevNatIds) {
        let mut built = Vec::with_capacity(group.len());
        let mut new_rev_ids = Vec::new();
        for (frontend, plan) in group {
            let family = IpFamily::of(&frontend.addr);
            let rev_nat_id = match self.frontends.get(frontend) {
                Some(old) => old.rev_nat_id,
                None => match self.rev_ids.get_mut(family).alloc() {
                    Some(id) => {
                        new_rev_ids.push((family, id));
                        id
                    }
                    None => {
                        let reason = format!("no free reverse-NAT id (map {} full)", family.maps().revnat);
                        return (Err(reason), new_rev_ids);
                    }
                },
            };
            let backend = |addr: &BackendAddr| -> Option<(u32, u8)> {
                let id = self
                    .backends
                    .get(addr)
                    .map(|(id, _)| *id)
                    .or_else(|| new_backend_ids.get(addr).copied())?;
                Some((id, backend_flags.get(addr).copied().unwrap_or(0)))
            };
            let reason = match entries_for(frontend, plan, rev_nat_id, &backend) {
                Ok(entries) => {
                    built.push((**frontend, entries));
                    continue;
                }
                Err(EntriesError::NoBackendId(addr)) => format!(
                    "no free backend id for {addr} (map {} full)",
                    IpFamily::of(&addr.addr).maps().backends
                ),
                Err(EntriesError::TooManyBackends(n)) => format!(
                    "{frontend}: {n} backends in one scope, more than the {} a frontend entry can count",
                    u16::MAX
                ),
            };
            return (Err(reason), new_rev_ids);
        }
        (Ok(built), new_rev_ids)
    }

    /// Deletes the backends no slot references any more (candidates: `maybe_unused`).
    fn delete_unused_backends(&mut self, report: &mut ApplyReport) {
        let mut candidates = std::mem::take(&mut self.maybe_unused);
        candidates.sort_unstable();
        candidates.dedup();
        for id in candidates {
            if self.backend_refs.contains_key(&id) {
                continue;
            }
            let Some(addr) = self.backend_addrs.get(&id).copied() else {
                continue;
            };
            let family = IpFamily::of(&addr.addr);
            match self.maps.delete_backend(family, id) {
                Ok(()) => {
                    report.deletes += 1;
                    report.removed_backends.push(addr);
                    self.backends.remove(&addr);
                    self.backend_addrs.remove(&id);
                    self.backend_ids.get_mut(family).free(id);
                    let used = self.occupancy.backends.get_mut(family);
                    *used = used.saturating_sub(1);
                }
                Err(e) => {
                    report.errors.push(e.to_string());
                    self.maybe_unused.push(id);
                }
            }
        }
    }
}

/// A frontend with the entries it is to have.
type FrontendWrite = (Frontend, FrontendEntries);

/// Reverse-NAT ids allocated while building a Service's entries, each in its family's range.
type NewRevNatIds = Vec<(IpFamily, u32)>;

/// Each family's allocator of the ids of maps of `capacity` entries.
fn ids(capacity: u32) -> PerFamily<IdAllocator> {
    let ranges = family_ranges(capacity);
    PerFamily {
        v4: IdAllocator::with_range(ranges.v4),
        v6: IdAllocator::with_range(ranges.v6),
    }
}

/// The desired frontends among `frontends`, in Service order, each Service's in frontend order
/// (a Service's are written together: it is programmed whole or not at all; [`same_service`]
/// tells the groups apart). One list, not a map of lists: at a full programming it holds every
/// frontend, and is freed as one allocation.
fn by_service<'a>(
    desired: &'a DesiredState,
    frontends: &'a BTreeSet<Frontend>,
) -> Vec<(&'a Frontend, &'a FrontendPlan)> {
    let mut out: Vec<(&Frontend, &FrontendPlan)> = frontends
        .iter()
        .filter_map(|f| desired.frontends.get(f).map(|plan| (f, &**plan)))
        .collect();
    // Stable: frontend order within a Service.
    out.sort_by(|a, b| service_of(a.1).cmp(&service_of(b.1)));
    out
}

fn service_of(plan: &FrontendPlan) -> (&str, &str) {
    (plan.service.namespace.as_str(), plan.service.name.as_str())
}

fn same_service(a: &FrontendPlan, b: &FrontendPlan) -> bool {
    service_of(a) == service_of(b)
}

impl<M> Applier<M> {
    /// The size of every collection the writer keeps between syncs (see `Planner::residue`).
    #[cfg(test)]
    pub(crate) fn residue(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("applier frontends", self.frontends.len()),
            ("applier backends", self.backends.len()),
            ("applier backend ids", self.backend_addrs.len()),
            ("applier backend refs", self.backend_refs.len()),
            ("applier maybe unused", self.maybe_unused.len()),
            ("applier retry", self.retry.len()),
        ]
    }
}

#[cfg(test)]
mod tests;
