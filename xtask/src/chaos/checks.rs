//! The invariants a chaos run checks: exactly one replica reporting leadership after each
//! round, no lost update, no write by a replica after another acquired the Lease (from the
//! audit log), no panic and no unexpected exit; and the time to a new leader per round.

use std::time::{Duration, Instant};

use anyhow::Result;
use e2e::audit::{self, Acquisition, AuditEvent};
use e2e::lease;
use e2e::operator::http_get;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client, ResourceExt};
use myresource_operator::resource::{MyResource, POD_LABEL, PodCounts};
use serde_json::Value;

use super::schedule::{Fault, goal_of};
use super::{Chaos, NAMESPACE};

/// What the rounds counted as they went, and the panics found at the end.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) rounds_without_single_leader: usize,
    pub(super) lost_updates: usize,
    pub(super) unexpected_exits: usize,
    pub(super) panics: usize,
}

/// The fewest successful workload operations a round must see: fewer, and the round
/// struck an idle system (a round lets the workload run for 2 s at 10 per second before its
/// fault, and on until the recovery).
const MIN_OPERATIONS_PER_ROUND: u64 = 5;

/// The fewest writes the fencing check must examine per round, and terms per run: fewer,
/// and the check looked at too little to prove anything.
const MIN_WRITES_PER_ROUND: u64 = 5;
const MIN_TERMS: u64 = 2;

/// Whether a finished run's report shows a failed check.
pub(super) fn failed(report: &Value) -> bool {
    let rounds = report["rounds"].as_u64().unwrap_or(0);
    report["overlapping_leadership_writes"] != 0
        || report["writes_examined"].as_u64().unwrap_or(0) < MIN_WRITES_PER_ROUND * rounds
        || report["terms_examined"].as_u64().unwrap_or(0) < MIN_TERMS
        || report["rounds_missing_goal"] != 0
        || report["lost_updates"] != 0
        || report["panics"] != 0
        || report["unexpected_exits"] != 0
        || report["rounds_without_single_leader"] != 0
}

impl Chaos {
    /// Whether exactly one replica reports leadership (in scale-out mode: of each shard)
    /// within 10 s: a replica that was frozen or cut off may report leadership until it
    /// notices.
    pub(super) async fn single_leader(&self) -> bool {
        let single = e2e::wait::poll(
            "exactly one replica reporting leadership",
            Duration::from_secs(10),
            || async {
                let leaders = self.reporting_leaders().await;
                let want = self.shards.unwrap_or(1);
                let mut per_lease = std::collections::BTreeMap::new();
                for (lease, _) in &leaders {
                    *per_lease.entry(lease.clone()).or_insert(0) += 1;
                }
                let one_each = per_lease.len() == want && per_lease.values().all(|n| *n == 1);
                Ok(one_each.then_some(()))
            },
        )
        .await
        .is_ok();
        if !single {
            eprintln!(
                "  replicas reporting leadership: {:?}",
                self.reporting_leaders().await
            );
        }
        single
    }

    /// The (Lease, replica) pairs reporting leader_election_master_status 1.
    async fn reporting_leaders(&self) -> Vec<(String, String)> {
        let mut leaders = Vec::new();
        for slot in &self.slots {
            match http_get(slot.operator.metrics, "/metrics").await {
                Ok((200, body)) => {
                    for line in body.lines() {
                        if let Some(rest) = line.strip_prefix("leader_election_master_status{")
                            && line.ends_with(" 1")
                        {
                            let lease = rest.split('"').nth(1).unwrap_or_default().to_string();
                            leaders.push((lease, slot.operator.config.identity.clone()));
                        }
                    }
                }
                other => eprintln!(
                    "  scraping {} failed: {other:?}",
                    slot.operator.config.identity
                ),
            }
        }
        leaders
    }

    /// Log files of replicas that panicked.
    pub(super) fn panics(&self) -> usize {
        self.logs
            .iter()
            .filter(|log| std::fs::read_to_string(log).is_ok_and(|t| t.contains("panicked at")))
            .count()
    }

    /// Replicas no longer running at the end of the run.
    pub(super) fn exited(&mut self) -> usize {
        let mut exited = 0;
        for slot in &mut self.slots {
            if !slot.operator.process.is_running() {
                exited += 1;
            }
        }
        exited
    }
}

/// What the end of a round found: the objects not converged within the limit, and how
/// long convergence took.
pub(super) struct Convergence {
    pub(super) behind: usize,
    pub(super) seconds: f64,
}

/// Whether `mr` is as its spec and the world say: its status describes its generation, is
/// Ready and counts its labelled Pods (all, and Ready ones) as `pods` holds them; its
/// ConfigMap carries the spec and is controlled by this MyResource (its uid).
fn converged(mr: &MyResource, configmaps: &[ConfigMap], pods: &[Pod]) -> bool {
    let name = mr.metadata.name.as_deref().unwrap_or_default();
    let Some(status) = mr.status.as_ref() else {
        return false;
    };
    let configmap = configmaps
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some(name));
    let data = configmap.and_then(|c| c.data.clone()).unwrap_or_default();
    let owner = configmap
        .and_then(|c| c.metadata.owner_references.as_ref())
        .and_then(|o| o.iter().find(|o| o.controller == Some(true)))
        .map(|o| o.uid.as_str());
    let labelled: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.labels().get(POD_LABEL).map(String::as_str) == Some(name))
        .collect();
    let ready = labelled
        .iter()
        .filter(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .count();
    let counts = PodCounts {
        total: labelled.len() as i32,
        ready: ready as i32,
    };
    status.observed_generation == mr.metadata.generation
        && status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
        && status.pods == Some(counts)
        && data.get("message") == Some(&mr.spec.message)
        && data.get("someValue") == Some(&mr.spec.some_value.to_string())
        && owner.is_some()
        && owner == mr.metadata.uid.as_deref()
}

