//! Model step for Services: one v1 `Service` and one IP family -> the [`ServicePortInfo`] of each
//! of its ports, what kube-proxy's proxier of that family makes of it. This ports kube-proxy's `ServiceChangeTracker.serviceToServiceMap` and
//! `newBaseServiceInfo` (`pkg/proxy/servicechangetracker.go`, `pkg/proxy/serviceport.go`), the
//! skip rules of `proxyutil.ShouldSkipService` (`pkg/proxy/util/utils.go`) and of kube-proxy's
//! informer label selector (`cmd/kube-proxy/app/server.go`), and the traffic-policy helpers of
//! `pkg/api/v1/service/util.go`. kube-proxy drops a malformed entry and keeps the rest; so do we,
//! but where kube-proxy only logs we return a warning (or, when nothing usable is left, an error)
//! so that the caller can raise a Kubernetes Event. Services that kube-proxy ignores by design come
//! back as [`ServiceError::Skipped`], which callers must not report.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};

use super::{LbAlgorithm, Protocol, ServicePortInfo, ServicePortName};
use crate::family::IpFamily;
use crate::watch::{
    ANNOTATION_LB_ALGORITHM, ANNOTATION_LB_ALGORITHM_CILIUM, ANNOTATION_TOPOLOGY_AWARE_HINTS,
    ANNOTATION_TOPOLOGY_MODE, LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME,
};

/// The API server's default `sessionAffinityConfig.clientIP.timeoutSeconds`
/// (`v1.DefaultClientIPServiceAffinitySeconds`).
pub const DEFAULT_CLIENT_IP_TIMEOUT_SECONDS: u32 = 10800;
/// The largest `timeoutSeconds` API validation accepts (`core.MaxClientIPServiceAffinitySeconds`).
pub const MAX_CLIENT_IP_TIMEOUT_SECONDS: u32 = 86400;

/// The usable ports of one Service, plus what was wrong with the rest of it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServicePorts {
    /// One entry per usable `spec.ports[]` entry, in spec order.
    pub ports: Vec<ServicePortInfo>,
    /// Malformed entries that were dropped (kube-proxy logs these); each message starts with the
    /// field path. Worth a Warning Event on the Service; never fatal.
    pub warnings: Vec<String>,
}

/// Why a Service yields no [`ServicePortInfo`] at all.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    /// kube-proxy does not proxy this Service, by design (headless, ExternalName, owned by another
    /// proxy, no cluster IP of the family...). Not an error: callers must not report it.
    #[error("not proxied: {0}")]
    Skipped(&'static str),
    /// `metadata.name` is missing, so no `ServicePortName` can be formed.
    #[error("metadata.name is not set")]
    MissingName,
    /// The cluster IP of the family is not an address of the family. kube-proxy would program a
    /// nil IP here (`netutils.ParseIPSloppy` fails in `newBaseServiceInfo`); we refuse the Service
    /// in that family.
    #[error("{field}: {value:?} is not a valid {family} address")]
    InvalidClusterIp {
        field: String,
        value: String,
        family: IpFamily,
    },
    /// Every port was malformed (or `spec.ports` is empty); `problems` says why, one per field.
    #[error("no usable port: {}", .problems.join("; "))]
    NoUsablePorts { problems: Vec<String> },
}

impl ServiceError {
    /// True for [`ServiceError::Skipped`]: the Service is ignored by design, not broken.
    pub fn is_skipped(&self) -> bool {
        matches!(self, ServiceError::Skipped(_))
    }
}

