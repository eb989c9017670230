//! Scale-out mode's view of the shard group: who is a live member, who holds which shard
//! Lease, whose caches are warm for which shards; and from that view, the plan
//! ([`assignment`]), the shards this replica caches, and what its shard elections may do.
//!
//! Each replica holds a *member Lease* (`<lease>-member-<identity>`) that it renews every
//! retry period and that names the shards its cache has listed (annotation
//! [`WARM_ANNOTATION`]). All Leases of the group (members and shards, label
//! [`GROUP_LABEL`]) are read from one watch.
//!
//! Invariants:
//! - a member is live while its record keeps changing: judged, like a shard Lease, on this
//!   replica's monotonic clock from when the record last changed, against the longer of our
//!   lease duration and the record's (no remote clock is compared with ours);
//! - a member whose Pod proves that the process that wrote its member Lease exited
//!   ([`exit`]) is no member, whatever its Lease's age: its shards move at once;
//! - a member leaving gracefully clears its member Lease (a tombstone) *before* its shards
//!   are released, so the others plan without it by the time the releases arrive and take
//!   them at once; a late write of the departed member fails against the tombstone, which
//!   stays [`TOMBSTONE_AGE`] (so a member that left cannot reappear);
//! - this replica caches every shard the plan gives it to lead or stand by for, and every
//!   shard it still holds; it stops caching a shard only when neither is true any more.
//!   A standby cache it does not have yet may wait (at most a retry period) while a
//!   takeover is pending, so that its LIST does not slow the takeover down;
//! - the plan only steers: each shard's safety is its own Lease and fence;
//! - a holder hands a shard off only once the plan has asked for it for a retry period
//!   (`Settling`): while views differ (after an outage, a join) the plan may flip, and a
//!   holder releasing at once would pass its shards back and forth;
//! - the group watch must show this replica's own renewals: one that shows none of them
//!   for two retry periods is taken for dead (a connection a hanging outage left open, which
//!   kube's client, with no read timeout, would hold until it broke) and started over.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::ObjectMeta;
use kube::runtime::watcher::Event;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::assignment::{self, Intent, View};
use super::shard_key::ShardKey;
use crate::clock::Wall;
use crate::election::{GroupStore, KubeLeases, Read, StoreError, Timings};
use crate::observe::Observer;
use crate::replicas::exit;
use crate::replicas::this_pod::PodInfo;
use crate::replicas::{self, Pods, Replicas};
use crate::retry::{Reachability, retried};
use crate::term::Leadership;
use crate::throttle::{Throttle, Verdict};

/// The label every Lease of a shard group carries: the group's (base Lease's) name.
pub const GROUP_LABEL: &str = "trstringer.com/lease-group";
/// On a member Lease: the shards whose caches have listed, comma-separated.
pub const WARM_ANNOTATION: &str = "trstringer.com/warm-shards";

/// The Lease of shard `index` of group `group`.
pub fn shard_lease(group: &str, index: usize) -> String {
    format!("{group}-{index}")
}

/// The member Lease of `identity` in group `group` (the identity reduced to a DNS
/// subdomain; the Lease's holder names it exactly).
pub fn member_lease(group: &str, identity: &str) -> String {
    let name: String = identity
        .to_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let name = format!("{}{}", member_prefix(group), name.trim_matches(['-', '.']));
    name.chars().take(253).collect()
}

/// What the name of every member Lease of group `group` starts with.
fn member_prefix(group: &str) -> String {
    format!("{group}-member-")
}

/// The labels of every Lease of group `group`.
pub fn group_labels(group: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(GROUP_LABEL.to_string(), group.to_string())])
}

