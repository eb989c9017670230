//! The faults of the leader's whole node in the in-cluster rotation (`chaos --in-cluster
//! --nodes 3`; docs/nodes.md), struck through [`e2e::node_faults`]: each leaves the cluster
//! whole again (healed, booted, uncordoned, three replicas Ready and settled) so the next
//! round starts as every round does.
//!
//! The round's time to a new leader is judged against [`Fault::new_leader_goal`] like any
//! other; [`goal_held`] judges what that time cannot show: a new leader on another node,
//! no takeover before the Lease ran out when nothing reported the crash, and a drain's
//! single, short handover with two replicas Ready throughout.

use std::time::Instant;

use anyhow::{Result, bail};
use e2e::cluster::{Cluster, NodeFault};
use e2e::lease::TEST_TIMINGS;
use e2e::node_faults::{DRAIN_HANDOVER_GOAL, Release};
use serde_json::{Value, json};

use super::schedule::Fault;

/// Whether `fault` restarts the containers of every Pod on the struck node (the node
/// powered off, or power-cycled after its kubelet stopped): those Pods' restarts are the
/// fault's, not findings.
pub(super) fn restarts_the_node(fault: Fault) -> bool {
    matches!(fault, Fault::NodePowerOff | Fault::NodeKubeletStopKill)
}

/// Strikes the leader's node with `fault` and brings it back; returns the round's details
/// (`struck_at` when the fault struck, for the round's clock).
pub(super) async fn strike(
    release: &Release,
    cluster: &mut Cluster,
    fault: Fault,
) -> Result<Value> {
    let details = match fault {
        Fault::NodePartition => {
            let cut = release
                .silence_the_leaders_node(cluster, NodeFault::Partition)
                .await?;
            cluster.node_fault(&cut.node, NodeFault::Heal).await?;
            json!({
                "struck_at": cut.at.to_string(),
                "node": cut.node,
                "next_node": cut.next_node,
                "new_term_seconds": cut.took.as_secs_f64(),
            })
        }
        Fault::NodePowerOff => {
            let off = release
                .silence_the_leaders_node(cluster, NodeFault::Stop)
                .await?;
            let since = Instant::now();
            release.replaced(&off.node).await?;
            let replaced = since.elapsed() + off.took;
            cluster.node_fault(&off.node, NodeFault::Start).await?;
            release.ready_pods().await?;
            json!({
                "struck_at": off.at.to_string(),
                "node": off.node,
                "next_node": off.next_node,
                "new_term_seconds": off.took.as_secs_f64(),
                "replaced_seconds": replaced.as_secs_f64(),
            })
        }
        Fault::NodeKubeletStopKill => {
            let stopped = release.stop_kubelet_then_kill_leader(cluster).await?;
            release.power_cycle(cluster, &stopped.node).await?;
            json!({
                "struck_at": stopped.at.to_string(),
                "node": stopped.node,
                "new_term_seconds": stopped.took.as_secs_f64(),
                "after_renewal_seconds": stopped.after_renewal.as_secs_f64(),
            })
        }
        Fault::NodeDrain => {
            let drained = release.drain_the_leaders_node(cluster).await?;
            release.uncordon(cluster, &drained.node)?;
            json!({
                "node": drained.node,
                "next_node": drained.next_node,
                "leadership_moves": drained.moves,
                "handover_ms": (drained.handover.as_secs_f64() * 1000.0).round(),
                "fewest_ready": drained.fewest_ready,
            })
        }
        other => bail!("{} is not a fault of a node", other.kind()),
    };
    Ok(details)
}

/// Whether a node fault's round held what its new-leader time cannot show (see the module
/// doc); true for every other kind.
pub(super) fn goal_held(kind: &str, details: &Value) -> bool {
    let elsewhere = details["next_node"].is_string() && details["next_node"] != details["node"];
    if kind == Fault::NodePartition.kind() || kind == Fault::NodePowerOff.kind() {
        elsewhere
    } else if kind == Fault::NodeKubeletStopKill.kind() {
        details["after_renewal_seconds"]
            .as_f64()
            .is_some_and(|s| s >= TEST_TIMINGS.lease_duration.as_secs_f64())
    } else if kind == Fault::NodeDrain.kind() {
        elsewhere
            && details["leadership_moves"] == 1
            && details["fewest_ready"].as_u64().is_some_and(|n| n >= 2)
            && details["handover_ms"]
                .as_f64()
                .is_some_and(|ms| ms <= DRAIN_HANDOVER_GOAL.as_secs_f64() * 1000.0)
    } else {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_round_fails_on_what_its_new_leader_time_cannot_show() {
        let partition = Fault::NodePartition.kind();
        assert!(goal_held(
            partition,
            &json!({"node": "n1", "next_node": "n2"})
        ));
        assert!(!goal_held(
            partition,
            &json!({"node": "n1", "next_node": "n1"})
        ));
        assert!(!goal_held(partition, &json!({"node": "n1"})));

        let kubelet = Fault::NodeKubeletStopKill.kind();
        let lease = TEST_TIMINGS.lease_duration.as_secs_f64();
        assert!(goal_held(
            kubelet,
            &json!({"after_renewal_seconds": lease + 0.2})
        ));
        // A takeover on a stale status, before the Lease ran out.
        assert!(!goal_held(
            kubelet,
            &json!({"after_renewal_seconds": lease - 0.2})
        ));

        let drain = Fault::NodeDrain.kind();
        let good = json!({
            "node": "n1", "next_node": "n3", "leadership_moves": 1,
            "handover_ms": 40.0, "fewest_ready": 2,
        });
        assert!(goal_held(drain, &good));
        for (field, bad) in [
            ("leadership_moves", json!(2)),
            ("handover_ms", json!(900.0)),
            ("fewest_ready", json!(1)),
            ("next_node", json!("n1")),
        ] {
            let mut details = good.clone();
            details[field] = bad;
            assert!(!goal_held(drain, &details), "{field}");
        }
        assert!(goal_held(Fault::PodDelete.kind(), &json!({})));
    }
}
