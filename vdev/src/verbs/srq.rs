//! Shared receive queues: a receive ring in guest memory that the QPs
//! created with its number take their receives from, in posting order, and
//! the limit event armed with MODIFY_SRQ — each mirrored to hostd, whose
//! datapath consumes the ring and fires the event.

use vrdma_hostd_protocol::messages::{SrqSetup, WorkRing};
use vrdma_spec::control::{srq_mask, CreateSrqReq, ModifySrqReq, SrqAttr};
use vrdma_spec::limits::{Caps, QpGrant};
use vrdma_spec::ring::WorkRingGeometry;

use super::qp::cap_limits;
use super::share::Counted;
use super::{RdmaDevice, VerbError, VerbResult};

/// A shared receive queue.
#[derive(Debug)]
pub struct SharedReceiveQueue {
    pub pdn: u32,
    pub ring: (u64, WorkRingGeometry),
    /// Receive WQEs it holds (the ring's depth).
    pub max_wr: u32,
    /// SGEs one of its WQEs may carry.
    pub max_sge: u32,
    /// The limit as last armed (hostd's datapath disarms it when it fires;
    /// QUERY_SRQ asks hostd).
    pub limit: u32,
    /// QPs that take their receives from it.
    pub(super) users: u32,
}

impl SharedReceiveQueue {
    /// SRQ `srqn` as hostd's datapath needs it.
    pub(super) fn setup(&self, srqn: u32) -> SrqSetup {
        let (gpa, geometry) = self.ring;
        SrqSetup {
            srqn,
            pd: self.pdn,
            ring: WorkRing {
                gpa,
                depth: geometry.depth,
                stride: geometry.stride,
            },
            max_sge: self.max_sge,
            limit: self.limit,
        }
    }
}

impl RdmaDevice {
    pub(super) fn create_srq(&mut self, req: &CreateSrqReq) -> VerbResult<SrqAttr> {
        let pdn = req.pdn.get();
        self.pd_mut(pdn)?;
        let taken = self.share.take(Counted::Srq, self.limits.max_srq)?;
        let (wr, sge, limit) = (req.max_wr.get(), req.max_sge.get(), req.srq_limit.get());
        // The SRQ's ring is a receive ring: granted as a QP's receive queue
        // is, by the one computation every side shares.
        let asked = Caps {
            max_send_wr: 0,
            max_recv_wr: wr,
            max_send_sge: 0,
            max_recv_sge: sge,
            max_inline_data: 0,
        };
        let grant = QpGrant::compute(asked, cap_limits(&self.limits))
            .map_err(|e| VerbError::Invalid(format!("SRQ: {e}")))?;
        let (geometry, max_sge) = (grant.rq, grant.caps.max_recv_sge);
        if limit > geometry.depth {
            return Err(VerbError::Invalid(format!(
                "srq_limit {limit} above the SRQ's {} WRs",
                geometry.depth
            )));
        }
        let addr = req.ring_addr.get();
        self.check_ring(addr, geometry.ring_bytes())?;
        self.reset_ring(addr)?;
        let srqn = self.new_handle();
        let srq = SharedReceiveQueue {
            pdn,
            ring: (addr, geometry),
            max_wr: geometry.depth,
            max_sge,
            limit,
            users: 0,
        };
        if let Some(fabric) = &self.fabric {
            fabric
                .create_srq(srq.setup(srqn))
                .map_err(VerbError::Fabric)?;
        }
        self.srqs.insert(srqn, srq);
        self.pd_mut(pdn)?.qps += 1;
        taken.keep();
        Ok(SrqAttr {
            srqn: srqn.into(),
            max_wr: geometry.depth.into(),
            max_sge: max_sge.into(),
            srq_limit: limit.into(),
        })
    }

    fn srq_mut(&mut self, srqn: u32) -> VerbResult<&mut SharedReceiveQueue> {
        self.srqs.get_mut(&srqn).ok_or(VerbError::NoObject {
            kind: "SRQ",
            handle: srqn,
        })
    }

    pub(super) fn modify_srq(&mut self, req: &ModifySrqReq) -> VerbResult<()> {
        let srqn = req.srqn.get();
        let fabric = self.fabric.clone();
        let srq = self.srq_mut(srqn)?;
        let mask = req.attr_mask.get();
        if mask & !(srq_mask::MAX_WR | srq_mask::LIMIT) != 0 {
            return Err(VerbError::Invalid(format!("SRQ attribute mask {mask:#x}")));
        }
        if mask & srq_mask::MAX_WR != 0 {
            // As mlx5: an SRQ is not resized (its ring is the driver's).
            return Err(VerbError::Invalid("resizing an SRQ".into()));
        }
        if mask & srq_mask::LIMIT == 0 {
            return Ok(());
        }
        let limit = req.srq_limit.get();
        if limit > srq.max_wr {
            return Err(VerbError::Invalid(format!(
                "srq_limit {limit} above the SRQ's {} WRs",
                srq.max_wr
            )));
        }
        if let Some(fabric) = fabric {
            fabric.modify_srq(srqn, limit).map_err(VerbError::Fabric)?;
        }
        srq.limit = limit;
        Ok(())
    }

    pub(super) fn query_srq(&mut self, srqn: u32) -> VerbResult<SrqAttr> {
        let fabric = self.fabric.clone();
        let srq = self.srq_mut(srqn)?;
        if let Some(fabric) = fabric {
            srq.limit = fabric.query_srq(srqn).map_err(VerbError::Fabric)?;
        }
        Ok(SrqAttr {
            srqn: srqn.into(),
            max_wr: srq.max_wr.into(),
            max_sge: srq.max_sge.into(),
            srq_limit: srq.limit.into(),
        })
    }

    pub(super) fn destroy_srq(&mut self, srqn: u32) -> VerbResult<()> {
        let srq = self.srq_mut(srqn)?;
        if srq.users > 0 {
            return Err(VerbError::Busy {
                kind: "SRQ",
                handle: srqn,
                users: format!("{} QPs", srq.users),
            });
        }
        if let Some(fabric) = &self.fabric {
            // hostd answers once it no longer reads the ring.
            if let Err(e) = fabric.destroy_srq(srqn) {
                tracing::warn!(tenant = %self.tenant(), srqn, error = %e, "hostd did not destroy the SRQ");
            }
        }
        if let Some(srq) = self.srqs.remove(&srqn) {
            self.share.give_back(Counted::Srq, 1);
            if let Some(pd) = self.pds.get_mut(&srq.pdn) {
                pd.qps -= 1;
            }
        }
        Ok(())
    }

    /// The SRQ numbered `srqn`.
    pub fn srq(&self, srqn: u32) -> Option<&SharedReceiveQueue> {
        self.srqs.get(&srqn)
    }
}
