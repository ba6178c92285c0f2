//! Small cluster topologies in network namespaces, wired like the CNI `ptp` plugin: each pod has
//! its own veth, the node side of every pod veth carries the node's pod-gateway address
//! (`10.244.<node>.1/32`), and the node routes each pod's /32 to its veth. All traffic between pods
//! therefore crosses the node's IP stack (and its tc hooks), as with Calico or Cilium.
//!
//! Nodes can get an uplink to a shared "LAN" namespace (a bridge) where external clients live,
//! with routes to every other node's pod CIDR, so pods on different nodes reach each other.
//!
//! A dual-stack node ([`Node::dual_stack`]) does the same in IPv6 alongside: every IPv4 address
//! `10.244.<node>.<n>` has its twin `fd00:10:244:<node>::<n>`, the LAN `192.168.50.0/24` has
//! `fd00:192:168:50::/64`. IPv6 addresses are added with `nodad`, so they are usable at once
//! (a tentative address can be neither bound nor used as a source).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use lb_agent::family::IpFamily;

use crate::{netns::NetNs, unique_name};

/// The IPv6 twin of an IPv4 address of the topology: `10.244.1.2` -> `fd00:10:244:1::2`,
/// `192.168.50.11` -> `fd00:192:168:50::11` (each decimal octet written as a hex group, so the
/// two read alike).
pub fn ipv6_twin(v4: Ipv4Addr) -> Ipv6Addr {
    let [a, b, c, d] = v4
        .octets()
        .map(|o| u16::from_str_radix(&o.to_string(), 16).expect("decimal digits are hex digits"));
    Ipv6Addr::new(0xfd00, a, b, c, 0, 0, 0, d)
}

/// Adds an IPv6 address (CIDR notation) to `dev` in `ns`, usable at once (no duplicate address
/// detection).
fn add_ipv6(ns: &NetNs, addr: &str, dev: &str) {
    ns.ip(&["-6", "addr", "add", addr, "dev", dev, "nodad"]);
}

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

/// A pod: its namespace and address(es).
pub struct Pod {
    pub ns: NetNs,
    pub ip: Ipv4Addr,
    /// Its IPv6 address, on a dual-stack node.
    pub ip6: Option<Ipv6Addr>,
    /// The node-side veth.
    pub host_dev: String,
}

impl Pod {
    /// The pod's address of `family` (panics for IPv6 on a single-stack node).
    pub fn addr(&self, family: IpFamily) -> IpAddr {
        match family {
            IpFamily::V4 => self.ip.into(),
            IpFamily::V6 => self
                .ip6
                .expect("an IPv6 pod address: use Node::dual_stack")
                .into(),
        }
    }
}

