//! A real Kubernetes node on this machine: kubelet with containerd, runc and the CNI plugins
//! (bridge, host-local, loopback), registered with a [`ControlPlane`] started with its
//! controllers, running real Pods from images built locally (`cargo xtask images`).
//!
//! The node is a network namespace on the test LAN ([`Lan`]), like the netns nodes of
//! [`crate::topo`], and more: its processes run in a private mount namespace (a "holder" process
//! keeps it) where `/var/lib`, `/var/log` and `/run` are the node's own directories, so kubelet
//! and containerd run with their default paths and nothing of theirs lands on the machine; and
//! its cgroups are `lb-tests/<node>` in every hierarchy, kubelet's `cgroupRoot`. The API server on
//! loopback is reached through forwards inside the node's namespace (on 127.0.0.1 and on
//! [`ADVERTISE_ADDRESS`], the `kubernetes` Service's endpoint).
//!
//! Dropping the guard stops kubelet, kills every process of the node (its cgroup tree: runtime,
//! shims, containers), which ends the mount namespace and with it every mount the node made
//! (overlays, Pod volumes, the bpffs the DaemonSet mounted), then removes the cgroups, the
//! namespace and the directory. When the test process dies without its guard (SIGTERM, SIGKILL),
//! the holder kills the node's cgroup tree within a second, and the next run's sweep removes the
//! names left (`crate::sweep`).

use std::{
    env, fs,
    fs::OpenOptions,
    net::{Ipv4Addr, SocketAddr},
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::{
    control_plane::{ADVERTISE_ADDRESS, ControlPlane},
    netns::{NetNs, PortForward},
    topo::Lan,
};

/// The port of the control-plane endpoint inside a node (kubeadm's default).
pub const API_PORT: u16 = 6443;
/// The cluster CIDR the deployed agent is told (every node's Pod range is inside it).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// How long containerd and kubelet may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// The parent of every node's cgroups, in every hierarchy (as `crate::cgroup`'s tests).
const CGROUP_PARENT: &str = "lb-tests";

/// containerd, its shim, ctr, runc and the CNI plugins, from Debian's packages
/// (`cargo xtask node-parts`, which `./x test` and `./x sandbox` run).
#[derive(Clone, Debug)]
pub struct NodeParts {
    /// containerd, containerd-shim-runc-v2, ctr, runc.
    pub bin: PathBuf,
    /// bridge, host-local, loopback, ...
    pub cni: PathBuf,
}

impl NodeParts {
    /// `LB_NODE_PARTS_DIR`, else `<cache>/node-parts`.
    pub fn locate() -> Result<NodeParts> {
        let dir = env::var_os("LB_NODE_PARTS_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| crate::control_plane::cache_dir().join("node-parts"));
        let parts = NodeParts {
            bin: dir.join("bin"),
            cni: dir.join("cni"),
        };
        for file in [
            parts.bin.join("containerd"),
            parts.bin.join("containerd-shim-runc-v2"),
            parts.bin.join("ctr"),
            parts.bin.join("runc"),
            parts.cni.join("bridge"),
            parts.cni.join("host-local"),
            parts.cni.join("loopback"),
        ] {
            if !file.is_file() {
                bail!(
                    "{} is missing; fetch the node's parts with `cargo xtask node-parts` (Debian's \
                     containerd, runc and CNI plugins, once)",
                    file.display()
                );
            }
        }
        Ok(parts)
    }
}

/// An image archive built by `cargo xtask images` (`target/images/images.json`).
#[derive(Clone, Debug, Deserialize)]
pub struct Image {
    pub name: String,
    /// The reference it is imported as, e.g. `localhost/lb-agent:dev`.
    #[serde(rename = "ref")]
    pub reference: String,
    pub archive: PathBuf,
    pub manifest_digest: String,
}

/// The images `cargo xtask images` built (`LB_IMAGE_DIR`, else `<workspace>/target/images`).
pub fn images() -> Result<Vec<Image>> {
    let dir = env::var_os("LB_IMAGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/images"));
    images_in(&dir)
}

/// The images listed in `dir/images.json` (the format `cargo xtask images` writes).
pub fn images_in(dir: &Path) -> Result<Vec<Image>> {
    let index = dir.join("images.json");
    let text = fs::read_to_string(&index).with_context(|| {
        format!(
            "reading {}: build the images with `cargo xtask images`",
            index.display()
        )
    })?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))
}

