//! The chart as users run it, on a real node: the operator's image built here and loaded
//! into the node, `helm install` with default values apart from the image, three Pods
//! Running and Ready with exactly one leader, the tutorial's example reconciled in the
//! `default` namespace with nothing but the chart's RBAC, the leader Pod deleted, the
//! leader's container SIGKILLed from the host, a rolling `helm upgrade` without an
//! overlapping write and with one leadership move, onto the new template, an upgrade to
//! scale-out mode whose shard leader's container is SIGKILLed, and `helm uninstall`
//! leaving no operator object behind.
//!
//! One test, in order: each step starts from the state the previous one left, as a user's
//! session would. The Lease timings are the chart's defaults (15 s / 10 s / 2 s).

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use e2e::audit;
use e2e::harness::{self, TestEnv};
use e2e::operator::http_get;
use e2e::process::run;
use e2e::wait::poll;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding, Subject};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use kube_leasehold::scaleout::shard_key::ShardKey;
use myresource_operator::resource::MyResource;
use serde_json::json;

const RELEASE: &str = "mro";
/// The chart's names for release `mro` (`<release>-<chart>`).
const FULLNAME: &str = "mro-myresource-operator";
const SELECTOR: &str = "app.kubernetes.io/instance=mro";
const LEASE: &str = "myresource-operator";
const EXAMPLE: &str = "example-myresource";
/// A Pod's start (image present), caches synced, readiness probe passed: generous on 2 cores.
const READY_WITHIN: Duration = Duration::from_secs(120);
/// Lease duration + renew + slack, with the chart's default timings.
const FAILOVER_WITHIN: Duration = Duration::from_secs(40);
/// A crashed leader's container is proven dead by the kubelet's report (about a second):
/// far below the 15 s lease, so a fall-back to lease expiry fails the test.
const CRASH_FAILOVER_WITHIN: Duration = Duration::from_secs(5);
/// Shard Leases in the scale-out step.
const SHARD_LEASES: usize = 4;

fn helm(env: &TestEnv) -> Result<Command> {
    let home = std::env::temp_dir().join("myresource-e2e-helm");
    let mut cmd = e2e::chart::helm(&env.shared.kubeconfig, &home)?;
    cmd.args(["--namespace", &env.namespace]);
    Ok(cmd)
}

