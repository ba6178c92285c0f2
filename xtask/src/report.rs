//! docs/reliability.md, generated from the figures the reliability tests wrote to
//! `target/reliability/*.json` (never typed by hand).

use std::{fmt::Write as _, fs, process::Command};

use anyhow::{Context, Result};
use serde_json::{Map, Value};

use crate::util::{output, workspace_root};

/// A value as a Markdown table cell: strings as they are, lists joined, objects as `key: value`
/// pairs; `|` and line breaks escaped.
fn cell(v: &Value) -> String {
    let text = match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        Value::Array(items) if items.is_empty() => "none".into(),
        Value::Array(items) => items.iter().map(cell).collect::<Vec<_>>().join(", "),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| format!("{}: {}", key(k), cell(v)))
            .collect::<Vec<_>>()
            .join("; "),
        // Measured durations and latencies: three decimals are plenty.
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(f64::NAN);
            let text = format!("{f:.3}");
            text.trim_end_matches('0').trim_end_matches('.').to_string()
        }
        other => other.to_string(),
    };
    text.replace('|', "\\|").replace('\n', " ")
}

/// Columns shown first, in this order, when a list of objects is rendered as a table.
const FIRST_COLUMNS: &[&str] = &[
    "t_s",
    "row",
    "load",
    "command",
    "object",
    "apiserver",
    "agent",
    "event",
];
/// Columns shown last.
const LAST_COLUMNS: &[&str] = &["ok"];

/// A list of objects as a Markdown table (columns: the union of their keys).
fn table(items: &[Value]) -> String {
    let mut keys: Vec<String> = Vec::new();
    for item in items {
        for k in item.as_object().into_iter().flat_map(Map::keys) {
            if !keys.contains(k) {
                keys.push(k.clone());
            }
        }
    }
    let rank = |k: &str| {
        FIRST_COLUMNS
            .iter()
            .position(|c| *c == k)
            .map(|p| (0, p))
            .or_else(|| LAST_COLUMNS.iter().position(|c| *c == k).map(|p| (2, p)))
            .unwrap_or((1, 0))
    };
    keys.sort_by_key(|k| rank(k));
    let mut out = String::new();
    let header: Vec<String> = keys.iter().map(|k| capitalized(&key(k))).collect();
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let _ = writeln!(out, "|{}", "---|".repeat(keys.len()));
    for item in items {
        let cells: Vec<String> = keys.iter().map(|k| cell(&item[k.as_str()])).collect();
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    out
}

/// A snake_case key as words; other keys (names like `TC_ACT_OK`) as they are.
fn key(k: &str) -> String {
    if k.chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        k.replace('_', " ")
    } else {
        k.to_string()
    }
}

