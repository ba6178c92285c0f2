//! The parts of a real Kubernetes node besides kubelet (which `k8s.rs` builds): containerd, its
//! runc shim and `ctr`, runc, and the CNI plugins, from Debian's packages, read through the
//! private apt lists of `kernel/apt.rs` (the machine's apt is untouched) and extracted into
//! `<cache>/node-parts/{bin,cni}` (`LB_NODE_PARTS_DIR` for the tests; `tests/src/kubelet/`).
//!
//! Versions: containerd 2.1 (forky; kubelet 1.37 supports containerd 2.x, and bookworm's and
//! trixie's 1.6/1.7 are past their support), the CNI plugins 1.9 (forky), runc 1.1.5 (bookworm:
//! the runc builds of trixie and later need glibc 2.38, newer than this machine's). containerd and
//! the plugins are Go programs that need only glibc 2.34.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use crate::{
    kernel::PrivateApt,
    util::{self, step},
};

/// A Debian package and the files taken from it.
type Package = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

/// (package, version, [(path in the package, where it goes under node-parts)]).
const PACKAGES: &[Package] = &[
    (
        "containerd",
        "2.1.9+ds1-5",
        &[
            ("usr/bin/containerd", "bin/containerd"),
            ("usr/bin/containerd-shim-runc-v2", "bin/containerd-shim-runc-v2"),
            ("usr/bin/ctr", "bin/ctr"),
        ],
    ),
    ("runc", "1.1.5+ds1-1+deb12u1", &[("usr/sbin/runc", "bin/runc")]),
    (
        "containernetworking-plugins",
        "1.9.1+ds1-1",
        &[
            ("usr/lib/cni/bridge", "cni/bridge"),
            ("usr/lib/cni/host-local", "cni/host-local"),
            ("usr/lib/cni/loopback", "cni/loopback"),
            ("usr/lib/cni/portmap", "cni/portmap"),
        ],
    ),
];

/// Fetches what is missing and returns `<cache>/node-parts`. Idempotent: a stamp records the
/// package versions of the extracted files.
pub fn ensure(cache: &Path) -> Result<PathBuf> {
    let dir = cache.join("node-parts");
    let stamp = dir.join(".stamp");
    let wanted: String = PACKAGES
        .iter()
        .map(|(package, version, _)| format!("{package}={version}\n"))
        .collect();
    let complete = PACKAGES
        .iter()
        .flat_map(|(_, _, files)| files.iter())
        .all(|(_, to)| dir.join(to).is_file());
    if complete && fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(dir);
    }
    let apt = PrivateApt::for_download(cache, "containerd, runc and the CNI plugins")?;
    let _ = fs::remove_file(&stamp);
    let work = dir.join(".download");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    for (package, version, files) in PACKAGES {
        step(&format!("fetching {package} {version} from Debian (once)"));
        util::run(
            apt.command("apt-get")
                .args(["download", "-q", &format!("{package}={version}")])
                .current_dir(&work),
        )
        .with_context(|| {
            format!(
                "downloading {package} {version}; if the mirror no longer serves it, update \
                 PACKAGES in xtask/src/node.rs"
            )
        })?;
        let deb = PrivateApt::downloaded(&work, package)?;
        let tree = work.join(package);
        util::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tree))?;
        for (from, to) in *files {
            let (from, to) = (tree.join(from), dir.join(to));
            let parent = to.parent().expect("a parent");
            fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
            fs::copy(&from, &to)
                .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        }
    }
    for binary in ["bin/containerd", "bin/runc"] {
        util::output(Command::new(dir.join(binary)).arg("--version"))
            .with_context(|| format!("{binary} from Debian does not run on this machine"))?;
    }
    fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    fs::write(&stamp, wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(dir)
}
