//! The sandbox (README command 1) as a new user runs it: it must end with every example Service
//! balanced correctly from a pod and from the external client, and leave nothing behind.

use std::{collections::BTreeSet, path::Path, process::Command};

use lb_tests::{process::workspace_bin, require_root};
use serde_json::Value;

fn flows<'a>(summary: &'a Value, service: &str) -> Vec<&'a Value> {
    summary["flows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["service"].as_str().unwrap().starts_with(service))
        .collect()
}

fn backends(flow: &Value) -> BTreeSet<String> {
    flow["per_backend"].as_object().unwrap().keys().cloned().collect()
}

#[test]
fn the_sandbox_balances_every_example_service() {
    require_root();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/examples");
    let summary_file = tempfile::NamedTempFile::new().unwrap();
    let out = Command::new(workspace_bin("lb-sandbox"))
        .args(["--duration", "12s", "--rate", "20", "--examples"])
        .arg(&examples)
        .arg("--summary-json")
        .arg(summary_file.path())
        .output()
        .expect("run lb-sandbox");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "lb-sandbox failed:\n{stderr}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(summary_file.path()).unwrap()).unwrap();
    let all_web: BTreeSet<String> = ["web-1", "web-2", "web-3", "web-4"].map(String::from).into();

    for f in summary["flows"].as_array().unwrap() {
        let served: u64 = f["per_backend"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        if f["expect_denied"] == true {
            assert_eq!(
                served, 0,
                "a source outside loadBalancerSourceRanges is dropped: {f}"
            );
        } else {
            assert_eq!(f["errors"], 0, "no request may fail: {f}");
            assert!(served > 20, "traffic flowed: {f}");
        }
    }
    // Pods reach every ClusterIP with their own address; every web backend serves.
    for f in flows(&summary, "demo/web").iter().filter(|f| f["from"] == "pod") {
        assert_eq!(f["replaced_client_ip"], 0, "{f}");
        if !f["service"].as_str().unwrap().starts_with("demo/sticky") {
            assert_eq!(backends(f), all_web, "{f}");
        }
    }
    // externalTrafficPolicy Cluster: every backend, masqueraded.
    for f in flows(&summary, "demo/web-nodeport")
        .iter()
        .filter(|f| f["from"] == "external")
    {
        assert_eq!(backends(f), all_web, "{f}");
        assert_eq!(f["kept_client_ip"], 0, "{f}");
    }
    // externalTrafficPolicy Local: the node's own pods only, client IP kept.
    for f in flows(&summary, "demo/web-local")
        .iter()
        .filter(|f| f["from"] == "external")
    {
        let local: BTreeSet<String> = if f["frontend"].as_str().unwrap().contains("192.168.50.11:") {
            ["web-1", "web-2"].map(String::from).into()
        } else {
            ["web-3", "web-4"].map(String::from).into()
        };
        assert_eq!(backends(f), local, "{f}");
        assert_eq!(f["replaced_client_ip"], 0, "{f}");
    }
    // ClientIP affinity: one backend per client.
    for f in flows(&summary, "demo/sticky") {
        assert_eq!(backends(f).len(), 1, "{f}");
    }
    // UDP DNS-style: both DNS backends answer, from the Service address.
    for f in flows(&summary, "demo/dns") {
        assert_eq!(backends(f), ["dns-1", "dns-2"].map(String::from).into(), "{f}");
    }
    // The LoadBalancer IP is served to the allowed client.
    assert!(
        flows(&summary, "demo/web-lb").iter().any(|f| f["frontend"]
            .as_str()
            .unwrap()
            .starts_with("LoadBalancer")
            && f["from"] == "external")
    );

    // Nothing left behind.
    let netns = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    assert!(!netns.contains("lbsb-"), "namespaces left: {netns}");
    assert!(!Path::new("/run/lb-sandbox").exists());
}
