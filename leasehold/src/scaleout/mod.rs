//! Scale-out: S shard Leases instead of one, each with its own fence, led by different
//! replicas; a *member Lease* per replica; and a plan every replica computes alike from
//! what it sees, so that each shard is led by one replica and kept warm by others.
//!
//! - [`ShardKey`]: which shard an object belongs to (the FNV-1a hash of its owner's uid, as
//!   the API server hashes for `shardSelector`), and the selectors that list one shard;
//! - [`assignment`]: the plan (fair, sticky, warm takeover), a pure function;
//! - [`Membership`]: renews this replica's member Lease, watches the group, keeps the plan
//!   and tells the shard caches ([`ShardCaches`]) and elections what to do;
//! - [`ShardGroup`]: runs the membership and one [`crate::Campaign`] per shard.
//!
//! Invariants (each shard is the single-Lease election in miniature): a shard's writes
//! pass only its own fence, opened only by its own Lease's election, so no object is
//! written by two replicas at once for the same reasons as with one Lease; the plan only
//! steers who campaigns. Shutdown: leave the group first (so the others plan without this
//! replica), then end every shard's term and release its Lease, each in the single Lease's
//! order.
//!
//! Not promised: balance while replicas disagree about who is live (at most a lease
//! duration); a server without `shardSelector` makes every replica list every object
//! (filter on the client side, [`selector::serves_shard_selector`]).

pub mod assignment;
pub mod membership;
pub mod selector;
pub mod shard_key;

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use assignment::Intent;
pub use membership::{Member, Membership, ShardCaches, group_labels, member_lease, shard_lease};
pub use shard_key::ShardKey;

use crate::candidate::Candidate;
use crate::election::{GroupStore, KubeLeases, Seat};
use crate::fence::Fence;

/// Everything a scale-out replica's group runs with.
pub struct ShardGroup<C, S = KubeLeases> {
    /// Who this replica is in which group.
    pub member: Member<S>,
    /// The shard caches the plan steers.
    pub caches: C,
    /// One fence per shard, in order; give each to the shard's fenced client.
    pub fences: Vec<Fence>,
    /// How long a shutdown waits for each shard's term to stop.
    pub grace: Duration,
}

impl<C: ShardCaches, S: GroupStore> ShardGroup<C, S> {
    /// Runs the group's part of this replica until `stop` resolves; then leaves the group
    /// and releases every shard (see the module doc). `term(shard, cancel)` runs shard
    /// `shard`'s term while this replica leads it, as [`crate::Campaign::run`] does.
    pub async fn run<T, F>(self, stop: impl Future<Output = ()>, term: T)
    where
        T: Fn(usize, CancellationToken) -> F + Clone + Send + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let m = &self.member;
        assert_eq!(self.fences.len(), m.key.shards(), "one fence per shard");
        let (intent, intent_rx) = watch::channel(Intent::default());
        let stopping = CancellationToken::new();
        let mut leaderships = Vec::new();
        let mut terms = Vec::new();
        for (shard, fence) in self.fences.iter().enumerate() {
            let lease = shard_lease(&m.group, shard);
            let campaign = Candidate::new(&m.identity, lease, m.leases.namespace(), m.timings)
                .in_pod(m.pod.clone())
                .replicas(m.replicas.clone())
                .labelled(group_labels(&m.group))
                .seat(Seat {
                    shard,
                    intent: intent_rx.clone(),
                })
                .observer(m.observer.clone())
                .wall_clock(m.wall.clone())
                .spawn(m.leases.clone(), fence.clone());
            leaderships.push(campaign.leadership().clone());
            let (stopping, term) = (stopping.clone(), term.clone());
            terms.push(tokio::spawn(campaign.run(
                self.grace,
                async move { stopping.cancelled().await },
                move |cancel| term(shard, cancel),
            )));
        }
        let leave = CancellationToken::new();
        let members = tokio::spawn(
            Membership {
                member: self.member,
                caches: self.caches,
                leaderships,
                intent,
            }
            .run(leave.clone()),
        );
        stop.await;
        info!("leaving the shard group, then releasing every shard");
        leave.cancel();
        if let Err(err) = members.await {
            warn!(error = %err, "the membership task failed");
        }
        stopping.cancel();
        for term in terms {
            if let Err(err) = term.await {
                warn!(error = %err, "a shard's leadership task failed");
            }
        }
    }
}