/// Translates a Service into the [`ServicePortInfo`] of each of its ports in `family` (kube-proxy
/// `ServiceChangeTracker.serviceToServiceMap` + `newBaseServiceInfo` of that family's proxier).
///
/// Order of the checks, as upstream:
/// 1. the informer label selector: `service.kubernetes.io/service-proxy-name` or
///    `service.kubernetes.io/headless` present -> skipped;
/// 2. `ShouldSkipService`: `type: ExternalName`, or `clusterIP` `None` or empty -> skipped;
/// 3. `GetClusterIPByFamily(family)` empty (a single-stack Service of the other family) ->
///    skipped;
/// 4. then one [`ServicePortInfo`] per port, dropping (with a warning) the malformed ones.
///
/// A special address ([`special_address`]: unspecified, loopback, link-local, multicast,
/// broadcast) as the cluster IP, an external IP or a load-balancer IP is dropped with a warning
/// naming its field; the rest of the Service is kept.
///
/// Fields left unset are filled with the API server's defaults (`type: ClusterIP`, port
/// `protocol: TCP`, `clusterIPs` from `clusterIP`, `timeoutSeconds: 10800`) so that objects read
/// from manifest files behave as they would once created through the API.
pub fn service_ports(svc: &Service, family: IpFamily) -> Result<ServicePorts, ServiceError> {
    let meta = &svc.metadata;
    if let Some(labels) = &meta.labels {
        if labels.contains_key(LABEL_SERVICE_PROXY_NAME) {
            return Err(ServiceError::Skipped(
                "labelled service.kubernetes.io/service-proxy-name",
            ));
        }
        if labels.contains_key(LABEL_HEADLESS) {
            return Err(ServiceError::Skipped("labelled service.kubernetes.io/headless"));
        }
    }
    let default_spec = ServiceSpec::default();
    let spec = svc.spec.as_ref().unwrap_or(&default_spec);
    let svc_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    // ShouldSkipService checks clusterIP first; checking the type first only changes which reason
    // is given (an ExternalName Service usually has no clusterIP either).
    if svc_type == "ExternalName" {
        return Err(ServiceError::Skipped("type ExternalName"));
    }
    match primary_cluster_ip(spec) {
        "None" => return Err(ServiceError::Skipped("headless (clusterIP None)")),
        "" => return Err(ServiceError::Skipped("no clusterIP")),
        _ => {}
    }
    let name = meta
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .ok_or(ServiceError::MissingName)?;
    let namespace = meta.namespace.clone().unwrap_or_default();

    let mut warnings = Vec::new();
    let Some((index, cluster_ip)) = cluster_ip_of(spec, family, &mut warnings)? else {
        return Err(ServiceError::Skipped("no cluster IP of the family"));
    };
    // A special cluster IP (0.0.0.0, loopback...) is dropped, and with it the Service's cluster-IP
    // frontends; its NodePorts, external and load-balancer IPs are still served.
    let cluster_ips = match special_address(cluster_ip) {
        Some(reason) => {
            warnings.push(special_address_warning(
                &format!("spec.clusterIPs[{index}]"),
                cluster_ip,
                reason,
            ));
            Vec::new()
        }
        None => vec![cluster_ip],
    };
    let has_other = has_family(spec, family.other());

    if !matches!(svc_type, "ClusterIP" | "NodePort" | "LoadBalancer") {
        warnings.push(format!(
            "spec.type: unknown type {svc_type:?}, treated as not externally accessible"
        ));
    }
    let external_ips = external_ips(spec, family, has_other, &mut warnings);
    let load_balancer_ips = load_balancer_ips(svc, family, has_other, &mut warnings);
    let load_balancer_source_ranges = source_ranges(spec, family, &mut warnings);
    let session_affinity_timeout = session_affinity_timeout(spec, &mut warnings);
    let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let external_policy_local = external_policy_local(spec, svc_type);
    let health_check_node_port = health_check_node_port(spec, svc_type, external_policy_local, &mut warnings);
    let traffic_distribution = spec.traffic_distribution.clone();
    let topology_mode = topology_mode(svc);
    let lb_algorithm = lb_algorithm(svc, &mut warnings);

    let service_ports = spec.ports.as_deref().unwrap_or_default();
    if service_ports.is_empty() {
        warnings.push("spec.ports: no port".to_owned());
        return Err(ServiceError::NoUsablePorts { problems: warnings });
    }
    let mut ports = Vec::with_capacity(service_ports.len());
    let mut seen_names = BTreeSet::new();
    let mut seen_numbers = BTreeSet::new();
    for (i, sp) in service_ports.iter().enumerate() {
        let field = format!("spec.ports[{i}]");
        let Some((port, protocol)) = port_and_protocol(sp, &field, &mut warnings) else {
            continue;
        };
        let port_name = ServicePortName {
            namespace: namespace.clone(),
            name: name.clone(),
            port: sp.name.clone().unwrap_or_default(),
            protocol,
        };
        // Duplicates: API validation rejects both (duplicate names, duplicate (port, protocol)).
        // kube-proxy keys its map by ServicePortName, so a later duplicate name replaces an
        // earlier one; we keep the first of either kind so that (VIP, port, protocol) stays a key.
        if seen_names.contains(&port_name) {
            warnings.push(format!(
                "{field}: duplicate port {port_name} ({}); ignored",
                protocol.as_str()
            ));
            continue;
        }
        if !seen_numbers.insert((port, protocol)) {
            warnings.push(format!(
                "{field}: duplicate port {port}/{}; ignored",
                protocol.as_str()
            ));
            continue;
        }
        seen_names.insert(port_name.clone());
        let node_port = node_port(sp, svc_type, &field, &mut warnings);
        ports.push(ServicePortInfo {
            name: port_name,
            family,
            cluster_ips: cluster_ips.clone(),
            port,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            load_balancer_source_ranges: load_balancer_source_ranges.clone(),
            session_affinity_timeout,
            internal_policy_local,
            external_policy_local,
            health_check_node_port,
            traffic_distribution: traffic_distribution.clone(),
            topology_mode: topology_mode.clone(),
            lb_algorithm,
        });
    }
    if ports.is_empty() {
        return Err(ServiceError::NoUsablePorts { problems: warnings });
    }
    Ok(ServicePorts { ports, warnings })
}

