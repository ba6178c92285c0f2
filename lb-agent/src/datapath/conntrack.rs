//! Conntrack GC: frees the tc path's NAT entries (`lb4_ct`) of flows that ended, and with them
//! their masquerade ports.
//!
//! `lb4_ct` is an LRU map, but LRU eviction starts only when the map is full, and a masqueraded
//! flow reserves its port with its un-SNAT entry: left alone, the entries of closed connections
//! would hold every port of the SNAT range towards a busy backend (10,000 connections), after
//! which new NodePort connections to it are dropped (`tc_snat_ports_exhausted`). netfilter frees
//! these with its TCP state machine (TIME_WAIT 120 s) and UDP timeouts; Cilium with its CT GC
//! (`--bpf-ct-timeout-regular-tcp-fin` 10 s, `--bpf-ct-timeout-regular-any` 60 s).
//!
//! The programs mark TCP closes on the entry a FIN or RST passes (`flags::CLOSE_MARKS`, with the
//! time in `last_seen_ns`) and keep `last_seen_ns` fresh for UDP. A pass here groups the entries
//! by flow (all entries of a flow share `created_ns`) and deletes:
//! - a TCP flow reset, or closed by both sides, `tcp_fin_timeout` ago;
//! - a UDP flow idle for `udp_timeout`;
//! - an entry no forward entry claims (its flow was replaced by a new connection on the same
//!   client tuple, or LRU-evicted) once `orphan_grace` old (a flow being created right now has
//!   its companions in place a moment before its forward entry).
//!
//! TCP flows never closed (a peer that vanished) stay until LRU eviction: the programs do not
//! write per packet, so there is no idle clock for TCP.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use aya::maps::MapData;
use lb_common::conntrack::{Ct4Key, Ct4Value, dir, flags};

/// Timeouts of a GC pass.
#[derive(Clone, Copy, Debug)]
pub struct GcTimeouts {
    pub tcp_fin_timeout: Duration,
    pub udp_timeout: Duration,
    pub orphan_grace: Duration,
}

impl Default for GcTimeouts {
    fn default() -> Self {
        Self {
            tcp_fin_timeout: Duration::from_secs(10),
            udp_timeout: Duration::from_secs(60),
            orphan_grace: Duration::from_secs(30),
        }
    }
}

/// Why an entry goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    Closed,
    Idle,
    Orphan,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::Closed => "closed",
            Reason::Idle => "idle",
            Reason::Orphan => "orphan",
        }
    }
}

/// One entry to delete: deleted only if it still has this `created_ns` (a new flow may have
/// taken the key since the scan).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Doomed {
    pub key: Ct4Key,
    pub created_ns: u64,
    pub reason: Reason,
}

/// The key of the entry for packets `saddr:sport -> daddr:dport` in direction `d`.
fn tuple_key(saddr: [u8; 4], sport: u16, daddr: [u8; 4], dport: u16, proto: u8, d: u8) -> Ct4Key {
    Ct4Key {
        saddr,
        daddr,
        sport,
        dport,
        proto,
        dir: d,
        _pad: [0; 2],
    }
}

/// The keys of a flow's companion entries, derived from its forward (DNAT) entry.
fn companions(fwd_key: &Ct4Key, fwd: &Ct4Value, entries: &HashMap<Ct4Key, Ct4Value>) -> Vec<Ct4Key> {
    let same_flow = |k: &Ct4Key| entries.get(k).is_some_and(|v| v.created_ns == fwd.created_ns);
    let mut out = Vec::with_capacity(2);
    if fwd.flags & flags::SNAT != 0 {
        // SNAT: client -> backend (egress); un-SNAT: backend -> node IP:port (ingress).
        let snat_key = tuple_key(
            fwd_key.saddr,
            fwd_key.sport,
            fwd.nat_addr,
            fwd.nat_port,
            fwd_key.proto,
            dir::EGRESS,
        );
        if same_flow(&snat_key) {
            let snat = entries[&snat_key];
            out.push(snat_key);
            let unsnat_key = tuple_key(
                fwd.nat_addr,
                fwd.nat_port,
                snat.nat_addr,
                snat.nat_port,
                fwd_key.proto,
                dir::INGRESS,
            );
            if same_flow(&unsnat_key) {
                out.push(unsnat_key);
            }
        }
    } else {
        // un-DNAT: backend -> client (egress).
        let undnat_key = tuple_key(
            fwd.nat_addr,
            fwd.nat_port,
            fwd_key.saddr,
            fwd_key.sport,
            fwd_key.proto,
            dir::EGRESS,
        );
        if same_flow(&undnat_key) {
            out.push(undnat_key);
        }
    }
    out
}

/// Where a TCP flow is in its close, from the close marks of all its entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowState {
    Open,
    /// A FIN one way.
    Closing,
    /// FINs both ways.
    Closed,
    Reset,
}

