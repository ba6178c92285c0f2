//! Step 5 of watch -> model -> plan -> maps -> programs: the eBPF object in the kernel.
//!
//! Loads the embedded object with every map pinned under `<bpf-root>/maps/<name>` (an existing pin
//! is reused, so a restarted agent keeps its state), loads the programs, and attaches them with
//! pinned BPF links under `<bpf-root>/links/`, so the data path keeps running while the agent is
//! down. On restart, a pinned link is adopted and its program replaced atomically
//! (`bpf_link_update`), never detached.

pub mod bpffs;
pub mod cgroup;
pub mod conntrack;
pub mod ct_filter;
pub mod features;
pub mod journal;
pub mod migrate;
pub mod sockets;
pub mod tc;

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    programs::{
        CgroupAttachMode, CgroupSock, CgroupSockAddr, SchedClassifier,
        links::{FdLink, PinnedLink},
    },
};
use lb_common::catalog::{self, Capacities};

pub use self::bpffs::PinPaths;
use crate::{apply::KernelMaps, error::Chain, family::IpFamily};

/// The object built by `cargo xtask build-ebpf`, embedded at build time (empty when built
/// without it).
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf.o"));

/// The socket programs and the cgroup hook each attaches to. The IPv6 hooks also see IPv4
/// traffic of dual-stack sockets (IPv4-mapped addresses), which they translate with the IPv4
/// maps.
pub const SOCK_PROGRAMS: [(&str, &str); 8] = [
    ("lb_connect4", "connect4"),
    ("lb_sendmsg4", "sendmsg4"),
    ("lb_recvmsg4", "recvmsg4"),
    ("lb_getpeername4", "getpeername4"),
    ("lb_connect6", "connect6"),
    ("lb_sendmsg6", "sendmsg6"),
    ("lb_recvmsg6", "recvmsg6"),
    ("lb_getpeername6", "getpeername6"),
];

/// Frees a closing socket's slot of `lb4_sock_conn` (its connected reverse NAT); attached beside
/// [`SOCK_PROGRAMS`] at the cgroup hook `sock_release`.
pub const SOCK_RELEASE_PROGRAM: (&str, &str) = ("lb_sock_release", "sock_release");

/// The trace harness (runs the socket code under BPF_PROG_TEST_RUN).
pub const SOCK_TRACE_PROGRAM: &str = "lb_sock_trace";

/// Finds the agent's network namespace cookie on kernels without `SO_NETNS_COOKIE`; loaded and
/// attached only then (`Datapath::probe_netns_cookie`).
pub const NETNS_PROBE_PROGRAM: &str = "lb_probe_netns";

/// Why the data path cannot be loaded or attached. Each variant's message includes its cause
/// (flattened with [`Chain`]) and none returns it from `source()`, so that the cause is printed
/// once, in a plain `{e}` as in anyhow's `{:#}`.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error(
        "this lb-agent was built without its eBPF object: run `cargo xtask build-ebpf` and rebuild, or pass --bpf-object"
    )]
    NoObject,
    #[error("reading the eBPF object {path}: {error}")]
    ReadObject { path: PathBuf, error: io::Error },
    #[error("--bpf-root {path}: {error}")]
    Bpffs { path: PathBuf, error: io::Error },
    #[error(
        "pinned map {name} no longer matches this agent ({detail}); its layout or capacity changed. \
         Run `lb-agent cleanup` (drops flow state) or restart with the previous capacities"
    )]
    IncompatiblePin { name: String, detail: String },
    #[error("loading the eBPF object: {}{hint}", Chain(.error))]
    Load {
        error: aya::EbpfError,
        hint: &'static str,
    },
    #[error(
        "program {program}: the kernel's verifier (Linux {kernel}) rejected it ({errno}); this is not \
         a permission problem but a limit of this kernel's verifier, and the last lines of its log \
         say which:\n{last_lines}\nRun `cargo xtask kernel-test --kernel <version>` to reproduce; \
         docs/kernels.md lists the kernels this object is verified on"
    )]
    Verifier {
        program: String,
        kernel: String,
        errno: io::Error,
        last_lines: String,
    },
    #[error("program {name}: {}{hint}", Chain(.error))]
    Program {
        name: String,
        error: aya::programs::ProgramError,
        hint: &'static str,
    },
    #[error("cgroup {path}: {error}")]
    Cgroup { path: PathBuf, error: io::Error },
    #[error("pinning {path}: {message}")]
    Pin { path: PathBuf, message: String },
    #[error("{0}")]
    Kernel(String),
    #[error("maps: {}{hint}", Chain(.error))]
    Maps {
        error: aya::maps::MapError,
        hint: &'static str,
    },
}

impl From<aya::maps::MapError> for DatapathError {
    fn from(error: aya::maps::MapError) -> Self {
        let hint = hint_for(&format!("{error:?}"));
        DatapathError::Maps { error, hint }
    }
}

/// Suggests the likely cause of a kernel refusal: EPERM (missing capabilities) or EACCES (the
/// pins or the bpffs belong to root), or a missing kernel feature.
fn hint_for(message: &str) -> &'static str {
    if message.contains("Operation not permitted")
        || message.contains("EPERM")
        || message.contains("Permission denied")
        || message.contains("EACCES")
    {
        " (permission denied: the agent needs root, or CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON with \
         access to the pins under --bpf-root)"
    } else if message.contains("Invalid argument")
        || message.contains("not supported")
        || message.contains("524")
    {
        " (the kernel may lack a needed feature: BTF, cgroup sock_addr hooks, bpf_link; see `bpftool feature probe`)"
    } else {
        ""
    }
}

