//! Where the control-plane binaries (and, for a real node, the node's) come from.
//!
//! In order of preference: `KUBEBUILDER_ASSETS` (the envtest convention: a folder holding
//! `etcd` and `kube-apiserver`, optionally `kube-controller-manager`), else a build from the
//! pinned Go wrapper modules in `e2e/tools/`, cached outside the clone in
//! `<cache>/controlplane/<tool>-<version>/` so every clone and CI run on the machine reuses it.
//!
//! A real node ([`node`]) adds kubelet, kube-proxy and kube-scheduler (same module, same
//! ldflags), containerd with its runc shim and ctr (`e2e/tools/containerd`), runc with
//! seccomp (`e2e/tools/runc`, cgo, after `apt-get install libseccomp-dev pkg-config`), a
//! static pause binary compiled from the Kubernetes module's `pause.c`, and Debian's CNI
//! plugins and iptables; the process-only cluster never builds or installs any of these.
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
    /// Whether cgo is on (`CGO_ENABLED=1`); off for every tool but runc.
    cgo: bool,
    /// Go build tags (`-tags`), empty for none.
    tags: &'static str,
    /// Debian packages the build needs (headers, pkg-config), as (package, file it
    /// installs): installed on first use when the file is missing.
    build_packages: &'static [(&'static str, &'static str)],
}

const ETCD: Tool = Tool {
    module_dir: "etcd",
    version: ETCD_VERSION,
    binaries: &[("go.etcd.io/etcd/server/v3", "etcd")],
    ldflags: "",
    cgo: false,
    tags: "",
    build_packages: &[],
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
    ldflags: KUBERNETES_LDFLAGS,
    cgo: false,
    tags: "",
    build_packages: &[],
};

const KUBERNETES_LDFLAGS: &str = "-X k8s.io/component-base/version.gitVersion=v1.37.2 \
              -X k8s.io/component-base/version.gitMajor=1 \
              -X k8s.io/component-base/version.gitMinor=37 \
              -X k8s.io/client-go/pkg/version.gitVersion=v1.37.2";

/// The root of this project's caches: `$MYRESOURCE_OPERATOR_CACHE`, else
/// `$XDG_CACHE_HOME/myresource-operator`, else `~/.cache/myresource-operator`.
pub fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("MYRESOURCE_OPERATOR_CACHE") {
        return PathBuf::from(dir);
    }
    user_cache().join("myresource-operator")
}

