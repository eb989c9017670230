//! `leasehold-sim` (run it as `cargo xtask simulate`): deterministic simulation of
//! kube-leasehold's leadership. Each seed draws a history (replicas, timings, faults);
//! the crate's real election, fence and term lifecycle run it against a simulated API
//! server on a paused clock, and the invariants are checked on the server's effect order.
//! A failing seed is shrunk to the fewest faults that still fail, and printed with its
//! trace and the command that replays it.

mod caches;
mod check;
mod history;
mod net;
mod pods;
#[cfg(test)]
mod regressions;
mod replica;
mod rng;
mod run;
mod server;
mod world;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use kube_leasehold::bugs::{self, Bug};

use crate::history::History;
use crate::run::{Outcome, run};

#[derive(Parser, Debug)]
#[command(
    name = "cargo xtask simulate",
    about = "Deterministic simulation of the leadership code: seeded adversarial histories"
)]
struct Args {
    /// How many seeds to run (from --first on).
    #[arg(long, default_value_t = 2000)]
    seeds: u64,
    /// The first seed of the run.
    #[arg(long, default_value_t = 1)]
    first: u64,
    /// Also run this many seeds drawn from the clock (printed, so a failure replays).
    #[arg(long, default_value_t = 0)]
    random: u64,
    /// Run this one seed and print its trace (replay).
    #[arg(long)]
    seed: Option<u64>,
    /// With --seed: keep only these faults of its history (a shrunk history).
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<usize>>,
    /// Replicas in each history.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Shard Leases in every history (scale-out; 0: one Lease). Default: drawn per
    /// history (30% run 2 to 4 shard Leases).
    #[arg(long)]
    shard_leases: Option<usize>,
    /// Re-introduce one historical defect; the run succeeds when a seed catches it.
    #[arg(long)]
    bug: Option<String>,
    /// Re-introduce each historical defect in turn and report the seed that catches it.
    #[arg(long, conflicts_with_all = ["bug", "seed"])]
    every_bug: bool,
    /// Print the trace of the replayed seed even when it passes.
    #[arg(long)]
    trace: bool,
    /// Threads running histories (default: the machine's cores).
    #[arg(long)]
    jobs: Option<usize>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !cfg!(tokio_unstable) {
        bail!(
            "build the simulator with RUSTFLAGS=\"--cfg tokio_unstable\" (cargo xtask simulate \
             does): only then are tokio's own choices seeded, and a seed replays"
        );
    }
    if !(1..=7).contains(&args.replicas) {
        bail!("--replicas must be between 1 and 7 (got {})", args.replicas);
    }
    let bug = match &args.bug {
        Some(name) => Some(Bug::named(name).with_context(|| {
            let names: Vec<_> = Bug::ALL.iter().map(|(_, n)| *n).collect();
            format!("unknown --bug {name:?}; known: {}", names.join(", "))
        })?),
        None => None,
    };
    if args
        .shard_leases
        .is_some_and(|k| !(0..=16).contains(&k) || k == 1)
    {
        bail!(
            "--shard-leases must be 0 (one Lease) or between 2 and 16 (got {})",
            args.shard_leases.unwrap_or_default()
        );
    }
    bugs::set(bug);
    run::catch_panics();
    match args.seed {
        Some(seed) => replay(&args, seed),
        None if args.every_bug => every_bug(&args),
        None => explore(&args, bug),
    }
}

/// The history `seed` draws, with the shard Leases `--shard-leases` asks for.
fn drawn(args: &Args, seed: u64) -> History {
    let history = History::generate(seed, args.replicas);
    match args.shard_leases {
        Some(shards) => history.with_shards(shards),
        None => history,
    }
}

fn history(args: &Args, seed: u64) -> History {
    let history = drawn(args, seed);
    match &args.only {
        Some(only) => history.only(only),
        None => history,
    }
}

/// The command that replays `seed` (with only `only` of its faults, if shrunk).
fn replay_command(args: &Args, seed: u64, only: Option<&[usize]>) -> String {
    let mut command = format!("cargo xtask simulate --seed {seed}");
    if args.replicas != 3 {
        command += &format!(" --replicas {}", args.replicas);
    }
    if let Some(shards) = args.shard_leases {
        command += &format!(" --shard-leases {shards}");
    }
    if let Some(bug) = &args.bug {
        command += &format!(" --bug {bug}");
    }
    if let Some(only) = only {
        let only: Vec<String> = only.iter().map(usize::to_string).collect();
        command += &format!(" --only {}", only.join(","));
    }
    command
}

