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
//!   reverse DNAT of replies on the client-facing side.
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
//! Anything that cannot be translated safely passes untouched and is counted: truncated packets,
//! fragments, SCTP (its CRC32c checksum cannot be updated incrementally), other protocols.

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns, bpf_redirect},
    programs::TcContext,
};
use lb_common::{
    affinity::kind,
    conntrack::{Ct4Key, Ct4Value, dir, flags as ct},
    proto,
    revnat::RevNat4Value,
    service::flags,
    stats::Counter,
    trace::{tc as trace_cb, verdict},
};
use network_types::{eth::EthHdr, ip::Ipv4Hdr};

use crate::{
    features,
    lb::{self, Frontend},
    maps::{CONNTRACK, REJECT_LIMIT, REVNAT},
    stats::count,
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
/// Offsets inside the IPv4 header.
const IP_CHECK: usize = 10;
const IP_SADDR: usize = 12;
const IP_DADDR: usize = 16;
/// Offsets inside TCP and UDP headers.
const L4_SPORT: usize = 0;
const L4_DPORT: usize = 2;
const TCP_FLAGS: usize = 13;
const TCP_CHECK: usize = 16;
const UDP_CHECK: usize = 6;
const ICMP_CHECK: usize = 2;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
/// How often a UDP reply refreshes its entry's `last_seen_ns` (the GC's idle clock).
const UDP_REPLY_REFRESH_NS: u64 = 1_000_000_000;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;
const EEXIST: i64 = 17;

/// A SYN on a tracked TCP tuple older than this starts a new connection (a port reused after
/// close); a younger one is a retransmission and keeps its backend.
const SYN_REUSE_NS: u64 = 1_000_000_000;
/// Masquerade port attempts before giving up on a destination.
const SNAT_ATTEMPTS: u32 = 8;

/// skb->mark set by ingress on an un-SNATed reply so that egress restores the frontend as its
/// source: `MARK_MAGIC | rev_nat_id`. Cleared by egress.
pub const MARK_MAGIC: u32 = 0x5EA0_0000;
pub const MARK_MASK: u32 = 0xFFF0_0000;
pub const MARK_ID: u32 = 0x000F_FFFF;

/// The 5-tuple of a packet, addresses in network order, ports in host order.
#[derive(Clone, Copy)]
struct Flow {
    saddr: [u8; 4],
    daddr: [u8; 4],
    sport: u16,
    dport: u16,
    proto: u8,
}

impl Flow {
    #[inline(always)]
    fn key(&self, direction: u8) -> Ct4Key {
        Ct4Key {
            saddr: self.saddr,
            daddr: self.daddr,
            sport: self.sport,
            dport: self.dport,
            proto: self.proto,
            dir: direction,
            _pad: [0; 2],
        }
    }
}

#[derive(Clone, Copy)]
struct Packet {
    /// Offset of the L4 header.
    l4: usize,
    flow: Flow,
    tcp_flags: u8,
}

enum Parsed {
    /// Not IPv4, or not a protocol we look at.
    Skip,
    Truncated,
    Fragment,
    /// TCP, UDP or SCTP (ports only).
    L4(Packet),
    /// ICMP: the offset of the ICMP header and the outer addresses.
    Icmp(usize, Flow),
}

/// Bounds-checked pointer into the packet.
#[inline(always)]
fn ptr_at<T>(ctx: &TcContext, off: usize) -> Option<*mut T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + core::mem::size_of::<T>() > end {
        return None;
    }
    Some((start + off) as *mut T)
}

