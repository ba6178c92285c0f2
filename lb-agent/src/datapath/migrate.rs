//! Pinned maps across restarts and upgrades: reused when they still match, migrated when they do
//! not, never silently reused with another layout.
//!
//! Each map has a layout version (`LAYOUTS`); a map whose key or value layout changes gets a new
//! version and therefore a new pin name (`lb4_services` is version 1, its successor would be
//! `lb4_services_v2`), as Cilium renames `cilium_lb4_services_v2`. At start-up:
//! - a pin of the current version whose capacity differs (a changed `--bpf-lb-map-max`, say) is
//!   moved aside, a new map is created, and its entries are copied over;
//! - pins of other versions are left to the programs that still use them;
//! - a pin of the current version whose key or value size differs is a layout change without a
//!   version bump: refused, with an error (it would be read with the wrong layout).
//!
//! The agent then programs the new maps completely, replaces the attached programs atomically
//! (`bpf_link_update`), and only then removes the old pins (`finish`), so traffic never sees an
//! empty or half-filled map.

use std::{
    fs,
    mem::size_of,
    path::{Path, PathBuf},
};

use aya::maps::{HashMap, LpmTrie, Map, MapData, MapInfo, lpm_trie::Key};
use lb_common::{
    affinity::{Affinity4Key, Affinity4Value, AffinityMatchKey},
    backend::Backend4Value,
    catalog,
    config::DatapathConfig,
    conntrack::{Ct4Key, Ct4Value},
    revnat::{RevNat4Value, SockRevNat4Key, SockRevNat4Sk, SockRevNat4Value, SvcName},
    service::{SrcRange4, Svc4Key, Svc4Value},
};

use super::{DatapathError, PinPaths, hint_for};
use lb_common::catalog::Capacities;

/// Layout version of every map. Bump a map's version when its key or value layout changes (and add
/// a conversion in `copy_entries` if its entries must survive the upgrade).
pub const LAYOUTS: &[(&str, u32)] = &[
    (catalog::SERVICES, 1),
    (catalog::BACKENDS, 1),
    (catalog::REVNAT, 1),
    (catalog::SVC_NAMES, 1),
    (catalog::SOCK_REVNAT, 1),
    (catalog::SOCK_REVNAT_SK, 1),
    (catalog::AFFINITY, 1),
    (catalog::AFFINITY_MATCH, 1),
    (catalog::SOURCE_RANGES, 1),
    (catalog::CONNTRACK, 1),
    (catalog::CONFIG, 1),
    (catalog::STATS, 1),
    (catalog::REJECT_LIMIT, 1),
];

/// The pin file name of a map at its current layout version.
pub fn pin_name(name: &str) -> String {
    let version = LAYOUTS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| *v)
        .unwrap_or(1);
    if version == 1 {
        name.to_string()
    } else {
        format!("{name}_v{version}")
    }
}

/// What the kernel must agree with for a pin to be reused.
struct Expected {
    key_size: u32,
    value_size: u32,
    max_entries: Option<u32>,
}

fn expected(name: &str, caps: &Capacities) -> Expected {
    let sizes = |k: usize, v: usize, max: Option<u32>| Expected {
        key_size: k as u32,
        value_size: v as u32,
        max_entries: max,
    };
    match name {
        catalog::SERVICES => sizes(size_of::<Svc4Key>(), size_of::<Svc4Value>(), Some(caps.services)),
        catalog::BACKENDS => sizes(4, size_of::<Backend4Value>(), Some(caps.backends)),
        catalog::REVNAT => sizes(4, size_of::<RevNat4Value>(), Some(caps.revnat)),
        catalog::SVC_NAMES => sizes(4, size_of::<SvcName>(), Some(caps.revnat)),
        catalog::SOCK_REVNAT => sizes(
            size_of::<SockRevNat4Key>(),
            size_of::<SockRevNat4Value>(),
            Some(caps.sock_revnat),
        ),
        // Socket storage: keyed by a socket (an fd from user space), no capacity.
        catalog::SOCK_REVNAT_SK => sizes(4, size_of::<SockRevNat4Sk>(), None),
        catalog::AFFINITY => sizes(
            size_of::<Affinity4Key>(),
            size_of::<Affinity4Value>(),
            Some(caps.affinity),
        ),
        catalog::AFFINITY_MATCH => sizes(size_of::<AffinityMatchKey>(), 1, Some(caps.affinity_match)),
        catalog::SOURCE_RANGES => sizes(4 + size_of::<SrcRange4>(), 1, Some(caps.source_ranges)),
        catalog::CONNTRACK => sizes(size_of::<Ct4Key>(), size_of::<Ct4Value>(), Some(caps.conntrack)),
        catalog::CONFIG => sizes(4, size_of::<DatapathConfig>(), Some(1)),
        // Per-CPU values: the kernel reports the per-CPU value size.
        catalog::REJECT_LIMIT => sizes(4, size_of::<lb_common::ratelimit::RateBucket>(), Some(1)),
        // New counters grow the map; counters then restart from zero.
        _ => sizes(4, 8, Some(lb_common::stats::COUNT)),
    }
}

