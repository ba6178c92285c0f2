//! Masquerade port reservation: a free node IP port for a flow's SNAT, held by its un-SNAT entry.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_prandom_u32};
use lb_common::{
    config::DatapathConfig,
    conntrack::{CtKey, CtValue, dir},
};

use super::ip::Ip;

/// Masquerade port attempts before giving up on a destination.
const SNAT_ATTEMPTS: u32 = 8;

/// Reserves a masquerade port for the flow whose reply tuple (backend -> client, at egress) is
/// `key`: its un-SNAT entry `unsnat` (backend -> node IP:port, to the client) is inserted with
/// BPF_NOEXIST, so a port in use for this backend is never handed out twice. `key` becomes the
/// un-SNAT entry's key (the caller's buffer, for the stack's sake).
#[inline(always)]
pub(super) fn reserve_snat_port<F: Ip>(
    cfg: &DatapathConfig,
    key: &mut CtKey<F>,
    unsnat: &CtValue<F>,
) -> Option<u16> {
    let snat_addr = &F::settings(cfg).snat_addr;
    if cfg.snat_port_max < cfg.snat_port_min {
        return None;
    }
    let range = (cfg.snat_port_max - cfg.snat_port_min) as u32 + 1;
    let start = unsafe { bpf_get_prandom_u32() };
    key.daddr = *snat_addr;
    key.dir = dir::INGRESS;
    for attempt in 0..SNAT_ATTEMPTS {
        key.dport = cfg.snat_port_min + (start.wrapping_add(attempt.wrapping_mul(7919)) % range) as u16;
        if F::conntrack().insert(key, unsnat, BPF_NOEXIST as u64).is_ok() {
            return Some(key.dport);
        }
    }
    None
}
