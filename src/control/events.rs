//! Events (`events.k8s.io/v1`) about MyResources, published the way client-go's events
//! recorder does: the first occurrence creates an Event; a repeat of the same event (same
//! object, type, reason and action, from this replica) within [`SERIES_WINDOW`] of the last
//! one patches that Event's `series` (count, lastObservedTime) instead of creating another,
//! so `kubectl describe` shows "(x3 over 2m)" rather than three lines.
//!
//! Off the reconcile's path: a reconcile queues its Events ([`Publisher::queue`]) and goes on
//! to its status write; each leadership term publishes them from a task of its own beside
//! its workers ([`Publisher::run_term`]), as client-go's broadcaster does from its own
//! goroutine, so nothing the publisher does (its sweep included) holds up a reconcile.
//!
//! Invariants:
//! - an Event is published only in the term that queued it: the queue belongs to one term,
//!   every publish checks the term's fence first and goes through the fenced client, and
//!   what a term left unsent when it ended is dropped (counted), never sent in a later term;
//! - the queue is bounded ([`QUEUE`]); a full queue drops the Event (counted and logged)
//!   rather than slow the reconciles (client-go's broadcaster drops past 1,000 too);
//! - a term ends only once the publishes it started are answered, so the release that
//!   follows finds them settled ([`kube_leasehold::fence::Fence::settled`]);
//! - the memory of recent events ([`Recent`], pure, tested with a fake clock) forgets
//!   expired entries from an expiry queue kept in the order they were observed, at most
//!   [`EXPIRE_PER_OBSERVE`] per publish: a publish costs O(1) however many objects there
//!   are, never a pass over the whole memory, and the queue shrinks faster than it grows.
//!   (kube's `Recorder` sweeps its whole cache on every publish under a lock that every
//!   worker shares: at 10,000 objects that was the largest single item in the operator's
//!   CPU profile; a sweep every 30 s of our own still held a runtime thread for 85 ms at
//!   100,000.)
//! - its lock is never held across a request;
//! - a failed create is forgotten, so the next occurrence creates again; a series patch
//!   that finds its Event gone (404) or changed (409) creates a new one;
//! - every write is conditional: a series patch carries the resourceVersion this replica's
//!   last write of the Event left (while that write's outcome is unknown, the next
//!   occurrence creates a new Event instead), so a late patch from an earlier term cannot
//!   overwrite a later one.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use kube_leasehold::fence::{Fence, is_fenced};
use opentelemetry::trace::SpanContext;
use serde_json::json;
use tokio::sync::mpsc;
use tracing::{Instrument, debug, warn};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::infra::metrics::Metrics;

/// A repeat within this long of the previous occurrence joins its series (client-go: 6 min).
pub const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);
/// How many expired entries one observation may forget: more than the one entry it adds,
/// so the expiry queue never falls further behind.
pub const EXPIRE_PER_OBSERVE: usize = 2;
/// How many Events a term may hold queued and unsent; more are dropped.
pub const QUEUE: usize = 1024;

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
///
/// Every observation also goes to the back of `expiry`, which is therefore in the order of
/// observation; an entry there stands for "this key may have expired by then". A key
/// observed again has a later entry too, so an entry whose key was seen since is skipped.
#[derive(Debug, Default)]
pub struct Recent {
    seen: HashMap<Arc<Key>, Seen>,
    expiry: VecDeque<(Instant, Arc<Key>)>,
}

