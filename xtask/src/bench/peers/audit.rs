//! The API server's audit log, read as it grows: every operator sends a user agent with
//! `(IDENTITY)` in it, so the log tells, the same way for ours and the peers, who made
//! which request and when the API server received it (Lease writes aside: those of
//! controller-runtime carry client-go's default user agent, so terms are told apart by the
//! holder the Lease names). Audited: writes, LISTs and WATCHes of
//! MyResources, ConfigMaps, Pods, Events and Leases (GETs are not; see e2e's policy).
//!
//! The API server rotates the log (`--audit-log-maxsize`): it closes the full file,
//! renames it and starts a new one under the same name, which a run at 20,000 objects
//! reaches. The reader holds the file it reads open, so the renamed file's last lines are
//! still read before it moves on to the new one.

use std::fs::File;
use std::io::{ErrorKind, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use anyhow::{Context, Result};
use e2e::audit::AuditEvent;
use k8s_openapi::jiff::Timestamp;

/// The verb given to a watch that starts with the full state (`sendInitialEvents=true`,
/// client-go's streaming replacement for LIST since its WatchListClient became the default).
pub(super) const WATCH_LIST: &str = "watch-list";

/// The requests so far (watches as they start, the rest as they complete), read
/// incrementally from the first [`Audit::refresh`] on, across rotations.
pub(super) struct Audit {
    path: PathBuf,
    /// The file being read, held open so that a rotation cannot take its end away; `None`
    /// before the first read and after a rotation.
    file: Option<File>,
    /// The bytes of `file` read so far (whole lines).
    offset: u64,
    pub(super) events: Vec<AuditEvent>,
}

impl Audit {
    pub(super) fn new(path: PathBuf) -> Audit {
        Audit {
            path,
            file: None,
            offset: 0,
            events: Vec::new(),
        }
    }

    /// Reads the lines written since the last call (whole lines only), through any
    /// rotations since: first the rest of the file held, then each new file from its start.
    pub(super) fn refresh(&mut self) -> Result<()> {
        loop {
            if self.file.is_none() {
                match File::open(&self.path) {
                    Ok(file) => {
                        self.file = Some(file);
                        self.offset = 0;
                    }
                    // Between the rename and the new file: the next call reads it.
                    Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
                    Err(e) => return Err(e).context(format!("opening {}", self.path.display())),
                }
            }
            // Asked before reading: once the name is another file's, nothing more is
            // written to the one held, so reading it to its end misses nothing.
            let rotated = self.rotated()?;
            self.read_held()?;
            if !rotated {
                return Ok(());
            }
            self.file = None;
        }
    }

    /// Whether the log's name no longer names the file held (renamed, and perhaps not yet
    /// replaced).
    fn rotated(&self) -> Result<bool> {
        let Some(file) = &self.file else {
            return Ok(false);
        };
        let held = file.metadata()?.ino();
        match std::fs::metadata(&self.path) {
            Ok(current) => Ok(current.ino() != held),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(true),
            Err(e) => Err(e).context(format!("reading {}", self.path.display())),
        }
    }

    /// Parses the whole lines of the held file past `offset`.
    fn read_held(&mut self) -> Result<()> {
        let Some(file) = &mut self.file else {
            return Ok(());
        };
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
            // Only a Lease's body is read (the holder it names); the rest would hold
            // every object of the run in memory.
            if event.resource() != "leases" {
                event = event.without_bodies();
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

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn line(name: &str) -> String {
        format!(
            r#"{{"verb":"create","user":{{"username":"u"}},"objectRef":{{"resource":"configmaps","namespace":"ns","name":"{name}"}},"stage":"ResponseComplete","requestReceivedTimestamp":"2026-01-01T00:00:00Z","stageTimestamp":"2026-01-01T00:00:00Z"}}"#
        ) + "\n"
    }

    fn append(path: &std::path::Path, text: &str) {
        let mut file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        file.write_all(text.as_bytes()).unwrap();
    }

    fn names(audit: &Audit) -> Vec<&str> {
        audit.events.iter().map(name_of).collect()
    }

    #[test]
    fn a_rotation_loses_neither_the_old_files_end_nor_the_new_files_start() {
        let dir = std::env::temp_dir().join(format!("peers-audit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("audit.log");
        let mut audit = Audit::new(path.clone());
        // Nothing written yet: nothing read, no error.
        audit.refresh().unwrap();
        append(&path, &(line("a") + &line("b")));
        audit.refresh().unwrap();
        assert_eq!(names(&audit), ["a", "b"]);
        // Written after the last read, then the file rotated away: not read yet.
        append(&path, &line("c"));
        std::fs::rename(&path, dir.join("audit-2026-01-01T00-00-01.000.log")).unwrap();
        // Between the rename and the new file.
        audit.refresh().unwrap();
        assert_eq!(names(&audit), ["a", "b", "c"]);
        // The new file, shorter than what was read of the old one, and half a line.
        append(&path, &line("d"));
        append(&path, &line("e")[..20]);
        audit.refresh().unwrap();
        assert_eq!(names(&audit), ["a", "b", "c", "d"]);
        append(&path, &line("e")[20..]);
        // Another rotation before the next read: both files' lines, in order.
        std::fs::rename(&path, dir.join("audit-2026-01-01T00-00-02.000.log")).unwrap();
        append(&path, &line("f"));
        audit.refresh().unwrap();
        assert_eq!(names(&audit), ["a", "b", "c", "d", "e", "f"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
