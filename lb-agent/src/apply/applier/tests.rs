//! The writer against the fake maps: write order, minimal writes, recovery, and full maps.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use lb_common::{
    catalog,
    revnat::SvcName,
    service::{SCOPE_EXTERNAL, SCOPE_INTERNAL, flags},
};

use super::*;
use crate::{
    apply::{
        ServiceMapKey, Snapshot, SourceRange,
        fake::{FakeMaps, Op},
    },
    model::{Protocol, ServicePortName},
    plan::{Changes, FrontendKind, ScopePlan},
};

fn name(svc: &str) -> ServicePortName {
    ServicePortName {
        namespace: "ns".into(),
        name: svc.into(),
        port: "".into(),
        protocol: Protocol::Tcp,
    }
}

fn be(last: u8) -> BackendAddr {
    BackendAddr {
        addr: IpAddr::V4(Ipv4Addr::new(10, 244, 0, last)),
        port: 8080,
        proto: Protocol::Tcp,
    }
}

fn fe(last: u8) -> Frontend {
    Frontend {
        addr: IpAddr::V4(Ipv4Addr::new(10, 96, 0, last)),
        port: 80,
        proto: Protocol::Tcp,
    }
}

fn be6(last: u16) -> BackendAddr {
    BackendAddr {
        addr: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, last)),
        ..be(0)
    }
}

fn fe6(last: u16) -> Frontend {
    Frontend {
        addr: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, last)),
        ..fe(0)
    }
}

fn frontend_plan(svc: &str, backends: &[u8]) -> FrontendPlan {
    FrontendPlan {
        service: name(svc),
        kind: FrontendKind::ClusterIp,
        affinity_timeout: 0,
        scopes: vec![ScopePlan {
            scope: SCOPE_EXTERNAL,
            flags: flags::CLUSTER_IP,
            backends: backends.iter().map(|b| be(*b)).collect(),
            maglev: None,
        }],
        source_ranges: vec![],
    }
}

fn desired(services: &[(u8, &str, &[u8])]) -> DesiredState {
    let mut d = DesiredState::default();
    for (vip, svc, backends) in services {
        let plan = frontend_plan(svc, backends);
        for b in plan.backends() {
            d.backends.insert(*b, 0);
        }
        d.frontends.insert(fe(*vip), plan.into());
    }
    d
}

fn applier() -> Applier<FakeMaps> {
    Applier::new(FakeMaps::new(), Capacities::default())
}

/// Asserts that no prefix of the operation log leaves a frontend pointing at nothing.
fn assert_every_step_consistent(log: &[Op]) {
    FakeMaps::replay(log, |i, maps| {
        if let Err(e) = maps.check_consistent() {
            panic!("after operation {i} ({:?}): {e}", log[i]);
        }
    });
}

#[test]
fn first_apply_writes_everything_in_a_safe_order() {
    let mut a = applier();
    let r = a.apply(&desired(&[(10, "web", &[1, 2, 3])]));
    assert!(r.is_clean(), "{r:?}");
    let maps = a.maps();
    assert_eq!(maps.state.backends.len(), 3);
    assert_eq!(maps.state.services.len(), 4);
    maps.check_consistent().unwrap();
    assert_every_step_consistent(&maps.log);
    // The frontend entry is the last service write.
    let last_service_write = maps.log.iter().rev().find_map(|op| match op {
        Op::PutService(k, _) => Some(*k),
        _ => None,
    });
    assert_eq!(last_service_write.map(|k| k.slot), Some(0));
    assert_eq!(r.writes, 3 + 1 + 4);
}

#[test]
fn an_unchanged_state_costs_nothing() {
    let mut a = applier();
    let d = desired(&[(10, "web", &[1, 2]), (11, "api", &[3])]);
    a.apply(&d);
    let r = a.apply(&d);
    assert_eq!((r.writes, r.deletes), (0, 0));
}

#[test]
fn a_change_to_one_service_writes_only_that_change() {
    let mut a = applier();
    let services: Vec<(u8, String, Vec<u8>)> = (0..100)
        .map(|i| (i, format!("svc{i}"), vec![i % 50 + 1]))
        .collect();
    let as_refs = |list: &[(u8, String, Vec<u8>)]| -> DesiredState {
        let v: Vec<(u8, &str, &[u8])> = list
            .iter()
            .map(|(a, b, c)| (*a, b.as_str(), c.as_slice()))
            .collect();
        desired(&v)
    };
    a.apply(&as_refs(&services));
    let mut changed = services.clone();
    changed[42].2.push(200);
    let r = a.apply(&as_refs(&changed));
    // One new backend, one new slot, the frontend entry with its new count.
    assert_eq!((r.writes, r.deletes), (3, 0), "{r:?}");
}

