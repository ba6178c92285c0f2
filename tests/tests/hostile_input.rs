//! Reliability scenario 5, hostile and malformed input, end to end: the real agent fed by a real
//! kube-apiserver programs a node (network namespaces) while continuous load runs against a good
//! Service for the whole test (socket path to its cluster IP, tc path to its NodePort), and a table
//! of bad Services and EndpointSlices is thrown at it.
//!
//! 1. Every row is first created through the API server. Most are refused there (port 0, nodePort
//!    out of range, duplicate ports, invalid or wrong-family IPs, special addresses, a field of the
//!    wrong type...): the test asserts the refusal and its field.
//! 2. The rows the API server accepts (two Services claiming one external IP or load-balancer IP,
//!    an IPv6 external IP on an IPv4-only Service, a slice port 0, a name at the 63-character
//!    limit, IPv6 and FQDN slices, 200,000 endpoints in 200 slices of 1,000) must each end in a
//!    Warning Event on the offending Service and a log line naming it, or be served (the long name)
//!    or ignored by design (IPv6/FQDN slices, as kube-proxy's IPv4 proxier does), while the rest of
//!    each object keeps serving and a Service created after them is programmed. The planner refuses
//!    the 200,000-endpoint frontend (`MAX_BACKENDS_PER_SCOPE`) and nothing of it reaches the maps.
//!    Deleting the bad objects leaves the maps with the good Services only, and the problems and
//!    Events stop.
//! 3. The agent is restarted in `--manifests` mode (no API validation there) on the same pins with
//!    every row the API server refused: it must log a problem naming the object and the field, skip
//!    just that object or port, serve the rest of it, and serve a Service next to them. Removing the
//!    rows leaves the good Services only. Last, a file with a field of the wrong type is added next
//!    to a new valid Service.
//!
//! Rows that a known agent bug keeps from their expected outcome are recorded as "known bug", with
//! the ignored reproducer (at the end of this file) that asserts the expected outcome; every other
//! row must hold, and the load must never fail. Figures go to
//! `target/reliability/5-hostile-input.json` (rows, load, timings, the huge Service's figures).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use futures::StreamExt;
use k8s_openapi::{
    api::{
        core::v1::{Event, Namespace, Node, NodeAddress, NodeStatus, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams},
    core::Status,
};
use lb_agent::events::REPORTING_CONTROLLER;
use lb_tests::{
    agent::{Agent, AgentOptions, bpf_root_in},
    bpffs::BpfFs,
    cgroup::Cgroup,
    control_plane::ControlPlane,
    fixtures::{State, service, slice},
    load::{Load, tally},
    netns::PortForward,
    probe,
    process::{Place, Proc, workspace_bin},
    require_root,
    topo::{Lan, Node as TopoNode, external_client},
};
use serde_json::{Value, json};

const NS: &str = "hostile";
const NODE: &str = "node-a";
/// The good Service, under load for the whole test.
const GOOD: &str = "good-web";
const GOOD_IP: &str = "10.96.70.10";
const GOOD_NODE_PORT: u16 = 30100;
/// The huge Service: endpoints and slice size.
const HUGE_ENDPOINTS: usize = 200_000;
const HUGE_SLICE: usize = 1_000;
/// The agent's Event reason for a problem with a Service or its slices (lb-agent/src/agent/sync.rs).
const REASON: &str = "InvalidService";

/// A node with three pods (servers on 8080/TCP) on a LAN with an external client.
struct Site {
    _servers: Vec<Proc>,
    client: (lb_tests::netns::NetNs, Ipv4Addr),
    node: TopoNode,
    _lan: Lan,
    cgroup: Cgroup,
    bpffs: BpfFs,
}

impl Site {
    fn new() -> Site {
        require_root();
        let bpffs = BpfFs::new();
        let cgroup = Cgroup::new("lbhost");
        let lan = Lan::new();
        let mut node = TopoNode::new(1);
        node.attach_lan(&lan);
        for n in 2..5 {
            node.add_pod(n);
        }
        let client = external_client(&lan, 1);
        let servers: Vec<Proc> = node
            .pods
            .iter()
            .map(|p| probe::server(Place::netns(&p.ns), &p.ip.to_string(), &["0.0.0.0:8080"], &[]))
            .collect();
        for s in &servers {
            prioritize(s.pid());
        }
        Site {
            _servers: servers,
            client,
            node,
            _lan: lan,
            cgroup,
            bpffs,
        }
    }

    fn pod(&self, i: usize) -> String {
        self.node.pods[i].ip.to_string()
    }

    fn node_ip(&self) -> Ipv4Addr {
        self.node.ip.expect("attached to the LAN")
    }

    fn host(&self) -> Place<'_> {
        Place::new(&self.node.ns, &self.cgroup)
    }

    fn external(&self) -> Place<'_> {
        Place::netns(&self.client.0)
    }

    fn bpf_root(&self) -> PathBuf {
        bpf_root_in(self.bpffs.path())
    }

    fn agent(&self, manifests: Option<PathBuf>, kubeconfig: Option<PathBuf>) -> Agent {
        Agent::start(AgentOptions {
            netns: &self.node.ns,
            cgroup: &self.cgroup,
            bpf_root: self.bpf_root(),
            node_name: NODE.into(),
            manifests,
            kubeconfig,
            extra_args: vec!["--cluster-cidr".into(), "10.244.0.0/16".into()],
        })
    }

    /// `lb-agent <cmd> -o json` on the pins.
    fn inspect(&self, cmd: &str) -> Vec<Value> {
        lb_tests::agent::inspect(&self.bpf_root(), cmd)
            .unwrap_or_else(|e| panic!("{e}"))
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Programmed frontends ("ip:port/PROTO") by Service ("ns/name"), for this test's namespace.
    fn frontends(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for f in self.inspect("services") {
            let service = f["service"].as_str().unwrap_or_default();
            let Some(svc) = service.strip_prefix(&format!("{NS}/")) else {
                continue;
            };
            let name = svc.split(':').next().unwrap_or_default().to_string();
            out.entry(name)
                .or_default()
                .insert(f["frontend"].as_str().unwrap_or_default().to_string());
        }
        out
    }

    fn all_frontends(&self) -> BTreeSet<String> {
        self.inspect("services")
            .iter()
            .filter_map(|f| f["frontend"].as_str().map(str::to_string))
            .collect()
    }
}

/// The API side: the control plane, a client, and the API reachable from the node's namespace.
struct Cluster {
    client: kube::Client,
    _forward: PortForward,
    cp: ControlPlane,
    rt: tokio::runtime::Runtime,
}

