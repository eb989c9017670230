//! `cargo xtask chaos --in-cluster`: the chaos suite against the chart's Pods on a real
//! node, with faults as users cause them: the leader's Pod deleted, its container
//! SIGKILLed from the node, frozen with the cgroup freezer past the lease, its network cut
//! inside its network namespace past the lease, kube-apiserver restarted, and a rolling
//! update under the workload. The workload, the checks and the report are the suite's own
//! (overlapping writes from the audit log, lost updates, panics, unexpected exits, exactly
//! one leader after each round); writes `target/chaos-in-cluster/`.
//!
//! With `--nodes 3` the cluster has three nodes, the replicas land on three of them, and
//! the rotation adds the faults of the leader's node ([`super::nodes`]).
//!
//! The chart runs three replicas with the test Lease timings in namespace `chaos`, which
//! it also watches. A replica's exits are read from its Pod's container restarts (those
//! the run did not cause are findings); its logs (for panics and the first reconcile
//! after a fault) are copied from the kubelet's Pod logs as they grow, since the kubelet
//! removes a deleted Pod's logs.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use e2e::audit;
use e2e::cluster::{Cluster, NODES_DIR};
use e2e::lease::{self, TEST_TIMINGS};
use e2e::node_faults::{Release, SHORT_NODE_TOLERATIONS};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

use super::checks::{self, Counts};
use super::nodes;
use super::probe::Probes;
use super::schedule::{Fault, schedule};
use super::workload::Workload;
use super::{ChaosArgs, NAMESPACE, Round, report, settle, verdict};

const RELEASE: &str = "chaos";
/// The chart's Deployment of release `chaos`, whose name starts its Pods'.
const DEPLOYMENT: &str = "chaos-myresource-operator";
const SELECTOR: &str = "app.kubernetes.io/instance=chaos";
/// Pods starting on two busy cores, a rollout of three.
const LIMIT: Duration = Duration::from_secs(180);
/// How long a freeze or a network cut lasts: past the lease, so leadership moves.
const PAST_THE_LEASE: Duration = Duration::from_secs(6);
const _: () = assert!(PAST_THE_LEASE.as_secs() > TEST_TIMINGS.lease_duration.as_secs());

pub(super) async fn run(root: &Path, args: &ChaosArgs) -> Result<()> {
    let out = root.join("target/chaos-in-cluster");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    eprintln!(
        "==> building the image, starting a local cluster with {} node(s), installing the chart",
        args.nodes
    );
    let (mut cluster, image) =
        e2e::chart::cluster_with_image(out.join("cluster"), args.nodes).await?;
    let result = async {
        // A mixed-version run starts on the earlier release's image.
        let installed = match &args.upgrade_from {
            None => image.reference.clone(),
            Some(rev) => {
                let old = earlier_image(root, rev, &out)?;
                e2e::node::import_into(&cluster.dir.join(NODES_DIR), &old)?;
                old.reference
            }
        };
        let client = cluster.client().await?;
        let mut helm = e2e::chart::helm(&cluster.kubeconfig, &cluster.dir.join("helm"))?;
        let timings = [
            format!(
                "leaderElection.leaseDuration={}s",
                TEST_TIMINGS.lease_duration.as_secs()
            ),
            format!(
                "leaderElection.renewDeadline={}s",
                TEST_TIMINGS.renew_deadline.as_secs()
            ),
            format!(
                "leaderElection.retryPeriod={}s",
                TEST_TIMINGS.retry_period.as_secs()
            ),
            format!("watchNamespaces={{{NAMESPACE}}}"),
            // As the processes suite: each reconcile logged (helm splits --set on commas).
            r"logging.level=info\,myresource_operator=debug".to_string(),
        ];
        let mut sets: Vec<&str> = timings.iter().flat_map(|t| ["--set", t.as_str()]).collect();
        if args.nodes > 1 {
            // A lost node's Pods move within a round, not after 300 s.
            sets.extend(["--set-json", SHORT_NODE_TOLERATIONS]);
        }
        e2e::chart::install(&mut helm, RELEASE, NAMESPACE, &installed, &sets)?;
        // Scrapes show a token the chart's metrics-reader role admits (the role comes with
        // the current chart: an earlier release may serve plain metrics until upgraded).
        let token = e2e::access::service_account_token(&client, NAMESPACE, "prometheus").await?;
        e2e::access::bind_cluster_role(
            &client,
            NAMESPACE,
            &format!("{DEPLOYMENT}-metrics-reader"),
            "prometheus",
        )
        .await?;
        let mut chaos = InCluster {
            upgrade_to: args.upgrade_from.as_ref().map(|_| image.reference.clone()),
            release: (args.nodes > 1).then(|| Release::new(client.clone(), NAMESPACE, RELEASE)),
            pods: Api::namespaced(client.clone(), NAMESPACE),
            token,
            client,
            logs: LogCopy::new(&cluster, &out),
            expected_restarts: BTreeMap::new(),
            reported_restarts: BTreeMap::new(),
            restarted_by_node_faults: BTreeSet::new(),
        };
        chaos.rounds(&mut cluster, args, &out).await
    }
    .await;
    let _ = std::fs::copy(&cluster.audit_log, out.join("audit.log"));
    cluster.stop();
    verdict(&out, result)
}

