//! The Kubernetes binaries the end-to-end tests, the sandbox and the benchmarks run: etcd,
//! kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl and kube-proxy, built from their published Go modules with the
//! wrapper modules committed under `xtask/go/` and cached under `<cache>/`.
//!
//! - `xtask/go/etcd`: `require go.etcd.io/etcd/server/v3`, built as `etcd`;
//! - `xtask/go/k8s`: `require k8s.io/kubernetes` plus a `replace` block that maps every staging
//!   module to its published release (k8s.io/kubernetes itself cannot be `go install`ed: its own
//!   go.mod replaces them with `./staging` paths, which only work inside its repository).
//!
//! Each wrapper is copied into its build directory (`<cache>/etcd-<version>/`,
//! `<cache>/k8s-<version>/`) and built there; all four binaries land in `<cache>/k8s-<version>/bin/`
//! so one directory (`LB_K8S_BIN_DIR` for the tests) locates them. A stamp per component in that
//! directory records the version, a hash of the committed Go files and the build recipe; when every
//! stamp matches and every binary exists, `ensure` returns without running `go` at all.

use std::{
    fs,
    fs::File,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result, bail};

use crate::util::{self, step};

/// The Kubernetes release kube-apiserver, kubectl and kube-proxy are built from (v1.37.2's module
/// zip is not served by the module proxy this project builds with; v1.37.1 is).
pub const KUBERNETES_VERSION: &str = "v1.37.1";
/// The etcd release: the newest v3.6 patch. kube-apiserver 1.37 supports etcd >= 3.5.24
/// (kubeadm's `MinExternalEtcdVersion`; its default is 3.7.0) and talks to it with the v3 API.
pub const ETCD_VERSION: &str = "v3.6.16";
/// The Go release line the wrapper modules declare (`go 1.26.0`); built with GOTOOLCHAIN=local.
const MIN_GO_MINOR: u32 = 26;
/// The committed Go files of a wrapper module (the e2e wrapper adds its test main).
const GO_FILES: [&str; 3] = ["go.mod", "go.sum", "tools.go"];
/// The CoreDNS release kubeadm deploys with Kubernetes v1.37 (its `CoreDNSVersion`).
pub const COREDNS_VERSION: &str = "v1.14.6";
/// agnhost's version in the pinned release (`test/images/agnhost/VERSION`).
pub const AGNHOST_VERSION: &str = "2.66.1";

/// The cached control-plane binaries, all in `dir`.
// Today's callers only pass `dir` on (LB_K8S_BIN_DIR); the paths are for those wanting one binary.
#[allow(dead_code)]
pub struct K8sBins {
    pub dir: PathBuf,
    pub etcd: PathBuf,
    pub kube_apiserver: PathBuf,
    pub kubectl: PathBuf,
    pub kube_proxy: PathBuf,
    pub kube_controller_manager: PathBuf,
    pub kube_scheduler: PathBuf,
    pub kubelet: PathBuf,
}

/// One wrapper module and what it builds.
struct Component {
    /// Short name: the directory under `xtask/go/` and the stamp's name.
    name: &'static str,
    version: &'static str,
    /// Build directory under the cache.
    build_dir: PathBuf,
    /// (Go package, binary name) pairs built by one `go build`.
    programs: Vec<(&'static str, &'static str)>,
    /// A test binary built with `go test -c` from the wrapper's own package (`e2e.test`).
    test_program: Option<&'static str>,
    /// Committed files besides [`GO_FILES`] (the e2e wrapper's test main).
    extra_files: &'static [&'static str],
    ldflags: String,
    /// Expected in the output of the version check of every binary (see `version_check`).
    version_text: String,
}

impl Component {
    fn committed_dir(&self) -> PathBuf {
        util::workspace_root().join("xtask/go").join(self.name)
    }

    fn stamp_path(&self, bin_dir: &Path) -> PathBuf {
        bin_dir.join(format!(".{}.stamp", self.name))
    }

    fn go_files(&self) -> impl Iterator<Item = &'static str> + '_ {
        GO_FILES.into_iter().chain(self.extra_files.iter().copied())
    }

    /// The `go` commands' arguments (after `go`) for one output directory: `go build` of the
    /// programs, `go test -c` of the test program.
    fn build_commands(&self, bin_dir: &Path) -> Vec<Vec<String>> {
        let mut commands = Vec::new();
        if !self.programs.is_empty() {
            commands.push(self.build_args(bin_dir));
        }
        if let Some(binary) = self.test_program {
            commands.push(vec![
                "test".to_string(),
                "-c".into(),
                "-trimpath".into(),
                format!("-ldflags={}", self.ldflags),
                "-o".into(),
                bin_dir.join(binary).display().to_string(),
                ".".into(),
            ]);
        }
        commands
    }

