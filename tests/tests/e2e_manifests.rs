//! The deployment manifests (`manifests/`) against a real kube-apiserver (RBAC on, v1.37):
//!
//! - the kustomization and every manifest pass a server-side dry run, and the kustomization lists
//!   every manifest in the folder;
//! - the example Services (`manifests/examples/`) are created for real, as the sandbox does, and
//!   lb-agent's model takes each of them without a complaint;
//! - the ClusterRole is a subset of the built-in `system:node-proxier` (kube-proxy's), grants every
//!   call the agent makes and nothing listed beyond (`kubectl auth can-i --as=<the agent's
//!   ServiceAccount>`);
//! - with the ConfigMap's kubeconfig (pointed at this API server) and a token of the agent's
//!   ServiceAccount, the agent's own reflectors (`KubeSource`) list and watch, and its
//!   `EventPublisher` creates and then patches an Event;
//! - the ConfigMap's `config.conf` has only fields the agent honours, and the DaemonSet's arguments
//!   parse and merge with it exactly as `lb-agent` does at start;
//! - the DaemonSet: not privileged, exactly the documented capabilities, probes on 10256, host
//!   network, system-node-critical, and the rest of its documented shape.
//!
//! Needs no root; needs the control-plane binaries (`cargo xtask k8s-bins`, or LB_K8S_BIN_DIR).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use clap::{CommandFactory, FromArgMatches};
use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Node, Service},
        rbac::v1::{ClusterRole, PolicyRule},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Resource,
    api::{Api, PostParams},
};
use lb_agent::{cli::Cli, config, events::EventPublisher, watch::kube::KubeSource};
use lb_tests::control_plane::ControlPlane;
use serde_json::Value;

/// The agent's ServiceAccount, as `kubectl --as` spells it.
const AGENT: &str = "system:serviceaccount:kube-system:lb-agent";
/// The node name the DaemonSet's `$(NODE_NAME)` stands for in these checks.
const NODE: &str = "node-a";
/// The capabilities the DaemonSet documents (README.md), exactly.
const CAPABILITIES: [&str; 5] = ["BPF", "NET_ADMIN", "PERFMON", "SYS_ADMIN", "SYS_PTRACE"];
const HEALTHZ_PORT: i32 = 10256;

fn manifests() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests")
}

/// `kubectl` with the admin kubeconfig, returning stdout and failing with stderr. Blocking.
fn kubectl<I, S>(cp: &ControlPlane, args: I) -> Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    tokio::task::block_in_place(|| cp.kubectl(args))
}

/// The objects of `kubectl ... -o json` output: a `List`'s items, or the single object.
fn objects(json: &str) -> Result<Vec<Value>> {
    let v: Value = serde_json::from_str(json).context("kubectl printed no JSON")?;
    Ok(match v.get("kind").and_then(Value::as_str) {
        Some("List") => v["items"].as_array().cloned().unwrap_or_default(),
        _ => vec![v],
    })
}

/// `Kind namespace/name` of an object, for comparing sets of objects.
fn identity(v: &Value) -> String {
    format!(
        "{} {}/{}",
        v["kind"].as_str().unwrap_or_default(),
        v["metadata"]["namespace"].as_str().unwrap_or(""),
        v["metadata"]["name"].as_str().unwrap_or_default()
    )
}

