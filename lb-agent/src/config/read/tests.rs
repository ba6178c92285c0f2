//! Reading files: apiVersion and kind, the honoured fields, the mode's sections, the internal/draft
//! layout, and fatal type and value errors.

use std::net::Ipv4Addr;

use super::*;
use crate::config::test_support::{load, load_err, warning};

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
    assert_eq!(c.bind_address, Some(Ipv4Addr::new(192, 168, 1, 10).into()));
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
    use crate::node::DetectLocalMode;
    assert!(load("detectLocalMode: \"\"\n").warnings.is_empty());
    assert_eq!(
        load("detectLocalMode: NodeCIDR\n").config.detect_local_mode,
        Some(DetectLocalMode::NodeCidr)
    );
    assert_eq!(
        load("detectLocalMode: ClusterCIDR\n").config.detect_local_mode,
        Some(DetectLocalMode::ClusterCidr)
    );
    let bridge = load("detectLocalMode: BridgeInterface\ndetectLocal:\n  bridgeInterface: cbr0\n");
    assert!(bridge.warnings.is_empty(), "{:?}", bridge.warnings);
    assert_eq!(
        bridge.config.detect_local_mode,
        Some(DetectLocalMode::BridgeInterface)
    );
    assert_eq!(bridge.config.pod_bridge_interface.as_deref(), Some("cbr0"));
    let prefix = load("detectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  interfaceNamePrefix: veth\n");
    assert!(prefix.warnings.is_empty(), "{:?}", prefix.warnings);
    assert_eq!(
        prefix.config.detect_local_mode,
        Some(DetectLocalMode::InterfaceNamePrefix)
    );
    assert_eq!(prefix.config.pod_interface_name_prefix.as_deref(), Some("veth"));
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
    let c = load("bindAddress: 0.0.0.0\nhealthzBindAddress: \"\"\nmetricsBindAddress: \":9999\"\n").config;
    assert_eq!(c.bind_address, None);
    assert_eq!(c.healthz_bind_address, None);
    assert_eq!(c.metrics_bind_address.as_deref(), Some("[::]:9999"));
    let c = load("healthzBindAddress: \"::1\"\n").config;
    assert_eq!(c.healthz_bind_address.as_deref(), Some("[::1]:10256"));
    // Either family: it overrides the node's primary IP of its family (`detectNodeIPs`).
    let loaded = load("bindAddress: \"fd00::1\"\n");
    assert_eq!(loaded.config.bind_address, Some("fd00::1".parse().unwrap()));
    assert!(
        loaded.warnings.iter().all(|w| w.path != "bindAddress"),
        "{:#?}",
        loaded.warnings
    );
    assert_eq!(load("bindAddress: \"::\"\n").config.bind_address, None);
    // Zero durations and zero client settings are unset, as kube-proxy's defaulting.
    let c = load("configSyncPeriod: 0s\niptables:\n  syncPeriod: 0s\n  minSyncPeriod: 0s\nclientConnection:\n  qps: 0\n  burst: 0\n").config;
    assert_eq!(c, ProxyConfig::default());
}
