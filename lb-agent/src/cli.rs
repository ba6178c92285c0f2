//! Command line. Without a subcommand, `lb-agent` runs the agent with kube-proxy's flag names where
//! kube-proxy has the concept, and Cilium's names for BPF-specific settings. Subcommands are the
//! operator's tools.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use clap::{Args, Parser, Subcommand, ValueEnum};
use lb_common::{catalog::Capacities, config::MAX_CLUSTER_CIDRS};

use crate::{
    family::IpFamily,
    model::LbAlgorithm,
    node::{DetectLocalMode, NodePortAddress, NodeSettings},
    plan::maglev::{HashSeed, TableSize},
};

#[derive(Parser, Debug)]
#[command(
    name = "lb-agent",
    version,
    about = "eBPF Service load balancer for Kubernetes (a kube-proxy replacement)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// List the Services programmed in the pinned maps, with their frontends and backends.
    Services(InspectArgs),
    /// List the backends in the pinned maps.
    Backends(InspectArgs),
    /// List the tc path's tracked flows (client, frontend, backend, masquerade address).
    Conntrack(InspectArgs),
    /// List ClientIP session-affinity entries.
    Affinity(InspectArgs),
    /// Show the data path's event counters, and the bits the tc prefilter has set per family.
    Stats(InspectArgs),
    /// List this node's interfaces as the tc path sees them: its TCX links, whether it is a pod
    /// interface (the interface local-traffic detectors), and the addresses masqueraded flows
    /// leaving by it get.
    Interfaces(InspectArgs),
    /// Explain what the data path does with one packet (BPF_PROG_TEST_RUN on the real programs).
    Trace(Box<TraceArgs>),
    /// Stream what the data path does, live: socket translations, the tc path's new flows with
    /// their NAT and masquerade, rejects and drops with their reason, packets left untranslated.
    Monitor(MonitorArgs),
    /// Detach every program and remove every pin the agent created (idempotent).
    Cleanup(BpfRootArgs),
    /// Check this node's kernel: the features the data path needs, which it has, and what the
    /// agent does without each (exit status 1 when the agent cannot run here).
    Kernel(KernelArgs),
}

