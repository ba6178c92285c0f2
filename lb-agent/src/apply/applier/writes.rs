//! The writes themselves, in the make-before-break order the module doc gives: a Service's
//! backends, each frontend's entries (reverse NAT, source ranges and affinity members, slots,
//! slot 0 last, then the stale ones), a frontend's withdrawal and removal. Each keeps the mirror
//! accurate write by write, so a failure leaves it true to the kernel.

use std::collections::{BTreeMap, BTreeSet};

use lb_common::service::SvcValue;

use super::{Applier, ApplyReport, FrontendEntries, WriteMode, backend_value, svc_name};
use crate::{
    apply::{BackendEntry, MapError, MapOps, ServiceMapKey},
    family::IpFamily,
    plan::{BackendAddr, Frontend},
};

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
            .filter(|(addr, id, value)| self.backends.get(addr) != Some(&(*id, *value)))
            .collect();
        let entries: Vec<(u32, BackendEntry)> = writes.iter().map(|(_, id, v)| (*id, *v)).collect();
        let result = self.maps.put_backends(&entries);
        let done = result.as_ref().err().map_or(writes.len(), |e| e.done);
        for (addr, id, value) in &writes[..done] {
            report.writes += 1;
            if self.backends.insert(*addr, (*id, *value)).is_none() {
                *self.occupancy.backends.get_mut(IpFamily::of(&addr.addr)) += 1;
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
            services: BTreeMap::new(),
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
            self.maps.put_source_range(range)?;
            report.writes += 1;
            current.source_ranges.insert(*range);
        }
        for member in new.affinity_match.difference(&current.affinity_match.clone()) {
            self.maps.put_affinity_match(member)?;
            report.writes += 1;
            current.affinity_match.insert(*member);
        }
        // The Maglev table before the frontend entry that asks for it; its backends are written.
        if let Some(table) = &new.maglev
            && current.maglev.as_ref() != Some(table)
        {
            let positions = table.positions(&mut self.maglev_tables);
            self.maps.put_maglev(new.rev_nat_id, &positions)?;
            report.writes += 1;
            current.maglev = Some(table.clone());
        }
        // Writes: internal scope first, and within a scope the slots before slot 0.
        let mut writes: Vec<(&ServiceMapKey, &SvcValue)> = new
            .services
            .iter()
            .filter(|(k, v)| current.services.get(k) != Some(v))
            .collect();
        writes.sort_by_key(|(k, _)| (std::cmp::Reverse(k.scope), k.slot == 0, k.slot));
        let writes: Vec<(ServiceMapKey, SvcValue)> = writes.into_iter().map(|(k, v)| (*k, *v)).collect();
        let result = self.maps.put_services(&writes);
        let done = result.as_ref().err().map_or(writes.len(), |e| e.done);
        for (key, value) in &writes[..done] {
            report.writes += 1;
            current.services.insert(*key, *value);
        }
        result.map_err(|e| e.error)?;
        // Deletions: slot 0 of the external scope first, then the rest.
        let mut deletes: Vec<ServiceMapKey> = current
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
            self.maps.delete_source_range(range)?;
            report.deletes += 1;
            current.source_ranges.remove(range);
        }
        for member in current.affinity_match.clone().difference(&new.affinity_match) {
            self.maps.delete_affinity_match(member)?;
            report.deletes += 1;
            current.affinity_match.remove(member);
        }
        // A table no frontend entry asks for any more (slot 0 was rewritten above).
        if new.maglev.is_none() && current.maglev.is_some() {
            self.maps.delete_maglev(new.rev_nat_id)?;
            report.deletes += 1;
            current.maglev = None;
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
        let mut keys: Vec<ServiceMapKey> = current
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
            let mut keys: Vec<ServiceMapKey> = current.services.keys().copied().collect();
            keys.sort_by_key(|k| (k.slot != 0, k.scope, k.slot));
            for key in keys {
                self.maps.delete_service(&key)?;
                report.deletes += 1;
                current.services.remove(&key);
            }
            if current.maglev.is_some() {
                self.maps.delete_maglev(current.rev_nat_id)?;
                report.deletes += 1;
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
