//! The traffic: a flow per (Service frontend, client), each an `lb-probe load` process whose
//! results a thread tallies per backend; the example Services' flows started once they answer,
//! and the Services created or deleted while the sandbox runs followed from the real node.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader},
    net::Ipv4Addr,
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
    cluster::Cluster,
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
    pub(crate) client_ip: Ipv4Addr,
    /// Where it sends to and how (`http` or `udp`).
    pub(crate) to: String,
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
    to: &str,
    kind: &str,
    rate: u32,
    client_ip: Ipv4Addr,
    stats: &Arc<Mutex<FlowStats>>,
) -> Result<Proc> {
    let interval = (1000 / rate.max(1)).to_string();
    let mut cmd = Command::new(workspace_bin("lb-probe"));
    cmd.args([
        "load",
        "--to",
        to,
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
                let seen = v
                    .pointer("/reply/client")
                    .and_then(|x| x.as_str())
                    .unwrap_or("")
                    .rsplit_once(':')
                    .map(|(h, _)| h.to_string())
                    .unwrap_or_default();
                if seen == client_ip.to_string() {
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
fn served_once(place: Place<'_>, to: &str, kind: &str) -> bool {
    let args: Vec<&str> = if kind == "udp" {
        vec!["udp", "--to", to, "--timeout-ms", "300"]
    } else {
        vec!["tcp", "--connect", to, "--timeout-ms", "300"]
    };
    let out = lb_tests::process::run_in(place, workspace_bin("lb-probe"), &args);
    String::from_utf8_lossy(&out.stdout).contains("\"ok\":true")
}

impl Cluster {
    /// One load generator per (Service frontend, client): pods call cluster IPs, the external
    /// client calls NodePorts on both nodes and load-balancer IPs.
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
            let lb_ips: Vec<String> = svc
                .status
                .as_ref()
                .and_then(|s| s.load_balancer.as_ref())
                .and_then(|l| l.ingress.as_ref())
                .map(|i| i.iter().filter_map(|x| x.ip.clone()).collect())
                .unwrap_or_default();
            for port in spec.ports.iter().flatten() {
                let kind = kind_of(port);
                let mut targets: Vec<(String, &'static str)> = Vec::new();
                if let Some(cip) = spec.cluster_ip.as_deref().filter(|c| *c != "None") {
                    targets.push((format!("{cip}:{}", port.port), "pod"));
                }
                if let Some(np) = port.node_port {
                    for node in &self.nodes {
                        targets.push((format!("{}:{np}", node.ip), "external"));
                    }
                }
                for ip in &lb_ips {
                    targets.push((format!("{ip}:{}", port.port), "external"));
                    if !spec
                        .load_balancer_source_ranges
                        .clone()
                        .unwrap_or_default()
                        .is_empty()
                    {
                        targets.push((format!("{ip}:{}", port.port), "outsider"));
                    }
                }
                for (to, from) in targets {
                    let (place, client_ip) = match from {
                        "pod" => (Place::new(&client_pod.ns, &self.nodes[0].cgroup), client_pod.ip),
                        "outsider" => (Place::netns(&self.outsider.0), self.outsider.1),
                        _ => (Place::new(&self.external.0, &self.external.2), self.external.1),
                    };
                    let expect_denied = from == "outsider";
                    if !expect_denied {
                        wait_until_served(place, &to, kind);
                    }
                    let stats = Arc::new(Mutex::new(FlowStats::default()));
                    let proc = spawn_load(place, &to, kind, self.rate, client_ip, &stats)?;
                    let kind_label = match (spec.type_.as_deref(), from) {
                        (_, "pod") => "ClusterIP",
                        _ if lb_ips.iter().any(|ip| to.starts_with(ip.as_str())) => "LoadBalancer",
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
        let mut wanted: BTreeMap<(String, String), (String, &'static str, String)> = BTreeMap::new();
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
            let Some(cip) = spec
                .cluster_ip
                .as_deref()
                .filter(|c| !c.is_empty() && *c != "None")
            else {
                continue;
            };
            for port in spec.ports.iter().flatten() {
                let protocol = port.protocol.clone().unwrap_or_else(|| "TCP".into());
                if protocol == "SCTP" {
                    continue;
                }
                wanted.insert(
                    (uid.to_string(), format!("{cip}:{}", port.port)),
                    (
                        service_label(ns, name, port),
                        kind_of(port),
                        format!("ClusterIP {cip}:{}/{protocol}", port.port),
                    ),
                );
            }
        }
        // Deleted Services (and ports): their loads stop with their flows.
        let mut gone = BTreeSet::new();
        self.flows.retain(|f| {
            let keep = live.contains(&f.uid)
                && (self.initial_services.contains(&f.uid)
                    || wanted.contains_key(&(f.uid.clone(), f.to.clone())));
            if !keep {
                gone.insert(f.service.clone());
            }
            keep
        });
        for service in gone {
            step(&format!("{service} is gone: its traffic stopped"));
        }
        // The real node's bridge address (the first of its Pod range): the source address of its
        // connections to its own Pods.
        let client_ip = kubelet::gateway_of(self.real.pod_cidr()).unwrap_or(Ipv4Addr::UNSPECIFIED);
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
                client_ip,
                to,
                kind,
                stats: Arc::default(),
                proc: None,
            });
        }
        let place = Place::new(self.real.netns(), &self.real_clients);
        for flow in self.flows.iter_mut().filter(|f| f.proc.is_none()) {
            if served_once(place, &flow.to, flow.kind) {
                match spawn_load(place, &flow.to, flow.kind, self.rate, flow.client_ip, &flow.stats) {
                    Ok(proc) => flow.proc = Some(proc),
                    Err(e) => say(&format!("    {}: no load started: {e:#}", flow.service)),
                }
            }
        }
    }
}

/// Waits (up to 20 s) until a frontend answers once, so the table starts from a programmed data
/// path rather than counting the agents' start-up as errors.
fn wait_until_served(place: Place<'_>, to: &str, kind: &str) {
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
