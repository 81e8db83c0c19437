//! A hostile guest's own rings against hostd's engine: an attacker device
//! writes whatever it likes into its send and receive rings, its doorbell
//! page, its CQ's consumer index and arm word, beside a peer it is
//! connected to and a third device it is not. Whatever it writes, the
//! third device's memory does not change, every completion hostd writes
//! has a real status, and the engine keeps serving.

use std::time::Duration;

use vrdma_hostd::engine::testing::{
    remote, send, sge, tenant, Env, Side, CQ, DATA_LEN, DEPTH, DOORBELL, IOVA, MEM, STRIDE,
};
use vrdma_spec::ring::{send_flags, DRIVER_ARM_OFFSET, DRIVER_INDEX_OFFSET};
use vrdma_spec::verbs::{QpState, SendOpcode, WcStatus};
use vrdma_tenant_policy::PriorityClass;

use crate::input::Input;

/// Most operations one input drives.
const MAX_OPS: usize = 24;

/// Reads `data` as a sequence of the attacker's operations.
pub fn check(data: &[u8]) {
    let mut input = Input::new(data);
    let mut env = Env::new();
    let bystander = env.add_side(3, 30, &tenant("tc", PriorityClass::Normal), 300);
    let untouched = snapshot(&bystander, &pattern());
    for _ in 0..MAX_OPS {
        if input.is_empty() {
            break;
        }
        attack(&mut env, &bystander, &mut input);
        env.run();
        if input.bool() {
            env.advance(Duration::from_micros(u64::from(input.u16())));
        }
        for cqe in env.a.poll().into_iter().chain(env.b.poll()) {
            assert!(WcStatus::try_from(cqe.status).is_ok(), "{cqe:?}");
        }
    }
    let mut now = vec![0u8; MEM as usize];
    assert!(bystander.mem.read(0, &mut now));
    assert!(now == untouched, "the bystander's memory changed");
    assert_eq!(env.engine.query_qp(3, 300), Ok(QpState::Reset));
}

/// Bytes no write of the attacker's would leave: `i % 251 ^ 0x5a` at byte
/// `i`, built by copying one period (a byte at a time is slow in debug
/// builds, and this runs per input).
fn pattern() -> Vec<u8> {
    let period: Vec<u8> = (0..251u8).map(|i| i ^ 0x5a).collect();
    let mut bytes = Vec::with_capacity(MEM as usize + period.len());
    while bytes.len() < MEM as usize {
        bytes.extend_from_slice(&period);
    }
    bytes.truncate(MEM as usize);
    bytes
}

/// Fills the bystander's data region with `pattern`; returns its memory.
fn snapshot(side: &Side, pattern: &[u8]) -> Vec<u8> {
    side.fill(0, &pattern[..DATA_LEN as usize]);
    let mut all = vec![0u8; MEM as usize];
    assert!(side.mem.read(0, &mut all));
    all
}

fn key(env: &Env, bystander: &Side, input: &mut Input<'_>) -> u32 {
    let keys = [
        env.a.lkey,
        env.a.rkey,
        env.b.lkey,
        env.b.rkey,
        bystander.lkey,
        bystander.rkey,
    ];
    match input.pick(&keys) {
        Some(&k) if !input.u8().is_multiple_of(8) => k,
        _ => input.u32(),
    }
}

/// An address near the data region's edges, or anywhere.
fn addr(input: &mut Input<'_>) -> u64 {
    match input.u8() % 4 {
        0 => IOVA + u64::from(input.u16()),
        1 => IOVA + DATA_LEN - u64::from(input.u16() % 64),
        2 => IOVA - u64::from(input.u8()),
        _ => input.u64(),
    }
}

