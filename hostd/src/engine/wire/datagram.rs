//! UD on the wire: a send naming an address handle on another host goes
//! out as one RoCEv2 SEND ONLY packet (BTH, DETH with the Q_Key and the
//! sender's QP number, the immediate if any); a UD packet that arrives is
//! delivered to the UD QP it names, as a datagram from this host's
//! devices is (`engine::ud`).
//!
//! What a receiver accepts: its QP exists, is UD and ready to receive,
//! its tenant may reach the network of the packet's source GID (the
//! directory's word, the check a connection gets at RTR on each side), and
//! the DETH's Q_Key is the QP's. The receive buffer starts with the GRH as
//! a RoCEv2 device writes it for IPv4: 20 zero bytes, then the packet's
//! IPv4 header as it arrived.

use std::net::Ipv4Addr;
use std::time::Instant;

use vrdma_roce::{Bth, Deth, Headers, Ipv4Meta, Opcode, Packet, Psn, DEFAULT_PKEY};
use vrdma_spec::gid::{ipv4_mapped, ipv4_of};
use vrdma_spec::ring::{send_flags, GRH_SIZE};
use vrdma_spec::verbs::{QpType, SendOpcode, WcStatus};

use super::state::Path;
use super::{Emit, Wire};
use crate::engine::rc::{done, QpRef, Step};
use crate::engine::ud::{AhPath, Datagram, Drop, Payload, Sender};
use crate::engine::wqe::SendWork;
use crate::engine::Engine;

/// PSNs are 24 bits.
const PSN_MASK: u32 = 0x00ff_ffff;

impl Engine {
    /// Sends UD WQE `work` of `qref` to QP `dest_qpn` behind remote AH
    /// `ah` with Q_Key `qkey` (the WQE's checks passed). It completes once
    /// the packet is queued; a full queue makes it wait, not drop.
    pub(in crate::engine) fn ud_send_remote(
        &mut self,
        qref: QpRef,
        work: &SendWork,
        ah: &AhPath,
        dest_qpn: u32,
        qkey: u32,
        _now: Instant,
    ) -> Step {
        let Some(qp) = self.qps.get(qref) else {
            return done(WcStatus::LocQpOpErr);
        };
        let (device, pd, vqpn, psn, di) = (qp.device, qp.pd, qp.vqpn, qp.ud_psn, qp.dev);
        let ends = ipv4_of(&qp.gid).zip(ipv4_of(&ah.dgid));
        let Some((src, dst)) = ends.map(|(s, d)| (Ipv4Addr::from(s), Ipv4Addr::from(d))) else {
            // Not an IPv4 GID: nothing on this fabric has it.
            self.count_drop(di, Drop::NoQp);
            return done(WcStatus::Success);
        };
        let Some(mut w) = self.wire.take() else {
            self.count_drop(di, Drop::NoQp);
            return done(WcStatus::Success);
        };
        let path = Path {
            src,
            dst,
            tos: ah.traffic_class,
            dest_qpn,
            mtu: self.port_mtu,
        };
        let imm = work.opcode == SendOpcode::SendWithImm;
        let mut h = Headers::new(Bth {
            opcode: if imm {
                Opcode::UdSendOnlyImm
            } else {
                Opcode::UdSendOnly
            },
            solicited: work.flags & send_flags::SOLICITED != 0,
            migreq: false,
            pad: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp: dest_qpn,
            ack_req: false,
            psn: Psn::new(psn),
        });
        h.deth = Some(Deth { qkey, src_qp: vqpn });
        if imm {
            h.imm = Some(work.imm_data);
        }
        let len = usize::try_from(work.length).unwrap_or(usize::MAX);
        let fill = super::requester::fill_payload(&self.keys, device, pd, work, 0);
        let emitted = w.emit(&path, &h, len, fill);
        self.wire = Some(w);
        match emitted {
            Emit::Sent => {
                if let Some(qp) = self.qps.get_mut(qref) {
                    qp.ud_psn = psn.wrapping_add(1) & PSN_MASK;
                }
                done(WcStatus::Success)
            }
            Emit::Full => Step::Blocked,
            Emit::LocalError => done(WcStatus::LocProtErr),
        }
    }

    /// A UD packet from peer host `peer`, whose source GID is in
    /// `network`; `ip_header` is the 20 bytes of its IPv4 header.
    pub(super) fn datagram(
        &mut self,
        w: &mut Wire,
        peer: usize,
        network: &str,
        meta: &Ipv4Meta,
        ip_header: &[u8],
        pkt: &Packet<'_>,
    ) {
        if pkt.bth.dest_qp == crate::engine::gsi::GSI_QPN {
            let tos = ip_header.get(1).copied().unwrap_or(0);
            self.gsi_receive(w, peer, network, meta, tos, pkt);
            return;
        }
        let Some(deth) = pkt.deth else {
            w.drop_packet(peer, "missing_deth");
            return;
        };
        let dgid = ipv4_mapped(meta.dst.octets());
        let dest = (meta.dst, pkt.bth.dest_qp);
        let cached = (w.last_ud)
            .filter(|&(ip, qpn, q, serial)| {
                (ip, qpn) == dest && self.qps.get(q).is_some_and(|qp| qp.serial == serial)
            })
            .map(|(_, _, q, _)| q);
        let target = cached
            .or_else(|| self.qp_at(&dgid, pkt.bth.dest_qp))
            .and_then(|q| {
                let qp = self.qps.get(q)?;
                w.last_ud = Some((dest.0, dest.1, q, qp.serial));
                (qp.qp_type == QpType::Ud && qp.receives()).then_some((q, qp.dev, qp.qkey))
            });
        let Some((qref, di, qkey)) = target else {
            // Counted on the device the GID names too, if there is one:
            // its tenant sees what it missed.
            let first = (self.gids.get(&dgid))
                .and_then(|contexts| contexts.first())
                .and_then(|id| self.devices.index(id));
            if let Some(di) = first {
                self.count_drop(di, Drop::NoQp);
            }
            w.drop_packet(peer, "ud_no_qp");
            return;
        };
        let reaches = (self.devices.at(di)).is_some_and(|d| d.policy.may_reach(network));
        if !reaches {
            w.drop_packet(peer, "ud_unreachable_source");
            return;
        }
        if deth.qkey != qkey {
            self.count_drop(di, Drop::Qkey);
            w.drop_packet(peer, "ud_qkey");
            return;
        }
        let mut grh = [0u8; GRH_SIZE as usize];
        if let Some(tail) = grh.get_mut(GRH_SIZE as usize - ip_header.len()..) {
            tail.copy_from_slice(ip_header);
        }
        let message = Datagram {
            payload: Payload::Bytes(pkt.payload),
            length: pkt.payload.len() as u64,
            imm: pkt.imm,
            solicited: pkt.bth.solicited,
            grh: Some(&grh),
            from: Sender {
                qpn: deth.src_qp,
                lid: 0,
            },
        };
        self.deliver(qref, &message);
    }
}
