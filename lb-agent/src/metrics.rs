//! What the agent exports on `--metrics-bind-address`: kube-proxy's metric names, so that existing
//! dashboards and alerts keep working, plus the agent's own `lb_*` metrics about the BPF maps and the data
//! path. Mirrors `pkg/proxy/metrics/metrics.go` (names, help texts, types, label names and histogram
//! buckets) and the `/metrics` endpoint kube-proxy serves in `cmd/kube-proxy/app/server.go`.
//!
//! | metric | type | labels | set by |
//! |---|---|---|---|
//! | `kubeproxy_sync_proxy_rules_duration_seconds` | histogram, `ExponentialBuckets(0.001, 2, 15)` | | [`Metrics::observe_sync_duration`] |
//! | `kubeproxy_sync_proxy_rules_last_timestamp_seconds` | gauge | | [`Metrics::sync_succeeded`] |
//! | `kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds` | gauge | | [`Metrics::sync_queued`] |
//! | `kubeproxy_network_programming_duration_seconds` | histogram, upstream's merged linear buckets | | [`Metrics::observe_network_programming`] |
//! | `kubeproxy_sync_proxy_rules_endpoint_changes_total` | counter | | [`Metrics::endpoint_changes`] |
//! | `kubeproxy_sync_proxy_rules_endpoint_changes_pending` | gauge | | [`Metrics::set_endpoint_changes_pending`] |
//! | `kubeproxy_sync_proxy_rules_service_changes_total` | counter | | [`Metrics::service_changes`] |
//! | `kubeproxy_sync_proxy_rules_service_changes_pending` | gauge | | [`Metrics::set_service_changes_pending`] |
//! | `kubeproxy_sync_proxy_rules_no_local_endpoints_total` | **gauge** (as upstream, despite the name) | `traffic_policy` = `internal`/`external` | [`Metrics::set_no_local_endpoints`] |
//! | `kubeproxy_proxy_healthz_total` | counter | `code` | [`Metrics::proxy_healthz`] (the health server) |
//! | `kubeproxy_proxy_livez_total` | counter | `code` | [`Metrics::proxy_livez`] (the health server) |
//! | `lb_map_entries` | gauge | `map` | [`Metrics::set_map_occupancy`] (service maps, `lb_maglev`'s tables, at each sync; `lb4_ct`/`lb6_ct`/`lb4_ct_new`/`lb6_ct_new` after each conntrack GC pass) |
//! | `lb_map_capacity` | gauge | `map` | [`Metrics::set_map_occupancy`] |
//! | `lb_datapath_events_total` | counter | `event` | [`Metrics::set_datapath_events`] (absolute totals) |
//! | `lb_map_write_errors_total` | counter | `map` | [`Metrics::map_write_errors`] |
//! | `lb_services_skipped` | gauge | `reason` | [`Metrics::set_services_skipped`] |
//! | `lb_conntrack_gc_deleted_total` | counter | `reason` = `closed`/`handshake`/`idle`/`orphan` | [`Metrics::conntrack_gc_deleted`] |
//! | `lb_sockets_terminated_total` | counter | | [`Metrics::sockets_terminated`] (`datapath::sockets`) |
//! | `lb_tc_prefilter_bits` | gauge | `ip_family` = `IPv4`/`IPv6` | [`Metrics::set_prefilter_bits`] (after each conntrack GC pass) |
//! | `lb_tc_ct_filter_buckets` | gauge | `ip_family` = `IPv4`/`IPv6` | [`Metrics::set_ct_filter_buckets`] (after each conntrack GC pass) |
//! | `process_resident_memory_bytes` | gauge | | [`ProcessMemory`], at each scrape (`/proc/self/statm`; the name Go's process collector gives it in kube-proxy's output) |
//! | `lb_agent_heap_bytes` | gauge | `state` = `in_use`/`free`/`mmapped` | [`ProcessMemory`], at each scrape (glibc's `mallinfo2`: what the heap holds for the agent, what it keeps freed, what it mapped apart; a leak grows `in_use`, allocator retention `free`) |
//!
//! Not exported: the iptables/ipvs/nftables-specific metrics (`..._iptables_restore_failures_total`,
//! `..._iptables_total`, `..._nftables_sync_failures_total`, `kubeproxy_conntrack_reconciler_*`, ...),
//! which have no meaning for the eBPF data path, and the partial/full sync split. kube-proxy's newest
//! metrics reference also lists an `ip_family` label on some of these metrics; this agent is IPv4-only and
//! keeps the label-less form of `metrics.go`.
//!
//! The exposition is OpenMetrics text (`application/openmetrics-text; version=1.0.0`), which Prometheus
//! negotiates by default; counters carry the `_total` suffix there exactly as in kube-proxy's output.
//!
//! `lb_datapath_events_total` is fed with the absolute totals summed from the per-CPU stats map. Counter
//! semantics require it never to go down while the process lives, so the exporter tracks increments: when
//! a total drops (the stats map was recreated, e.g. after a `cleanup`), the new total counts as the
//! increment since the reset and the exported counter keeps growing.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    sync::{Arc, Mutex, atomic::AtomicU64},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context;
use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        MetricType,
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets, linear_buckets},
    },
    registry::Registry,
};
use tokio_util::sync::CancellationToken;

