//! The effective configuration as a `KubeProxyConfiguration` v1alpha1 file: [`render_config`] and
//! [`write_config_to`] (kube-proxy's `--write-config-to`).

use std::{
    net::{IpAddr, Ipv4Addr},
    path::Path,
    time::Duration,
};

use serde_json::Value;

use super::{API_VERSION, KIND, ProxyConfig, format_go_duration};
use crate::cli::{LogFormat, RunArgs};

/// kube-proxy's v1alpha1 default for a setting the agent keeps but has no flag for.
const DEFAULT_CONFIG_SYNC_PERIOD: Duration = Duration::from_secs(15 * 60);

/// The effective configuration (flags merged with `file`) as a `KubeProxyConfiguration` v1alpha1 YAML
/// document, fields in kube-proxy's (alphabetical) order, like `kube-proxy --write-config-to`. Only the
/// fields the agent honours are written; kube-proxy reads the result the same way.
pub fn render_config(args: &RunArgs, file: Option<&ProxyConfig>) -> String {
    let file = file.cloned().unwrap_or_default();
    let duration = |d: Duration| Value::String(format_go_duration(d));
    let bind_address = args
        .node
        .bind_address
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
        .to_string();
    let nodeport_addresses = if args.node.nodeport_addresses.is_empty() {
        Value::Null
    } else {
        Value::from(args.node.nodeport_addresses.clone())
    };
    let qps = args.kube_api_qps;
    let doc = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": KIND,
        "bindAddress": bind_address,
        "clientConnection": {
            "kubeconfig": args.kubeconfig.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            // f32 -> f64 through its decimal form, so 5.5 stays 5.5.
            "qps": qps.to_string().parse::<f64>().unwrap_or(f64::from(qps)),
            "burst": args.kube_api_burst,
        },
        "clusterCIDR": args.node.cluster_cidr.join(","),
        "configSyncPeriod": duration(file.config_sync_period.unwrap_or(DEFAULT_CONFIG_SYNC_PERIOD)),
        "detectLocalMode": args.node.detect_local_mode.as_str(),
        "detectLocal": {
            "bridgeInterface": args.node.pod_bridge_interface,
            "interfaceNamePrefix": args.node.pod_interface_name_prefix,
        },
        "featureGates": file.feature_gates,
        "healthzBindAddress": args.healthz_bind_address,
        "hostnameOverride": args.node.hostname_override.clone().unwrap_or_default(),
        "iptables": {
            "localhostNodePorts": args.node.iptables_localhost_nodeports,
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
mod tests;
