//! The steps that make an image's root (relative paths, no leading `/`): packages extracted
//! with `dpkg-deb -x`, their documentation pruned, files, directories and links placed exactly
//! once, and BusyBox's applets linked as the official image or as Alpine does.

use std::{
    fs,
    io::{self, Write as _},
    os::unix::fs::{PermissionsExt, symlink},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{
    image::{self, IMAGE_PATH},
    util,
};

/// Left out of the package contents, as Debian's slim images do (the licences stay).
const PRUNED: &[&str] = &[
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bug",
];

/// Where BusyBox's applets are linked.
#[derive(Debug, Clone, Copy)]
pub(super) enum Applets {
    /// As the official busybox image: every applet in /bin (and at its own place when that is
    /// elsewhere, for absolute paths like /usr/bin/env).
    Official,
    /// As on Alpine: at the applet's own place, for every applet whose name no file in the
    /// root's PATH directories has.
    WhereMissing,
}

/// One step of making an image's root, relative paths without the leading `/`.
#[derive(Debug)]
pub(super) enum Step {
    /// `dpkg-deb -x` of a package.
    Deb(PathBuf),
    /// Removes [`PRUNED`] and all of /usr/share/doc but the copyright files.
    Prune,
    /// One file of a package.
    FromDeb {
        deb: PathBuf,
        from: &'static str,
        path: &'static str,
    },
    Copy {
        path: &'static str,
        mode: u32,
        source: PathBuf,
    },
    Text {
        path: &'static str,
        mode: u32,
        text: &'static str,
    },
    Dir {
        path: &'static str,
        mode: u32,
    },
    /// (path, target) symlinks.
    Links(&'static [(&'static str, &'static str)]),
    /// Links to /bin/busybox, from its `--list-full`.
    Applets(Applets),
}

impl Step {
    /// What the stamp compares: contents by digest, packages by file name and size.
    pub(super) fn describe(&self) -> Result<String> {
        let deb = |deb: &Path| -> Result<String> {
            let size = fs::metadata(deb)
                .with_context(|| format!("reading {}", deb.display()))?
                .len();
            Ok(format!("{} {size}", file_name(deb)?))
        };
        let digest = |source: &Path| -> Result<String> {
            let bytes = fs::read(source).with_context(|| format!("reading {}", source.display()))?;
            Ok(format!("sha256:{}", image::sha256_hex(&bytes)))
        };
        Ok(match self {
            Step::Deb(path) => format!("deb {}", deb(path)?),
            Step::Prune => format!("prune {PRUNED:?}, usr/share/doc but */copyright"),
            Step::FromDeb { deb: d, from, path } => format!("from deb {} {from} -> /{path}", deb(d)?),
            Step::Copy { path, mode, source } => format!("file /{path} {mode:04o} {}", digest(source)?),
            Step::Text { path, mode, text } => format!("text /{path} {mode:04o} {text:?}"),
            Step::Dir { path, mode } => format!("dir /{path} {mode:04o}"),
            Step::Links(links) => format!("links {links:?}"),
            Step::Applets(how) => format!("busybox applets {how:?}"),
        })
    }

    pub(super) fn describe_short(&self) -> String {
        match self {
            Step::Deb(path) | Step::FromDeb { deb: path, .. } => format!("extracting {}", path.display()),
            Step::Copy { path, source, .. } => format!("copying {} to /{path}", source.display()),
            other => format!("{other:?}"),
        }
    }

    pub(super) fn apply(&self, root: &Path) -> Result<()> {
        match self {
            Step::Deb(deb) => util::run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(root)),
            Step::Prune => prune(root),
            Step::FromDeb { deb, from, path } => {
                let scratch = beside(root, &format!(".scratch-{}", std::process::id()));
                let _ = fs::remove_dir_all(&scratch);
                util::run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&scratch))?;
                let result = place(root, path, 0o755, &fs::read(scratch.join(from))?);
                fs::remove_dir_all(&scratch)?;
                result
            }
            Step::Copy { path, mode, source } => {
                let bytes = fs::read(source).with_context(|| format!("reading {}", source.display()))?;
                place(root, path, *mode, &bytes)
            }
            Step::Text { path, mode, text } => place(root, path, *mode, text.as_bytes()),
            Step::Dir { path, mode } => {
                make_parents(root, path)?;
                make_dir(&root.join(path), *mode)
            }
            Step::Links(links) => {
                for (path, target) in *links {
                    link(root, path, target)?;
                }
                Ok(())
            }
            Step::Applets(how) => {
                let list = util::output(Command::new(root.join("bin/busybox")).arg("--list-full"))?;
                let applets = parse_applets(&list)?;
                let paths = match how {
                    Applets::Official => official_applet_links(&applets),
                    Applets::WhereMissing => missing_applet_links(&applets, |name| on_path(root, name)),
                };
                for path in paths {
                    link(root, &path, "/bin/busybox")?;
                }
                Ok(())
            }
        }
    }
}

/// Whether a file (or link) named `name` is in one of the image PATH's directories of `root`.
fn on_path(root: &Path, name: &str) -> bool {
    IMAGE_PATH
        .split(':')
        .any(|dir| fs::symlink_metadata(root.join(dir.trim_start_matches('/')).join(name)).is_ok())
}

