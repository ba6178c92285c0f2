//! Packets for BPF_PROG_TEST_RUN fixtures, in either IP family: every fixture builds its input and
//! its expected output the same way, so a byte-for-byte comparison checks the rewritten fields,
//! and `verify_checksums` checks what the program computed incrementally against a full
//! recomputation by etherparse (an independent parser).
//!
//! One code path for both families: a [`Spec`] holds `IpAddr`s and the family follows from them;
//! only the IP header (and IPv6's extension headers) differ. [`Family`] lets a test be written once
//! with IPv4 literals and run for both families.
//!
//! Building is here; `read` reads packets back (layout, tuple, checksums recomputed) and `icmp`
//! builds and reads the ICMP errors that quote a packet.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

mod icmp;
mod read;

pub use icmp::*;
pub use read::*;

use etherparse::{NetSlice, SlicedPacket, TransportSlice};

pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0c];
pub const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];

pub const ETH_HLEN: usize = 14;
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const SCTP: u8 = 132;
pub const ICMP: u8 = 1;
pub const ICMPV6: u8 = 58;
/// IPv6 extension headers (next-header values).
pub const HOPOPTS: u8 = 0;
pub const ROUTING: u8 = 43;
pub const FRAGMENT: u8 = 44;
pub const AUTH: u8 = 51;
pub const DSTOPTS: u8 = 60;

/// An IP family, for tests written once over both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

/// Both families, for `for family in FAMILIES`.
pub const FAMILIES: [Family; 2] = [Family::V4, Family::V6];

