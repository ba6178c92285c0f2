//! Container images for a real kubelet + containerd node, built without a registry or a container
//! engine: OCI image-layout tar archives that `ctr -n k8s.io images import <archive>` loads.
//!
//! - `lb-agent` (`localhost/lb-agent:dev`): the release `lb-agent` at `/usr/local/bin/lb-agent`, as
//!   the runtime stage of `manifests/Dockerfile` installs it on `debian:bookworm-slim`. That base
//!   cannot be pulled here, and this machine is Debian bookworm, so its stand-in is the host's own
//!   files: `/bin/sh`, `stat` and `mount` (the DaemonSet's init container mounts bpffs with them),
//!   `cat` and `ls`, each with its shared-library closure (from `ldd`), in the host's usrmerge
//!   layout (`/bin -> usr/bin`, `/lib -> usr/lib`, ...). The builder refuses to run on another
//!   release; a unit test checks the recipe against the Dockerfile and the DaemonSet.
//! - `lb-probe` (`localhost/lb-probe:dev`): the traffic helper of `tests/` (debug build), serving
//!   TCP 8080 and UDP 5353 and answering with its host name, which is the pod's name.
//! - `pause` (`localhost/pause:3.10`): Kubernetes' own `build/pause/linux/pause.c`, from the
//!   `k8s.io/kubernetes` module that `cargo xtask k8s-bins` uses, compiled static.
//! - `kube-proxy` (`localhost/kube-proxy:v1.37.1`): the kube-proxy `cargo xtask k8s-bins` builds
//!   (static) at `/usr/local/bin/kube-proxy`, as in `registry.k8s.io/kube-proxy`, with the programs
//!   it runs: `nft` (nftables mode, through knftables, and `--cleanup`), and `iptables`,
//!   `iptables-save`, `iptables-restore` and their `ip6tables` twins (iptables mode, and the
//!   cleanup of iptables rules every mode does at start and in `--cleanup`). They are the host's
//!   (Debian bookworm: the nf_tables variant, `iptables -> /etc/alternatives/iptables ->
//!   iptables-nft -> xtables-nft-multi`, links kept as links), with their libraries and the
//!   iptables extensions they load with dlopen(), and `/etc/protocols`, which both read protocol
//!   names from (see `KUBE_PROXY_TOOLS`). Not `conntrack` (kube-proxy 1.37 clears
//!   conntrack entries over netlink), `ipset` or `modprobe` (IPVS mode only; without `modprobe` the
//!   IPVS cleanup is skipped, as kube-proxy does on a node without the module).
//!
//! Each archive holds one gzip layer, its config and manifest, and an `index.json` naming the
//! image. The same inputs give the same bytes: entries sorted, mtime 0, uid/gid 0, a fixed gzip
//! level and no timestamp in the gzip header, JSON with sorted keys. A stamp next to each archive
//! lists its inputs (every file's sha256, the config, the format); when they are unchanged the
//! archive is reused. `images.json` in the output directory lists name, reference, archive and
//! manifest digest of each image, for the tests.

use std::{
    collections::BTreeMap,
    fs::{self, File},
    io::{self, Write},
    os::unix::{fs::PermissionsExt, io::AsRawFd},
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result, bail};
use flate2::{Compression, GzBuilder};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::{
    ebpf,
    k8s::KUBERNETES_VERSION,
    setup,
    util::{self, clean_cargo, step, workspace_root},
};

pub const AGENT_REF: &str = "localhost/lb-agent:dev";
pub const PROBE_REF: &str = "localhost/lb-probe:dev";
pub const PAUSE_REF: &str = "localhost/pause:3.10";
/// kube-proxy's image, tagged with the cached binary's version (`k8s::KUBERNETES_VERSION`).
pub const KUBE_PROXY_REF: &str = "localhost/kube-proxy:v1.37.1";

/// The image the `lb-agent` image stands in for: the base of the last stage of manifests/Dockerfile.
const AGENT_BASE: &str = "debian:bookworm-slim";
/// The programs of the lb-agent image besides lb-agent: what the DaemonSet's init container runs,
/// and a little for looking around. A bare name is looked up on the host in the image's PATH.
const AGENT_TOOLS: &[&str] = &["/bin/sh", "stat", "mount", "cat", "ls"];
/// What kube-proxy 1.37 runs (`pkg/util/iptables`: iptables, iptables-save, iptables-restore and
/// the ip6tables ones; knftables: nft), as found in the image's PATH.
const KUBE_PROXY_TOOLS: &[&str] = &[
    // Protocol names for nft and iptables. Without it nft's JSON output names protocols by number
    // (`6` for `tcp`), and kube-proxy's nftables proxier, which reads its maps back when it
    // starts and compares keys as text, deletes every Service from them when it restarts over
    // its own table (seen with kube-proxy 1.37.1 and nft 1.0.6: Services refused until their
    // next change).
    "/etc/protocols",
    "nft",
    "iptables",
    "iptables-save",
    "iptables-restore",
    "ip6tables",
    "ip6tables-save",
    "ip6tables-restore",
];
/// Libraries that load plugins with dlopen(), which `ldd` cannot see: (the library's name up to
/// its version, the plugins' directory next to it). Every `*.so` there goes into the image too.
const PLUGIN_DIRS: &[(&str, &str)] = &[("libxtables.so", "xtables")];

/// Changes whenever the way archives are written changes, so that older stamps no longer match.
const FORMAT: &str = "lb-oci-archive 1";
/// PATH in every image's config (Debian's images have the same).
pub(crate) const IMAGE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The layers' gzip level: fixed, since the digests depend on it.
const GZIP_LEVEL: u32 = 6;
/// Top-level links of a usrmerged host, reproduced in the images that hold host files.
const ROOT_LINKS: [&str; 4] = ["bin", "lib", "lib64", "sbin"];

const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";

