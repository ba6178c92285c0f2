//! What each upstream image is made of besides its program: the Debian packages (and the
//! release they come from), the links their maintainer scripts or the Dockerfile would make,
//! the users and groups of the image it mirrors, and the programs run in its root at build time
//! with what they must print.

use super::{debs::DebSet, steps::Step};
use crate::k8s::AGNHOST_VERSION;

/// What agnhost's Dockerfile installs with `apk add` (bind-tools curl netcat-openbsd iproute2
/// iperf bash util-linux-misc socat), as Debian bookworm packages, and what Alpine's base gives
/// the specs' shell commands that BusyBox does not.
const AGNHOST_PACKAGES: &[&str] = &[
    "bind9-dnsutils", // dig, nslookup
    "curl",
    "netcat-openbsd", // nc
    "iproute2",       // ip, ss
    "iperf",
    "bash",
    "util-linux", // ipcs
    "socat",
    "dash",     // /bin/sh
    "libc-bin", // getent (the DNS specs run `getent hosts`; musl-utils on Alpine)
    "netbase",  // /etc/services, /etc/protocols (alpine-baselayout-data)
];

/// Debian's suites of one release (the same mirror and lists as the kernels' private apt).
const BOOKWORM: &[&str] = &["bookworm", "bookworm-updates", "bookworm-security"];
const TRIXIE: &[&str] = &["trixie", "trixie-updates", "trixie-security"];

pub(super) const AGNHOST_DEBS: DebSet = DebSet {
    name: "agnhost-bookworm",
    suites: BOOKWORM,
    packages: AGNHOST_PACKAGES,
    versions: &[],
};

/// BusyBox 1.37, as the busybox:1.37.0 image the e2e busybox image mirrors (and Alpine 3.21's).
pub(super) const BUSYBOX_DEBS: DebSet = DebSet {
    name: "busybox-static-trixie",
    suites: TRIXIE,
    packages: &["busybox-static"],
    versions: &[("busybox-static", "1:1.37.0-")],
};
/// Where `busybox-static` has the binary.
pub(super) const BUSYBOX_IN_DEB: &str = "usr/bin/busybox";

/// What the maintainer scripts of agnhost's packages would link (`nc` by netcat-openbsd's
/// update-alternatives; bookworm's dash ships `/bin/sh -> dash` itself), and the Dockerfile's
/// `/usr/local/bin/iperf` and `/agnhost-2`.
pub(super) const AGNHOST_LINKS: &[(&str, &str)] = &[
    ("bin/nc", "nc.openbsd"),
    ("bin/netcat", "nc.openbsd"),
    ("usr/local/bin/iperf", "/usr/bin/iperf"),
    ("agnhost-2", "agnhost"),
];

const NSSWITCH: &str = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n\
                        protocols: files\nservices: files\nethers: files\nrpc: files\n";

/// Alpine's root and nobody, and what the Dockerfile's adduser/addgroup make.
pub(super) const AGNHOST_PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                              user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n\
                              nobody:x:65534:65534:nobody:/:/sbin/nologin\n";
pub(super) const AGNHOST_GROUP: &str = "root:x:0:root\nuser-defined-in-image:x:1000:\n\
                             group-defined-in-image:x:50000:user-defined-in-image\nnobody:x:65534:\n";

/// The official busybox image's (buildroot's) users and groups.
pub(super) const BUSYBOX_PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                              daemon:x:1:1:daemon:/usr/sbin:/bin/false\n\
                              bin:x:2:2:bin:/bin:/bin/false\n\
                              sys:x:3:3:sys:/dev:/bin/false\n\
                              sync:x:4:100:sync:/bin:/bin/sync\n\
                              mail:x:8:8:mail:/var/spool/mail:/bin/false\n\
                              www-data:x:33:33:www-data:/var/www:/bin/false\n\
                              operator:x:37:37:Operator:/var:/bin/false\n\
                              nobody:x:65534:65534:nobody:/home:/bin/false\n";
