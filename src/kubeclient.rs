//! The Kubernetes clients: configuration, the user agent that names the replica, a tower
//! layer that traces and counts every API request, and the fence on every write.
//!
//! Invariants:
//! - neither client re-sends a request by itself (`default_retry` off): kube's retry layer
//!   would re-send a 429/503/504 with backoff up to minutes, honouring `Retry-After`, so a
//!   deposed leader's write could reach the server long after its fence closed. Reconciles
//!   are retried by their queue, election requests by the elector, watches by the caches.
//! - every write of the reconcile client (POST, PUT, PATCH, DELETE) passes [`FenceLayer`]:
//!   refused when the fence is closed, abandoned at the fence's expiry, and sent with the
//!   API server's `timeout` parameter set to the time left (see [`crate::fence`]). Writes
//!   travel on connections of their own whose sockets take bytes only while the fence is
//!   open ([`FencedIo`]): a write let through before the process was paused, or while it
//!   waited in hyper for a connection, is not sent once the fence has closed.
//! - [`Reachability`] counts the returns of the API server (a success after a failure), so
//!   the caches can retry their watches at once instead of at their backoff's cap.
//!
//! The request layer opens a `k8s.request` span per request (a child of the current span, so a
//! reconcile's requests nest under it), sends that span's W3C `traceparent` so the API
//! server's own spans join the trace (as children for callers in `system:masters` or
//! `system:monitoring`, as linked traces otherwise), records the status code, and counts
//! `rest_client_requests_total{code,method,host}` and their latency.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context as _, Result};
use http::{HeaderMap, Method, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kube::Client;
use kube::client::{Body, ConfigExt, DynBody};
use opentelemetry::propagation::Injector;
use tokio::sync::watch;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, Service, ServiceBuilder, ServiceExt};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::fence::{Fence, NotLeader, with_timeout};
use crate::metrics::Metrics;

/// A write abandoned at the fence's expiry (it may or may not have been applied before).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceExpired;

impl std::fmt::Display for FenceExpired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the write did not finish before this replica's fence expired")
    }
}

impl std::error::Error for FenceExpired {}

/// Whether a kube error is a write refused or abandoned by the fence.
pub fn is_fenced(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Service(e) if e.is::<NotLeader>() || e.is::<FenceExpired>())
}

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

/// The process's clients.
pub struct Clients {
    /// Caches and reconciles; every write is fenced.
    pub reconcile: Client,
    /// The Lease only; never fenced (it is what opens the fence).
    pub election: Client,
    pub reachability: Reachability,
    config: kube::Config,
    layer: ApiRequestLayer,
}

impl Clients {
    /// Another reconcile client whose writes pass `fence` (a scale-out replica has one per
    /// shard: each shard's writes are fenced by that shard's Lease).
    pub fn fenced(&self, fence: Fence) -> Result<Client> {
        fenced_client(&self.config, fence, &self.layer)
    }
}

/// Builds both clients from one configuration.
pub fn clients(mut config: kube::Config, fence: Fence, metrics: Arc<Metrics>) -> Result<Clients> {
    config.default_retry = false;
    let reachability = Reachability::default();
    let layer = ApiRequestLayer {
        host: host_of(&config),
        reachability: reachability.clone(),
        metrics,
    };
    let election = kube::client::ClientBuilder::try_from(config.clone())?
        .with_layer(&layer)
        .build();
    let reconcile = fenced_client(&config, fence, &layer)?;
    Ok(Clients {
        reconcile,
        election,
        reachability,
        config,
        layer,
    })
}

/// A reconcile client: reads through kube's usual stack, writes fenced by `fence`.
fn fenced_client(config: &kube::Config, fence: Fence, layer: &ApiRequestLayer) -> Result<Client> {
    let writes = write_service(config, &fence, layer)?;
    Ok(kube::client::ClientBuilder::try_from(config.clone())?
        .with_layer(layer)
        .with_layer(&FenceLayer { fence, writes })
        .build())
}

