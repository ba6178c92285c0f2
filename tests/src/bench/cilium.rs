//! The Cilium peer: the real cilium-agent (`cargo xtask cilium` builds it from Cilium's Go module
//! with its BPF sources, CRDs and a clang from Debian into the bundle `LB_CILIUM_DIR` names) as a
//! kube-proxy replacement in the benchmark's node namespace, configured as Cilium documents it
//! for that (socket LB on, native routing, no tunnel, no Hubble, Envoy or L7 proxy, no policy).
//!
//! It runs as the other proxies do: in the node namespace, against the same API server, on the
//! same devices and a test cgroup of its own. Two things keep it off the machine's state, as the
//! test hygiene rules require of everything here: it gets a private mount namespace in which its
//! cgroup is bind-mounted on a directory of its state (cilium-agent mounts a whole cgroup2
//! hierarchy, whose root is the machine's root cgroup, on a `--cgroup-root` that is not a mount
//! point of its own), /proc/sys/kernel is read-only (it sets `kernel.timer_migration` and
//! `kernel.unprivileged_bpf_disabled`, which are machine-wide; it ignores the failure) and /run
//! is a tmpfs of its own (it writes /run/cilium/deleteQueue whatever its flags say).

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

use super::{peers::Metrics, topo};

/// Where the agent serves Prometheus metrics (inside the node namespace).
pub const METRICS_ADDR: &str = "127.0.0.1:9962";

/// The bundle `cargo xtask cilium` built: `bin/cilium-agent`, `lib/bpf` (the agent's
/// `--lib-dir`), `crds/*.yaml`, `llvm/` (clang for the agent's runtime compilation of its
/// programs) and `VERSION`. None when `LB_CILIUM_DIR` is unset.
pub fn bundle() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("LB_CILIUM_DIR")?);
    assert!(
        dir.join("bin/cilium-agent").is_file(),
        "LB_CILIUM_DIR={} holds no bin/cilium-agent: run `cargo xtask cilium`",
        dir.display()
    );
    Some(dir)
}

/// The agent's flags besides the paths (kubeconfig, bpffs, cgroup, state and library
/// directories, API socket), for the report.
pub fn flags(backends_capacity: u32) -> Vec<String> {
    [
        "--kube-proxy-replacement=true",
        "--bpf-lb-sock=true",
        // The "lb tc" configuration's client reaches ClusterIPs from outside the node through its
        // devices, as lb-agent's tc path serves them; Cilium needs this to do the same.
        "--bpf-lb-external-clusterip=true",
        "--routing-mode=native",
        "--enable-ipv4=true",
        "--enable-ipv6=true",
        "--enable-ipv4-masquerade=false",
        "--enable-ipv6-masquerade=false",
        "--ipam=kubernetes",
        "--devices=n0,n1",
        "--enable-hubble=false",
        "--enable-l7-proxy=false",
        "--enable-policy=never",
        "--enable-k8s-networkpolicy=false",
        "--enable-health-checking=false",
        "--enable-endpoint-health-checking=false",
        "--cni-exclusive=false",
        "--prometheus-serve-addr=127.0.0.1:9962",
        "--metrics=+cilium_reconciler_count,+cilium_reconciler_duration_seconds",
    ]
    .into_iter()
    .map(str::to_owned)
    .chain([
        format!("--ipv4-native-routing-cidr={}", topo::CLUSTER_CIDR),
        format!("--ipv6-native-routing-cidr={}", topo::CLUSTER_CIDR6),
        format!("--bpf-lb-map-max={backends_capacity}"),
    ])
    .collect()
}

/// The command that starts the agent (to be placed in the node namespace by the caller), with
/// its state under `state` (the caller removes it).
pub fn command(
    kubeconfig: &Path,
    bpf_root: &Path,
    cgroup: &Path,
    state: &Path,
    backends_capacity: u32,
) -> Command {
    let dir = bundle().expect("LB_CILIUM_DIR");
    install_crds(kubeconfig, &dir);
    let llvm = dir.join("llvm/usr/lib/llvm-19");
    let path = std::env::var("PATH").unwrap_or_default();
    // The cgroup is bind-mounted on a directory of the state (another file system): Cilium
    // takes a --cgroup-root whose device is its parent's for no mount point, and mounts one.
    let cgroup_root = state.join("cgroup");
    std::fs::create_dir_all(&cgroup_root).expect("cilium cgroup root");
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(
            "mount --bind \"$0\" \"$1\" && mount --bind /proc/sys/kernel /proc/sys/kernel \
             && mount -o remount,bind,ro /proc/sys/kernel && mount -t tmpfs lb-bench-run /run \
             && shift && exec \"$@\"",
        )
        .arg(cgroup)
        .arg(&cgroup_root)
        .arg(dir.join("bin/cilium-agent"))
        .arg(format!("--k8s-kubeconfig-path={}", kubeconfig.display()))
        .arg(format!("--bpf-root={}", bpf_root.display()))
        .arg(format!("--cgroup-root={}", cgroup_root.display()))
        .arg(format!("--state-dir={}", state.join("run").display()))
        .arg(format!("--lib-dir={}", dir.join("lib").display()))
        .arg(format!(
            "--socket-path={}",
            state.join("run/cilium.sock").display()
        ))
        .args(flags(backends_capacity))
        // The Node it runs as (Cilium has no flag for it; the DaemonSet sets this).
        .env("K8S_NODE_NAME", super::api::NODE)
        // Its own status collector's client finds the API socket here, not through the flag.
        .env("CILIUM_SOCK", state.join("run/cilium.sock"))
        .env("PATH", format!("{}:{path}", llvm.join("bin").display()))
        .env(
            "LD_LIBRARY_PATH",
            format!(
                "{}:{}",
                llvm.join("lib").display(),
                dir.join("llvm/usr/lib/x86_64-linux-gnu").display()
            ),
        );
    cmd
}

/// Cilium's CRDs (its operator installs them in a cluster; there is no operator here), once.
fn install_crds(kubeconfig: &Path, dir: &Path) {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let bins = lb_tests::control_plane::Binaries::locate().expect("control-plane binaries");
        let out = Command::new(&bins.kubectl)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(["apply", "--server-side", "-f"])
            .arg(dir.join("crds"))
            .output()
            .expect("run kubectl");
        assert!(
            out.status.success(),
            "installing Cilium's CRDs failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
}

/// (rounds, seconds) of the agent's load-balancer reconciliation (Table[Frontend] to the BPF
/// maps): Cilium's counterpart of kube-proxy's sync count and duration.
pub fn syncs(m: &Metrics) -> (f64, f64) {
    let lb = |k: &str| k.contains("loadbalancer-reconciler");
    let rounds =
        m.0.iter()
            .filter(|(k, _)| k.starts_with("cilium_reconciler_count{") && lb(k))
            .map(|(_, v)| v)
            .sum();
    let seconds =
        m.0.iter()
            .filter(|(k, _)| k.starts_with("cilium_reconciler_duration_seconds_sum{") && lb(k))
            .map(|(_, v)| v)
            .sum();
    (rounds, seconds)
}
