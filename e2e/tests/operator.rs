//! One operator replica as a real process against the real control plane: the tutorial's
//! example, spec updates, Pod counting, garbage collection, drift repair, no writes on
//! restart, a foreign ConfigMap, bad input, and a crash in the middle of 100 objects.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use e2e::harness;
use e2e::wait::poll;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use myresource_operator::resource::{MyResource, MyResourceSpec, POD_LABEL, PodCounts};
use serde_json::json;

fn myresource(name: &str, message: &str, value: i32) -> MyResource {
    MyResource::new(
        name,
        MyResourceSpec {
            message: message.into(),
            some_value: value,
        },
    )
}

/// Waits until the ConfigMap `name` has this data and the MyResource is Ready for its
/// current generation; returns both.
async fn converged(
    client: &Client,
    ns: &str,
    name: &str,
    message: &str,
    value: i32,
) -> Result<(MyResource, ConfigMap)> {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), ns);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    poll(
        &format!("{name} to converge"),
        Duration::from_secs(20),
        || {
            let (mrs, cms) = (mrs.clone(), cms.clone());
            async move {
                let Some(mr) = mrs.get_opt(name).await? else {
                    return Ok(None);
                };
                let Some(cm) = cms.get_opt(name).await? else {
                    return Ok(None);
                };
                let data = cm.data.clone().unwrap_or_default();
                let status = mr.status.clone().unwrap_or_default();
                let ready = status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                let done = data.get("message").map(String::as_str) == Some(message)
                    && data.get("someValue") == Some(&value.to_string())
                    && ready
                    && status.observed_generation == mr.metadata.generation;
                Ok(done.then_some((mr, cm)))
            }
        },
    )
    .await
}

#[tokio::test]
async fn tutorial_example_gets_its_configmap_and_follows_spec_updates() -> Result<()> {
    let env = harness::setup("tutorial").await?;
    let _op = env.start_operator("op", &[]).await?;
    env.apply_tutorial_example()?;

    let started = Instant::now();
    let (mr, cm) = converged(
        &env.client,
        &env.namespace,
        "example-myresource",
        "hello world",
        13,
    )
    .await?;
    eprintln!("tutorial example Ready after {:?}", started.elapsed());
    assert_eq!(
        mr.status.as_ref().unwrap().config_map_name.as_deref(),
        Some("example-myresource")
    );
    let owner = &cm.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("MyResource", Some(true))
    );
    assert_eq!(Some(owner.uid.clone()), mr.metadata.uid);
    let first_generation = mr.metadata.generation.unwrap();

    // A spec update: ConfigMap and status follow, observedGeneration advances.
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    mrs.patch(
        "example-myresource",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"message": "goodbye", "someValue": 42}})),
    )
    .await?;
    let (mr, _) = converged(
        &env.client,
        &env.namespace,
        "example-myresource",
        "goodbye",
        42,
    )
    .await?;
    assert!(mr.status.unwrap().observed_generation.unwrap() > first_generation);
    Ok(())
}

#[tokio::test]
async fn labelled_pods_are_counted() -> Result<()> {
    let env = harness::setup("pods").await?;
    let _op = env.start_operator("op", &[]).await?;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    mrs.create(&PostParams::default(), &myresource("counted", "m", 1))
        .await?;
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.namespace);
    for i in 0..3 {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("p{i}"), "labels": {POD_LABEL: "counted"}},
            "spec": {"containers": [{"name": "c", "image": "example.invalid/none"}]}
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
    }
    for i in 0..2 {
        let status = json!({"status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
        ]}});
        pods.patch_status(
            &format!("p{i}"),
            &PatchParams::default(),
            &Patch::Merge(status),
        )
        .await?;
    }
    wait_for_counts(&mrs, "counted", PodCounts { total: 3, ready: 2 }).await?;
    pods.delete("p0", &DeleteParams::default()).await?;
    wait_for_counts(&mrs, "counted", PodCounts { total: 2, ready: 1 }).await?;
    Ok(())
}

