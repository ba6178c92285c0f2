//! docs/migrating-from-kube-proxy.md executed on a real node, with traffic flowing: a control
//! plane with its controllers, one real node (kubelet, containerd, runc, the CNI bridge;
//! `lb_tests::kubelet`) running kube-proxy v1.37.1 (nftables mode) deployed as kubeadm deploys it,
//! and a backend Deployment behind a NodePort Service. Then, with a client on the node (a ClusterIP,
//! the socket path) and one outside it (the NodePort, the tc path) sending a request every 20 ms
//! throughout:
//!
//! - the guide's steps 1, 2 and 4 to 7: kube-proxy's settings read and carried over, kube-proxy
//!   stopped restorably (its frozen rules keep serving), lb-agent deployed, the conntrack entries
//!   of kube-proxy's masquerading forgotten and its rules removed with the guide's cleanup
//!   DaemonSet, the checks of step 7;
//! - the guide's "Rolling back" section: kube-proxy back (its nodeSelector patch undone; then,
//!   the other way it offers, step 8's deletes and the backups of step 4 applied), lb-agent
//!   deleted, its programs detached and unpinned with the guide's cleanup DaemonSet, the rest
//!   removed; and kube-proxy serving again.
//!
//! Every request must succeed but for what the guide says may not: a NodePort connection opened
//! in the instant lb-agent attaches (`ATTACH_RESETS`), and one open in the instant the rollback
//! detaches lb-agent's programs (`DETACH_RESETS`). Requests served only after a retransmission
//! (over 1 s) and the node's conntrack statistics (`conntrack -S`: `insert_failed`, `invalid`)
//! are reported per step, not asserted: the node's conntrack counts every flow of the node (the
//! kubelet's probes, the proxies' own connections), and with br_netfilter it also meets the
//! bridged pod side of lb-agent's masqueraded flows, which the guide explains (section 3).
//!
//! The guide's commands and manifests are read from the guide itself and run as written,
//! with only its placeholders filled in (file names, pod name, addresses, this machine's images
//! instead of registry.k8s.io's); the few it cannot run here are replaced by their equivalent,
//! each with a comment saying why. Who serves at each stage is checked, not assumed: kube-proxy's
//! DNAT leaves conntrack entries whose original destination is the ClusterIP or the NodePort,
//! lb-agent translates before conntrack sees the packet and leaves none.
//!
//! Figures: `9-kubelet-migration` in docs/reliability.md.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::Ipv4Addr,
    path::Path,
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail, ensure};
use lb_tests::{
    cgroup::Cgroup,
    control_plane::{ADVERTISE_ADDRESS, ControlPlane},
    kubelet::{
        self, API_PORT, CLUSTER_CIDR, KubeletNode, NodeConfig, NodeLoads, is_ready, json_of, pods, wait_for,
    },
    load,
    netns::NetNs,
    process::Place,
    topo::Lan,
};
use serde_json::{Value, json};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 21);
const CLIENT_IP: &str = "192.168.50.100";
const POD_CIDR: &str = "10.244.1.0/24";
/// The request interval of both loads.
const LOAD_INTERVAL_MS: u64 = 20;
const WAIT: Duration = Duration::from_secs(180);
const REPORT: &str = "9-kubelet-migration";
/// NodePort connections reset in the instant lb-agent attaches to the node's interfaces (the
/// guide's section 3). Until lb-agent attached the tc egress program before the ingress one, a
/// SYN arriving between the two was translated and its SYN-ACK was not, and the client's
/// retransmission a second later started a second connection that reset the first: 0 or 1 per
/// run at one new connection every 20 ms. None seen since the order was fixed. What remains from
/// step 5 until step 6's `conntrack -D` removed kube-proxy's recent masquerade entries (the
/// guide's section 3): a NodePort connection whose masquerade port meets one of them waits for its
/// SYN's retransmission, and was reset after it once in five runs (once, in a CI run, with its
/// SYN sent in step 6 before `conntrack -D` returned).
const ATTACH_RESETS: u64 = 2;
/// NodePort connections reset in the instant the rollback's cleanup detaches lb-agent's tc
/// programs (the guide's "Rolling back", step 3): a connection lb-agent translated lives in its
/// maps only; once they go, its next packet meets kube-proxy's rules as a new flow and reaches a
/// backend that never saw it. Measured: 0 or 1 per run at one new connection every 20 ms.
const DETACH_RESETS: u64 = 2;
const SCENARIO: &str = "docs/migrating-from-kube-proxy.md on a real kubelet: kube-proxy (nftables) to lb-agent and back, under load";
/// The images the guide names (registry.k8s.io, the project's registry) and this machine's
/// stand-ins, imported into the node (`cargo xtask images`).
const IMAGE_NAMES: [(&str, &str); 3] = [
    ("registry.k8s.io/kube-proxy:v1.37.1", "kube-proxy"),
    ("registry.k8s.io/pause:3.10", "pause"),
    ("ghcr.io/lb-project/lb-agent:0.1.0", "lb-agent"),
];

// ---------------------------------------------------------------------------------------------
// The guide

/// One command of the guide's `sh` blocks: its words (shell quoting removed), the file its output
/// is redirected to, and the pipeline it feeds.
#[derive(Debug, Clone)]
struct GuideCommand {
    words: Vec<String>,
    redirect: Option<String>,
    pipe: Option<String>,
}

impl GuideCommand {
    fn text(&self) -> String {
        self.words.join(" ")
    }
}

/// docs/migrating-from-kube-proxy.md: its commands (`kubectl`, and those run on a node) and its
/// YAML manifests.
struct Guide {
    text: String,
    commands: Vec<GuideCommand>,
}

impl Guide {
    fn load() -> Result<Guide> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/migrating-from-kube-proxy.md");
        let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let mut commands = Vec::new();
        // Inline ones (`kubectl ...` in the prose), then those of the `sh` blocks.
        for (i, span) in text.split('`').enumerate() {
            if i % 2 == 1
                && span.starts_with("kubectl ")
                && let Some(command) = shell_words(span)
            {
                commands.push(command);
            }
        }
        for block in fenced_blocks(&text, "sh") {
            let joined = block.replace("\\\n", " ");
            for line in joined.lines() {
                // A command of its own, and one in its comment (`# or, if it was deleted: kubectl ...`).
                let in_comment = line
                    .find("# ")
                    .and_then(|i| line[i..].find("kubectl ").map(|k| &line[i + k..]));
                for text in [Some(line), in_comment].into_iter().flatten() {
                    if let Some(command) = shell_words(text) {
                        commands.push(command);
                    }
                }
            }
        }
        Ok(Guide { text, commands })
    }

    /// The guide's command whose words are `text` exactly, else the one command starting with it.
    fn command(&self, text: &str) -> Result<GuideCommand> {
        if let Some(c) = self.commands.iter().find(|c| c.text() == text) {
            return Ok(c.clone());
        }
        let starting: Vec<&GuideCommand> = self
            .commands
            .iter()
            .filter(|c| c.text().starts_with(text))
            .collect();
        match starting.as_slice() {
            [one] => Ok((*one).clone()),
            [] => bail!(
                "the guide has no command `{text}`; its commands:\n{}",
                self.commands
                    .iter()
                    .map(GuideCommand::text)
                    .collect::<Vec<_>>()
                    .join("\n")
            ),
            many => bail!("`{text}` starts {} of the guide's commands: {many:?}", many.len()),
        }
    }

    /// The YAML block whose first line is `first_line` (e.g. `# kube-proxy-cleanup.yaml: ...`).
    fn yaml(&self, first_line: &str) -> Result<String> {
        fenced_blocks(&self.text, "yaml")
            .into_iter()
            .find(|b| b.lines().next().is_some_and(|l| l.starts_with(first_line)))
            .with_context(|| format!("the guide has no YAML block starting with {first_line:?}"))
    }
}

