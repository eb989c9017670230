//! Leader election on Kubernetes Leases for kube-rs controllers, with the parts that make
//! it safe and fast: a **fence** on every write of a term, **warm takeover** (followers keep
//! their caches; a term starts without a LIST), a **crash proof** (a follower takes over as
//! soon as the holder's Pod proves its process exited, not a lease duration later),
//! **successor hand-off** on a rolling update, and **scale-out** over shard Leases.
//!
//! # Run something only while leading
//!
//! ```no_run
//! use std::time::Duration;
//! use k8s_openapi::api::coordination::v1::Lease;
//! use kube_leasehold::{Candidate, Fence, KubeLeases, Timings, fence::fenced_client};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let config = kube::Config::infer().await?;
//! let client = kube::Client::try_from(config.clone())?;
//! let leases = kube::Api::<Lease>::namespaced(client, "default");
//! let fence = Fence::default();
//! // The term's writes go through this client: refused as soon as the term ends.
//! let fenced = fenced_client(&config, fence.clone())?;
//! let term = move |ended: CancellationToken| {
//!     let fenced = fenced.clone();
//!     async move {
//!         // Your controller, writing with `fenced`, until `ended` is cancelled.
//!         ended.cancelled().await;
//!         drop(fenced);
//!     }
//! };
//! let stop = async { tokio::signal::ctrl_c().await.unwrap_or_default() };
//! Candidate::new("replica-a", "my-controller", "default", Timings::default())
//!     .spawn(KubeLeases::new(leases), fence)
//!     .run(Duration::from_secs(10), stop, term)
//!     .await;
//! # Ok(()) }
//! ```
//!
//! `examples/` has this as a program, and kube-runtime's own `Controller` running under a
//! term with warm reflector stores.
//!
//! # What is promised
//!
//! With `lease_duration > renew_deadline > retry_period` ([`Timings::new`] checks it):
//! - **at most one term writes at a time**, per Lease: acquiring and renewing are
//!   compare-and-swap writes, and a term's writes pass its [`Fence`], which closes at the
//!   renew deadline of its last successful renewal, before any other replica can acquire
//!   (it waits a whole lease duration from when it saw that renewal, on its own monotonic
//!   clock). A write let through is sent with the API server's `timeout` set to the time
//!   left, on a connection that takes bytes only while the fence is open;
//! - **a released Lease is taken at once**: shutdown closes the fence, stops the term,
//!   waits until its writes are answered, then releases; a Lease found absent (a first
//!   start, or deleted by hand) is created one lease duration later, since it may have been
//!   deleted while its holder still wrote;
//! - **a crash is taken over on proof** (in a Pod, with [`Candidate::in_pod`] and
//!   [`Candidate::replicas`]): when the holder's container reports that exactly the holding
//!   process exited, followers take over after the fence's write margin instead of the
//!   lease duration.
//!
//! # What is not promised
//!
//! - Clocks must run at rates that agree to within `lease_duration / renew_deadline`; no
//!   wall clock is compared, but a monotonic clock that runs slow lengthens a fence.
//! - A write the API server received is applied within the fence only if the server honours
//!   the `timeout` parameter and the network delivers within
//!   [`fence::MAX_WRITE_TIME`]; a process paused *between* its fence check and the kernel
//!   taking its bytes is not fenced.
//! - Writes made with any client other than the fenced one are not fenced.
//! - [`KubeLeases`] needs, on the Lease's namespace, `create` on leases and `get`, `list`,
//!   `watch`, `update` on the Lease (by `resourceNames`): it reads the Lease with a list by
//!   name, which says as of which resourceVersion it is absent.
//! - The crash proof needs, in each Pod, the process to announce its instance in its
//!   container's termination message ([`replicas::exit::announce_instance`], the default
//!   `terminationMessagePath` with `terminationMessagePolicy: File`), the Pod's
//!   ServiceAccount token mounted ([`replicas::this_pod::this_pod`]) and the right to
//!   watch the replicas' Pods. Without them, and outside a Pod, a crash is taken over when
//!   the lease expires. It trusts whoever may write `pods/status`, as the cluster does.
//! - A foreign write that forges a graceful release (an empty holder, a one-second lease, a
//!   new renew time) is taken as one, at once.
//! - In scale-out mode the plan only steers: replicas that disagree about who is live may
//!   leave a shard unled for up to a lease duration, never led twice.
//!
//! # Parts
//!
//! - [`election`]: the pure [`election::Elector`] and its [`election::Driver`] behind a
//!   [`election::LeaseStore`] ([`KubeLeases`] for a real cluster);
//! - [`fence`]: the [`Fence`] and the fenced `kube::Client`;
//! - [`Candidate`] / [`Campaign`]: an election with its term lifecycle ([`term`]);
//! - [`replicas`]: this Pod, the replicas' Pods, the crash proof, successor hand-off;
//! - [`scaleout`]: shard keys and selectors, the plan, membership, a shard group (behind
//!   an [`election::GroupStore`], [`KubeLeases`] for a real cluster);
//! - [`observe`]: the metrics hook, with controller-runtime's names;
//! - [`retry`]: watch retries that restart when the API server answers again;
//! - [`warm`]: warm reflector stores that a kube-runtime `Controller` starts each term on.

#![warn(missing_docs)]

#[doc(hidden)]
pub mod bugs;
mod candidate;
pub mod clock;
pub mod election;
pub mod fence;
pub mod observe;
pub mod replicas;
pub mod retry;
pub mod scaleout;
pub mod term;
mod throttle;
pub mod warm;

pub use candidate::{Campaign, Candidate};
pub use election::{KubeLeases, Timings};
pub use fence::Fence;
