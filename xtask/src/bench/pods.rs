//! `cargo xtask bench --pods N`: failover of the chart's Pods on a real node, with the
//! chart's default Lease timings (15 s / 10 s / 2 s). N times the leader's container is
//! SIGKILLed from the host, N times the leader Pod is deleted (as `kubectl delete pod`
//! does, through the API, so the tool's own start is not counted); each
//! time a change is made right after the fault, and the sample is the time from the fault
//! until the change is in the ConfigMap: the new leader's first reconcile and its write.
//! Then N `helm upgrade`s that change the Pod template: how often leadership moved during
//! each rollout, the longest time without a holder (from the audit log), and whether it
//! ended on a Pod of the new template.
//! Writes `target/bench/pods/report.{json,md}`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use e2e::cluster::Cluster;
use e2e::lease::wait_for_holder;
use e2e::node::image::Image;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use myresource_operator::resource::MyResource;
use serde_json::json;

use super::report::Report;

const NAMESPACE: &str = "bench-pods";
const RELEASE: &str = "mro";
const EXAMPLE: &str = "example-myresource";
const LIMIT: Duration = Duration::from_secs(120);

#[derive(Clone, Copy)]
enum Fault {
    Kill,
    Delete,
}

pub async fn run(root: &Path, runs: usize) -> Result<()> {
    eprintln!("==> building the image and starting a cluster with a node");
    let (mut cluster, image) =
        e2e::chart::cluster_with_image(root.join("target/bench/pods-cluster"), 1).await?;
    let result = measure(&cluster, &image, runs).await;
    cluster.stop();
    result?.write(&root.join("target/bench/pods"))
}

async fn measure(cluster: &Cluster, image: &Image, runs: usize) -> Result<Report> {
    let mut helm = e2e::chart::helm(&cluster.kubeconfig, &cluster.dir.join("helm"))?;
    e2e::chart::install(&mut helm, RELEASE, NAMESPACE, &image.reference, &[])?;
    let client = cluster.client().await?;
    e2e::process::run(
        Command::new(e2e::binaries::kubectl()?)
            .arg(format!("--kubeconfig={}", cluster.kubeconfig.display()))
            .args(["apply", "-n", "default", "-f", "-"]),
        Some(e2e::TUTORIAL_EXAMPLE),
    )?;
    let (mut killed, mut deleted, mut took_over_by) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..runs {
        for fault in [Fault::Kill, Fault::Delete] {
            let (seconds, same_pod) = once(&client, fault, run).await?;
            eprintln!(
                "    run {run} {}: {seconds:.3} s",
                match fault {
                    Fault::Kill => "container SIGKILL",
                    Fault::Delete => "Pod delete",
                }
            );
            match fault {
                Fault::Kill => {
                    killed.push(seconds);
                    took_over_by.push(same_pod);
                }
                Fault::Delete => deleted.push(seconds),
            }
        }
    }
    let mut report = Report::new();
    report.record(
        "pod_container_sigkill_seconds",
        e2e::stats::summary(&killed),
        line_ms(
            "leader container SIGKILLed from the host → a change made after it reconciled",
            &killed,
        ),
    );
    report.record(
        "pod_delete_seconds",
        e2e::stats::summary(&deleted),
        line_ms(
            "kubectl delete pod of the leader → a change made after it reconciled",
            &deleted,
        ),
    );
    let rollouts = rollouts(cluster, &client, runs).await?;
    let moves: Vec<usize> = rollouts.iter().map(|r| r.handovers.moves).collect();
    let exactly_one = moves.iter().filter(|m| **m == 1).count();
    report.record(
        "rollout_leadership_moves",
        json!(moves),
        format!(
            "leadership moves per rollout of three replicas ({runs} helm upgrades): exactly one in {exactly_one} of {runs}; {moves:?}"
        ),
    );
    let landed = rollouts.iter().filter(|r| r.landed_on_new).count();
    report.record(
        "rollout_landed_on_the_new_template",
        json!(landed),
        format!("leadership ended on a Pod of the new template in {landed} of {runs} rollouts"),
    );
    let gaps: Vec<f64> = rollouts
        .iter()
        .map(|r| r.handovers.longest_gap.as_secs_f64())
        .collect();
    report.record(
        "rollout_longest_leaderless_gap_seconds",
        e2e::stats::summary(&gaps),
        line_ms(
            "longest time without a holder per rollout (release to next acquisition, audit log)",
            &gaps,
        ),
    );
    let restarted = took_over_by.iter().filter(|same| **same).count();
    report.record(
        "pod_sigkill_retaken_by_the_restarted_container",
        json!(restarted),
        format!(
            "after a container SIGKILL the new term went to the restarted container itself in {restarted} of {} runs, to another Pod in the others",
            took_over_by.len()
        ),
    );
    Ok(report)
}

