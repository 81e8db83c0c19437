//! The engine end to end in one process: two devices whose "drivers" write
//! their rings as the spec says, and every RC rule of `rc.rs`.

use std::time::Duration;

use vrdma_spec::ring::{event_kind, send_flags, wc_flags, Cqe, SendWqe, CQ_ARM_NEXT};
use vrdma_spec::verbs::{QpState, SendOpcode, WcOpcode, WcStatus};
use vrdma_tenant_policy::PriorityClass;

use super::testing::{connection, gid, remote, send, sge, tenant, Env, CAPS, IOVA};
use super::SEGMENT;

fn status(c: &Cqe) -> WcStatus {
    WcStatus::try_from(c.status).expect("valid status")
}

fn ids(cs: &[Cqe]) -> Vec<(u64, WcStatus)> {
    cs.iter().map(|c| (c.wr_id.get(), status(c))).collect()
}

/// A's WRITE of `len` bytes at A's offset 0 to B's offset `at`.
fn write(env: &mut Env, wr_id: u64, len: u32, at: u64, rkey: u32) {
    let wqe = remote(send(wr_id, SendOpcode::RdmaWrite), IOVA + at, rkey);
    let lkey = env.a.lkey;
    env.a.post_sges(0, &wqe, &[sge(IOVA, len, lkey)]);
}

#[test]
fn rdma_write_moves_bytes_and_frees_the_slot_at_completion() {
    let mut env = Env::new();
    env.a.fill(0, b"hello, tenant b");
    let rkey = env.b.rkey;
    write(&mut env, 1, 15, 0x40, rkey);
    // Unsignaled: no CQE, but the slot is free once the write ran.
    let mut quiet = remote(send(2, SendOpcode::RdmaWrite), IOVA + 0x80, rkey);
    quiet.flags = 0;
    let lkey = env.a.lkey;
    env.a.post_sges(0, &quiet, &[sge(IOVA, 5, lkey)]);
    assert_eq!(env.a.sq_done(0), 0, "nothing ran yet");
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    assert_eq!(a[0].opcode, u8::from(WcOpcode::RdmaWrite));
    assert_eq!(a[0].qp_num.get(), 100);
    assert!(b.is_empty(), "a WRITE completes nothing at the responder");
    assert_eq!(env.b.bytes(0x40, 15), b"hello, tenant b");
    assert_eq!(env.b.bytes(0x80, 5), b"hello");
    assert_eq!(env.a.sq_done(0), 2);
}

#[test]
fn send_gathers_and_scatters_with_receive_fields() {
    let mut env = Env::new();
    env.a.fill(0, b"abc");
    env.a.fill(100, b"defgh");
    let lkey_b = env.b.lkey;
    env.b.post_recv(
        0,
        77,
        &[sge(IOVA + 10, 4, lkey_b), sge(IOVA + 50, 100, lkey_b)],
    );
    let mut wqe = send(5, SendOpcode::SendWithImm);
    wqe.imm_data = [1, 2, 3, 4];
    wqe.flags |= send_flags::SOLICITED;
    wqe.num_sge = 2;
    let lkey = env.a.lkey;
    env.a
        .post_sges(0, &wqe, &[sge(IOVA, 3, lkey), sge(IOVA + 100, 5, lkey)]);
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(5, WcStatus::Success)]);
    assert_eq!(ids(&b), vec![(77, WcStatus::Success)]);
    let r = &b[0];
    assert_eq!(r.opcode, u8::from(WcOpcode::Recv));
    assert_eq!(r.byte_len.get(), 8);
    assert_eq!(r.imm_data, [1, 2, 3, 4]);
    assert_eq!(r.wc_flags, wc_flags::WITH_IMM);
    assert_eq!((r.qp_num.get(), r.src_qp.get()), (200, 100));
    assert_eq!(env.b.bytes(10, 4), b"abcd");
    assert_eq!(env.b.bytes(50, 4), b"efgh");
}