    /// The `go build` arguments after `go`, for one output directory.
    fn build_args(&self, bin_dir: &Path) -> Vec<String> {
        let mut args = vec![
            "build".to_string(),
            "-trimpath".into(),
            format!("-ldflags={}", self.ldflags),
        ];
        if let [(package, binary)] = self.programs[..] {
            // One program: name the output (a module path ending in /v3 would name it "server").
            args.extend([
                "-o".into(),
                bin_dir.join(binary).display().to_string(),
                package.into(),
            ]);
        } else {
            args.extend(["-o".into(), format!("{}/", bin_dir.display())]);
            args.extend(self.programs.iter().map(|(package, _)| package.to_string()));
        }
        args
    }

    /// What the stamp must say for the binaries to be reused: version, Go files, recipe.
    fn wanted_stamp(&self) -> Result<String> {
        let dir = self.committed_dir();
        use std::hash::Hasher;
        let mut hash = fnv::FnvHasher::default();
        for file in self.go_files() {
            let path = dir.join(file);
            let bytes = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            hash.write(file.as_bytes());
            hash.write(&[0]);
            hash.write(&(bytes.len() as u64).to_le_bytes());
            hash.write(&bytes);
        }
        let recipe = self
            .build_commands(Path::new("bin"))
            .iter()
            .map(|c| c.join(" "))
            .collect::<Vec<_>>()
            .join(" && ");
        Ok(format!(
            "component={}\nversion={}\ngo-files-fnv64={:016x}\nrecipe={recipe}\nenv={}\n",
            self.name,
            self.version,
            hash.finish(),
            BUILD_ENV
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        ))
    }

    fn binaries<'a>(&'a self, bin_dir: &'a Path) -> impl Iterator<Item = PathBuf> + 'a {
        self.programs
            .iter()
            .map(|(_, binary)| *binary)
            .chain(self.test_program)
            .map(move |binary| bin_dir.join(binary))
    }

    fn is_current(&self, bin_dir: &Path) -> Result<bool> {
        if !self.binaries(bin_dir).all(|b| b.is_file()) {
            return Ok(false);
        }
        let have = fs::read_to_string(self.stamp_path(bin_dir)).unwrap_or_default();
        Ok(have == self.wanted_stamp()?)
    }

    /// Copies the committed wrapper module into the build directory and builds into `bin_dir`.
    fn build(&self, go: &Path, bin_dir: &Path) -> Result<()> {
        let stamp = self.stamp_path(bin_dir);
        // A build that stops half-way must not leave a stamp behind that vouches for it.
        match fs::remove_file(&stamp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", stamp.display()));
            }
            _ => {}
        }
        fs::create_dir_all(&self.build_dir)
            .with_context(|| format!("creating {}", self.build_dir.display()))?;
        let committed = self.committed_dir();
        for file in self.go_files() {
            let (from, to) = (committed.join(file), self.build_dir.join(file));
            fs::copy(&from, &to)
                .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        }
        let started = Instant::now();
        for args in self.build_commands(bin_dir) {
            let mut cmd = Command::new(go);
            cmd.args(args).current_dir(&self.build_dir);
            go_env(&mut cmd);
            util::run(&mut cmd).with_context(|| {
                format!(
                    "building {} {} in {}",
                    self.name,
                    self.version,
                    self.build_dir.display()
                )
            })?;
        }
        for binary in self.binaries(bin_dir) {
            let Some((args, version_text)) = version_check(&binary, &self.version_text) else {
                continue;
            };
            let out = util::output(Command::new(&binary).args(args))
                .with_context(|| format!("the freshly built {} does not run", binary.display()))?;
            if !out.contains(&version_text) {
                bail!(
                    "{} {args:?} printed {:?}, expected it to contain {:?}",
                    binary.display(),
                    out.trim(),
                    version_text
                );
            }
        }
        fs::write(&stamp, self.wanted_stamp()?).with_context(|| format!("writing {}", stamp.display()))?;
        step(&format!(
            "built {} {} in {:.0?}",
            self.name,
            self.version,
            started.elapsed()
        ));
        Ok(())
    }
}

