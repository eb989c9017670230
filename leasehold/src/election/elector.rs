//! The pure half of the election: fed what was read and written and the monotonic time,
//! it says what to do next (see [`crate::election`] for the rules it keeps).

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::ObjectMeta;

use super::Timings;
use crate::bugs::{self, Bug};
use crate::fence::{MAX_WRITE_TIME, SETTLE_MARGIN};
use crate::replicas::exit::{self, Exit};
use crate::replicas::succession;
use crate::replicas::this_pod::PodInfo;

/// How many records sent without an answer are remembered as ours (one per attempt; a
/// leader makes at most `renew_deadline / retry_period` attempts before stepping down).
const MAX_UNANSWERED: usize = 16;

/// What the last read of the Lease showed, and when this replica first saw its election
/// record.
#[derive(Debug, Clone)]
struct Observation {
    resource_version: String,
    /// The election record.
    spec: LeaseSpec,
    /// Monotonic time of the first observation of this record (not of this
    /// resourceVersion: metadata-only writes do not restart the clock).
    since: Instant,
    /// The holder's Pod and process, as the Lease's annotations name them ([`crash`]).
    holder_pod: Option<exit::Holder>,
    /// The successor a released record names ([`succession::SUCCESSOR`]), while it may
    /// still be live.
    successor: Option<String>,
}

impl Observation {
    fn holder(&self) -> &str {
        holder_of(&self.spec)
    }
}

/// The successor a Lease names.
fn successor_of(lease: &Lease) -> Option<String> {
    lease.annotations().get(succession::SUCCESSOR).cloned()
}

/// The holder a record names ("" when released or cleared).
fn holder_of(spec: &LeaseSpec) -> &str {
    spec.holder_identity.as_deref().unwrap_or_default()
}

/// Whether `spec` is a graceful release of `previous`: an empty holder, a one-second lease
/// and a new renewTime, as a holder writes after closing its fence. A foreign writer that
/// only clears the holder leaves the duration and renewTime as they were.
fn is_release(previous: Option<&LeaseSpec>, spec: &LeaseSpec) -> bool {
    holder_of(spec).is_empty()
        && spec.lease_duration_seconds == Some(1)
        && previous.is_none_or(|p| p.renew_time != spec.renew_time)
}

/// What the driver should do next.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// No Lease exists: create one naming us.
    Create(Lease),
    /// Replace the Lease (with the resourceVersion inside) to acquire or renew it.
    Replace(Lease),
    /// Someone else holds a valid lease (or may still act on one): look again at this time
    /// (or on a watch event).
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
    /// While absent: the oldest resourceVersion as of which it was read absent, where a
    /// watch starts so that a term that begins and vanishes meanwhile is seen.
    absent_version: Option<String>,
    /// A holder vanished without releasing (Lease deleted, holder cleared by someone else):
    /// nobody takes the Lease before this, when that holder's fence has surely closed.
    vanished_until: Option<Instant>,
    /// Start of the last successful acquire or renew, while leading.
    renewed_at: Option<Instant>,
    /// This replica's Pod (see [`crate::pod`]): its ServiceAccount owns the Lease, its uid
    /// is written on it.
    pod: Option<PodInfo>,
    /// A record whose term is proven over: its holder's process exited ([`crash`]); and
    /// when the proof was seen.
    exited: Option<(LeaseSpec, Instant)>,
    /// The last record this process wrote as the server confirmed it, and those it sent
    /// since without an answer (a slow server may apply any of them after the client gave
    /// up): the only records that are ours (see the module doc).
    written: Option<LeaseSpec>,
    sent: Vec<LeaseSpec>,
    /// Labels written on the Lease (scale-out mode: its group, which replicas watch).
    labels: Option<std::collections::BTreeMap<String, String>>,
}

impl Elector {
    /// A follower that has seen nothing yet: `identity` standing for the Lease `name` in
    /// `namespace`.
    pub fn new(identity: &str, name: &str, namespace: &str, timings: Timings) -> Self {
        Elector {
            identity: identity.into(),
            name: name.into(),
            namespace: namespace.into(),
            timings,
            observed: None,
            absent: false,
            absent_version: None,
            vanished_until: None,
            renewed_at: None,
            pod: None,
            exited: None,
            written: None,
            sent: Vec::new(),
            labels: None,
        }
    }

    /// Labels every Lease this replica writes carries.
    pub fn labelled(mut self, labels: std::collections::BTreeMap<String, String>) -> Self {
        self.labels = Some(labels);
        self
    }

    /// The Pod this replica runs in, if any: every Lease it writes is then owned by the
    /// Pod's ServiceAccount (so it goes with the release) and names the Pod's uid (so
    /// followers can match the holder's Pod, see [`crate::replicas::exit`]).
    pub fn in_pod(mut self, pod: Option<PodInfo>) -> Self {
        self.pod = pod;
        self
    }