#[test]
fn inline_send_and_write_with_imm() {
    let mut env = Env::new();
    let lkey_b = env.b.lkey;
    env.b.post_recv(0, 1, &[sge(IOVA, 64, lkey_b)]);
    env.b.post_recv(0, 2, &[sge(IOVA, 64, lkey_b)]);
    let mut wqe = send(10, SendOpcode::Send);
    wqe.flags |= send_flags::INLINE;
    wqe.inline_len = 6.into();
    env.a.post_send(0, &wqe, b"inline");
    env.a.fill(0x200, b"written");
    let rkey = env.b.rkey;
    let mut imm = remote(send(11, SendOpcode::RdmaWriteWithImm), IOVA + 0x300, rkey);
    imm.imm_data = [9, 9, 9, 9];
    imm.num_sge = 1;
    let lkey = env.a.lkey;
    env.a.post_sges(0, &imm, &[sge(IOVA + 0x200, 7, lkey)]);
    let (a, b) = env.run();
    assert_eq!(
        ids(&a),
        vec![(10, WcStatus::Success), (11, WcStatus::Success)]
    );
    assert_eq!(
        ids(&b),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(env.b.bytes(0, 6), b"inline");
    assert_eq!(env.b.bytes(0x300, 7), b"written");
    assert_eq!(b[1].opcode, u8::from(WcOpcode::RecvRdmaWithImm));
    assert_eq!((b[1].imm_data, b[1].byte_len.get()), ([9; 4], 7));
}

#[test]
fn rdma_read_and_atomics() {
    let mut env = Env::new();
    env.b.fill(0x400, b"remote bytes");
    env.b.fill(0x800, &41u64.to_le_bytes());
    let (lkey, rkey) = (env.a.lkey, env.b.rkey);
    let mut read = remote(send(1, SendOpcode::RdmaRead), IOVA + 0x400, rkey);
    read.num_sge = 1;
    env.a.post_sges(0, &read, &[sge(IOVA + 0x10, 12, lkey)]);
    let mut faa = remote(send(2, SendOpcode::AtomicFetchAndAdd), IOVA + 0x800, rkey);
    faa.compare_add = 1.into();
    faa.num_sge = 1;
    env.a.post_sges(0, &faa, &[sge(IOVA + 0x20, 8, lkey)]);
    let mut cas = remote(send(3, SendOpcode::AtomicCmpAndSwp), IOVA + 0x800, rkey);
    cas.compare_add = 42.into();
    cas.swap = 1000.into();
    cas.num_sge = 1;
    env.a.post_sges(0, &cas, &[sge(IOVA + 0x28, 8, lkey)]);
    let (a, _) = env.run();
    assert_eq!(
        ids(&a),
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success)
        ]
    );
    assert_eq!(a[0].byte_len.get(), 12);
    assert_eq!(env.a.bytes(0x10, 12), b"remote bytes");
    assert_eq!(
        env.a.bytes(0x20, 8),
        41u64.to_le_bytes(),
        "FAA returns the old value"
    );
    assert_eq!(env.a.bytes(0x28, 8), 42u64.to_le_bytes(), "CAS too");
    assert_eq!(env.b.bytes(0x800, 8), 1000u64.to_le_bytes());
}

#[test]
fn misaligned_atomics_and_wrong_local_lengths_fail() {
    let mut env = Env::new();
    let (lkey, rkey) = (env.a.lkey, env.b.rkey);
    let mut faa = remote(send(1, SendOpcode::AtomicFetchAndAdd), IOVA + 0x804, rkey);
    faa.num_sge = 1;
    env.a.post_sges(0, &faa, &[sge(IOVA, 8, lkey)]);
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::RemInvReqErr)]);
    // A fresh pair: a 4-byte local buffer is the WQE's own fault.
    let mut env = Env::new();
    let mut faa = remote(send(2, SendOpcode::AtomicFetchAndAdd), IOVA + 0x800, rkey);
    faa.num_sge = 1;
    let lkey = env.a.lkey;
    env.a.post_sges(0, &faa, &[sge(IOVA, 4, lkey)]);
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(2, WcStatus::LocLenErr)]);
}

#[test]
fn local_protection_errors() {
    for (lkey_of, addr, len, why) in [
        (0u32, IOVA, 8u32, "unknown lkey"),
        (1, IOVA - 8, 16, "before the region"),
        (
            1,
            IOVA + super::testing::DATA_LEN - 8,
            16,
            "past the region",
        ),
        (2, IOVA, 8, "an rkey is no lkey"),
    ] {
        let mut env = Env::new();
        let lkey = match lkey_of {
            0 => 0xdead_0001,
            1 => env.a.lkey,
            _ => env.a.rkey,
        };
        let rkey = env.b.rkey;
        let wqe = remote(send(1, SendOpcode::RdmaWrite), IOVA, rkey);
        env.a.post_sges(0, &wqe, &[sge(addr, len, lkey)]);
        let (a, _) = env.run();
        assert_eq!(ids(&a), vec![(1, WcStatus::LocProtErr)], "{why}");
    }
}

