//! The simulated world of one history: the API server, the replicas' processes and the
//! faults in force, behind one lock, on tokio's paused clock (a current-thread runtime
//! whose time jumps to the next timer whenever every task waits).
//!
//! Invariants: nothing here touches a real socket, clock or thread, and every choice is
//! drawn from the history's seed in the order the single-threaded scheduler runs, so a
//! seed replays byte for byte. The lock is never held across an `.await`.

use std::fmt::Display;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube_leasehold::Fence;
use kube_leasehold::clock::WallClock;
use kube_leasehold::observe::Observer;
use kube_leasehold::retry::Reachability;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use kube_leasehold::replicas::Pods;

use crate::history::History;
use crate::rng::Rng;
use crate::server::Server;

/// Its namespace.
pub const NAMESPACE: &str = "sim";
/// True wall time at the start of every history (2027-01-15).
const EPOCH_SECONDS: i64 = 1_800_000_000;

/// One process: an incarnation of a replica.
pub struct Process {
    /// The replica slot it runs in.
    pub replica: usize,
    /// Its fences, one per election (what the checker asks at the end: does it believe it
    /// leads?).
    pub fences: Vec<Fence>,
    /// Not killed and not exited.
    pub alive: bool,
    /// When it started.
    pub started: Duration,
    /// Cancelled for a graceful shutdown (SIGTERM).
    pub stop: CancellationToken,
    /// Set once its campaign returned.
    pub exited: watch::Sender<bool>,
    /// The API server's returns, as its client records every answer (what cuts a
    /// failed watch's backoff short).
    pub reachability: Reachability,
}

/// The truth about one slot's container, which its kubelet reports.
#[derive(Debug, Clone, Default)]
pub struct Container {
    /// The process running in it.
    pub running: Option<usize>,
    /// The last process that ended in it, and its exit code.
    pub ended: Option<(usize, i32)>,
    /// Restarts so far.
    pub restarts: i32,
}

/// What holds per replica slot (its Pod and node), whichever process runs in it.
pub struct Slot {
    /// Its current process.
    pub pid: usize,
    /// Partitions in force.
    pub partitioned: usize,
    /// Freezes in force (`true` while any).
    pub frozen: watch::Sender<bool>,
    freezes: usize,
    /// Lease-request throttles in force.
    pub throttled: usize,
    /// Its node's wall clock steps so far, in microseconds.
    pub stepped: i64,
    /// Its container, as its kubelet reports it.
    pub container: Container,
    /// Silences of its kubelet in force.
    pub kubelet_silent: watch::Sender<usize>,
}

/// Everything that changes.
pub struct State {
    /// Every choice the world makes.
    pub rng: Rng,
    /// The API server.
    pub server: Server,
    /// Every process that ever ran, by pid.
    pub processes: Vec<Process>,
    /// The replica slots.
    pub slots: Vec<Slot>,
    /// Outages in force, and whether connections are refused in the last one.
    pub outages: usize,
    /// Whether a refused outage is in force.
    pub refused: bool,
    /// The slow periods in force (each request waits up to the largest).
    pub slow: Vec<Duration>,
    /// Every Lease request sent: (pid, the Lease or "group" for the group's list and watch,
    /// when).
    pub lease_requests: Vec<(usize, String, Duration)>,
    /// Every time a process's fence opened on a new term: (pid, Lease, when).
    pub led: Vec<(usize, String, Duration)>,
    /// The replicas' Pods, as the API server serves them.
    pub pods: watch::Sender<Arc<Pods>>,
    /// The trace, when kept.
    pub trace: Option<Vec<String>>,
}

/// The world, shared by every task of a history.
#[derive(Clone)]
pub struct World {
    state: Arc<Mutex<State>>,
    start: tokio::time::Instant,
    /// The history being run.
    pub history: Arc<History>,
}

impl World {
    /// A world for `history`, starting now on tokio's (paused) clock.
    pub fn new(history: History, trace: bool) -> World {
        let slots = history
            .replicas
            .iter()
            .map(|_| Slot {
                pid: usize::MAX,
                partitioned: 0,
                frozen: watch::channel(false).0,
                freezes: 0,
                throttled: 0,
                stepped: 0,
                container: Container::default(),
                kubelet_silent: watch::channel(0).0,
            })
            .collect();
        World {
            state: Arc::new(Mutex::new(State {
                rng: Rng::new(history.seed.rotate_left(17) ^ 0x5EED),
                server: Server::default(),
                processes: Vec::new(),
                slots,
                outages: 0,
                refused: false,
                slow: Vec::new(),
                lease_requests: Vec::new(),
                led: Vec::new(),
                pods: watch::channel(Arc::new(Pods::new())).0,
                trace: trace.then(Vec::new),
            })),
            start: tokio::time::Instant::now(),
            history: Arc::new(history),
        }
    }

