//! The Helm chart against the real control plane: lint, render with several value sets
//! (each accepted by a server-side dry run), schema refusals, install/upgrade/uninstall,
//! three replicas running with exactly the chart's RBAC (a ServiceAccount token), and a
//! real Prometheus scraping them, evaluating every dashboard query and loading the rendered
//! alert rules; the same in scale-out mode (`sharding.leases`), two replicas holding every
//! shard Lease with the chart's wider Lease rights; a namespaced install (`watchNamespaces`)
//! whose rights hold in the watched namespaces only.
//!
//! One control plane for the whole binary; the tests are grouped by concern:
//! [`render`] (lint, templates, schema, the checked-in copies and the plain manifests),
//! [`install`] (install, upgrade, uninstall; a namespaced install's rights), [`metrics`]
//! (Prometheus scraping replicas run with the chart's RBAC; dashboards and alerts) and
//! [`scale_out`] (the same in scale-out mode).

mod install;
mod metrics;
mod render;
mod scale_out;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use e2e::harness::{self, TestEnv};
use e2e::operator::{Operator, workspace_root};
use e2e::process::run;
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
