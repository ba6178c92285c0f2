//! apt with private sources and state under `<cache>/kernels/apt`: the Debian suites of the
//! matrix on one mirror (`LB_DEBIAN_MIRROR`), their lists refreshed once a day; the machine's
//! own apt configuration is never touched.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result, bail};

use crate::util::step;

/// The Debian suites whose kernel packages make the matrix (all on the same mirror).
const SUITES: &[(&str, &str)] = &[
    ("debian", "bullseye"),
    ("debian-security", "bullseye-security"),
    ("debian", "bookworm"),
    ("debian", "bookworm-updates"),
    ("debian-security", "bookworm-security"),
    ("debian", "bookworm-backports"),
    ("debian", "trixie"),
    ("debian", "trixie-updates"),
    ("debian-security", "trixie-security"),
    ("debian", "trixie-backports"),
    ("debian", "forky"),
    ("debian", "sid"),
];

/// apt with private sources and state under `<cache>/kernels/apt` (the kernels of the matrix,
/// the node parts of `node.rs`, the upstream e2e images' packages). One process at a time uses it
/// (a second `cargo xtask` waits): two `apt-get update`s or downloads into the same lists and
/// archives would remove each other's files.
pub(crate) struct PrivateApt {
    dir: PathBuf,
    _lock: fs::File,
}

impl PrivateApt {
    pub(crate) fn new(cache: &Path) -> Result<PrivateApt> {
        let dir = cache.join("kernels/apt");
        for sub in ["lists/partial", "cache/archives/partial"] {
            let sub = dir.join(sub);
            fs::create_dir_all(&sub).with_context(|| format!("creating {}", sub.display()))?;
        }
        let lock_path = dir.join(".lock");
        let lock =
            fs::File::create(&lock_path).with_context(|| format!("creating {}", lock_path.display()))?;
        if lock.try_lock().is_err() {
            step(&format!(
                "waiting for another use of the private apt state to end ({})",
                lock_path.display()
            ));
            lock.lock()
                .with_context(|| format!("locking {}", lock_path.display()))?;
        }
        let mirror = std::env::var("LB_DEBIAN_MIRROR").unwrap_or_else(|_| "http://deb.debian.org".into());
        let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
        let signed_by = if Path::new(keyring).is_file() {
            format!(" [signed-by={keyring}]")
        } else {
            String::new()
        };
        let sources: String = SUITES
            .iter()
            .map(|(archive, suite)| format!("deb{signed_by} {mirror}/{archive} {suite} main\n"))
            .collect();
        fs::write(dir.join("sources.list"), sources).context("writing the private sources.list")?;
        Ok(PrivateApt { dir, _lock: lock })
    }

    /// The private apt with fresh lists, for downloading `what` (said when apt-get or dpkg-deb,
    /// which extracts the packages, is missing).
    pub(crate) fn for_download(cache: &Path, what: &str) -> Result<PrivateApt> {
        for tool in ["apt-get", "dpkg-deb"] {
            if !crate::util::have(tool) {
                bail!("{tool} is needed to fetch {what} from Debian");
            }
        }
        let apt = PrivateApt::new(cache)?;
        apt.update()?;
        Ok(apt)
    }

    /// The `.deb` of `package` that `apt-get download` left in `dir`.
    pub(crate) fn downloaded(dir: &Path, package: &str) -> Result<PathBuf> {
        fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{package}_")) && n.ends_with(".deb"))
            })
            .with_context(|| format!("apt-get download left no {package} package"))
    }

    /// The sources.list of every suite; a command may read a subset of its lines (with the same
    /// lists, which `update` keeps).
    pub(crate) fn sources_list(&self) -> PathBuf {
        self.dir.join("sources.list")
    }

    pub(crate) fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        let d = |sub: &str| self.dir.join(sub).display().to_string();
        for (key, value) in [
            ("Dir::Etc::sourcelist", d("sources.list")),
            ("Dir::Etc::sourceparts", "-".to_string()),
            ("Dir::State::Lists", d("lists")),
            ("Dir::Cache", d("cache")),
            // Downloads into our own directory need no privilege separation.
            ("APT::Sandbox::User", "root".to_string()),
        ] {
            cmd.arg("-o").arg(format!("{key}={value}"));
        }
        cmd
    }

    /// Refreshes the package lists when they are a day old or missing; stale lists are used
    /// (with a warning) when the mirror cannot be reached.
    pub(crate) fn update(&self) -> Result<()> {
        let stamp = self.dir.join("lists/.lb-updated");
        let fresh = fs::metadata(&stamp)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age < Duration::from_secs(24 * 3600));
        if fresh {
            return Ok(());
        }
        step("reading Debian's package lists (private apt lists; the machine's apt is untouched)");
        let out = self
            .command("apt-get")
            .args(["update", "-q"])
            .output()
            .context("apt-get update")?;
        if out.status.success() {
            fs::write(&stamp, "")?;
            return Ok(());
        }
        let err = String::from_utf8_lossy(&out.stderr);
        if fs::read_dir(self.dir.join("lists"))?.count() > 2 {
            eprintln!(
                "warning: apt-get update failed, using the previous lists: {}",
                err.trim()
            );
            return Ok(());
        }
        bail!("apt-get update with the private sources failed: {}", err.trim())
    }
}