/// `$XDG_CACHE_HOME`, else `~/.cache`.
pub fn user_cache() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into())).join(".cache")
        })
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
    cgo: false,
    tags: "",
    build_packages: &[],
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
    cgo: false,
    tags: "",
    build_packages: &[],
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
    if !apt_install(&["prometheus"]) {
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

/// Runs `apt-get update` and `apt-get install` for `packages` (as root, non-interactive);
/// true when both succeeded.
fn apt_install(packages: &[&str]) -> bool {
    eprintln!(
        "installing Debian packages {} (first use on this machine)",
        packages.join(" ")
    );
    let apt = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    apt(&["update", "-qq"])
        && apt(&[
            &["install", "-y", "-qq", "--no-install-recommends"],
            packages,
        ]
        .concat())
}

/// Makes sure the Debian packages are installed, each given as (package, a file it
/// installs): the ones whose file is missing are installed with apt-get; fails naming them
/// when that does not work. `why` says who needs them, for the messages.
pub fn debian_packages(packages: &[(&str, &str)], why: &str) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .filter(|(_, file)| !Path::new(file).exists())
        .map(|(package, _)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !apt_install(&missing) {
        bail!(
            "{why} needs the Debian packages {list}, and `apt-get install {list}` failed; \
             install them (as root) and try again",
            list = missing.join(" ")
        );
    }
    let still: Vec<&str> = packages
        .iter()
        .filter(|(_, file)| !Path::new(file).exists())
        .map(|(_, file)| *file)
        .collect();
    if !still.is_empty() {
        bail!(
            "{why}: apt-get installed {} but {} is still missing",
            missing.join(" "),
            still.join(", ")
        );
    }
    Ok(())
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

/// The containerd release built from `e2e/tools/containerd` (keep in step with its go.mod).
pub const CONTAINERD_VERSION: &str = "v2.3.7";
/// The runc release built from `e2e/tools/runc` (keep in step with its go.mod).
pub const RUNC_VERSION: &str = "v1.4.4";
/// The pause image's tag: the sandbox image containerd 2.3 names by default, built here
/// from `build/pause/linux/pause.c` of the Kubernetes module.
pub const PAUSE_VERSION: &str = "3.10.2";

/// The programs a real node runs, beside the control plane.
#[derive(Debug, Clone)]
pub struct NodeBinaries {
    pub kubelet: PathBuf,
    pub kube_proxy: PathBuf,
    pub kube_scheduler: PathBuf,
    /// containerd; `containerd-shim-runc-v2` lies next to it, where containerd looks first.
    pub containerd: PathBuf,
    pub ctr: PathBuf,
    pub runc: PathBuf,
    /// The static pause binary for the sandbox image.
    pub pause: PathBuf,
    /// Debian's CNI plugins (bridge, host-local, loopback, portmap).
    pub cni_bin_dir: PathBuf,
}

const KUBERNETES_NODE: Tool = Tool {
    module_dir: "kubernetes",
    version: KUBERNETES_VERSION,
    binaries: &[
        ("k8s.io/kubernetes/cmd/kubelet", "kubelet"),
        ("k8s.io/kubernetes/cmd/kube-proxy", "kube-proxy"),
        ("k8s.io/kubernetes/cmd/kube-scheduler", "kube-scheduler"),
    ],
    ldflags: KUBERNETES_LDFLAGS,
    cgo: false,
    tags: "",
    build_packages: &[],
};

const CONTAINERD: Tool = Tool {
    module_dir: "containerd",
    version: CONTAINERD_VERSION,
    binaries: &[
        (
            "github.com/containerd/containerd/v2/cmd/containerd",
            "containerd",
        ),
        (
            "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
            "containerd-shim-runc-v2",
        ),
        ("github.com/containerd/containerd/v2/cmd/ctr", "ctr"),
    ],
    ldflags: "-X github.com/containerd/containerd/v2/version.Version=v2.3.7",
    // btrfs support needs cgo and drops out without it, which is what we want.
    cgo: false,
    tags: "",
    build_packages: &[],
};

const RUNC: Tool = Tool {
    module_dir: "runc",
    version: RUNC_VERSION,
    binaries: &[("github.com/opencontainers/runc", "runc")],
    ldflags: "-X main.version=1.4.4",
    // Seccomp (the chart asks for RuntimeDefault) needs libseccomp through cgo.
    cgo: true,
    tags: "seccomp",
    build_packages: &[
        ("libseccomp-dev", "/usr/include/seccomp.h"),
        ("pkg-config", "/usr/bin/pkg-config"),
    ],
};

/// Debian packages the node uses at run time: the CNI plugins and iptables (kube-proxy).
const NODE_PACKAGES: &[(&str, &str)] = &[
    ("containernetworking-plugins", "/usr/lib/cni/bridge"),
    ("iptables", "/usr/sbin/iptables"),
];

/// Installs the Debian packages the nodes and their network need (CNI plugins, iptables),
/// where missing: the host's bridge and filter rules come before any node, on a new machine
/// too.
pub fn node_packages() -> Result<()> {
    debian_packages(NODE_PACKAGES, "the node")
}

/// Finds or builds everything a real node runs (kubelet, kube-proxy, kube-scheduler,
/// containerd with its shim and ctr, runc, pause) and installs the Debian packages it needs
/// (CNI plugins, iptables). Only the node asks for these: the process-only cluster never
/// builds them.
pub fn node() -> Result<NodeBinaries> {
    node_packages()?;
    let kubernetes = build(&KUBERNETES_NODE)?;
    let containerd = build(&CONTAINERD)?;
    let runc = build(&RUNC)?;
    Ok(NodeBinaries {
        kubelet: kubernetes.join("kubelet"),
        kube_proxy: kubernetes.join("kube-proxy"),
        kube_scheduler: kubernetes.join("kube-scheduler"),
        containerd: containerd.join("containerd"),
        ctr: containerd.join("ctr"),
        runc: runc.join("runc"),
        pause: pause()?,
        cni_bin_dir: PathBuf::from("/usr/lib/cni"),
    })
}

/// The static pause binary, compiled (`gcc -Os -static`, as its Makefile does) from
/// `build/pause/linux/pause.c` of the pinned Kubernetes module and cached in
/// `<cache>/controlplane/pause-<version>/`.
fn pause() -> Result<PathBuf> {
    let target = controlplane_cache().join(format!("pause-{PAUSE_VERSION}"));
    let binary = target.join("pause");
    if binary.is_file() {
        return Ok(binary);
    }
    check_go()?;
    debian_packages(&[("gcc", "/usr/bin/gcc")], "building pause")?;
    let module = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tools")
        .join(KUBERNETES.module_dir);
    // Downloads the module into the module cache when needed and prints where it is.
    let source = crate::process::run(
        Command::new("go")
            .current_dir(&module)
            .env("GOWORK", "off")
            .env("GOTOOLCHAIN", "local")
            .env("GOFLAGS", "-mod=readonly")
            .args(["list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes"]),
        None,
    )?;
    let source = PathBuf::from(source.trim()).join("build/pause/linux/pause.c");
    std::fs::create_dir_all(&target)?;
    let partial = target.join(format!("pause.partial-{}", std::process::id()));
    crate::process::run(
        Command::new("gcc")
            .args(["-Os", "-Wall", "-Werror", "-static"])
            .arg(format!("-DVERSION=v{PAUSE_VERSION}-myresource-operator"))
            .arg("-o")
            .arg(&partial)
            .arg(&source),
        None,
    )
    .with_context(|| format!("compiling {}", source.display()))?;
    std::fs::rename(&partial, &binary)?;
    Ok(binary)
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
    debian_packages(
        tool.build_packages,
        &format!("building {}", tool.module_dir),
    )?;
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
            .env("CGO_ENABLED", if tool.cgo { "1" } else { "0" })
            .env("GOFLAGS", "-mod=readonly")
            .args([
                "build",
                "-p",
                "2",
                "-trimpath",
                "-tags",
                tool.tags,
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
