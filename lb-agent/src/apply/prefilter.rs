//! The tc programs' prefilter bits (`lb_common::prefilter`, maps `lb4_prefilter`/`lb6_prefilter`):
//! which tuples they hold and when a bit may be cleared.
//!
//! A bit is *held* while a frontend (its slot-0 entry), a backend or a family's masquerade address
//! needs it; the map writer ([`super::KernelMaps`]) holds a tuple's bit before it writes the entry
//! that names it, so no packet ever finds an entry whose bit is clear. An entry removed
//! *releases* its bit, which stays set: conntrack entries of live flows may still name the tuple
//! (a deleted Service's established connections keep their backend, as with kube-proxy). Bits are
//! cleared only by [`Prefilter::rebuild`], after a conntrack GC pass: a released bit that no
//! conntrack entry names and that was released well before the pass began. A flow the pass missed
//! was created after it began, by a program that read its frontend or backend then, so the bit it
//! needs was held until after that moment, which is too recent to clear.
//!
//! The programs apply the filter once the agent has held every bit and [`Prefilter::prime`]d
//! them from the conntrack entries left by the previous run (`config::flags::PREFILTER`).
//!
//! [`Bits`] is the pure bookkeeping of one family, [`Prefilter`] the two families with their maps,
//! shared by the map writer and the conntrack GC thread.

use std::{
    collections::{HashMap, HashSet},
    io,
    net::IpAddr,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use aya::maps::{Array, Map, MapData};
use lb_common::{
    catalog,
    family::{In6Addr, V4, V6},
    prefilter::{self, WORDS, word_of},
};

use super::{
    entries::{BackendEntry, ServiceMapKey},
    ops::MapError,
};
use crate::family::IpFamily;

/// How long before a GC pass began a bit must have been released for the pass to clear it. A
/// program holds what it read for microseconds; a second covers any scheduling delay.
pub const RELEASE_GRACE: Duration = Duration::from_secs(1);

/// The bit of a destination address at ingress, in its family.
pub fn ingress_bit(ip: &IpAddr) -> (IpFamily, u32) {
    match ip {
        IpAddr::V4(v4) => (IpFamily::V4, prefilter::ingress_bit::<V4>(&v4.octets())),
        IpAddr::V6(v6) => (IpFamily::V6, prefilter::ingress_bit::<V6>(&In6Addr::from(*v6))),
    }
}

/// The bit of a destination (address, port) at ingress, in its family (the address's bit's
/// line: `lb_common::prefilter::ingress_port_bit`).
pub fn ingress_port_bit(ip: &IpAddr, port: u16) -> (IpFamily, u32) {
    let (family, address) = ingress_bit(ip);
    (family, prefilter::ingress_port_bit(address, port))
}

/// The bit of a backend's (address, port) at egress, in its family.
pub fn egress_bit(ip: &IpAddr, port: u16) -> (IpFamily, u32) {
    match ip {
        IpAddr::V4(v4) => (IpFamily::V4, prefilter::egress_bit::<V4>(&v4.octets(), port)),
        IpAddr::V6(v6) => (
            IpFamily::V6,
            prefilter::egress_bit::<V6>(&In6Addr::from(*v6), port),
        ),
    }
}

/// What holds a bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    /// A frontend's slot-0 entry (either scope): its address at ingress.
    Frontend(ServiceMapKey),
    /// The same entry: its (address, port) at ingress.
    FrontendPort(ServiceMapKey),
    /// A backend id: its (address, port) at egress.
    Backend(IpFamily, u32),
    /// A family's masquerade address (`FamilyConfig::snat_addr`): un-SNAT entries at ingress.
    Masquerade(IpFamily),
    /// An interface's masquerade address (`lb_masq_addrs`): un-SNAT entries at ingress.
    InterfaceAddress(std::net::IpAddr),
}

impl Owner {
    /// The owners and bits of a service entry, if it is a frontend's (slot 0): its address's and
    /// its (address, port)'s.
    pub fn frontend(key: &ServiceMapKey) -> impl Iterator<Item = (Owner, IpFamily, u32)> + use<> {
        let key = *key;
        (key.slot == 0)
            .then(|| {
                let (family, address) = ingress_bit(&key.addr);
                let port = prefilter::ingress_port_bit(address, key.port);
                [
                    (Owner::Frontend(key), family, address),
                    (Owner::FrontendPort(key), family, port),
                ]
            })
            .into_iter()
            .flatten()
    }

