//! `lb-agent trace`: what the data path does with one packet, answered by the real programs.
//!
//! Traffic that starts on this node (`--src` is a node IP or loopback) is handled by the socket
//! programs, which BPF_PROG_TEST_RUN cannot run; `lb_sock_trace` runs the very same socket code
//! on a described call instead. Everything else is a packet arriving at tc: a synthetic SYN (or
//! UDP datagram) goes through `lb_tc_ingress`, and the packet that comes out and the decision the
//! program records in `__sk_buff.cb` give the answer.
//!
//! Both families: an IPv6 destination goes through the IPv6 programs (`connect6`, `sendmsg6`, an
//! IPv6 packet at tc); an IPv4-mapped one (`::ffff:10.96.0.10`, a dual-stack socket calling an
//! IPv4 Service) through the IPv6 socket hooks onto the IPv4 maps, as the kernel would (connect6;
//! the kernel hands such a datagram to sendmsg4, which decides alike), and from off the node as
//! the IPv4 packet such a socket sends. An IPv4-mapped `--src` is the IPv4 address it maps; the
//! two addresses must be of one family.
//!
//! The maps are either a scratch set built from manifests (`--manifests`: the live maps are never
//! touched) or the live pinned ones (read for service state; the flow-state maps the programs
//! write are private to the trace, so tracing never leaves state behind).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    path::Path,
};

use anyhow::{Context, Result, bail};
use lb_common::trace::{SockTraceIn, SockTraceOut, TRACE_PACKET_LEN, hook, tc as trace_cb, verdict};
use serde::Serialize;

mod scratch;

pub use scratch::{SCRATCH_CAPACITIES, ScratchDatapath};

use crate::{
    apply::{KernelMaps, ServiceMapKey},
    cli::{OutputFormat, TraceArgs, TraceProtocol},
    datapath::{self, Datapath, PinPaths},
    family::IpFamily,
    model::Protocol,
    watch::manifests,
};

/// The answer, as `-o json` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TraceResult {
    /// "dnat", "reject", "drop" or "pass".
    pub verdict: &'static str,
    /// Every endpoint the data path may choose for this packet, sorted ("IP:PORT").
    pub backends: Vec<String>,
    /// Whether the source is rewritten to a node IP.
    pub masquerade: bool,
    /// The source address a masqueraded packet leaves with (the address of the interface it leaves
    /// by, as the programs recorded it), when `masquerade`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_source: Option<IpAddr>,
    /// "tc" or "socket".
    pub path: &'static str,
    /// "maglev" when the frontend picks by Maglev consistent hashing (`chosen` is then this
    /// flow's backend on every node with the same endpoints), else absent (a random pick).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<&'static str>,
}

/// Details for the table output.
#[derive(Clone, Debug, Default)]
pub struct TraceDetails {
    pub service: Option<String>,
    pub scope: Option<u8>,
    pub chosen: Option<String>,
    pub note: Option<String>,
}

/// A packet or socket call to trace.
#[derive(Clone, Copy, Debug)]
pub struct TraceRequest {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// The source port of the packet traced through tc (Maglev picks by it).
    pub sport: u16,
    pub dport: u16,
    pub protocol: Protocol,
    /// The ifindex of the interface the packet comes in by (tc path; 0: none given), which the
    /// interface local-traffic detectors decide by.
    pub ingress_ifindex: u32,
}

impl TraceRequest {
    /// The frontend address the maps key the destination by: an IPv4-mapped IPv6 destination is
    /// its IPv4 address (the IPv6 socket hooks look such calls up in the IPv4 maps).
    fn frontend_addr(&self) -> IpAddr {
        self.dst.to_canonical()
    }
}

