//! Install, upgrade and uninstall; a namespaced install (`watchNamespaces`) whose rights
//! hold in the watched namespaces only.

use super::*;

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
    // Cluster-wide: only what secured metrics need, which cannot be namespaced (token and
    // access reviews, and the non-resource URL /metrics).
    let cluster_roles: Vec<&str> = rendered
        .split("\n---")
        .filter(|doc| doc.contains("\nkind: ClusterRole\n"))
        .filter_map(|doc| doc.lines().find_map(|l| l.strip_prefix("  name: ")))
        .collect();
    assert_eq!(
        cluster_roles,
        [
            "nsd-myresource-operator-metrics-auth",
            "nsd-myresource-operator-metrics-reader"
        ],
        "{rendered}"
    );
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
    // Nothing cluster-wide names the account but the metrics reviews' rights …
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
    assert_eq!(
        cluster_wide,
        ["nsd-myresource-operator-metrics-auth"],
        "ClusterRoleBindings for the operator: only the metrics reviews"
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
