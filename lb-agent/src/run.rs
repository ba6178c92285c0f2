//! The agent: load and attach the data path, adopt what a previous run left in the maps, then keep
//! the maps equal to the cluster's state (watch -> model -> plan -> maps) until told to stop. On
//! exit the programs stay attached and the maps stay pinned, so traffic keeps flowing while the
//! agent restarts or upgrades.
//!
//! Syncs are driven by a bounded-frequency runner (kube-proxy's minSyncPeriod/syncPeriod): every
//! watched change requests one, requests are coalesced, and one runs at least every syncPeriod.

use std::{
    cell::RefCell,
    collections::{BTreeMap, BTreeSet, HashSet},
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    rc::Rc,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource;
use lb_common::{
    config::{self as dpconfig, Cidr4, DatapathConfig, MAX_CLUSTER_CIDRS},
    maps as names,
    stats::Counter,
};
use tokio_util::sync::CancellationToken;

use crate::{
    cli::{RunArgs, parse_bind_address},
    config,
    datapath::{self, Datapath, PinPaths, cgroup, tc},
    health::{self, ProxyHealth, ServiceHealthServers},
    maps::{Applier, KernelMaps, MapOps},
    metrics::{self, Metrics},
    node::{self, NodePortAddress},
    plan::NodeContext,
    runner::BoundedFrequencyRunner,
    sync::{self, Synchronizer, Totals},
    watch::{
        kube::{KubeSource, PendingChanges, ProblemReporter, Report},
        manifests,
    },
};

/// The system hostname, lowercased as kube-proxy does.
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_default()
        .trim()
        .to_lowercase()
}

/// The cookie of the node's network namespace (the agent's own), which the socket programs
/// compare against: from `SO_NETNS_COOKIE`, or on kernels without it from `lb_probe_netns`.
fn host_netns_cookie(
    kernel: &datapath::features::KernelFeatures,
    dp: &mut Datapath,
    cgroup_root: &std::path::Path,
) -> Result<u64> {
    if kernel.netns_cookie_sockopt {
        return datapath::features::own_netns_cookie().context("reading this network namespace's cookie");
    }
    match dp.probe_netns_cookie(cgroup_root) {
        Ok(Some(cookie)) => Ok(cookie),
        Ok(None) => {
            tracing::error!(
                cgroup = %cgroup_root.display(),
                "cannot identify the node's network namespace: this agent does not run inside \
                 --cgroup-root, and kernel {} has no SO_NETNS_COOKIE (5.14); rules for traffic \
                 from the node itself (localhost NodePorts, --bpf-lb-sock-hostns-only, \
                 loadBalancerSourceRanges containing a node IP) apply to no socket",
                kernel.release
            );
            Ok(0)
        }
        Err(e) => Err(e).context("probing this network namespace's cookie"),
    }
}

/// Settings resolved from flags and the config file.
#[derive(Clone, Debug)]
pub struct NodeSettings {
    pub node_name: String,
    pub cluster_cidrs: Vec<ipnet::Ipv4Net>,
    pub nodeport_addresses: Vec<NodePortAddress>,
    pub masquerade_all: bool,
    pub localhost_nodeports: bool,
    pub bind_address: Option<Ipv4Addr>,
}

