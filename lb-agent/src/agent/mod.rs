//! The agent process: load and attach the data path, adopt what a previous run left in the maps,
//! then keep the maps equal to the cluster's state until told to stop. On exit the programs stay
//! attached and the maps stay pinned, so traffic keeps flowing while the agent restarts or
//! upgrades.
//!
//! - this file: start-up ([`run`]), in the order that keeps a node serving: configuration, kernel
//!   features, the data path loaded and its pinned state adopted, servers, the watch's initial
//!   lists, a first sync, and only then the programs attached;
//! - `sync`: one sync, as a sequence of named steps;
//! - `program`: the steps of the line the agent shares with `lb-agent trace` ([`Programmer`]).
//!
//! Syncs are driven by kube-proxy's bounded-frequency runner (minSyncPeriod/syncPeriod): every
//! watched change requests one, requests are coalesced, and one runs at least every syncPeriod.

mod program;
mod sync;

use std::{
    cell::RefCell,
    collections::{BTreeSet, HashSet},
    rc::Rc,
    sync::Arc,
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result};
pub use program::Programmer;
pub(crate) use sync::{has_sctp_port, serve_sctp};
use tokio_util::sync::CancellationToken;

use self::sync::Agent;
use crate::{
    apply::Applier,
    bounded_frequency::BoundedFrequencyRunner,
    cli::{RunArgs, parse_bind_address},
    config,
    datapath::{self, Datapath, PinPaths, cgroup, tc},
    events::EventPublisher,
    health::{self, ProxyHealth, ServiceHealthServers},
    metrics::{self, Metrics},
    watch::{kube::KubeSource, manifests},
};

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

/// Where the agent gets the cluster's state.
pub(crate) enum Source {
    Manifests(manifests::Manifests),
    Kube(KubeSource),
}