/// The image named `name` (`lb-agent`, `lb-probe`, `pause`).
pub fn image(name: &str) -> Result<Image> {
    images()?
        .into_iter()
        .find(|i| i.name == name)
        .with_context(|| format!("`cargo xtask images` built no image named {name}"))
}

/// What makes one node.
pub struct NodeConfig {
    /// Its address on the LAN (192.168.50.0/24).
    pub ip: Ipv4Addr,
    /// The Pods' range on this node, e.g. `10.244.1.0/24`; its first address is the bridge's.
    pub pod_cidr: String,
    /// The cluster DNS Service's address kubelet writes into Pods' resolv.conf (kubelet's
    /// `clusterDNS`); `None`: Pods get the node's resolver.
    pub cluster_dns: Option<Ipv4Addr>,
}

/// A kubelet node; see the module documentation.
pub struct KubeletNode {
    name: String,
    ip: Ipv4Addr,
    pod_cidr: String,
    cluster_dns: Option<Ipv4Addr>,
    parts: NodeParts,
    kubelet_bin: PathBuf,
    kubeconfig: PathBuf,
    /// The processes that hold the mount namespace, run the containers and the node.
    holder: Option<Child>,
    containerd: Option<Child>,
    kubelet: Option<Child>,
    /// `<hierarchy>/lb-tests/<name>` for every cgroup hierarchy.
    cgroups: Vec<PathBuf>,
    /// The cgroup2 directory of the node (`--cgroup-root` for the socket programs).
    cgroup2: PathBuf,
    _forwards: Vec<PortForward>,
    // Dropped after the processes and before the directory.
    ns: NetNs,
    dir: tempfile::TempDir,
}

impl KubeletNode {
    /// Creates the node's namespace on `lan`, starts containerd, imports `images`, starts kubelet
    /// and waits until the Node is Ready. Blocking.
    pub fn start(cp: &ControlPlane, lan: &Lan, config: NodeConfig, images: &[Image]) -> Result<KubeletNode> {
        crate::require_root();
        let parts = NodeParts::locate()?;
        let ns = NetNs::new("lbk");
        let name = ns.name().to_string();
        let dir = tempfile::Builder::new()
            .prefix(&format!("{name}-"))
            .tempdir()
            .context("creating the node's directory")?;
        lan.attach(&ns, "eth0", &format!("{}/24", config.ip));
        ns.sysctl("net.ipv4.ip_forward=1");
        ns.ip(&["addr", "add", &format!("{ADVERTISE_ADDRESS}/32"), "dev", "lo"]);
        let api: SocketAddr = cp
            .server_url()
            .trim_start_matches("https://")
            .parse()
            .context("the API server URL")?;
        // The API server as the node's processes see it: on loopback (kubelet), at the
        // `kubernetes` Service's endpoint, and at the usual control-plane endpoint
        // `ADVERTISE_ADDRESS:6443` (what an operator writes into the agent's ConfigMap).
        let forwards = vec![
            PortForward::start(&ns, api, api),
            PortForward::start(&ns, SocketAddr::from((ADVERTISE_ADDRESS, api.port())), api),
            PortForward::start(&ns, SocketAddr::from((ADVERTISE_ADDRESS, API_PORT)), api),
        ];
        let pods: ipnet::IpNet = config.pod_cidr.parse().context("the node's Pod range")?;
        for net in [ipnet::IpNet::from(std::net::IpAddr::from(config.ip)), pods] {
            cp.route_to_node(net, ns.path());
        }
        let (cgroups, cgroup2) = make_cgroups(&name)?;
        let mut node = KubeletNode {
            name,
            ip: config.ip,
            pod_cidr: config.pod_cidr,
            cluster_dns: config.cluster_dns,
            parts,
            kubelet_bin: cp.binaries().kubelet.clone(),
            kubeconfig: cp.kubeconfig_path().to_path_buf(),
            holder: None,
            containerd: None,
            kubelet: None,
            cgroups,
            cgroup2,
            _forwards: forwards,
            ns,
            dir,
        };
        // From here on, an error drops `node`, which stops and removes what was started.
        node.write_config()?;
        node.start_holder()?;
        node.start_containerd()?;
        for image in images {
            node.import(image)?;
        }
        node.start_kubelet(cp)?;
        Ok(node)
    }

