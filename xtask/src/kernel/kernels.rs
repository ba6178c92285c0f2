//! The kernels of the matrix: the newest generic amd64 `linux-image` package of every series
//! the mirror serves, downloaded once and extracted under `<cache>/kernels/<release>/` (or an
//! earlier run's, when the mirror cannot be read), and the host's own kernel.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use super::PrivateApt;
use crate::util::{cache_dir, output, run, step};

/// A kernel of the matrix.
#[derive(Clone, Debug)]
pub struct Kernel {
    /// `uname -r` (`6.1.0-56-amd64`), or the running kernel's for the host.
    pub release: String,
    /// `major.minor`.
    pub series: String,
    /// Debian package and version; `None` for the host's kernel.
    pub package: Option<(String, String)>,
    /// The boot image, for a guest.
    pub vmlinuz: Option<PathBuf>,
    /// The directory holding `lib/modules/<release>/` of an extracted package (`modprobe -d`):
    /// the guest sees this machine's filesystem, whose /lib/modules has none of its release but
    /// the link virtme-ng makes there.
    pub modules_root: Option<PathBuf>,
}

impl Kernel {
    pub(super) fn host() -> Result<Kernel> {
        let release = output(Command::new("uname").arg("-r"))?.trim().to_string();
        Ok(Kernel {
            series: series_of(&release).unwrap_or_default(),
            release,
            package: None,
            vmlinuz: None,
            modules_root: None,
        })
    }

    pub(super) fn label(&self) -> String {
        match &self.package {
            Some((_, version)) => format!("{} (Debian {version})", self.release),
            None => format!("{} (this machine's kernel)", self.release),
        }
    }
}

/// `major.minor` of a release or version string (`6.12.117+deb13-amd64` -> `6.12`).
fn series_of(release: &str) -> Option<String> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let (major, minor) = (parts.next()?, parts.next()?);
    (!major.is_empty() && !minor.is_empty()).then(|| format!("{major}.{minor}"))
}

/// A version as numbers, for ordering (`6.1.192-2` -> [6, 1, 192, 2]).
pub(super) fn version_key(version: &str) -> Vec<u64> {
    version
        .split(|c: char| !c.is_ascii_digit())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse().unwrap_or(0))
        .collect()
}

/// Whether a kernel image package is the generic amd64 flavour (not cloud, rt, a debug or an
/// unsigned build, nor a meta package).
fn is_generic_image(name: &str) -> bool {
    let Some(release) = name.strip_prefix("linux-image-") else {
        return false;
    };
    release.ends_with("-amd64")
        && !release.ends_with("-cloud-amd64")
        && !release.ends_with("-rt-amd64")
        && !release.contains("unsigned")
        && !release.contains("dbg")
        && series_of(release).is_some()
        // Meta packages (`linux-image-6.1-amd64`) carry no patch level.
        && release.matches(['.', '-', '+']).count() > 2
}

/// A kernel image package, with the packages that hold its kernel and modules when it does not.
#[derive(Clone, Debug)]
pub(super) struct KernelPackage {
    pub(super) package: String,
    pub(super) version: String,
    parts: Vec<String>,
}

impl PrivateApt {
    /// The newest generic kernel image of every series.
    pub(super) fn newest_per_series(&self) -> Result<BTreeMap<String, KernelPackage>> {
        let names = output(self.command("apt-cache").args(["pkgnames", "linux-image-"]))?;
        let candidates: Vec<&str> = names.lines().filter(|n| is_generic_image(n)).collect();
        if candidates.is_empty() {
            return Ok(BTreeMap::new());
        }
        let shown = output(
            self.command("apt-cache")
                .args(["show", "--no-all-versions"])
                .args(&candidates),
        )?;
        let mut newest: BTreeMap<String, KernelPackage> = BTreeMap::new();
        for stanza in shown.split("\n\n") {
            let field = |name: &str| {
                stanza
                    .lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
                    .map(|v| v.trim().to_string())
            };
            let (Some(package), Some(version)) = (field("Package"), field("Version")) else {
                continue;
            };
            let Some(series) = series_of(&version) else {
                continue;
            };
            let release = package.trim_start_matches("linux-image-");
            // Since 7.x the image package only depends on the kernel (linux-binary-*) and its
            // modules (linux-modules-*).
            let parts = field("Depends")
                .unwrap_or_default()
                .split(',')
                .filter_map(|d| d.split_whitespace().next())
                .filter(|d| {
                    *d == format!("linux-binary-{release}") || *d == format!("linux-modules-{release}")
                })
                .map(str::to_string)
                .collect();
            let better = newest
                .get(&series)
                .is_none_or(|old| version_key(&version) > version_key(&old.version));
            if better {
                newest.insert(
                    series,
                    KernelPackage {
                        package,
                        version,
                        parts,
                    },
                );
            }
        }
        Ok(newest)
    }

