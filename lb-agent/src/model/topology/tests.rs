use super::*;
use crate::model::test_support::service_port;

/// An endpoint builder: `ep("10.1.2.3:80")` is ready, serving, not terminating, remote, with no
/// hints (upstream `BaseEndpointInfo{ready: true}` / `makeTestEndpointInfo`).
fn ep(addr: &str) -> Endpoint {
    let (ip, port) = addr.split_once(':').unwrap();
    Endpoint {
        ip: ip.parse().unwrap(),
        port: port.parse().unwrap(),
        ready: true,
        serving: true,
        terminating: false,
        is_local: false,
        node_name: None,
        zone: None,
        zone_hints: BTreeSet::new(),
        node_hints: BTreeSet::new(),
    }
}

trait EpExt {
    fn zones(self, zones: &[&str]) -> Self;
    fn nodes(self, nodes: &[&str]) -> Self;
    fn local(self) -> Self;
    /// `ready: false` (and so, as upstream's `BaseEndpointInfo{ready: false}`, not serving).
    fn unready(self) -> Self;
    /// ready false, serving true, terminating true.
    fn serving_terminating(self) -> Self;
    /// ready false, serving false, terminating true.
    fn terminating_not_serving(self) -> Self;
}

impl EpExt for Endpoint {
    fn zones(mut self, zones: &[&str]) -> Self {
        self.zone_hints = zones.iter().map(|z| (*z).to_owned()).collect();
        self
    }
    fn nodes(mut self, nodes: &[&str]) -> Self {
        self.node_hints = nodes.iter().map(|n| (*n).to_owned()).collect();
        self
    }
    fn local(mut self) -> Self {
        self.is_local = true;
        self
    }
    fn unready(mut self) -> Self {
        (self.ready, self.serving, self.terminating) = (false, false, false);
        self
    }
    fn serving_terminating(mut self) -> Self {
        (self.ready, self.serving, self.terminating) = (false, true, true);
        self
    }
    fn terminating_not_serving(mut self) -> Self {
        (self.ready, self.serving, self.terminating) = (false, false, true);
        self
    }
}

/// A service-port builder: `svc()` is a ClusterIP-only port (upstream `&BaseServicePortInfo{}`).
fn svc() -> ServicePortInfo {
    service_port("ns", "svc", "", "10.96.0.1")
}

trait SvcExt {
    fn itp_local(self) -> Self;
    fn etp_local(self) -> Self;
    fn node_port(self, p: u16) -> Self;
}

impl SvcExt for ServicePortInfo {
    fn itp_local(mut self) -> Self {
        self.internal_policy_local = true;
        self
    }
    fn etp_local(mut self) -> Self {
        self.external_policy_local = true;
        self
    }
    fn node_port(mut self, p: u16) -> Self {
        self.node_port = Some(p);
        self
    }
}

type Set = Option<&'static [&'static str]>;

/// One row of upstream `TestCategorizeEndpoints`. `cluster`/`local`: `None` means "the service
/// doesn't use this kind of endpoints" (upstream nil), checked as empty here. `all`: `None`
/// derives it as upstream does (the one set that is `Some`). `only_remote`: `has_any` despite an
/// empty `all_reachable`.
struct Case {
    name: &'static str,
    node_name: &'static str,
    zone: Option<&'static str>,
    svc: ServicePortInfo,
    endpoints: Vec<Endpoint>,
    cluster: Set,
    local: Set,
    all: Set,
    only_remote: bool,
}

impl Default for Case {
    fn default() -> Self {
        Case {
            name: "",
            node_name: "",
            zone: Some("zone-a"),
            svc: svc(),
            endpoints: vec![],
            cluster: None,
            local: None,
            all: None,
            only_remote: false,
        }
    }
}

fn addrs(eps: &[Endpoint]) -> BTreeSet<String> {
    eps.iter().map(|e| format!("{}:{}", e.ip, e.port)).collect()
}

fn set(s: Set) -> BTreeSet<String> {
    s.unwrap_or_default().iter().map(|a| (*a).to_owned()).collect()
}