/// A node: its namespace, its index (which names its pod CIDR 10.244.<index>.0/24) and pods.
pub struct Node {
    pub ns: NetNs,
    pub index: u8,
    pub pods: Vec<Pod>,
    /// The node's LAN address, once attached.
    pub ip: Option<Ipv4Addr>,
    /// Whether pods and the LAN address get IPv6 twins.
    pub dual_stack: bool,
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
            dual_stack: false,
        }
    }

    /// A node whose pods and uplink have an IPv6 address too (see the module's notes).
    pub fn dual_stack(index: u8) -> Node {
        let mut node = Node::new(index);
        node.ns.sysctl("net.ipv6.conf.all.forwarding=1");
        node.dual_stack = true;
        node
    }

    /// The pod gateway address on every pod veth.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 244, self.index, 1)
    }

    /// The pod gateway address of `family`.
    pub fn gateway_of(&self, family: IpFamily) -> IpAddr {
        match family {
            IpFamily::V4 => self.gateway().into(),
            IpFamily::V6 => ipv6_twin(self.gateway()).into(),
        }
    }

    /// The node's LAN address of `family`, once attached (IPv6 on a dual-stack node only).
    pub fn addr(&self, family: IpFamily) -> Option<IpAddr> {
        let ip = self.ip?;
        match family {
            IpFamily::V4 => Some(ip.into()),
            IpFamily::V6 => self.dual_stack.then(|| ipv6_twin(ip).into()),
        }
    }

    pub fn pod_cidr(&self) -> String {
        format!("10.244.{}.0/24", self.index)
    }

    /// Adds pod number `n` (address 10.244.<node>.<n>, n >= 2).
    pub fn add_pod(&mut self, n: u8) -> &Pod {
        self.add_pod_wired(n, "vp", None)
    }

    /// Adds a bridge for pods, named `prefix`..., up and holding the gateway address (IPv4
    /// only); returns its name. Pods join it with [`Self::add_pod_wired`].
    pub fn add_bridge(&self, prefix: &str) -> String {
        assert!(!self.dual_stack, "bridged pods are IPv4 only here");
        let bridge = unique_name(prefix);
        self.ns.ip(&["link", "add", &bridge, "type", "bridge"]);
        self.ns.ip(&["link", "set", &bridge, "up"]);
        let gw = self.gateway().to_string();
        self.ns.ip(&["addr", "add", &format!("{gw}/32"), "dev", &bridge]);
        bridge
    }

    /// Adds pod `n` whose node-side veth is named `dev_prefix`..., as a port of `bridge` (from
    /// [`Self::add_bridge`]) when given, else routed to on its own veth.
    pub fn add_pod_wired(&mut self, n: u8, dev_prefix: &str, bridge: Option<&str>) -> &Pod {
        assert!(n >= 2, "10.244.x.1 is the gateway");
        let ns = NetNs::new("lbpod");
        let ip = Ipv4Addr::new(10, 244, self.index, n);
        let host_dev = unique_name(dev_prefix);
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
        if let Some(bridge) = bridge {
            self.ns.ip(&["link", "set", &host_dev, "master", bridge]);
            self.ns.ip(&["link", "set", &host_dev, "up"]);
            self.ns.ip(&["route", "add", &format!("{ip}/32"), "dev", bridge]);
        } else {
            self.ns
                .ip(&["addr", "add", &format!("{gw}/32"), "dev", &host_dev]);
            self.ns.ip(&["link", "set", &host_dev, "up"]);
            self.ns
                .ip(&["route", "add", &format!("{ip}/32"), "dev", &host_dev]);
        }
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
        let ip6 = self.dual_stack.then(|| ipv6_twin(ip));
        if let Some(ip6) = ip6 {
            // The same wiring in IPv6: the gateway's twin on the node side, the pod's /128.
            let gw6 = ipv6_twin(self.gateway()).to_string();
            add_ipv6(&self.ns, &format!("{gw6}/128"), &host_dev);
            self.ns
                .ip(&["-6", "route", "add", &format!("{ip6}/128"), "dev", &host_dev]);
            add_ipv6(&ns, &format!("{ip6}/128"), "eth0");
            ns.ip(&["-6", "route", "add", &format!("{gw6}/128"), "dev", "eth0"]);
            ns.ip(&["-6", "route", "add", "default", "via", &gw6, "dev", "eth0"]);
        }
        self.pods.push(Pod {
            ns,
            ip,
            ip6,
            host_dev,
        });
        self.pods.last().expect("just pushed")
    }

    /// Attaches the node to the LAN as 192.168.50.<10 + index>, device `eth0`.
    pub fn attach_lan(&mut self, lan: &Lan) -> Ipv4Addr {
        let ip = Ipv4Addr::new(192, 168, 50, 10 + self.index);
        lan.attach(&self.ns, "eth0", &format!("{ip}/24"));
        if self.dual_stack {
            add_ipv6(&self.ns, &format!("{}/64", ipv6_twin(ip)), "eth0");
        }
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
        if let (Some(via6), true) = (other.addr(IpFamily::V6), self.dual_stack) {
            let cidr6 = format!("{}/64", ipv6_twin(Ipv4Addr::new(10, 244, other.index, 0)));
            self.ns
                .ip(&["-6", "route", "add", &cidr6, "via", &via6.to_string()]);
        }
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
