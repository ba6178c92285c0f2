//! Kubernetes Events for the problems the agent finds (a malformed Service, a frontend two
//! Services claim, a Service the maps have no room for): Warning Events on the Service, so that
//! `kubectl describe service` says why it is not served the way its owner expects.

use std::{
    collections::{BTreeMap, BTreeSet},
    hash::{Hash, Hasher},
    sync::Mutex,
};

use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1 as events},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{
    Client,
    api::{Api, PostParams},
};

use crate::watch::ServiceKey;

/// Publishes Warning Events on Services for per-Service problems: one Event per distinct
/// problem, published once. The Event is named after the Service and a hash of the problem, so
/// each problem has its own Event with its own message (kube-runtime's `Recorder` keys Events by
/// reason and object only: two problems would share one Event showing the first message), and the
/// agents of other nodes finding the same problem meet the same name instead of adding copies.
pub struct EventPublisher {
    client: Client,
    node_name: String,
    /// The problems published, per Service: (reason, message).
    published: Mutex<BTreeMap<ServiceKey, BTreeSet<(String, String)>>>,
}

/// A problem to report: (namespace, name, reason, message).
pub type ProblemEvent = (String, String, &'static str, String);

impl EventPublisher {
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
    pub async fn report(&self, problems: &[ProblemEvent], services: &BTreeMap<ServiceKey, ObjectReference>) {
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