/// A slot carries a copy of its backend's entry (the programs choose without a backends lookup):
/// when a backend's flags change while no frontend's plan does (a node address came, another
/// Service's endpoint at the same address started terminating), the backend is written first,
/// then every slot that copies it, in each Service that uses it, by a full apply and by an
/// incremental one alike.
#[test]
fn a_backends_flags_change_rewrites_every_slot_that_copies_it() {
    use lb_common::backend::flags::{HOST, TERMINATING};
    let d = desired(&[(10, "web", &[1, 2]), (11, "api", &[2, 3])]);
    let slot_flags = |a: &Applier<FakeMaps>, vip: u8| -> Vec<u8> {
        let key = ServiceMapKey::new(fe(vip).addr, 80, 6, SCOPE_EXTERNAL, 0);
        (1..=2)
            .map(|slot| {
                a.maps().state.services[&key.with_slot(slot)]
                    .backend
                    .unwrap()
                    .flags
            })
            .collect()
    };
    for incremental in [false, true] {
        let mut a = applier();
        assert!(a.apply(&d).is_clean());
        a.maps_mut().log.clear();
        let mut changed = d.clone();
        changed.backends.insert(be(2), HOST | TERMINATING);
        let r = if incremental {
            let changes = Changes {
                frontends: Default::default(),
                backends: [be(2)].into(),
            };
            a.apply_changes(&changed, &changes)
        } else {
            a.apply(&changed)
        };
        assert!(r.is_clean(), "{r:?}");
        // Backend 2 sits in slot 2 of web and slot 1 of api (slots follow the plan's order).
        assert_eq!(
            slot_flags(&a, 10),
            vec![0, HOST | TERMINATING],
            "incremental {incremental}"
        );
        assert_eq!(
            slot_flags(&a, 11),
            vec![HOST | TERMINATING, 0],
            "incremental {incremental}"
        );
        // The backend entry first, then the two slots; nothing else.
        let log = &a.maps().log;
        assert!(
            matches!(log[0], Op::PutBackend(_, b) if b.flags == HOST | TERMINATING),
            "{log:?}"
        );
        let slots: Vec<u8> = log[1..]
            .iter()
            .map(|op| match op {
                Op::PutService(k, v) if k.slot > 0 => v.backend.unwrap().flags,
                other => panic!("only slots after the backend: {other:?}"),
            })
            .collect();
        assert_eq!(
            slots,
            vec![HOST | TERMINATING; 2],
            "incremental {incremental}: {log:?}"
        );
        a.maps().check_consistent().unwrap();
        // Nothing left to do.
        let again = a.apply(&changed);
        assert_eq!((again.writes, again.deletes), (0, 0));
    }
}

#[test]
fn scaling_down_lowers_the_count_before_deleting_slots() {
    let mut a = applier();
    a.apply(&desired(&[(10, "web", &[1, 2, 3, 4])]));
    a.maps_mut().log.clear();
    let before = a.maps().state.clone();
    a.apply(&desired(&[(10, "web", &[2])]));
    let log = a.maps().log.clone();
    // Replay from the state before this apply: every intermediate state must be consistent.
    let mut maps = FakeMaps {
        state: before,
        ..FakeMaps::new()
    };
    for (i, op) in log.iter().enumerate() {
        match op {
            Op::PutService(k, v) => maps.put_service(k, v).unwrap(),
            Op::DeleteService(k) => maps.delete_service(k).unwrap(),
            Op::PutBackend(id, v) => maps.put_backend(*id, v).unwrap(),
            Op::DeleteBackend(family, id) => maps.delete_backend(*family, *id).unwrap(),
            other => panic!("unexpected {other:?}"),
        }
        maps.check_consistent()
            .unwrap_or_else(|e| panic!("after {i} {op:?}: {e}"));
    }
    assert_eq!(a.maps().state.services.len(), 2);
    assert_eq!(a.maps().state.backends.len(), 1);
}

#[test]
fn removing_a_service_hides_its_frontend_first_and_frees_backends() {
    let mut a = applier();
    a.apply(&desired(&[(10, "web", &[1, 2]), (11, "api", &[2])]));
    a.maps_mut().log.clear();
    let r = a.apply(&desired(&[(11, "api", &[2])]));
    assert!(r.is_clean());
    let log = &a.maps().log;
    assert!(
        matches!(log.first(), Some(Op::DeleteService(k)) if k.slot == 0),
        "{log:?}"
    );
    assert!(
        matches!(log.last(), Some(Op::DeleteBackend(IpFamily::V4, _))),
        "the unused backend goes last: {log:?}"
    );
    assert_eq!(
        a.maps().state.backends.len(),
        1,
        "the backend shared with api stays"
    );
    assert_eq!(
        r.removed_backends,
        vec![be(1)],
        "the deleted backend is reported (its connected sockets are terminated)"
    );
    a.maps().check_consistent().unwrap();
}

#[test]
fn switching_local_to_cluster_policy_rewrites_the_frontend_before_dropping_the_internal_scope() {
    let two_scopes = |local: &[u8], all: &[u8]| {
        let mut d = DesiredState::default();
        let plan = FrontendPlan {
            service: name("np"),
            kind: FrontendKind::NodePort,
            affinity_timeout: 0,
            scopes: vec![
                ScopePlan {
                    scope: SCOPE_EXTERNAL,
                    flags: flags::NODE_PORT | flags::TWO_SCOPES,
                    backends: local.iter().map(|b| be(*b)).collect(),
                    maglev: None,
                },
                ScopePlan {
                    scope: SCOPE_INTERNAL,
                    flags: flags::NODE_PORT,
                    backends: all.iter().map(|b| be(*b)).collect(),
                    maglev: None,
                },
            ],
            source_ranges: vec![],
        };
        for b in plan.backends() {
            d.backends.insert(*b, 0);
        }
        d.frontends.insert(fe(20), plan.into());
        d
    };
    let mut a = applier();
    a.apply(&two_scopes(&[1], &[1, 2]));
    let log = &a.maps().log;
    let pos = |pred: &dyn Fn(&Op) -> bool| log.iter().position(pred).unwrap();
    let internal_front =
        pos(&|op| matches!(op, Op::PutService(k, _) if k.slot == 0 && k.scope == SCOPE_INTERNAL));
    let external_front =
        pos(&|op| matches!(op, Op::PutService(k, _) if k.slot == 0 && k.scope == SCOPE_EXTERNAL));
    assert!(
        internal_front < external_front,
        "TWO_SCOPES must never point at a missing internal scope"
    );
    assert_every_step_consistent(log);

    a.maps_mut().log.clear();
    a.apply(&desired(&[(20, "np", &[1, 2])]));
    let log = &a.maps().log;
    let rewrite = log.iter().position(|op| matches!(op, Op::PutService(k, v) if k.slot == 0 && k.scope == SCOPE_EXTERNAL && v.entry.flags & flags::TWO_SCOPES == 0)).unwrap();
    let drop_internal = log
        .iter()
        .position(|op| matches!(op, Op::DeleteService(k) if k.scope == SCOPE_INTERNAL))
        .unwrap();
    assert!(rewrite < drop_internal);
    assert!(a.maps().state.services.keys().all(|k| k.scope == SCOPE_EXTERNAL));
}