fn capitalized(s: &str) -> String {
    let mut chars = s.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// The figures of a scenario's IPv6 load, kept apart from the rest (`"ipv6": {...}`, with the
/// same keys as the scenario's own: `load`, `attempted`, `failed`, `established`, ...), so that
/// the IPv4 figures read as they did before the scenarios carried IPv6 load.
const IPV6: &str = "ipv6";

/// What a scenario lost: failed requests, broken or moved connections, misrouted connections,
/// unexpected outcomes; its IPv6 load's losses after `IPv6: `.
fn lost(v: &Value) -> String {
    if v["completed"] == false {
        return "the test did not complete (it failed before recording its figures)".into();
    }
    let mut parts = losses(v);
    if v[IPV6].is_object() {
        parts.extend(losses(&v[IPV6]).into_iter().map(|p| format!("IPv6: {p}")));
    }
    if parts.is_empty() {
        "nothing".into()
    } else {
        parts.join(", ")
    }
}

/// The losses among one set of figures (a scenario's, or its IPv6 load's).
fn losses(v: &Value) -> Vec<String> {
    let mut parts = Vec::new();
    let count = |pointer: &str| v.pointer(pointer).and_then(Value::as_u64).filter(|n| *n > 0);
    for (pointer, what) in [
        ("/failed", "failed requests"),
        ("/established/broken", "broken connections"),
        ("/established/moved_backend", "connections moved backend"),
        (
            "/new_connections_to_removed_endpoints",
            "connections to removed endpoints",
        ),
        ("/half_programmed", "half-programmed Services"),
        ("/mistranslations", "mistranslated packets"),
        ("/rows_failed", "inputs not handled as expected"),
        (
            "/problems_after_delete",
            "problems reported after the bad objects were gone",
        ),
        (
            "/denied_but_served",
            "connections served from outside loadBalancerSourceRanges",
        ),
        ("/undocumented", "undocumented listening sockets"),
    ] {
        if let Some(n) = count(pointer) {
            parts.push(format!("{n} {what}"));
        }
    }
    if v["ids_stable"] == false {
        parts.push("ids changed".into());
    }
    if let Some(n) = count("/known_bugs") {
        parts.push(format!("{n} known bugs (see the table)"));
    }
    parts
}

/// The document, from each scenario's (name, figures), in name order.
fn render(scenarios: &[(String, Value)], header: &str) -> String {
    let mut doc = String::new();
    let _ = writeln!(doc, "# Reliability\n");
    doc.push_str(&render_scenarios(scenarios, header));
    doc
}

fn render_scenarios(scenarios: &[(String, Value)], header: &str) -> String {
    let mut doc = String::new();
    let _ = writeln!(doc, "{header}\n");
    let _ = writeln!(
        doc,
        "| Scenario | Requests attempted | Failed | IPv6 requests attempted | IPv6 failed | Lost |\n|---|---:|---:|---:|---:|---|"
    );
    let mut sections = String::new();
    for (name, v) in scenarios {
        let title = v["scenario"].as_str().unwrap_or(name).to_string();
        let _ = writeln!(
            doc,
            "| {name}: {} | {} | {} | {} | {} | {} |",
            cell(&json_string(&title)),
            cell(&v["attempted"]),
            cell(&v["failed"]),
            cell(&v[IPV6]["attempted"]),
            cell(&v[IPV6]["failed"]),
            lost(v)
        );
        let _ = writeln!(sections, "\n## {name}\n\n{title}\n");
        figures(&mut sections, v, "");
        if v[IPV6].is_object() {
            let _ = writeln!(sections, "\nIPv6, alongside:\n");
            figures(&mut sections, &v[IPV6], "IPv6 ");
        }
    }
    doc.push_str(&sections);
    doc
}

/// One set of figures (a scenario's, or its IPv6 load's, whose rows and bullets start with
/// `prefix`): the loads held as a table, lists of objects as tables, the rest as bullets.
fn figures(sections: &mut String, v: &Value, prefix: &str) {
    if let Some(loads) = v["load"].as_array() {
        let _ = writeln!(
            sections,
            "| {}oad held | Attempted | Failed | Details |\n|---|---:|---:|---|",
            if prefix.is_empty() {
                "L".to_string()
            } else {
                format!("{prefix}l")
            }
        );
        for l in loads {
            let details: Vec<String> = l
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, _)| !matches!(k.as_str(), "load" | "attempted" | "failed"))
                .map(|(k, v)| format!("{}: {}", key(k), cell(v)))
                .collect();
            let _ = writeln!(
                sections,
                "| {} | {} | {} | {} |",
                cell(&l["load"]),
                cell(&l["attempted"]),
                cell(&l["failed"]),
                details.join("; ")
            );
        }
        sections.push('\n');
    }
    let mut tables = String::new();
    for (k, val) in v.as_object().into_iter().flatten() {
        if matches!(k.as_str(), "scenario" | "load" | "attempted" | "failed" | IPV6) {
            continue;
        }
        match val.as_array() {
            // Lists of objects (per-input rows, per-command attempts) get their own table.
            Some(items) if !items.is_empty() && items.iter().all(Value::is_object) => {
                let _ = writeln!(
                    tables,
                    "\n{}:\n\n{}",
                    capitalized(&format!("{prefix}{}", key(k))),
                    table(items)
                );
            }
            _ => {
                let _ = writeln!(sections, "- {prefix}{}: {}", key(k), cell(val));
            }
        }
    }
    sections.push_str(&tables);
}

