//! Where the control-plane binaries come from.
//!
//! In order of preference: `KUBEBUILDER_ASSETS` (the envtest convention: a folder holding
//! `etcd` and `kube-apiserver`, optionally `kube-controller-manager`), else a build from the
//! pinned Go wrapper modules in `e2e/tools/`, cached outside the clone in
//! `<cache>/controlplane/<tool>-<version>/` so every clone and CI run on the machine reuses it.
//!
//! Invariant: a binary is in the cache only when its build finished (each is built into a
//! temporary sibling folder and renamed into place), so a killed build never leaves a
//! half-written binary; a missing binary is built on the next use.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// The Kubernetes release built from `e2e/tools/kubernetes` (keep in step with its go.mod).
pub const KUBERNETES_VERSION: &str = "v1.37.2";
/// The etcd release built from `e2e/tools/etcd` (keep in step with its go.mod).
pub const ETCD_VERSION: &str = "v3.7.3";

/// Paths of the control-plane programs (and a kubectl of the same release).
#[derive(Debug, Clone)]
pub struct Binaries {
    pub etcd: PathBuf,
    pub kube_apiserver: PathBuf,
    pub kube_controller_manager: PathBuf,
}

struct Tool {
    module_dir: &'static str,
    version: &'static str,
    /// (Go package, binary name) pairs.
    binaries: &'static [(&'static str, &'static str)],
    /// Linker flags (version stamps, so `/version` tells the truth).
    ldflags: &'static str,
}

const ETCD: Tool = Tool {
    module_dir: "etcd",
    version: ETCD_VERSION,
    binaries: &[("go.etcd.io/etcd/server/v3", "etcd")],
    ldflags: "",
};

const KUBERNETES: Tool = Tool {
    module_dir: "kubernetes",
    version: KUBERNETES_VERSION,
    binaries: &[
        ("k8s.io/kubernetes/cmd/kube-apiserver", "kube-apiserver"),
        (
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "kube-controller-manager",
        ),
        ("k8s.io/kubernetes/cmd/kubectl", "kubectl"),
    ],
    ldflags: "-X k8s.io/component-base/version.gitVersion=v1.37.2 \
              -X k8s.io/component-base/version.gitMajor=1 \
              -X k8s.io/component-base/version.gitMinor=37 \
              -X k8s.io/client-go/pkg/version.gitVersion=v1.37.2",
};

/// The root of this project's caches: `$MYRESOURCE_OPERATOR_CACHE`, else
/// `$XDG_CACHE_HOME/myresource-operator`, else `~/.cache/myresource-operator`.
pub fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("MYRESOURCE_OPERATOR_CACHE") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into())).join(".cache")
        });
    base.join("myresource-operator")
}

/// The folder every control-plane binary of this project lives in (used to find leftovers).
pub fn controlplane_cache() -> PathBuf {
    cache_root().join("controlplane")
}

/// Jaeger (v2, in-memory), for the tracing tests; built from `e2e/tools/jaeger` on first use.
pub fn jaeger() -> Result<PathBuf> {
    Ok(build(&JAEGER)?.join("jaeger"))
}

const JAEGER: Tool = Tool {
    module_dir: "jaeger",
    // v1.76.0 is served by the module proxy but is not an approved release here.
    version: "v1.75.0",
    binaries: &[("github.com/jaegertracing/jaeger/cmd/jaeger", "jaeger")],
    ldflags: "",
};

/// Helm v4, for the chart tests; built from `e2e/tools/helm` on first use.
pub fn helm() -> Result<PathBuf> {
    Ok(build(&HELM)?.join("helm"))
}

const HELM: Tool = Tool {
    module_dir: "helm",
    version: "v4.3.2",
    binaries: &[("helm.sh/helm/v4/cmd/helm", "helm")],
    ldflags: "",
};

/// Prometheus and promtool: Debian's `prometheus` package, installed on first use when
/// missing (as root, with apt-get), since building Prometheus from its module takes far
/// longer. Returns (prometheus, promtool).
pub fn prometheus() -> Result<(PathBuf, PathBuf)> {
    let found = |name: &str| {
        std::env::var_os("PATH")
            .map(|paths| {
                std::env::split_paths(&paths)
                    .map(|p| p.join(name))
                    .find(|p| p.is_file())
            })
            .unwrap_or_default()
    };
    if let (Some(server), Some(tool)) = (found("prometheus"), found("promtool")) {
        return Ok((server, tool));
    }
    eprintln!("installing Debian's prometheus package (first use on this machine)");
    let install = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    if !(install(&["update", "-qq"])
        && install(&[
            "install",
            "-y",
            "-qq",
            "--no-install-recommends",
            "prometheus",
        ]))
    {
        bail!(
            "prometheus and promtool are not on PATH and `apt-get install prometheus` failed; \
             install Debian's prometheus package (or put both binaries on PATH)"
        );
    }
    match (found("prometheus"), found("promtool")) {
        (Some(server), Some(tool)) => Ok((server, tool)),
        _ => bail!("the prometheus package installed no prometheus/promtool on PATH"),
    }
}

