//! Traffic helper for tests, the sandbox and the benchmarks. Tests start it inside a network
//! namespace and a cgroup (so the socket programs see its sockets) and read one JSON object per
//! line from its stdout.
//!
//! - `serve`: TCP, UDP and SCTP servers that answer every request with who they are and who the
//!   client appeared to be (so tests can check backend choice and client-IP preservation); a
//!   request that starts with `GET ` gets the same answer as an HTTP response.
//! - `tcp`: connects N times, reporting the peer (getpeername) and the server's answer, or errno.
//! - `sctp`: the same over one-to-one SCTP associations (`SOCK_STREAM`, `IPPROTO_SCTP`), which
//!   read and write as a byte stream: the server answers them with the TCP server's code.
//! - `udp`: sends N datagrams (connected or not), reporting the reply's source address.
//! - `hold`: keeps one TCP connection and exchanges a message every interval.
//! - `flood`: raw TCP SYNs or UDP datagrams from random (spoofed) sources to one address, bounded
//!   in count and time, for the reliability scenario of a flood from outside.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    thread,
    time::{Duration, Instant},
};

use clap::{Parser, Subcommand};
use serde_json::json;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

/// `tcp` and `sctp`: requests over stream connections (SCTP: one-to-one associations).
#[derive(clap::Args)]
struct Stream {
    #[arg(long)]
    connect: SocketAddr,
    #[arg(long, default_value_t = 1)]
    count: u32,
    /// Bytes of payload to send and expect echoed back as a checksum.
    #[arg(long, default_value_t = 0)]
    payload: usize,
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
    /// SCTP: connect from this local port (0: any), so that a test can fix the association's
    /// addresses and ports.
    #[arg(long, default_value_t = 0)]
    source_port: u16,
}

#[derive(Subcommand)]
enum Cmd {
    Serve {
        /// TCP listen addresses.
        #[arg(long)]
        tcp: Vec<SocketAddr>,
        /// UDP listen addresses.
        #[arg(long)]
        udp: Vec<SocketAddr>,
        /// SCTP listen addresses (one-to-one style sockets).
        #[arg(long)]
        sctp: Vec<SocketAddr>,
        /// Name reported in answers (default: the host name, which is the pod's name in
        /// Kubernetes: $HOSTNAME, else gethostname(2); else the listen address).
        #[arg(long)]
        name: Option<String>,
    },
    /// `count` requests, each over a TCP connection of its own; one JSON line each.
    Tcp(Stream),
    /// `tcp` over SCTP: the same requests and the same JSON lines.
    Sctp(Stream),
    Udp {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// connect() the socket first (else sendto/recvfrom).
        #[arg(long)]
        connected: bool,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// Bytes of payload (a pattern) instead of `hello`. The server answers a datagram with at
        /// least as many bytes, and says how many it got and their checksum: past the MTU, the
        /// datagram travels in IP fragments both ways.
        #[arg(long, default_value_t = 0)]
        payload: usize,
        /// Send from this local port (0: any), so that several runs are one flow.
        #[arg(long, default_value_t = 0)]
        source_port: u16,
    },
    /// Endless load for the sandbox: one request every interval, one JSON line each, as `tcp`,
    /// `udp` or `http` print them.
    Load {
        #[arg(long)]
        to: SocketAddr,
        /// tcp, udp or http.
        #[arg(long, default_value = "http")]
        kind: String,
        #[arg(long, default_value_t = 200)]
        interval_ms: u64,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// UDP: send every datagram from one long-lived (unconnected) socket, like a client that
        /// keeps a flow, instead of a fresh socket each time.
        #[arg(long)]
        persistent: bool,
    },
    /// One HTTP/1.1 GET; prints {"status": N, "headers": {...}, "body": "..."}.
    Http {
        /// host:port
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value = "/")]
        path: String,
        #[arg(long, default_value_t = 3000)]
        timeout_ms: u64,
    },
    /// Sends `count` TCP SYNs or UDP datagrams, each from a random address of `sources` and a
    /// random port, to `to` through a raw socket, as fast as it can (or at `pps`) and for at most
    /// `seconds`; prints {"sent", "failed", "elapsed_ms", "pps"} at the end. Run it only in a
    /// network namespace of the test's own: the packets go wherever its routes say.
    Flood {
        #[arg(long)]
        to: std::net::SocketAddrV4,
        /// tcp (SYNs) or udp.
        #[arg(long, default_value = "tcp")]
        proto: String,
        #[arg(long, default_value = "198.18.0.0/15")]
        sources: ipnet::Ipv4Net,
        #[arg(long, default_value_t = 100_000)]
        count: u64,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Packets per second; 0 sends as fast as the socket takes them.
        #[arg(long, default_value_t = 0)]
        pps: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// A resolver's loop on one long-lived connected UDP socket: a query every interval for
    /// `seconds`, one JSON line each ({"seq", "ok", "reply", "socket", "error", "errno"};
    /// `socket` counts the sockets used so far). A query without an answer in time is lost and
    /// the socket kept; any other error (ECONNABORTED when the agent aborts the socket) makes it
    /// open and connect a new one, as resolvers with long-lived sockets do.
    Resolve {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 50)]
        interval_ms: u64,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        #[arg(long, default_value_t = 500)]
        timeout_ms: u64,
    },
    Hold {
        #[arg(long)]
        connect: SocketAddr,
        #[arg(long, default_value_t = 100)]
        interval_ms: u64,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// How long an exchange may wait for its reply before the connection counts as broken
        /// (TCP retransmits meanwhile).
        #[arg(long, default_value_t = 2000)]
        read_timeout_ms: u64,
    },
}