fn format_shards(shards: &BTreeSet<usize>) -> String {
    shards
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// A record's own lease duration.
fn duration_of(spec: &LeaseSpec) -> Duration {
    spec.lease_duration_seconds
        .map_or(Duration::ZERO, |s| Duration::from_secs(s.max(0) as u64))
}

fn parse_shards(text: &str) -> BTreeSet<usize> {
    text.split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

/// A Lease of the group as this replica saw it, and since when its record is unchanged.
struct Seen {
    spec: LeaseSpec,
    warm: BTreeSet<usize>,
    /// The Pod and process that wrote it ([`exit`]).
    holder: Option<exit::Holder>,
    resource_version: String,
    since: Instant,
}

/// The group's Leases, by name, as the watch shows them.
#[derive(Default)]
pub struct Group {
    leases: BTreeMap<String, Seen>,
}

impl Group {
    /// Records a Lease at `now` (`wall` on the wall clock); its liveness clock restarts
    /// only when its record changed. A record seen for the first time is dated by its
    /// `renewTime` against our wall clock (at most a lease duration back): a replica that
    /// starts must not count a member dead for minutes as live for a lease duration. This
    /// steers only the plan; each shard Lease's expiry never reads a remote clock.
    pub fn observe(&mut self, lease: &Lease, now: Instant, wall: Timestamp) {
        let spec = lease.spec.clone().unwrap_or_default();
        let warm = lease
            .annotations()
            .get(WARM_ANNOTATION)
            .map(|w| parse_shards(w))
            .unwrap_or_default();
        let name = lease.name_any();
        let holder = exit::Holder::of(lease);
        let resource_version = lease.resource_version().unwrap_or_default();
        let since = match self.leases.get_mut(&name) {
            Some(seen) if seen.spec == spec => {
                seen.warm = warm;
                seen.holder = holder;
                seen.resource_version = resource_version;
                return;
            }
            Some(_) => now,
            None => {
                let age = spec
                    .renew_time
                    .as_ref()
                    .and_then(|t| Duration::try_from(wall.duration_since(t.0)).ok())
                    .unwrap_or_default()
                    .min(duration_of(&spec));
                now.checked_sub(age).unwrap_or(now)
            }
        };
        self.leases.insert(
            name,
            Seen {
                spec,
                warm,
                holder,
                resource_version,
                since,
            },
        );
    }

    /// Forgets a deleted Lease.
    pub fn forget(&mut self, name: &str) {
        self.leases.remove(name);
    }

    /// The view at `now`: members whose Lease changed within the lease duration and whose
    /// process is not proven to have exited by its Pod in `pods` (plus `me`, when joined),
    /// the shard holders among them, and who is warm for what.
    pub fn view(
        &self,
        group: &str,
        shards: usize,
        me: Option<&str>,
        lease_duration: Duration,
        now: Instant,
        pods: &Pods,
    ) -> (View, BTreeMap<String, BTreeSet<usize>>) {
        let prefix = member_prefix(group);
        let mut members = BTreeSet::new();
        let mut warm = BTreeMap::new();
        for (name, seen) in &self.leases {
            let Some(holder) = seen
                .spec
                .holder_identity
                .as_deref()
                .filter(|h| !h.is_empty())
            else {
                continue;
            };
            let duration = duration_of(&seen.spec).max(lease_duration);
            let exited = pods
                .get(holder)
                .and_then(|pod| exit::exited(holder, seen.holder.as_ref(), pod));
            if name.starts_with(&prefix) && now < seen.since + duration && exited.is_none() {
                members.insert(holder.to_string());
                warm.insert(holder.to_string(), seen.warm.clone());
            }
        }
        if let Some(me) = me {
            members.insert(me.to_string());
        }
        let holders = (0..shards)
            .map(|i| {
                self.leases
                    .get(&shard_lease(group, i))
                    .and_then(|seen| seen.spec.holder_identity.clone())
                    .filter(|h| members.contains(h))
            })
            .collect();
        (View { members, holders }, warm)
    }

    /// The member Leases of departed members (no holder) unchanged for [`TOMBSTONE_AGE`],
    /// with their resourceVersions.
    fn tombstones(&self, group: &str, now: Instant) -> Vec<(String, String)> {
        let prefix = member_prefix(group);
        self.leases
            .iter()
            .filter(|(name, seen)| {
                name.starts_with(&prefix)
                    && seen
                        .spec
                        .holder_identity
                        .as_deref()
                        .unwrap_or_default()
                        .is_empty()
                    && now >= seen.since + TOMBSTONE_AGE
            })
            .map(|(name, seen)| (name.clone(), seen.resource_version.clone()))
            .collect()
    }

    /// When the next member would expire, if any.
    fn next_expiry(&self, group: &str, lease_duration: Duration) -> Option<Instant> {
        let prefix = member_prefix(group);
        self.leases
            .iter()
            .filter(|(name, _)| name.starts_with(&prefix))
            .map(|(_, seen)| seen.since + lease_duration)
            .min()
    }
}

/// The shard caches a scale-out replica keeps warm: the user's side of the plan. The
/// membership tells it which shards to cache; it tells the membership which have listed.
pub trait ShardCaches: Send + Sync + 'static {
    /// Caches exactly `shards` from now on (starting the missing, stopping the others).
    fn cache_shards(&self, shards: &BTreeSet<usize>);
    /// The shards being cached (listed or not).
    fn cached_shards(&self) -> BTreeSet<usize>;
    /// The shards whose caches have completed their first list.
    fn warm_shards(&self) -> BTreeSet<usize>;
    /// Changes whenever [`ShardCaches::warm_shards`] may have changed.
    fn subscribe_warmed(&self) -> watch::Receiver<u64>;
}

/// A replica's place in a shard group: who it is, in which group, and what it sees with.
/// Shared by the [`Membership`] and the shard elections of a
/// [`crate::scaleout::ShardGroup`].
#[derive(Clone)]
pub struct Member<S = KubeLeases> {
    /// The group's Leases (member and shard Leases share a namespace; for a real cluster,
    /// [`KubeLeases`] over the election client's API: never fenced).
    pub leases: S,
    /// The wall clock written into the member Lease and against which a record seen for
    /// the first time is dated ([`crate::clock::system_wall`] but in a simulation).
    pub wall: Wall,
    /// This replica's identity (the holder it writes).
    pub identity: String,
    /// The group's (base Lease's) name: shard Leases are `<group>-<i>`, member Leases
    /// `<group>-member-<identity>`.
    pub group: String,
    /// The shards, and how objects map to them.
    pub key: ShardKey,
    /// How many replicas besides the leader keep each shard's cache warm.
    pub standbys: usize,
    /// The group's timings (a member is live for a lease duration after its last change).
    pub timings: Timings,
    /// The API server's returns: the watch retries at once when it is back.
    pub reachability: Reachability,
    /// Told the terms, and the number of shards led and cached and of members seen.
    pub observer: Arc<dyn Observer>,
    /// In a Pod: this replica's Pod. Its ServiceAccount owns the member Lease (as it owns
    /// the shard Leases), so `helm uninstall` removes a crashed replica's too; its uid and
    /// instance go on it, so the others can drop this member as soon as its Pod proves
    /// that its process exited ([`exit`]).
    pub pod: Option<PodInfo>,
    /// In a Pod: the replicas' Pods, which prove other members' exits.
    pub replicas: Option<Replicas>,
}

/// What a scale-out replica's membership needs.
pub struct Membership<C, S = KubeLeases> {
    /// Who this replica is in which group.
    pub member: Member<S>,
    /// The shard caches.
    pub caches: C,
    /// One per shard, in order: whether this replica leads it.
    pub leaderships: Vec<Leadership>,
    /// Where the plan's word for this replica goes (the shard elections' seats).
    pub intent: watch::Sender<Intent>,
}

impl<C: ShardCaches, S: GroupStore> Membership<C, S> {
    /// Renews this replica's member Lease and keeps the plan, the cached shards and the
    /// intent current, until `stop` fires; then clears the member Lease (leaving the
    /// group) and returns.
    pub async fn run(self, stop: CancellationToken) {
        let name = member_lease(&self.member.group, &self.member.identity);
        let selector = format!("{GROUP_LABEL}={}", self.member.group);
        let watch = || {
            Box::pin(retried(
                self.member.leases.watch_group(&selector),
                self.member.reachability.subscribe(),
                "Lease".into(),
            ))
        };
        let mut events = watch();
        let mut echo = Echo::default();
        let echo_within = echo_within(self.member.timings);
        let mut warmed = self.caches.subscribe_warmed();
        let mut roles: Vec<_> = self.leaderships.iter().map(Leadership::subscribe).collect();
        let mut pods = self.member.replicas.as_ref().map(Replicas::subscribe);
        let mut group = Group::default();
        let mut listing: Option<Group> = None;
        let mut listed = false;
        let mut written: Option<Lease> = None;
        // Start of the last successful renewal: this replica plans itself in while the
        // others can still see it live.
        let mut renewed: Option<Instant> = None;
        let mut renew_at = crate::clock::now();
        let mut failures = Throttle::new(Duration::from_secs(30));
        // Since when a takeover has been pending (new standby caches wait for it).
        let mut deferring: Option<Instant> = None;
        let mut settling = Settling::default();
        let retry = self.member.timings.retry_period;
        loop {
            let now = crate::clock::now();
            let warm_mine = self.caches.warm_shards();
            let stale = written.as_ref().is_none_or(|w| {
                w.annotations().get(WARM_ANNOTATION) != Some(&format_shards(&warm_mine))
            });
            if now >= renew_at || (stale && written.is_some()) {
                match self.renew(&name, written.as_ref(), &warm_mine).await {
                    Ok(lease) => {
                        renewed = Some(now);
                        if let Some(run) = failures.succeeded() {
                            info!(failures = run, "member Lease renewals succeed again");
                        }
                        group.observe(&lease, crate::clock::now(), self.member.wall.now());
                        echo.wrote(
                            lease.resource_version().unwrap_or_default(),
                            crate::clock::now(),
                            echo_within,
                        );
                        written = Some(lease);
                        renew_at = crate::clock::now() + retry;
                    }
                    Err(err) => {
                        if let Verdict::Log { suppressed } = failures.failed(crate::clock::now()) {
                            warn!(error = %err, suppressed, "renewing the member Lease failed; retrying every retry period");
                        }
                        // Read it again before the next attempt.
                        written = None;
                        renew_at = crate::clock::now() + retry;
                    }
                }
            }
            // Plan only once the group is known: planning alone would cache every shard.
            let mut replan_by = None;
            if listed {
                let joined = renewed.is_some_and(|at| {
                    crate::clock::now() < at + self.member.timings.lease_duration
                });
                replan_by = self.replan(&group, joined, &mut deferring, &mut settling);
                if renewed == Some(now) {
                    self.sweep(&group).await;
                }
            }
            if echo.due().is_some_and(|due| crate::clock::now() >= due) {
                warn!("the group watch shows none of this replica's renewals; starting it over");
                events = watch();
                listing = None;
                echo.restarted(crate::clock::now(), echo_within);
            }
            let wake = group
                .next_expiry(&self.member.group, self.member.timings.lease_duration)
                .filter(|t| *t > crate::clock::now())
                .into_iter()
                .chain(replan_by)
                .chain(echo.due())
                .fold(renew_at, Instant::min);
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep_until(wake.into()) => {}
                _ = warmed.changed() => {}
                _ = replicas::changed(&mut pods) => {}
                _ = futures::future::select_all(roles.iter_mut().map(|r| Box::pin(r.changed()))) => {}
                event = events.next() => {
                    if let Some(Event::Apply(lease) | Event::InitApply(lease)) = &event
                        && lease.name_any() == name
                    {
                        let version = lease.resource_version().unwrap_or_default();
                        echo.seen(&version, crate::clock::now(), echo_within);
                    }
                    match event {
                        Some(Event::Apply(lease)) => group.observe(&lease, crate::clock::now(), self.member.wall.now()),
                        Some(Event::Delete(lease)) => group.forget(&lease.name_any()),
                        Some(Event::Init) => listing = Some(Group::default()),
                        Some(Event::InitApply(lease)) => {
                            if let Some(fresh) = listing.as_mut() {
                                fresh.observe(&lease, crate::clock::now(), self.member.wall.now());
                            }
                        }
                        Some(Event::InitDone) => {
                            // Keep the liveness clocks of records that did not change.
                            let mut fresh = listing.take().unwrap_or_default();
                            for (name, seen) in fresh.leases.iter_mut() {
                                if let Some(old) = group.leases.get(name).filter(|o| o.spec == seen.spec) {
                                    seen.since = old.since;
                                }
                            }
                            group = fresh;
                            listed = true;
                        }
                        None => break,
                    }
                }
            }
        }
        self.leave(&name, written).await;
    }

    /// Recomputes the plan: caches what it says, tells the shard elections what they may do.
    /// While a takeover is pending (since `deferring`), new standby caches wait for it, for
    /// at most a retry period; a hand-off waits until it has settled. Returns when the
    /// next of those waits ends, if one is on.
    fn replan(
        &self,
        group: &Group,
        joined: bool,
        deferring: &mut Option<Instant>,
        settling: &mut Settling,
    ) -> Option<Instant> {
        let me = joined.then_some(self.member.identity.as_str());
        let pods = self
            .member
            .replicas
            .as_ref()
            .map(Replicas::pods)
            .unwrap_or_default();
        let (view, mut warm) = group.view(
            &self.member.group,
            self.member.key.shards(),
            me,
            self.member.timings.lease_duration,
            crate::clock::now(),
            &pods,
        );
        let plan = assignment::plan(&view, self.member.standbys);
        let held: BTreeSet<usize> = self
            .leaderships
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_leading())
            .map(|(i, _)| i)
            .collect();
        warm.insert(self.member.identity.clone(), self.caches.warm_shards());
        let mut intent = assignment::intent(&plan, &self.member.identity, &warm, &held);
        let now = crate::clock::now();
        let settles_at;
        (intent.hand_off, settles_at) =
            settling.settled(&intent.hand_off, now, self.member.timings.retry_period);
        let until = if assignment::takeover_pending(&plan, &self.member.identity, &held) {
            Some(*deferring.get_or_insert(now) + self.member.timings.retry_period)
        } else {
            *deferring = None;
            None
        };
        let until = until.filter(|t| now < *t);
        let cached = assignment::to_cache(
            &plan,
            &self.member.identity,
            &held,
            &self.caches.cached_shards(),
            until.is_some(),
        );
        self.caches.cache_shards(&cached);
        self.member
            .observer
            .shards(held.len(), cached.len(), view.members.len());
        self.intent.send_if_modified(|current| {
            if *current == intent {
                return false;
            }
            info!(
                lead = %format_shards(&intent.lead),
                hand_off = %format_shards(&intent.hand_off),
                members = view.members.len(),
                "shard plan changed"
            );
            *current = intent;
            true
        });
        until.into_iter().chain(settles_at).min()
    }

    /// Creates or renews the member Lease, naming the warm shards.
    async fn renew(
        &self,
        name: &str,
        written: Option<&Lease>,
        warm: &BTreeSet<usize>,
    ) -> Result<Lease, String> {
        let timeout = self.member.timings.retry_period;
        let now = MicroTime(self.member.wall.now());
        let current = match written {
            Some(lease) => Some(lease.clone()),
            None => match tokio::time::timeout(timeout, self.member.leases.get(name))
                .await
                .map_err(|_| "reading the member Lease timed out".to_string())?
                .map_err(|e| format!("reading the member Lease: {e}"))?
            {
                Read::Found(lease) => Some(*lease),
                Read::Absent { .. } => None,
            },
        };
        let mut annotations = self
            .member
            .pod
            .as_ref()
            .map(PodInfo::annotations)
            .unwrap_or_default();
        annotations.insert(WARM_ANNOTATION.to_string(), format_shards(warm));
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(group_labels(&self.member.group)),
                annotations: Some(annotations),
                resource_version: current.as_ref().and_then(|l| l.resource_version()),
                owner_references: self
                    .member
                    .pod
                    .as_ref()
                    .map(|p| vec![p.service_account.clone()]),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.member.identity.clone()),
                lease_duration_seconds: Some(self.member.timings.lease_duration.as_secs() as i32),
                renew_time: Some(now),
                ..Default::default()
            }),
        };
        let request = async {
            match current {
                Some(_) => self.member.leases.replace(&lease).await,
                None => self.member.leases.create(&lease).await,
            }
        };
        tokio::time::timeout(timeout, request)
            .await
            .map_err(|_| "writing the member Lease timed out".to_string())?
            .map_err(|e| format!("writing the member Lease: {e}"))
    }

    /// Leaves the group: clears the holder of the member Lease (a *tombstone*), so the
    /// others plan without this replica at once. The Lease is not deleted: a renew of ours
    /// that timed out here may still reach the API server, and against a tombstone it fails
    /// (its resourceVersion conflicts, a create finds the Lease exists) instead of bringing
    /// the departed member back for a lease duration. [`Membership::sweep`] deletes
    /// tombstones once no such write can still arrive.
    async fn leave(&self, name: &str, written: Option<Lease>) {
        let request = async {
            let mut current = written;
            for _ in 0..2 {
                let lease = match current.take() {
                    Some(lease) => lease,
                    None => match self.member.leases.get(name).await? {
                        Read::Found(lease) => *lease,
                        Read::Absent { .. } => return Ok(()),
                    },
                };
                let cleared = tombstone(lease, self.member.wall.now());
                match self.member.leases.replace(&cleared).await {
                    Err(StoreError::Conflict) => continue,
                    Err(StoreError::NotFound) => return Ok(()),
                    other => return other.map(drop),
                }
            }
            Ok(())
        };
        match tokio::time::timeout(self.member.timings.retry_period, request).await {
            Ok(Ok(())) => info!("left the shard group"),
            Ok(Err(err)) => {
                warn!(error = %err, "clearing the member Lease failed; the others see it expire")
            }
            Err(_) => warn!("clearing the member Lease timed out; the others see it expire"),
        }
    }

    /// Deletes the group's tombstones that are older than [`TOMBSTONE_AGE`] (each only
    /// if unchanged since it was seen); a failure is left to the next sweep.
    async fn sweep(&self, group: &Group) {
        for (name, resource_version) in group.tombstones(&self.member.group, crate::clock::now()) {
            match tokio::time::timeout(
                self.member.timings.retry_period,
                self.member.leases.delete(&name, &resource_version),
            )
            .await
            {
                Ok(Ok(_)) => info!(lease = %name, "deleted a departed member's Lease"),
                Ok(Err(err)) => {
                    debug!(lease = %name, error = %err, "deleting a departed member's Lease failed")
                }
                Err(_) => debug!(lease = %name, "deleting a departed member's Lease timed out"),
            }
        }
    }
}

