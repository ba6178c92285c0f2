use lb_common::{
    conntrack::{Ct4Key, Ct4Value, Ct6Key, Ct6Value},
    family::In6Addr,
    proto,
};

use super::*;

const S: u64 = 1_000_000_000;
const CLIENT: [u8; 4] = [192, 0, 2, 10];
const NODE: [u8; 4] = [10, 0, 0, 1];
const BACKEND: [u8; 4] = [10, 244, 1, 5];

fn value(created: u64, nat: ([u8; 4], u16), flags: u16) -> Ct4Value {
    Ct4Value {
        created_ns: created,
        last_seen_ns: created,
        nat_addr: nat.0,
        nat_port: nat.1,
        flags,
        rev_nat_id: 1,
        backend_id: 1,
        _pad: Default::default(),
    }
}

/// A masqueraded NodePort flow as the programs write it: forward, SNAT, un-SNAT.
fn masqueraded(
    m: &mut HashMap<Ct4Key, Ct4Value>,
    proto: u8,
    cport: u16,
    snat_port: u16,
    at: u64,
) -> [Ct4Key; 3] {
    let fwd = tuple_key::<V4>(CLIENT, cport, NODE, 30080, proto, dir::INGRESS);
    let snat = tuple_key::<V4>(CLIENT, cport, BACKEND, 8080, proto, dir::EGRESS);
    let unsnat = tuple_key::<V4>(BACKEND, 8080, NODE, snat_port, proto, dir::INGRESS);
    m.insert(fwd, value(at, (BACKEND, 8080), flags::SNAT));
    m.insert(snat, value(at, (NODE, snat_port), flags::SNAT));
    m.insert(unsnat, value(at, (CLIENT, cport), flags::SNAT | flags::REPLY));
    [fwd, snat, unsnat]
}

/// A flow kept with its client address: forward and un-DNAT.
fn direct(m: &mut HashMap<Ct4Key, Ct4Value>, cport: u16, at: u64) -> [Ct4Key; 2] {
    let fwd = tuple_key::<V4>(CLIENT, cport, [10, 96, 0, 10], 80, proto::TCP, dir::INGRESS);
    let undnat = tuple_key::<V4>(BACKEND, 8080, CLIENT, cport, proto::TCP, dir::EGRESS);
    m.insert(fwd, value(at, (BACKEND, 8080), 0));
    m.insert(undnat, value(at, ([10, 96, 0, 10], 80), flags::REPLY));
    [fwd, undnat]
}

fn mark(m: &mut HashMap<Ct4Key, Ct4Value>, k: &Ct4Key, flag: u16, at: u64) {
    let v = m.get_mut(k).unwrap();
    v.flags |= flag;
    v.last_seen_ns = at;
}

fn doomed_keys(m: &HashMap<Ct4Key, Ct4Value>, now: u64) -> HashSet<(Ct4Key, Reason)> {
    plan(m, now, &GcTimeouts::default())
        .into_iter()
        .map(|d| (d.key, d.reason))
        .collect()
}

#[test]
fn a_flow_closed_by_both_sides_goes_whole_after_the_fin_timeout() {
    let mut m = HashMap::new();
    let [fwd, snat, unsnat] = masqueraded(&mut m, proto::TCP, 41000, 20001, 100 * S);
    mark(&mut m, &fwd, flags::FIN_FORWARD, 101 * S);
    mark(&mut m, &unsnat, flags::FIN_REPLY, 102 * S);
    assert!(
        doomed_keys(&m, 111 * S).is_empty(),
        "10 s after the first FIN, not the last"
    );
    let gone = doomed_keys(&m, 112 * S);
    let expect: HashSet<_> = [fwd, snat, unsnat]
        .into_iter()
        .map(|k| (k, Reason::Closed))
        .collect();
    assert_eq!(gone, expect);
}

#[test]
fn a_half_closed_flow_stays() {
    let mut m = HashMap::new();
    let [fwd, ..] = masqueraded(&mut m, proto::TCP, 41000, 20001, 100 * S);
    mark(&mut m, &fwd, flags::FIN_FORWARD, 101 * S);
    assert!(doomed_keys(&m, 10_000 * S).is_empty());
}

#[test]
fn a_reset_on_either_side_closes_and_a_direct_flow_goes_with_its_un_dnat_entry() {
    let mut m = HashMap::new();
    let [fwd, undnat] = direct(&mut m, 41000, 100 * S);
    mark(&mut m, &undnat, flags::RESET, 100 * S);
    let expect: HashSet<_> = [fwd, undnat].into_iter().map(|k| (k, Reason::Closed)).collect();
    assert_eq!(doomed_keys(&m, 110 * S), expect);
}

#[test]
fn open_tcp_flows_stay_however_old() {
    let mut m = HashMap::new();
    masqueraded(&mut m, proto::TCP, 41000, 20001, 100 * S);
    direct(&mut m, 41001, 100 * S);
    assert!(doomed_keys(&m, 1_000_000 * S).is_empty());
}

