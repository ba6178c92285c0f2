//! Container images for a real kubelet + containerd node, built without a registry or a container
//! engine: OCI image-layout tar archives that `ctr -n k8s.io images import <archive>` loads.
//!
//! - `lb-agent` (`localhost/lb-agent:dev`): the release `lb-agent` at `/usr/local/bin/lb-agent`, as
//!   the runtime stage of `manifests/Dockerfile` installs it on `debian:bookworm-slim`. That base
//!   cannot be pulled here, and this machine is Debian bookworm, so its stand-in is the host's own
//!   files: `/bin/sh`, `stat` and `mount` (the DaemonSet's init container mounts bpffs with them),
//!   `cat` and `ls`, each with its shared-library closure (from `ldd`), in the host's usrmerge
//!   layout (`/bin -> usr/bin`, `/lib -> usr/lib`, ...). The builder refuses to run on another
//!   release; a unit test checks the recipe against the Dockerfile and the DaemonSet.
//! - `lb-probe` (`localhost/lb-probe:dev`): the traffic helper of `tests/` (debug build), serving
//!   TCP 8080 and UDP 5353 on both families (`[::]`, dual-stack sockets) and answering with its
//!   host name, which is the pod's name.
//! - `pause` (`localhost/pause:3.10`): Kubernetes' own `build/pause/linux/pause.c`, from the
//!   `k8s.io/kubernetes` module that `cargo xtask k8s-bins` uses, compiled static.
//! - `kube-proxy` (`localhost/kube-proxy:v1.37.1`): the kube-proxy `cargo xtask k8s-bins` builds
//!   (static) at `/usr/local/bin/kube-proxy`, as in `registry.k8s.io/kube-proxy`, with the programs
//!   it runs: `nft` (nftables mode, through knftables, and `--cleanup`), and `iptables`,
//!   `iptables-save`, `iptables-restore` and their `ip6tables` twins (iptables mode, and the
//!   cleanup of iptables rules every mode does at start and in `--cleanup`). They are the host's
//!   (Debian bookworm: the nf_tables variant, `iptables -> /etc/alternatives/iptables ->
//!   iptables-nft -> xtables-nft-multi`, links kept as links), with their libraries and the
//!   iptables extensions they load with dlopen(), and `/etc/protocols`, which both read protocol
//!   names from (see `KUBE_PROXY_TOOLS`). Not `conntrack` (kube-proxy 1.37 clears
//!   conntrack entries over netlink), `ipset` or `modprobe` (IPVS mode only; without `modprobe` the
//!   IPVS cleanup is skipped, as kube-proxy does on a node without the module).
//!
//! Each archive holds one gzip layer, its config and manifest, and an `index.json` naming the
//! image. The same inputs give the same bytes: entries sorted, mtime 0, uid/gid 0, a fixed gzip
//! level and no timestamp in the gzip header, JSON with sorted keys. A stamp next to each archive
//! lists its inputs (every file's sha256, the config, the format); when they are unchanged the
//! archive is reused. `images.json` in the output directory lists name, reference, archive and
//! manifest digest of each image, for the tests.
//!
//! The files: `recipes` (what each image is made of), `pause` (the pause program, compiled from
//! upstream's source), `layer` (a layer's entries and its reproducible tar), `host` (host
//! programs with their libraries in a layer), `oci` (configs, digests, canonical JSON),
//! `archive` (one image's archive and its stamp), `output` (`images.json`, the lock, atomic
//! writes); `dockerfile` (tests only) checks the lb-agent recipe against manifests/.

mod archive;
#[cfg(test)]
mod dockerfile;
mod host;
mod layer;
mod oci;
mod output;
mod pause;
mod recipes;

use std::{
    fs,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{Context, Result};

use self::recipes::{agent_recipe, check_host_release, kube_proxy_recipe, pause_recipe, probe_recipe};
pub(crate) use self::{
    archive::Plan,
    layer::Layer,
    oci::{IMAGE_PATH, config_of, sha256_hex},
    output::{lock, remove_if_there, write_index},
    pause::pause_source,
};
pub use self::{pause::build_pause, recipes::Recipe};
use crate::{
    ebpf, setup,
    util::{self, clean_cargo, step, workspace_root},
};

/// One image archive, current on return from [`ensure`].
#[derive(Debug, Clone)]
pub struct Built {
    /// Short name: `lb-agent`, `lb-probe`, `pause`.
    pub name: &'static str,
    /// The reference `ctr images import` gives the image (`localhost/lb-agent:dev`).
    pub reference: &'static str,
    /// The archive (absolute path).
    pub archive: PathBuf,
    /// `sha256:...` of the image manifest (what `ctr images ls` shows as DIGEST).
    pub manifest_digest: String,
    /// Whether this call wrote the archive (false: reused, its inputs were unchanged).
    pub rebuilt: bool,
}

/// The default output directory, `<workspace>/target/images`.
pub fn default_dir() -> PathBuf {
    workspace_root().join("target/images")
}

/// Builds what is needed (the eBPF object, lb-agent, lb-probe, pause; kube-proxy comes from
/// `cargo xtask k8s-bins`, built if missing) and every image archive
/// whose inputs changed, into `out`; writes `out/images.json`. Archives whose stamps match are
/// reused without being rewritten.
pub fn ensure(out: &Path) -> Result<Vec<Built>> {
    let started = Instant::now();
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = fs::canonicalize(out).with_context(|| format!("resolving {}", out.display()))?;
    let _lock = lock(&out.join(".lock"))?;
    // Before any build: an image of host files only stands in for its base on the same release.
    for base in [agent_recipe(), probe_recipe()].iter().filter_map(|r| r.base) {
        check_host_release(base)?;
    }

    setup::ebpf_toolchain_and_linker()?;
    ebpf::build()?;
    step("building lb-agent (release) and lb-probe for the images");
    util::run(clean_cargo(None).args([
        "build",
        "--release",
        "--quiet",
        "--package",
        "lb-agent",
        "--bin",
        "lb-agent",
    ]))?;
    util::run(clean_cargo(None).args(["build", "--quiet", "--package", "lb-tests", "--bin", "lb-probe"]))?;
    let pause = build_pause(&out.join("build"))?;
    // Built once from its Go module (with the control plane's binaries); a stamp check when cached.
    let kube_proxy = crate::k8s::ensure(&util::cache_dir())?.kube_proxy;

    let recipes = [
        agent_recipe(),
        probe_recipe(),
        pause_recipe(pause),
        kube_proxy_recipe(kube_proxy),
    ];
    let mut plans = Vec::new();
    for recipe in recipes {
        plans.push(Plan::new(recipe, &out)?);
    }
    let built = in_parallel(&plans, Plan::ensure)?;
    let index = write_index(&out, &built)?;
    step(&format!(
        "images ready in {:.1?} ({} rebuilt): {}",
        started.elapsed(),
        built.iter().filter(|b| b.rebuilt).count(),
        index.display()
    ));
    Ok(built)
}

/// Builds every item on a thread of its own (the layers' compression is the long part); the
/// first error wins.
pub(crate) fn in_parallel<T: Sync>(
    items: &[T],
    build: impl Fn(&T) -> Result<Built> + Sync,
) -> Result<Vec<Built>> {
    let build = &build;
    let results: Vec<Result<Built>> = std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .iter()
            .map(|item| scope.spawn(move || build(item)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("image build panicked")))
            })
            .collect()
    });
    results.into_iter().collect()
}