/// Pins to deal with once the new programs are in place.
#[derive(Debug, Default)]
pub struct Migration {
    /// (map name, where the old map's pin was moved) for maps recreated with another capacity.
    pub resized: Vec<(String, PathBuf)>,
    /// Pins of other layout versions.
    pub stale: Vec<PathBuf>,
}

impl Migration {
    pub fn is_empty(&self) -> bool {
        self.resized.is_empty() && self.stale.is_empty()
    }

    /// Removes the old pins; the maps go away once the programs that used them are replaced.
    pub fn finish(&mut self) {
        for (name, path) in self.resized.drain(..) {
            tracing::info!(map = %name, "migration done: removing the old map's pin");
            let _ = fs::remove_file(path);
        }
        for path in self.stale.drain(..) {
            tracing::info!(pin = %path.display(), "removing a map of an older layout version");
            let _ = fs::remove_file(path);
        }
    }
}

/// Checks every existing pin against what this agent will create; moves aside the ones to
/// migrate. Runs before the object is loaded.
pub fn prepare(paths: &PinPaths, caps: &Capacities) -> Result<Migration, DatapathError> {
    let mut migration = Migration::default();
    let existing: Vec<String> = fs::read_dir(paths.maps())
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    for (name, _) in LAYOUTS {
        let current = pin_name(name);
        for other in existing
            .iter()
            .filter(|f| is_version_of(f, name) && **f != current)
        {
            tracing::warn!(map = name, pin = %other, "a map of another layout version is pinned; it is replaced, its entries are rebuilt");
            migration.stale.push(paths.maps().join(other));
        }
        let pin = paths.maps().join(&current);
        // `exists()` would say "no" for a pin the agent may not even look at.
        match pin.try_exists() {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                return Err(DatapathError::Pin {
                    path: pin,
                    message: format!("{e}{}", hint_for(&e.to_string())),
                });
            }
        }
        let info = MapInfo::from_pin(&pin)?;
        let want = expected(name, caps);
        if info.key_size() != want.key_size || info.value_size() != want.value_size {
            return Err(DatapathError::IncompatiblePin {
                name: name.to_string(),
                detail: format!(
                    "key/value size {}/{} where this agent uses {}/{} at the same layout version (a layout change needs a version bump)",
                    info.key_size(),
                    info.value_size(),
                    want.key_size,
                    want.value_size
                ),
            });
        }
        if want.max_entries.is_some_and(|max| max != info.max_entries()) {
            let aside = paths.maps().join(format!("{current}-old"));
            let _ = fs::remove_file(&aside);
            fs::rename(&pin, &aside).map_err(|e| DatapathError::Pin {
                path: pin.clone(),
                message: e.to_string(),
            })?;
            tracing::info!(
                map = name,
                from = info.max_entries(),
                to = want.max_entries.unwrap_or_default(),
                "capacity changed: migrating the map to a new one of the new size"
            );
            migration.resized.push((name.to_string(), aside));
        }
    }
    Ok(migration)
}

