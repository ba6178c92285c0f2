//! The test runner behind the README's test command: set-up, the eBPF build, then every test
//! binary of the workspace, ending with one summary line over all of them.

use std::{
    fs,
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::mpsc,
    thread,
    time::Instant,
};

use anyhow::{Context, Result, bail};

use crate::{
    ebpf, k8s, setup,
    util::{cache_dir, clean_cargo, step, workspace_root},
};

/// Totals over every `test result:` line cargo's test harness prints.
#[derive(Default)]
pub(crate) struct Summary {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    pub filtered: u64,
    pub binaries: u64,
    pub failing_binaries: Vec<String>,
    /// Each failing test's name and why it failed (its panic and what follows, cut short): the
    /// harness prints them mid-output, where a long run's tail (all CI shows) no longer reaches.
    pub failure_reasons: Vec<(String, Vec<String>)>,
    /// The failing test whose captured output is being read (`---- NAME stdout ----` onwards).
    reading_failure: Option<(String, Vec<String>)>,
}

/// How many lines of a failing test's panic the summary repeats, and how much of each: CI shows
/// only the last lines of a run, where these go.
const REASON_LINES: usize = 12;
const REASON_LINE_CHARS: usize = 400;

impl Summary {
    pub fn add_line(&mut self, line: &str) {
        self.read_failure(line);
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        self.binaries += 1;
        // "FAILED. 1 passed", " 2 failed", " 4 filtered out", ...: a count, then what it counts.
        for part in rest.split(';') {
            let mut words = part.split_whitespace().skip_while(|w| w.parse::<u64>().is_err());
            let (Some(n), Some(what)) = (words.next(), words.next()) else {
                continue;
            };
            let n: u64 = n.parse().unwrap_or(0);
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                "ignored" => self.ignored += n,
                "filtered" => self.filtered += n,
                _ => {}
            }
        }
    }

    /// Follows the harness's `failures:` section: each `---- NAME stdout ----` block up to the
    /// next one, the list of names, or the result line; keeps its panic onwards.
    fn read_failure(&mut self, line: &str) {
        let ends = line.starts_with("---- ") || line == "failures:" || line.starts_with("test result: ");
        if ends && let Some((name, lines)) = self.reading_failure.take() {
            // A panic, or the `Error: ...` libtest prints for a test that returned one.
            let from = lines
                .iter()
                .position(|l| l.contains("panicked at") || l.starts_with("Error: "))
                .unwrap_or(
                    // Neither (a test harness error, a killed child): the block's last lines.
                    lines.len().saturating_sub(REASON_LINES),
                );
            // The message ends at a blank line or where a fixture starts dumping its logs
            // ("control plane at ... (dropped while panicking):", "--- /tmp/.../0.log:"). Lines
            // of the fixtures' own children (containerd's `time="..."`) land anywhere in the
            // block: not the test's words.
            let reason: Vec<String> = lines[from..]
                .iter()
                .take_while(|l| {
                    !l.is_empty() && !l.contains("(dropped while panicking)") && !l.starts_with("--- /")
                })
                .filter(|l| !l.starts_with("note: run with `RUST_BACKTRACE=1`") && !l.starts_with("time=\""))
                .take(REASON_LINES)
                .map(|l| match l.char_indices().nth(REASON_LINE_CHARS) {
                    Some((cut, _)) => format!("{}…", &l[..cut]),
                    None => l.clone(),
                })
                .collect();
            self.failure_reasons.push((name, reason));
        }
        if let Some(name) = line
            .strip_prefix("---- ")
            .and_then(|r| r.strip_suffix(" stdout ----"))
        {
            self.reading_failure = Some((name.to_string(), Vec::new()));
        } else if let Some((_, lines)) = &mut self.reading_failure {
            lines.push(line.to_string());
        }
    }
}

/// Privileged and end-to-end test targets of the `tests/` package (one per file in tests/tests).
fn lb_tests_targets(with_e2e: bool) -> Result<Vec<String>> {
    let dir = workspace_root().join("tests/tests");
    let mut targets = Vec::new();
    for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rs") {
            let name = path.file_stem().unwrap_or_default().to_string_lossy().to_string();
            if with_e2e || !name.starts_with("e2e") {
                targets.push(name);
            }
        }
    }
    targets.sort();
    Ok(targets)
}

pub(crate) fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the privileged tests need root (network namespaces, cgroups, BPF); run `sudo -E ./x test`");
    }
    Ok(())
}

/// Runs one cargo test invocation, streaming its output and adding its result lines to `summary`.
fn cargo_test(
    args: &[String],
    filter: Option<&str>,
    envs: &[(&str, String)],
    summary: &mut Summary,
) -> Result<bool> {
    cargo_test_with(args, filter.as_slice(), envs, summary)
}

