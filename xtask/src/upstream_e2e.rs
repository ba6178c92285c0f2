//! `cargo xtask e2e-upstream`: the upstream Kubernetes e2e suite against lb-agent, and
//! docs/conformance.md from its report.
//!
//! Builds (once, cached) e2e.test and the test images' programs from k8s.io/kubernetes at the
//! pinned release and CoreDNS (`k8s.rs`), the images under their upstream names
//! (`upstream_images/`), our own images (`image/`); then runs `lb-upstream-e2e`
//! (tests/src/bin), which makes the two-node cluster with lb-agent as its only Service proxy, runs
//! the suite and leaves the report in `target/conformance/<time>/`; then writes the document.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{
    k8s::{self, KUBERNETES_VERSION},
    test, upstream_images,
    util::{self, step},
};

/// The specs a Service proxy is judged by (what kube-proxy's, Cilium's and Calico's CI run).
pub const FOCUS: &str = r"\[sig-network\] (Services|Conntrack|Networking Granular Checks: Services) ";
/// What needs more than this cluster or this agent has: disrupting nodes, a cloud's load
/// balancers, features behind gates, a second family (issue 12), SCTP (issue 17). The `[Serial]`
/// and `[Slow]` specs of the focused groups run too (ginkgo runs the `[Serial]` ones alone, after
/// the others): the upstream selection of 70 specs plus the two `[Slow]` NodePort updates.
pub const SKIP: &str = r"\[Disruptive\]|\[Feature:|LoadBalancers|SCTP|IPv6|DualStack";

#[derive(clap::Args, Debug)]
pub struct Options {
    /// The specs to run (a ginkgo focus regular expression).
    #[arg(long, default_value = FOCUS)]
    focus: String,
    /// The specs to leave out (a ginkgo skip regular expression).
    #[arg(long, default_value = SKIP)]
    skip: String,
    /// How many specs run at once.
    #[arg(long, default_value_t = 4)]
    procs: u32,
    /// Only write docs/conformance.md from the report of an earlier run (its directory).
    #[arg(long)]
    report_from: Option<PathBuf>,
    /// Do not write docs/conformance.md (a run with a narrower focus, while working on one spec).
    #[arg(long)]
    no_doc: bool,
    /// Extra arguments for e2e.test (after `--`).
    #[arg(last = true)]
    extra: Vec<String>,
}

pub fn run(opts: &Options) -> Result<()> {
    let report_dir = match &opts.report_from {
        Some(dir) => dir.clone(),
        None => run_suite(opts)?,
    };
    let mut specs = load_specs(&report_dir)?;
    // By name, so that two runs' documents differ only where results do.
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    if !opts.no_doc {
        let doc = util::workspace_root().join("docs/conformance.md");
        fs::write(&doc, render(&report_dir, &specs)?)?;
        step(&format!("wrote {}", doc.display()));
    }
    let summary = summarize(&specs);
    step(&format!(
        "{} selected: {} passed, {} failed, {} skipped (report: {})",
        summary.selected,
        summary.passed,
        summary.failed,
        summary.skipped,
        report_dir.display()
    ));
    if summary.failed > 0 {
        bail!("{} of the selected specs failed", summary.failed);
    }
    Ok(())
}

