//! Three replicas as real processes: one leader at a time, failover on SIGKILL, a fast
//! handover on SIGTERM with no LIST and no write at takeover, fencing of a frozen or
//! partitioned leader (proven from the audit log), ten leader kills under a workload,
//! foreign writes to the Lease and replicas with different timings.
//! Lease timings are the test defaults: 4 s / 3 s / 1 s.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use e2e::audit;
use e2e::harness::{self, TestEnv};
use e2e::lease::TEST_TIMINGS;
use e2e::objects::{create, set_message, wait_converged};
use e2e::operator::{Operator, wait_for_log};
use e2e::proxy::Proxy;
use e2e::wait::poll;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use myresource_operator::resource::{MyResource, MyResourceSpec};
use serde_json::json;

const LEASE_DURATION: Duration = TEST_TIMINGS.lease_duration;
const RETRY_PERIOD: Duration = TEST_TIMINGS.retry_period;

async fn start_replicas(env: &TestEnv, names: &[&str]) -> Result<Vec<Operator>> {
    let mut replicas = Vec::new();
    for name in names {
        replicas.push(Operator::start(env.operator_config(name, &[]))?);
    }
    for r in &mut replicas {
        r.wait_ready().await?;
    }
    Ok(replicas)
}

/// Waits until the Lease names a replica other than `not`, and returns its index.
async fn wait_for_leader(env: &TestEnv, replicas: &[Operator], not: Option<&str>) -> Result<usize> {
    poll("a leader", Duration::from_secs(30), || async {
        let holder = env.lease_holder().await?.unwrap_or_default();
        Ok(replicas
            .iter()
            .position(|r| r.config.identity == holder && Some(holder.as_str()) != not))
    })
    .await
}

/// Waits until `op` logs that it lost leadership and stays a follower; returns that line.
async fn stepped_down(op: &Operator, what: &str, limit: Duration) -> Result<serde_json::Value> {
    wait_for_log(op, what, limit, |l| {
        l["message"] == "lost leadership: stopping workers, staying a follower"
    })
    .await
}