impl Family {
    pub fn of(ip: &IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// The address that stands for the IPv4 literal `v4` in this family: the literal itself, or
    /// `fd00:a:b:c::d` (each octet's decimal digits as a hex group: `10.96.0.10` is
    /// `fd00:10:96::10`, `192.168.50.11` is `fd00:192:168:50::11`), so that a test reads the same
    /// in both families and the IPv6 plan keeps the IPv4 one's structure (prefixes included, see
    /// [`Family::net`]).
    pub fn ip(self, v4: &str) -> IpAddr {
        let addr: Ipv4Addr = v4.parse().unwrap_or_else(|e| panic!("{v4}: {e}"));
        match self {
            Family::V4 => addr.into(),
            Family::V6 => {
                let group = |octet: u8| u16::from_str_radix(&octet.to_string(), 16).expect("hex digits");
                let [a, b, c, d] = addr.octets();
                Ipv6Addr::new(0xfd00, group(a), group(b), group(c), 0, 0, 0, group(d)).into()
            }
        }
    }

    /// [`Family::ip`] as a string, for the object builders.
    pub fn addr(self, v4: &str) -> String {
        self.ip(v4).to_string()
    }

    /// The prefix that stands for the IPv4 prefix `cidr` (whole octets): in IPv6 each octet is a
    /// group after `fd00`, so `/16` becomes `/48`, `/24` `/64`, and a host `/32` `/128`.
    pub fn net(self, cidr: &str) -> String {
        let (addr, len) = cidr.split_once('/').expect("a prefix");
        let len: u8 = len.parse().expect("a prefix length");
        assert!(len.is_multiple_of(8), "{cidr}: whole octets only");
        match self {
            Family::V4 => cidr.to_string(),
            Family::V6 => {
                let len = if len == 32 { 128 } else { 16 + 2 * len };
                format!("{}/{len}", self.ip(addr))
            }
        }
    }

    /// Length of the fixed IP header.
    pub fn ip_hlen(self) -> usize {
        match self {
            Family::V4 => 20,
            Family::V6 => 40,
        }
    }

    pub fn ether_type(self) -> u16 {
        match self {
            Family::V4 => 0x0800,
            Family::V6 => 0x86dd,
        }
    }

    /// The family's ICMP protocol number.
    pub fn icmp_proto(self) -> u8 {
        match self {
            Family::V4 => ICMP,
            Family::V6 => ICMPV6,
        }
    }

    /// Kubernetes' spelling ("IPv4", "IPv6").
    pub fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

/// A fragment: IPv4's offset and more-fragments fields, or an IPv6 fragment header (`offset` 0
/// and `more` false make it an atomic fragment, RFC 6946).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fragment {
    /// In 8-byte units.
    pub offset: u16,
    pub more: bool,
}

/// A TCP, UDP or SCTP packet under construction.
#[derive(Clone, Debug)]
pub struct Spec {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub udp: bool,
    /// SCTP (`udp` false): an INIT chunk when `syn`, else a DATA chunk carrying the payload.
    pub sctp: bool,
    /// TCP flags: SYN only when true, else ACK (+PSH with payload).
    pub syn: bool,
    /// A TCP close: FIN+ACK, or RST+ACK.
    pub close: Option<Close>,
    pub payload: Vec<u8>,
    /// TTL or hop limit.
    pub ttl: u8,
    /// Extra IPv4 options (a multiple of 4 bytes).
    pub options: Vec<u8>,
    /// IPv6 extension headers before the fragment header (if any) and L4, in order: each a
    /// next-header value (hop-by-hop, routing, destination options, authentication) and its
    /// length in bytes (a multiple of 8, at least 8; of 4 for authentication), filled with
    /// padding.
    pub extensions: Vec<(u8, usize)>,
    /// Set the more-fragments flag (IPv4), or add a fragment header with it (IPv6).
    pub more_fragments: bool,
    /// A fragment (IPv4 fields, or an IPv6 fragment header), instead of `more_fragments`.
    pub fragment: Option<Fragment>,
}

pub fn tcp(src: &str, sport: u16, dst: &str, dport: u16) -> Spec {
    let (src, dst): (IpAddr, IpAddr) = (src.parse().unwrap(), dst.parse().unwrap());
    assert_eq!(Family::of(&src), Family::of(&dst), "{src} -> {dst}: one family");
    Spec {
        src,
        dst,
        sport,
        dport,
        udp: false,
        sctp: false,
        syn: true,
        close: None,
        payload: Vec::new(),
        ttl: 64,
        options: Vec::new(),
        extensions: Vec::new(),
        more_fragments: false,
        fragment: None,
    }
}

pub fn udp(src: &str, sport: u16, dst: &str, dport: u16) -> Spec {
    Spec {
        udp: true,
        syn: false,
        payload: b"hello".to_vec(),
        ..tcp(src, sport, dst, dport)
    }
}

/// An SCTP packet: an INIT chunk, or a DATA chunk once `data` gives it a payload. Its CRC32c
/// checksum is computed in full (`sctp_checksum`).
pub fn sctp(src: &str, sport: u16, dst: &str, dport: u16) -> Spec {
    Spec {
        sctp: true,
        ..tcp(src, sport, dst, dport)
    }
}

/// How a TCP packet closes its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Close {
    Fin,
    Rst,
}

impl Spec {
    /// A FIN+ACK (or RST+ACK) without payload.
    pub fn closing(mut self, how: Close) -> Self {
        self.syn = false;
        self.close = Some(how);
        self
    }

    pub fn data(mut self, payload: &[u8]) -> Self {
        self.syn = false;
        self.payload = payload.to_vec();
        self
    }

    pub fn from(mut self, src: &str, sport: u16) -> Self {
        self.src = src.parse().unwrap();
        self.sport = sport;
        self
    }

    pub fn to(mut self, dst: &str, dport: u16) -> Self {
        self.dst = dst.parse().unwrap();
        self.dport = dport;
        self
    }

    /// Adds an IPv6 extension header (see [`Spec::extensions`]).
    pub fn extension(mut self, next_header: u8, len: usize) -> Self {
        self.extensions.push((next_header, len));
        self
    }

    pub fn family(&self) -> Family {
        Family::of(&self.src)
    }

