//! The operator's own Pods — this replica's and its peers' — as one watch sees them: the
//! I/O half of [`crate::replicas::exit`] (the holder's Pod), of [`crate::replicas::succession`] (whom a
//! releasing leader names) and of this replica's early stop ([`Replicas::deleting`]).
//!
//! One watch of the Pods in this replica's namespace that match the replica selector
//! (`--replica-selector`; the chart sets it to its selector labels, and by default it is
//! this Pod's own labels without the per-revision and per-Pod ones, read once).
//! Invariant: [`Replicas::pods`] is the state the watch last delivered, a re-list
//! replacing it whole once complete (never a mix of two lists).
//! Failures are retried as the caches' watches are ([`crate::retry`]: kube's backoff,
//! cut short by the API server's return, so the view is not stale for up to 30 s after an
//! outage); meanwhile a replica detects crashes by lease expiry only, stops at the
//! kubelet's SIGTERM only, and may name a successor from a stale view (which costs at most
//! a retry period, see [`crate::replicas::succession`]).

pub mod exit;
pub mod succession;
pub mod this_pod;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::{Api, ResourceExt};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::retry::{Reachability, retried};

/// The replicas' Pods by name.
pub type Pods = BTreeMap<String, Arc<Pod>>;

/// Labels that differ between the replicas of one workload, left out of the default
/// selector: a template's revision, a StatefulSet Pod's own name and index.
const PER_POD_LABELS: [&str; 4] = [
    "pod-template-hash",
    "controller-revision-hash",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
];

/// Resolves when `pods` sees a change (marking it seen); never without a receiver.
pub async fn changed(pods: &mut Option<watch::Receiver<Arc<Pods>>>) {
    match pods {
        Some(pods) => {
            if pods.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// A watch of the replicas' Pods, running until the last clone is dropped.
#[derive(Clone)]
pub struct Replicas {
    /// This replica's Pod.
    own: Arc<str>,
    pods: watch::Receiver<Arc<Pods>>,
}

impl Replicas {
    /// Starts watching the Pods of `api`'s namespace matching `selector` (by default the
    /// labels of this replica's Pod `own`, see the module doc).
    pub fn start(
        api: Api<Pod>,
        own: &str,
        selector: Option<String>,
        reachability: &Reachability,
    ) -> Self {
        let (sender, pods) = watch::channel(Arc::default());
        let returns = reachability.subscribe();
        tokio::spawn(run(api, own.to_string(), selector, returns, sender));
        Replicas {
            own: own.into(),
            pods,
        }
    }

    /// Replicas seen through a Pod view of your own (a test's, a simulation's): `pods` is
    /// the replicas' Pods by name as they change, `own` this replica's Pod.
    pub fn from_view(own: &str, pods: watch::Receiver<Arc<Pods>>) -> Self {
        Replicas {
            own: own.into(),
            pods,
        }
    }

    /// The Pods as last seen.
    pub fn pods(&self) -> Arc<Pods> {
        self.pods.borrow().clone()
    }

    /// A receiver whose first `changed` resolves at once once the watch has delivered
    /// anything, and then on each update.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Pods>> {
        self.pods.clone()
    }

    /// Resolves once this replica's Pod is being deleted: a stop that the kubelet's SIGTERM
    /// would only bring later. Never resolves while the Pods cannot be watched: the SIGTERM
    /// still comes.
    pub async fn deleting(&self) {
        let mut pods = self.subscribe();
        let deleting = pods
            .wait_for(|pods| {
                pods.get(&*self.own)
                    .is_some_and(|p| p.metadata.deletion_timestamp.is_some())
            })
            .await;
        if deleting.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

async fn run(
    api: Api<Pod>,
    own: String,
    selector: Option<String>,
    returns: watch::Receiver<u64>,
    sender: watch::Sender<Arc<Pods>>,
) {
    let selector = match selector.filter(|s| !s.is_empty()) {
        Some(selector) => selector,
        None => own_labels(&api, &own).await,
    };
    info!(%selector, "watching this operator's Pods");
    let config = watcher::Config::default().labels(&selector);
    let events = retried(
        watcher::watcher(api, config),
        returns,
        "operator Pod".into(),
    );
    let mut events = std::pin::pin!(events);
    let mut listing = Pods::new();
    while let Some(event) = events.next().await {
        match event {
            Event::Init => listing.clear(),
            Event::InitApply(pod) => {
                listing.insert(pod.name_any(), Arc::new(pod));
            }
            Event::InitDone => {
                sender.send_replace(Arc::new(std::mem::take(&mut listing)));
            }
            Event::Apply(pod) => {
                sender.send_modify(|pods| {
                    Arc::make_mut(pods).insert(pod.name_any(), Arc::new(pod));
                });
            }
            Event::Delete(pod) => {
                sender.send_modify(|pods| {
                    Arc::make_mut(pods).remove(&pod.name_any());
                });
            }
        }
        if sender.is_closed() {
            return;
        }
    }
}

/// The selector of this replica's peers: its own Pod's labels without [`PER_POD_LABELS`],
/// read with a bounded backoff until the read succeeds.
async fn own_labels(api: &Api<Pod>, own: &str) -> String {
    let mut pause = Duration::from_millis(250);
    let mut warned = false;
    loop {
        match api.get(own).await {
            Ok(pod) => {
                return pod
                    .labels()
                    .iter()
                    .filter(|(k, _)| !PER_POD_LABELS.contains(&k.as_str()))
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",");
            }
            Err(err) => {
                if !std::mem::replace(&mut warned, true) {
                    warn!(pod = own, error = %err, "cannot read this replica's Pod for its labels; retrying");
                }
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(30));
    }
}
