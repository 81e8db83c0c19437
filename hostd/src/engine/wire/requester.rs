//! The requester and completer of a QP whose peer is on another host: a
//! send WQE goes on the wire as RoCEv2 packets (segmented at the path MTU,
//! numbered by PSN) and stays in the QP's window until the responder
//! acknowledges it (a SEND or WRITE) or answers it (a READ or atomic);
//! completions are written in posting order. Lost packets are sent again
//! from the first one missing (go-back-N) on a NAK or when the QP's
//! `timeout` expires, `retry_cnt` times without progress; an RNR NAK holds
//! the QP for the responder's timer, `rnr_retry` times (7: for ever).

use std::time::Instant;

use vrdma_roce::{Aeth, AtomicEth, NakCode, Packet, Psn, Reth};
use vrdma_spec::ring::send_flags;
use vrdma_spec::verbs::{access, SendOpcode, WcStatus};

use super::state::{ack_timeout, answered_with_data, later, packets, Issued, RemoteQp, ACK_EVERY};
use super::{op, Emit, Wire};
use crate::engine::keys::{self, SgeList};
use crate::engine::rc::{Outcome, QpRef};
use crate::engine::{rnr_timer, Engine};

impl Engine {
    /// Puts the head WQE of remote QP `qref` on the wire: it joins the QP's
    /// window (its slot in the guest's ring stays taken until it
    /// completes) and its first packets are sent.
    pub(in crate::engine) fn issue_remote(&mut self, qref: QpRef, now: Instant) -> Outcome {
        let Some(qp) = self.qps.get_mut(qref) else {
            return Outcome::default();
        };
        let (device, pd) = (qp.device, qp.pd);
        let Some(remote) = qp.remote.as_mut() else {
            return Outcome::default();
        };
        if !qp.has_head || !remote.has_room(qp.head.opcode) {
            return Outcome::default();
        }
        let need = if answered_with_data(qp.head.opcode) {
            access::LOCAL_WRITE
        } else {
            0
        };
        let uc = remote.conn.unacknowledged;
        // UC has SENDs and WRITEs only (IBA table 38).
        let unsupported = matches!(
            qp.head.opcode,
            SendOpcode::LocalInv | SendOpcode::BindMw | SendOpcode::SendWithInv
        ) || (uc && answered_with_data(qp.head.opcode));
        let misaligned = matches!(
            qp.head.opcode,
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd
        ) && !qp.head.remote_addr.is_multiple_of(8);
        let local_ok = self.keys.check_sges(device, pd, qp.head.sges(), need);
        let Some(qp) = self.qps.get_mut(qref) else {
            return Outcome::default();
        };
        let failure = if unsupported {
            Some(WcStatus::LocQpOpErr)
        } else if !local_ok {
            Some(WcStatus::LocProtErr)
        } else if misaligned {
            // The responder would NAK it as an invalid request.
            Some(WcStatus::RemInvReqErr)
        } else {
            None
        };
        let Some(remote) = qp.remote.as_deref_mut() else {
            return Outcome::default();
        };
        let length = qp.head.length;
        if let Some(status) = failure {
            // Completions stay in order: behind messages on the wire it
            // completes as a failed entry of the window.
            if remote.inflight.is_empty() {
                let (wr_id, opcode) = (qp.head.wr_id, qp.head.wc_opcode());
                qp.has_head = false;
                qp.sent = 0;
                self.complete_send(qref, wr_id, opcode, status, 0, true);
                self.fail_qp(qref, false, "work completed in error");
            } else if remote.take_on(&mut qp.head, 0, Some(status)) {
                qp.has_head = false;
                qp.sent = 0;
                qp.issued += 1;
            } else {
                return Outcome::default();
            }
            return Outcome {
                completed: true,
                ..Outcome::default()
            };
        }
        let npkts = match qp.head.opcode {
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd => 1,
            _ => packets(length, remote.conn.path.mtu),
        };
        if !remote.take_on(&mut qp.head, npkts, None) {
            return Outcome::default();
        }
        if remote.due.is_none() && !remote.conn.unacknowledged {
            remote.due = ack_timeout(remote.conn.timeout).map(|t| now + t);
        }
        qp.has_head = false;
        qp.sent = 0;
        qp.issued += 1;
        if let Some(mut w) = self.wire.take() {
            // Its timer runs from now; the rest of it goes out in later
            // rounds if the window or the queue is full.
            w.mark_active(qref);
            self.pump(&mut w, qref, now);
            self.wire = Some(w);
        }
        Outcome {
            completed: true,
            moved: length,
            preempted: false,
        }
    }

