//! One sync of the agent: read what changed, derive the node's view, program the maps, then
//! report (logs, Events, metrics, health). Only the Services the watch marked dirty are re-planned
//! and only what changed is written; everything is re-planned (and compared with the maps) after a
//! relist, when the node's facts change, and for manifests, which have no watch.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    sync::Arc,
    time::{Instant, SystemTime},
};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::Resource;
use lb_common::{catalog, stats::Counter};

use super::{Source, program::Programmer};
use crate::{
    apply::{ApplyReport, KernelMaps},
    datapath::{Datapath, tc},
    events::ProblemEvent,
    family::IpFamily,
    health::{self, ProxyHealth, ServiceHealthServers},
    metrics::Metrics,
    node::{self, NodeView},
    plan::Outcome,
    watch::{ClusterState, kube::PendingChanges, manifests},
};

/// What the agent keeps between syncs.
pub(super) struct Agent {
    pub datapath: Datapath,
    /// The cgroup the socket programs attach to, once the first sync has filled the maps.
    pub cgroup_root: PathBuf,
    pub cgroup_attached: bool,
    /// Aborts local sockets connected to removed backends (None: the kernel cannot).
    pub sockets: Option<crate::datapath::sockets::SocketTerminator>,
    /// Steps 0 to 4, kept between syncs (one changed Service costs one Service's work).
    pub programmer: Programmer<KernelMaps>,
    pub devices: Option<Vec<tc::DevicePattern>>,
    pub metrics: Metrics,
    pub health: ProxyHealth,
    pub service_health: ServiceHealthServers,
    pub source: Source,
    /// Problems of the last sync, for Events.
    pub problems: Vec<ProblemEvent>,
    /// Bad files and objects of the manifests folder at the last sync (each is logged once).
    pub manifest_problems: BTreeSet<manifests::Problem>,
    /// `--service-cluster-ip-range`: the Service CIDRs where the source has no ServiceCIDR
    /// objects.
    pub service_cluster_ip_range: Vec<ipnet::IpNet>,
    /// The node's addresses and links, dumped anew only after a link or address event (or at a
    /// sync no Service change caused).
    pub local_network: node::LocalNetworkCache,
}

/// What a sync reads from its source.
struct SourceRead {
    /// The watch's changes since the last sync (none for manifests).
    pending: PendingChanges,
    /// The whole state, when the source has no watch (manifests, loaded anew).
    loaded: Option<ClusterState>,
    node: Option<Arc<Node>>,
    /// The CIDRs of the source's ServiceCIDR objects, if it has any.
    service_cidrs: Option<Vec<ipnet::IpNet>>,
    /// The cluster IPs of the Services another proxy serves.
    delegated: std::collections::BTreeSet<std::net::IpAddr>,
}

impl Agent {
    /// One sync (see the module doc).
    pub fn sync(&mut self) -> Result<()> {
        let started = Instant::now();
        let SourceRead {
            pending,
            loaded,
            node,
            service_cidrs,
            delegated,
        } = self.read_source()?;
        self.programmer.set_service_cidrs(
            service_cidrs.unwrap_or_else(|| self.service_cluster_ip_range.clone()),
            delegated,
        );
        if let Some(node) = node.as_deref() {
            self.health.set_node(node);
        }
        if !self.datapath.sctp_decided()
            && self.sctp_wanted(&pending, loaded.as_ref())
            && let Err(e) = serve_sctp(&mut self.datapath, self.programmer.settings_mut())
        {
            // TCP and UDP are still served; the next sync with an SCTP change tries again.
            tracing::error!("{e:#}");
        }
        // A sync for changed Services alone reuses the last dump unless the link watcher saw an
        // event since; any other (periodic, relist, link event, manifests) dumps anew.
        let refresh = loaded.is_some() || pending.relisted || pending.dirty.is_empty();
        let view = self.node_view(node.as_deref(), refresh)?;
        self.programmer
            .write_config(&view)
            .context("writing the datapath configuration")?;
        let full = pending.relisted || loaded.is_some() || !self.programmer.is_current(&view);
        let (outcome, report) = self.program(full, loaded, &pending, &view);
        // The data path is as planned from here on; what follows is bookkeeping.
        let programmed = started.elapsed();
        let queued = pending
            .first_seen
            .map(|seen| started.saturating_duration_since(seen));
        self.terminate_sockets(&report);
        if full {
            release_freed_memory();
        }
        if self.cgroup_attached {
            self.attach_tc();
        }
        self.report_problems(&outcome, &report);
        self.record_metrics(&report, &pending, started);
        self.update_health(&report);
        log_sync(
            full,
            &outcome,
            &report,
            self.programmer.planner(),
            programmed,
            queued,
            started,
        );
        if !report.errors.is_empty() {
            anyhow::bail!("{} map update(s) failed; retrying", report.errors.len());
        }
        Ok(())
    }

