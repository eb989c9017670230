//! Images without a registry: a docker-archive (`manifest.json`, a config, one layer) written
//! here and imported into containerd's `k8s.io` namespace with `ctr images import`.
//!
//! The archive format is the one `docker save` writes and containerd's importer reads. Both
//! the layer and the archive around it are plain ustar files, written by [`Tar`] (a few
//! dozen lines: regular files and folders only, owned by root, mtime 0, so the same input
//! gives the same digests). The config's `rootfs.diff_ids` names the layer's sha256, which
//! containerd checks when it unpacks the layer.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::json;

/// A regular file in an image's only layer.
#[derive(Debug, Clone)]
pub struct ImageFile {
    /// Path inside the image, without the leading `/` (`pause`, `etc/x`).
    pub path: String,
    pub mode: u32,
    pub contents: Vec<u8>,
}

/// A one-layer image.
#[derive(Debug, Clone)]
pub struct Image {
    /// The full reference it is tagged with (`registry.k8s.io/pause:3.10.2`).
    pub reference: String,
    pub files: Vec<ImageFile>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `uid:gid`.
    pub user: String,
}

impl Image {
    /// Writes the image as a docker-archive to `out`.
    pub fn write_docker_archive(&self, out: &Path) -> Result<()> {
        let mut layer = Tar::default();
        let mut dirs: Vec<String> = Vec::new();
        for file in &self.files {
            // Parent folders first, each once.
            let parts: Vec<&str> = file.path.split('/').collect();
            for i in 1..parts.len() {
                let dir = parts[..i].join("/");
                if !dirs.contains(&dir) {
                    layer.dir(&dir, 0o755)?;
                    dirs.push(dir);
                }
            }
            layer.file(&file.path, file.mode, &file.contents)?;
        }
        let layer = layer.finish();
        let diff_id = sha256_hex(&layer);
        let config = serde_json::to_vec(&json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "User": self.user,
                "Entrypoint": self.entrypoint,
                "Cmd": if self.cmd.is_empty() { serde_json::Value::Null } else { json!(self.cmd) },
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            },
            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]},
            "history": [{"created_by": "myresource-operator e2e (docker-archive writer)"}],
        }))?;
        let config_name = format!("{}.json", sha256_hex(&config));
        let layer_name = format!("{diff_id}/layer.tar");
        let manifest = serde_json::to_vec(&json!([{
            "Config": config_name,
            "RepoTags": [self.reference],
            "Layers": [layer_name],
        }]))?;
        let mut archive = Tar::default();
        archive.dir(&diff_id, 0o755)?;
        archive.file(&layer_name, 0o644, &layer)?;
        archive.file(&config_name, 0o644, &config)?;
        archive.file("manifest.json", 0o644, &manifest)?;
        std::fs::write(out, archive.finish())
            .with_context(|| format!("writing {}", out.display()))?;
        Ok(())
    }
}

/// Imports a docker-archive into containerd's `k8s.io` namespace (the CRI's) and unpacks it.
pub fn import(ctr: &Path, address: &Path, archive: &Path) -> Result<()> {
    crate::process::run(
        Command::new(ctr)
            .arg("--address")
            .arg(address)
            .args(["-n", "k8s.io", "images", "import", "--local"])
            .arg(archive),
        None,
    )
    .with_context(|| format!("importing {}", archive.display()))?;
    Ok(())
}

fn sha256_hex(bytes: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// A ustar writer for regular files and folders (root-owned, mtime 0).
#[derive(Default)]
pub struct Tar {
    bytes: Vec<u8>,
}

impl Tar {
    pub fn dir(&mut self, path: &str, mode: u32) -> Result<()> {
        self.header(&format!("{}/", path.trim_end_matches('/')), mode, 0, b'5')
    }

    pub fn file(&mut self, path: &str, mode: u32, contents: &[u8]) -> Result<()> {
        self.header(path, mode, contents.len() as u64, b'0')?;
        self.bytes.extend_from_slice(contents);
        let pad = (512 - contents.len() % 512) % 512;
        self.bytes.extend(std::iter::repeat_n(0u8, pad));
        Ok(())
    }

    /// The archive, with its two closing zero blocks.
    pub fn finish(mut self) -> Vec<u8> {
        self.bytes.extend(std::iter::repeat_n(0u8, 1024));
        self.bytes
    }

    fn header(&mut self, path: &str, mode: u32, size: u64, kind: u8) -> Result<()> {
        let mut h = [0u8; 512];
        let (prefix, name) = if path.len() <= 100 {
            ("", path)
        } else {
            // ustar splits long paths at a '/' into prefix (≤155) and name (≤100).
            match path[..path.len().min(156)].rfind('/') {
                Some(i) if path.len() - i - 1 <= 100 => (&path[..i], &path[i + 1..]),
                _ => bail!("path too long for ustar: {path}"),
            }
        };
        h[..name.len()].copy_from_slice(name.as_bytes());
        octal(&mut h[100..108], mode as u64);
        octal(&mut h[108..116], 0);
        octal(&mut h[116..124], 0);
        octal(&mut h[124..136], size);
        octal(&mut h[136..148], 0);
        h[156] = kind;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[345..345 + prefix.len()].copy_from_slice(prefix.as_bytes());
        // The checksum is taken with its own field as eight spaces.
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|b| *b as u32).sum();
        let field = format!("{sum:06o}\0 ");
        h[148..156].copy_from_slice(field.as_bytes());
        self.bytes.extend_from_slice(&h);
        Ok(())
    }
}

/// Writes `value` as zero-padded octal, NUL-terminated, filling `field`.
fn octal(field: &mut [u8], value: u64) {
    let digits = field.len() - 1;
    let text = format!("{value:0digits$o}");
    field[..digits].copy_from_slice(text.as_bytes());
    field[digits] = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tar_headers_have_valid_checksums_and_sizes() {
        let mut tar = Tar::default();
        tar.dir("a", 0o755).unwrap();
        tar.file("a/b", 0o644, b"hello").unwrap();
        let bytes = tar.finish();
        assert_eq!(bytes.len(), 512 * 5);
        let header = &bytes[512..1024];
        assert_eq!(&header[..3], b"a/b");
        let stored =
            u32::from_str_radix(std::str::from_utf8(&header[148..154]).unwrap(), 8).unwrap();
        let mut copy = header.to_vec();
        copy[148..156].copy_from_slice(b"        ");
        assert_eq!(stored, copy.iter().map(|b| *b as u32).sum::<u32>());
        assert_eq!(&header[124..135], b"00000000005");
        assert_eq!(&bytes[1024..1029], b"hello");
    }
}