/// The last lines of the verifier's log when `BPF_PROG_LOAD` failed because the verifier rejected
/// the program: it answers EACCES (or EINVAL, E2BIG, ...) with a log. EPERM is a missing
/// capability whatever the log says, and a failure without a log is not the verifier's.
fn verifier_rejection(errno: &io::Error, log: &str) -> Option<String> {
    if errno.raw_os_error() == Some(libc::EPERM) {
        return None;
    }
    let lines: Vec<&str> = log
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect();
    if lines.is_empty() {
        return None;
    }
    let tail = &lines[lines.len().saturating_sub(VERIFIER_LINES)..];
    Some(
        tail.iter()
            .map(|l| format!("  {l}"))
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

/// Where the object comes from and what it is called.
pub fn object_bytes(path: Option<&Path>) -> Result<std::borrow::Cow<'static, [u8]>, DatapathError> {
    match path {
        Some(path) => {
            fs::read(path)
                .map(std::borrow::Cow::Owned)
                .map_err(|error| DatapathError::ReadObject {
                    path: path.to_path_buf(),
                    error,
                })
        }
        None if OBJECT.is_empty() => Err(DatapathError::NoObject),
        None => Ok(std::borrow::Cow::Borrowed(OBJECT)),
    }
}

/// A loaded object.
pub struct Datapath {
    ebpf: Ebpf,
    /// Where the SCTP program stands ([`Datapath::serve_sctp`]).
    sctp: Sctp,
    paths: Option<PinPaths>,
    /// Old pins to remove once the new programs are attached.
    migration: migrate::Migration,
    /// Interfaces this process attached the tc programs to (they are not touched again).
    tc_attached: std::collections::BTreeSet<u32>,
    /// Attach the tc programs with TCX links (else as clsact filters): the kernel has TCX and
    /// `--enable-tcx` is not false.
    tcx: bool,
    /// What this start changed under the bpf root, undone if it is dropped before
    /// [`Datapath::commit_start`] (declared last: dropped after the maps and programs).
    journal: Option<journal::StartJournal>,
}

impl Datapath {
    /// Loads the object with its maps pinned under `paths` (reusing existing pins) and the
    /// programs verified and ready to attach.
    /// Until [`Datapath::commit_start`], dropping it (or a failure here) undoes what it changed
    /// under the root (`journal`).
    pub fn load(paths: &PinPaths, caps: &Capacities, object: &[u8]) -> Result<Self, DatapathError> {
        let mut journal = journal::StartJournal::begin(&paths.root);
        bpffs::prepare(paths, &mut journal).map_err(|error| DatapathError::Bpffs {
            path: paths.root.clone(),
            error,
        })?;
        let migration = migrate::prepare(paths, caps, &mut journal)?;
        let pin_paths: Vec<(&'static str, PathBuf)> =
            catalog::ALL.iter().map(|n| (*n, paths.map(n))).collect();
        let mut loader = EbpfLoader::new();
        for (name, path) in &pin_paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = Self::load_with(&mut loader, caps, object)?;
        migrate::copy_entries(&migration, &mut ebpf);
        Ok(Self {
            ebpf,
            sctp: Sctp::NotLoaded,
            paths: Some(paths.clone()),
            migration,
            tc_attached: Default::default(),
            tcx: features::current().is_ok_and(|f| f.tcx),
            journal: Some(journal),
        })
    }

    /// The programs are attached: the maps and pins this start made are the node's data path, no
    /// longer undone when the agent stops.
    pub fn commit_start(&mut self) {
        if let Some(mut journal) = self.journal.take() {
            journal.commit();
        }
    }

    /// Loads the object with private, unpinned maps (trace against manifests, tests).
    pub fn load_unpinned(caps: &Capacities, object: &[u8]) -> Result<Self, DatapathError> {
        let ebpf = Self::load_with(&mut EbpfLoader::new(), caps, object)?;
        Ok(Self {
            ebpf,
            sctp: Sctp::NotLoaded,
            paths: None,
            migration: migrate::Migration::default(),
            tc_attached: Default::default(),
            tcx: features::current().is_ok_and(|f| f.tcx),
            journal: None,
        })
    }

    /// Loads the object for `trace` against a running agent: the service-state maps are the live
    /// pinned ones (read-only to the programs), while conntrack, socket reverse NAT, affinity and
    /// counters are private, so a traced packet leaves no state behind.
    pub fn load_for_trace(paths: &PinPaths, object: &[u8]) -> Result<Self, DatapathError> {
        let shared = [
            catalog::SERVICES,
            catalog::BACKENDS,
            catalog::REVNAT,
            catalog::SOURCE_RANGES,
            catalog::SERVICES6,
            catalog::BACKENDS6,
            catalog::REVNAT6,
            catalog::SOURCE_RANGES6,
            catalog::SVC_NAMES,
            catalog::AFFINITY_MATCH,
            catalog::CONFIG,
            // The interface detector's pod interfaces, and the interfaces' masquerade addresses,
            // beside the config that turns each on.
            catalog::POD_INTERFACES,
            catalog::MASQ_ADDRS,
            // The programs trust the pinned config's PREFILTER flag only with the bits beside it.
            catalog::PREFILTER,
            catalog::PREFILTER6,
            catalog::MAGLEV,
        ];
        let capacity = |name: &str| -> Result<u32, DatapathError> {
            Ok(aya::maps::MapInfo::from_pin(paths.map(name))?.max_entries())
        };
        let caps = Capacities {
            services: capacity(catalog::SERVICES)?,
            backends: capacity(catalog::BACKENDS)?,
            revnat: capacity(catalog::REVNAT)?,
            affinity_match: capacity(catalog::AFFINITY_MATCH)?,
            source_ranges: capacity(catalog::SOURCE_RANGES)?,
            sock_revnat: 4096,
            affinity: 4096,
            conntrack: 4096,
            conntrack_new: 4096,
        };
        // Maps an agent of an earlier release did not pin (nor set their flags for): shared when
        // pinned, never pinned here.
        let newer = [
            catalog::PREFILTER,
            catalog::PREFILTER6,
            catalog::POD_INTERFACES,
            catalog::MASQ_ADDRS,
            catalog::MAGLEV,
        ];
        let pins: Vec<(&'static str, PathBuf)> = shared
            .iter()
            .map(|n| (*n, paths.map(n)))
            .filter(|(n, p)| !newer.contains(n) || p.try_exists().unwrap_or(false))
            .collect();
        let mut loader = EbpfLoader::new();
        for (name, path) in &pins {
            loader.map_pin_path(name, path.as_path());
        }
        // The egress flow filters as their control word alone (off: every packet takes the full
        // path, as a filter's missing word makes it): 2 MiB each that a trace inside the agent's
        // container would add to its memory limit, beside the agent's own.
        for name in [catalog::CT_FILTER, catalog::CT_FILTER6] {
            loader.map_max_entries(name, 1);
        }
        let ebpf = Self::load_with(&mut loader, &caps, object)?;
        Ok(Self {
            ebpf,
            sctp: Sctp::NotLoaded,
            paths: None,
            migration: migrate::Migration::default(),
            tc_attached: Default::default(),
            tcx: features::current().is_ok_and(|f| f.tcx),
            journal: None,
        })
    }

    fn load_with(
        loader: &mut EbpfLoader<'_>,
        caps: &Capacities,
        object: &[u8],
    ) -> Result<Ebpf, DatapathError> {
        for family in IpFamily::ALL {
            let maps = family.maps();
            loader
                .map_max_entries(maps.services, caps.services)
                .map_max_entries(maps.backends, caps.backends)
                .map_max_entries(maps.revnat, caps.revnat)
                .map_max_entries(maps.sock_revnat, caps.sock_revnat)
                .map_max_entries(maps.affinity, caps.affinity)
                .map_max_entries(maps.source_ranges, caps.source_ranges)
                .map_max_entries(maps.conntrack, caps.conntrack)
                .map_max_entries(maps.conntrack_new, caps.conntrack_new)
                .map_max_entries(
                    maps.cluster_ips,
                    caps.revnat
                        .saturating_add(lb_common::cluster_ip::SERVICE_CIDR_ROOM),
                );
        }
        // Reverse-NAT ids of both families (`apply::ids::family_ranges`).
        loader
            .map_max_entries(catalog::SVC_NAMES, caps.revnat.saturating_mul(2))
            .map_max_entries(catalog::MAGLEV, caps.revnat.saturating_mul(2))
            .map_max_entries(catalog::AFFINITY_MATCH, caps.affinity_match);
        // The kernel's features decide which branches the programs keep (`lb_common::features`).
        let features = features::current().map_err(|e| DatapathError::Kernel(e.to_string()))?;
        loader.override_global(lb_common::features::GLOBAL, &features.program_bits, true);
        let mut ebpf = loader.load(object).map_err(|error| match error {
            aya::EbpfError::MapError(aya::maps::MapError::IncompatiblePinnedMap {
                name,
                property,
                expected,
                actual,
            }) => DatapathError::IncompatiblePin {
                name,
                detail: format!("{property} is {actual}, expected {expected}"),
            },
            error => {
                let hint = hint_for(&format!("{error:?}"));
                DatapathError::Load { error, hint }
            }
        })?;
        for (name, _) in SOCK_PROGRAMS {
            let prog: &mut CgroupSockAddr = program(&mut ebpf, name)?;
            prog.load().map_err(|source| program_error(name, source))?;
        }
        let (name, _) = SOCK_RELEASE_PROGRAM;
        let prog: &mut CgroupSock = program(&mut ebpf, name)?;
        prog.load().map_err(|source| program_error(name, source))?;
        for name in [SOCK_TRACE_PROGRAM, tc::TC_PROGRAMS[0].0, tc::TC_PROGRAMS[1].0] {
            let prog: &mut SchedClassifier = program(&mut ebpf, name)?;
            prog.load().map_err(|source| program_error(name, source))?;
        }
        Ok(ebpf)
    }

    /// Loads the SCTP programs (`lb_tc_sctp_in`, `lb_tc_sctp_out`) into their tail-call slots,
    /// unless done already: before the first SCTP frontend is written. Their verification
    /// (~0.4-0.6M steps, about a second) is paid only where SCTP is served. Returns the kernel's
    /// refusal, if it refused either: both slots are then emptied and SCTP passes untranslated,
    /// counted as `tc_unsupported_protocol`, while TCP and UDP are served; the planner reports
    /// each SCTP port (`NodeSettings::sctp_refused`).
    pub fn serve_sctp(&mut self) -> Result<Option<&str>, DatapathError> {
        if let Sctp::NotLoaded = self.sctp {
            self.sctp = match load_sctp(&mut self.ebpf) {
                Ok(()) => Sctp::Serving,
                // The slot emptied: SCTP passes untranslated, counted.
                Err(refusal @ (DatapathError::Verifier { .. } | DatapathError::Program { .. })) => {
                    clear_sctp_slots(&mut self.ebpf)?;
                    Sctp::Refused(refusal.to_string())
                }
                Err(other) => return Err(other),
            };
        }
        Ok(self.sctp_refused())
    }

    /// Whether [`Datapath::serve_sctp`] has run (loaded or refused).
    pub fn sctp_decided(&self) -> bool {
        !matches!(self.sctp, Sctp::NotLoaded)
    }

    /// Empties the SCTP program's slot while this start serves no SCTP: a program an earlier
    /// start left there (pinned) must not run on beside this start's maps and programs.
    pub fn retire_sctp(&mut self) -> Result<(), DatapathError> {
        if let Sctp::NotLoaded = self.sctp {
            clear_sctp_slots(&mut self.ebpf)?;
        }
        Ok(())
    }

    /// Why this kernel refused the SCTP program, if it did ([`Datapath::serve_sctp`]).
    pub fn sctp_refused(&self) -> Option<&str> {
        match &self.sctp {
            Sctp::Refused(reason) => Some(reason),
            _ => None,
        }
    }

    /// Runs on as a load whose kernel refused the SCTP program for `reason` does (its tail-call
    /// slot emptied, the reason kept): for tests of a node without SCTP, since no kernel this
    /// object is verified on refuses it.
    #[doc(hidden)]
    pub fn refuse_sctp(&mut self, reason: &str) -> Result<(), DatapathError> {
        clear_sctp_slots(&mut self.ebpf)?;
        self.sctp = Sctp::Refused(reason.to_string());
        Ok(())
    }

    /// `--enable-tcx=false`: attach the tc programs as clsact filters even where the kernel has
    /// TCX (as on kernels before 6.6). Returns whether TCX is used.
    pub fn enable_tcx(&mut self, enabled: bool) -> bool {
        self.tcx = enabled && features::current().is_ok_and(|f| f.tcx);
        self.tcx
    }

    /// Whether maps were migrated at load (their old pins go once the programs are replaced).
    pub fn migrating(&self) -> bool {
        !self.migration.is_empty()
    }

    /// Removes the pins of migrated maps: call after the new programs are attached.
    pub fn finish_migration(&mut self) {
        self.migration.finish();
    }

    /// The map writer's handles (taken out of the object; call once).
    pub fn take_maps(&mut self) -> Result<KernelMaps, DatapathError> {
        Ok(KernelMaps::from_ebpf(&mut self.ebpf)?)
    }

    /// Takes the tc path's conntrack maps out of the object (for the conntrack GC).
    pub fn take_conntrack(&mut self) -> Result<conntrack::ConntrackMaps, DatapathError> {
        let mut take = |name: &str| {
            self.ebpf
                .take_map(name)
                .ok_or_else(|| aya::maps::MapError::InvalidName {
                    name: name.to_string(),
                })
        };
        let filters = (|| -> Result<ct_filter::CtFilters, Box<dyn std::error::Error>> {
            Ok(ct_filter::CtFilters {
                v4: ct_filter::CtFilter::new(take(catalog::CT_FILTER)?)?,
                v6: ct_filter::CtFilter::new(take(catalog::CT_FILTER6)?)?,
            })
        })();
        let filters = match filters {
            Ok(filters) => Some(filters),
            Err(e) => {
                tracing::warn!(
                    "the egress flow filter stays off (every packet of a backend takes the conntrack lookups): {e}"
                );
                None
            }
        };
        Ok(conntrack::ConntrackMaps {
            v4: take(catalog::CONNTRACK)?.try_into()?,
            v6: take(catalog::CONNTRACK6)?.try_into()?,
            new_v4: take(catalog::CONNTRACK_NEW)?.try_into()?,
            new_v6: take(catalog::CONNTRACK_NEW6)?.try_into()?,
            filters,
        })
    }

    /// The trace harness program.
    pub fn sock_trace(&mut self) -> Result<&mut SchedClassifier, DatapathError> {
        program(&mut self.ebpf, SOCK_TRACE_PROGRAM)
    }

    /// Attaches the socket programs to `cgroup` (a cgroup v2 directory) with pinned links,
    /// adopting links pinned by a previous run, and detaches links a previous run pinned for
    /// another cgroup once the new ones are in place.
    pub fn attach_cgroup(&mut self, cgroup: &Path) -> Result<(), DatapathError> {
        let paths = self.paths.clone().ok_or_else(|| DatapathError::Pin {
            path: PathBuf::new(),
            message: "attaching needs a pinned data path (load, not load_unpinned)".into(),
        })?;
        cgroup::check_cgroup2_dir(cgroup).map_err(|error| DatapathError::Cgroup {
            path: cgroup.into(),
            error,
        })?;
        let id = cgroup::cgroup_id(cgroup).map_err(|error| DatapathError::Cgroup {
            path: cgroup.into(),
            error,
        })?;
        let dir = cgroup_links_dir(&paths, id);
        fs::create_dir_all(&dir).map_err(|e| DatapathError::Pin {
            path: dir.clone(),
            message: e.to_string(),
        })?;
        let cgroup_file = fs::File::open(cgroup).map_err(|error| DatapathError::Cgroup {
            path: cgroup.into(),
            error,
        })?;
        for (name, hook) in SOCK_PROGRAMS {
            let pin = dir.join(hook);
            let prog: &mut CgroupSockAddr = program(&mut self.ebpf, name)?;
            match PinnedLink::from_pin(&pin) {
                Ok(old) => {
                    // Atomic replacement of the running program; the link and its pin stay.
                    let link =
                        FdLink::from(old)
                            .try_into()
                            .map_err(|e: aya::programs::links::LinkError| DatapathError::Pin {
                                path: pin.clone(),
                                message: e.to_string(),
                            })?;
                    prog.attach_to_link(link)
                        .map_err(|source| program_error(name, source))?;
                    tracing::debug!(program = name, pin = %pin.display(), "adopted pinned link");
                }
                Err(_) => attach_pinned!(prog, &cgroup_file, name, &pin),
            }
        }
        attach_release(&mut self.ebpf, &dir, &cgroup_file)?;
        // Make-before-break: only now drop links a previous run made for another cgroup.
        for stale in cgroup_link_dirs(&paths).into_iter().filter(|d| *d != dir) {
            tracing::info!(dir = %stale.display(), "detaching socket programs from a previous cgroup root");
            let _ = fs::remove_dir_all(&stale);
        }
        Ok(())
    }
}

/// Attaches `lb_sock_release` to the cgroup open as `cgroup_file` with a link pinned in `dir`, or
/// replaces the program of the link a previous run pinned there, atomically as for the other
/// socket programs (aya offers that for sock_addr links only: [`replace_link_program`]).
fn attach_release(ebpf: &mut Ebpf, dir: &Path, cgroup_file: &fs::File) -> Result<(), DatapathError> {
    let (name, hook) = SOCK_RELEASE_PROGRAM;
    let pin = dir.join(hook);
    let prog: &mut CgroupSock = program(ebpf, name)?;
    if pin.exists() {
        let prog_fd = prog.fd().map_err(|source| program_error(name, source))?;
        replace_link_program(&pin, std::os::fd::AsFd::as_fd(prog_fd)).map_err(|e| DatapathError::Pin {
            path: pin.clone(),
            message: format!("replacing the link's program: {e}"),
        })?;
        tracing::debug!(program = name, pin = %pin.display(), "adopted pinned link");
        return Ok(());
    }
    attach_pinned!(prog, cgroup_file, name, &pin);
    Ok(())
}

/// `BPF_LINK_UPDATE` of the link pinned at `pin`: `prog` runs in place of its program from the
/// next call on, with no moment where neither runs.
fn replace_link_program(pin: &Path, prog: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use std::os::{fd::AsRawFd, unix::ffi::OsStrExt};
    // `enum bpf_cmd` of linux/bpf.h.
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_LINK_UPDATE: libc::c_long = 29;
    /// `BPF_OBJ_GET`'s attributes (`path_fd`, Linux 6.5, must be 0 before), padded explicitly:
    /// the kernel refuses any non-zero byte past the fields it knows.
    #[repr(C)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        _pad: u32,
    }
    /// `BPF_LINK_UPDATE`'s attributes (no flags: replace whatever program the link runs).
    #[repr(C)]
    struct LinkUpdate {
        link_fd: u32,
        new_prog_fd: u32,
        flags: u32,
        old_prog_fd: u32,
    }
    let path = std::ffi::CString::new(pin.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let get = ObjGet {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
        path_fd: 0,
        _pad: 0,
    };
    // SAFETY: ObjGet is BPF_OBJ_GET's layout; `path` lives through the call.
    let link = unsafe { features::bpf(BPF_OBJ_GET, &get) }
        .map_err(|e| io::Error::new(e.kind(), format!("opening the pinned link: {e}")))?;
    let update = LinkUpdate {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: prog.as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    // SAFETY: LinkUpdate is BPF_LINK_UPDATE's layout; both descriptors are open. The command
    // answers 0, not a descriptor, hence the direct call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_UPDATE,
            &raw const update,
            std::mem::size_of::<LinkUpdate>(),
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("BPF_LINK_UPDATE: {e}")));
    }
    Ok(())
}

/// Attaches the cgroup program `$prog` (sock_addr or sock: aya's types share no trait) to the
/// cgroup open as `$cgroup` with a new link pinned at `$pin`. A cgroup bpf_link always coexists
/// with other programs (the kernel attaches links as BPF_F_ALLOW_MULTI and refuses explicit
/// flags), hence Single.
macro_rules! attach_pinned {
    ($prog:expr, $cgroup:expr, $name:expr, $pin:expr) => {{
        let link_id = $prog
            .attach($cgroup, CgroupAttachMode::Single)
            .map_err(|source| program_error($name, source))?;
        let link = $prog
            .take_link(link_id)
            .map_err(|source| program_error($name, source))?;
        pin_link(link, $pin)?;
        tracing::debug!(program = $name, pin = %$pin.display(), "attached and pinned link");
    }};
}
use attach_pinned;

/// Pins a new cgroup link at `pin`: it stays attached while the pin exists.
fn pin_link<L>(link: L, pin: &Path) -> Result<(), DatapathError>
where
    L: TryInto<FdLink, Error = aya::programs::links::LinkError>,
{
    let pin_error = |message: String| DatapathError::Pin {
        path: pin.to_path_buf(),
        message,
    };
    let fd_link: FdLink = link.try_into().map_err(|e| pin_error(e.to_string()))?;
    fd_link.pin(pin).map_err(|e| pin_error(e.to_string()))?;
    Ok(())
}

/// One program of the object as this kernel's verifier accepted it (`Datapath::verify_programs`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct VerifiedProgram {
    pub name: String,
    /// Instructions after the verifier's rewrites (8 bytes each).
    pub instructions: u32,
    /// Instructions the verifier walked (kernel >= 5.16; its limit is 1,000,000).
    pub verified_instructions: Option<u32>,
}

