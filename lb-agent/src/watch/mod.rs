//! Step 1 of watch -> model -> plan -> maps -> programs: the API objects the agent acts on, from
//! the Kubernetes API (`kube`, reflectors with kube-proxy's label selectors) or from manifest
//! files (`manifests`, for `trace --manifests` and static runs), kept in the form the model reads
//! ([`ClusterState`]; EndpointSlices as [`Slice`]; Services and the Node pruned by `prune` to what
//! the rules read; the Service CIDRs of ServiceCIDR objects). Also the Kubernetes label and annotation names the agent reads.

pub mod kube;
pub mod manifests;
pub mod prune;
pub mod rate;
mod slice;

use std::{collections::BTreeMap, sync::Arc};

use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

pub use slice::{EndpointPlace, Slice, SliceAddress, SliceEndpoint, SliceHints, SlicePort};

/// `discovery.LabelServiceName`: the label naming the Service an EndpointSlice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// Label naming the proxy that owns a Service; kube-proxy's informers only list objects *without*
/// it (`apis.LabelServiceProxyName`, selector built in `cmd/kube-proxy/app/server.go`).
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label the control plane puts on headless Services' objects; kube-proxy's informers only list
/// objects *without* it (`v1.IsHeadlessService`, same selector).
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// `v1.AnnotationTopologyMode`.
pub const ANNOTATION_TOPOLOGY_MODE: &str = "service.kubernetes.io/topology-mode";
/// `v1.DeprecatedAnnotationTopologyAwareHints`.
pub const ANNOTATION_TOPOLOGY_AWARE_HINTS: &str = "service.kubernetes.io/topology-aware-hints";
/// The per-Service algorithm for traffic from outside, `random` or `maglev` (issue 17).
pub const ANNOTATION_LB_ALGORITHM: &str = "lb-agent.io/lb-algorithm";
/// Cilium's name for the same annotation, honoured so that Services annotated for Cilium keep
/// their algorithm when the node moves to lb-agent; ours wins when both are set.
pub const ANNOTATION_LB_ALGORITHM_CILIUM: &str = "service.cilium.io/lb-algorithm";
/// kube-proxy's informer label selector (without [`LABEL_SERVICE_PROXY_NAME`] and
/// [`LABEL_HEADLESS`]), for Services and EndpointSlices alike.
pub const LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// A consistent view of the objects the agent programs from.
#[derive(Clone, Debug, Default)]
pub struct ClusterState {
    /// By (namespace, name).
    pub services: BTreeMap<(String, String), Arc<Service>>,
    /// By (namespace, slice name), in the form the model reads (`model::Slice`).
    pub slices: BTreeMap<(String, String), Arc<Slice>>,
    /// This node, when known.
    pub node: Option<Arc<Node>>,
    /// The CIDRs of the ServiceCIDR objects; `None` when there are none to read (the API server
    /// has none, or the manifests hold none): `--service-cluster-ip-range` applies.
    pub service_cidrs: Option<Vec<ipnet::IpNet>>,
}

/// The cluster IPs of the Services among `services` that another proxy serves (labelled
/// [`LABEL_SERVICE_PROXY_NAME`]): kube-proxy's cluster-ips-check must not refuse their traffic
/// (`plan::ClusterIpPlan`).
pub fn delegated_cluster_ips<'a>(
    services: impl Iterator<Item = &'a Service>,
) -> std::collections::BTreeSet<std::net::IpAddr> {
    services
        .filter(|s| {
            s.metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key(LABEL_SERVICE_PROXY_NAME))
        })
        .filter_map(|s| s.spec.as_ref())
        .flat_map(|spec| spec.cluster_ips.iter().flatten().chain(spec.cluster_ip.iter()))
        .filter_map(|ip| ip.parse().ok())
        .collect()
}

/// The namespace of an object read without one: what `kubectl apply` and the API server give it.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Gives an object without a namespace (or with an empty one) the default namespace, in its
/// metadata itself, so that every later step (the state's keys, the model's names, the
/// Service-to-slice matching) sees the same namespace. Objects from the API always have one.
pub fn default_namespace(meta: &mut ObjectMeta) -> &str {
    if meta.namespace.as_deref().is_none_or(str::is_empty) {
        meta.namespace = Some(DEFAULT_NAMESPACE.to_owned());
    }
    meta.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE)
}

impl ClusterState {
    /// Adds a Service (pruned to what the agent reads), in the default namespace if it names none.
    pub fn add_service(&mut self, mut svc: Service) {
        prune::service(&mut svc);
        let key = (
            default_namespace(&mut svc.metadata).to_owned(),
            svc.metadata.name.clone().unwrap_or_default(),
        );
        self.services.insert(key, Arc::new(svc));
    }

    /// Adds an EndpointSlice (in the form the model reads), in the default namespace if it names
    /// none.
    pub fn add_slice(&mut self, mut slice: EndpointSlice) {
        let key = (
            default_namespace(&mut slice.metadata).to_owned(),
            slice.metadata.name.clone().unwrap_or_default(),
        );
        self.slices.insert(key, Arc::new(Slice::from(&slice)));
    }

    /// The EndpointSlices of each Service, by (namespace, service name) from the
    /// `kubernetes.io/service-name` label. Slices without the label belong to no Service.
    pub fn slices_by_service(&self) -> BTreeMap<ServiceKey, Vec<&Slice>> {
        let mut out: BTreeMap<ServiceKey, Vec<&Slice>> = BTreeMap::new();
        for ((namespace, _), slice) in &self.slices {
            if let Some(service) = slice_service(namespace, slice) {
                out.entry(service).or_default().push(slice);
            }
        }
        out
    }

    /// One Service's objects as the watch would give them (`kube::KubeState::service_inputs`).
    pub fn service_inputs(&self, key: &ServiceKey) -> ServiceInputs {
        let slices = self
            .slices
            .iter()
            .filter(|((ns, _), slice)| slice_service(ns, slice).as_ref() == Some(key))
            .map(|(_, slice)| slice.clone())
            .collect();
        (self.services.get(key).cloned(), slices)
    }
}

/// A Service's (namespace, name).
pub type ServiceKey = (String, String);

/// The objects of one Service, as the watch holds them now (`None`: the Service is gone).
pub type ServiceInputs = (Option<Arc<Service>>, Vec<Arc<Slice>>);

/// The Service an EndpointSlice (stored under `namespace`) belongs to: its
/// `kubernetes.io/service-name` label, unless kube-proxy ignores the slice (another proxy's, or a
/// headless Service's).
pub fn slice_service(namespace: &str, slice: &Slice) -> Option<ServiceKey> {
    if slice.excluded {
        return None;
    }
    let service = slice.service_name.as_deref()?;
    Some((namespace.to_owned(), service.to_owned()))
}
