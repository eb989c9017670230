//! Which replica should lead each shard, and which stand by for it: a pure function of
//! one replica's view (the live members and the current holders), so every replica computes
//! the same plan from the same view, and a unit test can check it.
//!
//! Rules, in order:
//! - **fair**: with n members, each leads ⌊S/n⌋ or ⌈S/n⌉ shards; the members that hold the
//!   most today get the larger share, so fewer shards move;
//! - **sticky**: a live holder keeps its shards up to its share; only the excess and the
//!   shards without a live holder move;
//! - **warm takeover**: a shard's first standby is exactly the replica the plan would make
//!   its leader if its leader died (the plan recomputed without it). So when a leader dies,
//!   each of its shards goes to the replica that already caches it: no LIST at takeover;
//! - further standbys (and the choice among equals) follow rendezvous hashing of
//!   (shard, member), which moves as little as possible when members come and go.
//!
//! The plan decides only liveness. Safety is each shard Lease's own compare-and-swap and
//! fence: replicas whose views differ may disagree for a moment, never write together.

use std::collections::{BTreeMap, BTreeSet};

use super::shard_key::fnv1a64;

/// One replica's view of the shard group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// Live members' identities.
    pub members: BTreeSet<String>,
    /// Per shard, the live member that holds its Lease, if any.
    pub holders: Vec<Option<String>>,
}

/// What the view says each shard should have.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Per shard, the member that should lead it (`None` only without members).
    pub leaders: Vec<Option<String>>,
    /// Per shard, the members that should cache it warm besides its leader, in order.
    pub standbys: Vec<Vec<String>>,
}

impl Plan {
    /// The shards `member` should lead.
    pub fn led_by(&self, member: &str) -> BTreeSet<usize> {
        (0..self.leaders.len())
            .filter(|i| self.leaders[*i].as_deref() == Some(member))
            .collect()
    }

    /// The shards `member` should cache: those it should lead or stand by for.
    pub fn cached_by(&self, member: &str) -> BTreeSet<usize> {
        let mut shards = self.led_by(member);
        shards.extend(
            (0..self.standbys.len()).filter(|i| self.standbys[*i].iter().any(|m| m == member)),
        );
        shards
    }
}

/// What one replica's shard elections may do now, from the plan and who is warm.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Intent {
    /// Shards this replica may acquire: the plan gives them to it, and its cache of each
    /// has listed (a leader must find every object of its shard in its cache).
    pub lead: BTreeSet<usize>,
    /// Shards this replica holds and should release: the plan gives them to another
    /// replica whose cache of them has listed, so the handover costs it no LIST.
    pub hand_off: BTreeSet<usize>,
}

/// The intent of replica `me`, which holds `held`, when `warm` says whose caches of which
/// shards have listed.
pub fn intent(
    plan: &Plan,
    me: &str,
    warm: &BTreeMap<String, BTreeSet<usize>>,
    held: &BTreeSet<usize>,
) -> Intent {
    let warm_for =
        |member: &str, shard: usize| warm.get(member).is_some_and(|w| w.contains(&shard));
    Intent {
        lead: plan
            .led_by(me)
            .into_iter()
            .filter(|i| warm_for(me, *i))
            .collect(),
        hand_off: held
            .iter()
            .copied()
            .filter(|i| match plan.leaders.get(*i).and_then(Option::as_deref) {
                Some(other) => other != me && warm_for(other, *i),
                None => false,
            })
            .collect(),
    }
}

/// The shards replica `me` should cache now, holding `held` and caching `caching`: every
/// shard the plan gives it to lead, every shard it holds, and the shards it stands by for;
/// but while `defer` (a takeover is pending: see [`takeover_pending`]) a standby shard it
/// does not cache yet waits, so that its LIST does not compete with the takeover for the
/// API server and this replica's CPU (a leave hands several shards over at once, and each
/// survivor starts standing by for others at that very moment; a joiner would list its
/// standby shards while its share is handed to it).
pub fn to_cache(
    plan: &Plan,
    me: &str,
    held: &BTreeSet<usize>,
    caching: &BTreeSet<usize>,
    defer: bool,
) -> BTreeSet<usize> {
    let led = plan.led_by(me);
    plan.cached_by(me)
        .into_iter()
        .filter(|i| !defer || led.contains(i) || caching.contains(i))
        .chain(held.iter().copied())
        .collect()
}

/// Whether the plan gives replica `me` a shard it does not hold yet (a joiner's share, a
/// leaver's or a dead replica's shards).
pub fn takeover_pending(plan: &Plan, me: &str, held: &BTreeSet<usize>) -> bool {
    !plan.led_by(me).is_subset(held)
}

/// Members in rendezvous order for `shard`: highest weight first.
fn rendezvous<'a>(shard: usize, members: impl Iterator<Item = &'a String>) -> Vec<&'a String> {
    let mut ranked: Vec<(u64, &String)> = members
        .map(|m| (fnv1a64(format!("{shard}/{m}").as_bytes()), m))
        .collect();
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    ranked.into_iter().map(|(_, m)| m).collect()
}