impl NodeSettings {
    pub fn from_args(
        args: &crate::cli::NodeArgs,
        localhost_nodeports: bool,
        bind_address: Option<Ipv4Addr>,
    ) -> Result<Self> {
        let mut cluster_cidrs = Vec::new();
        for cidr in &args.cluster_cidr {
            match cidr.trim().parse::<ipnet::IpNet>() {
                Ok(ipnet::IpNet::V4(v4)) => cluster_cidrs.push(v4.trunc()),
                Ok(ipnet::IpNet::V6(_)) => {} // the IPv6 detector belongs to the IPv6 data path
                Err(e) => anyhow::bail!("--cluster-cidr {cidr:?}: {e}"),
            }
        }
        if cluster_cidrs.len() > MAX_CLUSTER_CIDRS {
            anyhow::bail!("--cluster-cidr: at most {MAX_CLUSTER_CIDRS} IPv4 CIDRs are supported");
        }
        let nodeport_addresses = args
            .nodeport_addresses
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.parse::<NodePortAddress>().map_err(anyhow::Error::msg))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            node_name: args
                .hostname_override
                .clone()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(hostname)
                .to_lowercase(),
            cluster_cidrs,
            nodeport_addresses,
            masquerade_all: args.masquerade_all,
            localhost_nodeports,
            bind_address,
        })
    }

    /// The plan's node context, from this node's addresses and Node object.
    pub fn node_context(&self, local_addresses: &[Ipv4Addr], node_primary: &[Ipv4Addr]) -> NodeContext {
        let mut primary = node_primary.to_vec();
        if primary.is_empty() {
            primary.extend(self.bind_address);
        }
        let selection = node::select_nodeport_addresses(&self.nodeport_addresses, local_addresses, &primary);
        NodeContext {
            nodeport_addresses: selection.addresses,
            localhost_nodeports: selection.loopback && self.localhost_nodeports,
            node_ips: primary,
            masquerade_all: self.masquerade_all,
            cluster_cidr_configured: !self.cluster_cidrs.is_empty(),
        }
    }

    /// The `lb_config` entry. `snat` is the node IP masqueraded flows get as their source.
    pub fn datapath_config(
        &self,
        host_netns_cookie: u64,
        sock_hostns_only: bool,
        snat: Ipv4Addr,
    ) -> DatapathConfig {
        let mut cfg = DatapathConfig {
            host_netns_cookie,
            snat_addr: snat.octets(),
            snat_port_min: dpconfig::SNAT_PORT_MIN,
            snat_port_max: dpconfig::SNAT_PORT_MAX,
            ..DatapathConfig::default()
        };
        if sock_hostns_only {
            cfg.flags |= dpconfig::flags::SOCK_HOSTNS_ONLY;
        }
        for (slot, cidr) in cfg.cluster_cidrs.iter_mut().zip(&self.cluster_cidrs) {
            *slot = Cidr4::new(cidr.network().octets(), cidr.prefix_len());
        }
        cfg.cluster_cidr_count = self.cluster_cidrs.len().min(MAX_CLUSTER_CIDRS) as u32;
        cfg
    }
}

/// Where the agent gets the cluster's state.
enum Source {
    Manifests(manifests::Manifests),
    Kube(KubeSource),
}

/// What the agent keeps between syncs.
struct Agent {
    datapath: Datapath,
    /// The cgroup the socket programs attach to, once the first sync has filled the maps.
    cgroup_root: PathBuf,
    cgroup_attached: bool,
    applier: Applier<KernelMaps>,
    settings: NodeSettings,
    host_cookie: u64,
    sock_hostns_only: bool,
    devices: Option<Vec<tc::DevicePattern>>,
    config_written: Option<DatapathConfig>,
    metrics: Metrics,
    health: ProxyHealth,
    service_health: ServiceHealthServers,
    source: Source,
    /// Steps 2 and 3, kept between syncs (one changed Service costs one Service's work).
    synchronizer: Synchronizer,
    /// Problems of the last sync, for Events: (namespace, name, reason, message).
    problems: Vec<Report>,
    /// Bad files and objects of the manifests folder at the last sync (each is logged once).
    manifest_problems: BTreeSet<manifests::Problem>,
}

