//! Removes what runs that died without their guards (SIGKILL, a crashed runner, a lost machine
//! session) left behind: network namespaces, test cgroups (of every hierarchy), bpffs mounts and
//! the directories of real nodes. Every such object is
//! named by [`crate::unique_name`] (`<prefix><pid % 100000>x<n>`), so an object is only swept when
//! no live process has a matching pid: a concurrent run's objects are never touched.

use std::{fs, path::Path, process::Command};

use nix::mount::{MntFlags, umount2};

/// The pid part of a [`crate::unique_name`] (`bn20974x3` -> 20974), if `name` is one.
fn pid_of(name: &str) -> Option<u32> {
    let (head, n) = name.rsplit_once('x')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = head.len() - head.bytes().rev().take_while(u8::is_ascii_digit).count();
    let (prefix, pid) = head.split_at(digits);
    if prefix.is_empty() || pid.is_empty() || !prefix.bytes().all(|b| b.is_ascii_lowercase()) {
        return None;
    }
    pid.parse().ok()
}

/// The pids (mod 100,000, as names carry them) of the processes alive now.
fn live_pids() -> std::collections::BTreeSet<u32> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .map(|pid| pid % 100_000)
        .collect()
}

/// Processes of a control plane (their command line names `<tmp>/lb-control-plane-*`) whose
/// parent is `parent` (1: their test died and they were re-parented), with that directory.
fn control_planes_of(parent: i32) -> Vec<(i32, std::path::PathBuf)> {
    let marker = std::env::temp_dir().join("lb-control-plane-");
    let marker = marker.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let Some(at) = cmdline.find(&marker) else {
            continue;
        };
        let stat = fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let ppid = crate::process::parse_stat(&stat).and_then(|(ppid, _, _)| i32::try_from(ppid).ok());
        if ppid != Some(parent) {
            continue;
        }
        // The directory is the marker plus tempfile's alphanumeric suffix.
        let suffix: String = cmdline[at + marker.len()..]
            .chars()
            .take_while(char::is_ascii_alphanumeric)
            .collect();
        let dir = format!("{marker}{suffix}");
        found.push((pid, std::path::PathBuf::from(dir)));
    }
    found
}

/// Sweeps the leftovers of dead runs; returns what it removed (for one line of output).
pub fn leftovers_of_dead_runs() -> Vec<String> {
    // Asked of each object once it is listed, never of a list of processes read before: a run
    // that started in between (its objects made after that list) would be taken for dead and its
    // namespaces deleted under it.
    sweep(|pid| !live_pids().contains(&pid), control_planes_of(1))
}

/// Removes everything this process made (a signal is ending it: no guard will run).
pub fn own_objects() -> Vec<String> {
    let me = std::process::id();
    sweep(|pid| pid == me % 100_000, control_planes_of(me as i32))
}

/// On SIGINT, SIGTERM or SIGHUP (Ctrl-C, a runner's timeout, a closed terminal), removes what this
/// process made, then exits as the signal would have (128 + its number): a signal ends a process
/// without running its guards. Installed once, by [`crate::require_root`], for the signals the
/// program has not taken itself.
pub fn remove_own_objects_on_signals() {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    use std::os::fd::{AsRawFd, IntoRawFd};

    static WRITE_END: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
    extern "C" fn on_signal(sig: libc::c_int) {
        let fd = WRITE_END.load(std::sync::atomic::Ordering::SeqCst);
        let byte = sig as u8;
        // SAFETY: write is async-signal-safe; the byte lives for the call.
        unsafe { libc::write(fd, (&byte as *const u8).cast(), 1) };
    }
    let Ok((read_end, write_end)) = nix::unistd::pipe() else {
        return;
    };
    WRITE_END.store(write_end.into_raw_fd(), std::sync::atomic::Ordering::SeqCst);
    let spawned = std::thread::Builder::new()
        .name("signal-sweep".into())
        .spawn(move || {
            let mut byte = [0u8; 1];
            // SAFETY: reading into a live one-byte buffer from the pipe this thread owns.
            let n = unsafe { libc::read(read_end.as_raw_fd(), byte.as_mut_ptr().cast(), 1) };
            if n != 1 {
                return;
            }
            let sig = i32::from(byte[0]);
            let removed = own_objects();
            eprintln!(
                "signal {sig}: removed what this test process made ({}); exiting",
                if removed.is_empty() {
                    "nothing".to_string()
                } else {
                    removed.join(", ")
                }
            );
            // SAFETY: ends the process without unwinding other threads, as the signal would have.
            unsafe { libc::_exit(128 + sig) };
        });
    if spawned.is_err() {
        return;
    }
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only writes one byte to a pipe, which is async-signal-safe; a
        // program with its own handler (the sandbox tears down in order) gets it back.
        unsafe {
            if let Ok(old) = sigaction(signal, &action)
                && !matches!(old.handler(), SigHandler::SigDfl)
            {
                let _ = sigaction(signal, &old);
            }
        }
    }
}

