//! Socket termination: the connected UDP sockets of local clients whose backend left.
//!
//! The socket programs translate a connected socket's destination once, at `connect()`; a
//! connected UDP socket then sends to that backend for as long as it lives, even after the
//! backend left every Service (a CoreDNS rollout leaves resolvers talking to a deleted pod).
//! kube-proxy has the same problem with conntrack and flushes the UDP entries of removed
//! endpoints; Cilium destroys the sockets. Here, when the map writer deletes a UDP backend (no
//! frontend uses it any more; a terminating backend kept as a fallback is still used), the
//! connected UDP sockets whose destination it was are aborted with netlink SOCK_DESTROY (what
//! `ss -K` does), in every network namespace of the processes under the socket programs' cgroup.
//! The application sees ECONNABORTED (a receive in flight) or EDESTADDRREQ (its next send: the
//! socket lost its destination); the socket it opens or connects next is translated anew, to a
//! live backend. The tc path needs none of this: its UDP flows move to a live backend by
//! themselves.
//!
//! Limits: the sockets are found by their destination, so a socket connected to the same
//! address and port directly (not through a Service) is aborted too; and a backend that leaves
//! one Service but stays in another keeps its sockets (the writer deletes only unused backends).
//! SOCK_DESTROY needs a kernel built with CONFIG_INET_DIAG_DESTROY, and entering a pod's network
//! namespace needs CAP_SYS_ADMIN (plus CAP_SYS_PTRACE and the host's PID namespace to open it
//! through /proc); [`SocketTerminator::start`] tries both once and says what is missing (without
//! the second, only the node's own sockets are terminated).

use std::{
    collections::{BTreeSet, HashSet},
    fs, io,
    net::{IpAddr, SocketAddr, UdpSocket},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::mpsc,
};

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP};
use netlink_packet_sock_diag::{
    AF_INET, AF_INET6, IPPROTO_UDP, SockDiagDestroy, SockDiagMessage,
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::{Socket, protocols::NETLINK_SOCK_DIAG};

use crate::metrics::Metrics;

/// One aborted socket: its network namespace (the inode of `/proc/PID/ns/net`), its own address
/// and the backend it was connected to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Aborted {
    pub netns: u64,
    pub local: SocketAddr,
    pub backend: SocketAddr,
}

/// What one termination did.
#[derive(Debug, Default)]
pub struct Termination {
    pub aborted: Vec<Aborted>,
    /// Network namespaces looked in.
    pub namespaces: usize,
    pub errors: Vec<String>,
}

/// Where sockets are terminated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every network namespace of the processes in the cgroup: the pods' and the node's.
    Pods,
    /// The agent's own network namespace (the node's) only, and why.
    NodeOnly(String),
}

/// Terminates sockets from a thread of its own, so that a sync never waits for it; batches are
/// handled in order.
pub struct SocketTerminator {
    batches: mpsc::Sender<BTreeSet<SocketAddr>>,
    scope: Scope,
}

