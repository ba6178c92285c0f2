//! Socket-level load balancing (cgroup connect, sendmsg, recvmsg, getpeername; both families).
//!
//! A connect() or sendto() to a frontend gets its destination rewritten to a backend before the
//! kernel routes anything, so an established connection costs nothing per packet. The reverse
//! hooks (recvmsg, getpeername) put the frontend address back, so a UDP client sees replies
//! from the address it sent to and getpeername() returns the Service address.
//!
//! Rules (kube-proxy semantics, decided by the agent and carried by the frontend entry):
//! - the frontend entry of `SCOPE_EXTERNAL` is looked up first; `TWO_SCOPES` (an external frontend
//!   with externalTrafficPolicy=Local) sends node- and pod-originated traffic to `SCOPE_INTERNAL`,
//!   the cluster-wide endpoints, as kube-proxy does;
//! - `count == 0` refuses the call: ECONNREFUSED for a Service without endpoints (kube-proxy's
//!   REJECT), EHOSTUNREACH where kube-proxy would DROP (a Local policy without local endpoints;
//!   a socket cannot lose a packet silently, so it fails fast with an errno callers handle);
//! - a call no frontend matches gets kube-proxy's cluster-ips-check: to a cluster IP (a port no
//!   Service has) ECONNREFUSED, to an unallocated address of a Service CIDR EHOSTUNREACH;
//! - any internal failure (a slot or backend missing during an update) leaves the call untouched
//!   and is counted: a connect never fails because of us.
//!
//! The logic works on the `SockCall` trait, generic over the family, so that `lb_sock_trace` (a tc
//! program, which BPF_PROG_TEST_RUN can run) executes exactly this code for tests and `lb-agent
//! trace`, and so that an AF_INET6 socket naming an IPv4-mapped address (`::ffff:10.96.0.10`,
//! what dual-stack sockets of Java, Go and C programs do) goes through the IPv4 code ([`Mapped`]),
//! exactly as connect4 would. (Of the forward hooks only connect6 meets such calls: the kernel
//! hands an AF_INET6 socket's datagram to a mapped address to the IPv4 stack, which runs
//! sendmsg4; recvmsg6 and getpeername6 do see the mapped backend and take the IPv4 code back.)

use aya_ebpf::helpers::{bpf_ktime_get_boot_ns, bpf_spin_lock, bpf_spin_unlock};
use lb_common::{
    affinity::kind,
    cluster_ip::action,
    config::{self, DatapathConfig},
    family::{Family, V4, V6, put_addr, v4_mapped, v4_unmapped},
    proto,
    revnat::{self, SockConnSlot, SockRevNatKey, SockRevNatSk, SockRevNatValue},
    service::{SvcValue, flags},
    stats::Counter,
    trace::verdict,
};

use crate::{
    family::{FamilyMaps, insert_used},
    lb::{self, Frontend},
    monitor,
    stats::count,
};

pub const ECONNREFUSED: u32 = 111;
pub const EHOSTUNREACH: u32 = 113;

/// One socket call of family `F` as the translation code sees it.
pub trait SockCall<F: Family> {
    /// IPPROTO of the socket.
    fn protocol(&self) -> u8;
    /// Destination (connect, sendmsg) or peer (recvmsg, getpeername), network order.
    fn addr(&self) -> F::Addr;
    fn port(&self) -> u16;
    fn set_addr(&mut self, addr: F::Addr, port: u16);
    fn socket_cookie(&self) -> u64;
    fn netns_cookie(&self) -> u64;
    /// The source address the packet will carry if already known (bound socket or
    /// IP_PKTINFO), else unspecified.
    fn src_addr(&self) -> F::Addr;
    /// A random value for slot selection.
    fn random(&self) -> u32;
    fn now_ns(&self) -> u64;
    /// The calling task's cgroup (v2 id), for `lb-agent monitor`; 0 where there is none (the
    /// trace harness).
    fn cgroup_id(&self) -> u64;
    /// Keeps the reverse NAT of a connected socket of family `G` for as long as the socket lives
    /// (`lb4_sock_conn`, or its socket storage); false where there is no such record (sendmsg,
    /// whose socket may talk to several frontends; the trace harness, which has no socket that
    /// closes), and the LRU map is used instead.
    fn set_sk_revnat<G: FamilyMaps>(&mut self, _entry: &SockRevNatSk<G>) -> bool {
        false
    }
    /// The reverse NAT kept for the connected socket of family `G`, if any.
    fn sk_revnat<G: FamilyMaps>(&self) -> Option<SockRevNatSk<G>> {
        None
    }
}

