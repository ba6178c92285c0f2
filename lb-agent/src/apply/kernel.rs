//! `MapOps` on the real maps, through aya. The maps come either from a freshly loaded object or
//! from their pins (so the CLI can read and clean up without loading anything).

use std::{
    io,
    os::fd::{AsFd, AsRawFd, OwnedFd, RawFd},
    path::Path,
};

use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, PerCpuArray, lpm_trie::Key};
use lb_common::{
    affinity::AffinityMatchKey,
    backend::Backend4Value,
    catalog,
    config::DatapathConfig,
    revnat::{RevNat4Value, SvcName},
    service::{SrcRange4, Svc4Key, Svc4Value},
};

use super::ops::{BatchError, MapError, MapOps, Snapshot};

/// The maps the agent writes, plus the counters it reads.
pub struct KernelMaps {
    pub services: HashMap<MapData, Svc4Key, Svc4Value>,
    pub backends: HashMap<MapData, u32, Backend4Value>,
    pub revnat: HashMap<MapData, u32, RevNat4Value>,
    pub names: HashMap<MapData, u32, SvcName>,
    pub affinity_match: HashMap<MapData, AffinityMatchKey, u8>,
    pub source_ranges: LpmTrie<MapData, SrcRange4, u8>,
    pub config: Array<MapData, DatapathConfig>,
    pub stats: PerCpuArray<MapData, u64>,
    /// The services and backends maps again, for BPF_MAP_UPDATE_BATCH (aya has no batch calls).
    batch_fds: BatchFds,
}

struct BatchFds {
    services: OwnedFd,
    backends: OwnedFd,
    /// Cleared when the kernel refuses batch updates (before 5.6): single updates from then on.
    supported: bool,
}

/// A second descriptor of a hash map, taken before aya wraps it.
fn dup_fd(map: &Map) -> Result<OwnedFd, aya::maps::MapError> {
    match map {
        Map::HashMap(data) => Ok(data.fd().as_fd().try_clone_to_owned()?),
        _ => Err(aya::maps::MapError::IoError(io::Error::other("not a hash map"))),
    }
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
    // SAFETY: `attr` is the kernel's batch layout; keys and values point at `count` contiguous
    // elements of the map's key and value size, alive for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_UPDATE_BATCH,
            &mut attr as *mut BatchAttr, // the kernel writes `count` back
            std::mem::size_of::<BatchAttr>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether an error says the kernel has no batch update for this map (not an entry's failure).
fn batch_unsupported(e: &io::Error) -> bool {
    // ENOTSUPP (524) is the kernel-internal "not supported" some paths return.
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) | Some(524)
    )
}

impl KernelMaps {
    /// Writes a run of entries to the map behind `fd` with one batch call, or one by one (with
    /// `single`) where batches are refused.
    fn batch<K: aya::Pod, V: aya::Pod>(
        &mut self,
        fd: RawFd,
        entries: &[(K, V)],
        single: impl Fn(&mut Self, &K, &V) -> Result<(), MapError>,
    ) -> Result<(), BatchError> {
        let one_by_one = |this: &mut Self| {
            for (done, (k, v)) in entries.iter().enumerate() {
                single(this, k, v).map_err(|error| BatchError { done, error })?;
            }
            Ok(())
        };
        if entries.len() < 2 || !self.batch_fds.supported {
            return one_by_one(self);
        }
        let keys: Vec<K> = entries.iter().map(|(k, _)| *k).collect();
        let values: Vec<V> = entries.iter().map(|(_, v)| *v).collect();
        match update_batch(fd, &keys, &values) {
            Ok(()) => Ok(()),
            Err(e) => {
                if batch_unsupported(&e) {
                    tracing::debug!("BPF_MAP_UPDATE_BATCH refused ({e}): single updates from now on");
                    self.batch_fds.supported = false;
                }
                // Redo the run one by one, for the failing entry's own error and an exact count
                // (the kernel does not report one when it refuses the call before starting);
                // rewriting an entry with the value it already has changes nothing.
                one_by_one(self)
            }
        }
    }
}

