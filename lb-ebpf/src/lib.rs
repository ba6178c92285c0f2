//! The in-kernel data path. Program entry points live in `main.rs` and stay thin; the logic lives
//! here so that it reads as ordinary Rust and can be shared between programs (the socket programs
//! and their BPF_PROG_TEST_RUN harness run the same `sock` code).
//!
//! - `maps`: every map, declared once with `#[btf_map]` (BTF makes `bpftool map dump` print fields);
//! - `family`: which map serves which family (`FamilyMaps`): the code below is written once over
//!   the family and monomorphised for IPv4 and IPv6;
//! - `lb`: service lookup and backend selection, shared by both paths;
//! - `sock`: cgroup connect/sendmsg/recvmsg/getpeername translation (IPv4-mapped IPv6 included);
//! - `tc`: per-packet translation (DNAT, masquerade, conntrack, reverse NAT, reject, ICMP).
//! - `stats`: per-CPU counters, bumped instead of failing a syscall or logging on the hot path;
//! - `monitor`: the same outcomes as events with their flow, only while `lb-agent monitor` listens.
//! - `features`: the kernel features the agent found, so one object loads on every supported kernel.
#![no_std]

pub mod family;
pub mod features;
pub mod lb;
pub mod maps;
pub mod monitor;
pub mod sock;
pub mod stats;
pub mod tc;
