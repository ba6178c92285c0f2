//! What the sandbox shows: the live table per Service (frontend, client, requests per backend,
//! errors, whether the client IP was kept), the same figures as JSON for `--summary-json`, and
//! how to use the cluster from another terminal.

use std::{collections::BTreeMap, fs, path::Path, time::Duration};

use anyhow::Result;
use lb_tests::process::workspace_bin;

use crate::{
    STATE_DIR,
    cluster::{Cluster, kubeconfig_path},
    traffic::Flow,
};

/// How the instructions make a Service dual-stack (the second family's ClusterIP is allocated,
/// the EndpointSlice controller writes the IPv6 slice from the Pods' `podIPs`).
const DUAL_STACK_PATCH: &str =
    r#"kubectl patch service hello -p '{"spec":{"ipFamilyPolicy":"PreferDualStack"}}'"#;

impl Cluster {
    pub(crate) fn render(&self, elapsed: Duration) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "lb sandbox (dual-stack): 2 netns nodes with {} pods, real node {} (kubelet: your Deployments), external clients {} / {} and {} (outside the LB source ranges) — running for {:.0?}\n\n",
            self.pods.len(),
            self.real.name(),
            self.external.ip,
            self.external.ip6,
            self.outsider.ip,
            Duration::from_secs(elapsed.as_secs())
        ));
        let mut by_service: BTreeMap<&str, Vec<&Flow>> = BTreeMap::new();
        for f in &self.flows {
            by_service.entry(&f.service).or_default().push(f);
        }
        for (service, flows) in by_service {
            out.push_str(&format!("{service}\n"));
            out.push_str(&format!(
                "  {:<44} {:<9} {:<48} {:>6}  {}\n",
                "FRONTEND", "FROM", "REQUESTS PER BACKEND", "ERRORS", "CLIENT IP"
            ));
            for f in flows {
                let s = f.stats.lock().expect("stats lock");
                let backends = if f.proc.is_none() {
                    "(waiting for a first answer)".to_string()
                } else if s.per_backend.is_empty() {
                    "-".to_string()
                } else {
                    s.per_backend
                        .iter()
                        .map(|(b, n)| format!("{b}:{n}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                };
                let kept = match (s.kept_client_ip, s.replaced_client_ip) {
                    (0, 0) => "-".to_string(),
                    (_, 0) => format!("preserved ({})", f.client_ip),
                    (0, _) => "masqueraded".to_string(),
                    _ => "mixed".to_string(),
                };
                let errors = match &s.last_error {
                    Some(e) if s.errors > 0 => {
                        format!("{} ({})", s.errors, e.chars().take(30).collect::<String>())
                    }
                    _ => s.errors.to_string(),
                };
                out.push_str(&format!(
                    "  {:<44} {:<9} {:<48} {:>6}  {}\n",
                    f.frontend, f.from, backends, errors, kept
                ));
            }
            out.push('\n');
        }
        out
    }

    /// The figures of every flow, for `--summary-json`.
    fn summary(&self) -> serde_json::Value {
        let flows: Vec<serde_json::Value> = self
            .flows
            .iter()
            .map(|f| {
                let s = f.stats.lock().expect("stats lock");
                serde_json::json!({
                    "service": f.service,
                    "frontend": f.frontend,
                    "from": f.from,
                    "client_ip": f.client_ip.to_string(),
                    "expect_denied": f.expect_denied,
                    "started": f.proc.is_some(),
                    "per_backend": s.per_backend,
                    "errors": s.errors,
                    "last_error": s.last_error,
                    "kept_client_ip": s.kept_client_ip,
                    "replaced_client_ip": s.replaced_client_ip,
                })
            })
            .collect();
        serde_json::json!({ "real_node": self.real.name(), "flows": flows })
    }

    pub(crate) fn write_summary(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("tmp");
        fs::write(&tmp, serde_json::to_string_pretty(&self.summary())?)?;
        fs::rename(&tmp, path)?;
        Ok(())
    }

    pub(crate) fn instructions(&self) -> String {
        let kubectl = if on_path("kubectl") {
            String::new()
        } else {
            format!(
                " (kubectl is not on your PATH: this one matches the cluster: {})",
                self.cp.binaries().kubectl.display()
            )
        };
        let mut s = String::new();
        s.push_str(&format!(
            "Use it with kubectl, as root from another terminal{kubectl}:\n"
        ));
        s.push_str(&format!("  export KUBECONFIG={}\n", kubeconfig_path().display()));
        s.push_str("  kubectl get nodes,pods,svc,endpointslices -A\n");
        s.push_str(&format!(
            "Pods run on the real node {} (the netns nodes have no kubelet); every Service you create gets a row:\n",
            self.real.name()
        ));
        for example in [
            "kubectl create deployment hello --image=localhost/lb-probe:dev --replicas=2",
            "kubectl expose deployment hello --port=80 --target-port=8080",
            "kubectl scale deployment hello --replicas=4",
            "kubectl delete pod -l app=hello",
        ] {
            s.push_str(&format!("  {example}\n"));
        }
        s.push_str(
            "The cluster is dual-stack: give a Service an IPv6 ClusterIP beside its IPv4 one (a row more):\n",
        );
        s.push_str(&format!("  {DUAL_STACK_PATCH}\n"));
        s.push_str("Look inside:\n");
        s.push_str(
            "  kubectl -n kube-system exec ds/lb-agent -- lb-agent services   (the real node's agent)\n",
        );
        for n in &self.nodes {
            s.push_str(&format!(
                "  nsenter --net=/run/netns/{} {} services --bpf-root {STATE_DIR}/bpf/{}\n",
                n.ns.name(),
                workspace_bin("lb-agent").display(),
                n.name
            ));
        }
        s.push_str(&format!(
            "  bpftool map dump pinned {STATE_DIR}/bpf/node-1/maps/lb4_services_v2   (lb6_services_v2: IPv6)\n"
        ));
        s.push_str(&format!(
            "  logs: {STATE_DIR}/logs/node-*.log (netns agents), {}/kubelet.log   (Ctrl-C tears everything down)\n",
            self.real.dir().display()
        ));
        s
    }
}

/// Whether `program` is on PATH.
fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}
