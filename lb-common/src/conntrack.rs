//! Connection tracking of the tc path (`lb4_ct`, `lb6_ct`, `lb4_ct_new`, `lb6_ct_new`, LRU): a NAT table. Each entry rewrites one
//! direction of one flow, keyed by the packet's tuple as the program sees it:
//!
//! | entry (dir)  | key                     | rewrites                         | written at        |
//! |--------------|-------------------------|----------------------------------|-------------------|
//! | forward DNAT (INGRESS) | client -> frontend | destination -> backend        | first packet      |
//! | SNAT (EGRESS)          | client -> backend  | source -> node IP:port        | first packet      |
//! | un-SNAT (INGRESS)      | backend -> node:port | destination -> client       | first packet      |
//! | un-DNAT (EGRESS)       | backend -> client  | source -> frontend            | first packet      |
//!
//! So the ingress program rewrites destinations and the egress program rewrites sources, each
//! with one lookup; translation happens before routing (DNAT, un-SNAT) and after it (SNAT,
//! un-DNAT), like netfilter's PREROUTING and POSTROUTING, and the kernel routes in between.
//! The un-SNAT entry is also the SNAT port reservation: it is inserted with BPF_NOEXIST, so two
//! flows can never share a post-SNAT tuple.
//!
//! Two flows can share a post-DNAT tuple, though: a client that uses one source port towards two
//! frontends with a common backend (its connections to two NodePorts, say) has two flows that
//! both leave as client -> backend. netfilter tells them apart by their original tuples; egress
//! sees only the packet. The second flow's SNAT entry then carries a tag (`CtKey::tag`,
//! [`snat_tag`]), its forward entry says so (`flags::SNAT_TAGGED`), and ingress puts a mark on its
//! packets for egress ([`FORWARD_MARK`]), which looks the tagged entry up. Every other entry has
//! tag 0.
//!
//! Two tables of this layout per family: `lb4_ct_new` holds a new flow's entries until its client
//! goes past the handshake (a TCP packet without SYN or RST, a second UDP datagram), then they
//! move to `lb4_ct`; lookups read `lb4_ct` first. A flood that never completes a handshake fills
//! and evicts only `lb4_ct_new`, so established flows keep their entries (nf_conntrack's
//! protection of ASSURED connections); see docs/architecture.md, "Two tables".
//!
//! All entries of one flow carry the same `created_ns`, which is how the agent's conntrack GC
//! (`lb-agent/src/datapath/conntrack.rs`) tells a flow's entries from those of a later flow on the
//! same tuple. The programs mark TCP closes (FIN, RST) and UDP activity; the GC frees what ended.

use crate::{
    family::{Family, V4, V6},
    user_pod,
};

/// `CtKey::dir`.
pub mod dir {
    /// Matched by the ingress program; rewrites the destination.
    pub const INGRESS: u8 = 0;
    /// Matched by the egress program; rewrites the source.
    pub const EGRESS: u8 = 1;
}

