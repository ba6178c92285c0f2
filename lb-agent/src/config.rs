//! `--config FILE`: kube-proxy's `KubeProxyConfiguration` (`kubeproxy.config.k8s.io/v1alpha1`,
//! `staging/src/k8s.io/kube-proxy/config/v1alpha1/types.go`), so that an existing kube-proxy ConfigMap
//! (kubeadm's, for example) can be reused as is. The file is read as YAML into a `serde_json::Value`, the
//! fields the agent honours are mapped into [`ProxyConfig`], and **every other field present is reported**
//! as a [`ConfigWarning`]: either a kube-proxy field that means nothing for the eBPF data path, or a
//! field kube-proxy does not know either (most likely a typo; a close known name is suggested).
//!
//! # Honoured fields
//!
//! | field (camelCase, as in the file) | agent setting | notes |
//! |---|---|---|
//! | `hostnameOverride` | `--hostname-override` | `""` = unset; lowercased, as kube-proxy |
//! | `bindAddress` | `--bind-address` | the node's primary IP; `""`, `0.0.0.0`, `::` = unset; IPv6 ignored (warning) |
//! | `healthzBindAddress` | `--healthz-bind-address` | `""` = unset (kube-proxy's default); port 10256 appended when missing |
//! | `metricsBindAddress` | `--metrics-bind-address` | `""` = unset; port 10249 appended when missing |
//! | `clusterCIDR` | `--cluster-cidr` | comma-separated, as kube-proxy |
//! | `detectLocal.clusterCIDRs` | `--cluster-cidr` | the internal/draft-v1alpha2 layout (a list); wins over `clusterCIDR` |
//! | `detectLocalMode` | | only `ClusterCIDR` (or unset); any other mode is an error |
//! | `nodePortAddresses` | `--nodeport-addresses` | CIDRs and `primary`/`localhost`/`all` |
//! | `clientConnection.kubeconfig` | `--kubeconfig` | not applied when `--manifests` is given |
//! | `clientConnection.qps`, `.burst` | [`ProxyConfig::qps`], [`ProxyConfig::burst`] | kept for the API client; `0` = unset |
//! | `iptables.syncPeriod` / `ipvs.syncPeriod` / `nftables.syncPeriod` | `--sync-period` | the section of the file's `mode`, as kube-proxy's conversion (`ipvs`, `nftables`, else `iptables`) |
//! | `iptables.minSyncPeriod` / `ipvs.…` / `nftables.…` | `--min-sync-period` | likewise |
//! | `syncPeriod`, `minSyncPeriod` | `--sync-period`, `--min-sync-period` | the internal/draft-v1alpha2 top-level layout; wins over the section |
//! | `iptables.masqueradeAll` / `nftables.masqueradeAll` | `--masquerade-all` | `nftables.` when `mode: nftables`, else `iptables.` |
//! | `linux.masqueradeAll` | `--masquerade-all` | internal/draft-v1alpha2 layout; wins over the section |
//! | `iptables.localhostNodePorts` | `--iptables-localhost-nodeports` | `null` = unset |
//! | `configSyncPeriod` | [`ProxyConfig::config_sync_period`] | kept (no flag) |
//! | `mode` | | accepted; a non-empty value gets a note: the agent always runs its eBPF data path |
//! | `featureGates` | [`ProxyConfig::feature_gates`] | kept, each gate reported as not used |
//! | `logging.format` | `--log-format` | `text` or `json` |
//!
//! Durations are Go duration strings (`100ms`, `30s`, `1m30s`, `1h0m0s`; [`parse_go_duration`]). As in
//! kube-proxy's v1alpha1 defaulting, a zero `syncPeriod`, `minSyncPeriod` or `configSyncPeriod` means
//! "unset" (kubeadm writes `0s` for every duration it leaves to the default). Type errors in honoured
//! fields are fatal, as kube-proxy's decoding is.
//!
//! Only `apiVersion: kubeproxy.config.k8s.io/v1alpha1` is accepted: it is the only version kube-proxy
//! has released (a `v1alpha2` was drafted for KEP-784 and not merged). The top-level `syncPeriod`,
//! `minSyncPeriod`, `linux.masqueradeAll` and `detectLocal.clusterCIDRs` come from that draft (and
//! kube-proxy's internal type); kube-proxy's strict decoder rejects them in a v1alpha1 file and its lenient
//! fallback ignores them, so the agent honours them but adds a note.
//!
//! # Flags and the file ([`merge`])
//!
//! kube-proxy (`cmd/kube-proxy/app/options.go`, `Options.Complete`) does **not** let flags override the
//! file: when `--config` is given, the decoded file *replaces* the configuration the flags were parsed into
//! (flag help texts say "This parameter is ignored if a config file is specified by --config"). Only two
//! kinds of flags survive: the logging flags, copied over the file's `logging` when explicitly set
//! (`copyLogsFromFlags`), and `--hostname-override`, which wins when non-empty
//! (`processHostnameOverrideFlag`); `--master` and `--cleanup` are not in the file at all.
//!
//! The agent's documented rule (`cli.rs`: "flags given explicitly override it") is more useful and is the
//! default, [`Precedence::ExplicitFlags`]: a flag explicitly set on the command line (or through its
//! environment variable) wins, every other setting comes from the file when the file sets it, and the
//! flag's default otherwise. [`merge`] returns a note for each explicit flag that overrides a different
//! file value, since kube-proxy would have ignored that flag. [`Precedence::KubeProxy`] reproduces
//! kube-proxy: the file wins over every flag except `--hostname-override` and `--log-format` (flags for
//! settings the file leaves out still apply, where kube-proxy would use its defaults). Clap cannot tell a
//! default from an explicit value by itself; [`explicit_flags`] computes the set from `ArgMatches`.
//!
//! [`render_config`] / [`write_config_to`] print the effective configuration as a v1alpha1 file (like
//! kube-proxy's `--write-config-to`).

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::{Map, Value};

use crate::{
    cli::{LogFormat, RunArgs},
    node::NodePortAddress,
};

/// The API group of kube-proxy's configuration.
pub const API_GROUP: &str = "kubeproxy.config.k8s.io";
/// The only released version.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// kube-proxy's default health server port (`ports.ProxyHealthzPort`).
pub const DEFAULT_HEALTHZ_PORT: u16 = 10256;
/// kube-proxy's default metrics server port (`ports.ProxyStatusPort`).
pub const DEFAULT_METRICS_PORT: u16 = 10249;

/// Clap ids of the agent flags a configuration file can set (the `RunArgs`/`NodeArgs` field names).
pub mod flag {
    pub const HOSTNAME_OVERRIDE: &str = "hostname_override";
    pub const BIND_ADDRESS: &str = "bind_address";
    pub const HEALTHZ_BIND_ADDRESS: &str = "healthz_bind_address";
    pub const METRICS_BIND_ADDRESS: &str = "metrics_bind_address";
    pub const CLUSTER_CIDR: &str = "cluster_cidr";
    pub const NODEPORT_ADDRESSES: &str = "nodeport_addresses";
    pub const KUBECONFIG: &str = "kubeconfig";
    pub const SYNC_PERIOD: &str = "sync_period";
    pub const MIN_SYNC_PERIOD: &str = "min_sync_period";
    pub const MASQUERADE_ALL: &str = "masquerade_all";
    pub const LOCALHOST_NODEPORTS: &str = "iptables_localhost_nodeports";
    pub const LOG_FORMAT: &str = "log_format";
}

/// A configuration file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {}: {error}", path.display())]
    Read { path: PathBuf, error: std::io::Error },
    #[error("parsing the configuration as YAML: {0}")]
    Yaml(String),
    #[error("the configuration must be a YAML mapping (a KubeProxyConfiguration object)")]
    NotAMapping,
    #[error("apiVersion is missing (expected {API_VERSION})")]
    MissingApiVersion,
    #[error(
        "apiVersion {0:?} is not supported: lb-agent reads {API_VERSION}, the only version kube-proxy has released"
    )]
    ApiVersion(String),
    #[error("kind {0:?} is not supported: expected {KIND}")]
    Kind(String),
    #[error("kind is missing (expected {KIND})")]
    MissingKind,
    #[error("{path}: {message}")]
    Field { path: String, message: String },
}

fn field_error(path: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        path: path.to_string(),
        message: message.into(),
    }
}

/// The settings of a configuration file the agent honours. `None` (or empty) means the file leaves the
/// setting to the flag or its default.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProxyConfig {
    pub hostname_override: Option<String>,
    pub bind_address: Option<Ipv4Addr>,
    /// `host:port`, the default port appended when the file gave none.
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub cluster_cidrs: Option<Vec<String>>,
    pub nodeport_addresses: Option<Vec<String>>,
    pub kubeconfig: Option<PathBuf>,
    pub qps: Option<f32>,
    pub burst: Option<i32>,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    pub config_sync_period: Option<Duration>,
    pub masquerade_all: Option<bool>,
    pub localhost_nodeports: Option<bool>,
    /// kube-proxy's `mode` as written (informational).
    pub mode: Option<String>,
    pub feature_gates: BTreeMap<String, bool>,
    pub log_format: Option<LogFormat>,
}

/// What a [`ConfigWarning`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarningKind {
    /// A kube-proxy field the agent does not use.
    NotUsed,
    /// Not a `KubeProxyConfiguration` field at all (kube-proxy's strict decoding rejects it).
    Unknown,
    /// A field that is used, with a caveat.
    Note,
}

