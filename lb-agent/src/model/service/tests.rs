use std::collections::BTreeMap;

use k8s_openapi::{
    api::core::v1::{
        ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, ServiceStatus, SessionAffinityConfig,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::*;
use crate::model::test_support::port_name;

/// A Service builder: `svc()` is a ClusterIP Service `ns1/svc1` at 10.96.0.1 with one unnamed
/// TCP port 80, as the API server would return it.
struct SvcBuilder(Service);

fn svc() -> SvcBuilder {
    SvcBuilder(Service {
        metadata: ObjectMeta {
            name: Some("svc1".into()),
            namespace: Some("ns1".into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            cluster_ip: Some("10.96.0.1".into()),
            cluster_ips: Some(vec!["10.96.0.1".into()]),
            ip_families: Some(vec!["IPv4".into()]),
            ports: Some(vec![port("", 80, "TCP")]),
            ..Default::default()
        }),
        status: None,
    })
}

fn port(name: &str, number: i32, protocol: &str) -> ServicePort {
    ServicePort {
        name: (!name.is_empty()).then(|| name.to_owned()),
        port: number,
        protocol: Some(protocol.to_owned()),
        ..Default::default()
    }
}

fn strings(v: &[&str]) -> Option<Vec<String>> {
    Some(v.iter().map(|s| (*s).to_owned()).collect())
}

impl SvcBuilder {
    fn spec(mut self, f: impl FnOnce(&mut ServiceSpec)) -> Self {
        f(self.0.spec.as_mut().unwrap());
        self
    }
    fn type_(self, t: &str) -> Self {
        self.spec(|s| s.type_ = Some(t.to_owned()))
    }
    fn cluster_ips(self, ips: &[&str], families: &[&str]) -> Self {
        self.spec(|s| {
            s.cluster_ip = ips.first().map(|ip| (*ip).to_owned());
            s.cluster_ips = strings(ips);
            s.ip_families = strings(families);
        })
    }
    fn ports(self, ports: Vec<ServicePort>) -> Self {
        self.spec(|s| s.ports = Some(ports))
    }
    fn node_ports(self, node_ports: &[i32]) -> Self {
        self.spec(|s| {
            for (p, n) in s.ports.as_mut().unwrap().iter_mut().zip(node_ports) {
                p.node_port = Some(*n);
            }
        })
    }
    fn external_ips(self, ips: &[&str]) -> Self {
        self.spec(|s| s.external_ips = strings(ips))
    }
    fn source_ranges(self, ranges: &[&str]) -> Self {
        self.spec(|s| s.load_balancer_source_ranges = strings(ranges))
    }
    fn etp(self, policy: &str) -> Self {
        self.spec(|s| s.external_traffic_policy = Some(policy.to_owned()))
    }
    fn itp(self, policy: &str) -> Self {
        self.spec(|s| s.internal_traffic_policy = Some(policy.to_owned()))
    }
    fn health_check_node_port(self, p: i32) -> Self {
        self.spec(|s| s.health_check_node_port = Some(p))
    }
    fn affinity(self, affinity: &str, timeout: Option<i32>) -> Self {
        self.spec(|s| {
            s.session_affinity = Some(affinity.to_owned());
            s.session_affinity_config = timeout.map(|t| SessionAffinityConfig {
                client_ip: Some(ClientIPConfig {
                    timeout_seconds: Some(t),
                }),
            });
        })
    }
    fn ingress(mut self, entries: &[(&str, Option<&str>)]) -> Self {
        let ingress = entries
            .iter()
            .map(|(ip, mode)| LoadBalancerIngress {
                ip: Some((*ip).to_owned()),
                ip_mode: mode.map(str::to_owned),
                ..Default::default()
            })
            .collect();
        self.0.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(ingress),
            }),
            ..Default::default()
        });
        self
    }
    fn label(mut self, k: &str, v: &str) -> Self {
        self.0
            .metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(k.to_owned(), v.to_owned());
        self
    }
    fn annotation(mut self, k: &str, v: &str) -> Self {
        self.0
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(k.to_owned(), v.to_owned());
        self
    }
    fn build(self) -> Service {
        self.0
    }
    /// The IPv4 proxier's view, which most cases are about.
    fn ports_ok(self) -> ServicePorts {
        self.ports_in(IpFamily::V4)
    }
    fn ports_in(&self, family: IpFamily) -> ServicePorts {
        service_ports(&self.0, family).expect("service_ports")
    }
    fn one(self) -> ServicePortInfo {
        let out = self.ports_ok();
        assert_eq!(out.ports.len(), 1, "{out:?}");
        out.ports.into_iter().next().unwrap()
    }
}

fn v4(s: &str) -> IpAddr {
    s.parse::<Ipv4Addr>().unwrap().into()
}