struct InCluster {
    /// A mixed-version run: the image its first round upgrades to.
    upgrade_to: Option<String>,
    /// On several nodes, the release as the node faults see it.
    release: Option<Release>,
    client: Client,
    pods: Api<Pod>,
    /// A token whose user the chart's metrics-reader role admits (secured metrics).
    token: String,
    logs: LogCopy,
    /// Container restarts the run caused (SIGKILLs), by Pod uid.
    expected_restarts: BTreeMap<String, i32>,
    /// Restarts already reported as unexpected, by Pod uid.
    reported_restarts: BTreeMap<String, i32>,
    /// Pods whose node a fault powered off or power-cycled (by uid): every restart of
    /// theirs is the fault's.
    restarted_by_node_faults: BTreeSet<String>,
}

impl InCluster {
    async fn rounds(
        &mut self,
        cluster: &mut Cluster,
        args: &ChaosArgs,
        out: &Path,
    ) -> Result<Value> {
        e2e::chart::ready_pods(&self.client, NAMESPACE, RELEASE, 3, LIMIT).await?;
        let started_at = Timestamp::now();
        let probes = Probes::start(&self.client, None).await?;
        let workload = Workload::start(self.client.clone(), args.seed);
        let mut faults = Vec::new();
        let mut counts = Counts::default();
        let mut kinds = schedule(args.seed, args.rounds, &args.kinds()?);
        if self.upgrade_to.is_some() {
            kinds.insert(0, Fault::UpgradeMixedVersions);
        }
        for (round, fault) in kinds.into_iter().enumerate() {
            let record = self
                .round(cluster, round, fault, (&workload, &probes), &mut counts)
                .await?;
            faults.push(record);
        }
        let operations = workload.operations();
        workload.stop().await;
        let ended_at = Timestamp::now();
        counts.unexpected_exits += self.unexpected_restarts().await?;
        self.logs.copy();
        counts.panics = self.logs.panics();

        let events = audit::read(&cluster.audit_log)?;
        events.covers(started_at)?;
        let fencing = checks::fencing(&events, &mut faults, None);
        for fault in faults
            .iter_mut()
            .filter(|f| f["kind"] == Fault::Rollout.kind())
        {
            rollout_handovers(fault, &fencing.terms);
        }
        checks::judge_goals(&mut faults);
        let mut report = report::build(args, faults, &fencing, &counts, &operations);
        report["mode"] = "in-cluster: the chart's Pods on a node".into();
        report::write(out, &report, &fencing.terms, started_at, ended_at)?;
        Ok(report)
    }

