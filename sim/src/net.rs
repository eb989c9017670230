//! The network between a process and the simulated API server: every request travels as
//! a task of its own (so a client that gives up does not stop the server from applying
//! it), with latency, and meets the faults in force on the way out, at the server and on
//! the way back.
//!
//! What a request meets, in order: a dead process sends nothing; a frozen one sends when
//! it is resumed, and a fenced write is then sent only if its fence is still open (what
//! [`kube_leasehold::fence::FencedIo`] does for the real socket); a partition or a hanging
//! outage loses it (no answer ever: the client's own timeout decides); a refused outage
//! resets it; a throttled replica's Lease request gets 429; a slow server holds it up to
//! the slow period's bound, and a write whose `timeout` runs out first is answered 504
//! and not applied (the API server's rule); then it takes effect, and its answer meets
//! the same partition and freeze on the way back.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use http::{Request, Response};
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::watcher;
use kube_leasehold::election::{GroupStore, LeaseEvent, LeaseEvents, LeaseStore, Read, StoreError};
use tokio::sync::{mpsc, oneshot};
use tower::{BoxError, Service};

use crate::server::{By, Change, Filter};
use crate::world::{NAMESPACE, World};

/// Latency each way, outside faults.
const LATENCY: (Duration, Duration) = (Duration::from_micros(300), Duration::from_millis(40));
/// The server's own handling time, outside a slow period.
const HANDLING: (Duration, Duration) = (Duration::ZERO, Duration::from_millis(5));
/// How late a watch event may arrive.
const WATCH_LAG: (Duration, Duration) = (Duration::ZERO, Duration::from_millis(250));
/// How long a request stays in the process before its bytes leave.
const LOCAL: (Duration, Duration) = (Duration::ZERO, Duration::from_millis(3));
/// The share of watches the server ends early.
const EARLY_END: f64 = 0.1;
/// How long the group watch's client waits for an answer to a list or a watch (kube's
/// client has a read timeout; a lost request must not hang the watch for ever).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a group watch asks the server to keep it open.
const GROUP_WATCH_SECS: u32 = 290;

/// A request.
enum Req {
    Get(String),
    Create(Lease),
    Replace(Lease),
    Delete {
        name: String,
        resource_version: String,
    },
    List(Filter),
    Watch {
        filter: Filter,
        from: String,
        secs: u32,
    },
    Write {
        shard: usize,
        key: String,
        timeout: Option<Duration>,
        sent: Duration,
    },
}

/// An answer.
enum Resp {
    Got(Read),
    Wrote(Result<Box<Lease>, StoreError>),
    Deleted(Result<(), StoreError>),
    Listed(Vec<Lease>, String),
    Watching(Option<mpsc::UnboundedReceiver<Result<Change, StoreError>>>),
    Status(u16),
    Failed(StoreError),
}

impl Req {
    /// The Lease a Lease request is about ("group" for a list or watch by label), for the
    /// request-rate invariant; `None` for an object write.
    fn subject(&self) -> Option<String> {
        match self {
            Req::Get(name) | Req::Delete { name, .. } => Some(name.clone()),
            Req::Create(lease) | Req::Replace(lease) => lease.metadata.name.clone(),
            Req::Watch {
                filter: Filter::Name(name),
                ..
            } => Some(name.clone()),
            Req::List(_) | Req::Watch { .. } => Some("group".into()),
            Req::Write { .. } => None,
        }
    }
}

/// A process's connection to the API server: its `LeaseStore` (and `GroupStore`), and the
/// service its fenced writes of shard `shard` go through.
#[derive(Clone)]
pub struct Link {
    /// The world.
    pub world: World,
    /// The process.
    pub pid: usize,
    /// The shard whose fence the writes sent here pass (0 with a single Lease).
    pub shard: usize,
}