pub(super) const BUSYBOX_GROUP: &str = "root:x:0:\ndaemon:x:1:\nbin:x:2:\nsys:x:3:\nadm:x:4:\ntty:x:5:\ndisk:x:6:\n\
                             lp:x:7:\nmail:x:8:\nkmem:x:9:\nwheel:x:10:root\ncdrom:x:11:\ndialout:x:18:\n\
                             floppy:x:19:\nvideo:x:28:\naudio:x:29:\ntape:x:32:\nwww-data:x:33:\n\
                             operator:x:37:\nutmp:x:43:\nplugdev:x:46:\nstaff:x:50:\nlock:x:54:\n\
                             netdev:x:82:\nusers:x:100:\nnogroup:x:65534:\n";

/// distroless/static's users and groups (CoreDNS' base).
pub(super) const DISTROLESS_PASSWD: &str = "root:x:0:0:root:/root:/sbin/nologin\n\
                                 nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n\
                                 nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n";
pub(super) const DISTROLESS_GROUP: &str =
    "root:x:0:\nnobody:x:65534:\ntty:x:5:\nstaff:x:50:\nnonroot:x:65532:\n";

pub(super) const ROOT_PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n";
pub(super) const ROOT_GROUP: &str = "root:x:0:\n";

/// A program run in an image's root at build time, and what its output must contain.
pub(super) type Check = (&'static [&'static str], &'static str);

pub(super) const AGNHOST_CHECKS: &[Check] = &[
    (&["/agnhost", "--version"], AGNHOST_VERSION),
    (&["/agnhost-2", "--version"], AGNHOST_VERSION),
    (&["/coredns", "-version"], "CoreDNS-"),
    (&["/bin/sh", "-c", "echo shell; seq 2 | cat"], "shell\n1\n2\n"),
    (&["bash", "--version"], "GNU bash"),
    (&["curl", "--version"], "libcurl/"),
    (&["dig", "-v"], "DiG 9."),
    (&["nslookup", "-version"], "nslookup 9."),
    (&["nc", "-h"], "OpenBSD netcat"),
    (&["ip", "-V"], "iproute2"),
    (&["ss", "-V"], "iproute2"),
    (&["iperf", "-v"], "iperf version 2"),
    (&["/usr/local/bin/iperf", "-v"], "iperf version 2"),
    (&["ipcs", "-V"], "util-linux"),
    (&["socat", "-V"], "socat version"),
    (
        &["getent", "passwd", "user-defined-in-image"],
        "user-defined-in-image:x:1000:1000:",
    ),
    (&["id", "-G", "user-defined-in-image"], "1000 50000"),
    (&["wget", "--help"], "Usage: wget"),
];

pub(super) const BUSYBOX_CHECKS: &[Check] = &[
    (&["/bin/sh", "-c", "echo shell; seq 2 | cat"], "shell\n1\n2\n"),
    (&["/bin/busybox"], "BusyBox v1.37.0"),
    (&["wget", "--help"], "Usage: wget"),
    (&["nslookup", "--help"], "Usage: nslookup"),
    (&["/usr/bin/env", "id", "-u", "nobody"], "65534"),
];

pub(super) const COREDNS_CHECKS: &[Check] = &[(&["/coredns", "-version"], "CoreDNS-")];
pub(super) const PAUSE_CHECKS: &[Check] = &[(&["/pause", "-v"], "pause.c v")];

/// /etc/passwd, /etc/group and /etc/nsswitch.conf.
pub(super) fn etc(passwd: &'static str, group: &'static str) -> [Step; 3] {
    let text = |path, text| Step::Text {
        path,
        mode: 0o644,
        text,
    };
    [
        text("etc/passwd", passwd),
        text("etc/group", group),
        text("etc/nsswitch.conf", NSSWITCH),
    ]
}
