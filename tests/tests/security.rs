//! Security checks of the agent and its operator commands:
//!
//! - the commands that change kernel state (`cleanup`, running the agent) refuse without
//!   privileges, say what is missing, and change nothing;
//! - the read-only commands (`services`, `backends`, `stats`) open pinned maps, which takes
//!   CAP_BPF (or root): they refuse clearly for an unprivileged user and work for root;
//! - the listen defaults are the documented ones (`/metrics` on loopback only);
//! - nothing listens on an undocumented port: with a LoadBalancer Service with
//!   externalTrafficPolicy=Local, the node namespace has exactly /healthz, /metrics and the
//!   Service's health-check NodePort open;
//! - loadBalancerSourceRanges hold for real connections: on a node with pods and external clients
//!   (network namespaces), clients inside the ranges (an external one, a pod) are served through
//!   the load-balancer IP, clients outside them (an external one, a pod, the node itself) never.
//!
//! Each check writes its figures for docs/reliability.md (scenario 7, `7-security-*.json`); the
//! RBAC part of scenario 7 is checked against the real API server in e2e_manifests.rs.
//!
//! "Unprivileged" is uid/gid 65534 (nobody) without supplementary groups or capabilities,
//! through util-linux `setpriv`.

use std::{
    collections::BTreeSet,
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use lb_agent::datapath::bpffs::is_bpffs;
use lb_tests::{
    agent::{Agent, AgentOptions, bpf_root_in},
    bpffs::BpfFs,
    cgroup::Cgroup,
    fixtures::{State, service, slice, write_manifests},
    netns::NetNs,
    probe,
    process::{Place, Proc, run_in, workspace_bin},
    report::{record, started},
    require_root,
    topo::{Lan, Node as TopoNode, external_client},
};
use serde_json::{Value, json};

const NODE: &str = "node-a";
const NOBODY: u32 = 65_534;
const HEALTH_CHECK_NODE_PORT: i32 = 32_123;

/// Words an error about missing privileges may use.
const PRIVILEGE_WORDS: &[&str] = &[
    "permission",
    "not permitted",
    "cap_bpf",
    "cap_sys_admin",
    "cap_net_admin",
    "root",
    "privilege",
];

fn says_what_is_missing(text: &str) -> bool {
    let lower = text.to_lowercase();
    PRIVILEGE_WORDS.iter().any(|w| lower.contains(w))
}

/// A refusal names the kernel's answer once: not twice in one chain ("X: X"), nor once in an
/// ERROR log line and again in an "error:" line.
fn says_it_once(text: &str) -> bool {
    text.matches("Permission denied").count() + text.matches("Operation not permitted").count() == 1
}

/// A Service worth a health-check NodePort: LoadBalancer, externalTrafficPolicy=Local, with a
/// local endpoint.
fn objects() -> (Vec<Service>, Vec<EndpointSlice>) {
    let mut svc = service("demo", "web")
        .cluster_ip("10.96.0.20")
        .port("http", "TCP", 80, 8080)
        .node_port(30080)
        .load_balancer_ip("203.0.113.20")
        .external_traffic_policy("Local")
        .build();
    svc.spec.as_mut().expect("spec").health_check_node_port = Some(HEALTH_CHECK_NODE_PORT);
    let sl = slice("demo", "web", "web-1")
        .endpoint("10.244.1.2", NODE, State::Ready)
        .port("http", "TCP", 8080)
        .build();
    (vec![svc], vec![sl])
}

/// A directory everybody may read (tempdir makes 0700 ones).
fn world_readable_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

/// The manifests folder, readable by an unprivileged user too.
fn manifests() -> tempfile::TempDir {
    let dir = world_readable_tempdir();
    let (services, slices) = objects();
    write_manifests(dir.path(), "objects.yaml", &services, &slices);
    fs::set_permissions(dir.path().join("objects.yaml"), fs::Permissions::from_mode(0o644)).expect("chmod");
    dir
}

/// Runs `lb-agent args` in `place`, as root or as nobody, to completion (killed after `timeout`).
fn lb_agent(place: Place<'_>, unprivileged: bool, args: &[&str], timeout: Duration) -> Output {
    let bin = workspace_bin("lb-agent");
    let mut cmd = if unprivileged {
        let mut c = Command::new("setpriv");
        c.args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        ])
        .arg(&bin);
        c
    } else {
        Command::new(&bin)
    };
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    place.apply(&mut cmd);
    let mut child = cmd.spawn().expect("spawn lb-agent");
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "lb-agent {args:?} (unprivileged: {unprivileged}) still running after {timeout:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every pin under `dir` (recursively).
fn pins(dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(pins(&p));
            } else {
                out.insert(p);
            }
        }
    }
    out
}

/// The agent (as root) in `ns` and `cgroup`, pinned under `bpf_root`, programmed from the
/// manifests in `manifests`; returned once its programs are attached.
fn start_agent(ns: &NetNs, cgroup: &Cgroup, bpf_root: PathBuf, manifests: &Path) -> Agent {
    Agent::start(AgentOptions {
        netns: ns,
        cgroup,
        bpf_root,
        node_name: NODE.into(),
        manifests: Some(manifests.to_path_buf()),
        kubeconfig: None,
        extra_args: vec![],
    })
}