fn kubectl(env: &TestEnv) -> Result<Command> {
    let mut cmd = Command::new(e2e::binaries::kubectl()?);
    cmd.arg(format!("--kubeconfig={}", env.shared.kubeconfig.display()));
    Ok(cmd)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_runs_as_users_run_it() -> Result<()> {
    let env = harness::setup_with_node("node").await?;
    let nodes_dir = env.shared.nodes_dir.clone().context("a node")?;
    let built = e2e::operator_image::build()?;
    e2e::node::import_into(&nodes_dir, &built.image)?;

    // 1. helm install: default values apart from the image.
    e2e::chart::install(
        &mut helm(&env)?,
        RELEASE,
        &env.namespace,
        &built.image.reference,
        &[],
    )?;
    let pods = wait_for_ready_pods(&env, 3).await?;
    let leader = e2e::lease::wait_for_holder(&env.client, &env.namespace, None, READY_WITHIN)
        .await
        .context("a leader among the Pods")?;
    ensure!(
        pods.contains(&leader),
        "the Lease names {leader}, not one of {pods:?}"
    );
    // Metrics are served over TLS to the scrapers the cluster authorises (the chart's
    // default): Prometheus' ServiceAccount, bound to the chart's metrics-reader role.
    let token = env.service_account_token("prometheus").await?;
    env.bind_cluster_role(
        &format!("{FULLNAME}-metrics-reader"),
        "prometheus",
        "/metrics",
    )
    .await?;
    assert_metrics_refused_without_the_role(&env, &pods[0]).await?;
    assert_one_leader_by_metrics(&env, &token).await?;
    let lease: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
    let owners = lease
        .get(LEASE)
        .await?
        .metadata
        .owner_references
        .unwrap_or_default();
    ensure!(
        owners
            .iter()
            .any(|o| o.kind == "ServiceAccount" && o.name == FULLNAME),
        "the Lease is owned by the chart's ServiceAccount (so uninstall removes it): {owners:?}"
    );

    // 2. The tutorial's example, in the default namespace.
    run(
        kubectl(&env)?.args(["apply", "-n", "default", "-f", "-"]),
        Some(e2e::TUTORIAL_EXAMPLE),
    )?;
    wait_for_message(&env.client, "hello world").await?;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), "default");
    let mr = poll("the example's status", READY_WITHIN, || async {
        let mr = mrs.get(EXAMPLE).await?;
        let status = mr.status.clone().unwrap_or_default();
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        Ok((ready && status.observed_generation == mr.metadata.generation).then_some(mr))
    })
    .await?;
    let events: Api<Event> = Api::namespaced(env.client.clone(), "default");
    let about_example = |e: &Event| {
        e.regarding.as_ref().and_then(|r| r.uid.as_deref()) == mr.metadata.uid.as_deref()
    };
    // Events go out after the status write, off the reconcile's path: poll for it.
    poll(
        &format!("an Event about {EXAMPLE}"),
        READY_WITHIN,
        || async {
            let list = events.list(&ListParams::default()).await?;
            Ok(list.items.iter().any(about_example).then_some(()))
        },
    )
    .await?;

    // 3. The chart's RBAC is all the operator has: its requests carry the ServiceAccount's
    //    token, none was refused, and no binding but the chart's names the account.
    let account = format!("system:serviceaccount:{}:{FULLNAME}", env.namespace);
    let log = env.audit_log()?;
    let mine: Vec<_> = log.iter().filter(|e| e.replica().is_some()).collect();
    ensure!(
        !mine.is_empty(),
        "the operator's requests are in the audit log"
    );
    let foreign: Vec<_> = mine.iter().filter(|e| e.user.username != account).collect();
    ensure!(
        foreign.is_empty(),
        "requests not made as {account}: {foreign:?}"
    );
    let refused: Vec<_> = mine
        .iter()
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .collect();
    ensure!(refused.is_empty(), "requests refused by RBAC: {refused:?}");
    assert_only_the_charts_bindings(&env.client, &env.namespace).await?;

    // 4. kubectl delete pod of the leader: another Pod leads and reconciles a change made
    //    after the delete.
    let deleted_at = Instant::now();
    run(
        kubectl(&env)?.args([
            "delete",
            "pod",
            "-n",
            &env.namespace,
            &leader,
            "--wait=false",
        ]),
        None,
    )?;
    set_message(&env.client, "after the delete").await?;
    let second =
        e2e::lease::wait_for_holder(&env.client, &env.namespace, Some(&leader), FAILOVER_WITHIN)
            .await?;
    wait_for_message(&env.client, "after the delete").await?;
    eprintln!(
        "leader Pod {leader} deleted: {second} leads and reconciled the change in {:.2} s",
        deleted_at.elapsed().as_secs_f64()
    );

    // 5. The leader's container process SIGKILLed from the host: another replica takes
    //    over, and the kubelet restarts the container.
    wait_for_ready_pods(&env, 3).await?;
    let pid = e2e::node::pod_process(&second, "/myresource-operator")?;
    let restarts_before = restarts(&env.client, &env.namespace, &second).await?;
    let term = e2e::lease::acquire_time(&env.client, &env.namespace)
        .await?
        .context("the second term's acquireTime")?;
    let killed_at = Instant::now();
    e2e::node::sigkill(pid)?;
    // Failover is measured to a change made right after the kill being reconciled.
    set_message(&env.client, "after the kill").await?;
    wait_for_message(&env.client, "after the kill").await?;
    let crash_failover = killed_at.elapsed();
    // The next term may be a follower's or the restarted container's (same Pod, another
    // process: the proof names the process), whichever is first.
    let third =
        e2e::lease::wait_for_new_term(&env.client, &env.namespace, &term, READY_WITHIN).await?;
    eprintln!(
        "leader container of {second} SIGKILLed: {third} began the next term and reconciled a \
         change made right after the kill in {:.2} s",
        crash_failover.as_secs_f64()
    );
    ensure!(
        crash_failover < CRASH_FAILOVER_WITHIN,
        "crash failover took {crash_failover:?}, not under {CRASH_FAILOVER_WITHIN:?}: the \
         kubelet's report was not used as the proof of the crash"
    );
    poll(
        "the kubelet to restart the killed container",
        READY_WITHIN,
        || async {
            Ok(
                (restarts(&env.client, &env.namespace, &second).await? > restarts_before)
                    .then_some(()),
            )
        },
    )
    .await?;
    wait_for_ready_pods(&env, 3).await?;

    // 6. helm upgrade with a new Pod template: the rollout completes, one leader at a time,
    //    no overlapping write, and leadership moves once, onto a Pod of the new template
    //    (the releasing leader names it as its successor).
    let rollout_began = Timestamp::now();
    e2e::chart::roll(
        &mut helm(&env)?,
        &env.client,
        (RELEASE, &env.namespace),
        ("podAnnotations.rollout", "second"),
        3,
        Duration::from_secs(240),
    )
    .await?;
    set_message(&env.client, "after the rollout").await?;
    wait_for_message(&env.client, "after the rollout").await?;
    assert_one_leader_by_metrics(&env, &token).await?;
    let log = env.audit_log()?;
    let terms = audit::acquisitions(&log, &env.namespace, LEASE);
    ensure!(terms.len() >= 3, "terms of the whole session: {terms:?}");
    let handovers = audit::handovers(&terms, rollout_began);
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.namespace);
    let leader = pods.get(&handovers.last_holder).await?;
    ensure!(
        handovers.moves == 1
            && leader.annotations().get("rollout").map(String::as_str) == Some("second"),
        "leadership during the rollout: {handovers:?}, ending on {} with annotations {:?}",
        handovers.last_holder,
        leader.annotations()
    );
    // Every write the Pods made (the example's, in `default`), judged by when it took effect.
    env.assert_fenced(None, 6, 3).await?;

    // 7. Scale-out: `helm upgrade` to four shard Leases, then the container of the replica
    //    leading the example's shard SIGKILLed from the host: the shard moves on the
    //    kubelet's report, as the single Lease does (issue 30, hole 6: it waited for the
    //    dead member's Lease to expire, and its own restarted container took it back).
    e2e::chart::roll(
        &mut helm(&env)?,
        &env.client,
        (RELEASE, &env.namespace),
        ("sharding.leases", &SHARD_LEASES.to_string()),
        3,
        Duration::from_secs(240),
    )
    .await?;
    let pods = wait_for_ready_pods(&env, 3).await?;
    let live: Vec<&str> = pods.iter().map(String::as_str).collect();
    let steady = e2e::shards::wait_steady(
        &env.client,
        &env.namespace,
        SHARD_LEASES,
        &live,
        READY_WITHIN,
    )
    .await?;
    let key = ShardKey::new(SHARD_LEASES);
    let shard = e2e::shards::shard_by_name(&env.client, "default", key).await?[EXAMPLE];
    let victim = steady.holders[shard].clone();
    let shard_lease = format!("{LEASE}-{shard}");
    let term = |lease: &Lease| {
        let holder = kube_leasehold::replicas::exit::Holder::of(lease).map(|h| h.instance);
        let spec = lease.spec.clone().unwrap_or_default();
        (
            spec.holder_identity.unwrap_or_default(),
            holder,
            spec.acquire_time,
        )
    };
    let before = term(&lease.get(&shard_lease).await?);
    let pid = e2e::node::pod_process(&victim, "/myresource-operator")?;
    let killed_at = Instant::now();
    e2e::node::sigkill(pid)?;
    set_message(&env.client, "after the shard kill").await?;
    wait_for_message(&env.client, "after the shard kill").await?;
    let shard_failover = killed_at.elapsed();
    let after = term(&lease.get(&shard_lease).await?);
    eprintln!(
        "container of {victim} (leading shard {shard}) SIGKILLed: {} (instance {:?}) leads it \
         and reconciled a change made right after the kill in {:.2} s",
        after.0,
        after.1,
        shard_failover.as_secs_f64()
    );
    // The new term may be the restarted container's (a live member, as the plan says) or
    // another replica's; not the killed process's.
    ensure!(
        shard_failover < CRASH_FAILOVER_WITHIN && after.1 != before.1 && after.2 != before.2,
        "shard {shard} failover took {shard_failover:?} ({before:?} → {after:?}), not under \
         {CRASH_FAILOVER_WITHIN:?} in a new term: the kubelet's report was not used"
    );

    // 8. helm uninstall: no operator object is left (the Leases go with their owner).
    run(helm(&env)?.args(["uninstall", RELEASE, "--wait"]), None)?;
    poll("every operator object to be gone", READY_WITHIN, || async {
        let left = operator_objects(&env.client, &env.namespace).await?;
        if !left.is_empty() {
            eprintln!("still there: {left:?}");
        }
        Ok(left.is_empty().then_some(()))
    })
    .await?;
    Ok(())
}