/// One image archive, current on return from [`ensure`].
#[derive(Debug, Clone)]
pub struct Built {
    /// Short name: `lb-agent`, `lb-probe`, `pause`.
    pub name: &'static str,
    /// The reference `ctr images import` gives the image (`localhost/lb-agent:dev`).
    pub reference: &'static str,
    /// The archive (absolute path).
    pub archive: PathBuf,
    /// `sha256:...` of the image manifest (what `ctr images ls` shows as DIGEST).
    pub manifest_digest: String,
    /// Whether this call wrote the archive (false: reused, its inputs were unchanged).
    pub rebuilt: bool,
}

/// The default output directory, `<workspace>/target/images`.
pub fn default_dir() -> PathBuf {
    workspace_root().join("target/images")
}

/// What one image is made of.
#[derive(Debug, Clone)]
pub struct Recipe {
    pub name: &'static str,
    pub reference: &'static str,
    /// Where the program is in the image.
    pub program: &'static str,
    /// The file it is copied from.
    pub program_source: PathBuf,
    /// Host programs copied to the same path (with their libraries); a bare name is looked up in
    /// the image's PATH directories on the host. A path under `/etc/` is a file the programs read,
    /// copied as is.
    pub tools: &'static [&'static str],
    pub entrypoint: &'static [&'static str],
    pub cmd: &'static [&'static str],
    pub user: &'static str,
    /// The image this one stands in for with the host's files (the host must be that release).
    pub base: Option<&'static str>,
}

pub fn agent_recipe() -> Recipe {
    Recipe {
        name: "lb-agent",
        reference: AGENT_REF,
        program: "/usr/local/bin/lb-agent",
        program_source: workspace_root().join("target/release/lb-agent"),
        tools: AGENT_TOOLS,
        entrypoint: &["/usr/local/bin/lb-agent"],
        cmd: &[],
        // Root: the capabilities the DaemonSet adds are only effective for uid 0.
        user: "0",
        base: Some(AGENT_BASE),
    }
}

pub fn probe_recipe() -> Recipe {
    Recipe {
        name: "lb-probe",
        reference: PROBE_REF,
        program: "/usr/local/bin/lb-probe",
        program_source: workspace_root().join("target/debug/lb-probe"),
        tools: &[],
        entrypoint: &["/usr/local/bin/lb-probe"],
        // Without --name it answers with its host name: the pod's name.
        cmd: &["serve", "--tcp", "0.0.0.0:8080", "--udp", "0.0.0.0:5353"],
        user: "0",
        base: None,
    }
}

/// `binary`: the static pause built by [`build_pause`].
pub fn pause_recipe(binary: PathBuf) -> Recipe {
    Recipe {
        name: "pause",
        reference: PAUSE_REF,
        program: "/pause",
        program_source: binary,
        tools: &[],
        entrypoint: &["/pause"],
        cmd: &[],
        // As upstream's pause image (build/pause/Dockerfile: USER 65535:65535).
        user: "65535:65535",
        base: None,
    }
}

/// `binary`: the kube-proxy of `cargo xtask k8s-bins` (static, [`KUBERNETES_VERSION`]).
pub fn kube_proxy_recipe(binary: PathBuf) -> Recipe {
    Recipe {
        name: "kube-proxy",
        reference: KUBE_PROXY_REF,
        // Where registry.k8s.io/kube-proxy has it, and kubeadm's DaemonSet runs it.
        program: "/usr/local/bin/kube-proxy",
        program_source: binary,
        tools: KUBE_PROXY_TOOLS,
        entrypoint: &["/usr/local/bin/kube-proxy"],
        cmd: &[],
        // Root: it programs the node's netfilter (the DaemonSet runs it privileged).
        user: "0",
        // It stands in for registry.k8s.io/kube-proxy (on distroless-iptables) with this
        // machine's nft and iptables; the release check of the lb-agent image covers it.
        base: None,
    }
}

/// Builds what is needed (the eBPF object, lb-agent, lb-probe, pause; kube-proxy comes from
/// `cargo xtask k8s-bins`, built if missing) and every image archive
/// whose inputs changed, into `out`; writes `out/images.json`. Archives whose stamps match are
/// reused without being rewritten.
pub fn ensure(out: &Path) -> Result<Vec<Built>> {
    let started = Instant::now();
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = fs::canonicalize(out).with_context(|| format!("resolving {}", out.display()))?;
    let _lock = lock(&out.join(".lock"))?;
    // Before any build: an image of host files only stands in for its base on the same release.
    for base in [agent_recipe(), probe_recipe()].iter().filter_map(|r| r.base) {
        check_host_release(base)?;
    }

    setup::ebpf_toolchain_and_linker()?;
    ebpf::build()?;
    step("building lb-agent (release) and lb-probe for the images");
    util::run(clean_cargo(None).args([
        "build",
        "--release",
        "--quiet",
        "--package",
        "lb-agent",
        "--bin",
        "lb-agent",
    ]))?;
    util::run(clean_cargo(None).args(["build", "--quiet", "--package", "lb-tests", "--bin", "lb-probe"]))?;
    let pause = build_pause(&out.join("build"))?;
    // Built once from its Go module (with the control plane's binaries); a stamp check when cached.
    let kube_proxy = crate::k8s::ensure(&util::cache_dir())?.kube_proxy;

    let recipes = [
        agent_recipe(),
        probe_recipe(),
        pause_recipe(pause),
        kube_proxy_recipe(kube_proxy),
    ];
    let mut plans = Vec::new();
    for recipe in recipes {
        plans.push(Plan::new(recipe, &out)?);
    }
    let built = in_parallel(&plans, Plan::ensure)?;
    let index = write_index(&out, &built)?;
    step(&format!(
        "images ready in {:.1?} ({} rebuilt): {}",
        started.elapsed(),
        built.iter().filter(|b| b.rebuilt).count(),
        index.display()
    ));
    Ok(built)
}

/// Builds every item on a thread of its own (the layers' compression is the long part); the
/// first error wins.
pub(crate) fn in_parallel<T: Sync>(
    items: &[T],
    build: impl Fn(&T) -> Result<Built> + Sync,
) -> Result<Vec<Built>> {
    let build = &build;
    let results: Vec<Result<Built>> = std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .iter()
            .map(|item| scope.spawn(move || build(item)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("image build panicked")))
            })
            .collect()
    });
    results.into_iter().collect()
}