/// An agent (as root) in its own node namespace, bpffs and cgroup, programmed from manifests.
struct Node {
    agent: Option<Agent>,
    bpf_root: PathBuf,
    _manifests: tempfile::TempDir,
    cgroup: Cgroup,
    ns: NetNs,
    bpffs: BpfFs,
}

impl Node {
    fn start() -> Node {
        require_root();
        let bpffs = BpfFs::new();
        let cgroup = Cgroup::new("lbsec");
        let ns = NetNs::new("lbsec");
        let manifests = manifests();
        let bpf_root = bpf_root_in(bpffs.path());
        let agent = start_agent(&ns, &cgroup, bpf_root.clone(), manifests.path());
        Node {
            agent: Some(agent),
            bpf_root,
            _manifests: manifests,
            cgroup,
            ns,
            bpffs,
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(agent) = self.agent.take() {
            agent.stop();
        }
    }
}

#[test]
fn help_shows_the_documented_listen_defaults() {
    let out = Command::new(workspace_bin("lb-agent"))
        .arg("--help")
        .output()
        .expect("lb-agent --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    // The option's paragraph: from its name to the next option.
    let paragraph = |flag: &str| -> String {
        let start = help
            .find(flag)
            .unwrap_or_else(|| panic!("{flag} missing from --help:\n{help}"));
        let rest = &help[start + flag.len()..];
        let end = rest
            .find("\n      --")
            .or_else(|| rest.find("\n  -"))
            .unwrap_or(rest.len());
        rest[..end].to_string()
    };
    let metrics = paragraph("--metrics-bind-address");
    assert!(
        metrics.contains("[default: 127.0.0.1:10249]"),
        "metrics must default to loopback only: {metrics:?}"
    );
    let healthz = paragraph("--healthz-bind-address");
    assert!(
        healthz.contains("[default: 0.0.0.0:10256]"),
        "healthz default: {healthz:?}"
    );
}

#[test]
fn operator_commands_need_privileges_say_so_and_change_nothing() {
    const SCENARIO: &str = "The CLI's commands that change kernel state (and those that read the pinned maps) run as an unprivileged user (nobody, no capabilities)";
    started("7-security-privileges", SCENARIO);
    let node = Node::start();
    // What each unprivileged attempt did, for the report.
    let mut attempts: Vec<Value> = Vec::new();
    let attempt = |what: String, out: &Output| -> Value {
        json!({
            "command": what,
            "refused": !out.status.success(),
            "says_why": says_what_is_missing(&text(out)),
            "message": text(out).trim().lines().last().unwrap_or_default().chars().take(160).collect::<String>(),
        })
    };
    let root = node.bpf_root.to_str().expect("utf-8 path").to_owned();
    let place = Place::netns(&node.ns);
    let short = Duration::from_secs(30);
    let before = pins(&node.bpf_root);
    assert!(
        before
            .iter()
            .any(|p| p.to_string_lossy().contains("lb4_services")),
        "the agent pinned its maps: {before:?}"
    );

    // Read-only commands open pinned maps (CAP_BPF or root): they work for root...
    for cmd in ["services", "backends", "stats"] {
        let out = lb_agent(place, false, &[cmd, "--bpf-root", &root], short);
        assert!(out.status.success(), "lb-agent {cmd} as root: {}", text(&out));
        if cmd == "services" {
            assert!(
                text(&out).contains("10.96.0.20"),
                "lb-agent services: {}",
                text(&out)
            );
        }
    }
    // ... and refuse an unprivileged user, saying why.
    let mut unclear = Vec::new();
    for cmd in ["services", "backends", "stats"] {
        let out = lb_agent(place, true, &[cmd, "--bpf-root", &root], short);
        assert!(
            !out.status.success(),
            "lb-agent {cmd} as nobody succeeded: {}",
            text(&out)
        );
        eprintln!("lb-agent {cmd} as nobody: {}", text(&out).trim());
        attempts.push(attempt(format!("lb-agent {cmd}"), &out));
        if !says_what_is_missing(&text(&out)) || !says_it_once(&text(&out)) {
            unclear.push(format!("lb-agent {cmd}: {}", text(&out).trim()));
        }
    }

    // cleanup as nobody: refused, clearly, and every pin is still there.
    let out = lb_agent(place, true, &["cleanup", "--bpf-root", &root], short);
    eprintln!("lb-agent cleanup as nobody: {}", text(&out).trim());
    attempts.push(attempt("lb-agent cleanup".into(), &out));
    assert!(
        !out.status.success(),
        "cleanup as nobody succeeded: {}",
        text(&out)
    );
    if !says_what_is_missing(&text(&out)) || !says_it_once(&text(&out)) {
        unclear.push(format!("lb-agent cleanup: {}", text(&out).trim()));
    }
    assert_eq!(
        pins(&node.bpf_root),
        before,
        "an unprivileged cleanup removed pins"
    );

    // Running the agent as nobody: on the live bpffs (pins owned by root), and on a fresh
    // directory it owns (it would have to mount bpffs there).
    let own = world_readable_tempdir();
    let own_root = own.path().join("lb");
    std::os::unix::fs::chown(own.path(), Some(NOBODY), Some(NOBODY)).expect("chown");
    let manifests = manifests();
    let cgroup = node.cgroup.path().to_str().expect("utf-8").to_owned();
    for bpf_root in [root.clone(), own_root.to_str().expect("utf-8").to_owned()] {
        let out = lb_agent(
            place,
            true,
            &[
                "--manifests",
                manifests.path().to_str().expect("utf-8"),
                "--bpf-root",
                &bpf_root,
                "--cgroup-root",
                &cgroup,
                "--hostname-override",
                NODE,
                "--healthz-bind-address",
                "",
                "--metrics-bind-address",
                "",
            ],
            Duration::from_secs(60),
        );
        eprintln!("lb-agent --bpf-root {bpf_root} as nobody: {}", text(&out).trim());
        attempts.push(attempt(
            if bpf_root == root {
                "lb-agent (run) on the live pins".to_string()
            } else {
                "lb-agent (run) on a fresh directory it owns".to_string()
            },
            &out,
        ));
        assert!(!out.status.success(), "the agent ran as nobody: {}", text(&out));
        if !says_what_is_missing(&text(&out)) || !says_it_once(&text(&out)) {
            unclear.push(format!("lb-agent --bpf-root {bpf_root}: {}", text(&out).trim()));
        }
    }
    assert_eq!(
        pins(&node.bpf_root),
        before,
        "an unprivileged agent changed the pins"
    );
    assert!(
        !own_root.exists(),
        "an unprivileged agent created {}",
        own_root.display()
    );
    // A bpffs only root may enter (/sys/fs/bpf is often mounted with mode 0700): refused too
    // (see `read_only_commands_behind_a_closed_bpffs_say_permission_denied`).
    let out = services_behind_a_closed_bpffs(&node);
    attempts.push(attempt("lb-agent services, bpffs mode 0700".into(), &out));
    assert!(!out.status.success(), "{}", text(&out));
    // The root agent is still serving.
    let out = lb_agent(place, false, &["services", "--bpf-root", &root], short);
    assert!(out.status.success() && text(&out).contains("10.96.0.20"));
    let refused = attempts.iter().filter(|a| a["refused"] == true).count();
    let clear = attempts.iter().filter(|a| a["says_why"] == true).count();
    record(
        "7-security-privileges",
        &json!({
            "scenario": SCENARIO,
            "attempted": attempts.len(),
            "failed": attempts.len() - refused,
            "refused": refused,
            "refusals_saying_what_is_missing": clear,
            "unclear_refusals": unclear.len(),
            "pins_changed": false,
            "attempts": attempts,
        }),
    );
    assert!(
        unclear.is_empty(),
        "these refusals do not say what is missing (permission, CAP_BPF or root), or say it more \
         than once:\n{}",
        unclear.join("\n")
    );
}

/// `lb-agent services` as nobody while the bpffs root is mode 0700.
fn services_behind_a_closed_bpffs(node: &Node) -> Output {
    let root = node.bpf_root.to_str().expect("utf-8 path");
    let mode = fs::metadata(node.bpffs.path())
        .expect("stat")
        .permissions()
        .mode();
    fs::set_permissions(node.bpffs.path(), fs::Permissions::from_mode(0o700)).expect("chmod");
    let out = lb_agent(
        Place::netns(&node.ns),
        true,
        &["services", "--bpf-root", root],
        Duration::from_secs(30),
    );
    fs::set_permissions(node.bpffs.path(), fs::Permissions::from_mode(mode)).expect("chmod");
    eprintln!("lb-agent services as nobody, bpffs 0700: {}", text(&out).trim());
    out
}

/// Regression: the read-only commands checked `Path::exists()`, which is false when the directory
/// cannot be entered, and answered "no pinned maps under ... (start the agent, or pass
/// --bpf-root)" while the agent ran: they say that permission was denied, and that root or
/// CAP_BPF is needed.
#[test]
fn read_only_commands_behind_a_closed_bpffs_say_permission_denied() {
    let node = Node::start();
    let out = services_behind_a_closed_bpffs(&node);
    assert!(!out.status.success());
    assert!(
        says_what_is_missing(&text(&out)) && !text(&out).contains("no pinned maps"),
        "{}",
        text(&out)
    );
}

/// Regression: with a --bpf-root outside any bpffs, the agent mounted a bpffs over the nearest
/// existing ancestor of the root (as root, `--bpf-root /var/lib/lb` hid /var/lib). It mounts one
/// at the root itself, which it creates. Its log, a pipe here, has no colour codes.
#[test]
fn the_agent_mounts_bpffs_at_its_root_never_over_an_ancestor() {
    require_root();
    let parent = world_readable_tempdir();
    fs::write(parent.path().join("keep"), "still here").expect("write");
    let root = parent.path().join("lb");
    let cgroup = Cgroup::new("lbmnt");
    let ns = NetNs::new("lbmnt");
    let manifests = manifests();
    let agent = start_agent(&ns, &cgroup, root.clone(), manifests.path());
    let mounted_at_root = is_bpffs(&root);
    let ancestor_untouched = !is_bpffs(parent.path()) && parent.path().join("keep").exists();
    let log = agent.log();
    agent.stop();
    let _ = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH);
    let _ = fs::remove_dir(&root);
    assert!(mounted_at_root, "no bpffs at {}; log:\n{log}", root.display());
    assert!(
        ancestor_untouched,
        "a bpffs hides {}; log:\n{log}",
        parent.path().display()
    );
    assert!(!log.contains('\x1b'), "colour codes in a piped log:\n{log}");
}

/// A --bpf-root outside any bpffs that holds files is refused, clearly and once: mounting there
/// would hide them.
#[test]
fn the_agent_refuses_to_mount_bpffs_over_files() {
    require_root();
    let root = world_readable_tempdir();
    fs::write(root.path().join("keep"), "still here").expect("write");
    let ns = NetNs::new("lbmnt");
    let cgroup = Cgroup::new("lbmnt");
    let manifests = manifests();
    let out = lb_agent(
        Place::netns(&ns),
        false,
        &[
            "--manifests",
            manifests.path().to_str().expect("utf-8"),
            "--bpf-root",
            root.path().to_str().expect("utf-8"),
            "--cgroup-root",
            cgroup.path().to_str().expect("utf-8"),
            "--hostname-override",
            NODE,
            "--healthz-bind-address",
            "",
            "--metrics-bind-address",
            "",
        ],
        Duration::from_secs(60),
    );
    assert!(!out.status.success(), "{}", text(&out));
    assert!(!is_bpffs(root.path()) && root.path().join("keep").exists());
    assert_eq!(
        text(&out)
            .matches("is not empty: refusing to mount a bpffs over it")
            .count(),
        1,
        "{}",
        text(&out)
    );
}

/// The listening sockets of the namespace: (protocol, local address, port).
fn listening(ns: &NetNs) -> BTreeSet<(String, String, u16)> {
    let out = ns.exec_ok("ss", &["-H", "-l", "-n", "-t", "-u"]);
    out.lines()
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // Netid State Recv-Q Send-Q Local:Port Peer:Port
            let (proto, local) = (cols.first()?, cols.get(4)?);
            let (addr, port) = local.rsplit_once(':')?;
            Some((proto.to_string(), addr.to_string(), port.parse().ok()?))
        })
        .collect()
}

