//! Scale-out mode's wiring: S shard Leases, each with its own fence, fenced client,
//! leadership and election, steered by the replica's [`Membership`].
//!
//! Invariants (each shard is the single-Lease operator in miniature):
//! - a shard's writes pass only its own fence, opened only by its own Lease's election; a
//!   MyResource's writes go through its shard's client, so no key is written by two
//!   replicas at once for the same reasons as with one Lease;
//! - a shard's term runs only its queue's workers, over the keys of its cache;
//! - shutdown: leave the group first (so the others plan without this replica), then end
//!   every shard's term and release its Lease, each in the single Lease's order.

use std::future::Future;
use std::sync::Arc;

use anyhow::Result;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::assignment::Intent;
use crate::cache::Caches;
use crate::controller::Controller;
use crate::echo::Echoes;
use crate::election::{Driver, Elector, Seat, Timings};
use crate::events::Publisher;
use crate::fence::Fence;
use crate::kubeclient::{self, Clients};
use crate::leadership::{self, Leadership, Terms};
use crate::membership::{self, Membership};
use crate::metrics::Metrics;
use crate::pod::PodInfo;
use crate::reconcile::Context;
use crate::replicas::Replicas;
use crate::shardkey::ShardKey;

/// Everything a scale-out replica runs with.
pub struct ScaleOut {
    pub key: ShardKey,
    pub standbys: usize,
    /// The watched namespaces (empty: all).
    pub namespaces: Vec<String>,
    pub identity: String,
    /// The group's name: the base Lease name.
    pub group: String,
    pub lease_namespace: String,
    pub timings: Timings,
    pub pod: Option<PodInfo>,
    pub replicas: Option<Replicas>,
    pub clients: Clients,
    pub caches: Caches,
    pub controller: Arc<Controller>,
    pub echoes: Arc<Echoes>,
    pub metrics: Arc<Metrics>,
    pub workers_per_shard: usize,
    pub grace: std::time::Duration,
}

/// Whether the API server filters lists and watches by `shardSelector`; says which way
/// this replica filters, in its log and metrics. Asked of ConfigMaps in a watched
/// namespace: the feature gate is server-wide, and kube-apiserver 1.37 filters custom
/// resources by it but echoes `shardInfo` only on built-in lists.
async fn probe(
    client: &kube::Client,
    namespaces: &[String],
    key: ShardKey,
    metrics: &Metrics,
) -> bool {
    use kube::Resource;
    let path = ConfigMap::url_path(&(), namespaces.first().map(String::as_str));
    let served = match kubeclient::serves_shard_selector(client, &path, &key.selector(0)).await {
        Ok(served) => served,
        Err(err) => {
            warn!(error = %format!("{err:#}"), "could not tell whether the API server serves shardSelector; filtering on the client side");
            false
        }
    };
    if served {
        info!(
            "the API server serves shardSelector: each replica lists and watches only its shards' MyResources"
        );
    } else {
        warn!(
            "the API server ignores shardSelector (feature gate ShardedListAndWatch off): each replica lists every MyResource and keeps only its shards' (ConfigMaps are still filtered on the server, by their bucket label)"
        );
    }
    metrics.shard_filter(served);
    served
}

/// Runs the shard group's part of this replica until `stop` resolves; then leaves the
/// group and releases every shard (see the module doc).
pub async fn run(s: ScaleOut, stop: impl Future<Output = ()>) -> Result<()> {
    let server_side = probe(&s.clients.reconcile, &s.namespaces, s.key, &s.metrics).await;
    let (intent, intent_rx) = watch::channel(Intent::default());
    let api: Api<Lease> = Api::namespaced(s.clients.election.clone(), &s.lease_namespace);
    let stopping = CancellationToken::new();
    let mut leaderships = Vec::new();
    let mut terms = Vec::new();
    for shard in 0..s.key.shards() {
        let fence = Fence::default();
        let client = s.clients.fenced(fence.clone())?;
        let lease = membership::shard_lease(&s.group, shard);
        let leadership = Leadership::new(fence.clone(), &lease, &s.identity, s.metrics.clone());
        let ctx = Arc::new(Context {
            client: client.clone(),
            caches: s.caches.clone(),
            echoes: s.echoes.clone(),
            events: Publisher::new(client, "myresource-operator", &s.identity),
            fence,
            shard: Some((s.key, shard)),
        });
        let elector = Elector::new(&s.identity, &lease, &s.lease_namespace, s.timings)
            .in_pod(s.pod.clone())
            .labelled(membership::group_labels(&s.group));
        let stop_election = CancellationToken::new();
        let election = tokio::spawn(
            Driver {
                replicas: s.replicas.clone(),
                api: api.clone(),
                elector,
                leadership: leadership.clone(),
                metrics: s.metrics.clone(),
                seat: Some(Seat {
                    shard,
                    intent: intent_rx.clone(),
                }),
            }
            .run(stop_election.clone()),
        );
        let term = Terms {
            controller: s.controller.clone(),
            ctx,
            workers_per_shard: s.workers_per_shard,
            shard: Some(shard),
            grace: s.grace,
        };
        let stopping = stopping.clone();
        terms.push(tokio::spawn(leadership::run(
            leadership.clone(),
            term,
            (election, stop_election),
            async move { stopping.cancelled().await },
        )));
        leaderships.push(leadership);
    }
    let leave = CancellationToken::new();
    let members = tokio::spawn(
        Membership {
            api,
            identity: s.identity.clone(),
            group: s.group.clone(),
            key: s.key,
            standbys: s.standbys,
            timings: s.timings,
            server_side,
            caches: s.caches.clone(),
            leaderships,
            intent,
            reachability: s.clients.reachability.clone(),
            metrics: s.metrics.clone(),
            pod: s.pod.clone(),
            replicas: s.replicas.clone(),
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
    Ok(())
}
