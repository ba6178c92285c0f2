//! The agent: load and attach the data path, adopt what a previous run left in the maps, then keep
//! the maps equal to the cluster's state (watch -> model -> plan -> maps) until told to stop. On
//! exit the programs stay attached and the maps stay pinned, so traffic keeps flowing while the
//! agent restarts or upgrades.

use std::{net::Ipv4Addr, os::fd::AsRawFd, path::PathBuf, time::Instant};

use anyhow::{Context, Result};
use lb_common::config::{self as dpconfig, Cidr4, DatapathConfig, MAX_CLUSTER_CIDRS};

use crate::{
    cli::RunArgs,
    datapath::{self, cgroup, tc, Datapath, PinPaths},
    maps::{Applier, KernelMaps, MapOps},
    node::{self, NodePortAddress},
    plan::NodeContext,
    sync,
    watch::{manifests, ClusterState},
};

/// The system hostname, lowercased as kube-proxy does.
pub fn hostname() -> String {
    nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_default().trim().to_lowercase()
}

/// `bpf_get_netns_cookie()` of the calling thread's network namespace (SO_NETNS_COOKIE, 5.14+).
pub fn netns_cookie() -> std::io::Result<u64> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").or_else(|_| std::net::UdpSocket::bind("0.0.0.0:0"))?;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    const SO_NETNS_COOKIE: libc::c_int = 71;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
    let rc = unsafe {
        libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, SO_NETNS_COOKIE, (&raw mut cookie).cast(), &mut len)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

/// Settings resolved from flags (and, later, the config file).
#[derive(Clone, Debug)]
pub struct NodeSettings {
    pub node_name: String,
    pub cluster_cidrs: Vec<ipnet::Ipv4Net>,
    pub nodeport_addresses: Vec<NodePortAddress>,
    pub masquerade_all: bool,
    pub localhost_nodeports: bool,
    pub bind_address: Option<Ipv4Addr>,
}

impl NodeSettings {
    pub fn from_args(args: &crate::cli::NodeArgs, localhost_nodeports: bool, bind_address: Option<Ipv4Addr>) -> Result<Self> {
        let mut cluster_cidrs = Vec::new();
        for cidr in &args.cluster_cidr {
            match cidr.trim().parse::<ipnet::IpNet>() {
                Ok(ipnet::IpNet::V4(v4)) => cluster_cidrs.push(v4.trunc()),
                Ok(ipnet::IpNet::V6(_)) => {} // the IPv6 detector belongs to the IPv6 data path
                Err(e) => anyhow::bail!("--cluster-cidr {cidr:?}: {e}"),
            }
        }
        if cluster_cidrs.len() > MAX_CLUSTER_CIDRS {
            anyhow::bail!("--cluster-cidr: at most {MAX_CLUSTER_CIDRS} IPv4 CIDRs are supported");
        }
        let nodeport_addresses = args
            .nodeport_addresses
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.parse::<NodePortAddress>().map_err(anyhow::Error::msg))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            node_name: args.hostname_override.clone().filter(|n| !n.is_empty()).unwrap_or_else(hostname).to_lowercase(),
            cluster_cidrs,
            nodeport_addresses,
            masquerade_all: args.masquerade_all,
            localhost_nodeports,
            bind_address,
        })
    }

    /// The plan's node context, from this node's addresses and Node object.
    pub fn node_context(&self, local_addresses: &[Ipv4Addr], node_primary: &[Ipv4Addr]) -> NodeContext {
        let mut primary = node_primary.to_vec();
        if primary.is_empty() {
            primary.extend(self.bind_address);
        }
        let selection = node::select_nodeport_addresses(&self.nodeport_addresses, local_addresses, &primary);
        NodeContext {
            nodeport_addresses: selection.addresses,
            localhost_nodeports: selection.loopback && self.localhost_nodeports,
            node_ips: primary,
            masquerade_all: self.masquerade_all,
            cluster_cidr_configured: !self.cluster_cidrs.is_empty(),
        }
    }

    /// The `lb_config` entry. `snat` is the node IP masqueraded flows get as their source.
    pub fn datapath_config(&self, host_netns_cookie: u64, sock_hostns_only: bool, snat: Ipv4Addr) -> DatapathConfig {
        let mut cfg = DatapathConfig {
            host_netns_cookie,
            snat_addr: snat.octets(),
            snat_port_min: dpconfig::SNAT_PORT_MIN,
            snat_port_max: dpconfig::SNAT_PORT_MAX,
            ..DatapathConfig::default()
        };
        if sock_hostns_only {
            cfg.flags |= dpconfig::flags::SOCK_HOSTNS_ONLY;
        }
        for (slot, cidr) in cfg.cluster_cidrs.iter_mut().zip(&self.cluster_cidrs) {
            *slot = Cidr4::new(cidr.network().octets(), cidr.prefix_len());
        }
        cfg.cluster_cidr_count = self.cluster_cidrs.len().min(MAX_CLUSTER_CIDRS) as u32;
        cfg
    }
}

