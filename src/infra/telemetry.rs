//! Logs and traces.
//!
//! - Logs: JSON lines when stderr is not a terminal (or `--log-format json`), readable text
//!   otherwise; the filter from RUST_LOG, else `--log-level`. Every JSON line written inside
//!   a span carries that span's `trace_id` and `span_id`, so logs and traces join.
//! - Traces: tracing-opentelemetry, configured by the standard `OTEL_*` variables: an OTLP
//!   exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `…_TRACES_ENDPOINT`) is set, over gRPC
//!   or `http/protobuf` (`OTEL_EXPORTER_OTLP_PROTOCOL`), sampled per `OTEL_TRACES_SAMPLER`
//!   and `OTEL_TRACES_SAMPLER_ARG`, with `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`.
//!   Without an endpoint nothing is exported; span ids are still made so that log lines
//!   carry them. Spans still buffered are flushed by [`Telemetry::shutdown`].

use std::fmt;
use std::io::IsTerminal;

use anyhow::{Context, Result};
use opentelemetry::trace::{SpanContext, TraceContextExt, TracerProvider as _};
use opentelemetry::{KeyValue, global};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Who this process is, for the trace resource.
pub struct Identity<'a> {
    pub replica: &'a str,
}

/// Owns the tracer provider; flush it on the way out.
pub struct Telemetry {
    provider: SdkTracerProvider,
    exporting: bool,
}

impl Telemetry {
    /// Exports what is still buffered.
    pub fn shutdown(self) {
        if self.exporting
            && let Err(err) = self.provider.shutdown()
        {
            eprintln!("flushing traces failed: {err}");
        }
    }
}

/// How log lines are written.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Json,
    Text,
}

/// kube's own request layer logs every failed request at ERROR, so an unreachable API
/// server turned into one line per request. The operator counts every request
/// (`rest_client_requests_total`) and logs repeated failures at a bounded rate itself, so
/// that target is off unless the filter names it.
fn quiet_kube_request_errors(directives: &str) -> String {
    const TARGET: &str = "kube_client::client::builder";
    if directives.contains(TARGET) {
        directives.to_string()
    } else {
        format!("{directives},{TARGET}=off")
    }
}

/// Installs the global subscriber (and, with an OTLP endpoint, the exporter). Call inside
/// the tokio runtime: the gRPC exporter needs it.
/// The OpenTelemetry context of `span` (invalid when tracing is off): for span links and
/// the trace ids of log lines.
pub fn span_context(span: &tracing::Span) -> SpanContext {
    span.context().span().span_context().clone()
}

pub fn init(level: &str, format: Option<LogFormat>, identity: Identity<'_>) -> Result<Telemetry> {
    let directives = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.is_empty() => directives,
        _ => level.to_string(),
    };
    let filter = EnvFilter::try_new(quiet_kube_request_errors(&directives))
        .with_context(|| format!("invalid log filter {directives:?}"))?;
    let json = match format {
        Some(LogFormat::Json) => true,
        Some(LogFormat::Text) => false,
        None => !std::io::stderr().is_terminal(),
    };

    global::set_text_map_propagator(TraceContextPropagator::new());
    let (provider, exporting) = tracer_provider(&identity)?;
    let tracer = provider.tracer("myresource-operator");
    global::set_tracer_provider(provider.clone());
    let otel = tracing_opentelemetry::layer().with_tracer(tracer);

    let logs = if json {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .event_format(JsonLines)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .boxed()
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(otel)
        .with(logs)
        .try_init()
        .context("installing the tracing subscriber")?;
    Ok(Telemetry {
        provider,
        exporting,
    })
}

fn tracer_provider(identity: &Identity<'_>) -> Result<(SdkTracerProvider, bool)> {
    let mut resource = Resource::builder();
    let named_by_env = std::env::var("OTEL_SERVICE_NAME").is_ok()
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| a.contains("service.name="));
    if !named_by_env {
        resource = resource.with_service_name("myresource-operator");
    }
    resource = resource.with_attributes([
        KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        KeyValue::new("service.instance.id", identity.replica.to_string()),
    ]);
    for (var, key) in [
        ("POD_NAME", "k8s.pod.name"),
        ("POD_NAMESPACE", "k8s.namespace.name"),
    ] {
        if let Some(value) = std::env::var(var).ok().filter(|v| !v.is_empty()) {
            resource = resource.with_attribute(KeyValue::new(key, value));
        }
    }
    let builder = SdkTracerProvider::builder().with_resource(resource.build());
    let endpoint = [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|e| !e.is_empty()));
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v == "true")
        || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v == "none");
    if !endpoint || disabled {
        return Ok((builder.build(), false));
    }
    let protocol = std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|_| "grpc".into());
    let exporter = match protocol.as_str() {
        "grpc" => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()?,
        "http/protobuf" => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build()?,
        other => anyhow::bail!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={other:?} is not supported (use grpc or http/protobuf)"
        ),
    };
    Ok((builder.with_batch_exporter(exporter).build(), true))
}

/// One JSON object per event: timestamp, level, target, message and fields, the current
/// span's name, and its trace and span ids.
struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut line = Map::new();
        line.insert(
            "timestamp".into(),
            k8s_openapi::jiff::Timestamp::now().to_string().into(),
        );
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("target".into(), meta.target().into());
        event.record(&mut JsonVisitor(&mut line));
        if let Some(span) = ctx.lookup_current() {
            line.insert("span".into(), span.name().into());
            let span_context = span_context(&tracing::Span::current());
            if span_context.is_valid() {
                line.insert(
                    "trace_id".into(),
                    span_context.trace_id().to_string().into(),
                );
                line.insert("span_id".into(), span_context.span_id().to_string().into());
            }
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}

struct JsonVisitor<'a>(&'a mut Map<String, Value>);

impl Visit for JsonVisitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_request_errors_are_quiet_unless_asked_for() {
        assert_eq!(
            quiet_kube_request_errors("info"),
            "info,kube_client::client::builder=off"
        );
        let asked = "info,kube_client::client::builder=debug";
        assert_eq!(quiet_kube_request_errors(asked), asked);
    }
}
