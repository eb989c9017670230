//! The per-shard work queue: pure decision logic, no I/O, time passed in by the caller.
//!
//! Semantics follow client-go's workqueue (the model for controller-runtime), which
//! kube-runtime's scheduler does not expose in a form we can measure (queue depth, time in
//! queue, longest-running work):
//! - de-duplication: a key is in the queue at most once; adding a queued key is a no-op;
//! - one worker per key: a key handed out by [`Queue::pop`] is not handed out again until
//!   [`Queue::done`]; adds that arrive meanwhile mark it dirty, and `done` puts it back;
//! - failures requeue after a capped exponential backoff per key, reset on success;
//! - requeue-after: a key can be scheduled for later; an immediate add overrides the delay;
//! - two lanes, like controller-runtime's priority queue: keys queued for a change (a watch
//!   event, a retry, a requeue) are handed out before the backlog a term queues at its start
//!   (every cached key, for one look each), so a change made during a takeover at 100,000
//!   objects waits for the workers, not for the backlog; a backlog key that changes moves up.
//!
//! Invariant: every key is in at most one of {ready, delayed}; `ready_since` holds exactly
//! the ready keys, each with the one lane entry that is live (entries it left behind when it
//! moved up or was handed out are skipped); `processing` and the ready keys are disjoint.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// How a processed key leaves the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Done; forget its failures.
    Success,
    /// Done for now; look again after this long.
    RequeueAfter(Duration),
    /// Failed; retry after the key's next backoff step.
    Failure,
}

/// Capped exponential backoff: `base * 2^(failures-1)`, at most `cap`.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

impl Default for Backoff {
    /// 200 ms doubling to 5 min: at most 9 retries in the first minute of a persistent failure.
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(200),
            cap: Duration::from_secs(300),
        }
    }
}

impl Backoff {
    /// The delay before retry number `failures` (1 for the first failure).
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(31);
        self.base.saturating_mul(1u32 << exp).min(self.cap)
    }
}

/// Which ready list a key waits in: every [`Lane::Changed`] key is handed out before any
/// [`Lane::Backlog`] key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Queued for a change: a watch event, a retry, a requeue.
    Changed,
    /// Queued by a term's start for one look at every cached object.
    Backlog,
}

/// A key's bookkeeping while it waits.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    /// When it entered the ready list (for the queue-duration metric).
    since: Instant,
    lane: Lane,
    /// Its live entry in its lane's list.
    entry: u64,
}

/// A handed-out key and how long it waited in the ready list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Popped<K> {
    pub key: K,
    pub waited: Duration,
    /// How many times this key failed in a row before this attempt.
    pub retries: u32,
}

/// The queue of one shard.
#[derive(Debug)]
pub struct Queue<K> {
    backoff: Backoff,
    /// Per lane (indexed by `Lane as usize`), entries `(entry, key)` in arrival order.
    ready: [VecDeque<(u64, K)>; 2],
    ready_since: HashMap<K, Waiting>,
    delayed: BTreeSet<(Instant, u64, K)>,
    delayed_at: HashMap<K, (Instant, u64)>,
    processing: HashMap<K, Instant>,
    dirty: HashSet<K>,
    failures: HashMap<K, u32>,
    seq: u64,
}

impl<K: Clone + Eq + Hash + Ord> Queue<K> {
    pub fn new(backoff: Backoff) -> Self {
        Queue {
            backoff,
            ready: [VecDeque::new(), VecDeque::new()],
            ready_since: HashMap::new(),
            delayed: BTreeSet::new(),
            delayed_at: HashMap::new(),
            processing: HashMap::new(),
            dirty: HashSet::new(),
            failures: HashMap::new(),
            seq: 0,
        }
    }

    /// Makes `key` ready now in [`Lane::Changed`] (or, while it is being processed, as
    /// soon as it is done); a key waiting in the backlog moves up. Returns whether the key
    /// is newly waiting.
    pub fn add(&mut self, key: K, now: Instant) -> bool {
        self.add_in(Lane::Changed, key, now)
    }

    /// Makes `key` ready now in [`Lane::Backlog`], unless it is waiting already (a key being
    /// processed runs again when done, as after [`Queue::add`]). Returns whether the key is
    /// newly waiting.
    pub fn add_backlog(&mut self, key: K, now: Instant) -> bool {
        self.add_in(Lane::Backlog, key, now)
    }