/// Waits (up to `limit`) until every object has converged (see [`converged`]); the probes
/// change all the time and are left out (their failover measure shows they are handled).
pub(super) async fn lost_updates(client: &Client, limit: Duration) -> Result<Convergence> {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), NAMESPACE);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let started = Instant::now();
    loop {
        let configmaps = cms.list(&Default::default()).await?.items;
        let pods = pods.list(&Default::default()).await?.items;
        let pods: Vec<Pod> = pods
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        let behind = mrs
            .list(&Default::default())
            .await?
            .items
            .iter()
            .filter(|mr| mr.metadata.deletion_timestamp.is_none())
            .filter(|mr| !mr.name_any().starts_with("probe-"))
            .filter(|mr| !converged(mr, &configmaps, &pods))
            .count();
        if behind == 0 || started.elapsed() > limit {
            return Ok(Convergence {
                behind,
                seconds: started.elapsed().as_secs_f64(),
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The fencing check's result for a run: every term of the Lease (or of all shard Leases),
/// in time order, and what the check found and examined.
pub(super) struct Fencing {
    pub(super) terms: Vec<Acquisition>,
    pub(super) findings: Vec<String>,
    pub(super) writes_examined: usize,
    pub(super) terms_examined: usize,
}

/// The fencing check on the run's audit log ([`audit::fencing`]): every write the replicas
/// made, judged by when it took effect against the terms of the Lease that fences it (in
/// scale-out mode, `shards` shard Leases, by each write's owner uid). Sets each round's
/// `new_leader_seconds` and the late writes that may first have taken effect during it
/// (`overlapping_writes`).
pub(super) fn fencing(
    events: &[AuditEvent],
    faults: &mut [Value],
    shards: Option<usize>,
) -> Fencing {
    let fences = match shards {
        None => audit::Fences::lease(NAMESPACE, lease::NAME),
        Some(shards) => e2e::shards::fences(NAMESPACE, shards),
    };
    let verdict = audit::check(events, &fences);
    let mut terms: Vec<Acquisition> = verdict.terms.iter().flatten().cloned().collect();
    terms.sort_by_key(|t| t.at);
    for fault in faults.iter_mut() {
        fault["new_leader_seconds"] = new_leader_seconds(fault, &terms).into();
        let (Some(from), Some(until)) = (timestamp(&fault["started"]), timestamp(&fault["until"]))
        else {
            continue;
        };
        fault["overlapping_writes"] = verdict
            .late
            .iter()
            .filter(|l| (from..until).contains(&l.from()))
            .count()
            .into();
    }
    Fencing {
        terms,
        findings: verdict.findings(),
        writes_examined: verdict.writes_examined,
        terms_examined: verdict.terms_examined(),
    }
}

/// Sets each round's `goal_met`: its failover came (a change made after the fault was
/// handled), within its fault's goal for a new leader where there is one, the workload
/// ran ([`MIN_OPERATIONS_PER_ROUND`] successful operations at least), and a node fault
/// held what its details must show ([`super::nodes::goal_held`]).
pub(super) fn judge_goals(faults: &mut [Value]) {
    for fault in faults.iter_mut() {
        let kind = fault["kind"].as_str().unwrap_or_default();
        let goal = goal_of(kind);
        // After a container SIGKILL the new term may be the restarted container's, in the
        // same Pod (same identity: no new leader by name); the change handled then counts.
        let restarted_in_place = kind == Fault::ContainerKill.kind();
        let new_leader = fault["new_leader_seconds"].as_f64().or_else(|| {
            restarted_in_place
                .then(|| fault["failover_seconds"].as_f64())
                .flatten()
        });
        let in_time = match goal {
            None => true,
            Some(goal) => new_leader.is_some_and(|s| s <= goal.as_secs_f64()),
        };
        let worked =
            fault["operations_succeeded"].as_u64().unwrap_or(0) >= MIN_OPERATIONS_PER_ROUND;
        let held = super::nodes::goal_held(kind, &fault["details"]);
        fault["goal_met"] =
            (fault["failover_seconds"].is_number() && in_time && worked && held).into();
    }
}

/// The first acquisition by another replica than the struck leader, within the round: the
/// time to a new leader in seconds (none when leadership stayed).
fn new_leader_seconds(fault: &Value, terms: &[Acquisition]) -> Option<f64> {
    let at = timestamp(&fault["at"])?;
    let until = timestamp(&fault["until"])?;
    let leader = fault["leader_before"].as_str()?;
    terms
        .iter()
        .find(|t| t.at > at && t.at <= until && !t.holder.is_empty() && t.holder != leader)
        .map(|t| t.at.duration_since(at).as_secs_f64())
}

fn timestamp(value: &Value) -> Option<Timestamp> {
    value.as_str()?.parse().ok()
}
