//! `cargo xtask bench --peers [N]`: the operator side by side with what a platform team would
//! pick instead, on one local control plane, one after the other, with the same objects and
//! the same Lease timings (15 s / 10 s / 2 s): controller-runtime (warm-up off, then
//! `EnableWarmup`) and kube-runtime's `Controller` with kube-lease-manager, all from
//! `bench/peers/`. Writes `target/bench/peers/report.{json,md}`.
//!
//! Every number comes from outside the processes, the same way for all: the API server's
//! audit log (who sent which request, when it was received), a watch on the MyResources
//! (when they are Ready), /proc (resident memory), and the signals the bench sends.
//!
//! - [`build`]: the peers' binaries, built on first use and cached outside the clone;
//! - [`replica`]: the peers and a replica of any of them;
//! - [`audit`]: the audit log, read as it grows;
//! - [`table`]: the comparison table.

mod audit;
mod build;
mod replica;
mod table;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use anyhow::{Context, Result};
use e2e::stats::{percentile, summary};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, watcher};
use myresource_operator::resource::MyResource;
use serde_json::{Value, json};

use super::Bench;
use super::ceiling::Ceiling;
use super::latency::create_spaced;
use super::objects::{create_objects, mr};
use audit::{Audit, WATCH_LIST, identity_of, name_of};
pub(super) use build::{PeerBinaries, ensure as build_peers};
use e2e::audit::AuditEvent;
use replica::{CONCURRENCY, PEERS, Peer, Replica};

/// Passes over every peer, alternating the order of [`PEERS`] and its reverse, so every peer
/// runs on average at the same point of the store's growth.
const PASSES: usize = 2;

/// Gap between the objects created one at a time for the idle latency.
const IDLE_GAP: Duration = Duration::from_millis(50);
/// How long a follower runs before its memory is read (its caches filled, if it fills any).
const SETTLE: Duration = Duration::from_secs(8);
/// How long after a takeover the new leader's requests are counted, at least (until the
/// probe was handled, if later: a peer that relists pages through N objects first).
const TAKEOVER_WINDOW: Duration = Duration::from_secs(15);
/// How long a replica may take to handle a probe: with nothing in between, or ([`PER_OBJECT`]
/// more for each) behind a takeover that may list and reconcile every object first.
const PROBE_WAIT: Duration = Duration::from_secs(60);
const PER_OBJECT: Duration = Duration::from_millis(10);

/// A `--peer` argument: one of the peers' keys.
pub(super) fn parse_key(key: &str) -> Result<&'static str, String> {
    PEERS
        .iter()
        .map(|p| p.key())
        .find(|k| *k == key)
        .ok_or_else(|| {
            let keys: Vec<&str> = PEERS.iter().map(|p| p.key()).collect();
            format!("no peer {key:?}; the peers are {}", keys.join(", "))
        })
}

