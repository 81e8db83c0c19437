//! Unreliable datagram service between QPs of this host, and the address
//! handles UD sends name.
//!
//! A UD send completes as soon as it is sent: whatever happens at the
//! destination is invisible to the sender, as on the wire. The message is
//! delivered only to a UD QP of the device the AH resolved to when it was
//! created (the tenant check of `CreateAh` holds for the AH's life: a GID
//! that meanwhile names another tenant's device gets nothing), that is
//! ready to receive, whose Q_Key matches and that has a receive posted
//! with room for the GRH and the message. Everything else is dropped and
//! counted in the destination's (or, when there is none, the sender's)
//! [`DropCounts`]. The receive buffer starts with the 40-byte GRH as Linux
//! rxe writes it for RoCEv2 over IPv4: 20 zero bytes, then the IPv4 header
//! of the packet the message would have been (`rxe_resp.c`, the
//! `roce4grh` of `union rdma_network_hdr`). On an InfiniBand port an AH
//! may have no GRH (it named its destination by LID): its datagrams
//! arrive as on IB, the message still after the 40 bytes a GRH would
//! take, those bytes untouched and the completion without `GRH`; the
//! completion's `slid` is the sending port's LID (0 on Ethernet).

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Instant;

use vrdma_hostd_protocol::messages::AhSetup;
use vrdma_roce::{
    write_ipv4_udp_header, Ipv4Meta, BTH_LEN, DETH_LEN, ICRC_LEN, IMM_LEN, IPV4_HEADER_LEN,
};
use vrdma_spec::ring::{send_flags, wc_flags, Cqe, UdDest, GRH_SIZE, QKEY_CONTROLLED};
use vrdma_spec::verbs::{access, QpType, SendOpcode, WcOpcode, WcStatus};

use super::keys::{self, SgeList};
use super::rc::{done, QpRef, Step};
use super::wqe::{Local, SendWork};
use super::{DeviceId, Engine, EngineError};
use crate::gids::Gid;

/// An address handle: where UD sends naming it go.
#[derive(Debug, Clone)]
pub struct Ah {
    pub pd: u32,
    pub dgid: Gid,
    /// The destination device's tenant when the AH was created (and its
    /// reachability checked); empty for a remote one.
    pub tenant: Arc<str>,
    /// Its GID is on another host: datagrams go on the wire.
    pub remote: bool,
    pub hop_limit: u8,
    pub traffic_class: u8,
    /// Whether its datagrams carry a GRH (always on Ethernet; on
    /// InfiniBand only when the address vector had one).
    pub grh: bool,
}

/// Datagrams from the wire up to this many payload bytes are put into a
/// receive in one pass with their GRH (copied together on the stack).
const SMALL_DATAGRAM: usize = 256;

/// What a datagram needs of its AH, copied out of the device's table
/// (the AH's tenant, an `Arc`, is not cloned per datagram).
#[derive(Debug, Clone, Copy)]
pub struct AhPath {
    pub dgid: Gid,
    pub remote: bool,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub grh: bool,
}

impl AhPath {
    fn of(ah: &Ah) -> Self {
        AhPath {
            dgid: ah.dgid,
            remote: ah.remote,
            hop_limit: ah.hop_limit,
            traffic_class: ah.traffic_class,
            grh: ah.grh,
        }
    }
}

/// Why UD or UC messages were dropped, counted where they would have
/// arrived.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DropCounts {
    /// A UD message whose Q_Key did not match the receiving QP's.
    pub qkey: u64,
    /// No receive posted (UD, UC SEND or WRITE_WITH_IMM).
    pub no_receive: u64,
    /// No such QP, not ready to receive, of another type or not connected
    /// back (UC).
    pub no_qp: u64,
    /// The receive's buffers were too short or failed their checks, or a
    /// UC WRITE's remote key did.
    pub invalid: u64,
}

