//! A Lease's terms from the audit log, in the order they took effect, and how leadership
//! moved among them.

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use super::effect::{Dated, Dater, Effect};
use super::event::AuditEvent;

/// A replica's Lease write that changed the holder: the start of a term ("" for a release).
#[derive(Debug, Clone, PartialEq)]
pub struct Acquisition {
    pub holder: String,
    /// When the server answered (for reports and windows on the server's clock).
    pub at: Timestamp,
    /// When it took effect: the Lease's revision, or a window when the answer was lost.
    pub dated: Dated,
}

/// The terms of the Lease `namespace/name`, in the order they took effect: every write by a
/// replica that was applied (or, answered 5xx or not at all, may have been) and whose holder
/// differs from the previous such write's ("" for a release). Applied writes are ordered by
/// revision; one of unknown outcome is put after the last applied write answered before it
/// was received. Foreign writes (a deleted Lease, a holder cleared by another client,
/// relabelling) start no term: they do not stop the holder from believing it leads; the next
/// replica's acquisition does.
pub fn acquisitions(events: &[AuditEvent], namespace: &str, name: &str) -> Vec<Acquisition> {
    let mut dater = Dater::new(events);
    let mut applied: Vec<(Dated, &AuditEvent)> = Vec::new();
    let mut possibly: Vec<(Dated, &AuditEvent)> = Vec::new();
    for e in events
        .iter()
        .filter(|e| e.is_write() && e.is_lease() && e.replica().is_some())
        .filter(|e| e.namespace() == namespace && e.name() == name)
    {
        match dater.effect(e) {
            Effect::Applied(d) => applied.push((d, e)),
            Effect::Possibly(d) => possibly.push((d, e)),
            Effect::Unchanged | Effect::Rejected => {}
        }
    }
    applied.sort_by_key(|(d, e)| (d.revision, e.stage_timestamp));
    for (d, e) in possibly {
        let at = applied.partition_point(|(a, _)| a.until < d.from);
        applied.insert(at, (d, e));
    }
    let mut terms: Vec<Acquisition> = Vec::new();
    for (dated, e) in applied {
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
                dated,
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::audit::effect::tests::write;
    use serde_json::json;

    pub(crate) fn ua(id: &str) -> String {
        format!("myresource-operator/0.1.0 ({id})")
    }

    /// `id`'s write of Lease `ns/n` naming `holder`, received at `received` and answered at
    /// `answered` (seconds), with `code` and the answer's revision `rv`.
    pub(crate) fn lease_write(
        id: &str,
        holder: &str,
        (received, answered): (f64, f64),
        code: u16,
        rv: Option<u64>,
    ) -> AuditEvent {
        let mut e = write(
            &ua(id),
            "update",
            "leases",
            "n",
            (received, answered),
            code,
            rv,
        );
        e.request_object = Some(json!({"spec": {"holderIdentity": holder}}));
        e
    }

    #[test]
    fn terms_are_ordered_by_revision_and_renewals_start_none() {
        let events = vec![
            lease_write("a", "a", (0.0, 0.1), 200, Some(10)),
            lease_write("a", "a", (1.0, 1.1), 200, Some(12)),
            // b's acquisition was answered before a's release was: the revisions tell.
            lease_write("a", "", (2.0, 2.9), 200, Some(14)),
            lease_write("b", "b", (2.5, 2.6), 200, Some(15)),
            // A 409 starts nothing; a foreign write starts nothing.
            lease_write("c", "c", (3.0, 3.1), 409, None),
            write(
                "kubectl/v1.37.2",
                "delete",
                "leases",
                "n",
                (3.5, 3.6),
                200,
                None,
            ),
            // A 504 acquisition may have been applied: it starts a term, after the last
            // write answered before it was received.
            lease_write("c", "c", (4.0, 9.0), 504, None),
            lease_write("b", "b", (5.0, 5.1), 200, Some(20)),
        ];
        let terms = acquisitions(&events, "ns", "n");
        let holders: Vec<&str> = terms.iter().map(|t| t.holder.as_str()).collect();
        assert_eq!(holders, ["a", "", "b", "c", "b"]);
        assert_eq!(terms[2].dated.revision, Some(15));
        assert_eq!(terms[3].dated.revision, None);
    }

    #[test]
    fn release_gaps_count_releases_in_the_window_followed_by_an_acquisition() {
        let term = |holder: &str, at: &str| {
            let at: Timestamp = at.parse().unwrap();
            Acquisition {
                holder: holder.into(),
                at,
                dated: Dated {
                    revision: None,
                    from: at,
                    until: at,
                },
            }
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
