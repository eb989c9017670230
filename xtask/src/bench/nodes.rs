//! `cargo xtask bench --pods N --nodes 3`: the node faults of docs/nodes.md against the
//! chart's three replicas on three nodes, with the chart's default Lease timings
//! (15 s / 10 s / 2 s), N times each, in turn: the leader's node partitioned (then healed),
//! powered off (its Pods replaced once the node is declared lost, then booted again), its
//! kubelet stopped and then its container killed (then power-cycled), and drained (then
//! uncordoned). A workload changes a MyResource every 100 ms throughout, and at the end the
//! whole run's audit log is judged by when writes took effect (the fencing check).
//! Writes `target/bench/nodes/report.{json,md}`.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use e2e::cluster::{Cluster, NodeFault};
use e2e::node_faults::{DRAIN_HANDOVER_GOAL, Release};
use serde_json::json;

use super::report::Report;

const NAMESPACE: &str = "bench-nodes";
const RELEASE: &str = "mro";
/// The chart's default timings.
const LEASE_DURATION: Duration = Duration::from_secs(15);
const RETRY_PERIOD: Duration = Duration::from_secs(2);
/// The bound for a silent node (docs/nodes.md): lease duration + retry period + 1 s.
const TAKEOVER_WITHIN: Duration = Duration::from_secs(18);

/// What each fault measured, run after run.
#[derive(Default)]
struct Samples {
    partition: Vec<f64>,
    partition_elsewhere: usize,
    power_off: Vec<f64>,
    power_off_elsewhere: usize,
    replaced: Vec<f64>,
    kubelet: Vec<f64>,
    kubelet_after_renewal: Vec<f64>,
    drain_handover: Vec<f64>,
    drain_one_move: usize,
    drain_elsewhere: usize,
    drain_fewest_ready: Vec<usize>,
}

pub async fn run(root: &Path, runs: usize, nodes: u8) -> Result<()> {
    eprintln!("==> building the image and starting a cluster with {nodes} nodes");
    let (mut cluster, image) =
        e2e::chart::cluster_with_image(root.join("target/bench/nodes-cluster"), nodes).await?;
    let result = measure(&mut cluster, &image.reference, runs).await;
    cluster.stop();
    let (report, findings) = result?;
    report.write(&root.join("target/bench/nodes"))?;
    ensure!(
        findings.is_empty(),
        "writes of an old term took effect in a newer one: {findings:#?}"
    );
    Ok(())
}

/// The report, and the fencing check's findings (none, or the bench fails).
async fn measure(cluster: &mut Cluster, image: &str, runs: usize) -> Result<(Report, Vec<String>)> {
    let release = Release::install(cluster, RELEASE, NAMESPACE, image).await?;
    release.ready_pods().await?;
    let workload = e2e::node_faults::workload(&release.client).await?;
    let measured = faults(cluster, &release, runs).await;
    workload.abort();
    let samples = measured?;
    let log = e2e::audit::read(&cluster.audit_log)?;
    let verdict = e2e::audit::check(
        &log,
        &e2e::audit::Fences::lease(NAMESPACE, e2e::lease::NAME),
    );
    Ok((report(&samples, runs, &verdict), verdict.findings()))
}

/// `runs` rounds of the four faults, each begun with three replicas Ready and settled.
async fn faults(cluster: &mut Cluster, release: &Release, runs: usize) -> Result<Samples> {
    let mut s = Samples::default();
    for run in 0..runs {
        release.ready_pods().await?;
        let cut = release
            .silence_the_leaders_node(cluster, NodeFault::Partition)
            .await?;
        eprintln!("    run {run} partition: new term after {:.2?}", cut.took);
        s.partition.push(cut.took.as_secs_f64());
        s.partition_elsewhere += usize::from(cut.next_node != cut.node);
        cluster.node_fault(&cut.node, NodeFault::Heal).await?;

        release.ready_pods().await?;
        let at = Instant::now();
        let off = release
            .silence_the_leaders_node(cluster, NodeFault::Stop)
            .await?;
        release.replaced(&off.node).await?;
        let replaced = at.elapsed();
        eprintln!(
            "    run {run} power-off: new term after {:.2?}, Pods replaced after {replaced:.1?}",
            off.took
        );
        s.power_off.push(off.took.as_secs_f64());
        s.power_off_elsewhere += usize::from(off.next_node != off.node);
        s.replaced.push(replaced.as_secs_f64());
        cluster.node_fault(&off.node, NodeFault::Start).await?;

        release.ready_pods().await?;
        let k = release.stop_kubelet_then_kill_leader(cluster).await?;
        eprintln!(
            "    run {run} kubelet stopped + kill: new term after {:.2?}, {:.2?} after the last renewal",
            k.took, k.after_renewal
        );
        s.kubelet.push(k.took.as_secs_f64());
        s.kubelet_after_renewal.push(k.after_renewal.as_secs_f64());
        release.power_cycle(cluster, &k.node).await?;

        let d = release.drain_the_leaders_node(cluster).await?;
        eprintln!(
            "    run {run} drain: {} move(s), {:.0} ms without a holder, at least {} Ready",
            d.moves,
            d.handover.as_secs_f64() * 1000.0,
            d.fewest_ready
        );
        s.drain_handover.push(d.handover.as_secs_f64());
        s.drain_one_move += usize::from(d.moves == 1);
        s.drain_elsewhere += usize::from(d.next_node != d.node);
        s.drain_fewest_ready.push(d.fewest_ready);
        release.uncordon(cluster, &d.node)?;
    }
    Ok(s)
}

