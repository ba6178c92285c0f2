//! The benchmark suite behind `cargo xtask bench`: lb-agent side by side with the real
//! kube-proxy (iptables and nftables) and the no-balancer floor. See `docs/benchmarks.md` (which
//! this writes) for the method; the modules are:
//!
//! - `topo`: the client / node / backend namespaces of one configuration;
//! - `crr`: the connect-latency client, the accept-and-close server and the change probe (child
//!   processes of lb-bench, so they can live in a namespace and a cgroup);
//! - `api`: the Service set, through the real API server;
//! - `peers`: the configurations (floor, kube-proxy iptables on either backend and nftables, lb
//!   socket/tc, Cilium);
//! - `measure`: connect latency, programming time, change latency and memory;
//! - `tcrun`: tc cost per packet with BPF_PROG_TEST_RUN;
//! - `restore`: how `iptables-restore` itself scales on each backend (kube-proxy iptables' limit);
//! - `report`: docs/benchmarks.md, the plots, the terminal summary.
//!
//! Connect latency and the tc cost are measured in both IP families: every topology, proxy and
//! Node is dual-stack (IPv4 first), and after the IPv4 rounds at each N the IPv4 Services are
//! replaced by as many single-stack IPv6 ones for the IPv6 rounds (fresh proxies, cold starts
//! timed the same way), so each family's numbers are taken with only that family's Services in
//! the API, and the IPv4 ones exactly as in an IPv4-only run.

pub mod api;
pub mod cilium;
pub mod crr;
pub mod maglev;
pub mod measure;
pub mod peers;
pub mod report;
pub mod restore;
pub mod tcrun;
pub mod throughput;
pub mod topo;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use lb_tests::{control_plane::ControlPlane, packet::Family};

use self::{measure::Ctx, peers::Config, report::Results};

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    pub quick: bool,
    /// Service counts for the connect-latency runs.
    pub levels: Vec<u32>,
    /// Service counts for the programming runs (the largest also gets the change runs).
    pub programming: Vec<u32>,
    pub change_reps: u32,
    pub rounds: usize,
    pub conns: usize,
    pub warmup: usize,
    pub tc_levels: Vec<u32>,
    pub tc_batches: usize,
    pub tc_calls: usize,
    /// How long a program may take to serve every Service before the step is given up.
    pub sync_timeout: Duration,
    /// How long a configuration may take to serve every Service after its start (cold start)
    /// before it is left out of the connect-latency rounds at that N.
    pub cold_timeout: Duration,
    /// The agent's `--bpf-lb-map-max` (backends and reverse-NAT capacity).
    pub backends_capacity: u32,
    /// The agent's `--bpf-lb-service-map-max` (frontends and backend slots).
    pub services_capacity: u32,
    pub write_docs: bool,
    /// The IPv6 rounds (connect latency and tc cost over IPv6) besides the IPv4 ones.
    pub ipv6: bool,
    pub skip_tc: bool,
    /// Only the BPF_PROG_TEST_RUN measurements (development).
    pub tc_only: bool,
    /// Where every proxy's log is saved (target/bench/logs).
    pub log_dir: PathBuf,
    /// The configurations run: every one by default, Cilium's when its bundle is built.
    pub configs: Vec<Config>,
    /// Rounds of the north-south throughput (0: not measured) and each run's length.
    pub throughput_rounds: usize,
    pub throughput_seconds: u64,
    /// Service counts of the `iptables-restore` scaling runs (empty: not measured).
    pub restore_levels: Vec<u32>,
    /// Only the `iptables-restore` scaling runs (development).
    pub restore_only: bool,
    /// Service counts of the Maglev table measurements (empty: not measured), and the endpoint
    /// changes timed at each.
    pub maglev_levels: Vec<u32>,
    pub maglev_changes: u32,
}

