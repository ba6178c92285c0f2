//! The Service set, written through the real API server: Service `bench/sNNNNN` number `i` has
//! the ClusterIP `10.96.1.0 + i`, port 80 (TCP) to target port 8080, and one EndpointSlice with
//! 10 ready endpoints `10.128.0.0 + 16 i + j + 1` (j < 10) on another node. ClusterIPs are set
//! explicitly so every run (and every delete/re-create) uses the same addresses.
//!
//! The IPv6 set is the same in IPv6, single-stack (the cluster is dual-stack, IPv4 first):
//! `bench/sNNNNN-v6` has the ClusterIP `fd00:10:96::100 + i` (the same offset in the IPv6
//! Service range) and one `addressType: IPv6` slice with the endpoints `fd00:10:200:: + 16 i +
//! j + 1`. The two sets are independent: the suite has one or the other in the API.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{
        core::v1::{Namespace, Node, NodeAddress, NodeSpec, NodeStatus, Service},
        discovery::v1::EndpointSlice,
        networking::v1::IPAddress,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use lb_tests::{
    control_plane::ControlPlane,
    fixtures::{State, service, slice},
    packet::Family,
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

/// The name of Service `i` of `family`'s set.
pub fn svc_name_in(family: Family, i: u32) -> String {
    match family {
        Family::V4 => format!("s{i:05}"),
        Family::V6 => format!("s{i:05}-v6"),
    }
}

pub fn svc_name(i: u32) -> String {
    svc_name_in(Family::V4, i)
}

/// The ClusterIP of Service `i` of `family`'s set: the same offset (256 + i) in either range.
pub fn cluster_ip_in(family: Family, i: u32) -> IpAddr {
    assert!(i < 60_000, "service index {i} outside the Service ranges");
    match family {
        Family::V4 => cluster_ip(i).into(),
        Family::V6 => {
            Ipv6Addr::from(u128::from(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x100)) + u128::from(i))
                .into()
        }
    }
}

pub fn cluster_ip(i: u32) -> Ipv4Addr {
    assert!(i < 60_000, "service index {i} outside 10.96.0.0/16");
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 1, 0)) + i)
}

/// Endpoint `j` of Service `i` of `family`'s set: the same offset in either endpoint range.
pub fn endpoint_ip_in(family: Family, i: u32, j: u32) -> IpAddr {
    match family {
        Family::V4 => endpoint_ip(i, j).into(),
        Family::V6 => Ipv6Addr::from(
            u128::from(Ipv6Addr::new(0xfd00, 0x10, 0x200, 0, 0, 0, 0, 0)) + u128::from(i * 16 + j + 1),
        )
        .into(),
    }
}

pub fn endpoint_ip(i: u32, j: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + i * 16 + j + 1)
}

pub fn vip_in(family: Family, i: u32, port: u16) -> SocketAddr {
    SocketAddr::new(cluster_ip_in(family, i), port)
}

pub fn vip(i: u32, port: u16) -> SocketAddr {
    vip_in(Family::V4, i, port)
}

pub fn endpoints_in(family: Family, i: u32) -> Vec<SocketAddr> {
    (0..ENDPOINTS)
        .map(|j| SocketAddr::new(endpoint_ip_in(family, i, j), topo::BACKEND_PORT))
        .collect()
}

pub fn build_service_in(family: Family, i: u32, port: u16) -> Service {
    let svc = service(NS, &svc_name_in(family, i));
    match family {
        Family::V4 => svc.cluster_ip(&cluster_ip(i).to_string()),
        // Single-stack IPv6 (`ipFamilies: [IPv6]`) in the IPv4-first dual-stack cluster.
        Family::V6 => svc.cluster_ips(&[&cluster_ip_in(family, i).to_string()]),
    }
    .port("http", "TCP", i32::from(port), i32::from(topo::BACKEND_PORT))
    .build()
}