    /// Sends the packets of `qref`'s window not sent in this pass, as far
    /// as its window of unacknowledged packets and the packet queue allow.
    /// Returns whether some are left to send. A UC message is done once
    /// its last packet is queued: it completes then, in order.
    pub(super) fn pump(&mut self, w: &mut Wire, qref: QpRef, now: Instant) -> bool {
        let more = self.pump_window(w, qref, now);
        let uc = (self.qps.get(qref))
            .and_then(|q| q.remote.as_deref())
            .is_some_and(|r| r.conn.unacknowledged);
        if uc {
            self.retire(w, qref, now);
        }
        more
    }

    fn pump_window(&mut self, w: &mut Wire, qref: QpRef, now: Instant) -> bool {
        let Some(qp) = self.qps.get(qref) else {
            return false;
        };
        if !qp.sends() {
            return false;
        }
        let Some(remote) = qp.remote.as_deref() else {
            return false;
        };
        if remote.rnr_until.is_some_and(|t| t > now) {
            return remote.has_unsent();
        }
        let (device, pd) = (qp.device, qp.pd);
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return false;
        };
        let mut i = remote.skip_sent();
        loop {
            let Some(qp) = self.qps.get(qref) else {
                return false;
            };
            let Some(remote) = qp.remote.as_deref() else {
                return false;
            };
            let Some(m) = remote.inflight.get(i) else {
                return false;
            };
            // Answered (or acknowledged) messages are never sent again.
            if !m.to_send() {
                i += 1;
                continue;
            }
            if remote.unacked_packets() >= remote.window {
                return true;
            }
            let k = m.sent;
            let emitted = send_packet(w, &self.keys, device, pd, remote, m, k);
            match emitted {
                Emit::Full => return true,
                Emit::Sent | Emit::LocalError => {}
            }
            let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
                return false;
            };
            let uc = remote.conn.unacknowledged;
            let Some(m) = remote.inflight.get_mut(i) else {
                return false;
            };
            let psn = m.first.add(k);
            if emitted == Emit::LocalError {
                // The local memory went away under the message.
                m.failed = Some(WcStatus::LocProtErr);
                m.sent = m.npkts;
                continue;
            }
            m.sent = if m.reads() { m.npkts } else { k + 1 };
            if m.reads() {
                m.asked = Some(m.got);
            }
            if uc {
                // Nothing comes back: a sent packet is as good as
                // acknowledged, and the message is done with its last.
                m.answered = m.all_sent();
                remote.acked = psn;
                remote.high = psn.add(1);
                continue;
            }
            // A READ request takes the PSNs of all its responses.
            let (psn, end) = if m.reads() {
                (m.first.add(m.got), m.first.add(m.npkts))
            } else {
                (psn, psn.add(1))
            };
            w.note_sent(remote, psn, end, now);
        }
    }

    /// A response (ACK, NAK, READ response, atomic acknowledgement) for
    /// remote QP `qref`.
    pub(super) fn response(&mut self, w: &mut Wire, qref: QpRef, pkt: &Packet<'_>, now: Instant) {
        let psn = pkt.bth.psn;
        let opcode = pkt.bth.opcode as u8;
        match opcode {
            op::ACK => match pkt.aeth {
                Some(Aeth::Ack { .. }) => {
                    self.ack_upto(w, qref, psn, now);
                }
                Some(Aeth::RnrNak { timer, .. }) => self.rnr_nak(w, qref, psn, timer, now),
                Some(Aeth::Nak { code, .. }) => self.nak(w, qref, psn, code, now),
                None => w.drop_packet(qref_peer(self, qref), "missing_aeth"),
            },
            op::ATOMIC_ACK => {
                let Some(orig) = pkt.atomic_ack.map(|a| a.orig) else {
                    w.drop_packet(qref_peer(self, qref), "missing_atomic_ack");
                    return;
                };
                self.atomic_answer(w, qref, psn, orig, now);
            }
            op::READ_RESPONSE_FIRST
            | op::READ_RESPONSE_MIDDLE
            | op::READ_RESPONSE_LAST
            | op::READ_RESPONSE_ONLY => {
                if let Some(Aeth::Nak { code, .. }) = pkt.aeth {
                    self.nak(w, qref, psn, code, now);
                    return;
                }
                self.read_response(w, qref, opcode, psn, pkt.payload, now);
            }
            _ => w.drop_packet(qref_peer(self, qref), "unexpected_opcode"),
        }
    }

    /// The responder received everything up to `psn`: SENDs and WRITEs it
    /// covers are done; a READ or atomic it passes without an answer lost
    /// its response, and is asked again.
    fn ack_upto(&mut self, w: &mut Wire, qref: QpRef, psn: Psn, now: Instant) {
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return;
        };
        let Some(front) = remote.inflight.front() else {
            return;
        };
        // An acknowledgement of a PSN never sent is not believed.
        if psn.diff(front.first) < -1 || psn.diff(remote.high) >= 0 {
            tracing::debug!(
                psn = psn.get(),
                first = front.first.get(),
                high = remote.high.get(),
                acked = remote.acked.get(),
                "Acknowledgement out of the window dropped"
            );
            w.drop_packet(remote.conn.peer, "ack_out_of_window");
            return;
        }
        if psn.diff(remote.acked) > 0 {
            remote.acked = psn;
            remote.progress(now);
        }
        if let Some((probe, at)) = remote.probe {
            if psn.diff(probe) >= 0 {
                w.rtt_sample(remote.conn.peer, now.saturating_duration_since(at));
                remote.probe = None;
            }
        }
        let mut asked = false;
        for m in remote.inflight.iter_mut() {
            if psn.diff(m.last()) < 0 {
                break;
            }
            if m.reads() {
                // The responder is past it and part of its answer is
                // missing: lost. It alone is asked again, from the first
                // packet missing, once per gap (the packets behind it are
                // answered as they come).
                if !m.answered && m.failed.is_none() && m.asked != Some(m.got) {
                    m.sent = 0;
                    m.ahead = 0;
                    asked = true;
                }
            } else {
                // The responder has every packet of it, even if some are
                // being sent again.
                m.answered = true;
            }
        }
        if asked {
            // Sending looks from the start again.
            remote.send_from = 0;
            w.mark_active(qref);
        }
        self.retire(w, qref, now);
    }

    /// An RNR NAK: the responder had no receive for the message at `psn`.
    fn rnr_nak(&mut self, w: &mut Wire, qref: QpRef, psn: Psn, timer: u8, now: Instant) {
        self.ack_upto(w, qref, psn.sub(1), now);
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return;
        };
        w.nak_received(remote.conn.peer, "rnr");
        if remote.conn.rnr_retry != 7 {
            if remote.rnr_left == 0 {
                self.fail_at(w, qref, psn, WcStatus::RnrRetryExcErr, now);
                return;
            }
            remote.rnr_left -= 1;
        }
        remote.rnr_until = Some(now + rnr_timer(timer));
        remote.rewind(psn);
        w.mark_active(qref);
    }

    /// A NAK: a PSN sequence error (go back to `psn`) or a fatal one.
    fn nak(&mut self, w: &mut Wire, qref: QpRef, psn: Psn, code: NakCode, now: Instant) {
        self.ack_upto(w, qref, psn.sub(1), now);
        let peer = qref_peer(self, qref);
        let (status, kind) = match code {
            NakCode::PsnSequenceError => {
                w.nak_received(peer, "psn_sequence");
                let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut())
                else {
                    return;
                };
                if remote.inflight.iter().any(|m| m.holds(psn)) {
                    // Go back to the gap with a small window: what was
                    // lost is sent again first, not behind a full window.
                    remote.window = ACK_EVERY;
                    remote.rewind(psn);
                    w.mark_active(qref);
                }
                return;
            }
            NakCode::InvalidRequest | NakCode::InvalidRdRequest => {
                (WcStatus::RemInvReqErr, "invalid_request")
            }
            NakCode::RemoteAccessError => (WcStatus::RemAccessErr, "remote_access"),
            NakCode::RemoteOperationalError => (WcStatus::RemOpErr, "remote_operational"),
        };
        w.nak_received(peer, kind);
        self.fail_at(w, qref, psn, status, now);
    }

    /// The message holding `psn` completes with `status` (after those
    /// before it), and the QP goes to ERR.
    fn fail_at(&mut self, w: &mut Wire, qref: QpRef, psn: Psn, status: WcStatus, now: Instant) {
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return;
        };
        let Some(m) = remote
            .inflight
            .iter_mut()
            .find(|m| m.holds(psn) || psn.diff(m.first) < 0)
        else {
            return;
        };
        m.failed = Some(status);
        self.retire(w, qref, now);
    }

    /// A READ response packet: lands in the READ's local buffers at its
    /// place; out of order ones are dropped (the timeout asks again).
    fn read_response(
        &mut self,
        w: &mut Wire,
        qref: QpRef,
        opcode: u8,
        psn: Psn,
        payload: &[u8],
        now: Instant,
    ) {
        let Some(qp) = self.qps.get(qref) else {
            return;
        };
        let (device, pd) = (qp.device, qp.pd);
        let Some(remote) = qp.remote.as_deref() else {
            return;
        };
        let peer = remote.conn.peer;
        let mtu = u64::from(remote.conn.path.mtu);
        let Some(i) = remote
            .inflight
            .iter()
            .position(|m| m.work.opcode == SendOpcode::RdmaRead && m.holds(psn))
        else {
            w.drop_packet(peer, "unexpected_response");
            return;
        };
        let m = &remote.inflight[i];
        // Packet `k` of the response: taken in any order within the
        // window of `got` and `ahead` (a reordered network costs no
        // retransmission), each once.
        let k = u32::try_from(psn.diff(m.first)).unwrap_or(u32::MAX);
        let beyond = k.wrapping_sub(m.got).wrapping_sub(1);
        let fresh = k == m.got || (k > m.got && beyond < 64 && m.ahead & (1 << beyond) == 0);
        if m.answered || m.failed.is_some() || !fresh {
            w.drop_packet(peer, "response_duplicate");
            return;
        }
        let first = k == 0;
        let last = k + 1 == m.npkts;
        // A READ asked again from packet `got` is answered from a FIRST
        // (or ONLY) there: only the last packet's position is fixed.
        let ends = matches!(opcode, op::READ_RESPONSE_LAST | op::READ_RESPONSE_ONLY);
        let position_ok = ends == last && (first || opcode != op::READ_RESPONSE_ONLY || last);
        let offset = u64::from(k) * mtu;
        let expect = if last {
            m.work.length.saturating_sub(offset)
        } else {
            mtu
        };
        if !position_ok || payload.len() as u64 != expect {
            w.drop_packet(peer, "bad_response");
            return;
        }
        let landed = {
            let dst = SgeList::new(&self.keys, device, pd, m.work.sges(), access::LOCAL_WRITE);
            keys::scatter(payload, &dst, offset)
        };
        let first_psn = m.first;
        // Everything before the READ was received by the responder.
        self.ack_upto(w, qref, first_psn.sub(1), now);
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return;
        };
        let Some(m) = remote.inflight.iter_mut().find(|m| m.first == first_psn) else {
            return;
        };
        if k == m.got {
            m.got += 1;
            while m.ahead & 1 != 0 {
                m.ahead >>= 1;
                m.got += 1;
            }
            m.ahead >>= 1;
        } else {
            m.ahead |= 1 << (k - m.got - 1);
        }
        if !landed {
            m.failed = Some(WcStatus::LocProtErr);
        } else if m.got == m.npkts {
            m.answered = true;
        }
        remote.progress(now);
        self.retire(w, qref, now);
    }

    /// An atomic's original value came back.
    fn atomic_answer(&mut self, w: &mut Wire, qref: QpRef, psn: Psn, orig: u64, now: Instant) {
        let Some(qp) = self.qps.get(qref) else {
            return;
        };
        let (device, pd) = (qp.device, qp.pd);
        let Some(remote) = qp.remote.as_deref() else {
            return;
        };
        let peer = remote.conn.peer;
        let Some(m) = remote.inflight.iter().find(|m| {
            m.holds(psn)
                && matches!(
                    m.work.opcode,
                    SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd
                )
        }) else {
            w.drop_packet(peer, "unexpected_response");
            return;
        };
        if m.answered {
            return;
        }
        let landed = {
            let dst = SgeList::new(&self.keys, device, pd, m.work.sges(), access::LOCAL_WRITE);
            keys::write_bytes(&orig.to_le_bytes(), &dst)
        };
        self.ack_upto(w, qref, psn.sub(1), now);
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return;
        };
        if let Some(m) = remote.inflight.iter_mut().find(|m| m.holds(psn)) {
            if landed {
                m.answered = true;
            } else {
                m.failed = Some(WcStatus::LocProtErr);
            }
        }
        remote.progress(now);
        self.retire(w, qref, now);
    }

    /// Completes the messages at the front of `qref`'s window that are
    /// done, in order; a failed one moves the QP to ERR (which flushes the
    /// rest). Room made lets the QP load its next WQEs.
    pub(super) fn retire(&mut self, w: &mut Wire, qref: QpRef, now: Instant) {
        let mut retired = 0;
        loop {
            let Some(qp) = self.qps.get_mut(qref) else {
                return;
            };
            let Some(remote) = qp.remote.as_deref_mut() else {
                return;
            };
            let Some(front) = remote.inflight.front() else {
                break;
            };
            let status = match (front.failed, front.answered) {
                (Some(s), _) => s,
                (None, true) => WcStatus::Success,
                (None, false) => break,
            };
            let Some(m) = remote.inflight.pop_front() else {
                break;
            };
            remote.send_from = remote.send_from.saturating_sub(1);
            qp.issued = qp.issued.saturating_sub(1);
            let (wr_id, opcode, signaled) = (m.work.wr_id, m.work.wc_opcode(), m.work.signaled());
            let byte_len = if status == WcStatus::Success {
                u32::try_from(m.work.length).unwrap_or(u32::MAX)
            } else {
                0
            };
            remote.pool.push(m.work);
            remote.progress(now);
            retired += 1;
            self.complete_send(qref, wr_id, opcode, status, byte_len, signaled);
            if status != WcStatus::Success {
                self.fail_qp(qref, false, "work completed in error");
                return;
            }
        }
        if retired > 0 {
            if let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) {
                if remote.inflight.is_empty() {
                    remote.due = None;
                }
            }
            w.mark_active(qref);
            self.activate(qref, now);
        }
    }

    /// The QP's ACK timeout or RNR wait is due: send again from the first
    /// packet not acknowledged, or fail the oldest message when its
    /// retries ran out.
    pub(super) fn requester_timer(&mut self, w: &mut Wire, qref: QpRef, now: Instant) {
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return;
        };
        if remote.rnr_until.is_some_and(|t| t <= now) {
            remote.rnr_until = None;
            w.mark_active(qref);
        }
        let Some(due) = remote.due else {
            return;
        };
        if due > now || remote.rnr_until.is_some() {
            return;
        }
        // Sent again from the oldest message not answered.
        let Some(front) = remote
            .inflight
            .iter()
            .find(|m| !m.answered && m.failed.is_none())
        else {
            remote.due = None;
            return;
        };
        let from = if front.reads() {
            front.first.add(front.got)
        } else {
            later(remote.acked.add(1), front.first)
        };
        if remote.retry_left == 0 {
            let peer = remote.conn.peer;
            tracing::debug!(qpn = qref, "transport retries exhausted");
            w.timeout(peer);
            self.fail_at(w, qref, from, WcStatus::RetryExcErr, now);
            return;
        }
        remote.retry_left -= 1;
        remote.window = ACK_EVERY;
        remote.rewind(from);
        remote.due = ack_timeout(remote.conn.timeout).map(|t| now + t);
        let peer = remote.conn.peer;
        w.timeout(peer);
        w.mark_active(qref);
    }
}

