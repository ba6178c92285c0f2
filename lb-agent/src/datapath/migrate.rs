//! Pinned maps across restarts and upgrades: reused when they still match, migrated when they do
//! not, never silently reused with another layout.
//!
//! Each map has a layout version (`catalog::LAYOUTS`); a map whose key or value layout changes gets a new
//! version and therefore a new pin name (`lb4_services` was version 1; version 2, whose slots carry
//! their backend's entry, is pinned as `lb4_services_v2`), as Cilium renames
//! `cilium_lb4_services_v2`. At start-up:
//! - a pin of the current version whose capacity differs (a changed `--bpf-lb-map-max`, say) is
//!   moved aside (`<pin>-old`), a new map is created, and its entries are copied over;
//! - a `<pin>-old` left by a start killed before it finished such a migration goes back under
//!   its pin first ([`recover_interrupted`]), so the migration starts over from the map the
//!   attached programs used;
//! - pins of other versions are left to the programs that still use them; the entries of a map
//!   whose new layout only adds to the old one are converted into the new map first
//!   ([`convert_entries`]: `lb4_services` v1 -> v2 adds each slot's copy of its backend), so the
//!   ids the agent adopts from them survive the upgrade;
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

use aya::{
    Pod,
    maps::{HashMap, LpmTrie, Map, MapData, MapInfo, lpm_trie::Key},
};
use lb_common::{
    affinity::{AffinityKey, AffinityMatchKey, AffinityValue},
    backend::BackendValue,
    catalog::{self, FamilyMaps},
    config::DatapathConfig,
    conntrack::{CtKey, CtValue},
    family::{V4, V6},
    revnat::{RevNatValue, SockConnSlot, SockRevNatKey, SockRevNatSk, SockRevNatValue, SvcName},
    service::{SrcRange, SvcEntry, SvcKey, SvcValue},
};

use super::{DatapathError, PinPaths, hint_for};
use lb_common::catalog::{Capacities, LAYOUTS, pin_name};

/// What the kernel must agree with for a pin to be reused.
struct Expected {
    key_size: u32,
    value_size: u32,
    max_entries: Option<u32>,
}

fn sizes(key: usize, value: usize, max_entries: Option<u32>) -> Expected {
    Expected {
        key_size: key as u32,
        value_size: value as u32,
        max_entries,
    }
}

/// What the pin of map `name` must hold; `None` for a name this agent has no map of (every
/// name of `catalog::ALL` has an arm: a unit test says so, so a new map cannot be checked
/// against another map's layout).
fn expected(name: &str, caps: &Capacities) -> Option<Expected> {
    if let Some(e) = family_expected::<V4>(name, caps).or_else(|| family_expected::<V6>(name, caps)) {
        return Some(e);
    }
    Some(match name {
        catalog::SVC_NAMES => sizes(4, size_of::<SvcName>(), Some(caps.revnat.saturating_mul(2))),
        // Values are inner maps (an fd in, an id out: 4 bytes). A resized one starts empty: the
        // first sync writes every table before the programs are replaced.
        catalog::MAGLEV => sizes(4, 4, Some(caps.revnat.saturating_mul(2))),
        // Program fds in, ids out.
        // A resized one starts empty: the agent fills it when it serves SCTP.
        catalog::TC_TAIL => sizes(4, 4, Some(catalog::TAIL_SLOTS)),
        catalog::AFFINITY_MATCH => sizes(size_of::<AffinityMatchKey>(), 1, Some(caps.affinity_match)),
        catalog::CONFIG => sizes(4, size_of::<DatapathConfig>(), Some(1)),
        catalog::POD_INTERFACES => sizes(4, 1, Some(lb_common::catalog::capacity::POD_INTERFACES)),
        catalog::MASQ_ADDRS => sizes(
            4,
            size_of::<lb_common::config::MasqueradeAddrs>(),
            Some(lb_common::catalog::capacity::MASQ_ADDRS),
        ),
        catalog::MONITOR => sizes(4, size_of::<lb_common::monitor::MonitorControl>(), Some(1)),
        // A ring buffer has neither keys nor values; its size is its capacity in bytes.
        catalog::EVENTS => sizes(0, 0, Some(lb_common::catalog::capacity::EVENTS)),
        // Per-CPU values: the kernel reports the per-CPU value size.
        catalog::REJECT_LIMIT => sizes(4, size_of::<lb_common::ratelimit::RateBucket>(), Some(1)),
        // New counters grow the map; counters then restart from zero.
        catalog::STATS => sizes(4, 8, Some(lb_common::stats::COUNT)),
        _ => return None,
    })
}