    /// The Node's name (also its namespace's and its cgroups').
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    pub fn pod_cidr(&self) -> &str {
        &self.pod_cidr
    }

    /// The node's network namespace (what `hostNetwork` Pods share).
    pub fn netns(&self) -> &NetNs {
        &self.ns
    }

    /// The node's cgroup2 directory: every Pod of the node is below it.
    pub fn cgroup2(&self) -> &Path {
        &self.cgroup2
    }

    /// The node's directory (logs: `containerd.log`, `kubelet.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn holder_pid(&self) -> u32 {
        self.holder.as_ref().map(Child::id).unwrap_or_default()
    }

    /// A command run inside the node: its network and mount namespaces (the node's "host").
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--target={}", self.holder_pid()))
            .args(["--mount", "--net", "--"])
            .arg(program);
        cmd
    }

    /// Runs a command inside the node and returns its stdout; fails with its stderr.
    pub fn exec(&self, program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> Result<String> {
        let mut cmd = self.command(program);
        cmd.args(args).stdin(Stdio::null());
        let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
        if !out.status.success() {
            bail!(
                "{cmd:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `ctr -n k8s.io <args>` against the node's containerd.
    pub fn ctr(&self, args: &[&str]) -> Result<String> {
        let ctr = self.parts.bin.join("ctr");
        let mut full = vec!["--address", "/run/containerd/containerd.sock", "-n", "k8s.io"];
        full.extend_from_slice(args);
        self.exec(&ctr, &full)
    }

    /// Imports an image archive into the node's containerd (what `ctr images import` does on a
    /// node without a registry).
    pub fn import(&self, image: &Image) -> Result<()> {
        let archive = image.archive.display().to_string();
        self.ctr(&["images", "import", "--local", &archive])
            .with_context(|| format!("importing {} into {}", image.reference, self.name))?;
        Ok(())
    }

    /// The host pid of a container (`containerd://<id>` as a Pod's status names it).
    pub fn container_pid(&self, container_id: &str) -> Result<i32> {
        let id = container_id.trim_start_matches("containerd://");
        let tasks = self.ctr(&["tasks", "ls"])?;
        tasks
            .lines()
            .skip(1)
            .find_map(|line| {
                let mut fields = line.split_whitespace();
                (fields.next() == Some(id)).then(|| fields.next()?.parse().ok())?
            })
            .with_context(|| format!("container {id} has no task on {}:\n{tasks}", self.name))
    }

    /// The last lines of kubelet's and containerd's logs.
    pub fn log_tail(&self) -> String {
        let mut out = String::new();
        for log in ["kubelet.log", "containerd.log"] {
            let path = self.dir.path().join(log);
            let text = fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!(
                "--- {} ({}), last lines:\n{}\n",
                log,
                path.display(),
                lines[lines.len().saturating_sub(30)..].join("\n")
            ));
        }
        out
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write_config(&self) -> Result<()> {
        for sub in ["var-lib", "var-log", "run", "opt-containerd", "cni"] {
            fs::create_dir_all(self.path(sub))?;
        }
        let gateway = gateway_of(&self.pod_cidr)?;
        // The bridge plugin, as kubeadm's documentation and kind's first CNI: Pods on `cni0`,
        // which is their gateway; the node routes between the bridge and its uplink. No
        // masquerading: Pod addresses are routed on the LAN (as the netns nodes of `topo`).
        let cni = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "lb-node",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.pod_cidr, "gateway": gateway.to_string()}]],
                        "routes": [{"dst": "0.0.0.0/0"}]
                    }
                },
                {"type": "loopback"}
            ]
        });
        fs::write(
            self.path("cni/10-bridge.conflist"),
            serde_json::to_string_pretty(&cni)?,
        )?;
        let q = |p: PathBuf| toml_string(&p.display().to_string());
        let containerd = format!(
            r#"version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
# Snapshotters and exporters this node does not use (and whose probes only log noise).
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.erofs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins.'io.containerd.cri.v1.images']
  # Images come from `ctr images import`; there is no registry to pull from.
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "localhost/pause:3.10"

