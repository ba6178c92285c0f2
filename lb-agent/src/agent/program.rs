//! Programming the maps from the cluster's objects, steps 0 to 4 of the line in one place: the
//! node's view (`node`), the plan kept between syncs (`plan::Planner`), the writes
//! (`apply::Applier`) and the `lb_config` entry. The agent programs the kernel's maps through it
//! at every sync, and `lb-agent trace --manifests` (`trace::ScratchDatapath`) programs its private
//! maps through it, so the two agree by construction on every frontend, backend, flag and
//! masquerade address.

use k8s_openapi::api::core::v1::Node;
use lb_common::{catalog::Capacities, config::DatapathConfig};

use crate::{
    apply::{Applier, ApplyReport, MapError, MapOps},
    node::{LocalNetwork, NodeSettings, NodeView},
    plan::{Outcome, Planner, Totals},
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
    /// The pod interfaces last written to `lb_pod_ifaces`.
    pod_interfaces_written: Option<std::collections::BTreeSet<u32>>,
}

impl<M: MapOps> Programmer<M> {
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
            applier,
            config_written: None,
            pod_interfaces_written: None,
        }
    }

    pub fn settings(&self) -> &NodeSettings {
        &self.settings
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
        self.settings
            .datapath_config(view, self.host_netns_cookie, self.sock_hostns_only)
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
        let config = self.datapath_config(view);
        if self.config_written != Some(config) {
            self.applier.maps_mut().put_config(&config)?;
            self.config_written = Some(config);
        }
        Ok(())
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
        (outcome, report)
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
        ]);
        r
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
            node_name: "node-a".into(),
            cluster_cidrs: vec![],
            detect_local_mode: DetectLocalMode::InterfaceNamePrefix,
            pod_bridge_interface: String::new(),
            pod_interface_name_prefix: "veth".into(),
            nodeport_addresses: vec![],
            masquerade_all: false,
            localhost_nodeports: true,
            bind_address: None,
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
                })
                .collect(),
        };
        let mut p = Programmer::new(
            settings,
            1,
            false,
            Applier::new(FakeMaps::new(), Capacities::default()),
        );
        let view = p.view(None, &local(&["eth0", "veth1", "veth2"]));
        p.write_config(&view).unwrap();
        assert_eq!(p.maps().log, [Op::PutPodInterfaces, Op::PutConfig]);
        assert_eq!(p.maps().pod_interfaces, [3, 4].into());
        let flags = p.maps().config.unwrap().flags;
        assert_eq!(
            flags & lb_common::config::flags::DETECT_LOCAL_BY_INTERFACE,
            lb_common::config::flags::DETECT_LOCAL_BY_INTERFACE
        );
        // Unchanged: nothing written.
        p.write_config(&view).unwrap();
        assert_eq!(p.maps().log.len(), 2);
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

    /// The soak (docs/soak.md) saw the agent's RSS grow slowly while Services were created and
    /// deleted under new names. Whatever that is, it is not state the plan or the writer keep for
    /// a deleted Service: after hundreds of Services of every kind come and go, incrementally as
    /// the agent's syncs do, every collection is back to its size with only the steady Service.
    #[test]
    fn services_that_come_and_go_leave_nothing_in_the_plan_or_the_maps() {
        let settings = NodeSettings {
            node_name: "node-a".into(),
            cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
            detect_local_mode: Default::default(),
            pod_bridge_interface: String::new(),
            pod_interface_name_prefix: String::new(),
            nodeport_addresses: vec![],
            masquerade_all: false,
            localhost_nodeports: true,
            bind_address: None,
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
