//! The bpffs directory that holds our pins: `<bpf-root>/maps/<map>` and `<bpf-root>/links/...`.
//! Like Cilium's `checkOrMountDefaultLocations`: when the root is not on a bpffs (bpffs is often
//! not mounted on a fresh machine), mount one, at /sys/fs/bpf or at the root itself, never over
//! anything else (see [`mount_plan`]).

use std::{
    fs, io,
    os::unix::fs::DirBuilderExt,
    path::{Component, Path, PathBuf},
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

    /// The pin of a map at its current layout version (`catalog::pin_name`).
    pub fn map(&self, name: &str) -> PathBuf {
        self.maps().join(lb_common::catalog::pin_name(name).to_string())
    }

    pub fn links(&self) -> PathBuf {
        self.root.join("links")
    }
}

pub fn is_bpffs(path: &Path) -> bool {
    statfs(path).is_ok_and(|s| s.filesystem_type() == BPF_FS_MAGIC)
}

/// The standard bpffs mount point.
pub const STANDARD_MOUNT: &str = "/sys/fs/bpf";

/// The bpf root directory, as found before preparing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootState {
    Missing,
    EmptyDir,
    NonEmptyDir,
    NotADir,
}

/// /sys/fs/bpf, as found before preparing the root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StandardState {
    Missing,
    /// A directory that is not a bpffs (nothing mounted there yet).
    Dir,
    Bpffs,
}

/// What [`mount_plan`] decides from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootFacts {
    pub root: RootState,
    /// The root, or else its nearest existing ancestor (where it would be created), is on a bpffs.
    pub on_bpffs: bool,
    pub standard: StandardState,
}

/// Where to mount a bpffs for the root, if anywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MountPlan {
    /// The root is (or will be created) on a bpffs already.
    Nothing,
    /// Mount one at /sys/fs/bpf (the root is below it), as Cilium and the DaemonSet's init step do.
    Standard,
    /// Mount one at the root directory itself, creating it first when `create`.
    AtRoot { create: bool },
}

/// Decides where to mount a bpffs for `root` (absolute, without `..`). Mounting hides whatever
/// the mount point holds, so a bpffs is only ever mounted at /sys/fs/bpf, for a root below it
/// while it is not a bpffs yet, or at the root directory itself when that is empty or missing:
/// never over an ancestor of the root (`--bpf-root /var/lib/lb` must not hide /var/lib).
pub fn mount_plan(root: &Path, facts: &RootFacts) -> Result<MountPlan, String> {
    if !root.is_absolute() || root.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(format!(
            "--bpf-root {} must be an absolute path without `..`",
            root.display()
        ));
    }
    if facts.on_bpffs {
        return Ok(MountPlan::Nothing);
    }
    if root.starts_with(STANDARD_MOUNT) {
        return match facts.standard {
            StandardState::Dir => Ok(MountPlan::Standard),
            StandardState::Bpffs => Err(format!(
                "{} is not on the bpffs mounted at {STANDARD_MOUNT}: another filesystem is mounted in \
                 between; pass a --bpf-root on the bpffs",
                root.display()
            )),
            StandardState::Missing => Err(format!(
                "{STANDARD_MOUNT} does not exist (is sysfs mounted, and the kernel built with \
                 CONFIG_BPF_SYSCALL?); mount a bpffs and pass a --bpf-root on it"
            )),
        };
    }
    match facts.root {
        RootState::Missing => Ok(MountPlan::AtRoot { create: true }),
        RootState::EmptyDir => Ok(MountPlan::AtRoot { create: false }),
        RootState::NonEmptyDir => Err(format!(
            "{} is not on a bpffs and is not empty: refusing to mount a bpffs over it (mount one \
             there yourself, or pass a --bpf-root under {STANDARD_MOUNT}, or an empty or missing \
             directory)",
            root.display()
        )),
        RootState::NotADir => Err(format!("{} is not a directory", root.display())),
    }
}

/// `path` exists: false only when it does not; an error when that cannot be told (permission).
fn exists(path: &Path) -> io::Result<bool> {
    path.try_exists()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot look up {}: {e}", path.display())))
}

/// The facts [`mount_plan`] needs, from the filesystem, and the nearest existing ancestor of
/// `root` (or `root`).
fn root_facts(root: &Path) -> io::Result<(RootFacts, PathBuf)> {
    let mut base = root;
    while !exists(base)? {
        base = base.parent().ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, "the bpf root has no existing ancestor")
        })?;
    }
    let state = if base != root {
        RootState::Missing
    } else if !root.is_dir() {
        RootState::NotADir
    } else {
        let mut entries = fs::read_dir(root)
            .map_err(|e| io::Error::new(e.kind(), format!("reading {}: {e}", root.display())))?;
        if entries.next().is_none() {
            RootState::EmptyDir
        } else {
            RootState::NonEmptyDir
        }
    };
    let standard = Path::new(STANDARD_MOUNT);
    let standard = if is_bpffs(standard) {
        StandardState::Bpffs
    } else if standard.is_dir() {
        StandardState::Dir
    } else {
        StandardState::Missing
    };
    let facts = RootFacts {
        root: state,
        on_bpffs: is_bpffs(base),
        standard,
    };
    Ok((facts, base.to_path_buf()))
}

