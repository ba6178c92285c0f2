//! The DaemonSet on a real kubelet: a control plane with kube-controller-manager and
//! kube-scheduler, one real node (kubelet, containerd, runc, the CNI bridge; `lb_tests::kubelet`),
//! the images built locally (`cargo xtask images`), and `manifests/` applied with `kubectl apply
//! -k` after only the documented edits, as an operator would. Then:
//!
//! - the agent's Pod becomes Ready through its own probes, called by kubelet; its container runs
//!   with exactly the manifest's capabilities (read from /proc of the real process: not
//!   privileged); the init container mounted bpffs on the node, and the pins are there;
//! - Services whose EndpointSlices the real controller writes are served from a Pod on the node
//!   (ClusterIP, and the `kubernetes` Service), from the node itself, and from a client outside
//!   it (NodePort), also with the controller's topology hints (`trafficDistribution`);
//! - operator flows under load, each with zero failed requests (figures in docs/reliability.md):
//!   a rolling update of the backend Deployment (terminating endpoints; with one replica only
//!   terminating ones, KEP-1669's fallback), `kubectl delete pod`, scaling to zero (rejected at
//!   once while empty) and back, and `kubectl rollout restart ds/lb-agent` (the new Pod adopts
//!   the pinned maps).
//!
//! The documented edits (manifests/README.md): the API server address and the cluster CIDR in
//! configmap.yaml, the image (kustomize `images:`). One more, for this machine's hygiene and not
//! an operator's: `--cgroup-root=<the node's cgroup>`, since a test node is a cgroup subtree of
//! this machine, whose root cgroup the socket programs must never be attached to.

use std::{
    collections::BTreeSet,
    fs,
    net::Ipv4Addr,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use lb_tests::{
    cgroup::Cgroup,
    control_plane::ControlPlane,
    kubelet::{self, KubeletNode, NodeConfig, NodeLoads, is_ready, json_of, pods, wait_for},
    load,
    netns::NetNs,
    process::Place,
    topo::Lan,
};
use serde_json::{Value, json};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 11);
const CLIENT_IP: &str = "192.168.50.100";
const POD_CIDR: &str = "10.244.1.0/24";
/// The DaemonSet's capabilities (manifests/README.md), by their bit in /proc/<pid>/status.
const CAPABILITIES: [(&str, u32); 5] = [
    ("NET_ADMIN", 12),
    ("SYS_PTRACE", 19),
    ("SYS_ADMIN", 21),
    ("PERFMON", 38),
    ("BPF", 39),
];
/// The request interval of every load.
const LOAD_INTERVAL_MS: u64 = 20;
const WAIT: Duration = Duration::from_secs(120);

fn record(name: &str, figures: Value) {
    lb_tests::report::record(name, &figures);
}

/// The capability bits of a process's effective, permitted and bounding sets.
fn capabilities(pid: i32) -> Result<(u64, u64, u64, bool)> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("no {name} in /proc/{pid}/status"))?;
        Ok(u64::from_str_radix(line[name.len()..].trim(), 16)?)
    };
    let no_new_privs = field("NoNewPrivs:")? == 1;
    Ok((
        field("CapEff:")?,
        field("CapPrm:")?,
        field("CapBnd:")?,
        no_new_privs,
    ))
}

/// The pinned maps' ids under the node's /sys/fs/bpf/lb (what a new agent Pod must adopt).
fn pinned_map_ids(node: &KubeletNode) -> Result<BTreeSet<(String, u64)>> {
    let out = node.exec("bpftool", &["-j", "map", "show"])?;
    let maps: Vec<Value> = serde_json::from_str(&out)?;
    let pins = node.exec("find", &["/sys/fs/bpf/lb", "-type", "f"])?;
    let mut ids = BTreeSet::new();
    for pin in pins.lines() {
        let Ok(show) = node.exec("bpftool", &["-j", "map", "show", "pinned", pin]) else {
            continue; // a pinned program or link
        };
        let v: Value = serde_json::from_str(&show)?;
        if let Some(id) = v["id"].as_u64() {
            ids.insert((pin.to_string(), id));
        }
    }
    ensure!(
        !maps.is_empty() && !ids.is_empty(),
        "no pinned maps under /sys/fs/bpf/lb: {pins}"
    );
    Ok(ids)
}