impl Datapath {
    /// Loads the programs the agent loads only on demand, then reports every program of the
    /// object as the kernel holds it: proof that this kernel's verifier accepts all of them
    /// (`lb-agent kernel`, the kernel matrix).
    pub fn verify_programs(&mut self) -> Result<Vec<VerifiedProgram>, DatapathError> {
        let probe: &mut CgroupSockAddr = program(&mut self.ebpf, NETNS_PROBE_PROGRAM)?;
        if probe.fd().is_err() {
            probe
                .load()
                .map_err(|source| program_error(NETNS_PROBE_PROGRAM, source))?;
        }
        if let Some(refusal) = self.serve_sctp()? {
            return Err(DatapathError::Kernel(refusal.to_string()));
        }
        let mut verified = Vec::new();
        for (name, prog) in self.ebpf.programs() {
            let info = prog.info().map_err(|source| program_error(name, source))?;
            verified.push(VerifiedProgram {
                name: name.to_string(),
                instructions: info.size_translated().unwrap_or(0) / 8,
                verified_instructions: info.verified_instruction_count(),
            });
        }
        verified.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(verified)
    }
}

impl Datapath {
    /// The network namespace cookie of this process on kernels without `SO_NETNS_COOKIE`:
    /// `lb_probe_netns` is attached to `cgroup` for one UDP connect() of a socket whose cookie it
    /// looks for, then detached (`lb_common::features::NetnsProbe`). `None` when this process is
    /// not inside `cgroup`'s tree (the program never saw the socket).
    pub fn probe_netns_cookie(&mut self, cgroup: &Path) -> Result<Option<u64>, DatapathError> {
        use lb_common::features::NetnsProbe;
        const SO_COOKIE: libc::c_int = 57;
        let io_error = |error: io::Error| DatapathError::Cgroup {
            path: cgroup.into(),
            error,
        };
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").map_err(io_error)?;
        let socket_cookie = features::socket_option_u64(&socket, SO_COOKIE).map_err(io_error)?;
        let mut probe: aya::maps::Array<_, NetnsProbe> =
            aya::maps::Array::try_from(self.ebpf.map_mut(catalog::NETNS_PROBE).ok_or_else(|| {
                aya::maps::MapError::InvalidName {
                    name: catalog::NETNS_PROBE.to_string(),
                }
            })?)?;
        probe.set(
            0,
            &NetnsProbe {
                socket_cookie,
                netns_cookie: 0,
            },
            0,
        )?;
        let cgroup_file = fs::File::open(cgroup).map_err(io_error)?;
        let prog: &mut CgroupSockAddr = program(&mut self.ebpf, NETNS_PROBE_PROGRAM)?;
        if prog.fd().is_err() {
            prog.load()
                .map_err(|source| program_error(NETNS_PROBE_PROGRAM, source))?;
        }
        let link = prog
            .attach(&cgroup_file, CgroupAttachMode::Single)
            .map_err(|source| program_error(NETNS_PROBE_PROGRAM, source))?;
        // A UDP connect() sends nothing; the discard port on loopback is never a frontend.
        let connected = socket.connect("127.0.0.1:9");
        let detached = prog.detach(link);
        connected.map_err(io_error)?;
        detached.map_err(|source| program_error(NETNS_PROBE_PROGRAM, source))?;
        let found =
            aya::maps::Array::<_, NetnsProbe>::try_from(self.ebpf.map(catalog::NETNS_PROBE).ok_or_else(
                || aya::maps::MapError::InvalidName {
                    name: catalog::NETNS_PROBE.to_string(),
                },
            )?)?
            .get(&0, 0)?;
        Ok((found.netns_cookie != 0).then_some(found.netns_cookie))
    }
}

