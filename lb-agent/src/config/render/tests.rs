//! `--write-config-to`: the rendered file reads back to the same settings.

use std::path::PathBuf;

use super::*;
use crate::config::{
    ConfigError, load_file, merge, parse,
    test_support::{FILE, cli, load},
};

#[test]
fn rendered_config_round_trips() {
    let file = load(FILE).config;
    let (mut args, explicit) = cli(&[
        "--nodeport-addresses",
        "primary,10.0.0.0/8",
        "--bind-address",
        "192.168.1.5",
        "--detect-local-mode",
        "NodeCIDR",
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
    assert_eq!(c.bind_address, Some(Ipv4Addr::new(192, 168, 1, 5).into()));
    assert_eq!(c.cluster_cidrs, Some(vec!["10.244.0.0/16".to_string()]));
    assert_eq!(c.detect_local_mode, Some(crate::node::DetectLocalMode::NodeCidr));
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
