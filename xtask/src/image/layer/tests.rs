//! Layers: the same bytes for the same contents, every directory before its contents.

use std::path::Path;

use super::*;

#[test]
fn layers_are_deterministic_and_ordered() {
    let build = || {
        let mut layer = Layer::skeleton().unwrap();
        layer
            .file("usr/local/bin/x", 0o755, b"#!/bin/sh\n".to_vec())
            .unwrap();
        layer.symlink("bin", "usr/bin".into()).unwrap();
        layer.write(Vec::new()).unwrap()
    };
    let bytes = build();
    assert_eq!(bytes, build());
    let mut archive = tar::Archive::new(bytes.as_slice());
    let mut seen = Vec::new();
    for entry in archive.entries().unwrap() {
        let entry = entry.unwrap();
        let header = entry.header();
        assert_eq!(header.mtime().unwrap(), 0);
        assert_eq!((header.uid().unwrap(), header.gid().unwrap()), (0, 0));
        let path = entry
            .path()
            .unwrap()
            .to_string_lossy()
            .trim_end_matches('/')
            .to_string();
        if let Some(parent) = Path::new(&path).parent().filter(|p| !p.as_os_str().is_empty()) {
            assert!(
                seen.contains(&parent.to_string_lossy().to_string()),
                "{path} before its directory"
            );
        }
        if path == "tmp" {
            assert_eq!(header.mode().unwrap(), 0o1777);
        }
        seen.push(path);
    }
    assert!(seen.contains(&"usr/local/bin/x".to_string()) && seen.contains(&"etc/passwd".to_string()));
    // A file cannot go under a symlink.
    let mut layer = Layer::default();
    layer.symlink("bin", "usr/bin".into()).unwrap();
    assert!(layer.file("bin/sh", 0o755, vec![]).is_err());
}