/// Endpoints of a Service's slices: (address, ready, serving, terminating).
fn endpoints(cp: &ControlPlane, service: &str) -> Result<Vec<(String, bool, bool, bool)>> {
    let v = json_of(
        cp,
        &[
            "get",
            "endpointslices",
            "-l",
            &format!("kubernetes.io/service-name={service}"),
        ],
    )?;
    let mut out = Vec::new();
    for slice in v["items"].as_array().into_iter().flatten() {
        for e in slice["endpoints"].as_array().into_iter().flatten() {
            let c = &e["conditions"];
            out.push((
                e["addresses"][0].as_str().unwrap_or_default().to_string(),
                c["ready"] == true,
                c["serving"] == true,
                c["terminating"] == true,
            ));
        }
    }
    Ok(out)
}

/// Watches a Service's endpoints while an operator command runs, remembering the most
/// terminating endpoints seen and whether only terminating (serving) ones were left at a time
/// (the window where KEP-1669's fallback is what keeps the Service up).
struct EndpointWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<thread::JoinHandle<(usize, bool, bool)>>,
}

impl EndpointWatch {
    fn start(kubeconfig: &Path, kubectl: &Path, cache: &Path, service: &str) -> EndpointWatch {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let (kubeconfig, kubectl, cache, service) = (
            kubeconfig.to_path_buf(),
            kubectl.to_path_buf(),
            cache.to_path_buf(),
            service.to_string(),
        );
        let thread = thread::spawn(move || {
            let (mut most_terminating, mut only_terminating, mut empty) = (0, false, false);
            while !stopped.load(std::sync::atomic::Ordering::SeqCst) {
                let out = std::process::Command::new(&kubectl)
                    .arg("--kubeconfig")
                    .arg(&kubeconfig)
                    .arg("--cache-dir")
                    .arg(&cache)
                    .args(["get", "endpointslices", "-o", "json", "-l"])
                    .arg(format!("kubernetes.io/service-name={service}"))
                    .output();
                if let Ok(out) = out
                    && let Ok(v) = serde_json::from_slice::<Value>(&out.stdout)
                {
                    let all: Vec<&Value> = v["items"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .flat_map(|s| s["endpoints"].as_array().into_iter().flatten())
                        .collect();
                    let terminating = all
                        .iter()
                        .filter(|e| e["conditions"]["terminating"] == true)
                        .count();
                    let ready = all.iter().filter(|e| e["conditions"]["ready"] == true).count();
                    most_terminating = most_terminating.max(terminating);
                    only_terminating |= ready == 0 && terminating > 0;
                    empty |= all.is_empty();
                }
                thread::sleep(Duration::from_millis(100));
            }
            (most_terminating, only_terminating, empty)
        });
        EndpointWatch {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> (usize, bool, bool) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread
            .take()
            .expect("started")
            .join()
            .expect("the watch thread")
    }
}

/// The backend: lb-probe answering on 8080 with its Pod's name, ready once it listens, and a
/// preStop pause so that a terminating Pod keeps serving while the change reaches every node (as
/// production Deployments behind kube-proxy do).
fn backend_manifest(image: &str, replicas: u32) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: default
spec:
  replicas: {replicas}
  selector:
    matchLabels: {{app: web}}
  strategy:
    type: RollingUpdate
    rollingUpdate: {{maxSurge: 0, maxUnavailable: 1}}
  template:
    metadata:
      labels: {{app: web}}
    spec:
      terminationGracePeriodSeconds: 30
      containers:
        - name: web
          image: {image}
          args: ["serve", "--tcp", "0.0.0.0:8080", "--udp", "0.0.0.0:5353"]
          ports: [{{containerPort: 8080}}]
          readinessProbe:
            tcpSocket: {{port: 8080}}
            periodSeconds: 1
          lifecycle:
            preStop:
              sleep: {{seconds: 4}}
---
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  type: NodePort
  selector: {{app: web}}
  ports:
    - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}
"#
    )
}

