//! The data path on the kernel these tests run on (`cargo xtask kernel-test` runs them on every
//! kernel of the matrix): every program of the object passes this kernel's verifier with the
//! feature bits the agent chooses here, and the agent's feature probes never miss a feature the
//! kernel's version guarantees (a probe that wrongly said "no" would silently put a whole fleet
//! on a fallback).

use lb_agent::datapath::{Datapath, OBJECT, features};
use lb_common::catalog::Capacities;
use lb_tests::require_root;

fn small() -> Capacities {
    Capacities {
        services: 64,
        backends: 64,
        revnat: 64,
        sock_revnat: 64,
        affinity: 64,
        affinity_match: 64,
        source_ranges: 64,
        conntrack: 64,
        conntrack_new: 64,
    }
}

#[test]
fn every_program_passes_this_kernels_verifier() {
    require_root();
    let kernel = features::current().expect("probing the kernel");
    kernel.check().expect("this kernel is supported");
    let mut datapath = Datapath::load_unpinned(&small(), OBJECT)
        .unwrap_or_else(|e| panic!("the object does not load on Linux {}: {e}", kernel.release));
    let programs = datapath.verify_programs().expect("every program loads");
    let names: Vec<&str> = programs.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "lb_connect4",
            "lb_connect6",
            "lb_getpeername4",
            "lb_getpeername6",
            "lb_probe_netns",
            "lb_recvmsg4",
            "lb_recvmsg6",
            "lb_sendmsg4",
            "lb_sendmsg6",
            "lb_sock_release",
            "lb_sock_trace",
            "lb_tc_egress",
            "lb_tc_ingress",
            "lb_tc_sctp_in",
            "lb_tc_sctp_out",
        ],
        "the object's programs"
    );
    eprintln!(
        "Linux {} (LB_FEATURES {:#x}):",
        kernel.release, kernel.program_bits
    );
    for program in &programs {
        eprintln!(
            "  {:<16} {:>6} instructions, {:>7} verifier steps",
            program.name,
            program.instructions,
            program
                .verified_instructions
                .map_or("?".into(), |n| n.to_string())
        );
        assert!(program.instructions > 0, "{} has no instructions", program.name);
        // Kernels older than 5.16 do not report the count.
        if let Some(steps) = program.verified_instructions {
            assert!(
                steps > 0 && steps < 1_000_000,
                "{}: {steps} verifier steps (the limit is 1,000,000)",
                program.name
            );
        }
    }
}

#[test]
fn probes_find_every_feature_the_kernel_version_guarantees() {
    require_root();
    let kernel = features::current().expect("probing the kernel");
    let version = kernel.version.expect("uname -r parses as a version");
    let at_least = |major, minor| version >= aya::util::KernelVersion::new(major, minor, 0);
    // Backports may bring a feature to an older kernel, so only "new enough => present" holds.
    let expectations = [
        ("bpf_ktime_get_coarse_ns", at_least(5, 11), kernel.ktime_coarse),
        ("SO_NETNS_COOKIE", at_least(5, 14), kernel.netns_cookie_sockopt),
        ("bpf_set_retval", at_least(5, 18), kernel.set_retval),
        ("TCX", at_least(6, 6), kernel.tcx),
    ];
    for (feature, guaranteed, present) in expectations {
        assert!(
            present || !guaranteed,
            "Linux {} has {feature} upstream, but the probe did not find it",
            kernel.release
        );
    }
    for feature in &kernel.features {
        assert!(
            feature.present || feature.fallback.is_some(),
            "{} is required and missing, yet check() passed",
            feature.name
        );
    }
    // The programs' bits are exactly the program-side features found.
    let expected_bits = if kernel.set_retval {
        lb_common::features::SET_RETVAL
    } else {
        0
    } | if kernel.ktime_coarse {
        lb_common::features::KTIME_COARSE
    } else {
        0
    };
    assert_eq!(kernel.program_bits, expected_bits);
}
