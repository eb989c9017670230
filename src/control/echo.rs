//! The echo filter, the step between the caches and the controller: drops the echoes of
//! the operator's own writes. A write's result comes back on the watch, and
//! reconciling that echo would only find nothing to do. A 10,000-object cold start would
//! run three reconciles per object (the create, the ConfigMap's echo, the status echo)
//! where one suffices; the CPU they take is CPU the API server, on the same cores in a
//! small cluster, does not get.
//!
//! Invariants:
//! - an event is an echo only if it carries exactly the resourceVersion the API server
//!   returned for our write: any other change (someone else's write, a re-list) still
//!   triggers a reconcile;
//! - at most one entry per object: a newer write replaces it, and the next event for the
//!   object removes it, echo or not — so the memory is bounded by the number of objects;
//! - losing a race (the echo arrives before the write's response is recorded) costs one
//!   reconcile that finds nothing to do, never a missed change;
//! - Pods are never echoes (the operator does not write them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::cache::{Change, Observed, Sink, Trigger};
use crate::key::ObjectKey;

/// The kinds the operator writes and watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    MyResource,
    ConfigMap,
}

/// The resourceVersion of the last write of ours to each object, until its echo arrives:
/// one map per [`Kind`], so a lookup on every watch event needs no key of its own.
#[derive(Debug, Default)]
pub struct Echoes {
    written: Mutex<[HashMap<ObjectKey, String>; 2]>,
}

impl Echoes {
    /// Records a successful write of ours and the resourceVersion it produced.
    pub fn wrote(&self, kind: Kind, key: &ObjectKey, resource_version: Option<String>) {
        if let Some(rv) = resource_version {
            self.with(kind, |written| written.insert(key.clone(), rv));
        }
    }

    /// Whether an observed change of the object is the echo of our last write to it.
    /// Forgets that write either way: only the next event can be its echo.
    pub fn is_echo(&self, kind: Kind, key: &ObjectKey, resource_version: Option<&str>) -> bool {
        let written = self.with(kind, |written| written.remove(key));
        written.is_some() && written.as_deref() == resource_version
    }

    /// Forgets the last write to the object (it was deleted or re-listed).
    pub fn forget(&self, kind: Kind, key: &ObjectKey) {
        self.with(kind, |written| written.remove(key));
    }

    fn with<T>(&self, kind: Kind, f: impl FnOnce(&mut HashMap<ObjectKey, String>) -> T) -> T {
        f(&mut self.written.lock().expect("echoes lock")[kind as usize])
    }

    /// How many writes await their echo.
    #[cfg(test)]
    fn len(&self) -> usize {
        let written = self.written.lock().expect("echoes lock");
        written.iter().map(HashMap::len).sum()
    }
}

/// Passes every change of the caches on to `next`, except the echoes of our writes.
pub struct EchoFilter {
    echoes: Arc<Echoes>,
    next: Arc<dyn Sink>,
}

impl EchoFilter {
    /// A filter of the writes recorded in `echoes`, in front of `next`.
    pub fn new(echoes: Arc<Echoes>, next: Arc<dyn Sink>) -> Self {
        EchoFilter { echoes, next }
    }
}

impl Sink for EchoFilter {
    fn changed(&self, change: Change) {
        let kind = match change.trigger {
            Trigger::MyResource => Kind::MyResource,
            Trigger::ConfigMap => Kind::ConfigMap,
            Trigger::Pod => return self.next.changed(change),
        };
        match &change.observed {
            Observed::Applied { resource_version } => {
                if self
                    .echoes
                    .is_echo(kind, &change.key, resource_version.as_deref())
                {
                    return;
                }
            }
            Observed::Deleted | Observed::Relisted => self.echoes.forget(kind, &change.key),
        }
        self.next.changed(change);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> ObjectKey {
        ObjectKey::new("ns", name)
    }

    #[test]
    fn only_the_exact_resource_version_of_our_write_is_an_echo() {
        let echoes = Echoes::default();
        echoes.wrote(Kind::MyResource, &key("a"), Some("12".into()));
        assert!(!echoes.is_echo(Kind::ConfigMap, &key("a"), Some("12")));
        assert!(!echoes.is_echo(Kind::MyResource, &key("b"), Some("12")));
        assert!(echoes.is_echo(Kind::MyResource, &key("a"), Some("12")));
        // Consumed: the same state seen again (a re-list) is not an echo.
        assert!(!echoes.is_echo(Kind::MyResource, &key("a"), Some("12")));
        assert_eq!(echoes.len(), 0);
    }

    #[test]
    fn any_other_event_for_the_object_forgets_the_write() {
        let echoes = Echoes::default();
        // Someone else wrote after us (or the echo came before we recorded the write).
        echoes.wrote(Kind::ConfigMap, &key("a"), Some("12".into()));
        assert!(!echoes.is_echo(Kind::ConfigMap, &key("a"), Some("13")));
        assert!(!echoes.is_echo(Kind::ConfigMap, &key("a"), Some("12")));
        // Deleted or re-listed.
        echoes.wrote(Kind::ConfigMap, &key("b"), Some("14".into()));
        echoes.forget(Kind::ConfigMap, &key("b"));
        assert!(!echoes.is_echo(Kind::ConfigMap, &key("b"), Some("14")));
        assert_eq!(echoes.len(), 0);
    }

    #[test]
    fn a_newer_write_replaces_the_older() {
        let echoes = Echoes::default();
        echoes.wrote(Kind::MyResource, &key("a"), Some("12".into()));
        echoes.wrote(Kind::MyResource, &key("a"), Some("15".into()));
        assert_eq!(echoes.len(), 1);
        assert!(echoes.is_echo(Kind::MyResource, &key("a"), Some("15")));
    }

    /// Collects what passes the filter.
    #[derive(Default)]
    struct Passed(Mutex<Vec<(Trigger, String)>>);

    impl Sink for Passed {
        fn changed(&self, change: Change) {
            self.0
                .lock()
                .unwrap()
                .push((change.trigger, change.key.name));
        }
    }

    #[test]
    fn the_filter_drops_only_echoes_and_passes_pods_deletes_and_relists() {
        let echoes = Arc::new(Echoes::default());
        let passed = Arc::new(Passed::default());
        let filter = EchoFilter::new(echoes.clone(), passed.clone());
        let applied = |trigger, name: &str, rv: &str| Change {
            key: key(name),
            trigger,
            observed: Observed::Applied {
                resource_version: Some(rv.into()),
            },
        };
        echoes.wrote(Kind::ConfigMap, &key("a"), Some("5".into()));
        echoes.wrote(Kind::MyResource, &key("b"), Some("6".into()));
        echoes.wrote(Kind::ConfigMap, &key("c"), Some("7".into()));
        filter.changed(applied(Trigger::ConfigMap, "a", "5")); // echo: dropped
        filter.changed(applied(Trigger::MyResource, "b", "9")); // someone else's: passed
        filter.changed(applied(Trigger::Pod, "a", "5")); // Pods: passed
        filter.changed(Change {
            key: key("c"),
            trigger: Trigger::ConfigMap,
            observed: Observed::Relisted,
        }); // passed, and the recorded write forgotten
        filter.changed(applied(Trigger::ConfigMap, "c", "7"));
        assert_eq!(
            *passed.0.lock().unwrap(),
            vec![
                (Trigger::MyResource, "b".to_string()),
                (Trigger::Pod, "a".to_string()),
                (Trigger::ConfigMap, "c".to_string()),
                (Trigger::ConfigMap, "c".to_string()),
            ]
        );
        assert_eq!(echoes.len(), 0);
    }
}
