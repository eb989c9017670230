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
//! In scale-out mode (steered by the shard plan through the operator's scale-out module)
//! MyResources and ConfigMaps are watched per shard ([`Caches::watch_shards`]): a shard's MyResource watch carries the API server's
//! `shardSelector` (or, where that is not served, lists everything and keeps the shard's),
//! its ConfigMap watch selects the shard's bucket labels; each shard has its own stores and
//! its own "listed" flag ([`Caches::warm_shards`]). The slim Pod index stays whole.
//!
//! Parts: `reflect` (the one loop every watch runs through, and the reflector store as a
//! mirror of it), `store` (a reflector store per watched scope: namespace, and shard), `pods` (the slim Pod
//! index as a mirror); a watch's failures are retried by `kube_leasehold::retry`, cut short by
//! the API server's return; here: what the caches report, and the wiring.

mod pods;
mod reflect;
mod store;

pub use pods::PodIndex;
use pods::PodMirror;
use reflect::{StoreMirror, SyncGate, reflect};
pub use store::NamespacedStore;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::runtime::reflector;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::info;

use kube_leasehold::retry::{Reachability, retried};
use kube_leasehold::scaleout::ShardKey;
use kube_leasehold::scaleout::selector::with_query;

use crate::key::ObjectKey;
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

/// What one watch covers: a namespace (or all of them) and, in scale-out mode, one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    pub namespace: Option<String>,
    pub shard: Option<ShardScope>,
}

/// One shard of a scale-out replica's caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardScope {
    pub index: usize,
    pub key: ShardKey,
    /// Whether the API server filters MyResources by `shardSelector`; otherwise this
    /// replica lists all of them and keeps the shard's (ConfigMaps are always filtered on
    /// the server, by their bucket label).
    pub server_side: bool,
}

/// A shard's watch tasks, and whether their first lists have completed.
type ShardWatches = (Vec<JoinHandle<()>>, watch::Receiver<bool>);

/// How to start more watches: for the shards of a scale-out replica.
struct Wiring {
    client: Client,
    namespaces: Vec<Option<String>>,
    sink: Arc<dyn Sink>,
    reachability: Reachability,
    /// The shards watched, each with its watches' tasks and whether it has listed.
    shards: Mutex<BTreeMap<usize, ShardWatches>>,
    /// Moves whenever a shard's first list completes.
    warmed: watch::Sender<u64>,
}

/// The caches of one replica.
#[derive(Clone)]
pub struct Caches {
    pub myresources: NamespacedStore<MyResource>,
    pub configmaps: NamespacedStore<ConfigMap>,
    pub pods: PodIndex,
    synced: watch::Receiver<bool>,
    wiring: Arc<Wiring>,
}

