//! The container images the upstream Kubernetes e2e Service specs run, under the exact names
//! `e2e.test` asks kubelet for, built as OCI archives without a registry or a container engine
//! (the archive writer, stamps and `images.json` of `image/`). This module owns their recipes,
//! the Debian packages they take files from, and `target/images/upstream`:
//!
//! - `registry.k8s.io/e2e-test-images/agnhost:2.66.1`: upstream's test/images/agnhost/Dockerfile
//!   on Debian instead of Alpine. `/agnhost` (built by `k8s::ensure_upstream_e2e`), the
//!   `/agnhost-2 -> agnhost` link, `/uploads`, porter's `/localhost.crt` and `/localhost.key`, the
//!   user `user-defined-in-image` (uid 1000, also in group `group-defined-in-image`, gid 50000),
//!   `/coredns` (the v1.14.6 of the cluster; upstream bundles 1.6.2 for the DNS specs that run
//!   it), and the tools the Dockerfile installs with apk, from Debian bookworm's packages with
//!   their whole dependency closure (`AGNHOST_PACKAGES` in `recipes.rs`). Alpine's other
//!   commands (`cat`, `seq`, `wget`, ...) are BusyBox applets there, and are here too: Debian's
//!   static BusyBox at `/bin/busybox`, linked for every applet no Debian package provides;
//!   `/bin/sh` is dash.
//! - `registry.k8s.io/e2e-test-images/busybox:1.37.0-2`: Debian's `busybox-static` 1.37 (trixie)
//!   at `/bin/busybox` with a link in `/bin` for every applet, as the official busybox image.
//! - `registry.k8s.io/pause:3.10.2`: the static pause of [`image::build_pause`].
//! - `registry.k8s.io/e2e-test-images/regression-issue-74839:1.5` and
//!   `registry.k8s.io/coredns/coredns:v1.14.6`: their static programs (`k8s.rs`); CoreDNS with
//!   distroless' users and `USER nonroot:nonroot`, as upstream, but without upstream's file
//!   capability on /coredns (a layer here has no xattrs): it binds port 53 in a Pod through
//!   containerd 2's `enable_unprivileged_ports`, not on the host network.
//!
//! Packages are resolved and downloaded once through the private apt lists of `kernel/apt.rs`
//! (the machine's apt is untouched): the closure of what an image needs, as `apt-get install`
//! computes it on an empty system (an empty dpkg status), restricted to one release's suites.
//! They are kept under `<cache>/upstream-images/debs/` with a stamp; a later build uses them
//! without the network (security updates come in when a package list of `recipes.rs` changes, or
//! the directory is removed). Each image's root is assembled in
//! `target/images/upstream/build/<name>-root` (`dpkg-deb -x`, then what the packages' maintainer
//! scripts or the Dockerfile would have done), its programs are run there with `chroot` (the
//! build fails when one does not run), and it is packed as the image's one layer. A stamp next
//! to each root lists every input; the archives' stamps are `image/`'s: same inputs, same bytes.
//!
//! The files: `recipes` (each image's packages, links, users and checks), `debs` (the packages'
//! closure through the private apt lists), `steps` (the steps that make a root, BusyBox's
//! applets), `root` (one image's root: assembled, checked with `chroot`, packed as its layer),
//! `references` (the references `e2e.test` asks for, checked against manifest.go).

mod debs;
mod recipes;
mod references;
mod root;
mod steps;

use std::{
    fs,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{Context, Result, bail};

use self::{
    debs::fetch,
    recipes::{
        AGNHOST_CHECKS, AGNHOST_DEBS, AGNHOST_GROUP, AGNHOST_LINKS, AGNHOST_PASSWD, BUSYBOX_CHECKS,
        BUSYBOX_DEBS, BUSYBOX_GROUP, BUSYBOX_IN_DEB, BUSYBOX_PASSWD, COREDNS_CHECKS, DISTROLESS_GROUP,
        DISTROLESS_PASSWD, PAUSE_CHECKS, ROOT_GROUP, ROOT_PASSWD, etc,
    },
    references::{check_e2e_references, kubernetes_module},
    root::Upstream,
    steps::{Applets, Step},
};
use crate::{
    image::{self, Built},
    k8s,
    util::{self, step, workspace_root},
};

pub const AGNHOST_REF: &str = "registry.k8s.io/e2e-test-images/agnhost:2.66.1";
pub const BUSYBOX_REF: &str = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2";
pub const PAUSE_REF: &str = "registry.k8s.io/pause:3.10.2";
pub const REGRESSION_REF: &str = "registry.k8s.io/e2e-test-images/regression-issue-74839:1.5";
pub const COREDNS_REF: &str = "registry.k8s.io/coredns/coredns:v1.14.6";

/// The default output directory, `<workspace>/target/images/upstream`.
pub fn default_dir() -> PathBuf {
    workspace_root().join("target/images/upstream")
}

/// Builds what is stale (the programs through `k8s::ensure_upstream_e2e`, pause, the Debian
/// packages once, each image whose inputs changed) into `out`, and writes `out/images.json` (the
/// format of `image/`): `agnhost`, `busybox`, `pause-3.10.2`, `regression-issue-74839`,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::{AGNHOST_VERSION, COREDNS_VERSION};

    #[test]
    fn references_carry_the_built_versions() {
        let tag = |r: &str| r.rsplit_once(':').map(|(_, t)| t.to_string()).unwrap();
        assert_eq!(tag(AGNHOST_REF), AGNHOST_VERSION);
        assert_eq!(tag(COREDNS_REF), COREDNS_VERSION);
    }
}
