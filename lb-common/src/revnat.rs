//! Reverse NAT: from a backend back to the frontend the client asked for.
//! - `lb4_revnat`, `lb6_revnat`: rev_nat_id -> frontend (written by the agent; the tc path and the
//!   stale check of the socket path read it);
//! - `lb4_sock_conn`, `lb6_sock_conn`: per connected socket, its backend and frontend, in the slot
//!   its socket cookie names ([`SockConnSlot`]), written by connect, read by recvmsg/getpeername,
//!   freed when the socket closes, so a client sees its peer as the address it called (socket
//!   storage, `lb4_sock_rev_sk`, when the slot is another live socket's);
//! - `lb4_sock_revnat`, `lb6_sock_revnat` (LRU): per unconnected UDP socket, backend -> frontend,
//!   written by sendmsg and read by recvmsg;
//! - `lb_svc_names`: rev_nat_id -> Service name, for operators only.

use crate::{
    family::{Family, V4, V6},
    user_pod,
};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNatValue<F: Family> {
    /// Frontend address, network order.
    pub addr: F::Addr,
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey<F: Family> {
    /// `bpf_get_socket_cookie()` of the client socket.
    pub cookie: u64,
    /// Backend address, network order.
    pub addr: F::Addr,
    pub port: u16,
    pub _pad: u16,
    pub _tail: F::Pad,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatValue<F: Family> {
    /// Frontend address, network order.
    pub addr: F::Addr,
    pub port: u16,
    pub _pad: u16,
    /// Checked against the frontend's current id, so a recycled entry is never trusted.
    pub rev_nat_id: u32,
}

/// A connected socket's (TCP, connected UDP, SCTP) reverse NAT: the backend its connect() went to
/// and the frontend it called, for getpeername and recvmsg. Kept in the socket's slot of
/// `lb4_sock_conn` ([`SockConnSlot`]), or in its socket storage `lb4_sock_rev_sk` when that slot
/// is another live socket's. Never evicted and never outliving the socket, unlike the LRU
/// `lb4_sock_revnat`, which unconnected UDP sockets use (they talk to several frontends).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatSk<F: Family> {
    /// Backend address, network order.
    pub backend_addr: F::Addr,
    pub backend_port: u16,
    pub frontend_port: u16,
    /// Frontend address, network order.
    pub frontend_addr: F::Addr,
    /// Checked against the frontend's current id, so a recycled entry is never trusted.
    pub rev_nat_id: u32,
}

/// The kernel's `struct bpf_spin_lock`: the verifier finds a map value's lock by this BTF name.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct bpf_spin_lock {
    pub val: u32,
}

/// One slot of `lb4_sock_conn` (`lb6_sock_conn`), an array indexed by the low bits of a socket
/// cookie ([`conn_slot`]). Cookies are handed out in sequence (per CPU, in batches), so the
/// sockets a CPU connects one after another use neighbouring slots, mostly in cache: a record
/// costs a store where a hash map's insert costs an allocation and a bucket's cache misses, and
/// socket storage two memory-accounted allocations. A slot is claimed under its lock by a connect
/// while free or already its socket's, and freed by `lb_sock_release` when its socket closes; a
/// socket whose slot another live socket holds keeps its record in socket storage instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockConnSlot<F: Family> {
    pub lock: bpf_spin_lock,
    pub _pad: u32,
    /// The owner's socket cookie; 0 while the slot is free (the kernel's cookies start at 1).
    pub cookie: u64,
    pub conn: SockRevNatSk<F>,
}

/// Slots of `lb4_sock_conn` (and of `lb6_sock_conn`): a power of two. A socket's slot is taken
/// from another only by one whose cookie is a multiple of this away and that is still open.
pub const CONN_SLOTS: u32 = 65_536;

/// The slot of the socket with cookie `cookie`.
#[inline(always)]
pub const fn conn_slot(cookie: u64) -> u32 {
    (cookie as u32) & (CONN_SLOTS - 1)
}

/// Sizes of the name fields: a namespace and a Service name are DNS labels (at most 63 bytes), a
/// port name an IANA service name (at most 15).
pub const NAME_LEN: usize = 64;
pub const PORT_NAME_LEN: usize = 16;

/// `namespace/name:port` of a frontend, NUL-padded.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SvcName {
    pub namespace: [u8; NAME_LEN],
    pub name: [u8; NAME_LEN],
    pub port_name: [u8; PORT_NAME_LEN],
}

impl Default for SvcName {
    fn default() -> Self {
        Self {
            namespace: [0; NAME_LEN],
            name: [0; NAME_LEN],
            port_name: [0; PORT_NAME_LEN],
        }
    }
}

pub type RevNat4Value = RevNatValue<V4>;
pub type RevNat6Value = RevNatValue<V6>;
pub type SockRevNat4Key = SockRevNatKey<V4>;
pub type SockRevNat6Key = SockRevNatKey<V6>;
pub type SockRevNat4Value = SockRevNatValue<V4>;
pub type SockRevNat6Value = SockRevNatValue<V6>;
pub type SockRevNat4Sk = SockRevNatSk<V4>;
pub type SockRevNat6Sk = SockRevNatSk<V6>;

user_pod!(
    RevNatValue<V4>,
    RevNatValue<V6>,
    SockRevNatKey<V4>,
    SockRevNatKey<V6>,
    SockRevNatValue<V4>,
    SockRevNatValue<V6>,
    SockRevNatSk<V4>,
    SockRevNatSk<V6>,
    SockConnSlot<V4>,
    SockConnSlot<V6>,
    SvcName
);

#[cfg(test)]
mod layout {
    use core::mem::size_of;

    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(size_of::<RevNat4Value>(), 8);
        assert_eq!(size_of::<SockRevNat4Key>(), 16);
        assert_eq!(size_of::<SockRevNat4Value>(), 12);
        assert_eq!(size_of::<SockRevNat4Sk>(), 16);
        assert_eq!(size_of::<SvcName>(), 144);
        assert_eq!(size_of::<RevNat6Value>(), 20);
        assert_eq!(size_of::<SockRevNat6Key>(), 32);
        assert_eq!(size_of::<SockRevNat6Value>(), 24);
        assert_eq!(size_of::<SockRevNat6Sk>(), 40);
        assert_eq!(size_of::<SockConnSlot<V4>>(), 32);
        assert_eq!(size_of::<SockConnSlot<V6>>(), 56);
    }

    #[test]
    fn neighbouring_cookies_take_neighbouring_slots() {
        assert_eq!(conn_slot(1), 1);
        assert_eq!(conn_slot(u64::from(CONN_SLOTS) + 5), 5);
        assert_eq!(conn_slot(u64::MAX), CONN_SLOTS - 1);
        assert!(CONN_SLOTS.is_power_of_two());
    }
}
