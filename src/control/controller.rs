//! The controller: routes cache changes to the shard queues while this replica leads, and
//! runs the workers of a leadership term.
//!
//! Invariants:
//! - followers enqueue nothing (their caches stay warm, their queues empty);
//! - a term starts by marking its shards led and then enqueuing every key of theirs in the
//!   warm MyResource cache (no LIST, no waiting), so no change between the two is missed;
//!   the first [`FIRST_CHUNK`] keys go in, then the rest [`CHUNK`] at a time, and between
//!   chunks the workers (futures of the same task) get one turn, a key each (see
//!   [`Shard::next`]): the first reconcile does not wait for the last of 100,000 keys to be
//!   queued, a change queued meanwhile waits for one chunk, not for the whole enqueue, and
//!   the last key does not wait for the workers to empty the queue;
//! - a term's start queues every cached key in the queue's backlog lane, those whose status
//!   lags their spec (new objects, changes the last term did not reach) first; the term's
//!   watch events go in the changed lane, before the backlog: a change made during a
//!   takeover or a cold start waits for a worker, not for 100,000 looks at other objects
//!   (like controller-runtime's priority queue; the backlog waits while changes keep coming);
//! - a term ends by cancelling the workers and clearing its queues; a reconcile in flight
//!   may finish for [`FINISH_AFTER_CANCEL`] (the fence is closed by then, so it writes
//!   nothing new, and the writes it sent get their answers, so the release need not wait
//!   for their deadlines), then is dropped.
//!
//! A term covers every shard (one Lease), or in scale-out mode one shard (its shard
//! Lease): a key's shard is then its MyResource's uid's ([`kube_leasehold::scaleout::shard_key`]), looked up
//! in the cache; a key not in the cache is no shard's (another replica's, or deleted).
//!
//! Each reconcile runs in a `reconcile` span (namespace, name, kind, shard, trigger, result,
//! requeue delay) linked to the short `watch.event` span recorded when the change arrived.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use opentelemetry::trace::SpanContext;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::cache::{Caches, Change, Sink, Trigger};
use crate::control::partition::{Shard, Shards, shard_of};
use crate::control::queue::{Lane, Outcome};
use crate::control::reconcile::{Context, Error, reconcile};
use crate::infra::metrics::{Metrics, QueueState, ReconcileResult};
use crate::infra::telemetry::span_context;
use crate::key::ObjectKey;
use crate::resource::MyResource;
use kube_leasehold::scaleout::shard_key::ShardKey;

/// How long a reconcile in flight when its term ends may go on: enough for the answers to
/// the writes it sent (a reconcile takes milliseconds), bounded for one stuck on a read.
pub const FINISH_AFTER_CANCEL: std::time::Duration = std::time::Duration::from_secs(1);

/// Keys a takeover queues before it lets the workers begin: the first reconcile starts
/// after microseconds, not after every cached key is queued.
const FIRST_CHUNK: usize = 256;

/// Keys a takeover queues between two turns of the workers, after the first chunk: a few
/// milliseconds of enqueueing (about 2.4 µs a key at 100,000 objects).
const CHUNK: usize = 4096;

/// Why a key was last enqueued, and the span of that watch event.
#[derive(Debug, Clone)]
struct Cause {
    trigger: Trigger,
    span: SpanContext,
}

/// Shared by the echo filter (as its next [`Sink`]) and the leadership loop.
pub struct Controller {
    shards: Shards,
    /// Per shard, whether a term runs for it.
    leading: Vec<AtomicBool>,
    /// Scale-out mode: the shard key, and the caches that give a key its uid.
    routing: OnceLock<(ShardKey, Caches)>,
    causes: Mutex<HashMap<ObjectKey, Cause>>,
    /// Namespaces seen being deleted, to say so once each (bounded: cleared when full).
    terminating: Mutex<HashSet<String>>,
    metrics: Arc<Metrics>,
}

/// How many deleted namespaces [`Controller::terminating`] remembers.
const TERMINATING_REMEMBERED: usize = 1024;

impl Sink for Controller {
    fn changed(&self, change: Change) {
        let Change { key, trigger, .. } = change;
        let Some(shard) = self.shard_of(&key) else {
            return;
        };
        if !self.leading[shard].load(Ordering::SeqCst) {
            return;
        }
        let span =
            tracing::info_span!("watch.event", trigger = trigger.as_str(), myresource = %key);
        let context = span_context(&span);
        debug!(parent: &span, myresource = %key, trigger = trigger.as_str(), "enqueued");
        self.causes.lock().expect("causes lock").insert(
            key.clone(),
            Cause {
                trigger,
                span: context,
            },
        );
        self.enqueue(shard, key, Lane::Changed);
    }
}

impl Controller {
    pub fn new(shards: Shards, metrics: Arc<Metrics>) -> Self {
        Controller {
            leading: shards.iter().map(|_| AtomicBool::new(false)).collect(),
            shards,
            routing: OnceLock::new(),
            causes: Mutex::new(HashMap::new()),
            terminating: Mutex::new(HashSet::new()),
            metrics,
        }
    }

