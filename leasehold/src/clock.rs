//! Time as the crate reads it: the monotonic clock every deadline is measured on, and the
//! wall clock written into Lease records.
//!
//! Invariants:
//! - every monotonic reading goes through [`now`], which is tokio's clock: the system's
//!   in production, a paused or simulated runtime's in tests and in the simulator, so a
//!   history of minutes can run in milliseconds with every deadline honoured;
//! - the wall clock is only *written* (acquire and renew times), never compared across
//!   replicas; it is injectable ([`WallClock`]) so a simulation can skew and step it per
//!   node.

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::jiff::Timestamp;

/// The monotonic time now, on tokio's clock.
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Where the wall time written into Lease records comes from.
pub trait WallClock: Send + Sync + 'static {
    /// The wall time now.
    fn now(&self) -> Timestamp;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemWall;

impl WallClock for SystemWall {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A shared wall clock.
pub type Wall = Arc<dyn WallClock>;

/// The system's wall clock, shared.
pub fn system_wall() -> Wall {
    Arc::new(SystemWall)
}