#[test]
fn recovery_keeps_ids_and_writes_nothing_for_the_same_state() {
    let d = desired(&[(10, "web", &[1, 2]), (11, "api", &[3])]);
    let mut first = applier();
    first.apply(&d);
    let ids_before: Vec<_> = d.frontends.keys().map(|f| first.rev_nat_id(f)).collect();
    let backend_ids_before: Vec<_> = d.backends.keys().map(|b| first.backend_id(b)).collect();

    let maps = FakeMaps {
        state: first.maps().state.clone(),
        ..FakeMaps::new()
    };
    let mut second = Applier::recover(maps, Capacities::default()).unwrap();
    assert_eq!(
        d.frontends
            .keys()
            .map(|f| second.rev_nat_id(f))
            .collect::<Vec<_>>(),
        ids_before
    );
    assert_eq!(
        d.backends
            .keys()
            .map(|b| second.backend_id(b))
            .collect::<Vec<_>>(),
        backend_ids_before
    );
    assert_eq!(second.occupancy(), first.occupancy());
    let r = second.apply(&d);
    assert_eq!((r.writes, r.deletes), (0, 0), "{r:?}");

    // New work after recovery gets fresh ids, not recycled ones.
    let r = second.apply(&desired(&[
        (10, "web", &[1, 2]),
        (11, "api", &[3]),
        (12, "new", &[4]),
    ]));
    assert!(r.is_clean());
    let new_id = second.rev_nat_id(&fe(12)).unwrap();
    assert!(!ids_before.contains(&Some(new_id)));
}

/// The mirror keeps a slot's copy of its backend as flags only (the address is the backend id's):
/// a restart that finds a slot holding some other copy, or an entry of another frontend's
/// reverse-NAT id, must still leave the maps exactly as a fresh writer would.
#[test]
fn recovery_rewrites_foreign_copies_and_deletes_entries_of_another_frontends_id() {
    let d = desired(&[(10, "web", &[1, 2]), (11, "api", &[3])]);
    let mut first = applier();
    first.apply(&d);
    let clean = first.maps().state.clone();
    let mut state = clean.clone();
    // Slot 1 of 10.96.0.10 copies an address that is not its backend's.
    let slot = ServiceMapKey::new(fe(10).addr, 80, 6, SCOPE_EXTERNAL, 1);
    let copy = state.services.get_mut(&slot).unwrap().backend.as_mut().unwrap();
    copy.addr = be(99).addr;
    // An entry at 10.96.0.12 with 10.96.0.11's reverse-NAT id (past the other frontend's slots).
    let api = ServiceMapKey::new(fe(11).addr, 80, 6, SCOPE_EXTERNAL, 1);
    let stray = ServiceMapKey::new(fe(12).addr, 80, 6, SCOPE_EXTERNAL, 1);
    let api_slot = state.services[&api];
    state.services.insert(stray, api_slot);

    let maps = FakeMaps {
        state,
        ..FakeMaps::new()
    };
    let mut second = Applier::recover(maps, Capacities::default()).unwrap();
    assert!(
        !second.maps().state.services.contains_key(&stray),
        "the stray entry is deleted at adoption"
    );
    let r = second.apply(&d);
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(r.writes, 1, "only the foreign copy is rewritten: {r:?}");
    assert_eq!(second.maps().state.services, clean.services);
    second.maps().check_consistent().unwrap();
    assert_eq!(second.apply(&d).writes, 0);
}

#[test]
fn a_service_that_does_not_fit_is_skipped_whole_and_appears_once_room_is_made() {
    let caps = Capacities {
        services: 5,
        ..Capacities::default()
    };
    let mut a = Applier::new(FakeMaps::new(), caps);
    // Each needs 3 entries; Services are written in (namespace, name) order, so api fits and
    // web does not.
    let both = desired(&[(10, "web", &[1, 2]), (11, "api", &[3, 4])]);
    let r = a.apply(&both);
    assert_eq!(r.skipped.len(), 1, "{r:?}");
    assert_eq!(r.skipped[0].0.name, "web");
    assert!(r.skipped[0].1.contains("lb4_services"), "{}", r.skipped[0].1);
    assert!(a.rev_nat_id(&fe(11)).is_some());
    assert!(a.rev_nat_id(&fe(10)).is_none(), "nothing of web is written");
    assert_eq!(
        a.maps().state.backends.len(),
        2,
        "no backend of the skipped Service is left behind"
    );
    a.maps().check_consistent().unwrap();

    // api goes away: now web fits.
    let r = a.apply(&desired(&[(10, "web", &[1, 2])]));
    assert!(r.is_clean(), "{r:?}");
    assert!(a.rev_nat_id(&fe(10)).is_some());
    a.maps().check_consistent().unwrap();
}

/// Regression: a Service whose backend write failed kept the reverse-NAT ids allocated for it,
/// and each retry took more, until no id was left for any new Service.
#[test]
fn a_failed_backend_write_gives_the_services_ids_back() {
    let caps = Capacities {
        revnat: 4,
        ..Capacities::default()
    };
    let mut a = Applier::new(FakeMaps::new(), caps);
    a.maps_mut().backends_fail = true;
    let web = desired(&[(10, "web", &[1, 2])]);
    for _ in 0..10 {
        let r = a.apply(&web);
        assert_eq!(r.skipped.len(), 1, "{r:?}");
        assert!(a.rev_nat_id(&fe(10)).is_none());
    }
    a.maps_mut().backends_fail = false;
    let r = a.apply(&desired(&[(10, "web", &[1, 2]), (11, "api", &[3])]));
    assert!(r.is_clean(), "ids are left for both: {r:?}");
    assert!(a.rev_nat_id(&fe(10)).is_some() && a.rev_nat_id(&fe(11)).is_some());
    a.maps().check_consistent().unwrap();
}