impl Cluster {
    fn new(site: &Site) -> Cluster {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let cp = ControlPlane::start().expect("control plane");
        let client = rt.block_on(cp.client()).expect("client");
        let api: SocketAddr = cp
            .server_url()
            .trim_start_matches("https://")
            .parse()
            .expect("api address");
        let forward = PortForward::start(&site.node.ns, api, api);
        let c = Cluster {
            client,
            _forward: forward,
            cp,
            rt,
        };
        c.rt.block_on(async {
            Api::<Namespace>::all(c.client.clone())
                .create(
                    &PostParams::default(),
                    &Namespace {
                        metadata: ObjectMeta {
                            name: Some(NS.into()),
                            ..Default::default()
                        },
                        ..Default::default()
                    },
                )
                .await
                .expect("namespace");
            let nodes: Api<Node> = Api::all(c.client.clone());
            nodes
                .create(&PostParams::default(), &node_object(site.node_ip()))
                .await
                .expect("node");
            let status = node_object(site.node_ip()).status;
            nodes
                .patch_status(
                    NODE,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({ "status": status })),
                )
                .await
                .expect("node status");
        });
        c
    }

    /// Creates one object (a JSON Service or EndpointSlice, valid or not) through the API; its
    /// status too, when it has one. `Err`: the API server's refusal.
    fn create(&self, obj: &Value) -> Result<(), String> {
        self.rt.block_on(create(&self.client, obj))
    }

    fn delete(&self, kind: &str, name: &str) {
        self.rt.block_on(async {
            let dp = DeleteParams::default();
            let _ = match kind {
                "Service" => Api::<Service>::namespaced(self.client.clone(), NS)
                    .delete(name, &dp)
                    .await
                    .map(|_| ()),
                _ => Api::<EndpointSlice>::namespaced(self.client.clone(), NS)
                    .delete(name, &dp)
                    .await
                    .map(|_| ()),
            };
        });
    }

    /// The agent's Events on a Service: (reason, message, count).
    fn events(&self, name: &str) -> Vec<(String, String, i64)> {
        let selector = format!("involvedObject.name={name}");
        self.agent_events(Some(&selector))
            .into_iter()
            .map(|(_, reason, message, count)| (reason, message, count))
            .collect()
    }

    /// Every Event of the agent in the namespace: (object, reason, message, count).
    fn all_events(&self) -> BTreeSet<(String, String, String, i64)> {
        self.agent_events(None).into_iter().collect()
    }

    /// The agent's Events in the namespace, those matching `fields` if given: (object, reason,
    /// message, count). Only the agent's own: the API server's controllers report on the same
    /// objects (its ClusterIP repair loop, racing a Service's creation under load, says "Cluster
    /// IP ... is not allocated; repairing").
    fn agent_events(&self, fields: Option<&str>) -> Vec<(String, String, String, i64)> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), NS);
        let lp = match fields {
            Some(fields) => ListParams::default().fields(fields),
            None => ListParams::default(),
        };
        self.rt
            .block_on(api.list(&lp))
            .map(|l| {
                l.items
                    .into_iter()
                    .filter(|e| e.reporting_component.as_deref() == Some(REPORTING_CONTROLLER))
                    .map(|e| {
                        let count = e.count.map(i64::from).unwrap_or(1)
                            + e.series.and_then(|s| s.count).map(i64::from).unwrap_or(0);
                        (
                            e.involved_object.name.unwrap_or_default(),
                            e.reason.unwrap_or_default(),
                            e.message.unwrap_or_default(),
                            count,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

async fn create(client: &kube::Client, obj: &Value) -> Result<(), String> {
    let kind = obj["kind"].as_str().unwrap_or_default();
    let resource = match kind {
        "Service" => ApiResource::erase::<Service>(&()),
        "EndpointSlice" => ApiResource::erase::<EndpointSlice>(&()),
        other => panic!("unexpected kind {other}"),
    };
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &resource);
    let mut body = obj.clone();
    let status = body.as_object_mut().and_then(|o| o.remove("status"));
    let dynamic: DynamicObject = serde_json::from_value(body).expect("a dynamic object");
    match api.create(&PostParams::default(), &dynamic).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) => return Err(refusal(&status)),
        Err(e) => panic!("creating {kind} {}: {e}", obj["metadata"]["name"]),
    }
    if let Some(status) = status.filter(|s| !s.is_null()) {
        let name = obj["metadata"]["name"].as_str().unwrap_or_default();
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": status })),
        )
        .await
        .map_err(|e| format!("status: {e}"))?;
    }
    Ok(())
}

/// The API server's refusal, without the `Kind "name" is invalid: ` preamble.
fn refusal(status: &Status) -> String {
    let message = status
        .message
        .split_once(" is invalid: ")
        .map_or(status.message.as_str(), |(_, m)| m);
    format!("{message} ({})", status.reason)
}

fn node_object(ip: Ipv4Addr) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(NODE.into()),
            ..Default::default()
        },
        status: Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                type_: "InternalIP".into(),
                address: ip.to_string(),
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn with_kind<T: serde::Serialize>(obj: T, api_version: &str, kind: &str) -> Value {
    let mut v = serde_json::to_value(obj).expect("json");
    v["apiVersion"] = api_version.into();
    v["kind"] = kind.into();
    v
}

fn svc_json(s: lb_tests::fixtures::Svc) -> Value {
    with_kind(s.build(), "v1", "Service")
}

fn slice_json(s: lb_tests::fixtures::Slice) -> Value {
    with_kind(s.build(), "discovery.k8s.io/v1", "EndpointSlice")
}

/// A slice of `address_type` with raw addresses (one endpoint each), ready, on this node.
fn raw_slice(service: &str, name: &str, address_type: &str, addresses: &[&str], port: i32) -> Value {
    let mut b = slice(NS, service, name);
    for a in addresses {
        b = b.endpoint(a, NODE, State::Ready);
    }
    let mut s = b.port("http", "TCP", port).build();
    s.address_type = address_type.into();
    with_kind(s, "discovery.k8s.io/v1", "EndpointSlice")
}