fn v6(s: &str) -> IpAddr {
    s.parse::<Ipv6Addr>().unwrap().into()
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn spn(port: &str, protocol: Protocol) -> ServicePortName {
    port_name("ns1", "svc1", port, protocol)
}

#[test]
fn basic_cluster_ip_service() {
    let info = svc().one();
    assert_eq!(
        info,
        ServicePortInfo {
            name: spn("", Protocol::Tcp),
            family: IpFamily::V4,
            cluster_ips: vec![v4("10.96.0.1")],
            port: 80,
            node_port: None,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            session_affinity_timeout: None,
            internal_policy_local: false,
            external_policy_local: false,
            health_check_node_port: None,
            traffic_distribution: None,
            topology_mode: None,
            lb_algorithm: None,
        }
    );
    assert_eq!(info.name.to_string(), "ns1/svc1");
}

#[test]
fn two_named_ports_and_protocols() {
    let out = svc()
        .ports(vec![
            port("http", 80, "TCP"),
            port("dns", 53, "UDP"),
            port("sctp", 9, "SCTP"),
        ])
        .ports_ok();
    let names: Vec<_> = out.ports.iter().map(|p| (p.name.clone(), p.port)).collect();
    assert_eq!(
        names,
        vec![
            (spn("http", Protocol::Tcp), 80),
            (spn("dns", Protocol::Udp), 53),
            (spn("sctp", Protocol::Sctp), 9)
        ]
    );
    assert_eq!(out.ports[0].name.to_string(), "ns1/svc1:http");
    assert!(out.warnings.is_empty());
}

#[test]
fn unset_protocol_and_type_default() {
    let s = svc()
        .spec(|s| {
            s.type_ = None;
            s.ports.as_mut().unwrap()[0].protocol = None;
        })
        .one();
    assert_eq!(s.name.protocol, Protocol::Tcp);
}

/// ShouldSkipService and the informer label selector: all "skipped by design".
#[test]
fn skipped_services() {
    let cases: Vec<(&str, Service, &str)> = vec![
        (
            "headless",
            svc().cluster_ips(&["None"], &["IPv4"]).build(),
            "headless (clusterIP None)",
        ),
        (
            "ExternalName",
            svc()
                .type_("ExternalName")
                .spec(|s| {
                    s.cluster_ip = None;
                    s.cluster_ips = None;
                    s.external_name = Some("example.com".into());
                })
                .build(),
            "type ExternalName",
        ),
        (
            "ExternalName with a clusterIP",
            svc().type_("ExternalName").build(),
            "type ExternalName",
        ),
        (
            "no clusterIP",
            svc()
                .spec(|s| (s.cluster_ip, s.cluster_ips) = (None, None))
                .build(),
            "no clusterIP",
        ),
        (
            "empty clusterIP",
            svc().cluster_ips(&[""], &["IPv4"]).build(),
            "no clusterIP",
        ),
        (
            "service-proxy-name label",
            svc().label(LABEL_SERVICE_PROXY_NAME, "other-proxy").build(),
            "labelled service.kubernetes.io/service-proxy-name",
        ),
        (
            "service-proxy-name label, empty value",
            svc().label(LABEL_SERVICE_PROXY_NAME, "").build(),
            "labelled service.kubernetes.io/service-proxy-name",
        ),
        (
            "headless label",
            svc().label(LABEL_HEADLESS, "").build(),
            "labelled service.kubernetes.io/headless",
        ),
        (
            "IPv6 single-stack",
            svc().cluster_ips(&["fd00::1"], &["IPv6"]).build(),
            "no cluster IP of the family",
        ),
        (
            "IPv6 single-stack, no ipFamilies",
            svc()
                .cluster_ips(&["fd00::1"], &[])
                .spec(|s| s.ip_families = None)
                .build(),
            "no cluster IP of the family",
        ),
        (
            "ipFamilies IPv4 without an IP at that index",
            svc().cluster_ips(&["fd00::1"], &["IPv6", "IPv4"]).build(),
            "no cluster IP of the family",
        ),
        (
            "no spec",
            Service {
                spec: None,
                ..svc().build()
            },
            "no clusterIP",
        ),
    ];
    for (name, s, reason) in cases {
        let err = service_ports(&s, IpFamily::V4).expect_err(name);
        assert_eq!(err, ServiceError::Skipped(reason), "{name}");
        assert!(err.is_skipped(), "{name}");
    }
}

#[test]
fn dual_stack_takes_the_ipv4_cluster_ip() {
    let cases: Vec<(&str, Service)> = vec![
        (
            "IPv6 primary",
            svc()
                .cluster_ips(&["fd00::1", "10.96.0.7"], &["IPv6", "IPv4"])
                .build(),
        ),
        (
            "IPv4 primary",
            svc()
                .cluster_ips(&["10.96.0.7", "fd00::1"], &["IPv4", "IPv6"])
                .build(),
        ),
        (
            "no ipFamilies (skew)",
            svc()
                .cluster_ips(&["fd00::1", "10.96.0.7"], &[])
                .spec(|s| s.ip_families = None)
                .build(),
        ),
        (
            "only spec.clusterIP",
            svc()
                .spec(|s| s.cluster_ips = None)
                .spec(|s| s.cluster_ip = Some("10.96.0.7".into()))
                .build(),
        ),
        (
            "only spec.clusterIPs",
            svc()
                .spec(|s| s.cluster_ip = None)
                .spec(|s| s.cluster_ips = strings(&["10.96.0.7"]))
                .build(),
        ),
        (
            "leading zeros (ParseIPSloppy)",
            svc().cluster_ips(&["010.096.000.007"], &["IPv4"]).build(),
        ),
    ];
    for (name, s) in cases {
        let out = service_ports(&s, IpFamily::V4).expect(name);
        assert_eq!(out.ports[0].cluster_ips, vec![v4("10.96.0.7")], "{name}");
        assert!(out.warnings.is_empty(), "{name}: {:?}", out.warnings);
    }
}

#[test]
fn invalid_cluster_ips() {
    let cases: Vec<(&str, Service, &str, &str)> = vec![
        (
            "garbage",
            svc().cluster_ips(&["not-an-ip"], &["IPv4"]).build(),
            "spec.clusterIPs[0]",
            "not-an-ip",
        ),
        (
            "IPv6 in the IPv4 slot",
            svc().cluster_ips(&["fd00::1"], &["IPv4"]).build(),
            "spec.clusterIPs[0]",
            "fd00::1",
        ),
        (
            "garbage, no ipFamilies",
            svc()
                .cluster_ips(&["10.96.0.300"], &[])
                .spec(|s| s.ip_families = None)
                .build(),
            "spec.clusterIPs[0]",
            "10.96.0.300",
        ),
    ];
    for (name, s, field, value) in cases {
        let err = service_ports(&s, IpFamily::V4).expect_err(name);
        assert_eq!(
            err,
            ServiceError::InvalidClusterIp {
                field: field.into(),
                value: value.into(),
                family: IpFamily::V4,
            },
            "{name}"
        );
        assert!(!err.is_skipped());
    }
    let err = service_ports(&svc().spec(|s| s.ports = None).build(), IpFamily::V4).unwrap_err();
    assert_eq!(
        err,
        ServiceError::NoUsablePorts {
            problems: vec!["spec.ports: no port".into()]
        }
    );
    let err = service_ports(
        &Service {
            metadata: ObjectMeta::default(),
            ..svc().build()
        },
        IpFamily::V4,
    )
    .unwrap_err();
    assert_eq!(err, ServiceError::MissingName);
}

#[test]
fn bad_entry_in_the_other_family_slot_is_a_warning() {
    let out = svc()
        .cluster_ips(&["10.96.0.1", "zzz"], &["IPv4", "IPv6"])
        .ports_ok();
    assert_eq!(out.ports[0].cluster_ips, vec![v4("10.96.0.1")]);
    assert_eq!(
        out.warnings,
        vec!["spec.clusterIPs[1]: \"zzz\" is not an IP address".to_owned()]
    );
}

/// `proxyutil.MapIPsByIPFamily`: wrong-family and unparsable entries dropped, the rest kept.
#[test]
fn external_ips_filtered_by_family() {
    let out = svc()
        .external_ips(&[
            "192.0.2.1",
            "2001:db8::1",
            "nonsense",
            "",
            " ",
            "192.000.002.010",
            "::ffff:192.0.2.3",
        ])
        .ports_ok();
    assert_eq!(
        out.ports[0].external_ips,
        vec![v4("192.0.2.1"), v4("192.0.2.10"), v4("192.0.2.3")]
    );
    assert_eq!(
        out.warnings,
        vec![
            "spec.externalIPs[1]: \"2001:db8::1\" is IPv6 but the Service has no IPv6 cluster IP; ignored",
            "spec.externalIPs[2]: \"nonsense\" is not an IP address; ignored",
        ]
    );
    // Dual-stack: the IPv6 external IP is the IPv6 proxy's business; no warning.
    let out = svc()
        .cluster_ips(&["10.96.0.1", "fd00::1"], &["IPv4", "IPv6"])
        .external_ips(&["192.0.2.1", "2001:db8::1"])
        .ports_ok();
    assert_eq!(out.ports[0].external_ips, vec![v4("192.0.2.1")]);
    assert!(out.warnings.is_empty(), "{:?}", out.warnings);
}

/// Regression: special addresses (which API validation rejects, but `--manifests` skips the
/// API server) were accepted; an external IP 127.0.0.1:22 would have let the socket programs
/// take over `ssh localhost`. Each is dropped with a warning naming its field; the rest of the
/// Service is kept.
#[test]
fn special_addresses_are_dropped_with_a_warning() {
    let special = [
        "0.0.0.0",
        "127.0.0.1",
        "127.1.2.3",
        "169.254.169.254",
        "224.0.0.1",
        "239.255.255.250",
        "255.255.255.255",
    ];
    let out = svc()
        .type_("LoadBalancer")
        .node_ports(&[30080])
        .external_ips(&[&["192.0.2.1"][..], &special[..]].concat())
        .ingress(
            &[("198.51.100.1", None)]
                .into_iter()
                .chain(special.iter().map(|ip| (*ip, None)))
                .collect::<Vec<_>>(),
        )
        .ports_ok();
    let p = &out.ports[0];
    assert_eq!(p.cluster_ips, vec![v4("10.96.0.1")]);
    assert_eq!(p.external_ips, vec![v4("192.0.2.1")]);
    assert_eq!(p.load_balancer_ips, vec![v4("198.51.100.1")]);
    assert_eq!(p.node_port, Some(30080));
    assert_eq!(out.warnings.len(), 2 * special.len(), "{:?}", out.warnings);
    assert_eq!(
        out.warnings[1],
        "spec.externalIPs[2]: \"127.0.0.1\" is in the loopback range (127.0.0.0/8), which a \
         Service may not use; ignored"
    );
    for (i, ip) in special.iter().enumerate() {
        assert!(
            out.warnings[i].starts_with(&format!("spec.externalIPs[{}]: \"{ip}\" is ", i + 1))
                && out.warnings[i].ends_with("; ignored"),
            "{}",
            out.warnings[i]
        );
        let lb = &out.warnings[special.len() + i];
        assert!(
            lb.starts_with(&format!(
                "status.loadBalancer.ingress[{}].ip: \"{ip}\" is ",
                i + 1
            )),
            "{lb}"
        );
    }

    // A special cluster IP: no cluster-IP frontend, the NodePort is still served.
    for ip in special {
        let out = svc()
            .type_("NodePort")
            .cluster_ips(&[ip], &["IPv4"])
            .node_ports(&[30080])
            .ports_ok();
        assert!(out.ports[0].cluster_ips.is_empty(), "{ip}");
        assert_eq!(out.ports[0].node_port, Some(30080));
        assert_eq!(out.warnings.len(), 1, "{:?}", out.warnings);
        assert!(
            out.warnings[0].starts_with(&format!("spec.clusterIPs[0]: \"{ip}\" is ")),
            "{}",
            out.warnings[0]
        );
    }
    // Without ipFamilies (a manifest), the field is the index of the IPv4 entry.
    let out = svc().cluster_ips(&["fd00::1", "0.0.0.0"], &[]).ports_ok();
    assert!(out.ports[0].cluster_ips.is_empty());
    assert_eq!(
        out.warnings,
        vec![
            "spec.clusterIPs[1]: \"0.0.0.0\" is unspecified (0.0.0.0), which a Service may not \
             use; ignored"
        ]
    );
    // Ordinary addresses next to the special ranges are fine.
    for ip in [
        "1.0.0.0",
        "126.255.255.255",
        "128.0.0.1",
        "169.253.0.1",
        "223.255.255.255",
        "240.0.0.1",
    ] {
        assert_eq!(special_address(v4(ip)), None, "{ip}");
    }
}

/// KEP-1860: ipMode Proxy is excluded, VIP and unset kept; hostname-only entries skipped.
#[test]
fn load_balancer_ips_by_ip_mode() {
    let out = svc()
        .type_("LoadBalancer")
        .node_ports(&[30080])
        .ingress(&[
            ("192.0.2.1", None),
            ("192.0.2.2", Some("VIP")),
            ("192.0.2.3", Some("Proxy")),
            ("", None),
            ("2001:db8::1", None),
            ("bad", Some("VIP")),
            ("192.0.2.4", Some("Magic")),
        ])
        .ports_ok();
    assert_eq!(
        out.ports[0].load_balancer_ips,
        vec![v4("192.0.2.1"), v4("192.0.2.2")]
    );
    assert_eq!(
        out.warnings,
        vec![
            "status.loadBalancer.ingress[4].ip: \"2001:db8::1\" is IPv6 but the Service has no IPv6 cluster IP; ignored",
            "status.loadBalancer.ingress[5].ip: \"bad\" is not an IP address; ignored",
            "status.loadBalancer.ingress[6].ipMode: unknown mode \"Magic\"; ingress ignored",
        ]
    );
    assert!(out.ports[0].externally_accessible());
}

/// `newBaseServiceInfo` + `MapCIDRsByIPFamily`: trimmed, bad ones ignored, IPv6 dropped,
/// zero CIDR means "allow any".
#[test]
fn load_balancer_source_ranges() {
    type Case = (
        &'static str,
        &'static [&'static str],
        &'static [&'static str],
        usize,
    );
    let cases: &[Case] = &[
        (
            "plain",
            &["10.0.0.0/8", "192.168.1.0/24"],
            &["10.0.0.0/8", "192.168.1.0/24"],
            0,
        ),
        (
            "whitespace padding trimmed",
            &[" 10.0.0.0/8 ", "\t192.168.1.0/24"],
            &["10.0.0.0/8", "192.168.1.0/24"],
            0,
        ),
        (
            "bad CIDRs ignored",
            &["10.0.0.0/8", "bogus", "10.0.0.0/33", "1.2.3.4"],
            &["10.0.0.0/8"],
            3,
        ),
        (
            "host bits cleared",
            &["10.1.2.3/8", "010.001.002.000/16"],
            &["10.0.0.0/8", "10.1.0.0/16"],
            0,
        ),
        (
            "IPv6 dropped silently",
            &["2001:db8::/32", "10.0.0.0/8"],
            &["10.0.0.0/8"],
            0,
        ),
        ("zero CIDR allows any", &["10.0.0.0/8", "0.0.0.0/0"], &[], 0),
        (
            "IPv6 zero CIDR does not",
            &["10.0.0.0/8", "::/0"],
            &["10.0.0.0/8"],
            0,
        ),
        ("blank entries silently ignored", &["", "  "], &[], 0),
        ("nothing usable: allow any, with a warning", &["bogus"], &[], 2),
        (
            "only IPv6: allow any IPv4, with a warning",
            &["2001:db8::/32"],
            &[],
            1,
        ),
    ];
    for (name, input, want, n_warnings) in cases {
        let out = svc()
            .type_("LoadBalancer")
            .node_ports(&[30080])
            .source_ranges(input)
            .ports_ok();
        let want: Vec<IpNet> = want.iter().map(|s| net(s)).collect();
        assert_eq!(out.ports[0].load_balancer_source_ranges, want, "{name}");
        assert_eq!(out.warnings.len(), *n_warnings, "{name}: {:?}", out.warnings);
    }
}

