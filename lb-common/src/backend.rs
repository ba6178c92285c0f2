//! The backends maps (`lb4_backends`, `lb6_backends`): backend id -> address. One id per distinct
//! (address, port, protocol), shared by every Service that selects it and reference-counted by the
//! agent, so an endpoint in several Services costs one entry.

use crate::{
    family::{Family, V4, V6},
    user_pod,
};

/// `BackendValue::flags`. Selection is decided by the agent: `LOCAL` and `TERMINATING` are
/// informational for operators; `HOST` is read by tc.
pub mod flags {
    /// The endpoint runs on this node (EndpointSlice `nodeName` equals the node name).
    pub const LOCAL: u8 = 1 << 0;
    /// Serving but terminating (used only while no endpoint is ready, per KEP-1669).
    pub const TERMINATING: u8 = 1 << 1;
    /// The address is one of this node's own (a hostNetwork endpoint of this node, at any of its
    /// interfaces' addresses or its node IPs): tc delivers its flows locally and never
    /// masquerades them, as kube-proxy's POSTROUTING never sees a locally delivered packet.
    pub const HOST: u8 = 1 << 2;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendValue<F: Family> {
    /// Endpoint address, network order.
    pub addr: F::Addr,
    /// Endpoint (target) port.
    pub port: u16,
    pub proto: u8,
    /// `flags::*`.
    pub flags: u8,
}

pub type Backend4Value = BackendValue<V4>;
pub type Backend6Value = BackendValue<V6>;

user_pod!(BackendValue<V4>, BackendValue<V6>);

#[cfg(test)]
mod layout {
    #[test]
    fn backend4_value() {
        assert_eq!(core::mem::size_of::<super::Backend4Value>(), 8);
        assert_eq!(core::mem::size_of::<super::Backend6Value>(), 20);
    }
}
