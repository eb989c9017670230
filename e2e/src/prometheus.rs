//! A real Prometheus on loopback for the chart tests: it scrapes replicas every second,
//! evaluates queries and the rendered alert rules, and promtool checks the rules.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kube_leasehold::scaleout::selector::encode_query_value as encoded;
use serde_json::{Value, json};

use crate::harness::TestEnv;
use crate::operator::{Operator, http_get};
use crate::process::{Lifetime, Process, run, spawn};
use crate::wait::poll;

/// A Prometheus process, stopped when dropped.
pub struct Prometheus {
    addr: std::net::SocketAddr,
    promtool: PathBuf,
    rules: PathBuf,
    _process: ProcessGuard,
}

struct ProcessGuard(Process);

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        self.0.stop(Duration::from_secs(5));
    }
}

impl Prometheus {
    /// Prometheus scraping `replicas` every second and evaluating the rule file `rules`.
    pub async fn start(env: &TestEnv, replicas: &[Operator], rules: &str) -> Result<Prometheus> {
        Prometheus::start_with(env, replicas, rules, None).await
    }

    /// [`Prometheus::start`]; with `token`, over HTTPS (the certificate unchecked, as the
    /// chart's ServiceMonitor does for a self-signed one) with that bearer token, as
    /// Prometheus shows its ServiceAccount's.
    pub async fn start_with(
        env: &TestEnv,
        replicas: &[Operator],
        rules: &str,
        token: Option<&str>,
    ) -> Result<Prometheus> {
        let (server, promtool) = crate::binaries::prometheus()?;
        let dir = std::env::temp_dir().join(format!("myresource-e2e-prometheus-{}", env.namespace));
        std::fs::create_dir_all(&dir)?;
        let rules_file = dir.join("alerts.yaml");
        std::fs::write(&rules_file, rules)?;
        let targets: Vec<Value> = replicas
            .iter()
            .map(|r| json!({"targets": [r.metrics.to_string()], "labels": {"namespace": env.namespace, "pod": r.config.identity}}))
            .collect();
        let mut job = json!({"job_name": "myresource-operator", "static_configs": targets});
        if let Some(token) = token {
            let token_file = dir.join("token");
            std::fs::write(&token_file, token)?;
            job["scheme"] = json!("https");
            job["tls_config"] = json!({"insecure_skip_verify": true});
            job["authorization"] = json!({"type": "Bearer", "credentials_file": token_file});
        }
        let config = json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [rules_file],
            "scrape_configs": [job]
        });
        std::fs::write(
            dir.join("prometheus.yml"),
            serde_json::to_vec_pretty(&config)?,
        )?;
        let addr: std::net::SocketAddr =
            format!("127.0.0.1:{}", crate::ports::free_port()?).parse()?;
        let mut cmd = Command::new(server);
        cmd.arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"));
        let process = spawn(
            "prometheus",
            cmd,
            &dir.join("prometheus.log"),
            Lifetime::TiedToThisProcess,
        )?;
        let prometheus = Prometheus {
            addr,
            promtool,
            rules: rules_file,
            _process: ProcessGuard(process),
        };
        poll(
            &format!("Prometheus ready with {} targets up", replicas.len()),
            Duration::from_secs(60),
            || async {
                if !http_get(addr, "/-/ready")
                    .await
                    .is_ok_and(|(c, _)| c == 200)
                {
                    return Ok(None);
                }
                Ok((prometheus
                    .query("up")
                    .await?
                    .iter()
                    .filter(|s| s["value"][1] == "1")
                    .count()
                    == replicas.len())
                .then_some(()))
            },
        )
        .await?;
        Ok(prometheus)
    }

    /// An instant query; fails when Prometheus cannot parse or evaluate it.
    pub async fn query(&self, expr: &str) -> Result<Vec<Value>> {
        let doc = self
            .api(&format!("/api/v1/query?query={}", encoded(expr)))
            .await?;
        Ok(doc["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// The state of alerting rule `alert` (inactive, pending, firing) once Prometheus has
    /// evaluated it and found it healthy; `None` before.
    pub async fn alert_state(&self, alert: &str) -> Result<Option<String>> {
        let doc = self.api("/api/v1/rules?type=alert").await?;
        let rule = doc["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .find(|r| r["name"] == alert)
            .with_context(|| format!("no rule {alert} loaded: {doc}"))?;
        match rule["health"].as_str() {
            Some("ok") => Ok(rule["state"].as_str().map(String::from)),
            Some("unknown") => Ok(None),
            _ => bail!("rule {alert} is unhealthy: {rule}"),
        }
    }

    /// A GET of the HTTP API; fails unless it answers `"status": "success"`.
    async fn api(&self, path: &str) -> Result<Value> {
        let (code, body) = http_get(self.addr, path).await?;
        let doc: Value = serde_json::from_str(&body).with_context(|| format!("{code}: {body}"))?;
        if doc["status"] != "success" {
            bail!("{path} failed: {body}");
        }
        Ok(doc)
    }

    /// promtool's verdict on the rule file this Prometheus runs.
    pub fn check_rules(&self) -> Result<()> {
        run(
            Command::new(&self.promtool)
                .args(["check", "rules"])
                .arg(&self.rules),
            None,
        )?;
        Ok(())
    }
}