#[test]
fn session_affinity() {
    let cases: Vec<(&str, SvcBuilder, Option<u32>, usize)> = vec![
        ("none", svc(), None, 0),
        ("None", svc().affinity("None", None), None, 0),
        (
            "ClientIP, default timeout",
            svc().affinity("ClientIP", None),
            Some(10800),
            0,
        ),
        (
            "ClientIP, explicit timeout",
            svc().affinity("ClientIP", Some(60)),
            Some(60),
            0,
        ),
        (
            "ClientIP, max timeout",
            svc().affinity("ClientIP", Some(86400)),
            Some(86400),
            0,
        ),
        (
            "ClientIP, zero timeout",
            svc().affinity("ClientIP", Some(0)),
            Some(10800),
            1,
        ),
        (
            "ClientIP, negative timeout",
            svc().affinity("ClientIP", Some(-5)),
            Some(10800),
            1,
        ),
        (
            "ClientIP, too long",
            svc().affinity("ClientIP", Some(86401)),
            Some(10800),
            1,
        ),
        ("unknown affinity", svc().affinity("Cookie", None), None, 1),
    ];
    for (name, b, want, n_warnings) in cases {
        let out = b.ports_ok();
        assert_eq!(out.ports[0].session_affinity_timeout, want, "{name}");
        assert_eq!(out.warnings.len(), n_warnings, "{name}: {:?}", out.warnings);
    }
}