impl Agent {
    /// One sync: bring the desired state up to date and write the difference. Only the Services
    /// the watch marked dirty are recomputed and only what changed is written; everything is
    /// recomputed (and compared with the maps) after a relist, when the node's facts change,
    /// and for manifests, which have no watch.
    fn sync(&mut self) -> Result<()> {
        let started = Instant::now();
        let (pending, manifests_state) = match &mut self.source {
            Source::Kube(kube) => (kube.take_pending(), None),
            Source::Manifests(folder) => {
                let loaded = folder
                    .load()
                    .with_context(|| format!("loading the manifests of {}", folder.dir().display()))?;
                // Logged when they appear, like the model's problems.
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
                (PendingChanges::default(), Some(loaded.state))
            }
        };
        let node = match (&self.source, &manifests_state) {
            (_, Some(state)) => state.node.clone(),
            (Source::Kube(kube), None) => kube.node(),
            (Source::Manifests(_), None) => None,
        };
        let settings = &self.settings;
        if let Some(node) = node.as_deref() {
            self.health.set_node(node);
        }
        let info = sync::node_info(&settings.node_name, node.as_deref());
        let locals = node::local_addresses().context("listing this node's addresses")?;
        let ctx = settings.node_context(&locals, &sync::node_primary_ips(node.as_deref()));
        // Masqueraded flows leave with the node's primary IP (else its first NodePort address).
        let snat = ctx
            .node_ips
            .first()
            .or(ctx.nodeport_addresses.first())
            .copied()
            .unwrap_or(Ipv4Addr::UNSPECIFIED);
        let config = settings.datapath_config(self.host_cookie, self.sock_hostns_only, snat);
        if self.config_written != Some(config) {
            self.applier
                .maps_mut()
                .put_config(&config)
                .context("writing the datapath configuration")?;
            self.config_written = Some(config);
        }
        let full =
            pending.relisted || manifests_state.is_some() || !self.synchronizer.is_current(&info, &ctx);
        let (outcome, report) = match &self.source {
            Source::Kube(kube) if !full => {
                let outcome = self
                    .synchronizer
                    .update(&pending.dirty, |key| kube.service_inputs(key));
                let report = self
                    .applier
                    .apply_changes(self.synchronizer.desired(), &outcome.changes);
                (outcome, report)
            }
            _ => {
                let state = match (manifests_state, &self.source) {
                    (Some(state), _) => state,
                    (None, Source::Kube(kube)) => kube.state(),
                    (None, Source::Manifests(_)) => unreachable!("manifests are loaded above"),
                };
                let outcome = self.synchronizer.rebuild(&state, &info, &ctx);
                let report = self.applier.apply(self.synchronizer.desired());
                drop(state);
                release_freed_memory();
                (outcome, report)
            }
        };
        if self.cgroup_attached {
            self.attach_tc();
        }

        // Problems are logged when they appear; Events are published from the current set.
        for p in &outcome.new_problems {
            tracing::warn!(kind = p.kind, namespace = %p.namespace, name = %p.name, "{}", p.message);
        }
        self.problems = self
            .synchronizer
            .problems()
            .into_iter()
            .map(|p| (p.namespace, p.name, "InvalidService", p.message))
            .collect();
        let mut skipped_reasons: Vec<(&str, usize)> = Vec::new();
        for (service, reason) in &report.skipped {
            tracing::error!(service = %service, "not programmed: {reason}");
            self.problems.push((
                service.namespace.clone(),
                service.name.clone(),
                "MapFull",
                format!("not programmed: {reason}"),
            ));
        }
        if !report.skipped.is_empty() {
            skipped_reasons.push(("map_full", report.skipped.len()));
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
        let totals = self.synchronizer.totals();
        self.record_metrics(&totals, &report, &pending, started);
        let health_checks = health::targets_from_health_checks(&self.synchronizer.health_checks());
        for e in self.service_health.sync(&health_checks) {
            tracing::warn!("health check server: {e}");
        }
        self.metrics.set_services_skipped(&skipped_reasons);
        if report.errors.is_empty() {
            self.health.updated();
            self.metrics.sync_succeeded(SystemTime::now());
        }
        let desired = self.synchronizer.desired();
        let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        // A full sync, or one that changed something, is worth a line; a no-op resync is not.
        let level_info = full || report.writes + report.deletes > 0 || !report.is_clean();
        if level_info {
            tracing::info!(
                full,
                services_recomputed = outcome.recomputed,
                service_ports = totals.service_ports,
                frontends = desired.frontends.len(),
                backends = desired.backends.len(),
                writes = report.writes,
                deletes = report.deletes,
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
        if !report.errors.is_empty() {
            anyhow::bail!("{} map update(s) failed; retrying", report.errors.len());
        }
        Ok(())
    }

    /// The Services the current problems are about, for their Events.
    fn problem_references(&self) -> BTreeMap<(String, String), ObjectReference> {
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
    fn attach_programs(&mut self) -> Result<()> {
        self.datapath
            .attach_cgroup(&self.cgroup_root)
            .context("attaching the socket programs")?;
        self.cgroup_attached = true;
        self.attach_tc();
        if self.datapath.migrating() {
            self.datapath.finish_migration();
        }
        Ok(())
    }

    /// Attaches the tc programs to the selected interfaces that are up, and detaches them from
    /// interfaces that went away (rescanned at every sync: pod veths come and go).
    fn attach_tc(&mut self) {
        let Some(patterns) = &self.devices else { return };
        let up = match tc::interfaces_up() {
            Ok(up) => up,
            Err(e) => {
                tracing::error!("listing interfaces: {e}");
                return;
            }
        };
        let wanted = tc::select_devices(patterns, &up);
        for (name, index) in &wanted {
            if let Err(e) = self.datapath.attach_tc(name, *index) {
                tracing::error!(device = %name, "attaching the tc programs: {e}");
            }
        }
        for gone in self.datapath.detach_tc_except(&wanted) {
            tracing::info!(device = %gone, "detached the tc programs");
        }
    }

    fn record_metrics(
        &self,
        totals: &Totals,
        report: &crate::maps::ApplyReport,
        pending: &PendingChanges,
        started: Instant,
    ) {
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
        m.set_no_local_endpoints(totals.no_local_internal, totals.no_local_external);
        let caps = self.applier.capacities();
        let occ = self.applier.occupancy();
        for (name, used, cap) in [
            (names::SERVICES, occ.services, caps.services),
            (names::BACKENDS, occ.backends, caps.backends),
            (names::REVNAT, occ.revnat, caps.revnat),
            (names::AFFINITY_MATCH, occ.affinity_match, caps.affinity_match),
            (names::SOURCE_RANGES, occ.source_ranges, caps.source_ranges),
        ] {
            m.set_map_occupancy(name, u64::from(used), u64::from(cap));
        }
        let events: Vec<(&str, u64)> = Counter::ALL
            .iter()
            .map(|c| (c.name(), self.applier.maps().counter(*c as u32)))
            .collect();
        m.set_datapath_events(&events);
        for e in &report.errors {
            let map = names::ALL
                .iter()
                .find(|n| e.contains(*n))
                .copied()
                .unwrap_or("unknown");
            m.map_write_errors(map, 1);
        }
    }
}

/// Builds a client from `--kubeconfig` (or the in-cluster/default configuration) and `--master`.
async fn kube_client(args: &RunArgs) -> Result<kube::Client> {
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
                .await?
        }
        None => kube::Config::infer()
            .await
            .context("no --kubeconfig, and neither in-cluster nor ~/.kube/config configuration works")?,
    };
    if let Some(master) = &args.master {
        config.cluster_url = master
            .parse()
            .with_context(|| format!("--master {master:?} is not a URL"))?;
    }
    Ok(kube::Client::try_from(config)?)
}

/// Binds a server or fails with a clear message.
/// Serves `what` on `addr` in the background; a bind failure (say, kube-proxy still holds the
/// port) is logged and retried every 5 s, as kube-proxy does without --bind-address-hard-fail.
fn spawn_server<F>(
    what: &str,
    addr: &str,
    shutdown: &CancellationToken,
    serve: impl Fn(std::net::SocketAddr, CancellationToken) -> F + Send + 'static,
) -> Result<()>
where
    F: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let Some(addr) = parse_bind_address(addr)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("{what} bind address"))?
    else {
        return Ok(());
    };
    let what = what.to_string();
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        loop {
            match serve(addr, shutdown.clone()).await {
                Ok(()) => return,
                Err(e) => tracing::error!("{what} server on {addr}: {e:#}; retrying in 5s"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
            }
        }
    });
    Ok(())
}