/// Removes the objects named with a pid for which `owned` holds, and the control planes in
/// `control_planes`; returns what it removed.
fn sweep(owned: impl Fn(u32) -> bool, control_planes: Vec<(i32, std::path::PathBuf)>) -> Vec<String> {
    let dead = |name: &str| pid_of(name).is_some_and(&owned);
    // Only the prefixes this crate gives namespaces (`lb...` for the tests, `bc`/`bn`/`bs` for
    // the benchmark's client, node and server): a namespace of someone else's is never ours.
    let ours = |name: &str| {
        let prefix = name.trim_end_matches(|c: char| c.is_ascii_digit() || c == 'x');
        prefix.starts_with("lb") || matches!(prefix, "bc" | "bn" | "bs")
    };
    let mut removed = Vec::new();

    // Control planes (`crate::control_plane`): etcd, kube-apiserver and the controllers outlive a
    // killed test as orphans; their data directory goes with them.
    for (pid, dir) in control_planes {
        // SAFETY: kill has no memory effects.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        removed.push(format!("control-plane process {pid}"));
        if dir.exists() {
            std::thread::sleep(std::time::Duration::from_millis(200));
            if fs::remove_dir_all(&dir).is_ok() {
                removed.push(format!("control-plane directory {}", dir.display()));
            }
        }
    }

    // Namespaces: kill what still runs inside, then delete the name.
    for entry in fs::read_dir("/run/netns").into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !ours(&name) || !dead(&name) {
            continue;
        }
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &name]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>() {
                    // SAFETY: kill has no memory effects.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        if Command::new("ip")
            .args(["netns", "delete", &name])
            .output()
            .is_ok_and(|o| o.status.success())
        {
            removed.push(format!("netns {name}"));
        }
    }

    // Test cgroups (their processes are killed by the removal).
    if let Ok(mount) = lb_agent::datapath::cgroup::cgroup2_mount() {
        let parent = mount.join("lb-tests");
        for entry in fs::read_dir(&parent).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.path().is_dir() && dead(&name) {
                crate::cgroup::remove_tree(&entry.path());
                removed.push(format!("cgroup {name}"));
            }
        }
    }

    // The cgroups of real nodes in the v1 hierarchies of a hybrid machine (`crate::kubelet`; their
    // cgroup2 tree went above, with its processes).
    for hierarchy in fs::read_dir("/sys/fs/cgroup").into_iter().flatten().flatten() {
        let parent = hierarchy.path().join("lb-tests");
        for entry in fs::read_dir(&parent).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.path().is_dir() && dead(&name) {
                crate::kubelet::remove_cgroup_tree(&entry.path());
                removed.push(format!("cgroup {}", entry.path().display()));
            }
        }
    }
    // The directories of real nodes (`<tmp>/<node>-XXXXXX`: images, containers' layers, logs),
    // free once the node's processes (and so its mount namespace) are gone.
    for entry in fs::read_dir(std::env::temp_dir()).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some((node, _)) = name.split_once('-')
            && node.starts_with("lbk")
            && dead(node)
            && fs::remove_dir_all(entry.path()).is_ok()
        {
            removed.push(format!("node directory {}", entry.path().display()));
        }
    }

    // bpffs mounts in the temp dir (dropping the pins detaches pinned links).
    let tmp = std::env::temp_dir();
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    for line in mounts.lines() {
        let mut fields = line.split_whitespace();
        let (Some(_), Some(point), Some("bpf")) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let point = Path::new(point);
        let Some(name) = point.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if point.parent() == Some(tmp.as_path()) && dead(name) {
            while umount2(point, MntFlags::MNT_DETACH).is_ok() {}
            let _ = fs::remove_dir(point);
            removed.push(format!("bpffs {}", point.display()));
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::pid_of;

    #[test]
    fn names_made_by_unique_name_give_their_pid() {
        assert_eq!(pid_of("bn20974x15"), Some(20974));
        assert_eq!(pid_of("lbbpffs7x0"), Some(7));
        assert_eq!(pid_of("lbb123x9"), Some(123));
        for other in [
            "eth0",
            "lb-tests",
            "x1",
            "bnx1",
            "bn12x",
            "cni-1x2",
            "Bn1x2",
            "lb-node-a",
        ] {
            assert_eq!(pid_of(other), None, "{other}");
        }
    }
}