/// `apiservice.ExternalPolicyLocal` / `InternalPolicyLocal` / `NeedsHealthCheck`.
#[test]
fn traffic_policies_and_health_check() {
    struct Case {
        name: &'static str,
        svc: SvcBuilder,
        etp_local: bool,
        itp_local: bool,
        hc: Option<u16>,
        n_warnings: usize,
    }
    let lb = || svc().type_("LoadBalancer").node_ports(&[30080]);
    let cases = vec![
        Case {
            name: "defaults",
            svc: svc(),
            etp_local: false,
            itp_local: false,
            hc: None,
            n_warnings: 0,
        },
        Case {
            name: "ITP Local",
            svc: svc().itp("Local"),
            etp_local: false,
            itp_local: true,
            hc: None,
            n_warnings: 0,
        },
        Case {
            name: "ITP Cluster",
            svc: svc().itp("Cluster"),
            etp_local: false,
            itp_local: false,
            hc: None,
            n_warnings: 0,
        },
        Case {
            name: "ETP Local on ClusterIP: not externally accessible",
            svc: svc().etp("Local"),
            etp_local: false,
            itp_local: false,
            hc: None,
            n_warnings: 0,
        },
        Case {
            name: "ETP Local on ClusterIP with externalIPs",
            svc: svc().etp("Local").external_ips(&["192.0.2.1"]),
            etp_local: true,
            itp_local: false,
            hc: None,
            n_warnings: 0,
        },
        Case {
            name: "ETP Local on NodePort: no health check",
            svc: svc()
                .type_("NodePort")
                .node_ports(&[30080])
                .etp("Local")
                .health_check_node_port(31000),
            etp_local: true,
            itp_local: false,
            hc: None,
            n_warnings: 0,
        },
        Case {
            name: "ETP Local on LoadBalancer",
            svc: lb().etp("Local").health_check_node_port(31000),
            etp_local: true,
            itp_local: false,
            hc: Some(31000),
            n_warnings: 0,
        },
        Case {
            name: "ETP Local on LoadBalancer, no healthCheckNodePort",
            svc: lb().etp("Local"),
            etp_local: true,
            itp_local: false,
            hc: None,
            n_warnings: 1,
        },
        Case {
            name: "ETP Local on LoadBalancer, bad healthCheckNodePort",
            svc: lb().etp("Local").health_check_node_port(70000),
            etp_local: true,
            itp_local: false,
            hc: None,
            n_warnings: 1,
        },
        Case {
            name: "ETP Cluster on LoadBalancer",
            svc: lb().etp("Cluster").health_check_node_port(31000),
            etp_local: false,
            itp_local: false,
            hc: None,
            n_warnings: 0,
        },
        Case {
            name: "both Local",
            svc: lb().etp("Local").itp("Local").health_check_node_port(31000),
            etp_local: true,
            itp_local: true,
            hc: Some(31000),
            n_warnings: 0,
        },
    ];
    for c in cases {
        let out = c.svc.ports_ok();
        let p = &out.ports[0];
        assert_eq!(p.external_policy_local, c.etp_local, "{}", c.name);
        assert_eq!(p.internal_policy_local, c.itp_local, "{}", c.name);
        assert_eq!(p.health_check_node_port, c.hc, "{}", c.name);
        assert_eq!(out.warnings.len(), c.n_warnings, "{}: {:?}", c.name, out.warnings);
    }
}

