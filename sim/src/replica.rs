//! A replica's process: the crate's real [`Candidate`] and [`Campaign`] (elector, driver,
//! term lifecycle, fence, crash proof and successor hand-off, in its Pod) over a [`Link`]
//! to the simulated API server, and a term that
//! writes the history's keys through the crate's real [`FenceLayer`], two workers at a
//! time, while it leads.

use std::sync::Arc;
use std::time::Duration;

use kube_leasehold::fence::FenceLayer;
use kube_leasehold::{Candidate, Fence};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tower::{Layer, ServiceExt};

use crate::net::Link;
use crate::pods;
use crate::world::{LEASE, NAMESPACE, NodeWall, Process, Traced, World};

/// How long a graceful shutdown waits for the term's workers.
const GRACE: Duration = Duration::from_secs(5);
/// A worker's pause between writes.
const WRITE_PAUSE: (Duration, Duration) = (Duration::from_millis(50), Duration::from_millis(400));
/// Workers per term.
const WORKERS: usize = 2;

/// Starts a new process in `replica`'s slot; returns its pid.
pub fn launch(world: &World, replica: usize) -> usize {
    let fence = Fence::default();
    let stop = CancellationToken::new();
    let now = world.now();
    let pid = {
        let mut state = world.lock();
        let pid = state.processes.len();
        state.processes.push(Process {
            replica,
            fence: fence.clone(),
            alive: true,
            started: now,
            stop: stop.clone(),
            exited: watch::channel(false).0,
        });
        state.slots[replica].pid = pid;
        pid
    };
    let spec = &world.history.replicas[replica];
    let link = Link {
        world: world.clone(),
        pid,
    };
    pods::changed(world, replica, |c| {
        if c.running.is_some() || c.ended.is_some() {
            c.restarts += 1;
        }
        c.running = Some(pid);
    });
    let in_pod = world.history.pods;
    let campaign = Candidate::new(spec.identity.clone(), LEASE, NAMESPACE, spec.timings)
        .in_pod(in_pod.then(|| pods::pod_info(replica, pid)))
        .replicas(in_pod.then(|| pods::view(world, pid, replica)))
        .wall_clock(Arc::new(NodeWall {
            world: world.clone(),
            replica,
        }))
        .observer(Arc::new(Traced {
            world: world.clone(),
            pid,
        }))
        .spawn(link.clone(), fence.clone());
    let term = {
        let world = world.clone();
        move |ended: CancellationToken| {
            let writes = FenceLayer::new(fence.clone(), link.clone()).layer(link.clone());
            let world = world.clone();
            async move {
                let workers = (0..WORKERS)
                    .map(|worker| work(world.clone(), writes.clone(), ended.clone(), worker));
                futures::future::join_all(workers).await;
            }
        }
    };
    let world = world.clone();
    tokio::spawn(async move {
        campaign.run(GRACE, stop.cancelled_owned(), term).await;
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

/// One worker of a term: writes the keys it owns in turn until the term ends.
async fn work<S>(world: World, writes: S, ended: CancellationToken, worker: usize)
where
    S: tower::Service<http::Request<String>, Response = http::Response<String>> + Clone,
{
    let keys = world.history.keys;
    let mut next = worker;
    loop {
        let pause = world.lock().rng.between(WRITE_PAUSE.0, WRITE_PAUSE.1);
        tokio::select! {
            biased;
            _ = ended.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        let request = http::Request::put(format!("/objects/key-{}", next % keys))
            .body(String::new())
            .expect("a path and an empty body make a request");
        // Refused by the fence, expired, lost or failed: the next round writes again, as
        // a controller's queue retries.
        let _ = writes.clone().oneshot(request).await;
        next += WORKERS;
    }
}
