//! The plots in docs/bench/ (connect latency, programming time), drawn by gnuplot from data
//! files written next to its script. In the connect-latency plot each configuration has one
//! colour, solid over IPv4 and dashed over IPv6.

use std::{fmt::Write as _, fs, path::Path, process::Command};

use lb_tests::packet::Family;

use super::{
    Results,
    stats::{fmt_n, median},
};
use crate::bench::peers::Config;

/// One gnuplot line colour per configuration, the same in every plot.
fn color(c: Config) -> usize {
    Config::ALL.iter().position(|&x| x == c).unwrap_or(0) + 1
}

pub fn plots(r: &Results, out_dir: &Path, work: &Path) -> Result<(), String> {
    fs::create_dir_all(out_dir).map_err(|e| e.to_string())?;
    let levels = r.levels();
    let lo = levels.iter().copied().min().unwrap_or(10) as f64 / 2.0;
    let hi = levels.iter().copied().max().unwrap_or(10_000) as f64 * 2.0;
    // Latency: one data block per family and configuration, columns N p50 p99.
    let families = r.latency_families();
    let series: Vec<(Family, Config)> = families
        .iter()
        .flat_map(|&f| r.measured_configs().into_iter().map(move |c| (f, c)))
        .collect();
    let mut lat = String::new();
    for &(f, c) in &series {
        let _ = writeln!(lat, "# {} {}", c.label(), f.name());
        for &n in &levels {
            if let (Some(p50), Some(p99)) = (r.p50_in(f, n, c), median(&r.lat_in(f, n, c, |x| x.p99_us))) {
                let _ = writeln!(lat, "{n} {p50} {p99}");
            }
        }
        lat.push_str("\n\n");
    }
    let lat_file = work.join("latency.dat");
    fs::write(&lat_file, lat).map_err(|e| e.to_string())?;
    // With both families the key (up to fourteen entries) goes below the panels.
    let (height, key) = if families.len() > 1 {
        (640, "set key below maxrows 7\nset bmargin 11")
    } else {
        (480, "set key top left")
    };
    let mut plot = format!(
        "set terminal pngcairo size 1100,{height} font 'sans,10'\nset output '{}'\n\
         set multiplot layout 1,2 title 'Connect latency to a ClusterIP (median over rounds){}'\n\
         set logscale x\nset xrange [{lo}:{hi}]\nset xlabel 'Services (10 endpoints each)'\n\
         {key}\nset grid\nset xtics ({})\nset yrange [0:*]\n",
        out_dir.join("connect-latency.png").display(),
        if families.len() > 1 {
            ": solid IPv4, dashed IPv6"
        } else {
            ""
        },
        levels
            .iter()
            .map(|n| format!("'{}' {n}", fmt_n(*n)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (title, col) in [("p50", 2), ("p99", 3)] {
        let _ = write!(plot, "set title '{title}'\nset ylabel 'µs'\nplot ");
        let parts: Vec<String> = series
            .iter()
            .enumerate()
            .filter(|&(_, &(f, c))| levels.iter().any(|&n| r.p50_in(f, n, c).is_some()))
            .map(|(k, &(f, c))| {
                format!(
                    "'{}' index {k} using 1:{col} with linespoints lw 2 lc {} dt {} title '{}{}'",
                    lat_file.display(),
                    color(c),
                    if f == Family::V4 { 1 } else { 2 },
                    c.label(),
                    if families.len() > 1 {
                        format!(", {}", f.name())
                    } else {
                        String::new()
                    }
                )
            })
            .collect();
        plot.push_str(&parts.join(", "));
        plot.push('\n');
    }
    plot.push_str("unset multiplot\n");

    // Programming: through the API (all answering) and cold start, per program.
    let mut prog = String::new();
    let mut blocks = Vec::new();
    for c in Config::PROXIES {
        let rows: Vec<(u32, f64)> = r
            .programming
            .iter()
            .filter(|p| p.config == Some(c))
            .filter_map(|p| Some((p.n, p.all_s?)))
            .collect();
        let cold: Vec<(u32, f64)> = r
            .latency
            .iter()
            .flat_map(|l| l.cold.iter())
            .filter(|x| x.config == Some(c))
            .filter_map(|x| Some((x.n, x.all_s?)))
            .collect();
        for (what, rows) in [("created through the API", rows), ("cold start", cold)] {
            let _ = writeln!(prog, "# {} {what}", c.program());
            for (n, v) in &rows {
                let _ = writeln!(prog, "{n} {v}");
            }
            prog.push_str("\n\n");
            blocks.push((format!("{}: {what}", c.program()), rows.is_empty(), color(c)));
        }
    }
    let prog_file = work.join("programming.dat");
    fs::write(&prog_file, prog).map_err(|e| e.to_string())?;
    let _ = write!(
        plot,
        "reset\nset terminal pngcairo size 900,580 font 'sans,10'\nset output '{}'\n\
         set title 'Programming time: until every Service answers through the data path'\n\
         set logscale xy\nset xrange [{lo}:{hi}]\nset xlabel 'Services (10 endpoints each)'\n\
         set ylabel 'seconds'\nset key below\nset bmargin 8\nset grid\nset xtics ({})\nplot ",
        out_dir.join("programming-time.png").display(),
        levels
            .iter()
            .map(|n| format!("'{}' {n}", fmt_n(*n)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let parts: Vec<String> = blocks
        .iter()
        .enumerate()
        .filter(|(_, (_, empty, _))| !empty)
        .map(|(k, (title, _, lc))| {
            format!(
                "'{}' index {k} using 1:2 with linespoints lw 2 lc {lc} dt {} title '{title}'",
                prog_file.display(),
                if k % 2 == 0 { 1 } else { 2 }
            )
        })
        .collect();
    plot.push_str(&parts.join(", "));
    plot.push('\n');
    let script = work.join("plots.gp");
    fs::write(&script, plot).map_err(|e| e.to_string())?;
    let out = Command::new("gnuplot")
        .arg(&script)
        .output()
        .map_err(|e| format!("gnuplot: {e} (install gnuplot-nox; `cargo xtask setup` does)"))?;
    if !out.status.success() {
        return Err(format!(
            "gnuplot failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}
