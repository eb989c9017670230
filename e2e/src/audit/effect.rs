//! When a write took effect, as far as the audit log can tell.
//!
//! The API server stamps `requestReceivedTimestamp` before a request waits in
//! priority-and-fairness queues or on a slow etcd, so receipt says little about when a write
//! changed anything. What does: the resourceVersion of the object the server answered with,
//! which is etcd's revision at the commit, one counter for every resource of the cluster (our
//! local cluster keeps all resources in one etcd; a cluster with `--etcd-servers-overrides`
//! would need one counter per store). So:
//!
//! - a 2xx answer carrying a resourceVersion took effect at that revision;
//! - a 2xx answer without one (a delete answered with a `Status`) took effect between its
//!   receipt and its answer;
//! - a 5xx answer, or none at all, may still have been applied: the server may commit it
//!   after the client gave up, up to the request's server-side `timeout` (or the server's
//!   default 60 s when the client set none);
//! - any other answer (4xx: a conflict, a failed precondition, a refusal) changed nothing;
//! - a write of unknown outcome that carried a resourceVersion precondition another,
//!   applied, write of the same object also carried lost that race: two writes made from
//!   the same version cannot both apply.
//!
//! Two dated writes are ordered by revision when both have one; otherwise only when one's
//! window ends before the other's begins. Anything else is "maybe concurrent", and the
//! checks treat it as the worse case.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::event::AuditEvent;

/// The API server's default request timeout: the latest a write without its own `timeout`
/// can be applied after it was received.
pub const SERVER_TIMEOUT: Duration = Duration::from_secs(60);

/// When a write took effect (or may have).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dated {
    /// etcd's revision at the commit, when the answer told it.
    pub revision: Option<u64>,
    /// The earliest the write can have taken effect.
    pub from: Timestamp,
    /// The latest.
    pub until: Timestamp,
}

impl Dated {
    /// Whether this surely took effect before `other` did.
    pub fn before(&self, other: &Dated) -> bool {
        match (self.revision, other.revision) {
            (Some(a), Some(b)) => a < b,
            _ => self.until < other.from,
        }
    }
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Applied (2xx), when.
    Applied(Dated),
    /// Maybe applied (5xx or no answer), and if so, when.
    Possibly(Dated),
    /// Applied, but changed nothing: the answer's resourceVersion is one the object already
    /// had (a server-side apply or patch that found everything as asked).
    Unchanged,
    /// Rejected (any other answer).
    Rejected,
}

impl Effect {
    /// When the write took effect, if it may have changed anything.
    pub fn dated(&self) -> Option<&Dated> {
        match self {
            Effect::Applied(d) | Effect::Possibly(d) => Some(d),
            Effect::Unchanged | Effect::Rejected => None,
        }
    }
}

/// The resourceVersion of the object an answer carried.
fn answered_revision(e: &AuditEvent) -> Option<u64> {
    e.response_object.as_ref()?["metadata"]["resourceVersion"]
        .as_str()?
        .parse()
        .ok()
}

/// The window of an event alone: from receipt to answer, or to the latest the server may
/// apply it when its outcome is unknown.
fn window(e: &AuditEvent, possibly: bool) -> (Timestamp, Timestamp) {
    let until = if possibly {
        let limit = e.timeout().unwrap_or(SERVER_TIMEOUT);
        let latest = e
            .request_received_timestamp
            .checked_add(SignedDuration::try_from(limit).unwrap_or(SignedDuration::MAX))
            .unwrap_or(Timestamp::MAX);
        latest.max(e.stage_timestamp)
    } else {
        e.stage_timestamp
    };
    (e.request_received_timestamp, until)
}

/// An object as the audit log names it (its subresources included).
type ObjectKey = (String, String, String);

/// The object a write is about: its name from the answer when there is one (a create's
/// request names none).
fn object_key(e: &AuditEvent) -> ObjectKey {
    let name = e
        .response_object
        .as_ref()
        .and_then(|o| o["metadata"]["name"].as_str())
        .unwrap_or(e.name());
    (
        e.resource().to_string(),
        e.namespace().to_string(),
        name.to_string(),
    )
}

/// The resourceVersion a write's body required the object to have.
fn precondition(e: &AuditEvent) -> Option<&str> {
    e.request_object.as_ref()?["metadata"]["resourceVersion"].as_str()
}

/// Dates writes, remembering each object's revisions so that an answer repeating one marks
/// a write that changed nothing.
#[derive(Debug, Default)]
pub struct Dater {
    /// Per object (resource/subresource-less key), the revisions answers have carried.
    seen: BTreeMap<ObjectKey, Vec<u64>>,
    /// Per object, the preconditions that applied writes carried.
    consumed: BTreeMap<ObjectKey, Vec<String>>,
}

impl Dater {
    /// A dater for the writes of `events` (it reads them all once for the preconditions
    /// applied writes consumed).
    pub fn new(events: &[AuditEvent]) -> Dater {
        let mut consumed: BTreeMap<ObjectKey, Vec<String>> = BTreeMap::new();
        for e in events.iter().filter(|e| e.is_write() && e.succeeded()) {
            if let Some(rv) = precondition(e) {
                consumed.entry(object_key(e)).or_default().push(rv.into());
            }
        }
        Dater {
            seen: BTreeMap::new(),
            consumed,
        }
    }

