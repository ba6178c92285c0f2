//! `cargo xtask bench [--quick]`: lb-agent side by side with the real kube-proxy (iptables and
//! nftables) and the no-balancer floor, over IPv4 and over IPv6; prints the numbers and
//! regenerates docs/benchmarks.md and docs/bench/*.png. Needs root (namespaces, cgroups, BPF)
//! and the control-plane binaries of `cargo xtask k8s-bins`; everything it creates is removed
//! by guards, also on panic or Ctrl-C.
//!
//! Hidden subcommands (`crr`, `serve`, `probe`) are the child processes the suite starts inside
//! its namespaces and cgroups. `lb-bench cluster N` is for profiling by hand: a control plane
//! holding the suite's N Services (10 endpoints each) until Ctrl-C, its kubeconfig printed, so
//! an agent can be started against it as often as needed without creating them again.
//! `lb-bench tc-profile N SECONDS` runs the tc new-flow fixture in a loop for a profiler.
//!
//! The results are saved as JSON after every step (target/bench/results-{quick,full}.json) and
//! every proxy's log in target/bench/logs. `LB_BENCH_VERBOSE=1` echoes the proxies' logs live;
//! `LB_BENCH_DEBUG=1` prints, for every add/change/remove, when the agent's syncs and the API
//! watch event happened relative to the API call.

#[path = "../bench/mod.rs"]
mod bench;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "lb-bench",
    about = "Benchmarks side by side with kube-proxy; writes docs/benchmarks.md"
)]
struct Cli {
    /// 10 and 1,000 Services, fewer rounds (a few minutes).
    #[arg(long)]
    quick: bool,
    /// Rounds of the connect-latency runs (default: 3 quick, 7 full).
    #[arg(long)]
    rounds: Option<usize>,
    /// Connections per configuration and round (default: 5,000 quick, 20,000 full).
    #[arg(long)]
    conns: Option<usize>,
    /// Repetitions of the add/change/remove measurement (default: 5 quick, 15 full).
    #[arg(long)]
    change_reps: Option<u32>,
    /// Service counts of the connect-latency runs (development; default 10,1000[,10000]).
    #[arg(long, value_delimiter = ',')]
    levels: Vec<u32>,
    /// Service counts of the programming runs, each one of --levels (development).
    #[arg(long, value_delimiter = ',')]
    programming_levels: Vec<u32>,
    /// Only the connect-latency runs (no programming runs, no BPF_PROG_TEST_RUN).
    #[arg(long)]
    latency_only: bool,
    /// Seconds a configuration may take to serve every Service after its start before it is
    /// left out of the connect-latency rounds (default: 600 quick, 1200 full).
    #[arg(long)]
    cold_timeout: Option<u64>,
    /// Skip the BPF_PROG_TEST_RUN measurements.
    #[arg(long)]
    skip_tc: bool,
    /// Skip the north-south throughput (NodePort from outside the node).
    #[arg(long)]
    skip_throughput: bool,
    /// Skip the iptables-restore scaling runs (kube-proxy's ruleset on each iptables backend).
    #[arg(long)]
    skip_restore: bool,
    /// IPv4 only: no connect-latency rounds or tc cost over IPv6.
    #[arg(long)]
    no_ipv6: bool,
    /// Only the BPF_PROG_TEST_RUN measurements (development).
    #[arg(long, conflicts_with_all = ["skip_tc", "latency_only"])]
    tc_only: bool,
    /// Only these configurations (development): direct, iptables, nftables, lb-socket, lb-tc,
    /// cilium-socket, cilium-tc. Default: all (Cilium's when `LB_CILIUM_DIR` names its bundle).
    #[arg(long, value_delimiter = ',')]
    configs: Vec<String>,
    /// Only the iptables-restore scaling runs (development).
    #[arg(long, conflicts_with_all = ["skip_restore", "latency_only", "tc_only"])]
    restore_only: bool,
    /// Skip the Maglev table measurements.
    #[arg(long)]
    skip_maglev: bool,
    /// Service counts of the Maglev table measurements (default 10000).
    #[arg(long, value_delimiter = ',')]
    maglev_levels: Vec<u32>,
    /// Do not rewrite docs/benchmarks.md and docs/bench/*.png.
    #[arg(long)]
    no_docs: bool,
    /// Regenerate the docs from the results JSON of earlier runs (target/bench/results-*.json,
    /// docs/bench/results.json: what the current docs were generated from); several files are
    /// merged in order (e.g. the docs' results and a --levels 10000 run completing them).
    #[arg(long, value_name = "FILE", num_args = 1..)]
    report: Vec<std::path::PathBuf>,
}

/// `cargo xtask bench` builds lb-agent next to lb-bench (release, with the eBPF object it just
/// built) and runs lb-bench directly, which then measures that agent. Run through `cargo run`
/// instead, lb-bench builds the agent itself so that a stale one is never measured, in a target
/// directory of its own: this process carries the variables `cargo run` set for lb-bench
/// (CARGO_MANIFEST_DIR, CARGO_PKG_NAME, ...), which build scripts such as ring's watch, so a build
/// in the main target directory would redo a good part of the dependencies there.
fn build_agent() {
    let Some(cargo) = std::env::var_os("CARGO") else {
        return;
    };
    let target_dir = bench::workspace_root().join("target/bench/agent");
    eprintln!("==> building lb-agent (release, in {})", target_dir.display());
    let status = std::process::Command::new(cargo)
        .args([
            "build",
            "--release",
            "--quiet",
            "--package",
            "lb-agent",
            "--bin",
            "lb-agent",
            "--target-dir",
        ])
        .arg(&target_dir)
        .current_dir(bench::workspace_root())
        .status()
        .expect("run cargo");
    assert!(status.success(), "building lb-agent failed ({status})");
    bench::use_agent(target_dir.join("release/lb-agent"));
}