/// Percent-encodes a query parameter's value.
pub fn encode_query_value(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `client`, with `name=value` added to the query of every GET (lists and watches): how a
/// watch passes a parameter kube's `watcher::Config` does not know, such as
/// `shardSelector`.
pub fn with_query(client: &Client, name: &str, value: &str) -> Client {
    let base = client.clone();
    let param = format!("{name}={}", encode_query_value(value));
    let service = tower::service_fn(move |mut request: Request<kube::client::Body>| {
        if request.method() == Method::GET {
            let uri = request.uri();
            let query = match uri.query() {
                Some(q) if !q.is_empty() => format!("{q}&{param}"),
                _ => param.clone(),
            };
            let mut parts = uri.clone().into_parts();
            parts.path_and_query = format!("{}?{query}", uri.path()).parse().ok();
            if let Ok(uri) = http::Uri::from_parts(parts) {
                *request.uri_mut() = uri;
            }
        }
        let base = base.clone();
        async move { base.send(request).await }
    });
    Client::new(service, client.default_namespace())
}

/// Whether the API server filters lists by `shardSelector` (KEP-5866, feature gate
/// `ShardedListAndWatch`): a server that does echoes the selector in the list's
/// `metadata.shardInfo`; one that does not ignores the parameter.
pub async fn serves_shard_selector(client: &Client, path: &str, selector: &str) -> Result<bool> {
    let uri = format!(
        "{path}?limit=1&shardSelector={}",
        encode_query_value(selector)
    );
    let request = Request::get(uri).body(Vec::new())?;
    let text = client
        .request_text(request)
        .await
        .context("probing the API server for shardSelector")?;
    let list: serde_json::Value = serde_json::from_str(&text).context("a list response")?;
    Ok(list["metadata"]["shardInfo"]["selector"].is_string())
}

/// Reads the kubeconfig (the flag, else the usual inference) and sets the user agent
/// `myresource-operator/VERSION (IDENTITY)`, which the audit log records.
pub async fn config(kubeconfig: Option<&Path>, identity: &str) -> Result<kube::Config> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await.context(
            "no Kubernetes configuration (--kubeconfig, KUBECONFIG, ~/.kube/config or in-cluster)",
        )?,
    };
    let user_agent = format!(
        "myresource-operator/{} ({identity})",
        env!("CARGO_PKG_VERSION")
    );
    config.headers.push((
        http::header::USER_AGENT,
        user_agent
            .parse()
            .context("the identity is not a valid HTTP header value")?,
    ));
    Ok(config)
}

fn host_of(config: &kube::Config) -> String {
    let host = config.cluster_url.host().unwrap_or_default().to_string();
    let port = config
        .cluster_url
        .port_u16()
        .map(|p| format!(":{p}"))
        .unwrap_or_default();
    format!("{host}{port}")
}

/// See the module doc: writes go to `writes` (in production [`WriteService`], connections
/// of their own on which bytes pass only while the fence is open), reads to the inner
/// stack.
#[derive(Debug, Clone)]
pub struct FenceLayer<W> {
    fence: Fence,
    writes: W,
}

impl<S, W: Clone> Layer<S> for FenceLayer<W> {
    type Service = FenceService<S, W>;

