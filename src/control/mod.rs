//! The control loop: what happens between a cache's change and a write.
//!
//! caches → [`echo`] (drops the echo of our own last write) → [`controller`] (routes a
//! key to its [`partition`]'s [`queue`], runs the workers of a term) → [`reconcile`]
//! (apply, status, [`events`]), all keyed by [`crate::key::ObjectKey`].

pub mod controller;
pub mod echo;
pub mod events;
pub mod partition;
pub mod queue;
pub mod reconcile;