fn answer(name: &str, local: SocketAddr, peer: SocketAddr, extra: serde_json::Value) -> String {
    let (local, peer) = (canonical(local), canonical(peer));
    json!({"server": name, "local": local.to_string(), "client": peer.to_string(), "extra": extra})
        .to_string()
}

/// An address as answers report it: an IPv4-mapped IPv6 address (an IPv4 peer of a dual-stack
/// socket bound to `[::]`) as the IPv4 address it stands for, so that a server on `[::]` reports
/// IPv4 clients as one on `0.0.0.0` does.
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// Binds `addr` with `bind`; `[::]` on a kernel without IPv6 (EAFNOSUPPORT) falls back to
/// `0.0.0.0` of the same port, so a server told to listen on both families still serves IPv4.
/// `proto` names the socket in the message of a bind that fails.
fn bind_or_ipv4<T>(
    proto: &str,
    addr: SocketAddr,
    bind: impl Fn(SocketAddr) -> std::io::Result<T>,
) -> (T, SocketAddr) {
    fn failed(proto: &str, addr: SocketAddr, e: std::io::Error) -> ! {
        let hint = if e.raw_os_error() == Some(libc::EPROTONOSUPPORT) {
            " (the kernel has no such protocol: for SCTP, CONFIG_IP_SCTP or `modprobe sctp`)"
        } else {
            ""
        };
        panic!("bind {proto} {addr}: {e}{hint}")
    }
    match bind(addr) {
        Err(e)
            if addr.ip() == std::net::Ipv6Addr::UNSPECIFIED
                && e.raw_os_error() == Some(libc::EAFNOSUPPORT) =>
        {
            let v4 = SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, addr.port()));
            eprintln!("no IPv6 on this kernel: {addr} is served on {v4}");
            (bind(v4).unwrap_or_else(|e| failed(proto, v4, e)), v4)
        }
        result => (result.unwrap_or_else(|e| failed(proto, addr, e)), addr),
    }
}

/// A one-to-one style SCTP socket (`SOCK_STREAM`, `IPPROTO_SCTP`) of the family of `addr`.
fn sctp_socket(addr: SocketAddr) -> std::io::Result<socket2::Socket> {
    socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::from(libc::IPPROTO_SCTP)),
    )
}

