//! `cargo xtask kernel-test`: the privileged test suite on the kernels operators run, each booted
//! in a guest on this machine, and on the host's own kernel.
//!
//! - Kernels: Debian's `linux-image-<release>-amd64` packages, the newest build of each series
//!   the Debian mirror serves (5.10, 6.1, 6.12, ...). They are found through a private apt
//!   sources list and private apt state under the cache (the machine's own apt configuration is
//!   never touched), downloaded with `apt-get download` and extracted with `dpkg-deb -x` under
//!   `<cache>/kernels/<release>/`: nothing is installed as the host's kernel.
//! - Guests: virtme-ng (PyPI, in a virtualenv under the cache) boots a kernel with qemu over a
//!   read-only view of this machine's filesystem: the test binaries built here run there as they
//!   are. `target/` is an overlay the guest may write (the host's copy is untouched), and one
//!   shared directory carries each binary's output and result back. KVM is used where the CPU
//!   exposes hardware virtualization; elsewhere (this kind of VM: nested KVM runs ~1000x slow)
//!   the guest is emulated (TCG), slower but with the same verifier, BPF_PROG_TEST_RUN,
//!   namespaces and cgroups.
//! - Each kernel prints a line per test binary as it finishes, then a summary; the results go to
//!   `target/kernel-test/<release>/` and `docs/kernels.md` is written from every result there.
//!   Ctrl-C, SIGTERM and SIGHUP stop the guest; nothing stays running or mounted.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::{
    ebpf, setup,
    test::{Summary, build_agent, require_root, test_env},
    util::{cache_dir, clean_cargo, output, provenance, run, step, workspace_root},
};

/// virtme-ng, from the Python package index.
const VIRTME_NG: &str = "virtme-ng==1.42";

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

/// What the guests need on the host: qemu, busybox (virtme-ng's initramfs), depmod (the
/// modules of an extracted kernel package), apt and dpkg-deb (the kernel packages).
const GUEST_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86_64", "qemu-system-x86"),
    ("busybox", "busybox-static"),
    ("depmod", "kmod"),
    ("dpkg-deb", "dpkg"),
    ("python3", "python3"),
];

/// `cargo xtask kernel-test` options.
#[derive(clap::Args, Debug, Clone)]
pub struct Options {
    /// A kernel to test: a series (`6.1`), a release (`6.1.0-56-amd64`), `host` (the running
    /// kernel, natively) or `all` (every series the mirror serves, and the host). Repeatable;
    /// default `all`.
    #[arg(long = "kernel")]
    pub kernels: Vec<String>,
    /// Only these test binaries of tests/ (`tc_fixtures`, `socket_lb`, ...; `lib` for the
    /// harness's own tests). Repeatable; default: every binary but the end-to-end ones.
    #[arg(long = "binary")]
    pub binaries: Vec<String>,
    /// Only tests whose name contains this (passed to every test binary).
    #[arg(long)]
    pub filter: Option<String>,
    /// Guest CPUs.
    #[arg(long, default_value_t = 2)]
    pub cpus: u32,
    /// Guest memory.
    #[arg(long, default_value = "4G")]
    pub memory: String,
    /// `kvm`, `tcg` (emulated) or `auto` (KVM when the CPU exposes hardware virtualization).
    #[arg(long, default_value = "auto")]
    pub accel: String,
    /// Give up on a kernel after this many minutes.
    #[arg(long, default_value_t = 120)]
    pub timeout_minutes: u64,
    /// List the kernels the mirror serves and exit.
    #[arg(long)]
    pub list: bool,
    /// `./x test`'s subset: results under `target/kernel-test-ci/`, docs/kernels.md untouched.
    #[arg(skip)]
    pub ci: bool,
}

/// The kernel and test binaries `./x test` runs in a guest (its README promise: the fixtures and
/// the netns tests on Debian 12's kernel, the oldest LTS most fleets run). The full matrix is
/// `cargo xtask kernel-test`.
pub const CI_KERNEL: &str = "6.1";
pub const CI_BINARIES: &[&str] = &["kernel_support", "tc_fixtures", "socket_lb", "tc_topology"];

