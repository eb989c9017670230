//! docs/node-facts.md's fail-fast checks, each on a node of its own in a folder of its own, torn down
//! afterwards whatever the outcome:
//! 1. [`runc_alone`]: `ctr run` with seccomp, a memory limit and user 65532 of a tiny static
//!    test image, then an allocation over the limit (runc on cgroup v1, seccomp, overlayfs
//!    and a hand-written image at once);
//! 2. [`kubelet_standalone`]: the kubelet with no API server runs a static Pod on the CNI
//!    bridge (cgroup v1 flag, CRI, CNI, pause image).
//!
//! The test program ([`probe_image`]) is `probe.c` beside this file, compiled static.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

use super::image::{Image, ImageFile};
use super::{Node, PARTS, fabric, teardown};
use crate::process::{self, Lifetime, Process};

/// The probe image's reference.
pub const PROBE_IMAGE: &str = "localhost/mro-probe:1";
const PROBE_SOURCE: &str = include_str!("probe.c");
const MEMORY_LIMIT: u64 = 256 * 1024 * 1024;

/// The test program as a one-layer image: `/probe`, user 65532, `probe info` by default.
pub fn probe_image(dir: &Path) -> Result<Image> {
    std::fs::create_dir_all(dir)?;
    let source = dir.join("probe.c");
    let binary = dir.join("probe");
    std::fs::write(&source, PROBE_SOURCE)?;
    process::run(
        Command::new("gcc")
            .args(["-Os", "-Wall", "-static", "-o"])
            .arg(&binary)
            .arg(&source),
        None,
    )
    .context("compiling the probe program")?;
    Ok(Image {
        reference: PROBE_IMAGE.into(),
        files: vec![ImageFile {
            path: "probe".into(),
            mode: 0o755,
            contents: std::fs::read(&binary)?,
        }],
        entrypoint: vec!["/probe".into()],
        cmd: vec!["info".into()],
        user: "65532:65532".into(),
    })
}

/// The processes a probe started, stopped by name at tear-down.
#[derive(Default)]
struct Started(Vec<Process>);

impl Started {
    fn spawn(&mut self, dir: &Path, name: &str, cmd: Command) -> Result<()> {
        let log = dir.join(format!("{name}.log"));
        self.0.push(process::spawn(
            name,
            cmd,
            &log,
            Lifetime::TiedToThisProcess,
        )?);
        Ok(())
    }

    fn alive(&mut self, name: &str) -> Result<()> {
        match self.0.iter_mut().find(|p| p.name == name) {
            Some(p) => p.ensure_running(),
            None => Err(anyhow!("{name} was not started")),
        }
    }

    fn stop(&mut self, name: &str) {
        if let Some(p) = self.0.iter_mut().find(|p| p.name == name) {
            p.stop(Duration::from_secs(10));
        }
    }
}

/// Runs `check` on a fresh node in `dir`, then tears the node down and removes `dir`; the
/// check's error wins over the tear-down's.
fn with_node(
    dir: &Path,
    check: impl FnOnce(&Node, &mut Started) -> Result<String>,
) -> Result<String> {
    let _ = std::fs::remove_dir_all(dir);
    fabric::create(dir, None)?;
    let outcome = Node::prepare(dir, 1).and_then(|node| {
        let mut started = Started::default();
        let outcome = node
            .network
            .create()
            .and_then(|()| check(&node, &mut started));
        let down = teardown(&node.dir, &mut |name| started.stop(name));
        for part in PARTS {
            started.stop(&node.process_name(part));
        }
        match (outcome, down) {
            (Ok(report), Ok(())) => Ok(report),
            (Ok(_), Err(err)) => Err(err),
            (Err(err), Err(down)) => Err(err.context(format!("tear-down also failed: {down:#}"))),
            (Err(err), Ok(())) => Err(err),
        }
    });
    let outcome = match (outcome, fabric::teardown(dir)) {
        (outcome, Ok(())) => outcome,
        (Ok(_), Err(err)) => Err(err),
        (Err(err), Err(down)) => Err(err.context(format!("tear-down also failed: {down:#}"))),
    };
    if outcome.is_ok() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    outcome
}

fn start_containerd(node: &Node, started: &mut Started) -> Result<()> {
    let name = node.process_name("containerd");
    started.spawn(&node.dir, &name, node.containerd_command()?)?;
    node.runtime.wait_ready(&node.bin, || started.alive(&name))
}

