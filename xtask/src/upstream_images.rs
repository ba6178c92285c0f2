//! The container images the upstream Kubernetes e2e Service specs run, under the exact names
//! `e2e.test` asks kubelet for, built as OCI archives without a registry or a container engine
//! (the archive writer, stamps and `images.json` of `image.rs`). This module owns their recipes,
//! the Debian packages they take files from, and `target/images/upstream`:
//!
//! - `registry.k8s.io/e2e-test-images/agnhost:2.66.1`: upstream's test/images/agnhost/Dockerfile
//!   on Debian instead of Alpine. `/agnhost` (built by `k8s::ensure_upstream_e2e`), the
//!   `/agnhost-2 -> agnhost` link, `/uploads`, porter's `/localhost.crt` and `/localhost.key`, the
//!   user `user-defined-in-image` (uid 1000, also in group `group-defined-in-image`, gid 50000),
//!   `/coredns` (the v1.14.6 of the cluster; upstream bundles 1.6.2 for the DNS specs that run
//!   it), and the tools the Dockerfile installs with apk, from Debian bookworm's packages with
//!   their whole dependency closure ([`AGNHOST_PACKAGES`]). Alpine's other commands (`cat`,
//!   `seq`, `wget`, ...) are BusyBox applets there, and are here too: Debian's static BusyBox at
//!   `/bin/busybox`, linked for every applet no Debian package provides; `/bin/sh` is dash.
//! - `registry.k8s.io/e2e-test-images/busybox:1.37.0-2`: Debian's `busybox-static` 1.37 (trixie)
//!   at `/bin/busybox` with a link in `/bin` for every applet, as the official busybox image.
//! - `registry.k8s.io/pause:3.10.2`: the static pause of [`image::build_pause`].
//! - `registry.k8s.io/e2e-test-images/regression-issue-74839:1.5` and
//!   `registry.k8s.io/coredns/coredns:v1.14.6`: their static programs (`k8s.rs`); CoreDNS with
//!   distroless' users and `USER nonroot:nonroot`, as upstream, but without upstream's file
//!   capability on /coredns (a layer here has no xattrs): it binds port 53 in a Pod through
//!   containerd 2's `enable_unprivileged_ports`, not on the host network.
//!
//! Packages are resolved and downloaded once through the private apt lists of `kernel.rs` (the
//! machine's apt is untouched): the closure of what an image needs, as `apt-get install` computes
//! it on an empty system (an empty dpkg status), restricted to one release's suites. They are
//! kept under `<cache>/upstream-images/debs/` with a stamp; a later build uses them without the
//! network (security updates come in when the package list below changes, or the directory is
//! removed). Each image's root is assembled in `target/images/upstream/build/<name>-root`
//! (`dpkg-deb -x`, then what the packages' maintainer scripts or the Dockerfile would have done),
//! its programs are run there with `chroot` (the build fails when one does not run), and it is
//! packed as the image's one layer. A stamp next to each root lists every input; the archives'
//! stamps are `image.rs`'s: same inputs, same bytes.

use std::{
    collections::BTreeMap,
    fs,
    io::{self, Write as _},
    os::unix::fs::{PermissionsExt, symlink},
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result, bail};

use crate::{
    image::{self, Built, IMAGE_PATH, Layer, Plan, Recipe},
    k8s::{self, AGNHOST_VERSION},
    kernel::PrivateApt,
    util::{self, step, workspace_root},
};

pub const AGNHOST_REF: &str = "registry.k8s.io/e2e-test-images/agnhost:2.66.1";
pub const BUSYBOX_REF: &str = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2";
pub const PAUSE_REF: &str = "registry.k8s.io/pause:3.10.2";
pub const REGRESSION_REF: &str = "registry.k8s.io/e2e-test-images/regression-issue-74839:1.5";
pub const COREDNS_REF: &str = "registry.k8s.io/coredns/coredns:v1.14.6";

