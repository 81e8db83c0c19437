//! Resource limits of one tenant's device: how many verbs objects it may
//! create and how much memory it may register. vdev advertises them as the
//! device's limits (config space, `ibv_query_device`) and enforces them at
//! each control verb.

use serde::{Deserialize, Serialize};
use vrdma_spec::limits as spec;

/// Why a set of limits is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LimitsError {
    #[error("Limit `{key}` must be at least 1")]
    Zero { key: &'static str },
    #[error("Limit `{key}` = {value} exceeds the device maximum {max}")]
    TooLarge {
        key: &'static str,
        value: u64,
        max: u64,
    },
    #[error("Limit `max_mr_bytes` = {single} exceeds `max_total_mr_bytes` = {total}")]
    SingleAboveTotal { single: u64, total: u64 },
}

/// Resource limits of one tenant's device. Field names are the keys of the
/// `[limits]` table of a vdev config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Protection domains.
    pub max_pd: u32,
    /// Queue pairs.
    pub max_qp: u32,
    /// Completion queues.
    pub max_cq: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Entries of one CQ.
    pub max_cq_depth: u32,
    /// Work requests of one send or receive queue.
    pub max_qp_depth: u32,
    /// Scatter/gather elements of one work request.
    pub max_sge: u32,
    /// Inline bytes of one send work request.
    pub max_inline_data: u32,
    /// Outstanding RDMA READ/atomic operations per QP.
    pub max_rd_atomic: u32,
    /// Bytes of the largest single memory region.
    pub max_mr_bytes: u64,
    /// Bytes of all memory regions together (pinned memory).
    pub max_total_mr_bytes: u64,
    /// Shared receive queues; 0 means none (a policy may forbid them).
    pub max_srq: u32,
    /// Address handles (UD destinations); 0 means none.
    pub max_ah: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_pd: 64,
            max_qp: 256,
            max_cq: 256,
            max_mr: 1024,
            // What the programs people run ask for: UCX and perftest's UD
            // tests CQs of 8 Ki entries and more, MPI libraries queues of
            // thousands of WRs, and applications sharing one CQ among
            // many QPs CQs of hundreds of thousands. A CQ of 1 Mi entries
            // is 32 MiB of the tenant's own memory.
            max_cq_depth: 1 << 20,
            max_qp_depth: 8192,
            max_sge: 16,
            max_inline_data: 256,
            max_rd_atomic: 16,
            max_mr_bytes: 1 << 32,
            max_total_mr_bytes: 1 << 34,
            max_srq: 256,
            max_ah: 65536,
        }
    }
}

/// Hard ceilings no configuration may exceed: what the device format carries
/// ([`vrdma_spec::limits`]: ring depths, SGEs and inline bytes per WQE, QPs
/// per doorbell page), and object numbers below the 24-bit QPN space.
pub const CEILING: Limits = Limits {
    max_pd: 1 << 20,
    max_qp: spec::MAX_QPS,
    max_cq: 1 << 20,
    max_mr: 1 << 20,
    max_cq_depth: spec::MAX_CQ_DEPTH,
    max_qp_depth: spec::MAX_RING_DEPTH,
    max_sge: spec::MAX_SGE,
    max_inline_data: spec::MAX_INLINE_DATA,
    max_rd_atomic: 128,
    max_mr_bytes: 1 << 46,
    max_total_mr_bytes: 1 << 46,
    max_srq: 1 << 20,
    max_ah: 1 << 24,
};

impl Limits {
    /// Checks every limit is at least 1 (`max_srq` and `max_ah` may be 0), within
    /// [`CEILING`], and that the largest MR fits in the total.
    pub fn validate(&self) -> Result<(), LimitsError> {
        for (key, value, max) in self.entries() {
            if value == 0 && key != "max_srq" && key != "max_ah" {
                return Err(LimitsError::Zero { key });
            }
            if value > max {
                return Err(LimitsError::TooLarge { key, value, max });
            }
        }
        if self.max_mr_bytes > self.max_total_mr_bytes {
            return Err(LimitsError::SingleAboveTotal {
                single: self.max_mr_bytes,
                total: self.max_total_mr_bytes,
            });
        }
        Ok(())
    }

