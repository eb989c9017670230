//! The operator's Kubernetes clients: configuration, the user agent that names the
//! replica, and a tower layer that traces and counts every API request, on top of
//! `kube_leasehold`'s fenced client.
//!
//! Invariants:
//! - neither client re-sends a request by itself (`default_retry` off): kube's retry layer
//!   would re-send a 429/503/504 with backoff up to minutes, honouring `Retry-After`, so a
//!   deposed leader's write could reach the server long after its fence closed. Reconciles
//!   are retried by their queue, election requests by the elector, watches by the caches.
//! - every write of the reconcile client passes `kube_leasehold`'s fence layer
//!   ([`kube_leasehold::fence::FenceLayer`], over its fenced connections).
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
use std::sync::Arc;
use std::task::{Context, Poll};

use anyhow::{Context as _, Result};
use http::{HeaderMap, Request, Response};
use kube::Client;
use kube_leasehold::fence::{Fence, FenceLayer, write_service};
use kube_leasehold::retry::Reachability;
use opentelemetry::propagation::Injector;
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::infra::metrics::Metrics;

/// The process's clients.
pub struct Clients {
    /// Caches and reconciles; every write is fenced.
    pub reconcile: Client,
    /// The Lease only; never fenced (it is what opens the fence).
    pub election: Client,
    /// Token and access reviews of metrics scrapes; never fenced (followers serve metrics
    /// too), and it writes nothing that is stored.
    pub reviews: Client,
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

/// Builds the clients from one configuration.
pub fn clients(mut config: kube::Config, fence: Fence, metrics: Arc<Metrics>) -> Result<Clients> {
    config.default_retry = false;
    let reachability = Reachability::default();
    let layer = ApiRequestLayer {
        host: host_of(&config),
        reachability: reachability.clone(),
        metrics,
    };
    // Unfenced, through the request layer; one per use, so that neither queues behind
    // the other's requests.
    let unfenced = || -> Result<Client> {
        Ok(kube::client::ClientBuilder::try_from(config.clone())?
            .with_layer(&layer)
            .build())
    };
    let election = unfenced()?;
    let reviews = unfenced()?;
    let reconcile = fenced_client(&config, fence, &layer)?;
    Ok(Clients {
        reconcile,
        election,
        reviews,
        reachability,
        config,
        layer,
    })
}

/// A reconcile client: reads through kube's usual stack, writes fenced by `fence`, both
/// through the request layer.
fn fenced_client(config: &kube::Config, fence: Fence, layer: &ApiRequestLayer) -> Result<Client> {
    let writes = BoxCloneSyncService::new(layer.layer(write_service(config, &fence)?));
    Ok(kube::client::ClientBuilder::try_from(config.clone())?
        .with_layer(layer)
        .with_layer(&FenceLayer::new(fence, writes))
        .build())
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
