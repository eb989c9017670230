//! The invariants, judged on the simulated API server's effect order (when a change took
//! effect, not when it was sent or answered), as Jepsen's checkers judge a history.
//!
//! Each election (the one Lease, or each shard Lease) is judged on its own: its Lease's
//! changes, the writes let through its fence, who led on it.
//!
//! - **Fenced writes**: a term begins when a replica's acquire of the Lease takes effect
//!   (its write of a record naming it, over a record it did not write) and the replica
//!   then leads on it (an acquire it disowns, and never leads, is no term). No object
//!   write of a term takes effect after another process's term of the same Lease began.
//! - **Shard routing**: with shard Leases, every write let through a shard's fence is of
//!   an object of that shard (its owner's uid hashes into it).
//! - **One leader, soon**: when the faults are over, exactly one process leads each Lease,
//!   its term began by the bound below, and it wrote every key of its shard; and in Pods, a
//!   leader SIGKILLed with no other fault near is replaced within [`proof_bound`] (the
//!   crash proof), not a lease duration later.
//! - **Bounded requests**: no process sends more than [`MAX_LEASE_REQUESTS_PER_SECOND`]
//!   requests about one Lease (or the group's list and watch) in any second, outage or not.
//! - **No panic** in any task.
//!
//! The bound on a new leader: from the moment every fault is over (`h`: the last fault's
//! end, plus the longest a slow server held a request, which may land after it), a
//! replica whose own record is current (not deleted) takes it back within two retry
//! periods. Otherwise a follower first sees the last change of the record (`c`: within two
//! retry periods of the first moment from `c` on when nothing cuts it off for that long),
//! waits a lease duration (the longest any replica waits; none after a graceful release),
//! and acquires within two more retry periods:
//! `B = max(h, min over followers of that) + 2 × retry period + 1 s`. With shard Leases,
//! the plan steers who campaigns: a shard's planned leader changes once a departed
//! member's Lease has run out (a lease duration, as the shard Lease's own wait, but
//! counted from its member Lease's last renewal), and it waits up to a retry period for a
//! warm cache; so `B` gains a lease duration and two retry periods.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::LeaseSpec;
use kube_leasehold::scaleout::ShardKey;

use crate::history::{Fault, History};
use crate::replica::uid_of;
use crate::server::{By, Effect};

/// The most Lease requests one process may send in any second: a takeover race costs up
/// to seven (read, watch, acquire, conflict, read, watch); a busy loop costs hundreds.
pub const MAX_LEASE_REQUESTS_PER_SECOND: usize = 8;
/// Slack on the leader bound: latencies and watch lag.
const SLACK: Duration = Duration::from_secs(1);

/// What a process did, as the checker needs it.
#[derive(Debug, Clone)]
pub struct ProcessFacts {
    /// Its replica slot.
    pub replica: usize,
    /// When it started.
    pub started: Duration,
    /// Alive when the history ended.
    pub alive: bool,
    /// Per election, its fence open when the history ended (it believes it leads).
    pub leads: Vec<bool>,
}

/// What happened in a history.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// Every change, in effect order.
    pub effects: Vec<Effect>,
    /// Every process, by pid.
    pub processes: Vec<ProcessFacts>,
    /// Every Lease request: (pid, which Lease or "group", when sent).
    pub lease_requests: Vec<(usize, String, Duration)>,
    /// Every time a process's fence opened on a new term: (pid, Lease, when).
    pub led: Vec<(usize, String, Duration)>,
    /// When the history ended.
    pub end: Duration,
    /// Panics of any task.
    pub panics: Vec<String>,
}

/// A broken invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which invariant.
    pub invariant: &'static str,
    /// What happened.
    pub what: String,
}

/// One election's share of the facts.
struct Lane<'a> {
    /// Its shard (0 with one Lease).
    shard: usize,
    /// Its Lease's changes and the writes through its fences, in effect order.
    effects: Vec<&'a Effect>,
    /// When a process's fence opened on a term of it: (pid, when).
    led: Vec<(usize, Duration)>,
    /// By pid: whether the process leads it at the end.
    leads: Vec<bool>,
    /// The keys of its shard.
    keys: Vec<String>,
}