#[test]
fn remote_access_errors_leave_the_responder_working() {
    let env = Env::new();
    env.b.fill(0, b"victim");
    let bad_rkeys = [env.b.lkey, env.a.rkey, 0x0bad_c0de];
    for (i, rkey) in bad_rkeys.into_iter().enumerate() {
        let mut env = Env::new();
        env.b.fill(0, b"victim");
        write(&mut env, i as u64, 6, 0, rkey);
        let (a, b) = env.run();
        assert_eq!(ids(&a), vec![(i as u64, WcStatus::RemAccessErr)]);
        assert!(b.is_empty());
        assert_eq!(env.b.bytes(0, 6), b"victim");
        assert_eq!(env.engine.query_qp(1, 100), Ok(QpState::Err));
        assert_eq!(
            env.engine.query_qp(2, 200),
            Ok(QpState::Rts),
            "the victim goes on"
        );
    }
}

#[test]
fn short_receive_fails_both_sides() {
    let mut env = Env::new();
    let lkey_b = env.b.lkey;
    env.b.post_recv(0, 9, &[sge(IOVA, 4, lkey_b)]);
    let mut wqe = send(1, SendOpcode::Send);
    wqe.num_sge = 1;
    let lkey = env.a.lkey;
    env.a.post_sges(0, &wqe, &[sge(IOVA, 8, lkey)]);
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::RemInvReqErr)]);
    assert_eq!(ids(&b), vec![(9, WcStatus::LocLenErr)]);
    assert_eq!(env.engine.query_qp(2, 200), Ok(QpState::Err));
}

#[test]
fn unsupported_opcodes_are_local_qp_errors() {
    let mut env = Env::new();
    env.a.post_send(0, &send(1, SendOpcode::BindMw), &[]);
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::LocQpOpErr)]);
}

#[test]
fn rnr_waits_for_a_receive_then_succeeds() {
    let mut env = Env::new();
    let mut wqe = send(1, SendOpcode::Send);
    wqe.flags |= send_flags::INLINE;
    wqe.inline_len = 2.into();
    env.a.post_send(0, &wqe, b"hi");
    let (a, _) = env.run();
    assert!(a.is_empty(), "waiting for a receive");
    assert_eq!(env.a.sq_done(0), 0, "its slot is still taken");
    // A posted receive cuts the RNR wait short.
    let lkey_b = env.b.lkey;
    env.b.post_recv(0, 3, &[sge(IOVA, 8, lkey_b)]);
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    assert_eq!(ids(&b), vec![(3, WcStatus::Success)]);
}

#[test]
fn rnr_retries_run_out() {
    let mut env = Env::new();
    // rnr_retry 2 on A this time.
    let mut to_b = connection(gid(20), 200);
    to_b.rnr_retry = 2;
    env.modify(1, 100, QpState::Rts, Some(to_b)).expect("rts");
    let mut wqe = send(1, SendOpcode::Send);
    wqe.flags |= send_flags::INLINE;
    env.a.post_send(0, &wqe, &[]);
    let mut all = Vec::new();
    for _ in 0..10 {
        // B's min_rnr_timer is code 1: 10 µs.
        all.extend(env.advance(Duration::from_micros(20)).0);
    }
    assert_eq!(ids(&all), vec![(1, WcStatus::RnrRetryExcErr)]);
}

#[test]
fn unreachable_responders_give_retry_exceeded_and_recover_when_back() {
    let mut env = Env::new();
    // B back to RESET: A's packets are lost.
    env.modify(2, 200, QpState::Reset, None).expect("reset");
    let rkey = env.b.rkey;
    write(&mut env, 1, 8, 0, rkey);
    let (a, _) = env.run();
    assert!(a.is_empty());
    // Two retries later B is back: the write goes through.
    let (a, _) = env.advance(super::RETRY_STEP);
    assert!(a.is_empty());
    env.connect(0, 0);
    let (a, _) = env.advance(super::RETRY_STEP);
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    // retry_cnt 3: the fourth loss fails it.
    let mut env = Env::new();
    env.engine.destroy_qp(2, 200).expect("destroy");
    write(&mut env, 2, 8, 0, rkey);
    let mut all = env.run().0;
    for _ in 0..5 {
        all.extend(env.advance(super::RETRY_STEP).0);
    }
    assert_eq!(ids(&all), vec![(2, WcStatus::RetryExcErr)]);
}