/// Writes `out/images.json` for `built` unless it already says exactly that; returns its path.
pub(crate) fn write_index(out: &Path, built: &[Built]) -> Result<PathBuf> {
    let index = out.join("images.json");
    let text = images_json(built);
    if fs::read_to_string(&index).ok().as_deref() != Some(text.as_str()) {
        write_atomically(&index, text.as_bytes())?;
    }
    Ok(index)
}

/// `images.json`: `[{"name", "ref", "archive", "manifest_digest"}, ...]`, one image a line.
pub(crate) fn images_json(built: &[Built]) -> String {
    let q = |s: &str| Value::from(s).to_string();
    let lines: Vec<String> = built
        .iter()
        .map(|b| {
            format!(
                "  {{\"name\": {}, \"ref\": {}, \"archive\": {}, \"manifest_digest\": {}}}",
                q(b.name),
                q(b.reference),
                q(&b.archive.to_string_lossy()),
                q(&b.manifest_digest)
            )
        })
        .collect();
    format!("[\n{}\n]\n", lines.join(",\n"))
}

/// Fails unless this machine runs the Debian release `base` (`debian:bookworm-slim`) names.
fn check_host_release(base: &str) -> Result<()> {
    let (distro, tag) = base.split_once(':').unwrap_or((base, ""));
    let codename = tag.trim_end_matches("-slim");
    let os_release = fs::read_to_string("/etc/os-release").unwrap_or_default();
    let field = |key: &str| {
        os_release
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .map(|v| v.trim().trim_matches('"').to_string())
            .unwrap_or_default()
    };
    let (id, have) = (field("ID"), field("VERSION_CODENAME"));
    if id != distro || have != codename {
        bail!(
            "the {AGENT_REF} image stands in for {base} (the runtime stage of manifests/Dockerfile) with this \
             machine's own /bin/sh, stat, mount and libraries, so it must be built on {distro} {codename}; \
             /etc/os-release says ID={id:?} VERSION_CODENAME={have:?}. Build the image from manifests/Dockerfile \
             with a container engine instead, or build on {distro} {codename}"
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// pause

/// Compiles upstream's pause.c (from the k8s.io/kubernetes module) into `work/pause`, static, as
/// build/pause/Makefile does; reused while the source, the flags and the compiler are the same.
pub fn build_pause(work: &Path) -> Result<PathBuf> {
    let source = pause_source(work)?;
    let code = fs::read(&source).with_context(|| format!("reading {}", source.display()))?;
    let tag = pause_tag(&source)?;
    // Upstream: CFLAGS = -Os -Wall -Werror -static -DVERSION=v$(TAG)-$(REV), REV a git describe
    // of the kubernetes tree; here the module version.
    let flags = [
        "-Os".to_string(),
        "-Wall".into(),
        "-Werror".into(),
        "-static".into(),
        format!("-DVERSION=v{tag}-{KUBERNETES_VERSION}"),
    ];
    setup::install(&[("cc", "gcc")])?;
    let cc_version = util::output(Command::new("cc").arg("--version"))?;
    let wanted = format!(
        "source=k8s.io/kubernetes@{KUBERNETES_VERSION}/build/pause/linux/pause.c sha256:{}\ncc={}\nflags={}\n",
        sha256_hex(&code),
        cc_version.lines().next().unwrap_or_default(),
        flags.join(" ")
    );
    let (binary, stamp) = (work.join("pause"), work.join("pause.stamp"));
    if binary.is_file() && fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(binary);
    }
    step(&format!(
        "compiling pause {tag} (static) from {}",
        source.display()
    ));
    // A static binary needs libc.a (libc6-dev), which gcc does not pull in without recommends.
    let libc_a = util::output(Command::new("cc").arg("-print-file-name=libc.a"))?;
    if !Path::new(libc_a.trim()).is_absolute() {
        setup::apt_install(&["libc6-dev"])?;
    }
    fs::create_dir_all(work).with_context(|| format!("creating {}", work.display()))?;
    let _ = fs::remove_file(&stamp);
    let tmp = work.join(format!("pause.tmp-{}", std::process::id()));
    util::run(Command::new("cc").args(&flags).arg("-o").arg(&tmp).arg(&source))?;
    fs::rename(&tmp, &binary).with_context(|| format!("renaming {}", tmp.display()))?;
    let said = util::output(Command::new(&binary).arg("-v"))?;
    if !said.contains(&format!("pause.c v{tag}")) {
        bail!("{} -v printed {said:?}", binary.display());
    }
    fs::write(&stamp, wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(binary)
}

/// pause.c in the Go module cache; downloads the module when it is not there.
pub(crate) fn pause_source(work: &Path) -> Result<PathBuf> {
    let relative = "build/pause/linux/pause.c";
    let go = find_go()?;
    let modcache = util::output(go_command(&go).args(["env", "GOMODCACHE"]))?;
    let file = Path::new(modcache.trim())
        .join(format!("k8s.io/kubernetes@{KUBERNETES_VERSION}"))
        .join(relative);
    if file.is_file() {
        return Ok(file);
    }
    step(&format!(
        "downloading the k8s.io/kubernetes {KUBERNETES_VERSION} module (for {relative})"
    ));
    fs::create_dir_all(work).with_context(|| format!("creating {}", work.display()))?;
    let module = format!("k8s.io/kubernetes@{KUBERNETES_VERSION}");
    let said = util::output(
        go_command(&go)
            .args(["mod", "download", "-json", &module])
            .current_dir(work),
    )?;
    let dir = serde_json::from_str::<Value>(&said)
        .ok()
        .and_then(|v| v["Dir"].as_str().map(PathBuf::from))
        .with_context(|| format!("go mod download -json {module} printed no Dir: {said}"))?;
    let file = dir.join(relative);
    if !file.is_file() {
        bail!("{} is missing after go mod download {module}", file.display());
    }
    Ok(file)
}

/// The pause release the source is (`TAG ?= 3.10.2` in build/pause/Makefile).
fn pause_tag(source: &Path) -> Result<String> {
    let makefile = source
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join("Makefile"))
        .context("pause.c has no build/pause directory")?;
    let text = fs::read_to_string(&makefile).with_context(|| format!("reading {}", makefile.display()))?;
    text.lines()
        .find_map(|l| {
            let (key, value) = l.split_once("?=")?;
            (key.trim() == "TAG").then(|| value.trim().to_string())
        })
        .with_context(|| format!("no `TAG ?=` line in {}", makefile.display()))
}

/// `go`, as `cargo xtask k8s-bins` finds it: on PATH, else the official tarball's place.
fn find_go() -> Result<PathBuf> {
    if util::have("go") {
        Ok(PathBuf::from("go"))
    } else if Path::new("/usr/local/go/bin/go").is_file() {
        Ok(PathBuf::from("/usr/local/go/bin/go"))
    } else {
        bail!(
            "`go` is not installed (not on PATH, not in /usr/local/go/bin); the pause image is compiled from \
             pause.c of the k8s.io/kubernetes {KUBERNETES_VERSION} Go module: install Go from https://go.dev/dl/ \
             or run `cargo xtask k8s-bins` first"
        )
    }
}

/// A `go` command with the environment of the k8s-bins builds (modules as committed, the
/// installed Go only, no go.work from a parent directory).
fn go_command(go: &Path) -> Command {
    let mut cmd = Command::new(go);
    cmd.env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local")
        .env("GOWORK", "off");
    cmd
}

// ---------------------------------------------------------------------------------------------
// The layer: files, directories and links, in path order

#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    Dir,
    File(Vec<u8>),
    Symlink(PathBuf),
}

#[derive(Debug, Clone)]
struct Item {
    mode: u32,
    node: Node,
}

/// The contents of the image's one layer, keyed by path without the leading `/`. Byte order puts
/// every directory before its contents.
#[derive(Debug, Default)]
pub(crate) struct Layer {
    items: BTreeMap<String, Item>,
}

/// How a host file is used, which decides its mode.
#[derive(Clone, Copy)]
enum Role {
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

fn relative(path: &Path) -> Result<String> {
    let text = path
        .to_str()
        .with_context(|| format!("{} is not UTF-8", path.display()))?;
    let rel = text.trim_start_matches('/').trim_end_matches('/');
    if rel.is_empty() || rel.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        bail!("{text} is not a plain absolute path");
    }
    Ok(rel.to_string())
}

impl Layer {
    /// The directories and files every image has: /dev, /proc, /sys, /run, /tmp (1777), /root,
    /// and /etc with root in passwd and group, and an nsswitch.conf for files then DNS.
    fn skeleton() -> Result<Self> {
        let mut layer = Layer::default();
        for dir in ["dev", "etc", "proc", "run", "sys"] {
            layer.dir(dir, 0o755)?;
        }
        layer.dir("root", 0o700)?;
        layer.dir("tmp", 0o1777)?;
        layer.file("etc/passwd", 0o644, b"root:x:0:0:root:/root:/bin/sh\n".to_vec())?;
        layer.file("etc/group", 0o644, b"root:x:0:\n".to_vec())?;
        layer.file(
            "etc/nsswitch.conf",
            0o644,
            b"passwd: files\ngroup: files\nhosts: files dns\n".to_vec(),
        )?;
        Ok(layer)
    }

    fn parents(&mut self, path: &str) -> Result<()> {
        let mut end = 0;
        while let Some(i) = path[end..].find('/') {
            end += i;
            let parent = &path[..end];
            match self.items.get(parent) {
                None => {
                    self.items.insert(
                        parent.to_string(),
                        Item {
                            mode: 0o755,
                            node: Node::Dir,
                        },
                    );
                }
                Some(Item { node: Node::Dir, .. }) => {}
                Some(_) => bail!("/{parent} is not a directory in the image, yet /{path} is under it"),
            }
            end += 1;
        }
        Ok(())
    }

    fn insert(&mut self, path: &str, mode: u32, node: Node) -> Result<()> {
        self.parents(path)?;
        match self.items.get_mut(path) {
            None => {
                self.items.insert(path.to_string(), Item { mode, node });
            }
            Some(have) if have.node == node => {
                // The same file for two reasons (a program that is also a library): the wider mode.
                have.mode = have.mode.max(mode);
            }
            Some(have) => bail!(
                "/{path} is in the image twice, differently: {:?} and {:?}",
                kind(&have.node),
                kind(&node)
            ),
        }
        Ok(())
    }

    pub(crate) fn dir(&mut self, path: &str, mode: u32) -> Result<()> {
        self.insert(path, mode, Node::Dir)
    }

    pub(crate) fn file(&mut self, path: &str, mode: u32, bytes: Vec<u8>) -> Result<()> {
        self.insert(path, mode, Node::File(bytes))
    }

    pub(crate) fn symlink(&mut self, path: &str, target: PathBuf) -> Result<()> {
        self.insert(path, 0o777, Node::Symlink(target))
    }

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
    fn host_file(&mut self, path: &Path, role: Role) -> Result<()> {
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
    fn host_program(&mut self, path: &Path) -> Result<()> {
        self.host_file(path, Role::Program)?;
        self.libraries_of(path)
    }

    fn libraries_of(&mut self, program: &Path) -> Result<()> {
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

    /// One line per entry (with each file's sha256): what the stamp compares.
    pub(crate) fn describe(&self) -> String {
        let mut text = String::new();
        for (path, item) in &self.items {
            let line = match &item.node {
                Node::Dir => format!("dir /{path} {:04o}\n", item.mode),
                Node::File(bytes) => format!(
                    "file /{path} {:04o} {} sha256:{}\n",
                    item.mode,
                    bytes.len(),
                    sha256_hex(bytes)
                ),
                Node::Symlink(target) => format!("link /{path} -> {}\n", target.display()),
            };
            text.push_str(&line);
        }
        text
    }

    /// The layer as a tar stream into `w`: GNU headers, mtime 0, uid and gid 0, no user names.
    fn write<W: Write>(&self, w: W) -> Result<W> {
        let mut tar = tar::Builder::new(w);
        for (path, item) in &self.items {
            let mut header = tar::Header::new_gnu();
            header.set_mtime(0);
            header.set_uid(0);
            header.set_gid(0);
            header.set_mode(item.mode);
            match &item.node {
                Node::Dir => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_size(0);
                    tar.append_data(&mut header, format!("{path}/"), io::empty())?;
                }
                Node::File(bytes) => {
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_size(bytes.len() as u64);
                    tar.append_data(&mut header, path, bytes.as_slice())?;
                }
                Node::Symlink(target) => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_size(0);
                    tar.append_link(&mut header, path, target)?;
                }
            }
        }
        Ok(tar.into_inner()?)
    }
}

fn kind(node: &Node) -> &'static str {
    match node {
        Node::Dir => "directory",
        Node::File(_) => "file",
        Node::Symlink(_) => "symlink",
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
fn resolve_tool(tool: &str) -> Result<PathBuf> {
    if tool.starts_with('/') {
        return Ok(PathBuf::from(tool));
    }
    IMAGE_PATH
        .split(':')
        .map(|dir| Path::new(dir).join(tool))
        .find(|p| p.is_file())
        .with_context(|| format!("`{tool}` is not on this machine (looked in {IMAGE_PATH})"))
}

// ---------------------------------------------------------------------------------------------
// Archives

/// One image: its layer and config, and where its archive and stamp go.
pub(crate) struct Plan {
    recipe: Recipe,
    layer: Layer,
    /// The config without its diff_ids (which the layer decides).
    config: Value,
    archive: PathBuf,
    stamp: PathBuf,
    inputs: String,
}

impl Plan {
    fn new(recipe: Recipe, out: &Path) -> Result<Self> {
        let mut layer = Layer::skeleton()?;
        let program = relative(Path::new(recipe.program))?;
        let bytes = fs::read(&recipe.program_source)
            .with_context(|| format!("reading {}", recipe.program_source.display()))?;
        layer.file(&program, 0o755, bytes)?;
        layer.libraries_of(&recipe.program_source)?;
        for tool in recipe.tools {
            let path = resolve_tool(tool)?;
            if tool.starts_with("/etc/") {
                layer.host_file(&path, Role::Data)?;
            } else {
                layer.host_program(&path)?;
            }
        }
        let config = image_config(&recipe)?;
        Ok(Plan::with_layer(recipe, layer, config, out))
    }

    /// A plan for a layer and an image config (without rootfs) made elsewhere
    /// (`upstream_images.rs`); of the recipe only the name and the reference are used.
    pub(crate) fn with_layer(recipe: Recipe, layer: Layer, config: Value, out: &Path) -> Self {
        let inputs = format!(
            "format {FORMAT}\nreference {}\ngzip level {GZIP_LEVEL}\nconfig {}\n{}",
            recipe.reference,
            canonical_json(&config),
            layer.describe()
        );
        Plan {
            archive: out.join(format!("{}.oci.tar", recipe.name)),
            stamp: out.join(format!("{}.oci.tar.stamp", recipe.name)),
            recipe,
            layer,
            config,
            inputs,
        }
    }

    /// The manifest digest of the archive on disk when the stamp vouches for it.
    fn current(&self) -> Option<String> {
        let stamp = fs::read_to_string(&self.stamp).ok()?;
        let outputs = stamp.strip_prefix(&self.inputs)?;
        let field = |key: &str| {
            outputs
                .lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
                .map(str::to_string)
        };
        let digest = field("= manifest_digest")?;
        let size: u64 = field("= archive_bytes")?.parse().ok()?;
        let on_disk = fs::metadata(&self.archive).ok()?.len();
        (on_disk == size).then_some(digest)
    }

    pub(crate) fn ensure(&self) -> Result<Built> {
        let built = |manifest_digest: String, rebuilt: bool| Built {
            name: self.recipe.name,
            reference: self.recipe.reference,
            archive: self.archive.clone(),
            manifest_digest,
            rebuilt,
        };
        if let Some(digest) = self.current() {
            step(&format!(
                "{} is current ({}, {})",
                self.recipe.reference,
                short(&digest),
                self.archive.display()
            ));
            return Ok(built(digest, false));
        }
        let started = Instant::now();
        // A half-written archive must not keep an old stamp that vouches for it.
        match fs::remove_file(&self.stamp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", self.stamp.display()));
            }
            _ => {}
        }
        let (digest, size) = self.write_archive()?;
        let stamp = format!(
            "{}= manifest_digest {digest}\n= archive_bytes {size}\n",
            self.inputs
        );
        fs::write(&self.stamp, stamp).with_context(|| format!("writing {}", self.stamp.display()))?;
        step(&format!(
            "built {} ({}, {:.1} MB, {} entries) in {:.1?}",
            self.recipe.reference,
            short(&digest),
            size as f64 / 1e6,
            self.layer.items.len(),
            started.elapsed()
        ));
        Ok(built(digest, true))
    }

    /// Writes the archive (via a temporary file) and returns the manifest digest and the size.
    fn write_archive(&self) -> Result<(String, u64)> {
        // The layer: tar, hashed uncompressed (the diff_id) and compressed (the blob digest).
        let gzip = GzBuilder::new()
            .mtime(0)
            .operating_system(255)
            .write(Vec::new(), Compression::new(GZIP_LEVEL));
        let hashing = self.layer.write(Hashing::new(gzip))?;
        let diff_id = format!("sha256:{}", hex(&hashing.hash.finalize()));
        let layer = hashing.inner.finish()?;

        let mut config = self.config.clone();
        config["rootfs"] = json!({"type": "layers", "diff_ids": [diff_id]});
        let config = canonical_json(&config).into_bytes();
        let manifest = canonical_json(&json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": descriptor(CONFIG_MEDIA_TYPE, &config),
            "layers": [descriptor(LAYER_MEDIA_TYPE, &layer)],
        }))
        .into_bytes();
        let manifest_digest = digest(&manifest);
        let tag = self
            .recipe
            .reference
            .rsplit_once(':')
            .map(|(_, t)| t)
            .unwrap_or("latest");
        let mut entry = descriptor(MANIFEST_MEDIA_TYPE, &manifest);
        entry["annotations"] = json!({
            "io.containerd.image.name": self.recipe.reference,
            "org.opencontainers.image.ref.name": tag,
        });
        entry["platform"] = json!({"architecture": arch()?, "os": "linux"});
        let index = canonical_json(&json!({
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA_TYPE,
            "manifests": [entry],
        }))
        .into_bytes();

        let mut files: BTreeMap<String, &[u8]> = BTreeMap::new();
        for blob in [&layer, &config, &manifest] {
            files.insert(format!("blobs/sha256/{}", &digest(blob)["sha256:".len()..]), blob);
        }
        files.insert("index.json".into(), &index);
        let layout = br#"{"imageLayoutVersion":"1.0.0"}"#;
        files.insert("oci-layout".into(), layout);

        let tmp = self
            .archive
            .with_extension(format!("tar.tmp-{}", std::process::id()));
        let file = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut tar = tar::Builder::new(io::BufWriter::new(file));
        for dir in ["blobs", "blobs/sha256"] {
            let mut header = archive_header(tar::EntryType::Directory, 0o755, 0);
            tar.append_data(&mut header, format!("{dir}/"), io::empty())?;
        }
        for (path, bytes) in &files {
            let mut header = archive_header(tar::EntryType::Regular, 0o644, bytes.len() as u64);
            tar.append_data(&mut header, path, *bytes)?;
        }
        let file = tar
            .into_inner()?
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("writing {}", tmp.display()))?;
        file.sync_all()?;
        let size = file.metadata()?.len();
        drop(file);
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644))?;
        fs::rename(&tmp, &self.archive)
            .with_context(|| format!("renaming {} to {}", tmp.display(), self.archive.display()))?;
        Ok((manifest_digest, size))
    }
}