    /// Downloads and extracts one kernel package and its parts (once; reused from the cache
    /// after).
    fn fetch(&self, cache: &Path, kernel: &KernelPackage) -> Result<Kernel> {
        let (package, version) = (kernel.package.as_str(), kernel.version.as_str());
        let release = package
            .strip_prefix("linux-image-")
            .context("not a kernel image package")?
            .to_string();
        let dir = cache.join("kernels").join(&release);
        let marker = dir.join(".lb-complete");
        if fs::read_to_string(&marker).ok().as_deref() != Some(version) {
            let _ = fs::remove_dir_all(&dir);
            let debs = cache.join("kernels/debs");
            fs::create_dir_all(&debs)?;
            step(&format!("downloading {package} {version} (about 100 MB, once)"));
            fs::create_dir_all(&dir)?;
            for part in std::iter::once(package).chain(kernel.parts.iter().map(String::as_str)) {
                let pinned = run(self
                    .command("apt-get")
                    .args(["download", "-q", &format!("{part}={version}")])
                    .current_dir(&debs));
                if pinned.is_err() && part != package {
                    // A part may carry its own version (6.19's linux-modules-*): the release in
                    // its name already pins the kernel build.
                    run(self
                        .command("apt-get")
                        .args(["download", "-q", part])
                        .current_dir(&debs))?;
                } else {
                    pinned?;
                }
                let deb = PrivateApt::downloaded(&debs, part)?;
                run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&dir))?;
                let _ = fs::remove_file(&deb);
            }
            fs::write(&marker, version)?;
        }
        let Some(vmlinuz) = find_vmlinuz(&dir, &release) else {
            bail!("{package} has no vmlinuz under {}", dir.display());
        };
        Ok(Kernel {
            series: series_of(&release).unwrap_or_default(),
            modules_root: find_modules_root(&dir, &release),
            release,
            package: Some((package.to_string(), version.to_string())),
            vmlinuz: Some(vmlinuz),
        })
    }

    /// A kernel extracted by an earlier run, for when the mirror cannot be read.
    fn cached(cache: &Path, wanted: &str) -> Option<Kernel> {
        let mut found: Vec<Kernel> = fs::read_dir(cache.join("kernels"))
            .ok()?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let release = e.file_name().to_string_lossy().to_string();
                let version = fs::read_to_string(e.path().join(".lb-complete")).ok()?;
                let vmlinuz = find_vmlinuz(&e.path(), &release)?;
                Some(Kernel {
                    series: series_of(&release)?,
                    package: Some((format!("linux-image-{release}"), version)),
                    vmlinuz: Some(vmlinuz),
                    modules_root: find_modules_root(&e.path(), &release),
                    release,
                })
            })
            .filter(|k| k.series == wanted || k.release == wanted)
            .collect();
        found.sort_by_key(|k| version_key(&k.package.as_ref().map(|p| p.1.clone()).unwrap_or_default()));
        found.pop()
    }
}
/// The kernel image of an extracted package: `/boot/vmlinuz-<release>`, or since the 7.x
/// packages (linux-binary-*) `/usr/lib/modules/<release>/vmlinuz`.
fn find_vmlinuz(dir: &Path, release: &str) -> Option<PathBuf> {
    [
        dir.join("boot").join(format!("vmlinuz-{release}")),
        dir.join("usr/lib/modules").join(release).join("vmlinuz"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// The module root of an extracted package: `<dir>` where the modules are in
/// `<dir>/lib/modules/<release>/` (5.10, 6.1), `<dir>/usr` where Debian 13's packages put them in
/// `/usr/lib/modules/<release>/`.
fn find_modules_root(dir: &Path, release: &str) -> Option<PathBuf> {
    [dir.to_path_buf(), dir.join("usr")].into_iter().find(|root| {
        root.join("lib/modules")
            .join(release)
            .join("modules.dep")
            .is_file()
    })
}

/// The kernels asked for, downloaded as needed.
pub(super) fn resolve_kernels(wanted: &[String]) -> Result<Vec<Kernel>> {
    let cache = cache_dir();
    let wanted: Vec<String> = if wanted.is_empty() {
        vec!["all".into()]
    } else {
        wanted.to_vec()
    };
    let needs_mirror = wanted.iter().any(|w| w != "host");
    let apt = PrivateApt::new(&cache)?;
    let available = if needs_mirror {
        match apt.update().and_then(|()| apt.newest_per_series()) {
            Ok(found) => found,
            Err(e) => {
                eprintln!("warning: cannot read the kernel packages ({e:#}); using cached kernels only");
                BTreeMap::new()
            }
        }
    } else {
        BTreeMap::new()
    };
    let host = Kernel::host()?;
    let mut kernels: Vec<Kernel> = Vec::new();
    for w in &wanted {
        match w.as_str() {
            "host" => kernels.push(host.clone()),
            "all" => {
                for kernel in available.values() {
                    // A mirror may list a kernel whose parts it does not serve (6.19's modules
                    // here): say so and go on with the others.
                    match apt.fetch(&cache, kernel) {
                        Ok(k) => kernels.push(k),
                        Err(e) => eprintln!("==> skipping {}: {e:#}", kernel.package),
                    }
                }
                kernels.push(host.clone());
            }
            spec => {
                let by_series = available.get(spec);
                let by_release = available
                    .values()
                    .find(|k| k.package.strip_prefix("linux-image-") == Some(spec));
                match by_series.or(by_release) {
                    Some(kernel) => kernels.push(apt.fetch(&cache, kernel)?),
                    None => match PrivateApt::cached(&cache, spec) {
                        Some(k) => kernels.push(k),
                        None => bail!(
                            "no kernel {spec:?} on the mirror (series there: {}) nor in {}",
                            available.keys().cloned().collect::<Vec<_>>().join(", "),
                            cache.join("kernels").display()
                        ),
                    },
                }
            }
        }
    }
    kernels.dedup_by(|a, b| a.release == b.release);
    Ok(kernels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_packages_and_versions() {
        assert!(is_generic_image("linux-image-6.1.0-56-amd64"));
        assert!(is_generic_image("linux-image-6.12.117+deb13-amd64"));
        assert!(is_generic_image("linux-image-5.10.0-46-amd64"));
        assert!(!is_generic_image("linux-image-6.1-amd64"), "meta package");
        assert!(!is_generic_image("linux-image-6.1.0-56-cloud-amd64"));
        assert!(!is_generic_image("linux-image-6.1.0-56-rt-amd64"));
        assert!(!is_generic_image("linux-image-6.1.0-56-amd64-unsigned"));
        assert!(!is_generic_image("linux-image-6.1.0-56-amd64-dbg"));
        assert!(!is_generic_image("linux-image-amd64"));
        assert_eq!(series_of("6.12.117+deb13-amd64").as_deref(), Some("6.12"));
        assert_eq!(series_of("6.1.192-2").as_deref(), Some("6.1"));
        assert!(version_key("6.1.192-2") > version_key("6.1.158-1~deb11u1"));
        assert!(version_key("6.12.117-1") > version_key("6.12.95-1"));
    }
}
