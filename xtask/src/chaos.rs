//! `cargo xtask chaos`: three replicas, a steady bounded workload, and one fault per round
//! chosen by a seed; after every round it checks that exactly one replica leads, measures the
//! failover and the time to a new leader, and at the end proves from the API server's audit
//! log that no replica wrote after another had acquired the Lease, that no update was lost,
//! and that nothing panicked. Writes `target/chaos/report.json`, `report.md` and
//! `timeline.svg`; fails when a check does.
//!
//! Each replica reaches the API server through two loopback proxies of its own: a TCP proxy
//! (cut for a partition) in front of an HTTPS proxy (overloaded on demand), so the audit log
//! still names the replica's user and user agent.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use e2e::audit;
use e2e::cluster::{Cluster, ClusterConfig};
use e2e::foreign_lease;
use e2e::operator::{Operator, OperatorConfig, http_get};
use e2e::overload_proxy::{Overload, OverloadProxy, OverloadStats};
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
const RETRY_PERIOD: Duration = Duration::from_secs(1);
/// The leader of a `mixed_timings` round: an older replica with longer timings.
const LONG_TIMINGS: [&str; 3] = [
    "--lease-duration=12s",
    "--renew-deadline=8s",
    "--retry-period=2s",
];
/// How long the long-timed leader is frozen: longer than the others' lease duration and
/// retry period (a follower that judges expiry by its own 4 s acquires meanwhile), shorter
/// than its own 8 s renew deadline (so it resumes still believing it leads, and writes).
const MIXED_FREEZE: Duration = Duration::from_secs(6);
/// A GitOps or policy tool relabelling the Lease: every 2 s, six times.
const RELABEL_EVERY: Duration = Duration::from_secs(2);
const RELABEL_COUNT: usize = 6;
const RELABEL_FOR: Duration = Duration::from_secs(12);
/// How long the leader's API server is overloaded.
const OVERLOAD_FOR: Duration = Duration::from_secs(8);

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
    /// The Lease deleted under a working leader (`kubectl delete lease`).
    LeaseDelete,
    /// A foreign merge patch empties `spec.holderIdentity` under a working leader.
    LeaseClearHolder,
    /// The leader SIGKILLed while a foreign tool relabels the Lease every 2 s.
    LeaseRelabelKill,
    /// The leader restarted with longer timings than the others, then frozen for longer
    /// than their lease duration but shorter than its own renew deadline.
    MixedTimings,
    /// The leader's API server answers a share of its writes 429 and delays others past
    /// the renew deadline, its renewals among them (so another replica takes over).
    ApiserverOverload,
}

const FAULTS: [Fault; 11] = [
    Fault::LeaderKill,
    Fault::LeaderTerm,
    Fault::LeaderFreeze,
    Fault::LeaderPartition,
    Fault::FollowerKill,
    Fault::ApiserverRestart,
    Fault::LeaseDelete,
    Fault::LeaseClearHolder,
    Fault::LeaseRelabelKill,
    Fault::MixedTimings,
    Fault::ApiserverOverload,
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
            Fault::LeaseDelete => "lease_delete",
            Fault::LeaseClearHolder => "lease_clear_holder",
            Fault::LeaseRelabelKill => "lease_relabel_kill",
            Fault::MixedTimings => "mixed_timings",
            Fault::ApiserverOverload => "apiserver_overload",
        }
    }

    /// The goal for the time to a new leader, where there is one: after SIGKILL, the lease
    /// duration plus a retry period, relabelled Lease or not.
    fn new_leader_goal(self) -> Option<Duration> {
        matches!(self, Fault::LeaderKill | Fault::LeaseRelabelKill)
            .then_some(LEASE_DURATION + RETRY_PERIOD)
    }
}

/// The fault of every round: each block of `FAULTS.len()` rounds has every kind once, in an
/// order the seed shuffles, so a run of that many rounds covers all of them.
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

