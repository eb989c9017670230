//! A reflector store per watched namespace (or one for all namespaces), read as one.

use std::sync::Arc;

use kube::Resource;
use kube::runtime::reflector::{self, Store};

use crate::key::ObjectKey;

/// A reflector store per watched namespace (or one for all namespaces).
///
/// kube-runtime's `Writer` buffers a re-list between `Init` and `InitDone`; merging the
/// watch streams of several namespaces into one writer would let one namespace's `InitDone`
/// swap in a buffer holding only part of another's objects. So each namespace has its own.
#[derive(Clone)]
pub struct NamespacedStore<K: 'static + kube::runtime::reflector::Lookup<DynamicType = ()> + Clone>
{
    pub(super) stores: Vec<(Option<String>, Store<K>)>,
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