/// UDP flows, and SCTP associations (issue 17: their heartbeats keep them fresh), go by their idle
/// clock, which packets in either direction keep.
#[test]
fn udp_flows_and_sctp_associations_go_when_idle_in_both_directions() {
    for protocol in [proto::UDP, proto::SCTP] {
        let mut m = HashMap::new();
        let [fwd, snat, unsnat] = masqueraded(&mut m, protocol, 5353, 20001, 100 * S);
        // Only replies lately: alive.
        mark(&mut m, &unsnat, 0, 150 * S);
        assert!(doomed_keys(&m, 200 * S).is_empty(), "protocol {protocol}");
        let expect: HashSet<_> = [fwd, snat, unsnat]
            .into_iter()
            .map(|k| (k, Reason::Idle))
            .collect();
        assert_eq!(doomed_keys(&m, 210 * S), expect, "protocol {protocol}");
    }
}

#[test]
fn a_new_connection_on_the_same_client_tuple_keeps_its_entries_and_frees_the_old_port() {
    let mut m = HashMap::new();
    let [fwd, _, old_unsnat] = masqueraded(&mut m, proto::TCP, 41000, 20001, 100 * S);
    mark(&mut m, &fwd, flags::FIN_FORWARD, 101 * S);
    mark(&mut m, &old_unsnat, flags::FIN_REPLY, 101 * S);
    // A fresh SYN from the same client port: new forward and SNAT entries, another port.
    let [fwd2, snat2, unsnat2] = masqueraded(&mut m, proto::TCP, 41000, 20002, 150 * S);
    assert_eq!(fwd, fwd2);
    // The old un-SNAT entry (the old port's reservation) is no flow's any more.
    let gone = doomed_keys(&m, 151 * S);
    assert_eq!(gone, [(old_unsnat, Reason::Orphan)].into_iter().collect());
    assert!(!gone.iter().any(|(k, _)| [fwd2, snat2, unsnat2].contains(k)));
}

#[test]
fn entries_of_a_flow_being_created_are_not_orphans() {
    let mut m = HashMap::new();
    let [fwd, ..] = masqueraded(&mut m, proto::TCP, 41000, 20001, 100 * S);
    m.remove(&fwd);
    assert!(doomed_keys(&m, 101 * S).is_empty());
    assert_eq!(doomed_keys(&m, 130 * S).len(), 2, "orphans after the grace");
}

#[test]
fn many_closed_flows_towards_one_backend_free_their_ports() {
    let mut m = HashMap::new();
    for i in 0..5_000u16 {
        let [fwd, _, unsnat] = masqueraded(&mut m, proto::TCP, 30_000 + i, 20_000 + i, 100 * S);
        mark(&mut m, &fwd, flags::FIN_FORWARD, 100 * S);
        mark(&mut m, &unsnat, flags::FIN_REPLY, 100 * S);
    }
    let gone = plan(&m, 111 * S, &GcTimeouts::default());
    assert_eq!(gone.len(), m.len());
}

