//! Reading packets back: their layout, a summary of their tuple, and every checksum recomputed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::*;

/// One's-complement checksum of `data`, starting from the partial sum `initial`.
pub fn checksum(data: &[u8], initial: u32) -> u16 {
    let mut sum = u64::from(initial);
    for c in data.chunks(2) {
        sum += u64::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The partial sum of the pseudo-header of either family (RFC 768/793, RFC 8200 8.1).
pub fn pseudo_header_sum(src: &IpAddr, dst: &IpAddr, proto: u8, len: usize) -> u32 {
    let bytes = |ip: &IpAddr| match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let mut sum = 0u32;
    for c in bytes(src).chunks(2).chain(bytes(dst).chunks(2)) {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    sum + u32::from(proto) + (len as u32 & 0xffff) + (len as u32 >> 16)
}

/// The checksum of an L4 segment (its checksum field zero) over the pseudo-header; a UDP
/// checksum that comes out as zero is sent as 0xffff (zero means "none").
pub fn l4_checksum(src: &IpAddr, dst: &IpAddr, proto: u8, segment: &[u8]) -> u16 {
    let c = checksum(segment, pseudo_header_sum(src, dst, proto, segment.len()));
    if c == 0 && proto == UDP { 0xffff } else { c }
}

/// Where the fields of a packet are, found by hand (IPv4 options and IPv6 extension headers
/// walked): what tests rewrite and what the fuzzer's model looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub family: Family,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// The L4 protocol (after the extension headers).
    pub proto: u8,
    /// Offset of the L4 header in the frame.
    pub l4: usize,
    /// Length of the L4 segment, per the IP header.
    pub l4_len: usize,
    /// A fragment of a larger packet (IPv4 offset or MF; IPv6 fragment header not atomic).
    pub fragment: bool,
    /// An IPv6 fragment header that is atomic (offset 0, M clear).
    pub atomic_fragment: bool,
}

impl Layout {
    /// Offsets of the source and destination addresses in the frame.
    pub fn addr_offsets(&self) -> (usize, usize) {
        match self.family {
            Family::V4 => (ETH_HLEN + 12, ETH_HLEN + 16),
            Family::V6 => (ETH_HLEN + 8, ETH_HLEN + 24),
        }
    }

    /// Offset of the L4 checksum (TCP, UDP, the family's ICMP).
    pub fn l4_checksum_offset(&self) -> Option<usize> {
        match self.proto {
            TCP => Some(self.l4 + 16),
            UDP => Some(self.l4 + 6),
            p if p == self.family.icmp_proto() => Some(self.l4 + 2),
            _ => None,
        }
    }
}

fn addr_at(p: &[u8], at: usize, family: Family) -> IpAddr {
    match family {
        Family::V4 => Ipv4Addr::from(<[u8; 4]>::try_from(&p[at..at + 4]).unwrap()).into(),
        Family::V6 => Ipv6Addr::from(<[u8; 16]>::try_from(&p[at..at + 16]).unwrap()).into(),
    }
}

/// The layout of an IP packet starting at `at` in `p` (a frame's IP header, or a quote).
pub fn layout_at(p: &[u8], at: usize) -> Option<Layout> {
    match p.get(at)? >> 4 {
        4 => {
            let ihl = usize::from(p[at] & 0x0f) * 4;
            if ihl < 20 || p.len() < at + ihl {
                return None;
            }
            let total = usize::from(u16::from_be_bytes([p[at + 2], p[at + 3]]));
            let frags = u16::from_be_bytes([p[at + 6], p[at + 7]]);
            Some(Layout {
                family: Family::V4,
                src: addr_at(p, at + 12, Family::V4),
                dst: addr_at(p, at + 16, Family::V4),
                proto: p[at + 9],
                l4: at + ihl,
                l4_len: total.saturating_sub(ihl),
                fragment: frags & 0x3fff != 0,
                atomic_fragment: false,
            })
        }
        6 => {
            if p.len() < at + 40 {
                return None;
            }
            let payload = usize::from(u16::from_be_bytes([p[at + 4], p[at + 5]]));
            let mut next = p[at + 6];
            let mut off = at + 40;
            let (mut fragment, mut atomic_fragment) = (false, false);
            loop {
                match next {
                    HOPOPTS | ROUTING | DSTOPTS | 135 => {
                        let h = p.get(off..off + 2)?;
                        next = h[0];
                        off += (usize::from(h[1]) + 1) * 8;
                    }
                    AUTH => {
                        let h = p.get(off..off + 2)?;
                        next = h[0];
                        off += (usize::from(h[1]) + 2) * 4;
                    }
                    FRAGMENT => {
                        let h = p.get(off..off + 4)?;
                        let field = u16::from_be_bytes([h[2], h[3]]);
                        if field & 0xfff9 != 0 {
                            fragment = true;
                        } else {
                            atomic_fragment = true;
                        }
                        next = h[0];
                        off += 8;
                    }
                    _ => break,
                }
            }
            Some(Layout {
                family: Family::V6,
                src: addr_at(p, at + 8, Family::V6),
                dst: addr_at(p, at + 24, Family::V6),
                proto: next,
                l4: off,
                l4_len: (at + 40 + payload).saturating_sub(off),
                fragment,
                atomic_fragment,
            })
        }
        _ => None,
    }
}

/// The layout of an Ethernet frame's IP packet.
pub fn layout(p: &[u8]) -> Option<Layout> {
    layout_at(p, ETH_HLEN)
}

/// The fields tests look at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
}

/// Decodes a TCP or UDP packet of either family with etherparse, an SCTP one by its layout
/// (etherparse has no SCTP); panics on anything else.
pub fn summary(packet: &[u8]) -> Summary {
    if let Some(l) = layout(packet).filter(|l| l.proto == SCTP) {
        let port = |at: usize| u16::from_be_bytes([packet[l.l4 + at], packet[l.l4 + at + 1]]);
        return Summary {
            src: l.src,
            dst: l.dst,
            sport: port(0),
            dport: port(2),
            proto: SCTP,
        };
    }
    let sliced = SlicedPacket::from_ethernet(packet).unwrap_or_else(|e| panic!("not a packet: {e:?}"));
    let (src, dst, proto): (IpAddr, IpAddr, u8) = match &sliced.net {
        Some(NetSlice::Ipv4(ip)) => (
            ip.header().source_addr().into(),
            ip.header().destination_addr().into(),
            ip.payload().ip_number.0,
        ),
        Some(NetSlice::Ipv6(ip)) => (
            ip.header().source_addr().into(),
            ip.header().destination_addr().into(),
            ip.payload().ip_number.0,
        ),
        other => panic!("not IP: {other:?}"),
    };
    let (sport, dport) = match &sliced.transport {
        Some(TransportSlice::Tcp(t)) => (t.source_port(), t.destination_port()),
        Some(TransportSlice::Udp(u)) => (u.source_port(), u.destination_port()),
        other => panic!("not TCP/UDP: {other:?}"),
    };
    Summary {
        src,
        dst,
        sport,
        dport,
        proto,
    }
}

/// Checks, by recomputation with etherparse, the IPv4 header checksum and the TCP/UDP/ICMP or
/// TCP/UDP/ICMPv6 checksum of a packet (over the pseudo-header where the protocol has one), and
/// SCTP's CRC32c (`sctp_checksum`). An IPv6 UDP checksum of zero is an error (it is mandatory
/// there, RFC 8200 8.1).
pub fn verify_checksums(packet: &[u8]) -> Result<(), String> {
    verify_sctp(packet)?;
    let sliced = SlicedPacket::from_ethernet(packet).map_err(|e| format!("{e:?}"))?;
    let (src, dst): (IpAddr, IpAddr) = match &sliced.net {
        Some(NetSlice::Ipv4(ip)) => {
            let header = ip.header().to_header();
            if header.calc_header_checksum() != header.header_checksum {
                return Err(format!(
                    "IP checksum {:#06x}, expected {:#06x}",
                    header.header_checksum,
                    header.calc_header_checksum()
                ));
            }
            (header.source.into(), header.destination.into())
        }
        Some(NetSlice::Ipv6(ip)) => (
            ip.header().source_addr().into(),
            ip.header().destination_addr().into(),
        ),
        _ => return Err("not IP".into()),
    };
    let raw = |ip: &IpAddr| match ip {
        IpAddr::V6(a) => a.octets(),
        IpAddr::V4(_) => unreachable!(),
    };
    match (&sliced.transport, src, dst) {
        (Some(TransportSlice::Tcp(t)), IpAddr::V4(s), IpAddr::V4(d)) => {
            let expected = t
                .to_header()
                .calc_checksum_ipv4_raw(s.octets(), d.octets(), t.payload())
                .map_err(|e| format!("{e:?}"))?;
            check("TCP", t.checksum(), expected)?;
        }
        (Some(TransportSlice::Tcp(t)), IpAddr::V6(_), _) => {
            let expected = t
                .to_header()
                .calc_checksum_ipv6_raw(raw(&src), raw(&dst), t.payload())
                .map_err(|e| format!("{e:?}"))?;
            check("TCP", t.checksum(), expected)?;
        }
        (Some(TransportSlice::Udp(u)), IpAddr::V4(s), IpAddr::V4(d)) => {
            if u.checksum() != 0 {
                let expected = u
                    .to_header()
                    .calc_checksum_ipv4_raw(s.octets(), d.octets(), u.payload())
                    .map_err(|e| format!("{e:?}"))?;
                check("UDP", u.checksum(), expected)?;
            }
        }
        (Some(TransportSlice::Udp(u)), IpAddr::V6(_), _) => {
            if u.checksum() == 0 {
                return Err("IPv6 UDP checksum zero (mandatory in IPv6)".into());
            }
            let expected = u
                .to_header()
                .calc_checksum_ipv6_raw(raw(&src), raw(&dst), u.payload())
                .map_err(|e| format!("{e:?}"))?;
            check("UDP", u.checksum(), expected)?;
        }
        (Some(TransportSlice::Icmpv4(i)), ..) => {
            // The checksum covers the whole ICMP message, no pseudo-header.
            if checksum(i.slice(), 0) != 0 {
                return Err(format!("ICMP checksum {:#06x} does not verify", i.checksum()));
            }
        }
        (Some(TransportSlice::Icmpv6(i)), ..) if !i.is_checksum_valid(raw(&src), raw(&dst)) => {
            return Err(format!(
                "ICMPv6 checksum {:#06x} does not verify (pseudo-header included)",
                i.checksum()
            ));
        }
        _ => {}
    }
    Ok(())
}

/// SCTP's checksum of a segment (common header and chunks) as the packet carries it
/// (little-endian): CRC32c with the checksum field taken as zero (RFC 9260 6.8), by the `crc`
/// crate, independent of the programs' incremental update (`lb_common::sctp`).
pub fn sctp_checksum(segment: &[u8]) -> u32 {
    const CRC32C: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
    let mut digest = CRC32C.digest();
    digest.update(&segment[..8]);
    digest.update(&[0; 4]);
    digest.update(&segment[12..]);
    digest.finalize()
}

/// An unfragmented SCTP packet's checksum, recomputed; a zero field (the device computes it) is
/// accepted.
fn verify_sctp(packet: &[u8]) -> Result<(), String> {
    let Some(l) = layout(packet).filter(|l| l.proto == SCTP && !l.fragment) else {
        return Ok(());
    };
    let segment = packet
        .get(l.l4..l.l4 + l.l4_len)
        .filter(|s| s.len() >= 12)
        .ok_or("SCTP packet shorter than its common header or its IP length")?;
    let field = u32::from_le_bytes(segment[8..12].try_into().unwrap());
    let expected = sctp_checksum(segment);
    if field != 0 && field != expected {
        return Err(format!("SCTP checksum {field:#010x}, expected {expected:#010x}"));
    }
    Ok(())
}

fn check(what: &str, actual: u16, expected: u16) -> Result<(), String> {
    // 0x0000 and 0xffff are the same one's-complement value (RFC 1624 3): an incremental update
    // may leave either in a TCP header. UDP must send 0xffff (zero means "none").
    let zero = |c: u16| c == 0 || c == 0xffff;
    if actual == expected || (what == "TCP" && zero(actual) && zero(expected)) {
        Ok(())
    } else {
        Err(format!("{what} checksum {actual:#06x}, expected {expected:#06x}"))
    }
}
