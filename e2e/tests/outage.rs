//! An API server outage (kube-apiserver stopped: connections refused) under three replicas.
//! Its own test binary, because it stops the binary's shared control plane.
//!
//! Proves (issue 13, item 8): while the server is gone, the replicas neither spin nor flood
//! their logs; when it returns, the replica the Lease names takes it back or a follower
//! whose clock ran out takes it over (one compare-and-swap wins; failed reads do not
//! restart a follower's clock, issue 30), with no lease-duration wait, and a change made
//! right after the return is reconciled within a lease duration
//! plus 2 s (the watches retry at the server's return, not at their 30 s backoff cap); no
//! replica writes after another acquired. A fourth replica serves secured metrics (issue 35):
//! during the outage a token it has not reviewed yet gets 503, never a pass, one it
//! reviewed before still gets its metrics, and its health endpoint answers.
//! Lease timings: 4 s / 3 s / 1 s.

use std::time::{Duration, Instant};

use anyhow::Result;
use e2e::harness::{self, TestEnv};
use e2e::lease::TEST_TIMINGS;
use e2e::operator::{Operator, http_get, https_get};
use e2e::process::cpu_seconds;
use e2e::wait::poll;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use myresource_operator::resource::{MyResource, MyResourceSpec};
use serde_json::json;

const OUTAGE: Duration = Duration::from_secs(20);
const LEASE_DURATION: Duration = TEST_TIMINGS.lease_duration;

/// The sum of `rest_client_requests_total` over every label set.
async fn requests(op: &Operator) -> Result<f64> {
    let (_, body) = http_get(op.metrics, "/metrics").await?;
    Ok(body
        .lines()
        .filter(|l| l.starts_with("rest_client_requests_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum())
}

async fn message_in_configmap(env: &TestEnv, name: &str) -> Result<Option<String>> {
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    Ok(cms
        .get_opt(name)
        .await?
        .and_then(|c| c.data)
        .and_then(|d| d.get("message").cloned()))
}

#[tokio::test]
async fn an_api_server_outage_costs_little_and_ends_at_the_servers_return() -> Result<()> {
    let env = harness::setup("outage").await?;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    let spec = MyResourceSpec {
        message: "before".into(),
        some_value: 1,
    };
    mrs.create(&PostParams::default(), &MyResource::new("o", spec))
        .await?;
    let mut replicas = Vec::new();
    for name in ["a", "b", "c"] {
        replicas.push(env.start_operator(name, &[]).await?);
    }
    // Secured metrics: a token reviewed before the outage, and one first shown during it.
    let reviewed = env.metrics_scraper("prometheus").await?;
    let unreviewed = env.service_account_token("prometheus").await?;
    let secured = env.start_operator("s", &["--metrics-secure"]).await?;
    let addr = secured.metrics;
    let scrape =
        |token: String| async move { https_get(addr, "/metrics", None, Some(&token)).await };
    let (code, _) = scrape(reviewed.clone()).await?;
    assert_eq!(
        code, 200,
        "a scrape with Prometheus' token before the outage"
    );
    let holder = poll("a leader", Duration::from_secs(30), || async {
        Ok(env.lease_holder().await?.filter(|h| !h.is_empty()))
    })
    .await?;
    poll("the first reconcile", Duration::from_secs(20), || async {
        Ok(message_in_configmap(&env, "o")
            .await?
            .filter(|m| m == "before"))
    })
    .await?;

    // The outage.
    let before: Vec<(f64, f64, usize)> = {
        let mut v = Vec::new();
        for r in &replicas {
            let cpu = cpu_seconds(r.process.pid).unwrap_or_default();
            v.push((requests(r).await?, cpu, r.log().lines().count()));
        }
        v
    };
    harness::stop_apiserver()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (code, _) = scrape(unreviewed.clone()).await?;
    assert_eq!(
        code, 503,
        "a token nobody can review in an outage: 503, never a pass"
    );
    let (code, _) = scrape(reviewed.clone()).await?;
    assert_eq!(
        code, 200,
        "a token reviewed before the outage (cached for 60 s)"
    );
    let (code, body) = http_get(secured.health, "/healthz").await?;
    assert_eq!(
        (code, body.as_str()),
        (200, "ok"),
        "health answers in an outage"
    );
    tokio::time::sleep(OUTAGE - Duration::from_secs(2)).await;
    for (r, (requests_before, cpu_before, lines_before)) in replicas.iter().zip(&before) {
        let sent = requests(r).await? - requests_before;
        let cpu = cpu_seconds(r.process.pid).unwrap_or_default() - cpu_before;
        let lines = r.log().lines().count() - lines_before;
        eprintln!(
            "{} during a {OUTAGE:?} outage: {sent} requests, {cpu:.2} s CPU, {lines} log lines",
            r.config.identity
        );
        // One election request per retry period (1–1.2 s) plus three watches backing off:
        // about 40. A busy loop made thousands.
        assert!(sent <= 100.0, "{sent} requests in {OUTAGE:?}");
        assert!(lines <= 30, "{lines} log lines in {OUTAGE:?}");
        assert!(
            cpu <= OUTAGE.as_secs_f64() * 0.25,
            "{cpu:.2} s of CPU in {OUTAGE:?}"
        );
    }

    // The return.
    harness::start_apiserver().await?;
    let returned = Instant::now();
    mrs.patch(
        "o",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"message": "after the outage"}})),
    )
    .await?;
    poll(
        "the change after the return",
        Duration::from_secs(40),
        || async {
            Ok(message_in_configmap(&env, "o")
                .await?
                .filter(|m| m == "after the outage"))
        },
    )
    .await?;
    let recovered = returned.elapsed();
    let bound = LEASE_DURATION + Duration::from_secs(2);
    eprintln!(
        "a change made at the server's return reconciled after {recovered:?} (goal {bound:?})"
    );
    assert!(recovered <= bound, "took {recovered:?}, goal {bound:?}");
    let after = env.lease_holder().await?.unwrap_or_default();
    assert!(
        replicas
            .iter()
            .chain([&secured])
            .any(|r| r.config.identity == after),
        "a replica holds the Lease, not {after:?} (before the outage: {holder})"
    );

    env.assert_fenced(None, 4, 1).await?;
    for r in &mut replicas {
        r.stop();
    }
    Ok(())
}
