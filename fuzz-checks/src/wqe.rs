//! Send/receive WQE translation (`translate_send`, `translate_recv`,
//! `checked_sges` through `RdmaDevice::translate_wqe_for_fuzzing`) against
//! random MR tables of two protection domains.

use vrdma_hostd_protocol::entries::{kind, PhysWqe, MAX_PHYS_SGE};
use vrdma_spec::control::{CqHandle, CreateCqReq, Opcode, PdHandle};
use vrdma_spec::control::{CreateQpReq, CreateQpResp, QpCap, RegMrReq, RegMrResp, NO_SRQ};
use vrdma_spec::ring::{send_flags, RecvWqe, SendWqe, Sge, SGE_SIZE};
use vrdma_spec::verbs::{access, SendOpcode};
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};
use vrdma_vdev::verbs::RdmaDevice;

use crate::control::{device, fuzz_limits, MEM_BASE, MEM_SIZE};
use crate::input::Input;

/// A registered MR as the test saw it registered.
#[derive(Debug, Clone, Copy)]
pub struct ModelMr {
    pub handle: u32,
    pub pdn: u32,
    pub lkey: u32,
    pub addr: u64,
    pub iova: u64,
    pub len: u64,
    pub access: u32,
    /// The VMM removed memory under it since.
    pub revoked: bool,
}

/// A created QP.
#[derive(Debug, Clone, Copy)]
pub struct ModelQp {
    pub qpn: u32,
    pub pdn: u32,
}

fn exec<T: FromBytes>(dev: &mut RdmaDevice, op: Opcode, req: &[u8]) -> Option<T> {
    dev.execute(op, req)
        .ok()
        .and_then(|b| T::read_from_bytes(&b).ok())
}

pub fn alloc_pd(dev: &mut RdmaDevice) -> Option<u32> {
    exec::<PdHandle>(dev, Opcode::AllocPd, &[]).map(|h| h.pdn.get())
}

/// Registers an MR from input bytes, aimed into `[base, base + span)`.
pub fn reg_mr(
    dev: &mut RdmaDevice,
    pds: &[u32],
    base: u64,
    span: u64,
    input: &mut Input<'_>,
) -> Option<ModelMr> {
    let pdn = *input.pick(pds)?;
    let flags = input.u32() & (access::MR_KNOWN | 0x100);
    let addr = base + u64::from(input.u32()) % span;
    let len = u64::from(input.u32() % (200 << 10)) + 1;
    let iova = if input.bool() { addr } else { input.u64() };
    let req = RegMrReq {
        pdn: pdn.into(),
        access: flags.into(),
        addr: addr.into(),
        length: len.into(),
        iova: iova.into(),
    };
    let before = dev.object_counts();
    match exec::<RegMrResp>(dev, Opcode::RegMr, req.as_bytes()) {
        Some(resp) => {
            assert_ne!(resp.lkey.get(), 0, "0 handed out as an lkey");
            Some(ModelMr {
                handle: resp.handle.get(),
                pdn,
                lkey: resp.lkey.get(),
                addr,
                iova,
                len,
                access: flags,
                revoked: false,
            })
        }
        None => {
            assert_eq!(
                before,
                dev.object_counts(),
                "refused reg_mr changed the device"
            );
            None
        }
    }
}

/// Creates a CQ and one QP per PD, with capacities from `input` (falling
/// back to fixed ones the device accepts).
pub fn create_qps(dev: &mut RdmaDevice, pds: &[u32], input: &mut Input<'_>) -> Vec<ModelQp> {
    let cq = CreateCqReq {
        depth: 16.into(),
        comp_vector: 0.into(),
        ring_addr: MEM_BASE.into(),
    };
    let Some(cqn) = exec::<CqHandle>(dev, Opcode::CreateCq, cq.as_bytes()).map(|h| h.cqn.get())
    else {
        return Vec::new();
    };
    let mut qps = Vec::new();
    for (i, &pdn) in pds.iter().enumerate() {
        let sq = MEM_BASE + 0x10000 * (2 * i as u64 + 1);
        let asked = QpCap {
            max_send_wr: 8.into(),
            max_recv_wr: 8.into(),
            max_send_sge: u32::from(input.u8() % 18).into(),
            max_recv_sge: u32::from(input.u8() % 18).into(),
            max_inline_data: u32::from(input.u16() % 600).into(),
        };
        let fixed = QpCap {
            max_send_wr: 8.into(),
            max_recv_wr: 8.into(),
            max_send_sge: 4.into(),
            max_recv_sge: 4.into(),
            max_inline_data: 64.into(),
        };
        for cap in [asked, fixed] {
            let req = CreateQpReq {
                pdn: pdn.into(),
                send_cqn: cqn.into(),
                recv_cqn: cqn.into(),
                srqn: NO_SRQ.into(),
                qp_type: 2,
                sq_sig_all: input.u8() & 1,
                cap,
                sq_ring_addr: sq.into(),
                rq_ring_addr: (sq + 0x10000).into(),
                ..CreateQpReq::default()
            };
            if let Some(resp) = exec::<CreateQpResp>(dev, Opcode::CreateQp, req.as_bytes()) {
                qps.push(ModelQp {
                    qpn: resp.qpn.get(),
                    pdn,
                });
                break;
            }
        }
    }
    qps
}