/// Regression: a frontend whose deletion failed stayed in the maps (and kept its reverse-NAT id)
/// until the next full apply: an incremental apply never named it again.
#[test]
fn a_failed_frontend_removal_is_retried_by_the_next_incremental_apply() {
    let mut a = applier();
    let r = a.apply(&desired(&[(10, "web", &[1, 2])]));
    assert!(r.is_clean(), "{r:?}");
    a.maps_mut().service_deletes_fail = true;
    let removed = Changes {
        frontends: [fe(10)].into_iter().collect(),
        backends: [be(1), be(2)].into_iter().collect(),
    };
    let r = a.apply_changes(&desired(&[]), &removed);
    assert!(!r.errors.is_empty(), "the deletion failed: {r:?}");
    assert!(a.rev_nat_id(&fe(10)).is_some(), "kept for the retry");
    a.maps_mut().service_deletes_fail = false;
    let r = a.apply_changes(&desired(&[]), &Changes::default());
    assert!(r.errors.is_empty(), "{r:?}");
    assert!(a.rev_nat_id(&fe(10)).is_none(), "removed by the retry");
    assert!(
        a.maps().state.services.is_empty(),
        "{:?}",
        a.maps().state.services
    );
    a.maps().check_consistent().unwrap();
}

#[test]
fn affinity_members_and_source_ranges_follow_the_plan() {
    let mut d = desired(&[(10, "web", &[1, 2])]);
    let plan = Arc::make_mut(d.frontends.get_mut(&fe(10)).unwrap());
    plan.affinity_timeout = 60;
    plan.scopes[0].flags |= flags::AFFINITY;
    plan.source_ranges = vec!["198.51.100.0/24".parse().unwrap()];
    let mut a = applier();
    assert!(a.apply(&d).is_clean());
    let rev = a.rev_nat_id(&fe(10)).unwrap();
    assert_eq!(a.maps().state.affinity_match.len(), 2);
    assert!(a.maps().state.affinity_match.iter().all(|k| k.rev_nat_id == rev));
    assert_eq!(
        a.maps().state.source_ranges,
        vec![SourceRange::new(rev, "198.51.100.0/24".parse().unwrap())]
    );
    let front = a.maps().state.services[&ServiceMapKey::new(fe(10).addr, 80, 6, SCOPE_EXTERNAL, 0)];
    assert_eq!(front.entry.affinity_timeout, 60);

    // Dropping a backend drops its affinity member.
    let mut d2 = d.clone();
    Arc::make_mut(d2.frontends.get_mut(&fe(10)).unwrap()).scopes[0]
        .backends
        .pop();
    assert!(a.apply(&d2).is_clean());
    assert_eq!(a.maps().state.affinity_match.len(), 1);
}

/// Replays `log` from `before`, checking the maps after every operation: what a reader running
/// concurrently with this apply could observe.
fn assert_consistent_from(before: Snapshot, log: &[Op]) {
    let mut maps = FakeMaps {
        state: before,
        ..FakeMaps::new()
    };
    for (i, op) in log.iter().enumerate() {
        let name = SvcName::default();
        match op {
            Op::PutService(k, v) => maps.put_service(k, v).unwrap(),
            Op::DeleteService(k) => maps.delete_service(k).unwrap(),
            Op::PutBackend(id, v) => maps.put_backend(*id, v).unwrap(),
            Op::DeleteBackend(family, id) => maps.delete_backend(*family, *id).unwrap(),
            Op::PutRevNat(id, v) => maps.put_revnat(*id, v, &name).unwrap(),
            Op::DeleteRevNat(family, id) => maps.delete_revnat(*family, *id).unwrap(),
            Op::PutAffinityMatch(k) => maps.put_affinity_match(k).unwrap(),
            Op::DeleteAffinityMatch(k) => maps.delete_affinity_match(k).unwrap(),
            Op::PutSourceRange(r) => maps.put_source_range(r).unwrap(),
            Op::DeleteSourceRange(r) => maps.delete_source_range(r).unwrap(),
            Op::PutMaglev(id, positions) => maps.put_maglev(*id, positions).unwrap(),
            Op::DeleteMaglev(id) => maps.delete_maglev(*id).unwrap(),
            Op::PutConfig
            | Op::PutPodInterfaces
            | Op::PutMasqueradeAddrs
            | Op::SetClusterIpCheck(..)
            | Op::PutServiceRanges(..) => {}
        }
        maps.check_consistent()
            .unwrap_or_else(|e| panic!("after {i} {op:?}: {e}"));
    }
}

