//! Reverse NAT: from a backend back to the frontend the client asked for.
//! - `lb4_revnat`, `lb6_revnat`: rev_nat_id -> frontend (written by the agent; the tc path and the
//!   stale check of the socket path read it);
//! - `lb4_sock_revnat`, `lb6_sock_revnat` (LRU): per socket, backend -> frontend, written by
//!   connect/sendmsg and read by recvmsg/getpeername, so a client sees replies from the address it
//!   sent to;
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

/// `lb4_sock_rev_sk` (`lb6_sock_rev_sk`), the socket storage of a connected socket (TCP, connected
/// UDP): the backend its connect() went to and the frontend it called, for getpeername and
/// recvmsg. Lives exactly as long as the socket, so it is never evicted and never outlives it
/// (unlike the LRU `lb4_sock_revnat`, which unconnected UDP sockets keep using: they talk to
/// several frontends).
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
    }
}
