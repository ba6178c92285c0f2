//! Conntrack GC: frees the tc path's NAT entries (`lb4_ct`, `lb6_ct`: the same code over
//! `F: Family`; and the new flows' tables `lb4_ct_new`, `lb6_ct_new`, each collected on its own,
//! since a flow's entries are all in one table) of flows that ended, and with them their
//! masquerade ports.
//!
//! The conntrack maps are LRU maps, but LRU eviction starts only when the map is full, and a masqueraded
//! flow reserves its port with its un-SNAT entry: left alone, the entries of closed connections
//! would hold every port of the SNAT range towards a busy backend (10,000 connections), after
//! which new NodePort connections to it are dropped (`tc_snat_ports_exhausted`). netfilter frees
//! these with its TCP state machine (TIME_WAIT 120 s) and UDP timeouts; Cilium with its CT GC
//! (`--bpf-ct-timeout-regular-tcp-fin` 10 s, `--bpf-ct-timeout-regular-any` 60 s).
//!
//! The programs mark TCP closes on the entry a FIN or RST passes (`flags::CLOSE_MARKS`, with the
//! time in `last_seen_ns`) and keep `last_seen_ns` fresh for UDP and SCTP. A pass here groups the entries
//! by flow (all entries of a flow share `created_ns`) and deletes:
//! - a TCP flow reset, or closed by both sides, `tcp_fin_timeout` ago;
//! - a TCP flow whose handshake never completed (no `ESTABLISHED`: the client never sent a
//!   packet past its SYN) `tcp_syn_timeout` after it began: a spoofed SYN's, in a flood, which
//!   would otherwise hold its masquerade port and its entries until LRU eviction (netfilter
//!   frees these after 60-120 s: `nf_conntrack_tcp_timeout_syn_recv`, `_syn_sent`; Cilium's
//!   `--bpf-ct-timeout-regular-tcp-syn` is 60 s);
//! - a UDP or SCTP flow idle for `udp_timeout`;
//! - an entry no forward entry claims (its flow was replaced by a new connection on the same
//!   client tuple, or LRU-evicted) once `orphan_grace` old (a flow being created right now has
//!   its companions in place a moment before its forward entry).
//!
//! Established TCP flows never closed (a peer that vanished) stay until LRU eviction: the programs
//! do not write per packet, so there is no idle clock for TCP. Flows created by an earlier
//! release's programs (no `HANDSHAKE_TRACKED`) are never taken for unfinished handshakes.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use aya::{Pod, maps::MapData};

use super::ct_filter::{CtFilters, FlowBuckets, Tracked};
use crate::apply::prefilter::Referenced;
use lb_common::{
    conntrack::{CtKey, CtValue, dir, flags},
    family::{Family, V4, V6},
};

/// Timeouts of a GC pass.
#[derive(Clone, Copy, Debug)]
pub struct GcTimeouts {
    pub tcp_fin_timeout: Duration,
    pub tcp_syn_timeout: Duration,
    pub udp_timeout: Duration,
    pub orphan_grace: Duration,
}

impl Default for GcTimeouts {
    fn default() -> Self {
        Self {
            tcp_fin_timeout: Duration::from_secs(10),
            tcp_syn_timeout: Duration::from_secs(60),
            udp_timeout: Duration::from_secs(60),
            orphan_grace: Duration::from_secs(30),
        }
    }
}

/// Why an entry goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    Closed,
    /// A TCP handshake that never completed.
    Unanswered,
    Idle,
    Orphan,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::Closed => "closed",
            Reason::Unanswered => "handshake",
            Reason::Idle => "idle",
            Reason::Orphan => "orphan",
        }
    }
}

/// One entry to delete: deleted only if it still has this `created_ns` (a new flow may have
/// taken the key since the scan).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Doomed<F: Family> {
    pub key: CtKey<F>,
    pub created_ns: u64,
    pub reason: Reason,
}

/// The key of the entry for packets `saddr:sport -> daddr:dport` in direction `d`.
fn tuple_key<F: Family>(
    saddr: F::Addr,
    sport: u16,
    daddr: F::Addr,
    dport: u16,
    proto: u8,
    d: u8,
) -> CtKey<F> {
    CtKey {
        saddr,
        daddr,
        sport,
        dport,
        proto,
        dir: d,
        tag: 0,
    }
}

