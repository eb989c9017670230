//! Where the election reads and writes its Lease: the [`LeaseStore`] seam (and
//! [`GroupStore`], what a shard group's membership needs besides), and their kube
//! implementation [`KubeLeases`].
//!
//! The election's safety rests on two properties of a store, which the API server gives
//! and a test double must give too: a `replace` succeeds only if the Lease still has the
//! resourceVersion it carries (else [`StoreError::Conflict`]), and a `create` fails with
//! [`StoreError::Conflict`] when the Lease exists. Everything else (timeouts, retries,
//! when to watch) is the driver's.

use std::future::Future;

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions, WatchEvent, WatchParams};
use kube::runtime::watcher;

/// Why a store request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// 409: a replace whose resourceVersion is stale, or a create of an existing Lease.
    Conflict,
    /// 404: the Lease does not exist.
    NotFound,
    /// 410 Gone: a watch's resourceVersion was compacted away; what happened since is
    /// unknown.
    Gone,
    /// Anything else (transport, 5xx, 429, a refused request): the driver pauses a retry
    /// period and tries again.
    Other(String),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Conflict => f.write_str("conflict (409)"),
            StoreError::NotFound => f.write_str("not found (404)"),
            StoreError::Gone => f.write_str("gone (410): resourceVersion compacted"),
            StoreError::Other(err) => f.write_str(err),
        }
    }
}

impl std::error::Error for StoreError {}

/// What a watch of one Lease delivers.
#[derive(Debug, Clone)]
pub enum LeaseEvent {
    /// The Lease was created or changed: its new state.
    Applied(Box<Lease>),
    /// The Lease was deleted, at this resourceVersion (a watch from it sees what follows).
    Deleted {
        /// The resourceVersion of the deletion.
        resource_version: String,
    },
}

/// What a read of one Lease found.
#[derive(Debug, Clone)]
pub enum Read {
    /// The Lease.
    Found(Box<Lease>),
    /// No such Lease, as of `resource_version`: a watch from it sees the Lease created, if
    /// it is, however briefly.
    Absent {
        /// The resourceVersion of the read.
        resource_version: String,
    },
}

/// A stream of one Lease's changes; it ends when the store ends the watch. A watch from a
/// compacted resourceVersion yields [`StoreError::Gone`].
pub type LeaseEvents = BoxStream<'static, Result<LeaseEvent, StoreError>>;

/// The Leases of one namespace, as the election needs them. Implemented by [`KubeLeases`];
/// a test or a simulation implements it over its own model of the API server.
pub trait LeaseStore: Send + Sync + 'static {
    /// The Lease `name`, or the resourceVersion at which it was absent.
    fn get(&self, name: &str) -> impl Future<Output = Result<Read, StoreError>> + Send;

    /// Creates `lease`; [`StoreError::Conflict`] when it exists.
    fn create(&self, lease: &Lease) -> impl Future<Output = Result<Lease, StoreError>> + Send;

    /// Replaces the Lease `lease` names if its resourceVersion is still the one `lease`
    /// carries; [`StoreError::Conflict`] otherwise, [`StoreError::NotFound`] when absent.
    fn replace(&self, lease: &Lease) -> impl Future<Output = Result<Lease, StoreError>> + Send;

    /// Watches the Lease `name` from `resource_version` for at most `timeout_secs`.
    fn watch(
        &self,
        name: &str,
        resource_version: &str,
        timeout_secs: u32,
    ) -> impl Future<Output = Result<LeaseEvents, StoreError>> + Send;
}

/// What a shard group's membership needs besides one Lease's reads and writes: the
/// namespace, one watch of every Lease of the group, and a conditional delete.
/// Implemented by [`KubeLeases`]; a simulation implements it over its own server.
pub trait GroupStore: LeaseStore + Clone {
    /// The namespace of the Leases.
    fn namespace(&self) -> String;

    /// Every Lease labelled `selector`, as kube's watcher reports them: a list
    /// (`Init`, `InitApply`…, `InitDone`), then each change; after an error, the next poll
    /// starts over (a list again, or a watch from the last resourceVersion).
    fn watch_group(
        &self,
        selector: &str,
    ) -> BoxStream<'static, watcher::Result<watcher::Event<Lease>>>;

