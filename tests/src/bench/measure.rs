//! The measurements that need the API server: connect latency per configuration (over IPv4,
//! and over IPv6 with the IPv6 Service set), programming time, add/change/remove latency, and
//! memory.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use lb_tests::packet::Family;
use serde::{Deserialize, Serialize};

use super::{
    Options,
    api::{self, Cluster},
    check_interrupted,
    crr::{self, CrrResult, Probe, now_ns},
    peers::{Config, MapMem, Peer, agent_maps},
};

/// What the measurements share.
pub struct Ctx<'a> {
    pub cluster: &'a mut Cluster,
    pub api_addr: SocketAddr,
    pub kubeconfig: PathBuf,
    pub kube_proxy: PathBuf,
    pub workdir: PathBuf,
    pub opts: &'a Options,
}

impl Ctx<'_> {
    pub(crate) fn launch(&self, peer: &mut Peer) {
        peer.launch(&self.kubeconfig, &self.kube_proxy, self.opts);
    }

    /// Target files for `n` Services of `family`'s set: ClusterIP:80 per line, and the floor's
    /// endpoints.
    fn targets(&self, n: u32, family: Family) -> (PathBuf, PathBuf) {
        let tag = tag(family);
        let vips = self.workdir.join(format!("vips{tag}-{n}.txt"));
        let direct = self.workdir.join(format!("direct{tag}-{n}.txt"));
        if !vips.exists() {
            let lines: Vec<_> = (0..n)
                .map(|i| vec![api::vip_in(family, i, api::SERVICE_PORT)])
                .collect();
            crr::write_targets(&vips, &lines);
            let lines: Vec<_> = (0..n).map(|i| api::endpoints_in(family, i)).collect();
            crr::write_targets(&direct, &lines);
        }
        (vips, direct)
    }
}

/// "" for IPv4 (the names of an IPv4-only suite), "6" for IPv6: in file names.
fn tag(family: Family) -> &'static str {
    match family {
        Family::V4 => "",
        Family::V6 => "6",
    }
}

/// What the memory taken after a cold start is called (`Memory::when`), per family of the
/// Services in the API.
pub fn cold_start_when(family: Family) -> &'static str {
    match family {
        Family::V4 => "cold start",
        Family::V6 => "cold start (IPv6 Services)",
    }
}

/// From a proxy's start (with N Services already in the API) to the data path serving them.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ColdStart {
    pub config: Option<Config>,
    pub n: u32,
    /// Start to the last Service answering.
    pub last_s: Option<f64>,
    /// Start to every Service answering (a connect to each).
    pub all_s: Option<f64>,
    pub not_answering: usize,
    /// The proxy's own sync histogram after the start (count, total seconds).
    pub sync_count: f64,
    pub sync_sum_s: f64,
    /// The agent's "data path programmed ... elapsed_ms" values.
    pub agent_sync_ms: Vec<f64>,
    /// For a program that did not serve in time: what it was busy with then (its log's last
    /// sync size, the commands it waited for; `Peer::stall_diagnosis`).
    #[serde(default)]
    pub stalled: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LatencyLevel {
    pub n: u32,
    pub runs: BTreeMap<Config, Vec<CrrResult>>,
    pub cold: Vec<ColdStart>,
    /// The machine's 1-minute load average at the start of each round (other work on the VM).
    #[serde(default)]
    pub round_load: Vec<f64>,
    /// kube-proxy's effective configuration (/configz) per mode, for the record.
    #[serde(default)]
    pub configz: BTreeMap<Config, String>,
    /// What each of our programs cost in the real stack during one extra (untimed) round of each
    /// lb configuration, from the kernel's run-time statistics.
    #[serde(default)]
    pub in_stack: BTreeMap<Config, Vec<ProgramCost>>,
}

