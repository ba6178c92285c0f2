//! Operator commands that read the pinned maps: `lb-agent services`, `backends`, `conntrack`,
//! `affinity`, `stats` and `interfaces`. They work while the agent runs and after it stopped (the maps are
//! pinned), print a table or JSON, show addresses as written (`10.0.0.1:80`, `[fd00::1]:80`),
//! and join Service names back from the reverse-NAT data. Both families' maps are read, the same
//! code over `F: KernelFamily`. Also `lb-agent kernel`: what this node's kernel offers the data
//! path.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::{Result, anyhow, bail};
use aya::{
    Pod,
    maps::{Array, HashMap, Map, MapData},
};
use lb_common::{
    affinity::{AffinityClient, AffinityKey, AffinityValue, kind},
    backend::flags as bflags,
    catalog::{self, FamilyMaps},
    conntrack::{CtKey, CtValue, dir, flags as ctflags},
    family::{V4, V6},
    revnat::{SockConnSlot, SockRevNatKey, SockRevNatValue},
    service::{SCOPE_INTERNAL, SvcValue, flags},
    stats::Counter,
};
use serde::Serialize;

use crate::{
    apply::{KernelMaps, MapOps, ServiceMapKey, Snapshot, entries::service_port_name},
    cli::{InspectArgs, KernelArgs, OutputFormat},
    datapath::PinPaths,
    error::{Chain, is_permission_denied},
    family::KernelFamily,
};

fn open(args: &InspectArgs) -> Result<(PinPaths, KernelMaps)> {
    let paths = PinPaths::new(&args.root.bpf_root);
    let maps = open_pinned_maps(&paths, "start the agent, or pass --bpf-root")?;
    Ok((paths, maps))
}

/// What an unprivileged user is missing to read the pins.
const READ_HINT: &str = " (reading the pinned maps needs root, or CAP_BPF and read access to the pins)";

fn read_hint(e: &(dyn std::error::Error + 'static)) -> &'static str {
    if is_permission_denied(e) { READ_HINT } else { "" }
}

/// Opens the pinned maps under `paths` for reading; `missing` says what to do when there are
/// none. A pin that cannot be looked at (a bpffs only root may enter) is "permission denied",
/// not "missing".
pub(crate) fn open_pinned_maps(paths: &PinPaths, missing: &str) -> Result<KernelMaps> {
    let dir = paths.maps();
    match paths.map(catalog::SERVICES).try_exists() {
        Ok(true) => {}
        Ok(false) => bail!("no pinned maps under {} ({missing})", dir.display()),
        Err(e) => bail!(
            "cannot look for the pinned maps under {}: {e}{}",
            dir.display(),
            read_hint(&e)
        ),
    }
    KernelMaps::from_pins(&dir).map_err(|e| {
        anyhow!(
            "opening the pinned maps under {}: {}{}",
            dir.display(),
            Chain(&e),
            read_hint(&e)
        )
    })
}

/// A pinned map's data, or `None` when it is not pinned (a map of an agent from before it, such
/// as the IPv6 maps of one from before IPv6).
fn open_pinned(paths: &PinPaths, name: &str) -> Result<Option<MapData>> {
    let pin = paths.map(name);
    if !pin.try_exists().unwrap_or(true) {
        return Ok(None);
    }
    MapData::from_pin(&pin)
        .map(Some)
        .map_err(|e| anyhow!("opening {}: {}{}", pin.display(), Chain(&e), read_hint(&e)))
}

/// A pinned hash map (LRU or not), or `None` ([`open_pinned`]).
fn open_hash<K: Pod, V: Pod>(paths: &PinPaths, name: &str) -> Result<Option<HashMap<MapData, K, V>>> {
    let Some(data) = open_pinned(paths, name)? else {
        return Ok(None);
    };
    Ok(Some(Map::LruHashMap(data).try_into()?))
}

/// A pinned array, or `None` ([`open_pinned`]).
fn open_array<V: Pod>(paths: &PinPaths, name: &str) -> Result<Option<Array<MapData, V>>> {
    let Some(data) = open_pinned(paths, name)? else {
        return Ok(None);
    };
    Ok(Some(Map::Array(data).try_into()?))
}

/// `10.0.0.1:80`, `[fd00::1]:80`.
fn socket(addr: IpAddr, port: u16) -> String {
    SocketAddr::new(addr, port).to_string()
}

pub(crate) fn proto_name(p: u8) -> &'static str {
    match p {
        lb_common::proto::TCP => "TCP",
        lb_common::proto::UDP => "UDP",
        lb_common::proto::SCTP => "SCTP",
        _ => "?",
    }
}

fn kind_name(f: u16) -> &'static str {
    if f & flags::LOCALHOST != 0 {
        "NodePort(localhost)"
    } else if f & flags::NODE_PORT != 0 {
        "NodePort"
    } else if f & flags::LOAD_BALANCER != 0 {
        "LoadBalancer"
    } else if f & flags::EXTERNAL_IP != 0 {
        "ExternalIP"
    } else {
        "ClusterIP"
    }
}

