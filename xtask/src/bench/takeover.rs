//! Takeover with N objects cached: a follower started beside the cold-started leader, the
//! leader stopped (SIGTERM: a graceful release) or killed (SIGKILL: the Lease runs out), and
//! the time until the follower has reconciled every key, with the requests it made and the
//! memory of both.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context, Result};
use e2e::lease::DEFAULT_TIMINGS;
use e2e::operator::Operator;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use myresource_operator::resource::MyResource;
use serde_json::{Value, json};

use super::Bench;
use super::latency::stamp;
use super::objects::count_all;

/// How the leader goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    Sigterm,
    Sigkill,
}

/// What the takeover measured; the follower, now leading, is still running.
pub(super) struct Takeover {
    pub(super) follower: Operator,
    how: Stop,
    /// Objects in the namespace when the leader stopped.
    expected: usize,
    first_ms: f64,
    /// Seconds from acquiring to every cached key queued (the operator's own log line).
    enqueued: f64,
    drain: f64,
    writes: usize,
    lists: usize,
    rss_leader: u64,
    rss_leader_before: u64,
    rss_follower: u64,
}

impl Bench {
    /// Starts the follower `identity` in `ns`, then stops `leader` as `how` says and
    /// measures the follower's takeover with `cached` objects in its caches.
    pub(super) async fn takeover(
        &mut self,
        mut leader: Operator,
        ns: &str,
        cached: usize,
        (identity, how): (&str, Stop),
    ) -> Result<Takeover> {
        eprintln!("==> takeover with {cached} objects cached, the leader stopped by {how:?}");
        let mut follower = self.replica(ns, identity, &DEFAULT_TIMINGS)?;
        // Its caches fill from paged LISTs of every object: about a second per 3,000 here.
        let limit = Duration::from_secs(30 + cached as u64 / 1000);
        follower.wait_ready_within(limit).await?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss_follower = follower.rss_bytes().unwrap_or(0);
        let rss_leader_before = leader.rss_bytes().unwrap_or(0);
        match how {
            Stop::Sigterm => leader.stop(),
            Stop::Sigkill => leader.kill(),
        }
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), ns);
        let expected = count_all(&mrs).await?;
        let lines = drained(&follower, expected).await?;
        let took_over = lines
            .iter()
            .find(|l| l["message"] == "acquired the Lease: leading")
            .and_then(stamp)
            .context("acquired line")?;
        let reconciled: Vec<Timestamp> = lines
            .iter()
            .filter(|l| l["message"] == "reconciled")
            .filter_map(stamp)
            .collect();
        let first_ms = reconciled[0].duration_since(took_over).as_secs_f64() * 1000.0;
        let enqueued = lines
            .iter()
            .find(|l| l["message"] == "takeover enqueued every cached key")
            .and_then(|l| l["seconds"].as_f64())
            .context("the takeover's enqueued line")?;
        let drain = reconciled[reconciled.len() - 1]
            .duration_since(took_over)
            .as_secs_f64();
        let (writes, lists) = self.takeover_requests(&follower, took_over)?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss_leader = follower.rss_bytes().unwrap_or(0);
        Ok(Takeover {
            follower,
            how,
            expected,
            first_ms,
            enqueued,
            drain,
            writes,
            lists,
            rss_leader,
            rss_leader_before,
            rss_follower,
        })
    }

    /// From the audit log: the new leader's writes (Leases aside), and its LIST requests
    /// after it acquired the Lease.
    fn takeover_requests(
        &self,
        follower: &Operator,
        took_over: Timestamp,
    ) -> Result<(usize, usize)> {
        let identity = Some(follower.config.identity.as_str());
        let audit = e2e::audit::read_filtered(&self.cluster.audit_log, |e| {
            (e.replica() == identity).then(|| e.without_bodies())
        })?;
        let takeover_writes = audit
            .iter()
            .filter(|e| e.is_write() && e.resource() != "leases")
            .count();
        let takeover_lists = audit
            .iter()
            .filter(|e| {
                e.verb == "list"
                    && e.resource() != "leases"
                    && e.request_received_timestamp > took_over
            })
            .count();
        Ok((takeover_writes, takeover_lists))
    }

    pub(super) fn record_takeover(&mut self, n: usize, takeover: &Takeover) {
        let Takeover {
            how,
            expected,
            first_ms,
            enqueued,
            drain,
            writes: takeover_writes,
            lists: takeover_lists,
            rss_leader,
            rss_leader_before,
            rss_follower,
            ..
        } = *takeover;
        let mib = |b: u64| b as f64 / 1048576.0;
        if how == Stop::Sigkill {
            // The second takeover, after the Lease ran out: its own keys; memory was
            // recorded by the first.
            let first = "sigkill_takeover_first_reconcile_ms";
            self.report.record(first, json!(first_ms), format!("takeover after SIGKILL with {expected} objects cached: first reconcile {first_ms:.1} ms after acquiring"));
            self.report.record(
                "sigkill_takeover_drain_seconds",
                json!({"drain": drain, "enqueued": enqueued, "writes": takeover_writes, "lists": takeover_lists}),
                format!("takeover after SIGKILL: every key queued {enqueued:.3} s and reconciled {drain:.2} s after acquiring; {takeover_writes} writes and {takeover_lists} LIST requests by the new leader"),
            );
            return;
        }
        self.report.record("takeover_first_reconcile_ms", json!(first_ms), format!("takeover with {expected} objects cached: first reconcile {first_ms:.1} ms after acquiring"));
        self.report
            .insert("takeover_enqueued_seconds", json!(enqueued));
        self.report.record(
            "takeover_drain_seconds",
            json!(drain),
            format!("takeover: every key queued {enqueued:.3} s and reconciled {drain:.2} s after acquiring; {takeover_writes} writes and {takeover_lists} LIST requests by the new leader"),
        );
        self.report.insert(
            "takeover_requests",
            json!({"writes": takeover_writes, "lists": takeover_lists}),
        );
        self.report.record("rss_bytes_leader", json!(rss_leader), format!("resident memory, leader after the takeover: {:.1} MiB (the old leader before it: {:.1} MiB)", mib(rss_leader), mib(rss_leader_before)));
        self.report.record("rss_bytes_follower", json!(rss_follower), format!("resident memory, follower with {n} MyResources, {n} ConfigMaps and {n} Pods cached: {:.1} MiB", mib(rss_follower)));
    }
}

/// Waits until `follower` has logged a "reconciled" line for `expected` keys; returns its
/// log lines.
async fn drained(follower: &Operator, expected: usize) -> Result<Vec<Value>> {
    e2e::wait::poll("the takeover to drain", Duration::from_secs(600), || {
        let lines = follower.log_lines();
        async move {
            let keys: HashSet<&str> = lines
                .iter()
                .filter(|l| l["message"] == "reconciled")
                .filter_map(|l| l["myresource"].as_str())
                .collect();
            Ok((keys.len() >= expected).then_some(lines.clone()))
        }
    })
    .await
}
