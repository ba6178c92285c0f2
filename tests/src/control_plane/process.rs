//! The control plane's children: started with their output appended to a log, stopped with
//! SIGTERM then SIGKILL (always reaped), markers in their logs, and the tail of a log.

use std::{
    fs::{File, OpenOptions},
    io::{Read, Seek, SeekFrom, Write},
    path::Path,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

/// How long a process gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Spawns `cmd` with stdout and stderr appended to `log`.
pub(super) fn spawn_logged(cmd: &mut Command, log: &Path, what: &str) -> Result<Child> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .spawn()
        .with_context(|| format!("cannot start {what} ({cmd:?})"))?;
    Ok(child)
}

/// SIGTERM, then SIGKILL after [`STOP_GRACE`]; always reaps the child.
pub(super) fn stop(mut child: Child, what: &str) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    let pid = Pid::from_raw(child.id() as i32);
    if kill(pid, Signal::SIGTERM).is_ok() {
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        eprintln!("control plane: {what} ignored SIGTERM for {STOP_GRACE:?}; killing it");
    }
    let _ = child.kill();
    let _ = child.wait();
}

pub(super) fn append_marker(log: &Path, text: &str) {
    if let Ok(mut f) = OpenOptions::new().append(true).open(log) {
        let _ = writeln!(f, "==== {text} ====");
    }
}

/// The last `lines` lines of a (possibly large) log file.
pub(super) fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(64 * 1024);
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(start)).is_err() || f.read_to_end(&mut buf).is_err() {
        return format!("(cannot read {})", path.display());
    }
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