fn cgroup_links_dir(paths: &PinPaths, cgroup_id: u64) -> PathBuf {
    paths.links().join(format!("cgroup-{cgroup_id}"))
}

/// Link directories of every cgroup we attached to.
pub fn cgroup_link_dirs(paths: &PinPaths) -> Vec<PathBuf> {
    fs::read_dir(paths.links())
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("cgroup-"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// One BPF_PROG_TEST_RUN of a tc program.
#[derive(Clone, Debug)]
pub struct TcRun {
    /// The program's return value (TC_ACT_*).
    pub action: i32,
    /// The packet as the program left it.
    pub packet: Vec<u8>,
    /// `__sk_buff.cb` as the program left it (see `lb_common::trace::tc`).
    pub cb: [u32; 5],
    /// `__sk_buff.mark` as the program left it.
    pub mark: u32,
    /// Mean run time per repetition, as measured by the kernel.
    pub duration: std::time::Duration,
}

impl Datapath {
    /// Runs a tc program (`lb_tc_ingress`, `lb_tc_egress`, `lb_sock_trace`) on `packet` with
    /// BPF_PROG_TEST_RUN. With `repeat > 1` every run after the first sees the packet as the
    /// previous run left it.
    pub fn test_run_tc(&mut self, name: &str, packet: &[u8], repeat: u32) -> Result<TcRun, DatapathError> {
        self.test_run_tc_ctx(name, packet, repeat, 0, 0)
    }

    /// A map of this load, by name (`trace` reads what its private maps recorded).
    pub fn map(&self, name: &str) -> Option<&aya::maps::Map> {
        self.ebpf.map(name)
    }

    /// A map of this load, by name, to write (tests: `lb_monitor`).
    pub fn map_mut(&mut self, name: &str) -> Option<&mut aya::maps::Map> {
        self.ebpf.map_mut(name)
    }

    /// Turns the egress flow filters on (`lb_common::ct_filter`) in maps that hold no flow yet,
    /// where no rebuild is needed for them to be complete: a scratch load, whose programs then
    /// filter as a running agent's do.
    pub fn activate_fresh_ct_filters(&mut self) -> Result<(), DatapathError> {
        for name in [catalog::CT_FILTER, catalog::CT_FILTER6] {
            let map = self
                .ebpf
                .map_mut(name)
                .ok_or_else(|| aya::maps::MapError::InvalidName { name: name.into() })?;
            let mut array: aya::maps::Array<&mut aya::maps::MapData, u64> = map.try_into()?;
            let mut control = [0u8; 8];
            control[lb_common::ct_filter::CONTROL_ACTIVE] = 1;
            array.set(lb_common::ct_filter::CONTROL, &u64::from_ne_bytes(control), 0)?;
        }
        Ok(())
    }

    /// Like `test_run_tc`, for a packet that came in by interface `ingress_ifindex` (kernels
    /// before 5.15 refuse to set it: EINVAL).
    pub fn test_run_tc_from(
        &mut self,
        name: &str,
        packet: &[u8],
        ingress_ifindex: u32,
    ) -> Result<TcRun, DatapathError> {
        self.test_run_tc_ctx(name, packet, 1, 0, ingress_ifindex)
    }

    /// Like `test_run_tc`, for a packet carrying `skb->mark` (egress after an ingress that set it).
    pub fn test_run_tc_with_mark(
        &mut self,
        name: &str,
        packet: &[u8],
        mark: u32,
    ) -> Result<TcRun, DatapathError> {
        self.test_run_tc_ctx(name, packet, 1, mark, 0)
    }

    fn test_run_tc_ctx(
        &mut self,
        name: &str,
        packet: &[u8],
        repeat: u32,
        mark: u32,
        ingress_ifindex: u32,
    ) -> Result<TcRun, DatapathError> {
        use aya::programs::{TestRun, TestRunOptions};
        use lb_common::trace::tc::{SKB_CB_OFFSET, SKB_CTX_LEN, SKB_INGRESS_IFINDEX_OFFSET, SKB_MARK_OFFSET};
        let prog: &mut SchedClassifier = program(&mut self.ebpf, name)?;
        // Room for a packet that grows (an ICMP error built from a short packet).
        let mut out = vec![0u8; packet.len() + 256];
        let mut ctx_in = [0u8; SKB_CTX_LEN];
        ctx_in[SKB_MARK_OFFSET..SKB_MARK_OFFSET + 4].copy_from_slice(&mark.to_ne_bytes());
        ctx_in[SKB_INGRESS_IFINDEX_OFFSET..SKB_INGRESS_IFINDEX_OFFSET + 4]
            .copy_from_slice(&ingress_ifindex.to_ne_bytes());
        let mut ctx_out = [0u8; SKB_CTX_LEN];
        let opts = TestRunOptions {
            data_in: Some(packet),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx_in),
            ctx_out: Some(&mut ctx_out),
            repeat: repeat.max(1),
            ..TestRunOptions::default()
        };
        let result = prog
            .test_run(opts)
            .map_err(|source| program_error(name, source))?;
        out.truncate(result.data_size_out as usize);
        let mut cb = [0u32; 5];
        for (i, slot) in cb.iter_mut().enumerate() {
            let at = SKB_CB_OFFSET + 4 * i;
            *slot = u32::from_ne_bytes([ctx_out[at], ctx_out[at + 1], ctx_out[at + 2], ctx_out[at + 3]]);
        }
        let mark = u32::from_ne_bytes([
            ctx_out[SKB_MARK_OFFSET],
            ctx_out[SKB_MARK_OFFSET + 1],
            ctx_out[SKB_MARK_OFFSET + 2],
            ctx_out[SKB_MARK_OFFSET + 3],
        ]);
        Ok(TcRun {
            action: result.return_value as i32,
            packet: out,
            cb,
            mark,
            duration: result.duration,
        })
    }
}

/// How many lines of a verifier log an error quotes: the verdict is in the last ones.
const VERIFIER_LINES: usize = 12;

/// Where the SCTP program stands: loaded only once SCTP is served ([`Datapath::serve_sctp`]).
enum Sctp {
    NotLoaded,
    Serving,
    Refused(String),
}

/// Loads the SCTP programs and puts each in its tail call's slot, in a pinned map: programs still
/// attached from an earlier start reach this start's SCTP programs as soon as they are loaded.
/// Both or neither: the egress one's flows need the ingress one for their replies.
fn load_sctp(ebpf: &mut Ebpf) -> Result<(), DatapathError> {
    let mut loaded = Vec::new();
    for (name, _) in tc::SCTP_PROGRAMS {
        let sctp: &mut SchedClassifier = program(ebpf, name)?;
        sctp.load().map_err(|source| program_error(name, source))?;
        let fd = sctp
            .fd()
            .and_then(|fd| fd.try_clone().map_err(Into::into))
            .map_err(|source| program_error(name, source))?;
        loaded.push(fd);
    }
    let mut slots = tail_calls(ebpf)?;
    // The ingress program first: the egress one's flows have their replies there.
    for ((_, slot), fd) in tc::SCTP_PROGRAMS.iter().zip(&loaded) {
        slots.set(*slot, fd, 0)?;
    }
    Ok(())
}

/// Empties the SCTP programs' slots (the egress one first, whose flows need the ingress one).
fn clear_sctp_slots(ebpf: &mut Ebpf) -> Result<(), DatapathError> {
    for (_, slot) in tc::SCTP_PROGRAMS.iter().rev() {
        clear_tail_slot(ebpf, *slot)?;
    }
    Ok(())
}

/// Empties a tail call's slot: a program an earlier start put there (pinned) must not keep
/// running beside this start's maps and programs.
fn clear_tail_slot(ebpf: &mut Ebpf, slot: u32) -> Result<(), DatapathError> {
    match tail_calls(ebpf)?.clear_index(&slot) {
        Ok(()) => Ok(()),
        // Already empty.
        Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

fn tail_calls(ebpf: &mut Ebpf) -> Result<aya::maps::ProgramArray<&mut aya::maps::MapData>, DatapathError> {
    let tail = ebpf
        .map_mut(catalog::TC_TAIL)
        .ok_or_else(|| aya::maps::MapError::InvalidName {
            name: catalog::TC_TAIL.to_string(),
        })?;
    Ok(aya::maps::ProgramArray::try_from(tail)?)
}

pub(crate) fn program_error(name: &str, error: aya::programs::ProgramError) -> DatapathError {
    if let aya::programs::ProgramError::LoadError {
        io_error,
        verifier_log,
    } = &error
        && let Some(last_lines) = verifier_rejection(io_error, &verifier_log.to_string())
    {
        return DatapathError::Verifier {
            program: name.to_string(),
            kernel: features::current().map_or_else(|_| "(unknown)".to_string(), |f| f.release.clone()),
            errno: io::Error::from_raw_os_error(io_error.raw_os_error().unwrap_or(libc::EINVAL)),
            last_lines,
        };
    }
    let hint = hint_for(&format!("{error:?}"));
    DatapathError::Program {
        name: name.to_string(),
        error,
        hint,
    }
}

pub(crate) fn program<'a, T>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut T, DatapathError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    let prog = ebpf.program_mut(name).ok_or_else(|| DatapathError::Program {
        name: name.to_string(),
        error: aya::programs::ProgramError::UnexpectedProgramType,
        hint: " (not in the object: is the object out of date? run `cargo xtask build-ebpf`)",
    })?;
    prog.try_into().map_err(|source| program_error(name, source))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG_6_1: &str = "func#0 @0\n0: R1=ctx(off=0,imm=0) R10=fp0\n\ncombined stack size of 3 calls is 560. Too large\nverification time 4518638 usec\nstack depth 8+248+224\nprocessed 658461 insns (limit 1000000) max_states_per_insn 49\n";

    #[test]
    fn a_verifier_rejection_quotes_the_log_and_never_blames_permissions() {
        let errno = io::Error::from_raw_os_error(libc::EACCES);
        let error = aya::programs::ProgramError::LoadError {
            io_error: io::Error::from_raw_os_error(libc::EACCES),
            verifier_log: aya_obj::VerifierLog::new(LOG_6_1.to_string()),
        };
        let tail = verifier_rejection(&errno, LOG_6_1).expect("a rejection");
        assert!(tail.contains("combined stack size of 3 calls is 560"), "{tail}");
        let message = program_error("lb_tc_ingress", error).to_string();
        assert!(
            message.starts_with("program lb_tc_ingress: the kernel's verifier"),
            "{message}"
        );
        assert!(message.contains("processed 658461 insns"), "{message}");
        assert!(!message.contains("CAP_BPF"), "{message}");
    }

    #[test]
    fn a_long_log_is_cut_to_its_last_lines() {
        let log: String = (0..500).map(|i| format!("line {i}\n")).collect();
        let tail = verifier_rejection(&io::Error::from_raw_os_error(libc::EINVAL), &log).unwrap();
        assert_eq!(tail.lines().count(), VERIFIER_LINES);
        assert!(tail.ends_with("line 499"), "{tail}");
    }

    #[test]
    fn eperm_or_no_log_keeps_the_capability_hint() {
        assert_eq!(
            verifier_rejection(&io::Error::from_raw_os_error(libc::EPERM), LOG_6_1),
            None
        );
        assert_eq!(
            verifier_rejection(&io::Error::from_raw_os_error(libc::EACCES), "\n  \n"),
            None
        );
        let error = aya::programs::ProgramError::LoadError {
            io_error: io::Error::from_raw_os_error(libc::EPERM),
            verifier_log: aya_obj::VerifierLog::new(String::new()),
        };
        assert!(
            program_error("lb_connect4", error)
                .to_string()
                .contains("CAP_BPF")
        );
    }
}