impl Link {
    /// Sends `req` and waits for its answer; a request that is reset fails with a
    /// transport error, one that is lost never answers.
    async fn send(&self, req: Req) -> Result<Resp, StoreError> {
        let (answer, answered) = oneshot::channel();
        tokio::spawn(journey(self.world.clone(), self.pid, req, answer));
        // The process's client records every outcome in its `Reachability`; a request
        // given up (its future dropped by a timeout) counts as a failure.
        let mut outcome = Outcome {
            reachability: self.world.lock().processes[self.pid].reachability.clone(),
            status: None,
        };
        let result = answered
            .await
            .map_err(|_| StoreError::Other("connection reset by peer".into()));
        outcome.status = match &result {
            Ok(Resp::Status(code)) => Some(*code),
            Ok(Resp::Failed(StoreError::Other(_))) => Some(429),
            Ok(_) => Some(200),
            Err(_) => None,
        };
        result
    }
}

/// Records a request's outcome when it is over, answered or given up.
struct Outcome {
    reachability: kube_leasehold::retry::Reachability,
    status: Option<u16>,
}

impl Drop for Outcome {
    fn drop(&mut self) {
        self.reachability.record(self.status);
    }
}

/// Whether `pid` is cut off from the server now (dead, partitioned, or a hanging outage).
fn cut(world: &World, pid: usize) -> bool {
    let (alive, cut) = world.reach(pid);
    !alive || cut
}

async fn lost() {
    std::future::pending::<()>().await;
}

async fn journey(world: World, pid: usize, req: Req, answer: oneshot::Sender<Resp>) {
    let (replica, local, silent) = {
        let mut state = world.lock();
        let replica = state.processes[pid].replica;
        // A frozen process issues nothing: its timers fire when it is resumed, which the
        // simulation approximates by letting its logic run and losing what it sends.
        let silent = !state.processes[pid].alive || *state.slots[replica].frozen.borrow();
        (replica, state.rng.between(LOCAL.0, LOCAL.1), silent)
    };
    if silent {
        return lost().await;
    }
    // Between the fence's check and the kernel taking the bytes: a freeze that lands
    // here holds the request until the process is resumed.
    tokio::time::sleep(local).await;
    world.unfrozen(replica).await;
    let departed = world.now();
    let (out, back, handling, throttled, refused) = {
        let mut state = world.lock();
        if !state.processes[pid].alive {
            return;
        }
        // The fenced socket takes bytes only while the fence is open.
        if let Req::Write { shard, .. } = &req
            && !state.processes[pid].fences[*shard].is_open(kube_leasehold::clock::now())
        {
            return;
        }
        let subject = req.subject();
        if let Some(subject) = &subject {
            state.lease_requests.push((pid, subject.clone(), departed));
        }
        let slow = state.slow.iter().max().copied();
        let rng = &mut state.rng;
        let out = rng.between(LATENCY.0, LATENCY.1);
        let back = rng.between(LATENCY.0, LATENCY.1);
        let handling = match slow {
            Some(up_to) => rng.between(HANDLING.0, up_to),
            None => rng.between(HANDLING.0, HANDLING.1),
        };
        let throttled = subject.is_some() && state.slots[replica].throttled > 0;
        (
            out,
            back,
            handling,
            throttled,
            state.refused && state.outages > 0,
        )
    };
    tokio::time::sleep(out).await;
    if cut(&world, pid) {
        return lost().await;
    }
    let resp = if refused {
        None
    } else if throttled {
        Some(Resp::Failed(StoreError::Other(
            "429 Too Many Requests".into(),
        )))
    } else if let Req::Write {
        timeout: Some(timeout),
        ..
    } = &req
        && handling > *timeout
    {
        // The API server gives up at the request's timeout, before applying it.
        tokio::time::sleep(*timeout).await;
        Some(Resp::Status(504))
    } else {
        tokio::time::sleep(handling).await;
        Some(apply(&world, pid, req))
    };
    tokio::time::sleep(back).await;
    if cut(&world, pid) {
        return lost().await;
    }
    world.unfrozen(replica).await;
    if let Some(resp) = resp {
        let _ = answer.send(resp);
    }
}

