//! Service lookup and backend selection, shared by the socket programs and the tc programs so both
//! paths make the same decision for the same traffic, in both families.

use lb_common::{
    affinity::{AffinityKey, AffinityMatchKey, AffinityValue},
    backend::BackendValue,
    cluster_ip::ClusterIpKey,
    config::DatapathConfig,
    family::Family,
    maglev, select,
    service::{SCOPE_EXTERNAL, SCOPE_INTERNAL, SrcRange, SvcEntry, SvcKey, SvcValue, flags},
    stats::Counter,
};

use crate::{
    family::{FamilyMaps, insert_used},
    maps::{AFFINITY_MATCH, CONFIG, MAGLEV},
    stats::count,
};

/// What `lb_config` holds before the agent writes it: nothing configured.
static UNCONFIGURED: DatapathConfig = DatapathConfig::UNCONFIGURED;

/// The node-wide settings, read in place (the entry is larger than the stack can spare a copy
/// of in the tc programs).
#[inline(always)]
pub fn datapath_config() -> &'static DatapathConfig {
    CONFIG.get(0).unwrap_or(&UNCONFIGURED)
}

/// A frontend or slot entry, read in place as backends are (see [`lookup_backend`]).
#[inline(always)]
pub fn lookup_service<F: FamilyMaps>(key: &SvcKey<F>) -> Option<&'static SvcEntry<F>> {
    // SAFETY: the services map is not preallocated either.
    F::services().get_ptr(key).map(|p| unsafe { &*p })
}

/// A backend, read in place rather than copied (an IPv6 one would take five registers): the
/// backends map is not preallocated, so an update replaces an element and frees the old one only
/// after every program that may hold it has returned.
#[inline(always)]
pub fn lookup_backend<F: FamilyMaps>(id: u32) -> Option<&'static BackendValue<F>> {
    // SAFETY: see above; the agent never writes an element in place.
    F::backends().get_ptr(&id).map(|p| unsafe { &*p })
}

