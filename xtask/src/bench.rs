//! `cargo xtask bench`: measurements that print numbers and write a report
//! (`target/bench/report.json`, `target/bench/report.md`), all in one run on one local
//! control plane. Timed assertions live nowhere: this only measures.
//!
//! Sections: event-to-status latency at idle; cold start with N MyResources and N labelled
//! Pods; resident memory of leader and followers; SIGKILL failover and SIGTERM handover at
//! two timing sets; takeover time with N objects cached.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use e2e::cluster::{Cluster, ClusterConfig};
use e2e::operator::{Operator, OperatorConfig};
use e2e::process::Lifetime;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use myresource_operator::resource::{MyResource, MyResourceSpec, POD_LABEL};
use serde_json::{Value, json};

/// What to measure and how much.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Objects: MyResources and as many labelled Pods for throughput, takeover and memory.
    #[arg(long, default_value_t = 10_000)]
    pub objects: usize,
    /// SIGKILL failover and SIGTERM handover runs per timing set (15/10/2 s and 4/3/1 s);
    /// 0 skips them.
    #[arg(long, default_value_t = 5)]
    pub failover_runs: usize,
    /// Objects created one by one for the idle latency section.
    #[arg(long, default_value_t = 200)]
    pub latency_objects: usize,
    /// Objects per mode in the telemetry section (exporter off, then on at 100 % sampling);
    /// 0 skips it.
    #[arg(long, default_value_t = 500)]
    pub telemetry_objects: usize,
    /// The cargo profile the operator is built with: `release`, or `profiling` (release with
    /// symbols) to run perf against the replicas.
    #[arg(long, default_value = "release")]
    pub profile: String,
}

struct Bench {
    root: PathBuf,
    cluster: Cluster,
    client: Client,
    binary: PathBuf,
    report: serde_json::Map<String, Value>,
    md: Vec<String>,
}

pub async fn run(root: &Path, args: BenchArgs) -> Result<()> {
    eprintln!(
        "==> building the operator ({} profile) and starting a local control plane",
        args.profile
    );
    let binary = e2e::operator::built_with(&args.profile)?;
    // Replica logs are appended to; an earlier run's lines must not be read as this run's.
    let _ = std::fs::remove_dir_all(root.join("target/bench/logs"));
    let cluster = Cluster::start(ClusterConfig {
        dir: root.join("target/bench/cluster"),
        otlp_endpoint: None,
        lifetime: Lifetime::TiedToThisProcess,
        crds: vec![myresource_operator::resource::crd()],
    })
    .await?;
    let client = cluster.client().await?;
    let mut bench = Bench {
        root: root.to_path_buf(),
        cluster,
        client,
        binary,
        report: serde_json::Map::new(),
        md: vec![
            "# Benchmark report".into(),
            String::new(),
            format!(
                "Machine: {} cores; command: `cargo xtask bench`",
                std::thread::available_parallelism().map_or(0, |n| n.get())
            ),
            String::new(),
        ],
    };
    let result = bench.all(&args).await;
    bench.cluster.stop();
    result?;
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("report.json"),
        serde_json::to_vec_pretty(&Value::Object(bench.report))?,
    )?;
    std::fs::write(dir.join("report.md"), bench.md.join("\n") + "\n")?;
    eprintln!("wrote {}/report.json and report.md", dir.display());
    Ok(())
}

impl Bench {
    async fn all(&mut self, args: &BenchArgs) -> Result<()> {
        self.throughput_and_takeover(args.objects, args.latency_objects)
            .await?;
        self.memory_per_pod(args.objects).await?;
        if args.telemetry_objects > 0 {
            self.telemetry(args.telemetry_objects, 100).await?;
        }
        if args.failover_runs > 0 {
            for (lease, renew, retry) in [(15, 10, 2), (4, 3, 1)] {
                self.failover(args.failover_runs, lease, renew, retry, false)
                    .await?;
            }
            self.failover(args.failover_runs, 15, 10, 2, true).await?;
        }
        Ok(())
    }

