//! Per-packet load balancing at tc, for traffic the socket programs never see: clients outside the
//! node (NodePort, LoadBalancer IPs, externalIPs, ClusterIPs routed to the node) and pods whose
//! sockets are not translated.
//!
//! Where it happens (see `lb_common::conntrack` for the table):
//! - ingress, before routing: DNAT of new and established flows to a frontend; un-SNAT of replies
//!   to masqueraded flows (their destination is this node), which also marks the packet so the
//!   egress side restores the frontend as the source;
//! - egress, after routing: SNAT of masqueraded flows to the node IP (after routing, so the kernel
//!   never sees a forwarded packet with a local source address, which it drops as martian); and
//!   reverse DNAT of replies on the client-facing side;
//! - the node's own SCTP to a frontend (no socket hook runs for SCTP): DNAT at egress and a new
//!   route to the backend, its replies' reverse DNAT at ingress (`local`).
//!
//! The kernel routes in between: backends on other nodes are reached through the node's own
//! routing, neighbour tables and netfilter, so any CNI or overlay works unchanged.
//!
//! kube-proxy's decisions are carried by the frontend entry (`MASQUERADE`,
//! `MASQUERADE_OFF_CLUSTER`, `TWO_SCOPES`, `DROP_IF_EMPTY`, `SOURCE_RANGES`); hairpin (the chosen
//! backend is the client) is masqueraded too. A Service without endpoints is rejected with an
//! ICMP port unreachable (kube-proxy's REJECT); a Local policy without local endpoints and a source
//! outside loadBalancerSourceRanges are dropped.
//!
//! TCP, UDP and SCTP take one path; only the rewrite of an SCTP port differs (its CRC32c
//! checksum, `sctp`). IP fragments of TCP and UDP datagrams are translated: the first one as any
//! packet, the later ones with the first one's ports (`fragment`). Anything that cannot be
//! translated safely passes untouched and is counted: truncated packets, fragments whose first
//! fragment was not seen (or of SCTP, whose checksum covers the whole datagram, or other
//! protocols), SCTP while its programs are not loaded, other protocols; also IPv6 packets with
//! more than four extension headers (not counted).
//!
//! Both families go through one code path, written over `F: Ip` and monomorphised for `V4` and
//! `V6` inside each program; the Ethernet type picks the instance. One job per file; this one
//! holds the two programs' dispatch only:
//! - `ip`: what a family provides (`Ip`), and the one's-complement sums;
//! - `ipv4`, `ipv6`: each family's headers, checksums, ICMP types, port unreachable and which
//!   sources may get an ICMP error (IPv6: extension headers, no header checksum, Packet Too Big);
//! - `parse`: the packet (`Flow`, `Packet`, `Parsed`) and bounds-checked access to it;
//! - `fragment`: the ports of a fragmented datagram, from its first fragment to the later ones;
//! - `prefilter`: whether a packet may concern the programs at all (one bit of an array);
//! - `conntrack`: packets of tracked flows at ingress and egress, close and liveness notes, the
//!   un-SNAT mark, and the move of a flow from the new-flow table to the established one;
//! - `ct_filter`: whether egress may skip a packet's conntrack lookups (one byte per tuple);
//! - `new_flow`: a new flow, from the frontend lookup to its conntrack entries;
//! - `snat`: masquerade port reservation;
//! - `nat`: address and port rewriting with checksum updates;
//! - `sctp`: SCTP's port rewrite, its CRC32c checksum kept valid;
//! - `reject`: kube-proxy's REJECT (an ICMP port unreachable);
//! - `icmp_error`: ICMP errors about translated flows, at ingress and egress;
//! - `local`: the node's own SCTP to a frontend, at egress, and its replies at ingress.
//!
//! Everything is `#[inline(always)]` into the two programs, whose code the verifiers of older
//! kernels are sensitive to. Moving code between these files is not free even so: a function's
//! symbol names its module, rustc orders the LLVM module's functions by symbol, and that order can
//! change stack slots and block layout. Compare the object's program sections before and after.

mod conntrack;
mod ct_filter;
mod fragment;
mod icmp_error;
mod ip;
mod ipv4;
mod ipv6;
mod local;
mod nat;
mod new_flow;
mod parse;
mod prefilter;
mod reject;
mod sctp;
mod snat;

use aya_ebpf::{bindings::TC_ACT_OK, programs::TcContext};
use lb_common::{
    catalog,
    family::{Family, V4, V6},
    proto,
    stats::Counter,
};

pub use self::conntrack::{MARK_ID, MARK_MAGIC, MARK_MASK};
use self::{
    ip::Ip,
    parse::{ETH_HLEN, Flow, Packet, Parsed, ether_type, skb},
};
use crate::{
    lb::{self, Frontend},
    maps::TC_TAIL,
    monitor,
    stats::count,
};