/// The keys of a flow's companion entries, derived from its forward (DNAT) entry.
fn companions<F: Family>(
    fwd_key: &CtKey<F>,
    fwd: &CtValue<F>,
    entries: &HashMap<CtKey<F>, CtValue<F>>,
) -> Vec<CtKey<F>> {
    let same_flow = |k: &CtKey<F>| entries.get(k).is_some_and(|v| v.created_ns == fwd.created_ns);
    let mut out = Vec::with_capacity(2);
    if fwd.flags & flags::SNAT != 0 {
        // SNAT: client -> backend (egress; tagged when the flow is); un-SNAT: backend -> node
        // IP:port (ingress).
        let mut snat_key = tuple_key::<F>(
            fwd_key.saddr,
            fwd_key.sport,
            fwd.nat_addr,
            fwd.nat_port,
            fwd_key.proto,
            dir::EGRESS,
        );
        if fwd.flags & flags::SNAT_TAGGED != 0 {
            snat_key.tag = lb_common::conntrack::snat_tag(fwd.rev_nat_id);
        }
        if same_flow(&snat_key) {
            let snat = entries[&snat_key];
            out.push(snat_key);
            let unsnat_key = tuple_key::<F>(
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
        let undnat_key = tuple_key::<F>(
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
    /// A TCP flow whose client has not gone past its SYN yet.
    Handshake,
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
            FlowState::Handshake => "handshake",
            FlowState::Open => "open",
            FlowState::Closing => "closing",
            FlowState::Closed => "closed",
            FlowState::Reset => "reset",
        }
    }
}

/// A forward entry's flow state, as `lb-agent conntrack` shows it.
pub fn flow_state<F: Family>(
    fwd_key: &CtKey<F>,
    fwd: &CtValue<F>,
    entries: &HashMap<CtKey<F>, CtValue<F>>,
) -> FlowState {
    let marks = companions(fwd_key, fwd, entries)
        .iter()
        .fold(fwd.flags, |m, k| m | entries[k].flags);
    match FlowState::from_marks(marks) {
        FlowState::Open
            if fwd_key.proto == lb_common::proto::TCP
                && marks & (flags::HANDSHAKE_TRACKED | flags::ESTABLISHED) == flags::HANDSHAKE_TRACKED =>
        {
            FlowState::Handshake
        }
        state => state,
    }
}

pub fn is_forward<F: Family>(key: &CtKey<F>, value: &CtValue<F>) -> bool {
    key.dir == dir::INGRESS && value.flags & flags::REPLY == 0
}

/// What a pass deletes from `entries` at `now_ns` (the programs' clock, CLOCK_MONOTONIC).
pub fn plan<F: Family>(
    entries: &HashMap<CtKey<F>, CtValue<F>>,
    now_ns: u64,
    t: &GcTimeouts,
) -> Vec<Doomed<F>> {
    let older_than = |stamp: u64, d: Duration| now_ns.saturating_sub(stamp) >= d.as_nanos() as u64;
    let mut claimed: HashSet<CtKey<F>> = HashSet::new();
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
                let handshake_only = marks
                    & (flags::HANDSHAKE_TRACKED | flags::ESTABLISHED | flags::CLOSE_MARKS)
                    == flags::HANDSHAKE_TRACKED;
                if closed && older_than(closed_at, t.tcp_fin_timeout) {
                    Some(Reason::Closed)
                } else if handshake_only && older_than(fwd.created_ns, t.tcp_syn_timeout) {
                    Some(Reason::Unanswered)
                } else {
                    None
                }
            }
            // SCTP, like Cilium's `--bpf-ct-timeout-regular-any`: an association's heartbeats (30 s
            // by default, RFC 9260 8.3) keep a quiet one fresh.
            lb_common::proto::UDP | lb_common::proto::SCTP => {
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

/// What one pass did (over one map, or summed over both families').
#[derive(Debug, Default)]
pub struct GcReport {
    pub scanned: usize,
    /// Entries left after the pass, IPv4 then IPv6 (the maps' occupancy, `lb_map_entries`).
    pub left: [usize; 2],
    /// The same for the new-flow maps (`lb4_ct_new`, `lb6_ct_new`).
    pub left_new: [usize; 2],
    /// Deleted entries by reason.
    pub deleted: Vec<(Reason, u64)>,
    pub took: Duration,
}

impl GcReport {
    /// Adds another map's pass to this one.
    pub fn merge(&mut self, other: GcReport) {
        self.scanned += other.scanned;
        self.left = [self.left[0] + other.left[0], self.left[1] + other.left[1]];
        self.left_new = [
            self.left_new[0] + other.left_new[0],
            self.left_new[1] + other.left_new[1],
        ];
        self.took += other.took;
        for (reason, n) in other.deleted {
            match self.deleted.iter_mut().find(|(r, _)| *r == reason) {
                Some((_, total)) => *total += n,
                None => self.deleted.push((reason, n)),
            }
        }
        self.deleted.sort();
    }
}

/// Every entry of one family's kernel map, as the walk finds them; an entry deleted between the
/// key walk and its lookup (by the programs, or LRU) is skipped.
fn read_entries<T, F>(
    map: &aya::maps::HashMap<T, CtKey<F>, CtValue<F>>,
    mut each: impl FnMut(&CtKey<F>, &CtValue<F>),
) -> Result<(), aya::maps::MapError>
where
    T: std::borrow::Borrow<MapData>,
    F: Family,
    CtKey<F>: Pod,
    CtValue<F>: Pod,
{
    for item in map.iter() {
        match item {
            Ok((k, v)) => each(&k, &v),
            Err(aya::maps::MapError::KeyNotFound) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One pass over one family's kernel map: scan, plan, delete what still is what was planned.
/// `referenced` gets the prefilter bit of every entry scanned (`lb_common::prefilter`), `flows`
/// the flow filter bucket of every egress entry scanned (`lb_common::ct_filter`).
pub fn collect<T, F>(
    map: &mut aya::maps::HashMap<T, CtKey<F>, CtValue<F>>,
    now_ns: u64,
    t: &GcTimeouts,
    referenced: &mut HashSet<u32>,
    flows: &mut FlowBuckets,
) -> Result<GcReport, aya::maps::MapError>
where
    T: std::borrow::BorrowMut<MapData>,
    F: Family,
    CtKey<F>: Pod,
    CtValue<F>: Pod,
{
    let started = Instant::now();
    let mut entries = HashMap::new();
    read_entries(map, |k, v| {
        referenced.extend(lb_common::prefilter::conntrack_bits(k, v));
        flows.note(k);
        entries.insert(*k, *v);
    })?;
    let mut deleted: std::collections::BTreeMap<Reason, u64> = Default::default();
    for d in plan(&entries, now_ns, t) {
        let still = map.get(&d.key, 0).is_ok_and(|v| v.created_ns == d.created_ns);
        if still && map.remove(&d.key).is_ok() {
            *deleted.entry(d.reason).or_default() += 1;
        }
    }
    let mut left = [0; 2];
    left[usize::from(F::AF == libc::AF_INET6 as u32)] =
        entries.len() - deleted.values().sum::<u64>() as usize;
    Ok(GcReport {
        scanned: entries.len(),
        left,
        deleted: deleted.into_iter().collect(),
        took: started.elapsed(),
        ..Default::default()
    })
}

/// Both families' conntrack maps, taken out of the loaded object for the GC: the established
/// flows' and the new flows' (`lb_common::conntrack`, "two tables"). A flow's entries are in one
/// of the two, so each is collected on its own. With them the egress flow filters, which each
/// pass rebuilds (`None` where the kernel would not map them: the filter then stays off).
pub struct ConntrackMaps {
    pub v4: aya::maps::HashMap<MapData, CtKey<V4>, CtValue<V4>>,
    pub v6: aya::maps::HashMap<MapData, CtKey<V6>, CtValue<V6>>,
    pub new_v4: aya::maps::HashMap<MapData, CtKey<V4>, CtValue<V4>>,
    pub new_v6: aya::maps::HashMap<MapData, CtKey<V6>, CtValue<V6>>,
    pub filters: Option<CtFilters>,
}

impl ConntrackMaps {
    /// One pass over both maps.
    pub fn collect(&mut self, now_ns: u64, t: &GcTimeouts) -> Result<GcReport, aya::maps::MapError> {
        self.collect_noting(now_ns, t, &mut Referenced::default(), &mut Tracked::default())
    }

    /// One pass over both maps, noting the prefilter bits their entries need in `referenced` and
    /// the flow filter buckets of their egress entries in `tracked`.
    pub fn collect_noting(
        &mut self,
        now_ns: u64,
        t: &GcTimeouts,
        referenced: &mut Referenced,
        tracked: &mut Tracked,
    ) -> Result<GcReport, aya::maps::MapError> {
        referenced.began = Some(Instant::now());
        let mut report = collect(&mut self.v4, now_ns, t, &mut referenced.v4, &mut tracked.v4)?;
        report.merge(collect(
            &mut self.v6,
            now_ns,
            t,
            &mut referenced.v6,
            &mut tracked.v6,
        )?);
        for mut new in [
            collect(&mut self.new_v4, now_ns, t, &mut referenced.v4, &mut tracked.v4)?,
            collect(&mut self.new_v6, now_ns, t, &mut referenced.v6, &mut tracked.v6)?,
        ] {
            new.left_new = std::mem::take(&mut new.left);
            report.merge(new);
        }
        Ok(report)
    }

    /// The prefilter bits the entries need, without collecting anything (start-up).
    pub fn referenced(&self) -> Result<Referenced, aya::maps::MapError> {
        let mut referenced = Referenced {
            began: Some(Instant::now()),
            ..Default::default()
        };
        let Referenced { v4, v6, .. } = &mut referenced;
        for map in [&self.v4, &self.new_v4] {
            read_entries(map, |k, v| {
                v4.extend(lb_common::prefilter::conntrack_bits(k, v));
            })?;
        }
        for map in [&self.v6, &self.new_v6] {
            read_entries(map, |k, v| {
                v6.extend(lb_common::prefilter::conntrack_bits(k, v));
            })?;
        }
        Ok(referenced)
    }
}

#[cfg(test)]
mod tests;
