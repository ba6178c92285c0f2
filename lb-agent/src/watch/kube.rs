//! The Kubernetes API as a source: kube-rs reflectors for Services and EndpointSlices (with
//! kube-proxy's informer label selector), for this node's Node object, and for the ServiceCIDR
//! objects (networking.k8s.io/v1) where the API server has them (kube-proxy's cluster-ips-check).
//!
//! Objects are pruned to what the agent reads before the stores keep them (`prune`).
//!
//! Watch errors back off and relist (kube-rs `default_backoff`); while the API server is away the
//! stores keep the last state, so the data path keeps serving it. Every change pokes the sync
//! loop through `on_change`; the first sync waits until every store has its initial list, so a
//! restarted agent never programs an empty cluster over a full one.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use futures::TryStreamExt;
use ipnet::IpNet;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use kube::{
    Client, Resource, ResourceExt,
    api::Api,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use tokio_util::sync::CancellationToken;

use super::{ClusterState, LABEL_SELECTOR, ServiceInputs, ServiceKey, Slice};

/// kube-proxy reads this EndpointSlice annotation to compute network programming latency.
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// What changed, for the change counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    Service,
    EndpointSlice,
    Node,
    ServiceCidr,
}

/// Changes not yet covered by a sync: the Services to recompute, counts for kube-proxy's
/// `*_changes_pending` metrics and the trigger times of EndpointSlice changes for
/// `network_programming_duration_seconds`.
#[derive(Debug, Default)]
pub struct PendingChanges {
    pub services: u64,
    pub endpoints: u64,
    pub trigger_times: Vec<SystemTime>,
    /// Services whose object or EndpointSlices changed.
    pub dirty: BTreeSet<ServiceKey>,
    /// A watch relisted (its store was replaced): recompute everything.
    pub relisted: bool,
    /// When the first of these changes reached the agent (a sync logs how long it waited).
    pub first_seen: Option<Instant>,
}

/// What the watch tasks record for the sync loop, under one lock so that a sync never sees a
/// store change without its dirty mark: the pending changes, and the EndpointSlices themselves
/// with the index of which belong to which Service (so that one Service's inputs are found
/// without scanning every slice).
#[derive(Debug, Default)]
struct Tracker {
    pending: PendingChanges,
    slices: SliceStore,
    /// The slices of a list in progress (a start or a relist), swapped in when it completes.
    listing: Option<HashMap<ServiceKey, Arc<Slice>>>,
}

/// The EndpointSlices in the form the model reads (`model::Slice`, a fraction of the API
/// object's memory), by (namespace, slice name), and the names of each Service's slices.
#[derive(Debug, Default)]
struct SliceStore {
    slices: HashMap<ServiceKey, (Arc<Slice>, Option<ServiceKey>)>,
    /// Sorted names. A Service has one slice or a few: a `Vec` of them costs its names, where a
    /// `BTreeSet`'s first node cost 280 bytes (2.8 MB at 10,000 Services).
    by_service: HashMap<ServiceKey, Vec<String>>,
}

impl SliceStore {
    /// Stores (`Some`) or forgets (`None`) the slice at `key`, and returns the Services whose
    /// slices changed: its old and its new owner.
    fn set(&mut self, key: ServiceKey, slice: Option<Arc<Slice>>) -> Vec<ServiceKey> {
        let mut touched = Vec::new();
        if let Some((_, Some(old))) = self.slices.remove(&key) {
            if let Some(names) = self.by_service.get_mut(&old) {
                if let Ok(i) = names.binary_search(&key.1) {
                    names.remove(i);
                }
                if names.is_empty() {
                    self.by_service.remove(&old);
                }
            }
            touched.push(old);
        }
        if let Some(slice) = slice {
            let owner = super::slice_service(&key.0, &slice);
            if let Some(owner) = &owner {
                let names = self.by_service.entry(owner.clone()).or_default();
                if let Err(i) = names.binary_search(&key.1) {
                    names.insert(i, key.1.clone());
                }
                touched.push(owner.clone());
            }
            self.slices.insert(key, (slice, owner));
        }
        touched
    }

    /// The slices of one Service.
    fn of_service(&self, service: &ServiceKey) -> Vec<Arc<Slice>> {
        self.by_service
            .get(service)
            .into_iter()
            .flatten()
            .filter_map(|name| {
                self.slices
                    .get(&(service.0.clone(), name.clone()))
                    .map(|(slice, _)| slice.clone())
            })
            .collect()
    }
}

fn slice_key(slice: &EndpointSlice) -> ServiceKey {
    (slice.namespace().unwrap_or_default(), slice.name_any())
}

