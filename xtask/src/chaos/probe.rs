//! Failover as users feel it: the time from a fault to the operator having handled a change
//! made right after it.
//!
//! A probe MyResource (in scale-out mode one per shard) is changed every [`TICK`] for the
//! whole run, its `someValue` counting up; its ConfigMap is read every [`WATCH_EVERY`]. A
//! round's failover is from the fault to the moment the ConfigMap first showed the first
//! change made after the fault (or a later one). The measure therefore includes up to one
//! tick (the wait for the next change) and one read interval: it never ends at the new
//! leader's first reconcile of some other, queued key.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Result, bail};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use kube_leasehold::scaleout::shard_key::ShardKey;
use myresource_operator::resource::{MyResource, MyResourceSpec};
use serde_json::json;

use super::NAMESPACE;

/// How often each probe is changed.
const TICK: Duration = Duration::from_millis(100);
/// How often each probe's ConfigMap is read.
const WATCH_EVERY: Duration = Duration::from_millis(25);
/// Probe objects created at most while looking for one in every shard.
const MAX_PROBES: usize = 200;

/// One probe's history: when each value was written, and when the ConfigMap first showed
/// each value it showed.
#[derive(Debug, Default)]
struct History {
    made: Vec<(i32, Timestamp)>,
    seen: Vec<(i32, Timestamp)>,
}

impl History {
    /// From `at` to the first sighting of the first value made at or after `at`.
    fn handled_after(&self, at: Timestamp) -> Option<Duration> {
        let (value, _) = self.made.iter().find(|(_, made)| *made >= at)?;
        let (_, seen) = self.seen.iter().find(|(v, _)| v >= value)?;
        Some(seen.duration_since(at).unsigned_abs())
    }
}

/// The running probes; dropping them stops their tasks.
pub(super) struct Probes {
    /// Per shard (`None` without shards), the probe's history.
    histories: BTreeMap<Option<usize>, Arc<Mutex<History>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Probes {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Probes {
    /// Creates the probe objects (one, or one per shard of `shards`) and starts changing
    /// and reading them.
    pub(super) async fn start(client: &Client, shards: Option<usize>) -> Result<Probes> {
        let mrs: Api<MyResource> = Api::namespaced(client.clone(), NAMESPACE);
        let mut names: BTreeMap<Option<usize>, String> = BTreeMap::new();
        let want = shards.unwrap_or(1);
        for i in 0..MAX_PROBES {
            if names.len() == want {
                break;
            }
            let name = format!("probe-{i}");
            let spec = MyResourceSpec {
                message: "probe".into(),
                some_value: 0,
            };
            let created = mrs
                .create(&PostParams::default(), &MyResource::new(&name, spec))
                .await?;
            let shard =
                shards.map(|s| ShardKey::new(s).shard_of_uid(&created.uid().unwrap_or_default()));
            names.entry(shard).or_insert(name);
        }
        if names.len() < want {
            bail!("no probe in every shard after {MAX_PROBES} objects: {names:?}");
        }
        let mut probes = Probes {
            histories: BTreeMap::new(),
            tasks: Vec::new(),
        };
        for (shard, name) in names {
            let history = Arc::new(Mutex::new(History::default()));
            probes.tasks.push(tokio::spawn(change(
                mrs.clone(),
                name.clone(),
                history.clone(),
            )));
            probes.tasks.push(tokio::spawn(read(
                Api::namespaced(client.clone(), NAMESPACE),
                name,
                history.clone(),
            )));
            probes.histories.insert(shard, history);
        }
        Ok(probes)
    }

    /// Waits (up to `limit`) until the probes of `struck` (all of them when empty) have
    /// each handled a change made after `at`; returns the longest time that took.
    pub(super) async fn failover(
        &self,
        at: Timestamp,
        struck: &BTreeSet<usize>,
        limit: Duration,
    ) -> Option<f64> {
        let wanted: Vec<&Arc<Mutex<History>>> = self
            .histories
            .iter()
            .filter(|(shard, _)| struck.is_empty() || shard.is_some_and(|s| struck.contains(&s)))
            .map(|(_, h)| h)
            .collect();
        e2e::wait::poll(
            "the probes to show a change made after the fault",
            limit,
            || async {
                let times: Option<Vec<Duration>> = wanted
                    .iter()
                    .map(|h| h.lock().expect("probe history lock").handled_after(at))
                    .collect();
                Ok(times.and_then(|t| t.into_iter().max()))
            },
        )
        .await
        .ok()
        .map(|d| d.as_secs_f64())
    }
}

/// Changes probe `name` every [`TICK`], recording each value and when it was written.
async fn change(mrs: Api<MyResource>, name: String, history: Arc<Mutex<History>>) {
    let mut value = 0;
    loop {
        tokio::time::sleep(TICK).await;
        value += 1;
        let at = Timestamp::now();
        let patch = json!({"spec": {"someValue": value}});
        // A change the API server refused (it is restarting, say) is not recorded: the
        // next one is.
        if mrs
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .is_ok()
        {
            history
                .lock()
                .expect("probe history lock")
                .made
                .push((value, at));
        }
    }
}

/// Reads probe `name`'s ConfigMap every [`WATCH_EVERY`], recording each new value it shows.
async fn read(cms: Api<ConfigMap>, name: String, history: Arc<Mutex<History>>) {
    let mut last = -1;
    loop {
        tokio::time::sleep(WATCH_EVERY).await;
        let Ok(Some(cm)) = cms.get_opt(&name).await else {
            continue;
        };
        let value: Option<i32> = cm
            .data
            .as_ref()
            .and_then(|d| d.get("someValue"))
            .and_then(|v| v.parse().ok());
        if let Some(value) = value.filter(|v| *v > last) {
            last = value;
            history
                .lock()
                .expect("probe history lock")
                .seen
                .push((value, Timestamp::now()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failover_ends_at_the_first_sighting_of_a_change_made_after_the_fault() {
        let t = |ms: i64| Timestamp::from_millisecond(1_767_225_600_000 + ms).unwrap();
        let history = History {
            made: vec![(1, t(0)), (2, t(100)), (3, t(200)), (4, t(300))],
            // 1 was handled before the fault; 2 (made before it) just after; 4 long after.
            seen: vec![(1, t(50)), (2, t(160)), (4, t(1_400))],
        };
        // Fault at 150 ms: the first change after it is 3 (200 ms), first shown (as 4) at
        // 1,400 ms; value 2's sighting at 160 ms does not count.
        assert_eq!(
            history.handled_after(t(150)),
            Some(Duration::from_millis(1_250))
        );
        assert_eq!(
            history.handled_after(t(350)),
            None,
            "no change after it yet"
        );
    }
}