    /// One round: wait for three ready Pods, let the workload run, strike the leader with
    /// `fault`, wait for the recovery and check it; returns the round's record.
    async fn round(
        &mut self,
        cluster: &mut Cluster,
        round: usize,
        fault: Fault,
        (workload, probes): (&Workload, &Probes),
        counts: &mut Counts,
    ) -> Result<Value> {
        let round_started = Instant::now();
        let started = Timestamp::now();
        let operations = workload.operations();
        counts.unexpected_exits += self.unexpected_restarts().await?;
        e2e::chart::ready_pods(&self.client, NAMESPACE, RELEASE, 3, LIMIT).await?;
        workload.resume();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (leader, pid) = e2e::node::leader_process(&self.client, NAMESPACE, LIMIT).await?;
        eprintln!("round {:>2}: {} (leader {leader})", round + 1, fault.kind());
        let term = lease::acquire_time(&self.client, NAMESPACE)
            .await?
            .context("a Lease with an acquireTime")?;
        let mut at = Timestamp::now();
        let details = self.inject(cluster, fault, round, (&leader, pid)).await?;
        // A fault that struck later than it began says when.
        if let Some(struck) = details["struck_at"].as_str() {
            at = struck.parse()?;
        }
        // Every fault but the API server's restart (the leader keeps the Lease) ends the
        // term. After an API server restart the Pods reach it again only once kube-proxy has
        // re-programmed the Service's endpoint (measured: about 12 s after the restart): the
        // failover includes that.
        let moved = (fault != Fault::ApiserverRestart).then_some(term.as_str());
        let (failover, new_leader) = self.recover(probes, at, moved).await?;
        // After an API server restart the Pods reach it again only once kube-proxy has
        // re-programmed the Service (about 12 s), and a change handled before the server
        // went down can end the failover early: give leadership that long to settle.
        let settle_within = if fault == Fault::ApiserverRestart {
            Duration::from_secs(40)
        } else {
            Duration::from_secs(10)
        };
        let single = self.single_leader(settle_within).await;
        let lost = settle(&self.client, single, workload, counts).await?;
        self.logs.copy();
        let round = Round {
            round,
            fault,
            started,
            began: round_started,
            at,
            failover,
            leader_before: leader,
            leader_after: new_leader,
            details,
            operations: workload.operations().since(operations),
        };
        Ok(round.record(single, lost))
    }

