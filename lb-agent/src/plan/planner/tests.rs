//! Cases the property tests (`plan::proptests::incremental_*`) reach only by luck: a backend
//! whose flags change while no frontend does, contested frontends changing hands, problems
//! reported once, and a recomputed Service that did not change costing nothing.

use std::path::Path;

use super::*;
use crate::watch::manifests::load_text;

fn state(yaml: &str) -> ClusterState {
    let mut s = ClusterState::default();
    load_text(yaml, Path::new("t.yaml"), "node-a", &mut s).unwrap();
    s
}

/// A node serving both families (`NodeContext::default()` serves none).
fn ctx() -> NodeContext {
    NodeContext {
        serves: crate::family::PerFamily { v4: true, v6: true },
        ..NodeContext::default()
    }
}

fn node() -> NodeInfo {
    NodeInfo {
        name: "node-a".into(),
        zone: None,
    }
}

fn inputs(s: &ClusterState) -> impl Fn(&ServiceKey) -> ServiceInputs + '_ {
    |key| s.service_inputs(key)
}

fn key(name: &str) -> ServiceKey {
    ("t".to_string(), name.to_string())
}

const WEB: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: t}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP}]
"#;

fn web_slice(node: &str) -> String {
    format!(
        r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: t
  labels: {{kubernetes.io/service-name: web}}
addressType: IPv4
endpoints:
- addresses: [10.244.1.5]
  nodeName: {node}
ports:
- {{name: http, port: 8080, protocol: TCP}}
"#
    )
}

#[test]
fn a_backend_moving_to_this_node_changes_its_flags_only() {
    let ctx = ctx();
    let before = state(&format!("{WEB}---{}", web_slice("node-b")));
    let mut s = Planner::new();
    s.rebuild(&before, &node(), &ctx);
    let after = state(&format!("{WEB}---{}", web_slice("node-a")));
    let outcome = s.update(&[key("web")], inputs(&after));
    // Cluster policy: the frontend's backends are the same; the backend is now local.
    assert!(outcome.changes.frontends.is_empty(), "{:?}", outcome.changes);
    assert_eq!(outcome.changes.backends.len(), 1);
    assert_eq!(
        s.desired(),
        &super::super::from_scratch(&after, &node(), &ctx).desired
    );
    let (_, flags) = s.desired().backends.iter().next().unwrap();
    assert_eq!(*flags, lb_common::backend::flags::LOCAL);
}

#[test]
fn an_unchanged_service_costs_nothing() {
    let ctx = ctx();
    let st = state(&format!("{WEB}---{}", web_slice("node-a")));
    let mut s = Planner::new();
    s.rebuild(&st, &node(), &ctx);
    let outcome = s.update(&[key("web"), key("absent")], inputs(&st));
    assert!(outcome.changes.is_empty(), "{:?}", outcome.changes);
    assert!(outcome.new_problems.is_empty());
}

fn with_external_ip(name: &str, cluster_ip: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: t}}
spec:
  clusterIP: {cluster_ip}
  externalIPs: [203.0.113.7]
  ports: [{{name: http, port: 80, protocol: TCP}}]
"#
    )
}

#[test]
fn a_contested_frontend_changes_hands_and_conflicts_are_reported_once() {
    let ctx = ctx();
    let both = state(&format!(
        "{}---{}",
        with_external_ip("a", "10.96.0.1"),
        with_external_ip("b", "10.96.0.2")
    ));
    let mut s = Planner::new();
    let first = s.rebuild(&both, &node(), &ctx);
    // "a" wins (first by name); "b"'s claim is reported, once.
    let lost: Vec<_> = first
        .new_problems
        .iter()
        .filter(|p| p.message.contains("already served"))
        .collect();
    assert_eq!(lost.len(), 1, "{:?}", first.new_problems);
    assert_eq!(lost[0].name, "b");
    let external = s
        .desired()
        .frontends
        .iter()
        .find(|(f, _)| f.addr.to_string() == "203.0.113.7")
        .map(|(f, p)| (*f, p.service.name.clone()))
        .unwrap();
    assert_eq!(external.1, "a");
    // Recomputing "b" unchanged reports nothing new.
    let again = s.update(&[key("b")], inputs(&both));
    assert!(again.new_problems.is_empty(), "{:?}", again.new_problems);
    // "a" goes: the external IP passes to "b", and the conflict is gone.
    let only_b = state(&with_external_ip("b", "10.96.0.2"));
    let outcome = s.update(&[key("a")], inputs(&only_b));
    assert!(outcome.changes.frontends.contains(&external.0));
    assert_eq!(s.desired().frontends[&external.0].service.name, "b");
    assert!(s.problems().is_empty(), "{:?}", s.problems());
    assert_eq!(
        s.desired(),
        &super::super::from_scratch(&only_b, &node(), &ctx).desired
    );
}