/// The tc ingress program: each family's packets through its instance of the one code path.
#[inline(always)]
pub fn ingress(ctx: &mut TcContext) -> i32 {
    let verdict = match ether_type(ctx) {
        Some(V4::ETH_P) => ingress_of::<V4>(ctx),
        Some(V6::ETH_P) => ingress_of::<V6>(ctx),
        Some(_) => TC_ACT_OK,
        None => {
            count(Counter::TcTruncated);
            TC_ACT_OK
        }
    };
    if verdict != SCTP {
        return verdict;
    }
    // From this frame, the program's first: a tail call from a BPF function is limited to
    // callers whose frames use less than 256 bytes.
    // SAFETY: the program's own context; on success the call does not return.
    unsafe { TC_TAIL.tail_call(ctx, catalog::TAIL_SCTP_INGRESS) };
    no_tail_program()
}

/// An SCTP packet whose tail call found no program in its slot (an agent that has not filled
/// it): untranslated, counted. Not inlined: the counter's key would give the program's first
/// frame a stack of its own, which egress's call chain (512 bytes on 5.10 and 6.1) has no room
/// for.
#[inline(never)]
fn no_tail_program() -> i32 {
    count(Counter::TcUnsupportedProtocol);
    TC_ACT_OK
}

/// SCTP's ingress program (`lb_tc_sctp_in`): the steps of TCP and UDP, in a program of its own,
/// with the protocol a constant (`SCTP`, see `nat::apply`): the verifier cannot tell it from the
/// parsed packet, and with SCTP's rewrite beside TCP's and UDP's `lb_tc_ingress` went past its
/// million instructions. Also the replies to the node's own associations (`local::reply`).
#[inline(always)]
pub fn sctp_ingress(ctx: &mut TcContext) -> i32 {
    match ether_type(ctx) {
        Some(V4::ETH_P) => sctp_ingress_of::<V4>(ctx),
        Some(V6::ETH_P) => sctp_ingress_of::<V6>(ctx),
        _ => TC_ACT_OK,
    }
}

/// SCTP's egress program (`lb_tc_sctp_out`): the node's own SCTP to a frontend, which
/// `lb_tc_egress` sends here (`local`).
#[inline(always)]
pub fn sctp_egress(ctx: &mut TcContext) -> i32 {
    match ether_type(ctx) {
        Some(V4::ETH_P) => sctp_egress_of::<V4>(ctx),
        Some(V6::ETH_P) => sctp_egress_of::<V6>(ctx),
        _ => TC_ACT_OK,
    }
}

/// A verdict of `ingress_of` (`egress_of`): an SCTP packet that may concern a frontend, for
/// `lb_tc_sctp_in` (`lb_tc_sctp_out`). Not one tc knows (they are small non-negative numbers, and
/// -1, `TC_ACT_UNSPEC`).
const SCTP: i32 = -1000;

/// Not inlined, as `ingress_of`; parses again (a tail call passes only the packet). A packet from
/// a backend may be a reply to the node's own association; else the steps of any SCTP packet.
#[inline(never)]
fn sctp_ingress_of<F: Steps>(ctx: &mut TcContext) -> i32 {
    match F::parse(ctx) {
        Parsed::L4(pkt) if pkt.flow.proto == proto::SCTP => {
            if prefilter::egress_end::<F>((&pkt.flow.saddr, pkt.flow.sport)) {
                let verdict = local::reply::<F>(ctx, &pkt);
                if verdict != local::NOT_LOCAL {
                    return verdict;
                }
            }
            if prefilter::ingress::<F>(&pkt.flow.daddr, pkt.flow.dport) {
                l4_ingress::<F, true>(ctx, &pkt)
            } else {
                TC_ACT_OK
            }
        }
        _ => TC_ACT_OK,
    }
}

/// Not inlined, as `egress_of`; parses again.
#[inline(never)]
fn sctp_egress_of<F: Steps>(ctx: &mut TcContext) -> i32 {
    match F::parse(ctx) {
        Parsed::L4(pkt) if pkt.flow.proto == proto::SCTP => local::forward::<F>(ctx, &pkt),
        _ => TC_ACT_OK,
    }
}

