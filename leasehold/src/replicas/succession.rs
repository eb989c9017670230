//! Whom a releasing leader names as its successor, so that a rolling update moves
//! leadership once, onto a Pod of the newest template (pure; [`crate::replicas`] supplies
//! the Pods).
//!
//! A leader that stops gracefully writes the released record with the successor's Pod name
//! in [`SUCCESSOR`]. The successor takes the released Lease at once; every other follower
//! stands back for one retry period while the successor is live ([`is_live`]), then takes
//! it as before. In a rolling update the Deployment deletes old Pods only, so a leader
//! that hands over to a Pod of the new template never has to move again.
//!
//! The choice:
//! - candidates are the releasing Pod's peers that are live: not being deleted, Running
//!   and Ready (their caches are synced, so they campaign at once);
//! - the newest template is the revision label (`pod-template-hash`, or
//!   `controller-revision-hash` for a StatefulSet) of the most recently created Pod that is
//!   not being deleted: throughout a rollout only the new ReplicaSet creates Pods;
//! - candidates of the newest template come first; among them, those on another node than
//!   the releasing Pod's (a leader that stops because its node is drained would otherwise
//!   hand over to a peer the same drain evicts next: two moves); then the longest-lived
//!   (earliest creation, then name), whose cache has been warm longest.
//!
//! Safety does not rest on any of this: the successor still has to win the same
//! compare-and-swap on the released record as anyone, and the others only wait. A
//! successor that dies at the wrong moment costs at most one retry period of the
//! leaderless gap, or less once its Pod shows it is no longer live.

use k8s_openapi::api::core::v1::Pod;

/// The Lease annotation naming the successor's Pod on a released record.
pub const SUCCESSOR: &str = "trstringer.com/successor";

/// Labels a workload controller puts on a Pod to name its template's revision.
const REVISION_LABELS: [&str; 2] = ["pod-template-hash", "controller-revision-hash"];

/// Whether `pod` can take over at once: not being deleted, Running and Ready.
pub fn is_live(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    pod.metadata.deletion_timestamp.is_none()
        && status.and_then(|s| s.phase.as_deref()) == Some("Running")
        && status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The successor for the Pod `releasing` among its peers `pods` (see the module doc);
/// `None` when no peer is live.
pub fn successor<'a>(pods: impl IntoIterator<Item = &'a Pod>, releasing: &str) -> Option<String> {
    let pods: Vec<&Pod> = pods.into_iter().collect();
    let own_node = pods
        .iter()
        .find(|p| name(p) == releasing)
        .and_then(|p| node(p));
    let newest = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .max_by_key(|p| (p.metadata.creation_timestamp.as_ref().map(|t| t.0), name(p)))
        .and_then(|p| revision(p));
    pods.into_iter()
        .filter(|p| name(p) != releasing && is_live(p))
        .min_by_key(|p| {
            (
                newest.is_some() && revision(p) != newest,
                own_node.is_some() && node(p) == own_node,
                p.metadata.creation_timestamp.as_ref().map(|t| t.0),
                name(p),
            )
        })
        .map(|p| name(p).to_string())
}

fn name(pod: &Pod) -> &str {
    pod.metadata.name.as_deref().unwrap_or_default()
}

fn node(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_name.as_deref()
}

fn revision(pod: &Pod) -> Option<&str> {
    let labels = pod.metadata.labels.as_ref()?;
    REVISION_LABELS
        .iter()
        .find_map(|l| labels.get(*l).map(String::as_str))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    /// A Pod named `name` of template `hash`, created at second `created`.
    fn pod(name: &str, hash: &str, created: i64, ready: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some([("pod-template-hash".to_string(), hash.to_string())].into()),
                creation_timestamp: Some(Time(
                    k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + created).unwrap(),
                )),
                ..Default::default()
            },
            status: Some(PodStatus {
                phase: Some("Running".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn on(mut pod: Pod, node: &str) -> Pod {
        pod.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            node_name: Some(node.into()),
            ..Default::default()
        });
        pod
    }

    fn deleting(mut pod: Pod) -> Pod {
        pod.metadata.deletion_timestamp = pod.metadata.creation_timestamp.clone();
        pod
    }

    #[test]
    fn a_rollout_hands_over_to_the_oldest_ready_pod_of_the_new_template() {
        let pods = [
            pod("old-a", "old", 0, true),
            pod("old-b", "old", 1, true),
            pod("new-a", "new", 100, true),
            pod("new-b", "new", 110, false),
        ];
        assert_eq!(successor(&pods, "old-a").as_deref(), Some("new-a"));
        // The leader is the last old Pod: still the new template.
        assert_eq!(successor(&pods[2..], "old-a").as_deref(), Some("new-a"));
    }

    #[test]
    fn without_a_ready_pod_of_the_new_template_the_oldest_live_peer() {
        let pods = [
            pod("old-a", "old", 0, true),
            pod("old-b", "old", 1, true),
            pod("old-c", "old", 2, true),
            pod("new-a", "new", 100, false),
        ];
        assert_eq!(successor(&pods, "old-a").as_deref(), Some("old-b"));
    }

    #[test]
    fn pods_being_deleted_neither_succeed_nor_define_the_newest_template() {
        let pods = [
            pod("a", "x", 0, true),
            pod("b", "x", 1, true),
            deleting(pod("c", "y", 100, true)),
        ];
        assert_eq!(successor(&pods, "a").as_deref(), Some("b"));
        assert_eq!(successor(&pods[..1], "a"), None);
        assert_eq!(successor([&pods[0], &pods[2]], "a"), None);
    }

    #[test]
    fn a_drained_leader_hands_over_to_a_peer_on_another_node() {
        let pods = [
            on(pod("a", "x", 0, true), "node-1"),
            on(pod("b", "x", 1, true), "node-1"),
            on(pod("c", "x", 2, true), "node-2"),
        ];
        // The drain evicts b after a: c, though younger, is the one move.
        assert_eq!(successor(&pods, "a").as_deref(), Some("c"));
        // The template still comes first (a rollout moves once), and without another
        // node the oldest peer.
        let rollout = [
            on(pod("a", "old", 0, true), "node-1"),
            on(pod("b", "new", 100, true), "node-1"),
            on(pod("c", "old", 2, true), "node-2"),
        ];
        assert_eq!(successor(&rollout, "a").as_deref(), Some("b"));
        assert_eq!(successor(&pods[..2], "a").as_deref(), Some("b"));
    }

    #[test]
    fn liveness_needs_running_and_ready() {
        assert!(is_live(&pod("a", "x", 0, true)));
        assert!(!is_live(&pod("a", "x", 0, false)));
        assert!(!is_live(&deleting(pod("a", "x", 0, true))));
        let mut pending = pod("a", "x", 0, true);
        pending.status.as_mut().unwrap().phase = Some("Pending".into());
        assert!(!is_live(&pending));
    }
}
