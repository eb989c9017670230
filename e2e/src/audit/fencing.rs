//! The fencing check: no write of a term takes effect after a newer term of its Lease began.
//!
//! The check judges every write a replica of the group made (any namespace, any resource but
//! the group's own Leases) by when it took effect ([`super::effect`]), against the terms of
//! the Lease that fences it: the single Lease, or in scale-out mode the shard Lease of the
//! object the write was about. A write is *late* when it may have taken effect during a term
//! held by someone else (another replica, or nobody after a release). In scale-out mode the
//! object a write is about is its owner's uid, not its name (a name deleted and created again
//! gets a new uid, maybe in another shard): a MyResource's own uid, a ConfigMap's controller
//! owner, an Event's `regarding`; a delete of a ConfigMap is about the MyResource that had
//! the name when the delete took effect (the reconcile that deleted it), or failing that,
//! the deleted ConfigMap's owner. One write is about no live object: a delete of a
//! ConfigMap whose controller owner had lost the name (deleted and created again under
//! another uid) when it took effect removes an orphan, as garbage collection would, and
//! cannot undo any leader's work (the operator deletes by the ConfigMap's uid); such
//! deletes are counted, not judged. A delete of the live owner's ConfigMap is judged.
//!
//! The check refuses to pass on nothing: it reports how many writes and terms it examined
//! (callers assert a floor), lists writes it could not attribute to a shard, requests whose
//! user agent claims the operator but names no replica, and writes by a replica that never
//! touched any Lease (so belongs to no group the check could judge it by).

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Result, bail};
use kube_leasehold::scaleout::membership::shard_lease;
use kube_leasehold::scaleout::shard_key::ShardKey;
use serde_json::Value;

use super::effect::{Dated, Dater, Effect};
use super::event::AuditEvent;
use super::terms::{Acquisition, acquisitions};

/// The Lease or Leases that fence a group of replicas.
#[derive(Debug, Clone)]
pub enum Fences {
    /// One Lease, `namespace/name`, fences every write.
    Lease { namespace: String, name: String },
    /// Scale-out: shard Lease `<group>-<i>` in `namespace` fences the writes about the
    /// objects `key` puts in shard `i`.
    Shards {
        namespace: String,
        group: String,
        key: ShardKey,
    },
}

impl Fences {
    pub fn lease(namespace: &str, name: &str) -> Self {
        Fences::Lease {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    pub fn shards(namespace: &str, group: &str, shards: usize) -> Self {
        Fences::Shards {
            namespace: namespace.into(),
            group: group.into(),
            key: ShardKey::new(shards),
        }
    }

    fn namespace(&self) -> &str {
        match self {
            Fences::Lease { namespace, .. } | Fences::Shards { namespace, .. } => namespace,
        }
    }

    /// The name every Lease of the group starts with (the base Lease's name).
    fn base(&self) -> &str {
        match self {
            Fences::Lease { name, .. } => name,
            Fences::Shards { group, .. } => group,
        }
    }

    /// Whether `name` is one of the group's Leases (its own, a shard's, a member's).
    fn is_group_lease(&self, name: &str) -> bool {
        name == self.base()
            || name
                .strip_prefix(self.base())
                .is_some_and(|r| r.starts_with('-'))
    }
}

/// A write that may have taken effect in another's term.
#[derive(Debug, Clone)]
pub struct Late<'a> {
    pub write: &'a AuditEvent,
    pub effect: Effect,
    /// The shard whose Lease fences it (scale-out mode).
    pub shard: Option<usize>,
    /// Whether it may have taken effect before the Lease's first term.
    pub before_first: bool,
    /// The terms it may have taken effect in.
    pub terms: Vec<Acquisition>,
}

impl Late<'_> {
    /// The holders of the terms it may have taken effect in ("" for a released Lease, "-"
    /// before the first term).
    pub fn holders(&self) -> Vec<String> {
        let before = self.before_first.then(|| "-".to_string());
        before
            .into_iter()
            .chain(self.terms.iter().map(|t| t.holder.clone()))
            .collect()
    }

    /// When the write may first have taken effect (the round it belongs to).
    pub fn from(&self) -> k8s_openapi::jiff::Timestamp {
        self.effect
            .dated()
            .map_or(self.write.request_received_timestamp, |d| d.from)
    }

