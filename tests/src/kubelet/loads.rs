//! The traffic an operator flow on a node runs under: a ClusterIP from inside the node (socket
//! path) and a NodePort from outside (tc path).

use super::KubeletNode;
use crate::netns::NetNs;

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
