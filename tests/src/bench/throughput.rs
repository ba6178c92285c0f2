//! North-south throughput: NodePort connections per second from many parallel clients outside the
//! node, and the CPU each costs, for every configuration that serves such traffic (lb tc, the real
//! kube-proxy on either iptables backend and in nftables mode, Cilium's tc path), side by side in
//! one run, in alternating order over rounds.
//!
//! One NodePort Service, `bench/nodeport` (port 80 -> 8080, nodePort 30080, externalTrafficPolicy
//! Cluster, the 10 endpoints of Service 0): a client outside the cluster CIDRs calling the node's
//! address is masqueraded by every proxy (kube-proxy's KUBE-MARK-MASQ for external traffic). The
//! client namespace runs `lb-bench load 10.240.0.1:30080 THREADS WARMUP SECONDS PID`: THREADS
//! threads, each making connections one after the other (connect, then close with RST); after
//! WARMUP seconds, a window of SECONDS is measured. At the window's two ends: the machine's CPU
//! time from /proc/stat (every core; busy is all but idle and iowait, and
//! softirq, where the packet path runs, apart) and the proxy process's own (utime + stime), each
//! divided by the connections made. The client and the server share the two cores with the
//! proxy, so busy time per connection includes theirs: the same work in every configuration, so
//! the differences are the proxies'.

use std::{
    fs,
    net::SocketAddr,
    process::Stdio,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use serde::{Deserialize, Serialize};

use lb_tests::process::Place;

use super::{
    api, check_interrupted,
    crr::{self, Probe, connect_once, now_ns},
    measure::Ctx,
    peers::{Config, Peer},
    step, topo,
};

/// The NodePort of the throughput Service.
pub const NODE_PORT: u16 = 30080;
/// Parallel connections of the load.
pub const THREADS: usize = 16;
/// Seconds of load before the measured window.
pub const WARMUP_S: u64 = 1;

/// The configurations measured: those that serve traffic from outside the node, and the floor
/// (no proxy: the client connects to one endpoint directly, through the node's routing).
pub const CONFIGS: [Config; 6] = [
    Config::Direct,
    Config::LbTc,
    Config::Iptables,
    Config::IptablesLegacy,
    Config::Nftables,
    Config::CiliumTc,
];

/// What one configuration did in one round: the load's figures, with which configuration,
/// round and concurrency they are of.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ThroughputRun {
    pub config: Config,
    pub round: usize,
    pub threads: usize,
    #[serde(flatten)]
    pub load: LoadResult,
}

/// What `lb-bench load` prints: what the measured window saw (after the warm-up).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LoadResult {
    pub connections: u64,
    /// Connections whose connect() took over a second (a SYN retransmitted: a queue overflowed
    /// somewhere), counted in `connections` too.
    #[serde(default)]
    pub slow: u64,
    pub errors: u64,
    pub seconds: f64,
    /// CPU time of every core but idle and iowait, over the window, in ns.
    pub busy_ns: u64,
    /// Of which softirq.
    pub softirq_ns: u64,
    /// The proxy process's own CPU time (user + system), in ns.
    pub proxy_ns: u64,
    #[serde(default)]
    pub first_error: Option<String>,
}

impl LoadResult {
    pub fn per_s(&self) -> f64 {
        self.connections as f64 / self.seconds
    }

    /// `ns` per connection, in µs.
    pub fn us_per_conn(&self, ns: u64) -> f64 {
        ns as f64 / self.connections.max(1) as f64 / 1e3
    }
}

