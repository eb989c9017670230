//! SIGKILL failover and SIGTERM handover: three replicas, the leader killed (or
//! terminated) again and again, and the time from the signal to the new leader's first
//! reconcile.

use std::time::Duration;

use anyhow::{Context, Result};
use e2e::lease::{Timings, wait_for_holder};
use e2e::operator::Operator;
use e2e::stats;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use super::Bench;
use super::objects::create_objects;

impl Bench {
    /// Kill (or terminate) the leader `runs` times; time from the fault to the new leader's
    /// first reconcile.
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
                "{what} at {lease}/{renew}/{retry} s, {runs} runs, signal → new leader's first reconcile: min {:.3} s, median {:.3} s, p99 {:.3} s (from the old process's exit: median {:.3} s)",
                stats["min"], stats["median"], stats["p99"], exit_stats["median"]
            ),
        );
        Ok(())
    }

    /// Three replicas in `ns`; `runs` times the leader signalled and replaced. Returns the
    /// seconds from each signal, and from each old leader's exit, to the new leader's first
    /// reconcile.
    async fn failover_runs(
        &mut self,
        ns: &str,
        kind: &str,
        runs: usize,
        timings: &Timings,
        graceful: bool,
    ) -> Result<(Vec<f64>, Vec<f64>)> {
        let lease = timings.lease_duration.as_secs();
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
            if graceful {
                replicas[leader].stop();
            } else {
                replicas[leader].kill();
            }
            let exited = Timestamp::now();
            let first =
                first_reconcile_after(&replicas, leader, fault, timings.lease_duration * 3).await?;
            samples.push(first.duration_since(fault).as_secs_f64());
            from_exit.push(first.duration_since(exited).as_secs_f64());
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

/// The earliest "reconciled" log line after `after` in any replica but `except`.
async fn first_reconcile_after(
    replicas: &[Operator],
    except: usize,
    after: Timestamp,
    limit: Duration,
) -> Result<Timestamp> {
    e2e::wait::poll("the new leader's first reconcile", limit, || {
        let found = replicas
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != except)
            .flat_map(|(_, r)| r.log_lines())
            .filter(|l| l["message"] == "reconciled")
            .filter_map(|l| {
                l["timestamp"]
                    .as_str()
                    .and_then(|t| t.parse::<Timestamp>().ok())
            })
            .filter(|t| *t > after)
            .min();
        async move { Ok(found) }
    })
    .await
}
