//! SCTP's share of NAT: an address rewrite needs nothing of SCTP (its CRC32c checksum covers no
//! pseudo-header, RFC 9260 section 6.8), a port rewrite keeps the checksum valid with
//! `lb_common::sctp`'s update, which reads no packet byte beyond the header. `nat::apply` (in
//! `lb_tc_sctp_in`) and `nat::apply_source` (at egress) send SCTP packets here; every other step
//! of the tc path (conntrack, masquerade, REJECT, ICMP errors) is the one TCP and UDP take.
//!
//! A checksum field of zero is left alone: Linux's SCTP leaves it zero in a packet whose checksum
//! the device will compute (`sctp_packet_pack`: CHECKSUM_PARTIAL, `csum_not_inet`; a veth, and
//! every packet of SCTP's GSO), and the kernel then computes it over the packet as it is, new
//! ports included (`skb_crc32c_csum_help`); a sender with checksums disabled
//! (`net.sctp.checksum_disable`) writes zero too. A true CRC of zero (one packet in 2^32) is then
//! left stale, and the receiver drops the packet and SCTP retransmits it.

use aya_ebpf::{bindings::BPF_F_RECOMPUTE_CSUM, programs::TcContext};

use lb_common::backend::BackendValue;

use super::{ip::Ip, parse::Packet};

/// Offset of the checksum in SCTP's common header (after the ports and the verification tag).
const SCTP_CHECK: usize = 8;

/// The source rewrite at egress, as a BPF function of its own: inlined, its locals grew
/// `egress_of`'s frame past the 512 bytes Linux 5.10 and 6.1 allow its call chain (each frame
/// rounded to 32). (At ingress, in `lb_tc_sctp_in`, a call would add a frame to a chain that has
/// no room for one: there it is inlined.)
#[inline(never)]
pub(super) fn rewrite_source<F: Ip>(
    ctx: &TcContext,
    pkt: &Packet<F>,
    addr: F::Addr,
    port: u16,
) -> Result<(), ()> {
    rewrite::<F, true>(ctx, pkt, addr, port)
}

/// The destination rewrite of a new flow's first packet (`new_flow`, after `track`), as a BPF
/// function of its own: inlined, its locals grew `sctp_ingress_of::<V6>`'s frame past what that
/// call chain has room for on 5.10 and 6.1 (the program, `sctp_ingress_of`, `establish`,
/// `lb_sctp_checksum`). The backend by reference: an IPv6 address by value is a copy in the
/// caller's frame.
#[inline(never)]
pub(super) fn rewrite_destination<F: Ip>(
    ctx: &TcContext,
    pkt: &Packet<F>,
    backend: &BackendValue<F>,
) -> Result<(), ()> {
    rewrite::<F, false>(ctx, pkt, backend.addr, backend.port)
}

/// Rewrites the destination (`SOURCE == false`) or source address and port of an SCTP packet.
#[inline(always)]
pub(super) fn rewrite<F: Ip, const SOURCE: bool>(
    ctx: &TcContext,
    pkt: &Packet<F>,
    addr: F::Addr,
    port: u16,
) -> Result<(), ()> {
    let (old_addr, old_port, port_off) = pkt.endpoint(SOURCE);
    if old_addr != addr {
        F::rewrite_l3(ctx, SOURCE, old_addr, addr)?;
    }
    if old_port != port {
        rewrite_port::<F>(ctx, pkt.l4, port_off, port)?;
    }
    Ok(())
}

/// The port at `port_off` and the checksum. Through the helpers, with `BPF_F_RECOMPUTE_CSUM`:
/// they keep `skb->csum` of a CHECKSUM_COMPLETE packet right (no L4 checksum helper knows CRC32c).
#[inline(always)]
fn rewrite_port<F: Ip>(ctx: &TcContext, l4: usize, port_off: usize, port: u16) -> Result<(), ()> {
    // The ports as the packet holds them now (an earlier rewrite of this run may have changed them).
    let old_ports = ctx.load::<[u8; 4]>(l4).map_err(|_| ())?;
    let checksum = u32::from_le_bytes(ctx.load::<[u8; 4]>(l4 + SCTP_CHECK).map_err(|_| ())?);
    let mut new_ports = old_ports;
    let at = port_off - l4;
    let port_be = port.to_be_bytes();
    if at == 0 {
        new_ports[0] = port_be[0];
        new_ports[1] = port_be[1];
    } else {
        new_ports[2] = port_be[0];
        new_ports[3] = port_be[1];
    }
    ctx.store(port_off, &port_be, BPF_F_RECOMPUTE_CSUM as u64)
        .map_err(|_| ())?;
    if checksum != 0 {
        let len = F::l4_len(ctx, l4).ok_or(())?;
        let updated = lb_sctp_checksum(
            checksum,
            u32::from_ne_bytes(old_ports),
            u32::from_ne_bytes(new_ports),
            len,
        );
        ctx.store(
            l4 + SCTP_CHECK,
            &updated.to_le_bytes(),
            BPF_F_RECOMPUTE_CSUM as u64,
        )
        .map_err(|_| ())?;
    }
    Ok(())
}

/// `lb_common::sctp::checksum_after_port_rewrite` as a global function: the verifier checks its
/// loops (at most 16 carry-less products of 32 steps) once, on their own, rather than again for
/// every caller state that reaches a rewrite (as `snat::lb_reclaim_port4`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_sctp_checksum(checksum: u32, old_ports: u32, new_ports: u32, len: u32) -> u32 {
    lb_common::sctp::checksum_after_port_rewrite(
        checksum,
        old_ports.to_ne_bytes(),
        new_ports.to_ne_bytes(),
        len,
    )
}
