//! Model step for EndpointSlices: the `discovery.k8s.io/v1` EndpointSlices of one Service -> the
//! [`Endpoint`]s of each of its ports, keyed by [`ServicePortName`]. This ports kube-proxy's
//! `EndpointSliceCache` (`pkg/proxy/endpointslicecache.go`: `endpointSliceCacheKeys`,
//! `endpointInfoByServicePort`, `addEndpoints`, `endpointsMapFromEndpointInfo`), the address-type
//! filter of `EndpointsChangeTracker.EndpointSliceUpdate` (`pkg/proxy/endpointschangetracker.go`)
//! and kube-proxy's informer label selector, for one IP family at a time (kube-proxy's dual-stack
//! mode runs one proxier per family, each reading only the slices of its `addressType`). The cache's incremental
//! bookkeeping (pending/applied) is the caller's business: this is the function it computes.
//!
//! The model reads [`Slice`], what the watch keeps of an EndpointSlice (upstream's
//! `endpointSliceData`: its ports and endpoints, not the object).

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::service::{parse_ip_sloppy, parse_protocol};
use super::{Endpoint, ServicePortName};
use crate::{
    family::IpFamily,
    node::NodeInfo,
    watch::{Slice, SliceAddress, SliceEndpoint},
};

/// Something wrong with an EndpointSlice. kube-proxy logs these and carries on; so do we (the
/// faulty slice, port or endpoint is ignored), returning them for a Warning Event.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SliceError {
    /// `endpointSliceCacheKeys`: "no kubernetes.io/service-name label set on endpoint slice".
    #[error("EndpointSlice {slice:?} has no kubernetes.io/service-name label")]
    NoServiceName { slice: String },
    /// `endpointSliceCacheKeys`: "expected EndpointSlice name and namespace to be set".
    #[error("an EndpointSlice labelled for this Service has no name or no namespace; ignored")]
    NoNameOrNamespace,
    /// `endpointInfoByServicePort`: "Ignoring invalid endpoint port" (nil or 0), or a number that
    /// is not a port at all.
    #[error("EndpointSlice {slice}: ports[{index}] has no valid port number; ignored")]
    InvalidPort { slice: String, index: usize },
    /// A port protocol other than TCP, UDP and SCTP.
    #[error("EndpointSlice {slice}: ports[{index}] has unsupported protocol {protocol:?}; ignored")]
    UnsupportedProtocol {
        slice: String,
        index: usize,
        protocol: String,
    },
    /// `addEndpoints`: "Ignoring invalid endpoint port with empty address".
    #[error("EndpointSlice {slice}: endpoints[{index}] has no address; ignored")]
    NoAddress { slice: String, index: usize },
    /// The first address of an endpoint is not an address of the slice's family.
    #[error(
        "EndpointSlice {slice}: endpoints[{index}] address {address:?} is not an {family} address; ignored"
    )]
    InvalidAddress {
        slice: String,
        index: usize,
        address: String,
        family: IpFamily,
    },
    /// An address no backend may have (the API server's `ValidateEndpointIP` refuses them, but
    /// `--manifests` is not validated): traffic to a Service would go to the node itself
    /// (loopback, unspecified) or nowhere.
    #[error(
        "EndpointSlice {slice}: endpoints[{index}] address \"{address}\" is {reason}, which an endpoint may not use; ignored"
    )]
    SpecialAddress {
        slice: String,
        index: usize,
        address: IpAddr,
        reason: &'static str,
    },
}

/// The `(namespace, service name)` an EndpointSlice belongs to: kube-proxy
/// `endpointSliceCacheKeys` (the `kubernetes.io/service-name` label, which must be non-empty, and
/// the slice's own namespace; the slice must have a name and a namespace).
pub fn slice_service_name(slice: &Slice) -> Result<(String, String), SliceError> {
    let service = slice
        .service_name
        .as_deref()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| SliceError::NoServiceName {
            slice: slice.name.to_string(),
        })?;
    if slice.namespace.is_empty() || slice.name.is_empty() {
        return Err(SliceError::NoNameOrNamespace);
    }
    Ok((slice.namespace.to_string(), service.to_owned()))
}

