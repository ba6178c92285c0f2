//! `cargo xtask kernel-test`: the privileged test suite on the kernels operators run, each booted
//! in a guest on this machine, and on the host's own kernel.
//!
//! - Kernels: Debian's `linux-image-<release>-amd64` packages, the newest build of each series
//!   the Debian mirror serves (5.10, 6.1, 6.12, ...). They are found through a private apt
//!   sources list and private apt state under the cache (the machine's own apt configuration is
//!   never touched), downloaded with `apt-get download` and extracted with `dpkg-deb -x` under
//!   `<cache>/kernels/<release>/`: nothing is installed as the host's kernel.
//! - Guests: virtme-ng (PyPI, in a virtualenv under the cache) boots a kernel with qemu over a
//!   read-only view of this machine's filesystem: the test binaries built here run there as they
//!   are. `target/` is an overlay the guest may write (the host's copy is untouched), and one
//!   shared directory carries each binary's output and result back. KVM is used where the CPU
//!   exposes hardware virtualization; elsewhere (this kind of VM: nested KVM runs ~1000x slow)
//!   the guest is emulated (TCG), slower but with the same verifier, BPF_PROG_TEST_RUN,
//!   namespaces and cgroups.
//! - Each kernel prints a line per test binary as it finishes, then a summary; the results go to
//!   `target/kernel-test/<release>/` and `docs/kernels.md` is written from every result there.
//!   Ctrl-C, SIGTERM and SIGHUP stop the guest; nothing stays running or mounted.
//!
//! The files: `apt` (the private apt sources and state, which `node.rs` and `upstream_images`
//! use too), `kernels` (which kernels: Debian's packages, fetched and extracted, and the
//! host's), `vm` (virtme-ng, KVM or TCG, the guest's process group, the signals that stop it),
//! `run` (the test binaries on one kernel and what came back), `in_guest` (`cargo xtask
//! kernel-guest`, inside the guest), `doc` (docs/kernels.md).

mod apt;
mod doc;
mod in_guest;
mod kernels;
mod run;
mod vm;

use std::{sync::atomic::Ordering, time::Instant};

use anyhow::{Result, bail};

pub(crate) use self::apt::PrivateApt;
pub use self::in_guest::guest;
use self::{
    doc::write_doc,
    kernels::{Kernel, resolve_kernels},
    run::{KernelOutcome, build_test_binaries, run_kernel},
    vm::{GUEST_PACKAGES, INTERRUPTED, catch_signals, ensure_virtme_ng, use_kvm},
};
use crate::{
    ebpf, setup,
    test::{Summary, build_agent, require_root, test_env},
    util::{cache_dir, step},
};

/// `cargo xtask kernel-test` options.
#[derive(clap::Args, Debug, Clone)]
pub struct Options {
    /// A kernel to test: a series (`6.1`), a release (`6.1.0-56-amd64`), `host` (the running
    /// kernel, natively) or `all` (every series the mirror serves, and the host). Repeatable;
    /// default `all`.
    #[arg(long = "kernel")]
    pub kernels: Vec<String>,
    /// Only these test binaries of tests/ (`tc_fixtures`, `socket_lb`, ...; `lib` for the
    /// harness's own tests). Repeatable; default: every binary but the end-to-end ones.
    #[arg(long = "binary")]
    pub binaries: Vec<String>,
    /// Only tests whose name contains this (passed to every test binary).
    #[arg(long)]
    pub filter: Option<String>,
    /// Guest CPUs.
    #[arg(long, default_value_t = 2)]
    pub cpus: u32,
    /// Guest memory.
    #[arg(long, default_value = "4G")]
    pub memory: String,
    /// `kvm`, `tcg` (emulated) or `auto` (KVM when the CPU exposes hardware virtualization).
    #[arg(long, default_value = "auto")]
    pub accel: String,
    /// Give up on a kernel after this many minutes.
    #[arg(long, default_value_t = 120)]
    pub timeout_minutes: u64,
    /// List the kernels the mirror serves and exit.
    #[arg(long)]
    pub list: bool,
    /// Only what `./x test` runs in a guest (its kernel and tests), as it runs them: results under
    /// `target/kernel-test-ci/`, docs/kernels.md untouched.
    #[arg(long)]
    pub ci: bool,
    /// Binaries that run only the tests named here (exactly); the others run whole.
    #[arg(skip)]
    pub only: Vec<(String, Vec<String>)>,
}

/// The kernel and tests `./x test` runs in a guest: Debian 12's kernel, the oldest LTS most fleets
/// run; every program through its verifier, and the "fixtures and one netns test": eight tc
/// fixtures, one socket-path test, the clsact fallback that only kernels before 6.6 take, and real
/// SCTP associations (this machine's own kernel may lack the module). Emulated, a test costs 15 to
/// 50 s here (a tc fixture mostly the verifier on `lb_tc_ingress`; the SCTP associations about 6
/// minutes, three agents' starts on two nodes) and CI's machine has been up to 2.5 times slower:
/// the whole binaries took 35 to 50 minutes there, this subset about 17 here. The full matrix is
/// `cargo xtask kernel-test`.
pub const CI_KERNEL: &str = "6.1";
/// Test binaries, each whole (no names) or only the tests named.
pub type Tests = &'static [(&'static str, &'static [&'static str])];

