//! Masquerade port reservation: a free node IP port for a flow's SNAT, held by its un-SNAT entry,
//! or under exhaustion one taken back from a flow done with it (a TCP handshake never completed,
//! a silent UDP flow).

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_prandom_u32};
use lb_common::{
    config::DatapathConfig,
    conntrack::{CtKey, CtValue, dir, flags as ct, snat_tag},
    family::{V4, V6},
    proto,
    stats::Counter,
};

use super::{
    conntrack::{SYN_REUSE_NS, now_ns},
    ip::Ip,
};
use crate::{lb, stats::count};

/// Masquerade port attempts before giving up (and looking for one to take back).
const SNAT_ATTEMPTS: u32 = 8;
/// Further ports tried for one whose flow is done with it: under a flood at the rate the ports
/// turn over, most holders are too young to qualify, so one in a few does.
const RECLAIM_ATTEMPTS: u32 = 24;
/// How long a UDP flow must be silent both ways before a new flow may take its port.
const UDP_RECLAIM_IDLE_NS: u64 = 2_000_000_000;

/// Reserves a masquerade port for the flow whose reply tuple (backend -> client, at egress) is
/// `key`: its un-SNAT entry `unsnat` (backend -> node IP:port, to the client) is inserted with
/// BPF_NOEXIST, so a port in use for this backend is never handed out twice. `hint` (a port
/// [`reclaim_port_for`] freed, or 0) is tried first. `key` becomes the un-SNAT entry's key (the
/// caller's buffer, for the stack's sake).
#[inline(always)]
pub(super) fn reserve_snat_port<F: Ip>(
    cfg: &DatapathConfig,
    key: &mut CtKey<F>,
    unsnat: &CtValue<F>,
    hint: u16,
) -> Option<u16> {
    let ports = PortSequence::new(cfg)?;
    key.daddr = F::settings(cfg).snat_addr;
    key.dir = dir::INGRESS;
    if hint != 0 {
        key.dport = hint;
        if reserve::<F>(key, unsnat) {
            return Some(hint);
        }
    }
    for attempt in 0..SNAT_ATTEMPTS {
        key.dport = ports.nth(attempt);
        if reserve::<F>(key, unsnat) {
            return Some(key.dport);
        }
    }
    None
}

/// Inserts a new flow's un-SNAT entry into the new-flow table if neither table holds its port.
#[inline(always)]
fn reserve<F: Ip>(key: &CtKey<F>, unsnat: &CtValue<F>) -> bool {
    F::conntrack().get_ptr(key).is_none()
        && F::conntrack_new().insert(key, unsnat, BPF_NOEXIST as u64).is_ok()
}

