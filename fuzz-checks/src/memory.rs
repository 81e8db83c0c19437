//! vhost-user memory-table changes (`RdmaDevice::update_memory`)
//! interleaved with MR registration (`REG_MR`, `REG_MR_SG`),
//! deregistration and key lookups (`translate_local`) on vdev's device:
//! the shadows MRs keep of guest memory, and their revocation.

use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap};
use vrdma_spec::control::{
    MrHandle, MrSgSegment, Opcode, PdHandle, RegMrReq, RegMrResp, RegMrSgReq, MAX_MR_PIECES,
};
use vrdma_spec::verbs::access;
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};
use vrdma_tenant_policy::Limits;
use vrdma_vdev::verbs::{DeviceIdentity, RdmaDevice};

use crate::input::Input;

/// The slots a memory table may hold: two adjacent ones (MRs may span
/// both), a separate one, and a small one far up.
const SLOTS: [(u64, usize); 4] = [
    (0x10_0000, 1 << 20),
    (0x20_0000, 1 << 20),
    (0x40_0000, 256 << 10),
    (0x80_0000, 64 << 10),
];
/// Where `REG_MR_SG` segment lists go: the start of slot 2 (when the table
/// holds it; else the list itself is not in guest memory).
const LIST_GPA: u64 = SLOTS[2].0;
/// Most operations per input.
const MAX_OPS: usize = 64;

/// One slot's current mapping and its generation (a new mapping is a new
/// slot for vdev: the memory behind it is different).
#[derive(Default)]
struct Slots {
    current: [Option<(Arc<GuestRegionMmap>, u32)>; 4],
    /// Every mapping ever made, kept alive so no new mapping reuses a host
    /// address (anonymous slots are identified by it).
    all: Vec<Arc<GuestRegionMmap>>,
    next_generation: u32,
}

impl Slots {
    /// Applies `mask` (which slots to keep) and `fresh` (which to remap)
    /// and returns the new table.
    fn apply(&mut self, mask: u8, fresh: u8) -> GuestMemoryMmap {
        for (i, &(gpa, len)) in SLOTS.iter().enumerate() {
            let keep = mask & (1 << i) != 0;
            if !keep {
                self.current[i] = None;
            } else if self.current[i].is_none() || fresh & (1 << i) != 0 {
                let region =
                    GuestRegionMmap::from_range(GuestAddress(gpa), len, None).expect("mmap");
                let region = Arc::new(region);
                self.all.push(region.clone());
                self.next_generation += 1;
                self.current[i] = Some((region, self.next_generation));
            }
        }
        let regions: Vec<_> = self
            .current
            .iter()
            .flatten()
            .map(|(r, _)| r.clone())
            .collect();
        if regions.is_empty() {
            GuestMemoryMmap::new()
        } else {
            GuestMemoryMmap::from_arc_regions(regions).expect("sorted, disjoint slots")
        }
    }

    /// The (slot, generation) pairs under `[addr, addr + len)`, and
    /// whether current slots cover all of it (no hole, nothing outside).
    fn under(&self, addr: u64, len: u64) -> (Vec<(usize, u32)>, bool) {
        let Some(end) = addr.checked_add(len) else {
            return (Vec::new(), false);
        };
        let mut covered = 0;
        let mut under = Vec::new();
        for (i, &(gpa, size)) in SLOTS.iter().enumerate() {
            let slot_end = gpa + size as u64;
            if let Some((_, g)) = &self.current[i] {
                if addr < slot_end && end > gpa {
                    under.push((i, *g));
                    covered += end.min(slot_end) - addr.max(gpa);
                }
            }
        }
        (under, covered == len)
    }

    fn holds(&self, slot: usize, generation: u32) -> bool {
        self.current[slot]
            .as_ref()
            .is_some_and(|(_, g)| *g == generation)
    }

    /// How many slots `[addr, addr + len)` spans (the shadow's pieces).
    fn pieces(&self, addr: u64, len: u64) -> usize {
        self.under(addr, len).0.len()
    }
}