#[test]
fn revoked_keys_and_memory_are_never_touched() {
    let mut env = Env::new();
    env.b.fill(0, b"untouched");
    let rkey = env.b.rkey;
    let lkey = env.b.lkey;
    env.engine.deregister_mr(2, lkey).expect("dereg");
    env.a.fill(0, b"overwrite");
    write(&mut env, 1, 9, 0, rkey);
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::RemAccessErr)]);
    assert_eq!(env.b.bytes(0, 9), b"untouched");
    // Memory removed: its regions are revoked, its rings lost.
    let mut env = Env::new();
    env.b.fill(0, b"untouched");
    env.engine.remove_memory(2, 0).expect("remove");
    write(&mut env, 2, 9, 0, rkey);
    let (a, _) = env.run();
    assert_eq!(
        a.len(),
        0,
        "B's QP is lost, A's write is a lost packet for now"
    );
    assert_eq!(env.b.bytes(0, 9), b"untouched");
}

#[test]
fn an_error_flushes_everything_in_order_and_later_posts_too() {
    let mut env = Env::new();
    let rkey = env.b.rkey;
    write(&mut env, 1, 8, 0, 0x0bad_0001);
    write(&mut env, 2, 8, 0, rkey);
    let lkey = env.a.lkey;
    env.a.post_recv(0, 3, &[sge(IOVA, 8, lkey)]);
    let (a, _) = env.run();
    // Verbs order a QP's send completions, and its receive completions,
    // not the two against each other.
    let sends: Vec<_> = ids(&a).into_iter().filter(|c| c.0 != 3).collect();
    assert_eq!(
        sends,
        vec![(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)]
    );
    assert!(ids(&a).contains(&(3, WcStatus::WrFlushErr)));
    // Posted after the error: flushed too, and the ring says ERROR.
    write(&mut env, 4, 8, 0, rkey);
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(4, WcStatus::WrFlushErr)]);
    assert_eq!(env.a.sq_done(0), 3);
}

#[test]
fn rnr_blocks_its_own_qp_only() {
    let mut env = Env::new();
    // A second pair on the same pQPs.
    env.a.add_qp(&mut env.engine, 101, CAPS);
    env.b.add_qp(&mut env.engine, 201, CAPS);
    env.connect(1, 1);
    let mut wqe = send(1, SendOpcode::Send);
    wqe.flags |= send_flags::INLINE;
    env.a.post_send(0, &wqe, &[]);
    let rkey = env.b.rkey;
    let lkey = env.a.lkey;
    let w = remote(send(2, SendOpcode::RdmaWrite), IOVA, rkey);
    env.a.post_sges(1, &w, &[sge(IOVA, 8, lkey)]);
    let (a, _) = env.run();
    assert_eq!(
        ids(&a),
        vec![(2, WcStatus::Success)],
        "QP 101 was not held up"
    );
}

#[test]
fn a_ring_index_beyond_the_ring_is_fatal_for_that_qp_only() {
    let mut env = Env::new();
    env.a.publish_send(0, 1000);
    let (a, _) = env.run();
    assert!(a.is_empty(), "nothing sane to flush");
    assert_eq!(env.engine.query_qp(1, 100), Ok(QpState::Err));
    assert_eq!(env.a.events(), vec![(event_kind::QP_FATAL, 100)]);
    // B is fine.
    let lkey = env.b.lkey;
    env.b.post_recv(0, 1, &[sge(IOVA, 8, lkey)]);
    assert_eq!(env.engine.query_qp(2, 200), Ok(QpState::Rts));
}

#[test]
fn an_armed_cq_gets_one_event() {
    let mut env = Env::new();
    env.a.arm(1, CQ_ARM_NEXT);
    let rkey = env.b.rkey;
    write(&mut env, 1, 8, 0, rkey);
    write(&mut env, 2, 8, 0, rkey);
    let (a, _) = env.run();
    assert_eq!(a.len(), 2);
    assert_eq!(
        env.a.events(),
        vec![(event_kind::COMPLETION, super::testing::CQN)]
    );
    assert!(env.a.irq.read().expect("interrupted") >= 1);
}