/// The request takes effect at the server, now.
fn apply(world: &World, pid: usize, req: Req) -> Resp {
    let now = world.now();
    let by = By::Process(pid);
    let tracing = world.tracing();
    let resp = {
        let mut state = world.lock();
        match &req {
            Req::Get(name) => Resp::Got(state.server.get(name)),
            Req::Create(lease) => Resp::Wrote(state.server.create(now, by, lease).map(Box::new)),
            Req::Replace(lease) => Resp::Wrote(state.server.replace(now, by, lease).map(Box::new)),
            Req::Delete {
                name,
                resource_version,
            } => Resp::Deleted(
                state
                    .server
                    .delete(now, by, name, Some(resource_version.as_str())),
            ),
            Req::List(filter) => {
                let (leases, rv) = state.server.list(filter);
                Resp::Listed(leases, rv)
            }
            Req::Write {
                shard, key, sent, ..
            } => {
                state.server.write(now, *sent, pid, *shard, key);
                Resp::Status(200)
            }
            Req::Watch { filter, from, secs } => {
                let events = state.server.watch(filter.clone(), from);
                let early = state.rng.chance(EARLY_END);
                let lasting = Duration::from_secs(u64::from(*secs));
                let ends = now
                    + if early {
                        state.rng.between(Duration::ZERO, lasting)
                    } else {
                        lasting
                    };
                let replica = state.processes[pid].replica;
                Resp::Watching(
                    events.map(|events| forward(world.clone(), pid, replica, events, ends)),
                )
            }
        }
    };
    if tracing {
        let who = world.who(pid);
        world.trace(&who, describe(&req, &resp));
    }
    resp
}

fn describe(req: &Req, resp: &Resp) -> String {
    let record = |lease: &Lease| {
        let spec = lease.spec.clone().unwrap_or_default();
        format!(
            "rv {} holder {:?} duration {:?} renew {}",
            lease.metadata.resource_version.as_deref().unwrap_or("-"),
            spec.holder_identity.unwrap_or_default(),
            spec.lease_duration_seconds.unwrap_or_default(),
            spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default()
        )
    };
    let lease = req
        .subject()
        .filter(|name| name != "group")
        .unwrap_or_default();
    let text = match (req, resp) {
        (Req::Get(_), Resp::Got(Read::Found(l))) => format!("GET Lease → {}", record(l)),
        (Req::Get(_), Resp::Got(Read::Absent { resource_version })) => {
            format!("GET Lease → absent at rv {resource_version}")
        }
        (Req::Create(_), Resp::Wrote(Ok(l))) => format!("CREATE Lease → {}", record(l)),
        (Req::Replace(_), Resp::Wrote(Ok(l))) => format!("REPLACE Lease → {}", record(l)),
        (Req::Create(_) | Req::Replace(_), Resp::Wrote(Err(e))) => format!("WRITE Lease → {e}"),
        (Req::Delete { .. }, Resp::Deleted(result)) => format!("DELETE Lease → {result:?}"),
        (Req::List(_), Resp::Listed(leases, rv)) => {
            format!("LIST group → {} Leases at rv {rv}", leases.len())
        }
        (Req::Watch { from, .. }, Resp::Watching(w)) => format!(
            "WATCH from rv {from} → {}",
            if w.is_some() { "open" } else { "410 Gone" }
        ),
        (
            Req::Write {
                key, sent, shard, ..
            },
            _,
        ) => format!(
            "PUT object {key} (let through shard {shard}'s fence at {:.6}s) → applied",
            sent.as_secs_f64()
        ),
        _ => String::new(),
    };
    // The one Lease goes unnamed, as before shard Leases were simulated.
    if lease.is_empty() || lease == crate::history::LEASE {
        text
    } else {
        format!("{lease}: {text}")
    }
}

/// Delivers a watch's events to the process, late by up to [`WATCH_LAG`], in order, until
/// the watch ends; a partition or a death stalls it until then.
fn forward(
    world: World,
    pid: usize,
    replica: usize,
    mut events: mpsc::UnboundedReceiver<Change>,
    ends: Duration,
) -> mpsc::UnboundedReceiver<Result<Change, StoreError>> {
    let (deliver, delivered) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let end = tokio::time::sleep_until(world.instant(ends));
        tokio::pin!(end);
        let mut last = Duration::ZERO;
        loop {
            let event = tokio::select! {
                biased;
                _ = &mut end => break,
                event = events.recv() => event,
            };
            let Some(event) = event else { break };
            let lag = world.lock().rng.between(WATCH_LAG.0, WATCH_LAG.1);
            last = last.max(world.now() + lag);
            tokio::select! {
                biased;
                _ = &mut end => break,
                _ = tokio::time::sleep_until(world.instant(last)) => {}
            }
            if cut(&world, pid) {
                (&mut end).await;
                break;
            }
            world.unfrozen(replica).await;
            if deliver.send(Ok(event)).is_err() {
                break;
            }
        }
    });
    delivered
}

