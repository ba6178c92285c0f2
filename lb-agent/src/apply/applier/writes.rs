//! The writes themselves, in the make-before-break order the module doc gives: a Service's
//! backends, each frontend's entries (reverse NAT, source ranges and affinity members, slots,
//! slot 0 last, then the stale ones), a frontend's withdrawal and removal, and the apply's Maglev
//! tables together at the end. Each keeps the mirror accurate write by write, so a failure leaves
//! it true to the kernel.

use std::collections::BTreeSet;

use lb_common::service::flags;

use super::{
    Applier, ApplyReport, FrontendEntries, MaglevEntry, MaglevTables, WriteMode, backend_value, svc_name,
};
use crate::{
    apply::{
        BackendEntry, MapError, MapOps, ServiceMapKey, ServiceMapValue,
        entries::{SvcEntries, SvcEntry, service_key},
    },
    family::IpFamily,
    plan::{BackendAddr, Frontend},
};

/// Tables swapped in per batch: each built table is 64 KiB at the default size, and a batch's
/// are all in memory (and open) until it is written; one grace period per batch.
const MAGLEV_BATCH: usize = 256;

/// A Maglev table step 3 left for step 4 (`flush_maglev`).
pub(in crate::apply) struct PendingTable {
    frontend: Frontend,
    rev_nat_id: u32,
    table: MaglevEntry,
    /// Slot-0 entries written without `MAGLEV` until the table is in (a new table, or one of
    /// another size, which the old entry's size must not index): rewritten with it after.
    held: Vec<SvcEntry>,
}

impl<M: MapOps> Applier<M> {
    /// Writes a backend's entry unless the map already holds exactly that; false on failure.
    pub(super) fn put_backend(
        &mut self,
        addr: BackendAddr,
        id: u32,
        flags: u8,
        report: &mut ApplyReport,
    ) -> bool {
        self.put_backends(&[(addr, id, flags)], report)
    }