/// One program's runs during a diagnostic round (kernel BPF run-time statistics).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ProgramCost {
    pub program: String,
    pub runs: u64,
    pub ns_per_run: f64,
    /// Runs per connection of the round.
    pub runs_per_conn: f64,
}

/// The `lb_*` programs loaded now: id -> (name, run time ns, run count).
fn lb_program_counters() -> BTreeMap<u32, (String, u64, u64)> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter_map(|p| {
            let name = p.name_as_str()?.to_owned();
            name.starts_with("lb_")
                .then(|| (p.id(), (name, p.run_time().as_nanos() as u64, p.run_count())))
        })
        .collect()
}

/// One more round of `peer` with the kernel's BPF run-time statistics on (`BPF_ENABLE_STATS`,
/// which lasts as long as its file descriptor; they cost every program ~20 ns a run, so the
/// timed rounds run without them): ns per run of each of our programs that ran.
fn in_stack_costs(peer: &Peer, targets: &Path, conns: usize, seed: u64) -> Vec<ProgramCost> {
    let Ok(stats) = aya::sys::enable_stats(aya::sys::Stats::RunTime) else {
        eprintln!("  note: BPF run-time statistics are not available; in-stack costs not measured");
        return Vec::new();
    };
    let before = lb_program_counters();
    crr::run_crr(peer.client(), targets, conns, 0, seed);
    let after = lb_program_counters();
    drop(stats);
    let mut costs: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (id, (name, time, count)) in &after {
        let (t0, c0) = before.get(id).map_or((0, 0), |(_, t, c)| (*t, *c));
        let runs = count.saturating_sub(c0);
        if runs > 0 {
            let e = costs.entry(name.clone()).or_default();
            e.0 += time.saturating_sub(t0);
            e.1 += runs;
        }
    }
    costs
        .into_iter()
        .map(|(program, (time, runs))| ProgramCost {
            program,
            runs,
            ns_per_run: time as f64 / runs as f64,
            runs_per_conn: runs as f64 / conns as f64,
        })
        .collect()
}

/// Creating N Services through the API while the proxy runs.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Programming {
    pub config: Option<Config>,
    pub n: u32,
    /// First create request to the last object created.
    pub create_s: f64,
    /// First create request to the last Service answering through the data path.
    pub last_s: Option<f64>,
    /// First create request to every Service answering.
    pub all_s: Option<f64>,
    pub not_answering: usize,
    pub sync_count: f64,
    pub sync_sum_s: f64,
    pub agent_sync_ms: Vec<f64>,
}

/// One kind of call's API watch times and the times from the watch event to the data path.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WatchShares {
    pub api_watch_ms: Vec<f64>,
    pub after_watch_ms: Vec<f64>,
}

/// One added, changed and removed Service on top of N, repeated.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ChangeLatency {
    pub config: Option<Config>,
    pub n: u32,
    pub add_ms: Vec<f64>,
    pub change_ms: Vec<f64>,
    pub remove_ms: Vec<f64>,
    /// The agent's sync that applied each change (elapsed_ms from its log).
    pub agent_sync_ms: Vec<f64>,
    /// The same syncs from their start to their last map write (datapath_ms from its log): the
    /// part a change waits for; the rest is metrics, health and Events.
    #[serde(default)]
    pub agent_datapath_ms: Vec<f64>,
    /// The agent's own share of each change: from its watch event to the last map write
    /// (queued_ms + datapath_ms from its log). The rest of the time after lb-bench's own watch
    /// event is the event reaching the agent later, and the probe's polling.
    #[serde(default)]
    pub agent_own_ms: Vec<f64>,
    /// API call to the Service's watch event reaching a client (lb-bench's own watch): the API
    /// server's share, the same for every program.
    #[serde(default)]
    pub api_watch_ms: Vec<f64>,
    /// Per change: the data path time minus the API watch time (from the event to the data path).
    #[serde(default)]
    pub after_watch_ms: Vec<f64>,
    /// The same two shares per kind of call ("add", "change", "remove"): an add's watch event
    /// comes later than a change's (the API server allocates the ClusterIP first), so the split
    /// says whose time the difference is.
    #[serde(default)]
    pub by_kind: BTreeMap<String, WatchShares>,
    /// kube-proxy's own sync durations over the changes (count, total seconds).
    pub sync_count: f64,
    pub sync_sum_s: f64,
    pub failures: usize,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Memory {
    pub config: Option<Config>,
    pub n: u32,
    /// When: "after programming N" (HWM covers the programming) or "cold start".
    pub when: String,
    pub rss_kib: u64,
    pub hwm_kib: u64,
    pub maps: Vec<MapMem>,
    /// lb_map_entries{map=...} from the agent's /metrics.
    pub map_entries: BTreeMap<String, f64>,
}

