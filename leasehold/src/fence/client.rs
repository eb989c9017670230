//! The fenced client: a `kube::Client` whose writes (POST, PUT, PATCH, DELETE) pass a
//! [`Fence`].
//!
//! Invariants:
//! - a write is refused when the fence is closed ([`NotLeader`]), abandoned at the fence's
//!   expiry ([`FenceExpired`]), and sent with the API server's `timeout` parameter set to
//!   the time left (see [`crate::fence`]); reads pass untouched;
//! - writes travel on connections of their own whose sockets take bytes only while the
//!   fence is open ([`FencedIo`]): a write let through before the process was paused, or
//!   while it waited in hyper for a connection, is not sent once the fence has closed;
//! - a write connection is reset when it closes (`SO_LINGER` 0), never shut down gracefully:
//!   a write abandoned at its deadline closes its connection, and the kernel then discards
//!   what it still held to send or re-send, so bytes a partition kept from the API server
//!   do not reach it after the heal (a graceful close would send them, and the server apply
//!   them, in the next term);
//! - the client never re-sends a request by itself: [`fenced_client`] turns kube's retry
//!   layer off (`default_retry = false`), which would re-send a 429/503/504 with backoff up
//!   to minutes, honouring `Retry-After`, long after the fence closed. Retry in your
//!   controller's queue instead.
//!
//! What is not promised: the network's delay after the kernel took the bytes, and the API
//! server's admission after it read them, are bounded only by the margin the fence leaves
//! ([`crate::fence::MAX_WRITE_TIME`]) and by the server honouring `timeout`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Method, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kube::Client;
use kube::client::{Body, ConfigExt, DynBody};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, Service, ServiceBuilder, ServiceExt};

use super::{Fence, NotLeader, with_timeout};
use crate::bugs::{self, Bug};

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

/// The tower layer of a fenced client (see the module doc): writes go to `writes` (in
/// production a [`WriteService`], connections of their own on which bytes pass only while
/// the fence is open), reads to the inner stack.
#[derive(Debug, Clone)]
pub struct FenceLayer<W> {
    fence: Fence,
    writes: W,
}

impl<W> FenceLayer<W> {
    /// Writes pass `fence`, then go to `writes`.
    pub fn new(fence: Fence, writes: W) -> Self {
        FenceLayer { fence, writes }
    }
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

/// The service [`FenceLayer`] makes.
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
        let write = match self.fence.begin_write(crate::clock::now()) {
            Ok(write) => write,
            Err(not_leader) => return Box::pin(async move { Err(not_leader.into()) }),
        };
        let deadline = write.deadline();
        let outlive = bugs::on(Bug::WritesOutliveFence);
        if !outlive {
            *request.uri_mut() = with_timeout(request.uri(), &deadline.timeout_param());
        }
        let response = self.writes.clone().oneshot(request);
        Box::pin(async move {
            let cut_off = if outlive {
                crate::clock::now() + std::time::Duration::from_secs(3600)
            } else {
                deadline.at
            };
            match tokio::time::timeout_at(cut_off.into(), response).await {
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

/// The stack that carries a fenced client's writes.
pub type WriteService = BoxCloneSyncService<Request<Body>, Response<Box<DynBody>>, BoxError>;

/// A client whose reads go through kube's usual stack and whose writes pass `fence` (see
/// the module doc). Turns kube's retry layer off in the client it builds.
///
/// To add a layer of your own (tracing, metrics) to both reads and writes, build the
/// client from [`write_service`] and [`FenceLayer`] instead:
///
/// ```no_run
/// # fn f(config: kube::Config, fence: kube_leasehold::Fence) -> Result<kube::Client, kube::Error> {
/// use kube_leasehold::fence::{FenceLayer, write_service};
/// let mut config = config;
/// config.default_retry = false;
/// let writes = write_service(&config, &fence)?; // wrap it in your layer here
/// let client = kube::client::ClientBuilder::try_from(config)?
///     .with_layer(&FenceLayer::new(fence, writes))
///     .build();
/// # Ok(client) }
/// ```
pub fn fenced_client(config: &kube::Config, fence: Fence) -> Result<Client, kube::Error> {
    let mut config = config.clone();
    config.default_retry = false;
    let writes = write_service(&config, &fence)?;
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&FenceLayer::new(fence, writes))
        .build())
}

/// kube's stack (base URI, credentials, headers such as the user agent) over connections
/// of their own whose bytes pass only while `fence` is open ([`FencedIo`]): where a fenced
/// client's writes go.
pub fn write_service(config: &kube::Config, fence: &Fence) -> Result<WriteService, kube::Error> {
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    let connector = config.rustls_https_connector_with_connector(FencedConnector {
        inner: tcp,
        fence: fence.clone(),
    })?;
    let hyper = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector);
    let service = ServiceBuilder::new()
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

/// Opens the write connections: plain TCP (TLS goes on top), each reset when it closes
/// (see the module doc) and wrapped in [`FencedIo`].
#[derive(Debug, Clone)]
struct FencedConnector {
    inner: HttpConnector,
    fence: Fence,
}

impl Service<http::Uri> for FencedConnector {
    type Response = FencedIo<TokioIo<tokio::net::TcpStream>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let fence = self.fence.clone();
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            // Does not block on close (a zero linger discards; only a longer one waits).
            io.inner().set_zero_linger()?;
            Ok(FencedIo { io, fence })
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
        if !self.fence.is_open(crate::clock::now()) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

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

    /// A partition holds a request's bytes in the sender's kernel (unsent or unacknowledged);
    /// here a receiver with a small window does. Once the connection closes, as at a write's
    /// deadline, none of them may reach the server.
    #[tokio::test]
    async fn a_closed_write_connection_drops_what_the_kernel_still_held() {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(1).unwrap();
        let uri: http::Uri = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let fence = Fence::default();
        fence.extend(Instant::now() + std::time::Duration::from_secs(5));
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        let mut connector = FencedConnector { inner: tcp, fence };
        let io = connector.call(uri).await.unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        // Written until the kernel takes no more: most of it waits in the send queue.
        let mut sent = 0;
        let chunk = [b'x'; 64 * 1024];
        while let Ok(n) = io.io.inner().try_write(&chunk) {
            sent += n;
        }
        drop(io);
        let mut received = 0;
        let mut buf = vec![0; 64 * 1024];
        while let Ok(Ok(n @ 1..)) = tokio::time::timeout(
            std::time::Duration::from_secs(2),
            tokio::io::AsyncReadExt::read(&mut server, &mut buf),
        )
        .await
        {
            received += n;
        }
        assert!(
            received < sent / 2,
            "{received} of {sent} bytes reached the server after the close"
        );
    }
}