async fn wait_for_counts(mrs: &Api<MyResource>, name: &str, want: PodCounts) -> Result<()> {
    poll(&format!("pods {want:?}"), Duration::from_secs(20), || {
        let mrs = mrs.clone();
        async move {
            let mr = mrs.get(name).await?;
            Ok((mr.status.and_then(|s| s.pods) == Some(want)).then_some(()))
        }
    })
    .await
}

#[tokio::test]
async fn configmap_is_restored_and_garbage_collected() -> Result<()> {
    let env = harness::setup("drift").await?;
    let _op = env.start_operator("op", &[]).await?;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    mrs.create(&PostParams::default(), &myresource("kept", "keep me", 7))
        .await?;
    converged(&env.client, &env.namespace, "kept", "keep me", 7).await?;

    // Edited by hand → restored.
    cms.patch(
        "kept",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"message": "vandalised"}})),
    )
    .await?;
    wait_for_data(&cms, "kept", "keep me").await?;

    // Deleted by hand → restored.
    cms.delete("kept", &DeleteParams::default()).await?;
    wait_for_data(&cms, "kept", "keep me").await?;

    // Each change has its Event; the second creation joined the first one's series.
    let events: Api<Event> = Api::namespaced(env.client.clone(), &env.namespace);
    let reasons = poll("Events for kept", Duration::from_secs(20), || {
        let events = events.clone();
        async move {
            let mut seen: Vec<(String, Option<i32>, String)> = events
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("kept"))
                .filter(|e| e.reporting_controller.as_deref() == Some("myresource-operator"))
                .map(|e| {
                    let count = e.series.map(|s| s.count);
                    (
                        e.reason.unwrap_or_default(),
                        count,
                        e.note.unwrap_or_default(),
                    )
                })
                .collect();
            seen.sort();
            let done = seen
                .iter()
                .any(|(r, c, _)| r == "ConfigMapCreated" && *c == Some(2));
            Ok(done.then_some(seen))
        }
    })
    .await?;
    assert_eq!(
        reasons,
        vec![
            (
                "ConfigMapCreated".to_string(),
                Some(2),
                "ConfigMap kept created".to_string()
            ),
            (
                "ConfigMapUpdated".to_string(),
                None,
                "ConfigMap kept updated".to_string()
            ),
        ]
    );
    // The series patch is conditional (issue 30, hole 3): the operator sends the Event's
    // resourceVersion in its merge patch, which the API server refuses once stale.
    let created = events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("ConfigMapCreated"))
        .context("the ConfigMapCreated Event")?;
    let stale = json!({"metadata": {"resourceVersion": "1"}, "series": created.series});
    let refused = events
        .patch(
            &created.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&stale),
        )
        .await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 409),
        "a series patch with a stale resourceVersion: {refused:?}"
    );

    // The MyResource deleted → its ConfigMap goes by garbage collection.
    mrs.delete("kept", &DeleteParams::default()).await?;
    poll(
        "the ConfigMap to be garbage collected",
        Duration::from_secs(60),
        || {
            let cms = cms.clone();
            async move { Ok(cms.get_opt("kept").await?.is_none().then_some(())) }
        },
    )
    .await?;
    Ok(())
}

async fn wait_for_data(cms: &Api<ConfigMap>, name: &str, message: &str) -> Result<()> {
    poll(
        &format!("ConfigMap {name} restored"),
        Duration::from_secs(20),
        || {
            let cms = cms.clone();
            async move {
                let cm = cms.get_opt(name).await?;
                let restored = cm
                    .and_then(|c| c.data)
                    .is_some_and(|d| d.get("message").map(String::as_str) == Some(message));
                Ok(restored.then_some(()))
            }
        },
    )
    .await
}