impl Recent {
    /// Records an occurrence of `key` at `now`; `fresh_name` names the Event if a new one
    /// is to be created.
    pub fn observe(&mut self, key: Key, fresh_name: &str, now: Instant) -> Decision {
        self.expire(now);
        let fresh = || Seen {
            name: fresh_name.to_string(),
            count: 1,
            last: now,
            resource_version: None,
        };
        let (key, decision) = match self.seen.entry(Arc::new(key)) {
            // A repeat within the window joins the series, on condition that its Event is
            // as our last write left it; while that write's outcome is unknown no condition
            // can be put on a patch, so a new Event starts, as after the window.
            Entry::Occupied(mut entry) => {
                let s = entry.get_mut();
                let decision = match s.resource_version.take() {
                    Some(resource_version)
                        if now.saturating_duration_since(s.last) < SERIES_WINDOW =>
                    {
                        s.count += 1;
                        s.last = now;
                        Decision::Series {
                            name: s.name.clone(),
                            count: s.count,
                            resource_version,
                        }
                    }
                    _ => {
                        *s = fresh();
                        Decision::Create
                    }
                };
                (entry.key().clone(), decision)
            }
            Entry::Vacant(entry) => {
                let key = entry.key().clone();
                entry.insert(fresh());
                (key, Decision::Create)
            }
        };
        self.expiry.push_back((now, key));
        decision
    }

    /// Forgets up to [`EXPIRE_PER_OBSERVE`] keys whose last occurrence is a window old.
    fn expire(&mut self, now: Instant) {
        let expired = |last: Instant| now.saturating_duration_since(last) >= SERIES_WINDOW;
        for _ in 0..EXPIRE_PER_OBSERVE {
            let Some((_, key)) = self.expiry.pop_front_if(|(at, _)| expired(*at)) else {
                return;
            };
            // Unless seen again since (a later entry stands for it), or forgotten and seen anew.
            if let Entry::Occupied(entry) = self.seen.entry(key)
                && expired(entry.get().last)
            {
                entry.remove();
            }
        }
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

/// One Event a reconcile asked for.
#[derive(Debug)]
pub struct Pending {
    pub regarding: ObjectReference,
    pub type_: EventType,
    pub reason: &'static str,
    pub note: String,
    /// The reconcile that asked, linked from the publish's span.
    pub cause: SpanContext,
}

/// What became of an Event a reconcile queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Published,
    /// Refused or failed (logged).
    Failed,
    /// Not sent: the queue was full, or the term ended first.
    Dropped,
}

impl Fate {
    pub fn as_str(self) -> &'static str {
        match self {
            Fate::Published => "published",
            Fate::Failed => "failed",
            Fate::Dropped => "dropped",
        }
    }
}

/// Publishes Events for one replica (one shard's contexts in scale-out mode).
pub struct Publisher {
    client: Client,
    controller: String,
    instance: String,
    recent: Mutex<Recent>,
    /// The running term's queue; `None` between terms.
    outbox: Mutex<Option<mpsc::Sender<Pending>>>,
    /// Hears what became of every queued Event (the metrics).
    fate: Box<dyn Fn(Fate) + Send + Sync>,
}

impl Publisher {
    /// `controller` is the `reportingController`, `instance` the `reportingInstance` (the
    /// replica's identity).
    pub fn new(client: Client, controller: &str, instance: &str) -> Self {
        Publisher {
            client,
            controller: controller.into(),
            instance: instance.into(),
            recent: Mutex::new(Recent::default()),
            outbox: Mutex::new(None),
            fate: Box::new(|_| {}),
        }
    }

    /// Tells `fate` what became of every Event queued from now on.
    pub fn on_fate(mut self, fate: impl Fn(Fate) + Send + Sync + 'static) -> Self {
        self.fate = Box::new(fate);
        self
    }

    /// Queues an Event for the running term's [`Publisher::run_term`]; drops it (counted,
    /// logged at debug level) if no term runs or its queue is full.
    pub fn queue(&self, pending: Pending) {
        let outbox = self.outbox.lock().expect("outbox lock");
        let queued = match outbox.as_ref() {
            Some(tx) => tx.try_send(pending).map_err(|err| err.into_inner()),
            None => Err(pending),
        };
        if let Err(pending) = queued {
            debug!(
                reason = pending.reason,
                "Event dropped: no room in this term's queue"
            );
            (self.fate)(Fate::Dropped);
        }
    }