    pub fn backend(id: u32, value: &BackendEntry) -> (Owner, IpFamily, u32) {
        let (family, bit) = egress_bit(&value.addr, value.port);
        (Owner::Backend(family, id), family, bit)
    }
}

/// One family's bits: how many owners hold each, when each unheld one was released, and the words
/// as the map holds them.
#[derive(Debug)]
pub struct Bits {
    holds: HashMap<u32, u32>,
    released: HashMap<u32, Instant>,
    words: Vec<u64>,
}

impl Bits {
    /// Bits as `words` (read from the map) hold them; every set bit counts as released at `now`
    /// until an owner holds it, so a rebuild keeps it at least [`RELEASE_GRACE`] and then only if
    /// needed.
    pub fn new(words: Vec<u64>, now: Instant) -> Self {
        let mut words = words;
        words.resize(WORDS as usize, 0);
        let mut released = HashMap::new();
        for (i, word) in words.iter().enumerate() {
            for b in 0..64 {
                if word & (1 << b) != 0 {
                    released.insert((i as u32) << 6 | b, now);
                }
            }
        }
        Bits {
            holds: HashMap::new(),
            released,
            words,
        }
    }

    /// One more owner holds `bit`; the word to write if the bit was clear.
    pub fn hold(&mut self, bit: u32) -> Option<(u32, u64)> {
        *self.holds.entry(bit).or_default() += 1;
        self.released.remove(&bit);
        self.set(bit)
    }

    /// Sets `bit` without an owner (a conntrack entry needs it): released at `now`.
    pub fn note(&mut self, bit: u32, now: Instant) -> Option<(u32, u64)> {
        if !self.holds.contains_key(&bit) {
            self.released.insert(bit, now);
        }
        self.set(bit)
    }

    fn set(&mut self, bit: u32) -> Option<(u32, u64)> {
        let (word, mask) = word_of(bit);
        let w = &mut self.words[word as usize];
        (*w & mask == 0).then(|| {
            *w |= mask;
            (word, *w)
        })
    }

    /// One owner less holds `bit`; the bit stays set.
    pub fn release(&mut self, bit: u32, now: Instant) {
        if let Some(n) = self.holds.get_mut(&bit) {
            *n -= 1;
            if *n == 0 {
                self.holds.remove(&bit);
                self.released.insert(bit, now);
            }
        }
    }

    /// Clears the released bits that no conntrack entry names (`referenced`, read by a pass that
    /// began at `pass_began`) and that were released [`RELEASE_GRACE`] before it; the words to
    /// write. Referenced bits are set (they are already, unless the previous run's state was lost).
    pub fn rebuild(&mut self, referenced: &HashSet<u32>, pass_began: Instant) -> Vec<(u32, u64)> {
        let mut changed: HashMap<u32, u64> = HashMap::new();
        // A referenced bit no owner has held since it was last cleared (or since start-up) can
        // get no new flow: the next pass that finds no entry naming it may clear it.
        let unowned_since = pass_began.checked_sub(RELEASE_GRACE).unwrap_or(pass_began);
        for &bit in referenced {
            if !self.holds.contains_key(&bit) {
                self.released.entry(bit).or_insert(unowned_since);
            }
            if let Some((word, value)) = self.set(bit) {
                changed.insert(word, value);
            }
        }
        let stale: Vec<u32> = self
            .released
            .iter()
            .filter(|(bit, at)| !referenced.contains(bit) && **at + RELEASE_GRACE <= pass_began)
            .map(|(bit, _)| *bit)
            .collect();
        for bit in stale {
            self.released.remove(&bit);
            let (word, mask) = word_of(bit);
            let w = &mut self.words[word as usize];
            *w &= !mask;
            changed.insert(word, *w);
        }
        let mut changed: Vec<(u32, u64)> = changed.into_iter().collect();
        changed.sort_unstable();
        changed
    }

