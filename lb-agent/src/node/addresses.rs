//! This node's interface addresses, and which of them serve NodePorts (`--nodeport-addresses`,
//! with kube-proxy's semantics: CIDRs plus the keywords `primary`, `localhost` and `all`; unset
//! means every local address, as in kube-proxy's iptables mode, localhost included).

use std::{net::Ipv4Addr, str::FromStr};

use ipnet::Ipv4Net;

/// One entry of `--nodeport-addresses`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddress {
    Cidr(Ipv4Net),
    /// The node's primary IPs (from the Node object, or `--bind-address`).
    Primary,
    /// 127.0.0.0/8.
    Localhost,
    /// Every local address.
    All,
    /// A CIDR of the other family: valid, but the IPv4 data path has nothing to serve on it.
    Ipv6(ipnet::Ipv6Net),
}

impl FromStr for NodePortAddress {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "primary" => Ok(NodePortAddress::Primary),
            "localhost" => Ok(NodePortAddress::Localhost),
            "all" => Ok(NodePortAddress::All),
            cidr => {
                if let Ok(v6) = cidr.parse::<ipnet::Ipv6Net>() {
                    return Ok(NodePortAddress::Ipv6(v6));
                }
                cidr.parse::<Ipv4Net>().map(NodePortAddress::Cidr).map_err(|e| {
                    format!(
                        "--nodeport-addresses: {cidr:?} is neither a CIDR nor primary/localhost/all ({e})"
                    )
                })
            }
        }
    }
}

/// Which NodePort addresses a configuration selects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePortSelection {
    /// Non-loopback addresses.
    pub addresses: Vec<Ipv4Addr>,
    /// Whether 127.0.0.1 is selected (kube-proxy's localhost NodePorts).
    pub loopback: bool,
}

/// Applies `--nodeport-addresses` to the node's local addresses. `primary` are the node's primary
/// IPs; an empty `config` means `all` (kube-proxy iptables mode's default).
pub fn select_nodeport_addresses(
    config: &[NodePortAddress],
    local: &[Ipv4Addr],
    primary: &[Ipv4Addr],
) -> NodePortSelection {
    let all = config.is_empty() || config.contains(&NodePortAddress::All);
    let selected = |ip: &Ipv4Addr| {
        all || config.iter().any(|entry| match entry {
            NodePortAddress::Cidr(net) => net.contains(ip),
            NodePortAddress::Primary => primary.contains(ip),
            NodePortAddress::Localhost => ip.is_loopback(),
            NodePortAddress::All => true,
            NodePortAddress::Ipv6(_) => false,
        })
    };
    let mut addresses: Vec<Ipv4Addr> = local
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
    let loopback = selected(&Ipv4Addr::LOCALHOST);
    NodePortSelection { addresses, loopback }
}

/// IPv4 addresses on this network namespace's interfaces.
pub fn local_addresses() -> std::io::Result<Vec<Ipv4Addr>> {
    let mut out = Vec::new();
    for ifaddr in nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)? {
        if let Some(addr) = ifaddr.address.as_ref().and_then(|a| a.as_sockaddr_in()) {
            out.push(addr.ip());
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Ipv4Addr {
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
}
