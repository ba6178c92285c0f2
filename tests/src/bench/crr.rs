//! The traffic side of the benchmarks, run as child processes of lb-bench (re-executed with a
//! hidden subcommand) so that each lives in the network namespace, and for the socket path the
//! cgroup, it measures:
//!
//! - `crr`: the connect-latency client (a port of the reference's `crr.c`): N sequential
//!   connections, each to a uniformly random Service (and, for the floor, a uniformly random
//!   endpoint of it), closed with RST (`SO_LINGER` 0) so no TIME_WAIT piles up. The time of the
//!   blocking `connect()` is SYN to SYN-ACK (plus the local syscall); conn/s is the closed-loop
//!   rate over the whole loop (socket, connect, close).
//! - `serve`: the accept-and-close server that answers every endpoint IP (AnyIP routes), in both
//!   families (one IPv4 and one IPv6-only listener per port, so an IPv4 connection meets the
//!   same listener as in an IPv4-only benchmark).
//! - `probe`: polls one address with short-timeout connects until it answers (or stops
//!   answering), and reports the CLOCK_MONOTONIC time at which the deciding attempt started,
//!   which the parent compares with the time it made the API call (the clock is shared by every
//!   process on the machine). The resolution is one attempt plus the polling interval.
//!
//! Every address is IPv4 or IPv6; a connection uses a socket of its family (an IPv6 one meets
//! the agent's connect6 on the socket path).

use std::{
    fs,
    io::Write,
    net::{SocketAddr, TcpListener},
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use rand::{RngExt, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};
use socket2::{Domain, SockAddr, Socket, Type};

use lb_tests::process::{Place, Proc};

/// CLOCK_MONOTONIC in nanoseconds (the same clock in every process).
pub fn now_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

/// Pins the calling process to one CPU.
pub fn pin_to_cpu(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    let pinned = set
        .set(cpu)
        .and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set));
    if let Err(e) = pinned {
        eprintln!("lb-bench: cannot pin to CPU {cpu}: {e}");
    }
}

/// One TCP connect to `to`, closed with RST. Ok(connect time in ns) or Err(errno).
pub fn connect_once(to: SocketAddr, timeout: Duration) -> Result<u64, i32> {
    let errno = |e: std::io::Error| e.raw_os_error().unwrap_or(libc::EIO);
    let socket = Socket::new(Domain::for_address(to), Type::STREAM.cloexec(), None).map_err(errno)?;
    // Closed with RST: no TIME_WAIT piles up over a run.
    socket.set_linger(Some(Duration::ZERO)).map_err(errno)?;
    // A blocking connect gives up after SO_SNDTIMEO (EINPROGRESS): no run can hang on a lost SYN.
    socket.set_write_timeout(Some(timeout)).map_err(errno)?;
    let to = SockAddr::from(to);
    let t0 = now_ns();
    let r = socket.connect(&to);
    let t1 = now_ns();
    r.map(|()| t1 - t0).map_err(errno)
}

/// Targets: one line per Service, the addresses a connection to it may use (one ClusterIP:port,
/// or, for the floor, every endpoint IP:port).
pub fn write_targets(path: &Path, lines: &[Vec<SocketAddr>]) {
    let mut text = String::new();
    for l in lines {
        let parts: Vec<String> = l.iter().map(ToString::to_string).collect();
        text.push_str(&parts.join(","));
        text.push('\n');
    }
    fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

fn read_targets(path: &str) -> Vec<Vec<SocketAddr>> {
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read {path}: {e}"))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.split(',')
                .map(|a| a.trim().parse().unwrap_or_else(|e| panic!("target {a:?}: {e}")))
                .collect()
        })
        .collect()
}

/// What one `crr` run prints.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CrrResult {
    pub count: usize,
    pub errors: usize,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub mean_us: f64,
    pub conn_per_s: f64,
    #[serde(default)]
    pub first_error: Option<String>,
}