fn secs(from: u64, to: u64) -> f64 {
    to.saturating_sub(from) as f64 / 1e9
}

fn memory(peer: &Peer, n: u32, when: &str) -> Option<Memory> {
    let (rss_kib, hwm_kib) = peer.rss_kib()?;
    let mut m = Memory {
        config: Some(peer.config),
        n,
        when: when.into(),
        rss_kib,
        hwm_kib,
        ..Default::default()
    };
    if peer.config.is_bpf() {
        m.maps = agent_maps(peer.pid()?);
    }
    if peer.config.is_agent()
        && let Some(metrics) = peer.metrics()
    {
        for (k, v) in &metrics.0 {
            if let Some(rest) = k.strip_prefix("lb_map_entries{map=\"") {
                m.map_entries.insert(rest.trim_end_matches("\"}").to_string(), *v);
            }
        }
    }
    Some(m)
}

/// (count, seconds) of the program's syncs: kube-proxy's histogram (which the agent keeps), or
/// Cilium's load-balancer reconciliation rounds.
fn sync_hist(peer: &Peer) -> (f64, f64) {
    peer.metrics()
        .map(|m| {
            if peer.config.is_cilium() {
                super::cilium::syncs(&m)
            } else {
                m.histogram("kubeproxy_sync_proxy_rules_duration_seconds")
            }
        })
        .unwrap_or((0.0, 0.0))
}

fn agent_ms(peer: &Peer, since: u64) -> Vec<f64> {
    peer.agent_syncs_since(since)
        .iter()
        .filter_map(|(_, f)| f.get("elapsed_ms").copied())
        .collect()
}