/// The result of a Lease write, from its answer.
fn written(resp: Resp) -> Result<Lease, StoreError> {
    match resp {
        Resp::Wrote(result) => result.map(|lease| *lease),
        Resp::Failed(err) => Err(err),
        _ => unreachable!("a write is answered with its result"),
    }
}

impl LeaseStore for Link {
    async fn get(&self, name: &str) -> Result<Read, StoreError> {
        match self.send(Req::Get(name.into())).await? {
            Resp::Got(read) => Ok(read),
            Resp::Failed(err) => Err(err),
            _ => unreachable!("a GET is answered with a Lease"),
        }
    }

    async fn create(&self, lease: &Lease) -> Result<Lease, StoreError> {
        written(self.send(Req::Create(lease.clone())).await?)
    }

    async fn replace(&self, lease: &Lease) -> Result<Lease, StoreError> {
        written(self.send(Req::Replace(lease.clone())).await?)
    }

    async fn watch(
        &self,
        name: &str,
        resource_version: &str,
        timeout_secs: u32,
    ) -> Result<LeaseEvents, StoreError> {
        let req = Req::Watch {
            filter: Filter::Name(name.into()),
            from: resource_version.into(),
            secs: timeout_secs,
        };
        match self.send(req).await? {
            // 410 Gone, then the end (as `KubeLeases` delivers it).
            Resp::Watching(None) => Ok(futures::stream::iter([Err(StoreError::Gone)]).boxed()),
            Resp::Watching(Some(mut events)) => Ok(futures::stream::poll_fn(move |cx| {
                events
                    .poll_recv(cx)
                    .map(|change| change.map(|c| c.map(|(_, event)| event)))
            })
            .boxed()),
            Resp::Failed(err) => Err(err),
            _ => unreachable!("a watch is answered with a stream"),
        }
    }
}

/// A store error as kube's client reports a failed request.
fn kube_error(err: StoreError) -> kube::Error {
    kube::Error::Service(Box::new(err))
}

/// Where a group watch stands (kube's watcher's states, reduced).
enum Phase {
    /// About to list.
    List,
    /// Watching from a resourceVersion; the stream once opened.
    Watch {
        from: String,
        events: Option<mpsc::UnboundedReceiver<Result<Change, StoreError>>>,
    },
}

/// A group watch's state: what kube's watcher keeps between polls.
struct GroupWatch {
    link: Link,
    filter: Filter,
    phase: Phase,
    pending: std::collections::VecDeque<watcher::Event<Lease>>,
}