/// Waits until the release has `n` Pods, all Running and Ready; returns their names.
async fn wait_for_ready_pods(env: &TestEnv, n: usize) -> Result<Vec<String>> {
    e2e::chart::ready_pods(&env.client, &env.namespace, RELEASE, n, READY_WITHIN).await
}

/// Every live Pod's `/metrics`, read over the Pod network: exactly one reports leading.
/// The address of `pod`'s metrics endpoint.
async fn metrics_addr(env: &TestEnv, pod: &str) -> Result<SocketAddr> {
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.namespace);
    let ip = pods
        .get(pod)
        .await?
        .status
        .and_then(|s| s.pod_ip)
        .context("a Pod IP")?;
    Ok(SocketAddr::new(ip.parse()?, 8080))
}

/// A scrape of `pod` without a token gets 401, with a token whose user lacks the
/// metrics-reader role 403, and plain HTTP nothing.
async fn assert_metrics_refused_without_the_role(env: &TestEnv, pod: &str) -> Result<()> {
    let addr = metrics_addr(env, pod).await?;
    let stranger = env.service_account_token("stranger").await?;
    let (code, _) = e2e::operator::https_get(addr, "/metrics", None, None).await?;
    ensure!(
        code == 401,
        "{pod}: a scrape without a token got {code}, not 401"
    );
    let (code, _) = e2e::operator::https_get(addr, "/metrics", None, Some(&stranger)).await?;
    ensure!(
        code == 403,
        "{pod}: a token without the role got {code}, not 403"
    );
    let plain = http_get(addr, "/metrics").await;
    ensure!(
        !matches!(plain, Ok((200, _))),
        "{pod}: plain HTTP scraped the metrics: {plain:?}"
    );
    Ok(())
}

