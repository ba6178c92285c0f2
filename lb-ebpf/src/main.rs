//! Program entry points: each adapts its kernel context and calls into the library. Program names
//! stay within the kernel's 15-byte limit so `bpftool prog show` prints them whole.
#![no_std]
#![no_main]

use aya_ebpf::{
    EbpfContext,
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie,
        bpf_ktime_get_boot_ns, bpf_set_retval,
    },
    macros::{cgroup_sock, cgroup_sock_addr, classifier},
    programs::{SockAddrContext, SockContext, TcContext},
};
use lb_common::{
    family::{Family, In6Addr, V4, V6},
    revnat::SockRevNatSk,
    stats::Counter,
    trace::{SockTraceIn, SockTraceOut, hook, verdict},
};
use lb_ebpf::{
    family::FamilyMaps,
    maps::NETNS_PROBE,
    sock::{self, Mapped, Outcome, SockCall},
    stats::count,
};

/// A real socket call: the kernel's `bpf_sock_addr`. `SENDMSG` marks sendmsg, the only hook
/// whose context has `msg_src_ip4`/`msg_src_ip6` (the verifier rejects reading it elsewhere).
struct KernelCall<const SENDMSG: bool> {
    ctx: SockAddrContext,
}

impl<const SENDMSG: bool> KernelCall<SENDMSG> {
    #[inline(always)]
    fn cookie(&self) -> u64 {
        unsafe { bpf_get_socket_cookie(self.ctx.as_ptr()) }
    }

    #[inline(always)]
    fn netns(&self) -> u64 {
        unsafe { bpf_get_netns_cookie(self.ctx.as_ptr()) }
    }

    /// A connected socket's reverse NAT: in its slot of `lb4_sock_conn`, or, while another open
    /// socket holds that slot, in the socket's own storage (two memory-accounted allocations).
    #[inline(always)]
    fn store_sk<G: FamilyMaps>(&mut self, entry: &SockRevNatSk<G>) -> bool {
        if SENDMSG {
            return false;
        }
        if sock::claim_connection::<G>(self.cookie(), entry) {
            return true;
        }
        count(Counter::SockConnSlotBusy);
        let mut initial = *entry;
        let ptr = G::sock_revnat_sk().get_or_insert_ptr_mut(&self.ctx, Some(&mut initial));
        if ptr.is_null() {
            return false;
        }
        // SAFETY: a non-null pointer from bpf_sk_storage_get is this socket's value.
        unsafe { *ptr = *entry };
        true
    }

    #[inline(always)]
    fn load_sk<G: FamilyMaps>(&self) -> Option<SockRevNatSk<G>> {
        if let Some(entry) = sock::connection::<G>(self.cookie()) {
            return Some(entry);
        }
        let ptr = G::sock_revnat_sk().get_ptr_mut(&self.ctx);
        // SAFETY: a non-null pointer from bpf_sk_storage_get is this socket's value.
        (!ptr.is_null()).then(|| unsafe { *ptr })
    }
}