/// When every port `reserve_snat_port` tried for a flow to backend `backend_id` was held (the
/// range exhausted, most likely by a flood): looks at up to `RECLAIM_ATTEMPTS` further ports
/// towards that backend for one whose flow is done with it ([`reclaim_port`]) and returns it,
/// free, for the caller to try first (0: none). Called beside `track`, not below it: the stack
/// below `track` has no room for another frame with an IPv6 key (Linux 5.10 rounds every frame
/// up to 32 bytes and allows 512 for the whole chain).
///
/// A global function per family ([`lb_reclaim_port4`], [`lb_reclaim_port6`]): the verifier
/// checks a global function once, on its own, knowing only its arguments' types. As a static
/// one, its loop was walked again for every caller state reaching it, which tripled the tc
/// ingress program's verification on Linux 5.10 and 6.1 (183k to 597k steps on 6.1).
#[inline(always)]
pub(super) fn reclaim_port_for<F: Ip>(backend_id: u32, proto: u8) -> u16 {
    F::reclaim_port_for(backend_id, proto)
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_reclaim_port4(backend_id: u32, proto: u32) -> u32 {
    reclaim_port_in_range::<V4>(backend_id, proto as u8) as u32
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_reclaim_port6(backend_id: u32, proto: u32) -> u32 {
    reclaim_port_in_range::<V6>(backend_id, proto as u8) as u32
}

#[inline(always)]
fn reclaim_port_in_range<F: Ip>(backend_id: u32, proto: u8) -> u16 {
    let cfg = lb::datapath_config();
    let Some(backend) = lb::lookup_backend::<F>(backend_id) else {
        return 0;
    };
    let Some(ports) = PortSequence::new(cfg) else {
        return 0;
    };
    let mut key = CtKey::<F> {
        saddr: backend.addr,
        daddr: F::settings(cfg).snat_addr,
        sport: backend.port,
        dport: 0,
        proto,
        dir: dir::INGRESS,
        tag: 0,
    };
    for attempt in 0..RECLAIM_ATTEMPTS {
        key.dport = ports.nth(attempt);
        if reclaim_port::<F>(&key) {
            count(Counter::TcSnatPortReclaimed);
            return key.dport;
        }
    }
    0
}

/// The masquerade ports a flow tries, in order: from a random one, strides of a prime through
/// the masquerade port range, so that flows started together spread.
struct PortSequence {
    min: u16,
    range: u32,
    start: u32,
}

impl PortSequence {
    /// None when the range is empty.
    #[inline(always)]
    fn new(cfg: &DatapathConfig) -> Option<Self> {
        if cfg.snat_port_max < cfg.snat_port_min {
            return None;
        }
        Some(Self {
            min: cfg.snat_port_min,
            range: (cfg.snat_port_max - cfg.snat_port_min) as u32 + 1,
            start: unsafe { bpf_get_prandom_u32() },
        })
    }

    #[inline(always)]
    fn nth(&self, attempt: u32) -> u16 {
        self.min + (self.start.wrapping_add(attempt.wrapping_mul(7919)) % self.range) as u16
    }
}

/// Frees the masquerade port held by the un-SNAT entry at `unsnat_key` if no live flow needs it:
/// - a TCP flow at least `SYN_REUSE_NS` old whose handshake never completed (no `ESTABLISHED` on
///   its forward entry: a spoofed SYN's, in a flood);
/// - a UDP flow silent both ways for `UDP_RECLAIM_IDLE_NS` (a flood's datagram and its answer);
/// - a flow whose forward entry is gone (an orphan the GC would free), as old.
///
/// netfilter's early drop makes room the same way, by dropping unassured connections: without
/// it, a flood to a NodePort holds every port of the range towards each backend until the GC's
/// timeouts, and every legitimate new connection is dropped meanwhile. The holder's forward and
/// SNAT entries go too, so that a late packet of it starts a flow of its own instead of sending
/// through the port again. True when the entry is gone.
#[inline(never)]
fn reclaim_port<F: Ip>(unsnat_key: &CtKey<F>) -> bool {
    // A flow's entries are all in one table (established or new), the un-SNAT entry's.
    let (map, held) = match F::conntrack().get_ptr(unsnat_key) {
        Some(held) => (F::conntrack(), held),
        None => match F::conntrack_new().get_ptr(unsnat_key) {
            Some(held) => (F::conntrack_new(), held),
            None => return true,
        },
    };
    // The un-SNAT entry's target is the client; its frontend is the flow's rev-NAT id. The key
    // is built in place from the entry (no copies: an IPv6 key is 40 bytes of a frame that sits
    // at the bottom of the deepest call chain).
    let (created_ns, last_reply_ns, rev_nat_id) =
        unsafe { ((*held).created_ns, (*held).last_seen_ns, (*held).rev_nat_id) };
    let now = now_ns();
    let udp = unsnat_key.proto == proto::UDP;
    // A UDP reply refreshes `last_seen_ns` at most once a second: twice that is a second's
    // silence at least.
    let quiet = |since: u64| now.saturating_sub(since) >= UDP_RECLAIM_IDLE_NS;
    if udp && !quiet(last_reply_ns) || !udp && now.saturating_sub(created_ns) < SYN_REUSE_NS {
        return false;
    }
    let mut key = CtKey::<F> {
        saddr: unsafe { (*held).nat_addr },
        daddr: unsnat_key.saddr,
        sport: unsafe { (*held).nat_port },
        dport: unsnat_key.sport,
        proto: unsnat_key.proto,
        dir: dir::INGRESS,
        tag: 0,
    };
    if let Some(frontend) = F::revnat().get_ptr(&rev_nat_id) {
        unsafe {
            key.daddr = (*frontend).addr;
            key.dport = (*frontend).port;
        }
        if let Some(fwd) = map.get_ptr(&key) {
            let (fwd_created, fwd_seen, flags) =
                unsafe { ((*fwd).created_ns, (*fwd).last_seen_ns, (*fwd).flags) };
            if fwd_created == created_ns {
                let live = if udp {
                    !quiet(fwd_seen)
                } else {
                    flags & (ct::ESTABLISHED | ct::CLOSE_MARKS) != 0 || flags & ct::HANDSHAKE_TRACKED == 0
                };
                if live {
                    return false;
                }
                let _ = map.remove(&key);
            }
        }
    }
    // Its SNAT entry: client -> backend, at egress, untagged or tagged.
    key.daddr = unsnat_key.saddr;
    key.dport = unsnat_key.sport;
    key.dir = dir::EGRESS;
    for tag in [0, snat_tag(rev_nat_id)] {
        key.tag = tag;
        if map
            .get_ptr(&key)
            .is_some_and(|snat| unsafe { (*snat).created_ns } == created_ns)
        {
            let _ = map.remove(&key);
        }
    }
    let _ = map.remove(unsnat_key);
    true
}
