//! The cost of secured metrics: one replica serving `/metrics` over TLS to authorised
//! scrapers and one serving plain HTTP, side by side, each scraped N times in a row (a new
//! connection per scrape, so every secured scrape pays a TLS handshake: the worst case;
//! Prometheus keeps its connections). Measured: the API server requests the secured
//! replica makes per scrape (token and access reviews, from the audit log), each replica's
//! CPU per 1,000 scrapes, and the scrape latency (the first secured scrape reviewed, the
//! others cached).

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use e2e::lease::DEFAULT_TIMINGS;
use e2e::operator::{Operator, http_get, https_get};
use serde_json::json;

use super::Bench;

/// The ClusterRole the scraper's ServiceAccount is bound to (the chart's metrics-reader).
const READER: &str = "bench-metrics-reader";

impl Bench {
    /// `n` scrapes of a secured replica and of a plain one (see the module doc).
    pub(super) async fn scrapes(&mut self, n: usize) -> Result<()> {
        eprintln!("==> {n} scrapes of a secured replica and of a plain one");
        let ns = self.namespace("bench-scrapes").await?;
        e2e::access::create_metrics_reader(&self.client, READER).await?;
        let token = e2e::access::service_account_token(&self.client, &ns, "prometheus").await?;
        e2e::access::bind_cluster_role(&self.client, &ns, READER, "prometheus").await?;
        e2e::access::wait_allowed(&self.client, &ns, "prometheus", "/metrics").await?;
        let secured_config = self
            .replica_config(&ns, "secured", &DEFAULT_TIMINGS)
            .with_args(&["--metrics-secure=true"]);
        let mut secured = Operator::start(secured_config)?;
        let mut plain = self.replica(&ns, "plain", &DEFAULT_TIMINGS)?;
        secured.wait_ready().await?;
        plain.wait_ready().await?;

        let before = reviews(self, &secured)?;
        let mut secured_latency = Vec::with_capacity(n);
        let cpu = e2e::process::cpu_seconds(secured.process.pid).unwrap_or(0.0);
        for _ in 0..n {
            let started = Instant::now();
            let (code, _) = https_get(secured.metrics, "/metrics", None, Some(&token)).await?;
            secured_latency.push(started.elapsed().as_secs_f64() * 1000.0);
            ensure!(code == 200, "a secured scrape answered {code}");
        }
        let secured_cpu = e2e::process::cpu_seconds(secured.process.pid).unwrap_or(0.0) - cpu;
        let mut plain_latency = Vec::with_capacity(n);
        let cpu = e2e::process::cpu_seconds(plain.process.pid).unwrap_or(0.0);
        for _ in 0..n {
            let started = Instant::now();
            let (code, _) = http_get(plain.metrics, "/metrics").await?;
            plain_latency.push(started.elapsed().as_secs_f64() * 1000.0);
            ensure!(code == 200, "a plain scrape answered {code}");
        }
        let plain_cpu = e2e::process::cpu_seconds(plain.process.pid).unwrap_or(0.0) - cpu;
        // The audit log is written as requests end: give the last ones a moment.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let reviewed = reviews(self, &secured)? - before;
        let per_thousand = |cpu: f64| cpu * 1000.0 / n as f64;
        self.report.record(
            "scrape_api_requests_per_scrape",
            json!(reviewed as f64 / n as f64),
            format!(
                "secured metrics: {reviewed} API server requests (token and access reviews) for {n} scrapes with one token ({:.4} per scrape; verdicts cached 60 s)",
                reviewed as f64 / n as f64
            ),
        );
        self.report.record(
            "scrape_cpu_seconds_per_1000",
            json!({"secured": per_thousand(secured_cpu), "plain": per_thousand(plain_cpu)}),
            format!(
                "replica CPU per 1,000 scrapes: {:.3} s secured (a TLS handshake each), {:.3} s plain",
                per_thousand(secured_cpu),
                per_thousand(plain_cpu)
            ),
        );
        let p50 = |samples: &[f64]| e2e::stats::percentile(samples, 50.0);
        self.report.record(
            "scrape_latency_ms",
            json!({
                "secured_first": secured_latency[0],
                "secured_p50": p50(&secured_latency[1..]),
                "plain_p50": p50(&plain_latency),
            }),
            format!(
                "scrape latency: the first secured scrape (reviewed) {:.1} ms; then p50 {:.2} ms secured (cached), {:.2} ms plain",
                secured_latency[0],
                p50(&secured_latency[1..]),
                p50(&plain_latency)
            ),
        );
        secured.stop();
        plain.stop();
        Ok(())
    }
}

/// Token and access reviews `op` asked the API server for so far (the audit log).
fn reviews(bench: &Bench, op: &Operator) -> Result<usize> {
    let agent = op.user_agent();
    Ok(e2e::audit::read(&bench.cluster.audit_log)?
        .events
        .iter()
        .filter(|e| e.user_agent == agent && e.verb == "create")
        .filter(|e| matches!(e.resource(), "tokenreviews" | "subjectaccessreviews"))
        .count())
}
