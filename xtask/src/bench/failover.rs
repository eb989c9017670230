//! SIGKILL failover and SIGTERM handover: three replicas, the leader killed (or
//! terminated) again and again, and the time from the signal to a change made right after
//! it being handled (a probe object's ConfigMap carries it). The new leader's first
//! reconcile of any key would be sooner: a takeover enqueues every cached key at once.

use std::time::Duration;

use anyhow::{Context, Result};
use e2e::lease::{Timings, wait_for_holder};
use e2e::stats;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use myresource_operator::resource::MyResource;

use super::Bench;
use super::objects::{create_objects, mr};

/// The object changed right after each signal.
const PROBE: &str = "failover-probe";

impl Bench {
    /// Kill (or terminate) the leader `runs` times; time from the fault to a change made
    /// right after it handled.
    pub(super) async fn failover(
        &mut self,
        runs: usize,
        timings: Timings,
        graceful: bool,
    ) -> Result<()> {
        let (lease, renew, retry) = timings.as_secs();
        let kind = if graceful { "handover" } else { "failover" };
        eprintln!("==> {kind}: {runs} runs at {lease}/{renew}/{retry} s");
        let ns = self.namespace(&format!("bench-{kind}-{lease}")).await?;
        create_objects(&self.client, &ns, 10, false).await?;
        let (samples, from_exit) = self
            .failover_runs(&ns, kind, runs, &timings, graceful)
            .await?;
        let stats = summary_with_samples(&samples);
        let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        let exit_stats = summary_with_samples(&from_exit);
        let what = if graceful {
            "SIGTERM handover"
        } else {
            "SIGKILL failover"
        };
        self.report.record(
            &format!("{kind}_{lease}_{renew}_{retry}_seconds"),
            json!({"runs": runs, "from_signal": stats, "from_exit": exit_stats}),
            format!(
                "{what} at {lease}/{renew}/{retry} s, {runs} runs, signal → a change made right after it handled: min {:.3} s, median {:.3} s, p99 {:.3} s (from the old process's exit: median {:.3} s)",
                f(&stats["min"]), f(&stats["median"]), f(&stats["p99"]), f(&exit_stats["median"])
            ),
        );
        Ok(())
    }

    /// Three replicas in `ns`; `runs` times the leader signalled and replaced. Returns the
    /// seconds from each signal, and from each old leader's exit, to the probe's change
    /// made right after the signal being handled.
    async fn failover_runs(
        &mut self,
        ns: &str,
        kind: &str,
        runs: usize,
        timings: &Timings,
        graceful: bool,
    ) -> Result<(Vec<f64>, Vec<f64>)> {
        let lease = timings.lease_duration.as_secs();
        let mrs: Api<MyResource> = Api::namespaced(self.client.clone(), ns);
        let configmaps: Api<ConfigMap> = Api::namespaced(self.client.clone(), ns);
        mrs.create(&PostParams::default(), &mr(PROBE, 0)).await?;
        let mut replicas = Vec::new();
        for i in 0..3 {
            replicas.push(self.replica(ns, &format!("{kind}-{lease}-{i}"), timings)?);
        }
        for r in &mut replicas {
            r.wait_ready().await?;
        }
        let mut samples = Vec::new();
        let mut from_exit = Vec::new();
        for run in 0..runs {
            let holder = wait_for_holder(&self.client, ns, None, Duration::from_secs(60)).await?;
            let leader = replicas
                .iter()
                .position(|r| r.config.identity == holder)
                .context("leader is one of ours")?;
            // Let followers observe a fresh renew, as in steady state.
            tokio::time::sleep(timings.retry_period).await;
            let fault = Timestamp::now();
            let value = run as i32 + 1;
            if graceful {
                replicas[leader].process.signal(libc::SIGTERM);
            } else {
                replicas[leader].kill();
            }
            let patch = serde_json::json!({"spec": {"someValue": value}});
            mrs.patch(PROBE, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            if graceful {
                replicas[leader].stop();
            }
            let exited = Timestamp::now();
            let handled = handled(&configmaps, value, timings.lease_duration * 3).await?;
            samples.push(handled.duration_since(fault).as_secs_f64());
            from_exit.push(handled.duration_since(exited).as_secs_f64());
            let mut fresh =
                self.replica(ns, &format!("{kind}-{lease}-{}-{run}", leader), timings)?;
            fresh.wait_ready().await?;
            replicas[leader] = fresh;
        }
        Ok((samples, from_exit))
    }
}

/// [`stats::summary`] with the samples themselves.
fn summary_with_samples(samples: &[f64]) -> Value {
    let mut summary = stats::summary(samples);
    summary["samples"] = json!(samples);
    summary
}

/// When the probe's ConfigMap first carries `value` (read every 10 ms, up to `limit`).
async fn handled(configmaps: &Api<ConfigMap>, value: i32, limit: Duration) -> Result<Timestamp> {
    let deadline = std::time::Instant::now() + limit;
    let want = value.to_string();
    loop {
        let cm = configmaps.get_opt(PROBE).await?;
        if cm
            .and_then(|c| c.data)
            .is_some_and(|d| d.get("someValue") == Some(&want))
        {
            return Ok(Timestamp::now());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the probe's change {value} was not handled within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
