//! What the device format carries: the ceiling of every limit and grant.
//!
//! These are the single source for the numbers several crates share: the
//! tenant policy may not configure more ([`vrdma_tenant_policy`]'s ceiling
//! is built from them), vdev never grants more, the guest driver never
//! posts more, and hostd's WQE reader carries exactly this much. A limit
//! that one side allowed and another could not carry is how a WQE with 17
//! SGEs once failed on a QP granted 28.
//!
//! [`vrdma_tenant_policy`]: ../../vrdma_tenant_policy/index.html

use crate::ring::{RecvWqe, SendWqe, WorkRingGeometry, SGE_SIZE};

/// Most scatter/gather elements of one send or receive WQE.
pub const MAX_SGE: u32 = 64;
/// Most inline bytes of one send WQE.
pub const MAX_INLINE_DATA: u32 = 1024;
/// Largest stride (bytes of one slot) of a send or receive ring: the
/// largest WQE, 64 SGEs or 1024 inline bytes after the fixed part, fits.
pub const MAX_WQE_STRIDE: u32 = 4096;
/// Largest number of entries of a work or event ring.
pub const MAX_RING_DEPTH: u32 = 1 << 16;
/// Largest number of entries of a completion ring: 4 Mi (128 MiB of
/// CQEs), as many as ConnectX devices offer (`max_cqe` 4 Mi − 1). A CQ's
/// indices are free-running 32-bit counters like every ring's, so its
/// depth is bounded by memory, not by the format.
pub const MAX_CQ_DEPTH: u32 = 1 << 22;
/// Largest message of one work request in bytes: the port's
/// `max_msg_sz` (2 GiB, as on InfiniBand).
pub const MAX_MSG_SIZE: u32 = 1 << 31;
/// Most queue pairs one device may have: one doorbell bit each
/// ([`crate::ring::doorbell`]).
pub const MAX_QPS: u32 = 1 << 14;

const SEND_FIXED: u32 = core::mem::size_of::<SendWqe>() as u32;
const RECV_FIXED: u32 = core::mem::size_of::<RecvWqe>() as u32;

// The largest WQEs fit a slot.
const _: () = assert!(SEND_FIXED + MAX_SGE * SGE_SIZE as u32 <= MAX_WQE_STRIDE);
const _: () = assert!(SEND_FIXED + MAX_INLINE_DATA <= MAX_WQE_STRIDE);
const _: () = assert!(RECV_FIXED + MAX_SGE * SGE_SIZE as u32 <= MAX_WQE_STRIDE);

/// Queue-pair capacities as numbers (the wire form is
/// [`crate::control::QpCap`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Caps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// The ceilings a device applies to one QP's capacities (the tenant's
/// limits, themselves at most this module's constants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapLimits {
    pub max_wr: u32,
    pub max_sge: u32,
    pub max_inline_data: u32,
}

/// Why capacities cannot be granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapError {
    /// `field` asks for `value`, above `max`.
    TooLarge {
        field: &'static str,
        value: u32,
        max: u32,
    },
    /// Neither a send nor a receive queue was asked for.
    NoQueue,
}

impl core::fmt::Display for CapError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            CapError::TooLarge { field, value, max } => {
                write!(f, "cap.{field} = {value} exceeds {max}")
            }
            CapError::NoQueue => write!(f, "a QP needs a send or a receive queue"),
        }
    }
}

/// A QP's rings and what it may post on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpGrant {
    pub sq: WorkRingGeometry,
    pub rq: WorkRingGeometry,
    /// At least what was asked for, at most what the rings hold and the
    /// limits allow: exactly what the datapath carries.
    pub caps: Caps,
}

