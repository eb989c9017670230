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

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::runtime::reflector::store::Writer;
use kube::runtime::reflector::{self, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, DefaultBackoff, Event};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::echo::{Echoes, Kind};
use crate::key::ObjectKey;
use crate::kubeclient::Reachability;
use crate::resource::{MANAGED_BY, MANAGED_BY_LABEL, MyResource, POD_LABEL, PodCounts};
use crate::throttle::{Throttle, Verdict};

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

/// One Pod as the operator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PodEntry {
    ready: bool,
}

/// Labelled Pods grouped by the MyResource they name: key → pod name → entry.
#[derive(Debug, Default)]
struct PodTable {
    by_owner: HashMap<ObjectKey, BTreeMap<String, PodEntry>>,
    owner_of: HashMap<ObjectKey, ObjectKey>,
}

impl PodTable {
    /// Inserts or updates a Pod; returns its previous owner (if it had one) and whether it
    /// existed before.
    fn upsert(&mut self, pod: ObjectKey, owner: ObjectKey, entry: PodEntry) -> Option<ObjectKey> {
        let previous = self.owner_of.insert(pod.clone(), owner.clone());
        if let Some(prev) = previous.as_ref().filter(|p| **p != owner) {
            self.remove_from(prev, &pod.name);
        }
        self.by_owner
            .entry(owner)
            .or_default()
            .insert(pod.name, entry);
        previous
    }

    fn remove(&mut self, pod: &ObjectKey) -> Option<ObjectKey> {
        let owner = self.owner_of.remove(pod)?;
        self.remove_from(&owner, &pod.name);
        Some(owner)
    }

    fn remove_from(&mut self, owner: &ObjectKey, pod_name: &str) {
        if let Some(pods) = self.by_owner.get_mut(owner) {
            pods.remove(pod_name);
            if pods.is_empty() {
                self.by_owner.remove(owner);
            }
        }
    }

    /// Replaces every Pod in `scope` (a namespace, or all) with the contents of `fresh`;
    /// returns the owners whose Pods may have changed.
    fn replace_scope(&mut self, scope: Option<&str>, fresh: PodTable) -> Vec<ObjectKey> {
        let in_scope = |key: &ObjectKey| scope.is_none_or(|ns| ns == key.namespace);
        let mut owners: Vec<ObjectKey> = self
            .by_owner
            .keys()
            .filter(|k| in_scope(k))
            .cloned()
            .collect();
        self.by_owner.retain(|owner, _| !in_scope(owner));
        self.owner_of.retain(|pod, _| !in_scope(pod));
        owners.extend(fresh.by_owner.keys().cloned());
        self.by_owner.extend(fresh.by_owner);
        self.owner_of.extend(fresh.owner_of);
        owners.sort();
        owners.dedup();
        owners
    }

    fn counts(&self, owner: &ObjectKey) -> PodCounts {
        let pods = self.by_owner.get(owner);
        let count = |pred: fn(&PodEntry) -> bool| {
            pods.map_or(0, |p| p.values().filter(|e| pred(e)).count() as i32)
        };
        PodCounts {
            total: count(|_| true),
            ready: count(|e| e.ready),
        }
    }
}

/// The shared, read-only view of the Pod index.
#[derive(Debug, Clone, Default)]
pub struct PodIndex(Arc<RwLock<PodTable>>);

impl PodIndex {
    /// Total and Ready labelled Pods of a MyResource.
    pub fn counts(&self, owner: &ObjectKey) -> PodCounts {
        self.0.read().expect("pod index lock").counts(owner)
    }

