//! Program entry points: each adapts its kernel context and calls into the library. Program names
//! stay within the kernel's 15-byte limit so `bpftool prog show` prints them whole.
#![no_std]
#![no_main]

use aya_ebpf::{
    EbpfContext,
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::{
        bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_boot_ns,
        bpf_set_retval,
    },
    macros::{cgroup_sock_addr, classifier},
    programs::{SockAddrContext, TcContext},
};
use lb_common::{
    revnat::SockRevNat4Sk,
    trace::{SockTraceIn, SockTraceOut, hook, verdict},
};
use lb_ebpf::{
    maps::{NETNS_PROBE, SOCK_REVNAT_SK},
    sock::{self, Outcome, SockCall},
};

/// A real socket call: the kernel's `bpf_sock_addr`. `SENDMSG` marks sendmsg4, the only hook
/// whose context has `msg_src_ip4` (the verifier rejects reading it elsewhere).
struct KernelCall<const SENDMSG: bool> {
    ctx: SockAddrContext,
}

impl<const SENDMSG: bool> SockCall for KernelCall<SENDMSG> {
    #[inline(always)]
    fn family(&self) -> u32 {
        unsafe { (*self.ctx.sock_addr).user_family }
    }

    #[inline(always)]
    fn protocol(&self) -> u8 {
        unsafe { (*self.ctx.sock_addr).protocol as u8 }
    }

    #[inline(always)]
    fn addr(&self) -> [u8; 4] {
        // user_ip4 holds the address in network order; its in-memory bytes are the wire bytes.
        unsafe { (*self.ctx.sock_addr).user_ip4 }.to_ne_bytes()
    }

    #[inline(always)]
    fn port(&self) -> u16 {
        // user_port holds the port in network order in its low 16 bits.
        u16::from_be(unsafe { (*self.ctx.sock_addr).user_port } as u16)
    }

    #[inline(always)]
    fn set_addr(&mut self, addr: [u8; 4], port: u16) {
        unsafe {
            (*self.ctx.sock_addr).user_ip4 = u32::from_ne_bytes(addr);
            (*self.ctx.sock_addr).user_port = u32::from(port.to_be());
        }
    }

    #[inline(always)]
    fn socket_cookie(&self) -> u64 {
        unsafe { bpf_get_socket_cookie(self.ctx.as_ptr()) }
    }

    #[inline(always)]
    fn netns_cookie(&self) -> u64 {
        unsafe { bpf_get_netns_cookie(self.ctx.as_ptr()) }
    }

    #[inline(always)]
    fn src_addr(&self) -> [u8; 4] {
        unsafe {
            if SENDMSG {
                let msg_src = (*self.ctx.sock_addr).msg_src_ip4;
                if msg_src != 0 {
                    return msg_src.to_ne_bytes();
                }
            }
            let sk = (*self.ctx.sock_addr).__bindgen_anon_1.sk;
            if sk.is_null() {
                return [0; 4];
            }
            (*sk).src_ip4.to_ne_bytes()
        }
    }

    #[inline(always)]
    fn random(&self) -> u32 {
        unsafe { bpf_get_prandom_u32() }
    }

    #[inline(always)]
    fn now_ns(&self) -> u64 {
        unsafe { bpf_ktime_get_boot_ns() }
    }

    #[inline(always)]
    fn set_sk_revnat(&mut self, entry: &SockRevNat4Sk) -> bool {
        if SENDMSG {
            return false;
        }
        let mut initial = *entry;
        let ptr = SOCK_REVNAT_SK.get_or_insert_ptr_mut(&self.ctx, Some(&mut initial));
        if ptr.is_null() {
            return false;
        }
        // SAFETY: a non-null pointer from bpf_sk_storage_get is this socket's value.
        unsafe { *ptr = *entry };
        true
    }

    #[inline(always)]
    fn sk_revnat(&self) -> Option<SockRevNat4Sk> {
        let ptr = SOCK_REVNAT_SK.get_ptr_mut(&self.ctx);
        // SAFETY: as above.
        (!ptr.is_null()).then(|| unsafe { *ptr })
    }
}