#[test]
fn a_full_cq_loses_completions_and_says_so_once() {
    let mut env = Env::new();
    let rkey = env.b.rkey;
    let lkey = env.a.lkey;
    for round in 0..5u64 {
        for i in 0..60u64 {
            let wqe = remote(send(round * 100 + i, SendOpcode::RdmaWrite), IOVA, rkey);
            env.a.post_sges(0, &wqe, &[sge(IOVA, 8, lkey)]);
        }
        for _ in 0..100 {
            env.engine.round(&[1, 2], env.now);
        }
    }
    // 300 signaled WQEs into a 256-entry CQ nobody polled.
    assert_eq!(
        env.a.events(),
        vec![(event_kind::CQ_ERROR, super::testing::CQN)]
    );
    assert_eq!(env.a.poll().len(), 256);
}

#[test]
fn sixty_four_sges_and_a_kilobyte_inline_are_carried() {
    use vrdma_spec::limits::{MAX_INLINE_DATA, MAX_SGE};
    let mut env = Env::new();
    // 64 SGEs or 1 KiB inline take a 2 KiB slot (spec::limits::QpGrant).
    let caps = (MAX_SGE, MAX_INLINE_DATA, MAX_SGE);
    env.a.add_qp_shaped(&mut env.engine, 101, caps, 8, 2048);
    env.b.add_qp_shaped(&mut env.engine, 201, caps, 8, 2048);
    env.connect(1, 1);
    let (lkey, rkey) = (env.a.lkey, env.b.rkey);
    let data: Vec<u8> = (0..64u8).collect();
    env.a.fill(0, &data);
    // Byte i from SGE i, in reverse order.
    let sges: Vec<_> = (0..64).rev().map(|i| sge(IOVA + i, 1, lkey)).collect();
    let mut wqe = remote(send(1, SendOpcode::RdmaWrite), IOVA + 0x1000, rkey);
    wqe.num_sge = 64;
    env.a.post_sges(1, &wqe, &sges);
    let mut inline = remote(send(2, SendOpcode::RdmaWrite), IOVA + 0x2000, rkey);
    inline.flags |= send_flags::INLINE;
    inline.inline_len = MAX_INLINE_DATA.into();
    env.a.post_send(1, &inline, &[7u8; 1024]);
    let (a, _) = env.run();
    assert_eq!(
        ids(&a),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    let reversed: Vec<u8> = (0..64u8).rev().collect();
    assert_eq!(env.b.bytes(0x1000, 64), reversed);
    assert_eq!(env.b.bytes(0x2000, 1024), vec![7u8; 1024]);
}

fn long_op_beside_a_busy_realtime_device(op: SendOpcode, len: u32) -> (Env, Vec<u8>) {
    // A normal, B realtime and busy (it just posted work).
    let mut env = Env::with_classes(PriorityClass::Normal, PriorityClass::Realtime);
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let (lkey, rkey) = (env.a.lkey, env.b.rkey);
    match op {
        SendOpcode::RdmaRead => env.b.fill(0, &data),
        _ => env.a.fill(0, &data),
    }
    let lkey_b = env.b.lkey;
    env.b.post_recv(0, 50, &[sge(IOVA + 0x2_0000, len, lkey_b)]);
    // B reads from A: realtime work staged, so A's class is outranked.
    let mut probe = remote(send(90, SendOpcode::RdmaRead), IOVA + 0x3_0000, env.a.rkey);
    probe.num_sge = 1;
    env.b
        .post_sges(0, &probe, &[sge(IOVA + 0x3_0000, 8, lkey_b)]);
    let target = if op == SendOpcode::Send { 0 } else { IOVA };
    let mut wqe = remote(send(1, op), target, rkey);
    wqe.num_sge = 1;
    let local = if op == SendOpcode::RdmaRead {
        IOVA + 0x4_0000
    } else {
        IOVA
    };
    env.a.post_sges(0, &wqe, &[sge(local, len, lkey)]);
    (env, data)
}

/// Runs `env` to the end: A's long op (WQE 1) completed and B holds `data`.
fn assert_the_long_op_completes(env: &mut Env, data: &[u8]) {
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    assert_eq!(env.b.bytes(0, data.len()), data);
}

#[test]
fn a_long_write_moves_in_segments_while_realtime_is_busy() {
    let (mut env, data) = long_op_beside_a_busy_realtime_device(SendOpcode::RdmaWrite, 64 * 1024);
    // One round: B's realtime read runs first, A's write moves one segment.
    let round = env.engine.round(&[1, 2], env.now);
    assert!(round.preempted, "stopped between segments");
    assert_eq!(env.b.poll().len(), 1, "the realtime READ completed");
    assert_eq!(env.b.bytes(0, SEGMENT as usize), &data[..SEGMENT as usize]);
    assert_ne!(
        env.b.bytes(SEGMENT, 16),
        &data[SEGMENT as usize..SEGMENT as usize + 16]
    );
    assert_the_long_op_completes(&mut env, &data);
}

#[test]
fn a_message_moved_in_segments_is_charged_once() {
    // A's send bucket holds one 64 KiB message and barely refills. Charging
    // what is left again at every segment (as hostd once did: 64 + 48 + 32
    // + 16 KiB, so a flood beside a busy realtime tenant got 40 % of the
    // port) leaves the message waiting for the bucket after one segment.
    let (mut env, data) = long_op_beside_a_busy_realtime_device(SendOpcode::RdmaWrite, 64 * 1024);
    let mut ta = tenant("ta", PriorityClass::Normal);
    ta.rate.send.bytes_per_sec = Some(1);
    ta.rate.send.bytes_burst = Some(64 * 1024);
    let tb = tenant("tb", PriorityClass::Realtime);
    env.engine.configure_tenants(&[ta, tb], env.now);
    assert!(env.engine.round(&[1, 2], env.now).preempted);
    assert_the_long_op_completes(&mut env, &data);
}

#[test]
fn a_deregistration_between_segments_stops_the_message() {
    let (mut env, data) = long_op_beside_a_busy_realtime_device(SendOpcode::RdmaWrite, 64 * 1024);
    env.engine.round(&[1, 2], env.now);
    let lkey = env.b.lkey;
    env.engine.deregister_mr(2, lkey).expect("dereg");
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::RemAccessErr)]);
    assert_eq!(
        env.b.bytes(SEGMENT, 16),
        vec![0; 16],
        "nothing after the first segment"
    );
    let _ = data;
}

