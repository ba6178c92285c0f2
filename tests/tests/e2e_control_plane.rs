//! Smoke test of the control-plane guard: a real etcd and kube-apiserver on loopback take a
//! namespace, a selector-less ClusterIP Service and its EndpointSlice, kubectl sees them, and
//! they survive an apiserver restart. Needs no root; needs `cargo xtask k8s-bins` (or `cargo
//! xtask e2e`, which sets LB_K8S_BIN_DIR).

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        apps::v1::{DaemonSet, DaemonSetSpec},
        core::v1::{
            ConfigMap, Container, Namespace, PodSpec, PodTemplateSpec, SecurityContext, Service, ServicePort,
            ServiceSpec,
        },
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta},
};
use kube::api::{Api, PostParams};
use lb_tests::control_plane::ControlPlane;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_serves_services_and_endpoint_slices_across_an_apiserver_restart() -> anyhow::Result<()>
{
    let mut cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
    let client = cp.client().await?;
    let ns = "lb-smoke";

    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(ns.into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;

    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let created = services
        .create(
            &PostParams::default(),
            &Service {
                metadata: ObjectMeta {
                    name: Some("web".into()),
                    ..Default::default()
                },
                spec: Some(ServiceSpec {
                    type_: Some("ClusterIP".into()),
                    ports: Some(vec![ServicePort {
                        name: Some("http".into()),
                        port: 80,
                        protocol: Some("TCP".into()),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .await?;
    let cluster_ip = created
        .spec
        .as_ref()
        .and_then(|s| s.cluster_ip.clone())
        .expect("a ClusterIP is allocated");
    assert!(
        cluster_ip.starts_with("10.96."),
        "ClusterIP {cluster_ip} outside 10.96.0.0/16"
    );

    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    slices
        .create(
            &PostParams::default(),
            &EndpointSlice {
                metadata: ObjectMeta {
                    name: Some("web-1".into()),
                    labels: Some(BTreeMap::from([(
                        "kubernetes.io/service-name".to_string(),
                        "web".to_string(),
                    )])),
                    ..Default::default()
                },
                address_type: "IPv4".into(),
                endpoints: Some(vec![Endpoint {
                    addresses: vec!["10.244.1.10".into()],
                    conditions: Some(EndpointConditions {
                        ready: Some(true),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ports: Some(vec![EndpointPort {
                    name: Some("http".into()),
                    port: Some(8080),
                    protocol: Some("TCP".into()),
                    ..Default::default()
                }]),
            },
        )
        .await?;

    let svc = services.get("web").await?;
    assert_eq!(
        svc.spec.as_ref().and_then(|s| s.cluster_ip.clone()),
        Some(cluster_ip.clone())
    );
    let slice = slices.get("web-1").await?;
    assert_eq!(
        slice.endpoints.as_deref().map(|e| e[0].addresses.clone()),
        Some(vec!["10.244.1.10".to_string()])
    );
    assert_eq!(slice.ports.as_deref().and_then(|p| p[0].port), Some(8080));

    let listed = tokio::task::block_in_place(|| cp.kubectl(["get", "svc", "-n", ns, "-o", "name"]))?;
    assert_eq!(listed.trim(), "service/web", "kubectl get svc: {listed}");

    // What the sandbox and the benchmarks create besides: ConfigMaps, and DaemonSets (validated
    // with a server-side dry run; no controller-manager runs to make Pods of them).
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    config_maps
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: ObjectMeta {
                    name: Some("lb-config".into()),
                    ..Default::default()
                },
                data: Some(BTreeMap::from([("mode".to_string(), "ebpf".to_string())])),
                ..Default::default()
            },
        )
        .await?;
    let labels = BTreeMap::from([("app".to_string(), "lb-agent".to_string())]);
    let daemon_sets: Api<DaemonSet> = Api::namespaced(client.clone(), ns);
    daemon_sets
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &DaemonSet {
                metadata: ObjectMeta {
                    name: Some("lb-agent".into()),
                    ..Default::default()
                },
                spec: DaemonSetSpec {
                    selector: LabelSelector {
                        match_labels: Some(labels.clone()),
                        ..Default::default()
                    },
                    template: PodTemplateSpec {
                        metadata: Some(ObjectMeta {
                            labels: Some(labels),
                            ..Default::default()
                        }),
                        spec: Some(PodSpec {
                            host_network: Some(true),
                            containers: vec![Container {
                                name: "agent".into(),
                                image: Some("lb-agent:dev".into()),
                                security_context: Some(SecurityContext {
                                    privileged: Some(true),
                                    ..Default::default()
                                }),
                                ..Default::default()
                            }],
                            ..Default::default()
                        }),
                    },
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    assert!(
        daemon_sets.get_opt("lb-agent").await?.is_none(),
        "a dry run must not persist"
    );

    // An API outage while etcd keeps the data.
    tokio::task::block_in_place(|| cp.stop_apiserver());
    assert!(
        services.get("web").await.is_err(),
        "the apiserver still answers after stop_apiserver"
    );
    tokio::task::block_in_place(|| cp.start_apiserver())?;

    let svc = services.get("web").await?;
    assert_eq!(svc.spec.and_then(|s| s.cluster_ip), Some(cluster_ip));
    assert_eq!(slices.get("web-1").await?.metadata.name.as_deref(), Some("web-1"));
    let listed = tokio::task::block_in_place(|| cp.kubectl(["get", "svc", "-n", ns, "-o", "name"]))?;
    assert_eq!(listed.trim(), "service/web");

    tokio::task::spawn_blocking(move || drop(cp)).await?;
    Ok(())
}