/// A bad port is dropped and reported; the good ones are kept.
#[test]
fn bad_ports_dropped_good_ones_kept() {
    let out = svc()
        .type_("NodePort")
        .ports(vec![
            port("zero", 0, "TCP"),
            port("big", 70000, "TCP"),
            port("http", 80, "TCP"),
            port("http-again", 80, "TCP"),
            port("http", 81, "TCP"),
            port("http", 80, "UDP"),
            port("icmp", 7, "ICMP"),
            port("https", 443, "TCP"),
            port("metrics", 9090, "TCP"),
        ])
        .node_ports(&[0, 0, 30080, 30081, 30082, 30083, 0, 70000, -1])
        .ports_ok();
    let got: Vec<_> = out
        .ports
        .iter()
        .map(|p| (p.name.port.as_str(), p.port, p.name.protocol, p.node_port))
        .collect();
    assert_eq!(
        got,
        vec![
            ("http", 80, Protocol::Tcp, Some(30080)),
            ("http", 80, Protocol::Udp, Some(30083)),
            ("https", 443, Protocol::Tcp, None),
            ("metrics", 9090, Protocol::Tcp, None),
        ]
    );
    assert_eq!(
        out.warnings,
        vec![
            "spec.ports[0].port: 0 is not a port number; port ignored",
            "spec.ports[1].port: 70000 is not a port number; port ignored",
            "spec.ports[3]: duplicate port 80/TCP; ignored",
            "spec.ports[4]: duplicate port ns1/svc1:http (TCP); ignored",
            "spec.ports[6].protocol: unsupported protocol \"ICMP\"; port ignored",
            "spec.ports[7].nodePort: 70000 is not a port number; ignored",
            "spec.ports[8].nodePort: -1 is not a port number; ignored",
        ]
    );
}

#[test]
fn no_usable_port_is_an_error() {
    let err = service_ports(
        &svc()
            .ports(vec![port("a", 0, "TCP"), port("b", 80, "ICMP")])
            .build(),
        IpFamily::V4,
    )
    .unwrap_err();
    assert_eq!(
        err,
        ServiceError::NoUsablePorts {
            problems: vec![
                "spec.ports[0].port: 0 is not a port number; port ignored".into(),
                "spec.ports[1].protocol: unsupported protocol \"ICMP\"; port ignored".into(),
            ]
        }
    );
    assert!(!err.is_skipped());
    assert!(err.to_string().starts_with("no usable port: spec.ports[0].port"));
}

#[test]
fn node_ports() {
    let p = svc().type_("NodePort").node_ports(&[30080]).one();
    assert_eq!(p.node_port, Some(30080));
    assert!(p.externally_accessible());
    // allocateLoadBalancerNodePorts: false
    let p = svc().type_("LoadBalancer").node_ports(&[0]).one();
    assert_eq!(p.node_port, None);
    // Kept as kube-proxy does, but reported: the API server rejects it.
    let out = svc().node_ports(&[30080]).ports_ok();
    assert_eq!(out.ports[0].node_port, Some(30080));
    assert_eq!(out.warnings.len(), 1);
}

#[test]
fn traffic_distribution_and_topology_annotations() {
    let p = svc()
        .spec(|s| s.traffic_distribution = Some("PreferSameNode".into()))
        .one();
    assert_eq!(p.traffic_distribution.as_deref(), Some("PreferSameNode"));
    assert_eq!(p.topology_mode, None);
    let p = svc().annotation(ANNOTATION_TOPOLOGY_MODE, "Auto").one();
    assert_eq!(p.topology_mode.as_deref(), Some("Auto"));
    let p = svc().annotation(ANNOTATION_TOPOLOGY_AWARE_HINTS, "auto").one();
    assert_eq!(p.topology_mode.as_deref(), Some("auto"));
    // The deprecated annotation wins, as in kube-proxy and the EndpointSlice controller.
    let p = svc()
        .annotation(ANNOTATION_TOPOLOGY_MODE, "Auto")
        .annotation(ANNOTATION_TOPOLOGY_AWARE_HINTS, "Disabled")
        .one();
    assert_eq!(p.topology_mode.as_deref(), Some("Disabled"));
}