/// The parts of `SockCall` the two families' kernel calls share.
macro_rules! kernel_call_common {
    () => {
        #[inline(always)]
        fn protocol(&self) -> u8 {
            unsafe { (*self.ctx.sock_addr).protocol as u8 }
        }

        #[inline(always)]
        fn port(&self) -> u16 {
            // user_port holds the port in network order in its low 16 bits.
            u16::from_be(unsafe { (*self.ctx.sock_addr).user_port } as u16)
        }

        #[inline(always)]
        fn socket_cookie(&self) -> u64 {
            self.cookie()
        }

        #[inline(always)]
        fn netns_cookie(&self) -> u64 {
            self.netns()
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
        fn cgroup_id(&self) -> u64 {
            unsafe { bpf_get_current_cgroup_id() }
        }

        #[inline(always)]
        fn set_sk_revnat<G: FamilyMaps>(&mut self, entry: &SockRevNatSk<G>) -> bool {
            self.store_sk(entry)
        }

        #[inline(always)]
        fn sk_revnat<G: FamilyMaps>(&self) -> Option<SockRevNatSk<G>> {
            self.load_sk()
        }
    };
}

impl<const SENDMSG: bool> SockCall<V4> for KernelCall<SENDMSG> {
    kernel_call_common!();

    #[inline(always)]
    fn addr(&self) -> [u8; 4] {
        // user_ip4 holds the address in network order; its in-memory bytes are the wire bytes.
        unsafe { (*self.ctx.sock_addr).user_ip4 }.to_ne_bytes()
    }

    #[inline(always)]
    fn set_addr(&mut self, addr: [u8; 4], port: u16) {
        unsafe {
            (*self.ctx.sock_addr).user_ip4 = u32::from_ne_bytes(addr);
            (*self.ctx.sock_addr).user_port = u32::from(port.to_be());
        }
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
}

impl<const SENDMSG: bool> SockCall<V6> for KernelCall<SENDMSG> {
    kernel_call_common!();

    #[inline(always)]
    fn addr(&self) -> In6Addr {
        // The verifier allows 4-byte loads of user_ip6, one word at a time.
        unsafe {
            let s = self.ctx.sock_addr;
            In6Addr::from_words([
                (*s).user_ip6[0],
                (*s).user_ip6[1],
                (*s).user_ip6[2],
                (*s).user_ip6[3],
            ])
        }
    }

    #[inline(always)]
    fn set_addr(&mut self, addr: In6Addr, port: u16) {
        let words = addr.words();
        unsafe {
            let s = self.ctx.sock_addr;
            (*s).user_ip6[0] = words[0];
            (*s).user_ip6[1] = words[1];
            (*s).user_ip6[2] = words[2];
            (*s).user_ip6[3] = words[3];
            (*s).user_port = u32::from(port.to_be());
        }
    }

    #[inline(always)]
    fn src_addr(&self) -> In6Addr {
        unsafe {
            let s = self.ctx.sock_addr;
            if SENDMSG {
                let msg_src = In6Addr::from_words([
                    (*s).msg_src_ip6[0],
                    (*s).msg_src_ip6[1],
                    (*s).msg_src_ip6[2],
                    (*s).msg_src_ip6[3],
                ]);
                if msg_src != V6::UNSPECIFIED {
                    return msg_src;
                }
            }
            let sk = (*s).__bindgen_anon_1.sk;
            if sk.is_null() {
                return V6::UNSPECIFIED;
            }
            In6Addr::from_words([
                (*sk).src_ip6[0],
                (*sk).src_ip6[1],
                (*sk).src_ip6[2],
                (*sk).src_ip6[3],
            ])
        }
    }
}

/// cgroup sock_addr verdicts: 1 lets the call proceed; 0 fails it with the errno set by
/// `bpf_set_retval` (ECONNREFUSED or EHOSTUNREACH), or with EPERM on kernels without that
/// helper (before 5.18), as the kernel fails any refused call.
#[inline(always)]
fn sock_verdict(verdict: u32, errno: u32) -> i32 {
    match verdict {
        verdict::REJECT | verdict::DROP => {
            if lb_ebpf::features::set_retval() {
                unsafe { bpf_set_retval(-(errno as i32)) };
            }
            0
        }
        _ => 1,
    }
}

#[inline(always)]
fn forward<F: FamilyMaps, C: SockCall<F>>(call: &mut C, hook: u32) -> i32 {
    let outcome = sock::forward::<F, C>(call, hook);
    sock_verdict(outcome.verdict, outcome.errno)
}

/// An AF_INET6 call: IPv4-mapped addresses through the IPv4 code, the rest through the IPv6 code.
#[inline(always)]
fn forward6<const SENDMSG: bool>(ctx: SockAddrContext) -> i32 {
    let mut call = KernelCall::<SENDMSG> { ctx };
    let hook = if SENDMSG { hook::SENDMSG6 } else { hook::CONNECT6 };
    if sock::is_mapped::<KernelCall<SENDMSG>>(&call) {
        return forward::<V4, _>(&mut Mapped(call), hook);
    }
    forward::<V6, _>(&mut call, hook)
}

#[inline(always)]
fn reverse6(ctx: SockAddrContext) -> i32 {
    let mut call = KernelCall::<false> { ctx };
    if sock::is_mapped::<KernelCall<false>>(&call) {
        sock::translate_reverse::<V4, _>(&mut Mapped(call));
    } else {
        sock::translate_reverse::<V6, _>(&mut call);
    }
    1
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    #[cfg(lb_test_variant)]
    lb_ebpf::stats::count(lb_common::stats::Counter::TestVariant);
    forward::<V4, _>(&mut KernelCall::<false> { ctx }, hook::CONNECT4)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    forward::<V4, _>(&mut KernelCall::<true> { ctx }, hook::SENDMSG4)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate_reverse::<V4, _>(&mut KernelCall::<false> { ctx });
    1
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::translate_reverse::<V4, _>(&mut KernelCall::<false> { ctx });
    1
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    forward6::<false>(ctx)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
    forward6::<true>(ctx)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn lb_recvmsg6(ctx: SockAddrContext) -> i32 {
    reverse6(ctx)
}

#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    reverse6(ctx)
}

/// A socket closes: its slot of `lb4_sock_conn` is freed. Runs for every TCP, UDP and SCTP socket
/// of the cgroup; one that never connected to a frontend costs a read of the slot its cookie
/// names (two for an AF_INET6 socket, which may have talked IPv4 through IPv4-mapped addresses).
#[cgroup_sock(sock_release)]
pub fn lb_sock_release(ctx: SockContext) -> i32 {
    // SAFETY: the kernel's bpf_sock of the closing socket; the verifier checks each field read.
    let (family, protocol) = unsafe { ((*ctx.sock).family, (*ctx.sock).protocol) };
    if !lb_common::proto::is_balanced(protocol as u8) {
        return 1;
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if family == V6::AF {
        sock::forget_connection::<V6>(cookie);
        sock::forget_connection::<V4>(cookie);
    } else if family == V4::AF {
        sock::forget_connection::<V4>(cookie);
    }
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

/// A described socket call of family `F`, for the trace harness: the address is the first
/// bytes of `SockTraceIn::addr`.
struct TracedCall<F: Family> {
    input: SockTraceIn,
    _family: core::marker::PhantomData<F>,
}

impl<F: Family> TracedCall<F> {
    #[inline(always)]
    fn read(bytes: &[u8; 16]) -> F::Addr {
        let mut addr = F::UNSPECIFIED;
        let out = addr.as_mut();
        let mut i = 0;
        while i < out.len() && i < 16 {
            out[i] = bytes[i];
            i += 1;
        }
        addr
    }

    #[inline(always)]
    fn write(addr: &F::Addr) -> [u8; 16] {
        let mut bytes = [0; 16];
        let src = addr.as_ref();
        let mut i = 0;
        while i < src.len() && i < 16 {
            bytes[i] = src[i];
            i += 1;
        }
        bytes
    }
}

impl<F: Family> SockCall<F> for TracedCall<F> {
    fn protocol(&self) -> u8 {
        self.input.protocol as u8
    }
    fn addr(&self) -> F::Addr {
        Self::read(&self.input.addr)
    }
    fn port(&self) -> u16 {
        self.input.port
    }
    fn set_addr(&mut self, addr: F::Addr, port: u16) {
        self.input.addr = Self::write(&addr);
        self.input.port = port;
    }
    fn socket_cookie(&self) -> u64 {
        self.input.socket_cookie
    }
    fn netns_cookie(&self) -> u64 {
        self.input.netns_cookie
    }
    fn src_addr(&self) -> F::Addr {
        Self::read(&self.input.src_addr)
    }
    fn random(&self) -> u32 {
        self.input.random
    }
    fn now_ns(&self) -> u64 {
        unsafe { bpf_ktime_get_boot_ns() }
    }
    fn cgroup_id(&self) -> u64 {
        0
    }
}

/// The harness's answer for an outcome of family `F`.
#[inline(always)]
fn trace_out<F: Family>(outcome: Outcome<F>, addr: [u8; 16], port: u16) -> SockTraceOut {
    SockTraceOut {
        verdict: outcome.verdict,
        errno: outcome.errno,
        addr,
        port,
        scope: outcome.scope,
        _pad: 0,
        backend_id: outcome.backend_id,
        rev_nat_id: outcome.rev_nat_id,
        flags: u32::from(outcome.flags),
        count: u32::from(outcome.count),
    }
}

#[inline(always)]
fn traced<F: FamilyMaps>(input: SockTraceIn, forward: bool) -> SockTraceOut {
    let mut call = TracedCall::<F> {
        input,
        _family: core::marker::PhantomData,
    };
    let outcome = if forward {
        sock::translate_forward::<F, _>(&mut call)
    } else {
        sock::translate_reverse::<F, _>(&mut call)
    };
    trace_out(outcome, call.input.addr, call.input.port)
}

#[inline(always)]
fn traced6(input: SockTraceIn, forward: bool) -> SockTraceOut {
    let mut call = TracedCall::<V6> {
        input,
        _family: core::marker::PhantomData,
    };
    if !sock::is_mapped(&call) {
        return traced::<V6>(input, forward);
    }
    let mut mapped = Mapped(call);
    let outcome = if forward {
        sock::translate_forward::<V4, _>(&mut mapped)
    } else {
        sock::translate_reverse::<V4, _>(&mut mapped)
    };
    call = mapped.0;
    trace_out(outcome, call.input.addr, call.input.port)
}

/// Runs the socket translation on a `SockTraceIn` carried as packet data and writes a
/// `SockTraceOut` over it. Never attached; only run with BPF_PROG_TEST_RUN.
#[classifier]
pub fn lb_sock_trace(ctx: TcContext) -> i32 {
    let Ok(input) = ctx.load::<SockTraceIn>(0) else {
        return TC_ACT_SHOT;
    };
    // The translation without `sock::forward`'s event: a traced call is no call a monitor shows
    // (and the harness's one frame has no room for it).
    let out = match input.hook {
        hook::CONNECT4 | hook::SENDMSG4 => traced::<V4>(input, true),
        hook::RECVMSG4 | hook::GETPEERNAME4 => traced::<V4>(input, false),
        hook::CONNECT6 | hook::SENDMSG6 => traced6(input, true),
        hook::RECVMSG6 | hook::GETPEERNAME6 => traced6(input, false),
        _ => return TC_ACT_SHOT,
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

/// SCTP's packets at tc ingress, the steps of `lb_tc_ingress` in a program of its own: reached
/// by a tail call from it (`lb_tc_tail`), never attached.
#[classifier]
pub fn lb_tc_sctp_in(mut ctx: TcContext) -> i32 {
    lb_ebpf::tc::sctp_ingress(&mut ctx)
}

/// The node's own SCTP to a frontend at tc egress: DNAT and a new route to the backend. Reached
/// by a tail call from `lb_tc_egress` (`lb_tc_tail`), never attached.
#[classifier]
pub fn lb_tc_sctp_out(mut ctx: TcContext) -> i32 {
    lb_ebpf::tc::sctp_egress(&mut ctx)
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
