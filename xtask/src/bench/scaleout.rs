//! `cargo xtask bench --shard-leases S`: scale-out mode against the single leader, on one
//! control plane that serves `shardSelector`, with the default Lease timings (15/10/2 s).
//!
//! - the API server's write ceiling (a minimal client making a reconcile's writes);
//! - the single-Lease operator (one replica, which caches everything) and then N = 1…4
//!   scale-out replicas over the same N objects: each time every object's spec is changed
//!   and the phase lasts until every object is reconciled; measured: resident memory per
//!   replica at the end, reconciles per replica (the work split), the operator's writes/s
//!   against the ceiling;
//! - with three replicas, `rounds` times: a replica SIGKILLed (then a change in each of its
//!   shards: the time until all are reconciled again, and the new holders' LISTs of those
//!   shards before taking them, from the audit log), a replica joining and one leaving
//!   gracefully (the time until the shards are divided again and every cache is warm);
//! - the shard key: how evenly the objects' uids spread over the shards, against
//!   namespace names.
//!
//! Writes `target/bench/scaleout/report.{json,md}`.

use std::time::{Duration, Instant};

use anyhow::Result;
use e2e::audit;
use e2e::lease::{DEFAULT_TIMINGS, wait_for_holder};
use e2e::operator::Operator;
use e2e::shards::{self, Snapshot};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};
use kube_leasehold::scaleout::shard_key::{ShardKey, fnv1a64};
use myresource_operator::resource::MyResource;
use serde_json::json;

use super::Bench;
use super::ceiling::Ceiling;
use super::objects::{create_objects, metric_sum};

const NAMESPACE: &str = "bench-scaleout";
const SUCCESSES: &str =
    "controller_runtime_reconcile_total{controller=\"myresource\",result=\"success\"}";
const LIMIT: Duration = Duration::from_secs(1800);

/// The audit log's Lease events (what the terms are read from) and LISTs (without bodies):
/// the objects' events of 100,000 MyResources would not fit in memory.
fn leases_and_lists(path: &std::path::Path) -> Result<audit::Log> {
    audit::read_filtered(path, |e| {
        if e.is_lease() {
            Some(e)
        } else {
            (e.verb == "list").then(|| e.without_bodies())
        }
    })
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1_048_576.0
}

fn median(values: &[f64]) -> f64 {
    e2e::stats::percentile(values, 50.0)
}

fn in_ms(gaps: Vec<Duration>) -> Vec<f64> {
    gaps.iter().map(|d| d.as_secs_f64() * 1000.0).collect()
}

/// "median X ms (max Y ms, n = K)".
fn milliseconds(values: &[f64]) -> String {
    if values.is_empty() {
        return "none seen in the audit log".into();
    }
    format!(
        "median {:.0} ms (max {:.0} ms, n = {})",
        median(values),
        values.iter().cloned().fold(0.0, f64::max),
        values.len()
    )
}

/// One change phase: wall time, reconciles per replica, resident memory per replica.
struct Phase {
    seconds: f64,
    reconciles: Vec<f64>,
    rss: Vec<u64>,
}

