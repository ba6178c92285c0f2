//! The tc programs on the node's interfaces: which interfaces (`--devices`), attaching with pinned
//! TCX links (kernel >= 6.6) or, on kernels without TCX, as clsact filters at our own priority and
//! handle; adopting what a previous run attached (its program is replaced in place), and
//! detaching from interfaces that went away.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

use aya::programs::{
    LinkOrder, SchedClassifier,
    links::{FdLink, PinnedLink},
    tc::{self, NlOptions, SchedClassifierLink, TcAttach, TcAttachType, TcHandle},
};

use super::{Datapath, DatapathError, PinPaths, program, program_error};
use crate::node::Link;

/// The tc programs and their hooks.
pub const TC_PROGRAMS: [(&str, TcAttachType, &str); 2] = [
    ("lb_tc_ingress", TcAttachType::Ingress, "ingress"),
    ("lb_tc_egress", TcAttachType::Egress, "egress"),
];

/// SCTP's tc ingress program: never attached, reached by a tail call from `lb_tc_ingress` through
/// `lb_tc_tail` (the verifier could not walk SCTP's steps in `lb_tc_ingress` as well).
pub const SCTP_INGRESS_PROGRAM: &str = "lb_tc_sctp_in";

/// SCTP's tc egress program, for the node's own SCTP to a frontend: never attached, reached by a
/// tail call from `lb_tc_egress` through `lb_tc_tail`.
pub const SCTP_EGRESS_PROGRAM: &str = "lb_tc_sctp_out";

/// The SCTP programs and their slots in `lb_tc_tail`: loaded together, only where SCTP is served.
pub const SCTP_PROGRAMS: [(&str, u32); 2] = [
    (SCTP_INGRESS_PROGRAM, lb_common::catalog::TAIL_SCTP_INGRESS),
    (SCTP_EGRESS_PROGRAM, lb_common::catalog::TAIL_SCTP_EGRESS),
];

/// One entry of `--devices`: a name, or a prefix ending in `+` (iptables style) or `*`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DevicePattern {
    Name(String),
    Prefix(String),
}

impl DevicePattern {
    pub fn parse(s: &str) -> Self {
        let s = s.trim();
        match s.strip_suffix('+').or_else(|| s.strip_suffix('*')) {
            Some(prefix) => DevicePattern::Prefix(prefix.to_string()),
            None => DevicePattern::Name(s.to_string()),
        }
    }

    pub fn matches(&self, name: &str) -> bool {
        match self {
            DevicePattern::Name(n) => n == name,
            DevicePattern::Prefix(p) => name.starts_with(p.as_str()),
        }
    }
}

/// The links (of the sync's RTM_GETLINK dump, `node::local_network`) that are up, but
/// loopback: name -> ifindex.
pub fn interfaces_up(links: &[Link]) -> BTreeMap<String, u32> {
    links
        .iter()
        .filter(|l| l.up && !l.loopback)
        .map(|l| (l.name.clone(), l.index))
        .collect()
}

/// The interfaces to attach to: those matching `patterns`; when there are none, every interface
/// that is up but loopback and the ports of a bridge (`bridge_ports`, ifindexes). A bridge's
/// ports are left to the bridge: every packet of theirs that is routed (to or from a Service,
/// replies of masqueraded flows to its pods included) crosses the bridge device's own ingress or
/// egress, so with a bridge CNI no pod veth carries the programs. A ptp CNI's veths are each
/// the only interface facing their pod and keep them. (The caller passes no ports when pods'
/// connections are translated at tc: a reply between two pods of one bridge is bridged.)
pub fn select_devices(
    patterns: &[DevicePattern],
    up: &BTreeMap<String, u32>,
    bridge_ports: &BTreeSet<u32>,
) -> BTreeMap<String, u32> {
    up.iter()
        .filter(|(name, index)| {
            if patterns.is_empty() {
                !bridge_ports.contains(index)
            } else {
                patterns.iter().any(|p| p.matches(name))
            }
        })
        .map(|(n, i)| (n.clone(), *i))
        .collect()
}

fn tc_links_root(paths: &PinPaths) -> PathBuf {
    paths.links().join("tc")
}

/// Pin names may not contain '.', which interface names may (VLANs): keep names readable and
/// unique through the ifindex.
fn device_dir(paths: &PinPaths, ifindex: u32, name: &str) -> PathBuf {
    let clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    tc_links_root(paths).join(format!("{ifindex}-{clean}"))
}

/// The ifindex of every interface with pinned tc links.
pub fn pinned_devices(paths: &PinPaths) -> BTreeMap<u32, PathBuf> {
    let Ok(entries) = fs::read_dir(tc_links_root(paths)) else {
        return BTreeMap::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let index: u32 = name.split('-').next()?.parse().ok()?;
            Some((index, e.path()))
        })
        .collect()
}

