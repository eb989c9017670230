//! A follower's memory per cached Pod: a follower watching N labelled Pods against one
//! watching an empty namespace.

use std::time::Duration;

use anyhow::Result;
use e2e::lease::{DEFAULT_TIMINGS, wait_for_holder};
use serde_json::json;

use super::Bench;
use super::objects::create_pods;

impl Bench {
    /// A follower's memory per cached Pod: a follower watching N labelled Pods against one
    /// watching an empty namespace, side by side.
    pub(super) async fn memory_per_pod(&mut self, n: usize) -> Result<()> {
        eprintln!("==> memory per cached Pod: {n} Pods against an empty namespace");
        let pods_ns = self.namespace("bench-pods").await?;
        let empty_ns = self.namespace("bench-empty").await?;
        create_pods(&self.client, &pods_ns, n).await?;
        // A leader in each namespace, so the measured replicas are followers.
        let mut leaders = Vec::new();
        let mut followers = Vec::new();
        for ns in [&pods_ns, &empty_ns] {
            let mut leader = self.replica(ns, &format!("{ns}-leader"), &DEFAULT_TIMINGS)?;
            leader.wait_ready().await?;
            wait_for_holder(&self.client, ns, None, Duration::from_secs(60)).await?;
            leaders.push(leader);
            let mut follower = self.replica(ns, &format!("{ns}-follower"), &DEFAULT_TIMINGS)?;
            follower.wait_ready().await?;
            followers.push(follower);
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        let with_pods = followers[0].rss_bytes().unwrap_or(0) as f64;
        let empty = followers[1].rss_bytes().unwrap_or(0) as f64;
        let per_pod = (with_pods - empty) / n as f64;
        self.report.insert("rss_bytes_empty_follower", json!(empty));
        self.report.record(
            "rss_bytes_per_cached_object",
            json!(per_pod),
            format!(
                "follower memory per cached Pod: {per_pod:.0} bytes ({:.1} MiB with {n} Pods vs {:.1} MiB with none)",
                with_pods / 1048576.0,
                empty / 1048576.0
            ),
        );
        Ok(())
    }
}
