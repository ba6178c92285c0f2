//! What the running kernel can do for the data path, found before anything is loaded, pinned or
//! attached. One eBPF object serves every supported kernel:
//!
//! - a kernel older than [`MINIMUM_KERNEL`] (the oldest one `cargo xtask kernel-test` passes on),
//!   or one without a feature that every supported kernel has, is refused with the name of what
//!   is missing and the kernel that brought it;
//! - a feature with a fallback is announced at start-up with what changes without it. The
//!   program-side ones go into the object's `LB_FEATURES` global (`lb_common::features`), which
//!   the verifier reads as a constant, so the programs take the fallback branch.
//!
//! Every answer comes from the kernel itself (a probe program, a probe syscall), never from its
//! version number alone: distribution kernels backport features.

use std::{fmt, io, os::fd::AsRawFd, sync::OnceLock};

use aya::{
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_program_supported},
    util::KernelVersion,
};
use lb_common::features as bits;
use serde::Serialize;

/// The oldest kernel the kernel matrix (`cargo xtask kernel-test`) passes on: Debian 11's 5.10.
/// Older kernels are refused at start-up.
pub const MINIMUM_KERNEL: (u8, u8) = (5, 10);

/// One kernel feature and whether this kernel has it.
#[derive(Clone, Debug, Serialize)]
pub struct Feature {
    /// What it is, as an operator would search for it.
    pub name: &'static str,
    /// The upstream kernel that brought it.
    pub since: &'static str,
    pub present: bool,
    /// What the agent does without it; `None` when it cannot run without it.
    pub fallback: Option<&'static str>,
}

/// What the probes found.
#[derive(Clone, Debug, Serialize)]
pub struct KernelFeatures {
    /// `uname -r`.
    pub release: String,
    /// The version the release parses to, when it does.
    #[serde(skip)]
    pub version: Option<KernelVersion>,
    pub features: Vec<Feature>,
    /// `bpf_set_retval` in cgroup sock_addr programs (5.18).
    pub set_retval: bool,
    /// `bpf_ktime_get_coarse_ns` in tc programs (5.11).
    pub ktime_coarse: bool,
    /// TCX: tc programs attached with BPF links (6.6); else clsact filters.
    pub tcx: bool,
    /// `getsockopt(SO_NETNS_COOKIE)` (5.14); else the `lb_probe_netns` program finds it.
    pub netns_cookie_sockopt: bool,
    /// The `LB_FEATURES` bits for the programs (`lb_common::features`).
    pub program_bits: u32,
}

/// Why the agent cannot run on this kernel.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Unsupported {
    #[error(
        "Linux {release} is older than {}.{}, the oldest kernel this data path is tested on \
         (`cargo xtask kernel-test`); upgrade the node's kernel",
        MINIMUM_KERNEL.0,
        MINIMUM_KERNEL.1
    )]
    TooOld { release: String },
    #[error(
        "Linux {release} lacks {name} (Linux {since} or later, or a kernel built with it); \
         the data path cannot run without it"
    )]
    Missing {
        release: String,
        name: &'static str,
        since: &'static str,
    },
    #[error(
        "probing the kernel's BPF features: {error} (the agent needs root, or CAP_BPF, \
         CAP_NET_ADMIN and CAP_PERFMON)"
    )]
    Probe { error: String },
}

const SET_RETVAL: &str = "bpf_set_retval in cgroup socket programs";
const KTIME_COARSE: &str = "bpf_ktime_get_coarse_ns in tc programs";
const TCX: &str = "TCX (tc programs attached with BPF links)";
const NETNS_COOKIE: &str = "getsockopt(SO_NETNS_COOKIE)";