impl Datapath {
    /// Attaches the tc programs to one interface (ingress and egress), adopting what a previous
    /// run attached: a pinned TCX link, or on kernels without TCX the clsact filter at our
    /// priority and handle, whose program is replaced in place.
    pub fn attach_tc(&mut self, ifname: &str, ifindex: u32) -> Result<(), DatapathError> {
        if self.tc_attached.contains(&ifindex) {
            return Ok(());
        }
        let paths = self.pinned_paths()?;
        let dir = device_dir(&paths, ifindex, ifname);
        fs::create_dir_all(&dir).map_err(|e| DatapathError::Pin {
            path: dir.clone(),
            message: e.to_string(),
        })?;
        let tcx = self.tcx;
        if !tcx {
            // Filters hang off a clsact qdisc (EEXIST when one is there: ours, or Cilium's).
            if let Err(e) = tc::qdisc_add_clsact(ifindex) {
                tracing::debug!(device = ifname, "clsact: {e}");
            }
        }
        // Egress first: once ingress translates a flow, the reply must find its reverse NAT on
        // the way out. In the other order a SYN arriving between the two is translated and its
        // SYN-ACK is not, and the client's retransmitted SYN is reset (seen migrating from
        // kube-proxy, tests/tests/e2e_migration.rs). `detach_clsact` removes ingress first.
        for (name, attach_type, hook) in TC_PROGRAMS.into_iter().rev() {
            let prog: &mut SchedClassifier = program(&mut self.ebpf, name)?;
            let pin = dir.join(hook);
            if tcx {
                attach_tcx(prog, name, ifindex, attach_type, &pin)?;
            } else {
                attach_clsact(prog, name, ifindex, attach_type)?;
                // After a switch from TCX (--enable-tcx=false): the new filter runs, so the
                // link a previous run pinned can go (removing its pin detaches it).
                if pin.exists() {
                    let _ = fs::remove_file(&pin);
                    tracing::info!(
                        device = ifname,
                        hook,
                        "replaced the TCX link with a clsact filter"
                    );
                }
            }
        }
        if tcx {
            // After a switch from clsact filters (a kernel upgrade, --enable-tcx=true): the
            // links run now, so our filters can go.
            detach_clsact(ifindex);
        }
        self.tc_attached.insert(ifindex);
        Ok(())
    }

    /// Detaches the tc programs from interfaces no longer wanted (or gone; `links` are those
    /// there now): removing a pinned TCX link detaches its program.
    pub fn detach_tc_except(&mut self, keep: &BTreeMap<String, u32>, links: &[Link]) -> Vec<String> {
        let Ok(paths) = self.pinned_paths() else {
            return Vec::new();
        };
        let wanted: Vec<PathBuf> = keep.iter().map(|(n, i)| device_dir(&paths, *i, n)).collect();
        let mut removed = Vec::new();
        let keep_ids: std::collections::BTreeSet<u32> = keep.values().copied().collect();
        self.tc_attached.retain(|i| keep_ids.contains(i));
        for (ifindex, dir) in pinned_devices(&paths) {
            if wanted.contains(&dir) {
                continue;
            }
            // Clsact filters are not pinned: the directory records them. Detach them while the
            // interface (the one the directory names, not a newer one with its index) is there.
            let same_interface = links
                .iter()
                .any(|l| l.index == ifindex && device_dir(&paths, l.index, &l.name) == dir);
            if same_interface {
                detach_clsact(ifindex);
            }
            // With TCX, removing the pinned links detaches the programs.
            if fs::remove_dir_all(&dir).is_ok() {
                removed.push(dir.file_name().unwrap_or_default().to_string_lossy().to_string());
            }
        }
        removed
    }

    fn pinned_paths(&self) -> Result<PinPaths, DatapathError> {
        self.paths.clone().ok_or_else(|| DatapathError::Pin {
            path: PathBuf::new(),
            message: "attaching needs a pinned data path (load, not load_unpinned)".into(),
        })
    }
}

/// The clsact filters of kernels without TCX: our own priority and handle on each hook, so that
/// a restarted agent finds its filter and swaps the program in place (cls_bpf replaces it
/// atomically), as `bpf_link_update` does for a pinned TCX link. Priority 1 runs first, as a
/// kube-proxy replacement must (before any filter that could redirect the packet away).
pub const CLSACT_PRIORITY: u16 = 1;
pub const CLSACT_HANDLE: TcHandle = TcHandle::new(0, 0x5ea);

