//! The operator's container image, built here without Docker.
//!
//! It is the image `deploy/Dockerfile` describes (which stays the recipe for people with
//! Docker or Podman): one static binary at `/myresource-operator`, the `nonroot` user 65532
//! of distroless, no shell, no package manager, entrypoint `/myresource-operator`, argument
//! `run`. The Dockerfile links against musl; here, where the musl target cannot be
//! installed, glibc is linked statically (`-C target-feature=+crt-static`) and the result is
//! checked to ask for no dynamic loader. (A static glibc cannot load NSS modules: names
//! resolve through `/etc/hosts` and DNS only, which is all a Pod has anyway.)
//!
//! The static build has its own cargo target folder (its flags differ from every other
//! build's) outside the clone, `~/.cache/myresource-operator-build/image-target` (or under
//! `$XDG_CACHE_HOME`), so clones and CI runs on this machine reuse its compiled
//! dependencies. Like Go's build cache, it is a build product, not a binary: it is kept
//! when `MYRESOURCE_OPERATOR_CACHE` points the binaries elsewhere (the first-use check),
//! and may be removed at any time.
//! The tag carries the binary's digest: a rebuilt binary is a new image, never a stale one
//! the node already holds.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail};

use crate::node::image::{Image, ImageFile};
use crate::operator::workspace_root;

/// The chart's default `image.repository`, as containerd names it.
pub const REPOSITORY: &str = "docker.io/library/myresource-operator";
/// The target whose static build the image holds.
const TARGET: &str = "x86_64-unknown-linux-gnu";
/// distroless' users, so that user 65532 has a name.
const PASSWD: &str = "root:x:0:0:root:/root:/sbin/nologin\n\
                      nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n";
const GROUP: &str = "root:x:0:\nnonroot:x:65532:\n";

/// The image, ready to be imported.
#[derive(Debug)]
pub struct OperatorImage {
    pub image: Image,
    /// Bytes of the binary (the image's only sizeable file).
    pub binary_bytes: u64,
}

/// Builds the static release binary and the image around it.
pub fn build() -> Result<OperatorImage> {
    build_from(&workspace_root())
}

/// [`build`] from the workspace at `source` (another checkout, such as an earlier
/// release's, for a mixed-version rollout), in a target folder of its own.
pub fn build_from(source: &std::path::Path) -> Result<OperatorImage> {
    let binary = static_binary(source)?;
    let contents =
        std::fs::read(&binary).with_context(|| format!("reading {}", binary.display()))?;
    if asks_for_a_loader(&contents)? {
        bail!(
            "{} is not static: it names a dynamic loader (PT_INTERP)",
            binary.display()
        );
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, &contents);
    let digest: String = digest.as_ref()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    // The version the binary reports (which also shows that it runs).
    let out = crate::process::run(Command::new(&binary).arg("--version"), None)?;
    let version = out
        .split_whitespace()
        .last()
        .ok_or_else(|| anyhow!("{} --version printed nothing", binary.display()))?;
    let reference = format!("{REPOSITORY}:{version}-{digest}");
    let binary_bytes = contents.len() as u64;
    let file = |path: &str, mode, contents: Vec<u8>| ImageFile {
        path: path.into(),
        mode,
        contents,
    };
    Ok(OperatorImage {
        image: Image {
            reference,
            files: vec![
                file("myresource-operator", 0o755, contents),
                file("etc/passwd", 0o644, PASSWD.into()),
                file("etc/group", 0o644, GROUP.into()),
            ],
            entrypoint: vec!["/myresource-operator".into()],
            cmd: vec!["run".into()],
            user: "65532:65532".into(),
        },
        binary_bytes,
    })
}

/// `cargo build --release` of the operator in the workspace at `source`, glibc linked
/// statically.
fn static_binary(source: &std::path::Path) -> Result<PathBuf> {
    // Another checkout gets a folder of its own: cargo names the artifacts of a workspace
    // member alike wherever it is checked out, so two checkouts building into one folder
    // overwrite each other's binary, and one may then take the other's as fresh.
    let folder = if source == workspace_root() {
        "image-target"
    } else {
        "image-target-other-checkout"
    };
    let target_dir = crate::binaries::user_cache()
        .join("myresource-operator-build")
        .join(folder);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(source)
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .env("CARGO_TARGET_DIR", &target_dir)
        .args([
            "build",
            "--quiet",
            "--release",
            "--locked",
            "--package",
            "myresource-operator",
            "--bin",
            "myresource-operator",
            "--target",
            TARGET,
        ])
        .status()
        .context("running cargo build for the image")?;
    if !status.success() {
        bail!("the static build of the operator failed ({status})");
    }
    let binary = target_dir
        .join(TARGET)
        .join("release")
        .join("myresource-operator");
    binary
        .exists()
        .then_some(binary)
        .ok_or_else(|| anyhow!("cargo build left no binary in {}", target_dir.display()))
}

/// Whether an ELF64 file has a `PT_INTERP` program header (a dynamic loader to run it).
fn asks_for_a_loader(elf: &[u8]) -> Result<bool> {
    const PT_INTERP: u32 = 3;
    let field = |at: usize, len: usize| -> Result<u64> {
        let bytes = elf
            .get(at..at + len)
            .ok_or_else(|| anyhow!("truncated ELF header"))?;
        Ok(bytes
            .iter()
            .rev()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    };
    if elf.get(..5) != Some(b"\x7fELF\x02".as_slice()) {
        bail!("not a 64-bit ELF file");
    }
    let (offset, size, count) = (field(0x20, 8)?, field(0x36, 2)?, field(0x38, 2)?);
    for i in 0..count {
        if field((offset + i * size) as usize, 4)? == u64::from(PT_INTERP) {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dynamic_executable_asks_for_a_loader_and_a_static_one_does_not() {
        // This test binary is dynamically linked (the workspace builds without crt-static).
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(asks_for_a_loader(&me).unwrap());
        // A minimal ELF64 header with no program headers: nothing to load.
        let mut header = vec![0u8; 64];
        header[..5].copy_from_slice(b"\x7fELF\x02");
        assert!(!asks_for_a_loader(&header).unwrap());
        assert!(asks_for_a_loader(b"#!/bin/sh").is_err());
    }
}