impl Bench {
    pub(super) async fn scale_out(
        &mut self,
        n: usize,
        shards: usize,
        replica_counts: &[usize],
        rounds: usize,
    ) -> Result<()> {
        anyhow::ensure!(
            replica_counts.iter().all(|&r| (1..=8).contains(&r)),
            "--scale-replicas takes counts from 1 to 8, not {replica_counts:?}"
        );
        let key = ShardKey::new(shards);
        eprintln!(
            "==> setup: {n} MyResources, and the write ceiling on {} more",
            n / 2
        );
        let ns = self.namespace(NAMESPACE).await?;
        create_objects(&self.client, &ns, n, false).await?;
        let ceiling_ns = self.namespace("bench-scaleout-ceiling").await?;
        create_objects(&self.client, &ceiling_ns, n / 2, false).await?;
        let (first, second) = self.ceiling_halves(&ceiling_ns, n / 2).await?;
        let before = self.ceiling(first, 8, "before").await?;
        let after = self.ceiling(second, 8, "after").await?;
        let ceiling = Ceiling::of(before, after);
        self.record_ceiling(n / 2, 8, &ceiling);

        // The single leader: one replica, one Lease, everything cached.
        eprintln!("==> the single-Lease operator: cold start, then a change to every object");
        let mut single = self.replica(&ns, "single", &DEFAULT_TIMINGS)?;
        single.wait_ready().await?;
        wait_for_holder(&self.client, &ns, None, LIMIT).await?;
        self.change_phase(&ns, n, &[&single], "cold").await?;
        let baseline = self.change_phase(&ns, n, &[&single], "single").await?;
        let single_gaps = self.single_handovers(&ns, single, rounds).await?;
        let single_rss = baseline.rss[0];
        self.report_phase("single Lease", &baseline, single_rss, n, &ceiling);

        self.report.record(
            "single_lease_handover",
            json!({"gaps_ms": single_gaps}),
            format!(
                "the single Lease's SIGTERM handover, {rounds} times (a warm replica waiting): release → the next holder's acquisition {}",
                milliseconds(&single_gaps)
            ),
        );

        let mut rows = Vec::new();
        for &replicas in replica_counts {
            eprintln!("==> scale-out: {replicas} replicas, {shards} shards");
            let mut ops = Vec::new();
            for i in 0..replicas {
                ops.push(self.scaled(&ns, &format!("so{replicas}-{i}"), shards)?);
            }
            for op in &mut ops {
                op.wait_ready().await?;
            }
            let live: Vec<&Operator> = ops.iter().collect();
            self.steady(&ns, shards, &live).await?;
            let phase = self
                .change_phase(&ns, n, &live, &format!("n{replicas}"))
                .await?;
            self.report_phase(
                &format!("{replicas} replicas"),
                &phase,
                single_rss,
                n,
                &ceiling,
            );
            rows.push(json!({
                "replicas": replicas,
                "seconds": phase.seconds,
                "reconciles": phase.reconciles,
                "rss_bytes": phase.rss,
            }));
            if replicas == 3 {
                self.lifecycle(&ns, key, &mut ops, rounds).await?;
            }
            for op in &mut ops {
                op.stop();
            }
        }
        self.report.insert("scale_out", json!(rows));
        self.shard_key_spread(&ns, key).await
    }

    /// The single Lease's SIGTERM handover, `rounds` times: a second replica warms up, then
    /// the leader is stopped. Returns, from the audit log, the milliseconds from each
    /// release to the successor's acquisition.
    async fn single_handovers(
        &self,
        ns: &str,
        mut leader: Operator,
        rounds: usize,
    ) -> Result<Vec<f64>> {
        eprintln!("==> the single Lease's SIGTERM handover, {rounds} times");
        let from = Timestamp::now();
        for round in 0..rounds {
            let mut next = self.replica(ns, &format!("single-{round}"), &DEFAULT_TIMINGS)?;
            next.wait_ready().await?;
            leader.stop();
            wait_for_holder(&self.client, ns, Some(&leader.config.identity), LIMIT).await?;
            leader = next;
        }
        leader.stop();
        let events = leases_and_lists(&self.cluster.audit_log)?;
        let terms = audit::acquisitions(&events, ns, e2e::lease::NAME);
        Ok(in_ms(audit::release_gaps(&terms, from, Timestamp::now())))
    }

    fn scaled(&self, ns: &str, identity: &str, shards: usize) -> Result<Operator> {
        let shards = format!("--shard-leases={shards}");
        Operator::start(
            self.replica_config(ns, identity, &DEFAULT_TIMINGS)
                .with_args(&[&shards]),
        )
    }

    async fn steady(&self, ns: &str, shards: usize, live: &[&Operator]) -> Result<Snapshot> {
        let ids: Vec<&str> = live.iter().map(|o| o.config.identity.as_str()).collect();
        shards::wait_steady(&self.client, ns, shards, &ids, LIMIT).await
    }