fn report(s: &Samples, runs: usize, verdict: &e2e::audit::Verdict) -> Report {
    let mut report = Report::titled("Node faults: three replicas on three nodes");
    let within =
        |v: &[f64], bound: Duration| v.iter().filter(|t| **t <= bound.as_secs_f64()).count();
    let silenced = [
        (
            "partition",
            "partitioned",
            &s.partition,
            s.partition_elsewhere,
        ),
        (
            "power_off",
            "powered off",
            &s.power_off,
            s.power_off_elsewhere,
        ),
    ];
    for (key, what, samples, elsewhere) in silenced {
        report.record(
            &format!("{key}_new_term_seconds"),
            e2e::stats::summary(samples),
            format!(
                "leader's node {what} → new term: {}; within {TAKEOVER_WITHIN:?} in {} of \
                 {runs}, led from another node in {elsewhere} of {runs}",
                seconds(samples),
                within(samples, TAKEOVER_WITHIN)
            ),
        );
    }
    report.record(
        "power_off_pods_replaced_seconds",
        e2e::stats::summary(&s.replaced),
        format!(
            "leader's node powered off → its Pods replaced on the others (node lost after 20 s, tolerations 2 s): {}",
            seconds(&s.replaced)
        ),
    );
    let early = s
        .kubelet_after_renewal
        .iter()
        .filter(|t| **t < LEASE_DURATION.as_secs_f64())
        .count();
    let bound = LEASE_DURATION + RETRY_PERIOD + Duration::from_secs(1);
    report.record(
        "kubelet_stopped_kill_new_term_seconds",
        json!({
            "after_kill": e2e::stats::summary(&s.kubelet),
            "after_last_renewal": e2e::stats::summary(&s.kubelet_after_renewal),
        }),
        format!(
            "leader's kubelet stopped, then its container killed → new term: {}; after the last renewal: {}; before the Lease ran out in {early} of {runs}, within {bound:?} of the kill in {} of {runs}",
            seconds(&s.kubelet),
            seconds(&s.kubelet_after_renewal),
            within(&s.kubelet, bound)
        ),
    );
    let fewest = s.drain_fewest_ready.iter().min().copied().unwrap_or(0);
    report.record(
        "drain_handover_seconds",
        e2e::stats::summary(&s.drain_handover),
        format!(
            "kubectl drain of the leader's node → time without a holder: {}; p99 goal {:.0} ms; exactly one move in {} of {runs}, onto another node in {} of {runs}; fewest Ready replicas seen {fewest}",
            milliseconds(&s.drain_handover),
            DRAIN_HANDOVER_GOAL.as_secs_f64() * 1000.0,
            s.drain_one_move,
            s.drain_elsewhere
        ),
    );
    report.record(
        "fencing",
        json!({
            "writes_examined": verdict.writes_examined,
            "terms_examined": verdict.terms_examined(),
            "findings": verdict.findings(),
        }),
        format!(
            "fencing check over the whole run: {} writes in {} terms examined, {} finding(s)",
            verdict.writes_examined,
            verdict.terms_examined(),
            verdict.findings().len()
        ),
    );
    report
}

/// Samples in seconds as min, median, p99 and max.
fn seconds(samples: &[f64]) -> String {
    spread(samples, "s", 1.0, 2)
}

/// A drain's handovers are milliseconds.
fn milliseconds(samples: &[f64]) -> String {
    spread(samples, "ms", 1000.0, 0)
}

/// "N runs, min …, median …, p99 …, max …" of `samples` (seconds) × `scale` in `unit`.
fn spread(samples: &[f64], unit: &str, scale: f64, decimals: usize) -> String {
    let p = |q| e2e::stats::percentile(samples, q) * scale;
    format!(
        "{} runs, min {:.decimals$} {unit}, median {:.decimals$} {unit}, p99 {:.decimals$} {unit}, max {:.decimals$} {unit}",
        samples.len(),
        p(0.0),
        p(50.0),
        p(99.0),
        p(100.0)
    )
}