    /// Connected UDP sockets to the backends this sync deleted are aborted (from a thread of their
    /// own): their applications reconnect, through the socket programs, to a live backend.
    fn terminate_sockets(&self, report: &ApplyReport) {
        if let Some(sockets) = &self.sockets {
            sockets.terminate(
                report
                    .removed_backends
                    .iter()
                    .filter(|b| b.proto == crate::model::Protocol::Udp)
                    .map(|b| std::net::SocketAddr::new(b.addr, b.port))
                    .collect(),
            );
        }
    }

    /// The watch's pending changes and its Node, or the manifests folder loaded anew (whose bad
    /// files and objects are logged when they appear).
    fn read_source(&mut self) -> Result<SourceRead> {
        match &mut self.source {
            Source::Kube(kube) => Ok(SourceRead {
                pending: kube.take_pending(),
                loaded: None,
                node: kube.node(),
                service_cidrs: kube.service_cidrs(),
                delegated: kube.delegated_cluster_ips(),
            }),
            Source::Manifests(folder) => {
                let loaded = folder
                    .load()
                    .with_context(|| format!("loading the manifests of {}", folder.dir().display()))?;
                for p in loaded
                    .problems
                    .iter()
                    .filter(|p| !self.manifest_problems.contains(*p))
                {
                    match &p.error {
                        manifests::ManifestError::Object(o) => {
                            tracing::warn!(kind = %o.kind, namespace = %o.namespace, name = %o.name, "{p}")
                        }
                        _ => tracing::warn!("{p}"),
                    }
                }
                self.manifest_problems = loaded.problems.into_iter().collect();
                Ok(SourceRead {
                    pending: PendingChanges::default(),
                    node: loaded.state.node.clone(),
                    service_cidrs: loaded.state.service_cidrs.clone(),
                    delegated: crate::watch::delegated_cluster_ips(
                        loaded.state.services.values().map(|s| s.as_ref()),
                    ),
                    loaded: Some(loaded.state),
                })
            }
        }
    }

    /// Whether this sync brings an SCTP port: among every Service after a relist or with a
    /// loaded state (the first sync is one), else among the changed ones.
    fn sctp_wanted(&self, pending: &PendingChanges, loaded: Option<&ClusterState>) -> bool {
        match (&self.source, loaded) {
            (_, Some(state)) => state.services.values().any(|s| has_sctp_port(s)),
            (Source::Kube(kube), None) if pending.relisted => kube.any_service(has_sctp_port),
            (Source::Kube(kube), None) => pending
                .dirty
                .iter()
                .any(|key| kube.service(key).is_some_and(|s| has_sctp_port(&s))),
            (Source::Manifests(_), None) => false,
        }
    }

    /// This node's view from its Node object and its interfaces and their addresses now (the
    /// cache keeps the links for the tc attachment).
    fn node_view(&mut self, node: Option<&Node>, refresh: bool) -> Result<NodeView> {
        let local = self
            .local_network
            .read(refresh)
            .context("listing this node's addresses and links")?;
        Ok(self.programmer.view(node, local))
    }

    /// Re-plans and writes: every Service (`full`; the state is dropped before returning, so a
    /// full sync's garbage can be released), or the ones the watch marked dirty.
    fn program(
        &mut self,
        full: bool,
        loaded: Option<ClusterState>,
        pending: &PendingChanges,
        view: &NodeView,
    ) -> (Outcome, ApplyReport) {
        match (&self.source, loaded) {
            (_, Some(state)) => self.programmer.program_all(&state, view),
            (Source::Kube(kube), None) if full => self.programmer.program_all(&kube.state(), view),
            (Source::Kube(kube), None) => self
                .programmer
                .program_changed(&pending.dirty, |key| kube.service_inputs(key)),
            (Source::Manifests(_), None) => unreachable!("manifests are always loaded"),
        }
    }

