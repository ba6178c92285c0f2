//! tc program cost per packet, with BPF_PROG_TEST_RUN against scratch maps that the agent's own
//! pipeline programs with N Services x 10 endpoints (no API server involved).
//!
//! The kernel reports the mean run time of `repeat` runs, and with `repeat > 1` every run after
//! the first sees the packet the previous run left (reference §8(c)). So:
//!
//! - a packet the program leaves untouched (non-service) is timed with repeat = 1,000,000;
//! - an established flow and a reply are timed with repeat = 1,000,000 on a *two-cycle*: Services
//!   A (VIP a:80, one endpoint b:80) and B (VIP b:80, one endpoint a:80). The established packet
//!   c:p -> a:80 becomes c:p -> b:80, which is again an established flow (of B) and becomes
//!   c:p -> a:80 again, byte for byte (checked before timing). Each run is therefore a conntrack
//!   hit plus DNAT, alternating between two flows. The reply a:80 -> c:p (egress) likewise
//!   alternates between the reverse NAT of the two flows;
//! - every fixture is also timed one call at a time (repeat = 1, the data copied in afresh by each
//!   syscall, so a SYN really is a new flow each time: a new source port per call). A single run
//!   includes the kernel's timer reads around it; that overhead is estimated as the difference
//!   between the non-service packet at repeat = 1 and at repeat = 1,000,000 and subtracted.
//!
//! There is no empty program to subtract (we cannot load other programs); the non-service packet
//! is itself an upper bound of the harness cost plus the program's cheapest path, and the
//! reference measured an empty tc program at 26 ns/run on this VM.
//!
//! Each family is measured on its own scratch maps holding N Services of that family only (the
//! suite's IPv4 or IPv6 set, see `api`), with the same packets in that family: the addresses are
//! the IPv4 ones or their IPv6 twins (`10.97.0.1` → `fd00:10:97::1`, see
//! `lb_tests::packet::Family::ip`), and the socket call is connect4 or connect6.

use std::net::IpAddr;

use anyhow::{Result, bail};
use lb_agent::{
    datapath::{OBJECT, SOCK_TRACE_PROGRAM},
    node::NodeSettings,
    trace::ScratchDatapath,
    watch::ClusterState,
};
use lb_common::{
    catalog::Capacities,
    trace::{SockTraceIn, SockTraceOut, TRACE_PACKET_LEN, hook, verdict},
};
use lb_tests::{
    fixtures::{State, service, slice},
    packet::{self, Family},
};
use serde::{Deserialize, Serialize};

use super::{api, topo};