    /// Whether `namespace` is seen being deleted for the first time.
    fn first_seen_terminating(&self, namespace: &str) -> bool {
        let mut seen = self.terminating.lock().expect("terminating lock");
        if seen.len() >= TERMINATING_REMEMBERED {
            seen.clear();
        }
        seen.insert(namespace.to_string())
    }

    /// Each shard's queue, for the scrape-time metrics.
    pub fn queue_state(&self) -> Vec<QueueState> {
        self.shards.snapshot()
    }

    /// Scale-out mode: route keys by `key` (one queue per shard Lease) through `caches`.
    pub fn route_by_uid(&self, key: ShardKey, caches: Caches) {
        assert_eq!(key.shards(), self.shards.len(), "one queue per shard Lease");
        if self.routing.set((key, caches)).is_err() {
            panic!("routing is set once, at startup");
        }
    }

    /// The shard of `key`: by name, or in scale-out mode by its cached MyResource's uid.
    fn shard_of(&self, key: &ObjectKey) -> Option<usize> {
        match self.routing.get() {
            None => Some(shard_of(key, self.shards.len())),
            Some((shard_key, caches)) => {
                let uid = caches.myresources.get(key)?.metadata.uid.clone()?;
                Some(shard_key.shard_of_uid(&uid))
            }
        }
    }

    fn enqueue(&self, shard: usize, key: ObjectKey, lane: Lane) {
        if self.shards.add_to(shard, key, lane) {
            self.metrics.queue_added();
        }
    }

    /// Queues `object`'s key in the backlog of its shard (`only`, in scale-out mode).
    fn backlog(&self, only: Option<usize>, object: &MyResource) {
        let key = ObjectKey::of(object);
        if let Some(shard) = only.or_else(|| self.shard_of(&key)) {
            self.enqueue(shard, key, Lane::Backlog);
        }
    }

    /// Runs one leadership term with `workers_per_shard` workers on every shard (`only`
    /// `None`), or on shard `only` (scale-out mode), until `cancel` fires. `lease` names
    /// the term's Lease in the takeover metric.
    pub async fn lead(
        &self,
        ctx: Arc<Context>,
        workers_per_shard: usize,
        only: Option<usize>,
        lease: &str,
        cancel: CancellationToken,
    ) {
        let acquired = Instant::now();
        let shards: Vec<&Shard> = match only {
            None => self.shards.iter().collect(),
            Some(index) => vec![self.shards.get(index)],
        };
        for shard in &shards {
            self.leading[shard.index].store(true, Ordering::SeqCst);
        }
        let cached = match only {
            None => ctx.caches.cached_myresources(),
            Some(index) => ctx.caches.shard_myresources(index),
        };
        info!(
            keys = cached.len(),
            shard = only,
            "leading: enqueuing every cached MyResource"
        );
        let workers = (workers_per_shard * shards.len()) as i64;
        self.metrics.workers_changed(workers);
        let takeover = Takeover {
            acquired,
            lease,
            first_done: AtomicBool::new(false),
            enqueued: AtomicBool::new(false),
            drained_done: AtomicBool::new(false),
        };
        // The backlog: every cached key, those whose status lags their spec (new objects,
        // changes the last term did not reach) first. The term's watch events go before it.
        let (mut ordered, done): (Vec<_>, Vec<_>) =
            cached.iter().partition(|o| o.awaits_reconcile());
        ordered.extend(done);
        let (first, rest) = ordered.split_at(FIRST_CHUNK.min(ordered.len()));
        let enqueuing = async {
            for (i, chunk) in std::iter::once(first).chain(rest.chunks(CHUNK)).enumerate() {
                if i > 0 {
                    // One turn for the workers on what is queued (join3 polls them next).
                    tokio::task::yield_now().await;
                    if cancel.is_cancelled() {
                        return;
                    }
                }
                chunk.iter().for_each(|o| self.backlog(only, o));
            }
            takeover.enqueued(&shards, &self.metrics);
        };
        let running = shards.iter().flat_map(|shard| {
            let (ctx, cancel, takeover, shards) = (ctx.clone(), cancel.clone(), &takeover, &shards);
            (0..workers_per_shard)
                .map(move |_| self.work(shard, shards, ctx.clone(), cancel.clone(), takeover))
        });
        // The term's Events go out from a task of their own, off the reconciles' path and
        // off their task: whatever a publish costs (a sweep of the publisher's memory, when
        // it still swept it whole, stalled every worker for up to 80 ms at 100,000 objects
        // while it shared their task) holds no reconcile. The term ends once the workers
        // have stopped and the publishes under way are answered.
        let (stopped, workers_stopped) = tokio::sync::oneshot::channel::<()>();
        let working = async move {
            futures::future::join_all(running).await;
            drop(stopped);
        };
        let publisher = ctx.clone();
        let events = tokio::spawn(async move {
            publisher
                .events
                .run_term(&publisher.fence, workers as usize, async {
                    let _ = workers_stopped.await;
                })
                .await
        });
        let ((), (), published) = futures::future::join3(enqueuing, working, events).await;
        if let Err(err) = published
            && err.is_panic()
        {
            std::panic::resume_unwind(err.into_panic());
        }
        for shard in &shards {
            self.leading[shard.index].store(false, Ordering::SeqCst);
            shard.queue().clear();
        }
        self.metrics.workers_changed(-workers);
        self.causes
            .lock()
            .expect("causes lock")
            .retain(|key, _| only.is_some() && self.shard_of(key) != only);
        info!(
            shard = only,
            "leadership term ended: workers stopped, queues cleared"
        );
    }