/// What the API server must do with a row.
#[derive(Clone, Copy)]
enum ApiExpect {
    /// Refuse it, with this text in its message.
    Refuses(&'static str),
    Accepts,
}

/// What the agent must do with a row.
#[derive(Clone)]
enum AgentExpect {
    /// Log a problem naming the Service (and, through the API, publish a Warning Event on it)
    /// with each of these texts (the field paths).
    Reports(Vec<&'static str>),
    /// Program it without a complaint.
    Serves,
    /// Ignore it without a complaint, by design (the reason).
    Ignores(&'static str),
}

struct Row {
    what: &'static str,
    /// The Service a problem is reported on.
    service: String,
    objects: Vec<Value>,
    api: ApiExpect,
    agent: AgentExpect,
    /// Frontends (from the node) that must keep serving, and by which pods.
    serves: Vec<(String, Vec<usize>)>,
    /// Frontends ("ip:port/PROTO") that must not be programmed.
    absent: Vec<String>,
    /// Backends ("ip:port") that must not be in the maps.
    absent_backends: Vec<String>,
}

fn cip(n: u8) -> String {
    format!("10.96.70.{n}")
}

/// The good Service and its slice (three pods), identical through the API and in manifests.
fn good_objects(site: &Site) -> Vec<Value> {
    vec![
        svc_json(
            service(NS, GOOD)
                .cluster_ip(GOOD_IP)
                .port("http", "TCP", 80, 8080)
                .node_port(i32::from(GOOD_NODE_PORT)),
        ),
        slice_json(
            slice(NS, GOOD, "good-web-1")
                .endpoint(&site.pod(0), NODE, State::Ready)
                .endpoint(&site.pod(1), NODE, State::Ready)
                .endpoint(&site.pod(2), NODE, State::Ready)
                .port("http", "TCP", 8080),
        ),
    ]
}

/// A simple valid Service (one TCP port 80 -> 8080) with one slice of these pods.
fn simple(site: &Site, name: &str, ip: &str, pods: &[usize]) -> Vec<Value> {
    let mut s = slice(NS, name, &format!("{name}-1"));
    for p in pods {
        s = s.endpoint(&site.pod(*p), NODE, State::Ready);
    }
    vec![
        svc_json(service(NS, name).cluster_ip(ip).port("http", "TCP", 80, 8080)),
        slice_json(s.port("http", "TCP", 8080)),
    ]
}

/// The rows the API server refuses; each is also fed to the agent through `--manifests`.
fn refused_rows(site: &Site) -> Vec<Row> {
    let p = |i: usize| site.pod(i);
    let long_64 = format!("long-{}", "x".repeat(59));
    vec![
        Row {
            what: "Service port 0, next to a valid port",
            service: "port-zero".into(),
            objects: vec![
                svc_json(
                    service(NS, "port-zero")
                        .cluster_ip(&cip(21))
                        .port("zero", "TCP", 0, 8080)
                        .port("http", "TCP", 81, 8080),
                ),
                slice_json(
                    slice(NS, "port-zero", "port-zero-1")
                        .endpoint(&p(0), NODE, State::Ready)
                        .port("zero", "TCP", 8080)
                        .port("http", "TCP", 8080),
                ),
            ],
            api: ApiExpect::Refuses("spec.ports[0].port"),
            agent: AgentExpect::Reports(vec!["spec.ports[0].port"]),
            serves: vec![(format!("{}:81", cip(21)), vec![0])],
            absent: vec![format!("{}:0/TCP", cip(21))],
            absent_backends: vec![],
        },
        Row {
            what: "nodePort out of range (70000)",
            service: "node-port-range".into(),
            objects: vec![
                svc_json(
                    service(NS, "node-port-range")
                        .cluster_ip(&cip(22))
                        .port("http", "TCP", 80, 8080)
                        .node_port(70_000),
                ),
                slice_json(
                    slice(NS, "node-port-range", "node-port-range-1")
                        .endpoint(&p(0), NODE, State::Ready)
                        .port("http", "TCP", 8080),
                ),
            ],
            api: ApiExpect::Refuses("spec.ports[0].nodePort"),
            agent: AgentExpect::Reports(vec!["spec.ports[0].nodePort"]),
            serves: vec![(format!("{}:80", cip(22)), vec![0])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "Two ports with the same number and protocol",
            service: "dup-port".into(),
            objects: vec![
                svc_json(
                    service(NS, "dup-port")
                        .cluster_ip(&cip(23))
                        .port("a", "TCP", 80, 8080)
                        .port("b", "TCP", 80, 8080),
                ),
                slice_json(
                    slice(NS, "dup-port", "dup-port-1")
                        .endpoint(&p(1), NODE, State::Ready)
                        .port("a", "TCP", 8080)
                        .port("b", "TCP", 8080),
                ),
            ],
            api: ApiExpect::Refuses("spec.ports[1]: Duplicate value"),
            agent: AgentExpect::Reports(vec!["spec.ports[1]", "duplicate"]),
            serves: vec![(format!("{}:80", cip(23)), vec![1])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "Two ports with the same name",
            service: "dup-name".into(),
            objects: vec![
                svc_json(
                    service(NS, "dup-name")
                        .cluster_ip(&cip(24))
                        .port("a", "TCP", 80, 8080)
                        .port("a", "TCP", 81, 8080),
                ),
                slice_json(
                    slice(NS, "dup-name", "dup-name-1")
                        .endpoint(&p(1), NODE, State::Ready)
                        .port("a", "TCP", 8080),
                ),
            ],
            api: ApiExpect::Refuses("spec.ports[1].name: Duplicate value"),
            agent: AgentExpect::Reports(vec!["spec.ports[1]", "duplicate"]),
            serves: vec![(format!("{}:80", cip(24)), vec![1])],
            absent: vec![format!("{}:81/TCP", cip(24))],
            absent_backends: vec![],
        },
        Row {
            what: "Cluster IP that is not an IP (10.96.300.1)",
            service: "bad-cluster-ip".into(),
            objects: simple(site, "bad-cluster-ip", "10.96.300.1", &[0]),
            api: ApiExpect::Refuses("spec.clusterIPs[0]"),
            agent: AgentExpect::Reports(vec!["spec.clusterIPs[0]"]),
            serves: vec![],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "Cluster IP of the wrong family (fd00:10:96::10 where ipFamilies says IPv4)",
            service: "v6-cluster-ip".into(),
            objects: {
                let mut o = simple(site, "v6-cluster-ip", "fd00:10:96::10", &[0]);
                o[0]["spec"]["ipFamilies"] = json!(["IPv4"]);
                o
            },
            api: ApiExpect::Refuses("expected an IPv4 value as indicated by `ipFamilies[0]`"),
            agent: AgentExpect::Reports(vec!["spec.clusterIPs[0]", "is not a valid IPv4 address"]),
            serves: vec![],
            absent: vec!["[fd00:10:96::10]:80/TCP".into()],
            absent_backends: vec![],
        },
        Row {
            what: "externalIP that is not an IP",
            service: "bad-external-ip".into(),
            objects: {
                let mut o = simple(site, "bad-external-ip", &cip(26), &[2]);
                o[0]["spec"]["externalIPs"] = json!(["not-an-ip"]);
                o
            },
            api: ApiExpect::Refuses("spec.externalIPs[0]"),
            agent: AgentExpect::Reports(vec!["spec.externalIPs[0]"]),
            serves: vec![(format!("{}:80", cip(26)), vec![2])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "Special externalIPs (127.0.0.1, 0.0.0.0, 224.0.0.5)",
            service: "special-external-ip".into(),
            objects: {
                let mut o = simple(site, "special-external-ip", &cip(27), &[2]);
                o[0]["spec"]["externalIPs"] = json!(["127.0.0.1", "0.0.0.0", "224.0.0.5"]);
                o
            },
            api: ApiExpect::Refuses("may not be in the loopback range"),
            agent: AgentExpect::Reports(vec![
                "spec.externalIPs[0]",
                "spec.externalIPs[1]",
                "spec.externalIPs[2]",
            ]),
            serves: vec![(format!("{}:80", cip(27)), vec![2])],
            absent: vec![
                "127.0.0.1:80/TCP".into(),
                "0.0.0.0:80/TCP".into(),
                "224.0.0.5:80/TCP".into(),
            ],
            absent_backends: vec![],
        },
        Row {
            what: "loadBalancerSourceRanges entry that is not a CIDR",
            service: "bad-source-range".into(),
            objects: {
                let mut o = simple(site, "bad-source-range", &cip(28), &[0]);
                o[0] = svc_json(
                    service(NS, "bad-source-range")
                        .cluster_ip(&cip(28))
                        .port("http", "TCP", 80, 8080)
                        .load_balancer_ip("203.0.113.28")
                        .source_ranges(&["nope"]),
                );
                o
            },
            api: ApiExpect::Refuses("LoadBalancerSourceRanges[0]"),
            agent: AgentExpect::Reports(vec!["spec.loadBalancerSourceRanges[0]"]),
            serves: vec![(format!("{}:80", cip(28)), vec![0])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "Unsupported protocol (ICMP), next to a valid port",
            service: "bad-protocol".into(),
            objects: vec![
                svc_json(
                    service(NS, "bad-protocol")
                        .cluster_ip(&cip(29))
                        .port("icmp", "ICMP", 80, 8080)
                        .port("http", "TCP", 80, 8080),
                ),
                slice_json(
                    slice(NS, "bad-protocol", "bad-protocol-1")
                        .endpoint(&p(1), NODE, State::Ready)
                        .port("http", "TCP", 8080),
                ),
            ],
            api: ApiExpect::Refuses("spec.ports[0].protocol"),
            agent: AgentExpect::Reports(vec!["spec.ports[0].protocol"]),
            serves: vec![(format!("{}:80", cip(29)), vec![1])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "Service name over the 63-character limit",
            service: long_64.clone(),
            objects: simple(site, &long_64, &cip(30), &[1]),
            api: ApiExpect::Refuses("must be no more than 63 characters"),
            agent: AgentExpect::Serves,
            serves: vec![(format!("{}:80", cip(30)), vec![1])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "IPv6 address in an IPv4 EndpointSlice",
            service: "wrong-family".into(),
            objects: vec![
                svc_json(
                    service(NS, "wrong-family")
                        .cluster_ip(&cip(31))
                        .port("http", "TCP", 80, 8080),
                ),
                raw_slice(
                    "wrong-family",
                    "wrong-family-1",
                    "IPv4",
                    &["2001:db8::5", &p(1)],
                    8080,
                ),
            ],
            api: ApiExpect::Refuses("must be an IPv4 address"),
            agent: AgentExpect::Reports(vec!["wrong-family-1", "endpoints[0]"]),
            serves: vec![(format!("{}:80", cip(31)), vec![1])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "EndpointSlice address that is not an IP (10.244.1.300)",
            service: "bad-address".into(),
            objects: vec![
                svc_json(
                    service(NS, "bad-address")
                        .cluster_ip(&cip(32))
                        .port("http", "TCP", 80, 8080),
                ),
                raw_slice(
                    "bad-address",
                    "bad-address-1",
                    "IPv4",
                    &["10.244.1.300", &p(2)],
                    8080,
                ),
            ],
            api: ApiExpect::Refuses("must be a valid IP address"),
            agent: AgentExpect::Reports(vec!["bad-address-1", "endpoints[0]"]),
            serves: vec![(format!("{}:80", cip(32)), vec![2])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "Special addresses in an EndpointSlice (127.0.0.1, 0.0.0.0, 224.0.0.1)",
            service: "special-endpoint".into(),
            objects: vec![
                svc_json(
                    service(NS, "special-endpoint")
                        .cluster_ip(&cip(33))
                        .port("http", "TCP", 80, 8080),
                ),
                raw_slice(
                    "special-endpoint",
                    "special-endpoint-1",
                    "IPv4",
                    &["127.0.0.1", "0.0.0.0", "224.0.0.1", &p(2)],
                    8080,
                ),
            ],
            api: ApiExpect::Refuses("may not be in the loopback range"),
            agent: AgentExpect::Reports(vec!["endpoints[0]", "endpoints[1]", "endpoints[2]"]),
            serves: vec![(format!("{}:80", cip(33)), vec![2])],
            absent: vec![],
            absent_backends: vec![
                "127.0.0.1:8080".into(),
                "0.0.0.0:8080".into(),
                "224.0.0.1:8080".into(),
            ],
        },
        Row {
            what: "EndpointSlice port name used twice",
            service: "slice-dup-port".into(),
            objects: vec![
                svc_json(
                    service(NS, "slice-dup-port")
                        .cluster_ip(&cip(34))
                        .port("http", "TCP", 80, 8080),
                ),
                slice_json(
                    slice(NS, "slice-dup-port", "slice-dup-port-1")
                        .endpoint(&p(0), NODE, State::Ready)
                        .port("http", "TCP", 8080)
                        .port("http", "TCP", 8080),
                ),
            ],
            api: ApiExpect::Refuses("ports[1].name: Duplicate value"),
            agent: AgentExpect::Ignores(
                "the copies are merged, as kube-proxy's EndpointSliceCache does; nothing is lost",
            ),
            serves: vec![(format!("{}:80", cip(34)), vec![0])],
            absent: vec![],
            absent_backends: vec![],
        },
    ]
}

/// The rows the API server accepts (the huge Service is separate).
fn accepted_rows(site: &Site) -> Vec<Row> {
    let p = |i: usize| site.pod(i);
    let long_63 = format!("long-{}", "n".repeat(58));
    vec![
        Row {
            what: "Two Services claiming one externalIP:port",
            service: "claim-b".into(),
            objects: {
                let mut o = simple(site, "claim-a", &cip(41), &[0]);
                o.extend(simple(site, "claim-b", &cip(42), &[1]));
                o[0]["spec"]["externalIPs"] = json!(["198.51.100.77"]);
                o[2]["spec"]["externalIPs"] = json!(["198.51.100.77"]);
                o
            },
            api: ApiExpect::Accepts,
            agent: AgentExpect::Reports(vec!["198.51.100.77:80", "already served"]),
            serves: vec![
                ("198.51.100.77:80".into(), vec![0]),
                (format!("{}:80", cip(42)), vec![1]),
            ],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "Two LoadBalancer Services claiming one load-balancer IP:port",
            service: "lb-b".into(),
            objects: vec![
                svc_json(
                    service(NS, "lb-a")
                        .cluster_ip(&cip(43))
                        .port("http", "TCP", 80, 8080)
                        .load_balancer_ip("203.0.113.77"),
                ),
                slice_json(
                    slice(NS, "lb-a", "lb-a-1")
                        .endpoint(&p(0), NODE, State::Ready)
                        .port("http", "TCP", 8080),
                ),
                svc_json(
                    service(NS, "lb-b")
                        .cluster_ip(&cip(44))
                        .port("http", "TCP", 80, 8080)
                        .load_balancer_ip("203.0.113.77"),
                ),
                slice_json(
                    slice(NS, "lb-b", "lb-b-1")
                        .endpoint(&p(1), NODE, State::Ready)
                        .port("http", "TCP", 8080),
                ),
            ],
            api: ApiExpect::Accepts,
            agent: AgentExpect::Reports(vec!["203.0.113.77:80", "already served"]),
            serves: vec![
                ("203.0.113.77:80".into(), vec![0]),
                (format!("{}:80", cip(44)), vec![1]),
            ],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "IPv6 externalIP on an IPv4-only Service",
            service: "v6-external-ip".into(),
            objects: {
                let mut o = simple(site, "v6-external-ip", &cip(45), &[2]);
                o[0]["spec"]["externalIPs"] = json!(["2001:db8::1"]);
                o
            },
            api: ApiExpect::Accepts,
            agent: AgentExpect::Reports(vec!["spec.externalIPs[0]", "IPv6"]),
            serves: vec![(format!("{}:80", cip(45)), vec![2])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "Service name at the 63-character limit",
            service: long_63.clone(),
            objects: simple(site, &long_63, &cip(46), &[0, 1]),
            api: ApiExpect::Accepts,
            agent: AgentExpect::Serves,
            serves: vec![(format!("{}:80", cip(46)), vec![0, 1])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "EndpointSlices of addressType IPv6 and FQDN next to an IPv4 one",
            service: "mixed-families".into(),
            objects: vec![
                svc_json(
                    service(NS, "mixed-families")
                        .cluster_ip(&cip(47))
                        .port("http", "TCP", 80, 8080),
                ),
                raw_slice("mixed-families", "mixed-families-v4", "IPv4", &[&p(2)], 8080),
                raw_slice(
                    "mixed-families",
                    "mixed-families-v6",
                    "IPv6",
                    &["2001:db8::7"],
                    8080,
                ),
                raw_slice(
                    "mixed-families",
                    "mixed-families-fqdn",
                    "FQDN",
                    &["web.example.com"],
                    8080,
                ),
            ],
            api: ApiExpect::Accepts,
            agent: AgentExpect::Ignores(
                "the Service is IPv4 single-stack: its IPv6 slice has no frontend of its family and FQDN slices are never proxied, as with kube-proxy; the IPv4 slice serves",
            ),
            serves: vec![(format!("{}:80", cip(47)), vec![2])],
            absent: vec![],
            absent_backends: vec![],
        },
        Row {
            what: "EndpointSlice port 0, next to a valid slice",
            service: "slice-port-zero".into(),
            objects: vec![
                svc_json(
                    service(NS, "slice-port-zero")
                        .cluster_ip(&cip(48))
                        .port("http", "TCP", 80, 8080),
                ),
                raw_slice("slice-port-zero", "slice-port-zero-1", "IPv4", &[&p(0)], 0),
                raw_slice("slice-port-zero", "slice-port-zero-2", "IPv4", &[&p(1)], 8080),
            ],
            api: ApiExpect::Accepts,
            agent: AgentExpect::Reports(vec!["slice-port-zero-1", "ports[0]"]),
            serves: vec![(format!("{}:80", cip(48)), vec![1])],
            absent: vec![],
            absent_backends: vec![],
        },
    ]
}

/// The huge Service's slices: `HUGE_ENDPOINTS` endpoints on another node, from 10.128.0.0.
fn huge_slices() -> Vec<Value> {
    (0..HUGE_ENDPOINTS / HUGE_SLICE)
        .map(|s| {
            let endpoints: Vec<Value> = (0..HUGE_SLICE)
                .map(|i| {
                    let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (s * HUGE_SLICE + i) as u32);
                    json!({"addresses": [ip.to_string()], "conditions": {"ready": true}, "nodeName": "node-b"})
                })
                .collect();
            json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"name": format!("huge-{s}"), "namespace": NS, "labels": {"kubernetes.io/service-name": "huge"}},
                "addressType": "IPv4",
                "endpoints": endpoints,
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            })
        })
        .collect()
}

/// The agent's log without ANSI colours.
fn plain_log(agent: &Agent) -> Vec<String> {
    agent.log().lines().map(strip_ansi).collect()
}

fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn is_problem(line: &str) -> bool {
    line.contains(" WARN ") || line.contains(" ERROR ")
}

/// Whether a log line is about an object of the test's namespace (a Service or a slice).
fn names_a_test_object(line: &str) -> bool {
    line.contains(&format!("namespace={NS}")) || line.contains(&format!("service={NS}/"))
}

/// The problem lines naming `name` (as the object, `name=...`) with `needle`.
fn problem_lines<'a>(log: &'a [String], name: &str, needle: &str) -> Vec<&'a String> {
    let named = format!("name={name}");
    log.iter()
        .filter(|l| {
            is_problem(l) && (l.contains(&named) || l.contains(&format!("{NS}/{name}"))) && l.contains(needle)
        })
        .collect()
}

/// The message of a log line: after the target, without the trailing `key=value` fields.
fn message(line: &str) -> String {
    let after = line.split_once("lb_agent").map(|(_, r)| r).unwrap_or(line);
    let after = after.split_once(": ").map(|(_, r)| r).unwrap_or(after);
    let mut words: Vec<&str> = after.split(' ').collect();
    let is_field = |w: &str| {
        w.split_once('=')
            .is_some_and(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
    };
    while words.last().is_some_and(|w| is_field(w)) {
        words.pop();
    }
    words.join(" ").trim().to_string()
}

/// Backends that answered over 12 TCP connections from the node (any failure: `None`).
fn served_by(site: &Site, to: &str) -> Option<BTreeSet<String>> {
    let results = probe::tcp(site.host(), to, 12);
    results.iter().all(|r| r["ok"] == true).then(|| {
        results
            .iter()
            .filter_map(|r| probe::server_of(r).map(str::to_string))
            .collect()
    })
}

/// Gives every thread of `pid` (and so the threads it starts later) nice -10. The traffic fixtures
/// (pod servers, load clients) get the CPU before the agent, the API server and anything else on
/// the machine: the load measures the data path, not whether a 2-core machine running the agent
/// through 200,000 endpoints (a debug build) schedules a test server within the 1 s timeout.
fn prioritize(pid: u32) {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process's threads");
    for task in tasks.flatten() {
        if let Ok(tid) = task.file_name().to_string_lossy().parse::<libc::id_t>() {
            // SAFETY: setpriority has no memory preconditions.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, -10) };
        }
    }
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as u64
}

/// Failed requests of a load, each with the test phase it fell in (phases: (name, start µs)).
fn failures_by_phase(results: &[Value], phases: &[(&str, u64)], start_us: u64) -> Vec<Value> {
    results
        .iter()
        .filter(|r| r["ok"] != true)
        .take(10)
        .map(|r| {
            let t = r["t_us"].as_u64().unwrap_or(0);
            let phase = phases
                .iter()
                .rev()
                .find(|(_, at)| *at <= t)
                .map_or("before the load", |(name, _)| name);
            json!(format!(
                "{:.2} s ({phase}): {}",
                t.saturating_sub(start_us) as f64 / 1e6,
                r["error"].as_str().unwrap_or("?")
            ))
        })
        .collect()
}

fn converge(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    started.elapsed()
}

fn pods_of(site: &Site, idx: &[usize]) -> BTreeSet<String> {
    idx.iter().map(|i| site.pod(*i)).collect()
}

/// Checks a row's frontends: those that must serve do, with the right pods; the absent ones are.
fn check_frontends(site: &Site, row: &Row, timeout: Duration) -> Result<(), String> {
    for (to, pods) in &row.serves {
        let want = pods_of(site, pods);
        let started = Instant::now();
        loop {
            let got = served_by(site, to);
            if got.as_ref() == Some(&want) {
                break;
            }
            if started.elapsed() > timeout {
                return Err(format!("{to}: served by {got:?}, expected {want:?}"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let all = site.all_frontends();
    for f in &row.absent {
        if all.contains(f) {
            return Err(format!("{f} is programmed"));
        }
    }
    Ok(())
}

/// Writes objects as one manifest file (JSON documents are YAML).
fn write_objects(dir: &Path, file: &str, objects: &[Value]) {
    let text: String = objects.iter().map(|o| format!("---\n{o}\n")).collect();
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, text).expect("write manifests");
    std::fs::rename(&tmp, dir.join(file)).expect("rename manifests");
}

/// A Service name as it appears in the row table (long names shortened).
fn short(name: &str) -> String {
    if name.len() > 24 {
        format!("{}… ({} characters)", &name[..12], name.len())
    } else {
        name.to_string()
    }
}

/// What the agent did with one row.
struct Verdict {
    notes: Vec<String>,
    /// Checks that did not hold.
    failed: Vec<String>,
    event: Value,
}

/// Judges one row against the agent's log, its Events (through the API) and the data path.
fn judge(site: &Site, row: &Row, log: &[String], cluster: Option<&Cluster>, timeout: Duration) -> Verdict {
    let mut v = Verdict {
        notes: Vec::new(),
        failed: Vec::new(),
        event: Value::Null,
    };
    match &row.agent {
        AgentExpect::Reports(needles) => {
            for n in needles {
                match problem_lines(log, &row.service, n).first() {
                    Some(line) => {
                        let m = message(line);
                        if !v.notes.contains(&m) {
                            v.notes.push(m);
                        }
                    }
                    None => v
                        .failed
                        .push(format!("no log line naming {} with {n:?}", row.service)),
                }
            }
            if let Some(cluster) = cluster {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let events = cluster.events(&row.service);
                    if let Some((reason, msg, _)) = events
                        .iter()
                        .find(|(reason, msg, _)| reason == REASON && needles.iter().all(|n| msg.contains(n)))
                    {
                        v.event = json!(reason);
                        v.notes = vec![format!("Event {reason}: {msg}")];
                        break;
                    }
                    if Instant::now() > deadline {
                        v.failed
                            .push(format!("no {REASON} Event with {needles:?}: {events:?}"));
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        AgentExpect::Serves | AgentExpect::Ignores(_) => {
            let named: Vec<&String> = log
                .iter()
                .filter(|l| is_problem(l) && l.contains(&format!("name={}", row.service)))
                .collect();
            if !named.is_empty() {
                v.failed.push(format!("reported, though it is fine: {named:?}"));
            }
            if let Some(cluster) = cluster {
                let events = cluster.events(&row.service);
                if !events.is_empty() {
                    v.failed.push(format!("Events, though it is fine: {events:?}"));
                }
            }
            v.notes.push(match &row.agent {
                AgentExpect::Ignores(why) => format!("ignored without a complaint ({why})"),
                _ => "programmed without a complaint".into(),
            });
        }
    }
    let backends: BTreeSet<String> = site
        .inspect("backends")
        .iter()
        .filter_map(|b| b["address"].as_str().map(str::to_string))
        .collect();
    for b in &row.absent_backends {
        if backends.contains(b) {
            v.failed.push(format!("{b} is a backend"));
        }
    }
    match check_frontends(site, row, timeout) {
        Ok(()) if !row.serves.is_empty() => v.notes.push("the rest of it serves".into()),
        Ok(()) => v.notes.push("nothing of it programmed".into()),
        Err(e) => v.failed.push(e),
    }
    if row.serves.is_empty() && site.frontends().contains_key(&row.service) {
        v.failed.push("programmed".into());
    }
    v
}

/// A table row from a verdict; its failures go to `failures`.
fn table_row(row: &Row, apiserver: &str, mode: &str, v: Verdict, failures: &mut Vec<String>) -> Value {
    failures.extend(v.failed.iter().map(|f| format!("{} ({mode}): {f}", row.what)));
    let ok = json!(v.failed.is_empty());
    let mut parts = v.notes.clone();
    if !v.failed.is_empty() {
        parts.push(format!("NOT AS EXPECTED: {}", v.failed.join("; ")));
    }
    let agent = parts.join("; ");
    json!({
        "row": row.what,
        "object": short(&row.service),
        "apiserver": apiserver,
        "agent": format!("{mode}: {agent}"),
        "event": v.event,
        "ok": ok,
    })
}

/// `elapsed_ms` of the "data path programmed" lines.
fn sync_times(log: &[String]) -> Vec<f64> {
    log.iter()
        .filter(|l| l.contains(lb_tests::agent::SYNCED))
        .filter_map(|l| {
            l.split("elapsed_ms=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// A Service whose port number is a string: no typed client can even build it.
fn malformed_row() -> Row {
    let mut svc = svc_json(
        service(NS, "malformed")
            .cluster_ip(&cip(35))
            .port("http", "TCP", 80, 8080),
    );
    svc["spec"]["ports"][0]["port"] = "eighty".into();
    Row {
        what: "A field of the wrong type (port: \"eighty\")",
        service: "malformed".into(),
        objects: vec![svc],
        api: ApiExpect::Refuses("cannot unmarshal"),
        agent: AgentExpect::Reports(vec!["spec.ports[0].port"]),
        serves: vec![],
        absent: vec![],
        absent_backends: vec![],
    }
}

#[test]
fn hostile_services_and_slices_are_reported_and_skipped_under_load() {
    lb_tests::report::started(
        "5-hostile-input",
        "Hostile and malformed Services and EndpointSlices",
    );
    let started = Instant::now();
    let start_us = now_us();
    // Where the test is, for the failures of the load: (phase, start in µs since the epoch).
    let mut phases: Vec<(&str, u64)> = Vec::new();
    let site = Site::new();
    let cluster = Cluster::new(&site);
    let agent = site.agent(None, Some(cluster.cp.kubeconfig_path().into()));
    for obj in good_objects(&site) {
        cluster.create(&obj).expect("the good Service");
    }
    let all_pods = pods_of(&site, &[0, 1, 2]);
    converge("the good Service serves", Duration::from_secs(20), || {
        served_by(&site, &format!("{GOOD_IP}:80")).as_ref() == Some(&all_pods)
    });
    let node_port = format!("{}:{GOOD_NODE_PORT}", site.node_ip());
    let loads = [
        (
            "socket path, TCP to the good Service's cluster IP every 10 ms",
            Load::start(site.host(), &format!("{GOOD_IP}:80"), "tcp", 10, false),
        ),
        (
            "tc path, TCP to the good Service's NodePort from an external client every 10 ms",
            Load::start(site.external(), &node_port, "tcp", 10, false),
        ),
    ];
    for (_, load) in &loads {
        prioritize(load.pid());
    }
    // Table rows by position: the refused rows, the malformed one, the accepted ones, the huge one.
    let mut table: BTreeMap<usize, Value> = BTreeMap::new();
    let mut failures: Vec<String> = Vec::new();
    phases.push(("API: creating the rows", now_us()));

    // 1. Through the API server: the refused rows are refused, the accepted ones created.
    let refused = refused_rows(&site);
    let malformed = malformed_row();
    let accepted = accepted_rows(&site);
    let mut api_outcome: BTreeMap<&str, String> = BTreeMap::new();
    for row in refused.iter().chain([&malformed]).chain(&accepted) {
        let mut refusals = Vec::new();
        for obj in &row.objects {
            if let Err(e) = cluster.create(obj) {
                refusals.push(format!(
                    "{} {}: {e}",
                    obj["kind"].as_str().unwrap_or_default(),
                    obj["metadata"]["name"].as_str().unwrap_or_default()
                ));
            }
        }
        match row.api {
            ApiExpect::Refuses(needle) => {
                if !refusals.iter().any(|r| r.contains(needle)) {
                    failures.push(format!(
                        "{}: the API server did not refuse it with {needle:?}: {refusals:?}",
                        row.what
                    ));
                }
                api_outcome.insert(row.what, format!("refused: {}", refusals.join("; ")));
            }
            ApiExpect::Accepts => {
                if !refusals.is_empty() {
                    failures.push(format!("{}: refused by the API server: {refusals:?}", row.what));
                }
                api_outcome.insert(row.what, "accepted".into());
            }
        }
    }

    // The huge Service: 200 slices of 1,000 endpoints, created 8 at a time.
    phases.push(("API: creating 200,000 endpoints", now_us()));
    let huge_log_from = plain_log(&agent).len();
    let huge_started = Instant::now();
    cluster
        .create(&svc_json(
            service(NS, "huge")
                .cluster_ip(&cip(49))
                .port("http", "TCP", 80, 8080),
        ))
        .expect("the huge Service");
    let slices = huge_slices();
    let client = cluster.client.clone();
    let results: Vec<Result<(), String>> = cluster.rt.block_on(
        futures::stream::iter(slices.iter().map(|s| {
            let client = client.clone();
            async move { create(&client, s).await }
        }))
        .buffer_unordered(8)
        .collect(),
    );
    let huge_created = huge_started.elapsed();
    let huge_refused: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(huge_refused.is_empty(), "huge slices refused: {huge_refused:?}");
    eprintln!(
        "created {HUGE_ENDPOINTS} endpoints in {} slices in {huge_created:.1?}",
        slices.len()
    );
    // The agent sees all of them and refuses the frontend (log, Event), and nothing of it reaches
    // the maps.
    let all_seen = format!("{HUGE_ENDPOINTS} endpoints in one scope");
    let huge_refused_after = (|| {
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            if !problem_lines(&plain_log(&agent), "huge", &all_seen).is_empty() {
                return Some(huge_started.elapsed());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    })();

    // A Service created after every bad one is programmed.
    phases.push(("API: checking the rows", now_us()));
    for obj in simple(&site, "after-web", &cip(50), &[1, 2]) {
        cluster.create(&obj).expect("after-web");
    }
    let after_programmed = converge(
        "a Service created after the bad ones serves",
        Duration::from_secs(60),
        || served_by(&site, &format!("{}:80", cip(50))) == Some(pods_of(&site, &[1, 2])),
    );

    // The accepted rows: an Event and a log line each (or served / ignored), the rest serves.
    let mut events_seen = 0;
    let base = refused.len() + 1;
    for (i, row) in accepted.iter().enumerate() {
        let v = judge(
            &site,
            row,
            &plain_log(&agent),
            Some(&cluster),
            Duration::from_secs(20),
        );
        events_seen += usize::from(!v.event.is_null());
        table.insert(base + i, table_row(row, "accepted", "API", v, &mut failures));
    }
    // Events are posted after the sync that found the problem, through the client's rate
    // limit (kube-proxy's qps 5, burst 10) behind the accepted rows' Events: wait for it.
    // The Event naming the whole Service: each count the agent saw on the way (its slices
    // arrive one by one) had an Event of its own, and the last must name all the endpoints.
    let whole = format!("{HUGE_ENDPOINTS} endpoints in one scope");
    let huge_event_of = |events: &[(String, String, i64)]| {
        events
            .iter()
            .find(|(reason, msg, _)| reason == REASON && msg.contains(&whole))
            .cloned()
    };
    let mut huge_events = cluster.events("huge");
    let event_deadline = Instant::now() + Duration::from_secs(30);
    while huge_event_of(&huge_events).is_none() && Instant::now() < event_deadline {
        std::thread::sleep(Duration::from_millis(200));
        huge_events = cluster.events("huge");
    }
    let huge_event = huge_event_of(&huge_events);
    let huge_event = huge_event.as_ref();
    let huge_frontends = site.frontends().get("huge").cloned().unwrap_or_default();
    let backends_in_maps = site.inspect("backends").len();
    let huge_log = plain_log(&agent);
    let huge_syncs = sync_times(&huge_log[huge_log_from..]);
    let huge_ok = huge_refused_after.is_some()
        && huge_event.is_some()
        && huge_frontends.is_empty()
        && backends_in_maps < 100;
    if huge_ok {
        events_seen += 1;
    } else {
        failures.push(format!(
            "huge Service: refused after {huge_refused_after:?}, Events {huge_events:?}, frontends {huge_frontends:?}, \
             {backends_in_maps} backends in the maps"
        ));
    }
    table.insert(
        base + accepted.len(),
        json!({
            "row": format!("{HUGE_ENDPOINTS} endpoints in {} EndpointSlices of {HUGE_SLICE}", HUGE_ENDPOINTS / HUGE_SLICE),
            "object": "huge",
            "apiserver": format!("accepted (created in {:.1} s)", huge_created.as_secs_f64()),
            "agent": format!(
                "API: not programmed (more than {} backends in a scope; {} backends in the maps), logged with all {HUGE_ENDPOINTS} endpoints {:.1} s after the first slice; Event {}",
                lb_agent::plan::MAX_BACKENDS_PER_SCOPE,
                backends_in_maps,
                huge_refused_after.map_or(f64::NAN, |t| t.as_secs_f64()),
                huge_event.map_or("none naming all of them".to_string(), |e| format!(
                    "{}: {} (one of {} Events, one per count seen as the slices arrived)",
                    e.0,
                    e.1,
                    huge_events.iter().filter(|(reason, _, _)| reason == REASON).count()
                )),
            ),
            "event": huge_event.map(|e| e.0.clone()),
            "ok": huge_ok,
        }),
    );

    // 2. Delete the bad objects: only the good Services remain, and the problems stop.
    let keep: BTreeSet<String> = [GOOD.to_string(), "after-web".into()]
        .into_iter()
        .chain(
            accepted
                .iter()
                .filter(|r| matches!(r.agent, AgentExpect::Serves | AgentExpect::Ignores(_)))
                .map(|r| r.service.clone()),
        )
        .collect();
    phases.push(("API: deleting the bad objects", now_us()));
    let deleting = Instant::now();
    for row in refused.iter().chain(&accepted) {
        for obj in &row.objects {
            let name = obj["metadata"]["name"].as_str().unwrap_or_default();
            let kind = obj["kind"].as_str().unwrap_or_default();
            let owner = if kind == "Service" {
                name
            } else {
                obj["metadata"]["labels"]["kubernetes.io/service-name"]
                    .as_str()
                    .unwrap_or_default()
            };
            if !keep.contains(owner) {
                cluster.delete(kind, name);
            }
        }
    }
    cluster.delete("Service", "huge");
    cluster
        .rt
        .block_on(
            Api::<EndpointSlice>::namespaced(cluster.client.clone(), NS).delete_collection(
                &DeleteParams::default(),
                &ListParams::default().labels("kubernetes.io/service-name=huge"),
            ),
        )
        .expect("delete the huge slices");
    converge(
        "only the good Services are programmed",
        Duration::from_secs(60),
        || site.frontends().keys().cloned().collect::<BTreeSet<_>>() == keep,
    );
    let cleaned = deleting.elapsed();
    agent.wait_for_next_sync();
    let events_before = cluster.all_events();
    let lines_before = plain_log(&agent).len();
    std::thread::sleep(Duration::from_secs(3));
    agent.wait_for_next_sync();
    // Problems with objects of the test (a warning that the API server's watch failed and is
    // retried, which a loaded machine may see while 200 slices are deleted, is not one: it is
    // reported beside, not asserted).
    let (late_problems, late_other): (Vec<String>, Vec<String>) = plain_log(&agent)[lines_before..]
        .iter()
        .filter(|l| is_problem(l))
        .cloned()
        .partition(|l| names_a_test_object(l));
    let events_after = cluster.all_events();
    if !late_problems.is_empty() {
        failures.push(format!("problems after the deletions: {late_problems:?}"));
    }
    let late_events: Vec<_> = events_after.difference(&events_before).collect();
    if !late_events.is_empty() {
        failures.push(format!("Events after the deletions: {late_events:?}"));
    }
    let backends_after_clean = site.inspect("backends").len();
    let api_phase = started.elapsed();

    // 3. The agent in --manifests mode (no API validation) on the same pins, with every row the
    // API server refused. The load keeps running across the restart.
    phases.push(("restart into --manifests", now_us()));
    assert!(agent.stop().success(), "the agent stops cleanly");
    let dir = tempfile::tempdir().expect("tempdir");
    write_objects(
        dir.path(),
        "00-node.json",
        &[with_kind(node_object(site.node_ip()), "v1", "Node")],
    );
    write_objects(dir.path(), "01-good.yaml", &good_objects(&site));
    for (i, row) in refused.iter().enumerate() {
        write_objects(dir.path(), &format!("row-{i:02}.yaml"), &row.objects);
    }
    write_objects(
        dir.path(),
        "zz-later.yaml",
        &simple(&site, "later-web", &cip(60), &[0, 2]),
    );
    let manifests_agent = site.agent(Some(dir.path().into()), None);
    let later_programmed = converge(
        "a valid Service next to the bad ones is programmed",
        Duration::from_secs(30),
        || served_by(&site, &format!("{}:80", cip(60))) == Some(pods_of(&site, &[0, 2])),
    );
    phases.push(("--manifests: checking the rows", now_us()));
    manifests_agent.wait_for_next_sync();
    let mut reported_by_manifests = 0;
    for (i, row) in refused.iter().enumerate() {
        let v = judge(
            &site,
            row,
            &plain_log(&manifests_agent),
            None,
            Duration::from_secs(10),
        );
        if matches!(row.agent, AgentExpect::Reports(_)) && v.failed.is_empty() {
            reported_by_manifests += 1;
        }
        let said = api_outcome.get(row.what).cloned().unwrap_or_default();
        table.insert(i, table_row(row, &said, "--manifests", v, &mut failures));
    }
    // The bad rows removed from the folder: only the good Services remain.
    for i in 0..refused.len() {
        let _ = std::fs::remove_file(dir.path().join(format!("row-{i:02}.yaml")));
    }
    let manifest_services: BTreeSet<String> = [GOOD.to_string(), "later-web".into()].into();
    let manifests_clean = converge(
        "manifests: only the good Services",
        Duration::from_secs(30),
        || site.frontends().keys().cloned().collect::<BTreeSet<_>>() == manifest_services,
    );
    manifests_agent.wait_for_next_sync();
    let lines_before = plain_log(&manifests_agent).len();
    manifests_agent.wait_for_next_sync();
    let late_manifest_problems: Vec<String> = plain_log(&manifests_agent)[lines_before..]
        .iter()
        .filter(|l| is_problem(l))
        .cloned()
        .collect();
    if !late_manifest_problems.is_empty() {
        failures.push(format!(
            "manifests: problems after removing the rows: {late_manifest_problems:?}"
        ));
    }

    // A malformed object (a field of the wrong type) next to a new valid Service.
    phases.push(("--manifests: a malformed object", now_us()));
    write_objects(
        dir.path(),
        "zz-latest.yaml",
        &simple(&site, "latest-web", &cip(61), &[1]),
    );
    write_objects(dir.path(), "zz-malformed.yaml", &malformed.objects);
    let latest = format!("{}:80", cip(61));
    let malformed_window = Instant::now() + Duration::from_secs(5);
    let mut latest_served = false;
    while Instant::now() < malformed_window && !latest_served {
        latest_served = served_by(&site, &latest) == Some(pods_of(&site, &[1]));
    }
    let log = plain_log(&manifests_agent);
    let named: Option<String> = log
        .iter()
        .find(|l| is_problem(l) && l.contains("\"malformed\"") && l.contains("spec.ports[0].port"))
        .map(|l| message(l).replace(&dir.path().display().to_string(), "<manifests>"));
    let mut v = Verdict {
        notes: named.iter().cloned().collect(),
        failed: Vec::new(),
        event: Value::Null,
    };
    if named.is_none() {
        v.failed.push("no log line names the object and its field".into());
    }
    if latest_served {
        v.notes
            .push("a valid Service added next to it was programmed; the rest kept serving".into());
    } else {
        v.failed
            .push("a valid Service added next to it was not programmed within 5 s".into());
    }
    if site.frontends().contains_key(&malformed.service) {
        v.failed.push("programmed".into());
    }
    let _ = std::fs::remove_file(dir.path().join("zz-malformed.yaml"));
    converge("the malformed object removed", Duration::from_secs(30), || {
        served_by(&site, &latest) == Some(pods_of(&site, &[1]))
    });
    if v.failed.is_empty() {
        reported_by_manifests += 1;
    }
    let said = api_outcome.get(malformed.what).cloned().unwrap_or_default();
    table.insert(
        refused.len(),
        table_row(&malformed, &said, "--manifests", v, &mut failures),
    );

    let good_complaints: Vec<String> = plain_log(&manifests_agent)
        .into_iter()
        .filter(|l| is_problem(l) && (l.contains(&format!("name={GOOD}")) || l.contains("name=later-web")))
        .collect();
    if !good_complaints.is_empty() {
        failures.push(format!("the good Services were reported: {good_complaints:?}"));
    }

    let mut per_load = Vec::new();
    let (mut attempted, mut failed) = (0, 0);
    for (what, load) in loads {
        let results = load.stop();
        let (a, f) = tally(&results);
        attempted += a;
        failed += f;
        let mut entry = lb_tests::load::row(what, &results);
        if f > 0 {
            entry["failures"] = failures_by_phase(&results, &phases, start_us).into();
        }
        per_load.push(entry);
    }
    let events = lb_tests::agent::datapath_events(&site.bpf_root());
    drop(manifests_agent);
    let rows: Vec<Value> = table.into_values().collect();
    let rows_failed = rows.iter().filter(|r| r["ok"] == false).count();
    let known_bugs: Vec<&str> = rows.iter().filter_map(|r| r["ok"].as_str()).collect();
    let refused_count = api_outcome.values().filter(|o| o.starts_with("refused")).count();
    let total = started.elapsed();
    lb_tests::report::record(
        "5-hostile-input",
        &json!({
            "scenario": "Hostile and malformed Services and EndpointSlices: through the API server (what it accepts), then through --manifests (what it refuses), under load",
            "load": per_load,
            "attempted": attempted,
            "failed": failed,
            "rows": rows,
            "rows_failed": rows_failed,
            "known_bugs": known_bugs.len(),
            "refused_by_apiserver": refused_count,
            "accepted_by_apiserver": accepted.len() + 1,
            "events": events_seen,
            "reported_in_manifests_mode": reported_by_manifests,
            "huge_service": {
                "endpoints": HUGE_ENDPOINTS,
                "slices": HUGE_ENDPOINTS / HUGE_SLICE,
                "created_in_s": huge_created.as_secs_f64(),
                "all_seen_and_refused_after_s": huge_refused_after.map(|t| t.as_secs_f64()),
                "backends_in_maps": backends_in_maps,
                "sync_ms_p50": percentile(huge_syncs.clone(), 0.5),
                "sync_ms_max": percentile(huge_syncs, 1.0),
            },
            "service_created_after_programmed_in_s": after_programmed.as_secs_f64(),
            "service_next_to_bad_manifests_programmed_in_s": later_programmed.as_secs_f64(),
            "clean_after_delete_s": cleaned.as_secs_f64(),
            "backends_after_delete": backends_after_clean,
            "problems_after_delete": late_problems.len() + late_events.len() + late_manifest_problems.len(),
            "other_warnings_after_delete": late_other,
            "manifests_clean_after_removal_s": manifests_clean.as_secs_f64(),
            "api_phase_s": api_phase.as_secs_f64(),
            "test_s": total.as_secs_f64(),
        }),
    );
    assert!(
        failures.is_empty(),
        "{} problem(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The failures first (CI shows a failure's first lines), then each load's whole row.
    let first_failures: Vec<String> = per_load
        .iter()
        .filter_map(|l| l.get("failures"))
        .flat_map(|f| f.as_array().cloned().unwrap_or_default())
        .map(|f| f.as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        failed,
        0,
        "the good Service never fails a request: {failed} of {attempted} failed, first at\n{}\n{}\ndata path events: {events:#}",
        first_failures.join("\n"),
        serde_json::to_string_pretty(&per_load).unwrap_or_default()
    );
    assert_eq!(rows_failed, 0, "rows failed: {rows:#?}");
}

/// A node namespace, cgroup and bpffs with an agent reading `dir` (no pods: the checks read the
/// pinned maps).
struct ManifestNode {
    agent: Option<Agent>,
    bpf_root: PathBuf,
    _cgroup: Cgroup,
    _ns: lb_tests::netns::NetNs,
    _bpffs: BpfFs,
}

impl ManifestNode {
    fn start(dir: &Path) -> ManifestNode {
        require_root();
        let bpffs = BpfFs::new();
        let cgroup = Cgroup::new("lbhost");
        let ns = lb_tests::netns::NetNs::new("lbhost");
        let bpf_root = bpf_root_in(bpffs.path());
        let agent = Agent::start(AgentOptions {
            netns: &ns,
            cgroup: &cgroup,
            bpf_root: bpf_root.clone(),
            node_name: NODE.into(),
            manifests: Some(dir.to_path_buf()),
            kubeconfig: None,
            extra_args: vec![],
        });
        ManifestNode {
            agent: Some(agent),
            bpf_root,
            _cgroup: cgroup,
            _ns: ns,
            _bpffs: bpffs,
        }
    }

    fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("running")
    }

    fn inspect(&self, cmd: &str) -> String {
        let out = Command::new(workspace_bin("lb-agent"))
            .args([cmd, "-o", "json", "--bpf-root"])
            .arg(&self.bpf_root)
            .output()
            .expect("lb-agent");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for ManifestNode {
    fn drop(&mut self) {
        if let Some(agent) = self.agent.take() {
            agent.stop();
        }
    }
}

/// Regression: in `--manifests` mode an EndpointSlice endpoint on a special address
/// (127.0.0.1, 0.0.0.0, multicast) became a backend without a word. The API server refuses such
/// addresses (`may not be in the loopback range`), as the agent now does for a Service's own
/// addresses; a loopback backend sends a cluster IP's connections from the node to the node's own
/// loopback services (here 127.0.0.1:22, sshd), the very redirection the special-address check on
/// externalIPs prevents. Expected: the endpoint is skipped with a warning naming the slice and
/// `endpoints[i]`; the valid endpoint stays.
#[test]
fn manifests_endpoint_on_a_special_address_is_reported_and_skipped() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_objects(
        dir.path(),
        "a.yaml",
        &[
            svc_json(
                service(NS, "loopback-endpoint")
                    .cluster_ip("10.96.71.10")
                    .port("ssh", "TCP", 22, 22),
            ),
            {
                let mut s = raw_slice(
                    "loopback-endpoint",
                    "loopback-endpoint-1",
                    "IPv4",
                    &["127.0.0.1", "0.0.0.0", "224.0.0.1", "10.244.1.2"],
                    22,
                );
                s["ports"][0]["name"] = "ssh".into();
                s
            },
        ],
    );
    let node = ManifestNode::start(dir.path());
    node.agent().wait_for_next_sync();
    let backends = node.inspect("backends");
    let log: Vec<String> = node.agent().log().lines().map(strip_ansi).collect();
    for (i, special) in ["127.0.0.1", "0.0.0.0", "224.0.0.1"].iter().enumerate() {
        assert!(
            !backends.contains(&format!("\"{special}:22\"")),
            "{special} is a backend: {backends}"
        );
        assert!(
            !problem_lines(&log, "loopback-endpoint", &format!("endpoints[{i}]")).is_empty(),
            "no warning about endpoints[{i}] ({special}):\n{}",
            log.join("\n")
        );
    }
    assert!(backends.contains("\"10.244.1.2:22\""), "{backends}");
}

/// Regression: in `--manifests` mode one object that does not deserialize (a field of the
/// wrong type, which the API server refuses with `cannot unmarshal`) failed the whole folder: every
/// sync failed ("run failed ... is malformed"), so no other object was programmed (a fresh agent
/// programmed nothing; a running one froze on its last state). Expected: the agent logs the object
/// and skips just it, as for every other malformed field.
#[test]
fn manifests_a_malformed_object_skips_only_that_object() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_objects(
        dir.path(),
        "good.yaml",
        &[svc_json(
            service(NS, "good")
                .cluster_ip("10.96.71.20")
                .port("http", "TCP", 80, 8080),
        )],
    );
    let mut bad = svc_json(
        service(NS, "bad")
            .cluster_ip("10.96.71.21")
            .port("http", "TCP", 80, 8080),
    );
    bad["spec"]["ports"][0]["port"] = "eighty".into();
    write_objects(dir.path(), "bad.yaml", &[bad]);
    let node = ManifestNode::start(dir.path());
    std::thread::sleep(Duration::from_secs(2));
    let log: Vec<String> = node.agent().log().lines().map(strip_ansi).collect();
    assert!(
        log.iter().any(|l| is_problem(l) && l.contains("\"bad\"")),
        "the malformed object is named:\n{}",
        log.join("\n")
    );
    let services = node.inspect("services");
    assert!(
        services.contains("10.96.71.20:80/TCP"),
        "the valid Service next to the malformed one is not programmed: {services}\n{}",
        log.join("\n")
    );
}

/// Regression, in `ProblemReporter` (lb-agent/src/watch/kube.rs) with kube-runtime's
/// `Recorder`: the Recorder keys its Events by (type, action, reason, regarding object), not by
/// message, so every `InvalidService` problem of one Service lands in the same Event, which it
/// PATCHes with the message it cached first; and `ProblemReporter` remembers one message per
/// Service, so with two problems each sync sees the other one as new and publishes both again.
/// Result: a Service with two problems (here two IPv6 externalIPs on an IPv4-only Service, which
/// the API server accepts) shows one Event naming only the first problem, whose count grows by two
/// at every sync (about 9 per second with the tests' 200 ms sync period) for as long as the
/// problems last. Expected: one Event per problem, each published once.
#[test]
fn a_service_with_two_problems_gets_an_event_for_each_once() {
    let site = Site::new();
    let cluster = Cluster::new(&site);
    let agent = site.agent(None, Some(cluster.cp.kubeconfig_path().into()));
    let mut objects = simple(&site, "two-problems", &cip(80), &[0]);
    objects[0]["spec"]["externalIPs"] = json!(["2001:db8::1", "2001:db8::2"]);
    for o in &objects {
        cluster.create(o).expect("accepted");
    }
    converge("an Event", Duration::from_secs(20), || {
        !cluster.events("two-problems").is_empty()
    });
    std::thread::sleep(Duration::from_secs(2));
    agent.wait_for_next_sync();
    let count = |c: &Cluster| -> i64 { c.events("two-problems").iter().map(|e| e.2).sum() };
    let before = count(&cluster);
    let syncs_before = agent.syncs();
    std::thread::sleep(Duration::from_secs(5));
    let after = count(&cluster);
    let syncs = agent.syncs() - syncs_before;
    let events = cluster.events("two-problems");
    let shown = |needle: &str| events.iter().any(|(_, msg, _)| msg.contains(needle));
    assert!(
        shown("spec.externalIPs[0]") && shown("spec.externalIPs[1]") && before == after,
        "Events on the Service: {events:?}; {} occurrences added in 5 s ({syncs} syncs) with nothing changing",
        after - before,
    );
}

/// Regression, same cause: once a Service has an `InvalidService` Event, a different problem
/// on it (here the IPv6 externalIP changed from 2001:db8::1 to 2001:db8::2) only bumps the old
/// Event's count; its message keeps naming the old problem (for the Recorder's 6-minute cache
/// TTL). The 200,000-endpoint Service of the scenario above shows it too: its Event still says
/// "19000 endpoints" once all 200,000 are listed. Expected: the Event names the current problem.
#[test]
fn an_event_follows_a_changed_problem() {
    let site = Site::new();
    let cluster = Cluster::new(&site);
    let _agent = site.agent(None, Some(cluster.cp.kubeconfig_path().into()));
    let mut objects = simple(&site, "changed-problem", &cip(81), &[0]);
    objects[0]["spec"]["externalIPs"] = json!(["2001:db8::1"]);
    for o in &objects {
        cluster.create(o).expect("accepted");
    }
    converge("the first Event", Duration::from_secs(20), || {
        cluster
            .events("changed-problem")
            .iter()
            .any(|(_, msg, _)| msg.contains("2001:db8::1"))
    });
    cluster
        .rt
        .block_on(Api::<Service>::namespaced(cluster.client.clone(), NS).patch(
            "changed-problem",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"externalIPs": ["2001:db8::2"]}})),
        ))
        .expect("patch");
    let deadline = Instant::now() + Duration::from_secs(15);
    while !cluster
        .events("changed-problem")
        .iter()
        .any(|(_, msg, _)| msg.contains("2001:db8::2"))
    {
        assert!(
            Instant::now() < deadline,
            "no Event names the new problem (2001:db8::2) within 15 s: {:?}",
            cluster.events("changed-problem")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