    /// Records what the holder's Pod reports; returns how its process was proven to have
    /// ended, if it was (the current record's term can then be taken at once).
    /// Says so once per record.
    pub fn observe_holder_pod(&mut self, pod: &Pod, now: Instant) -> Option<Exit> {
        let obs = self.observed.as_ref()?;
        if self
            .exited
            .as_ref()
            .is_some_and(|(spec, _)| spec == &obs.spec)
        {
            return None;
        }
        let exit = exit::exited(obs.holder(), obs.holder_pod.as_ref(), pod)?;
        self.exited = Some((obs.spec.clone(), now));
        Some(exit)
    }

    /// When the current record's term, proven over, can be taken: once the dead process's
    /// last writes are surely over (each lives at most [`MAX_WRITE_TIME`], and it died
    /// before the proof was seen).
    fn proven_over_at(&self, obs: &Observation) -> Option<Instant> {
        let (spec, seen) = self.exited.as_ref()?;
        (spec == &obs.spec).then(|| *seen + MAX_WRITE_TIME + SETTLE_MARGIN)
    }

    /// Who this replica is (the holder it writes).
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The Lease's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The timings this replica runs with.
    pub fn timings(&self) -> Timings {
        self.timings
    }

    /// How long a record is valid after it was observed: the larger of our lease duration
    /// and the one it states.
    fn duration_of(&self, spec: &LeaseSpec) -> Duration {
        if bugs::on(Bug::OwnDurationOnly) {
            return self.timings.lease_duration;
        }
        let stated = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(Duration::ZERO, Duration::from_secs);
        self.timings.lease_duration.max(stated)
    }

    /// When the holder of `obs` may last act on it.
    fn expiry_of(&self, obs: &Observation) -> Instant {
        obs.since + self.duration_of(&obs.spec)
    }

    /// Notes that the holder of the previous record vanished without a release, seen at
    /// `now`: nobody may take the Lease before that holder's fence has surely closed. Its
    /// last renewal may have been missed (a watch that lagged, an outage), so the lease
    /// duration counts from now, when the holder surely renewed no more, not from the
    /// last renewal seen.
    fn holder_vanished(&mut self, previous: &Observation, now: Instant) {
        if !previous.holder().is_empty() {
            self.hold_off_until(now + self.duration_of(&previous.spec));
        }
    }

    /// Nobody may take the Lease before `until` (the latest such time wins).
    fn hold_off_until(&mut self, until: Instant) {
        self.vanished_until = Some(self.vanished_until.map_or(until, |u| u.max(until)));
    }

    /// Records a read (GET or watch event) of the Lease at `now`.
    pub fn observe(&mut self, lease: &Lease, now: Instant) {
        self.absent = false;
        let rv = lease.resource_version().unwrap_or_default();
        let spec = lease.spec.clone().unwrap_or_default();
        let holder_pod = exit::Holder::of(lease);
        let restarts =
            |o: &Observation| bugs::on(Bug::MetadataRestartsExpiry) && o.resource_version != rv;
        if let Some(obs) = self
            .observed
            .as_mut()
            .filter(|o| o.spec == spec && !restarts(o))
        {
            // The same record (perhaps relabelled, perhaps after failed reads: it was not
            // renewed meanwhile): only the resourceVersion moves on, not the clock.
            obs.resource_version = rv;
            obs.holder_pod = holder_pod;
            obs.successor = successor_of(lease);
            return;
        }
        let previous = self.observed.take();
        let released = is_release(previous.as_ref().map(|p| &p.spec), &spec)
            || bugs::on(Bug::ClearedHolderIsRelease);
        if holder_of(&spec).is_empty() && !released {
            if let Some(previous) = &previous {
                self.holder_vanished(previous, now);
            }
            // The record cleared may not be the one this replica saw last (it missed the
            // records between): it may hide a live holder, whoever it was.
            self.hold_off_until(now + self.duration_of(&spec));
        }
        // While leading, the last record is our own write: any other record ends the term.
        self.renewed_at = None;
        self.observed = Some(Observation {
            resource_version: rv,
            spec,
            since: now,
            holder_pod,
            successor: successor_of(lease),
        });
    }

    /// Records that the Lease does not exist (read or renew returned 404, or a watch said
    /// it was deleted).
    pub fn observe_absent(&mut self, now: Instant, version: Option<&str>) {
        match self.observed.take() {
            Some(previous) if !bugs::on(Bug::DeletedLeaseAtOnce) => {
                self.holder_vanished(&previous, now);
            }
            Some(_) => {}
            // The first thing this process learns is that the Lease is absent: it may
            // have been deleted a moment ago while its holder still wrote.
            None if !self.absent => self.hold_off_until(now + self.timings.lease_duration),
            None => {}
        }
        // The oldest version of this absence: a watch from it misses nothing since.
        if !self.absent || self.absent_version.is_none() {
            self.absent_version = version.map(str::to_string);
        }
        self.absent = true;
        self.renewed_at = None;
    }

    /// Records that a watch's resourceVersion was compacted away (410 Gone): while the
    /// Lease is absent, a term may have begun and vanished unseen since, so nobody takes
    /// it before such a term's fence has surely closed, a lease duration from now.
    pub fn watch_gone(&mut self, now: Instant) {
        if self.absent {
            self.absent_version = None;
            self.hold_off_until(now + self.timings.lease_duration);
        }
    }

