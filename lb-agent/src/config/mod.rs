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
//! | `bindAddress` | `--bind-address` | overrides the node's primary IP of its family; `""`, `0.0.0.0`, `::` = unset |
//! | `healthzBindAddress` | `--healthz-bind-address` | `""` = unset (kube-proxy's default); port 10256 appended when missing |
//! | `metricsBindAddress` | `--metrics-bind-address` | `""` = unset; port 10249 appended when missing |
//! | `clusterCIDR` | `--cluster-cidr` | comma-separated, as kube-proxy |
//! | `detectLocal.clusterCIDRs` | `--cluster-cidr` | the internal/draft-v1alpha2 layout (a list); wins over `clusterCIDR` |
//! | `detectLocalMode` | `--detect-local-mode` | `ClusterCIDR` (or unset), `NodeCIDR` (the Node's `spec.podCIDRs`), `BridgeInterface` or `InterfaceNamePrefix` |
//! | `detectLocal.bridgeInterface` | `--pod-bridge-interface` | BridgeInterface mode: the pods' bridge (its ports count as it) |
//! | `detectLocal.interfaceNamePrefix` | `--pod-interface-name-prefix` | InterfaceNamePrefix mode |
//! | `nodePortAddresses` | `--nodeport-addresses` | CIDRs and `primary`/`localhost`/`all` |
//! | `clientConnection.kubeconfig` | `--kubeconfig` | not applied when `--manifests` is given |
//! | `clientConnection.qps`, `.burst` | `--kube-api-qps`, `--kube-api-burst` | the API client's token bucket (`watch::rate`); `0` = unset |
//! | `iptables.syncPeriod` / `ipvs.syncPeriod` / `nftables.syncPeriod` | `--sync-period` | the section of the file's `mode`, as kube-proxy's conversion (`ipvs`, `nftables`, else `iptables`) |
//! | `iptables.minSyncPeriod` / `ipvs.…` / `nftables.…` | `--min-sync-period` | likewise |
//! | `syncPeriod`, `minSyncPeriod` | `--sync-period`, `--min-sync-period` | the internal/draft-v1alpha2 top-level layout; wins over the section |
//! | `iptables.masqueradeAll` / `nftables.masqueradeAll` | `--masquerade-all` | `nftables.` when `mode: nftables`, else `iptables.` |
//! | `linux.masqueradeAll` | `--masquerade-all` | internal/draft-v1alpha2 layout; wins over the section |
//! | `iptables.localhostNodePorts` | `--iptables-localhost-nodeports` | `null` = unset |
//! | `configSyncPeriod` | [`ProxyConfig::config_sync_period`] | not used (reported as such): the watches have no resync; written back by `--write-config-to` |
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
//!
//! # Files
//!
//! This module owns the public types; one job per file below it: `read` (decoding a file into
//! [`ProxyConfig`]), `fields` (the table of kube-proxy's fields, unused-field and typo reports),
//! `duration` (Go durations), `merge` (flags and the file) and `render` (`--write-config-to`).

use std::{collections::BTreeMap, fmt, net::IpAddr, path::PathBuf, time::Duration};

use crate::cli::LogFormat;

mod duration;
mod fields;
mod merge;
mod read;
mod render;
#[cfg(test)]
mod test_support;

pub use duration::{format_go_duration, parse_go_duration};
pub use merge::{Precedence, explicit_flags, merge, merge_with, validate};
pub use read::{from_value, load_file, parse};
pub use render::{render_config, write_config_to};

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
    pub const DETECT_LOCAL_MODE: &str = "detect_local_mode";
    pub const POD_BRIDGE_INTERFACE: &str = "pod_bridge_interface";
    pub const POD_INTERFACE_NAME_PREFIX: &str = "pod_interface_name_prefix";
    pub const NODEPORT_ADDRESSES: &str = "nodeport_addresses";
    pub const KUBECONFIG: &str = "kubeconfig";
    pub const KUBE_API_QPS: &str = "kube_api_qps";
    pub const KUBE_API_BURST: &str = "kube_api_burst";
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
    pub bind_address: Option<IpAddr>,
    /// `host:port`, the default port appended when the file gave none.
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub cluster_cidrs: Option<Vec<String>>,
    pub detect_local_mode: Option<crate::node::DetectLocalMode>,
    pub pod_bridge_interface: Option<String>,
    pub pod_interface_name_prefix: Option<String>,
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
