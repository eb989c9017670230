//! `cargo xtask demo`: the users' path on a real node.
//!
//! A local cluster with a node, the operator's image built here and loaded into it,
//! `helm install` of the chart (three replicas, default values apart from the image), the
//! tutorial's example and three labelled Pods that really run (two Ready), `kubectl get
//! myr,pods`, the ConfigMap and who leads; then `kubectl delete pod` of the leader, and a
//! SIGKILL of the next leader's process from the host (a crash failover read from the
//! Pod's status, not waited out), each failover shown with its measured time (Lease
//! timings: the chart's defaults, 15 s / 10 s / 2 s). With three nodes, the replicas land on
//! three, and the demo goes on: the leader's node partitioned (no replica can prove a
//! silent node's leader dead: a new term after the lease runs out, on another node), healed,
//! then drained (one leadership move, at once).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use e2e::cluster::{Cluster, ClusterConfig, NODES_DIR, NodeFault};
use e2e::lease::{self, wait_for_holder};
use e2e::node_faults::Release;
use e2e::operator_image::OperatorImage;
use kube::Client;

use super::{Kubectl, left_running, lifetime, require_programs, step, wait_for};

/// Where the chart is installed (and so where its Lease lives).
const NAMESPACE: &str = "myresource-system";
const RELEASE: &str = "myresource-operator";
const READY_WITHIN: Duration = Duration::from_secs(120);

pub async fn run(root: &Path, keep: bool, nodes: u8) -> Result<()> {
    let started = Instant::now();
    let dir = root.join("target").join("demo");
    step("building the operator's image and finding (or building) the cluster's programs");
    let image = e2e::operator_image::build()?;
    let control_plane = e2e::binaries::ensure()?;
    let node = e2e::binaries::node()?;
    let kubectl = e2e::binaries::kubectl()?;
    let helm = e2e::binaries::helm()?;
    require_programs(&[
        ("etcd", &control_plane.etcd),
        ("kube-apiserver", &control_plane.kube_apiserver),
        (
            "kube-controller-manager",
            &control_plane.kube_controller_manager,
        ),
        ("kube-scheduler", &node.kube_scheduler),
        ("kubelet", &node.kubelet),
        ("kube-proxy", &node.kube_proxy),
        ("containerd", &node.containerd),
        ("ctr", &node.ctr),
        ("runc", &node.runc),
        ("kubectl", &kubectl),
        ("helm", &helm),
    ])?;
    println!(
        "    image {} (binary {:.1} MiB)",
        image.image.reference,
        image.binary_bytes as f64 / 1_048_576.0
    );
    step(&format!(
        "starting a local cluster with {} in {} (containerd, runc, kubelet, kube-proxy, a CNI \
         bridge each; a kube-scheduler)",
        if nodes == 1 {
            "a node".to_string()
        } else {
            format!("{nodes} nodes, each in a network namespace of its own,")
        },
        dir.display()
    ));
    let mut cluster = Cluster::start_with_nodes(
        ClusterConfig {
            dir,
            otlp_endpoint: None,
            lifetime: lifetime(keep),
            crds: Vec::new(),
            shard_selector: true,
        },
        nodes,
    )
    .await
    .context(
        "the node could not start on this machine (it needs root, cgroups, iptables and a \
         bridge); `cargo xtask demo --processes` runs the replicas as processes instead",
    )?;
    let result = demo(&mut cluster, &image, &kubectl, started).await;
    if result.is_ok() && keep {
        left_running(
            &cluster,
            &[
                format!("{} get myr,pods -A", kubectl.display()),
                format!(
                    "{} logs -n {NAMESPACE} -l app.kubernetes.io/instance={RELEASE}",
                    kubectl.display()
                ),
            ],
        );
        return Ok(());
    }
    step("cleaning up (the node too)");
    cluster.stop();
    result
}

