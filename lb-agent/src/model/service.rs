//! Model step for Services: one v1 `Service` -> the [`ServicePortInfo`] of each of its ports, IPv4
//! family only. This ports kube-proxy's `ServiceChangeTracker.serviceToServiceMap` and
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

use ipnet::Ipv4Net;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};

use super::{Protocol, ServicePortInfo, ServicePortName};
use crate::watch::{
    ANNOTATION_TOPOLOGY_AWARE_HINTS, ANNOTATION_TOPOLOGY_MODE, LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME,
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
    /// proxy, no IPv4 cluster IP...). Not an error: callers must not report it.
    #[error("not proxied: {0}")]
    Skipped(&'static str),
    /// `metadata.name` is missing, so no `ServicePortName` can be formed.
    #[error("metadata.name is not set")]
    MissingName,
    /// The IPv4 cluster IP is not an IPv4 address. kube-proxy would program a nil IP here
    /// (`netutils.ParseIPSloppy` fails in `newBaseServiceInfo`); we refuse the whole Service.
    #[error("{field}: {value:?} is not a valid IPv4 address")]
    InvalidClusterIp { field: String, value: String },
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

/// Translates a Service into the [`ServicePortInfo`] of each of its ports (kube-proxy
/// `ServiceChangeTracker.serviceToServiceMap` + `newBaseServiceInfo`, for the IPv4 family).
///
/// Order of the checks, as upstream:
/// 1. the informer label selector: `service.kubernetes.io/service-proxy-name` or
///    `service.kubernetes.io/headless` present -> skipped;
/// 2. `ShouldSkipService`: `type: ExternalName`, or `clusterIP` `None` or empty -> skipped;
/// 3. `GetClusterIPByFamily(IPv4)` empty (an IPv6 single-stack Service) -> skipped;
/// 4. then one [`ServicePortInfo`] per port, dropping (with a warning) the malformed ones.
///
/// A special address ([`special_address`]: 0.0.0.0, loopback, link-local, multicast, broadcast)
/// as the cluster IP, an external IP or a load-balancer IP is dropped with a warning naming its
/// field; the rest of the Service is kept.
///
/// Fields left unset are filled with the API server's defaults (`type: ClusterIP`, port
/// `protocol: TCP`, `clusterIPs` from `clusterIP`, `timeoutSeconds: 10800`) so that objects read
/// from manifest files behave as they would once created through the API.
pub fn service_ports(svc: &Service) -> Result<ServicePorts, ServiceError> {
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
    let Some((index, cluster_ip)) = ipv4_cluster_ip(spec, &mut warnings)? else {
        return Err(ServiceError::Skipped("no IPv4 cluster IP"));
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
    let has_ipv6 = has_ipv6_family(spec);

    if !matches!(svc_type, "ClusterIP" | "NodePort" | "LoadBalancer") {
        warnings.push(format!(
            "spec.type: unknown type {svc_type:?}, treated as not externally accessible"
        ));
    }
    let external_ips = external_ips(spec, has_ipv6, &mut warnings);
    let load_balancer_ips = load_balancer_ips(svc, has_ipv6, &mut warnings);
    let load_balancer_source_ranges = source_ranges(spec, &mut warnings);
    let session_affinity_timeout = session_affinity_timeout(spec, &mut warnings);
    let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let external_policy_local = external_policy_local(spec, svc_type);
    let health_check_node_port = health_check_node_port(spec, svc_type, external_policy_local, &mut warnings);
    let traffic_distribution = spec.traffic_distribution.clone();
    let topology_mode = topology_mode(svc);

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

/// The Service's IPv4 cluster IP: kube-proxy `proxyutil.GetClusterIPByFamily(IPv4, svc)`.
///
/// With `spec.ipFamilies` set, the IP is `clusterIPs[i]` where `ipFamilies[i] == "IPv4"`; none ->
/// `Ok(None)` (skipped), and an address there that is not IPv4 -> [`ServiceError::InvalidClusterIp`].
/// Without `ipFamilies` (version skew, or a manifest file), kube-proxy takes `clusterIP` when it
/// is not IPv6; we take the first IPv4 entry of the list, and an unparsable entry is an error only
/// when no IPv4 entry exists (kube-proxy would have used it as a nil IP).
fn ipv4_cluster_ip(
    spec: &ServiceSpec,
    warnings: &mut Vec<String>,
) -> Result<Option<(usize, Ipv4Addr)>, ServiceError> {
    let ips = cluster_ip_list(spec);
    let families = spec.ip_families.as_deref().unwrap_or_default();
    let invalid = |i: usize, value: &str| ServiceError::InvalidClusterIp {
        field: format!("spec.clusterIPs[{i}]"),
        value: value.to_owned(),
    };
    if !families.is_empty() {
        let v4_index = families.iter().position(|f| f == "IPv4");
        for (i, ip) in ips.iter().enumerate() {
            if Some(i) != v4_index && parse_ip_sloppy(ip).is_none() {
                warnings.push(format!("spec.clusterIPs[{i}]: {ip:?} is not an IP address"));
            }
        }
        let Some(i) = v4_index else { return Ok(None) };
        let Some(ip) = ips.get(i) else { return Ok(None) };
        return match parse_ip_sloppy(ip) {
            Some(IpAddr::V4(v4)) => Ok(Some((i, v4))),
            _ => Err(invalid(i, ip)),
        };
    }
    let mut first_invalid = None;
    let mut found = None;
    for (i, ip) in ips.iter().enumerate() {
        match parse_ip_sloppy(ip) {
            Some(IpAddr::V4(v4)) => {
                found.get_or_insert((i, v4));
            }
            Some(IpAddr::V6(_)) => {}
            None => {
                first_invalid.get_or_insert((i, *ip));
            }
        }
    }
    match (found, first_invalid) {
        (Some(v4), Some((i, ip))) => {
            warnings.push(format!("spec.clusterIPs[{i}]: {ip:?} is not an IP address"));
            Ok(Some(v4))
        }
        (Some(v4), None) => Ok(Some(v4)),
        (None, Some((i, ip))) => Err(invalid(i, ip)),
        (None, None) => Ok(None),
    }
}

/// Whether the Service also has an IPv6 cluster IP (dual-stack): then IPv6 external and
/// load-balancer IPs are legitimate, served by an IPv6 proxy, and are dropped here silently.
fn has_ipv6_family(spec: &ServiceSpec) -> bool {
    spec.ip_families
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|f| f == "IPv6")
        || cluster_ip_list(spec)
            .iter()
            .any(|ip| matches!(parse_ip_sloppy(ip), Some(IpAddr::V6(_))))
}

/// Why `ip` may not be a Service address, if it may not: API validation's `ValidateNonSpecialIP`
/// (unspecified, loopback, link-local, link-local multicast), which also guards `externalIPs`,
/// widened to all multicast and the limited broadcast address. The API server never lets such an
/// address through (the cluster IP comes from the service CIDR), but `--manifests` skips the API
/// server, and the socket programs would then take over the host's own connections (an external
/// IP 127.0.0.1:22 would redirect `ssh localhost`).
pub fn special_address(ip: Ipv4Addr) -> Option<&'static str> {
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
fn special_address_warning(field: &str, ip: Ipv4Addr, reason: &str) -> String {
    format!("{field}: \"{ip}\" is {reason}, which a Service may not use; ignored")
}

/// `spec.externalIPs` of the IPv4 family: kube-proxy `proxyutil.MapIPsByIPFamily(...)[IPv4]`.
///
/// Unparsable entries are dropped with a warning (upstream: "Skipping invalid IP"), except blank
/// ones, which upstream drops silently ("ExternalIPs may not be validated by the API server").
/// Special addresses ([`special_address`]) are dropped with a warning.
/// IPv6 entries are dropped; with a warning only when the Service has no IPv6 cluster IP, since
/// then no proxy at all will serve them.
fn external_ips(spec: &ServiceSpec, has_ipv6: bool, warnings: &mut Vec<String>) -> Vec<Ipv4Addr> {
    let mut out = Vec::new();
    for (i, ip) in spec
        .external_ips
        .as_deref()
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        match parse_ip_sloppy(ip) {
            Some(IpAddr::V4(v4)) => match special_address(v4) {
                Some(reason) => warnings.push(special_address_warning(
                    &format!("spec.externalIPs[{i}]"),
                    v4,
                    reason,
                )),
                None => out.push(v4),
            },
            Some(IpAddr::V6(_)) if has_ipv6 => {}
            Some(IpAddr::V6(_)) => warnings.push(format!(
                "spec.externalIPs[{i}]: {ip:?} is IPv6 but the Service has no IPv6 cluster IP; ignored"
            )),
            None if ip.trim().is_empty() => {}
            None => warnings.push(format!(
                "spec.externalIPs[{i}]: {ip:?} is not an IP address; ignored"
            )),
        }
    }
    out
}

/// `status.loadBalancer.ingress[].ip` of the IPv4 family in VIP mode: kube-proxy
/// `newBaseServiceInfo`'s ingress loop with `proxyutil.IsVIPMode` (`ipMode` unset or `VIP`;
/// `Proxy` means the load balancer delivers to the node itself, KEP-1860). Hostname-only ingress
/// entries are skipped silently, as upstream; unparsable, special ([`special_address`]) and
/// (single-stack) IPv6 ones with a warning.
fn load_balancer_ips(svc: &Service, has_ipv6: bool, warnings: &mut Vec<String>) -> Vec<Ipv4Addr> {
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
            Some(IpAddr::V4(v4)) => match special_address(v4) {
                Some(reason) => warnings.push(special_address_warning(&format!("{field}.ip"), v4, reason)),
                None => out.push(v4),
            },
            Some(IpAddr::V6(_)) if has_ipv6 => {}
            Some(IpAddr::V6(_)) => warnings.push(format!(
                "{field}.ip: {ip:?} is IPv6 but the Service has no IPv6 cluster IP; ignored"
            )),
            None => warnings.push(format!("{field}.ip: {ip:?} is not an IP address; ignored")),
        }
    }
    out
}