/// The expected layout of `name` if it is one of family `F`'s maps.
fn family_expected<F: FamilyMaps>(name: &str, caps: &Capacities) -> Option<Expected> {
    let maps = F::MAPS;
    Some(if name == maps.services {
        sizes(
            size_of::<SvcKey<F>>(),
            size_of::<SvcEntry<F>>(),
            Some(caps.services),
        )
    } else if name == maps.backends {
        sizes(4, size_of::<BackendValue<F>>(), Some(caps.backends))
    } else if name == maps.revnat {
        sizes(4, size_of::<RevNatValue<F>>(), Some(caps.revnat))
    } else if name == maps.sock_revnat {
        sizes(
            size_of::<SockRevNatKey<F>>(),
            size_of::<SockRevNatValue<F>>(),
            Some(caps.sock_revnat),
        )
    } else if name == maps.sock_conn {
        sizes(
            4,
            size_of::<SockConnSlot<F>>(),
            Some(lb_common::revnat::CONN_SLOTS),
        )
    } else if name == maps.sock_revnat_sk {
        // Socket storage: keyed by a socket (an fd from user space), no capacity.
        sizes(4, size_of::<SockRevNatSk<F>>(), None)
    } else if name == maps.affinity {
        sizes(
            size_of::<AffinityKey<F>>(),
            size_of::<AffinityValue>(),
            Some(caps.affinity),
        )
    } else if name == maps.source_ranges {
        sizes(4 + size_of::<SrcRange<F>>(), 1, Some(caps.source_ranges))
    } else if name == maps.conntrack || name == maps.conntrack_new {
        let capacity = if name == maps.conntrack {
            caps.conntrack
        } else {
            caps.conntrack_new
        };
        sizes(size_of::<CtKey<F>>(), size_of::<CtValue<F>>(), Some(capacity))
    } else if name == maps.fragments {
        sizes(
            size_of::<lb_common::fragment::FragKey<F>>(),
            size_of::<lb_common::fragment::FragPorts>(),
            Some(lb_common::catalog::capacity::FRAGMENTS),
        )
    } else if name == maps.cluster_ips {
        sizes(
            4 + size_of::<lb_common::cluster_ip::ClusterIpKey<F>>(),
            1,
            Some(
                caps.revnat
                    .saturating_add(lb_common::cluster_ip::SERVICE_CIDR_ROOM),
            ),
        )
    } else if name == maps.service_ranges {
        sizes(4, size_of::<lb_common::cluster_ip::ServiceRanges<F>>(), Some(1))
    } else if name == maps.prefilter {
        sizes(4, 8, Some(lb_common::prefilter::WORDS))
    } else if name == maps.ct_filter {
        sizes(4, 8, Some(lb_common::ct_filter::WORDS))
    } else {
        return None;
    })
}

/// Pins to deal with once the new programs are in place.
#[derive(Debug, Default)]
pub struct Migration {
    /// (map name, where the old map's pin was moved) for maps recreated with another capacity.
    pub resized: Vec<(String, PathBuf)>,
    /// (map name, pin of its layout-1 map) for maps whose entries are converted into the new
    /// layout, the new map not being pinned yet ([`CONVERTED_FROM_V1`]).
    pub converted: Vec<(String, PathBuf)>,
    /// Pins of other layout versions.
    pub stale: Vec<PathBuf>,
}