fn run(cases: Vec<Case>) {
    for c in cases {
        let node = NodeInfo {
            name: c.node_name.into(),
            zone: c.zone.map(str::to_owned),
        };
        let got = categorize_endpoints(&c.endpoints, &c.svc, &node);
        assert_eq!(addrs(&got.cluster), set(c.cluster), "{}: cluster", c.name);
        assert_eq!(addrs(&got.local), set(c.local), "{}: local", c.name);
        let all = match (c.cluster, c.local) {
            (Some(_), None) => c.cluster,
            (None, Some(_)) => c.local,
            _ => c.all,
        };
        assert_eq!(addrs(&got.all_reachable), set(all), "{}: all_reachable", c.name);
        let want_has_any = !set(all).is_empty() || c.only_remote;
        assert_eq!(got.has_any, want_has_any, "{}: has_any", c.name);
        // Upstream nil lists: the service doesn't use this kind of endpoints.
        if c.cluster.is_none() {
            assert!(
                !c.svc.uses_cluster_endpoints() || c.endpoints.is_empty(),
                "{}",
                c.name
            );
        }
        if c.local.is_none() {
            assert!(
                !c.svc.uses_local_endpoints() || c.endpoints.is_empty(),
                "{}",
                c.name
            );
        }
        // all_reachable keeps the input order.
        let positions: Vec<_> = got
            .all_reachable
            .iter()
            .map(|e| c.endpoints.iter().position(|x| x == e).expect("from the input"))
            .collect();
        assert!(positions.is_sorted(), "{}: order", c.name);
    }
}

const ABCA: [&str; 4] = ["zone-a", "zone-b", "zone-c", "zone-a"];

fn four_zoned(zones: [&str; 4]) -> Vec<Endpoint> {
    (3..=6)
        .zip(zones)
        .map(|(i, z)| ep(&format!("10.1.2.{i}:80")).zones(&[z]))
        .collect()
}

