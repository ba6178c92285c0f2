//! `MapOps` on the real maps, through aya. The maps come either from a freshly loaded object or
//! from their pins (so the CLI can read and clean up without loading anything).
//!
//! This is where an entry's family becomes a type: each write goes to its family's maps
//! ([`FamilyMaps<F>`], written once over `F: KernelFamily`), its `IpAddr` turned into the map
//! key's address.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::IpAddr,
    os::fd::{AsFd, AsRawFd, OwnedFd, RawFd},
    path::Path,
};

use aya::{
    Pod,
    maps::{Array, HashMap, HashOfMaps, LpmTrie, Map, MapData, PerCpuArray, lpm_trie::Key},
};
use ipnet::IpNet;
use lb_common::{
    affinity::AffinityMatchKey,
    backend::BackendValue,
    catalog,
    cluster_ip::{ClusterIpKey, MAX_SERVICE_RANGES, ServiceRange, ServiceRanges},
    config::{DatapathConfig, MasqueradeAddrs},
    family::{V4, V6},
    maglev::{self, MaglevChunk},
    revnat::{RevNatValue, SvcName},
    service::{SrcRange, SvcEntry, SvcKey},
};

use super::{
    entries::{BackendEntry, RevNatEntry, ServiceMapKey, ServiceMapValue, SourceRange},
    ops::{BatchError, MapError, MapOps, Snapshot},
    prefilter::{Owner, Prefilter, Referenced},
};
use crate::family::{IpFamily, KernelFamily};

/// The maps the agent writes, plus the counters it reads.
pub struct KernelMaps {
    pub v4: FamilyMaps<V4>,
    pub v6: FamilyMaps<V6>,
    pub names: HashMap<MapData, u32, SvcName>,
    pub affinity_match: HashMap<MapData, AffinityMatchKey, u8>,
    pub config: Array<MapData, DatapathConfig>,
    /// `lb_pod_ifaces`; `None` from the pins of a release that had none.
    pub pod_interfaces: Option<HashMap<MapData, u32, u8>>,
    /// `lb_masq_addrs`; `None` from the pins of a release that had none.
    pub masquerade_addrs: Option<HashMap<MapData, u32, MasqueradeAddrs>>,
    pub stats: PerCpuArray<MapData, u64>,
    /// `lb_maglev`; `None` from the pins of a release that had none.
    pub maglev: Option<MaglevMap>,
    /// `lb_maglev` again, for the batch calls (aya has none).
    maglev_batch: Option<OwnedFd>,
    /// What the tables' inner arrays are created with.
    maglev_inner: super::maglev_tables::InnerArrays,
    /// The tc programs' prefilter: each write below holds the bits its entry needs first.
    pub prefilter: Prefilter,
    /// Cleared when the kernel refuses batch updates (before 5.6): single updates from then on.
    batch_supported: bool,
}

/// `lb_maglev`: rev_nat_id -> the frontend's table, an inner array of chunks.
pub type MaglevMap = HashOfMaps<MapData, u32, Array<MapData, MaglevChunk>>;

/// The maps of one family that the agent writes.
pub struct FamilyMaps<F: KernelFamily> {
    pub services: HashMap<MapData, SvcKey<F>, SvcEntry<F>>,
    pub backends: HashMap<MapData, u32, BackendValue<F>>,
    pub revnat: HashMap<MapData, u32, RevNatValue<F>>,
    pub source_ranges: LpmTrie<MapData, SrcRange<F>, u8>,
    /// `lb4_cluster_ips` and `lb4_svc_ranges` (`lb_common::cluster_ip`); `None` from the pins of
    /// a release that had none.
    pub cluster_ips: Option<LpmTrie<MapData, ClusterIpKey<F>, u8>>,
    /// (An array of `ServiceRanges<F>`, typed where it is written: the struct has no `Pod` bound.)
    pub service_ranges: Option<Map>,
    /// The services and backends maps again, for BPF_MAP_UPDATE_BATCH (aya has no batch calls).
    batch_services: OwnedFd,
    batch_backends: OwnedFd,
}

/// A second descriptor of a hash map (or a hash of maps), taken before aya wraps it.
fn dup_fd(map: &Map) -> Result<OwnedFd, aya::maps::MapError> {
    match map {
        Map::HashMap(data) | Map::HashOfMaps(data) => Ok(data.fd().as_fd().try_clone_to_owned()?),
        _ => Err(aya::maps::MapError::IoError(io::Error::other("not a hash map"))),
    }
}

/// `lb_maglev` and its descriptor for the batch calls.
fn maglev_map(map: Map) -> Result<(MaglevMap, OwnedFd), aya::maps::MapError> {
    let fd = dup_fd(&map)?;
    Ok((map.try_into()?, fd))
}

/// `union bpf_attr`'s `batch` member (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// Deletes `keys` with one syscall; stops at the first key that fails (a missing one included).
fn delete_batch<K: aya::Pod>(fd: RawFd, keys: &[K]) -> io::Result<()> {
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        count: keys.len() as u32,
        map_fd: fd as u32,
        ..Default::default()
    };
    // SAFETY: keys points at `count` contiguous elements of the map's key size, alive for the
    // call.
    unsafe { bpf_batch(BPF_MAP_DELETE_BATCH, &mut attr) }
}

/// Updates `keys[i] -> values[i]` in order with one syscall. Keys and values are `#[repr(C)]`
/// Pod types whose size is the map's key and value size.
fn update_batch<K: aya::Pod, V: aya::Pod>(fd: RawFd, keys: &[K], values: &[V]) -> io::Result<()> {
    debug_assert_eq!(keys.len(), values.len());
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: keys.len() as u32,
        map_fd: fd as u32,
        ..Default::default()
    };
    // SAFETY: keys and values point at `count` contiguous elements of the map's key and value
    // size, alive for the call.
    unsafe { bpf_batch(BPF_MAP_UPDATE_BATCH, &mut attr) }
}