/// The fair, sticky leader of every shard for `members` and `holders` (holders not among
/// `members` are ignored).
fn leaders(members: &BTreeSet<String>, holders: &[Option<String>]) -> Vec<Option<String>> {
    let shards = holders.len();
    let n = members.len();
    if n == 0 {
        return vec![None; shards];
    }
    let held = |m: &String| holders.iter().filter(|h| h.as_ref() == Some(m)).count();
    // The larger shares go to those who hold the most (then by name).
    let mut order: Vec<&String> = members.iter().collect();
    order.sort_by(|a, b| held(b).cmp(&held(a)).then_with(|| a.cmp(b)));
    let target: BTreeMap<&String, usize> = order
        .iter()
        .enumerate()
        .map(|(rank, m)| (*m, shards / n + usize::from(rank < shards % n)))
        .collect();
    let mut kept: BTreeMap<&String, usize> = BTreeMap::new();
    let mut leaders: Vec<Option<String>> = vec![None; shards];
    for (shard, holder) in holders.iter().enumerate() {
        if let Some(holder) = holder.as_ref().and_then(|h| members.get(h)) {
            let count = kept.entry(holder).or_default();
            if *count < target[holder] {
                *count += 1;
                leaders[shard] = Some(holder.clone());
            }
        }
    }
    for (shard, leader) in leaders.iter_mut().enumerate() {
        if leader.is_some() {
            continue;
        }
        let chosen = rendezvous(shard, members.iter())
            .into_iter()
            .find(|m| kept.get(*m).copied().unwrap_or(0) < target[*m])
            .expect("the targets add up to the shard count");
        *kept.entry(chosen).or_default() += 1;
        *leader = Some(chosen.clone());
    }
    leaders
}