    /// CPU seconds used so far by each control-plane component, this process and `extra`.
    fn cpu(&mut self, extra: &[(&str, u32)]) -> Vec<(String, f64)> {
        let mut pids: Vec<(String, u32)> = ["etcd", "kube-apiserver", "kube-controller-manager"]
            .into_iter()
            .filter_map(|name| Some((name.to_string(), self.cluster.process(name)?.pid)))
            .collect();
        pids.push(("bench".into(), std::process::id()));
        pids.extend(extra.iter().map(|(name, pid)| (name.to_string(), *pid)));
        pids.into_iter()
            .map(|(name, pid)| (name, e2e::process::cpu_seconds(pid).unwrap_or(0.0)))
            .collect()
    }

    /// The ceiling's writes for `objects`; returns (writes, seconds, CPU split).
    async fn ceiling(
        &mut self,
        objects: Vec<MyResource>,
        concurrency: usize,
        when: &str,
    ) -> Result<(usize, f64, CpuSplit)> {
        eprintln!(
            "==> write ceiling ({when} the operator): the writes of {} reconciles from a minimal client, {concurrency} at a time",
            objects.len()
        );
        let cpu_before = self.cpu(&[]);
        let started = Instant::now();
        let writes = ceiling_writes(&self.client, objects, concurrency).await?;
        let wall = started.elapsed().as_secs_f64();
        Ok((
            writes,
            wall,
            CpuSplit::between(&cpu_before, &self.cpu(&[]), wall),
        ))
    }

    fn record(&mut self, key: &str, value: Value, line: String) {
        println!("{line}");
        self.md.push(format!("- {line}"));
        self.report.insert(key.into(), value);
    }

    async fn namespace(&self, name: &str) -> Result<String> {
        e2e::cluster::create_namespace(&self.client, name).await?;
        Ok(name.into())
    }

    fn replica(&self, ns: &str, identity: &str, timings: (u64, u64, u64)) -> Result<Operator> {
        Operator::start(self.replica_config(ns, identity, timings))
    }

    fn replica_config(&self, ns: &str, identity: &str, timings: (u64, u64, u64)) -> OperatorConfig {
        OperatorConfig {
            identity: identity.into(),
            kubeconfig: self.cluster.kubeconfig.clone(),
            namespaces: vec![ns.into()],
            log_dir: self.root.join("target/bench/logs"),
            extra_args: vec![
                format!("--lease-namespace={ns}"),
                format!("--lease-duration={}s", timings.0),
                format!("--renew-deadline={}s", timings.1),
                format!("--retry-period={}s", timings.2),
            ],
            binary: Some(self.binary.clone()),
            env: Vec::new(),
        }
    }

