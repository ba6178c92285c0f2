//! Finds the cgroup v2 hierarchy the socket programs attach to. It is `/sys/fs/cgroup` on a unified
//! layout and often `/sys/fs/cgroup/unified` on a hybrid one, so it is read from the mount table,
//! never assumed.

use std::{
    fs, io,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

/// The first cgroup2 mount in /proc/self/mounts.
pub fn cgroup2_mount() -> io::Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    parse_cgroup2_mount(&mounts).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "no cgroup2 filesystem is mounted (cgroup v2 is required for socket load balancing)",
        )
    })
}

fn parse_cgroup2_mount(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_dev, dir, fstype) = (fields.next()?, fields.next()?, fields.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(unescape_mount_path(dir)))
    })
}

/// /proc/mounts escapes spaces and a few other bytes as octal (`\040`).
fn unescape_mount_path(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 4 <= bytes.len()
            && bytes[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b))
        {
            let n = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(n);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Checks that `path` is a directory on a cgroup2 filesystem.
pub fn check_cgroup2_dir(path: &Path) -> io::Result<()> {
    let stat = nix::sys::statfs::statfs(path).map_err(io::Error::from)?;
    if stat.filesystem_type() != nix::sys::statfs::CGROUP2_SUPER_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is not on a cgroup2 filesystem (the cgroup2 mount is {:?})",
                path.display(),
                cgroup2_mount().ok()
            ),
        ));
    }
    Ok(())
}

/// The cgroup id (the inode number of its directory), which names its link pins.
pub fn cgroup_id(path: &Path) -> io::Result<u64> {
    Ok(fs::metadata(path)?.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_unified_and_hybrid_mounts() {
        let hybrid = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\ncgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(
            parse_cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n";
        assert_eq!(
            parse_cgroup2_mount(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        assert_eq!(parse_cgroup2_mount("proc /proc proc rw 0 0\n"), None);
        assert_eq!(
            parse_cgroup2_mount("cgroup2 /a\\040b cgroup2 rw 0 0\n"),
            Some(PathBuf::from("/a b"))
        );
    }
}