/// The contents of the ```<lang> blocks of a Markdown text, each dedented by its fence's indent.
fn fenced_blocks(text: &str, lang: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match &mut current {
            None if trimmed == format!("```{lang}") => current = Some((indent, String::new())),
            Some((_, body)) if trimmed == "```" => {
                blocks.push(std::mem::take(body));
                current = None;
            }
            Some((fence, body)) => {
                body.push_str(line.get(*fence..).unwrap_or(trimmed));
                body.push('\n');
            }
            None => {}
        }
    }
    blocks
}

/// A POSIX shell line's words: quotes removed, a `#` word ends it, `> file` and `| rest` set
/// aside. `None` for an empty line or one that is not a simple command (a subshell).
fn shell_words(line: &str) -> Option<GuideCommand> {
    let mut words = Vec::new();
    let (mut redirect, mut pipe) = (None, None);
    let mut word: Option<String> = None;
    let mut redirect_next = false;
    let mut chars = line.char_indices().peekable();
    let mut finish = |word: &mut Option<String>, redirect_next: &mut bool, words: &mut Vec<String>| {
        if let Some(w) = word.take() {
            if *redirect_next {
                redirect = Some(w);
                *redirect_next = false;
            } else {
                words.push(w);
            }
        }
    };
    while let Some((i, c)) = chars.next() {
        match c {
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                for (_, c) in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    w.push(c);
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                while let Some((_, c)) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => {
                            if let Some((_, next)) = chars.next() {
                                if !matches!(next, '"' | '\\' | '$' | '`') {
                                    w.push('\\');
                                }
                                w.push(next);
                            }
                        }
                        c => w.push(c),
                    }
                }
            }
            '\\' => {
                if let Some((_, next)) = chars.next() {
                    word.get_or_insert_with(String::new).push(next);
                }
            }
            '#' if word.is_none() => break,
            c if c.is_whitespace() => finish(&mut word, &mut redirect_next, &mut words),
            '|' => {
                finish(&mut word, &mut redirect_next, &mut words);
                pipe = Some(line[i + 1..].trim().to_string());
                break;
            }
            // `<node-ip>` is the guide's placeholder, not a redirection.
            '>' if word.is_none() => redirect_next = true,
            '(' | ')' | ';' | '&' if word.is_none() => return None,
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    finish(&mut word, &mut redirect_next, &mut words);
    drop(finish);
    (!words.is_empty()).then_some(GuideCommand {
        words,
        redirect,
        pipe,
    })
}

/// Runs a command of the guide with its placeholders (whole words) replaced; its output goes to
/// the redirect file (in `dir`) when it has one. Returns the output and the command as written.
fn run_guide(
    cp: &ControlPlane,
    command: &GuideCommand,
    fill: &[(&str, String)],
    dir: &Path,
) -> Result<(String, String)> {
    let mut words: Vec<String> = command.words[1..]
        .iter()
        .map(|w| {
            fill.iter()
                .find(|(placeholder, _)| w == placeholder)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| w.clone())
        })
        .collect();
    // A test must not hang where an operator would look and press Ctrl-C.
    if words.iter().any(|w| w == "rollout") && !words.iter().any(|w| w.starts_with("--timeout")) {
        words.push("--timeout=300s".into());
    }
    let out = cp
        .kubectl(&words)
        .with_context(|| format!("the guide's `{}`", command.text()))?;
    if let Some(file) = &command.redirect {
        fs::write(dir.join(file), &out)?;
    }
    Ok((out, command.text()))
}

// ---------------------------------------------------------------------------------------------
// kube-proxy as kubeadm deploys it

/// kubeadm's kube-proxy add-on (cmd/kubeadm/app/phases/addons/proxy): the ServiceAccount, the
/// ClusterRoleBinding to `system:node-proxier`, the ConfigMap with `config.conf` (the fields
/// kubeadm writes; mode nftables, and one value as kind sets it) and `kubeconfig.conf` (the
/// control-plane endpoint, the ServiceAccount's token and CA), and the DaemonSet, verbatim but for
/// the image and one volume.
fn kube_proxy_manifests(image: &str) -> String {
    let server = format!("https://{ADVERTISE_ADDRESS}:{API_PORT}");
    format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata:
  name: kube-proxy
  namespace: kube-system
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: kubeadm:node-proxier
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: system:node-proxier
subjects:
  - kind: ServiceAccount
    name: kube-proxy
    namespace: kube-system
---
kind: ConfigMap
apiVersion: v1
metadata:
  name: kube-proxy
  namespace: kube-system
  labels:
    app: kube-proxy
data:
  kubeconfig.conf: |-
    apiVersion: v1
    kind: Config
    clusters:
    - cluster:
        certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
        server: {server}
      name: default
    contexts:
    - context:
        cluster: default
        namespace: default
        user: default
      name: default
    current-context: default
    users:
    - name: default
      user:
        tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
  config.conf: |-
    apiVersion: kubeproxy.config.k8s.io/v1alpha1
    kind: KubeProxyConfiguration
    bindAddress: 0.0.0.0
    bindAddressHardFail: false
    clientConnection:
      acceptContentTypes: ""
      burst: 0
      contentType: ""
      kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
      qps: 0
    clusterCIDR: {CLUSTER_CIDR}
    configSyncPeriod: 0s
    conntrack:
      # As kind writes it: a node here is a network namespace, where the machine-wide
      # nf_conntrack_max is read-only (kube-proxy would fail to lower it, and must not).
      maxPerCore: 0
      min: null
      tcpBeLiberal: false
      tcpCloseWaitTimeout: null
      tcpEstablishedTimeout: null
      udpStreamTimeout: 0s
      udpTimeout: 0s
    detectLocal:
      bridgeInterface: ""
      interfaceNamePrefix: ""
    detectLocalMode: ""
    enableProfiling: false
    healthzBindAddress: ""
    hostnameOverride: ""
    iptables:
      localhostNodePorts: null
      masqueradeAll: false
      masqueradeBit: null
      minSyncPeriod: 0s
      syncPeriod: 0s
    metricsBindAddress: ""
    mode: nftables
    nftables:
      masqueradeAll: false
      masqueradeBit: null
      minSyncPeriod: 0s
      syncPeriod: 0s
    nodePortAddresses: null
    oomScoreAdj: null
    portRange: ""
    showHiddenMetricsForVersion: ""
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  labels:
    k8s-app: kube-proxy
  name: kube-proxy
  namespace: kube-system
spec:
  selector:
    matchLabels:
      k8s-app: kube-proxy
  updateStrategy:
    type: RollingUpdate
  template:
    metadata:
      labels:
        k8s-app: kube-proxy
    spec:
      priorityClassName: system-node-critical
      containers:
      - name: kube-proxy
        image: {image}
        imagePullPolicy: IfNotPresent
        command:
        - /usr/local/bin/kube-proxy
        - --config=/var/lib/kube-proxy/config.conf
        - --hostname-override=$(NODE_NAME)
        securityContext:
          privileged: true
        volumeMounts:
        - mountPath: /var/lib/kube-proxy
          name: kube-proxy
        - mountPath: /run/xtables.lock
          name: xtables-lock
          readOnly: false
        # Not kubeadm's /lib/modules: only IPVS mode loads modules (with modprobe, which the
        # image does not have); nftables mode needs no host path but the iptables lock.
        env:
          - name: NODE_NAME
            valueFrom:
              fieldRef:
                fieldPath: spec.nodeName
      hostNetwork: true
      serviceAccountName: kube-proxy
      volumes:
      - name: kube-proxy
        configMap:
          name: kube-proxy
      - name: xtables-lock
        hostPath:
          path: /run/xtables.lock
          type: FileOrCreate
      tolerations:
      - operator: Exists
      nodeSelector:
        kubernetes.io/os: linux
"#
    )
}

