//! The addresses MASQUERADE would give a flow leaving by each of the node's interfaces
//! (`lb_masq_addrs`): every interface's addresses from one RTM_GETADDR dump, kube-proxy's
//! MASQUERADE rules applied to them (`masquerade_candidates`), and the map's entries with the
//! fallback at key 0 (`masquerade_entries`). The tc path looks the flow's route up and takes its
//! interface's address; a node with several uplinks on different subnets thus masquerades through
//! each with its own address, as MASQUERADE does. The masquerade ports are checked against the
//! node's ephemeral ports at start (`warn_if_ephemeral_overlap`).

use std::{collections::BTreeMap, io, net::IpAddr};

use ipnet::IpNet;
use lb_common::config::{
    FamilySettings, InterfaceAddr, InterfaceAddrs, MASQUERADE_FALLBACK, MAX_INTERFACE_ADDRS, MasqueradeAddrs,
};
use netlink_packet_core::NLM_F_DUMP;
use netlink_packet_route::{
    RouteNetlinkMessage,
    address::{AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage, AddressScope},
};
use netlink_sys::protocols::NETLINK_ROUTE;

use crate::family::{IpFamily, KernelFamily, PerFamily};

/// One address of one interface, as RTM_GETADDR lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceAddress {
    pub ifindex: u32,
    /// The address and its prefix length.
    pub net: IpNet,
    /// Scope universe (global): the only addresses MASQUERADE takes.
    pub universe: bool,
    /// An IPv4 secondary address (another in the same subnet came first): never taken.
    pub secondary: bool,
    /// An IPv6 address not usable yet or any more (tentative, DAD failed): never taken.
    pub unusable: bool,
    /// An IPv6 address past its preferred lifetime: taken only when there is no other.
    pub deprecated: bool,
}

impl InterfaceAddress {
    /// A usable address of universe scope (what most interfaces have).
    pub fn universe(ifindex: u32, net: IpNet) -> Self {
        InterfaceAddress {
            ifindex,
            net,
            universe: true,
            secondary: false,
            unusable: false,
            deprecated: false,
        }
    }
}

/// Every address of this network namespace's interfaces, in the kernel's order (per interface,
/// the order they were added; IPv4 primaries before their secondaries).
pub fn interface_addresses() -> io::Result<Vec<InterfaceAddress>> {
    let socket = crate::netlink::socket(NETLINK_ROUTE)?;
    let mut out = Vec::new();
    let request = RouteNetlinkMessage::GetAddress(AddressMessage::default());
    crate::netlink::request(&socket, request, NLM_F_DUMP, |answer| {
        let RouteNetlinkMessage::NewAddress(message) = answer else {
            return;
        };
        let (mut address, mut local) = (None, None);
        let mut flags = AddressFlags::from_bits_truncate(message.header.flags.bits().into());
        for attribute in message.attributes {
            match attribute {
                AddressAttribute::Address(ip) => address = Some(ip),
                AddressAttribute::Local(ip) => local = Some(ip),
                // The full set: the header has only the low 8 bits.
                AddressAttribute::Flags(all) => flags = all,
                _ => {}
            }
        }
        // IPv4's own address is IFA_LOCAL (IFA_ADDRESS is the peer's on a point-to-point link).
        let Some(ip) = local.or(address) else {
            return;
        };
        let Ok(net) = IpNet::new(ip, message.header.prefix_len) else {
            return;
        };
        let header = message.header.flags;
        out.push(InterfaceAddress {
            ifindex: message.header.index,
            net,
            universe: message.header.scope == AddressScope::Universe,
            secondary: header.contains(AddressHeaderFlags::Secondary)
                || flags.contains(AddressFlags::Secondary),
            unusable: flags.intersects(AddressFlags::Tentative | AddressFlags::Dadfailed),
            deprecated: flags.contains(AddressFlags::Deprecated),
        });
    })?;
    Ok(out)
}

/// MASQUERADE's candidates on each interface, per family in the order the kernel considers them,
/// at most [`MAX_INTERFACE_ADDRS`] per family: IPv4's primary addresses of universe scope
/// (`inet_select_addr`), IPv6's global ones that are usable, deprecated ones last (source address
/// selection, RFC 6724 rule 3). Families the node does not serve are left out; interfaces with
/// no candidate are absent.
pub fn masquerade_candidates(
    addresses: &[InterfaceAddress],
    serves: &PerFamily<bool>,
) -> BTreeMap<u32, Vec<IpNet>> {
    let mut out: BTreeMap<u32, Vec<IpNet>> = BTreeMap::new();
    let usable = |a: &&InterfaceAddress| {
        a.universe && !a.secondary && !a.unusable && *serves.get(IpFamily::of(&a.net.addr()))
    };
    // Preferred addresses first, then deprecated ones: a stable partition of the kernel's order.
    for deprecated in [false, true] {
        for a in addresses
            .iter()
            .filter(usable)
            .filter(|a| a.deprecated == deprecated)
        {
            let list = out.entry(a.ifindex).or_default();
            let family = IpFamily::of(&a.net.addr());
            if list.iter().filter(|n| IpFamily::of(&n.addr()) == family).count() < MAX_INTERFACE_ADDRS {
                list.push(a.net);
            }
        }
    }
    out
}

