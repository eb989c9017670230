//! The scale-out scenario both scale-out test binaries run, on a server that serves
//! `shardSelector` and on one that does not: three replicas split six shards and all
//! reconcile; a fourth joins and the shards rebalance; one is SIGKILLed and its shards move
//! to their warm standbys with no LIST; the group shrinks to one, which leads every shard.
//! Throughout, the audit log shows no write by a replica outside its shard's term. On the
//! way, a ConfigMap left by an earlier MyResource of a name, outside every shard's cache, is
//! replaced by the new MyResource's.
//! Lease timings: 4 s / 3 s / 1 s.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use e2e::audit;
use e2e::harness::TestEnv;
use e2e::lease::TEST_TIMINGS;
use e2e::objects::{create, leftover_configmap, set_message, wait_converged};
use e2e::operator::{Operator, http_get};
use e2e::shards::{self, Snapshot};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use kube_leasehold::scaleout::shard_key::ShardKey;
use myresource_operator::resource::{MyResource, MyResourceSpec};

const SHARDS: usize = 6;
const OBJECTS: usize = 30;

async fn start(env: &TestEnv, name: &str) -> Result<Operator> {
    env.start_operator(name, &[&format!("--shard-leases={SHARDS}")])
        .await
}

fn identities(replicas: &[&Operator]) -> Vec<String> {
    replicas.iter().map(|r| r.config.identity.clone()).collect()
}

async fn steady(env: &TestEnv, live: &[&Operator]) -> Result<Snapshot> {
    let ids = identities(live);
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    shards::wait_steady(
        &env.client,
        &env.namespace,
        SHARDS,
        &ids,
        Duration::from_secs(60),
    )
    .await
}

async fn change_all(env: &TestEnv, message: &str) -> Result<()> {
    for i in 0..OBJECTS {
        set_message(env, &format!("o{i}"), message).await?;
    }
    wait_converged(env, Duration::from_secs(60)).await
}

/// The value of the metric line starting with `series`, if the replica serves it.
async fn metric(op: &Operator, series: &str) -> Result<Option<f64>> {
    let (_, body) = http_get(op.metrics, "/metrics").await?;
    Ok(body
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok()))
}

/// What a deleted MyResource leaves when garbage collection lags: its ConfigMap, controlled
/// by a MyResource of the same name with another uid. Without a shard bucket label no
/// shard's cache shows it (a leftover labelled with the earlier owner's bucket is outside
/// the new owner's shard the same way): the new MyResource's reconcile must find it by
/// reading, replace it, and converge. Its owner's apiVersion is one the server does not
/// serve (a CRD version since removed), so the garbage collector cannot judge it and leaves
/// it to the operator. The object is deleted afterwards.
async fn leftover_is_replaced(env: &TestEnv) -> Result<()> {
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    let leftover = leftover_configmap("again", "trstringer.com/v1alpha1");
    cms.create(&PostParams::default(), &leftover).await?;
    let spec = MyResourceSpec {
        message: "new".into(),
        some_value: 2,
    };
    let mr = mrs
        .create(&PostParams::default(), &MyResource::new("again", spec))
        .await?;
    wait_converged(env, Duration::from_secs(30)).await?;
    let owner = cms.get("again").await?.metadata.owner_references;
    ensure!(
        owner.as_ref().and_then(|o| o.first()).map(|o| &o.uid) == mr.metadata.uid.as_ref(),
        "the leftover ConfigMap was not replaced: owners {owner:?}"
    );
    mrs.delete("again", &DeleteParams::default()).await?;
    Ok(())
}