    pub fn describe(&self) -> String {
        let how = match self.effect {
            Effect::Possibly(_) => "maybe applied",
            _ => "applied",
        };
        let shard = self
            .shard
            .map_or(String::new(), |s| format!(" (shard {s})"));
        let rv = self
            .effect
            .dated()
            .and_then(|d| d.revision)
            .map_or(String::new(), |rv| format!(" at revision {rv}"));
        let began: Vec<String> = self
            .terms
            .iter()
            .map(|t| match t.dated.revision {
                Some(rv) => format!("{:?} at revision {rv}", t.holder),
                None => format!(
                    "{:?} maybe, between {} and {}",
                    t.holder, t.dated.from, t.dated.until
                ),
            })
            .collect();
        format!(
            "{}: {how}{rv}{shard} in the term(s) of {:?} (begun: {})",
            self.write.describe(),
            self.holders(),
            began.join("; ")
        )
    }
}

/// What the fencing check found.
#[derive(Debug, Clone, Default)]
pub struct Verdict<'a> {
    /// Writes by the group's replicas that took (or may have taken) effect, judged against
    /// the terms.
    pub writes_examined: usize,
    /// Writes by the group's replicas that changed nothing (rejected, or answered with a
    /// revision the object already had).
    pub writes_without_effect: usize,
    /// The terms (holder changes) of the Lease, or of each shard Lease in shard order.
    pub terms: Vec<Vec<Acquisition>>,
    pub late: Vec<Late<'a>>,
    /// Scale-out: writes whose object (owner uid) could not be found.
    pub unattributed: Vec<&'a AuditEvent>,
    /// Scale-out: deletes of orphaned ConfigMaps (see the module doc), not judged.
    pub orphans_removed: usize,
    /// Requests whose user agent claims the operator but names no replica.
    pub unparsed: Vec<&'a AuditEvent>,
    /// Writes (other than to a Lease) by a replica that made no request to any Lease.
    pub ungrouped: Vec<&'a AuditEvent>,
}

impl Verdict<'_> {
    /// How many terms the writes were judged against.
    pub fn terms_examined(&self) -> usize {
        self.terms.iter().map(Vec::len).sum()
    }

    /// Whether nothing was found wrong (the floors aside).
    pub fn clean(&self) -> bool {
        self.late.is_empty()
            && self.unattributed.is_empty()
            && self.unparsed.is_empty()
            && self.ungrouped.is_empty()
    }

    /// Every finding, one per line.
    pub fn findings(&self) -> Vec<String> {
        let mut out: Vec<String> = self.late.iter().map(Late::describe).collect();
        out.extend(
            self.unattributed
                .iter()
                .map(|e| format!("{}: no owner uid to judge it by", e.describe())),
        );
        out.extend(
            self.unparsed
                .iter()
                .map(|e| format!("{}: user agent names no replica", e.describe())),
        );
        out.extend(
            self.ungrouped
                .iter()
                .map(|e| format!("{}: by a replica of no Lease group", e.describe())),
        );
        out
    }

    /// Whether at least `min_writes` writes and `min_terms` terms were examined.
    pub fn examined_at_least(&self, min_writes: usize, min_terms: usize) -> bool {
        self.writes_examined >= min_writes && self.terms_examined() >= min_terms
    }

    /// Fails on any finding, or when fewer than `min_writes` writes or `min_terms` terms
    /// were examined (a check that looked at nothing proves nothing).
    pub fn ensure(&self, min_writes: usize, min_terms: usize) -> Result<()> {
        let findings = self.findings();
        if !findings.is_empty() {
            bail!(
                "the fencing check found {} problem(s) ({} writes, {} terms examined):\n{}",
                findings.len(),
                self.writes_examined,
                self.terms_examined(),
                findings.join("\n")
            );
        }
        if !self.examined_at_least(min_writes, min_terms) {
            bail!(
                "the fencing check examined {} writes and {} terms, fewer than {min_writes} and \
                 {min_terms}: it proves nothing",
                self.writes_examined,
                self.terms_examined()
            );
        }
        Ok(())
    }
}

