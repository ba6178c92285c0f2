//! What the sandbox writes itself for its netns pods, which are not Pod objects: the
//! EndpointSlices (the EndpointSlice controller's job: one per IP family of the Service, of that
//! family's pod addresses) and the LoadBalancer status (a load-balancer controller's, with
//! addresses from 203.0.113.0/24).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::Result;
use k8s_openapi::{
    api::{
        core::v1::Service,
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};

use crate::{LB_POOL, cluster::Cluster};

impl Cluster {
    /// Plays the EndpointSlice controller (selector -> pods, a slice per IP family of the
    /// Service) and the load-balancer controller (an IP from 203.0.113.0/24 for each LoadBalancer
    /// Service).
    pub(crate) fn program_endpoints_and_status(&mut self, client: &kube::Client) -> Result<()> {
        let services: Vec<Service> = self
            .rt
            .block_on(Api::<Service>::all(client.clone()).list(&ListParams::default()))?
            .items;
        let mut next_lb = 10u8;
        for svc in services {
            let (Some(ns), Some(name)) = (svc.metadata.namespace.clone(), svc.metadata.name.clone()) else {
                continue;
            };
            let Some(spec) = &svc.spec else { continue };
            let Some(selector) = &spec.selector else { continue };
            let app = selector.get("app").cloned().unwrap_or_default();
            let ports: Vec<EndpointPort> = spec
                .ports
                .iter()
                .flatten()
                .map(|p| {
                    let protocol = p.protocol.clone().unwrap_or_else(|| "TCP".into());
                    let number = match &p.target_port {
                        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n)) => *n,
                        // Named target ports: the pods serve http on 8080 and dns on 5353.
                        _ => {
                            if protocol == "UDP" {
                                5353
                            } else {
                                8080
                            }
                        }
                    };
                    EndpointPort {
                        name: p.name.clone(),
                        protocol: Some(protocol),
                        port: Some(number),
                        ..Default::default()
                    }
                })
                .collect();
            // The Service's families as the API server set them (IPv4 when it says none).
            let families = spec.ip_families.clone().unwrap_or_else(|| vec!["IPv4".into()]);
            for family in families {
                // Any address of the family stands for it in `addr_like`.
                let (like, suffix): (IpAddr, &str) = match family.as_str() {
                    "IPv6" => (Ipv6Addr::UNSPECIFIED.into(), "-ipv6"),
                    _ => (Ipv4Addr::UNSPECIFIED.into(), ""),
                };
                let endpoints: Vec<Endpoint> = self
                    .pods
                    .iter()
                    .filter(|p| p.app == app)
                    .map(|p| Endpoint {
                        addresses: vec![p.addr_like(like).to_string()],
                        conditions: Some(EndpointConditions {
                            ready: Some(true),
                            serving: Some(true),
                            terminating: Some(false),
                        }),
                        node_name: Some(p.node.clone()),
                        target_ref: None,
                        ..Default::default()
                    })
                    .collect();
                let slice = EndpointSlice {
                    metadata: ObjectMeta {
                        name: Some(format!("{name}-sandbox{suffix}")),
                        namespace: Some(ns.clone()),
                        labels: Some(BTreeMap::from([
                            ("kubernetes.io/service-name".to_string(), name.clone()),
                            (
                                "endpointslice.kubernetes.io/managed-by".to_string(),
                                "lb-sandbox".to_string(),
                            ),
                        ])),
                        ..Default::default()
                    },
                    address_type: family.clone(),
                    endpoints: Some(endpoints),
                    ports: Some(ports.clone()),
                };
                self.rt.block_on(
                    Api::<EndpointSlice>::namespaced(client.clone(), &ns)
                        .create(&PostParams::default(), &slice),
                )?;
            }
            if spec.type_.as_deref() == Some("LoadBalancer") {
                let ip = Ipv4Addr::new(LB_POOL[0], LB_POOL[1], LB_POOL[2], next_lb);
                next_lb += 1;
                let status = serde_json::json!({"status": {"loadBalancer": {"ingress": [{"ip": ip.to_string(), "ipMode": "VIP"}]}}});
                self.rt
                    .block_on(Api::<Service>::namespaced(client.clone(), &ns).patch_status(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(&status),
                    ))?;
            }
        }
        Ok(())
    }
}
