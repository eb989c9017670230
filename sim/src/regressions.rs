//! Histories the simulator found failing in the code as it was, kept so they keep passing,
//! and the determinism every replay relies on.

use crate::history::History;
use crate::run::run;

/// A history that once broke an invariant, and what was fixed.
struct Regression {
    seed: u64,
    /// With this many shard Leases, in Pods as drawn; `None`: one Lease, bare processes
    /// (as found, before Pods and shard Leases were simulated).
    shards: Option<usize>,
    only: &'static [usize],
    fixed: &'static str,
}

const REGRESSIONS: &[Regression] = &[
    Regression {
        shards: None,
        seed: 1,
        only: &[3],
        fixed: "after a compaction, followers watched the Lease from its own resourceVersion, \
                got 410 Gone and read and watched again in a busy loop (15 requests/s) until \
                the Lease changed; a watch that ends as it opens now waits for the deadline",
    },
    Regression {
        shards: None,
        seed: 20,
        only: &[0, 2, 3, 5],
        fixed: "a slow API server applied a renew after the leader's client gave up; the \
                next renew conflicted with it, and the leader, remembering only its last \
                record sent, took its own earlier record for a foreign one and waited a lease \
                duration; every record sent since the last answer is now the leader's own",
    },
    Regression {
        shards: None,
        seed: 340,
        only: &[0, 1, 2, 5, 6],
        fixed: "a deleted Lease was recreated a lease duration after the last renewal a \
                follower had seen; an outage had hidden the holder's latest renewal, so the \
                holder still wrote; the wait now counts from when the deletion is seen",
    },
    Regression {
        shards: None,
        seed: 3648,
        only: &[0, 3],
        fixed: "while the Lease was absent, followers only polled it, and a term that began \
                and was deleted between two polls went unseen; reads now say as of which \
                resourceVersion the Lease is absent, and the watch starts there",
    },
    Regression {
        shards: None,
        seed: 6697,
        only: &[3, 4],
        fixed: "a process that started just after the Lease was deleted under a live holder \
                created it at once; a Lease absent at the first look is now created after a \
                lease duration",
    },
    Regression {
        shards: None,
        seed: 1683,
        only: &[0],
        fixed: "a Lease created and deleted while another replica's watch had not yet \
                delivered it: that replica created it again and led beside the first; a \
                creator now leads only if the watch from where it saw the Lease absent shows \
                its create first, and leaves the Lease to expire otherwise",
    },
    Regression {
        shards: None,
        seed: 5269,
        only: &[0, 1, 2, 3, 4, 5],
        fixed: "a holder cleared twice by a foreign writer, with a term between that one \
                replica never saw: it took the second clearing for the first one's, with no \
                holder to wait for; any cleared record is now waited out from when it is seen",
    },
    Regression {
        shards: Some(3),
        seed: 9,
        only: &[1, 3],
        fixed: "after an outage in which requests hung, every member's group watch stayed on \
                a connection the outage had left open, so each saw only itself for tens of \
                seconds (with kube's client, which sets no read timeout, until the connection \
                broke); a watch that shows none of this \
                replica's own renewals for two retry periods is now started over",
    },
    Regression {
        shards: Some(3),
        seed: 101,
        only: &[1, 3],
        fixed: "the API server throttled one replica's Lease requests (429) while its other \
                requests succeeded: each success counted as the server's return and cut the \
                group watch's backoff short, 9 lists a second; a return now brings a retry \
                no sooner than 0.8 s after the failure",
    },
    Regression {
        shards: Some(3),
        seed: 137,
        only: &[0, 1, 2, 3, 4, 5, 6, 7],
        fixed: "after an outage, members' views differed for a moment and the plan flipped \
                with every change of holder: a replica acquired, handed off and took back the \
                same shard three times in 0.6 s; a hand-off now waits until the plan has \
                asked for it for a retry period",
    },
];

#[test]
fn every_history_once_failing_passes() {
    for case in REGRESSIONS {
        let drawn = History::generate(case.seed, 3);
        let history = match case.shards {
            Some(shards) => drawn.with_shards(shards),
            None => drawn.without_pods().with_shards(0),
        }
        .only(case.only);
        let outcome = run(&history, false);
        assert!(
            outcome.violations.is_empty(),
            "seed {} (only {:?}) fails again: {:?}\nfixed was: {}",
            case.seed,
            case.only,
            outcome.violations,
            case.fixed
        );
    }
}

#[test]
fn a_seed_replays_byte_for_byte() {
    if !cfg!(tokio_unstable) {
        panic!(
            "run with RUSTFLAGS=\"--cfg tokio_unstable\" (cargo xtask test does): without it \
             tokio's own choices are not seeded"
        );
    }
    for (seed, shards) in [(3, 0), (4, 0), (16, 0), (117, 0), (137, 3)] {
        let history = History::generate(seed, 3).with_shards(shards);
        let first = run(&history, true);
        let second = run(&history, true);
        assert!(
            first.trace.len() > 100,
            "a trace of {} lines",
            first.trace.len()
        );
        assert_eq!(first.trace, second.trace, "seed {seed} replays differently");
    }
}
