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
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use e2e::cluster::{Cluster, NodeFault, Supervisor};
use e2e::process::run;
use e2e::wait::poll;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use myresource_operator::resource::{MyResource, MyResourceSpec};
use serde_json::json;

const RELEASE: &str = "mro";
/// Where the workload's MyResources live.
const WORK: &str = "work";
/// MyResources the workload changes, one every 100 ms in turn.
const WORK_OBJECTS: usize = 5;
const NAMESPACE: &str = "mro-nodes";
const LEASE: &str = e2e::lease::NAME;
const SELECTOR: &str = "app.kubernetes.io/instance=mro";
const READY_WITHIN: Duration = Duration::from_secs(120);
/// The chart's default timings.
const LEASE_DURATION: Duration = Duration::from_secs(15);
const RETRY_PERIOD: Duration = Duration::from_secs(2);
/// Lease duration + retry period + 1 s of slack: no replica can prove a silent node's
/// leader dead, so none may take over sooner, and one must right after.
const TAKEOVER_WITHIN: Duration = Duration::from_secs(18);
/// How long the Ready replicas must stay the same before a step begins.
const SETTLED_FOR: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_and_the_faults_users_meet() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("myresource-nodes-{}", std::process::id()));
    let (mut cluster, image) = e2e::chart::cluster_with_image(dir, 3).await?;
    let outcome = scenario(&mut cluster, &image.reference).await;
    cluster.stop();
    outcome
}

