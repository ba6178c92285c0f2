//! Polling the cluster through kubectl: waiting for a condition, objects as JSON, Pods by
//! label and whether one is Ready.

use std::{
    thread,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};

use crate::control_plane::ControlPlane;

/// Polls `f` until it returns `Some`, failing after `timeout` with `what` and the last error.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            bail!("{what}: not within {timeout:?} (last error: {last})");
        }
        thread::sleep(Duration::from_millis(200));
    }
}

/// `kubectl <args> -o json`, parsed.
pub fn json_of(cp: &ControlPlane, args: &[&str]) -> Result<serde_json::Value> {
    let mut full = args.to_vec();
    full.extend(["-o", "json"]);
    Ok(serde_json::from_str(&cp.kubectl(full)?)?)
}

/// The Pods of a label selector.
pub fn pods(cp: &ControlPlane, namespace: &str, selector: &str) -> Result<Vec<serde_json::Value>> {
    let v = json_of(cp, &["-n", namespace, "get", "pods", "-l", selector])?;
    Ok(v["items"].as_array().cloned().unwrap_or_default())
}

/// Ready, and not being deleted.
pub fn is_ready(pod: &serde_json::Value) -> bool {
    pod["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
        && pod["metadata"]["deletionTimestamp"].is_null()
}
