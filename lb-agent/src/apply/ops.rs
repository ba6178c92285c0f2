//! The writes the map writer needs, as a trait: implemented by the kernel maps and by a fake.

use std::collections::BTreeMap;

use lb_common::{affinity::AffinityMatchKey, config::DatapathConfig, revnat::SvcName, service::SvcValue};

use super::entries::{BackendEntry, RevNatEntry, ServiceMapKey, SourceRange};
use crate::family::IpFamily;

/// A failed map operation. The message includes the OS error, which is therefore not also a
/// `source()` (it would be printed twice in a chain).
#[derive(Debug, thiserror::Error)]
#[error("{op} on map {map}: {error}")]
pub struct MapError {
    pub map: &'static str,
    pub op: &'static str,
    pub error: std::io::Error,
}

impl MapError {
    pub fn new(map: &'static str, op: &'static str, error: std::io::Error) -> Self {
        Self { map, op, error }
    }

    /// The kernel refused a new entry because the map is at max_entries.
    pub fn is_full(&self) -> bool {
        matches!(self.error.raw_os_error(), Some(libc::E2BIG) | Some(libc::ENOSPC))
    }
}

/// Everything the agent writes, as read back from the maps of both families (restart recovery,
/// inspection).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub services: BTreeMap<ServiceMapKey, SvcValue>,
    pub backends: BTreeMap<u32, BackendEntry>,
    pub revnat: BTreeMap<u32, RevNatEntry>,
    pub names: BTreeMap<u32, SvcName>,
    pub affinity_match: Vec<AffinityMatchKey>,
    pub source_ranges: Vec<SourceRange>,
}

/// A batch write that stopped: the entries before `done` are written, the one at `done` failed
/// with `error`, the rest were not tried.
#[derive(Debug)]
pub struct BatchError {
    pub done: usize,
    pub error: MapError,
}

/// The writes, one method per kind of map entry, on entries of either family (the family of an
/// entry is its address's; ids are one space across both families, so an id-keyed delete names
/// the family whose map holds it).
pub trait MapOps {
    /// Writes `entries` in order, as one `put_service` each would (the kernel maps do it in one
    /// BPF_MAP_UPDATE_BATCH call per run of one family: a cold start writes ~220,000 entries at
    /// 10,000 Services).
    fn put_services(&mut self, entries: &[(ServiceMapKey, SvcValue)]) -> Result<(), BatchError> {
        for (done, (key, value)) in entries.iter().enumerate() {
            self.put_service(key, value)
                .map_err(|error| BatchError { done, error })?;
        }
        Ok(())
    }
    /// Writes `entries` in order, as one `put_backend` each would.
    fn put_backends(&mut self, entries: &[(u32, BackendEntry)]) -> Result<(), BatchError> {
        for (done, (id, value)) in entries.iter().enumerate() {
            self.put_backend(*id, value)
                .map_err(|error| BatchError { done, error })?;
        }
        Ok(())
    }
    fn put_service(&mut self, key: &ServiceMapKey, value: &SvcValue) -> Result<(), MapError>;
    fn delete_service(&mut self, key: &ServiceMapKey) -> Result<(), MapError>;
    fn put_backend(&mut self, id: u32, value: &BackendEntry) -> Result<(), MapError>;
    fn delete_backend(&mut self, family: IpFamily, id: u32) -> Result<(), MapError>;
    fn put_revnat(&mut self, id: u32, value: &RevNatEntry, name: &SvcName) -> Result<(), MapError>;
    fn delete_revnat(&mut self, family: IpFamily, id: u32) -> Result<(), MapError>;
    fn put_affinity_match(&mut self, key: &AffinityMatchKey) -> Result<(), MapError>;
    fn delete_affinity_match(&mut self, key: &AffinityMatchKey) -> Result<(), MapError>;
    fn put_source_range(&mut self, range: &SourceRange) -> Result<(), MapError>;
    fn delete_source_range(&mut self, range: &SourceRange) -> Result<(), MapError>;
    fn put_config(&mut self, config: &DatapathConfig) -> Result<(), MapError>;
    /// The writer adopted `snapshot` (what a previous run wrote) without writing it again.
    fn adopted(&mut self, _snapshot: &Snapshot) -> Result<(), MapError> {
        Ok(())
    }
    fn snapshot(&self) -> Result<Snapshot, MapError>;
}
