//! The writes the map writer needs, as a trait: implemented by the kernel maps and by a fake.

use std::collections::BTreeMap;

use lb_common::{affinity::AffinityMatchKey, config::DatapathConfig, revnat::SvcName};

use super::entries::{BackendEntry, RevNatEntry, ServiceMapKey, ServiceMapValue, SourceRange};
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
    pub services: BTreeMap<ServiceMapKey, ServiceMapValue>,
    pub backends: BTreeMap<u32, BackendEntry>,
    pub revnat: BTreeMap<u32, RevNatEntry>,
    pub names: BTreeMap<u32, SvcName>,
    pub affinity_match: Vec<AffinityMatchKey>,
    pub source_ranges: Vec<SourceRange>,
    /// Each frontend's Maglev table by rev_nat_id: the backend id at each position.
    pub maglev: BTreeMap<u32, std::sync::Arc<[u32]>>,
    /// The seed the tables were built with: `lb_config`'s `maglev_seed` (the fixed seed's 0
    /// before any configuration, or from a release before the seed), written with the tables.
    pub maglev_seed: crate::plan::maglev::HashSeed,
}

impl Snapshot {
    /// Checks what a packet relies on at any moment, the write order's promise (and, after a
    /// kill -9 in the middle of a sync, what the pinned maps must still hold): every frontend
    /// entry's slots exist and point at existing backends of the frontend's family, whose
    /// address, port and protocol their copies hold (the flags of a copy may lag its backend's
    /// for the few writes between the two); its reverse-NAT entry exists in its family; and a
    /// frontend whose external entry says `TWO_SCOPES` has its internal entry.
    pub fn check_consistent(&self) -> Result<(), String> {
        for (key, value) in self.services.iter().filter(|(k, _)| k.slot == 0) {
            let value = &value.entry;
            for slot in 1..=value.count {
                let slot_key = key.with_slot(slot);
                let Some(entry) = self.services.get(&slot_key) else {
                    return Err(format!(
                        "{key:?} has count {} but slot {slot} is missing",
                        value.count
                    ));
                };
                let backend = self.backends.get(&entry.entry.backend_id);
                let Some(backend) = backend.filter(|b| IpFamily::of(&b.addr) == key.family()) else {
                    return Err(format!(
                        "{slot_key:?} points at missing backend {}",
                        entry.entry.backend_id
                    ));
                };
                let copy = entry.backend.map(|c| (c.addr, c.port, c.proto));
                if copy != Some((backend.addr, backend.port, backend.proto)) {
                    return Err(format!(
                        "{slot_key:?} holds {:?} for backend {}, which is {backend:?}",
                        entry.backend, entry.entry.backend_id
                    ));
                }
            }
            let revnat = self.revnat.get(&value.rev_nat_id);
            if revnat.is_none_or(|r| r.family() != key.family()) {
                return Err(format!("{key:?} has no reverse-NAT entry {}", value.rev_nat_id));
            }
            // A Maglev table is optional (the slots decide without one), but the ids it holds
            // must be backends of the frontend's family.
            if let Some(table) = self.maglev.get(&value.rev_nat_id)
                && value.flags & lb_common::service::flags::MAGLEV != 0
            {
                if value.backend_id as usize != table.len() {
                    return Err(format!(
                        "{key:?} says its Maglev table has {} entries; it has {}",
                        value.backend_id,
                        table.len()
                    ));
                }
                if let Some(id) = table.iter().find(|id| {
                    self.backends
                        .get(id)
                        .is_none_or(|b| IpFamily::of(&b.addr) != key.family())
                }) {
                    return Err(format!("{key:?}'s Maglev table points at missing backend {id}"));
                }
            }
            let internal = ServiceMapKey {
                scope: lb_common::service::SCOPE_INTERNAL,
                ..*key
            };
            if key.scope == lb_common::service::SCOPE_EXTERNAL
                && value.flags & lb_common::service::flags::TWO_SCOPES != 0
                && !self.services.contains_key(&internal)
            {
                return Err(format!("{key:?} says TWO_SCOPES but has no internal entry"));
            }
        }
        Ok(())
    }
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
    fn put_services(&mut self, entries: &[(ServiceMapKey, ServiceMapValue)]) -> Result<(), BatchError> {
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
    fn put_service(&mut self, key: &ServiceMapKey, value: &ServiceMapValue) -> Result<(), MapError>;
    fn delete_service(&mut self, key: &ServiceMapKey) -> Result<(), MapError>;
    fn put_backend(&mut self, id: u32, value: &BackendEntry) -> Result<(), MapError>;
    fn delete_backend(&mut self, family: IpFamily, id: u32) -> Result<(), MapError>;
    fn put_revnat(&mut self, id: u32, value: &RevNatEntry, name: &SvcName) -> Result<(), MapError>;
    fn delete_revnat(&mut self, family: IpFamily, id: u32) -> Result<(), MapError>;
    fn put_affinity_match(&mut self, key: &AffinityMatchKey) -> Result<(), MapError>;
    fn delete_affinity_match(&mut self, key: &AffinityMatchKey) -> Result<(), MapError>;
    fn put_source_range(&mut self, range: &SourceRange) -> Result<(), MapError>;
    fn delete_source_range(&mut self, range: &SourceRange) -> Result<(), MapError>;
    /// Puts frontend `rev_nat_id`'s Maglev table in `lb_maglev`: built whole first, then swapped
    /// in with one update, so a lookup sees the old table or the new one, never a mix.
    fn put_maglev(&mut self, rev_nat_id: u32, positions: &[u32]) -> Result<(), MapError>;
    fn delete_maglev(&mut self, rev_nat_id: u32) -> Result<(), MapError>;
    /// `put_maglev` for several frontends, in order; a failure says how many went in. The
    /// kernel's writer swaps them in with one batch update: each update of a map of maps waits
    /// for an RCU grace period (milliseconds), once per call rather than once per table; and
    /// frontends given one `Arc` share one inner array.
    fn put_maglev_tables(&mut self, tables: &[(u32, std::sync::Arc<[u32]>)]) -> Result<(), BatchError> {
        for (done, (id, positions)) in tables.iter().enumerate() {
            self.put_maglev(*id, positions)
                .map_err(|error| BatchError { done, error })?;
        }
        Ok(())
    }
    /// `delete_maglev` for several frontends (absent ones are no error), as `put_maglev_tables`.
    fn delete_maglev_tables(&mut self, ids: &[u32]) -> Result<(), BatchError> {
        for (done, id) in ids.iter().enumerate() {
            self.delete_maglev(*id)
                .map_err(|error| BatchError { done, error })?;
        }
        Ok(())
    }
    fn put_config(&mut self, config: &DatapathConfig) -> Result<(), MapError>;
    /// Makes `lb_pod_ifaces` hold exactly `ifindexes` (the interface local-traffic detector's
    /// pod interfaces); written before the `lb_config` entry that turns the detector on.
    fn put_pod_interfaces(&mut self, ifindexes: &std::collections::BTreeSet<u32>) -> Result<(), MapError>;
    /// Makes `lb_masq_addrs` hold exactly `entries` (ifindex -> the interface's masquerade
    /// addresses, 0 the fallback), and the prefilter hold their addresses' bits (replies to them
    /// are un-SNATed at ingress); written before the `lb_config` entry whose flag has them read.
    fn put_masquerade_addrs(
        &mut self,
        entries: &BTreeMap<u32, lb_common::config::MasqueradeAddrs>,
    ) -> Result<(), MapError>;
    /// The family's cluster-ips-check trie (`lb4_cluster_ips`, `lb_common::cluster_ip`) as it
    /// is: prefix -> action (what a previous run left, read once before the first write).
    fn cluster_ip_checks(&self, family: IpFamily) -> Result<BTreeMap<ipnet::IpNet, u8>, MapError>;
    /// Writes (`Some`) or deletes (`None`) the entry of `net` in its family's trie.
    fn set_cluster_ip_check(&mut self, net: &ipnet::IpNet, action: Option<u8>) -> Result<(), MapError>;
    /// Makes the family's covering prefixes (`lb4_svc_ranges`) `ranges` (at most
    /// `cluster_ip::MAX_SERVICE_RANGES`, of the family).
    fn put_service_ranges(&mut self, family: IpFamily, ranges: &[ipnet::IpNet]) -> Result<(), MapError>;
    /// The writer adopted `snapshot` (what a previous run wrote) without writing it again.
    fn adopted(&mut self, _snapshot: &Snapshot) -> Result<(), MapError> {
        Ok(())
    }
    fn snapshot(&self) -> Result<Snapshot, MapError>;
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use lb_common::service::{SCOPE_EXTERNAL, SCOPE_INTERNAL, flags};

    use super::*;

    fn key(slot: u16, scope: u8) -> ServiceMapKey {
        ServiceMapKey::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1)), 80, 6, scope, slot)
    }

    fn frontend(rev_nat_id: u32, count: u16, flags: u16) -> ServiceMapValue {
        ServiceMapValue::frontend(lb_common::service::SvcValue::frontend(
            rev_nat_id, count, flags, 0,
        ))
    }

    /// Each broken promise is found: a missing slot, a slot naming a missing backend or holding
    /// another backend's copy, a missing reverse-NAT entry, a two-scope frontend without its
    /// internal entry.
    #[test]
    fn check_consistent_finds_each_half_written_frontend() {
        let mut snap = Snapshot::default();
        snap.revnat.insert(
            1,
            RevNatEntry {
                addr: IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1)),
                port: 80,
                proto: 6,
            },
        );
        let backend = BackendEntry {
            addr: IpAddr::V4(Ipv4Addr::new(10, 244, 0, 2)),
            port: 8080,
            proto: 6,
            flags: 0,
        };
        snap.backends.insert(7, backend);
        snap.services.insert(key(0, SCOPE_EXTERNAL), frontend(1, 1, 0));
        snap.services
            .insert(key(1, SCOPE_EXTERNAL), ServiceMapValue::slot(1, 7, backend));
        assert_eq!(snap.check_consistent(), Ok(()));

        // The slot's copy of its backend: flags may lag, the address may not.
        let mut lagging_flags = snap.clone();
        lagging_flags.backends.get_mut(&7).unwrap().flags = lb_common::backend::flags::TERMINATING;
        assert_eq!(lagging_flags.check_consistent(), Ok(()));
        let mut wrong_copy = snap.clone();
        wrong_copy.services.insert(
            key(1, SCOPE_EXTERNAL),
            ServiceMapValue::slot(
                1,
                7,
                BackendEntry {
                    port: 9090,
                    ..backend
                },
            ),
        );
        assert!(wrong_copy.check_consistent().unwrap_err().contains("holds"));

        let mut missing_slot = snap.clone();
        missing_slot
            .services
            .insert(key(0, SCOPE_EXTERNAL), frontend(1, 2, 0));
        assert!(
            missing_slot
                .check_consistent()
                .unwrap_err()
                .contains("slot 2 is missing")
        );

        let mut missing_backend = snap.clone();
        missing_backend.backends.clear();
        assert!(
            missing_backend
                .check_consistent()
                .unwrap_err()
                .contains("missing backend 7")
        );

        let mut missing_revnat = snap.clone();
        missing_revnat.revnat.clear();
        assert!(
            missing_revnat
                .check_consistent()
                .unwrap_err()
                .contains("reverse-NAT")
        );

        let mut two_scopes = snap.clone();
        two_scopes
            .services
            .insert(key(0, SCOPE_EXTERNAL), frontend(1, 1, flags::TWO_SCOPES));
        assert!(two_scopes.check_consistent().unwrap_err().contains("TWO_SCOPES"));
        two_scopes
            .services
            .insert(key(0, SCOPE_INTERNAL), frontend(1, 0, 0));
        assert_eq!(two_scopes.check_consistent(), Ok(()));
    }
}
