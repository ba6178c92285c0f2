//! The test binaries on one kernel: built once (`cargo test --no-run`), run natively for the
//! host's kernel or in a guest through a script in a shared directory; a line per binary as its
//! result appears, NOT RUN for those that never reported, and `summary.json` with the kernel's
//! features in `target/kernel-test/<release>/`.

use std::{
    fmt::Write as _,
    fs,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::Ordering,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::{
    Options,
    kernels::Kernel,
    vm::{GuestProcess, INTERRUPTED, shell_quote},
};
use crate::{
    test::Summary,
    util::{clean_cargo, provenance, step, workspace_root},
};

/// A test binary of tests/ as cargo built it.
#[derive(Clone, Debug)]
pub(super) struct TestBinary {
    name: String,
    path: PathBuf,
}

/// Builds the test binaries (without running them) and returns those selected.
pub(super) fn build_test_binaries(selected: &[String]) -> Result<Vec<TestBinary>> {
    step("building the test binaries of tests/");
    let mut cmd = clean_cargo(None);
    cmd.args([
        "test",
        "--package",
        "lb-tests",
        "--lib",
        "--tests",
        "--no-run",
        "--message-format=json",
    ]);
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the test binaries failed");
    }
    let mut all = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let (Some(path), Some(name)) = (msg["executable"].as_str(), msg["target"]["name"].as_str()) else {
            continue;
        };
        // `--tests` also builds the tools' (bin targets') unit tests: only the library's and
        // the integration tests' binaries are the suite.
        let name = match msg["target"]["kind"][0].as_str().unwrap_or_default() {
            "lib" => "lib".to_string(),
            "test" => name.to_string(),
            _ => continue,
        };
        all.push(TestBinary {
            name,
            path: PathBuf::from(path),
        });
    }
    all.sort_by(|a, b| a.name.cmp(&b.name));
    let chosen: Vec<TestBinary> = if selected.is_empty() {
        all.into_iter().filter(|b| !b.name.starts_with("e2e")).collect()
    } else {
        for wanted in selected {
            if !all.iter().any(|b| &b.name == wanted) {
                let names: Vec<&str> = all.iter().map(|b| b.name.as_str()).collect();
                bail!("no test binary {wanted:?}; there are {}", names.join(", "));
            }
        }
        all.into_iter().filter(|b| selected.contains(&b.name)).collect()
    };
    Ok(chosen)
}

/// What one kernel gave.
pub(super) struct KernelOutcome {
    pub(super) kernel: Kernel,
    guest: String,
    pub(super) results: Vec<Value>,
    /// Why the run stopped early, if it did.
    pub(super) aborted: Option<String>,
    pub(super) seconds: f64,
    /// Where its summary and the guest's console are kept.
    results_dir: PathBuf,
}

impl KernelOutcome {
    pub(super) fn ok(&self) -> bool {
        self.aborted.is_none() && !self.results.is_empty() && self.results.iter().all(|r| r["ok"] == true)
    }

    /// The guest's kernel panicked before any test binary started (its console says so): the
    /// run says nothing about the code under test.
    pub(super) fn panicked_while_booting(&self) -> bool {
        self.aborted.is_some()
            && self.results.iter().all(|r| r["not_run"] == true)
            && self.kernel.vmlinuz.is_some()
            && self.console_log().is_some_and(|c| c.contains("Kernel panic"))
    }

    /// Why each failed test of the failed binaries failed, read from their logs as the host's
    /// test summary reads a binary's output (`Summary::add_line`): `(binary::test on Linux
    /// release, its panic)`, for the closing section of `./x test`'s output, which is often all
    /// there is to read of a CI run.
    pub(super) fn failure_reasons(&self) -> Vec<(String, Vec<String>)> {
        let mut reasons = Vec::new();
        for r in self.results.iter().filter(|r| r["ok"] != true) {
            let binary = r["binary"].as_str().unwrap_or("?");
            let Ok(log) = fs::read_to_string(self.results_dir.join(format!("{binary}.log"))) else {
                continue;
            };
            let mut summary = Summary::default();
            log.lines().for_each(|l| summary.add_line(l));
            reasons.extend(
                summary
                    .failure_reasons
                    .into_iter()
                    .map(|(test, why)| (format!("{binary}::{test} on Linux {}", self.kernel.release), why)),
            );
        }
        reasons
    }