const A: &str = "10.97.0.1";
const B: &str = "10.97.0.2";
const REPEAT: u32 = 1_000_000;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TcFixture {
    pub name: String,
    pub program: String,
    /// repeat = 1,000,000: ns per run, per batch (median and min over batches).
    pub batched_ns: Vec<f64>,
    /// repeat = 1, one call each: median ns per call, raw and minus the timer overhead.
    pub single_median_ns: Option<f64>,
    pub single_corrected_ns: Option<f64>,
    pub action: i32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TcLevel {
    pub n: u32,
    /// "IPv4" or "IPv6": the family of the Services and packets (absent in older results: IPv4).
    #[serde(default)]
    pub family: String,
    pub fixtures: Vec<TcFixture>,
    /// Estimated per-call timer overhead of a repeat = 1 run.
    pub single_overhead_ns: f64,
}

fn state(n: u32, family: Family) -> ClusterState {
    let mut s = ClusterState::default();
    for i in 0..n {
        s.add_service(api::build_service_in(family, i, api::SERVICE_PORT));
        s.add_slice(api::build_slice_in(family, i));
    }
    for (name, vip, ep) in [("ping", A, B), ("pong", B, A)] {
        s.add_service(
            service("tc", name)
                .cluster_ips(&[&family.addr(vip)])
                .port("http", "TCP", 80, 80)
                .build(),
        );
        s.add_slice(
            slice("tc", name, &format!("{name}-1"))
                .endpoint(&family.addr(ep), "bench-node-b", State::Ready)
                .port("http", "TCP", 80)
                .build(),
        );
    }
    s
}

fn scratch(n: u32, family: Family) -> Result<ScratchDatapath> {
    if OBJECT.is_empty() {
        bail!("lb-agent was built without the eBPF object (run through `cargo xtask bench`)");
    }
    // ScratchDatapath::new sizes its maps for small fixtures (65,536 service slots, 16,384
    // backends): too small for 10,000 Services x 10 endpoints. Same construction, agent-sized maps
    // (as the benchmark's agent gets above 10,000 Services).
    let (backends, services) = super::map_sizes(n);
    let caps = Capacities {
        services: services.max(262_144),
        backends: backends.max(262_144),
        revnat: 65_536,
        sock_revnat: 4096,
        affinity: 4096,
        affinity_match: 16_384,
        source_ranges: 4096,
        conntrack: 262_144,
        // The new-flow fixture's SYNs never complete a handshake: their flows stay in the
        // new-flow table, 2 or 3 entries each for up to 60,000 calls. Sized like the established
        // table, so that the fixture times the new-flow path and not LRU eviction (which an LRU
        // map starts before it is full), as it did with one table.
        conntrack_new: 262_144,
    };
    let settings = NodeSettings {
        cluster_cidrs: vec![
            topo::CLUSTER_CIDR.parse().expect("cidr"),
            topo::CLUSTER_CIDR6.parse().expect("cidr"),
        ],
        ..NodeSettings::new(api::NODE)
    };
    let node_ips = [topo::NODE_IP, topo::NODE_IP6].map(|ip| ip.parse::<IpAddr>().expect("ip"));
    ScratchDatapath::with_capacities(&state(n, family), settings, &node_ips, OBJECT, caps)
}

/// A `SockTraceIn` as the packet `lb_sock_trace` reads: a connect4 or connect6 call, after the
/// address's family.
fn sock_call(addr: IpAddr, port: u16, socket_cookie: u64, random: u32) -> Vec<u8> {
    let (hook, addr) = match addr {
        // An IPv4 hook reads the first 4 bytes.
        IpAddr::V4(a) => {
            let mut bytes = [0; 16];
            bytes[..4].copy_from_slice(&a.octets());
            (hook::CONNECT4, bytes)
        }
        IpAddr::V6(a) => (hook::CONNECT6, a.octets()),
    };
    let input = SockTraceIn {
        hook,
        protocol: u32::from(lb_common::proto::TCP),
        addr,
        port,
        _pad: 0,
        src_addr: [0; 16],
        random,
        socket_cookie,
        netns_cookie: 0x1000_0001,
    };
    let mut packet = vec![0u8; TRACE_PACKET_LEN];
    // SAFETY: SockTraceIn is plain old data and fits the buffer (checked at compile time in lb-common).
    unsafe {
        std::ptr::copy_nonoverlapping(
            (&raw const input).cast::<u8>(),
            packet.as_mut_ptr(),
            size_of::<SockTraceIn>(),
        )
    };
    packet
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ns(d: std::time::Duration) -> f64 {
    d.as_nanos() as f64
}

/// Times `pkt` with repeat = 1,000,000, `batches` times.
fn batched(s: &mut ScratchDatapath, prog: &str, pkt: &[u8], batches: usize) -> Result<Vec<f64>> {
    (0..batches)
        .map(|_| Ok(ns(s.datapath.test_run_tc(prog, pkt, REPEAT)?.duration)))
        .collect()
}

/// Median of `calls` single runs; `make(k)` builds the k-th packet.
fn single(s: &mut ScratchDatapath, prog: &str, calls: usize, make: impl Fn(usize) -> Vec<u8>) -> Result<f64> {
    let mut v = Vec::with_capacity(calls);
    for k in 0..calls {
        v.push(ns(s.datapath.test_run_tc(prog, &make(k), 1)?.duration));
    }
    Ok(median(&mut v))
}

pub fn measure(n: u32, family: Family, batches: usize, calls: usize) -> Result<TcLevel> {
    let mut s = scratch(n, family)?;
    let client = topo::client_ip(family);
    let vip = |i: u32| api::cluster_ip_in(family, i % n).to_string();
    let (a, b) = (family.addr(A), family.addr(B));
    let (a, b) = (a.as_str(), b.as_str());
    let mut level = TcLevel {
        n,
        family: family.name().into(),
        ..Default::default()
    };

    // Non-service: to an endpoint address directly (routed, not a frontend).
    let plain = packet::tcp(
        client,
        40000,
        &api::endpoint_ip_in(family, 0, 0).to_string(),
        8080,
    )
    .data(b"x")
    .build();
    let out = s.datapath.test_run_tc("lb_tc_ingress", &plain, 1)?;
    if out.packet != plain {
        bail!("the non-service packet was modified");
    }
    let plain_batched = batched(&mut s, "lb_tc_ingress", &plain, batches)?;
    let plain_single = single(&mut s, "lb_tc_ingress", calls, |_| plain.clone())?;
    level.single_overhead_ns = (plain_single - median(&mut plain_batched.clone())).max(0.0);
    let overhead = level.single_overhead_ns;
    level.fixtures.push(TcFixture {
        name: "non-service packet (ingress, passes)".into(),
        program: "lb_tc_ingress".into(),
        batched_ns: plain_batched,
        single_median_ns: Some(plain_single),
        single_corrected_ns: Some(plain_single - overhead),
        action: out.action,
    });

    // The node's own traffic: a reply to one of its connections, to its address (a masquerade
    // address, which NodePorts share), on an ephemeral port no frontend has.
    let to_node = packet::tcp(
        &family.addr("203.0.113.50"),
        443,
        &family.addr(topo::NODE_IP),
        45_000,
    )
    .data(b"x")
    .build();
    let out = s.datapath.test_run_tc("lb_tc_ingress", &to_node, 1)?;
    if out.packet != to_node {
        bail!("the packet to the node's address was modified");
    }
    let to_node_single = single(&mut s, "lb_tc_ingress", calls, |_| to_node.clone())?;
    level.fixtures.push(TcFixture {
        name: "the node's own traffic (ingress, passes: a reply to the node IP's ephemeral port)".into(),
        program: "lb_tc_ingress".into(),
        batched_ns: batched(&mut s, "lb_tc_ingress", &to_node, batches)?,
        single_median_ns: Some(to_node_single),
        single_corrected_ns: Some(to_node_single - overhead),
        action: out.action,
    });

    // New flow: a SYN to a random Service, a new source port each call.
    let syn = |k: usize| new_flow_syn(n, family, k).1;
    let first = s.datapath.test_run_tc("lb_tc_ingress", &syn(0), 1)?;
    if packet::summary(&first.packet).dst == api::cluster_ip_in(family, 0) {
        bail!("the SYN to a ClusterIP was not translated");
    }
    let syn_single = single(&mut s, "lb_tc_ingress", calls.min(60_000), |k| syn(k + 1))?;
    level.fixtures.push(TcFixture {
        name: "new flow (SYN to a ClusterIP: lookup, backend choice, conntrack insert, DNAT)".into(),
        program: "lb_tc_ingress".into(),
        batched_ns: vec![],
        single_median_ns: Some(syn_single),
        single_corrected_ns: Some(syn_single - overhead),
        action: first.action,
    });

    // The same new flows while `lb-agent monitor` listens: each writes its event (the ring is
    // drained between calls, untimed, as a monitor keeps up). The fixture above is the idle cost
    // (one lookup of `lb_monitor`); this one the cost of an event.
    lb_tests::monitor::listen(&mut s.datapath, lb_common::monitor::types::ALL, 3_600_000_000_000);
    // Source ports 31,024 and up: none of the SYNs above (1,025 to 21,024 at the default 20,000
    // calls) nor the flows below (61,000, 62,000).
    let mut v = Vec::with_capacity(calls.min(20_000));
    let mut events = 0;
    for k in 0..calls.min(20_000) {
        let packet = packet::tcp(client, 31_024 + k as u16, &vip((k as u32) % n), 80).build();
        v.push(ns(s.datapath.test_run_tc("lb_tc_ingress", &packet, 1)?.duration));
        if k % 1_000 == 999 {
            events += lb_tests::monitor::events(&mut s.datapath).len();
        }
    }
    events += lb_tests::monitor::events(&mut s.datapath).len();
    lb_tests::monitor::listen(&mut s.datapath, 0, 0);
    if events != v.len() {
        bail!("a listening monitor got {events} events of {} new flows", v.len());
    }
    let listened = median(&mut v);
    level.fixtures.push(TcFixture {
        name: "new flow, lb-agent monitor listening (the same SYNs, each writing its event)".into(),
        program: "lb_tc_ingress".into(),
        batched_ns: vec![],
        single_median_ns: Some(listened),
        single_corrected_ns: Some(listened - overhead),
        action: first.action,
    });

    // Established flow and reply, one call at a time: a flow to the last Service.
    let est_vip = vip(n - 1);
    s.datapath.test_run_tc(
        "lb_tc_ingress",
        &packet::tcp(client, 61000, &est_vip, 80).build(),
        1,
    )?;
    let est = packet::tcp(client, 61000, &est_vip, 80).data(b"GET /").build();
    let est_out = s.datapath.test_run_tc("lb_tc_ingress", &est, 1)?;
    let backend = packet::summary(&est_out.packet);
    let est_single = single(&mut s, "lb_tc_ingress", calls, |_| est.clone())?;
    let reply = packet::tcp(&backend.dst.to_string(), backend.dport, client, 61000)
        .data(b"200")
        .build();
    let reply_out = s.datapath.test_run_tc("lb_tc_egress", &reply, 1)?;
    if packet::summary(&reply_out.packet).src.to_string() != est_vip {
        bail!("the reply was not reverse-translated");
    }
    let reply_single = single(&mut s, "lb_tc_egress", calls, |_| reply.clone())?;

    // The two-cycle for repeat = 1,000,000.
    s.datapath
        .test_run_tc("lb_tc_ingress", &packet::tcp(client, 62000, a, 80).build(), 1)?;
    s.datapath
        .test_run_tc("lb_tc_ingress", &packet::tcp(client, 62000, b, 80).build(), 1)?;
    let ping = packet::tcp(client, 62000, a, 80).data(b"GET /").build();
    let once = s.datapath.test_run_tc("lb_tc_ingress", &ping, 1)?.packet;
    let twice = s.datapath.test_run_tc("lb_tc_ingress", &once, 1)?.packet;
    let est_batched = if packet::summary(&once).dst.to_string() == b && twice == ping {
        batched(&mut s, "lb_tc_ingress", &ping, batches)?
    } else {
        eprintln!("  note: the established two-cycle is not stable; batched timing skipped");
        vec![]
    };
    let pong_reply = packet::tcp(a, 80, client, 62000).data(b"200").build();
    let once = s.datapath.test_run_tc("lb_tc_egress", &pong_reply, 1)?.packet;
    let twice = s.datapath.test_run_tc("lb_tc_egress", &once, 1)?.packet;
    let reply_batched = if packet::summary(&once).src.to_string() == b && twice == pong_reply {
        batched(&mut s, "lb_tc_egress", &pong_reply, batches)?
    } else {
        eprintln!("  note: the reply two-cycle is not stable; batched timing skipped");
        vec![]
    };
    level.fixtures.push(TcFixture {
        name: "established flow (ingress: conntrack hit, DNAT)".into(),
        program: "lb_tc_ingress".into(),
        batched_ns: est_batched,
        single_median_ns: Some(est_single),
        single_corrected_ns: Some(est_single - overhead),
        action: est_out.action,
    });
    level.fixtures.push(TcFixture {
        name: "reply (egress: reverse NAT)".into(),
        program: "lb_tc_egress".into(),
        batched_ns: reply_batched,
        single_median_ns: Some(reply_single),
        single_corrected_ns: Some(reply_single - overhead),
        action: reply_out.action,
    });

    // The socket path's connect4 (connect6) code, run through `lb_sock_trace` (the same
    // translation on a described socket call; cgroup programs cannot be test-run): a connect to
    // a random Service, a new socket cookie each call. One call at a time (the harness
    // overwrites its input with the outcome).
    let connect = |k: usize| {
        let i = (k as u32).wrapping_mul(2_654_435_761) % n;
        sock_call(api::cluster_ip_in(family, i), 80, k as u64 + 1, k as u32)
    };
    let connect_hook = match family {
        Family::V4 => "connect4",
        Family::V6 => "connect6",
    };
    let first = s.datapath.test_run_tc(SOCK_TRACE_PROGRAM, &connect(0), 1)?;
    // SAFETY: the harness wrote a SockTraceOut at the start of the packet.
    let out: SockTraceOut = unsafe { std::ptr::read_unaligned(first.packet.as_ptr().cast()) };
    if out.verdict != verdict::TRANSLATED {
        bail!(
            "the socket connect to a ClusterIP was not translated (verdict {})",
            out.verdict
        );
    }
    let connect_single = single(&mut s, SOCK_TRACE_PROGRAM, calls, |k| connect(k + 1))?;
    level.fixtures.push(TcFixture {
        name: format!(
            "socket connect ({connect_hook}'s code via lb_sock_trace: lookup, backend choice, reverse-NAT entry in the LRU map)"
        ),
        program: SOCK_TRACE_PROGRAM.into(),
        batched_ns: vec![],
        single_median_ns: Some(connect_single),
        single_corrected_ns: Some(connect_single - overhead),
        action: first.action,
    });

    // Non-service at egress too: a backend's packet on a flow tc never tracked (a reply on a
    // connection the socket programs translated), which the prefilter lets through by its
    // source and the flow filter stops.
    let plain_e = packet::tcp(
        &api::endpoint_ip_in(family, 0, 0).to_string(),
        8080,
        &family.addr("10.250.0.9"),
        40000,
    )
    .data(b"x")
    .build();
    let out = s.datapath.test_run_tc("lb_tc_egress", &plain_e, 1)?;
    let e_batched = batched(&mut s, "lb_tc_egress", &plain_e, batches)?;
    let e_single = single(&mut s, "lb_tc_egress", calls, |_| plain_e.clone())?;
    level.fixtures.push(TcFixture {
        name: "non-service packet (egress, passes: a backend's reply on a socket-path connection)".into(),
        program: "lb_tc_egress".into(),
        batched_ns: e_batched,
        single_median_ns: Some(e_single),
        single_corrected_ns: Some(e_single - overhead),
        action: out.action,
    });
    Ok(level)
}

/// The new-flow fixture's `k`-th SYN, and the Service it goes to: a Service picked by a
/// multiplicative hash of `k` (spread over all `n`), source port `1024 + k % 60,000`.
fn new_flow_syn(n: u32, family: Family, k: usize) -> (u32, Vec<u8>) {
    let i = (k as u32).wrapping_mul(2_654_435_761) % n;
    let vip = api::cluster_ip_in(family, i).to_string();
    let syn = packet::tcp(topo::client_ip(family), 1024 + (k % 60_000) as u16, &vip, 80).build();
    (i, syn)
}

/// `lb-bench tc-profile`: new flows (the fixture's SYNs to random Services, one call each) for
/// `secs` seconds, for a profiler to sample (`perf record -g -- lb-bench tc-profile ...`; the
/// programs' samples are those under `bpf_prog_*_lb_tc_ingress`). Each client address sends at
/// most 60,000 SYNs; the scratch maps are built again before their new-flow table could fill
/// (an LRU map evicts before it is full, and eviction is not what this profiles). Prints the
/// median call.
pub fn profile_new_flow(n: u32, family: Family, secs: u64) -> Result<()> {
    const FLOWS_PER_MAPS: usize = 60_000;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let mut v = Vec::new();
    while std::time::Instant::now() < deadline {
        let mut s = scratch(n, family)?;
        for k in 0..FLOWS_PER_MAPS {
            let (i, syn) = new_flow_syn(n, family, k);
            let out = s.datapath.test_run_tc("lb_tc_ingress", &syn, 1)?;
            if packet::summary(&out.packet).dst == api::cluster_ip_in(family, i) {
                bail!("a SYN to a ClusterIP was not translated");
            }
            v.push(ns(out.duration));
            if k % 1024 == 0 && std::time::Instant::now() >= deadline {
                break;
            }
        }
    }
    println!(
        "{} new flows at {n} Services ({}): median {} ns per call (raw)",
        v.len(),
        family.name(),
        median(&mut v)
    );
    Ok(())
}
