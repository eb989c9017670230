//! Writes a ConfigMap every second, only while this process leads the Lease
//! `only-while-leading`. Start two (`IDENTITY=a`, `IDENTITY=b`) and stop the leader.
use std::time::Duration;

use k8s_openapi::api::{coordination::v1::Lease, core::v1::ConfigMap};
use kube::api::{Api, Patch, PatchParams};
use kube_leasehold::{Candidate, Fence, KubeLeases, Timings, fence::fenced_client};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let me = std::env::var("IDENTITY").unwrap_or_else(|_| "example".into());
    let config = kube::Config::infer().await?;
    let ns = config.default_namespace.clone();
    let leases = Api::<Lease>::namespaced(kube::Client::try_from(config.clone())?, &ns);
    let fence = Fence::default();
    // Writes through this client are refused the moment a term ends.
    let cms = Api::<ConfigMap>::namespaced(fenced_client(&config, fence.clone())?, &ns);
    let campaign = Candidate::new(&me, "only-while-leading", ns, Timings::default())
        .spawn(KubeLeases::new(leases), fence);
    let cm = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "leader"}, "data": {"leader": me}});
    let term = move |ended: tokio_util::sync::CancellationToken| {
        let (cms, cm) = (cms.clone(), cm.clone());
        async move {
            while !ended.is_cancelled() {
                let apply = PatchParams::apply("only-while-leading");
                if let Err(err) = cms.patch("leader", &apply, &Patch::Apply(&cm)).await {
                    eprintln!("write refused or failed: {err}");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let stop = async { tokio::signal::ctrl_c().await.unwrap_or_default() };
    campaign.run(Duration::from_secs(5), stop, term).await;
    Ok(())
}
