//! Programming the maps from the cluster's objects, steps 0 to 4 of the line in one place: the
//! node's view (`node`), the plan kept between syncs (`plan::Planner`), the writes
//! (`apply::Applier`) and the `lb_config` entry. The agent programs the kernel's maps through it
//! at every sync, and `lb-agent trace --manifests` (`trace::ScratchDatapath`) programs its private
//! maps through it, so the two agree by construction on every frontend, backend, flag and
//! masquerade address.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use lb_common::{catalog::Capacities, config::DatapathConfig};

use crate::{
    apply::{Applier, ApplyReport, MapError, MapOps},
    family::{IpFamily, PerFamily},
    node::{LocalNetwork, NodeSettings, NodeView},
    plan::{ClusterIpPlan, Frontend, Outcome, Planner, Totals},
    watch::{ClusterState, ServiceInputs, ServiceKey},
};

/// The node's settings, the plan and the map writer, with the `lb_config` entry last written.
pub struct Programmer<M> {
    settings: NodeSettings,
    /// Identifies the node's network namespace to the socket programs.
    host_netns_cookie: u64,
    /// `--bpf-lb-sock-hostns-only`.
    sock_hostns_only: bool,
    planner: Planner,
    applier: Applier<M>,
    config_written: Option<DatapathConfig>,
    /// The seed every Maglev table in the maps is built with, which `lb_config` names for the flow
    /// hash: the adopted tables' until a programming rewrote them all with the configured seed
    /// (`--bpf-lb-maglev-hash-seed`), then the configured one. `lb_config` changes after the
    /// tables, so an agent killed in between finds the seed its tables still have, and rebuilds
    /// them at its start.
    maglev_seed: crate::plan::maglev::HashSeed,
    /// The pod interfaces last written to `lb_pod_ifaces`.
    pod_interfaces_written: Option<std::collections::BTreeSet<u32>>,
    /// The entries last written to `lb_masq_addrs`.
    masquerade_addrs_written: Option<std::collections::BTreeMap<u32, lb_common::config::MasqueradeAddrs>>,
    /// kube-proxy's cluster-ips-check (`plan::ClusterIpPlan`), with the Service CIDRs it is to
    /// use from the next programming on.
    cluster_ips: ClusterIpPlan,
    service_cidrs: Vec<IpNet>,
    /// The cluster IPs of the Services another proxy serves (exempt from the check).
    delegated: BTreeSet<std::net::IpAddr>,
    /// The tries as last written, both families (`None`: not read yet, or a write failed; the
    /// next programming compares the plan with the maps themselves).
    cluster_ips_written: Option<BTreeMap<IpNet, u8>>,
    service_ranges_written: PerFamily<Option<Vec<IpNet>>>,
    /// The last failure reported about them (each is logged once).
    cluster_ips_error: Option<String>,
}

impl<M: MapOps> Programmer<M> {
    /// `--bpf-lb-sock-hostns-only`: pods' connections are translated at tc, not at connect().
    pub fn sock_hostns_only(&self) -> bool {
        self.sock_hostns_only
    }

    pub fn new(
        settings: NodeSettings,
        host_netns_cookie: u64,
        sock_hostns_only: bool,
        applier: Applier<M>,
    ) -> Self {
        Self {
            settings,
            host_netns_cookie,
            sock_hostns_only,
            planner: Planner::new(),
            maglev_seed: applier.adopted_maglev_seed(),
            applier,
            config_written: None,
            pod_interfaces_written: None,
            masquerade_addrs_written: None,
            cluster_ips: ClusterIpPlan::default(),
            service_cidrs: Vec::new(),
            delegated: BTreeSet::new(),
            cluster_ips_written: None,
            service_ranges_written: PerFamily::default(),
            cluster_ips_error: None,
        }
    }

    /// The Service CIDRs (ServiceCIDR objects, or `--service-cluster-ip-range`) and the cluster
    /// IPs of the Services another proxy serves, which the cluster-ips-check uses from the next
    /// programming on. Normalised (host bits cleared, sorted, each once): a CIDR written with
    /// host bits (`10.96.0.1/12`, which `--service-cluster-ip-range` and a ServiceCIDR may hold)
    /// is its network, and an unchanged set in another order reprograms nothing.
    pub fn set_service_cidrs(&mut self, cidrs: Vec<IpNet>, delegated: BTreeSet<std::net::IpAddr>) {
        let mut cidrs: Vec<IpNet> = cidrs.into_iter().map(|c| c.trunc()).collect();
        cidrs.sort();
        cidrs.dedup();
        self.service_cidrs = cidrs;
        self.delegated = delegated;
    }

    /// The cluster-ips-check as planned (what the maps hold once written).
    pub fn cluster_ips(&self) -> &ClusterIpPlan {
        &self.cluster_ips
    }

    pub fn settings(&self) -> &NodeSettings {
        &self.settings
    }

