//! Telemetry against the real control plane: traces in Jaeger (the operator's reconcile
//! span, its API request spans, and the API server's spans in the same trace), the metrics
//! of three replicas, and readiness that means "caches synced".

use std::time::Duration;

use anyhow::Result;
use e2e::harness::{self, TestEnv};
use e2e::operator::{Operator, http_get};
use e2e::proxy::Proxy;
use e2e::wait::poll;
use kube::Api;
use kube::api::PostParams;
use myresource_operator::resource::{MyResource, MyResourceSpec};
use serde_json::Value;

fn mr(name: &str) -> MyResource {
    MyResource::new(
        name,
        MyResourceSpec {
            message: "traced".into(),
            some_value: 1,
        },
    )
}

async fn wait_ready_status(env: &TestEnv, name: &str) -> Result<()> {
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    poll(&format!("{name} Ready"), Duration::from_secs(30), || {
        let mrs = mrs.clone();
        async move {
            let mr = mrs.get(name).await?;
            Ok(mr
                .status
                .is_some_and(|s| {
                    s.observed_generation == mr.metadata.generation
                        && s.conditions.iter().any(|c| c.status == "True")
                })
                .then_some(()))
        }
    })
    .await
}

/// Whether `trace` holds an API server span whose parent is one of the operator's request
/// spans (the API server continued the `traceparent` the operator sent).
fn api_server_span_under_an_operator_request(trace: &Value) -> bool {
    let spans = trace["spans"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let service = |s: &Value| {
        let process = s["processID"].as_str().unwrap_or_default();
        trace["processes"][process]["serviceName"].as_str()
    };
    let parent = |s: &Value| {
        let id = s["references"][0]["spanID"].as_str()?;
        spans.iter().find(|p| p["spanID"] == id)
    };
    spans.iter().any(|s| {
        service(s) == Some("apiserver")
            && parent(s).is_some_and(|p| {
                service(p) == Some("myresource-operator") && tag(p, "http.request.method").is_some()
            })
    })
}

fn tag<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["tags"]
        .as_array()?
        .iter()
        .find(|t| t["key"] == key)
        .map(|t| &t["value"])
}

