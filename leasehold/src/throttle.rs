//! Bounded-rate logging of a failure that repeats.
//!
//! During an API server outage every election attempt and every watch retry fails; logging
//! each one turned a control-plane outage into gigabytes of log per replica. A [`Throttle`]
//! admits the first failure of a run, then at most one per `every` (its period) carrying the
//! number suppressed since, and reports the end of the run once, with its length.
//!
//! Pure (the caller passes the monotonic time), so it is tested with a fake clock.

use std::time::{Duration, Instant};

/// What the caller should log for a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; `suppressed` failures were not logged since the last one that was.
    Log { suppressed: u64 },
    /// Say nothing.
    Quiet,
}

/// See the module doc.
#[derive(Debug, Clone)]
pub struct Throttle {
    every: Duration,
    /// When the next failure may be logged, while a run of failures lasts.
    next: Option<Instant>,
    suppressed: u64,
    failures: u64,
}

impl Throttle {
    pub fn new(every: Duration) -> Self {
        Throttle {
            every,
            next: None,
            suppressed: 0,
            failures: 0,
        }
    }

    /// Records a failure at `now`.
    pub fn failed(&mut self, now: Instant) -> Verdict {
        self.failures += 1;
        match self.next {
            Some(next) if now < next => {
                self.suppressed += 1;
                Verdict::Quiet
            }
            _ => {
                self.next = Some(now + self.every);
                Verdict::Log {
                    suppressed: std::mem::take(&mut self.suppressed),
                }
            }
        }
    }

    /// Records a success; returns the length of the run of failures it ends, if any.
    pub fn succeeded(&mut self) -> Option<u64> {
        self.next = None;
        self.suppressed = 0;
        Some(std::mem::take(&mut self.failures)).filter(|n| *n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_failures_is_logged_at_a_bounded_rate_with_counts() {
        let t = Instant::now();
        let mut throttle = Throttle::new(Duration::from_secs(10));
        assert_eq!(throttle.failed(t), Verdict::Log { suppressed: 0 });
        // A tight loop of failures: one line per 10 s whatever the rate.
        let mut logged = 0;
        for ms in 1..30_000u64 {
            if let Verdict::Log { suppressed } = throttle.failed(t + Duration::from_millis(ms)) {
                logged += 1;
                assert_eq!(suppressed, 9_999);
            }
        }
        assert_eq!(logged, 2);
        assert_eq!(throttle.succeeded(), Some(30_000));
        assert_eq!(throttle.succeeded(), None, "the run was reported once");
        // A new run starts loud again.
        assert_eq!(
            throttle.failed(t + Duration::from_secs(31)),
            Verdict::Log { suppressed: 0 }
        );
    }
}
