//! The replicas' Pods and their kubelets: one Pod per replica slot, whose uid survives
//! container restarts; the kubelet reports the container's state some time after a process
//! starts or ends (the ended one's termination message names the instance it announced),
//! and not at all while it is silenced; every process sees the Pods through a view of its
//! own, delivered late and cut off by its partitions.
//!
//! This feeds the crate's crash proof ([`kube_leasehold::replicas::exit`]) and successor
//! hand-off ([`kube_leasehold::replicas::succession`]) exactly what a Pod watch would.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube_leasehold::replicas::exit::termination_message;
use kube_leasehold::replicas::this_pod::PodInfo;
use kube_leasehold::replicas::{Pods, Replicas};
use serde_json::json;
use tokio::sync::watch;

use crate::world::{Container, NAMESPACE, World};

/// How long a kubelet takes to report a container's start or end (PLEG relists each second).
const REPORT: (Duration, Duration) = (Duration::from_millis(200), Duration::from_millis(1500));
/// How late a process's Pod watch delivers a change.
const VIEW_LAG: (Duration, Duration) = (Duration::ZERO, Duration::from_millis(250));

/// The name of `replica`'s Pod: its identity, as a Deployment's replicas are named.
pub fn pod_name(replica: usize) -> String {
    format!("r{replica}")
}

/// The instance token process `pid` announces.
fn instance(pid: usize) -> String {
    format!("instance-{pid}")
}

/// What process `pid` in `replica`'s Pod knows about its Pod.
pub fn pod_info(replica: usize, pid: usize) -> PodInfo {
    PodInfo {
        service_account: OwnerReference {
            api_version: "v1".into(),
            kind: "ServiceAccount".into(),
            name: "sim".into(),
            uid: "sa-uid".into(),
            ..Default::default()
        },
        name: pod_name(replica),
        namespace: NAMESPACE.into(),
        uid: format!("uid-r{replica}"),
        instance: Some(instance(pid)),
    }
}

/// The Pod its kubelet reports for `replica`'s `container`.
fn pod(replica: usize, container: &Container) -> Pod {
    let terminated = |(pid, code): (usize, i32)| json!({"terminated": {"exitCode": code, "message": termination_message(&instance(pid))}});
    let (state, last) = match (container.running, container.ended) {
        (Some(_), ended) => (json!({"running": {}}), ended.map_or(json!({}), terminated)),
        (None, Some(ended)) => (terminated(ended), json!({})),
        (None, None) => (json!({"waiting": {}}), json!({})),
    };
    let ready = container.running.is_some();
    serde_json::from_value(json!({
        "metadata": {
            "name": pod_name(replica),
            "namespace": NAMESPACE,
            "uid": format!("uid-r{replica}"),
            "labels": {"app": "sim"},
            "creationTimestamp": format!("2027-01-15T08:00:0{}Z", replica.min(9)),
        },
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            "containerStatuses": [{
                "name": "operator", "image": "sim", "imageID": "", "ready": ready,
                "restartCount": container.restarts, "state": state, "lastState": last,
            }],
        },
    }))
    .expect("a Pod the API would serve")
}

/// Records a change of `replica`'s container and has its kubelet report it.
pub fn changed(world: &World, replica: usize, change: impl FnOnce(&mut Container)) {
    if !world.history.pods {
        return;
    }
    let delay = {
        let mut state = world.lock();
        change(&mut state.slots[replica].container);
        state.rng.between(REPORT.0, REPORT.1)
    };
    let world = world.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        // A silenced kubelet reports nothing until it is back; then what is true then.
        let mut silent = world.lock().slots[replica].kubelet_silent.subscribe();
        let _ = silent.wait_for(|s| *s == 0).await;
        let state = world.lock();
        let pod = Arc::new(pod(replica, &state.slots[replica].container));
        let name = pod_name(replica);
        let mut pods: Pods = (**state.pods.borrow()).clone();
        pods.insert(name, pod);
        state.pods.send_replace(Arc::new(pods));
    });
}

/// Process `pid`'s view of the Pods: each change delivered up to [`VIEW_LAG`] late, held
/// while the process is cut off or frozen, and no more once it is dead.
pub fn view(world: &World, pid: usize, replica: usize) -> Replicas {
    let mut pods = world.lock().pods.subscribe();
    pods.mark_changed();
    let (deliver, delivered) = watch::channel(Arc::new(Pods::new()));
    let world = world.clone();
    tokio::spawn(async move {
        while pods.changed().await.is_ok() {
            let lag = world.lock().rng.between(VIEW_LAG.0, VIEW_LAG.1);
            tokio::time::sleep(lag).await;
            loop {
                let (alive, cut) = world.reach(pid);
                if !alive {
                    return;
                }
                if !cut {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            world.unfrozen(replica).await;
            let current = pods.borrow_and_update().clone();
            deliver.send_replace(current);
        }
    });
    Replicas::from_view(&pod_name(replica), delivered)
}