/// An AF_INET6 call on an IPv4-mapped address, seen as the IPv4 call it is.
pub struct Mapped<C>(pub C);

impl<C: SockCall<V6>> SockCall<V4> for Mapped<C> {
    #[inline(always)]
    fn protocol(&self) -> u8 {
        self.0.protocol()
    }
    #[inline(always)]
    fn addr(&self) -> [u8; 4] {
        v4_unmapped(&self.0.addr()).unwrap_or([0; 4])
    }
    #[inline(always)]
    fn port(&self) -> u16 {
        self.0.port()
    }
    #[inline(always)]
    fn set_addr(&mut self, addr: [u8; 4], port: u16) {
        self.0.set_addr(v4_mapped(addr), port)
    }
    #[inline(always)]
    fn socket_cookie(&self) -> u64 {
        self.0.socket_cookie()
    }
    #[inline(always)]
    fn netns_cookie(&self) -> u64 {
        self.0.netns_cookie()
    }
    #[inline(always)]
    fn src_addr(&self) -> [u8; 4] {
        // A dual-stack socket bound to an IPv4 address holds it mapped; any other source is not
        // an IPv4 one, so the kernel picks it later.
        v4_unmapped(&self.0.src_addr()).unwrap_or([0; 4])
    }
    #[inline(always)]
    fn random(&self) -> u32 {
        self.0.random()
    }
    #[inline(always)]
    fn now_ns(&self) -> u64 {
        self.0.now_ns()
    }
    #[inline(always)]
    fn cgroup_id(&self) -> u64 {
        self.0.cgroup_id()
    }
    #[inline(always)]
    fn set_sk_revnat<G: FamilyMaps>(&mut self, entry: &SockRevNatSk<G>) -> bool {
        self.0.set_sk_revnat(entry)
    }
    #[inline(always)]
    fn sk_revnat<G: FamilyMaps>(&self) -> Option<SockRevNatSk<G>> {
        self.0.sk_revnat()
    }
}

/// Whether an AF_INET6 call names an IPv4-mapped address (and belongs to the IPv4 code).
#[inline(always)]
pub fn is_mapped<C: SockCall<V6>>(call: &C) -> bool {
    v4_unmapped(&call.addr()).is_some()
}

/// What a translation did, with the details the trace harness reports.
#[derive(Clone, Copy, Default)]
pub struct Outcome<F: Family> {
    pub verdict: u32,
    pub errno: u32,
    pub scope: u8,
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub flags: u16,
    pub count: u16,
    pub addr: F::Addr,
    pub port: u16,
    /// The counter the call bumped, as an index (`Counter as u32`), for `lb-agent monitor`;
    /// [`NOT_COUNTED`] when it bumped none.
    pub counter: u32,
}

/// [`Outcome::counter`] of a call that counted nothing.
pub const NOT_COUNTED: u32 = u32::MAX;

impl<F: Family> Outcome<F> {
    #[inline(always)]
    fn pass() -> Self {
        Outcome {
            verdict: verdict::PASS,
            errno: 0,
            scope: 0,
            backend_id: 0,
            rev_nat_id: 0,
            flags: 0,
            count: 0,
            addr: F::UNSPECIFIED,
            port: 0,
            counter: NOT_COUNTED,
        }
    }

    /// Counts `counter` and remembers it as this outcome's.
    #[inline(always)]
    fn count(&mut self, counter: Counter) {
        count(counter);
        self.counter = counter as u32;
    }
}