/// Whether a write dated `d` may have taken effect before the first of `terms`, and the
/// terms during which it may have.
fn terms_during(terms: &[Acquisition], d: &Dated) -> (bool, Vec<Acquisition>) {
    let before_first = terms.first().is_none_or(|t| !t.dated.before(d));
    let during = terms
        .iter()
        .enumerate()
        .filter(|(i, term)| {
            let began_in_time = !d.before(&term.dated);
            let still_on = terms.get(i + 1).is_none_or(|next| !next.dated.before(d));
            began_in_time && still_on
        })
        .map(|(_, term)| term.clone())
        .collect();
    (before_first, during)
}

/// A MyResource's uid by name over time, from its creates in the log.
#[derive(Debug, Default)]
struct Names<'a> {
    created: BTreeMap<(&'a str, &'a str), Vec<(Dated, &'a str)>>,
}

impl<'a> Names<'a> {
    fn add(&mut self, e: &'a AuditEvent, d: Dated) {
        let Some(body) = e.response_object.as_ref() else {
            return;
        };
        if let (Some(name), Some(uid)) = (
            body["metadata"]["name"].as_str(),
            body["metadata"]["uid"].as_str(),
        ) {
            self.created
                .entry((e.namespace(), name))
                .or_default()
                .push((d, uid));
        }
    }

    /// The uid `namespace/name` had when a write dated `d` took effect: the last created
    /// not surely after it.
    fn uid_at(&self, namespace: &str, name: &str, d: &Dated) -> Option<&'a str> {
        self.created
            .get(&(namespace, name))?
            .iter()
            .rev()
            .find(|(created, _)| !d.before(created))
            .map(|(_, uid)| *uid)
    }
}

/// The uid of the controller owner in an object's `ownerReferences`.
fn controller_uid(body: &Value) -> Option<&str> {
    body["metadata"]["ownerReferences"]
        .as_array()?
        .iter()
        .find(|o| o["controller"].as_bool() == Some(true))
        .and_then(|o| o["uid"].as_str())
}

/// The bodies a write's object can be read from: the answer, then the request.
fn bodies(e: &AuditEvent) -> impl Iterator<Item = &Value> {
    [e.response_object.as_ref(), e.request_object.as_ref()]
        .into_iter()
        .flatten()
        .filter(|b| b["kind"] != "Status" && b["kind"] != "DeleteOptions")
}

/// Checks the writes of the replicas that `fences` fence.
pub fn check<'a>(events: &'a [AuditEvent], fences: &Fences) -> Verdict<'a> {
    let namespace = fences.namespace();
    let mut verdict = Verdict {
        unparsed: events.iter().filter(|e| e.unparsed_agent()).collect(),
        ..Default::default()
    };

    // Who belongs to the group: replicas that made any request to one of its Leases; and
    // who belongs to some group at all.
    let mut members = BTreeSet::new();
    let mut grouped = BTreeSet::new();
    for e in events.iter().filter(|e| e.is_lease()) {
        let Some(replica) = e.replica() else { continue };
        grouped.insert(replica);
        if e.namespace() == namespace && (e.name().is_empty() || fences.is_group_lease(e.name())) {
            members.insert(replica);
        }
    }

    verdict.terms = match fences {
        Fences::Lease { name, .. } => vec![acquisitions(events, namespace, name)],
        Fences::Shards { group, key, .. } => (0..key.shards())
            .map(|i| acquisitions(events, namespace, &shard_lease(group, i)))
            .collect(),
    };

    // One pass in log order: dates every write, learns names and owners as it goes.
    let mut dater = Dater::new(events);
    let mut names = Names::default();
    let mut owners: BTreeMap<&str, &str> = BTreeMap::new();
    let mut subjects: BTreeMap<(&str, &str), &str> = BTreeMap::new();
    let mut writes: Vec<(&AuditEvent, Effect)> = Vec::new();
    for e in events.iter().filter(|e| e.is_write()) {
        let effect = dater.effect(e);
        if let Effect::Applied(d) = effect {
            if e.resource() == "myresources" && e.verb == "create" {
                names.add(e, d);
            }
            if e.resource() == "configmaps"
                && let Some(body) = e.response_object.as_ref()
                && let (Some(uid), Some(owner)) =
                    (body["metadata"]["uid"].as_str(), controller_uid(body))
            {
                owners.insert(uid, owner);
            }
            if e.resource() == "events"
                && e.verb == "create"
                && let Some(uid) = bodies(e).find_map(event_subject)
                && let Some(name) = bodies(e).find_map(|b| b["metadata"]["name"].as_str())
            {
                subjects.insert((e.namespace(), name), uid);
            }
        }
        let Some(replica) = e.replica() else { continue };
        if e.is_lease() && e.namespace() == namespace && fences.is_group_lease(e.name()) {
            continue;
        }
        if !grouped.contains(replica) {
            verdict.ungrouped.push(e);
            continue;
        }
        if members.contains(replica) {
            writes.push((e, effect));
        }
    }

    let known = Known {
        names: &names,
        owners: &owners,
        subjects: &subjects,
    };
    for (e, effect) in writes {
        let Some(dated) = effect.dated() else {
            verdict.writes_without_effect += 1;
            continue;
        };
        verdict.writes_examined += 1;
        let (shard, fence) = match fences {
            Fences::Lease { .. } => (None, &verdict.terms[0]),
            Fences::Shards { key, .. } => {
                if removes_orphan(e, dated, &known) {
                    verdict.orphans_removed += 1;
                    continue;
                }
                let Some(uid) = owner_uid(e, dated, &known) else {
                    verdict.unattributed.push(e);
                    continue;
                };
                let shard = key.shard_of_uid(uid);
                (Some(shard), &verdict.terms[shard])
            }
        };
        let (before_first, terms) = terms_during(fence, dated);
        let replica = e.replica().unwrap_or_default();
        if before_first || terms.iter().any(|t| t.holder != replica) {
            verdict.late.push(Late {
                write: e,
                effect,
                shard,
                before_first,
                terms,
            });
        }
    }
    verdict
}

