//! Service lookup and backend selection, shared by the socket programs and the tc programs so both
//! paths make the same decision for the same traffic.

use lb_common::{
    affinity::{Affinity4Key, Affinity4Value, AffinityMatchKey},
    backend::Backend4Value,
    config::DatapathConfig,
    select,
    service::{SCOPE_EXTERNAL, SCOPE_INTERNAL, SrcRange4, Svc4Key, Svc4Value, flags},
    stats::Counter,
};

use crate::{
    maps::{AFFINITY, AFFINITY_MATCH, BACKENDS, CONFIG, SERVICES, SOURCE_RANGES},
    stats::count,
};

#[inline(always)]
pub fn datapath_config() -> DatapathConfig {
    match CONFIG.get(0) {
        Some(cfg) => *cfg,
        None => DatapathConfig::default(),
    }
}

#[inline(always)]
pub fn lookup_service(key: &Svc4Key) -> Option<Svc4Value> {
    // Copy out: a hash map reference is only valid until the next update of the map.
    SERVICES.get_ptr(key).map(|p| unsafe { *p })
}

#[inline(always)]
pub fn lookup_backend(id: u32) -> Option<Backend4Value> {
    BACKENDS.get_ptr(&id).map(|p| unsafe { *p })
}

/// The frontend entry a packet or socket call uses.
pub enum Frontend {
    /// Not a frontend.
    None,
    /// A frontend whose internal scope is missing (written mid-update): leave the traffic alone.
    Incomplete,
    /// The key (at slot 0, of the scope used) and its entry.
    Found(Svc4Key, Svc4Value),
}

/// Looks up a frontend. `internal` traffic (from this node's sockets, or from pods) uses the
/// cluster-wide scope of a frontend with externalTrafficPolicy=Local (`TWO_SCOPES`), as kube-proxy
/// short-circuits such traffic to the cluster chain.
#[inline(always)]
pub fn lookup_frontend(addr: [u8; 4], port: u16, proto: u8, internal: bool) -> Frontend {
    let mut key = Svc4Key::new(addr, port, proto, SCOPE_EXTERNAL, 0);
    let Some(entry) = lookup_service(&key) else {
        return Frontend::None;
    };
    if internal && entry.has(flags::TWO_SCOPES) {
        key.scope = SCOPE_INTERNAL;
        return match lookup_service(&key) {
            Some(internal_entry) => Frontend::Found(key, internal_entry),
            None => Frontend::Incomplete,
        };
    }
    Frontend::Found(key, entry)
}

/// Whether loadBalancerSourceRanges admit `src` to `frontend`.
#[inline(always)]
pub fn source_in_ranges(frontend: &Svc4Value, src: [u8; 4]) -> bool {
    let key = aya_ebpf::maps::lpm_trie::Key::new(
        SrcRange4::prefix_len(32),
        SrcRange4::new(frontend.rev_nat_id, src),
    );
    SOURCE_RANGES.get(&key).is_some()
}

/// Picks a backend for the frontend entry `frontend` at `key` (slot 0 of the scope used):
/// a still-valid ClientIP affinity entry first, else slot `hash % count + 1`.
/// `client` identifies the client for affinity (`Affinity4Key` without the frontend).
#[inline(always)]
pub fn select_backend(
    key: &Svc4Key,
    frontend: &Svc4Value,
    client: u64,
    client_kind: u8,
    hash: u32,
    now_ns: u64,
) -> Option<(u32, Backend4Value)> {
    let affinity_key = Affinity4Key {
        client,
        rev_nat_id: frontend.rev_nat_id,
        kind: client_kind,
        _pad: [0; 3],
    };
    let affinity = frontend.has(flags::AFFINITY);
    if affinity
        && let Some(entry) = AFFINITY.get_ptr(&affinity_key).map(|p| unsafe { *p })
        && select::affinity_valid(entry.last_used_ns, now_ns, frontend.affinity_timeout)
        && AFFINITY_MATCH
            .get_ptr(&AffinityMatchKey {
                backend_id: entry.backend_id,
                rev_nat_id: frontend.rev_nat_id,
            })
            .is_some()
        && let Some(backend) = lookup_backend(entry.backend_id)
    {
        count(Counter::AffinityHit);
        remember_affinity(&affinity_key, entry.backend_id, now_ns);
        return Some((entry.backend_id, backend));
    }
    let slot = select::slot_for(hash, frontend.count);
    let slot_entry = match lookup_service(&key.with_slot(slot)) {
        Some(entry) => entry,
        // The frontend shrank under us (slots are deleted after the count is lowered): slot 1
        // exists while count > 0.
        None => lookup_service(&key.with_slot(1))?,
    };
    let backend = lookup_backend(slot_entry.backend_id)?;
    if affinity {
        remember_affinity(&affinity_key, slot_entry.backend_id, now_ns);
    }
    Some((slot_entry.backend_id, backend))
}

#[inline(always)]
fn remember_affinity(key: &Affinity4Key, backend_id: u32, now_ns: u64) {
    let value = Affinity4Value {
        last_used_ns: now_ns,
        backend_id,
        _pad: 0,
    };
    if AFFINITY.insert(key, &value, 0).is_err() {
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