/// `cargo test ARGS --no-fail-fast -- HARNESS_ARGS`, its output passed through and summed.
fn cargo_test_with(
    args: &[String],
    harness_args: &[&str],
    envs: &[(&str, String)],
    summary: &mut Summary,
) -> Result<bool> {
    let mut cmd = clean_cargo(None);
    cmd.arg("test")
        .args(args)
        .arg("--no-fail-fast")
        .arg("--")
        .args(harness_args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("cannot start {cmd:?}"))?;
    let (tx, rx) = mpsc::channel::<(bool, String)>();
    let out = child.stdout.take().expect("piped");
    let err = child.stderr.take().expect("piped");
    let tx2 = tx.clone();
    let readers = [
        thread::spawn(move || {
            BufReader::new(out)
                .lines()
                .map_while(Result::ok)
                .for_each(|l| drop(tx.send((true, l))))
        }),
        thread::spawn(move || {
            BufReader::new(err)
                .lines()
                .map_while(Result::ok)
                .for_each(|l| drop(tx2.send((false, l))))
        }),
    ];
    let mut current_binary = String::new();
    for (is_stdout, line) in rx {
        if is_stdout {
            println!("{line}");
        } else {
            eprintln!("{line}");
        }
        if let Some(b) = line.trim().strip_prefix("Running ") {
            current_binary = b.to_string();
        }
        if line.starts_with("test result: FAILED") {
            summary.failing_binaries.push(current_binary.clone());
        }
        summary.add_line(&line);
    }
    for r in readers {
        let _ = r.join();
    }
    Ok(child.wait()?.success())
}

pub(crate) fn print_summary(summary: &Summary, started: Instant, ok: bool) {
    if !summary.failing_binaries.is_empty() {
        eprintln!("failing test binaries:");
        for b in &summary.failing_binaries {
            eprintln!("    {b}");
        }
    }
    println!(
        "test result: {}. {} passed; {} failed; {} ignored; {} filtered out; {} test binaries; finished in {:.1}s",
        if ok { "ok" } else { "FAILED" },
        summary.passed,
        summary.failed,
        summary.ignored,
        summary.filtered,
        summary.binaries,
        started.elapsed().as_secs_f64()
    );
    // Last, so that the tail of the output (all CI shows) says why.
    print_failure_reasons(&summary.failure_reasons);
}

/// Each failing test's name and its reason ([`Summary::failure_reasons`]), if any failed.
pub(crate) fn print_failure_reasons(reasons: &[(String, Vec<String>)]) {
    if reasons.is_empty() {
        return;
    }
    eprintln!("why the failing tests failed (in full above, with their output):");
    for (name, reason) in reasons {
        eprintln!("---- {name}");
        for l in reason {
            eprintln!("    {l}");
        }
    }
}

/// Environment for the test binaries: where the control-plane binaries are, and no backtraces
/// (a failing scenario's message, with its timeline, is what explains it; a backtrace after it
/// pushes it out of the tail of the output that CI shows). `LB_TEST_BACKTRACE=1` keeps them.
pub(crate) fn test_env(with_e2e: bool) -> Result<Vec<(&'static str, String)>> {
    let mut envs = vec![];
    if std::env::var_os("LB_TEST_BACKTRACE").is_none_or(|v| v == "0") {
        envs.push(("RUST_BACKTRACE", "0".to_string()));
        envs.push(("RUST_LIB_BACKTRACE", "0".to_string()));
    }
    if with_e2e {
        let bins = k8s::ensure(&cache_dir())?;
        envs.push(("LB_K8S_BIN_DIR", bins.dir.display().to_string()));
        let parts = crate::node::ensure(&cache_dir())?;
        envs.push(("LB_NODE_PARTS_DIR", parts.display().to_string()));
        // The images the real node runs (lb-agent from its release build, lb-probe, pause).
        let images = crate::image::default_dir();
        crate::image::ensure(&images)?;
        envs.push(("LB_IMAGE_DIR", images.display().to_string()));
    }
    Ok(envs)
}

/// What a fresh clone's `./x test` writes into target/ (measured: 3.2 GB), and on a machine
/// whose caches are still empty also the toolchains, the Go build of the control plane, the guest
/// kernels and the node's parts (about 10 GB more); the README says so.
fn fresh_test_gib() -> u64 {
    if crate::util::cache_dir().is_dir() { 4 } else { 14 }
}