/// The uid an Event is about.
fn event_subject(body: &Value) -> Option<&str> {
    body["regarding"]["uid"]
        .as_str()
        .or_else(|| body["involvedObject"]["uid"].as_str())
}

/// What the log taught about objects a write's own bodies may not name.
struct Known<'k, 'a> {
    /// MyResource uids by name over time.
    names: &'k Names<'a>,
    /// ConfigMap uid → its controller owner's uid.
    owners: &'k BTreeMap<&'a str, &'a str>,
    /// Event (namespace, name) → the uid it is about, from its create.
    subjects: &'k BTreeMap<(&'a str, &'a str), &'a str>,
}

/// The ConfigMap a delete removed, named by the answer or the precondition.
fn deleted_uid(e: &AuditEvent) -> Option<&str> {
    e.response_object
        .as_ref()
        .and_then(|b| b["details"]["uid"].as_str())
        .or_else(|| e.request_object.as_ref()?["preconditions"]["uid"].as_str())
}

/// Whether `e` deleted a ConfigMap whose controller owner no longer had its name when the
/// delete took effect (see the module's doc).
fn removes_orphan(e: &AuditEvent, dated: &Dated, known: &Known<'_, '_>) -> bool {
    e.resource() == "configmaps"
        && e.verb == "delete"
        && deleted_uid(e)
            .and_then(|cm| known.owners.get(cm))
            .zip(known.names.uid_at(e.namespace(), e.name(), dated))
            .is_some_and(|(owner, current)| *owner != current)
}

