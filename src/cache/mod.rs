//! Warm caches, kept on every replica from process start, leader or not.
//!
//! - MyResources: a kube-runtime reflector store, without managedFields.
//! - ConfigMaps the operator owns (label `app.kubernetes.io/managed-by`): a reflector store,
//!   without managedFields.
//! - Pods labelled `trstringer.com/myresource`: not Pods at all but a slim index (measured:
//!   a k8s-openapi `Pod` is ≈2.5 KiB even when empty), holding per Pod only the MyResource
//!   it names and whether it is Ready, indexed by that MyResource.
//!
//! Every change is reported to a [`Sink`] as the MyResource key it affects, so that the
//! caller (the controller) decides whether to enqueue it; the caches never enqueue.
//! Invariants: [`Caches::synced`] is true only after every watcher has completed its initial
//! list, and stays true across re-lists (a re-list swaps the contents atomically). A failed
//! watch is retried with kube's exponential backoff (0.8 s to 30 s), cut short by the API
//! server's return ([`Reachability`]): after an outage the caches catch up within a retry
//! period of the election's first successful request, not at the backoff's cap (client-go's
//! reflectors wait out the same 30 s cap).
//!
//! Parts: `store` (a reflector store per watched namespace), `pods` (the slim Pod index
//! and its event loop), `retry` (a watch's failures retried, cut short by the API
//! server's return); here: the wiring, the reflector loop and what a change means.

mod pods;
mod retry;
mod store;

pub use pods::PodIndex;
use pods::index_pods;
use retry::retried;
pub use store::NamespacedStore;

use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::runtime::reflector;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tracing::{debug, info};

use crate::echo::{Echoes, Kind};
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

/// Where the caches report the MyResource keys that a change affects.
pub trait Sink: Send + Sync + 'static {
    fn changed(&self, key: ObjectKey, trigger: Trigger);
}

/// The caches of one replica.
#[derive(Clone)]
pub struct Caches {
    pub myresources: NamespacedStore<MyResource>,
    pub configmaps: NamespacedStore<ConfigMap>,
    pub pods: PodIndex,
    /// The operator's own writes awaiting their echo; see [`crate::echo`].
    pub echoes: Arc<Echoes>,
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
}

/// Counts the watchers that have not finished their first list; flips `synced` at zero.
#[derive(Clone)]
struct SyncGate {
    remaining: Arc<std::sync::atomic::AtomicUsize>,
    synced: Arc<watch::Sender<bool>>,
}

impl SyncGate {
    fn done(&self) {
        if self
            .remaining
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            self.synced.send_replace(true);
            info!("caches synced");
        }
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
    let (synced_tx, synced) = watch::channel(false);
    let gate = SyncGate {
        remaining: Arc::new(std::sync::atomic::AtomicUsize::new(3 * scopes.len())),
        synced: Arc::new(synced_tx),
    };
    let cm_selector = format!("{MANAGED_BY_LABEL}={MANAGED_BY}");
    let pods = PodIndex::default();
    let echoes = Arc::new(Echoes::default());
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
        tokio::spawn(reflect(events, writer, gate.clone(), {
            let (sink, echoes) = (sink.clone(), echoes.clone());
            move |change| on_myresource(change, sink.as_ref(), &echoes)
        }));
        myresources.push((scope.clone(), store));

        let (store, writer) = reflector::store::<ConfigMap>();
        let config = watcher::Config::default().labels(&cm_selector);
        let events = watch::<ConfigMap>(&client, scope.as_deref(), config, reachability)
            .map(|e| e.modify(strip_managed_fields));
        tokio::spawn(reflect(events, writer, gate.clone(), {
            let (sink, echoes) = (sink.clone(), echoes.clone());
            move |change| on_configmap(change, sink.as_ref(), &echoes)
        }));
        configmaps.push((scope.clone(), store));