/// Whether a pin file name is some layout version of map `name`.
fn is_version_of(file: &str, name: &str) -> bool {
    file == name
        || file
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix("_v"))
            .is_some_and(|v| v.chars().all(|c| c.is_ascii_digit()))
}

fn copy_hash<K: aya::Pod, V: aya::Pod>(
    from: &Path,
    to: &mut Map,
    lru: bool,
) -> Result<(usize, usize), aya::maps::MapError> {
    let data = MapData::from_pin(from)?;
    let old: HashMap<MapData, K, V> = if lru {
        Map::LruHashMap(data)
    } else {
        Map::HashMap(data)
    }
    .try_into()?;
    let mut new: HashMap<&mut MapData, K, V> = to.try_into()?;
    let (mut copied, mut dropped) = (0, 0);
    for (k, v) in old.iter().flatten() {
        match new.insert(&k, &v, 0) {
            Ok(()) => copied += 1,
            Err(_) => dropped += 1,
        }
    }
    Ok((copied, dropped))
}

fn copy_lpm<K: aya::Pod, V: aya::Pod>(
    from: &Path,
    to: &mut Map,
) -> Result<(usize, usize), aya::maps::MapError> {
    let old: LpmTrie<MapData, K, V> = Map::LpmTrie(MapData::from_pin(from)?).try_into()?;
    let mut new: LpmTrie<&mut MapData, K, V> = to.try_into()?;
    let (mut copied, mut dropped) = (0, 0);
    for (k, v) in old.iter().flatten() {
        match new.insert(&Key::new(k.prefix_len(), k.data()), &v, 0) {
            Ok(()) => copied += 1,
            Err(_) => dropped += 1,
        }
    }
    Ok((copied, dropped))
}

/// Copies the entries of the maps moved aside into their new maps (same layout, new capacity).
pub fn copy_entries(migration: &Migration, ebpf: &mut aya::Ebpf) {
    for (name, from) in &migration.resized {
        let Some(to) = ebpf.map_mut(name) else { continue };
        let result = match name.as_str() {
            catalog::SERVICES => copy_hash::<Svc4Key, Svc4Value>(from, to, false),
            catalog::BACKENDS => copy_hash::<u32, Backend4Value>(from, to, false),
            catalog::REVNAT => copy_hash::<u32, RevNat4Value>(from, to, false),
            catalog::SVC_NAMES => copy_hash::<u32, SvcName>(from, to, false),
            catalog::AFFINITY_MATCH => copy_hash::<AffinityMatchKey, u8>(from, to, false),
            catalog::SOCK_REVNAT => copy_hash::<SockRevNat4Key, SockRevNat4Value>(from, to, true),
            catalog::AFFINITY => copy_hash::<Affinity4Key, Affinity4Value>(from, to, true),
            catalog::CONNTRACK => copy_hash::<Ct4Key, Ct4Value>(from, to, true),
            catalog::SOURCE_RANGES => copy_lpm::<SrcRange4, u8>(from, to),
            _ => continue,
        };
        match result {
            Ok((copied, 0)) => tracing::info!(map = %name, copied, "entries migrated"),
            Ok((copied, dropped)) => {
                tracing::warn!(map = %name, copied, dropped, "entries migrated; the new map is too small for some")
            }
            Err(e) => tracing::error!(map = %name, "migrating entries failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_pin_names() {
        assert_eq!(pin_name(catalog::SERVICES), "lb4_services");
        assert!(is_version_of("lb4_services", "lb4_services"));
        assert!(is_version_of("lb4_services_v2", "lb4_services"));
        assert!(!is_version_of("lb4_services-old", "lb4_services"));
        assert!(!is_version_of("lb4_services_vx", "lb4_services"));
        assert!(!is_version_of("lb4_svc", "lb4_services"));
    }

    #[test]
    fn every_map_has_a_layout_version_and_an_expected_size() {
        for name in catalog::ALL {
            assert!(
                LAYOUTS.iter().any(|(n, _)| n == name),
                "{name} has no layout version"
            );
            let e = expected(name, &Capacities::default());
            assert!(e.key_size > 0 && e.value_size > 0, "{name}");
        }
    }
}