impl Bench {
    /// Every peer, one after the other, in [`PASSES`] passes (the order of [`PEERS`], then
    /// the reverse), with a third of the write ceiling before, between and after them.
    pub(super) async fn peers(
        &mut self,
        binaries: &PeerBinaries,
        n: usize,
        latency_objects: usize,
        failover_runs: usize,
        only: &[&str],
    ) -> Result<()> {
        // Replica logs are appended to; an earlier run's lines must not be read as this run's.
        let _ = std::fs::remove_dir_all(self.root.join("target/bench/peers/logs"));
        let mut audit = Audit::new(self.cluster.audit_log.clone());
        let per_phase = n / 2;
        eprintln!(
            "==> setup: {} MyResources for the write ceiling",
            per_phase * (PASSES + 1)
        );
        let ceiling_ns = self.namespace("peers-ceiling").await?;
        create_objects(&self.client, &ceiling_ns, per_phase * (PASSES + 1), false).await?;
        let mut parts = self
            .ceiling_parts(&ceiling_ns, per_phase)
            .await?
            .into_iter();
        let mut phase = || {
            parts
                .next()
                .context("a part of the ceiling's objects per phase")
        };
        let mut before = self.ceiling(phase()?, CONCURRENCY, "before").await?;
        let mut passes = Vec::new();
        for pass in 1..=PASSES {
            let mut order = PEERS.to_vec();
            order.retain(|p| only.is_empty() || only.contains(&p.key()));
            if pass % 2 == 0 {
                order.reverse();
            }
            let mut results = BTreeMap::new();
            for peer in order.iter().copied() {
                let result = self
                    .peer(
                        peer,
                        pass,
                        binaries,
                        &mut audit,
                        Sizes {
                            n,
                            latency_objects,
                            failover_runs,
                        },
                    )
                    .await
                    .with_context(|| format!("measuring {} (pass {pass})", peer.title()))?;
                results.insert(peer.key(), result);
            }
            let after = self.ceiling(phase()?, CONCURRENCY, "after").await?;
            let ceiling = Ceiling::of(before, after.clone());
            for result in results.values_mut() {
                let ratio = result["cold_start"]["writes_per_second"]
                    .as_f64()
                    .unwrap_or(f64::NAN)
                    / ceiling.writes_per_second;
                result["cold_start"]["ceiling_ratio"] = json!(ratio);
                // The ceiling makes 3 writes per object, as a reconcile from scratch does.
                let objects = result["cold_start"]["objects_per_second"]
                    .as_f64()
                    .unwrap_or(f64::NAN);
                result["cold_start"]["objects_ceiling_ratio"] =
                    json!(objects / (ceiling.writes_per_second / 3.0));
            }
            passes.push(table::Pass {
                order: order.iter().map(|p| p.key()).collect(),
                ceiling: ceiling.writes_per_second,
                results,
            });
            before = after;
        }
        let report: Vec<Value> = passes.iter().map(table::Pass::json).collect();
        self.report.insert("passes", json!(report));
        let peers: String = only.iter().map(|k| format!(" --peer {k}")).collect();
        let command = format!(
            "cargo xtask bench --peers {n} --latency-objects {latency_objects} --failover-runs {failover_runs}{peers}"
        );
        self.report.insert("command", json!(command));
        for line in table::markdown(&passes, n, &command) {
            self.report.line(line);
        }
        Ok(())
    }

