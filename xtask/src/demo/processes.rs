//! `cargo xtask demo --processes`: the demo without a node, the replicas as processes.
//!
//! A local control plane, the CRD, three replicas, the tutorial's example and a few labelled
//! Pods (objects only: nothing runs them), `kubectl get myr`, who leads; then the leader is
//! killed with SIGKILL and the demo shows the new leader, the reconcile that followed and
//! the measured failover time.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use e2e::cluster::{Cluster, ClusterConfig};
use e2e::lease::{self, wait_for_holder};

use super::{Kubectl, left_running, lifetime, require_programs, step, wait_for};

const REPLICAS: [&str; 3] = ["replica-a", "replica-b", "replica-c"];

pub async fn run(root: &Path, keep: bool) -> Result<()> {
    let started = Instant::now();
    let dir = root.join("target").join("demo");
    step("building the operator and finding (or building) the control plane");
    let operator = e2e::operator::binary()?;
    let control_plane = e2e::binaries::ensure()?;
    let kubectl = e2e::binaries::kubectl()?;
    require_programs(&[
        ("myresource-operator", &operator),
        ("etcd", &control_plane.etcd),
        ("kube-apiserver", &control_plane.kube_apiserver),
        (
            "kube-controller-manager",
            &control_plane.kube_controller_manager,
        ),
        ("kubectl", &kubectl),
    ])?;
    step(&format!(
        "starting a local control plane in {}",
        dir.display()
    ));
    let mut cluster = Cluster::start(ClusterConfig {
        dir,
        otlp_endpoint: None,
        lifetime: lifetime(keep),
        crds: Vec::new(),
        shard_selector: true,
    })
    .await?;
    let result = demo(&mut cluster, root, &operator, &kubectl, started).await;
    if result.is_ok() && keep {
        left_running(
            &cluster,
            &[
                format!("{} get myr", kubectl.display()),
                format!("replica logs: {}/replica-*.log", cluster.dir.display()),
            ],
        );
        return Ok(());
    }
    step("cleaning up");
    cluster.stop();
    result
}

async fn demo(
    cluster: &mut Cluster,
    root: &Path,
    operator: &Path,
    kubectl: &Path,
    started: Instant,
) -> Result<()> {
    let kc = Kubectl::new(kubectl, cluster);
    println!(
        "    ready at {} ({:.1} s so far)",
        cluster.server,
        started.elapsed().as_secs_f64()
    );

    step("installing the CRD: kubectl apply -f deploy/crd.yaml");
    kc.run(
        &[
            "apply",
            "-f",
            root.join("deploy/crd.yaml").to_str().unwrap(),
        ],
        None,
    )?;
    kc.run(
        &[
            "wait",
            "--for=condition=Established",
            "crd/myresources.trstringer.com",
        ],
        None,
    )?;

    step("starting three replicas (Lease timings: the defaults, 15 s / 10 s / 2 s)");
    for name in REPLICAS {
        let mut cmd = Command::new(operator);
        cmd.arg("run")
            .arg(format!("--kubeconfig={}", cluster.kubeconfig.display()))
            .arg(format!("--identity={name}"))
            .arg("--lease-namespace=default")
            .arg("--metrics-addr=127.0.0.1:0")
            .arg("--health-addr=127.0.0.1:0")
            .arg("--log-format=json");
        cluster.spawn(name, cmd)?;
    }
    let client = cluster.client().await?;
    let leader = wait_for_holder(&client, "default", None, Duration::from_secs(60)).await?;
    println!("    {leader} leads; the other two are warm followers");

    step("applying the tutorial's example and three labelled Pods (two of them Ready)");
    kc.run(&["apply", "-f", "-"], Some(e2e::TUTORIAL_EXAMPLE))?;
    for i in 0..3 {
        let pod = format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: demo-pod-{i}\n  labels:\n    trstringer.com/myresource: example-myresource\nspec:\n  containers:\n  - name: app\n    image: registry.invalid/app\n"
        );
        kc.run(&["apply", "-f", "-"], Some(&pod))?;
    }
    for i in 0..2 {
        let ready = r#"{"status":{"phase":"Running","conditions":[{"type":"Ready","status":"True","lastTransitionTime":"2026-01-01T00:00:00Z"}]}}"#;
        kc.run(
            &[
                "patch",
                &format!("pod/demo-pod-{i}"),
                "--subresource=status",
                "--type=merge",
                "-p",
                ready,
            ],
            None,
        )?;
    }
    wait_for(&client, Duration::from_secs(30), |mr| {
        mr.status
            .as_ref()
            .and_then(|s| s.pods)
            .is_some_and(|p| p.total == 3 && p.ready == 2)
    })
    .await?;
    step("kubectl get myr");
    kc.show(&["get", "myr"])?;
    step("kubectl get configmap example-myresource (owned by the MyResource)");
    kc.show_configmap()?;
    step("who leads: kubectl get lease myresource-operator");
    kc.show(&[
        "get",
        "lease",
        lease::NAME,
        "-o",
        "custom-columns=HOLDER:.spec.holderIdentity,TRANSITIONS:.spec.leaseTransitions",
    ])?;

    step(&format!(
        "killing the leader {leader} with SIGKILL, then changing the spec"
    ));
    let killed = Instant::now();
    let process = cluster.process(&leader).context("leader process")?;
    process.signal(libc::SIGKILL);
    process.wait_for_exit(Duration::from_secs(10));
    kc.run(
        &[
            "patch",
            "myr/example-myresource",
            "--type=merge",
            "-p",
            r#"{"spec":{"message":"hello again","someValue":14}}"#,
        ],
        None,
    )?;
    let new_leader =
        wait_for_holder(&client, "default", Some(&leader), Duration::from_secs(60)).await?;
    let took_over = killed.elapsed();
    wait_for(&client, Duration::from_secs(60), |mr| {
        mr.spec.message == "hello again"
            && mr.status.as_ref().and_then(|s| s.observed_generation) == mr.metadata.generation
    })
    .await?;
    let reconciled = killed.elapsed();
    println!(
        "    {new_leader} took over {:.1} s after the kill (lease duration 15 s)",
        took_over.as_secs_f64()
    );
    println!(
        "    the change made after the kill was reconciled {:.1} s after the kill",
        reconciled.as_secs_f64()
    );
    step(&format!("what {new_leader} logged about it"));
    let log = std::fs::read_to_string(cluster.dir.join(format!("{new_leader}.log")))?;
    for line in log.lines().filter(|l| {
        l.contains("acquired the Lease")
            || l.contains("ConfigMap updated")
            || l.contains("enqueuing every cached")
    }) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
        println!(
            "    {} {}",
            v["timestamp"].as_str().unwrap_or(""),
            v["message"].as_str().unwrap_or(line)
        );
    }
    kc.show(&["get", "myr"])?;
    kc.show_configmap()?;
    println!(
        "\ndemo finished in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