fn age(now: u64, then: u64) -> String {
    format!("{}s", Duration::from_nanos(now.saturating_sub(then)).as_secs())
}

#[derive(Serialize)]
struct BackendView {
    address: String,
    id: u32,
    local: bool,
    terminating: bool,
    /// At one of the node's own addresses (hostNetwork): tc delivers it locally, unmasqueraded.
    host: bool,
}

#[derive(Serialize)]
struct ScopeView {
    scope: &'static str,
    backends: Vec<BackendView>,
    /// What happens with no backend: "reject" or "drop".
    when_empty: &'static str,
}

#[derive(Serialize)]
struct FrontendView {
    service: String,
    frontend: String,
    #[serde(rename = "type")]
    kind: &'static str,
    rev_nat_id: u32,
    masquerade: &'static str,
    affinity_timeout_seconds: Option<u32>,
    /// How a new flow from outside picks its backend: "random" or "maglev".
    algorithm: &'static str,
    /// The Maglev table of the external scope, with "maglev".
    #[serde(skip_serializing_if = "Option::is_none")]
    maglev_table: Option<MaglevTableView>,
    source_ranges: Vec<String>,
    scopes: Vec<ScopeView>,
    /// Live tc flows, open connected sockets and recently translated unconnected UDP sockets for
    /// this frontend (not the few connected sockets whose record went to socket storage, which
    /// user space cannot list, their slot of `lb4_sock_conn` being another socket's).
    flows: u64,
}

#[derive(Serialize)]
struct MaglevTableView {
    size: u32,
    /// The table is in `lb_maglev` at this size (else the slots pick, as for random).
    installed: bool,
}

fn backend_view(snap: &Snapshot, id: u32) -> BackendView {
    match snap.backends.get(&id) {
        Some(b) => BackendView {
            address: socket(b.addr, b.port),
            id,
            local: b.flags & bflags::LOCAL != 0,
            terminating: b.flags & bflags::TERMINATING != 0,
            host: b.flags & bflags::HOST != 0,
        },
        None => BackendView {
            address: format!("(missing backend {id})"),
            id,
            local: false,
            terminating: false,
            host: false,
        },
    }
}

/// A frontend as the services map keys it: (rev_nat_id, address, port, protocol).
type FrontendId = (u32, IpAddr, u16, u8);

/// Live flows per frontend (rev_nat_id), from the flow-state maps of both families (best effort:
/// they may be absent).
fn flow_counts(paths: &PinPaths) -> BTreeMap<u32, u64> {
    let mut flows: BTreeMap<u32, u64> = BTreeMap::new();
    count_flows::<V4>(paths, &mut flows);
    count_flows::<V6>(paths, &mut flows);
    flows
}