/// Whether the proxier of `family` handles this slice at all: its `addressType` is that family
/// (each proxier's `EndpointSliceUpdate` ignores the other family's slices, and kube-proxy never
/// handles `FQDN` ones), and none of the labels its informers exclude
/// (`service.kubernetes.io/service-proxy-name`, `service.kubernetes.io/headless`; the EndpointSlice
/// controller copies them from the Service).
pub fn slice_is_proxied(slice: &Slice, family: IpFamily) -> bool {
    slice.address_type == Some(family) && !slice.excluded
}

/// The endpoints of each port of Service `namespace/service`, from all the given slices (slices of
/// other Services, or that kube-proxy ignores, are skipped); see
/// [`endpoints_by_port_with_problems`], which also returns what was wrong.
pub fn endpoints_by_port(
    namespace: &str,
    service: &str,
    slices: &[&Slice],
    node: &NodeInfo,
    family: IpFamily,
) -> BTreeMap<ServicePortName, Vec<Endpoint>> {
    endpoints_by_port_with_problems(namespace, service, slices, node, family).0
}

/// kube-proxy `EndpointSliceCache.getEndpointsMap` for one Service, plus the problems it logs.
///
/// - Slices are selected with [`slice_service_name`] and [`slice_is_proxied`]. Two slices with
///   the same name: the later one wins (the cache keys slices by name). The rest are processed in
///   name order, which makes the duplicate rule below deterministic (upstream walks a Go map).
/// - Each slice port gives a `ServicePortName` from its name (unset -> "", the API default) and
///   protocol (unset -> TCP, the API default); a port without a number, or 0, is ignored. Ports
///   are matched to Service ports by that name and protocol only, as upstream.
/// - Each endpoint uses its first address (`addEndpoints`); conditions as in `addEndpoints`:
///   `ready` and `serving` nil -> true, `terminating` nil -> false; `is_local` when `nodeName`
///   equals a non-empty `node.name`; `zone`; hints `forZones` and `forNodes`
///   (`PreferSameTrafficDistribution`, GA and locked on since v1.35).
/// - Duplicates (same ip:port under one `ServicePortName`, e.g. an endpoint moving between
///   slices, or a pod IP reused while the old pod terminates): a later copy replaces an earlier
///   one unless the later copy is terminating (`addEndpoints`: "prefer the running pod").
/// - A `ServicePortName` with no endpoint is left out; each list is sorted by (IP, port), which
///   is upstream's "same order to simplify diffing", numerically rather than as strings.
pub fn endpoints_by_port_with_problems(
    namespace: &str,
    service: &str,
    slices: &[&Slice],
    node: &NodeInfo,
    family: IpFamily,
) -> (BTreeMap<ServicePortName, Vec<Endpoint>>, Vec<SliceError>) {
    let mut selected: BTreeMap<&str, &Slice> = BTreeMap::new();
    let mut problems = Vec::new();
    for slice in slices {
        if !slice_is_proxied(slice, family) {
            continue;
        }
        match slice_service_name(slice) {
            Ok((ns, svc)) if ns == namespace && svc == service => {
                selected.insert(&slice.name, slice);
            }
            // Labelled for this Service but without a name or namespace: its endpoints cannot be
            // used, which must not go unnoticed (the Service would silently have no backends).
            Err(e @ SliceError::NoNameOrNamespace) if slice.service_name.as_deref() == Some(service) => {
                problems.push(e);
            }
            // Another Service's slice, or one that belongs to no Service (no label).
            _ => {}
        }
    }

    let mut by_port: BTreeMap<ServicePortName, BTreeMap<(IpAddr, u16), Endpoint>> = BTreeMap::new();
    for (slice_name, slice) in selected {
        let parsed = parse_endpoints(slice_name, slice, node, family, &mut problems);
        for (index, port) in slice.ports.iter().enumerate() {
            let Some(number) = port.port.and_then(|p| u16::try_from(p).ok()).filter(|&p| p != 0) else {
                problems.push(SliceError::InvalidPort {
                    slice: slice_name.to_owned(),
                    index,
                });
                continue;
            };
            let Some(protocol) = parse_protocol(port.protocol.as_deref()) else {
                problems.push(SliceError::UnsupportedProtocol {
                    slice: slice_name.to_owned(),
                    index,
                    protocol: port.protocol.as_deref().unwrap_or_default().to_owned(),
                });
                continue;
            };
            let name = ServicePortName {
                namespace: namespace.to_owned(),
                name: service.to_owned(),
                port: port.name.as_deref().unwrap_or_default().to_owned(),
                protocol,
            };
            let set = by_port.entry(name).or_default();
            for ep in &parsed {
                let endpoint = Endpoint {
                    port: number,
                    ..ep.clone()
                };
                let key = (endpoint.ip, number);
                if !set.contains_key(&key) || !endpoint.terminating {
                    set.insert(key, endpoint);
                }
            }
        }
    }
    let map = by_port
        .into_iter()
        .filter(|(_, set)| !set.is_empty())
        .map(|(name, set)| (name, set.into_values().collect()))
        .collect();
    (map, problems)
}