/// Regression (see `plan::proptests::reshaping_a_frontend_in_a_full_services_map_is_not_an_error`):
/// in a services map with no room for the transient peak of make-before-break, but room for the
/// result, a frontend is withdrawn (slot 0 first) and written anew, never half-visible, and the
/// kernel map never refuses a write.
#[test]
fn a_full_map_rewrites_a_frontend_break_before_make() {
    // A NodePort with externalTrafficPolicy=Local (1 + 1 and 1 + 3 slots) going to Cluster
    // (1 + 5 slots): six entries either way, but make-before-break would peak at ten.
    let local = || {
        let mut d = DesiredState::default();
        let plan = FrontendPlan {
            service: name("web"),
            kind: FrontendKind::NodePort,
            affinity_timeout: 0,
            scopes: vec![
                ScopePlan {
                    scope: SCOPE_EXTERNAL,
                    flags: flags::NODE_PORT | flags::TWO_SCOPES,
                    backends: vec![be(1)],
                    maglev: None,
                },
                ScopePlan {
                    scope: SCOPE_INTERNAL,
                    flags: flags::NODE_PORT,
                    backends: vec![be(1), be(2), be(3)],
                    maglev: None,
                },
            ],
            source_ranges: vec![],
        };
        for b in plan.backends() {
            d.backends.insert(*b, 0);
        }
        d.frontends.insert(fe(10), plan.into());
        d
    };
    let cluster = || desired(&[(10, "web", &[1, 2, 3, 4, 5])]);
    let caps = Capacities {
        services: 6,
        ..Capacities::default()
    };
    let maps = FakeMaps {
        services_capacity: Some(6),
        ..FakeMaps::new()
    };
    let mut a = Applier::new(maps, caps);
    assert!(a.apply(&local()).is_clean());
    let before = a.maps().state.clone();
    a.maps_mut().log.clear();
    let r = a.apply(&cluster());
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(r.withdrawn, vec![(name("web"), fe(10))]);
    let log = a.maps().log.clone();
    let service_ops: Vec<&Op> = log
        .iter()
        .filter(|op| matches!(op, Op::PutService(..) | Op::DeleteService(_)))
        .collect();
    // Both frontend entries first, the external one (whose TWO_SCOPES points at the internal
    // one) before the internal one; the new frontend entry last.
    assert!(
        matches!(service_ops[0], Op::DeleteService(k) if k.slot == 0 && k.scope == SCOPE_EXTERNAL)
            && matches!(service_ops[1], Op::DeleteService(k) if k.slot == 0 && k.scope == SCOPE_INTERNAL)
            && matches!(service_ops.last(), Some(Op::PutService(k, _)) if k.slot == 0),
        "{log:?}"
    );
    assert_consistent_from(before, &log);
    let mut fresh = applier();
    fresh.apply(&cluster());
    assert_eq!(a.maps().state.services, fresh.maps().state.services);
    assert_eq!(a.occupancy().services.v4, 6);

    // With room for the peak, the usual make-before-break: no withdrawal.
    let mut roomy = applier();
    roomy.apply(&local());
    let r = roomy.apply(&cluster());
    assert!(r.is_clean() && r.withdrawn.is_empty(), "{r:?}");
}

/// What does not fit even break-before-make is skipped whole and reported, never an error.
#[test]
fn a_frontend_that_grows_past_a_full_map_is_skipped_not_an_error() {
    let caps = Capacities {
        services: 6,
        ..Capacities::default()
    };
    let maps = FakeMaps {
        services_capacity: Some(6),
        ..FakeMaps::new()
    };
    let mut a = Applier::new(maps, caps);
    assert!(a.apply(&desired(&[(10, "web", &[1, 2, 3, 4, 5])])).is_clean());
    let before = a.maps().state.clone();
    let r = a.apply(&desired(&[(10, "web", &[1, 2, 3, 4, 5, 6])]));
    assert!(r.errors.is_empty(), "{r:?}");
    assert_eq!(r.skipped.len(), 1, "{r:?}");
    assert!(
        r.skipped[0].1.contains("lb4_services") && r.skipped[0].1.contains("1 more needed"),
        "{}",
        r.skipped[0].1
    );
    assert_eq!(a.maps().state.services, before.services, "left as it was");
}

/// Source ranges too: with the source-range map full, changing a Service's ranges withdraws
/// its frontend before the old ranges go, so it is never reachable without its ranges.
#[test]
fn a_full_source_range_map_never_leaves_a_frontend_without_its_ranges() {
    let caps = Capacities {
        source_ranges: 1,
        ..Capacities::default()
    };
    let mut a = Applier::new(FakeMaps::new(), caps);
    let with_range = |cidr: &str| {
        let mut d = desired(&[(10, "web", &[1])]);
        Arc::make_mut(d.frontends.get_mut(&fe(10)).unwrap()).source_ranges = vec![cidr.parse().unwrap()];
        d
    };
    assert!(a.apply(&with_range("198.51.100.0/24")).is_clean());
    a.maps_mut().log.clear();
    let r = a.apply(&with_range("203.0.113.0/24"));
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(r.withdrawn.len(), 1);
    let log = &a.maps().log;
    let pos = |pred: &dyn Fn(&Op) -> bool| log.iter().position(pred).unwrap();
    let hide = pos(&|op| matches!(op, Op::DeleteService(k) if k.slot == 0));
    let drop_range = pos(&|op| matches!(op, Op::DeleteSourceRange(..)));
    let add_range = pos(&|op| matches!(op, Op::PutSourceRange(..)));
    let show = pos(&|op| matches!(op, Op::PutService(k, _) if k.slot == 0));
    assert!(
        hide < drop_range && drop_range < add_range && add_range < show,
        "{log:?}"
    );
    let rev = a.rev_nat_id(&fe(10)).unwrap();
    assert_eq!(
        a.maps().state.source_ranges,
        vec![SourceRange::new(rev, "203.0.113.0/24".parse().unwrap())]
    );
    assert_eq!(a.occupancy().source_ranges.v4, 1);
}

/// A scope with more backends than a frontend entry's `u16` count is refused with a reason, not
/// truncated (the plan never asks for it; the writer checks anyway).
#[test]
fn a_scope_too_large_to_count_is_skipped() {
    let mut d = desired(&[(10, "web", &[1])]);
    let many: Vec<BackendAddr> = (0..=u32::from(u16::MAX))
        .map(|i| BackendAddr {
            addr: IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)),
            port: 8080,
            proto: Protocol::Tcp,
        })
        .collect();
    for b in &many {
        d.backends.insert(*b, 0);
    }
    Arc::make_mut(d.frontends.get_mut(&fe(10)).unwrap()).scopes[0].backends = many;
    let caps = Capacities {
        backends: 1 << 17,
        ..Capacities::default()
    };
    let mut a = Applier::new(FakeMaps::new(), caps);
    let r = a.apply(&d);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.skipped.len(), 1);
    assert!(r.skipped[0].1.contains("65536 backends"), "{}", r.skipped[0].1);
    assert!(a.maps().state.services.is_empty());
    assert!(a.maps().state.backends.is_empty());
}