/// Whether loadBalancerSourceRanges let this socket through. `None`: undecidable at the socket
/// (a pod's unbound socket, whose source address the kernel picks later), so leave it to tc.
#[inline(always)]
fn source_allowed<F: FamilyMaps, C: SockCall<F>>(
    call: &C,
    cfg: &DatapathConfig,
    frontend: &SvcValue,
) -> Option<bool> {
    let src = call.src_addr();
    if src != F::UNSPECIFIED {
        return Some(lb::source_in_ranges::<F>(frontend, &src));
    }
    if call.netns_cookie() == cfg.host_netns_cookie {
        // The node's own address is the source: kube-proxy allows it when a range contains it.
        return Some(frontend.has(flags::SOURCE_RANGES_ALLOW_NODE));
    }
    None
}

/// kube-proxy's cluster-ips-check for a call no frontend matched (`lb_common::cluster_ip`): a
/// cluster IP on a port no Service has is refused as a Service without endpoints is
/// (ECONNREFUSED), an unallocated address of a Service CIDR as a drop is (EHOSTUNREACH); any other
/// call proceeds.
#[inline(always)]
fn cluster_ip_check<F: FamilyMaps>(vip: &F::Addr) -> Outcome<F> {
    let mut outcome = Outcome::pass();
    match lb::cluster_ip_check::<F>(vip) {
        Some(action::REJECT) => {
            outcome.count(Counter::SockClusterIpBadPort);
            outcome.verdict = verdict::REJECT;
            outcome.errno = ECONNREFUSED;
        }
        Some(action::DROP) => {
            outcome.count(Counter::SockUnallocatedClusterIp);
            outcome.verdict = verdict::DROP;
            outcome.errno = EHOSTUNREACH;
        }
        _ => {}
    }
    outcome
}

/// connect and sendmsg (`hook`: `lb_common::trace::hook`'s): the translation, and its event
/// when a monitor listens (`lb_common::monitor`).
#[inline(always)]
pub fn forward<F: FamilyMaps, C: SockCall<F>>(call: &mut C, hook: u32) -> Outcome<F> {
    let (vip, vport) = (call.addr(), call.port());
    let outcome = translate_forward::<F, C>(call);
    if outcome.counter != NOT_COUNTED && monitor::wanted(outcome.counter) {
        monitor::emit(|event| {
            event.time_ns = unsafe { bpf_ktime_get_boot_ns() };
            event.cgroup_id = call.cgroup_id();
            event.counter = outcome.counter;
            event.hook = hook;
            event.rev_nat_id = outcome.rev_nat_id;
            event.backend_id = outcome.backend_id;
            event.family = F::AF as u8;
            event.protocol = call.protocol();
            event.dst_port = vport;
            event.backend_port = outcome.port;
            put_addr::<F>(&mut event.src, &call.src_addr());
            put_addr::<F>(&mut event.dst, &vip);
            put_addr::<F>(&mut event.backend, &outcome.addr);
        });
    }
    outcome
}

