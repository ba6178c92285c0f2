//! Reads v1 Services, discovery.k8s.io/v1 EndpointSlices and v1 Nodes from a folder of YAML or
//! JSON files, exactly as `kubectl get -o yaml` prints them (multi-document files and `kind: List`
//! are accepted). Other kinds are ignored; a malformed object is an error naming its file. An
//! object without `metadata.namespace` is in the `default` namespace, as `kubectl apply` would
//! create it (see [`super::default_namespace`]).

use std::{
    fs,
    path::{Path, PathBuf},
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde_json::Value;

use super::ClusterState;

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("reading {path}: {error}")]
    Read { path: PathBuf, error: std::io::Error },
    #[error("{path}: not valid YAML: {message}")]
    Yaml { path: PathBuf, message: String },
    #[error("{path}: {kind} {name:?} is malformed: {message}")]
    Object {
        path: PathBuf,
        kind: String,
        name: String,
        message: String,
    },
}

/// Loads every `*.yaml`, `*.yml` and `*.json` file of `dir` (not recursive), in name order.
/// `node_name` picks the Node object that describes this node, if the folder has one.
pub fn load_dir(dir: &Path, node_name: &str) -> Result<ClusterState, ManifestError> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|error| ManifestError::Read {
            path: dir.to_path_buf(),
            error,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
        })
        .collect();
    files.sort();
    let mut state = ClusterState::default();
    for path in files {
        let text = fs::read_to_string(&path).map_err(|error| ManifestError::Read {
            path: path.clone(),
            error,
        })?;
        load_text(&text, &path, node_name, &mut state)?;
    }
    Ok(state)
}

/// Adds the objects of one file's text to `state` (objects without a namespace go to `default`).
pub fn load_text(
    text: &str,
    path: &Path,
    node_name: &str,
    state: &mut ClusterState,
) -> Result<(), ManifestError> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(text).map_err(|e| ManifestError::Yaml {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let mut queue: Vec<Value> = docs.into_iter().filter(|d| !d.is_null()).collect();
    while let Some(doc) = queue.pop() {
        let kind = doc
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let name = doc
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let malformed = |e: serde_json::Error| ManifestError::Object {
            path: path.to_path_buf(),
            kind: kind.clone(),
            name: name.clone(),
            message: e.to_string(),
        };
        match kind.as_str() {
            "List" | "ServiceList" | "EndpointSliceList" | "NodeList" => {
                if let Some(items) = doc.get("items").and_then(Value::as_array) {
                    queue.extend(items.iter().cloned());
                }
            }
            "Service" => state.add_service(serde_json::from_value::<Service>(doc).map_err(malformed)?),
            "EndpointSlice" => {
                state.add_slice(serde_json::from_value::<EndpointSlice>(doc).map_err(malformed)?)
            }
            "Node" if name == node_name => {
                state.node = Some(std::sync::Arc::new(
                    serde_json::from_value::<Node>(doc).map_err(malformed)?,
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: demo
spec:
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  ports:
  - name: http
    port: 80
    protocol: TCP
    targetPort: 8080
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: demo
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
endpoints:
- addresses: [10.244.1.5]
  conditions: {ready: true}
  nodeName: node-a
ports:
- name: http
  port: 8080
  protocol: TCP
---
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata:
    name: node-a
    labels: {topology.kubernetes.io/zone: z1}
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: ignored}
"#;

    #[test]
    fn reads_services_slices_and_this_node() {
        let mut state = ClusterState::default();
        load_text(TEXT, Path::new("t.yaml"), "node-a", &mut state).unwrap();
        assert_eq!(state.services.len(), 1);
        assert_eq!(state.slices.len(), 1);
        assert!(state.node.is_some());
        let by_svc = state.slices_by_service();
        assert_eq!(by_svc[&("demo".to_string(), "web".to_string())].len(), 1);
    }

    /// Regression: a Service and its slice written without `metadata.namespace` (as people write
    /// manifests for `kubectl apply`) used to be keyed as "default" but named "" by the model, so
    /// the slice was dropped silently and the Service programmed without backends.
    #[test]
    fn objects_without_a_namespace_are_in_the_default_namespace() {
        let text = r#"
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
endpoints:
- addresses: [10.244.1.5]
ports:
- {name: http, port: 8080, protocol: TCP}
"#;
        let mut state = ClusterState::default();
        load_text(text, Path::new("t.yaml"), "node-a", &mut state).unwrap();
        let key = ("default".to_string(), "web".to_string());
        assert_eq!(
            state.services[&key].metadata.namespace.as_deref(),
            Some("default")
        );
        let slice_key = ("default".to_string(), "web-abc".to_string());
        assert_eq!(
            state.slices[&slice_key].metadata.namespace.as_deref(),
            Some("default")
        );

        let node = crate::sync::node_info("node-a", None);
        let computed = crate::sync::compute(&state, &node, &crate::plan::NodeContext::default());
        assert!(computed.problems.is_empty(), "{:?}", computed.problems);
        let (frontend, plan) = computed.desired.frontends.iter().next().expect("a frontend");
        assert_eq!(frontend.to_string(), "10.96.0.10:80/TCP");
        assert_eq!(plan.service.to_string(), "default/web:http");
        let backends: Vec<String> = plan.backends().map(|b| b.addr.to_string()).collect();
        assert_eq!(backends, ["10.244.1.5"]);
        assert_eq!(computed.desired.backends.len(), 1);
    }

    #[test]
    fn malformed_objects_name_their_file() {
        let bad = "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: 7}\n";
        let err = load_text(bad, Path::new("bad.yaml"), "n", &mut ClusterState::default()).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("bad.yaml") && text.contains("Service"), "{text}");
    }
}
