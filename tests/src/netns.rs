//! Network namespaces and veth pairs made by a test, deleted by their guards (deleting a namespace
//! deletes the interfaces inside it, and a veth pair dies with either end).

use std::{
    fs::File,
    os::fd::AsFd,
    path::PathBuf,
    process::{Command, Output},
    thread,
};

use nix::sched::{setns, CloneFlags};

use crate::unique_name;

/// A named network namespace (`/run/netns/<name>`) with `lo` up.
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Creates a namespace whose name starts with `prefix` (at most 8 bytes, to leave room).
    pub fn new(prefix: &str) -> NetNs {
        let name = unique_name(prefix);
        run_ip(&["netns", "add", &name]);
        let ns = NetNs { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Opens the namespace file (for `setns`).
    pub fn file(&self) -> File {
        File::open(self.path()).unwrap_or_else(|e| panic!("open {}: {e}", self.path().display()))
    }

    /// Runs `ip -n <ns> <args>`, panicking with iproute2's message on failure.
    pub fn ip(&self, args: &[&str]) {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        run_ip(&full);
    }

    /// Runs a command inside the namespace (via `nsenter --net=`, which keeps the host's /sys).
    pub fn exec(&self, program: &str, args: &[&str]) -> Output {
        Command::new("nsenter")
            .arg(format!("--net={}", self.path().display()))
            .arg("--")
            .arg(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("nsenter {program}: {e}"))
    }

    /// Like `exec`, panicking unless the command succeeds; returns its stdout.
    pub fn exec_ok(&self, program: &str, args: &[&str]) -> String {
        let out = self.exec(program, args);
        assert!(
            out.status.success(),
            "in netns {}: {program} {args:?} failed: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Sets a sysctl inside the namespace, e.g. `net.ipv4.ip_forward=1`.
    pub fn sysctl(&self, setting: &str) {
        self.exec_ok("sysctl", &["-q", "-w", setting]);
    }

    /// Runs `f` on a fresh thread that has entered this namespace, and returns its result. The
    /// caller's thread is never moved.
    pub fn run<F, R>(&self, f: F) -> R
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        let file = self.file();
        thread::scope(|s| {
            s.spawn(move || {
                setns(file.as_fd(), CloneFlags::CLONE_NEWNET).expect("setns into the test namespace");
                f()
            })
            .join()
            .expect("thread inside the namespace panicked")
        })
    }

    /// The interface index of `dev` inside this namespace.
    pub fn ifindex(&self, dev: &str) -> u32 {
        let text = self.exec_ok("cat", &[&format!("/sys/class/net/{dev}/ifindex")]);
        text.trim().parse().unwrap_or_else(|e| panic!("ifindex of {dev}: {e}: {text:?}"))
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Best effort: a failed delete must not mask the test's own panic.
        let _ = Command::new("ip").args(["netns", "delete", &self.name]).output();
    }
}

/// Creates a veth pair with one end in each namespace, addresses them (CIDR notation) and brings
/// them up. The pair is deleted with either namespace.
pub fn veth(a: &NetNs, a_dev: &str, a_addr: Option<&str>, b: &NetNs, b_dev: &str, b_addr: Option<&str>) {
    // Create in `a`, then move the peer.
    a.ip(&["link", "add", a_dev, "type", "veth", "peer", "name", b_dev, "netns", b.name()]);
    for (ns, dev, addr) in [(a, a_dev, a_addr), (b, b_dev, b_addr)] {
        if let Some(addr) = addr {
            ns.ip(&["addr", "add", addr, "dev", dev]);
        }
        ns.ip(&["link", "set", dev, "up"]);
    }
}

fn run_ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
    assert!(out.status.success(), "ip {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}
