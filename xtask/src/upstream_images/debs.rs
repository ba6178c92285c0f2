//! The Debian packages of the images: the closure of what an image needs, resolved by
//! `apt-get -s install` on an empty system restricted to one release's suites (the private apt
//! lists of `kernel`), downloaded once under `<cache>/upstream-images/debs/<set>` with a stamp.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

use crate::{
    image,
    kernel::PrivateApt,
    util::{self, step},
};

/// Packages from one release, with the closure of their dependencies (Depends and Pre-Depends,
/// no Recommends), and version prefixes some of them must have.
#[derive(Debug)]
pub(super) struct DebSet {
    /// Its directory under `<cache>/upstream-images/debs`.
    pub(super) name: &'static str,
    pub(super) suites: &'static [&'static str],
    pub(super) packages: &'static [&'static str],
    /// (package, version prefix).
    pub(super) versions: &'static [(&'static str, &'static str)],
}

/// The `.deb` files of `set`'s closure, downloaded once into `<cache>/upstream-images/debs/<name>`
/// and reused while the stamp there names the same request.
pub(super) fn fetch(cache: &Path, set: &DebSet) -> Result<Vec<PathBuf>> {
    let base = cache.join("upstream-images/debs");
    let dir = base.join(set.name);
    let request = format!("{set:?}\n");
    if let Some(debs) = cached_debs(&dir, &request) {
        return Ok(debs);
    }
    fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let _lock = image::lock(&base.join(".lock"))?;
    if let Some(debs) = cached_debs(&dir, &request) {
        return Ok(debs);
    }
    step(&format!(
        "fetching {} and what they need from Debian {} (once)",
        set.packages.join(" "),
        set.suites.join(", ")
    ));
    let apt = PrivateApt::new(cache)?;
    apt.update()?;
    let work = base.join(format!("{}.tmp-{}", set.name, std::process::id()));
    let _ = fs::remove_dir_all(&work);
    let debs = work.join("debs");
    for sub in ["debs", "preferences.d"] {
        fs::create_dir_all(work.join(sub))?;
    }
    let all = fs::read_to_string(apt.sources_list())
        .with_context(|| format!("reading {}", apt.sources_list().display()))?;
    fs::write(work.join("sources.list"), select_suites(&all, set.suites)?)?;
    fs::write(work.join("status"), "")?;
    let apt_get = || {
        let mut cmd = apt.command("apt-get");
        let w = |sub: &str| work.join(sub).display().to_string();
        for (key, value) in [
            // Only this release's suites (read from the lists `update` keeps).
            ("Dir::Etc::sourcelist", w("sources.list")),
            // An empty system: the whole closure, whatever this machine has installed.
            ("Dir::State::status", w("status")),
            ("Dir::State::extended_states", w("extended_states")),
            ("Dir::Etc::preferences", w("preferences")),
            ("Dir::Etc::preferencesparts", w("preferences.d")),
            // No package cache written over the one of the full lists.
            ("Dir::Cache::pkgcache", String::new()),
            ("Dir::Cache::srcpkgcache", String::new()),
        ] {
            cmd.arg("-o").arg(format!("{key}={value}"));
        }
        cmd
    };
    let simulated = util::output(
        apt_get()
            .args(["-s", "-q", "install", "--no-install-recommends"])
            .args(set.packages),
    )
    .with_context(|| {
        format!(
            "resolving {} in Debian {}",
            set.packages.join(" "),
            set.suites.join(", ")
        )
    })?;
    let resolved = parse_simulation(&simulated)?;
    for (package, prefix) in set.versions {
        match resolved.get(*package) {
            Some(version) if version.starts_with(prefix) => {}
            other => bail!(
                "Debian {} has {package} {other:?}, not a {prefix}* version: update the {} set in \
                 xtask/src/upstream_images/recipes.rs",
                set.suites.join(", "),
                set.name
            ),
        }
    }
    for package in set.packages {
        if !resolved.contains_key(*package) {
            bail!(
                "apt would not install {package} from Debian {}",
                set.suites.join(", ")
            );
        }
    }
    util::run(
        apt_get()
            .args(["download", "-q"])
            .args(resolved.iter().map(|(p, v)| format!("{p}={v}")))
            .current_dir(&debs),
    )
    .with_context(|| format!("downloading the {} packages", set.name))?;
    let mut names = Vec::new();
    for (package, version) in &resolved {
        let prefix = deb_file_prefix(package, version);
        let found: Vec<String> = fs::read_dir(&debs)?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
            .collect();
        match found.as_slice() {
            [one] => names.push(one.clone()),
            _ => {
                bail!("apt-get download left {found:?} for {package} {version} (expected one {prefix}*.deb)")
            }
        }
    }
    names.sort();
    let stamp = format!(
        "{request}{}",
        names.iter().map(|n| format!("deb {n}\n")).collect::<String>()
    );
    fs::write(debs.join(".stamp"), stamp)?;
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    fs::rename(&debs, &dir).with_context(|| format!("renaming {} to {}", debs.display(), dir.display()))?;
    fs::remove_dir_all(&work)?;
    step(&format!(
        "{} Debian packages for {} in {}",
        names.len(),
        set.name,
        dir.display()
    ));
    Ok(names.iter().map(|n| dir.join(n)).collect())
}

