//! vhost-user memory-table changes (`RdmaDevice::update_memory`)
//! interleaved with MR registration and WQE translation.

use std::sync::Arc;

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap};
use vrdma_spec::control::{MrHandle, Opcode};
use vrdma_spec::ring::{RecvWqe, Sge};
use vrdma_spec::verbs::access;
use vrdma_spec::zerocopy::IntoBytes;
use vrdma_tenant_policy::Limits;
use vrdma_vdev::verbs::{DeviceIdentity, RdmaDevice};

use crate::input::Input;
use crate::wqe::{self, ModelMr, ModelQp};

/// The slots a memory table may hold: two adjacent ones (MRs may span
/// both), a separate one, and a small one far up.
const SLOTS: [(u64, usize); 4] = [
    (0x10_0000, 1 << 20),
    (0x20_0000, 1 << 20),
    (0x40_0000, 256 << 10),
    (0x80_0000, 64 << 10),
];

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

    /// The (slot, generation) pairs under `[addr, addr + len)`.
    fn under(&self, addr: u64, len: u64) -> Vec<(usize, u32)> {
        let end = addr.saturating_add(len);
        SLOTS
            .iter()
            .enumerate()
            .filter(|(_, &(gpa, size))| addr < gpa + size as u64 && end > gpa)
            .filter_map(|(i, _)| self.current[i].as_ref().map(|(_, g)| (i, *g)))
            .collect()
    }

    fn holds(&self, slot: usize, generation: u32) -> bool {
        self.current[slot]
            .as_ref()
            .is_some_and(|(_, g)| *g == generation)
    }
}

