//! The Kubernetes API as a source: kube-rs reflectors for Services and EndpointSlices (with
//! kube-proxy's informer label selector) and for this node's Node object.
//!
//! Watch errors back off and relist (kube-rs `default_backoff`); while the API server is away the
//! stores keep the last state, so the data path keeps serving it. Every change pokes the sync
//! loop through `on_change`; the first sync waits until every store has its initial list, so a
//! restarted agent never programs an empty cluster over a full one.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use futures::TryStreamExt;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Client, Resource, ResourceExt,
    api::Api,
    runtime::{
        WatchStreamExt,
        events::{Event, EventType, Recorder, Reporter},
        reflector::{self, Store},
        watcher,
    },
};
use tokio_util::sync::CancellationToken;

use super::{ClusterState, LABEL_SELECTOR};

/// kube-proxy reads this EndpointSlice annotation to compute network programming latency.
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// What changed, for the change counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    Service,
    EndpointSlice,
    Node,
}

/// Changes not yet covered by a sync: counts for kube-proxy's `*_changes_pending` metrics and the
/// trigger times of EndpointSlice changes for `network_programming_duration_seconds`.
#[derive(Debug, Default)]
pub struct PendingChanges {
    pub services: u64,
    pub endpoints: u64,
    pub trigger_times: Vec<SystemTime>,
}

/// The reflector stores and their watch tasks.
pub struct KubeSource {
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    nodes: Store<Node>,
    pending: Arc<Mutex<PendingChanges>>,
}

impl KubeSource {
    /// Starts the watches; `on_change` is called (from the watch tasks) after every change.
    pub fn start(
        client: Client,
        node_name: &str,
        on_change: Arc<dyn Fn(ChangeKind) + Send + Sync>,
        shutdown: CancellationToken,
    ) -> Self {
        let pending = Arc::new(Mutex::new(PendingChanges::default()));
        let selector = watcher::Config::default().labels(LABEL_SELECTOR);

        let (services, writer) = reflector::store::<Service>();
        let stream = watcher(Api::<Service>::all(client.clone()), selector.clone())
            .default_backoff()
            .reflect(writer);
        spawn_watch(
            "Service",
            stream,
            ChangeKind::Service,
            |_| None,
            on_change.clone(),
            pending.clone(),
            shutdown.clone(),
        );

        let (slices, writer) = reflector::store::<EndpointSlice>();
        let stream = watcher(Api::<EndpointSlice>::all(client.clone()), selector)
            .default_backoff()
            .reflect(writer);
        spawn_watch(
            "EndpointSlice",
            stream,
            ChangeKind::EndpointSlice,
            trigger_time,
            on_change.clone(),
            pending.clone(),
            shutdown.clone(),
        );

        let (nodes, writer) = reflector::store::<Node>();
        let by_name = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        let stream = watcher(Api::<Node>::all(client), by_name)
            .default_backoff()
            .reflect(writer);
        spawn_watch(
            "Node",
            stream,
            ChangeKind::Node,
            |_| None,
            on_change,
            pending.clone(),
            shutdown,
        );

        Self {
            services,
            slices,
            nodes,
            pending,
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
        std::mem::take(&mut *self.pending.lock().expect("pending lock"))
    }

    /// Changes not yet taken.
    pub fn pending_counts(&self) -> (u64, u64) {
        let p = self.pending.lock().expect("pending lock");
        (p.services, p.endpoints)
    }
}

fn trigger_time(slice: &EndpointSlice) -> Option<SystemTime> {
    let text = slice.annotations().get(LAST_CHANGE_TRIGGER_TIME)?;
    let parsed: k8s_openapi::jiff::Timestamp = text.parse().ok()?;
    Some(SystemTime::from(parsed))
}

fn spawn_watch<K, S>(
    kind_name: &'static str,
    stream: S,
    kind: ChangeKind,
    trigger: fn(&K) -> Option<SystemTime>,
    on_change: Arc<dyn Fn(ChangeKind) + Send + Sync>,
    pending: Arc<Mutex<PendingChanges>>,
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
                    let touched = match &event {
                        watcher::Event::Apply(obj) | watcher::Event::Delete(obj) => {
                            let mut p = pending.lock().expect("pending lock");
                            match kind {
                                ChangeKind::Service => p.services += 1,
                                ChangeKind::EndpointSlice => {
                                    p.endpoints += 1;
                                    p.trigger_times.extend(trigger(obj));
                                }
                                ChangeKind::Node => {}
                            }
                            true
                        }
                        // A relist completed: the store was replaced.
                        watcher::Event::InitDone => true,
                        watcher::Event::Init | watcher::Event::InitApply(_) => false,
                    };
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

/// Publishes Warning Events on Services for per-Service problems, once per distinct problem.
pub struct ProblemReporter {
    recorder: Recorder,
    published: Mutex<BTreeMap<(String, String), String>>,
}

impl ProblemReporter {
    pub fn new(client: Client, node_name: &str) -> Self {
        let reporter = Reporter {
            controller: "lb-agent".into(),
            instance: Some(node_name.to_string()),
        };
        Self {
            recorder: Recorder::new(client, reporter),
            published: Mutex::new(BTreeMap::new()),
        }
    }

    /// Reports `problems` (namespace, name, reason, message) on their Services; a problem already
    /// reported with the same message is not repeated, and a Service whose problems are gone is
    /// forgotten so a recurrence is reported again.
    pub async fn report(&self, state: &ClusterState, problems: &[(String, String, &'static str, String)]) {
        let mut fresh = Vec::new();
        {
            let mut published = self.published.lock().expect("published lock");
            let current: BTreeMap<(String, String), String> = problems
                .iter()
                .map(|(ns, name, _, msg)| ((ns.clone(), name.clone()), msg.clone()))
                .collect();
            published.retain(|k, _| current.contains_key(k));
            for (ns, name, reason, msg) in problems {
                let key = (ns.clone(), name.clone());
                if published.get(&key) != Some(msg) {
                    published.insert(key.clone(), msg.clone());
                    if let Some(svc) = state.services.get(&key) {
                        fresh.push((svc.object_ref(&()), *reason, msg.clone()));
                    }
                }
            }
        }
        for (reference, reason, msg) in fresh {
            let event = Event {
                type_: EventType::Warning,
                reason: reason.to_string(),
                note: Some(msg.chars().take(1000).collect()),
                action: "Program".into(),
                secondary: None,
            };
            if let Err(e) = self.recorder.publish(&event, &reference).await {
                tracing::debug!("publishing an Event failed: {e}");
            }
        }
    }
}
