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
//!
//! - [`schedule`]: the fault kinds and the seeded order of the rounds;
//! - [`in_cluster`] (`--in-cluster`): the same rounds and checks against the chart's Pods
//!   on a local node, with the faults users cause to Pods;
//! - [`nodes`] (`--in-cluster --nodes 3`): the faults of the leader's whole node in that
//!   rotation (partition, power-off, kubelet stopped then a kill, drain);
//! - [`replicas`]: the replica slots, their proxies and configuration;
//! - [`faults`]: injecting a fault and waiting for the recovery;
//! - [`probe`]: failover as users feel it, to a change made right after the fault;
//! - [`workload`]: the steady workload the faults strike under;
//! - [`checks`]: the invariants, and the time to a new leader from the audit log;
//! - [`report`] and [`svg`]: `report.json`, `report.md` and `timeline.svg`.
//!
//! Replicas run with the test Lease timings, [`e2e::lease::TEST_TIMINGS`] (4 s / 3 s / 1 s),
//! so a round takes seconds.

mod checks;
mod faults;
mod in_cluster;
mod nodes;
mod probe;
mod replicas;
mod report;
mod schedule;
mod svg;
mod workload;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use e2e::audit;
use e2e::cluster::{Cluster, ClusterConfig};
use e2e::process::Lifetime;
use e2e::proxy::Proxy;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube_leasehold::scaleout::membership::shard_lease;
use serde_json::{Value, json};

use checks::Counts;
use probe::Probes;
use replicas::Slot;
use schedule::{Fault, Rng, schedule};
use workload::{Operations, Workload};

const NAMESPACE: &str = "chaos";

/// Rounds that cover every fault kind once: against processes, in scale-out mode, and
/// against the chart's Pods and their nodes on three nodes.
pub const ROUNDS_COVERING_EVERY_KIND: [usize; 3] = [
    schedule::FAULTS.len(),
    schedule::SHARD_FAULTS.len(),
    schedule::POD_FAULTS.len() + schedule::NODE_FAULTS.len(),
];

/// The release `cargo xtask test` upgrades from in its mixed-version round: the last
/// commit whose Lease record names no process instance (issue 30 changed what the record
/// means).
pub const EARLIER_RELEASE: &str = "f748a28";

#[derive(Debug, Clone, clap::Args)]
pub struct ChaosArgs {
    /// Rounds, one fault each.
    #[arg(long, default_value_t = 50)]
    pub rounds: usize,
    /// Seed for the choice of faults and the workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Against the chart's Pods on a local node instead of processes: Pod deleted,
    /// container SIGKILLed, cgroup frozen, network cut, API server restarted, rollout
    /// (writes target/chaos-in-cluster/).
    #[arg(long)]
    pub in_cluster: bool,
    /// Scale-out mode: the replicas run with S shard Leases; "the leader" a fault strikes
    /// is the replica leading the most shards, and every check is per shard (writes outside
    /// the shard's terms, exactly one leader per shard). Faults on the single Lease itself
    /// (deleted, holder cleared, relabelled, mixed timings) are left out.
    /// Writes target/chaos-scaleout/.
    #[arg(long, value_name = "S", conflicts_with = "in_cluster")]
    pub shard_leases: Option<usize>,
    /// Only these fault kinds, comma-separated (default: every kind of the mode), e.g.
    /// `--faults leader_sigkill,lease_name_former_holder`.
    #[arg(long, value_delimiter = ',', value_name = "KIND,...")]
    pub faults: Vec<String>,
    /// In a cluster: install the image built from git revision REV (an earlier release),
    /// and make the first round a rolling `helm upgrade` to this tree's image, with the
    /// leader's container SIGKILLed while old and new replicas share the Lease
    /// (`upgrade_mixed_versions`); the other rounds follow on the new version.
    #[arg(long, value_name = "REV", requires = "in_cluster")]
    pub upgrade_from: Option<String>,
    /// In a cluster: run on N nodes (1, or 3 or more); with three or more, the rotation
    /// adds the faults of the leader's node: partitioned, powered off, its kubelet stopped
    /// then the leader killed, drained (docs/nodes.md).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::fault_nodes)]
    pub nodes: u8,
}