/// `lb_masq_addrs`' entries: each interface's candidates, and at key
/// [`MASQUERADE_FALLBACK`] each family's `fallback` (the node's primary IP of the family: what a
/// flow gets when its interface has no address of its family or its route is unknown; the kernel
/// would take the first universe address of any interface).
pub fn masquerade_entries(
    candidates: &BTreeMap<u32, Vec<IpNet>>,
    fallback: &PerFamily<Option<IpAddr>>,
) -> BTreeMap<u32, MasqueradeAddrs> {
    let mut entries: BTreeMap<u32, MasqueradeAddrs> = candidates
        .iter()
        .filter(|(ifindex, _)| **ifindex != MASQUERADE_FALLBACK)
        .map(|(ifindex, nets)| {
            let mut entry = MasqueradeAddrs::default();
            fill::<lb_common::family::V4>(&mut entry, nets);
            fill::<lb_common::family::V6>(&mut entry, nets);
            (*ifindex, entry)
        })
        .collect();
    let mut fallback_entry = MasqueradeAddrs::default();
    for family in IpFamily::ALL {
        if let Some(ip) = fallback.get(family) {
            let host = IpNet::from(*ip);
            fill::<lb_common::family::V4>(&mut fallback_entry, std::slice::from_ref(&host));
            fill::<lb_common::family::V6>(&mut fallback_entry, std::slice::from_ref(&host));
        }
    }
    entries.insert(MASQUERADE_FALLBACK, fallback_entry);
    entries
}

/// Appends the nets of family `F` among `nets` to `entry`'s part of that family.
fn fill<F: KernelFamily + FamilySettings>(entry: &mut MasqueradeAddrs, nets: &[IpNet]) {
    let out: &mut InterfaceAddrs<F> = F::interface_addrs_mut(entry);
    for net in nets {
        let Some(addr) = F::kernel_addr(&net.addr()) else {
            continue;
        };
        let Some(mask) = F::kernel_addr(&net.netmask()) else {
            continue;
        };
        if usize::from(out.count) < MAX_INTERFACE_ADDRS {
            out.addrs[usize::from(out.count)] = InterfaceAddr {
                addr,
                mask,
                prefix_len: net.prefix_len(),
                _pad: [0; 3],
            };
            out.count += 1;
        }
    }
}

/// Whether any interface masquerades with another address than its family's fallback (the
/// programs then look each new flow's route up: `config::flags::MASQUERADE_BY_INTERFACE`).
pub fn differs_from_fallback(
    candidates: &BTreeMap<u32, Vec<IpNet>>,
    fallback: &PerFamily<Option<IpAddr>>,
) -> bool {
    candidates
        .values()
        .flatten()
        .any(|net| *fallback.get(IpFamily::of(&net.addr())) != Some(net.addr()))
}

/// The masquerade ports (`SNAT_PORT_MIN..=SNAT_PORT_MAX`) that the kernel may also give a local
/// socket (`net.ipv4.ip_local_port_range`, which IPv6 shares), as `(first, last)`; `None` when
/// the ranges are disjoint or the sysctl cannot be read. A node socket connecting from a
/// masquerade address to a backend with such a port would share a 4-tuple, at the backend, with a
/// masqueraded flow (the two never meet in one table here: the tc path's SNAT is not netfilter's).
pub fn ephemeral_overlap(ip_local_port_range: &str) -> Option<(u16, u16)> {
    let mut ports = ip_local_port_range.split_whitespace().map(str::parse::<u16>);
    let (Some(Ok(low)), Some(Ok(high))) = (ports.next(), ports.next()) else {
        return None;
    };
    let (first, last) = (
        low.max(lb_common::config::SNAT_PORT_MIN),
        high.min(lb_common::config::SNAT_PORT_MAX),
    );
    (first <= last).then_some((first, last))
}

