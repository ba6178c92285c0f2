//! The plan kept between syncs ([`Planner`]): the desired state, updated one Service at a time, so
//! that a change to one Service costs work in proportion to that Service rather than to the
//! cluster (the map writer then looks only at what changed, `Applier::apply_changes`). The result
//! is exactly what [`super::from_scratch`] gives; the property tests hold it to that.
//!
//! What ties Services together is kept as indexes: who claims each frontend (the winner is the
//! first by [`plan::Claim::priority`]), how many kept frontends use each backend, and what the
//! endpoints at each backend address say about it ([`BackendVotes`]).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, btree_map::Entry},
    sync::Arc,
};

use super::{
    BackendAddr, BackendVotes, DesiredState, Frontend, FrontendKind, FrontendPlan, HealthCheck, ServicePlan,
};
use crate::{
    model::{Problem, ServicePortName},
    node::{NodeContext, NodeInfo},
    watch::{ClusterState, ServiceInputs, ServiceKey, Slice},
};

/// The frontends and backends whose desired entries changed in one update.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub frontends: BTreeSet<Frontend>,
    pub backends: BTreeSet<BackendAddr>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.frontends.is_empty() && self.backends.is_empty()
    }
}

/// Sums over every Service, for metrics and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub services: usize,
    pub service_ports: usize,
    pub endpoints: usize,
    pub no_local_internal: usize,
    pub no_local_external: usize,
}

/// What one update did.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub changes: Changes,
    /// Problems that were not there before this update (to log once, not at every sync).
    pub new_problems: Vec<Problem>,
    /// Services recomputed.
    pub recomputed: usize,
}

/// Steps 2 and 3 kept between syncs: every Service's [`ServicePlan`] and the desired state they
/// add up to.
#[derive(Debug, Default)]
pub struct Planner {
    /// The node facts every unit was computed with; other facts need a rebuild.
    inputs: Option<(NodeInfo, NodeContext)>,
    units: BTreeMap<ServiceKey, ServicePlan>,
    /// The units with problems or health checks: what [`Self::problems`] and
    /// [`Self::health_checks`] walk at every sync, rather than every unit (at 30,000 Services a
    /// walk of every unit cost each sync about 4 ms, measured in a release build).
    noted: BTreeSet<ServiceKey>,
    /// Every claim on each frontend, in priority order; the first is served.
    claimants: HashMap<Frontend, Claims>,
    desired: DesiredState,
    /// Each backend address some unit names: its endpoints' votes and how many times kept
    /// frontends' scopes list it. One map for both (100,000 entries at 10,000 Services).
    backends: HashMap<BackendAddr, BackendUse>,
    /// The losing claims on each contested frontend.
    conflicts: BTreeMap<Frontend, Vec<Problem>>,
    totals: Totals,
}

/// What the planner knows of one backend address.
#[derive(Clone, Copy, Debug, Default)]
struct BackendUse {
    /// What its endpoints say (none: `endpoints` 0).
    votes: BackendVotes,
    /// How many times kept frontends' scopes list it.
    used: u32,
}

impl BackendUse {
    fn is_empty(&self) -> bool {
        self.votes.endpoints <= 0 && self.used == 0
    }

    /// Its flags while some kept frontend uses it.
    fn flags(&self) -> Option<u8> {
        (self.used > 0).then(|| {
            if self.votes.endpoints > 0 {
                self.votes.flags()
            } else {
                0
            }
        })
    }
}

/// The claims on one frontend, sorted by [`super::Claim::priority`] (kind, then service port). A
/// frontend almost always has exactly one, so a sorted `Vec` rather than a map: at 10,000
/// Services a map per frontend costs about 10 MiB more.
type Claims = Vec<(FrontendKind, Arc<FrontendPlan>)>;

fn claim_position(claims: &Claims, kind: FrontendKind, service: &ServicePortName) -> Result<usize, usize> {
    claims.binary_search_by(|(k, plan)| (*k, &plan.service).cmp(&(kind, service)))
}

/// What a unit's arrival or departure may have changed.
#[derive(Default)]
struct Touched {
    frontends: BTreeSet<Frontend>,
    backends: BTreeSet<BackendAddr>,
}

