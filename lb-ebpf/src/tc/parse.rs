//! The packet as the programs see it, in either family: the 5-tuple (`Flow`), where its L4 header
//! is (`Packet`), what parsing found (`Parsed`), and bounds-checked access to the packet and its
//! `__sk_buff`. The family's own parsing is `Ip::parse`.

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, BPF_F_MARK_MANGLED_0},
    programs::TcContext,
};
use lb_common::{conntrack::CtKey, family::Family, proto};
use network_types::eth::EthHdr;

use super::ip::Ip;

pub(super) const ETH_HLEN: usize = 14;
/// Offsets inside TCP and UDP headers.
pub(super) const L4_SPORT: usize = 0;
pub(super) const L4_DPORT: usize = 2;
const TCP_FLAGS: usize = 13;
const TCP_CHECK: usize = 16;
const UDP_CHECK: usize = 6;
/// Both families' ICMP headers: type, code, checksum and 4 bytes that depend on the type.
pub(super) const ICMP_HLEN: usize = 8;
pub(super) const ICMP_CHECK: usize = 2;

/// The 5-tuple of a packet, addresses in network order, ports in host order.
#[derive(Clone, Copy)]
pub(super) struct Flow<F: Family> {
    pub(super) saddr: F::Addr,
    pub(super) daddr: F::Addr,
    pub(super) sport: u16,
    pub(super) dport: u16,
    pub(super) proto: u8,
}

impl<F: Family> Flow<F> {
    /// A flow of `proto` between two addresses, its ports not read yet.
    #[inline(always)]
    pub(super) fn without_ports(saddr: F::Addr, daddr: F::Addr, proto: u8) -> Flow<F> {
        Flow {
            saddr,
            daddr,
            sport: 0,
            dport: 0,
            proto,
        }
    }

    #[inline(always)]
    pub(super) fn key(&self, direction: u8) -> CtKey<F> {
        CtKey {
            saddr: self.saddr,
            daddr: self.daddr,
            sport: self.sport,
            dport: self.dport,
            proto: self.proto,
            dir: direction,
            tag: 0,
        }
    }

    /// The same flow seen from the other end.
    #[inline(always)]
    pub(super) fn reversed(&self) -> Flow<F> {
        Flow {
            saddr: self.daddr,
            daddr: self.saddr,
            sport: self.dport,
            dport: self.sport,
            proto: self.proto,
        }
    }
}

#[derive(Clone, Copy)]
pub(super) struct Packet<F: Family> {
    /// Offset of the L4 header.
    pub(super) l4: usize,
    pub(super) flow: Flow<F>,
    pub(super) tcp_flags: u8,
}

impl<F: Family> Packet<F> {
    /// The address and port a rewrite of the source (or destination) replaces, and the offset of
    /// that port.
    #[inline(always)]
    pub(super) fn endpoint(&self, source: bool) -> (F::Addr, u16, usize) {
        if source {
            (self.flow.saddr, self.flow.sport, self.l4 + L4_SPORT)
        } else {
            (self.flow.daddr, self.flow.dport, self.l4 + L4_DPORT)
        }
    }

    /// The offset of the L4 checksum, and the `l4_csum_replace` flag that keeps a UDP checksum of
    /// zero ("none") zero.
    #[inline(always)]
    pub(super) fn l4_csum(&self) -> (usize, u64) {
        if self.flow.proto == proto::UDP {
            (self.l4 + UDP_CHECK, BPF_F_MARK_MANGLED_0 as u64)
        } else {
            (self.l4 + TCP_CHECK, 0)
        }
    }
}

pub(super) enum Parsed<F: Family> {
    /// Not this family's, or not a protocol we look at.
    Skip,
    Truncated,
    /// A fragment the programs cannot translate (`super::fragment`).
    Fragment,
    /// TCP, UDP or SCTP (ports only), a first fragment of a TCP or UDP datagram included.
    L4(Packet<F>),
    /// A later fragment of a TCP or UDP datagram whose first fragment was seen: its flow, with
    /// the first one's ports (`super::fragment`). It has no L4 header.
    Later(Flow<F>),
    /// The family's ICMP: the offset of its header and the outer addresses.
    Icmp(usize, Flow<F>),
}

/// The checksum at `csum_off` (an L4 or ICMP checksum, `flags` as for `l4_csum_replace`) after a
/// port it covers changed from `old` to `new`.
#[inline(always)]
pub(super) fn port_changed(
    ctx: &TcContext,
    csum_off: usize,
    flags: u64,
    old: u16,
    new: u16,
) -> Result<(), ()> {
    ctx.l4_csum_replace(csum_off, old.to_be() as u64, new.to_be() as u64, flags | 2)
        .map_err(|_| ())
}

/// Bounds-checked pointer into the packet.
#[inline(always)]
pub(super) fn ptr_at<T>(ctx: &TcContext, off: usize) -> Option<*mut T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + core::mem::size_of::<T>() > end {
        return None;
    }
    Some((start + off) as *mut T)
}

/// Reads a `T` at the L4 offset: direct packet access at a constant offset in the common case (no
/// IP options or extension headers), else through `bpf_skb_load_bytes` (the verifier cannot follow
/// a variable offset into the packet).
#[inline(always)]
pub(super) fn read_l4<F: Ip, T: Copy>(ctx: &TcContext, l4: usize) -> Option<T> {
    if l4 == ETH_HLEN + F::HLEN {
        ptr_at::<T>(ctx, ETH_HLEN + F::HLEN).map(|p| unsafe { *p })
    } else {
        ctx.load::<T>(l4).ok()
    }
}

/// The Ethernet type of the frame, or `None` when it is shorter than an Ethernet header.
#[inline(always)]
pub(super) fn ether_type(ctx: &TcContext) -> Option<u16> {
    let eth = ptr_at::<EthHdr>(ctx, 0)?;
    Some(u16::from_be(unsafe { (*eth).ether_type }))
}

/// The L4 part of parsing, once the family's header (and extension headers) are known: the
/// ports of TCP, UDP and SCTP, the family's ICMP, nothing else.
#[inline(always)]
pub(super) fn parse_l4<F: Ip>(ctx: &TcContext, l4: usize, mut flow: Flow<F>, icmp_proto: u8) -> Parsed<F> {
    match flow.proto {
        proto::TCP => {
            let Some(tcp) = read_l4::<F, [u8; 20]>(ctx, l4) else {
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
            let Some(ports) = read_l4::<F, [u8; 8]>(ctx, l4) else {
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
        p if p == icmp_proto => {
            if read_l4::<F, [u8; 8]>(ctx, l4).is_none() {
                return Parsed::Truncated;
            }
            Parsed::Icmp(l4, flow)
        }
        _ => Parsed::Skip,
    }
}

#[inline(always)]
pub(super) fn skb(ctx: &TcContext) -> *mut __sk_buff {
    ctx.as_ptr() as *mut __sk_buff
}
