//! Security checks of the agent and its operator commands:
//!
//! - the commands that change kernel state (`cleanup`, running the agent) refuse without
//!   privileges, say what is missing, and change nothing;
//! - the read-only commands (`services`, `backends`, `stats`) open pinned maps, which takes
//!   CAP_BPF (or root): they refuse clearly for an unprivileged user and work for root;
//! - the listen defaults are the documented ones (`/metrics` on loopback only);
//! - nothing listens on an undocumented port: with a LoadBalancer Service with
//!   externalTrafficPolicy=Local, the node namespace has exactly /healthz, /metrics and the
//!   Service's health-check NodePort open.
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
use lb_tests::{
    agent::{Agent, AgentOptions, bpf_root_in},
    bpffs::BpfFs,
    cgroup::Cgroup,
    fixtures::{State, service, slice, write_manifests},
    netns::NetNs,
    process::{Place, workspace_bin},
    require_root,
};

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
        let agent = Agent::start(AgentOptions {
            netns: &ns,
            cgroup: &cgroup,
            bpf_root: bpf_root.clone(),
            node_name: NODE.into(),
            manifests: Some(manifests.path().to_path_buf()),
            kubeconfig: None,
            extra_args: vec![],
        });
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
    let node = Node::start();
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
        if !says_what_is_missing(&text(&out)) {
            unclear.push(format!("lb-agent {cmd}: {}", text(&out).trim()));
        }
    }

    // cleanup as nobody: refused, clearly, and every pin is still there.
    let out = lb_agent(place, true, &["cleanup", "--bpf-root", &root], short);
    eprintln!("lb-agent cleanup as nobody: {}", text(&out).trim());
    assert!(
        !out.status.success(),
        "cleanup as nobody succeeded: {}",
        text(&out)
    );
    if !says_what_is_missing(&text(&out)) {
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
        assert!(!out.status.success(), "the agent ran as nobody: {}", text(&out));
        if !says_what_is_missing(&text(&out)) {
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
    // (but with a misleading message today, see the ignored test below).
    let out = services_behind_a_closed_bpffs(&node);
    assert!(!out.status.success(), "{}", text(&out));
    // The root agent is still serving.
    let out = lb_agent(place, false, &["services", "--bpf-root", &root], short);
    assert!(out.status.success() && text(&out).contains("10.96.0.20"));
    assert!(
        unclear.is_empty(),
        "these refusals do not say what is missing (permission, CAP_BPF or root):\n{}",
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

/// Today the read-only commands check `Path::exists()`, which is false when the directory cannot
/// be entered, and answer "no pinned maps under ... (start the agent, or pass --bpf-root)" while
/// the agent runs: they should say that permission was denied (and that root or CAP_BPF is
/// needed).
#[test]
#[ignore = "unclear message (\"no pinned maps\" instead of permission denied); reported, un-ignore once fixed"]
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