pub async fn run(mut args: RunArgs, explicit: HashSet<String>) -> Result<()> {
    if let Some(path) = args.config.clone() {
        let loaded = config::load_file(&path)?;
        for w in &loaded.warnings {
            match w.kind {
                config::WarningKind::Unknown => tracing::warn!(field = %w.path, "{}", w.message),
                config::WarningKind::NotUsed if !w.value_is_empty => {
                    tracing::warn!(field = %w.path, "{}", w.message)
                }
                _ => tracing::info!(field = %w.path, "{}", w.message),
            }
        }
        for note in config::merge(&loaded.config, &mut args, &explicit)? {
            tracing::info!("{note}");
        }
    }
    let settings = NodeSettings::from_args(&args.node, args.iptables_localhost_nodeports, args.bind_address)?;
    // The kernel before anything is loaded or pinned: refuse one the data path cannot run on,
    // and say what changes on one that lacks a feature with a fallback.
    let kernel = datapath::features::current()?;
    kernel.check()?;
    for (feature, fallback) in kernel.fallbacks() {
        tracing::warn!(
            kernel = %kernel.release,
            since = feature.since,
            "this kernel lacks {}: {fallback}",
            feature.name
        );
    }
    let object = datapath::object_bytes(args.bpf.bpf_object.as_deref())?;
    let caps = args.bpf.capacities();
    let paths = PinPaths::new(&args.bpf.root.bpf_root);
    let mut dp = Datapath::load(&paths, &caps, &object).context("loading the data path")?;
    let cgroup_root = match &args.bpf.cgroup_root {
        Some(path) => path.clone(),
        None => cgroup::cgroup2_mount().context("finding the cgroup v2 mount")?,
    };
    let maps = dp.take_maps()?;
    let conntrack = dp.take_conntrack()?;
    let applier = Applier::recover(maps, caps).context("reading the pinned maps")?;
    cgroup::check_cgroup2_dir(&cgroup_root)
        .with_context(|| format!("--cgroup-root {}", cgroup_root.display()))?;
    let host_cookie = host_netns_cookie(kernel, &mut dp, &cgroup_root)?;
    let tcx = dp.enable_tcx(args.bpf.enable_tcx);
    if !args.bpf.no_tc && !tcx {
        tracing::info!(
            kernel_has_tcx = kernel.tcx,
            "tc programs attach as clsact filters at priority {} handle {:#x}",
            datapath::tc::CLSACT_PRIORITY,
            u32::from(datapath::tc::CLSACT_HANDLE)
        );
    }
    tracing::info!(
        node = %settings.node_name,
        bpf_root = %paths.root.display(),
        cgroup = %cgroup_root.display(),
        frontends = applier.occupancy().revnat,
        "data path loaded (adopted {} frontend(s) from the pinned maps)",
        applier.occupancy().revnat
    );

    let shutdown = CancellationToken::new();
    let metrics = Metrics::new();
    let health = ProxyHealth::new(health::health_timeout_for(args.sync_period)).with_metrics(metrics.clone());
    {
        let h = health.clone();
        spawn_server(
            "healthz",
            &args.healthz_bind_address,
            &shutdown,
            move |addr, s| health::serve_proxy_health(addr, h.clone(), s),
        )?;
        let m = metrics.clone();
        spawn_server(
            "metrics",
            &args.metrics_bind_address,
            &shutdown,
            move |addr, s| metrics::serve_metrics(addr, m.clone(), s),
        )?;
    }

    let runner = BoundedFrequencyRunner::new(
        args.min_sync_period,
        args.sync_period.min(Duration::from_secs(1)),
        args.sync_period,
    );
    let handle = runner.handle();
    let (source, reporter) = match &args.manifests {
        Some(dir) => (
            Source::Manifests(manifests::Manifests::new(dir, &settings.node_name)),
            None,
        ),
        None => {
            let client = kube_client(&args).await?;
            match tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await {
                Ok(Ok(v)) => tracing::info!(version = %v.git_version, "connected to the API server"),
                Ok(Err(e)) => tracing::error!(
                    "cannot reach the API server: {e}; retrying in the background (the pinned data path keeps serving)"
                ),
                Err(_) => tracing::error!(
                    "the API server did not answer within 10s; retrying in the background (the pinned data path keeps serving)"
                ),
            }
            let (h, m, run) = (health.clone(), metrics.clone(), handle.clone());
            let on_change = Arc::new(move |_| {
                h.queued_update();
                m.sync_queued(SystemTime::now());
                run.run();
            });
            let kube = KubeSource::start(client.clone(), &settings.node_name, on_change, shutdown.clone());
            // Never program an empty cluster over a full one: wait for every initial list.
            while !kube.wait_ready(Duration::from_secs(30)).await {
                tracing::warn!(
                    "still waiting for the initial list of Services, EndpointSlices and the Node; the data path keeps its pinned state"
                );
            }
            (
                Source::Kube(kube),
                Some(ProblemReporter::new(client, &settings.node_name)),
            )
        }
    };

    let devices = (!args.bpf.no_tc).then(|| {
        args.bpf
            .devices
            .iter()
            .map(|d| tc::DevicePattern::parse(d))
            .collect()
    });
    let agent = Rc::new(RefCell::new(Agent {
        datapath: dp,
        cgroup_root,
        cgroup_attached: false,
        applier,
        settings: settings.clone(),
        host_cookie,
        sock_hostns_only: args.bpf.bpf_lb_sock_hostns_only,
        devices,
        config_written: None,
        metrics: metrics.clone(),
        health: health.clone(),
        service_health: ServiceHealthServers::new(vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)], health),
        source,
        synchronizer: Synchronizer::new(),
        problems: Vec::new(),
        manifest_problems: BTreeSet::new(),
    }));

    {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            }
            shutdown.cancel();
        });
    }
    // The first sync fills the maps; only then are the programs attached (or swapped in).
    if let Err(e) = agent.borrow_mut().sync() {
        tracing::error!("first sync: {e:#}");
    }
    agent.borrow_mut().attach_programs()?;
    tracing::info!("data path attached");
    if !args.bpf.no_tc && !args.bpf.conntrack_gc_interval.is_zero() {
        spawn_conntrack_gc(
            conntrack,
            args.bpf.conntrack_gc_interval,
            args.bpf.conntrack_timeouts(),
            metrics.clone(),
            shutdown.clone(),
        );
    }
    let reporter = Rc::new(reporter);
    runner
        .run_loop(
            || {
                let agent = agent.clone();
                let reporter = reporter.clone();
                async move {
                    let result = agent.borrow_mut().sync();
                    if let Some(reporter) = reporter.as_ref() {
                        let (problems, services) = {
                            let a = agent.borrow();
                            (a.problems.clone(), a.problem_references())
                        };
                        reporter.report(&problems, &services).await;
                    }
                    result
                }
            },
            shutdown.clone(),
        )
        .await;
    agent.borrow_mut().service_health.close_all();
    tracing::info!("stopping; the data path stays attached and keeps serving");
    Ok(())
}

