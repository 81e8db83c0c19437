//! RDMA between two tenants on one host: hostd and two vdevs as separate
//! processes, two process-mode tenants, every operation with its data
//! checked byte for byte on the other side, and the RC error cases.

use std::time::{Duration, Instant};

use vrdma_guest_driver::{RecvWr, SendPayload, SendWr};
use vrdma_spec::verbs::SendOpcode::{
    self, AtomicCmpAndSwp, AtomicFetchAndAdd, RdmaRead, RdmaWrite,
};
use vrdma_spec::verbs::{access, QpState, WcOpcode, WcStatus};
use vrdma_tests::daemon::{Hostd, Vdev};
use vrdma_tests::tenant::{
    assert_no_completion, blue_and_red, bring_up, connect, default_caps, fill, one, pattern, rdma,
    read_mr, signaled, statuses, wait_completions, Connection, Pair, Tenant,
};
use vrdma_tools::verbs::Opened;

const RW: u32 =
    access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

#[test]
fn rdma_write_lands_in_the_peers_memory() {
    let s = Pair::start();
    let (src, dst) = s.mrs(64 << 10);
    let data = fill(&src, 64 << 10, 1);
    let sge = [src.sge(0, data.len() as u32)];
    s.qa.post_send(&[rdma(7, SendOpcode::RdmaWrite, &sge, dst.iova(), dst.rkey())])
        .expect("post");
    let wc = one(&s.a.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (7, WcStatus::Success, Some(WcOpcode::RdmaWrite))
    );
    assert_eq!(
        read_mr(&dst, 0, data.len()),
        data,
        "bytes on the other side"
    );
    assert_no_completion(&s.b.cq, Duration::from_millis(20));
}

#[test]
fn write_with_immediate_consumes_a_receive() {
    let s = Pair::start();
    let (src, dst) = s.mrs(4096);
    let data = fill(&src, 1000, 2);
    s.recv(99, &[]);
    let sge = [src.sge(0, 1000)];
    let mut wr = rdma(
        8,
        SendOpcode::RdmaWriteWithImm,
        &sge,
        dst.iova() + 100,
        dst.rkey(),
    );
    wr.imm_data = [1, 2, 3, 4];
    s.qa.post_send(&[wr]).expect("post");
    assert_eq!(one(&s.a.cq).status, WcStatus::Success);
    let wc = one(&s.b.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (99, WcStatus::Success, Some(WcOpcode::RecvRdmaWithImm))
    );
    assert_eq!(wc.imm_data, Some([1, 2, 3, 4]));
    assert_eq!(wc.qp_num, s.qb.qp_num());
    assert_eq!(read_mr(&dst, 100, 1000), data);
}

#[test]
fn send_gathers_and_receive_scatters() {
    let s = Pair::start();
    let (src, dst) = s.mrs(8192);
    let data = pattern(3000, 3);
    src.write(0, &data[..1000]).expect("part 1");
    src.write(4000, &data[1000..2500]).expect("part 2");
    src.write(7000, &data[2500..]).expect("part 3");
    let recv_sges = [dst.sge(0, 1200), dst.sge(5000, 2000)];
    s.recv(5, &recv_sges);
    let send_sges = [src.sge(0, 1000), src.sge(4000, 1500), src.sge(7000, 500)];
    let mut wr = signaled(SendWr::new(
        6,
        SendOpcode::SendWithImm,
        SendPayload::Sges(&send_sges),
    ));
    wr.imm_data = [9, 9, 9, 9];
    s.qa.post_send(&[wr]).expect("send");
    let wc = one(&s.a.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (6, WcStatus::Success, Some(WcOpcode::Send))
    );
    let wc = one(&s.b.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (5, WcStatus::Success, Some(WcOpcode::Recv), 3000)
    );
    assert_eq!(wc.imm_data, Some([9, 9, 9, 9]));
    assert_eq!(wc.src_qp, s.qa.qp_num());
    let mut got = read_mr(&dst, 0, 1200);
    got.extend(read_mr(&dst, 5000, 1800));
    assert_eq!(got, data);
}