/// `spec.clusterIP`, or `spec.clusterIPs[0]` when only the list is set (the API server keeps
/// `clusterIP == clusterIPs[0]`). This is what `ShouldSkipService` compares with "None" and "".
fn primary_cluster_ip(spec: &ServiceSpec) -> &str {
    match spec.cluster_ip.as_deref() {
        Some(ip) if !ip.is_empty() => ip,
        _ => spec
            .cluster_ips
            .as_ref()
            .and_then(|ips| ips.first())
            .map_or("", String::as_str),
    }
}

/// `spec.clusterIPs` (or `[spec.clusterIP]` when the list is unset, as the API server defaults it).
fn cluster_ip_list(spec: &ServiceSpec) -> Vec<&str> {
    match spec.cluster_ips.as_deref() {
        Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
        _ => spec
            .cluster_ip
            .as_deref()
            .into_iter()
            .filter(|ip| !ip.is_empty())
            .collect(),
    }
}

/// The Service's cluster IP of `family`: kube-proxy `proxyutil.GetClusterIPByFamily(family, svc)`.
///
/// With `spec.ipFamilies` set, the IP is `clusterIPs[i]` where `ipFamilies[i]` is the family;
/// none -> `Ok(None)` (skipped), and an address there that is not of the family ->
/// [`ServiceError::InvalidClusterIp`]. Without `ipFamilies` (version skew, or a manifest file),
/// kube-proxy takes `clusterIP` when its family matches (an unparsable one counts as IPv4, since
/// it is not IPv6); we take the first entry of the family in the list, and an unparsable entry is
/// an error only for IPv4 and only when no IPv4 entry exists (kube-proxy would have used it as a
/// nil IP).
fn cluster_ip_of(
    spec: &ServiceSpec,
    family: IpFamily,
    warnings: &mut Vec<String>,
) -> Result<Option<(usize, IpAddr)>, ServiceError> {
    let ips = cluster_ip_list(spec);
    let families = spec.ip_families.as_deref().unwrap_or_default();
    let invalid = |i: usize, value: &str| ServiceError::InvalidClusterIp {
        field: format!("spec.clusterIPs[{i}]"),
        value: value.to_owned(),
        family,
    };
    if !families.is_empty() {
        let index = families.iter().position(|f| f == family.as_str());
        for (i, ip) in ips.iter().enumerate() {
            if Some(i) != index && parse_ip_sloppy(ip).is_none() {
                warnings.push(format!("spec.clusterIPs[{i}]: {ip:?} is not an IP address"));
            }
        }
        let Some(i) = index else { return Ok(None) };
        let Some(ip) = ips.get(i) else { return Ok(None) };
        return match parse_ip_sloppy(ip) {
            Some(addr) if IpFamily::of(&addr) == family => Ok(Some((i, addr))),
            _ => Err(invalid(i, ip)),
        };
    }
    let mut first_invalid = None;
    let mut found = None;
    for (i, ip) in ips.iter().enumerate() {
        match parse_ip_sloppy(ip) {
            Some(addr) if IpFamily::of(&addr) == family => {
                found.get_or_insert((i, addr));
            }
            Some(_) => {}
            None => {
                first_invalid.get_or_insert((i, *ip));
            }
        }
    }
    match (found, first_invalid) {
        (Some(found), Some((i, ip))) => {
            warnings.push(format!("spec.clusterIPs[{i}]: {ip:?} is not an IP address"));
            Ok(Some(found))
        }
        (Some(found), None) => Ok(Some(found)),
        (None, Some((i, ip))) if family == IpFamily::V4 => Err(invalid(i, ip)),
        (None, _) => Ok(None),
    }
}

