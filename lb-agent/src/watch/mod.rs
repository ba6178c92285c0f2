//! Step 1 of watch -> model -> plan -> maps -> programs: the API objects the agent acts on, from
//! the Kubernetes API (`kube`, reflectors with kube-proxy's label selectors) or from manifest
//! files (`manifests`, for `trace --manifests` and static runs).

pub mod kube;
pub mod manifests;

use std::{collections::BTreeMap, sync::Arc};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// kube-proxy ignores Services (and their slices) that name another proxy.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Set on the EndpointSlices of headless Services, which kube-proxy ignores.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
/// kube-proxy's informer label selector, for Services and EndpointSlices alike.
pub const LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// A consistent view of the objects the agent programs from.
#[derive(Clone, Debug, Default)]
pub struct ClusterState {
    /// By (namespace, name).
    pub services: BTreeMap<(String, String), Arc<Service>>,
    /// By (namespace, slice name).
    pub slices: BTreeMap<(String, String), Arc<EndpointSlice>>,
    /// This node, when known.
    pub node: Option<Arc<Node>>,
}

impl ClusterState {
    pub fn add_service(&mut self, svc: Service) {
        let key = (
            svc.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            svc.metadata.name.clone().unwrap_or_default(),
        );
        self.services.insert(key, Arc::new(svc));
    }

    pub fn add_slice(&mut self, slice: EndpointSlice) {
        let key = (
            slice
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".into()),
            slice.metadata.name.clone().unwrap_or_default(),
        );
        self.slices.insert(key, Arc::new(slice));
    }

    /// The EndpointSlices of each Service, by (namespace, service name) from the
    /// `kubernetes.io/service-name` label. Slices without the label belong to no Service.
    pub fn slices_by_service(&self) -> BTreeMap<(String, String), Vec<&EndpointSlice>> {
        let mut out: BTreeMap<(String, String), Vec<&EndpointSlice>> = BTreeMap::new();
        for ((namespace, _), slice) in &self.slices {
            let labels = slice.metadata.labels.as_ref();
            if labels
                .is_some_and(|l| l.contains_key(SERVICE_PROXY_NAME_LABEL) || l.contains_key(HEADLESS_LABEL))
            {
                continue;
            }
            if let Some(service) = labels.and_then(|l| l.get(SERVICE_NAME_LABEL)) {
                out.entry((namespace.clone(), service.clone()))
                    .or_default()
                    .push(slice);
            }
        }
        out
    }
}