fn json_string(s: &str) -> Value {
    Value::String(s.to_string())
}

pub fn write_reliability() -> Result<()> {
    let dir = workspace_root().join("target/reliability");
    let Ok(entries) = fs::read_dir(&dir) else {
        return Ok(());
    };
    let mut files: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    if files.is_empty() {
        return Ok(());
    }
    // By scenario number, then name: 10-flood after 9-kubelet-*, 1b after 1.
    files.sort_by_key(|p| {
        let stem = p.file_stem().unwrap_or_default().to_string_lossy().to_string();
        let digits = stem.chars().take_while(char::is_ascii_digit).count();
        (
            stem[..digits].parse::<u32>().unwrap_or(u32::MAX),
            stem[digits..].to_string(),
        )
    });
    let mut scenarios = Vec::new();
    for file in &files {
        let v: Value = serde_json::from_str(&fs::read_to_string(file)?)
            .with_context(|| format!("{}", file.display()))?;
        let name = file.file_stem().unwrap_or_default().to_string_lossy().to_string();
        scenarios.push((name, v));
    }
    let kernel = output(Command::new("uname").arg("-r")).unwrap_or_default();
    let (sha, date) = crate::util::provenance();
    let header = format!(
        "Generated by `cargo xtask test` (or `cargo xtask report`) from the figures the reliability tests recorded \
         (`target/reliability/*.json`), at {} on kernel {}, commit {}. Each scenario is an automated test in \
         `tests/tests/`; the goal is that nothing is lost. The scenarios run on a dual-stack node carry IPv6 load \
         beside their IPv4 load and report it apart: its requests in the IPv6 columns and in each section's IPv6 \
         part, the other columns and figures counting what they counted before (`-`: no IPv6 load of its own).",
        date.trim(),
        kernel.trim(),
        sha.trim()
    );
    let doc = render(&scenarios, &header);
    let path = workspace_root().join("docs/reliability.md");
    fs::create_dir_all(path.parent().expect("docs"))?;
    fs::write(&path, doc)?;
    eprintln!("==> wrote {} from {} scenario(s)", path.display(), files.len());
    Ok(())
}

fn render_soak(figures: Value, header: &str) -> String {
    let mut doc = String::from("# Soak\n\n");
    doc.push_str(&render_scenarios(&[("soak".to_string(), figures)], header));
    doc
}