#[tokio::test]
async fn a_reconcile_trace_holds_its_api_requests_and_the_api_servers_spans() -> Result<()> {
    let env = harness::setup_traced("traces").await?;
    let jaeger = env.shared.jaeger.expect("traced cluster");
    let mut config = env.operator_config("traced", &[]);
    config.env = vec![
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".into(),
            format!("http://{}", jaeger.otlp_grpc),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "200".into()),
        ("POD_NAMESPACE".into(), env.namespace.clone()),
    ];
    let mut op = Operator::start(config)?;
    op.wait_ready().await?;
    let name = "traced-object";
    Api::<MyResource>::namespaced(env.client.clone(), &env.namespace)
        .create(&PostParams::default(), &mr(name))
        .await?;
    wait_ready_status(&env, name).await?;

    // The reconcile that created the ConfigMap: its trace must hold the request spans and,
    // after the API server's batch delay, the API server's own spans.
    let trace = poll(
        "a reconcile trace with API server spans",
        Duration::from_secs(60),
        || async {
            for candidate in jaeger
                .api
                .traces("myresource-operator", Some("reconcile MyResource"))
                .await?
            {
                let ours = candidate["spans"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|s| {
                        s["operationName"] == "reconcile MyResource"
                            && tag(s, "k8s.name") == Some(&Value::from(name))
                    });
                if !ours {
                    continue;
                }
                let id = candidate["traceID"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let full = jaeger.api.trace(&id).await?;
                let applied = full["spans"].as_array().into_iter().flatten().any(|s| {
                    s["operationName"].as_str().is_some_and(|o| {
                        (o.starts_with("POST ") || o.starts_with("PATCH "))
                            && o.contains("/configmaps")
                    })
                });
                // The API server's inner spans end (and are exported) before its span of
                // the request itself: wait for that one, not for any of its spans.
                if applied && api_server_span_under_an_operator_request(&full) {
                    return Ok(Some(full));
                }
            }
            Ok(None)
        },
    )
    .await?;

    let spans = trace["spans"].as_array().unwrap();
    let reconcile = spans
        .iter()
        .find(|s| s["operationName"] == "reconcile MyResource")
        .unwrap();
    assert_eq!(
        tag(reconcile, "k8s.namespace"),
        Some(&Value::from(env.namespace.as_str()))
    );
    assert_eq!(tag(reconcile, "kind"), Some(&Value::from("MyResource")));
    assert!(tag(reconcile, "shard").is_some() && tag(reconcile, "trigger").is_some());
    assert_eq!(tag(reconcile, "result"), Some(&Value::from("success")));
    // Request spans are children of the reconcile span and carry method, path and status.
    // (Only the operator's: the API server's own spans may carry the same attributes.)
    let request = spans
        .iter()
        .find(|s| {
            s["processID"] == reconcile["processID"]
                && s["operationName"]
                    .as_str()
                    .is_some_and(|o| o.contains("/configmaps"))
                && tag(s, "http.request.method").is_some()
        })
        .expect("a ConfigMap request span");
    let parent = request["references"][0]["spanID"].as_str().unwrap();
    assert_eq!(
        parent,
        reconcile["spanID"].as_str().unwrap(),
        "request span is a child of the reconcile span"
    );
    assert!(tag(request, "http.response.status_code").is_some());
    // An API server span whose parent is one of our request spans (admin is in system:masters):
    // the poll above waited for one.
    let processes = trace["processes"].as_object().unwrap();
    // Resource attributes.
    let ours = processes
        .values()
        .find(|p| p["serviceName"] == "myresource-operator")
        .unwrap();
    let resource: Vec<&Value> = ours["tags"].as_array().unwrap().iter().collect();
    for key in [
        "service.version",
        "service.instance.id",
        "k8s.namespace.name",
    ] {
        assert!(
            resource.iter().any(|t| t["key"] == key),
            "resource attribute {key} missing: {resource:?}"
        );
    }
    // Log lines inside spans carry the trace and span ids.
    let traced_line = op.log_lines().into_iter().find(|l| l["span"].is_string());
    let line = traced_line.expect("a log line written inside a span");
    assert!(
        line["trace_id"].as_str().is_some_and(|t| t.len() == 32),
        "{line}"
    );
    assert!(
        line["span_id"].as_str().is_some_and(|t| t.len() == 16),
        "{line}"
    );
    op.stop();
    Ok(())
}

const LISTED: [&str; 15] = [
    "controller_runtime_reconcile_total",
    "controller_runtime_reconcile_errors_total",
    "controller_runtime_reconcile_time_seconds",
    "controller_runtime_active_workers",
    "controller_runtime_max_concurrent_reconciles",
    "workqueue_depth",
    "workqueue_adds_total",
    "workqueue_queue_duration_seconds",
    "workqueue_work_duration_seconds",
    "workqueue_retries_total",
    "workqueue_unfinished_work_seconds",
    "workqueue_longest_running_processor_seconds",
    "leader_election_master_status",
    "rest_client_requests_total",
    "process_resident_memory_bytes",
];

/// The value of the first sample whose line starts with `prefix`.
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn scrape(op: &Operator) -> Result<String> {
    let (code, body) = http_get(op.metrics, "/metrics").await?;
    anyhow::ensure!(code == 200, "/metrics answered {code}");
    Ok(body)
}

