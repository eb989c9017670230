//! The slim Pod index: labelled Pods reduced to the MyResource they name and whether they
//! are Ready (a k8s-openapi `Pod` is ≈2.5 KiB even when empty), kept as a mirror of the Pod
//! watch.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::runtime::watcher::Event;
use tracing::info;

use super::Observed;
use super::reflect::Mirror;
use crate::key::ObjectKey;
use crate::resource::{POD_LABEL, PodCounts};

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

/// The Pod index of one watched namespace (or all) as a [`Mirror`] of its watch: Pods are
/// reduced by [`slim`] as they arrive; a re-list is built aside and swapped in at its end.
pub(super) struct PodMirror {
    scope: Option<String>,
    index: PodIndex,
    relist: Option<PodTable>,
}

impl PodMirror {
    pub(super) fn new(scope: Option<String>, index: PodIndex) -> Self {
        PodMirror {
            scope,
            index,
            relist: None,
        }
    }
}

impl Mirror<Pod> for PodMirror {
    fn apply(&mut self, event: Event<Pod>, report: &mut dyn FnMut(ObjectKey, Observed)) {
        match event {
            Event::Init => self.relist = Some(PodTable::default()),
            Event::InitApply(pod) => {
                if let (Some(table), Some((key, owner, entry))) = (self.relist.as_mut(), slim(&pod))
                {
                    table.upsert(key, owner, entry);
                }
            }
            Event::InitDone => {
                let fresh = self.relist.take().unwrap_or_default();
                let owners = self
                    .index
                    .0
                    .write()
                    .expect("pod index lock")
                    .replace_scope(self.scope.as_deref(), fresh);
                // Every owner that had or has pods may have new counts.
                for owner in owners {
                    report(owner, Observed::Relisted);
                }
            }
            Event::Apply(pod) => {
                let Some((key, owner, entry)) = slim(&pod) else {
                    return;
                };
                let previous = self.index.0.write().expect("pod index lock").upsert(
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
                let resource_version = pod.resource_version();
                if let Some(prev) = previous.filter(|p| *p != owner) {
                    let resource_version = resource_version.clone();
                    report(prev, Observed::Applied { resource_version });
                }
                report(owner, Observed::Applied { resource_version });
            }
            Event::Delete(pod) => {
                let key = ObjectKey::new(pod.namespace().unwrap_or_default(), pod.name_any());
                if let Some(owner) = self.index.0.write().expect("pod index lock").remove(&key) {
                    info!(pod = %key, myresource = %owner, "Pod deleted");
                    report(owner, Observed::Deleted);
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
