//! The Lease holder's Pod, as a follower watches it (the I/O half of [`crate::crash`]).
//!
//! One Pod, by name (`metadata.name=<holder>`), in the Lease's namespace: the watch moves
//! whenever the holder changes, and stops while nobody (or this replica) holds the Lease.
//! Invariant: [`HolderPod::current`] is the latest state of the Pod named by the last
//! [`HolderPod::follow`], never of an earlier holder's (it is cleared when the name
//! changes).
//! Failures are retried with kube's backoff; a follower that cannot watch (say, RBAC without
//! Pods in its namespace) logs it once and detects crashes by lease expiry only.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tracing::{debug, warn};

/// A watch of the holder's Pod, running until this is dropped.
pub struct HolderPod {
    name: watch::Sender<String>,
    pod: watch::Receiver<Option<Arc<Pod>>>,
}

impl HolderPod {
    /// Starts watching the Pods of `api`'s namespace named by [`HolderPod::follow`].
    pub fn start(api: Api<Pod>) -> Self {
        let (name, names) = watch::channel(String::new());
        let (pods, pod) = watch::channel(None);
        tokio::spawn(run(api, names, pods));
        HolderPod { name, pod }
    }

    /// Watches the Pod `holder` from now on ("" for none).
    pub fn follow(&self, holder: &str) {
        self.name.send_if_modified(|name| {
            let changed = name != holder;
            if changed {
                holder.clone_into(name);
            }
            changed
        });
    }

    /// The followed Pod's latest state (once seen), and a receiver that wakes on the next.
    pub fn current(&self) -> (Option<Arc<Pod>>, watch::Receiver<Option<Arc<Pod>>>) {
        let mut next = self.pod.clone();
        let pod = next.borrow_and_update().clone();
        (pod, next)
    }
}

async fn run(
    api: Api<Pod>,
    mut names: watch::Receiver<String>,
    pods: watch::Sender<Option<Arc<Pod>>>,
) {
    let mut warned = false;
    loop {
        let name = names.borrow_and_update().clone();
        pods.send_replace(None);
        if name.is_empty() {
            if names.changed().await.is_err() {
                return;
            }
            continue;
        }
        debug!(pod = %name, "watching the Lease holder's Pod");
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut events = std::pin::pin!(watcher::watcher(api.clone(), config).default_backoff());
        loop {
            tokio::select! {
                changed = names.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    break;
                }
                event = events.next() => match event {
                    Some(Ok(Event::Apply(pod) | Event::InitApply(pod))) => {
                        warned = false;
                        pods.send_replace(Some(Arc::new(pod)));
                    }
                    Some(Ok(Event::Delete(_))) => {
                        pods.send_replace(None);
                    }
                    Some(Ok(Event::Init | Event::InitDone)) => {}
                    Some(Err(err)) => {
                        if !std::mem::replace(&mut warned, true) {
                            warn!(pod = %name, error = %err, "cannot watch the Lease holder's Pod: a crash is detected by lease expiry only until this works");
                        }
                    }
                    None => return,
                }
            }
        }
    }
}
