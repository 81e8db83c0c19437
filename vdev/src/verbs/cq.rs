//! Completion queues: their rings in guest memory, mirrored to hostd,
//! which writes the CQEs.

use vrdma_spec::control::CreateCqReq;
use vrdma_spec::ring;

use super::share::Counted;
use super::{RdmaDevice, VerbError, VerbResult};

/// A completion queue: its ring in guest memory.
#[derive(Debug)]
pub struct CompletionQueue {
    pub depth: u32,
    pub comp_vector: u32,
    pub ring_addr: u64,
    /// Number of QPs whose send or receive queue completes here.
    pub(super) users: u32,
}

impl RdmaDevice {
    pub(super) fn create_cq(&mut self, req: &CreateCqReq) -> VerbResult<u32> {
        let taken = self.share.take(Counted::Cq, self.limits.max_cq)?;
        let entries = req.depth.get();
        if entries == 0 || entries > self.limits.max_cq_depth {
            return Err(VerbError::Invalid(format!(
                "CQ depth {entries} (must be 1..={})",
                self.limits.max_cq_depth
            )));
        }
        let depth = ring::cq_depth(entries)
            .ok_or_else(|| VerbError::Invalid(format!("CQ depth {entries}")))?;
        let comp_vector = req.comp_vector.get();
        self.check_vector(comp_vector)?;
        let ring_addr = req.ring_addr.get();
        self.check_ring(ring_addr, ring::cq_ring_bytes(depth))?;
        self.reset_ring(ring_addr)?;
        let cqn = self.new_handle();
        if let Some(fabric) = &self.fabric {
            fabric
                .create_cq(cqn, (ring_addr, depth), comp_vector, false)
                .map_err(VerbError::Fabric)?;
        }
        self.cqs.insert(
            cqn,
            CompletionQueue {
                depth,
                comp_vector,
                ring_addr,
                users: 0,
            },
        );
        taken.keep();
        Ok(cqn)
    }

    pub(super) fn destroy_cq(&mut self, cqn: u32) -> VerbResult<()> {
        let cq = self.cqs.get(&cqn).ok_or(VerbError::NoObject {
            kind: "CQ",
            handle: cqn,
        })?;
        if cq.users > 0 {
            return Err(VerbError::Busy {
                kind: "CQ",
                handle: cqn,
                users: format!("{} QPs", cq.users),
            });
        }
        if let Some(fabric) = &self.fabric {
            // hostd answers once it no longer writes the ring.
            if let Err(e) = fabric.destroy_cq(cqn) {
                tracing::warn!(tenant = %self.tenant(), cqn, error = %e, "hostd did not destroy the CQ");
            }
        }
        self.cqs.remove(&cqn);
        self.share.give_back(Counted::Cq, 1);
        Ok(())
    }

    /// The CQ numbered `cqn`.
    pub fn cq(&self, cqn: u32) -> Option<&CompletionQueue> {
        self.cqs.get(&cqn)
    }
}
