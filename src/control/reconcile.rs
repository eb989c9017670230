//! What the operator does for one MyResource: level-triggered and idempotent.
//!
//! 1. Keep a ConfigMap of the same name whose data carries `message` and `someValue`,
//!    controlled by the MyResource (ownerReference `controller: true`, so garbage collection
//!    deletes it with its owner): created with a plain create (which cannot overwrite a
//!    ConfigMap that already exists), repaired by server-side apply under one field manager
//!    with the resourceVersion read as a precondition.
//! 2. Count the labelled Pods and how many are Ready (from the warm Pod index).
//! 3. Write status (`observedGeneration`, `Ready`, ConfigMap name, Pod counts) through the
//!    status subresource, with the resourceVersion read as a precondition.
//! 4. Publish an Event for every change made and every new failure.
//!
//! Invariants: every decision is made by the pure functions at the top from cached state;
//! a reconcile that finds the world as desired makes no request at all (so a failover that
//! re-reconciles every object causes no writes); every write is preceded by a fence check,
//! and the client refuses, times out and bounds on the server every write past the fence
//! (see [`kube_leasehold::fence`]), Events included.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info};

use crate::cache::Caches;
use crate::control::echo::{Echoes, Kind};
use crate::control::events::{EventType, Pending, Publisher};
use crate::control::queue::Outcome;
use crate::infra::telemetry::span_context;
use crate::key::ObjectKey;
use crate::resource::{
    FIELD_MANAGER, MANAGED_BY, MANAGED_BY_LABEL, MyResource, MyResourceStatus, PodCounts,
};
use kube_leasehold::fence::{Fence, NotLeader};
use kube_leasehold::scaleout::shard_key::{BUCKET_LABEL, ShardKey, bucket_label, bucket_of};

/// Everything a reconcile needs; shared by all workers.
pub struct Context {
    pub client: Client,
    pub caches: Caches,
    /// Where each write of ours is recorded for the echo filter.
    pub echoes: Arc<Echoes>,
    pub events: Publisher,
    pub fence: Fence,
    /// Scale-out mode: the shard this context's workers lead, and the key that maps a uid
    /// to its shard. A MyResource whose uid maps elsewhere is not theirs to touch (its name
    /// was re-created under another shard since the key was queued, or the cache returned
    /// another shard's stand-by copy): that shard's leader reconciles it.
    pub shard: Option<(ShardKey, usize)>,
}

/// Why a reconcile did not finish.
#[derive(Debug)]
pub enum Error {
    /// The API server refused or failed a request.
    Kube(kube::Error),
    /// The ConfigMap's name is taken by an object this MyResource does not control.
    OwnedElsewhere(String),
    /// A leftover ConfigMap of this name is being deleted, held by finalizers.
    Terminating(String),
    /// Leadership is no longer valid; nothing was written.
    NotLeader,
    /// The namespace is being deleted: the API server creates nothing in it (the
    /// MyResource goes with it, so there is nothing to do and nothing to retry).
    NamespaceTerminating(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Kube(err) => write!(f, "Kubernetes API: {err}"),
            Error::OwnedElsewhere(msg)
            | Error::Terminating(msg)
            | Error::NamespaceTerminating(msg) => f.write_str(msg),
            Error::NotLeader => NotLeader.fmt(f),
        }
    }
}

impl std::error::Error for Error {}

impl From<kube::Error> for Error {
    fn from(err: kube::Error) -> Self {
        match err {
            err if kube_leasehold::fence::is_fenced(&err) => Error::NotLeader,
            kube::Error::Api(status) if is_namespace_terminating(&status) => {
                Error::NamespaceTerminating(status.message)
            }
            err => Error::Kube(err),
        }
    }
}

impl From<NotLeader> for Error {
    fn from(_: NotLeader) -> Self {
        Error::NotLeader
    }
}

