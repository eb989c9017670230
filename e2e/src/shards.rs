//! Scale-out mode as tests, chaos and bench see it: who holds which shard Lease, whose
//! caches are warm for what, when the group is steady, and what the audit log says about
//! each shard (its terms, LISTs at a takeover); the fencing check per shard is
//! [`crate::audit::fencing`]'s.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use kube_leasehold::scaleout::assignment::{self, View};
use kube_leasehold::scaleout::membership::{GROUP_LABEL, WARM_ANNOTATION, shard_lease};
use kube_leasehold::scaleout::shard_key::ShardKey;
use myresource_operator::resource::MyResource;

use crate::audit::{self, Acquisition, AuditEvent, Fences};
use crate::wait::poll;

/// The group's (base Lease's) name: the operator's default `--lease-name`.
pub const GROUP: &str = crate::lease::NAME;

/// The group as its Leases show it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Per shard, its holder ("" when released, or absent).
    pub holders: Vec<String>,
    /// Members (by identity) and the shards their caches have listed.
    pub warm: BTreeMap<String, BTreeSet<usize>>,
}

impl Snapshot {
    /// The shards `identity` holds.
    pub fn held_by(&self, identity: &str) -> BTreeSet<usize> {
        (0..self.holders.len())
            .filter(|i| self.holders[*i] == identity)
            .collect()
    }

    /// Whether exactly `live` hold every shard, fairly, and each has listed every shard
    /// the plan gives it (so every takeover would need no LIST).
    pub fn steady(&self, live: &[&str], standbys: usize) -> bool {
        let members: BTreeSet<String> = live.iter().map(|s| s.to_string()).collect();
        if self.holders.iter().any(|h| !members.contains(h)) {
            return false;
        }
        let shards = self.holders.len();
        let fair = |n: usize| n == shards / live.len() || n == shards.div_ceil(live.len());
        if !live.iter().all(|m| fair(self.held_by(m).len())) {
            return false;
        }
        let view = View {
            members: members.clone(),
            holders: self.holders.iter().cloned().map(Some).collect(),
        };
        let plan = assignment::plan(&view, standbys);
        live.iter().all(|m| {
            plan.led_by(m) == self.held_by(m)
                && self
                    .warm
                    .get(*m)
                    .is_some_and(|w| plan.cached_by(m).is_subset(w))
        })
    }
}

/// Reads the group's Leases in `namespace`.
pub async fn snapshot(client: &Client, namespace: &str, shards: usize) -> Result<Snapshot> {
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let leases = api
        .list(&ListParams::default().labels(&format!("{GROUP_LABEL}={GROUP}")))
        .await?;
    let holder = |l: &Lease| {
        l.spec
            .as_ref()
            .and_then(|s| s.holder_identity.clone())
            .unwrap_or_default()
    };
    let mut snapshot = Snapshot {
        holders: vec![String::new(); shards],
        warm: BTreeMap::new(),
    };
    for lease in &leases {
        let name = lease.name_any();
        if let Some(i) = (0..shards).find(|i| shard_lease(GROUP, *i) == name) {
            snapshot.holders[i] = holder(lease);
        } else if let Some(warm) = lease.annotations().get(WARM_ANNOTATION) {
            let shards = warm.split(',').filter_map(|s| s.parse().ok()).collect();
            snapshot.warm.insert(holder(lease), shards);
        }
    }
    Ok(snapshot)
}

/// Waits until exactly `live` hold every shard fairly and are warm for their plan.
pub async fn wait_steady(
    client: &Client,
    namespace: &str,
    shards: usize,
    live: &[&str],
    limit: Duration,
) -> Result<Snapshot> {
    let what = format!("the shards to settle on {live:?}");
    poll(&what, limit, || async {
        let s = snapshot(client, namespace, shards).await?;
        Ok(s.steady(live, 1).then_some(s))
    })
    .await
}

/// Every MyResource's shard, by name.
pub async fn shard_by_name(
    client: &Client,
    namespace: &str,
    key: ShardKey,
) -> Result<BTreeMap<String, usize>> {
    let api: Api<MyResource> = Api::namespaced(client.clone(), namespace);
    Ok(api
        .list(&ListParams::default())
        .await?
        .into_iter()
        .filter_map(|mr| Some((mr.name_any(), key.shard_of_uid(&mr.uid()?))))
        .collect())
}

/// The fences of the group's shard Leases in `namespace`, for [`audit::check`].
pub fn fences(namespace: &str, shards: usize) -> Fences {
    Fences::shards(namespace, GROUP, shards)
}

/// Each shard Lease's terms, from the audit log.
pub fn terms(events: &[AuditEvent], namespace: &str, shards: usize) -> Vec<Vec<Acquisition>> {
    (0..shards)
        .map(|i| audit::acquisitions(events, namespace, &shard_lease(GROUP, i)))
        .collect()
}

/// Percent-decodes a request URI (`+` as a space, as form encoding writes it).
fn decoded(uri: &str) -> String {
    let bytes = uri.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// LISTs of shard `shard`'s objects (its ConfigMaps by bucket label, its MyResources by
/// `shardSelector`) made by `replica` in `[from, until]`.
pub fn shard_lists<'a>(
    events: &'a [AuditEvent],
    key: ShardKey,
    shard: usize,
    replica: &str,
    from: Timestamp,
    until: Timestamp,
) -> Vec<&'a AuditEvent> {
    let buckets = key.bucket_selector(shard);
    let range = key.selector(shard);
    events
        .iter()
        .filter(|e| e.verb == "list" && e.replica() == Some(replica))
        .filter(|e| (from..=until).contains(&e.request_received_timestamp))
        .filter(|e| {
            let uri = decoded(&e.request_uri);
            uri.contains(&buckets) || uri.contains(&range)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_uris_are_decoded() {
        assert_eq!(
            decoded("/api/v1/configmaps?labelSelector=a%3Db%2Cc+in+%280a%29"),
            "/api/v1/configmaps?labelSelector=a=b,c in (0a)"
        );
        assert_eq!(decoded("100%"), "100%");
    }

    #[test]
    fn a_steady_group_is_fair_planned_and_warm() {
        let holders: Vec<String> = ["a", "a", "b", "b"].map(String::from).into();
        let mut s = Snapshot {
            holders,
            warm: BTreeMap::new(),
        };
        assert!(!s.steady(&["a", "b"], 1), "nobody warm");
        s.warm.insert("a".into(), (0..4).collect());
        s.warm.insert("b".into(), (0..4).collect());
        assert!(s.steady(&["a", "b"], 1));
        assert!(!s.steady(&["a", "b", "c"], 1), "c holds nothing");
    }
}