/// Starts every configuration (but those in `skip`) on its own topology with `n` Services of
/// `family`'s set in the API (one at a time, timing each cold start), then runs the
/// connect-latency rounds over that family, alternating configurations.
pub fn latency_level(
    ctx: &mut Ctx<'_>,
    n: u32,
    family: Family,
    skip: &[Config],
) -> (LatencyLevel, Vec<Memory>) {
    let (vips, direct) = ctx.targets(n, family);
    let over = match family {
        Family::V4 => "",
        Family::V6 => " over IPv6",
    };
    let mut level = LatencyLevel {
        n,
        ..Default::default()
    };
    let mut peers = Vec::new();
    let mut mem = Vec::new();
    for &config in &ctx.opts.configs {
        check_interrupted();
        if skip.contains(&config) {
            continue;
        }
        let mut peer = Peer::new(config, ctx.api_addr);
        let (last, all): (std::net::SocketAddr, &Path) = if config == Config::Direct {
            (
                api::endpoints_in(family, n - 1)[api::ENDPOINTS as usize - 1],
                &direct,
            )
        } else {
            (api::vip_in(family, n - 1, api::SERVICE_PORT), &vips)
        };
        let probe = Probe::start(peer.client(), last, true, ctx.opts.cold_timeout, 2000, Some(all));
        ctx.launch(&mut peer);
        let r = probe.wait();
        // The data path can serve before the program records its sync (kube-proxy observes the
        // duration after iptables-restore/nft returns, the agent logs after its writes): wait
        // for that record so the sync columns hold the sync that did the work.
        if r.ok && !peer.wait_first_sync(Duration::from_secs(30)) {
            eprintln!(
                "  WARNING: {} recorded no sync within 30 s of serving",
                config.label()
            );
        }
        let (sync_count, sync_sum_s) = sync_hist(&peer);
        let cold = ColdStart {
            config: Some(config),
            n,
            last_s: r.ok.then(|| secs(peer.launched_ns, r.at_ns)),
            all_s: r.all_at_ns.map(|t| secs(peer.launched_ns, t)),
            not_answering: if r.ok { r.all_failed } else { n as usize },
            sync_count,
            sync_sum_s,
            agent_sync_ms: agent_ms(&peer, 0),
            stalled: if r.ok { None } else { peer.stall_diagnosis() },
        };
        eprintln!(
            "  {:<22} N={n}{over}: serving all after {} (last Service after {}){}",
            config.label(),
            fmt_s(cold.all_s),
            fmt_s(cold.last_s),
            if config.is_agent() {
                format!(", agent syncs (ms): {:?}", cold.agent_sync_ms)
            } else if config.is_kube_proxy() || config.is_cilium() {
                format!(
                    ", {} syncs: {sync_count} taking {sync_sum_s:.3}s in total",
                    config.program()
                )
            } else {
                String::new()
            }
        );
        if !r.ok || cold.not_answering > 0 {
            eprintln!(
                "  WARNING: {} did not serve every Service in time; last log lines:\n{}",
                config.label(),
                peer.log_text()
            );
        }
        let failed = !r.ok;
        level.cold.push(cold);
        if failed {
            // Not measured at this N: it would only time out, and keep a CPU busy meanwhile.
            eprintln!("  {} is left out of the rounds at N={n}{over}", config.label());
            peer.save_log(
                &ctx.opts.log_dir,
                &format!("cold{}-{n}-{config:?}.log", tag(family)),
            );
            peer.stop();
            continue;
        }
        // Memory once per program: the socket configuration's run stands for both.
        if config != Config::Direct
            && config != Config::LbTc
            && config != Config::CiliumTc
            && let Some(m) = memory(&peer, n, cold_start_when(family))
        {
            mem.push(m);
        }
        peers.push(peer);
    }
    for p in peers.iter().filter(|p| p.config.is_kube_proxy()) {
        if let Some(c) = p.configz() {
            level.configz.insert(p.config, c);
        }
    }
    // Every configuration is started: let the start-up work (syncs, Cilium's compiles, the API
    // server's own work after the Services were created) die down before the first round.
    super::throughput::wait_for_quiet_machine(Duration::from_secs(60));
    for round in 0..ctx.opts.rounds {
        check_interrupted();
        if let Some(load) = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next()?.parse().ok())
        {
            level.round_load.push(load);
        }
        let order: Vec<usize> = if round % 2 == 0 {
            (0..peers.len()).collect()
        } else {
            (0..peers.len()).rev().collect()
        };
        for k in order {
            let peer = &peers[k];
            let targets = if peer.config == Config::Direct {
                &direct
            } else {
                &vips
            };
            let seed = u64::from(n) * 1000
                + round as u64 * 10
                + k as u64
                + if family == Family::V6 { 500 } else { 0 };
            let r = crr::run_crr(peer.client(), targets, ctx.opts.conns, ctx.opts.warmup, seed);
            eprintln!(
                "  round {}/{} N={n}{over} {:<22} p50 {:>7.1} µs  p90 {:>7.1}  p99 {:>7.1}  p99.9 {:>7.1}  {:>7.0} conn/s{}",
                round + 1,
                ctx.opts.rounds,
                peer.config.label(),
                r.p50_us,
                r.p90_us,
                r.p99_us,
                r.p999_us,
                r.conn_per_s,
                if r.errors > 0 {
                    format!(
                        "  ({} errors, first: {})",
                        r.errors,
                        r.first_error.clone().unwrap_or_default()
                    )
                } else {
                    String::new()
                }
            );
            level.runs.entry(peer.config).or_default().push(r);
        }
    }
    for peer in peers.iter().filter(|p| p.config.is_agent()) {
        check_interrupted();
        let costs = in_stack_costs(peer, &vips, ctx.opts.conns, u64::from(n) * 1000 + 999);
        for c in &costs {
            eprintln!(
                "  in-stack N={n}{over} {:<22} {:<14} {:>7.0} ns/run  {:.1} runs/connection",
                peer.config.label(),
                c.program,
                c.ns_per_run,
                c.runs_per_conn
            );
        }
        level.in_stack.insert(peer.config, costs);
    }
    for p in peers {
        if p.config != Config::Direct {
            p.save_log(
                &ctx.opts.log_dir,
                &format!("cold{}-{n}-{:?}.log", tag(family), p.config),
            );
        }
        p.stop();
    }
    (level, mem)
}

