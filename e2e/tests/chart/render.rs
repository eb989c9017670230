//! Lint, render with several value sets (each accepted by a server-side dry run), schema
//! refusals; the checked-in copies of the chart's files and the plain manifests in `deploy/`.

use super::*;

#[tokio::test]
async fn lint_render_dry_run_and_schema_refusals() -> Result<()> {
    let env = harness::setup("chart-render").await?;
    run(helm(&env)?.args(["lint", "--strict"]).arg(chart()), None)?;
    monitoring_crds(&env).await?;
    // A Role goes into each watched namespace: for the dry run, this test's own.
    let watched = format!("watchNamespaces={{{}}}", env.namespace);
    let value_sets: [&[&str]; 5] = [
        &[],
        &[
            "--set",
            "replicaCount=5",
            "--set",
            &watched,
            "--set",
            "sharding.shards=8",
        ],
        &[
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--set",
            "metrics.prometheusRule.enabled=true",
            "--set",
            "grafanaDashboard.enabled=true",
            "--set",
            "metrics.certSecret=operator-metrics-tls",
            "--set",
            "networkPolicy.enabled=true",
        ],
        &[
            "--set",
            "opentelemetry.endpoint=http://otel:4317",
            "--set",
            "opentelemetry.sampler=parentbased_traceidratio",
            "--set",
            "opentelemetry.samplerArg=0.1",
            "--set",
            "podDisruptionBudget.enabled=false",
            "--set",
            "metrics.secure=false",
        ],
        &[
            "--set",
            "sharding.leases=4",
            "--set",
            "metrics.prometheusRule.enabled=true",
            "--set",
            "grafanaDashboard.enabled=true",
        ],
    ];
    // Scale-out mode's Lease rights: in the leader-election Role only with sharding.leases.
    let wide_lease_rule = r#"verbs: ["get", "list", "watch", "create", "update", "delete"]"#;
    let narrow_lease_rule = r#"resourceNames: ["myresource-operator"]"#;
    for (i, values) in value_sets.iter().enumerate() {
        let rendered = run(
            helm(&env)?
                .args(["template", &format!("dry{i}")])
                .arg(chart())
                .args(["--namespace", &env.namespace])
                .args(*values),
            None,
        )?;
        let scale_out = values.contains(&"sharding.leases=4");
        // Secure metrics (the default): the reviews' rights, the reader role, HTTPS in the
        // ServiceMonitor, a mounted certificate when named; the NetworkPolicy when asked for.
        let secure = !values.contains(&"metrics.secure=false");
        let monitor = values.contains(&"metrics.serviceMonitor.enabled=true");
        for (present, text) in [
            (
                secure,
                "name: METRICS_SECURE\n              value: \"true\"",
            ),
            (
                !secure,
                "name: METRICS_SECURE\n              value: \"false\"",
            ),
            (secure, "resources: [\"tokenreviews\"]"),
            (secure, "nonResourceURLs: [\"/metrics\"]"),
            (secure && monitor, "scheme: https"),
            (
                values.contains(&"metrics.certSecret=operator-metrics-tls"),
                "secretName: operator-metrics-tls",
            ),
            (
                values.contains(&"networkPolicy.enabled=true"),
                "kind: NetworkPolicy",
            ),
        ] {
            assert_eq!(
                rendered.contains(text),
                present,
                "value set {i} {values:?}: {text}"
            );
        }
        for (present, text) in [
            (scale_out, "name: SHARD_LEASES\n              value: \"4\""),
            (
                scale_out,
                "name: SHARD_STANDBYS\n              value: \"1\"",
            ),
            (scale_out, wide_lease_rule),
            (!scale_out, narrow_lease_rule),
        ] {
            assert_eq!(
                rendered.contains(text),
                present,
                "value set {i} {values:?}: {text}\n{rendered}"
            );
        }
        if values.contains(&"metrics.prometheusRule.enabled=true") {
            for (present, alert) in [
                (scale_out, "- alert: MyResourceOperatorShardWithoutLeader"),
                (!scale_out, "- alert: MyResourceOperatorNoLeader"),
            ] {
                assert_eq!(rendered.contains(alert), present, "value set {i}: {alert}");
            }
        }
        run(
            kubectl(&env)?.args(["apply", "--dry-run=server", "-n", &env.namespace, "-f", "-"]),
            Some(&rendered),
        )
        .with_context(|| format!("value set {i} {values:?}"))?;
    }
    let refusals: [(&[&str], &str); 12] = [
        (&["--set", "replicaCount=-1"], "replicaCount"),
        (&["--set", "metrics.secure=maybe"], "secure"),
        (&["--set", "watchNamespaces={Not_OK}"], "watchNamespaces"),
        (&["--set", "watchNamespaces={a,a}"], "watchNamespaces"),
        (
            &["--set", "leaderElection.leaseDuration=15"],
            "leaseDuration",
        ),
        (&["--set", "sharding.shards=many"], "shards"),
        (&["--set", "logging.format=xml"], "format"),
        (&["--set", "replicas=3"], "replicas"),
        (
            &["--set", "sharding.leases=-1"],
            "/sharding/leases': minimum",
        ),
        (
            &["--set", "sharding.leases=300"],
            "/sharding/leases': maximum",
        ),
        (
            &["--set", "sharding.leases=some"],
            "/sharding/leases': got string, want integer",
        ),
        (
            &["--set", "sharding.standbys=9"],
            "/sharding/standbys': maximum",
        ),
    ];
    for (values, field) in refusals {
        let err = run(
            helm(&env)?
                .args(["template", "bad"])
                .arg(chart())
                .args(values),
            None,
        )
        .expect_err(&format!("{values:?} must be refused"));
        let text = format!("{err:#}");
        assert!(
            text.contains("schema") && text.contains(field),
            "{values:?}: {text}"
        );
    }
    Ok(())
}