/// Builds what is missing, runs the cluster and the suite; returns the report's directory.
fn run_suite(opts: &Options) -> Result<PathBuf> {
    let cache = util::cache_dir();
    let bins = k8s::ensure_upstream_e2e(&cache)?;
    let upstream = upstream_images::ensure(&upstream_images::default_dir())?;
    step(&format!(
        "upstream images ready: {}",
        upstream
            .iter()
            .map(|b| b.reference)
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let (tool, envs) = test::build_tool("lb-upstream-e2e")?;
    let stamp = util::output(Command::new("date").args(["-u", "+%Y%m%d-%H%M%S"]))?;
    let report_dir = util::workspace_root()
        .join("target/conformance")
        .join(stamp.trim());
    fs::create_dir_all(&report_dir)?;
    let mut cmd = Command::new(tool);
    cmd.arg(format!("--e2e-test={}", bins.e2e_test.display()))
        .arg(format!("--ginkgo={}", bins.ginkgo.display()))
        .arg(format!("--procs={}", opts.procs))
        .arg(format!("--images={}", crate::image::default_dir().display()))
        .arg(format!("--images={}", upstream_images::default_dir().display()))
        .arg(format!("--report-dir={}", report_dir.display()))
        .arg(format!("--focus={}", opts.focus))
        .arg(format!("--skip={}", opts.skip))
        .arg("--")
        .args(&opts.extra)
        .envs(envs);
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !report_dir.join("report.json").is_file() {
        bail!(
            "the suite left no report ({status}); see the output above and {}",
            report_dir.display()
        );
    }
    Ok(report_dir)
}

/// One spec of the report that the focus and skip selected.
#[derive(Debug, Clone)]
struct Spec {
    name: String,
    /// passed, failed, skipped, panicked, interrupted, timedout, aborted.
    state: String,
    seconds: f64,
    /// For anything not passed: why, from the run's own report.
    reason: String,
    location: String,
}

/// The selected specs of `dir/report.json` (a ginkgo JSON report), in the suite's order. Specs
/// the filters left out are reported by ginkgo as skipped without an attempt; they are dropped.
fn load_specs(dir: &Path) -> Result<Vec<Spec>> {
    let path = dir.join("report.json");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let reports: Vec<Value> =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut specs = Vec::new();
    for report in &reports {
        for spec in report["SpecReports"].as_array().into_iter().flatten() {
            let state = spec["State"].as_str().unwrap_or_default().to_string();
            let attempted = spec["NumAttempts"].as_u64().unwrap_or(0) > 0;
            let leaf = spec["LeafNodeType"].as_str().unwrap_or_default();
            // The suite's setup and teardown only matter when they fail (then nothing ran).
            if leaf != "It" && state == "passed" {
                continue;
            }
            if leaf == "It" && !attempted && state == "skipped" {
                continue;
            }
            let mut name: Vec<&str> = spec["ContainerHierarchyTexts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let leaf_text = spec["LeafNodeText"].as_str().unwrap_or_default();
            if leaf == "It" {
                name.push(leaf_text);
            } else {
                name.push(leaf);
            }
            let failure = &spec["Failure"];
            let location = failure["Location"]["FileName"]
                .as_str()
                .map(|f| {
                    format!(
                        "{}:{}",
                        f.rsplit_once("test/e2e/").map_or(f, |(_, rest)| rest),
                        failure["Location"]["LineNumber"]
                    )
                })
                .unwrap_or_default();
            specs.push(Spec {
                name: name.join(" "),
                seconds: spec["RunTime"].as_f64().unwrap_or(0.0) / 1e9,
                reason: reason_of(failure["Message"].as_str().unwrap_or_default()),
                state,
                location,
            });
        }
    }
    Ok(specs)
}

/// A failure or skip message on one line, cut to what a table cell can hold.
fn reason_of(message: &str) -> String {
    let one_line: String = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let cut: String = one_line.chars().take(400).collect();
    let cut = if cut.len() < one_line.len() {
        format!("{cut}…")
    } else {
        cut
    };
    cut.replace('|', "\\|")
}

/// Specs other kube-proxy replacements skip in their CI (issue 23), by a part of their name, with
/// the reason they give.
const PEERS_SKIP: &[(&str, &str)] = &[
    (
        "should be rejected when no endpoints exist",
        "Cilium drops where kube-proxy rejects",
    ),
    (
        "should fallback to local terminating endpoints when there are no ready endpoints with externalTrafficPolicy=Local",
        "Cilium: cilium#37613",
    ),
    (
        "should fallback to local terminating endpoints when there are no ready endpoints with internalTrafficPolicy=Local",
        "Cilium's CI skips it",
    ),
    ("invalid conntrack state bug", "Cilium's CI skips it"),
    (
        "Networking Granular Checks: Services should update endpoints",
        "Cilium's CI skips it",
    ),
];

struct Summary {
    selected: usize,
    passed: usize,
    failed: usize,
    skipped: usize,
}

fn summarize(specs: &[Spec]) -> Summary {
    let count = |f: &dyn Fn(&str) -> bool| specs.iter().filter(|s| f(&s.state)).count();
    Summary {
        selected: specs.len(),
        passed: count(&|s| s == "passed"),
        skipped: count(&|s| s == "skipped"),
        failed: count(&|s| s != "passed" && s != "skipped"),
    }
}

/// docs/conformance.md from a report directory and its specs (in the document's order).
fn render(dir: &Path, specs: &[Spec]) -> Result<String> {
    let summary = summarize(specs);
    let cluster: Value = fs::read_to_string(dir.join("cluster.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let (commit, when) = util::provenance();
    let mut out = String::new();
    let _ = writeln!(out, "# Upstream Kubernetes e2e: Services\n");
    let _ = writeln!(
        out,
        "Generated by `cargo xtask e2e-upstream` from its run's report (`{}`), at {when}, commit \
         {commit}, kernel {}.\n",
        dir.strip_prefix(util::workspace_root()).unwrap_or(dir).display(),
        cluster["kernel"].as_str().unwrap_or("?")
    );
    let _ = writeln!(
        out,
        "The specs are the upstream ones, unchanged: `e2e.test` built from k8s.io/kubernetes \
         {KUBERNETES_VERSION} (`test/e2e/network`), run against a cluster made of the real \
         control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) and {} \
         real nodes (kubelet, containerd, runc, the CNI bridge; each in its own network namespace \
         and cgroup; the specs need two, and one of them, the ExternalTrafficPolicy change with \
         its HealthCheckNodePort, skips itself below three), with lb-agent deployed from \
         `manifests/` as a DaemonSet and **no kube-proxy**: lb-agent is the only Service proxy. \
         CoreDNS {} is the cluster DNS. The images are built here under their upstream names.\n",
        cluster["nodes"].as_array().map_or(0, Vec::len),
        k8s::COREDNS_VERSION
    );
    let _ = writeln!(
        out,
        "- Focus: `{}`\n- Skip: `{}`\n- Flags: `{}`\n",
        cluster["focus"].as_str().unwrap_or(FOCUS),
        cluster["skip"].as_str().unwrap_or(SKIP),
        cluster["flags"].as_str().unwrap_or("?")
    );
    let _ = writeln!(
        out,
        "**{} selected: {} passed, {} failed, {} skipped.**\n",
        summary.selected, summary.passed, summary.failed, summary.skipped
    );
    let _ = writeln!(
        out,
        "The specs other kube-proxy replacements leave out of their CI, here with the others:\n"
    );
    let _ = writeln!(out, "| Spec | Result | Left out by |");
    let _ = writeln!(out, "|---|---|---|");
    for (part, who) in PEERS_SKIP {
        for spec in specs.iter().filter(|s| s.name.contains(part)) {
            let _ = writeln!(
                out,
                "| {} | {} | {who} |",
                spec.name.replace('|', "\\|"),
                spec.state
            );
        }
    }
    let _ = writeln!(out, "\n## Every spec\n");
    let _ = writeln!(out, "| Spec | Result | Time | Why, when not passed |");
    let _ = writeln!(out, "|---|---|---:|---|");
    for spec in specs {
        let why = if spec.state == "passed" {
            String::new()
        } else if spec.location.is_empty() {
            spec.reason.clone()
        } else {
            format!("{} (`{}`)", spec.reason, spec.location)
        };
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} s | {} |",
            spec.name.replace('|', "\\|"),
            spec.state,
            spec.seconds,
            why
        );
    }
    if let Some(images) = cluster["images"].as_array() {
        let _ = writeln!(out, "\n## Images\n");
        let _ = writeln!(out, "| Image | Manifest digest |");
        let _ = writeln!(out, "|---|---|");
        let mut sorted: BTreeMap<&str, &str> = BTreeMap::new();
        for image in images {
            sorted.insert(
                image["ref"].as_str().unwrap_or_default(),
                image["digest"].as_str().unwrap_or_default(),
            );
        }
        for (reference, digest) in sorted {
            let _ = writeln!(out, "| `{reference}` | `{digest}` |");
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(specs: Value) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join("report.json"),
            serde_json::to_string(&serde_json::json!([{"SpecReports": specs}])).unwrap(),
        )
        .unwrap();
        dir
    }

    #[test]
    fn filtered_out_specs_and_passed_setup_are_left_out() {
        let dir = report(serde_json::json!([
            {"LeafNodeType": "SynchronizedBeforeSuite", "State": "passed", "NumAttempts": 1},
            {"ContainerHierarchyTexts": ["[sig-network] Services"], "LeafNodeText": "should a", "LeafNodeType": "It", "State": "passed", "NumAttempts": 1, "RunTime": 2_500_000_000u64},
            {"ContainerHierarchyTexts": ["[sig-apps] X"], "LeafNodeText": "filtered", "LeafNodeType": "It", "State": "skipped", "NumAttempts": 0},
            {"ContainerHierarchyTexts": ["[sig-network] Services"], "LeafNodeText": "should b", "LeafNodeType": "It", "State": "skipped", "NumAttempts": 1,
             "Failure": {"Message": "Requires at least 2 nodes\n(not 1)", "Location": {"FileName": "k8s.io/kubernetes@v1.37.1/test/e2e/network/service.go", "LineNumber": 12}}},
            {"ContainerHierarchyTexts": ["[sig-network] Conntrack"], "LeafNodeText": "should c | d", "LeafNodeType": "It", "State": "failed", "NumAttempts": 1,
             "Failure": {"Message": "timed out", "Location": {"FileName": "k8s.io/kubernetes@v1.37.1/test/e2e/network/conntrack.go", "LineNumber": 99}}},
        ]));
        let specs = load_specs(dir.path()).unwrap();
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "[sig-network] Services should a",
                "[sig-network] Services should b",
                "[sig-network] Conntrack should c | d"
            ]
        );
        assert_eq!(specs[0].seconds, 2.5);
        assert_eq!(specs[1].reason, "Requires at least 2 nodes (not 1)");
        assert_eq!(specs[2].location, "network/conntrack.go:99");
        let s = summarize(&specs);
        assert_eq!((s.selected, s.passed, s.failed, s.skipped), (3, 1, 1, 1));
        let doc = render(dir.path(), &specs).unwrap();
        assert!(
            doc.contains("**3 selected: 1 passed, 1 failed, 1 skipped.**"),
            "{doc}"
        );
        assert!(doc.contains("| [sig-network] Conntrack should c \\| d | failed | 0.0 s | timed out (`network/conntrack.go:99`) |"), "{doc}");
    }

    #[test]
    fn a_failed_suite_setup_is_reported() {
        let dir = report(serde_json::json!([
            {"LeafNodeType": "SynchronizedBeforeSuite", "State": "failed", "NumAttempts": 1, "Failure": {"Message": "nodes not ready"}},
        ]));
        let specs = load_specs(dir.path()).unwrap();
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].name, "SynchronizedBeforeSuite");
        assert_eq!(summarize(&specs).failed, 1);
    }
}
