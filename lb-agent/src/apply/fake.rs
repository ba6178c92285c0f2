//! An in-memory `MapOps` for unit tests of the writer (in the spirit of Cilium's `lbmap_mock` and
//! Katran's `testing` mode): it keeps the maps as BTreeMaps, logs every operation in order, and
//! can refuse inserts beyond a capacity like a full kernel map.

use std::collections::BTreeSet;

use lb_common::{affinity::AffinityMatchKey, catalog, config::DatapathConfig, revnat::SvcName};

use super::{
    entries::{BackendEntry, RevNatEntry, ServiceMapKey, ServiceMapValue, SourceRange},
    ops::{MapError, MapOps, Snapshot},
};
use crate::family::IpFamily;

/// One logged operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    PutService(ServiceMapKey, ServiceMapValue),
    DeleteService(ServiceMapKey),
    PutBackend(u32, BackendEntry),
    DeleteBackend(IpFamily, u32),
    PutRevNat(u32, RevNatEntry),
    DeleteRevNat(IpFamily, u32),
    PutAffinityMatch(AffinityMatchKey),
    DeleteAffinityMatch(AffinityMatchKey),
    PutSourceRange(SourceRange),
    DeleteSourceRange(SourceRange),
    PutConfig,
    PutPodInterfaces,
    PutMasqueradeAddrs,
    SetClusterIpCheck(ipnet::IpNet, Option<u8>),
    PutServiceRanges(IpFamily, Vec<ipnet::IpNet>),
    PutMaglev(u32, std::sync::Arc<[u32]>),
    DeleteMaglev(u32),
}

#[derive(Clone, Debug, Default)]
pub struct FakeMaps {
    pub state: Snapshot,
    pub config: Option<DatapathConfig>,
    pub pod_interfaces: std::collections::BTreeSet<u32>,
    pub masquerade_addrs: std::collections::BTreeMap<u32, lb_common::config::MasqueradeAddrs>,
    /// Both families' cluster-ips-check tries.
    pub cluster_ip_checks: std::collections::BTreeMap<ipnet::IpNet, u8>,
    pub service_ranges: crate::family::PerFamily<Vec<ipnet::IpNet>>,
    pub log: Vec<Op>,
    /// Refuse new service-map keys beyond this many entries of one family (E2BIG), like a full
    /// kernel map (each family has its own).
    pub services_capacity: Option<usize>,
    /// Refuse every backend write (EIO), like a map the kernel will not update.
    pub backends_fail: bool,
    /// Refuse every service-map deletion (EIO).
    pub service_deletes_fail: bool,
    /// Refuse the pod interfaces (E2BIG, a full `lb_pod_ifaces`).
    pub pod_interfaces_fail: bool,
    /// How many tables each `put_maglev_tables` call carried.
    pub maglev_batches: Vec<usize>,
}

fn full(map: &'static str) -> MapError {
    MapError::new(map, "update", std::io::Error::from_raw_os_error(libc::E2BIG))
}

impl FakeMaps {
    pub fn new() -> Self {
        Self::default()
    }

    /// [`Snapshot::check_consistent`] on the maps as they are now.
    pub fn check_consistent(&self) -> Result<(), String> {
        self.state.check_consistent()
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
                Op::DeleteBackend(family, id) => maps.delete_backend(*family, *id),
                Op::PutRevNat(id, v) => maps.put_revnat(*id, v, &name),
                Op::DeleteRevNat(family, id) => maps.delete_revnat(*family, *id),
                Op::PutAffinityMatch(k) => maps.put_affinity_match(k),
                Op::DeleteAffinityMatch(k) => maps.delete_affinity_match(k),
                Op::PutSourceRange(r) => maps.put_source_range(r),
                Op::DeleteSourceRange(r) => maps.delete_source_range(r),
                Op::SetClusterIpCheck(net, action) => maps.set_cluster_ip_check(net, *action),
                Op::PutServiceRanges(family, ranges) => maps.put_service_ranges(*family, ranges),
                Op::PutMaglev(id, positions) => maps.put_maglev(*id, positions),
                Op::DeleteMaglev(id) => maps.delete_maglev(*id),
                Op::PutConfig | Op::PutPodInterfaces | Op::PutMasqueradeAddrs => Ok(()),
            };
            check(i, &maps);
        }
    }

    pub fn frontend_keys(&self) -> BTreeSet<ServiceMapKey> {
        self.state
            .services
            .keys()
            .filter(|k| k.slot == 0)
            .copied()
            .collect()
    }
}

impl MapOps for FakeMaps {
    fn put_maglev_tables(
        &mut self,
        tables: &[(u32, std::sync::Arc<[u32]>)],
    ) -> Result<(), super::BatchError> {
        self.maglev_batches.push(tables.len());
        for (id, positions) in tables {
            self.put_maglev(*id, positions)
                .expect("the fake refuses no table");
        }
        Ok(())
    }

    fn put_maglev(&mut self, rev_nat_id: u32, positions: &[u32]) -> Result<(), MapError> {
        let positions: std::sync::Arc<[u32]> = positions.into();
        self.log.push(Op::PutMaglev(rev_nat_id, positions.clone()));
        self.state.maglev.insert(rev_nat_id, positions);
        Ok(())
    }

