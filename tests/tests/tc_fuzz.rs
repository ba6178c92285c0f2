//! Fuzzing the real tc programs with BPF_PROG_TEST_RUN: thousands of random, truncated and mutated
//! packets (random bytes, IPv4-looking garbage, TCP/UDP/SCTP between frontends, the node, pods and
//! clients, random IHL and options, fragments, bit flips, ICMP errors quoting random and real
//! flows) through `lb_tc_ingress` and `lb_tc_egress` of a scratch data path programmed with a
//! handful of Services, interleaved with complete flows (DNAT, SNAT, reply, reverse NAT, ICMP
//! errors) whose every step is checked. Properties:
//!
//! - a test run never fails, except BPF_PROG_TEST_RUN's own EINVAL for an IPv4 or IPv6 frame
//!   shorter than Ethernet + IP headers; the verdict is TC_ACT_OK, TC_ACT_SHOT or TC_ACT_REDIRECT;
//! - a packet that is no frontend's, no masquerade reply and no translated flow's (nor an ICMP
//!   error about one) passes byte-identical;
//! - a modified packet changed only in the fields translation may change (addresses, ports and
//!   checksums, the right ones for the hook), and its checksums are still valid;
//! - a DNAT result is a backend of the frontend's scope; a source rewrite is the masquerade
//!   address and range, or a frontend;
//! - the service maps are exactly as programmed afterwards (the programs never write them), every
//!   conntrack entry is well formed, and a flow set up before the fuzz still translates both ways.
//!
//! The seed is printed; `LB_FUZZ_SEED=<n>` replays a run, `LB_FUZZ_PACKETS=<n>` changes its length.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    time::Instant,
};

