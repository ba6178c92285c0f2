//! Maglev tables at scale (issue 17), against scratch maps that the agent's own pipeline programs
//! (no API server involved): N Services, each with 10 endpoints and one external IP whose
//! external scope uses Maglev (the `lb-agent.io/lb-algorithm` annotation), so N tables of the
//! default size, next to the same N Services with the default random choice.
//!
//! Measured for each: the cold programming (planning and every map write, tables included), the
//! kernel memory of the tables (`bytes_memlock` of every inner array, as `bpftool map show`
//! reports it, and of `lb_maglev` itself), and one Service's endpoint change through the agent's
//! incremental path (`Programmer::program_changed`: the Service re-planned, its table rebuilt and
//! swapped in), `changes` times, alternately removing and restoring one endpoint.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use lb_agent::{datapath::OBJECT, node::NodeSettings, trace::ScratchDatapath, watch::ClusterState};
use lb_common::catalog::Capacities;
use lb_tests::{
    fixtures::{State, service, slice},
    packet::Family,
};
use serde::{Deserialize, Serialize};

use super::{api, topo};

/// One Maglev measurement at N Services, with the random-choice twin.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct MaglevLevel {
    pub n: u32,
    pub table_size: u32,
    /// Tables in `lb_maglev` after the cold programming (one per Service: its external IP).
    pub tables: usize,
    /// Cold programming, seconds: Maglev, then the same Services with random choice.
    pub cold_s: f64,
    pub cold_random_s: f64,
    /// Kernel memory of the tables (every inner array's `bytes_memlock`) and of `lb_maglev`.
    pub table_bytes: u64,
    pub outer_bytes: u64,
    /// One Service's endpoint change, milliseconds each: Maglev, then random choice.
    pub change_ms: Vec<f64>,
    pub change_random_ms: Vec<f64>,
    /// Map writes of one Maglev change (median): its table is one.
    pub change_writes: usize,
}

const EXTERNAL_BASE: [u8; 2] = [198, 18];

fn external_ip(i: u32) -> String {
    format!(
        "{}.{}.{}.{}",
        EXTERNAL_BASE[0],
        EXTERNAL_BASE[1] + (i >> 16) as u8,
        (i >> 8) as u8,
        i as u8
    )
}

fn svc_name(i: u32) -> String {
    format!("mg{i:05}")
}

/// Service `i` with one external IP, annotated with `algorithm`.
fn build_service(i: u32, algorithm: &str) -> k8s_openapi::api::core::v1::Service {
    service(api::NS, &svc_name(i))
        .cluster_ip(&api::cluster_ip_in(Family::V4, i).to_string())
        .port(
            "http",
            "TCP",
            i32::from(api::SERVICE_PORT),
            i32::from(topo::BACKEND_PORT),
        )
        .external_ips(&[&external_ip(i)])
        .annotation("lb-agent.io/lb-algorithm", algorithm)
        .build()
}

/// Service `i`'s slice, without endpoint `drop` when given.
fn build_slice(i: u32, drop: Option<u32>) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    let name = svc_name(i);
    let mut s = slice(api::NS, &name, &format!("{name}-1"));
    for j in (0..api::ENDPOINTS).filter(|j| Some(*j) != drop) {
        s = s.endpoint(
            &api::endpoint_ip_in(Family::V4, i, j).to_string(),
            "bench-node-b",
            State::Ready,
        );
    }
    s.port("http", "TCP", i32::from(topo::BACKEND_PORT)).build()
}

fn state(n: u32, algorithm: &str) -> ClusterState {
    let mut s = ClusterState::default();
    for i in 0..n {
        s.add_service(build_service(i, algorithm));
        s.add_slice(build_slice(i, None));
    }
    s
}

