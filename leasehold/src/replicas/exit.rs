//! Proof from the Pod lifecycle that the Lease holder's process has exited, so a follower
//! may take over at once instead of waiting out the lease (pure, but for
//! [`announce_instance`]; the follower's watch of the holder's Pod feeds it).
//!
//! Each process in a Pod picks a random *instance* token at start and writes it to its
//! container's termination message file ([`TERMINATION_LOG`]). When the container ends,
//! its node's kubelet copies that file into the container's terminated state (and, once
//! restarted, its `lastState`); a new container instance gets a new, empty file. The holder
//! writes its Pod's uid and its instance on every Lease write ([`Holder`]). A follower
//! takes the current record's term as ended when the holder's Pod — the one with that uid,
//! by name and uid — reports a termination of a container whose message names that
//! instance (the token is random per process, so only the holder's container's can):
//! exactly the process that wrote the record has exited. A running container whose last
//! termination names it has been restarted ([`Exit::Restarted`]); a restarted process
//! never continues a record it did not write (see [`crate::election`]).
//!
//! No clock is compared: not the record's `acquireTime`, not the container's `startedAt`
//! or `finishedAt`, so a clock stepped back on the holder's node cannot make a live holder
//! look restarted. Nothing else counts: not a Pod being deleted (its process may still run,
//! and a graceful stop releases the Lease anyway), not a Pod gone from the API (a
//! force-deleted Pod's container may still run), not a stale status (a node that stopped
//! reporting shows the holder still running), not a termination of an earlier or later
//! instance (two restarts in quick succession leave only the later one in `lastState`:
//! the proof is withheld and the follower waits for the lease to expire, as it does
//! without a proof). The proof trusts whoever may write the Pod's status — the node's
//! kubelet, and anyone granted `pods/status` — as the whole cluster does.
//!
//! What about requests the dead process had already sent? They are bounded by
//! [`crate::fence::MAX_WRITE_TIME`], which the follower waits out from the moment it saw
//! the proof ([`crate::election`]); every write also carries a precondition.

use k8s_openapi::api::core::v1::{ContainerState, Pod};
use kube::ResourceExt;

/// The Lease annotation naming the holder Pod's uid.
pub const HOLDER_UID: &str = "trstringer.com/holder-pod-uid";
/// The Lease annotation naming the holder process's instance token.
pub const HOLDER_INSTANCE: &str = "trstringer.com/holder-instance";

/// Where the kubelet mounts the container's termination message file (the default
/// `terminationMessagePath`, which the chart states).
pub const TERMINATION_LOG: &str = "/dev/termination-log";

/// What the termination message says before the instance token (its first user's name,
/// kept so that replicas of its earlier releases and of this crate read each other).
const INSTANCE_PREFIX: &str = "myresource-operator instance ";

/// The termination message that announces the instance `token` (what
/// [`announce_instance`] writes; a simulated kubelet reports the same).
pub fn termination_message(token: &str) -> String {
    format!("{INSTANCE_PREFIX}{token}\n")
}

/// Picks this process's instance token and writes it to the termination message file at
/// `path`. Without it (an error) this process offers no crash proof: followers wait for
/// the lease to expire.
pub fn announce_instance(path: &str) -> Result<String, String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .map_err(|e| format!("reading /dev/urandom: {e}"))?;
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(path, termination_message(&token))
        .map_err(|e| format!("writing {path}: {e}"))?;
    Ok(token)
}

/// Who wrote a Lease, as its annotations say: the Pod's uid and the process's instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The holder's Pod's uid (annotation [`HOLDER_UID`]).
    pub pod_uid: String,
    /// The holder's process's instance token (annotation [`HOLDER_INSTANCE`]).
    pub instance: String,
}

impl Holder {
    /// The holder an object's annotations name, if they name both parts.
    pub fn of(object: &impl ResourceExt) -> Option<Holder> {
        let annotations = object.annotations();
        Some(Holder {
            pod_uid: annotations.get(HOLDER_UID)?.clone(),
            instance: annotations.get(HOLDER_INSTANCE)?.clone(),
        })
    }
}

/// How the holder's process was seen to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Its container terminated (and has not been restarted yet).
    Terminated,
    /// Its container was restarted: a later instance runs.
    Restarted,
}

impl Exit {
    /// The word for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Exit::Terminated => "terminated",
            Exit::Restarted => "restarted",
        }
    }
}