/// The timestamp of a JSON log line.
fn at(line: &serde_json::Value) -> Timestamp {
    line["timestamp"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("log lines carry a timestamp")
}

#[tokio::test]
async fn one_leader_at_a_time_and_sigkill_failover() -> Result<()> {
    let env = harness::setup("kill").await?;
    create(&env, 3, "before").await?;
    let mut replicas = start_replicas(&env, &["a", "b", "c"]).await?;
    let leader = wait_for_leader(&env, &replicas, None).await?;
    wait_converged(&env, Duration::from_secs(20)).await?;

    // Exactly one replica has ever acquired the Lease, and it is the holder.
    let sample_until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < sample_until {
        let acquired: Vec<_> = replicas
            .iter()
            .filter(|r| r.log().contains("acquired the Lease"))
            .map(|r| r.config.identity.clone())
            .collect();
        assert_eq!(acquired, vec![replicas[leader].config.identity.clone()]);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let old = replicas[leader].config.identity.clone();
    replicas[leader].kill();
    let killed = Instant::now();
    set_message(&env, "o1", "after the kill").await?;
    wait_converged(&env, Duration::from_secs(30)).await?;
    let failover = killed.elapsed();
    let bound = LEASE_DURATION + RETRY_PERIOD + Duration::from_secs(1);
    eprintln!("SIGKILL failover to a reconciled change: {failover:?} (bound {bound:?})");
    assert!(
        failover <= bound,
        "failover took {failover:?}, more than {bound:?}"
    );
    let new = wait_for_leader(&env, &replicas, Some(&old)).await?;
    assert_ne!(new, leader);
    // One writer at a time around the kill, from the audit log by effect order.
    env.assert_fenced(None, 6, 2).await?;
    Ok(())
}

#[tokio::test]
async fn sigterm_hands_over_fast_with_no_list_and_no_write() -> Result<()> {
    let env = harness::setup("term").await?;
    create(&env, 5, "steady").await?;
    let mut replicas = start_replicas(&env, &["a", "b", "c"]).await?;
    let leader = wait_for_leader(&env, &replicas, None).await?;
    wait_converged(&env, Duration::from_secs(20)).await?;

    let old = replicas[leader].config.identity.clone();
    // The handover's clock starts at the signal (stop sends SIGTERM, then waits for the exit).
    let signalled = Timestamp::now();
    replicas[leader].stop();
    let log = replicas[leader].log();
    assert!(
        log.contains("released the Lease"),
        "the leader did not release the Lease: {}",
        log.lines().rev().take(5).collect::<Vec<_>>().join("\n")
    );
    let new = wait_for_leader(&env, &replicas, Some(&old)).await?;
    let first = wait_for_log(
        &replicas[new],
        "the new leader's first reconcile",
        Duration::from_secs(10),
        |l| l["message"] == "reconciled",
    )
    .await?;
    let handover = at(&first).duration_since(signalled);
    eprintln!(
        "SIGTERM handover: SIGTERM to the old leader → new leader's first reconcile in {handover:?}"
    );
    assert!(handover.as_secs_f64() <= 1.0, "handover took {handover:?}");

    // Let the new leader reconcile every key, then read what it did after acquiring.
    for i in 0..5 {
        let key = format!("{}/o{i}", env.namespace);
        wait_for_log(&replicas[new], &key, Duration::from_secs(10), |l| {
            l["message"] == "reconciled" && l["myresource"] == key.as_str()
        })
        .await?;
    }
    let events = env.audit_log()?;
    let terms = audit::acquisitions(&events, &env.namespace, "myresource-operator");
    let new_id = replicas[new].config.identity.clone();
    let acquired = terms
        .iter()
        .find(|t| t.holder == new_id)
        .expect("the new leader's term is in the audit log")
        .at;
    let after: Vec<_> = events
        .iter()
        .filter(|e| {
            e.replica() == Some(new_id.as_str()) && e.request_received_timestamp >= acquired
        })
        .filter(|e| e.resource() != "leases" && (e.verb == "list" || e.is_write()))
        .map(|e| format!("{} {:?}", e.verb, e.object_ref))
        .collect();
    assert!(
        after.is_empty(),
        "the new leader listed or wrote at takeover: {after:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_frozen_leader_writes_nothing_after_takeover_and_stays_a_follower() -> Result<()> {
    let env = harness::setup("freeze").await?;
    create(&env, 5, "v0").await?;
    let mut replicas = start_replicas(&env, &["a", "b"]).await?;
    let leader = wait_for_leader(&env, &replicas, None).await?;
    wait_converged(&env, Duration::from_secs(20)).await?;
    let old = replicas[leader].config.identity.clone();

    // Frozen in the middle of a burst, with reconciles in flight: when it wakes, they go on
    // to their next write, which the fence (closed by the monotonic clock, which ran on
    // during the freeze) must refuse without sending.
    let burst = burst(&env, BURST).await?;
    replicas[leader].process.signal(libc::SIGSTOP);
    eprintln!("frozen with {burst} of {BURST} ConfigMaps of the burst written");
    // Changes while it is frozen: its caches will show them when it wakes.
    for i in 0..5 {
        set_message(&env, &format!("o{i}"), "v1").await?;
    }
    let new = wait_for_leader(&env, &replicas, Some(&old)).await?;
    wait_converged(&env, Duration::from_secs(20)).await?;
    tokio::time::sleep(LEASE_DURATION).await; // frozen well past the lease duration
    for i in 0..5 {
        set_message(&env, &format!("o{i}"), "v2").await?;
    }
    replicas[leader].process.signal(libc::SIGCONT);
    stepped_down(
        &replicas[leader],
        "the old leader to step down",
        Duration::from_secs(10),
    )
    .await?;
    wait_converged(&env, Duration::from_secs(20)).await?;
    let refused = replicas[leader]
        .log_lines()
        .into_iter()
        .filter(|l| l["message"] == "reconcile failed" && l["kind"] == "not_leader")
        .count();
    eprintln!("writes the fence refused after the freeze: {refused}");
    assert!(
        refused > 0,
        "the woken leader's reconciles in flight must meet a closed fence"
    );
    assert!(
        replicas[leader].process.is_running(),
        "the old leader must stay up as a follower"
    );
    assert_eq!(
        env.lease_holder().await?.as_deref(),
        Some(replicas[new].config.identity.as_str())
    );
    env.assert_fenced(None, 10, 2).await?;
    Ok(())
}

/// Objects in the frozen leader's burst.
const BURST: usize = 200;

/// Creates `count` objects at once and returns as soon as some of their ConfigMaps exist
/// (the leader is reconciling them) but not all (it has more in flight and queued): the
/// number written by then.
async fn burst(env: &TestEnv, count: usize) -> Result<usize> {
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    let mut creates = tokio::task::JoinSet::new();
    for i in 0..count {
        let mrs = mrs.clone();
        let mr = MyResource::new(
            &format!("burst-{i}"),
            MyResourceSpec {
                message: "burst".into(),
                some_value: i as i32,
            },
        );
        creates.spawn(async move { mrs.create(&PostParams::default(), &mr).await });
    }
    while let Some(created) = creates.join_next().await {
        created??;
    }
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    let written = poll(
        "the leader to start on the burst",
        Duration::from_secs(20),
        || async {
            let n = cms
                .list(&Default::default())
                .await?
                .items
                .iter()
                .filter(|c| {
                    c.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.starts_with("burst-"))
                })
                .count();
            Ok((n >= 8).then_some(n))
        },
    )
    .await?;
    if written == count {
        bail!("the leader finished the burst of {count} before it could be frozen");
    }
    Ok(written)
}

#[tokio::test]
async fn a_partitioned_leader_steps_down_in_time_and_rejoins() -> Result<()> {
    let env = harness::setup("partition").await?;
    create(&env, 5, "v0").await?;
    let apiserver = env.shared.server.trim_start_matches("https://").parse()?;
    let proxy = Proxy::start(apiserver).await?;
    let mut config = env.operator_config("cut", &[]);
    config.kubeconfig = env.kubeconfig_via(proxy.addr, "cut")?;
    let mut cut = Operator::start(config)?;
    cut.wait_ready().await?;
    poll(
        "the proxied replica to lead",
        Duration::from_secs(20),
        || async {
            Ok(
                (env.lease_holder().await?.as_deref() == Some(cut.config.identity.as_str()))
                    .then_some(()),
            )
        },
    )
    .await?;
    let mut other = env.start_operator("other", &[]).await?;
    wait_converged(&env, Duration::from_secs(20)).await?;

    proxy.block();
    let blocked = Timestamp::now();
    for i in 0..5 {
        set_message(&env, &format!("o{i}"), "v1").await?;
    }
    let lost = stepped_down(
        &cut,
        "the cut-off leader to step down",
        Duration::from_secs(15),
    )
    .await?;
    let stepped_down = at(&lost).duration_since(blocked);
    eprintln!(
        "partitioned leader stepped down {stepped_down:?} after the cut (renew deadline 3 s)"
    );
    assert!(
        stepped_down.as_secs_f64() <= 3.5,
        "stepped down after {stepped_down:?}"
    );
    poll(
        "the other replica to lead",
        Duration::from_secs(20),
        || async {
            Ok(
                (env.lease_holder().await?.as_deref() == Some(other.config.identity.as_str()))
                    .then_some(()),
            )
        },
    )
    .await?;
    wait_converged(&env, Duration::from_secs(20)).await?;

    proxy.heal();
    for i in 0..5 {
        set_message(&env, &format!("o{i}"), "v2").await?;
    }
    wait_converged(&env, Duration::from_secs(20)).await?;
    // Rejoined: up, ready (caches re-synced through the healed proxy), and a follower.
    cut.wait_ready().await?;
    assert!(cut.process.is_running() && other.process.is_running());
    assert_eq!(
        env.lease_holder().await?.as_deref(),
        Some(other.config.identity.as_str())
    );
    env.assert_fenced(None, 10, 2).await?;
    Ok(())
}

#[tokio::test]
async fn ten_leader_kills_under_a_workload_lose_nothing() -> Result<()> {
    let env = harness::setup("tenkills").await?;
    create(&env, 100, "g0").await?;
    let mut replicas = start_replicas(&env, &["r0", "r1", "r2"]).await?;
    wait_for_leader(&env, &replicas, None).await?;

    let workload = {
        let client = env.client.clone();
        let namespace = env.namespace.clone();
        tokio::spawn(async move {
            let mrs: Api<MyResource> = Api::namespaced(client, &namespace);
            // Bounded: at most 2,000 updates, 20 per second.
            for n in 0..2_000u32 {
                let patch = Patch::Merge(json!({"spec": {"message": format!("g{n}")}}));
                let _ = mrs
                    .patch(&format!("o{}", n % 100), &PatchParams::default(), &patch)
                    .await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    let mut generation = 0;
    let mut last_kill = Instant::now();
    for kill in 0..10 {
        let leader = wait_for_leader(&env, &replicas, None).await?;
        // Let the leader do some work before it dies.
        tokio::time::sleep(Duration::from_millis(500)).await;
        replicas[leader].kill();
        last_kill = Instant::now();
        generation += 1;
        let name = format!("r{leader}-{generation}");
        let mut replacement = Operator::start(env.operator_config(&name, &[]))?;
        replacement.wait_ready().await?;
        replicas[leader] = replacement;
        eprintln!("kill {} done", kill + 1);
    }
    workload.abort();
    let limit = LEASE_DURATION + Duration::from_secs(5);
    let remaining = limit.saturating_sub(last_kill.elapsed());
    if remaining.is_zero() {
        bail!("no time left to converge");
    }
    wait_converged(&env, remaining).await?;
    eprintln!("converged {:?} after the last kill", last_kill.elapsed());
    env.assert_fenced(None, 100, 11).await?;
    Ok(())
}

/// Patches every `o{i}` (i < count) with `message`, `rounds` times, while a fault goes on.
fn churn(env: &TestEnv, count: usize, rounds: u32) -> tokio::task::JoinHandle<()> {
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    tokio::spawn(async move {
        for n in 0..rounds {
            for i in 0..count {
                let patch = Patch::Merge(json!({"spec": {"message": format!("churn{n}")}}));
                let _ = mrs
                    .patch(&format!("o{i}"), &PatchParams::default(), &patch)
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

/// Issue 13, items 3–5: the Lease deleted, its holder cleared, and relabelled every 2 s
/// by foreign writers. None of them may produce a second writer; the relabels may not keep
/// a killed leader's Lease alive.
#[tokio::test]
async fn foreign_writes_to_the_lease_never_make_two_writers() -> Result<()> {
    let env = harness::setup("foreign").await?;
    create(&env, 5, "v0").await?;
    let mut replicas = start_replicas(&env, &["a", "b", "c"]).await?;
    wait_for_leader(&env, &replicas, None).await?;
    wait_converged(&env, Duration::from_secs(20)).await?;
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);

    // Deleted under a working leader, then its holder cleared: a writer each time, never two.
    let work = churn(&env, 5, 20);
    leases
        .delete("myresource-operator", &Default::default())
        .await?;
    wait_for_leader(&env, &replicas, None).await?;
    e2e::foreign_lease::set_holder(&leases, "myresource-operator", "").await?;
    wait_for_leader(&env, &replicas, None).await?;
    work.await?;
    wait_converged(&env, Duration::from_secs(20)).await?;

    // Its holder renamed to a live former holder (issue 30, hole 2): a leader frozen until
    // deposed, then woken, must not renew that record as its own while the real holder's
    // term runs.
    let former = wait_for_leader(&env, &replicas, None).await?;
    let former_id = replicas[former].config.identity.clone();
    replicas[former].process.signal(libc::SIGSTOP);
    let deposed = wait_for_leader(&env, &replicas, Some(&former_id)).await;
    replicas[former].process.signal(libc::SIGCONT);
    deposed?;
    stepped_down(
        &replicas[former],
        "the former holder to step down",
        Duration::from_secs(10),
    )
    .await?;
    let work = churn(&env, 5, 20);
    e2e::foreign_lease::set_holder(&leases, "myresource-operator", &former_id).await?;
    work.await?;
    wait_converged(&env, Duration::from_secs(20)).await?;

    // Relabelled every 2 s (bounded: 15 times) while the leader is killed.
    let relabel = {
        let leases = leases.clone();
        tokio::spawn(async move {
            for n in 0..15u32 {
                let label = json!({"metadata": {"labels": {"gitops-tick": n.to_string()}}});
                let _ = leases
                    .patch(
                        "myresource-operator",
                        &PatchParams::default(),
                        &Patch::Merge(label),
                    )
                    .await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        })
    };
    let leader = wait_for_leader(&env, &replicas, None).await?;
    let old = replicas[leader].config.identity.clone();
    replicas[leader].kill();
    let killed = Instant::now();
    wait_for_leader(&env, &replicas, Some(&old)).await?;
    let failover = killed.elapsed();
    relabel.abort();
    let bound = LEASE_DURATION + RETRY_PERIOD + Duration::from_secs(1);
    eprintln!(
        "SIGKILL failover with the Lease relabelled every 2 s: {failover:?} (bound {bound:?})"
    );
    assert!(failover <= bound, "failover took {failover:?}");
    set_message(&env, "o0", "after").await?;
    wait_converged(&env, Duration::from_secs(20)).await?;
    env.assert_fenced(None, 10, 2).await?;
    Ok(())
}

/// Issue 13, item 6: a leader with long timings (12 s / 8 s / 2 s) and followers with the
/// test's 4 s / 3 s / 1 s. Frozen for 6 s — past the followers' own lease duration, inside
/// its renew deadline — it wakes with its fence open; the followers must have waited for
/// the record's 12 s, so nobody else wrote meanwhile.
#[tokio::test]
async fn followers_wait_for_the_lease_duration_the_leader_wrote() -> Result<()> {
    let env = harness::setup("mixed").await?;
    create(&env, 5, "v0").await?;
    let slow = [
        "--lease-duration=12s",
        "--renew-deadline=8s",
        "--retry-period=2s",
    ];
    let mut first = env.start_operator("long", &slow).await?;
    poll(
        "the long-timed replica to lead",
        Duration::from_secs(20),
        || async {
            Ok(
                (env.lease_holder().await?.as_deref() == Some(first.config.identity.as_str()))
                    .then_some(()),
            )
        },
    )
    .await?;
    let mut others = start_replicas(&env, &["s1", "s2"]).await?;
    wait_converged(&env, Duration::from_secs(20)).await?;

    let frozen = Timestamp::now();
    first.process.signal(libc::SIGSTOP);
    let work = churn(&env, 5, 10);
    tokio::time::sleep(Duration::from_secs(6)).await;
    first.process.signal(libc::SIGCONT);
    work.await?;
    wait_converged(&env, Duration::from_secs(30)).await?;
    env.assert_fenced(None, 10, 1).await?;
    // Had a follower taken over during the freeze, the check above could pass only because
    // the woken leader happened not to write: no other term may begin while it is frozen.
    let terms = audit::acquisitions(&env.audit_log()?, &env.namespace, e2e::lease::NAME);
    let others_terms: Vec<_> = terms
        .iter()
        .filter(|t| t.at >= frozen && t.holder != first.config.identity)
        .collect();
    assert!(
        others_terms.is_empty(),
        "terms begun during or after the freeze: {others_terms:?}"
    );
    for r in others.iter_mut().chain([&mut first]) {
        assert!(r.process.is_running());
    }
    Ok(())
}
