//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's semantics.
//!
//! The decision logic ([`Elector`]) is pure: it is fed what was read and written, and the
//! monotonic time, and says what to do next. The driver ([`run`]) does the I/O.
//!
//! Guarantees (with `lease_duration > renew_deadline > retry_period`, checked by
//! [`Timings::new`]):
//! - Acquire and renew are `replace` calls carrying the resourceVersion last read, so of two
//!   candidates at most one succeeds (the other gets 409 Conflict); a deposed leader's renew
//!   conflicts instead of extending the new leader's term. The Lease is created only when
//!   absent (a concurrent create gets 409 AlreadyExists).
//! - Expiry is judged on this replica's monotonic clock: a holder's lease is expired when the
//!   record (its resourceVersion) has not changed for `lease_duration` since this replica
//!   first observed it. The remote `renewTime` is written for humans and never compared with
//!   the local clock, so clock skew between replicas cannot cause two leaders.
//! - The leader's writes are fenced ([`Fence`]) until `start of its last successful renew +
//!   renew_deadline`. Another replica observes that renew no earlier than it started, and
//!   acquires no earlier than `lease_duration` after that observation, which is later than
//!   the fence closes (as long as the clocks' rates agree to within
//!   `lease_duration / renew_deadline`).
//! - Each renew request has its own timeout (at most `retry_period`, never past the renew
//!   deadline), and the election's client does not retry 429/503/504 by itself, so a renew can
//!   never hang past the deadline. When the deadline passes without a successful renew the
//!   leader steps down: fence revoked first, then the workers are cancelled.
//! - A released Lease (empty holder) is acquirable at once; followers watch the Lease, so
//!   they see a release within one watch event rather than at their next poll.

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams, WatchEvent, WatchParams};
use kube::{Api, ResourceExt};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, debug_span, info, info_span, warn};

use crate::fence::Fence;
use crate::metrics::{self, NameLabels};

/// Lease timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    /// How long followers wait, from observing the last change of the Lease, before taking
    /// it over.
    pub lease_duration: Duration,
    /// How long the leader keeps leading without a successful renew.
    pub renew_deadline: Duration,
    /// How often the leader renews and followers retry.
    pub retry_period: Duration,
}

impl Timings {
    /// Checks `lease_duration > renew_deadline > retry_period > 0`, with messages a person
    /// can act on.
    pub fn new(
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Result<Self, String> {
        if retry_period.is_zero() {
            return Err("--retry-period must be greater than zero".into());
        }
        if renew_deadline <= retry_period {
            return Err(format!(
                "--renew-deadline ({renew_deadline:?}) must be greater than --retry-period \
                 ({retry_period:?}): the leader needs more than one renew attempt per deadline"
            ));
        }
        if lease_duration <= renew_deadline {
            return Err(format!(
                "--lease-duration ({lease_duration:?}) must be greater than --renew-deadline \
                 ({renew_deadline:?}): otherwise a follower may take over while the old leader \
                 still believes it leads"
            ));
        }
        if lease_duration.as_secs() < 1 || lease_duration.subsec_nanos() != 0 {
            return Err(format!(
                "--lease-duration ({lease_duration:?}) must be a whole number of seconds (the \
                 Lease records it in seconds)"
            ));
        }
        Ok(Timings {
            lease_duration,
            renew_deadline,
            retry_period,
        })
    }
}

/// What the last read of the Lease showed, and when this replica first saw it so.
#[derive(Debug, Clone)]
struct Observation {
    holder: String,
    resource_version: String,
    spec: LeaseSpec,
    /// Monotonic time of the first observation of this resourceVersion.
    since: Instant,
}

/// What the driver should do next.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// No Lease exists: create one naming us.
    Create(Lease),
    /// Replace the Lease (with the resourceVersion inside) to acquire or renew it.
    Replace(Lease),
    /// Someone else holds a valid lease: look again at this time (or on a watch event).
    WaitUntil(Instant),
}

/// The pure election state machine of one candidate.
#[derive(Debug)]
pub struct Elector {
    identity: String,
    name: String,
    namespace: String,
    timings: Timings,
    observed: Option<Observation>,
    /// Whether the Lease is known to be absent (read returned 404).
    absent: bool,
    /// Start of the last successful acquire or renew, while leading.
    renewed_at: Option<Instant>,
}