#[test]
fn other_node_facts_need_a_rebuild() {
    let ctx = ctx();
    let mut s = Planner::new();
    assert!(!s.is_current(&node(), &ctx), "nothing computed yet");
    s.rebuild(&ClusterState::default(), &node(), &ctx);
    assert!(s.is_current(&node(), &ctx));
    let moved = NodeContext {
        nodeport_addresses: vec!["192.168.1.10".parse().unwrap()],
        ..ctx.clone()
    };
    assert!(!s.is_current(&node(), &moved));
    let other = NodeInfo {
        name: "node-b".into(),
        zone: None,
    };
    assert!(!s.is_current(&other, &ctx));
}

/// Regression: a claim that loses on arrival, to a Service already served, was not reported:
/// only frontends whose winner changed had their conflicts reported, and the winner stays. The
/// hostile-input scenario saw it when lb-a and lb-b came in different syncs.
#[test]
fn a_claim_that_loses_on_arrival_is_reported() {
    let ctx = ctx();
    let only_a = state(&with_external_ip("a", "10.96.0.1"));
    let mut s = Planner::new();
    let first = s.rebuild(&only_a, &node(), &ctx);
    assert!(first.new_problems.is_empty(), "{:?}", first.new_problems);
    let both = state(&format!(
        "{}---{}",
        with_external_ip("a", "10.96.0.1"),
        with_external_ip("b", "10.96.0.2")
    ));
    let outcome = s.update(&[key("b")], inputs(&both));
    let lost: Vec<_> = outcome
        .new_problems
        .iter()
        .filter(|p| p.message.contains("already served"))
        .collect();
    assert_eq!(lost.len(), 1, "{:?}", outcome.new_problems);
    assert_eq!(lost[0].name, "b");
    assert_eq!(
        s.desired(),
        &super::super::from_scratch(&both, &node(), &ctx).desired
    );
    // Reported once: b's claim recomputed with another cluster IP is the same conflict.
    let both_moved = state(&format!(
        "{}---{}",
        with_external_ip("a", "10.96.0.1"),
        with_external_ip("b", "10.96.0.3")
    ));
    let again = s.update(&[key("b")], inputs(&both_moved));
    assert!(
        !again
            .new_problems
            .iter()
            .any(|p| p.message.contains("already served")),
        "{:?}",
        again.new_problems
    );
}

/// A kernel that refused the SCTP program: each SCTP port is reported (naming the node and the
/// refusal) and still programmed; TCP ports are not reported. With the program loaded, nothing is.
#[test]
fn sctp_ports_are_reported_where_the_kernel_refused_the_sctp_program() {
    let s = state(
        r#"
apiVersion: v1
kind: Service
metadata: {name: sig, namespace: t}
spec:
  clusterIP: 10.96.0.20
  ports:
  - {name: m3ua, port: 2905, protocol: SCTP}
  - {name: http, port: 80, protocol: TCP}
"#,
    );
    let served = super::super::from_scratch(&s, &node(), &ctx());
    assert!(served.problems.is_empty(), "{:?}", served.problems);

    let refused = NodeContext {
        sctp_refused: Some("program lb_tc_sctp_in: the kernel's verifier rejected it".into()),
        ..ctx()
    };
    let computed = super::super::from_scratch(&s, &node(), &refused);
    let messages: Vec<_> = computed.problems.iter().map(|p| p.message.clone()).collect();
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(messages[0].starts_with("t/sig:m3ua: "), "{}", messages[0]);
    assert!(messages[0].contains(crate::plan::SCTP_REFUSED), "{}", messages[0]);
    assert!(
        messages[0].contains("(node node-a: program lb_tc_sctp_in"),
        "{}",
        messages[0]
    );
    // Programmed all the same: the frontends are the node's truth for inspect and trace.
    assert_eq!(computed.desired, served.desired);
}