    /// Changes every object's spec and waits until `ops` have reconciled them all.
    async fn change_phase(
        &self,
        ns: &str,
        n: usize,
        ops: &[&Operator],
        tag: &str,
    ) -> Result<Phase> {
        let mut before = Vec::new();
        for op in ops {
            before.push(metric_sum(op, SUCCESSES).await?);
        }
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), ns);
        let started = Instant::now();
        futures::stream::iter(0..n)
            .map(|i| {
                let mrs = mrs.clone();
                let patch = json!({"spec": {"message": format!("{tag} {i}")}});
                async move {
                    mrs.patch(
                        &format!("o{i}"),
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await
                }
            })
            .buffer_unordered(32)
            .try_collect::<Vec<_>>()
            .await?;
        let deadline = Instant::now() + LIMIT;
        loop {
            anyhow::ensure!(Instant::now() < deadline, "the change phase did not end");
            tokio::time::sleep(Duration::from_millis(500)).await;
            let mut done = 0.0;
            for (op, before) in ops.iter().zip(&before) {
                done += metric_sum(op, SUCCESSES).await? - before;
            }
            if done < n as f64 {
                continue;
            }
            let list = mrs.list(&Default::default()).await?;
            let converged = list.items.iter().all(|m| {
                m.status
                    .as_ref()
                    .is_some_and(|s| s.observed_generation == m.metadata.generation)
            });
            if converged {
                break;
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        let mut reconciles = Vec::new();
        for (op, before) in ops.iter().zip(&before) {
            reconciles.push(metric_sum(op, SUCCESSES).await? - before);
        }
        Ok(Phase {
            seconds,
            reconciles,
            rss: ops.iter().map(|o| o.rss_bytes().unwrap_or(0)).collect(),
        })
    }

    fn report_phase(&mut self, what: &str, p: &Phase, single: u64, n: usize, c: &Ceiling) {
        let mean = p.reconciles.iter().sum::<f64>() / p.reconciles.len() as f64;
        let split: Vec<String> = p
            .reconciles
            .iter()
            .map(|r| format!("{:+.0} %", (r / mean - 1.0) * 100.0))
            .collect();
        let rss: Vec<String> = p
            .rss
            .iter()
            .map(|r| format!("{:.1} MiB ({:.2})", mib(*r), *r as f64 / single as f64))
            .collect();
        // A reconcile after a spec change writes the ConfigMap and the status, and
        // publishes an Event: three writes, as the ceiling's.
        let writes = 3.0 * n as f64 / p.seconds;
        self.report.record(
            &format!("scale_out_{}", what.replace(' ', "_")),
            json!({"seconds": p.seconds, "reconciles": p.reconciles, "rss_bytes": p.rss}),
            format!(
                "{what}: {n} changes reconciled in {:.1} s ({:.0} writes/s, {:.2} of the ceiling); reconciles per replica {:?} (split {}); resident memory per replica (ratio to the single leader) {}",
                p.seconds,
                writes,
                writes / c.writes_per_second,
                p.reconciles,
                split.join(", "),
                rss.join(", ")
            ),
        );
    }

    /// Kill, join and leave, `rounds` times, with three replicas.
    async fn lifecycle(
        &mut self,
        ns: &str,
        key: ShardKey,
        ops: &mut Vec<Operator>,
        rounds: usize,
    ) -> Result<()> {
        let shards = key.shards();
        let shard_of = shards::shard_by_name(&self.client, ns, key).await?;
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), ns);
        let (mut killed, mut joins, mut leaves) = (Vec::new(), Vec::new(), Vec::new());
        // When each join and leave began and ended: the shard handovers inside them.
        let (mut join_spans, mut leave_spans) = (Vec::new(), Vec::new());
        let mut takeovers = Vec::new();
        for round in 0..rounds {
            eprintln!("==> round {}/{rounds}: kill, join, leave", round + 1);
            let live: Vec<&Operator> = ops.iter().collect();
            let before = self.steady(ns, shards, &live).await?;
            let victim = (0..ops.len())
                .max_by_key(|i| before.held_by(&ops[*i].config.identity).len())
                .expect("replicas");
            let orphans = before.held_by(&ops[victim].config.identity);
            // One object in each of the victim's shards.
            let probes: Vec<String> = orphans
                .iter()
                .filter_map(|s| {
                    shard_of
                        .iter()
                        .find(|(_, v)| *v == s)
                        .map(|(k, _)| k.clone())
                })
                .collect();
            let at = Timestamp::now();
            let started = Instant::now();
            ops[victim].kill();
            let mut dead = ops.remove(victim);
            let message = format!("kill {round}");
            for name in &probes {
                let patch = json!({"spec": {"message": message}});
                mrs.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
            }
            e2e::wait::poll(
                "the dead replica's shards to be reconciled",
                LIMIT,
                || async {
                    for name in &probes {
                        let mr = mrs.get(name).await?;
                        let seen = mr.status.as_ref().and_then(|s| s.observed_generation);
                        if seen != mr.metadata.generation {
                            return Ok(None);
                        }
                    }
                    Ok(Some(()))
                },
            )
            .await?;
            killed.push(started.elapsed().as_secs_f64());
            let live: Vec<&Operator> = ops.iter().collect();
            let after = self.steady(ns, shards, &live).await?;
            takeovers.push((at, orphans, after));
            dead.stop();

            let mut joiner = self.scaled(ns, &format!("join-{round}"), shards)?;
            let (at, started) = (Timestamp::now(), Instant::now());
            joiner.wait_ready().await?;
            ops.push(joiner);
            let live: Vec<&Operator> = ops.iter().collect();
            self.steady(ns, shards, &live).await?;
            joins.push(started.elapsed().as_secs_f64());
            join_spans.push((at, Timestamp::now()));

            let mut leaving = ops.remove(0);
            let (at, started) = (Timestamp::now(), Instant::now());
            leaving.stop();
            let live: Vec<&Operator> = ops.iter().collect();
            self.steady(ns, shards, &live).await?;
            leaves.push(started.elapsed().as_secs_f64());
            leave_spans.push((at, Timestamp::now()));

            let mut back = self.scaled(ns, &format!("back-{round}"), shards)?;
            back.wait_ready().await?;
            ops.push(back);
        }
        // LISTs of each orphaned shard by its new holder between the kill and its term.
        let events = leases_and_lists(&self.cluster.audit_log)?;
        let terms = shards::terms(&events, ns, shards);
        let mut lists = 0;
        for (at, orphans, after) in &takeovers {
            for shard in orphans {
                let taker = &after.holders[*shard];
                let taken = terms[*shard]
                    .iter()
                    .find(|t| &t.holder == taker && t.at >= *at)
                    .map_or(Timestamp::now(), |t| t.at);
                lists += shards::shard_lists(&events, key, *shard, taker, *at, taken).len();
            }
        }
        let gaps = |spans: &[(Timestamp, Timestamp)]| {
            in_ms(
                spans
                    .iter()
                    .flat_map(|(from, until)| {
                        terms
                            .iter()
                            .flat_map(|t| audit::release_gaps(t, *from, *until))
                    })
                    .collect(),
            )
        };
        let (join_gaps, leave_gaps) = (gaps(&join_spans), gaps(&leave_spans));
        let s = |v: &[f64]| {
            format!(
                "median {:.1} s (min {:.1}, max {:.1})",
                median(v),
                v.iter().cloned().fold(f64::INFINITY, f64::min),
                v.iter().cloned().fold(0.0, f64::max)
            )
        };
        self.report.record(
            "scale_out_lifecycle",
            json!({
                "killed_seconds": killed, "join_seconds": joins, "leave_seconds": leaves,
                "takeover_lists": lists,
                "join_handover_gaps_ms": join_gaps, "leave_handover_gaps_ms": leave_gaps,
            }),
            format!(
                "three replicas, {rounds} rounds (lease 15 s, retry 2 s): a SIGKILLed replica's shards reconciled again after {}; LISTs of a taken shard by its new holder before its term: {lists}; a join rebalanced (shards divided, every cache warm) after {}; a graceful leave after {}; each shard's handover, release → the next holder's acquisition: at a join {}, at a leave {}",
                s(&killed),
                s(&joins),
                s(&leaves),
                milliseconds(&join_gaps),
                milliseconds(&leave_gaps)
            ),
        );
        Ok(())
    }

    /// How evenly the objects' uids spread over the shards, against namespace names.
    async fn shard_key_spread(&mut self, ns: &str, key: ShardKey) -> Result<()> {
        let by_uid = shards::shard_by_name(&self.client, ns, key).await?;
        let mut uid = vec![0usize; key.shards()];
        for shard in by_uid.values() {
            uid[*shard] += 1;
        }
        let spread = |counts: &[usize]| {
            let mean = counts.iter().sum::<usize>() as f64 / counts.len() as f64;
            let max = *counts.iter().max().unwrap_or(&0) as f64;
            let min = *counts.iter().min().unwrap_or(&0) as f64;
            format!(
                "{:+.0} % / {:+.0} %",
                (min / mean - 1.0) * 100.0,
                (max / mean - 1.0) * 100.0
            )
        };
        let by_namespace = |names: Vec<String>| {
            let mut counts = vec![0usize; key.shards()];
            for name in names {
                let bucket = (fnv1a64(name.as_bytes()) >> 56) as usize;
                counts[key.shard_of_bucket(bucket)] += 1;
            }
            counts
        };
        let tenants = by_namespace((0..1000).map(|i| format!("tenant-{i}")).collect());
        let teams = by_namespace(
            (0..1000)
                .map(|i| format!("team-{:x}-prod", fnv1a64(&(i as u64).to_le_bytes()) >> 40))
                .collect(),
        );
        self.report.record(
            "shard_key_spread",
            json!({"uid": uid, "namespace_tenant_n": tenants, "namespace_random": teams}),
            format!(
                "shard key over {} shards, objects per shard (least / most against the mean): uids of the {} objects {} {uid:?}; 1,000 namespaces `tenant-N` {} {tenants:?}; 1,000 namespaces with random names {} {teams:?}",
                key.shards(),
                by_uid.len(),
                spread(&uid),
                spread(&tenants),
                spread(&teams)
            ),
        );
        Ok(())
    }
}