impl Error {
    /// A short label for metrics and span fields.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(s)) if s.code == 409 => "conflict",
            Error::Kube(_) => "api",
            Error::OwnedElsewhere(_) => "owned_elsewhere",
            Error::Terminating(_) => "configmap_terminating",
            Error::NotLeader => "not_leader",
            Error::NamespaceTerminating(_) => "namespace_terminating",
        }
    }
}

/// Whether the API server refused a create because its namespace is being deleted (403,
/// cause `NamespaceTerminating`).
fn is_namespace_terminating(status: &kube::core::Status) -> bool {
    status.code == 403
        && status
            .details
            .as_ref()
            .is_some_and(|d| d.causes.iter().any(|c| c.reason == "NamespaceTerminating"))
}

// ---- decisions (pure) ----

/// The ConfigMap a MyResource should have.
pub fn desired_configmap(mr: &MyResource) -> ConfigMap {
    let mut labels = BTreeMap::from([(MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string())]);
    // Its owner's shard bucket: scale-out replicas watch only their shards' ConfigMaps.
    if let Some(uid) = mr.uid() {
        labels.insert(BUCKET_LABEL.into(), bucket_label(bucket_of(&uid)));
    }
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(mr.name_any()),
            namespace: mr.namespace(),
            labels: Some(labels),
            owner_references: mr.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        data: Some(BTreeMap::from([
            ("message".to_string(), mr.spec.message.clone()),
            ("someValue".to_string(), mr.spec.some_value.to_string()),
        ])),
        ..Default::default()
    }
}

/// How an existing ConfigMap relates to the desired one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigMapState {
    UpToDate,
    Missing,
    /// Ours and right, but it also carries data keys that someone else wrote; server-side
    /// apply cannot remove fields another manager owns, so they are left alone and named.
    ExtraKeys(Vec<String>),
    /// Ours, but our data keys or our label differ (someone edited it, or the spec changed).
    Drifted,
    /// Controlled by a MyResource of the same name and another uid: left behind by an
    /// earlier one (deleted; garbage collection has not removed its ConfigMap yet), or the
    /// current one's while our view of the MyResource lags. Deleted, by uid, and replaced
    /// only once a read shows the MyResource of that name is not `owner` ([`stale_proven`]).
    Stale {
        uid: String,
        owner: String,
    },
    /// Someone else's: the message says whose and what to do.
    OwnedElsewhere(String),
    /// Being deleted (a leftover whose finalizers have not finished): deleting or creating
    /// again cannot help until they do; the message names them.
    Terminating(String),
}

/// Compares an existing ConfigMap (if any) with the desired one for `mr`.
pub fn classify(
    existing: Option<&ConfigMap>,
    desired: &ConfigMap,
    mr: &MyResource,
) -> ConfigMapState {
    let Some(cm) = existing else {
        return ConfigMapState::Missing;
    };
    if cm.metadata.deletion_timestamp.is_some() {
        let finalizers = cm.finalizers().join(", ");
        return ConfigMapState::Terminating(format!(
            "ConfigMap {} is being deleted but its finalizers ({finalizers}) hold it; it is \
             recreated once whoever owns them removes them (kubectl get configmap {} -o \
             yaml shows them)",
            cm.name_any(),
            cm.name_any()
        ));
    }
    let uid = mr.uid().unwrap_or_default();
    let controller = cm
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true));
    match controller {
        Some(owner) if owner.uid == uid => {}
        // Names are unique among live objects, so a MyResource of this name with another uid
        // is an earlier one, or a later one our cache has not seen yet.
        Some(owner)
            if owner.kind == "MyResource"
                && owner.api_version.starts_with("trstringer.com/")
                && owner.name == mr.name_any() =>
        {
            return ConfigMapState::Stale {
                uid: cm.uid().unwrap_or_default(),
                owner: owner.uid.clone(),
            };
        }
        Some(owner) => {
            return ConfigMapState::OwnedElsewhere(format!(
                "ConfigMap {} already exists and is controlled by {} {} (uid {}); delete or \
                 rename that ConfigMap, or give this MyResource another name",
                cm.name_any(),
                owner.kind,
                owner.name,
                owner.uid
            ));
        }
        None => {
            return ConfigMapState::OwnedElsewhere(format!(
                "ConfigMap {} already exists and is not managed by this operator; delete or \
                 rename it, or give this MyResource another name",
                cm.name_any()
            ));
        }
    }
    let labelled = desired
        .labels()
        .iter()
        .all(|(k, v)| cm.labels().get(k) == Some(v));
    let empty = BTreeMap::new();
    let (have, want) = (
        cm.data.as_ref().unwrap_or(&empty),
        desired.data.as_ref().unwrap_or(&empty),
    );
    if !labelled || want.iter().any(|(k, v)| have.get(k) != Some(v)) {
        return ConfigMapState::Drifted;
    }
    let extra: Vec<String> = have
        .keys()
        .filter(|k| !want.contains_key(*k))
        .cloned()
        .collect();
    if extra.is_empty() {
        ConfigMapState::UpToDate
    } else {
        ConfigMapState::ExtraKeys(extra)
    }
}