/// The images of k8s.io/kubernetes' test/utils/image/manifest.go (what `e2e.test` pulls) built
/// here: (its ImageID there, our reference).
const E2E_IMAGES: &[(&str, &str)] = &[
    ("Agnhost", AGNHOST_REF),
    ("BusyBox", BUSYBOX_REF),
    ("Pause", PAUSE_REF),
    ("RegressionIssue74839", REGRESSION_REF),
];

/// Changes whenever the way a root is assembled changes (beyond what its steps describe), so
/// that older root stamps no longer match.
const ASSEMBLY: &str = "lb-upstream-root 1";

/// What agnhost's Dockerfile installs with `apk add` (bind-tools curl netcat-openbsd iproute2
/// iperf bash util-linux-misc socat), as Debian bookworm packages, and what Alpine's base gives
/// the specs' shell commands that BusyBox does not.
const AGNHOST_PACKAGES: &[&str] = &[
    "bind9-dnsutils", // dig, nslookup
    "curl",
    "netcat-openbsd", // nc
    "iproute2",       // ip, ss
    "iperf",
    "bash",
    "util-linux", // ipcs
    "socat",
    "dash",     // /bin/sh
    "libc-bin", // getent (the DNS specs run `getent hosts`; musl-utils on Alpine)
    "netbase",  // /etc/services, /etc/protocols (alpine-baselayout-data)
];

/// Debian's suites of one release (the same mirror and lists as the kernels' private apt).
const BOOKWORM: &[&str] = &["bookworm", "bookworm-updates", "bookworm-security"];
const TRIXIE: &[&str] = &["trixie", "trixie-updates", "trixie-security"];

/// Packages from one release, with the closure of their dependencies (Depends and Pre-Depends,
/// no Recommends), and version prefixes some of them must have.
#[derive(Debug)]
struct DebSet {
    /// Its directory under `<cache>/upstream-images/debs`.
    name: &'static str,
    suites: &'static [&'static str],
    packages: &'static [&'static str],
    /// (package, version prefix).
    versions: &'static [(&'static str, &'static str)],
}

const AGNHOST_DEBS: DebSet = DebSet {
    name: "agnhost-bookworm",
    suites: BOOKWORM,
    packages: AGNHOST_PACKAGES,
    versions: &[],
};

/// BusyBox 1.37, as the busybox:1.37.0 image the e2e busybox image mirrors (and Alpine 3.21's).
const BUSYBOX_DEBS: DebSet = DebSet {
    name: "busybox-static-trixie",
    suites: TRIXIE,
    packages: &["busybox-static"],
    versions: &[("busybox-static", "1:1.37.0-")],
};
/// Where `busybox-static` has the binary.
const BUSYBOX_IN_DEB: &str = "usr/bin/busybox";

/// What the maintainer scripts of agnhost's packages would link (`nc` by netcat-openbsd's
/// update-alternatives; bookworm's dash ships `/bin/sh -> dash` itself), and the Dockerfile's
/// `/usr/local/bin/iperf` and `/agnhost-2`.
const AGNHOST_LINKS: &[(&str, &str)] = &[
    ("bin/nc", "nc.openbsd"),
    ("bin/netcat", "nc.openbsd"),
    ("usr/local/bin/iperf", "/usr/bin/iperf"),
    ("agnhost-2", "agnhost"),
];

/// Left out of the package contents, as Debian's slim images do (the licences stay).
const PRUNED: &[&str] = &[
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bug",
];

const NSSWITCH: &str = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n\
                        protocols: files\nservices: files\nethers: files\nrpc: files\n";

/// Alpine's root and nobody, and what the Dockerfile's adduser/addgroup make.
const AGNHOST_PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                              user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n\
                              nobody:x:65534:65534:nobody:/:/sbin/nologin\n";