/// Regression (found by `apply_under_churn_converges`): a name longer than its field was cut in
/// the middle of a character; it read back with U+FFFD, which stored differently, so every
/// restart rewrote that frontend's name.
#[test]
fn a_cut_name_reads_back_to_the_same_bytes() {
    let long = ServicePortName {
        namespace: "default".into(),
        name: "n".repeat(70),
        port: "\u{1920}\u{1a7f} \u{830}\u{1944}\u{11000}".into(),
        protocol: Protocol::Tcp,
    };
    let stored = svc_name(&long);
    assert!(
        std::str::from_utf8(&stored.port_name).is_ok(),
        "cut at a character boundary"
    );
    let read_back = service_port_name(&stored, lb_common::proto::TCP);
    assert_eq!(svc_name(&read_back), stored);
}

/// A desired state of the given frontends, each with its Service and backends.
fn desired_of(frontends: &[(Frontend, &str, Vec<BackendAddr>)]) -> DesiredState {
    let mut d = DesiredState::default();
    for (frontend, svc, backends) in frontends {
        let mut plan = frontend_plan(svc, &[]);
        plan.scopes[0].backends = backends.clone();
        for b in plan.backends() {
            d.backends.insert(*b, 0);
        }
        d.frontends.insert(*frontend, plan.into());
    }
    d
}

/// A dual-stack Service is one Service to the writer: its IPv4 frontend goes to the `lb4_*`
/// maps, its IPv6 one to the `lb6_*` maps, each with ids from its family's range; removing one
/// family leaves the other untouched.
#[test]
fn a_dual_stack_service_goes_to_each_familys_maps() {
    let caps = Capacities::default();
    let mut a = applier();
    let both = desired_of(&[
        (fe(10), "web", vec![be(1), be(2)]),
        (fe6(10), "web", vec![be6(1), be6(2)]),
    ]);
    let r = a.apply(&both);
    assert!(r.is_clean(), "{r:?}");
    a.maps().check_consistent().unwrap();
    let state = &a.maps().state;
    let families = |f: IpFamily| state.services.keys().filter(|k| k.family() == f).count();
    assert_eq!((families(IpFamily::V4), families(IpFamily::V6)), (3, 3));
    let v6_rev = a.rev_nat_id(&fe6(10)).unwrap();
    let v4_rev = a.rev_nat_id(&fe(10)).unwrap();
    assert!(v4_rev <= caps.revnat && v6_rev > caps.revnat, "{v4_rev} {v6_rev}");
    let v6_backend = a.backend_id(&be6(1)).unwrap();
    assert!(v6_backend > caps.backends, "{v6_backend}");
    assert_eq!(state.revnat[&v6_rev].addr, fe6(10).addr);
    assert_eq!(state.backends[&v6_backend].addr, be6(1).addr);
    let occ = a.occupancy();
    assert_eq!((occ.services.v4, occ.services.v6), (3, 3));
    assert_eq!((occ.backends.v4, occ.backends.v6), (2, 2));
    assert_eq!((occ.revnat.v4, occ.revnat.v6), (1, 1));

    // The IPv6 frontend goes; IPv4 is not written at all.
    a.maps_mut().log.clear();
    let r = a.apply(&desired_of(&[(fe(10), "web", vec![be(1), be(2)])]));
    assert!(r.is_clean(), "{r:?}");
    let log = &a.maps().log;
    assert!(
        log.iter().all(|op| match op {
            Op::DeleteService(k) => k.family() == IpFamily::V6,
            Op::DeleteBackend(f, _) | Op::DeleteRevNat(f, _) => *f == IpFamily::V6,
            _ => false,
        }),
        "{log:?}"
    );
    assert_eq!(a.occupancy().services.v6, 0);
    assert_eq!(a.occupancy().backends.v6, 0);
    assert_eq!(a.maps().state.services.len(), 3);
}

/// Each family's maps have their own capacity: a full `lb4_services` does not stop an IPv6
/// Service, and the reason names the full map.
#[test]
fn each_family_has_its_own_capacity() {
    let caps = Capacities {
        services: 2,
        ..Capacities::default()
    };
    let maps = FakeMaps {
        services_capacity: Some(2),
        ..FakeMaps::new()
    };
    let mut a = Applier::new(maps, caps);
    let r = a.apply(&desired_of(&[
        (fe(10), "a", vec![be(1)]),
        (fe(11), "b", vec![be(2)]),
        (fe6(10), "c", vec![be6(1)]),
        (fe6(11), "d", vec![be6(2)]),
    ]));
    assert!(r.errors.is_empty(), "{r:?}");
    let reasons: Vec<&str> = r.skipped.iter().map(|(_, why)| why.as_str()).collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons.iter().any(|w| w.contains(catalog::SERVICES)),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|w| w.contains(catalog::SERVICES6)),
        "{reasons:?}"
    );
    assert_eq!(a.occupancy().services, PerFamily { v4: 2, v6: 2 });
    a.maps().check_consistent().unwrap();
}

