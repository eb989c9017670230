//! Three nodes and the faults users meet (docs/nodes.md): the chart with default values
//! places its three replicas on three nodes; then, each time against the node of the
//! replica that leads, with the chart's Lease timings (15 s / 10 s / 2 s):
//!
//! 1. the node partitioned (kubelet and Pods cut off together): a replica on another node
//!    leads within lease duration + retry period + 1 s; the node healed;
//! 2. the node powered off: the same bound; its Pods are replaced once the node is declared
//!    lost; the node boots again;
//! 3. the node's kubelet stopped, then the leader's container killed: no takeover before the
//!    Lease runs out (nothing can prove the leader dead), one right after it;
//! 4. `kubectl drain` of the node: exactly one leadership move, onto a Ready replica on
//!    another node, and the PDB keeps two replicas Ready throughout;
//!
//! and at the end, the audit log judged by when writes took effect (a workload changes a
//! MyResource every 100 ms throughout, so every term writes): no write of an old term took
//! effect once a newer term had begun.
//!
//! The cluster is the test's own (three nodes); its node controller declares a node lost
//! after 20 s without a heartbeat (`--node-monitor-grace-period`, 50 s upstream), and the
//! test installs the chart with tolerations of 2 s for unreachable and not-ready nodes (300 s
//! by default): both shortened so a lost node's Pods move within the test's time.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use e2e::cluster::{Cluster, NodeFault};
use e2e::node_faults::{Release, Silenced};

const RELEASE: &str = "mro";
const NAMESPACE: &str = "mro-nodes";
const LEASE: &str = e2e::lease::NAME;
/// The chart's default timings.
const LEASE_DURATION: Duration = Duration::from_secs(15);
const RETRY_PERIOD: Duration = Duration::from_secs(2);
/// Lease duration + retry period + 1 s of slack: no replica can prove a silent node's
/// leader dead, so none may take over sooner, and one must right after.
const TAKEOVER_WITHIN: Duration = Duration::from_secs(18);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_and_the_faults_users_meet() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("myresource-nodes-{}", std::process::id()));
    let (mut cluster, image) = e2e::chart::cluster_with_image(dir, 3).await?;
    let outcome = scenario(&mut cluster, &image.reference).await;
    cluster.stop();
    outcome
}

async fn scenario(cluster: &mut Cluster, image: &str) -> Result<()> {
    let release = Release::install(cluster, RELEASE, NAMESPACE, image).await?;

    // A workload for the whole run: the leader writes (ConfigMaps, statuses, Events) in
    // every term, so the fencing check at the end has writes to judge.
    let workload = e2e::node_faults::workload(&release.client).await?;

    // Placement: three replicas on three nodes, by the chart's default anti-affinity.
    let pods = release.ready_pods().await?;
    let nodes: BTreeSet<&String> = pods.iter().map(|(_, node)| node).collect();
    ensure!(
        nodes.len() == 3,
        "three replicas on three nodes, not {pods:?}"
    );
    eprintln!("placement: {pods:?}");

    // 1. Partition.
    let cut = silenced(&release, cluster, NodeFault::Partition).await?;
    cluster.node_fault(&cut.node, NodeFault::Heal).await?;
    release.ready_pods().await?;

    // 2. Power-off: the same bound; the node's Pods are replaced once it is declared lost.
    let cut_at = Instant::now();
    let off = silenced(&release, cluster, NodeFault::Stop).await?;
    let replaced = release.replaced(&off.node).await?;
    eprintln!(
        "{}'s Pods replaced {:.1?} after the power cut: {replaced:?}",
        off.node,
        cut_at.elapsed()
    );
    cluster.node_fault(&off.node, NodeFault::Start).await?;

    // 3. The kubelet stopped, then the leader's container killed: nothing reports the
    //    crash, so the Lease must run out first.
    let k = release.stop_kubelet_then_kill_leader(cluster).await?;
    eprintln!(
        "{}'s kubelet stopped and {} killed: {} leads {:.2?} after the kill, {:?} after the \
         last renewal seen",
        k.node, k.leader, k.next, k.took, k.after_renewal
    );
    ensure!(
        k.after_renewal >= LEASE_DURATION,
        "{} took over {:?} after the last renewal: before the Lease ran out",
        k.next,
        k.after_renewal
    );
    ensure!(
        k.took <= LEASE_DURATION + RETRY_PERIOD + Duration::from_secs(1),
        "a new leader {:?} after the kill: not right after the Lease ran out",
        k.took
    );
    // The node comes back whole: a power cycle starts its kubelet again.
    release.power_cycle(cluster, &k.node).await?;

    // 4. kubectl drain: one move, onto a Ready replica on another node; the PDB keeps two.
    let d = release.drain_the_leaders_node(cluster).await?;
    eprintln!(
        "{} drained: {} → {} on {}, {} leadership move(s), {:.0} ms without a holder; at \
         least {} replicas Ready throughout",
        d.node,
        d.leader,
        d.next,
        d.next_node,
        d.moves,
        d.handover.as_secs_f64() * 1000.0,
        d.fewest_ready
    );
    ensure!(
        d.moves == 1,
        "{} leadership moves in the drain, not one",
        d.moves
    );
    ensure!(
        d.next_node != d.node,
        "{} leads from the drained node",
        d.next
    );
    ensure!(
        d.fewest_ready >= 2,
        "the PDB let the Ready replicas fall to {}",
        d.fewest_ready
    );
    release.uncordon(cluster, &d.node)?;

    // The whole run, judged by when writes took effect.
    workload.abort();
    let log = e2e::audit::read(&cluster.audit_log)?;
    let verdict = e2e::audit::check(&log, &e2e::audit::Fences::lease(NAMESPACE, LEASE));
    let findings = verdict.findings();
    ensure!(
        findings.is_empty(),
        "writes of an old term took effect in a newer one: {findings:#?}"
    );
    ensure!(
        verdict.writes_examined >= 100 && verdict.terms_examined() >= 5,
        "too little to judge: {} writes in {} terms",
        verdict.writes_examined,
        verdict.terms_examined()
    );
    eprintln!(
        "fencing: {} writes in {} terms examined, none late",
        verdict.writes_examined,
        verdict.terms_examined()
    );
    Ok(())
}

/// Applies `fault` (a partition or a power-off) to the leader's node and checks the
/// takeover: a new term began within [`TAKEOVER_WITHIN`] of the fault, led from another
/// node.
async fn silenced(release: &Release, cluster: &mut Cluster, fault: NodeFault) -> Result<Silenced> {
    let s = release.silence_the_leaders_node(cluster, fault).await?;
    eprintln!(
        "{} {fault:?}: {} → {} on {}, leading {:.2?} after the fault",
        s.node, s.leader, s.next, s.next_node, s.took
    );
    ensure!(
        s.took <= TAKEOVER_WITHIN,
        "a new leader {:?} after {fault:?} of {}, not within {TAKEOVER_WITHIN:?}",
        s.took,
        s.node
    );
    ensure!(
        s.next_node != s.node,
        "{} leads from the faulty node",
        s.next
    );
    Ok(s)
}
