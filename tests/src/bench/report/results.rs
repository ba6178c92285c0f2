//! The results of a run as saved (`target/bench/results-*.json`), a later run merged into
//! them, and what the document, the plots and the summary read from them.

use lb_tests::packet::Family;
use serde::{Deserialize, Serialize};

use super::{Machine, stats::median};
use crate::bench::{
    measure::{ChangeLatency, LatencyLevel, Memory, Programming, cold_start_when},
    peers::Config,
    tcrun::TcLevel,
};

/// Both families, IPv4 first (the document's order).
pub(super) const FAMILIES: [Family; 2] = [Family::V4, Family::V6];

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Results {
    pub quick: bool,
    pub command: String,
    pub machine: Machine,
    pub rounds: usize,
    pub conns: usize,
    pub warmup: usize,
    pub change_reps: u32,
    pub backends_capacity: u32,
    /// `--bpf-lb-service-map-max` (0 in results written before it was recorded: the default).
    #[serde(default)]
    pub services_capacity: u32,
    /// tc cost per packet with IPv4 Services and packets.
    pub tc: Vec<TcLevel>,
    /// The same with IPv6 Services and packets.
    #[serde(default)]
    pub tc6: Vec<TcLevel>,
    /// Connect latency over IPv4 (the IPv4 Service set in the API).
    pub latency: Vec<LatencyLevel>,
    /// Connect latency over IPv6 (the IPv6 Service set in the API instead).
    #[serde(default)]
    pub latency6: Vec<LatencyLevel>,
    pub programming: Vec<Programming>,
    pub changes: Vec<ChangeLatency>,
    pub memory: Vec<Memory>,
    /// North-south throughput (NodePort from outside the node), every round of every
    /// configuration.
    #[serde(default)]
    pub throughput: Vec<crate::bench::throughput::ThroughputRun>,
    /// `iptables-restore` of kube-proxy's ruleset by Service count, on each backend.
    #[serde(default)]
    pub restore: Vec<crate::bench::restore::RestoreRun>,
    /// Maglev tables: memory, cold programming and one change, by Service count (issue 17).
    #[serde(default)]
    pub maglev: Vec<crate::bench::maglev::MaglevLevel>,
    /// Problems met during the run (a step that failed, a probe that timed out).
    pub problems: Vec<String>,
    pub duration_s: f64,
}

impl Results {
    /// The configurations with connect-latency rounds in this run, in the document's order.
    pub fn measured_configs(&self) -> Vec<Config> {
        Config::ALL
            .into_iter()
            .filter(|c| {
                self.latency
                    .iter()
                    .chain(&self.latency6)
                    .any(|l| l.runs.contains_key(c))
            })
            .collect()
    }

    /// `self` completed by a later run (e.g. `--latency-only --levels 10000`): its measurements
    /// are added, replacing those of `self` for the same N (and program); its problems are
    /// appended; the machine and settings of the first run are kept.
    pub fn merge(mut self, later: Results) -> Results {
        self.command = format!("{}` and `{}", self.command, later.command);
        for (ours, theirs) in [(&mut self.tc, later.tc), (&mut self.tc6, later.tc6)] {
            ours.retain(|t| !theirs.iter().any(|x| x.n == t.n));
            ours.extend(theirs);
            ours.sort_by_key(|t| t.n);
        }
        for (ours, theirs) in [
            (&mut self.latency, later.latency),
            (&mut self.latency6, later.latency6),
        ] {
            let redone: Vec<u32> = theirs.iter().map(|l| l.n).collect();
            ours.retain(|l| !redone.contains(&l.n));
            ours.extend(theirs);
            ours.sort_by_key(|l| l.n);
        }
        self.programming.retain(|p| {
            !later
                .programming
                .iter()
                .any(|x| (x.config, x.n) == (p.config, p.n))
        });
        self.programming.extend(later.programming);
        self.changes
            .retain(|c| !later.changes.iter().any(|x| (x.config, x.n) == (c.config, c.n)));
        self.changes.extend(later.changes);
        self.memory.retain(|m| {
            !later
                .memory
                .iter()
                .any(|x| (x.config, x.n, &x.when) == (m.config, m.n, &m.when))
        });
        self.memory.extend(later.memory);
        if !later.throughput.is_empty() {
            self.throughput = later.throughput;
        }
        if !later.restore.is_empty() {
            self.restore = later.restore;
        }
        if !later.maglev.is_empty() {
            self.maglev = later.maglev;
        }
        self.problems.extend(later.problems);
        self.duration_s += later.duration_s;
        self
    }

