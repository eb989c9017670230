//! A history: the replicas, their timings and the faults to inject, all drawn from one
//! seed. A shrunk history keeps a subset of the faults (`--only`).

use std::fmt;
use std::time::Duration;

use kube_leasehold::Timings;
use kube_leasehold::scaleout::{member_lease, shard_lease};

use crate::rng::Rng;

/// One replica slot: a Pod whose process may be killed and restarted (same identity, new
/// incarnation), as a container restarts in the same Pod.
#[derive(Debug, Clone)]
pub struct Replica {
    /// The identity its processes stand with.
    pub identity: String,
    /// Its Lease timings (a rolling upgrade mixes them).
    pub timings: Timings,
    /// Its node's wall clock, ahead (+) or behind (-) true time.
    pub skew: Duration,
    /// Whether the skew is behind.
    pub behind: bool,
}

/// What goes wrong, and to whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL of the replica's process; a new one starts after `down`.
    Crash { replica: usize, down: Duration },
    /// SIGTERM (graceful shutdown: fence, workers, release); a new one starts after `down`.
    Shutdown { replica: usize, down: Duration },
    /// SIGSTOP, then SIGCONT after `lasting`: nothing it sends or receives moves meanwhile.
    Freeze { replica: usize, lasting: Duration },
    /// The replica's kubelet reports nothing for `lasting` (its Pod's status goes stale).
    KubeletSilent { replica: usize, lasting: Duration },
    /// The replica cannot reach the API server (both ways), for `lasting`.
    Partition { replica: usize, lasting: Duration },
    /// The API server is down: connections refused (`refused`) or requests hang.
    Outage { lasting: Duration, refused: bool },
    /// The API server is overloaded: each request waits up to `up_to` before it is handled.
    Slow { lasting: Duration, up_to: Duration },
    /// Priority and fairness throttles the replica's Lease requests (429); its other
    /// requests go through.
    ThrottleLeases { replica: usize, lasting: Duration },
    /// A foreign writer deletes the Lease (with shard Leases: the one
    /// [`History::target`] names, as for every foreign write).
    Delete,
    /// A foreign writer clears the holder, leaving the rest of the record.
    ClearHolder,
    /// A foreign writer changes only the Lease's labels (never the group's label).
    Relabel,
    /// A foreign controller relabels the Lease every `every`, for `lasting` (a label
    /// syncer, a GitOps tool): metadata-only writes, one after another.
    Relabeler { lasting: Duration, every: Duration },
    /// A foreign writer names a replica as holder, with fresh times.
    NameHolder { replica: usize },
    /// A foreign writer names a replica as the successor of the record (what a releasing
    /// leader writes), whether it is released or not.
    ForgeSuccessor { replica: usize },
    /// The replica's node steps its wall clock.
    StepWall {
        replica: usize,
        by: Duration,
        back: bool,
    },
    /// The API server ends every watch.
    EndWatches,
    /// The API server compacts: watches from an older resourceVersion get 410 Gone.
    Compact,
}

impl Fault {
    /// How long it lasts (a restart counts until the new process starts).
    pub fn lasting(&self) -> Duration {
        match self {
            Fault::Crash { down, .. } | Fault::Shutdown { down, .. } => *down,
            Fault::Freeze { lasting, .. }
            | Fault::Partition { lasting, .. }
            | Fault::Outage { lasting, .. }
            | Fault::Slow { lasting, .. }
            | Fault::ThrottleLeases { lasting, .. }
            | Fault::KubeletSilent { lasting, .. }
            | Fault::Relabeler { lasting, .. } => *lasting,
            _ => Duration::ZERO,
        }
    }

    /// Whether a foreign writer makes it (it hits the Lease [`History::target`] names).
    pub fn is_foreign(&self) -> bool {
        matches!(
            self,
            Fault::Delete
                | Fault::ClearHolder
                | Fault::Relabel
                | Fault::Relabeler { .. }
                | Fault::NameHolder { .. }
                | Fault::ForgeSuccessor { .. }
        )
    }

