//! `lb-agent monitor`: what the data path does, live. It asks the running programs for events
//! (`lb_monitor`, a lease renewed every second), reads them from the ring buffer `lb_events` and
//! prints one line (or one JSON object) per event: socket translations, the tc path's new flows
//! with their NAT and masquerade, rejects and drops with their reason, packets left untranslated.
//! The event vocabulary is the counters' (`lb_common::monitor`): `lb-agent stats` says how often,
//! this says which flow.
//!
//! One monitor per node at a time (the programs write one ring buffer, which one reader drains);
//! a second one is refused while the first's lease runs. Events the buffer had no room for are
//! counted by the programs (`monitor_events_lost`) and reported here as they happen.

use std::{
    collections::HashMap as StdHashMap,
    fmt::Write as _,
    net::IpAddr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Result, anyhow, bail};
use aya::maps::{Array, HashMap, Map, MapData, RingBuf};
use lb_common::{
    catalog,
    family::AF_INET,
    monitor::{MonitorControl, MonitorEvent, event_type, hook, types},
    revnat::SvcName,
    stats::Counter,
};
use serde::Serialize;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};

use crate::{
    apply::{KernelMaps, entries::service_port_name},
    cli::{MonitorArgs, MonitorType, OutputFormat},
    datapath::PinPaths,
    error::Chain,
    family::IpFamily,
    time::boottime_ns,
};

/// How long the programs keep writing events after the last renewal: a monitor killed without
/// cleaning up costs the node at most this long of events nobody reads.
const LEASE: Duration = Duration::from_secs(5);
const RENEW_EVERY: Duration = Duration::from_secs(1);
/// A service name or a cgroup path looked up is trusted this long (ids are reused).
const NAME_TTL: Duration = Duration::from_secs(5);

/// `lb-agent monitor`.
pub async fn run(args: &MonitorArgs) -> Result<()> {
    let paths = PinPaths::new(&args.root.bpf_root);
    let maps = crate::inspect::open_pinned_maps(&paths, "start the agent, or pass --bpf-root")?;
    let open = |name: &str| -> Result<MapData> {
        let pin = paths.map(name);
        if !pin.try_exists().unwrap_or(true) {
            bail!(
                "{} is not pinned: the running agent predates `lb-agent monitor`; upgrade it",
                pin.display()
            );
        }
        MapData::from_pin(&pin).map_err(|e| anyhow!("opening {}: {}", pin.display(), Chain(&e)))
    };
    let wanted = wanted_types(&args.types);
    let mut lease = Lease::take(Array::try_from(Map::Array(open(catalog::MONITOR)?))?, wanted)?;
    let mut ring = RingBuf::try_from(Map::RingBuf(open(catalog::EVENTS)?))?;
    // A previous monitor's unread events: not this one's to show.
    while ring.next().is_some() {}
    lease.renew()?;
    let names: Option<HashMap<MapData, u32, SvcName>> = open(catalog::SVC_NAMES)
        .ok()
        .and_then(|m| Map::HashMap(m).try_into().ok());
    let filter = Filter::new(args)?;
    let mut view = View {
        names,
        name_cache: StdHashMap::new(),
        cgroups: Cgroups::new(),
        interfaces: StdHashMap::new(),
    };
    let lost_counter = |maps: &KernelMaps| maps.counter(Counter::MonitorEventsLost as u32);
    let mut lost_seen = lost_counter(&maps);

    let type_names: Vec<&str> = types::NAMED
        .iter()
        .filter(|(bit, _)| wanted & bit != 0)
        .map(|(_, name)| *name)
        .collect();
    match args.output {
        OutputFormat::Json => println!(
            "{}",
            serde_json::json!({"type": "listening", "types": type_names, "pid": std::process::id()})
        ),
        OutputFormat::Table => {
            eprintln!("listening for {} events (Ctrl-C to stop)", type_names.join(", "));
            println!("{}", table_header());
        }
    }

    // SAFETY: the ring buffer owns its map's file descriptor, open and unchanged for as long as
    // the `AsyncFd` holds it.
    let mut ring = unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE) }
        .map_err(|e| anyhow!("polling the event ring buffer: {e}"))?;
    let mut renew = tokio::time::interval(RENEW_EVERY);
    let (mut term, mut hup, mut int) = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::hangup())?,
        signal(SignalKind::interrupt())?,
    );
    let mut printed: u64 = 0;
    loop {
        tokio::select! {
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                let ring = guard.get_inner_mut();
                let clock = Clock::now();
                while let Some(item) = ring.next() {
                    if item.len() < size_of::<MonitorEvent>() {
                        continue;
                    }
                    // SAFETY: the programs write whole `MonitorEvent`s; read unaligned from the
                    // ring's bytes.
                    let event: MonitorEvent =
                        unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<MonitorEvent>()) };
                    drop(item);
                    let shown = view.describe(&event, &clock);
                    if !filter.matches(&shown) {
                        continue;
                    }
                    match args.output {
                        OutputFormat::Json => println!("{}", serde_json::to_string(&shown)?),
                        OutputFormat::Table => println!("{}", table_line(&shown)),
                    }
                    printed += 1;
                    if args.max_events.is_some_and(|max| printed >= max) {
                        return Ok(());
                    }
                }
                guard.clear_ready();
            }
            _ = renew.tick() => {
                lease.renew()?;
                let lost = lost_counter(&maps);
                if lost > lost_seen {
                    let n = lost - lost_seen;
                    match args.output {
                        OutputFormat::Json => println!("{}", serde_json::json!({"type": "lost", "events": n})),
                        OutputFormat::Table => println!("!! {n} events lost: the ring buffer was full (a burst, or this terminal reads too slowly)"),
                    }
                    lost_seen = lost;
                }
            }
            _ = term.recv() => break,
            _ = hup.recv() => break,
            _ = int.recv() => break,
        }
    }
    Ok(())
}