/// An SCTP listener on `addr`, as a `TcpListener`: accept, read, write and their timeouts are
/// the same calls on a one-to-one SCTP socket, so the TCP server's code serves it.
fn sctp_listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let sock = sctp_socket(addr)?;
    // As std's TcpListener::bind: a restarted server gets its port back at once.
    sock.set_reuse_address(true)?;
    sock.bind(&addr.into())?;
    sock.listen(128)?;
    Ok(sock.into())
}

/// An SCTP association to `to`, from local port `source_port` (0: any), as a `TcpStream`.
fn sctp_connect(to: SocketAddr, source_port: u16, timeout: Duration) -> std::io::Result<TcpStream> {
    let sock = sctp_socket(to)?;
    if source_port != 0 {
        // Runs with the same port one after the other: the last one's port may still be held.
        sock.set_reuse_address(true)?;
        let any: SocketAddr = if to.is_ipv6() {
            (std::net::Ipv6Addr::UNSPECIFIED, source_port).into()
        } else {
            (std::net::Ipv4Addr::UNSPECIFIED, source_port).into()
        };
        sock.bind(&any.into())?;
    }
    sock.connect_timeout(&to.into(), timeout)?;
    Ok(sock.into())
}

/// FNV-1a 64, to check bulk payloads end to end without a crypto dependency.
fn fnv1a(data: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    h.write(data);
    h.finish()
}

fn serve_tcp_conn(mut stream: TcpStream, name: String) {
    let (Ok(local), Ok(peer)) = (stream.local_addr(), stream.peer_addr()) else {
        return;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let reply = if line.starts_with("GET ") {
            // Drain the request headers, then answer as HTTP/1.1 and close.
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).map_or(true, |n| n == 0) || h == "\r\n" || h == "\n" {
                    break;
                }
            }
            let body = answer(&name, local, peer, json!(null));
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len() + 1
            );
            let _ = stream.write_all(b"\n");
            return;
        } else if let Some(n) = line.trim().strip_prefix("BULK ") {
            // The client sends n bytes; answer with their checksum.
            let n: usize = n.parse().unwrap_or(0);
            let mut buf = vec![0u8; n];
            if reader.read_exact(&mut buf).is_err() {
                return;
            }
            answer(
                &name,
                local,
                peer,
                json!({"bytes": n, "fnv1a": format!("{:016x}", fnv1a(&buf))}),
            )
        } else {
            answer(&name, local, peer, json!(null))
        };
        if stream.write_all(format!("{reply}\n").as_bytes()).is_err() {
            return;
        }
    }
}

/// The name `serve` reports without `--name`: the host name ($HOSTNAME, else gethostname(2)), so
/// that a probe running as a pod answers with the pod's name.
fn host_name() -> Option<String> {
    if let Some(name) = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()) {
        return Some(name);
    }
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that many bytes.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return None;
    }
    let len = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..len]).into_owned();
    (!name.is_empty()).then_some(name)
}

extern "C" fn exit_now(_: libc::c_int) {
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(0) };
}

fn serve(tcp: Vec<SocketAddr>, udp: Vec<SocketAddr>, sctp: Vec<SocketAddr>, name: Option<String>) {
    // As PID 1 of a container, a process only gets the signals it handles: without this, a Pod's
    // termination would wait for its whole grace period and SIGKILL.
    // SAFETY: installs a handler that only calls _exit.
    unsafe { libc::signal(libc::SIGTERM, exit_now as *const () as libc::sighandler_t) };
    let name = name.or_else(host_name);
    let mut handles = Vec::new();
    let stream_listeners = tcp
        .into_iter()
        .map(|addr| bind_or_ipv4("tcp", addr, TcpListener::bind))
        .chain(
            sctp.into_iter()
                .map(|addr| bind_or_ipv4("sctp", addr, sctp_listen)),
        )
        .collect::<Vec<_>>();
    for (listener, addr) in stream_listeners {
        let name = name.clone().unwrap_or_else(|| addr.to_string());
        handles.push(thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let name = name.clone();
                thread::spawn(move || serve_tcp_conn(stream, name));
            }
        }));
    }
    for addr in udp {
        let (sock, addr) = bind_or_ipv4("udp", addr, UdpSocket::bind);
        let name = name.clone().unwrap_or_else(|| addr.to_string());
        handles.push(thread::spawn(move || {
            let mut buf = [0u8; 65536];
            loop {
                let Ok((n, peer)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                let local = sock.local_addr().expect("local addr");
                let got = json!({"bytes": n, "fnv1a": format!("{:016x}", fnv1a(&buf[..n]))});
                // As large as the request (JSON ends at its closing brace; spaces pad it), so a
                // large request gets a reply in fragments too.
                let mut reply = answer(&name, local, peer, got).into_bytes();
                if reply.len() < n {
                    reply.resize(n, b' ');
                }
                let _ = sock.send_to(&reply, peer);
            }
        }));
    }
    println!("{}", json!({"ready": true}));
    for h in handles {
        let _ = h.join();
    }
}