fn count_flows<F>(paths: &PinPaths, flows: &mut BTreeMap<u32, u64>)
where
    F: FamilyMaps,
    CtKey<F>: Pod,
    CtValue<F>: Pod,
    SockRevNatKey<F>: Pod,
    SockRevNatValue<F>: Pod,
    SockConnSlot<F>: Pod,
{
    if let Ok(entries) = conntrack_entries::<F>(paths) {
        for (k, v) in entries {
            if crate::datapath::conntrack::is_forward(&k, &v) {
                *flows.entry(v.rev_nat_id).or_default() += 1;
            }
        }
    }
    if let Ok(Some(sk)) = open_hash::<SockRevNatKey<F>, SockRevNatValue<F>>(paths, F::MAPS.sock_revnat) {
        for (_, v) in sk.iter().flatten() {
            *flows.entry(v.rev_nat_id).or_default() += 1;
        }
    }
    if let Ok(Some(slots)) = open_array::<SockConnSlot<F>>(paths, F::MAPS.sock_conn) {
        for slot in slots.iter().flatten().filter(|slot| slot.cookie != 0) {
            *flows.entry(slot.conn.rev_nat_id).or_default() += 1;
        }
    }
}

fn frontends(snap: &Snapshot, flows: &BTreeMap<u32, u64>) -> Vec<FrontendView> {
    let mut by_frontend: BTreeMap<FrontendId, Vec<(ServiceMapKey, SvcValue)>> = BTreeMap::new();
    for (k, v) in &snap.services {
        by_frontend
            .entry((v.entry.rev_nat_id, k.addr, k.port, k.proto))
            .or_default()
            .push((*k, v.entry));
    }
    let mut out = Vec::new();
    for ((rev, addr, port, proto), entries) in by_frontend {
        let name = snap
            .names
            .get(&rev)
            .map(|n| service_port_name(n, proto).to_string())
            .unwrap_or_else(|| format!("(unknown, rev_nat_id {rev})"));
        let mut scopes = Vec::new();
        let mut front_flags = 0;
        let mut affinity = None;
        let mut maglev_table = None;
        for (k, v) in entries.iter().filter(|(k, _)| k.slot == 0) {
            if k.scope != SCOPE_INTERNAL {
                front_flags = v.flags;
                affinity = (v.flags & flags::AFFINITY != 0).then_some(v.affinity_timeout);
                maglev_table = (v.flags & flags::MAGLEV != 0).then(|| MaglevTableView {
                    size: v.backend_id,
                    installed: snap
                        .maglev
                        .get(&rev)
                        .is_some_and(|t| t.len() == v.backend_id as usize),
                });
            }
            let mut backends: Vec<BackendView> = (1..=v.count)
                .filter_map(|slot| {
                    entries
                        .iter()
                        .find(|(sk, _)| sk.scope == k.scope && sk.slot == slot)
                })
                .map(|(_, sv)| backend_view(snap, sv.backend_id))
                .collect();
            backends.sort_by(|a, b| a.address.cmp(&b.address));
            scopes.push(ScopeView {
                scope: if k.scope == SCOPE_INTERNAL {
                    "internal"
                } else {
                    "external"
                },
                backends,
                when_empty: if v.flags & flags::DROP_IF_EMPTY != 0 {
                    "drop"
                } else {
                    "reject"
                },
            });
        }
        // Sorted: the trie's order is the kernel's.
        let mut source_ranges: Vec<ipnet::IpNet> = snap
            .source_ranges
            .iter()
            .filter(|r| r.rev_nat_id == rev)
            .map(|r| r.net)
            .collect();
        source_ranges.sort();
        let source_ranges = source_ranges.iter().map(|n| n.to_string()).collect();
        out.push(FrontendView {
            service: name,
            frontend: format!("{}/{}", socket(addr, port), proto_name(proto)),
            kind: kind_name(front_flags),
            rev_nat_id: rev,
            masquerade: if front_flags & flags::MASQUERADE != 0 {
                "always"
            } else if front_flags & flags::MASQUERADE_OFF_CLUSTER != 0 {
                "off-cluster"
            } else {
                "no"
            },
            affinity_timeout_seconds: affinity,
            algorithm: if maglev_table.is_some() {
                "maglev"
            } else {
                "random"
            },
            maglev_table,
            source_ranges,
            scopes,
            flows: flows.get(&rev).copied().unwrap_or(0),
        });
    }
    out.sort_by(|a, b| (&a.service, &a.frontend).cmp(&(&b.service, &b.frontend)));
    out
}

