//! The configurations compared, each run on its own fresh topology: nothing (the floor), the real
//! kube-proxy in iptables and in nftables mode, lb-agent (socket path and tc path) and the real
//! cilium-agent as a kube-proxy replacement (socket LB and its tc path), when its bundle is
//! built (`LB_CILIUM_DIR`, see [`cilium`]).

use std::{
    collections::BTreeMap,
    fs,
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use lb_tests::{
    cgroup::Cgroup,
    process::{Place, Proc},
};
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use serde::{Deserialize, Serialize};

use super::{
    api, cilium,
    crr::now_ns,
    topo::{self, Topo},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Config {
    Direct,
    Iptables,
    /// kube-proxy in iptables mode on the legacy (x_tables) backend: `iptables` and friends are
    /// the `*-legacy` binaries (a PATH of symlinks, [`legacy_iptables_dir`]).
    IptablesLegacy,
    Nftables,
    LbSocket,
    LbTc,
    CiliumSocket,
    CiliumTc,
}

impl Config {
    pub const ALL: [Config; 8] = [
        Config::Direct,
        Config::Iptables,
        Config::IptablesLegacy,
        Config::Nftables,
        Config::LbSocket,
        Config::LbTc,
        Config::CiliumSocket,
        Config::CiliumTc,
    ];
    /// The programs that program something (measured for programming time and memory).
    pub const PROXIES: [Config; 5] = [
        Config::LbSocket,
        Config::Iptables,
        Config::IptablesLegacy,
        Config::Nftables,
        Config::CiliumSocket,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Config::Direct => "direct (floor)",
            Config::Iptables => "kube-proxy iptables",
            Config::IptablesLegacy => "kube-proxy iptables-legacy",
            Config::Nftables => "kube-proxy nftables",
            Config::LbSocket => "lb socket",
            Config::LbTc => "lb tc",
            Config::CiliumSocket => "cilium socket",
            Config::CiliumTc => "cilium tc",
        }
    }

    /// The name `--configs` takes.
    pub fn arg(self) -> &'static str {
        match self {
            Config::Direct => "direct",
            Config::Iptables => "iptables",
            Config::IptablesLegacy => "iptables-legacy",
            Config::Nftables => "nftables",
            Config::LbSocket => "lb-socket",
            Config::LbTc => "lb-tc",
            Config::CiliumSocket => "cilium-socket",
            Config::CiliumTc => "cilium-tc",
        }
    }

    pub fn from_arg(arg: &str) -> Option<Config> {
        Config::ALL.into_iter().find(|c| c.arg() == arg)
    }

    /// The program's name in the programming/memory tables.
    pub fn program(self) -> &'static str {
        match self {
            Config::Direct => "-",
            Config::Iptables => "kube-proxy iptables",
            Config::IptablesLegacy => "kube-proxy iptables-legacy",
            Config::Nftables => "kube-proxy nftables",
            Config::LbSocket | Config::LbTc => "lb-agent",
            Config::CiliumSocket | Config::CiliumTc => "cilium-agent",
        }
    }

    pub fn is_agent(self) -> bool {
        matches!(self, Config::LbSocket | Config::LbTc)
    }

    pub fn is_cilium(self) -> bool {
        matches!(self, Config::CiliumSocket | Config::CiliumTc)
    }

    /// A socket path: the client runs in the cgroup the proxy's socket programs hold.
    pub fn is_socket(self) -> bool {
        matches!(self, Config::LbSocket | Config::CiliumSocket)
    }

    /// Runs a BPF data path (an lb-agent or a cilium-agent): gets a cgroup and a bpffs.
    pub fn is_bpf(self) -> bool {
        self.is_agent() || self.is_cilium()
    }

    pub fn is_kube_proxy(self) -> bool {
        matches!(self, Config::Iptables | Config::IptablesLegacy | Config::Nftables)
    }
}

