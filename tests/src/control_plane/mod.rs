//! A real etcd and kube-apiserver on loopback, for the end-to-end tests, the sandbox and the
//! benchmarks; with [`ControlPlane::start_with_controllers`] also kube-controller-manager and
//! kube-scheduler, for clusters with real nodes (`crate::kubelet`).
//!
//! [`ControlPlane::start`] generates a CA, a serving certificate, an admin client certificate
//! (`O=system:masters`) and a service-account key with `rcgen`, starts etcd and kube-apiserver on
//! free 127.0.0.1 ports with their data and logs in a temporary directory, waits for `/readyz`
//! and writes an admin kubeconfig. Dropping the guard stops both processes (SIGTERM, SIGKILL after
//! a grace period) and removes the directory, also when the test panics.
//!
//! The binaries come from `cargo xtask k8s-bins` (built once from their Go modules): the directory
//! in `LB_K8S_BIN_DIR`, which `cargo xtask test`/`e2e` set, else the cache that command fills.
//!
//! The files: `binaries` (where the binaries are), `pki` (the certificates, keys and admin
//! kubeconfig), `servers` (etcd and kube-apiserver: flags, start, readiness, the API outage),
//! `controllers` (kube-controller-manager, kube-scheduler, and the API server's egress into the
//! nodes), `process` (the children: started with their logs, stopped, their logs' tails).

mod binaries;
mod controllers;
mod pki;
mod process;
mod servers;

use std::{
    env,
    ffi::OsStr,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context, Result, bail};

pub use self::binaries::{Binaries, cache_dir};
use self::{
    process::{stop, tail},
    servers::free_ports,
};

/// How long etcd and kube-apiserver may take to become ready (override: LB_CONTROL_PLANE_TIMEOUT_SECS).
const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// The Service CIDR; its first address is the `kubernetes` Service's ClusterIP.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The IPv6 Service CIDR: every control plane is dual-stack, IPv4 first (the primary family,
/// which Services without `ipFamilies` get), as `--service-cluster-ip-range` with one range per
/// family makes it.
pub const SERVICE_CIDR6: &str = "fd00:10:96::/112";
/// Lines of each log that errors and [`ControlPlane::log_tail`] show.
const TAIL_LINES: usize = 40;
/// Attempts at starting when a free port picked for etcd or kube-apiserver was taken meanwhile.
const PORT_ATTEMPTS: usize = 3;

/// The address the API server advertises when the controllers run (the `kubernetes` Service's
/// endpoint): not routable on the machine, it exists only inside the namespaces of the real nodes,
/// where a forward on it reaches the API server on loopback (`crate::kubelet`).
pub const ADVERTISE_ADDRESS: Ipv4Addr = Ipv4Addr::new(172, 31, 255, 1);