    pub fn is_set(&self, bit: u32) -> bool {
        let (word, mask) = word_of(bit);
        self.words[word as usize] & mask != 0
    }

    /// Set bits, held or not.
    pub fn count_set(&self) -> u32 {
        self.words.iter().map(|w| w.count_ones()).sum()
    }
}

/// A family's prefilter map, with a second descriptor for batch writes.
struct FamilyMap {
    map: Array<MapData, u64>,
    batch_fd: OwnedFd,
}

/// Which bit each owner holds. One entry per backend and frontend at 10,000 Services is 120,000
/// owners: stored as a map of [`Owner`]s (a 40-byte entry each, 262,144 buckets) this was 10 MiB
/// of the agent's heap, so each kind of owner is keyed by what it needs (a backend id, a
/// frontend's key for both of its bits).
#[derive(Debug, Default)]
struct Owners {
    /// Backend ids' egress bits, by family.
    backends: [HashMap<u32, u32>; 2],
    /// Frontend entries' bits: the address's ([`Owner::Frontend`]) and the (address, port)'s
    /// ([`Owner::FrontendPort`]), [`NO_BIT`] where that owner holds none.
    frontends: HashMap<ServiceMapKey, [u32; 2]>,
    /// The few masquerade addresses.
    addresses: HashMap<Owner, (IpFamily, u32)>,
}

/// A frontend's owner that holds no bit (a bit is below `WORDS * 64`).
const NO_BIT: u32 = u32::MAX;

impl Owners {
    fn get(&self, owner: &Owner) -> Option<(IpFamily, u32)> {
        match owner {
            Owner::Backend(family, id) => self.backends[index(*family)].get(id).map(|bit| (*family, *bit)),
            Owner::Frontend(key) | Owner::FrontendPort(key) => {
                let bit = self.frontends.get(key)?[Self::frontend_half(owner)];
                (bit != NO_BIT).then(|| (IpFamily::of(&key.addr), bit))
            }
            Owner::Masquerade(_) | Owner::InterfaceAddress(_) => self.addresses.get(owner).copied(),
        }
    }

    fn frontend_half(owner: &Owner) -> usize {
        usize::from(matches!(owner, Owner::FrontendPort(_)))
    }

    /// Records `owner`'s bit; what it held before.
    fn insert(&mut self, owner: Owner, family: IpFamily, bit: u32) -> Option<(IpFamily, u32)> {
        match owner {
            Owner::Backend(f, id) => self.backends[index(f)].insert(id, bit).map(|old| (f, old)),
            Owner::Frontend(key) | Owner::FrontendPort(key) => {
                let bits = self.frontends.entry(key).or_insert([NO_BIT; 2]);
                let old = std::mem::replace(&mut bits[Self::frontend_half(&owner)], bit);
                (old != NO_BIT).then(|| (IpFamily::of(&key.addr), old))
            }
            Owner::Masquerade(_) | Owner::InterfaceAddress(_) => self.addresses.insert(owner, (family, bit)),
        }
    }

    /// Forgets `owner`; the bit it held.
    fn remove(&mut self, owner: &Owner) -> Option<(IpFamily, u32)> {
        match owner {
            Owner::Backend(family, id) => self.backends[index(*family)].remove(id).map(|bit| (*family, bit)),
            Owner::Frontend(key) | Owner::FrontendPort(key) => {
                let bits = self.frontends.get_mut(key)?;
                let old = std::mem::replace(&mut bits[Self::frontend_half(owner)], NO_BIT);
                if bits == &[NO_BIT; 2] {
                    self.frontends.remove(key);
                }
                (old != NO_BIT).then(|| (IpFamily::of(&key.addr), old))
            }
            Owner::Masquerade(_) | Owner::InterfaceAddress(_) => self.addresses.remove(owner),
        }
    }
}

struct Inner {
    bits: [Bits; 2],
    owners: Owners,
    /// None for a writer without maps (the CLI's read-only handles never write).
    maps: Option<[FamilyMap; 2]>,
    batch_supported: bool,
    /// Every bit is held or primed: the programs may filter.
    ready: bool,
}

