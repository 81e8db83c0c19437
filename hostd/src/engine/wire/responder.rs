//! The responder of a QP whose peer is on another host: request packets
//! are taken strictly in PSN order. A packet ahead of the expected PSN is
//! NAKed once (PSN sequence error) and dropped; one behind it is a
//! duplicate: acknowledged again (SEND, WRITE), answered again from memory
//! (READ) or with the result it had (atomic — never executed twice).
//! Every key, range and access is checked per packet against the key
//! table as it is then. Remote access errors leave the responder as it is
//! (a peer's bad rkey cannot knock a QP into ERR); a SEND that its receive
//! cannot take fails the receive and the QP, as on the local path.

use std::time::Instant;

use vrdma_roce::{Aeth, AtomicAckEth, NakCode, Packet, Psn};
use vrdma_spec::ring::{wc_flags, Cqe};
use vrdma_spec::verbs::{access, QpType, WcOpcode, WcStatus};

use super::state::{packets, ReadResponse, Receiving};
use super::{op, Emit, Wire};
use crate::engine::keys::{self, SgeList};
use crate::engine::rc::{QpRef, Step};
use crate::engine::{rnr_timer, Engine};

/// What taking a request packet came to.
pub(super) enum Verdict {
    /// Taken: the expected PSN moves on by this many.
    Taken(u32),
    /// No receive: RNR NAK, the PSN stays.
    Rnr,
    /// NAK with this code; the responder goes to ERR if `fatal`.
    Nak { code: NakCode, fatal: bool },
    /// Dropped without an answer (counted by this reason).
    Drop(&'static str),
}

impl Engine {
    /// A request packet for remote QP `qref` (its connection and readiness
    /// already checked).
    pub(super) fn request(&mut self, w: &mut Wire, qref: QpRef, pkt: &Packet<'_>, now: Instant) {
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return;
        };
        let peer = remote.conn.peer;
        let psn = pkt.bth.psn;
        let d = psn.diff(remote.epsn);
        if d > 0 {
            // A gap: the packets before it were lost.
            if !remote.nak_sent {
                remote.nak_sent = true;
                let (epsn, msn) = (remote.epsn, remote.msn);
                let path = remote.conn.path;
                w.nak_sent(peer, "psn_sequence");
                send_ack(
                    w,
                    &path,
                    epsn,
                    Aeth::Nak {
                        code: NakCode::PsnSequenceError,
                        msn,
                    },
                );
            }
            tracing::debug!(
                psn = psn.get(),
                ahead = d,
                "Request ahead of the expected PSN dropped"
            );
            w.drop_packet(peer, "psn_ahead");
            return;
        }
        if d < 0 {
            self.duplicate(w, qref, pkt, now);
            return;
        }
        let opcode = pkt.bth.opcode as u8;
        let verdict = self.take_request(w, qref, opcode, pkt, now);
        let Some(qp) = self.qps.get_mut(qref) else {
            return;
        };
        let Some(remote) = qp.remote.as_deref_mut() else {
            return;
        };
        let path = remote.conn.path;
        match verdict {
            Verdict::Taken(n) => {
                remote.epsn = remote.epsn.add(n);
                remote.nak_sent = false;
                if pkt.bth.ack_req && op::is_send_or_write(opcode) {
                    w.ack_due(qref, remote);
                }
            }
            Verdict::Rnr => {
                let timer = remote.conn.min_rnr_timer;
                let msn = remote.msn;
                w.nak_sent(peer, "rnr");
                send_ack(w, &path, psn, Aeth::RnrNak { timer, msn });
            }
            Verdict::Nak { code, fatal } => {
                let msn = remote.msn;
                // The request is consumed: a retry of it is a duplicate.
                remote.epsn = remote.epsn.add(1);
                remote.receiving = Receiving::Nothing;
                w.nak_sent(peer, nak_label(code));
                send_ack(w, &path, psn, Aeth::Nak { code, msn });
                if fatal {
                    self.fail_qp(qref, false, "a request it received failed");
                }
            }
            Verdict::Drop(why) => w.drop_packet(peer, why),
        }
    }