/// Runs lb-probe as a Pod on the node (`tcp --connect TARGET --count N`) and returns its JSON
/// lines (`kubectl logs`).
fn probe_pod(
    cp: &ControlPlane,
    node: &KubeletNode,
    name: &str,
    target: &str,
    count: u32,
) -> Result<Vec<Value>> {
    let image = kubelet::image("lb-probe")?.reference;
    let manifest = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "nodeName": node.name(),
            "containers": [{
                "name": "probe",
                "image": image,
                "args": ["tcp", "--connect", target, "--count", count.to_string()],
            }],
        },
    });
    let file = node.dir().join(format!("{name}.json"));
    fs::write(&file, manifest.to_string())?;
    cp.kubectl(["apply", "-f", &file.display().to_string()])?;
    let phase = wait_for(&format!("pod {name} to finish"), WAIT, || {
        let v = json_of(cp, &["-n", "default", "get", "pod", name])?;
        Ok(match v["status"]["phase"].as_str() {
            Some(p @ ("Succeeded" | "Failed")) => Some(p.to_string()),
            _ => None,
        })
    })?;
    // Through the API server, which reaches kubelet via the control plane's egress proxy.
    let text = cp.kubectl(["-n", "default", "logs", name])?;
    let lines: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    cp.kubectl(["-n", "default", "delete", "pod", name, "--wait=false"])?;
    ensure!(phase == "Succeeded", "pod {name} {phase}: {lines:?}");
    ensure!(
        lines.len() == count as usize,
        "pod {name} printed {} results of {count}: {text:?}",
        lines.len()
    );
    Ok(lines)
}

/// Both loads' rows for the report, requests attempted and failed, and the failure lines.
fn tally_loads(loads: [(&str, Vec<Value>); 2]) -> (Vec<Value>, u64, u64, Vec<String>) {
    let mut rows = Vec::new();
    let (mut attempted, mut failed, mut failures) = (0, 0, Vec::new());
    for (what, results) in loads {
        let (a, f) = load::tally(&results);
        attempted += a;
        failed += f;
        failures.extend(load::failures(what, &results));
        rows.push(load::row(what, &results));
    }
    (rows, attempted, failed, failures)
}

/// What explains a failure on the node: the agent's log, the node's addresses, routes and BPF
/// attachments.
fn diagnostics(node: &KubeletNode) -> String {
    let mut out = String::new();
    let pods = node.dir().join("var-log/pods");
    for entry in fs::read_dir(&pods).into_iter().flatten().flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with("kube-system_lb-agent")
        {
            for log in fs::read_dir(entry.path().join("lb-agent"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let text = fs::read_to_string(log.path()).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                out.push_str(&format!(
                    "--- {}:\n{}\n",
                    log.path().display(),
                    lines[lines.len().saturating_sub(40)..].join("\n")
                ));
            }
        }
    }
    for (program, args) in [
        ("ip", &["-br", "addr"][..]),
        ("ip", &["route"][..]),
        ("bpftool", &["net"][..]),
        ("tc", &["filter", "show", "dev", "eth0", "ingress"][..]),
    ] {
        let result = node.exec(program, args).unwrap_or_else(|e| format!("{e:#}"));
        out.push_str(&format!("--- {program} {}:\n{result}\n", args.join(" ")));
    }
    // To look at a failing node by hand: LB_KUBELET_HOLD_SECS=600.
    if let Some(secs) = std::env::var("LB_KUBELET_HOLD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        eprintln!(
            "{out}\nholding node {} (holder pid in its directory {}) for {secs} s",
            node.name(),
            node.dir().display()
        );
        thread::sleep(Duration::from_secs(secs));
    }
    out
}

/// A rolling update of the backend Deployment (a new environment variable), waited for as
/// `kubectl rollout status` does.
fn roll_web(cp: &ControlPlane, env: &str) -> Result<()> {
    cp.kubectl(["-n", "default", "set", "env", "deployment/web", env])?;
    cp.kubectl([
        "-n",
        "default",
        "rollout",
        "status",
        "deployment/web",
        "--timeout=180s",
    ])?;
    Ok(())
}

