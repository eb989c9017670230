//! HTTP endpoints: `/healthz` (the runtime answers), `/readyz` (caches synced; never "is
//! leader", so followers are ready too), and `/metrics` (Prometheus text, or OpenMetrics
//! when the scraper asks for it), over TLS and for authorised scrapers only when
//! [`Secure`] (the health endpoints stay plain and open: they say ok or not ok, nothing
//! more).
//!
//! The servers are bounded: a failed `accept` (out of file descriptors, say) pauses the
//! accept loop with a doubling backoff instead of retrying at once, and is logged at a
//! bounded rate; each connection must send its request headers within
//! [`Limits::header_read`] and lives at most [`Limits::connection`] (keep-alive included);
//! at most [`Limits::max_connections`] are served at once and further ones are closed.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use crate::infra::access::{Authoriser, Verdict};

/// A secured endpoint: TLS, and the cluster's review of every request ([`Authoriser`]).
#[derive(Clone)]
pub struct Secure {
    /// The TLS handshake.
    pub tls: TlsAcceptor,
    /// Who may read.
    pub access: Arc<Authoriser>,
}

/// Answers one request: its path and its Accept header.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, path: &str, accept: &str) -> (StatusCode, &'static str, String);
}

/// How much an endpoint server gives its clients.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest wait for a request's headers, also between requests on a kept-alive
    /// connection.
    pub header_read: Duration,
    /// Longest life of a connection; then it is shut down gracefully (a request in flight
    /// is answered first, within `header_read`).
    pub connection: Duration,
    /// Connections served at once; a further one is closed as soon as it is accepted.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read: Duration::from_secs(10),
            connection: Duration::from_secs(30),
            max_connections: 64,
        }
    }
}

/// Binds `addr` and serves `handler` with the default [`Limits`] until the process ends;
/// returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    name: &'static str,
    handler: Arc<dyn Handler>,
) -> Result<SocketAddr> {
    serve_with(addr, name, handler, None, Limits::default()).await
}

/// [`serve`] with explicit limits, secured by `secure` if given.
pub async fn serve_with(
    addr: SocketAddr,
    name: &'static str,
    handler: Arc<dyn Handler>,
    secure: Option<Secure>,
    limits: Limits,
) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the {name} address {addr}"))?;
    let bound = listener.local_addr()?;
    let secured = if secure.is_some() {
        "https, authorised scrapers only"
    } else {
        "http"
    };
    info!(%bound, "{name} endpoint listening ({secured})");
    tokio::spawn(accept_loop(listener, name, handler, secure, limits));
    Ok(bound)
}

async fn accept_loop(
    listener: TcpListener,
    name: &'static str,
    handler: Arc<dyn Handler>,
    secure: Option<Secure>,
    limits: Limits,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut failures = AcceptFailures::default();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                let (pause, log) = failures.failed();
                if log {
                    warn!(
                        error = %err,
                        failures = failures.consecutive,
                        ?pause,
                        "{name} endpoint: accepting a connection failed"
                    );
                }
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        if let Some(ended) = failures.succeeded() {
            info!(
                failures = ended,
                "{name} endpoint: accepting connections again"
            );
        }
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!(
                max = limits.max_connections,
                "{name} endpoint: too many connections, closing a new one"
            );
            continue;
        };
        let handler = handler.clone();
        let secure = secure.clone();
        tokio::spawn(async move {
            match secure {
                None => serve_connection(stream, handler, None, limits).await,
                Some(Secure { tls, access }) => {
                    // The handshake must finish as soon as a request's headers must.
                    match tokio::time::timeout(limits.header_read, tls.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            serve_connection(stream, handler, Some(access), limits).await
                        }
                        Ok(Err(err)) => {
                            debug!(error = %err, "{name} endpoint: TLS handshake failed")
                        }
                        Err(_) => debug!("{name} endpoint: TLS handshake timed out"),
                    }
                }
            }
            drop(slot);
        });
    }
}

/// A response with a status, a content type and a body.
fn response(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut builder = Response::builder()
        .status(status)
        .header("content-type", content_type);
    if status == StatusCode::UNAUTHORIZED {
        builder = builder.header(hyper::header::WWW_AUTHENTICATE, "Bearer");
    }
    builder
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

/// What a refused request is told.
fn refusal(verdict: Verdict) -> &'static str {
    match verdict {
        Verdict::Allowed => "",
        Verdict::Unauthenticated => "unauthorized: send a bearer token the cluster authenticates",
        Verdict::Forbidden => "forbidden: the token's user may not get this path",
        Verdict::Unavailable => "the API server could not review the token; try again",
    }
}

