//! The Helm chart against the real control plane: lint, render with several value sets
//! (each accepted by a server-side dry run), schema refusals, install/upgrade/uninstall,
//! three replicas running with exactly the chart's RBAC (a ServiceAccount token), and a
//! real Prometheus scraping them, evaluating every dashboard query and loading the rendered
//! alert rules; the same in scale-out mode (`sharding.leases`), two replicas holding every
//! shard Lease with the chart's wider Lease rights; a namespaced install (`watchNamespaces`)
//! whose rights hold in the watched namespaces only.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use e2e::harness::{self, TestEnv};
use e2e::operator::{Operator, http_get, workspace_root};
use e2e::process::{Lifetime, run, spawn};
use e2e::wait::poll;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role};
use kube::Api;
use kube::api::PostParams;
use myresource_operator::resource::{MyResource, MyResourceSpec};
use serde_json::{Value, json};

fn chart() -> PathBuf {
    workspace_root().join("charts/myresource-operator")
}

/// Helm with its own cache and config folders (nothing from the user's Helm setup).
fn helm_offline() -> Result<Command> {
    let mut cmd = Command::new(e2e::binaries::helm()?);
    let home = std::env::temp_dir().join("myresource-e2e-helm");
    cmd.env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    Ok(cmd)
}

fn helm(env: &TestEnv) -> Result<Command> {
    let mut cmd = helm_offline()?;
    cmd.env("KUBECONFIG", &env.shared.kubeconfig);
    Ok(cmd)
}

fn kubectl(env: &TestEnv) -> Result<Command> {
    let mut cmd = Command::new(e2e::binaries::kubectl()?);
    cmd.arg(format!("--kubeconfig={}", env.shared.kubeconfig.display()));
    Ok(cmd)
}

/// CRDs for ServiceMonitor and PrometheusRule (schema-less), so the optional templates can
/// be dry-run against this cluster as they would be against one with the Prometheus Operator.
async fn monitoring_crds(env: &TestEnv) -> Result<()> {
    static ONCE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    ONCE.get_or_try_init(|| async {
        for (kind, plural) in [("ServiceMonitor", "servicemonitors"), ("PrometheusRule", "prometheusrules")] {
            let crd = json!({
                "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": format!("{plural}.monitoring.coreos.com")},
                "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                    "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase()},
                    "versions": [{"name": "v1", "served": true, "storage": true,
                        "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]}
            });
            run(kubectl(env)?.args(["apply", "-f", "-"]), Some(&crd.to_string()))?;
            run(kubectl(env)?.args(["wait", "--for=condition=Established", &format!("crd/{plural}.monitoring.coreos.com")]), None)?;
        }
        anyhow::Ok(())
    })
    .await?;
    Ok(())
}

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
    let refusals: [(&[&str], &str); 11] = [
        (&["--set", "replicaCount=-1"], "replicaCount"),
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

#[tokio::test]
async fn install_upgrade_uninstall() -> Result<()> {
    let env = harness::setup("chart-install").await?;
    let release = "inst";
    run(
        helm(&env)?.args(["install", release]).arg(chart()).args([
            "-n",
            &env.namespace,
            "--set",
            "replicaCount=3",
            "--skip-crds",
        ]),
        None,
    )?;
    let name = "inst-myresource-operator";
    let ns = &env.namespace;
    let deployments: Api<Deployment> = Api::namespaced(env.client.clone(), ns);
    assert!(deployments.get_opt(name).await?.is_some());
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), ns);
    let selector = "app.kubernetes.io/instance=inst";
    poll(
        "a ReplicaSet and 3 Pods (Pending without a kubelet)",
        Duration::from_secs(60),
        || async {
            let sets = Api::<ReplicaSet>::namespaced(env.client.clone(), ns)
                .list(&Default::default())
                .await?;
            let pods = pods
                .list(&kube::api::ListParams::default().labels(selector))
                .await?;
            Ok((!sets.items.is_empty() && pods.items.len() == 3).then_some(()))
        },
    )
    .await?;
    assert!(
        Api::<Service>::namespaced(env.client.clone(), ns)
            .get_opt(&format!("{name}-metrics"))
            .await?
            .is_some()
    );
    assert!(
        Api::<PodDisruptionBudget>::namespaced(env.client.clone(), ns)
            .get_opt(name)
            .await?
            .is_some()
    );
    assert!(
        Api::<ClusterRole>::all(env.client.clone())
            .get_opt(name)
            .await?
            .is_some()
    );
    assert!(
        Api::<Role>::namespaced(env.client.clone(), ns)
            .get_opt(&format!("{name}-leader-election"))
            .await?
            .is_some()
    );
    let pod = &pods
        .list(&kube::api::ListParams::default().labels(selector))
        .await?
        .items[0];
    let security = pod.spec.as_ref().unwrap().containers[0]
        .security_context
        .clone()
        .unwrap();
    assert_eq!(security.read_only_root_filesystem, Some(true));
    assert_eq!(security.allow_privilege_escalation, Some(false));

    run(
        helm(&env)?.args(["upgrade", release]).arg(chart()).args([
            "-n",
            ns,
            "--set",
            "replicaCount=2",
            "--skip-crds",
        ]),
        None,
    )?;
    poll(
        "2 replicas after the upgrade",
        Duration::from_secs(60),
        || async {
            let d = deployments.get(name).await?;
            Ok((d.spec.and_then(|s| s.replicas) == Some(2)).then_some(()))
        },
    )
    .await?;
    run(helm(&env)?.args(["uninstall", release, "-n", ns]), None)?;
    poll(
        "everything uninstalled",
        Duration::from_secs(60),
        || async {
            let gone = deployments.get_opt(name).await?.is_none()
                && Api::<ClusterRole>::all(env.client.clone())
                    .get_opt(name)
                    .await?
                    .is_none();
            Ok(gone.then_some(()))
        },
    )
    .await?;
    Ok(())
}