/// bpf(2) with a batch command; the kernel writes `count` back.
///
/// # Safety
/// `attr`'s pointers must name buffers of `count` elements of the map's key and value size (and
/// `out_batch` one key), valid for the call.
unsafe fn bpf_batch(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is the kernel's batch layout; its buffers are the caller's promise.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// Reads the first `len` values of the array map behind `fd` with one syscall (`None` where the
/// kernel has no batch lookup, or the call fails: the caller then reads them one by one).
pub(super) fn lookup_array_batch<V: aya::Pod + Default>(fd: RawFd, len: u32) -> Option<Vec<V>> {
    let mut keys = vec![0u32; len as usize];
    let mut values = vec![V::default(); len as usize];
    let mut next = 0u32;
    let mut attr = BatchAttr {
        out_batch: &mut next as *mut u32 as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: len,
        map_fd: fd as u32,
        ..Default::default()
    };
    // SAFETY: `keys` and `values` hold `count` elements of the array's key (u32) and value size,
    // and `next` the batch token (a key), alive for the call.
    let result = unsafe { bpf_batch(BPF_MAP_LOOKUP_BATCH, &mut attr) };
    // An array of exactly `len` entries reads whole with Ok; ENOENT with every entry copied is
    // the end of a longer walk's last batch, as good.
    let whole =
        attr.count == len && result.map_or_else(|e| e.raw_os_error() == Some(libc::ENOENT), |()| true);
    let in_order = keys.iter().enumerate().all(|(i, k)| *k == i as u32);
    (whole && in_order).then_some(values)
}

/// Whether an error says the kernel has no batch update for this map (not an entry's failure).
fn batch_unsupported(e: &io::Error) -> bool {
    // ENOTSUPP (524) is the kernel-internal "not supported" some paths return.
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) | Some(524)
    )
}

/// Writes a run of entries to the map behind `fd` with one batch call (when `supported`, cleared
/// when the kernel refuses batches), or one by one with `single`.
pub(super) fn write_batch<K: Pod, V: Pod>(
    fd: RawFd,
    supported: &mut bool,
    entries: &[(K, V)],
    mut single: impl FnMut(&K, &V) -> Result<(), MapError>,
) -> Result<(), BatchError> {
    let mut one_by_one = || {
        for (done, (k, v)) in entries.iter().enumerate() {
            single(k, v).map_err(|error| BatchError { done, error })?;
        }
        Ok(())
    };
    if entries.len() < 2 || !*supported {
        return one_by_one();
    }
    let keys: Vec<K> = entries.iter().map(|(k, _)| *k).collect();
    let values: Vec<V> = entries.iter().map(|(_, v)| *v).collect();
    match update_batch(fd, &keys, &values) {
        Ok(()) => Ok(()),
        Err(e) => {
            if batch_unsupported(&e) {
                tracing::debug!("BPF_MAP_UPDATE_BATCH refused ({e}): single updates from now on");
                *supported = false;
            }
            // Redo the run one by one, for the failing entry's own error and an exact count (the
            // kernel does not report one when it refuses the call before starting); rewriting an
            // entry with the value it already has changes nothing.
            one_by_one()
        }
    }
}

/// Writes `entries` (of both families, in order) as runs of one family each, `write_run` writing
/// a run; a failure's `done` counts from the start of `entries`.
fn by_family_runs<T>(
    entries: &[T],
    family: impl Fn(&T) -> IpFamily,
    mut write_run: impl FnMut(IpFamily, &[T]) -> Result<(), BatchError>,
) -> Result<(), BatchError> {
    let mut start = 0;
    while start < entries.len() {
        let f = family(&entries[start]);
        let len = entries[start..].iter().take_while(|e| family(e) == f).count();
        write_run(f, &entries[start..start + len]).map_err(|e| BatchError {
            done: start + e.done,
            error: e.error,
        })?;
        start += len;
    }
    Ok(())
}

pub(super) fn io_err(e: aya::maps::MapError) -> io::Error {
    match e {
        aya::maps::MapError::SyscallError(s) => s.io_error,
        aya::maps::MapError::IoError(e) => e,
        aya::maps::MapError::KeyNotFound | aya::maps::MapError::ElementNotFound => {
            io::Error::from_raw_os_error(libc::ENOENT)
        }
        other => io::Error::other(other.to_string()),
    }
}

/// Deleting what is already gone is fine: the writer's goal is absence.
fn absent_ok(r: Result<(), aya::maps::MapError>) -> Result<(), io::Error> {
    match r {
        Ok(()) => Ok(()),
        Err(e) => {
            let e = io_err(e);
            if e.raw_os_error() == Some(libc::ENOENT) {
                Ok(())
            } else {
                Err(e)
            }
        }
    }
}

/// An entry's address in its family's form; an address of the other family is a bug in the
/// caller, reported as EAFNOSUPPORT rather than written anywhere.
fn addr_of<F: KernelFamily>(ip: &IpAddr, map: &'static str, op: &'static str) -> Result<F::Addr, MapError> {
    F::kernel_addr(ip).ok_or_else(|| MapError::new(map, op, io::Error::from_raw_os_error(libc::EAFNOSUPPORT)))
}

fn take_map(ebpf: &mut aya::Ebpf, name: &str) -> Result<Map, aya::maps::MapError> {
    ebpf.take_map(name)
        .ok_or_else(|| aya::maps::MapError::InvalidName {
            name: name.to_string(),
        })
}