/// An address as a hook of `family` reads it from `SockTraceIn`: the first 4 bytes for IPv4, an
/// IPv4 address IPv4-mapped for IPv6.
fn hook_bytes(family: IpFamily, ip: IpAddr) -> [u8; 16] {
    let mut out = [0; 16];
    match (family, ip) {
        (IpFamily::V4, IpAddr::V4(v4)) => out[..4].copy_from_slice(&v4.octets()),
        (IpFamily::V6, IpAddr::V4(v4)) => out = v4.to_ipv6_mapped().octets(),
        (_, IpAddr::V6(v6)) => out = v6.octets(),
    }
    out
}

fn verdict_name(v: u32) -> &'static str {
    match v {
        verdict::TRANSLATED => "dnat",
        verdict::REJECT => "reject",
        verdict::DROP => "drop",
        _ => "pass",
    }
}

/// Every backend in the slots of a frontend's scope (the slots' copies, which the programs use).
fn scope_backends(maps: &KernelMaps, req: &TraceRequest, scope: u8) -> Vec<String> {
    let key = ServiceMapKey::new(req.frontend_addr(), req.dport, req.protocol.number(), scope, 0);
    let Some(frontend) = maps.service(&key) else {
        return Vec::new();
    };
    let mut out = BTreeSet::new();
    for slot in 1..=frontend.entry.count {
        if let Some(b) = maps.service(&key.with_slot(slot)).and_then(|e| e.backend) {
            out.insert(SocketAddr::new(b.addr, b.port));
        }
    }
    out.into_iter().map(|a| a.to_string()).collect()
}

fn backend_name(maps: &KernelMaps, family: IpFamily, id: u32) -> Option<String> {
    maps.backend(family, id)
        .map(|b| SocketAddr::new(b.addr, b.port).to_string())
}

fn service_name(maps: &KernelMaps, family: IpFamily, rev_nat_id: u32) -> Option<String> {
    let name = maps.name(rev_nat_id)?;
    let revnat = maps.revnat(family, rev_nat_id)?;
    Some(crate::apply::entries::service_port_name(&name, revnat.proto).to_string())
}

/// Whether the request starts on the node (socket path); an IPv4-mapped source is the IPv4
/// address it maps (a dual-stack socket bound to it shows it so).
pub fn starts_on_node(req: &TraceRequest, node_ips: &[IpAddr]) -> bool {
    let src = req.src.to_canonical();
    src.is_loopback() || node_ips.iter().any(|ip| ip.to_canonical() == src)
}

/// Runs one trace against a loaded data path and its maps.
pub fn trace(
    dp: &mut Datapath,
    maps: &KernelMaps,
    host_cookie: u64,
    node_ips: &[IpAddr],
    req: &TraceRequest,
) -> Result<(TraceResult, TraceDetails)> {
    // An IPv4-mapped address is the IPv4 address it maps: what a dual-stack socket sends to or
    // from it is an IPv4 packet.
    if IpFamily::of(&req.src.to_canonical()) != IpFamily::of(&req.frontend_addr()) {
        bail!(
            "--src {} and --dst {} are of different IP families (a packet has one; a dual-stack \
             socket calling an IPv4 address ::ffff:a.b.c.d has an IPv4 source)",
            req.src,
            req.dst
        );
    }
    let on_node = starts_on_node(req, node_ips);
    if on_node && req.protocol != Protocol::Sctp {
        return trace_socket(dp, maps, host_cookie, req);
    }
    // The agent loads the SCTP programs once it serves SCTP; a trace needs them whatever the
    // Services. A refusal is this kernel's answer, not the Service's: the packet passes
    // untranslated, and the note says why.
    let sctp_refused = match req.protocol {
        Protocol::Sctp => dp.serve_sctp()?.map(str::to_owned),
        _ => None,
    };
    // The node's own SCTP: no socket hook runs for it, tc egress translates it
    // (`lb_tc_sctp_out`, reached from `lb_tc_egress`, which passes it where the kernel refused
    // the SCTP programs).
    let program = match (on_node, sctp_refused.is_some()) {
        (true, false) => datapath::tc::SCTP_EGRESS_PROGRAM,
        (true, true) => datapath::tc::TC_PROGRAMS[1].0,
        (false, _) => datapath::tc::TC_PROGRAMS[0].0,
    };
    let (result, mut details) = trace_tc(dp, maps, req, program)?;
    if let Some(refusal) = sctp_refused {
        details.note = Some(format!("{} ({refusal})", crate::plan::SCTP_REFUSED));
    } else if on_node && result.verdict == "dnat" && details.note.is_none() {
        details.note = Some(crate::plan::SCTP_FROM_NODE.into());
    } else if on_node && result.verdict == "reject" {
        // No ICMP answer for the node's own packet at egress: SCTP would take it as a soft
        // error only, so the drop looks the same to the association (docs/architecture.md).
        details.note = Some(
            "the Service has no endpoints (or no such port): the node's own SCTP is dropped at tc \
             egress rather than answered with ICMP port unreachable, which SCTP takes only as a \
             soft error; the association retransmits its INIT until it gives up"
                .into(),
        );
    }
    Ok((result, details))
}