/// The `types::*` bits `--type` asks for (all when empty).
fn wanted_types(requested: &[MonitorType]) -> u32 {
    if requested.is_empty() {
        return types::ALL;
    }
    requested.iter().fold(0, |all, t| {
        all | match t {
            MonitorType::Translate => types::TRANSLATE,
            MonitorType::Nat => types::NAT,
            MonitorType::Reject => types::REJECT,
            MonitorType::Drop => types::DROP,
            MonitorType::Untranslated => types::UNTRANSLATED,
        }
    })
}

/// This monitor's hold on `lb_monitor`: the programs write events while it is renewed; dropped
/// (normal exit, error, panic unwinding), it is given back.
struct Lease {
    map: Array<MapData, MonitorControl>,
    types: u32,
    pid: u32,
}

impl Lease {
    fn take(map: Array<MapData, MonitorControl>, types: u32) -> Result<Self> {
        let current = map.get(&0, 0)?;
        if current.types != 0 && current.until_ns > boottime_ns() {
            bail!(
                "another lb-agent monitor (pid {}, in its PID namespace) is listening on this node; \
                 one at a time: stop it, or wait {} s for its lease to run out if it was killed",
                current.pid,
                Duration::from_nanos(current.until_ns - boottime_ns()).as_secs() + 1
            );
        }
        Ok(Lease {
            map,
            types,
            pid: std::process::id(),
        })
    }

    fn renew(&mut self) -> Result<()> {
        // Two monitors started at the same moment both found the lease free: the one that
        // finds the other's renewal gives way (the ring buffer has one reader).
        if let Ok(current) = self.map.get(&0, 0)
            && current.pid != self.pid
            && current.types != 0
            && current.until_ns > boottime_ns()
        {
            bail!(
                "another lb-agent monitor (pid {}, in its PID namespace) took the node's events; one at a time",
                current.pid
            );
        }
        let control = MonitorControl {
            until_ns: boottime_ns() + LEASE.as_nanos() as u64,
            types: self.types,
            pid: self.pid,
        };
        self.map.set(0, &control, 0).map_err(|e| {
            anyhow!(
                "renewing the monitor's lease in {}: {}",
                catalog::MONITOR,
                Chain(&e)
            )
        })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.map.get(&0, 0).is_ok_and(|c| c.pid == self.pid) {
            let _ = self.map.set(0, &MonitorControl::default(), 0);
        }
    }
}

/// The boot clock and the wall clock read together, to date events.
struct Clock {
    boot_ns: u64,
    wall: k8s_openapi::jiff::Timestamp,
}

impl Clock {
    fn now() -> Self {
        Clock {
            boot_ns: boottime_ns(),
            wall: k8s_openapi::jiff::Timestamp::now(),
        }
    }