#[test]
fn a_long_send_keeps_its_receive_across_segments() {
    let (mut env, data) = long_op_beside_a_busy_realtime_device(SendOpcode::Send, 48 * 1024);
    let round = env.engine.round(&[1, 2], env.now);
    assert!(round.preempted);
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    let recv: Vec<_> = ids(&b).into_iter().filter(|c| c.0 == 50).collect();
    assert_eq!(recv, vec![(50, WcStatus::Success)]);
    assert_eq!(env.b.bytes(0x2_0000, data.len()), data);
}

#[test]
fn a_responder_reset_between_segments_starts_the_send_again() {
    let (mut env, data) = long_op_beside_a_busy_realtime_device(SendOpcode::Send, 48 * 1024);
    env.engine.round(&[1, 2], env.now);
    env.modify(2, 200, QpState::Reset, None).expect("reset");
    env.connect(0, 0);
    let lkey_b = env.b.lkey;
    env.b
        .post_recv(0, 51, &[sge(IOVA + 0x6_0000, 48 * 1024, lkey_b)]);
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    let recv: Vec<_> = ids(&b).into_iter().filter(|c| c.0 != 90).collect();
    assert_eq!(recv, vec![(51, WcStatus::Success)]);
    assert_eq!(
        env.b.bytes(0x6_0000, data.len()),
        data,
        "the whole message, from its first byte"
    );
}

#[test]
fn reset_discards_what_was_posted_and_frees_the_slots() {
    let mut env = Env::new();
    env.engine.destroy_qp(2, 200).expect("destroy");
    let rkey = env.b.rkey;
    write(&mut env, 1, 8, 0, rkey);
    env.run();
    env.modify(1, 100, QpState::Reset, None).expect("reset");
    assert_eq!(env.a.sq_done(0), 1, "the slot is the driver's again");
    let (a, _) = env.advance(Duration::from_secs(1));
    assert!(a.is_empty(), "discarded work completes nothing");
}

#[test]
fn cq_users_keep_a_cq_alive() {
    let mut env = Env::new();
    assert!(env.engine.destroy_cq(1, super::testing::CQN).is_err());
    env.engine.destroy_qp(1, 100).expect("destroy");
    env.engine
        .destroy_cq(1, super::testing::CQN)
        .expect("now unused");
}

