//! Queue pairs: creation, posting work requests, and their state.
//!
//! Posting writes WQEs into the QP's ring, publishes them with one store of
//! the producer index and rings the device's doorbell once per call, as a
//! NIC's burst post does; [`SendBatch`] and [`RecvBatch`] let a caller that
//! translates work requests one at a time (libibverbs) do the same.

use std::sync::{Arc, Mutex, MutexGuard};

use vrdma_spec::control::{
    CreateQpReq, CreateQpResp, ModifyQpReq, Opcode, QpAttr, QpCap, QpHandle, QueryQpReq,
    QueryQpResp, NO_SRQ,
};
use vrdma_spec::ring::doorbell;
use vrdma_spec::ring::{rq_geometry, sq_geometry};
use vrdma_spec::verbs::QpType;
use zerocopy::IntoBytes;

use super::srq::{SharedReceiveQueue, SrqInner};
use super::{lock, CompletionQueue, CqInner, PdInner, ProtectionDomain};
use crate::device::Device;
use crate::error::{DestroyError, Error, PostError, Result};
use crate::ring::{Doorbell, RecvRing, RecvWr, SendRing, SendWr, WorkRing};

impl ProtectionDomain {
    /// `ibv_create_qp`: rings sized from `init.cap` exactly as the device
    /// computes them ([`vrdma_spec::ring::sq_geometry`]/`rq_geometry`).
    pub fn create_qp(&self, init: &QpInitAttr<'_>) -> Result<QueuePair> {
        let mut cap = init.cap;
        if let Some(srq) = init.srq {
            if !Arc::ptr_eq(&srq.inner.pd.dev, &self.inner.dev) {
                return Err(Error::InvalidArgument(
                    "shared receive queue belongs to another device",
                ));
            }
            // Its receives are the SRQ's: its own receive ring is the
            // smallest there is and never posted on.
            cap.max_recv_wr = 0;
            cap.max_recv_sge = 0;
        }
        // CQ numbers are per device: a CQ of another device would silently
        // name an unrelated CQ of this one.
        for cq in [init.send_cq, init.recv_cq] {
            if !Arc::ptr_eq(&cq.inner.dev, &self.inner.dev) {
                return Err(Error::InvalidArgument(
                    "completion queue belongs to another device",
                ));
            }
        }
        let sq_geo = sq_geometry(cap.max_send_wr, cap.max_send_sge, cap.max_inline_data)
            .ok_or(Error::InvalidArgument("send queue capacities too large"))?;
        let rq_geo = rq_geometry(cap.max_recv_wr, cap.max_recv_sge)
            .ok_or(Error::InvalidArgument("receive queue capacities too large"))?;
        let dev = &self.inner.dev;
        let (len, align) = WorkRing::alloc_args(sq_geo)?;
        let mut sq = WorkRing::new(dev.alloc(len, align, true)?, sq_geo);
        let (len, align) = WorkRing::alloc_args(rq_geo)?;
        let mut rq = WorkRing::new(dev.alloc(len, align, true)?, rq_geo);
        let req = CreateQpReq {
            pdn: self.inner.handle.wire.pdn,
            send_cqn: init.send_cq.inner.handle.wire.cqn,
            recv_cqn: init.recv_cq.inner.handle.wire.cqn,
            srqn: init.srq.map_or(NO_SRQ, SharedReceiveQueue::srqn).into(),
            qp_type: init.qp_type.into(),
            sq_sig_all: init.sq_sig_all.into(),
            cap: cap.into(),
            sq_ring_addr: sq.device_addr().into(),
            rq_ring_addr: rq.device_addr().into(),
            ..Default::default()
        };
        let resp: CreateQpResp = dev.command(Opcode::CreateQp, req.as_bytes())?;
        // The device may grant more than asked (what the slot stride holds):
        // post within the grant; the rings still check the stride and the
        // format's limits.
        let granted = QpCapabilities::from(resp.cap);
        sq.limit_to(granted.max_send_wr);
        rq.limit_to(granted.max_recv_wr);
        let qpn = resp.qpn.get();
        let db_index = resp.db_index.get();
        let Some(bit) = doorbell::bit(db_index) else {
            tracing::error!(
                qpn,
                db_index,
                "Device gave a QP a doorbell index beyond MAX_QPS"
            );
            destroy_or_keep(dev, qpn, (sq, rq));
            return Err(Error::Protocol("doorbell index beyond MAX_QPS"));
        };
        let doorbell = Doorbell::new(dev.doorbell_page(), bit);
        let sq = SendRing::new(
            sq,
            doorbell.clone(),
            granted.max_send_sge,
            granted.max_inline_data,
        )
        .of_type(init.qp_type);
        let rq = match init.srq {
            Some(_) => RecvRing::of_srq_qp(rq),
            None => RecvRing::new(rq, Some(doorbell), granted.max_recv_sge),
        };
        Ok(QueuePair {
            pd: Arc::clone(&self.inner),
            parents: Arc::new(Parents {
                send_cq: Arc::clone(&init.send_cq.inner),
                recv_cq: Arc::clone(&init.recv_cq.inner),
                srq: init.srq.map(|s| Arc::clone(&s.inner)),
            }),
            qpn,
            cap: granted,
            sq: Arc::new(Mutex::new(sq)),
            rq: Arc::new(Mutex::new(rq)),
            live: true,
        })
    }
}

