//! Child processes of the control plane and the operator, and how they end.
//!
//! Two lifetimes:
//! - [`Lifetime::TiedToThisProcess`]: the child gets `PR_SET_PDEATHSIG = SIGKILL`, so it dies
//!   with this process even when this process is killed outright. Linux sends that signal when
//!   the *thread* that forked the child exits, and test harnesses run each test on a thread of
//!   its own, so every tied child is forked by one spawner thread that lives as long as the
//!   process.
//! - [`Lifetime::Detached`]: the child starts its own session and outlives this process
//!   (`cargo xtask cluster up`); it is stopped later by pid.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};

/// Whether a child may outlive the process that started it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    TiedToThisProcess,
    Detached,
}

/// A running child with its log file.
#[derive(Debug)]
pub struct Process {
    pub name: String,
    pub pid: u32,
    pub log: PathBuf,
    child: Option<Child>,
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Starts `command` with stdout and stderr appended to `log`.
pub fn spawn(name: &str, mut command: Command, log: &Path, lifetime: Lifetime) -> Result<Process> {
    let out = File::options()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    command
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    let child = match lifetime {
        Lifetime::Detached => {
            // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
            unsafe {
                command.pre_exec(|| {
                    libc::setsid();
                    Ok(())
                });
            }
            command.spawn()
        }
        Lifetime::TiedToThisProcess => spawn_tied(command),
    }
    .with_context(|| format!("starting {name}"))?;
    Ok(Process {
        name: name.to_string(),
        pid: child.id(),
        log: log.to_path_buf(),
        child: Some(child),
    })
}

fn spawn_tied(command: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("child-spawner".into())
            .spawn(move || {
                // The sender lives in a static, so this loop (and the thread) never ends.
                for (mut command, reply) in rx {
                    let parent = std::process::id() as libc::pid_t;
                    // SAFETY: prctl and getppid are async-signal-safe.
                    unsafe {
                        command.pre_exec(move || {
                            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                            if libc::getppid() != parent {
                                libc::_exit(1);
                            }
                            Ok(())
                        });
                    }
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("spawning the child-spawner thread");
        Mutex::new(tx)
    });
    let (reply, result) = mpsc::channel();
    spawner
        .lock()
        .expect("spawner lock")
        .send((command, reply))
        .map_err(|_| std::io::Error::other("child-spawner thread is gone"))?;
    result
        .recv()
        .map_err(|_| std::io::Error::other("child-spawner thread is gone"))?
}

impl Process {
    /// A process known only by pid (started by another invocation).
    pub fn adopt(name: &str, pid: u32, log: PathBuf) -> Process {
        Process {
            name: name.to_string(),
            pid,
            log,
            child: None,
        }
    }

    /// Whether the process still runs (a zombie child of ours counts as ended).
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => pid_alive(self.pid),
        }
    }

    /// Sends `signal` (SIGTERM, SIGKILL, SIGSTOP, SIGCONT …).
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe {
            libc::kill(self.pid as libc::pid_t, signal);
        }
    }

    /// SIGTERM, then SIGKILL after `grace`; returns when the process has ended.
    pub fn stop(&mut self, grace: Duration) {
        if !self.is_running() {
            return;
        }
        self.signal(libc::SIGTERM);
        if !self.wait_for_exit(grace) {
            self.signal(libc::SIGKILL);
            self.wait_for_exit(Duration::from_secs(10));
        }
    }

    /// Polls until the process has ended or `limit` passed; true when it ended.
    pub fn wait_for_exit(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while self.is_running() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// The last `lines` lines of the log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }

    /// Fails with the log's tail unless the process still runs.
    pub fn ensure_running(&mut self) -> Result<()> {
        if self.is_running() {
            return Ok(());
        }
        Err(anyhow!(
            "{} exited; last lines of {}:\n{}",
            self.name,
            self.log.display(),
            self.log_tail(30)
        ))
    }
}

/// The last `lines` lines of a log file.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Whether a process with this pid exists and is not a zombie.
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state letter follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// Pids of running processes whose executable lies under `dir`.
pub fn processes_under(dir: &Path) -> Vec<(u32, PathBuf)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let exe = std::fs::read_link(entry.path().join("exe")).ok()?;
            (exe.starts_with(dir) && pid_alive(pid)).then_some((pid, exe))
        })
        .collect()
}

/// Resident memory of a process in bytes (VmRSS from /proc).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// CPU time (user + system) a process has used so far, in seconds (from /proc/PID/stat).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; the fields after its closing parenthesis do not.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    // Fields 14 (utime) and 15 (stime), counted from 1 over the whole line; 3 is "state".
    let utime: f64 = fields.nth(11)?.parse().ok()?;
    let stime: f64 = fields.next()?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((utime + stime) / ticks)
}

/// Runs a command to completion, feeding it `stdin`; returns its stdout, or fails with its
/// stderr.
pub fn run(cmd: &mut Command, stdin: Option<&str>) -> Result<String> {
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    if let Some(input) = stdin {
        use std::io::Write;
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(input.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        anyhow::bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