pub fn run_all(filter: Option<&str>, with_e2e: bool, with_guest: bool) -> Result<()> {
    let started = Instant::now();
    require_root()?;
    crate::util::warn_if_disk_low("a fresh ./x test", fresh_test_gib());
    setup::all()?;
    ebpf::build()?;
    let envs = test_env(with_e2e)?;

    let mut summary = Summary::default();
    step("unit tests (lb-common, lb-agent, xtask)");
    let mut ok = cargo_test(
        &["--workspace", "--exclude", "lb-ebpf", "--exclude", "lb-tests"].map(String::from),
        filter,
        &envs,
        &mut summary,
    )?;
    build_agent()?;
    ebpf::build_variant()?;
    step("privileged and end-to-end tests (tests/)");
    // The benchmark's own unit tests (its rule generator, its report's arithmetic) run with
    // the library's: lb-bench is built for the suite anyway.
    let mut args = vec![
        "--package".to_string(),
        "lb-tests".into(),
        "--lib".into(),
        "--bin".into(),
        "lb-bench".into(),
    ];
    for t in lb_tests_targets(with_e2e)? {
        args.push("--test".into());
        args.push(t);
    }
    ok &= cargo_test(&args, filter, &envs, &mut summary)?;
    if with_guest && filter.is_none() {
        let guests: Vec<String> = crate::kernel::CI_GUESTS
            .iter()
            .map(|(kernel, tests)| {
                let tests: Vec<String> = tests
                    .iter()
                    .map(|(b, tests)| match tests.len() {
                        0 => b.to_string(),
                        n => format!("{n} of {b}"),
                    })
                    .collect();
                format!("Linux {kernel}: {}", tests.join(", "))
            })
            .collect();
        step(&format!(
            "the verifier, fixtures and netns tests in guests ({})",
            guests.join("; ")
        ));
        ok &= crate::kernel::run_ci_subset(&mut summary)?;
    }
    ok &= summary.failed == 0;
    // A filtered run has some scenarios' figures only: the doc stays as the last whole run wrote it.
    if filter.is_none()
        && let Err(e) = crate::report::write_reliability()
    {
        eprintln!("docs/reliability.md not regenerated: {e:#}");
    }
    print_summary(&summary, started, ok);
    if !ok {
        bail!("tests failed");
    }
    Ok(())
}

/// `cargo xtask soak`: the soak scenario (`reliability.rs`'s ignored `soak` test) for `duration`,
/// under the suite's set-up (the test variant of the object for its upgrades), then docs/soak.md
/// from its figures.
pub fn run_soak(duration: std::time::Duration, step_secs: u64) -> Result<()> {
    let started = Instant::now();
    // The commit the soak runs, taken now: the tree may change during an hour's run.
    let (sha, _) = crate::util::provenance();
    require_root()?;
    setup::all()?;
    ebpf::build()?;
    ebpf::build_variant()?;
    // A control plane, no kubelet node: the binaries, not the images.
    let mut envs = test_env(false)?;
    envs.push((
        "LB_K8S_BIN_DIR",
        k8s::ensure(&cache_dir())?.dir.display().to_string(),
    ));
    envs.push(("LB_SOAK_SECS", duration.as_secs().to_string()));
    envs.push(("LB_SOAK_STEP_SECS", step_secs.to_string()));
    build_agent()?;
    let figures = workspace_root().join("target/soak/soak.json");
    let _ = fs::remove_file(&figures);
    step(&format!(
        "the soak: {}s, an action every {step_secs}s (progress on stderr; figures to {})",
        duration.as_secs(),
        figures.display()
    ));
    let mut summary = Summary::default();
    let args = ["--package", "lb-tests", "--test", "reliability"].map(String::from);
    let ok = cargo_test_with(
        &args,
        &["soak", "--exact", "--ignored", "--nocapture"],
        &envs,
        &mut summary,
    )? && summary.failed == 0
        && summary.passed == 1;
    if figures.exists() {
        crate::report::write_soak(&figures, &sha)?;
    }
    print_summary(&summary, started, ok);
    if !ok {
        bail!("the soak failed (docs/soak.md has its figures, if it got as far as recording them)");
    }
    Ok(())
}

pub fn run_e2e(filter: Option<&str>) -> Result<()> {
    let started = Instant::now();
    require_root()?;
    setup::all()?;
    ebpf::build()?;
    let envs = test_env(true)?;
    build_agent()?;
    let mut summary = Summary::default();
    let mut args = vec!["--package".to_string(), "lb-tests".into()];
    for t in lb_tests_targets(true)?
        .into_iter()
        .filter(|t| t.starts_with("e2e"))
    {
        args.push("--test".into());
        args.push(t);
    }
    let ok = cargo_test(&args, filter, &envs, &mut summary)? && summary.failed == 0;
    print_summary(&summary, started, ok);
    if !ok {
        bail!("end-to-end tests failed");
    }
    Ok(())
}

