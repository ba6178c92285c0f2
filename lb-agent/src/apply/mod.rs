//! Step 4 of watch -> model -> plan -> maps -> programs: the plan applied to the kernel's maps,
//! only what differs, in an order that never lets a packet see a half-written Service.
//!
//! - `applier`: [`Applier`], the mirror of what was written, the diff against the desired state
//!   and the make-before-break write order (`adopt`: a restart's recovery; `fit`: whether a
//!   Service fits and how it is written; `writes`: the writes);
//! - `entries`: the map entries of either family (`ServiceMapKey`, `BackendEntry`, ...), one
//!   frontend's entries built from its plan, and the names the maps store;
//! - `ids`: backend and reverse-NAT id allocation (stable across restarts: recovered from maps);
//! - `ops`: the [`MapOps`] trait, one method per kind of map write, so the writer runs against the
//!   kernel ([`KernelMaps`], `kernel`, where an entry's family picks its maps and becomes a type)
//!   or an in-memory fake (`fake::FakeMaps`) in unit tests;
//! - `prefilter`: the tc programs' prefilter bits, held by the kernel maps' writes before the
//!   entries that need them, cleared after conntrack GC passes.
//!
//! The writer is family-blind: a dual-stack Service's frontends of both families are one Service
//! to it, written together. What differs per family is counted per family: each family's maps
//! have their own capacity, and ids come from each family's own range of one id space.

pub mod applier;
pub mod entries;
pub mod fake;
pub mod ids;
pub mod kernel;
mod maglev_tables;
pub mod ops;
pub mod prefilter;

pub use applier::{Applier, ApplyReport};
pub use entries::{BackendEntry, RevNatEntry, ServiceMapKey, ServiceMapValue, SourceRange};
pub use kernel::KernelMaps;
pub use ops::{BatchError, MapError, MapOps, Snapshot};

#[cfg(test)]
mod proptests;