/// The backends: lb-probe answering on 8080 with its Pod's name, behind a NodePort Service.
fn backend_manifest(image: &str) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: default
spec:
  replicas: 3
  selector:
    matchLabels: {{app: web}}
  template:
    metadata:
      labels: {{app: web}}
    spec:
      containers:
        - name: web
          image: {image}
          args: ["serve", "--tcp", "0.0.0.0:8080"]
          ports: [{{containerPort: 8080}}]
          readinessProbe:
            tcpSocket: {{port: 8080}}
            periodSeconds: 1
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

// ---------------------------------------------------------------------------------------------
// Helpers

fn ready_endpoints(cp: &ControlPlane, service: &str) -> Result<usize> {
    let v = json_of(
        cp,
        &[
            "get",
            "endpointslices",
            "-l",
            &format!("kubernetes.io/service-name={service}"),
        ],
    )?;
    Ok(v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["endpoints"].as_array().into_iter().flatten())
        .filter(|e| e["conditions"]["ready"] == true)
        .count())
}

/// A shell line run inside the node: (exit code, stdout).
fn node_sh(node: &KubeletNode, script: &str) -> Result<(i32, String)> {
    let out = node
        .command("sh")
        .args(["-c", script])
        .stdin(std::process::Stdio::null())
        .output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    ))
}

/// The source ends (address, port) of the TCP conntrack entries in the node whose original
/// destination is `dst:port`: connections kube-proxy's DNAT translated. lb-agent's translations
/// leave none (the socket path connects to the backend, tc rewrites before conntrack).
fn translated_by_netfilter(node: &KubeletNode, dst: &str, port: u16) -> Result<BTreeSet<String>> {
    let out = node.exec(
        "conntrack",
        &["-L", "-p", "tcp", "-d", dst, "--dport", &port.to_string()],
    )?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let field = |key: &str| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(key))
                    .map(str::to_string)
            };
            Some(format!("{}:{}", field("src=")?, field("sport=")?))
        })
        .collect())
}

/// Connections to the ClusterIP and to the NodePort that netfilter (kube-proxy's rules)
/// translated in the next `window`, the loads running.
fn kube_proxy_translations(
    node: &KubeletNode,
    cluster_ip: &str,
    node_port: u16,
    window: Duration,
) -> Result<(usize, usize)> {
    let node_ip = NODE_IP.to_string();
    let before = (
        translated_by_netfilter(node, cluster_ip, 80)?,
        translated_by_netfilter(node, &node_ip, node_port)?,
    );
    thread::sleep(window);
    let after = (
        translated_by_netfilter(node, cluster_ip, 80)?,
        translated_by_netfilter(node, &node_ip, node_port)?,
    );
    Ok((
        after.0.difference(&before.0).count(),
        after.1.difference(&before.1).count(),
    ))
}

/// The node's conntrack statistics (`conntrack -S`), summed over its CPUs: `insert_failed` counts
/// packets dropped because their new entry could not be inserted (a tuple clash, an extension
/// changed meanwhile), `invalid` packets conntrack could not place in a connection.
fn conntrack_stats(node: &KubeletNode) -> BTreeMap<String, u64> {
    let mut sums = BTreeMap::new();
    for word in node
        .exec("conntrack", &["-S"])
        .unwrap_or_default()
        .split_whitespace()
    {
        if let Some((k, v)) = word.split_once('=')
            && k != "cpu"
            && let Ok(v) = v.parse::<u64>()
        {
            *sums.entry(k.to_string()).or_default() += v;
        }
    }
    sums
}

/// lb-agent's programs attached in the node, as (where, program id, program name): those on the
/// node's cgroup (its `--cgroup-root`), from `bpftool cgroup tree`, and the tc ones through the tcx
/// links pinned under /sys/fs/bpf/lb/links/tc. Not `bpftool link show` nor `bpftool net show`:
/// the first lists every link of the machine (other tests' too), and Debian bookworm's bpftool
/// (7.1) predates tcx: it prints tcx links as `type 11` and `net show` omits them.
fn lb_programs(node: &KubeletNode) -> Result<Vec<(String, u64, String)>> {
    let cgroup = node.cgroup2().display().to_string();
    let tree: Value = serde_json::from_str(&node.exec("bpftool", &["-j", "cgroup", "tree", &cgroup])?)?;
    let mut found = Vec::new();
    for entry in tree.as_array().into_iter().flatten() {
        for p in entry["programs"].as_array().into_iter().flatten() {
            found.push((
                format!(
                    "{} {}",
                    entry["cgroup"].as_str().unwrap_or_default(),
                    p["attach_type"]
                ),
                p["id"].as_u64().unwrap_or_default(),
                p["name"].as_str().unwrap_or_default().to_string(),
            ));
        }
    }
    let pins = node
        .exec("find", &["/sys/fs/bpf/lb/links/tc", "-type", "f"])
        .unwrap_or_default();
    for pin in pins.lines() {
        let link: Value =
            serde_json::from_str(&node.exec("bpftool", &["-j", "link", "show", "pinned", pin])?)?;
        let id = link["prog_id"].as_u64().unwrap_or_default();
        let prog: Value =
            serde_json::from_str(&node.exec("bpftool", &["-j", "prog", "show", "id", &id.to_string()])?)?;
        found.push((
            pin.to_string(),
            id,
            prog["name"].as_str().unwrap_or_default().to_string(),
        ));
    }
    found.retain(|(_, _, name)| name.starts_with("lb_"));
    Ok(found)
}

fn has_kube_proxy_table(node: &KubeletNode) -> Result<bool> {
    Ok(node
        .exec("nft", &["list", "tables"])?
        .lines()
        .any(|l| l.trim() == "table ip kube-proxy"))
}

/// /metrics on the node's 127.0.0.1:10249 (whoever holds the port).
fn metrics(node: &KubeletNode) -> Value {
    lb_tests::probe::http_get(Place::netns(node.netns()), "127.0.0.1:10249", "/metrics")
}

fn metric_lines<'a>(body: &'a str, prefix: &str) -> Vec<&'a str> {
    body.lines().filter(|l| l.starts_with(prefix)).collect()
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn round1(s: f64) -> f64 {
    (s * 10.0).round() / 10.0
}

/// The last lines of the node's container logs of `pod_prefix` (e.g. `kube-system_kube-proxy`).
fn pod_logs(node: &KubeletNode, pod_prefix: &str, lines: usize) -> String {
    let mut out = String::new();
    let pods = node.dir().join("var-log/pods");
    for entry in fs::read_dir(&pods).into_iter().flatten().flatten() {
        if !entry.file_name().to_string_lossy().starts_with(pod_prefix) {
            continue;
        }
        for container in fs::read_dir(entry.path()).into_iter().flatten().flatten() {
            for log in fs::read_dir(container.path()).into_iter().flatten().flatten() {
                let text = fs::read_to_string(log.path()).unwrap_or_default();
                let all: Vec<&str> = text.lines().collect();
                out.push_str(&format!(
                    "--- {}:\n{}\n",
                    log.path().display(),
                    all[all.len().saturating_sub(lines)..].join("\n")
                ));
            }
        }
    }
    out
}

