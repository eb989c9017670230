//! kube-runtime's own `Controller` under a term: a kube-rs user keeps their controller and
//! gains fenced writes and warm takeover.
//!
//! Every replica keeps a warm store of the ConfigMaps labelled `leasehold-example=watched`
//! from the start ([`Warm`]); the leader's term builds a `Controller` on that store
//! (`for_shared_stream`: no LIST at takeover) whose reconciles write through the fenced
//! client. Reconcile: annotate each ConfigMap with the number of its data keys.
//!
//! `IDENTITY=a cargo run -p kube-leasehold --example kube_runtime_controller` (and `b`);
//! stop the leader with Ctrl-C or `kill -9` and watch the other take over.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use kube_leasehold::warm::Warm;
use kube_leasehold::{Candidate, Fence, KubeLeases, Timings, fence::fenced_client};
use tokio_util::sync::CancellationToken;

const LABEL: &str = "leasehold-example=watched";
const ANNOTATION: &str = "leasehold-example/data-keys";

async fn reconcile(cm: Arc<ConfigMap>, api: Arc<Api<ConfigMap>>) -> Result<Action, kube::Error> {
    let keys = cm.data.as_ref().map_or(0, |d| d.len()).to_string();
    if cm.annotations().get(ANNOTATION) != Some(&keys) {
        let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION: keys}}});
        let params = PatchParams::default();
        api.patch(&cm.name_any(), &params, &Patch::Merge(&patch))
            .await?;
        println!("annotated {} with {keys} keys", cm.name_any());
    }
    Ok(Action::await_change())
}

fn error_policy(_: Arc<ConfigMap>, err: &kube::Error, _: Arc<Api<ConfigMap>>) -> Action {
    eprintln!("reconcile failed (refused when the term has ended): {err}");
    Action::requeue(Duration::from_secs(1))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let identity = std::env::var("IDENTITY").unwrap_or_else(|_| "example".into());
    let config = kube::Config::infer().await?;
    let ns = config.default_namespace.clone();
    let client = Client::try_from(config.clone())?;
    // Warm on every replica, from the start.
    let warm = Arc::new(Warm::start(
        Api::<ConfigMap>::namespaced(client.clone(), &ns),
        watcher::Config::default().labels(LABEL),
    ));
    let fence = Fence::default();
    let fenced = Arc::new(Api::namespaced(fenced_client(&config, fence.clone())?, &ns));
    let timings = Timings::new(
        Duration::from_secs(4),
        Duration::from_secs(3),
        Duration::from_secs(1),
    )
    .map_err(anyhow::Error::msg)?;
    let campaign = Candidate::new(&identity, "kube-runtime-controller-example", ns, timings).spawn(
        KubeLeases::new(Api::<Lease>::default_namespaced(client)),
        fence,
    );
    let term = move |ended: CancellationToken| {
        let (warm, fenced) = (warm.clone(), fenced.clone());
        async move {
            println!("leading");
            let _ = warm.store().wait_until_ready().await;
            Controller::for_shared_stream(warm.trigger(), warm.store())
                .graceful_shutdown_on(async move { ended.cancelled().await })
                .run(reconcile, error_policy, fenced)
                .for_each(|_| futures::future::ready(()))
                .await;
            println!("term ended");
        }
    };
    let stop = async { tokio::signal::ctrl_c().await.unwrap_or_default() };
    campaign.run(Duration::from_secs(5), stop, term).await;
    Ok(())
}