fn trace_socket(
    dp: &mut Datapath,
    maps: &KernelMaps,
    host_cookie: u64,
    req: &TraceRequest,
) -> Result<(TraceResult, TraceDetails)> {
    // The hook is the socket's family: an IPv6 destination (IPv4-mapped included) is an AF_INET6
    // socket's call.
    let hook_family = IpFamily::of(&req.dst);
    let input = SockTraceIn {
        hook: match (hook_family, req.protocol == Protocol::Udp) {
            (IpFamily::V4, true) => hook::SENDMSG4,
            (IpFamily::V4, false) => hook::CONNECT4,
            (IpFamily::V6, true) => hook::SENDMSG6,
            (IpFamily::V6, false) => hook::CONNECT6,
        },
        protocol: u32::from(req.protocol.number()),
        addr: hook_bytes(hook_family, req.dst),
        port: req.dport,
        _pad: 0,
        // A loopback source means an unbound socket: the kernel picks the node's address.
        src_addr: if req.src.to_canonical().is_loopback() {
            [0; 16]
        } else {
            hook_bytes(hook_family, req.src)
        },
        random: 0,
        socket_cookie: 1,
        netns_cookie: host_cookie,
    };
    let mut packet = [0u8; TRACE_PACKET_LEN];
    // SAFETY: SockTraceIn is plain old data and fits the buffer (checked at compile time).
    unsafe {
        std::ptr::copy_nonoverlapping(
            (&raw const input).cast::<u8>(),
            packet.as_mut_ptr(),
            size_of::<SockTraceIn>(),
        )
    };
    let run = dp.test_run_tc(datapath::SOCK_TRACE_PROGRAM, &packet, 1)?;
    if run.packet.len() < size_of::<SockTraceOut>() {
        bail!("the socket trace harness returned {} bytes", run.packet.len());
    }
    // SAFETY: the harness wrote a SockTraceOut at the start of the packet.
    let out: SockTraceOut = unsafe { std::ptr::read_unaligned(run.packet.as_ptr().cast()) };
    let verdict = verdict_name(out.verdict);
    let backends = if out.verdict == verdict::TRANSLATED {
        scope_backends(maps, req, out.scope)
    } else {
        Vec::new()
    };
    let family = IpFamily::of(&req.frontend_addr());
    let details = TraceDetails {
        service: (out.rev_nat_id != 0)
            .then(|| service_name(maps, family, out.rev_nat_id))
            .flatten(),
        scope: (out.rev_nat_id != 0).then_some(out.scope),
        chosen: (out.verdict == verdict::TRANSLATED)
            .then(|| SocketAddr::new(hook_family.addr_from_bytes(out.addr), out.port).to_string()),
        note: match out.verdict {
            verdict::REJECT => Some(refusal(
                out.rev_nat_id,
                out.verdict,
                "connect() fails with ECONNREFUSED",
            )),
            verdict::DROP => Some(refusal(
                out.rev_nat_id,
                out.verdict,
                "connect() fails with EHOSTUNREACH",
            )),
            _ => None,
        },
    };
    Ok((
        TraceResult {
            verdict,
            backends,
            masquerade: false,
            masquerade_source: None,
            path: "socket",
            algorithm: None,
        },
        details,
    ))
}