    /// Logs problems when they appear and keeps the current set for Events: the Services' own,
    /// and Services the maps had no room for.
    fn report_problems(&mut self, outcome: &Outcome, report: &ApplyReport) {
        for p in &outcome.new_problems {
            tracing::warn!(kind = p.kind, namespace = %p.namespace, name = %p.name, "{}", p.message);
        }
        self.problems = self
            .programmer
            .planner()
            .problems()
            .into_iter()
            .map(|p| (p.namespace, p.name, "InvalidService", p.message))
            .collect();
        for (service, reason) in &report.skipped {
            tracing::error!(service = %service, "not programmed: {reason}");
            self.problems.push((
                service.namespace.clone(),
                service.name.clone(),
                "MapFull",
                format!("not programmed: {reason}"),
            ));
        }
        for (service, frontend) in &report.withdrawn {
            tracing::warn!(
                service = %service,
                frontend = %frontend,
                "a map is too full to rewrite this frontend in place: it was withdrawn and rewritten \
                 (new connections to it may have failed meanwhile); raise the map capacities"
            );
        }
        for e in &report.errors {
            tracing::error!("map update failed: {e}");
        }
    }

    /// The health-check NodePort servers follow the plan; the proxy is healthy once a sync wrote
    /// everything.
    fn update_health(&mut self, report: &ApplyReport) {
        let health_checks = health::targets_from_health_checks(&self.programmer.planner().health_checks());
        for e in self.service_health.sync(&health_checks) {
            tracing::warn!("health check server: {e}");
        }
        if report.errors.is_empty() {
            self.health.updated();
            self.metrics.sync_succeeded(SystemTime::now());
        }
    }

    /// The Services the current problems are about, for their Events.
    pub fn problem_references(&self) -> BTreeMap<(String, String), ObjectReference> {
        let Source::Kube(kube) = &self.source else {
            return BTreeMap::new();
        };
        self.problems
            .iter()
            .map(|(ns, name, _, _)| (ns.clone(), name.clone()))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .filter_map(|key| kube.service(&key).map(|svc| (key, svc.object_ref(&()))))
            .collect()
    }

    /// Attaches (or atomically replaces) the programs once the maps hold the desired state, then
    /// drops the pins of maps that were migrated. A restarted or upgraded agent therefore swaps
    /// programs only after its maps are complete; until then the previous programs keep serving.
    pub fn attach_programs(&mut self) -> Result<()> {
        self.datapath
            .attach_cgroup(&self.cgroup_root)
            .context("attaching the socket programs")?;
        self.datapath.commit_start();
        self.cgroup_attached = true;
        self.attach_tc();
        if self.datapath.migrating() {
            self.datapath.finish_migration();
        }
        Ok(())
    }

    /// Attaches the tc programs to the selected interfaces that are up, and detaches them from
    /// interfaces that went away (the sync's links: pod veths come and go).
    fn attach_tc(&mut self) {
        let Some(patterns) = &self.devices else { return };
        let links = self.local_network.links();
        let up = tc::interfaces_up(links);
        // The default selection leaves a bridge's ports to the bridge (`select_devices`), unless
        // pods' connections are translated at tc (`--bpf-lb-sock-hostns-only`): a reply between
        // two pods of one bridge is bridged, never routed, and only its ports' tc can reverse a
        // translation. (kube-proxy meets it with br_netfilter.)
        let bridge_ports = if patterns.is_empty() && !self.programmer.sock_hostns_only() {
            links.iter().filter(|l| l.bridge_port).map(|l| l.index).collect()
        } else {
            BTreeSet::new()
        };
        let wanted = tc::select_devices(patterns, &up, &bridge_ports);
        for (name, index) in &wanted {
            if let Err(e) = self.datapath.attach_tc(name, *index) {
                tracing::error!(device = %name, "attaching the tc programs: {e}");
            }
        }
        for gone in self.datapath.detach_tc_except(&wanted, links) {
            tracing::info!(device = %gone, "detached the tc programs");
        }
    }

