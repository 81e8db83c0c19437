//! The UC responder of a QP whose peer is on another host. Nothing is
//! acknowledged and nothing is sent again, so the responder never answers:
//! a packet is taken if its PSN is the expected one, and a gap (or any
//! failure: no receive, a bad rkey, a receive too short) drops the
//! message it interrupts — the rest of it is dropped until the first
//! packet of a new message arrives, which is taken whatever its PSN
//! (IBA 9.7.5.1.3 and 9.9.2; rxe's `drop_msg`). A dropped message leaves
//! the QP as it was: a receive it was filling stays posted for the next
//! one; bytes a WRITE placed before the gap stay placed, as on a NIC.
//! Every drop is counted on the peer (by reason) and, for a message the
//! tenant loses, on its device (`DropCounts`).

use std::time::Instant;

use vrdma_roce::Packet;

use super::state::Receiving;
use super::{op, Wire};
use crate::engine::rc::QpRef;
use crate::engine::ud::Drop;
use crate::engine::Engine;

impl Engine {
    /// A UC packet for remote QP `qref` (its connection and readiness
    /// already checked).
    pub(super) fn uc_request(&mut self, w: &mut Wire, qref: QpRef, pkt: &Packet<'_>, now: Instant) {
        let Some(qp) = self.qps.get_mut(qref) else {
            return;
        };
        let di = qp.dev;
        let Some(remote) = qp.remote.as_deref_mut() else {
            return;
        };
        let peer = remote.conn.peer;
        // The operation, as RC numbers it.
        let code = pkt.bth.opcode as u8 & !op::TRANSPORT;
        let psn = pkt.bth.psn;
        let starts = op::is_first_or_only(code);
        let in_sequence = psn == remote.epsn && !remote.dropping;
        if starts {
            // A new message: one still in progress lost its end.
            if remote.receiving != Receiving::Nothing {
                remote.receiving = Receiving::Nothing;
                w.drop_packet(peer, "uc_message_cut");
                self.count_drop(di, Drop::Invalid);
            }
            if let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) {
                remote.dropping = false;
            }
        } else if !in_sequence {
            // A gap inside a message: it is lost; so is the rest of it.
            let first_loss = !remote.dropping;
            remote.dropping = true;
            remote.receiving = Receiving::Nothing;
            w.drop_packet(peer, "uc_psn_gap");
            if first_loss {
                self.count_drop(di, Drop::Invalid);
            }
            return;
        }
        let verdict = self.take_request(w, qref, code, pkt, now);
        let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
            return;
        };
        remote.epsn = psn.add(1);
        let why = match verdict {
            super::responder::Verdict::Taken(_) => return,
            super::responder::Verdict::Rnr => Drop::NoReceive,
            super::responder::Verdict::Nak { .. } => Drop::Invalid,
            super::responder::Verdict::Drop(reason) => {
                w.drop_packet(peer, reason);
                return;
            }
        };
        // The message is refused: nothing is answered, the rest of it (if
        // any) is dropped, the receive stays posted.
        remote.receiving = Receiving::Nothing;
        remote.dropping = !op::is_last_or_only(code);
        w.drop_packet(
            peer,
            if why == Drop::NoReceive {
                "uc_no_receive"
            } else {
                "uc_refused"
            },
        );
        self.count_drop(di, why);
    }
}