/// The status a MyResource should have. `problem` is the reason and message of a failure,
/// if any. `lastTransitionTime` is kept when the condition's status does not change, so a
/// status that is already right compares equal and is not written.
pub fn desired_status(
    mr: &MyResource,
    pods: PodCounts,
    problem: Option<(&str, &str)>,
    extra_keys: &[String],
    now: Timestamp,
) -> MyResourceStatus {
    let generation = mr.metadata.generation;
    let name = mr.name_any();
    let (status, reason, message) = match problem {
        None => {
            let mut message = format!(
                "ConfigMap {name} holds the spec of generation {}; {} of {} labelled Pods are Ready",
                generation.unwrap_or_default(),
                pods.ready,
                pods.total
            );
            let reason = if extra_keys.is_empty() {
                "Reconciled"
            } else {
                message.push_str(&format!(
                    "; it also carries keys written by someone else ({}), which this operator \
                     leaves alone",
                    extra_keys.join(", ")
                ));
                "ReconciledWithForeignKeys"
            };
            ("True", reason.to_string(), message)
        }
        Some((reason, message)) => ("False", reason.to_string(), message.to_string()),
    };
    let previous = mr
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
    let last_transition_time = match previous {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Time(now),
    };
    MyResourceStatus {
        observed_generation: generation,
        conditions: vec![Condition {
            type_: "Ready".into(),
            status: status.into(),
            reason,
            message,
            observed_generation: generation,
            last_transition_time,
        }],
        config_map_name: Some(name),
        pods: Some(pods),
    }
}

// ---- I/O ----