    async fn work(
        &self,
        shard: &Shard,
        term: &[&Shard],
        ctx: Arc<Context>,
        cancel: CancellationToken,
        takeover: &Takeover<'_>,
    ) {
        while let Some(popped) = shard.next(&cancel).await {
            let key = popped.key;
            let cause = self.causes.lock().expect("causes lock").remove(&key);
            let span = tracing::info_span!(
                "reconcile",
                otel.name = "reconcile MyResource",
                k8s.namespace = %key.namespace,
                k8s.name = %key.name,
                kind = "MyResource",
                shard = shard.index,
                trigger = cause.as_ref().map_or("takeover", |c| c.trigger.as_str()),
                retries = popped.retries,
                result = tracing::field::Empty,
                requeue_after = tracing::field::Empty,
            );
            if let Some(cause) = cause {
                span.add_link(cause.span);
            }
            self.metrics.reconcile_started(shard.index, popped.waited);
            span.in_scope(|| debug!(myresource = %key, shard = shard.index, "reconcile started"));
            let started = Instant::now();
            let result = tokio::select! {
                result = reconcile(&ctx, &key).instrument(span.clone()) => Some(result),
                _ = async {
                    cancel.cancelled().await;
                    tokio::time::sleep(FINISH_AFTER_CANCEL).await;
                } => None,
            };
            let Some(result) = result else {
                self.metrics.reconcile_finished(started.elapsed(), None);
                shard.done(&key, Outcome::Success);
                return;
            };
            let (outcome, label) = match &result {
                Ok(outcome @ Outcome::RequeueAfter(_)) => (*outcome, ReconcileResult::RequeueAfter),
                Ok(outcome) => (*outcome, ReconcileResult::Success),
                // Its namespace is being deleted, and it with it: nothing to retry.
                Err(Error::NamespaceTerminating(_)) => (Outcome::Success, ReconcileResult::Success),
                Err(_) => (Outcome::Failure, ReconcileResult::Error),
            };
            self.metrics
                .reconcile_finished(started.elapsed(), Some(label));
            span.record("result", label.as_str());
            let retry = shard.done(&key, outcome);
            span.in_scope(|| match &result {
                Ok(_) => debug!(myresource = %key, shard = shard.index, "reconciled"),
                Err(err @ Error::NamespaceTerminating(_)) => {
                    if self.first_seen_terminating(&key.namespace) {
                        info!(namespace = %key.namespace, error = %err, "namespace is being deleted: creating nothing in it");
                    } else {
                        debug!(myresource = %key, "namespace is being deleted");
                    }
                }
                Err(err) => {
                    if let Some(delay) = retry {
                        span.record("requeue_after", tracing::field::debug(delay));
                    }
                    warn!(myresource = %key, shard = shard.index, error = %err, kind = err.kind(), retry_in = ?retry, "reconcile failed");
                }
            });
            takeover.observe(term, &self.metrics);
        }
    }
}

/// Measures the takeover: from acquiring to the first reconcile, to every cached key
/// queued, and to empty queues (once every key was queued).
struct Takeover<'a> {
    acquired: Instant,
    lease: &'a str,
    first_done: AtomicBool,
    enqueued: AtomicBool,
    drained_done: AtomicBool,
}

impl Takeover<'_> {
    fn gauge(&self, metrics: &Metrics, phase: &'static str) -> f64 {
        let seconds = self.acquired.elapsed().as_secs_f64();
        metrics.takeover(self.lease, phase, seconds);
        seconds
    }

    /// Every cached key is queued: the drain can be judged from here on.
    fn enqueued(&self, shards: &[&Shard], metrics: &Metrics) {
        let seconds = self.gauge(metrics, "enqueued");
        info!(
            lease = self.lease,
            seconds, "takeover enqueued every cached key"
        );
        self.enqueued.store(true, Ordering::SeqCst);
        self.drained(shards, metrics);
    }

    /// After a reconcile: the first one, and the drain.
    fn observe(&self, shards: &[&Shard], metrics: &Metrics) {
        if !self.first_done.swap(true, Ordering::SeqCst) {
            self.gauge(metrics, "first_reconcile");
        }
        self.drained(shards, metrics);
    }

    fn drained(&self, shards: &[&Shard], metrics: &Metrics) {
        if self.enqueued.load(Ordering::SeqCst)
            && !self.drained_done.load(Ordering::SeqCst)
            && shards.iter().map(|s| s.pending()).sum::<usize>() == 0
            && !self.drained_done.swap(true, Ordering::SeqCst)
        {
            let seconds = self.gauge(metrics, "drained");
            info!(
                lease = self.lease,
                seconds, "takeover drained: every cached key reconciled once"
            );
        }
    }
}
