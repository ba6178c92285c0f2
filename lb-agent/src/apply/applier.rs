//! The map writer: keeps a mirror of what it applied, diffs the desired state against it, and
//! writes only the difference, in an order that never lets a concurrent lookup see a half-written
//! Service (Cilium's `bpf_reconciler.go` order, make-before-break):
//!
//! 1. backends that a frontend is about to use;
//! 2. frontends that disappeared (their frontend entry first, so lookups miss, then the rest);
//! 3. per frontend: reverse NAT, source ranges and affinity members, then the backend slots, then
//!    the frontend entry (slot 0) last — the internal scope before the external one, whose
//!    `TWO_SCOPES` flag points at it — then the stale slots;
//! 4. backends nothing uses any more.
//!
//! A change to one Service costs writes proportional to that change. A Service whose entries do
//! not fit the maps is skipped as a whole (its previous state stays) and reported, never written
//! half-way. "Fit" counts the peak of each write sequence, not only its net growth: make-before-break
//! writes a frontend's new entries before it deletes its stale ones. When only that transient peak
//! is too much, the frontend is withdrawn first and rewritten (break-before-make, see
//! [`Applier::plan_writes`]). Ids are recovered from the maps on restart, so they stay stable.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::Ipv4Addr,
};

use lb_common::{
    affinity::AffinityMatchKey,
    backend::Backend4Value,
    catalog::Capacities,
    revnat::{NAME_LEN, PORT_NAME_LEN, RevNat4Value, SvcName},
    service::{SrcRange4, Svc4Key, Svc4Value},
};

use super::{
    ids::IdAllocator,
    ops::{MapError, MapOps, Snapshot},
};
use crate::{
    model::{Protocol, ServicePortName},
    plan::{BackendAddr, Changes, DesiredState, Frontend, FrontendPlan},
};

/// Everything the maps hold for one frontend (its `lb_svc_names` entry is `svc_name(&service)`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct FrontendEntries {
    rev_nat_id: u32,
    service: ServicePortName,
    services: BTreeMap<Svc4Key, Svc4Value>,
    revnat: RevNat4Value,
    affinity_match: BTreeSet<AffinityMatchKey>,
    source_ranges: BTreeSet<(u32, SrcRange4Ord)>,
}

/// `SrcRange4` with an order, for sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct SrcRange4Ord([u8; 4], [u8; 4]);

impl From<SrcRange4Ord> for SrcRange4 {
    fn from(r: SrcRange4Ord) -> Self {
        SrcRange4 {
            rev_nat_id_be: r.0,
            addr: r.1,
        }
    }
}

impl From<SrcRange4> for SrcRange4Ord {
    fn from(r: SrcRange4) -> Self {
        SrcRange4Ord(r.rev_nat_id_be, r.addr)
    }
}

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
}

impl ApplyReport {
    pub fn is_clean(&self) -> bool {
        self.skipped.is_empty() && self.errors.is_empty()
    }
}

/// Entries currently in each map, as the writer knows them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    pub services: u32,
    pub backends: u32,
    pub revnat: u32,
    pub affinity_match: u32,
    pub source_ranges: u32,
}

pub struct Applier<M> {
    maps: M,
    caps: Capacities,
    /// The mirror of the maps: what each frontend's entries are.
    frontends: BTreeMap<Frontend, FrontendEntries>,
    backends: BTreeMap<BackendAddr, (u32, Backend4Value)>,
    backend_addrs: HashMap<u32, BackendAddr>,
    /// How many backend slots point at each backend id.
    backend_refs: HashMap<u32, u32>,
    /// Backend ids that may have lost their last slot since the last apply.
    maybe_unused: BTreeSet<u32>,
    /// Frontends an apply could not bring to their desired state (skipped, or a write failed):
    /// the next `apply_changes` looks at them again.
    retry: BTreeSet<Frontend>,
    backend_ids: IdAllocator,
    rev_ids: IdAllocator,
    occupancy: Occupancy,
}

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

