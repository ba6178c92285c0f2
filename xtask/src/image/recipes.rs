//! What each image of `cargo xtask images` is made of (lb-agent, lb-probe, pause, kube-proxy):
//! references, the program, the host tools copied beside it, entrypoint, command and user; and
//! the check that this machine is the release the lb-agent image stands in for.

use std::{fs, path::PathBuf};

use anyhow::{Result, bail};

use crate::util::workspace_root;

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
        // Without --name it answers with its host name: the pod's name. On `[::]`, a dual-stack
        // socket: a dual-stack Pod answers on both families (IPv4 clients are reported as IPv4).
        cmd: &["serve", "--tcp", "[::]:8080", "--udp", "[::]:5353"],
        user: "0",
        base: None,
    }
}

/// `binary`: the static pause built by [`build_pause`](super::build_pause).
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

/// `binary`: the kube-proxy of `cargo xtask k8s-bins` (static,
/// [`KUBERNETES_VERSION`](crate::k8s::KUBERNETES_VERSION)).
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

/// Fails unless this machine runs the Debian release `base` (`debian:bookworm-slim`) names.
pub(super) fn check_host_release(base: &str) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::KUBERNETES_VERSION;

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
    fn host_release_check_names_the_base() {
        let err = check_host_release("debian:no-such-release-slim")
            .unwrap_err()
            .to_string();
        assert!(err.contains("no-such-release"), "{err}");
    }
}