impl Caches {
    /// Whether every initial list of the replica-wide watches has completed (all watches;
    /// in scale-out mode the Pod index, see [`start`]).
    pub fn synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Waits until [`Caches::synced`].
    pub async fn wait_synced(&self) {
        let mut rx = self.synced.clone();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Every cached MyResource (shared, not copied: a takeover turns them into keys as it
    /// queues them, so its first reconcile does not wait for 100,000 keys to be built).
    pub fn cached_myresources(&self) -> Vec<Arc<MyResource>> {
        self.myresources.state()
    }

    /// Every MyResource cached for shard `index`.
    pub fn shard_myresources(&self, index: usize) -> Vec<Arc<MyResource>> {
        let in_shard = |scope: &Scope| scope.shard.is_some_and(|s| s.index == index);
        self.myresources.state_of(in_shard)
    }

    /// Objects cached, by kind.
    pub fn counts(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("MyResource", self.myresources.len()),
            ("ConfigMap", self.configmaps.len()),
            ("Pod", self.pods.len()),
        ]
    }

    /// Watches exactly the shards `wanted` (scale-out mode): starts the missing ones,
    /// stops and forgets the others.
    pub fn watch_shards(&self, wanted: &BTreeSet<usize>, key: ShardKey, server_side: bool) {
        let w = &self.wiring;
        let mut shards = w.shards.lock().expect("shard watches lock");
        let gone: Vec<usize> = shards
            .keys()
            .filter(|i| !wanted.contains(i))
            .copied()
            .collect();
        let mut stopped = Vec::new();
        for index in gone {
            let (tasks, _) = shards.remove(&index).expect("listed");
            for task in &tasks {
                task.abort();
            }
            stopped.extend(tasks);
            let in_shard = |scope: &Scope| scope.shard.is_some_and(|s| s.index == index);
            self.myresources.remove(in_shard);
            self.configmaps.remove(in_shard);
            info!(shard = index, "stopped caching the shard");
        }
        if !stopped.is_empty() {
            tokio::spawn(release_freed(stopped));
        }
        for &index in wanted {
            if shards.contains_key(&index) {
                continue;
            }
            let shard = ShardScope {
                index,
                key,
                server_side,
            };
            let scopes: Vec<Scope> = w
                .namespaces
                .iter()
                .map(|namespace| Scope {
                    namespace: namespace.clone(),
                    shard: Some(shard),
                })
                .collect();
            let (gate, mut synced) = SyncGate::new(2 * scopes.len());
            let mut tasks = Vec::new();
            for scope in scopes {
                tasks.push(self.watch_myresources(scope.clone(), &gate));
                tasks.push(self.watch_configmaps(scope, &gate));
            }
            let warmed = w.warmed.clone();
            let rx = synced.clone();
            tasks.push(tokio::spawn(async move {
                if synced.wait_for(|s| *s).await.is_ok() {
                    info!(shard = index, "shard cache synced");
                    warmed.send_modify(|n| *n += 1);
                }
            }));
            info!(shard = index, server_side, "caching the shard");
            shards.insert(index, (tasks, rx));
        }
    }

    /// The shards being cached (warm or still listing).
    pub fn cached_shards(&self) -> BTreeSet<usize> {
        let shards = self.wiring.shards.lock().expect("shard watches lock");
        shards.keys().copied().collect()
    }

    /// The shards whose caches have completed their first list.
    pub fn warm_shards(&self) -> BTreeSet<usize> {
        let shards = self.wiring.shards.lock().expect("shard watches lock");
        shards
            .iter()
            .filter(|(_, (_, synced))| *synced.borrow())
            .map(|(i, _)| *i)
            .collect()
    }

    /// Moves whenever a shard's cache completes its first list.
    pub fn subscribe_warmed(&self) -> watch::Receiver<u64> {
        self.wiring.warmed.subscribe()
    }

    fn watch_myresources(&self, scope: Scope, gate: &SyncGate) -> JoinHandle<()> {
        let w = &self.wiring;
        let (store, writer) = reflector::store::<MyResource>();
        let shard = scope.shard;
        let client = match shard {
            Some(s) if s.server_side => {
                with_query(&w.client, "shardSelector", &s.key.selector(s.index))
            }
            _ => w.client.clone(),
        };
        let events = watch::<MyResource>(
            &client,
            scope.namespace.as_deref(),
            watcher::Config::default(),
            &w.reachability,
        )
        .filter_map(move |e| {
            // Without the server's filter, keep only the shard's objects.
            let event = match shard {
                Some(s) if !s.server_side => only_shard(e, s),
                _ => Some(e),
            };
            std::future::ready(event.map(|e| e.modify(strip_managed_fields)))
        });
        let mirror = StoreMirror::new(writer, |mr| Some(ObjectKey::of(mr)));
        self.myresources.add(scope, store);
        let (sink, gate) = (w.sink.clone(), gate.clone());
        tokio::spawn(reflect(events, mirror, Trigger::MyResource, sink, gate))
    }

    fn watch_configmaps(&self, scope: Scope, gate: &SyncGate) -> JoinHandle<()> {
        let w = &self.wiring;
        let (store, writer) = reflector::store::<ConfigMap>();
        let mut selector = format!("{MANAGED_BY_LABEL}={MANAGED_BY}");
        if let Some(s) = scope.shard {
            selector = format!("{selector},{}", s.key.bucket_selector(s.index));
        }
        let config = watcher::Config::default().labels(&selector);
        let events = watch::<ConfigMap>(
            &w.client,
            scope.namespace.as_deref(),
            config,
            &w.reachability,
        )
        .map(|e| e.modify(strip_managed_fields));
        let mirror = StoreMirror::new(writer, controller_key);
        self.configmaps.add(scope, store);
        let (sink, gate) = (w.sink.clone(), gate.clone());
        tokio::spawn(reflect(events, mirror, Trigger::ConfigMap, sink, gate))
    }

    fn watch_pods(&self, namespace: Option<String>, gate: &SyncGate) -> JoinHandle<()> {
        let w = &self.wiring;
        let config = watcher::Config::default().labels(POD_LABEL);
        let events = watch::<Pod>(&w.client, namespace.as_deref(), config, &w.reachability);
        let mirror = PodMirror::new(namespace, self.pods.clone());
        let (sink, gate) = (w.sink.clone(), gate.clone());
        tokio::spawn(reflect(events, mirror, Trigger::Pod, sink, gate))
    }
}

/// Once the aborted watch tasks are gone (and with them the last references to their
/// objects), gives the freed memory back to the system: glibc's allocator keeps it
/// otherwise, and a replica that cached every shard for a moment (the first of a group, at
/// start) would keep the resident memory of all of them.
async fn release_freed(tasks: Vec<JoinHandle<()>>) {
    for task in tasks {
        let _ = task.await;
    }
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free heap memory to the system; it has no
    // preconditions and is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A MyResource event with only the objects of shard `s` (a re-list's markers pass).
fn only_shard(event: Event<MyResource>, s: ShardScope) -> Option<Event<MyResource>> {
    let ours = |mr: &MyResource| mr.uid().is_some_and(|uid| s.key.owns(s.index, &uid));
    match &event {
        Event::Apply(mr) | Event::Delete(mr) | Event::InitApply(mr) if !ours(mr) => None,
        _ => Some(event),
    }
}

fn scopes_of(namespaces: &[String]) -> Vec<Option<String>> {
    if namespaces.is_empty() {
        vec![None]
    } else {
        namespaces.iter().cloned().map(Some).collect()
    }
}

/// Starts the watchers (per resource and watched namespace; all namespaces when
/// `namespaces` is empty) and returns the caches. The watchers run until the process ends.
///
/// `sharded` (scale-out mode): only the slim Pod index starts here (labelled Pods are not
/// ours to label, so the server cannot shard them); MyResources and ConfigMaps are watched
/// per shard, as [`Caches::watch_shards`] says, and [`Caches::synced`] is the Pod index's
/// first list.
pub fn start(
    client: Client,
    namespaces: &[String],
    sink: Arc<dyn Sink>,
    reachability: &Reachability,
    sharded: bool,
) -> Caches {
    let wiring = Arc::new(Wiring {
        client,
        namespaces: scopes_of(namespaces),
        sink,
        reachability: reachability.clone(),
        shards: Mutex::default(),
        warmed: watch::channel(0).0,
    });
    let kinds = if sharded { 1 } else { 3 };
    let (gate, synced) = SyncGate::new(kinds * wiring.namespaces.len());
    let caches = Caches {
        myresources: NamespacedStore::default(),
        configmaps: NamespacedStore::default(),
        pods: PodIndex::default(),
        synced,
        wiring: wiring.clone(),
    };
    for namespace in &wiring.namespaces {
        if !sharded {
            let scope = Scope {
                namespace: namespace.clone(),
                shard: None,
            };
            caches.watch_myresources(scope.clone(), &gate);
            caches.watch_configmaps(scope, &gate);
        }
        caches.watch_pods(namespace.clone(), &gate);
    }
    caches
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
