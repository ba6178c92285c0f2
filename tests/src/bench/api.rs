//! The Service set, written through the real API server: Service `bench/sNNNNN` number `i` has
//! the ClusterIP `10.96.1.0 + i`, port 80 (TCP) to target port 8080, and one EndpointSlice with
//! 10 ready endpoints `10.128.0.0 + 16 i + j + 1` (j < 10) on another node. ClusterIPs are set
//! explicitly so every run (and every delete/re-create) uses the same addresses.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{
        core::v1::{Namespace, Node, NodeAddress, NodeStatus, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use lb_tests::{
    control_plane::ControlPlane,
    fixtures::{State, service, slice},
};

use super::{crr::now_ns, topo};

pub const NS: &str = "bench";
pub const NODE: &str = "bench-node";
pub const ENDPOINTS: u32 = 10;
pub const SERVICE_PORT: u16 = 80;
/// Services used for the add/change/remove measurements start at this index.
pub const EXTRA_BASE: u32 = 50_000;
/// Parallel API requests when creating or deleting many objects.
const CONCURRENCY: usize = 8;

pub fn svc_name(i: u32) -> String {
    format!("s{i:05}")
}

pub fn cluster_ip(i: u32) -> Ipv4Addr {
    assert!(i < 60_000, "service index {i} outside 10.96.0.0/16");
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 1, 0)) + i)
}

pub fn endpoint_ip(i: u32, j: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + i * 16 + j + 1)
}

pub fn vip(i: u32, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(cluster_ip(i), port)
}

pub fn endpoints(i: u32) -> Vec<SocketAddrV4> {
    (0..ENDPOINTS)
        .map(|j| SocketAddrV4::new(endpoint_ip(i, j), topo::BACKEND_PORT))
        .collect()
}

pub fn build_service(i: u32, port: u16) -> Service {
    service(NS, &svc_name(i))
        .cluster_ip(&cluster_ip(i).to_string())
        .port("http", "TCP", i32::from(port), i32::from(topo::BACKEND_PORT))
        .build()
}

pub fn build_slice(i: u32) -> EndpointSlice {
    let mut s = slice(NS, &svc_name(i), &format!("{}-1", svc_name(i)));
    for j in 0..ENDPOINTS {
        s = s.endpoint(&endpoint_ip(i, j).to_string(), "bench-node-b", State::Ready);
    }
    s.port("http", "TCP", i32::from(topo::BACKEND_PORT)).build()
}

type WatchLog = Arc<std::sync::Mutex<Vec<(u64, String, u16, bool)>>>;

/// Service watch events seen by lb-bench itself: (time, name, first port, deleted).
pub struct ServiceWatch {
    events: WatchLog,
    task: tokio::task::JoinHandle<()>,
}

impl ServiceWatch {
    /// When the first event for `i` after `since` with this port (or a deletion) arrived.
    pub fn seen(&self, since: u64, i: u32, port: u16, deleted: bool) -> Option<u64> {
        let name = svc_name(i);
        self.events
            .lock()
            .expect("watch log")
            .iter()
            .find(|(t, n, p, d)| *t >= since && *n == name && *d == deleted && (deleted || *p == port))
            .map(|(t, ..)| *t)
    }
}

impl Drop for ServiceWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The API client and the number of benchmark Services that exist (`0..present`).
pub struct Cluster {
    pub rt: tokio::runtime::Runtime,
    pub client: kube::Client,
    pub present: u32,
}

