//! The steady workload the faults strike under: MyResources and labelled Pods created,
//! updated and deleted at a fixed rate.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use myresource_operator::resource::{MyResource, MyResourceSpec, POD_LABEL};
use serde_json::json;

use super::NAMESPACE;
use super::schedule::Rng;

/// Creates, updates and deletes MyResources and labelled Pods at a fixed rate (10 per
/// second), bounded to 40 objects of each kind, until stopped.
pub(super) struct Workload {
    running: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    idle: Arc<tokio::sync::Notify>,
    operations: Arc<AtomicU64>,
    /// Every uid each MyResource name has had (scale-out chaos: a name created again may
    /// land on another shard).
    uids: Arc<Mutex<Uids>>,
    task: tokio::task::JoinHandle<()>,
}

/// MyResource names and the uids they have had.
pub(super) type Uids = BTreeMap<String, BTreeSet<String>>;

impl Workload {
    pub(super) fn start(client: Client, seed: u64) -> Workload {
        let running = Arc::new(AtomicBool::new(true));
        let paused = Arc::new(AtomicBool::new(false));
        let idle = Arc::new(tokio::sync::Notify::new());
        let operations = Arc::new(AtomicU64::new(0));
        let uids = Arc::new(Mutex::new(Uids::new()));
        let task = {
            let (running, paused, idle, operations, uids) = (
                running.clone(),
                paused.clone(),
                idle.clone(),
                operations.clone(),
                uids.clone(),
            );
            tokio::spawn(async move {
                let mut rng = Rng::new(seed ^ 0x5eed);
                let mrs: Api<MyResource> = Api::namespaced(client.clone(), NAMESPACE);
                let pods: Api<Pod> = Api::namespaced(client, NAMESPACE);
                let mut counter = 0u64;
                while running.load(Ordering::SeqCst) {
                    if paused.load(Ordering::SeqCst) {
                        idle.notify_waiters();
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    counter += 1;
                    operate(&mrs, &pods, &mut rng, counter, &uids).await;
                    operations.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        Workload {
            running,
            paused,
            idle,
            operations,
            uids,
            task,
        }
    }

    /// Every uid each MyResource name has had so far.
    pub(super) fn uids(&self) -> Uids {
        self.uids.lock().expect("uids lock").clone()
    }

    pub(super) fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
    }

    /// Pauses and waits until no operation is in flight.
    pub(super) async fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
        let _ = tokio::time::timeout(Duration::from_secs(10), self.idle.notified()).await;
    }

    pub(super) fn operations(&self) -> u64 {
        self.operations.load(Ordering::SeqCst)
    }

    pub(super) async fn stop(self) {
        self.running.store(false, Ordering::SeqCst);
        let _ = self.task.await;
    }
}

/// One operation, chosen by `rng`: create or update a MyResource (6 in 10), delete one (1
/// in 10), create a labelled Pod (2 in 10) or delete one (1 in 10).
async fn operate(
    mrs: &Api<MyResource>,
    pods: &Api<Pod>,
    rng: &mut Rng,
    counter: u64,
    uids: &Mutex<Uids>,
) {
    let i = rng.below(40);
    let name = format!("w{i}");
    // Errors (object exists, not found, API server restarting) are part of chaos.
    let _ = match rng.below(10) {
        0..=5 => {
            let mr = MyResource::new(
                &name,
                MyResourceSpec {
                    message: format!("m{counter}"),
                    some_value: counter as i32,
                },
            );
            match mrs.create(&PostParams::default(), &mr).await {
                Ok(created) => {
                    let uid = created.uid().unwrap_or_default();
                    let mut uids = uids.lock().expect("uids lock");
                    uids.entry(name).or_default().insert(uid);
                    Ok(())
                }
                Err(kube::Error::Api(s)) if s.code == 409 => mrs
                    .patch(&name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"message": format!("m{counter}"), "someValue": counter as i32}})))
                    .await
                    .map(|_| ()),
                other => other.map(|_| ()),
            }
        }
        6 => mrs
            .delete(&name, &DeleteParams::default())
            .await
            .map(|_| ()),
        7 | 8 => {
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": format!("p{i}"), "labels": {POD_LABEL: name}},
                // No scheduler has this name: on a cluster with a node the Pod stays
                // Pending, as it does without one, instead of failing to pull.
                "spec": {"schedulerName": "chaos-unscheduled",
                         "containers": [{"name": "c", "image": "registry.invalid/none"}]}
            }))
            .expect("a valid Pod");
            pods.create(&PostParams::default(), &pod).await.map(|_| ())
        }
        _ => pods
            .delete(&format!("p{i}"), &DeleteParams::default())
            .await
            .map(|_| ()),
    };
}
