//! The simulated API server's storage: Leases with resourceVersions and preconditions,
//! their watch history, the objects the leaders write, and the order in which every change
//! took effect (what the checker judges).
//!
//! Invariants, as the real API server keeps them: one resourceVersion counter for
//! everything; a replace applies only with the current resourceVersion, a create only when
//! absent, a delete with a precondition only with the current resourceVersion; a watch
//! from resourceVersion `rv` delivers every later change of its Lease (or of every Lease
//! with its label), in order, unless `rv` was compacted away (410 Gone).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube_leasehold::election::{LeaseEvent, Read, StoreError};
use tokio::sync::mpsc;

/// Who made a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// A replica's process (its pid: one per incarnation).
    Process(usize),
    /// A foreign writer (a person, another controller).
    Foreign,
}

/// A change that took effect, in effect order.
#[derive(Debug, Clone)]
pub enum Effect {
    /// A Lease was created, replaced or deleted (`spec: None`).
    Lease {
        at: Duration,
        by: By,
        name: String,
        spec: Option<LeaseSpec>,
    },
    /// A leader's write of an object took effect.
    Write {
        at: Duration,
        /// When its process let it through the fence.
        sent: Duration,
        pid: usize,
        /// The shard whose fence it went through (0 with a single Lease).
        shard: usize,
        key: String,
    },
}

/// What a watch follows: one Lease, or every Lease with a label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Filter {
    /// The Lease of this name.
    Name(String),
    /// Every Lease whose label `.0` is `.1`.
    Label(String, String),
}

impl Filter {
    /// A label selector `key=value` (the only form the group watch uses).
    pub fn label(selector: &str) -> Filter {
        let (key, value) = selector.split_once('=').unwrap_or((selector, ""));
        Filter::Label(key.into(), value.into())
    }

    fn matches(&self, lease: &Lease) -> bool {
        match self {
            Filter::Name(name) => lease.metadata.name.as_deref() == Some(name),
            Filter::Label(key, value) => lease
                .metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.get(key) == Some(value)),
        }
    }
}

/// A change as a watch delivers it: the Lease's name and the event.
pub type Change = (String, LeaseEvent);

/// A watch's end of the server.
struct Watcher {
    filter: Filter,
    events: mpsc::UnboundedSender<Change>,
}

/// The server's state.
#[derive(Default)]
pub struct Server {
    rv: u64,
    leases: BTreeMap<String, Lease>,
    /// Every change of every Lease: (resourceVersion, the Lease as it was last, event).
    history: Vec<(u64, Lease, LeaseEvent)>,
    /// Watches from before this resourceVersion get 410 Gone.
    compacted: u64,
    watchers: Vec<Watcher>,
    /// Every change, in the order it took effect.
    pub effects: Vec<Effect>,
}

fn rv_of(lease: &Lease) -> Option<u64> {
    lease.metadata.resource_version.as_deref()?.parse().ok()
}

impl Server {
    /// A read by name: the Lease, or the resourceVersion as of which it is absent.
    pub fn get(&self, name: &str) -> Read {
        match self.leases.get(name) {
            Some(lease) => Read::Found(Box::new(lease.clone())),
            None => Read::Absent {
                resource_version: self.rv.to_string(),
            },
        }
    }

    /// Every Lease `filter` matches, and the resourceVersion of the list.
    pub fn list(&self, filter: &Filter) -> (Vec<Lease>, String) {
        let leases = self
            .leases
            .values()
            .filter(|l| filter.matches(l))
            .cloned()
            .collect();
        (leases, self.rv.to_string())
    }

    /// The Lease, if it exists (what a foreign writer edits).
    pub fn lease(&self, name: &str) -> Option<Lease> {
        self.leases.get(name).cloned()
    }

    /// POST: fails when the Lease exists.
    pub fn create(&mut self, at: Duration, by: By, lease: &Lease) -> Result<Lease, StoreError> {
        let name = lease.metadata.name.clone().unwrap_or_default();
        if self.leases.contains_key(&name) {
            return Err(StoreError::Conflict);
        }
        Ok(self.store(at, by, name, lease.clone()))
    }

    /// PUT: applies only with the current resourceVersion.
    pub fn replace(&mut self, at: Duration, by: By, lease: &Lease) -> Result<Lease, StoreError> {
        let name = lease.metadata.name.clone().unwrap_or_default();
        let current = self.leases.get(&name).ok_or(StoreError::NotFound)?;
        if rv_of(current) != rv_of(lease) {
            return Err(StoreError::Conflict);
        }
        Ok(self.store(at, by, name, lease.clone()))
    }

