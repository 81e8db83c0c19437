//! Memory regions: `reg_mr` / `dereg_mr` and key lookup.

use vm_memory::GuestAddress;
use vrdma_hostd_protocol::messages::{MrRegistration, MrSegment};
use vrdma_spec::control::{RegMrReq, RegMrResp};
use vrdma_spec::verbs::access;

use super::{random_unique, RdmaDevice, VerbError, VerbResult};
use crate::shadow::{access_flags_consistent, ShadowRegion, TranslateError};

/// A registered memory region.
#[derive(Debug)]
pub struct MemoryRegion {
    pub pdn: u32,
    pub lkey: u32,
    pub rkey: u32,
    pub shadow: ShadowRegion,
}

/// Why a key lookup failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("No memory region has key {0:#x}")]
    UnknownKey(u32),
    #[error("Memory region of key {key:#x} belongs to PD {mr_pd}, not PD {qp_pd}")]
    OtherPd { key: u32, mr_pd: u32, qp_pd: u32 },
    #[error(transparent)]
    Translate(#[from] TranslateError),
}

impl RdmaDevice {
    pub(super) fn reg_mr(&mut self, req: &RegMrReq) -> VerbResult<RegMrResp> {
        let (pdn, flags, addr, len, iova) = (
            req.pdn.get(),
            req.access.get(),
            req.addr.get(),
            req.length.get(),
            req.iova.get(),
        );
        self.pd_mut(pdn)?;
        if flags & !access::MR_KNOWN != 0 {
            return Err(VerbError::Invalid(format!(
                "unknown access flags {:#x}",
                flags & !access::MR_KNOWN
            )));
        }
        if flags & !access::MR_SUPPORTED != 0 {
            return Err(VerbError::Unsupported(
                "memory windows, zero-based and on-demand memory regions",
            ));
        }
        if !access_flags_consistent(flags) {
            return Err(VerbError::Invalid(
                "remote write or atomic access requires local write".into(),
            ));
        }
        if len == 0 {
            return Err(VerbError::Invalid("zero-length memory region".into()));
        }
        Self::check_count("max_mr", self.mrs.len(), self.limits.max_mr)?;
        if len > self.limits.max_mr_bytes {
            return Err(VerbError::Limit {
                limit: "max_mr_bytes",
                current: len,
                max: self.limits.max_mr_bytes,
            });
        }
        let total = self.mr_bytes.saturating_add(len);
        if total > self.limits.max_total_mr_bytes {
            return Err(VerbError::Limit {
                limit: "max_total_mr_bytes",
                current: self.mr_bytes,
                max: self.limits.max_total_mr_bytes,
            });
        }
        let shadow =
            ShadowRegion::build(&self.mem, addr, len, iova, flags).map_err(VerbError::Fault)?;
        let (lkey, rkey) = self.register_keys(pdn, &shadow)?;
        let handle = self.new_handle();
        self.mrs.insert(
            handle,
            MemoryRegion {
                pdn,
                lkey,
                rkey,
                shadow,
            },
        );
        self.lkeys.insert(lkey, handle);
        self.mr_bytes = total;
        self.pd_mut(pdn)?.mrs += 1;
        Ok(RegMrResp {
            handle: handle.into(),
            lkey: lkey.into(),
            rkey: rkey.into(),
            reserved: 0.into(),
        })
    }

    /// Picks the region's keys and, on a fabric, registers the shadow with
    /// hostd under them. Keys are random so that a peer cannot guess another
    /// region's rkey; 0 is never a key, so a zeroed SGE never names a region.
    /// hostd keeps keys unique across tenants: a collision there means new
    /// keys.
    fn register_keys(&self, pdn: u32, shadow: &ShadowRegion) -> VerbResult<(u32, u32)> {
        let taken =
            |key: u32| self.lkeys.contains_key(&key) || self.mrs.values().any(|mr| mr.rkey == key);
        const ATTEMPTS: usize = 8;
        for _ in 0..ATTEMPTS {
            let lkey = random_unique(u32::MAX, &[0], taken);
            let rkey = random_unique(u32::MAX, &[0, lkey], taken);
            let Some(fabric) = &self.fabric else {
                return Ok((lkey, rkey));
            };
            let mut segments = Vec::new();
            for seg in shadow.segments() {
                let slot = self.slot_number(&seg.slot).ok_or_else(|| {
                    VerbError::Invalid(format!(
                        "guest memory at {:#x} is not known to hostd",
                        seg.gpa
                    ))
                })?;
                segments.push(MrSegment {
                    slot,
                    offset: seg.gpa - seg.slot.gpa,
                    len: seg.len,
                });
            }
            let registration = MrRegistration {
                lkey,
                rkey,
                pd: pdn,
                access: shadow.access,
                iova: shadow.iova,
                len: shadow.len,
                segments,
            };
            match fabric.register_mr(registration) {
                Ok(()) => return Ok((lkey, rkey)),
                Err(e) if e.errno() == libc::EEXIST => continue,
                Err(e) => return Err(VerbError::Fabric(e)),
            }
        }
        Err(VerbError::Limit {
            limit: "key space",
            current: ATTEMPTS as u64,
            max: ATTEMPTS as u64,
        })
    }

    pub(super) fn dereg_mr(&mut self, handle: u32) -> VerbResult<()> {
        let lkey = self
            .mrs
            .get(&handle)
            .ok_or(VerbError::NoObject { kind: "MR", handle })?
            .lkey;
        if let Some(fabric) = &self.fabric {
            // hostd answers once no work can touch the region any more.
            if let Err(e) = fabric.deregister_mr(lkey) {
                tracing::warn!(tenant = %self.tenant(), lkey, error = %e, "hostd did not deregister the MR");
            }
        }
        let mr = self
            .mrs
            .remove(&handle)
            .ok_or(VerbError::NoObject { kind: "MR", handle })?;
        self.lkeys.remove(&mr.lkey);
        self.mr_bytes -= mr.shadow.len;
        if let Some(pd) = self.pds.get_mut(&mr.pdn) {
            pd.mrs -= 1;
        }
        Ok(())
    }

    /// Resolves a local SGE of a work request posted on a QP of PD `qp_pd`:
    /// the key must name an MR of the same PD that grants `want` over the
    /// whole range.
    pub fn translate_local(
        &self,
        qp_pd: u32,
        lkey: u32,
        iova: u64,
        len: u64,
        want: u32,
    ) -> Result<Vec<(GuestAddress, u64)>, KeyError> {
        let mr = self
            .lkeys
            .get(&lkey)
            .and_then(|handle| self.mrs.get(handle))
            .ok_or(KeyError::UnknownKey(lkey))?;
        if mr.pdn != qp_pd {
            return Err(KeyError::OtherPd {
                key: lkey,
                mr_pd: mr.pdn,
                qp_pd,
            });
        }
        Ok(mr.shadow.translate(iova, len, want)?)
    }

    /// Bytes registered across all MRs.
    pub fn registered_bytes(&self) -> u64 {
        self.mr_bytes
    }
}