/// Whether `pod` proves that the process `holder` of the Pod named `name` has exited; see
/// the module doc.
pub fn exited(name: &str, holder: Option<&Holder>, pod: &Pod) -> Option<Exit> {
    let holder = holder?;
    if name.is_empty()
        || pod.metadata.name.as_deref() != Some(name)
        || pod.metadata.uid.as_deref() != Some(holder.pod_uid.as_str())
    {
        return None;
    }
    let ended = |state: Option<&ContainerState>| {
        state
            .and_then(|s| s.terminated.as_ref())
            .and_then(|t| t.message.as_deref())
            .is_some_and(|m| {
                m.lines()
                    .any(|l| l.strip_prefix(INSTANCE_PREFIX) == Some(holder.instance.as_str()))
            })
    };
    // The holder's container is the one whose termination names its instance: the token is
    // random per process, so no other container's can.
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    statuses.iter().find_map(|status| {
        let state = status.state.as_ref();
        if ended(state) {
            Some(Exit::Terminated)
        } else if ended(status.last_state.as_ref()) {
            Some(match state.and_then(|s| s.running.as_ref()) {
                Some(_) => Exit::Restarted,
                None => Exit::Terminated,
            })
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn holder() -> Holder {
        Holder {
            pod_uid: "u".into(),
            instance: "i1".into(),
        }
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

    fn terminated(instance: &str) -> serde_json::Value {
        json!({"terminated": {"exitCode": 137, "finishedAt": "2026-12-03T10:00:09Z",
            "message": format!("{INSTANCE_PREFIX}{instance}\n")}})
    }

    #[test]
    fn the_holders_own_termination_proves_the_exit() {
        let h = holder();
        let p = pod("p", "u", terminated("i1"), json!({}));
        assert_eq!(exited("p", Some(&h), &p), Some(Exit::Terminated));
        // Waiting to restart after that termination: still no process.
        let waiting = json!({"waiting": {"reason": "CrashLoopBackOff"}});
        let p = pod("p", "u", waiting, terminated("i1"));
        assert_eq!(exited("p", Some(&h), &p), Some(Exit::Terminated));
        // Restarted: a later instance runs.
        let running = json!({"running": {"startedAt": "2026-12-03T10:00:10Z"}});
        let p = pod("p", "u", running, terminated("i1"));
        assert_eq!(exited("p", Some(&h), &p), Some(Exit::Restarted));
    }

    /// Issue 30, hole 5: the old proof compared the record's acquireTime with the
    /// container's startedAt and finishedAt; a clock stepped back on the holder's node (or a
    /// patched status) made a live holder look restarted. Only the instance's own
    /// termination counts now.
    #[test]
    fn no_clock_and_no_other_instance_makes_a_proof() {
        let h = holder();
        // Started "after" any acquireTime by the node's clock: the holder may be this one.
        let running = json!({"running": {"startedAt": "2099-01-01T00:00:00Z"}});
        assert_eq!(
            exited("p", Some(&h), &pod("p", "u", running.clone(), json!({}))),
            None
        );
        // An earlier instance's termination, or one without a message.
        assert_eq!(
            exited("p", Some(&h), &pod("p", "u", running, terminated("i0"))),
            None
        );
        let silent = json!({"terminated": {"exitCode": 137, "finishedAt": "2099-01-01T00:00:00Z"}});
        assert_eq!(
            exited("p", Some(&h), &pod("p", "u", silent, json!({}))),
            None
        );
        // Two restarts: lastState shows the later instance only; the proof is withheld.
        let again = json!({"running": {"startedAt": "2026-12-03T10:00:20Z"}});
        assert_eq!(
            exited("p", Some(&h), &pod("p", "u", again, terminated("i2"))),
            None
        );
    }

    /// With a sidecar, the holder's container is the one whose termination names the
    /// instance, whatever its name; a sidecar's termination proves nothing.
    #[test]
    fn in_a_pod_with_a_sidecar_only_the_holders_container_counts() {
        let h = holder();
        let running = json!({"running": {"startedAt": "2026-12-03T10:00:10Z"}});
        let with = |app: serde_json::Value, sidecar: serde_json::Value| -> Pod {
            let status = |name: &str, state| {
                json!({"name": name, "image": "i", "imageID": "", "ready": false,
                    "restartCount": 0, "state": state, "lastState": {}})
            };
            serde_json::from_value(json!({
                "metadata": {"name": "p", "uid": "u"},
                "status": {"containerStatuses": [status("proxy", sidecar), status("app", app)]}
            }))
            .unwrap()
        };
        let sidecar_died = json!({"terminated": {"exitCode": 1, "finishedAt": "2026-12-03T10:00:09Z",
            "message": "proxy crashed"}});
        assert_eq!(
            exited("p", Some(&h), &with(running, sidecar_died.clone())),
            None
        );
        assert_eq!(
            exited("p", Some(&h), &with(terminated("i1"), sidecar_died)),
            Some(Exit::Terminated)
        );
    }

    #[test]
    fn nothing_else_is_a_proof() {
        let h = holder();
        // Another Pod of the same name (a new uid), another Pod, no holder on the Lease, a
        // released record.
        assert_eq!(
            exited("p", Some(&h), &pod("p", "v", terminated("i1"), json!({}))),
            None
        );
        assert_eq!(
            exited("p", Some(&h), &pod("q", "u", terminated("i1"), json!({}))),
            None
        );
        assert_eq!(
            exited("p", None, &pod("p", "u", terminated("i1"), json!({}))),
            None
        );
        assert_eq!(
            exited("", Some(&h), &pod("", "u", terminated("i1"), json!({}))),
            None
        );
        // Waiting for the first start (no termination), or a Pod being deleted but running.
        let creating = json!({"waiting": {"reason": "ContainerCreating"}});
        assert_eq!(
            exited("p", Some(&h), &pod("p", "u", creating, json!({}))),
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
        assert_eq!(exited("p", Some(&h), &deleting), None);
    }

    #[test]
    fn the_instance_is_announced_in_the_termination_message() {
        let dir = std::env::temp_dir().join(format!("mro-crash-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("termination-log");
        let path = path.to_str().unwrap();
        let token = announce_instance(path).unwrap();
        assert_eq!(token.len(), 32);
        assert_ne!(
            announce_instance(path).unwrap(),
            token,
            "a new token each time"
        );
        let message = std::fs::read_to_string(path).unwrap();
        let p = pod(
            "p",
            "u",
            json!({"terminated": {"exitCode": 0, "message": message}}),
            json!({}),
        );
        let h = Holder {
            pod_uid: "u".into(),
            instance: token,
        };
        assert_eq!(
            exited("p", Some(&h), &p),
            None,
            "the earlier token was overwritten"
        );
        let h = Holder {
            pod_uid: "u".into(),
            instance: message.trim().rsplit(' ').next().unwrap().into(),
        };
        assert_eq!(exited("p", Some(&h), &p), Some(Exit::Terminated));
        assert!(announce_instance(dir.join("missing/x").to_str().unwrap()).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