impl Options {
    pub fn new(quick: bool) -> Options {
        Options {
            quick,
            // 30,000 (the largest point of kube-proxy's own published nftables benchmark) is a
            // level of its own, `--levels 10,1000,10000,30000`: through this API server, deleting
            // 30,000 Services between two proxies' runs alone takes over an hour (6 per second).
            levels: if quick {
                vec![10, 1_000]
            } else {
                vec![10, 1_000, 10_000]
            },
            programming: if quick { vec![1_000] } else { vec![1_000, 10_000] },
            change_reps: if quick { 5 } else { 15 },
            rounds: if quick { 3 } else { 7 },
            conns: if quick { 5_000 } else { 20_000 },
            warmup: if quick { 1_000 } else { 2_000 },
            tc_levels: if quick { vec![10, 1_000] } else { vec![10, 10_000] },
            tc_batches: if quick { 3 } else { 10 },
            tc_calls: 20_000,
            sync_timeout: Duration::from_secs(if quick { 600 } else { 2_400 }),
            cold_timeout: Duration::from_secs(if quick { 600 } else { 1_200 }),
            // 10,000 Services × 10 distinct endpoints do not fit the default 65,536 backends.
            backends_capacity: 131_072,
            services_capacity: lb_common::catalog::capacity::SERVICES,
            write_docs: true,
            ipv6: true,
            skip_tc: false,
            tc_only: false,
            log_dir: workspace_root().join("target/bench/logs"),
            configs: Config::ALL
                .into_iter()
                .filter(|c| !c.is_cilium() || cilium::bundle().is_some())
                .filter(|c| *c != Config::IptablesLegacy || peers::legacy_iptables_dir().is_some())
                .collect(),
            throughput_rounds: if quick { 2 } else { 3 },
            throughput_seconds: if quick { 5 } else { 10 },
            restore_levels: vec![500, 1_000, 2_000],
            restore_only: false,
            // Scratch maps only (no API server): 10,000 Services in either run.
            maglev_levels: vec![10_000],
            maglev_changes: if quick { 20 } else { 50 },
        }
    }

    /// Grows the agent's map sizes (and Cilium's) to what the largest level needs: N Services ×
    /// 10 distinct endpoints are 10 N backends and 11 N service entries (a frontend and its
    /// slots), plus room for the helper Services; powers of two, never below the sizes every run
    /// up to 10,000 Services had, and backends at most what the reverse-NAT ids allow.
    pub fn fit_capacities(&mut self) {
        let max = self
            .levels
            .iter()
            .chain(&self.programming)
            .chain(&self.tc_levels)
            .copied()
            .max()
            .unwrap_or(0);
        let (backends, services) = map_sizes(max);
        self.backends_capacity = self.backends_capacity.max(backends);
        self.services_capacity = self.services_capacity.max(services);
    }

    /// Cilium's `--bpf-lb-map-max`, which sizes its service and backend maps alike.
    pub fn cilium_map_max(&self) -> u32 {
        self.backends_capacity.max(self.services_capacity)
    }

    /// The programs whose programming is measured, among the configurations run.
    pub fn proxies(&self) -> Vec<Config> {
        Config::PROXIES
            .into_iter()
            .filter(|c| self.configs.contains(c))
            .collect()
    }
}

/// (backends, service entries) for `n` Services × 10 endpoints: see `Options::fit_capacities`.
pub fn map_sizes(n: u32) -> (u32, u32) {
    let room = 1_024;
    let backends = (n * api::ENDPOINTS + room)
        .next_power_of_two()
        .min(lb_common::catalog::MAX_REVNAT_PER_FAMILY);
    let services = (n * (api::ENDPOINTS + 1) + room).next_power_of_two();
    (backends, services)
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Ctrl-C / SIGTERM: stop at the next step, unwinding so every guard cleans up.
pub fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as usize);
        libc::signal(libc::SIGTERM, on_signal as *const () as usize);
    }
}

pub fn check_interrupted() {
    if INTERRUPTED.load(Ordering::SeqCst) {
        panic!("interrupted; cleaning up");
    }
}

static AGENT: OnceLock<PathBuf> = OnceLock::new();

/// Measure this lb-agent binary (instead of the one next to lb-bench).
pub fn use_agent(path: PathBuf) {
    assert!(path.is_file(), "{} is not built", path.display());
    let _ = AGENT.set(path);
}