    fn layer(&self, inner: S) -> Self::Service {
        FenceService {
            inner,
            writes: self.writes.clone(),
            fence: self.fence.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct FenceService<S, W> {
    inner: S,
    writes: W,
    fence: Fence,
}

fn is_write(method: &Method) -> bool {
    [Method::POST, Method::PUT, Method::PATCH, Method::DELETE].contains(method)
}

impl<S, W, B, R> Service<Request<B>> for FenceService<S, W>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    W: Service<Request<B>, Response = Response<R>> + Clone + Send + 'static,
    W::Future: Send + 'static,
    W::Error: Into<BoxError>,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        if !is_write(request.method()) {
            let response = self.inner.call(request);
            return Box::pin(async move { response.await.map_err(Into::into) });
        }
        let write = match self.fence.begin_write(Instant::now()) {
            Ok(write) => write,
            Err(not_leader) => return Box::pin(async move { Err(not_leader.into()) }),
        };
        let deadline = write.deadline();
        *request.uri_mut() = with_timeout(request.uri(), &deadline.timeout_param());
        let response = self.writes.clone().oneshot(request);
        Box::pin(async move {
            match tokio::time::timeout_at(deadline.at.into(), response).await {
                Ok(Ok(response)) => {
                    write.answered(response.status().as_u16());
                    Ok(response)
                }
                // Failed on the way or abandoned: `write` is dropped unanswered, so it counts
                // as maybe applied until its deadline.
                Ok(Err(err)) => Err(err.into()),
                Err(_) => Err(FenceExpired.into()),
            }
        })
    }
}

/// The stack that carries a reconcile client's writes.
pub type WriteService = BoxCloneSyncService<Request<Body>, Response<Box<DynBody>>, BoxError>;

/// kube's stack (base URI, credentials, headers such as the user agent) and `layer`, over
/// connections of their own whose bytes pass only while `fence` is open ([`FencedIo`]).
fn write_service(
    config: &kube::Config,
    fence: &Fence,
    layer: &ApiRequestLayer,
) -> Result<WriteService> {
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    let connector = config.rustls_https_connector_with_connector(FencedConnector {
        inner: tcp,
        fence: fence.clone(),
    })?;
    let hyper = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector);
    let service = ServiceBuilder::new()
        .layer(layer.clone())
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .map_response(|response: Response<Incoming>| {
            response.map(|body| Box::new(body.map_err(BoxError::from)) as Box<DynBody>)
        })
        .service(hyper);
    Ok(BoxCloneSyncService::new(service))
}

/// Opens the write connections: plain TCP (TLS goes on top), each wrapped in [`FencedIo`].
#[derive(Debug, Clone)]
struct FencedConnector {
    inner: HttpConnector,
    fence: Fence,
}

impl Service<http::Uri> for FencedConnector {
    type Response = FencedIo<TokioIo<tokio::net::TcpStream>>;
    type Error = <HttpConnector as Service<http::Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let fence = self.fence.clone();
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            Ok(FencedIo {
                io: connecting.await?,
                fence,
            })
        })
    }
}

