//! Scale-out mode (`sharding.leases`): two replicas holding every shard Lease with the
//! chart's wider Lease rights, scraped by Prometheus.

use e2e::prometheus::Prometheus;

use super::metrics::*;
use super::*;

#[tokio::test]
async fn scale_out_replicas_with_the_charts_rbac_hold_every_shard() -> Result<()> {
    const SHARDS: usize = 4;
    let env = harness::setup("chart-scaleout").await?;
    let ns = env.namespace.clone();
    let leases = format!("sharding.leases={SHARDS}");
    let kubeconfig = install_without_replicas(&env, "sharded", &["--set", &leases])?;
    let mut replicas = Vec::new();
    for name in ["a", "b"] {
        let mut config = env.operator_config(
            name,
            &[
                "--lease-name=myresource-operator",
                &format!("--shard-leases={SHARDS}"),
            ],
        );
        config.kubeconfig = kubeconfig.clone();
        replicas.push(Operator::start(config)?);
    }
    for r in &mut replicas {
        r.wait_ready().await?;
    }
    e2e::objects::create(&env, 12, "scale-out").await?;
    let ids: Vec<String> = replicas.iter().map(|r| r.config.identity.clone()).collect();
    let both: Vec<&str> = ids.iter().map(String::as_str).collect();
    // Every shard Lease held, fairly, each replica warm for its plan; every object converges.
    let steady = e2e::shards::wait_steady(&env.client, &ns, SHARDS, &both, Duration::from_secs(60))
        .await
        .with_context(|| format!("forbidden requests:\n{}", forbidden(&replicas)))?;
    assert!(
        steady.holders.iter().all(|h| both.contains(&h.as_str())),
        "{steady:?}"
    );
    e2e::objects::wait_converged(&env, Duration::from_secs(60))
        .await
        .with_context(|| format!("forbidden requests:\n{}", forbidden(&replicas)))?;
    assert_nothing_forbidden(&replicas);

    // A real Prometheus scrapes both and runs the chart's scale-out rules; the shard ownership
    // panel shows who holds which shard Lease.
    let rules = rendered_rules(&["--set", &leases])?;
    let prometheus = Prometheus::start(&env, &replicas, &rules).await?;
    e2e::objects::set_message(&env, "o0", "scraped").await?;
    prometheus.check_rules()?;
    check_dashboard(&prometheus, &ns, true).await?;
    let ownership = dashboard_queries(&ns)?
        .into_iter()
        .find(|q| q.title == "Shard ownership")
        .context("a Shard ownership panel")?;
    let expected: BTreeMap<String, String> = (0..SHARDS)
        .map(|i| {
            (
                format!("myresource-operator-{i}"),
                steady.holders[i].clone(),
            )
        })
        .collect();
    poll(
        "the ownership panel to match the Leases",
        Duration::from_secs(30),
        || async {
            let shown: BTreeMap<String, String> = prometheus
                .query(&ownership.expr)
                .await?
                .iter()
                .map(|s| {
                    let label = |l: &str| s["metric"][l].as_str().unwrap_or_default().to_string();
                    (label("name"), label("pod"))
                })
                .collect();
            Ok((shown == expected).then_some(()))
        },
    )
    .await?;
    assert_leader_alert_inactive(&prometheus, &rules, "MyResourceOperatorShardWithoutLeader")
        .await?;
    // With one shard Lease more than the replicas hold, the same rule fires.
    let more = alert_exprs(&rendered_rules(&[
        "--set",
        &format!("sharding.leases={}", SHARDS + 1),
    ])?);
    let fired = prometheus
        .query(&more["MyResourceOperatorShardWithoutLeader"])
        .await?;
    assert!(
        fired.len() == 1
            && fired[0]["value"][1].as_str().and_then(|v| v.parse().ok()) == Some(SHARDS),
        "{SHARDS} of {} shards led: {fired:?}",
        SHARDS + 1
    );

    // Leaving clears the member Lease (a tombstone) and hands every shard to the other
    // replica. A renew of the departed replica that arrives late — replayed here as it was
    // written while it was live — fails against the tombstone instead of bringing it back
    // (issue 30, hole 6: with the Lease deleted, a late create succeeded).
    let leases =
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(env.client.clone(), &ns);
    let member = kube_leasehold::scaleout::membership::member_lease("myresource-operator", both[0]);
    let live = leases.get(&member).await?;
    replicas[0].stop();
    e2e::shards::wait_steady(
        &env.client,
        &ns,
        SHARDS,
        &both[1..],
        Duration::from_secs(60),
    )
    .await?;
    let left = leases.get(&member).await?;
    assert_eq!(
        left.spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref()),
        Some(""),
        "{member} is not a tombstone: {left:?}"
    );
    let late_replace = leases.replace(&member, &PostParams::default(), &live).await;
    let mut recreated = live.clone();
    recreated.metadata.resource_version = None;
    let late_create = leases.create(&PostParams::default(), &recreated).await;
    for (what, result) in [("replace", late_replace), ("create", late_create)] {
        assert!(
            matches!(&result, Err(kube::Error::Api(s)) if s.code == 409),
            "a late {what} of {member}: {result:?}"
        );
    }
    assert_eq!(leases.get(&member).await?.spec, left.spec);
    e2e::objects::set_message(&env, "o1", "one replica").await?;
    e2e::objects::wait_converged(&env, Duration::from_secs(60)).await?;
    assert_nothing_forbidden(&replicas);
    Ok(())
}
