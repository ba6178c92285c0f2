//! The Cilium bundle the benchmark runs as a peer (`tests/src/bench/cilium.rs`), cached under
//! `<cache>/cilium-<version>/` and named to lb-bench by `LB_CILIUM_DIR`:
//!
//! - `bin/cilium-agent`: built from Cilium's published Go module (`k8s.rs`, wrapper module
//!   `xtask/go/cilium`);
//! - `lib/bpf`: the datapath sources of the same module, which the agent compiles at run time
//!   (its `--lib-dir`);
//! - `crds/`: the release's CRDs (its operator installs them in a cluster; lb-bench applies them);
//! - `llvm/`: clang 19 from Debian bookworm (Cilium needs clang >= 18.1; the machine's is 14),
//!   extracted from its packages, read through the private apt lists of `kernel/apt.rs`;
//! - `VERSION`.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{
    kernel::PrivateApt,
    util::{self, step},
};

/// The Cilium release: the newest the Go module proxy serves.
pub const VERSION: &str = "v1.20.2";

/// clang and what it loads, from bookworm (the build of trixie's LLVM 19 for Debian 12).
const LLVM_VERSION: &str = "1:19.1.7-3~deb12u1";
const LLVM_PACKAGES: [&str; 4] = [
    "clang-19",
    "libclang-cpp19",
    "libllvm19",
    "libclang-common-19-dev",
];

/// Builds or finds the bundle and returns its directory.
pub fn ensure(cache: &Path) -> Result<PathBuf> {
    let dir = cache.join(format!("cilium-{VERSION}"));
    let (_agent, module) = crate::k8s::ensure_cilium_agent(cache, &dir.join("bin"))?;
    copy_sources(&module, &dir)?;
    ensure_llvm(cache, &dir)?;
    fs::write(dir.join("VERSION"), VERSION.trim_start_matches('v'))?;
    Ok(dir)
}

/// The BPF sources and the CRDs of the module the agent was built from (read-only in Go's module
/// cache), copied when the copy is not of this release.
fn copy_sources(module: &Path, dir: &Path) -> Result<()> {
    let stamp = dir.join(".sources.stamp");
    let wanted = module.display().to_string();
    if fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(());
    }
    step(&format!(
        "copying Cilium's BPF sources and CRDs from {}",
        module.display()
    ));
    let _ = fs::remove_file(&stamp);
    let bpf = dir.join("lib/bpf");
    let _ = fs::remove_dir_all(&bpf);
    copy_tree(&module.join("bpf"), &bpf)?;
    let crds = dir.join("crds");
    let _ = fs::remove_dir_all(&crds);
    fs::create_dir_all(&crds)?;
    for version in ["v2", "v2alpha1"] {
        let from = module.join("pkg/k8s/apis/cilium.io/client/crds").join(version);
        for entry in fs::read_dir(&from).with_context(|| format!("reading {}", from.display()))? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "yaml") {
                fs::copy(&path, crds.join(path.file_name().expect("a file name")))?;
            }
        }
    }
    fs::write(&stamp, wanted)?;
    Ok(())
}

/// Copies a tree of directories and files, writable (the module cache's are read-only).
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            fs::copy(entry.path(), &target).with_context(|| format!("copying {}", entry.path().display()))?;
            let mut perms = fs::metadata(&target)?.permissions();
            #[allow(clippy::permissions_set_readonly_false)]
            perms.set_readonly(false);
            fs::set_permissions(&target, perms)?;
        }
    }
    Ok(())
}

/// clang 19 in `llvm/`, checked to run with the library path lb-bench gives the agent.
fn ensure_llvm(cache: &Path, dir: &Path) -> Result<()> {
    let llvm = dir.join("llvm");
    let stamp = llvm.join(".stamp");
    let wanted = format!("{LLVM_VERSION}\n{}\n", LLVM_PACKAGES.join(" "));
    if fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(());
    }
    let apt = PrivateApt::for_download(cache, "clang for cilium-agent")?;
    let _ = fs::remove_dir_all(&llvm);
    let work = dir.join(".download");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    step(&format!(
        "fetching clang {LLVM_VERSION} from Debian for cilium-agent (once)"
    ));
    let requests: Vec<String> = LLVM_PACKAGES
        .iter()
        .map(|p| format!("{p}={LLVM_VERSION}"))
        .collect();
    util::run(
        apt.command("apt-get")
            .args(["download", "-q"])
            .args(&requests)
            .current_dir(&work),
    )
    .context(
        "downloading clang 19; if the mirror no longer serves it, update LLVM_VERSION in xtask/src/cilium.rs",
    )?;
    for package in LLVM_PACKAGES {
        let deb = PrivateApt::downloaded(&work, package)?;
        util::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&llvm))?;
    }
    let version = util::output(
        Command::new(llvm.join("usr/lib/llvm-19/bin/clang"))
            .arg("--version")
            .env("LD_LIBRARY_PATH", library_path(dir)),
    )
    .context("clang 19 from Debian does not run on this machine")?;
    if !version.contains("clang version 19") {
        bail!("clang --version printed {version:?}");
    }
    fs::remove_dir_all(&work)?;
    fs::write(&stamp, wanted)?;
    Ok(())
}

/// The LD_LIBRARY_PATH under which the bundle's clang finds its libraries (lb-bench sets the
/// same for the agent, whose child it is).
fn library_path(dir: &Path) -> String {
    let llvm = dir.join("llvm/usr");
    format!(
        "{}:{}",
        llvm.join("lib/llvm-19/lib").display(),
        llvm.join("lib/x86_64-linux-gnu").display()
    )
}