impl Elector {
    pub fn new(identity: &str, name: &str, namespace: &str, timings: Timings) -> Self {
        Elector {
            identity: identity.into(),
            name: name.into(),
            namespace: namespace.into(),
            timings,
            observed: None,
            absent: false,
            renewed_at: None,
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    pub fn timings(&self) -> Timings {
        self.timings
    }

    /// Records a read (GET or watch event) of the Lease at `now`.
    pub fn observe(&mut self, lease: &Lease, now: Instant) {
        self.absent = false;
        let rv = lease.resource_version().unwrap_or_default();
        if self
            .observed
            .as_ref()
            .is_some_and(|o| o.resource_version == rv)
        {
            return;
        }
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        if holder != self.identity && self.renewed_at.is_some() {
            // Someone else wrote the Lease: we are no longer leader, whatever our deadline says.
            self.renewed_at = None;
        }
        self.observed = Some(Observation {
            holder,
            resource_version: rv,
            spec,
            since: now,
        });
    }

    /// Records that the Lease does not exist.
    pub fn observe_absent(&mut self) {
        self.absent = true;
        self.observed = None;
        self.renewed_at = None;
    }

    /// Whether this replica leads at `now` (a successful renew within the renew deadline).
    pub fn is_leader(&self, now: Instant) -> bool {
        self.fence_until().is_some_and(|until| now < until)
    }

    /// Until when this replica may write (start of last renew + renew deadline).
    pub fn fence_until(&self) -> Option<Instant> {
        self.renewed_at.map(|t| t + self.timings.renew_deadline)
    }

    /// The current holder as last observed ("" when released or unknown).
    pub fn holder(&self) -> &str {
        self.observed.as_ref().map_or("", |o| o.holder.as_str())
    }

    /// When the leader should next renew.
    pub fn next_renew(&self) -> Option<Instant> {
        self.renewed_at.map(|t| t + self.timings.retry_period)
    }

    /// Decides the next step at monotonic `now`; `wall` is only written into the record.
    pub fn next_action(&self, now: Instant, wall: Timestamp) -> Action {
        if self.absent {
            return Action::Create(self.lease(self.record(None, wall), None));
        }
        let Some(obs) = &self.observed else {
            // Nothing read yet: the driver reads first; ask it to look again now.
            return Action::WaitUntil(now);
        };
        let mine = obs.holder == self.identity;
        let released = obs.holder.is_empty();
        let expires = obs.since + self.timings.lease_duration;
        if mine || released || now >= expires {
            let spec = self.record(Some(&obs.spec).filter(|_| mine), wall);
            Action::Replace(self.lease(spec, Some(obs.resource_version.clone())))
        } else {
            Action::WaitUntil(expires)
        }
    }

    /// The record we write: renewing keeps acquireTime and the transition count; taking over
    /// starts a new term.
    fn record(&self, ours: Option<&LeaseSpec>, wall: Timestamp) -> LeaseSpec {
        let now = MicroTime(wall);
        match ours {
            Some(spec) => LeaseSpec {
                renew_time: Some(now),
                lease_duration_seconds: Some(self.timings.lease_duration.as_secs() as i32),
                ..spec.clone()
            },
            None => {
                let transitions = self
                    .observed
                    .as_ref()
                    .and_then(|o| o.spec.lease_transitions)
                    .unwrap_or(0);
                LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(self.timings.lease_duration.as_secs() as i32),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(if self.observed.is_some() {
                        transitions + 1
                    } else {
                        0
                    }),
                    ..Default::default()
                }
            }
        }
    }

    fn lease(&self, spec: LeaseSpec, resource_version: Option<String>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                resource_version,
                ..Default::default()
            },
            spec: Some(spec),
        }
    }

    /// Records a successful create/replace that started at `started`; returns whether this
    /// began a new term.
    pub fn succeeded(&mut self, written: &Lease, started: Instant) -> bool {
        let was_leader = self.renewed_at.is_some();
        self.observe(written, started);
        self.renewed_at = Some(started);
        !was_leader
    }

    /// The Lease that releases our hold: empty holder, `leaseDurationSeconds: 1`.
    pub fn release(&self, wall: Timestamp) -> Option<Lease> {
        let obs = self
            .observed
            .as_ref()
            .filter(|o| o.holder == self.identity)?;
        let spec = LeaseSpec {
            holder_identity: Some(String::new()),
            lease_duration_seconds: Some(1),
            renew_time: Some(MicroTime(wall)),
            ..obs.spec.clone()
        };
        Some(self.lease(spec, Some(obs.resource_version.clone())))
    }

    /// Forgets leadership (after a failed renew past the deadline, or a release).
    pub fn step_down(&mut self) {
        self.renewed_at = None;
    }
}

/// Leadership as the rest of the process sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Follower,
    Leader,
}

