//! Socket-level load balancing with real sockets: the real lb-agent programs a test cgroup and a
//! private bpffs from manifests; clients run inside the cgroup, in the node's namespace (host
//! processes) or in a pod's namespace; servers run in pod namespaces.

use std::process::Command;

use lb_tests::{
    agent::{bpf_root_in, Agent, AgentOptions},
    bpffs::BpfFs,
    cgroup::Cgroup,
    fixtures::{service, slice, write_manifests, State},
    probe,
    process::{Place, Proc},
    require_root,
    topo::Node,
};
use serde_json::Value;

const NODE: &str = "node-a";

/// One node with `pods` pod namespaces, each serving TCP :8080 and UDP :5353 under its own name,
/// an agent, and a cgroup for clients.
struct Fixture {
    _servers: Vec<Proc>,
    agent: Option<Agent>,
    manifests: tempfile::TempDir,
    cgroup: Cgroup,
    node: Node,
    bpffs: BpfFs,
}

impl Fixture {
    fn new(pods: u8) -> Fixture {
        require_root();
        let bpffs = BpfFs::new();
        let cgroup = Cgroup::new("lbsock");
        let mut node = Node::new(1);
        for n in 0..pods {
            node.add_pod(n + 2);
        }
        let servers = node
            .pods
            .iter()
            .map(|p| probe::server(Place::netns(&p.ns), &p.ip.to_string(), &["0.0.0.0:8080"], &["0.0.0.0:5353"]))
            .collect();
        let manifests = tempfile::tempdir().expect("tempdir");
        Fixture { _servers: servers, agent: None, manifests, cgroup, node, bpffs }
    }

    fn pod_ip(&self, i: usize) -> String {
        self.node.pods[i].ip.to_string()
    }

    fn start_agent(&mut self, extra: &[&str]) {
        self.agent = Some(Agent::start(AgentOptions {
            netns: &self.node.ns,
            cgroup: &self.cgroup,
            bpf_root: bpf_root_in(self.bpffs.path()),
            node_name: NODE.into(),
            manifests: Some(self.manifests.path().to_path_buf()),
            kubeconfig: None,
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
        }));
    }

    fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("agent started")
    }

    /// A host process of the node (node namespace, test cgroup).
    fn host(&self) -> Place<'_> {
        Place::new(&self.node.ns, &self.cgroup)
    }
}

fn ok(results: &[Value]) -> Vec<&Value> {
    for r in results {
        assert_eq!(r["ok"], true, "failed: {r}");
    }
    results.iter().collect()
}

#[test]
fn first_slice_tcp_to_a_virtual_ip_reaches_the_backend() {
    let mut f = Fixture::new(1);
    let backend = f.pod_ip(0);
    write_manifests(
        f.manifests.path(),
        "web.yaml",
        &[service("demo", "web").cluster_ip("10.96.0.10").port("http", "TCP", 80, 8080).build()],
        &[slice("demo", "web", "web-1").endpoint(&backend, NODE, State::Ready).port("http", "TCP", 8080).build()],
    );
    f.start_agent(&[]);

    let results = probe::tcp(f.host(), "10.96.0.10:80", 3);
    for r in ok(&results) {
        assert_eq!(probe::server_of(r), Some(backend.as_str()), "{r}");
        assert_eq!(r["peer"], "10.96.0.10:80", "getpeername shows the Service, not the backend: {r}");
        // The backend saw the node's own address as the client: nothing was masqueraded.
        assert!(r["reply"]["client"].as_str().unwrap().starts_with("10.244.1.1:"), "{r}");
    }

    // A process outside the cgroup is not translated (programs are attached to the test cgroup
    // only): the virtual IP is not routable there.
    let outside = probe::tcp(Place::netns(&f.node.ns), "10.96.0.10:80", 1);
    assert_eq!(outside[0]["ok"], false, "{}", outside[0]);

    // SREs read the maps with bpftool: named fields thanks to BTF.
    let pin = bpf_root_in(f.bpffs.path()).join("maps/lb4_services");
    let dump = Command::new("bpftool").args(["map", "dump", "pinned"]).arg(&pin).output().expect("bpftool");
    let text = String::from_utf8_lossy(&dump.stdout);
    assert!(dump.status.success(), "bpftool: {}", String::from_utf8_lossy(&dump.stderr));
    for field in ["\"addr\"", "\"port\": 80", "\"slot\"", "\"backend_id\"", "\"count\": 1", "\"rev_nat_id\""] {
        assert!(text.contains(field), "bpftool output lacks {field}:\n{text}");
    }
    let status = f.agent.take().map(Agent::stop);
    assert!(status.is_some_and(|s| s.success()), "the agent exits cleanly on SIGTERM");
}