/// Queue-pair capacities (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QpCapabilities {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

impl From<QpCapabilities> for QpCap {
    fn from(c: QpCapabilities) -> Self {
        QpCap {
            max_send_wr: c.max_send_wr.into(),
            max_recv_wr: c.max_recv_wr.into(),
            max_send_sge: c.max_send_sge.into(),
            max_recv_sge: c.max_recv_sge.into(),
            max_inline_data: c.max_inline_data.into(),
        }
    }
}

impl From<QpCap> for QpCapabilities {
    fn from(c: QpCap) -> Self {
        QpCapabilities {
            max_send_wr: c.max_send_wr.get(),
            max_recv_wr: c.max_recv_wr.get(),
            max_send_sge: c.max_send_sge.get(),
            max_recv_sge: c.max_recv_sge.get(),
            max_inline_data: c.max_inline_data.get(),
        }
    }
}

/// What `create_qp` needs (`struct ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy)]
pub struct QpInitAttr<'a> {
    pub send_cq: &'a CompletionQueue,
    pub recv_cq: &'a CompletionQueue,
    pub cap: QpCapabilities,
    pub qp_type: QpType,
    /// Every send WQE completes with a CQE, signaled or not.
    pub sq_sig_all: bool,
    /// The SRQ its receives come from (`cap`'s receive capacities are
    /// then ignored).
    pub srq: Option<&'a SharedReceiveQueue>,
}

/// A queue pair (`struct ibv_qp`).
#[derive(Debug)]
pub struct QueuePair {
    pd: Arc<PdInner>,
    parents: Arc<Parents>,
    qpn: u32,
    cap: QpCapabilities,
    sq: Arc<Mutex<SendRing>>,
    rq: Arc<Mutex<RecvRing>>,
    live: bool,
}

/// The objects a QP uses besides its PD, held so that they outlive it: its
/// CQs and the SRQ it takes its receives from.
#[derive(Debug)]
struct Parents {
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    srq: Option<Arc<SrqInner>>,
}

/// Sends `DESTROY_QP` for `qpn`; when that fails the device may still use
/// the QP's `rings`, so they are kept until the device goes away.
fn destroy_or_keep(dev: &Device, qpn: u32, rings: impl std::any::Any + Send) {
    if let Err(e) = destroy(dev, qpn) {
        tracing::warn!(error = %e, qpn, "Cannot destroy a QP");
        dev.quarantine(rings);
    }
}