/// A registered MR as the check knows it.
#[derive(Debug, Clone)]
struct ModelMr {
    handle: u32,
    pdn: u32,
    lkey: u32,
    iova: u64,
    len: u64,
    access: u32,
    /// The guest ranges it concatenates.
    ranges: Vec<(u64, u64)>,
    /// The (slot, generation) pairs under it at registration.
    under: Vec<(usize, u32)>,
    /// The VMM removed memory under it since.
    revoked: bool,
}

impl ModelMr {
    /// The guest pieces `[off, off + len)` of the region translates to,
    /// adjacent pieces merged.
    fn expect_pieces(&self, off: u64, len: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut start = 0;
        for &(addr, n) in &self.ranges {
            let (lo, hi) = (off.max(start), (off + len).min(start + n));
            if lo < hi {
                out.push((addr + (lo - start), hi - lo));
            }
            start += n;
        }
        merge(out)
    }
}

/// Pieces with adjacent ones merged (the shadow splits at slot borders).
fn merge(pieces: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (addr, n) in pieces {
        match out.last_mut() {
            Some((a, m)) if *a + *m == addr => *m += n,
            _ => out.push((addr, n)),
        }
    }
    out
}

/// Small limits, so that inputs reach them.
fn limits() -> Limits {
    Limits {
        max_mr: 8,
        max_mr_bytes: 4 << 20,
        max_total_mr_bytes: 16 << 20,
        ..Limits::default()
    }
}

/// Runs up to [`MAX_OPS`] operations — new memory table, `REG_MR`,
/// `REG_MR_SG`, `DEREG_MR`, a key lookup — from `data`. Invariants: a
/// registration is accepted exactly when its arguments and quotas are
/// valid and current guest memory covers every range without a hole; an
/// MR whose memory left the table is revoked for good (the count
/// `update_memory` returns matches) and nothing translates through it; a
/// live MR translates exactly the guest pieces its ranges give, to current
/// guest memory, when its bounds and access allow (no false accept, no
/// false refusal); a deregistered MR no longer translates.
pub fn check(data: &[u8]) {
    let identity = DeviceIdentity {
        tenant: Arc::from("fuzz"),
        lid: 1,
        link_layer: Default::default(),
        gid: vrdma_spec::gid::loopback_gid(1),
        comp_vectors: 1,
        max_queue_size: 256,
        active_mtu: vrdma_spec::verbs::Mtu::Mtu4096,
    };
    let limits = limits();
    let mut dev = RdmaDevice::new(identity, limits);
    let mut slots = Slots::default();
    let mut mem = Arc::new(slots.apply(0b1111, 0));
    dev.update_memory(mem.clone());
    let mut input = Input::new(data);
    let pds: Vec<u32> = (0..2).filter_map(|_| alloc_pd(&mut dev)).collect();
    assert_eq!(pds.len(), 2, "two PDs");
    let mut mrs: Vec<ModelMr> = Vec::new();
    for _ in 0..MAX_OPS {
        if input.is_empty() {
            break;
        }
        match input.u8() % 5 {
            0 => {
                let (mask, fresh) = (input.u8(), input.u8());
                mem = Arc::new(slots.apply(mask, fresh));
                let revoked = dev.update_memory(mem.clone());
                let mut expected = 0;
                for mr in &mut mrs {
                    if !mr.revoked && !mr.under.iter().all(|&(s, g)| slots.holds(s, g)) {
                        mr.revoked = true;
                        expected += 1;
                    }
                }
                assert_eq!(revoked, expected, "revoked MR count");
            }
            op @ (1 | 2) => {
                let reg = Registration::generate(&pds, op == 2, &mut input);
                let bytes: u64 = mrs.iter().map(|m| m.len).sum();
                let valid = reg.valid(&pds, &slots, &mem, mrs.len(), bytes, &limits);
                let before = (dev.object_counts(), dev.registered_bytes());
                match reg.run(&mut dev, &mem) {
                    Some(resp) => {
                        assert!(valid, "registration accepted: {reg:?}");
                        assert_ne!(resp.lkey.get(), 0, "0 handed out as an lkey");
                        assert_eq!(dev.object_counts().1, before.0 .1 + 1);
                        assert_eq!(dev.registered_bytes(), before.1 + reg.len);
                        let under = reg
                            .ranges
                            .iter()
                            .flat_map(|&(a, n)| slots.under(a, n).0)
                            .collect();
                        mrs.push(ModelMr {
                            handle: resp.handle.get(),
                            pdn: reg.pdn,
                            lkey: resp.lkey.get(),
                            iova: reg.iova,
                            len: reg.len,
                            access: reg.access,
                            ranges: reg.ranges,
                            under,
                            revoked: false,
                        });
                    }
                    None => {
                        assert!(!valid, "registration refused: {reg:?}");
                        let after = (dev.object_counts(), dev.registered_bytes());
                        assert_eq!(before, after, "a refused registration changed the device");
                    }
                }
            }
            3 => {
                if mrs.is_empty() {
                    continue;
                }
                let i = usize::from(input.u8()) % mrs.len();
                let mr = mrs.swap_remove(i);
                let req = MrHandle {
                    handle: mr.handle.into(),
                    reserved: 0.into(),
                };
                assert!(dev.execute(Opcode::DeregMr, req.as_bytes()).is_ok());
                assert!(
                    dev.translate_local(mr.pdn, mr.lkey, mr.iova, 1, 0).is_err(),
                    "deregistered MR still translates"
                );
                let again = dev.execute(Opcode::DeregMr, req.as_bytes());
                assert!(again.is_err(), "an MR deregistered twice");
            }
            _ => {
                if let Some(mr) = input.pick(&mrs) {
                    check_lookup(&dev, &mem, mr, &pds, &mut input);
                }
            }
        }
    }
    dev.release_all();
    assert_eq!(dev.object_counts(), (0, 0, 0, 0));
    assert_eq!(dev.registered_bytes(), 0);
}