#[tokio::test]
async fn a_restart_with_nothing_changed_writes_nothing() -> Result<()> {
    let env = harness::setup("restart").await?;
    let mut first = env.start_operator("first", &[]).await?;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    for i in 0..5 {
        mrs.create(
            &PostParams::default(),
            &myresource(&format!("r{i}"), "steady", i),
        )
        .await?;
    }
    for i in 0..5 {
        converged(&env.client, &env.namespace, &format!("r{i}"), "steady", i).await?;
    }
    first.stop();

    let second = env.start_operator("second", &[]).await?;
    // The second replica has reconciled every key once it logged each as reconciled.
    for i in 0..5 {
        let key = format!("{}/r{i}", env.namespace);
        e2e::operator::wait_for_log(
            &second,
            &format!("{key} reconciled"),
            Duration::from_secs(20),
            |l| l["message"] == "reconciled" && l["myresource"] == key.as_str(),
        )
        .await?;
    }
    let log = env.shared.audit_log.as_ref().expect("local cluster");
    let writes: Vec<_> = e2e::audit::read(log)?
        .events
        .into_iter()
        .filter(|e| e.is_write() && e.user_agent == second.user_agent())
        // Acquiring the Lease is the one write a new replica must make.
        .filter(|e| e.object_ref.as_ref().is_none_or(|o| o.resource != "leases"))
        .map(|e| format!("{} {:?}", e.verb, e.object_ref))
        .collect();
    assert!(
        writes.is_empty(),
        "a restart with nothing changed wrote: {writes:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_foreign_configmap_is_left_alone_and_retries_slow_down() -> Result<()> {
    let env = harness::setup("foreign").await?;
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    let foreign: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "taken"}, "data": {"owner": "someone else"}
    }))?;
    let foreign = cms.create(&PostParams::default(), &foreign).await?;
    let op = env.start_operator("op", &[]).await?;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    mrs.create(&PostParams::default(), &myresource("taken", "mine", 1))
        .await?;
    let started = Instant::now();

    let condition = poll("Ready=False", Duration::from_secs(20), || {
        let mrs = mrs.clone();
        async move {
            let mr = mrs.get("taken").await?;
            Ok(mr.status.and_then(|s| {
                s.conditions
                    .into_iter()
                    .find(|c| c.type_ == "Ready" && c.status == "False")
            }))
        }
    })
    .await?;
    assert_eq!(condition.reason, "ConfigMapOwnedElsewhere");
    assert!(
        condition.message.contains("ConfigMap taken already exists"),
        "{}",
        condition.message
    );

    // Watch the retries for a minute: backoff doubling from 200 ms allows at most 9.
    let key = format!("{}/taken", env.namespace);
    let remaining = Duration::from_secs(60).saturating_sub(started.elapsed());
    tokio::time::sleep(remaining).await;
    let attempts = op
        .log_lines()
        .iter()
        .filter(|l| l["message"] == "reconcile failed" && l["myresource"] == key.as_str())
        .count();
    assert!(
        (1..=10).contains(&attempts),
        "{attempts} attempts in a minute"
    );

    let after = cms.get("taken").await?;
    assert_eq!(
        after.metadata.resource_version, foreign.metadata.resource_version,
        "foreign ConfigMap was modified"
    );
    Ok(())
}

