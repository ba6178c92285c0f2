//! The document's fixed text: how it is measured, how the tc cost is measured, the caveats.

pub(super) const METHOD: &str = r#"
## How it is measured

Everything runs inside network namespaces and a test cgroup made for the run (nothing touches the
machine's interfaces, root cgroup or global sysctls). A real etcd and kube-apiserver run on
loopback; the Services are created through the API: Service *i* has the ClusterIP 10.96.1.0 + *i*,
port 80 → 8080, and one EndpointSlice with 10 ready endpoints (10.128.0.0 + 16*i* + *j* + 1).
Every configuration gets its own fresh topology (the reference's §7.2/§8(a)):

```
client netns              node netns (the proxy runs here)           backend netns
c0 10.240.0.2 ──veth── n0 10.240.0.1   n1 10.250.0.1 ──veth── b0 10.250.0.2
default via the node      10.128.0.0/12 via the backend              local 10.128.0.0/12 dev lo
                          10.96.0.0/16 via the backend               local 10.96.0.0/16 dev lo
                                                                     one accept-and-close server :8080
```

A connection to a ClusterIP that nothing translated is refused at once by the backend namespace
(the Service range is local there and nothing listens on the Service ports), so the probes below
see "not served yet" / "no longer served" without waiting for a timeout.

The client is inside the cluster CIDR given to every proxy (10.128.0.0/9), so it is an in-cluster
pod and no configuration masquerades. Configurations:

1. **direct (floor)**: the client connects to a random endpoint of a random Service; no proxy.
2. **kube-proxy iptables** / 3. **kube-proxy nftables**: the real kube-proxy in the node namespace.
4. **lb socket**: lb-agent in the node namespace; the client runs in the agent's `--cgroup-root`,
   so `connect()` is translated at the socket (the tc programs are attached too, and see the
   packets as non-service traffic).
5. **lb tc**: lb-agent in the node namespace; the client is outside its cgroup, so the SYN is
   translated by the tc program on the node's client-facing veth, and replies on the way back.

The client (a Rust port of the reference's `crr.c`, in lb-bench) makes sequential connections, each
to a uniformly random Service, and closes each with RST (SO_LINGER 0); the time of the blocking
`connect()` is recorded. It is pinned to CPU 1 and the server to CPU 0. Every round runs every
configuration once, in alternating order (forward, then backward: ABCDE EDCBA ...).
"#;

pub(super) const TC_METHOD: &str = r#"The real programs run with BPF_PROG_TEST_RUN against private maps that the agent's own pipeline
programs with N Services × 10 endpoints (plus two helper Services). With repeat > 1 every run
after the first sees the packet the previous run rewrote, so:

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

"#;

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
