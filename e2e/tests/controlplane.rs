//! Proof that the harness runs a real control plane: optimistic concurrency on Leases, CRDs
//! and custom objects, garbage collection by the controller-manager, and the audit log.

use std::time::Duration;

use anyhow::Result;
use e2e::harness::{self, TestEnv};
use e2e::wait::poll;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ApiResource, DeleteParams, DynamicObject, ObjectMeta, PostParams};
use kube::core::GroupVersionKind;
use kube::{Api, Client};
use serde_json::json;

#[tokio::test]
async fn lease_create_read_conflict_delete() -> Result<()> {
    let TestEnv {
        client, namespace, ..
    } = harness::setup("lease").await?;
    let leases: Api<Lease> = Api::namespaced(client, &namespace);
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some("probe".into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("a".into()),
            lease_duration_seconds: Some(15),
            ..Default::default()
        }),
    };
    let created = leases.create(&PostParams::default(), &lease).await?;
    let read = leases.get("probe").await?;
    assert_eq!(
        read.spec.as_ref().unwrap().holder_identity.as_deref(),
        Some("a")
    );

    // A first update with the current resourceVersion wins …
    let mut first = read.clone();
    first.spec.as_mut().unwrap().holder_identity = Some("b".into());
    leases
        .replace("probe", &PostParams::default(), &first)
        .await?;

    // … and a second one carrying the now stale resourceVersion is refused with 409.
    let mut stale = created.clone();
    stale.spec.as_mut().unwrap().holder_identity = Some("c".into());
    let err = leases
        .replace("probe", &PostParams::default(), &stale)
        .await
        .expect_err("a stale resourceVersion must conflict");
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409),
        "expected 409 Conflict, got {err:?}"
    );
    assert_eq!(
        leases
            .get("probe")
            .await?
            .spec
            .unwrap()
            .holder_identity
            .as_deref(),
        Some("b")
    );

    leases.delete("probe", &DeleteParams::default()).await?;
    assert!(leases.get_opt("probe").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn crd_and_custom_object() -> Result<()> {
    let TestEnv {
        client, namespace, ..
    } = harness::setup("crd").await?;
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.e2e.example.com"},
        "spec": {
            "group": "e2e.example.com",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "properties": {"size": {"type": "integer"}}}
                }}}
            }]
        }
    }))?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.create(&PostParams::default(), &crd).await?;

    let gvk = GroupVersionKind::gvk("e2e.example.com", "v1", "Widget");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "widgets");
    let widgets: Api<DynamicObject> = Api::namespaced_with(client, &namespace, &resource);
    let widget: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "e2e.example.com/v1", "kind": "Widget",
        "metadata": {"name": "w1"}, "spec": {"size": 3}
    }))?;
    // The CRD takes a moment to be served: poll the create instead of sleeping.
    let created = poll(
        "the Widget CRD to be served",
        Duration::from_secs(30),
        || {
            let widgets = widgets.clone();
            let widget = widget.clone();
            async move { Ok(widgets.create(&PostParams::default(), &widget).await.ok()) }
        },
    )
    .await?;
    assert_eq!(created.data["spec"]["size"], 3);
    assert_eq!(widgets.get("w1").await?.data["spec"]["size"], 3);
    Ok(())
}

#[tokio::test]
async fn owned_configmap_is_garbage_collected() -> Result<()> {
    let TestEnv {
        client, namespace, ..
    } = harness::setup("gc").await?;
    let cms: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let owner = cms
        .create(&PostParams::default(), &configmap("owner", None))
        .await?;
    let reference = OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: "owner".into(),
        uid: owner.metadata.uid.clone().unwrap(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    cms.create(&PostParams::default(), &configmap("child", Some(reference)))
        .await?;
    cms.delete("owner", &DeleteParams::default()).await?;
    poll(
        "garbage collection of the child",
        Duration::from_secs(60),
        || {
            let cms = cms.clone();
            async move { Ok(cms.get_opt("child").await?.is_none().then_some(())) }
        },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn audit_log_records_a_write_with_its_user_agent() -> Result<()> {
    let TestEnv {
        namespace, shared, ..
    } = harness::setup("audit").await?;
    let user_agent = format!("e2e-audit-probe/{namespace}");
    let mut config = e2e::kubeconfig::config_for(&shared.kubeconfig).await?;
    config
        .headers
        .push((http::header::USER_AGENT, user_agent.parse()?));
    let cms: Api<ConfigMap> = Api::namespaced(Client::try_from(config)?, &namespace);
    cms.create(&PostParams::default(), &configmap("audited", None))
        .await?;

    let log = shared
        .audit_log
        .expect("the local cluster writes an audit log");
    let entry = poll("the audit entry", Duration::from_secs(10), || {
        let log = log.clone();
        let (namespace, user_agent) = (namespace.clone(), user_agent.clone());
        async move {
            Ok(e2e::audit::read(&log)?.events.into_iter().find(|e| {
                e.verb == "create"
                    && e.user_agent == user_agent
                    && e.namespace() == namespace
                    && e.object_ref
                        .as_ref()
                        .is_some_and(|o| o.resource == "configmaps")
            }))
        }
    })
    .await?;
    assert_eq!(entry.user.username, "admin");
    assert!(entry.user.groups.iter().any(|g| g == "system:masters"));
    assert_eq!(entry.response_status.map(|s| s.code), Some(201));
    Ok(())
}

#[tokio::test]
async fn non_admin_user_is_authenticated_but_not_authorized() -> Result<()> {
    let TestEnv { shared, .. } = harness::setup("rbac").await?;
    let user_kubeconfig = shared.kubeconfig.with_file_name("user.kubeconfig");
    let client = e2e::kubeconfig::client_for(&user_kubeconfig).await?;
    let err = Api::<ConfigMap>::namespaced(client, "default")
        .list(&Default::default())
        .await
        .expect_err("a user without RBAC grants must be refused");
    match err {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 403, "{status:?}");
            assert!(
                status.message.contains("myresource-user"),
                "{}",
                status.message
            );
        }
        other => panic!("expected 403 Forbidden, got {other:?}"),
    }
    Ok(())
}

fn configmap(name: &str, owner: Option<OwnerReference>) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        data: Some([("k".to_string(), "v".to_string())].into()),
        ..Default::default()
    }
}