/// One key lookup through `mr`'s lkey (sometimes from the other PD).
fn check_lookup(
    dev: &RdmaDevice,
    mem: &GuestMemoryMmap,
    mr: &ModelMr,
    pds: &[u32],
    input: &mut Input<'_>,
) {
    let off = u64::from(input.u32()) % (mr.len + 8);
    let len = u64::from(input.u32()) % (mr.len + 8);
    let want = input.u32() & (access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_WRITE);
    let pd = if input.u8().is_multiple_of(8) {
        *input.pick(pds).unwrap_or(&mr.pdn)
    } else {
        mr.pdn
    };
    let iova = mr.iova.wrapping_add(off);
    let fits = iova >= mr.iova && iova.checked_add(len).is_some_and(|e| e <= mr.iova + mr.len);
    let should = !mr.revoked && want & !mr.access == 0 && fits && pd == mr.pdn;
    match dev.translate_local(pd, mr.lkey, iova, len, want) {
        Ok(pieces) => {
            assert!(
                should,
                "translation allowed: {mr:?} [{iova:#x}, +{len}) want {want:#x} pd {pd}"
            );
            let mut got = Vec::new();
            for (gpa, n) in pieces {
                let inside = usize::try_from(n).is_ok_and(|n| mem.check_range(gpa, n));
                assert!(inside, "translated outside current guest memory");
                got.push((gpa.0, n));
            }
            assert_eq!(
                merge(got),
                mr.expect_pieces(off, len),
                "translated to other guest memory than the MR's: {mr:?} [+{off}, +{len})"
            );
        }
        Err(e) => assert!(
            !should,
            "translation refused: {mr:?} [{iova:#x}, +{len}) pd {pd}: {e}"
        ),
    }
}

/// A `REG_MR` or `REG_MR_SG` from the input.
#[derive(Debug)]
struct Registration {
    pdn: u32,
    access: u32,
    iova: u64,
    len: u64,
    ranges: Vec<(u64, u64)>,
    /// `REG_MR_SG`, with its list at this address.
    list: Option<u64>,
}

