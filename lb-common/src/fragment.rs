//! IP fragments on the tc path (`lb4_frags`, `lb6_frags`, LRU): only a datagram's first fragment
//! carries its ports, so the programs note them, keyed by what every fragment of the datagram
//! repeats (source, destination, protocol and the IP identification), and read them back for the
//! later fragments, which are then translated as the first one was. As Cilium's
//! `cilium_ipv4_frag_datagrams`, where kube-proxy relies on netfilter's defragmentation.
//!
//! A later fragment that arrives before its first one (reordered) finds nothing and passes
//! untranslated, counted (`tc_fragment_untracked`): the datagram is then lost, as it is when
//! one of its fragments is.

use crate::{
    family::{Family, V4, V6},
    user_pod,
};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey<F: Family> {
    pub saddr: F::Addr,
    pub daddr: F::Addr,
    /// The IP identification (16 bits in IPv4, 32 in IPv6's fragment header).
    pub id: u32,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// The ports of a fragmented datagram, from its first fragment.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragPorts {
    pub sport: u16,
    pub dport: u16,
}

pub type Frag4Key = FragKey<V4>;
pub type Frag6Key = FragKey<V6>;

user_pod!(FragKey<V4>, FragKey<V6>, FragPorts);

#[cfg(test)]
mod layout {
    use core::mem::size_of;

    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(size_of::<Frag4Key>(), 16);
        assert_eq!(size_of::<Frag6Key>(), 40);
        assert_eq!(size_of::<FragPorts>(), 4);
    }
}