/// Environment of every `go` command: modules as committed (plus any missing go.sum lines), no
/// VCS stamping (the cache may sit in someone's checkout), the installed Go only, no go.work from
/// a parent directory, static binaries (no C toolchain needed, as in the upstream release builds
/// of these programs). Replaces the caller's GOFLAGS.
const BUILD_ENV: [(&str, &str); 4] = [
    ("GOFLAGS", "-mod=mod -buildvcs=false"),
    ("GOTOOLCHAIN", "local"),
    ("GOWORK", "off"),
    ("CGO_ENABLED", "0"),
];

fn go_env(cmd: &mut Command) {
    for (k, v) in BUILD_ENV {
        cmd.env(k, v);
    }
}

/// The version linker flags hack/lib/version.sh sets, so `--version` and `/version` report the
/// release instead of `v0.0.0-master`.
fn kubernetes_ldflags() -> String {
    let (major, minor) = major_minor(KUBERNETES_VERSION);
    let mut flags = vec!["-s".to_string(), "-w".into()];
    for package in ["k8s.io/component-base/version", "k8s.io/client-go/pkg/version"] {
        for (key, value) in [
            ("gitVersion", KUBERNETES_VERSION),
            ("gitMajor", major),
            ("gitMinor", minor),
            ("gitTreeState", "clean"),
        ] {
            flags.push(format!("-X {package}.{key}={value}"));
        }
    }
    flags.join(" ")
}

fn major_minor(version: &str) -> (&str, &str) {
    let mut parts = version.trim_start_matches('v').split('.');
    (parts.next().unwrap_or_default(), parts.next().unwrap_or_default())
}

fn components(cache: &Path) -> [Component; 2] {
    [
        Component {
            name: "etcd",
            version: ETCD_VERSION,
            build_dir: cache.join(format!("etcd-{ETCD_VERSION}")),
            programs: vec![("go.etcd.io/etcd/server/v3", "etcd")],
            test_program: None,
            extra_files: &[],
            ldflags: "-s -w".into(),
            version_text: format!("etcd Version: {}", ETCD_VERSION.trim_start_matches('v')),
        },
        Component {
            name: "k8s",
            version: KUBERNETES_VERSION,
            build_dir: cache.join(format!("k8s-{KUBERNETES_VERSION}")),
            programs: vec![
                ("k8s.io/kubernetes/cmd/kube-apiserver", "kube-apiserver"),
                ("k8s.io/kubernetes/cmd/kubectl", "kubectl"),
                ("k8s.io/kubernetes/cmd/kube-proxy", "kube-proxy"),
                (
                    "k8s.io/kubernetes/cmd/kube-controller-manager",
                    "kube-controller-manager",
                ),
                ("k8s.io/kubernetes/cmd/kube-scheduler", "kube-scheduler"),
                ("k8s.io/kubernetes/cmd/kubelet", "kubelet"),
            ],
            test_program: None,
            extra_files: &[],
            ldflags: kubernetes_ldflags(),
            version_text: KUBERNETES_VERSION.to_string(),
        },
    ]
}

/// Builds what is missing or stale and returns where the binaries are. Idempotent: when everything
/// is current it only reads two stamp files.
pub fn ensure(cache: &Path) -> Result<K8sBins> {
    let bin_dir = cache.join(format!("k8s-{KUBERNETES_VERSION}")).join("bin");
    let bins = K8sBins {
        etcd: bin_dir.join("etcd"),
        kube_apiserver: bin_dir.join("kube-apiserver"),
        kubectl: bin_dir.join("kubectl"),
        kube_proxy: bin_dir.join("kube-proxy"),
        kube_controller_manager: bin_dir.join("kube-controller-manager"),
        kube_scheduler: bin_dir.join("kube-scheduler"),
        kubelet: bin_dir.join("kubelet"),
        dir: bin_dir.clone(),
    };
    build_stale(cache, &components(cache), &bin_dir)?;
    Ok(bins)
}

/// What the upstream e2e run needs besides the cluster's binaries, cached in
/// `<cache>/k8s-<version>/bin` beside them.
pub struct UpstreamE2eBins {
    /// The e2e suite with the specs of test/e2e/network (`go test -c`, xtask/go/e2e).
    pub e2e_test: PathBuf,
    /// ginkgo's runner (parallel processes), from the suite's own ginkgo release.
    pub ginkgo: PathBuf,
    /// The programs of the test images the specs run.
    pub agnhost: PathBuf,
    pub regression_issue_74839: PathBuf,
    /// The cluster DNS (xtask/go/coredns).
    pub coredns: PathBuf,
}

