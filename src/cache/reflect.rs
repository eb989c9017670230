//! The one loop every watch runs through: apply each event to its [`Mirror`] (a reflector
//! store, or the slim Pod index), report what changed once the mirror shows it, and count
//! the first complete list towards [`Caches::synced`](super::Caches::synced).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::reflector::Store;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher::Event;
use tokio::sync::watch;
use tracing::{debug, info};

use super::{Change, Observed, Sink, Trigger};
use crate::key::ObjectKey;

/// Where one watch's events land.
pub(super) trait Mirror<K> {
    /// Applies `event`; then, with the mirror already showing it, calls `report` for every
    /// MyResource the event may have changed and what was observed of the object.
    fn apply(&mut self, event: Event<K>, report: &mut dyn FnMut(ObjectKey, Observed));
}

/// Counts the watches that have not finished their first list; flips `synced` at zero.
#[derive(Clone)]
pub(super) struct SyncGate {
    remaining: Arc<AtomicUsize>,
    synced: Arc<watch::Sender<bool>>,
}

impl SyncGate {
    /// A gate for `watches` watches, and the flag it flips.
    pub(super) fn new(watches: usize) -> (SyncGate, watch::Receiver<bool>) {
        let (synced, rx) = watch::channel(false);
        let gate = SyncGate {
            remaining: Arc::new(AtomicUsize::new(watches)),
            synced: Arc::new(synced),
        };
        (gate, rx)
    }

    fn done(&self) {
        if self.remaining.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.synced.send_replace(true);
            info!("caches synced");
        }
    }
}

/// Runs one watch until its stream ends: every event into `mirror`, every change to `sink`
/// as `trigger`. Only the first complete list counts towards the gate; later re-lists keep
/// the caches synced.
pub(super) async fn reflect<K, S, M>(
    events: S,
    mut mirror: M,
    trigger: Trigger,
    sink: Arc<dyn Sink>,
    gate: SyncGate,
) where
    S: Stream<Item = Event<K>>,
    M: Mirror<K>,
{
    let mut events = std::pin::pin!(events);
    let mut synced = false;
    while let Some(event) = events.next().await {
        let list_done = matches!(event, Event::InitDone);
        mirror.apply(event, &mut |key, observed| {
            sink.changed(Change {
                key,
                trigger,
                observed,
            })
        });
        if list_done && !synced {
            synced = true;
            debug!(trigger = trigger.as_str(), "initial list complete");
            gate.done();
        }
    }
}

/// A kube-runtime reflector store as a [`Mirror`]: changes reported by `key_of` (the
/// MyResource an object belongs to; objects without one are cached, never reported).
///
/// Invariant: a re-list is reported at `InitDone`, after the writer has swapped in the new
/// list, for every object in the store before it or after it: reporting at `InitApply`
/// would let a worker read the store before the swap, find the old object up to date and
/// never look again (the chaos suite caught this after an API server restart).
pub(super) struct StoreMirror<K: Resource<DynamicType = ()> + Clone + 'static> {
    writer: Writer<K>,
    reader: Store<K>,
    before_relist: Vec<Arc<K>>,
    key_of: fn(&K) -> Option<ObjectKey>,
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> StoreMirror<K> {
    pub(super) fn new(writer: Writer<K>, key_of: fn(&K) -> Option<ObjectKey>) -> Self {
        StoreMirror {
            reader: writer.as_reader(),
            writer,
            before_relist: Vec::new(),
            key_of,
        }
    }
}