impl DropCounts {
    /// The non-zero counts by reason name, as the stats report them (as
    /// error statuses are: a reason appears once it happened).
    pub fn by_reason(&self) -> std::collections::BTreeMap<String, u64> {
        [
            ("qkey", self.qkey),
            ("no_receive", self.no_receive),
            ("no_qp", self.no_qp),
            ("invalid", self.invalid),
        ]
        .into_iter()
        .filter(|&(_, v)| v > 0)
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Adds `other`.
    pub fn add(&mut self, other: &DropCounts) {
        self.qkey += other.qkey;
        self.no_receive += other.no_receive;
        self.no_qp += other.no_qp;
        self.invalid += other.invalid;
    }
}

/// Which [`DropCounts`] field a drop goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drop {
    Qkey,
    NoReceive,
    NoQp,
    Invalid,
}

impl Engine {
    /// An address handle `s.ahn` of device `id` (hostd checked the tenant
    /// may reach its destination): a device of this host, or — when the
    /// engine is on a fabric — a GID on another host, whose datagrams go
    /// on the wire.
    pub fn create_ah(&mut self, id: DeviceId, s: &AhSetup) -> Result<(), EngineError> {
        let local = self
            .gids
            .get(&s.dgid)
            .and_then(|contexts| contexts.first())
            .and_then(|d| self.devices.get(d))
            .map(|d| Arc::clone(&d.tenant));
        let (tenant, remote) = match local {
            Some(tenant) => (tenant, false),
            None if self.wire.is_some() => (Arc::from(""), true),
            None => {
                return Err(EngineError::Unsupported(
                    "UD towards another host (this hostd is on no fabric)",
                ))
            }
        };
        let dev = self.device_mut(id)?;
        if dev.ahs.contains_key(&s.ahn) {
            return Err(EngineError::Exists("AH"));
        }
        dev.ahs.insert(
            s.ahn,
            Ah {
                pd: s.pd,
                dgid: s.dgid,
                tenant,
                remote,
                hop_limit: s.hop_limit,
                traffic_class: s.traffic_class,
                grh: s.dlid.is_none(),
            },
        );
        Ok(())
    }

    /// Destroys address handle `ahn`: later sends naming it fail.
    pub fn destroy_ah(&mut self, id: DeviceId, ahn: u32) -> Result<(), EngineError> {
        let dev = self.device_mut(id)?;
        dev.ahs
            .remove(&ahn)
            .map(|_| ())
            .ok_or(EngineError::Invalid("unknown address handle"))
    }

    /// Counts a dropped message on device slab index `di`.
    pub(super) fn count_drop(&mut self, di: usize, why: Drop) {
        if let Some(d) = self.devices.at_mut(di) {
            let c = &mut d.counters.dropped;
            match why {
                Drop::Qkey => c.qkey += 1,
                Drop::NoReceive => c.no_receive += 1,
                Drop::NoQp => c.no_qp += 1,
                Drop::Invalid => c.invalid += 1,
            }
        }
    }