    /// Everything measured for one peer; see the module doc of [`table`] for the rows.
    async fn peer(
        &mut self,
        peer: Peer,
        pass: usize,
        binaries: &PeerBinaries,
        audit: &mut Audit,
        sizes: Sizes,
    ) -> Result<Value> {
        let Sizes {
            n,
            latency_objects,
            failover_runs,
        } = sizes;
        // Namespaces and identities of their own per pass: replica logs are read by identity.
        let key = &format!("{}-{pass}", peer.key());
        eprintln!("==> {} (pass {pass})", peer.title());
        // Memory with nothing to cache, for the per-object figures.
        let empty_ns = self.namespace(&format!("peers-{key}-empty")).await?;
        let mut base_leader = self.start_peer(peer, binaries, &empty_ns, &format!("{key}-e0"))?;
        wait_leader(audit, &empty_ns).await?;
        let mut base_follower = self.start_peer(peer, binaries, &empty_ns, &format!("{key}-e1"))?;
        tokio::time::sleep(SETTLE).await;
        let base = (base_leader.rss_bytes(), base_follower.rss_bytes());
        base_leader.stop();
        base_follower.stop();

        let ns = self.namespace(&format!("peers-{key}")).await?;
        eprintln!("    cold start with {n} MyResources and {n} labelled Pods");
        create_objects(&self.client, &ns, n, true).await?;
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), &ns);
        let spawned = Timestamp::now();
        let mut leader = self.start_peer(peer, binaries, &ns, &format!("{key}-a"))?;
        let all_ready = wait_ready(&mrs, n, &mut leader).await?;
        audit.refresh()?;
        let cold = cold_start(audit, &leader.identity, &ns, n, spawned, all_ready)?;

        eprintln!("    idle latency: {latency_objects} objects one at a time");
        let starts = create_spaced(mrs.clone(), "idle", latency_objects, IDLE_GAP).await?;
        wait_ready(&mrs, n + latency_objects, &mut leader).await?;
        audit.refresh()?;
        let names: Vec<&str> = starts.iter().map(|(name, _)| name.as_str()).collect();
        let latency = idle_latency(audit, &leader.identity, &ns, &names);

        eprintln!("    memory and takeover with everything cached");
        let cached = 3 * n + 2 * latency_objects;
        let mut follower = self.start_peer(peer, binaries, &ns, &format!("{key}-b"))?;
        tokio::time::sleep(SETTLE).await;
        follower.ensure_running()?;
        let rss = (leader.rss_bytes(), follower.rss_bytes());
        let per_object = |rss: u64, base: u64| (rss as f64 - base as f64) / cached as f64;
        let memory = json!({
            "cached_objects": cached,
            "leader_bytes": rss.0, "follower_bytes": rss.1,
            "empty_leader_bytes": base.0, "empty_follower_bytes": base.1,
            "leader_bytes_per_object": per_object(rss.0, base.0),
            "follower_bytes_per_object": per_object(rss.1, base.1),
        });
        let takeover = self
            .takeover_of(audit, (leader, &mut follower), &ns, cached)
            .await?;
        follower.stop();

        let failover = self
            .failover_of(peer, key, binaries, audit, failover_runs)
            .await?;
        Ok(json!({
            "title": peer.title(),
            "cold_start": cold,
            "idle_latency_ms": latency,
            "memory": memory,
            "takeover": takeover,
            "failover": failover,
        }))
    }

    /// SIGTERM to `leader` with `follower` beside it and everything cached; then a probe
    /// object. Measures the signal → the probe's ConfigMap, and what the new leader sends in
    /// the first [`TAKEOVER_WINDOW`] after acquiring the Lease, the probe's requests aside.
    async fn takeover_of(
        &mut self,
        audit: &mut Audit,
        (mut leader, follower): (Replica, &mut Replica),
        ns: &str,
        cached: usize,
    ) -> Result<Value> {
        let signal = Timestamp::now();
        leader.stop();
        let probe = "takeover-probe";
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), ns);
        mrs.create(&PostParams::default(), &mr(probe, 0)).await?;
        let within = PROBE_WAIT + PER_OBJECT * cached as u32;
        let handled =
            wait_configmap(audit, (ns, probe), &leader.identity, follower, within).await?;
        let acquired = audit
            .term_after(ns, signal)
            .context("the follower never acquired the Lease")?;
        let window_end = (acquired + TAKEOVER_WINDOW).max(handled);
        let wait = window_end.duration_since(Timestamp::now()).as_secs_f64();
        if wait > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        }
        audit.refresh()?;
        let after: Vec<_> = audit
            .by(&follower.identity, ns)
            .filter(|e| e.request_received_timestamp >= acquired)
            .filter(|e| e.request_received_timestamp <= window_end)
            .filter(|e| !name_of(e).starts_with(probe))
            .collect();
        // Of the controller's objects: the election's own read of its Lease by name is a
        // one-item list (kube-leasehold reads it so).
        let full_state =
            |e: &AuditEvent| (e.verb == "list" || e.verb == WATCH_LIST) && e.resource() != "leases";
        let lists = after.iter().filter(|e| full_state(e)).count();
        let writes = after
            .iter()
            .filter(|e| e.is_write() && e.resource() != "leases")
            .count();
        let lists_before = audit
            .by(&follower.identity, ns)
            .filter(|e| e.request_received_timestamp < acquired && full_state(e))
            .count();
        Ok(json!({
            "signal_to_probe_configmap_seconds": seconds(signal, handled),
            "signal_to_acquired_seconds": seconds(signal, acquired),
            "lists_after_acquiring": lists,
            "writes_after_acquiring": writes,
            "lists_before_acquiring": lists_before,
            "requests_after_acquiring": breakdown(after.iter().copied()),
            "window_seconds": window_end.duration_since(acquired).as_secs_f64(),
        }))
    }

    /// Three replicas on 10 objects; `runs` times the leader SIGKILLed, then `runs` times
    /// SIGTERMed, each time followed at once by a probe object: the signal → the probe's
    /// ConfigMap created by another replica.
    async fn failover_of(
        &mut self,
        peer: Peer,
        key: &str,
        binaries: &PeerBinaries,
        audit: &mut Audit,
        runs: usize,
    ) -> Result<Value> {
        let ns = self.namespace(&format!("peers-{key}-failover")).await?;
        eprintln!("    SIGKILL failover and SIGTERM handover, {runs} runs each");
        create_objects(&self.client, &ns, 10, false).await?;
        let mut replicas = Vec::new();
        for i in 0..3 {
            replicas.push(self.start_peer(peer, binaries, &ns, &format!("{key}-f{i}"))?);
        }
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), &ns);
        let mut out = json!({});
        for (kind, graceful) in [("sigkill", false), ("sigterm", true)] {
            let mut samples = Vec::new();
            for run in 0..runs {
                let i = wait_leading(&mut replicas).await?;
                // Let followers observe a fresh renewal, as in steady state.
                tokio::time::sleep(Duration::from_secs(2)).await;
                let holder = replicas[i].identity.clone();
                let signal = Timestamp::now();
                if graceful {
                    replicas[i].stop();
                } else {
                    replicas[i].kill();
                }
                let probe = format!("{kind}-{run}");
                mrs.create(&PostParams::default(), &mr(&probe, run)).await?;
                let others = replicas.iter_mut().filter(|r| r.identity != holder);
                let handled =
                    wait_configmap_any(audit, (&ns, &probe), &holder, others, PROBE_WAIT).await?;
                samples.push(seconds(signal, handled));
                replicas[i] =
                    self.start_peer(peer, binaries, &ns, &format!("{key}-{kind}-{run}"))?;
            }
            let mut stats = summary(&samples);
            stats["samples"] = json!(samples);
            out[kind] = stats;
        }
        for r in &mut replicas {
            r.stop();
        }
        Ok(out)
    }
}