/// `lb-bench load TO THREADS WARMUP_S SECONDS [PROXY_PID]` (see the module doc): the threads run
/// for the warm-up and the measured window; the counters and CPU times are taken at the window's
/// two ends, so neither the threads' start nor their last connections count.
pub fn load_main(args: &[String]) {
    let (to, threads, warmup, seconds, pid) = match args {
        [a, b, c, d] => (a, b, c, d, None),
        [a, b, c, d, e] => (a, b, c, d, Some(e.parse::<u32>().expect("pid"))),
        _ => panic!("usage: lb-bench load TO THREADS WARMUP_S SECONDS [PROXY_PID]"),
    };
    let to: SocketAddr = to.parse().expect("address");
    let threads: usize = threads.parse().expect("threads");
    let warmup = Duration::from_secs(warmup.parse().expect("warm-up seconds"));
    let window = Duration::from_secs(seconds.parse().expect("seconds"));
    let (done, slow, errors) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let first_error = std::sync::Mutex::new(None);
    let snapshot = || {
        let (busy, softirq) = machine_cpu_ns();
        (
            now_ns(),
            done.load(Ordering::SeqCst),
            slow.load(Ordering::SeqCst),
            errors.load(Ordering::SeqCst),
            busy,
            softirq,
            pid.map_or(0, process_cpu_ns),
        )
    };
    let (a, b) = std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    // Long enough for a retransmitted SYN (1 s) to be answered: that is a slow
                    // connection, not a failed one.
                    match connect_once(to, Duration::from_secs(3)) {
                        Ok(ns) => {
                            if ns > 1_000_000_000 {
                                slow.fetch_add(1, Ordering::Relaxed);
                            }
                            done.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(e) => {
                            first_error
                                .lock()
                                .expect("lock")
                                .get_or_insert_with(|| std::io::Error::from_raw_os_error(e).to_string());
                            errors.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
            });
        }
        std::thread::sleep(warmup);
        let a = snapshot();
        std::thread::sleep(window);
        let b = snapshot();
        stop.store(true, Ordering::SeqCst);
        (a, b)
    });
    let result = LoadResult {
        seconds: (b.0 - a.0) as f64 / 1e9,
        connections: b.1 - a.1,
        slow: b.2 - a.2,
        errors: b.3 - a.3,
        busy_ns: b.4.saturating_sub(a.4),
        softirq_ns: b.5.saturating_sub(a.5),
        proxy_ns: b.6.saturating_sub(a.6),
        first_error: first_error.into_inner().expect("lock"),
    };
    println!("{}", serde_json::to_string(&result).expect("json"));
}

/// The machine's CPU time from /proc/stat's `cpu` line: (busy, softirq) in ns.
fn machine_cpu_ns() -> (u64, u64) {
    let stat = fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is counted in user already).
    let field = |i: usize| ticks.get(i).copied().unwrap_or(0);
    let busy: u64 = (0..8).filter(|i| *i != 3 && *i != 4).map(field).sum();
    (ticks_to_ns(busy), ticks_to_ns(field(6)))
}

/// Waits (at most `limit`) until the machine's cores are busy less than 15% of two consecutive
/// seconds, so that a measurement does not start on the tail of other work; says how it went.
pub fn wait_for_quiet_machine(limit: Duration) {
    let started = std::time::Instant::now();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let (mut quiet_seconds, mut busy) = (0, 0.0);
    while started.elapsed() < limit && quiet_seconds < 2 {
        let (a, _) = machine_cpu_ns();
        std::thread::sleep(Duration::from_secs(1));
        let (b, _) = machine_cpu_ns();
        busy = b.saturating_sub(a) as f64 / 1e9 / cores;
        quiet_seconds = if busy < 0.15 { quiet_seconds + 1 } else { 0 };
    }
    eprintln!(
        "  the machine is {} after {:.0} s (cores {:.0}% busy in the last second)",
        if quiet_seconds >= 2 { "quiet" } else { "still busy" },
        started.elapsed().as_secs_f64(),
        busy * 100.0
    );
}

/// A process's CPU time (utime + stime, /proc/PID/stat fields 14 and 15), in ns.
fn process_cpu_ns(pid: u32) -> u64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let ticks = lb_tests::process::parse_stat(&stat).map_or(0, |(_, cpu, _)| cpu);
    ticks_to_ns(ticks)
}

fn ticks_to_ns(ticks: u64) -> u64 {
    ticks * 1_000_000_000 / lb_tests::process::clock_ticks()
}

/// The configurations of this run that serve north-south traffic, in the document's order.
pub fn configs(run: &[Config]) -> Vec<Config> {
    CONFIGS.into_iter().filter(|c| run.contains(c)).collect()
}

