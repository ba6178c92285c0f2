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
//!
//! The files: `parts` (containerd, runc and the CNI plugins of `cargo xtask node-parts`),
//! `archives` (the images of `cargo xtask images`), `node` (the [`KubeletNode`] guard),
//! `processes` (the holder of the mount namespace, containerd, kubelet; stopping them),
//! `config` (the CNI, containerd and kubelet configuration files), `cgroups` (the node's cgroups
//! in every hierarchy), `operator` (the agent's manifests applied as an operator does), `loads`
//! (traffic on a node), `query` (polling the cluster through kubectl).
//!
//! [`ADVERTISE_ADDRESS`]: crate::control_plane::ADVERTISE_ADDRESS
//! [`ControlPlane`]: crate::control_plane::ControlPlane
//! [`Lan`]: crate::topo::Lan

mod archives;
mod cgroups;
mod config;
mod loads;
mod node;
mod operator;
mod parts;
mod processes;
mod query;

pub use self::{
    archives::{Image, image, images, images_in},
    cgroups::remove_cgroup_tree,
    config::{gateway_of, gateway6_of},
    loads::NodeLoads,
    node::{KubeletNode, NodeConfig, NodeIpv6},
    operator::{apply_agent_manifests, operator_manifests},
    parts::NodeParts,
    query::{is_ready, json_of, pods, wait_for},
};

/// The port of the control-plane endpoint inside a node (kubeadm's default).
pub const API_PORT: u16 = 6443;
/// The cluster CIDR the deployed agent is told (every node's Pod range is inside it).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The IPv6 cluster CIDR, told besides [`CLUSTER_CIDR`] on a dual-stack node ([`NodeIpv6`]):
/// every node's IPv6 Pod range is inside it (`fd00:10:244:<node>::/64`, as in `crate::topo`).
pub const CLUSTER_CIDR6: &str = "fd00:10:244::/48";