    /// Whether this replica leads at `now` (a successful renew within the renew deadline).
    pub fn is_leader(&self, now: Instant) -> bool {
        self.fence_until().is_some_and(|until| now < until)
    }

    /// Until when this replica may write (start of last renew + renew deadline).
    pub fn fence_until(&self) -> Option<Instant> {
        self.renewed_at.map(|t| t + self.timings.renew_deadline)
    }

    /// The current holder as last observed ("" when released, absent or unknown).
    pub fn holder(&self) -> &str {
        self.observed.as_ref().map_or("", Observation::holder)
    }

    /// When the leader should next renew.
    pub fn next_renew(&self) -> Option<Instant> {
        self.renewed_at.map(|t| t + self.timings.retry_period)
    }

    /// Decides the next step at monotonic `now`; `wall` is only written into the record.
    pub fn next_action(&self, now: Instant, wall: Timestamp) -> Action {
        let vanished = self.vanished_until.filter(|until| now < *until);
        if self.absent {
            return match vanished {
                Some(until) => Action::WaitUntil(until),
                None => Action::Create(self.lease(self.record(None, wall), None)),
            };
        }
        let Some(obs) = &self.observed else {
            // Nothing read yet: the driver reads first; ask it to look again now.
            return Action::WaitUntil(now);
        };
        let mine = self.is_ours(obs);
        let takeable = if let Some(at) = self.proven_over_at(obs) {
            at
        } else if obs.holder().is_empty() {
            self.standing_back(obs).unwrap_or(now)
        } else {
            self.expiry_of(obs)
        };
        let takeable = vanished.map_or(takeable, |until| until.max(takeable));
        if mine || now >= takeable {
            let spec = self.record(Some(&obs.spec).filter(|_| mine), wall);
            Action::Replace(self.lease(spec, Some(obs.resource_version.clone())))
        } else {
            Action::WaitUntil(takeable)
        }
    }