/// The content type of `/metrics`.
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `kubeproxy_sync_proxy_rules_duration_seconds` buckets: `ExponentialBuckets(0.001, 2, 15)`.
pub fn sync_duration_buckets() -> Vec<f64> {
    exponential_buckets(0.001, 2.0, 15).collect()
}

/// `kubeproxy_network_programming_duration_seconds` buckets: upstream's `MergeBuckets` of
/// `LinearBuckets(0.25, 0.25, 2)`, `LinearBuckets(1, 1, 59)`, `LinearBuckets(60, 5, 12)` and
/// `LinearBuckets(120, 30, 7)`, which (like upstream's `merge`) starts with a 0 bucket.
pub fn network_programming_buckets() -> Vec<f64> {
    std::iter::once(0.0)
        .chain(linear_buckets(0.25, 0.25, 2))
        .chain(linear_buckets(1.0, 1.0, 59))
        .chain(linear_buckets(60.0, 5.0, 12))
        .chain(linear_buckets(120.0, 30.0, 7))
        .collect()
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TrafficPolicyLabels {
    traffic_policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabels {
    map: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FamilyLabels {
    ip_family: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// `lb_datapath_events_total`: counters fed with absolute totals (see the module documentation).
#[derive(Debug, Default)]
struct DatapathEvents {
    /// event -> (last total seen, exported counter value).
    totals: Mutex<BTreeMap<String, (u64, u64)>>,
}

impl DatapathEvents {
    const NAME: &'static str = "lb_datapath_events";
    const HELP: &'static str = "Packets and socket operations handled by the eBPF programs, by outcome";

    fn set(&self, totals: &[(&str, u64)]) {
        let mut map = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        for &(event, total) in totals {
            let entry = map.entry(event.to_string()).or_insert((0, 0));
            let (last, exported) = entry;
            // A smaller total means the source was reset: everything it counted since is new.
            let increment = if total >= *last { total - *last } else { total };
            *exported = exported.saturating_add(increment);
            *last = total;
        }
    }

    fn snapshot(&self) -> Vec<(String, u64)> {
        let map = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        map.iter()
            .map(|(event, (_, exported))| (event.clone(), *exported))
            .collect()
    }
}

impl Collector for DatapathEvents {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snapshot = self.snapshot();
        if snapshot.is_empty() {
            return Ok(());
        }
        let mut family = encoder.encode_descriptor(Self::NAME, Self::HELP, None, MetricType::Counter)?;
        for (event, value) in &snapshot {
            let labels = [("event", event.as_str())];
            let sample = family.encode_family(&labels)?;
            ConstCounter::new(*value).encode(sample)?;
        }
        Ok(())
    }
}

/// The agent's memory, read at each scrape: its resident set, and how its heap splits between
/// what the agent holds and what the allocator keeps (the soak tells growth of one from the
/// other).
#[derive(Debug, Default)]
struct ProcessMemory;

impl ProcessMemory {
    /// Resident bytes (`/proc/self/statm`'s second field, in pages).
    fn resident_bytes() -> Option<u64> {
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
        // SAFETY: sysconf reads a constant of the system.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        Some(pages * u64::try_from(page).ok()?)
    }

    /// The heap's bytes in use, free (kept by the allocator) and mapped apart, from glibc.
    #[cfg(target_env = "gnu")]
    fn heap() -> Option<[(&'static str, u64); 3]> {
        // SAFETY: mallinfo2 only reads the allocator's own statistics.
        let info = unsafe { libc::mallinfo2() };
        Some([
            ("in_use", info.uordblks as u64),
            ("free", info.fordblks as u64),
            ("mmapped", info.hblkhd as u64),
        ])
    }

    #[cfg(not(target_env = "gnu"))]
    fn heap() -> Option<[(&'static str, u64); 3]> {
        None
    }
}

impl Collector for ProcessMemory {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use prometheus_client::metrics::gauge::ConstGauge;
        if let Some(bytes) = Self::resident_bytes() {
            let metric = encoder.encode_descriptor(
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(bytes as i64).encode(metric)?;
        }
        if let Some(heap) = Self::heap() {
            let mut family = encoder.encode_descriptor(
                "lb_agent_heap_bytes",
                "The agent's heap (glibc malloc), by state: in use by the agent, free but kept by the allocator, mapped apart",
                None,
                MetricType::Gauge,
            )?;
            for (state, bytes) in heap {
                let labels = [("state", state)];
                let sample = family.encode_family(&labels)?;
                ConstGauge::new(bytes as i64).encode(sample)?;
            }
        }
        Ok(())
    }
}

struct Inner {
    registry: Registry,
    sync_duration: Histogram,
    last_sync: FloatGauge,
    last_queued: FloatGauge,
    network_programming: Histogram,
    endpoint_changes: Counter,
    endpoint_changes_pending: Gauge,
    service_changes: Counter,
    service_changes_pending: Gauge,
    no_local_endpoints: Family<TrafficPolicyLabels, Gauge>,
    healthz: Family<CodeLabels, Counter>,
    livez: Family<CodeLabels, Counter>,
    map_entries: Family<MapLabels, Gauge>,
    map_capacity: Family<MapLabels, Gauge>,
    datapath_events: Arc<DatapathEvents>,
    map_write_errors: Family<MapLabels, Counter>,
    services_skipped: Family<ReasonLabels, Gauge>,
    conntrack_gc_deleted: Family<ReasonLabels, Counter>,
    sockets_terminated: Counter,
    prefilter_bits: Family<FamilyLabels, Gauge>,
    ct_filter_buckets: Family<FamilyLabels, Gauge>,
    /// The label values currently in `services_skipped`.
    skipped_reasons: Mutex<BTreeSet<String>>,
}

/// The agent's metrics: cheap to clone (an `Arc`), every method takes `&self`.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn unix_seconds(t: SystemTime) -> f64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let sync_duration = Histogram::new(sync_duration_buckets());
        let last_sync = FloatGauge::default();
        let last_queued = FloatGauge::default();
        let network_programming = Histogram::new(network_programming_buckets());
        let endpoint_changes = Counter::default();
        let endpoint_changes_pending = Gauge::default();
        let service_changes = Counter::default();
        let service_changes_pending = Gauge::default();
        let no_local_endpoints = Family::<TrafficPolicyLabels, Gauge>::default();
        let healthz = Family::<CodeLabels, Counter>::default();
        let livez = Family::<CodeLabels, Counter>::default();
        let map_entries = Family::<MapLabels, Gauge>::default();
        let map_capacity = Family::<MapLabels, Gauge>::default();
        let datapath_events = Arc::new(DatapathEvents::default());
        let map_write_errors = Family::<MapLabels, Counter>::default();
        let services_skipped = Family::<ReasonLabels, Gauge>::default();
        let conntrack_gc_deleted = Family::<ReasonLabels, Counter>::default();
        let sockets_terminated = Counter::default();
        let prefilter_bits = Family::<FamilyLabels, Gauge>::default();
        let ct_filter_buckets = Family::<FamilyLabels, Gauge>::default();

        // Names and help texts as in pkg/proxy/metrics/metrics.go. Counters are registered without
        // `_total`: the OpenMetrics encoder appends it.
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            last_sync.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            last_queued.clone(),
        );
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            network_programming.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            endpoint_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            endpoint_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            service_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            service_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            no_local_endpoints.clone(),
        );
        registry.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            healthz.clone(),
        );
        registry.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            livez.clone(),
        );
        registry.register("lb_map_entries", "Entries in each BPF map", map_entries.clone());
        registry.register(
            "lb_map_capacity",
            "Capacity (max_entries) of each BPF map",
            map_capacity.clone(),
        );
        registry.register_collector(Box::new(datapath_events.clone()));
        registry.register_collector(Box::new(ProcessMemory));
        registry.register(
            "lb_map_write_errors",
            "Failed BPF map updates and deletions, by map",
            map_write_errors.clone(),
        );
        registry.register(
            "lb_services_skipped",
            "Service ports not programmed in the last sync, by reason",
            services_skipped.clone(),
        );
        registry.register(
            "lb_conntrack_gc_deleted",
            "Conntrack entries of the tc path freed by the GC, by reason",
            conntrack_gc_deleted.clone(),
        );
        registry.register(
            "lb_sockets_terminated",
            "Connected UDP sockets of local clients aborted because their backend was removed",
            sockets_terminated.clone(),
        );
        registry.register(
            "lb_tc_prefilter_bits",
            "Bits set in the tc prefilter, of 2^20 per family (the fraction of packets the tc \
             programs do not translate that still take the full path)",
            prefilter_bits.clone(),
        );
        registry.register(
            "lb_tc_ct_filter_buckets",
            "Buckets the egress flow filter holds after the last conntrack GC pass, of 2^20 per \
             family (the fraction of packets to or from a backend on untracked flows that still \
             take the conntrack lookups)",
            ct_filter_buckets.clone(),
        );

        // Upstream sets both label values on every sync; show them from the start.
        for policy in ["internal", "external"] {
            no_local_endpoints
                .get_or_create(&TrafficPolicyLabels {
                    traffic_policy: policy.to_string(),
                })
                .set(0);
        }

        Self {
            inner: Arc::new(Inner {
                registry,
                sync_duration,
                last_sync,
                last_queued,
                network_programming,
                endpoint_changes,
                endpoint_changes_pending,
                service_changes,
                service_changes_pending,
                no_local_endpoints,
                healthz,
                livez,
                map_entries,
                map_capacity,
                datapath_events,
                map_write_errors,
                services_skipped,
                conntrack_gc_deleted,
                sockets_terminated,
                prefilter_bits,
                ct_filter_buckets,
                skipped_reasons: Mutex::default(),
            }),
        }
    }

    /// One sync took `elapsed` (observed for every sync, failed or not, as upstream's deferred
    /// `SyncProxyRulesLatency.Observe`).
    pub fn observe_sync_duration(&self, elapsed: Duration) {
        self.inner.sync_duration.observe(elapsed.as_secs_f64());
    }

    /// A sync completed successfully at `at` (`SyncProxyRulesLastTimestamp.SetToCurrentTime()`).
    pub fn sync_succeeded(&self, at: SystemTime) {
        self.inner.last_sync.set(unix_seconds(at));
    }

    /// A sync was requested at `at` (`SyncProxyRulesLastQueuedTimestamp`).
    pub fn sync_queued(&self, at: SystemTime) {
        self.inner.last_queued.set(unix_seconds(at));
    }

    /// Time from an object's change (its trigger time annotation) to its rules being programmed.
    pub fn observe_network_programming(&self, latency: Duration) {
        self.inner.network_programming.observe(latency.as_secs_f64());
    }

    /// `n` EndpointSlice changes were received.
    pub fn endpoint_changes(&self, n: u64) {
        self.inner.endpoint_changes.inc_by(n);
    }

    pub fn set_endpoint_changes_pending(&self, n: usize) {
        self.inner.endpoint_changes_pending.set(saturating_i64(n as u64));
    }

    /// `n` Service changes were received.
    pub fn service_changes(&self, n: u64) {
        self.inner.service_changes.inc_by(n);
    }

    pub fn set_service_changes_pending(&self, n: usize) {
        self.inner.service_changes_pending.set(saturating_i64(n as u64));
    }

    /// Services with `internalTrafficPolicy: Local` / `externalTrafficPolicy: Local` and no local
    /// endpoint, recounted on every sync.
    pub fn set_no_local_endpoints(&self, internal: usize, external: usize) {
        for (policy, n) in [("internal", internal), ("external", external)] {
            self.inner
                .no_local_endpoints
                .get_or_create(&TrafficPolicyLabels {
                    traffic_policy: policy.to_string(),
                })
                .set(saturating_i64(n as u64));
        }
    }

    /// `/healthz` answered with HTTP status `code`.
    pub fn proxy_healthz(&self, code: u16) {
        self.inner
            .healthz
            .get_or_create(&CodeLabels {
                code: code.to_string(),
            })
            .inc();
    }

    /// `/livez` answered with HTTP status `code`.
    pub fn proxy_livez(&self, code: u16) {
        self.inner
            .livez
            .get_or_create(&CodeLabels {
                code: code.to_string(),
            })
            .inc();
    }

    /// A map's entry count and capacity.
    pub fn set_map_occupancy(&self, map: &str, used: u64, capacity: u64) {
        let labels = MapLabels { map: map.to_string() };
        self.inner
            .map_entries
            .get_or_create(&labels)
            .set(saturating_i64(used));
        self.inner
            .map_capacity
            .get_or_create(&labels)
            .set(saturating_i64(capacity));
    }

    /// Absolute per-event totals summed over the per-CPU stats map. Events not listed keep their value.
    pub fn set_datapath_events(&self, totals: &[(&str, u64)]) {
        self.inner.datapath_events.set(totals);
    }

    /// `n` writes or deletions on `map` failed.
    pub fn map_write_errors(&self, map: &str, n: u64) {
        self.inner
            .map_write_errors
            .get_or_create(&MapLabels { map: map.to_string() })
            .inc_by(n);
    }

    /// The conntrack GC deleted `n` entries for `reason`.
    pub fn conntrack_gc_deleted(&self, reason: &str, n: u64) {
        self.inner
            .conntrack_gc_deleted
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc_by(n);
    }

    /// `n` connected UDP sockets to removed backends were aborted.
    pub fn sockets_terminated(&self, n: u64) {
        self.inner.sockets_terminated.inc_by(n);
    }

    /// Bits set in `family`'s tc prefilter (`IPv4`, `IPv6`).
    pub fn set_prefilter_bits(&self, family: &str, bits: u64) {
        self.inner
            .prefilter_bits
            .get_or_create(&FamilyLabels {
                ip_family: family.to_string(),
            })
            .set(saturating_i64(bits));
    }

    /// Buckets `family`'s egress flow filter holds (`IPv4`, `IPv6`).
    pub fn set_ct_filter_buckets(&self, family: &str, buckets: u64) {
        self.inner
            .ct_filter_buckets
            .get_or_create(&FamilyLabels {
                ip_family: family.to_string(),
            })
            .set(saturating_i64(buckets));
    }

    /// Service ports left out of the last sync, by reason (for example `map full`). Replaces the previous
    /// set: reasons not listed are removed.
    pub fn set_services_skipped(&self, by_reason: &[(&str, usize)]) {
        let family = &self.inner.services_skipped;
        let mut reasons = self
            .inner
            .skipped_reasons
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let current: BTreeSet<String> = by_reason.iter().map(|(reason, _)| reason.to_string()).collect();
        for &(reason, n) in by_reason {
            family
                .get_or_create(&ReasonLabels {
                    reason: reason.to_string(),
                })
                .set(saturating_i64(n as u64));
        }
        for stale in reasons.difference(&current) {
            family.remove(&ReasonLabels {
                reason: stale.clone(),
            });
        }
        *reasons = current;
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.inner.registry);
        out
    }
}

async fn metrics_handler(State(metrics): State<Metrics>) -> Response {
    (
        [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
        metrics.encode(),
    )
        .into_response()
}

/// The metrics server's routes: `GET /metrics`; everything else is 404.
pub fn router(metrics: Metrics) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .fallback(|| async { StatusCode::NOT_FOUND })
        .with_state(metrics)
}

/// Serves `/metrics` on `addr` until `shutdown` is cancelled. Fails at once, with the address in the
/// message, when the address cannot be bound.
pub async fn serve_metrics(
    addr: SocketAddr,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to start the metrics server on {addr}"))?;
    serve_metrics_on(listener, metrics, shutdown).await
}

/// As [`serve_metrics`], on a listener bound by the caller.
pub async fn serve_metrics_on(
    listener: tokio::net::TcpListener,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let addr = listener.local_addr().ok();
    tracing::info!(address = ?addr, "serving /metrics");
    axum::serve(listener, router(metrics))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .context("metrics server failed")
}

#[cfg(test)]
mod tests;