#[test]
fn nothing_listens_on_an_undocumented_port() {
    let node = Node::start();
    let expected: BTreeSet<(String, String, u16)> = [
        ("tcp", "0.0.0.0", 10_256),
        ("tcp", "127.0.0.1", 10_249),
        ("tcp", "0.0.0.0", HEALTH_CHECK_NODE_PORT as u16),
    ]
    .into_iter()
    .map(|(p, a, n)| (p.to_string(), a.to_string(), n))
    .collect();
    // The servers start around the first sync; give them a moment.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = listening(&node.ns);
    while got != expected && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        got = listening(&node.ns);
    }
    let show = |set: &mut dyn Iterator<Item = &(String, String, u16)>| -> Vec<String> {
        set.map(|(p, a, n)| format!("{p} {a}:{n}")).collect()
    };
    let undocumented = show(&mut got.difference(&expected));
    record(
        "7-security-listening",
        &json!({
            "scenario": "Listening sockets of the node's network namespace with the agent running (a LoadBalancer Service with externalTrafficPolicy Local), against the documented ones",
            "attempted": null,
            "failed": null,
            "documented": show(&mut expected.iter()),
            "found": show(&mut got.iter()),
            "undocumented": undocumented.len(),
            "missing": show(&mut expected.difference(&got)),
            "metrics_on_loopback_only": got.iter().filter(|s| s.2 == 10_249).all(|s| s.1 == "127.0.0.1")
                && got.contains(&("tcp".to_string(), "127.0.0.1".to_string(), 10_249)),
        }),
    );
    assert_eq!(
        got,
        expected,
        "listening sockets in the node namespace (only /healthz, /metrics on loopback and the \
         health-check NodePort are documented); agent log:\n{}",
        node.agent.as_ref().map(Agent::log).unwrap_or_default()
    );
    // And they answer as documented: the health-check NodePort reports the local endpoint.
    let out = node.ns.exec_ok(
        "curl",
        &[
            "-s",
            "--max-time",
            "5",
            &format!("http://127.0.0.1:{HEALTH_CHECK_NODE_PORT}/"),
        ],
    );
    assert!(out.contains("localEndpoints"), "health check answer: {out}");
}