/// What explains a failure on the node: the proxies' logs, the rules, the attachments.
fn diagnostics(node: &KubeletNode) -> String {
    let mut out = String::new();
    for prefix in [
        "kube-system_kube-proxy",
        "kube-system_lb-agent",
        "kube-system_kube-proxy-cleanup",
    ] {
        out.push_str(&pod_logs(node, prefix, 30));
    }
    for script in [
        "ip -br addr",
        "ip route",
        "nft list tables",
        "nft list table ip kube-proxy | head -60",
        "bpftool net",
        "conntrack -C",
    ] {
        let result = node_sh(node, script)
            .map(|(code, s)| format!("(exit {code})\n{s}"))
            .unwrap_or_else(|e| format!("{e:#}"));
        out.push_str(&format!("--- {script}: {result}\n"));
    }
    out.push_str(&node.log_tail());
    // To look at a failing node by hand: LB_KUBELET_HOLD_SECS=600.
    if let Some(secs) = std::env::var("LB_KUBELET_HOLD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        eprintln!(
            "{out}\nholding node {} (its directory {}) for {secs} s",
            node.name(),
            node.dir().display()
        );
        thread::sleep(Duration::from_secs(secs));
    }
    out
}

/// One row of the figures: a step of the guide, from its first command until the next step
/// starts (so every request of the loads belongs to exactly one row).
struct Step {
    row: String,
    conntrack_at_start: BTreeMap<String, u64>,
    commands: Vec<String>,
    started_us: u64,
    took_s: f64,
}

// ---------------------------------------------------------------------------------------------

#[test]
fn guide_switches_a_kube_proxy_node_to_lb_agent_and_back_under_load() -> Result<()> {
    lb_tests::require_root();
    lb_tests::report::started(REPORT, SCENARIO);
    let started = Instant::now();
    let guide = Guide::load()?;
    let images = ["pause", "lb-agent", "lb-probe", "kube-proxy"]
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
    let outside = NetNs::new("lbmo");
    lan.attach(&outside, "eth0", &format!("{CLIENT_IP}/24"));
    // A node has a default route (to its gateway). kube-proxy needs one: a connect() to a
    // ClusterIP is routed before netfilter's DNAT, and without a route to 10.96.0.0/16 it fails
    // with ENETUNREACH (lb-agent's socket path translates before routing and does not care). This
    // LAN has no gateway: the default route points onto it.
    node.netns().ip(&["route", "add", "default", "dev", "eth0"]);
    migrate(&cp, &node, &outside, &images, &guide, started)
        .map_err(|e| anyhow::anyhow!("{e:#}\n{}", diagnostics(&node)))
}