impl KernelFeatures {
    /// Probes the running kernel (a few dozen syscalls).
    pub fn probe() -> Result<Self, Unsupported> {
        let release = nix::sys::utsname::uname()
            .map(|u| u.release().to_string_lossy().into_owned())
            .unwrap_or_default();
        let version = KernelVersion::current().ok();
        // With its causes: "`bpf_prog_load` failed: Operation not permitted (os error 1)".
        let probe_err = |error: &(dyn std::error::Error + 'static)| Unsupported::Probe {
            error: crate::error::Chain(error).to_string(),
        };
        let program = |t: ProgramType| is_program_supported(t).map_err(|e| probe_err(&e));
        let helper = |t: ProgramType, h: BpfHelper| is_helper_supported(t, h).map_err(|e| probe_err(&e));
        let sock_addr = program(ProgramType::CgroupSockAddr)?;
        let sched_cls = program(ProgramType::SchedClassifier)?;
        let required = |name, since, present| Feature {
            name,
            since,
            present,
            fallback: None,
        };
        let mut features = vec![
            required(
                "cgroup socket address programs (CONFIG_CGROUP_BPF)",
                "4.17",
                sock_addr,
            ),
            required("tc classifier programs (CONFIG_NET_CLS_BPF)", "4.1", sched_cls),
            required(
                "bpf_get_netns_cookie in cgroup socket programs",
                "5.7",
                sock_addr && helper(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_get_netns_cookie)?,
            ),
            required(
                "socket storage in cgroup socket programs (bpf_sk_storage_get)",
                "5.10",
                sock_addr && helper(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_sk_storage_get)?,
            ),
        ];
        let set_retval = sock_addr && helper(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval)?;
        let ktime_coarse = sched_cls
            && helper(
                ProgramType::SchedClassifier,
                BpfHelper::BPF_FUNC_ktime_get_coarse_ns,
            )?;
        let tcx = probe_tcx().map_err(|e| probe_err(&e))?;
        let netns_cookie_sockopt = match own_netns_cookie() {
            Ok(_) => true,
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => false,
            Err(e) => {
                return Err(Unsupported::Probe {
                    error: format!("getsockopt(SO_NETNS_COOKIE): {e}"),
                });
            }
        };
        features.extend([
            Feature {
                name: SET_RETVAL,
                since: "5.18",
                present: set_retval,
                fallback: Some(
                    "a connect() or sendmsg() to a Service without endpoints (kube-proxy's REJECT) \
                     or one kube-proxy drops fails with EPERM instead of ECONNREFUSED or \
                     EHOSTUNREACH",
                ),
            },
            Feature {
                name: KTIME_COARSE,
                since: "5.11",
                present: ktime_coarse,
                fallback: Some("connection tracking reads the same clock with bpf_ktime_get_ns"),
            },
            Feature {
                name: TCX,
                since: "6.6",
                present: tcx,
                fallback: Some(
                    "the tc programs are filters of a clsact qdisc (replaced in place on restart, \
                     removed by `lb-agent cleanup`)",
                ),
            },
            Feature {
                name: NETNS_COOKIE,
                since: "5.14",
                present: netns_cookie_sockopt,
                fallback: Some(
                    "the node's network namespace is identified at start-up by a probe program on \
                     --cgroup-root (the agent must run inside that cgroup tree, as the DaemonSet does)",
                ),
            },
        ]);
        Ok(KernelFeatures {
            release,
            version,
            features,
            set_retval,
            ktime_coarse,
            tcx,
            netns_cookie_sockopt,
            program_bits: program_bits(set_retval, ktime_coarse),
        })
    }

    /// Whether the kernel's version is known and before `major.minor`.
    pub fn older_than(&self, major: u8, minor: u8) -> bool {
        self.version
            .is_some_and(|v| v < KernelVersion::new(major, minor, 0))
    }

    /// Refuses a kernel the data path cannot run on.
    pub fn check(&self) -> Result<(), Unsupported> {
        let (major, minor) = MINIMUM_KERNEL;
        if self.older_than(major, minor) {
            return Err(Unsupported::TooOld {
                release: self.release.clone(),
            });
        }
        match self.features.iter().find(|f| f.fallback.is_none() && !f.present) {
            Some(f) => Err(Unsupported::Missing {
                release: self.release.clone(),
                name: f.name,
                since: f.since,
            }),
            None => Ok(()),
        }
    }

    /// The features this kernel lacks and what the agent does instead.
    pub fn fallbacks(&self) -> impl Iterator<Item = (&Feature, &'static str)> {
        self.features
            .iter()
            .filter(|f| !f.present)
            .filter_map(|f| f.fallback.map(|fallback| (f, fallback)))
    }
}

