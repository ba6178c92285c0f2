//! Packets for BPF_PROG_TEST_RUN fixtures, built and checked with etherparse: every fixture
//! builds its input and its expected output the same way, so a byte-for-byte comparison checks the
//! rewritten fields, and `verify_checksums` checks what the program computed incrementally against
//! a full recomputation.

use std::net::Ipv4Addr;

use etherparse::{Icmpv4Type, IpNumber, Ipv4Header, PacketBuilder, SlicedPacket, TransportSlice};

pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0c];
pub const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];

/// A TCP or UDP packet under construction.
#[derive(Clone, Debug)]
pub struct Spec {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    pub udp: bool,
    /// TCP flags: SYN only when true, else ACK (+PSH with payload).
    pub syn: bool,
    /// A TCP close: FIN+ACK, or RST+ACK.
    pub close: Option<Close>,
    pub payload: Vec<u8>,
    pub ttl: u8,
    /// Extra IPv4 options (a multiple of 4 bytes).
    pub options: Vec<u8>,
    /// Set the more-fragments flag.
    pub more_fragments: bool,
}

pub fn tcp(src: &str, sport: u16, dst: &str, dport: u16) -> Spec {
    Spec {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        sport,
        dport,
        udp: false,
        syn: true,
        close: None,
        payload: Vec::new(),
        ttl: 64,
        options: Vec::new(),
        more_fragments: false,
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

    /// The packet bytes, with correct checksums.
    pub fn build(&self) -> Vec<u8> {
        let mut ip = Ipv4Header::new(
            0,
            self.ttl,
            if self.udp { IpNumber::UDP } else { IpNumber::TCP },
            self.src.octets(),
            self.dst.octets(),
        )
        .expect("ipv4 header");
        ip.identification = 0x1234;
        ip.dont_fragment = !self.more_fragments;
        ip.more_fragments = self.more_fragments;
        if !self.options.is_empty() {
            ip.options = self.options.as_slice().try_into().expect("valid options length");
        }
        let base = PacketBuilder::ethernet2(CLIENT_MAC, NODE_MAC)
            .ip(etherparse::IpHeaders::Ipv4(ip, Default::default()));
        let mut out = Vec::new();
        if self.udp {
            base.udp(self.sport, self.dport)
                .write(&mut out, &self.payload)
                .expect("write");
        } else {
            let b = base.tcp(self.sport, self.dport, 1000, 64_240);
            let b = match (self.syn, self.close) {
                (true, _) => b.syn(),
                (false, Some(Close::Fin)) => b.ack(5000).fin(),
                (false, Some(Close::Rst)) => b.ack(5000).rst(),
                (false, None) => b.ack(5000).psh(),
            };
            b.write(&mut out, &self.payload).expect("write");
        }
        out
    }
}

/// The fields tests look at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
}

/// Decodes a TCP or UDP packet (panics on anything else).
pub fn summary(packet: &[u8]) -> Summary {
    let sliced = SlicedPacket::from_ethernet(packet).unwrap_or_else(|e| panic!("not a packet: {e:?}"));
    let Some(etherparse::NetSlice::Ipv4(ip)) = &sliced.net else {
        panic!("not IPv4")
    };
    let h = ip.header();
    let (sport, dport) = match &sliced.transport {
        Some(TransportSlice::Tcp(t)) => (t.source_port(), t.destination_port()),
        Some(TransportSlice::Udp(u)) => (u.source_port(), u.destination_port()),
        other => panic!("not TCP/UDP: {other:?}"),
    };
    Summary {
        src: h.source_addr(),
        dst: h.destination_addr(),
        sport,
        dport,
        proto: h.protocol().0,
    }
}

/// Checks the IPv4 header checksum and the TCP/UDP/ICMP checksum of a packet.
pub fn verify_checksums(packet: &[u8]) -> Result<(), String> {
    let sliced = SlicedPacket::from_ethernet(packet).map_err(|e| format!("{e:?}"))?;
    let Some(etherparse::NetSlice::Ipv4(ip)) = &sliced.net else {
        return Err("not IPv4".into());
    };
    let header = ip.header().to_header();
    if header.calc_header_checksum() != header.header_checksum {
        return Err(format!(
            "IP checksum {:#06x}, expected {:#06x}",
            header.header_checksum,
            header.calc_header_checksum()
        ));
    }
    let payload = ip.payload().payload;
    match &sliced.transport {
        Some(TransportSlice::Tcp(t)) => {
            let expected = t
                .to_header()
                .calc_checksum_ipv4(&header, t.payload())
                .map_err(|e| format!("{e:?}"))?;
            if expected != t.checksum() {
                return Err(format!(
                    "TCP checksum {:#06x}, expected {expected:#06x}",
                    t.checksum()
                ));
            }
        }
        Some(TransportSlice::Udp(u)) => {
            if u.checksum() != 0 {
                let expected = u
                    .to_header()
                    .calc_checksum_ipv4(&header, u.payload())
                    .map_err(|e| format!("{e:?}"))?;
                if expected != u.checksum() {
                    return Err(format!(
                        "UDP checksum {:#06x}, expected {expected:#06x}",
                        u.checksum()
                    ));
                }
            }
        }
        Some(TransportSlice::Icmpv4(_)) => {
            // The checksum covers the whole ICMP message.
            let sum = payload.chunks(2).fold(0u32, |s, c| {
                s + u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))
            });
            let folded = (sum & 0xffff) + (sum >> 16);
            let folded = (folded & 0xffff) + (folded >> 16);
            if folded != 0xffff {
                return Err(format!("ICMP checksum does not verify (sum {folded:#06x})"));
            }
        }
        _ => {}
    }
    Ok(())
}