/// A field of the file the agent does not honour as kube-proxy would.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigWarning {
    /// Dotted path, e.g. `iptables.masqueradeBit`.
    pub path: String,
    pub kind: WarningKind,
    /// Whether the value is empty (`null`, `""`, `0`, `0s`, `false`, `[]`, `{}`): files generated by
    /// kubeadm list every field this way, so callers may log these at a lower level.
    pub value_is_empty: bool,
    pub message: String,
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// A parsed file: the settings, and what was not honoured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadedConfig {
    pub config: ProxyConfig,
    pub warnings: Vec<ConfigWarning>,
}

/// Reads and parses a configuration file.
pub fn load_file(path: &Path) -> Result<LoadedConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
        path: path.to_path_buf(),
        error,
    })?;
    parse(&text)
}

/// Parses a configuration from YAML (JSON is YAML too).
pub fn parse(yaml: &str) -> Result<LoadedConfig, ConfigError> {
    let doc: Value = serde_saphyr::from_str(yaml).map_err(|e| ConfigError::Yaml(e.to_string()))?;
    from_value(&doc)
}

/// Maps an already decoded document.
pub fn from_value(doc: &Value) -> Result<LoadedConfig, ConfigError> {
    let Value::Object(root) = doc else {
        return Err(ConfigError::NotAMapping);
    };
    match root.get("apiVersion") {
        None | Some(Value::Null) => return Err(ConfigError::MissingApiVersion),
        Some(Value::String(v)) if v == API_VERSION => {}
        Some(other) => return Err(ConfigError::ApiVersion(value_text(other))),
    }
    match root.get("kind") {
        None | Some(Value::Null) => return Err(ConfigError::MissingKind),
        Some(Value::String(k)) if k == KIND => {}
        Some(other) => return Err(ConfigError::Kind(value_text(other))),
    }
    let mut reader = Reader::new(doc);
    reader.take("apiVersion");
    reader.take("kind");
    let config = map_fields(&mut reader)?;
    let mut warnings = reader.notes;
    walk_unused(root, TOP, "", &reader.used, &reader.reasons, &mut warnings);
    Ok(LoadedConfig { config, warnings })
}

fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Reads typed values by dotted path, remembering which paths were consumed.
struct Reader<'a> {
    doc: &'a Value,
    used: HashSet<String>,
    /// Per-path reasons for fields left unused for a reason known only while mapping.
    reasons: HashMap<String, String>,
    notes: Vec<ConfigWarning>,
}

impl<'a> Reader<'a> {
    fn new(doc: &'a Value) -> Self {
        Self {
            doc,
            used: HashSet::new(),
            reasons: HashMap::new(),
            notes: Vec::new(),
        }
    }

    fn lookup(&self, path: &str) -> Option<&'a Value> {
        path.split('.')
            .try_fold(self.doc, |v, key| v.as_object()?.get(key))
    }

    /// Whether the file sets the path to a non-null value.
    fn present(&self, path: &str) -> bool {
        !matches!(self.lookup(path), None | Some(Value::Null))
    }

    /// Marks `path` consumed; its value unless absent or null.
    fn take(&mut self, path: &str) -> Option<&'a Value> {
        let value = self.lookup(path)?;
        self.used.insert(path.to_string());
        (!value.is_null()).then_some(value)
    }

    fn leave(&mut self, path: &str, reason: String) {
        if self.lookup(path).is_some() {
            self.reasons.insert(path.to_string(), reason);
        }
    }

    fn note(&mut self, path: &str, message: String) {
        let value_is_empty = self.lookup(path).is_none_or(is_empty);
        self.notes.push(ConfigWarning {
            path: path.to_string(),
            kind: WarningKind::Note,
            value_is_empty,
            message,
        });
    }

    fn string(&mut self, path: &str) -> Result<Option<String>, ConfigError> {
        match self.take(path) {
            None => Ok(None),
            Some(Value::String(s)) if s.trim().is_empty() => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.trim().to_string())),
            Some(other) => Err(field_error(path, format!("expected a string, got {other}"))),
        }
    }

    fn bool(&mut self, path: &str) -> Result<Option<bool>, ConfigError> {
        match self.take(path) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(field_error(path, format!("expected true or false, got {other}"))),
        }
    }

    /// A Go duration; zero means unset.
    fn duration(&mut self, path: &str) -> Result<Option<Duration>, ConfigError> {
        match self.take(path) {
            None => Ok(None),
            Some(Value::String(s)) => {
                let d = parse_go_duration(s).map_err(|e| field_error(path, e))?;
                Ok((!d.is_zero()).then_some(d))
            }
            Some(other) => Err(field_error(
                path,
                format!("expected a duration string such as \"30s\", got {other}"),
            )),
        }
    }

    fn string_list(&mut self, path: &str) -> Result<Option<Vec<String>>, ConfigError> {
        match self.take(path) {
            None => Ok(None),
            Some(Value::Array(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    match item {
                        Value::String(s) if !s.trim().is_empty() => out.push(s.trim().to_string()),
                        Value::String(_) => {}
                        other => {
                            return Err(field_error(
                                path,
                                format!("expected a list of strings, got {other}"),
                            ));
                        }
                    }
                }
                Ok((!out.is_empty()).then_some(out))
            }
            Some(other) => Err(field_error(
                path,
                format!("expected a list of strings, got {other}"),
            )),
        }
    }

    fn number(&mut self, path: &str) -> Result<Option<f64>, ConfigError> {
        match self.take(path) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(other) => Err(field_error(path, format!("expected a number, got {other}"))),
        }
    }
}

/// The v1alpha1 section kube-proxy reads the sync periods from for a `mode` (`conversion.go`).
fn sync_section(mode: &str) -> &'static str {
    match mode {
        "ipvs" => "ipvs",
        "nftables" => "nftables",
        _ => "iptables",
    }
}

