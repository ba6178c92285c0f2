//! Child processes placed in a test's network namespace and cgroup before they exec, so every
//! socket they open is subject to the programs attached to that cgroup. Killed on drop.

use std::{
    ffi::OsStr,
    fs::{File, OpenOptions},
    io::{BufRead, BufReader},
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::PathBuf,
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use crate::{cgroup::Cgroup, netns::NetNs};

/// Where a child runs.
#[derive(Clone, Copy, Default)]
pub struct Place<'a> {
    pub netns: Option<&'a NetNs>,
    pub cgroup: Option<&'a Cgroup>,
}

impl<'a> Place<'a> {
    pub fn new(netns: &'a NetNs, cgroup: &'a Cgroup) -> Self {
        Place {
            netns: Some(netns),
            cgroup: Some(cgroup),
        }
    }

    pub fn netns(netns: &'a NetNs) -> Self {
        Place {
            netns: Some(netns),
            cgroup: None,
        }
    }

    /// Prepares `cmd` to enter this place between fork and exec.
    pub fn apply(&self, cmd: &mut Command) {
        let netns: Option<File> = self.netns.map(NetNs::file);
        let procs: Option<File> = self.cgroup.map(|c| {
            OpenOptions::new()
                .write(true)
                .open(c.procs_file())
                .unwrap_or_else(|e| panic!("open cgroup.procs: {e}"))
        });
        // SAFETY: the closure only makes async-signal-safe syscalls on descriptors opened above.
        unsafe {
            cmd.pre_exec(move || {
                if let Some(ns) = &netns
                    && libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(procs) = &procs {
                    // "0" moves the writing process itself.
                    if libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }
}

/// A child process killed (and reaped) on drop.
pub struct Proc {
    child: Child,
    what: String,
    /// Lines read from the child's stdout so far (once something waited for a line).
    stdout_lines: Option<std::sync::Arc<std::sync::Mutex<Vec<String>>>>,
}

impl Proc {
    pub fn spawn(place: Place<'_>, program: impl AsRef<OsStr>, args: &[&str]) -> Proc {
        let mut cmd = Command::new(program.as_ref());
        cmd.args(args).stdin(Stdio::null());
        place.apply(&mut cmd);
        Self::spawn_command(cmd)
    }

    pub fn spawn_command(mut cmd: Command) -> Proc {
        let what = format!("{cmd:?}");
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        Proc {
            child,
            what,
            stdout_lines: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Waits until a line of the child's stdout (which must be piped) satisfies `ready`. A thread
    /// keeps draining stdout afterwards, so the child never blocks or dies writing to it.
    pub fn wait_for_line(&mut self, timeout: Duration, ready: impl Fn(&str) -> bool) -> String {
        self.wait_for_line_or(timeout, ready, || {})
    }

    /// [`Proc::wait_for_line`], calling `check` (which may panic, e.g. on Ctrl-C) while waiting.
    pub fn wait_for_line_or(
        &mut self,
        timeout: Duration,
        ready: impl Fn(&str) -> bool,
        check: impl Fn(),
    ) -> String {
        let lines = self.stdout_lines.get_or_insert_with(|| {
            let stdout = self
                .child
                .stdout
                .take()
                .expect("stdout must be piped to wait for a line");
            let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let sink = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    sink.lock().expect("lines lock").push(line);
                }
            });
            lines
        });
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = lines.lock().expect("lines lock").iter().find(|l| ready(l)) {
                return line.clone();
            }
            check();
            if Instant::now() > deadline {
                panic!(
                    "{}: no such line within {timeout:?}; got {:?}",
                    self.what,
                    lines.lock().expect("lines lock")
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Every stdout line read so far (see `wait_for_line`).
    pub fn stdout_lines(&self) -> Vec<String> {
        self.stdout_lines
            .as_ref()
            .map(|l| l.lock().expect("lines lock").clone())
            .unwrap_or_default()
    }

    /// Whether the child is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends a signal (e.g. SIGTERM) without waiting.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Waits up to `timeout` for the child to exit on its own.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a command to completion in `place` and returns its output.
pub fn run_in(place: Place<'_>, program: impl AsRef<OsStr>, args: &[&str]) -> Output {
    let mut cmd = Command::new(program.as_ref());
    cmd.args(args).stdin(Stdio::null());
    place.apply(&mut cmd);
    cmd.output()
        .unwrap_or_else(|e| panic!("run {:?}: {e}", program.as_ref()))
}

/// Path of a binary built from this workspace (`lb-agent`, `lb-probe`), next to the running test
/// executable's target directory.
pub fn workspace_bin(name: &str) -> PathBuf {
    // Test binaries live in target/<profile>/deps; bins in target/<profile>.
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is not built; run the tests through `./x test`",
        path.display()
    );
    path
}