/// Reads a `T` at the L4 offset: direct packet access at a constant offset in the common case (no
/// IP options), else through `bpf_skb_load_bytes` (the verifier cannot follow a variable offset
/// into the packet).
#[inline(always)]
fn read_l4<T: Copy>(ctx: &TcContext, l4: usize) -> Option<T> {
    if l4 == ETH_HLEN + Ipv4Hdr::LEN {
        ptr_at::<T>(ctx, ETH_HLEN + Ipv4Hdr::LEN).map(|p| unsafe { *p })
    } else {
        ctx.load::<T>(l4).ok()
    }
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Parsed {
    let Some(eth) = ptr_at::<EthHdr>(ctx, 0) else {
        return Parsed::Truncated;
    };
    if u16::from_be(unsafe { (*eth).ether_type }) != ETH_P_IP {
        return Parsed::Skip;
    }
    let Some(ip) = ptr_at::<Ipv4Hdr>(ctx, ETH_HLEN) else {
        return Parsed::Truncated;
    };
    let ip = unsafe { *ip };
    if ip.vihl >> 4 != 4 {
        return Parsed::Skip;
    }
    let ihl = ((ip.vihl & 0x0f) as usize) << 2;
    if ihl < Ipv4Hdr::LEN {
        return Parsed::Truncated;
    }
    // More-fragments set, or a non-zero offset: no (or not this packet's) L4 header.
    if u16::from_be_bytes(ip.frags) & 0x3fff != 0 {
        return Parsed::Fragment;
    }
    let l4 = ETH_HLEN + ihl;
    let mut flow = Flow {
        saddr: ip.src_addr,
        daddr: ip.dst_addr,
        sport: 0,
        dport: 0,
        proto: ip.proto,
    };
    match ip.proto {
        proto::TCP => {
            let Some(tcp) = read_l4::<[u8; 20]>(ctx, l4) else {
                return Parsed::Truncated;
            };
            flow.sport = u16::from_be_bytes([tcp[0], tcp[1]]);
            flow.dport = u16::from_be_bytes([tcp[2], tcp[3]]);
            Parsed::L4(Packet {
                l4,
                flow,
                tcp_flags: tcp[TCP_FLAGS],
            })
        }
        proto::UDP | proto::SCTP => {
            let Some(ports) = read_l4::<[u8; 8]>(ctx, l4) else {
                return Parsed::Truncated;
            };
            flow.sport = u16::from_be_bytes([ports[0], ports[1]]);
            flow.dport = u16::from_be_bytes([ports[2], ports[3]]);
            Parsed::L4(Packet {
                l4,
                flow,
                tcp_flags: 0,
            })
        }
        proto::ICMP => {
            if read_l4::<[u8; 8]>(ctx, l4).is_none() {
                return Parsed::Truncated;
            }
            Parsed::Icmp(l4, flow)
        }
        _ => Parsed::Skip,
    }
}

#[inline(always)]
fn now_ns() -> u64 {
    // Both read CLOCK_MONOTONIC; the coarse one is cheaper and precise enough for timeouts.
    if features::ktime_coarse() {
        unsafe { bpf_ktime_get_coarse_ns() }
    } else {
        unsafe { bpf_ktime_get_ns() }
    }
}

#[inline(always)]
fn skb(ctx: &TcContext) -> *mut __sk_buff {
    ctx.as_ptr() as *mut __sk_buff
}

/// Rewrites the destination (`source == false`) or source address and port of a TCP/UDP packet,
/// with the IP and L4 checksums updated incrementally.
#[inline(always)]
fn rewrite(ctx: &TcContext, pkt: &Packet, source: bool, addr: [u8; 4], port: u16) -> Result<(), ()> {
    let (old_addr, old_port, ip_off, port_off) = if source {
        (
            pkt.flow.saddr,
            pkt.flow.sport,
            ETH_HLEN + IP_SADDR,
            pkt.l4 + L4_SPORT,
        )
    } else {
        (
            pkt.flow.daddr,
            pkt.flow.dport,
            ETH_HLEN + IP_DADDR,
            pkt.l4 + L4_DPORT,
        )
    };
    let (csum_off, mangled) = if pkt.flow.proto == proto::UDP {
        // A UDP checksum of zero means "none" and must stay zero.
        (pkt.l4 + UDP_CHECK, BPF_F_MARK_MANGLED_0 as u64)
    } else {
        (pkt.l4 + TCP_CHECK, 0)
    };
    let (from, to) = (
        u32::from_ne_bytes(old_addr) as u64,
        u32::from_ne_bytes(addr) as u64,
    );
    // The L4 checksum always goes through the helper: only the kernel knows how it holds it (the
    // full sum, or the pseudo-header sum of an offloaded packet) and keeps skb->csum right.
    if old_addr != addr {
        ctx.l4_csum_replace(csum_off, from, to, BPF_F_PSEUDO_HDR as u64 | mangled | 4)
            .map_err(|_| ())?;
    }
    if old_port != port {
        ctx.l4_csum_replace(
            csum_off,
            old_port.to_be() as u64,
            port.to_be() as u64,
            mangled | 2,
        )
        .map_err(|_| ())?;
    }
    if pkt.l4 == ETH_HLEN + Ipv4Hdr::LEN {
        // No IP options (the common case): the address, the IP header checksum (plain software,
        // never offloaded) and the port are written in place, which saves three helper calls a
        // packet. Taken after the helpers, which invalidate packet pointers.
        //
        // One pointer to the headers and offsets that are constants here (`source` is a constant
        // at every call site), never derived from `pkt.l4`: given an offset computed from the
        // IP header length, LLVM may rebuild the pointer from that variable, which verifiers
        // before 6.8 cannot bound ("R1 offset is outside of the packet" on 6.1).
        const L4_AT: usize = ETH_HLEN + Ipv4Hdr::LEN;
        let port_at = if source {
            L4_AT + L4_SPORT
        } else {
            L4_AT + L4_DPORT
        };
        let Some(headers) = ptr_at::<[u8; L4_AT + 4]>(ctx, 0) else {
            return Err(());
        };
        let headers = headers as *mut u8;
        // SAFETY: every offset below is a constant inside the bounds-checked `headers`.
        unsafe {
            if old_addr != addr {
                let check_at = headers.add(ETH_HLEN + IP_CHECK) as *mut [u8; 2];
                let check = u16::from_be_bytes(*check_at);
                // RFC 1624: HC' = ~(~HC + ~m + m').
                let sum = csum_add_bytes(!check as u32, &addr) + csum_add_bytes(0, &old_addr.map(|b| !b));
                *check_at = csum_fold(sum).to_be_bytes();
                *(headers.add(ip_off) as *mut [u8; 4]) = addr;
            }
            if old_port != port {
                *(headers.add(port_at) as *mut [u8; 2]) = port.to_be_bytes();
            }
        }
        return Ok(());
    }
    if old_addr != addr {
        ctx.l3_csum_replace(ETH_HLEN + IP_CHECK, from, to, 4)
            .map_err(|_| ())?;
        ctx.store(ip_off, &addr, 0).map_err(|_| ())?;
    }
    if old_port != port {
        ctx.store(port_off, &port.to_be_bytes(), 0).map_err(|_| ())?;
    }
    Ok(())
}

#[inline(always)]
fn apply(ctx: &TcContext, pkt: &Packet, source: bool, addr: [u8; 4], port: u16) -> i32 {
    match rewrite(ctx, pkt, source, addr, port) {
        Ok(()) => TC_ACT_OK,
        Err(()) => {
            count(Counter::TcRewriteFailed);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn trace(ctx: &mut TcContext, slot: usize, value: u32) {
    if slot < 5 {
        ctx.cb_mut()[slot] = value;
    }
}

/// The tc ingress program.
#[inline(always)]
pub fn ingress(ctx: &mut TcContext) -> i32 {
    match parse(ctx) {
        Parsed::Skip => TC_ACT_OK,
        Parsed::Truncated => {
            count(Counter::TcTruncated);
            TC_ACT_OK
        }
        Parsed::Fragment => {
            count(Counter::TcFragment);
            TC_ACT_OK
        }
        Parsed::Icmp(l4, outer) => icmp_error_ingress(ctx, l4, &outer),
        Parsed::L4(pkt) if pkt.flow.proto == proto::SCTP => {
            if !matches!(
                lb::lookup_frontend(pkt.flow.daddr, pkt.flow.dport, proto::SCTP, false),
                Frontend::None
            ) {
                count(Counter::TcUnsupportedProtocol);
            }
            TC_ACT_OK
        }
        Parsed::L4(pkt) => l4_ingress(ctx, &pkt),
    }
}

#[inline(always)]
fn l4_ingress(ctx: &mut TcContext, pkt: &Packet) -> i32 {
    let key = pkt.flow.key(dir::INGRESS);
    if let Some(ptr) = CONNTRACK.get_ptr_mut(&key) {
        let entry = unsafe { *ptr };
        if entry.flags & ct::REPLY != 0 {
            // A reply to a masqueraded flow: back to the client, and egress restores the frontend.
            note_reply(ptr, pkt);
            ctx.set_mark(MARK_MAGIC | (entry.rev_nat_id & MARK_ID));
            return apply(ctx, pkt, false, entry.nat_addr, entry.nat_port);
        }
        let keep = if pkt.flow.proto == proto::TCP {
            // A fresh SYN on an old tuple is a new connection; everything else keeps its backend.
            pkt.tcp_flags & (TCP_SYN | TCP_ACK) != TCP_SYN
                || now_ns().saturating_sub(entry.created_ns) < SYN_REUSE_NS
        } else {
            // UDP has no connection end: a flow whose backend is gone moves to a live one (the
            // stale-UDP-conntrack problem of kube-proxy).
            let alive = lb::lookup_backend(entry.backend_id)
                .is_some_and(|b| b.addr == entry.nat_addr && b.port == entry.nat_port);
            if alive {
                unsafe { (*ptr).last_seen_ns = now_ns() };
            } else {
                count(Counter::TcStaleUdpMoved);
            }
            alive
        };
        if keep {
            note_close(ptr, pkt, ct::FIN_FORWARD);
            return apply(ctx, pkt, false, entry.nat_addr, entry.nat_port);
        }
    }
    new_flow(ctx, pkt)
}

/// Close tracking for the agent's conntrack GC: the first FIN (in `fin` direction) or RST that
/// passes a TCP entry marks it, with the time. One map write per closing packet, none for others.
#[inline(always)]
fn note_close(ptr: *mut Ct4Value, pkt: &Packet, fin: u16) {
    if pkt.flow.proto != proto::TCP {
        return;
    }
    let mark = if pkt.tcp_flags & TCP_RST != 0 {
        ct::RESET
    } else if pkt.tcp_flags & TCP_FIN != 0 {
        fin
    } else {
        return;
    };
    // SAFETY: `ptr` points into a map value the caller just looked up.
    unsafe {
        if (*ptr).flags & mark == 0 {
            (*ptr).flags |= mark;
            (*ptr).last_seen_ns = now_ns();
        }
    }
}

/// A packet from the backend on one of its flow's reply entries: TCP closes are marked, and a
/// UDP flow whose traffic is all replies stays alive for the GC (refreshed at most once a second).
#[inline(always)]
fn note_reply(ptr: *mut Ct4Value, pkt: &Packet) {
    if pkt.flow.proto == proto::UDP {
        let now = now_ns();
        // SAFETY: as in `note_close`.
        unsafe {
            if now.saturating_sub((*ptr).last_seen_ns) >= UDP_REPLY_REFRESH_NS {
                (*ptr).last_seen_ns = now;
            }
        }
    } else {
        note_close(ptr, pkt, ct::FIN_REPLY);
    }
}

#[inline(always)]
fn new_flow(ctx: &mut TcContext, pkt: &Packet) -> i32 {
    let flow = pkt.flow;
    let cfg = lb::datapath_config();
    // kube-proxy's local-traffic detector: pods (sources in the cluster CIDR) short-circuit a
    // Local-policy external frontend to the cluster-wide endpoints, and are not masqueraded when
    // they reach a cluster IP.
    let from_pod = cfg.is_pod_address(flow.saddr) == Some(true);
    let (key, frontend) = match lb::lookup_frontend(flow.daddr, flow.dport, flow.proto, from_pod) {
        Frontend::None => return TC_ACT_OK,
        Frontend::Incomplete => {
            count(Counter::TcNoBackend);
            return TC_ACT_OK;
        }
        Frontend::Found(key, entry) => (key, entry),
    };
    trace(ctx, trace_cb::CB_REV_NAT_ID, frontend.rev_nat_id);
    trace(ctx, trace_cb::CB_FRONTEND_FLAGS, frontend.flags as u32);
    trace(ctx, trace_cb::CB_SCOPE_FLAGS, key.scope as u32);

    if frontend.has(flags::SOURCE_RANGES) && !lb::source_in_ranges(&frontend, flow.saddr) {
        count(Counter::SourceRangeDenied);
        trace(ctx, trace_cb::CB_VERDICT, verdict::DROP);
        return TC_ACT_SHOT;
    }
    if frontend.count == 0 {
        if frontend.has(flags::DROP_IF_EMPTY) {
            count(Counter::TcDropped);
            trace(ctx, trace_cb::CB_VERDICT, verdict::DROP);
            return TC_ACT_SHOT;
        }
        count(Counter::TcRejected);
        trace(ctx, trace_cb::CB_VERDICT, verdict::REJECT);
        return reject(ctx, pkt);
    }

    let now = now_ns();
    let client = u32::from_ne_bytes(flow.saddr) as u64;
    let hash = unsafe { bpf_get_prandom_u32() };
    let Some((backend_id, backend)) = lb::select_backend(&key, &frontend, client, kind::ADDR, hash, now)
    else {
        count(Counter::TcNoBackend);
        return TC_ACT_OK;
    };
    // A backend at this node's own address (a hostNetwork endpoint) is delivered locally: the
    // packet never reaches egress, where masquerading happens. As with kube-proxy, whose
    // POSTROUTING MASQUERADE never sees a locally delivered packet, it keeps the client's address
    // and its replies get the frontend back on their way out.
    let local_backend = backend.addr == cfg.snat_addr;
    let mut masquerade = !local_backend
        && (frontend.has(flags::MASQUERADE)
            || (frontend.has(flags::MASQUERADE_OFF_CLUSTER) && !from_pod)
            // Hairpin: the reply must come back through this node to be translated.
            || backend.addr == flow.saddr);

    let base = Ct4Value {
        created_ns: now,
        last_seen_ns: now,
        nat_addr: [0; 4],
        nat_port: 0,
        flags: 0,
        rev_nat_id: frontend.rev_nat_id,
        backend_id,
    };
    let reply_tuple = Flow {
        saddr: backend.addr,
        daddr: flow.saddr,
        sport: backend.port,
        dport: flow.sport,
        proto: flow.proto,
    };
    // The tuple this flow has on the wire after DNAT; egress masquerades it when it carries an
    // SNAT entry.
    let fwd_after_dnat = Flow {
        saddr: flow.saddr,
        daddr: backend.addr,
        sport: flow.sport,
        dport: backend.port,
        proto: flow.proto,
    };
    if !masquerade {
        // Replies (backend -> client) get the frontend back as their source on the way out. If a
        // live flow already owns that tuple (the same client port to two frontends with a shared
        // backend), masquerade this one so both stay unambiguous.
        let undnat = Ct4Value {
            nat_addr: flow.daddr,
            nat_port: flow.dport,
            flags: ct::REPLY,
            ..base
        };
        let key = reply_tuple.key(dir::EGRESS);
        match CONNTRACK.insert(&key, &undnat, BPF_NOEXIST as u64) {
            Ok(()) => {}
            Err(e) if e as i64 == -EEXIST => {
                let same = CONNTRACK
                    .get_ptr(&key)
                    .map(|p| unsafe { *p })
                    .is_some_and(|old| old.nat_addr == flow.daddr && old.nat_port == flow.dport);
                if same {
                    let _ = CONNTRACK.insert(&key, &undnat, 0);
                } else {
                    masquerade = true;
                }
            }
            Err(_) => {
                count(Counter::TcCtInsertFailed);
                return TC_ACT_SHOT;
            }
        }
    }
    if !masquerade {
        // An earlier masqueraded flow from this client port to this backend through another
        // frontend leaves an SNAT entry for the same post-DNAT tuple; left in place it would
        // masquerade this flow too and its replies would go back as the wrong frontend. Egress
        // cannot tell two such flows apart, so the newest owns the tuple.
        let _ = CONNTRACK.remove(&fwd_after_dnat.key(dir::EGRESS));
    }
    if masquerade {
        let Some(port) = reserve_snat_port(&cfg, &reply_tuple, &flow, &base) else {
            count(Counter::TcSnatPortsExhausted);
            return TC_ACT_SHOT;
        };
        let snat = Ct4Value {
            nat_addr: cfg.snat_addr,
            nat_port: port,
            flags: ct::SNAT,
            ..base
        };
        if CONNTRACK
            .insert(&fwd_after_dnat.key(dir::EGRESS), &snat, 0)
            .is_err()
        {
            count(Counter::TcCtInsertFailed);
            return TC_ACT_SHOT;
        }
        count(Counter::TcMasqueraded);
    }
    let mut fwd_flags = if masquerade { ct::SNAT } else { 0 };
    if backend.addr == flow.saddr {
        fwd_flags |= ct::HAIRPIN;
    }
    let dnat = Ct4Value {
        nat_addr: backend.addr,
        nat_port: backend.port,
        flags: fwd_flags,
        ..base
    };
    if CONNTRACK.insert(&flow.key(dir::INGRESS), &dnat, 0).is_err() {
        count(Counter::TcCtInsertFailed);
        return TC_ACT_SHOT;
    }
    count(Counter::TcNewFlow);
    trace(ctx, trace_cb::CB_VERDICT, verdict::TRANSLATED);
    trace(ctx, trace_cb::CB_BACKEND_ID, backend_id);
    trace(
        ctx,
        trace_cb::CB_SCOPE_FLAGS,
        key.scope as u32 | if masquerade { trace_cb::MASQUERADED } else { 0 },
    );
    apply(ctx, pkt, false, backend.addr, backend.port)
}

/// Reserves a masquerade port: the un-SNAT entry (backend -> node IP:port) is inserted with
/// BPF_NOEXIST, so a port in use for this backend is never handed out twice.
#[inline(always)]
fn reserve_snat_port(
    cfg: &lb_common::config::DatapathConfig,
    reply: &Flow,
    client: &Flow,
    base: &Ct4Value,
) -> Option<u16> {
    if cfg.snat_addr == [0; 4] || cfg.snat_port_max < cfg.snat_port_min {
        return None;
    }
    let range = (cfg.snat_port_max - cfg.snat_port_min) as u32 + 1;
    let start = unsafe { bpf_get_prandom_u32() };
    let unsnat = Ct4Value {
        nat_addr: client.saddr,
        nat_port: client.sport,
        flags: ct::REPLY | ct::SNAT,
        ..*base
    };
    for attempt in 0..SNAT_ATTEMPTS {
        let port = cfg.snat_port_min + (start.wrapping_add(attempt.wrapping_mul(7919)) % range) as u16;
        let key = Ct4Key {
            saddr: reply.saddr,
            daddr: cfg.snat_addr,
            sport: reply.sport,
            dport: port,
            proto: reply.proto,
            dir: dir::INGRESS,
            _pad: [0; 2],
        };
        if CONNTRACK.insert(&key, &unsnat, BPF_NOEXIST as u64).is_ok() {
            return Some(port);
        }
    }
    None
}

/// One's-complement sum of big-endian 16-bit words.
#[inline(always)]
fn csum_add_bytes<const N: usize>(mut sum: u32, bytes: &[u8; N]) -> u32 {
    let mut i = 0;
    while i + 1 < N {
        sum += u16::from_be_bytes([bytes[i], bytes[i + 1]]) as u32;
        i += 2;
    }
    sum
}

#[inline(always)]
fn csum_fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// kube-proxy's REJECT: turn the packet into an ICMP port unreachable for the client and send it
/// back out of the interface it came in on. Like the kernel's `icmp_send` behind iptables' REJECT,
/// it never answers a source an ICMP error may not go to, and answers at a bounded rate; either
/// way the packet itself is dropped.
#[inline(always)]
fn reject(ctx: &TcContext, pkt: &Packet) -> i32 {
    let Ok(head) = ctx.load::<[u8; ETH_HLEN + Ipv4Hdr::LEN]>(0) else {
        return TC_ACT_SHOT;
    };
    let source = [head[26], head[27], head[28], head[29]];
    // A link-layer broadcast or multicast frame (group bit of the destination MAC).
    if head[0] & 1 != 0 || !answerable(source) {
        count(Counter::TcRejectUnanswerable);
        return TC_ACT_SHOT;
    }
    let allowed = REJECT_LIMIT
        .get_ptr_mut(0)
        .is_some_and(|bucket| unsafe { (*bucket).take(now_ns()) });
    if !allowed {
        count(Counter::TcRejectRateLimited);
        return TC_ACT_SHOT;
    }
    // The ICMP payload quotes the whole original IP header (options included) and the first 8
    // bytes of L4; one fixed-size copy per header length keeps the verifier happy.
    match (pkt.l4 - ETH_HLEN) / 4 {
        5 => reject_quoting::<28>(ctx),
        6 => reject_quoting::<32>(ctx),
        7 => reject_quoting::<36>(ctx),
        8 => reject_quoting::<40>(ctx),
        9 => reject_quoting::<44>(ctx),
        10 => reject_quoting::<48>(ctx),
        11 => reject_quoting::<52>(ctx),
        12 => reject_quoting::<56>(ctx),
        13 => reject_quoting::<60>(ctx),
        14 => reject_quoting::<64>(ctx),
        15 => reject_quoting::<68>(ctx),
        _ => TC_ACT_SHOT,
    }
}

/// Whether an ICMP error may be sent to `addr` (RFC 1122 3.2.2): not unspecified (0/8), loopback
/// (127/8), multicast (224/4) or reserved/broadcast (240/4).
#[inline(always)]
fn answerable(addr: [u8; 4]) -> bool {
    !matches!(addr[0], 0 | 127 | 224..=255)
}

/// Builds the port unreachable in place, quoting the first `Q` bytes of the IP packet.
#[inline(always)]
fn reject_quoting<const Q: usize>(ctx: &TcContext) -> i32 {
    // Fixed-size loads (a variable length could be zero, which the verifier refuses).
    let (Ok(quote), Ok(macs)) = (ctx.load::<[u8; Q]>(ETH_HLEN), ctx.load::<[u8; 12]>(0)) else {
        return TC_ACT_SHOT;
    };
    let icmp_len = 8 + Q;
    let total_len = ETH_HLEN + Ipv4Hdr::LEN + icmp_len;
    if ctx.change_tail(total_len as u32, 0).is_err() {
        count(Counter::TcRewriteFailed);
        return TC_ACT_SHOT;
    }
    let eth = [
        macs[6], macs[7], macs[8], macs[9], macs[10], macs[11], macs[0], macs[1], macs[2], macs[3], macs[4],
        macs[5], 0x08, 0x00,
    ];
    let total = (Ipv4Hdr::LEN + icmp_len) as u16;
    let mut ip = [
        0x45,
        0xc0,
        (total >> 8) as u8,
        total as u8,
        0,
        0,
        0,
        0,
        64,
        proto::ICMP,
        0,
        0,
        // From the address the client called, to the client.
        quote[16],
        quote[17],
        quote[18],
        quote[19],
        quote[12],
        quote[13],
        quote[14],
        quote[15],
    ];
    let ip_csum = csum_fold(csum_add_bytes(0, &ip));
    ip[10] = (ip_csum >> 8) as u8;
    ip[11] = ip_csum as u8;
    let mut icmp = [ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, 0, 0, 0, 0, 0, 0];
    let icmp_csum = csum_fold(csum_add_bytes(csum_add_bytes(0, &icmp), &quote));
    icmp[2] = (icmp_csum >> 8) as u8;
    icmp[3] = icmp_csum as u8;
    let stored = ctx.store(0, &eth, 0).is_ok()
        && ctx.store(ETH_HLEN, &ip, 0).is_ok()
        && ctx.store(ETH_HLEN + Ipv4Hdr::LEN, &icmp, 0).is_ok()
        && ctx.store(ETH_HLEN + Ipv4Hdr::LEN + 8, &quote, 0).is_ok();
    if !stored {
        count(Counter::TcRewriteFailed);
        return TC_ACT_SHOT;
    }
    let ifindex = unsafe { (*skb(ctx)).ifindex };
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}

/// The embedded packet of an ICMP error: its tuple and where its fields are.
struct Quoted {
    flow: Flow,
    /// Offset of the quoted IP header.
    ip: usize,
    /// Offset of the quoted L4 header.
    l4: usize,
    /// Offset of the ICMP header.
    icmp: usize,
}

#[inline(always)]
fn parse_icmp_error(ctx: &TcContext, icmp: usize) -> Option<Quoted> {
    // ICMP errors are rare: read them through helpers, whatever the offsets.
    let header = ctx.load::<[u8; 8]>(icmp).ok()?;
    if !matches!(
        header[0],
        ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM
    ) {
        return None;
    }
    let ip_off = icmp + 8;
    let inner = ctx.load::<Ipv4Hdr>(ip_off).ok()?;
    if inner.vihl != 0x45 || (inner.proto != proto::TCP && inner.proto != proto::UDP) {
        return None;
    }
    let l4 = ip_off + Ipv4Hdr::LEN;
    let ports = ctx.load::<[u8; 4]>(l4).ok()?;
    let flow = Flow {
        saddr: inner.src_addr,
        daddr: inner.dst_addr,
        sport: u16::from_be_bytes([ports[0], ports[1]]),
        dport: u16::from_be_bytes([ports[2], ports[3]]),
        proto: inner.proto,
    };
    Some(Quoted {
        flow,
        ip: ip_off,
        l4,
        icmp,
    })
}

/// Rewrites an address (`source`: the quoted source, else destination) and port of the quoted
/// packet, fixing the quoted IP checksum and the ICMP checksum (which covers the quote). The
/// quoted L4 checksum is left alone: receivers do not check it, and it is usually cut off.
#[inline(always)]
fn rewrite_quoted(ctx: &TcContext, q: &Quoted, source: bool, addr: [u8; 4], port: u16) -> Result<(), ()> {
    let (old_addr, old_port, addr_off, port_off) = if source {
        (q.flow.saddr, q.flow.sport, q.ip + IP_SADDR, q.l4 + L4_SPORT)
    } else {
        (q.flow.daddr, q.flow.dport, q.ip + IP_DADDR, q.l4 + L4_DPORT)
    };
    let icmp_csum = q.icmp + ICMP_CHECK;
    if old_addr != addr {
        let old_check = ctx.load::<[u8; 2]>(q.ip + IP_CHECK).map_err(|_| ())?;
        let old_check = u16::from_be_bytes(old_check);
        // RFC 1624: HC' = ~(~HC + ~m + m').
        let mut sum = (!old_check) as u32;
        sum += (!u16::from_be_bytes([old_addr[0], old_addr[1]])) as u32
            + (!u16::from_be_bytes([old_addr[2], old_addr[3]])) as u32;
        sum += u16::from_be_bytes([addr[0], addr[1]]) as u32 + u16::from_be_bytes([addr[2], addr[3]]) as u32;
        let new_check = csum_fold(sum);
        let (from, to) = (
            u32::from_ne_bytes(old_addr) as u64,
            u32::from_ne_bytes(addr) as u64,
        );
        ctx.l4_csum_replace(icmp_csum, from, to, 4).map_err(|_| ())?;
        ctx.l4_csum_replace(icmp_csum, old_check.to_be() as u64, new_check.to_be() as u64, 2)
            .map_err(|_| ())?;
        ctx.store(addr_off, &addr, 0).map_err(|_| ())?;
        ctx.store(q.ip + IP_CHECK, &new_check.to_be_bytes(), 0)
            .map_err(|_| ())?;
    }
    if old_port != port {
        ctx.l4_csum_replace(icmp_csum, old_port.to_be() as u64, port.to_be() as u64, 2)
            .map_err(|_| ())?;
        ctx.store(port_off, &port.to_be_bytes(), 0).map_err(|_| ())?;
    }
    Ok(())
}

/// Rewrites the outer destination of an ICMP error (the IP checksum only: ICMP has no pseudo
/// header).
#[inline(always)]
fn rewrite_outer_dst(ctx: &TcContext, outer: &Flow, addr: [u8; 4]) -> Result<(), ()> {
    if outer.daddr == addr {
        return Ok(());
    }
    let (from, to) = (
        u32::from_ne_bytes(outer.daddr) as u64,
        u32::from_ne_bytes(addr) as u64,
    );
    ctx.l3_csum_replace(ETH_HLEN + IP_CHECK, from, to, 4)
        .map_err(|_| ())?;
    ctx.store(ETH_HLEN + IP_DADDR, &addr, 0).map_err(|_| ())
}

/// An ICMP error about a translated flow (fragmentation needed, TTL exceeded, unreachable)
/// arriving at ingress, translated back so that path MTU discovery and errors reach the host that
/// sent the packet:
/// - about a masqueraded packet (node IP:port -> backend): to the client, quoting its own source,
///   and marked so that egress puts the frontend back in the quote;
/// - about a reply this node sent as the frontend: to the backend, quoting the packet it sent.
#[inline(always)]
fn icmp_error_ingress(ctx: &mut TcContext, icmp: usize, outer: &Flow) -> i32 {
    let Some(q) = parse_icmp_error(ctx, icmp) else {
        return TC_ACT_OK;
    };
    // The quoted packet went from `q.flow.saddr` to `q.flow.daddr`; the flow's entries are keyed
    // the other way round, as for a packet coming back.
    let reversed = Flow {
        saddr: q.flow.daddr,
        daddr: q.flow.saddr,
        sport: q.flow.dport,
        dport: q.flow.sport,
        proto: q.flow.proto,
    };
    let Some(entry) = CONNTRACK
        .get_ptr(&reversed.key(dir::INGRESS))
        .map(|p| unsafe { *p })
    else {
        return TC_ACT_OK;
    };
    let result = if entry.flags & ct::REPLY != 0 {
        // Quote: node IP:port -> backend. Make it client -> backend, addressed to the client.
        ctx.set_mark(MARK_MAGIC | (entry.rev_nat_id & MARK_ID));
        rewrite_quoted(ctx, &q, true, entry.nat_addr, entry.nat_port)
            .and_then(|()| rewrite_outer_dst(ctx, outer, entry.nat_addr))
    } else {
        // Quote: frontend -> client (a reply we translated). Make it what the backend sent:
        // backend -> client, or backend -> node IP:port when masqueraded.
        let mut result = rewrite_quoted(ctx, &q, true, entry.nat_addr, entry.nat_port);
        if result.is_ok() && entry.flags & ct::SNAT != 0 {
            let fwd = Flow {
                saddr: q.flow.daddr,
                daddr: entry.nat_addr,
                sport: q.flow.dport,
                dport: entry.nat_port,
                proto: q.flow.proto,
            };
            result = match CONNTRACK.get_ptr(&fwd.key(dir::EGRESS)).map(|p| unsafe { *p }) {
                Some(snat) => {
                    let q2 = Quoted {
                        flow: Flow {
                            saddr: entry.nat_addr,
                            sport: entry.nat_port,
                            ..q.flow
                        },
                        ..q
                    };
                    rewrite_quoted(ctx, &q2, false, snat.nat_addr, snat.nat_port)
                }
                None => Err(()),
            };
        }
        result.and_then(|()| rewrite_outer_dst(ctx, outer, entry.nat_addr))
    };
    match result {
        Ok(()) => {
            count(Counter::TcIcmpErrorTranslated);
            TC_ACT_OK
        }
        Err(()) => {
            count(Counter::TcRewriteFailed);
            TC_ACT_SHOT
        }
    }
}

/// The frontend an un-SNAT mark names, if the packet (`backend` -> `client`) really is a reply
/// of the flow ingress un-SNATed: the client's forward entry to that frontend must point at this
/// backend. Other components use skb->mark too (Cilium keeps identities in the upper bits); a
/// mark that merely looks like ours must not rewrite anything.
#[inline(always)]
fn marked_reply(
    mark: u32,
    client: ([u8; 4], u16),
    backend: ([u8; 4], u16),
    proto: u8,
) -> Option<RevNat4Value> {
    if mark & MARK_MASK != MARK_MAGIC {
        return None;
    }
    let id = mark & MARK_ID;
    let frontend = REVNAT.get_ptr(&id).map(|p| unsafe { *p })?;
    let forward = Flow {
        saddr: client.0,
        daddr: frontend.addr,
        sport: client.1,
        dport: frontend.port,
        proto,
    };
    let entry = CONNTRACK
        .get_ptr(&forward.key(dir::INGRESS))
        .map(|p| unsafe { *p })?;
    let ours = entry.flags & ct::REPLY == 0
        && entry.rev_nat_id & MARK_ID == id
        && entry.nat_addr == backend.0
        && entry.nat_port == backend.1;
    ours.then_some(frontend)
}

/// The tc egress program.
#[inline(always)]
pub fn egress(ctx: &mut TcContext) -> i32 {
    let mark = unsafe { (*skb(ctx)).mark };
    let ours = mark & MARK_MASK == MARK_MAGIC;
    match parse(ctx) {
        Parsed::L4(pkt) if pkt.flow.proto != proto::SCTP => {
            let flow = pkt.flow;
            if ours {
                match marked_reply(
                    mark,
                    (flow.daddr, flow.dport),
                    (flow.saddr, flow.sport),
                    flow.proto,
                ) {
                    Some(frontend) => {
                        // A reply un-SNATed at ingress: the client called the frontend.
                        ctx.set_mark(0);
                        return apply(ctx, &pkt, true, frontend.addr, frontend.port);
                    }
                    None => count(Counter::TcForeignMark),
                }
            }
            match CONNTRACK.get_ptr_mut(&flow.key(dir::EGRESS)) {
                Some(ptr) => {
                    let entry = unsafe { *ptr };
                    if entry.flags & ct::REPLY != 0 {
                        note_reply(ptr, &pkt);
                    }
                    apply(ctx, &pkt, true, entry.nat_addr, entry.nat_port)
                }
                None => TC_ACT_OK,
            }
        }
        Parsed::Icmp(icmp, _) => {
            let Some(q) = parse_icmp_error(ctx, icmp) else {
                return TC_ACT_OK;
            };
            // Ingress made the quote client -> backend.
            let marked = if ours {
                let found = marked_reply(
                    mark,
                    (q.flow.saddr, q.flow.sport),
                    (q.flow.daddr, q.flow.dport),
                    q.flow.proto,
                );
                match found {
                    Some(_) => ctx.set_mark(0),
                    None => count(Counter::TcForeignMark),
                }
                found
            } else {
                None
            };
            let target = match marked {
                Some(f) => Some((f.addr, f.port)),
                None => {
                    // Quote: client -> backend. The client called the frontend.
                    let reply = Flow {
                        saddr: q.flow.daddr,
                        daddr: q.flow.saddr,
                        sport: q.flow.dport,
                        dport: q.flow.sport,
                        proto: q.flow.proto,
                    };
                    CONNTRACK
                        .get_ptr(&reply.key(dir::EGRESS))
                        .map(|p| unsafe { *p })
                        .filter(|e| e.flags & ct::REPLY != 0)
                        .map(|e| (e.nat_addr, e.nat_port))
                }
            };
            match target {
                Some((addr, port)) => match rewrite_quoted(ctx, &q, false, addr, port) {
                    Ok(()) => {
                        count(Counter::TcIcmpErrorTranslated);
                        TC_ACT_OK
                    }
                    Err(()) => {
                        count(Counter::TcRewriteFailed);
                        TC_ACT_SHOT
                    }
                },
                None => TC_ACT_OK,
            }
        }
        _ => TC_ACT_OK,
    }
}
