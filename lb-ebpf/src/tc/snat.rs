//! Masquerade address and port: the address of the interface a flow leaves by (its route looked up
//! at its first packet, as MASQUERADE takes the out interface's), and a free port of it for the
//! flow's SNAT, held by its un-SNAT entry, or under exhaustion one taken back from a flow done with
//! it (a TCP handshake never completed, a silent UDP flow).

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, BPF_NOEXIST, bpf_fib_lookup},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_get_prandom_u32},
    programs::TcContext,
};
use lb_common::{
    backend::{BackendValue, flags as backend_flags},
    config::{DatapathConfig, MASQUERADE_FALLBACK, flags as config_flags},
    conntrack::{CtKey, CtValue, dir, flags as ct, snat_tag},
    family::{V4, V6},
    proto,
    stats::Counter,
};

use super::{
    conntrack::{SYN_REUSE_NS, now_ns},
    ip::Ip,
};
use crate::{family::insert_used, lb, maps::MASQ_ADDRS, stats::count};

/// `bpf_fib_lookup` results that name the interface the packet would leave by
/// (`BPF_FIB_LKUP_RET_SUCCESS`, `_NO_NEIGH`, `_FRAG_NEEDED`).
pub(super) const ROUTED: [i64; 3] = [0, 7, 8];

/// The interface a new flow from `saddr` to its backend leaves by, and the slot of the
/// masquerade address MASQUERADE would give it there (`InterfaceAddrs::slot_for` its next hop):
/// `(ifindex, slot)`, or `(MASQUERADE_FALLBACK, 0)` when the node's interfaces all masquerade
/// with the primary IP (no lookup) or the route is unknown. The lookup is the kernel's for the
/// packet as it will be forwarded: after DNAT, from the interface it came in by.
#[inline(never)]
pub(super) fn masquerade_route<F: Ip>(
    ctx: &TcContext,
    saddr: &F::Addr,
    backend: &BackendValue<F>,
    proto: u8,
) -> u32 {
    if lb::datapath_config().flags & config_flags::MASQUERADE_BY_INTERFACE == 0 {
        return MASQUERADE_FALLBACK;
    }
    // At a node address: delivered locally, no route to look up (the lookup would say "not
    // forwarded", counted as an unknown route).
    if backend.flags & backend_flags::HOST != 0 {
        return MASQUERADE_FALLBACK;
    }
    // SAFETY: an all-zero `bpf_fib_lookup` is a valid one (integers and unions of integers).
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    let rc = route_lookup::<F>(ctx, &mut params, saddr, &backend.addr, proto);
    if !ROUTED.contains(&rc) {
        count(Counter::TcMasqueradeRouteUnknown);
        return MASQUERADE_FALLBACK;
    }
    let ifindex = params.ifindex;
    let slot = match MASQ_ADDRS.get_ptr(&ifindex) {
        Some(addrs) => F::interface_addrs(unsafe { &*addrs }).slot_for(&F::fib_next_hop(&params)),
        None => 0,
    };
    // The slot (< MAX_INTERFACE_ADDRS) in the low byte: one return register, no pointer argument.
    ifindex << 8 | slot as u32
}

/// The kernel's forwarding route lookup (`bpf_fib_lookup`, `params` zeroed by the caller) of a
/// packet from `saddr` to `daddr` coming in by the interface the program runs on: at ingress,
/// the one the packet came in by (in a test run, loopback, where `ingress_ifindex` is 0); at
/// egress, the one the packet is on. Its result code; `params` says the route.
#[inline(always)]
pub(super) fn route_lookup<F: Ip>(
    ctx: &TcContext,
    params: &mut bpf_fib_lookup,
    saddr: &F::Addr,
    daddr: &F::Addr,
    proto: u8,
) -> i64 {
    F::fib_addresses(params, saddr, daddr);
    params.l4_protocol = proto;
    // SAFETY: the context's skb pointer is valid for the program's run.
    params.ifindex = unsafe { (*ctx.as_ptr().cast::<__sk_buff>()).ifindex };
    let size = core::mem::size_of::<bpf_fib_lookup>() as i32;
    // SAFETY: `params` is a valid lookup of the size given.
    unsafe { fib_lookup(ctx.as_ptr(), params, size, 0) }
}

