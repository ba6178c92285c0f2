//! Builds the eBPF object with the pinned nightly and bpf-linker, with BTF (so bpftool prints
//! named fields), and copies it to `target/bpf/lb-ebpf.o` without its DWARF sections, where
//! `lb-agent/build.rs` embeds it. The DWARF (`-Cdebuginfo=2`, from which bpf-linker makes the
//! BTF) is 3.4 of the object's 4.3 MB and nothing loads it: embedded, it was 3.4 MB more of
//! lb-agent's binary and of its resident set once the loader had read the object. The unstripped
//! build stays in `target/bpf/bpfel-unknown-none/release/lb-ebpf` (`llvm-objdump -S` there).

use std::{fs, path::PathBuf};

use anyhow::{Context, Result};

use crate::{
    setup::bpf_linker_dir,
    util::{clean_cargo, ebpf_toolchain, output, run, step, workspace_root},
};

/// The object's stable path, read by `lb-agent/build.rs`.
pub fn object_path() -> PathBuf {
    workspace_root().join("target/bpf/lb-ebpf.o")
}

/// The test build of the programs (`--cfg lb_test_variant`: connect4 bumps the `test_variant`
/// counter), which the upgrade tests swap in to prove a running data path is replaced in place.
pub fn variant_object_path() -> PathBuf {
    workspace_root().join("target/bpf/lb-ebpf-test-variant.o")
}

pub fn build() -> Result<PathBuf> {
    build_into("target/bpf", &[], &object_path())
}

pub fn build_variant() -> Result<PathBuf> {
    build_into(
        "target/bpf-variant",
        &["--cfg=lb_test_variant"],
        &variant_object_path(),
    )
}

fn build_into(dir: &str, extra_flags: &[&str], object: &std::path::Path) -> Result<PathBuf> {
    step(&format!(
        "building the eBPF object {} (lb-ebpf, bpfel-unknown-none)",
        object.file_name().unwrap_or_default().to_string_lossy()
    ));
    let target_dir = workspace_root().join(dir);
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bpf_linker_dir().join("bin")];
    paths.extend(std::env::split_paths(&path));
    // The same flags as aya-build: BTF comes from debuginfo plus bpf-linker's --btf.
    let mut flags = vec![
        "--cfg=bpf_target_arch=\"x86_64\"",
        "-Cdebuginfo=2",
        "-Clink-arg=--btf",
        // bpf-linker's default (--bpf-expand-memcpy-in-order) keeps LLVM from expanding any
        // memset: each one, even a struct's 3 padding bytes, became a call to a byte loop that
        // every verifier walks once per state reaching it and that runs a byte per iteration
        // (the 64-byte FIB lookup of every masqueraded new flow: 64 iterations). Expanded into
        // stores: Linux 6.18 walks lb_tc_ingress for 591k steps instead of 686k, lb_connect6
        // for 8k instead of 15k (docs/architecture.md, section 7).
        "-Clink-arg=--disable-expand-memcpy-in-order",
        // Global functions (verified once each, on their own) must stay global: bpf-linker
        // internalizes every symbol it is not told to export.
        "-Clink-arg=--export=lb_reclaim_port4,lb_reclaim_port6,lb_sctp_checksum,lb_ct_filter_note4,lb_ct_filter_note6",
    ];
    flags.extend_from_slice(extra_flags);
    let rustflags = flags.join("\x1f");
    run(clean_cargo(Some(&ebpf_toolchain()))
        .args(["build", "--package", "lb-ebpf", "--bins", "--release"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .arg("--target-dir")
        .arg(&target_dir)
        .env("PATH", std::env::join_paths(paths)?)
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags))?;
    let built = target_dir.join("bpfel-unknown-none/release/lb-ebpf");
    check_no_panics(&fs::read(&built).with_context(|| format!("reading {}", built.display()))?)
        .with_context(|| format!("checking {}", built.display()))?;
    let stripped = target_dir.join("lb-ebpf.stripped.o");
    run(std::process::Command::new(objcopy()?)
        .arg("--strip-debug")
        .arg(&built)
        .arg(&stripped))?;
    // Copy only when changed, so lb-agent is not rebuilt for nothing.
    let new = fs::read(&stripped).with_context(|| format!("reading {}", stripped.display()))?;
    if let Some(parent) = object.parent() {
        fs::create_dir_all(parent)?;
    }
    if fs::read(object).ok().as_deref() != Some(new.as_slice()) {
        fs::write(object, &new).with_context(|| format!("writing {}", object.display()))?;
    }
    Ok(object.to_path_buf())
}

/// LLVM's objcopy as the eBPF toolchain ships it (`rust-objcopy`, in every toolchain's rustc
/// component): it knows BPF objects and keeps `.BTF` and `.BTF.ext`, which are not DWARF.
fn objcopy() -> Result<PathBuf> {
    let sysroot = output(std::process::Command::new("rustup").args([
        "run",
        &ebpf_toolchain(),
        "rustc",
        "--print",
        "sysroot",
    ]))?;
    let rustlib = PathBuf::from(sysroot.trim()).join("lib/rustlib");
    fs::read_dir(&rustlib)
        .with_context(|| format!("reading {}", rustlib.display()))?
        .flatten()
        .map(|host| host.path().join("bin/rust-objcopy"))
        .find(|tool| tool.is_file())
        .with_context(|| format!("no rust-objcopy under {}", rustlib.display()))
}

/// A panic in a program compiles to a jump to `core::panicking` code that never returns, which
/// every verifier rejects (a loop, or "last insn is not an exit or jmp"), and only when the
/// program is loaded. Said here, at build time, with the functions to look at.
fn check_no_panics(elf: &[u8]) -> Result<()> {
    use object::{Object, ObjectSymbol};
    let file = object::File::parse(elf).context("parsing the eBPF object")?;
    let panics: Vec<String> = file
        .symbols()
        .filter_map(|s| s.name().ok())
        .filter(|name| name.contains("9panicking"))
        .map(str::to_owned)
        .collect();
    if !panics.is_empty() {
        anyhow::bail!(
            "the eBPF object has panic paths, which the verifier rejects: {}. A division, an \
             index or an unwrap the compiler cannot prove safe; `llvm-objdump -dr` shows which \
             program calls them",
            panics.join(", ")
        );
    }
    Ok(())
}