/// Why a call or packet was refused: a frontend's reason (no endpoints, a Local policy, source
/// ranges) when one matched (`rev_nat_id` set), else kube-proxy's cluster-ips-check.
fn refusal(rev_nat_id: u32, decision: u32, outcome: &str) -> String {
    match (rev_nat_id, decision) {
        (0, verdict::REJECT) => {
            format!("a cluster IP on a port no Service has (kube-proxy's cluster-ips-check): {outcome}")
        }
        (0, _) => format!(
            "an address of a Service CIDR that no Service holds (kube-proxy's cluster-ips-check): {outcome}"
        ),
        _ => outcome.to_string(),
    }
}

/// A synthetic first packet of a flow: a TCP SYN, or a UDP datagram, of the request's family.
pub fn first_packet(req: &TraceRequest, sport: u16) -> Vec<u8> {
    let ethernet = etherparse::PacketBuilder::ethernet2([0x02, 0, 0, 0, 0, 1], [0x02, 0, 0, 0, 0, 2]);
    let builder = match (req.src, req.dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => ethernet.ipv4(src.octets(), dst.octets(), 64),
        (src, dst) => ethernet.ipv6(v6(src).octets(), v6(dst).octets(), 64),
    };
    let mut out = Vec::new();
    match req.protocol {
        Protocol::Tcp => {
            let b = builder.tcp(sport, req.dport, 1000, 64_240).syn();
            b.write(&mut out, &[]).expect("write to a Vec");
        }
        Protocol::Udp => {
            let b = builder.udp(sport, req.dport);
            b.write(&mut out, b"trace").expect("write to a Vec");
        }
        Protocol::Sctp => {
            // An INIT: the common header (verification tag 0, checksum 0: "the device computes
            // it", which the programs leave alone) and the chunk (RFC 9260 3.3.2).
            let mut sctp = Vec::with_capacity(32);
            sctp.extend_from_slice(&sport.to_be_bytes());
            sctp.extend_from_slice(&req.dport.to_be_bytes());
            sctp.extend_from_slice(&[0; 8]);
            sctp.extend_from_slice(&[1, 0, 0, 20]);
            for word in [1u32, 106_496, (10 << 16) | 10, 1] {
                sctp.extend_from_slice(&word.to_be_bytes());
            }
            let sctp_number = etherparse::IpNumber(lb_common::proto::SCTP);
            builder
                .write(&mut out, sctp_number, &sctp)
                .expect("write to a Vec");
        }
    }
    out
}

/// An address as IPv6 (an IPv4 one mapped).
fn v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// The masquerade address the tc programs recorded for the traced flow: the `nat_addr` of its
/// SNAT entry (client -> backend, at egress) in this load's new-flow table, private to the trace.
fn recorded_masquerade<F: crate::family::KernelFamily + lb_common::catalog::FamilyMaps>(
    dp: &Datapath,
    req: &TraceRequest,
    sport: u16,
) -> Option<IpAddr>
where
    lb_common::conntrack::CtKey<F>: aya::Pod,
    lb_common::conntrack::CtValue<F>: aya::Pod,
{
    use lb_common::conntrack::{CtKey, CtValue, dir, flags};
    let map = dp.map(F::MAPS.conntrack_new)?;
    let table = aya::maps::HashMap::<_, CtKey<F>, CtValue<F>>::try_from(map).ok()?;
    let client = F::kernel_addr(&req.src)?;
    table.iter().filter_map(Result::ok).find_map(|(key, value)| {
        (key.dir == dir::EGRESS
            && value.flags & flags::SNAT != 0
            && value.flags & flags::REPLY == 0
            && key.saddr == client
            && key.sport == sport)
            .then(|| F::ip_addr(&value.nat_addr))
    })
}