/// The uid of the MyResource a write is about (see the module's doc).
fn owner_uid<'a>(e: &'a AuditEvent, dated: &Dated, known: &Known<'_, 'a>) -> Option<&'a str> {
    let from_body = |read: fn(&Value) -> Option<&str>| bodies(e).find_map(read);
    match e.resource() {
        "myresources" => from_body(|b| b["metadata"]["uid"].as_str())
            .or_else(|| known.names.uid_at(e.namespace(), e.name(), dated)),
        "configmaps" if e.verb == "delete" => known
            .names
            .uid_at(e.namespace(), e.name(), dated)
            .or_else(|| known.owners.get(deleted_uid(e)?).copied()),
        "configmaps" => from_body(controller_uid),
        // A series patch that got no answer names nothing: its create did.
        "events" => from_body(event_subject)
            .or_else(|| known.subjects.get(&(e.namespace(), e.name())).copied()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::effect::tests::write;
    use crate::audit::terms::tests::{lease_write, ua};
    use serde_json::json;

    /// `id`'s status patch of MyResource `ns/name` (uid `uid`).
    fn status(id: &str, name: &str, uid: &str, at: (f64, f64), rv: Option<u64>) -> AuditEvent {
        let mut e = write(&ua(id), "patch", "myresources", name, at, 200, rv);
        if let Some(body) = e.response_object.as_mut() {
            body["metadata"]["uid"] = uid.into();
        }
        e
    }

    /// The test's Lease ns/n: a acquires at revision 10, b at revision 20 (received at 5 s,
    /// answered at 5.1 s).
    fn two_terms() -> Vec<AuditEvent> {
        vec![
            lease_write("a", "a", (0.0, 0.1), 200, Some(10)),
            lease_write("b", "b", (5.0, 5.1), 200, Some(20)),
        ]
    }

    fn lease() -> Fences {
        Fences::lease("ns", "n")
    }

    /// A patch of ConfigMap `ns/x` by user agent `agent`, answered 200 with revision `rv`.
    fn cm_patch(agent: &str, at: (f64, f64), rv: u64) -> AuditEvent {
        write(agent, "patch", "configmaps", "x", at, 200, Some(rv))
    }

    #[test]
    fn a_write_received_in_the_old_term_but_applied_in_the_new_is_late() {
        // Received at 4 s, before b acquired, but queued in the server and committed at
        // revision 21, after b's acquisition: dating by receipt would credit it to a's term.
        let mut events = two_terms();
        events.push(status("a", "x", "u1", (4.0, 6.0), Some(21)));
        events.push(status("a", "y", "u2", (1.0, 1.1), Some(11)));
        let verdict = check(&events, &lease());
        assert_eq!(verdict.writes_examined, 2);
        assert_eq!(verdict.terms_examined(), 2);
        assert_eq!(verdict.late.len(), 1, "{:?}", verdict.findings());
        assert_eq!(verdict.late[0].holders(), ["b"]);
    }

    #[test]
    fn a_write_answered_5xx_may_have_been_applied_until_its_timeout() {
        let mut events = two_terms();
        // A 504 received at 3 s with a 4 s server-side timeout: it may be applied until 7 s,
        // after b's acquisition (5 s).
        let mut timed_out = write(&ua("a"), "patch", "configmaps", "x", (3.0, 3.5), 504, None);
        timed_out.request_uri = "/api/v1/namespaces/ns/configmaps/x?timeout=4000ms".into();
        events.push(timed_out.clone());
        // The same with a 1 s timeout ends before b's term: fine.
        timed_out.request_uri = "/api/v1/namespaces/ns/configmaps/x?timeout=1000ms".into();
        events.push(timed_out);
        // A 409 changed nothing, whenever it came.
        events.push(write(
            &ua("a"),
            "patch",
            "configmaps",
            "x",
            (9.0, 9.1),
            409,
            None,
        ));
        let verdict = check(&events, &lease());
        assert_eq!(verdict.late.len(), 1, "{:?}", verdict.findings());
        assert_eq!(verdict.writes_without_effect, 1);
    }

    #[test]
    fn every_namespace_and_resource_is_judged() {
        let mut events = two_terms();
        // a writes a Secret in another namespace after b acquired.
        let mut secret = write(
            &ua("a"),
            "create",
            "secrets",
            "s",
            (6.0, 6.1),
            201,
            Some(22),
        );
        secret.object_ref.as_mut().unwrap().namespace = "elsewhere".into();
        events.push(secret);
        let verdict = check(&events, &lease());
        assert_eq!(verdict.late.len(), 1, "{:?}", verdict.findings());
    }

    #[test]
    fn an_unchanged_answer_is_no_write_and_a_release_ends_the_term() {
        let mut events = vec![
            lease_write("a", "a", (0.0, 0.1), 200, Some(10)),
            cm_patch(&ua("a"), (1.0, 1.1), 11),
            lease_write("a", "", (2.0, 2.1), 200, Some(12)),
        ];
        // After its release: an apply that found everything as asked (revision 11 again)
        // changed nothing; a real change is late.
        events.push(cm_patch(&ua("a"), (3.0, 3.1), 11));
        events.push(cm_patch(&ua("a"), (4.0, 4.1), 13));
        let verdict = check(&events, &lease());
        assert_eq!(verdict.writes_without_effect, 1);
        assert_eq!(verdict.late.len(), 1, "{:?}", verdict.findings());
        assert_eq!(verdict.late[0].holders(), [""]);
    }

    #[test]
    fn nothing_examined_proves_nothing_and_unparsed_agents_fail() {
        let events = two_terms();
        let verdict = check(&events, &lease());
        assert!(verdict.clean());
        assert!(verdict.ensure(1, 2).is_err(), "no write examined");
        assert!(verdict.ensure(0, 2).is_ok());
        let mut events = two_terms();
        events.push(cm_patch("myresource-operator/0.1.0", (1.0, 1.1), 11));
        let verdict = check(&events, &lease());
        assert_eq!(verdict.unparsed.len(), 1);
        assert!(verdict.ensure(0, 0).is_err());
    }

    #[test]
    fn other_groups_are_not_judged_but_writers_of_no_group_are_reported() {
        let mut events = two_terms();
        // c leads another group's Lease and writes: not this group's business.
        let mut other = lease_write("c", "c", (0.0, 0.1), 200, Some(9));
        other.object_ref.as_mut().unwrap().namespace = "other".into();
        events.push(other);
        events.push(cm_patch(&ua("c"), (6.0, 6.1), 30));
        // d never touched a Lease, yet writes.
        events.push(cm_patch(&ua("d"), (6.0, 6.1), 31));
        let verdict = check(&events, &lease());
        assert!(verdict.late.is_empty(), "{:?}", verdict.findings());
        assert_eq!(verdict.ungrouped.len(), 1);
    }

    /// Shard Lease `g-<shard>`'s write by `id`.
    fn shard_write(id: &str, shard: usize, at: (f64, f64), rv: u64) -> AuditEvent {
        let mut e = lease_write(id, id, at, 200, Some(rv));
        e.object_ref.as_mut().unwrap().name = shard_lease("g", shard);
        e
    }

    /// A uid that `ShardKey::new(2)` puts in `shard`.
    fn uid_in(shard: usize, not: &str) -> String {
        (0..)
            .map(|i| format!("uid-{i}"))
            .find(|u| ShardKey::new(2).shard_of_uid(u) == shard && u != not)
            .unwrap()
    }

    #[test]
    fn scale_out_writes_are_judged_by_the_owner_uid_not_the_name() {
        let (u0, u1) = (uid_in(0, ""), uid_in(1, ""));
        let created = |uid: &str, at: (f64, f64), rv: u64| {
            let mut e = write("kubectl", "create", "myresources", "foo", at, 201, Some(rv));
            e.response_object.as_mut().unwrap()["metadata"]["uid"] = uid.into();
            e
        };
        let mut events = vec![
            shard_write("x", 0, (0.0, 0.1), 10),
            shard_write("y", 1, (0.0, 0.1), 11),
            created(&u0, (1.0, 1.1), 12),
            // foo in shard 0: x's writes are fine.
            status("x", "foo", &u0, (2.0, 2.1), Some(13)),
        ];
        // foo deleted and created again: its new uid is in shard 1, led by y.
        events.push(created(&u1, (3.0, 3.1), 14));
        // x's shard-0 worker writes the new object's status, its ConfigMap and an Event:
        // by name, x led "a shard foo had"; by uid, it is y's shard.
        events.push(status("x", "foo", &u1, (4.0, 4.1), Some(15)));
        let mut cm = write(
            &ua("x"),
            "patch",
            "configmaps",
            "foo",
            (4.0, 4.1),
            200,
            Some(16),
        );
        cm.response_object.as_mut().unwrap()["metadata"]["ownerReferences"] =
            json!([{"uid": u1, "controller": true}]);
        events.push(cm);
        let mut event = write(
            &ua("x"),
            "create",
            "events",
            "foo.1",
            (4.0, 4.1),
            201,
            Some(17),
        );
        event.response_object.as_mut().unwrap()["regarding"] = json!({"uid": u1});
        events.push(event);
        // x deletes foo's ConfigMap (answered with a Status): it is about the uid foo has.
        let mut delete = write(
            &ua("x"),
            "delete",
            "configmaps",
            "foo",
            (5.0, 5.1),
            200,
            None,
        );
        delete.response_object = Some(json!({"kind": "Status", "details": {"uid": "cm"}}));
        events.push(delete);
        // x's series patch of that Event, answered 504 with no body: its create named u1.
        let mut series = write(&ua("x"), "patch", "events", "foo.1", (4.5, 4.6), 504, None);
        series.request_uri =
            "/apis/events.k8s.io/v1/namespaces/ns/events/foo.1?timeout=500ms".into();
        events.push(series);
        // y writes its own object: fine. An Event about nothing known: unattributed.
        events.push(status("y", "foo", &u1, (6.0, 6.1), Some(18)));
        events.push(write(
            &ua("y"),
            "create",
            "events",
            "bar.1",
            (6.0, 6.1),
            201,
            Some(19),
        ));

        let verdict = check(&events, &Fences::shards("ns", "g", 2));
        assert_eq!(verdict.terms_examined(), 2);
        assert_eq!(verdict.writes_examined, 8);
        let late: Vec<(&str, Option<usize>)> = verdict
            .late
            .iter()
            .map(|l| (l.write.resource(), l.shard))
            .collect();
        assert_eq!(
            late,
            [
                ("myresources", Some(1)),
                ("configmaps", Some(1)),
                ("events", Some(1)),
                ("configmaps", Some(1)),
                ("events", Some(1)),
            ]
        );
        assert_eq!(verdict.unattributed.len(), 1);
    }

    /// A delete of a ConfigMap whose owner lost its name (deleted and created again) is an
    /// orphan's removal, not judged; a delete of the live owner's ConfigMap is (the
    /// destructive variant of the safety review's hole 1).
    #[test]
    fn deleting_an_orphaned_configmap_is_counted_not_judged() {
        let (u0, u1) = (uid_in(0, ""), uid_in(1, ""));
        let u0b = uid_in(0, &u0);
        let created = |uid: &str, at: (f64, f64), rv: u64| {
            let mut e = write("kubectl", "create", "myresources", "foo", at, 201, Some(rv));
            e.response_object.as_mut().unwrap()["metadata"]["uid"] = uid.into();
            e
        };
        let configmap = |id: &str, uid: &str, owner: &str, at: (f64, f64), rv: u64| {
            let mut e = write(&ua(id), "create", "configmaps", "foo", at, 201, Some(rv));
            let body = e.response_object.as_mut().unwrap();
            body["metadata"]["uid"] = uid.into();
            body["metadata"]["ownerReferences"] = json!([{"uid": owner, "controller": true}]);
            e
        };
        let delete = |id: &str, cm: &str, at: (f64, f64)| {
            let mut e = write(&ua(id), "delete", "configmaps", "foo", at, 200, None);
            e.response_object = Some(json!({"kind": "Status", "details": {"uid": cm}}));
            e
        };
        let events = vec![
            shard_write("x", 0, (0.0, 0.1), 10),
            shard_write("y", 1, (0.0, 0.1), 11),
            created(&u1, (1.0, 1.1), 12),
            configmap("y", "cm1", &u1, (1.5, 1.6), 13),
            // foo deleted and created again in x's shard: y's ConfigMap is an orphan, and
            // y removes it: not judged.
            created(&u0, (2.0, 2.1), 14),
            delete("y", "cm1", (3.0, 3.1)),
            configmap("x", "cm0", &u0, (4.0, 4.1), 15),
            // foo created again, still x's shard: y deletes the live owner's ConfigMap of
            // the previous one? No: cm0's owner u0 lost the name to u0b, so an orphan too.
            created(&u0b, (5.0, 5.1), 16),
            delete("y", "cm0", (6.0, 6.1)),
            configmap("x", "cm0b", &u0b, (7.0, 7.1), 17),
            // y deletes the live owner's ConfigMap: judged, late (shard 0 is x's).
            delete("y", "cm0b", (8.0, 8.1)),
        ];
        let verdict = check(&events, &Fences::shards("ns", "g", 2));
        assert_eq!(verdict.orphans_removed, 2);
        let late: Vec<(&str, Option<usize>)> = verdict
            .late
            .iter()
            .map(|l| (l.write.verb.as_str(), l.shard))
            .collect();
        assert_eq!(late, [("delete", Some(0))]);
    }
}