/// A report line: `samples` (seconds) as min, median, p99 and max in milliseconds.
fn line_ms(what: &str, samples: &[f64]) -> String {
    let ms = |p| e2e::stats::percentile(samples, p) * 1000.0;
    format!(
        "{what} ({} runs, 15/10/2 s): min {:.0} ms, median {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        samples.len(),
        ms(0.0),
        ms(50.0),
        ms(99.0),
        ms(100.0)
    )
}

/// One fault; returns the seconds until a change made after it was reconciled, and whether
/// the new term went to the faulted Pod itself (its restarted container).
async fn once(client: &Client, fault: Fault, run: usize) -> Result<(f64, bool)> {
    e2e::chart::ready_pods(client, NAMESPACE, RELEASE, 3, LIMIT).await?;
    let (leader, pid) = e2e::node::leader_process(client, NAMESPACE, LIMIT).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let term = e2e::lease::acquire_time(client, NAMESPACE)
        .await?
        .context("a Lease with an acquireTime")?;
    let message = format!("run {run} {}", matches!(fault, Fault::Kill));
    let at = Instant::now();
    match fault {
        Fault::Kill => {
            e2e::node::sigkill(pid)?;
        }
        Fault::Delete => {
            pods.delete(&leader, &DeleteParams::default()).await?;
        }
    }
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), "default");
    let patch = json!({"spec": {"message": message}});
    mrs.patch(EXAMPLE, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let deadline = at + LIMIT;
    let seconds = loop {
        let data = configmaps.get(EXAMPLE).await?.data.unwrap_or_default();
        if data.values().any(|v| *v == message) {
            break at.elapsed().as_secs_f64();
        }
        ensure!(
            Instant::now() < deadline,
            "the change after the fault was not reconciled"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Who began the new term.
    let holder = e2e::lease::wait_for_new_term(client, NAMESPACE, &term, LIMIT).await?;
    if matches!(fault, Fault::Kill) {
        // A container killed again and again would wait out the kubelet's growing restart
        // backoff (10 s, 20 s, 40 s …): its Pod is replaced instead, once measured. Its
        // restarted container may lead again: the next run starts once that Pod is gone,
        // so that it never measures this handover.
        pods.delete(&leader, &DeleteParams::default()).await?;
        e2e::wait::poll("the killed Pod to be gone", LIMIT, || async {
            Ok(pods.get_opt(&leader).await?.is_none().then_some(()))
        })
        .await?;
    }
    Ok((seconds, holder == leader))
}

/// One rollout's handovers, and whether leadership ended on a Pod of the new template.
struct Rollout {
    handovers: e2e::audit::Handovers,
    landed_on_new: bool,
}

/// `count` rollouts (`helm upgrade` with a new Pod annotation), each measured from the
/// audit log.
async fn rollouts(cluster: &Cluster, client: &Client, count: usize) -> Result<Vec<Rollout>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let mut rollouts = Vec::new();
    for i in 0..count {
        e2e::chart::ready_pods(client, NAMESPACE, RELEASE, 3, LIMIT).await?;
        wait_for_holder(client, NAMESPACE, None, LIMIT).await?;
        let from = Timestamp::now();
        let mark = format!("r{i}");
        let mut helm = e2e::chart::helm(&cluster.kubeconfig, &cluster.dir.join("helm"))?;
        let (namespace, rollout) = (NAMESPACE, ("podAnnotations.rollout", mark.as_str()));
        e2e::chart::roll(&mut helm, client, (RELEASE, namespace), rollout, 3, LIMIT).await?;
        let holder = wait_for_holder(client, NAMESPACE, None, LIMIT).await?;
        let log = e2e::audit::read(&cluster.audit_log)?;
        let terms = e2e::audit::acquisitions(&log, NAMESPACE, e2e::lease::NAME);
        let handovers = e2e::audit::handovers(&terms, from);
        let landed_on_new = pods
            .get_opt(&holder)
            .await?
            .is_some_and(|p| p.annotations().get("rollout") == Some(&mark));
        eprintln!(
            "    rollout {i}: {} moves, longest gap {:.0} ms, on the new template: {landed_on_new}",
            handovers.moves,
            handovers.longest_gap.as_secs_f64() * 1000.0
        );
        rollouts.push(Rollout {
            handovers,
            landed_on_new,
        });
    }
    Ok(rollouts)
}
