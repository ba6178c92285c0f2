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
