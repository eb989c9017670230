//! containerd for the node: its own config, root, state and sockets under the cluster's
//! folder; runc (built with seccomp) as its runtime; the locally built pause image pinned as
//! the sandbox image, so nothing is ever pulled.
//!
//! Settings that matter on this machine (docs/node-facts.md):
//! - `restrict_oom_score_adj = true`: no process here holds CAP_SYS_RESOURCE, so no
//!   container may get an oom_score_adj below containerd's own;
//! - `netns_mounts_under_state_dir = true` and runc's `Root` in the state folder: Pod network
//!   namespaces and runc's state stay under the cluster's folder instead of `/run`;
//! - the `opt` plugin's path under the root folder (instead of `/opt/containerd`), NRI off
//!   (no `/run/nri`). What containerd still writes outside the folder — shim sockets in
//!   `/run/containerd/s` — is removed at tear-down when it did not exist before.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::binaries::{NodeBinaries, PAUSE_VERSION};

/// Where one containerd lives.
#[derive(Debug, Clone)]
pub struct Runtime {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub socket: PathBuf,
}

/// The pause image's reference, as containerd 2.3 names its default sandbox image.
pub fn pause_reference() -> String {
    format!("registry.k8s.io/pause:{PAUSE_VERSION}")
}

impl Runtime {
    /// The layout under `dir` (nothing is written yet).
    pub fn new(dir: &Path) -> Runtime {
        Runtime {
            dir: dir.to_path_buf(),
            config: dir.join("config.toml"),
            socket: dir.join("containerd.sock"),
        }
    }

    /// containerd's `state` folder: what a machine keeps in `/run` (runc's state, the
    /// tasks' root filesystems and Pods' network namespaces), gone at a power-off.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// Writes containerd's config. `cni_conf_dir` is where the network's CNI config lies.
    pub fn write_config(&self, bin: &NodeBinaries, cni_conf_dir: &Path) -> Result<()> {
        let root = self.dir.join("root");
        let state = self.state_dir();
        std::fs::create_dir_all(&root)?;
        std::fs::create_dir_all(&state)?;
        let q = |p: &Path| toml_string(&p.to_string_lossy());
        let config = format!(
            r#"version = 3
root = {root}
state = {state}

[grpc]
  address = {socket}

[ttrpc]
  address = {ttrpc}

[plugins."io.containerd.internal.v1.opt"]
  path = {opt}

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = {pause}

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = {runc}
        Root = {runc_root}
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = [{cni_bin}]
    conf_dir = {cni_conf}
    max_conf_num = 1

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
"#,
            root = q(&root),
            state = q(&state),
            socket = q(&self.socket),
            ttrpc = q(&self.dir.join("containerd.sock.ttrpc")),
            opt = q(&root.join("opt")),
            pause = toml_string(&pause_reference()),
            runc = q(&bin.runc),
            runc_root = q(&state.join("runc")),
            cni_bin = q(&bin.cni_bin_dir),
            cni_conf = q(cni_conf_dir),
        );
        std::fs::write(&self.config, config)?;
        Ok(())
    }

    /// The command that runs containerd with this config (the shim is found next to the
    /// containerd binary; runc by its full path in the config).
    pub fn command(&self, bin: &NodeBinaries) -> Command {
        let mut cmd = Command::new(&bin.containerd);
        cmd.arg("--config")
            .arg(&self.config)
            .arg("--log-level=info");
        // containerd looks for `containerd-shim-runc-v2` on PATH before its own folder.
        let dir = bin.containerd.parent().expect("binary in a folder");
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut paths = vec![dir.to_path_buf()];
        paths.extend(std::env::split_paths(&path));
        cmd.env("PATH", std::env::join_paths(paths).expect("PATH entries"));
        cmd
    }

    /// `ctr` against this containerd, in namespace `k8s.io`.
    pub fn ctr(&self, ctr: &Path) -> Command {
        let mut cmd = Command::new(ctr);
        cmd.arg("--address")
            .arg(&self.socket)
            .args(["-n", "k8s.io"]);
        cmd
    }

    /// Waits (up to 30 s) until containerd answers `ctr version`; `alive` is checked on
    /// every round so a crash fails at once.
    pub fn wait_ready(
        &self,
        bin: &NodeBinaries,
        mut alive: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = self.socket.exists()
                && self
                    .ctr(&bin.ctr)
                    .arg("version")
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
            if ok {
                return Ok(());
            }
            alive()?;
            if Instant::now() > deadline {
                bail!(
                    "containerd did not answer on {} within 30 s",
                    self.socket.display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A TOML basic string.
fn toml_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serialises")
}
