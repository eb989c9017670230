//! Injecting a round's fault into the replicas, the Lease or the API server, and waiting
//! for the recovery after it.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use e2e::foreign_lease;
use e2e::lease::{self, TEST_TIMINGS, Timings};
use e2e::overload_proxy::{Overload, OverloadStats};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use kube_leasehold::scaleout::membership::member_lease;
use kube_leasehold::scaleout::shard_key::ShardKey;
use myresource_operator::resource::{MyResource, MyResourceSpec};
use serde_json::{Value, json};

use super::probe::Probes;
use super::schedule::Fault;
use super::{Chaos, NAMESPACE};

/// The leader of a `mixed_timings` round: an older replica with longer timings.
const LONG_TIMINGS: Timings = Timings::secs(12, 8, 2);
/// How long the long-timed leader is frozen: longer than the others' lease duration and
/// retry period (a follower that judges expiry by its own 4 s acquires meanwhile), shorter
/// than its own 8 s renew deadline (so it resumes still believing it leads, and writes).
const MIXED_FREEZE: Duration = Duration::from_secs(6);
/// A GitOps or policy tool relabelling the Lease: every 2 s, six times.
const RELABEL_EVERY: Duration = Duration::from_secs(2);
const RELABEL_COUNT: usize = 6;
const RELABEL_FOR: Duration = Duration::from_secs(12);
/// How long the followers' Lease reads keep failing after the leader's kill: past the
/// failover goal, so a failover that waits for a clean read misses it.
const READS_FAILING_FOR: Duration = Duration::from_secs(8);
/// How often the followers' connections are reset meanwhile.
const RESET_EVERY: Duration = Duration::from_millis(250);
/// How long the leader's API server is overloaded.
const OVERLOAD_FOR: Duration = Duration::from_secs(8);
/// How many creations `cross_shard_recreate` may take to land an object in a given set of
/// shards (each try lands in it with a probability of at least 1/6).
const CROSS_SHARD_TRIES: usize = 40;
/// How long `cross_shard_recreate` freezes the struck replica: within the renew deadline
/// (test timings 4 s / 3 s / 1 s), so that it still leads when it wakes.
const CROSS_SHARD_FREEZE: Duration = Duration::from_millis(1500);
/// How long `etcd_stall` holds etcd: past the renew deadline and the lease duration (test
/// timings 4 s / 3 s / 1 s), so every fence closes while writes wait inside the API server.
pub(super) const ETCD_STALL: Duration = Duration::from_secs(6);

/// Where and when a fault struck: the moment, the leader it struck, what it did.
pub(super) struct Hit {
    pub(super) at: Timestamp,
    pub(super) leader: String,
    details: Value,
    /// The overloaded slot and its proxy's counts before the overload.
    overloaded: Option<(usize, OverloadStats)>,
}