fn destroy(dev: &Device, qpn: u32) -> Result<()> {
    let req = QpHandle {
        qpn: qpn.into(),
        ..Default::default()
    };
    dev.command_no_reply(Opcode::DestroyQp, req.as_bytes())
}

/// A QP's send or receive ring, as a batch posts on it.
pub(super) trait PostRing {
    /// The work ring a batch writes and the doorbell it rings (an SRQ's
    /// has none).
    fn parts(&mut self) -> (&mut WorkRing, Option<&Doorbell>);
}

impl PostRing for SendRing {
    fn parts(&mut self) -> (&mut WorkRing, Option<&Doorbell>) {
        (&mut self.ring, Some(&self.doorbell))
    }
}

impl PostRing for RecvRing {
    fn parts(&mut self) -> (&mut WorkRing, Option<&Doorbell>) {
        (&mut self.ring, self.doorbell.as_ref())
    }
}

/// What [`SendBatch`] and [`RecvBatch`] share: the locked ring and, when
/// dropped, everything written published and the doorbell rung once (the
/// doorbell queue kicked only if the device sleeps).
#[derive(Debug)]
pub(super) struct Batch<'q, R: PostRing> {
    pub(super) ring: MutexGuard<'q, R>,
    pub(super) dev: &'q Device,
}

impl<R: PostRing> Drop for Batch<'_, R> {
    fn drop(&mut self) {
        let (ring, doorbell) = self.ring.parts();
        if ring.publish() && doorbell.is_some_and(Doorbell::ring) {
            self.dev.kick_doorbell();
        }
    }
}

/// Pushes `wrs` in order up to the first that fails, whose index is the
/// error's `bad_wr`.
pub(super) fn push_all<W>(
    wrs: &[W],
    mut push: impl FnMut(&W) -> Result<()>,
) -> Result<(), PostError> {
    for (bad_wr, wr) in wrs.iter().enumerate() {
        push(wr).map_err(|error| PostError { bad_wr, error })?;
    }
    Ok(())
}

/// Send work requests being posted: each [`SendBatch::push`] writes one WQE
/// (or fails, posting nothing); when the batch is dropped everything
/// written is published and the doorbell rung once. The QP's send queue is
/// locked meanwhile.
#[derive(Debug)]
pub struct SendBatch<'q>(Batch<'q, SendRing>);

impl SendBatch<'_> {
    /// Writes `wr` into the next slot: `ENOMEM` ([`Error::QueueFull`]) when
    /// the work in flight fills the queue, `EINVAL` for a request beyond
    /// the QP's capacities.
    pub fn push(&mut self, wr: &SendWr<'_>) -> Result<()> {
        self.0.ring.push(wr)
    }

    /// Ends the batch without posting anything pushed into it
    /// (`ibv_wr_abort`): the device never sees those WQEs, their slots are
    /// free again and the doorbell is not rung.
    pub fn abort(mut self) {
        self.0.ring.parts().0.discard_unpublished();
    }
}

/// Receive work requests being posted, like [`SendBatch`].
#[derive(Debug)]
pub struct RecvBatch<'q>(pub(super) Batch<'q, RecvRing>);

impl RecvBatch<'_> {
    /// Writes `wr` into the next slot (errors as [`SendBatch::push`]).
    pub fn push(&mut self, wr: &RecvWr<'_>) -> Result<()> {
        self.0.ring.push(wr)
    }
}

impl QueuePair {
    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// The capacities the device granted.
    pub fn cap(&self) -> QpCapabilities {
        self.cap
    }

    /// The number of the SRQ its receives come from, if any.
    pub fn srqn(&self) -> Option<u32> {
        self.parents.srq.as_ref().map(|s| s.srqn())
    }

    /// The send and receive CQs' numbers.
    pub fn cq_nums(&self) -> (u32, u32) {
        (self.parents.send_cq.cqn(), self.parents.recv_cq.cqn())
    }