async fn scenario(cluster: &mut Cluster, image: &str) -> Result<()> {
    let client = cluster.client().await?;
    let mut helm = e2e::chart::helm(&cluster.kubeconfig, &cluster.dir.join("helm"))?;
    let tolerations = r#"tolerations=[
        {"key":"node.kubernetes.io/unreachable","operator":"Exists","effect":"NoExecute","tolerationSeconds":2},
        {"key":"node.kubernetes.io/not-ready","operator":"Exists","effect":"NoExecute","tolerationSeconds":2}]"#;
    e2e::chart::install(
        &mut helm,
        RELEASE,
        NAMESPACE,
        image,
        &["--set-json", tolerations],
    )?;

    // A workload for the whole run: the leader writes (ConfigMaps, statuses, Events) in
    // every term, so the fencing check at the end has writes to judge.
    e2e::cluster::create_namespace(&client, WORK).await?;
    let workload = tokio::spawn(workload(client.clone()));

    // Placement: three replicas on three nodes, by the chart's default anti-affinity.
    let pods = ready_pods(&client).await?;
    let nodes: BTreeSet<String> = pods.iter().map(|(_, node)| node.clone()).collect();
    ensure!(
        nodes.len() == 3,
        "three replicas on three nodes, not {pods:?}"
    );
    eprintln!("placement: {pods:?}");

    // 1. Partition.
    let node = silence_the_leaders_node(cluster, &client, NodeFault::Partition).await?;
    cluster.node_fault(&node, NodeFault::Heal).await?;
    ready_pods(&client).await?;

    // 2. Power-off: the same bound; the node's Pods are replaced once it is declared lost.
    let cut = Instant::now();
    let node = silence_the_leaders_node(cluster, &client, NodeFault::Stop).await?;
    let replaced = poll("the lost node's Pods replaced", READY_WITHIN, || async {
        let pods = ready_pods_now(&client).await?;
        Ok((pods.len() == 3 && pods.iter().all(|(_, n)| *n != node)).then_some(pods))
    })
    .await?;
    eprintln!(
        "{node}'s Pods replaced {:.1?} after the power cut: {replaced:?}",
        cut.elapsed()
    );
    cluster.node_fault(&node, NodeFault::Start).await?;

    // 3. The kubelet stopped, then the leader's container killed: nothing reports the
    //    crash, so the Lease must run out first.
    let (leader, node, term) = find_leader(&client).await?;
    Supervisor::kill(cluster, &format!("{node}-kubelet"));
    let last_renew = renew_time(&client).await?;
    let pid = e2e::node::pod_process(&leader, "/myresource-operator")?;
    let killed = Timestamp::now();
    e2e::node::sigkill(pid)?;
    let (next, took) = takeover(&client, &term, killed).await?;
    let acquired = acquire_time(&client).await?;
    let after_renew = acquired.duration_since(last_renew);
    eprintln!(
        "{node}'s kubelet stopped and {leader} killed: {next} leads {took:.2?} after the kill, \
         {after_renew:?} after the last renewal seen"
    );
    ensure!(
        after_renew >= k8s_openapi::jiff::SignedDuration::try_from(LEASE_DURATION)?,
        "{next} took over {after_renew:?} after the last renewal: before the Lease ran out"
    );
    ensure!(
        took <= LEASE_DURATION + RETRY_PERIOD + Duration::from_secs(1),
        "a new leader {took:?} after the kill: not right after the Lease ran out"
    );
    // The node comes back whole: a power cycle starts its kubelet again.
    cluster.node_fault(&node, NodeFault::Stop).await?;
    cluster.node_fault(&node, NodeFault::Start).await?;
    ready_pods(&client).await?;

    // 4. kubectl drain: one move, onto a Ready replica on another node; the PDB keeps two.
    let (leader, node, _) = find_leader(&client).await?;
    let before = leadership_moves(cluster)?;
    let fewest = Arc::new(AtomicUsize::new(3));
    let watcher = tokio::spawn(watch_fewest_ready(client.clone(), fewest.clone()));
    let kubectl = e2e::binaries::kubectl()?;
    run(
        Command::new(&kubectl)
            .arg(format!("--kubeconfig={}", cluster.kubeconfig.display()))
            .args([
                "drain",
                &node,
                "--ignore-daemonsets",
                "--delete-emptydir-data",
                "--timeout=120s",
            ]),
        None,
    )?;
    let next = e2e::lease::wait_for_holder(&client, NAMESPACE, Some(&leader), READY_WITHIN).await?;
    on_another_node(&client, &next, &node).await?;
    ready_pods(&client).await?;
    watcher.abort();
    let moves = leadership_moves(cluster)? - before;
    eprintln!(
        "{node} drained: {leader} → {next}, {moves} leadership move(s); at least {} replicas \
         Ready throughout",
        fewest.load(Ordering::SeqCst)
    );
    ensure!(moves == 1, "{moves} leadership moves in the drain, not one");
    ensure!(
        fewest.load(Ordering::SeqCst) >= 2,
        "the PDB let the Ready replicas fall to {}",
        fewest.load(Ordering::SeqCst)
    );
    run(
        Command::new(&kubectl)
            .arg(format!("--kubeconfig={}", cluster.kubeconfig.display()))
            .args(["uncordon", &node]),
        None,
    )?;

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
/// node. Returns the node.
async fn silence_the_leaders_node(
    cluster: &mut Cluster,
    client: &Client,
    fault: NodeFault,
) -> Result<String> {
    let (leader, node, term) = find_leader(client).await?;
    let began = Timestamp::now();
    cluster.node_fault(&node, fault).await?;
    let (next, took) = takeover(client, &term, began).await?;
    eprintln!("{node} {fault:?}: {leader} → {next}, leading {took:.2?} after the fault");
    ensure!(
        took <= TAKEOVER_WITHIN,
        "a new leader {took:?} after {fault:?} of {node}, not within {TAKEOVER_WITHIN:?}"
    );
    on_another_node(client, &next, &node).await?;
    Ok(node)
}