    /// Sends UD WQE `work` of QP `qref`: the step completes it (successfully
    /// unless the WQE itself is wrong), whatever becomes of the message.
    pub(super) fn ud_send(&mut self, qref: QpRef, work: &SendWork, now: Instant) -> Step {
        let Some(qp) = self.qps.get(qref) else {
            return done(WcStatus::LocQpOpErr);
        };
        let (device, di, pd, vqpn, my_qkey, src_gid) =
            (qp.device, qp.dev, qp.pd, qp.vqpn, qp.qkey, qp.gid);
        if !matches!(work.opcode, SendOpcode::Send | SendOpcode::SendWithImm) {
            return done(WcStatus::LocQpOpErr);
        }
        if work.length > u64::from(self.port_mtu) {
            return done(WcStatus::LocLenErr);
        }
        let dest = UdDest::of_parts(work.rkey, work.remote_addr);
        let Some(found) = (self.devices.at(di))
            .and_then(|d| d.ahs.get(&dest.ah))
            .filter(|ah| ah.pd == pd)
        else {
            return done(WcStatus::LocQpOpErr);
        };
        // The AH's fields are copied out (its tenant, an Arc, is not cloned
        // per datagram). A local AH's destination, looked up while the AH
        // is at hand: its device, still of the tenant it was checked
        // against (any of its contexts: a QP number names one QP of the
        // device).
        let ah = AhPath::of(found);
        let target = (!ah.remote)
            .then(|| {
                (self.gids.get(&ah.dgid))
                    .and_then(|contexts| contexts.first())
                    .and_then(|id| self.devices.index(id))
                    .filter(|&i| (self.devices.at(i)).is_some_and(|d| d.tenant == found.tenant))
            })
            .flatten();
        if !self.keys.check_sges(device, pd, work.sges(), 0) {
            return done(WcStatus::LocProtErr);
        }
        let qkey = if dest.remote_qkey & QKEY_CONTROLLED != 0 {
            my_qkey
        } else {
            dest.remote_qkey
        };
        if ah.remote {
            return self.ud_send_remote(qref, work, &ah, dest.remote_qpn, qkey, now);
        }
        // The destination device, then its UD QP.
        let Some(first_di) = target else {
            self.count_drop(di, Drop::NoQp);
            return done(WcStatus::Success);
        };
        let peer = self.qp_at(&ah.dgid, dest.remote_qpn).filter(|&p| {
            self.qps
                .get(p)
                .is_some_and(|p| p.qp_type == QpType::Ud && p.receives())
        });
        let Some((peer, dest_di)) = peer.and_then(|p| Some((p, self.qps.get(p)?.dev))) else {
            self.count_drop(first_di, Drop::NoQp);
            return done(WcStatus::Success);
        };
        if self.qps.get(peer).is_some_and(|p| p.qkey != qkey) {
            self.count_drop(dest_di, Drop::Qkey);
            return done(WcStatus::Success);
        }
        let grh = ah.grh.then(|| grh(&src_gid, &ah, work));
        let slid = self.devices.at(di).map_or(0, |d| d.lid);
        let from = Sender {
            qpn: vqpn,
            lid: slid,
        };
        self.deliver_datagram(qref, peer, work, grh.as_ref().map(|g| &g[..]), from);
        done(WcStatus::Success)
    }

    /// Puts the GRH (if the datagram has one) and the message into
    /// `peer`'s next receive and completes it, or drops the message (no
    /// receive, or one too short or whose buffers fail their checks: the
    /// receive stays posted).
    fn deliver_datagram(
        &mut self,
        qref: QpRef,
        peer: QpRef,
        work: &SendWork,
        grh: Option<&[u8]>,
        from: Sender,
    ) {
        let message = Datagram {
            payload: Payload::Local(qref, work),
            length: work.length,
            imm: (work.opcode == SendOpcode::SendWithImm).then_some(work.imm_data),
            solicited: work.flags & send_flags::SOLICITED != 0,
            grh,
            from,
        };
        self.deliver(peer, &message);
    }