use aya::maps::{HashMap as BpfHashMap, IterableMap, Map, MapData, MapInfo};
use etherparse::{IpNumber, Ipv4Header, PacketBuilder};
use lb_agent::{
    apply::{MapOps, Snapshot},
    datapath::{DatapathError, OBJECT, TcRun},
    node::NodeSettings,
    trace::ScratchDatapath,
    watch::ClusterState,
};
use lb_common::{
    config::DatapathConfig,
    conntrack::{Ct4Key, Ct4Value, dir, flags as ct},
    service::{SCOPE_EXTERNAL, SCOPE_INTERNAL, flags},
};
use lb_tests::{
    fixtures::{State, service, slice},
    packet::{self, summary, verify_checksums, verify_quoted_ip_checksum},
    require_root,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

const OK: i32 = 0;
const SHOT: i32 = 2;
const REDIRECT: i32 = 7;
/// `lb_ebpf::tc::MARK_MAGIC` / `MARK_MASK` / `MARK_ID`: the mark ingress puts on un-SNATed replies.
const MARK_MAGIC: u32 = 0x5EA0_0000;
const MARK_MASK: u32 = 0xFFF0_0000;
const MARK_ID: u32 = 0x000F_FFFF;
const EINVAL: i32 = 22;

const NODE_IP: &str = "192.168.50.11";
const CLIENT: &str = "192.168.50.100";
/// A client used only by the flows set up before the fuzz and checked after it.
const SENTINEL_CLIENT: &str = "192.168.50.222";
const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;
const SCTP: u8 = 132;

fn state() -> ClusterState {
    let mut s = ClusterState::default();
    s.add_service(
        service("f", "web")
            .cluster_ip("10.96.0.10")
            .port("http", "TCP", 80, 8080)
            .build(),
    );
    s.add_slice(
        slice("f", "web", "web-1")
            .endpoint("10.244.1.5", "node-a", State::Ready)
            .endpoint("10.244.2.7", "node-b", State::Ready)
            .endpoint("10.244.2.11", "node-b", State::NotReady)
            .port("http", "TCP", 8080)
            .build(),
    );
    s.add_service(
        service("f", "np")
            .cluster_ip("10.96.0.11")
            .port("http", "TCP", 80, 8080)
            .node_port(30080)
            .port("dns", "UDP", 53, 5353)
            .node_port(30053)
            .build(),
    );
    s.add_slice(
        slice("f", "np", "np-1")
            .endpoint("10.244.2.7", "node-b", State::Ready)
            .port("http", "TCP", 8080)
            .port("dns", "UDP", 5353)
            .build(),
    );
    s.add_service(
        service("f", "local")
            .cluster_ip("10.96.0.12")
            .port("http", "TCP", 80, 8080)
            .node_port(30081)
            .external_traffic_policy("Local")
            .build(),
    );
    s.add_slice(
        slice("f", "local", "local-1")
            .endpoint("10.244.1.6", "node-a", State::Ready)
            .endpoint("10.244.2.8", "node-b", State::Ready)
            .port("http", "TCP", 8080)
            .build(),
    );
    s.add_service(
        service("f", "local-none")
            .cluster_ip("10.96.0.13")
            .port("http", "TCP", 80, 8080)
            .node_port(30082)
            .external_traffic_policy("Local")
            .build(),
    );
    s.add_slice(
        slice("f", "local-none", "ln-1")
            .endpoint("10.244.2.9", "node-b", State::Ready)
            .port("http", "TCP", 8080)
            .build(),
    );
    s.add_service(
        service("f", "empty")
            .cluster_ip("10.96.0.14")
            .port("http", "TCP", 80, 8080)
            .port("dns", "UDP", 53, 5353)
            .build(),
    );
    s.add_service(
        service("f", "lb")
            .cluster_ip("10.96.0.15")
            .port("http", "TCP", 80, 8080)
            .node_port(30083)
            .load_balancer_ip("203.0.113.10")
            .source_ranges(&["198.51.100.0/24"])
            .build(),
    );
    s.add_slice(
        slice("f", "lb", "lb-1")
            .endpoint("10.244.1.5", "node-a", State::Ready)
            .port("http", "TCP", 8080)
            .build(),
    );
    s.add_service(
        service("f", "dns")
            .cluster_ip("10.96.0.16")
            .port("dns", "UDP", 53, 5353)
            .port("dns-tcp", "TCP", 53, 5353)
            .build(),
    );
    s.add_slice(
        slice("f", "dns", "dns-1")
            .endpoint("10.244.1.5", "node-a", State::Ready)
            .endpoint("10.244.2.12", "node-b", State::Terminating)
            .port("dns", "UDP", 5353)
            .port("dns-tcp", "TCP", 5353)
            .build(),
    );
    s.add_service(
        service("f", "ext")
            .cluster_ip("10.96.0.17")
            .port("https", "TCP", 443, 8443)
            .external_ips(&["198.51.100.50"])
            .client_ip_affinity(60)
            .build(),
    );
    s.add_slice(
        slice("f", "ext", "ext-1")
            .endpoint("10.244.2.10", "node-b", State::Ready)
            .endpoint("10.244.1.7", "node-a", State::Ready)
            .port("https", "TCP", 8443)
            .build(),
    );
    s.add_service(
        service("f", "sctp")
            .cluster_ip("10.96.0.18")
            .port("s", "SCTP", 9999, 9999)
            .build(),
    );
    s.add_slice(
        slice("f", "sctp", "sctp-1")
            .endpoint("10.244.1.5", "node-a", State::Ready)
            .port("s", "SCTP", 9999)
            .build(),
    );
    s
}

fn settings() -> NodeSettings {
    NodeSettings {
        node_name: "node-a".into(),
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        nodeport_addresses: vec![],
        masquerade_all: false,
        localhost_nodeports: true,
        bind_address: None,
    }
}

fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

/// One scope of a frontend, as programmed.
#[derive(Clone, Debug)]
struct Scope {
    flags: u16,
    backends: BTreeSet<(Ipv4Addr, u16)>,
}

#[derive(Clone, Debug)]
struct Fe {
    rev_nat_id: u32,
    scopes: BTreeMap<u8, Scope>,
}

impl Fe {
    /// The scope traffic from `client` uses (`lb::lookup_frontend`).
    fn scope_for(&self, cfg: &DatapathConfig, client: Ipv4Addr) -> &Scope {
        let ext = &self.scopes[&SCOPE_EXTERNAL];
        if ext.flags & flags::TWO_SCOPES != 0 && cfg.is_pod_address(client.octets()) == Some(true) {
            &self.scopes[&SCOPE_INTERNAL]
        } else {
            ext
        }
    }

    fn all_backends(&self) -> BTreeSet<(Ipv4Addr, u16)> {
        self.scopes
            .values()
            .flat_map(|s| s.backends.iter().copied())
            .collect()
    }
}

/// What the maps say, read back from them: the oracle of every check.
struct World {
    frontends: BTreeMap<(Ipv4Addr, u16, u8), Fe>,
    by_rev: BTreeMap<u32, (Ipv4Addr, u16, u8)>,
    frontend_addrs: BTreeSet<Ipv4Addr>,
    backend_addrs: BTreeSet<Ipv4Addr>,
    backends_by_id: BTreeMap<u32, (Ipv4Addr, u16, u8)>,
    cfg: DatapathConfig,
    snat: Ipv4Addr,
}

impl World {
    fn read(s: &ScratchDatapath) -> (World, Snapshot) {
        let maps = s.maps();
        let snap = maps.snapshot().expect("snapshot of the scratch maps");
        let cfg = maps.config.get(&0, 0).expect("datapath config");
        let backends_by_id: BTreeMap<u32, (Ipv4Addr, u16, u8)> = snap
            .backends
            .iter()
            .map(|(id, b)| (*id, (Ipv4Addr::from(b.addr), b.port, b.proto)))
            .collect();
        let mut frontends: BTreeMap<(Ipv4Addr, u16, u8), Fe> = BTreeMap::new();
        for (key, value) in &snap.services {
            if key.slot != 0 {
                continue;
            }
            let mut backends = BTreeSet::new();
            for slot in 1..=value.count {
                let entry = snap.services[&key.with_slot(slot)];
                let (addr, port, _) = backends_by_id[&entry.backend_id];
                backends.insert((addr, port));
            }
            let fe = frontends
                .entry((Ipv4Addr::from(key.addr), key.port, key.proto))
                .or_insert_with(|| Fe {
                    rev_nat_id: value.rev_nat_id,
                    scopes: BTreeMap::new(),
                });
            fe.scopes.insert(
                key.scope,
                Scope {
                    flags: value.flags,
                    backends,
                },
            );
        }
        let world = World {
            by_rev: frontends.iter().map(|(k, f)| (f.rev_nat_id, *k)).collect(),
            frontend_addrs: frontends.keys().map(|k| k.0).collect(),
            backend_addrs: backends_by_id.values().map(|b| b.0).collect(),
            frontends,
            backends_by_id,
            snat: Ipv4Addr::from(cfg.snat_addr),
            cfg,
        };
        (world, snap)
    }

    fn in_snat_range(&self, port: u16) -> bool {
        (self.cfg.snat_port_min..=self.cfg.snat_port_max).contains(&port)
    }

    fn valid_mark(&self, mark: u32) -> bool {
        mark & MARK_MASK == MARK_MAGIC && self.by_rev.contains_key(&(mark & MARK_ID))
    }
}

/// A packet as the programs parse it (`lb_ebpf::tc::parse`).
#[derive(Clone, Copy, Debug)]
struct Tuple {
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
    proto: u8,
}

#[derive(Clone, Copy, Debug)]
enum Parsed {
    NotIpv4,
    Truncated,
    Fragment,
    /// TCP, UDP or SCTP, and the offset of the L4 header.
    L4(Tuple, usize),
    /// ICMP: outer addresses, the offset of the ICMP header, and the quoted packet of an error the
    /// programs read (destination unreachable, time exceeded, parameter problem quoting TCP/UDP
    /// with a 20-byte header), with its offset.
    Icmp(Tuple, usize, Option<(Tuple, usize)>),
    Other,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn addr(b: &[u8], at: usize) -> Ipv4Addr {
    Ipv4Addr::new(b[at], b[at + 1], b[at + 2], b[at + 3])
}

fn parse(p: &[u8]) -> Parsed {
    if p.len() < 14 {
        return Parsed::Truncated;
    }
    if be16(p, 12) != 0x0800 {
        return Parsed::NotIpv4;
    }
    if p.len() < 34 {
        return Parsed::Truncated;
    }
    if p[14] >> 4 != 4 {
        return Parsed::NotIpv4;
    }
    let ihl = usize::from(p[14] & 0x0f) * 4;
    if ihl < 20 {
        return Parsed::Truncated;
    }
    if be16(p, 20) & 0x3fff != 0 {
        return Parsed::Fragment;
    }
    let l4 = 14 + ihl;
    let mut t = Tuple {
        src: addr(p, 26),
        dst: addr(p, 30),
        sport: 0,
        dport: 0,
        proto: p[23],
    };
    match t.proto {
        TCP | UDP | SCTP => {
            let need = if t.proto == TCP { 20 } else { 8 };
            if p.len() < l4 + need {
                return Parsed::Truncated;
            }
            t.sport = be16(p, l4);
            t.dport = be16(p, l4 + 2);
            Parsed::L4(t, l4)
        }
        ICMP => {
            if p.len() < l4 + 8 {
                return Parsed::Truncated;
            }
            let q = l4 + 8;
            let quote = (matches!(p[l4], 3 | 11 | 12)
                && p.len() >= q + 24
                && p[q] == 0x45
                && matches!(p[q + 9], TCP | UDP))
            .then(|| {
                (
                    Tuple {
                        src: addr(p, q + 12),
                        dst: addr(p, q + 16),
                        sport: be16(p, q + 20),
                        dport: be16(p, q + 22),
                        proto: p[q + 9],
                    },
                    q,
                )
            });
            Parsed::Icmp(t, l4, quote)
        }
        _ => Parsed::Other,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hook {
    Ingress,
    Egress,
}

/// Counters for the report.
#[derive(Debug, Default)]
struct Stats {
    runs: usize,
    einval: usize,
    by_action: BTreeMap<(&'static str, i32), usize>,
    modified: BTreeMap<&'static str, usize>,
    walks: usize,
    walks_translated: usize,
    walks_masqueraded: usize,
    walks_refused: usize,
    checksum_checked: usize,
}

/// The byte offsets a translation may change, by hook and packet kind.
fn mutable_offsets(hook: Hook, parsed: &Parsed) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    let range = |out: &mut BTreeSet<usize>, from: usize, len: usize| out.extend(from..from + len);
    match (hook, parsed) {
        (Hook::Ingress, Parsed::L4(t, l4)) | (Hook::Egress, Parsed::L4(t, l4)) => {
            range(&mut out, 24, 2); // IP checksum
            if hook == Hook::Ingress {
                range(&mut out, 30, 4);
                range(&mut out, l4 + 2, 2);
            } else {
                range(&mut out, 26, 4);
                range(&mut out, *l4, 2);
            }
            range(&mut out, l4 + if t.proto == TCP { 16 } else { 6 }, 2);
        }
        (_, Parsed::Icmp(_, l4, Some((_, q)))) => {
            if hook == Hook::Ingress {
                range(&mut out, 24, 2);
                range(&mut out, 30, 4);
                range(&mut out, q + 12, 8); // quoted source and destination
                range(&mut out, q + 20, 4); // quoted ports
            } else {
                range(&mut out, q + 16, 4);
                range(&mut out, q + 22, 2);
            }
            range(&mut out, l4 + 2, 2); // ICMP checksum
            range(&mut out, q + 10, 2); // quoted IP checksum
        }
        _ => {}
    }
    out
}

/// Whether the programs may touch this packet at all: it is addressed to a frontend or to the
/// masquerade address (ingress), comes from or goes to a backend or carries the un-SNAT mark
/// (egress), or is an ICMP error about such a packet.
fn candidate(w: &World, hook: Hook, parsed: &Parsed, mark: u32) -> bool {
    let marked = w.valid_mark(mark);
    match (hook, parsed) {
        (_, Parsed::L4(t, _)) if t.proto == SCTP => false,
        (Hook::Ingress, Parsed::L4(t, _)) => {
            w.frontends.contains_key(&(t.dst, t.dport, t.proto)) || t.dst == w.snat
        }
        (Hook::Egress, Parsed::L4(t, _)) => {
            marked || w.backend_addrs.contains(&t.src) || w.backend_addrs.contains(&t.dst)
        }
        (Hook::Ingress, Parsed::Icmp(_, _, Some((q, _)))) => {
            w.frontend_addrs.contains(&q.src) || q.src == w.snat
        }
        (Hook::Egress, Parsed::Icmp(_, _, Some((q, _)))) => marked || w.backend_addrs.contains(&q.dst),
        _ => false,
    }
}

fn is_einval(e: &DatapathError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.raw_os_error() == Some(EINVAL)
        {
            return true;
        }
        source = err.source();
    }
    format!("{e:?}").contains("os error 22") || format!("{e:?}").contains("Invalid argument")
}

fn hex(p: &[u8]) -> String {
    p.iter().map(|b| format!("{b:02x}")).collect()
}

fn fail_with(seed: u64, what: &str, hook: Hook, input: &[u8], mark: u32, run: Option<&TcRun>) -> ! {
    panic!(
        "{what}\n  seed {seed} (replay with LB_FUZZ_SEED={seed}), {hook:?}, mark {mark:#x}\n  in : {}\n  \
         parsed {:?}\n  out: {} (action {:?}, mark {:?})",
        hex(input),
        parse(input),
        run.map(|r| hex(&r.packet)).unwrap_or_default(),
        run.map(|r| r.action),
        run.map(|r| r.mark),
    )
}

struct Fuzzer {
    s: ScratchDatapath,
    w: World,
    rng: StdRng,
    seed: u64,
    stats: Stats,
    /// Packets of real flows (DNAT and SNAT results, replies), for ICMP errors to quote.
    seen: Vec<Vec<u8>>,
    /// (source address, source port) of every TCP/UDP packet run so far.
    sources: BTreeSet<(Ipv4Addr, u16)>,
}

impl Fuzzer {
    /// Runs one packet through one program and checks every per-packet property.
    fn run(&mut self, hook: Hook, input: &[u8], mark: u32) -> Option<TcRun> {
        self.stats.runs += 1;
        let name = match hook {
            Hook::Ingress => "lb_tc_ingress",
            Hook::Egress => "lb_tc_egress",
        };
        let result = if mark == 0 {
            self.s.datapath.test_run_tc(name, input, 1)
        } else {
            self.s.datapath.test_run_tc_with_mark(name, input, mark)
        };
        let run = match result {
            Ok(run) => run,
            Err(e) => {
                // BPF_PROG_TEST_RUN refuses an IPv4 or IPv6 frame without room for its IP header
                // (a random frame is typed IPv6 now and then: seed 7683810944893409766).
                let short = input.len() < 14
                    || match be16(input, 12) {
                        0x0800 => input.len() < 14 + 20,
                        0x86dd => input.len() < 14 + 40,
                        _ => false,
                    };
                if short && is_einval(&e) {
                    self.stats.einval += 1;
                    return None;
                }
                fail_with(
                    self.seed,
                    &format!("test run failed: {e}"),
                    hook,
                    input,
                    mark,
                    None,
                );
            }
        };
        let hook_name = if hook == Hook::Ingress {
            "ingress"
        } else {
            "egress"
        };
        *self.stats.by_action.entry((hook_name, run.action)).or_default() += 1;
        let parsed = parse(input);
        if let Parsed::L4(t, _) = parsed {
            self.sources.insert((t.src, t.sport));
        }
        let w = &self.w;
        let seed = self.seed;
        let fail = |what: &str| -> ! { fail_with(seed, what, hook, input, mark, Some(&run)) };
        if ![OK, SHOT, REDIRECT].contains(&run.action) {
            fail("unexpected verdict");
        }
        // The mark: egress clears the un-SNAT mark when it uses it and leaves every other mark
        // alone; ingress sets it only for a known frontend.
        match hook {
            Hook::Egress if run.mark != mark && (run.mark != 0 || mark & MARK_MASK != MARK_MAGIC) => {
                fail("egress changed the mark")
            }
            Hook::Ingress if run.mark != 0 && !w.valid_mark(run.mark) => fail("ingress set a bad mark"),
            _ => {}
        }
        let cand = candidate(w, hook, &parsed, mark);
        if !cand {
            if run.action != OK || run.packet != input {
                fail("a packet that is no frontend's and no translated flow's was not passed untouched");
            }
            if run.mark != 0 && hook == Hook::Ingress {
                fail("ingress marked a packet it does not translate");
            }
            return Some(run);
        }
        match run.action {
            REDIRECT => {
                let Parsed::L4(t, l4) = parsed else {
                    fail("REDIRECT of a non-TCP/UDP packet")
                };
                if hook != Hook::Ingress {
                    fail("REDIRECT outside ingress");
                }
                let Some(fe) = w.frontends.get(&(t.dst, t.dport, t.proto)) else {
                    fail("REDIRECT of a packet to no frontend")
                };
                let scope = fe.scope_for(&w.cfg, t.src);
                if !scope.backends.is_empty() || scope.flags & flags::DROP_IF_EMPTY != 0 {
                    fail("REJECT of a frontend that has backends or drops");
                }
                let out = &run.packet;
                // The quote: the whole IP header, options included, and 8 bytes of L4.
                let quote = l4 - 14 + 8;
                if out.len() != 14 + 20 + 8 + quote || out[23] != ICMP || out[34] != 3 || out[35] != 3 {
                    fail("the REJECT is not an ICMP port unreachable");
                }
                if addr(out, 26) != t.dst || addr(out, 30) != t.src || out[42..] != input[14..14 + quote] {
                    fail("the REJECT is not from the frontend to the client quoting the packet");
                }
                verify_checksums(out).unwrap_or_else(|e| fail(&format!("REJECT checksums: {e}")));
                if t.src.octets()[0] == 0
                    || t.src.is_loopback()
                    || t.src.octets()[0] >= 224
                    || input[0] & 1 != 0
                {
                    fail("an ICMP error went to a source RFC 1122 forbids answering");
                }
                *self.stats.modified.entry("reject").or_default() += 1;
                return Some(run);
            }
            SHOT => return Some(run),
            _ => {}
        }
        if run.packet.len() != input.len() {
            fail("TC_ACT_OK changed the length");
        }
        if run.packet == input {
            return Some(run);
        }
        // Modified: only the fields of this translation, with valid checksums.
        let allowed = mutable_offsets(hook, &parsed);
        if let Some(i) = (0..input.len()).find(|i| input[*i] != run.packet[*i] && !allowed.contains(i)) {
            fail(&format!("byte {i} changed, which no translation may touch"));
        }
        if verify_checksums(input).is_ok() {
            self.stats.checksum_checked += 1;
            verify_checksums(&run.packet).unwrap_or_else(|e| fail(&format!("checksum broken: {e}")));
            if matches!(parsed, Parsed::Icmp(..)) && verify_quoted_ip_checksum(input).is_ok() {
                verify_quoted_ip_checksum(&run.packet)
                    .unwrap_or_else(|e| fail(&format!("quoted checksum broken: {e}")));
            }
        }
        let out = parse(&run.packet);
        match (hook, parsed, out) {
            (Hook::Ingress, Parsed::L4(t, _), Parsed::L4(o, _)) => {
                if let Some(fe) = w.frontends.get(&(t.dst, t.dport, t.proto)) {
                    // DNAT: a backend of the scope this client uses (the flow may predate the
                    // fuzz's own packets, but the Services never change here).
                    if !fe.scope_for(&w.cfg, t.src).backends.contains(&(o.dst, o.dport)) {
                        fail("DNAT to an address that is not a backend of this frontend's scope");
                    }
                    *self.stats.modified.entry("ingress DNAT").or_default() += 1;
                } else if t.dst == w.snat && w.in_snat_range(t.dport) && w.backend_addrs.contains(&t.src) {
                    if !w.valid_mark(run.mark) {
                        fail("un-SNAT without the mark for egress");
                    }
                    *self.stats.modified.entry("ingress un-SNAT").or_default() += 1;
                } else {
                    fail("ingress rewrote a packet that is neither a frontend's nor a masquerade reply");
                }
            }
            (Hook::Egress, Parsed::L4(t, _), Parsed::L4(o, _)) => {
                let to_snat = o.src == w.snat && w.in_snat_range(o.sport);
                if w.valid_mark(mark) && run.mark == 0 {
                    // Marked by ingress as an un-SNATed reply (and used, so cleared): the source
                    // becomes the frontend the mark names.
                    let fe = w.by_rev[&(mark & MARK_ID)];
                    if (o.src, o.sport, o.proto) != (fe.0, fe.1, fe.2) {
                        fail("egress restored another frontend than the mark names");
                    }
                    *self
                        .stats
                        .modified
                        .entry("egress reverse NAT (marked)")
                        .or_default() += 1;
                } else if to_snat && w.backend_addrs.contains(&t.dst) {
                    *self.stats.modified.entry("egress SNAT").or_default() += 1;
                } else if w.frontends.contains_key(&(o.src, o.sport, o.proto))
                    && w.backend_addrs.contains(&t.src)
                {
                    *self.stats.modified.entry("egress reverse NAT").or_default() += 1;
                } else {
                    fail("egress rewrote the source to neither the masquerade address nor a frontend");
                }
            }
            (Hook::Ingress, Parsed::Icmp(outer, _, Some(_)), Parsed::Icmp(o, _, Some(_))) => {
                if o.src != outer.src {
                    fail("ingress rewrote the source of an ICMP error");
                }
                *self.stats.modified.entry("ingress ICMP error").or_default() += 1;
            }
            (Hook::Egress, Parsed::Icmp(_, _, Some(_)), Parsed::Icmp(_, _, Some((q, _)))) => {
                let expected = if w.valid_mark(mark) && run.mark == 0 {
                    let fe = w.by_rev[&(mark & MARK_ID)];
                    (fe.0, fe.1) == (q.dst, q.dport)
                } else {
                    w.frontends.contains_key(&(q.dst, q.dport, q.proto))
                };
                if !expected {
                    fail("egress put a non-frontend in an ICMP error's quote");
                }
                *self.stats.modified.entry("egress ICMP error").or_default() += 1;
            }
            _ => fail("a modified packet no longer parses as it did"),
        }
        Some(run)
    }

    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.rng.random_range(0..v.len())]
    }

    fn some_addr(&mut self) -> Ipv4Addr {
        let mut pool: Vec<Ipv4Addr> = self.w.frontend_addrs.iter().copied().collect();
        pool.extend(self.w.backend_addrs.iter().copied());
        pool.extend(
            [
                NODE_IP,
                CLIENT,
                "198.51.100.7",
                "10.244.3.3",
                "10.244.1.1",
                "127.0.0.1",
                "0.0.0.0",
                "255.255.255.255",
            ]
            .map(ip),
        );
        match self.rng.random_range(0..10) {
            0 => Ipv4Addr::from(self.rng.random::<u32>()),
            _ => self.pick(&pool),
        }
    }

    fn some_port(&mut self) -> u16 {
        match self.rng.random_range(0..10) {
            0..4 => {
                let ports: Vec<u16> = self.w.frontends.keys().map(|k| k.1).collect();
                self.pick(&ports)
            }
            4..6 => self.pick(&[8080, 5353, 8443, 9999]),
            6..8 => self
                .rng
                .random_range(self.w.cfg.snat_port_min..=self.w.cfg.snat_port_max),
            8 => self.pick(&[0, 1, 65_535]),
            _ => self.rng.random(),
        }
    }

    /// A well-formed TCP or UDP packet between addresses of interest.
    fn valid_packet(&mut self) -> Vec<u8> {
        let (src, dst) = (self.some_addr().to_string(), self.some_addr().to_string());
        let (sport, dport) = (self.some_port(), self.some_port());
        let mut spec = if self.rng.random_bool(0.5) {
            packet::tcp(&src, sport, &dst, dport)
        } else {
            packet::udp(&src, sport, &dst, dport)
        };
        if !spec.udp && self.rng.random_bool(0.5) {
            let len = self.rng.random_range(0..64);
            let payload: Vec<u8> = (0..len).map(|_| self.rng.random()).collect();
            spec = spec.data(&payload);
        }
        if self.rng.random_bool(0.2) {
            let words = self.rng.random_range(1..=10);
            spec.options = (0..words * 4)
                .map(|_| {
                    let any = self.rng.random();
                    self.pick(&[0u8, 1, 1, 1, 7, 68, 130, any])
                })
                .collect();
        }
        spec.more_fragments = self.rng.random_bool(0.05);
        spec.ttl = self.rng.random();
        spec.build()
    }

    /// A valid packet, mangled: truncated, bits flipped, IHL, total length, flags, protocol...
    /// With probability 1/2 its checksums are made valid again, so that the program's checksum
    /// maintenance is checked on the mangled packet too.
    fn mutated_packet(&mut self) -> Vec<u8> {
        let mut p = if !self.seen.is_empty() && self.rng.random_bool(0.3) {
            let i = self.rng.random_range(0..self.seen.len());
            self.seen[i].clone()
        } else {
            self.valid_packet()
        };
        let mut truncate = None;
        for _ in 0..self.rng.random_range(1..4) {
            // (offset, value) of a one-byte change, if any.
            let change: Option<(usize, u8)> = match self.rng.random_range(0..8) {
                0 => {
                    let at = self.rng.random_range(0..p.len());
                    Some((at, p[at] ^ (1 << self.rng.random_range(0..8))))
                }
                1 => Some((14, 0x40 | self.rng.random_range(0..16u8))),
                2 => Some((self.rng.random_range(16..18), self.rng.random())),
                3 => {
                    let any = self.rng.random();
                    let frag: u16 = self.pick(&[0x2000, 0x0001, 0x1fff, 0x4000, 0x8000, any]);
                    if p.len() > 21 {
                        p[20..22].copy_from_slice(&frag.to_be_bytes());
                    }
                    None
                }
                4 => {
                    let any = self.rng.random();
                    Some((23, self.pick(&[TCP, UDP, ICMP, SCTP, 0, 41, 47, any])))
                }
                5 => Some((12, self.rng.random())),
                6 => {
                    truncate = Some(self.rng.random_range(14..p.len().max(15)));
                    None
                }
                _ => Some((self.rng.random_range(14..14 + 60 + 20), self.rng.random())),
            };
            if let Some((at, value)) = change
                && at < p.len()
            {
                p[at] = value;
            }
        }
        if self.rng.random_bool(0.5) {
            fix_checksums(&mut p);
        }
        if let Some(len) = truncate {
            p.truncate(len);
        }
        p
    }

    /// An ICMP message from somewhere to somewhere, quoting a random or a real packet.
    fn icmp_packet(&mut self) -> Vec<u8> {
        let quoted = if !self.seen.is_empty() && self.rng.random_bool(0.6) {
            let i = self.rng.random_range(0..self.seen.len());
            self.seen[i].clone()
        } else {
            self.valid_packet()
        };
        let (kind, code) = self.pick(&[
            (3u8, 3u8),
            (3, 4),
            (3, 1),
            (11, 0),
            (12, 0),
            (8, 0),
            (0, 0),
            (5, 1),
        ]);
        let (from, to) = if self.rng.random_bool(0.5) {
            // Addressed like a real error: to the quoted packet's source.
            let s = summary_or(&quoted);
            (self.some_addr(), s.map_or(self.some_addr(), |s| s.0))
        } else {
            (self.some_addr(), self.some_addr())
        };
        let ihl = usize::from(quoted.get(14).map_or(5, |b| b & 0x0f)) * 4;
        let cut = match self.rng.random_range(0..4) {
            0 => quoted.len().saturating_sub(14),
            1 => self.rng.random_range(0..quoted.len().saturating_sub(14).max(1)),
            _ => (ihl + 8).min(quoted.len().saturating_sub(14)),
        };
        let quote = quoted.get(14..14 + cut).unwrap_or_default();
        let mut rest = [0u8; 4];
        if kind == 3 && code == 4 {
            rest[2..4].copy_from_slice(&1400u16.to_be_bytes());
        }
        icmp_raw(from, to, kind, code, rest, quote)
    }

    /// A complete flow through the node, every step checked: the first packet is DNATed to a
    /// backend of the right scope (or rejected/dropped as the frontend says), masqueraded when
    /// the frontend asks for it, the reply is un-SNATed and reverse-NATed to the frontend, and
    /// ICMP errors about the flow are translated back.
    fn walk(&mut self) {
        self.stats.walks += 1;
        let keys: Vec<(Ipv4Addr, u16, u8)> = self
            .w
            .frontends
            .keys()
            .copied()
            .filter(|k| k.2 != SCTP && !k.0.is_loopback())
            .collect();
        let key = self.pick(&keys);
        let clients = [
            "192.168.50.100",
            "198.51.100.7",
            "10.244.3.3",
            "10.244.1.5",
            "172.16.9.9",
        ]
        .map(ip);
        let client = self.pick(&clients);
        // A source no packet has used yet: two flows from one client port to two frontends that
        // share a backend have the same tuple after DNAT, and the newest owns it (see
        // `a_client_port_reused_on_another_frontend_is_not_masqueraded_by_the_old_flow` in
        // tc_fixtures), so a reused port would make this walk's expectations depend on history.
        let sport = loop {
            let sport = self.rng.random_range(1024..=65_535u16);
            if !self.sources.contains(&(client, sport)) {
                break sport;
            }
        };
        self.walk_one(key, client, sport);
    }

    fn walk_one(
        &mut self,
        (fe_addr, fe_port, proto): (Ipv4Addr, u16, u8),
        client: Ipv4Addr,
        sport: u16,
    ) -> Option<Flow> {
        let fe = self.w.frontends[&(fe_addr, fe_port, proto)].clone();
        let scope = fe.scope_for(&self.w.cfg, client).clone();
        let build = |src: Ipv4Addr, sp: u16, dst: Ipv4Addr, dp: u16, data: &[u8]| {
            let spec = if proto == TCP {
                packet::tcp(&src.to_string(), sp, &dst.to_string(), dp)
            } else {
                packet::udp(&src.to_string(), sp, &dst.to_string(), dp)
            };
            if data.is_empty() {
                spec.build()
            } else {
                spec.data(data).build()
            }
        };
        let first = build(client, sport, fe_addr, fe_port, b"");
        let r1 = self.run(Hook::Ingress, &first, 0)?;
        let seed = self.seed;
        let flow_fail = |what: &str, p: &[u8]| -> ! {
            panic!(
                "flow {client}:{sport} -> {fe_addr}:{fe_port}/{proto}: {what}\n  seed {seed}\n  packet {}",
                hex(p)
            )
        };
        if r1.action != OK {
            let refused = scope.backends.is_empty() || scope.flags & flags::SOURCE_RANGES != 0;
            if !refused {
                flow_fail(
                    &format!("verdict {} for a frontend with backends", r1.action),
                    &r1.packet,
                );
            }
            self.stats.walks_refused += 1;
            return None;
        }
        let o1 = summary(&r1.packet);
        if (o1.src, o1.sport) != (client, sport) || !scope.backends.contains(&(o1.dst, o1.dport)) {
            flow_fail("DNAT result is not client -> a backend of the scope", &r1.packet);
        }
        self.stats.walks_translated += 1;
        self.seen.push(r1.packet.clone());
        let r2 = self.run(Hook::Egress, &r1.packet, 0)?;
        let o2 = summary(&r2.packet);
        if r2.action != OK || (o2.dst, o2.dport) != (o1.dst, o1.dport) {
            flow_fail("egress of the DNATed packet", &r2.packet);
        }
        let masqueraded = (o2.src, o2.sport) != (client, sport);
        let from_pod = self.w.cfg.is_pod_address(client.octets()) == Some(true);
        let must_masquerade = scope.flags & flags::MASQUERADE != 0
            || (scope.flags & flags::MASQUERADE_OFF_CLUSTER != 0 && !from_pod)
            || o1.dst == client;
        if masqueraded && (o2.src != self.w.snat || !self.w.in_snat_range(o2.sport)) {
            flow_fail(
                "masqueraded to something else than the node's address and range",
                &r2.packet,
            );
        }
        if must_masquerade != masqueraded {
            flow_fail(
                if must_masquerade {
                    "not masqueraded"
                } else {
                    "masqueraded"
                },
                &r2.packet,
            );
        }
        if masqueraded {
            self.stats.walks_masqueraded += 1;
        }
        self.seen.push(r2.packet.clone());
        // The reply, from the backend to whoever it saw.
        let reply = build(o1.dst, o1.dport, o2.src, o2.sport, b"pong");
        let r3 = self.run(Hook::Ingress, &reply, 0)?;
        let o3 = summary(&r3.packet);
        if masqueraded {
            if r3.action != OK
                || (o3.dst, o3.dport) != (client, sport)
                || (o3.src, o3.sport) != (o1.dst, o1.dport)
            {
                flow_fail("un-SNAT of the reply", &r3.packet);
            }
            if r3.mark != MARK_MAGIC | fe.rev_nat_id {
                flow_fail("the un-SNATed reply is not marked with its frontend", &r3.packet);
            }
        } else if r3.packet != reply {
            flow_fail("ingress touched a reply it does not un-SNAT", &r3.packet);
        }
        let r4 = self.run(Hook::Egress, &r3.packet, r3.mark)?;
        let o4 = summary(&r4.packet);
        if r4.action != OK
            || (o4.src, o4.sport) != (fe_addr, fe_port)
            || (o4.dst, o4.dport) != (client, sport)
        {
            flow_fail(
                "the reply does not leave from the frontend to the client",
                &r4.packet,
            );
        }
        self.seen.push(r4.packet.clone());
        // ICMP errors about the flow.
        if masqueraded {
            // A router between the nodes about the masqueraded packet: back to the client.
            let err = icmp_raw(
                ip("10.244.9.1"),
                self.w.snat,
                3,
                4,
                [0, 0, 5, 120],
                &r2.packet[14..42],
            );
            let e1 = self.run(Hook::Ingress, &err, 0)?;
            let q = packet::quoted_summary(&e1.packet);
            if e1.action != OK
                || addr(&e1.packet, 30) != client
                || (q.src, q.sport) != (client, sport)
                || (q.dst, q.dport) != (o1.dst, o1.dport)
            {
                flow_fail("ICMP error about a masqueraded packet, at ingress", &e1.packet);
            }
            let e2 = self.run(Hook::Egress, &e1.packet, e1.mark)?;
            let q = packet::quoted_summary(&e2.packet);
            if e2.action != OK
                || (q.dst, q.dport) != (fe_addr, fe_port)
                || (q.src, q.sport) != (client, sport)
            {
                flow_fail("ICMP error about a masqueraded packet, at egress", &e2.packet);
            }
        } else {
            // The backend's side about the DNATed packet, leaving towards the client.
            let err = icmp_raw(o1.dst, client, 3, 3, [0; 4], &r1.packet[14..42]);
            let e = self.run(Hook::Egress, &err, 0)?;
            let q = packet::quoted_summary(&e.packet);
            if e.action != OK
                || (q.dst, q.dport) != (fe_addr, fe_port)
                || (q.src, q.sport) != (client, sport)
                || e.packet[14..34] != err[14..34]
            {
                flow_fail("ICMP error about a DNATed packet, at egress", &e.packet);
            }
        }
        Some(Flow {
            client,
            sport,
            fe: (fe_addr, fe_port, proto),
            backend: (o1.dst, o1.dport),
            seen_as: (o2.src, o2.sport),
        })
    }
}

/// A flow the fuzz set up, to check after it.
#[derive(Clone, Copy, Debug)]
struct Flow {
    client: Ipv4Addr,
    sport: u16,
    fe: (Ipv4Addr, u16, u8),
    backend: (Ipv4Addr, u16),
    /// The source the backend sees (the client, or the masquerade address and port).
    seen_as: (Ipv4Addr, u16),
}

fn summary_or(p: &[u8]) -> Option<(Ipv4Addr, Ipv4Addr)> {
    (p.len() >= 34 && be16(p, 12) == 0x0800).then(|| (addr(p, 26), addr(p, 30)))
}

fn checksum(data: &[u8], initial: u32) -> u16 {
    let mut sum = initial;
    for c in data.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Recomputes the IPv4 header checksum and, when the lengths allow, the TCP/UDP/ICMP one.
fn fix_checksums(p: &mut [u8]) {
    if p.len() < 34 || be16(p, 12) != 0x0800 {
        return;
    }
    let ihl = usize::from(p[14] & 0x0f) * 4;
    if ihl < 20 || p.len() < 14 + ihl {
        return;
    }
    p[24] = 0;
    p[25] = 0;
    let c = checksum(&p[14..14 + ihl], 0);
    p[24..26].copy_from_slice(&c.to_be_bytes());
    let total = usize::from(be16(p, 16));
    if total < ihl || 14 + total > p.len() || be16(p, 20) & 0x3fff != 0 {
        return;
    }
    let l4 = 14 + ihl;
    let len = total - ihl;
    let at = match p[23] {
        TCP if len >= 20 => l4 + 16,
        UDP if len >= 8 => l4 + 6,
        ICMP if len >= 8 => l4 + 2,
        _ => return,
    };
    p[at] = 0;
    p[at + 1] = 0;
    let pseudo = if p[23] == ICMP {
        0
    } else {
        let mut s = 0u32;
        for w in [
            be16(p, 26),
            be16(p, 28),
            be16(p, 30),
            be16(p, 32),
            u16::from(p[23]),
            len as u16,
        ] {
            s += u32::from(w);
        }
        s
    };
    let mut c = checksum(&p[l4..l4 + len], pseudo);
    if p[23] == UDP && c == 0 {
        c = 0xffff;
    }
    p[at..at + 2].copy_from_slice(&c.to_be_bytes());
}

/// An ICMP message of any type and code, quoting `quote` (the start of an IP packet).
fn icmp_raw(from: Ipv4Addr, to: Ipv4Addr, kind: u8, code: u8, rest: [u8; 4], quote: &[u8]) -> Vec<u8> {
    let mut icmp = vec![kind, code, 0, 0];
    icmp.extend_from_slice(&rest);
    icmp.extend_from_slice(quote);
    let c = checksum(&icmp, 0);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let header = Ipv4Header::new(icmp.len() as u16, 64, IpNumber::ICMP, from.octets(), to.octets())
        .expect("ipv4 header");
    let mut out = Vec::new();
    PacketBuilder::ethernet2(packet::CLIENT_MAC, packet::NODE_MAC)
        .ip(etherparse::IpHeaders::Ipv4(header, Default::default()))
        .write(&mut out, IpNumber::ICMP, &icmp)
        .expect("write");
    out
}

/// The conntrack map of this scratch data path: the `lb4_ct` of the programs that use our
/// services map (the object keeps it; `KernelMaps` has no handle on it).
fn conntrack_of(s: &ScratchDatapath) -> BpfHashMap<MapData, Ct4Key, Ct4Value> {
    let services_id = s.maps().services.map().info().expect("services map info").id();
    for prog in aya::programs::loaded_programs().flatten() {
        let Ok(Some(ids)) = prog.map_ids() else { continue };
        if !ids.contains(&services_id) {
            continue;
        }
        for id in ids {
            let Ok(info) = MapInfo::from_id(id) else { continue };
            if info.name_as_str() == Some(lb_common::catalog::CONNTRACK) {
                let data = MapData::from_id(id).expect("open lb4_ct");
                return BpfHashMap::try_from(Map::LruHashMap(data)).expect("lb4_ct as a hash map");
            }
        }
    }
    panic!("no lb4_ct map among the maps of the programs using services map {services_id}");
}

/// Every conntrack entry must be one of the four kinds `lb_common::conntrack` documents, naming
/// a frontend and a backend that exist, with the translation they imply.
fn check_conntrack(
    w: &World,
    ct_map: &BpfHashMap<MapData, Ct4Key, Ct4Value>,
) -> BTreeMap<&'static str, usize> {
    let mut kinds = BTreeMap::new();
    for entry in ct_map.iter() {
        let (k, v) = entry.expect("read lb4_ct");
        let fail = |what: &str| -> ! { panic!("conntrack entry {k:?} -> {v:?}: {what}") };
        let Some(fe) = w.by_rev.get(&v.rev_nat_id) else {
            fail("unknown frontend")
        };
        let Some(be) = w.backends_by_id.get(&v.backend_id) else {
            fail("unknown backend")
        };
        let (saddr, daddr, nat) = (
            Ipv4Addr::from(k.saddr),
            Ipv4Addr::from(k.daddr),
            (Ipv4Addr::from(v.nat_addr), v.nat_port),
        );
        if k.proto != fe.2 || k.proto != be.2 {
            fail("protocol differs from its frontend's or backend's");
        }
        if !w.frontends[fe].all_backends().contains(&(be.0, be.1)) {
            fail("backend is not one of the frontend's");
        }
        let kind = match (k.dir, v.flags & ct::REPLY != 0) {
            (dir::INGRESS, false) => {
                // Forward DNAT: client -> frontend, rewritten to the backend.
                if (daddr, k.dport) != (fe.0, fe.1) || nat != (be.0, be.1) {
                    fail("DNAT entry does not map its frontend to its backend");
                }
                "dnat"
            }
            (dir::EGRESS, false) => {
                // SNAT: client -> backend, source rewritten to the node.
                if (daddr, k.dport) != (be.0, be.1)
                    || nat.0 != w.snat
                    || !w.in_snat_range(nat.1)
                    || v.flags & ct::SNAT == 0
                {
                    fail("SNAT entry");
                }
                "snat"
            }
            (dir::INGRESS, true) => {
                // un-SNAT: backend -> node:port, rewritten to the client.
                if (saddr, k.sport) != (be.0, be.1) || daddr != w.snat || !w.in_snat_range(k.dport) {
                    fail("un-SNAT entry");
                }
                "unsnat"
            }
            (dir::EGRESS, true) => {
                // un-DNAT: backend -> client, source rewritten to the frontend.
                if (saddr, k.sport) != (be.0, be.1) || nat != (fe.0, fe.1) {
                    fail("un-DNAT entry");
                }
                "undnat"
            }
            _ => fail("unknown direction"),
        };
        *kinds.entry(kind).or_default() += 1;
    }
    kinds
}

#[test]
fn random_and_mutated_packets_through_ingress_and_egress() {
    require_root();
    assert!(
        !OBJECT.is_empty(),
        "lb-agent was built without the eBPF object: run through ./x test"
    );
    let seed = std::env::var("LB_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    let packets: usize = std::env::var("LB_FUZZ_PACKETS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    eprintln!("tc fuzz: seed {seed} (LB_FUZZ_SEED={seed} replays it), {packets} packets");
    // Replaced by the figures once every check passed: a failed run leaves no stale figures.
    lb_tests::report::started(
        "5-hostile-packets",
        "Random, truncated and mutated packets through the tc programs (BPF_PROG_TEST_RUN)",
    );
    let s = ScratchDatapath::new(&state(), settings(), &[ip(NODE_IP)], OBJECT).expect("scratch data path");
    let (w, before) = World::read(&s);
    assert!(
        w.frontends.len() >= 15,
        "{} frontends programmed",
        w.frontends.len()
    );
    let mut f = Fuzzer {
        s,
        w,
        rng: StdRng::seed_from_u64(seed),
        seed,
        stats: Stats::default(),
        seen: Vec::new(),
        sources: BTreeSet::new(),
    };
    let started = Instant::now();

    // Flows set up before the fuzz, from a client the fuzz never uses, checked after it.
    let mut sentinels = Vec::new();
    for (i, key) in [
        (ip(NODE_IP), 30080, TCP),
        (ip(NODE_IP), 30053, UDP),
        (ip("10.96.0.10"), 80, TCP),
        (ip("198.51.100.50"), 443, TCP),
    ]
    .into_iter()
    .enumerate()
    {
        let flow = f
            .walk_one(key, ip(SENTINEL_CLIENT), 61_000 + i as u16)
            .expect("a sentinel flow");
        sentinels.push(flow);
    }

    for _ in 0..packets {
        let p = match f.rng.random_range(0..100) {
            0..8 => {
                let len = f.rng.random_range(0..160);
                (0..len).map(|_| f.rng.random()).collect()
            }
            8..16 => {
                // IPv4-looking garbage.
                let len = f.rng.random_range(14..120);
                let mut p: Vec<u8> = (0..len).map(|_| f.rng.random()).collect();
                p[12] = 0x08;
                p[13] = 0x00;
                if p.len() > 14 {
                    p[14] = 0x40 | (p[14] & 0x0f);
                }
                p
            }
            16..42 => f.valid_packet(),
            42..70 => f.mutated_packet(),
            70..85 => f.icmp_packet(),
            _ => {
                f.walk();
                continue;
            }
        };
        f.run(Hook::Ingress, &p, 0);
        let mark = match f.rng.random_range(0..10) {
            0..6 => 0,
            6 | 7 => MARK_MAGIC | f.rng.random_range(0..=f.w.by_rev.len() as u32 + 2),
            8 => MARK_MAGIC | (f.rng.random::<u32>() & MARK_ID),
            _ => f.rng.random(),
        };
        f.run(Hook::Egress, &p, mark);
    }
    let elapsed = started.elapsed();

    // The programs never write service state.
    let (_, after) = World::read(&f.s);
    assert_eq!(before, after, "the service maps changed during the fuzz");
    // Every conntrack entry is well formed.
    let ct_map = conntrack_of(&f.s);
    let kinds = check_conntrack(&f.w, &ct_map);
    // The flows set up before the fuzz still translate both ways.
    for flow in &sentinels {
        let (fe_addr, fe_port, proto) = flow.fe;
        let build = |src: Ipv4Addr, sp: u16, dst: Ipv4Addr, dp: u16| {
            let spec = if proto == TCP {
                packet::tcp(&src.to_string(), sp, &dst.to_string(), dp)
            } else {
                packet::udp(&src.to_string(), sp, &dst.to_string(), dp)
            };
            spec.data(b"after the fuzz").build()
        };
        let data = build(flow.client, flow.sport, fe_addr, fe_port);
        let r = f.run(Hook::Ingress, &data, 0).expect("run");
        assert_eq!(
            (summary(&r.packet).dst, summary(&r.packet).dport),
            flow.backend,
            "{flow:?}: the established flow lost its backend"
        );
        let reply = build(flow.backend.0, flow.backend.1, flow.seen_as.0, flow.seen_as.1);
        let back = f.run(Hook::Ingress, &reply, 0).expect("run");
        let out = f.run(Hook::Egress, &back.packet, back.mark).expect("run");
        let o = summary(&out.packet);
        assert_eq!(
            (o.src, o.sport, o.dst, o.dport),
            (fe_addr, fe_port, flow.client, flow.sport),
            "{flow:?}: the reply is not reverse-translated after the fuzz"
        );
        verify_checksums(&out.packet).unwrap();
    }
    let verdict_name = |action: i32| match action {
        OK => "TC_ACT_OK".to_string(),
        SHOT => "TC_ACT_SHOT".to_string(),
        REDIRECT => "TC_ACT_REDIRECT".to_string(),
        other => other.to_string(),
    };
    lb_tests::report::record(
        "5-hostile-packets",
        &serde_json::json!({
            "scenario": "Random, truncated and mutated packets through the tc programs (BPF_PROG_TEST_RUN), interleaved with complete flows whose every step is checked",
            "attempted": f.stats.runs,
            "failed": 0,
            "seed": format!("{seed} (LB_FUZZ_SEED={seed} replays it)"),
            "packets": packets,
            "test_runs": f.stats.runs,
            "refused_by_test_run_einval": f.stats.einval,
            "verdicts": f.stats.by_action.iter().map(|((hook, action), n)| (format!("{hook} {}", verdict_name(*action)), *n)).collect::<BTreeMap<_, _>>(),
            "packets_modified": f.stats.modified,
            "translations_checked": f.stats.modified.values().sum::<usize>(),
            "checksum_checks": f.stats.checksum_checked,
            "flows_walked": {"total": f.stats.walks, "translated": f.stats.walks_translated, "masqueraded": f.stats.walks_masqueraded, "refused": f.stats.walks_refused},
            "conntrack_entries_verified": kinds.values().sum::<usize>(),
            "conntrack": kinds,
            "established_flows_checked_after": sentinels.len(),
            "service_maps_unchanged": true,
            "mistranslations": 0,
            "duration_s": elapsed.as_secs_f64(),
        }),
    );
    eprintln!(
        "tc fuzz: seed {seed}: {} test runs in {elapsed:.2?} ({} refused with EINVAL); verdicts {:?}; \
         modified {:?}; {} checksum checks; {} flows walked ({} translated, {} masqueraded, {} refused); \
         conntrack {:?}",
        f.stats.runs,
        f.stats.einval,
        f.stats.by_action,
        f.stats.modified,
        f.stats.checksum_checked,
        f.stats.walks,
        f.stats.walks_translated,
        f.stats.walks_masqueraded,
        f.stats.walks_refused,
        kinds,
    );
}

fn scratch() -> ScratchDatapath {
    require_root();
    assert!(
        !OBJECT.is_empty(),
        "lb-agent was built without the eBPF object: run through ./x test"
    );
    ScratchDatapath::new(&state(), settings(), &[ip(NODE_IP)], OBJECT).expect("scratch data path")
}

fn tc(s: &mut ScratchDatapath, name: &str, p: &[u8], mark: u32) -> TcRun {
    if mark == 0 {
        s.datapath.test_run_tc(name, p, 1).expect("test run")
    } else {
        s.datapath.test_run_tc_with_mark(name, p, mark).expect("test run")
    }
}

/// Minimal reproducer of a data-path hardening gap: the REJECT path (a Service without
/// endpoints) answers with an ICMP port unreachable whatever the source, including the limited
/// broadcast, unspecified, multicast and loopback addresses, which RFC 1122 3.2.2 (and the
/// kernel's own `icmp_send`, which kube-proxy's REJECT goes through) never answers; nor is it
/// rate limited as the kernel's ICMP errors are (`net.ipv4.icmp_msgs_per_sec`).
#[test]
fn reject_never_answers_a_broadcast_multicast_or_unspecified_source() {
    let mut s = scratch();
    for src in ["255.255.255.255", "0.0.0.0", "224.0.0.5", "127.0.0.1"] {
        let p = packet::udp(src, 5000, "10.96.0.14", 53).build();
        let r = tc(&mut s, "lb_tc_ingress", &p, 0);
        assert_ne!(r.action, REDIRECT, "an ICMP error was sent to {src}");
    }
}

/// Minimal reproducer of a data-path robustness gap: egress trusts `skb->mark` alone. A packet
/// that ingress never un-SNATed but that carries a mark in `0x5EA00000/0xFFF00000` (another
/// component's mark: Cilium, for one, keeps a security identity in the upper 16 bits, and
/// 0x5EA0-0x5EAF are valid identities) gets its source rewritten to the frontend the low bits
/// name, even a frontend of another protocol, and loses its mark.
#[test]
fn egress_ignores_a_mark_ingress_did_not_set() {
    let mut s = scratch();
    let (w, _) = World::read(&s);
    let tcp_frontend = w.frontends[&(ip("10.96.0.10"), 80, TCP)].rev_nat_id;
    // A UDP datagram from a pod, carrying the mark of a TCP frontend.
    let p = packet::udp("10.244.1.5", 5353, "10.244.3.3", 40000).build();
    let out = tc(&mut s, "lb_tc_egress", &p, MARK_MAGIC | tcp_frontend);
    assert_eq!(out.packet, p, "rewritten to {:?}", summary(&out.packet));
    assert_eq!(
        out.mark,
        MARK_MAGIC | tcp_frontend,
        "another component's mark was cleared"
    );
}