/// One write per word: bits set one after another return the word each time, the last value
/// having them all.
fn latest_per_word(mut words: Vec<(u32, u64)>) -> Vec<(u32, u64)> {
    words.reverse();
    // Stable: of one word's values, the last set comes first after the reverse.
    words.sort_by_key(|(i, _)| *i);
    words.dedup_by_key(|(i, _)| *i);
    words
}

fn index(family: IpFamily) -> usize {
    match family {
        IpFamily::V4 => 0,
        IpFamily::V6 => 1,
    }
}

fn map_name(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => catalog::PREFILTER,
        IpFamily::V6 => catalog::PREFILTER6,
    }
}

impl Inner {
    fn write(&mut self, family: IpFamily, words: &[(u32, u64)]) -> Result<(), MapError> {
        let Some(maps) = self.maps.as_mut() else {
            return Ok(());
        };
        let m = &mut maps[index(family)];
        let name = map_name(family);
        super::kernel::write_batch(
            m.batch_fd.as_raw_fd(),
            &mut self.batch_supported,
            words,
            |i, w| {
                m.map
                    .set(*i, w, 0)
                    .map_err(|e| MapError::new(name, "update", super::kernel::io_err(e)))
            },
        )
        .map_err(|e| e.error)
    }

    /// Holds each owner's bit (an owner whose bit changed releases its old one afterwards); the
    /// owners that held nothing before.
    fn hold_all(
        &mut self,
        items: impl IntoIterator<Item = (Owner, IpFamily, u32)>,
    ) -> Result<Vec<Owner>, MapError> {
        let now = Instant::now();
        let mut changed: [Vec<(u32, u64)>; 2] = Default::default();
        let mut superseded = Vec::new();
        let mut fresh = Vec::new();
        for (owner, family, bit) in items {
            match self.owners.insert(owner, family, bit) {
                Some(old) if old == (family, bit) => continue,
                Some(old) => superseded.push(old),
                None => fresh.push(owner),
            }
            if let Some(word) = self.bits[index(family)].hold(bit) {
                changed[index(family)].push(word);
            }
        }
        for family in IpFamily::ALL {
            let words = latest_per_word(std::mem::take(&mut changed[index(family)]));
            if !words.is_empty() {
                self.write(family, &words)?;
            }
        }
        for (family, bit) in superseded {
            self.bits[index(family)].release(bit, now);
        }
        Ok(fresh)
    }

    fn release(&mut self, owner: &Owner) {
        if let Some((family, bit)) = self.owners.remove(owner) {
            self.bits[index(family)].release(bit, Instant::now());
        }
    }
}

/// Both families' bits and maps; clones share them (the map writer and the conntrack GC).
#[derive(Clone)]
pub struct Prefilter(Arc<Mutex<Inner>>);

/// Conntrack-referenced bits of both families, read by a GC pass (`datapath::conntrack`).
#[derive(Debug, Default)]
pub struct Referenced {
    pub v4: HashSet<u32>,
    pub v6: HashSet<u32>,
    /// When the pass began reading the maps.
    pub began: Option<Instant>,
}

/// A prefilter map as an array, with a second descriptor for batch calls, and its words: one
/// syscall for the whole array where the kernel can (5.6+), else one per word (16,384).
fn open_words(map: Map) -> Result<(FamilyMap, Vec<u64>), aya::maps::MapError> {
    let batch_fd = match &map {
        Map::Array(data) => data.fd().as_fd().try_clone_to_owned()?,
        _ => return Err(aya::maps::MapError::IoError(io::Error::other("not an array"))),
    };
    let map: Array<MapData, u64> = map.try_into()?;
    let words = super::kernel::lookup_array_batch(batch_fd.as_raw_fd(), WORDS)
        .unwrap_or_else(|| (0..WORDS).map(|i| map.get(&i, 0).unwrap_or(0)).collect());
    Ok((FamilyMap { map, batch_fd }, words))
}