    /// The packet bytes, with correct checksums.
    pub fn build(&self) -> Vec<u8> {
        let proto = match (self.udp, self.sctp) {
            (true, _) => UDP,
            (false, true) => SCTP,
            (false, false) => TCP,
        };
        let mut l4 = Vec::new();
        l4.extend_from_slice(&self.sport.to_be_bytes());
        l4.extend_from_slice(&self.dport.to_be_bytes());
        if proto == SCTP {
            return self.with_l4(proto, sctp_segment(&l4, self.syn, &self.payload));
        }
        if self.udp {
            l4.extend_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
            l4.extend_from_slice(&[0, 0]);
        } else {
            let (flags, ack): (u8, u32) = match (self.syn, self.close) {
                (true, _) => (0x02, 0),
                (false, Some(Close::Fin)) => (0x11, 5000),
                (false, Some(Close::Rst)) => (0x14, 5000),
                (false, None) => (0x18, 5000),
            };
            l4.extend_from_slice(&1000u32.to_be_bytes());
            l4.extend_from_slice(&ack.to_be_bytes());
            l4.extend_from_slice(&[5 << 4, flags]);
            l4.extend_from_slice(&64_240u16.to_be_bytes());
            l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
        }
        l4.extend_from_slice(&self.payload);
        let csum = l4_checksum(&self.src, &self.dst, proto, &l4);
        let at = if self.udp { 6 } else { 16 };
        l4[at..at + 2].copy_from_slice(&csum.to_be_bytes());
        self.with_l4(proto, l4)
    }

    /// The frame around an L4 segment whose checksum is final.
    fn with_l4(&self, proto: u8, l4: Vec<u8>) -> Vec<u8> {
        let fragment = self.fragment.or(self.more_fragments.then_some(Fragment {
            offset: 0,
            more: true,
        }));
        let mut out = ethernet(CLIENT_MAC, NODE_MAC, self.family());
        match (self.src, self.dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                assert!(
                    self.extensions.is_empty(),
                    "IPv6 extension headers in an IPv4 packet"
                );
                out.extend(ipv4_header(
                    src,
                    dst,
                    proto,
                    self.ttl,
                    &self.options,
                    fragment,
                    l4.len(),
                ));
            }
            (IpAddr::V6(src), IpAddr::V6(dst)) => {
                assert!(self.options.is_empty(), "IPv4 options in an IPv6 packet");
                let mut exts: Vec<(u8, usize)> = self.extensions.clone();
                if fragment.is_some() {
                    exts.push((FRAGMENT, 8));
                }
                let ext_bytes = extension_chain(&exts, proto, fragment);
                let first = exts.first().map_or(proto, |e| e.0);
                out.extend(ipv6_header(src, dst, first, self.ttl, ext_bytes.len() + l4.len()));
                out.extend(ext_bytes);
            }
            _ => panic!("{} -> {}: one family", self.src, self.dst),
        }
        out.extend(l4);
        out
    }
}

/// An SCTP packet after its ports: the verification tag, the checksum and one chunk (RFC 9260
/// 3.3.1 DATA, 3.3.2 INIT; an INIT travels with tag 0).
fn sctp_segment(ports: &[u8], init: bool, payload: &[u8]) -> Vec<u8> {
    let mut l4 = ports.to_vec();
    l4.extend_from_slice(&(if init { 0u32 } else { 0x5ca1_ab1e }).to_be_bytes());
    l4.extend_from_slice(&[0; 4]);
    if init {
        l4.extend_from_slice(&[1, 0]);
        l4.extend_from_slice(&20u16.to_be_bytes());
        for word in [0x0bad_cafe_u32, 106_496, (10 << 16) | 10, 1] {
            l4.extend_from_slice(&word.to_be_bytes());
        }
    } else {
        // Unfragmented user message (B and E flags), TSN 1, stream 0, sequence 0, PPID 0.
        l4.extend_from_slice(&[0, 0x03]);
        l4.extend_from_slice(&((16 + payload.len()) as u16).to_be_bytes());
        l4.extend_from_slice(&1u32.to_be_bytes());
        l4.extend_from_slice(&[0; 8]);
        l4.extend_from_slice(payload);
        l4.resize(l4.len().next_multiple_of(4), 0);
    }
    let crc = sctp_checksum(&l4);
    l4[8..12].copy_from_slice(&crc.to_le_bytes());
    l4
}