    fn record_metrics(&self, report: &ApplyReport, pending: &PendingChanges, started: Instant) {
        let m = &self.metrics;
        m.observe_sync_duration(started.elapsed());
        m.service_changes(pending.services);
        m.endpoint_changes(pending.endpoints);
        let now = SystemTime::now();
        for t in &pending.trigger_times {
            if let Ok(latency) = now.duration_since(*t) {
                m.observe_network_programming(latency);
            }
        }
        if let Source::Kube(kube) = &self.source {
            let (services, endpoints) = kube.pending_counts();
            m.set_service_changes_pending(services as usize);
            m.set_endpoint_changes_pending(endpoints as usize);
        }
        let totals = self.programmer.totals();
        m.set_no_local_endpoints(totals.no_local_internal, totals.no_local_external);
        let caps = self.programmer.capacities();
        let occ = self.programmer.applier().occupancy();
        for family in IpFamily::ALL {
            let maps = family.maps();
            for (name, used, cap) in [
                (maps.services, occ.services.get(family), caps.services),
                (maps.backends, occ.backends.get(family), caps.backends),
                (maps.revnat, occ.revnat.get(family), caps.revnat),
                (
                    maps.source_ranges,
                    occ.source_ranges.get(family),
                    caps.source_ranges,
                ),
            ] {
                m.set_map_occupancy(name, u64::from(*used), u64::from(cap));
            }
        }
        m.set_map_occupancy(
            catalog::AFFINITY_MATCH,
            u64::from(occ.affinity_match),
            u64::from(caps.affinity_match),
        );
        // One table per Maglev frontend; each table's own memory is in the benchmarks.
        m.set_map_occupancy(
            catalog::MAGLEV,
            u64::from(occ.maglev),
            u64::from(caps.revnat.saturating_mul(2)),
        );
        if self.programmer.settings().interface_detector().is_some() {
            m.set_map_occupancy(
                catalog::POD_INTERFACES,
                self.programmer.pod_interfaces() as u64,
                u64::from(catalog::capacity::POD_INTERFACES),
            );
        }
        m.set_map_occupancy(
            catalog::MASQ_ADDRS,
            self.programmer.masquerade_interfaces() as u64,
            u64::from(catalog::capacity::MASQ_ADDRS),
        );
        let events: Vec<(&str, u64)> = Counter::ALL
            .iter()
            .map(|c| (c.name(), self.programmer.maps().counter(*c as u32)))
            .collect();
        m.set_datapath_events(&events);
        let skipped: &[(&str, usize)] = if report.skipped.is_empty() {
            &[]
        } else {
            &[("map_full", report.skipped.len())]
        };
        m.set_services_skipped(skipped);
        for e in &report.errors {
            let map = catalog::ALL
                .iter()
                .find(|n| e.contains(*n))
                .copied()
                .unwrap_or("unknown");
            m.map_write_errors(map, 1);
        }
    }
}

/// Loads the SCTP program unless done (`Datapath::serve_sctp`), before the first SCTP frontend
/// is written. A refusal is logged and kept in `settings`, whose planner then reports each SCTP
/// port; TCP and UDP are served all the same.
pub(crate) fn serve_sctp(datapath: &mut Datapath, settings: &mut node::NodeSettings) -> Result<()> {
    if datapath.sctp_decided() {
        return Ok(());
    }
    let started = Instant::now();
    match datapath.serve_sctp().context("loading the SCTP program")? {
        None => tracing::info!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            "SCTP programs loaded ({}, {}): SCTP Services are served",
            tc::SCTP_INGRESS_PROGRAM,
            tc::SCTP_EGRESS_PROGRAM
        ),
        Some(refusal) => {
            tracing::error!("SCTP Services are not load-balanced on this node (TCP and UDP are): {refusal}");
            settings.sctp_refused = Some(refusal.to_string());
        }
    }
    Ok(())
}

/// Whether a Service has an SCTP port.
pub(crate) fn has_sctp_port(svc: &k8s_openapi::api::core::v1::Service) -> bool {
    let ports = svc.spec.as_ref().and_then(|spec| spec.ports.as_deref());
    ports.is_some_and(|ports| ports.iter().any(|p| p.protocol.as_deref() == Some("SCTP")))
}

/// A full sync, or one that changed something, is worth a line; a no-op resync is not.
fn log_sync(
    full: bool,
    outcome: &Outcome,
    report: &ApplyReport,
    planner: &crate::plan::Planner,
    programmed: std::time::Duration,
    queued: Option<std::time::Duration>,
    started: Instant,
) {
    let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
    // Sync start to the last map write: what a change waits for (elapsed_ms adds the metrics,
    // health and Events work after it).
    let datapath_ms = programmed.as_secs_f64() * 1e3;
    // From the first watch event this sync took to its start (absent for a periodic sync):
    // queued_ms + datapath_ms is the agent's share of a change's latency.
    let queued_ms = queued.map(|q| q.as_secs_f64() * 1e3);
    if full || report.writes + report.deletes > 0 || !report.is_clean() {
        let desired = planner.desired();
        tracing::info!(
            full,
            services_recomputed = outcome.recomputed,
            service_ports = planner.totals().service_ports,
            frontends = desired.frontends.len(),
            backends = desired.backends.len(),
            writes = report.writes,
            deletes = report.deletes,
            datapath_ms,
            queued_ms,
            elapsed_ms,
            "data path programmed"
        );
    } else {
        tracing::debug!(
            services_recomputed = outcome.recomputed,
            elapsed_ms,
            "data path up to date"
        );
    }
}

/// Hands the memory a full sync freed back to the kernel. A full sync builds the whole desired
/// state anew (and, at start, the watch's initial lists come and go); glibc would otherwise keep
/// the freed pages of every thread's arena resident.
fn release_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks and releases the allocator's own free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}
