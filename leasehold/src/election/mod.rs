//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's semantics and
//! stricter rules where client-go can elect two leaders.
//!
//! The decision logic ([`Elector`]) is pure: it is fed what was read and written, and the
//! monotonic time, and says what to do next. The driver ([`Driver`]) does the I/O through a [`LeaseStore`] and tells
//! [`Leadership`](crate::term::Leadership) (the one owner of the fence and the role) when a term begins, continues
//! or ends.
//!
//! Guarantees (with `lease_duration > renew_deadline > retry_period`, checked by
//! [`Timings::new`]):
//! - Acquire and renew are `replace` calls carrying the resourceVersion last read, so of two
//!   candidates at most one succeeds (the other gets 409 Conflict); a deposed leader's renew
//!   conflicts instead of extending the new leader's term. The Lease is created only when
//!   absent (a concurrent create gets 409 AlreadyExists).
//! - Expiry is judged on this replica's monotonic clock from when it first observed the
//!   current *election record* (holder, acquire and renew times, transitions, duration):
//!   metadata-only writes (labels, annotations, a new resourceVersion) never restart it. The
//!   remote `renewTime` is never compared with the local clock, so clock skew cannot cause
//!   two leaders. The duration waited is the larger of this replica's `--lease-duration`
//!   and the record's `leaseDurationSeconds`, so replicas with different timings (a rolling
//!   upgrade that shortens them) never take over before the holder's own fence closes.
//! - The leader's writes are fenced until `start of its last successful renew +
//!   renew_deadline`. Another replica observes that renew no earlier than it started, and
//!   acquires no earlier than a lease duration after that observation, which is later than
//!   the fence closes (as long as the clocks' rates agree to within
//!   `lease_duration / renew_deadline`).
//! - A graceful release (empty holder, `leaseDurationSeconds: 1`, a new renewTime: what
//!   this driver and client-go's `ReleaseOnCancel` write after closing their fence) is
//!   acquirable at once; followers watch the Lease, so they see it within one watch event.
//!   A release may name a successor ([`crate::replicas::succession`]): it takes the release at once, the
//!   others stand back one retry period while it is live. Only liveness depends on it:
//!   everyone acquires with the same compare-and-swap.
//!   Any other way a holder disappears — the Lease deleted, or its holder cleared by a
//!   foreign writer — is taken only after the previous holder's fence has surely closed: a
//!   lease duration after this replica saw it vanish (not after the last renewal it saw:
//!   renewals it missed may have extended that fence).
//! - A Lease absent at this replica's first look may have been deleted a moment ago under a
//!   live holder: it is created a lease duration later. While absent, the Lease is watched
//!   from the oldest read that found it absent ([`Read::Absent`]), so a term that begins
//!   and vanishes meanwhile is seen (and waited out); if that history is compacted away
//!   (410), the wait starts over. A create carries no precondition, so a creator leads only
//!   if the watch from where it saw the Lease absent shows its own create first; otherwise
//!   it leaves the Lease to expire, as every other replica waits it out.
//! - The leader steps down at once when a renew finds the Lease deleted (404) or its
//!   election record changed by someone else (409, then a read); a metadata-only change
//!   only makes it renew again with the new resourceVersion.
//! - Each request has its own timeout (at most `retry_period`, never past the renew
//!   deadline), the election's client does not retry by itself, and a failed request is
//!   followed by a jittered pause of one retry period (client-go's rule): an unreachable
//!   API server costs one request per retry period, not a busy loop. When the renew
//!   deadline passes without a successful renew the leader steps down.
//! - A failed read changes nothing: a renewal writes a new renewTime, so a record found
//!   unchanged after failed reads was not renewed meanwhile and keeps the expiry clock it
//!   had. After an outage the replica the record names takes the Lease back at its next
//!   attempt, or a follower whose clock ran out takes it over (one compare-and-swap wins):
//!   an API server restart costs the restart, not a lease duration.
//! - A record is this process's own only if it is exactly a record this process wrote (the
//!   last one the server confirmed, or one sent since, whose answer may have been lost;
//!   renewTime is written to the microsecond, so no other writer repeats it by chance). A
//!   record that merely names this identity is another holder's: a foreign write naming a
//!   former holder, a container restarted in the same Pod, two processes given the same
//!   `--identity`. It is taken only after it expires (the other writer's requests may still
//!   be in flight), and never released by this process.

mod driver;
mod elector;
mod store;
mod timings;

pub use driver::{Driver, Seat};
pub use elector::{Action, Elector};
pub use store::{GroupStore, KubeLeases, LeaseEvent, LeaseEvents, LeaseStore, Read, StoreError};
pub use timings::Timings;
