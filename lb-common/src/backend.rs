//! The backends map (`lb4_backends`): backend id -> address. One id per distinct
//! (address, port, protocol), shared by every Service that selects it and reference-counted by the
//! agent, so an endpoint in several Services costs one entry.

use crate::user_pod;

/// `Backend4Value::flags`: informational for operators; selection is decided by the agent.
pub mod flags {
    /// The endpoint runs on this node (EndpointSlice `nodeName` equals the node name).
    pub const LOCAL: u8 = 1 << 0;
    /// Serving but terminating (used only while no endpoint is ready, per KEP-1669).
    pub const TERMINATING: u8 = 1 << 1;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend4Value {
    /// Endpoint address, network order.
    pub addr: [u8; 4],
    /// Endpoint (target) port.
    pub port: u16,
    pub proto: u8,
    /// `flags::*`.
    pub flags: u8,
}

user_pod!(Backend4Value);

#[cfg(test)]
mod layout {
    #[test]
    fn backend4_value() {
        assert_eq!(core::mem::size_of::<super::Backend4Value>(), 8);
    }
}