/// The bits set in each family's prefilter map (IPv4, IPv6), read without taking them over (the
/// CLI's view of a running agent's maps).
pub fn bits_set_in(maps: [Map; 2]) -> Result<[u32; 2], aya::maps::MapError> {
    let count = |map: Map| -> Result<u32, aya::maps::MapError> {
        let (_, words) = open_words(map)?;
        Ok(words.iter().map(|w| w.count_ones()).sum())
    };
    let [v4, v6] = maps;
    Ok([count(v4)?, count(v6)?])
}

impl Prefilter {
    /// Over a family's maps (their current words read back), or over none (`maps` None).
    pub fn new(maps: Option<[Map; 2]>) -> Result<Self, aya::maps::MapError> {
        let now = Instant::now();
        let (bits, maps) = match maps {
            Some([v4, v6]) => {
                let open = |map: Map| -> Result<(FamilyMap, Bits), aya::maps::MapError> {
                    let (map, words) = open_words(map)?;
                    Ok((map, Bits::new(words, now)))
                };
                let (m4, b4) = open(v4)?;
                let (m6, b6) = open(v6)?;
                ([b4, b6], Some([m4, m6]))
            }
            None => ([Bits::new(Vec::new(), now), Bits::new(Vec::new(), now)], None),
        };
        Ok(Prefilter(Arc::new(Mutex::new(Inner {
            bits,
            owners: Owners::default(),
            maps,
            batch_supported: true,
            ready: false,
        }))))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere left the bookkeeping as it was: still true to the map.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds the bits of `items` (before the entries naming them are written); the owners that
    /// held nothing before, for [`Self::release_unwritten`].
    pub fn hold_all(
        &self,
        items: impl IntoIterator<Item = (Owner, IpFamily, u32)>,
    ) -> Result<Vec<Owner>, MapError> {
        self.lock().hold_all(items)
    }

    /// After a batch write that stopped early: of the owners `fresh` (what [`Self::hold_all`]
    /// returned for it), those in `unwritten` held their bits for entries that never reached the
    /// map, and no delete will ever release them (the writer deletes what it wrote). Owners that
    /// held their bit before the batch keep it: their entry is still in the map.
    pub fn release_unwritten(&self, fresh: &[Owner], unwritten: impl IntoIterator<Item = Owner>) {
        if fresh.is_empty() {
            return;
        }
        let fresh: HashSet<&Owner> = fresh.iter().collect();
        let mut inner = self.lock();
        for owner in unwritten {
            if fresh.contains(&owner) {
                inner.release(&owner);
            }
        }
    }

    /// Whether `owner` holds a bit.
    pub fn holds(&self, owner: &Owner) -> bool {
        self.lock().owners.get(owner).is_some()
    }

    /// `owner` no longer needs its bit (after its entry is gone).
    pub fn release(&self, owner: &Owner) {
        self.lock().release(owner)
    }

    /// Releases the bit of every interface masquerade address but those in `keep`.
    pub fn release_all_but(&self, keep: &std::collections::BTreeSet<std::net::IpAddr>) {
        let mut inner = self.lock();
        let gone: Vec<Owner> = inner
            .owners
            .addresses
            .keys()
            .filter(|o| matches!(o, Owner::InterfaceAddress(ip) if !keep.contains(ip)))
            .copied()
            .collect();
        for owner in gone {
            inner.release(&owner);
        }
    }

    /// Sets the bits the conntrack entries of `referenced` need (start-up: the flows of the
    /// previous run), then lets the programs filter.
    pub fn prime(&self, referenced: &Referenced) -> Result<(), MapError> {
        let mut inner = self.lock();
        let now = Instant::now();
        for (family, bits) in [(IpFamily::V4, &referenced.v4), (IpFamily::V6, &referenced.v6)] {
            let b = &mut inner.bits[index(family)];
            let words = latest_per_word(bits.iter().filter_map(|bit| b.note(*bit, now)).collect());
            if !words.is_empty() {
                inner.write(family, &words)?;
            }
        }
        inner.ready = true;
        Ok(())
    }

    /// Whether `bit` of `family` is set (in the map, as the agent last wrote it).
    pub fn is_set(&self, family: IpFamily, bit: u32) -> bool {
        self.lock().bits[index(family)].is_set(bit)
    }

    /// Whether [`Self::prime`] ran: the `lb_config` entry may carry `flags::PREFILTER`.
    pub fn is_ready(&self) -> bool {
        self.lock().ready
    }

    /// Clears what no owner and no conntrack entry needs any longer (after a GC pass).
    pub fn rebuild(&self, referenced: &Referenced) -> Result<RebuildReport, MapError> {
        let Some(began) = referenced.began else {
            return Ok(RebuildReport::default());
        };
        let mut inner = self.lock();
        let mut report = RebuildReport::default();
        for (family, bits) in [(IpFamily::V4, &referenced.v4), (IpFamily::V6, &referenced.v6)] {
            let words = inner.bits[index(family)].rebuild(bits, began);
            report.words_written += words.len();
            if !words.is_empty() {
                inner.write(family, &words)?;
            }
            report.bits_set[index(family)] = inner.bits[index(family)].count_set();
        }
        Ok(report)
    }
}

/// What a rebuild did.
#[derive(Debug, Default)]
pub struct RebuildReport {
    pub words_written: usize,
    /// Bits set afterwards, IPv4 then IPv6 (of 2^`BITS_LOG2` each).
    pub bits_set: [u32; 2],
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    const BIT: u32 = 4242;