impl<K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + 'static> Mirror<K>
    for StoreMirror<K>
{
    fn apply(&mut self, event: Event<K>, report: &mut dyn FnMut(ObjectKey, Observed)) {
        if matches!(event, Event::Init) {
            self.before_relist = self.reader.state();
        }
        self.writer.apply_watcher_event(&event);
        let key_of = self.key_of;
        match event {
            Event::Apply(object) => {
                if let Some(key) = key_of(&object) {
                    let resource_version = object.meta().resource_version.clone();
                    report(key, Observed::Applied { resource_version });
                }
            }
            Event::Delete(object) => {
                if let Some(key) = key_of(&object) {
                    info!(kind = K::kind(&()).as_ref(), myresource = %key, "deleted");
                    report(key, Observed::Deleted);
                }
            }
            Event::Init | Event::InitApply(_) => {}
            Event::InitDone => {
                for object in self.before_relist.drain(..).chain(self.reader.state()) {
                    if let Some(key) = key_of(&object) {
                        report(key, Observed::Relisted);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::ResourceExt;
    use kube::runtime::reflector;

    fn cm(name: &str, rv: &str) -> ConfigMap {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(name.into());
        cm.metadata.namespace = Some("ns".into());
        cm.metadata.resource_version = Some(rv.into());
        cm
    }

    fn key_of_itself(cm: &ConfigMap) -> Option<ObjectKey> {
        Some(ObjectKey::new(cm.namespace()?, cm.name_any()))
    }

    /// Records each change with the resourceVersion the store held for it at that moment.
    struct Recorder {
        store: Store<ConfigMap>,
        seen: std::sync::Mutex<Vec<(String, String, Option<String>)>>,
    }

    impl Sink for Recorder {
        fn changed(&self, change: Change) {
            let what = match change.observed {
                Observed::Applied { .. } => "applied",
                Observed::Deleted => "deleted",
                Observed::Relisted => "relisted",
            };
            let in_store = self
                .store
                .get(&reflector::ObjectRef::new(&change.key.name).within("ns"))
                .and_then(|c| c.resource_version());
            self.seen
                .lock()
                .unwrap()
                .push((what.to_string(), change.key.name, in_store));
        }
    }

    /// Runs `events` through [`reflect`] into a store; returns the changes reported, sorted.
    async fn reflected(
        events: Vec<Event<ConfigMap>>,
    ) -> (Vec<(String, String, Option<String>)>, bool) {
        let (store, writer) = reflector::store::<ConfigMap>();
        let (gate, synced) = SyncGate::new(1);
        let recorder = Arc::new(Recorder {
            store,
            seen: Default::default(),
        });
        let mirror = StoreMirror::new(writer, key_of_itself);
        let stream = futures::stream::iter(events);
        reflect(stream, mirror, Trigger::ConfigMap, recorder.clone(), gate).await;
        // Store order is hash order: compare sorted.
        let mut seen = recorder.seen.lock().unwrap().clone();
        seen.sort();
        (seen, *synced.borrow())
    }

    #[tokio::test]
    async fn a_relist_is_reported_once_the_store_holds_it_for_old_and_new_objects() {
        let (seen, synced) = reflected(vec![
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
            row("relisted", "a", Some("1")),
            row("relisted", "b", Some("1")),
            row("applied", "a", Some("2")),
            row("relisted", "a", Some("3")),
            row("relisted", "a", Some("3")),
            row("relisted", "b", None),
        ];
        want.sort();
        assert_eq!(seen, want);
        assert!(synced, "the first complete list opens the gate");
    }

    #[tokio::test]
    async fn the_gate_stays_shut_until_every_watch_has_listed_once() {
        let (gate, synced) = SyncGate::new(2);
        let (_store, writer) = reflector::store::<ConfigMap>();
        let mirror = StoreMirror::new(writer, key_of_itself);
        let sink: Arc<dyn Sink> = Arc::new(Recorder {
            store: reflector::store::<ConfigMap>().0,
            seen: Default::default(),
        });
        let events = futures::stream::iter(vec![
            Event::Init,
            Event::InitDone,
            Event::Init,
            Event::InitDone,
        ]);
        reflect(events, mirror, Trigger::ConfigMap, sink, gate).await;
        assert!(
            !*synced.borrow(),
            "one of two watches listed (twice): not synced"
        );
    }
}