fn archive_header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(kind);
    header.set_mode(mode);
    header.set_size(size);
    header.set_mtime(0);
    header.set_uid(0);
    header.set_gid(0);
    header
}

/// The image config without rootfs: what the recipe says, plus the platform and PATH.
fn image_config(recipe: &Recipe) -> Result<Value> {
    config_of(recipe.entrypoint, recipe.cmd, recipe.user, &[])
}

/// An image config (without rootfs): what a Dockerfile of the image would give, with the usual
/// PATH; no Entrypoint, Cmd, User or ExposedPorts when the image has none.
pub(crate) fn config_of(entrypoint: &[&str], cmd: &[&str], user: &str, ports: &[&str]) -> Result<Value> {
    let mut config = json!({
        "Env": [format!("PATH={IMAGE_PATH}")],
        "WorkingDir": "/",
    });
    if !entrypoint.is_empty() {
        config["Entrypoint"] = json!(entrypoint);
    }
    if !cmd.is_empty() {
        config["Cmd"] = json!(cmd);
    }
    if !user.is_empty() {
        config["User"] = json!(user);
    }
    if !ports.is_empty() {
        config["ExposedPorts"] = Value::Object(ports.iter().map(|p| (p.to_string(), json!({}))).collect());
    }
    Ok(json!({"architecture": arch()?, "os": "linux", "config": config}))
}