#[test]
fn wqes_of_a_bad_send_ring_slot_fail_alone() {
    let mut env = Env::new();
    let mut garbage = [0xffu8; 256];
    garbage[..8].copy_from_slice(&5u64.to_le_bytes());
    env.a.write_send_slot(0, 0, &garbage);
    env.a.publish_send(0, 1);
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(5, WcStatus::LocQpOpErr)]);
    assert_eq!(env.engine.query_qp(1, 100), Ok(QpState::Err));
    let _ = SendWqe::default();
}

#[test]
fn the_whole_connection_is_kept_and_peers_are_found_by_gid() {
    let mut env = Env::new();
    // A's QP back to RESET, then connected with every attribute set to a
    // value of its own: what RTS carries is what the QP keeps.
    env.modify(1, 100, QpState::Reset, None).expect("reset");
    let full = vrdma_hostd_protocol::messages::QpConnection {
        flow_label: 0xabcde,
        hop_limit: 17,
        traffic_class: 0x28,
        rnr_retry: 6,
        retry_cnt: 5,
        min_rnr_timer: 9,
        timeout: 18,
        path_mtu: 1024,
        sq_psn: 0x12_3456,
        rq_psn: 0xfe_dcba,
        max_rd_atomic: 3,
        max_dest_rd_atomic: 2,
        ..connection(gid(20), 200)
    };
    env.modify(1, 100, QpState::Init, None).expect("init");
    env.modify(1, 100, QpState::Rtr, Some(full)).expect("rtr");
    env.modify(1, 100, QpState::Rts, Some(full)).expect("rts");
    let qref = env.engine.qp_of(1, 100).expect("A's QP");
    let kept = env.engine.qps.get(qref).and_then(|qp| qp.conn);
    assert_eq!(kept, Some(full));
    // The peer is B's QP, found through B's GID; it works.
    let peer = env.engine.peer_of(qref).expect("B's QP by GID");
    assert_eq!(env.engine.qps.get(peer).map(|p| p.vqpn), Some(200));
    let rkey = env.b.rkey;
    write(&mut env, 1, 8, 0, rkey);
    let (a, _) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    // A GID no device of this engine has leads nowhere.
    let elsewhere = connection(vrdma_spec::gid::ipv4_mapped([10, 0, 0, 1]), 200);
    env.modify(1, 100, QpState::Reset, None).expect("reset");
    env.modify(1, 100, QpState::Init, None).expect("init");
    env.modify(1, 100, QpState::Rtr, Some(elsewhere))
        .expect("rtr");
    assert_eq!(env.engine.peer_of(qref), None);
}

/// A's QPs 101 and 102 connected to B's QPs 301 and 302, which take their
/// receives from B's SRQ 9 (8 slots at 0x7_0000, limit `limit`).
fn srq_env(limit: u32) -> (Env, super::testing::TestSrq) {
    let mut env = Env::new();
    let srq = env.b.add_srq(&mut env.engine, 9, 0x7_0000, 8, limit);
    for (a, b) in [(101, 301), (102, 302)] {
        env.a.add_qp(&mut env.engine, a, CAPS);
        env.b.add_qp_on_srq(&mut env.engine, b, 9);
    }
    env.connect(1, 1);
    env.connect(2, 2);
    (env, srq)
}

/// A SEND of `text` (from A's data offset 0) on A's QP `qp`.
fn send_text(env: &mut Env, qp: usize, wr_id: u64, text: &[u8]) {
    env.a.fill(0x800 * wr_id, text);
    let lkey = env.a.lkey;
    let len = u32::try_from(text.len()).expect("short");
    env.a.post_sges(
        qp,
        &send(wr_id, SendOpcode::Send),
        &[sge(IOVA + 0x800 * wr_id, len, lkey)],
    );
}