/// Issue 17: the algorithm annotation, ours or Cilium's (ours wins); an unknown value is reported
/// and leaves the node's setting.
#[test]
fn lb_algorithm_annotation() {
    assert_eq!(svc().one().lb_algorithm, None);
    let p = svc().annotation(ANNOTATION_LB_ALGORITHM, "maglev").one();
    assert_eq!(p.lb_algorithm, Some(LbAlgorithm::Maglev));
    let p = svc().annotation(ANNOTATION_LB_ALGORITHM_CILIUM, "maglev").one();
    assert_eq!(p.lb_algorithm, Some(LbAlgorithm::Maglev));
    let p = svc()
        .annotation(ANNOTATION_LB_ALGORITHM_CILIUM, "maglev")
        .annotation(ANNOTATION_LB_ALGORITHM, "random")
        .one();
    assert_eq!(p.lb_algorithm, Some(LbAlgorithm::Random));
    let out = svc().annotation(ANNOTATION_LB_ALGORITHM, "Maglev").ports_ok();
    assert_eq!(out.ports[0].lb_algorithm, None);
    assert_eq!(out.warnings.len(), 1, "{:?}", out.warnings);
    assert!(
        out.warnings[0].contains("lb-agent.io/lb-algorithm"),
        "{:?}",
        out.warnings
    );
}

#[test]
fn every_port_shares_the_service_fields() {
    let out = svc()
        .type_("LoadBalancer")
        .ports(vec![port("a", 80, "TCP"), port("b", 443, "TCP")])
        .node_ports(&[30080, 30443])
        .external_ips(&["192.0.2.9"])
        .ingress(&[("192.0.2.1", None)])
        .affinity("ClientIP", Some(30))
        .ports_ok();
    for p in &out.ports {
        assert_eq!(p.external_ips, vec![v4("192.0.2.9")]);
        assert_eq!(p.load_balancer_ips, vec![v4("192.0.2.1")]);
        assert_eq!(p.session_affinity_timeout, Some(30));
    }
    assert_eq!(out.ports[1].node_port, Some(30443));
}

#[test]
fn sloppy_parsing() {
    let cases: &[(&str, Option<&str>)] = &[
        ("10.0.0.1", Some("10.0.0.1")),
        ("010.000.000.001", Some("10.0.0.1")),
        ("0000000010.0.0.1", Some("10.0.0.1")),
        ("256.0.0.1", None),
        ("10.0.0", None),
        ("10.0.0.1.", None),
        ("10.0.0.-1", None),
        ("+10.0.0.1", None),
        (" 10.0.0.1", None),
        ("::ffff:10.0.0.1", Some("10.0.0.1")),
        ("fd00::1", Some("fd00::1")),
        ("", None),
    ];
    for (input, want) in cases {
        let got = parse_ip_sloppy(input).map(|ip| ip.to_string());
        assert_eq!(got.as_deref(), *want, "{input:?}");
    }
}

#[test]
fn pruning_by_the_watch_keeps_everything_the_model_reads() {
    let mut svc = Service {
        metadata: ObjectMeta {
            name: Some("web".into()),
            namespace: Some("shop".into()),
            uid: Some("u-1".into()),
            resource_version: Some("42".into()),
            annotations: Some(BTreeMap::from([
                (ANNOTATION_TOPOLOGY_MODE.into(), "Auto".into()),
                (ANNOTATION_LB_ALGORITHM.into(), "maglev".into()),
                (
                    "kubectl.kubernetes.io/last-applied-configuration".into(),
                    "{...}".into(),
                ),
            ])),
            managed_fields: Some(vec![Default::default()]),
            owner_references: Some(vec![]),
            generation: Some(3),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some("10.96.0.10".into()),
            cluster_ips: Some(vec!["10.96.0.10".into()]),
            ports: Some(vec![k8s_openapi::api::core::v1::ServicePort {
                name: Some("http".into()),
                port: 80,
                ..Default::default()
            }]),
            type_: Some("LoadBalancer".into()),
            selector: Some(BTreeMap::from([("app".into(), "web".into())])),
            ..Default::default()
        }),
        status: Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(vec![LoadBalancerIngress {
                    ip: Some("192.0.2.1".into()),
                    ..Default::default()
                }]),
            }),
            conditions: Some(vec![]),
        }),
    };
    let before = service_ports(&svc, IpFamily::V4).unwrap();
    crate::watch::prune::service(&mut svc);
    assert_eq!(service_ports(&svc, IpFamily::V4).unwrap(), before);
    let m = &svc.metadata;
    assert_eq!(m.managed_fields, None);
    assert_eq!(m.owner_references, None);
    assert_eq!(m.generation, None);
    assert_eq!(
        m.annotations,
        Some(BTreeMap::from([
            (ANNOTATION_TOPOLOGY_MODE.into(), "Auto".into()),
            (ANNOTATION_LB_ALGORITHM.into(), "maglev".into())
        ]))
    );
    assert_eq!(
        (m.uid.as_deref(), m.resource_version.as_deref()),
        (Some("u-1"), Some("42"))
    );
    assert_eq!(svc.spec.as_ref().unwrap().selector, None);
    let status = svc.status.unwrap();
    assert!(status.load_balancer.is_some() && status.conditions.is_none());
}