/// Upstream `TestCategorizeEndpoints` (pkg/proxy/topology_test.go), case names kept. The
/// PreferSameNode cases are the ones added with `PreferSameTrafficDistribution` (as in the
/// copy vendored by Antrea); upstream's "feature gate disabled" case is left out, the gate
/// being locked on since v1.35.
#[test]
fn upstream_categorize_endpoints() {
    run(vec![
        Case {
            name: "should use topology since all endpoints have hints, node has a zone label and and there are endpoints for the node's zone",
            endpoints: four_zoned(ABCA),
            cluster: Some(&["10.1.2.3:80", "10.1.2.6:80"]),
            ..Default::default()
        },
        Case {
            name: "externalTrafficPolicy: Local, topology ignored for Local endpoints",
            svc: svc().etp_local().node_port(8080),
            endpoints: vec![
                ep("10.1.2.3:80").zones(&["zone-a"]).local(),
                ep("10.1.2.4:80").zones(&["zone-b"]).local(),
                ep("10.1.2.5:80").zones(&["zone-c"]),
                ep("10.1.2.6:80").zones(&["zone-a"]),
            ],
            cluster: Some(&["10.1.2.3:80", "10.1.2.6:80"]),
            local: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
            all: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"]),
            ..Default::default()
        },
        Case {
            name: "internalTrafficPolicy: Local, topology ignored for Local endpoints",
            svc: svc().itp_local().node_port(8080),
            endpoints: vec![
                ep("10.1.2.3:80").zones(&["zone-a"]).local(),
                ep("10.1.2.4:80").zones(&["zone-b"]).local(),
                ep("10.1.2.5:80").zones(&["zone-c"]),
                ep("10.1.2.6:80").zones(&["zone-a"]),
            ],
            cluster: Some(&["10.1.2.3:80", "10.1.2.6:80"]),
            local: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
            all: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"]),
            ..Default::default()
        },
        Case {
            name: "empty node labels",
            zone: None,
            endpoints: vec![ep("10.1.2.3:80").zones(&["zone-a"])],
            cluster: Some(&["10.1.2.3:80"]),
            ..Default::default()
        },
        Case {
            name: "empty zone label",
            zone: Some(""),
            endpoints: vec![ep("10.1.2.3:80").zones(&["zone-a"])],
            cluster: Some(&["10.1.2.3:80"]),
            ..Default::default()
        },
        Case {
            name: "node in different zone, no endpoint filtering",
            zone: Some("zone-b"),
            endpoints: vec![ep("10.1.2.3:80").zones(&["zone-a"])],
            cluster: Some(&["10.1.2.3:80"]),
            ..Default::default()
        },
        Case {
            name: "unready endpoint",
            endpoints: {
                let mut e = four_zoned(ABCA);
                e[3] = e[3].clone().unready();
                e
            },
            cluster: Some(&["10.1.2.3:80"]),
            ..Default::default()
        },
        Case {
            name: "only unready endpoints in same zone (should not filter)",
            endpoints: {
                let mut e = four_zoned(ABCA);
                e[0] = e[0].clone().unready();
                e[3] = e[3].clone().unready();
                e
            },
            cluster: Some(&["10.1.2.4:80", "10.1.2.5:80"]),
            ..Default::default()
        },
        Case {
            name: "missing hints, no filtering applied",
            endpoints: {
                let mut e = four_zoned(ABCA);
                e[2] = e[2].clone().zones(&[]);
                e
            },
            cluster: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.5:80", "10.1.2.6:80"]),
            ..Default::default()
        },
        Case {
            name: "multiple hints per endpoint, filtering includes any endpoint with zone included",
            zone: Some("zone-c"),
            endpoints: vec![
                ep("10.1.2.3:80").zones(&["zone-a", "zone-b", "zone-c"]),
                ep("10.1.2.4:80").zones(&["zone-b", "zone-c"]),
                ep("10.1.2.5:80").zones(&["zone-b", "zone-d"]),
                ep("10.1.2.6:80").zones(&["zone-c"]),
            ],
            cluster: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"]),
            ..Default::default()
        },
        Case {
            name: "PreferSameNode available",
            node_name: "node-1",
            endpoints: vec![
                ep("10.1.2.3:80").zones(&["zone-a"]).nodes(&["node-1"]),
                ep("10.1.2.4:80").zones(&["zone-b"]).nodes(&["node-2"]),
                ep("10.1.2.5:80").zones(&["zone-c"]).nodes(&["node-3"]),
                ep("10.1.2.6:80").zones(&["zone-a"]).nodes(&["node-4"]),
            ],
            cluster: Some(&["10.1.2.3:80"]),
            ..Default::default()
        },
        Case {
            name: "PreferSameNode ignored if some endpoints unhinted",
            node_name: "node-1",
            endpoints: vec![
                ep("10.1.2.3:80").zones(&["zone-a"]).nodes(&["node-1"]),
                ep("10.1.2.4:80"),
                ep("10.1.2.5:80").zones(&["zone-c"]).nodes(&["node-3"]),
                ep("10.1.2.6:80").zones(&["zone-a"]).nodes(&["node-4"]),
            ],
            cluster: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.5:80", "10.1.2.6:80"]),
            ..Default::default()
        },
        Case {
            name: "PreferSameNode falls back to PreferSameZone if no endpoint for node",
            node_name: "node-0",
            endpoints: vec![
                ep("10.1.2.3:80").zones(&["zone-a"]).nodes(&["node-1"]),
                ep("10.1.2.4:80").zones(&["zone-b"]).nodes(&["node-2"]),
                ep("10.1.2.5:80").zones(&["zone-c"]).nodes(&["node-3"]),
                ep("10.1.2.6:80").zones(&["zone-a"]).nodes(&["node-4"]),
            ],
            cluster: Some(&["10.1.2.3:80", "10.1.2.6:80"]),
            ..Default::default()
        },
        Case {
            name: "conflicting topology and localness require merging allEndpoints",
            svc: svc().etp_local().node_port(8080),
            endpoints: vec![
                ep("10.0.0.0:80").zones(&["zone-a"]).local(),
                ep("10.0.0.1:80").zones(&["zone-b"]).local(),
                ep("10.0.0.2:80").zones(&["zone-a"]),
                ep("10.0.0.3:80").zones(&["zone-b"]),
            ],
            cluster: Some(&["10.0.0.0:80", "10.0.0.2:80"]),
            local: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            all: Some(&["10.0.0.0:80", "10.0.0.1:80", "10.0.0.2:80"]),
            ..Default::default()
        },
        Case {
            name: "internalTrafficPolicy: Local, with empty endpoints",
            svc: svc().itp_local(),
            local: Some(&[]),
            ..Default::default()
        },
        Case {
            name: "internalTrafficPolicy: Local, but all endpoints are remote",
            svc: svc().itp_local(),
            endpoints: vec![ep("10.0.0.0:80"), ep("10.0.0.1:80")],
            local: Some(&[]),
            only_remote: true,
            ..Default::default()
        },
        Case {
            name: "internalTrafficPolicy: Local, all endpoints are local",
            svc: svc().itp_local(),
            endpoints: vec![ep("10.0.0.0:80").local(), ep("10.0.0.1:80").local()],
            local: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "internalTrafficPolicy: Local, some endpoints are local",
            svc: svc().itp_local(),
            endpoints: vec![ep("10.0.0.0:80").local(), ep("10.0.0.1:80")],
            local: Some(&["10.0.0.0:80"]),
            ..Default::default()
        },
        Case {
            name: "Cluster traffic policy, endpoints not Ready",
            endpoints: vec![ep("10.0.0.0:80").unready(), ep("10.0.0.1:80").unready()],
            cluster: Some(&[]),
            ..Default::default()
        },
        Case {
            name: "Cluster traffic policy, some endpoints are Ready",
            endpoints: vec![ep("10.0.0.0:80").unready(), ep("10.0.0.1:80")],
            cluster: Some(&["10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "Cluster traffic policy, all endpoints are terminating",
            endpoints: vec![
                ep("10.0.0.0:80").serving_terminating().local(),
                ep("10.0.0.1:80").serving_terminating(),
            ],
            cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "iTP: Local, eTP: Cluster, some endpoints local",
            svc: svc().itp_local().node_port(8080),
            endpoints: vec![ep("10.0.0.0:80").local(), ep("10.0.0.1:80")],
            cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            local: Some(&["10.0.0.0:80"]),
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "iTP: Cluster, eTP: Local, some endpoints local",
            svc: svc().etp_local().node_port(8080),
            endpoints: vec![ep("10.0.0.0:80").local(), ep("10.0.0.1:80")],
            cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            local: Some(&["10.0.0.0:80"]),
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "iTP: Local, eTP: Local, some endpoints local",
            svc: svc().itp_local().etp_local().node_port(8080),
            endpoints: vec![ep("10.0.0.0:80").local(), ep("10.0.0.1:80")],
            cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            local: Some(&["10.0.0.0:80"]),
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "iTP: Local, eTP: Local, all endpoints remote",
            svc: svc().itp_local().etp_local().node_port(8080),
            endpoints: vec![ep("10.0.0.0:80"), ep("10.0.0.1:80")],
            cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            local: Some(&[]),
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "iTP: Local, eTP: Local, all endpoints remote and terminating",
            svc: svc().itp_local().etp_local().node_port(8080),
            endpoints: vec![
                ep("10.0.0.0:80").serving_terminating(),
                ep("10.0.0.1:80").serving_terminating(),
            ],
            cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            local: Some(&[]),
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            only_remote: true,
            ..Default::default()
        },
        Case {
            name: "iTP: Cluster, eTP: Local, with terminating endpoints",
            svc: svc().etp_local().node_port(8080),
            endpoints: vec![
                ep("10.0.0.0:80"),
                ep("10.0.0.1:80").unready().local(),
                ep("10.0.0.2:80").serving_terminating().local(),
                ep("10.0.0.3:80").serving_terminating(),
            ],
            cluster: Some(&["10.0.0.0:80"]),
            local: Some(&["10.0.0.2:80"]),
            all: Some(&["10.0.0.0:80", "10.0.0.2:80"]),
            ..Default::default()
        },
        Case {
            name: "externalTrafficPolicy ignored if not externally accessible",
            svc: svc().etp_local(),
            endpoints: vec![ep("10.0.0.0:80"), ep("10.0.0.1:80").local()],
            cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "no cluster endpoints for iTP:Local internal-only service",
            svc: svc().itp_local(),
            endpoints: vec![ep("10.0.0.0:80"), ep("10.0.0.1:80").local()],
            local: Some(&["10.0.0.1:80"]),
            all: Some(&["10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "externalTrafficPolicy: Local, externally accessible, with empty endpoints",
            svc: svc().etp_local().node_port(8080),
            cluster: Some(&[]),
            local: Some(&[]),
            ..Default::default()
        },
        Case {
            name: "externalTrafficPolicy: Local, externally accessible, but all endpoints are remote",
            svc: svc().etp_local().node_port(8080),
            endpoints: vec![ep("10.0.0.0:80"), ep("10.0.0.1:80")],
            cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            local: Some(&[]),
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "externalTrafficPolicy: Local, externally accessible, all endpoints are local",
            svc: svc().etp_local().node_port(8080),
            endpoints: vec![ep("10.0.0.0:80").local(), ep("10.0.0.1:80").local()],
            cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            local: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "externalTrafficPolicy: Local, externally accessible, some endpoints are local",
            svc: svc().etp_local().node_port(8080),
            endpoints: vec![ep("10.0.0.0:80").local(), ep("10.0.0.1:80")],
            cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            local: Some(&["10.0.0.0:80"]),
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            ..Default::default()
        },
    ]);
}

/// Cases beyond upstream's table: condition mixes (KEP-1669), Local policies on other kinds of
/// external access, and the topology fallbacks.
#[test]
fn more_categorize_endpoints() {
    run(vec![
        Case {
            name: "all ready",
            endpoints: vec![ep("10.0.0.1:80"), ep("10.0.0.2:80").local()],
            cluster: Some(&["10.0.0.1:80", "10.0.0.2:80"]),
            ..Default::default()
        },
        Case {
            name: "some terminating: ready ones only",
            endpoints: vec![ep("10.0.0.1:80"), ep("10.0.0.2:80").serving_terminating()],
            cluster: Some(&["10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "only terminating, some not serving: serving ones only",
            endpoints: vec![
                ep("10.0.0.1:80").serving_terminating(),
                ep("10.0.0.2:80").terminating_not_serving(),
            ],
            cluster: Some(&["10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "terminating, not serving: nothing",
            endpoints: vec![
                ep("10.0.0.1:80").terminating_not_serving(),
                ep("10.0.0.2:80").unready(),
            ],
            cluster: Some(&[]),
            ..Default::default()
        },
        Case {
            name: "serving but not ready and not terminating: not a fallback",
            endpoints: vec![{
                let mut e = ep("10.0.0.1:80");
                e.ready = false;
                e
            }],
            cluster: Some(&[]),
            ..Default::default()
        },
        Case {
            name: "iTP Local: local terminating used when no local endpoint is ready",
            svc: svc().itp_local(),
            endpoints: vec![
                ep("10.0.0.1:80"),
                ep("10.0.0.2:80").serving_terminating().local(),
                ep("10.0.0.3:80").terminating_not_serving().local(),
            ],
            local: Some(&["10.0.0.2:80"]),
            ..Default::default()
        },
        Case {
            name: "iTP Local: ready local endpoints preferred over terminating ones",
            svc: svc().itp_local(),
            endpoints: vec![
                ep("10.0.0.1:80").local(),
                ep("10.0.0.2:80").serving_terminating().local(),
            ],
            local: Some(&["10.0.0.1:80"]),
            ..Default::default()
        },
        Case {
            name: "iTP Local: no usable endpoint anywhere",
            svc: svc().itp_local(),
            endpoints: vec![
                ep("10.0.0.1:80").unready().local(),
                ep("10.0.0.2:80").terminating_not_serving(),
            ],
            local: Some(&[]),
            ..Default::default()
        },
        Case {
            name: "eTP Local via an external IP, no local endpoint: cluster set still computed",
            svc: ServicePortInfo {
                external_ips: vec!["192.0.2.1".parse().unwrap()],
                ..svc().etp_local()
            },
            endpoints: vec![ep("10.0.0.1:80"), ep("10.0.0.2:80")],
            cluster: Some(&["10.0.0.1:80", "10.0.0.2:80"]),
            local: Some(&[]),
            all: Some(&["10.0.0.1:80", "10.0.0.2:80"]),
            ..Default::default()
        },
        Case {
            name: "eTP Local via a load-balancer IP, local endpoint",
            svc: ServicePortInfo {
                load_balancer_ips: vec!["192.0.2.1".parse().unwrap()],
                ..svc().etp_local()
            },
            endpoints: vec![ep("10.0.0.1:80"), ep("10.0.0.2:80").local()],
            cluster: Some(&["10.0.0.1:80", "10.0.0.2:80"]),
            local: Some(&["10.0.0.2:80"]),
            all: Some(&["10.0.0.1:80", "10.0.0.2:80"]),
            ..Default::default()
        },
        Case {
            name: "eTP Local, local endpoints only terminating: merged with the ready remote ones",
            svc: svc().etp_local().node_port(30080),
            endpoints: vec![ep("10.0.0.1:80"), ep("10.0.0.2:80").serving_terminating().local()],
            cluster: Some(&["10.0.0.1:80"]),
            local: Some(&["10.0.0.2:80"]),
            all: Some(&["10.0.0.1:80", "10.0.0.2:80"]),
            ..Default::default()
        },
        Case {
            name: "iTP Local on an externally accessible port still uses cluster endpoints",
            svc: svc().itp_local().node_port(30080),
            endpoints: vec![ep("10.0.0.1:80"), ep("10.0.0.2:80")],
            cluster: Some(&["10.0.0.1:80", "10.0.0.2:80"]),
            local: Some(&[]),
            all: Some(&["10.0.0.1:80", "10.0.0.2:80"]),
            ..Default::default()
        },
        Case {
            name: "zone hints for another zone only: no filtering",
            zone: Some("zone-z"),
            endpoints: four_zoned(ABCA),
            cluster: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.5:80", "10.1.2.6:80"]),
            ..Default::default()
        },
        Case {
            name: "unready endpoints' missing hints do not disable topology",
            endpoints: {
                let mut e = four_zoned(ABCA);
                e.push(ep("10.1.2.7:80").unready());
                e
            },
            cluster: Some(&["10.1.2.3:80", "10.1.2.6:80"]),
            ..Default::default()
        },
        Case {
            name: "only terminating endpoints: topology ignored in the fallback",
            endpoints: vec![
                ep("10.1.2.3:80").zones(&["zone-a"]).serving_terminating(),
                ep("10.1.2.4:80").zones(&["zone-b"]).serving_terminating(),
            ],
            cluster: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
            ..Default::default()
        },
        Case {
            name: "PreferSameNode without node hints: zone hints used",
            node_name: "node-1",
            endpoints: four_zoned(ABCA),
            cluster: Some(&["10.1.2.3:80", "10.1.2.6:80"]),
            ..Default::default()
        },
        Case {
            name: "node hints for this node but zone hints missing: PreferSameNode",
            node_name: "node-1",
            zone: None,
            endpoints: vec![
                ep("10.1.2.3:80").nodes(&["node-1"]),
                ep("10.1.2.4:80").nodes(&["node-2"]),
            ],
            cluster: Some(&["10.1.2.3:80"]),
            ..Default::default()
        },
        Case {
            name: "no node hint for this node and no zone hints: no filtering",
            node_name: "node-9",
            endpoints: vec![
                ep("10.1.2.3:80").nodes(&["node-1"]),
                ep("10.1.2.4:80").nodes(&["node-2"]),
            ],
            cluster: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
            ..Default::default()
        },
        Case {
            name: "PreferSameNode with eTP Local: local endpoints merged",
            node_name: "node-1",
            svc: svc().etp_local().node_port(30080),
            endpoints: vec![
                ep("10.1.2.3:80").zones(&["zone-a"]).nodes(&["node-2"]).local(),
                ep("10.1.2.4:80").zones(&["zone-a"]).nodes(&["node-1"]),
            ],
            cluster: Some(&["10.1.2.4:80"]),
            local: Some(&["10.1.2.3:80"]),
            all: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
            ..Default::default()
        },
    ]);
}

#[test]
fn topology_modes() {
    let hinted = vec![
        ep("10.0.0.1:80").zones(&["zone-a"]).nodes(&["n1"]),
        ep("10.0.0.2:80").zones(&["zone-b"]).nodes(&["n2"]),
    ];
    assert_eq!(
        topology_mode_from_hints(&hinted, "n1", "zone-b"),
        TopologyMode::PreferSameNode
    );
    assert_eq!(
        topology_mode_from_hints(&hinted, "n3", "zone-b"),
        TopologyMode::PreferSameZone
    );
    assert_eq!(
        topology_mode_from_hints(&hinted, "n3", "zone-c"),
        TopologyMode::None
    );
    assert_eq!(topology_mode_from_hints(&hinted, "n3", ""), TopologyMode::None);
    assert_eq!(topology_mode_from_hints(&[], "n1", "zone-a"), TopologyMode::None);
    let unready: Vec<_> = hinted.iter().cloned().map(EpExt::unready).collect();
    assert_eq!(
        topology_mode_from_hints(&unready, "n1", "zone-a"),
        TopologyMode::None
    );
}

/// The service's own topology fields are not consulted: hints alone decide, as upstream.
#[test]
fn service_topology_fields_are_informational() {
    let node = NodeInfo {
        name: "n1".into(),
        zone: Some("zone-a".into()),
    };
    let endpoints = four_zoned(ABCA);
    let plain = categorize_endpoints(&endpoints, &svc(), &node);
    for (td, mode) in [
        (Some("PreferClose"), None),
        (None, Some("Auto")),
        (Some("PreferSameNode"), Some("Disabled")),
    ] {
        let s = ServicePortInfo {
            traffic_distribution: td.map(str::to_owned),
            topology_mode: mode.map(str::to_owned),
            lb_algorithm: None,
            ..svc()
        };
        assert_eq!(categorize_endpoints(&endpoints, &s, &node), plain);
    }
}
