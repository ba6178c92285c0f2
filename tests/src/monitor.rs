//! What `lb-agent monitor` does to a data path, for tests and the benchmark that load the programs
//! with private maps (`ScratchDatapath`): take the lease in `lb_monitor`, read `lb_events`.

use lb_agent::datapath::Datapath;
use lb_common::{
    catalog,
    monitor::{MonitorControl, MonitorEvent},
};

/// CLOCK_BOOTTIME, the clock of the lease and of the events' times.
pub use lb_agent::time::boottime_ns;

/// Listens for events of `types` (`lb_common::monitor::types`) for `lease_ns` from now: a
/// negative lease has already run out, as a killed monitor's has; `types` 0 is nobody listening.
pub fn listen(datapath: &mut Datapath, types: u32, lease_ns: i64) {
    let map = datapath.map_mut(catalog::MONITOR).expect("lb_monitor");
    let mut control: aya::maps::Array<&mut aya::maps::MapData, MonitorControl> =
        map.try_into().expect("lb_monitor is an array");
    let until_ns = boottime_ns().saturating_add_signed(lease_ns);
    control
        .set(
            0,
            &MonitorControl {
                until_ns,
                types,
                pid: std::process::id(),
            },
            0,
        )
        .expect("write lb_monitor");
}

/// The events written since the last call, in order.
pub fn events(datapath: &mut Datapath) -> Vec<MonitorEvent> {
    let map = datapath.map_mut(catalog::EVENTS).expect("lb_events");
    let mut ring = aya::maps::RingBuf::try_from(map).expect("lb_events is a ring buffer");
    let mut events = Vec::new();
    while let Some(item) = ring.next() {
        assert_eq!(item.len(), size_of::<MonitorEvent>(), "an event's size");
        // SAFETY: the programs write whole events; read unaligned from the ring's bytes.
        events.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) });
    }
    events
}
