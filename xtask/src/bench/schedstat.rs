//! Where a process's threads spent a stretch of time, from the kernel's per-thread
//! `/proc/PID/task/TID/schedstat` (nanoseconds on a CPU, nanoseconds runnable but waiting
//! for one), sampled every [`EVERY`]: tells a stall the process caused (its threads ran)
//! from one the machine caused (they waited for a CPU) from one where they slept (waiting
//! for I/O, a lock, a timer, or work).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

/// How often the threads are read.
const EVERY: Duration = Duration::from_millis(5);
/// Samples kept at most (a minute at [`EVERY`]): the sampler stops recording past it.
const MAX_SAMPLES: usize = 12_000;

/// One reading: per thread, (ns on a CPU, ns waiting for one).
struct Sample {
    at: Timestamp,
    threads: HashMap<u32, (u64, u64)>,
}

/// A thread reading `/proc/PID/task/*/schedstat` every [`EVERY`] until stopped.
pub(super) struct Sampler {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Vec<Sample>>,
}

/// What a process's threads did over a window, summed over its threads.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) struct Spent {
    pub ran_ms: f64,
    pub waited_for_cpu_ms: f64,
}

/// What the samples saw.
pub(super) struct Samples(Vec<Sample>);

impl Sampler {
    pub(super) fn start(pid: u32) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stopped.load(Ordering::Relaxed) && samples.len() < MAX_SAMPLES {
                samples.push(Sample {
                    at: Timestamp::now(),
                    threads: read(pid),
                });
                std::thread::sleep(EVERY);
            }
            samples
        });
        Sampler { stop, handle }
    }

    pub(super) fn stop(self) -> Samples {
        self.stop.store(true, Ordering::Relaxed);
        Samples(self.handle.join().unwrap_or_default())
    }
}

/// Every thread of `pid` now (threads that end meanwhile are skipped).
fn read(pid: u32) -> HashMap<u32, (u64, u64)> {
    let mut threads = HashMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        if let Some(times) = std::fs::read_to_string(task.path().join("schedstat"))
            .ok()
            .and_then(|s| parse(&s))
        {
            threads.insert(tid, times);
        }
    }
    threads
}

/// `schedstat`'s first two fields: time on a CPU and time waiting on a run queue (ns).
fn parse(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace().map(|f| f.parse::<u64>().ok());
    Some((fields.next()??, fields.next()??))
}

impl Samples {
    /// From the last sample at or before `from` to the first at or after `to`: what the
    /// threads present in both did (the window grows by up to [`EVERY`] at each end).
    pub(super) fn spent(&self, from: Timestamp, to: Timestamp) -> Option<Spent> {
        let first = self.0.iter().rev().find(|s| s.at <= from)?;
        let last = self.0.iter().find(|s| s.at >= to)?;
        Some(between(first, last))
    }

    /// Over the whole sampled stretch.
    pub(super) fn total(&self) -> Option<Spent> {
        Some(between(self.0.first()?, self.0.last()?))
    }
}

fn between(first: &Sample, last: &Sample) -> Spent {
    let mut spent = Spent::default();
    for (tid, (run, wait)) in &last.threads {
        let (run0, wait0) = first.threads.get(tid).copied().unwrap_or((0, 0));
        spent.ran_ms += run.saturating_sub(run0) as f64 / 1e6;
        spent.waited_for_cpu_ms += wait.saturating_sub(wait0) as f64 / 1e6;
    }
    spent
}

impl Spent {
    pub(super) fn json(self) -> Value {
        json!({
            "ran_ms": (self.ran_ms * 100.0).round() / 100.0,
            "waited_for_cpu_ms": (self.waited_for_cpu_ms * 100.0).round() / 100.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_counts_what_threads_present_at_both_ends_did() {
        assert_eq!(parse("2000000 3000000 7\n"), Some((2_000_000, 3_000_000)));
        assert_eq!(parse("garbage"), None);
        let t = |ms: i64| Timestamp::from_millisecond(1_767_225_600_000 + ms).unwrap();
        let sample = |ms, threads: &[(u32, u64, u64)]| Sample {
            at: t(ms),
            threads: threads.iter().map(|&(t, r, w)| (t, (r, w))).collect(),
        };
        let samples = Samples(vec![
            sample(0, &[(1, 0, 0), (2, 0, 0)]),
            sample(5, &[(1, 1_000_000, 0), (2, 0, 4_000_000)]),
            // Thread 3 began in the window: counted from zero; thread 2 ended: not counted.
            sample(10, &[(1, 2_000_000, 0), (3, 1_000_000, 1_000_000)]),
        ]);
        assert_eq!(
            samples.spent(t(1), t(6)),
            Some(Spent {
                ran_ms: 2.0 + 1.0,
                waited_for_cpu_ms: 1.0
            })
        );
        assert_eq!(
            samples.spent(t(0), t(5)),
            Some(Spent {
                ran_ms: 1.0,
                waited_for_cpu_ms: 4.0
            })
        );
        assert_eq!(
            samples.spent(t(6), t(11)),
            None,
            "no sample after the window"
        );
        assert!(samples.total().is_some());
    }
}
