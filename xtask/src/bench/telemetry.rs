//! The cost of telemetry: cold-start throughput, create → Ready latency and memory with the
//! OTLP exporter off and on (100 % sampling into a local Jaeger).

use std::time::{Duration, Instant};

use anyhow::Result;
use e2e::lease::DEFAULT_TIMINGS;
use e2e::operator::Operator;
use e2e::process::Lifetime;
use e2e::stats::percentile;
use kube::Api;
use myresource_operator::resource::MyResource;
use serde_json::{Value, json};

use super::Bench;
use super::latency::sequential_latency;
use super::objects::{create_objects, wait_all_ready};

impl Bench {
    /// Throughput, latency and memory with the OTLP exporter off and on (100 % sampling into
    /// a local Jaeger), side by side in one run.
    pub(super) async fn telemetry(&mut self, n: usize, latency_objects: usize) -> Result<()> {
        eprintln!(
            "==> telemetry: {n} objects cold, then {latency_objects} one at a time, exporter off and on"
        );
        let jaeger = e2e::jaeger::Jaeger::start(
            &self.root.join("target/bench/jaeger"),
            Lifetime::TiedToThisProcess,
        )
        .await?;
        let mut modes = Vec::new();
        for exporting in [false, true] {
            let otlp = exporting.then(|| format!("http://{}", jaeger.otlp_grpc));
            modes.push(self.telemetry_mode(n, latency_objects, otlp).await?);
        }
        let (off, on) = (&modes[0], &modes[1]);
        let line = format!(
            "telemetry, exporter off vs on (100 % sampling): cold throughput {:.0} vs {:.0} objects/s; event → status median {:.1} vs {:.1} ms, p99 {:.1} vs {:.1} ms; RSS {:.1} vs {:.1} MiB",
            off["objects_per_second"].as_f64().unwrap_or(0.0),
            on["objects_per_second"].as_f64().unwrap_or(0.0),
            off["event_to_status_ms"]["p50"].as_f64().unwrap_or(0.0),
            on["event_to_status_ms"]["p50"].as_f64().unwrap_or(0.0),
            off["event_to_status_ms"]["p99"].as_f64().unwrap_or(0.0),
            on["event_to_status_ms"]["p99"].as_f64().unwrap_or(0.0),
            off["rss_mib"].as_f64().unwrap_or(0.0),
            on["rss_mib"].as_f64().unwrap_or(0.0),
        );
        self.report
            .record("telemetry", json!({"objects": n, "modes": modes}), line);
        let mut jaeger = jaeger;
        jaeger.process.stop(Duration::from_secs(5));
        Ok(())
    }

    /// One mode of the telemetry section: exporting to `otlp` (100 % sampling), or not
    /// exporting when `None`.
    async fn telemetry_mode(
        &mut self,
        n: usize,
        latency_objects: usize,
        otlp: Option<String>,
    ) -> Result<Value> {
        let exporting = otlp.is_some();
        let mode = if exporting { "on" } else { "off" };
        let ns = self.namespace(&format!("bench-otel-{mode}")).await?;
        create_objects(&self.client, &ns, n, false).await?;
        let mut config = self.replica_config(&ns, &format!("otel-{mode}"), &DEFAULT_TIMINGS);
        if let Some(endpoint) = otlp {
            config.env = vec![
                ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint),
                ("OTEL_TRACES_SAMPLER".into(), "always_on".into()),
            ];
        }
        let started = Instant::now();
        let mut op = Operator::start(config)?;
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), &ns);
        wait_all_ready(&op, &mrs, n).await?;
        let throughput = n as f64 / started.elapsed().as_secs_f64();
        op.wait_ready().await?;
        let samples = sequential_latency(&self.client, &ns, "t", latency_objects).await?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss = op.rss_bytes().unwrap_or(0) as f64 / 1048576.0;
        op.stop();
        Ok(json!({
            "exporter": mode,
            "objects_per_second": throughput,
            "event_to_status_ms": {"p50": percentile(&samples, 50.0), "p99": percentile(&samples, 99.0)},
            "rss_mib": rss,
        }))
    }
}