fn map_fields(r: &mut Reader<'_>) -> Result<ProxyConfig, ConfigError> {
    let mut c = ProxyConfig {
        mode: r.string("mode")?,
        ..ProxyConfig::default()
    };
    if let Some(mode) = &c.mode {
        r.note(
            "mode",
            format!("mode {mode:?} is ignored: lb-agent always programs its own eBPF data path"),
        );
    }
    let mode = c.mode.clone().unwrap_or_default();

    c.hostname_override = r.string("hostnameOverride")?.map(|h| h.to_lowercase());

    if let Some(bind) = r.string("bindAddress")? {
        match bind.parse::<IpAddr>() {
            Ok(IpAddr::V4(v4)) if !v4.is_unspecified() => c.bind_address = Some(v4),
            Ok(IpAddr::V4(_)) => {}
            Ok(IpAddr::V6(v6)) if v6.is_unspecified() => {}
            Ok(IpAddr::V6(_)) => r.note(
                "bindAddress",
                format!("bindAddress {bind} is IPv6 and is ignored: the agent's data path is IPv4"),
            ),
            Err(_) => {
                return Err(field_error(
                    "bindAddress",
                    format!("{bind:?} is not an IP address"),
                ));
            }
        }
    }

    c.healthz_bind_address = r
        .string("healthzBindAddress")?
        .map(|a| bind_address_with_port("healthzBindAddress", &a, DEFAULT_HEALTHZ_PORT))
        .transpose()?;
    c.metrics_bind_address = r
        .string("metricsBindAddress")?
        .map(|a| bind_address_with_port("metricsBindAddress", &a, DEFAULT_METRICS_PORT))
        .transpose()?;

    // Local traffic detection.
    match r.string("detectLocalMode")?.as_deref() {
        None | Some("ClusterCIDR") => {}
        Some(other @ ("NodeCIDR" | "BridgeInterface" | "InterfaceNamePrefix")) => {
            return Err(field_error(
                "detectLocalMode",
                format!(
                    "{other} is not supported by lb-agent: only ClusterCIDR (set clusterCIDR, or --cluster-cidr) \
                     detects pod traffic in the eBPF data path"
                ),
            ));
        }
        Some(other) => {
            return Err(field_error(
                "detectLocalMode",
                format!(
                    "unknown mode {other:?} (kube-proxy knows ClusterCIDR, NodeCIDR, BridgeInterface, \
                     InterfaceNamePrefix; lb-agent supports ClusterCIDR)"
                ),
            ));
        }
    }
    let legacy_cidrs = r
        .string("clusterCIDR")?
        .map(|s| {
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .filter(|v| !v.is_empty());
    let list_cidrs = r.string_list("detectLocal.clusterCIDRs")?;
    if list_cidrs.is_some() {
        r.note(
            "detectLocal.clusterCIDRs",
            "detectLocal.clusterCIDRs is not a v1alpha1 field (kube-proxy ignores it); lb-agent honours it"
                .into(),
        );
        if legacy_cidrs.is_some() && legacy_cidrs != list_cidrs {
            r.note(
                "clusterCIDR",
                "clusterCIDR is overridden by detectLocal.clusterCIDRs".into(),
            );
        }
    }
    let (cidrs_path, cidrs) = if list_cidrs.is_some() {
        ("detectLocal.clusterCIDRs", list_cidrs)
    } else {
        ("clusterCIDR", legacy_cidrs)
    };
    if let Some(cidrs) = &cidrs {
        for cidr in cidrs {
            cidr.parse::<ipnet::IpNet>()
                .map_err(|e| field_error(cidrs_path, format!("{cidr:?}: {e}")))?;
        }
    }
    c.cluster_cidrs = cidrs;

    c.nodeport_addresses = r.string_list("nodePortAddresses")?;
    if let Some(list) = &c.nodeport_addresses {
        for entry in list {
            entry
                .parse::<NodePortAddress>()
                .map_err(|e| field_error("nodePortAddresses", e))?;
        }
    }

    // API client.
    c.kubeconfig = r.string("clientConnection.kubeconfig")?.map(PathBuf::from);
    c.qps = r
        .number("clientConnection.qps")?
        .filter(|q| *q != 0.0)
        .map(|q| q as f32);
    c.burst = match r.number("clientConnection.burst")? {
        None => None,
        Some(b) if b.fract() != 0.0 || b < f64::from(i32::MIN) || b > f64::from(i32::MAX) => {
            return Err(field_error(
                "clientConnection.burst",
                format!("expected an integer, got {b}"),
            ));
        }
        Some(b) => Some(b as i32).filter(|b| *b != 0),
    };
    c.config_sync_period = r.duration("configSyncPeriod")?;

    // Sync periods: the mode's section, unless the top-level (internal/draft) fields are set.
    let section = sync_section(&mode);
    for other in ["iptables", "ipvs", "nftables"]
        .into_iter()
        .filter(|s| *s != section)
    {
        for field in ["syncPeriod", "minSyncPeriod"] {
            r.leave(
                &format!("{other}.{field}"),
                format!("kube-proxy reads {other}.{field} only in {other} mode (mode is {mode:?})"),
            );
        }
    }
    for field in ["syncPeriod", "minSyncPeriod"] {
        let top_level = r.present(field);
        let section_path = format!("{section}.{field}");
        let value = if top_level {
            r.note(
                field,
                format!("{field} is not a v1alpha1 field (kube-proxy ignores it); lb-agent honours it"),
            );
            if r.present(&section_path) {
                r.leave(&section_path, format!("overridden by the top-level {field}"));
            }
            r.duration(field)?
        } else {
            r.duration(&section_path)?
        };
        match field {
            "syncPeriod" => c.sync_period = value,
            _ => c.min_sync_period = value,
        }
    }

    // masqueradeAll: linux.masqueradeAll (internal/draft layout), else the mode's section.
    let masq_section = if mode == "nftables" {
        "nftables"
    } else {
        "iptables"
    };
    let other_masq = if masq_section == "nftables" {
        "iptables"
    } else {
        "nftables"
    };
    r.leave(
        &format!("{other_masq}.masqueradeAll"),
        format!("kube-proxy reads {other_masq}.masqueradeAll only in {other_masq} mode (mode is {mode:?})"),
    );
    if r.present("linux.masqueradeAll") {
        r.note(
            "linux.masqueradeAll",
            "linux.masqueradeAll is not a v1alpha1 field (kube-proxy ignores it); lb-agent honours it".into(),
        );
        r.leave(
            &format!("{masq_section}.masqueradeAll"),
            "overridden by linux.masqueradeAll".into(),
        );
        c.masquerade_all = r.bool("linux.masqueradeAll")?;
    } else {
        c.masquerade_all = r.bool(&format!("{masq_section}.masqueradeAll"))?;
    }

    c.localhost_nodeports = r.bool("iptables.localhostNodePorts")?;

    // Feature gates: kept, each one reported by the walk.
    if let Some(gates) = r.lookup("featureGates") {
        match gates {
            Value::Null => {}
            Value::Object(map) => {
                for (gate, value) in map {
                    match value {
                        Value::Bool(b) => {
                            c.feature_gates.insert(gate.clone(), *b);
                        }
                        other => {
                            return Err(field_error(
                                &format!("featureGates.{gate}"),
                                format!("expected true or false, got {other}"),
                            ));
                        }
                    }
                }
            }
            other => {
                return Err(field_error(
                    "featureGates",
                    format!("expected a mapping of gate names to booleans, got {other}"),
                ));
            }
        }
    }

    c.log_format = match r.string("logging.format")?.as_deref() {
        None => None,
        Some("text") => Some(LogFormat::Text),
        Some("json") => Some(LogFormat::Json),
        Some(other) => {
            return Err(field_error(
                "logging.format",
                format!("{other:?}: lb-agent logs as text or json"),
            ));
        }
    };

    if let (Some(sync), Some(min)) = (c.sync_period, c.min_sync_period)
        && min > sync
    {
        return Err(field_error(
            "minSyncPeriod",
            format!(
                "{} must not exceed syncPeriod ({})",
                format_go_duration(min),
                format_go_duration(sync)
            ),
        ));
    }
    Ok(c)
}

/// kube-proxy's `AppendPortIfNeeded` and validation of a `host:port` bind address.
fn bind_address_with_port(path: &str, addr: &str, default_port: u16) -> Result<String, ConfigError> {
    if addr.parse::<SocketAddr>().is_ok() {
        return Ok(addr.to_string());
    }
    if let Some(port) = addr.strip_prefix(':')
        && port.parse::<u16>().is_ok()
    {
        return Ok(format!("0.0.0.0:{port}"));
    }
    match addr
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        Ok(ip) => Ok(SocketAddr::new(ip, default_port).to_string()),
        Err(_) => Err(field_error(
            path,
            format!("{addr:?} is not an IP address with an optional port"),
        )),
    }
}

/// Why a kube-proxy field is not used, for fields the agent never reads.
#[derive(Clone, Copy, Debug)]
enum Known {
    /// A leaf; the reason it is not used when it is not consumed.
    Leaf(&'static str),
    /// A nested object.
    Object(&'static [(&'static str, Known)]),
    /// A mapping with free-form keys (feature gates, klog options); each key is reported.
    FreeMap(&'static str),
}

use Known::{FreeMap, Leaf, Object};

const EBPF: &str = "eBPF data path";
const WINDOWS: &str = "Windows only";
const CONNTRACK: &str = "the eBPF data path does not tune the kernel's conntrack";
const HONOURED: &str = "honoured field";

const CONNTRACK_FIELDS: &[(&str, Known)] = &[
    ("maxPerCore", Leaf(CONNTRACK)),
    ("min", Leaf(CONNTRACK)),
    ("tcpEstablishedTimeout", Leaf(CONNTRACK)),
    ("tcpCloseWaitTimeout", Leaf(CONNTRACK)),
    ("tcpBeLiberal", Leaf(CONNTRACK)),
    ("udpTimeout", Leaf(CONNTRACK)),
    ("udpStreamTimeout", Leaf(CONNTRACK)),
];

/// Every `KubeProxyConfiguration` v1alpha1 field (plus the internal/draft layout the agent accepts).
const TOP: &[(&str, Known)] = &[
    ("apiVersion", Leaf(HONOURED)),
    ("kind", Leaf(HONOURED)),
    (
        "featureGates",
        FreeMap("kube-proxy feature gates do not apply to lb-agent"),
    ),
    (
        "clientConnection",
        Object(&[
            ("kubeconfig", Leaf(HONOURED)),
            (
                "acceptContentTypes",
                Leaf("the agent's API client always uses JSON"),
            ),
            ("contentType", Leaf("the agent's API client always uses JSON")),
            ("qps", Leaf(HONOURED)),
            ("burst", Leaf(HONOURED)),
        ]),
    ),
    (
        "logging",
        Object(&[
            ("format", Leaf(HONOURED)),
            ("flushFrequency", Leaf("logs are not buffered")),
            ("verbosity", Leaf("set log levels with RUST_LOG")),
            ("vmodule", Leaf("set per-module log levels with RUST_LOG")),
            ("options", FreeMap("klog output options")),
        ]),
    ),
    ("hostnameOverride", Leaf(HONOURED)),
    ("bindAddress", Leaf(HONOURED)),
    ("healthzBindAddress", Leaf(HONOURED)),
    ("metricsBindAddress", Leaf(HONOURED)),
    (
        "bindAddressHardFail",
        Leaf("failing to bind the health or metrics address is always an error"),
    ),
    ("enableProfiling", Leaf("there is no /debug/pprof handler")),
    ("showHiddenMetricsForVersion", Leaf("there are no hidden metrics")),
    (
        "serviceProxyName",
        Leaf("lb-agent handles every Service without a service.kubernetes.io/service-proxy-name label"),
    ),
    ("mode", Leaf(HONOURED)),
    (
        "iptables",
        Object(&[
            ("masqueradeBit", Leaf(EBPF)),
            ("masqueradeAll", Leaf(HONOURED)),
            ("localhostNodePorts", Leaf(HONOURED)),
            ("snatNodeInternalIP", Leaf(EBPF)),
            ("syncPeriod", Leaf(HONOURED)),
            ("minSyncPeriod", Leaf(HONOURED)),
        ]),
    ),
    (
        "ipvs",
        Object(&[
            ("syncPeriod", Leaf(HONOURED)),
            ("minSyncPeriod", Leaf(HONOURED)),
            (
                "scheduler",
                Leaf("eBPF data path: backends are picked at random, as in iptables mode"),
            ),
            ("excludeCIDRs", Leaf(EBPF)),
            (
                "strictARP",
                Leaf("eBPF data path: there is no kube-ipvs0 interface"),
            ),
            ("tcpTimeout", Leaf(EBPF)),
            ("tcpFinTimeout", Leaf(EBPF)),
            ("udpTimeout", Leaf(EBPF)),
        ]),
    ),
    (
        "nftables",
        Object(&[
            ("masqueradeBit", Leaf(EBPF)),
            ("masqueradeAll", Leaf(HONOURED)),
            ("syncPeriod", Leaf(HONOURED)),
            ("minSyncPeriod", Leaf(HONOURED)),
            ("tableName", Leaf(EBPF)),
        ]),
    ),
    (
        "winkernel",
        Object(&[
            ("networkName", Leaf(WINDOWS)),
            ("sourceVip", Leaf(WINDOWS)),
            ("enableDSR", Leaf(WINDOWS)),
            ("rootHnsEndpointName", Leaf(WINDOWS)),
            ("forwardHealthCheckVip", Leaf(WINDOWS)),
        ]),
    ),
    ("detectLocalMode", Leaf(HONOURED)),
    (
        "detectLocal",
        Object(&[
            (
                "bridgeInterface",
                Leaf("only for detectLocalMode BridgeInterface, which lb-agent does not support"),
            ),
            (
                "interfaceNamePrefix",
                Leaf("only for detectLocalMode InterfaceNamePrefix, which lb-agent does not support"),
            ),
            ("clusterCIDRs", Leaf(HONOURED)),
        ]),
    ),
    ("clusterCIDR", Leaf(HONOURED)),
    ("nodePortAddresses", Leaf(HONOURED)),
    (
        "oomScoreAdj",
        Leaf("set the agent's OOM score in its Pod or unit"),
    ),
    ("conntrack", Object(CONNTRACK_FIELDS)),
    ("configSyncPeriod", Leaf(HONOURED)),
    ("portRange", Leaf("unused by kube-proxy too (userspace mode)")),
    ("windowsRunAsService", Leaf(WINDOWS)),
    // The internal (and draft v1alpha2) layout.
    ("syncPeriod", Leaf(HONOURED)),
    ("minSyncPeriod", Leaf(HONOURED)),
    (
        "linux",
        Object(&[
            ("masqueradeAll", Leaf(HONOURED)),
            ("conntrack", Object(CONNTRACK_FIELDS)),
            (
                "oomScoreAdj",
                Leaf("set the agent's OOM score in its Pod or unit"),
            ),
        ]),
    ),
    ("windows", Object(&[("runAsService", Leaf(WINDOWS))])),
];

/// `null`, `""`, `0`, `"0"`, `0s`, `false`, `[]`, `{}`, or an object of such values.
fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || s == "0" || parse_go_duration(s).is_ok_and(|d| d.is_zero()),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_empty),
    }
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Reports every field of `object` not consumed by the mapping.
fn walk_unused(
    object: &Map<String, Value>,
    schema: &[(&str, Known)],
    prefix: &str,
    used: &HashSet<String>,
    reasons: &HashMap<String, String>,
    out: &mut Vec<ConfigWarning>,
) {
    for (key, value) in object {
        let path = join(prefix, key);
        if used.contains(&path) {
            continue;
        }
        let not_used = |reason: &str| ConfigWarning {
            path: path.clone(),
            kind: WarningKind::NotUsed,
            value_is_empty: is_empty(value),
            message: format!("{path} is not used by lb-agent ({reason})"),
        };
        match schema.iter().find(|(name, _)| name == key) {
            None => {
                let suggestion = suggest(key, schema.iter().map(|(name, _)| *name))
                    .map(|s| format!("; did you mean {}?", join(prefix, s)))
                    .unwrap_or_default();
                out.push(ConfigWarning {
                    path: path.clone(),
                    kind: WarningKind::Unknown,
                    value_is_empty: is_empty(value),
                    message: format!(
                        "{path} is not a KubeProxyConfiguration field and is ignored{suggestion}"
                    ),
                });
            }
            Some((_, Leaf(reason))) => {
                let reason = reasons.get(&path).map(String::as_str).unwrap_or(reason);
                out.push(not_used(reason));
            }
            Some((_, Object(children))) => match value {
                Value::Object(map) => walk_unused(map, children, &path, used, reasons, out),
                Value::Null => {}
                _ => out.push(ConfigWarning {
                    message: format!("{path} is not used by lb-agent (and should be a mapping)"),
                    ..not_used("")
                }),
            },
            Some((_, FreeMap(reason))) => match value {
                Value::Object(map) if !map.is_empty() => {
                    for (entry, entry_value) in map {
                        let entry_path = join(&path, entry);
                        out.push(ConfigWarning {
                            path: entry_path.clone(),
                            kind: WarningKind::NotUsed,
                            value_is_empty: is_empty(entry_value),
                            message: format!("{entry_path} is not used by lb-agent ({reason})"),
                        });
                    }
                }
                Value::Object(_) | Value::Null => {}
                _ => out.push(not_used(reason)),
            },
        }
    }
}