/// The conntrack GC (`maps::conntrack`), on its own thread: a pass walks the whole map with a
/// syscall or two per entry, which must not delay a sync.
fn spawn_conntrack_gc(
    mut map: aya::maps::HashMap<
        aya::maps::MapData,
        lb_common::conntrack::Ct4Key,
        lb_common::conntrack::Ct4Value,
    >,
    interval: Duration,
    timeouts: crate::maps::conntrack::GcTimeouts,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    use crate::maps::conntrack;
    let spawned = std::thread::Builder::new()
        .name("conntrack-gc".into())
        .spawn(move || {
            let mut next = std::time::Instant::now() + interval;
            while !shutdown.is_cancelled() {
                if std::time::Instant::now() < next {
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
                next = std::time::Instant::now() + interval;
                match conntrack::collect(&mut map, conntrack::now_ns(), &timeouts) {
                    Ok(report) => {
                        for (reason, n) in &report.deleted {
                            metrics.conntrack_gc_deleted(reason.label(), *n);
                        }
                        tracing::debug!(
                            scanned = report.scanned,
                            deleted = ?report.deleted,
                            took_ms = report.took.as_millis() as u64,
                            "conntrack GC pass"
                        );
                    }
                    Err(e) => tracing::warn!("conntrack GC pass failed (retried next interval): {e}"),
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!(
            "cannot start the conntrack GC thread: {e}; ended flows are freed only by LRU eviction"
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