impl Chaos {
    /// Strikes slot `leader` with `fault`; the Lease faults strike the Lease `lease` (in
    /// scale-out mode, one of the shard Leases the struck replica holds).
    pub(super) async fn inject(&mut self, fault: Fault, leader: usize, lease: &str) -> Result<Hit> {
        let mut hit = Hit {
            at: Timestamp::now(),
            leader: self.slots[leader].operator.config.identity.clone(),
            details: json!({}),
            overloaded: None,
        };
        match fault {
            Fault::LeaderKill => self.restart_slot(leader).await?,
            Fault::LeaderTerm => {
                self.slots[leader].operator.stop();
                self.restart_slot(leader).await?;
            }
            Fault::LeaderFreeze => {
                let process = &self.slots[leader].operator.process;
                process.signal(libc::SIGSTOP);
                tokio::time::sleep(TEST_TIMINGS.lease_duration + Duration::from_secs(2)).await;
                self.slots[leader].operator.process.signal(libc::SIGCONT);
            }
            Fault::LeaderPartition => {
                self.slots[leader].proxy.block();
                tokio::time::sleep(TEST_TIMINGS.lease_duration + Duration::from_secs(2)).await;
                self.slots[leader].proxy.heal();
            }
            Fault::FollowerKill => {
                let follower = (leader + 1 + self.rng.below(2)) % self.slots.len();
                self.restart_slot(follower).await?;
            }
            Fault::ApiserverRestart => {
                // This kind's failover includes the restart: say how much of it that was.
                let started = std::time::Instant::now();
                self.cluster.restart("kube-apiserver").await?;
                hit.details["restart_seconds"] = started.elapsed().as_secs_f64().into();
            }
            Fault::LeaseDelete => foreign_lease::delete(&self.leases(), lease).await?,
            Fault::LeaseClearHolder => foreign_lease::set_holder(&self.leases(), lease, "").await?,
            Fault::CrossShardRecreate => hit.details = self.cross_shard_recreate(leader).await?,
            Fault::MemberLeaseDelete => {
                let member = member_lease(e2e::shards::GROUP, &hit.leader);
                foreign_lease::delete(&self.leases(), &member).await?;
                hit.details["member_lease"] = member.into();
            }
            Fault::LeaseNameFormerHolder => {
                hit.details["holder_named_over"] =
                    self.name_former_holder(leader, lease).await?.into();
            }
            Fault::LeaseRelabelKill => {
                hit.details["relabels"] = self.relabel_kill(leader, lease).await?.into();
            }
            Fault::MixedTimings => {
                let (at, long) = self.mixed_timings(leader).await?;
                hit.at = at;
                hit.details["leader_timings"] = json!(LONG_TIMINGS.args());
                hit.leader = long;
            }
            Fault::ApiserverOverload => self.overload(leader, &mut hit).await,
            Fault::LeaderKillReadsFailing => {
                let (killed, failed) = self.kill_with_reads_failing(leader).await?;
                hit.at = killed;
                hit.details["follower_lease_reads_failed"] = failed.into();
            }
            Fault::EtcdStall => {
                self.etcd.stall();
                tokio::time::sleep(ETCD_STALL).await;
                self.etcd.resume();
                hit.details["stall_seconds"] = ETCD_STALL.as_secs_f64().into();
            }
            Fault::PodDelete
            | Fault::ContainerKill
            | Fault::PodFreeze
            | Fault::PodNetworkCut
            | Fault::Rollout
            | Fault::SlowNetworkContainerKill
            | Fault::UpgradeMixedVersions
            | Fault::NodePartition
            | Fault::NodePowerOff
            | Fault::NodeKubeletStopKill
            | Fault::NodeDrain => {
                bail!("{} needs a cluster: --in-cluster", fault.kind())
            }
        }
        Ok(hit)
    }

    /// The `lease_relabel_kill` fault: the leader SIGKILLed while a foreign tool relabels
    /// the Lease `name`; returns how many relabellings succeeded.
    async fn relabel_kill(&mut self, leader: usize, name: &str) -> Result<usize> {
        let leases = self.leases();
        let name = name.to_string();
        let relabel = tokio::spawn(async move {
            foreign_lease::relabel(&leases, &name, RELABEL_EVERY, RELABEL_COUNT, RELABEL_FOR).await
        });
        self.restart_slot(leader).await?;
        Ok(relabel.await?)
    }