/// The peer index of `qref`'s connection (for counting a drop).
fn qref_peer(engine: &Engine, qref: QpRef) -> usize {
    engine
        .qps
        .get(qref)
        .and_then(|q| q.remote.as_deref())
        .map_or(0, |r| r.conn.peer)
}

/// Builds and queues packet `k` of message `m` of `remote`.
fn send_packet(
    w: &mut Wire,
    keys_table: &keys::KeyTable,
    device: crate::engine::DeviceId,
    pd: u32,
    remote: &RemoteQp,
    m: &Issued,
    k: u32,
) -> Emit {
    let path = remote.conn.path;
    let work = &*m.work;
    let mtu = u64::from(path.mtu);
    let psn = m.first.add(k);
    let mut bth = super::bth(op::SEND_ONLY, path.dest_qpn, psn);
    let mut h = super::headers(bth);
    match work.opcode {
        SendOpcode::RdmaRead => {
            // Asked from the first byte not yet received.
            let skip = u64::from(m.got) * mtu;
            bth.opcode = op::opcode(op::READ_REQUEST);
            bth.psn = m.first.add(m.got);
            h.bth = bth;
            h.reth = Some(Reth {
                va: work.remote_addr.wrapping_add(skip),
                rkey: work.rkey,
                dma_len: u32::try_from(work.length.saturating_sub(skip)).unwrap_or(u32::MAX),
            });
            return w.emit(&path, &h, 0, |_| true);
        }
        SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd => {
            let cas = work.opcode == SendOpcode::AtomicCmpAndSwp;
            bth.opcode = op::opcode(if cas { op::CMP_SWAP } else { op::FETCH_ADD });
            h.bth = bth;
            h.atomic = Some(AtomicEth {
                va: work.remote_addr,
                rkey: work.rkey,
                swap_add: if cas { work.swap } else { work.compare_add },
                compare: if cas { work.compare_add } else { 0 },
            });
            h.bth.ack_req = true;
            return w.emit(&path, &h, 0, |_| true);
        }
        _ => {}
    }
    let offset = u64::from(k) * mtu;
    let n = work.length.saturating_sub(offset).min(mtu);
    let only = m.npkts == 1;
    let last = k + 1 == m.npkts;
    let first = k == 0;
    let write = matches!(
        work.opcode,
        SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm
    );
    let imm = matches!(
        work.opcode,
        SendOpcode::SendWithImm | SendOpcode::RdmaWriteWithImm
    );
    let code = match (write, only, first, last, imm) {
        (false, true, _, _, false) => op::SEND_ONLY,
        (false, true, _, _, true) => op::SEND_ONLY_IMM,
        (false, false, true, _, _) => op::SEND_FIRST,
        (false, false, false, false, _) => op::SEND_MIDDLE,
        (false, false, false, true, false) => op::SEND_LAST,
        (false, false, false, true, true) => op::SEND_LAST_IMM,
        (true, true, _, _, false) => op::WRITE_ONLY,
        (true, true, _, _, true) => op::WRITE_ONLY_IMM,
        (true, false, true, _, _) => op::WRITE_FIRST,
        (true, false, false, false, _) => op::WRITE_MIDDLE,
        (true, false, false, true, false) => op::WRITE_LAST,
        (true, false, false, true, true) => op::WRITE_LAST_IMM,
    };
    if remote.conn.unacknowledged {
        // The same operation in UC's opcode range; nothing is acknowledged.
        bth.opcode = op::opcode(code | op::UC);
        bth.ack_req = false;
    } else {
        bth.opcode = op::opcode(code);
        bth.ack_req = last || k % ACK_EVERY == ACK_EVERY - 1;
    }
    bth.solicited = last && work.flags & send_flags::SOLICITED != 0;
    h.bth = bth;
    if write && first {
        h.reth = Some(Reth {
            va: work.remote_addr,
            rkey: work.rkey,
            dma_len: u32::try_from(work.length).unwrap_or(u32::MAX),
        });
    }
    if imm && last {
        h.imm = Some(work.imm_data);
    }
    let len = usize::try_from(n).unwrap_or(0);
    w.emit(
        &path,
        &h,
        len,
        fill_payload(keys_table, device, pd, work, offset),
    )
}

/// Copies `work`'s bytes from `offset` on into a packet's payload (false:
/// its local memory failed its checks): from the WQE's inline data, or
/// gathered from its SGEs.
pub(super) fn fill_payload<'a>(
    keys_table: &'a keys::KeyTable,
    device: crate::engine::DeviceId,
    pd: u32,
    work: &'a crate::engine::wqe::SendWork,
    offset: u64,
) -> impl FnOnce(&mut [u8]) -> bool + 'a {
    move |out| {
        let inline = work.inline();
        let sges = work.sges();
        if !inline.is_empty() || sges.is_empty() {
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            return match inline.get(start..start.saturating_add(out.len())) {
                Some(bytes) => {
                    out.copy_from_slice(bytes);
                    true
                }
                None => out.is_empty(),
            };
        }
        let src = SgeList::new(keys_table, device, pd, sges, 0);
        keys::gather(&src, offset, out)
    }
}
