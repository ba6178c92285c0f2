//! What the watch keeps of an EndpointSlice: [`Slice`], the fields kube-proxy's
//! `EndpointSliceCache` reads (upstream's `endpointSliceData`: its ports and endpoints, not the
//! object). The agent keeps its slices in this form between syncs, at about a fifth of the API
//! object's memory.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::{LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME};
use crate::family::IpFamily;

/// An EndpointSlice as the model reads it: the fields kube-proxy's `EndpointSliceCache` uses, as
/// written in the object (validation is the model's: a bad address is reported, not lost on the
/// way). Built with `Slice::from(&EndpointSlice)`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slice {
    /// `metadata.name` ("" when unset).
    pub name: Box<str>,
    /// `metadata.namespace` ("" when unset).
    pub namespace: Box<str>,
    /// The `kubernetes.io/service-name` label, as written.
    pub service_name: Option<Box<str>>,
    /// Labelled `service.kubernetes.io/service-proxy-name` or `service.kubernetes.io/headless`,
    /// which kube-proxy's informers exclude.
    pub excluded: bool,
    /// `addressType`, when it is `IPv4` or `IPv6` (`FQDN` slices are no proxier's).
    pub address_type: Option<IpFamily>,
    pub ports: Box<[SlicePort]>,
    pub endpoints: Box<[SliceEndpoint]>,
}

/// One `ports[]` entry of a slice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlicePort {
    pub name: Option<Box<str>>,
    pub port: Option<i32>,
    pub protocol: Option<Box<str>>,
}

/// One `endpoints[]` entry of a slice. Kept for every endpoint of the cluster, so without a heap
/// allocation of its own in the usual case: the address inline, the node and zone names shared
/// by the endpoints of a slice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SliceEndpoint {
    /// The first address (`addEndpoints` uses no other).
    pub address: Option<SliceAddress>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    /// `nodeName` and `zone`, one allocation shared by the endpoints of a slice in the same
    /// place (`None` when both are unset).
    pub place: Option<Arc<EndpointPlace>>,
    /// Topology hints, when the endpoint has any (most have none).
    pub hints: Option<Box<SliceHints>>,
}

impl SliceEndpoint {
    pub fn node_name(&self) -> Option<&str> {
        self.place.as_ref()?.node_name.as_deref()
    }

    pub fn zone(&self) -> Option<&str> {
        self.place.as_ref()?.zone.as_deref()
    }
}

/// Where an endpoint runs: its `nodeName` and `zone`, as written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointPlace {
    pub node_name: Option<Box<str>>,
    pub zone: Option<Box<str>>,
}

impl EndpointPlace {
    /// The place of an endpoint with these fields; `None` when both are unset.
    pub fn of(node_name: Option<&str>, zone: Option<&str>) -> Option<Arc<EndpointPlace>> {
        (node_name.is_some() || zone.is_some()).then(|| {
            Arc::new(EndpointPlace {
                node_name: node_name.map(Box::from),
                zone: zone.map(Box::from),
            })
        })
    }
}

/// An endpoint's `hints`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SliceHints {
    /// `forZones[].name`.
    pub zones: Box<[Box<str>]>,
    /// `forNodes[].name`.
    pub nodes: Box<[Box<str>]>,
}

/// An endpoint address as written: inline when it is a plain dotted quad or a canonical IPv6
/// address (what the API server stores), else the text, which the model parses
/// (`netutils.ParseIPSloppy`) and reports when it is not of the slice's family. A plain address
/// parses to the same address both ways.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SliceAddress {
    V4(Ipv4Addr),
    V6(Ipv6Addr),
    Written(Box<str>),
}

impl From<&str> for SliceAddress {
    fn from(text: &str) -> Self {
        if let Ok(ip) = text.parse() {
            return SliceAddress::V4(ip);
        }
        match text.parse::<Ipv6Addr>() {
            // An IPv4-mapped address is IPv4 to `ParseIPSloppy`: left to the model's parser.
            Ok(ip) if ip.to_ipv4_mapped().is_none() => SliceAddress::V6(ip),
            _ => SliceAddress::Written(text.into()),
        }
    }
}

impl std::fmt::Display for SliceAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SliceAddress::V4(ip) => ip.fmt(f),
            SliceAddress::V6(ip) => ip.fmt(f),
            SliceAddress::Written(text) => f.write_str(text),
        }
    }
}

