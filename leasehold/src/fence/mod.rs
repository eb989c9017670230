//! Fencing: the proof of leadership that every write checks, and the deadline it carries.
//!
//! The leadership lifecycle ([`crate::term`]) extends the fence after each successful
//! renew to `start of that renew + renew deadline` (on the monotonic clock) and revokes it
//! when it steps down. A replica that is frozen or cut off therefore stops writing at the
//! latest one renew deadline after its last successful renew, which is before any other
//! replica can observe the Lease as expired (lease duration > renew deadline).
//!
//! A check before sending is not enough: a request can sit in a slow or overloaded API
//! server, or in a client's retry loop, and be applied later. So the reconcile client's
//! fenced client ([`fenced_client`]) asks the fence for a [`Deadline`] for every write: the write
//! is refused when the fence is closed, gives up on the client side at the fence's expiry,
//! and carries the remaining time as the API server's `timeout` parameter, so the server
//! does not apply it after that either (its deadline counts from when it received the
//! request, so it ends at most one network transit after the fence: far inside the margin
//! `lease duration - renew deadline` that followers wait beyond the fence). The check at
//! the start of a write is repeated for every byte the write puts on its socket
//! ([`crate::fence::FencedIo`]), so a process paused between the two sends nothing
//! when it wakes after the fence closed.
//!
//! A takeover that does not wait for the Lease to expire (a graceful release, a hand-off)
//! has no such margin, so the fence also tracks the writes it let through ([`Write`]): a
//! write answered 2xx or 4xx is settled; one answered 5xx, or dropped before its answer,
//! may still be applied by the server until its deadline. [`Fence::settled`] tells when
//! every write this fence let through is settled, and a release waits for that
//! ([`crate::election`]), so no write of a released term takes effect after the release.

mod client;

pub use client::{
    FenceExpired, FenceLayer, FenceService, FencedIo, WriteService, fenced_client, is_fenced,
    write_service,
};

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Returned when this replica may not write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotLeader;

impl std::fmt::Display for NotLeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("this replica's leadership is not (or no longer) valid")
    }
}

impl std::error::Error for NotLeader {}

/// A write shorter than this is not worth sending: it could not finish in time.
pub const MIN_WRITE_TIME: Duration = Duration::from_millis(20);

/// The longest a write may take, client and server deadline alike, however long the fence
/// has left. It bounds how long after a process dies its writes can still take effect,
/// which a takeover on a crash proof waits out ([`crate::election`]): without it, a write
/// queued in the server just before the crash could be applied up to a renew deadline
/// later, in the next term. Reconcile writes take milliseconds; one that cannot finish in
/// this time fails and its reconcile is retried.
pub const MAX_WRITE_TIME: Duration = Duration::from_millis(500);

/// How long after a write's deadline the server may still commit it: the time its request
/// took to reach the server (its `timeout` counts from there) and etcd's commit of a
/// transaction sent just before the server gave up.
pub const SETTLE_MARGIN: Duration = Duration::from_millis(100);

/// Shared between the leadership lifecycle (which extends and revokes it), the reconcilers
/// and the reconcile client's write layer. Closed until the first term begins.
#[derive(Debug, Clone, Default)]
pub struct Fence(Arc<Mutex<State>>);

#[derive(Debug, Default)]
struct State {
    /// Writes may start until then; `None` when closed.
    until: Option<Instant>,
    /// Writes sent and not yet answered.
    in_flight: usize,
    /// The latest deadline of a write that was answered 5xx or dropped unanswered: the
    /// server may apply it until then.
    unsettled_until: Option<Instant>,
}

/// When every write a fence let through is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Writes are still waiting for their answers.
    Pending,
    /// From this instant on (it may be past): no write can take effect any more.
    At(Instant),
    /// Every write was answered without a doubt.
    Done,
}

/// A write the fence let through, until its answer. Dropped without [`Write::answered`]
/// (the request failed on the way, or its caller gave up), it counts as maybe applied
/// until its deadline.
#[derive(Debug)]
pub struct Write {
    fence: Fence,
    deadline: Deadline,
    /// Answered with a status that leaves no doubt (2xx or 4xx).
    settled: bool,
}