    fn add_in(&mut self, lane: Lane, key: K, now: Instant) -> bool {
        if self.processing.contains_key(&key) {
            return self.dirty.insert(key);
        }
        if let Some(waiting) = self.ready_since.get_mut(&key) {
            if lane == Lane::Changed && waiting.lane == Lane::Backlog {
                self.seq += 1;
                (waiting.lane, waiting.entry) = (lane, self.seq);
                self.ready[lane as usize].push_back((self.seq, key));
            }
            return false;
        }
        if let Some((at, seq)) = self.delayed_at.remove(&key) {
            self.delayed.remove(&(at, seq, key.clone()));
        }
        self.seq += 1;
        let waiting = Waiting {
            since: now,
            lane,
            entry: self.seq,
        };
        self.ready_since.insert(key.clone(), waiting);
        self.ready[lane as usize].push_back((self.seq, key));
        true
    }

    /// Makes `key` ready at `at`, unless it is already ready or due earlier.
    pub fn add_at(&mut self, key: K, at: Instant) {
        if !self.ready_since.contains_key(&key) {
            self.schedule(key, at);
        }
    }

    fn schedule(&mut self, key: K, at: Instant) {
        if let Some(&(current, seq)) = self.delayed_at.get(&key) {
            if current <= at {
                return;
            }
            self.delayed.remove(&(current, seq, key.clone()));
        }
        self.seq += 1;
        self.delayed.insert((at, self.seq, key.clone()));
        self.delayed_at.insert(key, (at, self.seq));
    }

    /// Moves due delayed keys to the ready list and hands out the oldest ready key of the
    /// first lane that has one.
    pub fn pop(&mut self, now: Instant) -> Option<Popped<K>> {
        self.promote_due(now);
        let (key, waiting) = self.pop_live()?;
        self.processing.insert(key.clone(), now);
        Some(Popped {
            retries: self.failures.get(&key).copied().unwrap_or(0),
            waited: now.saturating_duration_since(waiting.since),
            key,
        })
    }

    /// Takes the first live entry, lane by lane, dropping the entries keys left behind.
    fn pop_live(&mut self) -> Option<(K, Waiting)> {
        for lane in &mut self.ready {
            while let Some((entry, key)) = lane.pop_front() {
                if self.ready_since.get(&key).is_some_and(|w| w.entry == entry) {
                    let waiting = self.ready_since.remove(&key).expect("checked above");
                    return Some((key, waiting));
                }
            }
        }
        None
    }

    fn promote_due(&mut self, now: Instant) {
        while let Some((at, _, _)) = self.delayed.first() {
            if *at > now {
                break;
            }
            let (_, _, key) = self.delayed.pop_first().expect("checked above");
            self.delayed_at.remove(&key);
            if self.processing.contains_key(&key) {
                self.dirty.insert(key);
            } else {
                self.add(key, now);
            }
        }
    }

    /// Ends the processing of `key`; returns the delay of a failure's retry.
    pub fn done(&mut self, key: &K, outcome: Outcome, now: Instant) -> Option<Duration> {
        self.processing.remove(key);
        let retry = match outcome {
            Outcome::Success => {
                self.failures.remove(key);
                None
            }
            Outcome::RequeueAfter(after) => {
                self.failures.remove(key);
                self.schedule(key.clone(), now + after);
                None
            }
            Outcome::Failure => {
                let failures = self.failures.entry(key.clone()).or_insert(0);
                *failures += 1;
                let delay = self.backoff.delay(*failures);
                self.schedule(key.clone(), now + delay);
                Some(delay)
            }
        };
        if self.dirty.remove(key) {
            // Something changed while it ran: look again now, whatever the outcome said.
            self.add(key.clone(), now);
        }
        retry
    }

    /// Forgets every waiting key and every failure count (leadership lost). Keys being
    /// processed stay tracked until their `done`.
    pub fn clear(&mut self) {
        self.ready.iter_mut().for_each(VecDeque::clear);
        self.ready_since.clear();
        self.delayed.clear();
        self.delayed_at.clear();
        self.dirty.clear();
        self.failures.clear();
    }

