//! The node's configuration files: the CNI bridge network, containerd's config (version 3,
//! images imported, never pulled) and kubelet's `KubeletConfiguration`.

use std::{
    fs,
    net::{Ipv4Addr, Ipv6Addr},
    path::PathBuf,
};

use anyhow::{Context, Result};

use super::{KubeletNode, cgroups::CGROUP_PARENT};

impl KubeletNode {
    pub(super) fn write_config(&self) -> Result<()> {
        for sub in ["var-lib", "var-log", "run", "opt-containerd", "cni"] {
            fs::create_dir_all(self.path(sub))?;
        }
        let gateway = gateway_of(&self.pod_cidr)?;
        // The bridge plugin, as kubeadm's documentation and kind's first CNI: Pods on `cni0`,
        // which is their gateway; the node routes between the bridge and its uplink. No
        // masquerading: Pod addresses are routed on the LAN (as the netns nodes of `topo`). A
        // dual-stack node has a range of each family (two range sets: an address of each).
        let mut ranges = vec![serde_json::json!([{"subnet": self.pod_cidr, "gateway": gateway.to_string()}])];
        let mut routes = vec![serde_json::json!({"dst": "0.0.0.0/0"})];
        if let Some(v6) = &self.ipv6 {
            let gateway6 = gateway6_of(&v6.pod_cidr)?;
            ranges.push(serde_json::json!([{"subnet": v6.pod_cidr, "gateway": gateway6.to_string()}]));
            routes.push(serde_json::json!({"dst": "::/0"}));
        }
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
                        "ranges": ranges,
                        "routes": routes
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
}

/// The bridge's (gateway's) address: the first of the range.
pub fn gateway_of(cidr: &str) -> Result<Ipv4Addr> {
    let (net, _) = cidr.split_once('/').context("a CIDR")?;
    let net: Ipv4Addr = net.parse().context("a CIDR's address")?;
    Ok(Ipv4Addr::from(u32::from(net) + 1))
}

/// The bridge's (gateway's) IPv6 address: the first of the range.
pub fn gateway6_of(cidr: &str) -> Result<Ipv6Addr> {
    let net: ipnet::Ipv6Net = cidr.parse().context("an IPv6 CIDR")?;
    Ok(Ipv6Addr::from(u128::from(net.network()) + 1))
}

fn toml_string(s: &str) -> String {
    // A TOML basic string is a JSON string for the characters paths use.
    serde_json::to_string(s).expect("a string serializes")
}