impl<'a> Lane<'a> {
    fn of(history: &History, facts: &'a Facts, shard: usize, name: &'a str) -> Lane<'a> {
        let effects = facts
            .effects
            .iter()
            .filter(|e| match e {
                Effect::Lease { name: n, .. } => n == name,
                Effect::Write { shard: s, .. } => *s == shard,
            })
            .collect();
        Lane {
            shard,
            effects,
            led: facts
                .led
                .iter()
                .filter(|(_, lease, _)| lease == name)
                .map(|(pid, _, at)| (*pid, *at))
                .collect(),
            leads: facts.processes.iter().map(|p| p.leads[shard]).collect(),
            keys: keys_of(history, shard),
        }
    }
}

/// The keys of shard `shard` (every key with one Lease), by the shard key's own hash.
fn keys_of(history: &History, shard: usize) -> Vec<String> {
    (0..history.keys)
        .map(|k| format!("key-{k}"))
        .filter(|key| {
            history.shards == 0 || ShardKey::new(history.shards).shard_of_uid(&uid_of(key)) == shard
        })
        .collect()
}

/// A term: a process's tenure, from the effect of its acquire.
#[derive(Debug, Clone, Copy)]
struct Term {
    pid: usize,
    began: Duration,
}

fn holder(spec: &Option<LeaseSpec>) -> &str {
    spec.as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or_default()
}

/// The election record as it stood when the faults were over.
struct Record {
    /// When it last changed (or the Lease was deleted).
    changed: Duration,
    /// The process that wrote it, if one did and led on it.
    author: Option<usize>,
    /// The record (`None`: deleted or never created).
    spec: Option<LeaseSpec>,
}

/// The terms, in the order they began; and the election record as of `h`.
fn terms(history: &History, facts: &Facts, lane: &Lane, h: Duration) -> (Vec<Term>, Record) {
    let mut acquires: Vec<Term> = Vec::new();
    let mut current: Option<LeaseSpec> = None;
    let mut author: Option<usize> = None;
    let mut changed = Duration::ZERO;
    let mut at_h = (Duration::ZERO, None, None);
    for effect in &lane.effects {
        let Effect::Lease { at, by, spec, .. } = effect else {
            continue;
        };
        let same_record = spec.is_some() && *spec == current;
        match by {
            By::Process(pid) => {
                let identity = &history.replicas[facts.processes[*pid].replica].identity;
                let renewing = author == Some(*pid) && holder(&current) == identity;
                if holder(spec) == identity && !renewing {
                    acquires.push(Term {
                        pid: *pid,
                        began: *at,
                    });
                }
                author = Some(*pid);
            }
            By::Foreign if same_record => {}
            By::Foreign => author = None,
        }
        if !same_record {
            changed = *at;
        }
        current = spec.clone();
        if *at <= h {
            at_h = (changed, author, current.clone());
        }
    }
    // An acquire is a term if its process led on it: its fence opened after it, before
    // its next acquire.
    let terms = acquires
        .iter()
        .enumerate()
        .filter(|(i, a)| {
            let next = acquires[i + 1..]
                .iter()
                .find(|n| n.pid == a.pid)
                .map_or(Duration::MAX, |n| n.began);
            lane.led
                .iter()
                .any(|(pid, at)| *pid == a.pid && a.began <= *at && *at < next)
        })
        .map(|(_, a)| *a)
        .collect::<Vec<Term>>();
    // The author counts only if it led on its last acquire (not a create it disowned).
    let author = at_h.1.filter(|p| {
        let last = acquires.iter().rfind(|a| a.pid == *p && a.began <= h);
        last.is_some_and(|last| terms.iter().any(|t| t.pid == *p && t.began == last.began))
    });
    let record = Record {
        changed: at_h.0,
        author,
        spec: at_h.2,
    };
    (terms, record)
}