#[derive(Args, Debug, Clone)]
pub struct KernelArgs {
    #[command(flatten)]
    pub output: OutputArgs,
    /// Check this eBPF object instead of the embedded one (development).
    #[arg(long)]
    pub bpf_object: Option<PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct OutputArgs {
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: OutputFormat,
}

#[derive(Args, Debug, Clone)]
pub struct BpfRootArgs {
    /// bpffs directory holding the agent's pinned maps and links. When it is not on a bpffs, the
    /// agent mounts one at /sys/fs/bpf (for a root below it), or else at this directory itself if
    /// it is empty or missing; never over anything else.
    #[arg(long, default_value = "/sys/fs/bpf/lb", env = "LB_BPF_ROOT")]
    pub bpf_root: PathBuf,
}

#[derive(Args, Debug, Clone)]
pub struct InspectArgs {
    #[command(flatten)]
    pub root: BpfRootArgs,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: OutputFormat,
}

/// `lb-agent monitor`.
#[derive(Args, Debug, Clone)]
pub struct MonitorArgs {
    #[command(flatten)]
    pub root: BpfRootArgs,
    /// Output format: a line per event, or a JSON object per line.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: OutputFormat,
    /// Only these event types (comma-separated or repeated; default: all). The programs write
    /// no other.
    #[arg(long = "type", value_enum, value_delimiter = ',')]
    pub types: Vec<MonitorType>,
    /// Only events of this Service: `namespace/name`, or `namespace/name:port` for one port.
    #[arg(long)]
    pub service: Option<String>,
    /// Only events whose client, destination, backend or masquerade address is this one.
    #[arg(long)]
    pub ip: Option<std::net::IpAddr>,
    /// Only events with this port on either side (client, destination, backend, masquerade).
    #[arg(long)]
    pub port: Option<u16>,
    /// Stop after printing this many events.
    #[arg(long)]
    pub max_events: Option<u64>,
}

/// `lb-agent monitor --type`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MonitorType {
    /// A socket call sent to a backend.
    Translate,
    /// A new flow at tc translated to a backend (and masqueraded, where kube-proxy would).
    Nat,
    /// Refused as kube-proxy's REJECT (ECONNREFUSED, or ICMP port unreachable).
    Reject,
    /// Dropped: a policy's drop, a full table, no free masquerade port.
    Drop,
    /// Let through untranslated though it concerned a frontend.
    Untranslated,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Table,
    Json,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceProtocol {
    Tcp,
    Udp,
    Sctp,
}

/// `lb-agent trace`.
#[derive(Args, Debug, Clone)]
pub struct TraceArgs {
    /// Build a scratch map set from this folder of Service/EndpointSlice YAML instead of reading
    /// the live pinned maps (which are then never touched).
    #[arg(long)]
    pub manifests: Option<PathBuf>,
    /// The addresses on the node's interfaces, of either family, comma-separated or repeated
    /// (where NodePorts are served, and what "traffic from the node" comes from); with
    /// `--manifests`, what the agent would find on the node.
    #[arg(long = "node-ip", value_delimiter = ',')]
    pub node_ips: Vec<IpAddr>,
    /// The interface the packet comes in by (tc path): with --detect-local-mode BridgeInterface
    /// or InterfaceNamePrefix, what makes it a pod's.
    #[arg(long)]
    pub in_interface: Option<String>,
    #[command(flatten)]
    pub node: NodeArgs,
    #[command(flatten)]
    pub root: BpfRootArgs,
    /// The packet's (or socket's) source address, of either family.
    #[arg(long)]
    pub src: IpAddr,
    /// Its destination: a frontend of the same family (or an IPv4-mapped IPv6 address, as a
    /// dual-stack socket names an IPv4 frontend).
    #[arg(long)]
    pub dst: IpAddr,
    /// The packet's source port (tc path): with Maglev, what picks the backend.
    #[arg(long, default_value_t = 40_000)]
    pub sport: u16,
    #[arg(long)]
    pub dport: u16,
    #[arg(long, value_enum, default_value = "tcp")]
    pub protocol: TraceProtocol,
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: OutputFormat,
}

/// Node settings shared by the agent and `trace`.
#[derive(Args, Debug, Clone, Default)]
pub struct NodeArgs {
    /// The name of this node, as in EndpointSlice `nodeName` (default: the hostname).
    #[arg(long, env = "NODE_NAME")]
    pub hostname_override: Option<String>,
    /// The pod CIDR(s) of the cluster (kube-proxy's local-traffic detector): off-cluster traffic to
    /// a ClusterIP is masqueraded, pod traffic to an external frontend uses all endpoints.
    #[arg(long, value_delimiter = ',')]
    pub cluster_cidr: Vec<String>,
    /// What tells pod traffic apart (kube-proxy's --detect-local-mode): ClusterCIDR (the
    /// --cluster-cidr ranges), NodeCIDR (this node's spec.podCIDRs, so another node's pods
    /// count as off the node), BridgeInterface (packets that came in by --pod-bridge-interface
    /// or one of its ports) or InterfaceNamePrefix (by an interface named
    /// --pod-interface-name-prefix*).
    #[arg(long, value_parser = clap::builder::ValueParser::new(str::parse::<DetectLocalMode>), default_value = "ClusterCIDR")]
    pub detect_local_mode: DetectLocalMode,
    /// The pods' bridge, with --detect-local-mode=BridgeInterface.
    #[arg(long, default_value = "")]
    pub pod_bridge_interface: String,
    /// The prefix of the pods' interface names, with --detect-local-mode=InterfaceNamePrefix.
    #[arg(long, default_value = "")]
    pub pod_interface_name_prefix: String,
    /// Addresses NodePorts are served on: CIDRs and/or `primary`, `localhost`, `all`
    /// (default: every local address, as kube-proxy's iptables mode).
    #[arg(long, value_delimiter = ',')]
    pub nodeport_addresses: Vec<String>,
    /// SNAT all traffic sent via Service cluster IPs (tc path).
    #[arg(long)]
    pub masquerade_all: bool,
    /// Overrides this node's primary IP of its family (kube-proxy's --bind-address; the Node
    /// object's addresses are used otherwise). `0.0.0.0` and `::` mean unset.
    #[arg(long)]
    pub bind_address: Option<IpAddr>,
    /// The Service CIDRs (comma-separated, as the API server's flag of that name), for
    /// kube-proxy's cluster-ips-check: a new flow to an address inside them that no Service holds
    /// is dropped (a cluster IP on a port no Service has is rejected in any case). Used where the
    /// API server has no ServiceCIDR objects (networking.k8s.io/v1), whose CIDRs win otherwise.
    #[arg(long, value_delimiter = ',')]
    pub service_cluster_ip_range: Vec<String>,
    /// Serve NodePorts on 127.0.0.1 when --nodeport-addresses includes loopback (kube-proxy's
    /// --iptables-localhost-nodeports; no route_localnet needed here).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub iptables_localhost_nodeports: bool,
    /// How NodePorts, external IPs and load-balancer IPs pick the backend of a new flow from
    /// outside the cluster: `random` (kube-proxy's) or `maglev` (consistent hashing of the flow:
    /// every node with the same endpoints picks the same backend, so a flow an ECMP router moves
    /// to another node keeps its backend). A Service's `lb-agent.io/lb-algorithm` annotation
    /// (or Cilium's `service.cilium.io/lb-algorithm`) overrides it. Cilium's flag name.
    #[arg(long, value_parser = clap::builder::ValueParser::new(str::parse::<LbAlgorithm>), default_value = "random")]
    pub bpf_lb_algorithm: LbAlgorithm,
    /// Entries of each Maglev table, a prime of 251, 509, 1021, 2039, 4093, 8191, 16381, 32749,
    /// 65521, 131071 (4 bytes each, per external frontend): at least 100 times a Service's
    /// endpoints keeps their shares within 1% of each other. Cilium's flag and default.
    #[arg(long, value_parser = clap::builder::ValueParser::new(|s: &str| s.parse::<u32>().map_err(|e| e.to_string()).and_then(TableSize::new)), default_value = "16381")]
    pub bpf_lb_maglev_table_size: TableSize,
    /// The seed of the Maglev tables and of the flow hash: 12 bytes in base64 (`head -c12
    /// /dev/urandom | base64 -w0`), the same on every node of the cluster (nodes with different
    /// seeds send a flow to different backends). Unset: the fixed seed every release uses.
    /// Changing it moves flows between backends. Cilium's flag and format.
    #[arg(long, value_parser = clap::builder::ValueParser::new(str::parse::<HashSeed>))]
    pub bpf_lb_maglev_hash_seed: Option<HashSeed>,
}

impl NodeArgs {
    /// `--service-cluster-ip-range`, parsed.
    pub fn service_cidrs(&self) -> anyhow::Result<Vec<ipnet::IpNet>> {
        self.service_cluster_ip_range
            .iter()
            .filter(|c| !c.trim().is_empty())
            .map(|c| {
                c.trim()
                    .parse::<ipnet::IpNet>()
                    .map(|n| n.trunc())
                    .map_err(|e| anyhow::anyhow!("--service-cluster-ip-range {c:?}: {e}"))
            })
            .collect()
    }

