//! sessionAffinity: ClientIP.
//! - `lb4_affinity`, `lb6_affinity` (LRU): (client, frontend) -> the backend it last used and when;
//! - `lb_aff_match`: (backend, frontend) pairs the agent currently allows, so an affinity entry
//!   never outlives the backend's membership in the Service (kube-proxy's `recent` match only
//!   covers endpoints that are still in the chain).

use crate::{
    family::{Family, In6Addr, V4, V6},
    user_pod,
};

/// `AffinityKey::kind`.
pub mod kind {
    /// `client` is the network-namespace cookie of a socket (socket path: the source address is
    /// not known at connect time; one netns is one pod or the host, which has one client IP):
    /// an IPv4 key's `u64`, an IPv6 key's first 8 bytes (native order).
    pub const NETNS_COOKIE: u8 = 0;
    /// `client` is the source address (tc path): an IPv4 key's `u64` holds it in its low 4
    /// bytes, network order; an IPv6 key's 16 bytes are the address.
    pub const ADDR: u8 = 1;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey<F: Family> {
    pub client: F::Client,
    pub rev_nat_id: u32,
    pub kind: u8,
    pub _pad: [u8; 3],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityValue {
    /// `bpf_ktime_get_boot_ns()` of the last connection that used the entry.
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityMatchKey {
    pub backend_id: u32,
    pub rev_nat_id: u32,
}

/// A family's `AffinityKey::client` encodings (`kind`), for the programs that write keys and the
/// agent that shows them.
pub trait AffinityClient: Family {
    fn client_of_addr(addr: &Self::Addr) -> Self::Client;
    fn client_of_cookie(cookie: u64) -> Self::Client;
    /// The address of a `kind::ADDR` client.
    fn addr_of_client(client: &Self::Client) -> Self::Addr;
    /// The cookie of a `kind::NETNS_COOKIE` client.
    fn cookie_of_client(client: &Self::Client) -> u64;
}

impl AffinityClient for V4 {
    /// The IPv4 layout of earlier releases: the address's in-memory bytes in the low 32 bits.
    #[inline(always)]
    fn client_of_addr(addr: &[u8; 4]) -> u64 {
        u32::from_ne_bytes(*addr) as u64
    }
    #[inline(always)]
    fn client_of_cookie(cookie: u64) -> u64 {
        cookie
    }
    fn addr_of_client(client: &u64) -> [u8; 4] {
        (*client as u32).to_ne_bytes()
    }
    fn cookie_of_client(client: &u64) -> u64 {
        *client
    }
}

impl AffinityClient for V6 {
    #[inline(always)]
    fn client_of_addr(addr: &In6Addr) -> In6Addr {
        *addr
    }
    /// The cookie's 8 bytes (native order), then zeros.
    #[inline(always)]
    fn client_of_cookie(cookie: u64) -> In6Addr {
        In6Addr::from_words([cookie as u32, (cookie >> 32) as u32, 0, 0])
    }
    fn addr_of_client(client: &In6Addr) -> In6Addr {
        *client
    }
    fn cookie_of_client(client: &In6Addr) -> u64 {
        let w = client.words();
        u64::from(w[0]) | (u64::from(w[1]) << 32)
    }
}

pub type Affinity4Key = AffinityKey<V4>;
pub type Affinity6Key = AffinityKey<V6>;

user_pod!(AffinityKey<V4>, AffinityKey<V6>, AffinityValue, AffinityMatchKey);

#[cfg(test)]
mod layout {
    use core::mem::size_of;

    use super::*;

    #[test]
    fn clients_round_trip() {
        assert_eq!(
            V4::addr_of_client(&V4::client_of_addr(&[10, 0, 0, 7])),
            [10, 0, 0, 7]
        );
        assert_eq!(
            V4::cookie_of_client(&V4::client_of_cookie(1 << 40 | 5)),
            1 << 40 | 5
        );
        let a = In6Addr::new([0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9]);
        assert_eq!(V6::addr_of_client(&V6::client_of_addr(&a)), a);
        assert_eq!(
            V6::cookie_of_client(&V6::client_of_cookie(1 << 40 | 5)),
            1 << 40 | 5
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(size_of::<Affinity4Key>(), 16);
        assert_eq!(size_of::<Affinity6Key>(), 24);
        assert_eq!(size_of::<AffinityValue>(), 16);
        assert_eq!(size_of::<AffinityMatchKey>(), 8);
    }
}