#[tokio::test]
async fn bad_input_is_rejected_by_the_api_server_with_a_clear_message() -> Result<()> {
    let env = harness::setup("badinput").await?;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    let long = "x".repeat(1025);
    let cases = [
        (
            json!({"message": "m", "someValue": "abc"}),
            "spec.someValue",
        ),
        (
            json!({"message": "m", "someValue": 2147483648i64}),
            "spec.someValue",
        ),
        (json!({"someValue": 1}), "spec.message"),
        (json!({"message": "", "someValue": 1}), "spec.message"),
        (json!({"message": long, "someValue": 1}), "spec.message"),
        (
            json!({"message": "m", "someValue": 1, "colour": "red"}),
            "colour",
        ),
    ];
    // A create as kubectl sends it, with server-side strict field validation.
    let url = format!(
        "/apis/trstringer.com/v1/namespaces/{}/myresources?fieldValidation=Strict",
        env.namespace
    );
    for (i, (spec, field)) in cases.into_iter().enumerate() {
        let name = format!("bad-{i}");
        let body = json!({"apiVersion": "trstringer.com/v1", "kind": "MyResource", "metadata": {"name": name}, "spec": spec});
        let request = http::Request::post(&url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(serde_json::to_vec(&body)?)?;
        let err = env
            .client
            .request::<MyResource>(request)
            .await
            .expect_err(&format!("case {i} ({spec}) must be rejected"));
        let kube::Error::Api(status) = err else {
            panic!("case {i}: not an API error: {err:?}")
        };
        assert!(matches!(status.code, 400 | 422), "case {i}: {status:?}");
        eprintln!("case {i}: {} {}", status.code, status.message);
        assert!(
            status.message.contains(field),
            "case {i}: message {:?} does not name {field}",
            status.message
        );
        assert!(mrs.get_opt(&name).await?.is_none(), "case {i} was stored");
    }
    Ok(())
}

#[tokio::test]
async fn a_crash_in_the_middle_of_100_objects_loses_nothing() -> Result<()> {
    let env = harness::setup("crash").await?;
    let mut op = env.start_operator("first", &[]).await?;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    for i in 0..100 {
        mrs.create(
            &PostParams::default(),
            &myresource(&format!("o{i}"), "bulk", i),
        )
        .await?;
    }
    // Kill it once it is partway through.
    e2e::operator::wait_for_log(&op, "some reconciles", Duration::from_secs(30), |l| {
        l["message"] == "ConfigMap created"
    })
    .await?;
    op.kill();
    let _second = env.start_operator("second", &[]).await?;
    for i in 0..100 {
        converged(&env.client, &env.namespace, &format!("o{i}"), "bulk", i).await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_configmap_left_by_an_earlier_myresource_of_the_same_name_is_replaced() -> Result<()> {
    let env = harness::setup("stale").await?;
    // What a deleted MyResource leaves when garbage collection lags: its ConfigMap, controlled
    // by a MyResource of the same name with another uid.
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    let stale = e2e::objects::leftover_configmap("again", "trstringer.com/v1");
    cms.create(&PostParams::default(), &stale).await?;
    let _op = env.start_operator("op", &[]).await?;
    Api::<MyResource>::namespaced(env.client.clone(), &env.namespace)
        .create(&PostParams::default(), &myresource("again", "new", 2))
        .await?;
    let (mr, cm) = converged(&env.client, &env.namespace, "again", "new", 2).await?;
    assert_eq!(
        cm.metadata.owner_references.unwrap()[0].uid,
        mr.metadata.uid.unwrap()
    );
    Ok(())
}

/// The Ready condition's (reason, message) once its reason is `reason`.
async fn ready_reason(mrs: &Api<MyResource>, name: &str, reason: &str) -> Result<String> {
    poll(
        &format!("{name} Ready reason {reason}"),
        Duration::from_secs(20),
        || {
            let mrs = mrs.clone();
            async move {
                let mr = mrs.get(name).await?;
                Ok(mr.status.and_then(|s| {
                    s.conditions
                        .into_iter()
                        .find(|c| c.type_ == "Ready" && c.reason == reason)
                        .map(|c| c.message)
                }))
            }
        },
    )
    .await
}

/// Issue 13, item 9: a leftover ConfigMap held by a foreign finalizer looped delete →
/// create → requeue every 200 ms; keys another field manager wrote were re-applied (with an
/// Event) on every reconcile. Both are now reported in the status and nothing loops.
#[tokio::test]
async fn a_finalizer_held_leftover_and_foreign_keys_make_no_loop() -> Result<()> {
    let env = harness::setup("noloop").await?;
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    // A leftover of an earlier MyResource "held", kept by someone's finalizer.
    let leftover: ConfigMap = serde_json::from_value(json!({
        "metadata": {
            "name": "held",
            "labels": {"app.kubernetes.io/managed-by": "myresource-operator"},
            "finalizers": ["example.com/hold"],
            "ownerReferences": [{
                "apiVersion": "trstringer.com/v1", "kind": "MyResource", "name": "held",
                "uid": "00000000-0000-0000-0000-000000000001", "controller": true
            }]
        },
        "data": {"message": "old", "someValue": "0"}
    }))?;
    cms.create(&PostParams::default(), &leftover).await?;
    let op = env.start_operator("op", &[]).await?;
    mrs.create(&PostParams::default(), &myresource("held", "new", 1))
        .await?;
    let message = ready_reason(&mrs, "held", "ConfigMapTerminating").await?;
    assert!(message.contains("example.com/hold"), "{message}");
    tokio::time::sleep(Duration::from_secs(10)).await;
    let key = format!("{}/held", env.namespace);
    let attempts = op
        .log_lines()
        .iter()
        .filter(|l| l["message"] == "reconcile started" && l["myresource"] == key.as_str())
        .count();
    // The queue's backoff (200 ms doubling) allows about 7 in 10 s; the loop made 50.
    assert!(attempts <= 12, "{attempts} reconciles of {key} in ~10 s");
    // Its owner removes the finalizer: the leftover goes and ours is created.
    cms.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await?;
    converged(&env.client, &env.namespace, "held", "new", 1).await?;

    // Another field manager adds a key to our ConfigMap.
    mrs.create(&PostParams::default(), &myresource("shared", "ours", 2))
        .await?;
    converged(&env.client, &env.namespace, "shared", "ours", 2).await?;
    let updates_before = op.log().matches("ConfigMap updated").count();
    let theirs = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "shared"}, "data": {"theirs": "x"}
    });
    cms.patch(
        "shared",
        &PatchParams::apply("someone-else"),
        &Patch::Apply(&theirs),
    )
    .await?;
    let message = ready_reason(&mrs, "shared", "ReconciledWithForeignKeys").await?;
    assert!(message.contains("theirs"), "{message}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        op.log().matches("ConfigMap updated").count(),
        updates_before,
        "a key written by someone else is not drift"
    );
    let data = cms.get("shared").await?.data.unwrap_or_default();
    assert_eq!(data.get("theirs").map(String::as_str), Some("x"));
    assert_eq!(data.get("message").map(String::as_str), Some("ours"));
    Ok(())
}

