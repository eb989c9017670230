//! The simulated API server's storage: Leases with resourceVersions and preconditions,
//! their watch history, the objects the leaders write, and the order in which every change
//! took effect (what the checker judges).
//!
//! Invariants, as the real API server keeps them: one resourceVersion counter for
//! everything; a replace applies only with the current resourceVersion, a create only when
//! absent; a watch from resourceVersion `rv` delivers every later change of its Lease, in
//! order, unless `rv` was compacted away (410 Gone).

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
        spec: Option<LeaseSpec>,
    },
    /// A leader's write of an object took effect.
    Write {
        at: Duration,
        /// When its process let it through the fence.
        sent: Duration,
        pid: usize,
        key: String,
    },
}

/// A watch's end of the server.
struct Watcher {
    name: String,
    events: mpsc::UnboundedSender<LeaseEvent>,
}

/// The server's state.
#[derive(Default)]
pub struct Server {
    rv: u64,
    leases: BTreeMap<String, Lease>,
    /// Every change of every Lease: (resourceVersion, Lease name, event).
    history: Vec<(u64, String, LeaseEvent)>,
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

    /// DELETE.
    pub fn delete(&mut self, at: Duration, by: By, name: &str) -> bool {
        if self.leases.remove(name).is_none() {
            return false;
        }
        self.rv += 1;
        self.effects.push(Effect::Lease { at, by, spec: None });
        let resource_version = self.rv.to_string();
        self.publish(name, LeaseEvent::Deleted { resource_version });
        true
    }

    fn store(&mut self, at: Duration, by: By, name: String, mut lease: Lease) -> Lease {
        self.rv += 1;
        lease.metadata.resource_version = Some(self.rv.to_string());
        self.effects.push(Effect::Lease {
            at,
            by,
            spec: lease.spec.clone(),
        });
        self.leases.insert(name.clone(), lease.clone());
        self.publish(&name, LeaseEvent::Applied(Box::new(lease.clone())));
        lease
    }

    fn publish(&mut self, name: &str, event: LeaseEvent) {
        self.history.push((self.rv, name.into(), event.clone()));
        self.watchers
            .retain(|w| w.name != name || w.events.send(event.clone()).is_ok());
    }

    /// A watch of `name` from `from`: the changes since, then every later one; `None` when
    /// `from` was compacted away (410 Gone) or is not a resourceVersion.
    pub fn watch(&mut self, name: &str, from: &str) -> Option<mpsc::UnboundedReceiver<LeaseEvent>> {
        let from: u64 = from.parse().ok()?;
        if from < self.compacted {
            return None;
        }
        let (events, receiver) = mpsc::unbounded_channel();
        for (_, _, event) in self
            .history
            .iter()
            .filter(|(rv, n, _)| *rv > from && n == name)
        {
            let _ = events.send(event.clone());
        }
        self.watchers.push(Watcher {
            name: name.into(),
            events,
        });
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

    /// Records that a leader's object write took effect.
    pub fn write(&mut self, at: Duration, sent: Duration, pid: usize, key: &str) {
        self.rv += 1;
        self.effects.push(Effect::Write {
            at,
            sent,
            pid,
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
        let mut watch = s.watch("l", "0").expect("not compacted");
        s.replace(t, By::Foreign, &created).unwrap();
        assert!(matches!(watch.try_recv(), Ok(LeaseEvent::Applied(_))));
        assert!(matches!(watch.try_recv(), Ok(LeaseEvent::Applied(_))));
        s.compact();
        assert!(s.watch("l", "1").is_none(), "410 Gone");
        assert!(s.delete(t, By::Foreign, "l"));
        assert_eq!(
            s.replace(t, By::Foreign, &created),
            Err(StoreError::NotFound)
        );
    }
}