/// What the cold start measured, from the audit log.
fn cold_start(
    audit: &Audit,
    identity: &str,
    ns: &str,
    n: usize,
    spawned: Timestamp,
    all_ready: Timestamp,
) -> Result<Value> {
    let acquired = audit
        .term_after(ns, spawned)
        .context("the leader never acquired the Lease")?;
    let requests: Vec<_> = audit
        .by(identity, ns)
        .filter(|e| e.resource() != "leases")
        .collect();
    let writes: Vec<_> = requests
        .iter()
        .filter(|e| e.is_write() && e.succeeded())
        .collect();
    let last = writes
        .iter()
        .map(|e| e.stage_timestamp)
        .max()
        .context("the leader wrote nothing")?;
    // From the process's start, for every peer alike: some list before they campaign (ours),
    // some after they acquire (controller-runtime without warm-up).
    let reconcile_seconds = seconds(spawned, last);
    Ok(json!({
        "spawn_to_all_ready_seconds": seconds(spawned, all_ready),
        "spawn_to_acquired_seconds": seconds(spawned, acquired),
        "spawn_to_last_write_seconds": reconcile_seconds,
        "writes": writes.len(),
        "writes_per_second": writes.len() as f64 / reconcile_seconds,
        "objects_per_second": n as f64 / reconcile_seconds,
        "requests": requests.len(),
        "requests_per_object": requests.len() as f64 / n as f64,
        "writes_per_object": writes.len() as f64 / n as f64,
        "requests_by_verb_resource_code": breakdown(requests.iter().copied()),
    }))
}

/// For each object: its create (committed, by the API server's clock) → the leader's first
/// ConfigMap create and first status write for it (received, same clock).
fn idle_latency(audit: &Audit, identity: &str, ns: &str, names: &[&str]) -> Value {
    let wanted: HashSet<&str> = names.iter().copied().collect();
    let mut created: BTreeMap<&str, Timestamp> = BTreeMap::new();
    let mut configmap: BTreeMap<&str, Timestamp> = BTreeMap::new();
    let mut status: BTreeMap<&str, Timestamp> = BTreeMap::new();
    for e in audit.events.iter().filter(|e| e.namespace() == ns) {
        let name = name_of(e);
        if !wanted.contains(name) || !e.succeeded() {
            continue;
        }
        let sub = e.object_ref.as_ref().map_or("", |o| o.subresource.as_str());
        let mine = identity_of(e) == Some(identity);
        let table = match (e.resource(), sub, e.verb.as_str()) {
            ("myresources", "", "create") => Some((&mut created, e.stage_timestamp)),
            ("configmaps", "", "create") if mine => {
                Some((&mut configmap, e.request_received_timestamp))
            }
            ("myresources", "status", "update" | "patch") if mine => {
                Some((&mut status, e.request_received_timestamp))
            }
            _ => None,
        };
        if let Some((table, at)) = table {
            table.entry(name).or_insert(at);
        }
    }
    let ms = |to: &BTreeMap<&str, Timestamp>| {
        let samples: Vec<f64> = created
            .iter()
            .filter_map(|(name, at)| Some(seconds(*at, *to.get(name)?) * 1000.0))
            .collect();
        if samples.is_empty() {
            return json!(null);
        }
        json!({"p50": percentile(&samples, 50.0), "p99": percentile(&samples, 99.0), "samples": samples.len()})
    };
    json!({"to_configmap_create": ms(&configmap), "to_status_write": ms(&status)})
}