    /// Strikes the leader Pod `leader` (host pid `pid`; or the cluster) with `fault`; returns
    /// what it did, for the report (a rollout's handovers are added at the end).
    async fn inject(
        &mut self,
        cluster: &mut Cluster,
        fault: Fault,
        round: usize,
        (leader, pid): (&str, u32),
    ) -> Result<Value> {
        let mut details = json!({});
        match fault {
            Fault::PodDelete => {
                self.pods.delete(leader, &DeleteParams::default()).await?;
            }
            Fault::ContainerKill => {
                let uid = self.pods.get(leader).await?.uid().unwrap_or_default();
                e2e::node::sigkill(pid)?;
                *self.expected_restarts.entry(uid).or_default() += 1;
            }
            Fault::PodFreeze => {
                let freezer = Freezer::of(pid)?;
                freezer.set(true)?;
                tokio::time::sleep(PAST_THE_LEASE).await;
                freezer.set(false)?;
                details["frozen_seconds"] = PAST_THE_LEASE.as_secs_f64().into();
            }
            Fault::PodNetworkCut => {
                let cut = NetworkCut::apply(pid)?;
                tokio::time::sleep(PAST_THE_LEASE).await;
                cut.heal()?;
                details["cut_seconds"] = PAST_THE_LEASE.as_secs_f64().into();
            }
            Fault::SlowNetworkContainerKill => {
                let uid = self.pods.get(leader).await?.uid().unwrap_or_default();
                // The Pod's network namespace outlives the container: the restarted one
                // would inherit the throttle, so it is lifted after the kill.
                let slow = SlowEgress::apply(pid)?;
                tokio::time::sleep(SLOW_BEFORE_KILL).await;
                details["struck_at"] = Timestamp::now().to_string().into();
                e2e::node::sigkill(pid)?;
                *self.expected_restarts.entry(uid).or_default() += 1;
                tokio::time::sleep(SLOW_AFTER_KILL).await;
                slow.lift()?;
                details["egress"] = SLOW_EGRESS.join(" ").into();
            }
            Fault::ApiserverRestart => {
                let started = Instant::now();
                cluster.restart("kube-apiserver").await?;
                details["restart_seconds"] = started.elapsed().as_secs_f64().into();
            }
            Fault::Rollout => {
                let mut helm = e2e::chart::helm(&cluster.kubeconfig, &cluster.dir.join("helm"))?;
                let mark = format!("r{round}");
                e2e::chart::roll(
                    &mut helm,
                    &self.client,
                    (RELEASE, NAMESPACE),
                    ("podAnnotations.chaos", &mark),
                    3,
                    LIMIT,
                )
                .await?;
            }
            Fault::UpgradeMixedVersions => {
                let image = self.upgrade_to.clone().context("no image to upgrade to")?;
                self.upgrade_mixed(cluster, &image, &mut details).await?;
            }
            Fault::NodePartition
            | Fault::NodePowerOff
            | Fault::NodeKubeletStopKill
            | Fault::NodeDrain => {
                let release = self.release.clone().context("node faults need --nodes 3")?;
                if nodes::restarts_the_node(fault) {
                    let node = release.node_of(leader).await?;
                    for pod in self
                        .pods
                        .list(&ListParams::default().labels(SELECTOR))
                        .await?
                    {
                        if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&node) {
                            self.restarted_by_node_faults
                                .insert(pod.uid().unwrap_or_default());
                        }
                    }
                }
                details = nodes::strike(&release, cluster, fault).await?;
            }
            other => bail!("{} is not a fault against Pods", other.kind()),
        }
        Ok(details)
    }

    /// The `upgrade_mixed_versions` fault: `helm upgrade` to `image`; once a new replica is
    /// Ready while old ones still run, the leader's container (old or new) is SIGKILLed;
    /// then the rollout completes. Records when and whom it struck in `details`.
    async fn upgrade_mixed(
        &mut self,
        cluster: &Cluster,
        image: &str,
        details: &mut Value,
    ) -> Result<()> {
        let (_, tag) = image.rsplit_once(':').context("a tagged image")?;
        let mut helm = e2e::chart::helm(&cluster.kubeconfig, &cluster.dir.join("helm"))?;
        e2e::chart::upgrade(&mut helm, (RELEASE, NAMESPACE), ("image.tag", tag))?;
        let mixed = e2e::wait::poll("old and new replicas side by side", LIMIT, || async {
            let (mut new, mut old) = (0, 0);
            for pod in self
                .pods
                .list(&ListParams::default().labels(SELECTOR))
                .await?
            {
                let status = pod.status.clone().unwrap_or_default();
                let image = status
                    .container_statuses
                    .as_ref()
                    .and_then(|c| c.first())
                    .map(|c| c.image.clone())
                    .unwrap_or_default();
                let ready = status.container_statuses.iter().flatten().all(|c| c.ready);
                if pod.metadata.deletion_timestamp.is_some() || !ready {
                    continue;
                }
                if image.ends_with(tag) {
                    new += 1
                } else {
                    old += 1
                }
            }
            Ok((new >= 1 && old >= 1).then_some((old, new)))
        })
        .await?;
        // The rollout goes on meanwhile: the Lease may still name an old replica whose
        // process has just exited (scaled down, it released). Strike a holder that runs.
        let (leader, pid) = e2e::node::leader_process(&self.client, NAMESPACE, LIMIT).await?;
        let pod = self.pods.get(&leader).await?;
        let leader_image = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.image.clone())
            .unwrap_or_default();
        details["struck_at"] = Timestamp::now().to_string().into();
        e2e::node::sigkill(pid)?;
        *self
            .expected_restarts
            .entry(pod.uid().unwrap_or_default())
            .or_default() += 1;
        details["killed"] = leader.into();
        details["killed_version"] = if leader_image.ends_with(tag) {
            "new"
        } else {
            "old"
        }
        .into();
        details["ready_old_and_new"] = json!([mixed.0, mixed.1]);
        e2e::chart::rolled_out(&self.client, (RELEASE, NAMESPACE), 3, LIMIT).await
    }

    /// Waits for the next term (after `ended`, the struck leader's) or any holder, and for
    /// the probe to handle a change made after the fault at `at`; returns the failover in
    /// seconds and the leader.
    async fn recover(
        &mut self,
        probes: &Probes,
        at: Timestamp,
        ended: Option<&str>,
    ) -> Result<(Option<f64>, String)> {
        let leader = match ended {
            Some(term) => lease::wait_for_new_term(&self.client, NAMESPACE, term, LIMIT).await?,
            None => lease::wait_for_holder(&self.client, NAMESPACE, None, LIMIT).await?,
        };
        let failover = probes
            .failover(at, &Default::default(), Duration::from_secs(60))
            .await;
        Ok((failover, leader))
    }

    /// Whether exactly one live Pod reports leadership on /metrics within `within`.
    async fn single_leader(&self, within: Duration) -> bool {
        let single = e2e::wait::poll("exactly one Pod reporting leadership", within, || async {
            Ok((self.reporting_leaders().await?.len() == 1).then_some(()))
        })
        .await
        .is_ok();
        if !single {
            eprintln!(
                "  Pods reporting leadership: {:?}",
                self.reporting_leaders().await
            );
        }
        single
    }

    /// Live Pods whose /metrics says leader_election_master_status 1.
    async fn reporting_leaders(&self) -> Result<Vec<String>> {
        let mut leaders = Vec::new();
        for pod in self
            .pods
            .list(&ListParams::default().labels(SELECTOR))
            .await?
        {
            let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()) else {
                continue;
            };
            if pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let addr = SocketAddr::new(ip.parse()?, 8080);
            if let Ok((200, body)) = e2e::operator::metrics_of(addr, &self.token).await
                && body
                    .lines()
                    .any(|l| l.starts_with("leader_election_master_status{") && l.ends_with(" 1"))
            {
                leaders.push(pod.name_any());
            }
        }
        Ok(leaders)
    }

    /// Container restarts the run did not cause, since the last call.
    async fn unexpected_restarts(&mut self) -> Result<usize> {
        let mut found = 0;
        for pod in self
            .pods
            .list(&ListParams::default().labels(SELECTOR))
            .await?
        {
            let uid = pod.uid().unwrap_or_default();
            if self.restarted_by_node_faults.contains(&uid) {
                continue;
            }
            let restarts: i32 = pod
                .status
                .and_then(|s| s.container_statuses)
                .unwrap_or_default()
                .iter()
                .map(|c| c.restart_count)
                .sum();
            let expected = self.expected_restarts.get(&uid).copied().unwrap_or(0);
            let unexpected = (restarts - expected).max(0);
            let reported = self.reported_restarts.entry(uid).or_default();
            if unexpected > *reported {
                eprintln!(
                    "  {}: {} container restarts nobody caused",
                    pod.metadata.name.unwrap_or_default(),
                    unexpected - *reported
                );
                found += (unexpected - *reported) as usize;
                *reported = unexpected;
            }
        }
        Ok(found)
    }
}

