//! The guests: virtme-ng (from PyPI, in a virtualenv under the cache) booting a kernel with
//! qemu, KVM where the CPU exposes hardware virtualization and TCG elsewhere; the guest's
//! process group, killed on drop; the signals (SIGINT, SIGTERM, SIGHUP) that stop it; and
//! quoting for the guest's shell.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};

use crate::{
    setup,
    util::{cache_dir, run, step},
};

/// virtme-ng, from the Python package index.
const VIRTME_NG: &str = "virtme-ng==1.42";

/// What the guests need on the host: qemu, busybox (virtme-ng's initramfs), depmod (the
/// modules of an extracted kernel package), apt and dpkg-deb (the kernel packages).
pub(super) const GUEST_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86_64", "qemu-system-x86"),
    ("busybox", "busybox-static"),
    ("depmod", "kmod"),
    ("dpkg-deb", "dpkg"),
    ("python3", "python3"),
];

/// Set by SIGINT, SIGTERM or SIGHUP: stop the guest and clean up.
pub(super) static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

pub(super) fn catch_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(signal, on_signal as *const () as libc::sighandler_t) };
    }
}

/// A process group (virtme-ng and the qemu it forks) killed on drop.
pub(super) struct GuestProcess {
    pub(super) child: Child,
}

impl GuestProcess {
    pub(super) fn kill(&mut self) {
        let pgid = self.child.id() as libc::pid_t;
        // SAFETY: signalling a process group we created.
        unsafe { libc::killpg(pgid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                break;
            }
            thread::sleep(Duration::from_millis(100));
        }
        // SAFETY: as above; qemu may outlive its parent's SIGTERM.
        unsafe { libc::killpg(pgid, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

impl Drop for GuestProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.kill();
        }
    }
}

/// virtme-ng in a virtualenv under the cache; returns the path of `vng`.
pub(super) fn ensure_virtme_ng() -> Result<PathBuf> {
    let venv = cache_dir().join(format!(
        "virtme-ng-{}",
        VIRTME_NG.trim_start_matches("virtme-ng==")
    ));
    let vng = venv.join("bin/vng");
    if vng.is_file() {
        return Ok(vng);
    }
    step(&format!(
        "installing {VIRTME_NG} from the Python package index (once)"
    ));
    let make_venv = || Command::new("python3").arg("-m").arg("venv").arg(&venv).status();
    if !make_venv().is_ok_and(|s| s.success()) {
        // Debian's python3 keeps venv in its own package.
        setup::apt_install(&["python3-venv"])?;
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    }
    run(Command::new(venv.join("bin/pip")).args(["install", "--quiet", VIRTME_NG]))?;
    if !vng.is_file() {
        bail!("{VIRTME_NG} installed no {}", vng.display());
    }
    Ok(vng)
}

/// Whether to use KVM: asked for, or `auto` and the CPU exposes hardware virtualization to us
/// (a /dev/kvm without vmx/svm is emulated by the outer hypervisor and far slower than TCG).
pub(super) fn use_kvm(accel: &str) -> Result<bool> {
    let hardware = Path::new("/dev/kvm").exists()
        && fs::read_to_string("/proc/cpuinfo")
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    match accel {
        "kvm" => Ok(true),
        "tcg" => Ok(false),
        "auto" => Ok(hardware),
        other => bail!("--accel {other:?}: use kvm, tcg or auto"),
    }
}

/// `'...'` for the guest's shell.
pub(super) fn shell_quote(s: &str) -> String {
    if s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}
