//! Unused and unknown fields: the reasons, typo suggestions, and kubeadm's ConfigMap.

use std::path::PathBuf;

use super::*;
use crate::config::{
    LoadedConfig, parse,
    test_support::{load, warning},
};

fn paths(loaded: &LoadedConfig) -> Vec<&str> {
    let mut p: Vec<&str> = loaded.warnings.iter().map(|w| w.path.as_str()).collect();
    p.sort();
    p
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

/// The honoured leaves of `TOP`, as dotted paths.
fn honoured(fields: &[(&str, Known)], prefix: &str, out: &mut Vec<String>) {
    for (name, known) in fields {
        let path = if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        };
        match known {
            Leaf(reason) if *reason == HONOURED => out.push(path),
            Object(inner) => honoured(inner, &path, out),
            _ => {}
        }
    }
}

/// Issue 24: a field the table marks honoured changes what the agent does. Each one, set in a file
/// to a value other than its default (beside what it depends on, in `baseline`), gives other
/// effective settings after the merge into default flags than `baseline` alone; a field marked
/// honoured without a case here fails. The settings' effects downstream are the other tests'
/// (the client's bucket in `watch::rate`, masquerading in the tc fixtures, listeners in
/// security.rs, ...).
#[test]
fn every_honoured_field_changes_the_effective_settings() {
    use crate::config::{merge, test_support::cli};
    // (field, baseline, file): the file is the baseline plus the field.
    let cases: &[(&str, &str, &str)] = &[
        (
            "clientConnection.kubeconfig",
            "",
            "clientConnection: {kubeconfig: /k}\n",
        ),
        ("clientConnection.qps", "", "clientConnection: {qps: 50}\n"),
        ("clientConnection.burst", "", "clientConnection: {burst: 100}\n"),
        ("logging.format", "", "logging: {format: json}\n"),
        ("hostnameOverride", "", "hostnameOverride: other\n"),
        ("bindAddress", "", "bindAddress: 192.168.1.5\n"),
        ("healthzBindAddress", "", "healthzBindAddress: 0.0.0.0:20256\n"),
        ("metricsBindAddress", "", "metricsBindAddress: 127.0.0.1:20249\n"),
        // The mode picks the section the sync periods and masqueradeAll are read from.
        (
            "mode",
            "ipvs: {syncPeriod: 5s}\n",
            "mode: ipvs\nipvs: {syncPeriod: 5s}\n",
        ),
        ("iptables.masqueradeAll", "", "iptables: {masqueradeAll: true}\n"),
        (
            "iptables.localhostNodePorts",
            "",
            "iptables: {localhostNodePorts: false}\n",
        ),
        ("iptables.syncPeriod", "", "iptables: {syncPeriod: 5s}\n"),
        ("iptables.minSyncPeriod", "", "iptables: {minSyncPeriod: 5s}\n"),
        (
            "ipvs.syncPeriod",
            "mode: ipvs\n",
            "mode: ipvs\nipvs: {syncPeriod: 5s}\n",
        ),
        (
            "ipvs.minSyncPeriod",
            "mode: ipvs\n",
            "mode: ipvs\nipvs: {minSyncPeriod: 5s}\n",
        ),
        (
            "nftables.masqueradeAll",
            "mode: nftables\n",
            "mode: nftables\nnftables: {masqueradeAll: true}\n",
        ),
        (
            "nftables.syncPeriod",
            "mode: nftables\n",
            "mode: nftables\nnftables: {syncPeriod: 5s}\n",
        ),
        (
            "nftables.minSyncPeriod",
            "mode: nftables\n",
            "mode: nftables\nnftables: {minSyncPeriod: 5s}\n",
        ),
        ("detectLocalMode", "", "detectLocalMode: NodeCIDR\n"),
        (
            "detectLocal.clusterCIDRs",
            "",
            "detectLocal: {clusterCIDRs: [10.244.0.0/16]}\n",
        ),
        (
            "detectLocal.bridgeInterface",
            "",
            "detectLocal: {bridgeInterface: cbr0}\n",
        ),
        (
            "detectLocal.interfaceNamePrefix",
            "",
            "detectLocal: {interfaceNamePrefix: veth}\n",
        ),
        ("clusterCIDR", "", "clusterCIDR: 10.244.0.0/16\n"),
        ("nodePortAddresses", "", "nodePortAddresses: [primary]\n"),
        ("syncPeriod", "", "syncPeriod: 5s\n"),
        ("minSyncPeriod", "", "minSyncPeriod: 5s\n"),
        ("linux.masqueradeAll", "", "linux: {masqueradeAll: true}\n"),
    ];
    // Checked, not settings: a file with another apiVersion or kind is refused (read tests).
    let checked_only = ["apiVersion", "kind"];
    let mut marked = Vec::new();
    honoured(TOP, "", &mut marked);
    let missing: Vec<&String> = marked
        .iter()
        .filter(|f| !checked_only.contains(&f.as_str()) && !cases.iter().any(|(c, _, _)| c == *f))
        .collect();
    assert!(missing.is_empty(), "honoured fields without a case: {missing:?}");

    let effective = |body: &str| {
        let (mut args, explicit) = cli(&[]);
        merge(&load(body).config, &mut args, &explicit).unwrap_or_else(|e| panic!("{e}\n{body}"));
        format!("{args:?}")
    };
    for (field, baseline, file) in cases {
        assert!(
            marked.iter().any(|m| m == field),
            "{field} is not marked honoured"
        );
        assert_ne!(
            effective(baseline),
            effective(file),
            "{field}: setting it changes nothing the agent uses"
        );
    }
}