/// Not inlined: each family's instance is a BPF function of its own, with its own stack frame
/// (inlined together, the two instances' locals overflow the 512 bytes a frame may have). Its
/// frame holds the parsed packet; each path is called from here (tracked flows, the new-flow
/// steps, REJECT, ICMP errors), one after the other rather than one inside another: the kernel
/// limits the frames of a call chain to 512 bytes in all. Tracked flows are inline for IPv4
/// ([`Steps`]).
#[inline(never)]
fn ingress_of<F: Steps>(ctx: &mut TcContext) -> i32 {
    match F::parse(ctx) {
        Parsed::Skip => TC_ACT_OK,
        Parsed::Truncated => untranslated::<F>(ctx, None, Counter::TcTruncated),
        Parsed::Fragment => untranslated::<F>(ctx, None, Counter::TcFragment),
        Parsed::Icmp(l4, outer) => icmp_error::icmp_error_ingress::<F>(ctx, l4, &outer),
        Parsed::Later(flow) if !prefilter::ingress_address::<F>(&flow.daddr) => TC_ACT_OK,
        Parsed::Later(flow) => match fragment::ingress::<F>(ctx, &flow) {
            fragment::UNFOLLOWED => untranslated::<F>(ctx, Some(&flow), Counter::TcFragment),
            verdict => verdict,
        },
        // SCTP to a frontend or a masquerade address, or from a backend (a reply to the node's
        // own association, `local`): `lb_tc_sctp_in`'s.
        Parsed::L4(pkt) if pkt.flow.proto == proto::SCTP => {
            if prefilter::ingress::<F>(&pkt.flow.daddr, pkt.flow.dport)
                || prefilter::egress_end::<F>((&pkt.flow.saddr, pkt.flow.sport))
            {
                SCTP
            } else {
                TC_ACT_OK
            }
        }
        // Neither a frontend's (address, port) nor a masquerade address's port: nothing to look up.
        Parsed::L4(pkt) if !prefilter::ingress::<F>(&pkt.flow.daddr, pkt.flow.dport) => TC_ACT_OK,
        Parsed::L4(pkt) => l4_ingress::<F, false>(ctx, &pkt),
    }
}

/// A TCP or UDP packet at ingress, or with `SCTP` an SCTP one (the program's protocol, see
/// `nat::apply`): its tracked flow, else a new one.
#[inline(always)]
fn l4_ingress<F: Steps, const SCTP: bool>(ctx: &mut TcContext, pkt: &Packet<F>) -> i32 {
    let mut verdict = F::l4_ingress::<SCTP>(ctx, pkt);
    if verdict == conntrack::ESTABLISH {
        verdict = conntrack::establish::<F, SCTP>(ctx, pkt);
    }
    match verdict {
        conntrack::NEW_FLOW => new_flow::new_flow::<F, SCTP, false>(ctx, pkt),
        verdict => verdict,
    }
}

/// A packet that passes untranslated though it may concern a frontend: counted, and reported to
/// a listening monitor.
#[inline(always)]
fn untranslated<F: Ip>(ctx: &TcContext, flow: Option<&Flow<F>>, counter: Counter) -> i32 {
    count(counter);
    if monitor::wanted(counter as u32) {
        new_flow::event::<F, false>(ctx, flow, None, counter as u32);
    }
    TC_ACT_OK
}

/// The loopback interface's index in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

/// The tc egress program.
#[inline(always)]
pub fn egress(ctx: &mut TcContext) -> i32 {
    let verdict = match ether_type(ctx) {
        Some(V4::ETH_P) => egress_of::<V4>(ctx),
        Some(V6::ETH_P) => egress_of::<V6>(ctx),
        _ => TC_ACT_OK,
    };
    if verdict != SCTP {
        return verdict;
    }
    // The node's own SCTP to a frontend: from the program's first frame, as at ingress.
    // SAFETY: the program's own context; on success the call does not return.
    unsafe { TC_TAIL.tail_call(ctx, catalog::TAIL_SCTP_EGRESS) };
    no_tail_program()
}