/// The known name closest to `key` (case-insensitive match or edit distance <= 2).
fn suggest<'a>(key: &str, known: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let lower = key.to_lowercase();
    known
        .map(|name| {
            let distance = if name.to_lowercase() == lower {
                0
            } else {
                levenshtein(&lower, &name.to_lowercase())
            };
            (distance, name)
        })
        .filter(|(distance, _)| *distance <= 2)
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, name)| name)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != *cb);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        previous = current;
    }
    previous[b.len()]
}

/// Parses a Go duration string (`time.ParseDuration`): a sequence of decimal numbers, each with an
/// optional fraction and a unit (`ns`, `us`/`µs`, `ms`, `s`, `m`, `h`), with an optional sign; `0` alone
/// needs no unit. Negative durations are rejected (no kube-proxy duration may be negative).
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let original = s;
    let s = s.trim();
    let (negative, mut rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(format!("invalid duration {original:?}"));
    }
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let int_len = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        let (int_part, tail) = rest.split_at(int_len);
        let (frac_part, tail) = match tail.strip_prefix('.') {
            Some(after) => {
                let len = after.find(|c: char| !c.is_ascii_digit()).unwrap_or(after.len());
                after.split_at(len)
            }
            None => ("", tail),
        };
        if int_part.is_empty() && frac_part.is_empty() {
            return Err(format!("invalid duration {original:?}"));
        }
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let nanos_per_unit: u128 = match unit {
            "ns" => 1,
            "us" | "\u{00b5}s" | "\u{03bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err(format!("missing unit in duration {original:?}")),
            other => return Err(format!("unknown unit {other:?} in duration {original:?}")),
        };
        let int_value: u128 = if int_part.is_empty() {
            0
        } else {
            int_part
                .parse()
                .map_err(|_| format!("invalid duration {original:?}"))?
        };
        let mut nanos = int_value
            .checked_mul(nanos_per_unit)
            .ok_or_else(|| format!("duration {original:?} overflows"))?;
        if !frac_part.is_empty() {
            // Digits beyond nanosecond precision are dropped, as Go does.
            let digits = &frac_part[..frac_part.len().min(30)];
            let frac: u128 = digits
                .parse()
                .map_err(|_| format!("invalid duration {original:?}"))?;
            nanos += frac * nanos_per_unit / 10u128.pow(digits.len() as u32);
        }
        total = total
            .checked_add(nanos)
            .ok_or_else(|| format!("duration {original:?} overflows"))?;
        rest = next;
    }
    if total > u128::from(i64::MAX as u64) {
        return Err(format!("duration {original:?} overflows"));
    }
    if negative && total != 0 {
        return Err(format!("duration {original:?} is negative"));
    }
    Ok(Duration::from_nanos(total as u64))
}

/// Formats a duration as Go's `time.Duration.String()`: `0s`, `100ms`, `1.5s`, `1m30s`, `1h0m0s`.
pub fn format_go_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_string();
    }
    fn with_fraction(value: u128, unit: u128, digits: usize) -> String {
        let whole = value / unit;
        let fraction = value % unit;
        if fraction == 0 {
            whole.to_string()
        } else {
            let fraction = format!("{fraction:0digits$}");
            format!("{whole}.{}", fraction.trim_end_matches('0'))
        }
    }
    if nanos < 1_000 {
        return format!("{nanos}ns");
    }
    if nanos < 1_000_000 {
        return format!("{}\u{00b5}s", with_fraction(nanos, 1_000, 3));
    }
    if nanos < 1_000_000_000 {
        return format!("{}ms", with_fraction(nanos, 1_000_000, 6));
    }
    let total_secs = nanos / 1_000_000_000;
    let seconds = with_fraction(nanos % 60_000_000_000, 1_000_000_000, 9);
    let minutes = (total_secs / 60) % 60;
    let hours = total_secs / 3600;
    if hours > 0 {
        format!("{hours}h{minutes}m{seconds}s")
    } else if minutes > 0 {
        format!("{minutes}m{seconds}s")
    } else {
        format!("{seconds}s")
    }
}

/// Which side wins when a setting is both in the file and on the command line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precedence {
    /// The agent's rule: explicitly set flags win over the file, the file wins over flag defaults.
    #[default]
    ExplicitFlags,
    /// kube-proxy's rule: the file wins, except for `--hostname-override` and the logging flags.
    KubeProxy,
}