fn scratch(n: u32, state: &ClusterState) -> Result<ScratchDatapath> {
    if OBJECT.is_empty() {
        bail!("lb-agent was built without the eBPF object (run through `cargo xtask bench`)");
    }
    let (backends, services) = super::map_sizes(n);
    // Two frontends per Service (its cluster IP and its external IP).
    let caps = Capacities {
        services: services.saturating_mul(2).max(262_144),
        backends: backends.max(131_072),
        revnat: (2 * n + 1_024).next_power_of_two().max(65_536),
        sock_revnat: 4096,
        affinity: 4096,
        affinity_match: 16_384,
        source_ranges: 4096,
        conntrack: 4096,
        conntrack_new: 4096,
    };
    let settings = NodeSettings {
        cluster_cidrs: vec![topo::CLUSTER_CIDR.parse().expect("cidr")],
        ..NodeSettings::new(api::NODE)
    };
    let node_ips = [topo::NODE_IP.parse::<IpAddr>().expect("ip")];
    ScratchDatapath::with_capacities(state, settings, &node_ips, OBJECT, caps)
}

/// Every map of the kernel named `name`: (count, sum of `bytes_memlock`).
fn kernel_maps(name: &str) -> Result<(usize, u64)> {
    let out = std::process::Command::new("bpftool")
        .args(["-j", "map", "show"])
        .output()
        .context("bpftool map show")?;
    let maps: serde_json::Value = serde_json::from_slice(&out.stdout).context("bpftool's JSON")?;
    let ours: Vec<&serde_json::Value> = maps
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["name"] == name)
        .collect();
    let bytes = ours.iter().filter_map(|m| m["bytes_memlock"].as_u64()).sum();
    Ok((ours.len(), bytes))
}

/// `changes` endpoint changes of one Service (a different one each time), each through the
/// incremental path: (milliseconds each, map writes each).
fn changes(
    s: &mut ScratchDatapath,
    state: &mut ClusterState,
    n: u32,
    changes: u32,
) -> (Vec<f64>, Vec<usize>) {
    let mut times = Vec::new();
    let mut writes = Vec::new();
    for k in 0..changes {
        let i = (k.wrapping_mul(2_654_435_761)) % n;
        // Remove one endpoint, then put it back: two changes per Service.
        for drop in [Some(k % api::ENDPOINTS), None] {
            state.add_slice(build_slice(i, drop));
            let key = (api::NS.to_string(), svc_name(i));
            let inputs = state.service_inputs(&key);
            let started = Instant::now();
            let (_, report) = s
                .programmer
                .program_changed(std::iter::once(&key), |_| inputs.clone());
            times.push(started.elapsed().as_secs_f64() * 1e3);
            writes.push(report.writes + report.deletes);
        }
    }
    (times, writes)
}

pub fn measure(n: u32, change_count: u32) -> Result<MaglevLevel> {
    let table_size = lb_agent::plan::maglev::DEFAULT_TABLE_SIZE;
    let mut level = MaglevLevel {
        n,
        table_size,
        ..Default::default()
    };

    let mut random_state = state(n, "random");
    let started = Instant::now();
    let mut random = scratch(n, &random_state)?;
    level.cold_random_s = started.elapsed().as_secs_f64();
    (level.change_random_ms, _) = changes(&mut random, &mut random_state, n, change_count);
    drop(random);

    // Other processes' maps of these names (an agent on this machine) are not ours.
    let (tables_before, table_bytes_before) = kernel_maps("lb_maglev_tbl")?;
    let outer_before = kernel_maps("lb_maglev")?.1;
    let mut maglev_state = state(n, "maglev");
    let started = Instant::now();
    let mut maglev = scratch(n, &maglev_state)?;
    level.cold_s = started.elapsed().as_secs_f64();
    let (tables, table_bytes) = kernel_maps("lb_maglev_tbl")?;
    level.tables = tables.saturating_sub(tables_before);
    level.table_bytes = table_bytes.saturating_sub(table_bytes_before);
    level.outer_bytes = kernel_maps("lb_maglev")?.1.saturating_sub(outer_before);
    if level.tables != n as usize {
        bail!("{} Maglev tables for {n} Services", level.tables);
    }
    let (times, mut writes) = changes(&mut maglev, &mut maglev_state, n, change_count);
    level.change_ms = times;
    writes.sort_unstable();
    level.change_writes = writes.get(writes.len() / 2).copied().unwrap_or(0);
    // The tables go with the scratch maps.
    drop(maglev);
    std::thread::sleep(Duration::from_millis(100));
    Ok(level)
}
