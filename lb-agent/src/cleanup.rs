//! `lb-agent cleanup` (and `--cleanup`): detach every program and remove every pin under the bpf
//! root. Removing a pinned link detaches its program; removing a map pin frees the map once no
//! program uses it. Idempotent: a second run finds nothing and succeeds.

use std::{fs, io, path::Path};

use anyhow::{Result, anyhow};

use crate::{datapath::bpffs, error::is_permission_denied};

/// What an unprivileged user is missing to clean up.
const HINT: &str = " (cleanup needs root: the agent's pins are owned by root, and detaching its \
                    tc programs takes CAP_NET_ADMIN)";

/// `error` while doing `what`, with the hint when it is a permission problem.
fn failed(what: String, error: io::Error) -> anyhow::Error {
    let hint = if is_permission_denied(&error) { HINT } else { "" };
    anyhow!("{what}: {error}{hint}")
}

pub fn run(bpf_root: &Path) -> Result<()> {
    // On kernels without TCX (or with --enable-tcx=false) the tc programs are clsact filters,
    // which no pin records once the bpf root is gone: remove them by name on every interface
    // (those that are down too).
    let filters: usize = crate::node::interfaces::links()
        .unwrap_or_default()
        .iter()
        .filter(|l| !l.loopback)
        .map(|l| crate::datapath::tc::detach_clsact(l.index))
        .sum();
    // `exists()` would say "no" for a root this user may not even look at.
    match bpf_root.try_exists() {
        Ok(true) => {}
        Ok(false) => {
            if filters > 0 {
                println!(
                    "detached {filters} clsact filter(s); {} does not exist",
                    bpf_root.display()
                );
            } else {
                println!("nothing to clean up: {} does not exist", bpf_root.display());
            }
            return Ok(());
        }
        Err(e) => return Err(failed(format!("looking at {}", bpf_root.display()), e)),
    }
    if !bpffs::is_bpffs(bpf_root) {
        anyhow::bail!("{} is not on a bpffs; refusing to delete it", bpf_root.display());
    }
    let paths = bpffs::PinPaths::new(bpf_root);
    // Links first: the data path stops translating before its maps go.
    let links = count_files(&paths.links());
    remove(&paths.links()).map_err(|e| failed(format!("removing {}", paths.links().display()), e))?;
    let maps = count_files(&paths.maps());
    remove(&paths.maps()).map_err(|e| failed(format!("removing {}", paths.maps().display()), e))?;
    remove(bpf_root).map_err(|e| failed(format!("removing {}", bpf_root.display()), e))?;
    println!(
        "detached {links} program link(s) and {filters} clsact filter(s), and removed {maps} map \
         pin(s) under {}",
        bpf_root.display()
    );
    Ok(())
}

fn count_files(dir: &Path) -> usize {
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(Result::ok)
        .map(|e| {
            if e.path().is_dir() {
                count_files(&e.path())
            } else {
                1
            }
        })
        .sum()
}

fn remove(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}
