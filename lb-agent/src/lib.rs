//! lb-agent: an eBPF replacement for kube-proxy.
//!
//! The data path from API object to packet is one straight line, one module per step; a module
//! imports only from the steps before it:
//!
//! 0. `node`     — this node's facts: name, zone, addresses, what the plan and programs are told;
//! 1. `watch`    — Services, EndpointSlices and this Node, from the API or from manifest files;
//! 2. `model`    — kube-proxy's semantics: service ports, endpoints, traffic policies, topology;
//! 3. `plan`     — the desired content of every BPF map, as plain data, kept up to date one
//!    Service at a time (`plan::Planner`);
//! 4. `apply`    — the difference against what is in the kernel's maps, written in a safe order;
//! 5. `datapath` — the eBPF object: bpffs, pinning, loading and attaching the programs; the
//!    conntrack GC.
//!
//! Around the line: `agent` (the agent process: start-up, then a sync per change, driven by
//! kube-proxy's `bounded_frequency` runner), `health` (`/healthz`, `/livez` and the
//! health-check NodePorts), `metrics`, `events` (Warning Events for problems), `config`
//! (`KubeProxyConfiguration`) and `cli` (flags). The operator commands: `inspect`, `monitor`
//! (the programs' events, live), `trace` (which programs a private data path through the agent's
//! own code) and `cleanup`. Below everything:
//! `time` (the kernel's clocks), `family` (IPv4 and IPv6 as values and as
//! types), `netlink` (one request and its answers), `compact` (long-lived maps repacked) and
//! `error`.

pub mod agent;
pub mod apply;
pub mod bounded_frequency;
pub mod cleanup;
pub mod cli;
pub mod compact;
pub mod config;
pub mod datapath;
pub mod error;
pub mod events;
pub mod family;
pub mod health;
pub mod inspect;
pub mod metrics;
pub mod model;
pub mod monitor;
pub mod netlink;
pub mod node;
pub mod plan;
#[cfg(test)]
pub(crate) mod test_util;
pub mod time;
pub mod trace;
pub mod watch;