/// Rows as an aligned table.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.len());
        }
    }
    let line = |cells: &[String]| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        format!("{}\n", s.trim_end())
    };
    let mut out = line(&header.iter().map(|h| h.to_string()).collect::<Vec<_>>());
    for row in rows {
        out.push_str(&line(row));
    }
    out
}

pub fn services(args: &InspectArgs) -> Result<()> {
    let (paths, maps) = open(args)?;
    let snap = maps.snapshot()?;
    let views = frontends(&snap, &flow_counts(&paths));
    match args.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&views)?),
        OutputFormat::Table => print!("{}", services_table(&views)),
    }
    Ok(())
}

/// `lb-agent services` as a table, from what the maps hold (`flows`: live flows per frontend).
pub fn services_text(snap: &Snapshot, flows: &BTreeMap<u32, u64>) -> String {
    services_table(&frontends(snap, flows))
}

fn services_table(views: &[FrontendView]) -> String {
    let rows: Vec<Vec<String>> = views
        .iter()
        .map(|v| {
            let backends = v
                .scopes
                .iter()
                .map(|s| {
                    let list = if s.backends.is_empty() {
                        format!("(none: {})", s.when_empty)
                    } else {
                        s.backends
                            .iter()
                            .map(|b| {
                                let mut t = b.address.clone();
                                for word in backend_state(b.local, b.terminating, b.host) {
                                    t.push(' ');
                                    t.push_str(word);
                                }
                                t
                            })
                            .collect::<Vec<_>>()
                            .join(", ")
                    };
                    if v.scopes.len() > 1 {
                        format!("{}: {list}", s.scope)
                    } else {
                        list
                    }
                })
                .collect::<Vec<_>>()
                .join(" | ");
            let mut notes = Vec::new();
            if let Some(t) = v.affinity_timeout_seconds {
                notes.push(format!("affinity {t}s"));
            }
            if let Some(m) = &v.maglev_table {
                notes.push(match m.installed {
                    true => format!("maglev {}", m.size),
                    false => format!("maglev {} (table not installed)", m.size),
                });
            }
            if !v.source_ranges.is_empty() {
                notes.push(format!("from {}", v.source_ranges.join(",")));
            }
            vec![
                v.service.clone(),
                v.frontend.clone(),
                v.kind.to_string(),
                v.masquerade.to_string(),
                v.flows.to_string(),
                notes.join("; "),
                backends,
            ]
        })
        .collect();
    table(
        &[
            "SERVICE",
            "FRONTEND",
            "TYPE",
            "MASQUERADE",
            "FLOWS",
            "NOTES",
            "BACKENDS",
        ],
        &rows,
    )
}

#[derive(Serialize)]
struct BackendRow {
    id: u32,
    address: String,
    protocol: &'static str,
    local: bool,
    terminating: bool,
    host: bool,
    services: Vec<String>,
}

pub fn backends(args: &InspectArgs) -> Result<()> {
    let (_, maps) = open(args)?;
    let rows = backend_rows(&maps.snapshot()?);
    match args.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        OutputFormat::Table => print!("{}", backends_table(&rows)),
    }
    Ok(())
}

/// `lb-agent backends` as a table, from what the maps hold.
pub fn backends_text(snap: &Snapshot) -> String {
    backends_table(&backend_rows(snap))
}

fn backend_rows(snap: &Snapshot) -> Vec<BackendRow> {
    let mut users: BTreeMap<u32, std::collections::BTreeSet<String>> = BTreeMap::new();
    for (k, v) in &snap.services {
        if k.slot > 0 {
            let name = snap
                .names
                .get(&v.entry.rev_nat_id)
                .map(|n| service_port_name(n, k.proto).to_string())
                .unwrap_or_default();
            users.entry(v.entry.backend_id).or_default().insert(name);
        }
    }
    let rows: Vec<BackendRow> = snap
        .backends
        .iter()
        .map(|(id, b)| BackendRow {
            id: *id,
            address: socket(b.addr, b.port),
            protocol: proto_name(b.proto),
            local: b.flags & bflags::LOCAL != 0,
            terminating: b.flags & bflags::TERMINATING != 0,
            host: b.flags & bflags::HOST != 0,
            services: users
                .remove(id)
                .map(|s| s.into_iter().collect())
                .unwrap_or_default(),
        })
        .collect();
    rows
}