[plugins.'io.containerd.cri.v1.runtime']
  # Lowering oom_score_adj (-998 for sandboxes, kubelet's QoS values) needs CAP_SYS_RESOURCE,
  # which root may lack on a VM like this one: keep scores at containerd's own or above.
  restrict_oom_score_adj = true

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = {runc}
  SystemdCgroup = false

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = [{cni_bin}]
  conf_dir = {cni_conf}

[plugins.'io.containerd.internal.v1.opt']
  path = {opt}

[plugins.'io.containerd.nri.v1.nri']
  disable = true
"#,
            runc = q(self.parts.bin.join("runc")),
            cni_bin = q(self.parts.cni.clone()),
            cni_conf = q(self.path("cni")),
            opt = q(self.path("opt-containerd")),
        );
        fs::write(self.path("containerd.toml"), containerd)?;
        let cgroup_root = format!("/{CGROUP_PARENT}/{}", self.name);
        let kubelet = serde_json::json!({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": cgroup_root,
            // This machine may have the hybrid layout; the node then runs on cgroup v1.
            "failCgroupV1": false,
            "failSwapOn": false,
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            // kubelet's API (logs, exec) on the node's address, reached only by the API server
            // through the control plane's egress proxy into this namespace: a test node takes
            // every request it gets.
            "address": self.ip.to_string(),
            "readOnlyPort": 0,
            "healthzPort": 0,
            "authentication": {"anonymous": {"enabled": true}, "webhook": {"enabled": false}},
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDomain": "cluster.local",
            "clusterDNS": self.cluster_dns.iter().map(|ip| ip.to_string()).collect::<Vec<_>>(),
            "resolvConf": "/etc/resolv.conf",
            // Images are imported, never pulled: never collect them.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            // The node shares the machine's disk and memory with everything else; evict only
            // when the machine itself is about to run out.
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "syncFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
            "maxPods": 60,
            "serializeImagePulls": false,
        });
        fs::write(self.path("kubelet.yaml"), serde_json::to_string_pretty(&kubelet)?)?;
        Ok(())
    }

    /// The holder: enters the node's network namespace, unshares a mount namespace in which the
    /// node's directories replace `/var/lib`, `/var/log` and `/run`, and sleeps.
    fn start_holder(&mut self) -> Result<()> {
        let ready = self.path("holder.ready");
        let d = |s: &str| self.path(s).display().to_string();
        // Private first, so nothing propagates back to the machine; then shared again inside, as
        // on a real node (Bidirectional mount propagation, which the DaemonSet's init container
        // uses for bpffs, needs a shared mount).
        //
        // It is also the node's watchdog: when the test process is gone (a panic that skipped
        // the guard, SIGTERM, SIGKILL), it kills the node's whole cgroup tree, itself included,
        // which ends the mount namespace; the next run's sweep removes the names left.
        let script = format!(
            "set -e\n\
             mount --make-rshared /\n\
             mount --bind '{var_lib}' /var/lib\n\
             mount --bind '{var_log}' /var/log\n\
             mount --bind '{run}' /run\n\
             touch '{ready}'\n\
             set +e\n\
             while kill -0 {test_pid} 2>/dev/null; do sleep 1; done\n\
             echo 1 > '{kill}'\n",
            var_lib = d("var-lib"),
            var_log = d("var-log"),
            run = d("run"),
            ready = ready.display(),
            test_pid = std::process::id(),
            kill = self.cgroup2.join("cgroup.kill").display(),
        );
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.ns.path().display())).args([
            "--",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
        ]);
        let child = self.spawn(cmd, "holder.log")?;
        self.holder = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ready.exists() {
            if let Some(status) = self.holder.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!(
                    "the node's mount namespace could not be set up ({status}): {}",
                    fs::read_to_string(self.path("holder.log")).unwrap_or_default()
                );
            }
            if Instant::now() > deadline {
                bail!("the node's mount namespace was not ready within 10 s");
            }
            thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Spawns `cmd` in the node's "system" cgroup with its output in `log`.
    fn spawn(&self, mut cmd: Command, log: &str) -> Result<Child> {
        let log_path = self.path(log);
        let file = OpenOptions::new().create(true).append(true).open(&log_path)?;
        let procs = OpenOptions::new()
            .write(true)
            .open(self.cgroup2.join("system/cgroup.procs"))
            .context("opening the node's system cgroup")?;
        let mut path = std::ffi::OsString::from(self.parts.bin.as_os_str());
        path.push(":");
        path.push(env::var_os("PATH").unwrap_or_default());
        cmd.env("PATH", path)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        // SAFETY: only async-signal-safe syscalls on a descriptor opened above.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn().with_context(|| format!("starting {cmd:?}"))
    }

    fn start_containerd(&mut self) -> Result<()> {
        let mut cmd = self.command(self.parts.bin.join("containerd"));
        cmd.arg("--config").arg(self.path("containerd.toml"));
        let child = self.spawn(cmd, "containerd.log")?;
        self.containerd = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.containerd.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.containerd = None;
                bail!("containerd exited ({status}) at start\n{}", self.log_tail());
            }
            if self.ctr(&["version"]).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "containerd did not answer within {START_TIMEOUT:?}\n{}",
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    fn start_kubelet(&mut self, cp: &ControlPlane) -> Result<()> {
        let mut cmd = self.command(&self.kubelet_bin);
        cmd.arg(format!("--config={}", self.path("kubelet.yaml").display()))
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .arg(format!("--hostname-override={}", self.name))
            .arg(format!("--node-ip={}", self.ip))
            .arg("--v=1");
        let child = self.spawn(cmd, "kubelet.log")?;
        self.kubelet = Some(child);
        self.wait_ready(cp)
    }

    /// Waits until the Node reports Ready.
    pub fn wait_ready(&mut self, cp: &ControlPlane) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.kubelet.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.kubelet = None;
                bail!("kubelet exited ({status})\n{}", self.log_tail());
            }
            let ready = cp.kubectl([
                "get",
                "node",
                &self.name,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ]);
            if ready.as_deref().is_ok_and(|s| s.trim() == "True") {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "node {} not Ready within {START_TIMEOUT:?} (last: {ready:?})\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(250));
        }
    }

    /// Stops every process of the node: kubelet first (politely), then everything in its cgroup
    /// tree, which ends the mount namespace.
    fn stop_all(&mut self) {
        if let Some(mut kubelet) = self.kubelet.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(kubelet.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && kubelet.try_wait().ok().flatten().is_none() {
                thread::sleep(Duration::from_millis(50));
            }
            let _ = kubelet.kill();
            let _ = kubelet.wait();
        }
        // cgroup.kill (cgroup2, 5.14+) kills the tree at once; SIGKILL by pid covers older kernels.
        for _ in 0..50 {
            let _ = fs::write(self.cgroup2.join("cgroup.kill"), "1");
            let pids = pids_in_tree(&self.cgroup2);
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            thread::sleep(Duration::from_millis(50));
        }
        for child in [self.containerd.take(), self.holder.take()].into_iter().flatten() {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for KubeletNode {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "node {} (dropped while panicking):\n{}",
                self.name,
                self.log_tail()
            );
        }
        self.stop_all();
        for cgroup in &self.cgroups {
            remove_cgroup_tree(cgroup);
            if let Some(parent) = cgroup.parent() {
                let _ = fs::remove_dir(parent);
            }
        }
        // The mount namespace is gone with its last process; its mounts may take a moment to be
        // released, after which the directory (images, containers' layers) can be removed.
        for _ in 0..50 {
            if fs::remove_dir_all(self.dir.path()).is_ok() {
                break;
            }
            thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The manifests as an operator deploys them, in `dir`: the folder copied, the documented edits
/// made, and this machine's one extra argument.
pub fn operator_manifests(dir: &Path, node: &KubeletNode) -> Result<()> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests");
    for entry in fs::read_dir(&src)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            fs::copy(entry.path(), dir.join(entry.file_name()))?;
        }
    }
    // manifests/README.md, "Deploying", step 2: the API server address and the cluster CIDR.
    let configmap = fs::read_to_string(dir.join("configmap.yaml"))?;
    anyhow::ensure!(
        configmap.contains("API_SERVER_HOST") && configmap.contains("clusterCIDR: 10.244.0.0/16")
    );
    let configmap = configmap
        .replace("API_SERVER_HOST", &ADVERTISE_ADDRESS.to_string())
        .replace(
            "clusterCIDR: 10.244.0.0/16",
            &format!("clusterCIDR: {CLUSTER_CIDR}"),
        );
    fs::write(dir.join("configmap.yaml"), configmap)?;
    // Step 2 again: the image, as `kustomize edit set image` writes it.
    let agent = image("lb-agent")?;
    let (name, tag) = agent
        .reference
        .rsplit_once(':')
        .context("an image reference with a tag")?;
    let mut kustomization = fs::read_to_string(dir.join("kustomization.yaml"))?;
    kustomization.push_str(&format!(
        "images:\n  - name: ghcr.io/lb-project/lb-agent\n    newName: {name}\n    newTag: {tag}\n"
    ));
    // This machine's hygiene: the node's cgroup, never the machine's root cgroup. Every node's
    // cgroup is named after the node (`lb-tests/<node>`), so one DaemonSet serves several nodes:
    // kubelet expands `$(NODE_NAME)` from the container's environment.
    let parent = node
        .cgroup2()
        .parent()
        .context("the node's cgroup has a parent")?;
    anyhow::ensure!(node.cgroup2().ends_with(node.name()));
    kustomization.push_str(&format!(
        "patches:\n  - target:\n      kind: DaemonSet\n      name: lb-agent\n    patch: |-\n      \
         - op: add\n        path: /spec/template/spec/containers/0/args/-\n        value: --cgroup-root={}/$(NODE_NAME)\n",
        parent.display()
    ));
    fs::write(dir.join("kustomization.yaml"), kustomization)?;
    Ok(())
}