pub async fn run(env: TestEnv, server_side: bool) -> Result<()> {
    let key = ShardKey::new(SHARDS);
    create(&env, OBJECTS, "v1").await?;
    let mut replicas = Vec::new();
    for name in ["a", "b", "c"] {
        replicas.push(start(&env, name).await?);
    }
    let three: Vec<&Operator> = replicas.iter().collect();
    steady(&env, &three).await?;
    wait_converged(&env, Duration::from_secs(60)).await?;
    let mode = if server_side { "server" } else { "client" };
    for r in &replicas {
        let series = format!("myresource_operator_shard_filter{{mode=\"{mode}\"}}");
        ensure!(
            metric(r, &series).await? == Some(1.0),
            "{} does not report filtering on the {mode} side",
            r.config.identity
        );
    }
    leftover_is_replaced(&env).await?;

    // Every replica reconciled its share (status writes by each).
    let log = env.shared.audit_log.as_ref().expect("local cluster");
    let events = audit::read(log)?;
    for id in identities(&three) {
        let writes = events
            .iter()
            .filter(|e| e.is_write() && e.succeeded() && e.replica() == Some(&id))
            .filter(|e| e.resource() == "myresources" && e.namespace() == env.namespace)
            .count();
        ensure!(writes > 0, "{id} reconciled nothing");
    }

    // A fourth joins: the shards rebalance to 2/2/1/1, and all reconcile.
    let joined_at = Timestamp::now();
    replicas.push(start(&env, "d").await?);
    let four: Vec<&Operator> = replicas.iter().collect();
    let before_kill = steady(&env, &four).await?;
    change_all(&env, "v2").await?;
    // The joiner listed the shards it was given before taking them (which also shows that
    // the takeover check below can see a shard's LISTs).
    let events = audit::read(log)?;
    let joiner = &replicas[3].config.identity;
    for shard in before_kill.held_by(joiner) {
        let lists = shards::shard_lists(&events, key, shard, joiner, joined_at, Timestamp::now());
        ensure!(
            !lists.is_empty(),
            "{joiner} leads shard {shard} without having listed it"
        );
    }

    // SIGKILL the replica holding the most shards: they go to their standbys.
    let victim = (0..replicas.len())
        .max_by_key(|i| before_kill.held_by(&replicas[*i].config.identity).len())
        .expect("four replicas");
    let orphans = before_kill.held_by(&replicas[victim].config.identity);
    let killed_at = Timestamp::now();
    let started = Instant::now();
    replicas[victim].kill();
    let mut dead = replicas.remove(victim);
    let survivors: Vec<&Operator> = replicas.iter().collect();
    let after_kill = steady(&env, &survivors).await?;
    let moved_in = started.elapsed();
    println!(
        "SIGKILL of {} ({} shards): moved and warm after {moved_in:?}",
        dead.config.identity,
        orphans.len()
    );
    let bound = TEST_TIMINGS.lease_duration + TEST_TIMINGS.retry_period;
    ensure!(
        moved_in < 3 * bound,
        "the dead replica's shards took {moved_in:?} to move (lease + retry is {bound:?})"
    );
    change_all(&env, "v3").await?;
    let events = audit::read(log)?;
    let terms = shards::terms(&events, &env.namespace, SHARDS);
    for shard in &orphans {
        let taker = &after_kill.holders[*shard];
        let taken = terms[*shard]
            .iter()
            .find(|t| &t.holder == taker && t.at >= killed_at)
            .map(|t| t.at)
            .ok_or_else(|| anyhow::anyhow!("no term of {taker} on shard {shard} after the kill"))?;
        let lists = shards::shard_lists(&events, key, *shard, taker, killed_at, taken);
        ensure!(
            lists.is_empty(),
            "{taker} listed shard {shard} to take it over: {:?}",
            lists.iter().map(|e| &e.request_uri).collect::<Vec<_>>()
        );
    }
    dead.stop();

    // Shrink to one (SIGTERM one by one): the last leads every shard.
    while replicas.len() > 1 {
        let mut leaving = replicas.remove(0);
        leaving.stop();
        let live: Vec<&Operator> = replicas.iter().collect();
        steady(&env, &live).await?;
    }
    let last = steady(&env, &[&replicas[0]]).await?;
    ensure!(last.held_by(&replicas[0].config.identity).len() == SHARDS);
    change_all(&env, "v4").await?;

    // Every write judged by its owner's uid and the shard Lease's terms when it took
    // effect; OBJECTS status writes at least, and a term per shard at least.
    env.assert_fenced(
        Some(shards::fences(&env.namespace, SHARDS)),
        OBJECTS,
        SHARDS,
    )
    .await?;
    Ok(())
}
