//! Memory regions: `reg_mr` / `dereg_mr` and key lookup.

use vm_memory::{Bytes, GuestAddress};
use vrdma_hostd_protocol::messages::{MrRegistration, MrSegment};
use vrdma_spec::control::{
    MrSgSegment, RegMrReq, RegMrResp, RegMrSgReq, MAX_MR_PIECES, MAX_MR_SEGMENTS,
};
use vrdma_spec::verbs::access;
use vrdma_spec::zerocopy::FromBytes;

use super::share::{Counted, Taken};
use super::{random_unique, RdmaDevice, VerbError, VerbResult};
use crate::fabric::FabricError;
use crate::shadow::{access_flags_consistent, ShadowError, ShadowRegion, TranslateError};

/// Bytes of one segment-list entry.
const ENTRY: usize = core::mem::size_of::<MrSgSegment>();

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
        self.check_mr_args(pdn, flags, len)?;
        let taken = self.check_mr_quota(len)?;
        let shadow =
            ShadowRegion::build(&self.mem, addr, len, iova, flags).map_err(VerbError::Fault)?;
        self.insert_mr(pdn, shadow, taken)
    }

    /// `REG_MR_SG`: the segment list is copied out of guest memory once,
    /// bounded by [`MAX_MR_SEGMENTS`], and only the copy is checked and used.
    pub(super) fn reg_mr_sg(&mut self, req: &RegMrSgReq) -> VerbResult<RegMrResp> {
        let (pdn, flags, len, iova) = (
            req.pdn.get(),
            req.access.get(),
            req.length.get(),
            req.iova.get(),
        );
        let (nsegs, list_addr) = (req.nsegs.get(), req.list_addr.get());
        self.check_mr_args(pdn, flags, len)?;
        if nsegs == 0 || nsegs > MAX_MR_SEGMENTS {
            return Err(VerbError::Invalid(format!(
                "{nsegs} segments (1 to {MAX_MR_SEGMENTS} accepted)"
            )));
        }
        let taken = self.check_mr_quota(len)?;
        let list_len = u64::from(nsegs) * ENTRY as u64;
        if list_addr.checked_add(list_len).is_none() {
            return Err(VerbError::Fault(ShadowError::Overflow {
                addr: list_addr,
                len: list_len,
            }));
        }
        let mut raw = vec![0u8; nsegs as usize * ENTRY];
        self.mem
            .read_slice(&mut raw, GuestAddress(list_addr))
            .map_err(|_| VerbError::Fault(ShadowError::Unmapped(list_addr)))?;
        let mut ranges = Vec::with_capacity(nsegs as usize);
        let mut sum = 0u64;
        for (i, entry) in raw.chunks_exact(ENTRY).enumerate() {
            let seg = MrSgSegment::read_from_bytes(entry)
                .map_err(|_| VerbError::Malformed("segment list entry".into()))?;
            let (addr, seg_len) = (seg.addr.get(), seg.len.get());
            if seg_len == 0 {
                return Err(VerbError::Invalid(format!("segment {i} is empty")));
            }
            if addr.checked_add(seg_len).is_none() {
                return Err(VerbError::Fault(ShadowError::Overflow {
                    addr,
                    len: seg_len,
                }));
            }
            sum = sum
                .checked_add(seg_len)
                .ok_or_else(|| VerbError::Invalid("segment lengths overflow".into()))?;
            ranges.push((addr, seg_len));
        }
        if sum != len {
            return Err(VerbError::Invalid(format!(
                "segments hold {sum} bytes, the region is {len}"
            )));
        }
        let shadow = ShadowRegion::build_scattered(&self.mem, &ranges, iova, flags, MAX_MR_PIECES)
            .map_err(|e| match e {
                ShadowError::TooManyPieces(_) => VerbError::Invalid(e.to_string()),
                e => VerbError::Fault(e),
            })?;
        self.insert_mr(pdn, shadow, taken)
    }

    /// The argument checks both registration commands share, in the
    /// documented order.
    fn check_mr_args(&mut self, pdn: u32, flags: u32, len: u64) -> VerbResult<()> {
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
        Ok(())
    }

    /// The tenant's MR quotas (over all the device's contexts): a region
    /// of `len` bytes, taken.
    fn check_mr_quota(&self, len: u64) -> VerbResult<Taken> {
        if len > self.limits.max_mr_bytes {
            return Err(VerbError::Limit {
                limit: "max_mr_bytes",
                current: len,
                max: self.limits.max_mr_bytes,
            });
        }
        self.share
            .take_mr(len, self.limits.max_mr, self.limits.max_total_mr_bytes)
    }

    fn insert_mr(&mut self, pdn: u32, shadow: ShadowRegion, taken: Taken) -> VerbResult<RegMrResp> {
        let (lkey, rkey) = self.register_keys(pdn, &shadow)?;
        let handle = self.new_handle();
        let shadow_len = shadow.len;
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
        self.mr_bytes += shadow_len;
        taken.keep();
        self.pd_mut(pdn)?.mrs += 1;
        Ok(RegMrResp {
            handle: handle.into(),
            lkey: lkey.into(),
            rkey: rkey.into(),
            reserved: 0.into(),
        })
    }

    /// The region's keys. On a fabric, hostd assigns them as it registers
    /// the shadow (like a NIC its memory keys: unique on the host by
    /// construction); without one they are drawn at random, so that a peer
    /// cannot guess another region's rkey. 0 is never a key, so a zeroed
    /// SGE never names a region.
    fn register_keys(&self, pdn: u32, shadow: &ShadowRegion) -> VerbResult<(u32, u32)> {
        let taken =
            |key: u32| self.lkeys.contains_key(&key) || self.mrs.values().any(|mr| mr.rkey == key);
        let Some(fabric) = &self.fabric else {
            let lkey = random_unique(u32::MAX, &[0], taken);
            let rkey = random_unique(u32::MAX, &[0, lkey], taken);
            return Ok((lkey, rkey));
        };
        let (lkey, rkey) = fabric
            .register_mr(self.mr_registration(pdn, shadow)?)
            .map_err(VerbError::Fabric)?;
        // vdev finds regions by key: keys that are 0, equal or already in
        // use would make two regions one. (Not deregistered here: the lkey
        // may name another region.)
        if lkey == 0 || rkey == 0 || lkey == rkey || taken(lkey) || taken(rkey) {
            return Err(VerbError::Fabric(FabricError::Keys { lkey, rkey }));
        }
        Ok((lkey, rkey))
    }

    /// A region of PD `pdn` over `shadow` as hostd registers it: its
    /// pieces in the memory slots hostd was given.
    pub(super) fn mr_registration(
        &self,
        pdn: u32,
        shadow: &ShadowRegion,
    ) -> VerbResult<MrRegistration> {
        let mut segments = Vec::new();
        for seg in shadow.segments() {
            let slot = self.slot_number(&seg.slot, seg.gpa)?;
            segments.push(MrSegment {
                slot,
                offset: seg.gpa - seg.slot.gpa,
                len: seg.len,
            });
        }
        Ok(MrRegistration {
            pd: pdn,
            access: shadow.access,
            iova: shadow.iova,
            len: shadow.len,
            segments,
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
        self.share.give_back(Counted::Mr, 1);
        self.share.give_back_bytes(mr.shadow.len);
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