fn errno_of(e: &std::io::Error) -> i32 {
    match e.raw_os_error() {
        Some(errno) => errno,
        // connect_timeout() reports its own timeout without an errno.
        None if e.kind() == std::io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        None => 0,
    }
}

/// CLOCK_MONOTONIC in nanoseconds: when an attempt started, comparable across attempts (and
/// processes), so a test can tell an idle gap from a stall.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|ts| ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64)
        .unwrap_or(0)
}

fn tcp_once(to: SocketAddr, payload: usize, timeout: Duration) -> serde_json::Value {
    stream_once(|| TcpStream::connect_timeout(&to, timeout), payload, timeout)
}

/// [`tcp_once`] over an SCTP association from `source_port` (0: any).
fn sctp_once(to: SocketAddr, payload: usize, timeout: Duration, source_port: u16) -> serde_json::Value {
    stream_once(|| sctp_connect(to, source_port, timeout), payload, timeout)
}

/// Connects with `connect` and makes one request: `hello`, or `BULK n` and n bytes whose checksum
/// the server must give back.
fn stream_once(
    connect: impl FnOnce() -> std::io::Result<TcpStream>,
    payload: usize,
    timeout: Duration,
) -> serde_json::Value {
    let start_ns = monotonic_ns();
    let started = Instant::now();
    let mut stream = match connect() {
        Ok(s) => s,
        Err(e) => return json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e)}),
    };
    let connect_us = started.elapsed().as_micros() as u64;
    let _ = stream.set_read_timeout(Some(timeout));
    let peer = stream.peer_addr().map(|p| p.to_string()).unwrap_or_default();
    let request = if payload > 0 {
        format!("BULK {payload}\n")
    } else {
        "hello\n".to_string()
    };
    let mut sum = None;
    let sent = stream.write_all(request.as_bytes()).and_then(|()| {
        if payload > 0 {
            let data = bulk_pattern(payload);
            sum = Some(format!("{:016x}", fnv1a(&data)));
            // In pieces: SCTP sends each write as one message once the send buffer has room
            // for all of it, so one larger than the buffer would wait until the timeout.
            for piece in data.chunks(32 * 1024) {
                stream.write_all(piece)?;
            }
        }
        Ok(())
    });
    if let Err(e) = sent {
        return json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e), "peer": peer});
    }
    let mut line = String::new();
    match BufReader::new(&stream).read_line(&mut line) {
        Ok(n) if n > 0 => {
            let reply: serde_json::Value = serde_json::from_str(line.trim()).unwrap_or(json!(line.trim()));
            json!({"ok": true, "peer": peer, "reply": reply, "sent_fnv1a": sum, "connect_us": connect_us, "start_ns": start_ns})
        }
        Ok(_) => {
            json!({"ok": false, "error": "connection closed without an answer", "errno": 0, "peer": peer})
        }
        Err(e) => json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e), "peer": peer}),
    }
}

/// A UDP socket of the family of `to`, bound to any address: AF_INET6 for an IPv6 destination,
/// IPv4-mapped ones included (a dual-stack socket, as Java's, Go's and most C programs' are).
fn udp_socket_for(to: SocketAddr) -> UdpSocket {
    udp_socket_from(to, 0)
}

