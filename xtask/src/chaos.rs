//! `cargo xtask chaos`: three replicas, a steady bounded workload, and one fault per round
//! chosen by a seed; after every round it checks that exactly one replica leads, measures the
//! failover, and at the end proves from the API server's audit log that no replica wrote
//! after another had acquired the Lease, that no update was lost, and that nothing panicked.
//! Writes `target/chaos/report.json`, `report.md` and `timeline.svg`; fails when a check does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use e2e::audit;
use e2e::cluster::{Cluster, ClusterConfig};
use e2e::operator::{Operator, OperatorConfig, http_get};
use e2e::process::Lifetime;
use e2e::proxy::Proxy;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use myresource_operator::resource::{MyResource, MyResourceSpec, POD_LABEL};
use serde_json::{Value, json};

const NAMESPACE: &str = "chaos";
const LEASE: &str = "myresource-operator";
/// Short timings so a round takes seconds: 4 s lease, 3 s renew deadline, 1 s retry.
const TIMINGS: [&str; 3] = [
    "--lease-duration=4s",
    "--renew-deadline=3s",
    "--retry-period=1s",
];
const LEASE_DURATION: Duration = Duration::from_secs(4);

#[derive(Debug, Clone, clap::Args)]
pub struct ChaosArgs {
    /// Rounds, one fault each.
    #[arg(long, default_value_t = 50)]
    pub rounds: usize,
    /// Seed for the choice of faults and the workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// The faults, in the order a seed indexes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    LeaderKill,
    LeaderTerm,
    LeaderFreeze,
    LeaderPartition,
    FollowerKill,
    ApiserverRestart,
}

const FAULTS: [Fault; 6] = [
    Fault::LeaderKill,
    Fault::LeaderTerm,
    Fault::LeaderFreeze,
    Fault::LeaderPartition,
    Fault::FollowerKill,
    Fault::ApiserverRestart,
];

impl Fault {
    fn kind(self) -> &'static str {
        match self {
            Fault::LeaderKill => "leader_sigkill",
            Fault::LeaderTerm => "leader_sigterm",
            Fault::LeaderFreeze => "leader_sigstop",
            Fault::LeaderPartition => "leader_partition",
            Fault::FollowerKill => "follower_sigkill",
            Fault::ApiserverRestart => "apiserver_restart",
        }
    }
}

/// The fault of every round: each block of six rounds has every kind once, in an order the
/// seed shuffles, so even a short run covers all of them.
fn schedule(seed: u64, rounds: usize) -> Vec<Fault> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(rounds);
    while out.len() < rounds {
        let mut block = FAULTS;
        for i in (1..block.len()).rev() {
            block.swap(i, rng.below(i + 1));
        }
        out.extend(block);
    }
    out.truncate(rounds);
    out
}

/// xorshift64*: a small deterministic generator, enough to pick faults and workload steps.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }
}

/// One replica slot: its proxy to the API server and the process currently in it.
struct Slot {
    proxy: Proxy,
    operator: Operator,
    generation: usize,
}

struct Chaos {
    root: PathBuf,
    cluster: Cluster,
    client: Client,
    slots: Vec<Slot>,
    /// Log files of every replica ever started, for the panic check.
    logs: Vec<PathBuf>,
    rng: Rng,
}

pub async fn run(root: &Path, args: ChaosArgs) -> Result<()> {
    let out = root.join("target/chaos");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    eprintln!("==> starting a local control plane and three replicas");
    let cluster = Cluster::start(ClusterConfig {
        dir: out.join("cluster"),
        otlp_endpoint: None,
        lifetime: Lifetime::TiedToThisProcess,
        crds: vec![myresource_operator::resource::crd()],
    })
    .await?;
    let client = cluster.client().await?;
    e2e::cluster::create_namespace(&client, NAMESPACE).await?;
    let mut chaos = Chaos {
        root: root.to_path_buf(),
        cluster,
        client,
        slots: Vec::new(),
        logs: Vec::new(),
        rng: Rng::new(args.seed),
    };
    let result = chaos.rounds(&args, &out).await;
    // Keep the audit log and replica logs; stop the processes.
    for slot in &mut chaos.slots {
        slot.operator.stop();
    }
    let audit_copy = out.join("audit.log");
    let _ = std::fs::copy(&chaos.cluster.audit_log, &audit_copy);
    chaos.cluster.stop();
    let report = result?;
    let failed = report["overlapping_leadership_writes"] != 0
        || report["lost_updates"] != 0
        || report["panics"] != 0
        || report["unexpected_exits"] != 0
        || report["rounds_without_single_leader"] != 0;
    if failed {
        bail!("chaos checks failed; see {}/report.md", out.display());
    }
    eprintln!("chaos checks passed; see {}/report.md", out.display());
    Ok(())
}