/// Builds a WQE slot from input: raw bytes, with SGEs pointed at model MRs
/// (random keys are never guessed otherwise) as the input says.
pub fn wqe_bytes(send: bool, mrs: &[ModelMr], input: &mut Input<'_>) -> Vec<u8> {
    let header = if send {
        core::mem::size_of::<SendWqe>()
    } else {
        core::mem::size_of::<RecvWqe>()
    };
    let stride = [64usize, 128, 256, 512, 24, 0][usize::from(input.u8() % 6)].max(header / 2);
    let mut bytes = input.bytes(stride).to_vec();
    bytes.resize(stride, 0);
    let aim = input.u32();
    if aim & 1 != 0 && bytes.len() >= header {
        // A plausible header: small num_sge, maybe a known opcode.
        let num_sge = input.u8() % 20;
        if send {
            bytes[8] = input.u8() % 11;
            bytes[10] = num_sge;
        } else {
            bytes[8] = num_sge;
        }
    }
    for (i, chunk) in bytes
        .get_mut(header.min(stride)..)
        .unwrap_or_default()
        .chunks_exact_mut(SGE_SIZE)
        .enumerate()
    {
        if aim & (2 << i) == 0 {
            continue;
        }
        let Some(mr) = input.pick(mrs) else { break };
        let off = match input.u8() % 4 {
            0 => 0,
            1 => mr.len.saturating_sub(u64::from(input.u8())),
            2 => u64::from(input.u32()) % (mr.len + 16),
            _ => u64::from(input.u16()),
        };
        let len = match input.u8() % 3 {
            0 => (mr.len - off.min(mr.len)) as u32,
            1 => u32::from(input.u16()),
            _ => input.u32(),
        };
        let sge = Sge {
            addr: mr.iova.wrapping_add(off).into(),
            length: len.into(),
            lkey: mr.lkey.into(),
        };
        chunk.copy_from_slice(sge.as_bytes());
    }
    bytes
}