/// [`udp_socket_for`] bound to local port `port` (0: any).
fn udp_socket_from(to: SocketAddr, port: u16) -> UdpSocket {
    let any: SocketAddr = if to.is_ipv6() {
        (std::net::Ipv6Addr::UNSPECIFIED, port).into()
    } else {
        (std::net::Ipv4Addr::UNSPECIFIED, port).into()
    };
    UdpSocket::bind(any).unwrap_or_else(|e| panic!("bind udp {any}: {e}"))
}

/// `n` bytes that are not a repeat of a short cycle (a byte lost or swapped changes the checksum).
fn bulk_pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
}

fn udp_once(
    to: SocketAddr,
    connected: bool,
    timeout: Duration,
    payload: usize,
    source_port: u16,
) -> serde_json::Value {
    let sock = udp_socket_from(to, source_port);
    let _ = sock.set_read_timeout(Some(timeout));
    let data: Vec<u8> = if payload == 0 {
        b"hello".to_vec()
    } else {
        bulk_pattern(payload)
    };
    let sent = if connected {
        sock.connect(to).and_then(|()| sock.send(&data))
    } else {
        sock.send_to(&data, to)
    };
    if let Err(e) = sent {
        return json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e)});
    }
    let peer = if connected {
        sock.peer_addr().ok().map(|p| p.to_string())
    } else {
        None
    };
    let mut buf = vec![0u8; 65536];
    match sock.recv_from(&mut buf) {
        Ok((n, from)) => {
            let reply: serde_json::Value = serde_json::from_slice(&buf[..n]).unwrap_or(json!(null));
            // The server got the datagram whole, and its answer came back whole (as long).
            let intact = reply["extra"]["bytes"] == data.len()
                && reply["extra"]["fnv1a"] == format!("{:016x}", fnv1a(&data))
                && n >= data.len();
            json!({"ok": true, "from": from.to_string(), "peer": peer, "reply": reply, "sent_bytes": data.len(), "received_bytes": n, "intact": intact})
        }
        // The socket's own address, so that a checker can look the flow's state up.
        Err(e) => {
            let local = sock.local_addr().ok().map(|a| a.to_string());
            json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e), "peer": peer, "local": local})
        }
    }
}

/// One request/response on an existing unconnected UDP socket (stray late replies are skipped).
fn udp_exchange(sock: &UdpSocket, to: SocketAddr) -> serde_json::Value {
    if let Err(e) = sock.send_to(b"hello", to) {
        return json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e)});
    }
    let mut buf = [0u8; 4096];
    match sock.recv_from(&mut buf) {
        Ok((n, from)) => {
            let reply: serde_json::Value = serde_json::from_slice(&buf[..n]).unwrap_or(json!(null));
            json!({"ok": true, "from": from.to_string(), "reply": reply})
        }
        Err(e) => json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e)}),
    }
}

fn resolve(to: SocketAddr, interval: Duration, seconds: Duration, timeout: Duration) {
    let connect = || -> std::io::Result<UdpSocket> {
        let sock = udp_socket_for(to);
        sock.set_read_timeout(Some(timeout))?;
        sock.connect(to)?;
        Ok(sock)
    };
    let started = std::time::Instant::now();
    let (mut sock, mut sockets) = (None, 0u32);
    let mut seq = 0u64;
    while started.elapsed() < seconds {
        seq += 1;
        if sock.is_none() {
            sock = connect().ok();
            sockets += 1;
        }
        let mut line = match &sock {
            None => json!({"ok": false, "error": "cannot connect a socket", "errno": 0}),
            Some(s) => {
                let mut buf = [0u8; 4096];
                match s.send(seq.to_string().as_bytes()).and_then(|_| s.recv(&mut buf)) {
                    Ok(n) => {
                        let reply: serde_json::Value =
                            serde_json::from_slice(&buf[..n]).unwrap_or(json!(null));
                        json!({"ok": true, "reply": reply})
                    }
                    Err(e) => {
                        let timed_out = matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        );
                        if !timed_out {
                            sock = None;
                        }
                        json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e)})
                    }
                }
            }
        };
        line["seq"] = json!(seq);
        line["socket"] = json!(sockets);
        line["t_us"] = json!(unix_us());
        println!("{line}");
        std::thread::sleep(interval);
    }
    println!("{}", json!({"done": true, "queries": seq, "sockets": sockets}));
}

