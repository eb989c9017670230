//! Fencing: the proof of leadership that every write checks, and the deadline it carries.
//!
//! The leadership lifecycle ([`crate::leadership`]) extends the fence after each successful
//! renew to `start of that renew + renew deadline` (on the monotonic clock) and revokes it
//! when it steps down. A replica that is frozen or cut off therefore stops writing at the
//! latest one renew deadline after its last successful renew, which is before any other
//! replica can observe the Lease as expired (lease duration > renew deadline).
//!
//! A check before sending is not enough: a request can sit in a slow or overloaded API
//! server, or in a client's retry loop, and be applied later. So the reconcile client's
//! [`crate::kubeclient`] layer asks the fence for a [`Deadline`] for every write: the write
//! is refused when the fence is closed, gives up on the client side at the fence's expiry,
//! and carries the remaining time as the API server's `timeout` parameter, so the server
//! does not apply it after that either (its deadline counts from when it received the
//! request, so it ends at most one network transit after the fence: far inside the margin
//! `lease duration - renew deadline` that followers wait beyond the fence).

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

/// Shared between the leadership lifecycle (which extends and revokes it), the reconcilers
/// and the reconcile client's write layer. Closed until the first term begins.
#[derive(Debug, Clone, Default)]
pub struct Fence(Arc<Mutex<Option<Instant>>>);

/// How long a write that starts now may take: until the fence's expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    pub at: Instant,
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
        *self.0.lock().expect("fence lock") = Some(until);
    }

    /// Blocks writes from now on.
    pub fn revoke(&self) {
        *self.0.lock().expect("fence lock") = None;
    }

    /// The deadline of a write that starts at `now`, or [`NotLeader`] when the fence is
    /// closed or would close within [`MIN_WRITE_TIME`].
    pub fn deadline_at(&self, now: Instant) -> Result<Deadline, NotLeader> {
        match *self.0.lock().expect("fence lock") {
            Some(until) if until.saturating_duration_since(now) >= MIN_WRITE_TIME => Ok(Deadline {
                at: until,
                remaining: until - now,
            }),
            _ => Err(NotLeader),
        }
    }

    /// Whether a write may start now.
    pub fn check(&self) -> Result<(), NotLeader> {
        self.deadline_at(Instant::now()).map(|_| ())
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
        let d = fence.deadline_at(t + Duration::from_secs(9)).unwrap();
        assert_eq!(d.remaining, Duration::from_secs(1));
        assert_eq!(d.timeout_param(), "1000ms");
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