/// A backend's flags in words.
fn backend_state(local: bool, terminating: bool, host: bool) -> Vec<&'static str> {
    [
        (local, "local"),
        (terminating, "terminating"),
        (host, "node address"),
    ]
    .into_iter()
    .filter_map(|(set, word)| set.then_some(word))
    .collect()
}

fn backends_table(rows: &[BackendRow]) -> String {
    table(
        &["ID", "BACKEND", "PROTO", "STATE", "SERVICES"],
        &rows
            .iter()
            .map(|r| {
                let state = backend_state(r.local, r.terminating, r.host).join(", ");
                vec![
                    r.id.to_string(),
                    r.address.clone(),
                    r.protocol.into(),
                    if state.is_empty() { "-".into() } else { state },
                    r.services.join(", "),
                ]
            })
            .collect::<Vec<_>>(),
    )
}

#[derive(Serialize)]
struct FlowRow {
    protocol: &'static str,
    client: String,
    frontend: String,
    backend: String,
    masquerade: Option<String>,
    service: String,
    age: String,
    /// `open`, `closing`, `closed` or `reset` (TCP; the GC frees closed and reset flows).
    state: &'static str,
}

pub fn conntrack(args: &InspectArgs) -> Result<()> {
    let (paths, maps) = open(args)?;
    let snap = maps.snapshot()?;
    let now = crate::time::monotonic_coarse_ns();
    let mut rows = flow_rows::<V4>(&paths, &snap, now)?;
    rows.extend(flow_rows::<V6>(&paths, &snap, now)?);
    match args.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        OutputFormat::Table => print!(
            "{}",
            table(
                &[
                    "PROTO",
                    "CLIENT",
                    "FRONTEND",
                    "BACKEND",
                    "MASQUERADED AS",
                    "AGE",
                    "STATE",
                    "SERVICE",
                ],
                &rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.protocol.into(),
                            r.client.clone(),
                            r.frontend.clone(),
                            r.backend.clone(),
                            r.masquerade.clone().unwrap_or_else(|| "-".into()),
                            r.age.clone(),
                            r.state.into(),
                            r.service.clone(),
                        ]
                    })
                    .collect::<Vec<_>>(),
            )
        ),
    }
    Ok(())
}

/// An SNAT entry's tuple: (source, source port, destination, destination port, protocol, tag).
type Tuple<F> = (
    <F as lb_common::family::Family>::Addr,
    u16,
    <F as lb_common::family::Family>::Addr,
    u16,
    u8,
    u16,
);

/// One family's conntrack entries: the established flows' map, then the new flows' (an entry in
/// both is the established one's, as the programs read it).
fn conntrack_entries<F>(paths: &PinPaths) -> Result<Vec<(CtKey<F>, CtValue<F>)>>
where
    F: FamilyMaps,
    CtKey<F>: Pod,
    CtValue<F>: Pod,
{
    let mut entries = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for name in [F::MAPS.conntrack, F::MAPS.conntrack_new] {
        // An agent of an earlier release pinned no new-flow map.
        if let Some(ct) = open_hash::<CtKey<F>, CtValue<F>>(paths, name)? {
            entries.extend(ct.iter().flatten().filter(|(k, _)| seen.insert(*k)));
        }
    }
    Ok(entries)
}