/// Whether the Service has a cluster IP of `family` (dual-stack, for the other family): then
/// that family's external and load-balancer IPs are legitimate, served by that family's proxier,
/// and are left out here silently.
fn has_family(spec: &ServiceSpec, family: IpFamily) -> bool {
    spec.ip_families
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|f| f == family.as_str())
        || cluster_ip_list(spec)
            .iter()
            .any(|ip| parse_ip_sloppy(ip).is_some_and(|a| IpFamily::of(&a) == family))
}

/// Why `ip` may not be a Service address, if it may not: API validation's `ValidateNonSpecialIP`
/// (unspecified, loopback, link-local, link-local multicast), which also guards `externalIPs`,
/// widened to all multicast and IPv4's limited broadcast address. The API server never lets such
/// an address through (the cluster IP comes from the service CIDR), but `--manifests` skips the
/// API server, and the socket programs would then take over the host's own connections (an
/// external IP 127.0.0.1:22 would redirect `ssh localhost`).
pub fn special_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => special_v4(v4),
        IpAddr::V6(v6) => special_v6(v6),
    }
}

fn special_v6(ip: Ipv6Addr) -> Option<&'static str> {
    if ip.is_unspecified() {
        Some("unspecified (::)")
    } else if ip.is_loopback() {
        Some("the loopback address (::1)")
    } else if ip.is_unicast_link_local() {
        Some("in the link-local range (fe80::/10)")
    } else if ip.is_multicast() {
        Some("multicast (ff00::/8)")
    } else {
        None
    }
}

fn special_v4(ip: Ipv4Addr) -> Option<&'static str> {
    if ip.is_unspecified() {
        Some("unspecified (0.0.0.0)")
    } else if ip.is_loopback() {
        Some("in the loopback range (127.0.0.0/8)")
    } else if ip.is_link_local() {
        Some("in the link-local range (169.254.0.0/16)")
    } else if ip.is_multicast() {
        Some("multicast (224.0.0.0/4)")
    } else if ip.is_broadcast() {
        Some("the broadcast address (255.255.255.255)")
    } else {
        None
    }
}

/// The warning for a special address dropped from `field`.
fn special_address_warning(field: &str, ip: IpAddr, reason: &str) -> String {
    format!("{field}: \"{ip}\" is {reason}, which a Service may not use; ignored")
}

/// `spec.externalIPs` of `family`: kube-proxy `proxyutil.MapIPsByIPFamily(...)[family]`.
///
/// Unparsable entries are dropped with a warning (upstream: "Skipping invalid IP"), except blank
/// ones, which upstream drops silently ("ExternalIPs may not be validated by the API server").
/// Special addresses ([`special_address`]) are dropped with a warning. Entries of the other
/// family are left to that family's proxier; with a warning when the Service has no cluster IP
/// of that family, since then no proxier at all serves them.
fn external_ips(
    spec: &ServiceSpec,
    family: IpFamily,
    has_other: bool,
    warnings: &mut Vec<String>,
) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for (i, ip) in spec
        .external_ips
        .as_deref()
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let field = format!("spec.externalIPs[{i}]");
        match parse_ip_sloppy(ip) {
            Some(addr) if IpFamily::of(&addr) == family => match special_address(addr) {
                Some(reason) => warnings.push(special_address_warning(&field, addr, reason)),
                None => out.push(addr),
            },
            Some(_) if has_other => {}
            Some(addr) => warnings.push(no_proxier_warning(&field, ip, IpFamily::of(&addr))),
            None if ip.trim().is_empty() => {}
            None => warnings.push(format!("{field}: {ip:?} is not an IP address; ignored")),
        }
    }
    out
}

/// The warning for an address of a family the Service has no cluster IP of.
fn no_proxier_warning(field: &str, ip: &str, family: IpFamily) -> String {
    format!("{field}: {ip:?} is {family} but the Service has no {family} cluster IP; ignored")
}