/// The stores and their watch tasks: reflector stores for the Services and the Node, the
/// tracker's own store for the EndpointSlices (kept compacted).
pub struct KubeSource {
    services: Store<Service>,
    nodes: Store<Node>,
    /// `None` where the API server has no ServiceCIDR objects (or may not list them).
    service_cidrs: Option<Store<ServiceCIDR>>,
    /// The Services another proxy serves (labelled service.kubernetes.io/service-proxy-name),
    /// for their cluster IPs only (`delegated_cluster_ips`).
    delegated: Store<Service>,
    tracker: Arc<Mutex<Tracker>>,
    /// Set once the first list of EndpointSlices is stored.
    slices_listed: tokio::sync::watch::Receiver<bool>,
}

impl KubeSource {
    /// Whether the API server lets this agent list ServiceCIDR objects: `false` where it has
    /// none (before Kubernetes 1.33 without the MultiCIDRServiceAllocator feature) or where RBAC
    /// forbids it, each said once; the agent then takes `--service-cluster-ip-range`.
    pub async fn lists_service_cidrs(client: &Client) -> bool {
        let api = Api::<ServiceCIDR>::all(client.clone());
        match api
            .list_metadata(&kube::api::ListParams::default().limit(1))
            .await
        {
            Ok(_) => true,
            Err(kube::Error::Api(e)) if e.code == 404 => {
                tracing::info!(
                    "the API server has no ServiceCIDR objects (networking.k8s.io/v1): the Service CIDRs are --service-cluster-ip-range's"
                );
                false
            }
            Err(kube::Error::Api(e)) if e.code == 403 => {
                tracing::warn!(
                    "listing ServiceCIDR objects is forbidden ({}): the Service CIDRs are --service-cluster-ip-range's; grant list and watch on servicecidrs.networking.k8s.io (see manifests/)",
                    e.message
                );
                false
            }
            // The API server unreachable for now: watch, as for every other kind (retried).
            Err(_) => true,
        }
    }

    /// Starts the watches (ServiceCIDR objects too when `service_cidrs`); `on_change` is called
    /// (from the watch tasks) after every change.
    pub fn start(
        client: Client,
        node_name: &str,
        service_cidrs: bool,
        on_change: Arc<dyn Fn(ChangeKind) + Send + Sync>,
        shutdown: CancellationToken,
    ) -> Self {
        let tracker = Arc::new(Mutex::new(Tracker::default()));
        let selector = watcher::Config::default().labels(LABEL_SELECTOR);

        let (services, writer) = reflector::store::<Service>();
        let stream = watcher(Api::<Service>::all(client.clone()), selector.clone())
            .default_backoff()
            .modify(super::prune::service)
            .reflect(writer);
        spawn_watch(
            "Service",
            stream,
            ChangeKind::Service,
            Box::new(|t: &mut Tracker, event: &watcher::Event<Service>| match event {
                watcher::Event::Apply(svc) | watcher::Event::Delete(svc) => {
                    t.pending.services += 1;
                    t.pending
                        .dirty
                        .insert((svc.namespace().unwrap_or_default(), svc.name_any()));
                }
                watcher::Event::InitDone => t.pending.relisted = true,
                watcher::Event::Init | watcher::Event::InitApply(_) => {}
            }),
            on_change.clone(),
            tracker.clone(),
            shutdown.clone(),
        );

        // No reflector here: each slice is stored compacted, under the tracker's lock, by the
        // event handler itself (a start or relist is collected aside and swapped in whole, as a
        // reflector would).
        let stream = watcher(Api::<EndpointSlice>::all(client.clone()), selector).default_backoff();
        let (listed, slices_listed) = tokio::sync::watch::channel(false);
        spawn_watch(
            "EndpointSlice",
            stream,
            ChangeKind::EndpointSlice,
            Box::new(
                move |t: &mut Tracker, event: &watcher::Event<EndpointSlice>| match event {
                    watcher::Event::Apply(slice) | watcher::Event::Delete(slice) => {
                        t.pending.endpoints += 1;
                        t.pending.trigger_times.extend(trigger_time(slice));
                        let kept =
                            matches!(event, watcher::Event::Apply(_)).then(|| Arc::new(Slice::from(slice)));
                        let touched = t.slices.set(slice_key(slice), kept);
                        t.pending.dirty.extend(touched);
                    }
                    watcher::Event::Init => t.listing = Some(HashMap::new()),
                    watcher::Event::InitApply(slice) => {
                        t.listing
                            .get_or_insert_default()
                            .insert(slice_key(slice), Arc::new(Slice::from(slice)));
                    }
                    watcher::Event::InitDone => {
                        t.slices = SliceStore::default();
                        for (key, slice) in t.listing.take().unwrap_or_default() {
                            t.slices.set(key, Some(slice));
                        }
                        t.pending.relisted = true;
                        listed.send_replace(true);
                    }
                },
            ),
            on_change.clone(),
            tracker.clone(),
            shutdown.clone(),
        );

        // The Services kube-proxy's selector leaves out for another proxy: their cluster IPs are
        // exempt from the cluster-ips-check. Compared at every sync, as the CIDRs are.
        let (delegated, writer) = reflector::store::<Service>();
        let stream = watcher(
            Api::<Service>::all(client.clone()),
            watcher::Config::default().labels(super::LABEL_SERVICE_PROXY_NAME),
        )
        .default_backoff()
        .modify(super::prune::service)
        .reflect(writer);
        spawn_watch(
            "Service (another proxy's)",
            stream,
            ChangeKind::Service,
            Box::new(|_: &mut Tracker, _: &watcher::Event<Service>| {}),
            on_change.clone(),
            tracker.clone(),
            shutdown.clone(),
        );

        // The sync compares the CIDRs with the last ones at every sync, as the node facts.
        let service_cidrs = service_cidrs.then(|| {
            let (store, writer) = reflector::store::<ServiceCIDR>();
            let stream = watcher(
                Api::<ServiceCIDR>::all(client.clone()),
                watcher::Config::default(),
            )
            .default_backoff()
            .reflect(writer);
            spawn_watch(
                "ServiceCIDR",
                stream,
                ChangeKind::ServiceCidr,
                Box::new(|_: &mut Tracker, _: &watcher::Event<ServiceCIDR>| {}),
                on_change.clone(),
                tracker.clone(),
                shutdown.clone(),
            );
            store
        });

        let (nodes, writer) = reflector::store::<Node>();
        let by_name = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        let stream = watcher(Api::<Node>::all(client), by_name)
            .default_backoff()
            .modify(super::prune::node)
            .reflect(writer);
        // The sync loop compares the node facts it derives with the last ones at every sync, so
        // a Node change needs no mark of its own.
        spawn_watch(
            "Node",
            stream,
            ChangeKind::Node,
            Box::new(|_: &mut Tracker, _: &watcher::Event<Node>| {}),
            on_change,
            tracker.clone(),
            shutdown,
        );

        Self {
            services,
            nodes,
            service_cidrs,
            delegated,
            tracker,
            slices_listed,
        }
    }