    /// Takes the request packet at the expected PSN.
    pub(super) fn take_request(
        &mut self,
        w: &mut Wire,
        qref: QpRef,
        opcode: u8,
        pkt: &Packet<'_>,
        now: Instant,
    ) -> Verdict {
        let Some(qp) = self.qps.get(qref) else {
            return Verdict::Drop("unknown_qp");
        };
        let Some(remote) = qp.remote.as_deref() else {
            return Verdict::Drop("unknown_qp");
        };
        let mtu = u64::from(remote.conn.path.mtu);
        let receiving = remote.receiving;
        // Opcode sequence (IBA 9.7.5.1.1): a FIRST opens a message its
        // MIDDLEs and LAST continue; anything else out of place is an
        // invalid request.
        let continues = op::is_middle_or_last(opcode);
        let in_send = matches!(receiving, Receiving::Send { .. });
        let in_write = matches!(receiving, Receiving::Write { .. });
        let fits_sequence = if continues {
            (op::is_send(opcode) && in_send) || (op::is_write(opcode) && in_write)
        } else {
            receiving == Receiving::Nothing
        };
        if !fits_sequence {
            return Verdict::Nak {
                code: NakCode::InvalidRequest,
                fatal: true,
            };
        }
        let payload = pkt.payload;
        // Every packet but a message's last carries exactly one MTU.
        if op::is_first_or_middle(opcode) && payload.len() as u64 != mtu {
            return Verdict::Nak {
                code: NakCode::InvalidRequest,
                fatal: true,
            };
        }
        if payload.len() as u64 > mtu {
            return Verdict::Nak {
                code: NakCode::InvalidRequest,
                fatal: true,
            };
        }
        match opcode {
            op::SEND_FIRST
            | op::SEND_MIDDLE
            | op::SEND_LAST
            | op::SEND_LAST_IMM
            | op::SEND_ONLY
            | op::SEND_ONLY_IMM => self.take_send(qref, opcode, pkt),
            op::WRITE_FIRST
            | op::WRITE_MIDDLE
            | op::WRITE_LAST
            | op::WRITE_LAST_IMM
            | op::WRITE_ONLY
            | op::WRITE_ONLY_IMM => self.take_write(qref, opcode, pkt),
            op::READ_REQUEST => self.take_read(w, qref, pkt, now),
            op::CMP_SWAP | op::FETCH_ADD => self.take_atomic(w, qref, opcode, pkt),
            _ => Verdict::Nak {
                code: NakCode::InvalidRequest,
                fatal: true,
            },
        }
    }

