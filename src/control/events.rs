//! Events (`events.k8s.io/v1`) about MyResources, published the way client-go's events
//! recorder does: the first occurrence creates an Event; a repeat of the same event (same
//! object, type, reason and action, from this replica) within [`SERIES_WINDOW`] of the last
//! one patches that Event's `series` (count, lastObservedTime) instead of creating another,
//! so `kubectl describe` shows "(x3 over 2m)" rather than three lines.
//!
//! Invariants:
//! - the memory of recent events ([`Recent`], pure, tested with a fake clock) forgets
//!   expired entries in a sweep that runs at most once per [`SWEEP_EVERY`], so a publish
//!   costs O(1) amortized however many objects there are. (kube's `Recorder` sweeps its
//!   whole cache on every publish under a lock that every worker shares: at 10,000 objects
//!   that was the largest single item in the operator's CPU profile.)
//! - its lock is never held across a request;
//! - a failed create is forgotten, so the next occurrence creates again; a series patch
//!   that finds its Event gone (404) or changed (409) creates a new one;
//! - every write is conditional: a series patch carries the resourceVersion this replica's
//!   last write of the Event left (while that write's outcome is unknown, the next
//!   occurrence creates a new Event instead), so a late patch from an earlier term cannot
//!   overwrite a later one.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

/// A repeat within this long of the previous occurrence joins its series (client-go: 6 min).
pub const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);
/// How often expired entries are swept from [`Recent`].
pub const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// Normal or Warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// What makes two events "the same" for a series.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    /// The regarding object's namespace, name and uid.
    pub object: (String, String, String),
    pub type_: EventType,
    pub reason: String,
    pub action: String,
}

/// What a publish should do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Create an Event with the name given to [`Recent::observe`].
    Create,
    /// Patch the series of the Event `name` to `count` occurrences, on condition that it
    /// is still at `resource_version` (as this replica last wrote it).
    Series {
        name: String,
        count: i32,
        resource_version: String,
    },
}

#[derive(Debug)]
struct Seen {
    name: String,
    count: i32,
    last: Instant,
    /// As this replica's last write of the Event left it; `None` while that write is in
    /// flight or if its answer was lost.
    resource_version: Option<String>,
}

/// Recently published events, by key.
#[derive(Debug)]
pub struct Recent {
    seen: HashMap<Key, Seen>,
    next_sweep: Instant,
}

impl Recent {
    pub fn new(now: Instant) -> Self {
        Recent {
            seen: HashMap::new(),
            next_sweep: now + SWEEP_EVERY,
        }
    }

    /// Records an occurrence of `key` at `now`; `fresh_name` names the Event if a new one
    /// is to be created.
    pub fn observe(&mut self, key: Key, fresh_name: &str, now: Instant) -> Decision {
        if now >= self.next_sweep {
            self.seen
                .retain(|_, s| now.saturating_duration_since(s.last) < SERIES_WINDOW);
            self.next_sweep = now + SWEEP_EVERY;
        }
        // A repeat within the window joins the series, on condition that its Event is as our
        // last write left it; while that write's outcome is unknown no condition can be put
        // on a patch, so a new Event starts, as after the window.
        if let Some(s) = self
            .seen
            .get_mut(&key)
            .filter(|s| now.saturating_duration_since(s.last) < SERIES_WINDOW)
            && let Some(resource_version) = s.resource_version.take()
        {
            s.count += 1;
            s.last = now;
            return Decision::Series {
                name: s.name.clone(),
                count: s.count,
                resource_version,
            };
        }
        let seen = Seen {
            name: fresh_name.to_string(),
            count: 1,
            last: now,
            resource_version: None,
        };
        self.seen.insert(key, seen);
        Decision::Create
    }

    /// Records that this replica's write of the Event `name` for `key` left it at
    /// `resource_version` (the next occurrence patches it on that condition).
    pub fn written(&mut self, key: &Key, name: &str, resource_version: Option<String>) {
        if let Some(s) = self.seen.get_mut(key).filter(|s| s.name == name) {
            s.resource_version = resource_version;
        }
    }