/// Reconciles the MyResource `key` from the caches; see the module doc.
pub async fn reconcile(ctx: &Context, key: &ObjectKey) -> Result<Outcome, Error> {
    let Some(mr) = ctx.caches.myresources.get(key) else {
        // Deleted: its ConfigMap goes by garbage collection.
        return Ok(Outcome::Success);
    };
    if mr.metadata.deletion_timestamp.is_some() || !in_shard(ctx.shard, &mr) {
        return Ok(Outcome::Success);
    }
    let configmaps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &key.namespace);
    let desired = desired_configmap(&mr);
    let cached = ctx.caches.configmaps.get(key);
    let mut state = match &cached {
        Some(cm) => classify(Some(cm), &desired, &mr),
        // Not in our cache (which holds only ours): absent, or someone else's.
        None => ConfigMapState::Missing,
    };
    let pods = ctx.caches.pods.counts(key);

    let mut change = None;
    if let ConfigMapState::Stale { uid, owner } = &state {
        // Delete exactly that ConfigMap, then create ours below.
        if !delete_stale(ctx, key, &configmaps, uid, owner).await? {
            return Ok(Outcome::RequeueAfter(Duration::from_millis(200)));
        }
        state = ConfigMapState::Missing;
    }
    if state == ConfigMapState::Missing {
        // Create, not apply: a create cannot overwrite a ConfigMap that exists already,
        // and it costs one request instead of a read and a write.
        ctx.fence.check()?;
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        match configmaps.create(&params, &desired).await {
            Ok(cm) => {
                ctx.echoes
                    .wrote(Kind::ConfigMap, key, cm.resource_version());
                change = Some(("ConfigMapCreated", "created"));
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {
                // It exists: someone else's, or ours and our cache has not seen it yet.
                let existing = configmaps.get_opt(&key.name).await?;
                state = classify(existing.as_ref(), &desired, &mr);
                match state {
                    ConfigMapState::Drifted => {
                        apply(ctx, key, &configmaps, &desired, existing.as_ref()).await?;
                        change = Some(("ConfigMapUpdated", "updated"));
                    }
                    // A leftover our cache does not show: in scale-out mode it carries the
                    // earlier owner's shard bucket, so this shard's cache never will.
                    // Delete it now; the next pass creates ours.
                    ConfigMapState::Stale { uid, owner } => {
                        delete_stale(ctx, key, &configmaps, &uid, &owner).await?;
                        return Ok(Outcome::RequeueAfter(Duration::from_millis(200)));
                    }
                    // Gone again: look again once the cache has caught up.
                    ConfigMapState::Missing => {
                        return Ok(Outcome::RequeueAfter(Duration::from_millis(200)));
                    }
                    ConfigMapState::UpToDate
                    | ConfigMapState::ExtraKeys(_)
                    | ConfigMapState::OwnedElsewhere(_)
                    | ConfigMapState::Terminating(_) => {}
                }
            }
            Err(err) => return Err(err.into()),
        }
    } else if state == ConfigMapState::Drifted {
        apply(ctx, key, &configmaps, &desired, cached.as_deref()).await?;
        change = Some(("ConfigMapUpdated", "updated"));
    }
    if let Some((reason, verb)) = change {
        info!(myresource = %key, "ConfigMap {verb}");
        let note = format!("ConfigMap {} {verb}", key.name);
        publish(ctx, &mr, EventType::Normal, reason, &note);
    }
    let problem = match &state {
        ConfigMapState::OwnedElsewhere(message) => {
            Some(("ConfigMapOwnedElsewhere", message.as_str()))
        }
        ConfigMapState::Terminating(message) => Some(("ConfigMapTerminating", message.as_str())),
        _ => None,
    };
    let extra_keys = match &state {
        ConfigMapState::ExtraKeys(keys) => keys.as_slice(),
        _ => &[],
    };

    let status = desired_status(&mr, pods, problem, extra_keys, Timestamp::now());
    if mr.status.as_ref() != Some(&status) {
        ctx.fence.check()?;
        let api: Api<MyResource> = Api::namespaced(ctx.client.clone(), &key.namespace);
        let patch = json!({
            "metadata": {"resourceVersion": mr.resource_version()},
            "status": status,
        });
        let written = api
            .patch_status(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        ctx.echoes
            .wrote(Kind::MyResource, key, written.resource_version());
        if let Some((reason, message)) = problem {
            let was = mr
                .status
                .as_ref()
                .and_then(|s| s.conditions.first())
                .map(|c| c.reason.as_str());
            if was != Some(reason) {
                publish(ctx, &mr, EventType::Warning, reason, message);
            }
        }
    }
    // Failures go back to the queue, whose backoff (200 ms doubling to 5 min) bounds the
    // retries; the status says what blocks progress.
    match state {
        ConfigMapState::OwnedElsewhere(message) => Err(Error::OwnedElsewhere(message)),
        ConfigMapState::Terminating(message) => Err(Error::Terminating(message)),
        _ => Ok(Outcome::Success),
    }
}

/// Deletes the ConfigMap of `key`'s name left by an earlier MyResource of that name: exactly
/// that object (uid precondition), so a ConfigMap created since is never deleted.
/// Deletes the ConfigMap `uid` controlled by `owner`, an earlier MyResource of this name,
/// once a read of the MyResource proves `owner` gone; returns whether it did (if not, the
/// cache that showed another uid lags, and the caller looks again once it has caught up).
async fn delete_stale(
    ctx: &Context,
    key: &ObjectKey,
    configmaps: &Api<ConfigMap>,
    uid: &str,
    owner: &str,
) -> Result<bool, Error> {
    let mrs: Api<MyResource> = Api::namespaced(ctx.client.clone(), &key.namespace);
    if !stale_proven(mrs.get_opt(&key.name).await?.as_ref(), owner, ctx.shard) {
        debug!(myresource = %key, owner, "the ConfigMap's owner may be the current MyResource: not deleting it");
        return Ok(false);
    }
    ctx.fence.check()?;
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid.to_string()),
            resource_version: None,
        }),
        ..Default::default()
    };
    match configmaps.delete(&key.name, &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => {}
        Err(err) => return Err(err.into()),
    }
    info!(myresource = %key, "deleted a ConfigMap left by an earlier MyResource of this name");
    Ok(true)
}

