//! The objects a benchmark measures: MyResources and labelled Pods created in bulk,
//! counted, and waited for until the operator has made them Ready.

use std::time::{Duration, Instant};

use anyhow::Result;
use e2e::operator::Operator;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::{Api, Client};
use myresource_operator::resource::{MyResource, MyResourceSpec, POD_LABEL};
use serde_json::json;

/// Creates `n` MyResources `o{i}` (and a labelled Pod `p{i}` for each when `pods`), 32 at
/// a time.
pub(super) async fn create_objects(client: &Client, ns: &str, n: usize, pods: bool) -> Result<()> {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), ns);
    futures::stream::iter(0..n)
        .map(|i| {
            let mrs = mrs.clone();
            async move {
                mrs.create(&PostParams::default(), &mr(&format!("o{i}"), i))
                    .await
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    if pods {
        create_pods(client, ns, n).await?;
    }
    Ok(())
}

/// Creates `n` labelled Pods, 32 at a time.
pub(super) async fn create_pods(client: &Client, ns: &str, n: usize) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    futures::stream::iter(0..n)
        .map(|i| {
            let pods = pods.clone();
            async move {
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("p{i}"), "labels": {POD_LABEL: format!("o{i}")}},
                    "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}]}
                }))?;
                pods.create(&PostParams::default(), &pod).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

pub(super) fn mr(name: &str, i: usize) -> MyResource {
    MyResource::new(
        name,
        MyResourceSpec {
            message: format!("message {i}"),
            some_value: i as i32,
        },
    )
}

pub(super) async fn count_all(mrs: &Api<MyResource>) -> Result<usize> {
    Ok(mrs.list(&Default::default()).await?.items.len())
}

async fn count_ready(mrs: &Api<MyResource>) -> Result<usize> {
    Ok(mrs
        .list(&Default::default())
        .await?
        .items
        .iter()
        .filter(|m| {
            m.status.as_ref().is_some_and(|s| {
                s.observed_generation == m.metadata.generation
                    && s.conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
            })
        })
        .count())
}

/// Waits until `n` MyResources are Ready. Listing thousands of objects is itself heavy load
/// on the API server, which must not slow down what is being measured: so this watches the
/// operator's own metrics (at least `n` successful reconciles, an empty queue) and lists
/// only to confirm.
pub(super) async fn wait_all_ready(op: &Operator, mrs: &Api<MyResource>, n: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        anyhow::ensure!(
            Instant::now() < deadline,
            "objects not all Ready after 900 s"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        if metric_sum(op, SUCCESSES).await? >= n as f64
            && metric_sum(op, "workqueue_depth{").await? == 0.0
            && count_ready(mrs).await? >= n
        {
            return Ok(());
        }
    }
}

const SUCCESSES: &str =
    "controller_runtime_reconcile_total{controller=\"myresource\",result=\"success\"}";

/// The sum of a replica's metric samples whose line starts with `prefix`.
pub(super) async fn metric_sum(op: &Operator, prefix: &str) -> Result<f64> {
    let (_, text) = e2e::operator::http_get(op.metrics, "/metrics").await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}