const AGNHOST_GROUP: &str = "root:x:0:root\nuser-defined-in-image:x:1000:\n\
                             group-defined-in-image:x:50000:user-defined-in-image\nnobody:x:65534:\n";

/// The official busybox image's (buildroot's) users and groups.
const BUSYBOX_PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                              daemon:x:1:1:daemon:/usr/sbin:/bin/false\n\
                              bin:x:2:2:bin:/bin:/bin/false\n\
                              sys:x:3:3:sys:/dev:/bin/false\n\
                              sync:x:4:100:sync:/bin:/bin/sync\n\
                              mail:x:8:8:mail:/var/spool/mail:/bin/false\n\
                              www-data:x:33:33:www-data:/var/www:/bin/false\n\
                              operator:x:37:37:Operator:/var:/bin/false\n\
                              nobody:x:65534:65534:nobody:/home:/bin/false\n";
const BUSYBOX_GROUP: &str = "root:x:0:\ndaemon:x:1:\nbin:x:2:\nsys:x:3:\nadm:x:4:\ntty:x:5:\ndisk:x:6:\n\
                             lp:x:7:\nmail:x:8:\nkmem:x:9:\nwheel:x:10:root\ncdrom:x:11:\ndialout:x:18:\n\
                             floppy:x:19:\nvideo:x:28:\naudio:x:29:\ntape:x:32:\nwww-data:x:33:\n\
                             operator:x:37:\nutmp:x:43:\nplugdev:x:46:\nstaff:x:50:\nlock:x:54:\n\
                             netdev:x:82:\nusers:x:100:\nnogroup:x:65534:\n";

/// distroless/static's users and groups (CoreDNS' base).
const DISTROLESS_PASSWD: &str = "root:x:0:0:root:/root:/sbin/nologin\n\
                                 nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n\
                                 nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n";
const DISTROLESS_GROUP: &str = "root:x:0:\nnobody:x:65534:\ntty:x:5:\nstaff:x:50:\nnonroot:x:65532:\n";

const ROOT_PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n";
const ROOT_GROUP: &str = "root:x:0:\n";

/// A program run in an image's root at build time, and what its output must contain.
type Check = (&'static [&'static str], &'static str);

const AGNHOST_CHECKS: &[Check] = &[
    (&["/agnhost", "--version"], AGNHOST_VERSION),
    (&["/agnhost-2", "--version"], AGNHOST_VERSION),
    (&["/coredns", "-version"], "CoreDNS-"),
    (&["/bin/sh", "-c", "echo shell; seq 2 | cat"], "shell\n1\n2\n"),
    (&["bash", "--version"], "GNU bash"),
    (&["curl", "--version"], "libcurl/"),
    (&["dig", "-v"], "DiG 9."),
    (&["nslookup", "-version"], "nslookup 9."),
    (&["nc", "-h"], "OpenBSD netcat"),
    (&["ip", "-V"], "iproute2"),
    (&["ss", "-V"], "iproute2"),
    (&["iperf", "-v"], "iperf version 2"),
    (&["/usr/local/bin/iperf", "-v"], "iperf version 2"),
    (&["ipcs", "-V"], "util-linux"),
    (&["socat", "-V"], "socat version"),
    (
        &["getent", "passwd", "user-defined-in-image"],
        "user-defined-in-image:x:1000:1000:",
    ),
    (&["id", "-G", "user-defined-in-image"], "1000 50000"),
    (&["wget", "--help"], "Usage: wget"),
];

const BUSYBOX_CHECKS: &[Check] = &[
    (&["/bin/sh", "-c", "echo shell; seq 2 | cat"], "shell\n1\n2\n"),
    (&["/bin/busybox"], "BusyBox v1.37.0"),
    (&["wget", "--help"], "Usage: wget"),
    (&["nslookup", "--help"], "Usage: nslookup"),
    (&["/usr/bin/env", "id", "-u", "nobody"], "65534"),
];

