//! The tc programs' prefilter (`lb4_prefilter`, `lb6_prefilter`): one bit per hashed tuple that a
//! packet must carry for the programs to have anything to do with it, so that traffic they never
//! translate (pod to pod, node to anywhere) passes after one array read instead of a conntrack and
//! a frontend lookup that both miss (two hash-bucket walks: most of the ~400 ns the ingress
//! program cost such a packet).
//!
//! Which tuples, from what the programs look up (see `conntrack`'s table):
//! - ingress: the destination address, for every frontend address (a new flow, or a forward DNAT
//!   entry keyed by client -> frontend) and every masquerade address (an un-SNAT entry keyed by
//!   backend -> node IP:port); then, for a packet with ports, its (address, port): a frontend's
//!   port has a bit of its own ([`ingress_port_bit`], in the address bit's cache line), and a
//!   masquerade address needs the port to be a masquerade port (`config::SNAT_PORT_MIN..=MAX`: an
//!   un-SNAT entry's is one). So the node's own traffic to its addresses (the replies to its
//!   connections, kubelet, sshd, host-network pods) passes after the filter too, not only traffic
//!   to addresses no frontend has; before, every such packet took two conntrack lookups and a
//!   frontend lookup that all missed;
//! - egress: the source or the destination (address, port) being a backend's (an un-DNAT entry
//!   keyed by backend -> client, an SNAT entry keyed by client -> backend).
//!
//! A bit set for a tuple that needs none (a hash collision, a Service gone) only costs the full
//! path; a bit missing for a tuple that needs one would leave a flow untranslated. So the agent
//! sets a tuple's bit before writing the entry that names it, and clears a bit only when no
//! frontend, backend, masquerade address or conntrack entry has needed it for a while
//! (`lb-agent/src/apply/prefilter.rs`). The programs apply the filter only once the agent says
//! the bits are complete (`config::flags::PREFILTER`).
//!
//! The hash is the same function here for both sides: the agent's and the programs' bits agree by
//! construction.

use crate::{
    config,
    conntrack::{CtKey, CtValue, dir, flags},
    family::{Family, In6Addr},
};

/// log2 of the bits per family: 2^20 bits, 128 KiB. With 30,000 Services of ten endpoints each
/// (about 330,000 tuples) a quarter of the bits are set, so three packets in four that the
/// programs do not translate pass after the filter alone.
pub const BITS_LOG2: u32 = 20;
/// The filter's 64-bit words: the array map's entries.
pub const WORDS: u32 = 1 << (BITS_LOG2 - 6);

const INGRESS_SALT: u32 = 0x5EA0_0001;
const EGRESS_SALT: u32 = 0x5EA0_0002;

#[inline(always)]
pub(crate) fn mix(h: u32, word: u32) -> u32 {
    let h = (h ^ word).wrapping_mul(0x9E37_79B1);
    h ^ (h >> 15)
}

/// An address folded into the hash word by word. IPv6 addresses are read as the four aligned
/// words they are (`In6Addr::words`): read byte by byte, the sixteen bytes would each take a
/// register and a stack slot in the programs' frames.
pub trait Fold {
    fn fold(&self, h: u32) -> u32;
}

impl Fold for [u8; 4] {
    #[inline(always)]
    fn fold(&self, h: u32) -> u32 {
        mix(h, u32::from_ne_bytes(*self))
    }
}

impl Fold for In6Addr {
    #[inline(always)]
    fn fold(&self, h: u32) -> u32 {
        let [a, b, c, d] = self.words();
        mix(mix(mix(mix(h, a), b), c), d)
    }
}

/// The bit of a packet's destination address at ingress.
#[inline(always)]
pub fn ingress_bit<F: Family>(daddr: &F::Addr) -> u32 {
    // The top bits of a multiplicative hash are the well-mixed ones.
    mix(daddr.fold(INGRESS_SALT), 0).wrapping_mul(0x85EB_CA6B) >> (32 - BITS_LOG2)
}

