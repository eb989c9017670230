//! Proof from the Pod lifecycle that the Lease holder's process has exited, so a follower
//! may take over at once instead of waiting out the lease (pure; the follower's watch of
//! the holder's Pod feeds it).
//!
//! The holder writes its Pod's uid on the Lease ([`HOLDER_UID`]). A follower takes the
//! current record's term as ended when the holder's Pod — the one with that uid, by name
//! and uid — reports its operator container as:
//! - terminated (or waiting to restart after a termination) at or after the term's
//!   `acquireTime`: the instance running when the term began has exited, and no instance
//!   runs now; or
//! - running, but started after the term's `acquireTime`: the instance that began the term
//!   has exited (a container's instances run one after another) and the running one did not
//!   write this record (a restarted process never continues a record it did not write; see
//!   [`crate::election`]).
//!
//! Both compare two times of the holder's own node: `acquireTime` is written by the holder
//! process, `startedAt` and `finishedAt` by its node's container runtime; the kubelet's
//! one-second resolution only ever withholds a proof (a later truncated time is still
//! later). Nothing else counts: not a Pod being deleted (its process may still run, and a
//! graceful stop releases the Lease anyway), not a Pod gone from the API (a force-deleted
//! Pod's container may still run), not a stale status (a node that stopped reporting shows
//! the holder still running). Without a proof the follower waits for the lease to expire,
//! as before.
//!
//! What about requests the dead process had already sent? The API server received them
//! before the process died (on a working node network, what a process wrote before it died
//! is delivered at once), so they belong to the old term, and every write carries a
//! resourceVersion precondition: one still being processed when the new leader writes the
//! same object cannot overwrite the new leader's write. A request held back in a dead
//! process's socket buffer by a broken network could arrive later; lease expiry bounds
//! that no better (TCP retransmits for minutes), and the precondition keeps it harmless.

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::api::core::v1::{ContainerState, Pod};

/// The Lease annotation naming the holder Pod's uid.
pub const HOLDER_UID: &str = "trstringer.com/holder-pod-uid";

/// The container that runs the operator in the chart's Pods (when a Pod has several).
pub const CONTAINER: &str = "operator";

/// How the holder's process was seen to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Its container terminated (and has not been restarted yet).
    Terminated,
    /// Its container was restarted: the running instance started after the term began.
    Restarted,
}

impl Exit {
    pub fn as_str(self) -> &'static str {
        match self {
            Exit::Terminated => "terminated",
            Exit::Restarted => "restarted",
        }
    }
}