    /// Waits until every store holds its initial list; `false` on timeout.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let all = async {
            let _ = self.services.wait_until_ready().await;
            let _ = self.slices_listed.clone().wait_for(|listed| *listed).await;
            let _ = self.nodes.wait_until_ready().await;
            let _ = self.delegated.wait_until_ready().await;
            if let Some(store) = &self.service_cidrs {
                let _ = store.wait_until_ready().await;
            }
        };
        tokio::time::timeout(timeout, all).await.is_ok()
    }

    /// A snapshot of the stores.
    pub fn state(&self) -> ClusterState {
        let mut state = ClusterState::default();
        for svc in self.services.state() {
            let key = (svc.namespace().unwrap_or_default(), svc.name_any());
            state.services.insert(key, svc);
        }
        let tracker = self.tracker.lock().expect("tracker lock");
        for (key, (slice, _)) in &tracker.slices.slices {
            state.slices.insert(key.clone(), slice.clone());
        }
        state.node = self.nodes.state().into_iter().next();
        state.service_cidrs = self.service_cidrs();
        state
    }

    /// Takes the changes seen since the last call (the caller is about to sync them).
    pub fn take_pending(&self) -> PendingChanges {
        std::mem::take(&mut self.tracker.lock().expect("tracker lock").pending)
    }

    /// Changes not yet taken.
    pub fn pending_counts(&self) -> (u64, u64) {
        let t = self.tracker.lock().expect("tracker lock");
        (t.pending.services, t.pending.endpoints)
    }

    /// One Service and its EndpointSlices as the stores hold them now.
    pub fn service_inputs(&self, key: &ServiceKey) -> ServiceInputs {
        let slices = self.tracker.lock().expect("tracker lock").slices.of_service(key);
        (self.service(key), slices)
    }

    /// Whether any Service in the store satisfies `test`.
    pub fn any_service(&self, test: impl Fn(&Service) -> bool) -> bool {
        self.services.state().iter().any(|svc| test(svc))
    }

    pub fn service(&self, key: &ServiceKey) -> Option<Arc<Service>> {
        self.services.get(&ObjectRef::new(&key.1).within(&key.0))
    }

    /// The Service CIDRs of every ServiceCIDR object (kube-proxy takes them all, ready or not);
    /// `None` when the API server's are not watched.
    pub fn service_cidrs(&self) -> Option<Vec<IpNet>> {
        let store = self.service_cidrs.as_ref()?;
        Some(service_cidrs_of(store.state().iter().map(|o| o.as_ref())))
    }

    /// The cluster IPs of the Services another proxy serves.
    pub fn delegated_cluster_ips(&self) -> std::collections::BTreeSet<std::net::IpAddr> {
        super::delegated_cluster_ips(self.delegated.state().iter().map(|s| s.as_ref()))
    }

    /// This node's Node object, once seen.
    pub fn node(&self) -> Option<Arc<Node>> {
        self.nodes.state().into_iter().next()
    }
}

