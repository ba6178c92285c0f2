//! The agent's manifests as an operator deploys them on a node: `manifests/` copied, the
//! documented edits made, this machine's one extra argument added, and `kubectl apply -k`.

use std::{fs, path::Path};

use anyhow::{Context, Result};

use super::{KubeletNode, image};
use crate::control_plane::{ADVERTISE_ADDRESS, ControlPlane};

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
    // manifests/README.md, "Deploying", step 2: the API server address and the cluster CIDR (one
    // per family of the node: a dual-stack node's agent detects local traffic of both).
    let configmap = fs::read_to_string(dir.join("configmap.yaml"))?;
    anyhow::ensure!(
        configmap.contains("API_SERVER_HOST") && configmap.contains("clusterCIDR: 10.244.0.0/16")
    );
    let configmap = configmap
        .replace("API_SERVER_HOST", &ADVERTISE_ADDRESS.to_string())
        .replace(
            "clusterCIDR: 10.244.0.0/16",
            &format!("clusterCIDR: {}", node.cluster_cidr()),
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
