//! Builders for the API objects tests feed the agent: Services and EndpointSlices as
//! `kubectl get -o yaml` would show them (written to a manifests folder, or created through the
//! API server).

use std::{collections::BTreeMap, fs, path::Path};

use crate::packet::Family;

use k8s_openapi::{
    api::{
        core::v1::{
            ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, Service, ServicePort, ServiceSpec,
            ServiceStatus, SessionAffinityConfig,
        },
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};

/// A Service under construction.
#[derive(Clone)]
pub struct Svc(pub Service);

pub fn service(namespace: &str, name: &str) -> Svc {
    Svc(Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            ports: Some(vec![]),
            ..Default::default()
        }),
        status: None,
    })
}

impl Svc {
    fn spec(&mut self) -> &mut ServiceSpec {
        self.0.spec.as_mut().expect("spec")
    }

    pub fn cluster_ip(mut self, ip: &str) -> Self {
        self.spec().cluster_ip = Some(ip.into());
        self.spec().cluster_ips = Some(vec![ip.into()]);
        self
    }

    /// The cluster IPs of a Service of one or two families, as the API server fills them:
    /// `clusterIP` is the first, `ipFamilies` follows `clusterIPs`, and two of them make the
    /// Service `RequireDualStack`.
    pub fn cluster_ips(mut self, ips: &[&str]) -> Self {
        let families = ips.iter().map(|ip| address_type(ip).to_string()).collect();
        let spec = self.spec();
        spec.cluster_ip = ips.first().map(|ip| ip.to_string());
        spec.cluster_ips = Some(ips.iter().map(|ip| ip.to_string()).collect());
        spec.ip_families = Some(families);
        spec.ip_family_policy = Some(
            if ips.len() > 1 {
                "RequireDualStack"
            } else {
                "SingleStack"
            }
            .into(),
        );
        self
    }

    pub fn type_(mut self, t: &str) -> Self {
        self.spec().type_ = Some(t.into());
        self
    }

    /// A port (`name` may be empty), with its target port.
    pub fn port(mut self, name: &str, protocol: &str, port: i32, target: i32) -> Self {
        self.spec().ports.get_or_insert_with(Vec::new).push(ServicePort {
            name: (!name.is_empty()).then(|| name.to_string()),
            protocol: Some(protocol.into()),
            port,
            target_port: Some(IntOrString::Int(target)),
            ..Default::default()
        });
        self
    }

    /// Sets the nodePort of the last port added (and makes the Service a NodePort one unless it is
    /// a LoadBalancer).
    pub fn node_port(mut self, node_port: i32) -> Self {
        if self.spec().type_.as_deref() != Some("LoadBalancer") {
            self.spec().type_ = Some("NodePort".into());
        }
        let port = self
            .spec()
            .ports
            .as_mut()
            .and_then(|p| p.last_mut())
            .expect("add a port first");
        port.node_port = Some(node_port);
        self
    }

    pub fn external_ips(mut self, ips: &[&str]) -> Self {
        self.spec().external_ips = Some(ips.iter().map(|s| s.to_string()).collect());
        self
    }