/// `status.loadBalancer.ingress[].ip` of `family` in VIP mode: kube-proxy `newBaseServiceInfo`'s
/// ingress loop with `proxyutil.IsVIPMode` (`ipMode` unset or `VIP`; `Proxy` means the load
/// balancer delivers to the node itself, KEP-1860). Hostname-only ingress entries are skipped
/// silently, as upstream; unparsable and special ([`special_address`]) ones with a warning, and
/// those of the other family as external IPs are.
fn load_balancer_ips(
    svc: &Service,
    family: IpFamily,
    has_other: bool,
    warnings: &mut Vec<String>,
) -> Vec<IpAddr> {
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_deref())
        .unwrap_or_default();
    let mut out = Vec::new();
    for (i, ing) in ingress.iter().enumerate() {
        let field = format!("status.loadBalancer.ingress[{i}]");
        let Some(ip) = ing.ip.as_deref().filter(|ip| !ip.is_empty()) else {
            continue;
        };
        match ing.ip_mode.as_deref() {
            None | Some("VIP") => {}
            Some("Proxy") => continue,
            Some(other) => {
                warnings.push(format!("{field}.ipMode: unknown mode {other:?}; ingress ignored"));
                continue;
            }
        }
        match parse_ip_sloppy(ip) {
            Some(addr) if IpFamily::of(&addr) == family => match special_address(addr) {
                Some(reason) => warnings.push(special_address_warning(&format!("{field}.ip"), addr, reason)),
                None => out.push(addr),
            },
            Some(_) if has_other => {}
            Some(addr) => warnings.push(no_proxier_warning(
                &format!("{field}.ip"),
                ip,
                IpFamily::of(&addr),
            )),
            None => warnings.push(format!("{field}.ip: {ip:?} is not an IP address; ignored")),
        }
    }
    out
}

/// `spec.loadBalancerSourceRanges` of `family`: kube-proxy `newBaseServiceInfo` with
/// `proxyutil.MapCIDRsByIPFamily`.
///
/// - each entry is whitespace-trimmed first (validation "mistakenly allows whitespace padding");
/// - unparsable entries are ignored with a warning ("Invalid CIDR ignored"; blank ones silently);
///   host bits are cleared (`net.ParseCIDR` returns the network);
/// - entries of the other family belong to that family's proxier and are dropped silently;
/// - a zero-length prefix (`0.0.0.0/0`, `::/0`) means "allow any", which is the same as an empty
///   list, so the list is emptied.
///
/// An empty result allows every client of the family. When the field was set but yields no usable
/// range of the family (all invalid, or all of the other family), that is still kube-proxy's
/// behaviour, and we add a warning.
fn source_ranges(spec: &ServiceSpec, family: IpFamily, warnings: &mut Vec<String>) -> Vec<IpNet> {
    let ranges = spec.load_balancer_source_ranges.as_deref().unwrap_or_default();
    let mut out = Vec::new();
    let mut allow_any = false;
    for (i, raw) in ranges.iter().enumerate() {
        let trimmed = raw.trim();
        match parse_cidr_sloppy(trimmed) {
            Some(net) if IpFamily::of_net(&net) != family => {}
            Some(net) if net.prefix_len() == 0 => allow_any = true,
            Some(net) => out.push(net),
            None if trimmed.is_empty() => {}
            None => warnings.push(format!(
                "spec.loadBalancerSourceRanges[{i}]: {raw:?} is not a CIDR; ignored"
            )),
        }
    }
    if allow_any {
        return Vec::new();
    }
    if out.is_empty() && ranges.iter().any(|r| !r.trim().is_empty()) {
        warnings.push(format!(
            "spec.loadBalancerSourceRanges: no usable {family} range, so every {family} client is allowed"
        ));
    }
    out
}