/// The OCI architecture of the binaries (built for this machine).
pub(crate) fn arch() -> Result<&'static str> {
    Ok(match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => bail!("no OCI architecture name for {other}"),
    })
}

fn descriptor(media_type: &str, blob: &[u8]) -> Value {
    json!({"mediaType": media_type, "digest": digest(blob), "size": blob.len()})
}

fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", sha256_hex(bytes))
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn short(digest: &str) -> &str {
    &digest[..digest.len().min("sha256:".len() + 12)]
}

/// JSON with object keys sorted at every level and no spaces, whatever serde_json's features
/// (`preserve_order` would keep insertion order): the digests must not depend on them.
fn canonical_json(value: &Value) -> String {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let fields: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::from(k.as_str()), canonical_json(&map[k])))
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(canonical_json).collect();
            format!("[{}]", items.join(","))
        }
        other => other.to_string(),
    }
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
}

impl<W> Hashing<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hash: Sha256::new(),
        }
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))
}

/// An exclusive `flock` on `path` (two builds into one directory would race), released on drop.
pub(crate) fn lock(path: &Path) -> Result<File> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        step(&format!(
            "waiting for another build of the images ({})",
            path.display()
        ));
        // SAFETY: as above.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io::Error::last_os_error()).with_context(|| format!("locking {}", path.display()));
        }
    }
    Ok(file)
}