    /// DELETE, with the resourceVersion precondition `precondition` if given.
    pub fn delete(
        &mut self,
        at: Duration,
        by: By,
        name: &str,
        precondition: Option<&str>,
    ) -> Result<(), StoreError> {
        let current = self.leases.get(name).ok_or(StoreError::NotFound)?;
        if precondition.is_some_and(|rv| current.metadata.resource_version.as_deref() != Some(rv)) {
            return Err(StoreError::Conflict);
        }
        let gone = self.leases.remove(name).expect("present");
        self.rv += 1;
        self.effects.push(Effect::Lease {
            at,
            by,
            name: name.into(),
            spec: None,
        });
        let resource_version = self.rv.to_string();
        self.publish(&gone, LeaseEvent::Deleted { resource_version });
        Ok(())
    }

    fn store(&mut self, at: Duration, by: By, name: String, mut lease: Lease) -> Lease {
        self.rv += 1;
        lease.metadata.resource_version = Some(self.rv.to_string());
        self.effects.push(Effect::Lease {
            at,
            by,
            name: name.clone(),
            spec: lease.spec.clone(),
        });
        self.leases.insert(name, lease.clone());
        self.publish(&lease, LeaseEvent::Applied(Box::new(lease.clone())));
        lease
    }

    /// Tells the watches of `lease` (as it is now, or was when deleted) about `event`.
    fn publish(&mut self, lease: &Lease, event: LeaseEvent) {
        self.history.push((self.rv, lease.clone(), event.clone()));
        let change = (lease.metadata.name.clone().unwrap_or_default(), event);
        self.watchers
            .retain(|w| !w.filter.matches(lease) || w.events.send(change.clone()).is_ok());
    }

    /// A watch of what `filter` matches from `from`: the changes since, then every later
    /// one; `None` when `from` was compacted away (410 Gone) or is not a resourceVersion.
    pub fn watch(&mut self, filter: Filter, from: &str) -> Option<mpsc::UnboundedReceiver<Change>> {
        let from: u64 = from.parse().ok()?;
        if from < self.compacted {
            return None;
        }
        let (events, receiver) = mpsc::unbounded_channel();
        for (_, lease, event) in self
            .history
            .iter()
            .filter(|(rv, lease, _)| *rv > from && filter.matches(lease))
        {
            let name = lease.metadata.name.clone().unwrap_or_default();
            let _ = events.send((name, event.clone()));
        }
        self.watchers.push(Watcher { filter, events });
        Some(receiver)
    }

    /// Ends every watch.
    pub fn end_watches(&mut self) {
        self.watchers.clear();
    }

    /// Compacts: watches from before now get 410 Gone; the open ones end.
    pub fn compact(&mut self) {
        self.compacted = self.rv;
        self.history.clear();
        self.watchers.clear();
    }

    /// Records that a leader's object write (through shard `shard`'s fence) took effect.
    pub fn write(&mut self, at: Duration, sent: Duration, pid: usize, shard: usize, key: &str) {
        self.rv += 1;
        self.effects.push(Effect::Write {
            at,
            sent,
            pid,
            shard,
            key: key.into(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn lease(rv: Option<&str>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("l".into()),
                resource_version: rv.map(Into::into),
                ..Default::default()
            },
            spec: Some(LeaseSpec::default()),
        }
    }

    #[test]
    fn preconditions_and_watches_behave_as_the_api_server() {
        let mut s = Server::default();
        let t = Duration::ZERO;
        let created = s.create(t, By::Foreign, &lease(None)).unwrap();
        assert_eq!(
            s.create(t, By::Foreign, &lease(None)),
            Err(StoreError::Conflict)
        );
        assert_eq!(
            s.replace(t, By::Foreign, &lease(Some("0"))),
            Err(StoreError::Conflict)
        );
        let mut watch = s
            .watch(Filter::Name("l".into()), "0")
            .expect("not compacted");
        let mut labelled = s.watch(Filter::label("g=1"), "0").expect("not compacted");
        s.replace(t, By::Foreign, &created).unwrap();
        assert!(matches!(watch.try_recv(), Ok((_, LeaseEvent::Applied(_)))));
        assert!(matches!(watch.try_recv(), Ok((_, LeaseEvent::Applied(_)))));
        assert!(labelled.try_recv().is_err(), "no Lease labelled g=1");
        let mut relabelled = s.lease("l").unwrap();
        relabelled.metadata.labels = Some([("g".to_string(), "1".to_string())].into());
        s.replace(t, By::Foreign, &relabelled).unwrap();
        assert!(matches!(labelled.try_recv(), Ok((name, LeaseEvent::Applied(_))) if name == "l"));
        assert_eq!(s.list(&Filter::label("g=1")).0.len(), 1);
        s.compact();
        assert!(s.watch(Filter::Name("l".into()), "1").is_none(), "410 Gone");
        assert_eq!(
            s.delete(t, By::Foreign, "l", Some("1")),
            Err(StoreError::Conflict),
            "a stale precondition"
        );
        assert_eq!(s.delete(t, By::Foreign, "l", None), Ok(()));
        assert_eq!(
            s.replace(t, By::Foreign, &created),
            Err(StoreError::NotFound)
        );
    }
}
