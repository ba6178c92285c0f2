//! `cargo xtask bench [--quick]`: lb-agent side by side with the real kube-proxy (iptables and
//! nftables) and the no-balancer floor; prints the numbers and regenerates docs/benchmarks.md and
//! docs/bench/*.png. Needs root (namespaces, cgroups, BPF) and the control-plane binaries of
//! `cargo xtask k8s-bins`; everything it creates is removed by guards, also on panic or Ctrl-C.
//!
//! Hidden subcommands (`crr`, `serve`, `probe`) are the child processes the suite starts inside
//! its namespaces and cgroups.

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
    /// Skip the BPF_PROG_TEST_RUN measurements.
    #[arg(long)]
    skip_tc: bool,
    /// Do not rewrite docs/benchmarks.md and docs/bench/*.png.
    #[arg(long)]
    no_docs: bool,
    /// Regenerate the docs from a results JSON of an earlier run (target/bench/results-*.json).
    #[arg(long, value_name = "FILE")]
    report: Option<std::path::PathBuf>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("crr") => return bench::crr::crr_main(&args[2..]),
        Some("serve") => return bench::crr::serve_main(&args[2..]),
        Some("probe") => return bench::crr::probe_main(&args[2..]),
        _ => {}
    }
    let cli = Cli::parse();
    if let Some(file) = &cli.report {
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let r: bench::report::Results = serde_json::from_str(&text).expect("results JSON");
        println!("{}", bench::report::summary(&r));
        bench::write_docs(&r);
        return;
    }
    lb_tests::require_root();
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
    opts.skip_tc = cli.skip_tc;
    opts.write_docs = !cli.no_docs;
    let command = format!("cargo xtask bench{}", if cli.quick { " --quick" } else { "" });
    let results = bench::run(&opts, command);
    println!("{}", bench::report::summary(&results));
    if opts.write_docs {
        bench::write_docs(&results);
    }
}