/// Builds e2e.test, ginkgo, agnhost, regression-issue-74839 and CoreDNS when missing or stale (once:
/// about 10 minutes on two cores), and returns their paths. `./x test` never needs them.
pub fn ensure_upstream_e2e(cache: &Path) -> Result<UpstreamE2eBins> {
    let bin_dir = cache.join(format!("k8s-{KUBERNETES_VERSION}")).join("bin");
    let components = [
        Component {
            name: "e2e",
            version: KUBERNETES_VERSION,
            build_dir: cache.join(format!("e2e-{KUBERNETES_VERSION}")),
            programs: vec![
                // The runner that spreads the specs over parallel e2e.test processes.
                ("github.com/onsi/ginkgo/v2/ginkgo", "ginkgo"),
                ("k8s.io/kubernetes/test/images/agnhost", "agnhost"),
                (
                    "k8s.io/kubernetes/test/images/regression-issue-74839",
                    "regression-issue-74839",
                ),
            ],
            test_program: Some("e2e.test"),
            extra_files: &["e2e_test.go"],
            // agnhost's version, as its Makefile sets it (the other programs have no main.Version).
            ldflags: format!("{} -X main.Version={AGNHOST_VERSION}", kubernetes_ldflags()),
            version_text: KUBERNETES_VERSION.to_string(),
        },
        Component {
            name: "coredns",
            version: COREDNS_VERSION,
            build_dir: cache.join(format!("coredns-{COREDNS_VERSION}")),
            programs: vec![("github.com/coredns/coredns", "coredns")],
            test_program: None,
            extra_files: &[],
            ldflags: "-s -w".into(),
            version_text: COREDNS_VERSION.to_string(),
        },
    ];
    build_stale(cache, &components, &bin_dir)?;
    Ok(UpstreamE2eBins {
        e2e_test: bin_dir.join("e2e.test"),
        ginkgo: bin_dir.join("ginkgo"),
        agnhost: bin_dir.join("agnhost"),
        regression_issue_74839: bin_dir.join("regression-issue-74839"),
        coredns: bin_dir.join("coredns"),
    })
}

/// Builds cilium-agent (the benchmark's Cilium peer, xtask/go/cilium) into `bin_dir` when missing
/// or stale (once: about 20 minutes on two cores) and returns its path; `go_module_dir` is
/// then where Go keeps the Cilium module (its BPF sources and CRDs).
pub fn ensure_cilium_agent(cache: &Path, bin_dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let version = crate::cilium::VERSION;
    let bare = version.trim_start_matches('v');
    let component = Component {
        name: "cilium",
        version,
        build_dir: cache.join(format!("cilium-{version}/build")),
        programs: vec![("github.com/cilium/cilium/daemon", "cilium-agent")],
        test_program: None,
        extra_files: &[],
        // What Cilium's Makefile.defs sets (the release, as `cilium-agent --version` prints it).
        ldflags: format!("-s -w -X 'github.com/cilium/cilium/pkg/version.ciliumVersion={bare} go-module'"),
        version_text: format!("cilium-agent {bare}"),
    };
    build_stale(cache, std::slice::from_ref(&component), bin_dir)?;
    let mut list = Command::new(find_go()?);
    list.args(["list", "-m", "-f", "{{.Dir}}", "github.com/cilium/cilium"])
        .current_dir(&component.build_dir);
    go_env(&mut list);
    let module_dir = PathBuf::from(util::output(&mut list)?.trim());
    Ok((bin_dir.join("cilium-agent"), module_dir))
}

/// Builds every component whose binaries or stamp are not current, under one lock.
fn build_stale(cache: &Path, components: &[Component], bin_dir: &Path) -> Result<()> {
    if all_current(components, bin_dir)? {
        return Ok(());
    }
    fs::create_dir_all(bin_dir).with_context(|| format!("creating {}", bin_dir.display()))?;
    // Two commands building at once (say a test run and the sandbox) would race on the outputs.
    let _lock = lock(&cache.join(".k8s-bins.lock"))?;
    let go = find_go()?;
    for c in components {
        if c.is_current(bin_dir)? {
            continue;
        }
        let what = c
            .programs
            .iter()
            .map(|(_, b)| *b)
            .chain(c.test_program)
            .collect::<Vec<_>>()
            .join(", ");
        let how_long = match c.name {
            "k8s" => "about 15 minutes",
            "e2e" => "about 8 minutes",
            "coredns" => "about 3 minutes",
            "cilium" => "about 20 minutes",
            _ => "about 1 minute",
        };
        step(&format!(
            "building {what} {} from Go modules ({how_long}, once)",
            c.version
        ));
        c.build(&go, bin_dir)?;
    }
    Ok(())
}