/// log2 of the bits of a cache line (64 bytes).
pub const LINE_BITS_LOG2: u32 = 9;

const PORT_SALT: u32 = 0x5EA0_0004;

/// The bit of a destination (address, port) at ingress, given the address's bit: a bit of the
/// same 64-byte line, so testing it after the address's costs no other cache line. The port is
/// in host order, as in every key. A line holds 512 bits, so an address with hundreds of frontend
/// ports (a node IP with many NodePorts) finds most of its line's bits set: its packets take the
/// full path, as they all did before port bits.
#[inline(always)]
pub fn ingress_port_bit(address_bit: u32, port: u16) -> u32 {
    let h = mix(address_bit ^ PORT_SALT, port as u32).wrapping_mul(0x85EB_CA6B);
    address_bit & !((1 << LINE_BITS_LOG2) - 1) | h >> (32 - LINE_BITS_LOG2)
}

/// Whether `port` is a masquerade port: an un-SNAT entry (backend -> masquerade address:port)
/// needs only its address's bit when it is (the programs test the range), its port's bit too
/// when not (a range changed since the entry was made).
#[inline(always)]
pub const fn is_masquerade_port(port: u16, min: u16, max: u16) -> bool {
    port >= min && port <= max
}

/// The bit of an (address, port) at egress (ports in host order, as in every key).
#[inline(always)]
pub fn egress_bit<F: Family>(addr: &F::Addr, port: u16) -> u32 {
    mix(addr.fold(EGRESS_SALT), port as u32).wrapping_mul(0x85EB_CA6B) >> (32 - BITS_LOG2)
}

/// The word of a bit, and the bit within it.
#[inline(always)]
pub const fn word_of(bit: u32) -> (u32, u64) {
    (bit >> 6, 1u64 << (bit & 63))
}