/// Requests counted by "verb resource[/subresource] code".
fn breakdown<'a>(requests: impl Iterator<Item = &'a AuditEvent>) -> Value {
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    for e in requests {
        let sub = e.object_ref.as_ref().map_or("", |o| o.subresource.as_str());
        let resource = match sub {
            "" => e.resource().to_string(),
            sub => format!("{}/{sub}", e.resource()),
        };
        let code = e.response_status.as_ref().map_or(0, |s| s.code);
        *counts
            .entry(format!("{} {resource} {code}", e.verb))
            .or_default() += 1;
    }
    json!(counts)
}

fn seconds(from: Timestamp, to: Timestamp) -> f64 {
    to.duration_since(from).as_secs_f64()
}

/// Waits until some replica holds the Lease in `ns` (60 s at most).
async fn wait_leader(audit: &mut Audit, ns: &str) -> Result<String> {
    e2e::wait::poll("a leader", Duration::from_secs(60), || {
        let found = audit.refresh().map(|()| audit.holder(ns));
        async move { found }
    })
    .await
}

/// Waits (60 s at most) until one of `replicas` has logged that it leads; returns its index.
/// Every replica that ever led is killed or terminated before the next run, so that one is
/// the leader.
async fn wait_leading(replicas: &mut [Replica]) -> Result<usize> {
    for _ in 0..300 {
        if let Some(i) = replicas.iter_mut().position(|r| r.has_led()) {
            return Ok(i);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("no replica led within 60 s")
}

/// Waits (`within` at most) until a replica other than `except` has created the ConfigMap
/// `ns/name`; fails early when `replica` has exited.
async fn wait_configmap(
    audit: &mut Audit,
    object: (&str, &str),
    except: &str,
    replica: &mut Replica,
    within: Duration,
) -> Result<Timestamp> {
    wait_configmap_any(audit, object, except, std::iter::once(replica), within).await
}

async fn wait_configmap_any<'a>(
    audit: &mut Audit,
    (ns, name): (&str, &str),
    except: &str,
    replicas: impl Iterator<Item = &'a mut Replica>,
    within: Duration,
) -> Result<Timestamp> {
    let mut replicas: Vec<&mut Replica> = replicas.collect();
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        audit.refresh()?;
        if let Some(at) = audit.configmap_created(ns, name, except) {
            return Ok(at);
        }
        for r in &mut replicas {
            r.ensure_running()?;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!(
        "no replica created the ConfigMap {ns}/{name} within {} s",
        within.as_secs()
    )
}

/// Watches the MyResources in `mrs` until `n` of them are Ready for their generation
/// (900 s at most); returns when. Fails when `replica` exits meanwhile.
async fn wait_ready(mrs: &Api<MyResource>, n: usize, replica: &mut Replica) -> Result<Timestamp> {
    let mut ready: HashSet<String> = HashSet::new();
    let mut events = std::pin::pin!(
        watcher::watcher(mrs.clone(), watcher::Config::default())
            .applied_objects()
            .default_backoff()
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(900);
    while tokio::time::Instant::now() < deadline {
        let Ok(next) = tokio::time::timeout(Duration::from_secs(2), events.next()).await else {
            replica.ensure_running()?;
            continue;
        };
        let mr = next.context("the watch ended")??;
        let is_ready = mr.status.as_ref().is_some_and(|s| {
            s.observed_generation == mr.metadata.generation
                && s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
        });
        let name = mr.metadata.name.clone().unwrap_or_default();
        if is_ready {
            ready.insert(name);
        } else {
            ready.remove(&name);
        }
        if ready.len() >= n {
            return Ok(Timestamp::now());
        }
    }
    anyhow::bail!("fewer than {n} MyResources Ready after 900 s")
}

/// How much one peer's measurement does: objects for the cold start, objects created one
/// at a time for the idle latency, failovers.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    n: usize,
    latency_objects: usize,
    failover_runs: usize,
}