/// docs/soak.md from the soak's figures (`cargo xtask soak`), in docs/reliability.md's form.
pub fn write_soak(figures: &std::path::Path, sha: &str) -> Result<()> {
    let v: Value = serde_json::from_str(&fs::read_to_string(figures)?)
        .with_context(|| format!("{}", figures.display()))?;
    let kernel = output(Command::new("uname").arg("-r")).unwrap_or_default();
    let (_, date) = crate::util::provenance();
    let header = format!(
        "Generated by `cargo xtask soak` (`soak` in tests/tests/reliability.rs) at {} on kernel {}, commit {}. \
         A real kube-apiserver and etcd, steady load on one Service through both paths, and in a cycle: endpoint \
         churn, Services created and deleted, API server and etcd restarts, agent restarts, upgrades, downgrades \
         and kill -9. The last 30% of the run keeps one agent: its memory, descriptors and conntrack entries from \
         a minute into that stretch to its end are the growth figures. Samples every 30 s.",
        date.trim(),
        kernel.trim(),
        sha.trim()
    );
    let doc = render_soak(v, &header);
    let path = workspace_root().join("docs/soak.md");
    fs::write(&path, doc)?;
    eprintln!("==> wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn soak_figures_render_their_actions_samples_and_growth() {
        let v = json!({
            "scenario": "Soak of 3600s",
            "attempted": 54008,
            "failed": 0,
            "load": [{"load": "tc path, TCP to the NodePort", "attempted": 12940, "failed": 0}],
            "actions": [{"action": "etcd restart", "times": 12}],
            "last_agent_rss_kib": {"from": 33288, "to": 33300, "over_s": 960},
            "samples": [{"t_s": 30, "agent": 1, "rss_kib": 32108, "fds": 57, "lb4_ct": 2479}],
        });
        let doc = render_soak(v, "header");
        assert!(doc.starts_with("# Soak\n\nheader\n"), "{doc}");
        assert!(doc.contains("| soak: Soak of 3600s | 54008 | 0 |"), "{doc}");
        assert!(
            doc.contains("| Action | Times |\n|---|---|\n| etcd restart | 12 |"),
            "{doc}"
        );
        assert!(
            doc.contains("- last agent rss kib: from: 33288; over s: 960; to: 33300"),
            "{doc}"
        );
        assert!(doc.contains("| T s | Agent | Fds | Lb4 ct | Rss kib |"), "{doc}");
    }

    #[test]
    fn rows_become_a_table_and_losses_are_named() {
        let v = json!({
            "scenario": "Hostile input",
            "attempted": 10,
            "failed": 0,
            "load": [{"load": "tcp", "attempted": 10, "failed": 0}],
            "rows": [
                {"row": "port 0", "agent": "spec.ports[0].port | ignored", "ok": true},
                {"row": "bad address", "agent": "skipped", "event": "InvalidService", "ok": "known bug (repro)"},
            ],
            "rows_failed": 0,
            "known_bugs": 1,
            "huge": {"endpoints": 200_000, "slices": 200, "created_in_s": 14.229_580_276},
            "verdicts": {"ingress TC_ACT_OK": 3},
            "granted": ["list services", "watch services"],
        });
        let doc = render(&[("5-hostile-input".into(), v)], "header");
        assert!(
            doc.contains(
                "| 5-hostile-input: Hostile input | 10 | 0 | - | - | 1 known bugs (see the table) |"
            ),
            "{doc}"
        );
        assert!(doc.contains("| Row | Agent | Event | Ok |"), "{doc}");
        assert!(
            doc.contains("| port 0 | spec.ports[0].port \\| ignored | - | true |"),
            "{doc}"
        );
        assert!(
            doc.contains("| bad address | skipped | InvalidService | known bug (repro) |"),
            "{doc}"
        );
        assert!(
            doc.contains("- huge: created in s: 14.23; endpoints: 200000; slices: 200"),
            "{doc}"
        );
        assert!(doc.contains("- verdicts: ingress TC_ACT_OK: 3"), "{doc}");
        assert!(doc.contains("- granted: list services, watch services"), "{doc}");
        // The IPv6 load of a dual-stack scenario: its own columns, table and bullets, its losses
        // named apart; the IPv4 figures as they were.
        let dual = json!({
            "scenario": "Restart",
            "attempted": 100,
            "failed": 0,
            "load": [{"load": "socket path, TCP to the cluster IP", "attempted": 100, "failed": 0}],
            "established": {"broken": 0, "connections": 3},
            "ids_stable": true,
            "ipv6": {
                "attempted": 90,
                "failed": 2,
                "load": [{"load": "socket path, TCP to the cluster IP", "attempted": 90, "failed": 2}],
                "established": {"broken": 1, "connections": 3},
                "ids_stable": true,
            },
        });
        let doc = render(&[("1-restart".into(), dual)], "header");
        assert!(
            doc.contains("| 1-restart: Restart | 100 | 0 | 90 | 2 | IPv6: 2 failed requests, IPv6: 1 broken connections |"),
            "{doc}"
        );
        assert!(
            doc.contains("| Load held | Attempted | Failed | Details |"),
            "{doc}"
        );
        assert!(
            doc.contains("| IPv6 load held | Attempted | Failed | Details |"),
            "{doc}"
        );
        assert!(
            doc.contains("| socket path, TCP to the cluster IP | 90 | 2 |  |"),
            "{doc}"
        );
        assert!(doc.contains("- established: broken: 0; connections: 3"), "{doc}");
        assert!(
            doc.contains("- IPv6 established: broken: 1; connections: 3"),
            "{doc}"
        );
        assert!(doc.contains("- IPv6 ids stable: true"), "{doc}");
        // A test that failed before recording says so.
        let failed = render(&[("x".into(), json!({"scenario": "x", "completed": false}))], "h");
        assert!(failed.contains("did not complete"), "{failed}");
    }
}