/// An ICMP error from `from` to `to` quoting the first `ihl + 8` bytes of `quoted`'s IP packet.
pub fn icmp_error(from: &str, to: &str, icmp_type: Icmpv4Type, quoted: &[u8]) -> Vec<u8> {
    let ip = &quoted[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let quote = &ip[..(ihl + 8).min(ip.len())];
    let from: Ipv4Addr = from.parse().unwrap();
    let to: Ipv4Addr = to.parse().unwrap();
    let mut out = Vec::new();
    PacketBuilder::ethernet2(CLIENT_MAC, NODE_MAC)
        .ipv4(from.octets(), to.octets(), 64)
        .icmpv4(icmp_type)
        .write(&mut out, quote)
        .expect("write");
    out
}

/// The quoted packet's addresses and ports inside an ICMP error.
pub fn quoted_summary(icmp_packet: &[u8]) -> Summary {
    let ip = &icmp_packet[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let q = &ip[ihl + 8..];
    let qihl = usize::from(q[0] & 0x0f) * 4;
    Summary {
        src: Ipv4Addr::new(q[12], q[13], q[14], q[15]),
        dst: Ipv4Addr::new(q[16], q[17], q[18], q[19]),
        sport: u16::from_be_bytes([q[qihl], q[qihl + 1]]),
        dport: u16::from_be_bytes([q[qihl + 2], q[qihl + 3]]),
        proto: q[9],
    }
}

/// Checks the quoted IP header's checksum inside an ICMP error.
pub fn verify_quoted_ip_checksum(icmp_packet: &[u8]) -> Result<(), String> {
    let ip = &icmp_packet[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let q = &ip[ihl + 8..];
    let (header, _) = Ipv4Header::from_slice(q).map_err(|e| format!("quoted header: {e:?}"))?;
    if header.calc_header_checksum() != header.header_checksum {
        return Err(format!(
            "quoted IP checksum {:#06x}, expected {:#06x}",
            header.header_checksum,
            header.calc_header_checksum()
        ));
    }
    Ok(())
}

/// Rewrites fields of a TCP/UDP packet and recomputes every checksum (the expected output of a
/// translation, built independently of the program).
pub fn rewritten(packet: &[u8], src: Option<(&str, u16)>, dst: Option<(&str, u16)>) -> Vec<u8> {
    let s = summary(packet);
    let sliced = SlicedPacket::from_ethernet(packet).unwrap();
    let Some(etherparse::NetSlice::Ipv4(ip)) = &sliced.net else {
        panic!()
    };
    let mut header = ip.header().to_header();
    let (src_ip, sport) = src
        .map(|(a, p)| (a.parse::<Ipv4Addr>().unwrap(), p))
        .unwrap_or((s.src, s.sport));
    let (dst_ip, dport) = dst
        .map(|(a, p)| (a.parse::<Ipv4Addr>().unwrap(), p))
        .unwrap_or((s.dst, s.dport));
    header.source = src_ip.octets();
    header.destination = dst_ip.octets();
    let mut out = Vec::new();
    let eth = sliced
        .link
        .as_ref()
        .and_then(|l| match l {
            etherparse::LinkSlice::Ethernet2(e) => Some(e.to_header()),
            _ => None,
        })
        .expect("ethernet");
    let builder = PacketBuilder::ethernet2(eth.source, eth.destination)
        .ip(etherparse::IpHeaders::Ipv4(header, Default::default()));
    match &sliced.transport {
        Some(TransportSlice::Tcp(t)) => {
            let mut h = t.to_header();
            h.source_port = sport;
            h.destination_port = dport;
            builder.tcp_header(h).write(&mut out, t.payload()).unwrap();
        }
        Some(TransportSlice::Udp(u)) => {
            builder.udp(sport, dport).write(&mut out, u.payload()).unwrap();
        }
        other => panic!("not TCP/UDP: {other:?}"),
    }
    out
}