/// `spec.loadBalancerSourceRanges` of the IPv4 family: kube-proxy `newBaseServiceInfo` with
/// `proxyutil.MapCIDRsByIPFamily`.
///
/// - each entry is whitespace-trimmed first (validation "mistakenly allows whitespace padding");
/// - unparsable entries are ignored with a warning ("Invalid CIDR ignored"; blank ones silently);
///   host bits are cleared (`net.ParseCIDR` returns the network);
/// - IPv6 entries belong to the IPv6 proxy and are dropped silently;
/// - a zero-length prefix (`0.0.0.0/0`) means "allow any", which is the same as an empty list, so
///   the list is emptied.
///
/// An empty result allows every client. When the field was set but yields no usable IPv4 range
/// (all invalid, or all IPv6), that is still kube-proxy's behaviour, and we add a warning.
fn source_ranges(spec: &ServiceSpec, warnings: &mut Vec<String>) -> Vec<Ipv4Net> {
    let ranges = spec.load_balancer_source_ranges.as_deref().unwrap_or_default();
    let mut out = Vec::new();
    let mut allow_any = false;
    for (i, raw) in ranges.iter().enumerate() {
        let trimmed = raw.trim();
        match parse_cidr_sloppy(trimmed) {
            Some(ParsedCidr::V4(net)) if net.prefix_len() == 0 => allow_any = true,
            Some(ParsedCidr::V4(net)) => out.push(net),
            Some(ParsedCidr::V6) => {}
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
        warnings.push(
            "spec.loadBalancerSourceRanges: no usable IPv4 range, so every IPv4 client is allowed".to_owned(),
        );
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

/// A CIDR as kube-proxy sorts it by family.
enum ParsedCidr {
    V4(Ipv4Net),
    V6,
}

/// k8s.io/utils/net `ParseCIDRSloppy`: `ip/prefix` with a sloppy IP and a decimal prefix no
/// longer than the address; the host bits are cleared.
fn parse_cidr_sloppy(s: &str) -> Option<ParsedCidr> {
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
        let _: Ipv6Addr = addr.parse().ok()?;
        return (prefix <= 128).then_some(ParsedCidr::V6);
    }
    let ip = parse_ipv4_sloppy(addr)?;
    Ipv4Net::new(ip, prefix)
        .ok()
        .map(|net| ParsedCidr::V4(net.trunc()))
}

#[cfg(test)]
mod tests;