/// The guide on the node, from kube-proxy's deployment to the figures.
fn migrate(
    cp: &ControlPlane,
    node: &KubeletNode,
    outside: &NetNs,
    images: &[kubelet::Image],
    guide: &Guide,
    started: Instant,
) -> Result<()> {
    // The guide's image names, as this node knows them.
    let local = |guide_name: &str| -> String {
        IMAGE_NAMES
            .iter()
            .find(|(g, _)| *g == guide_name)
            .and_then(|(_, short)| images.iter().find(|i| i.name == *short))
            .map(|i| i.reference.clone())
            .expect("an image of IMAGE_NAMES")
    };
    let with_local_images = |yaml: String| -> String {
        IMAGE_NAMES.iter().fold(yaml, |y, (guide_name, _)| {
            y.replace(guide_name, &local(guide_name))
        })
    };

    let work = tempfile::Builder::new().prefix("lb-migration-").tempdir()?;
    let dir = work.path();

    // --- The starting point: kube-proxy deployed as kubeadm does, serving a NodePort Service.
    let kube_proxy_yaml = dir.join("kube-proxy-addon.yaml");
    fs::write(
        &kube_proxy_yaml,
        kube_proxy_manifests(&local("registry.k8s.io/kube-proxy:v1.37.1")),
    )?;
    cp.kubectl(["apply", "-f", &kube_proxy_yaml.display().to_string()])?;
    wait_for("the kube-proxy Pod to be Ready", WAIT, || {
        Ok(pods(cp, "kube-system", "k8s-app=kube-proxy")?
            .into_iter()
            .find(is_ready))
    })?;
    wait_for("kube-proxy's nftables table", WAIT, || {
        Ok(has_kube_proxy_table(node)?.then_some(()))
    })?;

    let web = dir.join("web.yaml");
    fs::write(&web, backend_manifest(&local_probe(images)?))?;
    cp.kubectl(["apply", "-f", &web.display().to_string()])?;
    wait_for("3 ready endpoints of web", WAIT, || {
        Ok((ready_endpoints(cp, "web")? == 3).then_some(()))
    })?;
    let svc = json_of(cp, &["-n", "default", "get", "service", "web"])?;
    let cluster_ip = svc["spec"]["clusterIP"]
        .as_str()
        .context("a ClusterIP")?
        .to_string();
    let node_port = svc["spec"]["ports"][0]["nodePort"]
        .as_u64()
        .context("a NodePort")? as u16;
    let clients = Cgroup::at(
        &node
            .cgroup2()
            .join("clients")
            .strip_prefix(lb_tests::cgroup::cgroup2_mount())?
            .display()
            .to_string(),
    );
    // kube-proxy has programmed the Service: every request answered, from both sides.
    wait_for("kube-proxy to serve web", WAIT, || {
        let inside = lb_tests::probe::tcp(Place::new(node.netns(), &clients), &format!("{cluster_ip}:80"), 5);
        let from_lan = lb_tests::probe::tcp(Place::netns(outside), &format!("{NODE_IP}:{node_port}"), 5);
        let failed: Vec<&Value> = inside
            .iter()
            .chain(&from_lan)
            .filter(|r| r["ok"] != true)
            .collect();
        if failed.is_empty() {
            Ok(Some(()))
        } else {
            bail!("{} of 10 failed: {failed:?}", failed.len())
        }
    })?;
    ensure!(
        lb_programs(node)?.is_empty(),
        "lb-agent programs before lb-agent was deployed"
    );
    let setup_s = started.elapsed().as_secs_f64();

    // --- The loads, from here to the end.
    let loads = NodeLoads::start(node, &clients, outside, &cluster_ip, node_port, LOAD_INTERVAL_MS);
    let loads_started_us = now_us();
    thread::sleep(Duration::from_secs(2));
    let mut steps: Vec<Step> = Vec::new();
    let begin = |steps: &mut Vec<Step>, row: &str| {
        eprintln!("==> {row} ({:.0?} into the test)", started.elapsed());
        steps.push(Step {
            row: row.to_string(),
            conntrack_at_start: conntrack_stats(node),
            commands: Vec::new(),
            started_us: now_us(),
            took_s: 0.0,
        });
        Instant::now()
    };
    steps.push(Step {
        row: "kube-proxy serving, before the migration".into(),
        conntrack_at_start: conntrack_stats(node),
        commands: Vec::new(),
        started_us: loads_started_us,
        took_s: 0.0,
    });
    let mut evidence = serde_json::Map::new();

    // Served by kube-proxy: its table exists, and netfilter translates new connections.
    let (by_kp_inside, by_kp_outside) =
        kube_proxy_translations(node, &cluster_ip, node_port, Duration::from_secs(2))?;
    ensure!(
        by_kp_inside > 0 && by_kp_outside > 0,
        "before the migration, kube-proxy's rules translated {by_kp_inside} ClusterIP and {by_kp_outside} NodePort connections in 2 s"
    );
    evidence.insert(
        "before: connections translated by kube-proxy's rules in 2 s (ClusterIP, NodePort)".into(),
        json!([by_kp_inside, by_kp_outside]),
    );

    // The guide's placeholders.
    let manifests = tempfile::Builder::new().prefix("lb-manifests-").tempdir()?;
    let manifests_dir = format!("{}/", manifests.path().display());
    let file = |name: &str| dir.join(name).display().to_string();
    let mut fill: Vec<(&str, String)> = vec![
        ("manifests/", manifests_dir.clone()),
        ("kube-proxy-cleanup.yaml", file("kube-proxy-cleanup.yaml")),
        ("lb-agent-cleanup.yaml", file("lb-agent-cleanup.yaml")),
        ("kube-proxy-cm.yaml", file("kube-proxy-cm.yaml")),
        ("kube-proxy-ds.yaml", file("kube-proxy-ds.yaml")),
        ("<node-ip>", NODE_IP.to_string()),
        ("<cluster-ip>", cluster_ip.clone()),
        // The guide's example NodePort.
        ("30080", node_port.to_string()),
    ];
    let mut ran: Vec<String> = Vec::new();
    macro_rules! guide {
        ($text:expr) => {{
            let (out, text) = run_guide(cp, &guide.command($text)?, &fill, dir)?;
            ran.push(text);
            out
        }};
    }
    let end_step = |steps: &mut Vec<Step>, t: Instant, ran: &mut Vec<String>| {
        let s = steps.last_mut().expect("a step");
        s.took_s = t.elapsed().as_secs_f64();
        s.commands = std::mem::take(ran);
    };

    // --- 1. Check the prerequisites; read kube-proxy's settings and carry them over.
    let t = begin(&mut steps, "1. read kube-proxy's settings");
    let settings = guide!("kubectl -n kube-system get cm kube-proxy -o jsonpath={.data.config\\.conf}");
    ensure!(
        settings.contains("mode: nftables") && settings.contains("clusterCIDR: 10.244.0.0/16"),
        "kube-proxy's config.conf as the guide reads it: {settings}"
    );
    end_step(&mut steps, t, &mut ran);

    // --- 2. Prepare the manifests: the edits of the guide's `sed` and `kustomize edit` lines
    // (`kubelet::operator_manifests`: API_SERVER_HOST, clusterCIDR, the image; and this
    // machine's --cgroup-root), and what step 1 carried over: kube-proxy ran in nftables mode
    // without nodePortAddresses, so `nodePortAddresses: [primary]`. The guide's `kubectl -n
    // kube-public get cm cluster-info` has nothing to read here (no kubeadm): the control-plane
    // endpoint is the one kube-proxy's kubeconfig.conf names.
    let t = begin(&mut steps, "2. prepare the manifests");
    kubelet::operator_manifests(manifests.path(), node)?;
    ensure!(
        settings.lines().any(|l| l.trim() == "nodePortAddresses: null"),
        "kube-proxy's nodePortAddresses was set: {settings}"
    );
    let configmap = manifests.path().join("configmap.yaml");
    let text = fs::read_to_string(&configmap)?;
    ensure!(text.contains("nodePortAddresses: []"));
    fs::write(
        &configmap,
        text.replace("nodePortAddresses: []", "nodePortAddresses: [primary]"),
    )?;
    guide!("kubectl apply -k manifests/ --dry-run=server");
    end_step(&mut steps, t, &mut ran);

    // --- 4. Stop kube-proxy, restorably.
    let t = begin(&mut steps, "4. stop kube-proxy, restorably");
    guide!("kubectl -n kube-system get ds kube-proxy -o yaml");
    guide!("kubectl -n kube-system get cm kube-proxy -o yaml");
    guide!("kubectl -n kube-system patch ds kube-proxy -p");
    let wait_none = guide.command("kubectl -n kube-system get pods -l k8s-app=kube-proxy")?;
    wait_for("no kube-proxy Pod left", WAIT, || {
        let (out, _) = run_guide(cp, &wait_none, &fill, dir)?;
        Ok(out.trim().is_empty().then_some(()))
    })?;
    ran.push(wait_none.text() + "   # until none is left");
    end_step(&mut steps, t, &mut ran);
    // Its rules stay, frozen, and keep serving.
    ensure!(
        has_kube_proxy_table(node)?,
        "kube-proxy's table went with its Pod"
    );
    let (frozen_inside, frozen_outside) =
        kube_proxy_translations(node, &cluster_ip, node_port, Duration::from_secs(2))?;
    ensure!(
        frozen_inside > 0 && frozen_outside > 0,
        "kube-proxy's frozen rules translated {frozen_inside} and {frozen_outside} connections"
    );
    evidence.insert(
        "kube-proxy stopped: connections translated by its frozen rules in 2 s".into(),
        json!([frozen_inside, frozen_outside]),
    );

    // --- 5. Deploy lb-agent.
    let t = begin(&mut steps, "5. deploy lb-agent");
    guide!("kubectl apply -k manifests/");
    guide!("kubectl -n kube-system rollout status ds/lb-agent");
    // `kubectl logs` reaches kubelet through the control plane's egress proxy into the node.
    let logs_cmd = guide.command("kubectl -n kube-system logs ds/lb-agent")?;
    ensure!(
        logs_cmd.pipe.as_deref().is_some_and(|p| p.starts_with("grep -E")),
        "{logs_cmd:?}"
    );
    let logs = guide!("kubectl -n kube-system logs ds/lb-agent");
    ran.last_mut()
        .expect("ran")
        .push_str(&format!(" | {}", logs_cmd.pipe.as_deref().unwrap_or_default()));
    end_step(&mut steps, t, &mut ran);
    let programmed = logs
        .lines()
        .find(|l| l.contains("data path programmed"))
        .with_context(|| format!("no `data path programmed` in lb-agent's log:\n{logs}"))?;
    ensure!(
        logs.contains("connected to the API server") && !programmed.contains("frontends=0"),
        "lb-agent's log:\n{logs}"
    );
    // When its programs took over, on the loads' clock: a slow or failed request is read against it.
    let attached_at = logs
        .lines()
        .find(|l| l.contains(lb_tests::agent::ATTACHED))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
        .map(|t| round1((t.as_microsecond() as f64 - loads_started_us as f64) / 1e6));
    evidence.insert("lb-agent attached its programs at (s)".into(), json!(attached_at));

    // --- 6. Remove kube-proxy's rules: first the guide's conntrack line, on the node (its shell,
    // as an operator with one), while kube-proxy's NAT rules are still loaded.
    let t = begin(&mut steps, "6. remove kube-proxy's rules");
    let masqueraded = |node: &KubeletNode| -> Result<usize> {
        Ok(node
            .exec("conntrack", &["-L", "-p", "tcp", "--src-nat"])?
            .lines()
            .count())
    };
    let masqueraded_before = masqueraded(node)?;
    let forget = guide.command("conntrack -D")?;
    let out = node
        .command(&forget.words[0])
        .args(&forget.words[1..])
        .stdin(std::process::Stdio::null())
        .output()?;
    let said = String::from_utf8_lossy(&out.stderr).trim().to_string();
    // Exit 1: nothing to delete.
    ensure!(
        out.status.code().is_some_and(|c| c <= 1) && said.contains("flow entries have been deleted"),
        "`{}`: {}: {said}",
        forget.text(),
        out.status
    );
    ran.push(forget.text());
    // Until here kube-proxy's recent masquerade entries could meet lb-agent's (the guide's
    // section 3): the attach's allowance runs to this instant, not to the step's start.
    let forgotten_us = now_us();
    let masqueraded_after = masqueraded(node)?;
    evidence.insert(
        "conntrack entries with a translated source (kube-proxy's masquerade), before and after `conntrack -D`"
            .into(),
        json!([masqueraded_before, masqueraded_after]),
    );
    ensure!(
        masqueraded_before > 0 && masqueraded_after < 10,
        "masqueraded connections in conntrack: {masqueraded_before} before `{}`, {masqueraded_after} after",
        forget.text()
    );

    // Then the guide's DaemonSet (this machine's images).
    let cleanup = guide.yaml("# kube-proxy-cleanup.yaml")?;
    fs::write(dir.join("kube-proxy-cleanup.yaml"), with_local_images(cleanup))?;
    guide!("kubectl apply -f kube-proxy-cleanup.yaml");
    guide!("kubectl -n kube-system rollout status ds/kube-proxy-cleanup");
    let cleanup_pods = pods(cp, "kube-system", "k8s-app=kube-proxy-cleanup")?;
    let cleanup_exit = cleanup_pods
        .first()
        .map(|p| p["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"].clone())
        .unwrap_or_default();
    guide!("kubectl -n kube-system delete -f kube-proxy-cleanup.yaml");
    end_step(&mut steps, t, &mut ran);
    ensure!(
        cleanup_exit == 0,
        "kube-proxy --cleanup exited with {cleanup_exit}"
    );
    // The guide's checks, run on the node.
    let (_, svc_rules) = node_sh(node, "iptables-save | grep -c 'KUBE-SVC\\|KUBE-SEP'")?;
    ensure!(
        svc_rules.trim() == "0",
        "iptables-save still has {svc_rules} KUBE-SVC/KUBE-SEP lines"
    );
    ensure!(
        !has_kube_proxy_table(node)?,
        "kube-proxy's nftables table is still there after the cleanup"
    );

    // --- 7. Verify.
    let t = begin(&mut steps, "7. verify");
    let pod_list = guide!("kubectl -n kube-system get pods -l k8s-app=lb-agent -o wide");
    let agent_pods = pods(cp, "kube-system", "k8s-app=lb-agent")?;
    ensure!(agent_pods.len() == 1, "lb-agent Pods: {pod_list}");
    let pod = agent_pods[0]["metadata"]["name"]
        .as_str()
        .context("a Pod name")?
        .to_string();
    fill.push(("$POD", pod.clone()));
    let services = guide!("kubectl -n kube-system exec $POD -- lb-agent services");
    ensure!(
        services.contains(&cluster_ip) && services.contains(&node_port.to_string()),
        "`lb-agent services` shows neither web's {cluster_ip} nor its NodePort {node_port}:\n{services}"
    );
    // The carried-over `nodePortAddresses: [primary]`: the NodePort on the node's address only.
    for other in ["127.0.0.1", "10.244.1.1"] {
        ensure!(
            !services.contains(&format!("{other}:{node_port}")),
            "the NodePort is served on {other} too, not only on the primary address:\n{services}"
        );
    }
    let stats = guide!("kubectl -n kube-system exec $POD -- lb-agent stats");
    let trace_nodeport = guide!("kubectl -n kube-system exec $POD -- lb-agent trace --src 192.0.2.10");
    let trace_clusterip = guide!("kubectl -n kube-system exec $POD -- lb-agent trace --src <node-ip>");
    eprintln!(
        "lb-agent services:\n{services}\nlb-agent stats:\n{stats}\ntrace (NodePort):\n{trace_nodeport}\ntrace (ClusterIP):\n{trace_clusterip}"
    );
    let events = guide!("kubectl get events -A --field-selector reportingComponent=lb-agent");
    end_step(&mut steps, t, &mut ran);
    ensure!(
        events.trim().is_empty(),
        "lb-agent reported Services it could not program: {events}"
    );
    // The guide's curl lines, with lb-probe's HTTP client: the loads are its first two; then
    // /healthz from outside and /metrics on the node.
    let healthz = lb_tests::probe::http_get(Place::netns(outside), &format!("{NODE_IP}:10256"), "/healthz");
    ensure!(
        healthz["status"] == 200
            && healthz["body"]
                .as_str()
                .unwrap_or_default()
                .contains("\"nodeEligible\":true"),
        "/healthz: {healthz}"
    );
    let lb_metrics = metrics(node);
    let body = lb_metrics["body"].as_str().unwrap_or_default();
    for name in [
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "lb_map_entries",
        "lb_datapath_events_total",
    ] {
        ensure!(
            !metric_lines(body, name).is_empty(),
            "no {name} in /metrics: {lb_metrics}"
        );
    }
    // The attachments, on this node's cgroup and interfaces (see `lb_programs`).
    let attached = lb_programs(node)?;
    for program in [
        "lb_connect4",
        "lb_sendmsg4",
        "lb_recvmsg4",
        "lb_getpeername4",
        "lb_tc_ingress",
        "lb_tc_egress",
    ] {
        ensure!(
            attached.iter().any(|(_, _, name)| name == program),
            "{program} is not attached: {attached:#?}"
        );
    }
    let tcx = attached
        .iter()
        .filter(|(at, _, _)| at.starts_with("/sys/fs/bpf/lb/links/tc"))
        .count();
    evidence.insert(
        "lb-agent attachments in step 7 (cgroup programs, tcx links)".into(),
        json!([attached.len() - tcx, tcx]),
    );
    let services_pin = format!(
        "/sys/fs/bpf/lb/maps/{}",
        lb_common::catalog::pin_name(lb_common::catalog::SERVICES)
    );
    let services_map = node.exec("bpftool", &["map", "dump", "pinned", &services_pin])?;
    ensure!(
        services_map.contains("\"key\"") || services_map.contains("key:"),
        "{services_map}"
    );
    // Served by lb-agent: netfilter translates no new connection.
    let (by_lb_inside, by_lb_outside) =
        kube_proxy_translations(node, &cluster_ip, node_port, Duration::from_secs(2))?;
    ensure!(
        by_lb_inside == 0 && by_lb_outside == 0,
        "with lb-agent, netfilter still translated {by_lb_inside} and {by_lb_outside} connections"
    );
    evidence.insert(
        "lb-agent: connections translated by netfilter in 2 s".into(),
        json!([by_lb_inside, by_lb_outside]),
    );

    // --- Rolling back, 1. kube-proxy back.
    let t = begin(&mut steps, "rollback 1. bring kube-proxy back");
    guide!("kubectl -n kube-system patch ds kube-proxy --type=json");
    guide!("kubectl -n kube-system rollout status ds/kube-proxy");
    end_step(&mut steps, t, &mut ran);
    wait_for("kube-proxy's nftables table again", WAIT, || {
        Ok(has_kube_proxy_table(node)?.then_some(()))
    })?;
    // lb-agent still translates first.
    let (both_inside, both_outside) =
        kube_proxy_translations(node, &cluster_ip, node_port, Duration::from_secs(2))?;
    ensure!(
        both_inside == 0 && both_outside == 0,
        "with both running, netfilter translated {both_inside} and {both_outside} connections"
    );

    // --- 1 again, the other way: had step 8 deleted kube-proxy's DaemonSet and ConfigMap, the
    // backups of step 4 bring them back. Step 8's commands, then those of the backups, while
    // lb-agent still translates (as in a rollback). The new kube-proxy starts over the rules of
    // the one deleted, which it must keep (see KUBE_PROXY_TOOLS in xtask/src/image/recipes.rs).
    let t = begin(
        &mut steps,
        "rollback 1, if it was deleted: step 8, then the backups of step 4",
    );
    guide!("kubectl -n kube-system delete ds kube-proxy");
    guide!("kubectl -n kube-system delete cm kube-proxy");
    wait_for("no kube-proxy Pod left", WAIT, || {
        Ok(pods(cp, "kube-system", "k8s-app=kube-proxy")?
            .is_empty()
            .then_some(()))
    })?;
    guide!("kubectl apply -f kube-proxy-cm.yaml -f kube-proxy-ds.yaml");
    guide!("kubectl -n kube-system rollout status ds/kube-proxy");
    end_step(&mut steps, t, &mut ran);
    let restored = pods(cp, "kube-system", "k8s-app=kube-proxy")?;
    ensure!(
        restored.len() == 1,
        "kube-proxy Pods after the restore: {restored:?}"
    );
    // Once its informers synced, it syncs its rules (at once; its log says nothing more at its
    // default verbosity, and its /metrics port is still lb-agent's): its maps must still hold
    // the Service then.
    let restored_pod = format!(
        "kube-system_{}_",
        restored[0]["metadata"]["name"].as_str().unwrap_or_default()
    );
    wait_for("the restored kube-proxy's informers", WAIT, || {
        let log = pod_logs(node, &restored_pod, 1000);
        Ok(
            (log.contains("\"Caches are synced\" controller=\"service config\"")
                && log.contains("\"Caches are synced\" controller=\"endpoint slice config\""))
            .then_some(()),
        )
    })?;
    thread::sleep(Duration::from_secs(3));
    let map = node.exec("nft", &["list", "map", "ip", "kube-proxy", "service-ips"])?;
    ensure!(
        map.contains(&cluster_ip),
        "the restored kube-proxy emptied its service-ips map: {map}"
    );

    // --- 2. Stop lb-agent.
    let t = begin(&mut steps, "rollback 2. delete lb-agent's DaemonSet");
    guide!("kubectl -n kube-system delete ds lb-agent");
    let deleted = Instant::now();
    let agent_left = pods(cp, "kube-system", "k8s-app=lb-agent")?.len();
    guide!("kubectl -n kube-system wait --for=delete pod -l k8s-app=lb-agent");
    let agent_gone = Instant::now();
    let agent_gone_s = deleted.elapsed().as_secs_f64();
    end_step(&mut steps, t, &mut ran);
    ensure!(
        pods(cp, "kube-system", "k8s-app=lb-agent")?.is_empty(),
        "an lb-agent Pod is left after `kubectl wait --for=delete`"
    );
    // The programs stay attached with the last state.
    ensure!(
        !lb_programs(node)?.is_empty(),
        "lb-agent's programs went with its Pod"
    );

    // --- 3. Detach and unpin, with the guide's DaemonSet.
    let t = begin(&mut steps, "rollback 3. detach and unpin (lb-agent cleanup)");
    let cleanup = guide.yaml("# lb-agent-cleanup.yaml")?;
    fs::write(dir.join("lb-agent-cleanup.yaml"), with_local_images(cleanup))?;
    guide!("kubectl apply -f lb-agent-cleanup.yaml");
    guide!("kubectl -n kube-system rollout status ds/lb-agent-cleanup");
    let cleaned = guide!("kubectl -n kube-system logs -l k8s-app=lb-agent-cleanup -c cleanup --prefix");
    guide!("kubectl -n kube-system delete -f lb-agent-cleanup.yaml");
    end_step(&mut steps, t, &mut ran);
    ensure!(
        cleaned.contains("detached") && cleaned.contains("map pin(s) under /sys/fs/bpf/lb"),
        "lb-agent cleanup said: {cleaned}"
    );

    // --- 4. Remove the rest.
    let t = begin(&mut steps, "rollback 4. remove the rest");
    guide!("kubectl delete -k manifests/ --ignore-not-found");
    end_step(&mut steps, t, &mut ran);

    // The guide's checks: nothing of lb-agent's left, kube-proxy serving.
    let t = begin(&mut steps, "after the rollback: kube-proxy serving");
    ensure!(
        node.exec("ls", &["/sys/fs/bpf/lb"]).is_err(),
        "/sys/fs/bpf/lb is still there"
    );
    let left = lb_programs(node)?;
    ensure!(left.is_empty(), "lb-agent programs left: {left:#?}");
    // Detached everywhere: the programs that were attached in step 7 are unloaded (a program
    // is freed with its last link and map reference).
    wait_for(
        "lb-agent's programs to be unloaded",
        Duration::from_secs(30),
        || {
            let loaded: Vec<u64> = attached
                .iter()
                .map(|(_, id, _)| *id)
                .filter(|id| {
                    node.exec("bpftool", &["prog", "show", "id", &id.to_string()])
                        .is_ok()
                })
                .collect();
            if loaded.is_empty() {
                Ok(Some(()))
            } else {
                bail!("still loaded: {loaded:?}")
            }
        },
    )?;
    ensure!(has_kube_proxy_table(node)?);
    let (after_inside, after_outside) =
        kube_proxy_translations(node, &cluster_ip, node_port, Duration::from_secs(2))?;
    ensure!(
        after_inside > 0 && after_outside > 0,
        "after the rollback, kube-proxy's rules translated {after_inside} and {after_outside} connections"
    );
    evidence.insert(
        "after the rollback: connections translated by kube-proxy's rules in 2 s".into(),
        json!([after_inside, after_outside]),
    );
    // kube-proxy retried and got 10249 (and 10256) once lb-agent was gone.
    let kp_metrics = wait_for("kube-proxy's /metrics on 10249", WAIT, || {
        let m = metrics(node);
        let body = m["body"].as_str().unwrap_or_default().to_string();
        Ok((m["status"] == 200
            && !metric_lines(&body, "kubeproxy_sync_proxy_rules_last_timestamp_seconds").is_empty()
            && metric_lines(&body, "lb_").is_empty())
        .then_some(()))
    });
    kp_metrics?;
    let kube_proxy_metrics_s = agent_gone.elapsed().as_secs_f64();
    end_step(&mut steps, t, &mut ran);

    thread::sleep(Duration::from_secs(2));

    // --- The figures.
    let conntrack_at_end = conntrack_stats(node);
    let ended_us = now_us() + 10_000_000;
    let results = loads.stop();
    let mut rows = Vec::new();
    let (mut attempted, mut failed, mut failures) = (0, 0, Vec::new());
    for (what, r) in &results {
        let (a, f) = load::tally(r);
        attempted += a;
        failed += f;
        failures.extend(load::failures(what, r));
        rows.push(load::row(what, r));
    }
    let window_of = |i: usize| {
        let to = steps.get(i + 1).map(|s| s.started_us).unwrap_or(ended_us);
        (steps[i].started_us, to)
    };
    // The growth of one of the node's conntrack statistics during step `i`.
    let conntrack_delta = |i: usize, stat: &str| {
        let next = steps
            .get(i + 1)
            .map(|s| &s.conntrack_at_start)
            .unwrap_or(&conntrack_at_end);
        let at = |m: &BTreeMap<String, u64>| m.get(stat).copied().unwrap_or_default();
        at(next).saturating_sub(at(&steps[i].conntrack_at_start))
    };
    let step_rows: Vec<Value> = (0..steps.len())
        .map(|i| {
            let (from, to) = window_of(i);
            let in_window = |r: &&Value| r["t_us"].as_u64().is_some_and(|t| t >= from && t < to);
            let by_load: Vec<(u64, u64)> = results
                .iter()
                .map(|(_, r)| {
                    let w: Vec<Value> = r.iter().filter(in_window).cloned().collect();
                    load::tally(&w)
                })
                .collect();
            json!({
                "row": steps[i].row,
                "from (s)": round1(from.saturating_sub(loads_started_us) as f64 / 1e6),
                "command": steps[i].commands.join(" && "),
                "took (s)": round1(steps[i].took_s),
                "attempted": by_load.iter().map(|t| t.0).sum::<u64>(),
                "failed": by_load.iter().map(|t| t.1).sum::<u64>(),
                "failed (ClusterIP, NodePort)": format!("{}, {}", by_load[0].1, by_load[1].1),
                "conntrack insert_failed": conntrack_delta(i, "insert_failed"),
                "conntrack invalid": conntrack_delta(i, "invalid"),
            })
        })
        .collect();
    // Every failed request, and every one served after a retransmission (over 1 s): when (since
    // the loads started), in which step, how.
    let failure_rows: Vec<Value> = results
        .iter()
        .flat_map(|(what, r)| {
            r.iter()
                .filter(|r| r["ok"] != true || r["elapsed_us"].as_u64().is_some_and(|us| us > load::SLOW_US))
                .map(move |r| (*what, r))
        })
        .map(|(what, r)| {
            let t = r["t_us"].as_u64().unwrap_or_default();
            let step = (0..steps.len())
                .find(|&i| {
                    let (from, to) = window_of(i);
                    t >= from && t < to
                })
                .map(|i| steps[i].row.clone())
                .unwrap_or_default();
            json!({
                "load": what,
                "step": step,
                "at (s)": round1(t.saturating_sub(loads_started_us) as f64 / 1e6),
                "after (ms)": r["elapsed_us"].as_u64().unwrap_or_default() / 1000,
                "error": if r["ok"] == true { json!("none (slow)") } else { r["error"].clone() },
            })
        })
        .collect();
    let mut figures = json!({
        "scenario": SCENARIO,
        "attempted": attempted,
        "failed": failed,
        "setup: control plane, node, kube-proxy, backends (s)": round1(setup_s),
        "lb-agent Pod gone after `delete ds` (s)": round1(agent_gone_s),
        "kube-proxy serving /metrics on 10249, after the lb-agent Pod was gone (s)": round1(kube_proxy_metrics_s),
        "lb-agent Pods left right after `delete ds`": agent_left,
        "lb-agent cleanup said": cleaned.trim(),
        "test took (s)": round1(started.elapsed().as_secs_f64()),
        "load": rows,
        "steps": step_rows,
        "failed or slow requests": failure_rows,
    });
    for (k, v) in evidence {
        figures[k] = v;
    }
    lb_tests::report::record(REPORT, &figures);

    // What the guide promises: no failed request, but NodePort connections opened in the instant
    // lb-agent attaches, or while kube-proxy's masquerade entries are still in conntrack (its
    // section 3): reset, from step 5 until step 6's `conntrack -D` returned, at most
    // ATTACH_RESETS of them; and
    // NodePort connections open in the instant the rollback's cleanup detaches lb-agent's
    // programs (its "Rolling back" step 3): reset, at most DETACH_RESETS of them.
    let step_window = |prefix: &str| -> Result<(u64, u64)> {
        let i = steps
            .iter()
            .position(|s| s.row.starts_with(prefix))
            .with_context(|| format!("step {prefix}"))?;
        Ok(window_of(i))
    };
    let [(_, inside), (_, from_lan)] = &results;
    let resets_in = |(from, to): (u64, u64)| {
        from_lan
            .iter()
            .filter(|r| {
                r["ok"] != true
                    && r["errno"] == libc::ECONNRESET
                    && r["t_us"].as_u64().is_some_and(|t| t >= from && t < to)
            })
            .count() as u64
    };
    let attach_resets = resets_in((step_window("5.")?.0, forgotten_us));
    let detach_resets = resets_in(step_window("rollback 3.")?);
    ensure!(
        load::tally(inside).1 == 0
            && failed == attach_resets + detach_resets
            && attach_resets <= ATTACH_RESETS
            && detach_resets <= DETACH_RESETS,
        "requests failed during the migration and the rollback ({attach_resets} of them NodePort resets \
         while lb-agent attached, at most {ATTACH_RESETS} allowed; {detach_resets} while its programs \
         were detached, at most {DETACH_RESETS} allowed): {failures:#?}"
    );
    Ok(())
}

