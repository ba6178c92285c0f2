//! Step 4 of watch -> model -> plan -> maps -> programs: turning the desired state into map writes.
//!
//! - `ops`: the `MapOps` trait, one method per kind of map write, so the writer can run against
//!   the kernel (`kernel::KernelMaps`) or an in-memory fake (`fake::FakeMaps`) in unit tests;
//! - `ids`: backend and reverse-NAT id allocation (stable across restarts: recovered from maps);
//! - `apply`: the diff against what was applied and the make-before-break write order;
//! - `conntrack`: the conntrack GC, which frees the tc path's entries (and masquerade ports) of
//!   flows that ended.

pub mod apply;
pub mod conntrack;
pub mod fake;
pub mod ids;
pub mod kernel;
pub mod ops;

pub use apply::{Applier, ApplyReport, Capacities};
pub use kernel::KernelMaps;
pub use ops::{BatchError, MapError, MapOps, Snapshot};