/// `lb-bench crr TARGETS COUNT WARMUP CPU SEED`.
pub fn crr_main(args: &[String]) {
    let [targets, count, warmup, cpu, seed] = args else {
        panic!("usage: lb-bench crr TARGETS COUNT WARMUP CPU SEED");
    };
    let targets = read_targets(targets);
    let count: usize = count.parse().expect("count");
    let warmup: usize = warmup.parse().expect("warmup");
    pin_to_cpu(cpu.parse().expect("cpu"));
    let mut rng = StdRng::seed_from_u64(seed.parse().expect("seed"));
    let timeout = Duration::from_secs(1);
    let pick = |rng: &mut StdRng| {
        let svc = &targets[rng.random_range(0..targets.len())];
        svc[rng.random_range(0..svc.len())]
    };
    for _ in 0..warmup {
        let _ = connect_once(pick(&mut rng), timeout);
    }
    let mut samples = Vec::with_capacity(count);
    let mut errors = 0;
    let mut first_error = None;
    let mut failed_ns = 0;
    let started = now_ns();
    for _ in 0..count {
        let to = pick(&mut rng);
        let t = now_ns();
        match connect_once(to, timeout) {
            Ok(ns) => samples.push(ns),
            Err(e) => {
                errors += 1;
                failed_ns += now_ns() - t;
                first_error.get_or_insert_with(|| format!("{to}: {}", std::io::Error::from_raw_os_error(e)));
            }
        }
    }
    // The rate of the successful connections (a failed one waits for its timeout; it is counted
    // in `errors`, not in the rate).
    let wall = (now_ns() - started - failed_ns) as f64 / 1e9;
    samples.sort_unstable();
    let pct = |p: f64| -> f64 {
        if samples.is_empty() {
            return f64::NAN;
        }
        let idx = ((p * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[idx] as f64 / 1e3
    };
    let result = CrrResult {
        count: samples.len(),
        errors,
        p50_us: pct(0.50),
        p90_us: pct(0.90),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
        mean_us: samples.iter().sum::<u64>() as f64 / samples.len().max(1) as f64 / 1e3,
        conn_per_s: samples.len() as f64 / wall,
        first_error,
    };
    println!("{}", serde_json::to_string(&result).expect("json"));
}

/// `lb-bench serve CPU PORT...`: accept and close, forever (killed by its guard).
pub fn serve_main(args: &[String]) {
    let (cpu, ports) = args.split_first().expect("usage: lb-bench serve CPU PORT...");
    pin_to_cpu(cpu.parse().expect("cpu"));
    let listeners: Vec<TcpListener> = ports
        .iter()
        .flat_map(|p| {
            let port = p.parse().expect("port");
            [listen(port, false), listen(port, true)]
        })
        .collect();
    println!("{{\"ready\":true}}");
    let _ = std::io::stdout().flush();
    let handles: Vec<_> = listeners
        .into_iter()
        .map(|l| {
            std::thread::spawn(move || {
                loop {
                    if let Ok((s, _)) = l.accept() {
                        drop(s);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.join();
    }
}

/// A listener on 0.0.0.0:port, or on [::]:port for IPv6 only (IPV6_V6ONLY: the IPv4 listener
/// keeps every IPv4 connection), with a deep accept queue (std's is 128: a server descheduled
/// for a few ms would drop SYNs, and the client would see a 1 s retransmission).
fn listen(port: u16, ipv6: bool) -> TcpListener {
    let any: SocketAddr = if ipv6 {
        (std::net::Ipv6Addr::UNSPECIFIED, port).into()
    } else {
        (std::net::Ipv4Addr::UNSPECIFIED, port).into()
    };
    let socket = Socket::new(Domain::for_address(any), Type::STREAM.cloexec(), None)
        .unwrap_or_else(|e| panic!("socket: {e}"));
    socket
        .set_reuse_address(true)
        .unwrap_or_else(|e| panic!("SO_REUSEADDR: {e}"));
    if ipv6 {
        socket
            .set_only_v6(true)
            .unwrap_or_else(|e| panic!("IPV6_V6ONLY: {e}"));
    }
    socket
        .bind(&any.into())
        .unwrap_or_else(|e| panic!("bind {any}: {e}"));
    socket.listen(4096).unwrap_or_else(|e| panic!("listen: {e}"));
    socket.into()
}

/// What a probe prints when done.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ProbeResult {
    pub ok: bool,
    /// CLOCK_MONOTONIC ns when the attempt that first showed the wanted state started.
    pub at_ns: u64,
    pub attempts: u64,
    /// With a list of all targets: when every one of them answered.
    pub all_at_ns: Option<u64>,
    pub all_passes: u32,
    pub all_failed: usize,
}

/// `lb-bench probe TO up|down TIMEOUT_MS INTERVAL_US [ALL_TARGETS]`: prints `{"ready":..}` after
/// the first attempt, then the result line.
pub fn probe_main(args: &[String]) {
    let (to, want, timeout_ms, interval_us, all) = match args {
        [a, b, c, d] => (a, b, c, d, None),
        [a, b, c, d, e] => (a, b, c, d, Some(e)),
        _ => panic!("usage: lb-bench probe TO up|down TIMEOUT_MS INTERVAL_US [ALL_TARGETS]"),
    };
    pin_to_cpu(1);
    let to: SocketAddr = to.parse().expect("address");
    let want_up = want == "up";
    let deadline = now_ns() + timeout_ms.parse::<u64>().expect("timeout") * 1_000_000;
    let interval = Duration::from_micros(interval_us.parse().expect("interval"));
    // Waiting for "up", an attempt that times out only delays the answer, so it is short (a
    // dropped SYN, e.g. nftables dropping an unallocated ClusterIP, costs 2 ms, not more);
    // waiting for "down", a slow success must not pass for a failure, so it is longer.
    let attempt_timeout = Duration::from_millis(if want_up { 2 } else { 20 });
    let mut attempts = 0u64;
    let mut result = ProbeResult::default();
    loop {
        attempts += 1;
        // The SYN of this attempt leaves at `sent`: the state it sees held then.
        let sent = now_ns();
        let up = connect_once(to, attempt_timeout).is_ok();
        if attempts == 1 {
            println!("{{\"ready\":true,\"initially_up\":{up}}}");
            let _ = std::io::stdout().flush();
        }
        if up == want_up {
            result.ok = true;
            result.at_ns = sent;
            break;
        }
        if now_ns() > deadline {
            break;
        }
        std::thread::sleep(interval);
    }
    result.attempts = attempts;
    if let (true, Some(all)) = (result.ok, all) {
        let mut pending: Vec<SocketAddr> = read_targets(all).into_iter().flatten().collect();
        loop {
            result.all_passes += 1;
            pending.retain(|t| connect_once(*t, attempt_timeout).is_err());
            if pending.is_empty() {
                result.all_at_ns = Some(now_ns());
                break;
            }
            if now_ns() > deadline {
                result.all_failed = pending.len();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    println!("{}", serde_json::to_string(&result).expect("json"));
}

/// A command re-executing this binary with a hidden subcommand.
pub fn self_command(place: Place<'_>, args: &[String]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped());
    place.apply(&mut cmd);
    cmd
}

/// Runs a `crr` child in `place` and returns what it measured.
pub fn run_crr(place: Place<'_>, targets: &Path, count: usize, warmup: usize, seed: u64) -> CrrResult {
    let args: Vec<String> = vec![
        "crr".into(),
        targets.display().to_string(),
        count.to_string(),
        warmup.to_string(),
        "1".into(),
        seed.to_string(),
    ];
    let out = self_command(place, &args)
        .stderr(Stdio::inherit())
        .output()
        .expect("run the crr client");
    assert!(out.status.success(), "crr client failed: {}", out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("crr printed {text:?}: {e}"))
}

/// Starts the accept-and-close server in `place` (pinned to CPU 0) and waits until it listens.
pub fn start_server(place: Place<'_>, ports: &[u16]) -> Proc {
    let mut args = vec!["serve".to_string(), "0".into()];
    args.extend(ports.iter().map(ToString::to_string));
    let mut proc = Proc::spawn_command(self_command(place, &args));
    proc.wait_for_line(Duration::from_secs(10), |l| l.contains("\"ready\""));
    proc
}

/// A running probe: started, and waited on until it made its first attempt.
pub struct Probe {
    proc: Proc,
    timeout: Duration,
    pub initially_up: bool,
}

impl Probe {
    pub fn start(
        place: Place<'_>,
        to: SocketAddr,
        want_up: bool,
        timeout: Duration,
        interval_us: u64,
        all: Option<&Path>,
    ) -> Probe {
        let mut args = vec![
            "probe".to_string(),
            to.to_string(),
            if want_up { "up" } else { "down" }.into(),
            timeout.as_millis().to_string(),
            interval_us.to_string(),
        ];
        if let Some(all) = all {
            args.push(all.display().to_string());
        }
        let mut proc = Proc::spawn_command(self_command(place, &args));
        let ready = proc.wait_for_line(Duration::from_secs(10), |l| l.contains("\"ready\""));
        Probe {
            proc,
            timeout,
            initially_up: ready.contains("\"initially_up\":true"),
        }
    }

    /// Waits for the result (the probe stops by itself at its timeout).
    pub fn wait(mut self) -> ProbeResult {
        let line = self.proc.wait_for_line_or(
            self.timeout + Duration::from_secs(120),
            |l| l.contains("\"ok\""),
            super::check_interrupted,
        );
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("probe printed {line:?}: {e}"))
    }
}
