//! One benchmark topology (reference §7.2 / §8(a)), made fresh for every configuration. It is
//! dual-stack: every address has its IPv6 twin beside it (`10.240.0.2` → `fd00:10:240::2`), so
//! one topology (and one proxy) serves the IPv4 and the IPv6 measurements alike:
//!
//! ```text
//!  client netns                node netns (the proxy runs here)          backend netns
//!  c0 10.240.0.2/24 ──veth── n0 10.240.0.1/24   n1 10.250.0.1/30 ──veth── b0 10.250.0.2/30
//!     fd00:10:240::2/64         fd00:10:240::1/64  fd00:10:250::1/64          fd00:10:250::2/64
//!  default via the node       10.128.0.0/12 via 10.250.0.2                 local 10.128.0.0/12 dev lo
//!                             10.96.0.0/16 via 10.250.0.2                  local 10.96.0.0/16 dev lo
//!                             fd00:10:200::/64 via fd00:10:250::2          local fd00:10:200::/64 dev lo
//!                             fd00:10:96::/112 via fd00:10:250::2          local fd00:10:96::/112 dev lo
//!                                                                          accept-and-close server on
//!                                                                          :8080 (both families),
//!                                                                          pinned to CPU 0
//! ```
//!
//! A connection to a ClusterIP that no proxy translated is refused by the backend namespace (the
//! Service ranges are local there, nothing listens on the Service ports), so "not served" shows
//! at once (an unroutable ClusterIP would instead get ICMP errors, which the kernel rate-limits
//! globally, and a probe would wait for its connect timeout).
//!
//! The endpoint ranges are AnyIP in the backend namespace, so one server answers every endpoint
//! IP. The API server (host loopback) is forwarded into the node namespace at the same address.
//! IPv6 addresses are added with `nodad` and the namespaces do no duplicate address detection,
//! so every address is usable at once (a tentative address can be neither bound nor used as a
//! source, and a router without a usable link-local address sends no neighbour solicitation).

use std::net::SocketAddr;

use lb_tests::{
    netns::{NetNs, PortForward, veth},
    packet::Family,
    process::{Place, Proc},
};

use super::crr;

pub const CLIENT_IP: &str = "10.240.0.2";
pub const NODE_IP: &str = "10.240.0.1";
pub const CLIENT_IP6: &str = "fd00:10:240::2";
pub const NODE_IP6: &str = "fd00:10:240::1";
/// Every IPv4 endpoint IP of the benchmark lies here (AnyIP in the backend namespace).
pub const ENDPOINT_RANGE: &str = "10.128.0.0/12";
/// Every IPv6 endpoint IP (AnyIP in the backend namespace).
pub const ENDPOINT_RANGE6: &str = "fd00:10:200::/64";
/// The cluster CIDRs given to every proxy (one per family): they hold the client (and the
/// endpoints), so the client is an in-cluster pod and no configuration masquerades.
pub const CLUSTER_CIDR: &str = "10.128.0.0/9";
/// The IPv6 cluster CIDR: fd00:10:200:: to fd00:10:2ff:ffff:..., which holds the client's
/// fd00:10:240::/64 and the endpoints' fd00:10:200::/64, and not the Service range.
pub const CLUSTER_CIDR6: &str = "fd00:10:200::/40";
pub const BACKEND_PORT: u16 = 8080;
/// The Node's pod CIDRs (IPv4 first): inside the cluster CIDRs, apart from every address the
/// topology routes (Cilium puts its router addresses here).
pub const NODE_POD_CIDRS: [&str; 2] = ["10.200.0.0/24", "fd00:10:201::/64"];
/// The API server's Service CIDRs (the ClusterIPs).
pub const SERVICE_RANGE: &str = lb_tests::control_plane::SERVICE_CIDR;
pub const SERVICE_RANGE6: &str = lb_tests::control_plane::SERVICE_CIDR6;

/// The client's address of `family`.
pub fn client_ip(family: Family) -> &'static str {
    match family {
        Family::V4 => CLIENT_IP,
        Family::V6 => CLIENT_IP6,
    }
}

/// `--cluster-cidr` for every proxy: both families, IPv4 first (the primary family).
pub fn cluster_cidrs() -> String {
    format!("{CLUSTER_CIDR},{CLUSTER_CIDR6}")
}

pub struct Topo {
    // Dropped first: processes before the namespaces they live in.
    _server: Proc,
    _forward: PortForward,
    pub client: NetNs,
    pub node: NetNs,
    _backend: NetNs,
}

