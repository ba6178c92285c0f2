//! The map entries of one frontend, built from its plan ([`entries_for`]), and the conversions
//! between the plan's names and what the maps store (`lb_svc_names`, backend values).

use std::collections::{BTreeMap, BTreeSet};

use lb_common::{
    affinity::AffinityMatchKey,
    backend::Backend4Value,
    revnat::{NAME_LEN, PORT_NAME_LEN, RevNat4Value, SvcName},
    service::{SrcRange4, Svc4Key, Svc4Value},
};

use crate::{
    model::{Protocol, ServicePortName},
    plan::{BackendAddr, Frontend, FrontendPlan},
};

/// Everything the maps hold for one frontend (its `lb_svc_names` entry is `svc_name(&service)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct FrontendEntries {
    pub rev_nat_id: u32,
    pub service: ServicePortName,
    pub services: BTreeMap<Svc4Key, Svc4Value>,
    pub revnat: RevNat4Value,
    pub affinity_match: BTreeSet<AffinityMatchKey>,
    pub source_ranges: BTreeSet<(u32, SrcRange4Ord)>,
}

/// `SrcRange4` with an order, for sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct SrcRange4Ord([u8; 4], [u8; 4]);

impl From<SrcRange4Ord> for SrcRange4 {
    fn from(r: SrcRange4Ord) -> Self {
        SrcRange4 {
            rev_nat_id_be: r.0,
            addr: r.1,
        }
    }
}

impl From<SrcRange4> for SrcRange4Ord {
    fn from(r: SrcRange4) -> Self {
        SrcRange4Ord(r.rev_nat_id_be, r.addr)
    }
}

/// `s` in a zero-padded field, cut at a character boundary: what is stored is valid UTF-8 and
/// reads back (`unfixed`) to a string that stores to the same bytes, so a restarted agent finds
/// its own names unchanged.
fn fixed<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    let mut n = s.len().min(N);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
    out
}

fn unfixed(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// The operator-facing name of a frontend.
pub fn svc_name(name: &ServicePortName) -> SvcName {
    SvcName {
        namespace: fixed::<NAME_LEN>(&name.namespace),
        name: fixed::<NAME_LEN>(&name.name),
        port_name: fixed::<PORT_NAME_LEN>(&name.port),
    }
}

/// Reads a `ServicePortName` back from the maps.
pub fn service_port_name(name: &SvcName, proto: u8) -> ServicePortName {
    ServicePortName {
        namespace: unfixed(&name.namespace),
        name: unfixed(&name.name),
        port: unfixed(&name.port_name),
        protocol: protocol_from(proto).unwrap_or(Protocol::Tcp),
    }
}

pub fn protocol_from(n: u8) -> Option<Protocol> {
    match n {
        lb_common::proto::TCP => Some(Protocol::Tcp),
        lb_common::proto::UDP => Some(Protocol::Udp),
        lb_common::proto::SCTP => Some(Protocol::Sctp),
        _ => None,
    }
}

pub(super) fn backend_value(addr: &BackendAddr, flags: u8) -> Backend4Value {
    Backend4Value {
        addr: addr.addr.octets(),
        port: addr.port,
        proto: addr.proto.number(),
        flags,
    }
}

/// Why a frontend's entries cannot be built.
#[derive(Debug)]
pub(super) enum EntriesError {
    /// A backend has no id (the backends map is full).
    NoBackendId(BackendAddr),
    /// A scope has more backends than `Svc4Value::count` (a `u16`) can count. The plan never
    /// asks for this (`MAX_BACKENDS_PER_SCOPE`); checked here so that it could never wrap.
    TooManyBackends(usize),
}

/// The map entries of one frontend.
pub(super) fn entries_for(
    frontend: &Frontend,
    plan: &FrontendPlan,
    rev_nat_id: u32,
    backend_id: &dyn Fn(&BackendAddr) -> Option<u32>,
) -> Result<FrontendEntries, EntriesError> {
    let proto = frontend.proto.number();
    let addr = frontend.addr.octets();
    let mut services = BTreeMap::new();
    let mut affinity_match = BTreeSet::new();
    for scope in &plan.scopes {
        let key = Svc4Key::new(addr, frontend.port, proto, scope.scope, 0);
        let count = u16::try_from(scope.backends.len())
            .map_err(|_| EntriesError::TooManyBackends(scope.backends.len()))?;
        for (slot, backend) in (1..=count).zip(&scope.backends) {
            let id = backend_id(backend).ok_or(EntriesError::NoBackendId(*backend))?;
            services.insert(key.with_slot(slot), Svc4Value::slot(rev_nat_id, id));
            if plan.affinity_timeout > 0 {
                affinity_match.insert(AffinityMatchKey {
                    backend_id: id,
                    rev_nat_id,
                });
            }
        }
        services.insert(
            key,
            Svc4Value::frontend(rev_nat_id, count, scope.flags, plan.affinity_timeout),
        );
    }
    let source_ranges = plan
        .source_ranges
        .iter()
        .map(|net| {
            (
                SrcRange4::prefix_len(net.prefix_len()),
                SrcRange4::new(rev_nat_id, net.network().octets()).into(),
            )
        })
        .collect();
    Ok(FrontendEntries {
        rev_nat_id,
        service: plan.service.clone(),
        services,
        revnat: RevNat4Value {
            addr,
            port: frontend.port,
            proto,
            _pad: 0,
        },
        affinity_match,
        source_ranges,
    })
}
