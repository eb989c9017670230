//! Reading the apiserver's audit log (JSON lines, `audit.k8s.io/v1` Event).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;

/// The fields of an audit event the tests read.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEvent {
    pub verb: String,
    pub user: User,
    #[serde(default)]
    pub user_agent: String,
    #[serde(default)]
    pub object_ref: Option<ObjectRef>,
    #[serde(default)]
    pub response_status: Option<ResponseStatus>,
    pub stage: String,
    /// The path and query as the client sent them.
    #[serde(default, rename = "requestURI")]
    pub request_uri: String,
    pub request_received_timestamp: Timestamp,
    pub stage_timestamp: Timestamp,
    /// The request body (Lease writes only, see the audit policy).
    #[serde(default)]
    pub request_object: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct User {
    /// Empty for a request that failed authentication (401).
    #[serde(default)]
    pub username: String,
    #[serde(default)]
    pub groups: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectRef {
    #[serde(default)]
    pub resource: String,
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub api_group: String,
    #[serde(default)]
    pub subresource: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ResponseStatus {
    #[serde(default)]
    pub code: u16,
}

impl AuditEvent {
    /// Whether the request changed (or tried to change) state.
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }

    /// Whether the request succeeded (2xx).
    pub fn succeeded(&self) -> bool {
        self.response_status
            .as_ref()
            .is_some_and(|s| (200..300).contains(&s.code))
    }

    /// The operator replica that made the request, from its user agent
    /// `myresource-operator/VERSION (IDENTITY)`.
    pub fn replica(&self) -> Option<&str> {
        let rest = self.user_agent.strip_prefix("myresource-operator/")?;
        let (_, identity) = rest.split_once(" (")?;
        identity.strip_suffix(')')
    }

    /// The resource, or "" when absent.
    pub fn resource(&self) -> &str {
        self.object_ref.as_ref().map_or("", |o| o.resource.as_str())
    }

    /// The object's namespace, or "" when cluster-scoped or absent.
    pub fn namespace(&self) -> &str {
        self.object_ref
            .as_ref()
            .map_or("", |o| o.namespace.as_str())
    }
}

/// Every completed event in the log (`ResponseComplete` stage).
pub fn read(path: &Path) -> Result<Vec<AuditEvent>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut events = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let event: AuditEvent =
            serde_json::from_str(line).with_context(|| format!("parsing audit line {line}"))?;
        if event.stage == "ResponseComplete" {
            events.push(event);
        }
    }
    Ok(events)
}

/// A replica's successful Lease write that changed the holder: the start of a term.
#[derive(Debug, Clone, PartialEq)]
pub struct Acquisition {
    pub holder: String,
    pub at: Timestamp,
}

/// The terms of the Lease `namespace/name`, in order: every successful write by a replica
/// whose holder differs from the previous such write's ("" for a release). Foreign writes
/// (a deleted Lease, a holder cleared by another client, relabelling) start no term: they
/// do not stop the holder from believing it leads; the next replica's acquisition does.
pub fn acquisitions(events: &[AuditEvent], namespace: &str, name: &str) -> Vec<Acquisition> {
    let mut terms: Vec<Acquisition> = Vec::new();
    let mut writes: Vec<&AuditEvent> = events
        .iter()
        .filter(|e| e.is_write() && e.succeeded() && e.resource() == "leases")
        .filter(|e| e.replica().is_some())
        .filter(|e| {
            e.namespace() == namespace && e.object_ref.as_ref().is_some_and(|o| o.name == name)
        })
        .collect();
    writes.sort_by_key(|e| e.stage_timestamp);
    for e in writes {
        let holder = e
            .request_object
            .as_ref()
            .and_then(|o| o["spec"]["holderIdentity"].as_str())
            .unwrap_or_default()
            .to_string();
        if terms.last().is_none_or(|t| t.holder != holder) {
            terms.push(Acquisition {
                holder,
                at: e.stage_timestamp,
            });
        }
    }
    terms
}

/// How leadership moved over a span of terms (a rollout's, say).
#[derive(Debug, Clone, PartialEq)]
pub struct Handovers {
    /// Terms begun by a replica (releases not counted).
    pub moves: usize,
    /// The longest time from a release to the next acquisition.
    pub longest_gap: Duration,
    /// The holder at the end ("" when released).
    pub last_holder: String,
}

/// The handovers among `terms` (from [`acquisitions`]) begun at or after `from`.
pub fn handovers(terms: &[Acquisition], from: Timestamp) -> Handovers {
    let longest_gap = release_gaps(terms, from, Timestamp::MAX)
        .into_iter()
        .max()
        .unwrap_or_default();
    let terms: Vec<&Acquisition> = terms.iter().filter(|t| t.at >= from).collect();
    Handovers {
        moves: terms.iter().filter(|t| !t.holder.is_empty()).count(),
        longest_gap,
        last_holder: terms.last().map(|t| t.holder.clone()).unwrap_or_default(),
    }
}

/// For each release among `terms` (from [`acquisitions`]) made in `[from, until]` and
/// followed by an acquisition: the time from the release to that acquisition (a graceful
/// handover's leaderless gap, on the API server's clock).
pub fn release_gaps(terms: &[Acquisition], from: Timestamp, until: Timestamp) -> Vec<Duration> {
    terms
        .windows(2)
        .filter(|w| w[0].holder.is_empty() && !w[1].holder.is_empty())
        .filter(|w| (from..=until).contains(&w[0].at))
        .map(|w| w[1].at.duration_since(w[0].at).unsigned_abs())
        .collect()
}