fn describe(history: &History) -> String {
    let mut text = String::new();
    for (i, r) in history.replicas.iter().enumerate() {
        let t = r.timings;
        text += &format!(
            "  r{i}: lease {:?}, renew deadline {:?}, retry {:?}; wall clock {}{:?}\n",
            t.lease_duration,
            t.renew_deadline,
            t.retry_period,
            if r.behind { "-" } else { "+" },
            r.skew
        );
    }
    if history.pods {
        text += "  in Pods: the kubelets report the containers (crash proof, successor hand-off)\n";
    }
    if history.shards > 0 {
        text += &format!(
            "  scale-out: {} shard Leases, a member Lease per replica, {} keys\n",
            history.shards, history.keys
        );
    }
    for f in &history.faults {
        text += &format!(
            "  fault #{} at {:.3}s: {}{}\n",
            f.number,
            f.at.as_secs_f64(),
            f.fault,
            if history.shards > 0 && f.fault.is_foreign() {
                format!(" ({})", history.target(f.number))
            } else {
                String::new()
            }
        );
    }
    text
}

fn replay(args: &Args, seed: u64) -> Result<()> {
    let history = history(args, seed);
    let outcome = run(&history, true);
    println!(
        "seed {seed}: {} replicas\n{}",
        history.replicas.len(),
        describe(&history)
    );
    if args.trace || !outcome.violations.is_empty() {
        for line in &outcome.trace {
            println!("{line}");
        }
    }
    report(&outcome);
    if outcome.violations.is_empty() {
        println!(
            "seed {seed} passes ({:.0} s simulated)",
            outcome.simulated.as_secs_f64()
        );
        Ok(())
    } else {
        bail!("seed {seed} fails")
    }
}

fn report(outcome: &Outcome) {
    for v in &outcome.violations {
        println!("VIOLATION [{}] {}", v.invariant, v.what);
    }
}

/// Shrinks a failing history to the fewest faults that still break the same invariant.
fn shrink(args: &Args, seed: u64, invariant: &str) -> (Vec<usize>, Outcome) {
    let full = drawn(args, seed);
    let mut kept: Vec<usize> = (0..full.faults.len()).collect();
    let fails = |kept: &[usize]| {
        let outcome = run(&full.clone().only(kept), false);
        outcome
            .violations
            .iter()
            .any(|v| v.invariant == invariant)
            .then_some(outcome)
    };
    let mut i = kept.len();
    while i > 0 {
        i -= 1;
        let mut fewer = kept.clone();
        fewer.remove(i);
        if fails(&fewer).is_some() {
            kept = fewer;
        }
    }
    let outcome = run(&full.only(&kept), true);
    (kept, outcome)
}

/// What a run of many seeds found.
struct Search {
    /// The seeds, in order.
    seeds: Vec<u64>,
    /// The failing ones: (index in `seeds`, seed, outcome), in seed order.
    failures: Vec<(usize, u64, Outcome)>,
    /// Simulated time of each history run (`None`: not run, the search stopped).
    simulated: Vec<Option<Duration>>,
    /// Wall time.
    took: Duration,
    /// Threads.
    jobs: usize,
}

impl Search {
    /// Histories run.
    fn ran(&self) -> usize {
        self.simulated.iter().flatten().count()
    }

    /// Simulated time of the histories up to and including index `upto`.
    fn simulated_until(&self, upto: usize) -> Duration {
        self.simulated[..=upto].iter().flatten().sum()
    }
}