const COREDNS_CHECKS: &[Check] = &[(&["/coredns", "-version"], "CoreDNS-")];
const PAUSE_CHECKS: &[Check] = &[(&["/pause", "-v"], "pause.c v")];

/// The default output directory, `<workspace>/target/images/upstream`.
pub fn default_dir() -> PathBuf {
    workspace_root().join("target/images/upstream")
}

/// Builds what is stale (the programs through `k8s::ensure_upstream_e2e`, pause, the Debian
/// packages once, each image whose inputs changed) into `out`, and writes `out/images.json` (the
/// format of `image.rs`): `agnhost`, `busybox`, `pause-3.10.2`, `regression-issue-74839`,
/// `coredns`. Archives whose stamps match are reused without being rewritten.
pub fn ensure(out: &Path) -> Result<Vec<Built>> {
    let cache = util::cache_dir();
    let bins = k8s::ensure_upstream_e2e(&cache)?;
    let programs = Programs {
        agnhost: bins.agnhost,
        regression_issue_74839: bins.regression_issue_74839,
        coredns: bins.coredns,
    };
    build_images(out, &cache, &programs)
}

/// The static programs of the images (`k8s::ensure_upstream_e2e` builds them).
struct Programs {
    agnhost: PathBuf,
    regression_issue_74839: PathBuf,
    coredns: PathBuf,
}