async fn serve_connection<S>(
    stream: S,
    handler: Arc<dyn Handler>,
    access: Option<Arc<Authoriser>>,
    limits: Limits,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req: Request<Incoming>| {
        let header = |name| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let accept = header(hyper::header::ACCEPT).unwrap_or_default();
        let authorization = header(hyper::header::AUTHORIZATION);
        let path = req.uri().path().to_string();
        let (handler, access) = (handler.clone(), access.clone());
        async move {
            if let Some(access) = access {
                let verdict = access.verdict(authorization.as_deref()).await;
                if verdict != Verdict::Allowed {
                    let body = refusal(verdict).to_string();
                    return Ok::<_, Infallible>(response(verdict.status(), "text/plain", body));
                }
            }
            let (status, content_type, body) = handler.handle(&path, &accept);
            Ok(response(status, content_type, body))
        }
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        _ = tokio::time::sleep(limits.connection) => {
            connection.as_mut().graceful_shutdown();
            match tokio::time::timeout(limits.header_read, connection.as_mut()).await {
                Ok(result) => result,
                Err(_) => return,
            }
        }
    };
    if let Err(err) = result {
        debug!(error = %err, "endpoint connection ended with an error");
    }
}

/// A run of consecutive `accept` failures: how long to pause before the next attempt, and
/// which failures to log. Pure, so the pacing is tested without sockets.
#[derive(Debug, Default)]
struct AcceptFailures {
    consecutive: u32,
}

impl AcceptFailures {
    const FIRST_PAUSE: Duration = Duration::from_millis(100);
    const MAX_PAUSE: Duration = Duration::from_secs(1);
    /// Once the pause is at its cap, one line per this many failures (about 10 s).
    const LOG_EVERY: u32 = 10;

    /// Records a failure: the pause before the next accept (100 ms, doubling to 1 s) and
    /// whether to log it (the first of a run, then every [`Self::LOG_EVERY`]th).
    fn failed(&mut self) -> (Duration, bool) {
        self.consecutive = self.consecutive.saturating_add(1);
        let doublings = (self.consecutive - 1).min(16);
        let pause = (Self::FIRST_PAUSE * 2u32.pow(doublings)).min(Self::MAX_PAUSE);
        let log = self.consecutive == 1 || self.consecutive.is_multiple_of(Self::LOG_EVERY);
        (pause, log)
    }

    /// Records a success; returns the length of the run of failures it ends, if any.
    fn succeeded(&mut self) -> Option<u32> {
        Some(std::mem::take(&mut self.consecutive)).filter(|n| *n > 0)
    }
}

/// `/healthz` and `/readyz`.
pub struct Health<F: Fn() -> bool + Send + Sync + 'static> {
    pub ready: F,
}

impl<F: Fn() -> bool + Send + Sync + 'static> Handler for Health<F> {
    fn handle(&self, path: &str, _accept: &str) -> (StatusCode, &'static str, String) {
        match path {
            "/healthz" | "/livez" => (StatusCode::OK, "text/plain", "ok".into()),
            "/readyz" if (self.ready)() => (StatusCode::OK, "text/plain", "ok".into()),
            "/readyz" => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                "caches not synced".into(),
            ),
            _ => (StatusCode::NOT_FOUND, "text/plain", "not found".into()),
        }
    }
}

/// `/metrics`.
pub struct Metrics(pub Arc<crate::infra::metrics::Metrics>);

