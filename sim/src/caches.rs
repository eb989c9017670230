//! A scale-out replica's shard caches, as the membership steers them: a shard it is told
//! to cache lists for a while (drawn from the seed) and is then warm; a shard it is told
//! to drop is neither cached nor warm from then on.
//!
//! It stands in for the operator's informers, whose own behaviour is not simulated: only
//! what the membership sees of them (which shards are cached, which have listed, and when
//! that changes).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube_leasehold::scaleout::ShardCaches;
use tokio::sync::watch;

use crate::world::World;

/// How long a shard's first list takes.
const LISTING: (Duration, Duration) = (Duration::from_millis(50), Duration::from_millis(2000));

/// Which shards are cached and which of them have listed.
#[derive(Default)]
struct Shards {
    warm: BTreeSet<usize>,
    /// Counts caches started, so that a list that outlived its shard's drop does not warm
    /// the shard's next cache.
    started: u64,
    /// The cached shards, each with the count its cache started at.
    since: std::collections::BTreeMap<usize, u64>,
}

/// One process's shard caches.
#[derive(Clone)]
pub struct Caches {
    world: World,
    shards: Arc<Mutex<Shards>>,
    warmed: Arc<watch::Sender<u64>>,
}

impl Caches {
    /// Caches with nothing cached, for a process of `world`.
    pub fn new(world: World) -> Caches {
        Caches {
            world,
            shards: Arc::default(),
            warmed: Arc::new(watch::channel(0).0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shards> {
        self.shards.lock().expect("caches lock")
    }
}

impl ShardCaches for Caches {
    fn cache_shards(&self, shards: &BTreeSet<usize>) {
        let mut state = self.lock();
        let dropped = state.since.keys().any(|s| !shards.contains(s));
        let started: Vec<usize> = shards
            .iter()
            .filter(|s| !state.since.contains_key(s))
            .copied()
            .collect();
        state.warm.retain(|s| shards.contains(s));
        state.since.retain(|s, _| shards.contains(s));
        for shard in started {
            state.started += 1;
            let generation = state.started;
            state.since.insert(shard, generation);
            let listing = self.world.lock().rng.between(LISTING.0, LISTING.1);
            let caches = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(listing).await;
                let mut state = caches.lock();
                if state.since.get(&shard) == Some(&generation) {
                    state.warm.insert(shard);
                    drop(state);
                    caches.warmed.send_modify(|n| *n += 1);
                }
            });
        }
        drop(state);
        if dropped {
            self.warmed.send_modify(|n| *n += 1);
        }
    }

    fn cached_shards(&self) -> BTreeSet<usize> {
        self.lock().since.keys().copied().collect()
    }

    fn warm_shards(&self) -> BTreeSet<usize> {
        self.lock().warm.clone()
    }

    fn subscribe_warmed(&self) -> watch::Receiver<u64> {
        self.warmed.subscribe()
    }
}
