//! The document's fixed text: how it is measured (over IPv4, over IPv6), how the tc cost is
//! measured, the caveats.

pub(super) const METHOD: &str = r#"
## How it is measured

Everything runs inside network namespaces and a test cgroup made for the run (nothing touches the
machine's interfaces, root cgroup or global sysctls). A real etcd and kube-apiserver run on
loopback; the Services are created through the API: Service *i* has the ClusterIP 10.96.1.0 + *i*,
port 80 → 8080, and one EndpointSlice with 10 ready endpoints (10.128.0.0 + 16*i* + *j* + 1).
Every configuration gets its own fresh topology (the reference's §7.2/§8(a)), dual-stack (every
address has its IPv6 twin; section 1 says how the IPv6 numbers are taken):

```
client netns              node netns (the proxy runs here)           backend netns
c0 10.240.0.2 ──veth── n0 10.240.0.1   n1 10.250.0.1 ──veth── b0 10.250.0.2
   fd00:10:240::2          fd00:10:240::1  fd00:10:250::1            fd00:10:250::2
default via the node      10.128.0.0/12 via the backend              local 10.128.0.0/12 dev lo
                          10.96.0.0/16 via the backend               local 10.96.0.0/16 dev lo
                          fd00:10:200::/64 via the backend           local fd00:10:200::/64 dev lo
                          fd00:10:96::/112 via the backend           local fd00:10:96::/112 dev lo
                                                                     one accept-and-close server :8080
                                                                     (an IPv4 and an IPv6 listener)
```

A connection to a ClusterIP that nothing translated is refused at once by the backend namespace
(the Service range is local there and nothing listens on the Service ports), so the probes below
see "not served yet" / "no longer served" without waiting for a timeout.

The client is inside the cluster CIDRs given to every proxy (10.128.0.0/9 and fd00:10:200::/40),
so it is an in-cluster pod and no configuration masquerades, in either family. The API server is
dual-stack (`--service-cluster-ip-range=10.96.0.0/16,fd00:10:96::/112`, IPv4 first) and the Node
the proxies run as has both InternalIPs (10.240.0.1, fd00:10:240::1). Configurations:

1. **direct (floor)**: the client connects to a random endpoint of a random Service; no proxy.
2. **kube-proxy iptables** / 3. **kube-proxy nftables**: the real kube-proxy in the node namespace.
   **kube-proxy iptables** runs the machine's `iptables` (iptables-nft, the nf_tables backend);
   **kube-proxy iptables-legacy** the same kube-proxy with the legacy x_tables binaries first in
   its PATH, as the kube-proxy image's iptables-wrapper picks on a node whose rules are legacy.
   Both backends are in production use; their `iptables-restore` scales differently.
4. **lb socket**: lb-agent in the node namespace; the client runs in the agent's `--cgroup-root`,
   so `connect()` is translated at the socket (connect4, or connect6 over IPv6; the tc programs
   are attached too, and see the packets as non-service traffic).
5. **lb tc**: lb-agent in the node namespace; the client is outside its cgroup, so the SYN is
   translated by the tc program on the node's client-facing veth, and replies on the way back.
6. **cilium socket** / 7. **cilium tc**: the real cilium-agent (built from Cilium's Go module,
   its programs compiled at start by clang 19) as a kube-proxy replacement in the node namespace,
   on the same devices, with its own test cgroup as `--cgroup-root`: the client in that cgroup
   (Cilium's socket LB, `cil_sock4_connect`) or outside it (the SYN is translated by Cilium's
   `bpf_host` program on the node's client-facing veth; `--bpf-lb-external-clusterip` makes it
   serve ClusterIPs from outside the node, as lb tc does). Run when its bundle is built
   (`cargo xtask bench` builds it first).

The client (a Rust port of the reference's `crr.c`, in lb-bench) makes sequential connections, each
to a uniformly random Service, and closes each with RST (SO_LINGER 0); the time of the blocking
`connect()` is recorded. It is pinned to CPU 1 and the server to CPU 0. Every round runs every
configuration once, in alternating order (forward, then backward: ABCDE EDCBA ...). Every
configuration of an N is started before its first round, and the rounds begin once the cores
are less than 15% busy for two seconds in a row (at most a minute later): the proxies' start-up
work and the API server's own after the Services were created do not fall into the rounds.
"#;

pub(super) const TC_METHOD: &str = r#"The real programs run with BPF_PROG_TEST_RUN against private maps that the agent's own pipeline
programs with N Services × 10 endpoints (plus two helper Services), once with the IPv4 Service set
and IPv4 packets and once with the IPv6 set and the same packets in IPv6 (each address's twin,
`10.97.0.1` → `fd00:10:97::1`; the socket call is connect6). With repeat > 1 every run after the
first sees the packet the previous run rewrote, so:

- *repeat 10⁶* (median and min over batches): used only for packets that stay valid under their
  own rewrite. The non-service packet is left untouched. The established flow uses a two-cycle:
  Service A (VIP a:80) has the single endpoint b:80 and Service B (VIP b:80) the endpoint a:80;
  with both flows established, c:p → a:80 becomes c:p → b:80 and then exactly the original packet
  again (checked byte for byte first). Every run is thus a conntrack hit plus a DNAT. The reply
  (egress reverse NAT) cycles the same way.
- *one call*: the packet is copied in afresh by every syscall, so each call is a true first run (a
  SYN is a new flow: new source port each call). The median over the calls is shown after
  subtracting the kernel's timer overhead around one run, estimated as (non-service packet, one
  call) − (non-service packet, repeat 10⁶). The raw value is in parentheses.

No empty program can be loaded here to subtract a harness baseline; the non-service packet is an
upper bound of it (the reference measured an empty tc program at 26 ns/run on this VM).

*lb-agent monitor* (issue 24): the programs write an event per new flow only while a monitor
listens. The rows without a monitor are the idle cost, one lookup of `lb_monitor` per new flow
(none on an established flow's or a reply's path, which have no event code). The row *new flow,
lb-agent monitor listening* times the same kind of SYNs with the lease taken and every type
wanted, each writing its event into the ring buffer (drained between calls, untimed, as a
monitor keeps up; the run checks that every new flow's event arrived). The socket programs
cannot run under BPF_PROG_TEST_RUN and their harness (`lb_sock_trace`) writes no events, so
their listening cost is not in this table; their idle cost is the same one lookup per connect.

"#;

pub(super) const IPV6_METHOD: &str = r#"**Over IPv6.** After the IPv4 rounds at each N, the N IPv4 Services are deleted and N single-stack
IPv6 Services created instead (`ipFamilies: [IPv6]`; Service *i* has the ClusterIP
fd00:10:96::100 + *i* and one `addressType: IPv6` EndpointSlice with the endpoints
fd00:10:200:: + 16*i* + *j* + 1), and every configuration is started afresh on a fresh topology
and timed to serve them (the cold starts of section 2, *Services* IPv6), then measured the same
way with the client connecting over IPv6 (an AF_INET6 socket; the floor connects to the IPv6
endpoints directly). So each family's rows are taken with only that family's Services in the API,
and the IPv4 rows exactly as in an IPv4-only run. The proxies run dual-stack all along: kube-proxy
runs one proxier per family (IPv4 primary), the IPv6 one writing `ip6tables` rules in iptables
mode and the `ip6 kube-proxy` table in nftables mode; lb-agent serves both families from one
process (its `lb6_*` maps; connect6 on the socket path). A configuration that did not serve the
IPv4 Services within the cold-start timeout at some N is not started over IPv6 at that N (the
problems at the end say so).

"#;

/// Why an add's watch event comes later than a change's: said under the change table and, when
/// the target is missed, in the reasons.
pub(super) const ADD_VS_CHANGE: &str = "Creating a Service allocates its ClusterIP first, which \
since Kubernetes 1.33 writes an IPAddress object to etcd before the Service itself; a change is \
one write. That difference is the API server's, and every proxy pays it alike.";

pub(super) const CAVEATS: &str = r#"
## Caveats

- A 2-vCPU VM is noisy; the spread over rounds is shown with every latency. Single-connection
  latencies include the whole path through three namespaces (two veth hops each way).
- kube-proxy's and lb-agent's periodic resyncs are set to 1 h so that no idle program re-syncs
  while another configuration is measured; their min-sync-periods stay at the defaults.
- The programming times through the API include the API server's own work (on the same two
  cores), which dominates at 10,000 Services; the programs' own sync durations are shown beside.
- IPVS cannot be measured on this kernel (`CONFIG_IP_VS` is not set).
"#;

/// How the north-south throughput is set up (section 5).
pub(super) const THROUGHPUT: &str = "One NodePort Service (`bench/nodeport`, port 80 -> 8080, \
nodePort 30080, externalTrafficPolicy Cluster, 10 endpoints) is the only Service in the API \
while this runs; every configuration is started afresh on a fresh topology and measured once it \
serves the NodePort. The client is outside the cluster CIDRs, so every proxy masquerades \
(kube-proxy's KUBE-MARK-MASQ for external traffic; lb tc's SNAT on the backend-facing egress).";

pub(super) const RESTORE_METHOD: &str = r#"kube-proxy's iptables proxier programs its first sync after a start with one
`iptables-restore -w 5 --noflush --counters` of every Service's chains (later syncs restore only
the chains that changed, which is why creating the Services through the API with kube-proxy
running stays fast). Here that call runs by itself: kube-proxy's nat ruleset for N of the
benchmark's Services (KUBE-SERVICES, a KUBE-SVC chain per Service, a KUBE-SEP chain per endpoint,
hashed names) restored into an empty nat table of a fresh network namespace, timed until the
command returns. With `--noflush`, iptables-nft collects the name of every chain a command names
into a sorted linked list before fetching those chains from the kernel
(`cache_chain_list_insert` in `iptables/nft-cache.c`, in iptables 1.8.9 as here and unchanged in
1.8.11, Debian's newest): a walk of that list per command, so the restore grows with the square of
the number of chains. The same input without `--noflush`, and iptables-legacy, do not. The
growth exponent is `log(t₂/t₁) / log(N₂/N₁)` over the last two levels measured (1 linear, 2
quadratic), and the projection `t(N_last) × (N / N_last)^exponent`: an extrapolation, not a
measurement, and rather a lower bound for iptables-nft: the longer list also misses the CPU's
caches more often at every step of its walk.
"#;