    /// Publishes the Events queued during one leadership term, up to `concurrency` at once,
    /// each after a check of the term's `fence`, until `ended` resolves; then waits for the
    /// publishes under way and drops what is still queued.
    pub async fn run_term(
        &self,
        fence: &Fence,
        concurrency: usize,
        ended: impl Future<Output = ()>,
    ) {
        let fate = &self.fate;
        let (tx, mut rx) = mpsc::channel(QUEUE);
        *self.outbox.lock().expect("outbox lock") = Some(tx);
        let mut ended = pin!(ended);
        let mut sending = FuturesUnordered::new();
        loop {
            tokio::select! {
                // Answers first, then queued Events while there is room: the term's end
                // drops only what could not be started by then (at most what arrived
                // while `concurrency` publishes were under way).
                biased;
                Some(result) = sending.next(), if !sending.is_empty() => fate(result),
                Some(pending) = rx.recv(), if sending.len() < concurrency.max(1) => {
                    if fence.check().is_err() {
                        fate(Fate::Dropped);
                    } else {
                        sending.push(self.publish_pending(pending));
                    }
                }
                () = &mut ended => break,
            }
        }
        *self.outbox.lock().expect("outbox lock") = None;
        rx.close();
        let mut dropped = 0;
        while rx.try_recv().is_ok() {
            dropped += 1;
            fate(Fate::Dropped);
        }
        if dropped > 0 {
            warn!(
                dropped,
                "the leadership term ended before these Events were published"
            );
        }
        while let Some(result) = sending.next().await {
            fate(result);
        }
    }

    async fn publish_pending(&self, pending: Pending) -> Fate {
        let Pending {
            regarding,
            type_,
            reason,
            note,
            cause,
        } = pending;
        let span = tracing::info_span!("publish Event", reason);
        span.add_link(cause);
        let name = regarding.name.clone().unwrap_or_default();
        let namespace = regarding.namespace.clone().unwrap_or_default();
        match self
            .publish(&regarding, type_, reason, "Reconcile", &note)
            .instrument(span)
            .await
        {
            Ok(()) => Fate::Published,
            Err(err) => {
                if !is_fenced(&err) {
                    warn!(namespace, name, reason, error = %err, "could not publish event");
                }
                Fate::Failed
            }
        }
    }

