//! The term lifecycle of one Lease: the one place that opens and closes the fence,
//! publishes the role, reports `leader_election_master_status`, runs the work of a term,
//! and orders a shutdown.
//!
//! Invariants:
//! - a term begins only through [`Leadership::extend`] (called by the election after a
//!   successful acquire) and ends only through [`Leadership::step_down`]; stepping down
//!   closes the fence *first*, so no write starts after the decision, then sets the metric
//!   and publishes [`Role::Follower`], which cancels the term's workers;
//! - once shut down, nothing reopens the fence: a renew that lands during the shutdown
//!   cannot start a new term;
//! - shutdown order: close the fence, cancel the workers and wait for them (bounded by the
//!   grace period), then stop the election, which releases the Lease once every write the
//!   term let through is settled ([`Leadership::writes_settled`]). The release comes last
//!   so a follower that takes over at once never overlaps with our writes. A handoff
//!   (scale-out mode: a shard given to another replica) keeps the same order: the election
//!   steps down, waits until the term's workers have stopped ([`Leadership::wait_idle`]),
//!   then releases.
//!
//! One `Leadership` per Lease: one per replica, or in scale-out mode one per shard Lease,
//! each with its own fence.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn};

use crate::fence::{Fence, Settled};
use crate::observe::Observer;

/// Leadership as the rest of the process sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// No term runs: the fence is closed.
    Follower,
    /// A term runs: the fence is open until the renew deadline of the last renewal.
    Leader,
}

/// Why a term ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The Lease was lost: a renew deadline passed, or someone else changed or deleted it.
    Lost,
    /// The process is stopping.
    Shutdown,
    /// This replica gives the Lease to another (scale-out rebalancing); it may lead it
    /// again later.
    Handoff,
}

impl Transition {
    fn as_str(self) -> &'static str {
        match self {
            Transition::Lost => "lost",
            Transition::Shutdown => "shutdown",
            Transition::Handoff => "handoff",
        }
    }
}

/// One Lease's leadership, shared by the election (which reports terms) and the term loop
/// (which runs them).
#[derive(Clone)]
pub struct Leadership {
    fence: Fence,
    observer: Arc<dyn Observer>,
    lease: String,
    identity: String,
    /// Whether the process is shutting down; its lock also orders every transition.
    shut_down: Arc<Mutex<bool>>,
    /// The role, and where the term loop follows it.
    role: Arc<watch::Sender<Role>>,
    /// Whether a term's workers may still run: set when a term begins, cleared by the term
    /// loop once they have stopped.
    running: Arc<watch::Sender<bool>>,
}

impl Leadership {
    /// A follower with a closed fence, for the Lease `lease`.
    pub fn new(fence: Fence, lease: &str, identity: &str, observer: Arc<dyn Observer>) -> Self {
        let leadership = Leadership {
            fence,
            observer,
            lease: lease.into(),
            identity: identity.into(),
            shut_down: Arc::default(),
            role: Arc::new(watch::channel(Role::Follower).0),
            running: Arc::new(watch::channel(false).0),
        };
        leadership.set_status(false);
        leadership
    }

    /// Follows the role.
    pub fn subscribe(&self) -> watch::Receiver<Role> {
        self.role.subscribe()
    }

    /// Whether a term is running.
    pub fn is_leading(&self) -> bool {
        *self.role.borrow() == Role::Leader
    }

    /// The Lease this leadership is of.
    pub fn lease(&self) -> &str {
        &self.lease
    }

    /// Waits until every write the term let through is settled (answered, or past the
    /// deadline until which the server may apply it); `false` when not by `limit`.
    pub async fn writes_settled(&self, limit: Instant) -> bool {
        self.fence.wait_settled(limit).await
    }

    /// Where the writes the term let through stand.
    pub fn writes(&self) -> Settled {
        self.fence.settled()
    }

    /// Waits until no worker of a term runs (at once if none does).
    pub async fn wait_idle(&self) {
        let mut running = self.running.subscribe();
        let _ = running.wait_for(|r| !*r).await;
    }

    fn set_status(&self, leading: bool) {
        self.observer.leading(&self.lease, leading);
    }

    /// Opens (or keeps open) the fence until `until`; begins a term if none runs. Does
    /// nothing once shut down.
    pub fn extend(&self, until: Instant) {
        let shut_down = self.shut_down.lock().expect("leadership lock");
        if *shut_down {
            return;
        }
        self.fence.extend(until);
        if self.is_leading() {
            return;
        }
        let span = info_span!("leader_election", transition = "acquired", identity = %self.identity, lease = %self.lease);
        let _entered = span.enter();
        info!(identity = %self.identity, lease = %self.lease, "acquired the Lease: leading");
        self.observer.became_leader(&self.lease);
        self.set_status(true);
        self.running.send_replace(true);
        self.role.send_replace(Role::Leader);
    }