    /// The stricter of `self` and `other`, limit by limit.
    pub fn stricter(&self, other: &Limits) -> Limits {
        Limits {
            max_pd: self.max_pd.min(other.max_pd),
            max_qp: self.max_qp.min(other.max_qp),
            max_cq: self.max_cq.min(other.max_cq),
            max_mr: self.max_mr.min(other.max_mr),
            max_srq: self.max_srq.min(other.max_srq),
            max_ah: self.max_ah.min(other.max_ah),
            max_cq_depth: self.max_cq_depth.min(other.max_cq_depth),
            max_qp_depth: self.max_qp_depth.min(other.max_qp_depth),
            max_sge: self.max_sge.min(other.max_sge),
            max_inline_data: self.max_inline_data.min(other.max_inline_data),
            max_rd_atomic: self.max_rd_atomic.min(other.max_rd_atomic),
            max_mr_bytes: self.max_mr_bytes.min(other.max_mr_bytes),
            max_total_mr_bytes: self.max_total_mr_bytes.min(other.max_total_mr_bytes),
        }
    }

    /// `(key, value, ceiling)` of every limit; a limit's key is its field's
    /// name, which is also its key in a configuration file.
    fn entries(&self) -> [(&'static str, u64, u64); 13] {
        macro_rules! entries {
            ($($field:ident),*) => {
                [$((stringify!($field), u64::from(self.$field), u64::from(CEILING.$field))),*]
            };
        }
        entries! {
            max_pd, max_qp, max_cq, max_mr, max_cq_depth, max_qp_depth, max_sge, max_inline_data,
            max_rd_atomic, max_mr_bytes, max_total_mr_bytes, max_srq, max_ah
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        Limits::default().validate().expect("valid defaults");
        CEILING.validate().expect("ceiling is itself valid");
    }

    #[test]
    fn partial_tables_keep_defaults() {
        let limits: Limits = toml::from_str("max_qp = 8\nmax_mr_bytes = 4096").expect("parses");
        assert_eq!(limits.max_qp, 8);
        assert_eq!(limits.max_mr_bytes, 4096);
        assert_eq!(limits.max_cq, Limits::default().max_cq);
    }

    #[test]
    fn srqs_default_to_256_and_may_be_zero() {
        assert_eq!(Limits::default().max_srq, 256);
        let limits: Limits = toml::from_str("max_srq = 0").expect("parses");
        limits.validate().expect("0 SRQs is valid");
        let some: Limits = toml::from_str("max_srq = 16").expect("parses");
        assert_eq!(some.max_srq, 16);
        some.validate().expect("valid");
        let huge = Limits {
            max_srq: (1 << 20) + 1,
            ..Limits::default()
        };
        assert_eq!(
            huge.validate(),
            Err(LimitsError::TooLarge {
                key: "max_srq",
                value: (1 << 20) + 1,
                max: 1 << 20
            })
        );
    }

    #[test]
    fn bad_limits_name_their_key() {
        let zero = Limits {
            max_cq: 0,
            ..Limits::default()
        };
        assert_eq!(zero.validate(), Err(LimitsError::Zero { key: "max_cq" }));
        let huge = Limits {
            max_sge: 65,
            ..Limits::default()
        };
        assert!(huge.validate().unwrap_err().to_string().contains("max_sge"));
        let inverted = Limits {
            max_mr_bytes: 10,
            max_total_mr_bytes: 5,
            ..Limits::default()
        };
        assert!(matches!(
            inverted.validate(),
            Err(LimitsError::SingleAboveTotal { .. })
        ));
        assert!(
            toml::from_str::<Limits>("max_qps = 1").is_err(),
            "unknown key refused"
        );
        assert!(
            toml::from_str::<Limits>("max_qp = -1").is_err(),
            "negative refused"
        );
    }

    #[test]
    fn stricter_takes_each_smaller_limit() {
        let a = Limits {
            max_qp: 4,
            max_mr_bytes: 1 << 30,
            ..Limits::default()
        };
        let b = Limits {
            max_qp: 8,
            max_mr_bytes: 1 << 20,
            max_pd: 2,
            ..Limits::default()
        };
        let s = a.stricter(&b);
        assert_eq!((s.max_qp, s.max_mr_bytes, s.max_pd), (4, 1 << 20, 2));
        assert_eq!(s, b.stricter(&a), "symmetric");
        assert_eq!(a.stricter(&a), a);
    }
}
