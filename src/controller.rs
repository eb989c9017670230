//! The controller: routes cache changes to the shard queues while this replica leads, and
//! runs the workers of a leadership term.
//!
//! Invariants:
//! - followers enqueue nothing (their caches stay warm, their queues empty);
//! - a term starts by marking the controller leading and then enqueuing every key in the
//!   warm MyResource cache (no LIST, no waiting), so no change between the two is missed;
//! - a term ends by cancelling the workers (in-flight reconciles are dropped at their next
//!   await; writes are fenced anyway) and clearing the queues.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::cache::{Sink, Trigger};
use crate::key::ObjectKey;
use crate::queue::Outcome;
use crate::reconcile::{Context, reconcile};
use crate::shard::{Shard, Shards};

/// Shared by the caches (as their [`Sink`]) and the leadership loop.
#[derive(Debug)]
pub struct Controller {
    shards: Shards,
    leading: AtomicBool,
}

impl Sink for Controller {
    fn changed(&self, key: ObjectKey, trigger: Trigger) {
        if self.leading.load(Ordering::SeqCst) {
            debug!(myresource = %key, trigger = trigger.as_str(), "enqueued");
            self.shards.add(key);
        }
    }
}

impl Controller {
    pub fn new(shards: Shards) -> Self {
        Controller {
            shards,
            leading: AtomicBool::new(false),
        }
    }

    pub fn shards(&self) -> &Shards {
        &self.shards
    }

    /// Runs one leadership term with `workers_per_shard` workers on every shard, until
    /// `cancel` fires.
    pub async fn lead(
        &self,
        ctx: Arc<Context>,
        workers_per_shard: usize,
        cancel: CancellationToken,
    ) {
        self.leading.store(true, Ordering::SeqCst);
        let keys = ctx.caches.myresource_keys();
        info!(
            keys = keys.len(),
            "leading: enqueuing every cached MyResource"
        );
        for key in keys {
            self.shards.add(key);
        }
        let workers = self.shards.iter().flat_map(|shard| {
            let (ctx, cancel) = (ctx.clone(), cancel.clone());
            (0..workers_per_shard).map(move |_| work(shard, ctx.clone(), cancel.clone()))
        });
        futures::future::join_all(workers).await;
        self.leading.store(false, Ordering::SeqCst);
        self.shards.clear();
        info!("leadership term ended: workers stopped, queues cleared");
    }
}

async fn work(shard: &Shard, ctx: Arc<Context>, cancel: CancellationToken) {
    while let Some(popped) = shard.next(&cancel).await {
        let key = popped.key;
        let result = tokio::select! {
            result = reconcile(&ctx, &key) => result,
            _ = cancel.cancelled() => {
                shard.done(&key, Outcome::Success);
                return;
            }
        };
        match result {
            Ok(outcome) => {
                debug!(myresource = %key, shard = shard.index, "reconciled");
                shard.done(&key, outcome);
            }
            Err(err) => {
                let retry = shard.done(&key, Outcome::Failure);
                warn!(myresource = %key, shard = shard.index, error = %err, retry_in = ?retry, "reconcile failed");
            }
        }
    }
}