pub const CI_TESTS: Tests = &[
    // Every program through this kernel's verifier, and the feature probes: whole.
    ("kernel_support", &[]),
    (
        "tc_fixtures",
        &[
            "syn_to_a_cluster_ip_is_translated_to_the_backend",
            "replies_get_the_frontend_back_on_the_way_out",
            "nodeport_from_outside_is_translated_and_masqueraded_both_ways",
            "udp_is_translated_with_correct_checksums_in_both_families",
            "icmp_errors_about_replies_are_translated_for_the_backend_and_the_client",
            "a_service_without_endpoints_is_rejected_with_icmp_port_unreachable",
            // SCTP's tail call and checksum update on the oldest LTS's verifier and helpers.
            "sctp_to_a_cluster_ip_is_translated_with_a_valid_crc32c_both_ways",
            // The egress flow filter: the programs' byte stores and the agent's mapping of
            // the array (BPF_F_MMAPABLE).
            "the_egress_flow_filter_holds_every_tracked_tuple_and_only_those",
        ],
    ),
    (
        "socket_lb",
        &[
            "every_frontend_type_from_the_host_and_from_a_pod",
            // The connected sockets' slots (`bpf_spin_lock` in a socket program, freed by the
            // `sock_release` program) and their socket-storage fallback.
            "a_connected_sockets_slot_is_freed_with_the_socket_and_a_busy_slot_falls_back_to_socket_storage",
        ],
    ),
    (
        "tc_topology",
        &[
            "clsact_filters_are_replaced_in_place_switched_and_cleaned_up",
            // Real SCTP associations (the guest loads the kernel's `sctp` module; this machine's
            // own kernel may have none, where the test skips): from outside through a NodePort,
            // from a pod, and the node's own through `lb_tc_sctp_out`.
            "sctp_associations_through_the_tc_path",
        ],
    ),
];

/// The oldest kernel the agent runs on (`features::MINIMUM_KERNEL`, Debian 11's), in `./x test`
/// too, for every program through its verifier (about a minute emulated): 5.10 refuses what 6.1
/// accepts, such as a read of a stack slot no store on the path wrote, which LLVM's code for an
/// `Option` can hold (docs/architecture.md, *SCTP*).
pub const CI_OLDEST_KERNEL: &str = "5.10";
pub const CI_OLDEST_TESTS: Tests = &[
    ("kernel_support", &[]),
    // The egress flow filter's mapping and byte stores on the oldest kernel the agent runs on.
    (
        "tc_fixtures",
        &["the_egress_flow_filter_holds_every_tracked_tuple_and_only_those"],
    ),
];

/// The guests of `./x test`: each kernel with its tests.
pub const CI_GUESTS: &[(&str, Tests)] = &[(CI_KERNEL, CI_TESTS), (CI_OLDEST_KERNEL, CI_OLDEST_TESTS)];

/// Runs each of [`CI_GUESTS`] for `./x test`, adding the results to `summary` (a binary that ran
/// another number of tests than it was named fails: `in_guest::binary_result`).
pub fn run_ci_subset(summary: &mut Summary) -> Result<bool> {
    let mut ok = true;
    for (kernel, tests) in CI_GUESTS {
        ok &= run_ci_guest(kernel, tests, summary)?;
    }
    Ok(ok)
}

fn run_ci_guest(kernel: &str, tests: Tests, summary: &mut Summary) -> Result<bool> {
    let opts = Options {
        kernels: vec![kernel.into()],
        binaries: tests.iter().map(|(b, _)| b.to_string()).collect(),
        filter: None,
        cpus: 2,
        memory: "4G".into(),
        accel: "auto".into(),
        timeout_minutes: 40,
        list: false,
        ci: true,
        only: tests
            .iter()
            .filter(|(_, tests)| !tests.is_empty())
            .map(|(b, tests)| (b.to_string(), tests.iter().map(|t| t.to_string()).collect()))
            .collect(),
    };
    let outcomes = run_kernels(&opts)?;
    let mut ok = !outcomes.is_empty();
    for outcome in &outcomes {
        ok &= outcome.ok();
        for r in &outcome.results {
            summary.binaries += 1;
            summary.passed += r["passed"].as_u64().unwrap_or(0);
            summary.failed += r["failed"].as_u64().unwrap_or(0);
            summary.ignored += r["ignored"].as_u64().unwrap_or(0);
            if r["ok"] != true {
                summary.failing_binaries.push(format!(
                    "{} on Linux {} (target/kernel-test-ci/{}/)",
                    r["binary"].as_str().unwrap_or("?"),
                    outcome.kernel.release,
                    outcome.kernel.release
                ));
            }
        }
        summary.failure_reasons.extend(outcome.failure_reasons());
        if let Some(why) = &outcome.aborted {
            summary
                .failing_binaries
                .push(format!("Linux {}: {why}", outcome.kernel.release));
        }
    }
    Ok(ok)
}