    /// The node's settings from these flags (the agent's and `trace`'s alike).
    pub fn settings(&self) -> anyhow::Result<NodeSettings> {
        let args = self;
        let mut cluster_cidrs: Vec<ipnet::IpNet> = Vec::new();
        for cidr in args.cluster_cidr.iter().filter(|c| !c.trim().is_empty()) {
            match cidr.trim().parse::<ipnet::IpNet>() {
                Ok(net) => cluster_cidrs.push(net.trunc()),
                Err(e) => anyhow::bail!("--cluster-cidr {cidr:?}: {e}"),
            }
        }
        for family in IpFamily::ALL {
            let n = cluster_cidrs
                .iter()
                .filter(|c| IpFamily::of_net(c) == family)
                .count();
            if n > MAX_CLUSTER_CIDRS {
                anyhow::bail!("--cluster-cidr: at most {MAX_CLUSTER_CIDRS} {family} CIDRs are supported");
            }
        }
        let nodeport_addresses = args
            .nodeport_addresses
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.parse::<NodePortAddress>().map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // kube-proxy's validation: the mode's interface must be named.
        match args.detect_local_mode {
            DetectLocalMode::BridgeInterface if args.pod_bridge_interface.trim().is_empty() => {
                anyhow::bail!(
                    "--detect-local-mode=BridgeInterface needs --pod-bridge-interface (detectLocal.bridgeInterface)"
                )
            }
            DetectLocalMode::InterfaceNamePrefix if args.pod_interface_name_prefix.trim().is_empty() => {
                anyhow::bail!(
                    "--detect-local-mode=InterfaceNamePrefix needs --pod-interface-name-prefix (detectLocal.interfaceNamePrefix)"
                )
            }
            _ => {}
        }
        Ok(NodeSettings {
            node_name: args
                .hostname_override
                .clone()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(crate::node::hostname)
                .to_lowercase(),
            cluster_cidrs,
            detect_local_mode: args.detect_local_mode,
            pod_bridge_interface: args.pod_bridge_interface.trim().to_string(),
            pod_interface_name_prefix: args.pod_interface_name_prefix.trim().to_string(),
            nodeport_addresses,
            masquerade_all: args.masquerade_all,
            localhost_nodeports: args.iptables_localhost_nodeports,
            bind_address: args.bind_address,
            load_balancing: crate::node::LoadBalancing {
                algorithm: args.bpf_lb_algorithm,
                maglev_table_size: args.bpf_lb_maglev_table_size,
                maglev_hash_seed: args.bpf_lb_maglev_hash_seed.unwrap_or_default(),
            },
            // Known once the data path is loaded.
            sctp_refused: None,
        })
    }
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// A KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) file; flags given explicitly
    /// override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Path to a kubeconfig with the API server's address (without kube-proxy, the `kubernetes`
    /// ClusterIP is not reachable until we run).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The API server address (overrides the kubeconfig's).
    #[arg(long)]
    pub master: Option<String>,
    /// Requests per second to the API server (a token bucket, as client-go's); 0 means the default,
    /// a negative value no limit (kube-proxy's --kube-api-qps, clientConnection.qps).
    #[arg(long, default_value_t = crate::watch::rate::DEFAULT_QPS, allow_negative_numbers = true)]
    pub kube_api_qps: f32,
    /// Requests the API client may send at once before --kube-api-qps paces them (kube-proxy's
    /// --kube-api-burst, clientConnection.burst).
    #[arg(long, default_value_t = crate::watch::rate::DEFAULT_BURST)]
    pub kube_api_burst: i32,
    /// Read Services and EndpointSlices from this folder instead of the API (static mode).
    #[arg(long, conflicts_with_all = ["kubeconfig", "master"])]
    pub manifests: Option<PathBuf>,
    #[command(flatten)]
    pub node: NodeArgs,
    /// /healthz and /livez (empty disables).
    #[arg(long, default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: String,
    /// /metrics (empty disables).
    #[arg(long, default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: String,
    /// Detach and unpin everything, then exit (as `lb-agent cleanup`).
    #[arg(long)]
    pub cleanup: bool,
    /// Minimum interval between syncs (kube-proxy's minSyncPeriod).
    #[arg(long, value_parser = parse_duration, default_value = "100ms")]
    pub min_sync_period: Duration,
    /// Maximum interval between syncs (kube-proxy's syncPeriod).
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub sync_period: Duration,
    #[command(flatten)]
    pub bpf: BpfArgs,
    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// BPF-specific settings (Cilium's names where it has them).
#[derive(Args, Debug, Clone)]
pub struct BpfArgs {
    #[command(flatten)]
    pub root: BpfRootArgs,
    /// cgroup v2 directory the socket programs attach to (default: the cgroup2 mount, found in
    /// /proc/self/mounts).
    #[arg(long)]
    pub cgroup_root: Option<PathBuf>,
    /// Capacity of the backends and reverse-NAT maps (each family's; at most 524287, so that
    /// the reverse-NAT ids of both families fit the tc path's 20-bit mark).
    #[arg(
        long,
        default_value_t = lb_common::catalog::capacity::BACKENDS,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(lb_common::catalog::MAX_REVNAT_PER_FAMILY))
    )]
    pub bpf_lb_map_max: u32,
    /// Capacity of the services map (frontends plus backend slots).
    #[arg(long, default_value_t = lb_common::catalog::capacity::SERVICES)]
    pub bpf_lb_service_map_max: u32,
    /// Capacity of the socket reverse-NAT map (LRU).
    #[arg(long, default_value_t = lb_common::catalog::capacity::SOCK_REVNAT)]
    pub bpf_sock_rev_map_max: u32,
    /// Capacity of the session-affinity map (LRU).
    #[arg(long, default_value_t = lb_common::catalog::capacity::AFFINITY)]
    pub bpf_lb_affinity_map_max: u32,
    /// Capacity of the tc path's connection-tracking map of established flows (LRU; two or three
    /// entries per flow).
    #[arg(long, default_value_t = lb_common::catalog::capacity::CONNTRACK)]
    pub bpf_ct_map_max: u32,
    /// Capacity of the tc path's connection-tracking map of flows in their handshake (LRU): a
    /// flood of unanswered SYNs or one-datagram UDP fills only this one.
    #[arg(long, default_value_t = lb_common::catalog::capacity::CONNTRACK_NEW)]
    pub bpf_ct_new_map_max: u32,
    /// How often the conntrack GC frees the tc path's entries of ended flows (and their
    /// masquerade ports); 0 turns it off.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub conntrack_gc_interval: Duration,
    /// How long a TCP flow closed by both sides (or reset) keeps its conntrack entries.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub bpf_ct_timeout_regular_tcp_fin: Duration,
    /// How long a TCP flow whose client never went past its SYN (a spoofed SYN's, in a flood)
    /// keeps its conntrack entries and its masquerade port.
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    pub bpf_ct_timeout_regular_tcp_syn: Duration,
    /// How long an idle UDP flow keeps its conntrack entries (and its backend).
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    pub bpf_ct_timeout_regular_any: Duration,
    /// Interfaces the tc programs attach to: names, or prefixes ending in `+` (default: every
    /// interface that is up, except loopback and the ports of a bridge, which the bridge stands
    /// for unless --bpf-lb-sock-hostns-only; rescanned at every sync).
    #[arg(long, value_delimiter = ',')]
    pub devices: Vec<String>,
    /// Attach the tc programs with TCX links where the kernel has TCX (6.6); false attaches them
    /// as clsact filters, as on older kernels (Cilium's --enable-tcx). A restart with the other
    /// value swaps one for the other without a gap.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_tcx: bool,
    /// Do not attach the tc programs (socket load balancing only).
    #[arg(long)]
    pub no_tc: bool,
    /// Translate at the socket only in the host network namespace; pods go through tc.
    #[arg(long)]
    pub bpf_lb_sock_hostns_only: bool,
    /// Use this eBPF object instead of the embedded one (development).
    #[arg(long)]
    pub bpf_object: Option<PathBuf>,
}