    fn console_log(&self) -> Option<String> {
        fs::read_to_string(self.results_dir.join("console.log")).ok()
    }
}

/// Prints a line for each result file that appeared since the last call.
fn report_new_results(kernel: &Kernel, dir: &Path, seen: &mut Vec<String>) -> Vec<Value> {
    let mut new = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return new;
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json") && !p.ends_with("features.json"))
        .collect();
    files.sort();
    for file in files {
        let name = file.file_stem().unwrap_or_default().to_string_lossy().to_string();
        if seen.contains(&name) {
            continue;
        }
        let Ok(value) = fs::read_to_string(&file).map(|t| serde_json::from_str::<Value>(&t)) else {
            continue;
        };
        let Ok(value) = value else { continue };
        seen.push(name);
        println!("{}", result_line(&kernel.release, &value));
        new.push(value);
    }
    new
}

pub(super) fn result_line(release: &str, r: &Value) -> String {
    let verdict = if r["ok"] == true { "ok" } else { "FAILED" };
    let mut counts = format!("{} passed", r["passed"]);
    if r["failed"].as_u64().unwrap_or(0) > 0 {
        let _ = write!(counts, ", {} failed", r["failed"]);
    }
    if r["ignored"].as_u64().unwrap_or(0) > 0 {
        let _ = write!(counts, ", {} ignored", r["ignored"]);
    }
    if let Some(missing) = r["missing"].as_str() {
        let _ = write!(counts, " ({missing})");
    } else if r["ok"] != true && r["failed"].as_u64().unwrap_or(0) == 0 {
        let _ = write!(counts, " (exit {})", r["exit"]);
    }
    let mut line = format!(
        "    {release:<28} {:<16} {verdict:<7} {counts:<34} {:>7.1} s",
        r["binary"].as_str().unwrap_or("?"),
        r["seconds"].as_f64().unwrap_or(0.0)
    );
    if let Some(failures) = r["failures"].as_array().filter(|f| !f.is_empty()) {
        let names: Vec<&str> = failures.iter().filter_map(Value::as_str).collect();
        let _ = write!(line, "\n        failed: {}", names.join(", "));
    }
    line
}