#[test]
fn an_srq_feeds_every_attached_qp_in_posting_order() {
    let (mut env, mut srq) = srq_env(0);
    let lkey = env.b.lkey;
    for i in 1..=4u64 {
        env.b
            .post_srq_recv(&mut srq, i, &[sge(IOVA + 0x100 * i, 16, lkey)]);
    }
    send_text(&mut env, 1, 1, b"first");
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(1, WcStatus::Success)]);
    // One message at a time: which of two QPs the datapath serves first is
    // the scheduler's choice; the SRQ hands out receives in arrival order.
    send_text(&mut env, 2, 2, b"second");
    let (a2, b2) = env.run();
    send_text(&mut env, 1, 3, b"third");
    let (a3, b3) = env.run();
    assert_eq!(
        ids(&[a2, a3].concat()),
        vec![(2, WcStatus::Success), (3, WcStatus::Success)]
    );
    let got: Vec<_> = [b, b2, b3]
        .concat()
        .iter()
        .map(|c| (c.wr_id.get(), c.qp_num.get(), c.byte_len.get()))
        .collect();
    // Receives 1, 2, 3 in posting order, each on the QP the message came
    // to; the bytes in that receive's buffer.
    assert_eq!(got, vec![(1, 301, 5), (2, 302, 6), (3, 301, 5)]);
    assert_eq!(env.b.bytes(0x100, 5), b"first");
    assert_eq!(env.b.bytes(0x200, 6), b"second");
    assert_eq!(env.b.bytes(0x300, 5), b"third");
    // Each slot was freed when its WQE was taken; the QPs' own receive
    // rings were never used.
    assert_eq!(env.b.srq_taken(&srq), 3);
    assert_eq!((env.b.rq_done(1), env.b.rq_done(2)), (0, 0));
    // No receive left after the fourth: RNR, as for a QP's own queue.
    send_text(&mut env, 2, 4, b"4");
    send_text(&mut env, 2, 5, b"5");
    let (a, b) = env.run();
    assert_eq!(ids(&a), vec![(4, WcStatus::Success)]);
    assert_eq!(ids(&b), vec![(4, WcStatus::Success)]);
    env.b.post_srq_recv(&mut srq, 6, &[sge(IOVA, 16, lkey)]);
    let (a, b) = env.advance(Duration::from_secs(1));
    assert_eq!(ids(&a), vec![(5, WcStatus::Success)]);
    assert_eq!(ids(&b), vec![(6, WcStatus::Success)]);
}

#[test]
fn the_srq_limit_fires_once_below_the_limit_then_disarms() {
    let (mut env, mut srq) = srq_env(3);
    let lkey = env.b.lkey;
    for i in 1..=5u64 {
        env.b.post_srq_recv(&mut srq, i, &[sge(IOVA, 16, lkey)]);
    }
    // 5 posted: two takes leave 3, not below the limit.
    send_text(&mut env, 1, 1, b"a");
    send_text(&mut env, 2, 2, b"b");
    env.run();
    assert!(env.b.events().is_empty());
    assert_eq!(env.engine.query_srq(2, 9), Ok(3));
    // The third leaves 2 < 3: one event naming the SRQ, and the limit is
    // disarmed (as rxe's responder does).
    send_text(&mut env, 1, 3, b"c");
    env.run();
    assert_eq!(env.b.events(), vec![(event_kind::SRQ_LIMIT, 9)]);
    assert_eq!(env.engine.query_srq(2, 9), Ok(0));
    send_text(&mut env, 2, 4, b"d");
    env.run();
    assert!(env.b.events().is_empty(), "fires once");
    // Armed again: the next take below it fires again.
    env.engine.modify_srq(2, 9, 2).expect("arm");
    assert_eq!(
        env.engine.modify_srq(2, 9, 9).map_err(|e| e.errno()),
        Err(libc::EINVAL)
    );
    send_text(&mut env, 1, 5, b"e");
    env.run();
    assert_eq!(env.b.events(), vec![(event_kind::SRQ_LIMIT, 9)]);
    assert_eq!(env.b.srq_taken(&srq), 5);
}

#[test]
fn an_srq_qp_in_error_says_its_last_wqe_was_reached_and_keeps_the_srq_busy() {
    let (mut env, _srq) = srq_env(0);
    let busy = env.engine.destroy_srq(2, 9).map_err(|e| e.errno());
    assert_eq!(busy, Err(libc::EBUSY));
    env.modify(2, 301, QpState::Err, None).expect("to ERR");
    env.run();
    assert_eq!(env.b.events(), vec![(event_kind::QP_LAST_WQE_REACHED, 301)]);
    // The QP's own (unused) receive ring holds nothing to flush.
    assert!(env.b.poll().is_empty());
    env.engine.destroy_qp(2, 301).expect("destroy");
    env.engine.destroy_qp(2, 302).expect("destroy");
    env.engine.destroy_srq(2, 9).expect("no user left");
    let gone = env.engine.query_srq(2, 9).map_err(|e| e.errno());
    assert_eq!(gone, Err(libc::ENOENT));
}
