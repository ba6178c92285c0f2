//! Test harness shared by the privileged tests, the end-to-end tests, the sandbox and the
//! benchmarks. Every kernel object a test creates is owned by an RAII guard that removes it on
//! drop, also when the test panics; and when a signal (SIGINT, SIGTERM, SIGHUP) ends the process,
//! which runs no guard, `sweep::remove_own_objects_on_signals` removes them by their names:
//!
//! - `netns`: network namespaces, veth pairs, addresses and routes (iproute2);
//! - `cgroup`: a cgroup v2 subtree under the detected cgroup2 mount (never the root cgroup);
//! - `bpffs`: a private directory for pinned maps and links under a bpffs mount;
//! - `process`: child processes started inside a netns and a cgroup, killed on drop;
//! - `control_plane`: a real etcd and kube-apiserver on loopback with generated certificates;
//! - `topo`: nodes, pods and a LAN in namespaces; `agent`: the real lb-agent run inside them;
//! - `fixtures`: Service/EndpointSlice builders; `probe`: the `lb-probe` traffic helper;
//! - `kernel`: what the running kernel changes in what a test may observe;
//! - `sctp`: whether the kernel has SCTP, loading its module (from an extracted kernel package's
//!   modules in a guest) for the tests that need real SCTP sockets;
//! - `kubelet`: a real node (kubelet, containerd, runc, CNI) in a netns and a mount namespace;
//! - `monitor`: `lb-agent monitor`'s lease and events on a data path loaded with private maps.
//!
//! Tests never attach programs to the machine's root cgroup or to interfaces they did not create,
//! and only send traffic to addresses inside their own namespaces or to loopback.

pub mod agent;
pub mod bpffs;
pub mod bpftool;
pub mod cgroup;
pub mod control_plane;
pub mod fixtures;
pub mod kernel;
pub mod kubelet;
pub mod load;
pub mod monitor;
pub mod netns;
pub mod packet;
pub mod probe;
pub mod process;
pub mod report;
pub mod sctp;
pub mod sweep;
pub mod topo;

/// Fails the test with a clear message when not running as root (CI runs as root, so nothing is
/// skipped silently).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test needs root (network namespaces, cgroups, BPF); run it through `./x test` as root");
    }
    // Once per process: what killed runs (Ctrl-C skips every guard) left behind.
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(|| {
        let removed = sweep::leftovers_of_dead_runs();
        if !removed.is_empty() {
            eprintln!("removed the leftovers of runs that died: {}", removed.join(", "));
        }
        // And what this process makes goes with it when a signal ends it.
        sweep::remove_own_objects_on_signals();
    });
}

/// A name unique to this process and call, short enough for interface names (15 bytes). Each
/// prefix counts on its own, so that a test binary making many objects (a hundred namespaces
/// of one kind are fine) keeps even its longest prefixes within the limit.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: std::sync::Mutex<std::collections::BTreeMap<String, u32>> =
        std::sync::Mutex::new(std::collections::BTreeMap::new());
    let n = {
        let mut next = NEXT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let counter = next.entry(prefix.to_string()).or_insert(0);
        *counter += 1;
        *counter - 1
    };
    let pid = std::process::id() % 100_000;
    let name = format!("{prefix}{pid}x{n}");
    assert!(name.len() <= 15, "name {name} longer than 15 bytes");
    name
}