async fn assert_one_leader_by_metrics(env: &TestEnv, token: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.namespace);
    let list = pods.list(&ListParams::default().labels(SELECTOR)).await?;
    let series = format!("leader_election_master_status{{name=\"{LEASE}\"}} 1");
    let mut leading = Vec::new();
    for pod in list
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
    {
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .context("a Pod IP")?;
        let addr = SocketAddr::new(ip.parse()?, 8080);
        let (code, body) = e2e::operator::https_get(addr, "/metrics", None, Some(token)).await?;
        ensure!(code == 200, "{}: /metrics answered {code}", pod.name_any());
        if body.lines().any(|l| l == series) {
            leading.push(pod.name_any());
        }
    }
    ensure!(leading.len() == 1, "Pods reporting leadership: {leading:?}");
    Ok(())
}

async fn set_message(client: &Client, message: &str) -> Result<()> {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), "default");
    let patch = json!({"spec": {"message": message}});
    mrs.patch(EXAMPLE, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Waits until the example's ConfigMap carries `message`.
async fn wait_for_message(client: &Client, message: &str) -> Result<()> {
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    poll(
        &format!("the ConfigMap to say {message:?}"),
        FAILOVER_WITHIN,
        || async {
            let cm = configmaps.get_opt(EXAMPLE).await?;
            let data = cm.and_then(|c| c.data).unwrap_or_default();
            Ok(data.values().any(|v| v == message).then_some(()))
        },
    )
    .await
}

async fn restarts(client: &Client, namespace: &str, pod: &str) -> Result<i32> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods.get(pod).await?;
    Ok(pod
        .status
        .and_then(|s| s.container_statuses)
        .unwrap_or_default()
        .iter()
        .map(|c| c.restart_count)
        .sum())
}