/// One replica slot: its proxies to the API server (the replica's kubeconfig names the TCP
/// proxy, which forwards to the overload proxy), its Lease timings and the process
/// currently in it.
struct Slot {
    proxy: Proxy,
    api: OverloadProxy,
    timings: [&'static str; 3],
    operator: Operator,
    generation: usize,
}

/// Where and when a fault struck: the moment, the leader it struck, what it did.
struct Hit {
    at: Timestamp,
    leader: String,
    details: Value,
    /// The overloaded slot and its proxy's counts before the overload.
    overloaded: Option<(usize, OverloadStats)>,
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
        timings: [&str; 3],
    ) -> Result<OperatorConfig> {
        let mut doc: Value = serde_json::from_slice(&std::fs::read(&self.cluster.kubeconfig)?)?;
        doc["clusters"][0]["cluster"]["server"] = format!("https://{}", proxy.addr).into();
        let kubeconfig = self.cluster.dir.join(format!("slot-{slot}.kubeconfig"));
        std::fs::write(&kubeconfig, serde_json::to_vec_pretty(&doc)?)?;
        let mut extra_args: Vec<String> = timings.iter().map(|s| s.to_string()).collect();
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

    /// Starts slot `slot`'s proxies: the overload proxy presents the API server's own
    /// serving pair (signed by the test CA, SANs localhost and 127.0.0.1) and forwards with
    /// the admin certificate, which the replicas' kubeconfigs use too.
    async fn start_proxies(&self) -> Result<(Proxy, OverloadProxy)> {
        let pki = self.cluster.dir.join("pki");
        let api = OverloadProxy::start(
            &self.cluster.kubeconfig,
            &pki.join("apiserver.crt"),
            &pki.join("apiserver.key"),
        )
        .await?;
        Ok((Proxy::start(api.addr).await?, api))
    }

    async fn start_slot(
        &mut self,
        slot: usize,
        generation: usize,
        (proxy, api): (Proxy, OverloadProxy),
        timings: [&'static str; 3],
    ) -> Result<Slot> {
        let config = self.replica_config(slot, generation, &proxy, timings)?;
        let mut operator = Operator::start(config)?;
        self.logs.push(operator.process.log.clone());
        operator.wait_ready().await?;
        Ok(Slot {
            proxy,
            api,
            timings,
            operator,
            generation,
        })
    }

    /// Replaces the replica in `slot` with a new process (a new identity, as a new Pod)
    /// with the same timings.
    async fn restart_slot(&mut self, slot: usize) -> Result<()> {
        let timings = self.slots[slot].timings;
        self.restart_slot_with(slot, timings).await
    }

    /// Replaces the replica in `slot` with a new process running `timings`.
    async fn restart_slot_with(&mut self, slot: usize, timings: [&'static str; 3]) -> Result<()> {
        let old = self.slots.remove(slot);
        let generation = old.generation + 1;
        let Slot {
            proxy,
            api,
            mut operator,
            ..
        } = old;
        operator.kill();
        drop(operator);
        let fresh = self
            .start_slot(slot, generation, (proxy, api), timings)
            .await?;
        self.slots.insert(slot, fresh);
        Ok(())
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), NAMESPACE)
    }

    async fn holder(&self) -> Result<String> {
        Ok(self
            .leases()
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
            let proxies = self.start_proxies().await?;
            let started = self.start_slot(slot, 0, proxies, TIMINGS).await?;
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
            let round_started = Instant::now();
            let started = Timestamp::now();
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
            eprintln!(
                "round {:>2}: {} (leader {})",
                round + 1,
                fault.kind(),
                self.slots[leader].operator.config.identity
            );
            let hit = self.inject(fault, leader).await?;
            let (failover, new_leader) = self.recover(hit.at).await?;
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
            let mut details = hit.details;
            if let Some((slot, before)) = hit.overloaded {
                let after = self.slots[slot].api.stats();
                details["writes_rejected_429"] = (after.rejected - before.rejected).into();
                details["writes_delivered_late"] =
                    (after.delivered_late - before.delivered_late).into();
                details["writes_timed_out_while_held"] =
                    (after.timed_out - before.timed_out).into();
            }
            faults.push(json!({
                "round": round + 1,
                "kind": fault.kind(),
                "started": started.to_string(),
                "at": hit.at.to_string(),
                "until": Timestamp::now().to_string(),
                "failover_seconds": failover,
                "leader_before": hit.leader,
                "leader_after": self.slots[new_leader].operator.config.identity,
                "single_leader_after": single,
                "lost_updates": lost,
                "round_seconds": round_started.elapsed().as_secs_f64(),
                "details": details,
            }));
        }
        let operations = workload.operations();
        workload.stop().await;
        let ended_at = Timestamp::now();

        let events = audit::read(&self.cluster.audit_log)?;
        let terms = audit::acquisitions(&events, NAMESPACE, LEASE);
        for fault in &mut faults {
            fault["new_leader_seconds"] = new_leader_seconds(fault, &terms).into();
        }
        let overlapping = audit::overlapping_writes(&events, NAMESPACE, &terms);
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
        for fault in &mut faults {
            let (Some(from), Some(until)) =
                (timestamp(&fault["started"]), timestamp(&fault["until"]))
            else {
                continue;
            };
            fault["overlapping_writes"] = overlapping
                .iter()
                .filter(|e| (from..until).contains(&e.request_received_timestamp))
                .count()
                .into();
        }
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
            "by_kind": by_kind(&faults),
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

    async fn inject(&mut self, fault: Fault, leader: usize) -> Result<Hit> {
        let mut hit = Hit {
            at: Timestamp::now(),
            leader: self.slots[leader].operator.config.identity.clone(),
            details: json!({}),
            overloaded: None,
        };
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
            Fault::LeaseDelete => foreign_lease::delete(&self.leases(), LEASE).await?,
            Fault::LeaseClearHolder => foreign_lease::clear_holder(&self.leases(), LEASE).await?,
            Fault::LeaseRelabelKill => {
                let leases = self.leases();
                let relabel = tokio::spawn(async move {
                    foreign_lease::relabel(
                        &leases,
                        LEASE,
                        RELABEL_EVERY,
                        RELABEL_COUNT,
                        RELABEL_FOR,
                    )
                    .await
                });
                self.restart_slot(leader).await?;
                hit.details["relabels"] = relabel.await?.into();
            }
            Fault::MixedTimings => {
                let (at, long) = self.mixed_timings(leader).await?;
                hit.at = at;
                hit.details["leader_timings"] = json!(LONG_TIMINGS);
                hit.leader = long;
            }
            Fault::ApiserverOverload => {
                let api = &self.slots[leader].api;
                let overload = Overload {
                    reject_percent: 30,
                    retry_after_seconds: 5,
                    delay_percent: 30,
                    // Past the renew deadline and the lease duration: a held write can
                    // reach the server after another replica acquired.
                    delay: LEASE_DURATION + RETRY_PERIOD,
                    // Its renewals are held too, so leadership surely moves meanwhile.
                    hold_lease_writes: true,
                    seed: self.rng.below(1 << 30) as u64,
                };
                hit.overloaded = Some((leader, api.stats()));
                hit.details["overload"] = json!({
                    "seconds": OVERLOAD_FOR.as_secs_f64(),
                    "reject_percent": overload.reject_percent,
                    "retry_after_seconds": overload.retry_after_seconds,
                    "delay_percent": overload.delay_percent,
                    "delay_seconds": overload.delay.as_secs_f64(),
                    "hold_lease_writes": overload.hold_lease_writes,
                });
                api.overload(overload);
                tokio::time::sleep(OVERLOAD_FOR).await;
                self.slots[leader].api.relieve();
            }
        }
        Ok(hit)
    }

    /// The `mixed_timings` fault, a rolling upgrade that shortens the timings: the leader is
    /// replaced by a replica running [`LONG_TIMINGS`] (the followers frozen meanwhile, so
    /// that it and not they takes the released Lease), which is frozen right after one of
    /// its renewals for [`MIXED_FREEZE`] under workload and then resumed. A follower that
    /// judged expiry by its own lease duration instead of the record's acquires meanwhile,
    /// and the resumed leader's writes overlap with it. The standard timings are restored
    /// by a graceful restart. Returns when the freeze began and the long-timed replica.
    async fn mixed_timings(&mut self, leader: usize) -> Result<(Timestamp, String)> {
        let followers: Vec<usize> = (0..self.slots.len()).filter(|s| *s != leader).collect();
        for &f in &followers {
            self.slots[f].operator.process.signal(libc::SIGSTOP);
        }
        self.slots[leader].operator.stop();
        let takeover = async {
            self.restart_slot_with(leader, LONG_TIMINGS).await?;
            let long = self.slots[leader].operator.config.identity.clone();
            e2e::wait::poll(
                "the long-timed replica holding the Lease",
                Duration::from_secs(30),
                || async { Ok((self.holder().await? == long).then_some(())) },
            )
            .await?;
            anyhow::Ok(long)
        }
        .await;
        for &f in &followers {
            self.slots[f].operator.process.signal(libc::SIGCONT);
        }
        let long = takeover?;
        // The followers observe the long-timed record, then the leader is frozen right
        // after a renewal, so its fence stays open for most of its renew deadline.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let renewed = |lease: Option<Lease>| lease.and_then(|l| l.spec?.renew_time);
        let before = renewed(self.leases().get_opt(LEASE).await?);
        e2e::wait::poll(
            "a renewal by the long-timed leader",
            Duration::from_secs(10),
            || async {
                let now = renewed(self.leases().get_opt(LEASE).await?);
                Ok((now != before).then_some(()))
            },
        )
        .await?;
        self.slots[leader].operator.process.signal(libc::SIGSTOP);
        let at = Timestamp::now();
        tokio::time::sleep(MIXED_FREEZE).await;
        self.slots[leader].operator.process.signal(libc::SIGCONT);
        // Its fence is still open: whatever it writes now must not overlap.
        tokio::time::sleep(Duration::from_secs(2)).await;
        self.slots[leader].operator.stop();
        self.restart_slot_with(leader, TIMINGS).await?;
        Ok((at, long))
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

/// The first acquisition by another replica than the struck leader, within the round: the
/// time to a new leader in seconds (none when leadership stayed).
fn new_leader_seconds(fault: &Value, terms: &[audit::Acquisition]) -> Option<f64> {
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

/// Per fault kind: rounds, failover, time to a new leader (and its goal), round duration,
/// overlapping writes and lost updates.
fn by_kind(faults: &[Value]) -> Value {
    let mut kinds: BTreeMap<&str, Vec<&Value>> = BTreeMap::new();
    for f in faults {
        kinds
            .entry(f["kind"].as_str().unwrap_or(""))
            .or_default()
            .push(f);
    }
    let samples = |rounds: &[&Value], field: &str| -> Vec<f64> {
        rounds.iter().filter_map(|f| f[field].as_f64()).collect()
    };
    let total = |rounds: &[&Value], field: &str| -> u64 {
        rounds.iter().filter_map(|f| f[field].as_u64()).sum()
    };
    let map: serde_json::Map<String, Value> = kinds
        .into_iter()
        .map(|(kind, rounds)| {
            let goal = FAULTS
                .iter()
                .find(|f| f.kind() == kind)
                .and_then(|f| f.new_leader_goal());
            let entry = json!({
                "rounds": rounds.len(),
                "failover_seconds": summary(&samples(&rounds, "failover_seconds")),
                "new_leader_seconds": summary(&samples(&rounds, "new_leader_seconds")),
                "new_leader_goal_seconds": goal.map(|g| g.as_secs_f64()),
                "round_seconds": summary(&samples(&rounds, "round_seconds")),
                "overlapping_writes": total(&rounds, "overlapping_writes"),
                "lost_updates": total(&rounds, "lost_updates"),
            });
            (kind.to_string(), entry)
        })
        .collect();
    map.into()
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
    let seconds = |v: &Value| v.as_f64().map_or("–".to_string(), |s| format!("{s:.2}"));
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
        "| round | fault | failover s | new leader s | overlapping writes | lost updates | round s | details |"
            .into(),
        "|---|---|---|---|---|---|---|---|".into(),
    ];
    for f in report["faults"].as_array().into_iter().flatten() {
        md.push(format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            f["round"],
            f["kind"].as_str().unwrap_or(""),
            seconds(&f["failover_seconds"]),
            seconds(&f["new_leader_seconds"]),
            f["overlapping_writes"],
            f["lost_updates"],
            seconds(&f["round_seconds"]),
            f["details"]
        ));
    }
    md.push(String::new());
    md.push(
        "Failover: fault → first reconcile by the leader after it. New leader: fault → first \
         acquisition by another replica (the audit log), none when leadership stayed."
            .into(),
    );
    md.push(String::new());
    md.push(
        "| fault | rounds | failover median s | max s | new leader median s | max s | goal s | overlapping writes | round median s |"
            .into(),
    );
    md.push("|---|---|---|---|---|---|---|---|---|".into());
    for (kind, k) in report["by_kind"].as_object().into_iter().flatten() {
        md.push(format!(
            "| {kind} | {} | {} | {} | {} | {} | {} | {} | {} |",
            k["rounds"],
            seconds(&k["failover_seconds"]["median"]),
            seconds(&k["failover_seconds"]["max"]),
            seconds(&k["new_leader_seconds"]["median"]),
            seconds(&k["new_leader_seconds"]["max"]),
            seconds(&k["new_leader_goal_seconds"]),
            k["overlapping_writes"],
            seconds(&k["round_seconds"]["median"]),
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
    fn the_seed_orders_the_faults_and_every_block_covers_all_kinds() {
        assert_eq!(schedule(7, 22), schedule(7, 22));
        assert_ne!(schedule(7, 22), schedule(8, 22));
        for block in schedule(7, 5 * FAULTS.len()).chunks(FAULTS.len()) {
            let kinds: std::collections::HashSet<_> = block.iter().map(|f| f.kind()).collect();
            assert_eq!(kinds.len(), FAULTS.len());
        }
    }
}
