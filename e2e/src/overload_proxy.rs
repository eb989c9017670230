//! A loopback HTTPS proxy in front of kube-apiserver that can play an overloaded API server
//! for one replica.
//!
//! It terminates TLS with a serving pair signed by the test CA (SAN 127.0.0.1) and forwards
//! every request, headers (user agent included) unchanged, over TLS with the client
//! certificate of a kubeconfig, so the audit log names the same user and user agent as
//! without it. Request bodies are read whole (the operator's are small); response bodies
//! stream, so watches pass through as they arrive.
//!
//! While overloaded it answers a share of writes (POST, PUT, PATCH, DELETE) with 429 and
//! `Retry-After`, and holds another share for a delay before forwarding it; it can also hold
//! every Lease write, so that the leader surely misses its renew deadline and another
//! replica takes over while its other writes are being retried or held. A held write is
//! delivered even when its client has stopped waiting (a server that received a request
//! may still apply it), with its `timeout` parameter shortened by the time held; one whose
//! timeout ran out while held is answered 504, as the API server answers a request that
//! outlived its `timeout`. Reads and watches always pass through.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER, TRANSFER_ENCODING};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kube::client::ConfigExt;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// How the overloaded server treats writes.
#[derive(Debug, Clone, Copy)]
pub struct Overload {
    /// Percent of writes answered 429.
    pub reject_percent: u64,
    /// The `Retry-After` of a 429, in seconds.
    pub retry_after_seconds: u64,
    /// Percent of writes held for `delay` before they are forwarded.
    pub delay_percent: u64,
    pub delay: Duration,
    /// Hold every write to a Lease for `delay`, whatever the shares say.
    pub hold_lease_writes: bool,
    /// Percent of reads of a Lease (GETs and watches) answered 503.
    pub lease_read_fail_percent: u64,
    /// Seeds the choice of the writes that are rejected or held.
    pub seed: u64,
}

/// What the proxy did to writes since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OverloadStats {
    /// Answered 429.
    pub rejected: u64,
    /// Held, then forwarded.
    pub delivered_late: u64,
    /// Held until their `timeout` ran out, then answered 504.
    pub timed_out: u64,
    /// Reads of a Lease answered 503.
    pub lease_reads_failed: u64,
}

/// A running proxy; dropping it stops accepting.
pub struct OverloadProxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

type Body = Either<Incoming, Full<Bytes>>;
type Sender = SendRequest<Full<Bytes>>;

struct Shared {
    upstream: SocketAddr,
    server_name: ServerName<'static>,
    tls: TlsConnector,
    /// The overload in force and the state of its generator.
    overload: Mutex<Option<(Overload, u64)>>,
    rejected: AtomicU64,
    delivered_late: AtomicU64,
    timed_out: AtomicU64,
    lease_reads_failed: AtomicU64,
}

enum Verdict {
    Forward,
    Reject(u64),
    Hold(Duration),
    Unavailable,
}

impl OverloadProxy {
    /// Listens on a free loopback port and forwards to the API server of `kubeconfig` with
    /// its client certificate, presenting the serving pair `serving_cert`/`serving_key`.
    pub async fn start(
        kubeconfig: &Path,
        serving_cert: &Path,
        serving_key: &Path,
    ) -> Result<OverloadProxy> {
        let config = crate::kubeconfig::config_for(kubeconfig).await?;
        let upstream: SocketAddr = format!(
            "{}:{}",
            config.cluster_url.host().unwrap_or_default(),
            config.cluster_url.port_u16().unwrap_or(443)
        )
        .parse()?;
        ensure!(
            upstream.ip().is_loopback(),
            "the overload proxy only forwards to loopback, not {upstream}"
        );
        let shared = Arc::new(Shared {
            upstream,
            server_name: ServerName::IpAddress(upstream.ip().into()),
            tls: TlsConnector::from(Arc::new(config.rustls_client_config()?)),
            overload: Mutex::new(None),
            rejected: AtomicU64::new(0),
            delivered_late: AtomicU64::new(0),
            timed_out: AtomicU64::new(0),
            lease_reads_failed: AtomicU64::new(0),
        });
        let certs = CertificateDer::pem_file_iter(serving_cert)?.collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(serving_key)?;
        let server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
        let acceptor = TlsAcceptor::from(Arc::new(server));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let accept = {
            let shared = shared.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    tokio::spawn(serve(client, acceptor.clone(), shared.clone()));
                }
            })
        };
        Ok(OverloadProxy {
            addr,
            shared,
            accept,
        })
    }

    /// Starts treating writes as `overload` says.
    pub fn overload(&self, overload: Overload) {
        let state = overload.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        *self.shared.overload.lock().expect("overload lock") = Some((overload, state));
    }

    /// Forwards every new request at once again (held ones are still delivered late).
    pub fn relieve(&self) {
        *self.shared.overload.lock().expect("overload lock") = None;
    }

    pub fn stats(&self) -> OverloadStats {
        OverloadStats {
            rejected: self.shared.rejected.load(Ordering::SeqCst),
            delivered_late: self.shared.delivered_late.load(Ordering::SeqCst),
            timed_out: self.shared.timed_out.load(Ordering::SeqCst),
            lease_reads_failed: self.shared.lease_reads_failed.load(Ordering::SeqCst),
        }
    }
}