/// The lb-agent binary measured.
pub fn agent_bin() -> PathBuf {
    AGENT
        .get()
        .cloned()
        .unwrap_or_else(|| lb_tests::process::workspace_bin("lb-agent"))
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

pub(crate) fn step(what: &str) {
    eprintln!("\n==> {what}");
}

/// The results docs/benchmarks.md was generated from (relative to the workspace root).
pub const DOCS_RESULTS: &str = "docs/bench/results.json";

fn save(results: &Results, path: &Path) {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let _ = std::fs::write(path, serde_json::to_string_pretty(results).expect("json"));
}

/// Runs the whole suite and returns the results (also saved as JSON after every step).
pub fn run(opts: &Options, command: String) -> Results {
    let started = Instant::now();
    let root = workspace_root();
    let out_json = root.join("target/bench").join(if opts.quick {
        "results-quick.json"
    } else {
        "results-full.json"
    });
    let workdir = tempfile::Builder::new()
        .prefix("lb-bench-")
        .tempdir()
        .expect("work dir");
    // Only this run's logs (the proxies' logs of an earlier run would read as this one's).
    let _ = std::fs::remove_dir_all(&opts.log_dir);
    // A tc-only run starts no control plane: its binaries' versions are reported if they are
    // there, and their absence is no error.
    let tc_only = opts.tc_only && !opts.restore_only;
    let bins = if tc_only {
        lb_tests::control_plane::Binaries::locate().ok()
    } else {
        Some(lb_tests::control_plane::Binaries::locate().expect("control-plane binaries"))
    };
    let mut r = Results {
        quick: opts.quick,
        command,
        machine: report::machine(bins.as_ref(), &agent_bin(), &root, opts.cilium_map_max()),
        rounds: opts.rounds,
        conns: opts.conns,
        warmup: opts.warmup,
        change_reps: opts.change_reps,
        backends_capacity: opts.backends_capacity,
        services_capacity: opts.services_capacity,
        ..Default::default()
    };

    if !opts.skip_tc {
        for family in families(opts) {
            for &n in &opts.tc_levels {
                step(&format!(
                    "tc cost per packet (BPF_PROG_TEST_RUN) with {n} {} Services × 10 endpoints",
                    family.name()
                ));
                match tcrun::measure(n, family, opts.tc_batches, opts.tc_calls) {
                    Ok(level) => r.tc_in_mut(family).push(level),
                    Err(e) => {
                        eprintln!("  FAILED: {e:#}");
                        r.problems.push(format!(
                            "tc measurement at {n} {} Services failed: {e:#}",
                            family.name()
                        ));
                    }
                }
                check_interrupted();
            }
        }
        save(&r, &out_json);
    }
    for &n in &opts.maglev_levels {
        check_interrupted();
        step(&format!(
            "Maglev tables: {n} Services with one Maglev external IP each, and {} endpoint changes",
            opts.maglev_changes
        ));
        match maglev::measure(n, opts.maglev_changes) {
            Ok(level) => r.maglev.push(level),
            Err(e) => {
                eprintln!("  FAILED: {e:#}");
                r.problems
                    .push(format!("Maglev measurement at {n} Services failed: {e:#}"));
            }
        }
        save(&r, &out_json);
    }
    if tc_only {
        return r;
    }
    if !opts.restore_levels.is_empty()
        && opts
            .configs
            .iter()
            .any(|c| matches!(c, Config::Iptables | Config::IptablesLegacy))
    {
        step("iptables-restore of kube-proxy's ruleset on each backend, by Service count");
        r.restore = restore::measure(&opts.restore_levels);
        save(&r, &out_json);
    }
    if opts.restore_only {
        return r;
    }

    step("starting etcd and kube-apiserver");
    let cp = ControlPlane::start().expect("control plane");
    let api_addr: SocketAddr = cp
        .server_url()
        .trim_start_matches("https://")
        .parse()
        .expect("API address");
    let mut cluster = api::Cluster::setup(&cp);
    let mut ctx = Ctx {
        cluster: &mut cluster,
        api_addr,
        kubeconfig: cp.kubeconfig_path().to_path_buf(),
        kube_proxy: cp.binaries().kube_proxy.clone(),
        workdir: workdir.path().to_path_buf(),
        opts,
    };
    let change_n = opts.programming.iter().copied().max().unwrap_or(0);
    // Configurations that did not serve a smaller level's Services within the cold-start timeout:
    // not started at a larger level, where they would only time out again (their first sync
    // grows with N) and keep a CPU busy meanwhile.
    let mut too_slow: Vec<(Config, u32)> = Vec::new();
    for &n in &opts.levels {
        check_interrupted();
        if opts.programming.contains(&n) {
            let proxies = opts.proxies();
            for (k, &config) in proxies.iter().enumerate() {
                check_interrupted();
                if ctx.cluster.present > 0 {
                    step(&format!(
                        "deleting the {} benchmark Services",
                        ctx.cluster.present
                    ));
                    ctx.cluster.shrink_to(0);
                }
                // One-change latency on top of the targets' N and of the largest level.
                let reps = if n == change_n || n == report::TARGET_N {
                    opts.change_reps
                } else {
                    0
                };
                step(&format!(
                    "programming: {} creating {n} Services through the API{} ({}/{})",
                    config.program(),
                    if reps > 0 {
                        ", then add/change/remove latency"
                    } else {
                        ""
                    },
                    k + 1,
                    proxies.len()
                ));
                let (p, c, m) = measure::programming(&mut ctx, config, n, reps);
                for (what, missing) in [
                    ("the last Service", p.last_s.is_none()),
                    ("every Service", p.all_s.is_none() || p.not_answering > 0),
                ] {
                    if missing {
                        r.problems.push(format!(
                            "{} did not serve {what} within {:?} after creating {n} Services",
                            config.program(),
                            opts.sync_timeout
                        ));
                    }
                }
                r.programming.push(p);
                if let Some(c) = c {
                    if c.failures > 0 {
                        r.problems.push(format!(
                            "{}: {} of the add/change/remove probes on top of {n} did not see the change within 120 s",
                            config.program(),
                            c.failures
                        ));
                    }
                    r.changes.push(c);
                }
                r.memory.extend(m);
                save(&r, &out_json);
            }
        } else {
            step(&format!("creating {n} Services through the API"));
            ctx.cluster.shrink_to(n);
            ctx.cluster.grow_to(n);
        }
        step(&format!(
            "connect latency with {n} Services: starting the {} configurations",
            opts.configs.len()
        ));
        for &(c, at) in &too_slow {
            let why = format!(
                "{} was not started at {n} Services: it did not serve {at} Services within {:?} of \
                 its start",
                c.label(),
                opts.cold_timeout
            );
            eprintln!("  {why}");
            r.problems.push(why);
        }
        let mut skip: Vec<Config> = too_slow.iter().map(|&(c, _)| c).collect();
        // A kube-proxy whose first sync's iptables-restore alone projects (from this run's own
        // restore measurements) to more than twice the timeout would only time out.
        for &c in &opts.configs {
            if let Some(t) = restore::projected_first_sync_s(&r.restore, c, n)
                && t > 2.0 * opts.cold_timeout.as_secs_f64()
                && !skip.contains(&c)
            {
                let why = format!(
                    "{} was not started at {n} Services: its first sync's iptables-restore alone \
                     projects to {t:.0} s there (section 2's restore measurements), over twice the \
                     cold-start timeout of {:?}",
                    c.label(),
                    opts.cold_timeout
                );
                eprintln!("  {why}");
                r.problems.push(why);
                skip.push(c);
            }
        }
        let (level, mem) = measure::latency_level(&mut ctx, n, Family::V4, &skip);
        level_problems(&mut r, &level, Family::V4, opts);
        // Left out over IPv4 (did not serve the N Services within the cold-start timeout): not
        // started over IPv6 at this N, where the same proxier would face as many Services.
        let left_out: Vec<Config> = level
            .cold
            .iter()
            .filter(|c| c.last_s.is_none())
            .filter_map(|c| c.config)
            .collect();
        too_slow.extend(left_out.iter().map(|&c| (c, n)));
        r.latency.push(level);
        r.memory.extend(mem);
        save(&r, &out_json);
        if opts.ipv6 {
            check_interrupted();
            step(&format!(
                "IPv6: replacing the {} IPv4 Services by {n} single-stack IPv6 Services",
                ctx.cluster.present
            ));
            ctx.cluster.shrink_to(0);
            ctx.cluster.grow_in(Family::V6, n);
            for c in &left_out {
                let why = format!(
                    "{} was not started over IPv6 at {n} Services: it did not serve the {n} IPv4 \
                     Services within {:?} of its start, and its IPv6 proxier would face as many",
                    c.label(),
                    opts.cold_timeout
                );
                eprintln!("  {why}");
                r.problems.push(why);
            }
            step(&format!(
                "connect latency over IPv6 with {n} Services: starting the configurations"
            ));
            let skip6 = [skip.as_slice(), left_out.as_slice()].concat();
            let (level, mem) = measure::latency_level(&mut ctx, n, Family::V6, &skip6);
            level_problems(&mut r, &level, Family::V6, opts);
            r.latency6.push(level);
            r.memory.extend(mem);
            save(&r, &out_json);
            step(&format!("deleting the {n} IPv6 Services"));
            ctx.cluster.shrink_in(Family::V6, 0);
        }
    }
    if opts.throughput_rounds > 0 && !throughput::configs(&opts.configs).is_empty() {
        check_interrupted();
        let (runs, problems) = throughput::measure(&mut ctx, opts.throughput_rounds, opts.throughput_seconds);
        r.throughput = runs;
        r.problems.extend(problems);
        save(&r, &out_json);
    }
    drop(ctx);
    drop(cluster);
    drop(cp);
    r.duration_s = started.elapsed().as_secs_f64();
    save(&r, &out_json);
    eprintln!("results saved in {}", out_json.display());
    eprintln!("the proxies' logs saved in {}", opts.log_dir.display());
    r
}

/// The families measured.
fn families(opts: &Options) -> Vec<Family> {
    if opts.ipv6 {
        vec![Family::V4, Family::V6]
    } else {
        vec![Family::V4]
    }
}

/// What went wrong at one connect-latency level: a configuration that did not serve every
/// Service after its start, failed connections.
fn level_problems(r: &mut Results, level: &measure::LatencyLevel, family: Family, opts: &Options) {
    let n = level.n;
    let over = match family {
        Family::V4 => "",
        Family::V6 => " IPv6",
    };
    for c in &level.cold {
        if c.all_s.is_none() || c.not_answering > 0 {
            r.problems.push(format!(
                "{} did not serve every one of {n}{over} Services within {:?} of its start{}",
                c.config.map(Config::label).unwrap_or(""),
                opts.cold_timeout,
                if c.last_s.is_none() {
                    " (left out of the connect-latency rounds at this N)"
                } else {
                    ""
                }
            ));
            if let Some(stalled) = &c.stalled {
                r.problems.push(format!(
                    "{} at {n}{over} Services, when its timeout ran out: {stalled}",
                    c.config.map(Config::label).unwrap_or("")
                ));
            }
        }
    }
    for (c, runs) in &level.runs {
        let errors: usize = runs.iter().map(|x| x.errors).sum();
        if errors > 0 {
            r.problems.push(format!(
                "{} at {n}{over} Services: {errors} failed connections (first: {})",
                c.label(),
                runs.iter()
                    .find_map(|x| x.first_error.clone())
                    .unwrap_or_default()
            ));
        }
    }
}

/// Writes docs/benchmarks.md and docs/bench/*.png from the results, and the results themselves
/// beside them (docs/bench/results.json): a later partial run (`--levels 10000`, a
/// `--latency-only` completing one) merges into them with `--report docs/bench/results.json
/// target/bench/results-full.json` on any machine, not only the one that made them.
pub fn write_docs(r: &Results) {
    let root = workspace_root();
    save(r, &root.join(DOCS_RESULTS));
    let work = tempfile::tempdir().expect("temp dir");
    match report::plots(r, &root.join("docs/bench"), work.path()) {
        Ok(()) => eprintln!("plots written to {}", root.join("docs/bench").display()),
        Err(e) => eprintln!("plots not written: {e}"),
    }
    let doc = root.join("docs/benchmarks.md");
    std::fs::write(&doc, report::markdown(r)).expect("write docs/benchmarks.md");
    eprintln!("{} written", doc.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_sizes_grow_only_above_ten_thousand_services() {
        // Up to 10,000 Services (the full run) every run keeps the sizes it always had.
        let mut upto_10k = Options::new(false);
        upto_10k.fit_capacities();
        assert_eq!(
            (upto_10k.backends_capacity, upto_10k.services_capacity),
            (131_072, lb_common::catalog::capacity::SERVICES)
        );
        // 30,000 Services x 10 endpoints (`--levels ...,30000`, which also sets the programming
        // and tc levels): 300,000 backends (the most the reverse-NAT ids allow is 524,287) and
        // 330,000 service entries.
        let mut full = Options::new(false);
        full.levels.push(30_000);
        full.fit_capacities();
        assert_eq!(full.backends_capacity, lb_common::catalog::MAX_REVNAT_PER_FAMILY);
        assert_eq!(full.services_capacity, 524_288);
        assert!(full.backends_capacity >= 30_000 * api::ENDPOINTS);
        assert_eq!(full.cilium_map_max(), 524_288);
    }
}