    /// The settings, for a fact learnt after the start (`NodeSettings::sctp_refused`): the next
    /// view differs from the last, so the next sync is a full one.
    pub fn settings_mut(&mut self) -> &mut NodeSettings {
        &mut self.settings
    }

    pub fn planner(&self) -> &Planner {
        &self.planner
    }

    pub fn applier(&self) -> &Applier<M> {
        &self.applier
    }

    pub fn maps(&self) -> &M {
        self.applier.maps()
    }

    /// The maps, for writes outside the plan (tests); the programmer does not know of them.
    pub fn maps_mut(&mut self) -> &mut M {
        self.applier.maps_mut()
    }

    /// How many pod interfaces `lb_pod_ifaces` holds (as last written).
    pub fn pod_interfaces(&self) -> usize {
        self.pod_interfaces_written.as_ref().map_or(0, |p| p.len())
    }

    /// How many entries `lb_masq_addrs` holds (as last written; the fallback included).
    pub fn masquerade_interfaces(&self) -> usize {
        self.masquerade_addrs_written.as_ref().map_or(0, |m| m.len())
    }

    pub fn capacities(&self) -> Capacities {
        self.applier.capacities()
    }

    pub fn totals(&self) -> Totals {
        self.planner.totals()
    }

    /// This node's view: its Node object (when known) and its interfaces' addresses, through
    /// [`NodeSettings::view`].
    pub fn view(&self, node: Option<&Node>, local: &LocalNetwork) -> NodeView {
        self.settings.view(node, local)
    }

    /// The `lb_config` entry `view` asks for.
    pub fn datapath_config(&self, view: &NodeView) -> DatapathConfig {
        DatapathConfig {
            maglev_seed: self.maglev_seed.word(),
            ..self
                .settings
                .datapath_config(view, self.host_netns_cookie, self.sock_hostns_only)
        }
    }

    /// After a programming: once every table is written with the configured seed (no write
    /// failed and no Service was left as it was for want of room: each is retried by the next
    /// programming, which then advances), `lb_config` names it, for the flow hash. A failure to
    /// write it is retried by the next `write_config`, whose entry then differs from the one
    /// written.
    fn advance_maglev_seed(&mut self, report: &ApplyReport) {
        let configured = self.settings.load_balancing.maglev_hash_seed;
        if self.maglev_seed == configured || !report.is_clean() {
            return;
        }
        self.maglev_seed = configured;
        let Some(written) = self.config_written else {
            return;
        };
        let config = DatapathConfig {
            maglev_seed: configured.word(),
            ..written
        };
        if let Err(e) = self.put_config_if_changed(config) {
            tracing::error!("{e}: the Maglev flow hash keeps its previous seed until the next sync")
        }
    }

    /// Writes `config` to `lb_config` unless it is what was last written there, and remembers it.
    fn put_config_if_changed(&mut self, config: DatapathConfig) -> Result<(), MapError> {
        if self.config_written != Some(config) {
            self.applier.maps_mut().put_config(&config)?;
            self.config_written = Some(config);
        }
        Ok(())
    }

