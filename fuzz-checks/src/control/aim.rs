//! Aiming fuzzed payloads: handle fields at live objects, guest addresses
//! into guest memory, and `MODIFY_QP` at the QP's next state with the
//! attributes its transition needs — random bytes alone would almost never
//! name an object, fit a ring or pass the RC state table.

use vrdma_spec::control::{AhAttr, ModifyQpReq, Opcode, QpAttr, NO_SRQ};
use vrdma_spec::qp_state::{mask, rc_transition};
use vrdma_spec::verbs::{access, QpState, QpType};
use vrdma_spec::zerocopy::IntoBytes;
use vrdma_vdev::verbs::RdmaDevice;

use super::{Handles, COMP_VECTORS, MEM_BASE, MEM_SIZE, QUEUE_BASE};
use crate::input::Input;

fn put32(payload: &mut [u8], at: usize, v: u32) {
    if let Some(dst) = payload.get_mut(at..at + 4) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
}

fn put64(payload: &mut [u8], at: usize, v: u64) {
    if let Some(dst) = payload.get_mut(at..at + 8) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
}

/// A page for a ring or the doorbell: mostly in the data region, now and
/// then in the queue region (attached, hostd does not have it) or off by
/// a few bytes.
fn page(input: &mut Input<'_>) -> u64 {
    let b = input.u8();
    match b % 16 {
        0 => QUEUE_BASE + u64::from(input.u8() % 16) * 4096,
        1 => MEM_BASE + u64::from(input.u16()) % MEM_SIZE as u64,
        _ => MEM_BASE + u64::from(input.u8()) * 4096,
    }
}

/// A ring depth: mostly a small power of two.
fn depth(input: &mut Input<'_>) -> u32 {
    let b = input.u8();
    match b % 16 {
        14 => 0,
        15 => 3,
        _ => 1 << (b % 9),
    }
}

/// MR access flags vrdma supports, mostly consistent (remote write or
/// atomic with local write).
fn mr_access(input: &mut Input<'_>) -> u32 {
    let flags = input.u32() & access::MR_SUPPORTED;
    let remote = access::REMOTE_WRITE | access::REMOTE_ATOMIC;
    if flags & remote != 0 && !input.u8().is_multiple_of(8) {
        flags | access::LOCAL_WRITE
    } else {
        flags
    }
}

/// Points `payload` as `mode` says (see the module documentation).
pub(super) fn aim(
    payload: &mut [u8],
    opcode: Opcode,
    mode: u8,
    handles: &Handles,
    dev: &RdmaDevice,
    input: &mut Input<'_>,
) {
    let pool: &[u32] = match opcode {
        Opcode::DeallocPd | Opcode::RegMr | Opcode::RegMrSg | Opcode::CreateQp => &handles.pds,
        Opcode::DeregMr => &handles.mrs,
        Opcode::DestroyCq => &handles.cqs,
        Opcode::ModifyQp | Opcode::QueryQp | Opcode::DestroyQp => &handles.qps,
        _ => &[],
    };
    if mode & 0x03 != 0 {
        if let Some(&h) = input.pick(pool) {
            put32(payload, 0, h);
        }
    }
    if mode & 0x06 == 0 {
        return;
    }
    match opcode {
        Opcode::RegMr => {
            // pdn, access, addr, length, iova.
            let addr = MEM_BASE + u64::from(input.u32()) % MEM_SIZE as u64;
            let len = u64::from(input.u32() % (300 << 10));
            put32(payload, 4, mr_access(input));
            put64(payload, 8, addr);
            put64(payload, 16, len);
            if mode & 4 != 0 {
                put64(payload, 24, addr);
            }
        }
        Opcode::RegMrSg => {
            // pdn, access, iova, length, nsegs, reserved, list_addr: a
            // short list somewhere in guest memory, whose entries are
            // whatever bytes are there.
            let list = MEM_BASE + u64::from(input.u32()) % MEM_SIZE as u64;
            put32(payload, 4, mr_access(input));
            put64(payload, 16, u64::from(input.u32() % (300 << 10)));
            put32(payload, 24, u32::from(input.u8() % 5));
            put64(payload, 32, list);
        }
        Opcode::CreateCq => {
            // depth, comp_vector, ring_addr.
            put32(payload, 0, 1 << (input.u8() % 8));
            put32(
                payload,
                4,
                u32::from(input.u8()) % (u32::from(COMP_VECTORS) + 1),
            );
            put64(payload, 8, page(input));
        }
        Opcode::CreateQp => aim_create_qp(payload, mode, handles, input),
        Opcode::SetDoorbell => put64(payload, 0, page(input)),
        Opcode::CreateEq => {
            // vector, depth, ring_addr.
            put32(
                payload,
                0,
                u32::from(input.u8()) % (u32::from(COMP_VECTORS) + 1),
            );
            put32(payload, 4, depth(input));
            put64(payload, 8, page(input));
        }
        Opcode::ModifyQp => aim_modify(payload, handles, dev, input),
        _ => {}
    }
}