    /// Ends the term, if one runs: fence closed first, then the metric and the role.
    pub fn step_down(&self, transition: Transition, why: &str) {
        let mut shut_down = self.shut_down.lock().expect("leadership lock");
        self.fence.revoke();
        if transition == Transition::Shutdown {
            *shut_down = true;
        }
        if !self.is_leading() {
            return;
        }
        let span = info_span!("leader_election", transition = transition.as_str(), identity = %self.identity, why);
        let _entered = span.enter();
        match transition {
            Transition::Lost => warn!(
                identity = %self.identity,
                why, "lost leadership: stopping workers, staying a follower"
            ),
            Transition::Shutdown => info!(identity = %self.identity, why, "stepping down"),
            Transition::Handoff => info!(
                identity = %self.identity,
                lease = %self.lease,
                why,
                "handing the Lease over: stopping workers, then releasing"
            ),
        }
        self.set_status(false);
        self.role.send_replace(Role::Follower);
    }
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("lease", &self.lease)
            .field("identity", &self.identity)
            .field("role", &*self.role.borrow())
            .finish_non_exhaustive()
    }
}

/// Runs `term` whenever this replica leads, until `stop` resolves; then shuts down in the
/// order of the module doc, waiting at most `grace` for the term to stop. `election` is
/// the election's task and its stop token. A term is given a token cancelled when it
/// ends; it must stop soon after (its writes are refused from that moment anyway).
pub(crate) async fn run<T, F>(
    leadership: Leadership,
    grace: Duration,
    election: (tokio::task::JoinHandle<()>, CancellationToken),
    stop: impl std::future::Future<Output = ()>,
    mut term: T,
) where
    T: FnMut(CancellationToken) -> F,
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let mut role = leadership.subscribe();
    let mut running: Option<(CancellationToken, tokio::task::JoinHandle<()>)> = None;
    tokio::pin!(stop);
    loop {
        tokio::select! {
            biased;
            changed = role.changed() => {
                if changed.is_err() {
                    break;
                }
                let now = *role.borrow_and_update();
                match (now, running.is_some()) {
                    (Role::Leader, false) => {
                        let cancel = CancellationToken::new();
                        let handle = tokio::spawn(term(cancel.clone()));
                        running = Some((cancel, handle));
                    }
                    (Role::Follower, _) => {
                        if let Some((cancel, handle)) = running.take() {
                            cancel.cancel();
                            let _ = handle.await;
                        }
                        leadership.running.send_replace(false);
                    }
                    (Role::Leader, true) => {}
                }
            }
            _ = &mut stop => break,
        }
    }
    info!("shutting down: stopping the term, then releasing the Lease");
    leadership.step_down(Transition::Shutdown, "shutting down");
    if let Some((cancel, handle)) = running.take() {
        cancel.cancel();
        if tokio::time::timeout(grace, handle).await.is_err() {
            warn!(?grace, "the term did not stop within the grace period");
        }
    }
    leadership.running.send_replace(false);
    let (handle, stop_election) = election;
    stop_election.cancel();
    if let Err(err) = handle.await {
        warn!(error = %err, "the election task failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_term_opens_the_fence_and_stepping_down_closes_it_first() {
        let fence = Fence::default();
        let leadership = Leadership::new(
            fence.clone(),
            "leadership-test",
            "me",
            Arc::new(crate::observe::Silent),
        );
        let role = leadership.subscribe();
        let t = Instant::now();
        leadership.extend(t + Duration::from_secs(5));
        assert!(leadership.is_leading());
        assert!(*leadership.running.borrow(), "a term's workers may run");
        assert_eq!(*role.borrow(), Role::Leader);
        assert!(fence.deadline_at(t).is_ok());
        leadership.step_down(Transition::Lost, "test");
        assert!(fence.deadline_at(t).is_err());
        assert_eq!(*role.borrow(), Role::Follower);
        // A later term may begin again after a loss …
        leadership.extend(t + Duration::from_secs(5));
        assert!(leadership.is_leading());
        // … but never after a shutdown, even if a renew lands late.
        leadership.step_down(Transition::Shutdown, "test");
        leadership.extend(t + Duration::from_secs(5));
        assert!(!leadership.is_leading());
        assert!(fence.deadline_at(t).is_err());
    }
}
