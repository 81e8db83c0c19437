//! Shared receive queues (`struct ibv_srq`): a receive ring that the QPs
//! created with it take their receives from, in posting order.
//!
//! Posting is the QP receive ring's, without the doorbell: the device
//! reads an SRQ's ring when a message arrives, and frees a slot as soon
//! as it has taken the WQE (device spec §6.9).

use std::sync::{Arc, Mutex};

use vrdma_spec::control::{CreateSrqReq, ModifySrqReq, Opcode, SrqAttr, SrqHandle};
use vrdma_spec::ring::rq_geometry;
use zerocopy::IntoBytes;

use super::qp::{push_all, Batch};
use super::{lock, Handle, PdInner, ProtectionDomain};
use crate::error::{DestroyError, Error, PostError, Result};
use crate::ring::{RecvRing, RecvWr, WorkRing};
use crate::verbs::RecvBatch;

#[derive(Debug)]
pub(super) struct SrqInner {
    pub(super) pd: Arc<PdInner>,
    handle: Handle<SrqHandle>,
    ring: Arc<Mutex<RecvRing>>,
    max_wr: u32,
    max_sge: u32,
}

impl SrqInner {
    pub(super) fn srqn(&self) -> u32 {
        self.handle.wire.srqn.get()
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        if let Err(e) = self.handle.destroy(&self.pd.dev) {
            tracing::warn!(error = %e, srqn = self.srqn(), "Cannot destroy an SRQ");
            // The device may still read the ring.
            self.pd.dev.quarantine(Arc::clone(&self.ring));
        }
    }
}

/// A shared receive queue (`struct ibv_srq`).
#[derive(Debug)]
pub struct SharedReceiveQueue {
    pub(super) inner: Arc<SrqInner>,
}

impl ProtectionDomain {
    /// `ibv_create_srq`: room for at least `max_wr` receives of up to
    /// `max_sge` SGEs, the limit event armed at `srq_limit` (0: not armed).
    pub fn create_srq(
        &self,
        max_wr: u32,
        max_sge: u32,
        srq_limit: u32,
    ) -> Result<SharedReceiveQueue> {
        let geometry = rq_geometry(max_wr, max_sge)
            .ok_or(Error::InvalidArgument("SRQ capacities too large"))?;
        let dev = &self.inner.dev;
        let (len, align) = WorkRing::alloc_args(geometry)?;
        let mut ring = WorkRing::new(dev.alloc(len, align, true)?, geometry);
        let req = CreateSrqReq {
            pdn: self.inner.handle.wire.pdn,
            max_wr: max_wr.into(),
            max_sge: max_sge.into(),
            srq_limit: srq_limit.into(),
            ring_addr: ring.device_addr().into(),
        };
        let granted: SrqAttr = dev.command(Opcode::CreateSrq, req.as_bytes())?;
        let (max_wr, max_sge) = (granted.max_wr.get(), granted.max_sge.get());
        ring.limit_to(max_wr);
        let handle = SrqHandle {
            srqn: granted.srqn,
            reserved: 0.into(),
        };
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                pd: Arc::clone(&self.inner),
                handle: Handle::new(Opcode::DestroySrq, handle),
                ring: Arc::new(Mutex::new(RecvRing::new(ring, None, max_sge))),
                max_wr,
                max_sge,
            }),
        })
    }
}

impl SharedReceiveQueue {
    /// The device's SRQ number (what its limit event names).
    pub fn srqn(&self) -> u32 {
        self.inner.srqn()
    }

    /// Receives it holds and SGEs one may carry, as the device granted.
    pub fn caps(&self) -> (u32, u32) {
        (self.inner.max_wr, self.inner.max_sge)
    }

    /// Starts posting receives (see [`RecvBatch`]).
    pub fn recv_batch(&self) -> RecvBatch<'_> {
        RecvBatch(Batch {
            ring: lock(&self.inner.ring),
            dev: &self.inner.pd.dev,
        })
    }

    /// `ibv_post_srq_recv`: writes the WQEs in order up to the first that
    /// fails and publishes them.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let mut batch = self.recv_batch();
        push_all(wrs, |wr| batch.push(wr))
    }

    /// `ibv_modify_srq` with [`vrdma_spec::control::srq_mask`] bits: LIMIT arms the limit event
    /// at `srq_limit`; MAX_WR (resizing) is refused by the device.
    pub fn modify(&self, attr_mask: u32, max_wr: u32, srq_limit: u32) -> Result<()> {
        let req = ModifySrqReq {
            srqn: self.inner.handle.wire.srqn,
            attr_mask: attr_mask.into(),
            max_wr: max_wr.into(),
            srq_limit: srq_limit.into(),
        };
        self.inner
            .pd
            .dev
            .command_no_reply(Opcode::ModifySrq, req.as_bytes())
    }

    /// `ibv_query_srq`: its capacities and its limit now (0 once the limit
    /// event fired).
    pub fn query(&self) -> Result<SrqAttr> {
        let req = self.inner.handle.wire;
        self.inner.pd.dev.command(Opcode::QuerySrq, req.as_bytes())
    }

    /// `ibv_destroy_srq`, returning the device's errno (`EBUSY` while QPs
    /// use it); on failure the SRQ is handed back.
    pub fn destroy(self) -> Result<(), DestroyError<Self>> {
        let result = self.inner.handle.destroy(&self.inner.pd.dev);
        DestroyError::hand_back(self, result)
    }
}
