//! The API server's audit log, read as it grows: every operator sends a user agent with
//! `(IDENTITY)` in it, so the log tells, the same way for ours and the peers, who made
//! which request and when the API server received it (Lease writes aside: those of
//! controller-runtime carry client-go's default user agent, so terms are told apart by the
//! holder the Lease names). Audited: writes, LISTs and WATCHes of
//! MyResources, ConfigMaps, Pods, Events and Leases (GETs are not; see e2e's policy).

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use anyhow::Result;
use e2e::audit::AuditEvent;
use k8s_openapi::jiff::Timestamp;

/// The verb given to a watch that starts with the full state (`sendInitialEvents=true`,
/// client-go's streaming replacement for LIST since its WatchListClient became the default).
pub(super) const WATCH_LIST: &str = "watch-list";

/// The requests so far (watches as they start, the rest as they complete), read
/// incrementally.
pub(super) struct Audit {
    path: PathBuf,
    offset: u64,
    pub(super) events: Vec<AuditEvent>,
}

impl Audit {
    pub(super) fn new(path: PathBuf) -> Audit {
        Audit {
            path,
            offset: 0,
            events: Vec::new(),
        }
    }

    /// Reads the lines written since the last call (whole lines only).
    pub(super) fn refresh(&mut self) -> Result<()> {
        let mut file = std::fs::File::open(&self.path)?;
        file.seek(SeekFrom::Start(self.offset))?;
        let mut text = Vec::new();
        file.read_to_end(&mut text)?;
        let Some(end) = text.iter().rposition(|b| *b == b'\n') else {
            return Ok(());
        };
        for line in text[..end].split(|b| *b == b'\n') {
            if line.is_empty() {
                continue;
            }
            let mut event: AuditEvent = serde_json::from_slice(line)?;
            // A watch is recorded when it starts (it completes only when it ends); the rest
            // when they complete.
            let watch = event.verb == "watch";
            let stage = if watch {
                "ResponseStarted"
            } else {
                "ResponseComplete"
            };
            if event.stage != stage {
                continue;
            }
            if watch
                && serde_json::from_slice::<serde_json::Value>(line)?["requestURI"]
                    .as_str()
                    .is_some_and(|u| u.contains("sendInitialEvents=true"))
            {
                event.verb = WATCH_LIST.into();
            }
            self.events.push(event);
        }
        self.offset += end as u64 + 1;
        Ok(())
    }

    /// Requests in `ns` by the replica `identity`.
    pub(super) fn by<'a>(
        &'a self,
        identity: &'a str,
        ns: &'a str,
    ) -> impl Iterator<Item = &'a AuditEvent> + 'a {
        self.events
            .iter()
            .filter(move |e| e.namespace() == ns && identity_of(e) == Some(identity))
    }

    /// The holder named by the last holder write to the Lease in `ns`.
    pub(super) fn holder(&self, ns: &str) -> Option<String> {
        self.holder_writes(ns)
            .last()
            .map(|(holder, _)| holder.to_string())
    }

    /// When a new term began in `ns` after `after`: the first holder write naming another
    /// holder than the last one before `after` (the Lease's own record, whoever's client
    /// wrote it: controller-runtime's Lease client does not send our user agent).
    pub(super) fn term_after(&self, ns: &str, after: Timestamp) -> Option<Timestamp> {
        let writes = self.holder_writes(ns);
        let previous = writes
            .iter()
            .take_while(|(_, at)| *at <= after)
            .last()
            .map(|(holder, _)| *holder);
        writes
            .iter()
            .find(|(holder, at)| *at > after && Some(*holder) != previous)
            .map(|(_, at)| *at)
    }

    /// Successful Lease writes in `ns` that name a holder, oldest first: (holder, when).
    fn holder_writes(&self, ns: &str) -> Vec<(&str, Timestamp)> {
        let mut writes: Vec<(&str, Timestamp)> = self
            .events
            .iter()
            .filter(|e| e.namespace() == ns && e.resource() == "leases")
            .filter(|e| e.is_write() && e.succeeded())
            .filter_map(|e| {
                let holder = e.request_object.as_ref()?["spec"]["holderIdentity"].as_str()?;
                (!holder.is_empty()).then_some((holder, e.stage_timestamp))
            })
            .collect();
        writes.sort_by_key(|(_, at)| *at);
        writes
    }

    /// When the API server received the first create of the ConfigMap `name` in `ns` by
    /// any replica but `except`.
    pub(super) fn configmap_created(
        &self,
        ns: &str,
        name: &str,
        except: &str,
    ) -> Option<Timestamp> {
        self.events
            .iter()
            .filter(|e| e.namespace() == ns && e.verb == "create" && e.resource() == "configmaps")
            .filter(|e| e.object_ref.as_ref().is_some_and(|o| o.name == name))
            .filter(|e| identity_of(e).is_some_and(|i| i != except))
            .map(|e| e.request_received_timestamp)
            .min()
    }
}

/// The identity in a user agent `NAME/VERSION (IDENTITY)`, which client-go may suffix
/// (`…/leader-election` for controller-runtime's Lease client).
pub(super) fn identity_of(e: &AuditEvent) -> Option<&str> {
    let (_, rest) = e.user_agent.rsplit_once(" (")?;
    Some(rest.split_once(')')?.0)
}

/// The object's name, or "".
pub(super) fn name_of(e: &AuditEvent) -> &str {
    e.object_ref.as_ref().map_or("", |o| o.name.as_str())
}