/// Applies the agent's manifests as an operator does (`kubectl apply -k` of
/// [`operator_manifests`]); returns the folder applied.
pub fn apply_agent_manifests(cp: &ControlPlane, node: &KubeletNode) -> Result<tempfile::TempDir> {
    // Inside the node's directory, so that a killed run's copy goes with the node's sweep.
    let dir = tempfile::Builder::new()
        .prefix("manifests-")
        .tempdir_in(node.dir())?;
    operator_manifests(dir.path(), node)?;
    cp.kubectl(["apply", "-k", &dir.path().display().to_string()])?;
    Ok(dir)
}

/// The loads an operator flow on a node runs under: a client in the node's namespace and in a
/// cgroup below the node's (as a Pod's sockets are) to a ClusterIP on port 80 (socket path), and
/// a client outside to the node's NodePort (tc path).
pub struct NodeLoads {
    inside: crate::load::Load,
    outside: crate::load::Load,
}

impl NodeLoads {
    pub fn start(
        node: &KubeletNode,
        clients: &crate::cgroup::Cgroup,
        outside: &NetNs,
        cluster_ip: &str,
        node_port: u16,
        interval_ms: u64,
    ) -> NodeLoads {
        use crate::{load::Load, process::Place};
        NodeLoads {
            inside: Load::start(
                Place::new(node.netns(), clients),
                &format!("{cluster_ip}:80"),
                "tcp",
                interval_ms,
                false,
            ),
            outside: Load::start(
                Place::netns(outside),
                &format!("{}:{node_port}", node.ip()),
                "tcp",
                interval_ms,
                false,
            ),
        }
    }