/// The CIDRs of ServiceCIDR objects, sorted and without repeats (one the API server should not
/// have accepted is skipped, with a warning).
pub fn service_cidrs_of<'a>(objects: impl Iterator<Item = &'a ServiceCIDR>) -> Vec<IpNet> {
    let mut out = Vec::new();
    for object in objects {
        for text in object.spec.iter().flat_map(|s| s.cidrs.iter().flatten()) {
            match text.parse::<IpNet>() {
                Ok(net) => out.push(net.trunc()),
                Err(e) => tracing::warn!(name = %object.name_any(), "ServiceCIDR {text:?} skipped: {e}"),
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

fn trigger_time(slice: &EndpointSlice) -> Option<SystemTime> {
    let text = slice.annotations().get(LAST_CHANGE_TRIGGER_TIME)?;
    let parsed: k8s_openapi::jiff::Timestamp = text.parse().ok()?;
    Some(SystemTime::from(parsed))
}

/// How a watch event is recorded for the sync loop.
type Track<K> = Box<dyn Fn(&mut Tracker, &watcher::Event<K>) + Send>;

fn spawn_watch<K, S>(
    kind_name: &'static str,
    stream: S,
    kind: ChangeKind,
    track: Track<K>,
    on_change: Arc<dyn Fn(ChangeKind) + Send + Sync>,
    tracker: Arc<Mutex<Tracker>>,
    shutdown: CancellationToken,
) where
    K: Resource + Clone + Send + Sync + 'static,
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        let mut failing = false;
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = stream.try_next() => next,
            };
            match next {
                Ok(Some(event)) => {
                    if failing {
                        tracing::info!(kind = kind_name, "watch recovered");
                        failing = false;
                    }
                    let seen = Instant::now();
                    // A change, or a relist completed (the store was replaced).
                    let touched = matches!(
                        event,
                        watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone
                    );
                    {
                        let mut tracker = tracker.lock().expect("tracker lock");
                        track(&mut tracker, &event);
                        if touched {
                            tracker.pending.first_seen.get_or_insert(seen);
                        }
                    }
                    if touched {
                        on_change(kind);
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    // default_backoff retries; say so once per outage, not once per attempt.
                    if !failing {
                        tracing::warn!(
                            kind = kind_name,
                            "watch failed, retrying with backoff (the data path keeps the last state): {e}"
                        );
                        failing = true;
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use axum::http::{Request, Response};
    use kube::client::Body;

    use super::*;

    /// A client whose API server answers every request with `status` and `body`.
    fn answering(status: u16, body: serde_json::Value) -> Client {
        let service = tower::service_fn(move |_: Request<Body>| {
            let body = body.clone();
            async move {
                Ok::<_, std::convert::Infallible>(
                    Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(Body::from(serde_json::to_vec(&body).expect("JSON")))
                        .expect("a response"),
                )
            }
        });
        Client::new(service, "default")
    }

    fn status(code: u16, reason: &str) -> serde_json::Value {
        serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("servicecidrs.networking.k8s.io is {reason}"), "reason": reason, "code": code,
        })
    }

    /// Where the API server has no ServiceCIDR objects (404) or RBAC forbids listing them (403),
    /// the agent takes `--service-cluster-ip-range`; where it lists them, or cannot be reached for
    /// now (any other failure: watched and retried like every other kind), it watches them.
    #[tokio::test]
    async fn servicecidrs_are_watched_unless_missing_or_forbidden() {
        assert!(!KubeSource::lists_service_cidrs(&answering(404, status(404, "NotFound"))).await);
        assert!(!KubeSource::lists_service_cidrs(&answering(403, status(403, "Forbidden"))).await);
        let list = serde_json::json!({
            "kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1", "metadata": {}, "items": [],
        });
        assert!(KubeSource::lists_service_cidrs(&answering(200, list)).await);
        assert!(KubeSource::lists_service_cidrs(&answering(503, status(503, "ServiceUnavailable"))).await);
    }
}