/// The privileged tests run the real `lb-agent` binary (target/debug/lb-agent), which `cargo test`
/// of another package does not build.
pub(crate) fn build_agent() -> Result<()> {
    step("building lb-agent");
    crate::util::run(clean_cargo(None).args(["build", "--package", "lb-agent", "--bin", "lb-agent"]))
}

/// Builds and runs one of the harness programs of `tests/` (the sandbox, the benchmarks).
/// `cilium`: also build the Cilium bundle and name it to the tool (`LB_CILIUM_DIR`).
pub fn run_tool(bin: &str, args: &[String], cilium: bool) -> Result<()> {
    let (tool, mut envs) = build_tool(bin)?;
    if cilium {
        let dir = crate::cilium::ensure(&crate::util::cache_dir())?;
        envs.push(("LB_CILIUM_DIR", dir.display().to_string()));
    }
    let mut cmd = Command::new(tool);
    cmd.args(args).envs(envs);
    let status = cmd.status()?;
    if !status.success() {
        // The tool has said what went wrong (a usage error, a failed step): pass its status on
        // rather than adding an error of our own on top.
        use std::os::unix::process::ExitStatusExt;
        std::process::exit(
            status
                .code()
                .unwrap_or_else(|| 128 + status.signal().unwrap_or(1)),
        );
    }
    Ok(())
}

/// Sets up what a tool of `tests/src/bin` runs (toolchains, eBPF object, control-plane binaries,
/// node parts, images), builds it with lb-agent and lb-probe (release), and returns its path and
/// environment.
pub fn build_tool(bin: &str) -> Result<(std::path::PathBuf, Vec<(&'static str, String)>)> {
    require_root()?;
    setup::all()?;
    ebpf::build()?;
    let envs = test_env(true)?;
    // The tools start the agent and the probe from next to themselves (`workspace_bin`): build
    // them too, so that the first command on a fresh clone finds everything it runs.
    step(&format!("building {bin}, lb-agent and lb-probe (release)"));
    let mut build: Command = clean_cargo(None);
    build.args([
        "build",
        "--release",
        "--quiet",
        "--package",
        "lb-tests",
        "--bin",
        bin,
        "--bin",
        "lb-probe",
        "--package",
        "lb-agent",
        "--bin",
        "lb-agent",
    ]);
    for (k, v) in &envs {
        build.env(k, v);
    }
    crate::util::run(&mut build)?;
    Ok((
        crate::util::workspace_root().join("target/release").join(bin),
        envs,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_keeps_each_failing_tests_panic_or_error_and_the_totals() {
        let output = "\
running 4 tests
test a ... FAILED
test b ... FAILED
test c ... FAILED
test d ... ok

failures:

---- a stdout ----
created 200000 endpoints in 200 slices in 6.6s
thread 'a' panicked at tests/tests/x.rs:10:5:
2 problem(s):
the first
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace

---- b stdout ----
thread 'b' panicked at tests/tests/x.rs:20:5:
assertion failed
control plane at /tmp/x (dropped while panicking):
    I1127 06:16:26.590681   31007 controller.go:667] quota admission added evaluator

---- c stdout ----
==> 1. a step
time=\"2026-12-02T13:20:15Z\" level=info msg=\"a child's log line\"
Error: requests failed: [
time=\"2026-12-02T13:20:16Z\" level=info msg=\"another\"
    \"at 17 µs: reset\",
]
--- /tmp/node/var-log/pods/kube-proxy/0.log:
2026-12-02T13:20:07Z stderr F I1202 a kube-proxy log line

failures:
    a
    b
    c

test result: FAILED. 1 passed; 3 failed; 0 ignored; 0 measured; 4 filtered out; finished in 1.00s
";
        let mut summary = Summary::default();
        output.lines().for_each(|l| summary.add_line(l));
        assert_eq!((summary.passed, summary.failed, summary.filtered), (1, 3, 4));
        let reasons: Vec<(&str, Vec<&str>)> = summary
            .failure_reasons
            .iter()
            .map(|(n, r)| (n.as_str(), r.iter().map(String::as_str).collect()))
            .collect();
        assert_eq!(
            reasons,
            [
                (
                    "a",
                    vec![
                        "thread 'a' panicked at tests/tests/x.rs:10:5:",
                        "2 problem(s):",
                        "the first",
                    ]
                ),
                (
                    "b",
                    vec![
                        "thread 'b' panicked at tests/tests/x.rs:20:5:",
                        "assertion failed",
                    ]
                ),
                (
                    "c",
                    vec!["Error: requests failed: [", "    \"at 17 µs: reset\",", "]"]
                ),
            ]
        );
    }
}