/// `count` TCP connections from `place` to `to` with a short timeout: (attempted, served, errnos).
fn connections(place: Place<'_>, to: &str, count: u32) -> (usize, usize, BTreeSet<i64>) {
    let out = run_in(
        place,
        workspace_bin("lb-probe"),
        &[
            "tcp",
            "--connect",
            to,
            "--count",
            &count.to_string(),
            "--timeout-ms",
            "300",
        ],
    );
    assert!(
        out.status.success(),
        "lb-probe: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let served = results.iter().filter(|r| r["ok"] == true).count();
    let errnos = results.iter().filter_map(|r| r["errno"].as_i64()).collect();
    (results.len(), served, errnos)
}

/// loadBalancerSourceRanges with real sockets: a LoadBalancer Service whose ranges admit one
/// external client and one pod. Through the load-balancer IP, those two are served (tc path);
/// another external client and another pod are dropped (tc), and the node itself, outside the
/// ranges, is refused at connect() (socket path, EHOSTUNREACH). The NodePort is not filtered
/// (kube-proxy applies the ranges to the load-balancer IP only).
#[test]
fn load_balancer_source_ranges_hold_for_real_connections() {
    const SCENARIO: &str = "loadBalancerSourceRanges with real connections: a LoadBalancer IP whose ranges admit one external client and one pod";
    started("7-security-source-ranges", SCENARIO);
    require_root();
    let bpffs = BpfFs::new();
    let cgroup = Cgroup::new("lbsec");
    let lan = Lan::new();
    let mut node = TopoNode::new(1);
    let node_ip = node.attach_lan(&lan);
    for n in 2..5 {
        node.add_pod(n);
    }
    let backend = node.pods[2].ip.to_string();
    let _server: Proc = probe::server(Place::netns(&node.pods[2].ns), &backend, &["0.0.0.0:8080"], &[]);
    let (allowed_ns, allowed_ip) = external_client(&lan, 1);
    let (denied_ns, denied_ip) = external_client(&lan, 2);
    let lb_ip = "203.0.113.30";
    for ns in [&allowed_ns, &denied_ns] {
        ns.ip(&[
            "route",
            "add",
            &format!("{lb_ip}/32"),
            "via",
            &node_ip.to_string(),
        ]);
    }
    let (allowed_pod, denied_pod) = (node.pods[0].ip, node.pods[1].ip);
    let manifests = world_readable_tempdir();
    write_manifests(
        manifests.path(),
        "objects.yaml",
        &[service("demo", "ranged")
            .cluster_ip("10.96.0.30")
            .port("http", "TCP", 80, 8080)
            .node_port(30_130)
            .load_balancer_ip(lb_ip)
            .source_ranges(&[&format!("{allowed_ip}/32"), &format!("{allowed_pod}/32")])
            .build()],
        &[slice("demo", "ranged", "ranged-1")
            .endpoint(&backend, NODE, State::Ready)
            .port("http", "TCP", 8080)
            .build()],
    );
    let agent = Agent::start(AgentOptions {
        netns: &node.ns,
        cgroup: &cgroup,
        bpf_root: bpf_root_in(bpffs.path()),
        node_name: NODE.into(),
        manifests: Some(manifests.path().to_path_buf()),
        kubeconfig: None,
        extra_args: vec!["--cluster-cidr".into(), "10.244.0.0/16".into()],
    });
    let to_lb = format!("{lb_ip}:80");
    let to_node_port = format!("{node_ip}:30130");
    // (who, place, destination, admitted)
    let flows: [(String, Place<'_>, &str, bool); 6] = [
        (
            format!("external client {allowed_ip} (in the ranges)"),
            Place::netns(&allowed_ns),
            &to_lb,
            true,
        ),
        (
            format!("pod {allowed_pod} (in the ranges)"),
            Place::new(&node.pods[0].ns, &cgroup),
            &to_lb,
            true,
        ),
        (
            format!("external client {denied_ip} (outside)"),
            Place::netns(&denied_ns),
            &to_lb,
            false,
        ),
        (
            format!("pod {denied_pod} (outside)"),
            Place::new(&node.pods[1].ns, &cgroup),
            &to_lb,
            false,
        ),
        (
            format!("the node itself, {node_ip} (outside)"),
            Place::new(&node.ns, &cgroup),
            &to_lb,
            false,
        ),
        (
            format!("external client {denied_ip} (outside) to the NodePort, which the ranges do not cover"),
            Place::netns(&denied_ns),
            &to_node_port,
            true,
        ),
    ];
    let mut per_flow = Vec::new();
    let (mut admitted_attempts, mut admitted_failed, mut denied_attempts, mut denied_served) = (0, 0, 0, 0);
    let mut wrong = Vec::new();
    for (who, place, to, admitted) in flows {
        let (attempted, served, errnos) = connections(place, to, 20);
        let failed = attempted - served;
        if admitted {
            admitted_attempts += attempted;
            admitted_failed += failed;
        } else {
            denied_attempts += attempted;
            denied_served += served;
        }
        if (admitted && failed > 0) || (!admitted && served > 0) || attempted == 0 {
            wrong.push(format!("{who} -> {to}: {served} of {attempted} served"));
        }
        per_flow.push(json!({
            "load": format!("{who} -> {to}"),
            "attempted": attempted,
            "failed": failed,
            "expected": if admitted { "all served" } else { "all refused" },
            "errnos": errnos.into_iter().collect::<Vec<_>>(),
        }));
    }
    let stats = run_in(
        Place::netns(&node.ns),
        workspace_bin("lb-agent"),
        &[
            "stats",
            "-o",
            "json",
            "--bpf-root",
            bpf_root_in(bpffs.path()).to_str().expect("utf-8"),
        ],
    );
    let denied_counter = serde_json::from_slice::<Value>(&stats.stdout)
        .ok()
        .and_then(|v| v["source_range_denied"].as_u64());
    record(
        "7-security-source-ranges",
        &json!({
            "scenario": SCENARIO,
            "load": per_flow,
            "attempted": admitted_attempts,
            "failed": admitted_failed,
            "denied_attempts": denied_attempts,
            "denied_but_served": denied_served,
            "source_range_denied_counter": denied_counter,
        }),
    );
    let log = agent.log();
    drop(agent);
    assert!(wrong.is_empty(), "{wrong:?}; agent log:\n{log}");
}

/// What a start may have changed under a bpf root: every path below it, with the id of the map or
/// link a pin holds (a pin moved aside and replaced by a new map keeps its name, not its id).
fn pin_state(root: &Path) -> Vec<(String, Option<u32>)> {
    let mut all = BTreeSet::new();
    fn walk(dir: &Path, into: &mut BTreeSet<PathBuf>) {
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            into.insert(e.path());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&e.path(), into);
            }
        }
    }
    walk(root, &mut all);
    all.into_iter()
        .map(|p| {
            let id = aya::maps::MapInfo::from_pin(&p)
                .map(|i| i.id())
                .or_else(|_| aya::programs::links::PinnedLink::from_pin(&p).map(|_| 0))
                .ok();
            (p.strip_prefix(root).unwrap_or(&p).display().to_string(), id)
        })
        .collect()
}

