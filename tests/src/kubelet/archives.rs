//! The image archives `cargo xtask images` built, as its `images.json` lists them, for
//! `ctr images import` on a node without a registry.

use std::{
    env, fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use serde::Deserialize;

/// An image archive built by `cargo xtask images` (`target/images/images.json`).
#[derive(Clone, Debug, Deserialize)]
pub struct Image {
    pub name: String,
    /// The reference it is imported as, e.g. `localhost/lb-agent:dev`.
    #[serde(rename = "ref")]
    pub reference: String,
    pub archive: PathBuf,
    pub manifest_digest: String,
}

/// The images `cargo xtask images` built (`LB_IMAGE_DIR`, else `<workspace>/target/images`).
pub fn images() -> Result<Vec<Image>> {
    let dir = env::var_os("LB_IMAGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/images"));
    images_in(&dir)
}

/// The images listed in `dir/images.json` (the format `cargo xtask images` writes).
pub fn images_in(dir: &Path) -> Result<Vec<Image>> {
    let index = dir.join("images.json");
    let text = fs::read_to_string(&index).with_context(|| {
        format!(
            "reading {}: build the images with `cargo xtask images`",
            index.display()
        )
    })?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))
}

/// The image named `name` (`lb-agent`, `lb-probe`, `pause`).
pub fn image(name: &str) -> Result<Image> {
    images()?
        .into_iter()
        .find(|i| i.name == name)
        .with_context(|| format!("`cargo xtask images` built no image named {name}"))
}