    #[test]
    fn a_held_bit_is_set_once_and_survives_its_release() {
        let t0 = Instant::now();
        let mut b = Bits::new(Vec::new(), t0);
        assert_eq!(b.hold(BIT), Some((BIT >> 6, 1 << (BIT & 63))));
        assert_eq!(b.hold(BIT), None, "already set: nothing to write");
        b.release(BIT, t0);
        b.release(BIT, t0);
        assert!(b.is_set(BIT), "a release never clears");
    }

    #[test]
    fn a_rebuild_clears_only_bits_released_well_before_the_pass_and_unreferenced() {
        let t0 = Instant::now();
        let mut b = Bits::new(Vec::new(), t0);
        let (held, old, recent, in_flow) = (1, 100, 200, 300);
        for bit in [held, old, recent, in_flow] {
            b.hold(bit);
        }
        b.release(old, t0);
        b.release(in_flow, t0);
        let pass = t0 + RELEASE_GRACE + Duration::from_millis(1);
        b.release(recent, pass - Duration::from_millis(10));
        let referenced: HashSet<u32> = [in_flow].into();
        let words = b.rebuild(&referenced, pass);
        assert!(b.is_set(held));
        assert!(!b.is_set(old), "released before the pass, no flow names it");
        assert!(
            b.is_set(recent),
            "released too recently: a flow may be on its way"
        );
        assert!(b.is_set(in_flow), "a live flow names it");
        // Only `old`'s word changed (bit 100 is alone in word 1).
        assert_eq!(words, vec![(old >> 6, 0)]);
        // The next pass, later, with the flow gone: `recent` and `in_flow` go too.
        let later = pass + RELEASE_GRACE;
        b.rebuild(&HashSet::new(), later);
        assert!(!b.is_set(recent) && !b.is_set(in_flow) && b.is_set(held));
    }

    #[test]
    fn a_bit_set_only_for_a_flow_goes_with_the_flow() {
        let t0 = Instant::now();
        let mut b = Bits::new(Vec::new(), t0);
        b.rebuild(&[7].into(), t0);
        assert!(b.is_set(7));
        b.rebuild(&HashSet::new(), t0 + Duration::from_millis(1));
        assert!(
            !b.is_set(7),
            "no owner held it: nothing can have started a flow since the pass"
        );
    }

    #[test]
    fn bits_found_in_the_map_are_kept_for_a_grace_then_cleared_unless_held() {
        let t0 = Instant::now();
        let mut words = vec![0u64; WORDS as usize];
        words[0] = 0b110;
        let mut b = Bits::new(words, t0);
        assert!(b.is_set(1) && b.is_set(2));
        b.hold(2);
        assert!(b.rebuild(&HashSet::new(), t0).is_empty(), "within the grace");
        b.rebuild(&HashSet::new(), t0 + RELEASE_GRACE);
        assert!(!b.is_set(1) && b.is_set(2));
    }