/// Now, in microseconds since the Unix epoch (0 if the clock is before it).
fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn hold(to: SocketAddr, interval: Duration, seconds: u64, read_timeout: Duration) {
    let mut stream = match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
        Ok(s) => s,
        Err(e) => {
            println!(
                "{}",
                json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e)})
            );
            return;
        }
    };
    let _ = stream.set_read_timeout(Some(read_timeout));
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut n = 0u64;
    while Instant::now() < deadline {
        let mut line = String::new();
        let sent = Instant::now();
        let result = stream
            .write_all(b"ping\n")
            .and_then(|()| reader.read_line(&mut line));
        match result {
            Ok(len) if len > 0 => {
                let reply: serde_json::Value = serde_json::from_str(line.trim()).unwrap_or(json!(null));
                // getpeername at every exchange: the Service address for the connection's life.
                let peer = stream.peer_addr().map(|a| a.to_string()).ok();
                let rtt_us = sent.elapsed().as_micros() as u64;
                println!(
                    "{}",
                    json!({"ok": true, "seq": n, "reply": reply, "peer": peer, "rtt_us": rtt_us})
                );
            }
            // When it broke (unix µs), to set beside what else happened then.
            Ok(_) => {
                println!(
                    "{}",
                    json!({"ok": false, "seq": n, "error": "closed", "at_us": unix_us()})
                );
                return;
            }
            Err(e) => {
                // The client's port names the connection's conntrack entries; the kernel's view
                // says which side went silent (retransmissions unanswered, or nothing sent).
                let local = stream.local_addr().map(|a| a.to_string()).ok();
                println!(
                    "{}",
                    json!({"ok": false, "seq": n, "error": e.to_string(), "errno": errno_of(&e), "at_us": unix_us(), "local": local, "tcp_info": tcp_info(&stream)})
                );
                return;
            }
        }
        n += 1;
        thread::sleep(interval);
    }
    println!("{}", json!({"done": true, "exchanges": n}));
}

/// A TCP socket's state as the kernel sees it (`TCP_INFO`): what a stalled connection's
/// retransmissions and timers were doing.
fn tcp_info(stream: &TcpStream) -> serde_json::Value {
    use std::os::fd::AsRawFd;
    // SAFETY: tcp_info is plain data; getsockopt writes at most `len` bytes into it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return json!(null);
    }
    json!({
        "state": info.tcpi_state,
        "retransmits": info.tcpi_retransmits,
        "total_retrans": info.tcpi_total_retrans,
        "unacked": info.tcpi_unacked,
        "rto_us": info.tcpi_rto,
        "last_data_sent_ms": info.tcpi_last_data_sent,
        "last_data_recv_ms": info.tcpi_last_data_recv,
        "last_ack_recv_ms": info.tcpi_last_ack_recv,
    })
}

fn http_get(to: SocketAddr, path: &str, timeout: Duration) -> serde_json::Value {
    let mut stream = match TcpStream::connect_timeout(&to, timeout) {
        Ok(s) => s,
        Err(e) => return json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e)}),
    };
    let _ = stream.set_read_timeout(Some(timeout));
    if let Err(e) = write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n"
    ) {
        return json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e)});
    }
    let mut raw = Vec::new();
    if let Err(e) = stream.read_to_end(&mut raw)
        && raw.is_empty()
    {
        return json!({"ok": false, "error": e.to_string(), "errno": errno_of(&e)});
    }
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers: serde_json::Map<String, serde_json::Value> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), json!(v.trim())))
        .collect();
    json!({"ok": true, "status": status, "headers": headers, "body": body})
}

