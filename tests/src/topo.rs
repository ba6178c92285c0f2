//! Small cluster topologies in network namespaces, wired like the CNI `ptp` plugin: each pod has
//! its own veth, the node side of every pod veth carries the node's pod-gateway address
//! (`10.244.<node>.1/32`), and the node routes each pod's /32 to its veth. All traffic between pods
//! therefore crosses the node's IP stack (and its tc hooks), as with Calico or Cilium.
//!
//! Nodes can get an uplink to a shared "LAN" namespace (a bridge) where external clients live,
//! with routes to every other node's pod CIDR, so pods on different nodes reach each other.

use std::net::Ipv4Addr;

use crate::{netns::NetNs, unique_name};

/// The LAN the nodes and external clients share: 192.168.50.0/24 on a bridge in its own namespace.
pub struct Lan {
    pub ns: NetNs,
    next_port: std::cell::Cell<u32>,
}

impl Lan {
    pub fn new() -> Lan {
        let ns = NetNs::new("lblan");
        ns.ip(&["link", "add", "br0", "type", "bridge"]);
        ns.ip(&["link", "set", "br0", "up"]);
        Lan {
            ns,
            next_port: std::cell::Cell::new(0),
        }
    }

    /// Connects `ns` to the LAN: `dev` inside `ns` gets `addr` (CIDR notation).
    pub fn attach(&self, ns: &NetNs, dev: &str, addr: &str) {
        let n = self.next_port.get();
        self.next_port.set(n + 1);
        let port = format!("lp{n}");
        crate::netns::veth(&self.ns, &port, None, ns, dev, Some(addr));
        self.ns.ip(&["link", "set", &port, "master", "br0"]);
    }
}

impl Default for Lan {
    fn default() -> Self {
        Self::new()
    }
}

/// A pod: its namespace and address.
pub struct Pod {
    pub ns: NetNs,
    pub ip: Ipv4Addr,
    /// The node-side veth.
    pub host_dev: String,
}

/// A node: its namespace, its index (which names its pod CIDR 10.244.<index>.0/24) and pods.
pub struct Node {
    pub ns: NetNs,
    pub index: u8,
    pub pods: Vec<Pod>,
    /// The node's LAN address, once attached.
    pub ip: Option<Ipv4Addr>,
}

impl Node {
    pub fn new(index: u8) -> Node {
        let ns = NetNs::new("lbnode");
        ns.sysctl("net.ipv4.ip_forward=1");
        // Replies from pods on other nodes come back on the uplink: no reverse-path surprises.
        ns.sysctl("net.ipv4.conf.all.rp_filter=0");
        ns.sysctl("net.ipv4.conf.default.rp_filter=0");
        Node {
            ns,
            index,
            pods: Vec::new(),
            ip: None,
        }
    }

    /// The pod gateway address on every pod veth.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 244, self.index, 1)
    }

    pub fn pod_cidr(&self) -> String {
        format!("10.244.{}.0/24", self.index)
    }

    /// Adds pod number `n` (address 10.244.<node>.<n>, n >= 2).
    pub fn add_pod(&mut self, n: u8) -> &Pod {
        assert!(n >= 2, "10.244.x.1 is the gateway");
        let ns = NetNs::new("lbpod");
        let ip = Ipv4Addr::new(10, 244, self.index, n);
        let host_dev = unique_name("vp");
        self.ns.ip(&[
            "link",
            "add",
            &host_dev,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns.name(),
        ]);
        let gw = self.gateway().to_string();
        self.ns
            .ip(&["addr", "add", &format!("{gw}/32"), "dev", &host_dev]);
        self.ns.ip(&["link", "set", &host_dev, "up"]);
        self.ns
            .ip(&["route", "add", &format!("{ip}/32"), "dev", &host_dev]);
        ns.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"]);
        ns.ip(&["link", "set", "eth0", "up"]);
        ns.ip(&[
            "route",
            "add",
            &format!("{gw}/32"),
            "dev",
            "eth0",
            "scope",
            "link",
        ]);
        ns.ip(&["route", "add", "default", "via", &gw, "dev", "eth0"]);
        self.pods.push(Pod { ns, ip, host_dev });
        self.pods.last().expect("just pushed")
    }

    /// Attaches the node to the LAN as 192.168.50.<10 + index>, device `eth0`.
    pub fn attach_lan(&mut self, lan: &Lan) -> Ipv4Addr {
        let ip = Ipv4Addr::new(192, 168, 50, 10 + self.index);
        lan.attach(&self.ns, "eth0", &format!("{ip}/24"));
        self.ip = Some(ip);
        ip
    }

    /// Routes another node's pod CIDR through that node's LAN address.
    pub fn route_to(&self, other: &Node) {
        let via = other
            .ip
            .expect("attach the other node to the LAN first")
            .to_string();
        self.ns.ip(&["route", "add", &other.pod_cidr(), "via", &via]);
    }
}

/// An external client on the LAN (192.168.50.<100 + n>), with routes to the pod CIDRs via their
/// nodes when asked.
pub fn external_client(lan: &Lan, n: u8) -> (NetNs, Ipv4Addr) {
    let ns = NetNs::new("lbext");
    let ip = Ipv4Addr::new(192, 168, 50, 100 + n);
    lan.attach(&ns, "eth0", &format!("{ip}/24"));
    (ns, ip)
}