    /// The replica it happens to, if one.
    pub fn replica(&self) -> Option<usize> {
        match self {
            Fault::Crash { replica, .. }
            | Fault::Shutdown { replica, .. }
            | Fault::Freeze { replica, .. }
            | Fault::Partition { replica, .. }
            | Fault::ThrottleLeases { replica, .. }
            | Fault::KubeletSilent { replica, .. }
            | Fault::StepWall { replica, .. } => Some(*replica),
            _ => None,
        }
    }

    /// Whether it keeps the replica from hearing from or reaching the API server while
    /// it lasts (every fault but the foreign writes, wall steps and watch ends).
    pub fn cuts(&self, replica: usize) -> bool {
        match self {
            Fault::Outage { .. } | Fault::Slow { .. } => true,
            Fault::Crash { .. }
            | Fault::Shutdown { .. }
            | Fault::Freeze { .. }
            | Fault::Partition { .. }
            | Fault::ThrottleLeases { .. } => self.replica() == Some(replica),
            _ => false,
        }
    }
}

/// A fault at a time.
#[derive(Debug, Clone)]
pub struct Scheduled {
    /// Its number in the history as drawn (kept by a shrunk history: `--only` names it).
    pub number: usize,
    /// When, from the start.
    pub at: Duration,
    /// What.
    pub fault: Fault,
}

impl Scheduled {
    /// When it is over.
    pub fn until(&self) -> Duration {
        self.at + self.fault.lasting()
    }
}

/// A whole history.
#[derive(Debug, Clone)]
pub struct History {
    /// The seed it was drawn from (latencies and the like are drawn from it as it runs).
    pub seed: u64,
    /// The replica slots.
    pub replicas: Vec<Replica>,
    /// The faults, in time order.
    pub faults: Vec<Scheduled>,
    /// The keys the leader writes.
    pub keys: usize,
    /// Whether the replicas run in Pods whose kubelets report their containers (the crash
    /// proof and successor hand-off), or as bare processes.
    pub pods: bool,
    /// Scale-out: this many shard Leases, a member Lease per replica and the plan (0: one
    /// Lease).
    pub shards: usize,
}

/// The Lease every replica stands for (with shard Leases: the group's name, which their
/// names start with).
pub const LEASE: &str = "sim-leader";

/// The first fault starts after the replicas settled.
const FIRST_FAULT: Duration = Duration::from_secs(5);
/// Faults start within this.
const FAULT_WINDOW: Duration = Duration::from_secs(150);
/// The share of drawn histories that run scale-out (2 to 4 shard Leases).
const SCALE_OUT: f64 = 0.3;

impl History {
    /// The history `seed` draws for `replicas` replicas.
    pub fn generate(seed: u64, replicas: usize) -> History {
        let mut rng = Rng::new(seed);
        let standard = Timings::default();
        // A rolling upgrade that changes the timings: some replicas run others.
        let mixed = rng.chance(0.3);
        let replicas: Vec<Replica> = (0..replicas)
            .map(|i| {
                let timings = if mixed && i > 0 {
                    *rng.pick(&[
                        standard,
                        timings(8, 6, 2),
                        timings(20, 14, 3),
                        timings(10, 7, 1),
                    ])
                } else {
                    standard
                };
                Replica {
                    identity: format!("r{i}"),
                    timings,
                    skew: rng.between(Duration::ZERO, Duration::from_secs(90)),
                    behind: rng.chance(0.5),
                }
            })
            .collect();
        let n = replicas.len();
        let count = 1 + rng.below(8) as usize;
        let mut faults: Vec<Scheduled> = (0..count)
            .map(|_| Scheduled {
                number: 0,
                at: rng.between_ms(FIRST_FAULT, FAULT_WINDOW),
                fault: draw_fault(&mut rng, n),
            })
            .collect();
        faults.sort_by_key(|f| f.at);
        // Drawn after everything above, and listed after the other faults, so that a seed
        // drawn before Pods were simulated keeps its faults and their numbers.
        let pods = rng.chance(0.5);
        if pods {
            let mut silences: Vec<Scheduled> = (0..rng.below(3))
                .map(|_| Scheduled {
                    number: 0,
                    at: rng.between_ms(FIRST_FAULT, FAULT_WINDOW),
                    fault: Fault::KubeletSilent {
                        replica: rng.below(n as u64) as usize,
                        lasting: rng.between_ms(Duration::from_secs(1), Duration::from_secs(60)),
                    },
                })
                .collect();
            silences.sort_by_key(|f| f.at);
            faults.extend(silences);
        }
        // Drawn last, for the same reason.
        let shards = if rng.chance(SCALE_OUT) {
            2 + rng.below(3) as usize
        } else {
            0
        };
        // A rolling upgrade under load: the API server throttles one replica's Lease
        // requests while its writes go through (the case where replicas' differing lease
        // durations matter most), in half the mixed histories.
        if mixed && rng.chance(0.5) {
            faults.push(Scheduled {
                number: 0,
                at: rng.between_ms(FIRST_FAULT, FAULT_WINDOW),
                fault: Fault::ThrottleLeases {
                    replica: rng.below(n as u64) as usize,
                    lasting: rng.between_ms(Duration::from_secs(5), Duration::from_secs(40)),
                },
            });
        }
        // A forged successor, in a fifth of the histories.
        if rng.chance(0.2) {
            faults.push(Scheduled {
                number: 0,
                at: rng.between_ms(FIRST_FAULT, FAULT_WINDOW),
                fault: Fault::ForgeSuccessor {
                    replica: rng.below(n as u64) as usize,
                },
            });
        }
        for (number, fault) in faults.iter_mut().enumerate() {
            fault.number = number;
        }
        History {
            seed,
            replicas,
            faults,
            keys: 6,
            pods,
            shards: 0,
        }
        .with_shards(shards)
    }