/// connect and sendmsg: translate a frontend destination to a backend.
#[inline(always)]
pub fn translate_forward<F: FamilyMaps, C: SockCall<F>>(call: &mut C) -> Outcome<F> {
    let protocol = call.protocol();
    if !proto::is_balanced(protocol) {
        return Outcome::pass();
    }
    let cfg = lb::datapath_config();
    if cfg.flags & config::flags::SOCK_HOSTNS_ONLY != 0 && call.netns_cookie() != cfg.host_netns_cookie {
        count(Counter::SockSkippedNetns);
        return Outcome::pass();
    }

    let (vip, vport) = (call.addr(), call.port());
    // Socket calls start on this node: the internal scope of a Local-policy frontend applies.
    let (key, frontend) = match lb::lookup_frontend::<F>(&vip, vport, protocol, true) {
        Frontend::None => return cluster_ip_check::<F>(&vip),
        Frontend::Incomplete => {
            let mut outcome = Outcome::pass();
            outcome.count(Counter::SockNoBackend);
            return outcome;
        }
        Frontend::Found(key, entry) => (key, entry),
    };

    // 127.0.0.1:<nodePort> exists in the host's namespace only; a pod's loopback is its own.
    if frontend.has(flags::LOCALHOST) && call.netns_cookie() != cfg.host_netns_cookie {
        return Outcome::pass();
    }

    let mut outcome = Outcome {
        scope: key.scope,
        rev_nat_id: frontend.rev_nat_id,
        flags: frontend.flags,
        count: frontend.count,
        ..Outcome::pass()
    };

    if frontend.has(flags::SOURCE_RANGES) {
        match source_allowed::<F, C>(call, cfg, frontend) {
            Some(true) => {}
            Some(false) => {
                outcome.count(Counter::SourceRangeDenied);
                outcome.verdict = verdict::DROP;
                outcome.errno = EHOSTUNREACH;
                return outcome;
            }
            None => return outcome,
        }
    }

    if frontend.count == 0 {
        if frontend.has(flags::DROP_IF_EMPTY) {
            outcome.count(Counter::SockDropped);
            outcome.verdict = verdict::DROP;
            outcome.errno = EHOSTUNREACH;
        } else {
            outcome.count(Counter::SockRejected);
            outcome.verdict = verdict::REJECT;
            outcome.errno = ECONNREFUSED;
        }
        return outcome;
    }

    // TCP: random per connection. UDP: the socket cookie, so every datagram of one socket goes to
    // the same backend while the backend set is unchanged.
    let hash = if protocol == proto::TCP {
        call.random()
    } else {
        lb::mix64(call.socket_cookie())
    };
    let selected = lb::select_backend::<F>(
        &key,
        frontend,
        || F::client_of_cookie(call.netns_cookie()),
        kind::NETNS_COOKIE,
        hash,
        || call.now_ns(),
    );
    let Some((backend_id, backend)) = selected else {
        outcome.count(Counter::SockNoBackend);
        return outcome;
    };

    // Remember the frontend for recvmsg/getpeername before the destination changes: by the
    // socket's cookie for a connect() (`lb4_sock_conn`, freed when the socket closes, so never
    // evicted), else in the LRU map, skipping the write when the entry is already there (every
    // datagram of an unconnected UDP socket comes through here).
    let in_socket = SockRevNatSk::<F> {
        backend_addr: backend.addr,
        backend_port: backend.port,
        frontend_port: vport,
        frontend_addr: vip,
        rev_nat_id: frontend.rev_nat_id,
    };
    if !call.set_sk_revnat(&in_socket) {
        let rev_key = SockRevNatKey::<F> {
            cookie: call.socket_cookie(),
            addr: backend.addr,
            port: backend.port,
            _pad: 0,
            _tail: Default::default(),
        };
        let rev_value = SockRevNatValue::<F> {
            addr: vip,
            port: vport,
            _pad: 0,
            rev_nat_id: frontend.rev_nat_id,
        };
        let known = F::sock_revnat().get_ptr(&rev_key).map(|p| unsafe { *p });
        if known != Some(rev_value) && insert_used(F::sock_revnat(), &rev_key, &rev_value, 0).is_err() {
            count(Counter::SockRevNatUpdateFailed);
        }
    }

    call.set_addr(backend.addr, backend.port);
    outcome.count(Counter::SockTranslated);
    outcome.verdict = verdict::TRANSLATED;
    outcome.backend_id = backend_id;
    outcome.addr = backend.addr;
    outcome.port = backend.port;
    outcome
}

/// The slot of the socket with cookie `cookie` in `lb4_sock_conn` (`lb6_sock_conn`).
#[inline(always)]
fn conn_slot<F: FamilyMaps>(cookie: u64) -> Option<*mut SockConnSlot<F>> {
    F::sock_conn().get_ptr_mut(revnat::conn_slot(cookie))
}