fn backend_value(addr: &BackendAddr, flags: u8) -> Backend4Value {
    Backend4Value {
        addr: addr.addr.octets(),
        port: addr.port,
        proto: addr.proto.number(),
        flags,
    }
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
            maybe_unused: BTreeSet::new(),
            retry: BTreeSet::new(),
            backend_ids: IdAllocator::new(caps.backends),
            rev_ids: IdAllocator::new(caps.revnat),
            occupancy: Occupancy::default(),
        }
    }

    /// A writer that adopts what the maps already hold (after a restart): ids stay stable and
    /// the next `apply` writes only the difference, so no Service disappears in between.
    pub fn recover(maps: M, caps: Capacities) -> Result<Self, MapError> {
        let snap = maps.snapshot()?;
        let mut applier = Self::new(maps, caps);
        applier.adopt(snap);
        Ok(applier)
    }

    fn adopt(&mut self, snap: Snapshot) {
        for (id, value) in &snap.backends {
            let Some(proto) = protocol_from(value.proto) else {
                continue;
            };
            if self.backend_ids.reserve(*id) {
                let addr = BackendAddr {
                    addr: Ipv4Addr::from(value.addr),
                    port: value.port,
                    proto,
                };
                self.backends.insert(addr, (*id, *value));
                self.backend_addrs.insert(*id, addr);
                // Adopted backends no slot points at are deleted by the next apply.
                self.maybe_unused.insert(*id);
            }
        }
        let mut by_rev: BTreeMap<u32, FrontendEntries> = BTreeMap::new();
        for (key, value) in &snap.services {
            let entries = by_rev.entry(value.rev_nat_id).or_insert_with(|| FrontendEntries {
                rev_nat_id: value.rev_nat_id,
                service: ServicePortName {
                    namespace: String::new(),
                    name: String::new(),
                    port: String::new(),
                    protocol: protocol_from(key.proto).unwrap_or(Protocol::Tcp),
                },
                services: BTreeMap::new(),
                revnat: RevNat4Value {
                    addr: key.addr,
                    port: key.port,
                    proto: key.proto,
                    _pad: 0,
                },
                affinity_match: BTreeSet::new(),
                source_ranges: BTreeSet::new(),
            });
            entries.services.insert(*key, *value);
        }
        for (id, revnat) in &snap.revnat {
            if let Some(entries) = by_rev.get_mut(id) {
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
        for (prefix, range) in &snap.source_ranges {
            if let Some(entries) = by_rev.get_mut(&u32::from_be_bytes(range.rev_nat_id_be)) {
                entries.source_ranges.insert((*prefix, (*range).into()));
            }
        }
        for (id, entries) in by_rev {
            let Some(proto) = protocol_from(entries.revnat.proto) else {
                continue;
            };
            if !self.rev_ids.reserve(id) {
                continue;
            }
            let frontend = Frontend {
                addr: Ipv4Addr::from(entries.revnat.addr),
                port: entries.revnat.port,
                proto,
            };
            self.count_frontend(&entries, 1);
            self.frontends.insert(frontend, entries);
        }
        self.occupancy.backends = self.backends.len() as u32;
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

    /// The id of a backend, if applied.
    pub fn backend_id(&self, backend: &BackendAddr) -> Option<u32> {
        self.backends.get(backend).map(|(id, _)| *id)
    }

    /// Counts a frontend's entries in (`sign` 1) or out (-1) of the occupancy and the backend
    /// reference counts; called whenever the mirror gains or loses a frontend's entries.
    fn count_frontend(&mut self, entries: &FrontendEntries, sign: i64) {
        let add = |v: &mut u32, n: usize| *v = (*v as i64 + sign * n as i64).max(0) as u32;
        add(&mut self.occupancy.services, entries.services.len());
        add(&mut self.occupancy.revnat, 1);
        add(&mut self.occupancy.affinity_match, entries.affinity_match.len());
        add(&mut self.occupancy.source_ranges, entries.source_ranges.len());
        for value in entries
            .services
            .iter()
            .filter(|(k, _)| k.slot > 0)
            .map(|(_, v)| v)
        {
            let id = value.backend_id;
            if sign > 0 {
                *self.backend_refs.entry(id).or_default() += 1;
            } else if let Some(n) = self.backend_refs.get_mut(&id) {
                *n -= 1;
                if *n == 0 {
                    self.backend_refs.remove(&id);
                    self.maybe_unused.insert(id);
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
        let backends: BTreeSet<BackendAddr> = desired
            .backends
            .keys()
            .chain(self.backends.keys())
            .copied()
            .collect();
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
        self.apply_to(desired, frontends, &changes.backends)
    }

    fn apply_to(
        &mut self,
        desired: &DesiredState,
        frontends: BTreeSet<Frontend>,
        backends: &BTreeSet<BackendAddr>,
    ) -> ApplyReport {
        let mut report = ApplyReport::default();

        // 1. Ids for new backends (writes come per Service, just before they are used).
        let mut new_backend_ids: BTreeMap<BackendAddr, u32> = BTreeMap::new();
        for addr in frontends
            .iter()
            .filter_map(|f| desired.frontends.get(f))
            .flat_map(|plan| plan.backends())
        {
            if !self.backends.contains_key(addr)
                && !new_backend_ids.contains_key(addr)
                && let Some(id) = self.backend_ids.alloc()
            {
                new_backend_ids.insert(*addr, id);
            }
        }

        // 2. Frontends that are gone.
        for frontend in frontends.iter().filter(|f| !desired.frontends.contains_key(f)) {
            self.remove_frontend(frontend, &mut report);
        }

        // 3. Desired frontends, one Service at a time.
        let mut by_service: BTreeMap<(&str, &str), Vec<(&Frontend, &FrontendPlan)>> = BTreeMap::new();
        for frontend in &frontends {
            if let Some(plan) = desired.frontends.get(frontend) {
                by_service
                    .entry((plan.service.namespace.as_str(), plan.service.name.as_str()))
                    .or_default()
                    .push((frontend, plan));
            }
        }
        for group in by_service.values() {
            // Build the group's entries (with ids), then check they fit before writing anything.
            let mut built = Vec::with_capacity(group.len());
            let mut missing_backend = None;
            let mut new_rev_ids = Vec::new();
            for (frontend, plan) in group {
                let rev_nat_id = match self.frontends.get(frontend) {
                    Some(old) => old.rev_nat_id,
                    None => match self.rev_ids.alloc() {
                        Some(id) => {
                            new_rev_ids.push(id);
                            id
                        }
                        None => {
                            missing_backend = Some(format!(
                                "no free reverse-NAT id (map {} full)",
                                lb_common::catalog::REVNAT
                            ));
                            break;
                        }
                    },
                };
                let backend_id = |addr: &BackendAddr| -> Option<u32> {
                    self.backends
                        .get(addr)
                        .map(|(id, _)| *id)
                        .or_else(|| new_backend_ids.get(addr).copied())
                };
                match entries_for(frontend, plan, rev_nat_id, &backend_id) {
                    Ok(entries) => built.push((**frontend, entries)),
                    Err(EntriesError::NoBackendId(addr)) => {
                        missing_backend = Some(format!(
                            "no free backend id for {addr} (map {} full)",
                            lb_common::catalog::BACKENDS
                        ));
                        break;
                    }
                    Err(EntriesError::TooManyBackends(n)) => {
                        missing_backend = Some(format!(
                            "{frontend}: {n} backends in one scope, more than the {} a frontend \
                             entry can count",
                            u16::MAX
                        ));
                        break;
                    }
                }
            }
            let service = group[0].1.service.clone();
            let writes = match missing_backend {
                Some(reason) => Err(reason),
                None => self.plan_writes(built),
            };
            let writes = match writes {
                Ok(writes) => writes,
                Err(reason) => {
                    for id in new_rev_ids {
                        self.rev_ids.free(id);
                    }
                    report.skipped.push((service, reason));
                    self.retry.extend(group.iter().map(|(f, _)| **f));
                    continue;
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
            if !self.put_backends(&backends, &mut report) {
                report.skipped.push((service, "writing a backend failed".into()));
                self.retry.extend(group.iter().map(|(f, _)| **f));
                continue;
            }
            for (frontend, entries, mode) in writes {
                let errors = report.errors.len();
                if self.write_frontend(frontend, entries, mode, &mut report) {
                    report.withdrawn.push((service.clone(), frontend));
                }
                if report.errors.len() > errors {
                    self.retry.insert(frontend);
                }
            }
        }

        // 3b. Backends whose flags changed while their frontends did not (another Service's
        //     endpoint at the same address started or stopped terminating, say).
        for addr in backends {
            if let (Some(flags), Some((id, _))) = (desired.backends.get(addr), self.backends.get(addr)) {
                let id = *id;
                self.put_backend(*addr, id, *flags, &mut report);
            }
        }

        // 4. Backends nothing references any more.
        for id in std::mem::take(&mut self.maybe_unused) {
            if self.backend_refs.contains_key(&id) {
                continue;
            }
            let Some(addr) = self.backend_addrs.get(&id).copied() else {
                continue;
            };
            match self.maps.delete_backend(id) {
                Ok(()) => {
                    report.deletes += 1;
                    self.backends.remove(&addr);
                    self.backend_addrs.remove(&id);
                    self.backend_ids.free(id);
                    self.occupancy.backends = self.occupancy.backends.saturating_sub(1);
                }
                Err(e) => {
                    report.errors.push(e.to_string());
                    self.maybe_unused.insert(id);
                }
            }
        }
        // Ids allocated for backends that ended up unused (their Service was skipped).
        for (addr, id) in new_backend_ids {
            if !self.backends.contains_key(&addr) {
                self.backend_ids.free(id);
            }
        }
        report
    }

    /// Writes a backend's entry unless the map already holds exactly that; false on failure.
    fn put_backend(&mut self, addr: BackendAddr, id: u32, flags: u8, report: &mut ApplyReport) -> bool {
        self.put_backends(&[(addr, id, flags)], report)
    }

    /// Writes the backends' entries the map does not already hold exactly (in one batch); false
    /// when one failed (those before it are written and mirrored, the rest are not).
    fn put_backends(&mut self, backends: &[(BackendAddr, u32, u8)], report: &mut ApplyReport) -> bool {
        let writes: Vec<(BackendAddr, u32, Backend4Value)> = backends
            .iter()
            .map(|(addr, id, flags)| (*addr, *id, backend_value(addr, *flags)))
            .filter(|(addr, id, value)| self.backends.get(addr) != Some(&(*id, *value)))
            .collect();
        let entries: Vec<(u32, Backend4Value)> = writes.iter().map(|(_, id, v)| (*id, *v)).collect();
        let result = self.maps.put_backends(&entries);
        let done = result.as_ref().err().map_or(writes.len(), |e| e.done);
        for (addr, id, value) in &writes[..done] {
            report.writes += 1;
            if self.backends.insert(*addr, (*id, *value)).is_none() {
                self.occupancy.backends += 1;
                self.backend_addrs.insert(*id, *addr);
                // Deleted again at the end of this apply unless a frontend now uses it.
                self.maybe_unused.insert(*id);
            }
        }
        match result {
            Ok(()) => true,
            Err(e) => {
                report.errors.push(e.error.to_string());
                false
            }
        }
    }

    /// The order and the manner in which to write a group of frontends (one Service), or why they
    /// do not fit the maps.
    ///
    /// Make-before-break writes a frontend's new entries before it deletes its stale ones, so it
    /// transiently needs room for both: a NodePort going from externalTrafficPolicy=Local (1 + 3
    /// slots) to Cluster (5 slots) needs 4 more entries for a moment although its size does not
    /// change. The peak is what must fit, map by map, counted in write order (a frontend's
    /// deletions happen before the next frontend's writes).
    ///
    /// When the net result fits but the peak does not, the choice is between leaving the Service
    /// as it was for as long as the map stays full (a stale policy, source ranges or backends,
    /// with no end in sight) and rewriting it with a brief gap. We rewrite: the frontends whose
    /// peak does not fit are written break-before-make ([`WriteMode::BreakBeforeMake`]): their
    /// slot-0 entries are deleted first, so lookups miss the frontend exactly as if it were being
    /// removed (never a count pointing at missing slots, never a frontend without its source
    /// ranges), then the stale entries, then it is written as new. Only new connections to that
    /// frontend during those few writes are affected; established flows keep their conntrack
    /// entries, reverse-NAT id and backends. Shrinking frontends are written first then, to make
    /// room. A group whose net result does not fit is refused, as before.
    fn plan_writes(
        &self,
        built: Vec<(Frontend, FrontendEntries)>,
    ) -> Result<Vec<(Frontend, FrontendEntries, WriteMode)>, String> {
        let deltas: Vec<[Delta; 3]> = built
            .iter()
            .map(|(frontend, new)| {
                let old = self.frontends.get(frontend);
                [
                    delta(
                        new.services.keys(),
                        old.into_iter().flat_map(|o| o.services.keys()),
                    ),
                    delta(
                        new.affinity_match.iter(),
                        old.into_iter().flat_map(|o| o.affinity_match.iter()),
                    ),
                    delta(
                        new.source_ranges.iter(),
                        old.into_iter().flat_map(|o| o.source_ranges.iter()),
                    ),
                ]
            })
            .collect();
        let used = [
            i64::from(self.occupancy.services),
            i64::from(self.occupancy.affinity_match),
            i64::from(self.occupancy.source_ranges),
        ];
        let caps = [
            i64::from(self.caps.services),
            i64::from(self.caps.affinity_match),
            i64::from(self.caps.source_ranges),
        ];
        // 1. Make-before-break throughout, in the usual order.
        let mut running = used;
        let mut fits = true;
        for d in &deltas {
            for m in 0..3 {
                fits &= running[m] + d[m].added <= caps[m];
                running[m] += d[m].net();
            }
        }
        if fits {
            return Ok(built
                .into_iter()
                .map(|(f, e)| (f, e, WriteMode::MakeBeforeBreak))
                .collect());
        }
        // 2. Shrinking frontends first; break-before-make where the peak does not fit. A frontend
        //    written break-before-make never holds more than max(before, after) entries.
        let mut order: Vec<usize> = (0..built.len()).collect();
        order.sort_by_key(|&i| deltas[i][0].net());
        let mut running = used;
        let mut modes = vec![WriteMode::MakeBeforeBreak; built.len()];
        let mut peak = used;
        for &i in &order {
            let d = &deltas[i];
            if (0..3).any(|m| running[m] + d[m].added > caps[m]) {
                modes[i] = WriteMode::BreakBeforeMake;
            }
            for m in 0..3 {
                running[m] += d[m].net();
                peak[m] = peak[m].max(running[m]);
            }
        }
        let names = [
            lb_common::catalog::SERVICES,
            lb_common::catalog::AFFINITY_MATCH,
            lb_common::catalog::SOURCE_RANGES,
        ];
        if let Some(m) = (0..3).find(|&m| peak[m] > caps[m]) {
            return Err(format!(
                "map {} is full ({} of {} entries used, {} more needed)",
                names[m],
                used[m],
                caps[m],
                peak[m] - used[m]
            ));
        }
        let mut built: Vec<Option<(Frontend, FrontendEntries)>> = built.into_iter().map(Some).collect();
        Ok(order
            .into_iter()
            .filter_map(|i| built[i].take().map(|(f, e)| (f, e, modes[i])))
            .collect())
    }

    /// Writes one frontend; true when it was withdrawn first (break-before-make).
    fn write_frontend(
        &mut self,
        frontend: Frontend,
        new: FrontendEntries,
        mode: WriteMode,
        report: &mut ApplyReport,
    ) -> bool {
        let old = self.frontends.get(&frontend).cloned();
        if old.as_ref() == Some(&new) {
            return false;
        }
        // The entries as they are in the kernel right now, updated write by write, so that a
        // failure leaves an accurate mirror.
        let mut current = old.clone().unwrap_or_else(|| FrontendEntries {
            services: BTreeMap::new(),
            affinity_match: BTreeSet::new(),
            source_ranges: BTreeSet::new(),
            ..new.clone()
        });
        if old.is_some() {
            self.count_frontend(&current, -1);
        }
        let mut result = Ok(());
        let withdraw = mode == WriteMode::BreakBeforeMake && old.is_some();
        if withdraw {
            result = self.withdraw_frontend_entries(&new, &mut current, report);
        }
        if result.is_ok() {
            result = self.write_frontend_entries(old.as_ref(), &new, &mut current, report);
        }
        if let Err(e) = result {
            report.errors.push(format!("{frontend} ({}): {e}", new.service));
        }
        self.count_frontend(&current, 1);
        self.frontends.insert(frontend, current);
        withdraw
    }

    fn write_frontend_entries(
        &mut self,
        old: Option<&FrontendEntries>,
        new: &FrontendEntries,
        current: &mut FrontendEntries,
        report: &mut ApplyReport,
    ) -> Result<(), MapError> {
        // Reverse NAT before any slot 0 points at it.
        let name = svc_name(&new.service);
        if old.is_none_or(|o| o.revnat != new.revnat || svc_name(&o.service) != name) {
            self.maps.put_revnat(new.rev_nat_id, &new.revnat, &name)?;
            report.writes += 1;
        }
        current.revnat = new.revnat;
        current.service = new.service.clone();
        for range in new.source_ranges.difference(&current.source_ranges.clone()) {
            self.maps.put_source_range(range.0, &range.1.into())?;
            report.writes += 1;
            current.source_ranges.insert(*range);
        }
        for member in new.affinity_match.difference(&current.affinity_match.clone()) {
            self.maps.put_affinity_match(member)?;
            report.writes += 1;
            current.affinity_match.insert(*member);
        }
        // Writes: internal scope first, and within a scope the slots before slot 0.
        let mut writes: Vec<(&Svc4Key, &Svc4Value)> = new
            .services
            .iter()
            .filter(|(k, v)| current.services.get(k) != Some(v))
            .collect();
        writes.sort_by_key(|(k, _)| (std::cmp::Reverse(k.scope), k.slot == 0, k.slot));
        let writes: Vec<(Svc4Key, Svc4Value)> = writes.into_iter().map(|(k, v)| (*k, *v)).collect();
        let result = self.maps.put_services(&writes);
        let done = result.as_ref().err().map_or(writes.len(), |e| e.done);
        for (key, value) in &writes[..done] {
            report.writes += 1;
            current.services.insert(*key, *value);
        }
        result.map_err(|e| e.error)?;
        // Deletions: slot 0 of the external scope first, then the rest.
        let mut deletes: Vec<Svc4Key> = current
            .services
            .keys()
            .filter(|k| !new.services.contains_key(k))
            .copied()
            .collect();
        deletes.sort_by_key(|k| (k.slot != 0, k.scope, k.slot));
        for key in deletes {
            self.maps.delete_service(&key)?;
            report.deletes += 1;
            current.services.remove(&key);
        }
        for range in current.source_ranges.clone().difference(&new.source_ranges) {
            self.maps.delete_source_range(range.0, &range.1.into())?;
            report.deletes += 1;
            current.source_ranges.remove(range);
        }
        for member in current.affinity_match.clone().difference(&new.affinity_match) {
            self.maps.delete_affinity_match(member)?;
            report.deletes += 1;
            current.affinity_match.remove(member);
        }
        Ok(())
    }

    /// Break-before-make, first half: deletes the frontend's slot-0 entries (the external scope
    /// first, whose `TWO_SCOPES` flag points at the internal one), so lookups miss it as if it
    /// were being removed, then every entry `new` does not have. The reverse-NAT entry stays (same
    /// id: established flows are unaffected). `write_frontend_entries` then writes the frontend
    /// as new, slot 0 last.
    fn withdraw_frontend_entries(
        &mut self,
        new: &FrontendEntries,
        current: &mut FrontendEntries,
        report: &mut ApplyReport,
    ) -> Result<(), MapError> {
        let mut keys: Vec<Svc4Key> = current
            .services
            .keys()
            .filter(|k| k.slot == 0 || !new.services.contains_key(k))
            .copied()
            .collect();
        keys.sort_by_key(|k| (k.slot != 0, k.scope, k.slot));
        for key in keys {
            self.maps.delete_service(&key)?;
            report.deletes += 1;
            current.services.remove(&key);
        }
        for range in current.source_ranges.clone().difference(&new.source_ranges) {
            self.maps.delete_source_range(range.0, &range.1.into())?;
            report.deletes += 1;
            current.source_ranges.remove(range);
        }
        for member in current.affinity_match.clone().difference(&new.affinity_match) {
            self.maps.delete_affinity_match(member)?;
            report.deletes += 1;
            current.affinity_match.remove(member);
        }
        Ok(())
    }

    fn remove_frontend(&mut self, frontend: &Frontend, report: &mut ApplyReport) {
        let Some(mut current) = self.frontends.remove(frontend) else {
            return;
        };
        self.count_frontend(&current, -1);
        let result = (|| -> Result<(), MapError> {
            let mut keys: Vec<Svc4Key> = current.services.keys().copied().collect();
            keys.sort_by_key(|k| (k.slot != 0, k.scope, k.slot));
            for key in keys {
                self.maps.delete_service(&key)?;
                report.deletes += 1;
                current.services.remove(&key);
            }
            self.maps.delete_revnat(current.rev_nat_id)?;
            report.deletes += 1;
            for range in std::mem::take(&mut current.source_ranges) {
                self.maps.delete_source_range(range.0, &range.1.into())?;
                report.deletes += 1;
            }
            for member in std::mem::take(&mut current.affinity_match) {
                self.maps.delete_affinity_match(&member)?;
                report.deletes += 1;
            }
            Ok(())
        })();
        match result {
            Ok(()) => self.rev_ids.free(current.rev_nat_id),
            Err(e) => {
                report.errors.push(format!("removing {frontend}: {e}"));
                // Keep what is left so the next apply retries the deletion.
                self.count_frontend(&current, 1);
                self.frontends.insert(*frontend, current);
            }
        }
    }
}

/// How a frontend is rewritten (see [`Applier::plan_writes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WriteMode {
    /// New entries first, slot 0 last, then the stale ones: lookups see the old or the new
    /// frontend, never a gap; needs room for both for a moment.
    MakeBeforeBreak,
    /// Slot 0 and the stale entries first, then the new ones: lookups miss the frontend for a
    /// moment; needs no more room than the larger of the old and new frontend.
    BreakBeforeMake,
}

/// How one frontend changes the entry count of one map.
#[derive(Clone, Copy, Debug, Default)]
struct Delta {
    /// Keys the new entries have and the old ones do not.
    added: i64,
    /// Keys the old entries have and the new ones do not.
    removed: i64,
}

impl Delta {
    fn net(self) -> i64 {
        self.added - self.removed
    }
}

/// Counts the keys only in `new` (added) and only in `old` (removed), from two sorted sequences.
fn delta<K: Ord>(new: impl Iterator<Item = K>, old: impl Iterator<Item = K>) -> Delta {
    let (mut new, mut old) = (new.peekable(), old.peekable());
    let mut d = Delta::default();
    loop {
        let step = match (new.peek(), old.peek()) {
            (Some(a), Some(b)) => a.cmp(b),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => return d,
        };
        match step {
            std::cmp::Ordering::Less => {
                d.added += 1;
                new.next();
            }
            std::cmp::Ordering::Greater => {
                d.removed += 1;
                old.next();
            }
            std::cmp::Ordering::Equal => {
                new.next();
                old.next();
            }
        }
    }
}

/// Why a frontend's entries cannot be built.
#[derive(Debug)]
enum EntriesError {
    /// A backend has no id (the backends map is full).
    NoBackendId(BackendAddr),
    /// A scope has more backends than `Svc4Value::count` (a `u16`) can count. The plan never
    /// asks for this (`MAX_BACKENDS_PER_SCOPE`); checked here so that it could never wrap.
    TooManyBackends(usize),
}

/// The map entries of one frontend.
fn entries_for(
    frontend: &Frontend,
    plan: &FrontendPlan,
    rev_nat_id: u32,
    backend_id: &dyn Fn(&BackendAddr) -> Option<u32>,
) -> Result<FrontendEntries, EntriesError> {
    let proto = frontend.proto.number();
    let addr = frontend.addr.octets();
    let mut services = BTreeMap::new();
    let mut affinity_match = BTreeSet::new();
    for scope in &plan.scopes {
        let key = Svc4Key::new(addr, frontend.port, proto, scope.scope, 0);
        let count = u16::try_from(scope.backends.len())
            .map_err(|_| EntriesError::TooManyBackends(scope.backends.len()))?;
        for (slot, backend) in (1..=count).zip(&scope.backends) {
            let id = backend_id(backend).ok_or(EntriesError::NoBackendId(*backend))?;
            services.insert(key.with_slot(slot), Svc4Value::slot(rev_nat_id, id));
            if plan.affinity_timeout > 0 {
                affinity_match.insert(AffinityMatchKey {
                    backend_id: id,
                    rev_nat_id,
                });
            }
        }
        services.insert(
            key,
            Svc4Value::frontend(rev_nat_id, count, scope.flags, plan.affinity_timeout),
        );
    }
    let source_ranges = plan
        .source_ranges
        .iter()
        .map(|net| {
            (
                SrcRange4::prefix_len(net.prefix_len()),
                SrcRange4::new(rev_nat_id, net.network().octets()).into(),
            )
        })
        .collect();
    Ok(FrontendEntries {
        rev_nat_id,
        service: plan.service.clone(),
        services,
        revnat: RevNat4Value {
            addr,
            port: frontend.port,
            proto,
            _pad: 0,
        },
        affinity_match,
        source_ranges,
    })
}

#[cfg(test)]
mod tests;