    /// The state, locked (never across an `.await`).
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("world lock")
    }

    /// Simulated time since the start.
    pub fn now(&self) -> Duration {
        tokio::time::Instant::now() - self.start
    }

    /// The instant `at` after the start.
    pub fn instant(&self, at: Duration) -> tokio::time::Instant {
        self.start + at
    }

    /// Appends a line to the trace (when kept): simulated time, who, and what.
    pub fn trace(&self, who: &str, what: impl Display) {
        let now = self.now();
        let mut state = self.lock();
        if let Some(trace) = state.trace.as_mut() {
            trace.push(format!("{:>11.6}s {who:<8} {what}", now.as_secs_f64()));
        }
    }

    /// Whether the trace is kept.
    pub fn tracing(&self) -> bool {
        self.lock().trace.is_some()
    }

    /// Who a process is, for the trace: `r1#4` (replica 1, pid 4).
    pub fn who(&self, pid: usize) -> String {
        format!("r{}#{pid}", self.lock().processes[pid].replica)
    }

    /// The wall time on `replica`'s node.
    pub fn wall(&self, replica: usize) -> Timestamp {
        let r = &self.history.replicas[replica];
        let skew = r.skew.as_micros() as i64 * if r.behind { -1 } else { 1 };
        let stepped = self.lock().slots[replica].stepped;
        let micros = EPOCH_SECONDS * 1_000_000 + self.now().as_micros() as i64 + skew + stepped;
        Timestamp::from_microsecond(micros).expect("a wall time within jiff's range")
    }

    /// True wall time (the foreign writer's clock).
    pub fn true_wall(&self) -> Timestamp {
        Timestamp::from_microsecond(EPOCH_SECONDS * 1_000_000 + self.now().as_micros() as i64)
            .expect("a wall time within jiff's range")
    }

    /// Whether process `pid` is alive, and whether it is cut off from the API server now
    /// (partitioned, or a hanging outage).
    pub fn reach(&self, pid: usize) -> (bool, bool) {
        let state = self.lock();
        let process = &state.processes[pid];
        let slot = &state.slots[process.replica];
        let cut = slot.partitioned > 0 || (state.outages > 0 && !state.refused);
        (process.alive, cut)
    }

    /// Waits while `replica` is frozen.
    pub async fn unfrozen(&self, replica: usize) {
        let mut frozen = self.lock().slots[replica].frozen.subscribe();
        let _ = frozen.wait_for(|f| !*f).await;
    }

    /// Starts or ends a freeze of `replica`.
    pub fn freeze(&self, replica: usize, on: bool) {
        let mut state = self.lock();
        let slot = &mut state.slots[replica];
        if on {
            slot.freezes += 1;
        } else {
            slot.freezes -= 1;
        }
        slot.frozen.send_replace(slot.freezes > 0);
    }
}

/// A node's wall clock, as a process on it reads it.
pub struct NodeWall {
    /// The world.
    pub world: World,
    /// The node's replica slot.
    pub replica: usize,
}

impl WallClock for NodeWall {
    fn now(&self) -> Timestamp {
        self.world.wall(self.replica)
    }
}

/// Puts a process's leadership changes in the trace.
pub struct Traced {
    /// The world.
    pub world: World,
    /// The process.
    pub pid: usize,
}

impl Observer for Traced {
    fn became_leader(&self, lease: &str) {
        let now = self.world.now();
        self.world.lock().led.push((self.pid, lease.into(), now));
        if self.world.tracing() {
            let who = self.world.who(self.pid);
            self.world
                .trace(&who, format!("leads {lease}: its fence opens"));
        }
    }

    fn shards(&self, led: usize, cached: usize, members: usize) {
        if self.world.tracing() {
            let who = self.world.who(self.pid);
            self.world.trace(
                &who,
                format!("plans: leads {led} shards, caches {cached}, sees {members} members"),
            );
        }
    }

    fn leading(&self, lease: &str, leading: bool) {
        if !leading && self.world.tracing() {
            let who = self.world.who(self.pid);
            self.world
                .trace(&who, format!("does not lead {lease}: its fence is closed"));
        }
    }
}
