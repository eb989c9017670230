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
//! The leadership core (election, fence, term lifecycle, crash proof, successor hand-off,
//! scale-out) is the `kube-leasehold` crate of this workspace; this crate is its first
//! user. Folders by concept:
//! - [`cache`]: the warm caches every replica keeps (MyResources, their ConfigMaps, a slim
//!   Pod index), per shard in scale-out mode;
//! - [`control`]: the control loop: echo filter, controller, partitioned queues, reconcile,
//!   Events;
//! - [`scaleout`]: scale-out mode's wiring onto `kube_leasehold::scaleout`;
//! - [`infra`]: command line, clients, metrics, telemetry, HTTP endpoints;
//! - [`resource`], [`key`]: the `MyResource` custom resource, and the `namespace/name` key
//!   every part passes around.
//!
//! `main` only wires: it makes the one [`infra::metrics::Metrics`] and hands it to the parts
//! that record, and it builds the chain caches → [`control::echo::EchoFilter`] →
//! [`control::controller::Controller`].

pub mod cache;
pub mod control;
pub mod infra;
pub mod key;
pub mod resource;
pub mod scaleout;
