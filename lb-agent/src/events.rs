//! Kubernetes Events for the problems the agent finds (a malformed Service, a frontend two
//! Services claim, a Service the maps have no room for): Warning Events on the Service, so that
//! `kubectl describe service` says why it is not served the way its owner expects.

use std::{
    collections::{BTreeMap, BTreeSet},
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
use sha2::{Digest, Sha256};

use crate::watch::ServiceKey;

/// The Events' reporting controller (shown as their `reportingComponent` in the core/v1 view):
/// tests tell the agent's Events from the API server's by it.
pub const REPORTING_CONTROLLER: &str = "lb-agent";

/// Publishes Warning Events on Services for per-Service problems: one Event per distinct
/// problem, published once. The Event is named after the Service and a hash of the problem, so
/// each problem has its own Event with its own message (kube-runtime's `Recorder` keys Events by
/// reason and object only: two problems would share one Event showing the first message), and the
/// agents of other nodes finding the same problem meet the same name instead of adding copies.
/// The Event of one problem on one Service: `<service>.<16 hex digits>`, the digits the start of a
/// SHA-256 of the problem (reason, message, the Service's uid). Every agent, of any build or
/// architecture, names the same problem alike (std's hasher promises no such thing).
pub fn event_name(service: &str, reason: &str, note: &str, uid: Option<&str>) -> String {
    let mut hash = Sha256::new();
    for part in [reason, note, uid.unwrap_or("")] {
        // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part.as_bytes());
    }
    let digest = hash.finalize();
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{service}.{hex}")
}

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
        let event = events::Event {
            metadata: ObjectMeta {
                name: Some(event_name(name, &reason, &note, regarding.uid.as_deref())),
                namespace: Some(namespace.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
            action: Some("Program".into()),
            reason: Some(reason),
            note: Some(note.chars().take(1000).collect()),
            regarding: Some(regarding),
            reporting_controller: Some(REPORTING_CONTROLLER.into()),
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

#[cfg(test)]
mod tests {
    use super::event_name;

    #[test]
    fn event_names_are_stable_and_tell_problems_apart() {
        // A fixed value: agents of every node and release must agree on it.
        let name = event_name("web", "InvalidService", "port 0", Some("uid-1"));
        assert_eq!(name, event_name("web", "InvalidService", "port 0", Some("uid-1")));
        assert!(
            name.starts_with("web.") && name.len() == "web.".len() + 16,
            "{name}"
        );
        assert_ne!(name, event_name("web", "InvalidService", "port 1", Some("uid-1")));
        assert_ne!(event_name("s", "ab", "c", None), event_name("s", "a", "bc", None));
        assert_eq!(
            name, EXPECTED,
            "the hash changed: Events of older agents would be duplicated"
        );
    }

    // sha256(len8 "InvalidService" len8 "port 0" len8 "uid-1"), lengths little-endian u64.
    const EXPECTED: &str = "web.fd62646a9bb85b31";
}
