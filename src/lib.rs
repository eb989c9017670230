//! myresource-operator: a high-availability Kubernetes operator for `MyResource`.
//!
//! Event flow of one replica:
//!
//! ```text
//! kube-apiserver ─watch─► cache (MyResources, owned ConfigMaps, slim Pod index)
//!                              │ changed(key)           (warm on every replica)
//!                              ▼
//!                         controller ── while leading ──► shard = hash(ns/name) % S
//!                                                          │ queue: dedupe, one key per worker,
//!                                                          │ backoff, requeue-after
//!                                                          ▼
//!                                                  W workers ─► reconcile ─► apply / status
//!                                                                       │ fence layer: refused
//!                                                                       │ when closed, deadline
//!                                                                       ▼ = fence expiry
//! Lease ◄─ replace ─ election ─► leadership (fence, role, metric, term, shutdown order)
//! ```

pub mod cache;
pub mod cli;
pub mod controller;
pub mod echo;
pub mod election;
pub mod endpoints;
pub mod events;
pub mod fence;
pub mod key;
pub mod kubeclient;
pub mod leadership;
pub mod metrics;
pub mod queue;
pub mod reconcile;
pub mod resource;
pub mod shard;
pub mod telemetry;
pub mod throttle;