/// Builds a client from `--kubeconfig` (or the in-cluster/default configuration) and `--master`.
/// Socket termination (`datapath::sockets`), with a start-up line either way.
fn start_socket_termination(
    cgroup_root: &std::path::Path,
    host_only: bool,
    metrics: &Metrics,
) -> Option<datapath::sockets::SocketTerminator> {
    match datapath::sockets::SocketTerminator::start(cgroup_root.to_path_buf(), host_only, metrics.clone()) {
        Ok(t) => {
            match t.scope() {
                datapath::sockets::Scope::Pods => tracing::info!(
                    cgroup = %cgroup_root.display(),
                    "connected UDP sockets to removed backends are aborted (netlink SOCK_DESTROY in \
                     the network namespaces of the processes in the cgroup)"
                ),
                datapath::sockets::Scope::NodeOnly(why) => tracing::warn!(
                    "connected UDP sockets to removed backends are aborted in the node's network \
                     namespace only: {why}"
                ),
            }
            Some(t)
        }
        Err(e) => {
            tracing::warn!(
                "connected UDP sockets are not terminated when their backend is removed: {e}; such a \
                 socket keeps its removed backend until its application reconnects"
            );
            None
        }
    }
}

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
    let builder = kube::client::ClientBuilder::try_from(config)?;
    Ok(
        match crate::watch::rate::RateLimitLayer::new(args.kube_api_qps, args.kube_api_burst) {
            Some(limit) => builder.with_layer(&limit).build(),
            None => builder.build(),
        },
    )
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
    let Some(mut addr) = parse_bind_address(addr)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("{what} bind address"))?
    else {
        return Ok(());
    };
    // `[::]` on a node without IPv6: every IPv4 address instead (what Go does with `:port`).
    if addr.ip() == std::net::IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
        && crate::node::addresses::ipv6_disabled()
    {
        addr.set_ip(std::net::Ipv4Addr::UNSPECIFIED.into());
    }
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
    } else {
        config::validate(&args)?;
    }
    let mut settings = args.node.settings()?;
    let service_cluster_ip_range = args.node.service_cidrs()?;
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
    // Everything else that can be checked without touching the node, before anything is: a start
    // refused here leaves it exactly as it was (and one that fails later undoes what it changed,
    // `datapath::journal`).
    let cgroup_root = match &args.bpf.cgroup_root {
        Some(path) => path.clone(),
        None => cgroup::cgroup2_mount().context("finding the cgroup v2 mount")?,
    };
    cgroup::check_cgroup2_dir(&cgroup_root)
        .with_context(|| format!("--cgroup-root {}", cgroup_root.display()))?;
    for (what, addr) in [
        ("healthz", &args.healthz_bind_address),
        ("metrics", &args.metrics_bind_address),
    ] {
        parse_bind_address(addr)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("{what} bind address"))?;
    }
    // The Services come from the API server (its client built here: a bad kubeconfig stops the
    // start) or from a manifests folder.
    let api = match &args.manifests {
        Some(dir) => Err(dir.clone()),
        None => Ok(kube_client(&args).await?),
    };
    let caps = args.bpf.capacities();
    let paths = PinPaths::new(&args.bpf.root.bpf_root);
    let mut dp = Datapath::load(&paths, &caps, &object).context("loading the data path")?;
    let maps = dp.take_maps()?;
    let conntrack = dp.take_conntrack()?;
    // Off until this run's first conntrack GC pass rebuilt it (`datapath::ct_filter`): entries a
    // previous run's programs made may have no byte.
    if let Some(filters) = &conntrack.filters {
        filters
            .deactivate()
            .context("turning the egress flow filter off")?;
    }
    let applier = Applier::recover(maps, caps).context("reading the pinned maps")?;
    // The SCTP program now if the maps a previous start left hold SCTP frontends (they stay
    // served across the restart), else at the first sync with an SCTP port (`sync::serve_sctp`).
    if applier.serves_protocol(crate::model::Protocol::Sctp) {
        sync::serve_sctp(&mut dp, &mut settings)?;
    } else {
        dp.retire_sctp().context("emptying the SCTP program's slot")?;
    }
    let host_cookie = host_netns_cookie(kernel, &mut dp, &cgroup_root)?;
    let tcx = dp.enable_tcx(args.bpf.enable_tcx);
    if !args.bpf.no_tc {
        crate::node::masquerade::warn_if_ephemeral_overlap();
    }
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
        detect_local = %settings.detector_description(),
        ipv4_frontends = applier.occupancy().revnat.v4,
        ipv6_frontends = applier.occupancy().revnat.v6,
        "data path loaded (adopted {} frontend(s) from the pinned maps)",
        applier.occupancy().revnat.v4 + applier.occupancy().revnat.v6
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
    let (source, reporter) = match api {
        Err(dir) => (
            Source::Manifests(manifests::Manifests::new(&dir, &settings.node_name)),
            None,
        ),
        Ok(client) => {
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
            let service_cidrs = KubeSource::lists_service_cidrs(&client).await;
            let kube = KubeSource::start(
                client.clone(),
                &settings.node_name,
                service_cidrs,
                on_change,
                shutdown.clone(),
            );
            // Never program an empty cluster over a full one: wait for every initial list.
            while !kube.wait_ready(Duration::from_secs(30)).await {
                tracing::warn!(
                    "still waiting for the initial list of Services, EndpointSlices, ServiceCIDRs and the Node; the data path keeps its pinned state"
                );
            }
            (
                Source::Kube(kube),
                Some(EventPublisher::new(client, &settings.node_name)),
            )
        }
    };

    // Links and addresses that come and go (pod veths, bridge ports, node IPs) are seen at the
    // next sync: sync on each change, so tc attachments, the interface detector's pod interfaces
    // and the NodePort and masquerade addresses follow them; syncs for Service changes alone then
    // reuse the last dump of the node's network.
    let link_events = crate::node::LinkEvents::default();
    {
        let (run, shutdown) = (handle.clone(), shutdown.clone());
        if let Err(e) = crate::node::interfaces::watch_links(link_events.clone(), move || {
            run.run();
            !shutdown.is_cancelled()
        }) {
            tracing::warn!("cannot watch the links ({e}): they are rescanned at every sync only");
        }
    }

    let sockets = start_socket_termination(&cgroup_root, args.bpf.bpf_lb_sock_hostns_only, &metrics);
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
        sockets,
        programmer: Programmer::new(
            settings.clone(),
            host_cookie,
            args.bpf.bpf_lb_sock_hostns_only,
            applier,
        ),
        devices,
        metrics: metrics.clone(),
        health: health.clone(),
        // Every address of each family, as kube-proxy with the default nodePortAddresses.
        service_health: ServiceHealthServers::new(Vec::new(), health),
        source,
        problems: Vec::new(),
        manifest_problems: BTreeSet::new(),
        service_cluster_ip_range,
        local_network: crate::node::LocalNetworkCache::new(link_events),
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
    if !first_sync(&agent, args.sync_period.min(Duration::from_secs(1)), &shutdown).await {
        tracing::info!(
            "stopping before the data path was attached: what this start pinned is removed, and the programs attached before, if any, keep serving"
        );
        return Ok(());
    }
    // The first sync held the bits of every frontend and backend; the flows of a previous run
    // need theirs too before the new programs may skip what the bits rule out.
    let prefilter = agent.borrow().programmer.maps().prefilter.clone();
    match conntrack.referenced() {
        Ok(referenced) => {
            if let Err(e) = agent
                .borrow_mut()
                .programmer
                .maps_mut()
                .prime_prefilter(&referenced)
            {
                tracing::warn!("the tc prefilter stays off (every packet takes the full path): {e}");
            }
        }
        Err(e) => tracing::warn!(
            "cannot read the conntrack maps, so the tc prefilter stays off (every packet takes the full path): {e}"
        ),
    }
    agent.borrow_mut().attach_programs()?;
    tracing::info!("data path attached");
    if !args.bpf.no_tc && !args.bpf.conntrack_gc_interval.is_zero() {
        spawn_conntrack_gc(
            conntrack,
            prefilter,
            caps,
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

/// Runs the first sync, retried every `retry` until it has programmed the maps; false when told to
/// stop first. A sync that failed before writing anything (the manifests folder unreadable, say)
/// leaves the `lb_config` entry of a new install or of an upgrade (a new layout version, a new
/// pin) unconfigured and the maps this release added empty: programs attached then would run
/// without a masquerade address, the node's namespace cookie or the affinity members (the
/// programs they replace, if any, keep serving meanwhile with what they had). A sync that got as
/// far as the maps (its failure is a map write, retried at the next sync) or that failed over
/// maps a previous run of this release configured lets the programs be attached as before.
async fn first_sync(agent: &RefCell<Agent>, retry: Duration, shutdown: &CancellationToken) -> bool {
    loop {
        let result = agent.borrow_mut().sync();
        let Err(e) = result else { return true };
        tracing::error!("first sync: {e:#}");
        let configured = agent
            .borrow()
            .programmer
            .maps()
            .datapath_config()
            .is_some_and(|c| c != lb_common::config::DatapathConfig::UNCONFIGURED);
        if configured {
            return true;
        }
        tracing::warn!(
            "the data path is not programmed yet: its programs are not attached (nor swapped in) until a \
             sync programs it; retrying in {retry:?}"
        );
        tokio::select! {
            _ = shutdown.cancelled() => return false,
            _ = tokio::time::sleep(retry) => {}
        }
    }
}

/// The conntrack GC (`datapath::conntrack`), on its own thread: a pass walks the whole map with a
/// syscall or two per entry, which must not delay a sync.
fn spawn_conntrack_gc(
    mut maps: crate::datapath::conntrack::ConntrackMaps,
    prefilter: crate::apply::prefilter::Prefilter,
    capacity: lb_common::catalog::Capacities,
    interval: Duration,
    timeouts: crate::datapath::conntrack::GcTimeouts,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let spawned = std::thread::Builder::new()
        .name("conntrack-gc".into())
        .spawn(move || {
            // The first pass soon (it turns the egress flow filter on, `datapath::ct_filter`),
            // a second after the programs were attached: an earlier run's programs, which may
            // not set the filter's bytes, have long returned by then.
            let mut next = std::time::Instant::now() + interval.min(Duration::from_secs(1));
            while !shutdown.is_cancelled() {
                if std::time::Instant::now() < next {
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
                next = std::time::Instant::now() + interval;
                let mut referenced = Default::default();
                let mut tracked = Default::default();
                match maps.collect_noting(
                    crate::time::monotonic_coarse_ns(),
                    &timeouts,
                    &mut referenced,
                    &mut tracked,
                ) {
                    Ok(report) => {
                        // The egress flow filter rewritten from the same scan (and on from the first).
                        if let Some(filters) = &maps.filters {
                            // A filter this pass could not rewrite stays as it was: the programs
                            // keep writing its generation, so no tracked flow loses its byte.
                            match filters.rebuild(&tracked) {
                                Ok(rebuilt) => {
                                    for (family, r) in crate::family::IpFamily::ALL.iter().zip(rebuilt) {
                                        metrics.set_ct_filter_buckets(family.as_str(), u64::from(r.held));
                                    }
                                    if !rebuilt[0].was_active {
                                        tracing::info!(
                                            buckets = ?rebuilt.map(|r| r.held),
                                            "egress flow filter on: packets of untracked flows skip the conntrack lookups"
                                        );
                                    }
                                }
                                Err(e) => tracing::warn!("egress flow filter not rebuilt after this GC pass: {e}"),
                            }
                        }
                        for (reason, n) in &report.deleted {
                            metrics.conntrack_gc_deleted(reason.label(), *n);
                        }
                        for (family, (left, left_new)) in crate::family::IpFamily::ALL
                            .iter()
                            .zip(report.left.into_iter().zip(report.left_new))
                        {
                            let maps = family.maps();
                            metrics.set_map_occupancy(
                                maps.conntrack,
                                left as u64,
                                u64::from(capacity.conntrack),
                            );
                            metrics.set_map_occupancy(
                                maps.conntrack_new,
                                left_new as u64,
                                u64::from(capacity.conntrack_new),
                            );
                        }
                        // The bits only ended flows and removed Services needed go now.
                        let bits = match prefilter.rebuild(&referenced) {
                            Ok(r) => {
                                for (family, n) in crate::family::IpFamily::ALL.iter().zip(r.bits_set) {
                                    metrics.set_prefilter_bits(family.as_str(), u64::from(n));
                                }
                                r.bits_set
                            }
                            Err(e) => {
                                tracing::warn!("tc prefilter rebuild failed (retried next interval): {e}");
                                [0; 2]
                            }
                        };
                        tracing::debug!(
                            scanned = report.scanned,
                            deleted = ?report.deleted,
                            took_ms = report.took.as_millis() as u64,
                            prefilter_bits = ?bits,
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