/// The plan for `view` with `standbys` standbys per shard (fewer when there are not enough
/// members).
pub fn plan(view: &View, standbys: usize) -> Plan {
    let leaders = leaders(&view.members, &view.holders);
    // Each leader's shards, planned as if it had died: their new leaders are the standbys.
    let mut without: BTreeMap<&String, Vec<Option<String>>> = BTreeMap::new();
    for leader in leaders.iter().flatten() {
        without.entry(leader).or_insert_with(|| {
            let mut members = view.members.clone();
            members.remove(leader);
            let holders: Vec<Option<String>> = view
                .holders
                .iter()
                .map(|h| h.clone().filter(|h| h != leader))
                .collect();
            self::leaders(&members, &holders)
        });
    }
    let standbys = leaders
        .iter()
        .enumerate()
        .map(|(shard, leader)| {
            let Some(leader) = leader else {
                return Vec::new();
            };
            let mut chosen: Vec<String> = without[leader][shard].iter().cloned().collect();
            for m in rendezvous(shard, view.members.iter()) {
                if chosen.len() >= standbys {
                    break;
                }
                if m != leader && !chosen.contains(m) {
                    chosen.push(m.clone());
                }
            }
            chosen.truncate(standbys);
            chosen
        })
        .collect();
    Plan { leaders, standbys }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(members: &[&str], holders: &[Option<&str>]) -> View {
        View {
            members: members.iter().map(|m| m.to_string()).collect(),
            holders: holders.iter().map(|h| h.map(String::from)).collect(),
        }
    }

    fn counts(plan: &Plan) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for leader in plan.leaders.iter().flatten() {
            *counts.entry(leader.clone()).or_default() += 1;
        }
        counts
    }

    #[test]
    fn shards_are_divided_fairly_from_scratch() {
        for n in 1..=5 {
            let members: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
            let names: Vec<&str> = members.iter().map(String::as_str).collect();
            let plan = plan(&view(&names, &[None; 12]), 1);
            let counts = counts(&plan);
            assert_eq!(counts.len(), n, "{counts:?}");
            assert!(
                counts.values().all(|c| *c == 12 / n || *c == 12 / n + 1),
                "{counts:?}"
            );
            for (shard, standbys) in plan.standbys.iter().enumerate() {
                assert_eq!(standbys.len(), usize::from(n > 1));
                assert!(!standbys.contains(plan.leaders[shard].as_ref().unwrap()));
            }
        }
    }

    #[test]
    fn holders_keep_their_share_and_a_joiner_gets_only_the_excess() {
        // a holds 0-5, b holds 6-11; c joins: 4 each, and only 4 shards move, all to c.
        let holders: Vec<Option<&str>> = (0..12)
            .map(|i| Some(if i < 6 { "a" } else { "b" }))
            .collect();
        let plan = plan(&view(&["a", "b", "c"], &holders), 1);
        let moved: Vec<usize> = (0..12)
            .filter(|i| plan.leaders[*i].as_deref() != holders[*i])
            .collect();
        assert_eq!(moved.len(), 4, "{plan:?}");
        assert!(
            moved
                .iter()
                .all(|i| plan.leaders[*i].as_deref() == Some("c"))
        );
        assert_eq!(
            counts(&plan).values().copied().collect::<Vec<_>>(),
            [4, 4, 4]
        );
    }

    #[test]
    fn a_dead_leaders_shards_go_to_their_standbys() {
        let members = ["a", "b", "c", "d"];
        // The steady state: everyone holds what the plan says.
        let first = plan(&view(&members, &[None; 12]), 1);
        let steady = View {
            members: members.iter().map(|m| m.to_string()).collect(),
            holders: first.leaders.clone(),
        };
        let before = plan(&steady, 1);
        assert_eq!(before.leaders, first.leaders);
        for dead in members {
            // Then `dead` disappears.
            let holders: Vec<Option<String>> = before
                .leaders
                .iter()
                .map(|l| l.clone().filter(|l| l != dead))
                .collect();
            let alive: Vec<&str> = members.iter().copied().filter(|m| *m != dead).collect();
            let after = plan(
                &View {
                    members: alive.iter().map(|m| m.to_string()).collect(),
                    holders,
                },
                1,
            );
            for shard in 0..12 {
                if before.leaders[shard].as_deref() == Some(dead) {
                    assert_eq!(
                        after.leaders[shard],
                        before.standbys[shard][0].clone().into(),
                        "shard {shard} of {dead} did not go to its standby"
                    );
                } else {
                    assert_eq!(
                        after.leaders[shard], before.leaders[shard],
                        "a live holder's shard moved"
                    );
                }
            }
            assert!(counts(&after).values().all(|c| *c == 4), "{after:?}");
        }
    }

    #[test]
    fn holders_outside_the_members_are_ignored_and_no_members_means_no_leaders() {
        let plan_ = plan(&view(&["a"], &[Some("gone"), Some("a")]), 1);
        assert_eq!(plan_.leaders, [Some("a".into()), Some("a".into())]);
        assert_eq!(plan_.standbys, [Vec::<String>::new(), Vec::new()]);
        let empty = plan(&view(&[], &[Some("a")]), 1);
        assert_eq!(empty.leaders, [None]);
        assert!(empty.cached_by("a").is_empty());
    }

    #[test]
    fn a_replica_leads_only_warm_shards_and_hands_off_only_to_warm_replicas() {
        let plan = plan(
            &view(&["a", "b"], &[Some("a"), Some("a"), Some("a"), None]),
            1,
        );
        // a keeps two of its three; b gets the third and the free one.
        let given: Vec<usize> = plan.led_by("b").into_iter().collect();
        assert_eq!(given.len(), 2);
        let held_by_a: BTreeSet<usize> = [0, 1, 2].into();
        let moving = *given.iter().find(|i| held_by_a.contains(i)).unwrap();
        let warm = |b: &[usize]| {
            BTreeMap::from([
                ("a".to_string(), BTreeSet::from([0, 1, 2])),
                ("b".to_string(), b.iter().copied().collect()),
            ])
        };
        // b not warm yet: a keeps leading, b may take nothing.
        let cold = warm(&[]);
        assert!(intent(&plan, "a", &cold, &held_by_a).hand_off.is_empty());
        assert!(intent(&plan, "b", &cold, &BTreeSet::new()).lead.is_empty());
        // b warm for its shards: a hands the moving one off, b may lead both.
        let ready = warm(&given);
        assert_eq!(
            intent(&plan, "a", &ready, &held_by_a).hand_off,
            BTreeSet::from([moving])
        );
        assert_eq!(
            intent(&plan, "b", &ready, &BTreeSet::new()).lead,
            given.into_iter().collect()
        );
    }

    #[test]
    fn two_standbys_are_distinct_and_cached() {
        let plan = plan(&view(&["a", "b", "c", "d"], &[None; 8]), 2);
        for (shard, standbys) in plan.standbys.iter().enumerate() {
            assert_eq!(standbys.len(), 2);
            assert_ne!(standbys[0], standbys[1]);
            for m in standbys {
                assert!(plan.cached_by(m).contains(&shard));
            }
        }
    }

    #[test]
    fn new_standby_caches_wait_for_a_pending_takeover() {
        // b leaves: a is to lead 0 and 1 (it holds 0, caches 0 and 1) and stand by for 2, 3.
        let plan = Plan {
            leaders: vec![
                Some("a".into()),
                Some("a".into()),
                Some("c".into()),
                Some("c".into()),
            ],
            standbys: vec![
                vec!["c".into()],
                vec!["c".into()],
                vec!["a".into()],
                vec!["a".into()],
            ],
        };
        let held = BTreeSet::from([0]);
        let caching = BTreeSet::from([0, 1, 2]);
        assert!(takeover_pending(&plan, "a", &held));
        assert_eq!(
            to_cache(&plan, "a", &held, &caching, true),
            BTreeSet::from([0, 1, 2]),
            "3 waits; 2, already cached, stays"
        );
        assert_eq!(
            to_cache(&plan, "a", &held, &caching, false),
            BTreeSet::from([0, 1, 2, 3])
        );
        // Led shards are cached even while deferring; held ones are never dropped.
        assert_eq!(
            to_cache(&plan, "a", &BTreeSet::from([0, 3]), &BTreeSet::new(), true),
            BTreeSet::from([0, 1, 3])
        );
        assert!(!takeover_pending(&plan, "a", &BTreeSet::from([0, 1])));
        assert!(!takeover_pending(&plan, "c", &BTreeSet::from([2, 3])));
    }
}