/// The bits a conntrack entry needs: its key is exactly the tuple of the packets it rewrites, so
/// the bits of the side the filter tests there (see the module doc). An ingress entry needs its
/// destination address's bit (the later fragments of its packets are tested on it alone) and,
/// but for an un-SNAT entry of a masquerade port, its (address, port)'s.
pub fn conntrack_bits<F: Family>(key: &CtKey<F>, value: &CtValue<F>) -> impl Iterator<Item = u32> {
    let (first, second) = if key.dir == dir::INGRESS {
        let address = ingress_bit::<F>(&key.daddr);
        let unsnat_port = value.flags & flags::REPLY != 0
            && is_masquerade_port(key.dport, config::SNAT_PORT_MIN, config::SNAT_PORT_MAX);
        (
            address,
            (!unsnat_port).then(|| ingress_port_bit(address, key.dport)),
        )
    } else if value.flags & flags::REPLY != 0 {
        // un-DNAT: backend -> client.
        (egress_bit::<F>(&key.saddr, key.sport), None)
    } else {
        // SNAT: client -> backend.
        (egress_bit::<F>(&key.daddr, key.dport), None)
    };
    core::iter::once(first).chain(second)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::{V4, V6};

    #[test]
    fn bits_stay_in_range_and_spread() {
        let mut seen = [0u32; 64];
        for i in 0..20_000u32 {
            let addr = (0x0A60_0000u32 + i).to_be_bytes();
            let b = ingress_bit::<V4>(&addr);
            assert!(b < 1 << BITS_LOG2);
            seen[(b >> (BITS_LOG2 - 6)) as usize] += 1;
            let e = egress_bit::<V4>(&addr, 8080);
            assert!(e < 1 << BITS_LOG2);
        }
        // Consecutive cluster IPs land evenly over the filter (20,000 / 64 = 312 per part).
        assert!(seen.iter().all(|n| (200..450).contains(n)), "{seen:?}");
    }

    #[test]
    fn ingress_and_egress_bits_differ_and_ports_matter() {
        let addr = [10, 96, 0, 10];
        assert_ne!(ingress_bit::<V4>(&addr), egress_bit::<V4>(&addr, 0));
        assert_ne!(egress_bit::<V4>(&addr, 80), egress_bit::<V4>(&addr, 81));
        let v6 = crate::family::In6Addr::new([0xfd, 0, 0, 0x10, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10]);
        assert!(ingress_bit::<V6>(&v6) < 1 << BITS_LOG2);
        let mut other = v6;
        other.as_mut()[15] = 0x11;
        assert_ne!(ingress_bit::<V6>(&v6), ingress_bit::<V6>(&other));
    }

    #[test]
    fn a_port_bit_shares_its_address_bits_line_and_spreads_in_it() {
        let mut seen = [0u32; 1 << LINE_BITS_LOG2];
        for i in 0..200u32 {
            let address = ingress_bit::<V4>(&(0x0A60_0000u32 + i).to_be_bytes());
            for port in [53, 80, 443, 8080, 30000 + i as u16] {
                let bit = ingress_port_bit(address, port);
                assert_eq!(bit >> LINE_BITS_LOG2, address >> LINE_BITS_LOG2, "one line");
                seen[(bit & ((1 << LINE_BITS_LOG2) - 1)) as usize] += 1;
            }
            assert_ne!(ingress_port_bit(address, 80), ingress_port_bit(address, 81));
        }
        // 1,000 bits over the line's 512 positions: none piles up (a uniform hash gives at most
        // about 8 in one).
        assert!(seen.iter().all(|n| *n <= 10), "{seen:?}");
        assert!(seen.iter().filter(|n| **n == 0).count() < 200, "{seen:?}");
    }

    #[test]
    fn a_conntrack_entry_needs_the_bits_its_packets_are_tested_with() {
        extern crate std;
        let client = [192, 168, 50, 100];
        let frontend = [10, 96, 0, 10];
        let backend = [10, 244, 1, 5];
        let node = [192, 168, 50, 10];
        let key = |saddr, sport, daddr, dport, d| CtKey::<V4> {
            saddr,
            daddr,
            sport,
            dport,
            proto: crate::proto::TCP,
            dir: d,
            tag: 0,
        };
        let value = |f| CtValue::<V4> {
            flags: f,
            ..Default::default()
        };
        let bits = |k: &CtKey<V4>, f| conntrack_bits(k, &value(f)).collect::<std::vec::Vec<_>>();
        // forward DNAT: the packet's destination at ingress, its address and its port.
        let forward = key(client, 40000, frontend, 80, dir::INGRESS);
        let address = ingress_bit::<V4>(&frontend);
        assert_eq!(bits(&forward, 0), [address, ingress_port_bit(address, 80)]);
        // un-SNAT: the masquerade address, and its port only outside the masquerade ports,
        // which the programs test by range.
        let node_bit = ingress_bit::<V4>(&node);
        let unsnat = key(backend, 8080, node, config::SNAT_PORT_MIN, dir::INGRESS);
        assert_eq!(bits(&unsnat, flags::REPLY | flags::SNAT), [node_bit]);
        let unsnat = key(backend, 8080, node, config::SNAT_PORT_MAX + 1, dir::INGRESS);
        assert_eq!(
            bits(&unsnat, flags::REPLY | flags::SNAT),
            [node_bit, ingress_port_bit(node_bit, config::SNAT_PORT_MAX + 1)]
        );
        // un-DNAT: the reply's source at egress.
        let reply = key(backend, 8080, client, 40000, dir::EGRESS);
        assert_eq!(bits(&reply, flags::REPLY), [egress_bit::<V4>(&backend, 8080)]);
        // SNAT: the forward packet's destination at egress.
        let snat = key(client, 40000, backend, 8080, dir::EGRESS);
        assert_eq!(bits(&snat, flags::SNAT), [egress_bit::<V4>(&backend, 8080)]);
    }
}