impl Drop for OverloadProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// One client connection: TLS, then HTTP/1 with one upstream connection of its own
/// (opened on first use, reopened when the server closed it).
async fn serve(client: TcpStream, acceptor: TlsAcceptor, shared: Arc<Shared>) {
    let Ok(Ok(tls)) = tokio::time::timeout(Duration::from_secs(10), acceptor.accept(client)).await
    else {
        return;
    };
    let upstream: Arc<tokio::sync::Mutex<Option<Sender>>> = Default::default();
    let service = service_fn(move |req| handle(shared.clone(), upstream.clone(), req));
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(tls), service)
        .await;
}

async fn handle(
    shared: Arc<Shared>,
    upstream: Arc<tokio::sync::Mutex<Option<Sender>>>,
    req: Request<Incoming>,
) -> Result<Response<Body>> {
    let received = Instant::now();
    let (mut parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    // The body is forwarded whole: hyper sets the length from it.
    parts.headers.remove(TRANSFER_ENCODING);
    parts.headers.remove(CONTENT_LENGTH);
    let req = Request::from_parts(parts, Full::new(body));
    match shared.verdict(req.method(), req.uri().path()) {
        Verdict::Unavailable => {
            shared.lease_reads_failed.fetch_add(1, Ordering::SeqCst);
            Ok(status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "The server is currently unable to handle the request.",
                None,
            ))
        }
        Verdict::Forward => {
            let mut slot = upstream.lock().await;
            let reusable = match slot.as_mut() {
                Some(sender) => sender.ready().await.is_ok(),
                None => false,
            };
            if !reusable {
                *slot = Some(shared.connect().await?);
            }
            let response = slot.as_mut().expect("connected").send_request(req);
            drop(slot);
            Ok(response.await?.map(Either::Left))
        }
        Verdict::Reject(retry_after) => {
            shared.rejected.fetch_add(1, Ordering::SeqCst);
            Ok(status(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                "Too many requests, please try again later.",
                Some(retry_after),
            ))
        }
        Verdict::Hold(delay) => {
            // Detached: the write reaches the server even if the client gives up.
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = tx.send(shared.deliver_late(req, received).await);
            });
            rx.await?
        }
    }
}

/// The next of `state`'s rolls, 0 to 99 (xorshift64*).
fn roll(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) % 100
}

impl Shared {
    fn verdict(&self, method: &Method, path: &str) -> Verdict {
        let write = matches!(
            *method,
            Method::POST | Method::PUT | Method::PATCH | Method::DELETE
        );
        let lease = path.split('/').any(|segment| segment == "leases");
        let mut guard = self.overload.lock().expect("overload lock");
        let Some((overload, state)) = guard.as_mut() else {
            return Verdict::Forward;
        };
        if !write {
            return if lease
                && *method == Method::GET
                && roll(state) < overload.lease_read_fail_percent
            {
                Verdict::Unavailable
            } else {
                Verdict::Forward
            };
        }
        if overload.hold_lease_writes && lease {
            return Verdict::Hold(overload.delay);
        }
        let roll = roll(state);
        if roll < overload.reject_percent {
            Verdict::Reject(overload.retry_after_seconds)
        } else if roll < overload.reject_percent + overload.delay_percent {
            Verdict::Hold(overload.delay)
        } else {
            Verdict::Forward
        }
    }

    async fn connect(&self) -> Result<Sender> {
        let tcp = TcpStream::connect(self.upstream).await?;
        let tls = self.tls.connect(self.server_name.clone(), tcp).await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        sender.ready().await?;
        Ok(sender)
    }