/// `Some(timeoutSeconds)` for `sessionAffinity: ClientIP` (kube-proxy `newBaseServiceInfo`:
/// `stickyMaxAgeSeconds`). A missing config gets the API default 10800; a value outside the
/// validated range 1..=86400 gets the default too, with a warning. An unknown affinity is ignored
/// with a warning.
fn session_affinity_timeout(spec: &ServiceSpec, warnings: &mut Vec<String>) -> Option<u32> {
    match spec.session_affinity.as_deref() {
        None | Some("None") | Some("") => None,
        Some("ClientIP") => {
            let timeout = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match timeout {
                None => Some(DEFAULT_CLIENT_IP_TIMEOUT_SECONDS),
                Some(t) => match u32::try_from(t) {
                    Ok(t) if (1..=MAX_CLIENT_IP_TIMEOUT_SECONDS).contains(&t) => Some(t),
                    _ => {
                        warnings.push(format!(
                            "spec.sessionAffinityConfig.clientIP.timeoutSeconds: {t} is outside \
                             1..={MAX_CLIENT_IP_TIMEOUT_SECONDS}; using {DEFAULT_CLIENT_IP_TIMEOUT_SECONDS}"
                        ));
                        Some(DEFAULT_CLIENT_IP_TIMEOUT_SECONDS)
                    }
                },
            }
        }
        Some(other) => {
            warnings.push(format!(
                "spec.sessionAffinity: unknown affinity {other:?}; ignored"
            ));
            None
        }
    }
}

/// `apiservice.ExternalPolicyLocal`: `externalTrafficPolicy: Local` on a Service that is
/// externally accessible by type (`apiservice.ExternallyAccessible`: LoadBalancer, NodePort, or
/// ClusterIP with external IPs). This is a per-Service property; [`ServicePortInfo`]'s
/// `uses_local_endpoints` then also checks that the port itself is externally accessible.
fn external_policy_local(spec: &ServiceSpec, svc_type: &str) -> bool {
    let has_external_ips = !spec.external_ips.as_deref().unwrap_or_default().is_empty();
    let accessible =
        matches!(svc_type, "LoadBalancer" | "NodePort") || (svc_type == "ClusterIP" && has_external_ips);
    accessible && spec.external_traffic_policy.as_deref() == Some("Local")
}

/// `spec.healthCheckNodePort` when `apiservice.NeedsHealthCheck` (type LoadBalancer and
/// `ExternalPolicyLocal`); kube-proxy logs "Service has no healthcheck nodeport" when it is 0.
fn health_check_node_port(
    spec: &ServiceSpec,
    svc_type: &str,
    external_policy_local: bool,
    warnings: &mut Vec<String>,
) -> Option<u16> {
    if svc_type != "LoadBalancer" || !external_policy_local {
        return None;
    }
    match spec.health_check_node_port {
        None | Some(0) => {
            warnings.push(
                "spec.healthCheckNodePort: not set on a LoadBalancer with externalTrafficPolicy Local"
                    .to_owned(),
            );
            None
        }
        Some(p) => match u16::try_from(p) {
            Ok(p) => Some(p),
            Err(_) => {
                warnings.push(format!(
                    "spec.healthCheckNodePort: {p} is not a port number; ignored"
                ));
                None
            }
        },
    }
}

/// The topology annotation, as written. As in kube-proxy `newBaseServiceInfo` (while it still read
/// it) and the EndpointSlice controller's `hintsEnabled`, the deprecated
/// `service.kubernetes.io/topology-aware-hints` takes precedence over
/// `service.kubernetes.io/topology-mode`. Informational only: kube-proxy (and
/// `topology::categorize_endpoints`) follow the EndpointSlice hints, not this annotation.
fn topology_mode(svc: &Service) -> Option<String> {
    let annotations = svc.metadata.annotations.as_ref()?;
    annotations
        .get(ANNOTATION_TOPOLOGY_AWARE_HINTS)
        .or_else(|| annotations.get(ANNOTATION_TOPOLOGY_MODE))
        .cloned()
}

/// The Service's algorithm annotation; an unknown value is reported and the node's setting used.
fn lb_algorithm(svc: &Service, warnings: &mut Vec<String>) -> Option<LbAlgorithm> {
    let annotations = svc.metadata.annotations.as_ref()?;
    let (key, value) = [ANNOTATION_LB_ALGORITHM, ANNOTATION_LB_ALGORITHM_CILIUM]
        .into_iter()
        .find_map(|key| annotations.get(key).map(|v| (key, v)))?;
    match value.parse() {
        Ok(algorithm) => Some(algorithm),
        Err(e) => {
            warnings.push(format!(
                "annotation {key}: {e}; the node's --bpf-lb-algorithm applies"
            ));
            None
        }
    }
}