/// The IPv6 map goes through the same GC: a masqueraded flow's three entries, closed by both
/// sides, go together; an open one stays.
#[test]
fn ipv6_flows_are_collected_alike() {
    let addr = |last: u8| {
        let mut a = In6Addr::new([0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        a.octets[15] = last;
        a
    };
    let (client, node, backend) = (addr(10), addr(1), addr(5));
    let v = |nat: (In6Addr, u16), flags: u16| Ct6Value {
        created_ns: S,
        last_seen_ns: S,
        nat_addr: nat.0,
        nat_port: nat.1,
        flags,
        rev_nat_id: 7,
        backend_id: 3,
        _pad: Default::default(),
    };
    let mut m: HashMap<Ct6Key, Ct6Value> = HashMap::new();
    let flow = |m: &mut HashMap<Ct6Key, Ct6Value>, cport: u16| {
        let fwd = tuple_key::<V6>(client, cport, node, 30080, proto::TCP, dir::INGRESS);
        let snat = tuple_key::<V6>(client, cport, backend, 8080, proto::TCP, dir::EGRESS);
        let unsnat = tuple_key::<V6>(backend, 8080, node, 20000 + cport, proto::TCP, dir::INGRESS);
        m.insert(fwd, v((backend, 8080), flags::SNAT));
        m.insert(snat, v((node, 20000 + cport), flags::SNAT));
        m.insert(unsnat, v((client, cport), flags::SNAT | flags::REPLY));
        [fwd, snat, unsnat]
    };
    let closed = flow(&mut m, 1);
    let open = flow(&mut m, 2);
    for (key, fin) in [(closed[0], flags::FIN_FORWARD), (closed[2], flags::FIN_REPLY)] {
        let e = m.get_mut(&key).unwrap();
        e.flags |= fin;
        e.last_seen_ns = 2 * S;
    }
    let doomed: HashSet<(Ct6Key, Reason)> = plan(&m, 2 * S + 11 * S, &GcTimeouts::default())
        .into_iter()
        .map(|d| (d.key, d.reason))
        .collect();
    let want: HashSet<(Ct6Key, Reason)> = closed.iter().map(|k| (*k, Reason::Closed)).collect();
    assert_eq!(doomed, want);
    assert!(open.iter().all(|k| !doomed.iter().any(|(d, _)| d == k)));
    assert_eq!(flow_state(&closed[0], &m[&closed[0]], &m), FlowState::Closed);
}

/// A masqueraded TCP flow as the programs that track handshakes write it.
fn tracked(m: &mut HashMap<Ct4Key, Ct4Value>, cport: u16, snat_port: u16, at: u64) -> [Ct4Key; 3] {
    let keys = masqueraded(m, proto::TCP, cport, snat_port, at);
    for k in &keys {
        m.get_mut(k).unwrap().flags |= flags::HANDSHAKE_TRACKED;
    }
    keys
}

#[test]
fn a_handshake_that_never_completed_goes_after_the_syn_timeout() {
    let mut m = HashMap::new();
    let flow = tracked(&mut m, 41000, 20001, 100 * S);
    assert_eq!(flow_state(&flow[0], &m[&flow[0]], &m), FlowState::Handshake);
    assert!(doomed_keys(&m, 159 * S).is_empty(), "59 s old: kept");
    let gone = doomed_keys(&m, 160 * S);
    let expect: HashSet<_> = flow.into_iter().map(|k| (k, Reason::Unanswered)).collect();
    assert_eq!(gone, expect, "60 s old, unanswered: the whole flow and its port");
}

#[test]
fn an_established_flow_is_never_taken_for_an_unfinished_handshake() {
    let mut m = HashMap::new();
    let [fwd, ..] = tracked(&mut m, 41000, 20001, 100 * S);
    m.get_mut(&fwd).unwrap().flags |= flags::ESTABLISHED;
    assert_eq!(flow_state(&fwd, &m[&fwd], &m), FlowState::Open);
    assert!(
        doomed_keys(&m, 100_000 * S).is_empty(),
        "established TCP has no idle clock"
    );
}

#[test]
fn flows_of_programs_that_do_not_track_handshakes_are_kept() {
    // An earlier release's programs never mark ESTABLISHED: their flows look unanswered.
    let mut m = HashMap::new();
    let [fwd, ..] = masqueraded(&mut m, proto::TCP, 41000, 20001, 100 * S);
    assert_eq!(flow_state(&fwd, &m[&fwd], &m), FlowState::Open);
    assert!(doomed_keys(&m, 100_000 * S).is_empty());
}

#[test]
fn udp_flows_go_by_their_idle_clock_only() {
    let mut m = HashMap::new();
    let keys = masqueraded(&mut m, proto::UDP, 41000, 20001, 100 * S);
    for k in &keys {
        m.get_mut(k).unwrap().flags |= flags::HANDSHAKE_TRACKED;
    }
    mark(&mut m, &keys[0], 0, 150 * S);
    assert_eq!(flow_state(&keys[0], &m[&keys[0]], &m), FlowState::Open);
    assert!(doomed_keys(&m, 200 * S).is_empty(), "idle 50 s: kept");
    let gone = doomed_keys(&m, 210 * S);
    assert_eq!(gone, keys.into_iter().map(|k| (k, Reason::Idle)).collect());
}

/// Two masqueraded flows of one client port through two NodePorts with one backend share the
/// post-DNAT tuple; the second's SNAT entry is tagged (`flags::SNAT_TAGGED`). Each flow's entries
/// are its own: the second closing takes its tagged entry and leaves the first whole, and no entry
/// of either is an orphan.
#[test]
fn a_tagged_snat_entry_belongs_to_its_own_flow() {
    let mut m = HashMap::new();
    let first = masqueraded(&mut m, proto::TCP, 41000, 20001, 100 * S);
    let fwd2 = tuple_key::<V4>(CLIENT, 41000, NODE, 30081, proto::TCP, dir::INGRESS);
    let mut snat2 = tuple_key::<V4>(CLIENT, 41000, BACKEND, 8080, proto::TCP, dir::EGRESS);
    snat2.tag = lb_common::conntrack::snat_tag(2);
    let unsnat2 = tuple_key::<V4>(BACKEND, 8080, NODE, 20002, proto::TCP, dir::INGRESS);
    let second = |nat, flags| Ct4Value {
        rev_nat_id: 2,
        ..value(150 * S, nat, flags)
    };
    m.insert(fwd2, second((BACKEND, 8080), flags::SNAT | flags::SNAT_TAGGED));
    m.insert(snat2, second((NODE, 20002), flags::SNAT));
    m.insert(unsnat2, second((CLIENT, 41000), flags::SNAT | flags::REPLY));
    assert!(doomed_keys(&m, 1_000 * S).is_empty(), "two open flows, no orphan");
    mark(&mut m, &fwd2, flags::RESET, 200 * S);
    let gone = doomed_keys(&m, 300 * S);
    let expect: HashSet<_> = [fwd2, snat2, unsnat2]
        .into_iter()
        .map(|k| (k, Reason::Closed))
        .collect();
    assert_eq!(
        gone, expect,
        "the second flow goes whole, the first ({first:?}) stays"
    );
}