/// Where the agent gets the cluster's state.
enum Source {
    Manifests(PathBuf),
}

impl Source {
    fn load(&self, node_name: &str) -> Result<ClusterState> {
        match self {
            Source::Manifests(dir) => Ok(manifests::load_dir(dir, node_name)?),
        }
    }
}

/// What the agent keeps between syncs.
struct Agent {
    datapath: Datapath,
    applier: Applier<KernelMaps>,
    settings: NodeSettings,
    host_cookie: u64,
    sock_hostns_only: bool,
    devices: Option<Vec<tc::DevicePattern>>,
    config_written: Option<DatapathConfig>,
}

/// One sync: compute the desired state and write the difference.
fn sync_once(agent: &mut Agent, state: &ClusterState) -> Result<()> {
    let started = Instant::now();
    let settings = &agent.settings;
    let node = state.node.as_deref();
    let info = sync::node_info(&settings.node_name, node);
    let locals = node::local_addresses().context("listing this node's addresses")?;
    let ctx = settings.node_context(&locals, &sync::node_primary_ips(node));
    // Masqueraded flows leave with the node's primary IP (else its first NodePort address).
    let snat = ctx.node_ips.first().or(ctx.nodeport_addresses.first()).copied().unwrap_or(Ipv4Addr::UNSPECIFIED);
    let config = settings.datapath_config(agent.host_cookie, agent.sock_hostns_only, snat);
    if agent.config_written != Some(config) {
        agent.applier.maps_mut().put_config(&config).context("writing the datapath configuration")?;
        agent.config_written = Some(config);
    }
    if let Some(patterns) = &agent.devices {
        let up = tc::interfaces_up().context("listing interfaces")?;
        let wanted = tc::select_devices(patterns, &up);
        for (name, index) in &wanted {
            if let Err(e) = agent.datapath.attach_tc(name, *index) {
                tracing::error!(device = %name, "attaching the tc programs: {e}");
            }
        }
        for gone in agent.datapath.detach_tc_except(&wanted) {
            tracing::info!(device = %gone, "detached the tc programs");
        }
    }
    let computed = sync::compute(state, &info, &ctx);
    let applier = &mut agent.applier;
    for p in &computed.problems {
        tracing::warn!(kind = p.kind, namespace = %p.namespace, name = %p.name, "{}", p.message);
    }
    let report = applier.apply(&computed.desired);
    for (service, reason) in &report.skipped {
        tracing::error!(service = %service, "not programmed: {reason}");
    }
    for e in &report.errors {
        tracing::error!("map update failed: {e}");
    }
    tracing::info!(
        service_ports = computed.service_ports,
        frontends = computed.desired.frontends.len(),
        backends = computed.desired.backends.len(),
        writes = report.writes,
        deletes = report.deletes,
        elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
        "data path programmed"
    );
    Ok(())
}

pub async fn run(args: RunArgs) -> Result<()> {
    let settings = NodeSettings::from_args(&args.node, args.iptables_localhost_nodeports, args.bind_address)?;
    let source = match &args.manifests {
        Some(dir) => Source::Manifests(dir.clone()),
        None => anyhow::bail!("watching the API server is not available in this build; pass --manifests DIR"),
    };
    let object = datapath::object_bytes(args.bpf.bpf_object.as_deref())?;
    let caps = args.bpf.capacities();
    let paths = PinPaths::new(&args.bpf.root.bpf_root);
    let mut dp = Datapath::load(&paths, &caps, &object).context("loading the data path")?;
    let cgroup_root = match &args.bpf.cgroup_root {
        Some(path) => path.clone(),
        None => cgroup::cgroup2_mount().context("finding the cgroup v2 mount")?,
    };
    let maps = dp.take_maps()?;
    let applier = Applier::recover(maps, caps).context("reading the pinned maps")?;
    let host_cookie = netns_cookie().context("reading this network namespace's cookie (needs kernel >= 5.14)")?;
    dp.attach_cgroup(&cgroup_root).context("attaching the socket programs")?;
    let devices = (!args.bpf.no_tc).then(|| args.bpf.devices.iter().map(|d| tc::DevicePattern::parse(d)).collect());
    let mut agent = Agent {
        datapath: dp,
        applier,
        settings: settings.clone(),
        host_cookie,
        sock_hostns_only: args.bpf.bpf_lb_sock_hostns_only,
        devices,
        config_written: None,
    };
    tracing::info!(node = %settings.node_name, bpf_root = %paths.root.display(), cgroup = %cgroup_root.display(), "data path attached");

    let mut interval = tokio::time::interval(args.sync_period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = interval.tick() => {
                match source.load(&settings.node_name) {
                    Ok(state) => sync_once(&mut agent, &state)?,
                    Err(e) => tracing::error!("reading the cluster state: {e:#}; keeping the last programmed state"),
                }
            }
            _ = tokio::signal::ctrl_c() => break,
            _ = terminate.recv() => break,
        }
    }
    tracing::info!("stopping; the data path stays attached and keeps serving");
    Ok(())
}
