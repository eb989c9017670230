//! Three replicas with exactly the chart's RBAC and secure metrics, scraped over HTTPS with
//! a token by a real Prometheus that evaluates every dashboard query and the alert rules.

use e2e::prometheus::Prometheus;

use super::*;

/// The alert rules as the chart renders them with `values` (the PrometheusRule's spec): a
/// rule file for promtool and Prometheus.
pub(super) fn rendered_rules(values: &[&str]) -> Result<String> {
    let rendered = run(
        helm_offline()?
            .args(["template", "rules"])
            .arg(chart())
            .args(["--show-only", "templates/prometheusrule.yaml"])
            .args(["--set", "metrics.prometheusRule.enabled=true"])
            .args(values),
        None,
    )?;
    let spec: Vec<&str> = rendered
        .lines()
        .skip_while(|l| *l != "spec:")
        .skip(1)
        .map(|l| l.strip_prefix("  ").unwrap_or(l))
        .collect();
    if spec.is_empty() {
        bail!("no spec in the rendered PrometheusRule:\n{rendered}");
    }
    Ok(spec.join("\n") + "\n")
}

/// The expression of each alert in a rule file, by alert name.
pub(super) fn alert_exprs(rules: &str) -> BTreeMap<String, String> {
    let mut exprs = BTreeMap::new();
    let mut alert = None;
    for line in rules.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert: ") {
            alert = Some(name.to_string());
        } else if let Some(expr) = line.strip_prefix("expr: ") {
            exprs.insert(alert.take().unwrap_or_default(), expr.to_string());
        }
    }
    exprs
}

/// One dashboard query, with the panel it feeds.
pub(super) struct PanelQuery {
    pub(super) title: String,
    /// Whether the panel is in the "Scale-out" row (empty in single-Lease mode).
    scale_out: bool,
    pub(super) expr: String,
}

/// Every panel's queries, with the dashboard's variables set to this test's replicas (Lease
/// group `myresource-operator`, the replicas' `--lease-name`).
pub(super) fn dashboard_queries(namespace: &str) -> Result<Vec<PanelQuery>> {
    let dashboard: Value = serde_json::from_slice(&std::fs::read(
        workspace_root().join("dashboards/myresource-operator.json"),
    )?)?;
    let mut queries = Vec::new();
    let mut scale_out = false;
    for panel in dashboard["panels"].as_array().context("panels")? {
        let title = panel["title"].as_str().context("a panel's title")?;
        if panel["type"] == "row" {
            scale_out = title.starts_with("Scale-out");
            continue;
        }
        for target in panel["targets"].as_array().context("a panel's targets")? {
            let expr = target["expr"]
                .as_str()
                .context("a target's expr")?
                .replace("$__rate_interval", "30s")
                .replace("$job", "myresource-operator")
                .replace("$namespace", namespace)
                .replace("$pod", ".*")
                .replace("$lease", "myresource-operator");
            queries.push(PanelQuery {
                title: title.to_string(),
                scale_out,
                expr,
            });
        }
    }
    Ok(queries)
}

/// Every dashboard query evaluates; each returns data unless it is a scale-out panel and
/// the replicas run with one Lease.
pub(super) async fn check_dashboard(
    prometheus: &Prometheus,
    namespace: &str,
    scale_out: bool,
) -> Result<()> {
    let queries = dashboard_queries(namespace)?;
    assert!(queries.iter().any(|q| q.scale_out), "no scale-out panels");
    for q in &queries {
        if q.scale_out && !scale_out {
            prometheus
                .query(&q.expr)
                .await
                .with_context(|| format!("panel {:?}", q.title))?;
            continue;
        }
        poll(
            &format!("data for panel {:?}: {}", q.title, q.expr),
            Duration::from_secs(60),
            || async {
                let result = prometheus.query(&q.expr).await?;
                Ok((!result.is_empty()).then_some(()))
            },
        )
        .await?;
    }
    Ok(())
}