/// Whether `current`, the MyResource of a ConfigMap's name as the API server has it now,
/// proves that ConfigMap's controller `owner` gone *and* makes the name this shard's to
/// clean up: it exists under another uid, of this shard. (When it is `owner`, our cache
/// lagged; when it does not exist, garbage collection removes the ConfigMap and there is
/// nothing to replace it for; when it is another shard's, the name was deleted and created
/// again since the object we reconcile was read, and that shard's leader replaces the
/// ConfigMap.)
fn stale_proven(
    current: Option<&MyResource>,
    owner: &str,
    shard: Option<(ShardKey, usize)>,
) -> bool {
    current.is_some_and(|mr| {
        mr.uid()
            .is_some_and(|uid| uid != owner && owns(shard, &uid))
    })
}

/// Whether `mr` belongs to the shard of a scale-out context (always, outside scale-out).
fn in_shard(shard: Option<(ShardKey, usize)>, mr: &MyResource) -> bool {
    mr.uid().is_some_and(|uid| owns(shard, &uid)) || shard.is_none()
}

/// Whether the objects of the MyResource `uid` (itself, the ConfigMaps it controls, the
/// Events about it) belong to the shard of a scale-out context (always, outside scale-out).
fn owns(shard: Option<(ShardKey, usize)>, uid: &str) -> bool {
    shard.is_none_or(|(key, index)| key.owns(index, uid))
}