/// Adds an IPv6 address (CIDR notation) to `dev` in `ns`, usable at once.
fn add_ipv6(ns: &NetNs, addr: &str, dev: &str) {
    ns.ip(&["-6", "addr", "add", addr, "dev", dev, "nodad"]);
}

impl Topo {
    pub fn new(api: SocketAddr) -> Topo {
        let client = NetNs::new("bc");
        let node = NetNs::new("bn");
        let backend = NetNs::new("bs");
        // No duplicate address detection on the links made below: while a link-local address is
        // tentative (a second or two after the link comes up) the node cannot send a neighbour
        // solicitation for a packet it forwards, and the first IPv6 connections would wait.
        for ns in [&client, &node, &backend] {
            ns.sysctl("net.ipv6.conf.all.accept_dad=0");
            ns.sysctl("net.ipv6.conf.default.accept_dad=0");
        }
        veth(
            &node,
            "n0",
            Some("10.240.0.1/24"),
            &client,
            "c0",
            Some("10.240.0.2/24"),
        );
        veth(
            &node,
            "n1",
            Some("10.250.0.1/30"),
            &backend,
            "b0",
            Some("10.250.0.2/30"),
        );
        add_ipv6(&node, "fd00:10:240::1/64", "n0");
        add_ipv6(&client, "fd00:10:240::2/64", "c0");
        add_ipv6(&node, "fd00:10:250::1/64", "n1");
        add_ipv6(&backend, "fd00:10:250::2/64", "b0");
        client.ip(&["route", "add", "default", "via", NODE_IP]);
        client.ip(&["-6", "route", "add", "default", "via", NODE_IP6]);
        node.sysctl("net.ipv4.ip_forward=1");
        node.sysctl("net.ipv4.conf.all.rp_filter=0");
        node.sysctl("net.ipv4.conf.default.rp_filter=0");
        node.sysctl("net.ipv6.conf.all.forwarding=1");
        node.ip(&["route", "add", ENDPOINT_RANGE, "via", "10.250.0.2"]);
        node.ip(&["-6", "route", "add", ENDPOINT_RANGE6, "via", "fd00:10:250::2"]);
        backend.ip(&["route", "add", "local", ENDPOINT_RANGE, "dev", "lo"]);
        backend.ip(&["-6", "route", "add", "local", ENDPOINT_RANGE6, "dev", "lo"]);
        // A connection to a ClusterIP that nothing translated reaches the backend namespace, where
        // the Service range is local but nothing listens on the Service ports: it is refused at
        // once (a TCP RST). Without this it would be unroutable in the node, and the kernel
        // rate-limits the ICMP errors for that (net.ipv4.route.error_cost, global), so a probe
        // would wait for its connect timeout instead of seeing "not served".
        node.ip(&["route", "add", SERVICE_RANGE, "via", "10.250.0.2"]);
        node.ip(&["-6", "route", "add", SERVICE_RANGE6, "via", "fd00:10:250::2"]);
        backend.ip(&["route", "add", "local", SERVICE_RANGE, "dev", "lo"]);
        backend.ip(&["-6", "route", "add", "local", SERVICE_RANGE6, "dev", "lo"]);
        backend.ip(&["route", "add", "default", "via", "10.250.0.1"]);
        backend.ip(&["-6", "route", "add", "default", "via", "fd00:10:250::1"]);
        let server = crr::start_server(Place::netns(&backend), &[BACKEND_PORT]);
        let forward = PortForward::start(&node, api, api);
        Topo {
            _server: server,
            _forward: forward,
            client,
            node,
            _backend: backend,
        }
    }

    /// An HTTP GET inside the node namespace (kube-proxy's and the agent's /metrics).
    pub fn http_get(&self, addr: &str, path: &str) -> Option<String> {
        use std::io::{Read, Write};
        let addr: SocketAddr = addr.parse().ok()?;
        self.node.run(|| {
            let mut s =
                std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(2)).ok()?;
            s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
                .ok()?;
            write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
            let mut body = String::new();
            s.read_to_string(&mut body).ok()?;
            let (head, rest) = body.split_once("\r\n\r\n")?;
            head.starts_with("HTTP/1.1 200")
                .then(|| rest.to_string())
                .or_else(|| head.starts_with("HTTP/1.0 200").then(|| rest.to_string()))
        })
    }
}