/// A rollout round's leadership moves and longest leaderless gap, from the whole run's
/// terms (read at the end: the audit log may not hold a round's last writes yet when the
/// round ends).
fn rollout_handovers(fault: &mut Value, terms: &[audit::Acquisition]) {
    let at = |field: &str| {
        fault[field]
            .as_str()
            .and_then(|t| t.parse::<Timestamp>().ok())
    };
    let (Some(from), Some(until)) = (at("at"), at("until")) else {
        return;
    };
    let during: Vec<_> = terms.iter().filter(|t| t.at < until).cloned().collect();
    let handovers = audit::handovers(&during, from);
    fault["details"]["leadership_moves"] = handovers.moves.into();
    fault["details"]["longest_gap_ms"] = (handovers.longest_gap.as_secs_f64() * 1000.0)
        .round()
        .into();
}

/// The freezer of process `pid`'s cgroup (its container's): cgroup v1's freezer hierarchy
/// where it is mounted, else cgroup v2's `cgroup.freeze`.
struct Freezer {
    file: PathBuf,
    v1: bool,
}

impl Freezer {
    fn of(pid: u32) -> Result<Freezer> {
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
        let root = Path::new("/sys/fs/cgroup");
        let entry = |prefix: &str| {
            cgroups.lines().find_map(|l| {
                let (_, rest) = l.split_once(':')?;
                rest.strip_prefix(prefix)
                    .map(|p| p.trim_start_matches('/').to_string())
            })
        };
        if let Some(path) = entry("freezer:").filter(|_| root.join("freezer").is_dir()) {
            return Ok(Freezer {
                file: root.join("freezer").join(path).join("freezer.state"),
                v1: true,
            });
        }
        let path = entry(":").context("a cgroup v2 entry")?;
        Ok(Freezer {
            file: root.join(path).join("cgroup.freeze"),
            v1: false,
        })
    }