/// connect: keeps `record` in the socket's slot if the slot is free or already this socket's;
/// false if another open socket holds it. Under the slot's lock, so two sockets whose cookies
/// name the same slot never both take it.
#[inline(always)]
pub fn claim_connection<F: FamilyMaps>(cookie: u64, record: &SockRevNatSk<F>) -> bool {
    let Some(slot) = conn_slot::<F>(cookie) else {
        return false;
    };
    // SAFETY: a pointer into the array's value, valid until the program returns; the lock
    // serialises the claims of the slot (the verifier allows no call while it is held).
    unsafe {
        let lock = (&raw mut (*slot).lock).cast::<aya_ebpf::bindings::bpf_spin_lock>();
        bpf_spin_lock(lock);
        let owner = (*slot).cookie;
        let claimed = owner == 0 || owner == cookie;
        if claimed {
            (*slot).cookie = cookie;
            (*slot).conn = *record;
        }
        bpf_spin_unlock(lock);
        claimed
    }
}

/// recvmsg, getpeername: the socket's record, if its slot is its own. Read without the lock: only
/// this socket's connect writes its record, before the call that reads it, and a slot another
/// socket claims meanwhile shows that socket's cookie.
#[inline(always)]
pub fn connection<F: FamilyMaps>(cookie: u64) -> Option<SockRevNatSk<F>> {
    let slot = conn_slot::<F>(cookie)?;
    // SAFETY: as in `claim_connection`.
    unsafe { ((*slot).cookie == cookie).then(|| (*slot).conn) }
}

/// A socket closes (`lb_sock_release`): frees its slot if it holds it. No lock: a claimer only
/// takes a free slot, and this socket's own connect cannot run any more.
#[inline(always)]
pub fn forget_connection<F: FamilyMaps>(cookie: u64) {
    if let Some(slot) = conn_slot::<F>(cookie) {
        // SAFETY: as in `claim_connection`.
        unsafe {
            if (*slot).cookie == cookie {
                (*slot).cookie = 0;
            }
        }
    }
}

/// recvmsg and getpeername: show the frontend instead of the backend.
#[inline(always)]
pub fn translate_reverse<F: FamilyMaps, C: SockCall<F>>(call: &mut C) -> Outcome<F> {
    let (addr, port) = (call.addr(), call.port());
    // A connected socket's record first (`lb4_sock_conn`, else its socket storage); then the LRU
    // map (unconnected UDP).
    let in_socket = call
        .sk_revnat::<F>()
        .filter(|e| e.backend_addr == addr && e.backend_port == port);
    let (entry, lru_key) = match in_socket {
        Some(e) => (
            SockRevNatValue::<F> {
                addr: e.frontend_addr,
                port: e.frontend_port,
                _pad: 0,
                rev_nat_id: e.rev_nat_id,
            },
            None,
        ),
        None => {
            let key = SockRevNatKey::<F> {
                cookie: call.socket_cookie(),
                addr,
                port,
                _pad: 0,
                _tail: Default::default(),
            };
            let Some(entry) = F::sock_revnat().get_ptr(&key).map(|p| unsafe { *p }) else {
                return Outcome::pass();
            };
            (entry, Some(key))
        }
    };
    // The frontend may have been deleted, or its id given to another frontend since.
    let current = F::revnat().get_ptr(&entry.rev_nat_id).map(|p| unsafe { *p });
    match current {
        Some(frontend) if frontend.addr == entry.addr && frontend.port == entry.port => {}
        _ => {
            count(Counter::SockRevNatStale);
            if let Some(key) = lru_key {
                let _ = F::sock_revnat().remove(&key);
            }
            return Outcome::pass();
        }
    }
    call.set_addr(entry.addr, entry.port);
    count(Counter::SockRevNatHit);
    Outcome {
        verdict: verdict::TRANSLATED,
        rev_nat_id: entry.rev_nat_id,
        addr: entry.addr,
        port: entry.port,
        ..Outcome::pass()
    }
}