/// Issue 30: a namespace being deleted is not an error. The namespace controller removes
/// the ConfigMaps while the MyResources stay (an admission policy holds their deletion,
/// as a slow deletion order does in about half of the runs): every reconcile's create
/// then gets "403 … because it is being terminated". Nothing is retried, and one line says
/// so.
#[tokio::test]
async fn a_namespace_being_deleted_is_not_an_error() -> Result<()> {
    let env = harness::setup("nsdelete").await?;
    e2e::objects::create(&env, 20, "v0").await?;
    let op = env.start_operator("a", &[]).await?;
    e2e::objects::wait_converged(&env, Duration::from_secs(30)).await?;

    let hold = HoldDeletes::install(&env.client, &env.namespace).await?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(env.client.clone());
    let deleted = Timestamp::now();
    namespaces
        .delete(&env.namespace, &DeleteParams::default())
        .await?;
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    poll(
        "the namespace controller to remove the ConfigMaps",
        Duration::from_secs(60),
        || async {
            Ok(cms
                .list(&Default::default())
                .await?
                .items
                .is_empty()
                .then_some(()))
        },
    )
    .await?;
    // Long enough for backoff retries (200 ms, doubling) to show.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let lines = op.log_lines();
    let said: Vec<_> = lines
        .iter()
        .filter(|l| l["message"] == "namespace is being deleted: creating nothing in it")
        .collect();
    let since_deleted = |l: &&serde_json::Value| {
        l["timestamp"]
            .as_str()
            .and_then(|t| t.parse::<Timestamp>().ok())
            .is_some_and(|t| t >= deleted)
    };
    let failed = lines
        .iter()
        .filter(since_deleted)
        .filter(|l| l["message"] == "reconcile failed")
        .count();
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    assert_eq!(
        mrs.list(&Default::default()).await?.items.len(),
        20,
        "the MyResources were held while their ConfigMaps went"
    );
    assert_eq!(
        failed, 0,
        "reconciles failed after the namespace's deletion"
    );
    assert_eq!(
        said.len(),
        1,
        "one line says the namespace is being deleted"
    );
    hold.remove().await?;
    poll("the namespace to go", Duration::from_secs(60), || async {
        Ok(namespaces
            .get_opt(&env.namespace)
            .await?
            .is_none()
            .then_some(()))
    })
    .await?;
    Ok(())
}

