//! Child processes placed in a test's network namespace and cgroup before they exec, so every
//! socket they open is subject to the programs attached to that cgroup. Killed on drop.
//! [`descendants`] lists what such a process is running below it (from /proc).

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

/// A process found under another one in /proc (see [`descendants`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Descendant {
    pub pid: u32,
    /// Its command line, arguments joined by spaces.
    pub cmdline: String,
    /// Seconds since it started.
    pub elapsed_s: f64,
    /// User and system CPU seconds it has used.
    pub cpu_s: f64,
}

/// The fields of `/proc/<pid>/stat` this module reads: (ppid, utime + stime, starttime), in
/// clock ticks. The command name (field 2) is in parentheses and may itself hold spaces and
/// parentheses, so the fields are counted from its last `)`.
pub fn parse_stat(stat: &str) -> Option<(u32, u64, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the name: state(3) ppid(4) ... utime(14) stime(15) ... starttime(22).
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    Some((
        u32::try_from(field(4)?).ok()?,
        field(14)? + field(15)?,
        field(22)?,
    ))
}

/// The kernel's clock ticks per second (`/proc/<pid>/stat`'s time unit).
pub fn clock_ticks() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map_or(100, |t| t.max(1) as u64)
}

/// Every live process below `pid` (children, their children, ...), e.g. the `iptables-restore`
/// a kube-proxy is waiting for.
pub fn descendants(pid: u32) -> Vec<Descendant> {
    let tick = clock_ticks() as f64;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|u| u.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    let mut all = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(stat) = std::fs::read_to_string(format!("/proc/{p}/stat"))
            .ok()
            .and_then(|s| parse_stat(&s))
        {
            all.push((p, stat));
        }
    }
    let mut found: Vec<Descendant> = Vec::new();
    let mut parents = vec![pid];
    while let Some(parent) = parents.pop() {
        for &(p, (ppid, cpu, start)) in &all {
            if ppid != parent {
                continue;
            }
            parents.push(p);
            let cmdline = std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|b| {
                    b.split(|c| *c == 0)
                        .filter(|a| !a.is_empty())
                        .map(|a| String::from_utf8_lossy(a).into_owned())
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default();
            found.push(Descendant {
                pid: p,
                cmdline,
                elapsed_s: (uptime - start as f64 / tick).max(0.0),
                cpu_s: cpu as f64 / tick,
            });
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_name() {
        // A name with a space and a parenthesis, as a process can give itself.
        let stat = "4242 (iptables (x) r) R 17132 4242 17 0 -1 4194304 900 0 0 0 \
                    1200 34 0 0 20 0 1 0 5570123 22000000 7000 18446744073709551615";
        assert_eq!(parse_stat(stat), Some((17132, 1234, 5570123)));
        assert_eq!(parse_stat("4242 (short) R 1 2"), None);
    }

    #[test]
    fn this_process_has_a_descendant_while_a_child_runs() {
        let mut child = Command::new("sleep").arg("5").spawn().expect("sleep");
        let found = descendants(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        let sleep = found
            .iter()
            .find(|d| d.pid == child.id())
            .expect("the child is listed");
        assert_eq!(sleep.cmdline, "sleep 5");
        assert!(sleep.elapsed_s < 5.0 && sleep.cpu_s < 1.0, "{sleep:?}");
    }
}
