//! One benchmark topology (reference §7.2 / §8(a)), made fresh for every configuration:
//!
//! ```text
//!  client netns                node netns (the proxy runs here)          backend netns
//!  c0 10.240.0.2/24 ──veth── n0 10.240.0.1/24   n1 10.250.0.1/30 ──veth── b0 10.250.0.2/30
//!  default via 10.240.0.1     10.128.0.0/12 via 10.250.0.2                 local 10.128.0.0/12 dev lo
//!                             10.96.0.0/16 via 10.250.0.2                  local 10.96.0.0/16 dev lo
//!                                                                          accept-and-close server on
//!                                                                          :8080, pinned to CPU 0
//! ```
//!
//! A connection to a ClusterIP that no proxy translated is refused by the backend namespace (the
//! Service range is local there, nothing listens on the Service ports), so "not served" shows
//! at once (an unroutable ClusterIP would instead get ICMP errors, which the kernel rate-limits
//! globally, and a probe would wait for its connect timeout).
//!
//! The endpoint range is AnyIP in the backend namespace, so one server answers every endpoint IP.
//! The API server (host loopback) is forwarded into the node namespace at the same address.

use std::net::SocketAddr;

use lb_tests::{
    netns::{NetNs, PortForward, veth},
    process::{Place, Proc},
};

use super::crr;

pub const CLIENT_IP: &str = "10.240.0.2";
pub const NODE_IP: &str = "10.240.0.1";
/// Every endpoint IP of the benchmark lies here (AnyIP in the backend namespace).
pub const ENDPOINT_RANGE: &str = "10.128.0.0/12";
/// The cluster CIDR given to every proxy: it holds the client (and the endpoints), so the client
/// is an in-cluster pod and no configuration masquerades.
pub const CLUSTER_CIDR: &str = "10.128.0.0/9";
pub const BACKEND_PORT: u16 = 8080;
/// The API server's Service CIDR (the ClusterIPs).
pub const SERVICE_RANGE: &str = lb_tests::control_plane::SERVICE_CIDR;

pub struct Topo {
    // Dropped first: processes before the namespaces they live in.
    _server: Proc,
    _forward: PortForward,
    pub client: NetNs,
    pub node: NetNs,
    _backend: NetNs,
}

impl Topo {
    pub fn new(api: SocketAddr) -> Topo {
        let client = NetNs::new("bc");
        let node = NetNs::new("bn");
        let backend = NetNs::new("bs");
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
        client.ip(&["route", "add", "default", "via", NODE_IP]);
        node.sysctl("net.ipv4.ip_forward=1");
        node.sysctl("net.ipv4.conf.all.rp_filter=0");
        node.sysctl("net.ipv4.conf.default.rp_filter=0");
        node.ip(&["route", "add", ENDPOINT_RANGE, "via", "10.250.0.2"]);
        backend.ip(&["route", "add", "local", ENDPOINT_RANGE, "dev", "lo"]);
        // A connection to a ClusterIP that nothing translated reaches the backend namespace, where
        // the Service range is local but nothing listens on the Service ports: it is refused at
        // once (a TCP RST). Without this it would be unroutable in the node, and the kernel
        // rate-limits the ICMP errors for that (net.ipv4.route.error_cost, global), so a probe
        // would wait for its connect timeout instead of seeing "not served".
        node.ip(&["route", "add", SERVICE_RANGE, "via", "10.250.0.2"]);
        backend.ip(&["route", "add", "local", SERVICE_RANGE, "dev", "lo"]);
        backend.ip(&["route", "add", "default", "via", "10.250.0.1"]);
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