impl<F> FamilyMaps<F>
where
    F: KernelFamily + catalog::FamilyMaps,
    SvcKey<F>: Pod,
    SvcEntry<F>: Pod,
    BackendValue<F>: Pod,
    RevNatValue<F>: Pod,
    SrcRange<F>: Pod,
    ClusterIpKey<F>: Pod,
    ServiceRanges<F>: Pod,
{
    fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self, aya::maps::MapError> {
        let services = take_map(ebpf, F::MAPS.services)?;
        let backends = take_map(ebpf, F::MAPS.backends)?;
        Ok(Self {
            batch_services: dup_fd(&services)?,
            batch_backends: dup_fd(&backends)?,
            services: services.try_into()?,
            backends: backends.try_into()?,
            revnat: take_map(ebpf, F::MAPS.revnat)?.try_into()?,
            source_ranges: take_map(ebpf, F::MAPS.source_ranges)?.try_into()?,
            cluster_ips: Some(take_map(ebpf, F::MAPS.cluster_ips)?.try_into()?),
            service_ranges: Some(take_map(ebpf, F::MAPS.service_ranges)?),
        })
    }

    fn from_pins(maps_dir: &Path) -> Result<Self, aya::maps::MapError> {
        // At each map's current layout version, as the agent pins it (`lb_config_v2`).
        let open = |name: &str| MapData::from_pin(maps_dir.join(catalog::pin_name(name).to_string()));
        let services = Map::HashMap(open(F::MAPS.services)?);
        let backends = Map::HashMap(open(F::MAPS.backends)?);
        Ok(Self {
            batch_services: dup_fd(&services)?,
            batch_backends: dup_fd(&backends)?,
            services: services.try_into()?,
            backends: backends.try_into()?,
            revnat: Map::HashMap(open(F::MAPS.revnat)?).try_into()?,
            source_ranges: Map::LpmTrie(open(F::MAPS.source_ranges)?).try_into()?,
            cluster_ips: open(F::MAPS.cluster_ips)
                .ok()
                .map(|m| Map::LpmTrie(m).try_into())
                .transpose()?,
            service_ranges: open(F::MAPS.service_ranges).ok().map(Map::Array),
        })
    }

    fn service_key(key: &ServiceMapKey, op: &'static str) -> Result<SvcKey<F>, MapError> {
        let addr = addr_of::<F>(&key.addr, F::MAPS.services, op)?;
        Ok(SvcKey::new(addr, key.port, key.proto, key.scope, key.slot))
    }

    /// `map`: the map the value goes to (named by an error).
    fn backend_value(value: &BackendEntry, map: &'static str) -> Result<BackendValue<F>, MapError> {
        Ok(BackendValue {
            addr: addr_of::<F>(&value.addr, map, "update")?,
            port: value.port,
            proto: value.proto,
            flags: value.flags,
        })
    }

    fn backend_entry(value: &BackendValue<F>) -> BackendEntry {
        BackendEntry {
            addr: F::ip_addr(&value.addr),
            port: value.port,
            proto: value.proto,
            flags: value.flags,
        }
    }

    fn service_value(value: &ServiceMapValue) -> Result<SvcEntry<F>, MapError> {
        Ok(SvcEntry {
            value: value.entry,
            backend: match &value.backend {
                Some(backend) => Self::backend_value(backend, F::MAPS.services)?,
                None => BackendValue::default(),
            },
        })
    }

    /// What the map holds at `key`, as the writer names it (a frontend entry has no backend).
    fn service_map_value(key: &SvcKey<F>, value: &SvcEntry<F>) -> ServiceMapValue {
        ServiceMapValue {
            entry: value.value,
            backend: (key.slot > 0).then(|| Self::backend_entry(&value.backend)),
        }
    }

    fn source_range_key(range: &SourceRange, op: &'static str) -> Result<Key<SrcRange<F>>, MapError> {
        let addr = addr_of::<F>(&range.net.network(), F::MAPS.source_ranges, op)?;
        Ok(Key::new(
            SrcRange::<F>::prefix_len(range.net.prefix_len()),
            SrcRange::new(range.rev_nat_id, addr),
        ))
    }

    fn put_services(
        &mut self,
        supported: &mut bool,
        entries: &[(ServiceMapKey, ServiceMapValue)],
    ) -> Result<(), BatchError> {
        let mut converted = Vec::with_capacity(entries.len());
        for (done, (key, value)) in entries.iter().enumerate() {
            let key = Self::service_key(key, "update").map_err(|error| BatchError { done, error })?;
            let value = Self::service_value(value).map_err(|error| BatchError { done, error })?;
            converted.push((key, value));
        }
        let fd = self.batch_services.as_raw_fd();
        write_batch(fd, supported, &converted, |k, v| self.put_service(k, v))
    }

    fn put_backends(
        &mut self,
        supported: &mut bool,
        entries: &[(u32, BackendEntry)],
    ) -> Result<(), BatchError> {
        let mut converted = Vec::with_capacity(entries.len());
        for (done, (id, value)) in entries.iter().enumerate() {
            let value =
                Self::backend_value(value, F::MAPS.backends).map_err(|error| BatchError { done, error })?;
            converted.push((*id, value));
        }
        let fd = self.batch_backends.as_raw_fd();
        write_batch(fd, supported, &converted, |id, v| {
            self.backends
                .insert(id, v, 0)
                .map_err(|e| MapError::new(F::MAPS.backends, "update", io_err(e)))
        })
    }

    fn put_service(&mut self, key: &SvcKey<F>, value: &SvcEntry<F>) -> Result<(), MapError> {
        self.services
            .insert(key, value, 0)
            .map_err(|e| MapError::new(F::MAPS.services, "update", io_err(e)))
    }

    fn delete_service(&mut self, key: &ServiceMapKey) -> Result<(), MapError> {
        let key = Self::service_key(key, "delete")?;
        absent_ok(self.services.remove(&key)).map_err(|e| MapError::new(F::MAPS.services, "delete", e))
    }

    fn delete_backend(&mut self, id: u32) -> Result<(), MapError> {
        absent_ok(self.backends.remove(&id)).map_err(|e| MapError::new(F::MAPS.backends, "delete", e))
    }

    fn put_revnat(&mut self, id: u32, value: &RevNatEntry) -> Result<(), MapError> {
        let value = RevNatValue {
            addr: addr_of::<F>(&value.addr, F::MAPS.revnat, "update")?,
            port: value.port,
            proto: value.proto,
            _pad: 0,
        };
        self.revnat
            .insert(&id, &value, 0)
            .map_err(|e| MapError::new(F::MAPS.revnat, "update", io_err(e)))
    }

    fn delete_revnat(&mut self, id: u32) -> Result<(), MapError> {
        absent_ok(self.revnat.remove(&id)).map_err(|e| MapError::new(F::MAPS.revnat, "delete", e))
    }

    fn put_source_range(&mut self, range: &SourceRange) -> Result<(), MapError> {
        let key = Self::source_range_key(range, "update")?;
        self.source_ranges
            .insert(&key, &1u8, 0)
            .map_err(|e| MapError::new(F::MAPS.source_ranges, "update", io_err(e)))
    }

    fn delete_source_range(&mut self, range: &SourceRange) -> Result<(), MapError> {
        let key = Self::source_range_key(range, "delete")?;
        absent_ok(self.source_ranges.remove(&key))
            .map_err(|e| MapError::new(F::MAPS.source_ranges, "delete", e))
    }

    fn missing(map: &'static str) -> MapError {
        MapError::new(map, "update", io::Error::from_raw_os_error(libc::ENOENT))
    }

    fn cluster_ip_checks(&self) -> Result<BTreeMap<IpNet, u8>, MapError> {
        let map = F::MAPS.cluster_ips;
        let Some(trie) = &self.cluster_ips else {
            return Ok(BTreeMap::new());
        };
        let mut out = BTreeMap::new();
        for entry in trie.iter() {
            let (key, action) = entry.map_err(|e| MapError::new(map, "dump", io_err(e)))?;
            let bits = key.prefix_len().min(u32::from(F::BITS)) as u8;
            let net =
                IpNet::new(F::ip_addr(&key.data().addr), bits).expect("a prefix within the family's bits");
            out.insert(net, action);
        }
        Ok(out)
    }

    fn set_cluster_ip_check(&mut self, net: &IpNet, action: Option<u8>) -> Result<(), MapError> {
        let map = F::MAPS.cluster_ips;
        let op = if action.is_some() { "update" } else { "delete" };
        let trie = self.cluster_ips.as_mut().ok_or_else(|| Self::missing(map))?;
        let key = Key::new(
            u32::from(net.prefix_len()),
            ClusterIpKey::<F> {
                addr: addr_of::<F>(&net.network(), map, op)?,
            },
        );
        match action {
            Some(action) => trie
                .insert(&key, &action, 0)
                .map_err(|e| MapError::new(map, op, io_err(e))),
            None => absent_ok(trie.remove(&key)).map_err(|e| MapError::new(map, op, e)),
        }
    }

    fn put_service_ranges(&mut self, ranges: &[IpNet]) -> Result<(), MapError> {
        let map = F::MAPS.service_ranges;
        let mut array: Array<&mut MapData, ServiceRanges<F>> = self
            .service_ranges
            .as_mut()
            .ok_or_else(|| Self::missing(map))?
            .try_into()
            .map_err(|e| MapError::new(map, "update", io_err(e)))?;
        let mut value = ServiceRanges::<F>::default();
        for (slot, net) in value.ranges.iter_mut().zip(ranges) {
            *slot = ServiceRange {
                net: addr_of::<F>(&net.network(), map, "update")?,
                mask: addr_of::<F>(&net.netmask(), map, "update")?,
                prefix_len: net.prefix_len(),
                _pad: [0; 3],
            };
        }
        value.count = ranges.len().min(MAX_SERVICE_RANGES) as u8;
        array
            .set(0, &value, 0)
            .map_err(|e| MapError::new(map, "update", io_err(e)))
    }

    /// The service entry at `key`, if any (`key` must be of this family).
    pub fn service(&self, key: &ServiceMapKey) -> Option<ServiceMapValue> {
        let key = Self::service_key(key, "lookup").ok()?;
        let value = self.services.get(&key, 0).ok()?;
        Some(Self::service_map_value(&key, &value))
    }

    pub fn backend(&self, id: u32) -> Option<BackendEntry> {
        self.backends.get(&id, 0).ok().map(|v| Self::backend_entry(&v))
    }

    pub fn revnat(&self, id: u32) -> Option<RevNatEntry> {
        self.revnat.get(&id, 0).ok().map(|v| RevNatEntry {
            addr: F::ip_addr(&v.addr),
            port: v.port,
            proto: v.proto,
        })
    }

    /// Adds this family's entries to `snap`.
    fn read_into(&self, snap: &mut Snapshot) -> Result<(), MapError> {
        let read = |map: &'static str| move |e| MapError::new(map, "dump", io_err(e));
        for entry in self.services.iter() {
            let (k, v) = entry.map_err(read(F::MAPS.services))?;
            let key = ServiceMapKey::new(F::ip_addr(&k.addr), k.port, k.proto, k.scope, k.slot);
            snap.services.insert(key, Self::service_map_value(&k, &v));
        }
        for entry in self.backends.iter() {
            let (id, v) = entry.map_err(read(F::MAPS.backends))?;
            snap.backends.insert(id, Self::backend_entry(&v));
        }
        for entry in self.revnat.iter() {
            let (id, v) = entry.map_err(read(F::MAPS.revnat))?;
            let value = RevNatEntry {
                addr: F::ip_addr(&v.addr),
                port: v.port,
                proto: v.proto,
            };
            snap.revnat.insert(id, value);
        }
        for key in self.source_ranges.keys() {
            let key = key.map_err(read(F::MAPS.source_ranges))?;
            let data = key.data();
            let bits = key.prefix_len().saturating_sub(32).min(u32::from(F::BITS)) as u8;
            let net = IpNet::new(F::ip_addr(&data.addr), bits).expect("a prefix within the family's bits");
            snap.source_ranges
                .push(SourceRange::new(u32::from_be_bytes(data.rev_nat_id_be), net));
        }
        Ok(())
    }
}