/// kube-proxy runs one proxier per family, each with the Service's cluster IP of its family
/// (`GetClusterIPByFamily`): a dual-stack Service has the same ports in both, whichever family is
/// primary.
#[test]
fn a_dual_stack_service_has_ports_in_both_families() {
    for families in [["IPv4", "IPv6"], ["IPv6", "IPv4"]] {
        let ips = if families[0] == "IPv4" {
            ["10.96.0.7", "fd00:10:96::7"]
        } else {
            ["fd00:10:96::7", "10.96.0.7"]
        };
        let b = svc()
            .type_("NodePort")
            .cluster_ips(&ips, &families)
            .ports(vec![port("http", 80, "TCP"), port("dns", 53, "UDP")])
            .node_ports(&[30080, 30053]);
        let out4 = b.ports_in(IpFamily::V4);
        let out6 = b.ports_in(IpFamily::V6);
        assert!(
            out4.warnings.is_empty() && out6.warnings.is_empty(),
            "{out4:?} {out6:?}"
        );
        for (out, family, cluster_ip) in [
            (&out4, IpFamily::V4, v4("10.96.0.7")),
            (&out6, IpFamily::V6, v6("fd00:10:96::7")),
        ] {
            let got: Vec<_> = out
                .ports
                .iter()
                .map(|p| {
                    (
                        p.name.clone(),
                        p.family,
                        p.cluster_ips.clone(),
                        p.port,
                        p.node_port,
                    )
                })
                .collect();
            assert_eq!(
                got,
                vec![
                    (
                        spn("http", Protocol::Tcp),
                        family,
                        vec![cluster_ip],
                        80,
                        Some(30080)
                    ),
                    (
                        spn("dns", Protocol::Udp),
                        family,
                        vec![cluster_ip],
                        53,
                        Some(30053)
                    ),
                ],
                "{families:?}"
            );
        }
    }
}

/// A single-stack Service belongs to the proxier of its family only; without `ipFamilies`
/// (version skew, a manifest) the family is the cluster IP's.
#[test]
fn a_single_stack_service_is_its_familys_only() {
    let cases: Vec<(&str, SvcBuilder)> = vec![
        ("ipFamilies", svc().cluster_ips(&["fd00::1"], &["IPv6"])),
        (
            "no ipFamilies",
            svc()
                .cluster_ips(&["fd00::1"], &[])
                .spec(|s| s.ip_families = None),
        ),
        (
            "only spec.clusterIP",
            svc().spec(|s| {
                (s.cluster_ip, s.cluster_ips, s.ip_families) = (Some("fd00::1".into()), None, None)
            }),
        ),
    ];
    for (name, b) in cases {
        let s = b.build();
        assert_eq!(
            service_ports(&s, IpFamily::V4),
            Err(ServiceError::Skipped("no cluster IP of the family")),
            "{name}"
        );
        let out = service_ports(&s, IpFamily::V6).expect(name);
        assert_eq!(out.ports[0].cluster_ips, vec![v6("fd00::1")], "{name}");
        assert_eq!(out.ports[0].family, IpFamily::V6, "{name}");
    }
    assert_eq!(
        service_ports(&svc().build(), IpFamily::V6),
        Err(ServiceError::Skipped("no cluster IP of the family"))
    );
    // Headless and ExternalName Services are skipped by every proxier.
    for s in [
        svc().cluster_ips(&["None"], &["IPv4", "IPv6"]).build(),
        svc()
            .type_("ExternalName")
            .cluster_ips(&["fd00::1"], &["IPv6"])
            .build(),
    ] {
        for family in IpFamily::ALL {
            assert!(service_ports(&s, family).unwrap_err().is_skipped(), "{family}");
        }
    }
}

/// The cluster IP in the family's slot must be of the family; a bad one refuses the Service in
/// that family only.
#[test]
fn an_invalid_cluster_ip_refuses_its_family_only() {
    let cases: Vec<(&str, SvcBuilder, &str)> = vec![
        (
            "IPv4 in the IPv6 slot",
            svc().cluster_ips(&["10.96.0.1", "10.96.0.2"], &["IPv4", "IPv6"]),
            "10.96.0.2",
        ),
        (
            "garbage in the IPv6 slot",
            svc().cluster_ips(&["10.96.0.1", "zzz"], &["IPv4", "IPv6"]),
            "zzz",
        ),
        (
            // ParseIPSloppy: an IPv4-mapped address is IPv4.
            "IPv4-mapped in the IPv6 slot",
            svc().cluster_ips(&["10.96.0.1", "::ffff:10.96.0.2"], &["IPv4", "IPv6"]),
            "::ffff:10.96.0.2",
        ),
    ];
    for (name, b, value) in cases {
        assert_eq!(
            service_ports(&b.0, IpFamily::V6),
            Err(ServiceError::InvalidClusterIp {
                field: "spec.clusterIPs[1]".into(),
                value: value.into(),
                family: IpFamily::V6,
            }),
            "{name}"
        );
        assert_eq!(b.ports_ok().ports[0].cluster_ips, vec![v4("10.96.0.1")], "{name}");
    }
    let err = service_ports(
        &svc().cluster_ips(&["10.96.0.1"], &["IPv6"]).build(),
        IpFamily::V6,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "spec.clusterIPs[0]: \"10.96.0.1\" is not a valid IPv6 address"
    );
    // Without ipFamilies an unparsable entry is the IPv4 proxier's nil IP, not the IPv6 one's.
    let s = svc()
        .cluster_ips(&["10.96.0.300"], &[])
        .spec(|s| s.ip_families = None)
        .build();
    assert!(service_ports(&s, IpFamily::V6).unwrap_err().is_skipped());
}

