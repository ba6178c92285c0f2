//! Decoding a file into [`ProxyConfig`]: [`load_file`], [`parse`], [`from_value`] check `apiVersion` and
//! `kind`, then `map_fields` reads every honoured field through a `Reader` that remembers which paths
//! it consumed, so that `fields::walk_unused` can report the rest.

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::Value;

use super::{
    API_VERSION, ConfigError, ConfigWarning, DEFAULT_HEALTHZ_PORT, DEFAULT_METRICS_PORT, KIND, LoadedConfig,
    ProxyConfig, WarningKind, field_error,
    fields::{TOP, is_empty, walk_unused},
    format_go_duration, parse_go_duration,
};
use crate::{cli::LogFormat, node::NodePortAddress};

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
            Ok(ip) if !ip.is_unspecified() => c.bind_address = Some(ip),
            Ok(_) => {}
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
    c.detect_local_mode = r
        .string("detectLocalMode")?
        .map(|m| m.parse().map_err(|e: String| field_error("detectLocalMode", e)))
        .transpose()?;
    c.pod_bridge_interface = r.string("detectLocal.bridgeInterface")?;
    c.pod_interface_name_prefix = r.string("detectLocal.interfaceNamePrefix")?;
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
        // Every address of both families, as Go listens on `:port`.
        return Ok(format!("[::]:{port}"));
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

#[cfg(test)]
mod tests;
