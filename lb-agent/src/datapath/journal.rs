//! What a start changes under the bpf root before its programs are attached, undone if the start
//! ends first (a verifier rejection, a map the kernel refuses, an error or a signal before the
//! first sync): the node is left as it was, or as the previous agent left it.
//!
//! Recorded: the bpffs this start mounted, the directories it created for the root, every path
//! that existed under the root, and the pins it moved aside to migrate a map. Undone, in this
//! order: pins moved aside go back (over the new map's pin), paths that did not exist are removed
//! (new pins, new link directories), a bpffs this start mounted is unmounted, and directories it
//! created go. Entries the first sync wrote into maps a previous agent pinned stay: they are the
//! API's current state, written in the data path's safe order (backends, slots, frontend last).

use std::{
    collections::BTreeSet,
    fs, io,
    path::{Path, PathBuf},
};

/// A start's changes under the root until [`StartJournal::commit`].
#[derive(Debug)]
pub struct StartJournal {
    root: PathBuf,
    /// Every path under the root (the root included) before the start touched it.
    before: BTreeSet<PathBuf>,
    /// Directories this start created up to the root (deepest last), to remove if empty.
    created_dirs: Vec<PathBuf>,
    /// A bpffs this start mounted.
    mounted: Option<PathBuf>,
    /// (pin, where it was moved) for maps migrated to a new capacity.
    moved_aside: Vec<(PathBuf, PathBuf)>,
    committed: bool,
}

impl StartJournal {
    /// Records what is under `root` now, before anything is changed there.
    pub fn begin(root: &Path) -> Self {
        let root = std::path::absolute(root).unwrap_or_else(|_| root.to_path_buf());
        let mut before = BTreeSet::new();
        collect_tree(&root, &mut before);
        // The directories `create_dir_all` would make: from the first missing ancestor down.
        let created_dirs = root
            .ancestors()
            .take_while(|d| !d.exists())
            .map(Path::to_path_buf)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        Self {
            root,
            before,
            created_dirs,
            mounted: None,
            moved_aside: Vec::new(),
            committed: false,
        }
    }

    pub fn mounted(&mut self, mount_point: &Path) {
        self.mounted = Some(mount_point.to_path_buf());
    }

    pub fn moved_aside(&mut self, pin: &Path, aside: &Path) {
        self.moved_aside.push((pin.to_path_buf(), aside.to_path_buf()));
    }

    /// The programs are attached: what this start made is the node's data path now.
    pub fn commit(&mut self) {
        self.committed = true;
    }

    /// Undoes the start's changes; returns the problems met (each is also logged).
    pub fn roll_back(&mut self) -> Vec<String> {
        self.committed = true;
        let mut problems = Vec::new();
        let mut note = |what: String, e: io::Error| {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!("undoing the failed start: {what}: {e}");
                problems.push(format!("{what}: {e}"));
            }
        };
        for (pin, aside) in self.moved_aside.drain(..).rev() {
            if let Err(e) = fs::rename(&aside, &pin) {
                note(format!("moving {} back to {}", aside.display(), pin.display()), e);
            }
        }
        let mut now = BTreeSet::new();
        collect_tree(&self.root, &mut now);
        // Deepest first, so a directory is empty when its turn comes.
        let added: Vec<&PathBuf> = now.difference(&self.before).collect();
        for path in added.into_iter().rev() {
            if self.mounted.as_deref() == Some(path.as_path()) {
                continue;
            }
            let removed = if path.is_dir() {
                fs::remove_dir(path)
            } else {
                fs::remove_file(path)
            };
            if let Err(e) = removed {
                note(format!("removing {}", path.display()), e);
            }
        }
        if let Some(mount_point) = self.mounted.take()
            && let Err(e) = nix::mount::umount2(&mount_point, nix::mount::MntFlags::MNT_DETACH)
        {
            note(
                format!("unmounting the bpffs at {}", mount_point.display()),
                e.into(),
            );
        }
        for dir in self.created_dirs.iter().rev() {
            if let Err(e) = fs::remove_dir(dir) {
                note(format!("removing {}", dir.display()), e);
            }
        }
        problems
    }
}

impl Drop for StartJournal {
    fn drop(&mut self) {
        if !self.committed {
            tracing::info!(
                root = %self.root.display(),
                "the start ended before its programs were attached: undoing what it changed under the bpf root"
            );
            self.roll_back();
        }
    }
}

/// `root` and every path below it (symlinks not followed).
fn collect_tree(root: &Path, into: &mut BTreeSet<PathBuf>) {
    if fs::symlink_metadata(root).is_err() {
        return;
    }
    into.insert(root.to_path_buf());
    let Ok(entries) = fs::read_dir(root) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect_tree(&path, into);
        } else {
            into.insert(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(root: &Path) -> BTreeSet<PathBuf> {
        let mut t = BTreeSet::new();
        collect_tree(root, &mut t);
        t
    }

    #[test]
    fn a_rolled_back_start_leaves_the_tree_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("lb");
        fs::create_dir_all(root.join("maps")).unwrap();
        fs::write(root.join("maps/kept"), "old").unwrap();
        fs::write(root.join("maps/resized"), "old map").unwrap();
        let before = tree(&root);

        let mut journal = StartJournal::begin(&root);
        fs::rename(root.join("maps/resized"), root.join("maps/resized-old")).unwrap();
        journal.moved_aside(&root.join("maps/resized"), &root.join("maps/resized-old"));
        fs::write(root.join("maps/resized"), "new map").unwrap();
        fs::write(root.join("maps/added"), "new").unwrap();
        fs::create_dir_all(root.join("links/1234")).unwrap();
        fs::write(root.join("links/1234/connect4"), "link").unwrap();
        drop(journal);

        assert_eq!(tree(&root), before);
        assert_eq!(fs::read_to_string(root.join("maps/resized")).unwrap(), "old map");
        assert_eq!(fs::read_to_string(root.join("maps/kept")).unwrap(), "old");
    }

    #[test]
    fn a_root_the_start_created_is_removed_with_its_new_parents() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("a/b/lb");
        let journal = StartJournal::begin(&root);
        fs::create_dir_all(root.join("maps")).unwrap();
        fs::write(root.join("maps/x"), "").unwrap();
        drop(journal);
        assert!(!dir.path().join("a").exists());
        assert!(dir.path().exists());
    }

    #[test]
    fn a_committed_start_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("lb");
        let mut journal = StartJournal::begin(&root);
        fs::create_dir_all(root.join("maps")).unwrap();
        journal.commit();
        drop(journal);
        assert!(root.join("maps").is_dir());
    }
}
