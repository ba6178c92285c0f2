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
    assert_eq!(&*state.slices[&slice_key].namespace, "default");

    // The slice belongs to the Service (the plan's golden case `no-namespace` checks the
    // backend is programmed).
    assert_eq!(state.slices_by_service()[&key].len(), 1);
}

#[test]
fn malformed_objects_name_their_file_kind_name_and_field() {
    let bad = "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: eighty}]}\n";
    let err = load_text(bad, Path::new("bad.yaml"), "n", &mut ClusterState::default()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("bad.yaml")
            && text.contains("Service \"x\" (namespace default)")
            && text.contains("spec.ports[0].port"),
        "{text}"
    );
}

const GOOD: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: good, namespace: demo}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n";

fn service(port: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: edited, namespace: demo}}\nspec: {{clusterIP: 10.96.0.2, ports: [{{port: {port}}}]}}\n"
    )
}

fn port_of(state: &ClusterState, name: &str) -> Option<i32> {
    let svc = state.services.get(&("demo".to_string(), name.to_string()))?;
    Some(svc.spec.as_ref()?.ports.as_ref()?[0].port)
}

#[test]
fn a_bad_object_or_file_costs_only_itself() {
    let dir = tempfile::tempdir().unwrap();
    let bad_object = format!("{}---\n{GOOD}", service("eighty"));
    fs::write(dir.path().join("a.yaml"), bad_object).unwrap();
    fs::write(dir.path().join("b.yaml"), "kind: [unclosed").unwrap();
    fs::write(
        dir.path().join("c.yaml"),
        GOOD.replace("name: good", "name: other"),
    )
    .unwrap();
    let loaded = load_dir(dir.path(), "n").unwrap();
    assert_eq!(port_of(&loaded.state, "good"), Some(80));
    assert_eq!(port_of(&loaded.state, "other"), Some(80));
    assert_eq!(port_of(&loaded.state, "edited"), None);
    let problems: Vec<String> = loaded.problems.iter().map(ToString::to_string).collect();
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(
        problems[0].contains("a.yaml")
            && problems[0].contains("spec.ports[0].port")
            && problems[0].ends_with("skipped"),
        "{problems:?}"
    );
    assert!(
        problems[1].contains("b.yaml") && problems[1].contains("not valid YAML"),
        "{problems:?}"
    );
}

#[test]
fn a_broken_edit_keeps_the_last_good_version_until_fixed_or_removed() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.yaml");
    let mut manifests = Manifests::new(dir.path(), "n");
    fs::write(&file, service("80")).unwrap();
    assert_eq!(port_of(&manifests.load().unwrap().state, "edited"), Some(80));

    // A malformed object: the last good version stays, and the problem says so.
    fs::write(&file, service("eighty")).unwrap();
    let loaded = manifests.load().unwrap();
    assert_eq!(port_of(&loaded.state, "edited"), Some(80));
    assert!(loaded.problems[0].kept_last_good, "{:?}", loaded.problems);
    assert!(
        loaded.problems[0]
            .to_string()
            .ends_with("keeping its last good version")
    );

    // A file that no longer parses: the same.
    fs::write(&file, "kind: [unclosed").unwrap();
    let loaded = manifests.load().unwrap();
    assert_eq!(port_of(&loaded.state, "edited"), Some(80));
    assert!(loaded.problems[0].kept_last_good);

    // Fixed: the new version, no problem.
    fs::write(&file, service("81")).unwrap();
    let loaded = manifests.load().unwrap();
    assert_eq!(port_of(&loaded.state, "edited"), Some(81));
    assert!(loaded.problems.is_empty());

    // Removed: gone, and a later broken file of the same name has nothing to fall back on.
    fs::remove_file(&file).unwrap();
    assert_eq!(port_of(&manifests.load().unwrap().state, "edited"), None);
    fs::write(&file, service("eighty")).unwrap();
    let loaded = manifests.load().unwrap();
    assert_eq!(port_of(&loaded.state, "edited"), None);
    assert!(!loaded.problems[0].kept_last_good);
}

#[test]
fn an_unreadable_folder_is_an_error() {
    let err = load_dir(Path::new("/nonexistent/manifests"), "n").unwrap_err();
    assert!(err.to_string().contains("/nonexistent/manifests"), "{err}");
}

/// Regression: the YAML parser's default budget (1,024 documents) refused a file of 600
/// Services and their slices whole ("budget breached"), so nothing was programmed. A cluster's
/// worth of objects loads; an alias bomb is still refused.
#[test]
fn a_file_of_thousands_of_objects_loads_and_an_alias_bomb_does_not() {
    let one = TEXT.split("---").next().unwrap().to_string();
    let text: String = (0..3000)
        .map(|i| {
            one.replace("name: web", &format!("name: web{i}"))
                .replace("10.96.0.10", &format!("10.96.{}.{}", i / 250, i % 250 + 1))
        })
        .collect::<Vec<_>>()
        .join("---\n");
    let mut state = ClusterState::default();
    load_text(&text, Path::new("many.yaml"), "node-a", &mut state).unwrap();
    assert_eq!(state.services.len(), 3000);

    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for level in 1..12 {
        let prev = (b'a' + level - 1) as char;
        let this = (b'a' + level) as char;
        bomb.push_str(&format!("{this}: &{this} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"));
    }
    let err = parse_documents(&bomb, Path::new("bomb.yaml")).unwrap_err();
    assert!(err.to_string().contains("bomb.yaml"), "{err}");
}
