//! The Helm chart installed on a cluster with a node, as the node suite, the demo and the
//! Pod benchmark do it: Helm with its own folders (nothing from the user's setup), the
//! chart's default values apart from the image (loaded into the node, never pulled), and
//! waiting until the release's Pods run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};

use crate::cluster::{Cluster, ClusterConfig, NODES_DIR};
use crate::node::image::Image;
use crate::operator::workspace_root;
use crate::process::Lifetime;
use crate::wait::poll;

/// Helm against `kubeconfig`, with its cache, config and data under `home`.
pub fn helm(kubeconfig: &Path, home: &Path) -> Result<Command> {
    let mut cmd = Command::new(crate::binaries::helm()?);
    cmd.env("KUBECONFIG", kubeconfig)
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    Ok(cmd)
}

/// Builds the operator's image, starts a cluster with `nodes` nodes in `dir` (tied to this
/// process) and loads the image into every node, ready for [`install`]; the cluster is
/// stopped again if loading fails.
pub async fn cluster_with_image(dir: PathBuf, nodes: u8) -> Result<(Cluster, Image)> {
    let image = crate::operator_image::build()?.image;
    let mut cluster = Cluster::start_with_nodes(
        ClusterConfig {
            dir,
            otlp_endpoint: None,
            lifetime: Lifetime::TiedToThisProcess,
            crds: Vec::new(),
            shard_selector: true,
        },
        nodes,
    )
    .await?;
    if let Err(err) = crate::node::import_into(&cluster.dir.join(NODES_DIR), &image) {
        cluster.stop();
        return Err(err);
    }
    Ok((cluster, image))
}

/// `helm install RELEASE charts/myresource-operator -n NAMESPACE --create-namespace` with
/// the image `reference` (`repository:tag`) and `pullPolicy=Never`, and `extra` arguments.
pub fn install(
    helm: &mut Command,
    release: &str,
    namespace: &str,
    reference: &str,
    extra: &[&str],
) -> Result<()> {
    let (repository, tag) = reference.rsplit_once(':').context("a tagged image")?;
    crate::process::run(
        helm.args(["install", release])
            .arg(workspace_root().join("charts/myresource-operator"))
            .args(["--namespace", namespace, "--create-namespace"])
            .args(["--set", &format!("image.repository={repository}")])
            .args(["--set", &format!("image.tag={tag}")])
            .args(["--set", "image.pullPolicy=Never"])
            .args(extra),
        None,
    )?;
    Ok(())
}

/// A rolling update of release `release` in `namespace` (kubeconfig and Helm folders as in
/// `helm`): `helm upgrade --reuse-values --set key=value` (a value that changes the Pod
/// template, such as `podAnnotations.<name>`), then a wait of up to `limit` until the chart's Deployment has rolled out
/// `replicas` updated, Ready replicas and no others.
pub async fn roll(
    helm: &mut Command,
    client: &Client,
    (release, namespace): (&str, &str),
    (key, value): (&str, &str),
    replicas: i32,
    limit: Duration,
) -> Result<()> {
    upgrade(helm, (release, namespace), (key, value))?;
    rolled_out(client, (release, namespace), replicas, limit).await
}

/// `helm upgrade --reuse-values --set key=value` of release `release` in `namespace`,
/// without waiting for the rollout.
pub fn upgrade(
    helm: &mut Command,
    (release, namespace): (&str, &str),
    (key, value): (&str, &str),
) -> Result<()> {
    crate::process::run(
        helm.args(["upgrade", release])
            .arg(workspace_root().join("charts/myresource-operator"))
            .args(["--namespace", namespace, "--reuse-values"])
            .args(["--set", &format!("{key}={value}")]),
        None,
    )?;
    Ok(())
}

/// Waits up to `limit` until the chart's Deployment of `release` in `namespace` has rolled
/// out `replicas` updated, Ready replicas and no others.
pub async fn rolled_out(
    client: &Client,
    (release, namespace): (&str, &str),
    replicas: i32,
    limit: Duration,
) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let name = format!("{release}-myresource-operator");
    poll("the rollout to complete", limit, || async {
        let d = deployments.get(&name).await?;
        let status = d.status.unwrap_or_default();
        let done = status.observed_generation == d.metadata.generation
            && status.updated_replicas == Some(replicas)
            && status.ready_replicas == Some(replicas)
            && status.replicas == Some(replicas);
        Ok(done.then_some(()))
    })
    .await
}

/// Waits up to `limit` until release `release` in `namespace` has `n` live Pods, all
/// Running and Ready; returns their names.
pub async fn ready_pods(
    client: &Client,
    namespace: &str,
    release: &str,
    n: usize,
    limit: Duration,
) -> Result<Vec<String>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let params = ListParams::default().labels(&format!("app.kubernetes.io/instance={release}"));
    poll(
        &format!("{n} operator Pods Running and Ready"),
        limit,
        || async {
            let list = pods.list(&params).await?;
            let live: Vec<&Pod> = list
                .items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .collect();
            let ready = live.iter().all(|p| {
                let status = p.status.as_ref();
                status.and_then(|s| s.phase.as_deref()) == Some("Running")
                    && status
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| {
                            cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        })
            });
            Ok((live.len() == n && ready).then(|| live.iter().map(|p| p.name_any()).collect()))
        },
    )
    .await
}
