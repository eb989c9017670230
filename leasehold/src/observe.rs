//! What the crate reports, for the metrics you wire: implement [`Observer`] over your
//! registry (Prometheus client, the `metrics` facade, OpenTelemetry) and hand it to
//! [`crate::Candidate::observer`] and [`crate::scaleout::Membership`]. Every method has an
//! empty default, so an observer implements only what it exports; [`Silent`] reports
//! nothing.
//!
//! [`names`] holds the names controller-runtime exports for the same facts, so dashboards
//! written for a controller-runtime operator keep working.

use std::time::Duration;

/// Receives the crate's events. Called on the election's task: keep it cheap and never
/// block (set a gauge, bump a counter).
pub trait Observer: Send + Sync + 'static {
    /// This replica's term of Lease `lease` began (`true`) or ended (`false`):
    /// controller-runtime's [`names::LEADER_ELECTION_MASTER_STATUS`], labelled `name`.
    fn leading(&self, lease: &str, leading: bool) {
        let _ = (lease, leading);
    }

    /// A term of Lease `lease` began (a count of them is the number of leadership
    /// transitions this replica won).
    fn became_leader(&self, lease: &str) {
        let _ = lease;
    }

    /// A renewal of Lease `lease` succeeded after `took` (a histogram of it shows how close
    /// renewals come to the renew deadline).
    fn lease_renewed(&self, lease: &str, took: Duration) {
        let _ = (lease, took);
    }

    /// Scale-out: how many shards this replica leads and caches, and how many live members
    /// it sees.
    fn shards(&self, led: usize, cached: usize, members: usize) {
        let _ = (led, cached, members);
    }
}

/// Reports nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Silent;

impl Observer for Silent {}

/// Metric names as controller-runtime exports them.
pub mod names {
    /// Gauge, label `name` (the Lease): 1 while this replica leads it, else 0.
    pub const LEADER_ELECTION_MASTER_STATUS: &str = "leader_election_master_status";
}