fn local_probe(images: &[kubelet::Image]) -> Result<String> {
    images
        .iter()
        .find(|i| i.name == "lb-probe")
        .map(|i| i.reference.clone())
        .context("the lb-probe image")
}

#[test]
fn shell_words_of_the_guide() {
    let c = shell_words(
        "kubectl -n kube-system get cm kube-proxy -o jsonpath='{.data.config\\.conf}' > x.yaml  # note",
    )
    .unwrap();
    assert_eq!(
        c.words,
        [
            "kubectl",
            "-n",
            "kube-system",
            "get",
            "cm",
            "kube-proxy",
            "-o",
            "jsonpath={.data.config\\.conf}"
        ]
    );
    assert_eq!(c.redirect.as_deref(), Some("x.yaml"));
    let c = shell_words("kubectl logs ds/x | grep -E 'a|b'").unwrap();
    assert_eq!(c.words, ["kubectl", "logs", "ds/x"]);
    assert_eq!(c.pipe.as_deref(), Some("grep -E 'a|b'"));
    assert!(shell_words("(cd manifests && kustomize edit)").is_none());
    assert!(shell_words("   # only a comment").is_none());
    let guide = Guide::load().unwrap();
    for text in [
        "kubectl -n kube-system patch ds kube-proxy -p",
        "kubectl -n kube-system patch ds kube-proxy --type=json",
        "kubectl apply -f kube-proxy-cm.yaml -f kube-proxy-ds.yaml",
        "kubectl apply -k manifests/",
        "kubectl -n kube-system logs ds/lb-agent",
        "kubectl -n kube-system get pods -l k8s-app=lb-agent -o wide",
        "kubectl -n kube-system wait --for=delete pod -l k8s-app=lb-agent",
        "conntrack -D -p tcp --src-nat --state TIME_WAIT",
        "kubectl -n kube-system exec $POD -- lb-agent trace --src <node-ip>",
    ] {
        guide.command(text).unwrap();
    }
    let backup = guide
        .command("kubectl -n kube-system get ds kube-proxy -o yaml")
        .unwrap();
    assert_eq!(
        backup.redirect.as_deref(),
        Some("kube-proxy-ds.yaml"),
        "{backup:?}"
    );
    assert!(
        guide
            .yaml("# kube-proxy-cleanup.yaml")
            .unwrap()
            .contains("--cleanup")
    );
    assert!(
        guide
            .yaml("# lb-agent-cleanup.yaml")
            .unwrap()
            .starts_with("# lb-agent-cleanup.yaml")
    );
}