/// Runs the binaries on `kernel`: natively for the host's kernel, else in a guest.
pub(super) fn run_kernel(
    kernel: &Kernel,
    binaries: &[TestBinary],
    opts: &Options,
    env: &[(&str, String)],
    vng: Option<&Path>,
    kvm: bool,
) -> Result<KernelOutcome> {
    let root = workspace_root();
    let results_dir = root
        .join(if opts.ci {
            "target/kernel-test-ci"
        } else {
            "target/kernel-test"
        })
        .join(&kernel.release);
    let _ = fs::remove_dir_all(&results_dir);
    fs::create_dir_all(&results_dir)?;
    let started = Instant::now();
    let xtask = root.join("target/debug/xtask");
    let specs: Vec<String> = binaries
        .iter()
        .map(|b| format!("{}={}", b.name, b.path.display()))
        .collect();
    let mut guest_args: Vec<String> = vec!["kernel-guest".into(), "--results".into()];
    let (guest, share) = match (&kernel.vmlinuz, vng) {
        (None, _) => ("none (natively on this machine)".to_string(), results_dir.clone()),
        (Some(_), None) => bail!("no virtme-ng for a guest"),
        (Some(_), Some(_)) => (
            format!(
                "{}, {} CPUs, {} memory",
                if kvm { "KVM" } else { "TCG (emulated)" },
                opts.cpus,
                opts.memory
            ),
            // Outside target/, which the guest sees through an overlay.
            std::env::temp_dir().join(format!(
                "lb-kernel-test-{}-{}",
                std::process::id(),
                kernel.release
            )),
        ),
    };
    let _ = fs::remove_dir_all(&share);
    fs::create_dir_all(&share)?;
    guest_args.push(share.display().to_string());
    if let Some(f) = &opts.filter {
        guest_args.push("--filter".into());
        guest_args.push(f.clone());
    }
    for (binary, tests) in &opts.only {
        guest_args.push("--only".into());
        guest_args.push(format!("{binary}={}", tests.join(",")));
    }
    guest_args.extend(specs);
    println!("==> Linux {}: guest {guest}", kernel.label());

    // A guest's modules are its package's, outside the filesystem it shares with this machine
    // (virtme-ng links them into /lib/modules; should it not, the harness loads sctp.ko from here
    // with `modprobe -d`: tests/src/sctp.rs).
    let mut env = env.to_vec();
    if let Some(root) = &kernel.modules_root {
        env.push(("LB_KERNEL_MODULES_ROOT", root.display().to_string()));
    }
    let mut seen = Vec::new();
    let mut results = Vec::new();
    let mut aborted = None;
    let mut cmd = match (&kernel.vmlinuz, vng) {
        (Some(vmlinuz), Some(vng)) => {
            // The guest runs a script from the shared directory: a command given to --exec
            // travels on the kernel's command line, which is limited (2,048 bytes on x86; a
            // long PATH overflows it and 6.1 panics in early boot).
            let mut script = String::from("#!/bin/sh\nexec env");
            for (k, v) in &env {
                let _ = write!(script, " {k}={}", shell_quote(v));
            }
            if !kvm {
                // Emulated, a kube-apiserver takes minutes to become ready, and tests running
                // side by side starve each other: one test at a time, and patience.
                script.push_str(" RUST_TEST_THREADS=1 LB_CONTROL_PLANE_TIMEOUT_SECS=900");
            }
            let _ = write!(script, " {}", shell_quote(&xtask.display().to_string()));
            for a in &guest_args {
                let _ = write!(script, " {}", shell_quote(a));
            }
            script.push('\n');
            let script_path = share.join("guest.sh");
            fs::write(&script_path, script)?;
            let exec = format!("sh {}", shell_quote(&script_path.display().to_string()));
            // vng runs its siblings (virtme-run) from PATH: put the virtualenv's bin first.
            let bin = vng.parent().unwrap_or(Path::new("."));
            let path = std::env::var("PATH").unwrap_or_default();
            let mut c = Command::new(vng);
            c.env("PATH", format!("{}:{path}", bin.display()))
                .arg("--run")
                .arg(vmlinuz)
                .arg("--force-9p")
                .args(["--cpus", &opts.cpus.to_string(), "--memory", &opts.memory])
                .arg("--rwdir")
                .arg(&share)
                .arg("--overlay-rwdir")
                .arg(root.join("target"))
                .args(["--append", "panic=-1"])
                .arg("--verbose")
                .arg("--exec")
                .arg(exec);
            if !kvm {
                c.arg("--disable-kvm");
            }
            c
        }
        _ => {
            let mut c = Command::new(&xtask);
            c.args(&guest_args)
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
            c
        }
    };
    let console = fs::File::create(share.join("console.log"))?;
    cmd.current_dir(&root)
        .stdin(Stdio::null())
        .stdout(console.try_clone()?)
        .stderr(console)
        .process_group(0);
    let mut process = GuestProcess {
        child: cmd.spawn().with_context(|| format!("starting {cmd:?}"))?,
    };
    let deadline = started + Duration::from_secs(opts.timeout_minutes * 60);
    loop {
        results.extend(report_new_results(kernel, &share, &mut seen));
        if let Some(status) = process.child.try_wait()? {
            results.extend(report_new_results(kernel, &share, &mut seen));
            if !share.join("done").exists() {
                aborted = Some(format!(
                    "the guest ended ({status}) before the tests did; see {}",
                    results_dir.join("console.log").display()
                ));
            }
            break;
        }
        if INTERRUPTED.load(Ordering::SeqCst) {
            process.kill();
            aborted = Some("interrupted".into());
            break;
        }
        if Instant::now() > deadline {
            process.kill();
            aborted = Some(format!("timed out after {} minutes", opts.timeout_minutes));
            break;
        }
        thread::sleep(Duration::from_millis(500));
    }
    drop(process);
    // Keep everything the run wrote next to the other results, and drop the shared folder.
    if share != results_dir {
        for entry in fs::read_dir(&share)?.flatten() {
            let _ = fs::copy(entry.path(), results_dir.join(entry.file_name()));
        }
        let _ = fs::remove_dir_all(&share);
    }
    for b in binaries {
        if !seen.contains(&b.name) {
            let r = json!({
                "binary": b.name, "ok": false, "exit": null, "seconds": 0.0,
                "passed": 0, "failed": 0, "ignored": 0, "failures": [], "not_run": true,
            });
            println!("    {:<28} {:<16} NOT RUN", kernel.release, b.name);
            results.push(r);
        }
    }
    let outcome = KernelOutcome {
        kernel: kernel.clone(),
        guest,
        results,
        aborted,
        seconds: started.elapsed().as_secs_f64(),
        results_dir: results_dir.clone(),
    };
    write_summary(&outcome, &results_dir)?;
    Ok(outcome)
}

