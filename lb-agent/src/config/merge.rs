//! Flags and the file: which side wins ([`Precedence`]), which flags were given explicitly
//! ([`explicit_flags`]), and applying the file to the parsed flags ([`merge`], [`merge_with`]).

use std::{collections::HashSet, net::IpAddr, path::PathBuf, time::Duration};

use super::{ConfigError, ProxyConfig, field_error, flag, format_go_duration};
use crate::cli::{LogFormat, RunArgs};

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
    let show_ip = |v: &Option<IpAddr>| v.map(|ip| ip.to_string()).unwrap_or_default();
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
        args.node.bind_address,
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
    let show_number = |v: &dyn std::fmt::Display| v.to_string();
    apply!(
        flag::KUBE_API_QPS,
        "clientConnection.qps",
        &file.qps,
        args.kube_api_qps,
        |v| v,
        |v: &f32| show_number(v)
    );
    apply!(
        flag::KUBE_API_BURST,
        "clientConnection.burst",
        &file.burst,
        args.kube_api_burst,
        |v| v,
        |v: &i32| show_number(v)
    );
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
        flag::DETECT_LOCAL_MODE,
        "detectLocalMode",
        &file.detect_local_mode,
        args.node.detect_local_mode,
        |v| v,
        |v: &crate::node::DetectLocalMode| v.as_str().to_string()
    );
    apply!(
        flag::POD_BRIDGE_INTERFACE,
        "detectLocal.bridgeInterface",
        &file.pod_bridge_interface,
        args.node.pod_bridge_interface,
        |v| v,
        |v: &String| v.clone()
    );
    apply!(
        flag::POD_INTERFACE_NAME_PREFIX,
        "detectLocal.interfaceNamePrefix",
        &file.pod_interface_name_prefix,
        args.node.pod_interface_name_prefix,
        |v| v,
        |v: &String| v.clone()
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
        args.node.iptables_localhost_nodeports,
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

    validate(args)?;
    Ok(notes)
}

#[cfg(test)]
mod tests;

/// The checks every run's settings pass, from flags alone or merged with a file:
/// `syncPeriod` (`--sync-period`) > 0 and `minSyncPeriod` <= `syncPeriod`.
pub fn validate(args: &RunArgs) -> Result<(), ConfigError> {
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
    Ok(())
}