/// Successful writes to MyResources (any subresource), ConfigMaps or Events in `namespace`
/// by a replica that did not hold the Lease when the write reached the API server: a
/// replica's write after another replica acquired the Lease (or after its own release) and
/// before it next acquired it itself.
pub fn overlapping_writes<'a>(
    events: &'a [AuditEvent],
    namespace: &str,
    terms: &[Acquisition],
) -> Vec<&'a AuditEvent> {
    events
        .iter()
        .filter(|e| e.is_write() && e.succeeded() && e.namespace() == namespace)
        .filter(|e| matches!(e.resource(), "myresources" | "configmaps" | "events"))
        .filter(|e| {
            let Some(replica) = e.replica() else {
                return false;
            };
            // The holder at the time the write was received.
            let holder = terms
                .iter()
                .take_while(|t| t.at <= e.request_received_timestamp)
                .last()
                .map(|t| t.holder.as_str());
            holder != Some(replica)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(
        verb: &str,
        ua: &str,
        resource: &str,
        sub: &str,
        at: &str,
        holder: Option<&str>,
    ) -> AuditEvent {
        serde_json::from_value(json!({
            "verb": verb, "user": {"username": "u"}, "userAgent": ua, "stage": "ResponseComplete",
            "objectRef": {"resource": resource, "subresource": sub, "namespace": "ns", "name": "n"},
            "responseStatus": {"code": 200},
            "requestReceivedTimestamp": at, "stageTimestamp": at,
            "requestObject": holder.map(|h| json!({"spec": {"holderIdentity": h}})),
        }))
        .unwrap()
    }

    #[test]
    fn a_write_after_another_replica_acquired_is_an_overlap() {
        let ua = |id: &str| format!("myresource-operator/0.1.0 ({id})");
        let events = vec![
            event(
                "update",
                &ua("a"),
                "leases",
                "",
                "2026-01-01T00:00:00Z",
                Some("a"),
            ),
            event(
                "update",
                &ua("a"),
                "leases",
                "",
                "2026-01-01T00:00:02Z",
                Some("a"),
            ),
            event(
                "patch",
                &ua("a"),
                "myresources",
                "status",
                "2026-01-01T00:00:03Z",
                None,
            ),
            event(
                "update",
                &ua("b"),
                "leases",
                "",
                "2026-01-01T00:00:10Z",
                Some("b"),
            ),
            event(
                "patch",
                &ua("b"),
                "configmaps",
                "",
                "2026-01-01T00:00:11Z",
                None,
            ),
            // a, deposed, writes after b acquired: an overlap.
            event(
                "patch",
                &ua("a"),
                "configmaps",
                "",
                "2026-01-01T00:00:12Z",
                None,
            ),
        ];
        let terms = acquisitions(&events, "ns", "n");
        assert_eq!(
            terms.iter().map(|t| t.holder.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        let overlaps = overlapping_writes(&events, "ns", &terms);
        assert_eq!(overlaps.len(), 1);
        assert_eq!(overlaps[0].replica(), Some("a"));
    }

    #[test]
    fn foreign_lease_writes_start_no_term_and_events_count_as_writes() {
        let ua = |id: &str| format!("myresource-operator/0.1.0 ({id})");
        let at = |s: u32| format!("2026-01-01T00:00:{s:02}Z");
        let events = vec![
            event("update", &ua("a"), "leases", "", &at(0), Some("a")),
            // kubectl clears the holder, relabels, deletes: a still believes it leads.
            event("patch", "kubectl/v1.37.2", "leases", "", &at(1), Some("")),
            event("patch", "kubectl/v1.37.2", "leases", "", &at(2), None),
            event("delete", "kubectl/v1.37.2", "leases", "", &at(3), None),
            event("create", &ua("a"), "events", "", &at(4), None),
            // b acquires; a's Event and MyResource write after that are overlaps.
            event("create", &ua("b"), "leases", "", &at(5), Some("b")),
            event("create", &ua("a"), "events", "", &at(6), None),
            event("update", &ua("a"), "myresources", "", &at(7), None),
            event("patch", &ua("b"), "events", "", &at(8), None),
        ];
        let terms = acquisitions(&events, "ns", "n");
        assert_eq!(
            terms.iter().map(|t| t.holder.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        let overlaps: Vec<_> = overlapping_writes(&events, "ns", &terms)
            .iter()
            .map(|e| (e.replica(), e.resource(), e.request_received_timestamp))
            .collect();
        assert_eq!(
            overlaps,
            [
                (Some("a"), "events", at(6).parse().unwrap()),
                (Some("a"), "myresources", at(7).parse().unwrap()),
            ]
        );
    }

    #[test]
    fn release_gaps_count_releases_in_the_window_followed_by_an_acquisition() {
        let term = |holder: &str, at: &str| Acquisition {
            holder: holder.into(),
            at: at.parse().unwrap(),
        };
        let terms = [
            term("a", "2026-01-01T00:00:00Z"),
            term("", "2026-01-01T00:00:01Z"),
            term("b", "2026-01-01T00:00:01.250Z"),
            term("", "2026-01-01T00:00:05Z"),
            term("c", "2026-01-01T00:00:05.040Z"),
            // Released with no successor: no gap.
            term("", "2026-01-01T00:00:09Z"),
        ];
        let all = |s: &str| s.parse::<Timestamp>().unwrap();
        assert_eq!(
            release_gaps(&terms, all("2026-01-01T00:00:00Z"), Timestamp::MAX),
            [Duration::from_millis(250), Duration::from_millis(40)]
        );
        assert_eq!(
            release_gaps(
                &terms,
                all("2026-01-01T00:00:02Z"),
                all("2026-01-01T00:00:06Z")
            ),
            [Duration::from_millis(40)]
        );
        let h = handovers(&terms, all("2026-01-01T00:00:00Z"));
        assert_eq!(
            (h.moves, h.longest_gap, h.last_holder.as_str()),
            (3, Duration::from_millis(250), "")
        );
    }
}
