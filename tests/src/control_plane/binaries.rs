//! Where the control plane's binaries are: `LB_K8S_BIN_DIR`, else the cache `cargo xtask
//! k8s-bins` fills.

use std::{env, path::PathBuf};

use anyhow::{Result, bail};

/// The cache directory `cargo xtask k8s-bins` fills (`xtask/src/k8s.rs`, KUBERNETES_VERSION).
const CACHED_BIN_DIR: &str = "k8s-v1.37.1/bin";

/// The binaries the control plane runs.
#[derive(Clone, Debug)]
pub struct Binaries {
    pub dir: PathBuf,
    pub etcd: PathBuf,
    pub kube_apiserver: PathBuf,
    pub kubectl: PathBuf,
    pub kube_proxy: PathBuf,
    pub kube_controller_manager: PathBuf,
    pub kube_scheduler: PathBuf,
    pub kubelet: PathBuf,
}

impl Binaries {
    /// `LB_K8S_BIN_DIR`, else the cache `cargo xtask k8s-bins` fills (`$LB_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/lb`, else `~/.cache/lb`); fails naming that command when one is missing.
    pub fn locate() -> Result<Self> {
        let (dir, origin) = match env::var_os("LB_K8S_BIN_DIR") {
            Some(dir) => (PathBuf::from(dir), "LB_K8S_BIN_DIR"),
            None => (
                cache_dir().join(CACHED_BIN_DIR),
                "the cache of `cargo xtask k8s-bins`",
            ),
        };
        let bins = Self {
            etcd: dir.join("etcd"),
            kube_apiserver: dir.join("kube-apiserver"),
            kubectl: dir.join("kubectl"),
            kube_proxy: dir.join("kube-proxy"),
            kube_controller_manager: dir.join("kube-controller-manager"),
            kube_scheduler: dir.join("kube-scheduler"),
            kubelet: dir.join("kubelet"),
            dir,
        };
        for bin in [
            &bins.etcd,
            &bins.kube_apiserver,
            &bins.kubectl,
            &bins.kube_proxy,
            &bins.kube_controller_manager,
            &bins.kube_scheduler,
            &bins.kubelet,
        ] {
            if !bin.is_file() {
                bail!(
                    "{} is missing (looked in {}, from {origin}); build the control-plane binaries with \
                     `cargo xtask k8s-bins` (once, about 15 minutes) or run the tests through `cargo xtask e2e`",
                    bin.display(),
                    bins.dir.display()
                );
            }
        }
        Ok(bins)
    }
}

/// Same rule as xtask's `util::cache_dir`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = env::var_os("LB_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/var/cache"))
        .join("lb")
}