impl ChaosArgs {
    /// The fault kinds this run rotates through.
    fn kinds(&self) -> Result<Vec<Fault>> {
        if self.nodes > 1 && !self.in_cluster {
            bail!(
                "--nodes {} needs --in-cluster: replicas as processes have no node",
                self.nodes
            );
        }
        let on_nodes: Vec<Fault> = [&schedule::POD_FAULTS[..], &schedule::NODE_FAULTS].concat();
        let all: &[Fault] = if self.in_cluster && self.nodes > 1 {
            &on_nodes
        } else if self.in_cluster {
            if let Some(name) = self
                .faults
                .iter()
                .find(|name| schedule::NODE_FAULTS.iter().any(|f| f.kind() == *name))
            {
                bail!("--faults {name}: a fault of the leader's node needs --nodes 3");
            }
            &schedule::POD_FAULTS
        } else if self.shard_leases.is_some() {
            &schedule::SHARD_FAULTS
        } else {
            &schedule::FAULTS
        };
        let limits: &[Fault] = if self.in_cluster {
            &schedule::POD_LIMIT_FAULTS
        } else {
            &[]
        };
        schedule::pick(all, limits, &self.faults)
    }
}

struct Chaos {
    /// Where the report and the replicas' logs go.
    out: PathBuf,
    cluster: Cluster,
    /// The proxy kube-apiserver reaches etcd through (the `etcd_stall` fault).
    etcd: Proxy,
    client: Client,
    slots: Vec<Slot>,
    /// Log files of every replica ever started, for the panic check.
    logs: Vec<PathBuf>,
    rng: Rng,
    /// Scale-out mode's shard count.
    shards: Option<usize>,
}

pub async fn run(root: &Path, args: ChaosArgs) -> Result<()> {
    // Bad input is refused before anything starts.
    args.kinds()?;
    if args.in_cluster {
        return in_cluster::run(root, &args).await;
    }
    let out = root.join(match args.shard_leases {
        None => "target/chaos",
        Some(_) => "target/chaos-scaleout",
    });
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    eprintln!("==> starting a local control plane and three replicas");
    let mut cluster = Cluster::start(ClusterConfig {
        dir: out.join("cluster"),
        otlp_endpoint: None,
        lifetime: Lifetime::TiedToThisProcess,
        crds: vec![myresource_operator::resource::crd()],
        shard_selector: true,
    })
    .await?;
    // etcd behind a proxy the `etcd_stall` fault can stall.
    let etcd = Proxy::start(cluster.etcd_addr()?).await?;
    cluster.reroute_etcd(etcd.addr).await?;
    let client = cluster.client().await?;
    e2e::cluster::create_namespace(&client, NAMESPACE).await?;
    let mut chaos = Chaos {
        out: out.clone(),
        cluster,
        etcd,
        client,
        slots: Vec::new(),
        logs: Vec::new(),
        rng: Rng::new(args.seed),
        shards: args.shard_leases,
    };
    let result = chaos.rounds(&args, &out).await;
    // Keep the audit log and replica logs; stop the processes.
    for slot in &mut chaos.slots {
        slot.operator.stop();
    }
    let audit_copy = out.join("audit.log");
    let _ = std::fs::copy(&chaos.cluster.audit_log, &audit_copy);
    chaos.cluster.stop();
    verdict(&out, result)
}

/// A run's outcome: its error, or whether its report (in `out`) shows a failed check.
fn verdict(out: &Path, report: Result<Value>) -> Result<()> {
    if checks::failed(&report?) {
        bail!("chaos checks failed; see {}/report.md", out.display());
    }
    eprintln!("chaos checks passed; see {}/report.md", out.display());
    Ok(())
}

impl Chaos {
    /// Starts the replicas and the workload, runs every round, then checks the whole run
    /// and writes the report into `out`.
    async fn rounds(&mut self, args: &ChaosArgs, out: &Path) -> Result<Value> {
        self.start_replicas().await?;
        let started_at = Timestamp::now();
        let probes = Probes::start(&self.client, self.shards).await?;
        let workload = Workload::start(self.client.clone(), args.seed);
        let mut faults = Vec::new();
        let mut counts = Counts::default();
        for (round, fault) in schedule(args.seed, args.rounds, &args.kinds()?)
            .into_iter()
            .enumerate()
        {
            faults.push(
                self.round(round, fault, (&workload, &probes), &mut counts)
                    .await?,
            );
        }
        let operations = workload.operations();
        workload.stop().await;
        let ended_at = Timestamp::now();

        let events = audit::read(&self.cluster.audit_log)?;
        events.covers(started_at)?;
        let fencing = checks::fencing(&events, &mut faults, self.shards);
        checks::judge_goals(&mut faults);
        counts.panics = self.panics();
        counts.unexpected_exits += self.exited();
        let report = report::build(args, faults, &fencing, &counts, &operations);
        report::write(out, &report, &fencing.terms, started_at, ended_at)?;
        Ok(report)
    }

