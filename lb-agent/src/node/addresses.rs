//! This node's interface addresses (both families) and whether it has IPv6, and which addresses
//! serve NodePorts (`--nodeport-addresses`, with kube-proxy's semantics: CIDRs of either family
//! plus the keywords `primary`, `localhost` and `all`; unset means every local address, as in
//! kube-proxy's iptables mode, IPv4 localhost included).

use std::{
    net::{IpAddr, Ipv4Addr},
    str::FromStr,
};

use ipnet::IpNet;

use crate::family::{IpFamily, PerFamily};

/// One entry of `--nodeport-addresses`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddress {
    /// A CIDR of either family.
    Cidr(IpNet),
    /// The node's primary IPs, one per family (from the Node object, or `--bind-address`).
    Primary,
    /// 127.0.0.0/8 (kube-proxy serves localhost NodePorts on IPv4 only).
    Localhost,
    /// Every local address.
    All,
}

impl FromStr for NodePortAddress {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "primary" => Ok(NodePortAddress::Primary),
            "localhost" => Ok(NodePortAddress::Localhost),
            "all" => Ok(NodePortAddress::All),
            cidr => cidr
                .parse::<IpNet>()
                .map(|net| NodePortAddress::Cidr(net.trunc()))
                .map_err(|e| {
                    format!(
                        "--nodeport-addresses: {cidr:?} is neither a CIDR nor primary/localhost/all ({e})"
                    )
                }),
        }
    }
}

/// Which NodePort addresses a configuration selects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePortSelection {
    /// Non-loopback addresses, both families.
    pub addresses: Vec<IpAddr>,
    /// Whether 127.0.0.1 is selected (kube-proxy's localhost NodePorts; IPv4 only: `::1` never
    /// serves NodePorts).
    pub loopback: bool,
}

/// Applies `--nodeport-addresses` to the node's local addresses. `primary` are the node's primary
/// IPs; an empty `config` means `all` (kube-proxy iptables mode's default). As kube-proxy, each
/// family gets only its own entries (`NewNodePortAddresses`), and a family left with none serves
/// NodePorts on all its addresses.
pub fn select_nodeport_addresses(
    config: &[NodePortAddress],
    local: &[IpAddr],
    primary: &[IpAddr],
) -> NodePortSelection {
    // The entries of `family` once kube-proxy has expanded the keywords
    // (`expandNodePortAddressKeywords`: `primary` skips a family without a node IP).
    let has_entries = |family: IpFamily| {
        config.iter().any(|entry| match entry {
            NodePortAddress::Cidr(net) => IpFamily::of_net(net) == family,
            NodePortAddress::Primary => primary
                .iter()
                .any(|ip| IpFamily::of(ip) == family && !ip.is_loopback()),
            NodePortAddress::Localhost | NodePortAddress::All => true,
        })
    };
    let all = PerFamily::from_fn(|family| config.contains(&NodePortAddress::All) || !has_entries(family));
    // Every address of the family, but IPv6 link-local ones: every interface has one (each pod's
    // host-side veth), so serving NodePorts on them would multiply the frontends by the number
    // of interfaces, for addresses no client outside the link can name. A CIDR selects them.
    let selected = |ip: &IpAddr| {
        (*all.get(IpFamily::of(ip)) && !is_ipv6_link_local(ip))
            || config.iter().any(|entry| match entry {
                NodePortAddress::Cidr(net) => net.contains(ip),
                NodePortAddress::Primary => primary.contains(ip),
                NodePortAddress::Localhost => ip.is_loopback() && ip.is_ipv4(),
                NodePortAddress::All => true,
            })
    };
    let mut addresses: Vec<IpAddr> = local
        .iter()
        .filter(|ip| !ip.is_loopback() && selected(ip))
        .copied()
        .collect();
    // A primary IP not (yet) on an interface still counts when selected by `primary`.
    for ip in primary {
        if config.contains(&NodePortAddress::Primary) && !addresses.contains(ip) {
            addresses.push(*ip);
        }
    }
    addresses.sort();
    addresses.dedup();
    let loopback = selected(&IpAddr::V4(Ipv4Addr::LOCALHOST));
    NodePortSelection { addresses, loopback }
}