/// The release's Pods that run and are Ready with their nodes; waits until there are
/// three and the set has not changed for [`SETTLED_FOR`] (a node that just booted again
/// reports a restarted container Ready, then not, then Ready).
async fn ready_pods(client: &Client) -> Result<Vec<(String, String)>> {
    let deadline = Instant::now() + READY_WITHIN;
    let mut since: Option<(Vec<(String, String)>, Instant)> = None;
    loop {
        let pods = ready_pods_now(client).await?;
        match &since {
            Some((seen, at)) if *seen == pods && at.elapsed() >= SETTLED_FOR => return Ok(pods),
            Some((seen, _)) if *seen == pods => {}
            _ if pods.len() == 3 => since = Some((pods, Instant::now())),
            _ => since = None,
        }
        ensure!(
            Instant::now() < deadline,
            "three Ready replicas, settled for {SETTLED_FOR:?}, not within {READY_WITHIN:?}: {since:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn ready_pods_now(client: &Client) -> Result<Vec<(String, String)>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let list = pods.list(&ListParams::default().labels(SELECTOR)).await?;
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

/// The Lease's holder, its node, and when its term began (acquireTime, as written).
async fn find_leader(client: &Client) -> Result<(String, String, String)> {
    let holder = e2e::lease::wait_for_holder(client, NAMESPACE, None, READY_WITHIN).await?;
    let node = node_of(client, &holder).await?;
    let term = e2e::lease::acquire_time(client, NAMESPACE)
        .await?
        .context("the term's acquireTime")?;
    Ok((holder, node, term))
}

async fn node_of(client: &Client, pod: &str) -> Result<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    pods.get(pod)
        .await?
        .spec
        .and_then(|s| s.node_name)
        .with_context(|| format!("{pod} is on no node"))
}

async fn on_another_node(client: &Client, pod: &str, not: &str) -> Result<()> {
    let node = node_of(client, pod).await?;
    ensure!(node != not, "{pod} leads from {node}, the faulty node");
    Ok(())
}

/// Waits for a term other than the one that began at `term` (an acquireTime: a follower's,
/// or the same Pod's restarted container's); returns its holder and how long after `since`
/// it began (the Lease's acquireTime: this machine's clock, as the replicas').
async fn takeover(client: &Client, term: &str, since: Timestamp) -> Result<(String, Duration)> {
    let next = e2e::lease::wait_for_new_term(client, NAMESPACE, term, READY_WITHIN).await?;
    let began = acquire_time(client).await?;
    let took = Duration::try_from(began.duration_since(since)).unwrap_or_default();
    Ok((next, took))
}

async fn lease_spec(client: &Client) -> Result<k8s_openapi::api::coordination::v1::LeaseSpec> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
    leases.get(LEASE).await?.spec.context("a Lease spec")
}

async fn acquire_time(client: &Client) -> Result<Timestamp> {
    Ok(lease_spec(client)
        .await?
        .acquire_time
        .context("acquireTime")?
        .0)
}

async fn renew_time(client: &Client) -> Result<Timestamp> {
    Ok(lease_spec(client).await?.renew_time.context("renewTime")?.0)
}

/// How many times leadership moved, from the audit log (releases not counted).
fn leadership_moves(cluster: &Cluster) -> Result<usize> {
    let log = e2e::audit::read(&cluster.audit_log)?;
    Ok(e2e::audit::acquisitions(&log, NAMESPACE, LEASE)
        .iter()
        .filter(|t| !t.holder.is_empty())
        .count())
}

/// Creates [`WORK_OBJECTS`] MyResources, then changes one every 100 ms in turn until
/// aborted (a failed change, while the faults run, is tried again at the next turn).
async fn workload(client: Client) {
    let mrs: Api<MyResource> = Api::namespaced(client, WORK);
    for i in 0..WORK_OBJECTS {
        let mr = MyResource::new(
            &format!("w{i}"),
            MyResourceSpec {
                message: "start".into(),
                some_value: i as i32,
            },
        );
        let _ = mrs.create(&PostParams::default(), &mr).await;
    }
    for turn in 0usize.. {
        let patch = json!({"spec": {"message": format!("turn {turn}")}});
        let name = format!("w{}", turn % WORK_OBJECTS);
        let _ = mrs
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls the Ready replicas every 100 ms, keeps the smallest number seen, and prints each
/// change of the set (the drain's timeline).
async fn watch_fewest_ready(client: Client, fewest: Arc<AtomicUsize>) {
    let started = Instant::now();
    let mut last = Vec::new();
    loop {
        if let Ok(pods) = ready_pods_now(&client).await {
            fewest.fetch_min(pods.len(), Ordering::SeqCst);
            if pods != last {
                eprintln!("  {:.1?}: Ready {pods:?}", started.elapsed());
                last = pods;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