    /// One round: replace replicas that died, let the workload run, strike the leader with
    /// `fault`, wait for the recovery and check it; returns the round's record.
    async fn round(
        &mut self,
        round: usize,
        fault: Fault,
        (workload, probes): (&Workload, &Probes),
        counts: &mut Counts,
    ) -> Result<Value> {
        let round_started = Instant::now();
        let started = Timestamp::now();
        let operations = workload.operations();
        // A replica that died without being killed by us is a finding; replace it.
        counts.unexpected_exits += self.replace_exited().await?;
        workload.resume();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let leader = self.leader_slot(Duration::from_secs(30)).await?;
        eprintln!(
            "round {:>2}: {} (leader {})",
            round + 1,
            fault.kind(),
            self.slots[leader].operator.config.identity
        );
        // Scale-out mode: the shards the fault strikes (those the struck replica holds).
        let struck = match self.shards {
            None => BTreeSet::new(),
            Some(shards) => e2e::shards::snapshot(&self.client, NAMESPACE, shards)
                .await?
                .held_by(&self.slots[leader].operator.config.identity),
        };
        // The Lease a Lease fault strikes: the single Lease, or the first shard struck.
        let lease = match struck.first() {
            None => e2e::lease::NAME.to_string(),
            Some(shard) => shard_lease(e2e::shards::GROUP, *shard),
        };
        let hit = self.inject(fault, leader, &lease).await?;
        let (failover, new_leader) = self.recover(probes, hit.at, &struck).await?;
        let single = self.single_leader().await;
        let lost = settle(&self.client, single, workload, counts).await?;
        let round = Round {
            round,
            fault,
            started,
            began: round_started,
            at: hit.at,
            failover,
            leader_before: hit.leader.clone(),
            leader_after: self.slots[new_leader].operator.config.identity.clone(),
            details: self.details(hit),
            operations: workload.operations().since(operations),
        };
        Ok(round.record(single, lost))
    }
}

/// One round, as the report keeps it.
struct Round {
    round: usize,
    fault: Fault,
    started: Timestamp,
    began: Instant,
    /// When the fault struck.
    at: Timestamp,
    failover: Option<f64>,
    leader_before: String,
    leader_after: String,
    details: Value,
    /// The workload's operations during the round.
    operations: Operations,
}

impl Round {
    /// The round's record, with what [`settle`] found.
    fn record(self, single: bool, convergence: checks::Convergence) -> Value {
        json!({
            "round": self.round + 1,
            "kind": self.fault.kind(),
            "started": self.started.to_string(),
            "at": self.at.to_string(),
            "until": Timestamp::now().to_string(),
            "failover_seconds": self.failover,
            "leader_before": self.leader_before,
            "leader_after": self.leader_after,
            "single_leader_after": single,
            "lost_updates": convergence.behind,
            "converge_seconds": convergence.seconds,
            "round_seconds": self.began.elapsed().as_secs_f64(),
            "operations": self.operations.attempted,
            "operations_succeeded": self.operations.succeeded(),
            "details": self.details,
        })
    }
}

/// How long after the workload pauses every object must have converged: the failover is
/// over by then (the probes showed it), so this is a healthy leader's catching up on the
/// last second of changes, with room for a slow 2-core machine.
const CONVERGE_WITHIN: Duration = Duration::from_secs(10);

/// The end of a round: counts a round without exactly one leader (`single`), pauses the
/// workload and waits for every object to converge; returns what it found.
async fn settle(
    client: &Client,
    single: bool,
    workload: &Workload,
    counts: &mut Counts,
) -> Result<checks::Convergence> {
    if !single {
        counts.rounds_without_single_leader += 1;
    }
    workload.pause().await;
    let convergence = checks::lost_updates(client, CONVERGE_WITHIN).await?;
    counts.lost_updates += convergence.behind;
    Ok(convergence)
}
