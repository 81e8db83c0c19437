//! What of a QP's transport a new hostd needs to carry on where this one
//! stops (docs/architecture.md, "hostd hands over"): everything else of a
//! QP — its rings, attributes and state — its vdev gives the new hostd
//! again, as after a restart.
//!
//! The requester's messages on the wire are not handed over: the new hostd
//! reads them again from the send ring (a WQE's slot stays taken until it
//! completes) and numbers them from the first one's PSN, which is what a
//! go-back-N retransmission does; the responder drops what it already
//! took as duplicates and acknowledges it again. The responder's state is
//! handed over whole: the PSN it expects, its MSN, the message it is in
//! the middle of, the READ responses it owes and the atomic results it
//! replays.

use serde::{Deserialize, Serialize};
use vrdma_roce::Psn;
use vrdma_spec::verbs::QpState;

use super::wire::state::{ReadResponse, Receiving, ATOMIC_REPLAY};
use super::wqe::RecvWork;
use super::{DeviceId, Engine, EngineError};

/// The largest message (2 GiB, the verbs' `max_msg_sz`): a bound on every
/// length and offset of a handed-over message.
const MAX_MESSAGE: u64 = 1 << 31;
/// READ responses a responder owes at most (`max_dest_rd_atomic` ≤ 16).
const MAX_READS: usize = 16;

/// One QP's transport as the previous hostd left it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QpTransport {
    pub vqpn: u32,
    /// Its state then (a [`QpState`]): the state its vdev brings it back
    /// to, when the rest is applied.
    pub state: u8,
    /// A UD QP's next datagram PSN.
    pub ud_psn: u32,
    /// A QP connected to another host.
    pub remote: Option<RemoteTransport>,
    /// The receive a QP on an SRQ took for the message it is in the
    /// middle of (an SRQ's receive is taken off its ring when a message
    /// begins; the new hostd would otherwise take the next one).
    #[serde(default)]
    pub srq_receive: Option<HandedReceive>,
}

/// A receive taken off an SRQ and not completed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedReceive {
    pub wr_id: u64,
    /// (address, length, lkey) of each SGE.
    pub sges: Vec<(u64, u32, u32)>,
}

/// The transport of a QP whose peer is on another host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteTransport {
    /// The PSN of the oldest message not completed (or the next one's):
    /// where the requester starts again.
    pub next_psn: u32,
    /// The last PSN acknowledged, and one past the highest ever sent.
    pub acked: u32,
    pub high: u32,
    /// Responder: the PSN it expects, its MSN.
    pub epsn: u32,
    pub msn: u32,
    pub receiving: HandedReceiving,
    pub reads: Vec<HandedRead>,
    pub atomics: Vec<HandedAtomic>,
    pub nak_sent: bool,
    pub dropping: bool,
}

/// The message a responder is in the middle of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum HandedReceiving {
    Nothing,
    Send {
        offset: u64,
    },
    Write {
        va: u64,
        rkey: u32,
        len: u64,
        offset: u64,
    },
}

/// A READ response owed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedRead {
    pub first: u32,
    pub va: u64,
    pub rkey: u32,
    pub len: u64,
    pub sent: u32,
}

/// An atomic's original value, replayed to a duplicate request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedAtomic {
    pub psn: u32,
    pub orig: u64,
}

