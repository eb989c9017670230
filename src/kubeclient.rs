//! The Kubernetes client: configuration, the user agent that names the replica, and a tower
//! layer that traces and counts every API request.
//!
//! The layer opens a `k8s.request` span per request (a child of the current span, so a
//! reconcile's requests nest under it), sends that span's W3C `traceparent` so the API
//! server's own spans join the trace (as children for callers in `system:masters` or
//! `system:monitoring`, as linked traces otherwise), records the status code, and counts
//! `rest_client_requests_total{code,method,host}` and their latency.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};

use anyhow::{Context as _, Result};
use http::{HeaderMap, Request, Response};
use kube::Client;
use opentelemetry::propagation::Injector;
use tower::{Layer, Service};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::metrics::{self, RestLabels};

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

/// A client with the tracing and metrics layer.
pub fn client(config: kube::Config) -> Result<Client> {
    let host = config.cluster_url.host().unwrap_or_default().to_string();
    let port = config
        .cluster_url
        .port_u16()
        .map(|p| format!(":{p}"))
        .unwrap_or_default();
    let layer = ApiRequestLayer {
        host: format!("{host}{port}"),
    };
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&layer)
        .build())
}

/// See the module doc.
#[derive(Debug, Clone)]
pub struct ApiRequestLayer {
    host: String,
}

impl<S> Layer<S> for ApiRequestLayer {
    type Service = ApiRequestService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ApiRequestService {
            inner,
            host: self.host.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ApiRequestService<S> {
    inner: S,
    host: String,
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
        let started = std::time::Instant::now();
        let response = self.inner.call(request).instrument(span.clone());
        Box::pin(async move {
            let result = response.await;
            let took = started.elapsed().as_secs_f64();
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
            let labels = RestLabels { code, method, host };
            let m = metrics::get();
            m.rest_requests.get_or_create(&labels).inc();
            m.rest_request_duration.get_or_create(&labels).observe(took);
            result
        })
    }
}