/// [`ensure`] with the programs in `bins`, the Debian packages cached under `cache`.
fn build_images(out: &Path, cache: &Path, bins: &Programs) -> Result<Vec<Built>> {
    let started = Instant::now();
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = fs::canonicalize(out).with_context(|| format!("resolving {}", out.display()))?;
    let _lock = image::lock(&out.join(".lock"))?;
    for tool in ["apt-get", "dpkg-deb", "chroot"] {
        if !util::have(tool) {
            bail!("{tool} is needed to build the upstream e2e images (from Debian's packages)");
        }
    }
    let build = out.join("build");
    let pause = image::build_pause(&build)?;
    let kubernetes = kubernetes_module(&build)?;
    check_e2e_references(&kubernetes)?;
    let agnhost_debs = fetch(cache, &AGNHOST_DEBS)?;
    let busybox_deb = fetch(cache, &BUSYBOX_DEBS)?
        .into_iter()
        .next()
        .context("no busybox-static package")?;
    let porter = kubernetes.join("test/images/agnhost/porter");

    let mut agnhost_steps: Vec<Step> = agnhost_debs.into_iter().map(Step::Deb).collect();
    agnhost_steps.extend([
        Step::Prune,
        Step::FromDeb {
            deb: busybox_deb.clone(),
            from: BUSYBOX_IN_DEB,
            path: "bin/busybox",
        },
        Step::Copy {
            path: "agnhost",
            mode: 0o755,
            source: bins.agnhost.clone(),
        },
        Step::Copy {
            path: "coredns",
            mode: 0o755,
            source: bins.coredns.clone(),
        },
        Step::Copy {
            path: "localhost.crt",
            mode: 0o644,
            source: porter.join("localhost.crt"),
        },
        Step::Copy {
            path: "localhost.key",
            mode: 0o644,
            source: porter.join("localhost.key"),
        },
        Step::Dir {
            path: "uploads",
            mode: 0o755,
        },
        Step::Dir {
            path: "home/user-defined-in-image",
            mode: 0o755,
        },
        Step::Links(AGNHOST_LINKS),
        Step::Applets(Applets::WhereMissing),
    ]);
    agnhost_steps.extend(etc(AGNHOST_PASSWD, AGNHOST_GROUP));

    let mut busybox_steps = vec![
        Step::FromDeb {
            deb: busybox_deb,
            from: BUSYBOX_IN_DEB,
            path: "bin/busybox",
        },
        Step::Applets(Applets::Official),
    ];
    for (path, mode) in [("home", 0o755), ("var/spool/mail", 0o755), ("var/www", 0o755)] {
        busybox_steps.push(Step::Dir { path, mode });
    }
    busybox_steps.extend(etc(BUSYBOX_PASSWD, BUSYBOX_GROUP));

    let program = |path: &'static str, source: &Path| Step::Copy {
        path,
        mode: 0o755,
        source: source.to_path_buf(),
    };
    let mut pause_steps = vec![program("pause", &pause)];
    pause_steps.extend(etc(ROOT_PASSWD, ROOT_GROUP));
    let mut regression_steps = vec![program("regression-issue-74839", &bins.regression_issue_74839)];
    regression_steps.extend(etc(ROOT_PASSWD, ROOT_GROUP));
    let mut coredns_steps = vec![
        program("coredns", &bins.coredns),
        // 0700 and nonroot's in distroless; every entry of a layer here belongs to root.
        Step::Dir {
            path: "home/nonroot",
            mode: 0o755,
        },
    ];
    coredns_steps.extend(etc(DISTROLESS_PASSWD, DISTROLESS_GROUP));

    let images = [
        Upstream {
            name: "agnhost",
            reference: AGNHOST_REF,
            program: "/agnhost",
            // As upstream: `ENTRYPOINT ["/agnhost"]`, `CMD ["pause"]`, no USER.
            entrypoint: &["/agnhost"],
            cmd: &["pause"],
            user: "",
            ports: &["80/tcp", "8080/tcp", "8081/tcp", "9376/tcp", "5000/tcp"],
            steps: agnhost_steps,
            checks: AGNHOST_CHECKS,
        },
        Upstream {
            name: "busybox",
            reference: BUSYBOX_REF,
            program: "/bin/busybox",
            entrypoint: &[],
            cmd: &["sh"],
            user: "",
            ports: &[],
            steps: busybox_steps,
            checks: BUSYBOX_CHECKS,
        },
        Upstream {
            name: "pause-3.10.2",
            reference: PAUSE_REF,
            program: "/pause",
            entrypoint: &["/pause"],
            cmd: &[],
            user: "65535:65535",
            ports: &[],
            steps: pause_steps,
            checks: PAUSE_CHECKS,
        },
        Upstream {
            name: "regression-issue-74839",
            reference: REGRESSION_REF,
            program: "/regression-issue-74839",
            entrypoint: &["/regression-issue-74839"],
            cmd: &[],
            user: "",
            ports: &[],
            steps: regression_steps,
            // It has no version flag: it starts serving.
            checks: &[],
        },
        Upstream {
            name: "coredns",
            reference: COREDNS_REF,
            program: "/coredns",
            entrypoint: &["/coredns"],
            cmd: &[],
            // As upstream (`USER nonroot:nonroot`). Upstream also gives /coredns the file
            // capability cap_net_bind_service, which this layer cannot carry: port 53 is bound
            // as nonroot through containerd's enable_unprivileged_ports (the default of 2.x).
            user: "nonroot:nonroot",
            ports: &["53/tcp", "53/udp"],
            steps: coredns_steps,
            checks: COREDNS_CHECKS,
        },
    ];

    let built = image::in_parallel(&images, |image| image.ensure(&build, &out))?;
    let index = image::write_index(&out, &built)?;
    step(&format!(
        "upstream images ready in {:.1?} ({} rebuilt): {}",
        started.elapsed(),
        built.iter().filter(|b| b.rebuilt).count(),
        index.display()
    ));
    Ok(built)
}

// ---------------------------------------------------------------------------------------------
// The images

/// One image: its config and the steps that make its root.
struct Upstream {
    name: &'static str,
    reference: &'static str,
    /// The image's main program (the `program` of its [`Recipe`]).
    program: &'static str,
    entrypoint: &'static [&'static str],
    cmd: &'static [&'static str],
    /// Empty: none in the config (root), as an image without USER.
    user: &'static str,
    ports: &'static [&'static str],
    steps: Vec<Step>,
    checks: &'static [Check],
}

