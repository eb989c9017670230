//! Warm stores for kube-runtime's `Controller`: a reflector that runs on every replica,
//! leading or not, so that a new term starts from a full cache instead of a LIST, and a
//! trigger stream per term.
//!
//! kube-runtime starts a `Controller`'s watches when the controller starts, so a controller
//! started at the beginning of a term lists everything first. With a [`Warm`] store per
//! kind, started once at process start, the term's controller is built with
//! `Controller::for_shared_stream(warm.trigger(), warm.store())` (and
//! `owns_shared_stream` / `watches_shared_stream` for the others; kube's
//! `unstable-runtime-subscribe` feature): it reconciles every cached object at once and
//! then every change.
//!
//! Invariants: [`Warm::trigger`] subscribes to changes *before* it reads the store, so no
//! change between the two is lost; a term that falls behind by more than the channel holds
//! is given the whole store again (reconciles are idempotent), never a gap.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::broadcast;
use tokio::task::AbortHandle;

/// How many changes a term's trigger may fall behind before it is given the whole store.
const BUFFER: usize = 4096;

/// A reflector store kept warm on every replica, and the changes it sees.
pub struct Warm<K>
where
    K: Resource + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    store: Store<K>,
    changes: broadcast::Sender<Arc<K>>,
    task: AbortHandle,
}

impl<K> Warm<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    /// Starts watching `api` with `config` (kube's default backoff on failures); stops when
    /// dropped.
    pub fn start(api: Api<K>, config: watcher::Config) -> Self {
        let (store, writer) = reflector::store();
        let (changes, _) = broadcast::channel(BUFFER);
        let sender = changes.clone();
        let task = tokio::spawn(
            watcher(api, config)
                .default_backoff()
                .reflect(writer)
                .touched_objects()
                .for_each(move |object| {
                    if let Ok(object) = object {
                        // No receiver (no term runs): nothing to tell.
                        let _ = sender.send(Arc::new(object));
                    }
                    futures::future::ready(())
                }),
        )
        .abort_handle();
        Warm {
            store,
            changes,
            task,
        }
    }

    /// The store (a reader of it): give it to the controller, and read it in reconciles.
    pub fn store(&self) -> Store<K> {
        self.store.clone()
    }

    /// A term's trigger: every object in the store, then every change (a deletion too, as
    /// the object last seen). Call it once per term.
    pub fn trigger(&self) -> impl Stream<Item = Arc<K>> + Send + 'static {
        let changes = self.changes.subscribe();
        let store = self.store.clone();
        let first = store.state();
        futures::stream::iter(first).chain(
            futures::stream::unfold((changes, store), |(mut changes, store)| async move {
                match changes.recv().await {
                    Ok(object) => Some((vec![object], (changes, store))),
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let all = store.state();
                        Some((all, (changes, store)))
                    }
                    Err(broadcast::error::RecvError::Closed) => None,
                }
            })
            .flat_map(futures::stream::iter),
        )
    }
}

impl<K> Drop for Warm<K>
where
    K: Resource + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    fn drop(&mut self) {
        self.task.abort();
    }
}