/// Whether `pod` proves that the process that began the term of `record` (written with
/// `holder_uid`) has exited; see the module doc.
pub fn exited(record: &LeaseSpec, holder_uid: Option<&str>, pod: &Pod) -> Option<Exit> {
    let holder = record
        .holder_identity
        .as_deref()
        .filter(|h| !h.is_empty())?;
    let acquired = record.acquire_time.as_ref()?.0;
    if pod.metadata.name.as_deref() != Some(holder)
        || holder_uid.is_none()
        || pod.metadata.uid.as_deref() != holder_uid
    {
        return None;
    }
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    let status = match statuses.as_slice() {
        [only] => only,
        several => several.iter().find(|s| s.name == CONTAINER)?,
    };
    let state = status.state.as_ref()?;
    let finished_since = |state: Option<&ContainerState>| {
        state
            .and_then(|s| s.terminated.as_ref())
            .and_then(|t| t.finished_at.as_ref())
            .is_some_and(|finished| finished.0 >= acquired)
    };
    if let Some(running) = &state.running {
        let started = running.started_at.as_ref()?.0;
        return (started > acquired).then_some(Exit::Restarted);
    }
    let ended = finished_since(Some(state))
        || (state.waiting.is_some() && finished_since(status.last_state.as_ref()));
    ended.then_some(Exit::Terminated)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(acquired: &str) -> LeaseSpec {
        serde_json::from_value(json!({
            "holderIdentity": "p", "acquireTime": acquired, "leaseDurationSeconds": 15
        }))
        .unwrap()
    }

    fn pod(name: &str, uid: &str, state: serde_json::Value, last: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "uid": uid},
            "status": {"containerStatuses": [{
                "name": "operator", "image": "i", "imageID": "", "ready": false,
                "restartCount": 1, "state": state, "lastState": last,
            }]}
        }))
        .unwrap()
    }

    const ACQUIRED: &str = "2026-12-03T10:00:05.500000Z";

    #[test]
    fn a_termination_after_the_term_began_proves_the_exit() {
        let r = record(ACQUIRED);
        let terminated = |at: &str| json!({"terminated": {"exitCode": 137, "finishedAt": at, "startedAt": "2026-12-03T10:00:00Z"}});
        let p = pod("p", "u", terminated("2026-12-03T10:00:09Z"), json!({}));
        assert_eq!(exited(&r, Some("u"), &p), Some(Exit::Terminated));
        // Waiting to restart after that termination: still no process.
        let waiting = json!({"waiting": {"reason": "CrashLoopBackOff"}});
        let p = pod(
            "p",
            "u",
            waiting.clone(),
            terminated("2026-12-03T10:00:09Z"),
        );
        assert_eq!(exited(&r, Some("u"), &p), Some(Exit::Terminated));
        // A termination from before the term (the status predates the term's instance):
        // the instance that began the term may be running. Same second: no proof either.
        let p = pod("p", "u", terminated("2026-12-03T10:00:04Z"), json!({}));
        assert_eq!(exited(&r, Some("u"), &p), None);
        let p = pod("p", "u", waiting, terminated("2026-12-03T10:00:05Z"));
        assert_eq!(exited(&r, Some("u"), &p), None);
    }

    #[test]
    fn an_instance_started_after_the_term_began_proves_a_restart() {
        let r = record(ACQUIRED);
        let running = |at: &str| json!({"running": {"startedAt": at}});
        let p = pod("p", "u", running("2026-12-03T10:00:07Z"), json!({}));
        assert_eq!(exited(&r, Some("u"), &p), Some(Exit::Restarted));
        // Started before (or in the same second as) the term: it may be the holder.
        let p = pod("p", "u", running("2026-12-03T10:00:05Z"), json!({}));
        assert_eq!(exited(&r, Some("u"), &p), None);
    }

    #[test]
    fn nothing_else_is_a_proof() {
        let r = record(ACQUIRED);
        let terminated =
            json!({"terminated": {"exitCode": 137, "finishedAt": "2026-12-03T10:00:09Z"}});
        // Another Pod of the same name (a new uid), another Pod, no uid on the Lease.
        assert_eq!(
            exited(&r, Some("u"), &pod("p", "v", terminated.clone(), json!({}))),
            None
        );
        assert_eq!(
            exited(&r, Some("u"), &pod("q", "u", terminated.clone(), json!({}))),
            None
        );
        assert_eq!(
            exited(&r, None, &pod("p", "u", terminated.clone(), json!({}))),
            None
        );
        // A released record, or one without an acquireTime.
        let mut released = r.clone();
        released.holder_identity = Some(String::new());
        assert_eq!(
            exited(
                &released,
                Some("u"),
                &pod("p", "u", terminated.clone(), json!({}))
            ),
            None
        );
        let mut undated = r.clone();
        undated.acquire_time = None;
        assert_eq!(
            exited(&undated, Some("u"), &pod("p", "u", terminated, json!({}))),
            None
        );
        // Waiting for the first start (no termination), or a Pod being deleted but running.
        let creating = json!({"waiting": {"reason": "ContainerCreating"}});
        assert_eq!(
            exited(&r, Some("u"), &pod("p", "u", creating, json!({}))),
            None
        );
        let mut deleting = pod(
            "p",
            "u",
            json!({"running": {"startedAt": "2026-12-03T10:00:00Z"}}),
            json!({}),
        );
        deleting.metadata.deletion_timestamp =
            serde_json::from_value(json!("2026-12-03T10:00:08Z")).ok();
        assert!(deleting.metadata.deletion_timestamp.is_some());
        assert_eq!(exited(&r, Some("u"), &deleting), None);
    }
}