/// `MapIPsByIPFamily` and `newBaseServiceInfo`'s ingress loop: each proxier takes the external
/// and load-balancer IPs of its family; the other family's are that proxier's, silently.
#[test]
fn external_and_load_balancer_ips_are_split_by_family() {
    let b = svc()
        .type_("LoadBalancer")
        .cluster_ips(&["10.96.0.1", "fd00::1"], &["IPv4", "IPv6"])
        .node_ports(&[30080])
        .external_ips(&["192.0.2.1", "2001:db8::1", "::ffff:192.0.2.3", "2001:DB8::2"])
        .ingress(&[
            ("203.0.113.1", None),
            ("2001:db8:ff::1", None),
            ("2001:db8:ff::2", Some("Proxy")),
            ("2001:db8:ff::3", Some("VIP")),
        ]);
    let out4 = b.ports_in(IpFamily::V4);
    let out6 = b.ports_in(IpFamily::V6);
    assert!(out4.warnings.is_empty(), "{:?}", out4.warnings);
    assert!(out6.warnings.is_empty(), "{:?}", out6.warnings);
    assert_eq!(out4.ports[0].external_ips, vec![v4("192.0.2.1"), v4("192.0.2.3")]);
    assert_eq!(
        out6.ports[0].external_ips,
        vec![v6("2001:db8::1"), v6("2001:db8::2")]
    );
    assert_eq!(out4.ports[0].load_balancer_ips, vec![v4("203.0.113.1")]);
    assert_eq!(
        out6.ports[0].load_balancer_ips,
        vec![v6("2001:db8:ff::1"), v6("2001:db8:ff::3")]
    );
    // A single-stack IPv6 Service: its IPv4 addresses have no proxier at all, which is reported.
    let out = svc()
        .type_("LoadBalancer")
        .cluster_ips(&["fd00::1"], &["IPv6"])
        .node_ports(&[30080])
        .external_ips(&["192.0.2.1", "2001:db8::1"])
        .ingress(&[("203.0.113.1", None), ("2001:db8:ff::1", None)])
        .ports_in(IpFamily::V6);
    assert_eq!(out.ports[0].external_ips, vec![v6("2001:db8::1")]);
    assert_eq!(out.ports[0].load_balancer_ips, vec![v6("2001:db8:ff::1")]);
    assert_eq!(
        out.warnings,
        vec![
            "spec.externalIPs[0]: \"192.0.2.1\" is IPv4 but the Service has no IPv4 cluster IP; ignored",
            "status.loadBalancer.ingress[0].ip: \"203.0.113.1\" is IPv4 but the Service has no IPv4 cluster IP; ignored",
        ]
    );
}

/// `MapCIDRsByIPFamily`: each proxier takes the ranges of its family; a family with none allows
/// every client of it, and a zero-length prefix empties its own family's list only.
#[test]
fn load_balancer_source_ranges_are_split_by_family() {
    type Case = (
        &'static str,
        &'static [&'static str],
        &'static [&'static str],
        &'static [&'static str],
    );
    let cases: &[Case] = &[
        (
            "both families",
            &["10.0.0.0/8", "2001:db8::/32", " fd00::1/64 "],
            &["10.0.0.0/8"],
            &["2001:db8::/32", "fd00::/64"],
        ),
        (
            "IPv6 ::/0 allows any IPv6 client",
            &["10.0.0.0/8", "2001:db8::/32", "::/0"],
            &["10.0.0.0/8"],
            &[],
        ),
        (
            "IPv4 0.0.0.0/0 allows any IPv4 client",
            &["0.0.0.0/0", "2001:db8::/32"],
            &[],
            &["2001:db8::/32"],
        ),
        (
            "IPv4 only: every IPv6 client",
            &["10.0.0.0/8"],
            &["10.0.0.0/8"],
            &[],
        ),
        // Go's ParseCIDR: an IPv4-mapped prefix is IPv4.
        ("IPv4-mapped", &["::ffff:10.0.0.0/104"], &["10.0.0.0/8"], &[]),
    ];
    for (name, ranges, want4, want6) in cases {
        let b = svc()
            .type_("LoadBalancer")
            .cluster_ips(&["10.96.0.1", "fd00::1"], &["IPv4", "IPv6"])
            .node_ports(&[30080])
            .source_ranges(ranges);
        for (family, want) in [(IpFamily::V4, want4), (IpFamily::V6, want6)] {
            let got = b.ports_in(family).ports[0].load_balancer_source_ranges.clone();
            let want: Vec<IpNet> = want.iter().map(|s| net(s)).collect();
            assert_eq!(got, want, "{name}: {family}");
        }
    }
    let out = svc()
        .cluster_ips(&["10.96.0.1", "fd00::1"], &["IPv4", "IPv6"])
        .source_ranges(&["10.0.0.0/8"])
        .ports_in(IpFamily::V6);
    assert_eq!(
        out.warnings,
        vec!["spec.loadBalancerSourceRanges: no usable IPv6 range, so every IPv6 client is allowed"]
    );
}

/// IPv6's special addresses are dropped from every field as IPv4's are.
#[test]
fn special_ipv6_addresses_are_dropped_with_a_warning() {
    let special = ["::", "::1", "fe80::1", "ff02::1", "ff05::2"];
    let out = svc()
        .type_("LoadBalancer")
        .cluster_ips(&["fd00::1"], &["IPv6"])
        .node_ports(&[30080])
        .external_ips(&[&["2001:db8::1"][..], &special[..]].concat())
        .ingress(
            &[("2001:db8:ff::1", None)]
                .into_iter()
                .chain(special.iter().map(|ip| (*ip, None)))
                .collect::<Vec<_>>(),
        )
        .ports_in(IpFamily::V6);
    let p = &out.ports[0];
    assert_eq!(p.external_ips, vec![v6("2001:db8::1")]);
    assert_eq!(p.load_balancer_ips, vec![v6("2001:db8:ff::1")]);
    assert_eq!(out.warnings.len(), 2 * special.len(), "{:?}", out.warnings);
    assert_eq!(
        out.warnings[1],
        "spec.externalIPs[2]: \"::1\" is the loopback address (::1), which a Service may not use; ignored"
    );
    for ip in special {
        let out = svc()
            .type_("NodePort")
            .cluster_ips(&[ip], &["IPv6"])
            .node_ports(&[30080])
            .ports_in(IpFamily::V6);
        assert!(out.ports[0].cluster_ips.is_empty(), "{ip}");
        assert_eq!(out.ports[0].node_port, Some(30080));
        assert_eq!(out.warnings.len(), 1, "{:?}", out.warnings);
        assert!(special_address(v6(ip)).is_some(), "{ip}");
    }
    for ip in ["2001:db8::1", "fd00::1", "fec0::1", "64:ff9b::a00:1"] {
        assert_eq!(special_address(v6(ip)), None, "{ip}");
    }
}