    /// Throughput, latency and memory with the OTLP exporter off and on (100 % sampling into
    /// a local Jaeger), side by side in one run.
    async fn telemetry(&mut self, n: usize, latency_objects: usize) -> Result<()> {
        eprintln!(
            "==> telemetry: {n} objects cold, then {latency_objects} one at a time, exporter off and on"
        );
        let jaeger = e2e::jaeger::Jaeger::start(
            &self.root.join("target/bench/jaeger"),
            Lifetime::TiedToThisProcess,
        )
        .await?;
        let mut modes = Vec::new();
        for exporting in [false, true] {
            let mode = if exporting { "on" } else { "off" };
            let ns = self.namespace(&format!("bench-otel-{mode}")).await?;
            create_objects(&self.client, &ns, n, false).await?;
            let mut config = self.replica_config(&ns, &format!("otel-{mode}"), (15, 10, 2));
            if exporting {
                config.env = vec![
                    (
                        "OTEL_EXPORTER_OTLP_ENDPOINT".into(),
                        format!("http://{}", jaeger.otlp_grpc),
                    ),
                    ("OTEL_TRACES_SAMPLER".into(), "always_on".into()),
                ];
            }
            let started = Instant::now();
            let mut op = Operator::start(config)?;
            let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), &ns);
            wait_all_ready(&op, &mrs, n).await?;
            let throughput = n as f64 / started.elapsed().as_secs_f64();
            op.wait_ready().await?;
            let samples = sequential_latency(&self.client, &ns, "t", latency_objects).await?;
            tokio::time::sleep(Duration::from_secs(3)).await;
            let rss = op.rss_bytes().unwrap_or(0) as f64 / 1048576.0;
            op.stop();
            modes.push(json!({
                "exporter": mode,
                "objects_per_second": throughput,
                "event_to_status_ms": {"p50": percentile(&samples, 50.0), "p99": percentile(&samples, 99.0)},
                "rss_mib": rss,
            }));
        }
        let (off, on) = (&modes[0], &modes[1]);
        let line = format!(
            "telemetry, exporter off vs on (100 % sampling): cold throughput {:.0} vs {:.0} objects/s; event → status median {:.1} vs {:.1} ms, p99 {:.1} vs {:.1} ms; RSS {:.1} vs {:.1} MiB",
            off["objects_per_second"].as_f64().unwrap_or(0.0),
            on["objects_per_second"].as_f64().unwrap_or(0.0),
            off["event_to_status_ms"]["p50"].as_f64().unwrap_or(0.0),
            on["event_to_status_ms"]["p50"].as_f64().unwrap_or(0.0),
            off["event_to_status_ms"]["p99"].as_f64().unwrap_or(0.0),
            on["event_to_status_ms"]["p99"].as_f64().unwrap_or(0.0),
            off["rss_mib"].as_f64().unwrap_or(0.0),
            on["rss_mib"].as_f64().unwrap_or(0.0),
        );
        self.record("telemetry", json!({"objects": n, "modes": modes}), line);
        let mut jaeger = jaeger;
        jaeger.process.stop(Duration::from_secs(5));
        Ok(())
    }

    /// The API server's write ceiling, the operator's cold start against it, event →
    /// reconcile-start latency under load and idle, takeover with N objects cached, and the
    /// memory of leader and follower.
    async fn throughput_and_takeover(&mut self, n: usize, latency_objects: usize) -> Result<()> {
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
        let mut ceiling_objects = Api::<MyResource>::namespaced(self.client.clone(), &ceiling_ns)
            .list(&Default::default())
            .await?
            .items;
        let second_half = ceiling_objects.split_off(n / 2);
        let before = self.ceiling(ceiling_objects, concurrency, "before").await?;

        eprintln!("==> operator cold start with {n} objects (probes measure latency under load)");
        let mut leader = self.replica(&ns, "throughput-a", (15, 10, 2))?;
        let operator_pid = [("operator", leader.process.pid)];
        let cpu_before = self.cpu(&operator_pid);
        let started = Instant::now();
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), &ns);
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
        let cold_start_cpu = CpuSplit::between(
            &cpu_before,
            &self.cpu(&operator_pid),
            started.elapsed().as_secs_f64(),
        );
        let probe_starts = probes.await??;
        let after = self.ceiling(second_half, concurrency, "after").await?;
        let ceiling_wall = before.1 + after.1;
        let ceiling = (before.0 + after.0) as f64 / ceiling_wall;
        let ceiling_cpu = CpuSplit::combine(&before.2, &after.2);
        let ceiling_requests = {
            let audit = e2e::audit::read(&self.cluster.audit_log)?;
            request_breakdown(&audit, None, &ceiling_ns)
        };
        // From the audit log: the operator's writes and the moment of its last one.
        let audit = e2e::audit::read(&self.cluster.audit_log)?;
        let leader_writes: Vec<_> = audit
            .iter()
            .filter(|e| {
                e.replica() == Some(leader.config.identity.as_str())
                    && e.is_write()
                    && e.succeeded()
            })
            .filter(|e| e.resource() != "leases" && e.namespace() == ns)
            .collect();
        let operator_writes = leader_writes.len();
        let requests = request_breakdown(&audit, Some(&leader.config.identity), &ns);
        let done = leader_writes
            .iter()
            .map(|e| e.stage_timestamp)
            .max()
            .context("the operator wrote nothing")?;
        let reconcile_seconds = done.duration_since(acquired).as_secs_f64();
        let operator_rate = operator_writes as f64 / reconcile_seconds;
        let under_load = latencies(&leader, &probe_starts);

        eprintln!("==> event → reconcile start, idle: {latency_objects} objects one at a time");
        let idle_starts = create_spaced(
            mrs.clone(),
            "idle",
            latency_objects,
            Duration::from_millis(20),
        )
        .await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let idle = latencies(&leader, &idle_starts);

        eprintln!(
            "==> takeover with {} objects cached",
            n + latency_objects + probe_starts.len()
        );
        let mut follower = self.replica(&ns, "throughput-b", (15, 10, 2))?;
        follower.wait_ready().await?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss_follower = follower.rss_bytes().unwrap_or(0);
        let rss_leader_before = leader.rss_bytes().unwrap_or(0);
        leader.stop();
        let expected = count_all(&mrs).await?;
        let lines = e2e::wait::poll("the takeover to drain", Duration::from_secs(600), || {
            let lines = follower.log_lines();
            async move {
                let keys: std::collections::HashSet<&str> = lines
                    .iter()
                    .filter(|l| l["message"] == "reconciled")
                    .filter_map(|l| l["myresource"].as_str())
                    .collect();
                Ok((keys.len() >= expected).then_some(lines.clone()))
            }
        })
        .await?;
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
        let drain = reconciled[reconciled.len() - 1]
            .duration_since(took_over)
            .as_secs_f64();
        let audit = e2e::audit::read(&self.cluster.audit_log)?;
        let takeover_writes = audit
            .iter()
            .filter(|e| {
                e.replica() == Some(follower.config.identity.as_str())
                    && e.is_write()
                    && e.resource() != "leases"
            })
            .count();
        let takeover_lists = audit
            .iter()
            .filter(|e| {
                e.replica() == Some(follower.config.identity.as_str())
                    && e.verb == "list"
                    && e.request_received_timestamp > took_over
            })
            .count();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss_leader = follower.rss_bytes().unwrap_or(0);

        let mib = |b: u64| b as f64 / 1048576.0;
        self.report.insert("objects".into(), json!(n));
        self.record(
            "ceiling_writes_per_second",
            json!(ceiling),
            format!(
                "API server write ceiling (a minimal client, the writes of {n} reconciles, {concurrency} at a time, half before and half after the operator's cold start): {ceiling:.0} writes/s ({:.0} before, {:.0} after)",
                before.0 as f64 / before.1,
                after.0 as f64 / after.1
            ),
        );
        self.record(
            "operator_writes_per_second",
            json!(operator_rate),
            format!("operator cold start: {n} MyResources (+{n} Pods) reconciled in {reconcile_seconds:.1} s after acquiring the Lease: {operator_writes} writes, {operator_rate:.0} writes/s, {:.2} reconciles per object", reconciles / (n + PROBES) as f64),
        );
        let ratio = operator_rate / ceiling;
        self.record(
            "throughput_ratio",
            json!(ratio),
            format!("throughput ratio operator / ceiling: {ratio:.2}"),
        );
        self.record(
            "requests",
            json!({"ceiling": ceiling_requests, "operator": requests}),
            format!("requests by verb, resource and code: ceiling {ceiling_requests}; operator {requests}"),
        );
        self.record(
            "cpu_split",
            json!({"ceiling": ceiling_cpu.json(), "operator_cold_start": cold_start_cpu.json()}),
            format!(
                "CPU per process (cores busy on average; the machine has {}): ceiling phase {}; operator cold start (from process start, including its initial LISTs) {}",
                std::thread::available_parallelism().map_or(0, |n| n.get()),
                ceiling_cpu,
                cold_start_cpu
            ),
        );
        let (e2e_idle, op_idle) = (idle.end_to_end, idle.in_operator);
        let (e2e_load, op_load) = (under_load.end_to_end, under_load.in_operator);
        self.record(
            "event_to_reconcile_ms",
            json!({
                "p50": e2e_idle.0, "p99": e2e_idle.1,
                "idle": {"create_to_start": {"p50": e2e_idle.0, "p99": e2e_idle.1}, "watch_event_to_start": {"p50": op_idle.0, "p99": op_idle.1}, "samples": idle_starts.len()},
                "under_load": {"create_to_start": {"p50": e2e_load.0, "p99": e2e_load.1}, "watch_event_to_start": {"p50": op_load.0, "p99": op_load.1}, "samples": probe_starts.len()},
            }),
            format!(
                "event → reconcile start, idle ({} samples): from the create p50 {:.1} ms, p99 {:.1} ms; from the watch event p50 {:.2} ms, p99 {:.2} ms. Under the cold-start load ({} samples, FIFO behind {n} keys): from the create p50 {:.0} ms, p99 {:.0} ms",
                idle_starts.len(), e2e_idle.0, e2e_idle.1, op_idle.0, op_idle.1, probe_starts.len(), e2e_load.0, e2e_load.1
            ),
        );
        self.record("takeover_first_reconcile_ms", json!(first_ms), format!("takeover with {expected} objects cached: first reconcile {first_ms:.1} ms after acquiring"));
        self.record(
            "takeover_drain_seconds",
            json!(drain),
            format!("takeover: every key reconciled {drain:.2} s after acquiring; {takeover_writes} writes and {takeover_lists} LIST requests by the new leader"),
        );
        self.record("rss_bytes_leader", json!(rss_leader), format!("resident memory, leader after the takeover: {:.1} MiB (the old leader before it: {:.1} MiB)", mib(rss_leader), mib(rss_leader_before)));
        self.record("rss_bytes_follower", json!(rss_follower), format!("resident memory, follower with {n} MyResources, {n} ConfigMaps and {n} Pods cached: {:.1} MiB", mib(rss_follower)));
        follower.stop();
        Ok(())
    }

    /// A follower's memory per cached Pod: a follower watching N labelled Pods against one
    /// watching an empty namespace, side by side.
    async fn memory_per_pod(&mut self, n: usize) -> Result<()> {
        eprintln!("==> memory per cached Pod: {n} Pods against an empty namespace");
        let pods_ns = self.namespace("bench-pods").await?;
        let empty_ns = self.namespace("bench-empty").await?;
        create_pods(&self.client, &pods_ns, n).await?;
        // A leader in each namespace, so the measured replicas are followers.
        let mut leaders = Vec::new();
        let mut followers = Vec::new();
        for ns in [&pods_ns, &empty_ns] {
            let mut leader = self.replica(ns, &format!("{ns}-leader"), (15, 10, 2))?;
            leader.wait_ready().await?;
            wait_leading(&self.client, ns).await?;
            leaders.push(leader);
            let mut follower = self.replica(ns, &format!("{ns}-follower"), (15, 10, 2))?;
            follower.wait_ready().await?;
            followers.push(follower);
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        let with_pods = followers[0].rss_bytes().unwrap_or(0) as f64;
        let empty = followers[1].rss_bytes().unwrap_or(0) as f64;
        let per_pod = (with_pods - empty) / n as f64;
        self.record(
            "rss_bytes_per_cached_object",
            json!(per_pod),
            format!(
                "follower memory per cached Pod: {per_pod:.0} bytes ({:.1} MiB with {n} Pods vs {:.1} MiB with none)",
                with_pods / 1048576.0,
                empty / 1048576.0
            ),
        );
        Ok(())
    }

    /// Kill (or terminate) the leader `runs` times; time from the fault to the new leader's
    /// first reconcile.
    async fn failover(
        &mut self,
        runs: usize,
        lease: u64,
        renew: u64,
        retry: u64,
        graceful: bool,
    ) -> Result<()> {
        let kind = if graceful { "handover" } else { "failover" };
        eprintln!("==> {kind}: {runs} runs at {lease}/{renew}/{retry} s");
        let ns = self.namespace(&format!("bench-{kind}-{lease}")).await?;
        create_objects(&self.client, &ns, 10, false).await?;
        let timings = (lease, renew, retry);
        let mut replicas = Vec::new();
        for i in 0..3 {
            replicas.push(self.replica(&ns, &format!("{kind}-{lease}-{i}"), timings)?);
        }
        for r in &mut replicas {
            r.wait_ready().await?;
        }
        let mut samples = Vec::new();
        let mut from_exit = Vec::new();
        for run in 0..runs {
            let holder = wait_leading(&self.client, &ns).await?;
            let leader = replicas
                .iter()
                .position(|r| r.config.identity == holder)
                .context("leader is one of ours")?;
            // Let followers observe a fresh renew, as in steady state.
            tokio::time::sleep(Duration::from_secs(retry)).await;
            let fault = Timestamp::now();
            if graceful {
                replicas[leader].stop();
            } else {
                replicas[leader].kill();
            }
            let exited = Timestamp::now();
            let first =
                first_reconcile_after(&replicas, leader, fault, Duration::from_secs(lease * 3))
                    .await?;
            samples.push(first.duration_since(fault).as_secs_f64());
            from_exit.push(first.duration_since(exited).as_secs_f64());
            let mut fresh =
                self.replica(&ns, &format!("{kind}-{lease}-{}-{run}", leader), timings)?;
            fresh.wait_ready().await?;
            replicas[leader] = fresh;
        }
        let stats = summary(&samples);
        let exit_stats = summary(&from_exit);
        let what = if graceful {
            "SIGTERM handover"
        } else {
            "SIGKILL failover"
        };
        self.record(
            &format!("{kind}_{lease}_{renew}_{retry}_seconds"),
            json!({"runs": runs, "from_signal": stats, "from_exit": exit_stats}),
            format!(
                "{what} at {lease}/{renew}/{retry} s, {runs} runs, signal → new leader's first reconcile: min {:.3} s, median {:.3} s, p99 {:.3} s (from the old process's exit: median {:.3} s)",
                stats["min"], stats["median"], stats["p99"], exit_stats["median"]
            ),
        );
        Ok(())
    }
}

