//! The traffic: a flow per (Service frontend, client), each an `lb-probe load` process whose
//! results a thread tallies per backend; the example Services' flows started once they answer,
//! and the Services created or deleted while the sandbox runs followed from the real node. A
//! dual-stack Service has frontends of both families: a cluster IP of each, its NodePorts on the
//! nodes' addresses of each; each is called from a client of its family.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    process::{Command, Stdio},
    sync::{Arc, Mutex, atomic::Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, ListParams};
use lb_tests::{
    kubelet,
    process::{Place, Proc, workspace_bin},
};

use crate::{
    cluster::{Cluster, of_family},
    stop::{STOP, say, step},
};

/// A traffic flow: one `lb-probe load` process and what it saw.
pub(crate) struct Flow {
    pub(crate) service: String,
    /// The Service's uid: its flows stop when it is deleted.
    pub(crate) uid: String,
    pub(crate) frontend: String,
    pub(crate) from: &'static str,
    /// Traffic the data path must drop (a source outside loadBalancerSourceRanges).
    pub(crate) expect_denied: bool,
    pub(crate) client_ip: IpAddr,
    /// Where it sends to and how (`http` or `udp`).
    pub(crate) to: SocketAddr,
    pub(crate) kind: &'static str,
    pub(crate) stats: Arc<Mutex<FlowStats>>,
    /// `None` until the frontend first answers (a Service created while the sandbox runs).
    pub(crate) proc: Option<Proc>,
}

#[derive(Default)]
pub(crate) struct FlowStats {
    pub(crate) per_backend: BTreeMap<String, u64>,
    pub(crate) errors: u64,
    pub(crate) last_error: Option<String>,
    pub(crate) kept_client_ip: u64,
    pub(crate) replaced_client_ip: u64,
}

/// `namespace/name:port-name`, or the port number for an unnamed port (`kubectl expose`).
fn service_label(ns: &str, name: &str, port: &k8s_openapi::api::core::v1::ServicePort) -> String {
    match port.name.as_deref() {
        Some(port_name) if !port_name.is_empty() => format!("{ns}/{name}:{port_name}"),
        _ => format!("{ns}/{name}:{}", port.port),
    }
}

/// A Service's cluster IPs, one per family (`clusterIPs`; `clusterIP` from before dual-stack),
/// none for a headless Service.
fn cluster_ips(spec: &k8s_openapi::api::core::v1::ServiceSpec) -> Vec<IpAddr> {
    let listed = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.clone(),
        _ => spec.cluster_ip.iter().cloned().collect(),
    };
    listed.iter().filter_map(|ip| ip.parse().ok()).collect()
}

/// `udp` for a UDP port, else `http` (every backend here is lb-probe, which serves both).
fn kind_of(port: &k8s_openapi::api::core::v1::ServicePort) -> &'static str {
    if port.protocol.as_deref() == Some("UDP") {
        "udp"
    } else {
        "http"
    }
}

/// Starts `lb-probe load` in `place` and a thread that tallies its results into `stats`.
fn spawn_load(
    place: Place<'_>,
    to: SocketAddr,
    kind: &str,
    rate: u32,
    client_ip: IpAddr,
    stats: &Arc<Mutex<FlowStats>>,
) -> Result<Proc> {
    let interval = (1000 / rate.max(1)).to_string();
    let to = to.to_string();
    let mut cmd = Command::new(workspace_bin("lb-probe"));
    cmd.args([
        "load",
        "--to",
        &to,
        "--kind",
        kind,
        "--interval-ms",
        &interval,
        "--timeout-ms",
        "500",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped());
    place.apply(&mut cmd);
    let mut proc = Proc::spawn_command(cmd);
    let stdout = proc.child_mut().stdout.take().context("piped stdout")?;
    let sink = stats.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            let mut s = sink.lock().expect("stats lock");
            if v["ok"] == true {
                let server = v
                    .pointer("/reply/server")
                    .and_then(|x| x.as_str())
                    .unwrap_or("?")
                    .to_string();
                *s.per_backend.entry(server).or_default() += 1;
                // `10.244.1.9:40000` or `[fd00:10:244:1::9]:40000`.
                let seen = v
                    .pointer("/reply/client")
                    .and_then(|x| x.as_str())
                    .and_then(|c| c.parse::<SocketAddr>().ok())
                    .map(|c| c.ip());
                if seen == Some(client_ip) {
                    s.kept_client_ip += 1;
                } else {
                    s.replaced_client_ip += 1;
                }
            } else {
                s.errors += 1;
                s.last_error = v["error"].as_str().map(str::to_string);
            }
        }
    });
    Ok(proc)
}

