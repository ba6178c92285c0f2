//! The egress flow filter (`lb_common::ct_filter`): a new flow's egress entries set their
//! tuple's byte, and egress looks a packet up in the conntrack tables only if its byte is set.

use lb_common::{
    ct_filter,
    family::{V4, V6},
};

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
    // The tuple is read after the control word's lookup, not before it: loaded before a helper
    // call, its fields are spilled to the frame.
    !active::<F>()
        || may_hold::<F>(ct_filter::bucket::<F>(
            &flow.saddr,
            &flow.daddr,
            flow.sport,
            flow.dport,
            flow.proto,
        ))
}

/// Whether the filter is on: the agent has rebuilt it (or the maps held no flow), and a clear
/// byte then says that no egress entry has a tuple of that bucket.
#[inline(always)]
fn active<F: Ip>() -> bool {
    F::ct_filter()
        .get(ct_filter::CONTROL)
        .is_some_and(|control| ct_filter::control(*control).0)
}

/// Whether the conntrack tables may hold an egress entry whose tuple is in `bucket`, the filter
/// being on: a byte of the bucket is set. `false` is certain.
#[inline(always)]
fn may_hold<F: Ip>(bucket: u32) -> bool {
    let (word, offset) = ct_filter::position(bucket);
    F::ct_filter()
        .get(word)
        .is_none_or(|w| ct_filter::word_has(*w, offset))
}

/// [`new_flow_tuples`]' bit: an egress entry of the reply tuple (backend -> client) may exist.
pub(super) const REPLY_MAY_BE_HELD: u8 = 1;
/// [`new_flow_tuples`]' bit: an egress entry of the tuple after DNAT (client -> backend, any tag)
/// may exist.
pub(super) const FORWARD_MAY_BE_HELD: u8 = 2;

/// Which of a new flow's two egress tuples an entry may hold already, as bits: `track` looks a
/// tuple up (and removes a stale entry of it) only when its bit is set. Most new flows' tuples
/// are no entry's, and each of those lookups is a cache miss into a table of a million entries.
/// Through a global function per family ([`lb_ct_filter_held4`], [`lb_ct_filter_held6`]), which
/// the verifier checks once on its own, as [`note_bucket`]'s.
#[inline(always)]
pub(super) fn new_flow_tuples<F: Ip>(reply_bucket: u32, forward_bucket: u32) -> u8 {
    let bits = if F::BITS == 32 {
        lb_ct_filter_held4(reply_bucket, forward_bucket)
    } else {
        lb_ct_filter_held6(reply_bucket, forward_bucket)
    };
    bits as u8
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_ct_filter_held4(reply_bucket: u32, forward_bucket: u32) -> u32 {
    held_bits::<V4>(reply_bucket, forward_bucket)
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_ct_filter_held6(reply_bucket: u32, forward_bucket: u32) -> u32 {
    held_bits::<V6>(reply_bucket, forward_bucket)
}

#[inline(always)]
fn held_bits<F: Ip>(reply_bucket: u32, forward_bucket: u32) -> u32 {
    if !active::<F>() {
        return (REPLY_MAY_BE_HELD | FORWARD_MAY_BE_HELD) as u32;
    }
    let mut bits = 0;
    if may_hold::<F>(reply_bucket) {
        bits |= REPLY_MAY_BE_HELD as u32;
    }
    if may_hold::<F>(forward_bucket) {
        bits |= FORWARD_MAY_BE_HELD as u32;
    }
    bits
}

pub(super) use lb_common::ct_filter::{bucket, key_bucket};

/// `new_flow`'s bucket to note when it made no egress entry.
pub(super) const NO_BUCKET: u32 = u32::MAX;

/// Sets the byte of a bucket in the generation the programs write: called after a new flow
/// inserted its egress entry (`new_flow`, with the bucket `track` left in its choice: `track`'s
/// frame is the last the IPv6 call chain has room for) and after `establish` moved one. Before
/// any packet of the flow can reach egress either way: the packet being handled leaves only when
/// the program returns. Through a global function per family ([`lb_ct_filter_note4`],
/// [`lb_ct_filter_note6`]), which the verifier checks once, on its own, and called last on its
/// path: Linux 6.1's state pruning suffers from every branch and call these programs add (its
/// precision tracking marks every scalar precise when it walks back across a call). With the
/// calls before `establish`'s rewrite 6.1 walked `lb_tc_ingress` for 977k of its 1M steps, with
/// them last 931k; 603k before the filter; 426k since memsets are expanded into stores
/// (docs/architecture.md, section 7).
#[inline(always)]
pub(super) fn note_bucket<F: Ip>(bucket: u32) {
    if F::BITS == 32 {
        lb_ct_filter_note4(bucket);
    } else {
        lb_ct_filter_note6(bucket);
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_ct_filter_note4(bucket: u32) -> u32 {
    set_byte::<V4>(bucket);
    0
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_ct_filter_note6(bucket: u32) -> u32 {
    set_byte::<V6>(bucket);
    0
}

/// Written only if clear, so that the cache line of a busy bucket is not dirtied by every new
/// flow.
#[inline(always)]
fn set_byte<F: Ip>(bucket: u32) {
    let Some(control) = F::ct_filter().get(ct_filter::CONTROL) else {
        return;
    };
    // The generation byte as the agent wrote it (0 or 1), unmasked: LLVM then adds it to the
    // offset and keeps the bound check below, which the verifier needs. Masked, the sum is an OR
    // of two small values, which Linux 6.1's verifier cannot bound ("math between map_value
    // pointer and register with unbounded min value").
    let generation = u32::from(control.to_ne_bytes()[ct_filter::CONTROL_GENERATION]);
    // A global function's argument is any u32 to the verifier: the position is bounded here.
    let (word, offset) = ct_filter::position(bucket % ct_filter::BUCKETS);
    let index = offset + generation;
    if index >= 8 {
        return;
    }
    if let Some(ptr) = F::ct_filter().get_ptr_mut(word) {
        // SAFETY: `index` < 8, inside the 8-byte value just looked up.
        unsafe {
            let byte = (ptr as *mut u8).add(index as usize);
            if *byte == 0 {
                *byte = 1;
            }
        }
    }
}
