//! Explicit flags, both precedences, and validation of the merged result.

use clap::CommandFactory;

use super::*;
use crate::{
    cli::Cli,
    config::test_support::{FILE, cli, load},
};

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
        flag::DETECT_LOCAL_MODE,
        flag::NODEPORT_ADDRESSES,
        flag::KUBECONFIG,
        flag::SYNC_PERIOD,
        flag::MIN_SYNC_PERIOD,
        flag::MASQUERADE_ALL,
        flag::LOCALHOST_NODEPORTS,
        flag::LOG_FORMAT,
        flag::KUBE_API_QPS,
        flag::KUBE_API_BURST,
    ] {
        assert!(command.get_arguments().any(|a| a.get_id() == id), "no flag {id}");
    }
}

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
    assert!(!args.node.iptables_localhost_nodeports);
    assert_eq!(args.healthz_bind_address, "0.0.0.0:20256");
    assert_eq!(args.log_format, LogFormat::Json);
    // Untouched by the file: defaults stay.
    assert_eq!(args.metrics_bind_address, "127.0.0.1:10249");
    assert_eq!(notes.len(), 2, "{notes:#?}");
    assert!(notes.iter().any(|n| n
        == "--sync-period=10s overrides syncPeriod=1m0s from the config file (kube-proxy would ignore the flag)"));
    assert!(
        notes.iter().any(|n| n
            == "--hostname-override=from-flag overrides hostnameOverride=from-file from the config file")
    );
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
    assert!(notes.iter().any(
        |n| n == "--sync-period is ignored: the config file sets syncPeriod=1m0s (kube-proxy precedence)"
    ));
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
fn the_client_rate_limit_comes_from_the_file_unless_a_flag_says_otherwise() {
    let file = ProxyConfig {
        qps: Some(50.0),
        burst: Some(100),
        ..Default::default()
    };
    let (mut args, explicit) = cli(&["--manifests", "/m"]);
    assert_eq!(
        (args.kube_api_qps, args.kube_api_burst),
        (5.0, 10),
        "kube-proxy's defaults"
    );
    merge(&file, &mut args, &explicit).unwrap();
    assert_eq!((args.kube_api_qps, args.kube_api_burst), (50.0, 100));
    let (mut args, explicit) = cli(&["--manifests", "/m", "--kube-api-qps", "-1"]);
    let notes = merge(&file, &mut args, &explicit).unwrap();
    assert_eq!((args.kube_api_qps, args.kube_api_burst), (-1.0, 100));
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("--kube-api-qps=-1 overrides clientConnection.qps=50")),
        "{notes:?}"
    );
}

#[test]
fn flags_alone_are_validated_as_a_file_is() {
    let (args, _) = cli(&["--manifests", "/m", "--sync-period", "0"]);
    assert!(validate(&args).unwrap_err().to_string().contains("syncPeriod"));
    let (args, _) = cli(&[
        "--manifests",
        "/m",
        "--sync-period",
        "1s",
        "--min-sync-period",
        "2s",
    ]);
    assert!(validate(&args).is_err());
    let (args, _) = cli(&["--manifests", "/m", "--min-sync-period", "0"]);
    assert!(
        validate(&args).is_ok(),
        "a zero minSyncPeriod is kube-proxy's 'no minimum'"
    );
}

/// `detectLocalMode` from the file, or `--detect-local-mode` given explicitly (which wins, with a
/// note, as the other flags do).
#[test]
fn detect_local_mode_from_the_file_or_the_flag() {
    use crate::node::DetectLocalMode;
    let file = load("detectLocalMode: NodeCIDR\n").config;
    let (mut args, explicit) = cli(&[]);
    merge(&file, &mut args, &explicit).unwrap();
    assert_eq!(args.node.detect_local_mode, DetectLocalMode::NodeCidr);
    assert_eq!(
        args.node.settings().unwrap().detect_local_mode,
        DetectLocalMode::NodeCidr
    );
    let (mut args, explicit) = cli(&["--detect-local-mode", "ClusterCIDR"]);
    let notes = merge(&file, &mut args, &explicit).unwrap();
    assert_eq!(args.node.detect_local_mode, DetectLocalMode::ClusterCidr);
    assert_eq!(
        notes,
        [
            "--detect-local-mode=ClusterCIDR overrides detectLocalMode=NodeCIDR from the config file (kube-proxy would ignore the flag)"
        ]
    );
    let err = Cli::command()
        .try_get_matches_from(["lb-agent", "--detect-local-mode", "bridge"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown mode"), "{err}");
}

/// The interface modes take their interface from the file's `detectLocal` or the flag, and
/// refuse to start without one (kube-proxy's validation).
#[test]
fn interface_modes_need_their_interface() {
    let file = load("detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cbr0}\n").config;
    let (mut args, explicit) = cli(&[]);
    merge(&file, &mut args, &explicit).unwrap();
    let settings = args.node.settings().unwrap();
    assert_eq!(
        settings.detect_local_mode,
        crate::node::DetectLocalMode::BridgeInterface
    );
    assert_eq!(
        settings.interface_detector(),
        Some(crate::node::InterfaceDetector::Bridge("cbr0".into()))
    );
    let (args, _) = cli(&[
        "--detect-local-mode",
        "InterfaceNamePrefix",
        "--pod-interface-name-prefix",
        "veth",
    ]);
    assert_eq!(
        args.node.settings().unwrap().interface_detector(),
        Some(crate::node::InterfaceDetector::NamePrefix("veth".into()))
    );
    for (mode, flag) in [
        ("BridgeInterface", "--pod-bridge-interface"),
        ("InterfaceNamePrefix", "--pod-interface-name-prefix"),
    ] {
        let (args, _) = cli(&["--detect-local-mode", mode]);
        let err = args.node.settings().unwrap_err().to_string();
        assert!(err.contains(flag), "{err}");
    }
}