/// Whether a frontend answers one request now (300 ms at most).
fn served_once(place: Place<'_>, to: SocketAddr, kind: &str) -> bool {
    let to = to.to_string();
    let args: Vec<&str> = if kind == "udp" {
        vec!["udp", "--to", &to, "--timeout-ms", "300"]
    } else {
        vec!["tcp", "--connect", &to, "--timeout-ms", "300"]
    };
    let out = lb_tests::process::run_in(place, workspace_bin("lb-probe"), &args);
    String::from_utf8_lossy(&out.stdout).contains("\"ok\":true")
}

impl Cluster {
    /// One load generator per (Service frontend, client): pods call cluster IPs, the external
    /// client calls NodePorts on both nodes and load-balancer IPs; in every family of the
    /// Service, from the client's address of that family.
    pub(crate) fn start_traffic(&mut self, client: &kube::Client) -> Result<()> {
        let services: Vec<Service> = self
            .rt
            .block_on(Api::<Service>::all(client.clone()).list(&ListParams::default()))?
            .items;
        let client_pod = self
            .pods
            .iter()
            .find(|p| p.app == "client")
            .context("client pod")?;
        for svc in services {
            let (Some(ns), Some(name)) = (svc.metadata.namespace.clone(), svc.metadata.name.clone()) else {
                continue;
            };
            let uid = svc.metadata.uid.clone().unwrap_or_default();
            self.initial_services.insert(uid.clone());
            if ns == "default" {
                continue; // the `kubernetes` Service
            }
            let spec = svc.spec.clone().unwrap_or_default();
            let lb_ips: Vec<IpAddr> = svc
                .status
                .as_ref()
                .and_then(|s| s.load_balancer.as_ref())
                .and_then(|l| l.ingress.as_ref())
                .map(|i| i.iter().filter_map(|x| x.ip.as_deref()?.parse().ok()).collect())
                .unwrap_or_default();
            let cluster_ips = cluster_ips(&spec);
            for port in spec.ports.iter().flatten() {
                let kind = kind_of(port);
                let service_port = port.port as u16;
                let mut targets: Vec<(SocketAddr, &'static str)> = Vec::new();
                for cip in &cluster_ips {
                    targets.push((SocketAddr::new(*cip, service_port), "pod"));
                }
                if let Some(np) = port.node_port {
                    // kube-proxy serves a NodePort on the node addresses of the Service's
                    // families: one per cluster IP.
                    for node in &self.nodes {
                        for cip in &cluster_ips {
                            targets.push((SocketAddr::new(node.addr_like(*cip), np as u16), "external"));
                        }
                    }
                }
                for ip in &lb_ips {
                    targets.push((SocketAddr::new(*ip, service_port), "external"));
                    if !spec
                        .load_balancer_source_ranges
                        .clone()
                        .unwrap_or_default()
                        .is_empty()
                    {
                        targets.push((SocketAddr::new(*ip, service_port), "outsider"));
                    }
                }
                for (to, from) in targets {
                    let (place, client_ip) = match from {
                        "pod" => (
                            Place::new(&client_pod.ns, &self.nodes[0].cgroup),
                            client_pod.addr_like(to.ip()),
                        ),
                        "outsider" => (
                            self.outsider.place(),
                            of_family(to.ip(), self.outsider.ip, self.outsider.ip6),
                        ),
                        _ => (
                            self.external.place(),
                            of_family(to.ip(), self.external.ip, self.external.ip6),
                        ),
                    };
                    let expect_denied = from == "outsider";
                    if !expect_denied {
                        wait_until_served(place, to, kind);
                    }
                    let stats = Arc::new(Mutex::new(FlowStats::default()));
                    let proc = spawn_load(place, to, kind, self.rate, client_ip, &stats)?;
                    let kind_label = match (spec.type_.as_deref(), from) {
                        (_, "pod") => "ClusterIP",
                        _ if lb_ips.contains(&to.ip()) => "LoadBalancer",
                        _ => "NodePort",
                    };
                    self.flows.push(Flow {
                        service: service_label(&ns, &name, port),
                        uid: uid.clone(),
                        frontend: format!(
                            "{kind_label} {to}/{}",
                            port.protocol.clone().unwrap_or_else(|| "TCP".into())
                        ),
                        from,
                        expect_denied,
                        client_ip,
                        to,
                        kind,
                        stats,
                        proc: Some(proc),
                    });
                }
            }
        }
        Ok(())
    }

    /// Follows the user's Services: a Service created while the sandbox runs (any namespace, with
    /// a ClusterIP) gets a flow per port from a client on the real node to its ClusterIP, started
    /// once it first answers; a deleted Service's flows stop and leave the table.
    pub(crate) fn follow_services(&mut self, client: &kube::Client) {
        let listed = self.rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(2),
                Api::<Service>::all(client.clone()).list(&ListParams::default()),
            )
            .await
        });
        // The API server busy or restarting: try again on the next round.
        let Ok(Ok(services)) = listed else { return };
        // The real node's families: a cluster IP of another one has no client there.
        let real_families: Vec<bool> = self.real.ips().iter().map(IpAddr::is_ipv6).collect();
        let mut wanted: BTreeMap<(String, SocketAddr), (String, &'static str, String)> = BTreeMap::new();
        let mut live = BTreeSet::new();
        for svc in &services.items {
            let (Some(ns), Some(name), Some(uid)) = (
                svc.metadata.namespace.as_deref(),
                svc.metadata.name.as_deref(),
                svc.metadata.uid.as_deref(),
            ) else {
                continue;
            };
            live.insert(uid.to_string());
            if self.initial_services.contains(uid) || (ns == "default" && name == "kubernetes") {
                continue;
            }
            let spec = svc.spec.clone().unwrap_or_default();
            // Every cluster IP (a dual-stack Service has one per family, `kubectl patch` may add
            // the second while it runs).
            for cip in cluster_ips(&spec) {
                if !real_families.contains(&cip.is_ipv6()) {
                    continue;
                }
                for port in spec.ports.iter().flatten() {
                    let protocol = port.protocol.clone().unwrap_or_else(|| "TCP".into());
                    if protocol == "SCTP" {
                        continue;
                    }
                    let to = SocketAddr::new(cip, port.port as u16);
                    wanted.insert(
                        (uid.to_string(), to),
                        (
                            service_label(ns, name, port),
                            kind_of(port),
                            format!("ClusterIP {to}/{protocol}"),
                        ),
                    );
                }
            }
        }
        // Deleted Services (and ports): their loads stop with their flows.
        let mut gone = BTreeSet::new();
        self.flows.retain(|f| {
            let keep = live.contains(&f.uid)
                && (self.initial_services.contains(&f.uid) || wanted.contains_key(&(f.uid.clone(), f.to)));
            if !keep {
                gone.insert(f.service.clone());
            }
            keep
        });
        for service in gone {
            step(&format!("{service} is gone: its traffic stopped"));
        }
        // The real node's bridge addresses (the first of each Pod range): the source addresses of
        // its connections to its own Pods.
        let client_ip4 = kubelet::gateway_of(self.real.pod_cidr()).unwrap_or(Ipv4Addr::UNSPECIFIED);
        let client_ip6 = self
            .real
            .ipv6()
            .and_then(|v6| kubelet::gateway6_of(&v6.pod_cidr).ok())
            .unwrap_or(Ipv6Addr::UNSPECIFIED);
        for ((uid, to), (service, kind, frontend)) in wanted {
            if self.flows.iter().any(|f| f.uid == uid && f.to == to) {
                continue;
            }
            step(&format!(
                "following {service}: traffic from the real node to {to} once it answers"
            ));
            self.flows.push(Flow {
                service,
                uid,
                frontend,
                from: "real-node",
                expect_denied: false,
                client_ip: of_family(to.ip(), client_ip4, client_ip6),
                to,
                kind,
                stats: Arc::default(),
                proc: None,
            });
        }
        let place = Place::new(self.real.netns(), &self.real_clients);
        for flow in self.flows.iter_mut().filter(|f| f.proc.is_none()) {
            if served_once(place, flow.to, flow.kind) {
                match spawn_load(place, flow.to, flow.kind, self.rate, flow.client_ip, &flow.stats) {
                    Ok(proc) => flow.proc = Some(proc),
                    Err(e) => say(&format!("    {}: no load started: {e:#}", flow.service)),
                }
            }
        }
    }
}

/// Waits (up to 20 s) until a frontend answers once, so the table starts from a programmed data
/// path rather than counting the agents' start-up as errors.
fn wait_until_served(place: Place<'_>, to: SocketAddr, kind: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && !STOP.load(Ordering::SeqCst) {
        if served_once(place, to, kind) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    say(&format!(
        "    {to} did not answer within 20s; counting from now anyway"
    ));
}
