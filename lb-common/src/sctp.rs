//! SCTP's checksum, kept valid across a port rewrite without reading the packet (issue 17).
//!
//! SCTP protects its packet with CRC32c (RFC 9260 section 6.8 and appendix A), computed over the
//! common header and every chunk with the checksum field taken as zero, and stored in the field
//! least significant byte first (Linux: `sctp_compute_cksum` returns `cpu_to_le32(~crc)`). It
//! covers no pseudo-header: a rewrite of the IP addresses leaves it valid; a rewrite of the ports
//! (the first four bytes of the common header) does not. There is no BPF helper for CRC32c
//! (`bpf_csum_diff` and `bpf_l4_csum_replace` are one's complement sums), and recomputing it
//! means a loop over every byte of the packet.
//!
//! A CRC is affine in its message: for two messages of one length, `crc(a) ^ crc(b)` is the
//! linear part of the CRC of `a ^ b`. A port rewrite changes only bytes 0..4, so the new checksum
//! is the old one XOR the linear CRC of those four bytes' difference followed by `len - 4` zero
//! bytes: the difference as a polynomial times `x^(8 len)` modulo the CRC polynomial (running a
//! register through `n` bytes multiplies it by `x^(8n)`). `x^(8n)` for `n < 2^16` is the product
//! of two table entries (its low byte's and its high byte's), so the update is two carry-less
//! products of 32 steps, the same bounded cost for every packet, and no packet byte is read
//! beyond the ports.
//!
//! For the BPF verifier no step branches on the data: each step's choice is a multiplication by
//! one bit (see `times_bit`). The tc path calls this in its global function `lb_sctp_checksum`.

/// CRC32c's polynomial (Castagnoli), bit-reflected as the CRC is computed.
pub const POLY: u32 = 0x82F6_3B78;

/// `value` when bit 0 of `bit` is set, else zero: a choice without a branch, by a multiplication.
/// Not by a mask of all ones (`0 - bit`): Linux 6.17's verifier splits its state on a value in
/// [-1, 0] that is then ANDed, and 64 such choices in a row multiplied its states past its
/// million instructions.
#[inline(always)]
const fn times_bit(value: u32, bit: u32) -> u32 {
    // Hidden from LLVM, which would turn a product by a known 0 or 1 back into a branch.
    value.wrapping_mul(core::hint::black_box(bit & 1))
}

/// `a * b` modulo [`POLY`], both reflected (bit 31 is `x^0`): 32 steps, each adding `b` when
/// the step's bit of `a` is set and multiplying `b` by `x`; no branch on the data. A bounded loop
/// the verifier walks once (a global function is verified once, on its own), and a small frame.
#[inline(always)]
pub const fn mul_mod_poly(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut i = 0;
    while i < 32 {
        product ^= times_bit(b, a >> (31 - i));
        b = (b >> 1) ^ times_bit(POLY, b);
        i += 1;
    }
    product
}

/// `x^(8 * n * stride)` modulo [`POLY`] for n = 0..256, reflected.
const fn x_pow_8n_table(stride: u32) -> [u32; 256] {
    // x^8 (x^(8 stride)): a register through one zero byte (`stride` of them).
    let mut step = 1u32 << 31;
    let mut i = 0;
    while i < 8 * stride {
        // Multiply by x.
        step = (step >> 1) ^ times_bit(POLY, step);
        i += 1;
    }
    let mut table = [0u32; 256];
    // x^0 = 1: bit 31.
    let mut p = 1u32 << 31;
    let mut n = 0;
    while n < 256 {
        table[n] = p;
        p = mul_mod_poly(p, step);
        n += 1;
    }
    table
}

/// `x^(8n)` for the low byte of `n`, and for its high byte.
static X_POW_8N_LO: [u32; 256] = x_pow_8n_table(1);
static X_POW_8N_HI: [u32; 256] = x_pow_8n_table(256);

/// `x^(8n)` modulo [`POLY`] (a register run through `n` zero bytes is multiplied by it), for
/// `n < 2^16` (an SCTP packet is an IP payload): one product of two table entries.
#[inline(always)]
pub fn x_pow_8n(n: u32) -> u32 {
    mul_mod_poly(
        X_POW_8N_HI[((n >> 8) & 0xff) as usize],
        X_POW_8N_LO[(n & 0xff) as usize],
    )
}

