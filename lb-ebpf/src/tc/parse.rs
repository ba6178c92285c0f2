//! The packet as the programs see it: parsing Ethernet, IP and the L4 ports into a `Flow`, and
//! bounds-checked access to the packet and its `__sk_buff`.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, programs::TcContext};
use lb_common::{conntrack::Ct4Key, proto};
use network_types::{eth::EthHdr, ip::Ipv4Hdr};

use super::ipv4::{self, ETH_P_IP};

pub(super) const ETH_HLEN: usize = 14;
/// Offsets inside TCP and UDP headers.
pub(super) const L4_SPORT: usize = 0;
pub(super) const L4_DPORT: usize = 2;
const TCP_FLAGS: usize = 13;

/// The 5-tuple of a packet, addresses in network order, ports in host order.
#[derive(Clone, Copy)]
pub(super) struct Flow {
    pub(super) saddr: [u8; 4],
    pub(super) daddr: [u8; 4],
    pub(super) sport: u16,
    pub(super) dport: u16,
    pub(super) proto: u8,
}

impl Flow {
    #[inline(always)]
    pub(super) fn key(&self, direction: u8) -> Ct4Key {
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
pub(super) struct Packet {
    /// Offset of the L4 header.
    pub(super) l4: usize,
    pub(super) flow: Flow,
    pub(super) tcp_flags: u8,
}

pub(super) enum Parsed {
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
pub(super) fn ptr_at<T>(ctx: &TcContext, off: usize) -> Option<*mut T> {
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
pub(super) fn read_l4<T: Copy>(ctx: &TcContext, l4: usize) -> Option<T> {
    if l4 == ETH_HLEN + ipv4::HLEN {
        ptr_at::<T>(ctx, ETH_HLEN + ipv4::HLEN).map(|p| unsafe { *p })
    } else {
        ctx.load::<T>(l4).ok()
    }
}

#[inline(always)]
pub(super) fn parse(ctx: &TcContext) -> Parsed {
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
    if ip.vihl >> 4 != ipv4::VERSION {
        return Parsed::Skip;
    }
    let ihl = ipv4::header_len(ip.vihl);
    if ihl < ipv4::HLEN {
        return Parsed::Truncated;
    }
    // More-fragments set, or a non-zero offset: no (or not this packet's) L4 header.
    if u16::from_be_bytes(ip.frags) & ipv4::FRAG_MASK != 0 {
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
            if read_l4::<[u8; ipv4::ICMP_HLEN]>(ctx, l4).is_none() {
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
