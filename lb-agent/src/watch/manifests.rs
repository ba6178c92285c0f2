//! Reads v1 Services, discovery.k8s.io/v1 EndpointSlices and v1 Nodes from a folder of YAML or
//! JSON files, exactly as `kubectl get -o yaml` prints them (multi-document files and `kind: List`
//! are accepted). Other kinds are ignored. An object without `metadata.namespace` is in the
//! `default` namespace, as `kubectl apply` would create it (see [`super::default_namespace`]).
//!
//! A bad file or object costs only itself: a file that cannot be read or parsed, or an object
//! that does not deserialize (the API server would refuse it), is reported with its file, kind,
//! name and field path, and the rest of the folder is loaded. [`Manifests`] also remembers the
//! last good version of every file and object, so a typo saved over a working manifest keeps the
//! working version programmed (and reported) instead of withdrawing it.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::ClusterState;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, thiserror::Error)]
pub enum ManifestError {
    #[error("reading {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("{path}: not valid YAML: {message}")]
    Yaml { path: PathBuf, message: String },
    #[error("{0}")]
    Object(Box<BadObject>),
}

/// An object that does not deserialize.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, thiserror::Error)]
#[error("{}: {kind} {name:?} (namespace {namespace}) is malformed at {field}: {message}", path.display())]
pub struct BadObject {
    pub path: PathBuf,
    pub kind: String,
    pub namespace: String,
    pub name: String,
    /// Where in the object, as a path (`spec.ports[0].port`).
    pub field: String,
    pub message: String,
}

/// What one load of the folder found.
#[derive(Debug, Default)]
pub struct Loaded {
    pub state: ClusterState,
    /// Files and objects that were skipped, or replaced by their last good version.
    pub problems: Vec<Problem>,
}

/// A bad file or object, and what was done about it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    pub error: ManifestError,
    /// True when the last good version (from an earlier load) was used instead.
    pub kept_last_good: bool,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let outcome = if self.kept_last_good {
            "keeping its last good version"
        } else {
            "skipped"
        };
        write!(f, "{}; {outcome}", self.error)
    }
}

/// An object of the folder: (file, kind, namespace, name).
type ObjectId = (PathBuf, String, String, String);

/// A manifests folder, loaded again at every sync.
#[derive(Debug)]
pub struct Manifests {
    dir: PathBuf,
    node_name: String,
    /// The text of every file as last read and parsed.
    good_files: BTreeMap<PathBuf, String>,
    /// Every object as last deserialized.
    good_objects: BTreeMap<ObjectId, Value>,
}