    /// The history with `shards` shard Leases (0: one Lease); more keys with more shards,
    /// so that each shard has some.
    pub fn with_shards(mut self, shards: usize) -> History {
        self.shards = shards;
        self.keys = if shards == 0 { 6 } else { 4 * shards };
        self
    }

    /// The history as bare processes, without Pods (and without kubelet faults).
    #[cfg(test)]
    pub fn without_pods(mut self) -> History {
        self.pods = false;
        self.faults
            .retain(|f| !matches!(f.fault, Fault::KubeletSilent { .. }));
        self
    }

    /// The Leases elections run for: the one Lease, or each shard's.
    pub fn elections(&self) -> Vec<String> {
        if self.shards == 0 {
            vec![LEASE.to_string()]
        } else {
            (0..self.shards).map(|i| shard_lease(LEASE, i)).collect()
        }
    }

    /// The Lease fault number `index`'s foreign write hits: the one Lease; with shard Leases, a
    /// shard's or a replica's member Lease, in turn.
    pub fn target(&self, index: usize) -> String {
        if self.shards == 0 {
            return LEASE.to_string();
        }
        let n = self.shards + self.replicas.len();
        match index % n {
            i if i < self.shards => shard_lease(LEASE, i),
            i => member_lease(LEASE, &self.replicas[i - self.shards].identity),
        }
    }

    /// The history with only the faults at `indices` (a shrunk history).
    pub fn only(mut self, indices: &[usize]) -> History {
        self.faults.retain(|f| indices.contains(&f.number));
        self
    }

    /// When the last fault is over.
    pub fn quiet_from(&self) -> Duration {
        self.faults
            .iter()
            .map(Scheduled::until)
            .max()
            .unwrap_or(Duration::ZERO)
    }

    /// The longest lease duration any replica waits or states.
    pub fn longest_lease(&self) -> Duration {
        self.replicas
            .iter()
            .map(|r| r.timings.lease_duration)
            .max()
            .unwrap_or_default()
    }

    /// The longest retry period, stretched by the driver's jitter.
    pub fn longest_retry(&self) -> Duration {
        self.replicas
            .iter()
            .map(|r| r.timings.retry_period.mul_f64(1.2))
            .max()
            .unwrap_or_default()
    }

    /// When the history ends: long enough after the last fault for a leader to be elected
    /// and to write every key.
    pub fn end(&self) -> Duration {
        self.quiet_from() + self.longest_lease() * 2 + self.longest_retry() * 4 + KEYS_TIME
    }
}

/// Enough for a leader to write every key ([`crate::replica`] writes one every ≤ 400 ms
/// per worker).
const KEYS_TIME: Duration = Duration::from_secs(10);

