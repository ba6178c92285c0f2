//! The references `e2e.test` asks kubelet for: read from k8s.io/kubernetes'
//! test/utils/image/manifest.go, and checked against the images built here.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

use super::{AGNHOST_REF, BUSYBOX_REF, PAUSE_REF, REGRESSION_REF};
use crate::image;

/// The images of k8s.io/kubernetes' test/utils/image/manifest.go (what `e2e.test` pulls) built
/// here: (its ImageID there, our reference).
const E2E_IMAGES: &[(&str, &str)] = &[
    ("Agnhost", AGNHOST_REF),
    ("BusyBox", BUSYBOX_REF),
    ("Pause", PAUSE_REF),
    ("RegressionIssue74839", REGRESSION_REF),
];

/// The k8s.io/kubernetes module directory (where [`image::build_pause`] reads pause.c).
pub(super) fn kubernetes_module(work: &Path) -> Result<PathBuf> {
    let pause_c = image::pause_source(work)?;
    let root = pause_c
        .ancestors()
        .nth(4)
        .context("pause.c is not in build/pause/linux")?;
    if !root.join("test/images/agnhost/porter/localhost.crt").is_file() {
        bail!("{} has no test/images/agnhost/porter", root.display());
    }
    Ok(root.to_path_buf())
}

/// Fails when test/utils/image/manifest.go names other references than the images built here.
pub(super) fn check_e2e_references(kubernetes: &Path) -> Result<()> {
    let path = kubernetes.join("test/utils/image/manifest.go");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let wanted = e2e_references(&text).with_context(|| format!("reading {}", path.display()))?;
    for (id, ours) in E2E_IMAGES {
        match wanted.get(*id) {
            Some(theirs) if theirs == ours => {}
            other => bail!(
                "e2e.test asks for {id} as {other:?} ({}), this build makes {ours}: update \
                 xtask/src/upstream_images/mod.rs",
                path.display()
            ),
        }
    }
    Ok(())
}

/// manifest.go's images as (ImageID, reference), from its default registries
/// (`PromoterE2eRegistry: "registry.k8s.io/e2e-test-images",`) and its
/// `configs[Agnhost] = Config{list.PromoterE2eRegistry, "agnhost", "2.66.1"}` lines.
fn e2e_references(text: &str) -> Result<BTreeMap<String, String>> {
    let mut registries = BTreeMap::new();
    for line in text.lines() {
        let Some((key, value)) = line.trim().split_once(':') else {
            continue;
        };
        let value = value.trim().trim_end_matches(',');
        if key.ends_with("Registry")
            && !key.contains(char::is_whitespace)
            && value.len() > 2
            && value.starts_with('"')
            && value.ends_with('"')
        {
            registries.insert(key.to_string(), value.trim_matches('"').to_string());
        }
    }
    let mut references = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.trim().strip_prefix("configs[") else {
            continue;
        };
        let parsed = (|| {
            let (id, rest) = rest.split_once(']')?;
            let inner = rest.split_once("Config{")?.1.strip_suffix('}')?;
            let fields: Vec<&str> = inner.split(',').map(str::trim).collect();
            let [registry, name, version] = fields.as_slice() else {
                return None;
            };
            let registry = registries.get(registry.strip_prefix("list.")?)?;
            let unquote = |s: &str| s.strip_prefix('"')?.strip_suffix('"').map(str::to_string);
            Some((
                id.to_string(),
                format!("{registry}/{}:{}", unquote(name)?, unquote(version)?),
            ))
        })();
        // Lines of another form, or of an unknown registry, name no image built here.
        if let Some((id, reference)) = parsed {
            references.insert(id, reference);
        }
    }
    if references.is_empty() {
        bail!("no `configs[...] = Config{{...}}` lines");
    }
    Ok(references)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_go_references() {
        let text = r#"
type RegistryList struct {
	PromoterE2eRegistry      string `yaml:"promoterE2eRegistry"`
	GcRegistry               string `yaml:"gcRegistry"`
}
	initRegistry = RegistryList{
		PromoterE2eRegistry:      "registry.k8s.io/e2e-test-images",
		GcRegistry:               "registry.k8s.io",
	}
	configs[Agnhost] = Config{list.PromoterE2eRegistry, "agnhost", "2.66.1"}
	configs[Pause] = Config{list.GcRegistry, "pause", "3.10.2"}
"#;
        let refs = e2e_references(text).unwrap();
        assert_eq!(refs["Agnhost"], AGNHOST_REF);
        assert_eq!(refs["Pause"], PAUSE_REF);
        assert_eq!(refs.len(), 2);
        let unknown = text.replace("list.GcRegistry", "list.OtherRegistry");
        assert!(!e2e_references(&unknown).unwrap().contains_key("Pause"));
        assert!(e2e_references("package image\n").is_err());
    }
}