    pub fn load_balancer_ip(mut self, ip: &str) -> Self {
        self.spec().type_ = Some("LoadBalancer".into());
        self.0.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(vec![LoadBalancerIngress {
                    ip: Some(ip.into()),
                    ..Default::default()
                }]),
            }),
            ..Default::default()
        });
        self
    }

    pub fn source_ranges(mut self, ranges: &[&str]) -> Self {
        self.spec().load_balancer_source_ranges = Some(ranges.iter().map(|s| s.to_string()).collect());
        self
    }

    /// A label on the Service (`service.kubernetes.io/service-proxy-name`, say).
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.0
            .metadata
            .labels
            .get_or_insert_default()
            .insert(key.into(), value.into());
        self
    }

    /// An annotation on the Service (`lb-agent.io/lb-algorithm`, say).
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.0
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(key.into(), value.into());
        self
    }

    pub fn external_traffic_policy(mut self, policy: &str) -> Self {
        self.spec().external_traffic_policy = Some(policy.into());
        self
    }

    pub fn internal_traffic_policy(mut self, policy: &str) -> Self {
        self.spec().internal_traffic_policy = Some(policy.into());
        self
    }

    pub fn client_ip_affinity(mut self, timeout_seconds: i32) -> Self {
        self.spec().session_affinity = Some("ClientIP".into());
        self.spec().session_affinity_config = Some(SessionAffinityConfig {
            client_ip: Some(ClientIPConfig {
                timeout_seconds: Some(timeout_seconds),
            }),
        });
        self
    }

    /// Makes the Service dual-stack (`RequireDualStack`, IPv4 first): each IPv4 address set so
    /// far (cluster IP, external IPs, load-balancer IPs, loadBalancerSourceRanges) gets its IPv6
    /// counterpart ([`Family::ip`], [`Family::net`]) beside it, as a test written once for both
    /// families expects.
    pub fn dual_stack(mut self) -> Self {
        let v6 = |ip: &String| Family::V6.addr(ip);
        let spec = self.spec();
        let cluster_ip = spec.cluster_ip.clone().expect("a cluster IP");
        self = self.cluster_ips(&[&cluster_ip, &v6(&cluster_ip)]);
        let spec = self.spec();
        if let Some(ips) = &mut spec.external_ips {
            let mapped: Vec<String> = ips.iter().map(v6).collect();
            ips.extend(mapped);
        }
        if let Some(ranges) = &mut spec.load_balancer_source_ranges {
            let mapped: Vec<String> = ranges.iter().map(|r| Family::V6.net(r)).collect();
            ranges.extend(mapped);
        }
        let ingress = self
            .0
            .status
            .as_mut()
            .and_then(|s| s.load_balancer.as_mut())
            .and_then(|lb| lb.ingress.as_mut());
        if let Some(ingress) = ingress {
            let mapped: Vec<LoadBalancerIngress> = ingress
                .iter()
                .filter_map(|i| i.ip.as_ref())
                .map(|ip| LoadBalancerIngress {
                    ip: Some(v6(ip)),
                    ..Default::default()
                })
                .collect();
            ingress.extend(mapped);
        }
        self
    }

    pub fn build(self) -> Service {
        self.0
    }
}

/// Conditions of one endpoint.
#[derive(Clone, Copy, Debug)]
pub enum State {
    Ready,
    /// Serving and terminating (KEP-1669 fallback).
    Terminating,
    /// Neither ready nor serving.
    NotReady,
}

/// An EndpointSlice under construction.
#[derive(Clone)]
pub struct Slice(pub EndpointSlice);

pub fn slice(namespace: &str, service: &str, name: &str) -> Slice {
    Slice(EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([(
                "kubernetes.io/service-name".to_string(),
                service.to_string(),
            )])),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: Some(vec![]),
        ports: Some(vec![]),
    })
}

/// The EndpointSlice `addressType` (and `ipFamilies` entry) of an address: "IPv6" when it has a
/// colon, else "IPv4".
pub fn address_type(ip: &str) -> &'static str {
    if ip.contains(':') { "IPv6" } else { "IPv4" }
}

impl Slice {
    /// An endpoint; the slice's `addressType` is the family of its addresses (a slice holds one
    /// family, as the EndpointSlice controller writes them).
    pub fn endpoint(mut self, ip: &str, node: &str, state: State) -> Self {
        self.0.address_type = address_type(ip).into();
        let (ready, serving, terminating) = match state {
            State::Ready => (true, true, false),
            State::Terminating => (false, true, true),
            State::NotReady => (false, false, false),
        };
        self.0.endpoints.get_or_insert_with(Vec::new).push(Endpoint {
            addresses: vec![ip.into()],
            conditions: Some(EndpointConditions {
                ready: Some(ready),
                serving: Some(serving),
                terminating: Some(terminating),
            }),
            node_name: Some(node.into()),
            ..Default::default()
        });
        self
    }

    pub fn port(mut self, name: &str, protocol: &str, port: i32) -> Self {
        self.0.ports.get_or_insert_with(Vec::new).push(EndpointPort {
            name: Some(name.into()),
            protocol: Some(protocol.into()),
            port: Some(port),
            ..Default::default()
        });
        self
    }

