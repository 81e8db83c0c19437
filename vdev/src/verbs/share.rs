//! What the contexts of one device share.
//!
//! Every frontend connection is a context of the tenant's one device (an
//! application that opens the device twice, or many processes of the
//! tenant): each context has its own objects ([`super::RdmaDevice`]), but
//! the device's quotas count all of them, and a QP number names one QP of
//! the device, whichever context created it (peers address QPs by the
//! device's GID and their number). A quota is checked and taken in one
//! step under the share's lock, so contexts creating objects at the same
//! moment cannot together exceed it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

use super::qp::QPN_MASK;
use super::{VerbError, VerbResult};

/// The QP numbers a device never hands out (0 and 1 are special QPs).
const RESERVED_QPNS: [u32; 2] = [0, 1];

/// A kind of object a quota counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    Pd,
    Mr,
    Cq,
    Qp,
    Srq,
    Ah,
}

impl Counted {
    /// The quota's key in the tenant policy.
    fn limit(self) -> &'static str {
        match self {
            Counted::Pd => "max_pd",
            Counted::Mr => "max_mr",
            Counted::Cq => "max_cq",
            Counted::Qp => "max_qp",
            Counted::Srq => "max_srq",
            Counted::Ah => "max_ah",
        }
    }
}

/// The device's objects over all its contexts.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Usage {
    pub pds: u32,
    pub mrs: u32,
    pub cqs: u32,
    pub qps: u32,
    pub srqs: u32,
    pub ahs: u32,
    /// Bytes registered in MRs.
    pub mr_bytes: u64,
}

impl Usage {
    fn count(&mut self, what: Counted) -> &mut u32 {
        match what {
            Counted::Pd => &mut self.pds,
            Counted::Mr => &mut self.mrs,
            Counted::Cq => &mut self.cqs,
            Counted::Qp => &mut self.qps,
            Counted::Srq => &mut self.srqs,
            Counted::Ah => &mut self.ahs,
        }
    }
}

#[derive(Debug, Default)]
struct Shared {
    usage: Usage,
    qpns: HashSet<u32>,
}

/// The share of one device's contexts (one per vdev, cloned into every
/// context).
#[derive(Debug, Default, Clone)]
pub struct DeviceShare(Arc<Mutex<Shared>>);

impl DeviceShare {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes one `what` if fewer than `max` exist; it is given back when
    /// the [`Taken`] drops unless it is kept.
    pub fn take(&self, what: Counted, max: u32) -> VerbResult<Taken> {
        let mut shared = self.lock();
        let n = shared.usage.count(what);
        if *n >= max {
            return Err(VerbError::Limit {
                limit: what.limit(),
                current: u64::from(*n),
                max: max.into(),
            });
        }
        *n += 1;
        Ok(Taken {
            share: self.clone(),
            what,
            bytes: 0,
            kept: false,
        })
    }

    /// Takes one MR of `len` bytes, within `max_mr` regions and
    /// `max_total` bytes.
    pub fn take_mr(&self, len: u64, max_mr: u32, max_total: u64) -> VerbResult<Taken> {
        let mut taken = self.take(Counted::Mr, max_mr)?;
        let mut shared = self.lock();
        let total = shared.usage.mr_bytes.saturating_add(len);
        if total > max_total {
            return Err(VerbError::Limit {
                limit: "max_total_mr_bytes",
                current: shared.usage.mr_bytes,
                max: max_total,
            });
        }
        shared.usage.mr_bytes = total;
        taken.bytes = len;
        Ok(taken)
    }

    /// Gives back `n` of `what` (destroyed objects).
    pub fn give_back(&self, what: Counted, n: u32) {
        let mut shared = self.lock();
        let count = shared.usage.count(what);
        *count = count.saturating_sub(n);
    }

    /// Gives back an MR's `len` bytes (the region itself with
    /// [`DeviceShare::give_back`]).
    pub fn give_back_bytes(&self, len: u64) {
        let mut shared = self.lock();
        shared.usage.mr_bytes = shared.usage.mr_bytes.saturating_sub(len);
    }