impl Planner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the state was computed for these node facts (else only [`Self::rebuild`] may be
    /// used: every Service depends on them).
    pub fn is_current(&self, node: &NodeInfo, ctx: &NodeContext) -> bool {
        self.inputs.as_ref().is_some_and(|(n, c)| n == node && c == ctx)
    }

    pub fn desired(&self) -> &DesiredState {
        &self.desired
    }

    /// Repacks the ordered maps a rebuild filled in order ([`crate::compact`]).
    pub fn repack(&mut self) {
        crate::compact::repack(&mut self.units);
        crate::compact::repack(&mut self.desired.frontends);
        crate::compact::repack(&mut self.desired.backends);
    }

    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// Every current problem: the Services' own (in Service order), then the lost claims.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out: Vec<Problem> = self
            .noted_units()
            .flat_map(|u| u.problems.iter().cloned())
            .collect();
        out.extend(self.conflicts.values().flatten().cloned());
        out
    }

    /// The externalTrafficPolicy=Local health checks, per family.
    pub fn health_checks(&self) -> Vec<HealthCheck> {
        self.noted_units()
            .flat_map(|u| u.health_checks.iter().cloned())
            .collect()
    }

    fn noted_units(&self) -> impl Iterator<Item = &ServicePlan> {
        self.noted.iter().filter_map(|key| self.units.get(key))
    }

    /// Keeps `unit` as `key`'s plan (and notes whether it has problems or health checks).
    fn keep(&mut self, key: &ServiceKey, unit: ServicePlan) {
        if unit.problems.is_empty() && unit.health_checks.is_empty() {
            self.noted.remove(key);
        } else {
            self.noted.insert(key.clone());
        }
        self.units.insert(key.clone(), unit);
    }

    /// Drops `key`'s plan, returning it.
    fn drop_unit(&mut self, key: &ServiceKey) -> Option<ServicePlan> {
        self.noted.remove(key);
        self.units.remove(key)
    }

    /// Recomputes everything from `state`. The caller writes the whole desired state
    /// (`Applier::apply`); the outcome's changes list every frontend and backend anyway.
    pub fn rebuild(&mut self, state: &ClusterState, node: &NodeInfo, ctx: &NodeContext) -> Outcome {
        let before: BTreeSet<Problem> = self.problems().into_iter().collect();
        let old_frontends: Vec<Frontend> = self.desired.frontends.keys().copied().collect();
        let old_backends: Vec<BackendAddr> = self.desired.backends.keys().copied().collect();
        *self = Self {
            inputs: Some((node.clone(), ctx.clone())),
            ..Self::default()
        };
        let slices = state.slices_by_service();
        let mut touched = Touched::default();
        for (key, svc) in &state.services {
            let service_slices = slices.get(key).map(Vec::as_slice).unwrap_or_default();
            let unit = ServicePlan::compute(&key.0, &key.1, svc, service_slices, node, ctx);
            self.contribute(&unit, &mut touched);
            self.keep(key, unit);
        }
        let mut changes = self.settle(touched);
        // Whatever was desired before is gone unless settled again.
        changes.frontends.extend(old_frontends);
        changes.backends.extend(old_backends);
        let new_problems = self
            .problems()
            .into_iter()
            .filter(|p| !before.contains(p))
            .collect();
        Outcome {
            changes,
            new_problems,
            recomputed: self.units.len(),
        }
    }

    /// Recomputes the Services in `dirty` from their current objects. Only valid while
    /// [`Self::is_current`] holds for the node facts.
    pub fn update<'a>(
        &mut self,
        dirty: impl IntoIterator<Item = &'a ServiceKey>,
        inputs: impl Fn(&ServiceKey) -> ServiceInputs,
    ) -> Outcome {
        let Some((node, ctx)) = self.inputs.clone() else {
            return Outcome::default();
        };
        let mut touched = Touched::default();
        let mut new_problems = Vec::new();
        let mut recomputed = 0;
        for key in dirty {
            recomputed += 1;
            let (svc, slices) = inputs(key);
            let unit = svc.map(|svc| {
                let slices: Vec<&Slice> = slices.iter().map(Arc::as_ref).collect();
                ServicePlan::compute(&key.0, &key.1, &svc, &slices, &node, &ctx)
            });
            let old = self.drop_unit(key);
            if old.as_ref() == unit.as_ref() {
                if let Some(old) = old {
                    self.keep(key, old);
                }
                continue;
            }
            if let Some(old) = &old {
                self.withdraw(old, &mut touched);
            }
            if let Some(unit) = unit {
                let before = old.as_ref().map(|o| o.problems.as_slice()).unwrap_or_default();
                new_problems.extend(unit.problems.iter().filter(|p| !before.contains(p)).cloned());
                self.contribute(&unit, &mut touched);
                self.keep(key, unit);
            }
        }
        // Conflicts on every frontend a recomputed Service claims, whether or not its winner
        // changed: a claim that loses on arrival leaves the winner as it was.
        let contested: Vec<Frontend> = touched.frontends.iter().copied().collect();
        let conflicts_of = |s: &Self| -> BTreeSet<Problem> {
            contested
                .iter()
                .filter_map(|f| s.conflicts.get(f))
                .flatten()
                .cloned()
                .collect()
        };
        let conflicts_before = conflicts_of(self);
        let changes = self.settle(touched);
        new_problems.extend(conflicts_of(self).difference(&conflicts_before).cloned());
        Outcome {
            changes,
            new_problems,
            recomputed,
        }
    }

    fn contribute(&mut self, unit: &ServicePlan, touched: &mut Touched) {
        self.count(unit, 1);
        for port in &unit.ports {
            for claim in &port.claims {
                touched.frontends.insert(claim.frontend);
                let claims = self.claimants.entry(claim.frontend).or_default();
                match claim_position(claims, claim.kind, &claim.plan.service) {
                    Ok(i) => claims[i].1 = claim.plan.clone(),
                    Err(i) => claims.insert(i, (claim.kind, claim.plan.clone())),
                }
            }
            for vote in &port.endpoints {
                touched.backends.insert(vote.addr);
                self.backends.entry(vote.addr).or_default().votes.add(vote, 1);
            }
        }
    }

    fn withdraw(&mut self, unit: &ServicePlan, touched: &mut Touched) {
        self.count(unit, -1);
        for port in &unit.ports {
            for claim in &port.claims {
                touched.frontends.insert(claim.frontend);
                if let Some(claims) = self.claimants.get_mut(&claim.frontend) {
                    if let Ok(i) = claim_position(claims, claim.kind, &claim.plan.service) {
                        claims.remove(i);
                    }
                    if claims.is_empty() {
                        self.claimants.remove(&claim.frontend);
                    }
                }
            }
            for vote in &port.endpoints {
                touched.backends.insert(vote.addr);
                if let Some(backend) = self.backends.get_mut(&vote.addr) {
                    backend.votes.add(vote, -1);
                    if backend.votes.endpoints <= 0 {
                        backend.votes = BackendVotes::default();
                    }
                    if backend.is_empty() {
                        self.backends.remove(&vote.addr);
                    }
                }
            }
        }
    }

    fn count(&mut self, unit: &ServicePlan, sign: isize) {
        let t = &mut self.totals;
        let add = |v: &mut usize, n: usize| *v = v.saturating_add_signed(sign * n as isize);
        add(&mut t.services, 1);
        add(&mut t.service_ports, unit.ports.len());
        add(&mut t.endpoints, unit.endpoints);
        add(&mut t.no_local_internal, unit.no_local_internal);
        add(&mut t.no_local_external, unit.no_local_external);
    }

    /// Re-decides the touched frontends (winner, conflicts) and backends (used, flags).
    fn settle(&mut self, touched: Touched) -> Changes {
        let mut changes = Changes::default();
        let mut backends = touched.backends;
        for frontend in touched.frontends {
            let claims = self.claimants.get(&frontend);
            let winner = claims.and_then(|c| c.first());
            let served = self.desired.frontends.get(&frontend);
            if served != winner.map(|(_, plan)| plan) {
                if let Some(old) = served {
                    for b in old.backends() {
                        backends.insert(*b);
                        if let Some(backend) = self.backends.get_mut(b) {
                            backend.used -= 1;
                            if backend.is_empty() {
                                self.backends.remove(b);
                            }
                        }
                    }
                }
                match winner {
                    Some((_, plan)) => {
                        for b in plan.backends() {
                            backends.insert(*b);
                            self.backends.entry(*b).or_default().used += 1;
                        }
                        self.desired.frontends.insert(frontend, plan.clone());
                    }
                    None => {
                        self.desired.frontends.remove(&frontend);
                    }
                }
                changes.frontends.insert(frontend);
            }
            let lost: Vec<Problem> = match (claims, winner) {
                (Some(claims), Some((_, owner))) => claims
                    .iter()
                    .skip(1)
                    .filter(|(_, plan)| plan.service != owner.service)
                    .map(|(kind, plan)| {
                        Problem::from(&super::lost_claim(
                            *kind,
                            &frontend,
                            &plan.service,
                            &owner.service,
                        ))
                    })
                    .collect(),
                _ => Vec::new(),
            };
            if lost.is_empty() {
                self.conflicts.remove(&frontend);
            } else {
                self.conflicts.insert(frontend, lost);
            }
        }
        for addr in backends {
            let want = self.backends.get(&addr).and_then(BackendUse::flags);
            match (self.desired.backends.entry(addr), want) {
                (Entry::Occupied(e), None) => {
                    e.remove();
                    changes.backends.insert(addr);
                }
                (Entry::Occupied(mut e), Some(flags)) => {
                    if *e.get() != flags {
                        e.insert(flags);
                        changes.backends.insert(addr);
                    }
                }
                (Entry::Vacant(e), Some(flags)) => {
                    e.insert(flags);
                    changes.backends.insert(addr);
                }
                (Entry::Vacant(_), None) => {}
            }
        }
        changes
    }
}

impl Planner {
    /// The size of every collection the planner keeps between syncs, for the churn test that
    /// proves none keeps what a deleted Service left.
    #[cfg(test)]
    pub(crate) fn residue(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("planner units", self.units.len()),
            ("planner noted", self.noted.len()),
            ("planner claimants", self.claimants.len()),
            ("planner backends", self.backends.len()),
            ("planner conflicts", self.conflicts.len()),
            ("desired frontends", self.desired.frontends.len()),
            ("desired backends", self.desired.backends.len()),
        ]
    }
}

#[cfg(test)]
mod tests;