/// A restarted writer adopts both families' entries with their ids and writes nothing.
#[test]
fn a_restart_adopts_both_families() {
    let both = desired_of(&[
        (fe(10), "web", vec![be(1), be(2)]),
        (fe6(10), "web", vec![be6(1)]),
    ]);
    let mut a = applier();
    assert!(a.apply(&both).is_clean());
    let maps = FakeMaps {
        state: a.maps().state.clone(),
        ..FakeMaps::new()
    };
    let mut b = Applier::recover(maps, Capacities::default()).unwrap();
    assert_eq!(b.occupancy(), a.occupancy());
    assert_eq!(b.rev_nat_id(&fe6(10)), a.rev_nat_id(&fe6(10)));
    assert_eq!(b.backend_id(&be6(1)), a.backend_id(&be6(1)));
    let r = b.apply(&both);
    assert!(r.is_clean(), "{r:?}");
    assert_eq!((r.writes, r.deletes), (0, 0), "{:?}", b.maps().log);
}

/// A NodePort frontend (`fe(vip)`) of `svc` whose external scope uses Maglev with table size 251.
fn maglev_desired(services: &[(u8, &str, &[u8])], size: u32) -> DesiredState {
    let mut d = DesiredState::default();
    for (vip, svc, backends) in services {
        let backends: Vec<BackendAddr> = backends.iter().map(|b| be(*b)).collect();
        let plan = FrontendPlan {
            service: name(svc),
            kind: FrontendKind::NodePort,
            affinity_timeout: 0,
            scopes: vec![ScopePlan {
                scope: SCOPE_EXTERNAL,
                flags: flags::NODE_PORT | flags::MASQUERADE | flags::MAGLEV,
                backends,
                maglev: Some(crate::plan::maglev::TableParams {
                    size: crate::plan::maglev::TableSize::new(size).unwrap(),
                    seed: crate::plan::maglev::HashSeed::FIXED,
                }),
            }],
            source_ranges: vec![],
        };
        for b in plan.backends() {
            d.backends.insert(*b, 0);
        }
        d.frontends.insert(fe(*vip), plan.into());
    }
    d
}

/// The backend address at each position of frontend `vip`'s table in the maps.
fn maglev_targets(a: &Applier<FakeMaps>, vip: u8) -> Vec<BackendAddr> {
    let id = a.rev_nat_id(&fe(vip)).expect("applied");
    let state = &a.maps().state;
    state.maglev[&id]
        .iter()
        .map(|b| {
            let v = state.backends[b];
            BackendAddr {
                addr: v.addr,
                port: v.port,
                proto: Protocol::Tcp,
            }
        })
        .collect()
}

/// Issue 17: the table is the plan's (`plan::maglev`, the same on every node) in this node's ids,
/// in before the frontend entry asks for it (`MAGLEV`; written first without the flag, the slots
/// deciding meanwhile), whose `backend_id` holds its size.
#[test]
fn a_maglev_table_is_written_before_its_frontend_entry() {
    use crate::plan::maglev::{DEFAULT_SEED, Member, TableSize, lookup_table};
    let mut a = applier();
    let r = a.apply(&maglev_desired(&[(10, "web", &[1, 2, 3])], 251));
    assert!(r.is_clean(), "{r:?}");
    let log = &a.maps().log;
    let table_at = log
        .iter()
        .position(|op| matches!(op, Op::PutMaglev(..)))
        .expect("table written");
    let asks_at = log
        .iter()
        .position(|op| matches!(op, Op::PutService(k, v) if k.slot == 0 && v.entry.has(flags::MAGLEV)))
        .expect("frontend written");
    assert!(table_at < asks_at, "{log:?}");
    assert_every_step_consistent(log);
    let key = ServiceMapKey::new(fe(10).addr, 80, 6, SCOPE_EXTERNAL, 0);
    assert_eq!(a.maps().state.services[&key].entry.backend_id, 251);
    let members: Vec<Member> = [1, 2, 3]
        .map(|b| Member {
            addr: be(b).addr,
            port: 8080,
            weight: 1,
        })
        .to_vec();
    let want = lookup_table(&members, TableSize::new(251).unwrap(), &DEFAULT_SEED);
    let want: Vec<BackendAddr> = want
        .slots
        .iter()
        .map(|s| BackendAddr {
            addr: want.members[*s as usize].addr,
            port: 8080,
            proto: Protocol::Tcp,
        })
        .collect();
    assert_eq!(maglev_targets(&a, 10), want);
}

/// The tables of an apply go in together (one grace period per batch in the kernel, not one per
/// table): a cold start with three Maglev Services puts their three tables in one call, and
/// every intermediate state a reader could see is consistent.
#[test]
fn an_applys_maglev_tables_go_in_one_batch() {
    let mut a = applier();
    let r = a.apply(&maglev_desired(
        &[(10, "web", &[1, 2, 3]), (11, "api", &[4, 5]), (12, "db", &[6])],
        251,
    ));
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(a.maps().maglev_batches, [3]);
    assert_every_step_consistent(&a.maps().log);
    for vip in [10, 11, 12] {
        let key = ServiceMapKey::new(fe(vip).addr, 80, 6, SCOPE_EXTERNAL, 0);
        assert!(a.maps().state.services[&key].entry.has(flags::MAGLEV), "{vip}");
    }
    // A later change of one Service: one table, its entry untouched (same size).
    let before = a.maps().log.len();
    let r = a.apply(&maglev_desired(
        &[(10, "web", &[1, 2]), (11, "api", &[4, 5]), (12, "db", &[6])],
        251,
    ));
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(a.maps().maglev_batches, [3, 1]);
    assert_every_step_consistent(&a.maps().log);
    let changed = &a.maps().log[before..];
    assert!(
        !changed
            .iter()
            .any(|op| matches!(op, Op::PutService(k, v) if k.slot == 0 && !v.entry.has(flags::MAGLEV))),
        "a table of the same size is swapped under its entry: {changed:?}"
    );
    // The table size changes: each entry is written without the flag, then with it.
    let r = a.apply(&maglev_desired(
        &[(10, "web", &[1, 2]), (11, "api", &[4, 5]), (12, "db", &[6])],
        509,
    ));
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(a.maps().maglev_batches, [3, 1, 3]);
    assert_every_step_consistent(&a.maps().log);
    let key = ServiceMapKey::new(fe(10).addr, 80, 6, SCOPE_EXTERNAL, 0);
    assert_eq!(a.maps().state.services[&key].entry.backend_id, 509);
    assert!(a.maps().state.services[&key].entry.has(flags::MAGLEV));
}

