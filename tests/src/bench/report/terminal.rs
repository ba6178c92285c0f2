//! The compact text tables printed at the end of a run.

use std::fmt::Write as _;

use super::{
    Results,
    stats::{median, mib, num, opt_s, percentile},
    targets::targets,
};
use crate::bench::peers::Config;

/// Compact text tables for the terminal.
pub fn summary(r: &Results) -> String {
    let mut s = String::new();
    let levels = r.levels();
    let _ = writeln!(
        s,
        "\n==== connect latency p50 / p99 µs (median over {} rounds) and conn/s ====",
        r.rounds
    );
    for &n in &levels {
        let _ = writeln!(s, "N = {n}");
        for family in r.latency_families() {
            for c in r.measured_configs() {
                let q = |f: fn(&crate::bench::crr::CrrResult) -> f64| {
                    median(&r.lat_in(family, n, c, f)).map(num).unwrap_or_default()
                };
                let _ = writeln!(
                    s,
                    "  {:<22} {}  p50 {:>8}  p99 {:>8}  p99.9 {:>8}  {:>8} conn/s",
                    c.label(),
                    family.name(),
                    q(|x| x.p50_us),
                    q(|x| x.p99_us),
                    q(|x| x.p999_us),
                    q(|x| x.conn_per_s),
                );
            }
        }
    }
    let _ = writeln!(s, "==== programming through the API ====");
    for p in &r.programming {
        let _ = writeln!(
            s,
            "  {:<20} N={:<6} created {:>8}  last answers {:>10}  all answer {:>10}",
            p.config.map(Config::program).unwrap_or(""),
            p.n,
            opt_s(Some(p.create_s)),
            opt_s(p.last_s),
            opt_s(p.all_s)
        );
    }
    let _ = writeln!(s, "==== one change on top of N (p50 / p99 ms) ====");
    for c in &r.changes {
        let f = |v: &[f64]| {
            format!(
                "{} / {}",
                percentile(v, 0.5).map(num).unwrap_or_default(),
                percentile(v, 0.99).map(num).unwrap_or_default()
            )
        };
        let _ = writeln!(
            s,
            "  {:<20} N={:<6} add {}  change {}  remove {}",
            c.config.map(Config::program).unwrap_or(""),
            c.n,
            f(&c.add_ms),
            f(&c.change_ms),
            f(&c.remove_ms)
        );
    }
    let _ = writeln!(s, "==== tc ns/packet ====");
    for t in r.tc.iter().chain(&r.tc6) {
        for f in &t.fixtures {
            let _ = writeln!(
                s,
                "  N={:<6} {:<4} {:<75} repeat 1e6: {:>6}  one call: {:>6}",
                t.n,
                if t.family.is_empty() { "IPv4" } else { &t.family },
                f.name,
                median(&f.batched_ns).map(num).unwrap_or_else(|| "–".into()),
                f.single_corrected_ns.map(num).unwrap_or_else(|| "–".into())
            );
        }
    }
    let _ = writeln!(s, "==== memory ====");
    for m in &r.memory {
        let _ = writeln!(
            s,
            "  {:<20} N={:<6} {:<36} VmRSS {:>7} MiB  VmHWM {:>7} MiB  maps {:>7} MiB",
            m.config.map(Config::program).unwrap_or(""),
            m.n,
            m.when,
            mib(m.rss_kib as f64),
            mib(m.hwm_kib as f64),
            mib(m.maps.iter().map(|x| x.memlock).sum::<u64>() as f64 / 1024.0)
        );
    }
    if !r.throughput.is_empty() {
        let _ = writeln!(s, "==== north-south throughput (NodePort), every round ====");
        for t in &r.throughput {
            let _ = writeln!(
                s,
                "  {:<26} round {}  {:>7.0} conn/s  CPU {:>5.1} µs/conn (softirq {:>5.1})  slow {}  errors {}",
                t.config.label(),
                t.round + 1,
                t.load.per_s(),
                t.load.us_per_conn(t.load.busy_ns),
                t.load.us_per_conn(t.load.softirq_ns),
                t.load.slow,
                t.load.errors
            );
        }
    }
    s.push_str("==== targets ====\n");
    s.push_str(&targets(r));
    s
}
