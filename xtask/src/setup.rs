//! Installs what the build and the tests need, when it is missing: the pinned eBPF nightly with
//! rust-src, Debian packages (bpftool, iptables, nftables, ...), and bpf-linker built against the
//! nightly's own libLLVM. The userspace toolchain itself is installed by `./x` before cargo runs.

use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::util::{self, cache_dir, ebpf_toolchain, have, output, run, step};

/// Debian packages, by the command that proves each is installed.
const PACKAGES: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("bpftool", "bpftool"),
    ("iptables", "iptables"),
    ("nft", "nftables"),
    ("conntrack", "conntrack"),
    ("tcpdump", "tcpdump"),
    ("nsenter", "util-linux"),
    ("openssl", "openssl"),
    // The plots of docs/bench/ (`cargo xtask bench`).
    ("gnuplot", "gnuplot-nox"),
];

pub fn all() -> Result<()> {
    packages()?;
    ebpf_toolchain_and_linker()?;
    Ok(())
}

/// The nightly and bpf-linker, which `build-ebpf` needs.
pub fn ebpf_toolchain_and_linker() -> Result<()> {
    nightly()?;
    bpf_linker()?;
    Ok(())
}

/// Installs the Debian packages whose commands are missing.
pub fn packages() -> Result<()> {
    install(PACKAGES)
}

/// Installs those of `packages` (command, Debian package) whose command is missing.
pub fn install(packages: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .filter(|(cmd, _)| !have(cmd))
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    apt_install(&missing)
}

/// Installs Debian packages with the machine's apt.
pub fn apt_install(missing: &[&str]) -> Result<()> {
    if !nix_is_root() {
        bail!(
            "missing Debian packages {missing:?}; run as root or install them: apt-get install {}",
            missing.join(" ")
        );
    }
    step(&format!("installing Debian packages: {}", missing.join(" ")));
    let install = |update: bool| -> Result<()> {
        if update {
            run(Command::new("apt-get").args(["update", "-q"]))?;
        }
        run(Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(missing)
            .env("DEBIAN_FRONTEND", "noninteractive"))
    };
    // A fresh machine may have stale package lists: update only if the first try fails.
    install(false).or_else(|_| install(true))
}

fn nix_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The dated nightly with rust-src (for `-Z build-std=core`).
fn nightly() -> Result<()> {
    let toolchain = ebpf_toolchain();
    let installed = output(Command::new("rustup").args(["toolchain", "list"]))?;
    let has_toolchain = installed.lines().any(|l| l.starts_with(&toolchain));
    let has_src = has_toolchain
        && output(Command::new("rustup").args([
            "component",
            "list",
            "--installed",
            "--toolchain",
            &toolchain,
        ]))?
        .lines()
        .any(|l| l.starts_with("rust-src"));
    if !has_src {
        step(&format!(
            "installing Rust toolchain {toolchain} with rust-src (for the eBPF crate)"
        ));
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            &toolchain,
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))?;
    }
    Ok(())
}

/// The nightly's sysroot and LLVM major version (`rustc -vV`).
fn nightly_llvm() -> Result<(PathBuf, String, PathBuf)> {
    let toolchain = ebpf_toolchain();
    let sysroot = PathBuf::from(
        output(Command::new("rustup").args(["run", &toolchain, "rustc", "--print", "sysroot"]))?.trim(),
    );
    let version = output(Command::new("rustup").args(["run", &toolchain, "rustc", "-vV"]))?;
    let llvm = version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .context("rustc -vV printed no LLVM version")?;
    let major = llvm.split('.').next().unwrap_or_default().to_string();
    let lib = fs::read_dir(sysroot.join("lib"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("libLLVM.so.{major}")))
        })
        .with_context(|| format!("no libLLVM.so.{major}* in {}/lib", sysroot.display()))?;
    Ok((sysroot, major, lib))
}

/// Where bpf-linker is cached: one build per (bpf-linker version, nightly).
pub fn bpf_linker_dir() -> PathBuf {
    let version = std::env::var("LB_BPF_LINKER_VERSION").unwrap_or_else(|_| "0.13.0".into());
    cache_dir().join(format!("bpf-linker-{version}-{}", ebpf_toolchain()))
}

/// Builds bpf-linker from crates.io against the nightly's libLLVM, once.
fn bpf_linker() -> Result<PathBuf> {
    let root = bpf_linker_dir();
    let binary = root.join("bin/bpf-linker");
    if binary.is_file()
        && Command::new(&binary)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    {
        return Ok(binary);
    }
    let version = std::env::var("LB_BPF_LINKER_VERSION").unwrap_or_else(|_| "0.13.0".into());
    let (_, major, lib) = nightly_llvm()?;
    // LLVM_PREFIX must hold lib/libLLVM.so; point it at the toolchain's versioned library.
    let prefix = root.join("llvm-prefix");
    fs::create_dir_all(prefix.join("lib"))?;
    let link = prefix.join("lib/libLLVM.so");
    let _ = fs::remove_file(&link);
    symlink(&lib, &link)?;
    let lib_dir = lib.parent().map(Path::to_path_buf).unwrap_or_default();
    step(&format!(
        "building bpf-linker {version} against LLVM {major} of {} (about 2 minutes, once)",
        ebpf_toolchain()
    ));
    run(util::clean_cargo(None)
        .args([
            "install",
            "bpf-linker",
            "--version",
            &version,
            "--locked",
            "--no-default-features",
        ])
        .args(["--features", &format!("llvm-{major}")])
        .arg("--root")
        .arg(&root)
        .env("LLVM_PREFIX", &prefix)
        // A runpath to the toolchain's lib dir, so the linker runs outside rustup too.
        .env(
            "RUSTFLAGS",
            format!("-C link-arg=-Wl,-rpath,{}", lib_dir.display()),
        )
        .current_dir(cache_dir()))?;
    if !binary.is_file() {
        bail!("bpf-linker was not installed at {}", binary.display());
    }
    Ok(binary)
}
