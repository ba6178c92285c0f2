//! The `pause` image's program: upstream's `build/pause/linux/pause.c`, read from the
//! k8s.io/kubernetes Go module (downloaded when missing) and compiled static as
//! build/pause/Makefile does.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::sha256_hex;
use crate::{
    k8s::KUBERNETES_VERSION,
    setup,
    util::{self, step},
};

/// Compiles upstream's pause.c (from the k8s.io/kubernetes module) into `work/pause`, static, as
/// build/pause/Makefile does; reused while the source, the flags and the compiler are the same.
pub fn build_pause(work: &Path) -> Result<PathBuf> {
    let source = pause_source(work)?;
    let code = fs::read(&source).with_context(|| format!("reading {}", source.display()))?;
    let tag = pause_tag(&source)?;
    // Upstream: CFLAGS = -Os -Wall -Werror -static -DVERSION=v$(TAG)-$(REV), REV a git describe
    // of the kubernetes tree; here the module version.
    let flags = [
        "-Os".to_string(),
        "-Wall".into(),
        "-Werror".into(),
        "-static".into(),
        format!("-DVERSION=v{tag}-{KUBERNETES_VERSION}"),
    ];
    setup::install(&[("cc", "gcc")])?;
    let cc_version = util::output(Command::new("cc").arg("--version"))?;
    let wanted = format!(
        "source=k8s.io/kubernetes@{KUBERNETES_VERSION}/build/pause/linux/pause.c sha256:{}\ncc={}\nflags={}\n",
        sha256_hex(&code),
        cc_version.lines().next().unwrap_or_default(),
        flags.join(" ")
    );
    let (binary, stamp) = (work.join("pause"), work.join("pause.stamp"));
    if binary.is_file() && fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(binary);
    }
    step(&format!(
        "compiling pause {tag} (static) from {}",
        source.display()
    ));
    // A static binary needs libc.a (libc6-dev), which gcc does not pull in without recommends.
    let libc_a = util::output(Command::new("cc").arg("-print-file-name=libc.a"))?;
    if !Path::new(libc_a.trim()).is_absolute() {
        setup::apt_install(&["libc6-dev"])?;
    }
    fs::create_dir_all(work).with_context(|| format!("creating {}", work.display()))?;
    let _ = fs::remove_file(&stamp);
    let tmp = work.join(format!("pause.tmp-{}", std::process::id()));
    util::run(Command::new("cc").args(&flags).arg("-o").arg(&tmp).arg(&source))?;
    fs::rename(&tmp, &binary).with_context(|| format!("renaming {}", tmp.display()))?;
    let said = util::output(Command::new(&binary).arg("-v"))?;
    if !said.contains(&format!("pause.c v{tag}")) {
        bail!("{} -v printed {said:?}", binary.display());
    }
    fs::write(&stamp, wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(binary)
}

/// pause.c in the Go module cache; downloads the module when it is not there.
pub(crate) fn pause_source(work: &Path) -> Result<PathBuf> {
    let relative = "build/pause/linux/pause.c";
    let go = find_go()?;
    let modcache = util::output(go_command(&go).args(["env", "GOMODCACHE"]))?;
    let file = Path::new(modcache.trim())
        .join(format!("k8s.io/kubernetes@{KUBERNETES_VERSION}"))
        .join(relative);
    if file.is_file() {
        return Ok(file);
    }
    step(&format!(
        "downloading the k8s.io/kubernetes {KUBERNETES_VERSION} module (for {relative})"
    ));
    fs::create_dir_all(work).with_context(|| format!("creating {}", work.display()))?;
    let module = format!("k8s.io/kubernetes@{KUBERNETES_VERSION}");
    let said = util::output(
        go_command(&go)
            .args(["mod", "download", "-json", &module])
            .current_dir(work),
    )?;
    let dir = serde_json::from_str::<Value>(&said)
        .ok()
        .and_then(|v| v["Dir"].as_str().map(PathBuf::from))
        .with_context(|| format!("go mod download -json {module} printed no Dir: {said}"))?;
    let file = dir.join(relative);
    if !file.is_file() {
        bail!("{} is missing after go mod download {module}", file.display());
    }
    Ok(file)
}

/// The pause release the source is (`TAG ?= 3.10.2` in build/pause/Makefile).
fn pause_tag(source: &Path) -> Result<String> {
    let makefile = source
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join("Makefile"))
        .context("pause.c has no build/pause directory")?;
    let text = fs::read_to_string(&makefile).with_context(|| format!("reading {}", makefile.display()))?;
    text.lines()
        .find_map(|l| {
            let (key, value) = l.split_once("?=")?;
            (key.trim() == "TAG").then(|| value.trim().to_string())
        })
        .with_context(|| format!("no `TAG ?=` line in {}", makefile.display()))
}

/// `go`, as `cargo xtask k8s-bins` finds it: on PATH, else the official tarball's place.
fn find_go() -> Result<PathBuf> {
    if util::have("go") {
        Ok(PathBuf::from("go"))
    } else if Path::new("/usr/local/go/bin/go").is_file() {
        Ok(PathBuf::from("/usr/local/go/bin/go"))
    } else {
        bail!(
            "`go` is not installed (not on PATH, not in /usr/local/go/bin); the pause image is compiled from \
             pause.c of the k8s.io/kubernetes {KUBERNETES_VERSION} Go module: install Go from https://go.dev/dl/ \
             or run `cargo xtask k8s-bins` first"
        )
    }
}

/// A `go` command with the environment of the k8s-bins builds (modules as committed, the
/// installed Go only, no go.work from a parent directory).
fn go_command(go: &Path) -> Command {
    let mut cmd = Command::new(go);
    cmd.env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local")
        .env("GOWORK", "off");
    cmd
}