/// The checksum field's new value (as read from the packet, little-endian) after the first four
/// bytes of an SCTP packet of `len` bytes (common header and chunks) change from `old_ports` to
/// `new_ports` (source and destination port, as in the packet).
///
/// The linear CRC of the four changed bytes followed by `len - 4` zero bytes: the bytes as a
/// polynomial times `x^32` (through their own four bytes) times `x^(8(len - 4))`, so `x^(8 len)`.
#[inline(always)]
pub fn checksum_after_port_rewrite(checksum: u32, old_ports: [u8; 4], new_ports: [u8; 4], len: u32) -> u32 {
    let diff = u32::from_le_bytes(old_ports) ^ u32::from_le_bytes(new_ports);
    checksum ^ mul_mod_poly(x_pow_8n(len), diff)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    /// CRC32c bit by bit, straight from its definition (no tables, no shortcuts).
    fn crc32c(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for byte in data {
            crc ^= u32::from(*byte);
            for _ in 0..8 {
                crc = if crc & 1 != 0 { (crc >> 1) ^ POLY } else { crc >> 1 };
            }
        }
        !crc
    }

    /// An SCTP packet's checksum as Linux writes it: over the packet with the field zeroed,
    /// stored least significant byte first.
    fn seal(packet: &mut [u8]) {
        packet[8..12].fill(0);
        let crc = crc32c(packet);
        packet[8..12].copy_from_slice(&crc.to_le_bytes());
    }

    fn field(packet: &[u8]) -> u32 {
        u32::from_le_bytes(packet[8..12].try_into().unwrap())
    }

    /// xorshift: deterministic bytes without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    #[test]
    fn the_reference_crc_is_crc32c() {
        // RFC 3720 appendix B.4 and every CRC catalogue: CRC-32C of "123456789".
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        // RFC 3720 B.4: 32 bytes of zeros.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    #[test]
    fn powers_of_x_match_running_through_zero_bytes() {
        let mut rng = Rng(0x5EA5_C7B0_0000_0017);
        for n in [0u32, 1, 2, 3, 7, 8, 100, 1480, 9000, 65531] {
            let register = rng.next() as u32;
            let mut through = register;
            for _ in 0..n {
                for _ in 0..8 {
                    through = if through & 1 != 0 {
                        (through >> 1) ^ POLY
                    } else {
                        through >> 1
                    };
                }
            }
            assert_eq!(mul_mod_poly(x_pow_8n(n), register), through, "n = {n}");
        }
    }

    #[test]
    fn a_port_rewrite_keeps_the_checksum_valid() {
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        // From a bare common header (12 bytes) and a minimal chunk up to jumbo frames.
        for len in [
            12usize, 16, 17, 20, 52, 64, 100, 576, 1452, 1480, 4096, 8972, 65515,
        ] {
            for _ in 0..8 {
                let mut packet = rng.bytes(len);
                seal(&mut packet);
                let old: [u8; 4] = packet[0..4].try_into().unwrap();
                let new: [u8; 4] = (rng.next() as u32).to_ne_bytes();
                let updated = checksum_after_port_rewrite(field(&packet), old, new, len as u32);
                packet[0..4].copy_from_slice(&new);
                let mut recomputed = packet.clone();
                seal(&mut recomputed);
                assert_eq!(updated, field(&recomputed), "{len} bytes, {old:?} -> {new:?}");
            }
        }
    }

    #[test]
    fn rewriting_one_port_or_none() {
        let mut rng = Rng(0xFEED_FACE_CAFE_BEEF);
        let mut packet = rng.bytes(300);
        seal(&mut packet);
        let old: [u8; 4] = packet[0..4].try_into().unwrap();
        assert_eq!(
            checksum_after_port_rewrite(field(&packet), old, old, 300),
            field(&packet),
            "same ports, same checksum"
        );
        // Only the destination port (a DNAT from 5060 to 15060).
        let mut new = old;
        new[2..4].copy_from_slice(&15060u16.to_be_bytes());
        let updated = checksum_after_port_rewrite(field(&packet), old, new, 300);
        packet[0..4].copy_from_slice(&new);
        seal(&mut packet);
        assert_eq!(updated, field(&packet));
    }
}