/// A kubeconfig that authenticates as the chart's ServiceAccount (TokenRequest API).
fn service_account_kubeconfig(env: &TestEnv, account: &str) -> Result<PathBuf> {
    let token = run(
        kubectl(env)?.args([
            "create",
            "token",
            account,
            "-n",
            &env.namespace,
            "--duration=1h",
        ]),
        None,
    )?;
    let mut doc: Value = serde_json::from_slice(&std::fs::read(&env.shared.kubeconfig)?)?;
    doc["users"] = json!([{"name": account, "user": {"token": token.trim()}}]);
    doc["contexts"][0]["context"]["user"] = account.into();
    let path = env
        .shared
        .kubeconfig
        .with_file_name(format!("{}-sa.kubeconfig", env.namespace));
    std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)?;
    Ok(path)
}

/// Whether `account` (a ServiceAccount in `namespace`) may `verb` `resource` (optionally
/// `resource/subresource`) in `scope` (`-n NS` or `--all-namespaces`), as the API server
/// decides it: `kubectl auth can-i` impersonating the account.
fn can(
    env: &TestEnv,
    namespace: &str,
    account: &str,
    verb: &str,
    resource: &str,
    scope: &[&str],
) -> Result<bool> {
    let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
    let out = kubectl(env)?
        .args(["auth", "can-i", verb, resource])
        .arg(format!("--subresource={subresource}"))
        .arg(format!("--as=system:serviceaccount:{namespace}:{account}"))
        .args(scope)
        .output()?;
    match String::from_utf8_lossy(&out.stdout).trim() {
        "yes" => Ok(true),
        "no" => Ok(false),
        other => bail!(
            "kubectl auth can-i {verb} {resource} {scope:?}: {other:?} {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

#[tokio::test]
async fn a_namespaced_install_grants_roles_in_the_watched_namespaces_only() -> Result<()> {
    let env = harness::setup("chart-ns").await?;
    let release = "nsd";
    let ns = env.namespace.clone();
    // The operator lives in the release namespace and watches another one.
    let watched = format!("{ns}-watched");
    e2e::cluster::create_namespace(&env.client, &watched).await?;
    let values = [
        "--set".to_string(),
        format!("watchNamespaces={{{watched}}}"),
        "--set".into(),
        "replicaCount=0".into(),
        "--skip-crds".into(),
    ];
    let rendered = run(
        helm(&env)?
            .args(["template", release])
            .arg(chart())
            .args(["--namespace", &ns])
            .args(&values),
        None,
    )?;
    assert!(!rendered.contains("kind: ClusterRole"), "{rendered}");
    assert!(
        rendered.contains(&format!(
            "name: WATCH_NAMESPACES\n              value: \"{watched}\""
        )),
        "{rendered}"
    );
    run(
        helm(&env)?
            .args(["install", release])
            .arg(chart())
            .args(["-n", &ns])
            .args(&values),
        None,
    )?;
    let account = "nsd-myresource-operator";
    // Nothing cluster-wide names the account …
    let bindings = Api::<ClusterRoleBinding>::all(env.client.clone())
        .list(&Default::default())
        .await?;
    let cluster_wide: Vec<_> = bindings
        .items
        .iter()
        .filter(|b| {
            b.subjects.iter().flatten().any(|s| {
                s.kind == "ServiceAccount"
                    && s.name == account
                    && s.namespace.as_deref() == Some(ns.as_str())
            })
        })
        .filter_map(|b| b.metadata.name.clone())
        .collect();
    assert!(
        cluster_wide.is_empty(),
        "ClusterRoleBindings for the operator: {cluster_wide:?}"
    );
    // … and the API server agrees: the operator's rights hold in the watched namespace only.
    let rights = [
        ("watch", "myresources.trstringer.com"),
        ("patch", "myresources.trstringer.com/status"),
        ("create", "configmaps"),
        ("delete", "configmaps"),
        ("list", "pods"),
        ("create", "events.events.k8s.io"),
    ];
    for (verb, resource) in rights {
        assert!(
            can(&env, &ns, account, verb, resource, &["-n", &watched])?,
            "{verb} {resource} in {watched}"
        );
        for scope in [["-n", ns.as_str()], ["-n", "default"]] {
            // Pods in the release's own namespace are readable: followers watch the Lease
            // holder's Pod there.
            let holder_watch = resource == "pods" && scope[1] == ns.as_str();
            assert_eq!(
                can(&env, &ns, account, verb, resource, &scope)?,
                holder_watch,
                "{verb} {resource} {scope:?}"
            );
        }
        assert!(
            !can(&env, &ns, account, verb, resource, &["--all-namespaces"])?,
            "{verb} {resource} in every namespace"
        );
    }
    assert!(!can(
        &env,
        &ns,
        account,
        "update",
        "myresources.trstringer.com/finalizers",
        &["-n", &watched]
    )?);

    // A replica with exactly these rights reconciles in the watched namespace.
    let kubeconfig = service_account_kubeconfig(&env, account)?;
    let mut config = env.operator_config("op", &["--lease-name=myresource-operator"]);
    config.kubeconfig = kubeconfig;
    config.namespaces = vec![watched.clone()];
    let mut op = Operator::start(config)?;
    op.wait_ready().await?;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &watched);
    let mr = MyResource::new(
        "scoped",
        MyResourceSpec {
            message: "namespaced".into(),
            some_value: 1,
        },
    );
    mrs.create(&PostParams::default(), &mr).await?;
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &watched);
    poll(
        "the ConfigMap and Ready status",
        Duration::from_secs(30),
        || async {
            let ready = mrs.get("scoped").await?.status.is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
            Ok((ready && cms.get_opt("scoped").await?.is_some()).then_some(()))
        },
    )
    .await?;
    assert!(
        !op.log().contains("forbidden"),
        "a forbidden request:\n{}",
        op.log()
    );
    Ok(())
}

/// Installs the chart's RBAC, ServiceAccount and Service (no replicas: the Deployment's Pods
/// cannot run here, so replicas run as local processes) with `values`, and returns a
/// kubeconfig authenticating as the release's ServiceAccount.
fn install_without_replicas(env: &TestEnv, release: &str, values: &[&str]) -> Result<PathBuf> {
    run(
        helm(env)?
            .args(["install", release])
            .arg(chart())
            .args([
                "-n",
                &env.namespace,
                "--set",
                "replicaCount=0",
                "--skip-crds",
            ])
            .args(values),
        None,
    )?;
    service_account_kubeconfig(env, &format!("{release}-myresource-operator"))
}

/// The log lines of requests the API server refused (403 Forbidden), by replica.
fn forbidden(replicas: &[Operator]) -> String {
    replicas
        .iter()
        .flat_map(|r| {
            r.log()
                .lines()
                .filter(|l| l.to_lowercase().contains("forbidden"))
                .map(|l| format!("{}: {l}\n", r.config.identity))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Asserts that no replica's log shows a request the API server refused.
fn assert_nothing_forbidden(replicas: &[Operator]) {
    let refused = forbidden(replicas);
    assert!(refused.is_empty(), "forbidden requests:\n{refused}");
}

/// The alert rules as the chart renders them with `values` (the PrometheusRule's spec): a
/// rule file for promtool and Prometheus.
fn rendered_rules(values: &[&str]) -> Result<String> {
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
fn alert_exprs(rules: &str) -> BTreeMap<String, String> {
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
struct PanelQuery {
    title: String,
    /// Whether the panel is in the "Scale-out" row (empty in single-Lease mode).
    scale_out: bool,
    expr: String,
}

/// Every panel's queries, with the dashboard's variables set to this test's replicas (Lease
/// group `myresource-operator`, the replicas' `--lease-name`).
fn dashboard_queries(namespace: &str) -> Result<Vec<PanelQuery>> {
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
async fn check_dashboard(prometheus: &Prometheus, namespace: &str, scale_out: bool) -> Result<()> {
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
async fn assert_leader_alert_inactive(
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
    let kubeconfig = install_without_replicas(&env, "rbac", &[])?;
    let mut replicas = Vec::new();
    for name in ["a", "b", "c"] {
        let mut config = env.operator_config(name, &["--lease-name=myresource-operator"]);
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
    let sa_client = e2e::cluster::client_for(&kubeconfig).await?;
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
    let prometheus = Prometheus::start(&env, &replicas, &rules).await?;
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

struct Prometheus {
    addr: std::net::SocketAddr,
    promtool: PathBuf,
    rules: PathBuf,
    _process: ProcessGuard,
}

struct ProcessGuard(e2e::process::Process);

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        self.0.stop(Duration::from_secs(5));
    }
}

impl Prometheus {
    /// Prometheus scraping `replicas` every second and evaluating the rule file `rules`.
    async fn start(env: &TestEnv, replicas: &[Operator], rules: &str) -> Result<Prometheus> {
        let (server, promtool) = e2e::binaries::prometheus()?;
        let dir = std::env::temp_dir().join(format!("myresource-e2e-prometheus-{}", env.namespace));
        std::fs::create_dir_all(&dir)?;
        let rules_file = dir.join("alerts.yaml");
        std::fs::write(&rules_file, rules)?;
        let targets: Vec<Value> = replicas
            .iter()
            .map(|r| json!({"targets": [r.metrics.to_string()], "labels": {"namespace": env.namespace, "pod": r.config.identity}}))
            .collect();
        let config = json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [rules_file],
            "scrape_configs": [{"job_name": "myresource-operator", "static_configs": targets}]
        });
        std::fs::write(
            dir.join("prometheus.yml"),
            serde_json::to_vec_pretty(&config)?,
        )?;
        let addr: std::net::SocketAddr =
            format!("127.0.0.1:{}", e2e::cluster::free_port()?).parse()?;
        let mut cmd = Command::new(server);
        cmd.arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"));
        let process = spawn(
            "prometheus",
            cmd,
            &dir.join("prometheus.log"),
            Lifetime::TiedToThisProcess,
        )?;
        let prometheus = Prometheus {
            addr,
            promtool,
            rules: rules_file,
            _process: ProcessGuard(process),
        };
        poll(
            &format!("Prometheus ready with {} targets up", replicas.len()),
            Duration::from_secs(60),
            || async {
                if !http_get(addr, "/-/ready")
                    .await
                    .is_ok_and(|(c, _)| c == 200)
                {
                    return Ok(None);
                }
                Ok((prometheus
                    .query("up")
                    .await?
                    .iter()
                    .filter(|s| s["value"][1] == "1")
                    .count()
                    == replicas.len())
                .then_some(()))
            },
        )
        .await?;
        Ok(prometheus)
    }

    /// An instant query; fails when Prometheus cannot parse or evaluate it.
    async fn query(&self, expr: &str) -> Result<Vec<Value>> {
        let doc = self
            .api(&format!("/api/v1/query?query={}", encoded(expr)))
            .await?;
        Ok(doc["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// The state of alerting rule `alert` (inactive, pending, firing) once Prometheus has
    /// evaluated it and found it healthy; `None` before.
    async fn alert_state(&self, alert: &str) -> Result<Option<String>> {
        let doc = self.api("/api/v1/rules?type=alert").await?;
        let rule = doc["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .find(|r| r["name"] == alert)
            .with_context(|| format!("no rule {alert} loaded: {doc}"))?;
        match rule["health"].as_str() {
            Some("ok") => Ok(rule["state"].as_str().map(String::from)),
            Some("unknown") => Ok(None),
            _ => bail!("rule {alert} is unhealthy: {rule}"),
        }
    }

    /// A GET of the HTTP API; fails unless it answers `"status": "success"`.
    async fn api(&self, path: &str) -> Result<Value> {
        let (code, body) = http_get(self.addr, path).await?;
        let doc: Value = serde_json::from_str(&body).with_context(|| format!("{code}: {body}"))?;
        if doc["status"] != "success" {
            bail!("{path} failed: {body}");
        }
        Ok(doc)
    }

    /// promtool's verdict on the rule file this Prometheus runs.
    fn check_rules(&self) -> Result<()> {
        run(
            Command::new(&self.promtool)
                .args(["check", "rules"])
                .arg(&self.rules),
            None,
        )?;
        Ok(())
    }
}

/// Percent-encodes a query parameter.
fn encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
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
