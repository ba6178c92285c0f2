//! The [`KubeletNode`] guard: the node's namespace on the LAN with the API server forwarded
//! into it, its processes started in order, commands run inside it (`nsenter`, `ctr`), and
//! everything stopped and removed on drop.

use std::{
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::{
    API_PORT, Image, NodeParts,
    cgroups::{make_cgroups, remove_cgroup_tree},
};
use crate::{
    control_plane::{ADVERTISE_ADDRESS, ControlPlane},
    netns::{NetNs, PortForward},
    topo::Lan,
};

/// What makes one node.
pub struct NodeConfig {
    /// Its address on the LAN (192.168.50.0/24).
    pub ip: Ipv4Addr,
    /// The Pods' range on this node, e.g. `10.244.1.0/24`; its first address is the bridge's.
    pub pod_cidr: String,
    /// The cluster DNS Service's address kubelet writes into Pods' resolv.conf (kubelet's
    /// `clusterDNS`); `None`: Pods get the node's resolver.
    pub cluster_dns: Option<Ipv4Addr>,
    /// Makes the node dual-stack (IPv4 primary); `None`: IPv4 only.
    pub ipv6: Option<NodeIpv6>,
}

/// The IPv6 side of a dual-stack node: an address on the LAN beside the IPv4 one (kubelet's
/// `--node-ip` names both, so the Node has an InternalIP of each family), and a second Pod range
/// in the CNI bridge's IPAM, so every Pod gets an address of each family (`status.podIPs`), which
/// the EndpointSlice controller puts in the IPv4 and the IPv6 slices of dual-stack Services.
#[derive(Clone, Debug)]
pub struct NodeIpv6 {
    /// The node's IPv6 address on the LAN (a /64).
    pub ip: Ipv6Addr,
    /// The Pods' IPv6 range on this node, e.g. `fd00:10:244:3::/64`; its first address is the
    /// bridge's.
    pub pod_cidr: String,
}

/// A kubelet node; see the documentation of [`crate::kubelet`].
pub struct KubeletNode {
    pub(super) name: String,
    pub(super) ip: Ipv4Addr,
    pub(super) pod_cidr: String,
    pub(super) cluster_dns: Option<Ipv4Addr>,
    pub(super) ipv6: Option<NodeIpv6>,
    pub(super) parts: NodeParts,
    pub(super) kubelet_bin: PathBuf,
    pub(super) kubeconfig: PathBuf,
    /// The processes that hold the mount namespace, run the containers and the node.
    pub(super) holder: Option<Child>,
    pub(super) containerd: Option<Child>,
    pub(super) kubelet: Option<Child>,
    /// `<hierarchy>/lb-tests/<name>` for every cgroup hierarchy.
    pub(super) cgroups: Vec<PathBuf>,
    /// The cgroup2 directory of the node (`--cgroup-root` for the socket programs).
    pub(super) cgroup2: PathBuf,
    pub(super) _forwards: Vec<PortForward>,
    // Dropped after the processes and before the directory.
    pub(super) ns: NetNs,
    pub(super) dir: tempfile::TempDir,
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
        if let Some(v6) = &config.ipv6 {
            // Forwarding between the bridge and the uplink, and IPv6 addresses usable at once:
            // no duplicate address detection on the uplink nor on the bridge the CNI plugin
            // creates (its gateway address; the plugin already turns it off inside Pods).
            for setting in [
                "net.ipv6.conf.all.forwarding=1",
                "net.ipv6.conf.all.accept_dad=0",
                "net.ipv6.conf.default.accept_dad=0",
            ] {
                ns.sysctl(setting);
            }
            ns.ip(&[
                "-6",
                "addr",
                "add",
                &format!("{}/64", v6.ip),
                "dev",
                "eth0",
                "nodad",
            ]);
        }
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
        let mut nets = vec![ipnet::IpNet::from(IpAddr::from(config.ip)), pods];
        if let Some(v6) = &config.ipv6 {
            nets.push(IpAddr::from(v6.ip).into());
            nets.push(v6.pod_cidr.parse().context("the node's IPv6 Pod range")?);
        }
        for net in nets {
            cp.route_to_node(net, ns.path());
        }
        let (cgroups, cgroup2) = make_cgroups(&name)?;
        let mut node = KubeletNode {
            name,
            ip: config.ip,
            pod_cidr: config.pod_cidr,
            cluster_dns: config.cluster_dns,
            ipv6: config.ipv6,
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

    /// The node's IPv6 address and Pod range, on a dual-stack node.
    pub fn ipv6(&self) -> Option<&NodeIpv6> {
        self.ipv6.as_ref()
    }

    /// The node's addresses, IPv4 first (kubelet's `--node-ip`).
    pub fn ips(&self) -> Vec<IpAddr> {
        let mut ips = vec![IpAddr::from(self.ip)];
        ips.extend(self.ipv6.as_ref().map(|v6| IpAddr::from(v6.ip)));
        ips
    }

    /// The cluster CIDR(s) the agent on this node is told, one per family of the node.
    pub fn cluster_cidr(&self) -> String {
        match self.ipv6 {
            Some(_) => format!("{},{}", super::CLUSTER_CIDR, super::CLUSTER_CIDR6),
            None => super::CLUSTER_CIDR.to_string(),
        }
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

    pub(super) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
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