    fn set(&self, frozen: bool) -> Result<()> {
        let value = match (self.v1, frozen) {
            (true, true) => "FROZEN",
            (true, false) => "THAWED",
            (false, true) => "1",
            (false, false) => "0",
        };
        std::fs::write(&self.file, value)
            .with_context(|| format!("writing {value} to {}", self.file.display()))
    }
}

/// Every packet into or out of a Pod's network namespace dropped, loopback aside: a
/// partition as the Pod sees it (connections hang, nothing is refused).
/// The `slow_network_container_sigkill` fault's throttle on the leader Pod's egress: a token
/// bucket that queues up to 2.5 s of packets (this kernel has no netem to delay them
/// outright; a queue that long holds back every request sent meanwhile as a delay would).
const SLOW_EGRESS: [&str; 7] = [
    "tbf", "rate", "16kbit", "burst", "1600", "latency", "2500ms",
];
/// How long the leader runs throttled before its container is SIGKILLed, and how long the
/// throttle stays on after.
const SLOW_BEFORE_KILL: Duration = Duration::from_millis(1500);
const SLOW_AFTER_KILL: Duration = Duration::from_secs(3);

/// A queueing throttle on the egress of the network namespace of process `pid`, which it
/// names (`ip netns attach`) so that it can be lifted after that process died.
struct SlowEgress;

/// The name the throttled network namespace is given while throttled.
const SLOW_NETNS: &str = "chaos-slow-egress";

impl SlowEgress {
    fn apply(pid: u32) -> Result<SlowEgress> {
        let _ = e2e::process::run(
            Command::new("ip").args(["netns", "delete", SLOW_NETNS]),
            None,
        );
        e2e::process::run(
            Command::new("ip").args(["netns", "attach", SLOW_NETNS, &pid.to_string()]),
            None,
        )?;
        let slow = SlowEgress;
        slow.tc(&["qdisc", "add", "dev", "eth0", "root"], &SLOW_EGRESS)?;
        Ok(slow)
    }

    fn lift(self) -> Result<()> {
        self.tc(&["qdisc", "del", "dev", "eth0", "root"], &[])?;
        // Only the name goes: the Pod's sandbox keeps the namespace.
        e2e::process::run(
            Command::new("ip").args(["netns", "delete", SLOW_NETNS]),
            None,
        )?;
        Ok(())
    }

    fn tc(&self, args: &[&str], qdisc: &[&str]) -> Result<()> {
        e2e::process::run(
            Command::new("ip")
                .args(["netns", "exec", SLOW_NETNS, "tc"])
                .args(args)
                .args(qdisc),
            None,
        )?;
        Ok(())
    }
}