/// The hand-offs the plan asks for, and since when (pure: fed the wanted set and the
/// monotonic time).
#[derive(Debug, Default)]
struct Settling {
    since: BTreeMap<usize, Instant>,
}

impl Settling {
    /// Of the hand-offs `wanted` now, those wanted without a break for `settle`; and when
    /// the next of the others will have been.
    fn settled(
        &mut self,
        wanted: &BTreeSet<usize>,
        now: Instant,
        settle: Duration,
    ) -> (BTreeSet<usize>, Option<Instant>) {
        self.since.retain(|shard, _| wanted.contains(shard));
        for shard in wanted {
            self.since.entry(*shard).or_insert(now);
        }
        let ready = self
            .since
            .iter()
            .filter(|(_, since)| now >= **since + settle)
            .map(|(shard, _)| *shard)
            .collect();
        let next = self
            .since
            .values()
            .map(|since| *since + settle)
            .filter(|at| *at > now)
            .min();
        (ready, next)
    }
}

/// How long the group watch may take to show a renewal of this replica's member Lease
/// before it is taken for dead: two retry periods (two renewals), at least two seconds.
fn echo_within(timings: Timings) -> Duration {
    (timings.retry_period * 2).max(Duration::from_secs(2))
}

/// Whether the group watch shows this replica's own renewals (pure: fed the renewals, what
/// the watch delivered of them, and the monotonic time).
#[derive(Debug, Default)]
struct Echo {
    /// The resourceVersion of the last renewal the watch has not shown yet, and when the
    /// watch is due to have shown some progress towards it.
    awaited: Option<(String, Instant)>,
}

