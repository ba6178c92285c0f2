//! What the run ran on: kernel, CPU, memory, OS, the programs' versions and the commit (with
//! whether what is measured had uncommitted changes).

use std::{fs, path::Path, process::Command};

use serde::{Deserialize, Serialize};

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
    /// `iptables-legacy --version`, when the machine has it.
    #[serde(default)]
    pub iptables_legacy: String,
    pub nft: String,
    pub lb_agent: String,
    /// `cilium-agent --version`, when Cilium was one of the peers.
    #[serde(default)]
    pub cilium: Option<String>,
    /// The flags cilium-agent ran with (besides its paths), for the document.
    #[serde(default)]
    pub cilium_flags: Vec<String>,
    pub git: String,
    pub date: String,
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

/// A control-plane binary's version; a run that needs none (tc only) may not have located them.
fn version_of(bin: Option<&std::path::PathBuf>) -> String {
    bin.map_or_else(
        || "not located (not used by this run)".into(),
        |b| first_line(&b.display().to_string(), &["--version"]),
    )
}

pub fn machine(
    bins: Option<&lb_tests::control_plane::Binaries>,
    agent: &Path,
    root: &Path,
    backends_capacity: u32,
) -> Machine {
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
        kube_proxy: version_of(bins.map(|b| &b.kube_proxy)),
        kube_apiserver: version_of(bins.map(|b| &b.kube_apiserver)),
        etcd: version_of(bins.map(|b| &b.etcd)),
        iptables: first_line("iptables", &["--version"]),
        iptables_legacy: first_line("iptables-legacy", &["--version"]),
        nft: first_line("nft", &["--version"]),
        lb_agent: first_line(&agent.display().to_string(), &["--version"]),
        cilium: crate::bench::cilium::bundle().map(|dir| {
            first_line(
                &dir.join("bin/cilium-agent").display().to_string(),
                &["--version"],
            )
        }),
        cilium_flags: crate::bench::cilium::bundle()
            .map(|_| crate::bench::cilium::flags(backends_capacity))
            .unwrap_or_default(),
        git: format!("{sha}{}", if dirty { " with uncommitted changes" } else { "" }),
        date: first_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
    }
}