/// Checks every invariant.
pub fn check(history: &History, facts: &Facts) -> Vec<Violation> {
    let mut violations: Vec<Violation> = facts
        .panics
        .iter()
        .map(|p| Violation {
            invariant: "no panic",
            what: p.clone(),
        })
        .collect();
    // The faults are over once the requests a slow server held have landed too.
    let held = history
        .faults
        .iter()
        .filter_map(|f| match f.fault {
            Fault::Slow { up_to, .. } => Some(up_to),
            _ => None,
        })
        .max()
        .unwrap_or_default();
    let h = history.quiet_from() + held;
    for (shard, name) in history.elections().iter().enumerate() {
        let lane = Lane::of(history, facts, shard, name);
        let found = check_election(history, facts, &lane, h);
        violations.extend(found.into_iter().map(|mut v| {
            if history.shards > 0 {
                v.what = format!("{name}: {}", v.what);
            }
            v
        }));
    }
    if history.shards > 0 {
        violations.extend(routing(history, facts));
    }
    // Bounded requests.
    let mut subjects: Vec<(usize, &str)> = facts
        .lease_requests
        .iter()
        .map(|(pid, subject, _)| (*pid, subject.as_str()))
        .collect();
    subjects.sort();
    subjects.dedup();
    for (pid, subject) in subjects {
        let sent: Vec<Duration> = facts
            .lease_requests
            .iter()
            .filter(|(p, s, _)| *p == pid && s == subject)
            .map(|(_, _, t)| *t)
            .collect();
        if let Some(i) = (MAX_LEASE_REQUESTS_PER_SECOND..sent.len())
            .find(|i| sent[*i] - sent[i - MAX_LEASE_REQUESTS_PER_SECOND] < Duration::from_secs(1))
        {
            violations.push(Violation {
                invariant: "bounded requests",
                what: format!(
                    "r{}#{pid} sent {} requests about {subject} within a second, from {}",
                    facts.processes[pid].replica,
                    MAX_LEASE_REQUESTS_PER_SECOND + 1,
                    secs(sent[i - MAX_LEASE_REQUESTS_PER_SECOND])
                ),
            });
        }
    }
    violations
}

/// Every write let through a shard's fence is of an object of that shard.
fn routing(history: &History, facts: &Facts) -> Vec<Violation> {
    let key = ShardKey::new(history.shards);
    facts
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::Write {
                at,
                pid,
                shard,
                key: object,
                ..
            } => {
                let belongs = key.shard_of_uid(&uid_of(object));
                (belongs != *shard).then(|| Violation {
                    invariant: "shard routing",
                    what: format!(
                        "r{}#{pid} wrote {object} (of shard {belongs}) through shard {shard}'s fence, taking effect at {}",
                        facts.processes[*pid].replica,
                        secs(*at)
                    ),
                })
            }
            Effect::Lease { .. } => None,
        })
        .collect()
}

/// The invariants of one election (fenced writes, one leader soon, proven deaths).
fn check_election(history: &History, facts: &Facts, lane: &Lane, h: Duration) -> Vec<Violation> {
    let mut violations = Vec::new();
    let (terms, record) = terms(history, facts, lane, h);
    let who = |pid: usize| format!("r{}#{pid}", facts.processes[pid].replica);
    // Fenced writes.
    for effect in &lane.effects {
        let Effect::Write {
            at, sent, pid, key, ..
        } = effect
        else {
            continue;
        };
        let Some(own) = terms.iter().rfind(|t| t.pid == *pid && t.began <= *sent) else {
            violations.push(Violation {
                invariant: "fenced writes",
                what: format!(
                    "{} wrote {key} (took effect at {}) without ever having acquired the Lease",
                    who(*pid),
                    secs(*at)
                ),
            });
            continue;
        };
        if let Some(newer) = terms
            .iter()
            .find(|t| t.pid != *pid && t.began > own.began && t.began < *at)
        {
            violations.push(Violation {
                invariant: "fenced writes",
                what: format!(
                    "{}'s write of {key}, let through its fence at {} in its term begun at {}, took effect at {}, after {}'s term began at {}",
                    who(*pid),
                    secs(*sent),
                    secs(own.began),
                    secs(*at),
                    who(newer.pid),
                    secs(newer.began)
                ),
            });
        }
    }
    // One leader, soon.
    let leaders: Vec<usize> = (0..facts.processes.len())
        .filter(|p| lane.leads[*p])
        .collect();
    let due = leader_due(history, facts, h, &record);
    match leaders.as_slice() {
        [leader] => {
            let term = terms.iter().rfind(|t| t.pid == *leader);
            match term {
                Some(term) if term.began > due => violations.push(Violation {
                    invariant: "one leader, soon",
                    what: format!(
                        "the faults were over at {}; a leader was due by {} but {}'s term began at {}",
                        secs(h),
                        secs(due),
                        who(*leader),
                        secs(term.began)
                    ),
                }),
                Some(term) => {
                    let written: std::collections::BTreeSet<&str> = lane
                        .effects
                        .iter()
                        .filter_map(|e| match e {
                            Effect::Write { pid, key, at, .. }
                                if pid == leader && *at >= term.began =>
                            {
                                Some(key.as_str())
                            }
                            _ => None,
                        })
                        .collect();
                    let missing = lane
                        .keys
                        .iter()
                        .filter(|k| !written.contains(k.as_str()))
                        .count();
                    if missing > 0 {
                        violations.push(Violation {
                            invariant: "one leader, soon",
                            what: format!(
                                "{} leads but wrote {} of the {} keys of shard {} in its term",
                                who(*leader),
                                lane.keys.len() - missing,
                                lane.keys.len(),
                                lane.shard
                            ),
                        });
                    }
                }
                None => violations.push(Violation {
                    invariant: "one leader, soon",
                    what: format!("{} believes it leads without a term", who(*leader)),
                }),
            }
        }
        _ => violations.push(Violation {
            invariant: "one leader, soon",
            what: format!(
                "{} processes lead at the end ({}), {} after the faults were over (a leader was due by {})",
                leaders.len(),
                leaders.iter().map(|p| who(*p)).collect::<Vec<_>>().join(", "),
                secs(facts.end - h),
                secs(due)
            ),
        }),
    }
    // A proven death is taken over at once.
    if history.pods {
        violations.extend(proven_deaths(history, facts, &terms));
    }
    violations
}