fn write_summary(outcome: &KernelOutcome, dir: &Path) -> Result<()> {
    let features = fs::read_to_string(dir.join("features.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .unwrap_or(Value::Null);
    let (sha, date) = provenance();
    let summary = json!({
        "release": outcome.kernel.release,
        "series": outcome.kernel.series,
        "package": outcome.kernel.package.as_ref().map(|p| p.0.clone()),
        "version": outcome.kernel.package.as_ref().map(|p| p.1.clone()),
        "guest": outcome.guest,
        "ok": outcome.ok(),
        "aborted": outcome.aborted,
        "seconds": outcome.seconds,
        "commit": sha,
        "date": date,
        "features": features,
        "results": outcome.results,
    });
    fs::write(dir.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_guest_binarys_reasons_are_its_panics_read_from_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = "running 2 tests\ntest a ... ok\ntest b ... FAILED\n\nfailures:\n\n---- b stdout ----\n\
                   some output\nthread 'b' panicked at tests/b.rs:10:5:\nlb-agent logged no \"attached\"\n\n\
                   failures:\n    b\n\ntest result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n";
        fs::write(dir.path().join("tc_topology.log"), log).unwrap();
        fs::write(dir.path().join("socket_lb.log"), "thread 'x' panicked at y").unwrap();
        let outcome = KernelOutcome {
            kernel: Kernel {
                release: "6.1.0-56-amd64".into(),
                series: "6.1".into(),
                package: None,
                vmlinuz: None,
                modules_root: None,
            },
            guest: String::new(),
            results: vec![
                json!({"binary": "tc_topology", "ok": false}),
                // Passed: its log is not read.
                json!({"binary": "socket_lb", "ok": true}),
            ],
            aborted: None,
            seconds: 0.0,
            results_dir: dir.path().to_path_buf(),
        };
        assert_eq!(
            outcome.failure_reasons(),
            vec![(
                "tc_topology::b on Linux 6.1.0-56-amd64".to_string(),
                vec![
                    "thread 'b' panicked at tests/b.rs:10:5:".to_string(),
                    "lb-agent logged no \"attached\"".to_string(),
                ]
            )]
        );
    }
}
