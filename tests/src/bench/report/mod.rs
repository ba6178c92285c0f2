//! docs/benchmarks.md and the plots in docs/bench/, generated from the measured values only.
//!
//! The files: `results` (the saved results and what the document reads from them), `machine`
//! (what the run ran on), `stats` (medians, percentiles, number formats), `document` (the
//! markdown), `prose` (its fixed text: method, tc method, caveats), `targets` (the targets
//! table and why a missed one is missed), `gnuplot` (the plots), `terminal` (the summary
//! printed at the end).

mod document;
mod gnuplot;
mod machine;
mod prose;
mod results;
mod stats;
mod targets;
mod terminal;

pub use self::{
    document::markdown,
    gnuplot::plots,
    machine::{Machine, machine},
    results::Results,
    targets::TARGET_N,
    terminal::summary,
};