/// How a freshly built binary shows it is the wanted release: the arguments that print its
/// version and what they must print (`component_version` unless the program has its own).
/// regression-issue-74839 has no version flag (it starts serving): it is not run.
fn version_check(binary: &Path, component_version: &str) -> Option<(&'static [&'static str], String)> {
    let name = binary.file_name()?.to_str()?;
    match name {
        "kubectl" => Some((&["version", "--client"], component_version.to_string())),
        "agnhost" => Some((&["--version"], AGNHOST_VERSION.to_string())),
        "ginkgo" => Some((&["version"], "Ginkgo Version".to_string())),
        "coredns" => Some((
            &["-version"],
            format!("CoreDNS-{}", COREDNS_VERSION.trim_start_matches('v')),
        )),
        "regression-issue-74839" => None,
        _ => Some((&["--version"], component_version.to_string())),
    }
}

fn all_current(components: &[Component], bin_dir: &Path) -> Result<bool> {
    for c in components {
        if !c.is_current(bin_dir)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The `go` command: on PATH, else the official tarball's place; at least Go 1.26.
fn find_go() -> Result<PathBuf> {
    let go = if util::have("go") {
        PathBuf::from("go")
    } else if Path::new("/usr/local/go/bin/go").is_file() {
        PathBuf::from("/usr/local/go/bin/go")
    } else {
        bail!(
            "`go` is not installed (not on PATH, not in /usr/local/go/bin); etcd, kube-apiserver, kubectl and \
             kube-proxy are built from their Go modules and need Go >= 1.{MIN_GO_MINOR}: install it from \
             https://go.dev/dl/ (Debian 12's golang package is too old) and put it on PATH"
        );
    };
    let mut cmd = Command::new(&go);
    cmd.args(["env", "GOVERSION"]);
    go_env(&mut cmd);
    let version =
        util::output(&mut cmd).with_context(|| format!("running {} env GOVERSION", go.display()))?;
    let version = version.trim();
    let minor = version
        .strip_prefix("go1.")
        .and_then(|rest| rest.split(['.', 'r', 'b']).next()?.parse::<u32>().ok());
    match minor {
        Some(m) if m >= MIN_GO_MINOR => Ok(go),
        _ => bail!(
            "{} is {version}; building the control-plane binaries needs Go >= 1.{MIN_GO_MINOR} \
             (from https://go.dev/dl/)",
            go.display()
        ),
    }
}

/// An exclusive lock on `path`, released when the file is dropped.
fn lock(path: &Path) -> Result<File> {
    crate::util::lock_exclusive(path, "another build of the control-plane binaries")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stamps' hash is FNV-1a 64 (stamps written before the `fnv` crate stay valid).
    #[test]
    fn fnv_matches_reference_vectors() {
        use std::hash::Hasher;
        let mut h = fnv::FnvHasher::default();
        assert_eq!(h.finish(), 0xcbf2_9ce4_8422_2325);
        h.write(b"a");
        assert_eq!(h.finish(), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn ldflags_carry_the_release() {
        let flags = kubernetes_ldflags();
        assert!(
            flags.contains("-X k8s.io/component-base/version.gitVersion=v1.37.1"),
            "{flags}"
        );
        assert!(
            flags.contains("-X k8s.io/client-go/pkg/version.gitMinor=37"),
            "{flags}"
        );
        assert_eq!(major_minor("v1.37.1"), ("1", "37"));
    }

    #[test]
    fn committed_wrappers_pin_the_versions() {
        let root = util::workspace_root().join("xtask/go");
        let k8s = fs::read_to_string(root.join("k8s/go.mod")).unwrap();
        assert!(k8s.contains(&format!("require k8s.io/kubernetes {KUBERNETES_VERSION}")));
        let staging = KUBERNETES_VERSION.replacen("v1.", "v0.", 1);
        let replaces = k8s.lines().filter(|l| l.contains("=>")).collect::<Vec<_>>();
        assert!(replaces.len() >= 33, "{replaces:?}");
        assert!(
            replaces.iter().all(|l| l.trim_end().ends_with(&staging)),
            "{replaces:?}"
        );
        let etcd = fs::read_to_string(root.join("etcd/go.mod")).unwrap();
        assert!(etcd.contains(&format!("require go.etcd.io/etcd/server/v3 {ETCD_VERSION}")));
    }
}