impl Chaos {
    fn replica_config(
        &self,
        slot: usize,
        generation: usize,
        proxy: &Proxy,
    ) -> Result<OperatorConfig> {
        let mut doc: Value = serde_json::from_slice(&std::fs::read(&self.cluster.kubeconfig)?)?;
        doc["clusters"][0]["cluster"]["server"] = format!("https://{}", proxy.addr).into();
        let kubeconfig = self.cluster.dir.join(format!("slot-{slot}.kubeconfig"));
        std::fs::write(&kubeconfig, serde_json::to_vec_pretty(&doc)?)?;
        let mut extra_args: Vec<String> = TIMINGS.iter().map(|s| s.to_string()).collect();
        extra_args.push(format!("--lease-namespace={NAMESPACE}"));
        Ok(OperatorConfig {
            identity: format!("replica-{slot}-{generation}"),
            kubeconfig,
            namespaces: vec![NAMESPACE.into()],
            log_dir: self.root.join("target/chaos/logs"),
            extra_args,
            binary: None,
            env: Vec::new(),
        })
    }

    async fn start_slot(&mut self, slot: usize, generation: usize, proxy: Proxy) -> Result<Slot> {
        let config = self.replica_config(slot, generation, &proxy)?;
        let mut operator = Operator::start(config)?;
        self.logs.push(operator.process.log.clone());
        operator.wait_ready().await?;
        Ok(Slot {
            proxy,
            operator,
            generation,
        })
    }

    /// Replaces the replica in `slot` with a new process (a new identity, as a new Pod).
    async fn restart_slot(&mut self, slot: usize) -> Result<()> {
        let old = self.slots.remove(slot);
        let generation = old.generation + 1;
        let Slot {
            proxy,
            mut operator,
            ..
        } = old;
        operator.kill();
        drop(operator);
        let fresh = self.start_slot(slot, generation, proxy).await?;
        self.slots.insert(slot, fresh);
        Ok(())
    }