/// One family's tc flows, from its conntrack maps.
fn flow_rows<F>(paths: &PinPaths, snap: &Snapshot, now: u64) -> Result<Vec<FlowRow>>
where
    F: KernelFamily + FamilyMaps,
    CtKey<F>: Pod,
    CtValue<F>: Pod,
{
    // A list for the rows' order (the maps'), a table for finding each flow's other entries.
    let entries = conntrack_entries::<F>(paths)?;
    let by_key: std::collections::HashMap<CtKey<F>, CtValue<F>> = entries.iter().copied().collect();
    let at = |addr: &F::Addr, port: u16| socket(F::ip_addr(addr), port);
    // Masquerade addresses of each flow, from its SNAT entry (client -> backend): keyed by that
    // entry's tuple (client, client port, backend, backend port, protocol).
    let snat: std::collections::HashMap<Tuple<F>, (F::Addr, u16)> = entries
        .iter()
        .filter(|(k, v)| {
            k.dir == dir::EGRESS && v.flags & ctflags::SNAT != 0 && v.flags & ctflags::REPLY == 0
        })
        .map(|(k, v)| {
            (
                (k.saddr, k.sport, k.daddr, k.dport, k.proto, k.tag),
                (v.nat_addr, v.nat_port),
            )
        })
        .collect();
    Ok(entries
        .iter()
        .filter(|(k, v)| crate::datapath::conntrack::is_forward(k, v))
        .map(|(k, v)| FlowRow {
            protocol: proto_name(k.proto),
            client: at(&k.saddr, k.sport),
            frontend: at(&k.daddr, k.dport),
            backend: at(&v.nat_addr, v.nat_port),
            masquerade: snat
                .get(&(
                    k.saddr,
                    k.sport,
                    v.nat_addr,
                    v.nat_port,
                    k.proto,
                    // A flow sharing its post-DNAT tuple with another has a tagged SNAT entry.
                    if v.flags & ctflags::SNAT_TAGGED != 0 {
                        lb_common::conntrack::snat_tag(v.rev_nat_id)
                    } else {
                        0
                    },
                ))
                .map(|(a, p)| at(a, *p)),
            service: snap
                .names
                .get(&v.rev_nat_id)
                .map(|n| service_port_name(n, k.proto).to_string())
                .unwrap_or_default(),
            age: age(now, v.created_ns),
            state: crate::datapath::conntrack::flow_state(k, v, &by_key).label(),
        })
        .collect())
}

#[derive(Serialize)]
struct AffinityRow {
    client: String,
    service: String,
    backend: String,
    idle: String,
}

pub fn affinity(args: &InspectArgs) -> Result<()> {
    let (paths, maps) = open(args)?;
    let snap = maps.snapshot()?;
    let now = crate::time::boottime_ns();
    let mut rows = affinity_rows::<V4>(&paths, &snap, now)?;
    rows.extend(affinity_rows::<V6>(&paths, &snap, now)?);
    match args.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        OutputFormat::Table => print!(
            "{}",
            table(
                &["CLIENT", "SERVICE", "BACKEND", "IDLE"],
                &rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.client.clone(),
                            r.service.clone(),
                            r.backend.clone(),
                            r.idle.clone(),
                        ]
                    })
                    .collect::<Vec<_>>(),
            )
        ),
    }
    Ok(())
}

/// One family's ClientIP affinity entries.
fn affinity_rows<F>(paths: &PinPaths, snap: &Snapshot, now: u64) -> Result<Vec<AffinityRow>>
where
    F: KernelFamily + FamilyMaps + AffinityClient,
    AffinityKey<F>: Pod,
{
    let Some(aff) = open_hash::<AffinityKey<F>, AffinityValue>(paths, F::MAPS.affinity)? else {
        return Ok(Vec::new());
    };
    Ok(aff
        .iter()
        .flatten()
        .map(|(k, v)| AffinityRow {
            client: if k.kind == kind::ADDR {
                F::ip_addr(&F::addr_of_client(&k.client)).to_string()
            } else {
                format!("netns cookie {}", F::cookie_of_client(&k.client))
            },
            service: snap
                .names
                .get(&k.rev_nat_id)
                .zip(snap.revnat.get(&k.rev_nat_id))
                .map(|(n, r)| format!("{} ({})", service_port_name(n, r.proto), socket(r.addr, r.port)))
                .unwrap_or_default(),
            backend: backend_view(snap, v.backend_id).address,
            idle: age(now, v.last_used_ns),
        })
        .collect())
}