/// Warns when the node's ephemeral ports overlap the masquerade ports (see [`ephemeral_overlap`]).
pub fn warn_if_ephemeral_overlap() {
    let path = "/proc/sys/net/ipv4/ip_local_port_range";
    let Ok(range) = std::fs::read_to_string(path) else {
        return;
    };
    if let Some((first, last)) = ephemeral_overlap(&range) {
        tracing::warn!(
            ip_local_port_range = range.trim(),
            "the node's ephemeral ports {first}-{last} are also tc masquerade ports ({}-{}): a node \
             socket and a masqueraded flow to one backend may then share a 4-tuple; move \
             net.ipv4.ip_local_port_range out of that range",
            lb_common::config::SNAT_PORT_MIN,
            lb_common::config::SNAT_PORT_MAX
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ephemeral_ports_overlapping_the_masquerade_ports() {
        assert_eq!(ephemeral_overlap("32768\t60999\n"), None, "the kernel's default");
        assert_eq!(ephemeral_overlap("1024 65535"), Some((20000, 29999)));
        assert_eq!(ephemeral_overlap("25000 40000"), Some((25000, 29999)));
        assert_eq!(ephemeral_overlap("10000 20000"), Some((20000, 20000)));
        assert_eq!(ephemeral_overlap("30000 30100"), None);
        assert_eq!(ephemeral_overlap("garbage"), None);
    }

    fn addr(ifindex: u32, net: &str) -> InterfaceAddress {
        InterfaceAddress::universe(ifindex, net.parse().unwrap())
    }

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().unwrap()).collect()
    }

    const BOTH: PerFamily<bool> = PerFamily { v4: true, v6: true };

    #[test]
    fn masquerade_takes_primary_universe_addresses_in_the_kernels_order() {
        let addresses = vec![
            addr(1, "127.0.0.1/8").with(|a| a.universe = false),
            addr(2, "192.168.50.11/24"),
            addr(2, "192.168.50.12/24").with(|a| a.secondary = true),
            addr(2, "10.0.0.11/8"),
            addr(3, "192.168.60.11/24"),
            addr(3, "fd00:60::11/64"),
            addr(3, "fe80::1/64").with(|a| a.universe = false),
            addr(4, "10.244.1.1/32"),
            addr(5, "fd00:70::1/64").with(|a| a.deprecated = true),
            addr(5, "fd00:71::1/64"),
            addr(5, "fd00:72::1/64").with(|a| a.unusable = true),
        ];
        let candidates = masquerade_candidates(&addresses, &BOTH);
        assert_eq!(
            candidates,
            BTreeMap::from([
                (2, nets(&["192.168.50.11/24", "10.0.0.11/8"])),
                (3, nets(&["192.168.60.11/24", "fd00:60::11/64"])),
                (4, nets(&["10.244.1.1/32"])),
                // The deprecated address last.
                (5, nets(&["fd00:71::1/64", "fd00:70::1/64"])),
            ])
        );
        // A node without IPv6 leaves its IPv6 addresses out.
        let v4_only = masquerade_candidates(&addresses, &PerFamily { v4: true, v6: false });
        assert_eq!(v4_only.get(&3), Some(&nets(&["192.168.60.11/24"])));
        assert_eq!(v4_only.get(&5), None);
    }

    #[test]
    fn at_most_four_addresses_per_family_and_interface() {
        let addresses: Vec<_> = (1..=6)
            .map(|i| addr(2, &format!("10.{i}.0.1/16")))
            .chain((1..=6).map(|i| addr(2, &format!("fd00:{i}::1/64"))))
            .collect();
        let candidates = masquerade_candidates(&addresses, &BOTH);
        assert_eq!(candidates[&2].len(), 2 * MAX_INTERFACE_ADDRS);
        let entries = masquerade_entries(&candidates, &PerFamily { v4: None, v6: None });
        assert_eq!(entries[&2].v4.count as usize, MAX_INTERFACE_ADDRS);
        assert_eq!(entries[&2].v6.count as usize, MAX_INTERFACE_ADDRS);
        assert_eq!(entries[&2].v4.addrs[3].addr, [10, 4, 0, 1]);
        assert_eq!(entries[&2].v4.addrs[3].prefix_len, 16);
    }

    #[test]
    fn entries_carry_the_fallback_at_key_0_and_the_programs_pick_by_next_hop() {
        let candidates = BTreeMap::from([
            (2, nets(&["192.168.50.11/24", "10.0.0.11/8"])),
            (3, nets(&["fd00:60::11/64"])),
        ]);
        let fallback = PerFamily {
            v4: Some("192.168.50.11".parse().unwrap()),
            v6: Some("fd00:60::11".parse().unwrap()),
        };
        let entries = masquerade_entries(&candidates, &fallback);
        assert_eq!(entries[&0].v4.get(0), Some(&[192, 168, 50, 11]));
        assert_eq!(entries[&0].v6.count, 1);
        assert_eq!(entries[&3].v4.count, 0, "no IPv4 address: the fallback's");
        assert_eq!(entries[&3].v4.get(0), None);
        // The programs' choice (`InterfaceAddrs::slot_for`): the address whose subnet holds the
        // next hop, else the first.
        let uplink = &entries[&2].v4;
        assert_eq!(uplink.slot_for(&[10, 9, 9, 9]), 1);
        assert_eq!(uplink.slot_for(&[192, 168, 50, 1]), 0);
        assert_eq!(uplink.slot_for(&[172, 16, 0, 1]), 0);
        assert_eq!(uplink.get(1), Some(&[10, 0, 0, 11]));
        // Another address than the fallback's: the programs look routes up.
        assert!(differs_from_fallback(&candidates, &fallback));
        let single = BTreeMap::from([(2, nets(&["192.168.50.11/24"])), (3, nets(&["fd00:60::11/64"]))]);
        assert!(!differs_from_fallback(&single, &fallback));
    }

    trait With: Sized {
        fn with(self, f: impl FnOnce(&mut Self)) -> Self;
    }

    impl With for InterfaceAddress {
        fn with(mut self, f: impl FnOnce(&mut Self)) -> Self {
            f(&mut self);
            self
        }
    }
}