    /// Deletes the Lease `name` if its resourceVersion is still `resource_version`.
    fn delete(
        &self,
        name: &str,
        resource_version: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// The Leases of one namespace on a Kubernetes API server. Give it a client that does not
/// retry by itself (`kube::Config::default_retry = false`): the driver bounds every
/// request in time and retries on its own schedule.
#[derive(Clone)]
pub struct KubeLeases {
    api: Api<Lease>,
}

impl KubeLeases {
    /// The Leases `api` reaches (namespaced).
    pub fn new(api: Api<Lease>) -> Self {
        KubeLeases { api }
    }
}

fn store_error(err: kube::Error) -> StoreError {
    match &err {
        kube::Error::Api(status) if status.code == 409 => StoreError::Conflict,
        kube::Error::Api(status) if status.code == 404 => StoreError::NotFound,
        _ => StoreError::Other(err.to_string()),
    }
}

impl LeaseStore for KubeLeases {
    /// A list by name (`list` on the Lease, which RBAC grants by `resourceNames` for a
    /// `metadata.name` field selector): unlike a GET's 404, it says as of which
    /// resourceVersion the Lease is absent.
    async fn get(&self, name: &str) -> Result<Read, StoreError> {
        let params = ListParams::default().fields(&format!("metadata.name={name}"));
        let list = self.api.list(&params).await.map_err(store_error)?;
        Ok(match list.items.into_iter().next() {
            Some(lease) => Read::Found(Box::new(lease)),
            None => Read::Absent {
                resource_version: list.metadata.resource_version.unwrap_or_default(),
            },
        })
    }

    async fn create(&self, lease: &Lease) -> Result<Lease, StoreError> {
        self.api
            .create(&PostParams::default(), lease)
            .await
            .map_err(store_error)
    }

    async fn replace(&self, lease: &Lease) -> Result<Lease, StoreError> {
        let name = lease.metadata.name.as_deref().unwrap_or_default();
        self.api
            .replace(name, &PostParams::default(), lease)
            .await
            .map_err(store_error)
    }

    async fn watch(
        &self,
        name: &str,
        resource_version: &str,
        timeout_secs: u32,
    ) -> Result<LeaseEvents, StoreError> {
        let params = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(timeout_secs);
        let events = self
            .api
            .watch(&params, resource_version)
            .await
            .map_err(store_error)?;
        Ok(events
            .map_err(store_error)
            .filter_map(|event| async move {
                match event {
                    Ok(WatchEvent::Added(lease) | WatchEvent::Modified(lease)) => {
                        Some(Ok(LeaseEvent::Applied(Box::new(lease))))
                    }
                    Ok(WatchEvent::Deleted(lease)) => Some(Ok(LeaseEvent::Deleted {
                        resource_version: lease.resource_version().unwrap_or_default(),
                    })),
                    Ok(WatchEvent::Error(status)) if status.code == 410 => {
                        Some(Err(StoreError::Gone))
                    }
                    // Any other error event is followed by the end of the stream.
                    Ok(WatchEvent::Bookmark(_) | WatchEvent::Error(_)) => None,
                    Err(err) => Some(Err(err)),
                }
            })
            .boxed())
    }
}

impl GroupStore for KubeLeases {
    fn namespace(&self) -> String {
        self.api.namespace().unwrap_or_default().to_string()
    }

    fn watch_group(
        &self,
        selector: &str,
    ) -> BoxStream<'static, watcher::Result<watcher::Event<Lease>>> {
        watcher::watcher(
            self.api.clone(),
            watcher::Config::default().labels(selector),
        )
        .boxed()
    }

    async fn delete(&self, name: &str, resource_version: &str) -> Result<(), StoreError> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: Some(resource_version.into()),
                uid: None,
            }),
            ..DeleteParams::default()
        };
        self.api
            .delete(name, &params)
            .await
            .map(drop)
            .map_err(store_error)
    }
}