/// `CtValue::flags`.
pub mod flags {
    /// The flow is masqueraded (its forward DNAT entry has SNAT companions).
    pub const SNAT: u16 = 1 << 0;
    /// The entry rewrites reply packets (un-SNAT, un-DNAT).
    pub const REPLY: u16 = 1 << 1;
    /// The chosen backend is the client itself (hairpin).
    pub const HAIRPIN: u16 = 1 << 2;
    /// The flow's backend is on this node.
    pub const LOCAL_BACKEND: u16 = 1 << 3;
    /// A TCP FIN from the client passed this (forward) entry; `last_seen_ns` says when.
    pub const FIN_FORWARD: u16 = 1 << 4;
    /// A TCP FIN from the backend passed this (reply) entry; `last_seen_ns` says when.
    pub const FIN_REPLY: u16 = 1 << 5;
    /// A TCP RST passed this entry, in either direction; `last_seen_ns` says when.
    pub const RESET: u16 = 1 << 6;
    /// The close marks: a flow with RESET, or with FIN_FORWARD and FIN_REPLY, has ended, and the
    /// agent's conntrack GC frees its entries (and its masquerade port) after a grace period.
    pub const CLOSE_MARKS: u16 = FIN_FORWARD | FIN_REPLY | RESET;
    /// The client went past the TCP handshake: a packet of its without SYN or RST passed this
    /// (forward) entry. netfilter's ASSURED: a flow without it after `SYN_REUSE_NS` is one whose
    /// handshake never completed (a spoofed SYN's, in a flood), whose masquerade port a new flow
    /// may take when every port it tries is held, and which the conntrack GC frees after
    /// `--bpf-ct-timeout-regular-tcp-syn`.
    pub const ESTABLISHED: u16 = 1 << 7;
    /// Written on every entry of a flow by programs that mark `ESTABLISHED`. A flow without it
    /// was created by an earlier release's programs, which never mark it: it is never taken for
    /// one whose handshake did not complete.
    pub const HANDSHAKE_TRACKED: u16 = 1 << 8;
    /// The flow is masqueraded and its SNAT entry is keyed with [`super::snat_tag`] of its
    /// frontend: another live flow holds the untagged post-DNAT tuple. On its forward entry, which
    /// has ingress mark its packets ([`super::FORWARD_MARK`]) for egress to find the tagged entry.
    pub const SNAT_TAGGED: u16 = 1 << 9;
    /// The client is a socket of this node (its own SCTP, translated at tc egress: no socket hook
    /// runs for SCTP). On the flow's un-DNAT entry (backend -> client), which ingress then applies
    /// to the replies: they are delivered locally, and no egress runs for them.
    pub const LOCAL_CLIENT: u16 = 1 << 10;
}

/// skb->mark ingress sets on the forward packets of a `SNAT_TAGGED` flow: this magic in the top
/// 12 bits, the flow's rev_nat_id in the low 20 (as the un-SNAT mark of replies, whose magic is
/// `0x5EA`). Egress clears it once used.
pub const FORWARD_MARK: u32 = 0x5EB0_0000;

/// The tag of a `SNAT_TAGGED` flow's SNAT entry: from its frontend's id, never 0 (the untagged
/// entries' tag). Two frontends whose ids give one tag cannot both tag the same tuple; the second
/// then takes the untagged entry over, as before tags existed.
#[inline(always)]
pub const fn snat_tag(rev_nat_id: u32) -> u16 {
    (rev_nat_id % 0xFFFF) as u16 + 1
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey<F: Family> {
    pub saddr: F::Addr,
    pub daddr: F::Addr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// `dir::*`.
    pub dir: u8,
    /// 0, but for the SNAT entry of a `flags::SNAT_TAGGED` flow: [`snat_tag`] of its frontend.
    pub tag: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtValue<F: Family> {
    /// `bpf_ktime_get_coarse_ns()` when the flow was created.
    pub created_ns: u64,
    /// Last packet (UDP: every forward packet, reply packets at most once a second); TCP: the
    /// connection start, then the first FIN or RST seen on this entry (`flags::CLOSE_MARKS`).
    pub last_seen_ns: u64,
    /// The address written into the packet (destination for INGRESS, source for EGRESS).
    pub nat_addr: F::Addr,
    pub nat_port: u16,
    /// `flags::*`.
    pub flags: u16,
    /// The frontend of the flow.
    pub rev_nat_id: u32,
    /// The backend of the flow.
    pub backend_id: u32,
    pub _pad: F::Pad,
}

pub type Ct4Key = CtKey<V4>;
pub type Ct6Key = CtKey<V6>;
pub type Ct4Value = CtValue<V4>;
pub type Ct6Value = CtValue<V6>;

user_pod!(CtKey<V4>, CtKey<V6>, CtValue<V4>, CtValue<V6>);

#[cfg(test)]
mod layout {
    use core::mem::size_of;

    use super::*;

    #[test]
    fn snat_tags_are_never_zero() {
        for id in [0, 1, 0xFFFE, 0xFFFF, 0x1_0000, 0xF_FFFF, u32::MAX] {
            assert_ne!(snat_tag(id), 0, "{id:#x}");
        }
        assert_ne!(snat_tag(1), snat_tag(2));
    }

    #[test]
    fn sizes() {
        assert_eq!(size_of::<Ct4Key>(), 16);
        assert_eq!(size_of::<Ct4Value>(), 32);
        assert_eq!(size_of::<Ct6Key>(), 40);
        assert_eq!(size_of::<Ct6Value>(), 48);
    }
}