    /// Forgets `key` (its Event could not be created, or is gone).
    pub fn forget(&mut self, key: &Key) {
        self.seen.remove(key);
    }

    /// How many keys are remembered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.seen.len()
    }
}

/// Publishes Events for one replica.
pub struct Publisher {
    client: Client,
    controller: String,
    instance: String,
    recent: Mutex<Recent>,
}

impl Publisher {
    /// `controller` is the `reportingController`, `instance` the `reportingInstance` (the
    /// replica's identity).
    pub fn new(client: Client, controller: &str, instance: &str) -> Self {
        Publisher {
            client,
            controller: controller.into(),
            instance: instance.into(),
            recent: Mutex::new(Recent::new(Instant::now())),
        }
    }

    /// Publishes one occurrence of an event about `regarding`.
    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: &str,
    ) -> Result<(), kube::Error> {
        let namespace = regarding.namespace.clone().unwrap_or_default();
        let name = regarding.name.clone().unwrap_or_default();
        let key = Key {
            object: (
                namespace.clone(),
                name.clone(),
                regarding.uid.clone().unwrap_or_default(),
            ),
            type_,
            reason: reason.into(),
            action: action.into(),
        };
        let now = Timestamp::now();
        let fresh_name = format!("{name}.{:x}", now.as_nanosecond());
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        let decision = self.remember(|r| r.observe(key.clone(), &fresh_name, Instant::now()));
        if let Decision::Series {
            name,
            count,
            resource_version,
        } = decision
        {
            let series = EventSeries {
                count,
                last_observed_time: MicroTime(now),
            };
            // The resourceVersion makes the merge patch conditional, as every other write.
            let patch = json!({
                "metadata": {"resourceVersion": resource_version},
                "series": series,
            });
            match api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(event) => {
                    self.remember(|r| r.written(&key, &name, event.metadata.resource_version));
                    return Ok(());
                }
                Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                    // Expired, deleted, or changed by another write: start again with a
                    // new Event.
                    self.remember(|r| {
                        r.forget(&key);
                        r.observe(key.clone(), &fresh_name, Instant::now())
                    });
                }
                Err(err) => return Err(err),
            }
        }
        let event = Event {
            metadata: ObjectMeta {
                name: Some(fresh_name),
                namespace: Some(namespace),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            type_: Some(type_.as_str().into()),
            reason: Some(reason.into()),
            action: Some(action.into()),
            note: Some(note.into()),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            ..Default::default()
        };
        match api.create(&PostParams::default(), &event).await {
            Ok(created) => {
                let name = created.metadata.name.unwrap_or_default();
                self.remember(|r| r.written(&key, &name, created.metadata.resource_version));
                Ok(())
            }
            Err(err) => {
                self.remember(|r| r.forget(&key));
                Err(err)
            }
        }
    }

    fn remember<T>(&self, f: impl FnOnce(&mut Recent) -> T) -> T {
        f(&mut self.recent.lock().expect("recent events lock"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(reason: &str) -> Key {
        Key {
            object: ("ns".into(), "a".into(), "uid-a".into()),
            type_: EventType::Normal,
            reason: reason.into(),
            action: "Reconcile".into(),
        }
    }

    #[test]
    fn a_repeat_within_the_window_joins_the_series_of_the_first() {
        let t0 = Instant::now();
        let mut recent = Recent::new(t0);
        assert_eq!(recent.observe(key("R"), "a.1", t0), Decision::Create);
        recent.written(&key("R"), "a.1", Some("10".into()));
        let t1 = t0 + Duration::from_secs(60);
        let series = |count, rv: &str| Decision::Series {
            name: "a.1".into(),
            count,
            resource_version: rv.into(),
        };
        assert_eq!(recent.observe(key("R"), "a.2", t1), series(2, "10"));
        recent.written(&key("R"), "a.1", Some("11".into()));
        // The window runs from the last occurrence, not the first.
        let t2 = t1 + SERIES_WINDOW - Duration::from_secs(1);
        assert_eq!(recent.observe(key("R"), "a.3", t2), series(3, "11"));
        // Another reason is another event.
        assert_eq!(recent.observe(key("Other"), "a.4", t2), Decision::Create);
    }

    #[test]
    fn after_the_window_a_new_event_is_created() {
        let t0 = Instant::now();
        let mut recent = Recent::new(t0);
        recent.observe(key("R"), "a.1", t0);
        recent.written(&key("R"), "a.1", Some("1".into()));
        assert_eq!(
            recent.observe(key("R"), "a.2", t0 + SERIES_WINDOW),
            Decision::Create
        );
        // A late answer about the old Event changes nothing.
        recent.written(&key("R"), "a.1", Some("5".into()));
        recent.written(&key("R"), "a.2", Some("2".into()));
        assert_eq!(
            recent.observe(key("R"), "a.3", t0 + SERIES_WINDOW + Duration::from_secs(1)),
            Decision::Series {
                name: "a.2".into(),
                count: 2,
                resource_version: "2".into(),
            }
        );
    }

    /// Issue 30, hole 3: every write is conditional, series patches too. A patch goes out
    /// only with the resourceVersion this replica's last write of the Event left; while
    /// that write's outcome is unknown, the next occurrence creates a new Event instead.
    #[test]
    fn a_series_patch_is_conditional_on_the_last_write() {
        let t0 = Instant::now();
        let mut recent = Recent::new(t0);
        recent.observe(key("R"), "a.1", t0);
        // The create's answer has not come (or was lost): no patch without a condition.
        assert_eq!(recent.observe(key("R"), "a.2", t0), Decision::Create);
        recent.written(&key("R"), "a.2", Some("7".into()));
        let Decision::Series {
            resource_version, ..
        } = recent.observe(key("R"), "a.3", t0)
        else {
            panic!("expected a series patch")
        };
        assert_eq!(resource_version, "7");
        // That patch is in flight: the next occurrence cannot reuse its condition.
        assert_eq!(recent.observe(key("R"), "a.4", t0), Decision::Create);
    }

    #[test]
    fn expired_entries_are_swept_at_most_once_per_sweep_interval() {
        let t0 = Instant::now();
        let secs = Duration::from_secs;
        let mut recent = Recent::new(t0);
        for i in 0..100 {
            let mut k = key("R");
            k.object.1 = format!("o{i}");
            recent.observe(k, "x", t0);
        }
        // One sweep, once due, clears every expired entry.
        recent.observe(key("fresh"), "f", t0 + SERIES_WINDOW + SWEEP_EVERY);
        assert_eq!(recent.len(), 1);

        let mut recent = Recent::new(t0);
        recent.observe(key("R"), "r", t0);
        // A sweep runs here (due since t0 + SWEEP_EVERY); R is still fresh.
        recent.observe(key("X"), "x", t0 + SERIES_WINDOW - secs(1));
        // R has expired, but the next sweep is not due yet: it is still remembered...
        recent.observe(key("Y"), "y", t0 + SERIES_WINDOW + secs(1));
        assert_eq!(recent.len(), 3);
        // ...and never joined: an expired entry starts a new Event, swept or not.
        assert_eq!(
            recent.observe(key("R"), "r2", t0 + SERIES_WINDOW + secs(2)),
            Decision::Create
        );
    }

    #[test]
    fn a_forgotten_key_creates_again() {
        let t0 = Instant::now();
        let mut recent = Recent::new(t0);
        recent.observe(key("R"), "a.1", t0);
        recent.forget(&key("R"));
        assert_eq!(recent.len(), 0);
        assert_eq!(recent.observe(key("R"), "a.2", t0), Decision::Create);
    }
}
