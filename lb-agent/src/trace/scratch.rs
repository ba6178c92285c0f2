//! A data path with private, unpinned maps, programmed from a set of objects through the agent's
//! own code (`agent::Programmer`): what `lb-agent trace --manifests` runs the programs against,
//! and what the tests run them against with BPF_PROG_TEST_RUN.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::{Context, Result, bail};
use lb_common::catalog::Capacities;

use crate::{
    agent::Programmer,
    apply::{Applier, KernelMaps},
    datapath::Datapath,
    model::Problem,
    node::{Link, LocalNetwork, NodeSettings},
    watch::ClusterState,
};

/// The netns cookie the scratch data path treats as "the host" (any fixed value works: the socket
/// harness passes it in).
pub const SCRATCH_HOST_COOKIE: u64 = 0x1000_0001;

/// Map sizes for fixtures and traces: small, so that loading is quick.
pub const SCRATCH_CAPACITIES: Capacities = Capacities {
    services: 65_536,
    backends: 16_384,
    revnat: 16_384,
    sock_revnat: 4096,
    affinity: 4096,
    affinity_match: 16_384,
    source_ranges: 4096,
    conntrack: 65_536,
    conntrack_new: 16_384,
};

/// The loaded programs and their maps, programmed as a node with `node_ips` on its interfaces
/// would be.
pub struct ScratchDatapath {
    pub datapath: Datapath,
    pub programmer: Programmer<KernelMaps>,
    /// The node's interface addresses (loopback aside): what it programs NodePorts on, and what
    /// `trace` takes as "starts on this node".
    pub node_ips: Vec<IpAddr>,
    /// The node's links, for an interface local-traffic detector (none unless given: a packet
    /// then came in by no pod interface).
    pub links: Vec<Link>,
}

impl ScratchDatapath {
    /// Loads the object with scratch maps and programs `state`.
    pub fn new(
        state: &ClusterState,
        settings: NodeSettings,
        node_ips: &[IpAddr],
        object: &[u8],
    ) -> Result<Self> {
        Self::with_capacities(state, settings, node_ips, object, SCRATCH_CAPACITIES)
    }

    /// [`Self::new`] on a node with these links (what the interface local-traffic detectors
    /// decide by).
    pub fn with_links(
        state: &ClusterState,
        settings: NodeSettings,
        node_ips: &[IpAddr],
        links: Vec<Link>,
        object: &[u8],
    ) -> Result<Self> {
        Self::build(state, settings, node_ips, links, object, SCRATCH_CAPACITIES)
    }

    /// [`Self::new`] with maps of other sizes.
    pub fn with_capacities(
        state: &ClusterState,
        settings: NodeSettings,
        node_ips: &[IpAddr],
        object: &[u8],
        caps: Capacities,
    ) -> Result<Self> {
        Self::build(state, settings, node_ips, Vec::new(), object, caps)
    }

    fn build(
        state: &ClusterState,
        settings: NodeSettings,
        node_ips: &[IpAddr],
        links: Vec<Link>,
        object: &[u8],
        caps: Capacities,
    ) -> Result<Self> {
        let mut datapath = Datapath::load_unpinned(&caps, object).context("loading the eBPF object")?;
        let mut maps = datapath.take_maps()?;
        // Fresh maps hold no flow: the bits are complete as soon as the Services are written, so
        // the programs filter as the agent's do.
        maps.prime_prefilter(&Default::default())?;
        // Likewise the egress flow filter: on from the start, the programs set every byte.
        datapath.activate_fresh_ct_filters()?;
        let mut scratch = Self {
            datapath,
            programmer: Programmer::new(settings, SCRATCH_HOST_COOKIE, false, Applier::new(maps, caps)),
            node_ips: node_ips.to_vec(),
            links,
        };
        scratch.program(state)?;
        Ok(scratch)
    }

    /// Brings the scratch maps to `state` as the agent's full sync would; returns the problems
    /// found in it.
    pub fn program(&mut self, state: &ClusterState) -> Result<Vec<Problem>> {
        // The SCTP program as the agent loads it: once a Service has an SCTP port.
        if state.services.values().any(|s| crate::agent::has_sctp_port(s)) {
            crate::agent::serve_sctp(&mut self.datapath, self.programmer.settings_mut())?;
        }
        let mut addresses = self.node_ips.clone();
        addresses.extend([IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)]);
        let local = LocalNetwork {
            addresses,
            ipv6_disabled: false,
            links: self.links.clone(),
            // No interface addresses: flows are masqueraded with the node IP (`lb_masq_addrs`'
            // fallback), the programs look no route up.
            interface_addresses: Vec::new(),
        };
        let view = self.programmer.view(state.node.as_deref(), &local);
        self.programmer.write_config(&view)?;
        self.programmer.set_service_cidrs(
            state.service_cidrs.clone().unwrap_or_default(),
            crate::watch::delegated_cluster_ips(state.services.values().map(|s| s.as_ref())),
        );
        let (_, report) = self.programmer.program_all(state, &view);
        if !report.errors.is_empty() {
            bail!(
                "programming the scratch maps failed: {}",
                report.errors.join("; ")
            );
        }
        Ok(self.programmer.planner().problems())
    }

    pub fn maps(&self) -> &KernelMaps {
        self.programmer.maps()
    }

    /// The maps, for a test that writes an entry by hand (say, a narrower masquerade port range
    /// in `lb_config`); the programmer does not know of such writes.
    pub fn maps_mut(&mut self) -> &mut KernelMaps {
        self.programmer.maps_mut()
    }

    pub fn host_cookie(&self) -> u64 {
        SCRATCH_HOST_COOKIE
    }

    /// Traces `req` through this data path (`lb-agent trace --manifests`).
    pub fn trace(&mut self, req: &super::TraceRequest) -> Result<(super::TraceResult, super::TraceDetails)> {
        super::trace(
            &mut self.datapath,
            self.programmer.maps(),
            SCRATCH_HOST_COOKIE,
            &self.node_ips,
            req,
        )
    }
}