impl KernelMaps {
    /// Takes the maps out of a loaded object.
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self, aya::maps::MapError> {
        let (maglev, maglev_batch) = maglev_map(take_map(ebpf, catalog::MAGLEV)?)?;
        let mut maps = Self {
            v4: FamilyMaps::from_ebpf(ebpf)?,
            v6: FamilyMaps::from_ebpf(ebpf)?,
            names: take_map(ebpf, catalog::SVC_NAMES)?.try_into()?,
            affinity_match: take_map(ebpf, catalog::AFFINITY_MATCH)?.try_into()?,
            config: take_map(ebpf, catalog::CONFIG)?.try_into()?,
            pod_interfaces: Some(take_map(ebpf, catalog::POD_INTERFACES)?.try_into()?),
            masquerade_addrs: Some(take_map(ebpf, catalog::MASQ_ADDRS)?.try_into()?),
            stats: take_map(ebpf, catalog::STATS)?.try_into()?,
            maglev: None,
            maglev_batch: None,
            maglev_inner: Default::default(),
            prefilter: Prefilter::new(Some([
                take_map(ebpf, catalog::PREFILTER)?,
                take_map(ebpf, catalog::PREFILTER6)?,
            ]))?,
            batch_supported: true,
        };
        maps.maglev = Some(maglev);
        maps.maglev_batch = Some(maglev_batch);
        Ok(maps)
    }