/// Attaches with a TCX link pinned at `pin`, or swaps the program of the link a previous run
/// pinned there.
fn attach_tcx(
    prog: &mut SchedClassifier,
    name: &str,
    ifindex: u32,
    attach_type: TcAttachType,
    pin: &Path,
) -> Result<(), DatapathError> {
    let pin_error = |e: &dyn std::fmt::Display| DatapathError::Pin {
        path: pin.to_path_buf(),
        message: e.to_string(),
    };
    if let Ok(old) = PinnedLink::from_pin(pin) {
        let link = FdLink::from(old)
            .try_into()
            .map_err(|e: aya::programs::links::LinkError| pin_error(&e))?;
        prog.attach_to_link(link)
            .map_err(|source| program_error(name, source))?;
        return Ok(());
    }
    let link_id = prog
        .attach(
            ifindex,
            TcAttach::Tcx {
                attach_type,
                order: LinkOrder::default(),
            },
        )
        .map_err(|source| program_error(name, source))?;
    let link = prog
        .take_link(link_id)
        .map_err(|source| program_error(name, source))?;
    let fd_link = FdLink::try_from(link).map_err(|e| pin_error(&e))?;
    fd_link.pin(pin).map_err(|e| pin_error(&e))?;
    Ok(())
}

/// Attaches as the clsact filter at [`CLSACT_PRIORITY`]/[`CLSACT_HANDLE`], replacing the program
/// of the filter a previous run left there. The filter outlives the agent: its handle is
/// forgotten, never dropped (dropping would detach it).
fn attach_clsact(
    prog: &mut SchedClassifier,
    name: &str,
    ifindex: u32,
    attach_type: TcAttachType,
) -> Result<(), DatapathError> {
    let parent = TcHandle::from(attach_type);
    let existing = SchedClassifierLink::attached(ifindex, parent, CLSACT_PRIORITY, CLSACT_HANDLE, None)
        .map_err(|e| program_error(name, aya::programs::ProgramError::IOError(e)))?;
    let link_id = match prog.attach_to_link(existing) {
        Ok(id) => id,
        // No filter of ours there yet (ENOENT): create it.
        Err(_) => prog
            .attach(
                ifindex,
                TcAttach::Netlink {
                    parent,
                    options: NlOptions {
                        priority: CLSACT_PRIORITY,
                        handle: CLSACT_HANDLE,
                        classid: None,
                    },
                },
            )
            .map_err(|source| program_error(name, source))?,
    };
    let link = prog
        .take_link(link_id)
        .map_err(|source| program_error(name, source))?;
    std::mem::forget(link);
    Ok(())
}

/// Removes our clsact filters from an interface (kernels without TCX, `--enable-tcx=false`) and
/// returns how many there were. Absent filters are not an error: this runs for interfaces that
/// may have none.
pub fn detach_clsact(ifindex: u32) -> usize {
    let mut removed = 0;
    for (program, attach_type, _) in TC_PROGRAMS {
        match tc::qdisc_detach_program(ifindex, attach_type.into(), program) {
            Ok(()) => removed += 1,
            Err(tc::TcError::IoError(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::debug!(ifindex, program, "detaching the clsact filter: {e}"),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interfaces_up_are_the_links_up_but_loopback() {
        let link = |name: &str, index: u32, up: bool, loopback: bool| Link {
            name: name.into(),
            index,
            controller: None,
            bridge_port: false,
            up,
            loopback,
        };
        let links = [
            link("lo", 1, true, true),
            link("eth0", 2, true, false),
            link("eth1", 3, false, false),
            link("veth1a", 5, true, false),
        ];
        assert_eq!(
            interfaces_up(&links),
            BTreeMap::from([("eth0".to_string(), 2), ("veth1a".to_string(), 5)])
        );
    }

    #[test]
    fn device_patterns() {
        let up = BTreeMap::from([
            ("eth0".to_string(), 2),
            ("veth1a".to_string(), 5),
            ("cni0".to_string(), 7),
        ]);
        let none = BTreeSet::new();
        assert_eq!(select_devices(&[], &up, &none).len(), 3);
        // veth1a a port of cni0: the bridge carries the programs, not its port...
        let ports = BTreeSet::from([5]);
        assert_eq!(
            select_devices(&[], &up, &ports)
                .keys()
                .cloned()
                .collect::<Vec<_>>(),
            vec!["cni0", "eth0"]
        );
        // ... unless `--devices` names it.
        let patterns = [DevicePattern::parse("eth0"), DevicePattern::parse("veth+")];
        assert_eq!(
            select_devices(&patterns, &up, &ports)
                .keys()
                .cloned()
                .collect::<Vec<_>>(),
            vec!["eth0", "veth1a"]
        );
        assert!(DevicePattern::parse("lxc*").matches("lxc123"));
        assert!(!DevicePattern::parse("eth0").matches("eth01"));
    }
}