impl FlowState {
    fn from_marks(marks: u16) -> Self {
        let fins = marks & (flags::FIN_FORWARD | flags::FIN_REPLY);
        if marks & flags::RESET != 0 {
            FlowState::Reset
        } else if fins == flags::FIN_FORWARD | flags::FIN_REPLY {
            FlowState::Closed
        } else if fins != 0 {
            FlowState::Closing
        } else {
            FlowState::Open
        }
    }

    /// Ended: the GC frees the flow once its last close mark is `tcp_fin_timeout` old.
    fn ended(self) -> bool {
        matches!(self, FlowState::Closed | FlowState::Reset)
    }

    pub fn label(self) -> &'static str {
        match self {
            FlowState::Open => "open",
            FlowState::Closing => "closing",
            FlowState::Closed => "closed",
            FlowState::Reset => "reset",
        }
    }
}

/// A forward entry's flow state, as `lb-agent conntrack` shows it.
pub fn flow_state(fwd_key: &Ct4Key, fwd: &Ct4Value, entries: &HashMap<Ct4Key, Ct4Value>) -> FlowState {
    let marks = companions(fwd_key, fwd, entries)
        .iter()
        .fold(fwd.flags, |m, k| m | entries[k].flags);
    FlowState::from_marks(marks)
}

pub fn is_forward(key: &Ct4Key, value: &Ct4Value) -> bool {
    key.dir == dir::INGRESS && value.flags & flags::REPLY == 0
}

/// What a pass deletes from `entries` at `now_ns` (the programs' clock, CLOCK_MONOTONIC).
pub fn plan(entries: &HashMap<Ct4Key, Ct4Value>, now_ns: u64, t: &GcTimeouts) -> Vec<Doomed> {
    let older_than = |stamp: u64, d: Duration| now_ns.saturating_sub(stamp) >= d.as_nanos() as u64;
    let mut claimed: HashSet<Ct4Key> = HashSet::new();
    let mut doomed = Vec::new();
    for (key, fwd) in entries.iter().filter(|(k, v)| is_forward(k, v)) {
        let flow = companions(key, fwd, entries);
        claimed.extend(flow.iter().copied());
        let members = || std::iter::once((key, fwd)).chain(flow.iter().map(|k| (k, &entries[k])));
        let reason = match key.proto {
            lb_common::proto::TCP => {
                let marks = members().fold(0, |m, (_, v)| m | v.flags);
                let closed = FlowState::from_marks(marks).ended();
                // The last close mark: a flow half-closed long ago and closed now waits again.
                let closed_at = members()
                    .filter(|(_, v)| v.flags & flags::CLOSE_MARKS != 0)
                    .map(|(_, v)| v.last_seen_ns)
                    .max()
                    .unwrap_or(0);
                (closed && older_than(closed_at, t.tcp_fin_timeout)).then_some(Reason::Closed)
            }
            lb_common::proto::UDP => {
                let seen = members().map(|(_, v)| v.last_seen_ns).max().unwrap_or(0);
                older_than(seen, t.udp_timeout).then_some(Reason::Idle)
            }
            _ => None,
        };
        if let Some(reason) = reason {
            doomed.extend(members().map(|(k, v)| Doomed {
                key: *k,
                created_ns: v.created_ns,
                reason,
            }));
        }
    }
    doomed.extend(
        entries
            .iter()
            .filter(|(k, v)| !is_forward(k, v) && !claimed.contains(k))
            .filter(|(_, v)| older_than(v.created_ns, t.orphan_grace))
            .map(|(k, v)| Doomed {
                key: *k,
                created_ns: v.created_ns,
                reason: Reason::Orphan,
            }),
    );
    doomed
}

/// What one pass did.
#[derive(Debug, Default)]
pub struct GcReport {
    pub scanned: usize,
    /// Deleted entries by reason.
    pub deleted: Vec<(Reason, u64)>,
    pub took: Duration,
}

/// One pass over the kernel map: scan, plan, delete what still is what was planned.
pub fn collect<T>(
    map: &mut aya::maps::HashMap<T, Ct4Key, Ct4Value>,
    now_ns: u64,
    t: &GcTimeouts,
) -> Result<GcReport, aya::maps::MapError>
where
    T: std::borrow::BorrowMut<MapData>,
{
    let started = Instant::now();
    let mut entries = HashMap::new();
    for item in map.iter() {
        match item {
            Ok((k, v)) => {
                entries.insert(k, v);
            }
            // Deleted by the programs (or LRU) between the key walk and the lookup.
            Err(aya::maps::MapError::KeyNotFound) => {}
            Err(e) => return Err(e),
        }
    }
    let mut deleted: std::collections::BTreeMap<Reason, u64> = Default::default();
    for d in plan(&entries, now_ns, t) {
        let still = map.get(&d.key, 0).is_ok_and(|v| v.created_ns == d.created_ns);
        if still && map.remove(&d.key).is_ok() {
            *deleted.entry(d.reason).or_default() += 1;
        }
    }
    Ok(GcReport {
        scanned: entries.len(),
        deleted: deleted.into_iter().collect(),
        took: started.elapsed(),
    })
}

#[cfg(test)]
mod tests;