    /// Opens the pinned maps under `<bpf-root>/maps`.
    pub fn from_pins(maps_dir: &Path) -> Result<Self, aya::maps::MapError> {
        // At each map's current layout version, as the agent pins it (`lb_config_v2`).
        let open = |name: &str| MapData::from_pin(maps_dir.join(catalog::pin_name(name).to_string()));
        let maglev = open(catalog::MAGLEV)
            .ok()
            .map(|m| maglev_map(Map::HashOfMaps(m)))
            .transpose()?;
        let mut maps = Self {
            v4: FamilyMaps::from_pins(maps_dir)?,
            v6: FamilyMaps::from_pins(maps_dir)?,
            names: Map::HashMap(open(catalog::SVC_NAMES)?).try_into()?,
            affinity_match: Map::HashMap(open(catalog::AFFINITY_MATCH)?).try_into()?,
            config: Map::Array(open(catalog::CONFIG)?).try_into()?,
            pod_interfaces: open(catalog::POD_INTERFACES)
                .ok()
                .map(|m| Map::HashMap(m).try_into())
                .transpose()?,
            masquerade_addrs: open(catalog::MASQ_ADDRS)
                .ok()
                .map(|m| Map::HashMap(m).try_into())
                .transpose()?,
            stats: Map::PerCpuArray(open(catalog::STATS)?).try_into()?,
            maglev: None,
            maglev_batch: None,
            maglev_inner: Default::default(),
            // Read-only handles (the CLI): the bits are the running agent's to keep.
            prefilter: Prefilter::new(None)?,
            batch_supported: true,
        };
        if let Some((map, fd)) = maglev {
            maps.maglev = Some(map);
            maps.maglev_batch = Some(fd);
        }
        Ok(maps)
    }

    /// Sums a counter over the CPUs.
    pub fn counter(&self, index: u32) -> u64 {
        self.stats
            .get(&index, 0)
            .map(|per_cpu| per_cpu.iter().sum())
            .unwrap_or(0)
    }

    /// The service entry at `key`, in its family's map.
    pub fn service(&self, key: &ServiceMapKey) -> Option<ServiceMapValue> {
        match key.family() {
            IpFamily::V4 => self.v4.service(key),
            IpFamily::V6 => self.v6.service(key),
        }
    }

    pub fn backend(&self, family: IpFamily, id: u32) -> Option<BackendEntry> {
        match family {
            IpFamily::V4 => self.v4.backend(id),
            IpFamily::V6 => self.v6.backend(id),
        }
    }

    pub fn revnat(&self, family: IpFamily, id: u32) -> Option<RevNatEntry> {
        match family {
            IpFamily::V4 => self.v4.revnat(id),
            IpFamily::V6 => self.v6.revnat(id),
        }
    }

    pub fn name(&self, rev_nat_id: u32) -> Option<SvcName> {
        self.names.get(&rev_nat_id, 0).ok()
    }

    pub fn datapath_config(&self) -> Option<DatapathConfig> {
        self.config.get(&0, 0).ok()
    }

    /// Sets the bits the conntrack entries of `referenced` need and lets the programs filter
    /// (`config::flags::PREFILTER`, written now if the config entry is written already). Call
    /// after the first sync, which holds every frontend's and backend's bit.
    pub fn prime_prefilter(&mut self, referenced: &Referenced) -> Result<(), MapError> {
        self.prefilter.prime(referenced)?;
        match self.datapath_config() {
            Some(config) if config != DatapathConfig::UNCONFIGURED => self.put_config(&config),
            _ => Ok(()),
        }
    }

