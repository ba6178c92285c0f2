//! Golden tests of the model and the plan, in the style of Cilium's load-balancer tests: every
//! folder under `tests/golden/` is a case, a set of Kubernetes objects (`objects.yaml`) and the
//! node they are programmed on (`case.txt`: the agent's flags and the node's interface addresses),
//! with the map contents expected (`expected.txt`: what `lb-agent services` and `lb-agent
//! backends` print, the masquerade address and the problems reported).
//!
//! The objects go through the agent's own code, watch (`--manifests` reading) -> model -> plan ->
//! maps (`agent::Programmer` over in-memory maps), and the maps are printed by the CLI's own
//! tables. Each case is programmed twice: from scratch, as a full sync does, and one Service at a
//! time, as the watch's incremental syncs do; both must print the same.
//!
//! `UPDATE_GOLDEN=1 cargo test -p lb-agent --test golden` rewrites the expected files; review the
//! difference (`git diff lb-agent/tests/golden`) before committing it.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
};

use clap::Parser;
use lb_agent::{
    agent::Programmer,
    apply::{Applier, fake::FakeMaps},
    cli::Cli,
    inspect::{backends_text, services_text},
    node::{LocalNetwork, NodeSettings},
    watch::{ClusterState, ServiceKey, manifests},
};
use lb_common::catalog::Capacities;

/// The flags and addresses of a case that does not say otherwise.
const DEFAULT_FLAGS: &str = "--hostname-override=node-a --cluster-cidr=10.244.0.0/16";
const DEFAULT_ADDRESSES: &str = "192.168.1.10 127.0.0.1";

struct Case {
    dir: PathBuf,
    settings: NodeSettings,
    local: LocalNetwork,
}

fn read_case(dir: &Path) -> Case {
    let text = fs::read_to_string(dir.join("case.txt")).unwrap_or_default();
    let mut flags = DEFAULT_FLAGS.to_owned();
    let mut addresses = DEFAULT_ADDRESSES.to_owned();
    let mut ipv6_disabled = false;
    for line in text.lines().map(str::trim).filter(|l| !l.starts_with('#')) {
        if let Some(v) = line.strip_prefix("flags:") {
            flags = v.trim().to_owned();
        } else if let Some(v) = line.strip_prefix("addresses:") {
            addresses = v.trim().to_owned();
        } else if line == "ipv6: disabled" {
            ipv6_disabled = true;
        } else if !line.is_empty() {
            panic!("{}: unknown line in case.txt: {line:?}", dir.display());
        }
    }
    let cli = Cli::try_parse_from(std::iter::once("lb-agent").chain(flags.split_whitespace()))
        .unwrap_or_else(|e| panic!("{}: flags {flags:?}: {e}", dir.display()));
    let settings = cli
        .run
        .node
        .settings()
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let addresses = addresses
        .split_whitespace()
        .map(|a| {
            a.parse()
                .unwrap_or_else(|e| panic!("{}: address {a:?}: {e}", dir.display()))
        })
        .collect();
    Case {
        dir: dir.to_owned(),
        settings,
        local: LocalNetwork {
            addresses,
            ipv6_disabled,
            links: Vec::new(),
            interface_addresses: Vec::new(),
        },
    }
}

fn programmer(settings: &NodeSettings) -> Programmer<FakeMaps> {
    Programmer::new(
        settings.clone(),
        0,
        false,
        Applier::new(FakeMaps::new(), Capacities::default()),
    )
}

/// What the maps say, as the operator's commands print it.
fn render(p: &Programmer<FakeMaps>) -> String {
    let snap = &p.maps().state;
    let mut out = String::new();
    writeln!(out, "$ lb-agent services").unwrap();
    out.push_str(&services_text(snap, &BTreeMap::new()));
    writeln!(out, "\n$ lb-agent backends").unwrap();
    out.push_str(&backends_text(snap));
    // The IPv6 address only where there is one, so that IPv4-only cases read as before.
    let config = p.maps().config;
    let v4 = config
        .map(|c| IpAddr::V4(Ipv4Addr::from(c.v4.snat_addr)))
        .filter(|a| !a.is_unspecified());
    let v6 = config
        .map(|c| IpAddr::V6(Ipv6Addr::from(c.v6.snat_addr)))
        .filter(|a| !a.is_unspecified());
    writeln!(
        out,
        "\nmasquerade address: {}",
        v4.map_or("-".into(), |a| a.to_string())
    )
    .unwrap();
    if let Some(v6) = v6 {
        writeln!(out, "masquerade address (IPv6): {v6}").unwrap();
    }
    let problems = p.planner().problems();
    writeln!(out, "problems:{}", if problems.is_empty() { " none" } else { "" }).unwrap();
    for problem in problems {
        writeln!(
            out,
            "- {} {}/{}: {}",
            problem.kind, problem.namespace, problem.name, problem.message
        )
        .unwrap();
    }
    out
}