fn main() {
    match Cli::parse().command {
        Cmd::Serve { tcp, udp, sctp, name } => serve(tcp, udp, sctp, name),
        Cmd::Tcp(a) => {
            for _ in 0..a.count {
                println!(
                    "{}",
                    tcp_once(a.connect, a.payload, Duration::from_millis(a.timeout_ms))
                );
            }
        }
        Cmd::Sctp(a) => {
            for _ in 0..a.count {
                let timeout = Duration::from_millis(a.timeout_ms);
                println!("{}", sctp_once(a.connect, a.payload, timeout, a.source_port));
            }
        }
        Cmd::Udp {
            to,
            count,
            connected,
            timeout_ms,
            payload,
            source_port,
        } => {
            for _ in 0..count {
                println!(
                    "{}",
                    udp_once(
                        to,
                        connected,
                        Duration::from_millis(timeout_ms),
                        payload,
                        source_port
                    )
                );
            }
        }
        Cmd::Load {
            to,
            kind,
            interval_ms,
            timeout_ms,
            persistent,
        } => {
            let timeout = Duration::from_millis(timeout_ms);
            let flow = persistent.then(|| {
                let sock = udp_socket_for(to);
                let _ = sock.set_read_timeout(Some(timeout));
                sock
            });
            loop {
                let started_us = unix_us();
                let mut result = match kind.as_str() {
                    "tcp" => tcp_once(to, 0, timeout),
                    "udp" => match &flow {
                        Some(sock) => udp_exchange(sock, to),
                        None => udp_once(to, false, timeout, 0, 0),
                    },
                    _ => {
                        // An HTTP GET whose JSON body says who answered and whom it saw.
                        let r = http_get(to, "/", timeout);
                        match r["body"]
                            .as_str()
                            .and_then(|b| serde_json::from_str::<serde_json::Value>(b.trim()).ok())
                        {
                            Some(body) if r["status"] == 200 => json!({"ok": true, "reply": body}),
                            _ if r["ok"] == true => {
                                json!({"ok": false, "error": format!("HTTP status {}", r["status"]), "errno": 0})
                            }
                            _ => r,
                        }
                    }
                };
                // When the attempt started and how long it took, so that a checker can bound
                // when the kernel made its choice (between the two) without trusting the
                // scheduler.
                let done_us = unix_us();
                result["t_us"] = json!(started_us);
                result["elapsed_us"] = json!(done_us.saturating_sub(started_us));
                println!("{result}");
                thread::sleep(Duration::from_millis(interval_ms));
            }
        }
        Cmd::Http { to, path, timeout_ms } => {
            println!("{}", http_get(to, &path, Duration::from_millis(timeout_ms)))
        }
        Cmd::Resolve {
            to,
            interval_ms,
            seconds,
            timeout_ms,
        } => resolve(
            to,
            Duration::from_millis(interval_ms),
            Duration::from_secs(seconds),
            Duration::from_millis(timeout_ms),
        ),
        Cmd::Hold {
            connect,
            interval_ms,
            seconds,
            read_timeout_ms,
        } => hold(
            connect,
            Duration::from_millis(interval_ms),
            seconds,
            Duration::from_millis(read_timeout_ms),
        ),
        Cmd::Flood {
            to,
            proto,
            sources,
            count,
            seconds,
            pps,
            seed,
        } => {
            let udp = match proto.as_str() {
                "tcp" => false,
                "udp" => true,
                other => panic!("flood --proto {other}: tcp or udp"),
            };
            println!(
                "{}",
                flood(to, udp, sources, count, Duration::from_secs(seconds), pps, seed)
            );
        }
    }
}