/// The leadership alert (`alert`) of the rules Prometheus runs is inactive: once the
/// replicas' series are scraped, every Lease (or shard Lease) has a leader.
pub(super) async fn assert_leader_alert_inactive(
    prometheus: &Prometheus,
    rules: &str,
    alert: &str,
) -> Result<()> {
    let exprs = alert_exprs(rules);
    assert!(
        exprs.contains_key(alert) && exprs.len() == 4,
        "{alert} among the rendered rules: {exprs:?}"
    );
    poll(
        &format!("{alert} inactive"),
        Duration::from_secs(60),
        || async {
            Ok((prometheus.alert_state(alert).await?.as_deref() == Some("inactive")).then_some(()))
        },
    )
    .await?;
    for (name, expr) in &exprs {
        let result = prometheus
            .query(expr)
            .await
            .with_context(|| format!("alert {name}: {expr}"))?;
        if name == alert {
            assert!(result.is_empty(), "{alert} would fire: {result:?}");
        }
    }
    Ok(())
}

#[tokio::test]
async fn replicas_with_the_charts_rbac_are_scraped_by_prometheus() -> Result<()> {
    let env = harness::setup("chart-rbac").await?;
    let ns = env.namespace.clone();
    // Secure metrics: the replicas review each scrape with the chart's rights, and
    // Prometheus scrapes over HTTPS with a token the chart's metrics-reader role admits.
    let kubeconfig = install_without_replicas(&env, "rbac", &["--set", "metrics.secure=true"])?;
    let token = env.service_account_token("prometheus").await?;
    env.bind_cluster_role(
        "rbac-myresource-operator-metrics-reader",
        "prometheus",
        "/metrics",
    )
    .await?;
    let mut replicas = Vec::new();
    for name in ["a", "b", "c"] {
        let mut config = env.operator_config(
            name,
            &["--lease-name=myresource-operator", "--metrics-secure"],
        );
        config.kubeconfig = kubeconfig.clone();
        replicas.push(Operator::start(config)?);
    }
    for r in &mut replicas {
        r.wait_ready().await?;
    }
    // Reconcile works with exactly these permissions …
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &ns);
    for i in 0..5 {
        let mr = MyResource::new(
            &format!("r{i}"),
            MyResourceSpec {
                message: "rbac".into(),
                some_value: i,
            },
        );
        mrs.create(&PostParams::default(), &mr).await?;
    }
    poll("every object Ready", Duration::from_secs(30), || async {
        let ready = mrs
            .list(&Default::default())
            .await?
            .items
            .iter()
            .filter(|m| {
                m.status
                    .as_ref()
                    .is_some_and(|s| s.conditions.iter().any(|c| c.status == "True"))
            })
            .count();
        Ok((ready == 5).then_some(()))
    })
    .await?;
    assert!(
        env.lease_holder()
            .await?
            .is_some_and(|h| h.starts_with(&ns)),
        "a replica leads"
    );
    assert_nothing_forbidden(&replicas);
    // … and anything outside them is denied.
    let sa_client = e2e::kubeconfig::client_for(&kubeconfig).await?;
    let err = Api::<Secret>::namespaced(sa_client, &ns)
        .list(&Default::default())
        .await
        .expect_err("listing Secrets must be denied");
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 403),
        "{err:?}"
    );

    // A real Prometheus scrapes the three replicas and runs the chart's rules.
    let rules = rendered_rules(&[])?;
    let prometheus = Prometheus::start_with(&env, &replicas, &rules, Some(&token)).await?;
    for i in 0..5 {
        mrs.patch(
            &format!("r{i}"),
            &Default::default(),
            &kube::api::Patch::Merge(json!({"spec": {"message": "changed"}})),
        )
        .await?;
    }
    prometheus.check_rules()?;
    check_dashboard(&prometheus, &ns, false).await?;
    assert_leader_alert_inactive(&prometheus, &rules, "MyResourceOperatorNoLeader").await?;
    // The same rule for a Lease nobody holds fires.
    let elsewhere = alert_exprs(&rendered_rules(&[
        "--set",
        "leaderElection.leaseName=nobody",
    ])?);
    assert!(
        !prometheus
            .query(&elsewhere["MyResourceOperatorNoLeader"])
            .await?
            .is_empty(),
        "no alert for a Lease without a leader"
    );
    Ok(())
}