pub fn build_service(i: u32, port: u16) -> Service {
    build_service_in(Family::V4, i, port)
}

/// The slice of Service `i` of `family`'s set (its `addressType` is the family's).
pub fn build_slice_in(family: Family, i: u32) -> EndpointSlice {
    let name = svc_name_in(family, i);
    let mut s = slice(NS, &name, &format!("{name}-1"));
    for j in 0..ENDPOINTS {
        s = s.endpoint(
            &endpoint_ip_in(family, i, j).to_string(),
            "bench-node-b",
            State::Ready,
        );
    }
    s.port("http", "TCP", i32::from(topo::BACKEND_PORT)).build()
}

pub fn build_slice(i: u32) -> EndpointSlice {
    build_slice_in(Family::V4, i)
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

/// The API client and the number of benchmark Services that exist (`0..present` of the IPv4
/// set, `0..present6` of the IPv6 set).
pub struct Cluster {
    pub rt: tokio::runtime::Runtime,
    pub client: kube::Client,
    pub present: u32,
    pub present6: u32,
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

/// Creates a benchmark Service ([`retry`]). Its cluster IP may still be held by the IPAddress
/// object of the Service of the same index deleted moments before: the API server deletes that
/// object after deleting the Service, and under load it leaves some to its repair loop, which
/// runs minutes later (seen at 10,000 Services: "provided IP is already allocated" past all the
/// retries). An IPAddress whose parent Service is gone is released before the next attempt, as
/// the repair loop would; one whose parent exists is a real conflict and fails the run.
async fn create_service_in(svcs: &Api<Service>, svc: &Service) {
    let name = svc.metadata.name.clone().unwrap_or_default();
    let ip = svc.spec.as_ref().and_then(|s| {
        s.cluster_ip
            .clone()
            .or_else(|| s.cluster_ips.as_ref()?.first().cloned())
    });
    let pp = PostParams::default();
    retry(&format!("create service {name}"), 409, || async {
        let created = svcs.create(&pp, svc).await;
        if let (Err(e), Some(ip)) = (&created, &ip)
            && code(e) == Some(422)
            && e.to_string().contains("already allocated")
        {
            release_stale_ip(svcs, ip, &name).await;
        }
        created
    })
    .await;
}

/// Deletes the IPAddress object of `ip` if the Service it names no longer exists.
async fn release_stale_ip(svcs: &Api<Service>, ip: &str, creating: &str) {
    let ips: Api<IPAddress> = Api::all(svcs.clone().into_client());
    // Released meanwhile (or unreadable): the next attempt tells.
    let Ok(Some(held)) = ips.get_opt(ip).await else {
        return;
    };
    let parent = held.spec.parent_ref;
    if parent.resource == "services" {
        let owner: Api<Service> = Api::namespaced(
            svcs.clone().into_client(),
            parent.namespace.as_deref().unwrap_or_default(),
        );
        if let Ok(Some(_)) = owner.get_opt(&parent.name).await {
            panic!(
                "create service {creating}: its cluster IP {ip} belongs to the live Service {}/{}",
                parent.namespace.as_deref().unwrap_or_default(),
                parent.name
            );
        }
    }
    match ips.delete(ip, &DeleteParams::default()).await {
        Ok(_) => eprintln!(
            "    {creating}: its cluster IP {ip} was still allocated to the deleted Service {}; released it",
            parent.name
        ),
        Err(e) if code(&e) == Some(404) => {}
        Err(e) => eprintln!("    {creating}: could not release the stale IPAddress {ip}: {e}"),
    }
}

impl Cluster {
    /// The benchmark namespace and the Node every proxy runs as: a dual-stack node, its
    /// InternalIPs the node's addresses of both families, IPv4 first (kube-proxy takes the
    /// first as its primary family's node IP, the second as the other's).
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
                // What a controller-manager allocating node CIDRs would give it: Cilium's
                // Kubernetes IPAM takes its router addresses from here (the other proxies
                // are given --cluster-cidr and never read it).
                spec: Some(NodeSpec {
                    pod_cidr: Some(topo::NODE_POD_CIDRS[0].into()),
                    pod_cidrs: Some(topo::NODE_POD_CIDRS.map(String::from).to_vec()),
                    ..Default::default()
                }),
                ..Default::default()
            };
            retry("create node", 409, || nodes.create(&pp, &node)).await;
            let status = NodeStatus {
                addresses: Some(
                    [topo::NODE_IP, topo::NODE_IP6]
                        .map(|ip| NodeAddress {
                            type_: "InternalIP".into(),
                            address: ip.into(),
                        })
                        .to_vec(),
                ),
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
            present6: 0,
        }
    }

    /// The north-south throughput's NodePort Service and its slice (`throughput`).
    pub fn create_nodeport(&self, node_port: u16) {
        let (svc, sl) = super::throughput::nodeport_objects(node_port);
        let (svcs, slices, pp) = (self.services(), self.slices(), PostParams::default());
        self.rt.block_on(async {
            retry("create the NodePort service", 409, || svcs.create(&pp, &svc)).await;
            retry("create the NodePort slice", 409, || slices.create(&pp, &sl)).await;
        });
    }

    pub fn delete_nodeport(&self) {
        let (svcs, slices, dp) = (self.services(), self.slices(), DeleteParams::default());
        self.rt.block_on(async {
            retry("delete the NodePort slice", 404, || {
                slices.delete("nodeport-1", &dp)
            })
            .await;
            retry("delete the NodePort service", 404, || {
                svcs.delete("nodeport", &dp)
            })
            .await;
        });
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
        self.grow_in(Family::V4, n)
    }

    /// Deletes Services (and slices) `n..present`.
    pub fn shrink_to(&mut self, n: u32) {
        self.shrink_in(Family::V4, n)
    }

    /// The number of Services of `family`'s set that exist.
    pub fn present_in(&self, family: Family) -> u32 {
        match family {
            Family::V4 => self.present,
            Family::V6 => self.present6,
        }
    }

    fn present_mut(&mut self, family: Family) -> &mut u32 {
        match family {
            Family::V4 => &mut self.present,
            Family::V6 => &mut self.present6,
        }
    }

    /// [`Cluster::grow_to`] for `family`'s set.
    pub fn grow_in(&mut self, family: Family, n: u32) -> (u64, u64) {
        let started = now_ns();
        let indices: Vec<u32> = (self.present_in(family)..n).collect();
        self.parallel(
            &format!("creating {} Services + EndpointSlices", family.name()),
            indices,
            move |svcs, slices, i| async move {
                let (pp, svc, sl) = (
                    PostParams::default(),
                    build_service_in(family, i, SERVICE_PORT),
                    build_slice_in(family, i),
                );
                create_service_in(&svcs, &svc).await;
                retry("create slice", 409, || slices.create(&pp, &sl)).await;
            },
        );
        let present = self.present_mut(family);
        *present = (*present).max(n);
        (started, now_ns())
    }

    /// [`Cluster::shrink_to`] for `family`'s set.
    pub fn shrink_in(&mut self, family: Family, n: u32) {
        let indices: Vec<u32> = (n..self.present_in(family)).rev().collect();
        self.parallel(
            &format!("deleting {} Services + EndpointSlices", family.name()),
            indices,
            move |svcs, slices, i| async move {
                let (dp, svc) = (DeleteParams::default(), svc_name_in(family, i));
                let name = format!("{svc}-1");
                retry("delete service", 404, || svcs.delete(&svc, &dp)).await;
                retry("delete slice", 404, || slices.delete(&name, &dp)).await;
            },
        );
        let present = self.present_mut(family);
        *present = (*present).min(n);
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
        let svc = build_service(i, SERVICE_PORT);
        self.rt.block_on(create_service_in(&api, &svc));
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