/// `kubectl auth can-i VERB RESOURCE --as=<agent>`, in `namespace` or across all of them.
fn can_i(cp: &ControlPlane, verb: &str, resource: &str, namespace: Option<&str>) -> Result<bool> {
    let mut cmd = Command::new(&cp.binaries().kubectl);
    cmd.arg("--kubeconfig")
        .arg(cp.kubeconfig_path())
        .arg("--cache-dir")
        .arg(cp.dir().join("kubectl-cache"))
        .args(["auth", "can-i", verb])
        .args(resource.split(' '))
        .arg(format!("--as={AGENT}"))
        .env_remove("KUBECONFIG");
    match namespace {
        Some(ns) => cmd.args(["--namespace", ns]),
        None => cmd.arg("--all-namespaces"),
    };
    let out = tokio::task::block_in_place(|| cmd.output()).context("running kubectl auth can-i")?;
    let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match (out.status.code(), answer.as_str()) {
        (Some(0), "yes") => Ok(true),
        (Some(1), a) if a.starts_with("no") => Ok(false),
        _ => bail!(
            "kubectl auth can-i {verb} {resource}: {} / {answer:?} / {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    }
}

/// Every (API group, resource, verb) a set of rules grants, with `*` left as is.
fn grants(rules: &[PolicyRule]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for rule in rules {
        for group in rule.api_groups.as_deref().unwrap_or_default() {
            for resource in rule.resources.as_deref().unwrap_or_default() {
                for verb in &rule.verbs {
                    out.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifests_deploy_and_grant_exactly_what_the_agent_uses() -> Result<()> {
    const RBAC: &str = "The agent's ServiceAccount and ClusterRole (manifests/rbac.yaml) applied to a real kube-apiserver with RBAC on: the minimum the agent uses";
    lb_tests::report::started("7-security-rbac", RBAC);
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await?
        .context("starting etcd and kube-apiserver for the manifest checks")?;
    let dir = manifests();
    let dir_arg = dir.display().to_string();

    // 1. The kustomization, server-side dry run, and the same objects file by file.
    let kustomized = objects(&kubectl(
        &cp,
        ["apply", "-k", &dir_arg, "--dry-run=server", "-o", "json"],
    )?)?;
    let from_kustomize: BTreeSet<String> = kustomized.iter().map(identity).collect();
    let expected: BTreeSet<String> = [
        "ServiceAccount kube-system/lb-agent",
        "ClusterRole /lb-agent",
        "ClusterRoleBinding /lb-agent",
        "ConfigMap kube-system/lb-agent",
        "DaemonSet kube-system/lb-agent",
    ]
    .map(String::from)
    .into();
    assert_eq!(from_kustomize, expected, "objects of kubectl apply -k manifests/");
    let mut from_files = BTreeSet::new();
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml") && !p.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    for file in &files {
        let out = kubectl(
            &cp,
            [
                "apply",
                "--dry-run=server",
                "-o",
                "json",
                "-f",
                &file.display().to_string(),
            ],
        )
        .with_context(|| format!("server-side dry run of {}", file.display()))?;
        from_files.extend(objects(&out)?.iter().map(identity));
    }
    assert_eq!(
        from_files, from_kustomize,
        "every manifest in manifests/ must be listed in kustomization.yaml, and nothing else"
    );

    // 2. The examples, for real (the Namespace comes first by file name).
    let applied = kubectl(&cp, ["apply", "-f", &dir.join("examples").display().to_string()])?;
    for name in [
        "namespace/demo",
        "service/web",
        "service/web-nodeport",
        "service/web-local",
        "service/web-lb",
        "service/web-dual-stack",
        "service/sticky",
        "service/dns",
    ] {
        assert!(applied.contains(name), "{name} not applied:\n{applied}");
    }
    let services: Vec<Service> = objects(&kubectl(&cp, ["get", "services", "-n", "demo", "-o", "json"])?)?
        .into_iter()
        .map(serde_json::from_value)
        .collect::<Result<_, _>>()?;
    let by_name: BTreeMap<String, &Service> = services
        .iter()
        .map(|s| (s.metadata.name.clone().unwrap_or_default(), s))
        .collect();
    let spec = |name: &str| {
        by_name
            .get(name)
            .and_then(|s| s.spec.clone())
            .unwrap_or_else(|| panic!("Service demo/{name} missing"))
    };
    for (name, svc) in &by_name {
        let spec = svc.spec.as_ref().expect("spec");
        let ip = spec.cluster_ip.as_deref().unwrap_or_default();
        assert!(
            ip.starts_with("10.96."),
            "{name}: ClusterIP {ip} not allocated from 10.96.0.0/16"
        );
        let ports = lb_agent::model::service_ports(svc, lb_agent::family::IpFamily::V4)
            .map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        assert!(ports.warnings.is_empty(), "{name}: {:?}", ports.warnings);
    }
    let port0 = |name: &str| spec(name).ports.unwrap_or_default().remove(0);
    for (name, node_port, policy, type_) in [
        ("web", None, None, "ClusterIP"),
        ("web-nodeport", Some(30080), Some("Cluster"), "NodePort"),
        ("web-local", Some(30081), Some("Local"), "NodePort"),
        ("web-lb", Some(30082), Some("Cluster"), "LoadBalancer"),
        ("web-dual-stack", Some(30083), Some("Cluster"), "NodePort"),
    ] {
        let p = port0(name);
        assert_eq!((p.port, p.protocol.as_deref()), (80, Some("TCP")), "{name}");
        assert_eq!(
            p.target_port,
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(
                8080
            )),
            "{name}"
        );
        assert_eq!(p.node_port, node_port, "{name}: nodePort");
        assert_eq!(spec(name).type_.as_deref(), Some(type_), "{name}: type");
        assert_eq!(spec(name).external_traffic_policy.as_deref(), policy, "{name}");
        assert_eq!(
            spec(name).selector,
            Some(BTreeMap::from([("app".into(), "web".into())])),
            "{name}"
        );
    }
    assert_eq!(
        spec("web-lb").load_balancer_source_ranges,
        Some(vec!["192.168.50.0/25".to_string()])
    );
    let sticky = spec("sticky");
    assert_eq!(sticky.session_affinity.as_deref(), Some("ClientIP"));
    assert_eq!(
        sticky
            .session_affinity_config
            .and_then(|c| c.client_ip)
            .and_then(|c| c.timeout_seconds),
        Some(60)
    );
    let dns = port0("dns");
    assert_eq!((dns.port, dns.protocol.as_deref()), (53, Some("UDP")));
    assert_eq!(
        dns.target_port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(
            5353
        ))
    );
    assert_eq!(
        spec("dns").selector,
        Some(BTreeMap::from([("app".into(), "dns".into())]))
    );
    // The dual-stack example: a ClusterIP of each family from the API server's two ranges, IPv4
    // first; every other example is single-stack IPv4 (the cluster's primary family).
    let dual = spec("web-dual-stack");
    assert_eq!(dual.ip_family_policy.as_deref(), Some("RequireDualStack"));
    assert_eq!(
        dual.ip_families,
        Some(vec!["IPv4".to_string(), "IPv6".to_string()])
    );
    let dual_ips = dual.cluster_ips.unwrap_or_default();
    assert!(
        dual_ips.len() == 2 && dual_ips[1].starts_with("fd00:10:96::"),
        "web-dual-stack: ClusterIPs {dual_ips:?} not allocated from 10.96.0.0/16 and fd00:10:96::/112"
    );
    let ports6 = lb_agent::model::service_ports(by_name["web-dual-stack"], lb_agent::family::IpFamily::V6)
        .map_err(|e| anyhow::anyhow!("web-dual-stack: {e}"))?;
    assert!(
        ports6.warnings.is_empty(),
        "web-dual-stack: {:?}",
        ports6.warnings
    );
    for (name, svc) in by_name.iter().filter(|(name, _)| *name != "web-dual-stack") {
        let families = svc.spec.as_ref().and_then(|s| s.ip_families.clone());
        assert_eq!(families, Some(vec!["IPv4".to_string()]), "{name}");
    }

    // 3. RBAC, applied for real: a subset of system:node-proxier, and exactly the agent's calls.
    for file in ["serviceaccount.yaml", "rbac.yaml"] {
        kubectl(&cp, ["apply", "-f", &dir.join(file).display().to_string()])?;
    }
    let role: ClusterRole =
        serde_json::from_str(&kubectl(&cp, ["get", "clusterrole", "lb-agent", "-o", "json"])?)?;
    let proxier: ClusterRole = serde_json::from_str(&kubectl(
        &cp,
        ["get", "clusterrole", "system:node-proxier", "-o", "json"],
    )?)?;
    let ours = grants(role.rules.as_deref().unwrap_or_default());
    let theirs = grants(proxier.rules.as_deref().unwrap_or_default());
    println!("system:node-proxier grants: {theirs:?}");
    println!("lb-agent grants:            {ours:?}");
    let beyond: Vec<_> = ours.difference(&theirs).collect();
    let granted: Vec<String> = ours
        .iter()
        .map(|(group, resource, verb)| match group.as_str() {
            "" => format!("{verb} {resource}"),
            g => format!("{verb} {resource}.{g}"),
        })
        .collect();
    assert!(
        beyond.is_empty(),
        "the lb-agent ClusterRole grants more than system:node-proxier: {beyond:?}"
    );
    let yes: &[(&str, &str, Option<&str>)] = &[
        ("list", "services", None),
        ("watch", "services", None),
        ("list", "endpointslices.discovery.k8s.io", None),
        ("watch", "endpointslices.discovery.k8s.io", None),
        ("list", "nodes", None),
        ("watch", "nodes", None),
        ("list", "servicecidrs.networking.k8s.io", None),
        ("watch", "servicecidrs.networking.k8s.io", None),
        ("create", "events.events.k8s.io", Some("demo")),
        ("create", "events.events.k8s.io", Some("default")),
    ];
    let no: &[(&str, &str, Option<&str>)] = &[
        ("get", "secrets", Some("kube-system")),
        ("list", "secrets", None),
        ("list", "pods", None),
        ("create", "services", Some("demo")),
        ("delete", "services", Some("demo")),
        ("update", "services --subresource=status", Some("demo")),
        ("delete", "endpointslices.discovery.k8s.io", Some("demo")),
        ("create", "endpointslices.discovery.k8s.io", Some("demo")),
        ("patch", "nodes", None),
        ("update", "nodes --subresource=status", None),
        // system:node-proxier grants these; the agent never makes these calls (rbac.yaml says why).
        ("get", "nodes", None),
        ("list", "endpoints", None),
        ("create", "servicecidrs.networking.k8s.io", None),
        ("create", "events", Some("demo")),
        ("update", "events.events.k8s.io", Some("demo")),
        ("patch", "events.events.k8s.io", Some("demo")),
        ("delete", "events.events.k8s.io", Some("demo")),
        ("list", "configmaps", None),
        ("get", "configmaps", Some("kube-system")),
        ("create", "pods", Some("demo")),
        ("get", "leases.coordination.k8s.io", Some("kube-system")),
    ];
    for (verb, resource, ns) in yes {
        assert!(
            can_i(&cp, verb, resource, *ns)?,
            "the agent's ServiceAccount must be allowed to {verb} {resource} (namespace {ns:?})"
        );
    }
    for (verb, resource, ns) in no {
        assert!(
            !can_i(&cp, verb, resource, *ns)?,
            "the agent's ServiceAccount must not be allowed to {verb} {resource} (namespace {ns:?})"
        );
    }
    let rbac_checks = |list: &[(&str, &str, Option<&str>)]| -> Vec<String> {
        list.iter()
            .map(|(verb, resource, ns)| {
                format!(
                    "{verb} {resource}{}",
                    ns.map(|n| format!(" in {n}")).unwrap_or_default()
                )
            })
            .collect()
    };

    // 4. The agent's own API calls, as the ServiceAccount, through the ConfigMap's kubeconfig.
    let config_map: ConfigMap = kustomized
        .iter()
        .find(|o| o["kind"] == "ConfigMap")
        .map(|o| serde_json::from_value(o.clone()))
        .context("no ConfigMap in the kustomization")??;
    let data = config_map.data.clone().unwrap_or_default();
    let kubeconfig_text = data
        .get("kubeconfig.conf")
        .context("ConfigMap has no kubeconfig.conf")?;
    let parsed = kube::config::Kubeconfig::from_yaml(kubeconfig_text)?;
    let cluster = parsed.clusters[0].cluster.clone().context("no cluster")?;
    assert_eq!(cluster.server.as_deref(), Some("https://API_SERVER_HOST:6443"));
    const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount/";
    assert_eq!(
        cluster.certificate_authority.as_deref(),
        Some(&*format!("{SA_DIR}ca.crt"))
    );
    let user = parsed.auth_infos[0].auth_info.clone().context("no user")?;
    assert_eq!(user.token_file.as_deref(), Some(&*format!("{SA_DIR}token")));

    let sa_dir = cp.dir().join("serviceaccount");
    fs::create_dir_all(&sa_dir)?;
    let token = kubectl(
        &cp,
        [
            "create",
            "token",
            "lb-agent",
            "-n",
            "kube-system",
            "--duration=1h",
        ],
    )?;
    fs::write(sa_dir.join("token"), token.trim())?;
    fs::copy(cp.dir().join("pki/ca.crt"), sa_dir.join("ca.crt"))?;
    let local_kubeconfig = cp.dir().join("lb-agent.kubeconfig");
    fs::write(
        &local_kubeconfig,
        kubeconfig_text
            .replace("https://API_SERVER_HOST:6443", &cp.server_url())
            .replace(SA_DIR, &format!("{}/", sa_dir.display())),
    )?;
    let admin = cp.client().await?;
    Api::<Node>::all(admin.clone())
        .create(
            &PostParams::default(),
            &Node {
                metadata: ObjectMeta {
                    name: Some(NODE.into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    let agent_client = {
        let kubeconfig = kube::config::Kubeconfig::read_from(&local_kubeconfig)?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
        kube::Client::try_from(config)?
    };
    agent_client
        .apiserver_version()
        .await
        .context("GET /version as the agent")?;
    // The agent's CancellationToken, named through inference (tokio-util is not a dependency here).
    let shutdown = Default::default();
    assert!(
        KubeSource::lists_service_cidrs(&agent_client).await,
        "the agent's ServiceAccount must list ServiceCIDR objects"
    );
    let source = KubeSource::start(
        agent_client.clone(),
        NODE,
        true,
        Arc::new(|_| {}),
        Clone::clone(&shutdown),
    );
    assert!(
        source.wait_ready(Duration::from_secs(30)).await,
        "the agent's reflectors did not list Services, EndpointSlices, ServiceCIDRs and its Node as the ServiceAccount"
    );
    let state = source.state();
    // The API server's default ServiceCIDR object, from its --service-cluster-ip-range.
    let cidrs: Vec<String> = state
        .service_cidrs
        .iter()
        .flatten()
        .map(|c| c.to_string())
        .collect();
    assert_eq!(
        cidrs,
        [
            lb_tests::control_plane::SERVICE_CIDR,
            lb_tests::control_plane::SERVICE_CIDR6
        ],
        "the Service CIDRs the agent reads as the ServiceAccount"
    );
    assert_eq!(
        state
            .node
            .as_ref()
            .and_then(|n| n.metadata.name.clone())
            .as_deref(),
        Some(NODE)
    );
    for name in ["web", "web-nodeport", "web-local", "web-lb", "sticky", "dns"] {
        assert!(
            state
                .services
                .contains_key(&("demo".to_string(), name.to_string())),
            "demo/{name} not seen by the agent's reflector"
        );
    }
    let reporter = EventPublisher::new(agent_client, NODE);
    let web = ("demo".to_string(), "web".to_string());
    let web_ref = state.services[&web].object_ref(&());
    let services = std::collections::BTreeMap::from([(web.clone(), web_ref)]);
    let problem = |message: &str| {
        (
            web.0.clone(),
            web.1.clone(),
            "InvalidService",
            message.to_string(),
        )
    };
    reporter.report(&[problem("manifest test")], &services).await;
    let ours = |cp: &ControlPlane| -> Result<Vec<Value>> {
        Ok(objects(&kubectl(
            cp,
            ["get", "events.events.k8s.io", "-n", "demo", "-o", "json"],
        )?)?
        .into_iter()
        .filter(|e| e["reportingController"] == "lb-agent")
        .collect())
    };
    let events = ours(&cp)?;
    ensure!(
        events.len() == 1,
        "the agent's Event was not created (events.k8s.io create denied?): {events:?}"
    );
    assert_eq!(events[0]["regarding"]["name"], "web");
    assert_eq!(events[0]["note"], "manifest test");
    // Forgotten, then reported again: the same Event (same name, 409 ignored), not a copy; a
    // second problem gets its own Event.
    reporter.report(&[], &services).await;
    reporter
        .report(&[problem("manifest test"), problem("second problem")], &services)
        .await;
    let mut notes: Vec<String> = ours(&cp)?
        .iter()
        .map(|e| e["note"].as_str().unwrap_or_default().to_string())
        .collect();
    notes.sort();
    assert_eq!(notes, ["manifest test", "second problem"]);
    lb_tests::report::record(
        "7-security-rbac",
        &serde_json::json!({
            "scenario": RBAC,
            // `kubectl auth can-i --as=<the ServiceAccount>` answers, and the agent's own calls.
            "attempted": yes.len() + no.len() + 2,
            "failed": 0,
            "granted": granted,
            "subset_of_system_node_proxier": true,
            "allowed_as_needed": rbac_checks(yes),
            "denied_as_expected": rbac_checks(no),
            "agent_calls_as_the_serviceaccount": "list and watch Services, EndpointSlices and its Node (reflectors); create, then patch, an Event (EventPublisher): allowed",
        }),
    );

    // Stop the watches: the API server's graceful shutdown waits for open ones.
    shutdown.cancel();
    drop((source, reporter, admin));

    // 5. config.conf: only honoured fields, and the DaemonSet's flags merge with it as at start.
    let loaded = config::parse(data.get("config.conf").context("no config.conf")?)?;
    // Not even a note: every field is one the agent honours, in the v1alpha1 layout.
    let complaints: Vec<String> = loaded
        .warnings
        .iter()
        .map(|w| format!("{} ({:?}): {}", w.path, w.kind, w.message))
        .collect();
    assert!(complaints.is_empty(), "config.conf: {complaints:?}");

    let daemon_set: DaemonSet = serde_json::from_str(&kubectl(
        &cp,
        [
            "apply",
            "--dry-run=server",
            "-o",
            "json",
            "-f",
            &dir.join("daemonset.yaml").display().to_string(),
        ],
    )?)?;
    let pod = daemon_set.spec.template.spec.clone().context("no pod spec")?;
    assert_eq!(pod.containers.len(), 1, "one container");
    let agent = &pod.containers[0];
    let node_env = agent
        .env
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .context("no NODE_NAME env")?;
    assert_eq!(
        node_env
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str()),
        Some("spec.nodeName")
    );
    let args: Vec<String> = agent.args.clone().unwrap_or_default();
    assert!(
        args.contains(&"--hostname-override=$(NODE_NAME)".to_string()),
        "{args:?}"
    );
    let argv: Vec<String> = std::iter::once("lb-agent".to_string())
        .chain(args.iter().map(|a| a.replace("$(NODE_NAME)", NODE)))
        .collect();
    let matches = Cli::command()
        .try_get_matches_from(&argv)
        .with_context(|| format!("lb-agent rejects the DaemonSet's arguments {argv:?}"))?;
    let explicit = config::explicit_flags(&matches);
    let mut cli = Cli::from_arg_matches(&matches)?;
    assert!(
        cli.command.is_none(),
        "the DaemonSet runs the agent, not a subcommand"
    );
    let config_path = cli.run.config.clone().context("no --config")?;
    let kubeconfig_path = cli.run.kubeconfig.clone().context("no --kubeconfig")?;
    let mount = agent
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|m| m.name == "config")
        .context("no config volume mount")?;
    for (path, key) in [
        (&config_path, "config.conf"),
        (&kubeconfig_path, "kubeconfig.conf"),
    ] {
        assert_eq!(
            path,
            &Path::new(&mount.mount_path).join(key),
            "{key} is mounted at {}",
            mount.mount_path
        );
    }
    let notes = config::merge(&loaded.config, &mut cli.run, &explicit)?;
    assert!(notes.is_empty(), "flags and config.conf disagree: {notes:?}");
    let run = &cli.run;
    assert_eq!(run.node.hostname_override.as_deref(), Some(NODE));
    assert_eq!(run.healthz_bind_address, format!("0.0.0.0:{HEALTHZ_PORT}"));
    assert_eq!(run.metrics_bind_address, "127.0.0.1:10249");
    assert_eq!(run.node.cluster_cidr, vec!["10.244.0.0/16"]);
    assert_eq!(run.sync_period, Duration::from_secs(30));
    assert_eq!(run.min_sync_period, Duration::from_millis(100));
    assert!(run.node.iptables_localhost_nodeports && !run.node.masquerade_all);
    assert_eq!(run.bpf.root.bpf_root, Path::new("/sys/fs/bpf/lb"));
    assert_eq!(
        run.bpf.cgroup_root, None,
        "the cgroup2 mount is found, not configured"
    );
    run.node.settings()?;

    // 6. The DaemonSet's shape.
    let spec = &daemon_set.spec;
    assert_eq!(daemon_set.metadata.namespace.as_deref(), Some("kube-system"));
    assert_eq!(pod.host_network, Some(true));
    // The pods' processes, for socket termination (datapath/sockets.rs).
    assert_eq!(pod.host_pid, Some(true));
    assert_eq!(pod.dns_policy.as_deref(), Some("Default"));
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    assert_eq!(pod.service_account_name.as_deref(), Some("lb-agent"));
    let tolerations = pod.tolerations.clone().unwrap_or_default();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none()),
        "tolerate every taint, as kube-proxy: {tolerations:?}"
    );
    let strategy = spec.update_strategy.clone().unwrap_or_default();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        strategy.rolling_update.and_then(|r| r.max_unavailable),
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );
    assert!(
        agent
            .image
            .as_deref()
            .is_some_and(|i| i.starts_with("ghcr.io/lb-project/lb-agent:")),
        "image {:?}",
        agent.image
    );

    let security = agent.security_context.clone().context("no securityContext")?;
    assert_ne!(
        security.privileged,
        Some(true),
        "the agent container must not be privileged"
    );
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(security.read_only_root_filesystem, Some(true));
    let capabilities = security.capabilities.clone().context("no capabilities")?;
    let added: BTreeSet<&str> = capabilities
        .add
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(added, BTreeSet::from(CAPABILITIES), "added capabilities");
    assert_eq!(
        capabilities.drop.as_deref(),
        Some(&["ALL".to_string()][..]),
        "every other capability is dropped"
    );
    assert_eq!(
        security.app_armor_profile.as_ref().map(|p| p.type_.as_str()),
        Some("Unconfined")
    );

    let probe = |p: Option<&k8s_openapi::api::core::v1::Probe>| -> (String, i32) {
        let get = p.and_then(|p| p.http_get.clone()).expect("an httpGet probe");
        let port = match get.port {
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => n,
            other => panic!("probe port {other:?}: use the number"),
        };
        (get.path.unwrap_or_default(), port)
    };
    assert_eq!(
        probe(agent.readiness_probe.as_ref()),
        ("/healthz".to_string(), HEALTHZ_PORT)
    );
    assert_eq!(
        probe(agent.liveness_probe.as_ref()),
        ("/livez".to_string(), HEALTHZ_PORT)
    );
    let resources = agent.resources.clone().context("no resources")?;
    let quantity = |m: &Option<BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
                    k: &str| m.as_ref().and_then(|m| m.get(k)).map(|q| q.0.clone());
    assert_eq!(quantity(&resources.requests, "cpu").as_deref(), Some("50m"));
    assert_eq!(quantity(&resources.requests, "memory").as_deref(), Some("64Mi"));
    assert_eq!(quantity(&resources.limits, "memory").as_deref(), Some("320Mi"));

    // Volumes: bpffs (propagated from the host), the host's cgroup tree where the agent looks for
    // it, the ConfigMap; and no /lib/modules.
    let volumes: BTreeMap<String, k8s_openapi::api::core::v1::Volume> = pod
        .volumes
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|v| (v.name.clone(), v))
        .collect();
    let host_path = |name: &str| {
        volumes
            .get(name)
            .and_then(|v| v.host_path.as_ref())
            .map(|h| h.path.clone())
    };
    assert_eq!(host_path("bpffs").as_deref(), Some("/sys/fs/bpf"));
    assert_eq!(host_path("cgroup").as_deref(), Some("/sys/fs/cgroup"));
    assert_eq!(
        volumes
            .get("config")
            .and_then(|v| v.config_map.as_ref())
            .map(|c| c.name.as_str()),
        Some("lb-agent")
    );
    assert!(
        !volumes.values().any(|v| v
            .host_path
            .as_ref()
            .is_some_and(|h| h.path.starts_with("/lib/modules"))),
        "/lib/modules is not needed"
    );
    let mounts: BTreeMap<&str, &k8s_openapi::api::core::v1::VolumeMount> = agent
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|m| (m.name.as_str(), m))
        .collect();
    assert_eq!(mounts["bpffs"].mount_path, "/sys/fs/bpf");
    assert_eq!(
        mounts["bpffs"].mount_propagation.as_deref(),
        Some("HostToContainer")
    );
    assert!(
        run.bpf.root.bpf_root.starts_with(&mounts["bpffs"].mount_path),
        "--bpf-root must be on the bpffs mount"
    );
    assert_eq!(mounts["cgroup"].mount_path, "/sys/fs/cgroup");
    assert_eq!(mounts["cgroup"].read_only, Some(true));

    // The init container mounts bpffs for the host: the one privileged container.
    let init = pod.init_containers.clone().unwrap_or_default();
    assert_eq!(init.len(), 1, "one init container");
    assert_eq!(
        init[0].security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    let init_mount = init[0]
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|m| m.name == "bpffs")
        .context("the init container does not mount bpffs")?;
    assert_eq!(init_mount.mount_path, "/sys/fs/bpf");
    assert_eq!(init_mount.mount_propagation.as_deref(), Some("Bidirectional"));
    let script = init[0].args.clone().unwrap_or_default().join(" ");
    assert!(script.contains("mount -t bpf bpf /sys/fs/bpf"), "{script}");

    tokio::task::spawn_blocking(move || drop(cp)).await?;
    Ok(())
}