/// The masquerade address of a route [`masquerade_route`] returned (`ifindex << 8 | slot`): the
/// interface's address in that slot, else the fallback entry's (the node's primary IP of the
/// family); `None` when neither has one. A pointer into `lb_masq_addrs`, whichever entry.
#[inline(always)]
pub(super) fn masquerade_addr<F: Ip>(route: u32) -> Option<&'static F::Addr> {
    let entry = MASQ_ADDRS
        .get_ptr(&(route >> 8))
        .filter(|addrs| F::interface_addrs(unsafe { &**addrs }).count > 0)
        .or_else(|| MASQ_ADDRS.get_ptr(&MASQUERADE_FALLBACK))?;
    F::interface_addrs(unsafe { &*entry }).get(route as u8)
}

/// Masquerade port attempts before giving up (and looking for one to take back).
const SNAT_ATTEMPTS: u32 = 8;
/// Further ports tried for one whose flow is done with it: under a flood at the rate the ports
/// turn over, most holders are too young to qualify, so one in a few does.
const RECLAIM_ATTEMPTS: u32 = 24;
/// How long a UDP flow must be silent both ways before a new flow may take its port.
const UDP_RECLAIM_IDLE_NS: u64 = 2_000_000_000;

/// Reserves a masquerade port of `snat_addr` for the flow whose reply tuple (backend -> client, at
/// egress) is `key`: its un-SNAT entry `unsnat` (backend -> snat_addr:port, to the client) is inserted with
/// BPF_NOEXIST, so a port in use for this backend is never handed out twice. `hint` (a port
/// [`reclaim_port_for`] freed, or 0) is tried first. `key` becomes the un-SNAT entry's key (the
/// caller's buffer, for the stack's sake).
#[inline(always)]
pub(super) fn reserve_snat_port<F: Ip>(
    cfg: &DatapathConfig,
    key: &mut CtKey<F>,
    unsnat: &CtValue<F>,
    snat_addr: &F::Addr,
    hint: u16,
) -> Option<u16> {
    let ports = PortSequence::new(cfg)?;
    F::copy_addr(&mut key.daddr, snat_addr);
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
        && insert_used(F::conntrack_new(), key, unsnat, BPF_NOEXIST as u64).is_ok()
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
pub(super) fn reclaim_port_for<F: Ip>(backend_id: u32, proto: u8, masq_route: u32) -> u16 {
    F::reclaim_port_for(backend_id, proto, masq_route)
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_reclaim_port4(backend_id: u32, proto: u32, masq_route: u32) -> u32 {
    reclaim_port_in_range::<V4>(backend_id, proto as u8, masq_route) as u32
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn lb_reclaim_port6(backend_id: u32, proto: u32, masq_route: u32) -> u32 {
    reclaim_port_in_range::<V6>(backend_id, proto as u8, masq_route) as u32
}

/// The ports of the masquerade address of `masq_route` ([`masquerade_route`]) towards the backend.
#[inline(always)]
fn reclaim_port_in_range<F: Ip>(backend_id: u32, proto: u8, masq_route: u32) -> u16 {
    let cfg = lb::datapath_config();
    let Some(backend) = lb::lookup_backend::<F>(backend_id) else {
        return 0;
    };
    let Some(ports) = PortSequence::new(cfg) else {
        return 0;
    };
    let Some(snat_addr) = masquerade_addr::<F>(masq_route) else {
        return 0;
    };
    let mut key = CtKey::<F> {
        saddr: backend.addr,
        daddr: *snat_addr,
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
