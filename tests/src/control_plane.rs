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

use std::{
    env,
    ffi::OsStr,
    fs::{self, File, OpenOptions},
    io::{Read, Seek, SeekFrom, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// The cache directory `cargo xtask k8s-bins` fills (`xtask/src/k8s.rs`, KUBERNETES_VERSION).
const CACHED_BIN_DIR: &str = "k8s-v1.37.1/bin";
/// How long etcd and kube-apiserver may take to become ready (override: LB_CONTROL_PLANE_TIMEOUT_SECS).
const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a process gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// The Service CIDR; its first address is the `kubernetes` Service's ClusterIP.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// kube-controller-manager's flags besides its kubeconfig and key files.
const KCM_ARGS: &[&str] = &[
    "--leader-elect=false",
    // No serving port: two control planes may run at once.
    "--secure-port=0",
    "--profiling=false",
    // Pod IP ranges come from the nodes' CNI configuration, not from node IPAM; the CSR
    // controllers need a signing CA that nothing here uses.
    "--controllers=*,-nodeipam,-csrsigning,-csrapproving,-csrcleaner",
    "--use-service-account-credentials=false",
    // Quicker than a fleet's defaults (40 s), so a stopped node is noticed within a test.
    "--node-monitor-grace-period=20s",
];
/// Lines of each log that errors and [`ControlPlane::log_tail`] show.
const TAIL_LINES: usize = 40;
/// Attempts at starting when a free port picked for etcd or kube-apiserver was taken meanwhile.
const PORT_ATTEMPTS: usize = 3;

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

    /// The API server's egress to the nodes' kubelets: an HTTP CONNECT proxy on a Unix socket
    /// (`--egress-selector-config-file`, kind `cluster`), through which `kubectl logs`, `exec` and
    /// `port-forward` reach kubelets inside their namespaces (see [`ControlPlane::route_to_node`]).
    fn start_egress(&mut self) -> Result<()> {
        let socket = self.dir.path().join("egress.sock");
        let proxy = crate::netns::ConnectProxy::start(&socket).context("starting the egress proxy")?;
        let config = format!(
            "apiVersion: apiserver.k8s.io/v1beta1\n\
             kind: EgressSelectorConfiguration\n\
             egressSelections:\n\
             - name: cluster\n  \
               connection:\n    \
                 proxyProtocol: HTTPConnect\n    \
                 transport:\n      \
                   uds:\n        \
                     udsName: {}\n",
            socket.display()
        );
        fs::write(self.dir.path().join("egress.yaml"), config)?;
        self.egress = Some(proxy);
        Ok(())
    }

    /// Routes the API server's connections to the addresses of `net` (a node's address: its
    /// kubelet; its Pod range: `pods/proxy`, `services/proxy`) through the node's namespace.
    pub fn route_to_node(&self, net: ipnet::IpNet, netns: PathBuf) {
        if let Some(proxy) = &self.egress {
            proxy.route(net, netns);
        }
    }

    /// kube-controller-manager and kube-scheduler with the admin kubeconfig, no serving port (two
    /// control planes may run at once), no leader election.
    fn start_controllers(&mut self) -> Result<()> {
        let kubeconfig = format!("--kubeconfig={}", self.kubeconfig.display());
        let log = self.dir.path().join("kube-controller-manager.log");
        let child = spawn_logged(
            Command::new(&self.bins.kube_controller_manager)
                .arg(&kubeconfig)
                .args(KCM_ARGS)
                .arg(format!("--root-ca-file={}", self.pki("ca.crt").display()))
                .arg(format!(
                    "--service-account-private-key-file={}",
                    self.pki("sa.key").display()
                ))
                .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}")),
            &log,
            "kube-controller-manager",
        )?;
        self.controllers.push((child, "kube-controller-manager"));
        let log = self.dir.path().join("kube-scheduler.log");
        let child = spawn_logged(
            Command::new(&self.bins.kube_scheduler).arg(&kubeconfig).args([
                "--leader-elect=false",
                "--secure-port=0",
                "--profiling=false",
            ]),
            &log,
            "kube-scheduler",
        )?;
        self.controllers.push((child, "kube-scheduler"));
        // Ready when the ServiceAccounts controller has made `default` in `default` (the admission
        // plugin rejects Pods until then) and the root CA is published (Pods mount it).
        let deadline = Instant::now() + self.ready_timeout;
        loop {
            if let Some(exited) = self.exited_controller() {
                bail!("{exited} at start\n{}", self.log_tail());
            }
            let sa = self.kubectl(["-n", "default", "get", "serviceaccount", "default", "-o", "name"]);
            let ca = self.kubectl([
                "-n",
                "default",
                "get",
                "configmap",
                "kube-root-ca.crt",
                "-o",
                "name",
            ]);
            if sa.is_ok() && ca.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-controller-manager made no default ServiceAccount within {:?}\n{}",
                    self.ready_timeout,
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(250));
        }
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

    /// Kills kube-apiserver (SIGKILL: an outage is abrupt, and a graceful stop waits on every open
    /// watch) while etcd keeps running, to simulate an API outage. Blocking. A no-op when it is
    /// not running.
    pub fn stop_apiserver(&mut self) {
        if let Some(mut child) = self.apiserver.take() {
            let _ = child.kill();
            let _ = child.wait();
            append_marker(&self.apiserver_log(), "stopped by ControlPlane::stop_apiserver");
        }
    }

    /// Starts kube-apiserver (again) on the same port and waits until it is ready. Blocking. A
    /// no-op when it is running.
    pub fn start_apiserver(&mut self) -> Result<()> {
        if self.apiserver.is_some() {
            return Ok(());
        }
        let log = self.apiserver_log();
        let child = spawn_logged(
            Command::new(&self.bins.kube_apiserver).args(self.apiserver_args()),
            &log,
            "kube-apiserver",
        )?;
        self.apiserver = Some(child);
        let deadline = Instant::now() + self.ready_timeout;
        let mut last_error = String::new();
        loop {
            if let Some(status) = self.apiserver.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.apiserver = None;
                bail!(
                    "kube-apiserver exited ({status}) before becoming ready\n{}",
                    self.log_tail()
                );
            }
            if let Some(status) = self.etcd.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.etcd = None;
                bail!(
                    "etcd exited ({status}) while kube-apiserver was starting\n{}",
                    self.log_tail()
                );
            }
            // Only ask kubectl once something listens, to keep the polling cheap.
            if port_open(self.apiserver_port) {
                match self.kubectl(["get", "--raw", "/readyz"]) {
                    Ok(out) if out.trim() == "ok" => return Ok(()),
                    Ok(out) => last_error = out,
                    Err(e) => last_error = format!("{e:#}"),
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver not ready at {} after {:?} (last /readyz: {})\n{}",
                    self.server_url(),
                    self.ready_timeout,
                    last_error.trim(),
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(250));
        }
    }

    /// "<name> exited (<status>)" for the first controller that is no longer running.
    pub fn exited_controller(&mut self) -> Option<String> {
        self.controllers.iter_mut().find_map(|(child, what)| {
            child
                .try_wait()
                .ok()
                .flatten()
                .map(|status| format!("{what} exited ({status})"))
        })
    }

    /// Whether kube-apiserver is running (started and not stopped).
    pub fn apiserver_running(&self) -> bool {
        self.apiserver.is_some()
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

    fn write_pki_and_kubeconfig(&self) -> Result<()> {
        let pki = self.dir.path().join("pki");
        fs::create_dir_all(&pki)?;

        let mut ca_params = CertificateParams::default();
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "lb-test-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate()?;
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::from_params(&ca_params, &ca_key);

        let mut serving = CertificateParams::new(
            [
                "127.0.0.1",
                "10.96.0.1",
                "172.31.255.1",
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ]
            .map(String::from)
            .to_vec(),
        )?;
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        serving.use_authority_key_identifier_extension = true;
        let serving_key = KeyPair::generate()?;
        let serving_cert = serving.signed_by(&serving_key, &issuer)?;

        let mut admin = CertificateParams::default();
        admin.distinguished_name.push(DnType::CommonName, "lb-admin");
        admin
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        admin.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        admin.use_authority_key_identifier_extension = true;
        let admin_key = KeyPair::generate()?;
        let admin_cert = admin.signed_by(&admin_key, &issuer)?;

        // ECDSA P-256 (ES256) service-account token signing key.
        let sa_key = KeyPair::generate()?;

        for (name, contents) in [
            ("ca.crt", ca_cert.pem()),
            ("apiserver.crt", serving_cert.pem()),
            ("apiserver.key", serving_key.serialize_pem()),
            ("admin.crt", admin_cert.pem()),
            ("admin.key", admin_key.serialize_pem()),
            ("sa.key", sa_key.serialize_pem()),
            ("sa.pub", sa_key.public_key_pem()),
        ] {
            write_private(&pki.join(name), contents.as_bytes())?;
        }

        // Strings are JSON-quoted, which YAML reads as plain strings.
        let q = |p: PathBuf| serde_json::to_string(&p.display().to_string()).expect("a string serializes");
        let kubeconfig = format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: lb-test\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n\
             users:\n\
             - name: lb-admin\n  user:\n    client-certificate: {cert}\n    client-key: {key}\n\
             contexts:\n\
             - name: lb-test\n  context:\n    cluster: lb-test\n    user: lb-admin\n    namespace: default\n\
             current-context: lb-test\n",
            server = serde_json::to_string(&self.server_url())?,
            ca = q(self.pki("ca.crt")),
            cert = q(self.pki("admin.crt")),
            key = q(self.pki("admin.key")),
        );
        write_private(&self.kubeconfig, kubeconfig.as_bytes())
    }

    fn start_etcd(&mut self) -> Result<()> {
        let client = self.etcd_url();
        let peer = format!("http://127.0.0.1:{}", self.etcd_peer_port);
        let mut cmd = Command::new(&self.bins.etcd);
        cmd.arg("--name=lb-test")
            .arg(format!(
                "--data-dir={}",
                self.dir.path().join("etcd-data").display()
            ))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=lb-test={peer}"))
            .arg("--initial-cluster-state=new")
            // A throw-away store: skip fsync, it dominates latency on slow disks.
            .arg("--unsafe-no-fsync=true")
            .arg("--log-level=warn");
        // ETCD_* variables of the caller's environment would override the flags above.
        for (key, _) in env::vars_os() {
            if key.to_string_lossy().starts_with("ETCD_") {
                cmd.env_remove(key);
            }
        }
        self.etcd = Some(spawn_logged(&mut cmd, &self.etcd_log(), "etcd")?);
        let deadline = Instant::now() + self.ready_timeout;
        loop {
            if let Some(status) = self.etcd.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.etcd = None;
                bail!(
                    "etcd exited ({status}) before becoming healthy\n{}",
                    self.log_tail()
                );
            }
            if etcd_healthy(self.etcd_client_port) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "etcd not healthy at {client} after {:?}\n{}",
                    self.ready_timeout,
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    fn apiserver_args(&self) -> Vec<String> {
        let pki = |name: &str| self.pki(name).display().to_string();
        let mut args = vec![
            format!("--etcd-servers={}", self.etcd_url()),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", self.apiserver_port),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
            "--authorization-mode=Node,RBAC".into(),
            format!("--client-ca-file={}", pki("ca.crt")),
            format!("--tls-cert-file={}", pki("apiserver.crt")),
            format!("--tls-private-key-file={}", pki("apiserver.key")),
            // Self-signed fallbacks would otherwise go to /var/run/kubernetes.
            format!("--cert-dir={}", self.dir.path().join("apiserver-certs").display()),
            format!("--service-account-key-file={}", pki("sa.pub")),
            format!("--service-account-signing-key-file={}", pki("sa.key")),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            "--allow-privileged=true".into(),
            "--profiling=false".into(),
        ];
        if self.with_controllers {
            // As in a cluster: the `kubernetes` Service's endpoint is the advertised address
            // (reached inside the nodes through their forward), Pods get ServiceAccount tokens.
            args.push(format!("--advertise-address={ADVERTISE_ADDRESS}"));
            args.push(format!(
                "--egress-selector-config-file={}",
                self.dir.path().join("egress.yaml").display()
            ));
            args.push("--kubelet-preferred-address-types=InternalIP".into());
        } else {
            args.extend([
                "--advertise-address=127.0.0.1".into(),
                // No controller-manager runs, so no namespace gets its `default` ServiceAccount:
                // the ServiceAccount admission plugin would reject every Pod created in a new
                // namespace.
                "--disable-admission-plugins=ServiceAccount".into(),
                // The advertise address is loopback, which Endpoints and EndpointSlices may not
                // hold: the reconciler of the `kubernetes` Service's endpoints would fail forever
                // (the Service itself is still created). Upstream's test server does the same.
                "--endpoint-reconciler-type=none".into(),
            ]);
        }
        args
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

/// Spawns `cmd` with stdout and stderr appended to `log`.
fn spawn_logged(cmd: &mut Command, log: &Path, what: &str) -> Result<Child> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .spawn()
        .with_context(|| format!("cannot start {what} ({cmd:?})"))?;
    Ok(child)
}

/// SIGTERM, then SIGKILL after [`STOP_GRACE`]; always reaps the child.
fn stop(mut child: Child, what: &str) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    let pid = Pid::from_raw(child.id() as i32);
    if kill(pid, Signal::SIGTERM).is_ok() {
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        eprintln!("control plane: {what} ignored SIGTERM for {STOP_GRACE:?}; killing it");
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn append_marker(log: &Path, text: &str) {
    if let Ok(mut f) = OpenOptions::new().append(true).open(log) {
        let _ = writeln!(f, "==== {text} ====");
    }
}

/// Writes a file readable by its owner only (keys; harmless for the rest).
fn write_private(path: &Path, contents: &[u8]) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(contents)
        .with_context(|| format!("writing {}", path.display()))
}

/// Distinct free TCP ports on 127.0.0.1 (all held until all are picked).
fn free_ports<const N: usize>() -> Result<[u16; N]> {
    let listeners = (0..N)
        .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .collect::<std::io::Result<Vec<_>>>()
        .context("binding 127.0.0.1:0 to find free ports")?;
    let ports = listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<std::io::Result<Vec<_>>>()?;
    ports.try_into().map_err(|_| anyhow!("port count mismatch"))
}

fn port_open(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

/// `GET /health` on etcd's client port says `"health":"true"`.
fn etcd_healthy(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(
        &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        Duration::from_millis(200),
    ) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.starts_with("HTTP/1.1 200") && response.contains(r#""health":"true""#)
}

/// The last `lines` lines of a (possibly large) log file.
fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(64 * 1024);
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(start)).is_err() || f.read_to_end(&mut buf).is_err() {
        return format!("(cannot read {})", path.display());
    }
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