fn mount_bpffs(mount_point: &Path) -> io::Result<()> {
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
    })
}

/// Makes sure `root` is a directory on a bpffs, mounting one where [`mount_plan`] allows when
/// none is mounted, and creates the maps/ and links/ directories. A mount is noted in `journal`.
pub fn prepare(paths: &PinPaths, journal: &mut super::journal::StartJournal) -> io::Result<()> {
    let root = std::path::absolute(&paths.root)?;
    let (facts, base) = root_facts(&root)?;
    let plan = mount_plan(&root, &facts).map_err(|m| io::Error::new(io::ErrorKind::InvalidInput, m))?;
    match plan {
        MountPlan::Nothing => {}
        MountPlan::Standard => {
            mount_bpffs(Path::new(STANDARD_MOUNT))?;
            journal.mounted(Path::new(STANDARD_MOUNT));
        }
        MountPlan::AtRoot { create } => {
            if create {
                fs::DirBuilder::new().recursive(true).mode(0o755).create(&root)?;
            }
            if let Err(e) = mount_bpffs(&root) {
                if create {
                    // Leave nothing behind: the directories this call created, deepest first.
                    for dir in root.ancestors().take_while(|d| *d != base) {
                        let _ = fs::remove_dir(dir);
                    }
                }
                return Err(e);
            }
            journal.mounted(&root);
        }
    }
    for dir in [root.clone(), paths.maps(), paths.links()] {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(&dir)?;
    }
    if !is_bpffs(&root) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(root: RootState, on_bpffs: bool, standard: StandardState) -> RootFacts {
        RootFacts {
            root,
            on_bpffs,
            standard,
        }
    }

    #[test]
    fn a_root_on_a_bpffs_needs_no_mount() {
        for root in ["/sys/fs/bpf/lb", "/run/lb/bpf", "/tmp/x/lb"] {
            for state in [RootState::Missing, RootState::EmptyDir, RootState::NonEmptyDir] {
                for standard in [StandardState::Missing, StandardState::Dir, StandardState::Bpffs] {
                    assert_eq!(
                        mount_plan(Path::new(root), &facts(state, true, standard)),
                        Ok(MountPlan::Nothing),
                        "{root} {state:?} {standard:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn below_sys_fs_bpf_only_sys_fs_bpf_is_mounted() {
        for state in [RootState::Missing, RootState::EmptyDir, RootState::NonEmptyDir] {
            for root in ["/sys/fs/bpf", "/sys/fs/bpf/lb", "/sys/fs/bpf/a/b"] {
                let f = facts(state, false, StandardState::Dir);
                assert_eq!(mount_plan(Path::new(root), &f), Ok(MountPlan::Standard), "{root}");
            }
            // /sys/fs/bpf is a bpffs but the root is not on it: something is mounted between.
            let err = mount_plan(
                Path::new("/sys/fs/bpf/lb"),
                &facts(state, false, StandardState::Bpffs),
            )
            .unwrap_err();
            assert!(err.contains("another filesystem"), "{err}");
            let err = mount_plan(
                Path::new("/sys/fs/bpf/lb"),
                &facts(state, false, StandardState::Missing),
            )
            .unwrap_err();
            assert!(err.contains("/sys/fs/bpf does not exist"), "{err}");
        }
        // Not a path component prefix: /sys/fs/bpfx is elsewhere.
        assert_eq!(
            mount_plan(
                Path::new("/sys/fs/bpfx"),
                &facts(RootState::Missing, false, StandardState::Dir)
            ),
            Ok(MountPlan::AtRoot { create: true })
        );
    }

    /// Regression: `--bpf-root /var/lib/lb` used to mount a bpffs over /var/lib (the nearest
    /// existing ancestor), hiding everything in it.
    #[test]
    fn elsewhere_only_the_root_itself_is_mounted_and_only_when_empty() {
        let root = Path::new("/var/lib/lb");
        for standard in [StandardState::Missing, StandardState::Dir, StandardState::Bpffs] {
            assert_eq!(
                mount_plan(root, &facts(RootState::Missing, false, standard)),
                Ok(MountPlan::AtRoot { create: true })
            );
            assert_eq!(
                mount_plan(root, &facts(RootState::EmptyDir, false, standard)),
                Ok(MountPlan::AtRoot { create: false })
            );
            let err = mount_plan(root, &facts(RootState::NonEmptyDir, false, standard)).unwrap_err();
            assert!(err.contains("not empty") && err.contains("/var/lib/lb"), "{err}");
            let err = mount_plan(root, &facts(RootState::NotADir, false, standard)).unwrap_err();
            assert!(err.contains("not a directory"), "{err}");
        }
    }

    #[test]
    fn relative_roots_and_dot_dot_are_refused() {
        let f = facts(RootState::Missing, false, StandardState::Dir);
        for root in ["lb", "/sys/fs/bpf/../../../var/lib", "/tmp/../var/lb"] {
            let err = mount_plan(Path::new(root), &f).unwrap_err();
            assert!(err.contains("absolute path without `..`"), "{root}: {err}");
        }
    }
}
