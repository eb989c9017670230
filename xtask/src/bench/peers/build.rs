//! The peers' binaries: built from `bench/peers/` on first use (Go with the module and build
//! caches under ~/.cache as the control plane is, Rust with its own Cargo.lock), and kept
//! outside the clone in `<cache>/peers/<peer>-<hash of its sources and lockfiles>/`, so any
//! clone with the same sources reuses them. A binary is renamed into place only once its
//! build finished.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// Paths of the peer binaries.
pub(in crate::bench) struct PeerBinaries {
    pub(super) controller_runtime: PathBuf,
    pub(super) kube_runtime: PathBuf,
}

/// Finds or builds both peers.
pub(in crate::bench) fn ensure(root: &Path) -> Result<PeerBinaries> {
    let peers = root.join("bench/peers");
    Ok(PeerBinaries {
        controller_runtime: controller_runtime(&peers.join("controller-runtime"))?,
        kube_runtime: kube_runtime(&peers.join("kube-runtime"))?,
    })
}

fn controller_runtime(src: &Path) -> Result<PathBuf> {
    let name = "controller-runtime-peer";
    cached(
        src,
        &["go.mod", "go.sum", "main.go", "types.go"],
        name,
        |out| {
            let status = Command::new("go")
                .current_dir(src)
                .env("GOWORK", "off")
                .env("GOTOOLCHAIN", "local")
                .env("CGO_ENABLED", "0")
                .env("GOFLAGS", "-mod=readonly")
                .args(["build", "-p", "2", "-trimpath", "-o"])
                .arg(out)
                .arg(".")
                .status()
                .context("running go build (the controller-runtime peer needs Go 1.26)")?;
            anyhow::ensure!(status.success(), "go build in {} failed", src.display());
            Ok(())
        },
    )
}

fn kube_runtime(src: &Path) -> Result<PathBuf> {
    let name = "kube-runtime-peer";
    let target_dir = e2e::binaries::cache_root().join("peers/kube-runtime-target");
    // Its sources, and kube-leasehold's (a path dependency), named relative to `src`.
    let mut files: Vec<String> = ["Cargo.toml", "Cargo.lock", "src/main.rs"]
        .map(String::from)
        .to_vec();
    let crate_dir = "../../../leasehold";
    files.push(format!("{crate_dir}/Cargo.toml"));
    files.push("../../../Cargo.toml".into());
    files.extend(
        rust_files(&src.join(crate_dir).join("src"))?
            .into_iter()
            .map(|f| format!("{crate_dir}/src/{f}")),
    );
    let files: Vec<&str> = files.iter().map(String::as_str).collect();
    cached(src, &files, name, |out| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args([
                "build",
                "--release",
                "--locked",
                "--quiet",
                "--manifest-path",
            ])
            .arg(src.join("Cargo.toml"))
            .arg("--target-dir")
            .arg(&target_dir)
            .status()
            .context("running cargo build")?;
        anyhow::ensure!(status.success(), "cargo build of {} failed", src.display());
        std::fs::copy(target_dir.join("release").join(name), out)?;
        Ok(())
    })
}

/// The `.rs` files under `dir`, relative to it, sorted (a stable cache key).
fn rust_files(dir: &Path) -> Result<Vec<String>> {
    let mut found = Vec::new();
    let mut folders = vec![dir.to_path_buf()];
    while let Some(folder) = folders.pop() {
        for entry in
            std::fs::read_dir(&folder).with_context(|| format!("reading {}", folder.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path.strip_prefix(dir)?.to_string_lossy().into_owned();
                found.push(relative);
            }
        }
    }
    found.sort();
    Ok(found)
}

/// `<cache>/peers/<name>-<hash of files>/<name>`, built by `build` (into the path it is
/// given) when missing.
fn cached(
    src: &Path,
    files: &[&str],
    name: &str,
    build: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let mut hash = Fnv::new();
    for file in files {
        let bytes = std::fs::read(src.join(file))
            .with_context(|| format!("reading {}", src.join(file).display()))?;
        hash.write(file.as_bytes());
        hash.write(&bytes);
    }
    let dir = e2e::binaries::cache_root()
        .join("peers")
        .join(format!("{name}-{:016x}", hash.0));
    let binary = dir.join(name);
    if binary.is_file() {
        return Ok(binary);
    }
    std::fs::create_dir_all(&dir)?;
    let partial = dir.join(format!("{name}.partial-{}", std::process::id()));
    eprintln!(
        "building {name} from {} (first use of these sources; minutes)",
        src.display()
    );
    let started = Instant::now();
    if let Err(err) = build(&partial) {
        let _ = std::fs::remove_file(&partial);
        bail!("building {name}: {err:#}");
    }
    std::fs::rename(&partial, &binary)?;
    eprintln!(
        "built {name} in {:.0?} into {}",
        started.elapsed(),
        dir.display()
    );
    Ok(binary)
}

/// 64-bit FNV-1a: a cache key that stays the same across Rust releases (std's hashers do
/// not promise that).
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}