    /// Forwards a held write on a connection of its own, its `timeout` spent by the wait.
    async fn deliver_late(
        &self,
        mut req: Request<Full<Bytes>>,
        received: Instant,
    ) -> Result<Response<Body>> {
        let Some(uri) = spend_timeout(req.uri(), received.elapsed()) else {
            self.timed_out.fetch_add(1, Ordering::SeqCst);
            return Ok(status(
                StatusCode::GATEWAY_TIMEOUT,
                "Timeout",
                "Timeout: request did not complete within the allotted timeout",
                None,
            ));
        };
        *req.uri_mut() = uri;
        self.delivered_late.fetch_add(1, Ordering::SeqCst);
        let mut sender = self.connect().await?;
        Ok(sender.send_request(req).await?.map(Either::Left))
    }
}

/// A Kubernetes `Status` response.
fn status(
    code: StatusCode,
    reason: &str,
    message: &str,
    retry_after: Option<u64>,
) -> Response<Body> {
    let mut body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    let mut response = Response::builder()
        .status(code)
        .header(CONTENT_TYPE, "application/json");
    if let Some(seconds) = retry_after {
        body["details"] = serde_json::json!({"retryAfterSeconds": seconds});
        response = response.header(RETRY_AFTER, seconds);
    }
    response
        .body(Either::Right(Full::new(Bytes::from(body.to_string()))))
        .expect("a valid response")
}

/// `uri` with its `timeout` parameter less `spent`; unchanged without one (or with one that
/// is not a duration, which the API server rejects itself); `None` when it ran out.
fn spend_timeout(uri: &Uri, spent: Duration) -> Option<Uri> {
    let Some(query) = uri.query() else {
        return Some(uri.clone());
    };
    let mut expired = false;
    let params: Vec<String> = query
        .split('&')
        .map(|param| {
            let Some(timeout) = param.strip_prefix("timeout=").and_then(go_duration) else {
                return param.to_string();
            };
            match timeout.checked_sub(spent) {
                Some(left) if !left.is_zero() => {
                    format!("timeout={}ms", left.as_millis().max(1))
                }
                _ => {
                    expired = true;
                    param.to_string()
                }
            }
        })
        .collect();
    if expired {
        return None;
    }
    format!("{}?{}", uri.path(), params.join("&")).parse().ok()
}

/// A Go duration (`time.ParseDuration`, as the API server reads `timeout`): `1.5s`, `300ms`,
/// `1m30s`.
fn go_duration(text: &str) -> Option<Duration> {
    if text == "0" {
        return Some(Duration::ZERO);
    }
    let is_number = |c: char| c.is_ascii_digit() || c == '.';
    let mut rest = text;
    let mut seconds = 0.0;
    while !rest.is_empty() {
        let unit_at = rest.find(|c: char| !is_number(c))?;
        let (number, tail) = rest.split_at(unit_at);
        let value: f64 = number.parse().ok()?;
        let (unit, tail) = tail.split_at(tail.find(is_number).unwrap_or(tail.len()));
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        seconds += value * scale;
        rest = tail;
    }
    (!text.is_empty()).then(|| Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse_as_the_api_server_reads_them() {
        assert_eq!(go_duration("2s"), Some(Duration::from_secs(2)));
        assert_eq!(go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(go_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(go_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(go_duration("0"), Some(Duration::ZERO));
        assert_eq!(go_duration(""), None);
        assert_eq!(go_duration("5"), None);
        assert_eq!(go_duration("5x"), None);
    }

    #[test]
    fn the_time_held_is_taken_from_the_timeout() {
        let uri: Uri = "/api/v1/namespaces/a/configmaps?fieldManager=m&timeout=3s"
            .parse()
            .unwrap();
        assert_eq!(
            spend_timeout(&uri, Duration::from_millis(1200)).unwrap(),
            "/api/v1/namespaces/a/configmaps?fieldManager=m&timeout=1800ms"
        );
        assert_eq!(spend_timeout(&uri, Duration::from_secs(3)), None);
        let without: Uri = "/api/v1/namespaces/a/configmaps?fieldManager=m"
            .parse()
            .unwrap();
        assert_eq!(
            spend_timeout(&without, Duration::from_secs(9)).unwrap(),
            without
        );
        let bare: Uri = "/api/v1/namespaces".parse().unwrap();
        assert_eq!(spend_timeout(&bare, Duration::from_secs(9)).unwrap(), bare);
    }
}