fn timings(lease: u64, renew: u64, retry: u64) -> Timings {
    Timings::new(
        Duration::from_secs(lease),
        Duration::from_secs(renew),
        Duration::from_secs(retry),
    )
    .expect("consistent timings")
}

fn draw_fault(rng: &mut Rng, replicas: usize) -> Fault {
    let replica = rng.below(replicas as u64) as usize;
    let s = Duration::from_secs;
    match rng.below(15) {
        0 | 1 => Fault::Crash {
            replica,
            down: rng.between_ms(s(0), s(30)),
        },
        2 => Fault::Shutdown {
            replica,
            down: rng.between_ms(s(0), s(20)),
        },
        3 => Fault::Freeze {
            replica,
            lasting: rng.between_ms(Duration::from_millis(100), s(30)),
        },
        4 | 5 => Fault::Partition {
            replica,
            lasting: rng.between_ms(Duration::from_millis(100), s(40)),
        },
        6 => Fault::Outage {
            lasting: rng.between_ms(s(1), s(40)),
            refused: rng.chance(0.5),
        },
        7 => Fault::Slow {
            lasting: rng.between_ms(s(1), s(30)),
            up_to: rng.between_ms(s(1), s(12)),
        },
        8 => Fault::ThrottleLeases {
            replica,
            lasting: rng.between_ms(s(1), s(40)),
        },
        9 => rng
            .pick(&[Fault::Delete, Fault::ClearHolder, Fault::Relabel])
            .clone(),
        10 => Fault::NameHolder { replica },
        11 => Fault::StepWall {
            replica,
            by: rng.between_ms(s(1), s(3600)),
            back: rng.chance(0.5),
        },
        12 => Fault::EndWatches,
        13 => Fault::Relabeler {
            lasting: rng.between_ms(s(5), s(60)),
            every: rng.between_ms(Duration::from_millis(500), s(5)),
        },
        _ => Fault::Compact,
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = |d: &Duration| format!("{:.3}s", d.as_secs_f64());
        match self {
            Fault::Crash { replica, down } => {
                write!(f, "SIGKILL r{replica}, restart after {}", d(down))
            }
            Fault::Shutdown { replica, down } => {
                write!(f, "SIGTERM r{replica}, restart after {}", d(down))
            }
            Fault::Freeze { replica, lasting } => {
                write!(f, "SIGSTOP r{replica} for {}", d(lasting))
            }
            Fault::Partition { replica, lasting } => {
                write!(
                    f,
                    "partition r{replica} from the API server for {}",
                    d(lasting)
                )
            }
            Fault::Outage { lasting, refused } => write!(
                f,
                "API server down for {} ({})",
                d(lasting),
                if *refused {
                    "connections refused"
                } else {
                    "requests hang"
                }
            ),
            Fault::Slow { lasting, up_to } => {
                write!(
                    f,
                    "API server slow for {} (each request up to {})",
                    d(lasting),
                    d(up_to)
                )
            }
            Fault::ThrottleLeases { replica, lasting } => {
                write!(f, "429 on r{replica}'s Lease requests for {}", d(lasting))
            }
            Fault::Delete => f.write_str("foreign writer deletes the Lease"),
            Fault::ClearHolder => f.write_str("foreign writer clears the holder"),
            Fault::Relabel => f.write_str("foreign writer relabels the Lease"),
            Fault::Relabeler { lasting, every } => write!(
                f,
                "foreign controller relabels the Lease every {} for {}",
                d(every),
                d(lasting)
            ),
            Fault::NameHolder { replica } => write!(f, "foreign writer names r{replica} holder"),
            Fault::ForgeSuccessor { replica } => {
                write!(f, "foreign writer names r{replica} successor")
            }
            Fault::StepWall { replica, by, back } => write!(
                f,
                "r{replica}'s node steps its wall clock {} by {}",
                if *back { "back" } else { "forward" },
                d(by)
            ),
            Fault::EndWatches => f.write_str("API server ends every watch"),
            Fault::KubeletSilent { replica, lasting } => {
                write!(f, "r{replica}'s kubelet reports nothing for {}", d(lasting))
            }
            Fault::Compact => f.write_str("API server compacts (old watches get 410)"),
        }
    }
}
