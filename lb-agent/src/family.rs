//! IP families, as Kubernetes names them ("IPv4", "IPv6"): which family an address or a prefix
//! is. The agent carries addresses of either family through one code path (`IpAddr`, `IpNet`);
//! where kube-proxy runs one proxier per family, the model and the plan take the family as an
//! argument, and the map writer turns each address into its family's map key at the last step.

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;
use lb_common::{
    catalog::{FamilyMapNames, FamilyMaps},
    family::{Family, In6Addr, V4, V6},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    /// Both families, IPv4 first (the order kube-proxy's dual-stack proxier lists them).
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    pub fn of(ip: &IpAddr) -> IpFamily {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    pub fn of_net(net: &IpNet) -> IpFamily {
        match net {
            IpNet::V4(_) => IpFamily::V4,
            IpNet::V6(_) => IpFamily::V6,
        }
    }

    /// An address of this family from the 16 bytes the programs carry one of either family in
    /// (`SockTraceOut::addr`, `MonitorEvent`'s addresses): the family's bytes first; an
    /// IPv4-mapped IPv6 address shown as the IPv4 one.
    pub fn addr_from_bytes(self, bytes: [u8; 16]) -> IpAddr {
        match self {
            IpFamily::V4 => IpAddr::from([bytes[0], bytes[1], bytes[2], bytes[3]]),
            IpFamily::V6 => IpAddr::V6(std::net::Ipv6Addr::from(bytes)).to_canonical(),
        }
    }

    /// The Kubernetes spelling (`spec.ipFamilies`, `addressType`).
    pub const fn as_str(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }

    /// The family a Kubernetes field names, if it is one ("IPv4", "IPv6").
    pub fn parse(name: &str) -> Option<IpFamily> {
        match name {
            "IPv4" => Some(IpFamily::V4),
            "IPv6" => Some(IpFamily::V6),
            _ => None,
        }
    }

    /// The names of this family's maps (`lb4_*`, `lb6_*`).
    pub const fn maps(self) -> FamilyMapNames {
        match self {
            IpFamily::V4 => V4::MAPS,
            IpFamily::V6 => V6::MAPS,
        }
    }

    /// The other family.
    pub const fn other(self) -> IpFamily {
        match self {
            IpFamily::V4 => IpFamily::V6,
            IpFamily::V6 => IpFamily::V4,
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One value per family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PerFamily<T> {
    pub v4: T,
    pub v6: T,
}

impl<T> PerFamily<T> {
    pub fn from_fn(f: impl Fn(IpFamily) -> T) -> Self {
        PerFamily {
            v4: f(IpFamily::V4),
            v6: f(IpFamily::V6),
        }
    }

    pub fn get(&self, family: IpFamily) -> &T {
        match family {
            IpFamily::V4 => &self.v4,
            IpFamily::V6 => &self.v6,
        }
    }

    pub fn get_mut(&mut self, family: IpFamily) -> &mut T {
        match family {
            IpFamily::V4 => &mut self.v4,
            IpFamily::V6 => &mut self.v6,
        }
    }
}

/// A family as the maps spell it (`lb_common`'s `V4`, `V6`): where an `IpAddr` becomes a map
/// key's address and back. Code that touches one family's maps is generic over it.
pub trait KernelFamily: Family {
    const FAMILY: IpFamily;
    /// The address in the maps' form, if `ip` is of this family.
    fn kernel_addr(ip: &IpAddr) -> Option<Self::Addr>;
    fn ip_addr(addr: &Self::Addr) -> IpAddr;
}

impl KernelFamily for V4 {
    const FAMILY: IpFamily = IpFamily::V4;
    fn kernel_addr(ip: &IpAddr) -> Option<[u8; 4]> {
        match ip {
            IpAddr::V4(ip) => Some(ip.octets()),
            IpAddr::V6(_) => None,
        }
    }
    fn ip_addr(addr: &[u8; 4]) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(*addr))
    }
}

impl KernelFamily for V6 {
    const FAMILY: IpFamily = IpFamily::V6;
    fn kernel_addr(ip: &IpAddr) -> Option<In6Addr> {
        match ip {
            IpAddr::V6(ip) => Some(In6Addr::from(*ip)),
            IpAddr::V4(_) => None,
        }
    }
    fn ip_addr(addr: &In6Addr) -> IpAddr {
        IpAddr::V6(Ipv6Addr::from(*addr))
    }
}

/// Whether `ip` is of `family`.
pub fn is(family: IpFamily, ip: &IpAddr) -> bool {
    IpFamily::of(ip) == family
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families() {
        assert_eq!(IpFamily::of(&"10.0.0.1".parse().unwrap()), IpFamily::V4);
        assert_eq!(IpFamily::of(&"fd00::1".parse().unwrap()), IpFamily::V6);
        assert_eq!(IpFamily::of_net(&"fd00::/64".parse().unwrap()), IpFamily::V6);
        assert_eq!(IpFamily::parse("IPv6"), Some(IpFamily::V6));
        assert_eq!(IpFamily::parse("FQDN"), None);
        assert_eq!(IpFamily::V4.other(), IpFamily::V6);
        assert_eq!(IpFamily::V6.to_string(), "IPv6");
    }

    #[test]
    fn kernel_addresses_round_trip() {
        let v4: IpAddr = "10.96.0.10".parse().unwrap();
        let v6: IpAddr = "fd00:10:96::a".parse().unwrap();
        assert_eq!(V4::kernel_addr(&v4), Some([10, 96, 0, 10]));
        assert_eq!(V4::kernel_addr(&v6), None);
        assert_eq!(V6::kernel_addr(&v4), None);
        assert_eq!(V6::ip_addr(&V6::kernel_addr(&v6).unwrap()), v6);
        assert_eq!(V4::ip_addr(&[10, 96, 0, 10]), v4);
    }
}