    /// Stops both; each load's name and results.
    pub fn stop(self) -> [(&'static str, Vec<serde_json::Value>); 2] {
        [
            ("ClusterIP from the node (socket path)", self.inside.stop()),
            ("NodePort from outside (tc path)", self.outside.stop()),
        ]
    }
}

/// Polls `f` until it returns `Some`, failing after `timeout` with `what` and the last error.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            bail!("{what}: not within {timeout:?} (last error: {last})");
        }
        thread::sleep(Duration::from_millis(200));
    }
}

/// `kubectl <args> -o json`, parsed.
pub fn json_of(cp: &ControlPlane, args: &[&str]) -> Result<serde_json::Value> {
    let mut full = args.to_vec();
    full.extend(["-o", "json"]);
    Ok(serde_json::from_str(&cp.kubectl(full)?)?)
}

/// The Pods of a label selector.
pub fn pods(cp: &ControlPlane, namespace: &str, selector: &str) -> Result<Vec<serde_json::Value>> {
    let v = json_of(cp, &["-n", namespace, "get", "pods", "-l", selector])?;
    Ok(v["items"].as_array().cloned().unwrap_or_default())
}

/// Ready, and not being deleted.
pub fn is_ready(pod: &serde_json::Value) -> bool {
    pod["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
        && pod["metadata"]["deletionTimestamp"].is_null()
}

/// The bridge's (gateway's) address: the first of the range.
fn gateway_of(cidr: &str) -> Result<Ipv4Addr> {
    let (net, _) = cidr.split_once('/').context("a CIDR")?;
    let net: Ipv4Addr = net.parse().context("a CIDR's address")?;
    Ok(Ipv4Addr::from(u32::from(net) + 1))
}

fn toml_string(s: &str) -> String {
    // A TOML basic string is a JSON string for the characters paths use.
    serde_json::to_string(s).expect("a string serializes")
}

/// The cgroup hierarchies mounted on this machine: cgroup2 and every v1 hierarchy.
fn hierarchies() -> Vec<(PathBuf, bool)> {
    fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (_, point, fstype) = (f.next()?, f.next()?, f.next()?);
            match fstype {
                "cgroup2" => Some((PathBuf::from(point), true)),
                "cgroup" => Some((PathBuf::from(point), false)),
                _ => None,
            }
        })
        .collect()
}