    /// Labelled Pods cached.
    pub fn len(&self) -> usize {
        self.0.read().expect("pod index lock").owner_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A reflector store per watched namespace (or one for all namespaces).
///
/// kube-runtime's `Writer` buffers a re-list between `Init` and `InitDone`; merging the
/// watch streams of several namespaces into one writer would let one namespace's `InitDone`
/// swap in a buffer holding only part of another's objects. So each namespace has its own.
#[derive(Clone)]
pub struct NamespacedStore<K: 'static + kube::runtime::reflector::Lookup<DynamicType = ()> + Clone>
{
    stores: Vec<(Option<String>, Store<K>)>,
}

impl<K> NamespacedStore<K>
where
    K: 'static + Resource<DynamicType = ()> + Clone,
{
    /// The cached object `namespace/name`.
    pub fn get(&self, key: &ObjectKey) -> Option<Arc<K>> {
        let reference = reflector::ObjectRef::new(&key.name).within(&key.namespace);
        self.stores
            .iter()
            .find(|(scope, _)| scope.as_deref().is_none_or(|ns| ns == key.namespace))
            .and_then(|(_, store)| store.get(&reference))
    }

    /// Every cached object.
    pub fn state(&self) -> Vec<Arc<K>> {
        self.stores.iter().flat_map(|(_, s)| s.state()).collect()
    }

    /// How many objects are cached.
    pub fn len(&self) -> usize {
        self.stores.iter().map(|(_, s)| s.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
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

/// How often a watch that keeps failing is logged.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// A watcher's events with its failures retried: after a failure it waits kube's
/// exponential backoff or until the API server answers again (`returns` moves), whichever
/// comes first; a return also starts the backoff over. Failures are logged at a bounded
/// rate.
fn retried<K, S>(
    events: S,
    returns: watch::Receiver<u64>,
    kind: String,
) -> impl Stream<Item = Event<K>> + Send + 'static
where
    K: Send + 'static,
    S: Stream<Item = watcher::Result<Event<K>>> + Send + 'static,
{
    struct State<S> {
        events: std::pin::Pin<Box<S>>,
        backoff: DefaultBackoff,
        throttle: Throttle,
        returns: watch::Receiver<u64>,
        kind: String,
    }
    let state = State {
        events: Box::pin(events),
        backoff: DefaultBackoff::default(),
        throttle: Throttle::new(LOG_EVERY),
        returns,
        kind,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            let err = match st.events.next().await? {
                Ok(event) => {
                    st.backoff.reset();
                    if let Some(failures) = st.throttle.succeeded() {
                        info!(kind = %st.kind, failures, "watch works again");
                    }
                    return Some((event, st));
                }
                Err(err) => err,
            };
            if let Verdict::Log { suppressed } = st.throttle.failed(Instant::now()) {
                warn!(error = %err, kind = %st.kind, suppressed, "watch failed; retrying");
            }
            let delay = st.backoff.next().unwrap_or(Duration::from_secs(30));
            st.returns.borrow_and_update();
            let returned = async {
                if st.returns.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = returned => {
                    // A server that has just come back may not serve everything yet (a
                    // CRD still being loaded answers 404): start the backoff over, so the
                    // next retries come soon too.
                    st.backoff.reset();
                    debug!(kind = %st.kind, "the API server answers again: retrying the watch now");
                }
            }
        }
    })
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

async fn index_pods<S>(
    events: S,
    scope: Option<String>,
    index: PodIndex,
    sink: Arc<dyn Sink>,
    gate: SyncGate,
) where
    S: Stream<Item = Event<Pod>>,
{
    let mut events = std::pin::pin!(events);
    let mut relist: Option<PodTable> = None;
    let mut synced = false;
    while let Some(event) = events.next().await {
        match event {
            Event::Init => relist = Some(PodTable::default()),
            Event::InitApply(pod) => {
                if let (Some(table), Some((key, owner, entry))) = (relist.as_mut(), slim(&pod)) {
                    table.upsert(key, owner, entry);
                }
            }
            Event::InitDone => {
                let fresh = relist.take().unwrap_or_default();
                let owners = index
                    .0
                    .write()
                    .expect("pod index lock")
                    .replace_scope(scope.as_deref(), fresh);
                // Every owner that had or has pods may have new counts.
                for owner in owners {
                    sink.changed(owner, Trigger::Pod);
                }
                if !synced {
                    synced = true;
                    gate.done();
                }
            }
            Event::Apply(pod) => {
                let Some((key, owner, entry)) = slim(&pod) else {
                    continue;
                };
                let previous = index.0.write().expect("pod index lock").upsert(
                    key.clone(),
                    owner.clone(),
                    entry,
                );
                let verb = if previous.is_some() {
                    "updated"
                } else {
                    "created"
                };
                info!(pod = %key, myresource = %owner, ready = entry.ready, "Pod {verb}");
                if let Some(prev) = previous.filter(|p| *p != owner) {
                    sink.changed(prev, Trigger::Pod);
                }
                sink.changed(owner, Trigger::Pod);
            }
            Event::Delete(pod) => {
                let key = ObjectKey::new(pod.namespace().unwrap_or_default(), pod.name_any());
                if let Some(owner) = index.0.write().expect("pod index lock").remove(&key) {
                    info!(pod = %key, myresource = %owner, "Pod deleted");
                    sink.changed(owner, Trigger::Pod);
                }
            }
        }
    }
}

/// A Pod reduced to what the operator reads: its key, the MyResource its label names, and
/// whether its Ready condition is True.
fn slim(pod: &Pod) -> Option<(ObjectKey, ObjectKey, PodEntry)> {
    let namespace = pod.namespace()?;
    let owner = pod.labels().get(POD_LABEL)?.clone();
    let ready = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    Some((
        ObjectKey::new(namespace.clone(), pod.name_any()),
        ObjectKey::new(namespace, owner),
        PodEntry { ready },
    ))
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

    #[tokio::test(start_paused = true)]
    async fn a_failed_watch_is_retried_as_soon_as_the_api_server_answers_again() {
        let reachability = Reachability::default();
        let events = futures::stream::iter(vec![
            Err(watcher::Error::NoResourceVersion),
            Ok(Event::<ConfigMap>::InitDone),
        ]);
        let mut events = Box::pin(retried(
            events,
            reachability.subscribe(),
            "ConfigMap".into(),
        ));
        let started = tokio::time::Instant::now();
        let r = reachability.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            r.record(None);
            r.record(Some(200));
        });
        assert!(matches!(events.next().await, Some(Event::InitDone)));
        // kube's first backoff step is 800 ms; the return cut it short.
        let waited = started.elapsed();
        assert!(waited < Duration::from_millis(500), "{waited:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_return_a_failed_watch_waits_its_backoff() {
        let events = futures::stream::iter(vec![
            Err(watcher::Error::NoResourceVersion),
            Ok(Event::<ConfigMap>::InitDone),
        ]);
        let reachability = Reachability::default();
        let mut events = Box::pin(retried(
            events,
            reachability.subscribe(),
            "ConfigMap".into(),
        ));
        let started = tokio::time::Instant::now();
        assert!(matches!(events.next().await, Some(Event::InitDone)));
        assert!(started.elapsed() >= Duration::from_millis(500));
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

    fn k(name: &str) -> ObjectKey {
        ObjectKey::new("ns", name)
    }

    #[test]
    fn pod_table_counts_and_moves_pods_between_owners() {
        let mut t = PodTable::default();
        assert_eq!(t.upsert(k("p1"), k("a"), PodEntry { ready: true }), None);
        t.upsert(k("p2"), k("a"), PodEntry { ready: false });
        t.upsert(k("p3"), k("b"), PodEntry { ready: true });
        assert_eq!(t.counts(&k("a")), PodCounts { total: 2, ready: 1 });
        // Relabelled from a to b.
        assert_eq!(
            t.upsert(k("p2"), k("b"), PodEntry { ready: true }),
            Some(k("a"))
        );
        assert_eq!(t.counts(&k("a")), PodCounts { total: 1, ready: 1 });
        assert_eq!(t.counts(&k("b")), PodCounts { total: 2, ready: 2 });
        assert_eq!(t.remove(&k("p1")), Some(k("a")));
        assert_eq!(t.counts(&k("a")), PodCounts::default());
        assert!(!t.by_owner.contains_key(&k("a")));
        assert_eq!(t.remove(&k("p1")), None);
    }

    #[test]
    fn a_relist_replaces_only_its_namespace() {
        let mut t = PodTable::default();
        t.upsert(k("p1"), k("a"), PodEntry { ready: true });
        t.upsert(
            ObjectKey::new("other", "p9"),
            ObjectKey::new("other", "z"),
            PodEntry { ready: true },
        );
        let mut fresh = PodTable::default();
        fresh.upsert(k("p2"), k("b"), PodEntry { ready: false });
        let owners = t.replace_scope(Some("ns"), fresh);
        assert_eq!(owners, vec![k("a"), k("b")]);
        assert_eq!(t.counts(&k("a")), PodCounts::default());
        assert_eq!(t.counts(&k("b")), PodCounts { total: 1, ready: 0 });
        assert_eq!(t.counts(&ObjectKey::new("other", "z")).total, 1);
    }

    #[test]
    fn slim_reads_label_and_readiness() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "labels": {POD_LABEL: "mine"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let (key, owner, entry) = slim(&pod).unwrap();
        assert_eq!((key, owner, entry.ready), (k("p"), k("mine"), true));
        let unlabelled: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"}
        }))
        .unwrap();
        assert!(slim(&unlabelled).is_none());
    }
}