// ---------------------------------------------------------------------------------------------
// The recipe against manifests/Dockerfile and manifests/daemonset.yaml

/// One instruction of a Dockerfile, with the line it starts on.
#[cfg(test)]
#[derive(Debug)]
struct Instruction {
    line: usize,
    keyword: String,
    rest: String,
}

/// Instructions with continuation lines joined; comments and blank lines dropped.
#[cfg(test)]
fn dockerfile_instructions(text: &str) -> Vec<Instruction> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if current.is_none() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if current.is_some() && trimmed.starts_with('#') {
            continue;
        }
        let (continues, body) = match trimmed.strip_suffix('\\') {
            Some(body) => (true, body.trim_end()),
            None => (false, trimmed),
        };
        let (line, mut joined) = current.take().unwrap_or((i + 1, String::new()));
        if !joined.is_empty() && !body.is_empty() {
            joined.push(' ');
        }
        joined.push_str(body);
        if continues {
            current = Some((line, joined));
        } else if !joined.is_empty() {
            let (keyword, rest) = joined.split_once(char::is_whitespace).unwrap_or((&joined, ""));
            out.push(Instruction {
                line,
                keyword: keyword.to_ascii_uppercase(),
                rest: rest.trim().to_string(),
            });
        }
    }
    out
}

