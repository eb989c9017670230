//! Histories the simulator found failing in the code as it was, kept so they keep passing,
//! and the determinism every replay relies on.

use crate::history::History;
use crate::run::run;

/// A history that once broke an invariant, and what was fixed.
struct Regression {
    seed: u64,
    only: &'static [usize],
    fixed: &'static str,
}

const REGRESSIONS: &[Regression] = &[
    Regression {
        seed: 1,
        only: &[3],
        fixed: "after a compaction, followers watched the Lease from its own resourceVersion, \
                got 410 Gone and read and watched again in a busy loop (15 requests/s) until \
                the Lease changed; a watch that ends as it opens now waits for the deadline",
    },
    Regression {
        seed: 20,
        only: &[0, 2, 3, 5],
        fixed: "a slow API server applied a renew after the leader's client gave up; the \
                next renew conflicted with it, and the leader, remembering only its last \
                record sent, took its own earlier record for a foreign one and waited a lease \
                duration; every record sent since the last answer is now the leader's own",
    },
];

#[test]
fn every_history_once_failing_passes() {
    for case in REGRESSIONS {
        let history = History::generate(case.seed, 3).only(case.only);
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
    for seed in [3, 4, 5] {
        let history = History::generate(seed, 3);
        let first = run(&history, true);
        let second = run(&history, true);
        assert!(first.trace.len() > 100, "a trace of {} lines", first.trace.len());
        assert_eq!(first.trace, second.trace, "seed {seed} replays differently");
    }
}