/// Creates `count` objects one at a time (20 ms apart) and returns each one's create →
/// Ready-status latency in milliseconds.
async fn sequential_latency(
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
async fn create_spaced(
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
/// the watch), and from the watch event's "enqueued" line to it (the operator's own part).
struct Latency {
    end_to_end: (f64, f64),
    in_operator: (f64, f64),
}

fn latencies(op: &Operator, starts: &[(String, Timestamp)]) -> Latency {
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
    Latency {
        end_to_end: pair(
            starts
                .iter()
                .filter_map(|(n, at)| started.get(n).map(|s| ms(*at, *s)))
                .collect(),
        ),
        in_operator: pair(
            starts
                .iter()
                .filter_map(|(n, _)| Some(ms(*enqueued.get(n)?, *started.get(n)?)))
                .collect(),
        ),
    }
}

fn stamp(line: &Value) -> Option<Timestamp> {
    line["timestamp"].as_str().and_then(|t| t.parse().ok())
}

/// The writes a reconcile makes (create the ConfigMap, patch status with a resourceVersion
/// precondition, create an Event), for `n` objects, `concurrency` at a time; returns the
/// number of successful writes.
async fn ceiling_writes(
    client: &Client,
    objects: Vec<MyResource>,
    concurrency: usize,
) -> Result<usize> {
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::api::events::v1::Event;
    let ns = objects
        .first()
        .and_then(|o| o.metadata.namespace.clone())
        .unwrap_or_default();
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), &ns);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let results: Vec<usize> = futures::stream::iter(objects)
        .map(|mr| {
            let (mrs, cms, events) = (mrs.clone(), cms.clone(), events.clone());
            async move {
                let desired = myresource_operator::reconcile::desired_configmap(&mr);
                let name = mr.metadata.name.clone().unwrap_or_default();
                cms.create(&PostParams::default(), &desired).await?;
                let status = myresource_operator::reconcile::desired_status(&mr, Default::default(), None, &[], Timestamp::now());
                let patch = json!({"metadata": {"resourceVersion": mr.metadata.resource_version}, "status": status});
                mrs.patch_status(&name, &Default::default(), &kube::api::Patch::Merge(&patch)).await?;
                let event: Event = serde_json::from_value(json!({
                    "metadata": {"name": format!("{name}.ceiling")},
                    "eventTime": Timestamp::now().to_string(),
                    "reportingController": "bench-ceiling", "reportingInstance": "bench",
                    "action": "Reconcile", "reason": "ConfigMapCreated", "type": "Normal",
                    "note": format!("ConfigMap {name} created"),
                    "regarding": {"apiVersion": "trstringer.com/v1", "kind": "MyResource", "name": name, "namespace": mr.metadata.namespace, "uid": mr.metadata.uid},
                }))?;
                events.create(&PostParams::default(), &event).await?;
                anyhow::Ok(3)
            }
        })
        .buffer_unordered(concurrency)
        .try_collect()
        .await?;
    Ok(results.iter().sum())
}

