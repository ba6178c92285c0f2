//! The node's links, from one RTM_GETLINK dump of this network namespace (at a sync that follows a
//! link or address event, `watch_links`, or a sync not caused by a Service change): each link's
//! name, index, state and bridge, as kube-proxy's interface detectors (`--detect-local-mode`
//! BridgeInterface and InterfaceNamePrefix: which links are pod interfaces) and the tc
//! attachment (which links carry the programs) see them.

use std::{
    collections::BTreeSet,
    io,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use netlink_packet_core::NLM_F_DUMP;
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{InfoPortKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// One link of this network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub name: String,
    pub index: u32,
    /// The ifindex of the bridge (or bond) the link is a port of.
    pub controller: Option<u32>,
    /// The link is a bridge's port (its controller's kind is `bridge`).
    pub bridge_port: bool,
    /// Administratively up (`IFF_UP`).
    pub up: bool,
    /// The loopback device (`IFF_LOOPBACK`).
    pub loopback: bool,
}

/// kube-proxy's interface local-traffic detectors: what makes a packet a pod's by the interface
/// it came in by (iptables `-i`, nftables `iif`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InterfaceDetector {
    /// `--pod-bridge-interface`: the pods' bridge. Its ports count too: a pod's packet reaches
    /// tc on its port before the bridge passes it up, where iptables (br_netfilter) sees it
    /// coming in by the bridge.
    Bridge(String),
    /// `--pod-interface-name-prefix`: every interface whose name starts with it (`-i veth+`).
    NamePrefix(String),
}

impl InterfaceDetector {
    /// The ifindexes of the pod interfaces among `links`.
    pub fn pod_interfaces(&self, links: &[Link]) -> BTreeSet<u32> {
        match self {
            InterfaceDetector::Bridge(bridge) => {
                let Some(bridge) = links.iter().find(|l| &l.name == bridge) else {
                    return BTreeSet::new();
                };
                links
                    .iter()
                    .filter(|l| l.index == bridge.index || l.controller == Some(bridge.index))
                    .map(|l| l.index)
                    .collect()
            }
            InterfaceDetector::NamePrefix(prefix) => links
                .iter()
                .filter(|l| l.name.starts_with(prefix.as_str()))
                .map(|l| l.index)
                .collect(),
        }
    }
}

/// Every link of this network namespace (RTM_GETLINK dump).
pub fn links() -> io::Result<Vec<Link>> {
    let socket = crate::netlink::socket(NETLINK_ROUTE)?;
    let mut links = Vec::new();
    let request = RouteNetlinkMessage::GetLink(LinkMessage::default());
    crate::netlink::request(&socket, request, NLM_F_DUMP, |answer| {
        let RouteNetlinkMessage::NewLink(link) = answer else {
            return;
        };
        let mut name = None;
        let mut controller = None;
        let mut bridge_port = false;
        let flags = link.header.flags;
        for attribute in link.attributes {
            match attribute {
                LinkAttribute::IfName(n) => name = Some(n),
                LinkAttribute::Controller(index) => controller = Some(index),
                LinkAttribute::LinkInfo(infos) => {
                    bridge_port = infos
                        .iter()
                        .any(|i| matches!(i, LinkInfo::PortKind(InfoPortKind::Bridge)));
                }
                _ => {}
            }
        }
        if let Some(name) = name {
            links.push(Link {
                name,
                index: link.header.index,
                controller,
                bridge_port,
                up: flags.contains(LinkFlags::Up),
                loopback: flags.contains(LinkFlags::Loopback),
            });
        }
    })
    .map_err(|e| io::Error::new(e.kind(), format!("RTM_GETLINK: {e}")))?;
    Ok(links)
}

/// What the link watcher has seen (`watch_links`): a reader of the node's network dumps it anew
/// only after an event, and at every read while no watcher runs.
#[derive(Clone, Debug, Default)]
pub struct LinkEvents {
    /// Link and address events seen (and dropped batches: ENOBUFS counts as one).
    seen: Arc<AtomicU64>,
    /// A watcher is bound and running.
    watching: Arc<AtomicBool>,
}

impl LinkEvents {
    /// Events counted by hand, as if a watcher ran (tests of readers).
    #[cfg(test)]
    pub fn by_hand() -> Self {
        let events = Self::default();
        events.watching.store(true, Ordering::Release);
        events
    }

    /// One event, counted by hand.
    #[cfg(test)]
    pub fn count_one(&self) {
        self.seen.fetch_add(1, Ordering::AcqRel);
    }

    /// The number of events seen so far, or `None` when no watcher runs (then nothing says the
    /// network is unchanged).
    pub fn generation(&self) -> Option<u64> {
        // Acquire: an event counted here was seen by a watcher bound before the read that follows.
        self.watching
            .load(Ordering::Acquire)
            .then(|| self.seen.load(Ordering::Acquire))
    }
}