fn ethernet(dst: [u8; 6], src: [u8; 6], family: Family) -> Vec<u8> {
    let mut eth = Vec::with_capacity(ETH_HLEN);
    eth.extend_from_slice(&dst);
    eth.extend_from_slice(&src);
    eth.extend_from_slice(&family.ether_type().to_be_bytes());
    eth
}

/// An IPv4 header (id 0x1234, DF unless a fragment), checksum included.
fn ipv4_header(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    ttl: u8,
    options: &[u8],
    fragment: Option<Fragment>,
    payload_len: usize,
) -> Vec<u8> {
    assert!(
        options.len().is_multiple_of(4) && options.len() <= 40,
        "IPv4 options"
    );
    let hlen = 20 + options.len();
    let frags: u16 = match fragment {
        None => 0x4000,
        Some(f) => (f.offset & 0x1fff) | if f.more { 0x2000 } else { 0 },
    };
    let mut h = vec![0x40 | (hlen / 4) as u8, 0];
    h.extend_from_slice(&((hlen + payload_len) as u16).to_be_bytes());
    h.extend_from_slice(&0x1234u16.to_be_bytes());
    h.extend_from_slice(&frags.to_be_bytes());
    h.extend_from_slice(&[ttl, proto, 0, 0]);
    h.extend_from_slice(&src.octets());
    h.extend_from_slice(&dst.octets());
    h.extend_from_slice(options);
    let c = checksum(&h, 0);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h
}

fn ipv6_header(src: Ipv6Addr, dst: Ipv6Addr, next: u8, hop_limit: u8, payload_len: usize) -> Vec<u8> {
    let mut h = vec![0x60, 0, 0, 0];
    h.extend_from_slice(&(payload_len as u16).to_be_bytes());
    h.extend_from_slice(&[next, hop_limit]);
    h.extend_from_slice(&src.octets());
    h.extend_from_slice(&dst.octets());
    h
}

/// IPv6 extension headers `exts`, chained to `last` (the L4 protocol); padding options (PadN)
/// fill the option headers, the fragment header is `fragment`.
fn extension_chain(exts: &[(u8, usize)], last: u8, fragment: Option<Fragment>) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, &(kind, len)) in exts.iter().enumerate() {
        let next = exts.get(i + 1).map_or(last, |e| e.0);
        match kind {
            FRAGMENT => {
                let f = fragment.unwrap_or(Fragment {
                    offset: 0,
                    more: false,
                });
                let field = (f.offset << 3) | u16::from(f.more);
                out.extend_from_slice(&[next, 0]);
                out.extend_from_slice(&field.to_be_bytes());
                out.extend_from_slice(&0xabcd_0123u32.to_be_bytes());
            }
            AUTH => {
                assert!(len >= 12 && len % 4 == 0, "authentication header length");
                out.extend_from_slice(&[next, (len / 4 - 2) as u8, 0, 0]);
                out.extend_from_slice(&0x100u32.to_be_bytes()); // SPI
                out.resize(out.len() + len - 8, 0);
            }
            ROUTING => {
                assert!(len >= 8 && len % 8 == 0, "extension header length");
                // An experimental routing type with no segments left: this node is the
                // destination.
                out.extend_from_slice(&[next, (len / 8 - 1) as u8, 253, 0]);
                out.resize(out.len() + len - 4, 0);
            }
            _ => {
                assert!(len >= 8 && len % 8 == 0, "extension header length");
                out.extend_from_slice(&[next, (len / 8 - 1) as u8]);
                // One PadN option over the rest.
                out.extend_from_slice(&[1, (len - 4) as u8]);
                out.resize(out.len() + len - 4, 0);
            }
        }
    }
    out
}

