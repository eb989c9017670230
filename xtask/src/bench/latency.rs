//! Latency: from an object's create to the operator's "reconcile started" line (idle, and
//! under the cold start's load), and from the create to a Ready status. At idle, the
//! leader's threads are watched too ([`super::schedstat`]), so a stall is attributed: the
//! operator ran, waited for a CPU, or slept.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use e2e::operator::Operator;
use e2e::stats::percentile;
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use myresource_operator::resource::MyResource;
use serde_json::{Value, json};

use super::Bench;
use super::cpu::{CpuSplit, Settled};
use super::objects::mr;
use super::schedstat::{Sampler, Samples};

/// An in-operator latency (enqueued → reconcile started) above this is a stall, at idle.
const STALL_MS: f64 = 5.0;

impl Bench {
    /// `idle` with the CPU each process used over its section.
    pub(super) fn record_latency(
        &mut self,
        n: usize,
        (idle, idle_cpu, settled): (&Latency, &CpuSplit, &Settled),
        under_load: &Latency,
    ) {
        let (e2e_idle, op_idle) = (idle.end_to_end, idle.in_operator);
        let (e2e_load, op_load) = (under_load.end_to_end, under_load.in_operator);
        self.report.record(
            "event_to_reconcile_ms",
            json!({
                "p50": e2e_idle.0, "p99": e2e_idle.1,
                "idle": {"create_to_start": {"p50": e2e_idle.0, "p99": e2e_idle.1}, "watch_event_to_start": {"p50": op_idle.0, "p99": op_idle.1}, "samples": idle.samples, "leader_threads": idle.threads, "cpu": idle_cpu.json(), "settled": settled.json()},
                "under_load": {"create_to_start": {"p50": e2e_load.0, "p99": e2e_load.1}, "watch_event_to_start": {"p50": op_load.0, "p99": op_load.1}, "samples": under_load.samples},
            }),
            format!(
                "event → reconcile start, idle ({} samples): from the create p50 {:.1} ms, p99 {:.1} ms; from the key's enqueueing (after decode, store update and echo filter) p50 {:.2} ms, p99 {:.2} ms. Under the cold-start load ({} samples, created as it runs: the changed lane, ahead of the backlog of {n} keys): from the create p50 {:.0} ms, p99 {:.0} ms",
                idle.samples, e2e_idle.0, e2e_idle.1, op_idle.0, op_idle.1, under_load.samples, e2e_load.0, e2e_load.1
            ),
        );
        self.report.line(format!(
            "- CPU per process over the idle section (cores busy on average): {idle_cpu}; the leader's threads ran {} ms and waited {} ms for a CPU. Before it, the machine was {settled}",
            idle.threads["section"]["ran_ms"], idle.threads["section"]["waited_for_cpu_ms"],
        ));
        if let Some(worst) = idle.threads.get("worst_stall") {
            self.report.line(format!(
                "idle stalls (enqueued → start over {STALL_MS} ms): {}; the worst, {} ms: the leader's threads ran {} ms and waited {} ms for a CPU (over the idle section: ran {} ms, waited {} ms)",
                idle.threads["stalls"],
                worst["ms"],
                worst["ran_ms"],
                worst["waited_for_cpu_ms"],
                idle.threads["section"]["ran_ms"],
                idle.threads["section"]["waited_for_cpu_ms"],
            ));
        }
    }
}