    /// When the earliest delayed key falls due.
    pub fn next_due(&self) -> Option<Instant> {
        self.delayed.first().map(|(at, _, _)| *at)
    }

    /// Keys ready to be handed out (the `workqueue_depth` metric).
    pub fn depth(&self) -> usize {
        self.ready_since.len()
    }

    /// Keys being processed now.
    pub fn in_flight(&self) -> usize {
        self.processing.len()
    }

    /// Keys waiting for a later time (backoff or requeue-after).
    pub fn delayed(&self) -> usize {
        self.delayed.len()
    }

    /// Total and longest time the keys in processing have been running.
    pub fn unfinished(&self, now: Instant) -> (Duration, Duration) {
        self.processing
            .values()
            .map(|start| now.saturating_duration_since(*start))
            .fold((Duration::ZERO, Duration::ZERO), |(sum, max), d| {
                (sum + d, max.max(d))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> (Queue<&'static str>, Instant) {
        (Queue::new(Backoff::default()), Instant::now())
    }

    #[test]
    fn adds_are_deduplicated() {
        let (mut q, t) = queue();
        assert!(q.add("a", t));
        assert!(!q.add("a", t));
        q.add("b", t);
        assert_eq!(q.depth(), 2);
        assert_eq!(q.pop(t).unwrap().key, "a");
        assert_eq!(q.pop(t).unwrap().key, "b");
        assert!(q.pop(t).is_none());
    }

    #[test]
    fn changed_keys_go_before_the_backlog() {
        let (mut q, t) = queue();
        assert!(q.add_backlog("a", t));
        assert!(q.add_backlog("b", t));
        assert!(q.add("c", t));
        assert_eq!(q.depth(), 3);
        let order: Vec<_> = std::iter::from_fn(|| q.pop(t).map(|p| p.key)).collect();
        assert_eq!(order, ["c", "a", "b"]);
    }

    #[test]
    fn a_backlog_key_that_changes_moves_up_and_is_handed_out_once() {
        let (mut q, t) = queue();
        for key in ["a", "b", "c"] {
            q.add_backlog(key, t);
        }
        // Not newly waiting: it moves up, the depth stays.
        assert!(!q.add("b", t + Duration::from_millis(5)));
        assert_eq!(q.depth(), 3);
        let first = q.pop(t + Duration::from_millis(9)).unwrap();
        assert_eq!(first.key, "b");
        // It waited since it was first queued.
        assert_eq!(first.waited, Duration::from_millis(9));
        let order: Vec<_> = std::iter::from_fn(|| q.pop(t).map(|p| p.key)).collect();
        assert_eq!(order, ["a", "c"]);
        assert_eq!(q.depth(), 0);
    }

    #[test]
    fn a_backlog_add_neither_demotes_nor_duplicates_a_waiting_key() {
        let (mut q, t) = queue();
        q.add("a", t);
        assert!(!q.add_backlog("a", t));
        q.add_backlog("b", t);
        assert!(q.add("c", t));
        let order: Vec<_> = std::iter::from_fn(|| q.pop(t).map(|p| p.key)).collect();
        assert_eq!(order, ["a", "c", "b"]);
    }

    #[test]
    fn an_entry_a_key_left_behind_never_hands_it_out_early() {
        let (mut q, t) = queue();
        q.add_backlog("a", t);
        q.add_backlog("b", t);
        q.add("a", t);
        let a = q.pop(t).unwrap();
        q.done(&a.key, Outcome::Success, t);
        // Back in the backlog, behind "b": the entry "a" left at the front is not its own.
        assert!(q.add_backlog("a", t));
        let order: Vec<_> = std::iter::from_fn(|| q.pop(t).map(|p| p.key)).collect();
        assert_eq!(order, ["b", "a"]);
    }

    #[test]
    fn a_backlog_add_while_processing_runs_the_key_again_when_done() {
        let (mut q, t) = queue();
        q.add("a", t);
        let a = q.pop(t).unwrap();
        assert!(q.add_backlog("a", t));
        assert!(q.pop(t).is_none());
        q.done(&a.key, Outcome::Success, t);
        assert_eq!(q.pop(t).unwrap().key, "a");
    }

    #[test]
    fn a_key_is_never_handed_out_twice_at_once() {
        let (mut q, t) = queue();
        q.add("a", t);
        let first = q.pop(t).unwrap();
        // Changes while it runs mark it dirty instead of queueing a second copy.
        assert!(q.add("a", t));
        assert!(!q.add("a", t));
        assert!(q.pop(t).is_none());
        q.done(&first.key, Outcome::Success, t);
        assert_eq!(q.pop(t).unwrap().key, "a");
    }

    #[test]
    fn failures_back_off_exponentially_up_to_the_cap_and_reset_on_success() {
        let (mut q, t) = queue();
        let b = Backoff::default();
        assert_eq!(b.delay(1), Duration::from_millis(200));
        assert_eq!(b.delay(2), Duration::from_millis(400));
        assert_eq!(b.delay(40), Duration::from_secs(300));

        q.add("a", t);
        let mut now = t;
        for attempt in 1..=3u32 {
            let popped = q.pop(now).unwrap();
            assert_eq!(popped.retries, attempt - 1);
            let delay = q.done(&"a", Outcome::Failure, now).unwrap();
            assert_eq!(delay, b.delay(attempt));
            assert!(q.pop(now + delay - Duration::from_millis(1)).is_none());
            now += delay;
        }
        let popped = q.pop(now).unwrap();
        assert_eq!(popped.retries, 3);
        q.done(&"a", Outcome::Success, now);
        q.add("a", now);
        assert_eq!(q.pop(now).unwrap().retries, 0);
    }

    #[test]
    fn persistent_failure_retries_a_bounded_number_of_times_per_minute() {
        let (mut q, t) = queue();
        q.add("a", t);
        let mut now = t;
        let mut attempts = 0;
        while now < t + Duration::from_secs(60) {
            if q.pop(now).is_some() {
                attempts += 1;
                q.done(&"a", Outcome::Failure, now);
            }
            now = q.next_due().unwrap();
        }
        assert!(attempts <= 10, "{attempts} attempts in a minute");
    }

    #[test]
    fn requeue_after_waits_and_an_immediate_add_overrides_it() {
        let (mut q, t) = queue();
        q.add("a", t);
        q.pop(t);
        q.done(&"a", Outcome::RequeueAfter(Duration::from_secs(10)), t);
        assert_eq!(q.depth(), 0);
        assert_eq!(q.delayed(), 1);
        assert!(q.pop(t + Duration::from_secs(9)).is_none());
        q.add("a", t + Duration::from_secs(1));
        assert_eq!(q.delayed(), 0);
        assert_eq!(q.pop(t + Duration::from_secs(1)).unwrap().key, "a");
    }

    #[test]
    fn an_earlier_schedule_wins() {
        let (mut q, t) = queue();
        q.add_at("a", t + Duration::from_secs(10));
        q.add_at("a", t + Duration::from_secs(5));
        q.add_at("a", t + Duration::from_secs(7));
        assert_eq!(q.next_due(), Some(t + Duration::from_secs(5)));
        assert_eq!(q.delayed(), 1);
    }

    #[test]
    fn dirty_while_failing_runs_again_at_once() {
        let (mut q, t) = queue();
        q.add("a", t);
        q.pop(t);
        q.add("a", t);
        q.done(&"a", Outcome::Failure, t);
        assert_eq!(q.pop(t).unwrap().key, "a");
    }

    #[test]
    fn queue_latency_and_unfinished_work_are_measured() {
        let (mut q, t) = queue();
        q.add("a", t);
        q.add("b", t);
        let popped = q.pop(t + Duration::from_millis(30)).unwrap();
        assert_eq!(popped.waited, Duration::from_millis(30));
        q.pop(t + Duration::from_millis(40));
        let (sum, longest) = q.unfinished(t + Duration::from_millis(100));
        assert_eq!(longest, Duration::from_millis(70));
        assert_eq!(sum, Duration::from_millis(130));
        assert_eq!(q.in_flight(), 2);
    }

    #[test]
    fn clear_forgets_waiting_keys_but_not_running_ones() {
        let (mut q, t) = queue();
        q.add("a", t);
        q.add("b", t);
        q.pop(t);
        q.add_at("c", t + Duration::from_secs(1));
        q.clear();
        assert_eq!((q.depth(), q.delayed(), q.in_flight()), (0, 0, 1));
        q.done(&"a", Outcome::Success, t);
        assert_eq!(q.in_flight(), 0);
    }
}
