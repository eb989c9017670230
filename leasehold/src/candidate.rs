//! The one way to run a Lease's election with its term lifecycle: a [`Candidate`] is
//! spawned into a [`Campaign`], which runs your term while this replica leads. The single
//! Lease and every shard Lease of a [`crate::scaleout::ShardGroup`] go through it.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::clock::{self, Wall};
use crate::election::{Driver, Elector, LeaseStore, Seat, Timings};
use crate::fence::Fence;
use crate::observe::{Observer, Silent};
use crate::replicas::Replicas;
use crate::replicas::this_pod::PodInfo;
use crate::term::{self, Leadership};

/// A replica standing for one Lease, with the options a user may leave off.
pub struct Candidate {
    identity: String,
    lease: String,
    namespace: String,
    timings: Timings,
    pod: Option<PodInfo>,
    labels: BTreeMap<String, String>,
    replicas: Option<Replicas>,
    seat: Option<Seat>,
    observer: Arc<dyn Observer>,
    wall: Wall,
}

impl Candidate {
    /// `identity` (unique per process: a Pod name, or a Pod name and a random suffix)
    /// stands for the Lease `lease` in `namespace`.
    pub fn new(
        identity: impl Into<String>,
        lease: impl Into<String>,
        namespace: impl Into<String>,
        timings: Timings,
    ) -> Self {
        Candidate {
            identity: identity.into(),
            lease: lease.into(),
            namespace: namespace.into(),
            timings,
            pod: None,
            labels: BTreeMap::new(),
            replicas: None,
            seat: None,
            observer: Arc::new(Silent),
            wall: clock::system_wall(),
        }
    }

    /// In a Pod: names this Pod and process on the Lease (owner reference to the Pod's
    /// ServiceAccount, and the annotations of [`crate::replicas::exit`]), so followers can
    /// take over at once when the Pod proves this process exited. See
    /// [`crate::replicas::this_pod::this_pod`].
    pub fn in_pod(mut self, pod: Option<PodInfo>) -> Self {
        self.pod = pod;
        self
    }

    /// In a Pod: the replicas' Pods, from which a follower learns that the holder exited
    /// (taking over at once instead of after the lease) and a releasing leader names its
    /// successor ([`crate::replicas::succession`]).
    pub fn replicas(mut self, replicas: Option<Replicas>) -> Self {
        self.replicas = replicas;
        self
    }

    /// Labels on the Lease whenever this replica writes it.
    pub fn labelled(mut self, labels: BTreeMap<String, String>) -> Self {
        self.labels = labels;
        self
    }

    /// Scale-out: the Lease is a shard's, acquired only while the plan lets this replica
    /// lead it, and handed over when the plan says so.
    pub fn seat(mut self, seat: Seat) -> Self {
        self.seat = Some(seat);
        self
    }

    /// Where terms, renewals and their timings are reported (default: nowhere).
    pub fn observer(mut self, observer: Arc<dyn Observer>) -> Self {
        self.observer = observer;
        self
    }

    /// The wall clock written into the Lease's records (the system's by default; a
    /// simulation skews and steps it per node). It is never compared across replicas.
    pub fn wall_clock(mut self, wall: Wall) -> Self {
        self.wall = wall;
        self
    }

    /// Starts the election on `store`; `fence` opens while this replica leads (give the
    /// same fence to [`crate::fence::fenced_client`] for the term's writes).
    pub fn spawn(self, store: impl LeaseStore, fence: Fence) -> Campaign {
        let leadership = Leadership::new(fence, &self.lease, &self.identity, self.observer.clone());
        let elector = Elector::new(&self.identity, &self.lease, &self.namespace, self.timings)
            .in_pod(self.pod)
            .labelled(self.labels);
        let stop = CancellationToken::new();
        let driver = Driver {
            store,
            elector,
            leadership: leadership.clone(),
            observer: self.observer,
            replicas: self.replicas,
            seat: self.seat,
            wall: self.wall,
        };
        let task = tokio::spawn(driver.run(stop.clone()));
        Campaign {
            leadership,
            election: (task, stop),
        }
    }
}

/// A running election, whose terms [`Campaign::run`] runs.
pub struct Campaign {
    leadership: Leadership,
    election: (tokio::task::JoinHandle<()>, CancellationToken),
}

impl Campaign {
    /// This Lease's leadership: its role, and whether a term runs.
    pub fn leadership(&self) -> &Leadership {
        &self.leadership
    }

    /// Runs `term` whenever this replica leads, until `stop` resolves; then shuts down in
    /// order: the fence closes, the term is cancelled and awaited (at most `grace`), and
    /// the Lease is released once every write the term let through is settled, so a
    /// follower that takes it at once never overlaps with them.
    ///
    /// `term` is called at the start of each term with a token that is cancelled when the
    /// term ends (Lease lost, handed over, or shutdown). The term's writes must go through
    /// a client fenced by this campaign's fence: they are refused from the moment the term
    /// ends, whether or not the term has noticed yet.
    pub async fn run<T, F>(self, grace: Duration, stop: impl Future<Output = ()>, term: T)
    where
        T: FnMut(CancellationToken) -> F,
        F: Future<Output = ()> + Send + 'static,
    {
        term::run(self.leadership, grace, self.election, stop, term).await;
    }
}
