//! Sharded work queues: a stable hash of `namespace/name` picks one of S shards, each with its
//! own [`Queue`] and its own workers, so a hot or failing shard cannot starve the others.
//!
//! Invariants: the shard of a key depends only on the key and S (FNV-1a, stable across
//! processes and releases), so every replica routes a key to the same shard; each shard's
//! queue is behind its own lock, held only for queue bookkeeping, never across an await.

use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::control::queue::{Backoff, Lane, Outcome, Popped, Queue};
use crate::infra::metrics::QueueState;
use crate::key::ObjectKey;

/// FNV-1a over `namespace/name`, reduced to a shard index.
pub fn shard_of(key: &ObjectKey, shards: usize) -> usize {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let bytes = key
        .namespace
        .bytes()
        .chain(std::iter::once(b'/'))
        .chain(key.name.bytes());
    let hash = bytes.fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME));
    (hash % shards as u64) as usize
}

/// One shard: a queue and the signal that wakes its workers.
#[derive(Debug)]
pub struct Shard {
    pub index: usize,
    queue: Mutex<Queue<ObjectKey>>,
    wake: Notify,
}

impl Shard {
    /// The queue, for metrics and tests.
    pub fn queue(&self) -> MutexGuard<'_, Queue<ObjectKey>> {
        self.queue.lock().expect("queue lock poisoned")
    }

    fn add(&self, key: ObjectKey, lane: Lane) -> bool {
        let now = Instant::now();
        let added = match lane {
            Lane::Changed => self.queue().add(key, now),
            Lane::Backlog => self.queue().add_backlog(key, now),
        };
        if added {
            self.wake.notify_one();
        }
        added
    }

    /// Waits for the next key; `None` when `cancel` fires first. Yields once before it
    /// looks, so the workers of one task take turns, a key each: a worker whose reconciles
    /// need no request (a takeover's look at objects that are done) would otherwise hand out
    /// key after key in one poll, and the other workers of its task (a reconcile whose
    /// answer has come, another shard's change queued ahead of its backlog) would wait for
    /// its whole backlog. (Tokio's cooperative budget would not do: it stops whichever
    /// worker of the task exhausts it, and the first worker polled takes it all again.) The
    /// yield comes after a reconcile, never between a key's enqueueing and its reconcile.
    pub async fn next(&self, cancel: &CancellationToken) -> Option<Popped<ObjectKey>> {
        tokio::task::yield_now().await;
        loop {
            let due = {
                let mut queue = self.queue();
                if let Some(popped) = queue.pop(Instant::now()) {
                    return Some(popped);
                }
                queue.next_due()
            };
            let sleep = async {
                match due {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => return None,
                _ = self.wake.notified() => {}
                _ = sleep => {}
            }
        }
    }

    /// Keys ready or delayed, plus keys in processing.
    pub fn pending(&self) -> usize {
        let q = self.queue();
        q.depth() + q.delayed() + q.in_flight()
    }

    /// Ends the processing of `key` and wakes a worker if the key is ready again.
    pub fn done(&self, key: &ObjectKey, outcome: Outcome) -> Option<std::time::Duration> {
        let mut queue = self.queue();
        let retry = queue.done(key, outcome, Instant::now());
        let ready = queue.depth() > 0;
        let due = queue.next_due();
        drop(queue);
        if ready || due.is_some() {
            // A worker sleeping until an earlier deadline must learn of a new one.
            self.wake.notify_one();
        }
        retry
    }
}

/// All shards.
#[derive(Debug)]
pub struct Shards {
    shards: Vec<Shard>,
}