/// Where the last stage of the Dockerfile `text` and `recipe` disagree, one message per line of
/// the Dockerfile (empty: they agree).
#[cfg(test)]
fn dockerfile_disagreements(text: &str, recipe: &Recipe) -> Vec<String> {
    const FILE: &str = "manifests/Dockerfile";
    let instructions = dockerfile_instructions(text);
    let Some(start) = instructions.iter().rposition(|i| i.keyword == "FROM") else {
        return vec![format!("{FILE}: no FROM instruction")];
    };
    let stage = &instructions[start..];
    let mut problems = Vec::new();
    let mut at = |i: &Instruction, what: String| {
        problems.push(format!("{FILE}:{}: `{} {}`: {what}", i.line, i.keyword, i.rest));
    };
    let json_array = |rest: &str| serde_json::from_str::<Vec<String>>(rest).ok();
    let (mut copied, mut user, mut entrypoint) = (false, false, false);
    for i in stage {
        match i.keyword.as_str() {
            "FROM" => {
                let image = i
                    .rest
                    .split_whitespace()
                    .find(|w| !w.starts_with("--"))
                    .unwrap_or_default();
                if Some(image) != recipe.base {
                    at(i, format!("the local image stands in for {:?}", recipe.base));
                }
            }
            "COPY" => {
                let words: Vec<&str> = i.rest.split_whitespace().collect();
                let (flags, paths): (Vec<&str>, Vec<&str>) =
                    words.into_iter().partition(|w| w.starts_with("--"));
                if flags.iter().any(|f| *f != "--from=build" && *f != "--link") {
                    at(
                        i,
                        "the local image models only `COPY --from=build /out/lb-agent <dest>`".into(),
                    );
                    continue;
                }
                let Some((dest, sources)) = paths.split_last() else {
                    at(i, "COPY without a destination".into());
                    continue;
                };
                if flags.is_empty() || sources != ["/out/lb-agent"] {
                    at(
                        i,
                        "the local image copies only the build stage's /out/lb-agent".into(),
                    );
                    continue;
                }
                let dest = if dest.ends_with('/') {
                    format!("{dest}lb-agent")
                } else {
                    dest.to_string()
                };
                if dest != recipe.program {
                    at(i, format!("the local image has the binary at {}", recipe.program));
                }
                copied = true;
            }
            "USER" => {
                user = true;
                if i.rest != recipe.user {
                    at(i, format!("the local image's config has User {:?}", recipe.user));
                }
            }
            "ENTRYPOINT" => {
                entrypoint = true;
                match json_array(&i.rest) {
                    Some(e) if e == recipe.entrypoint => {}
                    _ => at(
                        i,
                        format!("the local image's Entrypoint is {:?}", recipe.entrypoint),
                    ),
                }
            }
            "CMD" => match json_array(&i.rest) {
                Some(c) if c == recipe.cmd => {}
                _ => at(i, format!("the local image's Cmd is {:?}", recipe.cmd)),
            },
            "WORKDIR" if i.rest == "/" => {}
            _ => at(
                i,
                "not modelled by the local image recipe (xtask/src/image.rs): add it there too".into(),
            ),
        }
    }
    let from = &stage[0];
    if !copied {
        at(
            from,
            format!("this stage copies no lb-agent to {}", recipe.program),
        );
    }
    if !user {
        at(
            from,
            format!("this stage has no USER; the local image's is {:?}", recipe.user),
        );
    }
    if !entrypoint {
        at(
            from,
            format!(
                "this stage has no ENTRYPOINT; the local image's is {:?}",
                recipe.entrypoint
            ),
        );
    }
    problems
}