/// `lb-bench tc-profile [N] [SECONDS] [ipv6]`: new flows through `lb_tc_ingress` for a profiler
/// (`perf record -g -- lb-bench tc-profile 1000 20`); see `bench::tcrun::profile_new_flow`.
fn tc_profile(args: &[String]) {
    lb_tests::require_root();
    let n = args
        .first()
        .map_or(1000, |a| a.parse().expect("N: a number of Services"));
    let secs = args.get(1).map_or(20, |a| a.parse().expect("SECONDS: a number"));
    let family = match args.get(2).map(String::as_str) {
        Some("ipv6") => lb_tests::packet::Family::V6,
        _ => lb_tests::packet::Family::V4,
    };
    if let Err(e) = bench::tcrun::profile_new_flow(n, family, secs) {
        eprintln!("tc-profile: {e:#}");
        std::process::exit(1);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("crr") => return bench::crr::crr_main(&args[2..]),
        Some("serve") => return bench::crr::serve_main(&args[2..]),
        Some("probe") => return bench::crr::probe_main(&args[2..]),
        Some("load") => return bench::throughput::load_main(&args[2..]),
        Some("cluster") => return hold_cluster(&args[2..]),
        Some("tc-profile") => return tc_profile(&args[2..]),
        _ => {}
    }
    let cli = Cli::parse();
    if !cli.report.is_empty() {
        let mut r: Option<bench::report::Results> = None;
        for file in &cli.report {
            let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let next: bench::report::Results = serde_json::from_str(&text).expect("results JSON");
            r = Some(match r {
                None => next,
                Some(r) => r.merge(next),
            });
        }
        let r = r.expect("a results file");
        println!("{}", bench::report::summary(&r));
        bench::write_docs(&r);
        return;
    }
    lb_tests::require_root(); // also sweeps what killed runs left behind
    build_agent();
    bench::install_signal_handlers();
    let mut opts = bench::Options::new(cli.quick);
    if let Some(r) = cli.rounds {
        opts.rounds = r;
    }
    if let Some(c) = cli.conns {
        opts.conns = c;
    }
    if let Some(c) = cli.change_reps {
        opts.change_reps = c;
    }
    if !cli.levels.is_empty() {
        opts.levels = cli.levels.clone();
        let max = cli.levels.iter().copied().max().unwrap_or(10);
        opts.tc_levels = vec![10, max];
        opts.programming = vec![max];
    }
    if !cli.programming_levels.is_empty() {
        opts.programming = cli.programming_levels.clone();
    }
    opts.fit_capacities();
    opts.skip_tc = cli.skip_tc;
    if cli.skip_restore {
        opts.restore_levels.clear();
    }
    if cli.restore_only {
        opts.restore_only = true;
        opts.skip_tc = true;
    }
    opts.ipv6 = !cli.no_ipv6;
    opts.tc_only = cli.tc_only;
    if cli.latency_only {
        opts.programming.clear();
        opts.skip_tc = true;
        opts.throughput_rounds = 0;
        opts.restore_levels.clear();
    }
    if cli.skip_throughput {
        opts.throughput_rounds = 0;
    }
    if !cli.maglev_levels.is_empty() {
        opts.maglev_levels = cli.maglev_levels.clone();
    }
    if cli.skip_maglev || cli.latency_only || cli.restore_only {
        opts.maglev_levels.clear();
    }
    if let Some(t) = cli.cold_timeout {
        opts.cold_timeout = std::time::Duration::from_secs(t);
    }
    opts.write_docs = !cli.no_docs;
    if !cli.configs.is_empty() {
        opts.configs = cli
            .configs
            .iter()
            .map(|c| {
                bench::peers::Config::from_arg(c)
                    .unwrap_or_else(|| panic!("--configs: unknown configuration {c:?}"))
            })
            .collect();
    }
    let command = format!(
        "cargo xtask bench{}",
        std::env::args()
            .skip(1)
            .map(|a| format!(" {a}"))
            .collect::<String>()
    );
    let results = bench::run(&opts, command);
    println!("{}", bench::report::summary(&results));
    if opts.write_docs {
        bench::write_docs(&results);
    }
}

/// `lb-bench cluster N`: the suite's N Services in a real control plane, until Ctrl-C.
fn hold_cluster(args: &[String]) {
    let n: u32 = args
        .first()
        .and_then(|a| a.parse().ok())
        .expect("usage: lb-bench cluster <number of Services>");
    bench::install_signal_handlers();
    let cp = lb_tests::control_plane::ControlPlane::start().expect("control plane");
    let mut cluster = bench::api::Cluster::setup(&cp);
    let started = std::time::Instant::now();
    cluster.grow_to(n);
    eprintln!(
        "==> {n} Services created in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    println!("kubeconfig: {}", cp.kubeconfig_path().display());
    println!(
        "node: {} (InternalIP {}); Ctrl-C stops the control plane",
        bench::api::NODE,
        bench::topo::NODE_IP
    );
    loop {
        std::thread::sleep(std::time::Duration::from_millis(200));
        if std::panic::catch_unwind(bench::check_interrupted).is_err() {
            break;
        }
    }
    drop(cluster);
    drop(cp);
}
