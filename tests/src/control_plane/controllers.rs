//! What a cluster with real nodes adds to etcd and kube-apiserver: kube-controller-manager and
//! kube-scheduler, and the API server's egress (an HTTP CONNECT proxy) into the nodes'
//! namespaces, through which it reaches their kubelets and Pods.

use std::{
    fs,
    path::PathBuf,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::{ControlPlane, SERVICE_CIDR, SERVICE_CIDR6, process::spawn_logged};

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

impl ControlPlane {
    /// The API server's egress to the nodes' kubelets: an HTTP CONNECT proxy on a Unix socket
    /// (`--egress-selector-config-file`, kind `cluster`), through which `kubectl logs`, `exec` and
    /// `port-forward` reach kubelets inside their namespaces (see [`ControlPlane::route_to_node`]).
    pub(super) fn start_egress(&mut self) -> Result<()> {
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
    pub(super) fn start_controllers(&mut self) -> Result<()> {
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
                .arg(format!(
                    "--service-cluster-ip-range={SERVICE_CIDR},{SERVICE_CIDR6}"
                )),
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
}