/// The `LB_FEATURES` bits for the programs.
fn program_bits(set_retval: bool, ktime_coarse: bool) -> u32 {
    let mut out = 0;
    if set_retval {
        out |= bits::SET_RETVAL;
    }
    if ktime_coarse {
        out |= bits::KTIME_COARSE;
    }
    out
}

/// `bpf_get_netns_cookie()` of the calling thread's network namespace, from
/// `getsockopt(SO_NETNS_COOKIE)` (5.14; ENOPROTOOPT before). Older kernels:
/// `Datapath::probe_netns_cookie`.
pub fn own_netns_cookie() -> io::Result<u64> {
    let sock =
        std::net::UdpSocket::bind("127.0.0.1:0").or_else(|_| std::net::UdpSocket::bind("0.0.0.0:0"))?;
    const SO_NETNS_COOKIE: libc::c_int = 71;
    socket_option_u64(&sock, SO_NETNS_COOKIE)
}

/// A `u64` socket option of `SOL_SOCKET` (`SO_COOKIE`, `SO_NETNS_COOKIE`).
pub fn socket_option_u64(sock: &impl AsRawFd, option: libc::c_int) -> io::Result<u64> {
    let mut value: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `value`.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&raw mut value).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(value)
}

/// The running kernel's features, probed once per process.
pub fn current() -> Result<&'static KernelFeatures, Unsupported> {
    static PROBED: OnceLock<Result<KernelFeatures, Unsupported>> = OnceLock::new();
    PROBED
        .get_or_init(KernelFeatures::probe)
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether the kernel has TCX. A TCX link to an interface that does not exist fails with ENODEV
/// on a kernel that knows the attach type and with EINVAL on one that does not (the probe
/// cilium/ebpf uses): nothing is attached either way.
fn probe_tcx() -> io::Result<bool> {
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_LINK_CREATE: libc::c_long = 28;
    const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
    const BPF_TCX_INGRESS: u32 = 46;
    /// `union bpf_attr` for BPF_PROG_LOAD, up to the fields this probe sets.
    #[repr(C)]
    #[derive(Default)]
    struct ProgLoad {
        prog_type: u32,
        insn_cnt: u32,
        insns: u64,
        license: u64,
        log_level: u32,
        log_size: u32,
        log_buf: u64,
        kern_version: u32,
        prog_flags: u32,
    }
    /// `union bpf_attr` for BPF_LINK_CREATE.
    #[repr(C)]
    #[derive(Default)]
    struct LinkCreate {
        prog_fd: u32,
        target_ifindex: u32,
        attach_type: u32,
        flags: u32,
        /// `tcx.relative_fd`, `tcx.expected_revision` (zero: no ordering, any revision).
        relative: u32,
        _pad: u32,
        expected_revision: u64,
    }
    // r0 = 0 (TC_ACT_OK); exit
    let insns: [u64; 2] = [0x0000_0000_0000_00b7, 0x0000_0000_0000_0095];
    let license = c"GPL";
    let load = ProgLoad {
        prog_type: BPF_PROG_TYPE_SCHED_CLS,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        ..ProgLoad::default()
    };
    // SAFETY: the attr is the kernel's BPF_PROG_LOAD layout; the pointers it holds live for the
    // call.
    let prog = unsafe { bpf(BPF_PROG_LOAD, &load) }?;
    let link = LinkCreate {
        prog_fd: prog.as_raw_fd() as u32,
        // No interface has this index (ifindex is a positive int).
        target_ifindex: i32::MAX as u32,
        attach_type: BPF_TCX_INGRESS,
        ..LinkCreate::default()
    };
    // SAFETY: as above, for BPF_LINK_CREATE.
    let rc = unsafe { bpf(BPF_LINK_CREATE, &link) };
    match rc {
        // Cannot happen (no such interface); the link's descriptor closes as it drops.
        Ok(_link) => Ok(true),
        Err(e) => match e.raw_os_error() {
            Some(libc::ENODEV) | Some(libc::ENXIO) => Ok(true),
            Some(libc::EINVAL) => Ok(false),
            _ => Err(e),
        },
    }
}