    /// Holds the masquerade addresses' bits of `config`.
    fn hold_masquerade(&self, config: &DatapathConfig) -> Result<(), MapError> {
        let mut held = Vec::new();
        for (family, addr) in [
            (IpFamily::V4, V4::ip_addr(&config.v4.snat_addr)),
            (IpFamily::V6, V6::ip_addr(&config.v6.snat_addr)),
        ] {
            if addr.is_unspecified() {
                self.prefilter.release(&Owner::Masquerade(family));
            } else {
                let (f, bit) = super::prefilter::ingress_bit(&addr);
                held.push((Owner::Masquerade(family), f, bit));
            }
        }
        self.prefilter.hold_all(held).map(drop)
    }
}

/// Makes the per-interface map `name` hold exactly `wanted`: the interfaces gone first (their
/// room is reused), then every one wanted; a full map leaves out the ones that do not fit, and
/// the first error says so.
fn replace_entries<V: Pod>(
    map: &mut HashMap<MapData, u32, V>,
    name: &'static str,
    wanted: impl Iterator<Item = (u32, V)>,
) -> Result<(), MapError> {
    let wanted: BTreeMap<u32, V> = wanted.collect();
    let present: Vec<u32> = map
        .keys()
        .collect::<Result<_, _>>()
        .map_err(|e| MapError::new(name, "dump", io_err(e)))?;
    let mut first_error = None;
    for gone in present.iter().filter(|i| !wanted.contains_key(i)) {
        match map.remove(gone) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
            Err(e) => {
                first_error.get_or_insert(MapError::new(name, "delete", io_err(e)));
            }
        }
    }
    for (key, value) in &wanted {
        if let Err(e) = map.insert(key, value, 0) {
            first_error.get_or_insert(MapError::new(name, "update", io_err(e)));
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// The prefilter bits of the frontend entries (slot 0) among `entries`.
fn frontend_bits(entries: &[(ServiceMapKey, ServiceMapValue)]) -> Vec<(Owner, IpFamily, u32)> {
    entries.iter().flat_map(|(k, _)| Owner::frontend(k)).collect()
}

impl KernelMaps {
    /// Every Maglev table, each cut to its frontend's table size (the last chunk's tail is
    /// padding) where a frontend entry in `services` names it.
    fn read_maglev(
        &self,
        services: &BTreeMap<ServiceMapKey, ServiceMapValue>,
    ) -> Result<BTreeMap<u32, std::sync::Arc<[u32]>>, MapError> {
        let mut tables = BTreeMap::new();
        let Some(outer) = &self.maglev else {
            return Ok(tables);
        };
        let read = |e| MapError::new(catalog::MAGLEV, "dump", io_err(e));
        let sizes: BTreeMap<u32, u32> = services
            .iter()
            .filter(|(k, v)| k.slot == 0 && v.entry.has(lb_common::service::flags::MAGLEV))
            .map(|(_, v)| (v.entry.rev_nat_id, v.entry.backend_id))
            .collect();
        for id in outer.keys() {
            let id = id.map_err(read)?;
            let inner = match outer.get(&id, 0) {
                Ok(inner) => inner,
                // Swapped out or deleted since the key was listed.
                Err(aya::maps::MapError::KeyNotFound) => continue,
                Err(e) => return Err(read(e)),
            };
            // One batch read per table where the kernel has it (64 chunks at the default size).
            let fd = aya::maps::IterableMap::map(&inner).fd().as_fd().as_raw_fd();
            let chunks = match lookup_array_batch::<MaglevChunk>(fd, inner.len()) {
                Some(chunks) => chunks,
                None => inner.iter().collect::<Result<_, _>>().map_err(read)?,
            };
            let mut positions = Vec::with_capacity(chunks.len() * maglev::LANES);
            for chunk in &chunks {
                positions.extend_from_slice(&chunk.backend_ids);
            }
            if let Some(size) = sizes.get(&id) {
                positions.truncate(*size as usize);
            }
            tables.insert(id, positions.into());
        }
        Ok(tables)
    }
}

impl MapOps for KernelMaps {
    /// One table: `put_maglev_tables`' path.
    fn put_maglev(&mut self, rev_nat_id: u32, positions: &[u32]) -> Result<(), MapError> {
        self.put_maglev_tables(&[(rev_nat_id, positions.into())])
            .map_err(|e| e.error)
    }

    fn delete_maglev(&mut self, rev_nat_id: u32) -> Result<(), MapError> {
        let Some(outer) = self.maglev.as_mut() else {
            return Ok(());
        };
        absent_ok(outer.remove(&rev_nat_id)).map_err(|e| MapError::new(catalog::MAGLEV, "delete", e))
    }

    /// Every table built first (its own inner array, filled), then all swapped in with one
    /// BPF_MAP_UPDATE_BATCH of (id, inner array's fd) on `lb_maglev`, or one by one where the
    /// kernel has no batch update. The built arrays are closed after: the outer map holds them.
    /// Frontends given the same table (one `Arc`: a Service port's frontends on several
    /// addresses, `MaglevEntry::positions`) share one inner array: the outer map holds a
    /// reference to it under each of their ids, so its memory is paid once per Service port, not
    /// once per frontend address, with no change to what the programs look up.
    fn put_maglev_tables(&mut self, tables: &[(u32, std::sync::Arc<[u32]>)]) -> Result<(), BatchError> {
        let mut built: Vec<(Array<MapData, MaglevChunk>, std::os::fd::RawFd)> = Vec::new();
        let mut first_of: std::collections::HashMap<*const u32, usize> = std::collections::HashMap::new();
        let mut inners = Vec::with_capacity(tables.len());
        for (_, positions) in tables {
            let index = match first_of.get(&positions.as_ptr()) {
                Some(index) => *index,
                None => {
                    let inner = self.maglev_inner.build(positions, &mut self.batch_supported);
                    built.push(inner.map_err(|error| BatchError { done: 0, error })?);
                    first_of.insert(positions.as_ptr(), built.len() - 1);
                    built.len() - 1
                }
            };
            inners.push(index);
        }
        let Some(outer) = self.maglev.as_mut() else {
            let error = MapError::new(
                catalog::MAGLEV,
                "update",
                io::Error::from_raw_os_error(libc::ENOENT),
            );
            return Err(BatchError { done: 0, error });
        };
        if tables.len() >= 2 && self.batch_supported {
            let fd = self.maglev_batch.as_ref().map_or(-1, |fd| fd.as_raw_fd());
            let keys: Vec<u32> = tables.iter().map(|(id, _)| *id).collect();
            let fds: Vec<u32> = inners.iter().map(|i| built[*i].1 as u32).collect();
            match update_batch(fd, &keys, &fds) {
                Ok(()) => return Ok(()),
                Err(e) if batch_unsupported(&e) => {
                    tracing::debug!("BPF_MAP_UPDATE_BATCH refused on lb_maglev ({e}): one by one");
                    self.batch_supported = false;
                }
                // Redone one by one below, for the failing table's own error.
                Err(_) => {}
            }
        }
        for (done, ((id, _), index)) in tables.iter().zip(&inners).enumerate() {
            let inner = &built[*index].0;
            outer.insert(id, inner, 0).map_err(|e| BatchError {
                done,
                error: MapError::new(catalog::MAGLEV, "update", io_err(e)),
            })?;
        }
        Ok(())
    }

    fn delete_maglev_tables(&mut self, ids: &[u32]) -> Result<(), BatchError> {
        if self.maglev.is_none() {
            return Ok(());
        }
        if ids.len() >= 2 && self.batch_supported {
            let fd = self.maglev_batch.as_ref().map_or(-1, |fd| fd.as_raw_fd());
            if delete_batch(fd, ids).is_ok() {
                return Ok(());
            }
            // A missing id stops a batch delete: the rest one by one, absent ones no error.
        }
        for (done, id) in ids.iter().enumerate() {
            self.delete_maglev(*id)
                .map_err(|error| BatchError { done, error })?;
        }
        Ok(())
    }

    fn put_services(&mut self, entries: &[(ServiceMapKey, ServiceMapValue)]) -> Result<(), BatchError> {
        let fresh = self
            .prefilter
            .hold_all(frontend_bits(entries))
            .map_err(|error| BatchError { done: 0, error })?;
        let (v4, v6, supported) = (&mut self.v4, &mut self.v6, &mut self.batch_supported);
        by_family_runs(
            entries,
            |(k, _)| k.family(),
            |family, run| match family {
                IpFamily::V4 => v4.put_services(supported, run),
                IpFamily::V6 => v6.put_services(supported, run),
            },
        )
        .inspect_err(|e| {
            let unwritten = entries.get(e.done..).unwrap_or_default();
            self.prefilter
                .release_unwritten(&fresh, frontend_bits(unwritten).into_iter().map(|(o, _, _)| o));
        })
    }

    fn put_backends(&mut self, entries: &[(u32, BackendEntry)]) -> Result<(), BatchError> {
        let fresh = self
            .prefilter
            .hold_all(entries.iter().map(|(id, v)| Owner::backend(*id, v)))
            .map_err(|error| BatchError { done: 0, error })?;
        let (v4, v6, supported) = (&mut self.v4, &mut self.v6, &mut self.batch_supported);
        by_family_runs(
            entries,
            |(_, v)| IpFamily::of(&v.addr),
            |family, run| match family {
                IpFamily::V4 => v4.put_backends(supported, run),
                IpFamily::V6 => v6.put_backends(supported, run),
            },
        )
        .inspect_err(|e| {
            let unwritten = entries.get(e.done..).unwrap_or_default();
            self.prefilter
                .release_unwritten(&fresh, unwritten.iter().map(|(id, v)| Owner::backend(*id, v).0));
        })
    }

    fn put_service(&mut self, key: &ServiceMapKey, value: &ServiceMapValue) -> Result<(), MapError> {
        self.put_services(&[(*key, *value)]).map_err(|e| e.error)
    }

    fn delete_service(&mut self, key: &ServiceMapKey) -> Result<(), MapError> {
        match key.family() {
            IpFamily::V4 => self.v4.delete_service(key)?,
            IpFamily::V6 => self.v6.delete_service(key)?,
        }
        for (owner, _, _) in Owner::frontend(key) {
            self.prefilter.release(&owner);
        }
        Ok(())
    }

    fn put_backend(&mut self, id: u32, value: &BackendEntry) -> Result<(), MapError> {
        self.put_backends(&[(id, *value)]).map_err(|e| e.error)
    }

    fn delete_backend(&mut self, family: IpFamily, id: u32) -> Result<(), MapError> {
        match family {
            IpFamily::V4 => self.v4.delete_backend(id)?,
            IpFamily::V6 => self.v6.delete_backend(id)?,
        }
        self.prefilter.release(&Owner::Backend(family, id));
        Ok(())
    }

    fn put_revnat(&mut self, id: u32, value: &RevNatEntry, name: &SvcName) -> Result<(), MapError> {
        self.names
            .insert(&id, name, 0)
            .map_err(|e| MapError::new(catalog::SVC_NAMES, "update", io_err(e)))?;
        match value.family() {
            IpFamily::V4 => self.v4.put_revnat(id, value),
            IpFamily::V6 => self.v6.put_revnat(id, value),
        }
    }

    fn delete_revnat(&mut self, family: IpFamily, id: u32) -> Result<(), MapError> {
        match family {
            IpFamily::V4 => self.v4.delete_revnat(id)?,
            IpFamily::V6 => self.v6.delete_revnat(id)?,
        }
        absent_ok(self.names.remove(&id)).map_err(|e| MapError::new(catalog::SVC_NAMES, "delete", e))
    }

    fn put_affinity_match(&mut self, key: &AffinityMatchKey) -> Result<(), MapError> {
        self.affinity_match
            .insert(key, &1u8, 0)
            .map_err(|e| MapError::new(catalog::AFFINITY_MATCH, "update", io_err(e)))
    }

    fn delete_affinity_match(&mut self, key: &AffinityMatchKey) -> Result<(), MapError> {
        absent_ok(self.affinity_match.remove(key))
            .map_err(|e| MapError::new(catalog::AFFINITY_MATCH, "delete", e))
    }

    fn put_source_range(&mut self, range: &SourceRange) -> Result<(), MapError> {
        match range.family() {
            IpFamily::V4 => self.v4.put_source_range(range),
            IpFamily::V6 => self.v6.put_source_range(range),
        }
    }

    fn delete_source_range(&mut self, range: &SourceRange) -> Result<(), MapError> {
        match range.family() {
            IpFamily::V4 => self.v4.delete_source_range(range),
            IpFamily::V6 => self.v6.delete_source_range(range),
        }
    }

    fn put_config(&mut self, config: &DatapathConfig) -> Result<(), MapError> {
        self.hold_masquerade(config)?;
        let mut config = *config;
        if self.prefilter.is_ready() {
            config.flags |= lb_common::config::flags::PREFILTER;
        }
        self.config
            .set(0, &config, 0)
            .map_err(|e| MapError::new(catalog::CONFIG, "update", io_err(e)))
    }

    fn cluster_ip_checks(&self, family: IpFamily) -> Result<BTreeMap<IpNet, u8>, MapError> {
        match family {
            IpFamily::V4 => self.v4.cluster_ip_checks(),
            IpFamily::V6 => self.v6.cluster_ip_checks(),
        }
    }

    fn set_cluster_ip_check(&mut self, net: &IpNet, action: Option<u8>) -> Result<(), MapError> {
        match IpFamily::of_net(net) {
            IpFamily::V4 => self.v4.set_cluster_ip_check(net, action),
            IpFamily::V6 => self.v6.set_cluster_ip_check(net, action),
        }
    }

    fn put_service_ranges(&mut self, family: IpFamily, ranges: &[IpNet]) -> Result<(), MapError> {
        match family {
            IpFamily::V4 => self.v4.put_service_ranges(ranges),
            IpFamily::V6 => self.v6.put_service_ranges(ranges),
        }
    }

    fn put_masquerade_addrs(&mut self, entries: &BTreeMap<u32, MasqueradeAddrs>) -> Result<(), MapError> {
        let Some(map) = self.masquerade_addrs.as_mut() else {
            return Err(MapError::new(
                catalog::MASQ_ADDRS,
                "update",
                io::Error::from_raw_os_error(libc::ENOENT),
            ));
        };
        // Replies to every address are un-SNATed at ingress: their bits before the entries.
        let addresses: BTreeSet<IpAddr> = entries
            .values()
            .flat_map(|e| {
                let v4 = e.v4.valid().iter().map(|c| V4::ip_addr(&c.addr));
                let v6 = e.v6.valid().iter().map(|c| V6::ip_addr(&c.addr));
                v4.chain(v6).collect::<Vec<_>>()
            })
            .collect();
        let held: Vec<_> = addresses
            .iter()
            .map(|ip| {
                let (family, bit) = super::prefilter::ingress_bit(ip);
                (Owner::InterfaceAddress(*ip), family, bit)
            })
            .collect();
        self.prefilter.hold_all(held)?;
        let result = replace_entries(map, catalog::MASQ_ADDRS, entries.iter().map(|(i, e)| (*i, *e)));
        // The bits of addresses no interface has any more go (after their grace period).
        self.prefilter.release_all_but(&addresses);
        result
    }

    fn put_pod_interfaces(&mut self, ifindexes: &std::collections::BTreeSet<u32>) -> Result<(), MapError> {
        let Some(map) = self.pod_interfaces.as_mut() else {
            return Err(MapError::new(
                catalog::POD_INTERFACES,
                "update",
                io::Error::from_raw_os_error(libc::ENOENT),
            ));
        };
        replace_entries(map, catalog::POD_INTERFACES, ifindexes.iter().map(|i| (*i, 1)))
    }

    fn adopted(&mut self, snapshot: &Snapshot) -> Result<(), MapError> {
        let frontends = snapshot.services.keys().flat_map(Owner::frontend);
        let backends = snapshot.backends.iter().map(|(id, v)| Owner::backend(*id, v));
        self.prefilter.hold_all(frontends.chain(backends)).map(drop)
    }

    fn snapshot(&self) -> Result<Snapshot, MapError> {
        let read = |map: &'static str| move |e| MapError::new(map, "dump", io_err(e));
        let mut snap = Snapshot::default();
        self.v4.read_into(&mut snap)?;
        self.v6.read_into(&mut snap)?;
        for entry in self.names.iter() {
            let (k, v) = entry.map_err(read(catalog::SVC_NAMES))?;
            snap.names.insert(k, v);
        }
        for key in self.affinity_match.keys() {
            snap.affinity_match
                .push(key.map_err(read(catalog::AFFINITY_MATCH))?);
        }
        snap.maglev = self.read_maglev(&snap.services)?;
        snap.maglev_seed =
            crate::plan::maglev::HashSeed::from_word(self.datapath_config().map_or(0, |c| c.maglev_seed));
        Ok(snap)
    }
}
