//! sessionAffinity: ClientIP.
//! - `lb4_affinity` (LRU): (client, frontend) -> the backend it last used and when;
//! - `lb4_aff_match`: (backend, frontend) pairs the agent currently allows, so an affinity entry
//!   never outlives the backend's membership in the Service (kube-proxy's `recent` match only
//!   covers endpoints that are still in the chain).

use crate::user_pod;

/// `Affinity4Key::kind`.
pub mod kind {
    /// `client` is the network-namespace cookie of a socket (socket path: the source address is
    /// not known at connect time; one netns is one pod or the host, which has one client IP).
    pub const NETNS_COOKIE: u8 = 0;
    /// `client` is the source IPv4 address in its low 4 bytes, network order (tc path).
    pub const ADDR: u8 = 1;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Affinity4Key {
    pub client: u64,
    pub rev_nat_id: u32,
    pub kind: u8,
    pub _pad: [u8; 3],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Affinity4Value {
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

user_pod!(Affinity4Key, Affinity4Value, AffinityMatchKey);

#[cfg(test)]
mod layout {
    use core::mem::size_of;

    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(size_of::<Affinity4Key>(), 16);
        assert_eq!(size_of::<Affinity4Value>(), 16);
        assert_eq!(size_of::<AffinityMatchKey>(), 8);
    }
}
