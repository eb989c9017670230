//! A watch's failures retried: kube's exponential backoff (0.8 s to 30 s), cut short and
//! started over by the API server's return ([`Reachability`]), with failures logged at a
//! bounded rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, DefaultBackoff, Event};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::throttle::{Throttle, Verdict};

/// The returns of the API server: a counter that goes up whenever a request succeeds after
/// one failed (transport error, 5xx or 429). Shared by every client of the process.
#[derive(Debug, Clone)]
pub struct Reachability {
    down: Arc<AtomicBool>,
    returns: Arc<watch::Sender<u64>>,
}

impl Default for Reachability {
    fn default() -> Self {
        Reachability {
            down: Arc::default(),
            returns: Arc::new(watch::channel(0).0),
        }
    }
}

impl Reachability {
    /// A receiver that sees every later return of the API server.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.returns.subscribe()
    }

    /// Records the outcome of one request (`None`: no response at all).
    pub fn record(&self, status: Option<u16>) {
        let failed = status.is_none_or(|s| s >= 500 || s == 429);
        if failed {
            self.down.store(true, Ordering::SeqCst);
        } else if self.down.swap(false, Ordering::SeqCst) {
            self.returns.send_modify(|n| *n += 1);
        }
    }
}

/// How often a watch that keeps failing is logged.
const LOG_EVERY: Duration = Duration::from_secs(30);
/// The soonest a failed watch is retried, return or not (kube's first backoff step): a
/// flow the API server throttles (429) while the process's other requests succeed sees a
/// "return" after every failure, and would otherwise retry at their pace.
const SOONEST_RETRY: Duration = Duration::from_millis(800);

/// A watcher's events with its failures retried: after a failure it waits kube's
/// exponential backoff or until the API server answers again (`returns` moves), whichever
/// comes first, but at least 0.8 s (kube's first step); a return also starts the backoff over.
/// Failures are logged at a bounded rate.
pub fn retried<K, S>(
    events: S,
    returns: watch::Receiver<u64>,
    kind: String,
) -> impl Stream<Item = Event<K>> + Send + 'static
where
    K: Send + 'static,
    S: Stream<Item = watcher::Result<Event<K>>> + Send + 'static,
{
    struct State<S> {
        events: std::pin::Pin<Box<S>>,
        backoff: DefaultBackoff,
        throttle: Throttle,
        returns: watch::Receiver<u64>,
        kind: String,
    }
    let state = State {
        events: Box::pin(events),
        backoff: DefaultBackoff::default(),
        throttle: Throttle::new(LOG_EVERY),
        returns,
        kind,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            let err = match st.events.next().await? {
                Ok(event) => {
                    st.backoff.reset();
                    if let Some(failures) = st.throttle.succeeded() {
                        info!(kind = %st.kind, failures, "watch works again");
                    }
                    return Some((event, st));
                }
                Err(err) => err,
            };
            if let Verdict::Log { suppressed } = st.throttle.failed(crate::clock::now()) {
                warn!(error = %err, kind = %st.kind, suppressed, "watch failed; retrying");
            }
            let failed_at = crate::clock::now();
            let delay = st.backoff.next().unwrap_or(Duration::from_secs(30));
            st.returns.borrow_and_update();
            let returned = async {
                if st.returns.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                biased;
                _ = tokio::time::sleep(delay) => {}
                _ = returned => {
                    // A server that has just come back may not serve everything yet (a
                    // CRD still being loaded answers 404): start the backoff over, so the
                    // next retries come soon too.
                    st.backoff.reset();
                    tokio::time::sleep_until((failed_at + SOONEST_RETRY).into()).await;
                    debug!(kind = %st.kind, "the API server answers again: retrying the watch now");
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    #[test]
    fn a_success_after_a_failure_counts_one_return() {
        let r = Reachability::default();
        let rx = r.subscribe();
        r.record(Some(200));
        assert_eq!(*rx.borrow(), 0, "no failure before: not a return");
        r.record(None);
        r.record(Some(503));
        r.record(Some(429));
        assert_eq!(*rx.borrow(), 0);
        r.record(Some(404));
        assert_eq!(*rx.borrow(), 1, "a 404 is an answer");
        r.record(Some(200));
        assert_eq!(*rx.borrow(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_return_cuts_the_backoff_short_but_never_below_the_first_step() {
        let reachability = Reachability::default();
        // Six failures: kube's backoff alone would wait 0.8 + 1.6 + … + 25.6 s at least.
        let mut results: Vec<_> = (0..6)
            .map(|_| Err(watcher::Error::NoResourceVersion))
            .collect();
        results.push(Ok(Event::<ConfigMap>::InitDone));
        let mut events = Box::pin(retried(
            futures::stream::iter(results),
            reachability.subscribe(),
            "ConfigMap".into(),
        ));
        let started = tokio::time::Instant::now();
        // The process's other requests fail and succeed every 100 ms (a throttled flow).
        let r = reachability.clone();
        tokio::spawn(async move {
            for _ in 0..600 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                r.record(Some(429));
                r.record(Some(200));
            }
        });
        assert!(matches!(events.next().await, Some(Event::InitDone)));
        let waited = started.elapsed();
        assert!(
            waited >= SOONEST_RETRY * 6 && waited < SOONEST_RETRY * 6 + Duration::from_millis(700),
            "each retry came {SOONEST_RETRY:?} after its failure, not at the returns' pace \
             nor after the backoff: {waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_return_a_failed_watch_waits_its_backoff() {
        let events = futures::stream::iter(vec![
            Err(watcher::Error::NoResourceVersion),
            Ok(Event::<ConfigMap>::InitDone),
        ]);
        let reachability = Reachability::default();
        let mut events = Box::pin(retried(
            events,
            reachability.subscribe(),
            "ConfigMap".into(),
        ));
        let started = tokio::time::Instant::now();
        assert!(matches!(events.next().await, Some(Event::InitDone)));
        assert!(started.elapsed() >= Duration::from_millis(500));
    }
}
