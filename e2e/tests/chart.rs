//! The Helm chart against the real control plane: lint, render with several value sets
//! (each accepted by a server-side dry run), schema refusals, install/upgrade/uninstall,
//! three replicas running with exactly the chart's RBAC (a ServiceAccount token), and a
//! real Prometheus scraping them, evaluating every dashboard query and alert expression; a
//! namespaced install (`watchNamespaces`) whose rights hold in the watched namespaces only.

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
    let value_sets: [&[&str]; 4] = [
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
    ];
    for (i, values) in value_sets.iter().enumerate() {
        let rendered = run(
            helm(&env)?
                .args(["template", &format!("dry{i}")])
                .arg(chart())
                .args(["--namespace", &env.namespace])
                .args(*values),
            None,
        )?;
        run(
            kubectl(&env)?.args(["apply", "--dry-run=server", "-n", &env.namespace, "-f", "-"]),
            Some(&rendered),
        )
        .with_context(|| format!("value set {i} {values:?}"))?;
    }
    let refusals: [(&[&str], &str); 7] = [
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

#[tokio::test]
async fn replicas_with_the_charts_rbac_are_scraped_by_prometheus() -> Result<()> {
    let env = harness::setup("chart-rbac").await?;
    let release = "rbac";
    let ns = env.namespace.clone();
    // RBAC, ServiceAccount and Service from the chart; the Deployment's Pods cannot run here,
    // so the replicas run as local processes with the ServiceAccount's token.
    run(
        helm(&env)?.args(["install", release]).arg(chart()).args([
            "-n",
            &ns,
            "--set",
            "replicaCount=0",
            "--skip-crds",
        ]),
        None,
    )?;
    let kubeconfig = service_account_kubeconfig(&env, "rbac-myresource-operator")?;
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
    for r in &replicas {
        assert!(
            !r.log().contains("forbidden"),
            "{} hit a forbidden request:\n{}",
            r.config.identity,
            r.log()
        );
    }
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

    // A real Prometheus scrapes the three replicas.
    let prometheus = Prometheus::start(&env, &replicas).await?;
    for i in 0..5 {
        mrs.patch(
            &format!("r{i}"),
            &Default::default(),
            &kube::api::Patch::Merge(json!({"spec": {"message": "changed"}})),
        )
        .await?;
    }
    prometheus.check_rules()?;
    let dashboard: Value = serde_json::from_slice(&std::fs::read(
        workspace_root().join("dashboards/myresource-operator.json"),
    )?)?;
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "30s")
                .replace("$job", "myresource-operator")
                .replace("$namespace", &ns)
                .replace("$pod", ".*");
            queries.push((panel["title"].as_str().unwrap().to_string(), expr));
        }
    }
    for (title, expr) in &queries {
        poll(
            &format!("data for panel {title:?}: {expr}"),
            Duration::from_secs(60),
            || async {
                let result = prometheus.query(expr).await?;
                Ok((!result.is_empty()).then_some(()))
            },
        )
        .await?;
    }
    let alerts = std::fs::read_to_string(chart().join("files/alerts.yaml"))?;
    for line in alerts
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr: "))
    {
        prometheus
            .query(line)
            .await
            .with_context(|| format!("alert expression {line}"))?;
    }
    Ok(())
}

struct Prometheus {
    addr: std::net::SocketAddr,
    promtool: PathBuf,
    _process: ProcessGuard,
}

struct ProcessGuard(e2e::process::Process);

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        self.0.stop(Duration::from_secs(5));
    }
}

impl Prometheus {
    async fn start(env: &TestEnv, replicas: &[Operator]) -> Result<Prometheus> {
        let (server, promtool) = e2e::binaries::prometheus()?;
        let dir = std::env::temp_dir().join(format!("myresource-e2e-prometheus-{}", env.namespace));
        std::fs::create_dir_all(&dir)?;
        let targets: Vec<Value> = replicas
            .iter()
            .map(|r| json!({"targets": [r.metrics.to_string()], "labels": {"namespace": env.namespace, "pod": r.config.identity}}))
            .collect();
        let config = json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
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
            _process: ProcessGuard(process),
        };
        poll(
            "Prometheus ready with 3 targets up",
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
                    == 3)
                    .then_some(()))
            },
        )
        .await?;
        Ok(prometheus)
    }

    /// An instant query; fails when Prometheus cannot parse or evaluate it.
    async fn query(&self, expr: &str) -> Result<Vec<Value>> {
        let encoded: String = expr
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let (code, body) = http_get(self.addr, &format!("/api/v1/query?query={encoded}")).await?;
        let doc: Value = serde_json::from_str(&body).with_context(|| format!("{code}: {body}"))?;
        if doc["status"] != "success" {
            bail!("query {expr} failed: {body}");
        }
        Ok(doc["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    fn check_rules(&self) -> Result<()> {
        run(
            Command::new(&self.promtool)
                .args(["check", "rules"])
                .arg(chart().join("files/alerts.yaml")),
            None,
        )?;
        Ok(())
    }
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
