//! Small helpers shared by the commands: paths, running commands with clear errors, progress.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result, bail};

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask is inside the workspace")
        .to_path_buf()
}

/// Where built tools are cached between runs: `$LB_CACHE_DIR`, else `$XDG_CACHE_HOME/lb`, else
/// `~/.cache/lb`. Outside the checkout, so a fresh clone on the same machine reuses it.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = env::var_os("LB_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    let base = env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/var/cache"));
    base.join("lb")
}

/// The eBPF toolchain named in `.cargo/config.toml` (`[env] LB_EBPF_TOOLCHAIN`).
pub fn ebpf_toolchain() -> String {
    env::var("LB_EBPF_TOOLCHAIN").unwrap_or_else(|_| "nightly-2026-10-29".to_string())
}

/// Prints a progress line for a step that may take a while.
pub fn step(message: &str) {
    eprintln!("==> {message}");
}

/// Says so up front when the disk holding the checkout has less room than `needed_gib`: a full
/// disk shows up much later, and far from its cause (the linker dies of SIGBUS writing a test
/// binary, or a write fails with ENOSPC in the middle of a test).
pub fn warn_if_disk_low(what: &str, needed_gib: u64) {
    let root = workspace_root();
    // Free bytes for an unprivileged writer, as df shows them.
    let free = nix::sys::statvfs::statvfs(&root)
        .ok()
        .map(|st| st.blocks_available() * st.fragment_size());
    if let Some(free) = free
        && free < needed_gib << 30
    {
        eprintln!(
            "==> warning: {:.1} GiB free on the filesystem of {}; {what} writes about {needed_gib} GiB \
             (target/ and the caches); a full disk fails it later as a linker crash (SIGBUS) or ENOSPC",
            free as f64 / f64::from(1u32 << 30),
            root.display()
        );
    }
}

/// Runs a command to completion, failing with the command line and its exit status.
pub fn run(cmd: &mut Command) -> Result<()> {
    let started = Instant::now();
    let status = cmd.status().with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status}) after {:.0?}", started.elapsed());
    }
    Ok(())
}

/// Runs a command and returns its stdout, failing with its stderr.
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("cannot start {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// The short commit and the UTC time a generated document states it comes from. A tree with
/// uncommitted changes outside docs/ (which the generators write) is `<commit>-dirty`: the run
/// measured code that commit does not hold.
pub fn provenance() -> (String, String) {
    let git = |args: &[&str]| {
        output(Command::new("git").args(args).current_dir(workspace_root())).unwrap_or_default()
    };
    let mut sha = git(&["rev-parse", "--short", "HEAD"]).trim().to_string();
    let changed = git(&[
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":!docs",
    ]);
    if !sha.is_empty() && !changed.trim().is_empty() {
        sha.push_str("-dirty");
    }
    let date = output(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"])).unwrap_or_default();
    (sha, date.trim().to_string())
}

/// Whether a program is on PATH.
pub fn have(program: &str) -> bool {
    env::var_os("PATH")
        .map(|paths| env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
        .unwrap_or(false)
}

/// A `Command` for cargo that does not inherit the toolchain selection of the cargo that runs
/// xtask (rustup sets RUSTUP_TOOLCHAIN and friends for its children).
pub fn clean_cargo(toolchain: Option<&str>) -> Command {
    let mut cmd = match toolchain {
        Some(tc) => {
            let mut c = Command::new("rustup");
            c.args(["run", tc, "cargo"]);
            c
        }
        None => Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into())),
    };
    if toolchain.is_some() {
        for var in [
            "RUSTUP_TOOLCHAIN",
            "RUSTC",
            "RUSTC_WRAPPER",
            "RUSTC_WORKSPACE_WRAPPER",
            "CARGO",
            "RUSTDOC",
        ] {
            cmd.env_remove(var);
        }
    }
    cmd.current_dir(workspace_root());
    cmd
}

/// An exclusive lock on `path` (created if missing), held until the file is dropped; says what it
/// waits for when another process holds it (`what`: "another build of the images").
pub fn lock_exclusive(path: &Path, what: &str) -> Result<std::fs::File> {
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            step(&format!("waiting for {what} ({})", path.display()));
            file.lock()
                .with_context(|| format!("locking {}", path.display()))?;
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("locking {}", path.display()));
        }
    }
    Ok(file)
}
