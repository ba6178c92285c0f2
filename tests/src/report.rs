//! Figures the reliability scenarios report: each test writes `target/reliability/<name>.json`,
//! from which `cargo xtask test` regenerates docs/reliability.md.

use std::path::PathBuf;

use serde_json::Value;

/// The report folder: `<target>/reliability`, found from the running test executable
/// (`<target>/<profile>/deps/<test>`).
pub fn dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.ancestors()
        .nth(3)
        .map(|t| t.join("reliability"))
        .unwrap_or_else(|| PathBuf::from("target/reliability"))
}

/// Writes one scenario's figures (and prints them).
pub fn record(name: &str, figures: &Value) {
    let dir = dir();
    std::fs::create_dir_all(&dir).expect("create the report folder");
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(figures).expect("json")).expect("write the figures");
    eprintln!("{name}: {figures}");
}

/// Marks a scenario as started: its figures say it did not complete until [`record`] replaces
/// them, so a test that fails before recording leaves no stale figures from an earlier run.
pub fn started(name: &str, scenario: &str) {
    let dir = dir();
    std::fs::create_dir_all(&dir).expect("create the report folder");
    let figures = serde_json::json!({
        "scenario": scenario,
        "completed": false,
        "attempted": null,
        "failed": null,
    });
    std::fs::write(
        dir.join(format!("{name}.json")),
        serde_json::to_string_pretty(&figures).expect("json"),
    )
    .expect("write the figures");
}
