//! `cargo xtask bench`: measurements that print numbers and write a report
//! (`target/bench/report.json`, `target/bench/report.md`), all in one run on one local
//! control plane. Timed assertions live nowhere: this only measures.
//!
//! Sections: event-to-status latency at idle; cold start with N MyResources and N labelled
//! Pods; resident memory of leader and followers; SIGKILL failover and SIGTERM handover at
//! two timing sets; takeover time with N objects cached.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use e2e::cluster::{Cluster, ClusterConfig};
use e2e::operator::{Operator, OperatorConfig};
use e2e::process::Lifetime;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use myresource_operator::resource::{MyResource, MyResourceSpec, POD_LABEL};
use serde_json::{Value, json};

/// What to measure and how much.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Objects for the cold-start and memory sections.
    #[arg(long, default_value_t = 1000)]
    pub objects: usize,
    /// Objects cached at takeover (repeat the flag for several sizes).
    #[arg(long = "takeover-objects", default_values_t = [1000, 10000])]
    pub takeover_objects: Vec<usize>,
    /// Failover and handover runs per timing set.
    #[arg(long, default_value_t = 20)]
    pub runs: usize,
    /// Objects created one by one for the latency section.
    #[arg(long, default_value_t = 200)]
    pub latency_objects: usize,
    /// Objects per mode in the telemetry section (exporter off, then on at 100 % sampling).
    #[arg(long, default_value_t = 500)]
    pub telemetry_objects: usize,
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
    eprintln!("==> building the release binary and starting a local control plane");
    let binary = e2e::operator::release_binary()?;
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
        self.telemetry(args.telemetry_objects, 100).await?;
        self.latency(args.latency_objects).await?;
        self.cold_start(args.objects).await?;
        for (lease, renew, retry) in [(15, 10, 2), (4, 3, 1)] {
            self.failover(args.runs, lease, renew, retry, false).await?;
        }
        self.failover(args.runs, 15, 10, 2, true).await?;
        for &n in &args.takeover_objects {
            self.takeover(n).await?;
        }
        Ok(())
    }

    fn record(&mut self, key: &str, value: Value, line: String) {
        println!("{line}");
        self.md.push(format!("- {line}"));
        self.report.insert(key.into(), value);
    }

    async fn namespace(&self, name: &str) -> Result<String> {
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await?;
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

    /// Event (create) to Ready status, one object at a time on an idle operator.
    async fn latency(&mut self, count: usize) -> Result<()> {
        eprintln!("==> latency: {count} objects created one at a time");
        let ns = self.namespace("bench-latency").await?;
        let mut op = self.replica(&ns, "latency", (15, 10, 2))?;
        op.wait_ready().await?;
        wait_leading(&self.client, &ns).await?;
        let samples = sequential_latency(&self.client, &ns, "l", count).await?;
        let (p50, p99) = (percentile(&samples, 50.0), percentile(&samples, 99.0));
        self.record(
            "event_to_status_ms",
            json!({"p50": p50, "p99": p99, "samples": count}),
            format!(
                "event → Ready status ({count} objects, idle): median {p50:.1} ms, p99 {p99:.1} ms"
            ),
        );
        Ok(())
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
            e2e::wait::poll("every object reconciled", Duration::from_secs(600), || {
                let mrs = mrs.clone();
                async move { Ok((count_ready(&mrs).await? == n).then_some(())) }
            })
            .await?;
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

    /// N MyResources and N labelled Pods exist before the operator starts.
    async fn cold_start(&mut self, n: usize) -> Result<()> {
        eprintln!("==> cold start: {n} MyResources and {n} labelled Pods");
        let ns = self.namespace("bench-cold").await?;
        create_objects(&self.client, &ns, n, true).await?;
        let started = Instant::now();
        let mut leader = self.replica(&ns, "cold-leader", (15, 10, 2))?;
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), &ns);
        e2e::wait::poll("every object reconciled", Duration::from_secs(600), || {
            let mrs = mrs.clone();
            async move { Ok((count_ready(&mrs).await? == n).then_some(())) }
        })
        .await?;
        let took = started.elapsed().as_secs_f64();
        self.record(
            "cold_start_seconds",
            json!({"objects": n, "seconds": took, "objects_per_second": n as f64 / took}),
            format!("cold start: {n} MyResources (+{n} Pods) reconciled in {took:.1} s ({:.0}/s), from process start", n as f64 / took),
        );
        // Two followers with the same caches, then everyone idles a moment.
        let mut followers = vec![
            self.replica(&ns, "cold-follower-1", (15, 10, 2))?,
            self.replica(&ns, "cold-follower-2", (15, 10, 2))?,
        ];
        for f in &mut followers {
            f.wait_ready().await?;
        }
        leader.wait_ready().await?;
        tokio::time::sleep(Duration::from_secs(5)).await;
        let mib = |b: Option<u64>| b.unwrap_or(0) as f64 / 1048576.0;
        let (l, f1, f2) = (
            mib(leader.rss_bytes()),
            mib(followers[0].rss_bytes()),
            mib(followers[1].rss_bytes()),
        );
        self.record(
            "rss_mib",
            json!({"objects": n, "leader": l, "followers": [f1, f2]}),
            format!("resident memory, idle, {n} MyResources + {n} ConfigMaps + {n} Pods cached: leader {l:.1} MiB, followers {f1:.1} and {f2:.1} MiB"),
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

    /// With N objects cached and reconciled, the follower takes over on SIGTERM: time from
    /// acquiring to the first reconcile and to the last key drained.
    async fn takeover(&mut self, n: usize) -> Result<()> {
        eprintln!("==> takeover with {n} objects cached");
        let ns = self.namespace(&format!("bench-takeover-{n}")).await?;
        create_objects(&self.client, &ns, n, false).await?;
        let mut first = self.replica(&ns, &format!("takeover-{n}-a"), (15, 10, 2))?;
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), &ns);
        e2e::wait::poll("every object reconciled", Duration::from_secs(900), || {
            let mrs = mrs.clone();
            async move { Ok((count_ready(&mrs).await? == n).then_some(())) }
        })
        .await?;
        let mut second = self.replica(&ns, &format!("takeover-{n}-b"), (15, 10, 2))?;
        second.wait_ready().await?;
        let follower_rss = second.rss_bytes().unwrap_or(0);
        first.stop();
        let lines = e2e::wait::poll("the takeover to drain", Duration::from_secs(600), || {
            let lines = second.log_lines();
            async move {
                let keys: HashSet<&str> = lines
                    .iter()
                    .filter(|l| l["message"] == "reconciled")
                    .filter_map(|l| l["myresource"].as_str())
                    .collect();
                Ok((keys.len() >= n).then_some(lines.clone()))
            }
        })
        .await?;
        let stamp = |l: &Value| {
            l["timestamp"]
                .as_str()
                .and_then(|t| t.parse::<Timestamp>().ok())
        };
        let acquired = lines
            .iter()
            .find(|l| l["message"] == "acquired the Lease: leading")
            .and_then(stamp)
            .context("acquired line")?;
        let reconciled: Vec<Timestamp> = lines
            .iter()
            .filter(|l| l["message"] == "reconciled")
            .filter_map(stamp)
            .collect();
        let first_ms = reconciled[0].duration_since(acquired).as_secs_f64() * 1000.0;
        let drain = reconciled[reconciled.len() - 1]
            .duration_since(acquired)
            .as_secs_f64();
        let writes = lines
            .iter()
            .filter(|l| {
                matches!(
                    l["message"].as_str(),
                    Some("ConfigMap created" | "ConfigMap updated")
                )
            })
            .count();
        self.record(
            &format!("takeover_{n}"),
            json!({"objects": n, "first_reconcile_ms": first_ms, "drain_seconds": drain, "configmap_writes": writes, "follower_rss_bytes": follower_rss}),
            format!(
                "takeover with {n} objects cached: first reconcile {first_ms:.1} ms after acquiring, last key drained after {drain:.2} s, ConfigMap writes {writes}; follower RSS before takeover {:.1} MiB",
                follower_rss as f64 / 1048576.0
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

fn mr(name: &str, i: usize) -> MyResource {
    MyResource::new(
        name,
        MyResourceSpec {
            message: format!("message {i}"),
            some_value: i as i32,
        },
    )
}

/// Creates `n` MyResources `o{i}` (and a labelled Pod for each when `pods`), 32 at a time.
async fn create_objects(client: &Client, ns: &str, n: usize, pods: bool) -> Result<()> {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), ns);
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), ns);
    futures::stream::iter(0..n)
        .map(|i| {
            let (mrs, pod_api) = (mrs.clone(), pod_api.clone());
            async move {
                mrs.create(&PostParams::default(), &mr(&format!("o{i}"), i)).await?;
                if pods {
                    let pod: Pod = serde_json::from_value(json!({
                        "metadata": {"name": format!("p{i}"), "labels": {POD_LABEL: format!("o{i}")}},
                        "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}]}
                    }))?;
                    pod_api.create(&PostParams::default(), &pod).await?;
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
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