/// Rewrites the addresses and ports of a TCP, UDP or SCTP packet of either family and recomputes
/// every checksum (the expected output of a translation, built independently of the program). A
/// UDP checksum of zero (IPv4's "none") stays zero, and so does an SCTP one (a checksum the
/// device computes).
pub fn rewritten(packet: &[u8], src: Option<(&str, u16)>, dst: Option<(&str, u16)>) -> Vec<u8> {
    let l = layout(packet).expect("an IP packet");
    assert!(matches!(l.proto, TCP | UDP | SCTP), "not TCP/UDP/SCTP: {l:?}");
    let mut out = patched(packet, src, dst);
    if l.proto == SCTP {
        let segment = &mut out[l.l4..l.l4 + l.l4_len];
        if segment[8..12] != [0; 4] {
            let crc = sctp_checksum(segment);
            segment[8..12].copy_from_slice(&crc.to_le_bytes());
        }
        return out;
    }
    let at = l.l4_checksum_offset().expect("TCP/UDP");
    if !(l.proto == UDP && l.family == Family::V4 && out[at..at + 2] == [0, 0]) {
        out[at..at + 2].fill(0);
        let new = layout(&out).expect("an IP packet");
        let segment = &out[l.l4..l.l4 + l.l4_len];
        let c = l4_checksum(&new.src, &new.dst, l.proto, segment);
        out[at..at + 2].copy_from_slice(&c.to_be_bytes());
    }
    out
}

