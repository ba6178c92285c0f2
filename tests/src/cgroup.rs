//! cgroup v2 subtrees made by tests. The cgroup2 mount is detected from /proc/self/mounts (it is
//! `/sys/fs/cgroup` on a unified layout and `/sys/fs/cgroup/unified` on a hybrid one); tests only
//! ever attach programs to a child they created here.

use std::{
    fs,
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use crate::unique_name;

/// The cgroup2 mount point, via the agent's own detection.
pub fn cgroup2_mount() -> PathBuf {
    lb_agent::datapath::cgroup::cgroup2_mount().expect("a cgroup2 mount (cgroup v2 is required)")
}

/// A child cgroup `<cgroup2>/lb-tests/<unique>`, removed on drop after killing what is left in it.
pub struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    pub fn new(prefix: &str) -> Cgroup {
        let parent = cgroup2_mount().join("lb-tests");
        fs::create_dir_all(&parent).unwrap_or_else(|e| panic!("mkdir {}: {e}", parent.display()));
        let path = parent.join(unique_name(prefix));
        fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        Cgroup { path }
    }

    /// A cgroup at a fixed path under the cgroup2 mount (the sandbox); a leftover of that name is
    /// emptied and removed first.
    pub fn at(relative: &str) -> Cgroup {
        let path = cgroup2_mount().join(relative);
        if path.exists() {
            remove_tree(&path);
        }
        fs::create_dir_all(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        Cgroup { path }
    }

    /// A child of this cgroup (e.g. one per pod of a sandbox node).
    pub fn child(&self, name: &str) -> Cgroup {
        let path = self.path.join(name);
        fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        Cgroup { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `cgroup.procs` file, which a child process writes "0" into to join.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    fn pids(&self) -> Vec<i32> {
        fs::read_to_string(self.procs_file())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

/// Kills everything in a cgroup tree and removes it, deepest first.
pub fn remove_tree(path: &Path) {
    if let Ok(entries) = fs::read_dir(path) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    let _ = fs::write(path.join("cgroup.kill"), "1");
    for _ in 0..100 {
        if fs::remove_dir(path).is_ok() || !path.exists() {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Children first (a sandbox node's pods), then stragglers (cgroup.kill exists since
        // 5.14), then the directory.
        if let Ok(entries) = fs::read_dir(&self.path) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    remove_tree(&e.path());
                }
            }
        }
        let _ = fs::write(self.path.join("cgroup.kill"), "1");
        for pid in self.pids() {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        for _ in 0..100 {
            if fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        // Leave the shared parent when other tests still use it; remove it when empty.
        if let Some(parent) = self.path.parent()
            && parent.file_name().is_some_and(|n| n == "lb-tests")
        {
            let _ = fs::remove_dir(parent);
        }
    }
}