/// The usable endpoints of one slice, with port 0 (filled in per slice port); an endpoint without
/// an address, or whose first address is not of `family` (parsed as `netutils.ParseIPSloppy`), is
/// left out and reported once per slice.
fn parse_endpoints(
    slice_name: &str,
    slice: &Slice,
    node: &NodeInfo,
    family: IpFamily,
    problems: &mut Vec<SliceError>,
) -> Vec<Endpoint> {
    let mut out = Vec::new();
    for (index, ep) in slice.endpoints.iter().enumerate() {
        let Some(address) = &ep.address else {
            problems.push(SliceError::NoAddress {
                slice: slice_name.to_owned(),
                index,
            });
            continue;
        };
        let parsed = match address {
            SliceAddress::V4(ip) => Some(IpAddr::V4(*ip)),
            SliceAddress::V6(ip) => Some(IpAddr::V6(*ip)),
            SliceAddress::Written(text) => parse_ip_sloppy(text),
        };
        let Some(ip) = parsed.filter(|ip| IpFamily::of(ip) == family) else {
            problems.push(SliceError::InvalidAddress {
                slice: slice_name.to_owned(),
                index,
                address: address.to_string(),
                family,
            });
            continue;
        };
        if let Some(reason) = super::service::special_address(ip) {
            problems.push(SliceError::SpecialAddress {
                slice: slice_name.to_owned(),
                index,
                address: ip,
                reason,
            });
            continue;
        }
        out.push(endpoint(ip, ep, node));
    }
    out
}

/// kube-proxy `addEndpoints`' conversion of one slice endpoint (before the port is known).
fn endpoint(ip: IpAddr, ep: &SliceEndpoint, node: &NodeInfo) -> Endpoint {
    Endpoint {
        ip,
        port: 0,
        ready: ep.ready.unwrap_or(true),
        serving: ep.serving.unwrap_or(true),
        terminating: ep.terminating.unwrap_or(false),
        is_local: !node.name.is_empty() && ep.node_name() == Some(node.name.as_str()),
        node_name: ep.node_name().map(str::to_owned),
        zone: ep.zone().map(str::to_owned),
        zone_hints: ep
            .hints
            .iter()
            .flat_map(|h| &h.zones)
            .map(|z| z.to_string())
            .collect(),
        node_hints: ep
            .hints
            .iter()
            .flat_map(|h| &h.nodes)
            .map(|n| n.to_string())
            .collect(),
    }
}

#[cfg(test)]
mod tests;