pub fn stats(args: &InspectArgs) -> Result<()> {
    let (paths, maps) = open(args)?;
    let mut rows: Vec<(&str, u64)> = Counter::ALL
        .iter()
        .map(|c| (c.name(), maps.counter(*c as u32)))
        .collect();
    // Gauges beside the counters: the tc prefilter's bits set now (as the metric
    // lb_tc_prefilter_bits), absent where an agent of an earlier release pinned no prefilter.
    let prefilter =
        |name: &str| -> Option<Map> { Some(Map::Array(MapData::from_pin(paths.map(name)).ok()?)) };
    if let (Some(v4), Some(v6)) = (prefilter(catalog::PREFILTER), prefilter(catalog::PREFILTER6)) {
        let [b4, b6] = crate::apply::prefilter::bits_set_in([v4, v6])?;
        rows.push(("tc_prefilter_bits_set_ipv4", u64::from(b4)));
        rows.push(("tc_prefilter_bits_set_ipv6", u64::from(b6)));
    }
    // The egress flow filters: on or off, and the buckets either generation holds now (absent
    // where an agent of an earlier release pinned none).
    for (name, family) in [(catalog::CT_FILTER, "ipv4"), (catalog::CT_FILTER6, "ipv6")] {
        let Some(map) = prefilter(name) else { continue };
        let filter = crate::datapath::ct_filter::CtFilter::new(map)?;
        rows.push((
            if family == "ipv4" {
                "tc_ct_filter_on_ipv4"
            } else {
                "tc_ct_filter_on_ipv6"
            },
            u64::from(filter.control()?.0),
        ));
        rows.push((
            if family == "ipv4" {
                "tc_ct_filter_buckets_ipv4"
            } else {
                "tc_ct_filter_buckets_ipv6"
            },
            u64::from(filter.held_buckets()?),
        ));
    }
    match args.output {
        OutputFormat::Json => {
            let obj: serde_json::Map<String, serde_json::Value> =
                rows.iter().map(|(n, v)| (n.to_string(), (*v).into())).collect();
            println!("{}", serde_json::to_string_pretty(&obj)?);
        }
        OutputFormat::Table => print!(
            "{}",
            table(
                &["EVENT", "TOTAL"],
                &rows
                    .iter()
                    .map(|(n, v)| vec![n.to_string(), v.to_string()])
                    .collect::<Vec<_>>(),
            )
        ),
    }
    Ok(())
}

/// One interface as the tc path sees it (`lb-agent interfaces`).
#[derive(Serialize)]
struct InterfaceRow {
    interface: String,
    ifindex: u32,
    /// The agent's pinned TCX links on it (tc programs attached as clsact filters, on kernels
    /// without TCX or with `--enable-tcx=false`, have no pins: `tc filter show dev <name> ingress`).
    tcx_links: bool,
    /// In `lb_pod_ifaces`: the interface detectors count its packets as pods'.
    pod_interface: bool,
    /// What a masqueraded flow leaving by it gets (`lb_masq_addrs`), in the programs' order; the
    /// node IP of the family where it has none.
    masquerade: Vec<String>,
}

/// The addresses of an `lb_masq_addrs` entry, both families.
fn masquerade_addresses(entry: &lb_common::config::MasqueradeAddrs) -> Vec<String> {
    let v4 = entry
        .v4
        .valid()
        .iter()
        .map(|c| format!("{}/{}", V4::ip_addr(&c.addr), c.prefix_len));
    let v6 = entry
        .v6
        .valid()
        .iter()
        .map(|c| format!("{}/{}", V6::ip_addr(&c.addr), c.prefix_len));
    v4.chain(v6).collect()
}