    /// Writes the `lb_config` entry for `view` when it differs from the last one written, after
    /// the pod interfaces the interface detector it may turn on reads.
    pub fn write_config(&mut self, view: &NodeView) -> Result<(), MapError> {
        let pod_interfaces = view.pod_interfaces.clone().unwrap_or_default();
        if self.pod_interfaces_written.as_ref() != Some(&pod_interfaces) {
            // Not fatal to the sync (retried at the next one): a packet from a pod interface the
            // map lacks counts as off the node, as before the interface appeared.
            match self.applier.maps_mut().put_pod_interfaces(&pod_interfaces) {
                Ok(()) => {
                    if view.pod_interfaces.is_some() {
                        tracing::info!(ifindexes = ?pod_interfaces, "pod interfaces (the local-traffic detector's): {}", pod_interfaces.len());
                    }
                    self.pod_interfaces_written = Some(pod_interfaces);
                }
                Err(e) => tracing::error!(
                    "{e}: packets from the pod interfaces it lacks are taken as off the node (masqueraded to cluster IPs)"
                ),
            }
        }
        let masquerade =
            crate::node::masquerade::masquerade_entries(&view.masquerade_by_interface, &view.masquerade);
        if self.masquerade_addrs_written.as_ref() != Some(&masquerade) {
            // Not fatal either: a flow leaving by an interface the map lacks gets the node's
            // primary IP, as before per-interface addresses.
            match self.applier.maps_mut().put_masquerade_addrs(&masquerade) {
                Ok(()) => {
                    tracing::info!(
                        "masquerade addresses: {}",
                        view.masquerade_by_interface
                            .iter()
                            .map(|(ifindex, nets)| format!(
                                "{ifindex}: {}",
                                nets.iter()
                                    .map(|n| n.addr().to_string())
                                    .collect::<Vec<_>>()
                                    .join(" ")
                            ))
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                    self.masquerade_addrs_written = Some(masquerade);
                }
                Err(e) => tracing::error!(
                    "{e}: flows leaving by the interfaces it lacks are masqueraded with the node's primary IP"
                ),
            }
        }
        let config = self.datapath_config(view);
        self.put_config_if_changed(config)
    }

    /// Whether the plan was computed for this view (else only [`Self::program_all`] may be used:
    /// every Service depends on the node's facts).
    pub fn is_current(&self, view: &NodeView) -> bool {
        self.planner.is_current(&view.info, &view.context)
    }

    /// Plans every Service of `state` anew and writes the whole difference against the maps.
    pub fn program_all(&mut self, state: &ClusterState, view: &NodeView) -> (Outcome, ApplyReport) {
        let outcome = self.planner.rebuild(state, &view.info, &view.context);
        let report = self.applier.apply(self.planner.desired());
        self.program_cluster_ips(None);
        self.advance_maglev_seed(&report);
        // What stays in memory until the next full programming, packed (half the nodes).
        self.planner.repack();
        self.applier.repack();
        (outcome, report)
    }

    /// Re-plans the Services in `dirty` (their objects from `inputs`) and writes what changed.
    /// Only valid while [`Self::is_current`] holds.
    pub fn program_changed<'a>(
        &mut self,
        dirty: impl IntoIterator<Item = &'a ServiceKey>,
        inputs: impl Fn(&ServiceKey) -> ServiceInputs,
    ) -> (Outcome, ApplyReport) {
        let outcome = self.planner.update(dirty, inputs);
        let report = self
            .applier
            .apply_changes(self.planner.desired(), &outcome.changes);
        self.program_cluster_ips(Some(&outcome.changes.frontends));
        self.advance_maglev_seed(&report);
        (outcome, report)
    }

    /// Brings the cluster-ips-check maps to the plan: every entry after a full programming or a
    /// change of the Service CIDRs (`changed` = `None`), else the addresses of the frontends a
    /// change touched. A failure (a full trie, say) is logged once and leaves the traffic it
    /// concerns unrefused, as before the check existed; the next programming compares anew.
    fn program_cluster_ips(&mut self, changed: Option<&BTreeSet<Frontend>>) {
        let desired = self.planner.desired();
        let touched = match changed {
            Some(changed)
                if self.cluster_ips.cidrs() == self.service_cidrs.as_slice()
                    && self.cluster_ips.delegated() == &self.delegated =>
            {
                Some(self.cluster_ips.update(desired, changed))
            }
            _ => {
                let before = self.cluster_ips.cidrs().to_vec();
                self.cluster_ips
                    .rebuild(desired, &self.service_cidrs, &self.delegated);
                self.service_cidrs = self.cluster_ips.cidrs().to_vec();
                if self.service_cidrs != before {
                    let cidrs: Vec<String> = self.service_cidrs.iter().map(IpNet::to_string).collect();
                    tracing::info!(
                        "Service CIDRs (kube-proxy's cluster-ips-check drops new flows to their unallocated addresses): {}",
                        if cidrs.is_empty() {
                            "none".to_string()
                        } else {
                            cidrs.join(", ")
                        }
                    );
                }
                None
            }
        };
        if let Err(e) = self.write_cluster_ips(touched) {
            self.cluster_ips_written = None;
            self.service_ranges_written = PerFamily::default();
            let message = e.to_string();
            if self.cluster_ips_error.as_ref() != Some(&message) {
                tracing::error!(
                    "kube-proxy's cluster-ips-check: {message}; traffic to the addresses it concerns is not refused (the next sync tries again)"
                );
                self.cluster_ips_error = Some(message);
            }
        } else {
            self.cluster_ips_error = None;
        }
    }

    fn write_cluster_ips(&mut self, touched: Option<BTreeSet<IpNet>>) -> Result<(), MapError> {
        let maps = self.applier.maps_mut();
        let planned = self.cluster_ips.entries();
        let (mut written, touched) = match self.cluster_ips_written.take() {
            Some(written) => (written, touched),
            None => {
                let mut present = maps.cluster_ip_checks(IpFamily::V4)?;
                present.extend(maps.cluster_ip_checks(IpFamily::V6)?);
                (present, None)
            }
        };
        // The keys that may differ: the touched ones, or every key of either side.
        let keys: BTreeSet<IpNet> = match touched {
            Some(touched) => touched,
            None => planned.keys().chain(written.keys()).copied().collect(),
        };
        // New and changed entries first, then the covering prefixes, then what is gone: the
        // programs never test an address the trie does not answer for yet.
        let mut result = Ok(());
        for net in &keys {
            let Some(want) = planned.get(net).copied() else {
                continue;
            };
            if written.get(net) != Some(&want) {
                match maps.set_cluster_ip_check(net, Some(want)) {
                    Ok(()) => {
                        written.insert(*net, want);
                    }
                    Err(e) => result = result.and(Err(e)),
                }
            }
        }
        for family in [IpFamily::V4, IpFamily::V6] {
            let ranges = self.cluster_ips.ranges(family);
            if self.service_ranges_written.get(family).as_deref() != Some(ranges) {
                match maps.put_service_ranges(family, ranges) {
                    Ok(()) => *self.service_ranges_written.get_mut(family) = Some(ranges.to_vec()),
                    Err(e) => result = result.and(Err(e)),
                }
            }
        }
        for net in &keys {
            if !planned.contains_key(net) && written.contains_key(net) {
                match maps.set_cluster_ip_check(net, None) {
                    Ok(()) => {
                        written.remove(net);
                    }
                    Err(e) => result = result.and(Err(e)),
                }
            }
        }
        self.cluster_ips_written = Some(written);
        result
    }
}

