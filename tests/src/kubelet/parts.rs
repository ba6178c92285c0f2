//! The node's parts besides kubelet: containerd, its shim, `ctr`, runc and the CNI plugins,
//! where `cargo xtask node-parts` put them.

use std::{env, path::PathBuf};

use anyhow::{Result, bail};

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