/// Every round of every configuration (rounds in alternating order); problems met, as text.
pub fn measure(ctx: &mut Ctx<'_>, rounds: usize, seconds: u64) -> (Vec<ThroughputRun>, Vec<String>) {
    let configs = configs(&ctx.opts.configs);
    let mut runs = Vec::new();
    let mut problems = Vec::new();
    ctx.cluster.create_nodeport(NODE_PORT);
    let node_port: SocketAddr = format!("{}:{NODE_PORT}", topo::NODE_IP).parse().expect("address");
    for round in 0..rounds {
        let order: Vec<Config> = if round % 2 == 0 {
            configs.clone()
        } else {
            configs.iter().rev().copied().collect()
        };
        for config in order {
            check_interrupted();
            step(&format!(
                "north-south throughput, round {}/{rounds}: {} ({THREADS} parallel connections to the NodePort for {seconds} s)",
                round + 1,
                config.label()
            ));
            let to = if config == Config::Direct {
                api::endpoints_in(lb_tests::packet::Family::V4, 0)[0]
            } else {
                node_port
            };
            match measure_one(ctx, config, to, round, seconds) {
                Ok(run) => {
                    let load = &run.load;
                    eprintln!(
                        "  {:<26} {:.0} conn/s, {:.1} µs CPU per connection ({:.1} softirq, {:.2} the proxy's), {} slow, {} errors",
                        config.label(),
                        load.per_s(),
                        load.us_per_conn(load.busy_ns),
                        load.us_per_conn(load.softirq_ns),
                        load.us_per_conn(load.proxy_ns),
                        load.slow,
                        load.errors
                    );
                    if load.errors > 0 && config != Config::Direct {
                        problems.push(format!(
                            "{}: {} failed NodePort connections in round {} (first: {})",
                            config.label(),
                            load.errors,
                            round + 1,
                            load.first_error.clone().unwrap_or_default()
                        ));
                    }
                    runs.push(run);
                }
                Err(e) => {
                    eprintln!("  {e}");
                    problems.push(e);
                }
            }
        }
    }
    ctx.cluster.delete_nodeport();
    (runs, problems)
}

fn measure_one(
    ctx: &mut Ctx<'_>,
    config: Config,
    to: SocketAddr,
    round: usize,
    seconds: u64,
) -> Result<ThroughputRun, String> {
    let mut peer = Peer::new(config, ctx.api_addr);
    let probe = Probe::start(
        Place::netns(&peer.topo.client),
        to,
        true,
        ctx.opts.cold_timeout,
        2000,
        None,
    );
    ctx.launch(&mut peer);
    if !probe.wait().ok {
        return Err(format!(
            "{} did not serve the NodePort within {:?} of its start: not measured",
            config.label(),
            ctx.opts.cold_timeout
        ));
    }
    wait_for_quiet_machine(Duration::from_secs(30));
    let mut args = vec![
        "load".to_string(),
        to.to_string(),
        THREADS.to_string(),
        WARMUP_S.to_string(),
        seconds.to_string(),
    ];
    args.extend(peer.pid().map(|p| p.to_string()));
    let out = crr::self_command(Place::netns(&peer.topo.client), &args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running the load: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let load: LoadResult = serde_json::from_str(text.lines().last().unwrap_or_default())
        .map_err(|e| format!("the load printed {text:?}: {e}"))?;
    Ok(ThroughputRun {
        config,
        round,
        threads: THREADS,
        load,
    })
}

/// The NodePort Service of this measurement and its slice (the endpoints of Service 0).
pub fn nodeport_objects(
    node_port: u16,
) -> (
    k8s_openapi::api::core::v1::Service,
    k8s_openapi::api::discovery::v1::EndpointSlice,
) {
    use lb_tests::fixtures::{State, service, slice};
    let svc = service(api::NS, "nodeport")
        .type_("NodePort")
        .port(
            "http",
            "TCP",
            i32::from(api::SERVICE_PORT),
            i32::from(topo::BACKEND_PORT),
        )
        .node_port(i32::from(node_port))
        .build();
    let mut s = slice(api::NS, "nodeport", "nodeport-1");
    for j in 0..api::ENDPOINTS {
        s = s.endpoint(&api::endpoint_ip(0, j).to_string(), "bench-node-b", State::Ready);
    }
    (svc, s.port("http", "TCP", i32::from(topo::BACKEND_PORT)).build())
}
