//! Masquerade port reservation: a free node IP port for a flow's SNAT, held by its un-SNAT entry.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_prandom_u32};
use lb_common::conntrack::{Ct4Key, Ct4Value, dir, flags as ct};

use super::parse::Flow;
use crate::maps::CONNTRACK;

/// Masquerade port attempts before giving up on a destination.
const SNAT_ATTEMPTS: u32 = 8;

/// Reserves a masquerade port: the un-SNAT entry (backend -> node IP:port) is inserted with
/// BPF_NOEXIST, so a port in use for this backend is never handed out twice.
#[inline(always)]
pub(super) fn reserve_snat_port(
    cfg: &lb_common::config::DatapathConfig,
    reply: &Flow,
    client: &Flow,
    base: &Ct4Value,
) -> Option<u16> {
    if cfg.snat_addr == [0; 4] || cfg.snat_port_max < cfg.snat_port_min {
        return None;
    }
    let range = (cfg.snat_port_max - cfg.snat_port_min) as u32 + 1;
    let start = unsafe { bpf_get_prandom_u32() };
    let unsnat = Ct4Value {
        nat_addr: client.saddr,
        nat_port: client.sport,
        flags: ct::REPLY | ct::SNAT,
        ..*base
    };
    for attempt in 0..SNAT_ATTEMPTS {
        let port = cfg.snat_port_min + (start.wrapping_add(attempt.wrapping_mul(7919)) % range) as u16;
        let key = Ct4Key {
            saddr: reply.saddr,
            daddr: cfg.snat_addr,
            sport: reply.sport,
            dport: port,
            proto: reply.proto,
            dir: dir::INGRESS,
            _pad: [0; 2],
        };
        if CONNTRACK.insert(&key, &unsnat, BPF_NOEXIST as u64).is_ok() {
            return Some(port);
        }
    }
    None
}
