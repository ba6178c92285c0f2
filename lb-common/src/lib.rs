//! The ABI between the eBPF programs (`lb-ebpf`) and the agent (`lb-agent`): map names, capacities,
//! and the `#[repr(C)]` keys and values stored in them.
//!
//! Rules every type here follows (checked by the layout tests at the bottom of each module):
//! - Addresses are `F::Addr` of a [`family::Family`] (`[u8; 4]` for IPv4, [`family::In6Addr`] for IPv6), in
//!   network order, exactly as on the wire; a type that holds one is generic over the family.
//! - Ports and every other integer are in host order; the programs convert. `bpftool map dump`
//!   then shows `"port": 80` rather than a byte-swapped number.
//! - Padding is an explicit `_pad` field that writers zero: padding bytes are part of a hash key.
//! - A layout change renames the map (`lb4_services` -> `lb4_services_v2`), so an agent never reuses a
//!   pinned map of the old layout; see [`catalog`].
//!
//! The `user` feature adds `aya::Pod` for the agent.
#![no_std]

pub mod affinity;
pub mod backend;
pub mod catalog;
pub mod cluster_ip;
pub mod config;
pub mod conntrack;
pub mod ct_filter;
pub mod family;
pub mod features;
pub mod fragment;
pub mod maglev;
pub mod monitor;
pub mod prefilter;
pub mod ratelimit;
pub mod revnat;
pub mod sctp;
pub mod select;
pub mod service;
pub mod stats;
pub mod trace;

/// IANA protocol numbers used in keys (`SvcKey::proto`, `BackendValue::proto`, ...).
pub mod proto {
    pub const ICMP: u8 = 1;
    pub const ICMPV6: u8 = 58;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const SCTP: u8 = 132;

    /// The protocols Services balance (kube-proxy's: TCP, UDP, SCTP).
    #[inline(always)]
    pub const fn is_balanced(protocol: u8) -> bool {
        matches!(protocol, TCP | UDP | SCTP)
    }
}

/// Implements `aya::Pod` for the given plain-old-data types when built for userspace.
macro_rules! user_pod {
    ($($ty:ty),+ $(,)?) => {
        $(
            #[cfg(feature = "user")]
            // SAFETY: #[repr(C)], only integer and byte-array fields, explicit padding fields.
            unsafe impl aya::Pod for $ty {}
        )+
    };
}
pub(crate) use user_pod;
