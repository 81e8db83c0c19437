//! A hostile guest's own rings against hostd's engine: an attacker device
//! writes whatever it likes into its send and receive rings, its doorbell
//! page, its CQ's consumer index and arm word, beside a peer it is
//! connected to and a third device it is not. Whatever it writes, the
//! third device's memory does not change, every completion hostd writes
//! has a real status, and the engine keeps serving.

use std::time::Duration;

use vrdma_hostd::engine::guest::SharedMapping;
use vrdma_hostd::engine::testing::{
    remote, send, sge, tenant, Env, Side, CQ, DATA, DATA_LEN, DEPTH, DOORBELL, IOVA, MEM, STRIDE,
};
use vrdma_hostd_protocol::shm::sealed_memfd;
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
    let untouched = SCRATCH.with(|scratch| {
        scratch.fill(&bystander);
        scratch.copy_of(&bystander)
    });
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
    let now = SCRATCH.with(|scratch| scratch.copy_of(&bystander));
    assert!(now == untouched, "the bystander's memory changed");
    assert_eq!(env.engine.query_qp(3, 300), Ok(QpState::Reset));
}

/// Private mappings for copying guest memory in and out at memcpy speed:
/// a bystander's memory is 1 MiB, and the volatile copies that hostd uses
/// for what it interprets would dominate every input (more so under the
/// fuzzer's instrumentation).
struct Scratch {
    /// [`MEM`] bytes of `i % 251 ^ 0x5a` at byte `i`: what no write of the
    /// attacker's would leave.
    pattern: SharedMapping,
    /// Where a device's memory is copied to be compared.
    view: SharedMapping,
}

thread_local! {
    /// One per thread (property tests run in parallel), made once.
    static SCRATCH: Scratch = Scratch::new();
}

impl Scratch {
    fn new() -> Self {
        let map = |name| {
            let file = sealed_memfd(name, MEM).expect("scratch memfd");
            SharedMapping::map(file, 0, MEM).expect("scratch mapping")
        };
        let (pattern, view) = (map("fuzz-pattern"), map("fuzz-view"));
        let period: Vec<u8> = (0..251u8).map(|i| i ^ 0x5a).collect();
        for (n, at) in (0..MEM as usize).step_by(period.len()).enumerate() {
            let len = period.len().min(MEM as usize - at);
            assert!(pattern.write(at, &period[..len]), "period {n}");
        }
        Scratch { pattern, view }
    }

    /// Fills `side`'s data region with the pattern.
    fn fill(&self, side: &Side) {
        let len = DATA_LEN as usize;
        assert!(self.pattern.copy_to(0, &side.mem, DATA as usize, len));
    }

    /// `side`'s memory as it is now.
    fn copy_of(&self, side: &Side) -> Vec<u8> {
        assert!(side.mem.copy_to(0, &self.view, 0, MEM as usize));
        // SAFETY: `view` maps MEM bytes that only this thread writes (its
        // memfd is this thread's alone, and `copy_to` above has returned),
        // so nothing changes them while the slice is alive; it ends with
        // this function.
        let bytes = unsafe { std::slice::from_raw_parts(self.view.as_ptr(), self.view.len()) };
        bytes.to_vec()
    }
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
                qkey: None,
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