    /// The IPv4 Service counts of the connect-latency runs.
    pub fn levels(&self) -> Vec<u32> {
        self.latency.iter().map(|l| l.n).collect()
    }

    /// The connect-latency levels over `family`.
    pub(super) fn latency_in(&self, family: Family) -> &[LatencyLevel] {
        match family {
            Family::V4 => &self.latency,
            Family::V6 => &self.latency6,
        }
    }

    /// The tc levels of `family`.
    pub(super) fn tc_in(&self, family: Family) -> &[TcLevel] {
        match family {
            Family::V4 => &self.tc,
            Family::V6 => &self.tc6,
        }
    }

    pub fn tc_in_mut(&mut self, family: Family) -> &mut Vec<TcLevel> {
        match family {
            Family::V4 => &mut self.tc,
            Family::V6 => &mut self.tc6,
        }
    }

    /// The families with connect-latency runs (IPv4 always listed).
    pub(super) fn latency_families(&self) -> Vec<Family> {
        FAMILIES
            .into_iter()
            .filter(|&f| f == Family::V4 || !self.latency_in(f).is_empty())
            .collect()
    }

    pub(super) fn level(&self, n: u32) -> Option<&LatencyLevel> {
        self.level_in(Family::V4, n)
    }

    pub(super) fn level_in(&self, family: Family, n: u32) -> Option<&LatencyLevel> {
        self.latency_in(family).iter().find(|l| l.n == n)
    }

    /// Per-round values of one latency statistic over `family`.
    pub(super) fn lat_in(
        &self,
        family: Family,
        n: u32,
        c: Config,
        f: impl Fn(&crate::bench::crr::CrrResult) -> f64,
    ) -> Vec<f64> {
        self.level_in(family, n)
            .and_then(|l| l.runs.get(&c))
            .map(|runs| runs.iter().map(&f).collect())
            .unwrap_or_default()
    }

    pub(super) fn p50(&self, n: u32, c: Config) -> Option<f64> {
        self.p50_in(Family::V4, n, c)
    }

    pub(super) fn p50_in(&self, family: Family, n: u32, c: Config) -> Option<f64> {
        median(&self.lat_in(family, n, c, |r| r.p50_us))
    }

    pub(super) fn max_n(&self) -> Option<u32> {
        self.levels().into_iter().max()
    }

    /// The Service count the targets are judged at: theirs (10,000), or the largest level below
    /// it that this run measured (a quick run's 1,000; 30,000 is there for the growth with N).
    pub(super) fn target_n(&self) -> Option<u32> {
        let levels = self.levels();
        let at_most = levels
            .iter()
            .copied()
            .filter(|&n| n <= super::targets::TARGET_N)
            .max();
        at_most.or_else(|| self.max_n())
    }

    /// The agent's largest memory measurement at N with the IPv4 Services (the target's).
    pub(super) fn agent_memory(&self, n: u32) -> Option<&Memory> {
        self.memory
            .iter()
            .filter(|m| m.n == n && m.config.is_some_and(Config::is_agent))
            .filter(|m| m.when != cold_start_when(Family::V6))
            .max_by_key(|m| m.rss_kib)
    }

    /// The agent's first sync after a cold start with N Services in the API (it programs all of
    /// them at once); the larger of the two agents started at N.
    pub(super) fn agent_full_sync_ms(&self, n: u32) -> Option<f64> {
        self.level(n)
            .into_iter()
            .flat_map(|l| l.cold.iter())
            .filter(|c| c.config.is_some_and(Config::is_agent))
            .filter_map(|c| c.agent_sync_ms.first().copied())
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
    }

    /// The agent's largest sync while N Services were created through the API.
    pub(super) fn agent_largest_live_sync_ms(&self, n: u32) -> Option<f64> {
        self.programming
            .iter()
            .filter(|p| p.n == n && p.config.is_some_and(Config::is_agent))
            .flat_map(|p| p.agent_sync_ms.iter().copied())
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_levels(levels: &[u32]) -> Results {
        Results {
            latency: levels
                .iter()
                .map(|&n| LatencyLevel {
                    n,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn targets_are_judged_at_ten_thousand_or_the_largest_level_below() {
        assert_eq!(with_levels(&[10, 1_000, 10_000, 30_000]).target_n(), Some(10_000));
        assert_eq!(with_levels(&[10, 1_000, 30_000]).target_n(), Some(1_000));
        assert_eq!(with_levels(&[10, 1_000]).target_n(), Some(1_000));
        assert_eq!(with_levels(&[30_000]).target_n(), Some(30_000));
        assert_eq!(with_levels(&[]).target_n(), None);
    }
}
