//! The node faults a release of the chart meets on several nodes (docs/nodes.md), each a
//! step against the node of the replica that leads that returns what it measured: the
//! three-node test holds them to their bounds, `cargo xtask bench --pods N --nodes 3`
//! repeats them for statistics.
//!
//! - [`Release::silence_the_leaders_node`]: a partition or a power-off, and how long after
//!   it a new term began, on which node;
//! - [`Release::stop_kubelet_then_kill_leader`]: nothing reports the crash, so the new term
//!   may begin only once the Lease ran out;
//! - [`Release::drain_the_leaders_node`]: `kubectl drain`, its leadership moves, the gap
//!   between release and acquisition (the audit log), and the fewest Ready replicas seen;
//! - [`Release::ready_pods`]: the replicas Ready, settled, with their nodes: where every
//!   step begins.
//!
//! Times of a new term are the Lease's `acquireTime` (written by a replica on this machine's
//! clock) against this machine's clock at the fault.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use myresource_operator::resource::{MyResource, MyResourceSpec};
use serde_json::json;

use crate::cluster::{Cluster, NodeFault, Supervisor};
use crate::lease::NAME as LEASE;
use crate::process::run;

/// A drain's goal for the longest time without a holder (p99; issue 33).
pub const DRAIN_HANDOVER_GOAL: Duration = Duration::from_millis(250);

/// How long a step waits for Pods, a holder or a term.
pub const READY_WITHIN: Duration = Duration::from_secs(120);
/// How long the Ready replicas must stay the same before a step begins (a node that just
/// booted again reports a restarted container Ready, then not, then Ready).
const SETTLED_FOR: Duration = Duration::from_secs(5);

/// A Pod's name and its node's.
pub type Placed = (String, String);

/// A release of the chart on a cluster's nodes.
#[derive(Clone)]
pub struct Release {
    pub client: Client,
    pub namespace: String,
    /// `helm install RELEASE`: its Pods carry `app.kubernetes.io/instance=RELEASE`.
    pub release: String,
    pub replicas: usize,
}

/// A partition or power-off of the leader's node.
#[derive(Debug, Clone)]
pub struct Silenced {
    /// When the fault struck (this machine's clock).
    pub at: Timestamp,
    pub node: String,
    pub leader: String,
    pub next: String,
    pub next_node: String,
    /// From the fault to the new term's `acquireTime`.
    pub took: Duration,
}

/// The leader's kubelet stopped, then its container killed.
#[derive(Debug, Clone)]
pub struct KubeletStopped {
    /// When the leader's container was killed (this machine's clock).
    pub at: Timestamp,
    pub node: String,
    pub leader: String,
    pub next: String,
    /// From the kill to the new term's `acquireTime`.
    pub took: Duration,
    /// From the last renewal seen before the kill to the new term's `acquireTime`: never
    /// less than the lease duration.
    pub after_renewal: Duration,
}

/// `kubectl drain` of the leader's node.
#[derive(Debug, Clone)]
pub struct Drained {
    pub node: String,
    pub leader: String,
    pub next: String,
    pub next_node: String,
    /// Terms begun during the drain (the audit log).
    pub moves: usize,
    /// The longest time without a holder during the drain, release to acquisition.
    pub handover: Duration,
    /// The fewest Ready replicas seen during the drain (every 100 ms).
    pub fewest_ready: usize,
}

/// The tolerations [`Release::install`] sets (a value for `helm --set-json`): a lost node's
/// Pods are evicted 2 s after it is declared lost, not 300 s.
pub const SHORT_NODE_TOLERATIONS: &str = r#"tolerations=[
    {"key":"node.kubernetes.io/unreachable","operator":"Exists","effect":"NoExecute","tolerationSeconds":2},
    {"key":"node.kubernetes.io/not-ready","operator":"Exists","effect":"NoExecute","tolerationSeconds":2}]"#;

impl Release {
    /// The release `release` in `namespace`, with the chart's default three replicas.
    pub fn new(client: Client, namespace: &str, release: &str) -> Release {
        Release {
            client,
            namespace: namespace.into(),
            release: release.into(),
            replicas: 3,
        }
    }

    /// `helm install` of the chart as `release` in `namespace` with `image`: default values
    /// (three replicas) but for tolerations of 2 s for unreachable and not-ready nodes (300 s
    /// by default), so a lost node's Pods move within a test's or a bench's time.
    pub async fn install(
        cluster: &Cluster,
        release: &str,
        namespace: &str,
        image: &str,
    ) -> Result<Release> {
        let mut helm = crate::chart::helm(&cluster.kubeconfig, &cluster.dir.join("helm"))?;
        let tolerations = ["--set-json", SHORT_NODE_TOLERATIONS];
        crate::chart::install(&mut helm, release, namespace, image, &tolerations)?;
        Ok(Release::new(cluster.client().await?, namespace, release))
    }