/// `busybox --list-full` (`usr/bin/wget`, one a line) as (directory, name); applets outside
/// a directory (`linuxrc`) are left out.
fn parse_applets(list: &str) -> Result<Vec<(String, String)>> {
    let mut applets = Vec::new();
    for line in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let Some((dir, name)) = line.rsplit_once('/') else {
            continue;
        };
        let plain = |s: &str| !s.is_empty() && s.split('/').all(|c| !c.is_empty() && c != "." && c != "..");
        if !plain(dir) || !plain(name) || line.starts_with('/') {
            bail!("`busybox --list-full` printed {line:?}, not a relative path");
        }
        applets.push((dir.to_string(), name.to_string()));
    }
    if applets.is_empty() {
        bail!("`busybox --list-full` listed no applets");
    }
    Ok(applets)
}

/// The official image's links: every applet in /bin, and at its own place too when that is
/// another directory.
fn official_applet_links(applets: &[(String, String)]) -> Vec<String> {
    let mut paths: Vec<String> = applets
        .iter()
        .flat_map(|(dir, name)| {
            let own = (dir != "bin").then(|| format!("{dir}/{name}"));
            std::iter::once(format!("bin/{name}")).chain(own)
        })
        .filter(|p| p != "bin/busybox")
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

/// Alpine's links, for the applets whose names `present` does not know.
fn missing_applet_links(applets: &[(String, String)], present: impl Fn(&str) -> bool) -> Vec<String> {
    let mut paths: Vec<String> = applets
        .iter()
        .filter(|(_, name)| name != "busybox" && !present(name))
        .map(|(dir, name)| format!("{dir}/{name}"))
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

fn prune(root: &Path) -> Result<()> {
    for dir in PRUNED {
        let path = root.join(dir);
        if path.exists() {
            fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    let docs = root.join("usr/share/doc");
    if !docs.is_dir() {
        return Ok(());
    }
    for entry in fs::read_dir(&docs)? {
        let path = entry?.path();
        if fs::symlink_metadata(&path)?.is_dir() {
            for inner in fs::read_dir(&path)? {
                let inner = inner?.path();
                if inner.file_name().is_some_and(|n| n == "copyright") {
                    continue;
                }
                if fs::symlink_metadata(&inner)?.is_dir() {
                    fs::remove_dir_all(&inner)?;
                } else {
                    fs::remove_file(&inner)?;
                }
            }
        }
    }
    Ok(())
}

/// Creates the missing directories above `rel` (0755).
fn make_parents(root: &Path, rel: &str) -> Result<()> {
    let mut dir = root.to_path_buf();
    let parents: Vec<&str> = rel.split('/').collect();
    for part in &parents[..parents.len().saturating_sub(1)] {
        dir.push(part);
        if fs::symlink_metadata(&dir).is_err() {
            make_dir(&dir, 0o755)?;
        }
    }
    Ok(())
}

/// A directory with exactly `mode` (whatever the umask), or that mode given to one already there.
pub(super) fn make_dir(path: &Path, mode: u32) -> Result<()> {
    match fs::create_dir(path) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => {}
        other => other.with_context(|| format!("creating {}", path.display()))?,
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", path.display()))
}

/// A new file at `root/rel` (nothing may be there yet: packages and steps must not collide).
pub(super) fn place(root: &Path, rel: &str, mode: u32, bytes: &[u8]) -> Result<()> {
    make_parents(root, rel)?;
    let path = root.join(rel);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .with_context(|| format!("creating {} (is it in a package too?)", path.display()))?;
    file.write_all(bytes)?;
    drop(file);
    fs::set_permissions(&path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", path.display()))
}

/// A new symlink at `root/rel`.
pub(super) fn link(root: &Path, rel: &str, target: &str) -> Result<()> {
    make_parents(root, rel)?;
    let path = root.join(rel);
    symlink(target, &path).with_context(|| format!("linking {} -> {target}", path.display()))
}

/// `dir/name` as `dir/name<suffix>` (`Path::with_extension` would cut `pause-3.10.2-root`).
pub(super) fn beside(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

fn file_name(path: &Path) -> Result<&str> {
    path.file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("{} has no UTF-8 file name", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applets_are_linked_as_in_each_image() {
        let list = "linuxrc\nbin/sh\nbin/cat\nusr/bin/wget\nusr/bin/nc\nsbin/ip\nbin/busybox\n";
        let applets = parse_applets(list).unwrap();
        assert_eq!(applets.len(), 6, "linuxrc has no directory: {applets:?}");
        assert_eq!(
            official_applet_links(&applets),
            [
                "bin/cat",
                "bin/ip",
                "bin/nc",
                "bin/sh",
                "bin/wget",
                "sbin/ip",
                "usr/bin/nc",
                "usr/bin/wget"
            ]
        );
        // Debian's nc, ip and sh win, wherever in PATH they are.
        let debian = ["nc", "ip", "sh"];
        assert_eq!(
            missing_applet_links(&applets, |name| debian.contains(&name)),
            ["bin/cat", "usr/bin/wget"]
        );
        assert!(parse_applets("").is_err());
        assert!(parse_applets("bin/../x\n").is_err());
        assert!(parse_applets("/bin/sh\n").is_err());
    }
}