/// A packet through `program`: the tc ingress program, or for the node's own SCTP the egress one.
fn trace_tc(
    dp: &mut Datapath,
    maps: &KernelMaps,
    req: &TraceRequest,
    program: &str,
) -> Result<(TraceResult, TraceDetails)> {
    // IPv4-mapped addresses never reach the wire: a dual-stack socket calling one sends IPv4.
    let req = &TraceRequest {
        src: req.src.to_canonical(),
        dst: req.dst.to_canonical(),
        ..*req
    };
    let packet = first_packet(req, req.sport);
    // An ingress interface of 0 is none, as without --in-interface.
    let run = dp
        .test_run_tc_from(program, &packet, req.ingress_ifindex)
        .with_context(|| match req.ingress_ifindex {
            0 => "running the packet through the tc ingress program".to_string(),
            _ => "running the packet from --in-interface (a kernel before 5.15 cannot set it)".into(),
        })?;
    let decision = run.cb[trace_cb::CB_VERDICT];
    let scope = (run.cb[trace_cb::CB_SCOPE_FLAGS] & 0xff) as u8;
    let masquerade =
        decision == verdict::TRANSLATED && run.cb[trace_cb::CB_SCOPE_FLAGS] & trace_cb::MASQUERADED != 0;
    let rev_nat_id = run.cb[trace_cb::CB_REV_NAT_ID];
    let backends = if decision == verdict::TRANSLATED {
        scope_backends(maps, req, scope)
    } else {
        Vec::new()
    };
    let frontend_flags = run.cb[trace_cb::CB_FRONTEND_FLAGS] as u16;
    let maglev = decision == verdict::TRANSLATED && frontend_flags & lb_common::service::flags::MAGLEV != 0;
    let family = IpFamily::of(&req.dst);
    let details = TraceDetails {
        service: (rev_nat_id != 0)
            .then(|| service_name(maps, family, rev_nat_id))
            .flatten(),
        scope: (rev_nat_id != 0).then_some(scope),
        chosen: (decision == verdict::TRANSLATED)
            .then(|| backend_name(maps, family, run.cb[trace_cb::CB_BACKEND_ID]))
            .flatten(),
        note: match decision {
            verdict::REJECT => Some(refusal(
                rev_nat_id,
                decision,
                "answered with ICMP port unreachable",
            )),
            verdict::DROP => Some(refusal(rev_nat_id, decision, "dropped")),
            _ if maglev && frontend_flags & lb_common::service::flags::AFFINITY != 0 => Some(format!(
                "Maglev: a client without a ClientIP affinity entry gets its flow's table entry (this one: source port {}); one with an entry keeps its backend",
                req.sport
            )),
            _ if maglev => Some(format!(
                "Maglev: this flow (source port {}) reaches the chosen backend on every node with the same endpoints; other source ports spread over the backends",
                req.sport
            )),
            _ => None,
        },
    };
    // The address the programs masquerade with: the one they recorded for this flow (the
    // interface it leaves by has its own, `lb_masq_addrs`), else `lb_config`'s.
    let masquerade_source = masquerade
        .then(|| {
            let recorded = match family {
                IpFamily::V4 => recorded_masquerade::<lb_common::family::V4>(dp, req, req.sport),
                IpFamily::V6 => recorded_masquerade::<lb_common::family::V6>(dp, req, req.sport),
            };
            recorded.or_else(|| {
                maps.datapath_config().map(|c| match family {
                    IpFamily::V4 => IpAddr::from(c.v4.snat_addr),
                    IpFamily::V6 => IpAddr::from(Ipv6Addr::from(c.v6.snat_addr)),
                })
            })
        })
        .flatten();
    Ok((
        TraceResult {
            verdict: verdict_name(decision),
            backends,
            masquerade,
            masquerade_source,
            path: "tc",
            algorithm: maglev.then_some("maglev"),
        },
        details,
    ))
}

