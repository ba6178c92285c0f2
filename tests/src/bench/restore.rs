//! How `iptables-restore` itself scales with a kube-proxy-shaped ruleset, on each iptables
//! backend: the measurement behind kube-proxy iptables (on iptables-nft) not serving 10,000
//! Services after a cold start within the run's timeout.
//!
//! kube-proxy's first sync after a start restores every Service's chains in one
//! `iptables-restore -w 5 --noflush --counters` (later syncs restore only what changed). With
//! `--noflush`, iptables-nft (xtables-nft-multi, 1.8.9 here and unchanged in Debian's 1.8.11)
//! collects the name of every chain a command names into a sorted linked list before it fetches
//! them from the kernel (`cache_chain_list_insert` in iptables/nft-cache.c): one list walk per
//! command, so the restore is quadratic in the number of chains, and kube-proxy makes 11 chains
//! per Service of 10 endpoints. The same input without `--noflush`, or through iptables-legacy,
//! grows about linearly. Each restore here runs into a fresh network namespace of its own.

use std::{
    fmt::Write as _,
    io::Write as _,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use lb_tests::{netns::NetNs, packet::Family};
use serde::{Deserialize, Serialize};

/// One restore of the ruleset of `services` Services into an empty nat table.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RestoreRun {
    /// `iptables-nft-restore` or `iptables-legacy-restore`.
    pub binary: String,
    pub noflush: bool,
    pub services: u32,
    pub chains: u32,
    pub rules: u32,
    pub seconds: f64,
}

/// The variants measured: kube-proxy's own call on both backends, and iptables-nft without
/// `--noflush` (the same input; shows where the time goes).
pub const VARIANTS: [(&str, bool); 3] = [
    ("iptables-nft-restore", true),
    ("iptables-legacy-restore", true),
    ("iptables-nft-restore", false),
];

/// kube-proxy's nat ruleset for `services` of the benchmark's Services (its addresses and names,
/// `api`), as its iptables proxier writes it: a KUBE-SVC chain per Service with its masquerade
/// mark and one probability rule per endpoint, a KUBE-SEP chain per endpoint with its
/// masquerade-mark and DNAT rules. Chain names are hashed like kube-proxy's (unordered).
/// Returns (text, chains, rules).
pub fn kube_proxy_ruleset(services: u32) -> (String, u32, u32) {
    use super::api;
    let mut chains = String::from("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n");
    let mut rules = String::new();
    let (mut n_chains, mut n_rules) = (2, 0);
    for i in 0..services {
        let svc = format!("KUBE-SVC-{}", chain_hash(u64::from(i) << 8));
        let name = format!("{}/{}:http", api::NS, api::svc_name_in(Family::V4, i));
        let vip = api::vip(i, api::SERVICE_PORT);
        let (vip_ip, vip_port) = (vip.ip(), vip.port());
        let _ = writeln!(chains, ":{svc} - [0:0]");
        let _ = writeln!(
            rules,
            "-A KUBE-SERVICES -m comment --comment \"{name} cluster IP\" -m tcp -p tcp -d {vip_ip}/32 --dport {vip_port} -j {svc}"
        );
        // Traffic to the ClusterIP from outside the cluster CIDR is marked for masquerade.
        let _ = writeln!(
            rules,
            "-A {svc} -m comment --comment \"{name} cluster IP\" -m tcp -p tcp -d {vip_ip}/32 --dport {vip_port} ! -s {} -j KUBE-MARK-MASQ",
            super::topo::CLUSTER_CIDR
        );
        n_chains += 1;
        n_rules += 2;
        let endpoints = api::endpoints_in(Family::V4, i);
        for (j, ep) in (0u32..).zip(&endpoints) {
            let sep = format!("KUBE-SEP-{}", chain_hash((u64::from(i) << 8) | u64::from(j + 1)));
            let ep_ip = ep.ip();
            let _ = writeln!(chains, ":{sep} - [0:0]");
            let probability = if j + 1 < api::ENDPOINTS {
                format!(
                    " -m statistic --mode random --probability {:.10}",
                    1.0 / f64::from(api::ENDPOINTS - j)
                )
            } else {
                String::new()
            };
            let _ = writeln!(
                rules,
                "-A {svc} -m comment --comment \"{name} -> {ep}\"{probability} -j {sep}"
            );
            let _ = writeln!(
                rules,
                "-A {sep} -m comment --comment {name} -s {ep_ip}/32 -j KUBE-MARK-MASQ"
            );
            let _ = writeln!(
                rules,
                "-A {sep} -m comment --comment {name} -m tcp -p tcp -j DNAT --to-destination {ep}"
            );
            n_chains += 1;
            n_rules += 3;
        }
    }
    chains.push_str(&rules);
    chains.push_str("COMMIT\n");
    (chains, n_chains, n_rules)
}

/// 16 characters of base32 like kube-proxy's chain suffixes, from a mixed integer.
fn chain_hash(x: u64) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut h = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    (0..16)
        .map(|k| ALPHABET[((h >> (k * 4)) & 31) as usize] as char)
        .collect()
}

/// A variant stops growing after the first level whose restore took longer than this (the next
/// would take about four times as long if quadratic).
pub const BUDGET: Duration = Duration::from_secs(30);