/// The names of the backends that answered.
fn servers(results: &[Value]) -> BTreeSet<String> {
    results
        .iter()
        .filter_map(|r| lb_tests::probe::server_of(r).map(str::to_string))
        .collect()
}

#[test]
fn daemonset_on_a_real_kubelet_serves_through_operator_flows() -> Result<()> {
    lb_tests::require_root();
    const SCENARIO: &str = "The DaemonSet on a real kubelet (containerd, runc, CNI bridge; real controllers): operator flows under load";
    lb_tests::report::started("9-kubelet-operator-flows", SCENARIO);
    let started = Instant::now();
    let images = ["pause", "lb-agent", "lb-probe"]
        .map(kubelet::image)
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let cp = ControlPlane::start_with_controllers()?;
    let lan = Lan::new();
    let node = KubeletNode::start(
        &cp,
        &lan,
        NodeConfig {
            ip: NODE_IP,
            pod_cidr: POD_CIDR.into(),
            cluster_dns: None,
            ipv6: None,
        },
        &images,
    )?;
    let node_ready_s = started.elapsed().as_secs_f64();
    let outside = NetNs::new("lbko");
    lan.attach(&outside, "eth0", &format!("{CLIENT_IP}/24"));

    // --- The DaemonSet, applied as an operator does.
    let applied = Instant::now();
    let _manifests = kubelet::apply_agent_manifests(&cp, &node)?;
    let agent_pod = wait_for("the lb-agent Pod to be Ready", WAIT, || {
        Ok(pods(&cp, "kube-system", "k8s-app=lb-agent")?
            .into_iter()
            .find(is_ready))
    })
    .map_err(|e| anyhow::anyhow!("{e:#}\n{}", node.log_tail()))?;
    let agent_ready_s = applied.elapsed().as_secs_f64();
    // Ready came from kubelet calling the readiness probe (/healthz on 10256).
    let statuses = agent_pod["status"]["containerStatuses"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let agent = statuses
        .iter()
        .find(|s| s["name"] == "lb-agent")
        .context("no lb-agent container status")?;
    ensure!(agent["ready"] == true && agent["started"] == true, "{agent}");
    let init = &agent_pod["status"]["initContainerStatuses"][0];
    ensure!(
        init["state"]["terminated"]["exitCode"] == 0,
        "the init container did not succeed: {init}"
    );

    // Exactly the manifest's capabilities, enforced by the runtime on the real process.
    let pid = node.container_pid(agent["containerID"].as_str().unwrap_or_default())?;
    let (effective, permitted, bounding, no_new_privs) = capabilities(pid)?;
    let wanted: u64 = CAPABILITIES.iter().map(|(_, bit)| 1u64 << bit).sum();
    ensure!(
        effective == wanted && permitted == wanted && bounding == wanted,
        "lb-agent runs with CapEff {effective:#x} CapPrm {permitted:#x} CapBnd {bounding:#x}, \
         expected exactly {CAPABILITIES:?} ({wanted:#x})"
    );
    ensure!(
        no_new_privs,
        "allowPrivilegeEscalation: false must set no_new_privs"
    );
    // The init container mounted bpffs on the node (Bidirectional), and the agent pinned there.
    let fs_type = node.exec("stat", &["-f", "-c", "%T", "/sys/fs/bpf"])?;
    ensure!(fs_type.trim() == "bpf_fs", "/sys/fs/bpf on the node is {fs_type}");
    let pins_before = pinned_map_ids(&node)?;

    // --- A backend Deployment and its Service; EndpointSlices from the real controller.
    let probe_image = kubelet::image("lb-probe")?.reference;
    let web = node.dir().join("web.yaml");
    fs::write(&web, backend_manifest(&probe_image, 3))?;
    cp.kubectl(["apply", "-f", &web.display().to_string()])?;
    wait_for("3 ready endpoints of web", WAIT, || {
        let ready = endpoints(&cp, "web")?.iter().filter(|e| e.1).count();
        Ok((ready == 3).then_some(()))
    })?;
    let svc = json_of(&cp, &["-n", "default", "get", "service", "web"])?;
    let cluster_ip = svc["spec"]["clusterIP"]
        .as_str()
        .context("a ClusterIP")?
        .to_string();
    let node_port = svc["spec"]["ports"][0]["nodePort"]
        .as_u64()
        .context("a NodePort")? as u16;
    let backends: BTreeSet<String> = pods(&cp, "default", "app=web")?
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .collect();

    // From a Pod on the node: the ClusterIP (every backend answers) and the `kubernetes` Service.
    let from_pod = probe_pod(&cp, &node, "client", &format!("{cluster_ip}:80"), 30)?;
    ensure!(
        from_pod.iter().all(|r| r["ok"] == true),
        "{from_pod:#?}\n{}",
        diagnostics(&node)
    );
    ensure!(
        servers(&from_pod) == backends,
        "a Pod reached {:?}, the backends are {backends:?}",
        servers(&from_pod)
    );
    let api = probe_pod(&cp, &node, "client-api", "10.96.0.1:443", 3)?;
    ensure!(api.iter().all(|r| r["ok"] == true || r["errno"] == 0), "{api:#?}");
    let kubernetes = endpoints(&cp, "kubernetes")?;
    ensure!(
        kubernetes
            .iter()
            .any(|e| e.0 == lb_tests::control_plane::ADVERTISE_ADDRESS.to_string()),
        "the kubernetes Service's endpoints: {kubernetes:?}"
    );
    // From outside the node: the NodePort.
    let from_outside = lb_tests::probe::tcp(Place::netns(&outside), &format!("{NODE_IP}:{node_port}"), 30);
    ensure!(
        from_outside.iter().all(|r| r["ok"] == true),
        "{from_outside:#?}\n{}",
        diagnostics(&node)
    );

    // Hints from the real controller: a zone on the node and `trafficDistribution: PreferClose`
    // make it write `hints.forZones` into the slices; the agent, in that zone, keeps serving.
    cp.kubectl(["label", "node", node.name(), "topology.kubernetes.io/zone=zone-a"])?;
    cp.kubectl([
        "-n",
        "default",
        "patch",
        "service",
        "web",
        "-p",
        r#"{"spec":{"trafficDistribution":"PreferClose"}}"#,
    ])?;
    let hinted = wait_for("hints in web's EndpointSlices", WAIT, || {
        let v = json_of(
            &cp,
            &["get", "endpointslices", "-l", "kubernetes.io/service-name=web"],
        )?;
        let zones: Vec<String> = v["items"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
            .filter_map(|e| e["hints"]["forZones"][0]["name"].as_str().map(str::to_string))
            .collect();
        Ok((zones.len() == 3).then_some(zones))
    })?;
    ensure!(hinted.iter().all(|z| z == "zone-a"), "hints: {hinted:?}");
    let with_hints = lb_tests::probe::tcp(Place::netns(&outside), &format!("{NODE_IP}:{node_port}"), 20);
    ensure!(
        with_hints.iter().all(|r| r["ok"] == true) && servers(&with_hints).len() > 1,
        "with topology hints: {with_hints:#?}"
    );

    // The operator's CLI inside the DaemonSet's Pod (`kubectl exec`), on the pinned maps.
    let services: Value = serde_json::from_str(&cp.kubectl([
        "-n",
        "kube-system",
        "exec",
        "ds/lb-agent",
        "-c",
        "lb-agent",
        "--",
        "lb-agent",
        "services",
        "-o",
        "json",
    ])?)
    .context("lb-agent services -o json")?;
    ensure!(
        services.to_string().contains(&cluster_ip),
        "`lb-agent services` in the Pod does not show web's {cluster_ip}: {services}"
    );

    let clients = Cgroup::at(
        &node
            .cgroup2()
            .join("clients")
            .strip_prefix(lb_tests::cgroup::cgroup2_mount())?
            .display()
            .to_string(),
    );
    let kubeconfig = cp.kubeconfig_path().to_path_buf();
    let kubectl = cp.binaries().kubectl.clone();
    let cache = cp.dir().join("kubectl-cache");
    let mut flows = Vec::new();
    let (mut total_attempted, mut total_failed) = (0, 0);
    let mut all_failures = Vec::new();
    let mut run_flow = |what: &str,
                        command: &str,
                        act: &mut dyn FnMut() -> Result<()>|
     -> Result<(usize, bool)> {
        let loads = NodeLoads::start(
            &node,
            &clients,
            &outside,
            &cluster_ip,
            node_port,
            LOAD_INTERVAL_MS,
        );
        thread::sleep(Duration::from_secs(1));
        let watch = EndpointWatch::start(&kubeconfig, &kubectl, &cache, "web");
        let t = Instant::now();
        act()?;
        let took = t.elapsed().as_secs_f64();
        thread::sleep(Duration::from_secs(1));
        let (terminating, only_terminating, _) = watch.finish();
        let (rows, attempted, failed, failures) = tally_loads(loads.stop());
        total_attempted += attempted;
        total_failed += failed;
        all_failures.extend(failures);
        flows.push(json!({
            "row": what,
            "command": command,
            "took (s)": (took * 10.0).round() / 10.0,
            "attempted": attempted,
            "failed": failed,
            "most terminating endpoints": terminating,
            "only terminating endpoints (fallback)": only_terminating,
            "loads": rows.iter().map(|r| format!("{}: {}/{}", r["load"].as_str().unwrap_or_default(), r["failed"], r["attempted"])).collect::<Vec<_>>().join("; "),
        }));
        Ok((terminating, only_terminating))
    };

    // 1. A rolling update of the 3 backends (one at a time, each terminating while replaced).
    let (terminating, _) = run_flow(
        "rolling update, 3 replicas",
        "kubectl set env deployment/web VERSION=2 && kubectl rollout status deployment/web",
        &mut || roll_web(&cp, "VERSION=2"),
    )?;
    ensure!(terminating > 0, "the rollout showed no terminating endpoint");
    // 2. `kubectl delete pod` of one backend.
    let victim = pods(&cp, "default", "app=web")?
        .iter()
        .find(|p| is_ready(p))
        .and_then(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .context("a backend pod")?;
    run_flow(
        "delete one backend pod",
        "kubectl delete pod <one of web>",
        &mut || {
            cp.kubectl(["-n", "default", "delete", "pod", &victim])?;
            wait_for("3 ready endpoints again", WAIT, || {
                let e = endpoints(&cp, "web")?;
                Ok((e.iter().filter(|e| e.1).count() == 3 && !e.iter().any(|e| e.3)).then_some(()))
            })
        },
    )?;
    // 3. One replica, rolled: for a moment the only endpoint is terminating (KEP-1669 fallback).
    cp.kubectl(["-n", "default", "scale", "deployment/web", "--replicas=1"])?;
    wait_for("1 endpoint of web", WAIT, || {
        Ok((endpoints(&cp, "web")?.len() == 1).then_some(()))
    })?;
    let (_, only_terminating) = run_flow(
        "rolling update, 1 replica (maxSurge 0)",
        "kubectl set env deployment/web VERSION=3 && kubectl rollout status deployment/web",
        &mut || roll_web(&cp, "VERSION=3"),
    )?;
    // 4. The agent's own rolling update: the new Pod adopts the pinned maps.
    run_flow(
        "lb-agent rollout restart",
        "kubectl -n kube-system rollout restart ds/lb-agent && kubectl rollout status",
        &mut || {
            cp.kubectl(["-n", "kube-system", "rollout", "restart", "ds/lb-agent"])?;
            cp.kubectl([
                "-n",
                "kube-system",
                "rollout",
                "status",
                "ds/lb-agent",
                "--timeout=180s",
            ])?;
            Ok(())
        },
    )?;
    let pins_after = pinned_map_ids(&node)?;
    let new_agent = pods(&cp, "kube-system", "k8s-app=lb-agent")?;
    ensure!(
        new_agent.len() == 1 && new_agent[0]["metadata"]["uid"] != agent_pod["metadata"]["uid"],
        "the DaemonSet's pod was not replaced"
    );
    // Liveness (/livez, called by kubelet every 10 s) never failed: no restarts.
    let restarts = new_agent[0]["status"]["containerStatuses"][0]["restartCount"].as_u64();
    ensure!(
        is_ready(&new_agent[0]) && restarts == Some(0),
        "the new agent Pod: {}",
        new_agent[0]["status"]
    );
    drop(run_flow);

    // 5. Scale to zero: rejected at once while empty; back to 2: served again.
    cp.kubectl(["-n", "default", "scale", "deployment/web", "--replicas=0"])?;
    wait_for("no endpoints of web", WAIT, || {
        Ok(endpoints(&cp, "web")?.is_empty().then_some(()))
    })?;
    thread::sleep(Duration::from_secs(1));
    let rejecting = Instant::now();
    let empty_inside = lb_tests::probe::tcp(
        Place::new(node.netns(), &clients),
        &format!("{cluster_ip}:80"),
        10,
    );
    let empty_outside = lb_tests::probe::tcp(Place::netns(&outside), &format!("{NODE_IP}:{node_port}"), 10);
    // Two lb-probe runs of 10 connections each, process start included: a rejected connection
    // fails at once, a dropped one would take the 2 s connect timeout.
    let rejecting_ms = rejecting.elapsed().as_millis();
    let refused = |rs: &[Value]| {
        rs.iter()
            .filter(|r| r["errno"] == libc::ECONNREFUSED || r["errno"] == libc::EPERM)
            .count()
    };
    let scaled_up = Instant::now();
    cp.kubectl(["-n", "default", "scale", "deployment/web", "--replicas=2"])?;
    wait_for("2 ready endpoints of web", WAIT, || {
        Ok((endpoints(&cp, "web")?.iter().filter(|e| e.1).count() == 2).then_some(()))
    })?;
    let back_s = scaled_up.elapsed().as_secs_f64();
    let after = lb_tests::probe::tcp(Place::netns(&outside), &format!("{NODE_IP}:{node_port}"), 20);
    flows.push(json!({
        "row": "scale to zero and back to 2",
        "command": "kubectl scale deployment/web --replicas=0, then --replicas=2",
        "took (s)": (back_s * 10.0).round() / 10.0,
        "attempted": 20,
        "failed": after.iter().filter(|r| r["ok"] != true).count(),
        "rejected while empty": format!(
            "{}/20 refused ({rejecting_ms} ms for all 20, two probe processes included)",
            refused(&empty_inside) + refused(&empty_outside)
        ),
    }));

    record(
        "9-kubelet-operator-flows",
        json!({
            "scenario": SCENARIO,
            "attempted": total_attempted,
            "failed": total_failed,
            "node Ready after (s)": (node_ready_s * 10.0).round() / 10.0,
            "lb-agent Pod Ready after apply (s)": (agent_ready_s * 10.0).round() / 10.0,
            "capabilities": CAPABILITIES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
            "pinned maps adopted across the DaemonSet's rollout": pins_before == pins_after,
        "topology hints from the EndpointSlice controller": format!("{} endpoints hinted for zone-a, served", hinted.len()),
            "flows": flows,
        }),
    );
    ensure!(
        total_failed == 0,
        "requests failed during the operator flows: {all_failures:#?}"
    );
    ensure!(
        only_terminating,
        "the 1-replica rollout never left only terminating endpoints"
    );
    ensure!(
        pins_before == pins_after,
        "the new lb-agent Pod re-created maps instead of adopting the pins: {pins_before:?} -> {pins_after:?}"
    );
    ensure!(
        refused(&empty_inside) == 10 && refused(&empty_outside) == 10,
        "while empty, connections must be refused at once: {empty_inside:?} {empty_outside:?}"
    );
    ensure!(
        after.iter().all(|r| r["ok"] == true),
        "after scaling back: {after:?}"
    );
    Ok(())
}
