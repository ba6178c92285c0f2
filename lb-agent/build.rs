//! Embeds the eBPF object built by `cargo xtask build-ebpf` (`target/bpf/lb-ebpf.o`, or the file
//! named by `LB_EBPF_OBJECT`). Without it, an empty stub is embedded so that `cargo build`,
//! `cargo clippy` and the unit tests work without the nightly toolchain; the agent then says at
//! run time that the object is missing.

use std::{env, fs, path::PathBuf};

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let source = env::var_os("LB_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join("../target/bpf/lb-ebpf.o"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("lb-ebpf.o");
    println!("cargo::rerun-if-env-changed=LB_EBPF_OBJECT");
    println!("cargo::rerun-if-changed={}", source.display());
    let bytes = fs::read(&source).unwrap_or_default();
    if bytes.is_empty() {
        println!(
            "cargo::warning=no eBPF object at {}: embedding an empty stub (run `cargo xtask build-ebpf`)",
            source.display()
        );
    }
    // Write only on change so dependants are not rebuilt for nothing.
    if fs::read(&out).ok() != Some(bytes.clone()) {
        fs::write(&out, bytes).expect("write the embedded object");
    }
}