    fn wall_of(&self, boot_ns: u64) -> k8s_openapi::jiff::Timestamp {
        let ago = Duration::from_nanos(self.boot_ns.saturating_sub(boot_ns));
        self.wall
            .checked_sub(k8s_openapi::jiff::SignedDuration::try_from(ago).unwrap_or_default())
            .unwrap_or(self.wall)
    }
}

/// One event as printed.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Shown {
    /// RFC 3339, UTC.
    pub time: String,
    /// `translate`, `nat`, `reject`, `drop`, `untranslated`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The counter it also bumped (`lb-agent stats`, `lb_datapath_events_total{event=...}`).
    pub event: &'static str,
    /// Why, in kube-proxy's terms.
    pub reason: &'static str,
    /// `connect4`, `sendmsg6`, ..., `tc-ingress` or `tc-egress` (the node's own SCTP).
    pub hook: &'static str,
    /// tc: the interface the packet came in by (ingress) or was leaving by (egress).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// The socket path: the calling process's cgroup (its path under the cgroup2 mount, or its id).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    pub protocol: &'static str,
    /// The client: the packet's source, or a bound socket's address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// The address the call or packet named.
    pub destination: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The address and port a masqueraded flow leaves with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade: Option<String>,
    /// `namespace/name:port` of the frontend's Service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// `time`, for the table's shorter form.
    #[serde(skip)]
    at: k8s_openapi::jiff::Timestamp,
    #[serde(skip)]
    addrs: Vec<IpAddr>,
    #[serde(skip)]
    ports: Vec<u16>,
}

/// What turns an event's ids into names, with caches.
struct View {
    names: Option<HashMap<MapData, u32, SvcName>>,
    name_cache: StdHashMap<u32, (Option<String>, Instant)>,
    cgroups: Cgroups,
    interfaces: StdHashMap<u32, String>,
}

impl View {
    fn describe(&mut self, e: &MonitorEvent, clock: &Clock) -> Shown {
        let counter = Counter::ALL.get(e.counter as usize).copied();
        let kind = counter
            .map(event_type)
            .and_then(|t| types::NAMED.iter().find(|(bit, _)| *bit == t))
            .map_or("?", |(_, name)| *name);
        let family = if u32::from(e.family) == AF_INET {
            IpFamily::V4
        } else {
            IpFamily::V6
        };
        let addr = |bytes: &[u8; 16]| family.addr_from_bytes(*bytes);
        let endpoint = |ip: IpAddr, port: u16| -> String {
            if port == 0 {
                ip.to_string()
            } else {
                std::net::SocketAddr::new(ip, port).to_string()
            }
        };
        let (src, dst, backend, nat) = (addr(&e.src), addr(&e.dst), addr(&e.backend), addr(&e.nat));
        let mut addrs = vec![dst];
        let mut ports = vec![e.dst_port];
        let client = (!src.is_unspecified()).then(|| {
            addrs.push(src);
            ports.push(e.src_port);
            endpoint(src, e.src_port)
        });
        let backend = (!backend.is_unspecified()).then(|| {
            addrs.push(backend);
            ports.push(e.backend_port);
            endpoint(backend, e.backend_port)
        });
        let masquerade = (e.nat_port != 0).then(|| {
            addrs.push(nat);
            ports.push(e.nat_port);
            endpoint(nat, e.nat_port)
        });
        let service = (e.rev_nat_id != 0)
            .then(|| self.service(e.rev_nat_id, e.protocol))
            .flatten();
        let tc = matches!(e.hook, hook::TC_INGRESS | hook::TC_EGRESS);
        let at = clock.wall_of(e.time_ns);
        Shown {
            time: at.to_string(),
            at,
            kind,
            event: counter.map_or("?", Counter::name),
            reason: counter.map_or("", reason),
            hook: hook_name(e.hook),
            interface: tc.then(|| self.interface(e.ifindex)),
            cgroup: (!tc && e.cgroup_id != 0).then(|| self.cgroups.path(e.cgroup_id)),
            protocol: crate::inspect::proto_name(e.protocol),
            client,
            destination: endpoint(dst, e.dst_port),
            backend,
            masquerade,
            service,
            addrs,
            ports,
        }
    }

