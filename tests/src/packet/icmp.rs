//! ICMP and ICMPv6 errors quoting a packet, and reading the quote back.

use std::net::IpAddr;

use super::*;

/// An ICMP error, in words that mean the same in both families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IcmpError {
    /// Port unreachable: ICMPv4 3/3, ICMPv6 1/4.
    PortUnreachable,
    /// Host (address) unreachable: ICMPv4 3/1, ICMPv6 1/3.
    HostUnreachable,
    /// Fragmentation needed (ICMPv4 3/4) or Packet Too Big (ICMPv6 2/0), with the next-hop MTU.
    TooBig { mtu: u16 },
    /// TTL or hop limit exceeded in transit: ICMPv4 11/0, ICMPv6 3/0.
    TimeExceeded,
}

impl IcmpError {
    /// Type, code and the 4 bytes after the checksum, in `family`.
    pub fn header(self, family: Family) -> (u8, u8, [u8; 4]) {
        match (self, family) {
            (IcmpError::PortUnreachable, Family::V4) => (3, 3, [0; 4]),
            (IcmpError::PortUnreachable, Family::V6) => (1, 4, [0; 4]),
            (IcmpError::HostUnreachable, Family::V4) => (3, 1, [0; 4]),
            (IcmpError::HostUnreachable, Family::V6) => (1, 3, [0; 4]),
            (IcmpError::TooBig { mtu }, Family::V4) => {
                let m = mtu.to_be_bytes();
                (3, 4, [0, 0, m[0], m[1]])
            }
            (IcmpError::TooBig { mtu }, Family::V6) => (2, 0, u32::from(mtu).to_be_bytes()),
            (IcmpError::TimeExceeded, Family::V4) => (11, 0, [0; 4]),
            (IcmpError::TimeExceeded, Family::V6) => (3, 0, [0; 4]),
        }
    }
}

/// An ICMP error from `from` to `to` about the frame `quoted`, quoting as a router would: the IP
/// header and 8 bytes of L4 (IPv4, RFC 792), or as much of the packet as fits in IPv6's minimum
/// MTU (RFC 4443 2.4 (c)).
pub fn icmp_error(from: &str, to: &str, kind: IcmpError, quoted: &[u8]) -> Vec<u8> {
    let from: IpAddr = from.parse().unwrap();
    let to: IpAddr = to.parse().unwrap();
    let family = Family::of(&from);
    let ip = &quoted[ETH_HLEN..];
    let len = match family {
        Family::V4 => usize::from(ip[0] & 0x0f) * 4 + 8,
        Family::V6 => 1280 - 48,
    };
    let (kind, code, rest) = kind.header(family);
    icmp_raw(from, to, kind, code, rest, &ip[..len.min(ip.len())])
}

/// An ICMP message of either family of any type and code, quoting `quote` (the start of an IP
/// packet), with a correct checksum (the pseudo-header's included for ICMPv6), TTL or hop limit
/// 64: IPv4 with TOS 0xc0, id 0 and no DF, IPv6 with traffic class and flow label 0 (the headers of
/// the programs' own port unreachable).
pub fn icmp_raw(from: IpAddr, to: IpAddr, kind: u8, code: u8, rest: [u8; 4], quote: &[u8]) -> Vec<u8> {
    let family = Family::of(&from);
    let proto = family.icmp_proto();
    let mut icmp = vec![kind, code, 0, 0];
    icmp.extend_from_slice(&rest);
    icmp.extend_from_slice(quote);
    let c = match family {
        Family::V4 => checksum(&icmp, 0),
        Family::V6 => checksum(&icmp, pseudo_header_sum(&from, &to, proto, icmp.len())),
    };
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let mut out = ethernet(CLIENT_MAC, NODE_MAC, family);
    match (from, to) {
        (IpAddr::V4(f), IpAddr::V4(t)) => {
            let mut h = ipv4_header(f, t, proto, 64, &[], None, icmp.len());
            // As the kernel sends its ICMP errors: TOS 0xc0 (internetwork control), id 0, no DF.
            h[1] = 0xc0;
            h[4..8].fill(0);
            h[10..12].fill(0);
            let c = checksum(&h, 0);
            h[10..12].copy_from_slice(&c.to_be_bytes());
            out.extend(h);
        }
        (IpAddr::V6(f), IpAddr::V6(t)) => out.extend(ipv6_header(f, t, proto, 64, icmp.len())),
        _ => panic!("{from} -> {to}: one family"),
    }
    out.extend(icmp);
    out
}

/// The quoted packet's addresses and ports inside an ICMP error of either family.
pub fn quoted_summary(icmp_packet: &[u8]) -> Summary {
    let outer = layout(icmp_packet).expect("an IP packet");
    let q = layout_at(icmp_packet, outer.l4 + 8).expect("a quoted IP packet");
    let port = |at: usize| u16::from_be_bytes([icmp_packet[at], icmp_packet[at + 1]]);
    Summary {
        src: q.src,
        dst: q.dst,
        sport: port(q.l4),
        dport: port(q.l4 + 2),
        proto: q.proto,
    }
}

/// Checks the quoted IP header's checksum inside an ICMP error (IPv6 has none: always Ok).
pub fn verify_quoted_ip_checksum(icmp_packet: &[u8]) -> Result<(), String> {
    let outer = layout(icmp_packet).ok_or("not an IP packet")?;
    let at = outer.l4 + 8;
    let q = layout_at(icmp_packet, at).ok_or("no quoted IP header")?;
    if q.family == Family::V6 {
        return Ok(());
    }
    let header = &icmp_packet[at..q.l4];
    if checksum(header, 0) != 0 {
        return Err(format!(
            "quoted IP checksum {:#06x} does not verify",
            u16::from_be_bytes([header[10], header[11]])
        ));
    }
    Ok(())
}