/// The ids of the arguments set on the command line or through their environment variable (not by
/// default), for [`merge`]. Works on the top-level matches (flattened argument groups included).
pub fn explicit_flags(matches: &clap::ArgMatches) -> HashSet<String> {
    use clap::parser::ValueSource;
    matches
        .ids()
        .filter(|id| {
            matches!(
                matches.value_source(id.as_str()),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        })
        .map(|id| id.as_str().to_string())
        .collect()
}

/// Applies the file to the parsed flags with [`Precedence::ExplicitFlags`]; see [`merge_with`].
pub fn merge(
    file: &ProxyConfig,
    args: &mut RunArgs,
    explicit: &HashSet<String>,
) -> Result<Vec<String>, ConfigError> {
    merge_with(file, args, explicit, Precedence::ExplicitFlags)
}

/// Overwrites the `args` fields the file sets, unless the flag takes precedence (`explicit` holds the clap
/// ids of the flags given explicitly; see [`explicit_flags`]). Returns notes about flags and file values
/// that conflict, then checks that `min_sync_period <= sync_period` and that `sync_period > 0`.
pub fn merge_with(
    file: &ProxyConfig,
    args: &mut RunArgs,
    explicit: &HashSet<String>,
    precedence: Precedence,
) -> Result<Vec<String>, ConfigError> {
    let mut notes = Vec::new();
    let flag_wins = |id: &str| {
        explicit.contains(id)
            && match precedence {
                Precedence::ExplicitFlags => true,
                Precedence::KubeProxy => id == flag::HOSTNAME_OVERRIDE || id == flag::LOG_FORMAT,
            }
    };

    /// Applies one setting: `$file` is an `Option` from the file, `$target` the flag's place.
    macro_rules! apply {
        ($id:expr, $field:literal, $file:expr, $target:expr, $wrap:expr, $show:expr) => {
            if let Some(value) = $file {
                let from_file = $wrap(value.clone());
                if flag_wins($id) {
                    if $target != from_file {
                        notes.push(format!(
                            "--{}={} overrides {}={} from the config file{}",
                            $id.replace('_', "-"),
                            $show(&$target),
                            $field,
                            $show(&from_file),
                            if $id == flag::HOSTNAME_OVERRIDE || $id == flag::LOG_FORMAT {
                                ""
                            } else {
                                " (kube-proxy would ignore the flag)"
                            }
                        ));
                    }
                } else {
                    if explicit.contains($id) && $target != from_file {
                        notes.push(format!(
                            "--{} is ignored: the config file sets {}={} (kube-proxy precedence)",
                            $id.replace('_', "-"),
                            $field,
                            $show(&from_file)
                        ));
                    }
                    $target = from_file;
                }
            }
        };
    }

    let show_opt_str = |v: &Option<String>| v.clone().unwrap_or_default();
    let show_str = |v: &String| v.clone();
    let show_list = |v: &Vec<String>| v.join(",");
    let show_duration = |v: &Duration| format_go_duration(*v);
    let show_bool = |v: &bool| v.to_string();
    let show_ip = |v: &Option<Ipv4Addr>| v.map(|ip| ip.to_string()).unwrap_or_default();
    let show_path = |v: &Option<PathBuf>| v.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
    let show_format = |v: &LogFormat| match v {
        LogFormat::Text => "text".to_string(),
        LogFormat::Json => "json".to_string(),
    };

    apply!(
        flag::HOSTNAME_OVERRIDE,
        "hostnameOverride",
        &file.hostname_override,
        args.node.hostname_override,
        Some,
        show_opt_str
    );
    apply!(
        flag::BIND_ADDRESS,
        "bindAddress",
        &file.bind_address,
        args.bind_address,
        Some,
        show_ip
    );
    apply!(
        flag::HEALTHZ_BIND_ADDRESS,
        "healthzBindAddress",
        &file.healthz_bind_address,
        args.healthz_bind_address,
        |v| v,
        show_str
    );
    apply!(
        flag::METRICS_BIND_ADDRESS,
        "metricsBindAddress",
        &file.metrics_bind_address,
        args.metrics_bind_address,
        |v| v,
        show_str
    );
    apply!(
        flag::CLUSTER_CIDR,
        "clusterCIDR",
        &file.cluster_cidrs,
        args.node.cluster_cidr,
        |v| v,
        show_list
    );
    apply!(
        flag::NODEPORT_ADDRESSES,
        "nodePortAddresses",
        &file.nodeport_addresses,
        args.node.nodeport_addresses,
        |v| v,
        show_list
    );
    if args.manifests.is_some() {
        if let Some(path) = &file.kubeconfig {
            notes.push(format!(
                "clientConnection.kubeconfig={} is not used: --manifests is given",
                path.display()
            ));
        }
    } else {
        apply!(
            flag::KUBECONFIG,
            "clientConnection.kubeconfig",
            &file.kubeconfig,
            args.kubeconfig,
            Some,
            show_path
        );
    }
    apply!(
        flag::SYNC_PERIOD,
        "syncPeriod",
        &file.sync_period,
        args.sync_period,
        |v| v,
        show_duration
    );
    apply!(
        flag::MIN_SYNC_PERIOD,
        "minSyncPeriod",
        &file.min_sync_period,
        args.min_sync_period,
        |v| v,
        show_duration
    );
    apply!(
        flag::MASQUERADE_ALL,
        "masqueradeAll",
        &file.masquerade_all,
        args.node.masquerade_all,
        |v| v,
        show_bool
    );
    apply!(
        flag::LOCALHOST_NODEPORTS,
        "iptables.localhostNodePorts",
        &file.localhost_nodeports,
        args.iptables_localhost_nodeports,
        |v| v,
        show_bool
    );
    apply!(
        flag::LOG_FORMAT,
        "logging.format",
        &file.log_format,
        args.log_format,
        |v| v,
        show_format
    );

    if args.sync_period.is_zero() {
        return Err(field_error("syncPeriod", "must be greater than 0"));
    }
    if args.min_sync_period > args.sync_period {
        return Err(field_error(
            "minSyncPeriod",
            format!(
                "{} must not exceed syncPeriod ({})",
                format_go_duration(args.min_sync_period),
                format_go_duration(args.sync_period)
            ),
        ));
    }
    Ok(notes)
}

/// kube-proxy's v1alpha1 defaults for the client settings the agent keeps but has no flag for.
const DEFAULT_QPS: f32 = 5.0;
const DEFAULT_BURST: i32 = 10;
const DEFAULT_CONFIG_SYNC_PERIOD: Duration = Duration::from_secs(15 * 60);

/// The effective configuration (flags merged with `file`) as a `KubeProxyConfiguration` v1alpha1 YAML
/// document, fields in kube-proxy's (alphabetical) order, like `kube-proxy --write-config-to`. Only the
/// fields the agent honours are written; kube-proxy reads the result the same way.
pub fn render_config(args: &RunArgs, file: Option<&ProxyConfig>) -> String {
    let file = file.cloned().unwrap_or_default();
    let duration = |d: Duration| Value::String(format_go_duration(d));
    let bind_address = args.bind_address.unwrap_or(Ipv4Addr::UNSPECIFIED).to_string();
    let nodeport_addresses = if args.node.nodeport_addresses.is_empty() {
        Value::Null
    } else {
        Value::from(args.node.nodeport_addresses.clone())
    };
    let qps = file.qps.unwrap_or(DEFAULT_QPS);
    let doc = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": KIND,
        "bindAddress": bind_address,
        "clientConnection": {
            "kubeconfig": args.kubeconfig.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            // f32 -> f64 through its decimal form, so 5.5 stays 5.5.
            "qps": qps.to_string().parse::<f64>().unwrap_or(f64::from(qps)),
            "burst": file.burst.unwrap_or(DEFAULT_BURST),
        },
        "clusterCIDR": args.node.cluster_cidr.join(","),
        "configSyncPeriod": duration(file.config_sync_period.unwrap_or(DEFAULT_CONFIG_SYNC_PERIOD)),
        "detectLocalMode": "ClusterCIDR",
        "featureGates": file.feature_gates,
        "healthzBindAddress": args.healthz_bind_address,
        "hostnameOverride": args.node.hostname_override.clone().unwrap_or_default(),
        "iptables": {
            "localhostNodePorts": args.iptables_localhost_nodeports,
            "masqueradeAll": args.node.masquerade_all,
            "minSyncPeriod": duration(args.min_sync_period),
            "syncPeriod": duration(args.sync_period),
        },
        "logging": {
            "format": match args.log_format { LogFormat::Text => "text", LogFormat::Json => "json" },
        },
        "metricsBindAddress": args.metrics_bind_address,
        "nodePortAddresses": nodeport_addresses,
    });
    serde_saphyr::to_string(&doc).unwrap_or_else(|_| serde_json::to_string_pretty(&doc).unwrap_or_default())
}

/// Writes [`render_config`] to `path`.
pub fn write_config_to(path: &Path, args: &RunArgs, file: Option<&ProxyConfig>) -> std::io::Result<()> {
    std::fs::write(path, render_config(args, file))
}

#[cfg(test)]
mod tests {
    use super::*;

    use clap::{CommandFactory, FromArgMatches};

    use crate::cli::Cli;

    const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

    fn load(body: &str) -> LoadedConfig {
        parse(&format!("{HEADER}{body}")).unwrap_or_else(|e| panic!("{e}"))
    }

    fn load_err(body: &str) -> ConfigError {
        parse(&format!("{HEADER}{body}")).expect_err("should fail")
    }