async fn demo(
    cluster: &mut Cluster,
    image: &OperatorImage,
    kubectl: &Path,
    started: Instant,
) -> Result<()> {
    let kc = Kubectl::new(kubectl, cluster);
    println!(
        "    node Ready, API server at {} ({:.1} s so far)",
        cluster.server,
        started.elapsed().as_secs_f64()
    );
    step("loading the image into the nodes (no registry: ctr images import)");
    e2e::node::import_into(&cluster.dir.join(NODES_DIR), &image.image)?;

    step(&format!(
        "helm install {RELEASE} charts/myresource-operator -n {NAMESPACE} --create-namespace \
         (default values apart from the image: {}, pullPolicy Never)",
        image.image.reference
    ));
    let mut helm = e2e::chart::helm(&cluster.kubeconfig, &cluster.dir.join("helm"))?;
    e2e::chart::install(&mut helm, RELEASE, NAMESPACE, &image.image.reference, &[])?;
    let client = cluster.client().await?;
    let installed = Instant::now();
    kc.run(
        &[
            "rollout",
            "status",
            "-n",
            NAMESPACE,
            &format!("deployment/{RELEASE}"),
            "--timeout=120s",
        ],
        None,
    )?;
    let leader = wait_for_holder(&client, NAMESPACE, None, READY_WITHIN).await?;
    println!(
        "    three Pods Ready {:.1} s after the install; {leader} leads",
        installed.elapsed().as_secs_f64()
    );

    step("applying the tutorial's example and three labelled Pods that run (one never Ready)");
    kc.run(&["apply", "-f", "-"], Some(e2e::TUTORIAL_EXAMPLE))?;
    for i in 0..3 {
        kc.run(&["apply", "-f", "-"], Some(&app_pod(i, i < 2)))?;
    }
    wait_for(&client, READY_WITHIN, |mr| {
        mr.status
            .as_ref()
            .and_then(|s| s.pods)
            .is_some_and(|p| p.total == 3 && p.ready == 2)
    })
    .await?;
    step("kubectl get myr,pods -A");
    kc.show(&["get", "myr,pods", "-A", "-o", "wide"])?;
    step("kubectl get configmap example-myresource (owned by the MyResource)");
    kc.show_configmap()?;
    step("who leads");
    show_leader(&kc)?;

    step(&format!(
        "kubectl delete pod {leader} (the leader), then changing the spec"
    ));
    let second = failover(&kc, &client, &leader, "after the delete", |kc| {
        kc.run(
            &["delete", "pod", "-n", NAMESPACE, &leader, "--wait=false"],
            None,
        )
    })
    .await?;

    step(&format!(
        "SIGKILL of {second}'s process from the host (the new leader), then changing the spec; \
         a new term begins as soon as the kubelet reports the container dead, without \
         waiting out the 15 s lease (a follower's, or the restarted container's if it \
         is first)"
    ));
    let pid = e2e::node::pod_process(&second, "/myresource-operator")?;
    println!("    pid {pid} on the host is /myresource-operator in Pod {second}");
    let third = failover(&kc, &client, &second, "after the kill", |_| {
        e2e::node::sigkill(pid)
    })
    .await?;
    step(&format!(
        "the kubelet restarted {second}'s container; {third} leads"
    ));
    kc.run(
        &[
            "wait",
            "-n",
            NAMESPACE,
            "--for=condition=Ready",
            &format!("pod/{second}"),
            "--timeout=120s",
        ],
        None,
    )?;
    kc.show(&["get", "pods", "-n", NAMESPACE])?;
    show_leader(&kc)?;
    kc.show(&["get", "myr"])?;
    kc.show_configmap()?;
    if cluster.node_names().len() >= 3 {
        node_faults(cluster, &kc, &client).await?;
    }
    println!(
        "\ndemo finished in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Makes the leader `leader` go with `fault`, changes the example's message right after,
/// and shows who began the next term and when the change was reconciled; returns the new
/// leader (after a container kill, it may be the restarted container in the same Pod).
async fn failover(
    kc: &Kubectl,
    client: &Client,
    leader: &str,
    message: &str,
    fault: impl FnOnce(&Kubectl) -> Result<()>,
) -> Result<String> {
    let term = lease::acquire_time(client, NAMESPACE)
        .await?
        .with_context(|| format!("{leader}'s term has no acquireTime"))?;
    let at = Instant::now();
    fault(kc)?;
    set_message(kc, message)?;
    let next = lease::wait_for_new_term(client, NAMESPACE, &term, Duration::from_secs(60)).await?;
    let took_over = at.elapsed();
    wait_for(client, Duration::from_secs(60), |mr| {
        mr.spec.message == message
            && mr.status.as_ref().and_then(|s| s.observed_generation) == mr.metadata.generation
    })
    .await?;
    println!(
        "    {next} took over {:.1} s after it; the change made after it was reconciled {:.1} s \
         after it",
        took_over.as_secs_f64(),
        at.elapsed().as_secs_f64()
    );
    Ok(next)
}

/// The leader's node partitioned, healed, then drained, each measured.
async fn node_faults(cluster: &mut Cluster, kc: &Kubectl, client: &Client) -> Result<()> {
    let release = Release::new(client.clone(), NAMESPACE, RELEASE);
    step("three replicas on three nodes (the chart's anti-affinity), once settled");
    release.ready_pods().await?;
    kc.show(&["get", "pods", "-n", NAMESPACE, "-o", "wide"])?;
    let (leader, node, _) = release.leader().await?;
    step(&format!(
        "cargo xtask cluster node {node} partition: {leader}'s node cut off from the API server \
         and the other nodes, kubelet and Pods alike, then changing the spec; nothing can prove \
         a silent node's leader dead, so a replica on another node takes over once the 15 s \
         lease runs out"
    ));
    let cut = release
        .silence_the_leaders_node(cluster, NodeFault::Partition)
        .await?;
    let changed = Instant::now();
    set_message(kc, "after the partition")?;
    wait_for(client, READY_WITHIN, |mr| {
        mr.spec.message == "after the partition"
            && mr.status.as_ref().and_then(|s| s.observed_generation) == mr.metadata.generation
    })
    .await?;
    println!(
        "    {} on {} began a term {:.1} s after the cut; the change was reconciled {:.1} s \
         after it was made",
        cut.next,
        cut.next_node,
        cut.took.as_secs_f64(),
        changed.elapsed().as_secs_f64()
    );
    step(&format!("cargo xtask cluster node {node} heal"));
    cluster.node_fault(&node, NodeFault::Heal).await?;
    release.ready_pods().await?;
    show_leader(kc)?;
    let (leader, node, _) = release.leader().await?;
    step(&format!(
        "kubectl drain --force {node} ({leader}'s node; the example's bare Pods on it are \
         deleted): the leader is evicted and releases the Lease naming a successor on another \
         node; the PodDisruptionBudget keeps two replicas"
    ));
    let drained = release.drain_the_leaders_node(cluster).await?;
    println!(
        "    {} on {} leads: {} leadership move(s), {:.0} ms without a holder, at least {} \
         replicas Ready throughout",
        drained.next,
        drained.next_node,
        drained.moves,
        drained.handover.as_secs_f64() * 1000.0,
        drained.fewest_ready
    );
    release.uncordon(cluster, &node)?;
    kc.show(&["get", "pods", "-n", NAMESPACE, "-o", "wide"])?;
    Ok(())
}

fn set_message(kc: &Kubectl, message: &str) -> Result<()> {
    let patch = format!(r#"{{"spec":{{"message":"{message}"}}}}"#);
    kc.run(
        &[
            "patch",
            "myr/example-myresource",
            "--type=merge",
            "-p",
            &patch,
        ],
        None,
    )?;
    Ok(())
}

fn show_leader(kc: &Kubectl) -> Result<()> {
    kc.show(&[
        "get",
        "lease",
        "-n",
        NAMESPACE,
        e2e::lease::NAME,
        "-o",
        "custom-columns=HOLDER:.spec.holderIdentity,TRANSITIONS:.spec.leaseTransitions",
    ])
}

/// A Pod of the example's "application": the node's probe image waiting for a signal,
/// Ready unless its readiness probe asks a port nothing listens on.
fn app_pod(i: usize, ready: bool) -> String {
    let probe = if ready {
        String::new()
    } else {
        "\n    readinessProbe:\n      tcpSocket:\n        port: 9\n      periodSeconds: 2".into()
    };
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: demo-pod-{i}
  labels:
    trstringer.com/myresource: example-myresource
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: {image}
    imagePullPolicy: Never
    args: [info-and-wait]{probe}
",
        image = e2e::node::probe::PROBE_IMAGE
    )
}