/// One proxy, started with no benchmark Service; then N Services are created through the API
/// (a few requests in flight) and the time to the last one answering is measured. On top of
/// that, the add/change/remove latencies when `change_reps` > 0.
pub fn programming(
    ctx: &mut Ctx<'_>,
    config: Config,
    n: u32,
    change_reps: u32,
) -> (Programming, Option<ChangeLatency>, Vec<Memory>) {
    assert_eq!(
        ctx.cluster.present, 0,
        "programming starts from no benchmark Service"
    );
    let (vips, _) = ctx.targets(n, Family::V4);
    let mut peer = Peer::new(config, ctx.api_addr);
    ctx.launch(&mut peer);
    assert!(
        peer.wait_first_sync(Duration::from_secs(120)),
        "{} did not sync within 120 s (metrics: {}):\n{}",
        config.label(),
        peer.metric_names(if config.is_cilium() {
            "reconciler"
        } else {
            "sync_proxy_rules"
        }),
        peer.log_text()
    );
    peer.settle(Duration::from_millis(1500), Duration::from_secs(60));
    let (c0, s0) = sync_hist(&peer);
    let probe = Probe::start(
        peer.client(),
        api::vip(n - 1, api::SERVICE_PORT),
        true,
        ctx.opts.sync_timeout,
        2000,
        Some(&vips),
    );
    let (first, created) = ctx.cluster.grow_to(n);
    let r = probe.wait();
    // The sync that made the last Service answer may be recorded just after (see latency_level):
    // the sync counts cover the period until the program is idle again.
    peer.settle(Duration::from_millis(1500), Duration::from_secs(60));
    let (c1, s1) = sync_hist(&peer);
    let prog = Programming {
        config: Some(config),
        n,
        create_s: secs(first, created),
        last_s: r.ok.then(|| secs(first, r.at_ns)),
        all_s: r.all_at_ns.map(|t| secs(first, t)),
        not_answering: if r.ok { r.all_failed } else { n as usize },
        sync_count: c1 - c0,
        sync_sum_s: s1 - s0,
        agent_sync_ms: agent_ms(&peer, first),
    };
    eprintln!(
        "  {:<20} N={n}: objects created in {:.1}s; last Service answered after {}, all after {} ({} syncs, {:.2}s syncing{})",
        config.program(),
        prog.create_s,
        fmt_s(prog.last_s),
        fmt_s(prog.all_s),
        prog.sync_count,
        prog.sync_sum_s,
        if config.is_agent() {
            format!(
                "; largest agent sync {:.1} ms",
                prog.agent_sync_ms.iter().copied().fold(0.0, f64::max)
            )
        } else {
            String::new()
        }
    );
    if !r.ok || prog.not_answering > 0 {
        eprintln!(
            "  WARNING: {} did not serve every Service in time; last log lines:\n{}",
            config.program(),
            peer.log_text()
        );
    }
    let mut mem: Vec<Memory> = memory(&peer, n, "after creating N through the API")
        .into_iter()
        .collect();
    let changes = (change_reps > 0).then(|| change_latency(ctx, &peer, n, change_reps));
    if let Some(m) = memory(&peer, n, "after the changes") {
        mem.push(m);
    }
    peer.save_log(&ctx.opts.log_dir, &format!("programming-{n}-{config:?}.log"));
    peer.stop();
    (prog, changes, mem)
}