/// The internet checksum of `chunks` (one's complement sum of 16-bit words).
fn checksum(chunks: &[&[u8]]) -> u16 {
    let mut sum = 0u32;
    for chunk in chunks {
        for word in chunk.chunks(2) {
            sum += u16::from_be_bytes([word[0], *word.get(1).unwrap_or(&0)]) as u32;
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 packet with a TCP SYN or a UDP datagram (8 bytes of payload) from `src`. The kernel
/// fills in the IP header's total length, id and checksum (raw socket, IPPROTO_RAW).
fn flood_packet(src: std::net::SocketAddrV4, dst: std::net::SocketAddrV4, udp: bool, seq: u32) -> Vec<u8> {
    let l4: Vec<u8> = if udp {
        let mut h = Vec::with_capacity(16);
        h.extend(src.port().to_be_bytes());
        h.extend(dst.port().to_be_bytes());
        h.extend(16u16.to_be_bytes());
        h.extend([0, 0]);
        h.extend(b"flood!\n\0");
        h
    } else {
        let mut h = Vec::with_capacity(20);
        h.extend(src.port().to_be_bytes());
        h.extend(dst.port().to_be_bytes());
        h.extend(seq.to_be_bytes());
        h.extend(0u32.to_be_bytes());
        h.extend([5 << 4, 0x02]); // data offset 5 words; SYN
        h.extend(64240u16.to_be_bytes());
        h.extend([0, 0, 0, 0]); // checksum, urgent pointer
        h
    };
    let proto = if udp { libc::IPPROTO_UDP } else { libc::IPPROTO_TCP } as u8;
    let pseudo = [
        &src.ip().octets()[..],
        &dst.ip().octets()[..],
        &[0, proto],
        &(l4.len() as u16).to_be_bytes(),
    ];
    let sum = checksum(&[pseudo[0], pseudo[1], pseudo[2], pseudo[3], &l4]);
    let mut l4 = l4;
    let at = if udp { 6 } else { 16 };
    l4[at..at + 2].copy_from_slice(&sum.to_be_bytes());
    let mut packet = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, proto, 0, 0];
    packet.extend(src.ip().octets());
    packet.extend(dst.ip().octets());
    packet.extend(l4);
    packet
}

fn flood(
    to: std::net::SocketAddrV4,
    udp: bool,
    sources: ipnet::Ipv4Net,
    count: u64,
    limit: Duration,
    pps: u64,
    seed: u64,
) -> serde_json::Value {
    use rand::{RngExt, SeedableRng, rngs::StdRng};
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    let dest = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(*to.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let (base, hosts) = (u32::from(sources.network()), 1u64 << (32 - sources.prefix_len()));
    let start = Instant::now();
    let (mut sent, mut failed) = (0u64, 0u64);
    while sent + failed < count && start.elapsed() < limit {
        // Paced when `pps` is set (None for 0: as fast as the socket takes them).
        if let Some(due_ns) = ((sent + failed) * 1_000_000_000).checked_div(pps)
            && let Some(wait) = Duration::from_nanos(due_ns).checked_sub(start.elapsed())
        {
            thread::sleep(wait);
        }
        let ip = std::net::Ipv4Addr::from(base + rng.random_range(0..hosts) as u32);
        let src = std::net::SocketAddrV4::new(ip, rng.random_range(1024..=65535));
        let packet = flood_packet(src, to, udp, rng.random());
        let n = unsafe {
            libc::sendto(
                fd,
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&dest as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if n == packet.len() as isize {
            sent += 1;
        } else {
            failed += 1;
        }
    }
    unsafe { libc::close(fd) };
    let elapsed = start.elapsed();
    json!({
        "sent": sent,
        "failed": failed,
        "elapsed_ms": elapsed.as_millis() as u64,
        "pps": (sent as f64 / elapsed.as_secs_f64().max(1e-9)) as u64,
    })
}

#[cfg(test)]
mod flood_tests {
    use super::*;

    /// A checksum over the packet with its checksum field filled in sums to zero.
    #[test]
    fn flood_packets_carry_valid_checksums() {
        let src = "198.18.3.4:40000".parse().unwrap();
        let dst = "192.168.50.11:30090".parse().unwrap();
        for udp in [false, true] {
            let p = flood_packet(src, dst, udp, 7);
            let l4 = &p[20..];
            let proto = [0, p[9]];
            let len = (l4.len() as u16).to_be_bytes();
            assert_eq!(
                checksum(&[&p[12..16], &p[16..20], &proto, &len, l4]),
                0,
                "udp={udp}"
            );
            assert_eq!(u16::from_be_bytes([l4[2], l4[3]]), 30090);
        }
    }
}