/// CPU used by each process over a phase, as average cores busy.
struct CpuSplit {
    wall_seconds: f64,
    cores: Vec<(String, f64)>,
}

impl CpuSplit {
    fn between(before: &[(String, f64)], after: &[(String, f64)], wall_seconds: f64) -> CpuSplit {
        let cores = after
            .iter()
            .map(|(name, cpu)| {
                let start = before.iter().find(|(n, _)| n == name).map_or(0.0, |b| b.1);
                (name.clone(), (cpu - start) / wall_seconds)
            })
            .collect();
        CpuSplit {
            wall_seconds,
            cores,
        }
    }

    /// Two phases as one: CPU and wall time added up.
    fn combine(a: &CpuSplit, b: &CpuSplit) -> CpuSplit {
        let wall_seconds = a.wall_seconds + b.wall_seconds;
        let cores = a
            .cores
            .iter()
            .map(|(name, cores)| {
                let other = b.cores.iter().find(|(n, _)| n == name).map_or(0.0, |c| c.1);
                let cpu = cores * a.wall_seconds + other * b.wall_seconds;
                (name.clone(), cpu / wall_seconds)
            })
            .collect();
        CpuSplit {
            wall_seconds,
            cores,
        }
    }

    fn json(&self) -> Value {
        let cores: serde_json::Map<String, Value> = self
            .cores
            .iter()
            .map(|(n, c)| (n.clone(), json!(c)))
            .collect();
        json!({"wall_seconds": self.wall_seconds, "cores": cores})
    }
}

