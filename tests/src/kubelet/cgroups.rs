//! The node's cgroups: `lb-tests/<node>` in every hierarchy (kubelet's `cgroupRoot`), with the
//! controllers delegated down to it, a `system` cgroup for the node's own processes, and their
//! removal, killing whatever is left in them.

use std::{
    fs,
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use anyhow::{Context, Result};

/// The parent of every node's cgroups, in every hierarchy (as `crate::cgroup`'s tests).
pub(super) const CGROUP_PARENT: &str = "lb-tests";

/// The cgroup hierarchies mounted on this machine: cgroup2 and every v1 hierarchy.
fn hierarchies() -> Vec<(PathBuf, bool)> {
    fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (_, point, fstype) = (f.next()?, f.next()?, f.next()?);
            match fstype {
                "cgroup2" => Some((PathBuf::from(point), true)),
                "cgroup" => Some((PathBuf::from(point), false)),
                _ => None,
            }
        })
        .collect()
}

/// Creates `lb-tests/<name>` in every hierarchy (kubelet's cgroupRoot must exist in each) and
/// `<cgroup2>/lb-tests/<name>/system` for the node's own processes. Returns the node's cgroup of
/// every hierarchy and its cgroup2 one.
pub(super) fn make_cgroups(name: &str) -> Result<(Vec<PathBuf>, PathBuf)> {
    let mut made = Vec::new();
    let mut cgroup2 = None;
    for (mount, unified) in hierarchies() {
        let parent = mount.join(CGROUP_PARENT);
        let node = parent.join(name);
        fs::create_dir_all(&node).with_context(|| format!("creating {}", node.display()))?;
        // A new cpuset has no CPUs until given its parent's.
        for file in ["cpuset.cpus", "cpuset.mems"] {
            for dir in [&parent, &node] {
                let own = dir.join(file);
                if own.exists() && fs::read_to_string(&own).unwrap_or_default().trim().is_empty() {
                    let from = fs::read_to_string(mount.join(file)).unwrap_or_default();
                    let _ = fs::write(&own, from.trim());
                }
            }
        }
        if unified {
            // A unified host: kubelet needs the controllers delegated down to the node.
            let controllers = fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
            let enable: String = controllers.split_whitespace().map(|c| format!("+{c} ")).collect();
            if !enable.is_empty() {
                let _ = fs::write(parent.join("cgroup.subtree_control"), enable.trim());
                let _ = fs::write(node.join("cgroup.subtree_control"), enable.trim());
            }
            let system = node.join("system");
            fs::create_dir_all(&system).with_context(|| format!("creating {}", system.display()))?;
            cgroup2 = Some(node.clone());
        }
        made.push(node);
    }
    let cgroup2 = cgroup2.context("no cgroup2 mount (cgroup v2 is required)")?;
    Ok((made, cgroup2))
}

/// Every pid in a cgroup tree.
pub(super) fn pids_in_tree(dir: &Path) -> Vec<i32> {
    let mut pids: Vec<i32> = fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            pids.extend(pids_in_tree(&entry.path()));
        }
    }
    pids
}

/// Removes a cgroup tree of any hierarchy, deepest first, killing what is left in it.
pub fn remove_cgroup_tree(dir: &Path) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroup_tree(&entry.path());
        }
    }
    for _ in 0..100 {
        for pid in pids_in_tree(dir) {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
}