#[test]
fn checked_in_copies_match_their_sources() -> Result<()> {
    let root = workspace_root();
    let read = |p: &str| std::fs::read_to_string(root.join(p)).with_context(|| p.to_string());
    assert_eq!(
        read("charts/myresource-operator/crds/myresource.yaml")?,
        read("deploy/crd.yaml")?,
        "chart CRD drifted from deploy/crd.yaml"
    );
    assert_eq!(
        read("charts/myresource-operator/files/dashboard.json")?,
        read("dashboards/myresource-operator.json")?,
        "chart dashboard drifted from dashboards/"
    );
    Ok(())
}

#[test]
fn plain_manifests_are_the_chart_rendered_with_defaults() -> Result<()> {
    let rendered = run(
        helm_offline()?
            .args(["template", "myresource-operator"])
            .arg(chart())
            .args(["--namespace", "myresource-operator"]),
        None,
    )?;
    assert!(
        !rendered.contains("WATCH_NAMESPACES"),
        "an empty watchNamespaces must leave WATCH_NAMESPACES unset"
    );
    let checked_in = std::fs::read_to_string(workspace_root().join("deploy/manifests.yaml"))?;
    assert!(
        checked_in == rendered,
        "deploy/manifests.yaml drifted: regenerate with `helm template myresource-operator charts/myresource-operator --namespace myresource-operator > deploy/manifests.yaml`"
    );
    Ok(())
}

/// What the README tells a user without Helm: `kubectl apply --server-side -f deploy/` on a
/// cluster that has never seen the operator creates the namespace and everything in it.
/// (The Pods need a node and the image; the `node` tests run the chart's on a real one.)
#[tokio::test]
async fn the_plain_manifests_apply_to_a_cluster_without_the_namespace() -> Result<()> {
    let env = harness::setup("plain").await?;
    let deploy = workspace_root().join("deploy");
    let ns = "myresource-operator";
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(env.client.clone());
    if namespaces.get_opt(ns).await?.is_some() {
        bail!("namespace {ns} exists before the test: the cluster is not the one it needs");
    }
    run(
        kubectl(&env)?
            .args(["apply", "--server-side", "-f"])
            .arg(&deploy),
        None,
    )?;
    let deployment = Api::<Deployment>::namespaced(env.client.clone(), ns)
        .get("myresource-operator")
        .await?;
    let service_account = deployment
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.service_account_name);
    assert_eq!(service_account.as_deref(), Some("myresource-operator"));
    for (kind, found) in [
        (
            "Service",
            Api::<Service>::namespaced(env.client.clone(), ns)
                .get_opt("myresource-operator-metrics")
                .await?
                .is_some(),
        ),
        (
            "PodDisruptionBudget",
            Api::<PodDisruptionBudget>::namespaced(env.client.clone(), ns)
                .get_opt("myresource-operator")
                .await?
                .is_some(),
        ),
        (
            "ClusterRole",
            Api::<ClusterRole>::all(env.client.clone())
                .get_opt("myresource-operator")
                .await?
                .is_some(),
        ),
    ] {
        assert!(found, "the {kind} was not created");
    }
    // Leave the CRD: the other tests of this binary use it.
    run(
        kubectl(&env)?
            .args(["delete", "--wait=false", "-f"])
            .arg(deploy.join("manifests.yaml"))
            .arg("-f")
            .arg(deploy.join("00-namespace.yaml")),
        None,
    )?;
    Ok(())
}
