//! The egress flow filter (`lb_common::ct_filter`): a new flow's egress entries set their
//! tuple's byte, and egress looks a packet up in the conntrack tables only if its byte is set.

use lb_common::{conntrack::CtKey, ct_filter};

use super::{ip::Ip, parse::Flow};

/// Whether egress must look up `flow`'s packet: the filter is off (not yet rebuilt by this
/// agent, or unreadable), or a byte of its bucket is set. Inline for IPv4; a BPF function of its
/// own for IPv6, whose `egress_of` frame has no 8 bytes to spare (Linux 5.10 and 6.1 round each
/// frame of a call chain up to 32 bytes and allow 512 in all, which `egress_of` and its ICMP
/// error path use to the byte).
#[inline(always)]
pub(super) fn may_be_tracked<F: Ip>(flow: &Flow<F>) -> bool {
    if F::BITS == 32 {
        test::<F>(flow)
    } else {
        test_out_of_line::<F>(flow)
    }
}

#[inline(never)]
fn test_out_of_line<F: Ip>(flow: &Flow<F>) -> bool {
    test::<F>(flow)
}

#[inline(always)]
fn test<F: Ip>(flow: &Flow<F>) -> bool {
    let Some(control) = F::ct_filter().get(ct_filter::CONTROL) else {
        return true;
    };
    if !ct_filter::control(*control).0 {
        return true;
    }
    let (word, offset) = ct_filter::position(ct_filter::bucket::<F>(
        &flow.saddr,
        &flow.daddr,
        flow.sport,
        flow.dport,
        flow.proto,
    ));
    F::ct_filter()
        .get(word)
        .is_none_or(|w| ct_filter::word_has(*w, offset))
}

/// Sets the byte of `key`'s bucket in the generation the programs write: called before an egress
/// entry is inserted or moved to the established table. Written only if clear, so that the
/// cache line of a busy bucket is not dirtied by every new flow.
#[inline(always)]
pub(super) fn note<F: Ip>(key: &CtKey<F>) {
    let Some(control) = F::ct_filter().get(ct_filter::CONTROL) else {
        return;
    };
    let generation = ct_filter::control(*control).1;
    let (word, offset) = ct_filter::position(ct_filter::key_bucket(key));
    if let Some(ptr) = F::ct_filter().get_ptr_mut(word) {
        // SAFETY: `offset + generation` < 8, inside the 8-byte value just looked up.
        unsafe {
            let byte = (ptr as *mut u8).add((offset + generation) as usize);
            if *byte == 0 {
                *byte = 1;
            }
        }
    }
}