/// `cargo xtask kernel-test`.
pub fn run_matrix(opts: &Options) -> Result<()> {
    require_root()?;
    if opts.ci {
        let started = Instant::now();
        let mut summary = Summary::default();
        let ok = run_ci_subset(&mut summary)?;
        crate::test::print_summary(&summary, started, ok);
        if !ok {
            bail!("tests failed");
        }
        return Ok(());
    }
    if opts.list {
        let apt = PrivateApt::new(&cache_dir())?;
        apt.update()?;
        for (series, k) in apt.newest_per_series()? {
            println!("{series:<6} {} {}", k.package, k.version);
        }
        println!("host   {}", Kernel::host()?.release);
        return Ok(());
    }
    let started = Instant::now();
    let outcomes = run_kernels(opts)?;
    println!(
        "\nkernel matrix ({:.0} min):",
        started.elapsed().as_secs_f64() / 60.0
    );
    for o in &outcomes {
        let passed: u64 = o.results.iter().filter_map(|r| r["passed"].as_u64()).sum();
        let failed: u64 = o.results.iter().filter_map(|r| r["failed"].as_u64()).sum();
        let bad: Vec<&str> = o
            .results
            .iter()
            .filter(|r| r["ok"] != true)
            .filter_map(|r| r["binary"].as_str())
            .collect();
        println!(
            "    {:<28} {:<7} {passed} passed, {failed} failed{}{}  ({:.0} min)",
            o.kernel.release,
            if o.ok() { "ok" } else { "FAILED" },
            if bad.is_empty() {
                String::new()
            } else {
                format!("; failing: {}", bad.join(", "))
            },
            o.aborted.as_ref().map(|a| format!("; {a}")).unwrap_or_default(),
            o.seconds / 60.0
        );
    }
    write_doc()?;
    // Last, so that the tail of a long run's output says why (each binary's log is in the
    // kernel's results directory).
    let reasons: Vec<(String, Vec<String>)> =
        outcomes.iter().flat_map(KernelOutcome::failure_reasons).collect();
    crate::test::print_failure_reasons(&reasons);
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    if !outcomes.iter().all(KernelOutcome::ok) {
        bail!("the suite failed on some kernel");
    }
    Ok(())
}

/// Sets up, builds, and runs the selected binaries on each selected kernel.
fn run_kernels(opts: &Options) -> Result<Vec<KernelOutcome>> {
    catch_signals();
    setup::all()?;
    ebpf::build()?;
    let kernels = resolve_kernels(&opts.kernels)?;
    let guests = kernels.iter().any(|k| k.vmlinuz.is_some());
    let vng = if guests {
        setup::install(GUEST_PACKAGES)?;
        Some(ensure_virtme_ng()?)
    } else {
        None
    };
    let kvm = use_kvm(&opts.accel)?;
    // The restart and upgrade scenarios run a real control plane, as on the host.
    let mut env = test_env(true)?;
    env.push(("HOME", std::env::var("HOME").unwrap_or_else(|_| "/root".into())));
    if !kvm {
        // Timeouts sized for a real CPU stretch in an emulated guest (tests/src/agent.rs).
        env.push(("LB_TEST_EMULATED", "1".into()));
    }
    env.push(("PATH", std::env::var("PATH").unwrap_or_default()));
    build_agent()?;
    ebpf::build_variant()?;
    let binaries = build_test_binaries(&opts.binaries)?;
    step(&format!(
        "{} test binaries on {} kernel(s): {}",
        binaries.len(),
        kernels.len(),
        kernels
            .iter()
            .map(|k| k.release.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let mut outcomes = Vec::new();
    for kernel in &kernels {
        if INTERRUPTED.load(Ordering::SeqCst) {
            break;
        }
        let mut outcome = run_kernel(kernel, &binaries, opts, &env, vng.as_deref(), kvm)?;
        if outcome.panicked_while_booting() && !INTERRUPTED.load(Ordering::SeqCst) {
            // Emulated guests of some kernels (6.12's) now and then die in early boot, patching
            // their own code under TCG (an int3 Oops in a static call site), before any test: the
            // kernel under test never ran them. One more boot, said out loud.
            println!(
                "==> Linux {}: the guest's kernel panicked while booting, before any test ran; booting it once more",
                kernel.release
            );
            outcome = run_kernel(kernel, &binaries, opts, &env, vng.as_deref(), kvm)?;
        }
        outcomes.push(outcome);
    }
    Ok(outcomes)
}