/// The I/O half: the Lease API and how the process learns of transitions. The API's client
/// must not retry 429/503/504 by itself (`kube::Config::default_retry = false`).
pub struct Driver {
    pub api: Api<Lease>,
    pub elector: Elector,
    pub fence: Fence,
    pub role: watch::Sender<Role>,
}

impl Driver {
    fn set_status(&self, leading: bool) {
        metrics::get()
            .leader_status
            .get_or_create(&NameLabels {
                name: self.elector.name.clone(),
            })
            .set(i64::from(leading));
    }

    /// Runs the election until `shutdown` fires; then releases the Lease if held.
    pub async fn run(mut self, shutdown: CancellationToken) {
        self.set_status(false);
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            let now = Instant::now();
            if self.elector.is_leader(now) {
                let at = self.elector.next_renew().unwrap_or(now);
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep_until(at.into()) => {}
                }
                self.attempt(true).await;
            } else {
                if self.role_is(Role::Leader) {
                    self.lose("renew deadline passed without a successful renew");
                }
                self.read().await;
                match self.elector.next_action(Instant::now(), Timestamp::now()) {
                    Action::WaitUntil(until) => {
                        let retry = Instant::now() + self.elector.timings().retry_period;
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = self.watch_until(until.min(retry).max(Instant::now())) => {}
                        }
                    }
                    _ => self.attempt(false).await,
                }
            }
        }
        self.release().await;
    }

    fn role_is(&self, role: Role) -> bool {
        *self.role.borrow() == role
    }

    /// GETs the Lease and records it.
    async fn read(&mut self) {
        let timeout = self.elector.timings().retry_period;
        match tokio::time::timeout(timeout, self.api.get_opt(&self.elector.name)).await {
            Ok(Ok(Some(lease))) => self.elector.observe(&lease, Instant::now()),
            Ok(Ok(None)) => self.elector.observe_absent(),
            Ok(Err(err)) => warn!(error = %err, "reading the Lease failed"),
            Err(_) => warn!(?timeout, "reading the Lease timed out"),
        }
    }

    /// One acquire or renew attempt, bounded in time (renewals are traced at debug level).
    async fn attempt(&mut self, renewing: bool) {
        let span = if renewing {
            debug_span!("leader_election.renew")
        } else {
            debug_span!("leader_election.try_acquire")
        };
        self.attempt_inner(renewing).instrument(span).await
    }

    async fn attempt_inner(&mut self, renewing: bool) {
        let started = Instant::now();
        let action = self.elector.next_action(started, Timestamp::now());
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
                Action::Create(lease) => self
                    .api
                    .create(&PostParams::default(), lease)
                    .await
                    .map(Some),
                Action::Replace(lease) => self
                    .api
                    .replace(&self.elector.name, &PostParams::default(), lease)
                    .await
                    .map(Some),
                Action::WaitUntil(_) => Ok(None),
            }
        };
        let result = tokio::time::timeout(limit, request).await;
        match result {
            Ok(Ok(Some(written))) => {
                let new_term = self.elector.succeeded(&written, started);
                if let Some(until) = self.elector.fence_until() {
                    self.fence.extend(until);
                }
                if new_term {
                    let span = info_span!("leader_election", transition = "acquired", identity = self.elector.identity(), lease = %self.elector.name);
                    let _entered = span.enter();
                    info!(identity = self.elector.identity(), lease = %self.elector.name, "acquired the Lease: leading");
                    metrics::get().leadership_transitions.inc();
                    self.set_status(true);
                    self.role.send_replace(Role::Leader);
                } else {
                    metrics::get()
                        .lease_renew_seconds
                        .observe(started.elapsed().as_secs_f64());
                    debug!(took = ?started.elapsed(), "renewed the Lease");
                }
            }
            Ok(Ok(None)) => {}
            Ok(Err(kube::Error::Api(status))) if status.code == 409 => {
                debug!(renewing, "Lease conflict: someone else wrote it first");
                if renewing {
                    // Re-read at once: if someone else holds it now, step down without waiting.
                    self.read().await;
                    if !self.elector.is_leader(Instant::now()) {
                        self.lose("the Lease was taken by another replica");
                    }
                }
            }
            Ok(Err(err)) => warn!(renewing, error = %err, "Lease request failed"),
            Err(_) => warn!(renewing, ?limit, "Lease request timed out"),
        }
        if renewing && !self.elector.is_leader(Instant::now()) && self.role_is(Role::Leader) {
            self.lose("renew deadline passed without a successful renew");
        }
    }

    fn lose(&mut self, why: &str) {
        self.fence.revoke();
        self.elector.step_down();
        let span = info_span!(
            "leader_election",
            transition = "lost",
            identity = self.elector.identity(),
            why
        );
        let _entered = span.enter();
        warn!(
            identity = self.elector.identity(),
            why, "lost leadership: stopping workers, staying a follower"
        );
        self.set_status(false);
        self.role.send_replace(Role::Follower);
    }

    /// Waits until `until` or the next change of the Lease, whichever comes first.
    async fn watch_until(&mut self, until: Instant) {
        let Some(rv) = self
            .elector
            .observed
            .as_ref()
            .map(|o| o.resource_version.clone())
        else {
            tokio::time::sleep_until(until.into()).await;
            return;
        };
        let seconds = until
            .saturating_duration_since(Instant::now())
            .as_secs()
            .max(1) as u32;
        let params = WatchParams::default()
            .fields(&format!("metadata.name={}", self.elector.name))
            .timeout(seconds);
        let deadline = tokio::time::sleep_until(until.into());
        tokio::pin!(deadline);
        let stream = tokio::select! {
            _ = &mut deadline => return,
            stream = self.api.watch(&params, &rv) => stream,
        };
        let Ok(stream) = stream else {
            deadline.await;
            return;
        };
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                _ = &mut deadline => return,
                event = stream.next() => match event {
                    Some(Ok(WatchEvent::Modified(lease) | WatchEvent::Added(lease))) => {
                        self.elector.observe(&lease, Instant::now());
                        return;
                    }
                    Some(Ok(WatchEvent::Deleted(_))) => {
                        self.elector.observe_absent();
                        return;
                    }
                    Some(Ok(_)) => {}
                    // The watch ended or failed: fall back to waiting for the deadline.
                    Some(Err(_)) | None => {
                        deadline.await;
                        return;
                    }
                },
            }
        }
    }

    /// Gives the Lease up (empty holder, 1 s) so a follower takes over at once.
    async fn release(&mut self) {
        let was_leader = self.role_is(Role::Leader);
        self.fence.revoke();
        self.set_status(false);
        self.role.send_replace(Role::Follower);
        if !was_leader {
            return;
        }
        let span = info_span!(
            "leader_election",
            transition = "released",
            identity = self.elector.identity()
        );
        let Some(lease) = self.elector.release(Timestamp::now()) else {
            return;
        };
        let limit = self.elector.timings().retry_period;
        let params = PostParams::default();
        let request = self.api.replace(&self.elector.name, &params, &lease);
        let result = tokio::time::timeout(limit, request)
            .instrument(span.clone())
            .await;
        let _entered = span.enter();
        match result {
            Ok(Ok(_)) => info!(identity = self.elector.identity(), "released the Lease"),
            Ok(Err(err)) => {
                warn!(error = %err, "releasing the Lease failed; followers take over when it expires")
            }
            Err(_) => warn!("releasing the Lease timed out; followers take over when it expires"),
        }
        self.elector.step_down();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timings() -> Timings {
        Timings::new(
            Duration::from_secs(15),
            Duration::from_secs(10),
            Duration::from_secs(2),
        )
        .unwrap()
    }

    fn wall() -> Timestamp {
        Timestamp::from_second(1_800_000_000).unwrap()
    }

    fn lease(holder: &str, rv: &str, renew: Timestamp) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("l".into()),
                namespace: Some("ns".into()),
                resource_version: Some(rv.into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                lease_duration_seconds: Some(15),
                renew_time: Some(MicroTime(renew)),
                lease_transitions: Some(3),
                ..Default::default()
            }),
        }
    }

    /// What the API server would return after a successful write.
    fn written(action: Action, rv: &str) -> Lease {
        let (Action::Create(mut l) | Action::Replace(mut l)) = action else {
            panic!("expected a write, got {action:?}");
        };
        l.metadata.resource_version = Some(rv.into());
        l
    }

    #[test]
    fn inconsistent_timings_are_refused() {
        let s = Duration::from_secs;
        assert!(
            Timings::new(s(10), s(10), s(2))
                .unwrap_err()
                .contains("--lease-duration")
        );
        assert!(
            Timings::new(s(15), s(2), s(2))
                .unwrap_err()
                .contains("--renew-deadline")
        );
        assert!(Timings::new(s(15), s(10), s(0)).is_err());
        assert!(Timings::new(Duration::from_millis(4500), s(3), s(1)).is_err());
        assert!(Timings::new(s(4), s(3), s(1)).is_ok());
    }

    #[test]
    fn creates_an_absent_lease_and_leads() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe_absent();
        let action = e.next_action(t, wall());
        let Action::Create(l) = &action else {
            panic!("{action:?}")
        };
        assert_eq!(
            l.spec.as_ref().unwrap().holder_identity.as_deref(),
            Some("me")
        );
        assert_eq!(l.metadata.resource_version, None);
        assert!(e.succeeded(&written(action, "1"), t));
        assert!(e.is_leader(t));
    }

    #[test]
    fn renews_with_the_last_resource_version_and_keeps_the_term() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe_absent();
        e.succeeded(&written(e.next_action(t, wall()), "1"), t);
        let renew_at = e.next_renew().unwrap();
        assert_eq!(renew_at, t + Duration::from_secs(2));
        let action = e.next_action(renew_at, wall());
        let Action::Replace(l) = &action else {
            panic!("{action:?}")
        };
        assert_eq!(l.metadata.resource_version.as_deref(), Some("1"));
        let acquired = l.spec.as_ref().unwrap().acquire_time.clone();
        assert!(
            !e.succeeded(&written(action, "2"), renew_at),
            "a renew is not a new term"
        );
        let Action::Replace(l) = e.next_action(renew_at, wall()) else {
            panic!()
        };
        assert_eq!(l.spec.unwrap().acquire_time, acquired);
    }

    #[test]
    fn steps_down_at_the_renew_deadline_without_a_renew() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe_absent();
        e.succeeded(&written(e.next_action(t, wall()), "1"), t);
        assert!(e.is_leader(t + Duration::from_millis(9_999)));
        assert!(!e.is_leader(t + Duration::from_secs(10)));
        assert_eq!(e.fence_until(), Some(t + Duration::from_secs(10)));
    }

    #[test]
    fn takes_over_only_after_observed_expiry() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe(&lease("other", "5", wall()), t);
        assert_eq!(
            e.next_action(t, wall()),
            Action::WaitUntil(t + Duration::from_secs(15))
        );
        // The same record seen again does not restart the clock …
        e.observe(&lease("other", "5", wall()), t + Duration::from_secs(10));
        assert_eq!(
            e.next_action(t + Duration::from_secs(14), wall()),
            Action::WaitUntil(t + Duration::from_secs(15))
        );
        // … and after the lease duration we take over with a new term.
        let action = e.next_action(t + Duration::from_secs(15), wall());
        let Action::Replace(l) = &action else {
            panic!("{action:?}")
        };
        let spec = l.spec.clone().unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(spec.lease_transitions, Some(4));
        assert_eq!(l.metadata.resource_version.as_deref(), Some("5"));
    }

    #[test]
    fn a_renewal_by_the_holder_restarts_the_expiry_clock() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe(&lease("other", "5", wall()), t);
        e.observe(&lease("other", "6", wall()), t + Duration::from_secs(12));
        assert_eq!(
            e.next_action(t + Duration::from_secs(16), wall()),
            Action::WaitUntil(t + Duration::from_secs(27))
        );
    }

    #[test]
    fn remote_renew_time_in_the_future_or_past_is_ignored() {
        let t = Instant::now();
        let far_future = Timestamp::from_second(4_000_000_000).unwrap();
        let far_past = Timestamp::from_second(0).unwrap();
        for renew in [far_future, far_past] {
            let mut e = Elector::new("me", "l", "ns", timings());
            e.observe(&lease("other", "5", renew), t);
            // Valid for exactly one lease duration from our observation, whatever it says.
            assert_eq!(
                e.next_action(t + Duration::from_secs(1), wall()),
                Action::WaitUntil(t + Duration::from_secs(15))
            );
            assert!(matches!(
                e.next_action(t + Duration::from_secs(15), wall()),
                Action::Replace(_)
            ));
        }
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe(&lease("", "7", wall()), t);
        assert!(matches!(e.next_action(t, wall()), Action::Replace(_)));
    }

    #[test]
    fn a_write_by_someone_else_ends_our_term_at_once() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe_absent();
        e.succeeded(&written(e.next_action(t, wall()), "1"), t);
        e.observe(&lease("other", "2", wall()), t + Duration::from_secs(1));
        assert!(!e.is_leader(t + Duration::from_secs(1)));
        assert_eq!(e.holder(), "other");
    }

    #[test]
    fn release_empties_the_holder_and_shortens_the_lease() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe_absent();
        e.succeeded(&written(e.next_action(t, wall()), "1"), t);
        let released = e.release(wall()).unwrap();
        let spec = released.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some(""));
        assert_eq!(spec.lease_duration_seconds, Some(1));
        assert_eq!(released.metadata.resource_version.as_deref(), Some("1"));
        // A follower cannot release what it does not hold.
        let mut f = Elector::new("f", "l", "ns", timings());
        f.observe(&lease("other", "3", wall()), t);
        assert!(f.release(wall()).is_none());
    }
}
