//! Warm caches, kept on every replica from process start, leader or not.
//!
//! - MyResources: a kube-runtime reflector store, without managedFields.
//! - ConfigMaps the operator owns (label `app.kubernetes.io/managed-by`): a reflector store,
//!   without managedFields.
//! - Pods labelled `trstringer.com/myresource`: not Pods at all but a slim index (measured:
//!   a k8s-openapi `Pod` is ≈2.5 KiB even when empty), holding per Pod only the MyResource
//!   it names and whether it is Ready, indexed by that MyResource.
//!
//! Every change is reported to a [`Sink`] as a [`Change`]: the MyResource key it affects and
//! what was observed, so that the next step (the echo filter, then the controller) decides
//! what to do with it; the caches never enqueue.
//! Invariants: [`Caches::synced`] is true only after every watch has completed its initial
//! list, and stays true across re-lists (a re-list swaps the contents atomically). A failed
//! watch is retried with kube's exponential backoff (0.8 s to 30 s), cut short by the API
//! server's return ([`Reachability`]): after an outage the caches catch up within a retry
//! period of the election's first successful request, not at the backoff's cap (client-go's
//! reflectors wait out the same 30 s cap).
//!
//! Parts: `reflect` (the one loop every watch runs through, and the reflector store as a
//! mirror of it), `store` (a reflector store per watched namespace), `pods` (the slim Pod
//! index as a mirror), `retry` (a watch's failures retried, cut short by the API server's
//! return); here: what the caches report, and the wiring.

mod pods;
mod reflect;
pub(crate) mod retry;
mod store;

pub use pods::PodIndex;
use pods::PodMirror;
use reflect::{StoreMirror, SyncGate, reflect};
use retry::retried;
pub use store::NamespacedStore;

use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::runtime::reflector;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use crate::key::ObjectKey;
use crate::kubeclient::Reachability;
use crate::resource::{MANAGED_BY, MANAGED_BY_LABEL, MyResource, POD_LABEL};

/// Why a key was reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    MyResource,
    ConfigMap,
    Pod,
}

impl Trigger {
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::MyResource => "myresource",
            Trigger::ConfigMap => "configmap",
            Trigger::Pod => "pod",
        }
    }
}

/// What a watch saw of the object behind a [`Change`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// Created or modified, now at `resource_version`.
    Applied {
        resource_version: Option<String>,
    },
    Deleted,
    /// In the cache before or after a re-list (which may hide any change in between).
    Relisted,
}

/// A change the caches report, once they show it: the MyResource it may affect, the kind of
/// object that changed, and what was seen of that object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub key: ObjectKey,
    pub trigger: Trigger,
    pub observed: Observed,
}

/// The next step after the caches: where they report every [`Change`].
pub trait Sink: Send + Sync + 'static {
    fn changed(&self, change: Change);
}

/// The caches of one replica.
#[derive(Clone)]
pub struct Caches {
    pub myresources: NamespacedStore<MyResource>,
    pub configmaps: NamespacedStore<ConfigMap>,
    pub pods: PodIndex,
    synced: watch::Receiver<bool>,
}

impl Caches {
    /// Whether every initial list has completed.
    pub fn synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Waits until every initial list has completed.
    pub async fn wait_synced(&self) {
        let mut rx = self.synced.clone();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Every MyResource key in the cache.
    pub fn myresource_keys(&self) -> Vec<ObjectKey> {
        self.myresources
            .state()
            .iter()
            .map(|o| ObjectKey::of(o))
            .collect()
    }

    /// Objects cached, by kind.
    pub fn counts(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("MyResource", self.myresources.len()),
            ("ConfigMap", self.configmaps.len()),
            ("Pod", self.pods.len()),
        ]
    }
}

/// Starts the watchers (per resource and watched namespace; all namespaces when
/// `namespaces` is empty) and returns the caches. The watchers run until the process ends.
pub fn start(
    client: Client,
    namespaces: &[String],
    sink: Arc<dyn Sink>,
    reachability: &Reachability,
) -> Caches {
    let scopes: Vec<Option<String>> = if namespaces.is_empty() {
        vec![None]
    } else {
        namespaces.iter().cloned().map(Some).collect()
    };
    let (gate, synced) = SyncGate::new(3 * scopes.len());
    let cm_selector = format!("{MANAGED_BY_LABEL}={MANAGED_BY}");
    let pods = PodIndex::default();
    let mut myresources = Vec::new();
    let mut configmaps = Vec::new();
    for scope in scopes {
        let (store, writer) = reflector::store::<MyResource>();
        let events = watch::<MyResource>(
            &client,
            scope.as_deref(),
            watcher::Config::default(),
            reachability,
        )
        .map(|e| e.modify(strip_managed_fields));
        let mirror = StoreMirror::new(writer, |mr| Some(ObjectKey::of(mr)));
        let trigger = Trigger::MyResource;
        tokio::spawn(reflect(events, mirror, trigger, sink.clone(), gate.clone()));
        myresources.push((scope.clone(), store));

        let (store, writer) = reflector::store::<ConfigMap>();
        let config = watcher::Config::default().labels(&cm_selector);
        let events = watch::<ConfigMap>(&client, scope.as_deref(), config, reachability)
            .map(|e| e.modify(strip_managed_fields));
        let mirror = StoreMirror::new(writer, controller_key);
        let trigger = Trigger::ConfigMap;
        tokio::spawn(reflect(events, mirror, trigger, sink.clone(), gate.clone()));
        configmaps.push((scope.clone(), store));

        let config = watcher::Config::default().labels(POD_LABEL);
        let events = watch::<Pod>(&client, scope.as_deref(), config, reachability);
        let mirror = PodMirror::new(scope, pods.clone());
        tokio::spawn(reflect(
            events,
            mirror,
            Trigger::Pod,
            sink.clone(),
            gate.clone(),
        ));
    }
    Caches {
        myresources: NamespacedStore {
            stores: myresources,
        },
        configmaps: NamespacedStore { stores: configmaps },
        pods,
        synced,
    }
}

/// managedFields are often the largest part of an object and the operator never reads them.
fn strip_managed_fields<K: Resource>(object: &mut K) {
    object.managed_fields_mut().clear();
}

/// The watch events of `K` in one namespace, or in all of them; see [`retried`].
fn watch<K>(
    client: &Client,
    namespace: Option<&str>,
    config: watcher::Config,
    reachability: &Reachability,
) -> impl Stream<Item = Event<K>> + Send + 'static
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    let api = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    retried(
        watcher::watcher(api, config),
        reachability.subscribe(),
        K::kind(&()).to_string(),
    )
}

/// The MyResource that controls a ConfigMap, by ownerReference.
fn controller_key(cm: &ConfigMap) -> Option<ObjectKey> {
    let owner = cm
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "MyResource")?;
    Some(ObjectKey::new(cm.namespace()?, owner.name.clone()))
}