#[cfg(test)]
mod tests {
    use std::{net::IpAddr, path::Path};

    use super::*;
    use crate::{apply::fake::FakeMaps, watch::manifests::load_text};

    /// Cycle `i`'s Services: new names and addresses every cycle (as a cluster that keeps
    /// creating and deleting Services sees), each kind of frontend, a Local policy with its
    /// health check, affinity, IPv6, and a claim that loses a contested external IP.
    fn churned(i: u32) -> String {
        let mut yaml = String::new();
        let svc = |name: &str, spec: &str| {
            format!(
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: churn}}\nspec: {spec}\n"
            )
        };
        let slice = |name: &str, family: &str, addr: &str| {
            format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: churn, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: {family}\nendpoints: [{{addresses: [\"{addr}\"], nodeName: node-a, conditions: {{ready: true}}}}]\nports: [{{name: p, port: 8080, protocol: TCP}}]\n"
            )
        };
        let (a, b) = (i / 250 % 250, i % 250 + 1);
        let n = |j: u32| format!("s{i}-{j}");
        yaml += &svc(
            &n(0),
            &format!(
                "{{type: NodePort, clusterIP: 10.96.{a}.{b}, ports: [{{name: p, port: 80, protocol: TCP, nodePort: {}}}]}}",
                30000 + i % 2000
            ),
        );
        yaml += &svc(
            &n(1),
            &format!(
                "{{type: LoadBalancer, clusterIP: 10.97.{a}.{b}, externalTrafficPolicy: Local, healthCheckNodePort: {}, ports: [{{name: p, port: 80, protocol: TCP, nodePort: {}}}]}}",
                32000 + i % 500,
                31000 + i % 1000
            ),
        );
        yaml += &svc(
            &n(2),
            &format!(
                "{{clusterIP: 10.98.{a}.{b}, externalIPs: [198.51.{a}.{b}], sessionAffinity: ClientIP, ports: [{{name: p, port: 80, protocol: TCP}}]}}"
            ),
        );
        yaml += &svc(
            &n(3),
            &format!(
                "{{clusterIP: \"fd00:10:96::{i:x}\", ipFamilies: [IPv6], ports: [{{name: p, port: 80, protocol: TCP}}]}}"
            ),
        );
        yaml += &svc(
            &n(4),
            &format!(
                "{{clusterIP: 10.99.{a}.{b}, externalIPs: [198.51.{a}.{b}], ports: [{{name: p, port: 80, protocol: TCP}}]}}"
            ),
        );
        for j in 0..5 {
            yaml += &match j {
                3 => slice(&n(j), "IPv6", &format!("fd00:10:244::{i:x}")),
                _ => slice(&n(j), "IPv4", &format!("10.{}.{a}.{b}", 200 + j)),
            };
        }
        yaml
    }

    fn residue(p: &Programmer<FakeMaps>) -> Vec<(&'static str, usize)> {
        let mut r = p.planner().residue();
        r.extend(p.applier().residue());
        let snap = p.maps().snapshot().expect("snapshot");
        r.extend([
            ("map services", snap.services.len()),
            ("map backends", snap.backends.len()),
            ("map revnat", snap.revnat.len()),
            ("map names", snap.names.len()),
            ("map cluster ips", p.maps().cluster_ip_checks.len()),
            ("planned cluster ips", p.cluster_ips().entries().len()),
        ]);
        r
    }

    /// kube-proxy's cluster-ips-check from the plan to the maps: what a previous run left is
    /// compared and cleaned up; new entries go in before the covering prefixes, which go before
    /// deletions (the programs never test an address the trie cannot answer for); one Service
    /// deleted costs one entry; new Service CIDRs replace the old ones.
    #[test]
    fn cluster_ip_checks_follow_the_services_and_the_service_cidrs() {
        use crate::apply::fake::Op;
        use lb_common::cluster_ip::action::{DROP, REJECT};
        let settings = NodeSettings::new("node-a");
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        let mut maps = FakeMaps::new();
        // A previous run's entries: one stale, one still right.
        maps.cluster_ip_checks.insert(net("10.96.9.9/32"), REJECT);
        maps.cluster_ip_checks.insert(net("10.96.0.10/32"), REJECT);
        let mut p = Programmer::new(settings, 1, false, Applier::new(maps, Capacities::default()));
        let local = LocalNetwork {
            addresses: vec![
                "192.168.50.11".parse::<IpAddr>().unwrap(),
                "fd00:50::11".parse().unwrap(),
            ],
            ipv6_disabled: false,
            links: Vec::new(),
            interface_addresses: Vec::new(),
        };
        let svc = |name: &str, ip: &str| {
            format!(
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: t}}\nspec: {{clusterIP: '{ip}', externalIPs: [198.51.100.1], ports: [{{port: 80}}, {{port: 53, protocol: UDP}}]}}\n"
            )
        };
        let load = |yaml: &str| {
            let mut s = ClusterState::default();
            load_text(yaml, Path::new("t.yaml"), "node-a", &mut s).expect("valid manifests");
            s
        };
        let all =
            load(&(svc("web", "10.96.0.10") + &svc("old", "10.96.0.11") + &svc("six", "fd00:10:96::a")));
        let view = p.view(None, &local);
        p.set_service_cidrs(
            vec![net("fd00:10:96::/112"), net("10.96.0.0/16")],
            BTreeSet::new(),
        );
        p.maps_mut().log.clear();
        p.program_all(&all, &view);
        let checks = |p: &Programmer<FakeMaps>| p.maps().cluster_ip_checks.clone();
        assert_eq!(
            checks(&p),
            [
                (net("10.96.0.0/16"), DROP),
                (net("10.96.0.10/32"), REJECT),
                (net("10.96.0.11/32"), REJECT),
                (net("fd00:10:96::/112"), DROP),
                (net("fd00:10:96::a/128"), REJECT),
            ]
            .into()
        );
        assert_eq!(p.maps().service_ranges.v4, [net("10.96.0.0/16")]);
        assert_eq!(p.maps().service_ranges.v6, [net("fd00:10:96::/112")]);
        let order: Vec<&str> = p
            .maps()
            .log
            .iter()
            .filter_map(|op| match op {
                Op::SetClusterIpCheck(_, Some(_)) => Some("put"),
                Op::PutServiceRanges(..) => Some("ranges"),
                Op::SetClusterIpCheck(_, None) => Some("delete"),
                _ => None,
            })
            .collect();
        assert_eq!(order, ["put", "put", "put", "put", "ranges", "ranges", "delete"]);

        // `old` deleted: its one entry, nothing else.
        let without_old = load(&(svc("web", "10.96.0.10") + &svc("six", "fd00:10:96::a")));
        p.maps_mut().log.clear();
        p.program_changed(&[("t".to_string(), "old".to_string())], |k| {
            without_old.service_inputs(k)
        });
        let cluster_ops: Vec<&Op> = p
            .maps()
            .log
            .iter()
            .filter(|op| matches!(op, Op::SetClusterIpCheck(..) | Op::PutServiceRanges(..)))
            .collect();
        assert_eq!(cluster_ops, [&Op::SetClusterIpCheck(net("10.96.0.11/32"), None)]);

        // Other Service CIDRs (a sync with nothing else changed): the old CIDR goes, the new one
        // comes, and the covering prefixes follow.
        p.set_service_cidrs(vec![net("10.96.0.0/12")], BTreeSet::new());
        p.program_changed(&[], |k| without_old.service_inputs(k));
        assert_eq!(
            checks(&p),
            [
                (net("10.96.0.0/12"), DROP),
                (net("10.96.0.10/32"), REJECT),
                (net("fd00:10:96::a/128"), REJECT),
            ]
            .into()
        );
        assert_eq!(p.maps().service_ranges.v4, [net("10.96.0.0/12")]);
        assert_eq!(p.maps().service_ranges.v6, [net("fd00:10:96::a/128")]);

        // The same CIDR written with host bits, twice: the same check, nothing rewritten.
        p.set_service_cidrs(vec![net("10.96.0.1/12"), net("10.96.0.0/12")], BTreeSet::new());
        p.maps_mut().log.clear();
        p.program_changed(&[], |k| without_old.service_inputs(k));
        assert!(
            !p.maps()
                .log
                .iter()
                .any(|op| matches!(op, Op::SetClusterIpCheck(..) | Op::PutServiceRanges(..))),
            "{:?}",
            p.maps().log
        );
        assert_eq!(checks(&p)[&net("10.96.0.0/12")], DROP);
    }

    /// The interface detector's pod interfaces are written before the `lb_config` entry that
    /// turns the detector on, and again only when they change; a full `lb_pod_ifaces` does not
    /// stop the config (nor the sync): it is retried at the next one.
    #[test]
    fn pod_interfaces_go_before_the_config_and_a_full_map_stops_nothing() {
        use crate::{
            apply::fake::Op,
            node::{DetectLocalMode, Link},
        };
        let settings = NodeSettings {
            detect_local_mode: DetectLocalMode::InterfaceNamePrefix,
            pod_interface_name_prefix: "veth".into(),
            ..NodeSettings::new("node-a")
        };
        let local = |names: &[&str]| LocalNetwork {
            addresses: vec!["192.168.50.11".parse::<IpAddr>().unwrap()],
            ipv6_disabled: true,
            links: names
                .iter()
                .enumerate()
                .map(|(i, n)| Link {
                    name: n.to_string(),
                    index: i as u32 + 2,
                    controller: None,
                    bridge_port: false,
                    up: true,
                    loopback: false,
                })
                .collect(),
            interface_addresses: Vec::new(),
        };
        let mut p = Programmer::new(
            settings,
            1,
            false,
            Applier::new(FakeMaps::new(), Capacities::default()),
        );
        let view = p.view(None, &local(&["eth0", "veth1", "veth2"]));
        p.write_config(&view).unwrap();
        assert_eq!(
            p.maps().log,
            [Op::PutPodInterfaces, Op::PutMasqueradeAddrs, Op::PutConfig]
        );
        assert_eq!(p.maps().pod_interfaces, [3, 4].into());
        let flags = p.maps().config.unwrap().flags;
        assert_eq!(
            flags & lb_common::config::flags::DETECT_LOCAL_BY_INTERFACE,
            lb_common::config::flags::DETECT_LOCAL_BY_INTERFACE
        );
        // Unchanged: nothing written.
        p.write_config(&view).unwrap();
        assert_eq!(p.maps().log.len(), 3);
        // A pod left: the map follows.
        p.write_config(&p.view(None, &local(&["eth0", "veth1"]))).unwrap();
        assert_eq!(p.maps().pod_interfaces, [3].into());
        // A full map: the config is still written, and the interfaces are tried again next time.
        p.maps_mut().pod_interfaces_fail = true;
        let mut grown = p.view(None, &local(&["eth0", "veth1", "veth2", "veth3"]));
        grown.masquerade.v4 = Some("192.168.50.12".parse().unwrap());
        p.write_config(&grown)
            .expect("the config despite a full lb_pod_ifaces");
        assert_eq!(p.maps().config.unwrap().v4.snat_addr, [192, 168, 50, 12]);
        p.maps_mut().pod_interfaces_fail = false;
        p.write_config(&grown).unwrap();
        assert_eq!(p.maps().pod_interfaces, [3, 4, 5].into());
    }

    /// `--bpf-lb-maglev-hash-seed`: the tables are built with the node's seed, and `lb_config`
    /// names it for the flow hash only once every table is (a restart with another seed finds
    /// the adopted tables' seed in `lb_config` until they are rebuilt; a kill in between leaves
    /// the old seed there, so the next start rebuilds them again). A restart with the same seed
    /// writes no table.
    #[test]
    fn the_flow_hash_takes_the_seed_once_every_table_is_built_with_it() {
        use crate::{
            apply::fake::Op,
            model::LbAlgorithm,
            node::LoadBalancing,
            plan::maglev::{HashSeed, TableSize},
        };
        let seed_a: HashSeed = "JLfvgnHc2kaSUFaI".parse().unwrap();
        let seed_b: HashSeed = "AAAAAAAAAAAAAAAA".parse().unwrap();
        let settings = |seed| NodeSettings {
            load_balancing: LoadBalancing {
                algorithm: LbAlgorithm::Maglev,
                maglev_table_size: TableSize::new(251).unwrap(),
                maglev_hash_seed: seed,
            },
            ..NodeSettings::new("node-a")
        };
        let local = LocalNetwork {
            addresses: vec!["192.168.50.11".parse::<IpAddr>().unwrap()],
            ipv6_disabled: true,
            links: Vec::new(),
            interface_addresses: Vec::new(),
        };
        let mut state = ClusterState::default();
        load_text(
            "---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: t}\nspec: {type: NodePort, clusterIP: 10.96.0.10, ports: [{port: 80, nodePort: 30080}]}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: t, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [10.244.1.1], conditions: {ready: true}}, {addresses: [10.244.1.2], conditions: {ready: true}}]\nports: [{port: 80, protocol: TCP}]\n",
            Path::new("t.yaml"),
            "node-a",
            &mut state,
        )
        .expect("valid manifests");
        // The tables are what the seed changes: compare them across programmings.
        let tables = |p: &Programmer<FakeMaps>| p.maps().snapshot().unwrap().maglev;
        let seed_in_config =
            |p: &Programmer<FakeMaps>| HashSeed::from_word(p.maps().config.unwrap().maglev_seed);
        let start = |maps: FakeMaps, seed| {
            let applier = Applier::recover(maps, Capacities::default()).expect("adopted");
            let mut p = Programmer::new(settings(seed), 1, false, applier);
            let view = p.view(None, &local);
            p.write_config(&view).unwrap();
            (p, view)
        };

        // A first start with seed A: the config says the fixed seed until the tables are in.
        let (mut p, view) = start(FakeMaps::new(), seed_a);
        assert_eq!(seed_in_config(&p), HashSeed::FIXED);
        let (_, report) = p.program_all(&state, &view);
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert_eq!(seed_in_config(&p), seed_a);
        let with_a = tables(&p);
        assert!(!with_a.is_empty(), "a table per NodePort frontend");
        let last_table = p
            .maps()
            .log
            .iter()
            .rposition(|op| matches!(op, Op::PutMaglev(..)));
        let last_config = p.maps().log.iter().rposition(|op| matches!(op, Op::PutConfig));
        assert!(
            last_table < last_config,
            "the seed after the tables: {:?}",
            p.maps().log
        );

        // A restart with the same seed: adopted, nothing rewritten.
        let maps = std::mem::take(p.maps_mut());
        let (mut p, view) = start(maps, seed_a);
        p.maps_mut().log.clear();
        p.program_all(&state, &view);
        assert!(
            !p.maps()
                .log
                .iter()
                .any(|op| matches!(op, Op::PutMaglev(..) | Op::PutConfig)),
            "{:?}",
            p.maps().log
        );
        assert_eq!(tables(&p), with_a);

        // A restart with seed B: every table rebuilt, then the config.
        let maps = std::mem::take(p.maps_mut());
        let (mut p, view) = start(maps, seed_b);
        assert_eq!(
            seed_in_config(&p),
            seed_a,
            "the adopted tables' seed until they are rebuilt"
        );
        p.program_all(&state, &view);
        assert_eq!(seed_in_config(&p), seed_b);
        let with_b = tables(&p);
        assert_eq!(
            with_b.keys().collect::<Vec<_>>(),
            with_a.keys().collect::<Vec<_>>()
        );
        assert!(
            with_b.iter().all(|(id, t)| with_a[id] != *t),
            "every table rebuilt with seed B"
        );

        // A Service left as it was for want of room (its Maglev table, had it one, would keep
        // its old seed): the config keeps naming the old seed, whose tables the maps may hold.
        let mut crowded = state.clone();
        load_text(
            "---\napiVersion: v1\nkind: Service\nmetadata: {name: more, namespace: t}\nspec: {clusterIP: 10.96.0.11, ports: [{port: 80}]}\n",
            Path::new("more.yaml"),
            "node-a",
            &mut crowded,
        )
        .expect("valid manifests");
        let maps = std::mem::take(p.maps_mut());
        let revnat = maps.snapshot().unwrap().revnat.len() as u32;
        let caps = Capacities {
            revnat,
            ..Capacities::default()
        };
        let mut p = Programmer::new(
            settings(seed_a),
            1,
            false,
            Applier::recover(maps, caps).expect("adopted"),
        );
        let view = p.view(None, &local);
        p.write_config(&view).unwrap();
        let (_, report) = p.program_all(&crowded, &view);
        assert!(
            !report.skipped.is_empty(),
            "no room for the new Service: {report:?}"
        );
        assert_eq!(tables(&p), with_a, "the tables rebuilt with seed A");
        assert_eq!(
            seed_in_config(&p),
            seed_b,
            "but a skipped Service keeps the old seed named"
        );
        let (_, report) = p.program_all(&state, &view);
        assert!(report.is_clean());
        assert_eq!(seed_in_config(&p), seed_a);

        // Killed after the tables, before the config: the next start (seed B again) finds seed A
        // named and rebuilds the tables, which it cannot tell from A's.
        let mut maps = std::mem::take(p.maps_mut());
        let mut config = maps.config.unwrap();
        config.maglev_seed = seed_a.word();
        maps.put_config(&config).unwrap();
        let (mut p, view) = start(maps, seed_b);
        p.maps_mut().log.clear();
        p.program_all(&state, &view);
        assert!(p.maps().log.iter().any(|op| matches!(op, Op::PutMaglev(..))));
        assert_eq!(seed_in_config(&p), seed_b);
        assert_eq!(tables(&p), with_b);
    }

    /// A node with two uplinks on different subnets (and a pod gateway address on a veth): each
    /// interface's MASQUERADE address goes to `lb_masq_addrs` with the node IP as the fallback
    /// at key 0, before the config whose flag has the programs look routes up; a single-homed
    /// node leaves the flag off (every flow gets the node IP, no lookup).
    #[test]
    fn masquerade_addresses_per_interface_go_before_the_config_that_reads_them() {
        use crate::{apply::fake::Op, node::masquerade::InterfaceAddress};
        use lb_common::config::flags::MASQUERADE_BY_INTERFACE;
        let address = |ifindex: u32, net: &str| InterfaceAddress::universe(ifindex, net.parse().unwrap());
        let settings = NodeSettings {
            bind_address: Some("192.168.50.11".parse().unwrap()),
            ..NodeSettings::new("node-a")
        };
        let mut p = Programmer::new(
            settings,
            1,
            false,
            Applier::new(FakeMaps::new(), Capacities::default()),
        );
        let local = |interface_addresses: Vec<InterfaceAddress>| LocalNetwork {
            addresses: interface_addresses.iter().map(|a| a.net.addr()).collect(),
            ipv6_disabled: true,
            links: Vec::new(),
            interface_addresses,
        };
        let single = p.view(None, &local(vec![address(2, "192.168.50.11/24")]));
        p.write_config(&single).unwrap();
        assert!(
            p.maps().log.ends_with(&[Op::PutMasqueradeAddrs, Op::PutConfig]),
            "{:?}",
            p.maps().log
        );
        let written = p.maps().log.len();
        assert_eq!(p.maps().config.unwrap().flags & MASQUERADE_BY_INTERFACE, 0);
        assert_eq!(p.maps().masquerade_addrs[&0].v4.get(0), Some(&[192, 168, 50, 11]));

        let multi = p.view(
            None,
            &local(vec![
                address(2, "192.168.50.11/24"),
                address(3, "192.168.60.11/24"),
                address(4, "10.244.1.1/32"),
            ]),
        );
        p.write_config(&multi).unwrap();
        assert_eq!(
            p.maps().log[written..],
            [Op::PutMasqueradeAddrs, Op::PutConfig],
            "the addresses before the flag"
        );
        assert_eq!(
            p.maps().config.unwrap().flags & MASQUERADE_BY_INTERFACE,
            MASQUERADE_BY_INTERFACE
        );
        let entries = &p.maps().masquerade_addrs;
        assert_eq!(entries.keys().copied().collect::<Vec<_>>(), [0, 2, 3, 4]);
        assert_eq!(
            entries[&0].v4.get(0),
            Some(&[192, 168, 50, 11]),
            "the fallback: the node IP"
        );
        assert_eq!(entries[&3].v4.get(0), Some(&[192, 168, 60, 11]));
        assert_eq!(entries[&3].v4.addrs[0].prefix_len, 24);
        assert_eq!(entries[&4].v4.get(0), Some(&[10, 244, 1, 1]));
    }

    /// The soak (docs/soak.md) saw the agent's RSS grow slowly while Services were created and
    /// deleted under new names. Whatever that is, it is not state the plan or the writer keep for
    /// a deleted Service: after hundreds of Services of every kind come and go, incrementally as
    /// the agent's syncs do, every collection is back to its size with only the steady Service.
    #[test]
    fn services_that_come_and_go_leave_nothing_in_the_plan_or_the_maps() {
        let settings = NodeSettings {
            cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
            ..NodeSettings::new("node-a")
        };
        let caps = Capacities::default();
        let mut p = Programmer::new(settings, 1, false, Applier::new(FakeMaps::new(), caps));
        let local = LocalNetwork {
            addresses: vec![
                "192.168.50.11".parse::<IpAddr>().unwrap(),
                "fd00:50::11".parse().unwrap(),
            ],
            ipv6_disabled: false,
            links: Vec::new(),
            interface_addresses: Vec::new(),
        };
        let steady = "apiVersion: v1\nkind: Service\nmetadata: {name: steady, namespace: churn}\nspec: {clusterIP: 10.96.255.1, ports: [{name: p, port: 80, protocol: TCP}]}\n";
        let load = |yaml: &str| {
            let mut s = ClusterState::default();
            load_text(yaml, Path::new("churn.yaml"), "node-a", &mut s).expect("valid manifests");
            s
        };
        let base = load(steady);
        let view = p.view(None, &local);
        let (_, report) = p.program_all(&base, &view);
        assert!(report.errors.is_empty(), "{report:?}");
        let at_rest = residue(&p);
        assert!(at_rest.iter().any(|(_, n)| *n > 0), "{at_rest:?}");

        let mut created_frontends = 0;
        for i in 0..300 {
            let with = load(&format!("{steady}{}", churned(i)));
            let dirty: Vec<ServiceKey> = with.services.keys().cloned().collect();
            assert!(p.is_current(&view));
            let (outcome, report) = p.program_changed(&dirty, |key| with.service_inputs(key));
            assert!(
                report.errors.is_empty() && report.skipped.is_empty(),
                "{report:?}"
            );
            created_frontends += outcome.changes.frontends.len();
            let (_, report) = p.program_changed(&dirty, |key| base.service_inputs(key));
            assert!(report.errors.is_empty(), "{report:?}");
            assert_eq!(residue(&p), at_rest, "after cycle {i}");
        }
        // Every cycle created its frontends (and not only once).
        assert!(created_frontends >= 300 * 8, "{created_frontends}");
    }
}