/// A running etcd and kube-apiserver on loopback (and, for clusters with nodes, the controllers);
/// stopped and cleaned up on drop.
pub struct ControlPlane {
    bins: Binaries,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    /// kube-controller-manager and kube-scheduler, when started with the controllers.
    controllers: Vec<(Child, &'static str)>,
    /// The API server's way to kubelets (logs, exec), when started with the controllers.
    egress: Option<crate::netns::ConnectProxy>,
    with_controllers: bool,
    etcd_client_port: u16,
    etcd_peer_port: u16,
    apiserver_port: u16,
    kubeconfig: PathBuf,
    ready_timeout: Duration,
    // Last, so it is removed after Drop::drop has stopped the processes that write into it.
    dir: tempfile::TempDir,
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver and waits until the apiserver is ready. Blocking; call it
    /// through `tokio::task::spawn_blocking` from async code.
    pub fn start() -> Result<Self> {
        Self::start_mode(false)
    }

    /// Like [`ControlPlane::start`], plus kube-controller-manager (EndpointSlices, Deployments,
    /// ReplicaSets, DaemonSets, ServiceAccounts, garbage collection, ...) and kube-scheduler; the
    /// API server then runs as in a real cluster: the ServiceAccount admission plugin on, and the
    /// `kubernetes` Service's endpoints kept at [`ADVERTISE_ADDRESS`]. Blocking.
    pub fn start_with_controllers() -> Result<Self> {
        Self::start_mode(true)
    }

    fn start_mode(with_controllers: bool) -> Result<Self> {
        let bins = Binaries::locate()?;
        let mut attempt = 1;
        loop {
            match Self::start_once(&bins, with_controllers) {
                Err(e) if attempt < PORT_ATTEMPTS && format!("{e:#}").contains("address already in use") => {
                    eprintln!(
                        "control plane: a picked port was taken meanwhile, retrying with new ports ({e:#})"
                    );
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    fn start_once(bins: &Binaries, with_controllers: bool) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("lb-control-plane-")
            .tempdir()
            .context("creating a temp dir")?;
        let [etcd_client_port, etcd_peer_port, apiserver_port] = free_ports()?;
        let ready_timeout = env::var("LB_CONTROL_PLANE_TIMEOUT_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .map(Duration::from_secs)
            .unwrap_or(DEFAULT_READY_TIMEOUT);
        let mut cp = ControlPlane {
            bins: bins.clone(),
            etcd: None,
            apiserver: None,
            controllers: Vec::new(),
            egress: None,
            with_controllers,
            etcd_client_port,
            etcd_peer_port,
            apiserver_port,
            kubeconfig: dir.path().join("admin.kubeconfig"),
            ready_timeout,
            dir,
        };
        // From here on, an error drops `cp`, which stops whatever was started.
        cp.write_pki_and_kubeconfig()?;
        if with_controllers {
            cp.start_egress()?;
        }
        cp.start_etcd()?;
        cp.start_apiserver()?;
        if with_controllers {
            cp.start_controllers()?;
        }
        Ok(cp)
    }

    /// The admin kubeconfig (user `lb-admin` in `system:masters`; certificate files next to it).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// `https://127.0.0.1:<port>`.
    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.apiserver_port)
    }

    /// etcd's client URL (plain http on loopback).
    pub fn etcd_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.etcd_client_port)
    }

    /// The temporary directory holding certificates, the kubeconfig, etcd's data and the logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The binaries in use (kube-proxy included, for the benchmarks).
    pub fn binaries(&self) -> &Binaries {
        &self.bins
    }

    /// Runs the built kubectl against this control plane and returns its stdout; fails with its
    /// stderr. Blocking.
    pub fn kubectl<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new(&self.bins.kubectl);
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            // Discovery cache inside the temp dir, not in ~/.kube.
            .arg("--cache-dir")
            .arg(self.dir.path().join("kubectl-cache"))
            .args(args)
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null());
        let out = cmd
            .output()
            .with_context(|| format!("cannot start {}", self.bins.kubectl.display()))?;
        if !out.status.success() {
            bail!(
                "{cmd:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// A kube client for the admin kubeconfig.
    pub async fn client(&self) -> Result<kube::Client> {
        // kube's rustls needs a process-wide crypto provider; ours is ring. Harmless when one is set.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let kubeconfig = kube::config::Kubeconfig::read_from(&self.kubeconfig)
            .with_context(|| format!("reading {}", self.kubeconfig.display()))?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
                .await
                .context("loading the admin kubeconfig")?;
        kube::Client::try_from(config).context("building a kube client")
    }

    /// The last lines of the kube-apiserver and etcd logs.
    pub fn log_tail(&self) -> String {
        let mut controllers = String::new();
        for (_, what) in &self.controllers {
            let log = self.dir.path().join(format!("{what}.log"));
            controllers.push_str(&format!(
                "\n--- {what} log ({}), last lines:\n{}",
                log.display(),
                tail(&log, TAIL_LINES)
            ));
        }
        format!(
            "--- kube-apiserver log ({}), last lines:\n{}\n--- etcd log ({}), last lines:\n{}{controllers}",
            self.apiserver_log().display(),
            tail(&self.apiserver_log(), TAIL_LINES),
            self.etcd_log().display(),
            tail(&self.etcd_log(), TAIL_LINES)
        )
    }

    fn apiserver_log(&self) -> PathBuf {
        self.dir.path().join("kube-apiserver.log")
    }

    fn etcd_log(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn pki(&self, name: &str) -> PathBuf {
        self.dir.path().join("pki").join(name)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "control plane at {} (dropped while panicking):\n{}",
                self.server_url(),
                self.log_tail()
            );
        }
        for (child, what) in self.controllers.drain(..) {
            stop(child, what);
        }
        if let Some(child) = self.apiserver.take() {
            stop(child, "kube-apiserver");
        }
        if let Some(child) = self.etcd.take() {
            stop(child, "etcd");
        }
        // `dir` (a TempDir) is removed when the fields drop, right after this.
    }
}