    /// Starts posting on the send queue (see [`SendBatch`]).
    pub fn send_batch(&self) -> SendBatch<'_> {
        SendBatch(Batch {
            ring: lock(&self.sq),
            dev: &self.pd.dev,
        })
    }

    /// Starts posting on the receive queue (see [`RecvBatch`]).
    pub fn recv_batch(&self) -> RecvBatch<'_> {
        RecvBatch(Batch {
            ring: lock(&self.rq),
            dev: &self.pd.dev,
        })
    }

    /// `ibv_post_send`: writes the WQEs into the send ring in order up to
    /// the first that fails, publishes them and rings the doorbell once. A
    /// queue full of work in flight is `ENOMEM` until completions free
    /// slots.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let mut batch = self.send_batch();
        push_all(wrs, |wr| batch.push(wr))
    }

    /// `ibv_post_recv`: like [`QueuePair::post_send`] for the receive ring.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let mut batch = self.recv_batch();
        push_all(wrs, |wr| batch.push(wr))
    }

    /// Whether the device flagged the send or receive ring as in error.
    pub fn rings_in_error(&self) -> bool {
        lock(&self.sq).ring.in_error() || lock(&self.rq).ring.in_error()
    }

    /// `ibv_modify_qp`: applies the attributes of `attr` that `attr_mask`
    /// ([`vrdma_spec::qp_state::mask`] bits) selects.
    pub fn modify(&self, attr: &QpAttr, attr_mask: u32) -> Result<()> {
        let req = ModifyQpReq {
            qpn: self.qpn.into(),
            attr_mask: attr_mask.into(),
            attr: *attr,
        };
        self.pd
            .dev
            .command_no_reply(Opcode::ModifyQp, req.as_bytes())
    }

    /// `ibv_query_qp`: every attribute plus the creation attributes.
    pub fn query(&self, attr_mask: u32) -> Result<QueryQpResp> {
        let req = QueryQpReq {
            qpn: self.qpn.into(),
            attr_mask: attr_mask.into(),
        };
        self.pd.dev.command(Opcode::QueryQp, req.as_bytes())
    }

    /// `ibv_destroy_qp`, returning the device's errno; on failure the QP is
    /// handed back.
    pub fn destroy(mut self) -> Result<(), DestroyError<Self>> {
        let result = destroy(&self.pd.dev, self.qpn);
        // Still live (and destroyed on drop) if the device refused.
        self.live = result.is_err();
        DestroyError::hand_back(self, result)
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        if self.live {
            let rings = (Arc::clone(&self.sq), Arc::clone(&self.rq));
            destroy_or_keep(&self.pd.dev, self.qpn, rings);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceOptions;
    use crate::ring::{SendPayload, Sge};
    use crate::testing::{config, options, Reply, StubTransport, FEATURES};
    use crate::verbs::Context;
    use std::time::Duration;
    use vrdma_spec::control::{CqHandle, CreateCqReq, PdHandle, SetDoorbellReq};
    use vrdma_spec::limits::{CapLimits, Caps, QpGrant, MAX_QPS};
    use vrdma_spec::ring::{
        Cqe, CQE_SIZE, DEVICE_INDEX_OFFSET, DRIVER_INDEX_OFFSET, RING_HEADER_SIZE,
    };
    use vrdma_spec::verbs::{SendOpcode, WcStatus};
    use vrdma_spec::DOORBELL_QUEUE;
    use zerocopy::FromBytes;

    const QPN: u32 = 9;
    const CQN: u32 = 3;

    /// A device that creates PDs, CQs and QPs the way vdev does (the grant
    /// from `QpGrant`), giving its QPs doorbell index `db_index`.
    fn device(db_index: u32) -> (Arc<StubTransport>, Context) {
        let stub = StubTransport::with_config(&config(1, 64), FEATURES).answering(
            move |op, req| match op {
                Opcode::AllocPd => Reply::of(&PdHandle {
                    pdn: 1.into(),
                    ..Default::default()
                }),
                Opcode::CreateCq => Reply::of(&CqHandle {
                    cqn: CQN.into(),
                    ..Default::default()
                }),
                Opcode::CreateQp => {
                    let cap = CreateQpReq::read_from_bytes(req).unwrap().cap;
                    let asked = Caps {
                        max_send_wr: cap.max_send_wr.get(),
                        max_recv_wr: cap.max_recv_wr.get(),
                        max_send_sge: cap.max_send_sge.get(),
                        max_recv_sge: cap.max_recv_sge.get(),
                        max_inline_data: cap.max_inline_data.get(),
                    };
                    let limits = CapLimits {
                        max_wr: 1024,
                        max_sge: 16,
                        max_inline_data: 256,
                    };
                    let g = QpGrant::compute(asked, limits).unwrap().caps;
                    Reply::of(&CreateQpResp {
                        qpn: QPN.into(),
                        db_index: db_index.into(),
                        cap: QpCap {
                            max_send_wr: g.max_send_wr.into(),
                            max_recv_wr: g.max_recv_wr.into(),
                            max_send_sge: g.max_send_sge.into(),
                            max_recv_sge: g.max_recv_sge.into(),
                            max_inline_data: g.max_inline_data.into(),
                        },
                        ..Default::default()
                    })
                }
                // Destroys and deallocations.
                _ => Reply::Ok(Vec::new()),
            },
        );
        let stub = Arc::new(stub);
        // Every command is answered: a slow test host must not time out.
        let options = DeviceOptions {
            control_timeout: Duration::from_secs(5),
            ..options()
        };
        let ctx = Context::open(Box::new(Arc::clone(&stub)), options).unwrap();
        (stub, ctx)
    }

    fn caps(wr: u32) -> QpCapabilities {
        QpCapabilities {
            max_send_wr: wr,
            max_recv_wr: wr,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        }
    }

    fn init(cq: &CompletionQueue, wr: u32) -> QpInitAttr<'_> {
        QpInitAttr {
            send_cq: cq,
            recv_cq: cq,
            cap: caps(wr),
            qp_type: QpType::Rc,
            sq_sig_all: true,
            srq: None,
        }
    }

    /// A QP of 16 work requests per queue on a fresh `device(db_index)`,
    /// and its CQ of `cqe` entries.
    fn queue_pair(db_index: u32, cqe: u32) -> (Arc<StubTransport>, CompletionQueue, QueuePair) {
        let (stub, ctx) = device(db_index);
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(cqe, 0).unwrap();
        let qp = pd.create_qp(&init(&cq, 16)).unwrap();
        (stub, cq, qp)
    }

    /// The address of the ring of the (first) CQ created on `stub`.
    fn cq_ring(stub: &StubTransport) -> u64 {
        stub.requests::<CreateCqReq>(Opcode::CreateCq)[0]
            .ring_addr
            .get()
    }

    fn read_u32(stub: &StubTransport, addr: u64) -> u32 {
        let mut raw = [0u8; 4];
        stub.read(addr, &mut raw);
        u32::from_le_bytes(raw)
    }

    fn read_u64(stub: &StubTransport, addr: u64) -> u64 {
        let mut raw = [0u8; 8];
        stub.read(addr, &mut raw);
        u64::from_le_bytes(raw)
    }

    const SGE: [Sge; 1] = [Sge {
        addr: 0x1000,
        length: 8,
        lkey: 1,
    }];

    fn sends(n: u64) -> Vec<SendWr<'static>> {
        (0..n)
            .map(|i| SendWr::new(i, SendOpcode::Send, SendPayload::Sges(&SGE)))
            .collect()
    }

    #[test]
    fn a_full_send_queue_is_enomem_until_the_device_completes_work() {
        let (stub, cq, qp) = queue_pair(0, 16);
        assert_eq!(qp.cap().max_send_wr, 16);
        let sq = stub.requests::<CreateQpReq>(Opcode::CreateQp)[0]
            .sq_ring_addr
            .get();
        let cq_ring = cq_ring(&stub);
        let wrs = sends(18);

        qp.post_send(&wrs[..16]).unwrap();
        assert_eq!(read_u32(&stub, sq + DRIVER_INDEX_OFFSET), 16);
        let err = qp.post_send(&wrs[16..17]).unwrap_err();
        assert_eq!((err.bad_wr, err.errno()), (0, libc::ENOMEM));
        assert!(matches!(err.error, Error::QueueFull));
        // The device took all 16 into its datapath, but none completed:
        // the slots are still the device's.
        let mut wc = [Default::default(); 4];
        assert_eq!(cq.poll(&mut wc).unwrap(), 0);
        assert_eq!(
            qp.post_send(&wrs[16..17]).unwrap_err().errno(),
            libc::ENOMEM
        );
        assert_eq!(read_u32(&stub, sq + DRIVER_INDEX_OFFSET), 16);

        // The device completes the first WQE: its CQE, then the SQ slot.
        let cqe = Cqe {
            wr_id: 0.into(),
            qp_num: QPN.into(),
            ..Default::default()
        };
        stub.write(cq_ring + RING_HEADER_SIZE as u64, cqe.as_bytes());
        stub.store_u32(cq_ring + DEVICE_INDEX_OFFSET, 1);
        stub.store_u32(sq + DEVICE_INDEX_OFFSET, 1);
        assert_eq!(cq.poll(&mut wc).unwrap(), 1);
        assert_eq!((wc[0].wr_id, wc[0].status), (0, WcStatus::Success));
        // One slot free: the 17th fits, the 18th does not.
        let err = qp.post_send(&wrs[16..18]).unwrap_err();
        assert_eq!((err.bad_wr, err.errno()), (1, libc::ENOMEM));
        assert_eq!(read_u32(&stub, sq + DRIVER_INDEX_OFFSET), 17);
        // The 17th went into slot 0, over the completed WQE.
        let mut slot = [0u8; 8];
        stub.read(sq + RING_HEADER_SIZE as u64, &mut slot);
        assert_eq!(u64::from_le_bytes(slot), 16);
        assert_eq!(CQE_SIZE, 32);
    }

    #[test]
    fn each_post_call_rings_the_doorbell_once_and_kicks_only_when_asked() {
        let db_index = 64 + 13;
        let (stub, _cq, qp) = queue_pair(db_index, 16);
        let page = stub.requests::<SetDoorbellReq>(Opcode::SetDoorbell)[0]
            .addr
            .get();
        let (word, summary) = (
            page + doorbell::BITMAP_OFFSET + 8,
            page + doorbell::SUMMARY_OFFSET,
        );
        let kicks = || {
            stub.notified
                .lock()
                .unwrap()
                .iter()
                .filter(|&&q| q == DOORBELL_QUEUE)
                .count()
        };
        let wrs = sends(3);

        qp.post_send(&wrs).unwrap();
        assert_eq!(read_u64(&stub, word), 1 << 13, "QP 77: word 1, bit 13");
        assert_eq!(read_u64(&stub, summary), 1 << 1, "word 1: summary bit 1");
        assert_eq!(kicks(), 0, "the device polls: no kick");

        // The device takes the bits, then goes to sleep.
        stub.write(summary, &0u64.to_le_bytes());
        stub.write(word, &0u64.to_le_bytes());
        stub.store_u32(page + doorbell::FLAGS_OFFSET, doorbell::NEED_KICK);
        qp.post_send(&wrs).unwrap();
        assert_eq!(kicks(), 1, "three work requests, one kick");
        assert_eq!(read_u64(&stub, word), 1 << 13);
        let recv = RecvWr {
            wr_id: 1,
            sg_list: &SGE,
        };
        qp.post_recv(&[recv, recv]).unwrap();
        assert_eq!(kicks(), 2);

        // Nothing posted, nothing rung: an empty list, a first request
        // that fails, a full queue.
        stub.write(word, &0u64.to_le_bytes());
        qp.post_send(&[]).unwrap();
        let too_many = [SGE[0]; 2];
        assert_eq!(qp.cap().max_send_sge, 1, "what a 64-byte slot holds");
        let bad = SendWr::new(9, SendOpcode::Send, SendPayload::Sges(&too_many));
        assert_eq!(qp.post_send(&[bad]).unwrap_err().errno(), libc::EINVAL);
        let mut batch = qp.send_batch();
        batch.push(&wrs[0]).unwrap();
        assert_eq!(kicks(), 2, "a batch rings when it ends");
        drop(batch);
        assert_eq!(kicks(), 3);
        assert_eq!(read_u64(&stub, word), 1 << 13);

        // An aborted batch publishes nothing and rings nothing; the next
        // post reuses its slots.
        let sq = stub.requests::<CreateQpReq>(Opcode::CreateQp)[0]
            .sq_ring_addr
            .get();
        let published = read_u32(&stub, sq + DRIVER_INDEX_OFFSET);
        stub.write(word, &0u64.to_le_bytes());
        let mut batch = qp.send_batch();
        batch.push(&wrs[0]).unwrap();
        batch.push(&wrs[1]).unwrap();
        batch.abort();
        assert_eq!(kicks(), 3, "an aborted batch rings nothing");
        assert_eq!(read_u64(&stub, word), 0);
        assert_eq!(read_u32(&stub, sq + DRIVER_INDEX_OFFSET), published);
        qp.post_send(&wrs[2..3]).unwrap();
        assert_eq!(read_u32(&stub, sq + DRIVER_INDEX_OFFSET), published + 1);
        assert_eq!(kicks(), 4);
    }

    #[test]
    fn posting_and_polling_allocate_nothing() {
        let (stub, cq, qp) = queue_pair(5, 64);
        let cq_ring = cq_ring(&stub);
        let cqe = Cqe {
            wr_id: 7.into(),
            ..Default::default()
        };
        stub.write(cq_ring + RING_HEADER_SIZE as u64, cqe.as_bytes());
        stub.store_u32(cq_ring + DEVICE_INDEX_OFFSET, 1);
        let wrs = sends(16);
        let recv = [RecvWr {
            wr_id: 1,
            sg_list: &SGE,
        }; 8];
        let mut wc = [Default::default(); 8];
        let mut polled = 0;
        let n = crate::testing::allocations_in(|| {
            qp.post_send(&wrs).unwrap();
            qp.post_recv(&recv).unwrap();
            // The error path too: the queue is full now.
            let mut batch = qp.send_batch();
            assert_eq!(batch.push(&wrs[0]).unwrap_err().errno(), libc::ENOMEM);
            drop(batch);
            polled = cq.poll(&mut wc).unwrap();
            polled += cq.poll(&mut wc).unwrap();
        });
        assert_eq!(polled, 1);
        assert_eq!(wc[0].wr_id, 7);
        assert_eq!(n, 0, "heap allocations on the data path");
        // The counter does count: the same thread allocating is seen.
        assert_eq!(crate::testing::allocations_in(|| drop(vec![1u8])), 1);
    }

    #[test]
    fn a_doorbell_index_beyond_the_page_destroys_the_qp() {
        let (stub, ctx) = device(MAX_QPS);
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4, 0).unwrap();
        let err = pd.create_qp(&init(&cq, 4)).unwrap_err();
        assert_eq!(err.errno(), libc::EPROTO);
        let destroyed = stub.requests::<QpHandle>(Opcode::DestroyQp);
        assert_eq!(destroyed.len(), 1);
        assert_eq!(destroyed[0].qpn.get(), QPN);
    }

    #[test]
    fn capabilities_convert_both_ways() {
        let caps = QpCapabilities {
            max_send_wr: 1,
            max_recv_wr: 2,
            max_send_sge: 3,
            max_recv_sge: 4,
            max_inline_data: 5,
        };
        let wire = QpCap::from(caps);
        assert_eq!(
            wire.as_bytes(),
            [1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0, 5, 0, 0, 0]
        );
        assert_eq!(QpCapabilities::from(wire), caps);
    }
}