/// Issue 18: a start that fails leaves the node as it was. The configuration, the kubeconfig and
/// the kernel are checked before anything is touched; a failure after that (here the kernel
/// refusing a map, as it refuses one too large for its memory) undoes the bpffs mount, the new
/// pins and the pins moved aside for a migration. Checked on a fresh node and on one a previous
/// agent programmed, whose pins must keep their maps (their ids) and whose programs keep serving.
#[test]
fn a_failed_start_leaves_the_node_as_it_was() {
    require_root();
    const SCENARIO: &str = "Starts that fail, on a fresh node (no bpffs mounted at the root) and on one a previous agent programmed: the pins, maps and mounts under the bpf root compared before and after";
    started("8-failed-start", SCENARIO);
    let ns = NetNs::new("lbfail");
    let cgroup = Cgroup::new("lbfail");
    let manifests = manifests();
    let common = |root: &Path| -> Vec<String> {
        [
            "--bpf-root",
            root.to_str().expect("utf-8"),
            "--hostname-override",
            NODE,
            "--healthz-bind-address",
            "",
            "--metrics-bind-address",
            "",
        ]
        .map(String::from)
        .to_vec()
    };
    let in_cgroup = ["--cgroup-root", cgroup.path().to_str().expect("utf-8")].map(String::from);
    let with_manifests = ["--manifests", manifests.path().to_str().expect("utf-8")].map(String::from);
    // 2^32 buckets: the kernel refuses the conntrack map (E2BIG) after the other maps are pinned.
    let refused_map = ["--bpf-ct-map-max", "4000000000"].map(String::from);
    let failures: [(&str, Vec<String>, &str); 3] = [
        (
            "a kubeconfig that does not exist",
            [
                in_cgroup.to_vec(),
                vec!["--kubeconfig".into(), "/nonexistent/kubeconfig".into()],
            ]
            .concat(),
            "reading kubeconfig /nonexistent/kubeconfig",
        ),
        (
            "a --cgroup-root that is not a cgroup v2 directory",
            [
                with_manifests.to_vec(),
                vec!["--cgroup-root".into(), "/proc".into()],
            ]
            .concat(),
            "--cgroup-root /proc",
        ),
        (
            "a map the kernel refuses",
            [with_manifests.to_vec(), in_cgroup.to_vec(), refused_map.to_vec()].concat(),
            "loading the data path",
        ),
    ];

    let mut attempts = Vec::new();
    let mut changed = Vec::new();
    let mut try_start = |node: &str, root: &Path, fresh_parent: Option<&Path>| {
        for (what, args, says) in &failures {
            let before = pin_state(root);
            let mounted_before = is_bpffs(root);
            let args: Vec<String> = [common(root), args.clone()].concat();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = lb_agent(Place::netns(&ns), false, &args, Duration::from_secs(60));
            let log = text(&out);
            let after = pin_state(root);
            let same = before == after && mounted_before == is_bpffs(root);
            let root_gone = fresh_parent.is_none_or(|_| !root.exists());
            let parent_untouched = fresh_parent.is_none_or(|p| !is_bpffs(p));
            let refused = !out.status.success();
            let says_why = log.contains(says);
            if !(same && root_gone && parent_untouched && refused && says_why) {
                changed.push(format!(
                    "{node}, {what}: refused {refused}, says {says:?}: {says_why}, pins unchanged {same}, root gone {root_gone}, parent untouched {parent_untouched}\nbefore {before:?}\nafter {after:?}\n{log}"
                ));
            }
            let last = log
                .lines()
                .rev()
                .find_map(|l| l.split_once("ERROR "))
                .map_or("", |(_, m)| m);
            attempts.push(json!({
                "node": node,
                "failure": what,
                "refused": refused,
                "left_as_it_was": same && root_gone && parent_untouched,
                "message": last.chars().take(160).collect::<String>(),
            }));
        }
    };

    // A fresh node: the root's parent is no bpffs, so a start would mount one at the root.
    let parent = world_readable_tempdir();
    let fresh_root = parent.path().join("lb");
    try_start("fresh node", &fresh_root, Some(parent.path()));
    // Only a failure of this test leaves a mount here: never leave it to the machine.
    let _ = nix::mount::umount2(&fresh_root, nix::mount::MntFlags::MNT_DETACH);

    // A node a previous agent programmed and left serving.
    let bpffs = BpfFs::new();
    let root = bpf_root_in(bpffs.path());
    let previous = start_agent(&ns, &cgroup, root.clone(), manifests.path());
    previous.stop();
    let programmed = pin_state(&root);
    assert!(
        programmed
            .iter()
            .any(|(p, id)| p.starts_with("maps/") && id.is_some()),
        "the previous agent left no pinned maps: {programmed:?}"
    );
    try_start("node a previous agent programmed", &root, None);

    let left = attempts.iter().filter(|a| a["left_as_it_was"] == true).count();
    record(
        "8-failed-start",
        &json!({
            "scenario": SCENARIO,
            "attempted": attempts.len(),
            "failed": attempts.len() - left,
            "left_as_it_was": left,
            "attempts": attempts,
        }),
    );
    assert!(changed.is_empty(), "{}", changed.join("\n\n"));
}

