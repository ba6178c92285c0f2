//! Input and output of `lb_sock_trace`, a tc program that runs the socket programs' translation
//! code on a described socket call. cgroup sock_addr programs cannot run under BPF_PROG_TEST_RUN,
//! so tests and `lb-agent trace` exercise the same compiled code through this harness.
//! The "packet" handed to BPF_PROG_TEST_RUN is a `SockTraceIn`; the program overwrites its start
//! with a `SockTraceOut`.

use crate::user_pod;

/// `SockTraceIn::hook`.
pub mod hook {
    pub const CONNECT4: u32 = 0;
    pub const SENDMSG4: u32 = 1;
    pub const RECVMSG4: u32 = 2;
    pub const GETPEERNAME4: u32 = 3;
}

/// `SockTraceOut::verdict`: what the socket program did.
pub mod verdict {
    /// Not a frontend (or skipped): the call proceeds untouched.
    pub const PASS: u32 = 0;
    /// The destination (connect4/sendmsg4) or peer (recvmsg4/getpeername4) was rewritten.
    pub const TRANSLATED: u32 = 1;
    /// The call fails with `errno` (no endpoints: ECONNREFUSED, as kube-proxy's REJECT).
    pub const REJECT: u32 = 2;
    /// The call fails with `errno` (Local policy without a local endpoint: kube-proxy drops).
    pub const DROP: u32 = 3;
}

/// Size of the test packet: BPF_PROG_TEST_RUN wants at least an Ethernet header's worth.
pub const TRACE_PACKET_LEN: usize = 64;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockTraceIn {
    pub hook: u32,
    /// IPPROTO of the socket.
    pub protocol: u32,
    /// The address the call names (destination, or the peer for recvmsg4/getpeername4).
    pub addr: [u8; 4],
    pub port: u16,
    pub _pad: u16,
    /// The socket's bound source address, or zero when unbound.
    pub src_addr: [u8; 4],
    /// Stands in for `bpf_get_prandom_u32()`/the socket-cookie hash when choosing a slot.
    pub random: u32,
    pub socket_cookie: u64,
    pub netns_cookie: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockTraceOut {
    /// `verdict::*`.
    pub verdict: u32,
    /// The positive errno of a REJECT or DROP.
    pub errno: u32,
    /// The rewritten address.
    pub addr: [u8; 4],
    pub port: u16,
    /// The scope whose slots were used (`service::SCOPE_*`).
    pub scope: u8,
    pub _pad: u8,
    pub backend_id: u32,
    pub rev_nat_id: u32,
    /// Frontend entry flags of the scope used.
    pub flags: u32,
    /// Slot count of the scope used.
    pub count: u32,
}

user_pod!(SockTraceIn, SockTraceOut);

const _: () = assert!(core::mem::size_of::<SockTraceIn>() <= TRACE_PACKET_LEN);
const _: () = assert!(core::mem::size_of::<SockTraceOut>() <= TRACE_PACKET_LEN);
