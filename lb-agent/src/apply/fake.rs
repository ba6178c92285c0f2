//! An in-memory `MapOps` for unit tests of the writer (in the spirit of Cilium's `lbmap_mock` and
//! Katran's `testing` mode): it keeps the maps as BTreeMaps, logs every operation in order, and
//! can refuse inserts beyond a capacity like a full kernel map.

use std::collections::BTreeSet;

use lb_common::{
    affinity::AffinityMatchKey,
    backend::Backend4Value,
    catalog,
    config::DatapathConfig,
    revnat::{RevNat4Value, SvcName},
    service::{SrcRange4, Svc4Key, Svc4Value},
};

use super::ops::{MapError, MapOps, Snapshot};

/// One logged operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    PutService(Svc4Key, Svc4Value),
    DeleteService(Svc4Key),
    PutBackend(u32, Backend4Value),
    DeleteBackend(u32),
    PutRevNat(u32, RevNat4Value),
    DeleteRevNat(u32),
    PutAffinityMatch(AffinityMatchKey),
    DeleteAffinityMatch(AffinityMatchKey),
    PutSourceRange(u32, SrcRange4),
    DeleteSourceRange(u32, SrcRange4),
    PutConfig,
}

#[derive(Clone, Debug, Default)]
pub struct FakeMaps {
    pub state: Snapshot,
    pub config: Option<DatapathConfig>,
    pub log: Vec<Op>,
    /// Refuse new service-map keys beyond this many entries (E2BIG), like a full kernel map.
    pub services_capacity: Option<usize>,
}

fn full(map: &'static str) -> MapError {
    MapError::new(map, "update", std::io::Error::from_raw_os_error(libc::E2BIG))
}

impl FakeMaps {
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks the invariant readers rely on: every frontend entry's slots exist and point at
    /// existing backends, and every frontend's reverse-NAT entry exists.
    pub fn check_consistent(&self) -> Result<(), String> {
        for (key, value) in &self.state.services {
            if key.slot == 0 {
                for slot in 1..=value.count {
                    let slot_key = key.with_slot(slot);
                    let Some(entry) = self.state.services.get(&slot_key) else {
                        return Err(format!(
                            "{key:?} has count {} but slot {slot} is missing",
                            value.count
                        ));
                    };
                    if !self.state.backends.contains_key(&entry.backend_id) {
                        return Err(format!(
                            "{slot_key:?} points at missing backend {}",
                            entry.backend_id
                        ));
                    }
                }
                if !self.state.revnat.contains_key(&value.rev_nat_id) {
                    return Err(format!("{key:?} has no reverse-NAT entry {}", value.rev_nat_id));
                }
            }
        }
        Ok(())
    }

    /// Replays `log` on empty maps, calling `check` after every operation: what a reader running
    /// concurrently with the writer could observe.
    pub fn replay(log: &[Op], mut check: impl FnMut(usize, &FakeMaps)) {
        let mut maps = FakeMaps::new();
        for (i, op) in log.iter().enumerate() {
            let name = SvcName::default();
            let _ = match op {
                Op::PutService(k, v) => maps.put_service(k, v),
                Op::DeleteService(k) => maps.delete_service(k),
                Op::PutBackend(id, v) => maps.put_backend(*id, v),
                Op::DeleteBackend(id) => maps.delete_backend(*id),
                Op::PutRevNat(id, v) => maps.put_revnat(*id, v, &name),
                Op::DeleteRevNat(id) => maps.delete_revnat(*id),
                Op::PutAffinityMatch(k) => maps.put_affinity_match(k),
                Op::DeleteAffinityMatch(k) => maps.delete_affinity_match(k),
                Op::PutSourceRange(p, r) => maps.put_source_range(*p, r),
                Op::DeleteSourceRange(p, r) => maps.delete_source_range(*p, r),
                Op::PutConfig => Ok(()),
            };
            check(i, &maps);
        }
    }

    pub fn frontend_keys(&self) -> BTreeSet<Svc4Key> {
        self.state
            .services
            .keys()
            .filter(|k| k.slot == 0)
            .copied()
            .collect()
    }
}

impl MapOps for FakeMaps {
    fn put_service(&mut self, key: &Svc4Key, value: &Svc4Value) -> Result<(), MapError> {
        if let Some(cap) = self.services_capacity
            && !self.state.services.contains_key(key)
            && self.state.services.len() >= cap
        {
            return Err(full(catalog::SERVICES));
        }
        self.log.push(Op::PutService(*key, *value));
        self.state.services.insert(*key, *value);
        Ok(())
    }

    fn delete_service(&mut self, key: &Svc4Key) -> Result<(), MapError> {
        self.log.push(Op::DeleteService(*key));
        self.state.services.remove(key);
        Ok(())
    }

    fn put_backend(&mut self, id: u32, value: &Backend4Value) -> Result<(), MapError> {
        self.log.push(Op::PutBackend(id, *value));
        self.state.backends.insert(id, *value);
        Ok(())
    }

    fn delete_backend(&mut self, id: u32) -> Result<(), MapError> {
        self.log.push(Op::DeleteBackend(id));
        self.state.backends.remove(&id);
        Ok(())
    }

    fn put_revnat(&mut self, id: u32, value: &RevNat4Value, name: &SvcName) -> Result<(), MapError> {
        self.log.push(Op::PutRevNat(id, *value));
        self.state.revnat.insert(id, *value);
        self.state.names.insert(id, *name);
        Ok(())
    }

    fn delete_revnat(&mut self, id: u32) -> Result<(), MapError> {
        self.log.push(Op::DeleteRevNat(id));
        self.state.revnat.remove(&id);
        self.state.names.remove(&id);
        Ok(())
    }

    fn put_affinity_match(&mut self, key: &AffinityMatchKey) -> Result<(), MapError> {
        self.log.push(Op::PutAffinityMatch(*key));
        if !self.state.affinity_match.contains(key) {
            self.state.affinity_match.push(*key);
        }
        Ok(())
    }

    fn delete_affinity_match(&mut self, key: &AffinityMatchKey) -> Result<(), MapError> {
        self.log.push(Op::DeleteAffinityMatch(*key));
        self.state.affinity_match.retain(|k| k != key);
        Ok(())
    }

    fn put_source_range(&mut self, prefix_len: u32, range: &SrcRange4) -> Result<(), MapError> {
        self.log.push(Op::PutSourceRange(prefix_len, *range));
        if !self.state.source_ranges.contains(&(prefix_len, *range)) {
            self.state.source_ranges.push((prefix_len, *range));
        }
        Ok(())
    }

    fn delete_source_range(&mut self, prefix_len: u32, range: &SrcRange4) -> Result<(), MapError> {
        self.log.push(Op::DeleteSourceRange(prefix_len, *range));
        self.state.source_ranges.retain(|e| e != &(prefix_len, *range));
        Ok(())
    }

    fn put_config(&mut self, config: &DatapathConfig) -> Result<(), MapError> {
        self.log.push(Op::PutConfig);
        self.config = Some(*config);
        Ok(())
    }

    fn snapshot(&self) -> Result<Snapshot, MapError> {
        Ok(self.state.clone())
    }
}
