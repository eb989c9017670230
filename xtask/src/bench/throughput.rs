//! The operator's cold start: N MyResources and N labelled Pods reconciled from scratch by
//! one replica, against the API server's write ceiling; then, on the same objects, the
//! latency and takeover sections.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use e2e::audit::AuditEvent;
use e2e::lease::DEFAULT_TIMINGS;
use e2e::operator::Operator;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use myresource_operator::resource::MyResource;
use serde_json::{Value, json};

use super::Bench;
use super::ceiling::Ceiling;
use super::cpu::CpuSplit;
use super::latency::{create_spaced, idle_latency, latencies, stamp};
use super::objects::{create_objects, metric_sum, wait_all_ready};
use super::takeover::Stop;

/// Objects created during the cold start, 200 ms apart, to measure latency under load.
const PROBES: usize = 20;

/// What the cold start measured.
struct ColdStart {
    /// When the replica acquired the Lease.
    acquired: Timestamp,
    /// The probes: (name, create time).
    probe_starts: Vec<(String, Timestamp)>,
    /// Reconciles, by the operator's metrics.
    reconciles: f64,
    cpu: CpuSplit,
}

/// The operator's writes in the cold start, from the audit log.
struct OperatorWrites {
    count: usize,
    /// By verb, resource and code.
    requests: Value,
    /// From acquiring the Lease to the last write.
    reconcile_seconds: f64,
    per_second: f64,
}

