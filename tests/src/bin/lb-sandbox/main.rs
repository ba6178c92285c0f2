//! The sandbox (README command 1): a small cluster on this machine, for real.
//!
//! - a real etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback;
//! - one real node (kubelet, containerd, runc, the CNI bridge; `lb_tests::kubelet`) running
//!   lb-agent as the DaemonSet of `manifests/`, applied as an operator does: the Deployments a
//!   user creates with kubectl run there, with EndpointSlices from the real controller;
//! - beside it, two fast "nodes" in network namespaces on the same LAN, each running lb-agent as
//!   a process against the API server, each with pods (HTTP on :8080, UDP echo on :5353) behind
//!   veths, in the node's cgroup; every node routes the others' Pod ranges over the LAN;
//! - an external client host on the LAN;
//! - the example Services of `manifests/examples/`, with EndpointSlices the sandbox writes itself
//!   for the netns pods (which are not Pod objects), and LoadBalancer status it fills in;
//! - traffic from a pod and from the external client to every example frontend, from a client on
//!   the real node to the ClusterIP of every Service created while it runs (`kubectl expose`),
//!   and a live table per Service: frontend, backends (pod names) and requests per backend,
//!   errors, whether the client IP was kept.
//!
//! It is dual-stack, IPv4 first: the API server has a Service range of each family, every node
//! (the real one too: kubelet's `--node-ip` and the CNI bridge's IPAM have both families) and pod
//! has an address of each, the agents are told a cluster CIDR of each; a dual-stack Service (the
//! example `web-dual-stack`, or one made so with `kubectl patch`) gets the rows of both families.
//!
//! It runs until Ctrl-C (SIGINT), SIGTERM, SIGHUP or `--duration`, then tears everything down; a
//! run that crashed is cleaned up by the next one (fixed names under `/run/lb-sandbox` and
//! `/tmp/lb-sandbox`, the `lb-sandbox` cgroup and `lbsb-*` namespaces; the real node and the LAN
//! are named after the run's pid and swept by `lb_tests::sweep` once it is dead). It never
//! touches the machine's interfaces or root cgroup.
//!
//! The files: `stop` (the signals, the stop flag, messages that survive a hang-up), `leftovers`
//! (what a crashed run left), `cluster` (the cluster: control plane, nodes, pods, agents),
//! `controllers` (the EndpointSlices and LoadBalancer status the sandbox writes itself),
//! `traffic` (the flows: loads, their tallies, Services followed while it runs), `table` (the
//! live table, the JSON summary, the instructions).

mod cluster;
mod controllers;
mod leftovers;
mod stop;
mod table;
mod traffic;