/// One Service added, changed (its port 80 -> 81) and removed, `reps` times, each timed from the
/// API call to the data path showing it (a probe polling every 200 µs; the time is when the SYN
/// of the deciding attempt left). The proxy is idle (no sync for 1.5 s, past kube-proxy's 1 s
/// min-sync-period) before every timed call; the EndpointSlice is created before the Service,
/// untimed.
fn change_latency(ctx: &mut Ctx<'_>, peer: &Peer, n: u32, reps: u32) -> ChangeLatency {
    let mut out = ChangeLatency {
        config: Some(peer.config),
        n,
        ..Default::default()
    };
    let quiet = Duration::from_millis(1500);
    let settle_max = ctx.opts.sync_timeout;
    let (c0, s0) = sync_hist(peer);
    let watch = ctx.cluster.watch_services();
    for rep in 0..reps {
        check_interrupted();
        let i = api::EXTRA_BASE + rep;
        ctx.cluster.create_slice(i);
        let steps: [(&str, u16, bool, Action); 3] = [
            (
                "add",
                api::SERVICE_PORT,
                true,
                Box::new(move |c: &Cluster| c.create_service(i)),
            ),
            (
                "change",
                api::SERVICE_PORT + 1,
                true,
                Box::new(move |c: &Cluster| c.set_port(i, api::SERVICE_PORT + 1)),
            ),
            (
                "remove",
                api::SERVICE_PORT + 1,
                false,
                Box::new(move |c: &Cluster| c.delete_service(i)),
            ),
        ];
        let mut line = format!(
            "  {:<20} on top of {n}: rep {}/{reps}:",
            peer.config.program(),
            rep + 1
        );
        for (what, port, up, act) in steps {
            let step = Step {
                peer,
                quiet,
                settle_max,
                what,
                index: i,
                to: api::vip(i, port),
                want_up: up,
                watch: &watch,
            };
            match step.run(ctx.cluster, &*act) {
                Some((ms, agent, api_ms)) => {
                    if let Some(a) = api_ms {
                        out.api_watch_ms.push(a);
                        out.after_watch_ms.push(ms - a);
                        let kind = out.by_kind.entry(what.to_string()).or_default();
                        kind.api_watch_ms.push(a);
                        kind.after_watch_ms.push(ms - a);
                    }
                    line.push_str(&format!(
                        " {what} {ms:.1} ms (API watch event after {})",
                        api_ms.map(|a| format!("{a:.1} ms")).unwrap_or_else(|| "?".into())
                    ));
                    match what {
                        "add" => out.add_ms.push(ms),
                        "change" => out.change_ms.push(ms),
                        _ => out.remove_ms.push(ms),
                    }
                    if let Some(sync) = agent {
                        out.agent_sync_ms.push(sync.elapsed_ms);
                        out.agent_datapath_ms.extend(sync.datapath_ms);
                        out.agent_own_ms.extend(sync.own_ms());
                    }
                }
                None => {
                    out.failures += 1;
                    line.push_str(&format!(" {what} FAILED"));
                }
            }
        }
        eprintln!("{line}");
        ctx.cluster.delete_slice(i);
    }
    peer.settle(quiet, settle_max);
    let (c1, s1) = sync_hist(peer);
    out.sync_count = c1 - c0;
    out.sync_sum_s = s1 - s0;
    out
}

type Action = Box<dyn Fn(&Cluster)>;

