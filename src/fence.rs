//! Fencing: the proof of leadership that a reconcile checks before every write.
//!
//! The elector extends the fence after each successful renew to
//! `start of that renew + renew deadline` (on the monotonic clock) and revokes it when it
//! steps down. A replica that is frozen or cut off therefore stops writing at the latest one
//! renew deadline after its last successful renew, which is before any other replica can
//! observe the Lease as expired (lease duration > renew deadline). A single-replica run
//! without election uses [`Fence::unfenced`].

use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Returned by [`Fence::check`] when this replica may not write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotLeader;

impl std::fmt::Display for NotLeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("this replica's leadership is not (or no longer) valid")
    }
}

impl std::error::Error for NotLeader {}

#[derive(Debug, Clone, Copy)]
enum Validity {
    Always,
    Until(Instant),
    Never,
}

/// Shared between the elector (which extends and revokes it) and the reconcilers.
#[derive(Debug, Clone)]
pub struct Fence(Arc<Mutex<Validity>>);

impl Fence {
    /// A fence that never blocks (no election).
    pub fn unfenced() -> Self {
        Fence(Arc::new(Mutex::new(Validity::Always)))
    }

    /// A fence that blocks until [`Fence::extend`] is called.
    pub fn closed() -> Self {
        Fence(Arc::new(Mutex::new(Validity::Never)))
    }

    /// Allows writes until `until`.
    pub fn extend(&self, until: Instant) {
        *self.0.lock().expect("fence lock") = Validity::Until(until);
    }

    /// Blocks writes from now on.
    pub fn revoke(&self) {
        *self.0.lock().expect("fence lock") = Validity::Never;
    }

    /// Whether a write may start at `now`.
    pub fn check_at(&self, now: Instant) -> Result<(), NotLeader> {
        match *self.0.lock().expect("fence lock") {
            Validity::Always => Ok(()),
            Validity::Until(until) if now < until => Ok(()),
            _ => Err(NotLeader),
        }
    }

    /// Whether a write may start now.
    pub fn check(&self) -> Result<(), NotLeader> {
        self.check_at(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn fence_opens_until_its_deadline_and_closes_on_revoke() {
        let t = Instant::now();
        let fence = Fence::closed();
        assert_eq!(fence.check_at(t), Err(NotLeader));
        fence.extend(t + Duration::from_secs(10));
        assert_eq!(fence.check_at(t + Duration::from_secs(9)), Ok(()));
        assert_eq!(fence.check_at(t + Duration::from_secs(10)), Err(NotLeader));
        fence.revoke();
        assert_eq!(fence.check_at(t), Err(NotLeader));
        assert_eq!(
            Fence::unfenced().check_at(t + Duration::from_secs(1 << 20)),
            Ok(())
        );
    }
}