/// Every binding that names a ServiceAccount of `namespace` is the chart's.
async fn assert_only_the_charts_bindings(client: &Client, namespace: &str) -> Result<()> {
    let names_account = |subjects: &Option<Vec<Subject>>| {
        subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount"
                && s.name == FULLNAME
                && s.namespace.as_deref() == Some(namespace)
        })
    };
    let cluster: Api<ClusterRoleBinding> = Api::all(client.clone());
    let mut bindings: Vec<String> = cluster
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|b| names_account(&b.subjects))
        .map(|b| format!("ClusterRoleBinding/{}", b.name_any()))
        .collect();
    let namespaced: Api<RoleBinding> = Api::all(client.clone());
    bindings.extend(
        namespaced
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|b| names_account(&b.subjects))
            .map(|b| {
                format!(
                    "RoleBinding/{}/{}",
                    b.namespace().unwrap_or_default(),
                    b.name_any()
                )
            }),
    );
    bindings.sort();
    let want = vec![
        format!("ClusterRoleBinding/{FULLNAME}"),
        format!("ClusterRoleBinding/{FULLNAME}-metrics-auth"),
        format!("RoleBinding/{namespace}/{FULLNAME}-leader-election"),
    ];
    ensure!(
        bindings == want,
        "bindings naming the operator's account: {bindings:?}"
    );
    Ok(())
}

/// What of the release is left: Deployment, Pods, ServiceAccount, RBAC, Service, PDB, Lease.
async fn operator_objects(client: &Client, namespace: &str) -> Result<Vec<String>> {
    let mut left = Vec::new();
    let params = ListParams::default().labels(SELECTOR);
    macro_rules! namespaced {
        ($kind:ty, $name:literal) => {
            let api: Api<$kind> = Api::namespaced(client.clone(), namespace);
            left.extend(
                api.list(&params)
                    .await?
                    .items
                    .iter()
                    .map(|o| format!("{}/{}", $name, o.name_any())),
            );
        };
    }
    namespaced!(Deployment, "Deployment");
    namespaced!(Pod, "Pod");
    namespaced!(ServiceAccount, "ServiceAccount");
    namespaced!(Role, "Role");
    namespaced!(RoleBinding, "RoleBinding");
    namespaced!(Service, "Service");
    namespaced!(PodDisruptionBudget, "PodDisruptionBudget");
    let roles: Api<ClusterRole> = Api::all(client.clone());
    left.extend(
        roles
            .list(&params)
            .await?
            .items
            .iter()
            .map(|o| format!("ClusterRole/{}", o.name_any())),
    );
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    left.extend(
        bindings
            .list(&params)
            .await?
            .items
            .iter()
            .map(|o| format!("ClusterRoleBinding/{}", o.name_any())),
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    if leases.get_opt(LEASE).await?.is_some() {
        left.push(format!("Lease/{LEASE}"));
    }
    Ok(left)
}