    /// One backend address on two ports.
    fn two_tuples_of_one_backend() -> (BackendEntry, BackendEntry) {
        let a = BackendEntry {
            addr: IpAddr::V4(Ipv4Addr::new(10, 244, 1, 5)),
            port: 8080,
            proto: 6,
            flags: 0,
        };
        (a, BackendEntry { port: 9090, ..a })
    }

    #[test]
    fn an_owner_moving_to_another_tuple_holds_the_new_bit_and_releases_the_old() {
        let p = Prefilter::new(None).unwrap();
        let (a, b) = two_tuples_of_one_backend();
        p.hold_all([Owner::backend(7, &a)]).unwrap();
        p.hold_all([Owner::backend(7, &b)]).unwrap();
        let (_, _, bit_a) = Owner::backend(7, &a);
        let (_, _, bit_b) = Owner::backend(7, &b);
        let inner = p.lock();
        let bits = &inner.bits[0];
        assert!(bits.is_set(bit_a) && bits.is_set(bit_b));
        assert!(!bits.holds.contains_key(&bit_a) && bits.holds[&bit_b] == 1);
        assert!(bits.released.contains_key(&bit_a));
    }

    /// A batch write that stopped early left the owners of the entries it never wrote holding
    /// their bits for good: the writer only deletes what it wrote, so nothing released them.
    #[test]
    fn owners_of_entries_a_failed_batch_never_wrote_give_their_bits_back() {
        let p = Prefilter::new(None).unwrap();
        let (a, b) = two_tuples_of_one_backend();
        let (owner_a, owner_b) = (Owner::backend(7, &a).0, Owner::backend(8, &b).0);
        p.hold_all([Owner::backend(7, &a)]).unwrap();
        let fresh = p
            .hold_all([Owner::backend(7, &a), Owner::backend(8, &b)])
            .unwrap();
        assert_eq!(fresh, vec![owner_b], "7 held its bit before this batch");
        // The batch wrote neither: 7's entry from before is still in the map, 8's never was.
        p.release_unwritten(&fresh, [owner_a, owner_b]);
        assert!(p.holds(&owner_a));
        assert!(!p.holds(&owner_b));
        let (_, _, bit_b) = Owner::backend(8, &b);
        assert!(
            p.lock().bits[0].released.contains_key(&bit_b),
            "cleared after the grace"
        );
    }

    /// A frontend's two owners share one record keyed by its entry: each is held and released on
    /// its own, and the record goes with the last.
    #[test]
    fn a_frontends_address_and_port_owners_are_held_and_released_apart() {
        let p = Prefilter::new(None).unwrap();
        let key = ServiceMapKey::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)), 80, 6, 0, 0);
        let owners: Vec<_> = Owner::frontend(&key).collect();
        let [(address, _, address_bit), (port, _, port_bit)] = owners[..] else {
            panic!("a frontend entry has two owners: {owners:?}");
        };
        assert_eq!(p.hold_all(owners.clone()).unwrap(), vec![address, port]);
        assert!(p.hold_all(owners).unwrap().is_empty(), "held already");
        assert_eq!(p.lock().bits[0].holds[&port_bit], 1, "held once");
        p.release(&port);
        assert!(p.holds(&address) && !p.holds(&port));
        assert!(p.lock().bits[0].released.contains_key(&port_bit));
        p.release(&address);
        assert!(!p.holds(&address));
        assert!(p.lock().bits[0].released.contains_key(&address_bit));
        assert!(p.lock().owners.frontends.is_empty());
    }

    #[test]
    fn one_write_per_word_with_its_last_value() {
        let words = latest_per_word(vec![(3, 0b1), (1, 0b10), (3, 0b11), (3, 0b111)]);
        assert_eq!(words, vec![(1, 0b10), (3, 0b111)]);
    }

    #[test]
    fn primed_conntrack_bits_count_as_released_until_held() {
        let p = Prefilter::new(None).unwrap();
        assert!(!p.is_ready());
        let referenced = Referenced {
            v4: [9].into(),
            ..Default::default()
        };
        p.prime(&referenced).unwrap();
        assert!(p.is_ready());
        let inner = p.lock();
        assert!(inner.bits[0].is_set(9) && inner.bits[0].released.contains_key(&9));
    }
}