fn code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// Retries transient failures; `ok_code` (409 on create, 404 on delete) counts as done.
async fn retry<F, Fut, T>(what: &str, ok_code: u16, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let mut attempt = 0;
    loop {
        match f().await {
            Ok(_) => return,
            Err(e) if code(&e) == Some(ok_code) => return,
            Err(e) => {
                attempt += 1;
                assert!(attempt < 20, "{what}: {e}");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

impl Cluster {
    /// The benchmark namespace and the Node every proxy runs as (InternalIP = the node address).
    pub fn setup(cp: &ControlPlane) -> Cluster {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let client = rt.block_on(cp.client()).expect("kube client");
        rt.block_on(async {
            let namespaces: Api<Namespace> = Api::all(client.clone());
            let ns = Namespace {
                metadata: ObjectMeta {
                    name: Some(NS.into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            let pp = PostParams::default();
            retry("create namespace", 409, || namespaces.create(&pp, &ns)).await;
            let nodes: Api<Node> = Api::all(client.clone());
            let node = Node {
                metadata: ObjectMeta {
                    name: Some(NODE.into()),
                    labels: Some(BTreeMap::from([(
                        "kubernetes.io/hostname".to_string(),
                        NODE.to_string(),
                    )])),
                    ..Default::default()
                },
                ..Default::default()
            };
            retry("create node", 409, || nodes.create(&pp, &node)).await;
            let status = NodeStatus {
                addresses: Some(vec![NodeAddress {
                    type_: "InternalIP".into(),
                    address: topo::NODE_IP.into(),
                }]),
                ..Default::default()
            };
            nodes
                .patch_status(
                    NODE,
                    &PatchParams::default(),
                    &Patch::Merge(&serde_json::json!({ "status": status })),
                )
                .await
                .expect("node status");
        });
        Cluster {
            rt,
            client,
            present: 0,
        }
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), NS)
    }

    fn slices(&self) -> Api<EndpointSlice> {
        Api::namespaced(self.client.clone(), NS)
    }

    /// Runs `op(i)` for every index with a few requests in flight, printing progress.
    fn parallel<F, Fut>(&self, what: &str, indices: Vec<u32>, op: F)
    where
        F: Fn(Api<Service>, Api<EndpointSlice>, u32) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let total = indices.len();
        if total == 0 {
            return;
        }
        let indices = Arc::new(indices);
        let next = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicUsize::new(0));
        let op = Arc::new(op);
        let started = Instant::now();
        self.rt.block_on(async {
            let mut tasks = Vec::new();
            for _ in 0..CONCURRENCY {
                let (indices, next, done, op) = (indices.clone(), next.clone(), done.clone(), op.clone());
                let (svcs, slices) = (self.services(), self.slices());
                tasks.push(tokio::spawn(async move {
                    loop {
                        let k = next.fetch_add(1, Ordering::SeqCst);
                        let Some(&i) = indices.get(k) else { break };
                        op(svcs.clone(), slices.clone(), i).await;
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                }));
            }
            let mut last_print = Instant::now();
            loop {
                let finished = tasks.iter().all(|t| t.is_finished());
                if finished {
                    break;
                }
                if total >= 500 && last_print.elapsed() > Duration::from_secs(5) {
                    last_print = Instant::now();
                    eprintln!(
                        "    {what}: {}/{total} ({:.0}/s)",
                        done.load(Ordering::SeqCst),
                        done.load(Ordering::SeqCst) as f64 / started.elapsed().as_secs_f64()
                    );
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            for t in tasks {
                t.await.expect("API worker panicked");
            }
        });
    }

    /// Creates Services (and their slices) `present..n`. Returns (first request, all done) times.
    pub fn grow_to(&mut self, n: u32) -> (u64, u64) {
        let started = now_ns();
        let indices: Vec<u32> = (self.present..n).collect();
        self.parallel(
            "creating Services + EndpointSlices",
            indices,
            |svcs, slices, i| async move {
                let (pp, svc, sl) = (
                    PostParams::default(),
                    build_service(i, SERVICE_PORT),
                    build_slice(i),
                );
                retry("create service", 409, || svcs.create(&pp, &svc)).await;
                retry("create slice", 409, || slices.create(&pp, &sl)).await;
            },
        );
        self.present = self.present.max(n);
        (started, now_ns())
    }

    /// Deletes Services (and slices) `n..present`.
    pub fn shrink_to(&mut self, n: u32) {
        let indices: Vec<u32> = (n..self.present).rev().collect();
        self.parallel(
            "deleting Services + EndpointSlices",
            indices,
            |svcs, slices, i| async move {
                let (dp, svc, name) = (DeleteParams::default(), svc_name(i), format!("{}-1", svc_name(i)));
                retry("delete service", 404, || svcs.delete(&svc, &dp)).await;
                retry("delete slice", 404, || slices.delete(&name, &dp)).await;
            },
        );
        self.present = self.present.min(n);
    }

    /// Watches the benchmark Services from this process: when each Service event reached an API
    /// client. This is the API server's share of a change's latency (persisting the object and
    /// delivering the watch event), which every proxy pays before it can do anything.
    pub fn watch_services(&self) -> ServiceWatch {
        use futures::StreamExt;
        use kube::runtime::watcher;
        let events = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = events.clone();
        let api = self.services();
        let task = self.rt.spawn(async move {
            let mut stream = std::pin::pin!(watcher(api, watcher::Config::default()));
            while let Some(ev) = stream.next().await {
                let (deleted, svc) = match ev {
                    Ok(watcher::Event::Apply(s)) => (false, s),
                    Ok(watcher::Event::Delete(s)) => (true, s),
                    _ => continue,
                };
                let port = svc
                    .spec
                    .as_ref()
                    .and_then(|s| s.ports.as_ref())
                    .and_then(|p| p.first())
                    .map(|p| p.port as u16)
                    .unwrap_or(0);
                let name = svc.metadata.name.unwrap_or_default();
                sink.lock()
                    .expect("watch log")
                    .push((now_ns(), name, port, deleted));
            }
        });
        ServiceWatch { events, task }
    }

    pub fn create_slice(&self, i: u32) {
        let api = self.slices();
        let (pp, sl) = (PostParams::default(), build_slice(i));
        self.rt
            .block_on(retry("create slice", 409, || api.create(&pp, &sl)));
    }

    pub fn delete_slice(&self, i: u32) {
        let api = self.slices();
        let (dp, name) = (DeleteParams::default(), format!("{}-1", svc_name(i)));
        self.rt
            .block_on(retry("delete slice", 404, || api.delete(&name, &dp)));
    }

    pub fn create_service(&self, i: u32) {
        let api = self.services();
        let (pp, svc) = (PostParams::default(), build_service(i, SERVICE_PORT));
        self.rt
            .block_on(retry("create service", 409, || api.create(&pp, &svc)));
    }

    pub fn delete_service(&self, i: u32) {
        let api = self.services();
        let (dp, name) = (DeleteParams::default(), svc_name(i));
        self.rt
            .block_on(retry("delete service", 404, || api.delete(&name, &dp)));
    }

    /// Changes the Service's port (the whole ports list is replaced by a JSON merge patch).
    pub fn set_port(&self, i: u32, port: u16) {
        let api = self.services();
        let patch = serde_json::json!({ "spec": { "ports": [
            { "name": "http", "protocol": "TCP", "port": port, "targetPort": topo::BACKEND_PORT }
        ]}});
        self.rt.block_on(async {
            api.patch(&svc_name(i), &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .expect("patch service port");
        });
    }
}
