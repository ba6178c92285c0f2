//! The contents of an image's one layer: directories, files and links keyed by path, in path
//! order; described line by line for the stamps, and written as a reproducible tar stream (GNU
//! headers, mtime 0, uid and gid 0). Host files are added by `host.rs`.

use std::{
    collections::BTreeMap,
    io::{self, Write},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

use super::sha256_hex;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Node {
    Dir,
    File(Vec<u8>),
    Symlink(PathBuf),
}

#[derive(Debug, Clone)]
pub(super) struct Item {
    mode: u32,
    node: Node,
}

/// The contents of the image's one layer, keyed by path without the leading `/`. Byte order puts
/// every directory before its contents.
#[derive(Debug, Default)]
pub(crate) struct Layer {
    pub(super) items: BTreeMap<String, Item>,
}

pub(super) fn relative(path: &Path) -> Result<String> {
    let text = path
        .to_str()
        .with_context(|| format!("{} is not UTF-8", path.display()))?;
    let rel = text.trim_start_matches('/').trim_end_matches('/');
    if rel.is_empty() || rel.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        bail!("{text} is not a plain absolute path");
    }
    Ok(rel.to_string())
}

impl Layer {
    /// The directories and files every image has: /dev, /proc, /sys, /run, /tmp (1777), /root,
    /// and /etc with root in passwd and group, and an nsswitch.conf for files then DNS.
    pub(super) fn skeleton() -> Result<Self> {
        let mut layer = Layer::default();
        for dir in ["dev", "etc", "proc", "run", "sys"] {
            layer.dir(dir, 0o755)?;
        }
        layer.dir("root", 0o700)?;
        layer.dir("tmp", 0o1777)?;
        layer.file("etc/passwd", 0o644, b"root:x:0:0:root:/root:/bin/sh\n".to_vec())?;
        layer.file("etc/group", 0o644, b"root:x:0:\n".to_vec())?;
        layer.file(
            "etc/nsswitch.conf",
            0o644,
            b"passwd: files\ngroup: files\nhosts: files dns\n".to_vec(),
        )?;
        Ok(layer)
    }

    fn parents(&mut self, path: &str) -> Result<()> {
        let mut end = 0;
        while let Some(i) = path[end..].find('/') {
            end += i;
            let parent = &path[..end];
            match self.items.get(parent) {
                None => {
                    self.items.insert(
                        parent.to_string(),
                        Item {
                            mode: 0o755,
                            node: Node::Dir,
                        },
                    );
                }
                Some(Item { node: Node::Dir, .. }) => {}
                Some(_) => bail!("/{parent} is not a directory in the image, yet /{path} is under it"),
            }
            end += 1;
        }
        Ok(())
    }

    fn insert(&mut self, path: &str, mode: u32, node: Node) -> Result<()> {
        self.parents(path)?;
        match self.items.get_mut(path) {
            None => {
                self.items.insert(path.to_string(), Item { mode, node });
            }
            Some(have) if have.node == node => {
                // The same file for two reasons (a program that is also a library): the wider mode.
                have.mode = have.mode.max(mode);
            }
            Some(have) => bail!(
                "/{path} is in the image twice, differently: {:?} and {:?}",
                kind(&have.node),
                kind(&node)
            ),
        }
        Ok(())
    }

    pub(crate) fn dir(&mut self, path: &str, mode: u32) -> Result<()> {
        self.insert(path, mode, Node::Dir)
    }

    pub(crate) fn file(&mut self, path: &str, mode: u32, bytes: Vec<u8>) -> Result<()> {
        self.insert(path, mode, Node::File(bytes))
    }

    pub(crate) fn symlink(&mut self, path: &str, target: PathBuf) -> Result<()> {
        self.insert(path, 0o777, Node::Symlink(target))
    }

    /// One line per entry (with each file's sha256): what the stamp compares.
    pub(crate) fn describe(&self) -> String {
        let mut text = String::new();
        for (path, item) in &self.items {
            let line = match &item.node {
                Node::Dir => format!("dir /{path} {:04o}\n", item.mode),
                Node::File(bytes) => format!(
                    "file /{path} {:04o} {} sha256:{}\n",
                    item.mode,
                    bytes.len(),
                    sha256_hex(bytes)
                ),
                Node::Symlink(target) => format!("link /{path} -> {}\n", target.display()),
            };
            text.push_str(&line);
        }
        text
    }

    /// The layer as a tar stream into `w`: GNU headers, mtime 0, uid and gid 0, no user names.
    pub(super) fn write<W: Write>(&self, w: W) -> Result<W> {
        let mut tar = tar::Builder::new(w);
        for (path, item) in &self.items {
            let mut header = tar::Header::new_gnu();
            header.set_mtime(0);
            header.set_uid(0);
            header.set_gid(0);
            header.set_mode(item.mode);
            match &item.node {
                Node::Dir => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_size(0);
                    tar.append_data(&mut header, format!("{path}/"), io::empty())?;
                }
                Node::File(bytes) => {
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_size(bytes.len() as u64);
                    tar.append_data(&mut header, path, bytes.as_slice())?;
                }
                Node::Symlink(target) => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_size(0);
                    tar.append_link(&mut header, path, target)?;
                }
            }
        }
        Ok(tar.into_inner()?)
    }
}

fn kind(node: &Node) -> &'static str {
    match node {
        Node::Dir => "directory",
        Node::File(_) => "file",
        Node::Symlink(_) => "symlink",
    }
}

#[cfg(test)]
mod tests;