    /// Publishes one occurrence of an event about `regarding`, now: only for the term's
    /// publisher ([`Publisher::run_term`]), which checks the fence first.
    async fn publish(
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

/// A [`Publisher::on_fate`] that counts in `metrics` (`myresource_operator_events_total`).
pub fn counted(metrics: &Arc<Metrics>) -> impl Fn(Fate) + Send + Sync + 'static {
    let metrics = metrics.clone();
    move |fate| metrics.event(fate.as_str())
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
        let mut recent = Recent::default();
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
        let mut recent = Recent::default();
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
        let mut recent = Recent::default();
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

    /// `n` keys observed at `at`, each written (so a repeat could join its series).
    fn observed_and_written(recent: &mut Recent, n: usize, at: Instant) -> Vec<Key> {
        (0..n)
            .map(|i| {
                let mut k = key("R");
                k.object.1 = format!("o{i}");
                recent.observe(k.clone(), "x", at);
                recent.written(&k, "x", Some(i.to_string()));
                k
            })
            .collect()
    }

    #[test]
    fn an_observation_forgets_a_bounded_number_of_expired_entries() {
        let t0 = Instant::now();
        let mut recent = Recent::default();
        observed_and_written(&mut recent, 100, t0);
        // All 100 have expired, but one observation forgets only EXPIRE_PER_OBSERVE of them
        // (a pass over the whole memory held a runtime thread for 85 ms at 100,000).
        let later = t0 + SERIES_WINDOW;
        recent.observe(key("fresh"), "f", later);
        assert_eq!(recent.len(), 100 - EXPIRE_PER_OBSERVE + 1);
        // Each observation adds one entry and forgets up to two: the backlog drains.
        for _ in 0..100 {
            recent.observe(key("fresh"), "f", later);
        }
        assert_eq!(recent.len(), 1);
        // What is left in the queue is one entry per observation within the window.
        assert_eq!(recent.expiry.len(), 101);
    }

    #[test]
    fn a_steady_stream_keeps_only_a_window_of_entries() {
        let t0 = Instant::now();
        let step = SERIES_WINDOW / 100;
        let mut recent = Recent::default();
        for i in 0..400u32 {
            let mut k = key("R");
            k.object.1 = format!("o{i}");
            recent.observe(k, "x", t0 + step * i);
            assert!(recent.len() <= 101, "{} remembered at {i}", recent.len());
            assert!(recent.expiry.len() <= 101);
        }
    }

    #[test]
    fn an_expired_entry_never_joins_and_a_refreshed_one_stays() {
        let t0 = Instant::now();
        let secs = Duration::from_secs;
        let mut recent = Recent::default();
        let keys = observed_and_written(&mut recent, 5, t0);
        // The first two are forgotten here, the next two by the observation of the last...
        recent.observe(key("X"), "x", t0 + SERIES_WINDOW);
        assert_eq!(recent.len(), 4);
        // ...which is still remembered when observed, expired: it starts a new Event.
        assert_eq!(
            recent.observe(keys[4].clone(), "new", t0 + SERIES_WINDOW),
            Decision::Create
        );
        assert_eq!(recent.len(), 2);

        // A key observed again within the window outlives the expiry of its first entry.
        let mut recent = Recent::default();
        recent.observe(key("R"), "r", t0);
        recent.observe(key("R"), "r2", t0 + SERIES_WINDOW - secs(1));
        recent.written(&key("R"), "r2", Some("9".into()));
        recent.observe(key("Y"), "y", t0 + SERIES_WINDOW + secs(1));
        assert_eq!(recent.len(), 2);
        assert!(matches!(
            recent.observe(key("R"), "r3", t0 + SERIES_WINDOW + secs(2)),
            Decision::Series { count: 2, .. }
        ));
    }

    /// An API server that answers every Event create once `release` grants a permit, and
    /// counts the creates it received and the most it held at once.
    struct Server {
        release: Arc<tokio::sync::Semaphore>,
        received: Arc<std::sync::atomic::AtomicUsize>,
        most_at_once: Arc<std::sync::atomic::AtomicUsize>,
    }

    fn publisher() -> (Publisher, Server, Arc<Mutex<Vec<Fate>>>) {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let server = Server {
            release: Arc::new(tokio::sync::Semaphore::new(0)),
            received: Arc::new(AtomicUsize::new(0)),
            most_at_once: Arc::new(AtomicUsize::new(0)),
        };
        let held = Arc::new(AtomicUsize::new(0));
        let (release, received, most) = (
            server.release.clone(),
            server.received.clone(),
            server.most_at_once.clone(),
        );
        let service = tower::service_fn(move |_: http::Request<kube::client::Body>| {
            let (release, held, most) = (release.clone(), held.clone(), most.clone());
            received.fetch_add(1, SeqCst);
            async move {
                most.fetch_max(held.fetch_add(1, SeqCst) + 1, SeqCst);
                release.acquire().await.expect("open").forget();
                held.fetch_sub(1, SeqCst);
                let event = r#"{"apiVersion":"events.k8s.io/v1","kind":"Event","metadata":{"name":"e","resourceVersion":"1"}}"#;
                http::Response::builder()
                    .status(201)
                    .body(http_body_util::Full::new(hyper::body::Bytes::from(event)))
                    .map_err(|e| -> tower::BoxError { e.into() })
            }
        });
        let fates = Arc::new(Mutex::new(Vec::new()));
        let heard = fates.clone();
        let publisher = Publisher::new(Client::new(service, "default"), "test", "replica")
            .on_fate(move |fate| heard.lock().unwrap().push(fate));
        (publisher, server, fates)
    }

    fn pending(name: &str) -> Pending {
        Pending {
            regarding: ObjectReference {
                namespace: Some("ns".into()),
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                ..Default::default()
            },
            type_: EventType::Normal,
            reason: "ConfigMapCreated",
            note: "created".into(),
            cause: SpanContext::empty_context(),
        }
    }

    fn count(fates: &Mutex<Vec<Fate>>, fate: Fate) -> usize {
        fates.lock().unwrap().iter().filter(|f| **f == fate).count()
    }

    /// Lets the publisher and the server run for a moment.
    async fn settle() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    /// Waits (bounded) until `done` holds.
    async fn until(what: &str, done: impl Fn() -> bool) {
        for _ in 0..500 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("still not: {what}");
    }

    /// Events go out beside the reconciles, at most `concurrency` at once; the term's end
    /// waits for those under way and drops what it had not started; outside a term, and
    /// past the fence, nothing is sent.
    #[tokio::test]
    async fn a_term_publishes_its_events_and_no_later_term_does() {
        use std::sync::atomic::Ordering::SeqCst;
        let (publisher, server, fates) = publisher();
        publisher.queue(pending("before"));
        assert_eq!(count(&fates, Fate::Dropped), 1, "no term runs yet");

        let fence = Fence::default();
        fence.extend(Instant::now() + Duration::from_secs(60));
        let (end, ended) = tokio::sync::oneshot::channel::<()>();
        let term = publisher.run_term(&fence, 2, async {
            let _ = ended.await;
        });
        let drive = async {
            settle().await;
            for i in 0..5 {
                publisher.queue(pending(&format!("o{i}")));
            }
            until("two sent", || server.received.load(SeqCst) == 2).await;
            settle().await;
            assert_eq!(server.received.load(SeqCst), 2, "two at once, three queued");
            server.release.add_permits(2);
            until("two more sent", || server.received.load(SeqCst) == 4).await;
            assert_eq!(count(&fates, Fate::Published), 2);
            // The term ends with two under way and one queued: the two are awaited.
            end.send(()).unwrap();
            settle().await;
            assert_eq!(count(&fates, Fate::Published), 2, "still under way");
            server.release.add_permits(2);
        };
        futures::join!(term, drive);
        assert_eq!(count(&fates, Fate::Published), 4);
        assert_eq!(
            count(&fates, Fate::Dropped),
            2,
            "the one queued at the end too"
        );
        assert_eq!(server.most_at_once.load(SeqCst), 2);

        publisher.queue(pending("after"));
        assert_eq!(count(&fates, Fate::Dropped), 3, "no term runs any more");

        // A term whose fence is closed sends nothing (were it to, the server would answer).
        fence.revoke();
        server.release.add_permits(10);
        let (end, ended) = tokio::sync::oneshot::channel::<()>();
        let term = publisher.run_term(&fence, 2, async {
            let _ = ended.await;
        });
        let drive = async {
            settle().await;
            publisher.queue(pending("fenced"));
            settle().await;
            end.send(()).unwrap();
        };
        futures::join!(term, drive);
        assert_eq!(count(&fates, Fate::Dropped), 4);
        assert_eq!(
            server.received.load(SeqCst),
            4,
            "nothing sent past the fence"
        );
    }

    #[test]
    fn a_forgotten_key_creates_again() {
        let t0 = Instant::now();
        let mut recent = Recent::default();
        recent.observe(key("R"), "a.1", t0);
        recent.forget(&key("R"));
        assert_eq!(recent.len(), 0);
        assert_eq!(recent.observe(key("R"), "a.2", t0), Decision::Create);
    }
}
