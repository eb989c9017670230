//! The API server's audit log as the tests' ground truth: one model for e2e, chaos and the
//! benches.
//!
//! - [`event`]: an audit event and the log, read across rotated files, with a check that it
//!   covers a window;
//! - [`effect`]: when a write took effect (the answer's resourceVersion, etcd's revision),
//!   or may have (5xx, no answer: up to its server-side timeout), or that it changed nothing;
//! - [`terms`]: a Lease's terms in effect order, and how leadership moved among them;
//! - [`fencing`]: the check that no write of a term took effect in another's term, over every
//!   namespace and resource, per shard by owner uid in scale-out mode, refusing to pass on
//!   nothing.

pub mod effect;
pub mod event;
pub mod fencing;
pub mod terms;

pub use event::{AuditEvent, Log, ObjectRef, read, read_filtered};
pub use fencing::{Fences, Verdict, check};
pub use terms::{Acquisition, Handovers, acquisitions, handovers, release_gaps};
