//! Developer commands. Every command does its own set-up on a fresh machine (toolchains, Debian
//! packages, bpf-linker, the control-plane binaries) and reuses what is cached on the next run.
//!
//! - `setup`        install what is missing, and nothing else;
//! - `build-ebpf`   build the eBPF object (`target/bpf/lb-ebpf.o`), which lb-agent embeds;
//! - `test`         the whole suite: unit, BPF_PROG_TEST_RUN, netns/cgroup, end-to-end;
//! - `e2e`          the end-to-end tests against a real etcd and kube-apiserver only;
//! - `sandbox`      the main job: a local cluster in network namespaces, live traffic tables;
//! - `bench`        benchmarks side by side with kube-proxy (writes docs/benchmarks.md);
//! - `report`       regenerate docs/reliability.md from the figures the last test run recorded;
//! - `soak`         the long reliability run (`--duration 1h`): churn, restarts and upgrades under
//!   load (writes docs/soak.md);
//! - `k8s-bins`     build (or find cached) etcd, kube-apiserver, kube-controller-manager,
//!   kube-scheduler, kubelet, kubectl and kube-proxy;
//! - `node-parts`   fetch (or find cached) containerd, runc and the CNI plugins (Debian's);
//! - `images`       the lb-agent, lb-probe, pause and kube-proxy images as OCI archives;
//! - `kernel-test`  the privileged suite on other kernels (Debian's), each in a guest;
//! - `e2e-upstream` the upstream Kubernetes Service e2e specs on a two-node cluster where
//!   lb-agent is the only Service proxy (writes docs/conformance.md).

mod cilium;
mod ebpf;
mod image;
mod k8s;
mod kernel;
mod node;
mod report;
mod setup;
mod test;
mod upstream_e2e;
mod upstream_images;
mod util;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Developer commands for the eBPF service load balancer"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install missing toolchains, Debian packages and bpf-linker.
    Setup,
    /// Build the eBPF object into target/bpf/lb-ebpf.o.
    BuildEbpf {
        /// Also build the test variant of the programs (target/bpf/lb-ebpf-test-variant.o).
        #[arg(long)]
        variant: bool,
    },
    /// Run the whole test suite (needs root for the privileged tests).
    Test {
        /// Only run tests whose name contains this string.
        filter: Option<String>,
        /// Skip the end-to-end tests (no control-plane build).
        #[arg(long)]
        no_e2e: bool,
        /// Skip the Linux 6.1 guest (the fixtures and netns tests on Debian 12's kernel).
        #[arg(long)]
        no_guest: bool,
    },
    /// Run only the end-to-end tests against a real kube-apiserver.
    E2e { filter: Option<String> },
    /// Start the local sandbox cluster and show live traffic (the README's first command).
    Sandbox {
        /// Arguments passed to the sandbox (see `cargo xtask sandbox -- --help`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run the benchmarks and regenerate docs/benchmarks.md. Cilium is one of the peers: its
    /// bundle is built first (`cilium`; about 20 minutes once), unless LB_BENCH_NO_CILIUM is set.
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build or locate the cached etcd and Kubernetes binaries (control plane, kubelet, kube-proxy).
    K8sBins,
    /// Build or locate the Cilium bundle the benchmark runs as a peer (cilium-agent from its Go
    /// module, its BPF sources and CRDs, clang 19 from Debian); prints its directory.
    Cilium,
    /// Fetch (or find cached) the node's containerd, runc and CNI plugins from Debian's packages.
    NodeParts,
    /// Build the lb-agent, lb-probe, pause and kube-proxy images as OCI archives (for `ctr images import`)
    /// and DIR/images.json, which lists them; archives whose inputs are unchanged are reused.
    Images {
        /// Output directory [default: <workspace>/target/images].
        #[arg(long, value_name = "DIR")]
        out: Option<std::path::PathBuf>,
    },
    /// Regenerate docs/reliability.md from target/reliability/*.json (as `test` does at its end).
    Report,
    /// The soak: churn, API server and etcd restarts, agent restarts, upgrades and kill -9 under
    /// steady load for `--duration`; writes docs/soak.md. Not part of `test`.
    Soak {
        /// How long: Go-style (`1h`, `30m`, `90s`).
        #[arg(long, default_value = "1h", value_parser = parse_duration)]
        duration: std::time::Duration,
        /// Seconds between two actions.
        #[arg(long, default_value_t = 20)]
        step: u64,
    },
    /// Run the privileged test suite on other kernels (Debian's linux-image packages), each booted
    /// in a guest, and on this machine's kernel; writes docs/kernels.md.
    KernelTest(kernel::Options),
    /// The upstream Kubernetes e2e Service specs (e2e.test built here) on a two-node cluster of
    /// real kubelets where lb-agent, deployed from manifests/, is the only Service proxy; writes
    /// docs/conformance.md. About 10 minutes of builds once, then the run.
    E2eUpstream(upstream_e2e::Options),
    /// (Inside a kernel-test guest) run test binaries, recording each one's result.
    #[command(hide = true)]
    KernelGuest {
        #[arg(long)]
        results: std::path::PathBuf,
        #[arg(long)]
        filter: Option<String>,
        /// NAME=TEST,TEST: run only these tests of binary NAME (exact names).
        #[arg(long)]
        only: Vec<String>,
        /// NAME=PATH of each test binary.
        binaries: Vec<String>,
    },
}