    async fn holder(&self) -> Result<String> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), NAMESPACE);
        Ok(leases
            .get_opt(LEASE)
            .await?
            .and_then(|l| l.spec?.holder_identity)
            .unwrap_or_default())
    }

    /// The slot whose live replica holds the Lease.
    async fn leader_slot(&self, limit: Duration) -> Result<usize> {
        e2e::wait::poll("a live leader", limit, || async {
            let holder = self.holder().await?;
            Ok(self
                .slots
                .iter()
                .position(|s| s.operator.config.identity == holder))
        })
        .await
    }

    /// Replicas reporting leader_election_master_status 1.
    async fn reporting_leaders(&self) -> Vec<String> {
        let mut leaders = Vec::new();
        for slot in &self.slots {
            match http_get(slot.operator.metrics, "/metrics").await {
                Ok((200, body)) => {
                    if body.lines().any(|l| {
                        l.starts_with("leader_election_master_status{") && l.ends_with(" 1")
                    }) {
                        leaders.push(slot.operator.config.identity.clone());
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

    async fn rounds(&mut self, args: &ChaosArgs, out: &Path) -> Result<Value> {
        for slot in 0..3 {
            let proxy =
                Proxy::start(self.cluster.server.trim_start_matches("https://").parse()?).await?;
            let started = self.start_slot(slot, 0, proxy).await?;
            self.slots.push(started);
        }
        self.leader_slot(Duration::from_secs(30)).await?;
        let started_at = Timestamp::now();
        let workload = Workload::start(self.client.clone(), args.seed);
        let mut faults = Vec::new();
        let mut no_single_leader = 0;
        let mut lost_total = 0;
        let mut unexpected_exits = 0;
        for (round, fault) in schedule(args.seed, args.rounds).into_iter().enumerate() {
            // A replica that died without being killed by us is a finding; replace it.
            for slot in 0..self.slots.len() {
                if !self.slots[slot].operator.process.is_running() {
                    eprintln!(
                        "replica {} exited unexpectedly",
                        self.slots[slot].operator.config.identity
                    );
                    unexpected_exits += 1;
                    self.restart_slot(slot).await?;
                }
            }
            workload.resume();
            tokio::time::sleep(Duration::from_secs(2)).await;
            let leader = self.leader_slot(Duration::from_secs(30)).await?;
            let at = Timestamp::now();
            eprintln!(
                "round {:>2}: {} (leader {})",
                round + 1,
                fault.kind(),
                self.slots[leader].operator.config.identity
            );
            self.inject(fault, leader).await?;
            let (failover, new_leader) = self.recover(at).await?;
            // A replica that was frozen or cut off may report leadership until it notices.
            let single = e2e::wait::poll(
                "exactly one replica reporting leadership",
                Duration::from_secs(10),
                || async { Ok((self.reporting_leaders().await.len() == 1).then_some(())) },
            )
            .await
            .is_ok();
            if !single {
                eprintln!(
                    "  replicas reporting leadership: {:?}",
                    self.reporting_leaders().await
                );
            }
            if !single {
                no_single_leader += 1;
            }
            workload.pause().await;
            let lost = lost_updates(&self.client, LEASE_DURATION + Duration::from_secs(20)).await?;
            lost_total += lost;
            faults.push(json!({
                "round": round + 1,
                "kind": fault.kind(),
                "at": at.to_string(),
                "failover_seconds": failover,
                "leader_before": leader,
                "leader_after": new_leader,
                "single_leader_after": single,
                "lost_updates": lost,
            }));
        }
        let operations = workload.operations();
        workload.stop().await;
        let ended_at = Timestamp::now();

        let events = audit::read(&self.cluster.audit_log)?;
        let terms = audit::acquisitions(&events, NAMESPACE, LEASE);
        let overlaps: Vec<String> = audit::overlapping_writes(&events, NAMESPACE, &terms)
            .iter()
            .map(|e| {
                format!(
                    "{} {} {:?} at {}",
                    e.user_agent, e.verb, e.object_ref, e.request_received_timestamp
                )
            })
            .collect();
        let panics = self
            .logs
            .iter()
            .filter(|log| std::fs::read_to_string(log).is_ok_and(|t| t.contains("panicked at")))
            .count();
        for slot in &mut self.slots {
            if !slot.operator.process.is_running() {
                unexpected_exits += 1;
            }
        }
        let failovers: Vec<f64> = faults
            .iter()
            .filter_map(|f| f["failover_seconds"].as_f64())
            .collect();
        let report = json!({
            "rounds": args.rounds,
            "seed": args.seed,
            "lease_timings": TIMINGS,
            "faults": faults,
            "overlapping_leadership_writes": overlaps.len(),
            "overlapping_examples": overlaps.iter().take(10).collect::<Vec<_>>(),
            "lost_updates": lost_total,
            "panics": panics,
            "unexpected_exits": unexpected_exits,
            "rounds_without_single_leader": no_single_leader,
            "failover_seconds": summary(&failovers),
            "workload_operations": operations,
            "lease_terms": terms.len(),
        });
        std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(&report)?)?;
        std::fs::write(out.join("report.md"), markdown(&report))?;
        std::fs::write(
            out.join("timeline.svg"),
            timeline(&terms, &report, started_at, ended_at),
        )?;
        println!("{}", markdown(&report));
        Ok(report)
    }

    async fn inject(&mut self, fault: Fault, leader: usize) -> Result<()> {
        match fault {
            Fault::LeaderKill => self.restart_slot(leader).await?,
            Fault::LeaderTerm => {
                self.slots[leader].operator.stop();
                self.restart_slot(leader).await?;
            }
            Fault::LeaderFreeze => {
                let process = &self.slots[leader].operator.process;
                process.signal(libc::SIGSTOP);
                tokio::time::sleep(LEASE_DURATION + Duration::from_secs(2)).await;
                self.slots[leader].operator.process.signal(libc::SIGCONT);
            }
            Fault::LeaderPartition => {
                self.slots[leader].proxy.block();
                tokio::time::sleep(LEASE_DURATION + Duration::from_secs(2)).await;
                self.slots[leader].proxy.heal();
            }
            Fault::FollowerKill => {
                let follower = (leader + 1 + self.rng.below(2)) % self.slots.len();
                self.restart_slot(follower).await?;
            }
            Fault::ApiserverRestart => self.cluster.restart("kube-apiserver").await?,
        }
        Ok(())
    }

    /// Waits for a live leader and its first reconcile after `fault`; returns the failover
    /// time in seconds and the leader's slot.
    async fn recover(&self, fault: Timestamp) -> Result<(Option<f64>, usize)> {
        let leader = self.leader_slot(Duration::from_secs(60)).await?;
        let first = e2e::wait::poll(
            "the leader's first reconcile after the fault",
            Duration::from_secs(30),
            || async {
                let found = self.slots[leader]
                    .operator
                    .log_lines()
                    .into_iter()
                    .filter(|l| l["message"] == "reconciled")
                    .filter_map(|l| {
                        l["timestamp"]
                            .as_str()
                            .and_then(|t| t.parse::<Timestamp>().ok())
                    })
                    .find(|t| *t > fault);
                Ok(found)
            },
        )
        .await
        .ok();
        Ok((first.map(|t| t.duration_since(fault).as_secs_f64()), leader))
    }
}

/// Objects whose status or ConfigMap has not caught up with their spec within `limit`.
async fn lost_updates(client: &Client, limit: Duration) -> Result<usize> {
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

/// Creates, updates and deletes MyResources and labelled Pods at a fixed rate (10 per
/// second), bounded to 40 objects of each kind, until stopped.
struct Workload {
    running: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    idle: Arc<tokio::sync::Notify>,
    operations: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Workload {
    fn start(client: Client, seed: u64) -> Workload {
        let running = Arc::new(AtomicBool::new(true));
        let paused = Arc::new(AtomicBool::new(false));
        let idle = Arc::new(tokio::sync::Notify::new());
        let operations = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let task = {
            let (running, paused, idle, operations) = (
                running.clone(),
                paused.clone(),
                idle.clone(),
                operations.clone(),
            );
            tokio::spawn(async move {
                let mut rng = Rng::new(seed ^ 0x5eed);
                let mrs: Api<MyResource> = Api::namespaced(client.clone(), NAMESPACE);
                let pods: Api<Pod> = Api::namespaced(client, NAMESPACE);
                let mut counter = 0u64;
                while running.load(Ordering::SeqCst) {
                    if paused.load(Ordering::SeqCst) {
                        idle.notify_waiters();
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    counter += 1;
                    let i = rng.below(40);
                    let name = format!("w{i}");
                    // Errors (object exists, not found, API server restarting) are part of chaos.
                    let _ = match rng.below(10) {
                        0..=5 => {
                            let mr = MyResource::new(
                                &name,
                                MyResourceSpec {
                                    message: format!("m{counter}"),
                                    some_value: counter as i32,
                                },
                            );
                            match mrs.create(&PostParams::default(), &mr).await {
                                Err(kube::Error::Api(s)) if s.code == 409 => mrs
                                    .patch(&name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"message": format!("m{counter}"), "someValue": counter as i32}})))
                                    .await
                                    .map(|_| ()),
                                other => other.map(|_| ()),
                            }
                        }
                        6 => mrs
                            .delete(&name, &DeleteParams::default())
                            .await
                            .map(|_| ()),
                        7 | 8 => {
                            let pod: Pod = serde_json::from_value(json!({
                                "metadata": {"name": format!("p{i}"), "labels": {POD_LABEL: name}},
                                "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}]}
                            }))
                            .expect("a valid Pod");
                            pods.create(&PostParams::default(), &pod).await.map(|_| ())
                        }
                        _ => pods
                            .delete(&format!("p{i}"), &DeleteParams::default())
                            .await
                            .map(|_| ()),
                    };
                    operations.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        Workload {
            running,
            paused,
            idle,
            operations,
            task,
        }
    }

    fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
    }

    /// Pauses and waits until no operation is in flight.
    async fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
        let _ = tokio::time::timeout(Duration::from_secs(10), self.idle.notified()).await;
    }

    fn operations(&self) -> u64 {
        self.operations.load(Ordering::SeqCst)
    }

    async fn stop(self) {
        self.running.store(false, Ordering::SeqCst);
        let _ = self.task.await;
    }
}

fn summary(samples: &[f64]) -> Value {
    if samples.is_empty() {
        return Value::Null;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = |p: f64| sorted[((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize];
    json!({"min": at(0.0), "median": at(50.0), "p99": at(99.0), "max": at(100.0)})
}

fn markdown(report: &Value) -> String {
    let mut md = vec![
        "# Chaos report".to_string(),
        String::new(),
        format!(
            "{} rounds, seed {}, Lease timings {}; {} workload operations.",
            report["rounds"],
            report["seed"],
            report["lease_timings"],
            report["workload_operations"]
        ),
        String::new(),
        "| check | result |".into(),
        "|---|---|".into(),
        format!(
            "| overlapping leadership writes (audit log) | {} |",
            report["overlapping_leadership_writes"]
        ),
        format!("| lost updates | {} |", report["lost_updates"]),
        format!("| panics | {} |", report["panics"]),
        format!("| unexpected exits | {} |", report["unexpected_exits"]),
        format!(
            "| rounds without exactly one leader after recovery | {} |",
            report["rounds_without_single_leader"]
        ),
        format!(
            "| failover seconds (fault → first reconcile by the leader) | {} |",
            report["failover_seconds"]
        ),
        String::new(),
        "| round | fault | failover s | lost updates |".into(),
        "|---|---|---|---|".into(),
    ];
    let mut by_kind: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for f in report["faults"].as_array().into_iter().flatten() {
        md.push(format!(
            "| {} | {} | {} | {} |",
            f["round"],
            f["kind"].as_str().unwrap_or(""),
            f["failover_seconds"],
            f["lost_updates"]
        ));
        if let Some(s) = f["failover_seconds"].as_f64() {
            by_kind
                .entry(f["kind"].as_str().unwrap_or("").into())
                .or_default()
                .push(s);
        }
    }
    md.push(String::new());
    md.push("| fault | rounds | failover median s | max s |".into());
    md.push("|---|---|---|---|".into());
    for (kind, samples) in by_kind {
        let s = summary(&samples);
        md.push(format!(
            "| {kind} | {} | {:.2} | {:.2} |",
            samples.len(),
            s["median"].as_f64().unwrap_or(0.0),
            s["max"].as_f64().unwrap_or(0.0)
        ));
    }
    md.join("\n") + "\n"
}

/// Leadership per replica over time, faults marked; a gap between bars is a failover.
fn timeline(
    terms: &[audit::Acquisition],
    report: &Value,
    start: Timestamp,
    end: Timestamp,
) -> String {
    let total = end.duration_since(start).as_secs_f64().max(1.0);
    let width = 1200.0;
    let x =
        |t: Timestamp| 120.0 + (t.duration_since(start).as_secs_f64() / total) * (width - 140.0);
    let slot_of = |holder: &str| {
        holder
            .strip_prefix("replica-")
            .and_then(|r| r.split('-').next())
            .and_then(|s| s.parse::<usize>().ok())
    };
    let mut svg = vec![format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="260" font-family="sans-serif" font-size="11">"#
    )];
    svg.push(r#"<rect width="100%" height="100%" fill="white"/>"#.into());
    for slot in 0..3 {
        let y = 40 + slot * 50;
        svg.push(format!(
            r#"<text x="10" y="{}">replica slot {slot}</text>"#,
            y + 15
        ));
        svg.push(format!(
            r##"<line x1="120" y1="{0}" x2="{1}" y2="{0}" stroke="#ddd"/>"##,
            y + 10,
            width - 20.0
        ));
    }
    for (i, term) in terms.iter().enumerate() {
        let Some(slot) = slot_of(&term.holder) else {
            continue;
        };
        let until = terms.get(i + 1).map_or(end, |t| t.at);
        let (x0, x1) = (x(term.at), x(until));
        svg.push(format!(
            r##"<rect x="{x0:.1}" y="{}" width="{:.1}" height="20" fill="#4c9be8"><title>{} leads</title></rect>"##,
            40 + slot * 50,
            (x1 - x0).max(1.0),
            term.holder
        ));
    }
    for f in report["faults"].as_array().into_iter().flatten() {
        let Some(at) = f["at"].as_str().and_then(|t| t.parse::<Timestamp>().ok()) else {
            continue;
        };
        let fx = x(at);
        svg.push(format!(r##"<line x1="{fx:.1}" y1="30" x2="{fx:.1}" y2="200" stroke="#d33" stroke-dasharray="3,2"/>"##));
        svg.push(format!(
            r##"<text x="{fx:.1}" y="215" fill="#d33" transform="rotate(45 {fx:.1} 215)">{}</text>"##,
            f["kind"].as_str().unwrap_or("")
        ));
    }
    svg.push(format!(r#"<text x="10" y="20">Leadership per replica slot over {total:.0} s (blue: holds the Lease; red: fault)</text>"#));
    svg.push("</svg>".into());
    svg.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_orders_the_faults_and_every_six_rounds_cover_all_kinds() {
        assert_eq!(schedule(7, 12), schedule(7, 12));
        assert_ne!(schedule(7, 12), schedule(8, 12));
        for block in schedule(7, 60).chunks(6) {
            let kinds: std::collections::HashSet<_> = block.iter().map(|f| f.kind()).collect();
            assert_eq!(kinds.len(), FAULTS.len());
        }
    }
}