/// Counts every link or address event of this network namespace (a link added, removed, or moved
/// to or from a bridge; an address added or removed) in `events`, then calls `on_change`, from a
/// thread of its own, until `on_change` returns false or the socket fails. The agent syncs on it:
/// pod interfaces, tc attachments, NodePort and masquerade addresses follow the links within the
/// minimum sync period, not the sync period; and a sync no event preceded reuses the last dump.
pub fn watch_links(
    events: LinkEvents,
    mut on_change: impl FnMut() -> bool + Send + 'static,
) -> io::Result<std::thread::JoinHandle<()>> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    // Address changes too: the masquerade addresses and NodePort addresses follow them.
    let groups = libc::RTMGRP_LINK | libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR;
    socket.bind(&SocketAddr::new(0, groups as u32))?;
    // Bound before any dump that relies on it: what changes from here on is an event.
    events.watching.store(true, Ordering::Release);
    let thread = std::thread::Builder::new().name("link-watch".into()).spawn({
        let events = events.clone();
        move || {
            let mut datagram = vec![0u8; 64 * 1024];
            loop {
                match socket.recv(&mut &mut datagram[..], 0) {
                    // ENOBUFS: the kernel dropped events; the next sync dumps anew anyway.
                    Ok(_) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
                    Err(e) => {
                        events.watching.store(false, Ordering::Release);
                        tracing::warn!(
                            "watching the links stopped: {e}; they are rescanned at every sync only"
                        );
                        return;
                    }
                }
                events.seen.fetch_add(1, Ordering::AcqRel);
                if !on_change() {
                    events.watching.store(false, Ordering::Release);
                    return;
                }
            }
        }
    });
    if thread.is_err() {
        events.watching.store(false, Ordering::Release);
    }
    thread
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(name: &str, index: u32, controller: Option<u32>) -> Link {
        Link {
            name: name.into(),
            index,
            controller,
            bridge_port: controller.is_some(),
            up: true,
            loopback: false,
        }
    }

    #[test]
    fn a_bridge_and_its_ports_are_pod_interfaces() {
        let links = [
            link("eth0", 2, None),
            link("cbr0", 3, None),
            link("veth1", 4, Some(3)),
            link("veth2", 5, Some(3)),
            link("veth3", 6, Some(9)),
            link("cbr0x", 7, None),
        ];
        let bridge = InterfaceDetector::Bridge("cbr0".into());
        assert_eq!(bridge.pod_interfaces(&links), BTreeSet::from([3, 4, 5]));
        // No such bridge (yet): nothing is a pod's.
        assert!(
            InterfaceDetector::Bridge("cni0".into())
                .pod_interfaces(&links)
                .is_empty()
        );
    }

    #[test]
    fn a_prefix_matches_as_iptables_plus_does() {
        let links = [
            link("eth0", 2, None),
            link("veth", 3, None),
            link("vethab12", 4, None),
            link("vxlan0", 5, None),
            link("cali1234", 6, None),
        ];
        assert_eq!(
            InterfaceDetector::NamePrefix("veth".into()).pod_interfaces(&links),
            BTreeSet::from([3, 4])
        );
        assert_eq!(
            InterfaceDetector::NamePrefix("cali".into()).pod_interfaces(&links),
            BTreeSet::from([6])
        );
    }

    /// A link added in a network namespace of the test's own wakes the watcher there (root only:
    /// the thread unshares its network namespace, which `ip` inherits).
    #[test]
    fn a_new_link_wakes_the_watcher() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root for a network namespace of its own");
            return;
        }
        let woken = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
            let (tx, rx) = std::sync::mpsc::channel();
            let events = LinkEvents::default();
            assert_eq!(events.generation(), None, "no watcher yet");
            watch_links(events.clone(), move || tx.send(()).is_ok()).expect("watching");
            assert_eq!(events.generation(), Some(0), "watching, nothing seen yet");
            let status = std::process::Command::new("ip")
                .args([
                    "link", "add", "lbwatch0", "type", "veth", "peer", "name", "lbwatch1",
                ])
                .status()
                .expect("ip link add");
            assert!(status.success());
            let woken = rx.recv_timeout(std::time::Duration::from_secs(5)).is_ok();
            assert!(
                events.generation() > Some(0),
                "the event is counted before the call"
            );
            let dump = links().expect("dump");
            (woken, dump)
        })
        .join()
        .expect("the namespace's thread");
        assert!(woken.0, "no link event within 5 s");
        assert!(woken.1.iter().any(|l| l.name == "lbwatch0"), "{:?}", woken.1);
    }

    /// A bridge's port is told from a free link by its controller's kind (root only, in a
    /// network namespace of the test's own).
    #[test]
    fn a_bridges_port_is_known_as_one() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root for a network namespace of its own");
            return;
        }
        let dump = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
            let ip = |args: &str| {
                let status = std::process::Command::new("ip")
                    .args(args.split(' '))
                    .status()
                    .expect("ip");
                assert!(status.success(), "ip {args}");
            };
            ip("link add lbbr0 type bridge");
            ip("link add lbport0 type veth peer name lbfree0");
            ip("link set lbport0 master lbbr0");
            links().expect("dump")
        })
        .join()
        .expect("the namespace's thread");
        let port = |name: &str| dump.iter().find(|l| l.name == name).map(|l| l.bridge_port);
        assert_eq!(port("lbport0"), Some(true), "{dump:?}");
        assert_eq!(port("lbfree0"), Some(false), "{dump:?}");
        assert_eq!(port("lbbr0"), Some(false), "{dump:?}");
    }

    /// The dump itself, in this process's network namespace: loopback is always there.
    #[test]
    fn the_dump_lists_loopback() {
        let links = links().expect("RTM_GETLINK dump");
        let lo = links.iter().find(|l| l.name == "lo").expect("lo in the dump");
        assert_eq!(lo.index, 1);
        assert_eq!(lo.controller, None);
        assert!(lo.loopback && lo.up, "{lo:?}");
        assert!(
            links.iter().filter(|l| l.name != "lo").all(|l| !l.loopback),
            "{links:?}"
        );
    }
}