impl GroupWatch {
    /// The next event or error, as kube's watcher yields them: a list (`Init`,
    /// `InitApply`…, `InitDone`), then the changes from the list's resourceVersion; a
    /// watch that ends is re-opened from the last resourceVersion seen, a 410 starts
    /// over with a list, and an error is yielded for the caller to back off.
    async fn next(&mut self) -> watcher::Result<watcher::Event<Lease>> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Ok(event);
            }
            match &mut self.phase {
                Phase::List => {
                    let answer = tokio::time::timeout(
                        CLIENT_TIMEOUT,
                        self.link.send(Req::List(self.filter.clone())),
                    )
                    .await
                    .unwrap_or_else(|_| Err(StoreError::Other("list timed out".into())));
                    match answer {
                        Ok(Resp::Listed(leases, rv)) => {
                            self.pending.push_back(watcher::Event::Init);
                            self.pending
                                .extend(leases.into_iter().map(watcher::Event::InitApply));
                            self.pending.push_back(watcher::Event::InitDone);
                            self.phase = Phase::Watch {
                                from: rv,
                                events: None,
                            };
                        }
                        Ok(Resp::Failed(err)) | Err(err) => {
                            return Err(watcher::Error::InitialListFailed(kube_error(err)));
                        }
                        Ok(_) => unreachable!("a list is answered with Leases"),
                    }
                }
                Phase::Watch { from, events: None } => {
                    let req = Req::Watch {
                        filter: self.filter.clone(),
                        from: from.clone(),
                        secs: GROUP_WATCH_SECS,
                    };
                    let answer = tokio::time::timeout(CLIENT_TIMEOUT, self.link.send(req))
                        .await
                        .unwrap_or_else(|_| Err(StoreError::Other("watch timed out".into())));
                    match answer {
                        Ok(Resp::Watching(None)) => {
                            self.phase = Phase::List;
                            let gone = kube::core::Status::failure("too old", "Expired");
                            return Err(watcher::Error::WatchError(Box::new(gone.with_code(410))));
                        }
                        Ok(Resp::Watching(Some(opened))) => {
                            self.phase = Phase::Watch {
                                from: from.clone(),
                                events: Some(opened),
                            }
                        }
                        Ok(Resp::Failed(err)) | Err(err) => {
                            return Err(watcher::Error::WatchStartFailed(kube_error(err)));
                        }
                        Ok(_) => unreachable!("a watch is answered with a stream"),
                    }
                }
                Phase::Watch {
                    from,
                    events: Some(open),
                } => match open.recv().await {
                    Some(Ok((_, LeaseEvent::Applied(lease)))) => {
                        *from = lease.metadata.resource_version.clone().unwrap_or_default();
                        return Ok(watcher::Event::Apply(*lease));
                    }
                    Some(Ok((name, LeaseEvent::Deleted { resource_version }))) => {
                        *from = resource_version;
                        let mut gone = Lease::default();
                        gone.metadata.name = Some(name);
                        return Ok(watcher::Event::Delete(gone));
                    }
                    Some(Err(err)) => {
                        return Err(watcher::Error::WatchFailed(kube_error(err)));
                    }
                    None => {
                        let from = std::mem::take(from);
                        self.phase = Phase::Watch { from, events: None };
                    }
                },
            }
        }
    }
}

impl GroupStore for Link {
    fn namespace(&self) -> String {
        NAMESPACE.into()
    }

    fn watch_group(
        &self,
        selector: &str,
    ) -> BoxStream<'static, watcher::Result<watcher::Event<Lease>>> {
        let watch = GroupWatch {
            link: self.clone(),
            filter: Filter::label(selector),
            phase: Phase::List,
            pending: Default::default(),
        };
        futures::stream::unfold(watch, |mut watch| async move {
            let next = watch.next().await;
            Some((next, watch))
        })
        .boxed()
    }

    async fn delete(&self, name: &str, resource_version: &str) -> Result<(), StoreError> {
        let req = Req::Delete {
            name: name.into(),
            resource_version: resource_version.into(),
        };
        match self.send(req).await? {
            Resp::Deleted(result) => result,
            Resp::Failed(err) => Err(err),
            _ => unreachable!("a DELETE is answered with its result"),
        }
    }
}

/// The server's `timeout` query parameter (`timeout=123ms`), as the fence sets it.
fn timeout_of(uri: &http::Uri) -> Option<Duration> {
    let query = uri.query()?;
    let value = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("timeout="))?;
    let millis: u64 = value.strip_suffix("ms")?.parse().ok()?;
    Some(Duration::from_millis(millis))
}

/// Writes of objects (`PUT /objects/KEY`), as the real fence layer sends them.
impl Service<Request<String>> for Link {
    type Response = Response<String>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<String>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<String>) -> Self::Future {
        let link = self.clone();
        Box::pin(async move {
            let key = request
                .uri()
                .path()
                .strip_prefix("/objects/")
                .unwrap_or_default()
                .to_string();
            let req = Req::Write {
                shard: link.shard,
                key,
                timeout: timeout_of(request.uri()),
                sent: link.world.now(),
            };
            match link.send(req).await? {
                Resp::Status(code) => Ok(Response::builder()
                    .status(code)
                    .body(String::new())
                    .expect("a status and an empty body make a response")),
                _ => unreachable!("a write is answered with a status"),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_timeout_the_fence_sets() {
        let uri: http::Uri = "/objects/a?x=1&timeout=250ms".parse().unwrap();
        assert_eq!(timeout_of(&uri), Some(Duration::from_millis(250)));
        assert_eq!(timeout_of(&"/objects/a".parse().unwrap()), None);
    }
}
