//! The invariants a chaos run checks: exactly one replica reporting leadership after each
//! round, no lost update, no write by a replica after another acquired the Lease (from the
//! audit log), no panic and no unexpected exit; and the time to a new leader per round.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::Result;
use e2e::audit::{self, Acquisition, AuditEvent};
use e2e::lease;
use e2e::operator::http_get;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client, ResourceExt};
use myresource_operator::resource::MyResource;
use myresource_operator::shardkey::ShardKey;
use serde_json::Value;

use super::{Chaos, NAMESPACE};

/// What the rounds counted as they went, and the panics found at the end.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) rounds_without_single_leader: usize,
    pub(super) lost_updates: usize,
    pub(super) unexpected_exits: usize,
    pub(super) panics: usize,
}

/// Whether a finished run's report shows a failed check.
pub(super) fn failed(report: &Value) -> bool {
    report["overlapping_leadership_writes"] != 0
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

/// Objects whose status or ConfigMap has not caught up with their spec within `limit`.
pub(super) async fn lost_updates(client: &Client, limit: Duration) -> Result<usize> {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), NAMESPACE);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
    let deadline = Instant::now() + limit;
    loop {
        let configmaps = cms.list(&Default::default()).await?.items;
        let behind = mrs
            .list(&Default::default())
            .await?
            .items
            .iter()
            .filter(|mr| mr.metadata.deletion_timestamp.is_none())
            .filter(|mr| {
                let name = mr.metadata.name.as_deref();
                let data = configmaps
                    .iter()
                    .find(|c| c.metadata.name.as_deref() == name)
                    .and_then(|c| c.data.clone())
                    .unwrap_or_default();
                mr.status.as_ref().and_then(|s| s.observed_generation) != mr.metadata.generation
                    || data.get("message") != Some(&mr.spec.message)
                    || data.get("someValue") != Some(&mr.spec.some_value.to_string())
            })
            .count();
        if behind == 0 || Instant::now() > deadline {
            return Ok(behind);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// From the audit log: the Lease's terms, and the writes a replica made after another had
/// acquired it, described. Sets each round's `new_leader_seconds` and the overlapping
/// writes received during it (`overlapping_writes`).
pub(super) fn audit_checks(
    events: &[AuditEvent],
    faults: &mut [Value],
) -> (Vec<Acquisition>, Vec<String>) {
    let terms = audit::acquisitions(events, NAMESPACE, lease::NAME);
    let overlapping = audit::overlapping_writes(events, NAMESPACE, &terms);
    attribute(faults, terms, &overlapping)
}

/// Each MyResource name of the run and the shards of every uid it had: those the workload
/// created, and those there now (a create whose answer was lost in a fault).
pub(super) async fn shards_of(
    client: &Client,
    shards: usize,
    mut uids: super::workload::Uids,
) -> Result<BTreeMap<String, BTreeSet<usize>>> {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), NAMESPACE);
    for mr in mrs.list(&Default::default()).await? {
        let name = mr.name_any();
        uids.entry(name)
            .or_default()
            .insert(mr.uid().unwrap_or_default());
    }
    let key = ShardKey::new(shards);
    Ok(uids
        .into_iter()
        .map(|(name, uids)| (name, uids.iter().map(|u| key.shard_of_uid(u)).collect()))
        .collect())
}

/// [`audit_checks`] in scale-out mode: every shard Lease's terms (in time order), and the
/// writes a replica made to an object while it held none of the object's shards.
pub(super) fn shard_audit_checks(
    events: &[AuditEvent],
    faults: &mut [Value],
    shards: usize,
    shards_of: &BTreeMap<String, BTreeSet<usize>>,
) -> (Vec<Acquisition>, Vec<String>) {
    let per_shard = e2e::shards::terms(events, NAMESPACE, shards);
    let overlapping = e2e::shards::overlapping_writes(events, NAMESPACE, &per_shard, shards_of);
    let mut terms: Vec<Acquisition> = per_shard.into_iter().flatten().collect();
    terms.sort_by_key(|t| t.at);
    attribute(faults, terms, &overlapping)
}

/// Sets each round's `new_leader_seconds` from `terms` and attributes the overlapping
/// writes to the rounds they were received in; returns the terms and the writes described.
fn attribute(
    faults: &mut [Value],
    terms: Vec<Acquisition>,
    overlapping: &[&AuditEvent],
) -> (Vec<Acquisition>, Vec<String>) {
    for fault in faults.iter_mut() {
        fault["new_leader_seconds"] = new_leader_seconds(fault, &terms).into();
    }
    let overlaps: Vec<String> = overlapping
        .iter()
        .map(|e| {
            format!(
                "{} {} {:?} at {}",
                e.user_agent, e.verb, e.object_ref, e.request_received_timestamp
            )
        })
        .collect();
    // Attribute every overlapping write to the round it was received in.
    for fault in faults.iter_mut() {
        let (Some(from), Some(until)) = (timestamp(&fault["started"]), timestamp(&fault["until"]))
        else {
            continue;
        };
        fault["overlapping_writes"] = overlapping
            .iter()
            .filter(|e| (from..until).contains(&e.request_received_timestamp))
            .count()
            .into();
    }
    (terms, overlaps)
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