/// Runs [`CI_BINARIES`] on [`CI_KERNEL`] for `./x test`, adding the results to `summary`.
pub fn run_ci_subset(summary: &mut Summary) -> Result<bool> {
    let opts = Options {
        kernels: vec![CI_KERNEL.into()],
        binaries: CI_BINARIES.iter().map(|b| b.to_string()).collect(),
        filter: None,
        cpus: 2,
        memory: "4G".into(),
        accel: "auto".into(),
        timeout_minutes: 30,
        list: false,
        ci: true,
    };
    let outcomes = run_kernels(&opts)?;
    let mut ok = !outcomes.is_empty();
    for outcome in &outcomes {
        ok &= outcome.ok();
        for r in &outcome.results {
            summary.binaries += 1;
            summary.passed += r["passed"].as_u64().unwrap_or(0);
            summary.failed += r["failed"].as_u64().unwrap_or(0);
            summary.ignored += r["ignored"].as_u64().unwrap_or(0);
            if r["ok"] != true {
                summary.failing_binaries.push(format!(
                    "{} on Linux {} (target/kernel-test-ci/{}/)",
                    r["binary"].as_str().unwrap_or("?"),
                    outcome.kernel.release,
                    outcome.kernel.release
                ));
            }
        }
        if let Some(why) = &outcome.aborted {
            summary
                .failing_binaries
                .push(format!("Linux {}: {why}", outcome.kernel.release));
        }
    }
    Ok(ok)
}

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
}

impl Kernel {
    fn host() -> Result<Kernel> {
        let release = output(Command::new("uname").arg("-r"))?.trim().to_string();
        Ok(Kernel {
            series: series_of(&release).unwrap_or_default(),
            release,
            package: None,
            vmlinuz: None,
        })
    }

    fn label(&self) -> String {
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
fn version_key(version: &str) -> Vec<u64> {
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
struct KernelPackage {
    package: String,
    version: String,
    parts: Vec<String>,
}

/// apt with private sources and state under `<cache>/kernels/apt` (the kernels of the matrix and
/// the node parts of `node.rs`).
pub(crate) struct PrivateApt {
    dir: PathBuf,
}

impl PrivateApt {
    pub(crate) fn new(cache: &Path) -> Result<PrivateApt> {
        let dir = cache.join("kernels/apt");
        for sub in ["lists/partial", "cache/archives/partial"] {
            fs::create_dir_all(dir.join(sub))?;
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
        fs::write(dir.join("sources.list"), sources)?;
        Ok(PrivateApt { dir })
    }

    /// The `.deb` of `package` that `apt-get download` left in `dir`.
    pub(crate) fn downloaded(dir: &Path, package: &str) -> Result<PathBuf> {
        fs::read_dir(dir)?
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

    /// The newest generic kernel image of every series.
    fn newest_per_series(&self) -> Result<BTreeMap<String, KernelPackage>> {
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
                    release,
                })
            })
            .filter(|k| k.series == wanted || k.release == wanted)
            .collect();
        found.sort_by_key(|k| version_key(&k.package.as_ref().map(|p| p.1.clone()).unwrap_or_default()));
        found.pop()
    }
}

/// Set by SIGINT, SIGTERM or SIGHUP: stop the guest and clean up.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn catch_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(signal, on_signal as *const () as libc::sighandler_t) };
    }
}

/// A process group (virtme-ng and the qemu it forks) killed on drop.
struct GuestProcess {
    child: Child,
}

impl GuestProcess {
    fn kill(&mut self) {
        let pgid = self.child.id() as libc::pid_t;
        // SAFETY: signalling a process group we created.
        unsafe { libc::killpg(pgid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                break;
            }
            thread::sleep(Duration::from_millis(100));
        }
        // SAFETY: as above; qemu may outlive its parent's SIGTERM.
        unsafe { libc::killpg(pgid, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

impl Drop for GuestProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.kill();
        }
    }
}

/// A test binary of tests/ as cargo built it.
#[derive(Clone, Debug)]
struct TestBinary {
    name: String,
    path: PathBuf,
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

/// Builds the test binaries (without running them) and returns those selected.
fn build_test_binaries(selected: &[String]) -> Result<Vec<TestBinary>> {
    step("building the test binaries of tests/");
    let mut cmd = clean_cargo(None);
    cmd.args([
        "test",
        "--package",
        "lb-tests",
        "--lib",
        "--tests",
        "--no-run",
        "--message-format=json",
    ]);
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the test binaries failed");
    }
    let mut all = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let (Some(path), Some(name)) = (msg["executable"].as_str(), msg["target"]["name"].as_str()) else {
            continue;
        };
        // `--tests` also builds the tools' (bin targets') unit tests: only the library's and
        // the integration tests' binaries are the suite.
        let name = match msg["target"]["kind"][0].as_str().unwrap_or_default() {
            "lib" => "lib".to_string(),
            "test" => name.to_string(),
            _ => continue,
        };
        all.push(TestBinary {
            name,
            path: PathBuf::from(path),
        });
    }
    all.sort_by(|a, b| a.name.cmp(&b.name));
    let chosen: Vec<TestBinary> = if selected.is_empty() {
        all.into_iter().filter(|b| !b.name.starts_with("e2e")).collect()
    } else {
        for wanted in selected {
            if !all.iter().any(|b| &b.name == wanted) {
                let names: Vec<&str> = all.iter().map(|b| b.name.as_str()).collect();
                bail!("no test binary {wanted:?}; there are {}", names.join(", "));
            }
        }
        all.into_iter().filter(|b| selected.contains(&b.name)).collect()
    };
    Ok(chosen)
}