/// The port number and protocol of one `spec.ports[]` entry; `None` (with a warning) when the
/// port is unusable: a number outside 1..=65535 or a protocol other than TCP, UDP and SCTP.
fn port_and_protocol(sp: &ServicePort, field: &str, warnings: &mut Vec<String>) -> Option<(u16, Protocol)> {
    let Some(protocol) = parse_protocol(sp.protocol.as_deref()) else {
        let p = sp.protocol.as_deref().unwrap_or_default();
        warnings.push(format!(
            "{field}.protocol: unsupported protocol {p:?}; port ignored"
        ));
        return None;
    };
    match u16::try_from(sp.port) {
        Ok(port) if port != 0 => Some((port, protocol)),
        _ => {
            warnings.push(format!(
                "{field}.port: {} is not a port number; port ignored",
                sp.port
            ));
            None
        }
    }
}

/// `spec.ports[].nodePort` (0 or unset: none). Kept whatever the Service type, as kube-proxy does
/// (API validation forbids it on ClusterIP Services, so we warn there); a value outside 1..=65535
/// is dropped with a warning, and the rest of the port is kept.
fn node_port(sp: &ServicePort, svc_type: &str, field: &str, warnings: &mut Vec<String>) -> Option<u16> {
    let n = sp.node_port.filter(|&n| n != 0)?;
    match u16::try_from(n) {
        Ok(p) => {
            if svc_type == "ClusterIP" {
                warnings.push(format!(
                    "{field}.nodePort: set on a ClusterIP Service (the API server rejects this)"
                ));
            }
            Some(p)
        }
        Err(_) => {
            warnings.push(format!("{field}.nodePort: {n} is not a port number; ignored"));
            None
        }
    }
}

/// A Kubernetes protocol name; unset means TCP (the API default for both `ServicePort` and
/// `discovery/v1` `EndpointPort`). `None` for anything else.
pub(crate) fn parse_protocol(protocol: Option<&str>) -> Option<Protocol> {
    match protocol {
        None | Some("TCP") => Some(Protocol::Tcp),
        Some("UDP") => Some(Protocol::Udp),
        Some("SCTP") => Some(Protocol::Sctp),
        Some(_) => None,
    }
}

/// k8s.io/utils/net `ParseIPSloppy`, as kube-proxy parses every IP: dotted-quad IPv4 with
/// leading zeros allowed (read as decimal, like Go before 1.17), or IPv6. An IPv4-mapped IPv6
/// address (`::ffff:a.b.c.d`) is IPv4, as `netutils.IPFamilyOf` says.
pub(crate) fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    if let Some(v4) = parse_ipv4_sloppy(s) {
        return Some(IpAddr::V4(v4));
    }
    let v6: Ipv6Addr = s.parse().ok()?;
    Some(match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    })
}

/// Go 1.16 `net.parseIPv4`: four dot-separated decimal numbers up to 255, any number of digits.
fn parse_ipv4_sloppy(s: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for octet in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let digits = part.trim_start_matches('0');
        *octet = if digits.is_empty() {
            0
        } else {
            digits.parse().ok()?
        };
    }
    parts.next().is_none().then_some(Ipv4Addr::from(octets))
}

/// k8s.io/utils/net `ParseCIDRSloppy`: `ip/prefix` with a sloppy IP and a decimal prefix no
/// longer than the address; the host bits are cleared. An IPv4-mapped IPv6 prefix is IPv4, as Go
/// sees it (`To4()`).
pub(crate) fn parse_cidr_sloppy(s: &str) -> Option<IpNet> {
    let (addr, prefix) = s.split_once('/')?;
    if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = prefix.trim_start_matches('0');
    let prefix: u8 = if digits.is_empty() {
        0
    } else {
        digits.parse().ok()?
    };
    if addr.contains(':') {
        let v6: Ipv6Addr = addr.parse().ok()?;
        if let Some(v4) = v6.to_ipv4_mapped()
            && prefix >= 96
        {
            return Ipv4Net::new(v4, prefix - 96).ok().map(|n| IpNet::V4(n.trunc()));
        }
        return Ipv6Net::new(v6, prefix).ok().map(|n| IpNet::V6(n.trunc()));
    }
    let ip = parse_ipv4_sloppy(addr)?;
    Ipv4Net::new(ip, prefix).ok().map(|net| IpNet::V4(net.trunc()))
}

#[cfg(test)]
mod tests;