/// Runs the seeds of `args` on every core; with `stop_at_first`, stops at the first
/// failure in seed order (every seed before it still runs).
fn search(args: &Args, stop_at_first: bool) -> Search {
    let mut seeds: Vec<u64> = (args.first..args.first + args.seeds).collect();
    if args.random > 0 {
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        let mut rng = rng::Rng::new(clock);
        let random: Vec<u64> = (0..args.random).map(|_| rng.next_u64() >> 16).collect();
        println!("random seeds: {random:?}");
        seeds.extend(random);
    }
    let jobs = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let next = AtomicU64::new(0);
    let stop_at = AtomicU64::new(u64::MAX);
    let failures = Mutex::new(Vec::new());
    let simulated = Mutex::new(vec![None; seeds.len()]);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    if index as usize >= seeds.len() || index > stop_at.load(Ordering::Relaxed) {
                        return;
                    }
                    let seed = seeds[index as usize];
                    let outcome = run(&drawn(args, seed), false);
                    simulated.lock().expect("lock")[index as usize] = Some(outcome.simulated);
                    if !outcome.violations.is_empty() {
                        if stop_at_first {
                            stop_at.fetch_min(index, Ordering::Relaxed);
                        }
                        failures
                            .lock()
                            .expect("lock")
                            .push((index as usize, seed, outcome));
                    }
                }
            });
        }
    });
    let mut failures = failures.into_inner().expect("lock");
    failures.sort_by_key(|(index, _, _)| *index);
    if stop_at_first {
        failures.truncate(1);
    }
    Search {
        seeds,
        failures,
        simulated: simulated.into_inner().expect("lock"),
        took: started.elapsed(),
        jobs,
    }
}

fn explore(args: &Args, bug: Option<Bug>) -> Result<()> {
    let found = search(args, bug.is_some());
    let ran = found.ran();
    println!(
        "{ran} histories, {:.1} simulated hours, in {:.1} s ({:.0} histories/s, {} threads)",
        found.simulated_until(found.seeds.len() - 1).as_secs_f64() / 3600.0,
        found.took.as_secs_f64(),
        ran as f64 / found.took.as_secs_f64().max(1e-9),
        found.jobs
    );
    let Some((index, seed, outcome)) = found.failures.first() else {
        return match bug {
            Some(bug) => bail!(
                "--bug {} was NOT caught by {ran} seeds: the simulator cannot see it",
                bug.name()
            ),
            None => {
                println!("every history kept every invariant");
                Ok(())
            }
        };
    };
    let invariant = outcome.violations[0].invariant;
    if bug.is_none() {
        println!(
            "{} of {ran} histories failed; the first in seed order is seed {seed}",
            found.failures.len()
        );
    }
    let (kept, shrunk) = shrink(args, *seed, invariant);
    let history = drawn(args, *seed).only(&kept);
    println!(
        "seed {seed} [{invariant}], shrunk to {} of its faults:\n{}",
        kept.len(),
        describe(&history)
    );
    if bug.is_none() || args.trace {
        for line in &shrunk.trace {
            println!("{line}");
        }
    }
    report(&shrunk);
    println!("replay: {}", replay_command(args, *seed, Some(&kept)));
    match bug {
        Some(bug) => {
            println!(
                "CAUGHT --bug {} with seed {seed}: history #{} of the run, {:.1} simulated minutes in",
                bug.name(),
                index + 1,
                found.simulated_until(*index).as_secs_f64() / 60.0
            );
            Ok(())
        }
        None => bail!("{} histories broke an invariant", found.failures.len()),
    }
}

/// Every historical defect in turn: the seed that catches it, how many histories and how
/// much simulated time it took, and the broken invariant (the README's table).
fn every_bug(args: &Args) -> Result<()> {
    println!("| defect | caught by seed | histories | simulated time | invariant broken |");
    println!("|---|---|---|---|---|");
    let mut missed = Vec::new();
    for (bug, name) in Bug::ALL {
        bugs::set(Some(bug));
        let found = search(args, true);
        match found.failures.first() {
            Some((index, seed, outcome)) => println!(
                "| `{name}` | {seed} | {} | {:.1} min | {} |",
                index + 1,
                found.simulated_until(*index).as_secs_f64() / 60.0,
                outcome.violations[0].invariant
            ),
            None => {
                println!(
                    "| `{name}` | NOT CAUGHT in {} histories | | | |",
                    found.ran()
                );
                missed.push(name);
            }
        }
    }
    bugs::set(None);
    if !missed.is_empty() {
        bail!("the simulator did not catch: {}", missed.join(", "));
    }
    Ok(())
}
