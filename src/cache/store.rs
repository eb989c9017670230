//! A reflector store per watched scope (a namespace or all of them, and in scale-out mode
//! one shard), read as one.

use std::sync::{Arc, RwLock};

use kube::Resource;
use kube::runtime::reflector::{self, Store};

use super::Scope;
use crate::key::ObjectKey;

/// A reflector store per watched scope.
///
/// kube-runtime's `Writer` buffers a re-list between `Init` and `InitDone`; merging the
/// watch streams of several scopes into one writer would let one scope's `InitDone` swap in
/// a buffer holding only part of another's objects. So each scope has its own. Scopes come
/// and go as a replica's shards do; each object is in at most one scope.
#[derive(Clone)]
pub struct NamespacedStore<K: 'static + kube::runtime::reflector::Lookup<DynamicType = ()> + Clone>
{
    stores: Arc<RwLock<Scoped<K>>>,
}

/// Each scope's store.
type Scoped<K> = Vec<(Scope, Store<K>)>;

impl<K: 'static + kube::runtime::reflector::Lookup<DynamicType = ()> + Clone> Default
    for NamespacedStore<K>
{
    fn default() -> Self {
        NamespacedStore {
            stores: Arc::default(),
        }
    }
}

impl<K> NamespacedStore<K>
where
    K: 'static + Resource<DynamicType = ()> + Clone,
{
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Scoped<K>> {
        self.stores.read().expect("store list lock")
    }

    pub(super) fn add(&self, scope: Scope, store: Store<K>) {
        self.stores
            .write()
            .expect("store list lock")
            .push((scope, store));
    }

    /// Forgets the stores of the scopes `drop` picks.
    pub(super) fn remove(&self, drop: impl Fn(&Scope) -> bool) {
        self.stores
            .write()
            .expect("store list lock")
            .retain(|(scope, _)| !drop(scope));
    }

    /// The cached object `namespace/name`.
    pub fn get(&self, key: &ObjectKey) -> Option<Arc<K>> {
        let reference = reflector::ObjectRef::new(&key.name).within(&key.namespace);
        self.read()
            .iter()
            .filter(|(scope, _)| {
                scope
                    .namespace
                    .as_deref()
                    .is_none_or(|ns| ns == key.namespace)
            })
            .find_map(|(_, store)| store.get(&reference))
    }

    /// Every cached object.
    pub fn state(&self) -> Vec<Arc<K>> {
        self.read().iter().flat_map(|(_, s)| s.state()).collect()
    }

    /// Every cached object of the scopes `pick` picks.
    pub fn state_of(&self, pick: impl Fn(&Scope) -> bool) -> Vec<Arc<K>> {
        self.read()
            .iter()
            .filter(|(scope, _)| pick(scope))
            .flat_map(|(_, s)| s.state())
            .collect()
    }

    /// How many objects are cached.
    pub fn len(&self) -> usize {
        self.read().iter().map(|(_, s)| s.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