    /// The same slice (built with IPv4 addresses) in `family`: its addresses through
    /// [`Family::ip`], its name suffixed with `-ipv6` (a Service has a slice per family).
    pub fn in_family(mut self, family: Family) -> Self {
        if family == Family::V4 {
            return self;
        }
        self.0.address_type = family.name().into();
        if let Some(name) = &mut self.0.metadata.name {
            name.push_str("-ipv6");
        }
        for endpoint in self.0.endpoints.iter_mut().flatten() {
            for address in &mut endpoint.addresses {
                *address = family.addr(address);
            }
        }
        self
    }

    pub fn build(self) -> EndpointSlice {
        self.0
    }
}

/// Writes objects as a multi-document YAML file (JSON documents are valid YAML).
pub fn write_manifests(dir: &Path, file: &str, services: &[Service], slices: &[EndpointSlice]) {
    let mut text = String::new();
    for s in services {
        let mut v = serde_json::to_value(s).expect("service to json");
        v["apiVersion"] = "v1".into();
        v["kind"] = "Service".into();
        text.push_str(&format!("---\n{v}\n"));
    }
    for s in slices {
        let mut v = serde_json::to_value(s).expect("slice to json");
        v["apiVersion"] = "discovery.k8s.io/v1".into();
        v["kind"] = "EndpointSlice".into();
        text.push_str(&format!("---\n{v}\n"));
    }
    // Write then rename, so an agent reading the folder never sees half a file.
    let tmp = dir.join(format!(".{file}.tmp"));
    fs::write(&tmp, text).expect("write manifests");
    fs::rename(&tmp, dir.join(file)).expect("rename manifests");
}

/// Adds a ServiceCIDR object (networking.k8s.io/v1) named `name` with `cidrs` to `state`, as the
/// watch or the manifests would read it (kube-proxy's cluster-ips-check drops their unallocated
/// addresses).
pub fn add_service_cidr(state: &mut lb_agent::watch::ClusterState, name: &str, cidrs: &[String]) {
    lb_agent::watch::manifests::load_text(
        &format!(
            "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: {name}}}\nspec: {{cidrs: [{}]}}\n",
            cidrs.join(", ")
        ),
        Path::new("servicecidr.yaml"),
        "node-a",
        state,
    )
    .expect("a ServiceCIDR manifest");
}

/// The backend Maglev gives a flow (issue 17), computed in user space as every node does: the
/// table of `backends` ((address, port), default size, `plan::maglev`) at the flow's hash
/// (`lb_common::maglev::flow_hash`, which the tc program computes itself), for the nodes of a
/// cluster with `--bpf-lb-maglev-hash-seed` `seed` (`HashSeed::FIXED` without it).
pub fn maglev_pick(
    seed: lb_agent::plan::maglev::HashSeed,
    src: std::net::IpAddr,
    sport: u16,
    dst: std::net::IpAddr,
    dport: u16,
    proto: u8,
    backends: &[(std::net::IpAddr, u16)],
) -> (std::net::IpAddr, u16) {
    use std::net::IpAddr;

    use lb_agent::plan::maglev::{Member, TableSize, lookup_table};
    use lb_common::{
        family::{In6Addr, V4, V6},
        maglev,
    };
    let members: Vec<Member> = backends
        .iter()
        .map(|(addr, port)| Member {
            addr: *addr,
            port: *port,
            weight: 1,
        })
        .collect();
    let size = TableSize::default();
    let table = lookup_table(&members, size, &seed.table_seed());
    let hash = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            maglev::flow_hash::<V4>(seed.word(), &s.octets(), &d.octets(), sport, dport, proto)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => maglev::flow_hash::<V6>(
            seed.word(),
            &In6Addr::new(s.octets()),
            &In6Addr::new(d.octets()),
            sport,
            dport,
            proto,
        ),
        _ => panic!("{src} and {dst}: one family"),
    };
    let member = table.members[table.slots[maglev::index(hash, size.get()) as usize] as usize];
    (member.addr, member.port)
}