/// Checks one translated WQE against the model. An accepted (not
/// poisoned) WQE names, for each non-empty SGE, an MR of the QP's own PD,
/// not revoked, granting the access the operation needs, over the whole
/// range; the SGEs are the guest's, unchanged; inline data is the guest's
/// bytes, within the QP's inline limit; the guest addresses the SGEs
/// translate to lie inside the MR's registered range.
pub fn check_translation(
    dev: &RdmaDevice,
    qp: ModelQp,
    send: bool,
    bytes: &[u8],
    out: &PhysWqe,
    mrs: &[ModelMr],
) {
    assert_eq!(out.vqpn.get(), qp.qpn, "WQE routed to another QP");
    assert_eq!(out.kind, if send { kind::SEND } else { kind::RECV });
    let Some(dq) = dev.qp(qp.qpn) else {
        panic!("QP {} vanished", qp.qpn)
    };
    let sges = out.sges().expect("translated WQE has a valid SGE count");
    let poisoned = sges.len() == 1 && sges[0].lkey.get() == 0 && sges[0].length.get() != 0;
    if poisoned {
        assert_eq!(
            out.flags & send_flags::INLINE,
            0,
            "poisoned WQE keeps inline data"
        );
        return;
    }
    let (header, want, max_sge, num_sge) = if send {
        let Ok((wqe, _)) = SendWqe::read_from_prefix(bytes) else {
            panic!("a truncated send WQE was accepted")
        };
        if wqe.flags & send_flags::INLINE != 0 {
            let len = out.inline_len.get() as usize;
            assert_eq!(len, wqe.inline_len.get() as usize);
            assert!(
                len <= dq.cap.max_inline_data.get() as usize,
                "inline beyond the QP's limit"
            );
            let start = core::mem::size_of::<SendWqe>();
            assert_eq!(
                &out.payload[..len],
                &bytes[start..start + len],
                "inline bytes changed"
            );
            assert_eq!(out.num_sge, 0);
            return;
        }
        let want = match SendOpcode::try_from(wqe.opcode) {
            Ok(
                SendOpcode::RdmaRead | SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd,
            ) => access::LOCAL_WRITE,
            _ => 0,
        };
        (
            core::mem::size_of::<SendWqe>(),
            want,
            dq.cap.max_send_sge.get(),
            wqe.num_sge,
        )
    } else {
        let Ok((wqe, _)) = RecvWqe::read_from_prefix(bytes) else {
            panic!("a truncated receive WQE was accepted")
        };
        (
            core::mem::size_of::<RecvWqe>(),
            access::LOCAL_WRITE,
            dq.cap.max_recv_sge.get(),
            wqe.num_sge,
        )
    };
    assert_eq!(usize::from(num_sge), sges.len(), "SGE count changed");
    assert!(
        sges.len() <= MAX_PHYS_SGE && sges.len() as u32 <= max_sge,
        "too many SGEs"
    );
    let given = &bytes[header..header + sges.len() * SGE_SIZE];
    assert_eq!(given, sges.as_bytes(), "SGEs rewritten");
    for sge in &sges {
        let len = u64::from(sge.length.get());
        if len == 0 {
            continue;
        }
        let (key, iova) = (sge.lkey.get(), sge.addr.get());
        let Some(mr) = mrs.iter().find(|m| m.lkey == key) else {
            panic!("SGE with key {key:#x} accepted: no MR of this tenant has it")
        };
        assert_eq!(mr.pdn, qp.pdn, "SGE accepted through an MR of another PD");
        assert!(!mr.revoked, "SGE accepted through a revoked MR");
        assert_eq!(
            want & !mr.access,
            0,
            "SGE accepted without the access it needs"
        );
        let end = iova.checked_add(len).expect("accepted SGE range overflows");
        assert!(
            iova >= mr.iova && end <= mr.iova + mr.len,
            "SGE [{iova:#x}, +{len}) outside MR [{:#x}, +{})",
            mr.iova,
            mr.len
        );
        let pieces = dev
            .translate_local(qp.pdn, key, iova, len, want)
            .expect("accepted SGE translates");
        let mut total = 0;
        for (gpa, n) in pieces {
            assert!(
                gpa.0 >= mr.addr && gpa.0 + n <= mr.addr + mr.len,
                "SGE translated outside its MR's guest range"
            );
            total += n;
        }
        assert_eq!(total, len, "translation does not cover the SGE");
    }
}

/// A device with two PDs, random MRs in guest memory, a QP per PD, then
/// random WQEs on random QPs, each checked by [`check_translation`].
pub fn check(data: &[u8]) {
    let (mut dev, _mem) = device("fuzz", fuzz_limits());
    let mut input = Input::new(data);
    let pds: Vec<u32> = (0..2).filter_map(|_| alloc_pd(&mut dev)).collect();
    let qps = create_qps(&mut dev, &pds, &mut input);
    let mut mrs = Vec::new();
    for _ in 0..input.u8() % 8 {
        // Mostly inside guest memory, sometimes straddling its end.
        let span = MEM_SIZE as u64 + 0x1000;
        if let Some(mr) = reg_mr(&mut dev, &pds, MEM_BASE, span, &mut input) {
            mrs.push(mr);
        }
    }
    for _ in 0..64 {
        if input.is_empty() {
            break;
        }
        let Some(&qp) = input.pick(&qps) else { break };
        let send = input.bool();
        let bytes = wqe_bytes(send, &mrs, &mut input);
        let out = dev.translate_wqe_for_fuzzing(qp.qpn, send, &bytes);
        check_translation(&dev, qp, send, &bytes, &out, &mrs);
    }
}