/// A change to one Service rebuilds that Service's table only; removing a backend keeps it in
/// the map until the new table no longer names it.
#[test]
fn an_endpoint_change_rebuilds_only_that_services_table() {
    let mut a = applier();
    a.apply(&maglev_desired(
        &[(10, "web", &[1, 2, 3]), (11, "api", &[4, 5])],
        251,
    ));
    let before = a.maps().state.clone();
    a.maps_mut().log.clear();
    let r = a.apply(&maglev_desired(
        &[(10, "web", &[1, 2]), (11, "api", &[4, 5])],
        251,
    ));
    assert!(r.is_clean(), "{r:?}");
    let log = a.maps().log.clone();
    let tables: Vec<u32> = log
        .iter()
        .filter_map(|op| match op {
            Op::PutMaglev(id, _) => Some(*id),
            _ => None,
        })
        .collect();
    assert_eq!(tables, vec![a.rev_nat_id(&fe(10)).unwrap()], "{log:?}");
    assert_consistent_from(before, &log);
    // The removed backend is deleted after the table that named it was replaced.
    let swapped = log.iter().position(|op| matches!(op, Op::PutMaglev(..))).unwrap();
    let deleted = log
        .iter()
        .position(|op| matches!(op, Op::DeleteBackend(..)))
        .expect("backend 3 deleted");
    assert!(swapped < deleted, "{log:?}");
    assert!(!maglev_targets(&a, 10).contains(&be(3)));
}

/// Off again (the annotation removed): the frontend entry loses the flag first, then the table
/// goes; removing the frontend removes its table.
#[test]
fn a_table_goes_after_the_entry_that_named_it() {
    let mut a = applier();
    a.apply(&maglev_desired(&[(10, "web", &[1, 2]), (11, "api", &[4])], 251));
    let before = a.maps().state.clone();
    a.maps_mut().log.clear();
    let mut off = maglev_desired(&[(11, "api", &[4])], 251);
    let mut plain = (*desired(&[(10, "web", &[1, 2])]).frontends[&fe(10)]).clone();
    plain.kind = FrontendKind::NodePort;
    off.frontends.insert(fe(10), plain.into());
    off.backends.extend([(be(1), 0), (be(2), 0)]);
    a.apply(&off);
    let log = a.maps().log.clone();
    let entry = log
        .iter()
        .position(|op| matches!(op, Op::PutService(k, v) if k.slot == 0 && !v.entry.has(flags::MAGLEV)))
        .expect("entry rewritten");
    let gone = log
        .iter()
        .position(|op| matches!(op, Op::DeleteMaglev(..)))
        .expect("table deleted");
    assert!(entry < gone, "{log:?}");
    assert_consistent_from(before, &log);
    assert_eq!(a.maps().state.maglev.len(), 1);
    assert_eq!(a.occupancy().maglev, 1);
    a.apply(&DesiredState::default());
    assert!(a.maps().state.maglev.is_empty());
    assert_eq!(a.occupancy().maglev, 0);
    assert!(a.maps().state.services.is_empty());
}

/// A restarted writer adopts the tables (no rewrite when nothing changed) and deletes a table
/// whose frontend is gone (left by a writer killed while removing it).
#[test]
fn recovery_adopts_tables_and_drops_orphans() {
    let d = maglev_desired(&[(10, "web", &[1, 2, 3])], 251);
    let mut a = applier();
    a.apply(&d);
    let mut maps = a.maps().clone();
    maps.state.maglev.insert(9999, Arc::from([1u32; 251]));
    maps.log.clear();
    let mut b = Applier::recover(maps, Capacities::default()).unwrap();
    assert_eq!(b.maps().log, vec![Op::DeleteMaglev(9999)]);
    assert_eq!(b.occupancy().maglev, 1);
    let r = b.apply(&d);
    assert_eq!((r.writes, r.deletes), (0, 0), "{:?}", b.maps().log);
}

/// `check_consistent` finds a table naming a missing backend, or of another size than its
/// frontend entry says.
#[test]
fn check_consistent_finds_a_broken_table() {
    let mut a = applier();
    a.apply(&maglev_desired(&[(10, "web", &[1, 2])], 251));
    let id = a.rev_nat_id(&fe(10)).unwrap();
    let mut state = a.maps().state.clone();
    state.maglev.insert(id, Arc::from([77u32; 251]));
    assert!(
        state
            .check_consistent()
            .unwrap_err()
            .contains("missing backend 77")
    );
    let mut state = a.maps().state.clone();
    state.maglev.insert(id, Arc::from([state.maglev[&id][0]; 250]));
    assert!(state.check_consistent().unwrap_err().contains("251"));
}

/// A full re-apply (a relist, a manifests sync) of unchanged Maglev frontends writes nothing: the
/// mirror compares what a table is built from, and builds a table only to write it.
#[test]
fn an_unchanged_maglev_table_is_not_rebuilt() {
    let d = maglev_desired(&[(10, "web", &[1, 2, 3]), (11, "api", &[4, 5])], 16381);
    let mut a = applier();
    a.apply(&d);
    a.maps_mut().log.clear();
    let r = a.apply(&d);
    assert_eq!((r.writes, r.deletes), (0, 0), "{:?}", a.maps().log);
}
