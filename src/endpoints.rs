//! HTTP endpoints: `/healthz` (the runtime answers), `/readyz` (caches synced; never "is
//! leader", so followers are ready too), and `/metrics` (Prometheus text, or OpenMetrics
//! when the scraper asks for it).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context as _, Result};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{debug, info};

/// Answers one request: its path and its Accept header.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, path: &str, accept: &str) -> (StatusCode, &'static str, String);
}

/// Binds `addr` and serves `handler` until the process ends; returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    name: &'static str,
    handler: Arc<dyn Handler>,
) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the {name} address {addr}"))?;
    let bound = listener.local_addr()?;
    info!(%bound, "{name} endpoint listening");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let accept = req
                        .headers()
                        .get(hyper::header::ACCEPT)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default();
                    let (status, content_type, body) = handler.handle(req.uri().path(), accept);
                    let response = Response::builder()
                        .status(status)
                        .header("content-type", content_type)
                        .body(Full::new(Bytes::from(body)))
                        .expect("static response parts are valid");
                    async move { Ok::<_, Infallible>(response) }
                });
                if let Err(err) = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    debug!(error = %err, "endpoint connection ended with an error");
                }
            });
        }
    });
    Ok(bound)
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
pub struct Metrics;

impl Handler for Metrics {
    fn handle(&self, path: &str, accept: &str) -> (StatusCode, &'static str, String) {
        if path != "/metrics" {
            return (StatusCode::NOT_FOUND, "text/plain", "not found".into());
        }
        let openmetrics = accept.contains("application/openmetrics-text");
        let body = crate::metrics::get().encode(openmetrics);
        let content_type = if openmetrics {
            "application/openmetrics-text; version=1.0.0; charset=utf-8"
        } else {
            "text/plain; version=0.0.4; charset=utf-8"
        };
        (StatusCode::OK, content_type, body)
    }
}
