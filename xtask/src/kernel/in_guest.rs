//! `cargo xtask kernel-guest`, inside the guest (or on the host for `--kernel host`): runs each
//! test binary with its output in a log and records its result as JSON, with the kernel's
//! features from `lb-agent kernel`.

use std::{
    fs,
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::{test::Summary, util::workspace_root};

/// One test binary's result, as the runner (in a guest or here) records it. `named`: how many
/// tests it was told to run by exact name; running another number of them (a test renamed or
/// gone) fails it, rather than passing on fewer tests than asked for.
fn binary_result(name: &str, log: &str, exit: Option<i32>, seconds: f64, named: Option<usize>) -> Value {
    let mut summary = Summary::default();
    for line in log.lines() {
        summary.add_line(line);
    }
    let failures: Vec<&str> = log
        .lines()
        .filter_map(|l| l.strip_prefix("test ")?.strip_suffix(" ... FAILED"))
        .collect();
    let ran = summary.passed + summary.failed;
    let missing = named
        .filter(|&n| ran != n as u64)
        .map(|n| format!("ran {ran} of the {n} tests named (a test renamed or gone?)"));
    let ok = exit == Some(0) && summary.failed == 0 && summary.binaries > 0 && missing.is_none();
    json!({
        "binary": name,
        "ok": ok,
        "exit": exit,
        "seconds": seconds,
        "passed": summary.passed,
        "failed": summary.failed,
        "ignored": summary.ignored,
        "failures": failures,
        "missing": missing,
    })
}

/// `cargo xtask kernel-guest`: runs inside the guest (or on the host for `--kernel host`). Runs
/// each binary with its output in `<results>/<name>.log`, writes `<results>/<name>.json` when it
/// ends, the kernel's features to `features.json`, and `done` last. A binary named in `only`
/// (`NAME=TEST,TEST`) runs just those tests, by exact name; the others run whole, or what
/// `filter` matches.
pub fn guest(results: &Path, filter: Option<&str>, only: &[String], binaries: &[String]) -> Result<()> {
    let root = workspace_root();
    fs::create_dir_all(results)?;
    let features = Command::new(root.join("target/debug/lb-agent"))
        .args(["kernel", "-o", "json"])
        .output();
    let features = match features {
        Ok(out) => serde_json::from_slice::<Value>(&out.stdout)
            .unwrap_or_else(|_| json!({ "error": String::from_utf8_lossy(&out.stderr).trim().to_string() })),
        Err(e) => json!({ "error": e.to_string() }),
    };
    fs::write(
        results.join("features.json"),
        serde_json::to_string_pretty(&features)?,
    )?;
    for spec in binaries {
        let (name, path) = spec.split_once('=').context("binaries are NAME=PATH")?;
        let log_path = results.join(format!("{name}.log"));
        let log = fs::File::create(&log_path)?;
        let started = Instant::now();
        let mut cmd = Command::new(path);
        let named = only.iter().find_map(|o| o.strip_prefix(name)?.strip_prefix('='));
        match named {
            Some(tests) => cmd.arg("--exact").args(tests.split(',')),
            None => cmd.args(filter),
        };
        cmd
            // As `cargo test` runs them: from the package's directory.
            .current_dir(root.join("tests"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let exit = match cmd.status() {
            Ok(status) => status.code(),
            Err(e) => {
                fs::write(&log_path, format!("cannot start {path}: {e}\n"))?;
                None
            }
        };
        let text = fs::read_to_string(&log_path).unwrap_or_default();
        let named = named.map(|tests| tests.split(',').count());
        let result = binary_result(name, &text, exit, started.elapsed().as_secs_f64(), named);
        fs::write(
            results.join(format!("{name}.json")),
            serde_json::to_string_pretty(&result)?,
        )?;
    }
    fs::write(results.join("done"), "")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::run::result_line;

    #[test]
    fn results_are_read_from_the_test_output() {
        let log = "running 2 tests\ntest a ... ok\ntest b ... FAILED\n\nfailures:\n\ntest result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s\n";
        let r = binary_result("socket_lb", log, Some(101), 1.5, None);
        assert_eq!(r["ok"], false);
        assert_eq!(r["passed"], 1);
        assert_eq!(r["failures"], json!(["b"]));
        // A binary that printed "3 passed" and exited 0, told to run `named` tests by name or not.
        let three_passed = |named| {
            binary_result(
                "x",
                "test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.1s\n",
                Some(0),
                0.1,
                named,
            )
        };
        assert_eq!(three_passed(None)["ok"], true);
        // A binary that crashed before printing a result is a failure, whatever its exit.
        assert_eq!(binary_result("x", "", Some(0), 0.0, None)["ok"], false);
        assert!(result_line("6.1.0-56-amd64", &r).contains("failed: b"));
        // Told to run 4 tests by name, it ran 3: one of the names matches no test any more.
        let short = three_passed(Some(4));
        assert_eq!(short["ok"], false);
        assert!(result_line("6.1.0-56-amd64", &short).contains("ran 3 of the 4 tests named"));
        assert_eq!(three_passed(Some(3))["ok"], true);
    }
}
