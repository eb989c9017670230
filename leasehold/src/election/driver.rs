//! The I/O half of the election: reads, writes and watches the Lease through a
//! [`LeaseStore`], feeds the [`Elector`], and tells the [`Leadership`] when a term begins,
//! continues or ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, debug_span, info, info_span, warn};

use super::{Action, Elector, LeaseEvent, LeaseStore, Read, StoreError};
use crate::bugs::{self, Bug};
use crate::clock::Wall;
use crate::fence::SETTLE_MARGIN;
use crate::observe::Observer;
use crate::replicas::{self, Replicas, succession};
use crate::scaleout::assignment::Intent;
use crate::term::{Leadership, Transition};
use crate::throttle::{Throttle, Verdict};

/// `period` stretched by `fraction` of itself (client-go's `wait.Jitter`).
pub fn jitter(period: Duration, fraction: f64) -> Duration {
    period.mul_f64(1.0 + fraction.clamp(0.0, 1.0) * JITTER)
}

/// The jitter factor of a retry after a failure.
const JITTER: f64 = 0.2;

/// A fraction in [0, 1) that differs between replicas (`identity`) and attempts
/// (`attempt`), and is the same on every run: a simulated history replays byte for byte.
fn spread(identity: &str, attempt: u64) -> f64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    (identity, attempt).hash(&mut hasher);
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// A watch that ends sooner than this after it opened is not re-opened at once.
const MIN_WATCH: Duration = Duration::from_secs(1);

/// How often a repeating failure is logged.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// The I/O half: runs one Lease's election against a [`LeaseStore`] (see the module doc
/// of [`crate::election`] for the rules). [`crate::Candidate`] builds and spawns one.
pub struct Driver<S> {
    /// Where the Lease is read and written.
    pub store: S,
    /// The decisions.
    pub elector: Elector,
    /// Told when a term begins, continues or ends.
    pub leadership: Leadership,
    /// Told how long renewals take.
    pub observer: Arc<dyn Observer>,
    /// The replicas' Pods (in a Pod only): a holder's proven crash is taken over at once,
    /// and a release names a successor.
    pub replicas: Option<Replicas>,
    /// Scale-out mode: this shard Lease's place in the replica's plan.
    pub seat: Option<Seat>,
    /// The wall time written into the records.
    pub wall: Wall,
}

/// A shard Lease's election in scale-out mode: it acquires only while the plan lets this
/// replica lead the shard, and hands the shard over when the plan says so
/// ([`crate::scaleout::assignment::intent`]). The plan decides liveness only: acquiring is
/// the same compare-and-swap, releasing the same ordered release, as for the single Lease.
pub struct Seat {
    /// The shard this Lease is of.
    pub shard: usize,
    /// The replica's plan ([`crate::scaleout::Membership`] keeps it).
    pub intent: tokio::sync::watch::Receiver<Intent>,
}

impl Seat {
    fn may_lead(&self) -> bool {
        self.intent.borrow().lead.contains(&self.shard)
    }

    /// Resolves when the plan says to hand this shard over.
    async fn hand_off_due(&mut self) {
        let shard = self.shard;
        if self
            .intent
            .wait_for(|i| i.hand_off.contains(&shard))
            .await
            .is_err()
        {
            std::future::pending::<()>().await;
        }
    }
}