impl Echo {
    /// A renewal wrote `resource_version` at `now`: the watch must show it within
    /// `within` (counted from the oldest renewal it has not shown).
    fn wrote(&mut self, resource_version: String, now: Instant, within: Duration) {
        let due = self.awaited.as_ref().map_or(now + within, |(_, due)| *due);
        self.awaited = Some((resource_version, due));
    }

    /// The watch delivered the member Lease at `resource_version`: the last renewal shown,
    /// or an earlier one (the watch lags but lives: it gets `within` more).
    fn seen(&mut self, resource_version: &str, now: Instant, within: Duration) {
        match &mut self.awaited {
            Some((awaited, _)) if awaited == resource_version => self.awaited = None,
            Some((_, due)) => *due = now + within,
            None => {}
        }
    }

    /// When the watch is due to have shown the awaited renewal, if one is awaited.
    fn due(&self) -> Option<Instant> {
        self.awaited.as_ref().map(|(_, due)| *due)
    }

    /// The watch was started over at `now`: it gets `within` to list the last renewal.
    fn restarted(&mut self, now: Instant, within: Duration) {
        if let Some((_, due)) = &mut self.awaited {
            *due = now + within;
        }
    }
}

/// How long a departed member's cleared Lease stays: longer than any of its writes can
/// take to arrive (the API server's default request timeout is 60 s).
pub const TOMBSTONE_AGE: Duration = Duration::from_secs(300);

