//! The election's three durations and the rule between them.

use std::time::Duration;

/// Lease timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    /// How long followers wait, from observing the last change of the election record,
    /// before taking the Lease over (at least; see the module doc).
    pub lease_duration: Duration,
    /// How long the leader keeps leading without a successful renew.
    pub renew_deadline: Duration,
    /// How often the leader renews and followers retry.
    pub retry_period: Duration,
}

impl Default for Timings {
    /// client-go's defaults: 15 s, 10 s, 2 s.
    fn default() -> Self {
        Timings {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

impl Timings {
    /// Checks `lease_duration > renew_deadline > retry_period > 0`, with messages a person
    /// can act on.
    pub fn new(
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Result<Self, String> {
        if retry_period.is_zero() {
            return Err("--retry-period must be greater than zero".into());
        }
        if renew_deadline <= retry_period {
            return Err(format!(
                "--renew-deadline ({renew_deadline:?}) must be greater than --retry-period \
                 ({retry_period:?}): the leader needs more than one renew attempt per deadline"
            ));
        }
        if lease_duration <= renew_deadline {
            return Err(format!(
                "--lease-duration ({lease_duration:?}) must be greater than --renew-deadline \
                 ({renew_deadline:?}): otherwise a follower may take over while the old leader \
                 still believes it leads"
            ));
        }
        if lease_duration.as_secs() < 1 || lease_duration.subsec_nanos() != 0 {
            return Err(format!(
                "--lease-duration ({lease_duration:?}) must be a whole number of seconds (the \
                 Lease records it in seconds)"
            ));
        }
        Ok(Timings {
            lease_duration,
            renew_deadline,
            retry_period,
        })
    }
}