/// Rewrites the addresses and ports of a TCP, UDP or SCTP packet of either family (or the start of one,
/// as an ICMP error quotes it), with the IPv4 header checksum but not the L4 one: what the
/// translation of a quoted packet does.
pub fn patched(packet: &[u8], src: Option<(&str, u16)>, dst: Option<(&str, u16)>) -> Vec<u8> {
    let l = layout(packet).expect("an IP packet");
    let mut out = packet.to_vec();
    let (src_at, dst_at) = l.addr_offsets();
    let put = |out: &mut Vec<u8>, at: usize, port_at: usize, to: Option<(&str, u16)>| {
        if let Some((addr, port)) = to {
            let addr: IpAddr = addr.parse().unwrap();
            assert_eq!(Family::of(&addr), l.family, "{addr} in a {:?} packet", l.family);
            match addr {
                IpAddr::V4(a) => out[at..at + 4].copy_from_slice(&a.octets()),
                IpAddr::V6(a) => out[at..at + 16].copy_from_slice(&a.octets()),
            }
            out[port_at..port_at + 2].copy_from_slice(&port.to_be_bytes());
        }
    };
    put(&mut out, src_at, l.l4, src);
    put(&mut out, dst_at, l.l4 + 2, dst);
    if l.family == Family::V4 {
        let ihl = l.l4 - ETH_HLEN;
        out[ETH_HLEN + 10..ETH_HLEN + 12].fill(0);
        let c = checksum(&out[ETH_HLEN..ETH_HLEN + ihl], 0);
        out[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&c.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_prefixes_map_to_their_ipv6_counterparts() {
        assert_eq!(Family::V4.addr("10.96.0.10"), "10.96.0.10");
        assert_eq!(Family::V6.addr("10.96.0.10"), "fd00:10:96::10");
        assert_eq!(Family::V6.addr("192.168.50.255"), "fd00:192:168:50::255");
        assert_eq!(Family::V6.net("10.244.0.0/16"), "fd00:10:244::/48");
        assert_eq!(Family::V6.net("198.51.100.0/24"), "fd00:198:51:100::/64");
        assert_eq!(Family::V6.net("198.51.100.7/32"), "fd00:198:51:100::7/128");
        let inside: ipnet::IpNet = Family::V6.net("10.244.0.0/16").parse().unwrap();
        assert!(inside.contains(&Family::V6.ip("10.244.3.3")));
        assert!(!inside.contains(&Family::V6.ip("10.245.0.1")));
    }

    /// The `crc` crate's CRC32c is SCTP's (RFC 3720 B.4's check value), a built SCTP packet
    /// verifies, and one changed bit does not.
    #[test]
    fn sctp_packets_carry_crc32c() {
        const CRC32C: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
        assert_eq!(CRC32C.checksum(b"123456789"), 0xE306_9283);
        for family in FAMILIES {
            let (src, dst) = (family.addr("192.168.50.100"), family.addr("10.96.0.10"));
            for spec in [
                sctp(&src, 40000, &dst, 3868),
                sctp(&src, 40000, &dst, 3868).data(b"CER"),
            ] {
                let mut p = spec.build();
                verify_checksums(&p).unwrap();
                let s = summary(&p);
                assert_eq!((s.sport, s.dport, s.proto), (40000, 3868, SCTP));
                let last = p.len() - 1;
                p[last] ^= 1;
                assert!(
                    verify_checksums(&p).is_err(),
                    "{family:?}: a flipped bit is caught"
                );
            }
        }
    }

    /// What the builder writes, etherparse (an independent parser) reads back the same, with
    /// valid checksums, and `layout` finds the same fields.
    #[test]
    fn built_packets_parse_back_with_valid_checksums() {
        for family in FAMILIES {
            let (src, dst) = (family.addr("192.168.50.100"), family.addr("10.96.0.10"));
            let mut specs = vec![
                tcp(&src, 40000, &dst, 80),
                tcp(&src, 40000, &dst, 80).data(b"GET /"),
                tcp(&src, 40000, &dst, 80).closing(Close::Fin),
                udp(&src, 5353, &dst, 53),
            ];
            if family == Family::V6 {
                specs.push(
                    udp(&src, 5353, &dst, 53)
                        .extension(HOPOPTS, 8)
                        .extension(DSTOPTS, 24),
                );
                specs.push(tcp(&src, 40000, &dst, 80).extension(AUTH, 12));
                let mut atomic = tcp(&src, 40000, &dst, 80).extension(DSTOPTS, 8);
                atomic.fragment = Some(Fragment {
                    offset: 0,
                    more: false,
                });
                specs.push(atomic);
            } else {
                let mut options = tcp(&src, 40000, &dst, 80);
                options.options = vec![1, 1, 1, 0];
                specs.push(options);
            }
            for spec in specs {
                let p = spec.build();
                verify_checksums(&p).unwrap_or_else(|e| panic!("{spec:?}: {e}"));
                let s = summary(&p);
                assert_eq!(
                    (s.src, s.sport, s.dst, s.dport),
                    (spec.src, spec.sport, spec.dst, spec.dport)
                );
                let l = layout(&p).unwrap();
                assert_eq!((l.src, l.dst, l.l4 + l.l4_len), (spec.src, spec.dst, p.len()));
                assert!(!l.fragment);
                // A rewrite keeps every checksum valid.
                let to = family.addr("10.244.1.5");
                verify_checksums(&rewritten(&p, None, Some((&to, 8080)))).unwrap();
            }
            // ICMP errors of the family verify too, their quote where `quoted_summary` says.
            let p = tcp(&src, 40000, &dst, 80).build();
            for kind in [IcmpError::PortUnreachable, IcmpError::TooBig { mtu: 1280 }] {
                let e = icmp_error(&dst, &src, kind, &p);
                verify_checksums(&e).unwrap();
                verify_quoted_ip_checksum(&e).unwrap();
                assert_eq!(quoted_summary(&e).dport, 80);
            }
        }
    }
}
