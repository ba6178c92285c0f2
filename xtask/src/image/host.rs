//! This machine's files in a layer: a program at the path it is known by, with its
//! shared-library closure (`ldd`), the dynamic loader, the plugins its libraries load with
//! dlopen(), and the host's top-level usrmerge links; and where a bare tool name is on the host.

use std::{
    fs, io,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use super::{
    IMAGE_PATH,
    layer::{Layer, relative},
};

/// Libraries that load plugins with dlopen(), which `ldd` cannot see: (the library's name up to
/// its version, the plugins' directory next to it). Every `*.so` there goes into the image too.
const PLUGIN_DIRS: &[(&str, &str)] = &[("libxtables.so", "xtables")];

/// Top-level links of a usrmerged host, reproduced in the images that hold host files.
const ROOT_LINKS: [&str; 4] = ["bin", "lib", "lib64", "sbin"];

/// How a host file is used, which decides its mode.
#[derive(Clone, Copy)]
pub(super) enum Role {
    Program,
    /// The dynamic loader: the kernel opens it for execution (PT_INTERP), so it must be 0755.
    Loader,
    Library,
    /// A file a program reads (`/etc/protocols`).
    Data,
}

impl Role {
    fn mode(self) -> u32 {
        match self {
            Role::Program | Role::Loader => 0o755,
            Role::Library | Role::Data => 0o644,
        }
    }
}

impl Layer {
    /// The host's top-level links (`/bin -> usr/bin`, ...), where the host has them: the paths
    /// programs and `ldd` name go through them.
    fn root_links(&mut self) -> Result<()> {
        for name in ROOT_LINKS {
            let path = Path::new("/").join(name);
            if fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
                let target = fs::read_link(&path)?;
                // The directory it points to exists in the image too (`/sbin -> usr/sbin`).
                if let Ok(dir) = relative(&Path::new("/").join(&target)) {
                    self.dir(&dir, 0o755)?;
                }
                self.symlink(name, target)?;
            }
        }
        Ok(())
    }

    /// Copies the host file a program or `ldd` names as `path` to the same place in the image.
    /// The directories on the way resolve as on the host (so `/lib/x86_64-linux-gnu/libc.so.6`
    /// lands in `/usr/lib/...` under the `/lib -> usr/lib` link); a symlink at the end is kept as
    /// a symlink, with what it points to copied too.
    pub(super) fn host_file(&mut self, path: &Path, role: Role) -> Result<()> {
        let mut path = path.to_path_buf();
        for _ in 0..16 {
            let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
                bail!("{} names no file", path.display());
            };
            let dir = fs::canonicalize(parent).with_context(|| format!("resolving {}", parent.display()))?;
            let real = dir.join(name);
            let meta = fs::symlink_metadata(&real).with_context(|| format!("reading {}", real.display()))?;
            let rel = relative(&real)?;
            if meta.file_type().is_symlink() {
                let target = fs::read_link(&real)?;
                self.symlink(&rel, target.clone())?;
                path = if target.is_absolute() {
                    target
                } else {
                    dir.join(target)
                };
                continue;
            }
            if !meta.is_file() {
                bail!("{} is not a regular file", real.display());
            }
            let bytes = fs::read(&real).with_context(|| format!("reading {}", real.display()))?;
            return self.file(&rel, role.mode(), bytes);
        }
        bail!("too many symlinks from {}", path.display())
    }

    /// A host program and its shared-library closure, each at the path it is known by.
    pub(super) fn host_program(&mut self, path: &Path) -> Result<()> {
        self.host_file(path, Role::Program)?;
        self.libraries_of(path)
    }

    pub(super) fn libraries_of(&mut self, program: &Path) -> Result<()> {
        let closure = ldd(program)?;
        if closure.loader.is_some() || !closure.libraries.is_empty() {
            self.root_links()?;
        }
        if let Some(loader) = &closure.loader {
            self.host_file(loader, Role::Loader)?;
        }
        for lib in &closure.libraries {
            self.host_file(lib, Role::Library)?;
            self.plugins_of(lib)?;
        }
        Ok(())
    }

    /// The plugins a library loads with dlopen() ([`PLUGIN_DIRS`]), each with its closure.
    fn plugins_of(&mut self, lib: &Path) -> Result<()> {
        let (Some(name), Some(dir)) = (lib.file_name().and_then(|n| n.to_str()), lib.parent()) else {
            return Ok(());
        };
        for (prefix, sub) in PLUGIN_DIRS {
            if !name.starts_with(prefix) {
                continue;
            }
            let plugins = dir.join(sub);
            if self.items.contains_key(&relative(&fs::canonicalize(&plugins)?)?) {
                continue; // already there, from another program's closure
            }
            let mut files: Vec<PathBuf> = fs::read_dir(&plugins)
                .with_context(|| format!("reading {}", plugins.display()))?
                .map(|e| e.map(|e| e.path()))
                .collect::<io::Result<_>>()?;
            files.retain(|f| f.extension().is_some_and(|e| e == "so"));
            files.sort();
            if files.is_empty() {
                bail!("{} has no plugins (*.so)", plugins.display());
            }
            for plugin in &files {
                self.host_file(plugin, Role::Library)?;
                self.libraries_of(plugin)?;
            }
        }
        Ok(())
    }
}

/// What `ldd` says a program loads: the dynamic loader and the libraries, as paths.
#[derive(Debug, Default, PartialEq)]
struct Closure {
    loader: Option<PathBuf>,
    libraries: Vec<PathBuf>,
}

fn ldd(program: &Path) -> Result<Closure> {
    let out = Command::new("ldd")
        .arg(program)
        .output()
        .with_context(|| format!("cannot run ldd {}", program.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if text.contains("not a dynamic executable") || text.contains("statically linked") {
        return Ok(Closure::default());
    }
    if !out.status.success() {
        bail!(
            "ldd {} failed ({}): {}",
            program.display(),
            out.status,
            text.trim()
        );
    }
    parse_ldd(&text).with_context(|| format!("ldd {}", program.display()))
}

/// Parses `ldd` output: `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` lines name
/// libraries, a bare `/lib64/ld-linux-x86-64.so.2 (0x...)` the loader; the vDSO has no file.
fn parse_ldd(text: &str) -> Result<Closure> {
    let mut closure = Closure::default();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let without_address = |s: &str| s.split(" (0x").next().unwrap_or_default().trim().to_string();
        if let Some((name, path)) = line.split_once("=>") {
            let path = without_address(path);
            if path == "not found" {
                bail!("library {} not found", name.trim());
            }
            if !path.is_empty() {
                closure.libraries.push(PathBuf::from(path));
            }
        } else if line.starts_with('/') {
            closure.loader = Some(PathBuf::from(without_address(line)));
        }
    }
    Ok(closure)
}

/// A bare tool name's path on the host: the first of the image's PATH directories that has it.
pub(super) fn resolve_tool(tool: &str) -> Result<PathBuf> {
    if tool.starts_with('/') {
        return Ok(PathBuf::from(tool));
    }
    IMAGE_PATH
        .split(':')
        .map(|dir| Path::new(dir).join(tool))
        .find(|p| p.is_file())
        .with_context(|| format!("`{tool}` is not on this machine (looked in {IMAGE_PATH})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_parses() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(text).unwrap(),
            Closure {
                loader: Some("/lib64/ld-linux-x86-64.so.2".into()),
                libraries: vec!["/lib/x86_64-linux-gnu/libc.so.6".into()],
            }
        );
        assert!(parse_ldd("\tlibfoo.so.1 => not found\n").is_err());
    }
}
