//! A replica's process: the crate's real [`Candidate`] and [`Campaign`] (elector, driver,
//! term lifecycle, fence, crash proof and successor hand-off, in its Pod) over a [`Link`]
//! to the simulated API server, or with shard Leases the crate's real [`ShardGroup`]
//! (membership, plan, one campaign per shard); and a term per Lease that writes the keys
//! its shard owns ([`ShardKey::owns`], the routing the operator uses) through the crate's
//! real [`FenceLayer`], two workers at a time, while it leads.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use kube_leasehold::clock::Wall;
use kube_leasehold::fence::FenceLayer;
use kube_leasehold::observe::Observer;
use kube_leasehold::retry::Reachability;
use kube_leasehold::scaleout::{Member, ShardGroup, ShardKey};
use kube_leasehold::{Candidate, Fence};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tower::{Layer, ServiceExt};

use crate::caches::Caches;
use crate::history::LEASE;
use crate::net::Link;
use crate::pods;
use crate::world::{NAMESPACE, NodeWall, Process, Traced, World};

/// How long a graceful shutdown waits for the term's workers.
const GRACE: Duration = Duration::from_secs(5);
/// A worker's pause between writes.
const WRITE_PAUSE: (Duration, Duration) = (Duration::from_millis(50), Duration::from_millis(400));
/// Workers per term.
const WORKERS: usize = 2;
/// Replicas besides a shard's leader that keep its cache warm.
const STANDBYS: usize = 1;

/// The uid of key `k`'s object (what its shard is computed from).
pub fn uid_of(key: &str) -> String {
    format!("uid-{key}")
}

/// Starts a new process in `replica`'s slot; returns its pid.
pub fn launch(world: &World, replica: usize) -> usize {
    let history = world.history.clone();
    let fences: Vec<Fence> = history
        .elections()
        .iter()
        .map(|_| Fence::default())
        .collect();
    let stop = CancellationToken::new();
    let reachability = Reachability::default();
    let now = world.now();
    let pid = {
        let mut state = world.lock();
        let pid = state.processes.len();
        state.processes.push(Process {
            replica,
            fences: fences.clone(),
            alive: true,
            started: now,
            stop: stop.clone(),
            exited: watch::channel(false).0,
            reachability: reachability.clone(),
        });
        state.slots[replica].pid = pid;
        pid
    };
    let spec = &history.replicas[replica];
    pods::changed(world, replica, |c| {
        if c.running.is_some() || c.ended.is_some() {
            c.restarts += 1;
        }
        c.running = Some(pid);
    });
    let in_pod = history.pods;
    let pod = in_pod.then(|| pods::pod_info(replica, pid));
    let replicas = in_pod.then(|| pods::view(world, pid, replica));
    let wall: Wall = Arc::new(NodeWall {
        world: world.clone(),
        replica,
    });
    let observer: Arc<dyn Observer> = Arc::new(Traced {
        world: world.clone(),
        pid,
    });
    let link = |shard: usize| Link {
        world: world.clone(),
        pid,
        shard,
    };
    let terms = Terms {
        world: world.clone(),
        pid,
        fences: fences.clone(),
    };
    let stopped = stop.cancelled_owned();
    let process: BoxFuture<'static, ()> = if history.shards == 0 {
        let campaign = Candidate::new(spec.identity.clone(), LEASE, NAMESPACE, spec.timings)
            .in_pod(pod)
            .replicas(replicas)
            .wall_clock(wall)
            .observer(observer)
            .spawn(link(0), fences[0].clone());
        campaign
            .run(GRACE, stopped, move |ended| terms.run(0, ended))
            .boxed()
    } else {
        let group = ShardGroup {
            member: Member {
                leases: link(0),
                wall,
                identity: spec.identity.clone(),
                group: LEASE.into(),
                key: ShardKey::new(history.shards),
                standbys: STANDBYS,
                timings: spec.timings,
                reachability,
                observer,
                pod,
                replicas,
            },
            caches: Caches::new(world.clone()),
            fences,
            grace: GRACE,
        };
        group
            .run(stopped, move |shard, ended| terms.run(shard, ended))
            .boxed()
    };
    let world = world.clone();
    tokio::spawn(async move {
        process.await;
        {
            let mut state = world.lock();
            let process = &mut state.processes[pid];
            process.alive = false;
            process.exited.send_replace(true);
        }
        ended(&world, replica, pid, 0);
    });
    pid
}

/// What a process's terms write with.
#[derive(Clone)]
struct Terms {
    world: World,
    pid: usize,
    fences: Vec<Fence>,
}

impl Terms {
    /// Shard `shard`'s term (the one Lease's: 0) until `ended`: its workers write the keys
    /// the shard owns through its fence.
    fn run(&self, shard: usize, ended: CancellationToken) -> BoxFuture<'static, ()> {
        let link = Link {
            world: self.world.clone(),
            pid: self.pid,
            shard,
        };
        let writes = FenceLayer::new(self.fences[shard].clone(), link.clone()).layer(link);
        let history = &self.world.history;
        let keys: Vec<String> = (0..history.keys)
            .map(|k| format!("key-{k}"))
            .filter(|key| {
                history.shards == 0 || ShardKey::new(history.shards).owns(shard, &uid_of(key))
            })
            .collect();
        let workers = (0..WORKERS).map(|worker| {
            work(
                self.world.clone(),
                writes.clone(),
                keys.clone(),
                ended.clone(),
                worker,
            )
        });
        futures::future::join_all(workers).map(drop).boxed()
    }
}

/// Records that process `pid` ended with `code` (if it still ran in its slot), for its
/// kubelet to report.
pub fn ended(world: &World, replica: usize, pid: usize, code: i32) {
    pods::changed(world, replica, |c| {
        if c.running == Some(pid) {
            c.running = None;
            c.ended = Some((pid, code));
        }
    });
}

/// One worker of a term: writes its share of `keys` in turn until the term ends.
async fn work<S>(
    world: World,
    writes: S,
    keys: Vec<String>,
    ended: CancellationToken,
    worker: usize,
) where
    S: tower::Service<http::Request<String>, Response = http::Response<String>> + Clone,
{
    let mut next = worker;
    loop {
        let pause = world.lock().rng.between(WRITE_PAUSE.0, WRITE_PAUSE.1);
        tokio::select! {
            biased;
            _ = ended.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        if keys.is_empty() {
            continue;
        }
        let request = http::Request::put(format!("/objects/{}", keys[next % keys.len()]))
            .body(String::new())
            .expect("a path and an empty body make a request");
        // Refused by the fence, expired, lost or failed: the next round writes again, as
        // a controller's queue retries.
        let _ = writes.clone().oneshot(request).await;
        next += WORKERS;
    }
}
