//! A queue pair's capacities end to end (hostd and vdevs as separate
//! processes, process-mode tenants): what a QP is granted is what the
//! datapath carries, and its send queue's depth bounds the work in flight.
//! Two of issue 12's defects, each test failing before its fix: a QP was
//! granted 64 SGEs or 1024 inline bytes that the datapath then refused
//! (LOC_PROT_ERR), and one asking 16 SGEs was granted 28; and a send
//! queue's slots were freed when vdev copied a WQE rather than when it
//! completed, so 64 posts fitted a 16-deep queue and 48 completions were
//! lost.

use std::time::Duration;

use vrdma_guest_driver::{Error, QpCapabilities, RecvWr, SendPayload, SendWr, Sge};
use vrdma_spec::verbs::{SendOpcode, WcOpcode, WcStatus};
use vrdma_tests::daemon::{Hostd, Vdev};
use vrdma_tests::tenant::{
    assert_no_completion, connect, one, pattern, policy, rc_qp, rdma, read_mr, signaled,
    wait_completions, Connection, Tenant, ALL_ACCESS,
};

/// What the policy allows alpha and beta, and their vdevs' own limits:
/// the most the spec allows.
const WIDE_QUOTAS: &str = "network = \"demo\"\nquotas = { max_sge = 64, max_inline_data = 1024 }";
const WIDE_LIMITS: &str = "[limits]\nmax_sge = 64\nmax_inline_data = 1024\n";

fn caps(wr: u32, sge: u32, inline: u32) -> QpCapabilities {
    QpCapabilities {
        max_send_wr: wr,
        max_recv_wr: wr,
        max_send_sge: sge,
        max_recv_sge: sge,
        max_inline_data: inline,
    }
}

/// `tenant`'s device on `hostd`, its vdev started with `config`.
fn tenant_with(hostd: &Hostd, tenant: &str, config: &str) -> Tenant {
    let socket = hostd.socket.to_str().expect("UTF-8 socket path");
    Tenant::open(Vdev::start_with_config(
        tenant,
        config,
        &["--hostd", socket],
    ))
}

#[test]
fn the_caps_a_qp_is_granted_are_carried_by_the_datapath() {
    let hostd = Hostd::start(Some(&policy(&[
        ("alpha", WIDE_QUOTAS),
        ("beta", WIDE_QUOTAS),
    ])));
    let a = tenant_with(&hostd, "alpha", WIDE_LIMITS);
    let b = tenant_with(&hostd, "beta", WIDE_LIMITS);
    let dev = a.ctx.query_device().expect("query_device");
    assert_eq!((dev.max_sge.get(), dev.max_inline_data.get()), (64, 1024));
    let asked = caps(16, 64, 1024);
    let (qa, qb) = (a.qp(asked), b.qp(asked));
    assert_eq!(qa.cap(), asked, "granted exactly what was asked");
    connect(&a, &qa, &b, &qb, Connection::default());
    let (src, dst) = (
        a.pd.alloc_mr(8192, ALL_ACCESS).expect("alloc_mr"),
        b.pd.alloc_mr(8192, ALL_ACCESS).expect("alloc_mr"),
    );

    // A 64-SGE RDMA WRITE: byte i of the message comes from SGE i, and
    // the SGEs run backwards through the source, 64 bytes apart.
    let message = pattern(64, 0x40);
    let at = |i: usize| ((63 - i) * 64) as u64;
    for (i, byte) in message.iter().enumerate() {
        src.write(at(i) as usize, &[*byte]).expect("fill");
    }
    let sges: Vec<Sge> = (0..64).map(|i| src.sge(at(i), 1)).collect();
    let wr = rdma(1, SendOpcode::RdmaWrite, &sges, dst.iova(), dst.rkey());
    qa.post_send(&[wr]).expect("post a 64-SGE WRITE");
    let wc = one(&a.cq);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success), "{wc:?}");
    assert_eq!(read_mr(&dst, 0, 64), message, "the 64 bytes on the peer");
    assert_eq!(read_mr(&dst, 64, 64), [0; 64], "nothing beyond them");

    // A 1024-byte inline WRITE.
    let inline = pattern(1024, 0x10);
    let mut wr = signaled(SendWr::new(
        2,
        SendOpcode::RdmaWrite,
        SendPayload::Inline(&inline),
    ));
    (wr.remote_addr, wr.rkey) = (dst.iova() + 4096, dst.rkey());
    qa.post_send(&[wr]).expect("post a 1024-byte inline WRITE");
    let wc = one(&a.cq);
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success), "{wc:?}");
    assert_eq!(
        read_mr(&dst, 4096, 1024),
        inline,
        "the inline bytes on the peer"
    );

    // A SEND gathering from 64 SGEs into a receive scattering over 64.
    let sent = pattern(64 * 16, 0x77);
    src.write(0, &sent).expect("fill");
    let gather: Vec<Sge> = (0..64).map(|i| src.sge(i * 16, 16)).collect();
    let scatter: Vec<Sge> = (0..64).map(|i| dst.sge(8191 - 16 * (i + 1), 16)).collect();
    (qb.post_recv(&[RecvWr {
        wr_id: 3,
        sg_list: &scatter,
    }]))
    .expect("post a 64-SGE receive");
    let send = signaled(SendWr::new(4, SendOpcode::Send, SendPayload::Sges(&gather)));
    qa.post_send(&[send]).expect("post a 64-SGE SEND");
    let (sent_wc, recv_wc) = (one(&a.cq), one(&b.cq));
    assert_eq!((sent_wc.wr_id, sent_wc.status), (4, WcStatus::Success));
    assert_eq!(
        (recv_wc.wr_id, recv_wc.status, recv_wc.byte_len),
        (3, WcStatus::Success, 1024)
    );
    for i in 0..64 {
        let piece = &sent[i * 16..(i + 1) * 16];
        assert_eq!(read_mr(&dst, 8191 - 16 * (i + 1), 16), piece, "SGE {i}");
    }

    // Under the limit of 64, a QP asking 16 SGEs is granted what its
    // 512-byte slot holds, 29 (device spec §6.2), and a WRITE gathering
    // all 29 succeeds (the defect's report: granted 28, refused past 16).
    let (qa, qb) = (a.qp(caps(16, 16, 0)), b.qp(caps(16, 16, 0)));
    assert_eq!(qa.cap().max_send_sge, 29, "{:?}", qa.cap());
    connect(&a, &qa, &b, &qb, Connection::default());
    let sges: Vec<Sge> = (0..29).map(|i| src.sge(at(i), 1)).collect();
    let wr = rdma(
        5,
        SendOpcode::RdmaWrite,
        &sges,
        dst.iova() + 6000,
        dst.rkey(),
    );
    qa.post_send(&[wr]).expect("post a 29-SGE WRITE");
    let wc = one(&a.cq);
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success), "{wc:?}");
    assert_eq!(read_mr(&dst, 6000, 29), message[..29], "the 29 bytes");

    // Under vdev's default limit of 16 SGEs (and 256 inline bytes), a QP
    // asking for them is granted exactly that (its slot would hold 29).
    let narrow = Tenant::start(&hostd, "alpha");
    let asked = caps(16, 16, 256);
    assert_eq!(narrow.qp(asked).cap(), asked, "granted exactly the limit");
}