/// A directory whose `iptables`, `iptables-save`, `iptables-restore` and their `ip6tables`
/// twins are the legacy (x_tables) binaries, to put first in kube-proxy's PATH (as the
/// kube-proxy image's iptables-wrapper does on a node whose rules are legacy); None when the
/// machine has no `iptables-legacy`. The machine's own `iptables` is iptables-nft here, whose
/// `iptables-restore` of 10,000 Services' rules takes longer than the run allows.
pub fn legacy_iptables_dir() -> Option<PathBuf> {
    let sbin = ["/usr/sbin", "/sbin", "/usr/bin"]
        .into_iter()
        .map(Path::new)
        .find(|d| d.join("iptables-legacy").exists())?;
    let dir = super::workspace_root().join("target/bench/iptables-legacy");
    fs::create_dir_all(&dir).ok()?;
    for family in ["iptables", "ip6tables"] {
        for suffix in ["", "-save", "-restore"] {
            let link = dir.join(format!("{family}{suffix}"));
            let target = sbin.join(format!("{family}-legacy{suffix}"));
            if !target.exists() {
                return None;
            }
            let _ = fs::remove_file(&link);
            std::os::unix::fs::symlink(&target, &link).ok()?;
        }
    }
    Some(dir)
}

/// Flags every peer ran with (besides kubeconfig, node name, cgroup and bpffs paths), for the doc.
/// kube-proxy runs dual-stack by itself wherever ip6tables works (iptables mode) or always
/// (nftables mode, the nft CLI serves both families) and IPv6 is enabled, IPv4 primary (the
/// Node's first InternalIP); `--cluster-cidr` with one CIDR per family gives its IPv6 proxier a
/// local-traffic detector, so the IPv6 client is in-cluster (not masqueraded) as the IPv4 one.
pub fn kube_proxy_flags(mode: &str) -> Vec<String> {
    vec![
        format!("--proxy-mode={mode}"),
        format!("--hostname-override={}", api::NODE),
        format!("--cluster-cidr={}", topo::cluster_cidrs()),
        "--conntrack-max-per-core=0".into(),
        "--conntrack-tcp-timeout-established=0".into(),
        "--conntrack-tcp-timeout-close-wait=0".into(),
        "--metrics-bind-address=127.0.0.1:10249".into(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
        "--iptables-sync-period=1h".into(),
        "--oom-score-adj=0".into(),
        // The size of every sync in its log ("Reloading service ... data"), as many clusters run it.
        "--v=2".into(),
    ]
}

/// `LB_BENCH_AGENT_FLAGS` (space-separated) adds flags to the agent's, for experiments by hand
/// (e.g. `--no-tc`); the report lists them with the rest.
pub fn agent_flags(backends_capacity: u32, services_capacity: u32) -> Vec<String> {
    let mut flags = vec![
        format!("--hostname-override={}", api::NODE),
        format!("--cluster-cidr={}", topo::cluster_cidrs()),
        "--metrics-bind-address=127.0.0.1:10249".into(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
        "--sync-period=1h".into(),
        format!("--bpf-lb-map-max={backends_capacity}"),
    ];
    // Named only where a level needs more than the default (above 10,000 Services).
    if services_capacity > lb_common::catalog::capacity::SERVICES {
        flags.push(format!("--bpf-lb-service-map-max={services_capacity}"));
    }
    if let Ok(extra) = std::env::var("LB_BENCH_AGENT_FLAGS") {
        flags.extend(extra.split_whitespace().map(str::to_owned));
    }
    flags
}

/// A private bpffs mount for one agent (its own name space of pins), unmounted on drop.
pub struct BpfMount {
    dir: PathBuf,
}

impl BpfMount {
    fn new() -> BpfMount {
        // Named like the tests' bpffs mounts, so a killed run's are swept (`lb_tests::sweep`).
        let dir = std::env::temp_dir().join(lb_tests::unique_name("lbbpffs"));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        mount(Some("bpf"), &dir, Some("bpf"), MsFlags::empty(), None::<&str>)
            .unwrap_or_else(|e| panic!("mount bpffs on {}: {e}", dir.display()));
        BpfMount { dir }
    }
}

impl Drop for BpfMount {
    fn drop(&mut self) {
        let _ = umount2(&self.dir, MntFlags::MNT_DETACH);
        let _ = fs::remove_dir(&self.dir);
    }
}

/// Log lines with the monotonic time they were read.
type Log = Arc<Mutex<Vec<(u64, String)>>>;

/// One configuration: its topology and, except for the floor, the proxy in the node namespace.
pub struct Peer {
    pub config: Config,
    // Drop order: the process, then its cgroup and pins, then the namespaces.
    proc: Option<Proc>,
    pub cgroup: Option<Cgroup>,
    _bpf: Option<BpfMount>,
    /// cilium-agent's state and run directories.
    _state: Option<tempfile::TempDir>,
    pub topo: Topo,
    log: Log,
    pub launched_ns: u64,
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn collect(reader: impl std::io::Read + Send + 'static, log: Log, tag: &'static str) {
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines().map_while(Result::ok) {
            let line = strip_ansi(&line);
            if std::env::var_os("LB_BENCH_VERBOSE").is_some() {
                eprintln!("[{tag}] {line}");
            }
            log.lock().expect("log").push((now_ns(), line));
        }
    });
}

impl Peer {
    /// A fresh topology; the proxy is started by [`Peer::launch`].
    pub fn new(config: Config, api_addr: SocketAddr) -> Peer {
        Peer {
            config,
            proc: None,
            cgroup: config.is_bpf().then(|| Cgroup::new("lbb")),
            _bpf: None,
            _state: None,
            topo: Topo::new(api_addr),
            log: Arc::new(Mutex::new(Vec::new())),
            launched_ns: 0,
        }
    }

    /// Where the measuring client runs: in the agent's cgroup for the socket path only.
    pub fn client(&self) -> Place<'_> {
        match &self.cgroup {
            Some(cg) if self.config.is_socket() => Place::new(&self.topo.client, cg),
            _ => Place::netns(&self.topo.client),
        }
    }

    /// Starts the proxy (nothing for the floor).
    pub fn launch(&mut self, kubeconfig: &Path, kube_proxy: &Path, opts: &super::Options) {
        self.launched_ns = now_ns();
        let mut cmd = match self.config {
            Config::Direct => return,
            Config::Iptables | Config::IptablesLegacy | Config::Nftables => {
                let mode = if self.config == Config::Nftables {
                    "nftables"
                } else {
                    "iptables"
                };
                let mut cmd = Command::new(kube_proxy);
                cmd.arg(format!("--kubeconfig={}", kubeconfig.display()))
                    .args(kube_proxy_flags(mode));
                if self.config == Config::IptablesLegacy {
                    let dir = legacy_iptables_dir()
                        .expect("iptables-legacy (the configuration is run only where it is)");
                    let path = std::env::var("PATH").unwrap_or_default();
                    cmd.env("PATH", format!("{}:{path}", dir.display()));
                }
                cmd
            }
            Config::LbSocket | Config::LbTc => {
                let bpf = BpfMount::new();
                let mut cmd = Command::new(super::agent_bin());
                cmd.arg("--kubeconfig")
                    .arg(kubeconfig)
                    .arg("--bpf-root")
                    .arg(bpf.dir.join("lb"))
                    .arg("--cgroup-root")
                    .arg(self.cgroup.as_ref().expect("agent cgroup").path())
                    .args(agent_flags(opts.backends_capacity, opts.services_capacity))
                    .env("RUST_LOG", "info")
                    .env("NO_COLOR", "1");
                self._bpf = Some(bpf);
                cmd
            }
            Config::CiliumSocket | Config::CiliumTc => {
                let bpf = BpfMount::new();
                let cgroup = self.cgroup.as_ref().expect("cilium cgroup").path();
                let state = tempfile::Builder::new()
                    .prefix("lb-bench-cilium-")
                    .tempdir()
                    .expect("cilium state directory");
                let cmd = cilium::command(kubeconfig, &bpf.dir, cgroup, state.path(), opts.cilium_map_max());
                self._bpf = Some(bpf);
                self._state = Some(state);
                cmd
            }
        };
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        Place::netns(&self.topo.node).apply(&mut cmd);
        let mut proc = Proc::spawn_command(cmd);
        let tag = match self.config {
            Config::Iptables => "kube-proxy-ipt",
            Config::IptablesLegacy => "kube-proxy-ipt-legacy",
            Config::Nftables => "kube-proxy-nft",
            Config::CiliumSocket | Config::CiliumTc => "cilium",
            _ => "lb-agent",
        };
        collect(
            proc.child_mut().stdout.take().expect("piped"),
            self.log.clone(),
            tag,
        );
        collect(
            proc.child_mut().stderr.take().expect("piped"),
            self.log.clone(),
            tag,
        );
        self.proc = Some(proc);
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    pub fn running(&mut self) -> bool {
        self.proc.as_mut().is_none_or(Proc::running)
    }

    pub fn log_text(&self) -> String {
        let log = self.log.lock().expect("log");
        let start = log.len().saturating_sub(40);
        log[start..]
            .iter()
            .map(|(_, l)| l.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The proxy's /metrics (kube-proxy's names; the agent keeps them; Cilium's own).
    pub fn metrics(&self) -> Option<Metrics> {
        let addr = match self.config {
            Config::Direct => return None,
            Config::CiliumSocket | Config::CiliumTc => cilium::METRICS_ADDR,
            _ => "127.0.0.1:10249",
        };
        self.topo.http_get(addr, "/metrics").map(|t| Metrics::parse(&t))
    }

    /// kube-proxy's /configz (the effective configuration), for the record.
    pub fn configz(&self) -> Option<String> {
        self.topo.http_get("127.0.0.1:10249", "/configz")
    }

    /// Number of syncs so far: the program's sync histogram count (the agent keeps kube-proxy's
    /// metric names, and counts a sync that changed nothing too, which it does not log). Without
    /// an answer from /metrics: the agent's "data path programmed" lines, or 0.
    pub fn syncs(&self) -> u64 {
        if self.config.is_cilium() {
            return self.metrics().map_or(0, |m| cilium::syncs(&m).0 as u64);
        }
        let count = self
            .metrics()
            .and_then(|m| m.get("kubeproxy_sync_proxy_rules_duration_seconds_count"));
        match count {
            Some(c) => c as u64,
            None if self.config.is_agent() => self.agent_syncs_since(0).len() as u64,
            None => 0,
        }
    }

    /// The metric names mentioning `part` (diagnostics).
    pub fn metric_names(&self, part: &str) -> String {
        match self.metrics() {
            None => "(no /metrics answer)".into(),
            Some(m) => {
                m.0.keys()
                    .filter(|k| k.contains(part))
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        }
    }

    /// Waits for the first sync after start (with whatever objects exist).
    pub fn wait_first_sync(&mut self, timeout: Duration) -> bool {
        if self.config == Config::Direct {
            return true;
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            super::check_interrupted();
            if !self.running() {
                panic!("{} exited:\n{}", self.config.label(), self.log_text());
            }
            if self.syncs() > 0 {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// Waits until no sync has happened for `quiet` (the proxy is idle, and past its min-sync-period).
    pub fn settle(&self, quiet: Duration, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut last = self.syncs();
        let mut since = Instant::now();
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
            let now = self.syncs();
            if now != last {
                last = now;
                since = Instant::now();
            } else if since.elapsed() >= quiet {
                return;
            }
        }
    }

    /// The agent's "data path programmed" log lines after `since_ns`: (time read, fields).
    pub fn agent_syncs_since(&self, since_ns: u64) -> Vec<(u64, BTreeMap<String, f64>)> {
        self.log
            .lock()
            .expect("log")
            .iter()
            .filter(|(t, l)| *t >= since_ns && l.contains("data path programmed"))
            .map(|(t, l)| {
                let fields = l
                    .split_whitespace()
                    .filter_map(|w| w.split_once('='))
                    .filter_map(|(k, v)| Some((k.to_string(), v.parse::<f64>().ok()?)))
                    .collect();
                (*t, fields)
            })
            .collect()
    }

    /// What a program that has not served yet is busy with, from its own log and from /proc:
    /// kube-proxy's last `Reloading service ... data` line (the size of the sync it started,
    /// logged at `--v=2`) and the commands it is waiting for (`iptables-restore`, `nft`), each
    /// with how long it has run and its CPU time. None when neither says anything.
    pub fn stall_diagnosis(&self) -> Option<String> {
        let pid = self.pid()?;
        let mut parts = Vec::new();
        let last_sync = {
            let log = self.log.lock().expect("log");
            log.iter()
                .rev()
                .find_map(|(_, l)| l.find("\"Reloading service").map(|at| l[at..].to_string()))
        };
        if let Some(line) = last_sync {
            parts.push(format!("its first sync logged `{line}`"));
        }
        for child in lb_tests::process::descendants(pid) {
            parts.push(format!(
                "it was still running `{}` ({:.0} s so far, {:.0} s of CPU)",
                child.cmdline, child.elapsed_s, child.cpu_s
            ));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }

    /// VmRSS and VmHWM of the proxy, in KiB.
    pub fn rss_kib(&self) -> Option<(u64, u64)> {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        };
        Some((field("VmRSS:")?, field("VmHWM:")?))
    }

    /// Writes everything the proxy logged (for a look after the run).
    pub fn save_log(&self, dir: &Path, name: &str) {
        let _ = fs::create_dir_all(dir);
        let text: String = self
            .log
            .lock()
            .expect("log")
            .iter()
            .map(|(_, l)| format!("{l}\n"))
            .collect();
        let _ = fs::write(dir.join(name), text);
    }

    /// SIGTERM and a short wait (the guard kills it otherwise).
    pub fn stop(mut self) {
        if let Some(p) = self.proc.as_mut() {
            p.signal(libc::SIGTERM);
            let _ = p.wait_timeout(Duration::from_secs(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // The proxy first, then whatever it started that is still in the node namespace (an
        // iptables-restore outlives a killed kube-proxy), so the namespace really goes away.
        drop(self.proc.take());
        let out = Command::new("ip")
            .args(["netns", "pids", self.topo.node.name()])
            .output();
        if let Ok(out) = out {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>()
                    && pid as u32 != std::process::id()
                {
                    // SAFETY: kill has no memory-safety preconditions.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
    }
}

/// A scraped Prometheus text page: `name{labels}` -> value.
#[derive(Clone, Debug, Default)]
pub struct Metrics(pub BTreeMap<String, f64>);

impl Metrics {
    fn parse(text: &str) -> Metrics {
        Metrics(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| {
                    let (k, v) = l.rsplit_once(' ')?;
                    Some((k.trim().to_string(), v.trim().parse().ok()?))
                })
                .collect(),
        )
    }

    /// The value of `name`, summed over its label sets (None when absent).
    pub fn get(&self, name: &str) -> Option<f64> {
        let mut found = None;
        for (k, v) in &self.0 {
            let base = k.split('{').next().unwrap_or(k);
            if base == name {
                *found.get_or_insert(0.0) += v;
            }
        }
        found
    }

    /// (count, sum) of a histogram.
    pub fn histogram(&self, name: &str) -> (f64, f64) {
        (
            self.get(&format!("{name}_count")).unwrap_or(0.0),
            self.get(&format!("{name}_sum")).unwrap_or(0.0),
        )
    }
}

/// One BPF map the agent holds (from /proc/<pid>/fdinfo, named through bpftool).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct MapMem {
    pub name: String,
    pub map_type: u32,
    pub max_entries: u64,
    pub memlock: u64,
}

/// The BPF maps an agent process holds open.
pub fn agent_maps(pid: u32) -> Vec<MapMem> {
    let names: BTreeMap<u64, String> = Command::new("bpftool")
        .args(["-j", "map", "show"])
        .output()
        .ok()
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|m| Some((m["id"].as_u64()?, m["name"].as_str()?.to_string())))
        .collect();
    let mut seen = BTreeMap::new();
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return vec![];
    };
    for entry in dir.flatten() {
        let Ok(text) = fs::read_to_string(entry.path()) else {
            continue;
        };
        if !text.contains("map_type:") {
            continue;
        }
        let field = |name: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        let id = field("map_id:");
        seen.entry(id).or_insert_with(|| MapMem {
            name: names.get(&id).cloned().unwrap_or_else(|| format!("id {id}")),
            map_type: field("map_type:") as u32,
            max_entries: field("max_entries:"),
            memlock: field("memlock:"),
        });
    }
    seen.into_values().collect()
}