impl Registration {
    fn generate(pds: &[u32], scattered: bool, input: &mut Input<'_>) -> Self {
        let pdn = match input.u8() % 16 {
            0 => input.u32(),
            b => pds[usize::from(b) % pds.len()],
        };
        let access = input.u32() & (access::MR_KNOWN | 0x100);
        let n = if scattered { input.u8() % 4 + 1 } else { 1 };
        let mut ranges: Vec<(u64, u64)> = (0..n)
            .map(|_| {
                let base = SLOTS[usize::from(input.u8()) % SLOTS.len()].0;
                let addr = base + u64::from(input.u32()) % (2 << 20);
                let len = match input.u8() % 8 {
                    0 => 0,
                    1 => input.u64(),
                    _ => u64::from(input.u32() % (200 << 10)) + 1,
                };
                (addr, len)
            })
            .collect();
        let sum = ranges
            .iter()
            .try_fold(0u64, |acc, &(_, n)| acc.checked_add(n));
        let len = match (input.u8() % 8, sum) {
            (0, _) | (_, None) => u64::from(input.u32()),
            (1, Some(s)) => s.wrapping_add(1),
            (_, Some(s)) => s,
        };
        if !scattered {
            ranges[0].1 = len;
        }
        let addr = ranges[0].0;
        let iova = match input.u8() % 4 {
            0 => input.u64(),
            1 => u64::MAX - len / 2,
            _ => addr,
        };
        let list = scattered.then(|| match input.u8() % 8 {
            0 => input.u64(),
            _ => LIST_GPA,
        });
        Registration {
            pdn,
            access,
            iova,
            len,
            ranges,
            list,
        }
    }

    /// Whether vdev must accept it, given the memory table and what is
    /// registered (`mrs` regions of `bytes`).
    fn valid(
        &self,
        pds: &[u32],
        slots: &Slots,
        mem: &GuestMemoryMmap,
        mrs: usize,
        bytes: u64,
        limits: &Limits,
    ) -> bool {
        let flags = self.access & !access::MR_SUPPORTED == 0
            && (self.access & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) == 0
                || self.access & access::LOCAL_WRITE != 0);
        let quota = (mrs as u64) < u64::from(limits.max_mr)
            && self.len <= limits.max_mr_bytes
            && bytes + self.len <= limits.max_total_mr_bytes;
        let sum = self
            .ranges
            .iter()
            .try_fold(0u64, |acc, &(_, n)| acc.checked_add(n));
        let covered = self
            .ranges
            .iter()
            .all(|&(a, n)| n > 0 && slots.under(a, n).1);
        let list = self.list.is_none_or(|at| {
            let bytes = self.ranges.len() * core::mem::size_of::<MrSgSegment>();
            mem.check_range(GuestAddress(at), bytes)
        });
        let pieces: usize = self.ranges.iter().map(|&(a, n)| slots.pieces(a, n)).sum();
        pds.contains(&self.pdn)
            && flags
            && self.len > 0
            && quota
            && sum == Some(self.len)
            && self.iova.checked_add(self.len).is_some()
            && covered
            && list
            && pieces <= MAX_MR_PIECES
    }

    /// Sends it; the response if accepted.
    fn run(&self, dev: &mut RdmaDevice, mem: &GuestMemoryMmap) -> Option<RegMrResp> {
        let out = match self.list {
            None => {
                let req = RegMrReq {
                    pdn: self.pdn.into(),
                    access: self.access.into(),
                    addr: self.ranges[0].0.into(),
                    length: self.len.into(),
                    iova: self.iova.into(),
                };
                dev.execute(Opcode::RegMr, req.as_bytes())
            }
            Some(list_addr) => {
                let list: Vec<MrSgSegment> = self
                    .ranges
                    .iter()
                    .map(|&(addr, len)| MrSgSegment {
                        addr: addr.into(),
                        len: len.into(),
                    })
                    .collect();
                // Where the list is not guest memory, nothing is written and
                // the device finds no list.
                let _ = mem.write_slice(list.as_bytes(), GuestAddress(list_addr));
                let req = RegMrSgReq {
                    pdn: self.pdn.into(),
                    access: self.access.into(),
                    iova: self.iova.into(),
                    length: self.len.into(),
                    nsegs: (list.len() as u32).into(),
                    reserved: 0.into(),
                    list_addr: list_addr.into(),
                };
                dev.execute(Opcode::RegMrSg, req.as_bytes())
            }
        };
        out.ok()
            .map(|b| RegMrResp::read_from_bytes(&b).expect("response size"))
    }
}

fn alloc_pd(dev: &mut RdmaDevice) -> Option<u32> {
    let resp = dev.execute(Opcode::AllocPd, &[]).ok()?;
    PdHandle::read_from_bytes(&resp).ok().map(|h| h.pdn.get())
}