/// The frontend entry a packet or socket call uses.
pub enum Frontend<F: Family> {
    /// Not a frontend.
    None,
    /// A frontend whose internal scope is missing (written mid-update): leave the traffic alone.
    Incomplete,
    /// The key (at slot 0, of the scope used) and its entry.
    Found(SvcKey<F>, &'static SvcValue),
}

/// Looks up a frontend. `internal` traffic (from this node's sockets, or from pods) uses the
/// cluster-wide scope of a frontend with externalTrafficPolicy=Local (`TWO_SCOPES`), as kube-proxy
/// short-circuits such traffic to the cluster chain.
#[inline(always)]
pub fn lookup_frontend<F: FamilyMaps>(addr: &F::Addr, port: u16, proto: u8, internal: bool) -> Frontend<F> {
    let mut key = SvcKey::<F>::new(*addr, port, proto, SCOPE_EXTERNAL, 0);
    let Some(entry) = lookup_service(&key) else {
        return Frontend::None;
    };
    if internal && entry.value.has(flags::TWO_SCOPES) {
        key.scope = SCOPE_INTERNAL;
        return match lookup_service(&key) {
            Some(internal_entry) => Frontend::Found(key, &internal_entry.value),
            None => Frontend::Incomplete,
        };
    }
    Frontend::Found(key, &entry.value)
}

/// kube-proxy's cluster-ips-check (`lb_common::cluster_ip`) for a new flow no frontend matched:
/// `Some(action::REJECT)` to a cluster IP (on a port no Service has), `Some(action::DROP)` to an
/// address of a Service CIDR that no Service holds, `None` for any other address. Traffic outside
/// the family's few covering prefixes costs one inlined array read, not a trie walk.
#[inline(always)]
pub fn cluster_ip_check<F: FamilyMaps>(daddr: &F::Addr) -> Option<u8> {
    let ranges = F::service_ranges().get(0)?;
    if !ranges.may_contain(daddr) {
        return None;
    }
    let key = aya_ebpf::maps::lpm_trie::Key::new(F::BITS as u32, ClusterIpKey::<F> { addr: *daddr });
    F::cluster_ips().get(&key).copied()
}

/// Whether loadBalancerSourceRanges admit `src` to `frontend`.
#[inline(always)]
pub fn source_in_ranges<F: FamilyMaps>(frontend: &SvcValue, src: &F::Addr) -> bool {
    let key = aya_ebpf::maps::lpm_trie::Key::new(
        SrcRange::<F>::prefix_len(F::BITS),
        SrcRange::<F>::new(frontend.rev_nat_id, *src),
    );
    F::source_ranges().get(&key).is_some()
}

/// Picks a backend for the frontend entry `frontend` at `key` (slot 0 of the scope used):
/// a still-valid ClientIP affinity entry first, else slot `hash % count + 1`, whose copy of the
/// backend's entry saves a lookup of the backends map (a Maglev table or an affinity entry names
/// the backend by id only).
/// `client` identifies the client for affinity (`AffinityKey` without the frontend). The client
/// and the clock are read only for a frontend with affinity: on a connect each is a helper call
/// (the netns cookie, the clock) that costs about what a map lookup does in the real stack.
#[inline(always)]
pub fn select_backend<F: FamilyMaps>(
    key: &SvcKey<F>,
    frontend: &SvcValue,
    client: impl Fn() -> F::Client,
    client_kind: u8,
    hash: u32,
    now_ns: impl Fn() -> u64,
) -> Option<(u32, &'static BackendValue<F>)> {
    let affinity = frontend.has(flags::AFFINITY);
    let (client, now_ns) = if affinity {
        (client(), now_ns())
    } else {
        (F::Client::default(), 0)
    };
    let affinity_key = AffinityKey::<F> {
        client,
        rev_nat_id: frontend.rev_nat_id,
        kind: client_kind,
        _pad: [0; 3],
    };
    if affinity
        && let Some(entry) = F::affinity().get_ptr(&affinity_key).map(|p| unsafe { *p })
        && select::affinity_valid(entry.last_used_ns, now_ns, frontend.affinity_timeout)
        && AFFINITY_MATCH
            .get_ptr(&AffinityMatchKey {
                backend_id: entry.backend_id,
                rev_nat_id: frontend.rev_nat_id,
            })
            .is_some()
        && let Some(backend) = lookup_backend::<F>(entry.backend_id)
    {
        count(Counter::AffinityHit);
        remember_affinity::<F>(&affinity_key, entry.backend_id, now_ns);
        return Some((entry.backend_id, backend));
    }
    let (backend_id, backend) = match maglev_choice(frontend, hash) {
        Some(id) => (id, lookup_backend::<F>(id)?),
        None => {
            let slot = select::slot_for(hash, frontend.count);
            let entry = match lookup_service(&key.with_slot(slot)) {
                Some(entry) => entry,
                // The frontend shrank under us (slots are deleted after the count is lowered):
                // slot 1 exists while count > 0.
                None => lookup_service(&key.with_slot(1))?,
            };
            (entry.value.backend_id, &entry.backend)
        }
    };
    if affinity {
        remember_affinity::<F>(&affinity_key, backend_id, now_ns);
    }
    Some((backend_id, backend))
}

/// The backend id at position `hash % size` of the frontend's Maglev table (`flags::MAGLEV`;
/// `hash` is then the flow's `maglev::flow_hash`). `None` without the flag, or while the agent
/// has not swapped the table in yet: the slots then decide, as for any frontend.
#[inline(always)]
fn maglev_choice(frontend: &SvcValue, hash: u32) -> Option<u32> {
    if !frontend.has(flags::MAGLEV) {
        return None;
    }
    let size = frontend.backend_id;
    if size == 0 || size > maglev::MAX_TABLE_SIZE {
        return None;
    }
    let (chunk, lane) = maglev::position(maglev::index(hash, size));
    // SAFETY: the agent never writes a table in place; it swaps in a new one (the outer map is
    // not preallocated, so an entry read here stays valid until the program returns).
    let chunk = unsafe { MAGLEV.get_value(&frontend.rev_nat_id, &chunk) }?;
    chunk.backend_ids.get(lane).copied()
}

#[inline(always)]
fn remember_affinity<F: FamilyMaps>(key: &AffinityKey<F>, backend_id: u32, now_ns: u64) {
    let value = AffinityValue {
        last_used_ns: now_ns,
        backend_id,
        _pad: 0,
    };
    if insert_used(F::affinity(), key, &value, 0).is_err() {
        count(Counter::AffinityUpdateFailed);
    }
}

/// Mixes a 64-bit value into 32 well-spread bits (socket cookies are counters; flow tuples are
/// structured).
#[inline(always)]
pub fn mix64(value: u64) -> u32 {
    let mixed = value.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (mixed >> 32) as u32
}