#[test]
fn inline_send_and_unsignaled_work() {
    let s = Pair::start();
    let dst = s.b.pd.alloc_mr(4096, RW).expect("dst");
    for i in 0..4 {
        s.recv(i, &[dst.sge(64 * i, 64)]);
    }
    let messages: Vec<Vec<u8>> = (0..4).map(|i| pattern(40, 10 + i as u8)).collect();
    // Three unsignaled sends, then a signaled one: one send completion.
    let wrs: Vec<SendWr<'_>> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let wr = SendWr::new(100 + i as u64, SendOpcode::Send, SendPayload::Inline(m));
            if i == 3 {
                signaled(wr)
            } else {
                wr
            }
        })
        .collect();
    s.qa.post_send(&wrs).expect("post");
    let wc = one(&s.a.cq);
    assert_eq!((wc.wr_id, wc.status), (103, WcStatus::Success));
    let recvs = wait_completions(&s.b.cq, 4);
    for (i, wc) in recvs.iter().enumerate() {
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len),
            (i as u64, WcStatus::Success, 40)
        );
        assert_eq!(read_mr(&dst, 64 * i, 40), messages[i]);
    }
    assert_no_completion(&s.a.cq, Duration::from_millis(20));
}

#[test]
fn rdma_read_fetches_the_peers_memory() {
    let s = Pair::start();
    let (local, remote) = s.mrs(16 << 10);
    let data = fill(&remote, 16 << 10, 4);
    let sge = [local.sge(0, 8 << 10), local.sge(8 << 10, 8 << 10)];
    let wc = s.post(rdma(11, RdmaRead, &sge, remote.iova(), remote.rkey()));
    assert_eq!(
        (wc.status, wc.opcode, wc.byte_len),
        (WcStatus::Success, Some(WcOpcode::RdmaRead), 16 << 10)
    );
    assert_eq!(read_mr(&local, 0, 16 << 10), data);
}

#[test]
fn atomics_compare_swap_and_fetch_add() {
    let s = Pair::start();
    let (local, remote) = s.mrs(4096);
    remote.write(8, &100u64.to_le_bytes()).expect("init");
    let sge = [local.sge(0, 8)];
    // (opcode, compare_add, swap): the value fetched, the value left.
    let steps = [
        (
            AtomicFetchAndAdd,
            5,
            0,
            100u64,
            105u64,
            "FAA returns the old value",
        ),
        (AtomicCmpAndSwp, 105, 7, 105, 7, "swapped"),
        (AtomicCmpAndSwp, 1, 55, 7, 7, "compare failed: unchanged"),
    ];
    for (i, (op, compare_add, swap, fetched, left, what)) in steps.into_iter().enumerate() {
        let mut wr = rdma(i as u64, op, &sge, remote.iova() + 8, remote.rkey());
        (wr.compare_add, wr.swap) = (compare_add, swap);
        assert_eq!(s.post(wr).status, WcStatus::Success, "{what}");
        assert_eq!(read_mr(&local, 0, 8), fetched.to_le_bytes(), "{what}");
        assert_eq!(read_mr(&remote, 8, 8), left.to_le_bytes(), "{what}");
    }
}

#[test]
fn misaligned_atomic_is_an_invalid_request() {
    let s = Pair::start();
    let (local, remote) = s.mrs(4096);
    let sge = [local.sge(0, 8)];
    let status = s.rdma(AtomicFetchAndAdd, &sge, remote.iova() + 4, remote.rkey());
    assert_eq!(status, WcStatus::RemInvReqErr);
}