/// `lease` with its holder cleared at wall time `now`: what a member that left leaves
/// behind.
fn tombstone(mut lease: Lease, now: Timestamp) -> Lease {
    let spec = lease.spec.get_or_insert_default();
    spec.holder_identity = Some(String::new());
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(MicroTime(now));
    if let Some(annotations) = lease.metadata.annotations.as_mut() {
        annotations.remove(WARM_ANNOTATION);
    }
    lease
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    fn lease(name: &str, holder: &str, renew: &str, warm: &str) -> Lease {
        let mut lease = Lease::default();
        lease.metadata.name = Some(name.into());
        lease.metadata.annotations = Some(BTreeMap::from([(WARM_ANNOTATION.into(), warm.into())]));
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(4),
            renew_time: Some(MicroTime(renew.parse().unwrap())),
            ..Default::default()
        });
        lease
    }

    #[test]
    fn a_hand_off_waits_until_the_plan_has_asked_for_it_a_retry_period() {
        let t = Instant::now();
        let settle = Duration::from_secs(2);
        let mut settling = Settling::default();
        let shards = |s: &[usize]| s.iter().copied().collect::<BTreeSet<usize>>();
        assert_eq!(
            settling.settled(&shards(&[0, 1]), t, settle),
            (shards(&[]), Some(t + settle))
        );
        // The plan flips shard 0 back: its wait starts over when it is asked for again.
        settling.settled(&shards(&[1]), t + Duration::from_secs(1), settle);
        assert_eq!(
            settling.settled(&shards(&[0, 1]), t + settle, settle),
            (shards(&[1]), Some(t + Duration::from_secs(4)))
        );
        assert_eq!(
            settling.settled(&shards(&[0, 1]), t + Duration::from_secs(4), settle),
            (shards(&[0, 1]), None)
        );
    }

    #[test]
    fn a_watch_that_shows_no_renewal_is_due_to_start_over() {
        let t = Instant::now();
        let within = Duration::from_secs(4);
        let mut echo = Echo::default();
        assert_eq!(echo.due(), None, "nothing written, nothing awaited");
        echo.wrote("5".into(), t, within);
        echo.wrote("6".into(), t + Duration::from_secs(2), within);
        assert_eq!(
            echo.due(),
            Some(t + within),
            "due from the oldest unshown renewal"
        );
        echo.seen("5", t + Duration::from_secs(3), within);
        assert_eq!(
            echo.due(),
            Some(t + Duration::from_secs(7)),
            "a lagging watch lives"
        );
        echo.seen("6", t + Duration::from_secs(3), within);
        assert_eq!(echo.due(), None, "the last renewal shown");
        echo.wrote("7".into(), t + Duration::from_secs(4), within);
        echo.restarted(t + Duration::from_secs(9), within);
        assert_eq!(echo.due(), Some(t + Duration::from_secs(13)));
    }

    #[test]
    fn member_lease_names_are_dns_subdomains() {
        assert_eq!(member_lease("op", "Pod_1"), "op-member-pod-1");
        assert_eq!(member_lease("op", "a.b-c"), "op-member-a.b-c");
        assert_eq!(shard_lease("op", 3), "op-3");
        assert_eq!(parse_shards("0,3, 5,x"), BTreeSet::from([0, 3, 5]));
        assert_eq!(format_shards(&BTreeSet::from([1, 2])), "1,2");
    }

    fn wall(text: &str) -> Timestamp {
        text.parse().unwrap()
    }

    #[test]
    fn members_live_while_their_records_change_and_holders_must_be_members() {
        // Far enough from Instant's origin to date records seconds back.
        let t = Instant::now() + Duration::from_secs(3600);
        let second = Duration::from_secs(1);
        let w = wall("2026-01-01T00:00:00Z");
        let mut group = Group::default();
        group.observe(
            &lease("op-member-a", "a", "2026-01-01T00:00:00Z", "0,1"),
            t,
            w,
        );
        group.observe(&lease("op-member-b", "b", "2026-01-01T00:00:00Z", ""), t, w);
        group.observe(&lease("op-0", "a", "2026-01-01T00:00:00Z", ""), t, w);
        group.observe(&lease("op-1", "b", "2026-01-01T00:00:00Z", ""), t, w);
        // a renews; b does not.
        group.observe(
            &lease("op-member-a", "a", "2026-01-01T00:00:03Z", "0,1"),
            t + 3 * second,
            w,
        );
        let (view, warm) = group.view(
            "op",
            2,
            Some("me"),
            4 * second,
            t + 2 * second,
            &Pods::default(),
        );
        assert_eq!(
            view.members,
            BTreeSet::from(["a".into(), "b".into(), "me".into()])
        );
        assert_eq!(warm["a"], BTreeSet::from([0, 1]));
        let (view, _) = group.view("op", 2, None, 4 * second, t + 5 * second, &Pods::default());
        assert_eq!(view.members, BTreeSet::from(["a".into()]));
        assert_eq!(view.holders, [Some("a".into()), None], "b expired");
        // A metadata-only change (the warm shards) does not restart the clock.
        group.observe(
            &lease("op-member-a", "a", "2026-01-01T00:00:03Z", "0"),
            t + 6 * second,
            w,
        );
        let (view, warm) = group.view(
            "op",
            2,
            None,
            4 * second,
            t + 7 * second + second,
            &Pods::default(),
        );
        assert!(view.members.is_empty(), "{view:?}");
        assert!(warm.is_empty());
    }

    #[test]
    fn a_record_first_seen_is_dated_by_its_renew_time() {
        let t = Instant::now() + Duration::from_secs(3600);
        let second = Duration::from_secs(1);
        let mut group = Group::default();
        // Renewed 10 s ago by our wall clock: dead at first sight (4 s lease).
        group.observe(
            &lease("op-member-old", "old", "2026-01-01T00:00:00Z", ""),
            t,
            wall("2026-01-01T00:00:10Z"),
        );
        // Renewed 1 s ago: live for 3 s more.
        group.observe(
            &lease("op-member-new", "new", "2026-01-01T00:00:09Z", ""),
            t,
            wall("2026-01-01T00:00:10Z"),
        );
        let (view, _) = group.view("op", 0, None, 4 * second, t, &Pods::default());
        assert_eq!(view.members, BTreeSet::from(["new".into()]));
        let (view, _) = group.view("op", 0, None, 4 * second, t + 3 * second, &Pods::default());
        assert!(view.members.is_empty());
    }

    /// Issue 30, hole 6: a member whose Pod proves that the process that wrote its member
    /// Lease exited leaves the plan at once, and its shards with it (before, it stayed a
    /// member until its Lease expired, so its shards waited for the lease duration).
    #[test]
    fn a_member_whose_exit_is_proven_leaves_the_plan_at_once() {
        let t = Instant::now() + Duration::from_secs(3600);
        let w = wall("2026-01-01T00:00:00Z");
        let mut group = Group::default();
        let mut b = lease("op-member-b", "b", "2026-01-01T00:00:00Z", "0");
        b.metadata.annotations.as_mut().unwrap().extend([
            (exit::HOLDER_UID.to_string(), "uid-b".to_string()),
            (exit::HOLDER_INSTANCE.to_string(), "i1".to_string()),
        ]);
        group.observe(&b, t, w);
        group.observe(
            &lease("op-member-a", "a", "2026-01-01T00:00:00Z", "0"),
            t,
            w,
        );
        group.observe(&lease("op-0", "b", "2026-01-01T00:00:00Z", ""), t, w);
        let pod = |message: &str| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "b", "uid": "uid-b"},
                "status": {"containerStatuses": [{"name": "operator", "image": "i",
                    "imageID": "", "ready": false, "restartCount": 1,
                    "state": {"running": {"startedAt": "2026-01-01T00:00:01Z"}},
                    "lastState": {"terminated": {"exitCode": 137, "message": message}}}]}
            }))
            .unwrap()
        };
        let pods = |message: &str| Pods::from([("b".to_string(), Arc::new(pod(message)))]);
        // An earlier instance's termination proves nothing: b is live, and holds shard 0.
        let (view, _) = group.view(
            "op",
            1,
            None,
            Duration::from_secs(4),
            t,
            &pods("myresource-operator instance i0"),
        );
        assert_eq!(view.members, BTreeSet::from(["a".into(), "b".into()]));
        assert_eq!(view.holders, [Some("b".into())]);
        // Its own: b is out of the plan at once, and shard 0 has no holder to wait for.
        let (view, _) = group.view(
            "op",
            1,
            None,
            Duration::from_secs(4),
            t,
            &pods("myresource-operator instance i1"),
        );
        assert_eq!(view.members, BTreeSet::from(["a".into()]));
        assert_eq!(view.holders, [None]);
    }

    /// Issue 30, hole 6: a member that left is a tombstone (no holder), never a member;
    /// tombstones are swept only after [`TOMBSTONE_AGE`].
    #[test]
    fn a_departed_member_leaves_a_tombstone_until_its_writes_are_over() {
        let t = Instant::now() + Duration::from_secs(3600);
        let w = wall("2026-01-01T00:00:00Z");
        let mut group = Group::default();
        let mut live = lease("op-member-b", "b", "2026-01-01T00:00:00Z", "0");
        live.metadata.resource_version = Some("7".into());
        let mut gone = tombstone(live.clone(), Timestamp::now());
        gone.metadata.resource_version = Some("8".into());
        assert_eq!(
            gone.spec.as_ref().unwrap().holder_identity.as_deref(),
            Some("")
        );
        assert!(!gone.annotations().contains_key(WARM_ANNOTATION));
        group.observe(&live, t, w);
        group.observe(&gone, t, w);
        let (view, _) = group.view("op", 0, None, Duration::from_secs(4), t, &Pods::default());
        assert!(view.members.is_empty());
        assert!(group.tombstones("op", t + TOMBSTONE_AGE / 2).is_empty());
        assert_eq!(
            group.tombstones("op", t + TOMBSTONE_AGE),
            [("op-member-b".to_string(), "8".to_string())]
        );
        // The same identity back before the sweep: its Lease is a member again.
        let mut back = live;
        back.metadata.resource_version = Some("9".into());
        back.spec.as_mut().unwrap().renew_time = Some(MicroTime(wall("2026-01-01T00:05:00Z")));
        group.observe(&back, t + TOMBSTONE_AGE, w);
        assert!(group.tombstones("op", t + TOMBSTONE_AGE * 2).is_empty());
    }
}