/// Event → reconcile start at idle: `count` objects created one at a time, 20 ms apart.
pub(super) async fn idle_latency(
    leader: &Operator,
    mrs: &Api<MyResource>,
    count: usize,
) -> Result<Latency> {
    eprintln!("==> event → reconcile start, idle: {count} objects one at a time");
    let sampler = Sampler::start(leader.process.pid);
    let idle_starts = create_spaced(mrs.clone(), "idle", count, Duration::from_millis(20)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let samples = sampler.stop();
    let mut latency = latencies(leader, &idle_starts?);
    latency.threads = attribute(&latency.stalls, &samples);
    Ok(latency)
}

/// Where the leader's threads spent the worst stall and the whole section.
fn attribute(stalls: &[(Timestamp, Timestamp)], samples: &Samples) -> Value {
    let ms = |(from, to): &(Timestamp, Timestamp)| to.duration_since(*from).as_secs_f64() * 1e3;
    let mut threads = json!({
        "stalls": stalls.len(),
        "section": samples.total().map(|s| s.json()),
    });
    if let Some(window) = stalls.iter().max_by(|a, b| ms(a).total_cmp(&ms(b)))
        && let Some(spent) = samples.spent(window.0, window.1)
    {
        threads["worst_stall"] = spent.json();
        threads["worst_stall"]["ms"] = ((ms(window) * 100.0).round() / 100.0).into();
    }
    threads
}

/// Creates `count` objects one at a time (20 ms apart) and returns each one's create →
/// Ready-status latency in milliseconds.
pub(super) async fn sequential_latency(
    client: &Client,
    ns: &str,
    prefix: &str,
    count: usize,
) -> Result<Vec<f64>> {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), ns);
    let ready = ready_times(mrs.clone());
    let mut samples = Vec::new();
    for i in 0..count {
        let name = format!("{prefix}{i}");
        let started = Instant::now();
        mrs.create(&PostParams::default(), &mr(&name, i)).await?;
        let seen = ready.wait(&name, Duration::from_secs(30)).await?;
        samples.push(seen.duration_since(started).as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(samples)
}

/// Creates `count` objects one at a time, `gap` apart; returns (name, create time).
pub(super) async fn create_spaced(
    mrs: Api<MyResource>,
    prefix: &'static str,
    count: usize,
    gap: Duration,
) -> Result<Vec<(String, Timestamp)>> {
    let mut starts = Vec::new();
    for i in 0..count {
        let name = format!("{prefix}{i}");
        let at = Timestamp::now();
        mrs.create(&PostParams::default(), &mr(&name, i)).await?;
        starts.push((name, at));
        tokio::time::sleep(gap).await;
    }
    Ok(starts)
}

/// Latency percentiles (p50, p99, in ms) for objects created at known times: from the
/// create to the operator's "reconcile started" line (end to end, through the API server and
/// the watch), and from the key's "enqueued" line to it (the operator's own part, which
/// starts after the watch event was decoded, stored and passed the echo filter).
pub(super) struct Latency {
    end_to_end: (f64, f64),
    in_operator: (f64, f64),
    /// How many objects were created.
    samples: usize,
    /// In-operator windows (enqueued → started) longer than [`STALL_MS`].
    stalls: Vec<(Timestamp, Timestamp)>,
    /// At idle: where the leader's threads spent the worst stall and the section
    /// ([`attribute`]); null otherwise.
    threads: Value,
}

pub(super) fn latencies(op: &Operator, starts: &[(String, Timestamp)]) -> Latency {
    let mut enqueued: HashMap<String, Timestamp> = HashMap::new();
    let mut started: HashMap<String, Timestamp> = HashMap::new();
    for line in op.log_lines() {
        let table = match line["message"].as_str() {
            Some("enqueued") => &mut enqueued,
            Some("reconcile started") => &mut started,
            _ => continue,
        };
        if let (Some(key), Some(at)) = (line["myresource"].as_str(), stamp(&line)) {
            let name = key.rsplit('/').next().unwrap_or(key).to_string();
            table.entry(name).or_insert(at);
        }
    }
    let pair = |samples: Vec<f64>| {
        if samples.is_empty() {
            (f64::NAN, f64::NAN)
        } else {
            (percentile(&samples, 50.0), percentile(&samples, 99.0))
        }
    };
    let ms = |from: Timestamp, to: Timestamp| to.duration_since(from).as_secs_f64() * 1000.0;
    let windows: Vec<(Timestamp, Timestamp)> = starts
        .iter()
        .filter_map(|(n, _)| Some((*enqueued.get(n)?, *started.get(n)?)))
        .collect();
    Latency {
        end_to_end: pair(
            starts
                .iter()
                .filter_map(|(n, at)| started.get(n).map(|s| ms(*at, *s)))
                .collect(),
        ),
        in_operator: pair(windows.iter().map(|(from, to)| ms(*from, *to)).collect()),
        stalls: windows
            .iter()
            .filter(|(from, to)| ms(*from, *to) > STALL_MS)
            .copied()
            .collect(),
        samples: starts.len(),
        threads: Value::Null,
    }
}

pub(super) fn stamp(line: &Value) -> Option<Timestamp> {
    line["timestamp"].as_str().and_then(|t| t.parse().ok())
}

/// When each MyResource was first seen Ready, from a watch.
struct ReadyTimes(tokio::sync::watch::Receiver<HashMap<String, Instant>>);

fn ready_times(api: Api<MyResource>) -> ReadyTimes {
    let (tx, rx) = tokio::sync::watch::channel(HashMap::new());
    tokio::spawn(async move {
        let mut events = std::pin::pin!(
            watcher::watcher(api, watcher::Config::default())
                .applied_objects()
                .default_backoff()
        );
        while let Some(Ok(mr)) = events.next().await {
            let ready = mr.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
            if ready {
                let name = mr.metadata.name.clone().unwrap_or_default();
                tx.send_modify(|m| {
                    m.entry(name).or_insert_with(Instant::now);
                });
            }
        }
    });
    ReadyTimes(rx)
}

impl ReadyTimes {
    async fn wait(&self, name: &str, limit: Duration) -> Result<Instant> {
        let mut rx = self.0.clone();
        let seen = tokio::time::timeout(limit, rx.wait_for(|m| m.contains_key(name))).await??;
        Ok(seen[name])
    }
}