#[test]
fn the_send_queue_is_full_until_completions_free_it() {
    let hostd = Hostd::start(None);
    let (a, b) = (
        Tenant::start(&hostd, "alpha"),
        Tenant::start(&hostd, "beta"),
    );
    let cq = a.ctx.create_cq(16, 0).expect("a 16-entry CQ");
    let qa = rc_qp(&a.pd, &cq, caps(16, 1, 64)).expect("create_qp");
    assert_eq!(qa.cap().max_send_wr, 16, "a 16-deep send queue");
    let qb = b.qp(caps(16, 1, 64));
    // Infinite RNR retries: a SEND waits for a receive as long as it takes.
    let how = Connection {
        rnr_retry: 7,
        ..Connection::default()
    };
    connect(&a, &qa, &b, &qb, how);
    let send = |id: u64| {
        let payload = SendPayload::Inline(&[]);
        let mut wr = signaled(SendWr::new(id, SendOpcode::SendWithImm, payload));
        wr.imm_data = (id as u32).to_be_bytes();
        wr
    };

    // The peer has no receive: 16 SENDs fit, the 17th does not.
    for id in 0..16 {
        qa.post_send(&[send(id)])
            .unwrap_or_else(|e| panic!("SEND {id} of 16: {e}"));
    }
    let full = qa.post_send(&[send(16)]).expect_err("the 17th SEND");
    assert_eq!((full.bad_wr, full.errno()), (0, libc::ENOMEM), "{full:?}");
    assert!(matches!(full.error, Error::QueueFull), "{full:?}");
    assert_no_completion(&cq, Duration::from_millis(50));
    assert!(
        qa.post_send(&[send(16)]).is_err(),
        "still full while nothing completed"
    );

    // The peer posts receives for `sends`: they complete, in order.
    let receive_for = |sends: std::ops::Range<u64>| {
        let recvs: Vec<RecvWr<'_>> = (sends.clone())
            .map(|id| RecvWr {
                wr_id: id + 100,
                sg_list: &[],
            })
            .collect();
        qb.post_recv(&recvs).expect("post receives");
        let wcs = wait_completions(&cq, recvs.len());
        let ids: Vec<u64> = wcs.iter().map(|wc| wc.wr_id).collect();
        assert_eq!(ids, sends.collect::<Vec<_>>(), "in order: {wcs:?}");
        let succeeded = wcs.iter().all(|wc| wc.status == WcStatus::Success);
        assert!(succeeded, "{wcs:?}");
    };
    receive_for(0..16);
    let received = wait_completions(&b.cq, 16);
    let imms: Vec<_> = received.iter().map(|wc| wc.imm_data).collect();
    let sent: Vec<_> = (0..16).map(|id| Some((id as u32).to_be_bytes())).collect();
    assert_eq!(imms, sent, "received in order: {received:?}");
    assert!(received
        .iter()
        .all(|wc| wc.opcode == Some(WcOpcode::Recv) && wc.status == WcStatus::Success));
    // They freed the queue for 16 more, and no more.
    let more: Vec<SendWr<'_>> = (16..32).map(send).collect();
    qa.post_send(&more).expect("16 more fit");
    let full = qa.post_send(&[send(32)]).expect_err("and then no more");
    assert_eq!(full.errno(), libc::ENOMEM);
    receive_for(16..32);
}

