//! Helpers shared by the configuration tests: parsing a body under the v1alpha1 header, finding a
//! warning, parsing the agent's command line, and a sample file.

use std::collections::HashSet;

use clap::{CommandFactory, FromArgMatches};

use super::{ConfigError, ConfigWarning, LoadedConfig, explicit_flags, parse};
use crate::cli::{Cli, RunArgs};

const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

pub(super) fn load(body: &str) -> LoadedConfig {
    parse(&format!("{HEADER}{body}")).unwrap_or_else(|e| panic!("{e}"))
}

pub(super) fn load_err(body: &str) -> ConfigError {
    parse(&format!("{HEADER}{body}")).expect_err("should fail")
}

pub(super) fn warning<'a>(loaded: &'a LoadedConfig, path: &str) -> &'a ConfigWarning {
    loaded
        .warnings
        .iter()
        .find(|w| w.path == path)
        .unwrap_or_else(|| panic!("no warning for {path}: {:#?}", loaded.warnings))
}

/// Parses the agent's command line and computes the explicit flag ids.
pub(super) fn cli(argv: &[&str]) -> (RunArgs, HashSet<String>) {
    let mut full = vec!["lb-agent"];
    full.extend_from_slice(argv);
    let matches = Cli::command().try_get_matches_from(full).unwrap();
    let explicit = explicit_flags(&matches);
    let cli = Cli::from_arg_matches(&matches).unwrap();
    (cli.run, explicit)
}

pub(super) const FILE: &str = r#"
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
