//! The table of every `KubeProxyConfiguration` field (`TOP`) with why the agent leaves it unused, and
//! the report of the fields a file sets that the mapping did not consume (`walk_unused`): kube-proxy
//! fields the agent does not use, and unknown fields with a close known name suggested (`suggest`).

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value};

use super::{ConfigWarning, WarningKind, parse_go_duration};

/// Why a kube-proxy field is not used, for fields the agent never reads.
#[derive(Clone, Copy, Debug)]
pub(super) enum Known {
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
pub(super) const TOP: &[(&str, Known)] = &[
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
                Leaf(
                    "eBPF data path: backends are picked at random, as in iptables mode, or for traffic \
                     from outside by Maglev hashing with --bpf-lb-algorithm maglev (or per Service, \
                     the lb-agent.io/lb-algorithm annotation)",
                ),
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
            ("bridgeInterface", Leaf(HONOURED)),
            ("interfaceNamePrefix", Leaf(HONOURED)),
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
    (
        "configSyncPeriod",
        Leaf(
            "kube-proxy's informer resync period; the agent's watches (kube-rs reflectors) have no periodic resync, they re-list when a watch breaks",
        ),
    ),
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
pub(super) fn is_empty(v: &Value) -> bool {
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
pub(super) fn walk_unused(
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

#[cfg(test)]
mod tests;