struct NetworkCut {
    pid: u32,
}

const CUT_RULES: [[&str; 6]; 2] = [
    ["INPUT", "!", "-i", "lo", "-j", "DROP"],
    ["OUTPUT", "!", "-o", "lo", "-j", "DROP"],
];

impl NetworkCut {
    fn apply(pid: u32) -> Result<NetworkCut> {
        let cut = NetworkCut { pid };
        for rule in CUT_RULES {
            cut.iptables("-I", &rule)?;
        }
        Ok(cut)
    }

    fn heal(self) -> Result<()> {
        for rule in CUT_RULES {
            self.iptables("-D", &rule)?;
        }
        Ok(())
    }

    fn iptables(&self, op: &str, rule: &[&str]) -> Result<()> {
        e2e::process::run(
            Command::new("nsenter")
                .args(["-t", &self.pid.to_string(), "-n", "iptables", "-w", op])
                .args(rule),
            None,
        )?;
        Ok(())
    }
}

/// The replicas' container logs, copied from every kubelet's Pod logs as they grow (the
/// kubelet removes a deleted Pod's).
struct LogCopy {
    from: Vec<PathBuf>,
    to: PathBuf,
}

impl LogCopy {
    fn new(cluster: &Cluster, out: &Path) -> LogCopy {
        LogCopy {
            from: e2e::node::recorded_nodes(&cluster.dir.join(NODES_DIR))
                .into_iter()
                .map(|node| node.join("kubelet/pod-logs"))
                .collect(),
            to: out.join("pod-logs"),
        }
    }

    /// Copies every operator log file that grew since the last copy.
    fn copy(&self) {
        for (from, file) in self
            .from
            .iter()
            .flat_map(|from| self.files(from).into_iter().map(move |f| (from, f)))
        {
            let Ok(relative) = file.strip_prefix(from) else {
                continue;
            };
            let target = self.to.join(relative);
            let len = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
            if len(&file) > len(&target) {
                if let Some(parent) = target.parent() {
                    let _ = std::fs::create_dir_all(parent);
                }
                let _ = std::fs::copy(&file, &target);
            }
        }
    }

    /// The log files of the operator's containers under `root`
    /// (`<namespace>_<pod>_<uid>/operator/<restart>.log`).
    fn files(&self, root: &Path) -> Vec<PathBuf> {
        let prefix = format!("{NAMESPACE}_{DEPLOYMENT}-");
        let mut files = Vec::new();
        for pod in std::fs::read_dir(root).into_iter().flatten().flatten() {
            if !pod.file_name().to_string_lossy().starts_with(&prefix) {
                continue;
            }
            let container = pod.path().join("operator");
            for log in std::fs::read_dir(container).into_iter().flatten().flatten() {
                files.push(log.path());
            }
        }
        files
    }

    /// Copied log files that record a panic.
    fn panics(&self) -> usize {
        self.files(&self.to)
            .iter()
            .filter(|f| std::fs::read_to_string(f).is_ok_and(|t| t.contains("panicked at")))
            .count()
    }
}

/// The operator's image built from git revision `rev` of the repository at `root`, in a
/// worktree under `out` removed again afterwards.
fn earlier_image(root: &Path, rev: &str, out: &Path) -> Result<e2e::node::image::Image> {
    let source = out.join("earlier-source");
    let git =
        |args: &[&str]| e2e::process::run(Command::new("git").arg("-C").arg(root).args(args), None);
    git(&["worktree", "prune"])?;
    git(&[
        "worktree",
        "add",
        "--detach",
        "--force",
        &source.to_string_lossy(),
        rev,
    ])
    .with_context(|| format!("checking out --upgrade-from {rev}"))?;
    eprintln!("==> building the image of {rev}");
    let built = e2e::operator_image::build_from(&source);
    git(&["worktree", "remove", "--force", &source.to_string_lossy()])?;
    Ok(built?.image)
}