/// The bpf(2) system call with `attr`; the new descriptor it returns is owned by the result.
///
/// # Safety
/// `attr` must be the kernel's layout for `cmd`, and every pointer in it valid for the call.
pub(super) unsafe fn bpf<T>(cmd: libc::c_long, attr: &T) -> io::Result<std::os::fd::OwnedFd> {
    // SAFETY: the caller's contract.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *const T, std::mem::size_of::<T>()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(rc as i32) })
}

impl fmt::Display for KernelFeatures {
    /// The table `lb-agent kernel` prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = match self.check() {
            Ok(()) if self.fallbacks().next().is_none() => "supported".to_string(),
            Ok(()) => "supported, with the fallbacks below".to_string(),
            Err(e) => format!("NOT SUPPORTED: {e}"),
        };
        writeln!(f, "Linux {}: {verdict}", self.release)?;
        writeln!(
            f,
            "(minimum {}.{}: the oldest kernel `cargo xtask kernel-test` passes on)\n",
            MINIMUM_KERNEL.0, MINIMUM_KERNEL.1
        )?;
        writeln!(f, "{:<64} {:>6}  {:<8} WITHOUT IT", "FEATURE", "SINCE", "PRESENT")?;
        for feature in &self.features {
            let without = match (feature.present, feature.fallback) {
                (true, _) => "",
                (false, Some(fallback)) => fallback,
                (false, None) => "the agent refuses to start",
            };
            let row = format!(
                "{:<64} {:>6}  {:<8} {without}",
                feature.name,
                feature.since,
                if feature.present { "yes" } else { "no" }
            );
            writeln!(f, "{}", row.trim_end())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features(release: &str, version: KernelVersion, missing: &[&str]) -> KernelFeatures {
        let feature = |name, fallback| Feature {
            name,
            since: "x",
            present: !missing.contains(&name),
            fallback,
        };
        KernelFeatures {
            release: release.into(),
            version: Some(version),
            features: vec![
                feature("required", None),
                feature(SET_RETVAL, Some("EPERM")),
                feature(TCX, Some("clsact")),
            ],
            set_retval: !missing.contains(&SET_RETVAL),
            ktime_coarse: true,
            tcx: !missing.contains(&TCX),
            netns_cookie_sockopt: true,
            program_bits: program_bits(!missing.contains(&SET_RETVAL), true),
        }
    }

    #[test]
    fn refuses_old_kernels_and_missing_required_features() {
        let old = features("5.4.0-150-generic", KernelVersion::new(5, 4, 0), &[]);
        let e = old.check().unwrap_err().to_string();
        assert!(
            e.contains("5.4.0-150-generic") && e.contains("older than 5.10"),
            "{e}"
        );

        let minimum = features("5.10.0-46-amd64", KernelVersion::new(5, 10, 0), &[]);
        minimum.check().expect("5.10 is supported");

        let stripped = features("6.1.0", KernelVersion::new(6, 1, 0), &["required"]);
        let e = stripped.check().unwrap_err().to_string();
        assert!(
            e.contains("lacks required") && e.contains("Linux x or later"),
            "{e}"
        );
    }

    #[test]
    fn fallbacks_are_listed_and_become_program_bits() {
        let k = features("6.1.0", KernelVersion::new(6, 1, 0), &[SET_RETVAL, TCX]);
        k.check().expect("fallbacks do not refuse");
        let names: Vec<_> = k.fallbacks().map(|(f, _)| f.name).collect();
        assert_eq!(names, [SET_RETVAL, TCX]);
        assert_eq!(k.program_bits, bits::KTIME_COARSE);
        let table = k.to_string();
        assert!(table.contains("supported, with the fallbacks below"), "{table}");
        assert!(table.contains("EPERM"), "{table}");

        let modern = features("6.18.0", KernelVersion::new(6, 18, 0), &[]);
        assert_eq!(modern.program_bits, bits::SET_RETVAL | bits::KTIME_COARSE);
        assert!(modern.to_string().starts_with("Linux 6.18.0: supported\n"));
    }
}