/// `fe80::/10`.
fn is_ipv6_link_local(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

/// The node's own addresses an endpoint may have (`NodeContext::host_addresses`): its node IPs,
/// and its interfaces' addresses but loopback and link-local ones; sorted and distinct.
pub fn host_addresses(addresses: &[IpAddr], node_ips: &[IpAddr]) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = addresses
        .iter()
        .chain(node_ips)
        .copied()
        .filter(|ip| {
            !ip.is_loopback()
                && !ip.is_unspecified()
                && !is_ipv6_link_local(ip)
                && !matches!(ip, IpAddr::V4(v4) if v4.is_link_local())
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// What this node's own network says: its interface addresses (both families) and whether it
/// has IPv6 at all (`net.ipv6.conf.all.disable_ipv6`, or no IPv6 in the kernel).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalNetwork {
    pub addresses: Vec<IpAddr>,
    pub ipv6_disabled: bool,
    /// Every link: the interface detectors' pod interfaces and the tc attachment read them.
    pub links: Vec<super::Link>,
    /// Every interface's addresses with their prefixes and flags (for the masquerade addresses).
    pub interface_addresses: Vec<super::masquerade::InterfaceAddress>,
}

/// Whether this network namespace has no IPv6: a kernel without IPv6 has no such file; one with
/// IPv6 turned off says 1.
pub fn ipv6_disabled() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/disable_ipv6").map_or(true, |v| v.trim() == "1")
}

/// This network namespace's addresses (per interface, from one RTM_GETADDR dump), its links
/// (one RTM_GETLINK dump) and its IPv6 state: what a sync reads of the node's own network.
pub fn local_network() -> std::io::Result<LocalNetwork> {
    let interface_addresses = super::masquerade::interface_addresses()?;
    let mut addresses: Vec<IpAddr> = interface_addresses.iter().map(|a| a.net.addr()).collect();
    addresses.sort();
    addresses.dedup();
    Ok(LocalNetwork {
        addresses,
        ipv6_disabled: ipv6_disabled(),
        links: super::interfaces::links()?,
        interface_addresses,
    })
}

/// The node's network as last dumped ([`local_network`]), dumped anew only when the link watcher
/// saw an event since, when no watcher runs, or when the caller asks. The two dumps cost about
/// 0.4 ms per sync (measured in the benchmark's node namespace), which a sync for one changed
/// Service would otherwise spend before its first map write.
#[derive(Debug, Default)]
pub struct LocalNetworkCache {
    events: super::interfaces::LinkEvents,
    /// The last dump and the watcher's event count just before it (`None` without a watcher).
    last: Option<(Option<u64>, LocalNetwork)>,
}

impl LocalNetworkCache {
    pub fn new(events: super::interfaces::LinkEvents) -> Self {
        Self { events, last: None }
    }

    /// The node's network now: the last dump when no event came since it and `refresh` is false.
    pub fn read(&mut self, refresh: bool) -> std::io::Result<&LocalNetwork> {
        // Read before the dump: an event during it leaves the count ahead, so the next read dumps.
        let generation = self.events.generation();
        let current = matches!(&self.last, Some((Some(then), _)) if !refresh && generation == Some(*then));
        if !current {
            self.last = Some((generation, local_network()?));
        }
        Ok(&self.last.as_ref().expect("dumped above").1)
    }

    /// The links of the last dump (none before the first).
    pub fn links(&self) -> &[super::Link] {
        self.last.as_ref().map_or(&[], |(_, local)| &local.links)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn parse(list: &[&str]) -> Vec<NodePortAddress> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn parses_keywords_and_cidrs() {
        assert_eq!("primary".parse(), Ok(NodePortAddress::Primary));
        assert_eq!(" localhost ".parse(), Ok(NodePortAddress::Localhost));
        assert_eq!(
            "10.0.0.0/8".parse(),
            Ok(NodePortAddress::Cidr("10.0.0.0/8".parse().unwrap()))
        );
        assert!("bogus".parse::<NodePortAddress>().is_err());
    }

    #[test]
    fn default_is_every_local_address_including_loopback() {
        let local = [ip("127.0.0.1"), ip("192.168.1.10"), ip("10.244.0.1")];
        let sel = select_nodeport_addresses(&[], &local, &[ip("192.168.1.10")]);
        assert_eq!(sel.addresses, vec![ip("10.244.0.1"), ip("192.168.1.10")]);
        assert!(sel.loopback);
    }

    #[test]
    fn primary_selects_the_node_ip_only() {
        let local = [ip("127.0.0.1"), ip("192.168.1.10"), ip("10.244.0.1")];
        let sel = select_nodeport_addresses(&parse(&["primary"]), &local, &[ip("192.168.1.10")]);
        assert_eq!(sel.addresses, vec![ip("192.168.1.10")]);
        assert!(
            !sel.loopback,
            "localhost NodePorts need loopback in --nodeport-addresses"
        );
    }

    #[test]
    fn cidrs_and_localhost() {
        let local = [ip("127.0.0.1"), ip("192.168.1.10"), ip("10.244.0.1")];
        let sel = select_nodeport_addresses(&parse(&["192.168.0.0/16", "127.0.0.0/8"]), &local, &[]);
        assert_eq!(sel.addresses, vec![ip("192.168.1.10")]);
        assert!(sel.loopback);
        let sel = select_nodeport_addresses(&parse(&["localhost"]), &local, &[]);
        assert!(sel.addresses.is_empty());
        assert!(sel.loopback);
    }

    #[test]
    fn both_families() {
        let local = [
            ip("127.0.0.1"),
            ip("::1"),
            ip("192.168.1.10"),
            ip("2001:db8::10"),
            ip("fd00:10:244::1"),
        ];
        let primary = [ip("192.168.1.10"), ip("2001:db8::10")];
        let sel = select_nodeport_addresses(&[], &local, &primary);
        assert_eq!(
            sel.addresses,
            vec![ip("192.168.1.10"), ip("2001:db8::10"), ip("fd00:10:244::1")]
        );
        assert!(sel.loopback, "127.0.0.1; ::1 never serves NodePorts");
        let sel = select_nodeport_addresses(&parse(&["primary"]), &local, &primary);
        assert_eq!(sel.addresses, vec![ip("192.168.1.10"), ip("2001:db8::10")]);
        let sel = select_nodeport_addresses(&parse(&["2001:db8::/64", "192.168.0.0/16"]), &local, &primary);
        assert_eq!(sel.addresses, vec![ip("192.168.1.10"), ip("2001:db8::10")]);
        assert!(!sel.loopback);
        assert_eq!(
            "2001:db8::1/64".parse(),
            Ok(NodePortAddress::Cidr("2001:db8::/64".parse().unwrap()))
        );
    }

    /// kube-proxy `NewNodePortAddresses`: each family's proxier gets that family's entries only,
    /// and one left with none falls back to the zero CIDR (every address, IPv4 loopback included).
    #[test]
    fn a_family_without_entries_serves_every_address_of_it() {
        let local = [
            ip("127.0.0.1"),
            ip("::1"),
            ip("192.168.1.10"),
            ip("10.244.0.1"),
            ip("2001:db8::10"),
            ip("fd00:10:244::1"),
        ];
        // IPv4 CIDRs only: every IPv6 address.
        let sel = select_nodeport_addresses(&parse(&["192.168.0.0/16"]), &local, &[]);
        assert_eq!(
            sel.addresses,
            vec![ip("192.168.1.10"), ip("2001:db8::10"), ip("fd00:10:244::1")]
        );
        assert!(!sel.loopback);
        // IPv6 CIDRs only: every IPv4 address, and 127.0.0.1.
        let sel = select_nodeport_addresses(&parse(&["2001:db8::/64"]), &local, &[]);
        assert_eq!(
            sel.addresses,
            vec![ip("10.244.0.1"), ip("192.168.1.10"), ip("2001:db8::10")]
        );
        assert!(sel.loopback);
        // `primary` of a node without an IPv6 node IP expands to the IPv4 one only.
        let sel = select_nodeport_addresses(&parse(&["primary"]), &local, &[ip("192.168.1.10")]);
        assert_eq!(
            sel.addresses,
            vec![ip("192.168.1.10"), ip("2001:db8::10"), ip("fd00:10:244::1")]
        );
        // `localhost` is 127.0.0.0/8 and ::1/128: both families have an entry, and ::1 never
        // serves NodePorts.
        let sel = select_nodeport_addresses(&parse(&["localhost"]), &local, &[]);
        assert!(sel.addresses.is_empty());
        assert!(sel.loopback);
    }

    /// The cache dumps anew after an event, when asked, and at every read without a watcher; it
    /// reuses the last dump otherwise (root only: in a network namespace of the test's own).
    #[test]
    fn the_cache_dumps_after_an_event_or_when_asked() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root for a network namespace of its own");
            return;
        }
        std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
            let add = |addr: &str| {
                let status = std::process::Command::new("ip")
                    .args(["addr", "add", addr, "dev", "lo"])
                    .status()
                    .expect("ip addr add");
                assert!(status.success(), "ip addr add {addr}");
            };
            let has = |local: &LocalNetwork, addr: &str| local.addresses.contains(&ip(addr));

            // No watcher: every read is a dump.
            let mut unwatched = LocalNetworkCache::default();
            assert!(!has(unwatched.read(false).unwrap(), "10.9.0.1"));
            add("10.9.0.1/32");
            assert!(has(unwatched.read(false).unwrap(), "10.9.0.1"));

            // Events counted by hand: no event, the last dump.
            let events = super::super::interfaces::LinkEvents::by_hand();
            let mut cache = LocalNetworkCache::new(events.clone());
            assert!(has(cache.read(false).unwrap(), "10.9.0.1"));
            add("10.9.0.2/32");
            assert!(!has(cache.read(false).unwrap(), "10.9.0.2"), "reused");
            // Asked to: a dump.
            assert!(has(cache.read(true).unwrap(), "10.9.0.2"));
            add("10.9.0.3/32");
            assert!(!has(cache.read(false).unwrap(), "10.9.0.3"), "reused");
            // After an event: a dump.
            events.count_one();
            assert!(has(cache.read(false).unwrap(), "10.9.0.3"));
        })
        .join()
        .expect("the namespace's thread");
    }
}