/// Why a handed-over QP transport is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("QP {vqpn}: {what} exceeds 24 bits")]
    Wide { vqpn: u32, what: &'static str },
    #[error("QP {vqpn}: unknown state {state}")]
    State { vqpn: u32, state: u8 },
    #[error("QP {vqpn}: {what}")]
    Invalid { vqpn: u32, what: &'static str },
}

impl QpTransport {
    /// Checks every field against what the transport can hold: PSNs of 24
    /// bits, lengths and offsets of one message, as many READ responses
    /// and atomic results as a responder keeps.
    pub fn check(&self) -> Result<(), TransportError> {
        let vqpn = self.vqpn;
        let wide = |what| TransportError::Wide { vqpn, what };
        let invalid = |what| TransportError::Invalid { vqpn, what };
        if vqpn > 0x00ff_ffff {
            return Err(wide("QP number"));
        }
        if QpState::try_from(self.state).is_err() {
            return Err(TransportError::State {
                vqpn,
                state: self.state,
            });
        }
        if self.ud_psn > 0x00ff_ffff {
            return Err(wide("UD PSN"));
        }
        if let Some(r) = &self.srq_receive {
            let total = r.sges.iter().map(|s| u64::from(s.1)).sum::<u64>();
            if r.sges.len() > vrdma_spec::limits::MAX_SGE as usize || total > MAX_MESSAGE {
                return Err(invalid("the SRQ receive taken is out of bounds"));
            }
        }
        let Some(r) = &self.remote else {
            return Ok(());
        };
        for (what, v) in [
            ("next PSN", r.next_psn),
            ("acknowledged PSN", r.acked),
            ("highest PSN", r.high),
            ("expected PSN", r.epsn),
            ("MSN", r.msn),
        ] {
            if v > 0x00ff_ffff {
                return Err(wide(what));
            }
        }
        match r.receiving {
            HandedReceiving::Nothing => {}
            HandedReceiving::Send { offset } if offset <= MAX_MESSAGE => {}
            HandedReceiving::Write { len, offset, .. } if len <= MAX_MESSAGE && offset <= len => {}
            _ => return Err(invalid("the message being received is out of bounds")),
        }
        if r.reads.len() > MAX_READS {
            return Err(invalid("more READ responses owed than a responder keeps"));
        }
        if (r.reads.iter()).any(|rd| rd.first > 0x00ff_ffff || rd.len > MAX_MESSAGE) {
            return Err(invalid("a READ response owed is out of bounds"));
        }
        if r.atomics.len() > ATOMIC_REPLAY || r.atomics.iter().any(|a| a.psn > 0x00ff_ffff) {
            return Err(invalid("atomic results out of bounds"));
        }
        Ok(())
    }
}

impl Engine {
    /// Contexts a previous hostd handed over come back until `until`
    /// (None: all are back): meanwhile a QP whose local peer is not back
    /// yet retries without using up its `retry_cnt`.
    pub fn set_resuming(&mut self, until: Option<std::time::Instant>) {
        self.resuming_until = until;
    }

    /// The transport of every QP of device `id`, for a new hostd.
    pub fn handover_qps(&self, id: DeviceId) -> Vec<QpTransport> {
        let Some(dev) = self.devices.get(&id) else {
            return Vec::new();
        };
        let mut qps: Vec<QpTransport> = (dev.qps.iter())
            .filter_map(|(&vqpn, &qref)| {
                let qp = self.qps.get(qref)?;
                Some(QpTransport {
                    vqpn,
                    state: qp.state.into(),
                    ud_psn: qp.ud_psn & 0x00ff_ffff,
                    srq_receive: (qp.srq.is_some() && qp.has_rq_head).then(|| HandedReceive {
                        wr_id: qp.rq_head.wr_id,
                        sges: (qp.rq_head.sges().iter())
                            .map(|s| (s.addr.get(), s.length.get(), s.lkey.get()))
                            .collect(),
                    }),
                    remote: qp.remote.as_deref().map(|r| RemoteTransport {
                        next_psn: r.inflight.front().map_or(r.next_psn, |m| m.first).get(),
                        acked: r.acked.get(),
                        high: r.high.get(),
                        epsn: r.epsn.get(),
                        msn: r.msn,
                        receiving: match r.receiving {
                            Receiving::Nothing => HandedReceiving::Nothing,
                            Receiving::Send { offset } => HandedReceiving::Send { offset },
                            Receiving::Write {
                                va,
                                rkey,
                                len,
                                offset,
                            } => HandedReceiving::Write {
                                va,
                                rkey,
                                len,
                                offset,
                            },
                        },
                        reads: (r.reads.iter())
                            .map(|rd| HandedRead {
                                first: rd.first.get(),
                                va: rd.va,
                                rkey: rd.rkey,
                                len: rd.len,
                                sent: rd.sent,
                            })
                            .collect(),
                        atomics: (r.atomics.iter().flatten())
                            .map(|&(psn, orig)| HandedAtomic {
                                psn: psn.get(),
                                orig,
                            })
                            .collect(),
                        nak_sent: r.nak_sent,
                        dropping: r.dropping,
                    }),
                })
            })
            .collect();
        qps.sort_unstable_by_key(|q| q.vqpn);
        qps
    }

    /// Gives QP `t.vqpn` of device `id` the transport a previous hostd
    /// handed over, once its vdev brought it back to the state it had
    /// then (`t.state`), before it sends or takes anything: the requester
    /// numbers its next message (the oldest one not completed) from
    /// `next_psn`, the responder continues as it was.
    pub fn resume_transport(&mut self, id: DeviceId, t: &QpTransport) -> Result<(), EngineError> {
        t.check()
            .map_err(|_| EngineError::Invalid("handed-over transport"))?;
        let qref = self
            .qp_of(id, t.vqpn)
            .ok_or(EngineError::UnknownQp(t.vqpn))?;
        // A receive taken off an SRQ was read with the SRQ's limits.
        let srq_max_sge = (self.qps.get(qref))
            .and_then(|qp| Some((qp.dev, qp.srq?)))
            .and_then(|(di, srq)| self.devices.at(di)?.srqs.get(srq))
            .map(|s| s.limits.max_sge);
        let qp = self
            .qps
            .get_mut(qref)
            .ok_or(EngineError::UnknownQp(t.vqpn))?;
        if u8::from(qp.state) != t.state {
            return Err(EngineError::Invalid(
                "the QP is not in the state it was handed over in",
            ));
        }
        qp.ud_psn = t.ud_psn;
        if let Some(r) = &t.srq_receive {
            let Some(max_sge) = srq_max_sge else {
                return Err(EngineError::Invalid("the QP has no SRQ"));
            };
            *qp.rq_head = RecvWork::with_sges(r.wr_id, &r.sges, max_sge).ok_or(
                EngineError::Invalid("the SRQ receive taken does not fit the QP"),
            )?;
            qp.has_rq_head = true;
        }
        let (Some(r), Some(remote)) = (&t.remote, qp.remote.as_deref_mut()) else {
            return match t.remote {
                None => Ok(()),
                Some(_) => Err(EngineError::Invalid(
                    "the QP is not connected to another host",
                )),
            };
        };
        if !remote.inflight.is_empty() {
            return Err(EngineError::Invalid("the QP has sent already"));
        }
        remote.next_psn = Psn::new(r.next_psn);
        remote.acked = Psn::new(r.acked);
        remote.high = Psn::new(r.high);
        remote.epsn = Psn::new(r.epsn);
        remote.msn = r.msn;
        remote.receiving = match r.receiving {
            HandedReceiving::Nothing => Receiving::Nothing,
            HandedReceiving::Send { offset } => Receiving::Send { offset },
            HandedReceiving::Write {
                va,
                rkey,
                len,
                offset,
            } => Receiving::Write {
                va,
                rkey,
                len,
                offset,
            },
        };
        remote.reads = (r.reads.iter())
            .map(|rd| ReadResponse {
                first: Psn::new(rd.first),
                va: rd.va,
                rkey: rd.rkey,
                len: rd.len,
                sent: rd.sent,
            })
            .collect();
        remote.atomics = [None; ATOMIC_REPLAY];
        for (slot, a) in remote.atomics.iter_mut().zip(&r.atomics) {
            *slot = Some((Psn::new(a.psn), a.orig));
        }
        remote.atomics_next = r.atomics.len() % ATOMIC_REPLAY;
        remote.nak_sent = r.nak_sent;
        remote.dropping = r.dropping;
        tracing::debug!(
            device = id,
            vqpn = t.vqpn,
            next_psn = r.next_psn,
            acked = r.acked,
            high = r.high,
            epsn = r.epsn,
            reads = r.reads.len(),
            "Transport handed over"
        );
        // READ responses owed go out now, not at the peer's next request.
        if let Some(w) = self.wire.as_deref_mut() {
            w.mark_active(qref);
        }
        Ok(())
    }
}