impl SocketTerminator {
    /// Tries SOCK_DESTROY on a socket of the agent's own and starts the worker; the error says
    /// why this kernel (or this process) cannot terminate sockets. `host_only`
    /// (`--bpf-lb-sock-hostns-only`): the socket programs translate the node's network namespace
    /// only, so only its sockets are looked at; so too when this process may not enter other
    /// network namespaces.
    pub fn start(cgroup_root: PathBuf, host_only: bool, metrics: Metrics) -> Result<Self, String> {
        probe().map_err(|e| match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) => {
                "the kernel has no SOCK_DESTROY (built without CONFIG_INET_DIAG_DESTROY)".to_string()
            }
            Some(libc::EPERM) => "SOCK_DESTROY needs CAP_NET_ADMIN".to_string(),
            _ => format!("SOCK_DESTROY failed on a socket of the agent's own: {e}"),
        })?;
        let scope = if host_only {
            Scope::NodeOnly("--bpf-lb-sock-hostns-only: the pods' sockets are not translated".into())
        } else if let Err(e) = in_namespace(Path::new("/proc/self/ns/net"), false, || Ok(())) {
            Scope::NodeOnly(format!(
                "entering the pods' network namespaces failed ({e}): it needs CAP_SYS_ADMIN, and \
                 CAP_SYS_PTRACE and the host's PID namespace to open them"
            ))
        } else {
            Scope::Pods
        };
        let node_only = scope != Scope::Pods;
        let (batches, receive) = mpsc::channel::<BTreeSet<SocketAddr>>();
        std::thread::Builder::new()
            .name("sock-terminate".into())
            .spawn(move || {
                for backends in receive {
                    let done = terminate(&cgroup_root, node_only, &backends);
                    report(&backends, &done);
                    metrics.sockets_terminated(done.aborted.len() as u64);
                }
            })
            .map_err(|e| format!("cannot start its thread: {e}"))?;
        Ok(Self { batches, scope })
    }

    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// Aborts, soon, the connected UDP sockets to `backends` (backends the maps no longer hold).
    pub fn terminate(&self, backends: BTreeSet<SocketAddr>) {
        if !backends.is_empty() {
            let _ = self.batches.send(backends);
        }
    }
}

fn report(backends: &BTreeSet<SocketAddr>, done: &Termination) {
    let backends: Vec<String> = backends.iter().map(ToString::to_string).collect();
    for a in &done.aborted {
        tracing::debug!(netns = a.netns, local = %a.local, backend = %a.backend, "aborted a connected UDP socket");
    }
    if !done.aborted.is_empty() {
        tracing::info!(
            backends = %backends.join(","),
            namespaces = done.namespaces,
            "aborted {} connected UDP socket(s) to removed backends",
            done.aborted.len()
        );
    }
    for e in &done.errors {
        tracing::warn!(backends = %backends.join(","), "terminating sockets to removed backends: {e}");
    }
}

/// In every network namespace of the processes in `cgroup_root` and below (`node_only`: in this
/// process's only, if one of them is there), aborts the connected UDP sockets whose destination
/// is one of `backends`.
pub fn terminate(cgroup_root: &Path, node_only: bool, backends: &BTreeSet<SocketAddr>) -> Termination {
    let mut done = Termination::default();
    let own = fs::metadata("/proc/self/ns/net").map(|m| m.ino()).ok();
    let namespaces = match namespaces_of(cgroup_root) {
        Ok(n) if node_only => n.into_iter().filter(|(ino, _)| Some(*ino) == own).collect(),
        Ok(n) => n,
        Err(e) => {
            done.errors
                .push(format!("listing the processes of {}: {e}", cgroup_root.display()));
            return done;
        }
    };
    done.namespaces = namespaces.len();
    for (inode, path) in namespaces {
        match in_namespace(&path, Some(inode) == own, || abort_connected_udp(backends)) {
            Ok(aborted) => done
                .aborted
                .extend(aborted.into_iter().map(|(local, backend)| Aborted {
                    netns: inode,
                    local,
                    backend,
                })),
            // The namespace went with its last process meanwhile.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => done.errors.push(format!(
                "in the network namespace {inode} ({}): {e}",
                path.display()
            )),
        }
    }
    done
}

/// Runs `work` in the network namespace at `path` (`own`: this process's, entered already), on a
/// thread of its own: setns() changes the calling thread only, and the thread is gone with it.
fn in_namespace<T: Send>(
    path: &Path,
    own: bool,
    work: impl FnOnce() -> io::Result<T> + Send,
) -> io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            if !own {
                let ns = fs::File::open(path)?;
                nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            }
            work()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the thread panicked")))
    })
}