/// Errors end with their chain of causes and exit code 1, never with a backtrace: under CI's
/// RUST_BACKTRACE=1 a backtrace of xtask's own frames would push the test summary out of the
/// tail that CI shows.
fn main() {
    if let Err(error) = run(Cli::parse()) {
        eprintln!("error: {error:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Setup => setup::all(),
        Command::BuildEbpf { variant } => {
            setup::ebpf_toolchain_and_linker()?;
            ebpf::build()?;
            if variant {
                ebpf::build_variant()?;
            }
            Ok(())
        }
        Command::Test {
            filter,
            no_e2e,
            no_guest,
        } => test::run_all(filter.as_deref(), !no_e2e, !no_guest),
        Command::E2e { filter } => test::run_e2e(filter.as_deref()),
        Command::Sandbox { args } => test::run_tool("lb-sandbox", &args, false),
        Command::Bench { args } => {
            let cilium = std::env::var_os("LB_BENCH_NO_CILIUM").is_none();
            test::run_tool("lb-bench", &args, cilium)
        }
        Command::Report => report::write_reliability(),
        Command::Soak { duration, step } => test::run_soak(duration, step),
        Command::KernelTest(opts) => kernel::run_matrix(&opts),
        Command::E2eUpstream(opts) => upstream_e2e::run(&opts),
        Command::KernelGuest {
            results,
            filter,
            only,
            binaries,
        } => kernel::guest(&results, filter.as_deref(), &only, &binaries),
        Command::K8sBins => {
            let bins = k8s::ensure(&util::cache_dir())?;
            println!("{}", bins.dir.display());
            Ok(())
        }
        Command::Cilium => {
            println!("{}", cilium::ensure(&util::cache_dir())?.display());
            Ok(())
        }
        Command::NodeParts => {
            println!("{}", node::ensure(&util::cache_dir())?.display());
            Ok(())
        }
        Command::Images { out } => {
            let out = out.unwrap_or_else(image::default_dir);
            image::ensure(&out)?;
            println!("{}", out.join("images.json").display());
            Ok(())
        }
    }
}

/// `1h`, `30m`, `90s`, `1h30m` (jiff's friendly format, or ISO 8601) or plain seconds.
fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(std::time::Duration::from_secs(secs));
    }
    let d: jiff::SignedDuration = s
        .parse()
        .map_err(|e| format!("{s:?}: expected a duration such as 1h, 30m or 90s ({e})"))?;
    std::time::Duration::try_from(d).map_err(|_| format!("{s:?}: a negative duration"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn soak_durations_parse_as_operators_write_them() {
        for (text, secs) in [
            ("1h", 3600),
            ("30m", 1800),
            ("90s", 90),
            ("1h30m", 5400),
            ("600", 600),
        ] {
            assert_eq!(
                super::parse_duration(text),
                Ok(Duration::from_secs(secs)),
                "{text}"
            );
        }
        for bad in ["-1h", "an hour", "1x"] {
            assert!(super::parse_duration(bad).is_err(), "{bad}");
        }
    }
}
