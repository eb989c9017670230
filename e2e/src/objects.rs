//! The test workload's MyResources: created, changed, and checked for convergence (every
//! object's status and ConfigMap follow its spec) in a test's namespace.

use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use myresource_operator::resource::{MyResource, MyResourceSpec};
use serde_json::json;

use crate::harness::TestEnv;
use crate::wait::poll;

/// Creates `o0` … `o{count-1}` with `message`.
pub async fn create(env: &TestEnv, count: usize, message: &str) -> Result<()> {
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    for i in 0..count {
        let mr = MyResource::new(
            &format!("o{i}"),
            MyResourceSpec {
                message: message.into(),
                some_value: i as i32,
            },
        );
        mrs.create(&PostParams::default(), &mr).await?;
    }
    Ok(())
}

/// What a deleted MyResource `name` leaves when garbage collection lags: its ConfigMap,
/// controlled by a MyResource of that name with another uid, under `owner_api_version`.
pub fn leftover_configmap(name: &str, owner_api_version: &str) -> ConfigMap {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "myresource-operator"},
            "ownerReferences": [{"apiVersion": owner_api_version, "kind": "MyResource", "name": name,
                "uid": "00000000-0000-0000-0000-000000000001", "controller": true}]},
        "data": {"message": "old", "someValue": "0"}
    }))
    .expect("a valid ConfigMap")
}

/// Sets one object's `spec.message`.
pub async fn set_message(env: &TestEnv, name: &str, message: &str) -> Result<()> {
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    mrs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"message": message}})),
    )
    .await?;
    Ok(())
}

/// Whether every MyResource has observedGeneration == generation and a matching ConfigMap.
pub async fn all_converged(env: &TestEnv) -> Result<bool> {
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    let configmaps = cms.list(&Default::default()).await?;
    for mr in mrs.list(&Default::default()).await? {
        let name = mr.metadata.name.clone().unwrap_or_default();
        let observed = mr.status.as_ref().and_then(|s| s.observed_generation);
        let cm = configmaps
            .items
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(&name));
        let data = cm.and_then(|c| c.data.clone()).unwrap_or_default();
        if observed != mr.metadata.generation
            || data.get("message") != Some(&mr.spec.message)
            || data.get("someValue") != Some(&mr.spec.some_value.to_string())
        {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Waits until [`all_converged`].
pub async fn wait_converged(env: &TestEnv, limit: Duration) -> Result<()> {
    poll("every object to converge", limit, || async {
        Ok(all_converged(env).await?.then_some(()))
    })
    .await
}
