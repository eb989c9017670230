//! The steady workload the faults strike under: MyResources and labelled Pods created,
//! updated and deleted at a fixed rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
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
    attempted: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

/// The workload's operations so far: attempted, and failed for another reason than the
/// expected ones (an object that exists already, or is gone already).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Operations {
    pub(super) attempted: u64,
    pub(super) failed: u64,
}

impl Operations {
    /// The operations made since `earlier`.
    pub(super) fn since(self, earlier: Operations) -> Operations {
        Operations {
            attempted: self.attempted - earlier.attempted,
            failed: self.failed - earlier.failed,
        }
    }

    pub(super) fn succeeded(self) -> u64 {
        self.attempted - self.failed
    }
}

impl Workload {
    pub(super) fn start(client: Client, seed: u64) -> Workload {
        let running = Arc::new(AtomicBool::new(true));
        let paused = Arc::new(AtomicBool::new(false));
        let idle = Arc::new(tokio::sync::Notify::new());
        let attempted = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let task = {
            let (running, paused, idle, attempted, failed) = (
                running.clone(),
                paused.clone(),
                idle.clone(),
                attempted.clone(),
                failed.clone(),
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
                    if let Err(err) = operate(&mrs, &pods, &mut rng, counter).await {
                        failed.fetch_add(1, Ordering::SeqCst);
                        eprintln!("  workload operation failed: {err}");
                    }
                    attempted.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        Workload {
            running,
            paused,
            idle,
            attempted,
            failed,
            task,
        }
    }

    pub(super) fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
    }

    /// Pauses and waits until no operation is in flight.
    pub(super) async fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
        let _ = tokio::time::timeout(Duration::from_secs(10), self.idle.notified()).await;
    }

    pub(super) fn operations(&self) -> Operations {
        Operations {
            attempted: self.attempted.load(Ordering::SeqCst),
            failed: self.failed.load(Ordering::SeqCst),
        }
    }

    pub(super) async fn stop(self) {
        self.running.store(false, Ordering::SeqCst);
        let _ = self.task.await;
    }
}

/// One operation, chosen by `rng`: create or update a MyResource (6 in 10), delete one (1
/// in 10), create a labelled Pod (2 in 10) or delete one (1 in 10). An object that exists
/// already or is gone already is an expected outcome; any other error is returned.
async fn operate(
    mrs: &Api<MyResource>,
    pods: &Api<Pod>,
    rng: &mut Rng,
    counter: u64,
) -> Result<(), kube::Error> {
    let i = rng.below(40);
    let name = format!("w{i}");
    let outcome = match rng.below(10) {
        0..=5 => {
            let mr = MyResource::new(
                &name,
                MyResourceSpec {
                    message: format!("m{counter}"),
                    some_value: counter as i32,
                },
            );
            match mrs.create(&PostParams::default(), &mr).await {
                Ok(_) => Ok(()),
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
    match outcome {
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        other => other,
    }
}