use std::{
    fs,
    io::{IsTerminal, Write},
    path::PathBuf,
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use clap::Parser;

use self::{
    cluster::{build, wait_for_agents},
    leftovers::clean_leftovers,
    stop::{Interrupted, SIGNAL, STOP, TTY_ERR, TTY_OUT, check_stop, on_signal, say, step},
};

const STATE_DIR: &str = "/run/lb-sandbox";
/// The temporary directory of the control plane and the real node (their data, logs and
/// processes' command lines, by which a later run finds a crashed one's). Not under `/run`,
/// `/var/lib` or `/var/log`, which the real node's mount namespace replaces with its own.
const WORK_DIR: &str = "/tmp/lb-sandbox";
const CGROUP: &str = "lb-sandbox";
const LB_POOL: [u8; 3] = [203, 0, 113];
/// The netns nodes are 1 and 2 (192.168.50.1<i>, Pods in 10.244.<i>.0/24); the real node takes
/// the next index.
const REAL_NODE_INDEX: u8 = 3;
/// The taint that keeps Pods off the netns nodes, which have no kubelet.
const NETNS_TAINT: &str = "node.lb.example/netns";
/// How often the sandbox looks for Services created or deleted while it runs.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

#[derive(Parser)]
#[command(
    name = "lb-sandbox",
    about = "A local cluster (real control plane, one real kubelet node, fast netns nodes) running lb-agent, with live traffic"
)]
struct Args {
    /// Stop after this long (e.g. 60s, 5m); default: until Ctrl-C.
    #[arg(long, value_parser = lb_agent::cli::parse_duration)]
    duration: Option<Duration>,
    /// Folder of example manifests to apply.
    #[arg(long, default_value = "manifests/examples")]
    examples: PathBuf,
    /// Requests per second per traffic flow.
    #[arg(long, default_value_t = 5)]
    rate: u32,
    /// Write the figures of every flow as JSON to this file, every second while running and a
    /// last time at the end (for tests).
    #[arg(long)]
    summary_json: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the sandbox needs root (network namespaces, cgroups, BPF): run `sudo ./x sandbox`");
    }
    TTY_OUT.store(std::io::stdout().is_terminal(), Ordering::SeqCst);
    TTY_ERR.store(std::io::stderr().is_terminal(), Ordering::SeqCst);
    // SAFETY: the handler only uses atomics and async-signal-safe calls.
    unsafe {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
    clean_leftovers();
    let started = Instant::now();
    let built = build(&args).and_then(|mut cluster| {
        wait_for_agents(&mut cluster)?;
        let client = cluster.rt.block_on(cluster.cp.client())?;
        step("driving traffic from a pod and from the external client to every example frontend");
        cluster.start_traffic(&client)?;
        check_stop()?;
        Ok((cluster, client))
    });
    let (mut cluster, client) = match built {
        Ok(built) => built,
        // Everything started so far was dropped on the way out (in this thread). A signal may
        // also have ended a child first (Ctrl-C and a hang-up reach the whole process group):
        // that is a stop too, not a failure.
        Err(e) if e.is::<Interrupted>() || STOP.load(Ordering::SeqCst) => {
            let _ = fs::remove_dir_all(STATE_DIR);
            let _ = fs::remove_dir_all(WORK_DIR);
            step(&format!(
                "stopped while starting (signal {}); everything removed",
                SIGNAL.load(Ordering::SeqCst)
            ));
            return Ok(());
        }
        Err(e) => {
            // The state directory keeps the netns agents' logs for a look; the next run removes
            // it. The control plane and the real node removed their directories.
            let _ = fs::remove_dir(WORK_DIR);
            return Err(e);
        }
    };
    say(&format!("\n{}", cluster.instructions()));
    step(&format!(
        "ready after {:.1}s: the table follows",
        started.elapsed().as_secs_f64()
    ));
    let tty = std::io::stdout().is_terminal();
    let traffic_started = Instant::now();
    let mut last_print = Instant::now() - Duration::from_secs(60);
    let mut last_follow = Instant::now();
    let mut last_summary = Instant::now() - Duration::from_secs(60);
    while !STOP.load(Ordering::SeqCst) && args.duration.is_none_or(|d| traffic_started.elapsed() < d) {
        if last_follow.elapsed() >= FOLLOW_EVERY {
            cluster.follow_services(&client);
            last_follow = Instant::now();
        }
        let every = if tty {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(10)
        };
        if last_print.elapsed() >= every {
            let table = cluster.render(traffic_started.elapsed());
            let mut stdout = std::io::stdout();
            if tty {
                let _ = write!(stdout, "\x1b[2J\x1b[H{table}{}", cluster.instructions());
            } else {
                let _ = writeln!(stdout, "{table}");
            }
            let _ = stdout.flush();
            last_print = Instant::now();
        }
        if let Some(path) = &args.summary_json
            && last_summary.elapsed() >= Duration::from_secs(1)
        {
            cluster.write_summary(path)?;
            last_summary = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // The final table, then an orderly teardown.
    let _ = writeln!(std::io::stdout(), "{}", cluster.render(traffic_started.elapsed()));
    if let Some(path) = &args.summary_json {
        cluster.write_summary(path)?;
    }
    match SIGNAL.load(Ordering::SeqCst) {
        0 => step("tearing down"),
        sig => step(&format!("tearing down (signal {sig})")),
    }
    let teardown = Instant::now();
    for node in &mut cluster.nodes {
        if let Some(agent) = &node.agent {
            agent.signal(libc::SIGTERM);
        }
    }
    drop(cluster);
    let _ = fs::remove_dir_all(STATE_DIR);
    let _ = fs::remove_dir_all(WORK_DIR);
    step(&format!(
        "done after {:.0?} (teardown {:.1}s)",
        Duration::from_secs(started.elapsed().as_secs()),
        teardown.elapsed().as_secs_f64()
    ));
    Ok(())
}