impl BpfArgs {
    pub fn conntrack_timeouts(&self) -> crate::datapath::conntrack::GcTimeouts {
        crate::datapath::conntrack::GcTimeouts {
            tcp_fin_timeout: self.bpf_ct_timeout_regular_tcp_fin,
            tcp_syn_timeout: self.bpf_ct_timeout_regular_tcp_syn,
            udp_timeout: self.bpf_ct_timeout_regular_any,
            ..Default::default()
        }
    }

    pub fn capacities(&self) -> Capacities {
        Capacities {
            services: self.bpf_lb_service_map_max,
            backends: self.bpf_lb_map_max,
            revnat: self.bpf_lb_map_max,
            sock_revnat: self.bpf_sock_rev_map_max,
            affinity: self.bpf_lb_affinity_map_max,
            conntrack: self.bpf_ct_map_max,
            conntrack_new: self.bpf_ct_new_map_max,
            ..Capacities::default()
        }
    }
}

/// Parses a flag's duration as the config file's are: Go's `time.ParseDuration` (`250ms`, `30s`,
/// `1m30s`, `1.5h`, `10µs`, `0`), so `--sync-period` accepts exactly what `syncPeriod` does.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    crate::config::parse_go_duration(s)
}

/// Parses `host:port`; `:port` means every address of both families, as Go's listeners take it
/// (`[::]`, which also accepts IPv4; the agent falls back to `0.0.0.0` on a node without IPv6).
pub fn parse_bind_address(s: &str) -> Result<Option<SocketAddr>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    let full = if s.starts_with(':') {
        format!("[::]{s}")
    } else {
        s.to_string()
    };
    full.parse().map(Some).map_err(|e| format!("{s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5x").is_err());
        // What the config file accepts, the flags accept (they share Go's parser).
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("10µs"), Ok(Duration::from_micros(10)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn bind_addresses() {
        assert_eq!(parse_bind_address(""), Ok(None));
        assert_eq!(
            parse_bind_address(":10256"),
            Ok(Some("[::]:10256".parse().unwrap()))
        );
        assert_eq!(
            parse_bind_address("[::]:10256"),
            Ok(Some("[::]:10256".parse().unwrap()))
        );
        assert!(parse_bind_address("nonsense").is_err());
    }

    #[test]
    fn cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "lb-agent",
            "--manifests",
            "/tmp/x",
            "--cluster-cidr",
            "10.244.0.0/16",
        ])
        .unwrap();
        assert!(cli.command.is_none());
        assert_eq!(cli.run.node.cluster_cidr, vec!["10.244.0.0/16"]);
    }
}