impl QpGrant {
    /// The rings for `asked` and the capacities granted on them, or why
    /// `asked` exceeds `limits` (which must not exceed this module's
    /// constants; they are clamped to them).
    ///
    /// The driver sizes its rings from what it asked with
    /// [`crate::ring::sq_geometry`]/[`crate::ring::rq_geometry`], which is
    /// what this computes, so both sides agree on the geometry.
    pub fn compute(asked: Caps, limits: CapLimits) -> Result<QpGrant, CapError> {
        let max_wr = limits.max_wr.min(MAX_RING_DEPTH);
        let max_sge = limits.max_sge.min(MAX_SGE);
        let max_inline = limits.max_inline_data.min(MAX_INLINE_DATA);
        let checks = [
            ("max_send_wr", asked.max_send_wr, max_wr),
            ("max_recv_wr", asked.max_recv_wr, max_wr),
            ("max_send_sge", asked.max_send_sge, max_sge),
            ("max_recv_sge", asked.max_recv_sge, max_sge),
            ("max_inline_data", asked.max_inline_data, max_inline),
        ];
        for (field, value, max) in checks {
            if value > max {
                return Err(CapError::TooLarge { field, value, max });
            }
        }
        if asked.max_send_wr == 0 && asked.max_recv_wr == 0 {
            return Err(CapError::NoQueue);
        }
        let too_large = |field| CapError::TooLarge {
            field,
            value: u32::MAX,
            max: MAX_WQE_STRIDE,
        };
        let sq =
            crate::ring::sq_geometry(asked.max_send_wr, asked.max_send_sge, asked.max_inline_data)
                .ok_or(too_large("max_send_sge"))?;
        let rq = crate::ring::rq_geometry(asked.max_recv_wr, asked.max_recv_sge)
            .ok_or(too_large("max_recv_sge"))?;
        let sq_payload = sq.stride - SEND_FIXED;
        let rq_payload = rq.stride - RECV_FIXED;
        let caps = Caps {
            max_send_wr: sq.depth.min(max_wr),
            max_recv_wr: rq.depth.min(max_wr),
            max_send_sge: (sq_payload / SGE_SIZE as u32).min(max_sge),
            max_recv_sge: (rq_payload / SGE_SIZE as u32).min(max_sge),
            max_inline_data: sq_payload.min(max_inline),
        };
        Ok(QpGrant { sq, rq, caps })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: CapLimits = cap_limits(MAX_RING_DEPTH, MAX_SGE, MAX_INLINE_DATA);

    const fn cap_limits(wr: u32, sge: u32, inline: u32) -> CapLimits {
        CapLimits {
            max_wr: wr,
            max_sge: sge,
            max_inline_data: inline,
        }
    }

    fn caps(wr: u32, sge: u32, inline: u32) -> Caps {
        Caps {
            max_send_wr: wr,
            max_recv_wr: wr,
            max_send_sge: sge,
            max_recv_sge: sge,
            max_inline_data: inline,
        }
    }

    #[test]
    fn grants_never_exceed_the_limits_or_the_format() {
        // 16 SGEs fill a 512-byte slot that would hold 29: only 16 are granted
        // when the limit is 16, and never more than MAX_SGE.
        let g = QpGrant::compute(caps(16, 16, 0), cap_limits(4096, 16, 256)).expect("fits");
        assert_eq!(g.sq.stride, 512);
        assert_eq!(g.caps.max_send_sge, 16);
        assert_eq!(g.caps.max_inline_data, 256);
        let g = QpGrant::compute(caps(16, 16, 0), ALL).expect("fits");
        assert_eq!(
            g.caps.max_send_sge, 29,
            "what the slot holds, within MAX_SGE"
        );
        let g = QpGrant::compute(caps(1, MAX_SGE, MAX_INLINE_DATA), ALL).expect("fits");
        assert_eq!(g.caps.max_send_sge, MAX_SGE);
        assert_eq!(g.caps.max_recv_sge, MAX_SGE);
        assert_eq!(g.caps.max_inline_data, MAX_INLINE_DATA);
        assert!(g.sq.stride <= MAX_WQE_STRIDE);
    }

    #[test]
    fn asks_beyond_the_limits_are_refused() {
        let limits = cap_limits(16, 4, 64);
        assert_eq!(
            QpGrant::compute(caps(17, 1, 0), limits),
            Err(CapError::TooLarge {
                field: "max_send_wr",
                value: 17,
                max: 16
            })
        );
        assert!(QpGrant::compute(caps(1, 5, 0), limits).is_err());
        assert!(QpGrant::compute(caps(1, 1, 65), limits).is_err());
        assert_eq!(
            QpGrant::compute(caps(0, 1, 0), limits),
            Err(CapError::NoQueue)
        );
        // Limits above the format are clamped to it.
        let huge = cap_limits(u32::MAX, u32::MAX, u32::MAX);
        assert!(QpGrant::compute(caps(1, MAX_SGE + 1, 0), huge).is_err());
    }

    #[test]
    fn the_depth_granted_is_what_was_asked_rounded_up_within_the_limit() {
        let limits = cap_limits(100, 4, 64);
        let g = QpGrant::compute(caps(100, 1, 0), limits).expect("fits");
        assert_eq!(g.sq.depth, 128);
        assert_eq!(g.caps.max_send_wr, 100, "never above the limit");
        let g = QpGrant::compute(caps(16, 1, 0), limits).expect("fits");
        assert_eq!(g.caps.max_send_wr, 16);
    }
}
