//! A Jaeger (v2, in-memory storage) on loopback ports for the tracing tests: OTLP over gRPC
//! in, the query API out. Every listener is bound to 127.0.0.1 (its defaults would
//! listen on all interfaces).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kube_leasehold::scaleout::selector::encode_query_value;
use serde_json::{Value, json};

use crate::operator::http_get;
use crate::ports::free_port;
use crate::process::{Lifetime, Process, spawn};

/// A running Jaeger.
#[derive(Debug)]
pub struct Jaeger {
    /// OTLP gRPC receiver (`host:port`, no scheme), as the apiserver's tracing config wants it.
    pub otlp_grpc: SocketAddr,
    /// Query API (`/api/traces`, `/api/services`).
    pub api: JaegerApi,
    pub process: Process,
}

/// Jaeger's query API.
#[derive(Debug, Clone, Copy)]
pub struct JaegerApi {
    pub addr: SocketAddr,
}

impl Jaeger {
    /// Starts Jaeger with its config and log in `dir`; returns once the query API answers.
    pub async fn start(dir: &Path, lifetime: Lifetime) -> Result<Jaeger> {
        let binary = crate::binaries::jaeger()?;
        std::fs::create_dir_all(dir)?;
        let addr = || -> Result<SocketAddr> { Ok(format!("127.0.0.1:{}", free_port()?).parse()?) };
        let (otlp_grpc, query, query_grpc) = (addr()?, addr()?, addr()?);
        let config = json!({
            "service": {
                "extensions": ["jaeger_storage", "jaeger_query"],
                "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["jaeger_storage_exporter"]}},
                "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}}
            },
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": otlp_grpc.to_string()}}}},
            "extensions": {
                "jaeger_storage": {"backends": {"memstore": {"memory": {"max_traces": 100000}}}},
                "jaeger_query": {
                    "storage": {"traces": "memstore"},
                    "http": {"endpoint": query.to_string()},
                    "grpc": {"endpoint": query_grpc.to_string()}
                }
            },
            "exporters": {"jaeger_storage_exporter": {"trace_storage": "memstore"}}
        });
        let config_path = dir.join("jaeger.json");
        std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
        let mut cmd = Command::new(binary);
        cmd.arg(format!("--config=file:{}", config_path.display()));
        let mut process = spawn("jaeger", cmd, &dir.join("jaeger.log"), lifetime)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !http_get(query, "/api/services")
            .await
            .is_ok_and(|(code, _)| code == 200)
        {
            process.ensure_running()?;
            if std::time::Instant::now() > deadline {
                bail!("Jaeger not answering after 60 s:\n{}", process.log_tail(20));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Jaeger {
            otlp_grpc,
            api: JaegerApi { addr: query },
            process,
        })
    }
}

impl JaegerApi {
    /// `GET /api/traces` for a service (and optionally an operation): the `data` array.
    pub async fn traces(&self, service: &str, operation: Option<&str>) -> Result<Vec<Value>> {
        let mut path = format!(
            "/api/traces?service={}&limit=1000&lookback=1h",
            encode_query_value(service)
        );
        if let Some(op) = operation {
            path.push_str(&format!("&operation={}", encode_query_value(op)));
        }
        let (code, body) = http_get(self.addr, &path).await?;
        if code != 200 {
            bail!("Jaeger query {path} answered {code}: {body}");
        }
        let doc: Value = serde_json::from_str(&body).context("Jaeger's answer is not JSON")?;
        Ok(doc["data"].as_array().cloned().unwrap_or_default())
    }

    /// `GET /api/traces/ID`: the trace's spans and processes.
    pub async fn trace(&self, id: &str) -> Result<Value> {
        let (code, body) = http_get(self.addr, &format!("/api/traces/{id}")).await?;
        if code != 200 {
            bail!("Jaeger trace {id} answered {code}");
        }
        let doc: Value = serde_json::from_str(&body)?;
        Ok(doc["data"][0].clone())
    }
}