/// Server-side applies the desired ConfigMap over `existing`, with its resourceVersion as a
/// precondition: if the ConfigMap changed since it was read (another writer, or a stale
/// cache), the apply conflicts and the key is retried instead of overwriting.
async fn apply(
    ctx: &Context,
    key: &ObjectKey,
    configmaps: &Api<ConfigMap>,
    desired: &ConfigMap,
    existing: Option<&ConfigMap>,
) -> Result<(), Error> {
    ctx.fence.check()?;
    let mut body = desired.clone();
    body.metadata.resource_version = existing.and_then(|cm| cm.resource_version());
    let written = configmaps
        .patch(
            &key.name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await?;
    ctx.echoes
        .wrote(Kind::ConfigMap, key, written.resource_version());
    Ok(())
}

/// Queues an Event about `mr`, published off the reconcile's path by the term's publisher
/// (see [`crate::control::events`]); one that cannot be queued is counted there, never fatal.
fn publish(ctx: &Context, mr: &MyResource, type_: EventType, reason: &'static str, note: &str) {
    ctx.events.queue(Pending {
        regarding: mr.object_ref(&()),
        type_,
        reason,
        note: note.into(),
        cause: span_context(&tracing::Span::current()),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::MyResourceSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn mr() -> MyResource {
        let mut mr = MyResource::new(
            "example-myresource",
            MyResourceSpec {
                message: "hello world".into(),
                some_value: 13,
            },
        );
        mr.metadata.namespace = Some("default".into());
        mr.metadata.uid = Some("uid-1".into());
        mr.metadata.generation = Some(2);
        mr
    }

    /// Issue 30, hole 1: a scale-out worker acts only on objects of its own shard.
    #[test]
    fn a_scale_out_worker_leaves_other_shards_objects_alone() {
        let key = ShardKey::new(6);
        let mine = key.shard_of_uid("uid-1");
        assert!(in_shard(None, &mr()), "one Lease: every object");
        assert!(in_shard(Some((key, mine)), &mr()));
        assert!(!in_shard(Some((key, (mine + 1) % 6)), &mr()));
        let mut no_uid = mr();
        no_uid.metadata.uid = None;
        assert!(!in_shard(Some((key, mine)), &no_uid));
        assert!(in_shard(None, &no_uid));
        // A ConfigMap left by an earlier MyResource of the name is removed only by the
        // leader of the shard the name belongs to now: the chaos fault cross_shard_recreate
        // saw a leader whose object had meanwhile been deleted and created again elsewhere
        // remove it during that shard's term (2 writes in 12 rounds).
        let other = (0..)
            .map(|i| format!("uid-other-{i}"))
            .find(|u| key.shard_of_uid(u) != mine)
            .unwrap();
        let named = |uid: &str| {
            let mut m = mr();
            m.metadata.uid = Some(uid.into());
            m
        };
        assert!(stale_proven(
            Some(&named("uid-1")),
            "uid-0",
            Some((key, mine))
        ));
        assert!(!stale_proven(
            Some(&named(&other)),
            "uid-0",
            Some((key, mine))
        ));
        assert!(stale_proven(Some(&named(&other)), "uid-0", None));
    }

    #[test]
    fn desired_configmap_carries_the_spec_and_a_controller_reference() {
        let cm = desired_configmap(&mr());
        let data = cm.data.unwrap();
        assert_eq!(data["message"], "hello world");
        assert_eq!(data["someValue"], "13");
        let owner = &cm.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("MyResource", "uid-1", Some(true))
        );
        assert_eq!(cm.metadata.labels.unwrap()[MANAGED_BY_LABEL], MANAGED_BY);
    }

    #[test]
    fn classify_tells_ours_drifted_missing_and_foreign_apart() {
        let mr = mr();
        let desired = desired_configmap(&mr);
        assert_eq!(classify(None, &desired, &mr), ConfigMapState::Missing);
        assert_eq!(
            classify(Some(&desired), &desired, &mr),
            ConfigMapState::UpToDate
        );

        let mut edited = desired.clone();
        edited
            .data
            .as_mut()
            .unwrap()
            .insert("message".into(), "edited".into());
        assert_eq!(
            classify(Some(&edited), &desired, &mr),
            ConfigMapState::Drifted
        );

        let mut foreign = desired.clone();
        foreign.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "apps/v1".into(),
            kind: "Deployment".into(),
            name: "web".into(),
            uid: "uid-9".into(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        let ConfigMapState::OwnedElsewhere(msg) = classify(Some(&foreign), &desired, &mr) else {
            panic!("foreign ConfigMap must not be ours");
        };
        assert!(msg.contains("Deployment web"), "{msg}");

        // The same name but an earlier uid: a leftover of a deleted MyResource.
        let mut stale = desired.clone();
        stale.metadata.uid = Some("cm-uid".into());
        stale.metadata.owner_references.as_mut().unwrap()[0].uid = "uid-0".into();
        assert_eq!(
            classify(Some(&stale), &desired, &mr),
            ConfigMapState::Stale {
                uid: "cm-uid".into(),
                owner: "uid-0".into(),
            }
        );
        // Deleted only once a read proves that owner gone.
        let named = |uid: &str| {
            let mut mr = mr.clone();
            mr.metadata.uid = Some(uid.into());
            mr
        };
        assert!(stale_proven(Some(&named("uid-1")), "uid-0", None));
        assert!(
            !stale_proven(Some(&named("uid-0")), "uid-0", None),
            "the current MyResource's: our cache lagged"
        );
        assert!(
            !stale_proven(None, "uid-0", None),
            "gone: garbage collection's"
        );

        let mut unowned = desired.clone();
        unowned.metadata.owner_references = None;
        assert!(matches!(
            classify(Some(&unowned), &desired, &mr),
            ConfigMapState::OwnedElsewhere(_)
        ));
    }

    #[test]
    fn an_unchanged_world_yields_an_equal_status() {
        let mut mr = mr();
        let t0 = Timestamp::from_second(1_000).unwrap();
        let pods = PodCounts { total: 3, ready: 2 };
        let first = desired_status(&mr, pods, None, &[], t0);
        assert_eq!(first.observed_generation, Some(2));
        assert_eq!(first.conditions[0].status, "True");
        mr.status = Some(first.clone());
        // Later, same world: equal, so nothing is written.
        let later = desired_status(&mr, pods, None, &[], Timestamp::from_second(2_000).unwrap());
        assert_eq!(later, first);
        // A failure flips the condition and its transition time.
        let failed = desired_status(
            &mr,
            pods,
            Some(("ConfigMapOwnedElsewhere", "taken")),
            &[],
            Timestamp::from_second(3_000).unwrap(),
        );
        assert_eq!(failed.conditions[0].status, "False");
        assert_eq!(failed.conditions[0].reason, "ConfigMapOwnedElsewhere");
        assert_eq!(
            failed.conditions[0].last_transition_time,
            Time(Timestamp::from_second(3_000).unwrap())
        );
    }

    /// Issue 13, item 9: a key written by another field manager was "drift" forever.
    #[test]
    fn keys_written_by_someone_else_are_named_not_fought() {
        let mut mr = mr();
        let desired = desired_configmap(&mr);
        let mut extra = desired.clone();
        extra
            .data
            .as_mut()
            .unwrap()
            .insert("theirs".into(), "x".into());
        let state = classify(Some(&extra), &desired, &mr);
        assert_eq!(state, ConfigMapState::ExtraKeys(vec!["theirs".into()]));
        let pods = PodCounts { total: 0, ready: 0 };
        let keys = vec!["theirs".to_string()];
        let t = Timestamp::from_second(1_000).unwrap();
        let status = desired_status(&mr, pods, None, &keys, t);
        let ready = &status.conditions[0];
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("True", "ReconciledWithForeignKeys")
        );
        assert!(ready.message.contains("theirs"), "{}", ready.message);
        // Stable: the same world later yields the same status, so nothing is written.
        mr.status = Some(status.clone());
        let later = Timestamp::from_second(2_000).unwrap();
        assert_eq!(desired_status(&mr, pods, None, &keys, later), status);
        // One of our keys edited is still drift, extra keys or not.
        extra
            .data
            .as_mut()
            .unwrap()
            .insert("message".into(), "edited".into());
        assert_eq!(
            classify(Some(&extra), &desired, &mr),
            ConfigMapState::Drifted
        );
    }

    /// Issue 13, item 9: a leftover held by a foreign finalizer looped delete → create →
    /// requeue every 200 ms.
    #[test]
    fn a_configmap_held_by_finalizers_is_reported_not_deleted_again() {
        let mr = mr();
        let desired = desired_configmap(&mr);
        let mut leftover = desired.clone();
        leftover.metadata.owner_references.as_mut().unwrap()[0].uid = "uid-0".into();
        leftover.metadata.deletion_timestamp = Some(Time(Timestamp::from_second(1).unwrap()));
        leftover.metadata.finalizers = Some(vec!["example.com/hold".into()]);
        let ConfigMapState::Terminating(message) = classify(Some(&leftover), &desired, &mr) else {
            panic!("a ConfigMap being deleted is neither stale nor missing");
        };
        assert!(message.contains("example.com/hold"), "{message}");
    }
}