impl Handler for Metrics {
    fn handle(&self, path: &str, accept: &str) -> (StatusCode, &'static str, String) {
        if path != "/metrics" {
            return (StatusCode::NOT_FOUND, "text/plain", "not found".into());
        }
        let openmetrics = accept.contains("application/openmetrics-text");
        let body = self.0.encode(openmetrics);
        let content_type = if openmetrics {
            "application/openmetrics-text; version=1.0.0; charset=utf-8"
        } else {
            "text/plain; version=0.0.4; charset=utf-8"
        };
        (StatusCode::OK, content_type, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    #[test]
    fn accept_failures_pause_with_a_doubling_backoff_and_log_at_a_bounded_rate() {
        let mut failures = AcceptFailures::default();
        let ms = Duration::from_millis;
        let run: Vec<(Duration, bool)> = (0..30).map(|_| failures.failed()).collect();
        let pauses: Vec<Duration> = run.iter().map(|(p, _)| *p).collect();
        assert_eq!(
            pauses[..6],
            [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]
        );
        assert!(pauses[4..].iter().all(|p| *p == ms(1000)));
        // 30 failures in a row (about 26 s of pauses): 4 log lines, not 30.
        let logged: Vec<usize> = (0..30).filter(|i| run[*i].1).map(|i| i + 1).collect();
        assert_eq!(logged, [1, 10, 20, 30]);
        // A success ends the run: the next failure pauses briefly and is logged again.
        assert_eq!(failures.succeeded(), Some(30));
        assert_eq!(failures.succeeded(), None);
        assert_eq!(failures.failed(), (ms(100), true));
        // No overflow however long the run.
        failures.consecutive = u32::MAX - 1;
        assert_eq!(failures.failed().0, ms(1000));
        assert_eq!(failures.failed().0, ms(1000));
    }

    struct Ok200;

    impl Handler for Ok200 {
        fn handle(&self, _path: &str, _accept: &str) -> (StatusCode, &'static str, String) {
            (StatusCode::OK, "text/plain", "ok".into())
        }
    }

    async fn server(limits: Limits) -> SocketAddr {
        serve_with(
            "127.0.0.1:0".parse().unwrap(),
            "test",
            Arc::new(Ok200),
            None,
            limits,
        )
        .await
        .unwrap()
    }

    /// Reads until the server closes the connection; returns what it sent and when it
    /// closed (relative to `since`). Fails the test if it is still open after `limit`.
    async fn until_closed(
        stream: &mut TcpStream,
        since: Instant,
        limit: Duration,
    ) -> (String, Duration) {
        let mut received = Vec::new();
        tokio::time::timeout(limit, stream.read_to_end(&mut received))
            .await
            .expect("the server closes the connection")
            .expect("reading");
        (
            String::from_utf8_lossy(&received).into_owned(),
            since.elapsed(),
        )
    }

    #[tokio::test]
    async fn silent_and_idle_connections_are_closed() {
        let limits = Limits {
            header_read: Duration::from_millis(200),
            connection: Duration::from_millis(600),
            max_connections: 8,
        };
        let addr = server(limits).await;

        // Connects and never sends a request: closed after the header-read timeout.
        let start = Instant::now();
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let (sent, after) = until_closed(&mut silent, start, Duration::from_secs(5)).await;
        assert!(after >= limits.header_read, "closed after {after:?}");
        assert!(!sent.contains("200 OK"), "{sent}");

        // One request on a kept-alive connection, then idle: answered, then closed.
        let start = Instant::now();
        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
            .await
            .unwrap();
        let (sent, after) = until_closed(&mut idle, start, Duration::from_secs(5)).await;
        assert!(sent.starts_with("HTTP/1.1 200 OK"), "{sent}");
        assert!(
            after <= limits.connection + Duration::from_secs(1),
            "closed after {after:?}"
        );

        // A client that keeps sending requests is still cut at the connection's lifetime.
        let start = Instant::now();
        let mut busy = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 4096];
        let closed = loop {
            if busy
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
                .await
                .is_err()
            {
                break start.elapsed();
            }
            match tokio::time::timeout(Duration::from_secs(5), busy.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break start.elapsed(),
                Ok(Ok(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(_) => panic!("no answer within 5 s"),
            }
        };
        assert!(closed >= limits.connection, "closed after {closed:?}");
        assert!(closed < Duration::from_secs(5), "closed after {closed:?}");
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_are_closed_at_once() {
        let limits = Limits {
            header_read: Duration::from_secs(30),
            connection: Duration::from_secs(30),
            max_connections: 2,
        };
        let addr = server(limits).await;
        let held = [
            TcpStream::connect(addr).await.unwrap(),
            TcpStream::connect(addr).await.unwrap(),
        ];
        let start = Instant::now();
        let mut extra = TcpStream::connect(addr).await.unwrap();
        let (sent, _) = until_closed(&mut extra, start, Duration::from_secs(5)).await;
        assert_eq!(sent, "");
        // Once a slot is free again, connections are served.
        drop(held);
        let answered = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let mut stream = TcpStream::connect(addr).await.unwrap();
                stream
                    .write_all(b"GET /healthz HTTP/1.0\r\n\r\n")
                    .await
                    .unwrap();
                let mut response = String::new();
                let _ = stream.read_to_string(&mut response).await;
                if response.contains(" 200 OK") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(
            answered.is_ok(),
            "no answer after the held connections closed"
        );
    }
}