/// Completions one CQ holds at once in the test below: more than 64 Ki
/// (a work ring's deepest), from 9 QPs of 8 Ki WRs each.
const QPS_ON_ONE_CQ: u64 = 9;
const WRS_PER_QP: u64 = 8192;

/// CQs as deep as programs make them (issue 14): a CQ of 1 Mi entries, the
/// default policy's deepest, holds 9 × 8 Ki = 73,728 completions at once —
/// past a 64 Ki ring's end — each where it belongs (per QP in posting
/// order); `ibv_query_device` says so; and the tenant's policy still
/// decides (`max_cq_depth` 4096: a CQ of 8192 is refused with EINVAL).
#[test]
fn a_cq_deeper_than_64_ki_holds_its_completions_and_the_policy_bounds_it() {
    let policy = policy(&[
        ("alpha", "network = \"demo\""),
        (
            "beta",
            "network = \"demo\"\nquotas = { max_cq_depth = 4096 }",
        ),
    ]);
    let hostd = Hostd::start(Some(&policy));
    let (a, b) = (
        Tenant::start(&hostd, "alpha"),
        Tenant::start(&hostd, "beta"),
    );
    let attr = a.ctx.query_device().expect("query_device");
    assert!(attr.max_cqe.get() >= 1 << 20, "max_cqe {}", attr.max_cqe);
    let cq = a.ctx.create_cq(1 << 20, 0).expect("a CQ of 1 Mi entries");
    let dst = b.pd.alloc_mr(4096, ALL_ACCESS).expect("beta's MR");
    let src = a.pd.alloc_mr(64, ALL_ACCESS).expect("alpha's MR");
    let sge = [src.sge(0, 8)];
    let qps: Vec<_> = (0..QPS_ON_ONE_CQ)
        .map(|_| {
            let qa = rc_qp(&a.pd, &cq, caps(WRS_PER_QP as u32, 1, 0)).expect("create_qp");
            let qb = b.qp(caps(16, 1, 0));
            connect(&a, &qa, &b, &qb, Connection::default());
            (qa, qb)
        })
        .collect();
    // Every QP's queue full of signaled WRITEs; nothing polled meanwhile.
    for (q, (qa, _)) in qps.iter().enumerate() {
        let q = q as u64;
        for batch in (0..WRS_PER_QP).collect::<Vec<_>>().chunks(256) {
            let wrs: Vec<SendWr<'_>> = batch
                .iter()
                .map(|i| {
                    let id = q << 32 | i;
                    rdma(id, SendOpcode::RdmaWrite, &sge, dst.iova(), dst.rkey())
                })
                .collect();
            qa.post_send(&wrs)
                .unwrap_or_else(|e| panic!("QP {q}: post: {e}"));
        }
    }
    let total = (QPS_ON_ONE_CQ * WRS_PER_QP) as usize;
    let wcs = poll_all(&cq, total);
    assert_eq!(wcs.len(), total, "every completion");
    let mut next = vec![0u64; QPS_ON_ONE_CQ as usize];
    for wc in &wcs {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        let (q, i) = ((wc.wr_id >> 32) as usize, wc.wr_id & 0xffff_ffff);
        assert_eq!(i, next[q], "QP {q}'s completions in posting order");
        next[q] += 1;
    }
    assert_no_completion(&cq, Duration::from_millis(20));
    drop(qps);

    // beta's policy: 4096 entries at most.
    b.ctx
        .create_cq(4096, 0)
        .expect("a CQ of beta's largest depth");
    let refused = b
        .ctx
        .create_cq(8192, 0)
        .expect_err("deeper than beta's max_cq_depth");
    assert_eq!(refused.errno(), libc::EINVAL, "{refused:?}");
}

/// Polls `cq` for `n` completions, however long the datapath takes (60 s
/// at most: `wait_completions` allows 10).
fn poll_all(
    cq: &vrdma_guest_driver::CompletionQueue,
    n: usize,
) -> Vec<vrdma_guest_driver::WorkCompletion> {
    vrdma_tools::verbs::poll_for(cq, n, Duration::from_secs(60)).expect("poll_cq")
}
