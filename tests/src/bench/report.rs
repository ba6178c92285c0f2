//! docs/benchmarks.md and the plots in docs/bench/, generated from the measured values only.

use std::{fmt::Write as _, fs, path::Path, process::Command};

use serde::{Deserialize, Serialize};

use super::{
    measure::{ChangeLatency, LatencyLevel, Memory, Programming},
    peers::{self, Config},
    tcrun::TcLevel,
};

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Machine {
    pub kernel: String,
    pub cpu: String,
    pub cores: usize,
    pub memory: String,
    pub os: String,
    pub kube_proxy: String,
    pub kube_apiserver: String,
    pub etcd: String,
    pub iptables: String,
    pub nft: String,
    pub lb_agent: String,
    pub git: String,
    pub date: String,
}

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

fn first_line(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .map(|o| {
            let text = if o.stdout.is_empty() { o.stderr } else { o.stdout };
            String::from_utf8_lossy(&text)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_else(|| "unknown".into())
}

pub fn machine(bins: &lb_tests::control_plane::Binaries, agent: &Path, root: &Path) -> Machine {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let os = fs::read_to_string("/etc/os-release")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .unwrap_or("")
        .trim_matches('"')
        .to_string();
    let root_s = root.display().to_string();
    let sha = first_line("git", &["-C", &root_s, "rev-parse", "--short=12", "HEAD"]);
    // Uncommitted changes to what is measured (the agent, its eBPF programs and what builds them);
    // the harness and the docs it writes do not count.
    let dirty = Command::new("git")
        .args([
            "-C",
            &root_s,
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
        ])
        .args([
            "lb-agent",
            "lb-ebpf",
            "lb-common",
            "Cargo.toml",
            "Cargo.lock",
            "rust-toolchain.toml",
            ".cargo",
        ])
        .output()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    Machine {
        kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        cpu: cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
            .unwrap_or_default(),
        cores: cpuinfo.lines().filter(|l| l.starts_with("processor")).count(),
        memory: meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse::<f64>().ok())
            .map(|kb| format!("{:.1} GiB", kb / 1024.0 / 1024.0))
            .unwrap_or_default(),
        os,
        kube_proxy: first_line(&bins.kube_proxy.display().to_string(), &["--version"]),
        kube_apiserver: first_line(&bins.kube_apiserver.display().to_string(), &["--version"]),
        etcd: first_line(&bins.etcd.display().to_string(), &["--version"]),
        iptables: first_line("iptables", &["--version"]),
        nft: first_line("nft", &["--version"]),
        lb_agent: first_line(&agent.display().to_string(), &["--version"]),
        git: format!("{sha}{}", if dirty { " with uncommitted changes" } else { "" }),
        date: first_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics

pub fn median(v: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// Nearest-rank percentile.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[idx])
}

fn min_max(v: &[f64]) -> Option<(f64, f64)> {
    let v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    Some((
        v.iter().copied().fold(f64::INFINITY, f64::min),
        v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    ))
}

fn num(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// "median (min–max)".
fn spread(v: &[f64]) -> String {
    match (median(v), min_max(v)) {
        (Some(m), Some((lo, hi))) if v.len() > 1 => format!("{} ({}–{})", num(m), num(lo), num(hi)),
        (Some(m), _) => num(m),
        _ => "–".into(),
    }
}

fn opt_s(v: Option<f64>) -> String {
    match v {
        Some(s) if s < 1.0 => format!("{} ms", num(s * 1e3)),
        Some(s) => format!("{} s", num(s)),
        None => "did not finish".into(),
    }
}

fn fmt_n(n: u32) -> String {
    if n >= 1000 {
        format!("{},{:03}", n / 1000, n % 1000)
    } else {
        n.to_string()
    }
}

fn mib(kib: f64) -> String {
    format!("{:.1}", kib / 1024.0)
}

// ---------------------------------------------------------------------------------------------
// Accessors

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

    fn level(&self, n: u32) -> Option<&LatencyLevel> {
        self.latency.iter().find(|l| l.n == n)
    }

    /// Per-round values of one latency statistic.
    fn lat(&self, n: u32, c: Config, f: impl Fn(&super::crr::CrrResult) -> f64) -> Vec<f64> {
        self.level(n)
            .and_then(|l| l.runs.get(&c))
            .map(|runs| runs.iter().map(&f).collect())
            .unwrap_or_default()
    }

    fn p50(&self, n: u32, c: Config) -> Option<f64> {
        median(&self.lat(n, c, |r| r.p50_us))
    }

    fn max_n(&self) -> Option<u32> {
        self.levels().into_iter().max()
    }

    fn agent_memory(&self, n: u32) -> Option<&Memory> {
        self.memory
            .iter()
            .filter(|m| m.n == n && m.config.is_some_and(Config::is_agent))
            .max_by_key(|m| m.rss_kib)
    }

    /// The agent's first sync after a cold start with N Services in the API (it programs all of
    /// them at once); the larger of the two agents started at N.
    fn agent_full_sync_ms(&self, n: u32) -> Option<f64> {
        self.level(n)
            .into_iter()
            .flat_map(|l| l.cold.iter())
            .filter(|c| c.config.is_some_and(Config::is_agent))
            .filter_map(|c| c.agent_sync_ms.first().copied())
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
    }

    /// The agent's largest sync while N Services were created through the API.
    fn agent_largest_live_sync_ms(&self, n: u32) -> Option<f64> {
        self.programming
            .iter()
            .filter(|p| p.n == n && p.config.is_some_and(Config::is_agent))
            .flat_map(|p| p.agent_sync_ms.iter().copied())
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
    }
}

// ---------------------------------------------------------------------------------------------
// Markdown

/// The Service count the targets are stated at.
const TARGET_N: u32 = 10_000;

/// "10, 1,000 and 10,000 Services".
fn fmt_levels(levels: &[u32]) -> String {
    let names: Vec<String> = levels.iter().map(|&n| fmt_n(n)).collect();
    match names.split_last() {
        None => "no Services".into(),
        Some((last, [])) => format!("{last} Services"),
        Some((last, rest)) => format!("{} and {last} Services", rest.join(", ")),
    }
}

/// What kind of run the document shows, and on which N its verdicts are.
fn run_kind(r: &Results, levels: &[u32], max_n: u32) -> String {
    let kind = if r.quick { "quick run" } else { "run" };
    let what = format!(
        "{}{}",
        fmt_levels(levels),
        if r.quick { ", fewer rounds" } else { "" }
    );
    if max_n < TARGET_N {
        format!(
            "This is a **{kind}** ({what}): the targets are stated at {} Services, so the verdicts \
             below are on {}; `cargo xtask bench` (full) measures {}.",
            fmt_n(TARGET_N),
            fmt_n(max_n),
            fmt_n(TARGET_N)
        )
    } else if r.quick {
        format!("Quick run: {what}.")
    } else {
        format!("Full run: {what}.")
    }
}

pub fn markdown(r: &Results) -> String {
    let mut s = String::new();
    let levels = r.levels();
    let max_n = r.max_n().unwrap_or(0);
    let m = &r.machine;
    let _ = writeln!(
        s,
        "# Benchmarks: lb-agent side by side with kube-proxy and the no-balancer floor\n"
    );
    let _ = writeln!(
        s,
        "Generated by `{}` on {} from the measured values; do not edit by hand. {}\n",
        r.command,
        m.date,
        run_kind(r, &levels, max_n)
    );
    let _ = writeln!(s, "| | |\n|---|---|");
    for (k, v) in [
        (
            "machine",
            format!("{} × {} ({}), {}", m.cores, m.cpu, m.memory, m.os),
        ),
        ("kernel", m.kernel.clone()),
        ("kube-proxy", m.kube_proxy.clone()),
        ("kube-apiserver", m.kube_apiserver.clone()),
        ("etcd", m.etcd.clone()),
        ("iptables", m.iptables.clone()),
        ("nft", m.nft.clone()),
        ("lb-agent", format!("{} (git {})", m.lb_agent, m.git)),
        (
            "run",
            format!(
                "{} rounds × {} connections (after {} warm-up connections) per configuration and N; took {:.0} min",
                r.rounds,
                r.conns,
                r.warmup,
                r.duration_s / 60.0
            ),
        ),
    ] {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    s.push_str(METHOD);
    let _ = writeln!(
        s,
        "\nFlags (besides `--kubeconfig`; the agent also gets `--bpf-root` on a private bpffs and \
         `--cgroup-root` on a test cgroup):\n\n- kube-proxy: `{}` with `--proxy-mode=iptables` or \
         `nftables`; everything else at its defaults (min-sync-period 1 s).\n- lb-agent: `{}`; \
         everything else at its defaults (min-sync-period 100 ms; tc attached to every interface \
         that is up in the node namespace).\n",
        peers::kube_proxy_flags("MODE")[1..].join(" "),
        peers::agent_flags(r.backends_capacity).join(" ")
    );

    // Targets first: what a reader wants to know.
    s.push_str("## Targets\n\n");
    s.push_str(&targets(r));

    // (1) Connect latency.
    s.push_str("\n## 1. Connection setup latency to a ClusterIP (random Service per connection)\n\n");
    s.push_str(
        "connect() time in µs (SYN to SYN-ACK as the client sees it) and closed-loop connections \
         per second, single-threaded. Each cell is the median over rounds, with the min–max over \
         rounds in parentheses.\n\n![connect latency](bench/connect-latency.png)\n\n",
    );
    let loads: Vec<f64> = r
        .latency
        .iter()
        .flat_map(|l| l.round_load.iter().copied())
        .collect();
    if let Some((lo, hi)) = min_max(&loads) {
        let _ = writeln!(
            s,
            "The machine's 1-minute load average at the start of the rounds was {lo:.1}–{hi:.1} (the \
             benchmark's own client and server account for about 1; more means other work shared \
             the {} cores, and the tails are partly its).\n",
            m.cores
        );
    }
    for &n in &levels {
        let _ = writeln!(s, "### {} Services × 10 endpoints\n", fmt_n(n));
        s.push_str("| configuration | p50 µs | p90 µs | p99 µs | p99.9 µs | conn/s | p50 ÷ floor | errors |\n|---|---|---|---|---|---|---|---|\n");
        let floor = r.p50(n, Config::Direct);
        let mut left_out = Vec::new();
        for c in Config::ALL {
            let runs = r.lat(n, c, |x| x.p50_us);
            if runs.is_empty() {
                left_out.push(c.label());
                continue;
            }
            let errors: usize = r
                .level(n)
                .and_then(|l| l.runs.get(&c))
                .map(|v| v.iter().map(|x| x.errors).sum())
                .unwrap_or(0);
            let ratio = match (r.p50(n, c), floor) {
                (Some(a), Some(b)) => format!("{:.2}", a / b),
                _ => "–".into(),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {ratio} | {errors} |",
                c.label(),
                spread(&runs),
                spread(&r.lat(n, c, |x| x.p90_us)),
                spread(&r.lat(n, c, |x| x.p99_us)),
                spread(&r.lat(n, c, |x| x.p999_us)),
                spread(&r.lat(n, c, |x| x.conn_per_s)),
            );
        }
        if !left_out.is_empty() {
            let _ = writeln!(
                s,
                "\nNot measured at {} Services: {} (did not serve every Service within the cold-start \
                 timeout; see the problems at the end).",
                fmt_n(n),
                left_out.join(", ")
            );
        }
        s.push('\n');
    }
    s.push_str("### Ratios (median p50 and p99 of lb divided by each peer's; below 1 is faster)\n\n| | ");
    for &n in &levels {
        let _ = write!(s, "{} Services | ", fmt_n(n));
    }
    s.push_str("\n|---|");
    for _ in &levels {
        s.push_str("---|");
    }
    s.push('\n');
    for ours in [Config::LbSocket, Config::LbTc] {
        for peer in [Config::Direct, Config::Iptables, Config::Nftables] {
            let _ = write!(s, "| {} ÷ {} | ", ours.label(), peer.label());
            for &n in &levels {
                let q = |c: Config, f: fn(&super::crr::CrrResult) -> f64| median(&r.lat(n, c, f));
                let p50 = q(ours, |x| x.p50_us)
                    .zip(q(peer, |x| x.p50_us))
                    .map(|(a, b)| a / b);
                let p99 = q(ours, |x| x.p99_us)
                    .zip(q(peer, |x| x.p99_us))
                    .map(|(a, b)| a / b);
                match (p50, p99) {
                    (Some(a), Some(b)) => {
                        let _ = write!(s, "p50 {a:.2}, p99 {b:.2} | ");
                    }
                    _ => s.push_str("– | "),
                }
            }
            s.push('\n');
        }
    }
    s.push_str("\n### Growth with the number of Services (median p50, µs)\n\n| configuration | ");
    for &n in &levels {
        let _ = write!(s, "{} | ", fmt_n(n));
    }
    s.push_str("largest ÷ smallest |\n|---|");
    for _ in &levels {
        s.push_str("---|");
    }
    s.push_str("---|\n");
    for c in Config::ALL {
        let _ = write!(s, "| {} | ", c.label());
        let vals: Vec<Option<f64>> = levels.iter().map(|&n| r.p50(n, c)).collect();
        for v in &vals {
            let _ = write!(s, "{} | ", v.map(num).unwrap_or_else(|| "–".into()));
        }
        match (vals.first().copied().flatten(), vals.last().copied().flatten()) {
            (Some(a), Some(b)) => {
                let _ = writeln!(s, "{:.2} |", b / a);
            }
            _ => s.push_str("– |\n"),
        }
    }

    // In-stack cost of our programs (a diagnostic round with the kernel's run-time statistics).
    let in_stack: Vec<&LatencyLevel> = r.latency.iter().filter(|l| !l.in_stack.is_empty()).collect();
    if !in_stack.is_empty() {
        s.push_str(
            "\n### What our programs cost in the real stack\n\nAfter the timed rounds, each lb \
             configuration ran one more round with the kernel's BPF run-time statistics on \
             (`BPF_ENABLE_STATS`, for that round only: it adds ~20 ns to every run, so the timed \
             rounds run without it). Per program: the mean time of one run and the runs per \
             connection (SYN, ACK and RST from the client; SYN-ACK from the server; each crosses \
             the node's two interfaces). Unlike BPF_PROG_TEST_RUN (section 3), this includes the \
             cache misses of a real connection: the TCP stack runs between two program runs and \
             evicts the maps' lines.\n\n| N | configuration | program | ns per run | runs per connection | ns per connection |\n|---|---|---|---|---|---|\n",
        );
        for level in in_stack {
            for (config, costs) in &level.in_stack {
                for c in costs {
                    let _ = writeln!(
                        s,
                        "| {} | {} | `{}` | {} | {:.1} | {} |",
                        fmt_n(level.n),
                        config.label(),
                        c.program,
                        num(c.ns_per_run),
                        c.runs_per_conn,
                        num(c.ns_per_run * c.runs_per_conn)
                    );
                }
            }
        }
    }

    // (2) Programming time.
    s.push_str("\n## 2. Programming time\n\n![programming time](bench/programming-time.png)\n\n");
    s.push_str(
        "**Through the API, proxy running.** Each program runs alone on a fresh node with no \
         benchmark Service; N Services and their EndpointSlices are then created through the API \
         (8 requests in flight), and a probe in the client namespace polls the last Service every \
         2 ms; once it answers, every Service is connected to once (repeating the ones that fail) \
         to confirm all of them are served. Times are from the first create request. \"Syncs\" are \
         the program's own `kubeproxy_sync_proxy_rules_duration_seconds` histogram over the \
         period (count and total); for lb-agent the largest single sync from its log line \
         `data path programmed ... elapsed_ms`.\n\n",
    );
    s.push_str("| program | N | objects created in | last Service answers | all answer | syncs | time in syncs | largest agent sync |\n|---|---|---|---|---|---|---|---|\n");
    for p in &r.programming {
        let c = p.config.unwrap_or(Config::Direct);
        let largest = p
            .agent_sync_ms
            .iter()
            .copied()
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {}{} | {} | {} | {} |",
            c.program(),
            fmt_n(p.n),
            opt_s(Some(p.create_s)),
            opt_s(p.last_s),
            opt_s(p.all_s),
            if p.not_answering > 0 {
                format!(" ({} not answering)", p.not_answering)
            } else {
                String::new()
            },
            p.sync_count,
            opt_s(Some(p.sync_sum_s)),
            largest
                .map(|v| format!("{} ms", num(v)))
                .unwrap_or_else(|| "–".into()),
        );
    }
    s.push_str(
        "\n**Cold start.** Each configuration of section 1 was started on its fresh node with the N \
         Services already in the API (one after the other, the others idle): from the process start \
         to every Service answering (the API list, the program's first sync, and for kube-proxy \
         the time it waits for its informers). Both lb configurations run the same agent; they \
         differ only in where the client is. \"Syncs\" and \"time in syncs\" are the sync histogram \
         as above; \"agent syncs\" are the `elapsed_ms` of the agent's `data path programmed` lines, \
         which it logs for the syncs that changed something.\n\n",
    );
    s.push_str("| configuration | N | last Service answers | all answer | syncs | time in syncs | agent syncs (ms) |\n|---|---|---|---|---|---|---|\n");
    for l in &r.latency {
        for c in &l.cold {
            let cfg = c.config.unwrap_or(Config::Direct);
            if cfg == Config::Direct {
                continue;
            }
            let _ = writeln!(
                s,
                "| {} | {} | {} | {}{} | {} | {} | {} |",
                cfg.label(),
                fmt_n(c.n),
                opt_s(c.last_s),
                opt_s(c.all_s),
                if c.not_answering > 0 {
                    format!(" ({} not answering)", c.not_answering)
                } else {
                    String::new()
                },
                c.sync_count,
                opt_s(Some(c.sync_sum_s)),
                if cfg.is_agent() {
                    c.agent_sync_ms
                        .iter()
                        .map(|v| num(*v))
                        .collect::<Vec<_>>()
                        .join(", ")
                } else {
                    "–".into()
                }
            );
        }
    }

    // Change latency.
    if !r.changes.is_empty() {
        s.push_str("\n### One Service added, changed, removed on top of N\n\n");
        s.push_str(
            "Timed from the API call to the data path showing it: a probe in the client namespace \
             (in the agent's cgroup for lb-agent: the socket path) connects every 200 µs (2 ms \
             connect timeout while waiting for *served*, 20 ms while waiting for *not served*); \
             the time is when the deciding attempt's SYN left. *add*: the EndpointSlice exists already, the Service is created; *change*: the \
             Service's port goes from 80 to 81 (timed until :81 answers); *remove*: the Service is \
             deleted (timed until :81 stops answering). Before every timed call the program has been \
             idle for 1.5 s (no sync), so no call waits for a min-sync-period. *API watch event*: \
             the same API calls, timed until lb-bench's own watch on Services receives the event (the \
             API server's share, which every program pays first). p50 / p99 / max in ms.\n\n",
        );
        s.push_str("| program | N | reps | add | change | remove | API watch event | program's sync per change | failures |\n|---|---|---|---|---|---|---|---|---|\n");
        for c in &r.changes {
            let cfg = c.config.unwrap_or(Config::Direct);
            let trio = |v: &[f64]| match (percentile(v, 0.5), percentile(v, 0.99), min_max(v)) {
                (Some(a), Some(b), Some((_, mx))) => format!("{} / {} / {}", num(a), num(b), num(mx)),
                _ => "–".into(),
            };
            let own = if cfg.is_agent() {
                format!("{} (elapsed_ms from the log)", trio(&c.agent_sync_ms))
            } else if c.sync_count > 0.0 {
                format!(
                    "mean {} ms over {} syncs",
                    num(c.sync_sum_s / c.sync_count * 1e3),
                    c.sync_count
                )
            } else {
                "–".into()
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {own} | {} |",
                cfg.program(),
                fmt_n(c.n),
                c.add_ms.len().max(c.change_ms.len()).max(c.remove_ms.len()),
                trio(&c.add_ms),
                trio(&c.change_ms),
                trio(&c.remove_ms),
                trio(&c.api_watch_ms),
                c.failures
            );
        }
    }

    // (3) tc.
    s.push_str("\n## 3. tc program cost per packet (BPF_PROG_TEST_RUN)\n\n");
    s.push_str(TC_METHOD);
    if let Some(first) = r.tc.first() {
        s.push_str("| fixture | program |");
        for t in &r.tc {
            let _ = write!(
                s,
                " {} Svc: repeat 10⁶, ns | {} Svc: one call, ns |",
                fmt_n(t.n),
                fmt_n(t.n)
            );
        }
        s.push_str("\n|---|---|");
        for _ in &r.tc {
            s.push_str("---|---|");
        }
        s.push('\n');
        for (k, f) in first.fixtures.iter().enumerate() {
            let _ = write!(s, "| {} | `{}` |", f.name, f.program);
            for t in &r.tc {
                let g = &t.fixtures[k];
                let batched = if g.batched_ns.is_empty() {
                    "–".to_string()
                } else {
                    let (lo, _) = min_max(&g.batched_ns).unwrap_or_default();
                    format!(
                        "{} (min {})",
                        num(median(&g.batched_ns).unwrap_or(f64::NAN)),
                        num(lo)
                    )
                };
                let single = match (g.single_median_ns, g.single_corrected_ns) {
                    (Some(raw), Some(c)) => format!("{} ({} raw)", num(c), num(raw)),
                    _ => "–".into(),
                };
                let _ = write!(s, " {batched} | {single} |");
            }
            s.push('\n');
        }
        s.push('\n');
        for t in &r.tc {
            let _ = writeln!(
                s,
                "- {} Services: timer overhead of a one-call run, estimated and subtracted: {} ns.",
                fmt_n(t.n),
                num(t.single_overhead_ns)
            );
        }
    } else {
        s.push_str("Not measured in this run.\n");
    }

    // (4) Memory.
    s.push_str("\n## 4. Memory\n\n");
    s.push_str(
        "VmRSS and VmHWM from /proc/<pid>/status of the program (for kube-proxy this is the Go \
         process only, not the rules the kernel holds); BPF map memory is the `memlock` of every map \
         the agent holds (from /proc/<pid>/fdinfo).\n\n| program | N | when | VmRSS MiB | VmHWM MiB | BPF maps MiB |\n|---|---|---|---|---|---|\n",
    );
    for mm in &r.memory {
        let c = mm.config.unwrap_or(Config::Direct);
        let maps: u64 = mm.maps.iter().map(|m| m.memlock).sum();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            c.program(),
            fmt_n(mm.n),
            mm.when,
            mib(mm.rss_kib as f64),
            mib(mm.hwm_kib as f64),
            if c.is_agent() {
                format!("{:.1}", maps as f64 / 1048576.0)
            } else {
                "–".into()
            }
        );
    }
    if let Some(am) = r.agent_memory(max_n) {
        let _ = writeln!(
            s,
            "\nThe agent's maps at {} Services (capacities: defaults, except `--bpf-lb-map-max {}`). \
             `memlock` is what the kernel reports for the map: preallocated maps cost their whole \
             capacity, the others grow with their entries.\n\n| map | max entries | entries used | memlock MiB |\n|---|---|---|---|",
            fmt_n(max_n),
            r.backends_capacity
        );
        let mut maps: Vec<_> = am.maps.iter().collect();
        maps.sort_by(|a, b| a.name.cmp(&b.name));
        for mp in maps {
            let used = am
                .map_entries
                .get(&mp.name)
                .map(|v| format!("{v:.0}"))
                .unwrap_or_else(|| "–".into());
            let _ = writeln!(
                s,
                "| {} | {} | {used} | {:.2} |",
                mp.name,
                mp.max_entries,
                mp.memlock as f64 / 1048576.0,
            );
        }
    }
    // Growth per Service between the smallest and the largest N (cold starts, same flags).
    let min_n = levels.first().copied().unwrap_or(0);
    let cold = |c: Config, n: u32| {
        r.memory
            .iter()
            .find(|m| m.n == n && m.config == Some(c) && m.when == "cold start")
    };
    let mut lines = Vec::new();
    for c in Config::PROXIES {
        if let (Some(a), Some(b)) = (cold(c, min_n), cold(c, max_n))
            && max_n > min_n
        {
            let dn = f64::from(max_n - min_n);
            let drss = (b.rss_kib as f64 - a.rss_kib as f64) * 1024.0 / dn;
            let kernel = if c.is_agent() {
                let total = |m: &Memory| m.maps.iter().map(|x| x.memlock).sum::<u64>() as f64;
                let dk = (total(b) - total(a)) / dn;
                format!(
                    "; BPF maps {:.0} bytes per Service ({:.0} per endpoint)",
                    dk,
                    dk / 10.0
                )
            } else {
                "; the kernel's rules not measured".into()
            };
            lines.push(format!(
                "- {}: VmRSS {:.0} bytes per Service ({:.0} per endpoint){kernel}.",
                c.program(),
                drss,
                drss / 10.0
            ));
        }
    }
    if !lines.is_empty() {
        let _ = writeln!(
            s,
            "\nGrowth per Service (10 endpoints each) from {} to {} Services, cold starts:\n",
            fmt_n(min_n),
            fmt_n(max_n)
        );
        for l in lines {
            let _ = writeln!(s, "{l}");
        }
    }

    if !r.problems.is_empty() {
        s.push_str("\n## Problems met during this run\n\n");
        for p in &r.problems {
            let _ = writeln!(s, "- {p}");
        }
    }
    s.push_str(CAVEATS);
    s
}

const METHOD: &str = r#"
## How it is measured

Everything runs inside network namespaces and a test cgroup made for the run (nothing touches the
machine's interfaces, root cgroup or global sysctls). A real etcd and kube-apiserver run on
loopback; the Services are created through the API: Service *i* has the ClusterIP 10.96.1.0 + *i*,
port 80 → 8080, and one EndpointSlice with 10 ready endpoints (10.128.0.0 + 16*i* + *j* + 1).
Every configuration gets its own fresh topology (the reference's §7.2/§8(a)):

```
client netns              node netns (the proxy runs here)           backend netns
c0 10.240.0.2 ──veth── n0 10.240.0.1   n1 10.250.0.1 ──veth── b0 10.250.0.2
default via the node      10.128.0.0/12 via the backend              local 10.128.0.0/12 dev lo
                          10.96.0.0/16 via the backend               local 10.96.0.0/16 dev lo
                                                                     one accept-and-close server :8080
```

A connection to a ClusterIP that nothing translated is refused at once by the backend namespace
(the Service range is local there and nothing listens on the Service ports), so the probes below
see "not served yet" / "no longer served" without waiting for a timeout.

The client is inside the cluster CIDR given to every proxy (10.128.0.0/9), so it is an in-cluster
pod and no configuration masquerades. Configurations:

1. **direct (floor)**: the client connects to a random endpoint of a random Service; no proxy.
2. **kube-proxy iptables** / 3. **kube-proxy nftables**: the real kube-proxy in the node namespace.
4. **lb socket**: lb-agent in the node namespace; the client runs in the agent's `--cgroup-root`,
   so `connect()` is translated at the socket (the tc programs are attached too, and see the
   packets as non-service traffic).
5. **lb tc**: lb-agent in the node namespace; the client is outside its cgroup, so the SYN is
   translated by the tc program on the node's client-facing veth, and replies on the way back.

The client (a Rust port of the reference's `crr.c`, in lb-bench) makes sequential connections, each
to a uniformly random Service, and closes each with RST (SO_LINGER 0); the time of the blocking
`connect()` is recorded. It is pinned to CPU 1 and the server to CPU 0. Every round runs every
configuration once, in alternating order (forward, then backward: ABCDE EDCBA ...).
"#;

const TC_METHOD: &str = r#"The real programs run with BPF_PROG_TEST_RUN against private maps that the agent's own pipeline
programs with N Services × 10 endpoints (plus two helper Services). With repeat > 1 every run
after the first sees the packet the previous run rewrote, so:

- *repeat 10⁶* (median and min over batches): used only for packets that stay valid under their
  own rewrite. The non-service packet is left untouched. The established flow uses a two-cycle:
  Service A (VIP a:80) has the single endpoint b:80 and Service B (VIP b:80) the endpoint a:80;
  with both flows established, c:p → a:80 becomes c:p → b:80 and then exactly the original packet
  again (checked byte for byte first). Every run is thus a conntrack hit plus a DNAT. The reply
  (egress reverse NAT) cycles the same way.
- *one call*: the packet is copied in afresh by every syscall, so each call is a true first run (a
  SYN is a new flow: new source port each call). The median over the calls is shown after
  subtracting the kernel's timer overhead around one run, estimated as (non-service packet, one
  call) − (non-service packet, repeat 10⁶). The raw value is in parentheses.

No empty program can be loaded here to subtract a harness baseline; the non-service packet is an
upper bound of it (the reference measured an empty tc program at 26 ns/run on this VM).

"#;

const CAVEATS: &str = r#"
## Caveats

- A 2-vCPU VM is noisy; the spread over rounds is shown with every latency. Single-connection
  latencies include the whole path through three namespaces (two veth hops each way).
- kube-proxy's and lb-agent's periodic resyncs are set to 1 h so that no idle program re-syncs
  while another configuration is measured; their min-sync-periods stay at the defaults.
- The programming times through the API include the API server's own work (on the same two
  cores), which dominates at 10,000 Services; the programs' own sync durations are shown beside.
- IPVS cannot be measured on this kernel (`CONFIG_IP_VS` is not set).
"#;

// ---------------------------------------------------------------------------------------------
// Targets

fn verdict(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "**met**",
        Some(false) => "**not met**",
        None => "**not measured**",
    }
}

fn targets(r: &Results) -> String {
    let mut s = String::new();
    let max_n = r.max_n().unwrap_or(0);
    let min_n = r.levels().into_iter().min().unwrap_or(0);
    let at = if max_n < TARGET_N {
        format!(
            "{} Services ({}; the target is stated at {})",
            fmt_n(max_n),
            if r.quick {
                "quick run"
            } else {
                "this run's largest N"
            },
            fmt_n(TARGET_N)
        )
    } else {
        format!("{} Services", fmt_n(max_n))
    };
    s.push_str("| target | measured | verdict |\n|---|---|---|\n");

    // 1. Socket path vs floor.
    let sock = r.p50(max_n, Config::LbSocket);
    let floor = r.p50(max_n, Config::Direct);
    let sock_small = r.p50(min_n, Config::LbSocket);
    let floor_small = r.p50(min_n, Config::Direct);
    let ratio = sock.zip(floor).map(|(a, b)| a / b);
    let growth = sock.zip(sock_small).map(|(a, b)| a / b);
    let floor_growth = floor.zip(floor_small).map(|(a, b)| a / b);
    let ok1 = ratio.map(|x| x <= 1.05);
    let ok1b = growth.zip(floor_growth).map(|(g, f)| g <= f * 1.05);
    let _ = writeln!(
        s,
        "| socket path p50 connect latency within 5% of the floor at {at} | {} µs vs floor {} µs: ×{} | {} |",
        sock.map(num).unwrap_or_else(|| "–".into()),
        floor.map(num).unwrap_or_else(|| "–".into()),
        ratio.map(|x| format!("{x:.3}")).unwrap_or_else(|| "–".into()),
        verdict(ok1)
    );
    let _ = writeln!(
        s,
        "| socket path: no growth with the number of Services | p50 ×{} from {} to {} Services (floor ×{}) | {} |",
        growth.map(|x| format!("{x:.3}")).unwrap_or_else(|| "–".into()),
        fmt_n(min_n),
        fmt_n(max_n),
        floor_growth
            .map(|x| format!("{x:.3}"))
            .unwrap_or_else(|| "–".into()),
        verdict(ok1b)
    );

    // 2. Programming.
    let full = r.agent_full_sync_ms(max_n);
    let live = r.agent_largest_live_sync_ms(max_n);
    let ok2 = full.map(|ms| ms < 1000.0);
    let _ = writeln!(
        s,
        "| programming {} Services × 10 endpoints in under 1 s (the agent's sync duration) | the sync that programs all of them after a start: {}{} | {} |",
        fmt_n(max_n),
        full.map(|v| format!("{} ms", num(v)))
            .unwrap_or_else(|| "–".into()),
        live.map(|v| format!(
            " (largest sync while they were created through the API: {} ms)",
            num(v)
        ))
        .unwrap_or_default(),
        verdict(ok2)
    );

    // 3. Change latency.
    let ch = r
        .changes
        .iter()
        .find(|c| c.config.is_some_and(Config::is_agent) && c.n == max_n);
    let all: Vec<f64> = ch
        .map(|c| {
            c.add_ms
                .iter()
                .chain(&c.change_ms)
                .chain(&c.remove_ms)
                .copied()
                .collect()
        })
        .unwrap_or_default();
    let p99 = percentile(&all, 0.99);
    let own99 = ch.and_then(|c| percentile(&c.agent_sync_ms, 0.99));
    let api50 = ch.and_then(|c| percentile(&c.api_watch_ms, 0.5));
    let api99 = ch.and_then(|c| percentile(&c.api_watch_ms, 0.99));
    let ok3 = p99.map(|v| v < 5.0);
    let _ = writeln!(
        s,
        "| one Service change visible in the data path in under 5 ms p99 at {at} | p99 {} over {} changes (API call to data path); the agent's own sync p99 {} | {} |",
        p99.map(|v| format!("{} ms", num(v)))
            .unwrap_or_else(|| "–".into()),
        all.len(),
        own99
            .map(|v| format!("{} ms", num(v)))
            .unwrap_or_else(|| "–".into()),
        verdict(ok3)
    );

    // 4. tc established.
    let tc = r.tc.iter().max_by_key(|t| t.n);
    let est = tc.and_then(|t| t.fixtures.iter().find(|f| f.name.starts_with("established")));
    let est_ns = est.and_then(|f| median(&f.batched_ns).or(f.single_corrected_ns));
    let ok4 = est_ns.map(|v| v < 150.0);
    let _ = writeln!(
        s,
        "| tc path under 150 ns per packet for an established flow | {} ns at {} Services (BPF_PROG_TEST_RUN, includes the harness) | {} |",
        est_ns.map(num).unwrap_or_else(|| "–".into()),
        tc.map(|t| fmt_n(t.n)).unwrap_or_else(|| "–".into()),
        verdict(ok4)
    );

    // 5. RSS.
    let am = r.agent_memory(max_n);
    let ok5 = am.map(|m| (m.rss_kib as f64) < 100.0 * 1024.0);
    let _ = writeln!(
        s,
        "| agent RSS under 100 MiB at {at} | VmRSS {} MiB (VmHWM {} MiB) | {} |",
        am.map(|m| mib(m.rss_kib as f64)).unwrap_or_else(|| "–".into()),
        am.map(|m| mib(m.hwm_kib as f64)).unwrap_or_else(|| "–".into()),
        verdict(ok5)
    );

    // Explanations for what is missed.
    let mut why = Vec::new();
    if ok1 == Some(false) {
        let level = r.latency.iter().find(|l| l.n == max_n);
        let cost = |program: &str| -> Option<(f64, f64)> {
            level?
                .in_stack
                .get(&Config::LbSocket)?
                .iter()
                .find(|c| c.program == program)
                .map(|c| (c.ns_per_run, c.ns_per_run * c.runs_per_conn))
        };
        let connect4 = cost("lb_connect4");
        let tc: Option<f64> = match (cost("lb_tc_ingress"), cost("lb_tc_egress")) {
            (Some(i), Some(e)) => Some(i.1 + e.1),
            _ => None,
        };
        let isolated =
            r.tc.iter()
                .max_by_key(|t| t.n)
                .and_then(|t| t.fixtures.iter().find(|f| f.name.starts_with("socket connect")))
                .and_then(|f| f.single_corrected_ns);
        why.push(format!(
            "Socket path vs floor: {} µs above the floor at p50. The floor runs no program; the \
             socket path runs connect4 once per connection ({} ns in the real stack; {} ns for the \
             code in BPF_PROG_TEST_RUN, section 3: three hash lookups, each a likely cache miss \
             in a real connection, and the reverse-NAT record for getpeername, which a real \
             connect keeps in socket storage and the test harness, having no socket, in the LRU \
             map), and every \
             packet of the connection also crosses the tc programs on the node's two interfaces as \
             non-service traffic ({} ns per connection in all, see *What our programs cost in the \
             real stack*). The gap is these program runs, not the lookups' size: the growth with \
             the number of Services stays with the floor's. Closing it means fewer cache lines per \
             connect (the backend address in the slot entry) and a cheaper non-service path at \
             tc; see docs/architecture.md.",
            sock.zip(floor)
                .map(|(a, b)| num(a - b))
                .unwrap_or_else(|| "–".into()),
            connect4.map(|c| num(c.0)).unwrap_or_else(|| "–".into()),
            isolated.map(num).unwrap_or_else(|| "–".into()),
            tc.map(num).unwrap_or_else(|| "–".into()),
        ));
    }
    if ok1b == Some(false) {
        why.push(
            "Socket path growth: the p50 grew more than the floor's between the smallest and the \
                  largest Service count (see the growth table); a hash lookup does not depend on the \
                  number of entries, so cache and TLB misses over larger maps are the likely cause."
                .to_string(),
        );
    }
    if ok2 == Some(false) {
        why.push(format!(
            "Programming: the agent's sync that programs {} Services took {}; it computes the \
             desired state from every Service and EndpointSlice and writes every map entry (one \
             bpf() syscall per entry).",
            fmt_n(max_n),
            full.map(|v| format!("{} ms", num(v))).unwrap_or_default()
        ));
    }
    if let (Some(l), Some(f)) = (live, full)
        && l > 2.0 * f
    {
        why.push(format!(
            "While the {} Services were created through the API, one of the agent's syncs took up to \
             {} ms, more than the {} ms of the sync that programs all of them after a start: those \
             syncs follow each other at the min-sync-period (100 ms) on the same {} cores as the API \
             server, which is creating the objects meanwhile.",
            fmt_n(max_n),
            num(l),
            num(f),
            r.machine.cores
        ));
    }
    if ok3 == Some(false) {
        why.push(format!(
            "Change latency: p99 {} from the API call to the data path, on top of {} Services. The \
             API server alone takes {} p50 / {} p99 to deliver the watch event of the same calls to a \
             client (persisting in etcd, the watch cache, the HTTP stream; on the same {} cores), \
             which no program can avoid; the agent's own sync is {} at p99. What remains is the \
             agent's event handling before its sync starts and the probe's 200 µs polling. Measured \
             from the moment a watch client receives the event (lb-bench's own watch, standing in \
             for the agent's), the target is {}.",
            p99.map(|v| format!("{} ms", num(v))).unwrap_or_default(),
            fmt_n(max_n),
            api50
                .map(|v| format!("{} ms", num(v)))
                .unwrap_or_else(|| "?".into()),
            api99
                .map(|v| format!("{} ms", num(v)))
                .unwrap_or_else(|| "?".into()),
            r.machine.cores,
            own99
                .map(|v| format!("{} ms", num(v)))
                .unwrap_or_else(|| "unknown".into()),
            match ch.map(|c| percentile(&c.after_watch_ms, 0.99)) {
                Some(Some(v)) if v < 5.0 =>
                    format!("met (p99 {} ms from the watch event to the data path)", num(v)),
                Some(Some(v)) => format!(
                    "still missed (p99 {} ms from the watch event to the data path)",
                    num(v)
                ),
                _ => "not measurable here".into(),
            }
        ));
    }
    if ok4 == Some(false) {
        why.push(format!(
            "tc established flow: {} ns per packet including the BPF_PROG_TEST_RUN harness (an empty \
             program costs 26 ns per run on this VM per the reference).",
            est_ns.map(num).unwrap_or_default()
        ));
    }
    if ok5 == Some(false) {
        why.push("Agent RSS: see the memory section for the userspace bytes per Service.".to_string());
    }
    if !why.is_empty() {
        s.push_str("\nWhy the missed targets are missed (from the numbers of this run):\n\n");
        for w in why {
            let _ = writeln!(s, "- {w}");
        }
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Plots

/// One gnuplot line colour per configuration, the same in every plot.
fn color(c: Config) -> usize {
    Config::ALL.iter().position(|&x| x == c).unwrap_or(0) + 1
}

pub fn plots(r: &Results, out_dir: &Path, work: &Path) -> Result<(), String> {
    fs::create_dir_all(out_dir).map_err(|e| e.to_string())?;
    let levels = r.levels();
    let lo = levels.iter().copied().min().unwrap_or(10) as f64 / 2.0;
    let hi = levels.iter().copied().max().unwrap_or(10_000) as f64 * 2.0;
    // Latency: one data block per configuration, columns N p50 p99.
    let mut lat = String::new();
    for c in Config::ALL {
        let _ = writeln!(lat, "# {}", c.label());
        for &n in &levels {
            if let (Some(p50), Some(p99)) = (r.p50(n, c), median(&r.lat(n, c, |x| x.p99_us))) {
                let _ = writeln!(lat, "{n} {p50} {p99}");
            }
        }
        lat.push_str("\n\n");
    }
    let lat_file = work.join("latency.dat");
    fs::write(&lat_file, lat).map_err(|e| e.to_string())?;
    let mut plot = format!(
        "set terminal pngcairo size 1100,480 font 'sans,10'\nset output '{}'\n\
         set multiplot layout 1,2 title 'Connect latency to a ClusterIP (median over rounds)'\n\
         set logscale x\nset xrange [{lo}:{hi}]\nset xlabel 'Services (10 endpoints each)'\n\
         set key top left\nset grid\nset xtics ({})\nset yrange [0:*]\n",
        out_dir.join("connect-latency.png").display(),
        levels
            .iter()
            .map(|n| format!("'{}' {n}", fmt_n(*n)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (title, col) in [("p50", 2), ("p99", 3)] {
        let _ = write!(plot, "set title '{title}'\nset ylabel 'µs'\nplot ");
        let parts: Vec<String> = Config::ALL
            .iter()
            .enumerate()
            .filter(|&(_, &c)| levels.iter().any(|&n| r.p50(n, c).is_some()))
            .map(|(k, &c)| {
                format!(
                    "'{}' index {k} using 1:{col} with linespoints lw 2 lc {} title '{}'",
                    lat_file.display(),
                    color(c),
                    c.label()
                )
            })
            .collect();
        plot.push_str(&parts.join(", "));
        plot.push('\n');
    }
    plot.push_str("unset multiplot\n");

    // Programming: through the API (all answering) and cold start, per program.
    let mut prog = String::new();
    let mut blocks = Vec::new();
    for c in Config::PROXIES {
        let rows: Vec<(u32, f64)> = r
            .programming
            .iter()
            .filter(|p| p.config == Some(c))
            .filter_map(|p| Some((p.n, p.all_s?)))
            .collect();
        let cold: Vec<(u32, f64)> = r
            .latency
            .iter()
            .flat_map(|l| l.cold.iter())
            .filter(|x| x.config == Some(c))
            .filter_map(|x| Some((x.n, x.all_s?)))
            .collect();
        for (what, rows) in [("created through the API", rows), ("cold start", cold)] {
            let _ = writeln!(prog, "# {} {what}", c.program());
            for (n, v) in &rows {
                let _ = writeln!(prog, "{n} {v}");
            }
            prog.push_str("\n\n");
            blocks.push((format!("{}: {what}", c.program()), rows.is_empty(), color(c)));
        }
    }
    let prog_file = work.join("programming.dat");
    fs::write(&prog_file, prog).map_err(|e| e.to_string())?;
    let _ = write!(
        plot,
        "reset\nset terminal pngcairo size 900,580 font 'sans,10'\nset output '{}'\n\
         set title 'Programming time: until every Service answers through the data path'\n\
         set logscale xy\nset xrange [{lo}:{hi}]\nset xlabel 'Services (10 endpoints each)'\n\
         set ylabel 'seconds'\nset key below\nset bmargin 8\nset grid\nset xtics ({})\nplot ",
        out_dir.join("programming-time.png").display(),
        levels
            .iter()
            .map(|n| format!("'{}' {n}", fmt_n(*n)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let parts: Vec<String> = blocks
        .iter()
        .enumerate()
        .filter(|(_, (_, empty, _))| !empty)
        .map(|(k, (title, _, lc))| {
            format!(
                "'{}' index {k} using 1:2 with linespoints lw 2 lc {lc} dt {} title '{title}'",
                prog_file.display(),
                if k % 2 == 0 { 1 } else { 2 }
            )
        })
        .collect();
    plot.push_str(&parts.join(", "));
    plot.push('\n');
    let script = work.join("plots.gp");
    fs::write(&script, plot).map_err(|e| e.to_string())?;
    let out = Command::new("gnuplot")
        .arg(&script)
        .output()
        .map_err(|e| format!("gnuplot: {e} (install gnuplot-nox; `cargo xtask setup` does)"))?;
    if !out.status.success() {
        return Err(format!(
            "gnuplot failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// Compact text tables for the terminal.
pub fn summary(r: &Results) -> String {
    let mut s = String::new();
    let levels = r.levels();
    let _ = writeln!(
        s,
        "\n==== connect latency p50 / p99 µs (median over {} rounds) and conn/s ====",
        r.rounds
    );
    for &n in &levels {
        let _ = writeln!(s, "N = {n}");
        for c in Config::ALL {
            let _ = writeln!(
                s,
                "  {:<22} p50 {:>8}  p99 {:>8}  p99.9 {:>8}  {:>8} conn/s",
                c.label(),
                median(&r.lat(n, c, |x| x.p50_us)).map(num).unwrap_or_default(),
                median(&r.lat(n, c, |x| x.p99_us)).map(num).unwrap_or_default(),
                median(&r.lat(n, c, |x| x.p999_us)).map(num).unwrap_or_default(),
                median(&r.lat(n, c, |x| x.conn_per_s))
                    .map(num)
                    .unwrap_or_default(),
            );
        }
    }
    let _ = writeln!(s, "==== programming through the API ====");
    for p in &r.programming {
        let _ = writeln!(
            s,
            "  {:<20} N={:<6} created {:>8}  last answers {:>10}  all answer {:>10}",
            p.config.map(Config::program).unwrap_or(""),
            p.n,
            opt_s(Some(p.create_s)),
            opt_s(p.last_s),
            opt_s(p.all_s)
        );
    }
    let _ = writeln!(s, "==== one change on top of N (p50 / p99 ms) ====");
    for c in &r.changes {
        let f = |v: &[f64]| {
            format!(
                "{} / {}",
                percentile(v, 0.5).map(num).unwrap_or_default(),
                percentile(v, 0.99).map(num).unwrap_or_default()
            )
        };
        let _ = writeln!(
            s,
            "  {:<20} N={:<6} add {}  change {}  remove {}",
            c.config.map(Config::program).unwrap_or(""),
            c.n,
            f(&c.add_ms),
            f(&c.change_ms),
            f(&c.remove_ms)
        );
    }
    let _ = writeln!(s, "==== tc ns/packet ====");
    for t in &r.tc {
        for f in &t.fixtures {
            let _ = writeln!(
                s,
                "  N={:<6} {:<75} repeat 1e6: {:>6}  one call: {:>6}",
                t.n,
                f.name,
                median(&f.batched_ns).map(num).unwrap_or_else(|| "–".into()),
                f.single_corrected_ns.map(num).unwrap_or_else(|| "–".into())
            );
        }
    }
    let _ = writeln!(s, "==== memory ====");
    for m in &r.memory {
        let _ = writeln!(
            s,
            "  {:<20} N={:<6} {:<36} VmRSS {:>7} MiB  VmHWM {:>7} MiB  maps {:>7} MiB",
            m.config.map(Config::program).unwrap_or(""),
            m.n,
            m.when,
            mib(m.rss_kib as f64),
            mib(m.hwm_kib as f64),
            mib(m.maps.iter().map(|x| x.memlock).sum::<u64>() as f64 / 1024.0)
        );
    }
    s.push_str("==== targets ====\n");
    s.push_str(&targets(r));
    s
}
