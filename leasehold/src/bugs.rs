//! Historical defects of this crate, re-introduced one at a time so that the simulator
//! (`cargo xtask simulate --bug NAME`) can show it finds each of them.
//!
//! The switches exist only with the `simulation` feature, which only the simulator
//! enables; without it [`on`] is the constant `false` and every switch compiles away.

/// One historical defect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bug {
    /// The expiry clock restarts on any resourceVersion change (a relabel keeps a dead
    /// holder's Lease alive, or a metadata write resets nothing it should).
    MetadataRestartsExpiry,
    /// The record's `leaseDurationSeconds` is ignored: a replica with a shorter lease
    /// duration takes over before the holder's longer fence closed.
    OwnDurationOnly,
    /// A holder cleared by a foreign writer is taken at once, like a graceful release.
    ClearedHolderIsRelease,
    /// A deleted Lease is recreated at once while the old holder's fence is still open.
    DeletedLeaseAtOnce,
    /// Writes are sent without the fence's deadline (no server `timeout`, no client-side
    /// cut-off): a slow server applies them after the fence closed.
    WritesOutliveFence,
    /// Any record naming this identity is taken as this process's own and renewed at
    /// once (a restarted process renews its predecessor's term).
    FormerHolderIsOurs,
    /// A failed read restarts the expiry clock of the record read next: an API server
    /// outage costs a whole lease duration after it ends.
    ReadFailureRestartsExpiry,
    /// A shard's worker reads and writes objects of every shard, not only its own.
    AnyShardStore,
}

impl Bug {
    /// Every defect, with the name `--bug` takes.
    pub const ALL: [(Bug, &'static str); 8] = [
        (Bug::MetadataRestartsExpiry, "metadata-restarts-expiry"),
        (Bug::OwnDurationOnly, "own-duration-only"),
        (Bug::ClearedHolderIsRelease, "cleared-holder-is-release"),
        (Bug::DeletedLeaseAtOnce, "deleted-lease-at-once"),
        (Bug::WritesOutliveFence, "writes-outlive-fence"),
        (Bug::FormerHolderIsOurs, "former-holder-is-ours"),
        (
            Bug::ReadFailureRestartsExpiry,
            "read-failure-restarts-expiry",
        ),
        (Bug::AnyShardStore, "any-shard-store"),
    ];

    /// The defect `--bug` names.
    pub fn named(name: &str) -> Option<Bug> {
        Bug::ALL.iter().find(|(_, n)| *n == name).map(|(b, _)| *b)
    }

    /// Its `--bug` name.
    pub fn name(self) -> &'static str {
        Bug::ALL
            .iter()
            .find(|(b, _)| *b == self)
            .map_or("", |(_, n)| n)
    }
}

#[cfg(feature = "simulation")]
mod switch {
    use std::sync::atomic::{AtomicU8, Ordering};

    use super::Bug;

    /// The defect switched on (its index in [`Bug::ALL`] + 1; 0 for none).
    static ACTIVE: AtomicU8 = AtomicU8::new(0);

    /// Switches `bug` on for the whole process (`None`: the code as it is).
    pub fn set(bug: Option<Bug>) {
        let index = bug.map_or(0, |bug| {
            Bug::ALL.iter().position(|(b, _)| *b == bug).unwrap_or(0) + 1
        });
        ACTIVE.store(index as u8, Ordering::Relaxed);
    }

    /// Whether `bug` is switched on.
    pub fn on(bug: Bug) -> bool {
        let index = ACTIVE.load(Ordering::Relaxed) as usize;
        index > 0 && Bug::ALL[index - 1].0 == bug
    }
}

#[cfg(feature = "simulation")]
pub use switch::{on, set};

/// Whether `bug` is switched on: never, without the `simulation` feature.
#[cfg(not(feature = "simulation"))]
#[inline(always)]
pub fn on(_bug: Bug) -> bool {
    false
}
