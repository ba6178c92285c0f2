//! The Kubernetes API as a source: kube-rs reflectors for Services and EndpointSlices (with
//! kube-proxy's informer label selector) and for this node's Node object.
//!
//! Watch errors back off and relist (kube-rs `default_backoff`); while the API server is away the
//! stores keep the last state, so the data path keeps serving it. Every change pokes the sync
//! loop through `on_change`; the first sync waits until every store has its initial list, so a
//! restarted agent never programs an empty cluster over a full one.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    hash::{Hash, Hasher},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use futures::TryStreamExt;
use k8s_openapi::{
    api::{
        core::v1::{Node, ObjectReference, Service},
        discovery::v1::EndpointSlice,
        events::v1 as events,
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{
    Client, Resource, ResourceExt,
    api::{Api, PostParams},
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use tokio_util::sync::CancellationToken;

use super::{ClusterState, LABEL_SELECTOR, ServiceKey};
use crate::sync::ServiceInputs;

/// kube-proxy reads this EndpointSlice annotation to compute network programming latency.
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// What changed, for the change counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    Service,
    EndpointSlice,
    Node,
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
}

/// What the watch tasks record for the sync loop, under one lock so that a sync never sees a
/// store change without its dirty mark: the pending changes, and which EndpointSlices belong to
/// which Service (so that one Service's inputs are found without scanning every slice).
#[derive(Debug, Default)]
struct Tracker {
    pending: PendingChanges,
    slice_owner: HashMap<ServiceKey, ServiceKey>,
    service_slices: HashMap<ServiceKey, BTreeSet<String>>,
}

impl Tracker {
    /// Records a slice (stored as `slice_key`) now belonging to `owner`, marking both its old and
    /// new Service dirty.
    fn set_slice(&mut self, slice_key: ServiceKey, owner: Option<ServiceKey>) {
        if let Some(old) = self.slice_owner.remove(&slice_key) {
            if let Some(names) = self.service_slices.get_mut(&old) {
                names.remove(&slice_key.1);
                if names.is_empty() {
                    self.service_slices.remove(&old);
                }
            }
            self.pending.dirty.insert(old);
        }
        if let Some(owner) = owner {
            self.service_slices
                .entry(owner.clone())
                .or_default()
                .insert(slice_key.1.clone());
            self.slice_owner.insert(slice_key, owner.clone());
            self.pending.dirty.insert(owner);
        }
    }

    fn reindex(&mut self, slices: &Store<EndpointSlice>) {
        self.slice_owner.clear();
        self.service_slices.clear();
        for slice in slices.state() {
            let key = (slice.namespace().unwrap_or_default(), slice.name_any());
            let owner = super::slice_service(&key.0, &slice);
            self.set_slice(key, owner);
        }
    }
}

/// The reflector stores and their watch tasks.
pub struct KubeSource {
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    nodes: Store<Node>,
    tracker: Arc<Mutex<Tracker>>,
}

impl KubeSource {
    /// Starts the watches; `on_change` is called (from the watch tasks) after every change.
    pub fn start(
        client: Client,
        node_name: &str,
        on_change: Arc<dyn Fn(ChangeKind) + Send + Sync>,
        shutdown: CancellationToken,
    ) -> Self {
        let tracker = Arc::new(Mutex::new(Tracker::default()));
        let selector = watcher::Config::default().labels(LABEL_SELECTOR);

        let (services, writer) = reflector::store::<Service>();
        let stream = watcher(Api::<Service>::all(client.clone()), selector.clone())
            .default_backoff()
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

        let (slices, writer) = reflector::store::<EndpointSlice>();
        let stream = watcher(Api::<EndpointSlice>::all(client.clone()), selector)
            .default_backoff()
            .reflect(writer);
        let store = slices.clone();
        spawn_watch(
            "EndpointSlice",
            stream,
            ChangeKind::EndpointSlice,
            Box::new(
                move |t: &mut Tracker, event: &watcher::Event<EndpointSlice>| match event {
                    watcher::Event::Apply(slice) | watcher::Event::Delete(slice) => {
                        t.pending.endpoints += 1;
                        t.pending.trigger_times.extend(trigger_time(slice));
                        let key = (slice.namespace().unwrap_or_default(), slice.name_any());
                        let owner = match event {
                            watcher::Event::Apply(_) => super::slice_service(&key.0, slice),
                            _ => None,
                        };
                        t.set_slice(key, owner);
                    }
                    // The reflector has swapped the store by now: index it afresh.
                    watcher::Event::InitDone => {
                        t.reindex(&store);
                        t.pending.relisted = true;
                    }
                    watcher::Event::Init | watcher::Event::InitApply(_) => {}
                },
            ),
            on_change.clone(),
            tracker.clone(),
            shutdown.clone(),
        );

        let (nodes, writer) = reflector::store::<Node>();
        let by_name = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        let stream = watcher(Api::<Node>::all(client), by_name)
            .default_backoff()
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
            slices,
            nodes,
            tracker,
        }
    }

    /// Waits until every store holds its initial list; `false` on timeout.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let all = async {
            let _ = self.services.wait_until_ready().await;
            let _ = self.slices.wait_until_ready().await;
            let _ = self.nodes.wait_until_ready().await;
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
        for slice in self.slices.state() {
            let key = (slice.namespace().unwrap_or_default(), slice.name_any());
            state.slices.insert(key, slice);
        }
        state.node = self.nodes.state().into_iter().next();
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
        let names: Vec<String> = self
            .tracker
            .lock()
            .expect("tracker lock")
            .service_slices
            .get(key)
            .map(|n| n.iter().cloned().collect())
            .unwrap_or_default();
        let slices = names
            .iter()
            .filter_map(|name| self.slices.get(&ObjectRef::new(name).within(&key.0)))
            .collect();
        (self.service(key), slices)
    }

    pub fn service(&self, key: &ServiceKey) -> Option<Arc<Service>> {
        self.services.get(&ObjectRef::new(&key.1).within(&key.0))
    }

    /// This node's Node object, once seen.
    pub fn node(&self) -> Option<Arc<Node>> {
        self.nodes.state().into_iter().next()
    }
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
                    track(&mut tracker.lock().expect("tracker lock"), &event);
                    // A change, or a relist completed (the store was replaced).
                    let touched = matches!(
                        event,
                        watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone
                    );
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

/// Publishes Warning Events on Services for per-Service problems: one Event per distinct
/// problem, published once. The Event is named after the Service and a hash of the problem, so
/// each problem has its own Event with its own message (kube-runtime's `Recorder` keys Events by
/// reason and object only: two problems would share one Event showing the first message), and the
/// agents of other nodes finding the same problem meet the same name instead of adding copies.
pub struct ProblemReporter {
    client: Client,
    node_name: String,
    /// The problems published, per Service: (reason, message).
    published: Mutex<BTreeMap<ServiceKey, BTreeSet<(String, String)>>>,
}

/// A problem to report: (namespace, name, reason, message).
pub type Report = (String, String, &'static str, String);

impl ProblemReporter {
    pub fn new(client: Client, node_name: &str) -> Self {
        Self {
            client,
            node_name: node_name.to_owned(),
            published: Mutex::new(BTreeMap::new()),
        }
    }

    /// Reports `problems` on their Services (`services` holds the references of those that
    /// exist). A problem already reported is not repeated; a Service's problems that are gone are
    /// forgotten, so a recurrence is reported again.
    pub async fn report(&self, problems: &[Report], services: &BTreeMap<ServiceKey, ObjectReference>) {
        let mut fresh = Vec::new();
        {
            let mut published = self.published.lock().expect("published lock");
            let mut current: BTreeMap<ServiceKey, BTreeSet<(String, String)>> = BTreeMap::new();
            for (ns, name, reason, msg) in problems {
                current
                    .entry((ns.clone(), name.clone()))
                    .or_default()
                    .insert((reason.to_string(), msg.clone()));
            }
            for (key, now) in &current {
                let before = published.get(key);
                for (reason, msg) in now {
                    if before.is_some_and(|b| b.contains(&(reason.clone(), msg.clone()))) {
                        continue;
                    }
                    if let Some(reference) = services.get(key) {
                        fresh.push((key.clone(), reference.clone(), reason.clone(), msg.clone()));
                    }
                }
            }
            *published = current;
        }
        for (key, regarding, reason, note) in fresh {
            if let Err(e) = self.publish(&key, regarding, reason, note).await {
                tracing::debug!("publishing an Event failed: {e}");
            }
        }
    }

    async fn publish(
        &self,
        (namespace, name): &ServiceKey,
        regarding: ObjectReference,
        reason: String,
        note: String,
    ) -> Result<(), kube::Error> {
        let mut hash = std::hash::DefaultHasher::new();
        (&reason, &note, &regarding.uid).hash(&mut hash);
        let event = events::Event {
            metadata: ObjectMeta {
                name: Some(format!("{name}.{:016x}", hash.finish())),
                namespace: Some(namespace.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
            action: Some("Program".into()),
            reason: Some(reason),
            note: Some(note.chars().take(1000).collect()),
            regarding: Some(regarding),
            reporting_controller: Some("lb-agent".into()),
            reporting_instance: Some(self.node_name.clone()),
            type_: Some("Warning".into()),
            ..events::Event::default()
        };
        let api: Api<events::Event> = Api::namespaced(self.client.clone(), namespace);
        match api.create(&PostParams::default(), &event).await {
            Ok(_) => Ok(()),
            // The same problem, already reported (by this agent before a restart, or another).
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }
}
