//! The node's processes: the holder (its mount namespace, and the watchdog that kills the
//! node when the test process is gone), containerd and kubelet, each started in the node's
//! "system" cgroup and waited for; and stopping them all through the node's cgroup tree.

use std::{
    env,
    fs::{self, OpenOptions},
    os::{fd::AsRawFd, unix::process::CommandExt},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::{KubeletNode, cgroups::pids_in_tree};
use crate::control_plane::ControlPlane;

/// How long containerd and kubelet may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(90);

impl KubeletNode {
    /// The holder: enters the node's network namespace, unshares a mount namespace in which the
    /// node's directories replace `/var/lib`, `/var/log` and `/run`, and sleeps.
    pub(super) fn start_holder(&mut self) -> Result<()> {
        let ready = self.path("holder.ready");
        let d = |s: &str| self.path(s).display().to_string();
        // Private first, so nothing propagates back to the machine; then shared again inside, as
        // on a real node (Bidirectional mount propagation, which the DaemonSet's init container
        // uses for bpffs, needs a shared mount).
        //
        // It is also the node's watchdog: when the test process is gone (a panic that skipped
        // the guard, SIGTERM, SIGKILL), it kills the node's whole cgroup tree, itself included,
        // which ends the mount namespace; the next run's sweep removes the names left.
        let script = format!(
            "set -e\n\
             mount --make-rshared /\n\
             mount --bind '{var_lib}' /var/lib\n\
             mount --bind '{var_log}' /var/log\n\
             mount --bind '{run}' /run\n\
             touch '{ready}'\n\
             set +e\n\
             while kill -0 {test_pid} 2>/dev/null; do sleep 1; done\n\
             echo 1 > '{kill}'\n",
            var_lib = d("var-lib"),
            var_log = d("var-log"),
            run = d("run"),
            ready = ready.display(),
            test_pid = std::process::id(),
            kill = self.cgroup2.join("cgroup.kill").display(),
        );
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.ns.path().display())).args([
            "--",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
        ]);
        let child = self.spawn(cmd, "holder.log")?;
        self.holder = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ready.exists() {
            if let Some(status) = self.holder.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!(
                    "the node's mount namespace could not be set up ({status}): {}",
                    fs::read_to_string(self.path("holder.log")).unwrap_or_default()
                );
            }
            if Instant::now() > deadline {
                bail!("the node's mount namespace was not ready within 10 s");
            }
            thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Spawns `cmd` in the node's "system" cgroup with its output in `log`.
    fn spawn(&self, mut cmd: Command, log: &str) -> Result<Child> {
        let log_path = self.path(log);
        let file = OpenOptions::new().create(true).append(true).open(&log_path)?;
        let procs = OpenOptions::new()
            .write(true)
            .open(self.cgroup2.join("system/cgroup.procs"))
            .context("opening the node's system cgroup")?;
        let mut path = std::ffi::OsString::from(self.parts.bin.as_os_str());
        path.push(":");
        path.push(env::var_os("PATH").unwrap_or_default());
        cmd.env("PATH", path)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        // SAFETY: only async-signal-safe syscalls on a descriptor opened above.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn().with_context(|| format!("starting {cmd:?}"))
    }

    pub(super) fn start_containerd(&mut self) -> Result<()> {
        let mut cmd = self.command(self.parts.bin.join("containerd"));
        cmd.arg("--config").arg(self.path("containerd.toml"));
        let child = self.spawn(cmd, "containerd.log")?;
        self.containerd = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.containerd.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.containerd = None;
                bail!("containerd exited ({status}) at start\n{}", self.log_tail());
            }
            if self.ctr(&["version"]).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "containerd did not answer within {START_TIMEOUT:?}\n{}",
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    pub(super) fn start_kubelet(&mut self, cp: &ControlPlane) -> Result<()> {
        let mut cmd = self.command(&self.kubelet_bin);
        cmd.arg(format!("--config={}", self.path("kubelet.yaml").display()))
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .arg(format!("--hostname-override={}", self.name))
            // One address per family on a dual-stack node, IPv4 (the primary) first.
            .arg(format!(
                "--node-ip={}",
                self.ips()
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ))
            .arg("--v=1");
        let child = self.spawn(cmd, "kubelet.log")?;
        self.kubelet = Some(child);
        self.wait_ready(cp)
    }

    /// Waits until the Node reports Ready.
    pub fn wait_ready(&mut self, cp: &ControlPlane) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.kubelet.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.kubelet = None;
                bail!("kubelet exited ({status})\n{}", self.log_tail());
            }
            let ready = cp.kubectl([
                "get",
                "node",
                &self.name,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ]);
            if ready.as_deref().is_ok_and(|s| s.trim() == "True") {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "node {} not Ready within {START_TIMEOUT:?} (last: {ready:?})\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(250));
        }
    }

    /// Stops every process of the node: kubelet first (politely), then everything in its cgroup
    /// tree, which ends the mount namespace.
    pub(super) fn stop_all(&mut self) {
        if let Some(mut kubelet) = self.kubelet.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(kubelet.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && kubelet.try_wait().ok().flatten().is_none() {
                thread::sleep(Duration::from_millis(50));
            }
            let _ = kubelet.kill();
            let _ = kubelet.wait();
        }
        // cgroup.kill (cgroup2, 5.14+) kills the tree at once; SIGKILL by pid covers older kernels.
        for _ in 0..50 {
            let _ = fs::write(self.cgroup2.join("cgroup.kill"), "1");
            let pids = pids_in_tree(&self.cgroup2);
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            thread::sleep(Duration::from_millis(50));
        }
        for child in [self.containerd.take(), self.holder.take()].into_iter().flatten() {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
