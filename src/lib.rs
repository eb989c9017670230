//! myresource-operator: a high-availability Kubernetes operator for `MyResource`.
//!
//! Event flow of one replica:
//!
//! ```text
//! kube-apiserver ─watch─► cache (MyResources, owned ConfigMaps, slim Pod index)
//!                              │ Change (key, trigger, seen)   (warm on every replica)
//!                              ▼
//!                         echo filter (drops the echo of our own last write)
//!                              │
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
//!                      ▲
//!   the operator's Pods (replicas): the holder's crash, a release's successor, own deletion
//! ```
//!
//! `main` only wires: it makes the one [`metrics::Metrics`] and hands it to the parts that
//! record, and it builds the chain caches → [`echo::EchoFilter`] → [`controller::Controller`].

pub mod assignment;
pub mod cache;
pub mod cli;
pub mod controller;
pub mod crash;
pub mod echo;
pub mod election;
pub mod endpoints;
pub mod events;
pub mod fence;
pub mod key;
pub mod kubeclient;
pub mod leadership;
pub mod membership;
pub mod metrics;
pub mod pod;
pub mod queue;
pub mod reconcile;
pub mod replicas;
pub mod resource;
pub mod scaleout;
pub mod shard;
pub mod shardkey;
pub mod succession;
pub mod telemetry;
pub mod throttle;