    /// A SEND packet: into the head receive at its place; the last one
    /// completes the receive.
    fn take_send(&mut self, qref: QpRef, opcode: u8, pkt: &Packet<'_>) -> Verdict {
        let Some(qp) = self.qps.get(qref) else {
            return Verdict::Drop("unknown_qp");
        };
        let Some(remote) = qp.remote.as_deref() else {
            return Verdict::Drop("unknown_qp");
        };
        let rnr = rnr_timer(remote.conn.min_rnr_timer);
        let offset = match remote.receiving {
            Receiving::Send { offset } => offset,
            _ => 0,
        };
        let src_qp = remote.conn.path.dest_qpn;
        match self.head_receive(qref, rnr) {
            Ok(()) => {}
            Err(Step::Rnr(_)) => return Verdict::Rnr,
            Err(Step::Complete { status, .. }) => {
                // The receive was completed in error by `head_receive`.
                return Verdict::Nak {
                    code: if status == WcStatus::RemInvReqErr {
                        NakCode::InvalidRequest
                    } else {
                        NakCode::RemoteOperationalError
                    },
                    fatal: true,
                };
            }
            Err(_) => return Verdict::Drop("receive_unreadable"),
        }
        let Some(qp) = self.qps.get(qref) else {
            return Verdict::Drop("unknown_qp");
        };
        let (device, pd, vqpn) = (qp.device, qp.pd, qp.vqpn);
        let recv_id = qp.rq_head.wr_id;
        let end = offset + pkt.payload.len() as u64;
        if end > qp.rq_head.length {
            return self.receive_refused(qref, recv_id, WcStatus::LocLenErr);
        }
        let landed = {
            let dst = SgeList::new(
                &self.keys,
                device,
                pd,
                qp.rq_head.sges(),
                access::LOCAL_WRITE,
            );
            keys::scatter(pkt.payload, &dst, offset)
        };
        if !landed {
            return self.receive_refused(qref, recv_id, WcStatus::LocProtErr);
        }
        let last = op::is_last_or_only(opcode);
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return Verdict::Drop("unknown_qp");
        };
        if !last {
            remote.receiving = Receiving::Send { offset: end };
            return Verdict::Taken(1);
        }
        remote.receiving = Receiving::Nothing;
        remote.msn = remote.msn.wrapping_add(1) & 0xff_ffff;
        let mut cqe = Cqe {
            wr_id: recv_id.into(),
            status: WcStatus::Success.into(),
            opcode: WcOpcode::Recv.into(),
            byte_len: u32::try_from(end).unwrap_or(u32::MAX).into(),
            qp_num: vqpn.into(),
            src_qp: src_qp.into(),
            ..Cqe::default()
        };
        if let Some(imm) = pkt.imm {
            cqe.imm_data = imm;
            cqe.wc_flags = wc_flags::WITH_IMM;
        }
        self.complete_recv(qref, &cqe, pkt.bth.solicited);
        Verdict::Taken(1)
    }

    /// The SEND for `qref`'s head receive `recv_id` does not fit it or its
    /// buffers failed their checks (`status`): an RC responder completes
    /// the receive so, NAKs and fails; a UC one drops the message and
    /// keeps the receive posted (no completion, as rxe's class D error).
    fn receive_refused(&mut self, qref: QpRef, recv_id: u64, status: WcStatus) -> Verdict {
        let code = if status == WcStatus::LocLenErr {
            NakCode::InvalidRequest
        } else {
            NakCode::RemoteOperationalError
        };
        let rc = (self.qps.get(qref)).is_some_and(|q| q.qp_type == QpType::Rc);
        if rc {
            self.refuse_receive(qref, recv_id, status);
        }
        Verdict::Nak { code, fatal: rc }
    }

    /// An RDMA WRITE packet: its target checked (the first packet's RETH
    /// names it), its bytes placed; WRITE_WITH_IMM's last packet consumes
    /// a receive.
    fn take_write(&mut self, qref: QpRef, opcode: u8, pkt: &Packet<'_>) -> Verdict {
        let Some(qp) = self.qps.get(qref) else {
            return Verdict::Drop("unknown_qp");
        };
        let Some(remote) = qp.remote.as_deref() else {
            return Verdict::Drop("unknown_qp");
        };
        let (device, pd, vqpn, granted) = (qp.device, qp.pd, qp.vqpn, qp.access);
        let rnr = rnr_timer(remote.conn.min_rnr_timer);
        let src_qp = remote.conn.path.dest_qpn;
        let (va, rkey, len, offset) = match (remote.receiving, pkt.reth) {
            (
                Receiving::Write {
                    va,
                    rkey,
                    len,
                    offset,
                },
                None,
            ) => (va, rkey, len, offset),
            (Receiving::Nothing, Some(r)) => (r.va, r.rkey, u64::from(r.dma_len), 0),
            _ => {
                return Verdict::Nak {
                    code: NakCode::InvalidRequest,
                    fatal: true,
                }
            }
        };
        let last = op::is_last_or_only(opcode);
        let end = offset + pkt.payload.len() as u64;
        if end > len || (last && end != len) {
            return Verdict::Nak {
                code: NakCode::InvalidRequest,
                fatal: true,
            };
        }
        let with_imm = matches!(opcode, op::WRITE_LAST_IMM | op::WRITE_ONLY_IMM);
        // The receive is checked before any byte lands: an RNR NAK makes
        // the requester send this packet again.
        if with_imm && !self.has_receive(qref) {
            return Verdict::Rnr;
        }
        if granted & access::REMOTE_WRITE == 0 {
            return Verdict::Nak {
                code: NakCode::RemoteAccessError,
                fatal: false,
            };
        }
        if len > 0 {
            let Some(target) = self
                .keys
                .remote(device, pd, rkey, va, len, access::REMOTE_WRITE)
            else {
                return Verdict::Nak {
                    code: NakCode::RemoteAccessError,
                    fatal: false,
                };
            };
            if !keys::scatter(pkt.payload, &target, offset) {
                return Verdict::Nak {
                    code: NakCode::RemoteAccessError,
                    fatal: false,
                };
            }
        }
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return Verdict::Drop("unknown_qp");
        };
        if !last {
            remote.receiving = Receiving::Write {
                va,
                rkey,
                len,
                offset: end,
            };
            return Verdict::Taken(1);
        }
        remote.receiving = Receiving::Nothing;
        remote.msn = remote.msn.wrapping_add(1) & 0xff_ffff;
        if with_imm {
            match self.head_receive(qref, rnr) {
                Ok(()) => {}
                Err(Step::Rnr(_)) => return Verdict::Rnr,
                Err(Step::Complete { .. }) => {
                    return Verdict::Nak {
                        code: NakCode::RemoteOperationalError,
                        fatal: true,
                    }
                }
                Err(_) => return Verdict::Drop("receive_unreadable"),
            }
            let Some(qp) = self.qps.get(qref) else {
                return Verdict::Drop("unknown_qp");
            };
            let cqe = Cqe {
                wr_id: qp.rq_head.wr_id.into(),
                status: WcStatus::Success.into(),
                opcode: WcOpcode::RecvRdmaWithImm.into(),
                wc_flags: wc_flags::WITH_IMM,
                byte_len: u32::try_from(len).unwrap_or(u32::MAX).into(),
                imm_data: pkt.imm.unwrap_or_default(),
                qp_num: vqpn.into(),
                src_qp: src_qp.into(),
                ..Cqe::default()
            };
            self.complete_recv(qref, &cqe, pkt.bth.solicited);
        }
        Verdict::Taken(1)
    }

    /// An RDMA READ request: checked, then answered by response packets
    /// (sent as the packet queue allows); it takes one PSN per response.
    fn take_read(&mut self, w: &mut Wire, qref: QpRef, pkt: &Packet<'_>, now: Instant) -> Verdict {
        let Some(reth) = pkt.reth else {
            return Verdict::Nak {
                code: NakCode::InvalidRequest,
                fatal: true,
            };
        };
        if let Some(v) = self.check_read(qref, reth.va, reth.rkey, u64::from(reth.dma_len)) {
            return v;
        }
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return Verdict::Drop("unknown_qp");
        };
        let mtu = remote.conn.path.mtu;
        let len = u64::from(reth.dma_len);
        remote.reads.push_back(ReadResponse {
            first: pkt.bth.psn,
            va: reth.va,
            rkey: reth.rkey,
            len,
            sent: 0,
        });
        remote.msn = remote.msn.wrapping_add(1) & 0xff_ffff;
        w.mark_active(qref);
        self.pump_reads(w, qref, now);
        Verdict::Taken(packets(len, mtu))
    }

    /// Whether a READ of `len` bytes at `va` under `rkey` may be answered;
    /// the verdict if not.
    fn check_read(&self, qref: QpRef, va: u64, rkey: u32, len: u64) -> Option<Verdict> {
        let qp = self.qps.get(qref)?;
        if qp.access & access::REMOTE_READ == 0 {
            return Some(Verdict::Nak {
                code: NakCode::RemoteAccessError,
                fatal: false,
            });
        }
        if len > 0
            && self
                .keys
                .remote(qp.device, qp.pd, rkey, va, len, access::REMOTE_READ)
                .is_none()
        {
            return Some(Verdict::Nak {
                code: NakCode::RemoteAccessError,
                fatal: false,
            });
        }
        None
    }

    /// An atomic: executed once, its original value sent back and kept
    /// for a duplicate of the request.
    fn take_atomic(&mut self, w: &mut Wire, qref: QpRef, opcode: u8, pkt: &Packet<'_>) -> Verdict {
        let Some(a) = pkt.atomic else {
            return Verdict::Nak {
                code: NakCode::InvalidRequest,
                fatal: true,
            };
        };
        if !a.va.is_multiple_of(8) {
            return Verdict::Nak {
                code: NakCode::InvalidRequest,
                fatal: false,
            };
        }
        let Some(qp) = self.qps.get(qref) else {
            return Verdict::Drop("unknown_qp");
        };
        if qp.access & access::REMOTE_ATOMIC == 0 {
            return Verdict::Nak {
                code: NakCode::RemoteAccessError,
                fatal: false,
            };
        }
        let Some(target) =
            (self.keys).remote(qp.device, qp.pd, a.rkey, a.va, 8, access::REMOTE_ATOMIC)
        else {
            return Verdict::Nak {
                code: NakCode::RemoteAccessError,
                fatal: false,
            };
        };
        let (operand, swap) = if opcode == op::CMP_SWAP {
            (a.compare, Some(a.swap_add))
        } else {
            (a.swap_add, None)
        };
        let Some(orig) = keys::atomic(&target, operand, swap) else {
            return Verdict::Nak {
                code: NakCode::RemoteAccessError,
                fatal: false,
            };
        };
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return Verdict::Drop("unknown_qp");
        };
        let psn = pkt.bth.psn;
        remote.remember_atomic(psn, orig);
        remote.msn = remote.msn.wrapping_add(1) & 0xff_ffff;
        let (path, msn) = (remote.conn.path, remote.msn);
        send_atomic_ack(w, &path, psn, msn, orig);
        Verdict::Taken(1)
    }

    /// A request behind the expected PSN: the requester did not hear our
    /// answer. SEND and WRITE are acknowledged again; a READ is answered
    /// again from memory (from the PSN asked); an atomic gets the result
    /// it had.
    fn duplicate(&mut self, w: &mut Wire, qref: QpRef, pkt: &Packet<'_>, now: Instant) {
        let opcode = pkt.bth.opcode as u8;
        let psn = pkt.bth.psn;
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return;
        };
        let peer = remote.conn.peer;
        w.duplicate(peer);
        match opcode {
            op::READ_REQUEST => {
                let Some(reth) = pkt.reth else {
                    w.drop_packet(peer, "bad_duplicate");
                    return;
                };
                let mtu = remote.conn.path.mtu;
                let len = u64::from(reth.dma_len);
                // Its responses must end before the expected PSN.
                let end = psn.add(packets(len, mtu));
                if end.diff(remote.epsn) > 0 {
                    w.drop_packet(peer, "bad_duplicate");
                    return;
                }
                // What was still owed from that point is answered anew.
                remote
                    .reads
                    .retain(|r| r.first.add(r.npkts(mtu)).diff(psn) <= 0);
                if self.check_read(qref, reth.va, reth.rkey, len).is_some() {
                    w.drop_packet(peer, "bad_duplicate");
                    return;
                }
                let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut())
                else {
                    return;
                };
                remote.reads.push_back(ReadResponse {
                    first: psn,
                    va: reth.va,
                    rkey: reth.rkey,
                    len,
                    sent: 0,
                });
                w.mark_active(qref);
                self.pump_reads(w, qref, now);
            }
            op::CMP_SWAP | op::FETCH_ADD => match remote.atomic_result(psn) {
                Some(orig) => {
                    let (path, msn) = (remote.conn.path, remote.msn);
                    send_atomic_ack(w, &path, psn, msn, orig);
                }
                None => w.drop_packet(peer, "atomic_forgotten"),
            },
            _ => w.ack_due(qref, remote),
        }
    }

    /// Sends the READ responses `qref` owes, as the packet queue allows.
    /// Returns whether some are left.
    pub(super) fn pump_reads(&mut self, w: &mut Wire, qref: QpRef, _now: Instant) -> bool {
        loop {
            let Some(qp) = self.qps.get(qref) else {
                return false;
            };
            let (device, pd) = (qp.device, qp.pd);
            let Some(remote) = qp.remote.as_deref() else {
                return false;
            };
            let Some(&r) = remote.reads.front() else {
                return false;
            };
            let path = remote.conn.path;
            let msn = remote.msn;
            let mtu = u64::from(path.mtu);
            let n = r.npkts(path.mtu);
            let k = r.sent;
            let offset = u64::from(k) * mtu;
            let size = r.len.saturating_sub(offset).min(mtu);
            let (first, last) = (k == 0, k + 1 == n);
            let code = match (first, last) {
                (true, true) => op::READ_RESPONSE_ONLY,
                (true, false) => op::READ_RESPONSE_FIRST,
                (false, false) => op::READ_RESPONSE_MIDDLE,
                (false, true) => op::READ_RESPONSE_LAST,
            };
            let psn = r.first.add(k);
            let mut h = super::headers(super::bth(code, path.dest_qpn, psn));
            if first || last {
                h.aeth = Some(Aeth::Ack {
                    credits: super::NO_CREDITS,
                    msn,
                });
            }
            let target = if r.len == 0 {
                None
            } else {
                self.keys
                    .remote(device, pd, r.rkey, r.va, r.len, access::REMOTE_READ)
            };
            let len = usize::try_from(size).unwrap_or(0);
            let emitted = match (&target, r.len) {
                (_, 0) => w.emit(&path, &h, 0, |_| true),
                (Some(src), _) => w.emit(&path, &h, len, |out| keys::gather(src, offset, out)),
                (None, _) => Emit::LocalError,
            };
            let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
                return false;
            };
            match emitted {
                Emit::Full => return true,
                Emit::Sent => {}
                Emit::LocalError => {
                    // The region went away while the response was owed.
                    remote.reads.pop_front();
                    let msn = remote.msn;
                    let peer = remote.conn.peer;
                    w.nak_sent(peer, "remote_access");
                    send_ack(
                        w,
                        &path,
                        psn,
                        Aeth::Nak {
                            code: NakCode::RemoteAccessError,
                            msn,
                        },
                    );
                    continue;
                }
            }
            if let Some(front) = remote.reads.front_mut() {
                front.sent += 1;
                if front.sent >= n {
                    remote.reads.pop_front();
                }
            }
        }
    }
}