    fn delete_maglev(&mut self, rev_nat_id: u32) -> Result<(), MapError> {
        self.log.push(Op::DeleteMaglev(rev_nat_id));
        self.state.maglev.remove(&rev_nat_id);
        Ok(())
    }

    fn put_service(&mut self, key: &ServiceMapKey, value: &ServiceMapValue) -> Result<(), MapError> {
        if let Some(cap) = self.services_capacity
            && !self.state.services.contains_key(key)
            && self
                .state
                .services
                .keys()
                .filter(|k| k.family() == key.family())
                .count()
                >= cap
        {
            return Err(full(match key.family() {
                IpFamily::V4 => catalog::SERVICES,
                IpFamily::V6 => catalog::SERVICES6,
            }));
        }
        self.log.push(Op::PutService(*key, *value));
        self.state.services.insert(*key, *value);
        Ok(())
    }

    fn delete_service(&mut self, key: &ServiceMapKey) -> Result<(), MapError> {
        if self.service_deletes_fail {
            return Err(MapError::new(
                "lb4_services",
                "delete",
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        self.log.push(Op::DeleteService(*key));
        self.state.services.remove(key);
        Ok(())
    }

    fn put_backend(&mut self, id: u32, value: &BackendEntry) -> Result<(), MapError> {
        if self.backends_fail {
            return Err(MapError::new(
                "lb4_backends",
                "update",
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        self.log.push(Op::PutBackend(id, *value));
        self.state.backends.insert(id, *value);
        Ok(())
    }

    fn delete_backend(&mut self, family: IpFamily, id: u32) -> Result<(), MapError> {
        self.log.push(Op::DeleteBackend(family, id));
        if self
            .state
            .backends
            .get(&id)
            .is_some_and(|b| IpFamily::of(&b.addr) == family)
        {
            self.state.backends.remove(&id);
        }
        Ok(())
    }

    fn put_revnat(&mut self, id: u32, value: &RevNatEntry, name: &SvcName) -> Result<(), MapError> {
        self.log.push(Op::PutRevNat(id, *value));
        self.state.revnat.insert(id, *value);
        self.state.names.insert(id, *name);
        Ok(())
    }

    fn delete_revnat(&mut self, family: IpFamily, id: u32) -> Result<(), MapError> {
        self.log.push(Op::DeleteRevNat(family, id));
        if self.state.revnat.get(&id).is_some_and(|r| r.family() == family) {
            self.state.revnat.remove(&id);
        }
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

    fn put_source_range(&mut self, range: &SourceRange) -> Result<(), MapError> {
        self.log.push(Op::PutSourceRange(*range));
        if !self.state.source_ranges.contains(range) {
            self.state.source_ranges.push(*range);
        }
        Ok(())
    }

    fn delete_source_range(&mut self, range: &SourceRange) -> Result<(), MapError> {
        self.log.push(Op::DeleteSourceRange(*range));
        self.state.source_ranges.retain(|e| e != range);
        Ok(())
    }

    fn put_config(&mut self, config: &DatapathConfig) -> Result<(), MapError> {
        self.log.push(Op::PutConfig);
        self.config = Some(*config);
        self.state.maglev_seed = crate::plan::maglev::HashSeed::from_word(config.maglev_seed);
        Ok(())
    }

    fn put_pod_interfaces(&mut self, ifindexes: &std::collections::BTreeSet<u32>) -> Result<(), MapError> {
        if self.pod_interfaces_fail {
            return Err(full(catalog::POD_INTERFACES));
        }
        self.log.push(Op::PutPodInterfaces);
        self.pod_interfaces = ifindexes.clone();
        Ok(())
    }

    fn put_masquerade_addrs(
        &mut self,
        entries: &std::collections::BTreeMap<u32, lb_common::config::MasqueradeAddrs>,
    ) -> Result<(), MapError> {
        self.log.push(Op::PutMasqueradeAddrs);
        self.masquerade_addrs = entries.clone();
        Ok(())
    }

    fn cluster_ip_checks(
        &self,
        family: IpFamily,
    ) -> Result<std::collections::BTreeMap<ipnet::IpNet, u8>, MapError> {
        Ok(self
            .cluster_ip_checks
            .iter()
            .filter(|(n, _)| IpFamily::of_net(n) == family)
            .map(|(n, a)| (*n, *a))
            .collect())
    }

    fn set_cluster_ip_check(&mut self, net: &ipnet::IpNet, action: Option<u8>) -> Result<(), MapError> {
        self.log.push(Op::SetClusterIpCheck(*net, action));
        match action {
            Some(a) => self.cluster_ip_checks.insert(*net, a),
            None => self.cluster_ip_checks.remove(net),
        };
        Ok(())
    }

    fn put_service_ranges(&mut self, family: IpFamily, ranges: &[ipnet::IpNet]) -> Result<(), MapError> {
        self.log.push(Op::PutServiceRanges(family, ranges.to_vec()));
        *self.service_ranges.get_mut(family) = ranges.to_vec();
        Ok(())
    }

    fn snapshot(&self) -> Result<Snapshot, MapError> {
        Ok(self.state.clone())
    }
}
