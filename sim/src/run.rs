//! Runs one history: a fresh current-thread runtime on a paused clock, the replicas
//! launched, each fault injected at its time, then the invariants checked on what the
//! simulated API server recorded.

use std::cell::RefCell;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube_leasehold::replicas::succession::SUCCESSOR;

use crate::check::{self, Facts, ProcessFacts, Violation};
use crate::history::{Fault, History, Scheduled};
use crate::replica::{ended, launch};
use crate::server::By;
use crate::world::World;

/// What a run found.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The broken invariants (none: the history passed).
    pub violations: Vec<Violation>,
    /// The trace, when asked for.
    pub trace: Vec<String>,
    /// The simulated time it covered.
    pub simulated: Duration,
}

thread_local! {
    /// Panics on this thread since the last run began (a history runs on one thread).
    static PANICS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Counts panics per thread instead of printing them; call once.
pub fn catch_panics() {
    std::panic::set_hook(Box::new(|info| {
        PANICS.with(|p| p.borrow_mut().push(info.to_string()));
    }));
}

/// Runs `history`; keeps its trace if `trace`.
pub fn run(history: &History, trace: bool) -> Outcome {
    PANICS.with(|p| p.borrow_mut().clear());
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time().start_paused(true);
    // tokio's own choices (which shard of a watch channel's waiters a receiver joins, so
    // the order they wake in) come from the runtime's generator: seeded by the history.
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(
        &history.seed.to_le_bytes(),
    ));
    let runtime = builder.build().expect("a current-thread runtime");
    // kube's watch backoff draws its jitter from this thread's generator.
    fastrand::seed(history.seed);
    let end = history.end();
    let (mut facts, trace) = runtime.block_on(async {
        let world = World::new(history.clone(), trace);
        for replica in 0..history.replicas.len() {
            launch(&world, replica);
        }
        for fault in &history.faults {
            tokio::spawn(inject(world.clone(), fault.clone()));
        }
        tokio::time::sleep_until(world.instant(end)).await;
        let now = kube_leasehold::clock::now();
        let mut state = world.lock();
        let facts = Facts {
            effects: std::mem::take(&mut state.server.effects),
            processes: state
                .processes
                .iter()
                .map(|p| ProcessFacts {
                    replica: p.replica,
                    started: p.started,
                    alive: p.alive,
                    leads: p.fences.iter().map(|f| p.alive && f.is_open(now)).collect(),
                })
                .collect(),
            lease_requests: std::mem::take(&mut state.lease_requests),
            led: std::mem::take(&mut state.led),
            end,
            panics: Vec::new(),
        };
        (facts, state.trace.take().unwrap_or_default())
    });
    // Every task of the history (the zombies of killed processes too) ends here.
    drop(runtime);
    facts.panics = PANICS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    Outcome {
        violations: check::check(history, &facts),
        trace,
        simulated: end,
    }
}