/// cgroup sock_addr verdicts: 1 lets the call proceed; 0 fails it with the errno set by
/// `bpf_set_retval` (ECONNREFUSED or EHOSTUNREACH), or with EPERM on kernels without that
/// helper (before 5.18), as the kernel fails any refused call.
#[inline(always)]
fn sock_verdict(outcome: Outcome) -> i32 {
    match outcome.verdict {
        verdict::REJECT | verdict::DROP => {
            if lb_ebpf::features::set_retval() {
                unsafe { bpf_set_retval(-(outcome.errno as i32)) };
            }
            0
        }
        _ => 1,
    }
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    #[cfg(lb_test_variant)]
    lb_ebpf::stats::count(lb_common::stats::Counter::TestVariant);
    sock_verdict(sock::translate_forward(&mut KernelCall::<false> { ctx }))
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock_verdict(sock::translate_forward(&mut KernelCall::<true> { ctx }))
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate_reverse(&mut KernelCall::<false> { ctx });
    1
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::translate_reverse(&mut KernelCall::<false> { ctx });
    1
}

/// Records the network namespace of the agent's probe socket, on kernels without
/// `SO_NETNS_COOKIE` (`lb_common::features::NetnsProbe`). Attached by the agent to the cgroup
/// root for one connect() at start-up, never otherwise; it lets every call through.
#[cgroup_sock_addr(connect4)]
pub fn lb_probe_netns(ctx: SockAddrContext) -> i32 {
    if let Some(probe) = NETNS_PROBE.get_ptr_mut(0) {
        // SAFETY: a pointer into the map's only value, which outlives the program run.
        unsafe {
            let wanted = (*probe).socket_cookie;
            if wanted != 0 && bpf_get_socket_cookie(ctx.as_ptr()) == wanted {
                (*probe).netns_cookie = bpf_get_netns_cookie(ctx.as_ptr());
            }
        }
    }
    1
}

/// A described socket call, for the trace harness.
struct TracedCall {
    input: SockTraceIn,
}

impl SockCall for TracedCall {
    fn family(&self) -> u32 {
        sock::AF_INET
    }
    fn protocol(&self) -> u8 {
        self.input.protocol as u8
    }
    fn addr(&self) -> [u8; 4] {
        self.input.addr
    }
    fn port(&self) -> u16 {
        self.input.port
    }
    fn set_addr(&mut self, addr: [u8; 4], port: u16) {
        self.input.addr = addr;
        self.input.port = port;
    }
    fn socket_cookie(&self) -> u64 {
        self.input.socket_cookie
    }
    fn netns_cookie(&self) -> u64 {
        self.input.netns_cookie
    }
    fn src_addr(&self) -> [u8; 4] {
        self.input.src_addr
    }
    fn random(&self) -> u32 {
        self.input.random
    }
    fn now_ns(&self) -> u64 {
        unsafe { bpf_ktime_get_boot_ns() }
    }
}

/// Runs the socket translation on a `SockTraceIn` carried as packet data and writes a
/// `SockTraceOut` over it. Never attached; only run with BPF_PROG_TEST_RUN.
#[classifier]
pub fn lb_sock_trace(ctx: TcContext) -> i32 {
    let Ok(input) = ctx.load::<SockTraceIn>(0) else {
        return TC_ACT_SHOT;
    };
    let mut call = TracedCall { input };
    let outcome = match input.hook {
        hook::CONNECT4 | hook::SENDMSG4 => sock::translate_forward(&mut call),
        hook::RECVMSG4 | hook::GETPEERNAME4 => sock::translate_reverse(&mut call),
        _ => return TC_ACT_SHOT,
    };
    let out = SockTraceOut {
        verdict: outcome.verdict,
        errno: outcome.errno,
        addr: call.input.addr,
        port: call.input.port,
        scope: outcome.scope,
        _pad: 0,
        backend_id: outcome.backend_id,
        rev_nat_id: outcome.rev_nat_id,
        flags: u32::from(outcome.flags),
        count: u32::from(outcome.count),
    };
    match ctx.store(0, &out, 0) {
        Ok(()) => TC_ACT_OK,
        Err(_) => TC_ACT_SHOT,
    }
}

/// Per-packet translation on the way in: DNAT, un-SNAT, reject/drop decisions.
#[classifier]
pub fn lb_tc_ingress(mut ctx: TcContext) -> i32 {
    lb_ebpf::tc::ingress(&mut ctx)
}

/// Per-packet translation on the way out: SNAT and reverse DNAT.
#[classifier]
pub fn lb_tc_egress(mut ctx: TcContext) -> i32 {
    lb_ebpf::tc::egress(&mut ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
