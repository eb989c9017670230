//! Foreign writers to a Lease: what `kubectl`, GitOps and policy tools do to it under a
//! working leader. Made with a client that is not a replica (the audit log does not count
//! them as a replica's acquisition or release).

use std::time::{Duration, Instant};

use anyhow::Result;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams};
use serde_json::json;

/// Deletes the Lease, as `kubectl delete lease` does.
pub async fn delete(leases: &Api<Lease>, name: &str) -> Result<()> {
    leases.delete(name, &DeleteParams::default()).await?;
    Ok(())
}

/// Sets `spec.holderIdentity` with a merge patch that keeps every other field: `""`
/// empties it; a replica's identity names that replica holder of a term it did not begin.
pub async fn set_holder(leases: &Api<Lease>, name: &str, holder: &str) -> Result<()> {
    let patch = json!({"spec": {"holderIdentity": holder}});
    leases
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

/// Relabels and annotates the Lease (metadata only, a new value each time) every `every`,
/// at most `count` times and for at most `limit`; the first write is at once. Returns the
/// writes that succeeded (a write fails while the Lease is absent).
pub async fn relabel(
    leases: &Api<Lease>,
    name: &str,
    every: Duration,
    count: usize,
    limit: Duration,
) -> usize {
    let started = Instant::now();
    let mut done = 0;
    for i in 0..count {
        if i > 0 {
            tokio::time::sleep(every).await;
        }
        if started.elapsed() >= limit {
            break;
        }
        let patch = json!({"metadata": {
            "labels": {"chaos.myresource-operator/relabelled": i.to_string()},
            "annotations": {"chaos.myresource-operator/relabelled-at": format!("{:?}", started.elapsed())},
        }});
        if leases
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .is_ok()
        {
            done += 1;
        }
    }
    done
}