        let events = watch::<Pod>(
            &client,
            scope.as_deref(),
            watcher::Config::default().labels(POD_LABEL),
            reachability,
        );
        tokio::spawn(index_pods(
            events,
            scope,
            pods.clone(),
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
        echoes,
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

/// A change as the caches report it, once the store reflects it.
enum Change<'a, K> {
    Applied(&'a K),
    Deleted(&'a K),
    /// In the store before or after a re-list (which may hide any change in between).
    Relisted(&'a K),
}

/// Applies watch events to a store and reports each change once the store shows it.
///
/// Invariant: a re-list is reported at `InitDone`, after the writer has swapped in the new
/// list, for every object in the store before it or after it: reporting at `InitApply`
/// would let a worker read the store before the swap, find the old object up to date and
/// never look again (the chaos suite caught this after an API server restart).
async fn reflect<K, S, F>(events: S, mut writer: Writer<K>, gate: SyncGate, mut on_change: F)
where
    K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + 'static,
    S: Stream<Item = Event<K>>,
    F: FnMut(Change<'_, K>),
{
    let mut events = std::pin::pin!(events);
    let reader = writer.as_reader();
    let mut before_relist = Vec::new();
    let mut synced = false;
    while let Some(event) = events.next().await {
        if matches!(event, Event::Init) {
            before_relist = reader.state();
        }
        writer.apply_watcher_event(&event);
        match &event {
            Event::Apply(object) => on_change(Change::Applied(object)),
            Event::Delete(object) => on_change(Change::Deleted(object)),
            Event::Init | Event::InitApply(_) => {}
            Event::InitDone => {
                for object in before_relist.drain(..).chain(reader.state()) {
                    on_change(Change::Relisted(&object));
                }
                if !synced {
                    // Only the first list counts; later re-lists keep the cache synced.
                    synced = true;
                    debug!(kind = K::kind(&()).as_ref(), "initial list complete");
                    gate.done();
                }
            }
        }
    }
}

fn on_myresource(change: Change<'_, MyResource>, sink: &dyn Sink, echoes: &Echoes) {
    match change {
        Change::Applied(mr) => {
            let key = ObjectKey::of(mr);
            if !echoes.is_echo(Kind::MyResource, &key, mr.resource_version().as_deref()) {
                sink.changed(key, Trigger::MyResource)
            }
        }
        Change::Deleted(mr) => {
            // The tutorial's handler logged deletions; the ConfigMap goes by garbage collection.
            let key = ObjectKey::of(mr);
            info!(myresource = %key, "MyResource deleted");
            echoes.forget(Kind::MyResource, &key);
            sink.changed(key, Trigger::MyResource);
        }
        Change::Relisted(mr) => {
            let key = ObjectKey::of(mr);
            echoes.forget(Kind::MyResource, &key);
            sink.changed(key, Trigger::MyResource);
        }
    }
}

fn on_configmap(change: Change<'_, ConfigMap>, sink: &dyn Sink, echoes: &Echoes) {
    match change {
        Change::Applied(cm) => {
            if let Some(owner) = controller_key(cm)
                && !echoes.is_echo(Kind::ConfigMap, &owner, cm.resource_version().as_deref())
            {
                sink.changed(owner, Trigger::ConfigMap);
            }
        }
        Change::Deleted(cm) | Change::Relisted(cm) => {
            if let Some(owner) = controller_key(cm) {
                echoes.forget(Kind::ConfigMap, &owner);
                sink.changed(owner, Trigger::ConfigMap);
            }
        }
    }
}

/// The MyResource that controls a ConfigMap, by ownerReference.
fn controller_key(cm: &ConfigMap) -> Option<ObjectKey> {
    let owner = cm
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "MyResource")?;
    Some(ObjectKey::new(cm.namespace()?, owner.name.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cm(name: &str, rv: &str) -> ConfigMap {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(name.into());
        cm.metadata.namespace = Some("ns".into());
        cm.metadata.resource_version = Some(rv.into());
        cm
    }

    /// Runs `events` through [`reflect`]; returns, for each change reported, what it was and
    /// the resourceVersion the store held for that object at that moment.
    async fn reflected(events: Vec<Event<ConfigMap>>) -> Vec<(String, String, Option<String>)> {
        let (store, writer) = reflector::store::<ConfigMap>();
        let (synced, _rx) = watch::channel(false);
        let gate = SyncGate {
            remaining: Arc::new(std::sync::atomic::AtomicUsize::new(1)),
            synced: Arc::new(synced),
        };
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = {
            let seen = seen.clone();
            move |change: Change<'_, ConfigMap>| {
                let (what, cm) = match change {
                    Change::Applied(cm) => ("applied", cm),
                    Change::Deleted(cm) => ("deleted", cm),
                    Change::Relisted(cm) => ("relisted", cm),
                };
                let in_store = store
                    .get(&reflector::ObjectRef::new(&cm.name_any()).within("ns"))
                    .and_then(|c| c.resource_version());
                seen.lock()
                    .unwrap()
                    .push((what.to_string(), cm.name_any(), in_store));
            }
        };
        let stream = futures::stream::iter(events);
        reflect(stream, writer, gate, record).await;
        // Store order is hash order: compare sorted.
        let mut seen = seen.lock().unwrap().clone();
        seen.sort();
        seen
    }

    #[tokio::test]
    async fn a_relist_is_reported_once_the_store_holds_it_for_old_and_new_objects() {
        let seen = reflected(vec![
            Event::Init,
            Event::InitApply(cm("a", "1")),
            Event::InitApply(cm("b", "1")),
            Event::InitDone,
            Event::Apply(cm("a", "2")),
            // A re-list after a gap in which b was deleted and a changed again.
            Event::Init,
            Event::InitApply(cm("a", "3")),
            Event::InitDone,
        ])
        .await;
        let row = |what: &str, name: &str, rv: Option<&str>| {
            (what.to_string(), name.to_string(), rv.map(String::from))
        };
        // The first list: a and b at 1. Then a applied at 2. Then the re-list, reported
        // after the swap for the old (a, b) and the new (a) contents: a worker reading the
        // store finds a at 3 and b gone, never the state before the re-list.
        let mut want = vec![
            row("applied", "a", Some("2")),
            row("relisted", "a", Some("1")),
            row("relisted", "a", Some("3")),
            row("relisted", "a", Some("3")),
            row("relisted", "b", Some("1")),
            row("relisted", "b", None),
        ];
        want.sort();
        assert_eq!(seen, want);
    }
}
