//! The results of a run as saved (`target/bench/results-*.json`), a later run merged into
//! them, and what the document, the plots and the summary read from them.

use serde::{Deserialize, Serialize};

use super::{Machine, stats::median};
use crate::bench::{
    measure::{ChangeLatency, LatencyLevel, Memory, Programming},
    peers::Config,
    tcrun::TcLevel,
};

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
    pub tc: Vec<TcLevel>,
    pub latency: Vec<LatencyLevel>,
    pub programming: Vec<Programming>,
    pub changes: Vec<ChangeLatency>,
    pub memory: Vec<Memory>,
    /// Problems met during the run (a step that failed, a probe that timed out).
    pub problems: Vec<String>,
    pub duration_s: f64,
}

impl Results {
    /// `self` completed by a later run (e.g. `--latency-only --levels 10000`): its measurements
    /// are added, replacing those of `self` for the same N (and program); its problems are
    /// appended; the machine and settings of the first run are kept.
    pub fn merge(mut self, later: Results) -> Results {
        self.command = format!("{}` and `{}", self.command, later.command);
        self.tc.retain(|t| !later.tc.iter().any(|x| x.n == t.n));
        self.tc.extend(later.tc);
        self.tc.sort_by_key(|t| t.n);
        let redone: Vec<u32> = later.latency.iter().map(|l| l.n).collect();
        self.latency.retain(|l| !redone.contains(&l.n));
        self.latency.extend(later.latency);
        self.latency.sort_by_key(|l| l.n);
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
        self.problems.extend(later.problems);
        self.duration_s += later.duration_s;
        self
    }

    pub fn levels(&self) -> Vec<u32> {
        self.latency.iter().map(|l| l.n).collect()
    }

    pub(super) fn level(&self, n: u32) -> Option<&LatencyLevel> {
        self.latency.iter().find(|l| l.n == n)
    }

    /// Per-round values of one latency statistic.
    pub(super) fn lat(
        &self,
        n: u32,
        c: Config,
        f: impl Fn(&crate::bench::crr::CrrResult) -> f64,
    ) -> Vec<f64> {
        self.level(n)
            .and_then(|l| l.runs.get(&c))
            .map(|runs| runs.iter().map(&f).collect())
            .unwrap_or_default()
    }

    pub(super) fn p50(&self, n: u32, c: Config) -> Option<f64> {
        median(&self.lat(n, c, |r| r.p50_us))
    }

    pub(super) fn max_n(&self) -> Option<u32> {
        self.levels().into_iter().max()
    }

    pub(super) fn agent_memory(&self, n: u32) -> Option<&Memory> {
        self.memory
            .iter()
            .filter(|m| m.n == n && m.config.is_some_and(Config::is_agent))
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