/// The kernels asked for, downloaded as needed.
fn resolve_kernels(wanted: &[String]) -> Result<Vec<Kernel>> {
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

/// virtme-ng in a virtualenv under the cache; returns the path of `vng`.
fn ensure_virtme_ng() -> Result<PathBuf> {
    let venv = cache_dir().join(format!(
        "virtme-ng-{}",
        VIRTME_NG.trim_start_matches("virtme-ng==")
    ));
    let vng = venv.join("bin/vng");
    if vng.is_file() {
        return Ok(vng);
    }
    step(&format!(
        "installing {VIRTME_NG} from the Python package index (once)"
    ));
    let make_venv = || Command::new("python3").arg("-m").arg("venv").arg(&venv).status();
    if !make_venv().is_ok_and(|s| s.success()) {
        // Debian's python3 keeps venv in its own package.
        setup::apt_install(&["python3-venv"])?;
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    }
    run(Command::new(venv.join("bin/pip")).args(["install", "--quiet", VIRTME_NG]))?;
    if !vng.is_file() {
        bail!("{VIRTME_NG} installed no {}", vng.display());
    }
    Ok(vng)
}

/// Whether to use KVM: asked for, or `auto` and the CPU exposes hardware virtualization to us
/// (a /dev/kvm without vmx/svm is emulated by the outer hypervisor and far slower than TCG).
fn use_kvm(accel: &str) -> Result<bool> {
    let hardware = Path::new("/dev/kvm").exists()
        && fs::read_to_string("/proc/cpuinfo")
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    match accel {
        "kvm" => Ok(true),
        "tcg" => Ok(false),
        "auto" => Ok(hardware),
        other => bail!("--accel {other:?}: use kvm, tcg or auto"),
    }
}

/// One test binary's result, as the runner (in a guest or here) records it.
fn binary_result(name: &str, log: &str, exit: Option<i32>, seconds: f64) -> Value {
    let mut summary = Summary::default();
    for line in log.lines() {
        summary.add_line(line);
    }
    let failures: Vec<&str> = log
        .lines()
        .filter_map(|l| l.strip_prefix("test ")?.strip_suffix(" ... FAILED"))
        .collect();
    let ok = exit == Some(0) && summary.failed == 0 && summary.binaries > 0;
    json!({
        "binary": name,
        "ok": ok,
        "exit": exit,
        "seconds": seconds,
        "passed": summary.passed,
        "failed": summary.failed,
        "ignored": summary.ignored,
        "failures": failures,
    })
}

/// `cargo xtask kernel-guest`: runs inside the guest (or on the host for `--kernel host`). Runs
/// each binary with its output in `<results>/<name>.log`, writes `<results>/<name>.json` when it
/// ends, the kernel's features to `features.json`, and `done` last.
pub fn guest(results: &Path, filter: Option<&str>, binaries: &[String]) -> Result<()> {
    let root = workspace_root();
    fs::create_dir_all(results)?;
    let features = Command::new(root.join("target/debug/lb-agent"))
        .args(["kernel", "-o", "json"])
        .output();
    let features = match features {
        Ok(out) => serde_json::from_slice::<Value>(&out.stdout)
            .unwrap_or_else(|_| json!({ "error": String::from_utf8_lossy(&out.stderr).trim().to_string() })),
        Err(e) => json!({ "error": e.to_string() }),
    };
    fs::write(
        results.join("features.json"),
        serde_json::to_string_pretty(&features)?,
    )?;
    for spec in binaries {
        let (name, path) = spec.split_once('=').context("binaries are NAME=PATH")?;
        let log_path = results.join(format!("{name}.log"));
        let log = fs::File::create(&log_path)?;
        let started = Instant::now();
        let mut cmd = Command::new(path);
        cmd.args(filter)
            // As `cargo test` runs them: from the package's directory.
            .current_dir(root.join("tests"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let exit = match cmd.status() {
            Ok(status) => status.code(),
            Err(e) => {
                fs::write(&log_path, format!("cannot start {path}: {e}\n"))?;
                None
            }
        };
        let text = fs::read_to_string(&log_path).unwrap_or_default();
        let result = binary_result(name, &text, exit, started.elapsed().as_secs_f64());
        fs::write(
            results.join(format!("{name}.json")),
            serde_json::to_string_pretty(&result)?,
        )?;
    }
    fs::write(results.join("done"), "")?;
    Ok(())
}

/// What one kernel gave.
struct KernelOutcome {
    kernel: Kernel,
    guest: String,
    results: Vec<Value>,
    /// Why the run stopped early, if it did.
    aborted: Option<String>,
    seconds: f64,
}

impl KernelOutcome {
    fn ok(&self) -> bool {
        self.aborted.is_none() && !self.results.is_empty() && self.results.iter().all(|r| r["ok"] == true)
    }
}

/// Prints a line for each result file that appeared since the last call.
fn report_new_results(kernel: &Kernel, dir: &Path, seen: &mut Vec<String>) -> Vec<Value> {
    let mut new = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return new;
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json") && !p.ends_with("features.json"))
        .collect();
    files.sort();
    for file in files {
        let name = file.file_stem().unwrap_or_default().to_string_lossy().to_string();
        if seen.contains(&name) {
            continue;
        }
        let Ok(value) = fs::read_to_string(&file).map(|t| serde_json::from_str::<Value>(&t)) else {
            continue;
        };
        let Ok(value) = value else { continue };
        seen.push(name);
        println!("{}", result_line(&kernel.release, &value));
        new.push(value);
    }
    new
}

fn result_line(release: &str, r: &Value) -> String {
    let verdict = if r["ok"] == true { "ok" } else { "FAILED" };
    let mut counts = format!("{} passed", r["passed"]);
    if r["failed"].as_u64().unwrap_or(0) > 0 {
        let _ = write!(counts, ", {} failed", r["failed"]);
    }
    if r["ignored"].as_u64().unwrap_or(0) > 0 {
        let _ = write!(counts, ", {} ignored", r["ignored"]);
    }
    if r["ok"] != true && r["failed"].as_u64().unwrap_or(0) == 0 {
        let _ = write!(counts, " (exit {})", r["exit"]);
    }
    let mut line = format!(
        "    {release:<28} {:<16} {verdict:<7} {counts:<34} {:>7.1} s",
        r["binary"].as_str().unwrap_or("?"),
        r["seconds"].as_f64().unwrap_or(0.0)
    );
    if let Some(failures) = r["failures"].as_array().filter(|f| !f.is_empty()) {
        let names: Vec<&str> = failures.iter().filter_map(Value::as_str).collect();
        let _ = write!(line, "\n        failed: {}", names.join(", "));
    }
    line
}

/// Runs the binaries on `kernel`: natively for the host's kernel, else in a guest.
fn run_kernel(
    kernel: &Kernel,
    binaries: &[TestBinary],
    opts: &Options,
    env: &[(&str, String)],
    vng: Option<&Path>,
    kvm: bool,
) -> Result<KernelOutcome> {
    let root = workspace_root();
    let results_dir = root
        .join(if opts.ci {
            "target/kernel-test-ci"
        } else {
            "target/kernel-test"
        })
        .join(&kernel.release);
    let _ = fs::remove_dir_all(&results_dir);
    fs::create_dir_all(&results_dir)?;
    let started = Instant::now();
    let xtask = root.join("target/debug/xtask");
    let specs: Vec<String> = binaries
        .iter()
        .map(|b| format!("{}={}", b.name, b.path.display()))
        .collect();
    let mut guest_args: Vec<String> = vec!["kernel-guest".into(), "--results".into()];
    let (guest, share) = match (&kernel.vmlinuz, vng) {
        (None, _) => ("none (natively on this machine)".to_string(), results_dir.clone()),
        (Some(_), None) => bail!("no virtme-ng for a guest"),
        (Some(_), Some(_)) => (
            format!(
                "{}, {} CPUs, {} memory",
                if kvm { "KVM" } else { "TCG (emulated)" },
                opts.cpus,
                opts.memory
            ),
            // Outside target/, which the guest sees through an overlay.
            std::env::temp_dir().join(format!(
                "lb-kernel-test-{}-{}",
                std::process::id(),
                kernel.release
            )),
        ),
    };
    let _ = fs::remove_dir_all(&share);
    fs::create_dir_all(&share)?;
    guest_args.push(share.display().to_string());
    if let Some(f) = &opts.filter {
        guest_args.push("--filter".into());
        guest_args.push(f.clone());
    }
    guest_args.extend(specs);
    println!("==> Linux {}: guest {guest}", kernel.label());

    let mut seen = Vec::new();
    let mut results = Vec::new();
    let mut aborted = None;
    let mut cmd = match (&kernel.vmlinuz, vng) {
        (Some(vmlinuz), Some(vng)) => {
            // The guest runs a script from the shared directory: a command given to --exec
            // travels on the kernel's command line, which is limited (2,048 bytes on x86; a
            // long PATH overflows it and 6.1 panics in early boot).
            let mut script = String::from("#!/bin/sh\nexec env");
            for (k, v) in env {
                let _ = write!(script, " {k}={}", shell_quote(v));
            }
            if !kvm {
                // Emulated, a kube-apiserver takes minutes to become ready, and tests running
                // side by side starve each other: one test at a time, and patience.
                script.push_str(" RUST_TEST_THREADS=1 LB_CONTROL_PLANE_TIMEOUT_SECS=900");
            }
            let _ = write!(script, " {}", shell_quote(&xtask.display().to_string()));
            for a in &guest_args {
                let _ = write!(script, " {}", shell_quote(a));
            }
            script.push('\n');
            let script_path = share.join("guest.sh");
            fs::write(&script_path, script)?;
            let exec = format!("sh {}", shell_quote(&script_path.display().to_string()));
            // vng runs its siblings (virtme-run) from PATH: put the virtualenv's bin first.
            let bin = vng.parent().unwrap_or(Path::new("."));
            let path = std::env::var("PATH").unwrap_or_default();
            let mut c = Command::new(vng);
            c.env("PATH", format!("{}:{path}", bin.display()))
                .arg("--run")
                .arg(vmlinuz)
                .arg("--force-9p")
                .args(["--cpus", &opts.cpus.to_string(), "--memory", &opts.memory])
                .arg("--rwdir")
                .arg(&share)
                .arg("--overlay-rwdir")
                .arg(root.join("target"))
                .args(["--append", "panic=-1"])
                .arg("--verbose")
                .arg("--exec")
                .arg(exec);
            if !kvm {
                c.arg("--disable-kvm");
            }
            c
        }
        _ => {
            let mut c = Command::new(&xtask);
            c.args(&guest_args)
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
            c
        }
    };
    let console = fs::File::create(share.join("console.log"))?;
    cmd.current_dir(&root)
        .stdin(Stdio::null())
        .stdout(console.try_clone()?)
        .stderr(console)
        .process_group(0);
    let mut process = GuestProcess {
        child: cmd.spawn().with_context(|| format!("starting {cmd:?}"))?,
    };
    let deadline = started + Duration::from_secs(opts.timeout_minutes * 60);
    loop {
        results.extend(report_new_results(kernel, &share, &mut seen));
        if let Some(status) = process.child.try_wait()? {
            results.extend(report_new_results(kernel, &share, &mut seen));
            if !share.join("done").exists() {
                aborted = Some(format!(
                    "the guest ended ({status}) before the tests did; see {}",
                    results_dir.join("console.log").display()
                ));
            }
            break;
        }
        if INTERRUPTED.load(Ordering::SeqCst) {
            process.kill();
            aborted = Some("interrupted".into());
            break;
        }
        if Instant::now() > deadline {
            process.kill();
            aborted = Some(format!("timed out after {} minutes", opts.timeout_minutes));
            break;
        }
        thread::sleep(Duration::from_millis(500));
    }
    drop(process);
    // Keep everything the run wrote next to the other results, and drop the shared folder.
    if share != results_dir {
        for entry in fs::read_dir(&share)?.flatten() {
            let _ = fs::copy(entry.path(), results_dir.join(entry.file_name()));
        }
        let _ = fs::remove_dir_all(&share);
    }
    for b in binaries {
        if !seen.contains(&b.name) {
            let r = json!({
                "binary": b.name, "ok": false, "exit": null, "seconds": 0.0,
                "passed": 0, "failed": 0, "ignored": 0, "failures": [], "not_run": true,
            });
            println!("    {:<28} {:<16} NOT RUN", kernel.release, b.name);
            results.push(r);
        }
    }
    let outcome = KernelOutcome {
        kernel: kernel.clone(),
        guest,
        results,
        aborted,
        seconds: started.elapsed().as_secs_f64(),
    };
    write_summary(&outcome, &results_dir)?;
    Ok(outcome)
}

/// `'...'` for the guest's shell.
fn shell_quote(s: &str) -> String {
    if s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn write_summary(outcome: &KernelOutcome, dir: &Path) -> Result<()> {
    let features = fs::read_to_string(dir.join("features.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .unwrap_or(Value::Null);
    let (sha, date) = provenance();
    let summary = json!({
        "release": outcome.kernel.release,
        "series": outcome.kernel.series,
        "package": outcome.kernel.package.as_ref().map(|p| p.0.clone()),
        "version": outcome.kernel.package.as_ref().map(|p| p.1.clone()),
        "guest": outcome.guest,
        "ok": outcome.ok(),
        "aborted": outcome.aborted,
        "seconds": outcome.seconds,
        "commit": sha,
        "date": date,
        "features": features,
        "results": outcome.results,
    });
    fs::write(dir.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
    Ok(())
}

/// `cargo xtask kernel-test`.
pub fn run_matrix(opts: &Options) -> Result<()> {
    require_root()?;
    if opts.list {
        let apt = PrivateApt::new(&cache_dir())?;
        apt.update()?;
        for (series, k) in apt.newest_per_series()? {
            println!("{series:<6} {} {}", k.package, k.version);
        }
        println!("host   {}", Kernel::host()?.release);
        return Ok(());
    }
    let started = Instant::now();
    let outcomes = run_kernels(opts)?;
    println!(
        "\nkernel matrix ({:.0} min):",
        started.elapsed().as_secs_f64() / 60.0
    );
    for o in &outcomes {
        let passed: u64 = o.results.iter().filter_map(|r| r["passed"].as_u64()).sum();
        let failed: u64 = o.results.iter().filter_map(|r| r["failed"].as_u64()).sum();
        let bad: Vec<&str> = o
            .results
            .iter()
            .filter(|r| r["ok"] != true)
            .filter_map(|r| r["binary"].as_str())
            .collect();
        println!(
            "    {:<28} {:<7} {passed} passed, {failed} failed{}{}  ({:.0} min)",
            o.kernel.release,
            if o.ok() { "ok" } else { "FAILED" },
            if bad.is_empty() {
                String::new()
            } else {
                format!("; failing: {}", bad.join(", "))
            },
            o.aborted.as_ref().map(|a| format!("; {a}")).unwrap_or_default(),
            o.seconds / 60.0
        );
    }
    write_doc()?;
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    if !outcomes.iter().all(KernelOutcome::ok) {
        bail!("the suite failed on some kernel");
    }
    Ok(())
}

/// Sets up, builds, and runs the selected binaries on each selected kernel.
fn run_kernels(opts: &Options) -> Result<Vec<KernelOutcome>> {
    catch_signals();
    setup::all()?;
    ebpf::build()?;
    let kernels = resolve_kernels(&opts.kernels)?;
    let guests = kernels.iter().any(|k| k.vmlinuz.is_some());
    let vng = if guests {
        setup::install(GUEST_PACKAGES)?;
        Some(ensure_virtme_ng()?)
    } else {
        None
    };
    let kvm = use_kvm(&opts.accel)?;
    // The restart and upgrade scenarios run a real control plane, as on the host.
    let mut env = test_env(true)?;
    env.push(("HOME", std::env::var("HOME").unwrap_or_else(|_| "/root".into())));
    env.push(("PATH", std::env::var("PATH").unwrap_or_default()));
    build_agent()?;
    ebpf::build_variant()?;
    let binaries = build_test_binaries(&opts.binaries)?;
    step(&format!(
        "{} test binaries on {} kernel(s): {}",
        binaries.len(),
        kernels.len(),
        kernels
            .iter()
            .map(|k| k.release.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let mut outcomes = Vec::new();
    for kernel in &kernels {
        if INTERRUPTED.load(Ordering::SeqCst) {
            break;
        }
        let outcome = run_kernel(kernel, &binaries, opts, &env, vng.as_deref(), kvm)?;
        outcomes.push(outcome);
    }
    Ok(outcomes)
}

/// docs/kernels.md from every `target/kernel-test/*/summary.json`.
pub fn write_doc() -> Result<()> {
    let dir = workspace_root().join("target/kernel-test");
    let mut summaries: Vec<Value> = fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| fs::read_to_string(e.path().join("summary.json")).ok())
        .filter_map(|t| serde_json::from_str(&t).ok())
        .collect();
    if summaries.is_empty() {
        return Ok(());
    }
    summaries.sort_by_key(|s| version_key(s["release"].as_str().unwrap_or_default()));
    let path = workspace_root().join("docs/kernels.md");
    fs::write(&path, render_doc(&summaries))?;
    eprintln!("==> wrote {} from {} kernel(s)", path.display(), summaries.len());
    Ok(())
}

fn render_doc(summaries: &[Value]) -> String {
    let mut doc = String::new();
    let minimum = summaries
        .iter()
        .find_map(|s| s["features"]["minimum"].as_str())
        .unwrap_or("?");
    let _ = writeln!(doc, "# Kernels\n");
    let _ = writeln!(
        doc,
        "Generated by `cargo xtask kernel-test` from its results (`target/kernel-test/*/summary.json`), \
         never typed by hand. Each kernel is a Debian `linux-image` package booted in a guest on the \
         test machine (or the machine's own kernel, natively); the privileged test suite (BPF_PROG_TEST_RUN \
         fixtures, socket-path and tc tests in network namespaces, trace, restart, upgrade and the other \
         reliability scenarios) runs there unchanged. The agent refuses kernels older than {minimum}; \
         `lb-agent kernel` prints what a node's kernel offers.\n"
    );
    let _ = writeln!(
        doc,
        "| Kernel | Package | Result | Tests | Fallbacks in use | Guest | Run |\n|---|---|---|---|---|---|---|"
    );
    for s in summaries {
        let passed: u64 = s["results"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["passed"].as_u64())
            .sum();
        let failed: u64 = s["results"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["failed"].as_u64())
            .sum();
        let fallbacks: Vec<String> = s["features"]["features"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| f["present"] == false)
            .map(|f| {
                format!(
                    "{} ({})",
                    f["name"].as_str().unwrap_or("?"),
                    f["since"].as_str().unwrap_or("?")
                )
            })
            .collect();
        let package = match (s["package"].as_str(), s["version"].as_str()) {
            (Some(p), Some(v)) => format!("{p} {v}"),
            _ => "this machine's kernel".into(),
        };
        let result = if s["ok"] == true {
            "passed".to_string()
        } else {
            let mut r = "FAILED".to_string();
            if let Some(a) = s["aborted"].as_str() {
                let _ = write!(r, ": {a}");
            }
            r
        };
        let _ = writeln!(
            doc,
            "| {} | {package} | {result} | {passed} passed, {failed} failed | {} | {} | {} min, {} at {} |",
            s["release"].as_str().unwrap_or("?"),
            if fallbacks.is_empty() {
                "none".into()
            } else {
                fallbacks.join("; ")
            },
            s["guest"].as_str().unwrap_or("?"),
            (s["seconds"].as_f64().unwrap_or(0.0) / 60.0).round(),
            s["commit"].as_str().unwrap_or("?"),
            s["date"].as_str().unwrap_or("?"),
        );
    }
    let _ = writeln!(
        doc,
        "\nNot in the matrix: the 5.15 and 6.6 LTS series (Ubuntu 22.04, Amazon Linux 2's 5.15, many \
         managed node images), because Debian never shipped them and this machine reaches no other \
         kernel source. Both lie between kernels that pass, and the agent probes each feature on \
         the node instead of trusting the version number, but they are untested."
    );
    let _ = writeln!(doc, "\n## What each fallback changes\n");
    let mut seen = Vec::new();
    for s in summaries {
        for f in s["features"]["features"].as_array().into_iter().flatten() {
            let name = f["name"].as_str().unwrap_or("?");
            if f["present"] == false && !seen.contains(&name) {
                seen.push(name);
                let _ = writeln!(
                    doc,
                    "- **{name}** (Linux {}): {}.",
                    f["since"].as_str().unwrap_or("?"),
                    f["fallback"]
                        .as_str()
                        .unwrap_or("required: the agent refuses to start")
                );
            }
        }
    }
    if seen.is_empty() {
        let _ = writeln!(doc, "None of the kernels above lacks a feature.");
    }
    let _ = writeln!(
        doc,
        "\n## Every program through each kernel's verifier\n\n`lb-agent kernel` in each guest: \
         instructions after the verifier's rewrites, and the verifier's steps where the kernel \
         reports them (5.16 and later; the limit is 1,000,000).\n"
    );
    per_kernel_table(
        &mut doc,
        summaries,
        "Program",
        "/features/programs",
        "name",
        |p| match p {
            None => "not loaded".to_string(),
            Some(p) => match p["verified_instructions"].as_u64() {
                Some(steps) => format!("{} / {steps}", p["instructions"]),
                None => format!("{}", p["instructions"]),
            },
        },
    );
    let _ = writeln!(doc, "\n## Per test binary\n");
    per_kernel_table(&mut doc, summaries, "Binary", "/results", "binary", |r| match r {
        None => "-".to_string(),
        Some(r) if r["not_run"] == true => "not run".to_string(),
        Some(r) if r["ok"] == true => format!(
            "{} passed ({:.0} s)",
            r["passed"],
            r["seconds"].as_f64().unwrap_or(0.0)
        ),
        Some(r) => {
            let failures: Vec<&str> = r["failures"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            format!("**FAILED** {}", failures.join(", "))
        }
    });
    doc
}

/// A table with a row per item of every summary's `list` (a JSON pointer), named by its `key`,
/// and a column per kernel whose cells `cell` writes from that kernel's item (`None`: absent).
fn per_kernel_table(
    doc: &mut String,
    summaries: &[Value],
    title: &str,
    list: &str,
    key: &str,
    cell: impl Fn(Option<&Value>) -> String,
) {
    let items = |s: &Value| {
        s.pointer(list)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let mut rows: Vec<String> = summaries
        .iter()
        .flat_map(items)
        .filter_map(|item| item[key].as_str().map(str::to_string))
        .collect();
    rows.sort();
    rows.dedup();
    let _ = write!(doc, "| {title} |");
    for s in summaries {
        let _ = write!(doc, " {} |", s["release"].as_str().unwrap_or("?"));
    }
    let _ = writeln!(doc, "\n|---|{}", "---|".repeat(summaries.len()));
    for row in &rows {
        let _ = write!(doc, "| {row} |");
        for s in summaries {
            let item = items(s)
                .into_iter()
                .find(|i| i[key].as_str() == Some(row.as_str()));
            let _ = write!(doc, " {} |", cell(item.as_ref()));
        }
        doc.push('\n');
    }
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

    #[test]
    fn results_are_read_from_the_test_output() {
        let log = "running 2 tests\ntest a ... ok\ntest b ... FAILED\n\nfailures:\n\ntest result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s\n";
        let r = binary_result("socket_lb", log, Some(101), 1.5);
        assert_eq!(r["ok"], false);
        assert_eq!(r["passed"], 1);
        assert_eq!(r["failures"], json!(["b"]));
        let good = binary_result(
            "x",
            "test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.1s\n",
            Some(0),
            0.1,
        );
        assert_eq!(good["ok"], true);
        // A binary that crashed before printing a result is a failure, whatever its exit.
        assert_eq!(binary_result("x", "", Some(0), 0.0)["ok"], false);
        assert!(result_line("6.1.0-56-amd64", &r).contains("failed: b"));
    }

    #[test]
    fn the_doc_lists_every_kernel_and_fallback() {
        let summary = |release: &str, ok: bool, fallback: bool| {
            json!({
                "release": release, "package": format!("linux-image-{release}"), "version": "1",
                "guest": "TCG", "ok": ok, "aborted": null, "seconds": 600.0, "commit": "abc", "date": "d",
                "features": {"minimum": "5.10", "features": [
                    {"name": "TCX", "since": "6.6", "present": !fallback, "fallback": "clsact filters"}
                ], "programs": [
                    {"name": "lb_tc_ingress", "instructions": 9000,
                     "verified_instructions": if fallback { json!(null) } else { json!(20000) }}
                ]},
                "results": [{"binary": "tc_fixtures", "ok": ok, "passed": 21, "failed": u64::from(!ok),
                             "seconds": 12.0, "failures": if ok { json!([]) } else { json!(["x"]) }}],
            })
        };
        let doc = render_doc(&[
            summary("6.1.0-56-amd64", true, true),
            summary("6.12.117+deb13-amd64", false, false),
        ]);
        assert!(doc.contains("older than 5.10"), "{doc}");
        assert!(
            doc.contains(
                "| 6.1.0-56-amd64 | linux-image-6.1.0-56-amd64 1 | passed | 21 passed, 0 failed | TCX (6.6) |"
            ),
            "{doc}"
        );
        assert!(doc.contains("- **TCX** (Linux 6.6): clsact filters."), "{doc}");
        assert!(doc.contains("| lb_tc_ingress | 9000 | 9000 / 20000 |"), "{doc}");
        assert!(
            doc.contains("| tc_fixtures | 21 passed (12 s) | **FAILED** x |"),
            "{doc}"
        );
    }
}