/// Resolves when a seat's intent changes (never without a seat).
async fn intent_changed(intent: &mut Option<tokio::sync::watch::Receiver<Intent>>) {
    match intent {
        Some(intent) => {
            if intent.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

impl<S: LeaseStore> Driver<S> {
    /// Runs the election until `shutdown` fires; then releases the Lease if it names us.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut failures = Throttle::new(LOG_EVERY);
        // Failed attempts so far: the jitter of each pause differs.
        let mut attempts = 0u64;
        // After a failed request: no new attempt before this.
        let mut pause: Option<Instant> = None;
        // The Lease watch just delivered the record: no need to GET it again.
        let mut watched = false;
        loop {
            if let Some(until) = pause.take() {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep_until(until.into()) => {}
                }
            }
            if shutdown.is_cancelled() {
                break;
            }
            let now = crate::clock::now();
            let outcome = if self.elector.is_leader(now) {
                let at = self.elector.next_renew().unwrap_or(now);
                let hand_off = async {
                    match self.seat.as_mut() {
                        Some(seat) => seat.hand_off_due().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep_until(at.into()) => {}
                    _ = hand_off => {
                        self.hand_off().await;
                        continue;
                    }
                }
                self.attempt(true).await
            } else {
                if self.leadership.is_leading() {
                    self.elector.step_down();
                    self.leadership.step_down(
                        Transition::Lost,
                        "renew deadline passed without a successful renew",
                    );
                }
                let read = if std::mem::take(&mut watched) {
                    Ok(())
                } else {
                    self.read().await
                };
                match read {
                    Err(err) => Err(err),
                    Ok(()) => {
                        self.observe_replicas();
                        let next = self
                            .elector
                            .next_action(crate::clock::now(), self.wall.now());
                        let retry = crate::clock::now() + self.elector.timings().retry_period;
                        match next {
                            // Takeable, but the plan gives the shard to another replica.
                            Action::Create(_) | Action::Replace(_) if !self.may_lead() => {
                                tokio::select! {
                                    biased;
                                    _ = shutdown.cancelled() => break,
                                    current = self.watch_until(retry) => watched = current,
                                }
                                Ok(())
                            }
                            Action::WaitUntil(until) => {
                                let until = until.min(retry).max(crate::clock::now());
                                tokio::select! {
                                    biased;
                                    _ = shutdown.cancelled() => break,
                                    current = self.watch_until(until) => watched = current,
                                }
                                Ok(())
                            }
                            _ => self.attempt(false).await,
                        }
                    }
                }
            };
            match outcome {
                Ok(()) => {
                    if let Some(run) = failures.succeeded() {
                        info!(failures = run, "Lease requests succeed again");
                    }
                }
                Err(err) => {
                    if let Verdict::Log { suppressed } = failures.failed(crate::clock::now()) {
                        warn!(error = %err, suppressed, "Lease request failed; retrying every retry period");
                    }
                    let period = self.elector.timings().retry_period;
                    attempts += 1;
                    let fraction = spread(self.elector.identity(), attempts);
                    pause = Some(crate::clock::now() + jitter(period, fraction));
                }
            }
        }
        self.release().await;
    }

    /// Whether the plan lets this replica lead (always for the single Lease).
    fn may_lead(&self) -> bool {
        self.seat.as_ref().is_none_or(Seat::may_lead)
    }

    /// Gives a shard to the replica the plan names: ends the term (fence first), waits
    /// for its workers to stop (bounded by the renew deadline), then releases, as a
    /// shutdown does. This replica stays a follower of the shard.
    async fn hand_off(&mut self) {
        self.leadership.step_down(
            Transition::Handoff,
            "the plan gives this shard to a replica whose cache of it is warm",
        );
        let limit = self.elector.timings().renew_deadline;
        if tokio::time::timeout(limit, self.leadership.wait_idle())
            .await
            .is_err()
        {
            warn!(
                ?limit,
                "the shard's workers did not stop in time; releasing anyway"
            );
        }
        self.release().await;
    }

    /// Records what the replicas' Pods show about the holder (a proven exit) and about a
    /// named successor (no longer live); nothing outside a Pod.
    fn observe_replicas(&mut self) {
        let Some(replicas) = &self.replicas else {
            return;
        };
        let pods = replicas.pods();
        let holder = self.elector.holder().to_string();
        if let Some(exit) = pods
            .get(&holder)
            .and_then(|pod| self.elector.observe_holder_pod(pod, crate::clock::now()))
        {
            info!(
                holder,
                exit = exit.as_str(),
                "the holder's process has exited (its Pod says so): taking over without waiting for the lease"
            );
        }
        if let Some(successor) = self.elector.successor().map(str::to_string)
            && !pods.get(&successor).is_some_and(|p| succession::is_live(p))
        {
            info!(
                successor,
                "the successor named by the release is not live: taking the Lease without standing back"
            );
            self.elector.successor_lost();
        }
    }

    /// GETs the Lease and records it.
    async fn read(&mut self) -> Result<(), String> {
        let timeout = self.elector.timings().retry_period;
        let result = tokio::time::timeout(timeout, self.store.get(self.elector.name())).await;
        match result {
            Ok(Ok(Read::Found(lease))) => self.elector.observe(&lease, crate::clock::now()),
            Ok(Ok(Read::Absent { resource_version })) => self
                .elector
                .observe_absent(crate::clock::now(), Some(&resource_version)),
            Ok(Err(err)) => return Err(self.read_failed(format!("reading the Lease: {err}"))),
            Err(_) => {
                return Err(
                    self.read_failed(format!("reading the Lease timed out after {timeout:?}"))
                );
            }
        }
        if !self.elector.is_leader(crate::clock::now()) && self.leadership.is_leading() {
            self.leadership.step_down(
                Transition::Lost,
                "the Lease was changed or deleted by someone else",
            );
        }
        Ok(())
    }

    /// What a failed read changes: nothing (see the module doc), but in the simulator's
    /// re-introduced defect.
    fn read_failed(&mut self, err: String) -> String {
        if bugs::on(Bug::ReadFailureRestartsExpiry) {
            self.elector.forget_record();
        }
        err
    }

    /// One acquire or renew attempt, bounded in time (renewals are traced at debug level).
    /// A renew that conflicts with a metadata-only change is retried once at once.
    async fn attempt(&mut self, renewing: bool) -> Result<(), String> {
        let span = if renewing {
            debug_span!("leader_election.renew")
        } else {
            debug_span!("leader_election.try_acquire")
        };
        let retry = self.attempt_once(renewing).instrument(span.clone()).await?;
        if retry && self.elector.is_leader(crate::clock::now()) {
            debug!("the Lease changed in metadata only: renewing again");
            self.attempt_once(true).instrument(span).await?;
        }
        Ok(())
    }

    /// Returns whether a renew conflicted and should be retried.
    async fn attempt_once(&mut self, renewing: bool) -> Result<bool, String> {
        let started = crate::clock::now();
        let action = self.elector.next_action(started, self.wall.now());
        // Where the Lease was last seen absent: a create is ours only if nothing came first.
        let absent_at = matches!(action, Action::Create(_))
            .then(|| self.elector.observed_version().map(str::to_string))
            .flatten();
        self.elector.sending(&action);
        let timings = self.elector.timings();
        // Never past the deadline while leading; at most one retry period in any case.
        let limit = match self.elector.fence_until() {
            Some(until) if renewing => until
                .saturating_duration_since(started)
                .min(timings.retry_period),
            _ => timings.retry_period,
        };
        let request = async {
            match &action {
                Action::Create(lease) => self.store.create(lease).await.map(Some),
                Action::Replace(lease) => self.store.replace(lease).await.map(Some),
                Action::WaitUntil(_) => Ok(None),
            }
        };
        match tokio::time::timeout(limit, request).await {
            Ok(Ok(Some(written)))
                if matches!(action, Action::Create(_))
                    && !self.created_first(absent_at.as_deref(), &written).await =>
            {
                warn!(
                    "another term began and vanished unseen while the Lease was absent: \
                     leaving the Lease just created to expire before anyone leads"
                );
                self.elector.disown(&written, crate::clock::now());
                Ok(false)
            }
            Ok(Ok(Some(written))) => {
                let new_term = self.elector.succeeded(&written, started);
                if let Some(until) = self.elector.fence_until() {
                    self.leadership.extend(until);
                }
                if !new_term {
                    self.observer
                        .lease_renewed(self.elector.name(), started.elapsed());
                    debug!(took = ?started.elapsed(), "renewed the Lease");
                }
                Ok(false)
            }
            Ok(Ok(None)) => Ok(false),
            Ok(Err(StoreError::Conflict)) => {
                debug!(renewing, "Lease conflict: someone else wrote it first");
                if renewing {
                    // Read at once: a changed record ends the term now, a relabel does not.
                    self.read().await?;
                    return Ok(self.elector.is_leader(crate::clock::now()));
                }
                Ok(false)
            }
            Ok(Err(StoreError::NotFound)) => {
                self.elector.observe_absent(crate::clock::now(), None);
                if self.leadership.is_leading() {
                    self.leadership
                        .step_down(Transition::Lost, "the Lease was deleted");
                }
                Ok(false)
            }
            Ok(Err(err)) => Err(format!("writing the Lease: {err}")),
            Err(_) => Err(format!("writing the Lease timed out after {limit:?}")),
        }
    }

    /// Whether the Lease this replica just created (`written`) is the first change since
    /// `absent_at`, where it was last seen absent: the watch from there replays every
    /// change in order. If another Lease was created (and deleted) first, that term's
    /// fence may still be open, and a create carries no precondition that could have
    /// refused ours. Unknown (no version, a failed or compacted watch) counts as not first.
    async fn created_first(&self, absent_at: Option<&str>, written: &Lease) -> bool {
        let (Some(from), Some(ours)) = (absent_at, written.metadata.resource_version.as_deref())
        else {
            return false;
        };
        let limit = self.elector.timings().retry_period;
        let check = async {
            // A watch the server ends before its first event is opened again.
            loop {
                let mut events = self.store.watch(self.elector.name(), from, 1).await.ok()?;
                match events.next().await {
                    None => continue,
                    Some(Ok(LeaseEvent::Applied(lease))) => {
                        return Some(lease.metadata.resource_version.as_deref() == Some(ours));
                    }
                    Some(_) => return Some(false),
                }
            }
        };
        tokio::time::timeout(limit, check)
            .await
            .ok()
            .flatten()
            .unwrap_or(false)
    }

    /// Waits until `until`, the next change of the Lease, or a change of the replicas' Pods
    /// that lets this replica take the Lease now (a proven exit, a successor gone),
    /// whichever comes first. Returns whether the record held is current (a watch event
    /// recorded it, or the watch was live throughout), so that no GET is needed. Pod
    /// changes that decide nothing keep the watch and its connection.
    async fn watch_until(&mut self, until: Instant) -> bool {
        // A new receiver wakes once at first: a change since the caller looked is not lost.
        let mut pods = self.replicas.as_ref().map(Replicas::subscribe);
        let mut intent = self.seat.as_ref().map(|s| s.intent.clone());
        let Some(rv) = self.elector.observed_version().map(str::to_string) else {
            tokio::time::sleep_until(until.into()).await;
            return false;
        };
        // Rounded up: a server timeout shorter than the wait would leave this replica
        // blind to the Lease for the rest of it.
        let seconds = until
            .saturating_duration_since(crate::clock::now())
            .as_secs_f64()
            .ceil()
            .max(1.0) as u32;
        let deadline = tokio::time::sleep_until(until.into());
        tokio::pin!(deadline);
        let name = self.elector.name().to_string();
        let stream = tokio::select! {
            biased;
            _ = &mut deadline => return false,
            stream = self.store.watch(&name, &rv, seconds) => stream,
        };
        let Ok(stream) = stream else {
            deadline.await;
            return false;
        };
        let opened = crate::clock::now();
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                biased;
                _ = &mut deadline => return false,
                _ = replicas::changed(&mut pods) => {
                    self.observe_replicas();
                    let next = self.elector.next_action(crate::clock::now(), self.wall.now());
                    if !matches!(next, Action::WaitUntil(_)) && self.may_lead() {
                        return true;
                    }
                }
                _ = intent_changed(&mut intent) => {
                    let next = self.elector.next_action(crate::clock::now(), self.wall.now());
                    if !matches!(next, Action::WaitUntil(_)) && self.may_lead() {
                        return true;
                    }
                }
                event = stream.next() => match event {
                    Some(Ok(LeaseEvent::Applied(lease))) => {
                        self.elector.observe(&lease, crate::clock::now());
                        return true;
                    }
                    Some(Ok(LeaseEvent::Deleted { resource_version })) => {
                        self.elector
                            .observe_absent(crate::clock::now(), Some(&resource_version));
                        return true;
                    }
                    // The server ended the watch early: read and watch again at once,
                    // unless it ended as it opened (a server or proxy that cuts watches
                    // short): then at the deadline, not in a busy loop.
                    None => {
                        if crate::clock::now() < opened + MIN_WATCH {
                            deadline.await;
                        }
                        return false;
                    }
                    // The resourceVersion was compacted away, and a watch from it fails
                    // until the Lease changes: note what may have been missed, and poll
                    // at the deadline rather than in a busy loop.
                    Some(Err(StoreError::Gone)) => {
                        self.elector.watch_gone(crate::clock::now());
                        deadline.await;
                        return false;
                    }
                    // The watch failed: fall back to waiting for the deadline.
                    Some(Err(_)) => {
                        deadline.await;
                        return false;
                    }
                },
            }
        }
    }

    /// Gives the Lease up (empty holder, 1 s) so a follower takes over at once. The fence
    /// is already closed (by [`Leadership`]'s shutdown) when this runs.
    async fn release(&mut self) {
        self.elector.step_down();
        // A follower takes a released Lease at once, with no margin for writes of ours that
        // the server may still apply: wait them out (at most until the fence's end, which is
        // before the Lease could expire), or leave the Lease to expire.
        let limit = crate::clock::now() + self.elector.timings().renew_deadline + SETTLE_MARGIN;
        if !self.leadership.writes_settled(limit).await {
            warn!(
                writes = ?self.leadership.writes(),
                "a write of this term may still be applied: leaving the Lease to expire instead of releasing it"
            );
            return;
        }
        // A shard's next leader is the plan's, not a successor's.
        let successor = self
            .replicas
            .as_ref()
            .filter(|_| self.seat.is_none())
            .zip(self.elector.pod_name())
            .and_then(|(replicas, me)| {
                succession::successor(replicas.pods().values().map(AsRef::as_ref), me)
            });
        let Some(lease) = self.elector.release(self.wall.now(), successor.clone()) else {
            return;
        };
        let span = info_span!(
            "leader_election",
            transition = "released",
            identity = self.elector.identity()
        );
        let limit = self.elector.timings().retry_period;
        let request = self.store.replace(&lease);
        let result = tokio::time::timeout(limit, request)
            .instrument(span.clone())
            .await;
        let _entered = span.enter();
        match result {
            Ok(Ok(_)) => info!(
                identity = self.elector.identity(),
                successor = successor.as_deref().unwrap_or(""),
                "released the Lease"
            ),
            Ok(Err(err)) => {
                warn!(error = %err, "releasing the Lease failed; followers take over when it expires")
            }
            Err(_) => warn!("releasing the Lease timed out; followers take over when it expires"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stretches_by_at_most_a_fifth() {
        let p = Duration::from_secs(2);
        assert_eq!(jitter(p, 0.0), p);
        assert_eq!(jitter(p, 1.0), Duration::from_millis(2_400));
        assert_eq!(jitter(p, 7.0), Duration::from_millis(2_400));
        let f = spread("a", 1);
        assert!((0.0..1.0).contains(&f), "{f}");
        assert_ne!(f, spread("b", 1), "replicas differ");
        assert_ne!(f, spread("a", 2), "attempts differ");
        assert_eq!(f, spread("a", 1), "and replay");
    }
}
