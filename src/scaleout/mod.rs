//! Scale-out mode's wiring onto `kube_leasehold::scaleout`: the one seam through which
//! scale-out enters the operator. It gives the crate's [`ShardGroup`] the operator's shard
//! caches ([`ShardCaches`] over [`Caches`]) and, per shard, a term that runs that shard's
//! queue over a client fenced by that shard's Lease.
//!
//! Invariants (each shard is the single-Lease operator in miniature; the crate's
//! `scaleout` module states the rest):
//! - a MyResource's writes go through its shard's client, fenced by its shard's Lease;
//! - a shard's term runs only its queue's workers, over the keys of its cache.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;

use anyhow::Result;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube_leasehold::fence::Fence;
use kube_leasehold::replicas::Replicas;
use kube_leasehold::replicas::this_pod::PodInfo;
use kube_leasehold::scaleout::selector::serves_shard_selector;
use kube_leasehold::scaleout::{Member, ShardCaches, ShardGroup, ShardKey, shard_lease};
use kube_leasehold::{KubeLeases, Timings};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::cache::Caches;
use crate::control::controller::Controller;
use crate::control::echo::Echoes;
use crate::control::events::{Publisher, counted};
use crate::control::reconcile::Context;
use crate::infra::kubeclient::Clients;
use crate::infra::metrics::Metrics;

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
    let served = match serves_shard_selector(client, &path, &key.selector(0)).await {
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

/// The operator's caches as the plan steers them: each shard's MyResources (filtered on
/// the server when it serves `shardSelector`) and ConfigMaps.
struct ShardedCaches {
    caches: Caches,
    key: ShardKey,
    server_side: bool,
}

impl ShardCaches for ShardedCaches {
    fn cache_shards(&self, shards: &BTreeSet<usize>) {
        self.caches.watch_shards(shards, self.key, self.server_side);
    }

    fn cached_shards(&self) -> BTreeSet<usize> {
        self.caches.cached_shards()
    }

    fn warm_shards(&self) -> BTreeSet<usize> {
        self.caches.warm_shards()
    }

    fn subscribe_warmed(&self) -> watch::Receiver<u64> {
        self.caches.subscribe_warmed()
    }
}

/// Runs the shard group's part of this replica until `stop` resolves; then leaves the
/// group and releases every shard (see `kube_leasehold::scaleout`).
pub async fn run(s: ScaleOut, stop: impl Future<Output = ()>) -> Result<()> {
    let server_side = probe(&s.clients.reconcile, &s.namespaces, s.key, &s.metrics).await;
    let fences: Vec<Fence> = (0..s.key.shards()).map(|_| Fence::default()).collect();
    let mut contexts = Vec::new();
    for (shard, fence) in fences.iter().enumerate() {
        let client = s.clients.fenced(fence.clone())?;
        contexts.push(Arc::new(Context {
            client: client.clone(),
            caches: s.caches.clone(),
            echoes: s.echoes.clone(),
            events: Publisher::new(client, "myresource-operator", &s.identity)
                .on_fate(counted(&s.metrics)),
            fence: fence.clone(),
            shard: Some((s.key, shard)),
        }));
    }
    let (controller, workers, group) = (s.controller, s.workers_per_shard, s.group.clone());
    let term = move |shard: usize, cancel| {
        let (controller, ctx) = (controller.clone(), contexts[shard].clone());
        let lease = shard_lease(&group, shard);
        async move {
            controller
                .lead(ctx, workers, Some(shard), &lease, cancel)
                .await
        }
    };
    let member = Member {
        leases: KubeLeases::new(Api::namespaced(
            s.clients.election.clone(),
            &s.lease_namespace,
        )),
        wall: kube_leasehold::clock::system_wall(),
        identity: s.identity,
        group: s.group,
        key: s.key,
        standbys: s.standbys,
        timings: s.timings,
        reachability: s.clients.reachability.clone(),
        observer: s.metrics,
        pod: s.pod,
        replicas: s.replicas,
    };
    ShardGroup {
        member,
        caches: ShardedCaches {
            caches: s.caches,
            key: s.key,
            server_side,
        },
        fences,
        grace: s.grace,
    }
    .run(stop, term)
    .await;
    Ok(())
}
