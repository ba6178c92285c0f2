//! lb-agent: an eBPF replacement for kube-proxy.
//!
//! The data path from API object to packet is one straight line, one module per step:
//!
//! 1. `watch`    — Services, EndpointSlices and this Node, from the API or from manifest files;
//! 2. `model`    — kube-proxy's semantics: service ports, endpoints, traffic policies, topology;
//! 3. `plan`     — the desired content of every BPF map, as plain data;
//! 4. `maps`     — the difference against what is in the kernel, written in a safe order;
//! 5. `datapath` — the eBPF object: bpffs, pinning, loading and attaching the programs.
//!
//! `sync` runs steps 1-3 as one pure function; `run` is the agent's loop around it. Around them:
//! `node` (addresses and `--nodeport-addresses`), `cli`, and the operator commands `inspect`,
//! `trace` and `cleanup`.

pub mod cleanup;
pub mod cli;
pub mod config;
pub mod datapath;
pub mod error;
pub mod health;
pub mod inspect;
pub mod maps;
pub mod metrics;
pub mod model;
pub mod node;
pub mod plan;
pub mod run;
pub mod runner;
pub mod sync;
pub mod trace;
pub mod watch;
