//! Who may read `/metrics`: the cluster's own authentication and authorisation, as
//! controller-runtime's `WithAuthenticationAndAuthorization` filter and kube-rbac-proxy
//! do. A scrape's bearer token is reviewed by the API server (a `TokenReview`), and the
//! user it names must be allowed `get` on the non-resource URL `/metrics` (a
//! `SubjectAccessReview`: the `metrics-reader` ClusterRole grants it).
//!
//! Invariants:
//! - nothing gets through without both reviews saying yes: a missing or malformed header
//!   is 401; a token the API server does not authenticate, 401; an authenticated user
//!   without the permission, 403; a review that fails or takes longer than
//!   [`REVIEW_TIMEOUT`] (an outage), 503, never a pass;
//! - verdicts are cached by the token's SHA-256 (never the token itself): an allowed one
//!   for [`ALLOWED_FOR`], a refused one for [`REFUSED_FOR`], a failed review not at all,
//!   so a scrape every few seconds costs the API server two requests a minute per
//!   scraper, and a revoked permission or token stops working within a minute;
//! - the cache holds at most [`MAX_ENTRIES`] verdicts (expired ones go first, then the
//!   oldest), so a flood of random tokens costs memory in bounds (and one review each).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::{Api, Client};
use tracing::warn;

/// How long an allowed verdict is reused.
pub const ALLOWED_FOR: Duration = Duration::from_secs(60);
/// How long a refused verdict (401, 403) is reused.
pub const REFUSED_FOR: Duration = Duration::from_secs(10);
/// The longest a review may take before the scrape is answered 503.
pub const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);
/// The most verdicts kept.
pub const MAX_ENTRIES: usize = 1024;

/// What a scrape gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Both reviews said yes: 200.
    Allowed,
    /// No token, or one the API server does not authenticate: 401.
    Unauthenticated,
    /// An authenticated user without `get` on the path: 403.
    Forbidden,
    /// A review failed or timed out: 503, and nothing is cached.
    Unavailable,
}