/// Programs the case from scratch, as a full sync does.
fn full(case: &Case, state: &ClusterState) -> String {
    let mut p = programmer(&case.settings);
    let view = p.view(state.node.as_deref(), &case.local);
    p.write_config(&view).unwrap();
    let (_, report) = p.program_all(&ClusterState::default(), &view);
    assert!(report.is_clean(), "{report:?}");
    let (_, report) = p.program_all(state, &view);
    assert!(
        report.errors.is_empty(),
        "{}: {:?}",
        case.dir.display(),
        report.errors
    );
    render(&p)
}

/// Programs the case one Service at a time, as the watch's syncs do, from an empty cluster.
fn incremental(case: &Case, state: &ClusterState) -> String {
    let mut p = programmer(&case.settings);
    let view = p.view(state.node.as_deref(), &case.local);
    p.write_config(&view).unwrap();
    let empty = ClusterState {
        node: state.node.clone(),
        ..ClusterState::default()
    };
    p.program_all(&empty, &view);
    let keys: BTreeSet<ServiceKey> = state
        .services
        .keys()
        .cloned()
        .chain(state.slices_by_service().into_keys())
        .collect();
    for key in &keys {
        let (_, report) = p.program_changed([key], |k| state.service_inputs(k));
        assert!(
            report.errors.is_empty(),
            "{}: {:?}",
            case.dir.display(),
            report.errors
        );
    }
    render(&p)
}

/// The text without the backends table's ID column, its rows sorted: ids depend on the order
/// backends were first written, which differs between a full sync and one Service at a time.
fn without_backend_ids(text: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut rows: Vec<String> = Vec::new();
    let mut in_backends = false;
    for line in text.lines() {
        if line == "$ lb-agent backends" {
            in_backends = true;
        } else if in_backends && line.is_empty() {
            rows.sort();
            out.append(&mut rows);
            in_backends = false;
        } else if in_backends {
            let without_id = line.split_once(' ').map_or(line, |(_, rest)| rest.trim_start());
            rows.push(without_id.to_owned());
            continue;
        }
        out.push(line.to_owned());
    }
    out.append(&mut rows);
    out.join("\n")
}

fn cases() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut dirs: Vec<PathBuf> = fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

#[test]
fn golden_cases() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1");
    let mut failed = Vec::new();
    let dirs = cases();
    assert!(dirs.len() >= 10, "the golden cases are missing");
    for dir in dirs {
        let case = read_case(&dir);
        let loaded = manifests::load_dir(&dir, &case.settings.node_name)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        // Bad files and objects, named relative to the case (the same on every machine).
        let mut manifest_problems = String::new();
        for problem in &loaded.problems {
            let text = problem.to_string().replace(&format!("{}/", dir.display()), "");
            writeln!(manifest_problems, "- manifest: {text}").unwrap();
        }
        let got = full(&case, &loaded.state) + &manifest_problems;
        let stepwise = incremental(&case, &loaded.state) + &manifest_problems;
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(
            without_backend_ids(&got),
            without_backend_ids(&stepwise),
            "{name}: programming one Service at a time differs from a full sync"
        );
        let expected_path = dir.join("expected.txt");
        if update {
            fs::write(&expected_path, &got).unwrap();
            continue;
        }
        let expected = fs::read_to_string(&expected_path).unwrap_or_default();
        if expected != got {
            failed.push(format!(
                "--- {name}: expected\n{expected}\n+++ {name}: got\n{got}"
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "{} golden case(s) differ (UPDATE_GOLDEN=1 rewrites them; review with git diff):\n{}",
        failed.len(),
        failed.join("\n")
    );
}