/// Maps whose layout-1 entries are converted into their current layout at an upgrade: the
/// services maps (layout 2 adds a copy of each slot's backend, read from the backends map, whose
/// layout is unchanged). Their frontends' reverse-NAT ids and their backends' ids are adopted from
/// them, so established flows (conntrack entries and socket reverse NAT naming those ids) keep
/// their meaning.
const CONVERTED_FROM_V1: &[&str] = &[catalog::SERVICES, catalog::SERVICES6];

impl Migration {
    pub fn is_empty(&self) -> bool {
        self.resized.is_empty() && self.stale.is_empty() && self.converted.is_empty()
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
pub fn prepare(
    paths: &PinPaths,
    caps: &Capacities,
    journal: &mut super::journal::StartJournal,
) -> Result<Migration, DatapathError> {
    let mut migration = Migration::default();
    let existing: Vec<String> = fs::read_dir(paths.maps())
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    // Maps this release no longer has: their pins go once the new programs are attached.
    for retired in catalog::RETIRED {
        if existing.iter().any(|f| f == retired) {
            tracing::info!(
                map = retired,
                "a map of an earlier release is pinned; it is removed once the programs are replaced"
            );
            migration.stale.push(paths.maps().join(retired));
        }
    }
    for (name, _) in LAYOUTS {
        recover_interrupted(paths, name)?;
        let current = pin_name(name).to_string();
        let current_pinned = existing.contains(&current);
        for other in existing
            .iter()
            .filter(|f| is_version_of(f, name) && **f != current)
        {
            let old = paths.maps().join(other);
            if other == name && CONVERTED_FROM_V1.contains(name) && !current_pinned {
                tracing::info!(map = name, pin = %other, "a map of layout version 1 is pinned; its entries are converted into the new layout, then it is replaced");
                migration.converted.push((name.to_string(), old.clone()));
            } else {
                tracing::warn!(map = name, pin = %other, "a map of another layout version is pinned; it is replaced, its entries are rebuilt");
            }
            migration.stale.push(old);
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
        let want = expected(name, caps).ok_or_else(|| DatapathError::IncompatiblePin {
            name: name.to_string(),
            detail: "this agent has no expected layout for it (a map added without one)".into(),
        })?;
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
            let aside = aside_path(paths, name);
            fs::rename(&pin, &aside).map_err(|e| DatapathError::Pin {
                path: pin.clone(),
                message: e.to_string(),
            })?;
            journal.moved_aside(&pin, &aside);
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

/// Where a map's pin is moved while it is migrated to a new capacity.
fn aside_path(paths: &PinPaths, name: &str) -> PathBuf {
    paths.maps().join(format!("{}-old", pin_name(name)))
}

/// Puts back a pin an earlier start moved aside and could not remove (killed with SIGKILL,
/// which no journal can undo, between [`prepare`] and [`Migration::finish`]).
///
/// The map moved aside is the one the attached programs served from: the killed start replaces
/// them only after its first sync, and removes the old pin right after that. A new map the
/// killed start pinned in between is dropped (its entries were copied from the old one, or are
/// the API's state, written again by this start's first sync). The one window this does not
/// cover is between that start's attach and its `finish`, a few milliseconds: conntrack,
/// affinity or socket entries created in the new map then are lost (entries the programs
/// recreate or, for socket reverse NAT, only a UDP reply's source address).
fn recover_interrupted(paths: &PinPaths, name: &str) -> Result<(), DatapathError> {
    let aside = aside_path(paths, name);
    if !aside.try_exists().unwrap_or(false) {
        return Ok(());
    }
    let pin = paths.map(name);
    let replaced = pin.try_exists().unwrap_or(false);
    fs::rename(&aside, &pin).map_err(|e| DatapathError::Pin {
        path: aside.clone(),
        message: format!("putting back a map an interrupted migration moved aside: {e}"),
    })?;
    tracing::warn!(
        map = name,
        pin = %pin.display(),
        replaced_a_new_map = replaced,
        "an earlier start was stopped while migrating this map: the map it moved aside is back under its pin"
    );
    Ok(())
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

/// Copies the entries of the maps moved aside into their new maps (same layout, new capacity),
/// and converts those of [`Migration::converted`].
pub fn copy_entries(migration: &Migration, ebpf: &mut aya::Ebpf) {
    convert_entries(migration, ebpf);
    for (name, from) in &migration.resized {
        let Some(to) = ebpf.map_mut(name) else { continue };
        let result = match name.as_str() {
            catalog::SVC_NAMES => copy_hash::<u32, SvcName>(from, to, false),
            catalog::AFFINITY_MATCH => copy_hash::<AffinityMatchKey, u8>(from, to, false),
            _ => match copy_family::<V4>(name, from, to).or_else(|| copy_family::<V6>(name, from, to)) {
                Some(result) => result,
                None => continue,
            },
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

type Copied = Result<(usize, usize), aya::maps::MapError>;

/// Converts the entries of each map of [`Migration::converted`] into its new map.
fn convert_entries(migration: &Migration, ebpf: &mut aya::Ebpf) {
    for (name, from) in &migration.converted {
        let Some(result) =
            convert_services::<V4>(name, from, ebpf).or_else(|| convert_services::<V6>(name, from, ebpf))
        else {
            continue;
        };
        match result {
            Ok((converted, 0)) => {
                tracing::info!(map = %name, converted, "entries converted to the new layout")
            }
            Ok((converted, skipped)) => tracing::warn!(
                map = %name,
                converted,
                skipped,
                "entries converted to the new layout; slots whose backend is missing are left to the first sync"
            ),
            Err(e) => {
                tracing::error!(map = %name, "converting entries failed (the first sync writes them anew): {e}")
            }
        }
    }
}

/// `lb4_services` (`lb6_services`) layout 1 -> 2, if `name` is family `F`'s: each entry with, in
/// a slot, a copy of its backend's entry from the backends map (a slot whose backend is missing
/// is skipped, counted: the first sync writes it, before the programs that read it are attached).
fn convert_services<F>(name: &str, from: &Path, ebpf: &mut aya::Ebpf) -> Option<Copied>
where
    F: FamilyMaps,
    SvcKey<F>: Pod,
    SvcEntry<F>: Pod,
    BackendValue<F>: Pod,
{
    if name != F::MAPS.services {
        return None;
    }
    Some((|| {
        let backends: std::collections::BTreeMap<u32, BackendValue<F>> = {
            let map = ebpf
                .map(F::MAPS.backends)
                .ok_or(aya::maps::MapError::InvalidName {
                    name: F::MAPS.backends.to_string(),
                })?;
            let map: HashMap<&MapData, u32, BackendValue<F>> = map.try_into()?;
            map.iter().flatten().collect()
        };
        let old: HashMap<MapData, SvcKey<F>, SvcValue> = Map::HashMap(MapData::from_pin(from)?).try_into()?;
        let to = ebpf.map_mut(name).ok_or(aya::maps::MapError::InvalidName {
            name: name.to_string(),
        })?;
        let mut new: HashMap<&mut MapData, SvcKey<F>, SvcEntry<F>> = to.try_into()?;
        let (mut converted, mut skipped) = (0, 0);
        for (key, value) in old.iter().flatten() {
            let backend = match key.slot {
                0 => BackendValue::default(),
                _ => match backends.get(&value.backend_id) {
                    Some(backend) => *backend,
                    None => {
                        skipped += 1;
                        continue;
                    }
                },
            };
            match new.insert(&key, &SvcEntry { value, backend }, 0) {
                Ok(()) => converted += 1,
                Err(_) => skipped += 1,
            }
        }
        Ok((converted, skipped))
    })())
}

/// Copies `name`'s entries if it is one of family `F`'s maps.
fn copy_family<F>(name: &str, from: &Path, to: &mut Map) -> Option<Copied>
where
    F: FamilyMaps,
    SvcKey<F>: Pod,
    SvcEntry<F>: Pod,
    BackendValue<F>: Pod,
    RevNatValue<F>: Pod,
    SockRevNatKey<F>: Pod,
    SockRevNatValue<F>: Pod,
    AffinityKey<F>: Pod,
    CtKey<F>: Pod,
    CtValue<F>: Pod,
    SrcRange<F>: Pod,
    lb_common::cluster_ip::ClusterIpKey<F>: Pod,
{
    let maps = F::MAPS;
    Some(if name == maps.services {
        copy_hash::<SvcKey<F>, SvcEntry<F>>(from, to, false)
    } else if name == maps.backends {
        copy_hash::<u32, BackendValue<F>>(from, to, false)
    } else if name == maps.revnat {
        copy_hash::<u32, RevNatValue<F>>(from, to, false)
    } else if name == maps.sock_revnat {
        copy_hash::<SockRevNatKey<F>, SockRevNatValue<F>>(from, to, true)
    } else if name == maps.affinity {
        copy_hash::<AffinityKey<F>, AffinityValue>(from, to, true)
    } else if name == maps.conntrack || name == maps.conntrack_new {
        copy_hash::<CtKey<F>, CtValue<F>>(from, to, true)
    } else if name == maps.source_ranges {
        copy_lpm::<SrcRange<F>, u8>(from, to)
    } else if name == maps.cluster_ips {
        copy_lpm::<lb_common::cluster_ip::ClusterIpKey<F>, u8>(from, to)
    } else {
        return None;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_pin_names() {
        assert_eq!(pin_name(catalog::SERVICES).to_string(), "lb4_services_v2");
        assert_eq!(pin_name(catalog::BACKENDS).to_string(), "lb4_backends");
        assert!(is_version_of("lb4_services", "lb4_services"));
        assert!(is_version_of("lb4_services_v2", "lb4_services"));
        assert!(!is_version_of("lb4_services-old", "lb4_services"));
        assert!(!is_version_of("lb4_services_vx", "lb4_services"));
        assert!(!is_version_of("lb4_svc", "lb4_services"));
    }

    #[test]
    fn the_config_entry_changed_layout() {
        assert_eq!(pin_name(catalog::CONFIG).to_string(), "lb_config_v2");
        assert!(
            is_version_of("lb_config", catalog::CONFIG),
            "the IPv4-only pin is an older version"
        );
        assert_eq!(pin_name(catalog::SERVICES6).to_string(), "lb6_services_v2");
        assert_eq!(pin_name(catalog::BACKENDS6).to_string(), "lb6_backends");
    }

    #[test]
    fn each_family_has_its_own_layouts() {
        let caps = Capacities::default();
        let v4 = expected(catalog::CONNTRACK, &caps).unwrap();
        let v6 = expected(catalog::CONNTRACK6, &caps).unwrap();
        assert_eq!((v4.key_size, v4.value_size), (16, 32));
        assert_eq!((v6.key_size, v6.value_size), (40, 48));
        assert_eq!(
            expected(catalog::SOURCE_RANGES6, &caps).unwrap().key_size,
            4 + 4 + 16
        );
    }

    #[test]
    fn every_map_has_a_layout_version_and_an_expected_size() {
        for name in catalog::ALL {
            assert!(
                LAYOUTS.iter().any(|(n, _)| n == name),
                "{name} has no layout version"
            );
            let e = expected(name, &Capacities::default())
                .unwrap_or_else(|| panic!("{name} has no expected layout in migrate::expected"));
            assert!(
                e.key_size > 0 && e.value_size > 0 || *name == catalog::EVENTS,
                "{name}"
            );
        }
        assert!(
            expected("lb_not_a_map", &Capacities::default()).is_none(),
            "no catch-all layout"
        );
    }
}