    /// The record we write: renewing (or retaking a record that still names us) keeps
    /// acquireTime and the transition count; taking over starts a new term.
    fn record(&self, ours: Option<&LeaseSpec>, wall: Timestamp) -> LeaseSpec {
        // To the microsecond, as the server keeps it: a record read back equals the one sent.
        let now = MicroTime(Timestamp::from_microsecond(wall.as_microsecond()).unwrap_or(wall));
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
                owner_references: self
                    .pod
                    .as_ref()
                    .map(|pod| vec![pod.service_account.clone()]),
                annotations: self.pod.as_ref().map(PodInfo::annotations),
                labels: self.labels.clone(),
                ..Default::default()
            },
            spec: Some(spec),
        }
    }

    /// Until when this replica leaves a released record to the successor it names: one
    /// retry period after the release was observed, unless we are that successor (see
    /// [`succession`]).
    fn standing_back(&self, obs: &Observation) -> Option<Instant> {
        let successor = obs.successor.as_deref()?;
        let ours = self.pod.as_ref().map(|p| p.name.as_str());
        (ours != Some(successor)).then(|| obs.since + self.timings.retry_period)
    }

    /// The successor the released record names, if it may still take it.
    pub fn successor(&self) -> Option<&str> {
        let obs = self.observed.as_ref()?;
        obs.successor.as_deref().filter(|_| obs.holder().is_empty())
    }

    /// Records that the named successor is not live (gone, being deleted, not Ready):
    /// nobody stands back for it any longer.
    pub fn successor_lost(&mut self) {
        if let Some(obs) = self.observed.as_mut() {
            obs.successor = None;
        }
    }

    /// Where a watch of the Lease starts: the resourceVersion of the Lease last observed,
    /// or while it is absent, of the oldest read that found it absent.
    pub fn observed_version(&self) -> Option<&str> {
        match &self.observed {
            Some(o) => Some(o.resource_version.as_str()),
            None => self.absent_version.as_deref().filter(|_| self.absent),
        }
    }

    /// This replica's Pod name (in a Pod).
    pub fn pod_name(&self) -> Option<&str> {
        self.pod.as_ref().map(|p| p.name.as_str())
    }

    /// Whether a record is this process's own: one it wrote (see the module doc).
    fn is_ours(&self, obs: &Observation) -> bool {
        self.written.as_ref() == Some(&obs.spec)
            || self.sent.contains(&obs.spec)
            || (bugs::on(Bug::FormerHolderIsOurs) && obs.holder() == self.identity)
    }

    /// Records that `action`'s Lease is about to be sent: if the answer is lost, the record
    /// may still be ours.
    pub fn sending(&mut self, action: &Action) {
        if let Action::Create(lease) | Action::Replace(lease) = action {
            if self.sent.len() == MAX_UNANSWERED {
                self.sent.remove(0);
            }
            self.sent.extend(lease.spec.clone());
        }
    }

    /// Records a successful create/replace that started at `started`; returns whether this
    /// began a new term.
    pub fn succeeded(&mut self, written: &Lease, started: Instant) -> bool {
        let was_leader = self.renewed_at.is_some();
        self.written = written.spec.clone();
        // Any earlier write still in flight carries an older resourceVersion: it conflicts.
        self.sent.clear();
        self.absent = false;
        self.observed = Some(Observation {
            resource_version: written.resource_version().unwrap_or_default(),
            spec: written.spec.clone().unwrap_or_default(),
            since: started,
            holder_pod: exit::Holder::of(written),
            successor: None,
        });
        self.renewed_at = Some(started);
        !was_leader
    }

    /// Records that the Lease this process just created (`written`) must not be led: a
    /// term may have begun and vanished unseen just before it. The record is then treated
    /// as any other holder's, waited out from `now`, as every other replica waits it out
    /// from when it sees it.
    pub fn disown(&mut self, written: &Lease, now: Instant) {
        self.written = None;
        self.sent.clear();
        self.renewed_at = None;
        self.absent = false;
        self.observed = Some(Observation {
            resource_version: written.resource_version().unwrap_or_default(),
            spec: written.spec.clone().unwrap_or_default(),
            since: now,
            holder_pod: exit::Holder::of(written),
            successor: None,
        });
    }

    /// The Lease that releases our hold: empty holder, `leaseDurationSeconds: 1`, and the
    /// `successor`'s Pod name if there is one. `None` when the last record we saw does not
    /// name us.
    pub fn release(&self, wall: Timestamp, successor: Option<String>) -> Option<Lease> {
        let obs = self.observed.as_ref().filter(|o| self.is_ours(o))?;
        let spec = LeaseSpec {
            holder_identity: Some(String::new()),
            lease_duration_seconds: Some(1),
            renew_time: Some(MicroTime(wall)),
            ..obs.spec.clone()
        };
        let mut lease = self.lease(spec, Some(obs.resource_version.clone()));
        if let Some(successor) = successor {
            lease
                .annotations_mut()
                .insert(succession::SUCCESSOR.into(), successor);
        }
        Some(lease)
    }

    /// Forgets the record observed, so the next read restarts its expiry clock: only the
    /// simulator's re-introduced defect does this ([`Bug::ReadFailureRestartsExpiry`]).
    pub(crate) fn forget_record(&mut self) {
        if !self.is_leader(crate::clock::now()) {
            self.observed = None;
        }
    }

    /// Forgets leadership (after a failed renew past the deadline, or a release).
    pub fn step_down(&mut self) {
        self.renewed_at = None;
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

    /// A fresh elector that has seen the Lease absent for long: it creates it at once.
    fn absent_long_since(e: &mut Elector, t: Instant) {
        e.observe_absent(t - Duration::from_secs(60), None);
        e.observe_absent(t, None);
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
    fn creates_an_absent_lease_after_a_lease_duration_and_leads() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t0 = Instant::now();
        // Absent at the first look: it may have been deleted under a live holder.
        e.observe_absent(t0, None);
        assert_eq!(
            e.next_action(t0, wall()),
            Action::WaitUntil(t0 + Duration::from_secs(15))
        );
        let t = t0 + Duration::from_secs(15);
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
    fn every_lease_written_names_the_owner_and_the_pod() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let pod = PodInfo {
            service_account: OwnerReference {
                api_version: "v1".into(),
                kind: "ServiceAccount".into(),
                name: "sa".into(),
                uid: "u".into(),
                ..Default::default()
            },
            uid: "pod-uid".into(),
            instance: Some("i".into()),
            ..Default::default()
        };
        let mut e = Elector::new("me", "l", "ns", timings()).in_pod(Some(pod.clone()));
        let t = Instant::now();
        absent_long_since(&mut e, t);
        let created = e.next_action(t, wall());
        let Action::Create(l) = &created else {
            panic!("{created:?}")
        };
        let owners = Some(vec![pod.service_account.clone()]);
        assert_eq!(l.metadata.owner_references, owners);
        let named = Some(exit::Holder {
            pod_uid: "pod-uid".into(),
            instance: "i".into(),
        });
        assert_eq!(exit::Holder::of(l), named);
        e.succeeded(&written(created, "1"), t);
        let Action::Replace(l) = e.next_action(t + Duration::from_secs(2), wall()) else {
            panic!("expected a renewal")
        };
        assert_eq!(l.metadata.owner_references, owners);
        assert_eq!(exit::Holder::of(&l), named);
        let plain = Elector::new("me", "l", "ns", timings()).lease(LeaseSpec::default(), None);
        assert_eq!(plain.metadata.owner_references, None);
        assert_eq!(plain.metadata.annotations, None);
    }

    /// Issue 16: a follower takes over at once when the holder's Pod proves its process
    /// exited, and only then.
    #[test]
    fn a_proven_crash_is_taken_over_once_its_last_writes_are_over() {
        let t = Instant::now();
        let mut leader = Elector::new("p", "l", "ns", timings()).in_pod(Some(PodInfo {
            uid: "u".into(),
            instance: Some("i1".into()),
            ..Default::default()
        }));
        absent_long_since(&mut leader, t);
        let record = written(leader.next_action(t, wall()), "1");
        let mut follower = Elector::new("f", "l", "ns", timings());
        follower.observe(&record, t);
        let expiry = Action::WaitUntil(t + Duration::from_secs(15));
        let pod = |uid: &str, state: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "uid": uid},
                "status": {"containerStatuses": [{"name": "operator", "image": "i",
                    "imageID": "", "ready": false, "restartCount": 0, "state": state}]}
            }))
            .unwrap()
        };
        let running = serde_json::json!({"running": {"startedAt": (wall() + Duration::from_secs(60)).to_string()}});
        assert_eq!(follower.observe_holder_pod(&pod("u", running), t), None);
        assert_eq!(follower.next_action(t, wall()), expiry);
        // Another Pod of the same name, or another instance's termination: no proof.
        let dead = |instance: &str| {
            serde_json::json!({"terminated": {"exitCode": 137,
            "message": format!("myresource-operator instance {instance}")}})
        };
        assert_eq!(follower.observe_holder_pod(&pod("v", dead("i1")), t), None);
        assert_eq!(follower.observe_holder_pod(&pod("u", dead("i0")), t), None);
        assert_eq!(follower.next_action(t, wall()), expiry);
        assert_eq!(
            follower.observe_holder_pod(&pod("u", dead("i1")), t),
            Some(Exit::Terminated)
        );
        // Its last writes may still be applied for their deadline (issue 30, hole 3): wait
        // those out from when the proof was seen, then take over.
        let over = t + MAX_WRITE_TIME + SETTLE_MARGIN;
        assert_eq!(follower.next_action(t, wall()), Action::WaitUntil(over));
        let Action::Replace(l) = follower.next_action(over, wall()) else {
            panic!("expected a takeover")
        };
        assert_eq!(l.spec.unwrap().holder_identity.as_deref(), Some("f"));
        // The proof is for that record only: a new term by anyone needs a new proof.
        let mut renewed = record.clone();
        renewed.spec.as_mut().unwrap().acquire_time =
            Some(MicroTime(wall() + Duration::from_secs(9)));
        renewed.metadata.resource_version = Some("2".into());
        follower.observe(&renewed, t + Duration::from_secs(1));
        assert_eq!(
            follower.next_action(t + Duration::from_secs(1), wall()),
            Action::WaitUntil(t + Duration::from_secs(16))
        );
    }

    #[test]
    fn renews_with_the_last_resource_version_and_keeps_the_term() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        absent_long_since(&mut e, t);
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
        absent_long_since(&mut e, t);
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

    fn later() -> Timestamp {
        Timestamp::from_second(1_800_000_012).unwrap()
    }

    #[test]
    fn a_renewal_by_the_holder_restarts_the_expiry_clock() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe(&lease("other", "5", wall()), t);
        e.observe(&lease("other", "6", later()), t + Duration::from_secs(12));
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
        let mut released = lease("", "7", wall());
        released.spec.as_mut().unwrap().lease_duration_seconds = Some(1);
        e.observe(&released, t);
        assert!(matches!(e.next_action(t, wall()), Action::Replace(_)));
    }

    #[test]
    fn a_write_by_someone_else_ends_our_term_at_once() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        absent_long_since(&mut e, t);
        e.succeeded(&written(e.next_action(t, wall()), "1"), t);
        e.observe(&lease("other", "2", wall()), t + Duration::from_secs(1));
        assert!(!e.is_leader(t + Duration::from_secs(1)));
        assert_eq!(e.holder(), "other");
    }

    #[test]
    fn release_empties_the_holder_and_shortens_the_lease() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        absent_long_since(&mut e, t);
        e.succeeded(&written(e.next_action(t, wall()), "1"), t);
        let released = e.release(wall(), None).unwrap();
        let spec = released.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some(""));
        assert_eq!(spec.lease_duration_seconds, Some(1));
        assert_eq!(released.metadata.resource_version.as_deref(), Some("1"));
        // A follower cannot release what it does not hold.
        let mut f = Elector::new("f", "l", "ns", timings());
        f.observe(&lease("other", "3", wall()), t);
        assert!(f.release(wall(), None).is_none());
    }

    /// Issue 16, item 2: a release naming a successor lets it take the Lease at once; the
    /// others stand back one retry period, or not at all once it is known not to be live.
    #[test]
    fn a_named_successor_takes_a_release_first() {
        let in_pod = |name: &str| {
            Elector::new(name, "l", "ns", timings()).in_pod(Some(PodInfo {
                name: name.into(),
                ..Default::default()
            }))
        };
        let t = Instant::now();
        let mut leader = in_pod("old");
        absent_long_since(&mut leader, t);
        let record = written(leader.next_action(t, wall()), "1");
        leader.succeeded(&record, t);
        let mut released = leader.release(later(), Some("new".into())).unwrap();
        released.metadata.resource_version = Some("2".into());
        assert_eq!(successor_of(&released).as_deref(), Some("new"));

        let (mut successor, mut other) = (in_pod("new"), in_pod("other"));
        for follower in [&mut successor, &mut other] {
            follower.observe(&record, t);
            follower.observe(&released, t + Duration::from_secs(1));
        }
        let now = t + Duration::from_secs(1);
        assert!(matches!(
            successor.next_action(now, wall()),
            Action::Replace(_)
        ));
        assert_eq!(
            other.next_action(now, wall()),
            Action::WaitUntil(now + Duration::from_secs(2))
        );
        assert_eq!(other.successor(), Some("new"));
        assert!(matches!(
            other.next_action(now + Duration::from_secs(2), wall()),
            Action::Replace(_)
        ));
        other.successor_lost();
        assert!(matches!(other.next_action(now, wall()), Action::Replace(_)));
        // Once someone holds it, there is no successor to wait for.
        other.observe(&lease("new", "3", wall()), now);
        assert_eq!(other.successor(), None);
    }

    /// Issue 13, item 5: a relabel every 2 s kept a dead leader alive.
    #[test]
    fn metadata_only_writes_do_not_restart_the_expiry_clock() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe(&lease("other", "5", wall()), t);
        for i in 1..=7u64 {
            let mut relabelled = lease("other", &format!("{}", 5 + i), wall());
            relabelled.metadata.labels = Some([("tick".to_string(), i.to_string())].into());
            e.observe(&relabelled, t + Duration::from_secs(2 * i));
        }
        let action = e.next_action(t + Duration::from_secs(15), wall());
        let Action::Replace(l) = &action else {
            panic!("{action:?}")
        };
        // … and the takeover carries the newest resourceVersion.
        assert_eq!(l.metadata.resource_version.as_deref(), Some("12"));
    }

    /// Issue 13, item 6: a leader with longer timings than ours.
    #[test]
    fn expiry_waits_for_the_longer_of_ours_and_the_records_duration() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        let mut long = lease("other", "5", wall());
        long.spec.as_mut().unwrap().lease_duration_seconds = Some(30);
        e.observe(&long, t);
        assert_eq!(
            e.next_action(t + Duration::from_secs(15), wall()),
            Action::WaitUntil(t + Duration::from_secs(30))
        );
        // A shorter stated duration never shortens ours.
        let mut short = lease("other", "6", later());
        short.spec.as_mut().unwrap().lease_duration_seconds = Some(4);
        e.observe(&short, t + Duration::from_secs(20));
        assert_eq!(
            e.next_action(t + Duration::from_secs(25), wall()),
            Action::WaitUntil(t + Duration::from_secs(35))
        );
    }

    /// Issue 13, item 3: a Lease deleted under a working leader.
    #[test]
    fn a_deleted_lease_is_created_only_after_the_old_holders_fence_closed() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe(&lease("other", "5", wall()), t);
        e.observe_absent(t, None);
        assert_eq!(
            e.next_action(t + Duration::from_secs(1), wall()),
            Action::WaitUntil(t + Duration::from_secs(15))
        );
        assert!(matches!(
            e.next_action(t + Duration::from_secs(15), wall()),
            Action::Create(_)
        ));
        // Found absent at the first look (deleted a moment ago, for all it knows): the
        // same wait, from then.
        let mut fresh = Elector::new("me", "l", "ns", timings());
        fresh.observe_absent(t, None);
        assert_eq!(
            fresh.next_action(t, wall()),
            Action::WaitUntil(t + Duration::from_secs(15))
        );
    }

    /// A watch while absent starts from the oldest read that found the Lease absent, so a
    /// term that begins and vanishes meanwhile is seen; if that version is compacted away,
    /// such a term may have been missed, and the wait starts over.
    #[test]
    fn an_absence_is_watched_from_its_first_version_and_waited_out_again_when_compacted() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        absent_long_since(&mut e, t);
        assert_eq!(e.observed_version(), None);
        e.observe_absent(t, Some("7"));
        e.observe_absent(t, Some("9"));
        assert_eq!(e.observed_version(), Some("7"));
        assert!(matches!(e.next_action(t, wall()), Action::Create(_)));
        let gone = t + Duration::from_secs(1);
        e.watch_gone(gone);
        assert_eq!(e.observed_version(), None);
        assert_eq!(
            e.next_action(gone, wall()),
            Action::WaitUntil(gone + Duration::from_secs(15))
        );
    }

    /// Issue 13, item 4: the holder cleared by a foreign writer.
    #[test]
    fn a_foreign_cleared_holder_is_taken_only_after_the_old_holders_fence_closed() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        e.observe(&lease("other", "5", wall()), t);
        // `holderIdentity: ""` patched in: duration and renewTime as they were. Renewals
        // this replica missed may have extended the holder's fence: a whole duration from
        // when the clearing is seen.
        e.observe(&lease("", "6", wall()), t + Duration::from_secs(3));
        assert_eq!(
            e.next_action(t + Duration::from_secs(3), wall()),
            Action::WaitUntil(t + Duration::from_secs(18))
        );
        assert!(matches!(
            e.next_action(t + Duration::from_secs(18), wall()),
            Action::Replace(_)
        ));
        // A cleared record seen for the first time may hide a live holder: one duration.
        let mut newcomer = Elector::new("me", "l", "ns", timings());
        newcomer.observe(&lease("", "6", wall()), t);
        assert_eq!(
            newcomer.next_action(t, wall()),
            Action::WaitUntil(t + Duration::from_secs(15))
        );
    }

    #[test]
    fn a_graceful_release_is_taken_at_once() {
        let mut holder = Elector::new("other", "l", "ns", timings());
        let t = Instant::now();
        absent_long_since(&mut holder, t);
        holder.succeeded(&written(holder.next_action(t, wall()), "5"), t);
        let mut released = holder.release(later(), None).unwrap();
        released.metadata.resource_version = Some("6".into());

        let mut e = Elector::new("me", "l", "ns", timings());
        e.observe(&written(holder.next_action(t, wall()), "5"), t);
        e.observe(&released, t + Duration::from_secs(1));
        assert!(matches!(
            e.next_action(t + Duration::from_secs(1), wall()),
            Action::Replace(_)
        ));
    }

    /// Issue 13: the leader treats a changed record as lost leadership at once, and a
    /// relabel as nothing.
    #[test]
    fn the_leader_loses_on_a_changed_record_but_not_on_a_relabel() {
        let mut e = Elector::new("me", "l", "ns", timings());
        let t = Instant::now();
        absent_long_since(&mut e, t);
        let ours = written(e.next_action(t, wall()), "1");
        e.succeeded(&ours, t);
        let mut relabelled = ours.clone();
        relabelled.metadata.resource_version = Some("2".into());
        relabelled.metadata.labels = Some([("a".to_string(), "b".to_string())].into());
        e.observe(&relabelled, t + Duration::from_secs(1));
        assert!(e.is_leader(t + Duration::from_secs(1)));
        let Action::Replace(renew) = e.next_action(t + Duration::from_secs(1), wall()) else {
            panic!()
        };
        assert_eq!(renew.metadata.resource_version.as_deref(), Some("2"));
        // Same holder, but someone rewrote the record (e.g. its duration): term over.
        let mut changed = relabelled.clone();
        changed.metadata.resource_version = Some("3".into());
        changed.spec.as_mut().unwrap().lease_duration_seconds = Some(99);
        e.observe(&changed, t + Duration::from_secs(2));
        assert!(!e.is_leader(t + Duration::from_secs(2)));
        // Not a record we wrote: taken again only once it has expired (99 s after it was seen).
        assert_eq!(
            e.next_action(t + Duration::from_secs(2), wall()),
            Action::WaitUntil(t + Duration::from_secs(101))
        );
        // Deleted: term over too.
        let later = t + Duration::from_secs(101);
        e.succeeded(&written(e.next_action(later, wall()), "4"), later);
        assert!(e.is_leader(later));
        e.observe_absent(t, None);
        assert!(!e.is_leader(later));
    }

    /// Issue 13, item 8, and issue 30, hole 4: after an outage the holder retakes its Lease
    /// at once, and failed reads do not restart a follower's clock: the record is the same,
    /// so it was not renewed meanwhile.
    #[test]
    fn after_an_outage_an_unchanged_record_keeps_its_expiry() {
        let t = Instant::now();
        let mut leader = Elector::new("me", "l", "ns", timings());
        absent_long_since(&mut leader, t);
        let ours = written(leader.next_action(t, wall()), "1");
        leader.succeeded(&ours, t);
        let mut follower = Elector::new("f", "l", "ns", timings());
        follower.observe(&ours, t);
        // Reads fail for 14 s; the record read then is the one seen before.
        let back = t + Duration::from_secs(14);
        follower.observe(&ours, back);
        assert_eq!(
            follower.next_action(back, wall()),
            Action::WaitUntil(t + Duration::from_secs(15)),
            "the clock runs from the first sight of the record"
        );
        // 20 s of outage: the leader stepped down at its deadline; both read the record.
        leader.step_down();
        let back = t + Duration::from_secs(20);
        leader.observe(&ours, back);
        follower.observe(&ours, back);
        let action = leader.next_action(back, wall());
        let Action::Replace(l) = &action else {
            panic!("{action:?}")
        };
        assert_eq!(l.metadata.resource_version.as_deref(), Some("1"));
        assert!(matches!(
            follower.next_action(back, wall()),
            Action::Replace(_)
        ));
    }

    /// Issue 30, hole 2: a foreign write naming a former holder does not give that holder
    /// a term while the current holder's may still run.
    #[test]
    fn a_record_naming_us_that_we_did_not_write_is_not_ours() {
        let t = Instant::now();
        let mut p = Elector::new("p", "l", "ns", timings());
        absent_long_since(&mut p, t);
        p.succeeded(&written(p.next_action(t, wall()), "1"), t);
        // q took over after p's term; p follows.
        let later = t + Duration::from_secs(30);
        let mut q = Elector::new("q", "l", "ns", timings());
        q.observe(&lease("p", "1", wall()), t);
        let q_record = written(q.next_action(later, wall() + Duration::from_secs(30)), "2");
        p.observe(&q_record, later);
        // `kubectl patch lease … holderIdentity: p`
        let mut forged = q_record.clone();
        forged.spec.as_mut().unwrap().holder_identity = Some("p".into());
        forged.metadata.resource_version = Some("3".into());
        let seen = later + Duration::from_millis(100);
        p.observe(&forged, seen);
        assert_eq!(
            p.next_action(seen, wall()),
            Action::WaitUntil(seen + Duration::from_secs(15)),
            "taken only after it expires"
        );
        assert_eq!(p.release(wall(), None), None, "not p's to release");
        // Once it has expired, p starts a new term.
        let Action::Replace(l) = p.next_action(seen + Duration::from_secs(15), wall()) else {
            panic!("expected a takeover")
        };
        assert_ne!(
            l.spec.unwrap().acquire_time,
            forged.spec.unwrap().acquire_time
        );
    }

    /// Issue 30, hole 2: two live processes under one identity (a pinned `--identity`, a
    /// StatefulSet Pod force-deleted while its node is down) do not renew each other's term.
    #[test]
    fn two_processes_with_one_identity_take_the_lease_only_by_expiry() {
        let t = Instant::now();
        let mut a = Elector::new("same", "l", "ns", timings());
        let mut b = Elector::new("same", "l", "ns", timings());
        absent_long_since(&mut a, t);
        let a_record = written(a.next_action(t, wall()), "1");
        a.succeeded(&a_record, t);
        b.observe(&a_record, t);
        assert_eq!(
            b.next_action(t, wall()),
            Action::WaitUntil(t + Duration::from_secs(15))
        );
        // a renews; b takes over only once a's record has expired.
        let t2 = t + Duration::from_secs(2);
        let renewed = written(a.next_action(t2, wall() + Duration::from_secs(2)), "2");
        a.succeeded(&renewed, t2);
        b.observe(&renewed, t2);
        assert_eq!(
            b.next_action(t2, wall()),
            Action::WaitUntil(t2 + Duration::from_secs(15))
        );
        // b's own later term is not a's: a, having seen it, waits too.
        let t3 = t2 + Duration::from_secs(15);
        let b_record = written(b.next_action(t3, wall() + Duration::from_secs(17)), "3");
        b.succeeded(&b_record, t3);
        a.observe(&b_record, t3);
        assert!(!a.is_leader(t3));
        assert_eq!(
            a.next_action(t3, wall()),
            Action::WaitUntil(t3 + Duration::from_secs(15))
        );
    }

    /// A record whose write timed out on the client may still have been applied: read back,
    /// it is ours, to the microsecond.
    #[test]
    fn a_record_sent_without_an_answer_is_recognised_as_ours() {
        let t = Instant::now();
        let mut e = Elector::new("me", "l", "ns", timings());
        absent_long_since(&mut e, t);
        e.succeeded(&written(e.next_action(t, wall()), "1"), t);
        let t2 = t + Duration::from_secs(2);
        let at = wall() + Duration::from_nanos(2_000_000_789);
        let action = e.next_action(t2, at);
        e.sending(&action);
        // The answer is lost; the server kept the record, renewTime to the microsecond.
        let mut applied = written(action, "2");
        let renew = applied.spec.as_ref().unwrap().renew_time.clone().unwrap();
        assert_eq!(renew.0.subsec_nanosecond() % 1_000, 0);
        applied.spec.as_mut().unwrap().renew_time = Some(renew);
        e.step_down();
        e.observe(&applied, t2 + Duration::from_secs(1));
        let Action::Replace(l) = e.next_action(t2 + Duration::from_secs(1), wall()) else {
            panic!("ours: renewed at once")
        };
        assert_eq!(l.metadata.resource_version.as_deref(), Some("2"));
    }

    /// A container restarted in its Pod keeps its identity but not its term.
    #[test]
    fn a_restarted_process_waits_out_the_record_its_predecessor_wrote() {
        let t = Instant::now();
        let mut before = Elector::new("me", "l", "ns", timings());
        absent_long_since(&mut before, t);
        let record = written(before.next_action(t, wall()), "1");
        before.succeeded(&record, t);
        // The process dies; its successor, same identity, reads the record at once.
        let mut after = Elector::new("me", "l", "ns", timings());
        let seen = t + Duration::from_secs(1);
        after.observe(&record, seen);
        assert_eq!(
            after.next_action(seen, wall()),
            Action::WaitUntil(seen + Duration::from_secs(15))
        );
        assert_eq!(
            after.release(wall(), None),
            None,
            "not its record to release"
        );
        // Once it has expired the successor takes it as a new term.
        let Action::Replace(l) = after.next_action(seen + Duration::from_secs(15), wall()) else {
            panic!("expected a takeover")
        };
        let (spec, previous) = (l.spec.unwrap(), record.spec.unwrap());
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(
            spec.lease_transitions,
            Some(previous.lease_transitions.unwrap_or(0) + 1),
            "a new term, not a renewal"
        );
    }
}
