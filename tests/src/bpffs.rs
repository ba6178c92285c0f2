//! A private bpffs instance per test: every `mount -t bpf` is a new, empty filesystem, so a test
//! can pin maps and links without touching the machine's /sys/fs/bpf. Unmounting drops the pins
//! (and detaches pinned links once nothing else holds them).

use std::{
    fs,
    path::{Path, PathBuf},
};

use nix::mount::{MntFlags, MsFlags, mount, umount2};

pub struct BpfFs {
    dir: PathBuf,
}

impl BpfFs {
    pub fn new() -> BpfFs {
        let dir = std::env::temp_dir().join(crate::unique_name("lbbpffs"));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        mount(Some("bpf"), &dir, Some("bpf"), MsFlags::empty(), None::<&str>)
            .unwrap_or_else(|e| panic!("mount bpffs on {}: {e}", dir.display()));
        BpfFs { dir }
    }

    /// A bpffs mounted at a fixed directory (the sandbox); a leftover mount there is removed
    /// first.
    pub fn at(dir: &Path) -> BpfFs {
        while umount2(dir, MntFlags::MNT_DETACH).is_ok() {}
        fs::create_dir_all(dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        mount(Some("bpf"), dir, Some("bpf"), MsFlags::empty(), None::<&str>)
            .unwrap_or_else(|e| panic!("mount bpffs on {}: {e}", dir.display()));
        BpfFs {
            dir: dir.to_path_buf(),
        }
    }

    /// The mount point; pass it (or a directory below it) as the agent's `--bpf-root`.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Default for BpfFs {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for BpfFs {
    fn drop(&mut self) {
        let _ = umount2(&self.dir, MntFlags::MNT_DETACH);
        let _ = fs::remove_dir(&self.dir);
    }
}