impl Shards {
    pub fn new(count: usize, backoff: Backoff) -> Self {
        assert!(count > 0, "at least one shard");
        Shards {
            shards: (0..count)
                .map(|index| Shard {
                    index,
                    queue: Mutex::new(Queue::new(backoff)),
                    wake: Notify::new(),
                })
                .collect(),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Shard> {
        self.shards.iter()
    }

    pub fn len(&self) -> usize {
        self.shards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// The shard that owns `key` by name.
    pub fn shard(&self, key: &ObjectKey) -> &Shard {
        &self.shards[shard_of(key, self.shards.len())]
    }

    /// Shard `index`.
    pub fn get(&self, index: usize) -> &Shard {
        &self.shards[index]
    }

    /// Queues `key` on its shard by name; false when it was already queued (or marked
    /// dirty).
    pub fn add(&self, key: ObjectKey) -> bool {
        self.shard(&key).add(key, Lane::Changed)
    }

    /// Queues `key` in `lane` on shard `index`; false when it was already queued (or marked
    /// dirty).
    pub fn add_to(&self, index: usize, key: ObjectKey, lane: Lane) -> bool {
        self.shards[index].add(key, lane)
    }

    /// Per shard: ready keys, seconds of unfinished work, longest running seconds.
    pub fn snapshot(&self) -> Vec<QueueState> {
        let now = Instant::now();
        self.shards
            .iter()
            .map(|s| {
                let q = s.queue();
                let (sum, longest) = q.unfinished(now);
                QueueState {
                    depth: q.depth(),
                    unfinished_seconds: sum.as_secs_f64(),
                    longest_seconds: longest.as_secs_f64(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_choice_is_stable_and_spread() {
        // Pinned values: changing the hash would move keys between shards across releases.
        // FNV-1a 64 of "default/example-myresource" is reduced mod 2^30: 857930312.
        assert_eq!(
            shard_of(&ObjectKey::new("default", "example-myresource"), 1 << 30),
            857_930_312
        );
        let mut counts = [0usize; 4];
        for i in 0..4000 {
            counts[shard_of(&ObjectKey::new("ns", format!("obj-{i}")), 4)] += 1;
        }
        for c in counts {
            assert!((800..1200).contains(&c), "uneven spread {counts:?}");
        }
    }

    #[test]
    fn namespace_and_name_boundaries_matter() {
        let a = ObjectKey::new("ab", "c");
        let b = ObjectKey::new("a", "bc");
        assert_ne!(shard_of(&a, 1 << 20), shard_of(&b, 1 << 20));
    }

    #[tokio::test]
    async fn workers_get_keys_and_cancellation_stops_them() {
        let shards = Shards::new(2, Backoff::default());
        let key = ObjectKey::new("ns", "a");
        shards.add(key.clone());
        let cancel = CancellationToken::new();
        let shard = shards.shard(&key);
        let popped = shard.next(&cancel).await.unwrap();
        assert_eq!(popped.key, key);
        shard.done(&key, Outcome::Success);
        cancel.cancel();
        assert!(shard.next(&cancel).await.is_none());
    }

    #[tokio::test]
    async fn the_workers_of_one_task_take_turns() {
        const KEYS: usize = 1_000;
        let shards = Shards::new(2, Backoff::default());
        for shard in 0..2 {
            for i in 0..KEYS {
                shards.add_to(shard, ObjectKey::new("n", format!("k{i}")), Lane::Backlog);
            }
        }
        let (cancel, order) = (
            CancellationToken::new(),
            std::cell::RefCell::new(Vec::new()),
        );
        // Reconciles that need no request: nothing in the loop waits.
        let worker = |shard: &'static str, queue| {
            let (cancel, order) = (&cancel, &order);
            async move {
                for _ in 0..KEYS {
                    let popped = Shard::next(queue, cancel).await.expect("not cancelled");
                    queue.done(&popped.key, Outcome::Success);
                    order.borrow_mut().push(shard);
                }
            }
        };
        futures::future::join(worker("a", shards.get(0)), worker("b", shards.get(1))).await;
        let order = order.into_inner();
        let first_b = order.iter().position(|s| *s == "b").expect("b ran");
        assert!(
            first_b <= 1,
            "worker b's first key came after {first_b} of a's"
        );
        assert!(
            order.windows(2).all(|w| w[0] != w[1]),
            "not a key each in turn"
        );
    }

    #[tokio::test]
    async fn a_sleeping_worker_wakes_for_a_new_key() {
        let shards = std::sync::Arc::new(Shards::new(1, Backoff::default()));
        let cancel = CancellationToken::new();
        let worker = {
            let (shards, cancel) = (shards.clone(), cancel.clone());
            tokio::spawn(async move { shards.shard(&ObjectKey::new("n", "x")).next(&cancel).await })
        };
        tokio::task::yield_now().await;
        shards.add(ObjectKey::new("n", "x"));
        assert_eq!(worker.await.unwrap().unwrap().key.name, "x");
    }
}