    /// A random QP number no context of the device holds, now held.
    pub fn new_qpn(&self) -> u32 {
        let mut shared = self.lock();
        let qpn = super::random_unique(QPN_MASK, &RESERVED_QPNS, |n| shared.qpns.contains(&n));
        shared.qpns.insert(qpn);
        qpn
    }

    /// Counts `n` objects that exist already (taken over from a journal),
    /// whatever the quota says now: a lowered quota refuses new objects
    /// only.
    pub fn add(&self, what: Counted, n: u32) {
        let mut shared = self.lock();
        let count = shared.usage.count(what);
        *count = count.saturating_add(n);
    }

    /// Counts `len` registered bytes that exist already.
    pub fn add_bytes(&self, len: u64) {
        let mut shared = self.lock();
        shared.usage.mr_bytes = shared.usage.mr_bytes.saturating_add(len);
    }

    /// Holds QP number `qpn` (a QP taken over from a journal).
    pub fn hold_qpn(&self, qpn: u32) {
        self.lock().qpns.insert(qpn);
    }

    /// A QP number is free again.
    pub fn free_qpn(&self, qpn: u32) {
        self.lock().qpns.remove(&qpn);
    }

    /// The device's objects now.
    pub fn usage(&self) -> Usage {
        self.lock().usage.clone()
    }
}

/// An object counted against its quota; given back on drop unless kept.
#[derive(Debug)]
#[must_use = "dropping it gives the quota back"]
pub struct Taken {
    share: DeviceShare,
    what: Counted,
    bytes: u64,
    kept: bool,
}

impl Taken {
    /// The object was created: it stays counted until destroyed.
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if !self.kept {
            self.share.give_back(self.what, 1);
            self.share.give_back_bytes(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quota_counts_every_context_and_what_is_not_kept_comes_back() {
        let device = DeviceShare::default();
        let other_context = device.clone();
        device.take(Counted::Qp, 2).expect("first").keep();
        other_context.take(Counted::Qp, 2).expect("second").keep();
        let refused = device.take(Counted::Qp, 2).map(|_| ());
        assert!(
            matches!(
                refused,
                Err(VerbError::Limit {
                    limit: "max_qp",
                    current: 2,
                    max: 2
                })
            ),
            "{refused:?}"
        );
        // A creation that fails after its check gives the slot back.
        other_context.give_back(Counted::Qp, 1);
        drop(device.take(Counted::Qp, 2).expect("a slot again"));
        assert_eq!(device.usage().qps, 1);
        let mr = device.take_mr(100, 4, 150).expect("an MR");
        let refused = other_context.take_mr(60, 4, 150).map(|_| ());
        assert!(
            matches!(
                refused,
                Err(VerbError::Limit {
                    limit: "max_total_mr_bytes",
                    current: 100,
                    ..
                })
            ),
            "{refused:?}"
        );
        assert_eq!(
            (device.usage().mrs, device.usage().mr_bytes),
            (1, 100),
            "the refusal took nothing"
        );
        drop(mr);
        assert_eq!((device.usage().mrs, device.usage().mr_bytes), (0, 0));
    }

    #[test]
    fn qp_numbers_are_unique_across_contexts_and_never_special() {
        let device = DeviceShare::default();
        let other_context = device.clone();
        let mut seen = HashSet::new();
        for i in 0..2000 {
            let qpn = if i % 2 == 0 {
                device.new_qpn()
            } else {
                other_context.new_qpn()
            };
            assert!(qpn <= QPN_MASK && !RESERVED_QPNS.contains(&qpn));
            assert!(seen.insert(qpn), "QPN {qpn:#x} handed out twice");
        }
        let some = *seen.iter().next().expect("one");
        device.free_qpn(some);
        assert!(!device.0.lock().expect("lock").qpns.contains(&some));
    }
}