/// `lb-agent interfaces`: this network namespace's links (run it where the agent runs: the node's)
/// joined with the pinned per-interface maps, then the fallback masquerade addresses (key 0).
pub fn interfaces(args: &InspectArgs) -> Result<()> {
    use lb_common::config::{MASQUERADE_FALLBACK, MasqueradeAddrs};
    let paths = PinPaths::new(&args.root.bpf_root);
    open_pinned_maps(&paths, "start the agent, or pass --bpf-root")?;
    let masquerade: BTreeMap<u32, MasqueradeAddrs> =
        open_hash::<u32, MasqueradeAddrs>(&paths, catalog::MASQ_ADDRS)?
            .map(|m| m.iter().flatten().collect())
            .unwrap_or_default();
    let pods: std::collections::BTreeSet<u32> = open_hash::<u32, u8>(&paths, catalog::POD_INTERFACES)?
        .map(|m| m.keys().flatten().collect())
        .unwrap_or_default();
    let tcx = crate::datapath::tc::pinned_devices(&paths);
    let fallback = masquerade
        .get(&MASQUERADE_FALLBACK)
        .map(masquerade_addresses)
        .unwrap_or_default();
    let links = crate::node::interfaces::links().map_err(|e| anyhow!("listing this node's links: {e}"))?;
    let mut rows: Vec<InterfaceRow> = links
        .iter()
        .map(|link| InterfaceRow {
            interface: link.name.clone(),
            ifindex: link.index,
            tcx_links: tcx.contains_key(&link.index),
            pod_interface: pods.contains(&link.index),
            masquerade: masquerade
                .get(&link.index)
                .map(masquerade_addresses)
                .unwrap_or_default(),
        })
        .collect();
    rows.sort_by_key(|r| r.ifindex);
    match args.output {
        OutputFormat::Json => println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "interfaces": rows,
                "masquerade_fallback": fallback,
            }))?
        ),
        OutputFormat::Table => {
            let yes = |b: bool| if b { "yes" } else { "-" }.to_string();
            print!(
                "{}",
                table(
                    &["INTERFACE", "IFINDEX", "TCX", "POD", "MASQUERADE"],
                    &rows
                        .iter()
                        .map(|r| {
                            vec![
                                r.interface.clone(),
                                r.ifindex.to_string(),
                                yes(r.tcx_links),
                                yes(r.pod_interface),
                                if r.masquerade.is_empty() {
                                    "(node IP)".into()
                                } else {
                                    r.masquerade.join(" ")
                                },
                            ]
                        })
                        .collect::<Vec<_>>(),
                )
            );
            println!(
                "node IP (where an interface has no address of the family): {}",
                fallback.join(" ")
            );
        }
    }
    Ok(())
}

/// `lb-agent kernel`: the features the data path uses on this kernel (probed, as the agent does
/// at start-up), then the real test: every program of the object loaded with scratch maps, which
/// is this kernel's verifier accepting each of them (or the verifier's reason it does not).
pub fn kernel(args: &KernelArgs) -> Result<()> {
    use crate::datapath::{Datapath, features};
    // The agent's own cached probe: loading the object below reads it too.
    let kernel = features::current()?;
    let mut verdict = kernel.check().map_err(anyhow::Error::from);
    let programs = if verdict.is_ok() {
        let caps = lb_common::catalog::Capacities {
            services: 1024,
            backends: 1024,
            revnat: 1024,
            sock_revnat: 1024,
            affinity: 1024,
            affinity_match: 1024,
            source_ranges: 1024,
            conntrack: 1024,
            conntrack_new: 1024,
        };
        let object = crate::datapath::object_bytes(args.bpf_object.as_deref())?;
        match Datapath::load_unpinned(&caps, &object).and_then(|mut dp| dp.verify_programs()) {
            Ok(programs) => programs,
            Err(e) => {
                verdict = Err(anyhow::anyhow!("the data path does not load on this kernel: {e}"));
                Vec::new()
            }
        }
    } else {
        Vec::new()
    };
    let minimum = format!("{}.{}", features::MINIMUM_KERNEL.0, features::MINIMUM_KERNEL.1);
    match args.output.output {
        OutputFormat::Json => {
            let mut value = serde_json::to_value(kernel)?;
            value["supported"] = verdict.is_ok().into();
            if let Err(e) = &verdict {
                value["error"] = format!("{e:#}").into();
            }
            value["minimum"] = minimum.into();
            value["programs"] = serde_json::to_value(&programs)?;
            println!("{}", serde_json::to_string_pretty(&value)?);
        }
        OutputFormat::Table => {
            print!("{kernel}");
            if !programs.is_empty() {
                println!(
                    "\n{:<18} {:>12} {:>14}",
                    "PROGRAM", "INSTRUCTIONS", "VERIFIER STEPS"
                );
                for p in &programs {
                    let steps = p.verified_instructions.map_or("-".to_string(), |n| n.to_string());
                    println!("{:<18} {:>12} {:>14}", p.name, p.instructions, steps);
                }
                println!("\nall {} programs pass this kernel's verifier", programs.len());
            }
        }
    }
    verdict
}