/// docs/node-facts.md step 1: runc alone through `ctr run` (see the module doc). Returns a report.
pub fn runc_alone(dir: &Path) -> Result<String> {
    with_node(dir, |node, started| {
        start_containerd(node, started)?;
        node.import(&probe_image(&node.dir.join("probe"))?)?;
        let run = |name: &str, args: &[&str]| {
            let mut cmd = node.runtime.ctr(&node.bin.ctr);
            cmd.args(["run", "--rm", "--seccomp"])
                .arg("--runc-binary")
                .arg(&node.bin.runc)
                .arg("--runc-root")
                .arg(node.runtime.dir.join("state/runc"))
                .arg(format!("--memory-limit={MEMORY_LIMIT}"))
                .args(["--user", "65532:65532"])
                .arg(format!("--cgroup={}/{name}", node.cgroups.path))
                .arg(PROBE_IMAGE)
                .arg(name)
                .arg("/probe")
                .args(args);
            cmd.output().context("running ctr run")
        };
        let out = run("probe-info", &["info"])?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(
            out.status.success(),
            "ctr run failed ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        for expected in [
            "uid=65532 gid=65532".to_string(),
            "Seccomp:\t2".to_string(),
            "NoNewPrivs:\t1".to_string(),
            format!(":memory:{}/probe-info", node.cgroups.path),
        ] {
            ensure!(
                text.contains(&expected),
                "probe output lacks {expected:?}:\n{text}"
            );
        }
        let over = run("probe-alloc", &["alloc", "512"])?;
        ensure!(
            over.status.code() == Some(137),
            "allocating 512 MiB under a 256 MiB limit ended with {} (137 expected): {}",
            over.status,
            String::from_utf8_lossy(&over.stdout)
        );
        // ctr's default spec mounts no cgroup filesystem, so the limit shows in its effect.
        Ok(format!(
            "runc alone: ok\n{text}allocating 512 MiB under the {} MiB limit: exit 137 (OOM-killed)\n",
            MEMORY_LIMIT >> 20
        ))
    })
}

/// docs/node-facts.md step 2: the kubelet with no API server runs a static Pod (non-root, seccomp
/// RuntimeDefault, a memory limit) on the CNI bridge. Returns a report.
pub fn kubelet_standalone(dir: &Path) -> Result<String> {
    with_node(dir, |node, started| {
        start_containerd(node, started)?;
        node.import_pause()?;
        node.import(&probe_image(&node.dir.join("probe"))?)?;
        let static_pods = node.dir.join("static-pods");
        std::fs::create_dir_all(&static_pods)?;
        std::fs::write(
            static_pods.join("probe.json"),
            serde_json::to_vec_pretty(&static_pod())?,
        )?;
        let kubelet = kubelet_settings(node, None, Some(static_pods));
        let kubelet_name = node.process_name("kubelet");
        let mut cmd = kubelet.command(&node.bin)?;
        node.network.enter(&mut cmd)?;
        started.spawn(&node.dir, &kubelet_name, cmd)?;
        // The static Pod's container log says who it runs as.
        let deadline = Instant::now() + Duration::from_secs(180);
        let log = loop {
            started.alive(&kubelet_name)?;
            started.alive(&node.process_name("containerd"))?;
            if let Some(log) = find_log(&kubelet.pod_logs_dir(), "probe")
                && std::fs::read_to_string(&log).is_ok_and(|t| t.contains("uid="))
            {
                break std::fs::read_to_string(&log)?;
            }
            if Instant::now() > deadline {
                bail!(
                    "the static Pod wrote no log within 180 s; kubelet log tail:\n{}",
                    process::log_tail(&node.dir.join(format!("{kubelet_name}.log")), 40)
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        for expected in [
            "uid=65532 gid=65532",
            "Seccomp:\t2",
            "NoNewPrivs:\t1",
            "memory.limit_in_bytes: 67108864",
        ] {
            ensure!(
                log.contains(expected),
                "the Pod's log lacks {expected:?}:\n{log}"
            );
        }
        ensure!(
            log.contains(&format!(":memory:{}/", node.cgroups.path)),
            "the Pod runs outside the node's memory cgroup {}:\n{log}",
            node.cgroups.path
        );
        let addresses: Vec<String> = std::fs::read_dir(node.network.ipam_dir.join("mro-pods"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .filter(|n| n.starts_with("10.244."))
                    .collect()
            })
            .unwrap_or_default();
        ensure!(!addresses.is_empty(), "CNI allocated no Pod address");
        Ok(format!(
            "kubelet standalone: ok; the static Pod got {addresses:?} from CNI and wrote:\n{log}"
        ))
    })
}

/// The kubelet's settings on this node; `api` is (kubeconfig, client CA) when joined.
pub fn kubelet_settings(
    node: &Node,
    api: Option<(PathBuf, PathBuf)>,
    static_pods: Option<PathBuf>,
) -> super::kubelet::KubeletSettings {
    super::kubelet::KubeletSettings {
        dir: node.dir.join("kubelet"),
        node_name: node.name.clone(),
        node_ip: node.network.address.clone(),
        cgroup_root: node.cgroups.path.clone(),
        runtime_socket: node.runtime.socket.clone(),
        static_pods,
        api,
        pod_cidr: node.network.pod_cidr.clone(),
        // The node's own namespace: the ports upstream uses.
        port: 10250,
        healthz_port: 10248,
    }
}

fn static_pod() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe", "namespace": "default"},
        "spec": {
            "securityContext": {
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "runAsNonRoot": true,
                "seccompProfile": {"type": "RuntimeDefault"}
            },
            "containers": [{
                "name": "probe",
                "image": PROBE_IMAGE,
                "imagePullPolicy": "Never",
                "args": ["info-and-wait"],
                "resources": {"limits": {"memory": "64Mi", "cpu": "100m"}},
                "securityContext": {"allowPrivilegeEscalation": false}
            }]
        }
    })
}

/// The first log file of a container named `container` under the kubelet's Pod logs.
fn find_log(pod_logs: &Path, container: &str) -> Option<PathBuf> {
    for pod in std::fs::read_dir(pod_logs).ok()?.flatten() {
        let dir = pod.path().join(container);
        if let Ok(files) = std::fs::read_dir(&dir) {
            for f in files.flatten() {
                if f.path().extension().is_some_and(|e| e == "log") {
                    return Some(f.path());
                }
            }
        }
    }
    None
}