impl Verdict {
    /// The HTTP status a scrape with this verdict is answered with.
    pub fn status(self) -> hyper::StatusCode {
        match self {
            Verdict::Allowed => hyper::StatusCode::OK,
            Verdict::Unauthenticated => hyper::StatusCode::UNAUTHORIZED,
            Verdict::Forbidden => hyper::StatusCode::FORBIDDEN,
            Verdict::Unavailable => hyper::StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// The token of an `Authorization: Bearer …` header, if that is what it is.
pub fn bearer(header: Option<&str>) -> Option<&str> {
    let (scheme, token) = header?.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Verdicts by token digest, with their expiry (pure: fed the monotonic time).
#[derive(Debug, Default)]
struct Verdicts {
    entries: HashMap<[u8; 32], (Verdict, Instant, Instant)>,
}

impl Verdicts {
    /// The cached verdict for `digest` at `now`, if one is still good.
    fn get(&self, digest: &[u8; 32], now: Instant) -> Option<Verdict> {
        let (verdict, _, expires) = self.entries.get(digest)?;
        (now < *expires).then_some(*verdict)
    }

    /// Keeps `verdict` for `digest` from `now` (a failed review is not kept).
    fn put(&mut self, digest: [u8; 32], verdict: Verdict, now: Instant) {
        let keep = match verdict {
            Verdict::Allowed => ALLOWED_FOR,
            Verdict::Unauthenticated | Verdict::Forbidden => REFUSED_FOR,
            Verdict::Unavailable => return,
        };
        if self.entries.len() >= MAX_ENTRIES && !self.entries.contains_key(&digest) {
            self.entries.retain(|_, (_, _, expires)| now < *expires);
            if self.entries.len() >= MAX_ENTRIES
                && let Some(oldest) = self
                    .entries
                    .iter()
                    .min_by_key(|(_, (_, stored, _))| *stored)
                    .map(|(digest, _)| *digest)
            {
                self.entries.remove(&oldest);
            }
        }
        self.entries.insert(digest, (verdict, now, now + keep));
    }
}

/// Reviews scrapes of one path against the cluster.
pub struct Authoriser {
    client: Client,
    path: &'static str,
    verdicts: Mutex<Verdicts>,
}

impl Authoriser {
    /// Reviews with `client` (never fenced: followers serve metrics too) whether a
    /// scrape may `get` `path`.
    pub fn new(client: Client, path: &'static str) -> Authoriser {
        Authoriser {
            client,
            path,
            verdicts: Mutex::default(),
        }
    }

    /// The verdict for a scrape whose `Authorization` header is `header`.
    pub async fn verdict(&self, header: Option<&str>) -> Verdict {
        let Some(token) = bearer(header) else {
            return Verdict::Unauthenticated;
        };
        let digest: [u8; 32] = ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
            .as_ref()
            .try_into()
            .expect("SHA-256 is 32 bytes");
        if let Some(verdict) = self.lock().get(&digest, Instant::now()) {
            return verdict;
        }
        let verdict = match tokio::time::timeout(REVIEW_TIMEOUT, self.review(token)).await {
            Ok(Ok(verdict)) => verdict,
            Ok(Err(err)) => {
                warn!(error = %err, "reviewing a metrics scrape's token failed; answering 503");
                Verdict::Unavailable
            }
            Err(_) => {
                warn!(timeout = ?REVIEW_TIMEOUT, "reviewing a metrics scrape's token timed out; answering 503");
                Verdict::Unavailable
            }
        };
        self.lock().put(digest, verdict, Instant::now());
        verdict
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Verdicts> {
        self.verdicts.lock().expect("verdicts lock")
    }

    /// A TokenReview, then a SubjectAccessReview for the user it names.
    async fn review(&self, token: &str) -> kube::Result<Verdict> {
        let params = PostParams::default();
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.into()),
                audiences: None,
            },
            ..Default::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone())
            .create(&params, &review)
            .await?;
        let Some(user) = reviewed
            .status
            .filter(|s| s.authenticated == Some(true))
            .and_then(|s| s.user)
        else {
            return Ok(Verdict::Unauthenticated);
        };
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(self.path.into()),
                    verb: Some("get".into()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let decided = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&params, &access)
            .await?;
        Ok(if decided.status.is_some_and(|s| s.allowed) {
            Verdict::Allowed
        } else {
            Verdict::Forbidden
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn only_a_bearer_token_is_a_token() {
        assert_eq!(bearer(Some("Bearer abc")), Some("abc"));
        assert_eq!(bearer(Some("bearer  abc ")), Some("abc"));
        assert_eq!(bearer(Some("Basic abc")), None);
        assert_eq!(bearer(Some("Bearer ")), None);
        assert_eq!(bearer(Some("Bearer")), None);
        assert_eq!(bearer(None), None);
    }

    #[test]
    fn verdicts_are_kept_for_their_time_and_failures_not_at_all() {
        let t = Instant::now();
        let mut verdicts = Verdicts::default();
        verdicts.put([1; 32], Verdict::Allowed, t);
        verdicts.put([2; 32], Verdict::Forbidden, t);
        verdicts.put([3; 32], Verdict::Unavailable, t);
        let later = |d: Duration| t + d;
        assert_eq!(
            verdicts.get(&[1; 32], later(ALLOWED_FOR - Duration::from_millis(1))),
            Some(Verdict::Allowed)
        );
        assert_eq!(verdicts.get(&[1; 32], later(ALLOWED_FOR)), None);
        assert_eq!(
            verdicts.get(&[2; 32], later(REFUSED_FOR - Duration::from_millis(1))),
            Some(Verdict::Forbidden)
        );
        assert_eq!(verdicts.get(&[2; 32], later(REFUSED_FOR)), None);
        assert_eq!(
            verdicts.get(&[3; 32], t),
            None,
            "a failed review is asked again"
        );
    }

    /// An Authoriser whose API server never answers (`hang`) or answers 500; and how
    /// many requests reached it.
    fn against(hang: bool) -> (Authoriser, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let server = tower::service_fn(move |_: http::Request<kube::client::Body>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if hang {
                    std::future::pending::<()>().await;
                }
                http::Response::builder()
                    .status(500)
                    .body(http_body_util::Full::new(hyper::body::Bytes::new()))
                    .map_err(|e| -> tower::BoxError { e.into() })
            }
        });
        (
            Authoriser::new(Client::new(server, "default"), "/metrics"),
            calls,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_review_that_hangs_or_fails_never_lets_a_scrape_through_nor_is_kept() {
        for hang in [true, false] {
            let (authoriser, calls) = against(hang);
            for _ in 0..2 {
                assert_eq!(
                    authoriser.verdict(Some("Bearer t")).await,
                    Verdict::Unavailable,
                    "hang: {hang}"
                );
            }
            assert_eq!(calls.load(Ordering::SeqCst), 2, "asked again each time");
            assert_eq!(
                authoriser.verdict(None).await,
                Verdict::Unauthenticated,
                "no token: no review at all"
            );
            assert_eq!(calls.load(Ordering::SeqCst), 2);
        }
    }

    #[test]
    fn the_cache_stays_within_bounds_dropping_expired_then_oldest() {
        let t = Instant::now();
        let mut verdicts = Verdicts::default();
        let digest = |i: usize| {
            let mut d = [0u8; 32];
            d[..8].copy_from_slice(&(i as u64).to_le_bytes());
            d
        };
        for i in 0..MAX_ENTRIES {
            verdicts.put(
                digest(i),
                Verdict::Allowed,
                t + Duration::from_millis(i as u64),
            );
        }
        verdicts.put(
            digest(MAX_ENTRIES),
            Verdict::Allowed,
            t + Duration::from_secs(1),
        );
        assert_eq!(verdicts.entries.len(), MAX_ENTRIES);
        assert_eq!(verdicts.get(&digest(0), t), None, "the oldest went");
        // Once the first ones expired, a new verdict takes an expired one's place.
        let late = t + ALLOWED_FOR + Duration::from_millis(500);
        verdicts.put(digest(MAX_ENTRIES + 1), Verdict::Forbidden, late);
        assert!(
            verdicts.entries.len() < MAX_ENTRIES,
            "expired ones dropped first"
        );
        assert_eq!(
            verdicts.get(&digest(MAX_ENTRIES + 1), late),
            Some(Verdict::Forbidden)
        );
    }
}
