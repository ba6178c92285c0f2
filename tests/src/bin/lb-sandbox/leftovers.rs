//! The leftovers of a crashed run: its processes, namespaces, cgroups, bpffs mount and
//! directories, removed before a new run starts.

use std::{fs, path::Path, process::Command, time::Duration};

use lb_tests::cgroup;

use crate::{CGROUP, STATE_DIR, WORK_DIR, stop::step};

/// Kills whatever a crashed run left: processes (the control plane's and the real node's
/// containerd and kubelet, found by their command line naming the state directory; the netns
/// nodes' in the sandbox cgroup), namespaces, the cgroup trees, the bpffs mount. The real node's
/// containers, its cgroups (`lb-tests/lbk<pid>x<n>` in every hierarchy) and its namespace, and the
/// LAN's (`lblan<pid>x<n>`), are named after the dead run's pid: `lb_tests::sweep` removes them,
/// as it does for the tests.
pub(crate) fn clean_leftovers() {
    if let Ok(procs) = fs::read_dir("/proc") {
        for p in procs.flatten() {
            let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            if pid == std::process::id() as i32 {
                continue;
            }
            let cmdline = fs::read(p.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            if cmdline.contains(STATE_DIR) || cmdline.contains(&format!("{WORK_DIR}/")) {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    if let Ok(mount) = cgroup::cgroup2_mount().canonicalize() {
        let tree = mount.join(CGROUP);
        if tree.exists() {
            step("removing the cgroups of a previous run");
            cgroup::remove_tree(&tree);
        }
    }
    let listed = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for name in listed
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("lbsb-"))
    {
        let _ = Command::new("ip").args(["netns", "delete", name]).output();
    }
    let removed = lb_tests::sweep::leftovers_of_dead_runs();
    if !removed.is_empty() {
        step(&format!(
            "removed the leftovers of runs that died: {}",
            removed.join(", ")
        ));
    }
    let bpf = Path::new(STATE_DIR).join("bpf");
    while nix::mount::umount2(&bpf, nix::mount::MntFlags::MNT_DETACH).is_ok() {}
    // A dead real node's mounts are gone with its last process; give them a moment.
    for dir in [STATE_DIR, WORK_DIR] {
        for _ in 0..50 {
            if fs::remove_dir_all(dir).is_ok() || !Path::new(dir).exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