impl Upstream {
    fn ensure(&self, build: &Path, out: &Path) -> Result<Built> {
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

/// /etc/passwd, /etc/group and /etc/nsswitch.conf.
fn etc(passwd: &'static str, group: &'static str) -> [Step; 3] {
    let text = |path, text| Step::Text {
        path,
        mode: 0o644,
        text,
    };
    [
        text("etc/passwd", passwd),
        text("etc/group", group),
        text("etc/nsswitch.conf", NSSWITCH),
    ]
}

// ---------------------------------------------------------------------------------------------
// Assembling a root

/// Where BusyBox's applets are linked.
#[derive(Debug, Clone, Copy)]
enum Applets {
    /// As the official busybox image: every applet in /bin (and at its own place when that is
    /// elsewhere, for absolute paths like /usr/bin/env).
    Official,
    /// As on Alpine: at the applet's own place, for every applet whose name no file in the
    /// root's PATH directories has.
    WhereMissing,
}

/// One step of making an image's root, relative paths without the leading `/`.
#[derive(Debug)]
enum Step {
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
    fn describe(&self) -> Result<String> {
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

    fn describe_short(&self) -> String {
        match self {
            Step::Deb(path) | Step::FromDeb { deb: path, .. } => format!("extracting {}", path.display()),
            Step::Copy { path, source, .. } => format!("copying {} to /{path}", source.display()),
            other => format!("{other:?}"),
        }
    }

    fn apply(&self, root: &Path) -> Result<()> {
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
fn make_dir(path: &Path, mode: u32) -> Result<()> {
    match fs::create_dir(path) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => {}
        other => other.with_context(|| format!("creating {}", path.display()))?,
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", path.display()))
}

/// A new file at `root/rel` (nothing may be there yet: packages and steps must not collide).
fn place(root: &Path, rel: &str, mode: u32, bytes: &[u8]) -> Result<()> {
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
fn link(root: &Path, rel: &str, target: &str) -> Result<()> {
    make_parents(root, rel)?;
    let path = root.join(rel);
    symlink(target, &path).with_context(|| format!("linking {} -> {target}", path.display()))
}

/// `dir/name` as `dir/name<suffix>` (`Path::with_extension` would cut `pause-3.10.2-root`).
fn beside(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

fn remove_if_there(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

fn file_name(path: &Path) -> Result<&str> {
    path.file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("{} has no UTF-8 file name", path.display()))
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

// ---------------------------------------------------------------------------------------------
// Debian packages

/// The `.deb` files of `set`'s closure, downloaded once into `<cache>/upstream-images/debs/<name>`
/// and reused while the stamp there names the same request.
fn fetch(cache: &Path, set: &DebSet) -> Result<Vec<PathBuf>> {
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
                 xtask/src/upstream_images.rs",
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

// ---------------------------------------------------------------------------------------------
// The references e2e.test asks for

/// The k8s.io/kubernetes module directory (where [`image::build_pause`] reads pause.c).
fn kubernetes_module(work: &Path) -> Result<PathBuf> {
    let pause_c = image::pause_source(work)?;
    let root = pause_c
        .ancestors()
        .nth(4)
        .context("pause.c is not in build/pause/linux")?;
    if !root.join("test/images/agnhost/porter/localhost.crt").is_file() {
        bail!("{} has no test/images/agnhost/porter", root.display());
    }
    Ok(root.to_path_buf())
}

/// Fails when test/utils/image/manifest.go names other references than the images built here.
fn check_e2e_references(kubernetes: &Path) -> Result<()> {
    let path = kubernetes.join("test/utils/image/manifest.go");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let wanted = e2e_references(&text).with_context(|| format!("reading {}", path.display()))?;
    for (id, ours) in E2E_IMAGES {
        match wanted.get(*id) {
            Some(theirs) if theirs == ours => {}
            other => bail!(
                "e2e.test asks for {id} as {other:?} ({}), this build makes {ours}: update \
                 xtask/src/upstream_images.rs",
                path.display()
            ),
        }
    }
    Ok(())
}

/// manifest.go's images as (ImageID, reference), from its default registries
/// (`PromoterE2eRegistry: "registry.k8s.io/e2e-test-images",`) and its
/// `configs[Agnhost] = Config{list.PromoterE2eRegistry, "agnhost", "2.66.1"}` lines.
fn e2e_references(text: &str) -> Result<BTreeMap<String, String>> {
    let mut registries = BTreeMap::new();
    for line in text.lines() {
        let Some((key, value)) = line.trim().split_once(':') else {
            continue;
        };
        let value = value.trim().trim_end_matches(',');
        if key.ends_with("Registry")
            && !key.contains(char::is_whitespace)
            && value.len() > 2
            && value.starts_with('"')
            && value.ends_with('"')
        {
            registries.insert(key.to_string(), value.trim_matches('"').to_string());
        }
    }
    let mut references = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.trim().strip_prefix("configs[") else {
            continue;
        };
        let parsed = (|| {
            let (id, rest) = rest.split_once(']')?;
            let inner = rest.split_once("Config{")?.1.strip_suffix('}')?;
            let fields: Vec<&str> = inner.split(',').map(str::trim).collect();
            let [registry, name, version] = fields.as_slice() else {
                return None;
            };
            let registry = registries.get(registry.strip_prefix("list.")?)?;
            let unquote = |s: &str| s.strip_prefix('"')?.strip_suffix('"').map(str::to_string);
            Some((
                id.to_string(),
                format!("{registry}/{}:{}", unquote(name)?, unquote(version)?),
            ))
        })();
        // Lines of another form, or of an unknown registry, name no image built here.
        if let Some((id, reference)) = parsed {
            references.insert(id, reference);
        }
    }
    if references.is_empty() {
        bail!("no `configs[...] = Config{{...}}` lines");
    }
    Ok(references)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::COREDNS_VERSION;
    use serde_json::json;

    #[test]
    fn references_carry_the_built_versions() {
        let tag = |r: &str| r.rsplit_once(':').map(|(_, t)| t.to_string()).unwrap();
        assert_eq!(tag(AGNHOST_REF), AGNHOST_VERSION);
        assert_eq!(tag(COREDNS_REF), COREDNS_VERSION);
    }

    #[test]
    fn manifest_go_references() {
        let text = r#"
type RegistryList struct {
	PromoterE2eRegistry      string `yaml:"promoterE2eRegistry"`
	GcRegistry               string `yaml:"gcRegistry"`
}
	initRegistry = RegistryList{
		PromoterE2eRegistry:      "registry.k8s.io/e2e-test-images",
		GcRegistry:               "registry.k8s.io",
	}
	configs[Agnhost] = Config{list.PromoterE2eRegistry, "agnhost", "2.66.1"}
	configs[Pause] = Config{list.GcRegistry, "pause", "3.10.2"}
"#;
        let refs = e2e_references(text).unwrap();
        assert_eq!(refs["Agnhost"], AGNHOST_REF);
        assert_eq!(refs["Pause"], PAUSE_REF);
        assert_eq!(refs.len(), 2);
        let unknown = text.replace("list.GcRegistry", "list.OtherRegistry");
        assert!(!e2e_references(&unknown).unwrap().contains_key("Pause"));
        assert!(e2e_references("package image\n").is_err());
    }

    #[test]
    fn apt_simulation_lists_what_it_installs() {
        let text = "NOTE: This is only a simulation!\n\
                    Inst libc6 (2.36-9+deb12u14 Debian:12.15/oldstable [amd64])\n\
                    Inst bind9-host (1:9.18.49-1~deb12u3 Debian-Security:12/oldstable-security [amd64])\n\
                    Inst libtirpc-common (1.3.3+ds-1 Debian:12.15/oldstable [all])\n\
                    Inst curl [7.88.1-10] (7.88.1-10+deb12u15 Debian:12.15/oldstable [amd64])\n\
                    Conf libc6 (2.36-9+deb12u14 Debian:12.15/oldstable [amd64])\n";
        let parsed = parse_simulation(text).unwrap();
        let pairs: Vec<(&str, &str)> = parsed.iter().map(|(p, v)| (p.as_str(), v.as_str())).collect();
        assert_eq!(
            pairs,
            [
                ("bind9-host", "1:9.18.49-1~deb12u3"),
                ("curl", "7.88.1-10+deb12u15"),
                ("libc6", "2.36-9+deb12u14"),
                ("libtirpc-common", "1.3.3+ds-1"),
            ]
        );
        assert!(parse_simulation("0 upgraded, 0 newly installed\n").is_err());
        assert!(parse_simulation("Inst broken\n").is_err());
    }

    #[test]
    fn deb_file_names_escape_the_epoch() {
        assert_eq!(
            deb_file_prefix("bind9-host", "1:9.18.49-1~deb12u3"),
            "bind9-host_1%3a9.18.49-1~deb12u3_"
        );
        assert_eq!(deb_file_prefix("curl:amd64", "7.88.1"), "curl_7.88.1_");
    }

    #[test]
    fn suites_are_selected_from_the_sources() {
        let sources = "deb [signed-by=/k.gpg] http://m/debian bookworm main\n\
                       deb [signed-by=/k.gpg] http://m/debian-security bookworm-security main\n\
                       deb [signed-by=/k.gpg] http://m/debian bookworm-backports main\n\
                       deb http://m/debian trixie main\n";
        assert_eq!(
            select_suites(sources, &["bookworm", "bookworm-security"]).unwrap(),
            "deb [signed-by=/k.gpg] http://m/debian bookworm main\n\
             deb [signed-by=/k.gpg] http://m/debian-security bookworm-security main\n"
        );
        assert_eq!(
            select_suites(sources, &["trixie"]).unwrap(),
            "deb http://m/debian trixie main\n"
        );
        assert!(select_suites(sources, &["bookworm", "bookworm-updates"]).is_err());
    }

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

    #[test]
    fn configs_leave_out_what_the_image_has_not() {
        let busybox = image::config_of(&[], &["sh"], "", &[]).unwrap();
        let config = busybox["config"].as_object().unwrap();
        assert!(!config.contains_key("Entrypoint") && !config.contains_key("User"));
        assert_eq!(config["Cmd"], json!(["sh"]));
        let coredns = image::config_of(&["/coredns"], &[], "nonroot:nonroot", &["53/udp"]).unwrap();
        assert_eq!(coredns["config"]["User"], "nonroot:nonroot");
        assert_eq!(coredns["config"]["ExposedPorts"], json!({"53/udp": {}}));
    }

    #[test]
    fn trees_become_layers_with_their_modes() {
        let dir = std::env::temp_dir().join(format!("lb-upstream-tree-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        make_dir(&dir, 0o755).unwrap();
        place(&dir, "usr/bin/tool", 0o4755, b"x").unwrap();
        link(&dir, "bin/tool", "/usr/bin/tool").unwrap();
        make_dir(&dir.join("tmp"), 0o1777).unwrap();
        assert!(
            place(&dir, "usr/bin/tool", 0o755, b"y").is_err(),
            "a second file at one path"
        );
        let layer = layer_of_tree(&dir).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        let x = image::sha256_hex(b"x");
        assert_eq!(
            layer.describe(),
            format!(
                "dir /bin 0755\nlink /bin/tool -> /usr/bin/tool\ndir /tmp 1777\ndir /usr 0755\n\
                 dir /usr/bin 0755\nfile /usr/bin/tool 4755 1 sha256:{x}\n"
            )
        );
    }
}
