//! One image archive: a [`Plan`] makes the layer and the config of a [`Recipe`] and writes the
//! OCI image-layout tar (one gzip layer, its config and manifest, `index.json`, `oci-layout`)
//! through a temporary file, the same bytes for the same inputs. A stamp next to the archive
//! lists those inputs; while it matches, the archive is reused.

use std::{
    collections::BTreeMap,
    fs::{self, File},
    io::{self, Write},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{Context, Result};
use flate2::{Compression, GzBuilder};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{
    Built, Recipe,
    host::{Role, resolve_tool},
    layer::{Layer, relative},
    oci::{arch, canonical_json, hex, image_config, sha256_hex},
    output::remove_if_there,
};
use crate::util::step;

/// Changes whenever the way archives are written changes, so that older stamps no longer match.
const FORMAT: &str = "lb-oci-archive 1";
/// The layers' gzip level: fixed, since the digests depend on it.
const GZIP_LEVEL: u32 = 6;

const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";

/// One image: its layer and config, and where its archive and stamp go.
pub(crate) struct Plan {
    recipe: Recipe,
    layer: Layer,
    /// The config without its diff_ids (which the layer decides).
    config: Value,
    archive: PathBuf,
    stamp: PathBuf,
    inputs: String,
}

impl Plan {
    pub(super) fn new(recipe: Recipe, out: &Path) -> Result<Self> {
        let mut layer = Layer::skeleton()?;
        let program = relative(Path::new(recipe.program))?;
        let bytes = fs::read(&recipe.program_source)
            .with_context(|| format!("reading {}", recipe.program_source.display()))?;
        layer.file(&program, 0o755, bytes)?;
        layer.libraries_of(&recipe.program_source)?;
        for tool in recipe.tools {
            let path = resolve_tool(tool)?;
            if tool.starts_with("/etc/") {
                layer.host_file(&path, Role::Data)?;
            } else {
                layer.host_program(&path)?;
            }
        }
        let config = image_config(&recipe)?;
        Ok(Plan::with_layer(recipe, layer, config, out))
    }

    /// A plan for a layer and an image config (without rootfs) made elsewhere
    /// (`upstream_images`); of the recipe only the name and the reference are used.
    pub(crate) fn with_layer(recipe: Recipe, layer: Layer, config: Value, out: &Path) -> Self {
        let inputs = format!(
            "format {FORMAT}\nreference {}\ngzip level {GZIP_LEVEL}\nconfig {}\n{}",
            recipe.reference,
            canonical_json(&config),
            layer.describe()
        );
        Plan {
            archive: out.join(format!("{}.oci.tar", recipe.name)),
            stamp: out.join(format!("{}.oci.tar.stamp", recipe.name)),
            recipe,
            layer,
            config,
            inputs,
        }
    }

    /// The manifest digest of the archive on disk when the stamp vouches for it.
    fn current(&self) -> Option<String> {
        let stamp = fs::read_to_string(&self.stamp).ok()?;
        let outputs = stamp.strip_prefix(&self.inputs)?;
        let field = |key: &str| {
            outputs
                .lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
                .map(str::to_string)
        };
        let digest = field("= manifest_digest")?;
        let size: u64 = field("= archive_bytes")?.parse().ok()?;
        let on_disk = fs::metadata(&self.archive).ok()?.len();
        (on_disk == size).then_some(digest)
    }

    pub(crate) fn ensure(&self) -> Result<Built> {
        let built = |manifest_digest: String, rebuilt: bool| Built {
            name: self.recipe.name,
            reference: self.recipe.reference,
            archive: self.archive.clone(),
            manifest_digest,
            rebuilt,
        };
        if let Some(digest) = self.current() {
            step(&format!(
                "{} is current ({}, {})",
                self.recipe.reference,
                short(&digest),
                self.archive.display()
            ));
            return Ok(built(digest, false));
        }
        let started = Instant::now();
        // A half-written archive must not keep an old stamp that vouches for it.
        remove_if_there(&self.stamp)?;
        let (digest, size) = self.write_archive()?;
        let stamp = format!(
            "{}= manifest_digest {digest}\n= archive_bytes {size}\n",
            self.inputs
        );
        fs::write(&self.stamp, stamp).with_context(|| format!("writing {}", self.stamp.display()))?;
        step(&format!(
            "built {} ({}, {:.1} MB, {} entries) in {:.1?}",
            self.recipe.reference,
            short(&digest),
            size as f64 / 1e6,
            self.layer.items.len(),
            started.elapsed()
        ));
        Ok(built(digest, true))
    }

    /// Writes the archive (via a temporary file) and returns the manifest digest and the size.
    fn write_archive(&self) -> Result<(String, u64)> {
        // The layer: tar, hashed uncompressed (the diff_id) and compressed (the blob digest).
        let gzip = GzBuilder::new()
            .mtime(0)
            .operating_system(255)
            .write(Vec::new(), Compression::new(GZIP_LEVEL));
        let hashing = self.layer.write(Hashing::new(gzip))?;
        let diff_id = format!("sha256:{}", hex(&hashing.hash.finalize()));
        let layer = hashing.inner.finish()?;

        let mut config = self.config.clone();
        config["rootfs"] = json!({"type": "layers", "diff_ids": [diff_id]});
        let config = canonical_json(&config).into_bytes();
        let manifest = canonical_json(&json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": descriptor(CONFIG_MEDIA_TYPE, &config),
            "layers": [descriptor(LAYER_MEDIA_TYPE, &layer)],
        }))
        .into_bytes();
        let manifest_digest = digest(&manifest);
        let tag = self
            .recipe
            .reference
            .rsplit_once(':')
            .map(|(_, t)| t)
            .unwrap_or("latest");
        let mut entry = descriptor(MANIFEST_MEDIA_TYPE, &manifest);
        entry["annotations"] = json!({
            "io.containerd.image.name": self.recipe.reference,
            "org.opencontainers.image.ref.name": tag,
        });
        entry["platform"] = json!({"architecture": arch()?, "os": "linux"});
        let index = canonical_json(&json!({
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA_TYPE,
            "manifests": [entry],
        }))
        .into_bytes();

        let mut files: BTreeMap<String, &[u8]> = BTreeMap::new();
        for blob in [&layer, &config, &manifest] {
            files.insert(format!("blobs/sha256/{}", &digest(blob)["sha256:".len()..]), blob);
        }
        files.insert("index.json".into(), &index);
        let layout = br#"{"imageLayoutVersion":"1.0.0"}"#;
        files.insert("oci-layout".into(), layout);

        let tmp = self
            .archive
            .with_extension(format!("tar.tmp-{}", std::process::id()));
        let file = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut tar = tar::Builder::new(io::BufWriter::new(file));
        for dir in ["blobs", "blobs/sha256"] {
            let mut header = archive_header(tar::EntryType::Directory, 0o755, 0);
            tar.append_data(&mut header, format!("{dir}/"), io::empty())?;
        }
        for (path, bytes) in &files {
            let mut header = archive_header(tar::EntryType::Regular, 0o644, bytes.len() as u64);
            tar.append_data(&mut header, path, *bytes)?;
        }
        let file = tar
            .into_inner()?
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("writing {}", tmp.display()))?;
        file.sync_all()?;
        let size = file.metadata()?.len();
        drop(file);
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644))?;
        fs::rename(&tmp, &self.archive)
            .with_context(|| format!("renaming {} to {}", tmp.display(), self.archive.display()))?;
        Ok((manifest_digest, size))
    }
}

fn archive_header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(kind);
    header.set_mode(mode);
    header.set_size(size);
    header.set_mtime(0);
    header.set_uid(0);
    header.set_gid(0);
    header
}

fn descriptor(media_type: &str, blob: &[u8]) -> Value {
    json!({"mediaType": media_type, "digest": digest(blob), "size": blob.len()})
}

fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", sha256_hex(bytes))
}

fn short(digest: &str) -> &str {
    &digest[..digest.len().min("sha256:".len() + 12)]
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
}

impl<W> Hashing<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hash: Sha256::new(),
        }
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
