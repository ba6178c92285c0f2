//! The bpffs directory that holds our pins: `<bpf-root>/maps/<map>` and `<bpf-root>/links/...`.
//! Like Cilium's `checkOrMountDefaultLocations`: when the parent is not a bpffs (bpffs is often
//! not mounted on a fresh machine), mount one there.

use std::{
    fs, io,
    os::unix::fs::DirBuilderExt,
    path::{Path, PathBuf},
};

use nix::{
    mount::{MsFlags, mount},
    sys::statfs::{BPF_FS_MAGIC, statfs},
};

/// The pin layout under the root.
#[derive(Clone, Debug)]
pub struct PinPaths {
    pub root: PathBuf,
}

impl PinPaths {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn maps(&self) -> PathBuf {
        self.root.join("maps")
    }

    /// The pin of a map at its current layout version (see `migrate::pin_name`).
    pub fn map(&self, name: &str) -> PathBuf {
        self.maps().join(super::migrate::pin_name(name))
    }

    pub fn links(&self) -> PathBuf {
        self.root.join("links")
    }
}

pub fn is_bpffs(path: &Path) -> bool {
    statfs(path).is_ok_and(|s| s.filesystem_type() == BPF_FS_MAGIC)
}

/// Makes sure `root` is a directory on a bpffs, mounting bpffs on the nearest existing ancestor
/// (normally /sys/fs/bpf) if none is mounted, and creates the maps/ and links/ directories.
pub fn prepare(paths: &PinPaths) -> io::Result<()> {
    let root = &paths.root;
    let mut base = root.as_path();
    while !base.exists() {
        base = base
            .parent()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "bpf root has no existing ancestor"))?;
    }
    if !is_bpffs(base) {
        // The standard place: mount there, as Cilium and the DaemonSet's init step do.
        let mount_point = if root.starts_with("/sys/fs/bpf") {
            Path::new("/sys/fs/bpf")
        } else {
            base
        };
        if !is_bpffs(mount_point) {
            tracing::info!(path = %mount_point.display(), "bpffs is not mounted: mounting it");
            mount(
                Some("bpf"),
                mount_point,
                Some("bpf"),
                MsFlags::empty(),
                None::<&str>,
            )
            .map_err(|e| {
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "cannot mount bpffs on {}: {e} (needs CAP_SYS_ADMIN; or mount it before starting)",
                        mount_point.display()
                    ),
                )
            })?;
        }
    }
    for dir in [root.clone(), paths.maps(), paths.links()] {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(&dir)?;
    }
    if !is_bpffs(root) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is not on a bpffs; pins would not survive a restart",
                root.display()
            ),
        ));
    }
    Ok(())
}