fn print(result: &TraceResult, details: &TraceDetails, output: OutputFormat) -> Result<()> {
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string(result)?),
        OutputFormat::Table => {
            println!("PATH      {}", result.path);
            println!("VERDICT   {}", result.verdict);
            println!("SERVICE   {}", details.service.as_deref().unwrap_or("-"));
            println!(
                "SCOPE     {}",
                match details.scope {
                    Some(lb_common::service::SCOPE_INTERNAL) => "internal (cluster-wide endpoints)",
                    Some(_) => "external",
                    None => "-",
                }
            );
            println!(
                "BACKENDS  {}",
                if result.backends.is_empty() {
                    "-".to_string()
                } else {
                    result.backends.join(", ")
                }
            );
            println!("CHOSEN    {}", details.chosen.as_deref().unwrap_or("-"));
            match result.masquerade_source {
                Some(source) => println!("MASQUERADE yes (source becomes {source})"),
                None if result.masquerade => println!("MASQUERADE yes (source becomes a node IP)"),
                None => println!("MASQUERADE no"),
            }
            if let Some(note) = &details.note {
                println!("NOTE      {note}");
            }
        }
    }
    Ok(())
}

/// The `lb-agent trace` command.
pub fn run(args: &TraceArgs) -> Result<()> {
    let protocol = match args.protocol {
        TraceProtocol::Tcp => Protocol::Tcp,
        TraceProtocol::Udp => Protocol::Udp,
        TraceProtocol::Sctp => Protocol::Sctp,
    };
    let req = TraceRequest {
        src: args.src,
        dst: args.dst,
        sport: args.sport,
        dport: args.dport,
        protocol,
        ingress_ifindex: match &args.in_interface {
            Some(name) => nix::net::if_::if_nametoindex(name.as_str())
                .with_context(|| format!("--in-interface {name}: no such interface here"))?,
            None => 0,
        },
    };
    let object = datapath::object_bytes(None)?;
    // The node the trace stands for has the `--node-ip` addresses on its interfaces and the
    // agent's flags; the rest is derived as the agent derives it.
    let settings = args.node.settings()?;
    let (result, details) = match &args.manifests {
        Some(dir) => {
            let mut loaded = manifests::load_dir(dir, &settings.node_name)?;
            // ServiceCIDR objects among the manifests win over the flag, as the API server's do.
            if loaded.state.service_cidrs.is_none() {
                loaded.state.service_cidrs = Some(args.node.service_cidrs()?);
            }
            for problem in &loaded.problems {
                eprintln!("warning: {problem}");
            }
            // The interface detectors decide by this node's links, as the agent's would.
            let links = match settings.interface_detector() {
                Some(_) => crate::node::interfaces::links().context("listing this node's links")?,
                None => Vec::new(),
            };
            ScratchDatapath::with_links(&loaded.state, settings, &args.node_ips, links, &object)?
                .trace(&req)?
        }
        None => trace_live(&args.root.bpf_root, &args.node_ips, &req, &object)?,
    };
    print(&result, &details, args.output)
}

/// Trace against the live pinned maps: the service state is read from the pins; the flow-state
/// maps the programs write are private.
fn trace_live(
    bpf_root: &Path,
    node_ips: &[IpAddr],
    req: &TraceRequest,
    object: &[u8],
) -> Result<(TraceResult, TraceDetails)> {
    let paths = PinPaths::new(bpf_root);
    let maps = crate::inspect::open_pinned_maps(
        &paths,
        "is the agent running? pass --bpf-root, or use --manifests",
    )?;
    let host_cookie = maps.datapath_config().map(|c| c.host_netns_cookie).unwrap_or(0);
    let mut dp = Datapath::load_for_trace(&paths, object).context("loading the programs for tracing")?;
    let mut node_ips = node_ips.to_vec();
    if node_ips.is_empty() {
        node_ips = crate::node::local_network()
            .map(|local| local.addresses)
            .unwrap_or_default()
            .into_iter()
            .filter(|ip| !ip.is_loopback())
            .collect();
    }
    trace(&mut dp, &maps, host_cookie, &node_ips, req)
}
