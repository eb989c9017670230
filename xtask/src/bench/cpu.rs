//! CPU per process over a phase of the benchmark: the control-plane components, the
//! benchmark itself and the replicas measured.

use serde_json::{Value, json};

use super::Bench;

impl Bench {
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
        write!(
            f,
            " (total {:.2})",
            self.cores.iter().map(|c| c.1).sum::<f64>()
        )
    }
}
