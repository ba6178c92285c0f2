//! Events for `lb-agent monitor` (`lb_common::monitor`): a counted outcome with the flow it
//! happened to, written into `lb_events` only while a monitor listens for its type. The socket
//! programs build theirs in `sock.rs::forward`, the tc ingress program in `tc/new_flow.rs::event`;
//! both ask [`wanted`] first, which costs one array lookup when nobody listens.

use aya_ebpf::helpers::bpf_ktime_get_boot_ns;
use lb_common::{
    monitor::{self, MonitorEvent},
    stats::Counter,
};

use crate::{
    maps::{EVENTS, MONITOR},
    stats::count,
};

/// `lb_common::monitor::EVENT_TYPES`, in the object's read-only data.
static EVENT_TYPES: [u8; monitor::EVENT_TYPES.len()] = monitor::EVENT_TYPES;

/// Whether a listening monitor wants the events of the counter at `index` (`Counter as u32`).
#[inline(always)]
pub fn wanted(index: u32) -> bool {
    let Some(control) = MONITOR.get(0) else {
        return false;
    };
    if control.types == 0 {
        return false;
    }
    let Some(types) = EVENT_TYPES.get(index as usize) else {
        return false;
    };
    // The clock is read only when someone asked for this type: an idle node pays the lookup alone.
    control.types & u32::from(*types) != 0 && unsafe { bpf_ktime_get_boot_ns() } < control.until_ns
}

/// Writes an event into the ring buffer in place (`fill` sets the fields of a zeroed event; the
/// event never exists on the stack, which the socket programs' trace harness has no room for), or
/// counts it lost when the buffer is full.
#[inline(always)]
pub fn emit(fill: impl FnOnce(&mut MonitorEvent)) {
    let Some(mut entry) = EVENTS.reserve(0) else {
        count(Counter::MonitorEventsLost);
        return;
    };
    // Zeroed in place (every field is an integer: all zeros is an event), not copied from a
    // zeroed event on the stack.
    unsafe { entry.as_mut_ptr().write_bytes(0, 1) };
    fill(unsafe { entry.assume_init_mut() });
    entry.submit(0);
}