impl Write {
    /// The server answered with `status`: settled unless it is a 5xx (the server may
    /// still apply the write until its deadline).
    pub fn answered(mut self, status: u16) {
        self.settled = status < 500;
    }

    /// Until when this write may take effect.
    pub fn deadline(&self) -> Deadline {
        self.deadline
    }
}

impl Drop for Write {
    fn drop(&mut self) {
        let mut state = self.fence.0.lock().expect("fence lock");
        state.in_flight -= 1;
        if !self.settled {
            let until = self.deadline.at + SETTLE_MARGIN;
            state.unsettled_until = Some(state.unsettled_until.map_or(until, |u| u.max(until)));
        }
    }
}

/// How long a write that starts now may take: until the fence's expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    /// The fence's expiry.
    pub at: Instant,
    /// The time left until it, when asked.
    pub remaining: Duration,
}

impl Deadline {
    /// The API server's `timeout` query parameter for this deadline (whole milliseconds,
    /// rounded down, so the server's deadline is never later than ours).
    pub fn timeout_param(&self) -> String {
        format!("{}ms", self.remaining.as_millis())
    }
}

impl Fence {
    /// Allows writes until `until`.
    pub fn extend(&self, until: Instant) {
        self.0.lock().expect("fence lock").until = Some(until);
    }

    /// Blocks writes from now on.
    pub fn revoke(&self) {
        self.0.lock().expect("fence lock").until = None;
    }

    /// The deadline of a write that starts at `now` (the fence's expiry, at most
    /// [`MAX_WRITE_TIME`] away), or [`NotLeader`] when the fence is closed or would close
    /// within [`MIN_WRITE_TIME`].
    pub fn deadline_at(&self, now: Instant) -> Result<Deadline, NotLeader> {
        match self.0.lock().expect("fence lock").until {
            Some(until) if until.saturating_duration_since(now) >= MIN_WRITE_TIME => {
                let at = until.min(now + MAX_WRITE_TIME);
                Ok(Deadline {
                    at,
                    remaining: at - now,
                })
            }
            _ => Err(NotLeader),
        }
    }

    /// Lets a write start at `now` (see [`Fence::deadline_at`]) and tracks it until its
    /// answer.
    pub fn begin_write(&self, now: Instant) -> Result<Write, NotLeader> {
        let deadline = self.deadline_at(now)?;
        self.0.lock().expect("fence lock").in_flight += 1;
        Ok(Write {
            fence: self.clone(),
            deadline,
            settled: false,
        })
    }

    /// When every write this fence let through is settled.
    pub fn settled(&self) -> Settled {
        let state = self.0.lock().expect("fence lock");
        if state.in_flight > 0 {
            return Settled::Pending;
        }
        state.unsettled_until.map_or(Settled::Done, Settled::At)
    }

    /// Waits until every write this fence let through is settled; `false` when that has
    /// not happened by `limit`.
    pub async fn wait_settled(&self, limit: Instant) -> bool {
        loop {
            // tokio's clock (the real one, or a test's paused one).
            let now = crate::clock::now();
            let wake = match self.settled() {
                Settled::Done => return true,
                Settled::At(at) if at <= now => return true,
                Settled::At(at) => at,
                Settled::Pending => now + Duration::from_millis(5),
            };
            if wake > limit {
                return false;
            }
            tokio::time::sleep_until(wake.into()).await;
        }
    }

    /// Whether the fence is open at `now` (a write already let through may still send
    /// its bytes; see [`crate::fence::FencedIo`]).
    pub fn is_open(&self, now: Instant) -> bool {
        self.0
            .lock()
            .expect("fence lock")
            .until
            .is_some_and(|until| now < until)
    }

    /// Whether a write may start now.
    pub fn check(&self) -> Result<(), NotLeader> {
        self.deadline_at(crate::clock::now()).map(|_| ())
    }
}