    fn service(&mut self, rev_nat_id: u32, protocol: u8) -> Option<String> {
        if let Some((name, at)) = self.name_cache.get(&rev_nat_id)
            && at.elapsed() < NAME_TTL
        {
            return name.clone();
        }
        let name = self
            .names
            .as_ref()
            .and_then(|m| m.get(&rev_nat_id, 0).ok())
            .map(|n| service_port_name(&n, protocol).to_string());
        self.name_cache.insert(rev_nat_id, (name.clone(), Instant::now()));
        name
    }

    fn interface(&mut self, ifindex: u32) -> String {
        self.interfaces
            .entry(ifindex)
            .or_insert_with(|| {
                nix::net::if_::if_indextoname(ifindex)
                    .ok()
                    .and_then(|n| n.into_string().ok())
                    .unwrap_or_else(|| format!("if{ifindex}"))
            })
            .clone()
    }
}

/// What an event's counter means, in kube-proxy's terms where it has them.
fn reason(counter: Counter) -> &'static str {
    use Counter::*;
    match counter {
        SockTranslated => "sent to a backend",
        TcNewFlow => "new flow sent to a backend",
        SockRejected | TcRejected => "the Service has no endpoints (REJECT)",
        SockClusterIpBadPort | TcClusterIpBadPort => "a cluster IP on a port no Service has (REJECT)",
        SockDropped | TcDropped => "the traffic policy is Local and this node has no endpoint (DROP)",
        SockUnallocatedClusterIp | TcUnallocatedClusterIp => {
            "an address of a Service CIDR no Service holds (DROP)"
        }
        SourceRangeDenied => "the source is outside loadBalancerSourceRanges (DROP)",
        TcCtInsertFailed => "the conntrack table refused the flow (full)",
        TcSnatPortsExhausted => "no masquerade port free for this backend",
        TcNoMasqueradeAddress => "no address of the family to masquerade with",
        TcLocalSctpUnrouted => {
            "the node's own SCTP: no route to the backend, or the backend is a node address (DROP)"
        }
        SockNoBackend | TcNoBackend => "the frontend changed while read; passed untranslated",
        TcFragment => "a fragment whose first fragment was not seen; passed untranslated",
        TcTruncated => "too short for its headers; passed untranslated",
        TcUnsupportedProtocol => "SCTP while the SCTP programs are not loaded; passed untranslated",
        _ => "",
    }
}

fn hook_name(h: u32) -> &'static str {
    match h {
        hook::CONNECT4 => "connect4",
        hook::SENDMSG4 => "sendmsg4",
        hook::CONNECT6 => "connect6",
        hook::SENDMSG6 => "sendmsg6",
        hook::TC_INGRESS => "tc-ingress",
        hook::TC_EGRESS => "tc-egress",
        _ => "?",
    }
}

/// cgroup v2 ids (their directories' inode numbers) to paths, found by walking the cgroup2 mount
/// on a miss (at most once per [`NAME_TTL`]).
struct Cgroups {
    root: Option<PathBuf>,
    paths: StdHashMap<u64, String>,
    walked: Option<Instant>,
}

impl Cgroups {
    fn new() -> Self {
        Cgroups {
            root: crate::datapath::cgroup::cgroup2_mount().ok(),
            paths: StdHashMap::new(),
            walked: None,
        }
    }

    fn path(&mut self, id: u64) -> String {
        if !self.paths.contains_key(&id)
            && let Some(root) = &self.root
            && self.walked.is_none_or(|at| at.elapsed() >= NAME_TTL)
        {
            self.paths.clear();
            walk_cgroups(root, root, &mut self.paths, 0);
            self.walked = Some(Instant::now());
        }
        self.paths
            .get(&id)
            .cloned()
            .unwrap_or_else(|| format!("cgroup id {id}"))
    }
}

fn walk_cgroups(root: &Path, dir: &Path, paths: &mut StdHashMap<u64, String>, depth: u32) {
    if let Ok(meta) = std::fs::metadata(dir) {
        let rel = dir.strip_prefix(root).unwrap_or(dir);
        paths.insert(meta.ino(), format!("/{}", rel.display()));
    }
    if depth >= 16 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            walk_cgroups(root, &entry.path(), paths, depth + 1);
        }
    }
}

/// `--service`, `--ip`, `--port` (`--type` is the programs' own filter).
struct Filter {
    service: Option<String>,
    ip: Option<IpAddr>,
    port: Option<u16>,
}