/// The agent's sync that applied a change, from its "data path programmed" log line.
#[derive(Clone, Copy, Debug)]
struct AgentSync {
    elapsed_ms: f64,
    datapath_ms: Option<f64>,
    /// From the first watch event the sync took to its start.
    queued_ms: Option<f64>,
}

impl AgentSync {
    /// From the agent's watch event to its last map write.
    fn own_ms(&self) -> Option<f64> {
        Some(self.queued_ms? + self.datapath_ms?)
    }
}

struct Step<'a> {
    peer: &'a Peer,
    quiet: Duration,
    settle_max: Duration,
    what: &'a str,
    index: u32,
    to: std::net::SocketAddr,
    want_up: bool,
    watch: &'a api::ServiceWatch,
}

impl Step<'_> {
    /// Waits for the proxy to be idle, then times `act` until the probe sees the wanted state.
    /// Returns (ms, the agent's sync if it logged one, ms to the API watch event).
    fn run(
        &self,
        cluster: &Cluster,
        act: &dyn Fn(&Cluster),
    ) -> Option<(f64, Option<AgentSync>, Option<f64>)> {
        self.peer.settle(self.quiet, self.settle_max);
        let probe = Probe::start(
            self.peer.client(),
            self.to,
            self.want_up,
            Duration::from_secs(120),
            200,
            None,
        );
        if probe.initially_up == self.want_up {
            eprintln!(
                "  WARNING: {}: {} was already {}",
                self.what,
                self.to,
                if self.want_up { "up" } else { "down" }
            );
        }
        let since = now_ns();
        act(cluster);
        let r = probe.wait();
        if !r.ok {
            return None;
        }
        let ms = r.at_ns.saturating_sub(since) as f64 / 1e6;
        if std::env::var_os("LB_BENCH_DEBUG").is_some() {
            let syncs: Vec<String> = self
                .peer
                .agent_syncs_since(since)
                .iter()
                .map(|(t, f)| {
                    let ms = |k: &str| f.get(k).map_or("-".into(), |v| format!("{v:.2}"));
                    format!(
                        "{:.1}ms(queued {} datapath {} elapsed {})",
                        t.saturating_sub(since) as f64 / 1e6,
                        ms("queued_ms"),
                        ms("datapath_ms"),
                        ms("elapsed_ms")
                    )
                })
                .collect();
            eprintln!(
                "    debug {}: probe {ms:.1} ms after {} attempts; agent sync lines at {syncs:?}; watch {:?}",
                self.what,
                r.attempts,
                self.watch
                    .seen(since, self.index, self.to.port(), !self.want_up)
                    .map(|t| t.saturating_sub(since) as f64 / 1e6)
            );
        }
        let agent = self
            .peer
            .agent_syncs_since(since)
            .iter()
            .filter(|(t, _)| *t <= r.at_ns + 50_000_000)
            .filter_map(|(_, f)| {
                Some(AgentSync {
                    elapsed_ms: *f.get("elapsed_ms")?,
                    datapath_ms: f.get("datapath_ms").copied(),
                    queued_ms: f.get("queued_ms").copied(),
                })
            })
            .fold(None, |m: Option<AgentSync>, v| {
                Some(m.map_or(v, |m| if v.elapsed_ms > m.elapsed_ms { v } else { m }))
            });
        let seen = || self.watch.seen(since, self.index, self.to.port(), !self.want_up);
        let api_ms = seen()
            .or_else(|| {
                std::thread::sleep(Duration::from_millis(50));
                seen()
            })
            .map(|t| t.saturating_sub(since) as f64 / 1e6);
        Some((ms, agent, api_ms))
    }
}

pub fn fmt_s(v: Option<f64>) -> String {
    match v {
        Some(s) if s < 1.0 => format!("{:.0} ms", s * 1e3),
        Some(s) => format!("{s:.2} s"),
        None => "did not finish".into(),
    }
}