fn aim_create_qp(payload: &mut [u8], mode: u8, handles: &Handles, input: &mut Input<'_>) {
    // pdn, send_cqn, recv_cqn, srqn, qp_type, sq_sig_all, reserved, cap
    // (max_send_wr, max_recv_wr, max_send_sge, max_recv_sge,
    // max_inline_data), reserved2, sq_ring_addr, rq_ring_addr.
    if let Some(&c) = input.pick(&handles.cqs) {
        put32(payload, 4, c);
        put32(payload, 8, c);
    }
    put32(payload, 12, NO_SRQ);
    if mode & 0x0c != 0 {
        payload[16] = QpType::Rc.into();
        for (i, max) in [(0, 128), (1, 128), (2, 8), (3, 8), (4, 300)] {
            put32(payload, 24 + 4 * i, input.u32() % max);
        }
    }
    let (sq, rq) = (page(input), page(input));
    put64(payload, 48, sq);
    put64(payload, 56, rq);
}

/// A transition of one of the device's QPs: mostly its next state on the
/// way to RTS with the attributes the RC state table requires (and some
/// it allows), valid for this device; else RESET, ERR or any state; and
/// now and then one byte damaged.
fn aim_modify(payload: &mut [u8], handles: &Handles, dev: &RdmaDevice, input: &mut Input<'_>) {
    let Some(&qpn) = input.pick(&handles.qps) else {
        return;
    };
    let Some(from) = dev.qp(qpn).map(|q| q.state) else {
        return;
    };
    use QpState::*;
    let to = match input.u8() % 8 {
        0..=4 => match from {
            Reset => Init,
            Init => Rtr,
            Rtr | Rts | Sqd | Sqe => Rts,
            Err => Reset,
        },
        5 => Reset,
        6 => Err,
        _ => [Init, Rtr, Rts, Sqd, Sqe][usize::from(input.u8() % 5)],
    };
    let rule = rc_transition(from, to);
    let (required, optional) = rule.map_or((0, 0), |r| (r.required, r.optional));
    let attr_mask = mask::STATE | required | (input.u32() & optional & !mask::ALT_PATH);
    // The device's own GID: a connection hostd (when attached) accepts.
    let dgid = dev.config().gid;
    let dest_qpn = *input.pick(&handles.qps).unwrap_or(&qpn);
    let ah_attr = AhAttr {
        dgid,
        is_global: 1,
        hop_limit: 64,
        port_num: 1,
        ..AhAttr::default()
    };
    let attr = QpAttr {
        qp_state: to.into(),
        cur_qp_state: from.into(),
        path_mtu: 1 + input.u8() % 5,
        qkey: 0.into(),
        rq_psn: u32::from(input.u16()).into(),
        sq_psn: u32::from(input.u16()).into(),
        dest_qp_num: dest_qpn.into(),
        qp_access_flags: (input.u32() & access::QP_SUPPORTED).into(),
        ah_attr,
        max_rd_atomic: input.u8() % 17,
        max_dest_rd_atomic: input.u8() % 17,
        min_rnr_timer: input.u8() % 32,
        port_num: 1,
        timeout: input.u8() % 32,
        retry_cnt: input.u8() % 8,
        rnr_retry: input.u8() % 8,
        ..QpAttr::default()
    };
    let req = ModifyQpReq {
        qpn: qpn.into(),
        attr_mask: attr_mask.into(),
        attr,
    };
    payload.copy_from_slice(req.as_bytes());
    if input.u8().is_multiple_of(8) {
        let at = usize::from(input.u8()) % payload.len();
        payload[at] = input.u8();
    }
}