/// A write connection's socket: every write to it first asks the fence, so a request the
/// fence let through cannot leave the process once the fence has closed, wherever it
/// waited in between (a paused process, a busy runtime, hyper's queue for a connection).
/// What is left is the time between that check and the kernel's taking the bytes, and the
/// network after it: both bounded by the margin the fence leaves (see [`crate::fence`]).
#[derive(Debug)]
pub struct FencedIo<T> {
    io: T,
    fence: Fence,
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for FencedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for FencedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if !self.fence.is_open(Instant::now()) {
            return Poll::Ready(Err(std::io::Error::other(NotLeader)));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<T: Connection> Connection for FencedIo<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

/// See the module doc.
#[derive(Debug, Clone)]
pub struct ApiRequestLayer {
    host: String,
    reachability: Reachability,
    metrics: Arc<Metrics>,
}

impl<S> Layer<S> for ApiRequestLayer {
    type Service = ApiRequestService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ApiRequestService {
            inner,
            host: self.host.clone(),
            reachability: self.reachability.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ApiRequestService<S> {
    inner: S,
    host: String,
    reachability: Reachability,
    metrics: Arc<Metrics>,
}

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

impl<S, B, R> Service<Request<B>> for ApiRequestService<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let method = request.method().to_string();
        let path = request.uri().path().to_string();
        let span = tracing::info_span!(
            "k8s.request",
            otel.name = %format!("{method} {path}"),
            otel.kind = "client",
            http.request.method = %method,
            url.path = %path,
            http.response.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        let context = span.context();
        opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.inject_context(&context, &mut HeaderInjector(request.headers_mut()))
        });
        let host = self.host.clone();
        let reachability = self.reachability.clone();
        let metrics = self.metrics.clone();
        let started = std::time::Instant::now();
        let response = self.inner.call(request).instrument(span.clone());
        Box::pin(async move {
            let result = response.await;
            let took = started.elapsed();
            reachability.record(result.as_ref().ok().map(|r| r.status().as_u16()));
            let code = match &result {
                Ok(response) => {
                    let status = response.status().as_u16();
                    span.record("http.response.status_code", status);
                    if status >= 500 {
                        span.record("otel.status_code", "ERROR");
                    }
                    status.to_string()
                }
                Err(_) => {
                    span.record("otel.status_code", "ERROR");
                    "<error>".to_string()
                }
            };
            metrics.api_request(code, method, host, took);
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[tokio::test]
    async fn writes_carry_the_fence_and_reads_do_not() {
        let fence = Fence::default();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let recorder = {
            let seen = seen.clone();
            tower::service_fn(move |req: Request<()>| {
                seen.lock().unwrap().push(req.uri().to_string());
                async { Ok::<_, BoxError>(Response::new(())) }
            })
        };
        let mut svc = FenceLayer {
            fence: fence.clone(),
            writes: recorder.clone(),
        }
        .layer(recorder);
        let req = |method: Method| {
            Request::builder()
                .method(method)
                .uri("/api/v1/namespaces/a/configmaps?fieldManager=m")
                .body(())
                .unwrap()
        };
        // Closed fence: reads pass, writes are refused without being sent.
        assert!(svc.call(req(Method::GET)).await.is_ok());
        let err = svc.call(req(Method::POST)).await.unwrap_err();
        assert!(err.is::<NotLeader>(), "{err}");
        assert_eq!(seen.lock().unwrap().len(), 1);
        // Open fence: the write carries the time left as the server's timeout.
        fence.extend(Instant::now() + std::time::Duration::from_secs(5));
        svc.call(req(Method::PATCH)).await.unwrap();
        let sent = seen.lock().unwrap()[1].clone();
        let timeout: u64 = sent
            .rsplit_once("&timeout=")
            .and_then(|(_, t)| t.strip_suffix("ms"))
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("no timeout in {sent}"));
        assert!((400..=500).contains(&timeout), "{sent}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_is_abandoned_at_the_fence() {
        let fence = Fence::default();
        fence.extend(Instant::now() + std::time::Duration::from_secs(2));
        let slow = tower::service_fn(|_: Request<()>| async {
            tokio::time::sleep(std::time::Duration::from_secs(60)).await;
            Ok::<_, BoxError>(Response::new(()))
        });
        let mut svc = FenceLayer {
            fence,
            writes: slow,
        }
        .layer(slow);
        let request = Request::builder()
            .method(Method::DELETE)
            .uri("/x")
            .body(())
            .unwrap();
        let err = svc.call(request).await.unwrap_err();
        assert!(err.is::<FenceExpired>(), "{err}");
    }

    async fn write<T: hyper::rt::Write + Unpin>(
        io: &mut FencedIo<T>,
        bytes: &[u8],
    ) -> std::io::Result<usize> {
        use hyper::rt::Write as _;
        std::future::poll_fn(|cx| Pin::new(&mut *io).poll_write(cx, bytes)).await
    }

    #[tokio::test]
    async fn a_write_connection_passes_bytes_only_while_the_fence_is_open() {
        let fence = Fence::default();
        let (client, mut server) = tokio::io::duplex(64);
        let mut io = FencedIo {
            io: TokioIo::new(client),
            fence: fence.clone(),
        };
        // A request let through before a pause, its bytes still in the process: refused.
        let err = write(&mut io, b"PATCH").await.unwrap_err();
        assert!(err.get_ref().is_some_and(|e| e.is::<NotLeader>()), "{err}");
        fence.extend(Instant::now() + std::time::Duration::from_secs(5));
        assert_eq!(write(&mut io, b"PATCH").await.unwrap(), 5);
        fence.revoke();
        assert!(write(&mut io, b" /x").await.is_err());
        drop(io);
        let mut received = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut server, &mut received)
            .await
            .unwrap();
        assert_eq!(received, b"PATCH", "only what passed while open");
    }
}