#[test]
fn a_foreign_or_invalid_rkey_is_a_remote_access_error_and_the_victim_is_untouched() {
    let s = Pair::start();
    let (src, victim) = s.mrs(4096);
    fill(&src, 4096, 5);
    let canary = fill(&victim, 4096, 6);
    // A's own MR's rkey used against B: the key is A's, not B's.
    let own = s.a.pd.alloc_mr(4096, RW).expect("own");
    let sge = [src.sge(0, 64)];
    let status = s.rdma(RdmaWrite, &sge, own.iova(), own.rkey());
    assert_eq!(status, WcStatus::RemAccessErr);
    assert_eq!(read_mr(&victim, 0, 4096), canary);
}

#[test]
fn a_guessed_rkey_fails_and_the_qp_flushes_what_follows() {
    let s = Pair::start();
    let (src, victim) = s.mrs(4096);
    let canary = fill(&victim, 4096, 7);
    let sge = [src.sge(0, 64)];
    let (iova, rkey) = (victim.iova(), victim.rkey());
    let wrs = [
        rdma(1, RdmaWrite, &sge, iova, rkey ^ 0x5a5a),
        rdma(2, RdmaWrite, &sge, iova, rkey),
        rdma(3, RdmaWrite, &sge, iova, rkey),
    ];
    s.qa.post_send(&wrs).expect("post");
    assert_eq!(
        statuses(&s.a.cq, 3),
        vec![
            (1, WcStatus::RemAccessErr),
            (2, WcStatus::WrFlushErr),
            (3, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(
        read_mr(&victim, 0, 4096),
        canary,
        "nothing written, not even by the flushed WQEs"
    );
    let state = s.qa.query(0).expect("query").attr.qp_state;
    assert_eq!(state, u8::from(QpState::Err), "the requester QP is in ERR");
}

#[test]
fn access_flags_are_enforced_both_ways() {
    // Alpha's MR's access, beta's, the operation, a wrong lkey or not.
    let (read_only, status) = (access::REMOTE_READ, WcStatus::RemAccessErr);
    let cases = [
        (
            RW,
            read_only,
            RdmaWrite,
            0,
            status,
            "remote write into a read-only MR",
        ),
        (
            read_only,
            RW,
            RdmaRead,
            0,
            WcStatus::LocProtErr,
            "READ without LOCAL_WRITE",
        ),
        (RW, RW, RdmaWrite, 1, WcStatus::LocProtErr, "unknown lkey"),
    ];
    for (local, remote, op, lkey_xor, expected, what) in cases {
        let s = Pair::start();
        let src = s.a.pd.alloc_mr(4096, local).expect("alpha's MR");
        let dst = s.b.pd.alloc_mr(4096, remote).expect("beta's MR");
        let mut sge = [src.sge(0, 64)];
        sge[0].lkey ^= lkey_xor;
        assert_eq!(s.rdma(op, &sge, dst.iova(), dst.rkey()), expected, "{what}");
    }
}

#[test]
fn a_qp_without_remote_write_access_refuses_writes() {
    let how = Connection {
        access: access::REMOTE_READ,
        ..Connection::default()
    };
    let s = Pair::start_with(how);
    let (src, dst) = s.mrs(4096);
    let sge = [src.sge(0, 64)];
    let status = s.rdma(RdmaWrite, &sge, dst.iova(), dst.rkey());
    assert_eq!(status, WcStatus::RemAccessErr);
}

#[test]
fn a_message_longer_than_the_receive_buffer_is_a_length_error() {
    let s = Pair::start();
    let (src, dst) = s.mrs(4096);
    s.recv(1, &[dst.sge(0, 100)]);
    let sge = [src.sge(0, 200)];
    s.qa.post_send(&[signaled(SendWr::new(
        2,
        SendOpcode::Send,
        SendPayload::Sges(&sge),
    ))])
    .expect("send");
    assert_eq!(one(&s.a.cq).status, WcStatus::RemInvReqErr);
    let wc = one(&s.b.cq);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::LocLenErr));
}

#[test]
fn receiver_not_ready_retries_then_succeeds_or_fails() {
    // Infinite RNR retries: the send waits until the receive is posted.
    let s = Pair::start();
    let dst = s.b.pd.alloc_mr(4096, RW).expect("dst");
    s.qa.post_send(&[signaled(SendWr::new(
        1,
        SendOpcode::Send,
        SendPayload::Inline(b"late"),
    ))])
    .expect("send");
    assert_no_completion(&s.a.cq, Duration::from_millis(30));
    s.recv(2, &[dst.sge(0, 64)]);
    assert_eq!(one(&s.a.cq).status, WcStatus::Success);
    assert_eq!(one(&s.b.cq).byte_len, 4);
    assert_eq!(read_mr(&dst, 0, 4), b"late");

    // One retry: RNR retry exceeded, then the rest is flushed.
    let s = Pair::start_with(Connection {
        rnr_retry: 1,
        ..Connection::default()
    });
    let wrs = [
        signaled(SendWr::new(
            1,
            SendOpcode::Send,
            SendPayload::Inline(b"nobody"),
        )),
        signaled(SendWr::new(
            2,
            SendOpcode::Send,
            SendPayload::Inline(b"home"),
        )),
    ];
    s.qa.post_send(&wrs).expect("send");
    assert_eq!(
        statuses(&s.a.cq, 2),
        vec![(1, WcStatus::RnrRetryExcErr), (2, WcStatus::WrFlushErr)]
    );
}

#[test]
fn moving_a_qp_to_error_flushes_its_receives() {
    let s = Pair::start();
    let dst = s.b.pd.alloc_mr(4096, RW).expect("dst");
    for i in 0..3 {
        s.recv(i, &[dst.sge(0, 64)]);
    }
    // hostd reads the receive ring itself: what is posted is flushed at
    // ERR whether or not it has looked at the ring yet.
    let err = vrdma_spec::control::QpAttr {
        qp_state: QpState::Err.into(),
        ..Default::default()
    };
    s.qb.modify(&err, vrdma_spec::qp_state::mask::STATE)
        .expect("to ERR");
    let flushed: Vec<_> = (0..3).map(|i| (i, WcStatus::WrFlushErr)).collect();
    assert_eq!(statuses(&s.b.cq, 3), flushed);
}

#[test]
fn many_qps_share_the_physical_queues_and_keep_their_order() {
    let s = Pair::start();
    let qps_a: Vec<_> = (0..8).map(|_| s.a.qp(default_caps())).collect();
    let qps_b: Vec<_> = (0..8).map(|_| s.b.qp(default_caps())).collect();
    for (qa, qb) in qps_a.iter().zip(&qps_b) {
        connect(&s.a, qa, &s.b, qb, Connection::default());
    }
    let src = s.a.pd.alloc_mr(4096, RW).expect("src");
    let dst = s.b.pd.alloc_mr(64 << 10, RW).expect("dst");
    fill(&src, 4096, 8);
    let sge = [src.sge(0, 256)];
    for round in 0..8u64 {
        for (i, qa) in qps_a.iter().enumerate() {
            let wr_id = (i as u64) << 32 | round;
            let remote = dst.iova() + (i as u64 * 8 + round) * 256;
            qa.post_send(&[rdma(wr_id, SendOpcode::RdmaWrite, &sge, remote, dst.rkey())])
                .expect("post");
        }
    }
    let wcs = wait_completions(&s.a.cq, 64);
    let mut next = [0u64; 8];
    for wc in &wcs {
        assert_eq!(wc.status, WcStatus::Success);
        let (qp, round) = ((wc.wr_id >> 32) as usize, wc.wr_id & 0xffff_ffff);
        assert_eq!(round, next[qp], "completions of QP {qp} out of order");
        assert_eq!(wc.qp_num, qps_a[qp].qp_num());
        next[qp] += 1;
    }
    assert_eq!(read_mr(&dst, 0, 256), read_mr(&src, 0, 256));
}

/// `t`'s CQ raised its completion event within 10 s.
#[track_caller]
fn assert_completion_event(t: &Tenant) {
    let event = t.ctx.get_event(0, Some(Duration::from_secs(10)));
    let completion = vrdma_guest_driver::DeviceEvent::Completion { cqn: t.cq.cqn() };
    assert_eq!(event.expect("event"), Some(completion));
}

/// `t`'s CQ raised no completion event within 50 ms.
#[track_caller]
fn assert_no_completion_event(t: &Tenant) {
    let event = t.ctx.get_event(0, Some(Duration::from_millis(50)));
    assert_eq!(event.expect("poll"), None);
}

#[test]
fn completion_events_wake_an_armed_cq_once() {
    let s = Pair::start();
    let dst = s.b.pd.alloc_mr(4096, RW).expect("dst");
    s.b.cq.req_notify(false);
    s.recv(1, &[dst.sge(0, 64)]);
    s.send_inline(1, b"wake up");
    assert_completion_event(&s.b);
    assert_eq!(one(&s.b.cq).byte_len, 7);
    // Not re-armed: the next completion raises no event.
    s.recv(2, &[dst.sge(0, 64)]);
    s.send_inline(2, b"again");
    assert_eq!(one(&s.b.cq).wr_id, 2);
    assert_no_completion_event(&s.b);
}

#[test]
fn connecting_outside_the_tenant_network_fails_at_rtr() {
    let hostd = Hostd::start(Some(&blue_and_red()));
    let a = Tenant::start(&hostd, "alpha");
    let c = Tenant::start(&hostd, "gamma");
    let qa = a.qp(default_caps());
    let qc = c.qp(default_caps());
    let err = bring_up(&qa, qc.qp_num(), c.gid, Connection::default())
        .expect_err("alpha cannot reach gamma");
    assert_eq!(err.errno(), libc::EACCES, "{err:?}");
    assert_eq!(
        qa.query(0).expect("query").attr.qp_state,
        u8::from(QpState::Init),
        "the QP stays in INIT"
    );
    let b = Tenant::start(&hostd, "beta");
    let qb = b.qp(default_caps());
    connect(&a, &qa, &b, &qb, Connection::default());
}

#[test]
fn a_third_tenant_cannot_use_a_victims_rkey_through_its_own_connection() {
    let s = Pair::start();
    // alpha also connects to itself (a second QP pair inside alpha); with
    // beta's rkey it aims at beta's memory over a QP whose peer is alpha.
    let victim = s.b.pd.alloc_mr(4096, RW).expect("victim");
    let canary = fill(&victim, 4096, 9);
    let q1 = s.a.qp(default_caps());
    let q2 = s.a.qp(default_caps());
    connect(&s.a, &q1, &s.a, &q2, Connection::default());
    let src = s.a.pd.alloc_mr(4096, RW).expect("src");
    let sge = [src.sge(0, 64)];
    q1.post_send(&[rdma(
        1,
        SendOpcode::RdmaWrite,
        &sge,
        victim.iova(),
        victim.rkey(),
    )])
    .expect("post");
    assert_eq!(one(&s.a.cq).status, WcStatus::RemAccessErr);
    assert_eq!(read_mr(&victim, 0, 4096), canary);
}

#[test]
fn killing_one_tenants_vdev_leaves_the_others_traffic_running() {
    // A vdev that dies for good: the tests' hostd keeps no context for a
    // successor (tests/tests/vdev_restart.rs has the one that comes back).
    let mut s = Pair::start();
    // A third device (tenant alpha again) floods alpha's first device with
    // writes from another thread; its vdev is killed in the middle of it,
    // and its driver does not wait for it to come back.
    let mut c = Tenant::open_without_reconnect(Vdev::on_hostd(&s.hostd, "alpha", &[]));
    let qc = c.qp(default_caps());
    let qa2 = s.a.qp(default_caps());
    connect(&s.a, &qa2, &c, &qc, Connection::default());
    let target = s.a.pd.alloc_mr(4096, RW).expect("target");
    let flood_src = c.pd.alloc_mr(4096, RW).expect("flood source");
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let flooder = scope.spawn(|| {
            let sge = [flood_src.sge(0, 4096)];
            let mut wr = SendWr::new(0, SendOpcode::RdmaWrite, SendPayload::Sges(&sge));
            wr.remote_addr = target.iova();
            wr.rkey = target.rkey();
            let mut posted = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match qc.post_send(&[wr]) {
                    Ok(()) => posted += 1,
                    // The ring is full, or the device is gone: keep trying
                    // until told to stop; a dead device keeps failing.
                    Err(_) => std::thread::yield_now(),
                }
            }
            posted
        });
        std::thread::sleep(Duration::from_millis(50));
        c.vdev.kill();
        let src = s.a.pd.alloc_mr(4096, RW).expect("src");
        let dst = s.b.pd.alloc_mr(4096, RW).expect("dst");
        for round in 0..20u64 {
            let data = pattern(512, round as u8);
            src.write(0, &data).expect("fill");
            let sge = [src.sge(0, 512)];
            s.qa.post_send(&[rdma(
                round,
                SendOpcode::RdmaWrite,
                &sge,
                dst.iova(),
                dst.rkey(),
            )])
            .expect("post");
            let wc = one(&s.a.cq);
            assert_eq!((wc.wr_id, wc.status), (round, WcStatus::Success));
            assert_eq!(read_mr(&dst, 0, 512), data);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let posted = flooder.join().expect("flooder");
        assert!(posted > 0, "the flood ran before the kill");
    });
    // Work towards the dead device fails, but only on that QP.
    let src = s.a.pd.alloc_mr(4096, RW).expect("src");
    let sge = [src.sge(0, 8)];
    qa2.post_send(&[signaled(SendWr::new(
        9,
        SendOpcode::Send,
        SendPayload::Sges(&sge),
    ))])
    .expect("post");
    assert_eq!(one(&s.a.cq).status, WcStatus::RetryExcErr);
    assert!(s.hostd.is_running(), "hostd survived:\n{}", s.hostd.log());
}

