//! The API server's write ceiling: the writes of N reconciles made by a minimal client, as
//! fast as the API server takes them, in two halves around the operator's cold start.

use std::time::Instant;

use anyhow::Result;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use myresource_operator::resource::MyResource;
use serde_json::json;

use super::Bench;
use super::cpu::CpuSplit;

/// One phase of the ceiling: the successful writes, the wall seconds, the CPU split.
#[derive(Clone)]
pub(super) struct Phase {
    writes: usize,
    seconds: f64,
    cpu: CpuSplit,
}

/// The ceiling over both phases.
pub(super) struct Ceiling {
    before: Phase,
    after: Phase,
    pub(super) writes_per_second: f64,
    pub(super) cpu: CpuSplit,
}

impl Ceiling {
    /// Both phases as one.
    pub(super) fn of(before: Phase, after: Phase) -> Ceiling {
        let ceiling_wall = before.seconds + after.seconds;
        let writes_per_second = (before.writes + after.writes) as f64 / ceiling_wall;
        let cpu = CpuSplit::combine(&before.cpu, &after.cpu);
        Ceiling {
            before,
            after,
            writes_per_second,
            cpu,
        }
    }
}

impl Bench {
    /// The MyResources in `ns` (`n` of them) in two halves, one for each phase.
    pub(super) async fn ceiling_halves(
        &self,
        ns: &str,
        n: usize,
    ) -> Result<(Vec<MyResource>, Vec<MyResource>)> {
        let mut objects = self.ceiling_objects(ns).await?;
        let second_half = objects.split_off(n / 2);
        Ok((objects, second_half))
    }

    /// The MyResources in `ns` in parts of `size`, one for each phase.
    pub(super) async fn ceiling_parts(
        &self,
        ns: &str,
        size: usize,
    ) -> Result<Vec<Vec<MyResource>>> {
        let objects = self.ceiling_objects(ns).await?;
        Ok(objects.chunks(size.max(1)).map(<[_]>::to_vec).collect())
    }

    async fn ceiling_objects(&self, ns: &str) -> Result<Vec<MyResource>> {
        Ok(Api::<MyResource>::namespaced(self.client.clone(), ns)
            .list(&Default::default())
            .await?
            .items)
    }

    /// The ceiling's writes for `objects`.
    pub(super) async fn ceiling(
        &mut self,
        objects: Vec<MyResource>,
        concurrency: usize,
        when: &str,
    ) -> Result<Phase> {
        eprintln!(
            "==> write ceiling ({when} the operator): the writes of {} reconciles from a minimal client, {concurrency} at a time",
            objects.len()
        );
        let cpu_before = self.cpu(&[]);
        let started = Instant::now();
        let writes = ceiling_writes(&self.client, objects, concurrency).await?;
        let wall = started.elapsed().as_secs_f64();
        Ok(Phase {
            writes,
            seconds: wall,
            cpu: CpuSplit::between(&cpu_before, &self.cpu(&[]), wall),
        })
    }

    pub(super) fn record_ceiling(&mut self, n: usize, concurrency: usize, ceiling: &Ceiling) {
        let (before, after) = (&ceiling.before, &ceiling.after);
        let ceiling = ceiling.writes_per_second;
        self.report.record(
            "ceiling_writes_per_second",
            json!(ceiling),
            format!(
                "API server write ceiling (a minimal client, the writes of {n} reconciles, {concurrency} at a time, half before and half after the operator's cold start): {ceiling:.0} writes/s ({:.0} before, {:.0} after)",
                before.writes as f64 / before.seconds,
                after.writes as f64 / after.seconds
            ),
        );
    }
}

/// The writes a reconcile makes (create the ConfigMap, patch status with a resourceVersion
/// precondition, create an Event), for `n` objects, `concurrency` at a time; returns the
/// number of successful writes.
async fn ceiling_writes(
    client: &Client,
    objects: Vec<MyResource>,
    concurrency: usize,
) -> Result<usize> {
    let ns = objects
        .first()
        .and_then(|o| o.metadata.namespace.clone())
        .unwrap_or_default();
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), &ns);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let results: Vec<usize> = futures::stream::iter(objects)
        .map(|mr| {
            let (mrs, cms, events) = (mrs.clone(), cms.clone(), events.clone());
            async move {
                let desired = myresource_operator::control::reconcile::desired_configmap(&mr);
                let name = mr.metadata.name.clone().unwrap_or_default();
                cms.create(&PostParams::default(), &desired).await?;
                let status = myresource_operator::control::reconcile::desired_status(&mr, Default::default(), None, &[], Timestamp::now());
                let patch = json!({"metadata": {"resourceVersion": mr.metadata.resource_version}, "status": status});
                mrs.patch_status(&name, &Default::default(), &kube::api::Patch::Merge(&patch)).await?;
                let event: Event = serde_json::from_value(json!({
                    "metadata": {"name": format!("{name}.ceiling")},
                    "eventTime": Timestamp::now().to_string(),
                    "reportingController": "bench-ceiling", "reportingInstance": "bench",
                    "action": "Reconcile", "reason": "ConfigMapCreated", "type": "Normal",
                    "note": format!("ConfigMap {name} created"),
                    "regarding": {"apiVersion": "trstringer.com/v1", "kind": "MyResource", "name": name, "namespace": mr.metadata.namespace, "uid": mr.metadata.uid},
                }))?;
                events.create(&PostParams::default(), &event).await?;
                anyhow::Ok(3)
            }
        })
        .buffer_unordered(concurrency)
        .try_collect()
        .await?;
    Ok(results.iter().sum())
}