    /// The release's Pods that run and are Ready, with their nodes; waits until there are
    /// [`Release::replicas`] and the set has not changed for [`SETTLED_FOR`].
    pub async fn ready_pods(&self) -> Result<Vec<Placed>> {
        let deadline = Instant::now() + READY_WITHIN;
        let mut since: Option<(Vec<Placed>, Instant)> = None;
        loop {
            let pods = self.ready_pods_now().await?;
            match &since {
                Some((seen, at)) if *seen == pods && at.elapsed() >= SETTLED_FOR => {
                    return Ok(pods);
                }
                Some((seen, _)) if *seen == pods => {}
                _ if pods.len() == self.replicas => since = Some((pods, Instant::now())),
                _ => since = None,
            }
            ensure!(
                Instant::now() < deadline,
                "{} Ready replicas, settled for {SETTLED_FOR:?}, not within {READY_WITHIN:?}: \
                 {since:?}",
                self.replicas
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The release's Pods Ready now, with their nodes.
    pub async fn ready_pods_now(&self) -> Result<Vec<Placed>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let selector = format!("app.kubernetes.io/instance={}", self.release);
        let list = pods.list(&ListParams::default().labels(&selector)).await?;
        Ok(list
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .filter_map(|p| Some((p.metadata.name?, p.spec?.node_name?)))
            .collect())
    }

    /// Waits until the Pods lost with `node` are replaced: every replica Ready elsewhere.
    pub async fn replaced(&self, node: &str) -> Result<Vec<Placed>> {
        crate::wait::poll("the lost node's Pods replaced", READY_WITHIN, || async {
            let pods = self.ready_pods_now().await?;
            Ok(
                (pods.len() == self.replicas && pods.iter().all(|(_, n)| n != node))
                    .then_some(pods),
            )
        })
        .await
    }

    /// Applies `fault` (a partition or a power-off) to the leader's node; returns when a
    /// new term began, and where.
    pub async fn silence_the_leaders_node(
        &self,
        cluster: &mut Cluster,
        fault: NodeFault,
    ) -> Result<Silenced> {
        let (leader, node, term) = self.leader().await?;
        let began = Timestamp::now();
        cluster.node_fault(&node, fault).await?;
        let (next, took) = self.takeover(&term, began).await?;
        let next_node = self.node_of(&next).await?;
        Ok(Silenced {
            at: began,
            node,
            leader,
            next,
            next_node,
            took,
        })
    }

    /// Stops the leader's kubelet, then SIGKILLs the leader's container: no status reports
    /// the crash. The kubelet stays stopped ([`Release::power_cycle`] brings it back).
    pub async fn stop_kubelet_then_kill_leader(
        &self,
        cluster: &mut Cluster,
    ) -> Result<KubeletStopped> {
        let (leader, node, term) = self.leader().await?;
        Supervisor::kill(cluster, &format!("{node}-kubelet"));
        let last_renewal = self.lease_spec().await?.renew_time.context("renewTime")?.0;
        let pid = crate::node::pod_process(&leader, "/myresource-operator")?;
        let killed = Timestamp::now();
        crate::node::sigkill(pid)?;
        let (next, took) = self.takeover(&term, killed).await?;
        let acquired = self.acquire_time().await?;
        let after_renewal = Duration::try_from(acquired.duration_since(last_renewal))?;
        Ok(KubeletStopped {
            at: killed,
            node,
            leader,
            next,
            took,
            after_renewal,
        })
    }

    /// Powers `node` off and on again (its kubelet, runtime and Pods start afresh); returns
    /// once the replicas are Ready and settled.
    pub async fn power_cycle(&self, cluster: &mut Cluster, node: &str) -> Result<()> {
        cluster.node_fault(node, NodeFault::Stop).await?;
        cluster.node_fault(node, NodeFault::Start).await?;
        self.ready_pods().await?;
        Ok(())
    }

    /// `kubectl drain --force` of the leader's node, measured (Pods without a controller on
    /// it are deleted); the node stays cordoned ([`Release::uncordon`]).
    pub async fn drain_the_leaders_node(&self, cluster: &Cluster) -> Result<Drained> {
        let (leader, node, _) = self.leader().await?;
        let from = Timestamp::now();
        let fewest = Arc::new(AtomicUsize::new(self.replicas));
        let watcher = tokio::spawn(self.clone().watch_fewest_ready(fewest.clone()));
        let outcome = async {
            run(
                kubectl(cluster)?.args([
                    "drain",
                    &node,
                    "--ignore-daemonsets",
                    "--delete-emptydir-data",
                    // Bare Pods (the demo's example Pods) are deleted, not a reason to stop.
                    "--force",
                    "--timeout=120s",
                ]),
                None,
            )?;
            let next = crate::lease::wait_for_holder(
                &self.client,
                &self.namespace,
                Some(&leader),
                READY_WITHIN,
            )
            .await?;
            self.ready_pods().await?;
            anyhow::Ok(next)
        }
        .await;
        watcher.abort();
        let next = outcome?;
        let log = crate::audit::read_filtered(&cluster.audit_log, |e| e.is_lease().then_some(e))?;
        let terms = crate::audit::acquisitions(&log, &self.namespace, LEASE);
        let handovers = crate::audit::handovers(&terms, from);
        Ok(Drained {
            node,
            leader,
            next_node: self.node_of(&next).await?,
            next,
            moves: handovers.moves,
            handover: handovers.longest_gap,
            fewest_ready: fewest.load(Ordering::SeqCst),
        })
    }

    /// `kubectl uncordon`: the drained node takes Pods again.
    pub fn uncordon(&self, cluster: &Cluster, node: &str) -> Result<()> {
        run(kubectl(cluster)?.args(["uncordon", node]), None)?;
        Ok(())
    }

    /// The Lease's holder, its node, and when its term began (`acquireTime`, as written).
    pub async fn leader(&self) -> Result<(String, String, String)> {
        let holder =
            crate::lease::wait_for_holder(&self.client, &self.namespace, None, READY_WITHIN)
                .await?;
        let node = self.node_of(&holder).await?;
        let term = crate::lease::acquire_time(&self.client, &self.namespace)
            .await?
            .context("the term's acquireTime")?;
        Ok((holder, node, term))
    }

    /// The node `pod` runs on.
    pub async fn node_of(&self, pod: &str) -> Result<String> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        pods.get(pod)
            .await?
            .spec
            .and_then(|s| s.node_name)
            .with_context(|| format!("{pod} is on no node"))
    }

    /// Waits for a term other than the one that began at `term` (a follower's, or the same
    /// Pod's restarted container's); returns its holder and how long after `since` it
    /// began.
    async fn takeover(&self, term: &str, since: Timestamp) -> Result<(String, Duration)> {
        let next =
            crate::lease::wait_for_new_term(&self.client, &self.namespace, term, READY_WITHIN)
                .await?;
        let began = self.acquire_time().await?;
        let took = Duration::try_from(began.duration_since(since)).unwrap_or_default();
        Ok((next, took))
    }

    async fn lease_spec(&self) -> Result<LeaseSpec> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.namespace);
        leases.get(LEASE).await?.spec.context("a Lease spec")
    }

    async fn acquire_time(&self) -> Result<Timestamp> {
        Ok(self
            .lease_spec()
            .await?
            .acquire_time
            .context("acquireTime")?
            .0)
    }

    /// Polls the Ready replicas every 100 ms, keeps the smallest number seen, and prints
    /// each change of the set (the drain's timeline).
    async fn watch_fewest_ready(self, fewest: Arc<AtomicUsize>) {
        let started = Instant::now();
        let mut last = Vec::new();
        loop {
            if let Ok(pods) = self.ready_pods_now().await {
                fewest.fetch_min(pods.len(), Ordering::SeqCst);
                if pods != last {
                    eprintln!("  {:.1?}: Ready {pods:?}", started.elapsed());
                    last = pods;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `kubectl` with the cluster's admin kubeconfig.
fn kubectl(cluster: &Cluster) -> Result<Command> {
    let mut cmd = Command::new(crate::binaries::kubectl()?);
    cmd.arg(format!("--kubeconfig={}", cluster.kubeconfig.display()));
    Ok(cmd)
}

/// Where [`workload`]'s MyResources live.
pub const WORK: &str = "work";
/// MyResources the workload changes, one every 100 ms in turn.
const WORK_OBJECTS: usize = 5;

/// Creates [`WORK_OBJECTS`] MyResources in [`WORK`], then changes one every 100 ms in turn
/// until the task is aborted (a failed change, while the faults run, is tried again at the
/// next turn): the leader writes in every term, so the fencing check has writes to judge.
pub async fn workload(client: &Client) -> Result<tokio::task::JoinHandle<()>> {
    crate::cluster::create_namespace(client, WORK).await?;
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), WORK);
    for i in 0..WORK_OBJECTS {
        let spec = MyResourceSpec {
            message: "start".into(),
            some_value: i as i32,
        };
        mrs.create(
            &PostParams::default(),
            &MyResource::new(&format!("w{i}"), spec),
        )
        .await?;
    }
    Ok(tokio::spawn(async move {
        for turn in 0usize.. {
            let patch = json!({"spec": {"message": format!("turn {turn}")}});
            let name = format!("w{}", turn % WORK_OBJECTS);
            let _ = mrs
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }))
}