/// Restores each variant at growing Service counts, up to [`BUDGET`] per variant's last level.
pub fn measure(levels: &[u32]) -> Vec<RestoreRun> {
    let mut runs = Vec::new();
    for (binary, noflush) in VARIANTS {
        if !binary_exists(binary) {
            eprintln!("  {binary}: not installed, skipped");
            continue;
        }
        for &services in levels {
            super::check_interrupted();
            match restore_once(binary, noflush, services) {
                Ok(run) => {
                    eprintln!(
                        "  {binary}{} with {services} Services ({} chains, {} rules): {:.2} s",
                        if noflush { " --noflush" } else { "" },
                        run.chains,
                        run.rules,
                        run.seconds
                    );
                    let slow = run.seconds > BUDGET.as_secs_f64();
                    runs.push(run);
                    if slow {
                        break;
                    }
                }
                Err(e) => {
                    eprintln!("  {binary} with {services} Services failed: {e}");
                    break;
                }
            }
        }
    }
    runs
}

fn binary_exists(binary: &str) -> bool {
    Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn restore_once(binary: &str, noflush: bool, services: u32) -> Result<RestoreRun, String> {
    let (text, chains, rules) = kube_proxy_ruleset(services);
    let ns = NetNs::new("lbrst");
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", ns.path().display()))
        .args(["--", binary, "-w", "5", "--counters"]);
    if noflush {
        cmd.arg("--noflush");
    }
    let started = Instant::now();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("start: {e}"))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(text.as_bytes())
        .map_err(|e| format!("write the rules: {e}"))?;
    let out = child.wait_with_output().map_err(|e| format!("wait: {e}"))?;
    let seconds = started.elapsed().as_secs_f64();
    if !out.status.success() {
        return Err(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(RestoreRun {
        binary: binary.to_string(),
        noflush,
        services,
        chains,
        rules,
        seconds,
    })
}

/// The growth exponent between the last two levels of a variant (2 is quadratic) and the time
/// that exponent projects at `target` Services: `t_last × (target / n_last)^k`.
pub fn projection(runs: &[&RestoreRun], target: u32) -> Option<(f64, f64)> {
    let [.., a, b] = runs else { return None };
    if a.seconds <= 0.0 || b.services <= a.services {
        return None;
    }
    let k = (b.seconds / a.seconds).ln() / (f64::from(b.services) / f64::from(a.services)).ln();
    Some((k, b.seconds * (f64::from(target) / f64::from(b.services)).powf(k)))
}

/// The restore a configuration's first sync runs (kube-proxy's call on its backend), if any.
pub fn variant_of(config: super::peers::Config) -> Option<(&'static str, bool)> {
    use super::peers::Config;
    match config {
        Config::Iptables => Some(("iptables-nft-restore", true)),
        Config::IptablesLegacy => Some(("iptables-legacy-restore", true)),
        _ => None,
    }
}

/// What the measured growth projects for `config`'s first-sync restore at `n` Services: None
/// when it runs no restore or the run measured fewer than two levels of it.
pub fn projected_first_sync_s(runs: &[RestoreRun], config: super::peers::Config, n: u32) -> Option<f64> {
    let (binary, noflush) = variant_of(config)?;
    let mine: Vec<&RestoreRun> = runs
        .iter()
        .filter(|r| r.binary == binary && r.noflush == noflush)
        .collect();
    projection(&mine, n).map(|(_, t)| t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ruleset_has_kube_proxys_shape() {
        let (text, chains, rules) = kube_proxy_ruleset(3);
        // KUBE-SERVICES, KUBE-MARK-MASQ, then per Service one SVC and ten SEP chains.
        assert_eq!(chains, 2 + 3 * 11);
        // Per Service: the KUBE-SERVICES jump and the masquerade mark (32 rules, as kube-proxy's
        // numNATRules per Service), then per endpoint a probability jump and two.
        assert_eq!(rules, 3 * (2 + 10 * 3));
        assert_eq!(text.lines().filter(|l| l.starts_with(':')).count() as u32, chains);
        assert_eq!(
            text.lines().filter(|l| l.starts_with("-A ")).count() as u32,
            rules
        );
        assert!(text.starts_with("*nat\n") && text.ends_with("COMMIT\n"));
        // Chain names are distinct and kube-proxy's length (KUBE-SEP- + 16).
        let names: std::collections::BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix(':')?.split(' ').next())
            .collect();
        assert_eq!(names.len() as u32, chains);
        assert!(
            names
                .iter()
                .filter(|n| n.starts_with("KUBE-SEP-"))
                .all(|n| n.len() == "KUBE-SEP-".len() + 16)
        );
        // The last endpoint takes what is left: no probability on its rule.
        assert!(text.contains("-> 10.128.0.10:8080\" -j KUBE-SEP-"));
        assert!(
            text.contains("-> 10.128.0.1:8080\" -m statistic --mode random --probability 0.1000000000 -j")
        );
    }

    #[test]
    fn projection_uses_the_last_doubling() {
        let run = |services, seconds| RestoreRun {
            binary: "iptables-nft-restore".into(),
            noflush: true,
            services,
            chains: 0,
            rules: 0,
            seconds,
        };
        let (a, b, c) = (run(500, 1.0), run(1000, 2.0), run(2000, 8.0));
        let (k, t) = projection(&[&a, &b, &c], 10_000).expect("two levels");
        assert!((k - 2.0).abs() < 1e-9);
        assert!((t - 8.0 * 25.0).abs() < 1e-6);
        assert!(projection(&[&c], 10_000).is_none());
        // Each kube-proxy configuration projects from its own backend's runs only.
        use crate::bench::peers::Config;
        let runs = [a.clone(), b.clone(), c.clone()];
        let t = projected_first_sync_s(&runs, Config::Iptables, 10_000).expect("nft runs");
        assert!((t - 200.0).abs() < 1e-6);
        assert!(projected_first_sync_s(&runs, Config::IptablesLegacy, 10_000).is_none());
        assert!(projected_first_sync_s(&runs, Config::Nftables, 10_000).is_none());
    }
}