/// A kubectl of the same release as the control plane (built on first use), so tests and
/// the demo do not depend on whatever kubectl the machine has.
pub fn kubectl() -> Result<PathBuf> {
    Ok(build(&KUBERNETES)?.join("kubectl"))
}

/// Finds or builds etcd, kube-apiserver and kube-controller-manager.
pub fn ensure() -> Result<Binaries> {
    let assets = std::env::var_os("KUBEBUILDER_ASSETS").map(PathBuf::from);
    let etcd = match &assets {
        Some(dir) => existing(dir, "etcd")?,
        None => build(&ETCD)?.join("etcd"),
    };
    let kube_apiserver = match &assets {
        Some(dir) => existing(dir, "kube-apiserver")?,
        None => build(&KUBERNETES)?.join("kube-apiserver"),
    };
    let kube_controller_manager = match assets.as_deref().map(|d| d.join("kube-controller-manager"))
    {
        Some(path) if path.is_file() => path,
        _ => build(&KUBERNETES)?.join("kube-controller-manager"),
    };
    Ok(Binaries {
        etcd,
        kube_apiserver,
        kube_controller_manager,
    })
}

fn existing(dir: &Path, name: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    if !path.is_file() {
        bail!(
            "KUBEBUILDER_ASSETS={} has no {name}; it must hold etcd and kube-apiserver \
             (unset it to build them from e2e/tools/ instead)",
            dir.display()
        );
    }
    Ok(path)
}

/// Returns the cache folder holding every binary of `tool`, building the missing ones.
fn build(tool: &Tool) -> Result<PathBuf> {
    let target = controlplane_cache().join(format!("{}-{}", tool.module_dir, tool.version));
    let missing: Vec<_> = tool
        .binaries
        .iter()
        .filter(|(_, binary)| !target.join(binary).is_file())
        .collect();
    if missing.is_empty() {
        return Ok(target);
    }
    check_go()?;
    let module = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tools")
        .join(tool.module_dir);
    let partial = target.with_extension(format!("partial-{}", std::process::id()));
    std::fs::create_dir_all(&partial)?;
    std::fs::create_dir_all(&target)?;
    for (package, binary) in missing {
        eprintln!(
            "building {binary} {} from {} (first use on this machine; minutes)",
            tool.version,
            module.display()
        );
        let started = Instant::now();
        let status = Command::new("go")
            .current_dir(&module)
            .env("GOWORK", "off")
            .env("GOTOOLCHAIN", "local")
            .env("CGO_ENABLED", "0")
            .env("GOFLAGS", "-mod=readonly")
            .args([
                "build",
                "-p",
                "2",
                "-trimpath",
                "-ldflags",
                tool.ldflags,
                "-o",
            ])
            .arg(partial.join(binary))
            .arg(package)
            .status()
            .context("running go build")?;
        if !status.success() {
            let _ = std::fs::remove_dir_all(&partial);
            bail!(
                "go build of {package} in {} failed ({status})",
                module.display()
            );
        }
        std::fs::rename(partial.join(binary), target.join(binary))?;
        eprintln!(
            "built {binary} in {:.0?} into {}",
            started.elapsed(),
            target.display()
        );
    }
    let _ = std::fs::remove_dir_all(&partial);
    Ok(target)
}

fn check_go() -> Result<()> {
    match Command::new("go").arg("version").output() {
        Ok(out) if out.status.success() => Ok(()),
        _ => bail!(
            "the control plane (etcd {ETCD_VERSION}, kube-apiserver and kube-controller-manager \
             {KUBERNETES_VERSION}) is built from Go modules on first use, and no working `go` \
             (Go 1.26 or newer, with access to the Go module proxy) is on PATH.\n\
             Either install Go, or point KUBEBUILDER_ASSETS at a folder holding etcd and \
             kube-apiserver (kube-controller-manager too, for garbage collection), or run \
             against an existing cluster with USE_EXISTING_CLUSTER=true and KUBECONFIG set"
        ),
    }
}