    /// Delivers `m` to UD QP `peer` (see [`Engine::deliver_datagram`]).
    pub(super) fn deliver(&mut self, peer: QpRef, m: &Datagram<'_>) {
        let Some(p) = self.qps.get(peer) else {
            return;
        };
        let dest_di = p.dev;
        // No RNR for UD: the time argument is never used. A malformed
        // receive completes in error and moves the QP to ERR, as on RC.
        match self.head_receive(peer, std::time::Duration::ZERO) {
            Ok(()) => {}
            Err(Step::Rnr(_)) => {
                self.count_drop(dest_di, Drop::NoReceive);
                return;
            }
            Err(Step::Complete {
                fail_responder: Some(p),
                ..
            }) => {
                self.fail_qp(p, false, "a receive it posted is malformed");
                return;
            }
            Err(_) => return,
        }
        let Some(p) = self.qps.get(peer) else {
            return;
        };
        let needed = u64::from(GRH_SIZE) + m.length;
        let dst = SgeList::new(
            &self.keys,
            p.device,
            p.pd,
            p.rq_head.sges(),
            access::LOCAL_WRITE,
        );
        if p.rq_head.length < needed || !dst.all_valid() {
            self.count_drop(dest_di, Drop::Invalid);
            return;
        }
        let at = u64::from(GRH_SIZE);
        let copied = match (m.grh, &m.payload) {
            // A small datagram from the wire lands in one pass, GRH and
            // payload together (one walk of the receive's SGEs, not two).
            (Some(grh), Payload::Bytes(bytes))
                if bytes.len() <= SMALL_DATAGRAM && grh.len() == GRH_SIZE as usize =>
            {
                let mut whole = [0u8; GRH_SIZE as usize + SMALL_DATAGRAM];
                let (head, tail) = whole.split_at_mut(grh.len());
                head.copy_from_slice(grh);
                tail[..bytes.len()].copy_from_slice(bytes);
                keys::write_bytes(&whole[..grh.len() + bytes.len()], &dst)
            }
            (grh, payload) => {
                grh.is_none_or(|grh| keys::write_bytes(grh, &dst))
                    && match payload {
                        Payload::Bytes(bytes) => keys::scatter(bytes, &dst, at),
                        Payload::Local(qref, work) => match (work.local, self.qps.get(*qref)) {
                            (Local::Inline(_), _) => keys::scatter(work.inline(), &dst, at),
                            (_, Some(qp)) => {
                                let src =
                                    SgeList::new(&self.keys, qp.device, qp.pd, work.sges(), 0);
                                keys::copy_between(&src, 0, &dst, at, work.length)
                            }
                            (_, None) => false,
                        },
                    }
            }
        };
        if !copied {
            self.count_drop(dest_di, Drop::Invalid);
            return;
        }
        let mut cqe = Cqe {
            wr_id: p.rq_head.wr_id.into(),
            status: WcStatus::Success.into(),
            opcode: WcOpcode::Recv.into(),
            wc_flags: if m.grh.is_some() { wc_flags::GRH } else { 0 },
            slid: m.from.lid.into(),
            byte_len: u32::try_from(needed).unwrap_or(u32::MAX).into(),
            qp_num: p.vqpn.into(),
            src_qp: m.from.qpn.into(),
            ..Cqe::default()
        };
        if let Some(imm) = m.imm {
            cqe.imm_data = imm;
            cqe.wc_flags |= wc_flags::WITH_IMM;
        }
        self.complete_recv(peer, &cqe, m.solicited);
    }
}

/// A datagram on its way into a receive.
pub(super) struct Datagram<'a> {
    pub payload: Payload<'a>,
    pub length: u64,
    pub imm: Option<[u8; 4]>,
    pub solicited: bool,
    /// The 40 bytes the receive buffer starts with, if it has a GRH.
    pub grh: Option<&'a [u8]>,
    pub from: Sender,
}

/// Where a datagram's bytes are.
pub(super) enum Payload<'a> {
    /// In the send WQE of a QP of this host.
    Local(QpRef, &'a SendWork),
    /// In a packet that came from the wire.
    Bytes(&'a [u8]),
}

/// Who sent a datagram, as its receiver's completion names it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sender {
    pub qpn: u32,
    /// The sending port's LID (0 on Ethernet).
    pub lid: u16,
}

/// The GRH of a UD message from the device of `src` through `ah`: as
/// RoCEv2 over IPv4 puts it in the receive buffer, 20 zero bytes and the
/// packet's IPv4 header (TOS the traffic class, TTL the hop limit, total
/// length the whole packet's: IPv4, UDP, BTH, DETH, immediate, payload,
/// ICRC; DF set and ID 0, as vrdma and Linux send RoCE).
pub fn grh(src: &Gid, ah: &AhPath, work: &SendWork) -> [u8; GRH_SIZE as usize] {
    let ip = |gid: &Gid| Ipv4Addr::from(vrdma_spec::gid::ipv4_of(gid).unwrap_or([0; 4]));
    let imm = if work.opcode == SendOpcode::SendWithImm {
        IMM_LEN
    } else {
        0
    };
    let payload = usize::try_from(work.length).unwrap_or(usize::MAX);
    let udp_payload = BTH_LEN + DETH_LEN + imm + payload + ICRC_LEN;
    let meta = Ipv4Meta::outgoing(ip(src), ip(&ah.dgid), 0);
    let mut headers = [0u8; 28];
    let mut out = [0u8; GRH_SIZE as usize];
    let offset = GRH_SIZE as usize - IPV4_HEADER_LEN;
    if write_ipv4_udp_header(
        &mut headers,
        &meta,
        ah.traffic_class,
        ah.hop_limit,
        udp_payload,
    )
    .is_ok()
    {
        out[offset..].copy_from_slice(&headers[..IPV4_HEADER_LEN]);
    }
    out
}