    /// The `lease_name_former_holder` fault: the leader frozen until another replica holds
    /// the Lease `name`, woken (a live former holder), then named holder of the current
    /// term by a foreign merge patch that keeps every other field. Before issue 30's fix it
    /// renewed that record as its own at once, while the real holder's fence was open.
    /// Returns the holder named over.
    async fn name_former_holder(&mut self, leader: usize, name: &str) -> Result<String> {
        let former = self.slots[leader].operator.config.identity.clone();
        let leases = self.leases();
        self.slots[leader].operator.process.signal(libc::SIGSTOP);
        let taken = e2e::wait::poll(
            "another replica to hold the Lease",
            Duration::from_secs(30),
            || async {
                let holder = leases
                    .get(name)
                    .await?
                    .spec
                    .and_then(|s| s.holder_identity)
                    .unwrap_or_default();
                Ok((!holder.is_empty() && holder != former).then_some(holder))
            },
        )
        .await;
        self.slots[leader].operator.process.signal(libc::SIGCONT);
        let current = taken?;
        // Woken, it learns that it lost; the workload goes on under the new holder.
        tokio::time::sleep(Duration::from_secs(1)).await;
        foreign_lease::set_holder(&leases, name, &former).await?;
        Ok(current)
    }

    /// The `cross_shard_recreate` fault (scale-out, issue 30's hole 1): a new MyResource,
    /// created until it falls in a shard the struck replica leads, converged; then changed
    /// (its key queued in that shard) and the replica frozen at once; the object deleted and
    /// created again by name until its new uid falls in a shard another replica leads and
    /// the struck one caches as a standby; the replica woken within its renew deadline.
    /// Before the fix its old shard's worker reconciled the new object, read from the
    /// standby copy, through the old shard's fence while the new shard's leader did too.
    /// Returns the object, its two shards and how many creations each took.
    async fn cross_shard_recreate(&mut self, leader: usize) -> Result<Value> {
        let shards = self
            .shards
            .context("cross_shard_recreate needs --shard-leases")?;
        let key = ShardKey::new(shards);
        let me = self.slots[leader].operator.config.identity.clone();
        let group = e2e::shards::snapshot(&self.client, NAMESPACE, shards).await?;
        let led = group.held_by(&me);
        let standby: BTreeSet<usize> = group.warm.get(&me).cloned().unwrap_or_default();
        let elsewhere: BTreeSet<usize> = (0..shards)
            .filter(|s| !led.contains(s) && standby.contains(s) && !group.holders[*s].is_empty())
            .collect();
        if led.is_empty() || elsewhere.is_empty() {
            bail!("{me} leads {led:?} and stands by for {standby:?}: nothing to move across");
        }
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), NAMESPACE);
        let name = format!("cross-shard-{}", Timestamp::now().as_millisecond());
        let recreate = |message: &'static str, within: BTreeSet<usize>| {
            let (mrs, name) = (mrs.clone(), name.clone());
            async move {
                for tries in 1..=CROSS_SHARD_TRIES {
                    let _ = mrs.delete(&name, &DeleteParams::default()).await;
                    let spec = MyResourceSpec {
                        message: message.into(),
                        some_value: 0,
                    };
                    let mr = mrs
                        .create(&PostParams::default(), &MyResource::new(&name, spec))
                        .await?;
                    let shard = key.shard_of_uid(&mr.uid().unwrap_or_default());
                    if within.contains(&shard) {
                        return Ok((shard, tries));
                    }
                }
                bail!("{name}: no uid in shards {within:?} after {CROSS_SHARD_TRIES} creations")
            }
        };
        let (from, first_tries) = recreate("before the move", led).await?;
        let cms: Api<ConfigMap> = Api::namespaced(self.client.clone(), NAMESPACE);
        e2e::wait::poll("its ConfigMap", Duration::from_secs(20), || async {
            Ok(cms.get_opt(&name).await?.map(drop))
        })
        .await?;
        let change = json!({"spec": {"someValue": 1}});
        mrs.patch(&name, &PatchParams::default(), &Patch::Merge(&change))
            .await?;
        let process = &self.slots[leader].operator.process;
        process.signal(libc::SIGSTOP);
        let frozen = std::time::Instant::now();
        let moved = recreate("after the move", elsewhere).await;
        // Woken well within its renew deadline: it still leads its shards.
        tokio::time::sleep_until((frozen + CROSS_SHARD_FREEZE).into()).await;
        self.slots[leader].operator.process.signal(libc::SIGCONT);
        let (to, tries) = moved?;
        Ok(json!({
            "object": name,
            "from_shard": from,
            "to_shard": to,
            "to_leader": group.holders[to],
            "creations": first_tries + tries,
            "frozen_seconds": frozen.elapsed().as_secs_f64(),
        }))
    }

    /// The `leader_sigkill_reads_failing` fault: half the replicas' reads of the Lease fail
    /// (503), and their connections are reset every [`RESET_EVERY`], from shortly
    /// before the leader is SIGKILLed until [`READS_FAILING_FOR`] after. Before issue 30's fix each failed read restarted a
    /// follower's expiry clock, and the failover could take minutes. Returns the moment of
    /// the kill and how many reads failed.
    async fn kill_with_reads_failing(&mut self, leader: usize) -> Result<(Timestamp, u64)> {
        // Every slot: the leader's is restarted at once, and its new replica must read
        // through the same failures as the others.
        let slots = 0..self.slots.len();
        let failed = |chaos: &Self| -> u64 {
            slots
                .clone()
                .map(|s| chaos.slots[s].api.stats().lease_reads_failed)
                .sum()
        };
        let before = failed(self);
        for s in slots.clone() {
            let seed = self.rng.below(1 << 30) as u64;
            self.slots[s].api.overload(Overload {
                reject_percent: 0,
                retry_after_seconds: 0,
                delay_percent: 0,
                delay: Duration::ZERO,
                hold_lease_writes: false,
                lease_read_fail_percent: 50,
                seed,
            });
        }
        tokio::time::sleep(TEST_TIMINGS.retry_period * 2).await;
        let killed = Timestamp::now();
        self.restart_slot(leader).await?;
        // Their connections reset too, so they read rather than follow a watch that
        // outlives the failures.
        let until = std::time::Instant::now() + READS_FAILING_FOR;
        while std::time::Instant::now() < until {
            for s in slots.clone() {
                self.slots[s].proxy.block();
                self.slots[s].proxy.heal();
            }
            tokio::time::sleep(RESET_EVERY).await;
        }
        for s in slots.clone() {
            self.slots[s].api.relieve();
        }
        Ok((killed, failed(self) - before))
    }

    /// The `apiserver_overload` fault: the leader's API server proxy overloaded for
    /// [`OVERLOAD_FOR`], then relieved.
    async fn overload(&mut self, leader: usize, hit: &mut Hit) {
        let api = &self.slots[leader].api;
        let overload = Overload {
            reject_percent: 30,
            retry_after_seconds: 5,
            delay_percent: 30,
            // Past the renew deadline and the lease duration: a held write can
            // reach the server after another replica acquired.
            delay: TEST_TIMINGS.lease_duration + TEST_TIMINGS.retry_period,
            // Its renewals are held too, so leadership surely moves meanwhile.
            hold_lease_writes: true,
            lease_read_fail_percent: 0,
            seed: self.rng.below(1 << 30) as u64,
        };
        hit.overloaded = Some((leader, api.stats()));
        hit.details["overload"] = json!({
            "seconds": OVERLOAD_FOR.as_secs_f64(),
            "reject_percent": overload.reject_percent,
            "retry_after_seconds": overload.retry_after_seconds,
            "delay_percent": overload.delay_percent,
            "delay_seconds": overload.delay.as_secs_f64(),
            "hold_lease_writes": overload.hold_lease_writes,
        });
        api.overload(overload);
        tokio::time::sleep(OVERLOAD_FOR).await;
        self.slots[leader].api.relieve();
    }

    /// What the fault did, for the report; for an overload, with what the proxy did to the
    /// leader's writes since it began.
    pub(super) fn details(&self, hit: Hit) -> Value {
        let mut details = hit.details;
        if let Some((slot, before)) = hit.overloaded {
            let after = self.slots[slot].api.stats();
            details["writes_rejected_429"] = (after.rejected - before.rejected).into();
            details["writes_delivered_late"] =
                (after.delivered_late - before.delivered_late).into();
            details["writes_timed_out_while_held"] = (after.timed_out - before.timed_out).into();
        }
        details
    }

    /// The `mixed_timings` fault, a rolling upgrade that shortens the timings: the leader is
    /// replaced by a replica running [`LONG_TIMINGS`] (the followers frozen meanwhile, so
    /// that it and not they takes the released Lease), which is frozen right after one of
    /// its renewals for [`MIXED_FREEZE`] under workload and then resumed. A follower that
    /// judged expiry by its own lease duration instead of the record's acquires meanwhile,
    /// and the resumed leader's writes overlap with it. The standard timings are restored
    /// by a graceful restart. Returns when the freeze began and the long-timed replica.
    async fn mixed_timings(&mut self, leader: usize) -> Result<(Timestamp, String)> {
        let long = self.long_timed_takeover(leader).await?;
        // The followers observe the long-timed record, then the leader is frozen right
        // after a renewal, so its fence stays open for most of its renew deadline.
        tokio::time::sleep(Duration::from_secs(2)).await;
        self.wait_for_renewal().await?;
        self.slots[leader].operator.process.signal(libc::SIGSTOP);
        let at = Timestamp::now();
        tokio::time::sleep(MIXED_FREEZE).await;
        self.slots[leader].operator.process.signal(libc::SIGCONT);
        // Its fence is still open: whatever it writes now must not overlap.
        tokio::time::sleep(Duration::from_secs(2)).await;
        self.slots[leader].operator.stop();
        self.restart_slot_with(leader, TEST_TIMINGS).await?;
        Ok((at, long))
    }

    /// Replaces the leader with a replica running [`LONG_TIMINGS`], the followers frozen
    /// until it holds the Lease; returns its identity.
    async fn long_timed_takeover(&mut self, leader: usize) -> Result<String> {
        let followers: Vec<usize> = (0..self.slots.len()).filter(|s| *s != leader).collect();
        for &f in &followers {
            self.slots[f].operator.process.signal(libc::SIGSTOP);
        }
        self.slots[leader].operator.stop();
        let takeover = async {
            self.restart_slot_with(leader, LONG_TIMINGS).await?;
            let long = self.slots[leader].operator.config.identity.clone();
            e2e::wait::poll(
                "the long-timed replica holding the Lease",
                Duration::from_secs(30),
                || async { Ok((self.holder().await? == long).then_some(())) },
            )
            .await?;
            anyhow::Ok(long)
        }
        .await;
        for &f in &followers {
            self.slots[f].operator.process.signal(libc::SIGCONT);
        }
        takeover
    }

    /// Waits for the leader's next renewal of the Lease.
    async fn wait_for_renewal(&self) -> Result<()> {
        let renewed = |lease: Option<Lease>| lease.and_then(|l| l.spec?.renew_time);
        let before = renewed(self.leases().get_opt(lease::NAME).await?);
        e2e::wait::poll(
            "a renewal by the long-timed leader",
            Duration::from_secs(10),
            || async {
                let now = renewed(self.leases().get_opt(lease::NAME).await?);
                Ok((now != before).then_some(()))
            },
        )
        .await
    }

    /// Waits for a live leader and for the probes of `struck` (every probe when empty) to
    /// handle a change made after `fault`; returns the failover time in seconds and the
    /// leader's slot. In scale-out mode the failover lasts until the probe of every shard
    /// the struck replica held has handled such a change, by whichever replica: the other
    /// shards never stopped.
    pub(super) async fn recover(
        &self,
        probes: &Probes,
        fault: Timestamp,
        struck: &BTreeSet<usize>,
    ) -> Result<(Option<f64>, usize)> {
        let leader = self.leader_slot(Duration::from_secs(60)).await?;
        let failover = probes
            .failover(fault, struck, Duration::from_secs(60))
            .await;
        Ok((failover, leader))
    }
}