impl Filter {
    fn new(args: &MonitorArgs) -> Result<Self> {
        if let Some(s) = &args.service
            && !s.contains('/')
        {
            bail!("--service {s}: expected namespace/name");
        }
        Ok(Filter {
            service: args.service.clone(),
            ip: args.ip,
            port: args.port,
        })
    }

    fn matches(&self, shown: &Shown) -> bool {
        let service_ok = self.service.as_ref().is_none_or(|want| {
            shown.service.as_ref().is_some_and(|s| {
                // `ns/name` matches every port of the Service; `ns/name:port` one of them.
                s == want
                    || s.strip_prefix(want.as_str())
                        .is_some_and(|rest| rest.starts_with(':'))
            })
        });
        service_ok
            && self.ip.is_none_or(|ip| shown.addrs.contains(&ip))
            && self.port.is_none_or(|port| shown.ports.contains(&port))
    }
}

fn table_header() -> String {
    format!(
        "{:<12} {:<12} {:<28} {:<12} {:<5} {}",
        "TIME (UTC)", "TYPE", "EVENT", "WHERE", "PROTO", "FLOW"
    )
}

/// One event as a table line: the fixed columns, then the flow and what became of it.
fn table_line(s: &Shown) -> String {
    let place = match (&s.interface, s.hook) {
        (Some(interface), "tc-egress") => format!("{interface} egress"),
        (Some(interface), _) => interface.clone(),
        (None, hook) => hook.to_string(),
    };
    let mut line = format!(
        "{:<12} {:<12} {:<28} {:<12} {:<5} ",
        s.at.strftime("%H:%M:%S%.3f").to_string(),
        s.kind,
        s.event,
        place,
        s.protocol
    );
    if let Some(client) = &s.client {
        let _ = write!(line, "{client} ");
    }
    let _ = write!(line, "-> {}", s.destination);
    if let Some(backend) = &s.backend {
        let _ = write!(line, " => {backend}");
    }
    if let Some(masquerade) = &s.masquerade {
        let _ = write!(line, " (masqueraded as {masquerade})");
    }
    if let Some(service) = &s.service {
        let _ = write!(line, "  [{service}]");
    }
    if let Some(cgroup) = &s.cgroup {
        let _ = write!(line, "  cgroup {cgroup}");
    }
    if s.backend.is_none() && !s.reason.is_empty() {
        let _ = write!(line, ": {}", s.reason);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(counter: Counter) -> MonitorEvent {
        let mut e = MonitorEvent {
            counter: counter as u32,
            hook: hook::TC_INGRESS,
            ifindex: 1,
            family: AF_INET as u8,
            protocol: lb_common::proto::TCP,
            src_port: 40000,
            dst_port: 30080,
            ..Default::default()
        };
        e.src[..4].copy_from_slice(&[192, 168, 50, 101]);
        e.dst[..4].copy_from_slice(&[192, 168, 50, 11]);
        e
    }

    fn view() -> View {
        View {
            names: None,
            name_cache: StdHashMap::new(),
            cgroups: Cgroups {
                root: None,
                paths: StdHashMap::new(),
                walked: None,
            },
            interfaces: StdHashMap::new(),
        }
    }

    #[test]
    fn a_masqueraded_new_flow_reads_as_one_line() {
        let mut e = event(Counter::TcNewFlow);
        e.backend[..4].copy_from_slice(&[10, 244, 2, 2]);
        e.backend_port = 8080;
        e.nat[..4].copy_from_slice(&[192, 168, 50, 11]);
        e.nat_port = 21000;
        let clock = Clock::now();
        e.time_ns = clock.boot_ns;
        let shown = view().describe(&e, &clock);
        assert_eq!(shown.kind, "nat");
        assert_eq!(shown.event, "tc_new_flow");
        assert_eq!(shown.hook, "tc-ingress");
        assert_eq!(shown.interface.as_deref(), Some("lo"));
        assert_eq!(shown.client.as_deref(), Some("192.168.50.101:40000"));
        assert_eq!(shown.destination, "192.168.50.11:30080");
        assert_eq!(shown.backend.as_deref(), Some("10.244.2.2:8080"));
        assert_eq!(shown.masquerade.as_deref(), Some("192.168.50.11:21000"));
        assert_eq!(shown.time, clock.wall.to_string());
        let line = table_line(&shown);
        assert_eq!(line.find(" nat "), Some(12), "{line}");
        assert!(
            line.ends_with("192.168.50.101:40000 -> 192.168.50.11:30080 => 10.244.2.2:8080 (masqueraded as 192.168.50.11:21000)"),
            "{line}"
        );
        let json = serde_json::to_value(&shown).unwrap();
        assert_eq!(json["type"], "nat");
        assert_eq!(json["masquerade"], "192.168.50.11:21000");
        assert!(json.get("cgroup").is_none(), "{json}");
    }

    /// The node's own SCTP association, translated at egress (`lb_tc_sctp_out`): its hook and the
    /// interface it was leaving by, no cgroup, no masquerade.
    #[test]
    fn the_nodes_own_new_flow_reads_as_tc_egress_on_its_interface() {
        let mut e = event(Counter::TcNewFlow);
        e.hook = hook::TC_EGRESS;
        e.protocol = lb_common::proto::SCTP;
        e.backend[..4].copy_from_slice(&[10, 244, 2, 7]);
        e.backend_port = 13868;
        let clock = Clock::now();
        e.time_ns = clock.boot_ns;
        let shown = view().describe(&e, &clock);
        assert_eq!((shown.kind, shown.hook), ("nat", "tc-egress"));
        assert_eq!(shown.interface.as_deref(), Some("lo"));
        assert_eq!((&shown.cgroup, &shown.masquerade), (&None, &None));
        let line = table_line(&shown);
        assert!(
            line.contains(" lo egress "),
            "the interface and the direction: {line}"
        );
        assert!(
            line.contains("192.168.50.101:40000 -> 192.168.50.11:30080 => 10.244.2.7:13868"),
            "{line}"
        );
    }

    #[test]
    fn a_refused_ipv6_socket_call_names_its_hook_and_no_backend() {
        let mut e = MonitorEvent {
            counter: Counter::SockRejected as u32,
            hook: hook::CONNECT6,
            family: lb_common::family::AF_INET6 as u8,
            protocol: lb_common::proto::UDP,
            dst_port: 53,
            cgroup_id: 1,
            ..Default::default()
        };
        e.dst = "fd00::10".parse::<std::net::Ipv6Addr>().unwrap().octets();
        let shown = view().describe(&e, &Clock::now());
        assert_eq!(
            (shown.kind, shown.event, shown.hook),
            ("reject", "sock_rejected", "connect6")
        );
        assert_eq!(shown.destination, "[fd00::10]:53");
        assert_eq!(shown.client, None);
        assert_eq!(shown.backend, None);
        assert_eq!(shown.cgroup.as_deref(), Some("cgroup id 1"));
        assert_eq!(shown.reason, "the Service has no endpoints (REJECT)");
        assert!(table_line(&shown).ends_with(": the Service has no endpoints (REJECT)"));
    }

    #[test]
    fn filters_match_any_address_and_port_of_the_flow_and_a_service_by_its_name() {
        let mut e = event(Counter::TcNewFlow);
        e.backend[..4].copy_from_slice(&[10, 244, 2, 2]);
        e.backend_port = 8080;
        let mut shown = view().describe(&e, &Clock::now());
        shown.service = Some("demo/web:http".into());
        let filter = |service: Option<&str>, ip: Option<&str>, port: Option<u16>| Filter {
            service: service.map(String::from),
            ip: ip.map(|i| i.parse().unwrap()),
            port,
        };
        assert!(filter(None, None, None).matches(&shown));
        assert!(filter(Some("demo/web"), Some("10.244.2.2"), Some(8080)).matches(&shown));
        assert!(filter(Some("demo/web:http"), Some("192.168.50.101"), Some(30080)).matches(&shown));
        assert!(!filter(Some("demo/we"), None, None).matches(&shown));
        assert!(!filter(None, Some("10.244.2.3"), None).matches(&shown));
        assert!(!filter(None, None, Some(81)).matches(&shown));
    }

    #[test]
    fn every_event_says_why() {
        for counter in Counter::ALL.iter().filter(|c| event_type(**c) != 0) {
            assert!(!reason(*counter).is_empty(), "{}", counter.name());
        }
    }

    #[test]
    fn type_flags_select_the_programs_types() {
        assert_eq!(wanted_types(&[]), types::ALL);
        assert_eq!(
            wanted_types(&[MonitorType::Drop, MonitorType::Reject]),
            types::DROP | types::REJECT
        );
    }
}