/// Injects one fault at its time, and undoes it when it is over.
async fn inject(world: World, scheduled: Scheduled) {
    let index = scheduled.number;
    tokio::time::sleep_until(world.instant(scheduled.at)).await;
    let target = world.history.target(index);
    if world.history.shards > 0 && scheduled.fault.is_foreign() {
        world.trace("fault", format!("#{index}: {} ({target})", scheduled.fault));
    } else {
        world.trace("fault", format!("#{index}: {}", scheduled.fault));
    }
    let now = world.now();
    match scheduled.fault {
        Fault::Crash { replica, down } => {
            let pid = {
                let mut state = world.lock();
                let pid = state.slots[replica].pid;
                if !state.processes[pid].alive {
                    return;
                }
                state.processes[pid].alive = false;
                pid
            };
            ended(&world, replica, pid, 137);
            tokio::time::sleep(down).await;
            if world.lock().slots[replica].pid == pid {
                launch(&world, replica);
            }
        }
        Fault::Shutdown { replica, down } => {
            let (pid, stop, mut exited) = {
                let state = world.lock();
                let pid = state.slots[replica].pid;
                let process = &state.processes[pid];
                if !process.alive {
                    return;
                }
                (pid, process.stop.clone(), process.exited.subscribe())
            };
            stop.cancel();
            // The kubelet's SIGKILL after the grace period, if it comes to that.
            let grace = Duration::from_secs(30);
            if tokio::time::timeout(grace, exited.wait_for(|e| *e))
                .await
                .is_err()
            {
                world.lock().processes[pid].alive = false;
                ended(&world, replica, pid, 137);
            }
            tokio::time::sleep(down).await;
            if world.lock().slots[replica].pid == pid {
                launch(&world, replica);
            }
        }
        Fault::Freeze { replica, lasting } => {
            world.freeze(replica, true);
            tokio::time::sleep(lasting).await;
            world.freeze(replica, false);
        }
        Fault::Partition { replica, lasting } => {
            world.lock().slots[replica].partitioned += 1;
            tokio::time::sleep(lasting).await;
            world.lock().slots[replica].partitioned -= 1;
        }
        Fault::Outage { lasting, refused } => {
            {
                let mut state = world.lock();
                state.outages += 1;
                state.refused = refused;
                state.server.end_watches();
            }
            tokio::time::sleep(lasting).await;
            world.lock().outages -= 1;
        }
        Fault::Slow { lasting, up_to } => {
            world.lock().slow.push(up_to);
            tokio::time::sleep(lasting).await;
            let mut state = world.lock();
            if let Some(i) = state.slow.iter().position(|s| *s == up_to) {
                state.slow.remove(i);
            }
        }
        Fault::KubeletSilent { replica, lasting } => {
            world.lock().slots[replica]
                .kubelet_silent
                .send_modify(|s| *s += 1);
            tokio::time::sleep(lasting).await;
            world.lock().slots[replica]
                .kubelet_silent
                .send_modify(|s| *s -= 1);
        }
        Fault::ThrottleLeases { replica, lasting } => {
            world.lock().slots[replica].throttled += 1;
            tokio::time::sleep(lasting).await;
            world.lock().slots[replica].throttled -= 1;
        }
        Fault::Delete => {
            let _ = world.lock().server.delete(now, By::Foreign, &target, None);
        }
        Fault::ClearHolder => foreign_edit(&world, &target, |lease| {
            if let Some(spec) = lease.spec.as_mut() {
                spec.holder_identity = Some(String::new());
            }
        }),
        Fault::Relabel => relabel(&world, &target, "touched-by", format!("fault-{index}")),
        Fault::Relabeler { lasting, every } => {
            let until = world.instant(scheduled.at + lasting);
            let mut round = 0;
            while tokio::time::Instant::now() + every <= until {
                tokio::time::sleep(every).await;
                round += 1;
                relabel(&world, &target, "synced", format!("fault-{index}-{round}"));
            }
        }
        Fault::NameHolder { replica } => {
            let identity = world.history.replicas[replica].identity.clone();
            let wall = MicroTime(world.true_wall());
            foreign_edit(&world, &target, |lease| {
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                spec.holder_identity = Some(identity);
                spec.acquire_time = Some(wall.clone());
                spec.renew_time = Some(wall);
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            });
        }
        Fault::ForgeSuccessor { replica } => {
            let pod = crate::pods::pod_name(replica);
            foreign_edit(&world, &target, |lease| {
                lease
                    .metadata
                    .annotations
                    .get_or_insert_default()
                    .insert(SUCCESSOR.into(), pod);
            });
        }
        Fault::StepWall { replica, by, back } => {
            let micros = by.as_micros() as i64;
            world.lock().slots[replica].stepped += if back { -micros } else { micros };
        }
        Fault::EndWatches => world.lock().server.end_watches(),
        Fault::Compact => world.lock().server.compact(),
    }
}

/// A foreign writer sets one label of the Lease `name`: a metadata-only write.
fn relabel(world: &World, name: &str, key: &str, value: String) {
    foreign_edit(world, name, |lease| {
        lease
            .metadata
            .labels
            .get_or_insert_default()
            .insert(key.into(), value);
    });
}

/// A foreign writer's read-modify-replace of the Lease `name` (nothing when it is absent).
fn foreign_edit(
    world: &World,
    name: &str,
    edit: impl FnOnce(&mut k8s_openapi::api::coordination::v1::Lease),
) {
    let now = world.now();
    let mut state = world.lock();
    if let Some(mut lease) = state.server.lease(name) {
        edit(&mut lease);
        let _ = state.server.replace(now, By::Foreign, &lease);
    }
}