/// Runs up to 64 operations — new memory table, reg_mr, dereg_mr, a
/// receive WQE, a direct key lookup — from `data`. Invariants: an MR whose
/// memory left the table is revoked for good and nothing translates through
/// it; a live MR translates exactly its own range; every translated piece
/// is in the current guest memory; WQE checks as in [`wqe::check_translation`].
pub fn check(data: &[u8]) {
    let identity = DeviceIdentity {
        tenant: Arc::from("fuzz"),
        lid: 1,
        comp_vectors: 1,
        max_queue_size: 256,
    };
    let limits = Limits {
        max_mr: 8,
        max_mr_bytes: 4 << 20,
        max_total_mr_bytes: 16 << 20,
        ..Limits::default()
    };
    let mut dev = RdmaDevice::new(identity, limits);
    let mut slots = Slots::default();
    let mem = Arc::new(slots.apply(0b1111, 0));
    dev.update_memory(mem.clone());
    let mut mem = mem;
    let mut input = Input::new(data);
    let pds: Vec<u32> = (0..2).filter_map(|_| wqe::alloc_pd(&mut dev)).collect();
    let qps: Vec<ModelQp> = wqe::create_qps(&mut dev, &pds, &mut input);
    // Each MR with the (slot, generation) pairs under it at registration.
    let mut mrs: Vec<(ModelMr, Vec<(usize, u32)>)> = Vec::new();
    for _ in 0..64 {
        if input.is_empty() {
            break;
        }
        match input.u8() % 5 {
            0 => {
                let (mask, fresh) = (input.u8(), input.u8());
                mem = Arc::new(slots.apply(mask, fresh));
                let revoked = dev.update_memory(mem.clone());
                let mut expected = 0;
                for (mr, under) in &mut mrs {
                    if !mr.revoked && !under.iter().all(|&(s, g)| slots.holds(s, g)) {
                        mr.revoked = true;
                        expected += 1;
                    }
                }
                assert_eq!(revoked, expected, "revoked MR count");
            }
            1 => {
                let before = dev.object_counts();
                let base = SLOTS[usize::from(input.u8()) % SLOTS.len()].0;
                if let Some(mr) = wqe::reg_mr(&mut dev, &pds, base, 2 << 20, &mut input) {
                    let under = slots.under(mr.addr, mr.len);
                    let covered: u64 = under
                        .iter()
                        .map(|&(s, _)| {
                            let (gpa, size) = SLOTS[s];
                            let lo = mr.addr.max(gpa);
                            let hi = (mr.addr + mr.len).min(gpa + size as u64);
                            hi.saturating_sub(lo)
                        })
                        .sum();
                    assert_eq!(covered, mr.len, "MR registered over a hole in guest memory");
                    assert_eq!(dev.object_counts().1, before.1 + 1);
                    mrs.push((mr, under));
                }
            }
            2 => {
                if mrs.is_empty() {
                    continue;
                }
                let i = usize::from(input.u8()) % mrs.len();
                let (mr, _) = mrs.swap_remove(i);
                let req = MrHandle {
                    handle: mr.handle.into(),
                    reserved: 0.into(),
                };
                assert!(dev.execute(Opcode::DeregMr, req.as_bytes()).is_ok());
                assert!(
                    dev.translate_local(mr.pdn, mr.lkey, mr.iova, 1, 0).is_err(),
                    "deregistered MR still translates"
                );
            }
            3 => {
                let Some(&qp) = input.pick(&qps) else {
                    continue;
                };
                let model: Vec<ModelMr> = mrs.iter().map(|(m, _)| *m).collect();
                let bytes = wqe::wqe_bytes(input.bool(), &model, &mut input);
                let send = input.bool();
                let out = dev.translate_wqe_for_fuzzing(qp.qpn, send, &bytes);
                wqe::check_translation(&dev, qp, send, &bytes, &out, &model);
                // One SGE over a whole live MR of the QP's PD must pass.
                if let Some((mr, _)) = mrs.iter().find(|(m, _)| {
                    m.pdn == qp.pdn && !m.revoked && m.access & access::LOCAL_WRITE != 0
                }) {
                    let sge = Sge {
                        addr: mr.iova.into(),
                        length: (mr.len as u32).into(),
                        lkey: mr.lkey.into(),
                    };
                    let mut slot = RecvWqe {
                        wr_id: 7.into(),
                        num_sge: 1,
                        reserved: [0; 7],
                    }
                    .as_bytes()
                    .to_vec();
                    slot.extend_from_slice(sge.as_bytes());
                    let out = dev.translate_wqe_for_fuzzing(qp.qpn, false, &slot);
                    let max_sge = dev.qp(qp.qpn).map_or(0, |q| q.cap.max_recv_sge.get());
                    if max_sge >= 1 {
                        assert_eq!(
                            out.sges().as_deref(),
                            Some(&[sge][..]),
                            "valid receive WQE refused"
                        );
                    }
                }
            }
            _ => {
                let Some((mr, _)) = input.pick(&mrs) else {
                    continue;
                };
                let off = u64::from(input.u32()) % (mr.len + 8);
                let len = u64::from(input.u32()) % (mr.len + 8);
                let want = input.u32()
                    & (access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_WRITE);
                let iova = mr.iova.wrapping_add(off);
                let result = dev.translate_local(mr.pdn, mr.lkey, iova, len, want);
                let fits =
                    iova >= mr.iova && iova.checked_add(len).is_some_and(|e| e <= mr.iova + mr.len);
                let should = !mr.revoked && want & !mr.access == 0 && fits;
                match result {
                    Ok(pieces) => {
                        assert!(
                            should,
                            "translation allowed: {mr:?} [{iova:#x}, +{len}) want {want:#x}"
                        );
                        let mut total = 0;
                        for (gpa, n) in pieces {
                            let inside = usize::try_from(n).is_ok_and(|n| mem.check_range(gpa, n));
                            assert!(inside, "translated outside current guest memory");
                            assert!(gpa.0 >= mr.addr && gpa.0 + n <= mr.addr + mr.len);
                            total += n;
                        }
                        assert_eq!(total, len);
                    }
                    Err(e) => assert!(
                        !should,
                        "translation refused: {mr:?} [{iova:#x}, +{len}): {e}"
                    ),
                }
            }
        }
    }
}