fn attack(env: &mut Env, bystander: &Side, input: &mut Input<'_>) {
    match input.u8() % 8 {
        0 | 1 => {
            // A nearly-valid WQE with chosen keys and addresses.
            let opcode = input.u8() % 12;
            let mut wqe = remote(
                send(input.u64(), SendOpcode::Send),
                addr(input),
                key(env, bystander, input),
            );
            wqe.opcode = opcode;
            wqe.flags = input.u8() & (send_flags::SIGNALED | send_flags::SOLICITED | 0xf0);
            wqe.compare_add = input.u64().into();
            wqe.swap = input.u64().into();
            let n = usize::from(input.u8() % 5);
            let sges: Vec<_> = (0..n)
                .map(|_| {
                    let len = u32::from(input.u16());
                    sge(addr(input), len, key(env, bystander, input))
                })
                .collect();
            env.a.post_sges(0, &wqe, &sges);
        }
        2 => {
            // A whole slot of garbage.
            let index = env.a.qps[0].sq_producer;
            let bytes = input.bytes(STRIDE as usize).to_vec();
            env.a.write_send_slot(0, index, &bytes);
            env.a.publish_send(0, index.wrapping_add(1));
        }
        3 => {
            // A producer index anywhere, on either ring.
            let producer = if input.bool() {
                input.u32()
            } else {
                env.a.qps[0]
                    .sq_producer
                    .wrapping_add(u32::from(input.u8()) % (2 * DEPTH))
            };
            let ring = if input.bool() {
                env.a.qps[0].sq
            } else {
                env.a.qps[0].rq
            };
            poke32(&env.a, ring + DRIVER_INDEX_OFFSET, producer);
            env.a.ring(0);
        }
        4 => {
            // Receives with chosen buffers, on the attacker's QP; and a
            // legitimate one on its peer's, for SENDs to land in.
            let n = usize::from(input.u8() % 4);
            let sges: Vec<_> = (0..n)
                .map(|_| {
                    sge(
                        addr(input),
                        u32::from(input.u16()),
                        key(env, bystander, input),
                    )
                })
                .collect();
            env.a.post_recv(0, input.u64(), &sges);
            let lkey = env.b.lkey;
            env.b.post_recv(0, 1, &[sge(IOVA, 4096, lkey)]);
        }
        5 => {
            // Garbage in its doorbell page.
            let at = (DOORBELL + u64::from(input.u16() % 4096)) & !7;
            poke64(&env.a, at, input.u64());
        }
        6 => {
            // Its CQ's consumer index and arm word.
            poke32(&env.a, CQ + DRIVER_INDEX_OFFSET, input.u32());
            poke32(&env.a, CQ + DRIVER_ARM_OFFSET, input.u32());
        }
        _ => {
            // Its driver resets, fails or reconnects its QP.
            let to = match input.u8() % 3 {
                0 => QpState::Reset,
                1 => QpState::Err,
                _ => QpState::Rts,
            };
            let state = |vqpn: u32, to: QpState| vrdma_hostd_protocol::messages::QpModify {
                vqpn,
                state: to.into(),
                connection: None,
                access: None,
            };
            if to == QpState::Rts {
                // Both ends start over, as two drivers reconnecting do.
                for (id, vqpn) in [(1, 100), (2, 200)] {
                    env.engine
                        .modify_qp(id, &state(vqpn, QpState::Reset))
                        .expect("RESET is always allowed");
                }
                env.connect(0, 0);
            } else {
                env.engine
                    .modify_qp(1, &state(100, to))
                    .expect("RESET and ERR are always allowed");
            }
        }
    }
}

fn poke32(side: &Side, at: u64, value: u32) {
    assert!(side.mem.write(at as usize, &value.to_le_bytes()));
}

fn poke64(side: &Side, at: u64, value: u64) {
    assert!(side.mem.write(at as usize, &value.to_le_bytes()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_well_formed_write_and_garbage_both_pass() {
        check(&[]);
        check(&[0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        check(&[2; 600]);
        check(&[7, 2, 7, 1, 0, 5]);
    }
}