/// After a leader's process is SIGKILLed in its Pod, with no other fault near: a new term
/// within [`proof_bound`], not a lease duration later.
fn proven_deaths(history: &History, facts: &Facts, terms: &[Term]) -> Vec<Violation> {
    let bound = proof_bound(history);
    let quiet = |t: Duration| {
        history.faults.iter().all(|f| {
            matches!(f.fault, Fault::Crash { .. }) && f.at == t
                || f.until() + history.longest_lease() < t
                || f.at > t + bound
        })
    };
    history
        .faults
        .iter()
        .filter_map(|f| match f.fault {
            Fault::Crash { replica, .. } => Some((f.at, replica)),
            _ => None,
        })
        .filter(|(at, _)| quiet(*at))
        .filter_map(|(at, replica)| {
            let leader = terms.iter().rfind(|t| t.began <= at)?;
            if facts.processes[leader.pid].replica != replica {
                return None;
            }
            let next = terms.iter().find(|t| t.began > at && t.pid != leader.pid);
            if next.is_some_and(|n| n.began <= at + bound) {
                return None;
            }
            Some(Violation {
                invariant: "one leader, soon",
                what: format!(
                    "the leader r{replica}#{} was SIGKILLed in its Pod at {} with no other fault near; the next term began {} (due by {})",
                    leader.pid,
                    secs(at),
                    next.map_or("never".into(), |n| secs(n.began)),
                    secs(at + bound)
                ),
            })
        })
        .collect()
}

/// How soon a proven death is taken over: the kubelet's report (up to 1.5 s), the Pod
/// watch's lag (0.25 s), the dead process's last writes waited out (0.6 s), two retry
/// periods, and a second of slack.
fn proof_bound(history: &History) -> Duration {
    Duration::from_millis(1500 + 250 + 600 + 1000) + history.longest_retry() * 2
}

/// When a leader is due (see the module doc).
fn leader_due(history: &History, facts: &Facts, h: Duration, record: &Record) -> Duration {
    let Record {
        changed,
        author,
        spec,
    } = record;
    let (changed, author, record) = (*changed, *author, spec.as_ref());
    let retry = history.longest_retry();
    // A deleted Lease is recreated only once its last holder's fence has surely closed,
    // by that holder too.
    let author_alive = author.is_some_and(|p| facts.processes[p].alive) && record.is_some();
    let released = record.is_some_and(|r| {
        r.holder_identity.as_deref().unwrap_or_default().is_empty()
            && r.lease_duration_seconds == Some(1)
            && author.is_some()
    });
    let wait = if released {
        Duration::ZERO
    } else {
        history.longest_lease()
    };
    let followers = facts
        .processes
        .iter()
        .filter(|p| p.alive)
        .map(|p| {
            connected_from(history, p.replica, changed.max(p.started), retry * 2) + retry * 2 + wait
        })
        .min()
        .unwrap_or(h);
    let available = if author_alive { h } else { followers };
    let plan = if history.shards > 0 {
        history.longest_lease() + retry * 2
    } else {
        Duration::ZERO
    };
    h.max(available) + retry * 2 + SLACK + plan
}

/// The first moment from `t` on from which no fault cuts `replica` off for `span` (long
/// enough to read the Lease).
fn connected_from(history: &History, replica: usize, mut t: Duration, span: Duration) -> Duration {
    loop {
        let cut_until = history
            .faults
            .iter()
            .filter(|f| f.fault.cuts(replica) && f.at < t + span && t < f.until())
            .map(|f| f.until())
            .max();
        match cut_until {
            Some(until) => t = until,
            None => return t,
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}