#[test]
fn a_cq_armed_for_solicited_events_ignores_unsolicited_messages() {
    let s = Pair::start();
    let dst = s.b.pd.alloc_mr(4096, RW).expect("dst");
    s.qb.post_recv(&[
        RecvWr {
            wr_id: 1,
            sg_list: &[dst.sge(0, 64)],
        },
        RecvWr {
            wr_id: 2,
            sg_list: &[dst.sge(64, 64)],
        },
    ])
    .expect("recv");
    s.b.cq.req_notify(true);
    s.send_inline(1, b"plain");
    assert_eq!(one(&s.b.cq).wr_id, 1);
    // Not solicited: no event.
    assert_no_completion_event(&s.b);
    let mut solicited = SendWr::new(2, SendOpcode::Send, SendPayload::Inline(b"urgent"));
    solicited.flags |= vrdma_spec::ring::send_flags::SOLICITED;
    s.qa.post_send(&[solicited]).expect("send");
    assert_completion_event(&s.b);
    let wc = one(&s.b.cq);
    assert_eq!(
        (wc.wr_id, wc.wc_flags & 0xc0),
        (2, 0),
        "marker bits never reach the guest"
    );
}

#[test]
fn a_memory_region_of_scattered_segments_takes_writes_and_reads() {
    let s = Pair::start();
    // Three separate buffers, registered as one MR (REG_MR_SG): the peer
    // sees one range of 9196 bytes at iova 0x5000_0000.
    let lens = [4096, 100, 5000];
    let total: usize = lens.iter().sum();
    let iova = 0x5000_0000;
    let dst =
        s.b.pd
            .alloc_mr_scattered(&lens, iova, RW)
            .expect("scattered MR");
    assert_eq!((dst.len(), dst.iova()), (total, iova));
    let src = s.a.pd.alloc_mr(2 * total, RW).expect("source MR");
    let data = fill(&src, total, 41);
    // A WRITE over all three segments, then one that starts in the middle
    // segment and ends in the last.
    let sge = [src.sge(0, total as u32)];
    s.qa.post_send(&[rdma(1, SendOpcode::RdmaWrite, &sge, iova, dst.rkey())])
        .expect("post write");
    assert_eq!(one(&s.a.cq).status, WcStatus::Success);
    assert_eq!(
        read_mr(&dst, 0, total),
        data,
        "bytes landed across segments"
    );
    let patch = pattern(300, 7);
    src.write(total, &patch).expect("fill patch");
    let sge = [src.sge(total as u64, 300)];
    s.qa.post_send(&[rdma(
        2,
        SendOpcode::RdmaWrite,
        &sge,
        iova + 4146,
        dst.rkey(),
    )])
    .expect("post write");
    assert_eq!(one(&s.a.cq).status, WcStatus::Success);
    let mut expected = data.clone();
    expected[4146..4446].copy_from_slice(&patch);
    assert_eq!(read_mr(&dst, 0, total), expected);
    // READ it all back into the other half of the source MR.
    let sge = [src.sge(total as u64, total as u32)];
    s.qa.post_send(&[rdma(3, SendOpcode::RdmaRead, &sge, iova, dst.rkey())])
        .expect("post read");
    assert_eq!(one(&s.a.cq).status, WcStatus::Success);
    assert_eq!(
        read_mr(&src, total, total),
        expected,
        "read across segments"
    );
    // One byte past the end is outside the MR.
    let sge = [src.sge(0, 2)];
    s.qa.post_send(&[rdma(
        4,
        SendOpcode::RdmaWrite,
        &sge,
        iova + total as u64 - 1,
        dst.rkey(),
    )])
    .expect("post write");
    assert_eq!(one(&s.a.cq).status, WcStatus::RemAccessErr);
}