/// The packages `dir/.stamp` lists when it was written for `request` and all are there.
fn cached_debs(dir: &Path, request: &str) -> Option<Vec<PathBuf>> {
    let stamp = fs::read_to_string(dir.join(".stamp")).ok()?;
    let listed = stamp.strip_prefix(request)?;
    let debs: Vec<PathBuf> = listed
        .lines()
        .map(|l| l.strip_prefix("deb ").map(|n| dir.join(n)))
        .collect::<Option<_>>()?;
    (!debs.is_empty() && debs.iter().all(|d| d.is_file())).then_some(debs)
}

/// The lines of a sources.list whose suite is one of `suites`; fails unless each is there.
fn select_suites(sources: &str, suites: &[&str]) -> Result<String> {
    let mut out = String::new();
    let mut seen = Vec::new();
    for line in sources.lines() {
        // `deb [options] URI SUITE COMPONENT...`
        let mut rest = line.trim();
        let Some(after) = rest.strip_prefix("deb ") else {
            continue;
        };
        rest = after.trim_start();
        if rest.starts_with('[') {
            let Some(end) = rest.find(']') else { continue };
            rest = &rest[end + 1..];
        }
        let suite = rest.split_whitespace().nth(1).unwrap_or_default();
        if suites.contains(&suite) {
            out.push_str(line.trim());
            out.push('\n');
            seen.push(suite);
        }
    }
    if let Some(missing) = suites.iter().find(|s| !seen.contains(s)) {
        bail!("the private apt sources have no {missing} suite");
    }
    Ok(out)
}

/// The packages `apt-get -s install` would install: `Inst NAME [OLD] (VERSION ARCHIVE [ARCH])`.
fn parse_simulation(text: &str) -> Result<BTreeMap<String, String>> {
    let mut packages = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("Inst ") else {
            continue;
        };
        let name = rest.split_whitespace().next().unwrap_or_default();
        let version = rest
            .split_once('(')
            .and_then(|(_, v)| v.split_whitespace().next())
            .unwrap_or_default();
        if name.is_empty() || version.is_empty() {
            bail!("cannot read apt's line {line:?}");
        }
        packages.insert(name.to_string(), version.to_string());
    }
    if packages.is_empty() {
        bail!("apt would install nothing: {}", text.trim());
    }
    Ok(packages)
}

/// How `apt-get download` names the package's file up to the architecture:
/// `NAME_VERSION_` with the epoch's `:` as `%3a`.
fn deb_file_prefix(package: &str, version: &str) -> String {
    let name = package.split(':').next().unwrap_or(package);
    format!("{name}_{}_", version.replace(':', "%3a"))
}

#[cfg(test)]
mod tests;