/// Hands out one [`EndpointPlace`] per distinct node and zone (a slice's endpoints mostly share
/// a few).
#[derive(Default)]
struct SharedPlaces(Vec<Arc<EndpointPlace>>);

impl SharedPlaces {
    fn get(&mut self, node_name: Option<&String>, zone: Option<&String>) -> Option<Arc<EndpointPlace>> {
        let (node_name, zone) = (node_name.map(String::as_str), zone.map(String::as_str));
        if let Some(known) = self
            .0
            .iter()
            .find(|p| p.node_name.as_deref() == node_name && p.zone.as_deref() == zone)
        {
            return Some(known.clone());
        }
        let new = EndpointPlace::of(node_name, zone)?;
        self.0.push(new.clone());
        Some(new)
    }
}

impl From<&EndpointSlice> for Slice {
    fn from(slice: &EndpointSlice) -> Self {
        let meta = &slice.metadata;
        let labels = meta.labels.as_ref();
        let boxed = |s: &Option<String>| s.as_deref().map(Box::from);
        let mut places = SharedPlaces::default();
        Slice {
            name: meta.name.as_deref().unwrap_or_default().into(),
            namespace: meta.namespace.as_deref().unwrap_or_default().into(),
            service_name: labels
                .and_then(|l| l.get(LABEL_SERVICE_NAME))
                .map(|s| s.as_str().into()),
            excluded: labels
                .is_some_and(|l| l.contains_key(LABEL_SERVICE_PROXY_NAME) || l.contains_key(LABEL_HEADLESS)),
            address_type: IpFamily::parse(&slice.address_type),
            ports: slice
                .ports
                .iter()
                .flatten()
                .map(|p| SlicePort {
                    name: boxed(&p.name),
                    port: p.port,
                    protocol: boxed(&p.protocol),
                })
                .collect(),
            endpoints: slice
                .endpoints
                .iter()
                .flatten()
                .map(|ep| {
                    let conditions = ep.conditions.as_ref();
                    let hints = ep.hints.as_ref();
                    SliceEndpoint {
                        address: ep.addresses.first().map(|a| SliceAddress::from(a.as_str())),
                        ready: conditions.and_then(|c| c.ready),
                        serving: conditions.and_then(|c| c.serving),
                        terminating: conditions.and_then(|c| c.terminating),
                        place: places.get(ep.node_name.as_ref(), ep.zone.as_ref()),
                        hints: hints.map(|h| {
                            Box::new(SliceHints {
                                zones: names(h.for_zones.as_deref(), |z| &z.name),
                                nodes: names(h.for_nodes.as_deref(), |n| &n.name),
                            })
                        }),
                    }
                })
                .collect(),
        }
    }
}

/// The names of a list of hints.
fn names<T>(list: Option<&[T]>, name: impl Fn(&T) -> &String) -> Box<[Box<str>]> {
    list.unwrap_or_default()
        .iter()
        .map(|h| name(h).as_str().into())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kept once per endpoint of the cluster (100,000 at 10,000 Services): its size is the
    /// agent's memory.
    #[test]
    fn an_endpoint_stays_compact() {
        assert!(
            std::mem::size_of::<SliceEndpoint>() <= 48,
            "{}",
            std::mem::size_of::<SliceEndpoint>()
        );
    }

    #[test]
    fn endpoints_in_the_same_place_share_it() {
        let ep = |node: &str, zone: Option<&str>| k8s_openapi::api::discovery::v1::Endpoint {
            addresses: vec!["10.0.0.1".into()],
            node_name: Some(node.into()),
            zone: zone.map(Into::into),
            ..Default::default()
        };
        let slice = Slice::from(&EndpointSlice {
            endpoints: Some(vec![
                ep("n1", Some("a")),
                ep("n1", Some("a")),
                ep("n1", None),
                ep("n2", Some("a")),
            ]),
            ..Default::default()
        });
        let e = &slice.endpoints;
        assert!(Arc::ptr_eq(
            e[0].place.as_ref().unwrap(),
            e[1].place.as_ref().unwrap()
        ));
        assert_eq!((e[2].node_name(), e[2].zone()), (Some("n1"), None));
        assert_eq!((e[3].node_name(), e[3].zone()), (Some("n2"), Some("a")));
        assert_ne!(e[0].place, e[2].place);
        let none = Slice::from(&EndpointSlice {
            endpoints: Some(vec![k8s_openapi::api::discovery::v1::Endpoint::default()]),
            ..Default::default()
        });
        assert_eq!(none.endpoints[0].place, None);
    }
}