impl Manifests {
    /// `node_name` picks the Node object that describes this node, if the folder has one.
    pub fn new(dir: &Path, node_name: &str) -> Self {
        Self {
            dir: dir.to_path_buf(),
            node_name: node_name.to_string(),
            good_files: BTreeMap::new(),
            good_objects: BTreeMap::new(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Loads every `*.yaml`, `*.yml` and `*.json` file of the folder (not recursive), in name
    /// order. Only an unreadable folder is an error.
    pub fn load(&mut self) -> Result<Loaded, ManifestError> {
        let mut files: Vec<PathBuf> = fs::read_dir(&self.dir)
            .map_err(|e| ManifestError::Read {
                path: self.dir.clone(),
                message: e.to_string(),
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
            })
            .collect();
        files.sort();
        let mut loaded = Loaded::default();
        let mut good_files = BTreeMap::new();
        let mut good_objects = BTreeMap::new();
        for path in files {
            let docs = fs::read_to_string(&path)
                .map_err(|e| ManifestError::Read {
                    path: path.clone(),
                    message: e.to_string(),
                })
                .and_then(|text| parse_documents(&text, &path).map(|docs| (text, docs)));
            let docs = match docs {
                Ok((text, docs)) => {
                    good_files.insert(path.clone(), text);
                    docs
                }
                Err(error) => {
                    // It parsed before: keep serving what it said then.
                    let previous = self
                        .good_files
                        .get(&path)
                        .and_then(|text| parse_documents(text, &path).ok().map(|docs| (text.clone(), docs)));
                    loaded.problems.push(Problem {
                        error,
                        kept_last_good: previous.is_some(),
                    });
                    let Some((text, docs)) = previous else {
                        continue;
                    };
                    good_files.insert(path.clone(), text);
                    docs
                }
            };
            for doc in docs {
                self.add(doc, &path, &mut loaded, &mut good_objects);
            }
        }
        self.good_files = good_files;
        self.good_objects = good_objects;
        Ok(loaded)
    }

    /// Adds one object (or the items of a list) to the state, or reports why it cannot.
    fn add(
        &self,
        doc: Value,
        path: &Path,
        loaded: &mut Loaded,
        good_objects: &mut BTreeMap<ObjectId, Value>,
    ) {
        let field = |pointer: &str| {
            doc.pointer(pointer)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let kind = field("/kind");
        let name = field("/metadata/name");
        let namespace = Some(field("/metadata/namespace"))
            .filter(|ns| !ns.is_empty())
            .unwrap_or_else(|| "default".into());
        if matches!(
            kind.as_str(),
            "List" | "ServiceList" | "EndpointSliceList" | "NodeList"
        ) {
            if let Some(items) = doc.get("items").and_then(Value::as_array) {
                for item in items {
                    self.add(item.clone(), path, loaded, good_objects);
                }
            }
            return;
        }
        let wanted = match kind.as_str() {
            "Service" | "EndpointSlice" | "ServiceCIDR" => true,
            "Node" => name == self.node_name,
            _ => false,
        };
        if !wanted {
            return;
        }
        let id: ObjectId = (path.to_path_buf(), kind.clone(), namespace.clone(), name.clone());
        let object = match add_object(&mut loaded.state, &kind, &doc) {
            Ok(()) => doc,
            Err((field, message)) => {
                let previous = self.good_objects.get(&id);
                loaded.problems.push(Problem {
                    error: ManifestError::Object(Box::new(BadObject {
                        path: path.to_path_buf(),
                        kind: kind.clone(),
                        namespace,
                        name,
                        field,
                        message,
                    })),
                    kept_last_good: previous.is_some(),
                });
                let Some(previous) = previous else {
                    return;
                };
                if add_object(&mut loaded.state, &kind, previous).is_err() {
                    return;
                }
                previous.clone()
            }
        };
        good_objects.insert(id, object);
    }
}

/// Loads a folder once, without last good versions (for one-shot commands such as `trace`).
pub fn load_dir(dir: &Path, node_name: &str) -> Result<Loaded, ManifestError> {
    Manifests::new(dir, node_name).load()
}

/// The documents of one file (a YAML stream; JSON is YAML), without the empty ones.
fn parse_documents(text: &str, path: &Path) -> Result<Vec<Value>, ManifestError> {
    // The parser's default budget is a config file's: 1,024 documents, 250,000 nodes, so a file
    // with 600 Services and their slices was refused whole. Without aliases, documents, nodes and
    // events grow with the text, so those caps follow its length here; the alias and anchor caps,
    // which stop an alias bomb, stay the defaults.
    let len = text.len().max(1024);
    let options = serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_documents: len,
            max_nodes: len,
            max_events: len.saturating_mul(4),
        },
    };
    let docs: Vec<Value> =
        serde_saphyr::from_multiple_with_options(text, options).map_err(|e| ManifestError::Yaml {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

/// Deserializes one object of a kind we read and adds it; the error is (field path, message).
fn add_object(state: &mut ClusterState, kind: &str, doc: &Value) -> Result<(), (String, String)> {
    match kind {
        "Service" => state.add_service(typed::<Service>(doc)?),
        "EndpointSlice" => state.add_slice(typed::<EndpointSlice>(doc)?),
        "Node" => state.node = Some(std::sync::Arc::new(typed::<Node>(doc)?)),
        "ServiceCIDR" => {
            let object = typed::<k8s_openapi::api::networking::v1::ServiceCIDR>(doc)?;
            let cidrs = state.service_cidrs.get_or_insert_default();
            cidrs.extend(super::kube::service_cidrs_of(std::iter::once(&object)));
            cidrs.sort();
            cidrs.dedup();
        }
        _ => {}
    }
    Ok(())
}

fn typed<T: DeserializeOwned>(doc: &Value) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize(doc).map_err(|e| (e.path().to_string(), e.into_inner().to_string()))
}

/// Adds the objects of one file's text to `state` (objects without a namespace go to `default`);
/// for tests and tools that hold manifests in memory. Any problem is an error.
pub fn load_text(
    text: &str,
    path: &Path,
    node_name: &str,
    state: &mut ClusterState,
) -> Result<(), ManifestError> {
    let manifests = Manifests::new(path.parent().unwrap_or(Path::new(".")), node_name);
    let mut loaded = Loaded {
        state: std::mem::take(state),
        problems: Vec::new(),
    };
    for doc in parse_documents(text, path)? {
        manifests.add(doc, path, &mut loaded, &mut BTreeMap::new());
    }
    *state = loaded.state;
    match loaded.problems.into_iter().next() {
        Some(problem) => Err(problem.error),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