impl std::fmt::Display for CpuSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "over {:.1} s:", self.wall_seconds)?;
        for (name, cores) in &self.cores {
            write!(f, " {name} {cores:.2}")?;
        }
        write!(
            f,
            " (total {:.2})",
            self.cores.iter().map(|c| c.1).sum::<f64>()
        )
    }
}

async fn count_all(mrs: &Api<MyResource>) -> Result<usize> {
    Ok(mrs.list(&Default::default()).await?.items.len())
}

/// Creates `n` labelled Pods, 32 at a time.
async fn create_pods(client: &Client, ns: &str, n: usize) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    futures::stream::iter(0..n)
        .map(|i| {
            let pods = pods.clone();
            async move {
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("p{i}"), "labels": {POD_LABEL: format!("o{i}")}},
                    "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}]}
                }))?;
                pods.create(&PostParams::default(), &pod).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

fn mr(name: &str, i: usize) -> MyResource {
    MyResource::new(
        name,
        MyResourceSpec {
            message: format!("message {i}"),
            some_value: i as i32,
        },
    )
}

/// Creates `n` MyResources `o{i}` (and a labelled Pod `p{i}` for each when `pods`), 32 at
/// a time.
async fn create_objects(client: &Client, ns: &str, n: usize, pods: bool) -> Result<()> {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), ns);
    futures::stream::iter(0..n)
        .map(|i| {
            let mrs = mrs.clone();
            async move {
                mrs.create(&PostParams::default(), &mr(&format!("o{i}"), i))
                    .await
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    if pods {
        create_pods(client, ns, n).await?;
    }
    Ok(())
}

/// Waits until `n` MyResources are Ready. Listing thousands of objects is itself heavy load
/// on the API server, which must not slow down what is being measured: so this watches the
/// operator's own metrics (at least `n` successful reconciles, an empty queue) and lists
/// only to confirm.
async fn wait_all_ready(op: &Operator, mrs: &Api<MyResource>, n: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        anyhow::ensure!(
            Instant::now() < deadline,
            "objects not all Ready after 900 s"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        if metric_sum(op, SUCCESSES).await? >= n as f64
            && metric_sum(op, "workqueue_depth{").await? == 0.0
            && count_ready(mrs).await? >= n
        {
            return Ok(());
        }
    }
}

/// Objects created during the cold start, 200 ms apart, to measure latency under load.
const PROBES: usize = 20;

const SUCCESSES: &str =
    "controller_runtime_reconcile_total{controller=\"myresource\",result=\"success\"}";

/// The sum of a replica's metric samples whose line starts with `prefix`.
async fn metric_sum(op: &Operator, prefix: &str) -> Result<f64> {
    let (_, text) = e2e::operator::http_get(op.metrics, "/metrics").await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// Requests in namespace `ns` by one replica (or, for `None`, by clients other than the
/// operator), counted by "verb resource[/subresource] code".
fn request_breakdown(audit: &[e2e::audit::AuditEvent], replica: Option<&str>, ns: &str) -> Value {
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

async fn count_ready(mrs: &Api<MyResource>) -> Result<usize> {
    Ok(mrs
        .list(&Default::default())
        .await?
        .items
        .iter()
        .filter(|m| {
            m.status.as_ref().is_some_and(|s| {
                s.observed_generation == m.metadata.generation
                    && s.conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
            })
        })
        .count())
}

/// The Lease holder, once there is one.
async fn wait_leading(client: &Client, ns: &str) -> Result<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    e2e::wait::poll("a leader", Duration::from_secs(60), || {
        let leases = leases.clone();
        async move {
            Ok(leases
                .get_opt("myresource-operator")
                .await?
                .and_then(|l| l.spec?.holder_identity)
                .filter(|h| !h.is_empty()))
        }
    })
    .await
}

/// The earliest "reconciled" log line after `after` in any replica but `except`.
async fn first_reconcile_after(
    replicas: &[Operator],
    except: usize,
    after: Timestamp,
    limit: Duration,
) -> Result<Timestamp> {
    e2e::wait::poll("the new leader's first reconcile", limit, || {
        let found = replicas
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != except)
            .flat_map(|(_, r)| r.log_lines())
            .filter(|l| l["message"] == "reconciled")
            .filter_map(|l| {
                l["timestamp"]
                    .as_str()
                    .and_then(|t| t.parse::<Timestamp>().ok())
            })
            .filter(|t| *t > after)
            .min();
        async move { Ok(found) }
    })
    .await
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

fn percentile(samples: &[f64], p: f64) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn summary(samples: &[f64]) -> Value {
    json!({
        "min": percentile(samples, 0.0),
        "median": percentile(samples, 50.0),
        "p99": percentile(samples, 99.0),
        "max": percentile(samples, 100.0),
        "samples": samples,
    })
}