#[tokio::test]
async fn three_replicas_expose_the_metrics_and_leadership_moves() -> Result<()> {
    let env = harness::setup_traced("metrics").await?;
    let mut replicas = Vec::new();
    for name in ["a", "b", "c"] {
        replicas.push(Operator::start(env.operator_config(name, &[]))?);
    }
    for r in &mut replicas {
        r.wait_ready().await?;
    }
    let n = 10;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    for i in 0..n {
        mrs.create(&PostParams::default(), &mr(&format!("m{i}")))
            .await?;
    }
    for i in 0..n {
        wait_ready_status(&env, &format!("m{i}")).await?;
    }
    let leader = poll("one replica reporting leadership with an empty queue", Duration::from_secs(30), || async {
        let mut leaders = Vec::new();
        for (i, r) in replicas.iter().enumerate() {
            let text = scrape(r).await?;
            for name in LISTED.iter().chain(["myresource_operator_cache_objects", "myresource_operator_shard_queue_depth", "process_cpu_seconds_total", "process_open_fds", "process_start_time_seconds"].iter()) {
                anyhow::ensure!(text.contains(name), "{} lacks {name}", r.config.identity);
            }
            let status = sample(&text, "leader_election_master_status{").unwrap_or(-1.0);
            if status == 1.0 {
                let successes = sample(&text, "controller_runtime_reconcile_total{controller=\"myresource\",result=\"success\"}").unwrap_or(0.0);
                let depth = sample(&text, "workqueue_depth{").unwrap_or(-1.0);
                // Each MyResource's ConfigMap creation has its Event, published off the
                // reconcile's path by the term.
                let events = sample(&text, "myresource_operator_events_total{result=\"published\"}").unwrap_or(0.0);
                if successes >= n as f64 && depth == 0.0 && events >= n as f64 {
                    leaders.push(i);
                } else {
                    return Ok(None);
                }
            } else {
                anyhow::ensure!(status == 0.0, "{}: leader_election_master_status {status}", r.config.identity);
            }
        }
        Ok((leaders.len() == 1).then(|| leaders[0]))
    })
    .await?;
    // OpenMetrics when asked for.
    let (_, openmetrics) = e2e::operator::http_get_accept(
        replicas[leader].metrics,
        "/metrics",
        "application/openmetrics-text;version=1.0.0",
    )
    .await?;
    assert!(openmetrics.trim_end().ends_with("# EOF"), "not OpenMetrics");
    replicas[leader].kill();
    poll(
        "leadership to move to another replica",
        Duration::from_secs(30),
        || async {
            let mut statuses = Vec::new();
            for (i, r) in replicas.iter().enumerate().filter(|(i, _)| *i != leader) {
                statuses.push((
                    i,
                    sample(&scrape(r).await?, "leader_election_master_status{").unwrap_or(-1.0),
                ));
            }
            Ok((statuses.iter().filter(|(_, s)| *s == 1.0).count() == 1).then_some(()))
        },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn readyz_waits_for_the_caches_on_followers_too() -> Result<()> {
    let env = harness::setup_traced("readyz").await?;
    let _leader = env.start_operator("leader", &[]).await?;
    let apiserver = env.shared.server.trim_start_matches("https://").parse()?;
    let proxy = Proxy::start(apiserver).await?;
    proxy.block();
    let mut config = env.operator_config("follower", &[]);
    config.kubeconfig = env.kubeconfig_via(proxy.addr, "follower")?;
    let mut follower = Operator::start(config)?;
    // Alive but not ready while its caches cannot sync.
    poll(
        "the follower's /healthz",
        Duration::from_secs(20),
        || async {
            Ok(http_get(follower.health, "/healthz")
                .await
                .ok()
                .filter(|(c, _)| *c == 200)
                .map(|_| ()))
        },
    )
    .await?;
    for _ in 0..10 {
        let (code, body) = http_get(follower.health, "/readyz").await?;
        assert_eq!(code, 503, "ready before its caches synced: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxy.heal();
    follower.wait_ready().await?;
    let metrics = http_get(follower.metrics, "/metrics").await?.1;
    assert_eq!(
        sample(&metrics, "leader_election_master_status{"),
        Some(0.0),
        "the follower must not lead"
    );
    Ok(())
}

/// How many token and access reviews the replica `op` asked the API server for.
fn reviews_by(env: &TestEnv, op: &Operator) -> Result<usize> {
    let agent = op.user_agent();
    Ok(env
        .audit_log()?
        .events
        .iter()
        .filter(|e| e.user_agent == agent && e.verb == "create")
        .filter(|e| {
            e.request_uri.contains("/tokenreviews")
                || e.request_uri.contains("/subjectaccessreviews")
        })
        .count())
}

#[tokio::test]
async fn metrics_are_served_over_tls_to_authorised_scrapers_only() -> Result<()> {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let env = harness::setup_traced("metrics-tls").await?;
    // The mounted-certificate path, with a certificate this test trusts.
    let certs = env.log_dir().join(format!("{}-tls", env.namespace));
    std::fs::create_dir_all(&certs)?;
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])?;
    std::fs::write(certs.join("tls.crt"), made.cert.pem())?;
    std::fs::write(certs.join("tls.key"), made.signing_key.serialize_pem())?;
    let trusted = made.cert.pem();
    let op = env
        .start_operator(
            "secure",
            &[
                "--metrics-secure",
                &format!("--metrics-cert-dir={}", certs.display()),
            ],
        )
        .await?;

    // Prometheus' ServiceAccount may get /metrics (as the chart's metrics-reader role
    // grants); another may not.
    let prometheus = env.metrics_scraper("prometheus").await?;
    let stranger = env.service_account_token("stranger").await?;
    let reader = env.metrics_reader();

    let get = |token: Option<String>| {
        let trusted = trusted.clone();
        async move {
            e2e::operator::https_get(op.metrics, "/metrics", Some(&trusted), token.as_deref()).await
        }
    };
    let (code, _) = get(None).await?;
    anyhow::ensure!(code == 401, "no token: {code}, not 401");
    let (code, _) = get(Some("not-a-token".into())).await?;
    anyhow::ensure!(
        code == 401,
        "a token the cluster does not know: {code}, not 401"
    );
    let (code, _) = get(Some(stranger.clone())).await?;
    anyhow::ensure!(code == 403, "a user without the role: {code}, not 403");
    let before = reviews_by(&env, &op)?;
    let scrapes = 5;
    for _ in 0..scrapes {
        let (code, body) = get(Some(prometheus.clone())).await?;
        anyhow::ensure!(code == 200, "Prometheus' token: {code}, not 200");
        anyhow::ensure!(
            body.contains("leader_election_master_status"),
            "a scrape without the metrics"
        );
    }
    // One token review and one access review for the first scrape; the others are cached.
    let reviewed = poll(
        "the reviews in the audit log",
        Duration::from_secs(10),
        || async {
            let n = reviews_by(&env, &op)? - before;
            Ok((n >= 2).then_some(n))
        },
    )
    .await?;
    anyhow::ensure!(
        reviewed == 2,
        "{scrapes} scrapes with one token cost {reviewed} reviews, not 2"
    );
    eprintln!("{scrapes} authorised scrapes cost the API server {reviewed} requests");
    // Plain HTTP is not served on the metrics port; health stays plain and open.
    let plain = http_get(op.metrics, "/metrics").await;
    anyhow::ensure!(
        !matches!(plain, Ok((200, _))),
        "plain HTTP scraped the metrics: {plain:?}"
    );
    let (code, body) = http_get(op.health, "/healthz").await?;
    anyhow::ensure!(code == 200 && body == "ok", "/healthz: {code} {body}");
    Api::<ClusterRole>::all(env.client.clone())
        .delete(&reader, &Default::default())
        .await?;
    Api::<ClusterRoleBinding>::all(env.client.clone())
        .delete(&format!("{}-{reader}", env.namespace), &Default::default())
        .await?;
    Ok(())
}
