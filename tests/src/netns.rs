//! Network namespaces and veth pairs made by a test, deleted by their guards (deleting a namespace
//! deletes the interfaces inside it, and a veth pair dies with either end).

use std::{
    fs::File,
    os::fd::AsFd,
    path::PathBuf,
    process::{Command, Output},
    thread,
};

use nix::sched::{CloneFlags, setns};

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

    /// A namespace with a fixed name (the sandbox, which must find a crashed run's leftovers);
    /// an existing namespace of that name is deleted first.
    pub fn named(name: &str) -> NetNs {
        assert!(name.len() <= 15, "{name} is too long");
        let _ = Command::new("ip").args(["netns", "delete", name]).output();
        run_ip(&["netns", "add", name]);
        let ns = NetNs {
            name: name.to_string(),
        };
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

    /// The interface index of `dev` inside this namespace (asked from inside it: `exec` keeps the
    /// host's /sys, whose `class/net` lists the host's interfaces).
    pub fn ifindex(&self, dev: &str) -> u32 {
        self.run(|| nix::net::if_::if_nametoindex(dev).unwrap_or_else(|e| panic!("ifindex of {dev}: {e}")))
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
    a.ip(&[
        "link",
        "add",
        a_dev,
        "type",
        "veth",
        "peer",
        "name",
        b_dev,
        "netns",
        b.name(),
    ]);
    for (ns, dev, addr) in [(a, a_dev, a_addr), (b, b_dev, b_addr)] {
        if let Some(addr) = addr {
            ns.ip(&["addr", "add", addr, "dev", dev]);
        }
        ns.ip(&["link", "set", dev, "up"]);
    }
}

fn run_ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
    assert!(
        out.status.success(),
        "ip {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Forwards TCP connections made to `listen` inside a namespace to `target` in the test's own
/// namespace: an agent inside a node namespace reaches the API server on the host's loopback at
/// the same address. Stops (and closes its listener) on drop.
pub struct PortForward {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    paused: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Open connections (client side), shut down on `pause`.
    open: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    accept: Option<thread::JoinHandle<()>>,
}

impl PortForward {
    pub fn start(ns: &NetNs, listen: std::net::SocketAddr, target: std::net::SocketAddr) -> PortForward {
        use std::{
            io,
            net::{Shutdown, TcpListener, TcpStream},
            sync::{
                Arc,
                atomic::{AtomicBool, Ordering},
            },
            time::Duration,
        };
        // The listening socket lives in the namespace it was created in; everything else (the
        // accept loop, the outbound connections) runs in ours.
        let listener = ns
            .run(|| TcpListener::bind(listen))
            .unwrap_or_else(|e| panic!("forward {listen} in {}: {e}", ns.name()));
        listener.set_nonblocking(true).expect("nonblocking listener");
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let paused = Arc::new(AtomicBool::new(false));
        let is_paused = paused.clone();
        let open: Arc<std::sync::Mutex<Vec<TcpStream>>> = Arc::default();
        let tracked = open.clone();
        let accept = thread::spawn(move || {
            while !stopped.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) if is_paused.load(Ordering::SeqCst) => {
                        // An outage: the connection is refused outright.
                        let _ = client.shutdown(Shutdown::Both);
                    }
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        if let Ok(c) = client.try_clone() {
                            tracked.lock().expect("open lock").push(c);
                        }
                        thread::spawn(move || {
                            let Ok(server) = TcpStream::connect_timeout(&target, Duration::from_secs(5))
                            else {
                                let _ = client.shutdown(Shutdown::Both);
                                return;
                            };
                            let (mut c2, mut s2) = (
                                client.try_clone().expect("clone"),
                                server.try_clone().expect("clone"),
                            );
                            let (mut c, mut s) = (client, server);
                            let up = thread::spawn(move || {
                                let _ = io::copy(&mut c, &mut s);
                                let _ = s.shutdown(Shutdown::Write);
                            });
                            let _ = io::copy(&mut s2, &mut c2);
                            let _ = c2.shutdown(Shutdown::Write);
                            let _ = up.join();
                        });
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        thread::sleep(Duration::from_millis(20))
                    }
                    Err(_) => thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        PortForward {
            stop,
            paused,
            open,
            accept: Some(accept),
        }
    }

    /// Cuts the path: open connections are shut down and new ones are closed at once, as if the
    /// API server were unreachable from the namespace.
    pub fn pause(&self) {
        self.paused.store(true, std::sync::atomic::Ordering::SeqCst);
        for c in self.open.lock().expect("open lock").drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn resume(&self) {
        self.paused.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// An HTTP CONNECT proxy on a Unix socket whose connections to an address are made inside the
/// namespace registered for it ([`ConnectProxy::route`]): the API server's egress to kubelets
/// (`kubectl logs`, `exec`, `port-forward`) and to Pods (`pods/proxy`, `services/proxy`), which
/// live in namespaces the machine has no route to. A destination no namespace was registered for
/// is refused: the machine's own routes would send it off the machine. Stops on drop.
pub struct ConnectProxy {
    via: Routes,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    accept: Option<thread::JoinHandle<()>>,
}

impl ConnectProxy {
    /// Listens on the Unix socket `path`.
    pub fn start(path: &std::path::Path) -> std::io::Result<ConnectProxy> {
        use std::sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        };
        let listener = std::os::unix::net::UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        let via: Routes = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (routes, stopped) = (via.clone(), stop.clone());
        let accept = thread::spawn(move || {
            while !stopped.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let routes = routes.clone();
                        thread::spawn(move || {
                            let _ = client.set_nonblocking(false);
                            let _ = connect_tunnel(client, &routes);
                        });
                    }
                    Err(_) => thread::sleep(std::time::Duration::from_millis(20)),
                }
            }
        });
        Ok(ConnectProxy {
            via,
            stop,
            accept: Some(accept),
        })
    }

    /// Makes the tunnels to `addr` from inside `ns` (by path, e.g. `/run/netns/<name>`).
    /// Connections to addresses in `net` are made inside the namespace at `ns` (the longest
    /// registered prefix wins).
    pub fn route(&self, net: ipnet::IpNet, ns: PathBuf) {
        let mut routes = self.via.lock().expect("route lock");
        routes.retain(|(known, _)| *known != net);
        routes.push((net, ns));
        routes.sort_by_key(|(known, _)| std::cmp::Reverse(known.prefix_len()));
    }
}

impl Drop for ConnectProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// Which namespace to connect from, per destination address.
type Routes = std::sync::Arc<std::sync::Mutex<Vec<(ipnet::IpNet, PathBuf)>>>;

/// Serves one `CONNECT host:port`: connects (inside the namespace routed for the host, if any),
/// answers 200 and relays.
fn connect_tunnel(mut client: std::os::unix::net::UnixStream, routes: &Routes) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > 8192 || client.read(&mut byte)? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    let target = head
        .strip_prefix("CONNECT ")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|t| t.parse::<std::net::SocketAddr>().ok());
    let Some(target) = target else {
        client.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")?;
        return Ok(());
    };
    let timeout = std::time::Duration::from_secs(5);
    let ns = routes
        .lock()
        .expect("route lock")
        .iter()
        .find(|(net, _)| net.contains(&target.ip()))
        .map(|(_, ns)| ns.clone());
    let server = match ns {
        Some(ns) => thread::scope(|s| {
            s.spawn(move || {
                let file = File::open(&ns)?;
                setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
                std::net::TcpStream::connect_timeout(&target, timeout)
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("connect thread panicked")))
        }),
        None => Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{} is in none of the test's namespaces", target.ip()),
        )),
    };
    let server = match server {
        Ok(s) => s,
        Err(e) => {
            client.write_all(format!("HTTP/1.1 502 Bad Gateway\r\n\r\n{e}").as_bytes())?;
            return Ok(());
        }
    };
    client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")?;
    let (mut c2, mut s2) = (client.try_clone()?, server.try_clone()?);
    let (mut c, mut s) = (client, server);
    let up = thread::spawn(move || {
        let _ = std::io::copy(&mut c, &mut s);
        let _ = s.shutdown(std::net::Shutdown::Write);
    });
    let _ = std::io::copy(&mut s2, &mut c2);
    let _ = c2.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::ConnectProxy;

    fn connect(socket: &std::path::Path, target: &str) -> String {
        let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        write!(stream, "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").unwrap();
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer
    }

    #[test]
    fn a_destination_in_none_of_the_tests_namespaces_is_refused_never_dialled() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("egress.sock");
        let proxy = ConnectProxy::start(&socket).unwrap();
        // Routed elsewhere: a Pod range, and one address of it more precisely.
        proxy.route("10.244.1.0/24".parse().unwrap(), "/nonexistent/a".into());
        proxy.route("10.244.1.7/32".parse().unwrap(), "/nonexistent/b".into());
        let answer = connect(&socket, "203.0.113.9:80");
        assert!(
            answer.starts_with("HTTP/1.1 502")
                && answer.contains("203.0.113.9 is in none of the test's namespaces"),
            "{answer}"
        );
        // Inside a routed range the namespace is used (here it does not exist: a 502 naming it).
        let answer = connect(&socket, "10.244.1.9:80");
        assert!(
            answer.starts_with("HTTP/1.1 502") && answer.contains("No such file"),
            "{answer}"
        );
        let routes = proxy.via.lock().unwrap();
        assert_eq!(
            routes[0].0.to_string(),
            "10.244.1.7/32",
            "the longest prefix first"
        );
    }
}