/// vdev serves one frontend after another on the same hostd registration
/// name: each frontend's leaving ends its registration (hostd releases the
/// device's objects), so the next frontend registers anew and works. Once
/// broken: vdev's policy listener kept the registration alive, hostd kept
/// refusing the next one as "already connected" and vdev gave up and exited.
#[test]
fn one_vdev_serves_frontend_after_frontend_on_hostd() {
    let hostd = Hostd::start(None);
    let mut alpha = Vdev::on_hostd(&hostd, "alpha", &[]);
    let beta = Tenant::start(&hostd, "beta");
    for round in 0..3u8 {
        let dev = Opened::open(&alpha.socket, 16)
            .unwrap_or_else(|e| panic!("frontend {round}: open: {e}\n{}", alpha.log()));
        let (qp, gid) = (dev.rc_qp(default_caps()).expect("create_qp"), dev.gid);
        let peer = beta.qp(default_caps());
        bring_up(&qp, peer.qp_num(), beta.gid, Connection::default()).expect("bring up");
        bring_up(&peer, qp.qp_num(), gid, Connection::default()).expect("bring up the peer");
        let src = dev.pd.alloc_mr(4096, RW).expect("src");
        let dst = beta.pd.alloc_mr(4096, RW).expect("dst");
        let data = vec![round + 1; 4096];
        src.write(0, &data).expect("fill");
        let sge = [src.sge(0, 4096)];
        qp.post_send(&[rdma(1, SendOpcode::RdmaWrite, &sge, dst.iova(), dst.rkey())])
            .expect("post WRITE");
        assert_eq!(one(&dev.cq).status, WcStatus::Success, "frontend {round}");
        let mut landed = vec![0u8; 4096];
        dst.read(0, &mut landed).expect("read");
        assert_eq!(landed, data, "frontend {round}'s WRITE landed");
        assert_eq!(hostd.usage("alpha")["qps"], 1, "frontend {round}");
        drop((src, qp, dev));
        // The frontend left: hostd releases what it had.
        let deadline = Instant::now() + Duration::from_secs(10);
        while hostd.usage("alpha")["qps"] != 0 {
            assert!(
                Instant::now() < deadline,
                "frontend {round}'s QP is still in hostd"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert!(alpha.is_running(), "vdev stays up:\n{}", alpha.log());
}