impl Bench {
    /// The API server's write ceiling, the operator's cold start against it, event →
    /// reconcile-start latency under load and idle, takeover with N objects cached, and the
    /// memory of leader and follower.
    pub(super) async fn throughput_and_takeover(
        &mut self,
        n: usize,
        latency_objects: usize,
    ) -> Result<()> {
        eprintln!(
            "==> setup: {n} MyResources and {n} labelled Pods, and {n} MyResources for the ceiling"
        );
        let ceiling_ns = self.namespace("bench-ceiling").await?;
        let ns = self.namespace("bench-throughput").await?;
        create_objects(&self.client, &ceiling_ns, n, false).await?;
        create_objects(&self.client, &ns, n, true).await?;
        // Same concurrency as the operator's default: 4 shards × 2 workers.
        let concurrency = 8;

        // The ceiling runs in two halves, before and after the operator's cold start: every
        // write leaves objects behind in etcd and the watch cache, so a ceiling measured
        // only before would see a smaller store than the operator does.
        let (first_half, second_half) = self.ceiling_halves(&ceiling_ns, n).await?;
        let before = self.ceiling(first_half, concurrency, "before").await?;
        let (leader, cold) = self.cold_start(&ns, n).await?;
        let after = self.ceiling(second_half, concurrency, "after").await?;
        let ceiling = Ceiling::of(before, after);
        let ceiling_requests = {
            let audit = read_namespace(&self.cluster.audit_log, &ceiling_ns)?;
            request_breakdown(&audit, None, &ceiling_ns)
        };
        let writes = self.operator_writes(&leader, &ns, cold.acquired)?;
        let under_load = latencies(&leader, &cold.probe_starts);

        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), &ns);
        // Who used the machine meanwhile: a slow sample the operator's threads spent waiting
        // for a CPU is told from one they spent working.
        let operator_pid = [("operator", leader.process.pid)];
        let settled = self.settle(&operator_pid).await;
        let cpu_before = self.cpu(&operator_pid);
        let started = Instant::now();
        let idle = idle_latency(&leader, &mrs, latency_objects).await?;
        let idle_cpu = CpuSplit::between(
            &cpu_before,
            &self.cpu(&operator_pid),
            started.elapsed().as_secs_f64(),
        );

        let cached = n + latency_objects + cold.probe_starts.len();
        let graceful = self
            .takeover(leader, &ns, cached, ("throughput-b", Stop::Sigterm))
            .await?;

        self.report.insert("objects", json!(n));
        self.record_ceiling(n, concurrency, &ceiling);
        self.record_cold_start(n, &ceiling, &ceiling_requests, &cold, &writes);
        self.record_latency(n, (&idle, &idle_cpu, &settled), &under_load);
        self.record_takeover(n, &graceful);
        let mut killed = self
            .takeover(
                graceful.follower,
                &ns,
                cached,
                ("throughput-c", Stop::Sigkill),
            )
            .await?;
        self.record_takeover(n, &killed);
        killed.follower.stop();
        Ok(())
    }

    /// Starts the leader on the `n` objects in `ns` and waits until all are Ready, creating
    /// probes meanwhile.
    async fn cold_start(&mut self, ns: &str, n: usize) -> Result<(Operator, ColdStart)> {
        eprintln!("==> operator cold start with {n} objects (probes measure latency under load)");
        let leader = self.replica(ns, "throughput-a", &DEFAULT_TIMINGS)?;
        let operator_pid = [("operator", leader.process.pid)];
        let cpu_before = self.cpu(&operator_pid);
        let started = Instant::now();
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), ns);
        let acquired = e2e::wait::poll("the operator to lead", Duration::from_secs(120), || {
            let line = leader
                .log_lines()
                .into_iter()
                .find(|l| l["message"] == "acquired the Lease: leading");
            async move { Ok(line.and_then(|l| stamp(&l))) }
        })
        .await?;
        let probes = tokio::spawn(create_spaced(
            mrs.clone(),
            "probe",
            PROBES,
            Duration::from_millis(200),
        ));
        wait_all_ready(&leader, &mrs, n).await?;
        let reconciles = metric_sum(&leader, "controller_runtime_reconcile_total{").await?;
        let cpu = CpuSplit::between(
            &cpu_before,
            &self.cpu(&operator_pid),
            started.elapsed().as_secs_f64(),
        );
        let probe_starts = probes.await??;
        let cold = ColdStart {
            acquired,
            probe_starts,
            reconciles,
            cpu,
        };
        Ok((leader, cold))
    }

    /// From the audit log: the operator's writes in `ns` and the moment of its last one.
    fn operator_writes(
        &self,
        leader: &Operator,
        ns: &str,
        acquired: Timestamp,
    ) -> Result<OperatorWrites> {
        let audit = read_namespace(&self.cluster.audit_log, ns)?;
        let leader_writes: Vec<_> = audit
            .iter()
            .filter(|e| {
                e.replica() == Some(leader.config.identity.as_str())
                    && e.is_write()
                    && e.succeeded()
            })
            .filter(|e| e.resource() != "leases" && e.namespace() == ns)
            .collect();
        let count = leader_writes.len();
        let requests = request_breakdown(&audit, Some(&leader.config.identity), ns);
        let done = leader_writes
            .iter()
            .map(|e| e.stage_timestamp)
            .max()
            .context("the operator wrote nothing")?;
        let reconcile_seconds = done.duration_since(acquired).as_secs_f64();
        Ok(OperatorWrites {
            count,
            requests,
            reconcile_seconds,
            per_second: count as f64 / reconcile_seconds,
        })
    }

    fn record_cold_start(
        &mut self,
        n: usize,
        ceiling: &Ceiling,
        ceiling_requests: &Value,
        cold: &ColdStart,
        writes: &OperatorWrites,
    ) {
        let (operator_writes, operator_rate) = (writes.count, writes.per_second);
        let reconcile_seconds = writes.reconcile_seconds;
        let requests = &writes.requests;
        let (ceiling_cpu, cold_start_cpu) = (&ceiling.cpu, &cold.cpu);
        self.report.record(
            "operator_writes_per_second",
            json!(operator_rate),
            format!("operator cold start: {n} MyResources (+{n} Pods) reconciled in {reconcile_seconds:.1} s after acquiring the Lease: {operator_writes} writes, {operator_rate:.0} writes/s, {:.2} reconciles per object", cold.reconciles / (n + PROBES) as f64),
        );
        self.report
            .insert("cold_start_seconds", json!(reconcile_seconds));
        let per_1000 = cold.cpu.seconds_of("operator") / cold.reconciles * 1000.0;
        self.report.record(
            "cpu_seconds_per_1000_reconciles",
            json!(per_1000),
            format!("operator CPU per 1,000 reconciles in the cold start (its initial LISTs included): {per_1000:.2} s"),
        );
        let ratio = operator_rate / ceiling.writes_per_second;
        self.report.record(
            "throughput_ratio",
            json!(ratio),
            format!("throughput ratio operator / ceiling: {ratio:.2}"),
        );
        self.report.record(
            "requests",
            json!({"ceiling": ceiling_requests, "operator": requests}),
            format!("requests by verb, resource and code: ceiling {ceiling_requests}; operator {requests}"),
        );
        self.report.record(
            "cpu_split",
            json!({"ceiling": ceiling_cpu.json(), "operator_cold_start": cold_start_cpu.json()}),
            format!(
                "CPU per process (cores busy on average; the machine has {}): ceiling phase {}; operator cold start (from process start, including its initial LISTs) {}",
                std::thread::available_parallelism().map_or(0, |n| n.get()),
                ceiling_cpu,
                cold_start_cpu
            ),
        );
    }
}

/// The audit log's events in `ns`, without their bodies: at 100,000 objects the whole log
/// with bodies takes more memory than the machine has.
fn read_namespace(path: &std::path::Path, ns: &str) -> Result<e2e::audit::Log> {
    e2e::audit::read_filtered(path, |e| (e.namespace() == ns).then(|| e.without_bodies()))
}

/// Requests in namespace `ns` by one replica (or, for `None`, by clients other than the
/// operator), counted by "verb resource[/subresource] code".
fn request_breakdown(audit: &[AuditEvent], replica: Option<&str>, ns: &str) -> Value {
    let mut counts: std::collections::BTreeMap<String, u64> = Default::default();
    for e in audit.iter().filter(|e| e.namespace() == ns) {
        if e.replica() != replica || e.resource() == "leases" {
            continue;
        }
        let sub = e.object_ref.as_ref().map_or("", |o| o.subresource.as_str());
        let code = e.response_status.as_ref().map_or(0, |s| s.code);
        let resource = if sub.is_empty() {
            e.resource().to_string()
        } else {
            format!("{}/{sub}", e.resource())
        };
        *counts
            .entry(format!("{} {resource} {code}", e.verb))
            .or_default() += 1;
    }
    json!(counts)
}
