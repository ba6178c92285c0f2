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

    /// Writes the `lb_config` entry for `view` when it differs from the last one written.
    pub fn write_config(&mut self, view: &NodeView) -> Result<(), MapError> {
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