/// A ValidatingAdmissionPolicy (and its binding) denying deletes of MyResources in one
/// namespace.
struct HoldDeletes {
    client: Client,
    name: String,
}

impl HoldDeletes {
    /// The binding and the policy: kind and plural (deleted in this order).
    const RESOURCES: [(&str, &str); 2] = [
        (
            "ValidatingAdmissionPolicyBinding",
            "validatingadmissionpolicybindings",
        ),
        ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
    ];

    async fn install(client: &Client, ns: &str) -> Result<HoldDeletes> {
        use kube::api::DynamicObject;
        use kube::discovery::ApiResource;
        let name = format!("hold-myresources-{ns}");
        let [binding, policy] = HoldDeletes::RESOURCES.map(admission_resource);
        let object = |resource: &ApiResource, spec: serde_json::Value| -> Result<DynamicObject> {
            Ok(serde_json::from_value(json!({
                "apiVersion": resource.api_version, "kind": resource.kind,
                "metadata": {"name": name}, "spec": spec,
            }))?)
        };
        let group = <MyResource as kube::Resource>::group(&());
        let specs = [
            (
                &policy,
                json!({
                    "failurePolicy": "Fail",
                    "matchConstraints": {"resourceRules": [{"apiGroups": [group], "apiVersions": ["*"],
                        "operations": ["DELETE"], "resources": ["myresources"]}]},
                    "validations": [{"expression": "false", "message": "held by the test"}],
                }),
            ),
            (
                &binding,
                json!({
                    "policyName": name, "validationActions": ["Deny"],
                    "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}},
                }),
            ),
        ];
        for (resource, spec) in specs {
            Api::<DynamicObject>::all_with(client.clone(), resource)
                .create(&PostParams::default(), &object(resource, spec)?)
                .await?;
        }
        let hold = HoldDeletes {
            client: client.clone(),
            name,
        };
        // Policies take effect once the API server has loaded them: wait until a delete is
        // refused (of an object that does not exist, the check comes first).
        let mrs: Api<MyResource> = Api::namespaced(client.clone(), ns);
        poll(
            "the hold to take effect",
            Duration::from_secs(30),
            || async {
                Ok(
                    match mrs
                        .delete(
                            "o0",
                            &DeleteParams {
                                dry_run: true,
                                ..Default::default()
                            },
                        )
                        .await
                    {
                        Err(kube::Error::Api(s)) if s.message.contains("held by the test") => {
                            Some(())
                        }
                        _ => None,
                    },
                )
            },
        )
        .await?;
        Ok(hold)
    }

    async fn remove(self) -> Result<()> {
        use kube::api::DynamicObject;
        for resource in HoldDeletes::RESOURCES.map(admission_resource) {
            Api::<DynamicObject>::all_with(self.client.clone(), &resource)
                .delete(&self.name, &DeleteParams::default())
                .await?;
        }
        Ok(())
    }
}

/// An `admissionregistration.k8s.io/v1` resource by kind and plural.
fn admission_resource((kind, plural): (&str, &str)) -> kube::discovery::ApiResource {
    kube::discovery::ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind),
        plural,
    )
}
