//! One upstream image: its root assembled in a directory from its steps (again only when the
//! root's stamp lists other inputs), its programs run there with `chroot`, and the root packed
//! as the image's one layer for the archive writer of `image/`.

use std::{fs, io, os::unix::fs::PermissionsExt, path::Path, process::Command, time::Instant};

use anyhow::{Context, Result, bail};

use super::{
    recipes::Check,
    steps::{Step, beside, make_dir},
};
use crate::{
    image::{self, Built, IMAGE_PATH, Layer, Plan, Recipe, remove_if_there},
    util::step,
};

/// Changes whenever the way a root is assembled changes (beyond what its steps describe), so
/// that older root stamps no longer match.
const ASSEMBLY: &str = "lb-upstream-root 1";

/// One image: its config and the steps that make its root.
pub(super) struct Upstream {
    pub(super) name: &'static str,
    pub(super) reference: &'static str,
    /// The image's main program (the `program` of its [`Recipe`]).
    pub(super) program: &'static str,
    pub(super) entrypoint: &'static [&'static str],
    pub(super) cmd: &'static [&'static str],
    /// Empty: none in the config (root), as an image without USER.
    pub(super) user: &'static str,
    pub(super) ports: &'static [&'static str],
    pub(super) steps: Vec<Step>,
    pub(super) checks: &'static [Check],
}

impl Upstream {
    pub(super) fn ensure(&self, build: &Path, out: &Path) -> Result<Built> {
        let root = build.join(format!("{}-root", self.name));
        self.assemble(&root)
            .with_context(|| format!("assembling the root of {}", self.reference))?;
        let layer = layer_of_tree(&root)?;
        let recipe = Recipe {
            name: self.name,
            reference: self.reference,
            program: self.program,
            program_source: root.join(self.program.trim_start_matches('/')),
            tools: &[],
            entrypoint: self.entrypoint,
            cmd: self.cmd,
            user: self.user,
            base: None,
        };
        let config = image::config_of(self.entrypoint, self.cmd, self.user, self.ports)?;
        Plan::with_layer(recipe, layer, config, out).ensure()
    }

    /// Everything that decides the root's contents.
    fn inputs(&self) -> Result<String> {
        let mut text = format!("{ASSEMBLY}\n");
        for step in &self.steps {
            text.push_str(&step.describe()?);
            text.push('\n');
        }
        for (argv, expected) in self.checks {
            text.push_str(&format!("check {argv:?} prints {expected:?}\n"));
        }
        Ok(text)
    }

    /// (Re)makes the root in `root` unless its stamp lists the same inputs, and runs the checks.
    fn assemble(&self, root: &Path) -> Result<()> {
        let stamp = beside(root, ".stamp");
        let inputs = self.inputs()?;
        if root.is_dir() && fs::read_to_string(&stamp).ok().as_deref() == Some(inputs.as_str()) {
            return Ok(());
        }
        let started = Instant::now();
        remove_if_there(&stamp)?;
        if root.exists() {
            fs::remove_dir_all(root).with_context(|| format!("removing {}", root.display()))?;
        }
        make_dir(root, 0o755)?;
        for dir in ["dev", "etc", "proc", "run", "sys"] {
            make_dir(&root.join(dir), 0o755)?;
        }
        make_dir(&root.join("root"), 0o700)?;
        make_dir(&root.join("tmp"), 0o1777)?;
        for step in &self.steps {
            step.apply(root)
                .with_context(|| format!("{} (into {})", step.describe_short(), root.display()))?;
        }
        for (argv, expected) in self.checks {
            check(root, argv, expected).with_context(|| format!("checking the {} image", self.reference))?;
        }
        fs::write(&stamp, inputs).with_context(|| format!("writing {}", stamp.display()))?;
        step(&format!(
            "assembled the root of {} ({} steps, {} checks) in {:.1?}",
            self.reference,
            self.steps.len(),
            self.checks.len(),
            started.elapsed()
        ));
        Ok(())
    }
}

/// Runs `argv` in `root` with `chroot` (as root; else in a user namespace where we are root)
/// and fails unless its output (stdout and stderr) contains `expected`. Exit codes are not
/// judged: some programs exit 1 after printing their version or usage (`iperf -v`).
fn check(root: &Path, argv: &[&str], expected: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    let mut cmd = if unsafe { libc::geteuid() } == 0 {
        Command::new("chroot")
    } else {
        let mut c = Command::new("unshare");
        c.args(["--map-root-user", "chroot"]);
        c
    };
    cmd.arg(root)
        .args(argv)
        .env_clear()
        .env("PATH", IMAGE_PATH)
        .env("HOME", "/root");
    let out = cmd.output().with_context(|| format!("cannot run {cmd:?}"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if !text.contains(expected) {
        bail!(
            "`{}` in the image's root ({}) exited {} and printed {:?}, without {expected:?}",
            argv.join(" "),
            root.display(),
            out.status,
            text.trim()
        );
    }
    Ok(())
}

/// The root as a layer: every directory, file and link with its mode (owners are root).
fn layer_of_tree(root: &Path) -> Result<Layer> {
    let mut layer = Layer::default();
    add_tree(&mut layer, root, "")?;
    Ok(layer)
}

fn add_tree(layer: &mut Layer, dir: &Path, prefix: &str) -> Result<()> {
    let mut entries = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<io::Result<Vec<_>>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let name = entry
            .file_name()
            .into_string()
            .map_err(|n| anyhow::anyhow!("{} has a name that is not UTF-8: {n:?}", dir.display()))?;
        let rel = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let meta = fs::symlink_metadata(&path).with_context(|| format!("reading {}", path.display()))?;
        let mode = meta.permissions().mode() & 0o7777;
        let kind = meta.file_type();
        if kind.is_symlink() {
            layer.symlink(&rel, fs::read_link(&path)?)?;
        } else if kind.is_dir() {
            layer.dir(&rel, mode)?;
            add_tree(layer, &path, &rel)?;
        } else if kind.is_file() {
            let bytes = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            layer.file(&rel, mode, bytes)?;
        } else {
            bail!("{} is not a file, a directory or a symlink", path.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
