//! CPU per process over a phase of the benchmark: the control-plane components, the
//! benchmark itself and the replicas measured.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::Bench;

/// A window counts as quiet when the control plane, this process and the replicas measured
/// use fewer cores than this together over it.
const QUIET_CORES: f64 = 0.3;
/// The window [`Bench::settle`] measures.
const QUIET_WINDOW: Duration = Duration::from_secs(1);
/// How long [`Bench::settle`] waits for a quiet window before it gives up and says so.
const QUIET_WITHIN: Duration = Duration::from_secs(180);

/// How the machine settled before a section.
pub(super) struct Settled {
    waited_seconds: f64,
    quiet: bool,
    /// The last window measured.
    last: CpuSplit,
}

impl Settled {
    pub(super) fn json(&self) -> Value {
        json!({"waited_seconds": self.waited_seconds, "quiet": self.quiet, "last_window": self.last.json()})
    }
}

impl std::fmt::Display for Settled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let outcome = if self.quiet { "quiet" } else { "still busy" };
        write!(
            f,
            "{outcome} after {:.1} s (under {QUIET_CORES} cores over {} s; the last window {})",
            self.waited_seconds,
            QUIET_WINDOW.as_secs(),
            self.last
        )
    }
}

impl Bench {
    /// Waits, up to [`QUIET_WITHIN`], for a [`QUIET_WINDOW`] in which the control plane, this
    /// process and `extra` use under [`QUIET_CORES`] together: an idle measurement taken
    /// while the API server is still busy with an earlier phase measures the machine.
    pub(super) async fn settle(&mut self, extra: &[(&str, u32)]) -> Settled {
        let started = Instant::now();
        let mut before = self.cpu(extra);
        loop {
            tokio::time::sleep(QUIET_WINDOW).await;
            let after = self.cpu(extra);
            let last = CpuSplit::between(&before, &after, QUIET_WINDOW.as_secs_f64());
            before = after;
            let quiet = last.total() < QUIET_CORES;
            if quiet || started.elapsed() >= QUIET_WITHIN {
                return Settled {
                    waited_seconds: started.elapsed().as_secs_f64(),
                    quiet,
                    last,
                };
            }
        }
    }

    /// CPU seconds used so far by each control-plane component, this process and `extra`.
    pub(super) fn cpu(&mut self, extra: &[(&str, u32)]) -> Vec<(String, f64)> {
        let mut pids: Vec<(String, u32)> = ["etcd", "kube-apiserver", "kube-controller-manager"]
            .into_iter()
            .filter_map(|name| Some((name.to_string(), self.cluster.process(name)?.pid)))
            .collect();
        pids.push(("bench".into(), std::process::id()));
        pids.extend(extra.iter().map(|(name, pid)| (name.to_string(), *pid)));
        pids.into_iter()
            .map(|(name, pid)| (name, e2e::process::cpu_seconds(pid).unwrap_or(0.0)))
            .collect()
    }
}

/// CPU used by each process over a phase, as average cores busy.
#[derive(Clone)]
pub(super) struct CpuSplit {
    wall_seconds: f64,
    cores: Vec<(String, f64)>,
}

impl CpuSplit {
    pub(super) fn between(
        before: &[(String, f64)],
        after: &[(String, f64)],
        wall_seconds: f64,
    ) -> CpuSplit {
        let cores = after
            .iter()
            .map(|(name, cpu)| {
                let start = before.iter().find(|(n, _)| n == name).map_or(0.0, |b| b.1);
                (name.clone(), (cpu - start) / wall_seconds)
            })
            .collect();
        CpuSplit {
            wall_seconds,
            cores,
        }
    }

    /// Two phases as one: CPU and wall time added up.
    pub(super) fn combine(a: &CpuSplit, b: &CpuSplit) -> CpuSplit {
        let wall_seconds = a.wall_seconds + b.wall_seconds;
        let cores = a
            .cores
            .iter()
            .map(|(name, cores)| {
                let other = b.cores.iter().find(|(n, _)| n == name).map_or(0.0, |c| c.1);
                let cpu = cores * a.wall_seconds + other * b.wall_seconds;
                (name.clone(), cpu / wall_seconds)
            })
            .collect();
        CpuSplit {
            wall_seconds,
            cores,
        }
    }

    /// Cores busy on average, all processes together.
    pub(super) fn total(&self) -> f64 {
        self.cores.iter().map(|c| c.1).sum()
    }

    /// CPU seconds `process` used over the phase.
    pub(super) fn seconds_of(&self, process: &str) -> f64 {
        self.cores
            .iter()
            .find(|(n, _)| n == process)
            .map_or(0.0, |(_, cores)| cores * self.wall_seconds)
    }

    pub(super) fn json(&self) -> Value {
        let cores: serde_json::Map<String, Value> = self
            .cores
            .iter()
            .map(|(n, c)| (n.clone(), json!(c)))
            .collect();
        json!({"wall_seconds": self.wall_seconds, "cores": cores})
    }
}

impl std::fmt::Display for CpuSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "over {:.1} s:", self.wall_seconds)?;
        for (name, cores) in &self.cores {
            write!(f, " {name} {cores:.2}")?;
        }
        write!(f, " (total {:.2})", self.total())
    }
}