/// Not inlined, as `ingress_of`.
#[inline(never)]
fn egress_of<F: Steps>(ctx: &mut TcContext) -> i32 {
    // SAFETY: the context's skb pointer is valid for the program's run.
    let (mark, ingress_ifindex, ifindex) = unsafe {
        let skb = skb(ctx);
        ((*skb).mark, (*skb).ingress_ifindex, (*skb).ifindex)
    };
    let ours = mark & MARK_MASK == MARK_MAGIC;
    // A packet this node sends (no ingress interface) is never SNATed: SNAT entries are made for
    // flows that came in at tc ingress and are forwarded. Only its source can make it a tracked
    // flow's (a reply of a backend of this node), so its destination needs no lookup: connections
    // of the node's own sockets (host network namespace -> backend) skip the conntrack tables; a
    // pod's socket-translated connection crosses the node forwarded and stops at the flow filter
    // (`ct_filter`). On loopback, where the agent never attaches and BPF_PROG_TEST_RUN runs every
    // packet, each is looked up as forwarded.
    let may_be_snat = ingress_ifindex != 0 || ifindex == LOOPBACK_IFINDEX;
    // The node's own SCTP to a frontend: `lb_tc_sctp_out`'s. One byte tells the node's TCP and
    // UDP apart at once; the rest is parsed and looked up in a frame of its own.
    if !may_be_snat
        && ctx.load::<u8>(ETH_HLEN + F::PROTO).is_ok_and(F::may_be_sctp)
        && local_sctp_to_frontend::<F>(ctx)
    {
        return SCTP;
    }
    match F::parse(ctx) {
        Parsed::L4(pkt) => {
            let from_backend = prefilter::egress_end::<F>((&pkt.flow.saddr, pkt.flow.sport));
            // A backend's end, and a tuple the flow filter holds: the packet of a connection the
            // socket programs translated (always a backend's) stops at the filter.
            if ours
                || (from_backend
                    || may_be_snat && prefilter::egress_end::<F>((&pkt.flow.daddr, pkt.flow.dport)))
                    && ct_filter::may_be_tracked::<F>(&pkt.flow)
            {
                match F::egress_rewrite(ctx, &pkt, mark, from_backend) {
                    Some((addr, port)) => nat::apply_source::<F>(ctx, &pkt, addr, port),
                    None => TC_ACT_OK,
                }
            } else {
                TC_ACT_OK
            }
        }
        Parsed::Later(flow) => {
            let from_backend = prefilter::egress_end::<F>((&flow.saddr, flow.sport));
            if ours || from_backend || may_be_snat && prefilter::egress_end::<F>((&flow.daddr, flow.dport)) {
                fragment::egress::<F>(ctx, &flow, mark, ours)
            } else {
                TC_ACT_OK
            }
        }
        Parsed::Icmp(icmp, _) => icmp_error::icmp_error_egress::<F>(ctx, icmp, mark, ours),
        _ => TC_ACT_OK,
    }
}

/// Whether the packet is the node's own SCTP to a frontend: no socket hook ran (the kernel runs
/// none for an SCTP connect or sendmsg), so `lb_tc_sctp_out` translates and routes it (`local`).
/// Not inlined, and parsing on its own: the parsed packet and the frontend key would take room
/// in `egress_of`'s frame, which its call chain does not have on 5.10 and 6.1.
#[inline(never)]
fn local_sctp_to_frontend<F: Ip>(ctx: &TcContext) -> bool {
    match F::parse(ctx) {
        Parsed::L4(pkt) => {
            let flow = &pkt.flow;
            flow.proto == proto::SCTP
                && prefilter::ingress::<F>(&flow.daddr, flow.dport)
                && !matches!(
                    lb::lookup_frontend::<F>(&flow.daddr, flow.dport, proto::SCTP, true),
                    Frontend::None
                )
        }
        _ => false,
    }
}

/// Where a family's tracked flows are handled, at ingress and at egress: in `ingress_of`'s and
/// `egress_of`'s frames for IPv4, in BPF functions of their own for IPv6. The most frequent
/// packet, one of an established flow, then costs IPv4 no BPF-to-BPF call (a call, a frame,
/// spilled arguments) beyond the program's; IPv4's locals fit beside REJECT's frame (ingress) and
/// the ICMP and fragment paths' (egress) in the 512 bytes a call chain may use on 5.10 and 6.1,
/// IPv6's (addresses of 16 bytes, keys of 40) do not. At egress the step returns the source to
/// write and `egress_of` rewrites: the rewrite's frames (SCTP's checksum update and its global
/// function, which 5.10 counts in the chain too) stay beside the step's, not below it. The code
/// is written once over `F: Ip`; only where its frame begins differs.
trait Steps: Ip {
    fn l4_ingress<const SCTP: bool>(ctx: &mut TcContext, pkt: &Packet<Self>) -> i32;
    fn egress_rewrite(
        ctx: &mut TcContext,
        pkt: &Packet<Self>,
        mark: u32,
        from_backend: bool,
    ) -> Option<(Self::Addr, u16)>;
}

impl Steps for V4 {
    #[inline(always)]
    fn l4_ingress<const SCTP: bool>(ctx: &mut TcContext, pkt: &Packet<Self>) -> i32 {
        conntrack::l4_ingress::<V4, SCTP>(ctx, pkt)
    }

    #[inline(always)]
    fn egress_rewrite(
        ctx: &mut TcContext,
        pkt: &Packet<Self>,
        mark: u32,
        from_backend: bool,
    ) -> Option<(Self::Addr, u16)> {
        conntrack::egress_rewrite::<V4>(ctx, pkt, mark, from_backend)
    }
}

impl Steps for V6 {
    #[inline(never)]
    fn l4_ingress<const SCTP: bool>(ctx: &mut TcContext, pkt: &Packet<Self>) -> i32 {
        conntrack::l4_ingress::<V6, SCTP>(ctx, pkt)
    }

    #[inline(never)]
    fn egress_rewrite(
        ctx: &mut TcContext,
        pkt: &Packet<Self>,
        mark: u32,
        from_backend: bool,
    ) -> Option<(Self::Addr, u16)> {
        conntrack::egress_rewrite::<V6>(ctx, pkt, mark, from_backend)
    }
}
