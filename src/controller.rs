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

use crate::cache::{Sink, Trigger};
use crate::key::ObjectKey;
use crate::metrics::{
    self, CONTROLLER, CONTROLLER_LABELS, PhaseLabels, QUEUE_LABELS, ResultLabels, ShardLabels,
};
use crate::queue::Outcome;
use crate::reconcile::{Context, reconcile};
use crate::shard::{Shard, Shards};

/// Why a key was last enqueued, and the span of that watch event.
#[derive(Debug, Clone)]
struct Cause {
    trigger: Trigger,
    span: SpanContext,
}

/// Shared by the caches (as their [`Sink`]) and the leadership loop.
#[derive(Debug)]
pub struct Controller {
    shards: Shards,
    leading: AtomicBool,
    causes: Mutex<HashMap<ObjectKey, Cause>>,
}

impl Sink for Controller {
    fn changed(&self, key: ObjectKey, trigger: Trigger) {
        if !self.leading.load(Ordering::SeqCst) {
            return;
        }
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
        if self.shards.add(key) {
            metrics::get().queue_adds.get_or_create(&QUEUE_LABELS).inc();
        }
    }
}

impl Controller {
    pub fn new(shards: Shards) -> Self {
        Controller {
            shards,
            leading: AtomicBool::new(false),
            causes: Mutex::new(HashMap::new()),
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
        let m = metrics::get();
        for key in keys {
            if self.shards.add(key) {
                m.queue_adds.get_or_create(&QUEUE_LABELS).inc();
            }
        }
        m.max_concurrent_reconciles
            .get_or_create(&CONTROLLER_LABELS)
            .set((workers_per_shard * self.shards.len()) as i64);
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
        let m = metrics::get();
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
            m.queue_duration
                .get_or_create(&QUEUE_LABELS)
                .observe(popped.waited.as_secs_f64());
            m.shard_queue_duration
                .get_or_create(&ShardLabels {
                    shard: shard.index.to_string(),
                })
                .observe(popped.waited.as_secs_f64());
            m.active_workers.get_or_create(&CONTROLLER_LABELS).inc();
            let started = Instant::now();
            {
                let _entered = span.enter();
                debug!(myresource = %key, shard = shard.index, "reconcile started");
            }
            let result = tokio::select! {
                result = reconcile(&ctx, &key).instrument(span.clone()) => Some(result),
                _ = cancel.cancelled() => None,
            };
            let took = started.elapsed().as_secs_f64();
            m.active_workers.get_or_create(&CONTROLLER_LABELS).dec();
            m.reconcile_time
                .get_or_create(&CONTROLLER_LABELS)
                .observe(took);
            m.work_duration.get_or_create(&QUEUE_LABELS).observe(took);
            let Some(result) = result else {
                shard.done(&key, Outcome::Success);
                return;
            };
            let (outcome, label) = match &result {
                Ok(outcome @ Outcome::RequeueAfter(_)) => (*outcome, "requeue_after"),
                Ok(outcome) => (*outcome, "success"),
                Err(_) => (Outcome::Failure, "error"),
            };
            m.reconcile_total
                .get_or_create(&ResultLabels {
                    controller: CONTROLLER,
                    result: label,
                })
                .inc();
            span.record("result", label);
            let retry = shard.done(&key, outcome);
            match result {
                Ok(_) => {
                    let _entered = span.enter();
                    debug!(myresource = %key, shard = shard.index, "reconciled");
                }
                Err(err) => {
                    m.reconcile_errors.get_or_create(&CONTROLLER_LABELS).inc();
                    m.queue_retries.get_or_create(&QUEUE_LABELS).inc();
                    if let Some(delay) = retry {
                        span.record("requeue_after", tracing::field::debug(delay));
                    }
                    let _entered = span.enter();
                    warn!(myresource = %key, shard = shard.index, error = %err, kind = err.kind(), retry_in = ?retry, "reconcile failed");
                }
            }
            takeover.observe(&self.shards);
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
    fn observe(&self, shards: &Shards) {
        let gauge = |phase| {
            metrics::get()
                .takeover_seconds
                .get_or_create(&PhaseLabels { phase })
                .set(self.acquired.elapsed().as_secs_f64())
        };
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

/// Scrape-time metrics of the queues and caches.
pub struct StateCollector {
    pub controller: Arc<Controller>,
    pub caches: crate::cache::Caches,
}

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateCollector")
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

impl prometheus_client::collector::Collector for StateCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use crate::metrics::encode_gauge;
        let shards = self.controller.shards.snapshot();
        let depth: usize = shards.iter().map(|s| s.0).sum();
        let unfinished: f64 = shards.iter().map(|s| s.1).sum();
        let longest = shards.iter().map(|s| s.2).fold(0.0, f64::max);
        encode_gauge(
            &mut encoder,
            "workqueue_depth",
            "Current depth of workqueue",
            &[(QUEUE_LABELS, depth as f64)],
        )?;
        encode_gauge(
            &mut encoder,
            "workqueue_unfinished_work_seconds",
            "How many seconds of work has been done that is in progress and hasn't been observed by work_duration",
            &[(QUEUE_LABELS, unfinished)],
        )?;
        encode_gauge(
            &mut encoder,
            "workqueue_longest_running_processor_seconds",
            "How many seconds has the longest running processor for workqueue been running",
            &[(QUEUE_LABELS, longest)],
        )?;
        let per_shard: Vec<_> = shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                (
                    ShardLabels {
                        shard: i.to_string(),
                    },
                    s.0 as f64,
                )
            })
            .collect();
        encode_gauge(
            &mut encoder,
            "myresource_operator_shard_queue_depth",
            "Keys ready in each shard's queue",
            &per_shard,
        )?;
        let caches = [
            (
                KindLabels { kind: "MyResource" },
                self.caches.myresources.len() as f64,
            ),
            (
                KindLabels { kind: "ConfigMap" },
                self.caches.configmaps.len() as f64,
            ),
            (KindLabels { kind: "Pod" }, self.caches.pods.len() as f64),
        ];
        encode_gauge(
            &mut encoder,
            "myresource_operator_cache_objects",
            "Objects in this replica's caches, by kind",
            &caches,
        )?;
        encode_gauge(
            &mut encoder,
            "myresource_operator_caches_synced",
            "1 when every cache has completed its initial list",
            &[(
                KindLabels { kind: "all" },
                if self.caches.synced() { 1.0 } else { 0.0 },
            )],
        )
    }
}