    /// What `e` (a write) did. Call in log order.
    pub fn effect(&mut self, e: &AuditEvent) -> Effect {
        let code = e.code();
        let possibly = code.is_none_or(|c| c >= 500);
        if !possibly && !e.succeeded() {
            return Effect::Rejected;
        }
        if possibly
            && let Some(rv) = precondition(e)
            && self
                .consumed
                .get(&object_key(e))
                .is_some_and(|c| c.iter().any(|c| c == rv))
        {
            return Effect::Rejected;
        }
        let revision = if possibly { None } else { answered_revision(e) };
        if let Some(rv) = revision {
            let seen = self.seen.entry(object_key(e)).or_default();
            // A delete answers with the object as it was; it is a change nonetheless.
            if e.verb != "delete" && seen.contains(&rv) {
                return Effect::Unchanged;
            }
            seen.push(rv);
        }
        let (from, until) = window(e, possibly);
        let dated = Dated {
            revision,
            from,
            until,
        };
        if possibly {
            Effect::Possibly(dated)
        } else {
            Effect::Applied(dated)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// A hand-built audit event: `verb` on `resource` `ns/name`, received at second
    /// `received` and answered at second `answered` of 2026-01-01T00:00, with `code` (0 for
    /// none) and the answer's resourceVersion `rv`.
    pub(crate) fn write(
        ua: &str,
        verb: &str,
        resource: &str,
        name: &str,
        (received, answered): (f64, f64),
        code: u16,
        rv: Option<u64>,
    ) -> AuditEvent {
        let at = |s: f64| {
            Timestamp::from_millisecond(1_767_225_600_000 + (s * 1000.0) as i64)
                .unwrap()
                .to_string()
        };
        let group = match resource {
            "leases" => "coordination.k8s.io",
            "myresources" => "trstringer.com",
            "events" => "events.k8s.io",
            _ => "",
        };
        serde_json::from_value(json!({
            "verb": verb, "user": {"username": "u"}, "userAgent": ua,
            "stage": "ResponseComplete",
            "objectRef": {"resource": resource, "namespace": "ns", "name": name, "apiGroup": group},
            "responseStatus": if code == 0 { Value::Null } else { json!({"code": code}) },
            "requestReceivedTimestamp": at(received), "stageTimestamp": at(answered),
            "responseObject": rv.map(|rv| json!({"metadata": {"name": name, "resourceVersion": rv.to_string()}})),
        }))
        .unwrap()
    }

    #[test]
    fn answers_date_writes() {
        let mut dater = Dater::default();
        let applied = write("a", "patch", "configmaps", "x", (1.0, 2.0), 200, Some(10));
        let Effect::Applied(d) = dater.effect(&applied) else {
            panic!("applied");
        };
        assert_eq!(d.revision, Some(10));
        // The same revision again: the apply changed nothing.
        let again = write("a", "patch", "configmaps", "x", (3.0, 3.1), 200, Some(10));
        assert_eq!(dater.effect(&again), Effect::Unchanged);
        let conflict = write("a", "patch", "configmaps", "x", (3.0, 3.1), 409, None);
        assert_eq!(dater.effect(&conflict), Effect::Rejected);
        // A 504 may have been applied up to its timeout; one without status up to 60 s.
        let mut timed_out = write("a", "patch", "configmaps", "x", (4.0, 5.0), 504, None);
        timed_out.request_uri = "/api/v1/namespaces/ns/configmaps/x?timeout=2500ms".into();
        let Effect::Possibly(d) = dater.effect(&timed_out) else {
            panic!("possibly");
        };
        assert_eq!(
            d.until.duration_since(d.from),
            SignedDuration::from_millis(2500)
        );
        let lost = write("a", "patch", "configmaps", "x", (4.0, 4.0), 0, None);
        let Effect::Possibly(d) = dater.effect(&lost) else {
            panic!("possibly");
        };
        assert_eq!(
            d.until.duration_since(d.from),
            SignedDuration::from_secs(60)
        );
    }

    #[test]
    fn a_write_of_unknown_outcome_loses_to_an_applied_one_from_the_same_version() {
        let body = |rv: &str| Some(json!({"metadata": {"resourceVersion": rv}}));
        let mut won = write("b", "update", "leases", "n", (1.0, 1.1), 200, Some(8));
        won.request_object = body("7");
        let mut lost = write("a", "update", "leases", "n", (1.0, 2.0), 0, None);
        lost.request_object = body("7");
        let mut other = lost.clone();
        other.request_object = body("8");
        let events = [won.clone(), lost.clone(), other.clone()];
        let mut dater = Dater::new(&events);
        assert!(matches!(dater.effect(&won), Effect::Applied(_)));
        assert_eq!(dater.effect(&lost), Effect::Rejected);
        assert!(matches!(dater.effect(&other), Effect::Possibly(_)));
    }

    #[test]
    fn revisions_order_writes_that_receipt_would_order_the_other_way() {
        // Received first, committed last (queued inside the server).
        let slow = Dated {
            revision: Some(30),
            from: "2026-01-01T00:00:00Z".parse().unwrap(),
            until: "2026-01-01T00:00:09Z".parse().unwrap(),
        };
        let quick = Dated {
            revision: Some(20),
            from: "2026-01-01T00:00:05Z".parse().unwrap(),
            until: "2026-01-01T00:00:05Z".parse().unwrap(),
        };
        assert!(quick.before(&slow));
        assert!(!slow.before(&quick));
        // Without a revision, only disjoint windows are ordered.
        let unknown = Dated {
            revision: None,
            ..slow
        };
        assert!(!quick.before(&unknown) && !unknown.before(&quick));
    }
}