    fn warning<'a>(loaded: &'a LoadedConfig, path: &str) -> &'a ConfigWarning {
        loaded
            .warnings
            .iter()
            .find(|w| w.path == path)
            .unwrap_or_else(|| panic!("no warning for {path}: {:#?}", loaded.warnings))
    }

    fn paths(loaded: &LoadedConfig) -> Vec<&str> {
        let mut p: Vec<&str> = loaded.warnings.iter().map(|w| w.path.as_str()).collect();
        p.sort();
        p
    }

    /// Parses the agent's command line and computes the explicit flag ids.
    fn cli(argv: &[&str]) -> (RunArgs, HashSet<String>) {
        let mut full = vec!["lb-agent"];
        full.extend_from_slice(argv);
        let matches = Cli::command().try_get_matches_from(full).unwrap();
        let explicit = explicit_flags(&matches);
        let cli = Cli::from_arg_matches(&matches).unwrap();
        (cli.run, explicit)
    }

    #[test]
    fn go_durations() {
        let ok = |s: &str, d: Duration| assert_eq!(parse_go_duration(s), Ok(d), "{s}");
        ok("0", Duration::ZERO);
        ok("0s", Duration::ZERO);
        ok("-0s", Duration::ZERO);
        ok("100ms", Duration::from_millis(100));
        ok("30s", Duration::from_secs(30));
        ok("1m30s", Duration::from_secs(90));
        ok("1h0m0s", Duration::from_secs(3600));
        ok("2h22m", Duration::from_secs(2 * 3600 + 22 * 60));
        ok("1.5s", Duration::from_millis(1500));
        ok(".5s", Duration::from_millis(500));
        ok("1.s", Duration::from_secs(1));
        ok("+5s", Duration::from_secs(5));
        ok("10us", Duration::from_micros(10));
        ok("10\u{00b5}s", Duration::from_micros(10));
        ok("10\u{03bc}s", Duration::from_micros(10));
        ok("7ns", Duration::from_nanos(7));
        ok("1.0000000001s", Duration::from_secs(1));
        for bad in ["", "5", "s", "1x", "-1s", "1m-5s", ".s", "1..5s", "9999999999h"] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn go_duration_strings() {
        let f = |d: Duration| format_go_duration(d);
        assert_eq!(f(Duration::ZERO), "0s");
        assert_eq!(f(Duration::from_nanos(7)), "7ns");
        assert_eq!(f(Duration::from_nanos(1500)), "1.5\u{00b5}s");
        assert_eq!(f(Duration::from_millis(100)), "100ms");
        assert_eq!(f(Duration::from_micros(1500)), "1.5ms");
        assert_eq!(f(Duration::from_secs(1)), "1s");
        assert_eq!(f(Duration::from_millis(1500)), "1.5s");
        assert_eq!(f(Duration::from_secs(90)), "1m30s");
        assert_eq!(f(Duration::from_secs(15 * 60)), "15m0s");
        assert_eq!(f(Duration::from_secs(3600)), "1h0m0s");
        assert_eq!(f(Duration::from_secs(24 * 3600 + 1)), "24h0m1s");
        for d in [
            Duration::from_millis(1),
            Duration::from_millis(61_500),
            Duration::from_secs(7322),
        ] {
            assert_eq!(parse_go_duration(&f(d)), Ok(d));
        }
    }

    #[test]
    fn api_version_and_kind_are_checked() {
        assert!(matches!(
            parse("kind: KubeProxyConfiguration\n"),
            Err(ConfigError::MissingApiVersion)
        ));
        assert!(matches!(
            parse("apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n"),
            Err(ConfigError::ApiVersion(v)) if v == "kubeproxy.config.k8s.io/v1alpha2"
        ));
        assert!(matches!(
            parse("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"),
            Err(ConfigError::ApiVersion(_))
        ));
        assert!(matches!(
            parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"),
            Err(ConfigError::MissingKind)
        ));
        assert!(matches!(
            parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: Other\n"),
            Err(ConfigError::Kind(k)) if k == "Other"
        ));
        assert!(matches!(parse("- a\n- b\n"), Err(ConfigError::NotAMapping)));
        assert!(matches!(parse("a: [unclosed\n"), Err(ConfigError::Yaml(_))));
        // The minimal document is valid and sets nothing.
        let loaded = load("");
        assert_eq!(loaded.config, ProxyConfig::default());
        assert!(loaded.warnings.is_empty());
        // JSON is YAML.
        let json = r#"{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration", "clusterCIDR": "10.0.0.0/8"}"#;
        assert_eq!(
            parse(json).unwrap().config.cluster_cidrs,
            Some(vec!["10.0.0.0/8".to_string()])
        );
    }

    #[test]
    fn honoured_fields_are_mapped() {
        let loaded = load(
            r#"
hostnameOverride: Node-A
bindAddress: 192.168.1.10
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1
clusterCIDR: "10.244.0.0/16, fd00::/48"
nodePortAddresses: [primary, 10.0.0.0/8]
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 50
  burst: 100
configSyncPeriod: 10m
iptables:
  syncPeriod: 1m30s
  minSyncPeriod: 250ms
  masqueradeAll: true
  localhostNodePorts: false
detectLocalMode: ClusterCIDR
logging:
  format: json
"#,
        );
        let c = &loaded.config;
        assert_eq!(c.hostname_override.as_deref(), Some("node-a"));
        assert_eq!(c.bind_address, Some(Ipv4Addr::new(192, 168, 1, 10)));
        assert_eq!(c.healthz_bind_address.as_deref(), Some("0.0.0.0:10256"));
        assert_eq!(
            c.metrics_bind_address.as_deref(),
            Some("127.0.0.1:10249"),
            "default port appended"
        );
        assert_eq!(
            c.cluster_cidrs,
            Some(vec!["10.244.0.0/16".to_string(), "fd00::/48".to_string()])
        );
        assert_eq!(
            c.nodeport_addresses,
            Some(vec!["primary".to_string(), "10.0.0.0/8".to_string()])
        );
        assert_eq!(
            c.kubeconfig,
            Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
        );
        assert_eq!(c.qps, Some(50.0));
        assert_eq!(c.burst, Some(100));
        assert_eq!(c.config_sync_period, Some(Duration::from_secs(600)));
        assert_eq!(c.sync_period, Some(Duration::from_secs(90)));
        assert_eq!(c.min_sync_period, Some(Duration::from_millis(250)));
        assert_eq!(c.masquerade_all, Some(true));
        assert_eq!(c.localhost_nodeports, Some(false));
        assert_eq!(c.log_format, Some(LogFormat::Json));
        assert!(loaded.warnings.is_empty(), "{:#?}", loaded.warnings);
    }

    #[test]
    fn unused_kube_proxy_fields_and_typos_are_reported() {
        let loaded = load(
            r#"
iptables:
  masqueradeBit: 14
  masqueradeAL: true
ipvs:
  scheduler: rr
  strictARP: true
conntrack:
  maxPerCore: 32768
winkernel:
  enableDSR: false
oomScoreAdj: -999
enableProfiling: true
hostnameOveride: typo
totallyMadeUp: 1
detectLocal:
  bridgeInterface: cbr0
"#,
        );
        let w = warning(&loaded, "iptables.masqueradeBit");
        assert_eq!(w.kind, WarningKind::NotUsed);
        assert_eq!(
            w.message,
            "iptables.masqueradeBit is not used by lb-agent (eBPF data path)"
        );
        assert!(!w.value_is_empty);
        assert_eq!(warning(&loaded, "ipvs.scheduler").kind, WarningKind::NotUsed);
        assert_eq!(warning(&loaded, "ipvs.strictARP").kind, WarningKind::NotUsed);
        assert_eq!(
            warning(&loaded, "conntrack.maxPerCore").kind,
            WarningKind::NotUsed
        );
        let dsr = warning(&loaded, "winkernel.enableDSR");
        assert!(dsr.value_is_empty && dsr.message.contains("Windows only"));
        assert_eq!(warning(&loaded, "oomScoreAdj").kind, WarningKind::NotUsed);
        assert_eq!(warning(&loaded, "enableProfiling").kind, WarningKind::NotUsed);
        assert!(
            warning(&loaded, "detectLocal.bridgeInterface")
                .message
                .contains("BridgeInterface")
        );

        let typo = warning(&loaded, "hostnameOveride");
        assert_eq!(typo.kind, WarningKind::Unknown);
        assert!(
            typo.message.contains("did you mean hostnameOverride?"),
            "{}",
            typo.message
        );
        let nested = warning(&loaded, "iptables.masqueradeAL");
        assert_eq!(nested.kind, WarningKind::Unknown);
        assert!(
            nested.message.contains("did you mean iptables.masqueradeAll?"),
            "{}",
            nested.message
        );
        let unknown = warning(&loaded, "totallyMadeUp");
        assert_eq!(unknown.kind, WarningKind::Unknown);
        assert!(!unknown.message.contains("did you mean"));
        // The typo'd hostname is not applied.
        assert_eq!(loaded.config.hostname_override, None);
    }

    #[test]
    fn sync_periods_follow_the_mode_section() {
        let sections = r#"
iptables:
  syncPeriod: 10s
  minSyncPeriod: 1s
ipvs:
  syncPeriod: 20s
  minSyncPeriod: 2s
nftables:
  syncPeriod: 40s
  minSyncPeriod: 4s
"#;
        for (mode, sync, min) in [
            ("", 10, 1),
            ("iptables", 10, 1),
            ("ipvs", 20, 2),
            ("nftables", 40, 4),
        ] {
            let loaded = load(&format!("mode: \"{mode}\"\n{sections}"));
            assert_eq!(
                loaded.config.sync_period,
                Some(Duration::from_secs(sync)),
                "mode {mode:?}"
            );
            assert_eq!(
                loaded.config.min_sync_period,
                Some(Duration::from_secs(min)),
                "mode {mode:?}"
            );
            // The other two sections are reported, with the reason.
            let unused: Vec<&str> = loaded
                .warnings
                .iter()
                .filter(|w| w.path.ends_with("yncPeriod"))
                .map(|w| w.path.as_str())
                .collect();
            assert_eq!(unused.len(), 4, "{mode:?}: {:#?}", loaded.warnings);
        }
        let loaded = load(&format!("mode: ipvs\n{sections}"));
        assert_eq!(
            warning(&loaded, "iptables.syncPeriod").message,
            "iptables.syncPeriod is not used by lb-agent (kube-proxy reads iptables.syncPeriod only in iptables mode (mode is \"ipvs\"))"
        );
        let mode_note = warning(&loaded, "mode");
        assert_eq!(mode_note.kind, WarningKind::Note);
        assert!(mode_note.message.contains("eBPF"));
    }

    #[test]
    fn top_level_layout_is_accepted_and_wins() {
        let loaded = load(
            r#"
syncPeriod: 45s
minSyncPeriod: 500ms
iptables:
  syncPeriod: 30s
  masqueradeAll: false
linux:
  masqueradeAll: true
detectLocal:
  clusterCIDRs: [10.1.0.0/16]
clusterCIDR: 10.2.0.0/16
"#,
        );
        let c = &loaded.config;
        assert_eq!(c.sync_period, Some(Duration::from_secs(45)));
        assert_eq!(c.min_sync_period, Some(Duration::from_millis(500)));
        assert_eq!(c.masquerade_all, Some(true));
        assert_eq!(c.cluster_cidrs, Some(vec!["10.1.0.0/16".to_string()]));
        assert_eq!(warning(&loaded, "syncPeriod").kind, WarningKind::Note);
        assert_eq!(warning(&loaded, "linux.masqueradeAll").kind, WarningKind::Note);
        assert_eq!(
            warning(&loaded, "detectLocal.clusterCIDRs").kind,
            WarningKind::Note
        );
        assert!(
            warning(&loaded, "iptables.syncPeriod")
                .message
                .contains("overridden by the top-level syncPeriod")
        );
        assert!(
            warning(&loaded, "iptables.masqueradeAll")
                .message
                .contains("overridden by linux.masqueradeAll")
        );
        assert!(warning(&loaded, "clusterCIDR").message.contains("overridden"));
    }

    #[test]
    fn masquerade_all_section_follows_mode() {
        let body = "iptables:\n  masqueradeAll: false\nnftables:\n  masqueradeAll: true\n";
        assert_eq!(load(body).config.masquerade_all, Some(false));
        assert!(
            warning(&load(body), "nftables.masqueradeAll")
                .message
                .contains("only in nftables mode")
        );
        assert_eq!(
            load(&format!("mode: nftables\n{body}")).config.masquerade_all,
            Some(true)
        );
    }

    #[test]
    fn detect_local_mode() {
        assert!(load("detectLocalMode: \"\"\n").warnings.is_empty());
        for mode in ["NodeCIDR", "BridgeInterface", "InterfaceNamePrefix"] {
            let err = load_err(&format!("detectLocalMode: {mode}\n")).to_string();
            assert!(
                err.starts_with("detectLocalMode:") && err.contains("only ClusterCIDR"),
                "{err}"
            );
        }
        assert!(
            load_err("detectLocalMode: Magic\n")
                .to_string()
                .contains("unknown mode")
        );
    }

    #[test]
    fn feature_gates_and_logging() {
        let loaded = load(
            "featureGates:\n  MultiCIDRServiceAllocator: true\n  Other: false\nlogging:\n  format: text\n  verbosity: 4\n  options:\n    json:\n      infoBufferSize: \"0\"\n",
        );
        assert_eq!(loaded.config.feature_gates.len(), 2);
        assert!(loaded.config.feature_gates["MultiCIDRServiceAllocator"]);
        let gate = warning(&loaded, "featureGates.MultiCIDRServiceAllocator");
        assert_eq!(gate.kind, WarningKind::NotUsed);
        assert!(gate.message.contains("feature gates"));
        assert!(warning(&loaded, "logging.verbosity").message.contains("RUST_LOG"));
        assert!(warning(&loaded, "logging.options.json").value_is_empty);
        assert_eq!(loaded.config.log_format, Some(LogFormat::Text));
        assert!(
            load_err("logging:\n  format: xml\n")
                .to_string()
                .contains("logging.format")
        );
        assert!(
            load_err("featureGates:\n  X: maybe\n")
                .to_string()
                .contains("featureGates.X")
        );
    }

    #[test]
    fn type_and_value_errors_are_fatal() {
        let cases = [
            ("bindAddress: not-an-ip\n", "bindAddress"),
            ("healthzBindAddress: nonsense:port\n", "healthzBindAddress"),
            ("clusterCIDR: 10.0.0.0/33\n", "clusterCIDR"),
            ("nodePortAddresses: [bogus]\n", "nodePortAddresses"),
            ("nodePortAddresses: primary\n", "nodePortAddresses"),
            (
                "iptables:\n  masqueradeAll: \"yes please\"\n",
                "iptables.masqueradeAll",
            ),
            ("iptables:\n  syncPeriod: 30\n", "iptables.syncPeriod"),
            ("iptables:\n  syncPeriod: 30 seconds\n", "iptables.syncPeriod"),
            (
                "iptables:\n  syncPeriod: 1s\n  minSyncPeriod: 2s\n",
                "minSyncPeriod",
            ),
            ("clientConnection:\n  burst: 1.5\n", "clientConnection.burst"),
            ("clientConnection:\n  qps: lots\n", "clientConnection.qps"),
            ("hostnameOverride: [a]\n", "hostnameOverride"),
        ];
        for (body, path) in cases {
            match load_err(body) {
                ConfigError::Field { path: p, .. } => assert_eq!(p, path, "{body}"),
                other => panic!("{body}: unexpected {other}"),
            }
        }
    }

    #[test]
    fn bind_addresses_and_unset_values() {
        let c =
            load("bindAddress: 0.0.0.0\nhealthzBindAddress: \"\"\nmetricsBindAddress: \":9999\"\n").config;
        assert_eq!(c.bind_address, None);
        assert_eq!(c.healthz_bind_address, None);
        assert_eq!(c.metrics_bind_address.as_deref(), Some("0.0.0.0:9999"));
        let c = load("healthzBindAddress: \"::1\"\n").config;
        assert_eq!(c.healthz_bind_address.as_deref(), Some("[::1]:10256"));
        let loaded = load("bindAddress: \"fd00::1\"\n");
        assert_eq!(loaded.config.bind_address, None);
        assert_eq!(warning(&loaded, "bindAddress").kind, WarningKind::Note);
        // Zero durations and zero client settings are unset, as kube-proxy's defaulting.
        let c = load("configSyncPeriod: 0s\niptables:\n  syncPeriod: 0s\n  minSyncPeriod: 0s\nclientConnection:\n  qps: 0\n  burst: 0\n").config;
        assert_eq!(c, ProxyConfig::default());
    }

    /// The file kubeadm writes into the kube-proxy ConfigMap (every field, mostly empty).
    const KUBEADM: &str = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

    #[test]
    fn kubeadm_config_map() {
        let loaded = parse(KUBEADM).unwrap();
        let c = &loaded.config;
        assert_eq!(c.cluster_cidrs, Some(vec!["10.244.0.0/16".to_string()]));
        assert_eq!(
            c.kubeconfig,
            Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
        );
        assert_eq!(c.masquerade_all, Some(false));
        assert_eq!(c.sync_period, None);
        assert_eq!(c.min_sync_period, None);
        assert_eq!(c.bind_address, None);
        assert_eq!(c.mode, None);
        // Everything else is reported, all of it with empty values, none unknown.
        assert!(
            loaded.warnings.iter().all(|w| w.value_is_empty),
            "{:#?}",
            loaded.warnings
        );
        assert!(
            loaded.warnings.iter().all(|w| w.kind == WarningKind::NotUsed),
            "{:#?}",
            loaded.warnings
        );
        assert_eq!(
            paths(&loaded),
            vec![
                "bindAddressHardFail",
                "clientConnection.acceptContentTypes",
                "clientConnection.contentType",
                "conntrack.maxPerCore",
                "conntrack.min",
                "conntrack.tcpBeLiberal",
                "conntrack.tcpCloseWaitTimeout",
                "conntrack.tcpEstablishedTimeout",
                "conntrack.udpStreamTimeout",
                "conntrack.udpTimeout",
                "detectLocal.bridgeInterface",
                "detectLocal.interfaceNamePrefix",
                "enableProfiling",
                "iptables.masqueradeBit",
                "ipvs.excludeCIDRs",
                "ipvs.minSyncPeriod",
                "ipvs.scheduler",
                "ipvs.strictARP",
                "ipvs.syncPeriod",
                "ipvs.tcpFinTimeout",
                "ipvs.tcpTimeout",
                "ipvs.udpTimeout",
                "logging.flushFrequency",
                "logging.options.json",
                "logging.options.text",
                "logging.verbosity",
                "nftables.masqueradeAll",
                "nftables.masqueradeBit",
                "nftables.minSyncPeriod",
                "nftables.syncPeriod",
                "oomScoreAdj",
                "portRange",
                "showHiddenMetricsForVersion",
                "winkernel.enableDSR",
                "winkernel.forwardHealthCheckVip",
                "winkernel.networkName",
                "winkernel.rootHnsEndpointName",
                "winkernel.sourceVip",
            ]
        );
    }

    #[test]
    fn explicit_flags_come_from_command_line_and_env_only() {
        let (_, explicit) = cli(&[
            "--manifests",
            "/m",
            "--sync-period",
            "10s",
            "--cluster-cidr",
            "10.0.0.0/8",
        ]);
        assert!(explicit.contains(flag::SYNC_PERIOD));
        assert!(explicit.contains(flag::CLUSTER_CIDR));
        assert!(explicit.contains("manifests"));
        assert!(
            !explicit.contains(flag::MIN_SYNC_PERIOD),
            "defaults are not explicit"
        );
        assert!(!explicit.contains(flag::HEALTHZ_BIND_ADDRESS));
    }

    #[test]
    fn flag_ids_exist_in_the_cli() {
        let command = Cli::command();
        for id in [
            flag::HOSTNAME_OVERRIDE,
            flag::BIND_ADDRESS,
            flag::HEALTHZ_BIND_ADDRESS,
            flag::METRICS_BIND_ADDRESS,
            flag::CLUSTER_CIDR,
            flag::NODEPORT_ADDRESSES,
            flag::KUBECONFIG,
            flag::SYNC_PERIOD,
            flag::MIN_SYNC_PERIOD,
            flag::MASQUERADE_ALL,
            flag::LOCALHOST_NODEPORTS,
            flag::LOG_FORMAT,
        ] {
            assert!(command.get_arguments().any(|a| a.get_id() == id), "no flag {id}");
        }
    }

    const FILE: &str = r#"
hostnameOverride: from-file
clusterCIDR: 10.244.0.0/16
clientConnection:
  kubeconfig: /etc/kube-proxy/kubeconfig
iptables:
  syncPeriod: 1m
  minSyncPeriod: 2s
  masqueradeAll: true
  localhostNodePorts: false
healthzBindAddress: 0.0.0.0:20256
logging:
  format: json
"#;

    #[test]
    fn merge_explicit_flags_win() {
        let file = load(FILE).config;
        let (mut args, explicit) = cli(&["--sync-period", "10s", "--hostname-override", "from-flag"]);
        let notes = merge(&file, &mut args, &explicit).unwrap();
        // Explicit flags keep their value...
        assert_eq!(args.sync_period, Duration::from_secs(10));
        assert_eq!(args.node.hostname_override.as_deref(), Some("from-flag"));
        // ...everything else the file sets replaces the defaults.
        assert_eq!(args.min_sync_period, Duration::from_secs(2));
        assert_eq!(args.node.cluster_cidr, vec!["10.244.0.0/16"]);
        assert_eq!(args.kubeconfig, Some(PathBuf::from("/etc/kube-proxy/kubeconfig")));
        assert!(args.node.masquerade_all);
        assert!(!args.iptables_localhost_nodeports);
        assert_eq!(args.healthz_bind_address, "0.0.0.0:20256");
        assert_eq!(args.log_format, LogFormat::Json);
        // Untouched by the file: defaults stay.
        assert_eq!(args.metrics_bind_address, "127.0.0.1:10249");
        assert_eq!(notes.len(), 2, "{notes:#?}");
        assert!(notes.iter().any(|n| n
            == "--sync-period=10s overrides syncPeriod=1m0s from the config file (kube-proxy would ignore the flag)"));
        assert!(notes.iter().any(|n| n
            == "--hostname-override=from-flag overrides hostnameOverride=from-file from the config file"));
    }

    #[test]
    fn merge_kube_proxy_precedence() {
        let file = load(FILE).config;
        let (mut args, explicit) = cli(&[
            "--sync-period",
            "10s",
            "--hostname-override",
            "from-flag",
            "--log-format",
            "text",
            "--metrics-bind-address",
            "0.0.0.0:1234",
        ]);
        let notes = merge_with(&file, &mut args, &explicit, Precedence::KubeProxy).unwrap();
        assert_eq!(args.sync_period, Duration::from_secs(60), "the file wins");
        assert_eq!(
            args.node.hostname_override.as_deref(),
            Some("from-flag"),
            "except --hostname-override"
        );
        assert_eq!(args.log_format, LogFormat::Text, "and logging flags");
        assert_eq!(
            args.metrics_bind_address, "0.0.0.0:1234",
            "the file does not set it"
        );
        assert!(
            notes.iter().any(|n| n
                == "--sync-period is ignored: the config file sets syncPeriod=1m0s (kube-proxy precedence)")
        );
    }

    #[test]
    fn merge_keeps_manifests_mode_and_validates() {
        let file = load(FILE).config;
        let (mut args, explicit) = cli(&["--manifests", "/srv/manifests"]);
        let notes = merge(&file, &mut args, &explicit).unwrap();
        assert_eq!(args.kubeconfig, None, "--manifests conflicts with a kubeconfig");
        assert!(notes.iter().any(|n| n.contains("--manifests")), "{notes:#?}");

        // The merged result must keep min <= sync.
        let file = load("iptables:\n  minSyncPeriod: 45s\n").config;
        let (mut args, explicit) = cli(&[]);
        let err = merge(&file, &mut args, &explicit).unwrap_err();
        assert!(err.to_string().contains("minSyncPeriod"), "{err}");
        let (mut args, explicit) = cli(&["--sync-period", "0s"]);
        assert!(merge(&ProxyConfig::default(), &mut args, &explicit).is_err());
    }

    #[test]
    fn merge_of_an_empty_file_changes_nothing() {
        let (mut args, explicit) = cli(&["--cluster-cidr", "10.9.0.0/16"]);
        let before = format!("{args:?}");
        let notes = merge(&ProxyConfig::default(), &mut args, &explicit).unwrap();
        assert!(notes.is_empty());
        assert_eq!(format!("{args:?}"), before);
    }

    #[test]
    fn rendered_config_round_trips() {
        let file = load(FILE).config;
        let (mut args, explicit) = cli(&[
            "--nodeport-addresses",
            "primary,10.0.0.0/8",
            "--bind-address",
            "192.168.1.5",
        ]);
        merge(&file, &mut args, &explicit).unwrap();
        let yaml = render_config(&args, Some(&file));
        assert!(
            yaml.starts_with("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"),
            "{yaml}"
        );
        let reread = parse(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
        assert!(reread.warnings.is_empty(), "{:#?}\n{yaml}", reread.warnings);
        let c = reread.config;
        assert_eq!(c.hostname_override.as_deref(), Some("from-file"));
        assert_eq!(c.bind_address, Some(Ipv4Addr::new(192, 168, 1, 5)));
        assert_eq!(c.cluster_cidrs, Some(vec!["10.244.0.0/16".to_string()]));
        assert_eq!(
            c.nodeport_addresses,
            Some(vec!["primary".to_string(), "10.0.0.0/8".to_string()])
        );
        assert_eq!(c.sync_period, Some(Duration::from_secs(60)));
        assert_eq!(c.min_sync_period, Some(Duration::from_secs(2)));
        assert_eq!(c.masquerade_all, Some(true));
        assert_eq!(c.localhost_nodeports, Some(false));
        assert_eq!(c.healthz_bind_address.as_deref(), Some("0.0.0.0:20256"));
        assert_eq!(c.metrics_bind_address.as_deref(), Some("127.0.0.1:10249"));
        assert_eq!(c.kubeconfig, Some(PathBuf::from("/etc/kube-proxy/kubeconfig")));
        assert_eq!(c.qps, Some(5.0));
        assert_eq!(c.burst, Some(10));
        assert_eq!(c.config_sync_period, Some(Duration::from_secs(900)));
        assert_eq!(c.log_format, Some(LogFormat::Json));

        // Merging the rendered file into default flags reproduces the effective settings.
        let (mut fresh, none) = cli(&[]);
        merge(&c, &mut fresh, &none).unwrap();
        assert_eq!(format!("{:?}", fresh.node), format!("{:?}", args.node));
        assert_eq!(fresh.sync_period, args.sync_period);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        write_config_to(&path, &args, Some(&file)).unwrap();
        assert_eq!(load_file(&path).unwrap().config, c);
        assert!(matches!(
            load_file(&dir.path().join("missing")),
            Err(ConfigError::Read { .. })
        ));
    }

    #[test]
    fn defaults_render_and_reload() {
        let (args, _) = cli(&[]);
        let yaml = render_config(&args, None);
        let reread = parse(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
        assert!(reread.warnings.is_empty(), "{:#?}", reread.warnings);
        assert_eq!(reread.config.sync_period, Some(Duration::from_secs(30)));
        assert_eq!(reread.config.min_sync_period, Some(Duration::from_millis(100)));
        assert_eq!(reread.config.cluster_cidrs, None);
        assert_eq!(reread.config.bind_address, None);
    }

    #[test]
    fn suggestions() {
        let known = ["hostnameOverride", "bindAddress", "clusterCIDR"];
        assert_eq!(
            suggest("hostnameoverride", known.iter().copied()),
            Some("hostnameOverride")
        );
        assert_eq!(suggest("bindAdress", known.iter().copied()), Some("bindAddress"));
        assert_eq!(
            suggest("clusterCIDRs", known.iter().copied()),
            Some("clusterCIDR")
        );
        assert_eq!(suggest("somethingElse", known.iter().copied()), None);
        assert_eq!(levenshtein("kitten", "sitting"), 3);
        assert_eq!(levenshtein("", "abc"), 3);
    }
}
