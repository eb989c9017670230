//! The controller: routes cache changes to the shard queues while this replica leads, and
//! runs the workers of a leadership term.
//!
//! Invariants:
//! - followers enqueue nothing (their caches stay warm, their queues empty);
//! - a term starts by marking the controller leading and then enqueuing every key in the
//!   warm MyResource cache (no LIST, no waiting), so no change between the two is missed;
//! - a term ends by cancelling the workers (in-flight reconciles are dropped at their next
//!   await; writes are fenced anyway) and clearing the queues.
//!
//! Each reconcile runs in a `reconcile` span (namespace, name, kind, shard, trigger, result,
//! requeue delay) linked to the short `watch.event` span recorded when the change arrived.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use opentelemetry::trace::{SpanContext, TraceContextExt};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::cache::{Change, Sink, Trigger};
use crate::key::ObjectKey;
use crate::metrics::{Metrics, QueueState, ReconcileResult};
use crate::queue::Outcome;
use crate::reconcile::{Context, reconcile};
use crate::shard::{Shard, Shards};

/// Why a key was last enqueued, and the span of that watch event.
#[derive(Debug, Clone)]
struct Cause {
    trigger: Trigger,
    span: SpanContext,
}

/// Shared by the echo filter (as its next [`Sink`]) and the leadership loop.
pub struct Controller {
    shards: Shards,
    leading: AtomicBool,
    causes: Mutex<HashMap<ObjectKey, Cause>>,
    metrics: Arc<Metrics>,
}

impl Sink for Controller {
    fn changed(&self, change: Change) {
        if !self.leading.load(Ordering::SeqCst) {
            return;
        }
        let Change { key, trigger, .. } = change;
        let span =
            tracing::info_span!("watch.event", trigger = trigger.as_str(), myresource = %key);
        let context = span.context().span().span_context().clone();
        debug!(parent: &span, myresource = %key, trigger = trigger.as_str(), "enqueued");
        self.causes.lock().expect("causes lock").insert(
            key.clone(),
            Cause {
                trigger,
                span: context,
            },
        );
        self.enqueue(key);
    }
}

impl Controller {
    pub fn new(shards: Shards, metrics: Arc<Metrics>) -> Self {
        Controller {
            shards,
            leading: AtomicBool::new(false),
            causes: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// Each shard's queue, for the scrape-time metrics.
    pub fn queue_state(&self) -> Vec<QueueState> {
        self.shards.snapshot()
    }

    fn enqueue(&self, key: ObjectKey) {
        if self.shards.add(key) {
            self.metrics.queue_added();
        }
    }

    /// Runs one leadership term with `workers_per_shard` workers on every shard, until
    /// `cancel` fires.
    pub async fn lead(
        &self,
        ctx: Arc<Context>,
        workers_per_shard: usize,
        cancel: CancellationToken,
    ) {
        let acquired = Instant::now();
        self.leading.store(true, Ordering::SeqCst);
        let keys = ctx.caches.myresource_keys();
        info!(
            keys = keys.len(),
            "leading: enqueuing every cached MyResource"
        );
        for key in keys {
            self.enqueue(key);
        }
        self.metrics
            .term_started(workers_per_shard * self.shards.len());
        let takeover = Takeover {
            acquired,
            first_done: AtomicBool::new(false),
            drained_done: AtomicBool::new(false),
        };
        let workers = self.shards.iter().flat_map(|shard| {
            let (ctx, cancel, takeover) = (ctx.clone(), cancel.clone(), &takeover);
            (0..workers_per_shard)
                .map(move |_| self.work(shard, ctx.clone(), cancel.clone(), takeover))
        });
        futures::future::join_all(workers).await;
        self.leading.store(false, Ordering::SeqCst);
        self.shards.clear();
        self.causes.lock().expect("causes lock").clear();
        info!("leadership term ended: workers stopped, queues cleared");
    }

    async fn work(
        &self,
        shard: &Shard,
        ctx: Arc<Context>,
        cancel: CancellationToken,
        takeover: &Takeover,
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
                _ = cancel.cancelled() => None,
            };
            let Some(result) = result else {
                self.metrics.reconcile_finished(started.elapsed(), None);
                shard.done(&key, Outcome::Success);
                return;
            };
            let (outcome, label) = match &result {
                Ok(outcome @ Outcome::RequeueAfter(_)) => (*outcome, ReconcileResult::RequeueAfter),
                Ok(outcome) => (*outcome, ReconcileResult::Success),
                Err(_) => (Outcome::Failure, ReconcileResult::Error),
            };
            self.metrics
                .reconcile_finished(started.elapsed(), Some(label));
            span.record("result", label.as_str());
            let retry = shard.done(&key, outcome);
            span.in_scope(|| match &result {
                Ok(_) => debug!(myresource = %key, shard = shard.index, "reconciled"),
                Err(err) => {
                    if let Some(delay) = retry {
                        span.record("requeue_after", tracing::field::debug(delay));
                    }
                    warn!(myresource = %key, shard = shard.index, error = %err, kind = err.kind(), retry_in = ?retry, "reconcile failed");
                }
            });
            takeover.observe(&self.shards, &self.metrics);
        }
    }
}

/// Measures the takeover: from acquiring to the first reconcile and to an empty queue.
struct Takeover {
    acquired: Instant,
    first_done: AtomicBool,
    drained_done: AtomicBool,
}

impl Takeover {
    fn observe(&self, shards: &Shards, metrics: &Metrics) {
        let gauge = |phase| metrics.takeover(phase, self.acquired.elapsed().as_secs_f64());
        if !self.first_done.swap(true, Ordering::SeqCst) {
            gauge("first_reconcile");
        }
        if !self.drained_done.load(Ordering::SeqCst)
            && shards.pending() == 0
            && !self.drained_done.swap(true, Ordering::SeqCst)
        {
            gauge("drained");
            info!(
                seconds = self.acquired.elapsed().as_secs_f64(),
                "takeover drained: every cached key reconciled once"
            );
        }
    }
}