/// Appends `timeout=<param>` to a request URI's query.
pub fn with_timeout(uri: &http::Uri, param: &str) -> http::Uri {
    let path = uri.path();
    let query = match uri.query() {
        Some(q) if !q.is_empty() => format!("{q}&timeout={param}"),
        _ => format!("timeout={param}"),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(
        format!("{path}?{query}")
            .parse()
            .expect("a valid path plus a valid query is a valid path and query"),
    );
    http::Uri::from_parts(parts).expect("only the path and query changed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_opens_until_its_deadline_and_closes_on_revoke() {
        let t = Instant::now();
        let fence = Fence::default();
        assert_eq!(fence.deadline_at(t), Err(NotLeader));
        fence.extend(t + Duration::from_secs(10));
        // However long the fence has left, a write gets at most MAX_WRITE_TIME.
        let d = fence.deadline_at(t).unwrap();
        assert_eq!((d.at, d.remaining), (t + MAX_WRITE_TIME, MAX_WRITE_TIME));
        assert_eq!(d.timeout_param(), "500ms");
        let d = fence.deadline_at(t + Duration::from_millis(9_700)).unwrap();
        assert_eq!(d.remaining, Duration::from_millis(300));
        assert_eq!(d.timeout_param(), "300ms");
        assert_eq!(
            fence.deadline_at(t + Duration::from_secs(10)),
            Err(NotLeader)
        );
        // Too little time left to finish a write: refused before it is sent.
        assert_eq!(
            fence.deadline_at(t + Duration::from_millis(9_990)),
            Err(NotLeader)
        );
        fence.revoke();
        assert_eq!(fence.deadline_at(t), Err(NotLeader));
    }

    #[test]
    fn writes_settle_when_answered_or_past_their_deadline() {
        let t = Instant::now();
        let fence = Fence::default();
        fence.extend(t + Duration::from_secs(10));
        assert_eq!(fence.settled(), Settled::Done);
        let ok = fence.begin_write(t).unwrap();
        let failed = fence.begin_write(t).unwrap();
        let dropped = fence.begin_write(t + Duration::from_secs(1)).unwrap();
        assert_eq!(fence.settled(), Settled::Pending);
        ok.answered(409);
        failed.answered(504);
        assert_eq!(fence.settled(), Settled::Pending, "one still in flight");
        drop(dropped);
        // The 5xx and the dropped one may be applied until their deadlines, the later wins.
        assert_eq!(
            fence.settled(),
            Settled::At(t + Duration::from_secs(1) + MAX_WRITE_TIME + SETTLE_MARGIN)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_for_settled_writes_is_bounded() {
        let t = tokio::time::Instant::now().into_std();
        let fence = Fence::default();
        fence.extend(t + Duration::from_secs(2));
        // Nothing sent: settled at once, whatever the limit.
        assert!(fence.wait_settled(t).await);
        drop(fence.begin_write(t).unwrap());
        assert!(!fence.wait_settled(t + Duration::from_millis(300)).await);
        assert!(fence.wait_settled(t + Duration::from_secs(3)).await);
        let now = tokio::time::Instant::now().into_std();
        assert!(now >= t + MAX_WRITE_TIME + SETTLE_MARGIN);
    }

    #[test]
    fn the_timeout_rounds_down() {
        let d = Deadline {
            at: Instant::now(),
            remaining: Duration::from_micros(1_999_999),
        };
        assert_eq!(d.timeout_param(), "1999ms");
    }

    #[test]
    fn timeout_is_appended_to_the_query() {
        let uri: http::Uri = "https://127.0.0.1:6443/api/v1/namespaces/a/configmaps?fieldManager=x"
            .parse()
            .unwrap();
        assert_eq!(
            with_timeout(&uri, "1500ms").to_string(),
            "https://127.0.0.1:6443/api/v1/namespaces/a/configmaps?fieldManager=x&timeout=1500ms"
        );
        let bare: http::Uri = "/api/v1/namespaces/a/configmaps".parse().unwrap();
        assert_eq!(
            with_timeout(&bare, "7ms").to_string(),
            "/api/v1/namespaces/a/configmaps?timeout=7ms"
        );
    }
}