/// Creates `lb-tests/<name>` in every hierarchy (kubelet's cgroupRoot must exist in each) and
/// `<cgroup2>/lb-tests/<name>/system` for the node's own processes. Returns the node's cgroup of
/// every hierarchy and its cgroup2 one.
fn make_cgroups(name: &str) -> Result<(Vec<PathBuf>, PathBuf)> {
    let mut made = Vec::new();
    let mut cgroup2 = None;
    for (mount, unified) in hierarchies() {
        let parent = mount.join(CGROUP_PARENT);
        let node = parent.join(name);
        fs::create_dir_all(&node).with_context(|| format!("creating {}", node.display()))?;
        // A new cpuset has no CPUs until given its parent's.
        for file in ["cpuset.cpus", "cpuset.mems"] {
            for dir in [&parent, &node] {
                let own = dir.join(file);
                if own.exists() && fs::read_to_string(&own).unwrap_or_default().trim().is_empty() {
                    let from = fs::read_to_string(mount.join(file)).unwrap_or_default();
                    let _ = fs::write(&own, from.trim());
                }
            }
        }
        if unified {
            // A unified host: kubelet needs the controllers delegated down to the node.
            let controllers = fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
            let enable: String = controllers.split_whitespace().map(|c| format!("+{c} ")).collect();
            if !enable.is_empty() {
                let _ = fs::write(parent.join("cgroup.subtree_control"), enable.trim());
                let _ = fs::write(node.join("cgroup.subtree_control"), enable.trim());
            }
            let system = node.join("system");
            fs::create_dir_all(&system).with_context(|| format!("creating {}", system.display()))?;
            cgroup2 = Some(node.clone());
        }
        made.push(node);
    }
    let cgroup2 = cgroup2.context("no cgroup2 mount (cgroup v2 is required)")?;
    Ok((made, cgroup2))
}

/// Every pid in a cgroup tree.
fn pids_in_tree(dir: &Path) -> Vec<i32> {
    let mut pids: Vec<i32> = fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            pids.extend(pids_in_tree(&entry.path()));
        }
    }
    pids
}

/// Removes a cgroup tree of any hierarchy, deepest first, killing what is left in it.
pub fn remove_cgroup_tree(dir: &Path) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroup_tree(&entry.path());
        }
    }
    for _ in 0..100 {
        for pid in pids_in_tree(dir) {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
}