    /// Writes the backends' entries the map does not already hold exactly (in one batch); false
    /// when one failed (those before it are written and mirrored, the rest are not).
    pub(super) fn put_backends(
        &mut self,
        backends: &[(BackendAddr, u32, u8)],
        report: &mut ApplyReport,
    ) -> bool {
        let writes: Vec<(BackendAddr, u32, BackendEntry)> = backends
            .iter()
            .map(|(addr, id, flags)| (*addr, *id, backend_value(addr, *flags)))
            .filter(|(addr, id, value)| self.backends.get(addr) != Some(&(*id, value.flags)))
            .collect();
        let entries: Vec<(u32, BackendEntry)> = writes.iter().map(|(_, id, v)| (*id, *v)).collect();
        let result = self.maps.put_backends(&entries);
        let done = result.as_ref().err().map_or(writes.len(), |e| e.done);
        for (addr, id, value) in &writes[..done] {
            report.writes += 1;
            if self.backends.insert(*addr, (*id, value.flags)).is_none() {
                *self.occupancy.backends.get_mut(IpFamily::of(&addr.addr)) += 1;
                self.backend_addrs.insert(*id, *addr);
                // Deleted again at the end of this apply unless a frontend now uses it.
                self.maybe_unused.push(*id);
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

    /// Writes one frontend; true when it was withdrawn first (break-before-make).
    pub(super) fn write_frontend(
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
            services: SvcEntries::default(),
            affinity_match: BTreeSet::new(),
            source_ranges: BTreeSet::new(),
            maglev: None,
            ..new.clone()
        });
        if old.is_some() {
            self.count_frontend(&current, -1);
        }
        let mut result = Ok(());
        let withdraw = mode == WriteMode::BreakBeforeMake && old.is_some();
        if withdraw {
            result = self.withdraw_frontend_entries(&frontend, &new, &mut current, report);
        }
        if result.is_ok() {
            result = self.write_frontend_entries(frontend, old.as_ref(), &new, &mut current, report);
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
        frontend: Frontend,
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
            self.maps.put_source_range(range)?;
            report.writes += 1;
            current.source_ranges.insert(*range);
        }
        for member in new.affinity_match.difference(&current.affinity_match.clone()) {
            self.maps.put_affinity_match(member)?;
            report.writes += 1;
            current.affinity_match.insert(*member);
        }
        // The Maglev table goes in with the apply's others (step 4). Until then the frontend
        // entry of a new table, or of one that changes size, does not ask for it (the slots
        // decide, as for random choice); a table of the same size is swapped under its entry.
        let pending = new
            .maglev
            .as_ref()
            .filter(|t| current.maglev.as_ref() != Some(*t));
        let hold = pending.is_some_and(|t| current.maglev.as_ref().is_none_or(|c| c.size != t.size));
        let mut held = Vec::new();
        // Writes: internal scope first, and within a scope the slots before slot 0.
        let mut writes: Vec<SvcEntry> = new
            .services
            .iter()
            .map(|e| {
                let mut e = *e;
                if hold && e.slot == 0 && e.value.has(flags::MAGLEV) {
                    held.push(e);
                    e.value.flags &= !flags::MAGLEV;
                }
                e
            })
            .filter(|e| current.services.get(e.position()) != Some(e))
            .collect();
        writes.sort_by_key(|e| (std::cmp::Reverse(e.scope), e.slot == 0, e.slot));
        let result = self
            .map_entries(&frontend, &writes)
            .and_then(|entries| self.maps.put_services(&entries));
        let done = result.as_ref().err().map_or(writes.len(), |e| e.done);
        for entry in &writes[..done] {
            report.writes += 1;
            current.services.insert(*entry);
        }
        result.map_err(|e| e.error)?;
        // Every entry is in: the table may follow (not otherwise, or its held entry would be
        // rewritten over missing slots).
        if let Some(table) = pending {
            self.pending_maglev.push(PendingTable {
                frontend,
                rev_nat_id: new.rev_nat_id,
                table: table.clone(),
                held,
            });
        }
        // Deletions: slot 0 of the external scope first, then the rest.
        let deletes = delete_order(
            current
                .services
                .iter()
                .filter(|e| !new.services.contains(e.position())),
        );
        for position in deletes {
            self.maps.delete_service(&service_key(&frontend, position))?;
            report.deletes += 1;
            current.services.remove(position);
        }
        for range in current.source_ranges.clone().difference(&new.source_ranges) {
            self.maps.delete_source_range(range)?;
            report.deletes += 1;
            current.source_ranges.remove(range);
        }
        for member in current.affinity_match.clone().difference(&new.affinity_match) {
            self.maps.delete_affinity_match(member)?;
            report.deletes += 1;
            current.affinity_match.remove(member);
        }
        // A table no frontend entry asks for any more (slot 0 was rewritten above): deleted in
        // step 4.
        if new.maglev.is_none() && current.maglev.is_some() {
            self.doomed_maglev.push(new.rev_nat_id);
            current.maglev = None;
        }
        Ok(())
    }

    /// Step 4: the tables of frontend entries that no longer ask for one go (first: a removed
    /// frontend's id may be a new one's now), then this apply's tables go in, a batch at a time,
    /// and the frontend entries written without `MAGLEV` are rewritten with it. Every backend a
    /// new table names was written in step 3; those an old table named are deleted only in step 5.
    pub(super) fn flush_maglev(&mut self, report: &mut ApplyReport) {
        let mut pending = std::mem::take(&mut self.pending_maglev);
        // Equal tables side by side, so that a batch computes each once and its frontends share
        // one inner array (`MapOps::put_maglev_tables`) however many Services the apply has.
        pending.sort_by(|a, b| {
            (&a.table.members, a.table.size, a.table.seed).cmp(&(
                &b.table.members,
                b.table.size,
                b.table.seed,
            ))
        });
        let replaced: BTreeSet<u32> = pending.iter().map(|p| p.rev_nat_id).collect();
        let doomed: Vec<u32> = std::mem::take(&mut self.doomed_maglev)
            .into_iter()
            .filter(|id| !replaced.contains(id))
            .collect();
        if !doomed.is_empty() {
            let result = self.maps.delete_maglev_tables(&doomed);
            report.deletes += result.as_ref().err().map_or(doomed.len(), |e| e.done);
            if let Err(e) = result {
                // Left in the map, unasked for by any entry: the next restart's adoption deletes
                // it, a new table with its id replaces it.
                report.errors.push(format!("deleting Maglev tables: {}", e.error));
            }
        }
        for batch in pending.chunks(MAGLEV_BATCH) {
            // One computation per set of members, size and seed within the batch (a Service's
            // frontends on several addresses share their endpoints); dropped with the batch.
            let mut built = MaglevTables::new();
            let tables: Vec<(u32, std::sync::Arc<[u32]>)> = batch
                .iter()
                .map(|p| (p.rev_nat_id, p.table.positions(&mut built)))
                .collect();
            drop(built);
            let result = self.maps.put_maglev_tables(&tables);
            drop(tables);
            let done = result.as_ref().err().map_or(batch.len(), |e| e.done);
            let mut flag_writes = Vec::new();
            for p in &batch[..done] {
                report.writes += 1;
                if let Some(mut current) = self.frontends.remove(&p.frontend) {
                    self.count_frontend(&current, -1);
                    current.maglev = Some(p.table.clone());
                    self.count_frontend(&current, 1);
                    self.frontends.insert(p.frontend, current);
                    flag_writes.extend(p.held.iter().map(|held| (p.frontend, *held)));
                }
            }
            if let Err(e) = result {
                report.errors.push(format!("Maglev tables: {}", e.error));
                self.retry.extend(batch[done..].iter().map(|p| p.frontend));
            }
            self.write_held_entries(&flag_writes, report);
        }
    }

    /// Slot-0 entries that waited for their Maglev table, rewritten with `MAGLEV` (one batch).
    fn write_held_entries(&mut self, entries: &[(Frontend, SvcEntry)], report: &mut ApplyReport) {
        // Slot-0 entries: no backend copy to look up.
        let writes: Vec<(ServiceMapKey, ServiceMapValue)> = entries
            .iter()
            .map(|(frontend, e)| {
                let value = ServiceMapValue::frontend(e.value);
                (e.key(frontend), value)
            })
            .collect();
        let result = self.maps.put_services(&writes);
        let done = result.as_ref().err().map_or(writes.len(), |e| e.done);
        for (frontend, entry) in &entries[..done] {
            report.writes += 1;
            if let Some(current) = self.frontends.get_mut(frontend) {
                current.services.insert(*entry);
            }
        }
        if let Err(e) = result {
            report
                .errors
                .push(format!("frontend entries after their Maglev tables: {}", e.error));
            self.retry.extend(entries[done..].iter().map(|(f, _)| *f));
        }
    }

    /// Break-before-make, first half: deletes the frontend's slot-0 entries (the external scope
    /// first, whose `TWO_SCOPES` flag points at the internal one), so lookups miss it as if it
    /// were being removed, then every entry `new` does not have. The reverse-NAT entry stays (same
    /// id: established flows are unaffected). `write_frontend_entries` then writes the frontend
    /// as new, slot 0 last.
    fn withdraw_frontend_entries(
        &mut self,
        frontend: &Frontend,
        new: &FrontendEntries,
        current: &mut FrontendEntries,
        report: &mut ApplyReport,
    ) -> Result<(), MapError> {
        let deletes = delete_order(
            current
                .services
                .iter()
                .filter(|e| e.slot == 0 || !new.services.contains(e.position())),
        );
        for position in deletes {
            self.maps.delete_service(&service_key(frontend, position))?;
            report.deletes += 1;
            current.services.remove(position);
        }
        for range in current.source_ranges.clone().difference(&new.source_ranges) {
            self.maps.delete_source_range(range)?;
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

    pub(super) fn remove_frontend(&mut self, frontend: &Frontend, report: &mut ApplyReport) {
        let Some(mut current) = self.frontends.remove(frontend) else {
            return;
        };
        self.count_frontend(&current, -1);
        let result = (|| -> Result<(), MapError> {
            for position in delete_order(current.services.iter()) {
                self.maps.delete_service(&service_key(frontend, position))?;
                report.deletes += 1;
                current.services.remove(position);
            }
            // Deleted in step 4, with the apply's others.
            if current.maglev.is_some() {
                self.doomed_maglev.push(current.rev_nat_id);
                current.maglev = None;
            }
            self.maps
                .delete_revnat(current.revnat.family(), current.rev_nat_id)?;
            report.deletes += 1;
            for range in std::mem::take(&mut current.source_ranges) {
                self.maps.delete_source_range(&range)?;
                report.deletes += 1;
            }
            for member in std::mem::take(&mut current.affinity_match) {
                self.maps.delete_affinity_match(&member)?;
                report.deletes += 1;
            }
            Ok(())
        })();
        match result {
            Ok(()) => self
                .rev_ids
                .get_mut(current.revnat.family())
                .free(current.rev_nat_id),
            Err(e) => {
                report.errors.push(format!("removing {frontend}: {e}"));
                // Keep what is left, and retry the deletion at the next apply (an incremental
                // one too: nothing else would name this frontend again).
                self.count_frontend(&current, 1);
                self.frontends.insert(*frontend, current);
                self.retry.insert(*frontend);
            }
        }
    }
}

impl<M: MapOps> Applier<M> {
    /// The map's keys and values of a frontend's entries. A slot's backend copy is its id's entry:
    /// every id a wanted entry names has one (its backends are written first), so a missing one is
    /// a bug, reported as a failed batch of which nothing was written.
    fn map_entries(
        &self,
        frontend: &Frontend,
        entries: &[SvcEntry],
    ) -> Result<Vec<(ServiceMapKey, ServiceMapValue)>, crate::apply::BatchError> {
        entries
            .iter()
            .map(|e| {
                let value = e
                    .map_value(|id| self.backend_addrs.get(&id).copied())
                    .ok_or_else(|| crate::apply::BatchError {
                        done: 0,
                        error: MapError::new(
                            IpFamily::of(&frontend.addr).maps().services,
                            "update",
                            std::io::Error::other(format!(
                                "{frontend}: slot {} names backend id {}, which has no entry",
                                e.slot, e.value.backend_id
                            )),
                        ),
                    })?;
                Ok((e.key(frontend), value))
            })
            .collect()
    }
}

/// The order a frontend's entries are deleted in: slot 0 of the external scope first (lookups
/// miss the frontend from then on; its `TWO_SCOPES` flag points at the internal one), then the
/// internal scope's slot 0, then the slots.
fn delete_order<'a>(entries: impl Iterator<Item = &'a SvcEntry>) -> Vec<(u8, u16)> {
    let mut positions: Vec<(u8, u16)> = entries.map(SvcEntry::position).collect();
    positions.sort_by_key(|&(scope, slot)| (slot != 0, scope, slot));
    positions
}