/// The external commands a shell script runs (first words of its simple commands, including
/// those in `$(...)`), without shell keywords and dash's builtins.
#[cfg(test)]
fn script_commands(script: &str) -> Vec<String> {
    const KEYWORDS: &[&str] = &[
        "if", "then", "else", "elif", "fi", "while", "until", "do", "done", "for", "case", "esac", "!", "{",
        "}",
    ];
    const BUILTINS: &[&str] = &[
        ":", ".", "[", "alias", "cd", "command", "echo", "eval", "exec", "exit", "export", "false",
        "getopts", "kill", "local", "printf", "pwd", "read", "return", "set", "shift", "test", "trap",
        "true", "type", "ulimit", "umask", "unset", "wait",
    ];
    let separated = script
        .replace("$(", "\n")
        .replace([';', '|', '&', '(', ')', '`'], "\n");
    let mut commands = Vec::new();
    for segment in separated.lines() {
        let first = segment
            .split_whitespace()
            .find(|w| !KEYWORDS.contains(w) && !(w.contains('=') && !w.starts_with('=')));
        let Some(word) = first else { continue };
        let plain = word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_./-[".contains(c));
        if plain && !word.starts_with('-') && !BUILTINS.contains(&word) && !commands.iter().any(|c| c == word)
        {
            commands.push(word.to_string());
        }
    }
    commands
}

/// Whether `command` (an absolute path or a name looked up in PATH) is one of `tools`.
#[cfg(test)]
fn has_tool(tools: &[&str], command: &str) -> bool {
    tools.iter().any(|t| {
        if command.starts_with('/') {
            *t == command
        } else {
            Path::new(t).file_name().is_some_and(|n| n == command)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dockerfile() -> String {
        fs::read_to_string(workspace_root().join("manifests/Dockerfile")).unwrap()
    }

    #[test]
    fn agent_recipe_matches_the_dockerfile_runtime_stage() {
        let problems = dockerfile_disagreements(&dockerfile(), &agent_recipe());
        assert!(
            problems.is_empty(),
            "the lb-agent image recipe (xtask/src/image.rs) and manifests/Dockerfile disagree:\n{}",
            problems.join("\n")
        );
    }

    #[test]
    fn a_drifted_dockerfile_is_caught_with_its_line() {
        let original = dockerfile();
        let drifted = original
            .replace(
                "ENTRYPOINT [\"/usr/local/bin/lb-agent\"]",
                "ENTRYPOINT [\"/usr/bin/lb-agent\"]",
            )
            .replace("FROM debian:bookworm-slim", "FROM debian:trixie-slim");
        assert_ne!(drifted, original, "the test's replacements no longer apply");
        let problems = dockerfile_disagreements(&drifted, &agent_recipe());
        let line_of = |needle: &str| drifted.lines().position(|l| l.contains(needle)).unwrap() + 1;
        for (needle, keyword) in [("/usr/bin/lb-agent", "ENTRYPOINT"), ("trixie", "FROM")] {
            let expected = format!("manifests/Dockerfile:{}: `{keyword} ", line_of(needle));
            assert!(
                problems.iter().any(|p| p.starts_with(&expected)),
                "{expected} in {problems:#?}"
            );
        }
        let extra = format!("{original}RUN apt-get install -y curl\n");
        let problems = dockerfile_disagreements(&extra, &agent_recipe());
        assert!(
            problems
                .iter()
                .any(|p| p.contains("`RUN apt-get") && p.contains("not modelled")),
            "{problems:#?}"
        );
    }

    #[test]
    fn dockerfile_continuations_and_comments() {
        let text = "FROM a AS b\nRUN x \\\n # note\n  && y\n\nFROM debian:bookworm-slim\nUSER 0\n";
        let parsed = dockerfile_instructions(text);
        let summary: Vec<(usize, &str, &str)> = parsed
            .iter()
            .map(|i| (i.line, i.keyword.as_str(), i.rest.as_str()))
            .collect();
        assert_eq!(
            summary,
            [
                (1, "FROM", "a AS b"),
                (2, "RUN", "x && y"),
                (6, "FROM", "debian:bookworm-slim"),
                (7, "USER", "0")
            ]
        );
    }

    #[test]
    fn daemonset_init_commands_are_in_the_agent_image() {
        let path = workspace_root().join("manifests/daemonset.yaml");
        let doc: Value = serde_saphyr::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        let spec = &doc["spec"]["template"]["spec"];
        let inits = spec["initContainers"].as_array().expect("initContainers");
        assert!(!inits.is_empty());
        let tools = agent_recipe().tools;
        let mut checked = Vec::new();
        for container in inits.iter().chain(spec["containers"].as_array().unwrap()) {
            let name = container["name"].as_str().unwrap_or_default();
            let image = container["image"].as_str().unwrap_or_default();
            assert!(
                image.contains("lb-agent"),
                "{name} runs {image}, not the lb-agent image"
            );
            let words = |key: &str| -> Vec<String> {
                container[key]
                    .as_array()
                    .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
                    .unwrap_or_default()
            };
            let (command, args) = (words("command"), words("args"));
            let Some(program) = command.first() else {
                continue; // the image's entrypoint: lb-agent
            };
            assert!(
                has_tool(tools, program),
                "{name} runs {program}, which the image lacks ({tools:?})"
            );
            checked.push(program.clone());
            let argv: Vec<&String> = command.iter().chain(&args).collect();
            if let Some(c) = argv.iter().position(|w| *w == "-c") {
                let script = argv.get(c + 1).expect("a script after -c");
                let commands = script_commands(script);
                assert!(!commands.is_empty(), "no command found in {script:?}");
                for command in commands {
                    assert!(
                        has_tool(tools, &command),
                        "{name}'s script runs `{command}`, which the lb-agent image lacks: add it to AGENT_TOOLS \
                         (tools: {tools:?})"
                    );
                    checked.push(command);
                }
            }
        }
        for needed in ["/bin/sh", "stat", "mount"] {
            assert!(
                checked.iter().any(|c| c == needed),
                "{needed} not found in {checked:?}"
            );
        }
    }

    #[test]
    fn script_commands_skip_keywords_and_builtins() {
        let script = "set -eu\nif [ \"$(stat -f -c %T /x)\" = bpf_fs ]; then\n  echo ok\nelse\n  \
                      mount -t bpf bpf /x && X=1 cat /y | grep z\nfi\n";
        assert_eq!(script_commands(script), ["stat", "mount", "cat", "grep"]);
    }

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

    #[test]
    fn layers_are_deterministic_and_ordered() {
        let build = || {
            let mut layer = Layer::skeleton().unwrap();
            layer
                .file("usr/local/bin/x", 0o755, b"#!/bin/sh\n".to_vec())
                .unwrap();
            layer.symlink("bin", "usr/bin".into()).unwrap();
            layer.write(Vec::new()).unwrap()
        };
        let bytes = build();
        assert_eq!(bytes, build());
        let mut archive = tar::Archive::new(bytes.as_slice());
        let mut seen = Vec::new();
        for entry in archive.entries().unwrap() {
            let entry = entry.unwrap();
            let header = entry.header();
            assert_eq!(header.mtime().unwrap(), 0);
            assert_eq!((header.uid().unwrap(), header.gid().unwrap()), (0, 0));
            let path = entry
                .path()
                .unwrap()
                .to_string_lossy()
                .trim_end_matches('/')
                .to_string();
            if let Some(parent) = Path::new(&path).parent().filter(|p| !p.as_os_str().is_empty()) {
                assert!(
                    seen.contains(&parent.to_string_lossy().to_string()),
                    "{path} before its directory"
                );
            }
            if path == "tmp" {
                assert_eq!(header.mode().unwrap(), 0o1777);
            }
            seen.push(path);
        }
        assert!(seen.contains(&"usr/local/bin/x".to_string()) && seen.contains(&"etc/passwd".to_string()));
        // A file cannot go under a symlink.
        let mut layer = Layer::default();
        layer.symlink("bin", "usr/bin".into()).unwrap();
        assert!(layer.file("bin/sh", 0o755, vec![]).is_err());
    }

    #[test]
    fn kube_proxy_image_is_tagged_with_the_binary_version() {
        let recipe = kube_proxy_recipe(PathBuf::from("/kube-proxy"));
        assert_eq!(
            recipe.reference.rsplit_once(':').map(|(_, tag)| tag),
            Some(KUBERNETES_VERSION)
        );
        // kubeadm's DaemonSet runs `/usr/local/bin/kube-proxy --config=...`.
        assert_eq!(recipe.entrypoint, [recipe.program]);
        assert_eq!(recipe.program, "/usr/local/bin/kube-proxy");
    }

    #[test]
    fn canonical_json_sorts_keys() {
        let v = json!({"b": 1, "a": {"d": [1, "x"], "c": null}});
        assert_eq!(canonical_json(&v), r#"{"a":{"c":null,"d":[1,"x"]},"b":1}"#);
    }

    #[test]
    fn host_release_check_names_the_base() {
        let err = check_host_release("debian:no-such-release-slim")
            .unwrap_err()
            .to_string();
        assert!(err.contains("no-such-release"), "{err}");
    }
}
