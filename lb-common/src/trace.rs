//! Input and output of `lb_sock_trace`, a tc program that runs the socket programs' translation
//! code on a described socket call. cgroup sock_addr programs cannot run under BPF_PROG_TEST_RUN,
//! so tests and `lb-agent trace` exercise the same compiled code through this harness.
//! The "packet" handed to BPF_PROG_TEST_RUN is a `SockTraceIn`; the program overwrites its start
//! with a `SockTraceOut`.

use crate::user_pod;

/// `SockTraceIn::hook`: the hook and the family of the call (an IPv6 hook's address may be
/// IPv4-mapped, as a dual-stack socket's).
pub mod hook {
    pub const CONNECT4: u32 = 0;
    pub const SENDMSG4: u32 = 1;
    pub const RECVMSG4: u32 = 2;
    pub const GETPEERNAME4: u32 = 3;
    pub const CONNECT6: u32 = 4;
    pub const SENDMSG6: u32 = 5;
    pub const RECVMSG6: u32 = 6;
    pub const GETPEERNAME6: u32 = 7;
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
    /// The address the call names (destination, or the peer for recvmsg/getpeername); an IPv4
    /// hook's in the first 4 bytes.
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: u16,
    /// The socket's bound source address, or zero when unbound (same layout as `addr`).
    pub src_addr: [u8; 16],
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
    /// The rewritten address (an IPv4 hook's in the first 4 bytes).
    pub addr: [u8; 16],
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

/// What `lb_tc_ingress` leaves in `__sk_buff.cb` about a new-flow decision, for `lb-agent trace`
/// (read back through BPF_PROG_TEST_RUN's ctx_out; production traffic ignores it).
pub mod tc {
    /// cb[0]: the decision (`verdict::*` values; 0 = not a frontend or nothing decided).
    pub const CB_VERDICT: usize = 0;
    /// cb[1]: the frontend's rev_nat_id.
    pub const CB_REV_NAT_ID: usize = 1;
    /// cb[2]: the scope used in the low byte, `MASQUERADED` in bit 8.
    pub const CB_SCOPE_FLAGS: usize = 2;
    /// cb[3]: the backend id.
    pub const CB_BACKEND_ID: usize = 3;
    /// cb[4]: the frontend entry's flags.
    pub const CB_FRONTEND_FLAGS: usize = 4;
    pub const MASQUERADED: u32 = 1 << 8;
    /// Offset of `cb` in `struct __sk_buff` (len, pkt_type, mark, queue_mapping, protocol,
    /// vlan_present, vlan_tci, vlan_proto, priority, ingress_ifindex, ifindex, tc_index: 12 u32).
    pub const SKB_CB_OFFSET: usize = 48;
    /// Offset of `mark` in `struct __sk_buff`.
    pub const SKB_MARK_OFFSET: usize = 8;
    /// Offset of `ingress_ifindex` in `struct __sk_buff` (BPF_PROG_TEST_RUN takes it from 5.15).
    pub const SKB_INGRESS_IFINDEX_OFFSET: usize = 36;
    /// A `struct __sk_buff` is smaller than this; BPF_PROG_TEST_RUN accepts a larger, zero-padded
    /// context.
    pub const SKB_CTX_LEN: usize = 256;
}
