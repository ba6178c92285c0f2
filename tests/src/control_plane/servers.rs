//! etcd and kube-apiserver: their flags, their start on free loopback ports and the wait for
//! their health and `/readyz`, and stopping and restarting kube-apiserver (an API outage) and etcd.

use std::{
    env,
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};

use super::{
    ADVERTISE_ADDRESS, ControlPlane, SERVICE_CIDR, SERVICE_CIDR6,
    process::{append_marker, spawn_logged},
};

impl ControlPlane {
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

    /// Kills etcd (SIGKILL) and starts it again on the same data and ports, waiting until it is
    /// healthy; kube-apiserver keeps running and reconnects. Blocking.
    pub fn restart_etcd(&mut self) -> Result<()> {
        if let Some(mut child) = self.etcd.take() {
            let _ = child.kill();
            let _ = child.wait();
            append_marker(&self.etcd_log(), "killed by ControlPlane::restart_etcd");
        }
        self.start_etcd()
    }

    /// Whether kube-apiserver is running (started and not stopped).
    pub fn apiserver_running(&self) -> bool {
        self.apiserver.is_some()
    }

    pub(super) fn start_etcd(&mut self) -> Result<()> {
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
            format!("--service-cluster-ip-range={SERVICE_CIDR},{SERVICE_CIDR6}"),
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

/// Distinct free TCP ports on 127.0.0.1 (all held until all are picked).
pub(super) fn free_ports<const N: usize>() -> Result<[u16; N]> {
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