fn io_err(e: aya::maps::MapError) -> io::Error {
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

impl KernelMaps {
    /// Takes the maps out of a loaded object.
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self, aya::maps::MapError> {
        let mut take = |name: &str| {
            ebpf.take_map(name)
                .ok_or_else(|| aya::maps::MapError::InvalidName {
                    name: name.to_string(),
                })
        };
        let services = take(catalog::SERVICES)?;
        let backends = take(catalog::BACKENDS)?;
        let batch_fds = BatchFds {
            services: dup_fd(&services)?,
            backends: dup_fd(&backends)?,
            supported: true,
        };
        Ok(Self {
            services: services.try_into()?,
            backends: backends.try_into()?,
            revnat: take(catalog::REVNAT)?.try_into()?,
            names: take(catalog::SVC_NAMES)?.try_into()?,
            affinity_match: take(catalog::AFFINITY_MATCH)?.try_into()?,
            source_ranges: take(catalog::SOURCE_RANGES)?.try_into()?,
            config: take(catalog::CONFIG)?.try_into()?,
            stats: take(catalog::STATS)?.try_into()?,
            batch_fds,
        })
    }

    /// Opens the pinned maps under `<bpf-root>/maps`.
    pub fn from_pins(maps_dir: &Path) -> Result<Self, aya::maps::MapError> {
        let open = |name: &str| MapData::from_pin(maps_dir.join(name));
        let services = Map::HashMap(open(catalog::SERVICES)?);
        let backends = Map::HashMap(open(catalog::BACKENDS)?);
        let batch_fds = BatchFds {
            services: dup_fd(&services)?,
            backends: dup_fd(&backends)?,
            supported: true,
        };
        Ok(Self {
            services: services.try_into()?,
            backends: backends.try_into()?,
            revnat: Map::HashMap(open(catalog::REVNAT)?).try_into()?,
            names: Map::HashMap(open(catalog::SVC_NAMES)?).try_into()?,
            affinity_match: Map::HashMap(open(catalog::AFFINITY_MATCH)?).try_into()?,
            source_ranges: Map::LpmTrie(open(catalog::SOURCE_RANGES)?).try_into()?,
            config: Map::Array(open(catalog::CONFIG)?).try_into()?,
            stats: Map::PerCpuArray(open(catalog::STATS)?).try_into()?,
            batch_fds,
        })
    }

    /// Sums a counter over the CPUs.
    pub fn counter(&self, index: u32) -> u64 {
        self.stats
            .get(&index, 0)
            .map(|per_cpu| per_cpu.iter().sum())
            .unwrap_or(0)
    }
}

impl MapOps for KernelMaps {
    fn put_services(&mut self, entries: &[(Svc4Key, Svc4Value)]) -> Result<(), BatchError> {
        let fd = self.batch_fds.services.as_raw_fd();
        self.batch(fd, entries, |m, k, v| m.put_service(k, v))
    }

    fn put_backends(&mut self, entries: &[(u32, Backend4Value)]) -> Result<(), BatchError> {
        let fd = self.batch_fds.backends.as_raw_fd();
        self.batch(fd, entries, |m, k, v| m.put_backend(*k, v))
    }

    fn put_service(&mut self, key: &Svc4Key, value: &Svc4Value) -> Result<(), MapError> {
        self.services
            .insert(key, value, 0)
            .map_err(|e| MapError::new(catalog::SERVICES, "update", io_err(e)))
    }

    fn delete_service(&mut self, key: &Svc4Key) -> Result<(), MapError> {
        absent_ok(self.services.remove(key)).map_err(|e| MapError::new(catalog::SERVICES, "delete", e))
    }

    fn put_backend(&mut self, id: u32, value: &Backend4Value) -> Result<(), MapError> {
        self.backends
            .insert(&id, value, 0)
            .map_err(|e| MapError::new(catalog::BACKENDS, "update", io_err(e)))
    }

    fn delete_backend(&mut self, id: u32) -> Result<(), MapError> {
        absent_ok(self.backends.remove(&id)).map_err(|e| MapError::new(catalog::BACKENDS, "delete", e))
    }

    fn put_revnat(&mut self, id: u32, value: &RevNat4Value, name: &SvcName) -> Result<(), MapError> {
        self.names
            .insert(&id, name, 0)
            .map_err(|e| MapError::new(catalog::SVC_NAMES, "update", io_err(e)))?;
        self.revnat
            .insert(&id, value, 0)
            .map_err(|e| MapError::new(catalog::REVNAT, "update", io_err(e)))
    }

    fn delete_revnat(&mut self, id: u32) -> Result<(), MapError> {
        absent_ok(self.revnat.remove(&id)).map_err(|e| MapError::new(catalog::REVNAT, "delete", e))?;
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

    fn put_source_range(&mut self, prefix_len: u32, range: &SrcRange4) -> Result<(), MapError> {
        self.source_ranges
            .insert(&Key::new(prefix_len, *range), &1u8, 0)
            .map_err(|e| MapError::new(catalog::SOURCE_RANGES, "update", io_err(e)))
    }

    fn delete_source_range(&mut self, prefix_len: u32, range: &SrcRange4) -> Result<(), MapError> {
        absent_ok(self.source_ranges.remove(&Key::new(prefix_len, *range)))
            .map_err(|e| MapError::new(catalog::SOURCE_RANGES, "delete", e))
    }

    fn put_config(&mut self, config: &DatapathConfig) -> Result<(), MapError> {
        self.config
            .set(0, config, 0)
            .map_err(|e| MapError::new(catalog::CONFIG, "update", io_err(e)))
    }

    fn snapshot(&self) -> Result<Snapshot, MapError> {
        let read = |map: &'static str| move |e| MapError::new(map, "dump", io_err(e));
        let mut snap = Snapshot::default();
        for entry in self.services.iter() {
            let (k, v) = entry.map_err(read(catalog::SERVICES))?;
            snap.services.insert(k, v);
        }
        for entry in self.backends.iter() {
            let (k, v) = entry.map_err(read(catalog::BACKENDS))?;
            snap.backends.insert(k, v);
        }
        for entry in self.revnat.iter() {
            let (k, v) = entry.map_err(read(catalog::REVNAT))?;
            snap.revnat.insert(k, v);
        }
        for entry in self.names.iter() {
            let (k, v) = entry.map_err(read(catalog::SVC_NAMES))?;
            snap.names.insert(k, v);
        }
        for key in self.affinity_match.keys() {
            snap.affinity_match
                .push(key.map_err(read(catalog::AFFINITY_MATCH))?);
        }
        for key in self.source_ranges.keys() {
            let key = key.map_err(read(catalog::SOURCE_RANGES))?;
            snap.source_ranges.push((key.prefix_len(), key.data()));
        }
        Ok(snap)
    }
}