/// The migration guide's promise while kube-proxy still runs: a port another process holds
/// (`/healthz`, `/metrics`, a health-check NodePort) is bound again and again, and taken once
/// that process lets it go: the two servers every 5 s, the NodePort at every sync.
#[test]
fn a_held_listen_port_is_taken_once_freed() {
    require_root();
    let bpffs = BpfFs::new();
    let cgroup = Cgroup::new("lbheld");
    let ns = NetNs::new("lbheld");
    ns.exec_ok("ip", &["link", "set", "lo", "up"]);
    let manifests = manifests();
    let node_port = format!("0.0.0.0:{HEALTH_CHECK_NODE_PORT}");
    let holder = probe::server(
        Place::netns(&ns),
        "kube-proxy",
        &["0.0.0.0:10256", "127.0.0.1:10249", &node_port],
        &[],
    );
    let agent = start_agent(&ns, &cgroup, bpf_root_in(bpffs.path()), manifests.path());
    agent.wait_for_line("healthz server on", Duration::from_secs(10));
    agent.wait_for_line("metrics server on", Duration::from_secs(10));
    drop(holder);
    let freed = Instant::now();
    let answers = |port: u16, path: &str| {
        probe::http_get(Place::netns(&ns), &format!("127.0.0.1:{port}"), path)["status"] == 200
    };
    let mut taken: Vec<(u16, Option<f64>)> = vec![
        (10_256, None),
        (10_249, None),
        (HEALTH_CHECK_NODE_PORT as u16, None),
    ];
    while freed.elapsed() < Duration::from_secs(20) && taken.iter().any(|(_, t)| t.is_none()) {
        for (port, at) in taken.iter_mut().filter(|(_, t)| t.is_none()) {
            let path = match *port {
                10_256 => "/healthz",
                10_249 => "/metrics",
                _ => "/",
            };
            if answers(*port, path) {
                *at = Some(freed.elapsed().as_secs_f64());
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = agent.log();
    drop(agent);
    eprintln!("ports taken after being freed (s): {taken:?}");
    assert!(
        taken.iter().all(|(_, t)| t.is_some()),
        "a freed port was not taken within 20 s: {taken:?}; agent log:\n{log}"
    );
}

/// `lb-agent stats -o json` against the node's pins.
fn stats_of(node: &Node) -> Value {
    let root = node.bpf_root.to_str().expect("utf-8");
    let out = lb_agent(
        Place::netns(&node.ns),
        false,
        &["stats", "-o", "json", "--bpf-root", root],
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).expect("json")
}

/// `lb-agent stats` shows the tc prefilter's bits per family, read from the pinned maps with one
/// batch lookup each (the agent reads them back the same way when it restarts): the same count as
/// reading every word of the pinned map one by one.
#[test]
fn stats_counts_the_prefilter_bits_the_maps_hold() {
    let node = Node::start();
    let stats = stats_of(&node);
    for (map, key) in [
        ("lb4_prefilter", "tc_prefilter_bits_set_ipv4"),
        ("lb6_prefilter", "tc_prefilter_bits_set_ipv6"),
    ] {
        let data = aya::maps::MapData::from_pin(node.bpf_root.join("maps").join(map)).expect("pinned");
        let words: aya::maps::Array<_, u64> = aya::maps::Map::Array(data).try_into().expect("array");
        let bits: u64 = (0..words.len())
            .map(|i| u64::from(words.get(&i, 0).expect("word").count_ones()))
            .sum();
        assert_eq!(stats[key], bits, "{key}: {stats}");
        if map == "lb4_prefilter" {
            assert!(bits > 0, "the Service's frontends hold bits");
        }
    }
}

/// `lb-agent stats` shows each family's egress flow filter: on (the agent's first conntrack GC
/// pass, a second after attaching, turns it on) and the buckets it holds, counted from the pinned
/// map read word by word through the map API (not the memory mapping the command uses).
#[test]
fn stats_shows_the_egress_flow_filter_on_and_its_buckets() {
    let node = Node::start();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut now = stats_of(&node);
    while now["tc_ct_filter_on_ipv4"] != 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(250));
        now = stats_of(&node);
    }
    for (map, on, buckets) in [
        (
            "lb4_ct_filter",
            "tc_ct_filter_on_ipv4",
            "tc_ct_filter_buckets_ipv4",
        ),
        (
            "lb6_ct_filter",
            "tc_ct_filter_on_ipv6",
            "tc_ct_filter_buckets_ipv6",
        ),
    ] {
        assert_eq!(now[on], 1, "{on}: the first GC pass turns the filter on: {now}");
        let data = aya::maps::MapData::from_pin(node.bpf_root.join("maps").join(map)).expect("pinned");
        let words: aya::maps::Array<_, u64> = aya::maps::Map::Array(data).try_into().expect("array");
        // Word 0 is the control word; then four buckets of two bytes each.
        let held: u64 = (1..words.len())
            .map(|i| {
                let w = words.get(&i, 0).expect("word");
                (0..4).filter(|b| (w >> (16 * b)) & 0xFFFF != 0).count() as u64
            })
            .sum();
        assert_eq!(now[buckets], held, "{buckets}: {now}");
    }
}

/// Test hygiene: a test process ended by SIGTERM, SIGHUP or SIGINT (a runner's timeout, a closed
/// terminal, Ctrl-C) removes its namespaces, cgroups and bpffs mounts, and stops what runs in
/// them, before it exits, though no guard runs (`sweep::remove_own_objects_on_signals`). Runs
/// this binary's helper `held_objects_until_a_signal` and signals it once its objects exist.
#[test]
fn a_test_ended_by_a_signal_leaves_nothing_behind() {
    require_root();
    use std::io::BufRead;
    for sig in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
        let mut helper = Command::new(std::env::current_exe().expect("this test binary"));
        helper
            .args([
                "held_objects_until_a_signal",
                "--exact",
                "--ignored",
                "--nocapture",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The helper starts with the default dispositions, as a test under a terminal does: a
        // run under nohup (SIGHUP ignored) would hand it an ignored SIGHUP, which the harness
        // rightly keeps ignoring.
        // SAFETY: signal() is async-signal-safe, as pre_exec requires.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut helper, || {
                for s in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
                    libc::signal(s, libc::SIG_DFL);
                }
                Ok(())
            });
        }
        let mut child = helper.spawn().expect("spawn the helper");
        let mut lines = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        let ready = lines
            .by_ref()
            .map_while(Result::ok)
            .any(|l| l.contains("holding"));
        let tag = format!("{}x", child.id() % 100_000);
        let ours = |text: String| -> Vec<String> {
            text.lines()
                .filter(|l| l.contains(&tag))
                .map(String::from)
                .collect()
        };
        let objects = || {
            let netns = ours(
                String::from_utf8_lossy(
                    &Command::new("ip")
                        .args(["netns", "list"])
                        .output()
                        .unwrap()
                        .stdout,
                )
                .into(),
            );
            let mounts = ours(std::fs::read_to_string("/proc/self/mounts").unwrap_or_default());
            let cgroups = ours(
                std::fs::read_dir(lb_tests::cgroup::cgroup2_mount().join("lb-tests"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join("\n"),
            );
            [netns, mounts, cgroups]
        };
        let before = objects();
        // SAFETY: kill has no memory effects.
        unsafe { libc::kill(child.id() as i32, sig) };
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the helper did not exit within 30 s of signal {sig}");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut stderr = String::new();
        let _ = std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr);
        let after = objects();
        assert!(ready, "the helper never held its objects: {stderr}");
        assert!(
            before.iter().all(|o| !o.is_empty()),
            "signal {sig}: objects held before: {before:?}"
        );
        assert!(
            after.iter().all(Vec::is_empty),
            "signal {sig}: left behind: {after:?}\n{stderr}"
        );
        assert_eq!(status.code(), Some(128 + sig), "signal {sig}: {stderr}");
    }
}

#[test]
#[ignore = "a helper of a_test_ended_by_a_signal_leaves_nothing_behind"]
fn held_objects_until_a_signal() {
    require_root();
    let ns = NetNs::new("lbsig");
    let cgroup = Cgroup::new("lbsig");
    let _bpffs = BpfFs::new();
    let _sleeper = Proc::spawn(Place::new(&ns, &cgroup), "sleep", &["120"]);
    println!("holding");
    std::thread::sleep(Duration::from_secs(120));
}