/// One `/proc/PID/ns/net` per network namespace of the processes in `cgroup_root` and every
/// cgroup below it, with the namespace's inode.
fn namespaces_of(cgroup_root: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut seen = HashSet::new();
    let mut namespaces = Vec::new();
    let mut cgroups = vec![cgroup_root.to_path_buf()];
    while let Some(dir) = cgroups.pop() {
        let procs = match fs::read_to_string(dir.join("cgroup.procs")) {
            Ok(p) => p,
            // A cgroup removed meanwhile (the root itself must be there).
            Err(e) if e.kind() == io::ErrorKind::NotFound && dir != cgroup_root => continue,
            Err(e) => return Err(e),
        };
        for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let path = PathBuf::from(format!("/proc/{pid}/ns/net"));
            // A process that exited meanwhile has no namespace to look in.
            if let Ok(meta) = fs::metadata(&path)
                && seen.insert((meta.dev(), meta.ino()))
            {
                namespaces.push((meta.ino(), path));
            }
        }
        if let Ok(entries) = fs::read_dir(&dir) {
            cgroups.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    Ok(namespaces)
}

/// In this thread's network namespace: aborts the connected UDP sockets whose destination is one
/// of `backends`; (local address, backend) of each. An IPv4 backend is also the destination of
/// dual-stack sockets connected to its IPv4-mapped address.
fn abort_connected_udp(backends: &BTreeSet<SocketAddr>) -> io::Result<Vec<(SocketAddr, SocketAddr)>> {
    let socket = crate::netlink::socket(NETLINK_SOCK_DIAG)?;
    let mut aborted = Vec::new();
    let families: &[u8] = if backends.iter().any(SocketAddr::is_ipv4) {
        &[AF_INET, AF_INET6]
    } else {
        &[AF_INET6]
    };
    for family in families {
        let mut targets = Vec::new();
        let dump = SockDiagMessage::InetRequest(udp_request(*family, any_socket(*family)));
        crate::netlink::request(&socket, dump, NLM_F_DUMP, |answer: SockDiagMessage| {
            let SockDiagMessage::InetResponse(response) = answer else {
                return;
            };
            let id = &response.header.socket_id;
            let backend = SocketAddr::new(id.destination_address.to_canonical(), id.destination_port);
            if backends.contains(&backend) {
                targets.push((id.clone(), backend));
            }
        })?;
        for (id, backend) in targets {
            let local = SocketAddr::new(id.source_address.to_canonical(), id.source_port);
            match destroy(&socket, *family, id) {
                Ok(()) => aborted.push((local, backend)),
                // Closed since the dump.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(aborted)
}

/// Connected UDP sockets (state TCP_ESTABLISHED) of `family` matching `id`.
fn udp_request(family: u8, socket_id: SocketId) -> InetRequest {
    InetRequest {
        family,
        protocol: IPPROTO_UDP,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::ESTABLISHED,
        socket_id,
    }
}

fn any_socket(family: u8) -> SocketId {
    if family == AF_INET {
        SocketId::new_v4()
    } else {
        SocketId::new_v6()
    }
}

/// SOCK_DESTROY of the socket `id` names (its cookie included, so a socket that replaced it on
/// the same addresses is left alone).
fn destroy(socket: &Socket, family: u8, id: SocketId) -> io::Result<()> {
    let request = SockDiagDestroy::new(SockDiagMessage::InetRequest(udp_request(family, id)));
    crate::netlink::request(socket, request, NLM_F_ACK, |_: SockDiagMessage| {})
}

/// SOCK_DESTROY of a connected UDP socket of our own on loopback: whether this kernel and this
/// process can terminate sockets at all.
fn probe() -> io::Result<()> {
    let own = UdpSocket::bind("127.0.0.1:0")?;
    // The discard port: nothing is sent.
    own.connect("127.0.0.1:9")?;
    let local = own.local_addr()?;
    let mut id = SocketId::new_v4();
    id.source_address = local.ip();
    id.source_port = local.port();
    id.destination_address = IpAddr::from([127, 0, 0, 1]);
    id.destination_port = 9;
    // No cookie: every byte 0xff.
    id.cookie = [0xff; 8];
    destroy(&crate::netlink::socket(NETLINK_SOCK_DIAG)?, AF_INET, id)?;
    match own.take_error()? {
        Some(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => Ok(()),
        other => Err(io::Error::other(format!(
            "the kernel acknowledged it but the socket's error is {other:?}, not ECONNABORTED"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Root only (CAP_NET_ADMIN): skipped otherwise.
    fn root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn this_kernel_destroys_sockets() {
        if !root() {
            return;
        }
        probe().expect("SOCK_DESTROY of a socket of our own");
    }

    #[test]
    fn only_the_sockets_connected_to_a_removed_backend_are_aborted() {
        if !root() {
            return;
        }
        // In a network namespace of the test's own (this thread's only), on its loopback: each
        // socket connected to a port nothing listens on.
        std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            // The child runs in this thread's namespace.
            let up = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status();
            assert!(up.unwrap().success());
            sockets_to_a_removed_backend_are_aborted();
        })
        .join()
        .unwrap();
    }

    fn sockets_to_a_removed_backend_are_aborted() {
        let gone: SocketAddr = "127.0.0.1:3".parse().unwrap();
        let kept: SocketAddr = "127.0.0.1:4".parse().unwrap();
        let to_gone = UdpSocket::bind("127.0.0.1:0").unwrap();
        to_gone.connect(gone).unwrap();
        let mapped = UdpSocket::bind("[::]:0").unwrap();
        mapped.connect("[::ffff:127.0.0.1]:3").unwrap();
        let to_kept = UdpSocket::bind("127.0.0.1:0").unwrap();
        to_kept.connect(kept).unwrap();
        let unconnected = UdpSocket::bind("127.0.0.1:0").unwrap();
        // Taken before: an aborted socket's port is released.
        let (gone_local, mapped_local) = (to_gone.local_addr().unwrap(), mapped.local_addr().unwrap());

        let aborted = abort_connected_udp(&BTreeSet::from([gone])).unwrap();
        let locals: BTreeSet<SocketAddr> = aborted.iter().map(|(l, _)| *l).collect();
        assert!(locals.contains(&gone_local), "{aborted:?}");
        assert!(
            locals.contains(&SocketAddr::new(
                mapped_local.ip().to_canonical(),
                mapped_local.port()
            )),
            "the dual-stack socket connected to the IPv4-mapped address: {aborted:?}"
        );
        assert!(aborted.iter().all(|(_, b)| *b == gone), "{aborted:?}");
        let error = |s: &UdpSocket| s.take_error().unwrap().and_then(|e| e.raw_os_error());
        assert_eq!(error(&to_gone), Some(libc::ECONNABORTED));
        assert_eq!(error(&mapped), Some(libc::ECONNABORTED));
        assert_eq!(error(&to_kept), None);
        assert_eq!(error(&unconnected), None);
        // The kept one still sends.
        to_kept.send(b"x").unwrap();
    }

    #[test]
    fn namespaces_are_listed_once_each_from_every_cgroup_below_the_root() {
        // A cgroup tree as files: the root with this process, a pod's cgroup below it with a
        // child of ours (the same namespace) and a pid that is gone.
        let root = tempfile::tempdir().unwrap();
        let pod = root.path().join("kubepods/pod1");
        fs::create_dir_all(&pod).unwrap();
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        fs::write(
            root.path().join("cgroup.procs"),
            format!("{}\n", std::process::id()),
        )
        .unwrap();
        fs::write(pod.join("cgroup.procs"), format!("{}\n4194304999\n", child.id())).unwrap();
        let listed = namespaces_of(root.path());
        let _ = child.kill();
        let _ = child.wait();
        let own = fs::metadata("/proc/self/ns/net").unwrap().ino();
        let inodes: Vec<u64> = listed.unwrap().iter().map(|(ino, _)| *ino).collect();
        assert_eq!(inodes, vec![own]);
        // The root must be there.
        assert!(namespaces_of(&root.path().join("gone")).is_err());
    }
}