/// Sends an ACK or NAK for `psn`.
pub(super) fn send_ack(w: &mut Wire, path: &super::state::Path, psn: Psn, aeth: Aeth) {
    let mut h = super::headers(super::bth(op::ACK, path.dest_qpn, psn));
    h.aeth = Some(aeth);
    // An acknowledgement that finds the queue full is lost like one the
    // network dropped: the requester's timer covers both.
    let _ = w.emit(path, &h, 0, |_| true);
}

/// Sends an atomic's original value.
fn send_atomic_ack(w: &mut Wire, path: &super::state::Path, psn: Psn, msn: u32, orig: u64) {
    let mut h = super::headers(super::bth(op::ATOMIC_ACK, path.dest_qpn, psn));
    h.aeth = Some(Aeth::Ack {
        credits: super::NO_CREDITS,
        msn,
    });
    h.atomic_ack = Some(AtomicAckEth { orig });
    let _ = w.emit(path, &h, 0, |_| true);
}

/// The counter label of a NAK code.
fn nak_label(code: NakCode) -> &'static str {
    match code {
        NakCode::PsnSequenceError => "psn_sequence",
        NakCode::InvalidRequest | NakCode::InvalidRdRequest => "invalid_request",
        NakCode::RemoteAccessError => "remote_access",
        NakCode::RemoteOperationalError => "remote_operational",
    }
}
