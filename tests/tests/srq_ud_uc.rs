//! Shared receive queues and UD through the real daemons (hostd and two
//! or three vdevs) and the guest driver's API: an SRQ feeding its QP and
//! its limit event; address handles and the isolation rule at their
//! creation, Q_Keys, the GRH a datagram arrives behind, and what hostd
//! counts. (Debian's binaries over SRQ, UD and UC: `ibverbs_compat.rs`.)

use vrdma_guest_driver::{
    QpInitAttr, QueuePair, SendPayload, SendWr, Sge, SharedReceiveQueue, UdDest,
};
use vrdma_spec::control::{AhAttr, QpAttr};
use vrdma_spec::qp_state::mask;
use vrdma_spec::ring::wc_flags;
use vrdma_spec::verbs::{access, QpState, QpType, SendOpcode, WcOpcode, WcStatus};
use vrdma_tests::daemon::{metric_value, Hostd};
use vrdma_tests::tenant::{blue_and_red, one, read_mr, Tenant};
use vrdma_tools::verbs::default_caps;

const QKEY: u32 = 0x1111_1111;

/// A path to `gid` (RoCE: a GRH from GID index 0).
fn path_to(gid: [u8; 16]) -> AhAttr {
    AhAttr {
        dgid: gid,
        is_global: 1,
        port_num: 1,
        hop_limit: 64,
        ..AhAttr::default()
    }
}

/// A QP of `qp_type` of `t` (its receives from `srq`, if given), in RESET.
fn qp_of(t: &Tenant, qp_type: QpType, srq: Option<&SharedReceiveQueue>) -> QueuePair {
    t.pd.create_qp(&QpInitAttr {
        send_cq: &t.cq,
        recv_cq: &t.cq,
        cap: default_caps(),
        qp_type,
        sq_sig_all: false,
        srq,
    })
    .unwrap_or_else(|e| panic!("{qp_type:?} QP: {e}"))
}

/// A UD QP of `t` in RTS with Q_Key `qkey`.
fn ud_qp(t: &Tenant, qkey: u32) -> QueuePair {
    let qp = qp_of(t, QpType::Ud, None);
    let init = QpAttr {
        qp_state: QpState::Init.into(),
        qkey: qkey.into(),
        port_num: 1,
        ..QpAttr::default()
    };
    qp.modify(
        &init,
        mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY,
    )
    .expect("INIT");
    let state = |s: QpState| QpAttr {
        qp_state: s.into(),
        ..QpAttr::default()
    };
    qp.modify(&state(QpState::Rtr), mask::STATE).expect("RTR");
    qp.modify(&state(QpState::Rts), mask::STATE | mask::SQ_PSN)
        .expect("RTS");
    qp
}

#[test]
fn an_address_handle_is_refused_outside_the_tenant_network() {
    let hostd = Hostd::start(Some(&blue_and_red()));
    let a = Tenant::start(&hostd, "alpha");
    let b = Tenant::start(&hostd, "beta");
    let c = Tenant::start(&hostd, "gamma");
    let errno = |attr: AhAttr| a.pd.create_ah(&attr).map(|_| ()).map_err(|e| e.errno());
    assert_eq!(
        errno(path_to(c.gid)),
        Err(libc::EACCES),
        "red is out of reach"
    );
    let nobody = vrdma_spec::gid::ipv4_mapped([127, 100, 9, 9]);
    assert_eq!(errno(path_to(nobody)), Err(libc::ENOENT), "no such device");
    let no_grh = AhAttr {
        is_global: 0,
        ..path_to(b.gid)
    };
    assert_eq!(errno(no_grh), Err(libc::EINVAL), "RoCE needs a GRH");
    let ah = a.pd.create_ah(&path_to(b.gid)).expect("blue reaches blue");
    ah.destroy().expect("destroy");
}

#[test]
fn datagrams_arrive_behind_their_grh_and_a_wrong_qkey_is_dropped_and_counted() {
    let hostd = Hostd::start(None);
    let a = Tenant::start(&hostd, "alpha");
    let b = Tenant::start(&hostd, "beta");
    let (qa, qb) = (ud_qp(&a, QKEY), ud_qp(&b, QKEY));
    let ah = a.pd.create_ah(&path_to(b.gid)).expect("AH");
    let src = a.pd.alloc_mr(4096, access::LOCAL_WRITE).expect("src");
    src.write(0, b"a datagram").expect("fill");
    let dst = b.pd.alloc_mr(4096, access::LOCAL_WRITE).expect("dst");
    qb.post_recv(&[vrdma_guest_driver::RecvWr {
        wr_id: 7,
        sg_list: &[dst.sge(0, 40 + 64)],
    }])
    .expect("post_recv");
    let sge: [Sge; 1] = [src.sge(0, 10)];
    let send = |wr_id, qkey| {
        let mut wr = SendWr::new(wr_id, SendOpcode::Send, SendPayload::Sges(&sge)).to_ud(UdDest {
            ah: ah.ahn(),
            remote_qpn: qb.qp_num(),
            remote_qkey: qkey,
        });
        wr.flags = vrdma_spec::ring::send_flags::SIGNALED;
        qa.post_send(&[wr]).expect("post_send");
        one(&a.cq)
    };
    // The wrong Q_Key: sent (the sender cannot tell), dropped at B.
    let wc = send(1, QKEY ^ 1);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    let wc = send(2, QKEY);
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    let r = one(&b.cq);
    assert_eq!(
        (r.wr_id, r.status, r.opcode),
        (7, WcStatus::Success, Some(WcOpcode::Recv))
    );
    assert_eq!(r.byte_len, 40 + 10);
    assert_eq!((r.qp_num, r.src_qp), (qb.qp_num(), qa.qp_num()));
    assert_ne!(r.wc_flags & wc_flags::GRH, 0);
    assert_eq!(read_mr(&dst, 40, 10), b"a datagram");
    let grh = read_mr(&dst, 0, 40);
    assert_eq!((grh[20], grh[28]), (0x45, 64), "IPv4 header, TTL 64");
    assert_eq!(grh[32..36], a.gid[12..], "source: alpha's address");
    assert_eq!(grh[36..40], b.gid[12..], "destination: beta's");
    // A UD QP carries no RDMA WRITE: the driver refuses it.
    let write = SendWr::new(3, SendOpcode::RdmaWrite, SendPayload::Sges(&sge));
    let err = qa.post_send(&[write]).expect_err("no WRITE on UD");
    assert_eq!(err.errno(), libc::EINVAL);
    // hostd counted the drop for beta.
    let (code, metrics, err) = hostd.ctl(&["metrics"]);
    assert_eq!(code, 0, "{err}");
    let series = "vrdma_tenant_dropped_total{tenant=\"beta\",reason=\"qkey\"}";
    assert_eq!(metric_value(&metrics, series), Some(1.0), "{metrics}");
}

/// A shared receive queue through the daemons: an RC QP of beta on beta's
/// SRQ takes the SRQ's receives in order; the armed limit raises
/// SRQ_LIMIT on beta's event ring once; a receive posted on the QP itself
/// is refused (EINVAL); a QP of the SRQ that goes to ERR raises
/// QP_LAST_WQE_REACHED.
#[test]
fn an_srq_feeds_its_qp_and_raises_its_limit_event_once() {
    use vrdma_guest_driver::{DeviceEvent, RecvWr};
    use vrdma_tests::tenant::{connect, statuses};
    use vrdma_tools::verbs::Connection;

    let hostd = Hostd::start(None);
    let a = Tenant::start(&hostd, "alpha");
    let b = Tenant::start(&hostd, "beta");
    let srq = b.pd.create_srq(8, 1, 3).expect("SRQ");
    assert_eq!(srq.caps().0, 8);
    let qb = qp_of(&b, QpType::Rc, Some(&srq));
    assert_eq!(qb.cap().max_recv_wr, 0);
    assert_eq!(qb.srqn(), Some(srq.srqn()));
    let qa = a.qp(default_caps());
    connect(&a, &qa, &b, &qb, Connection::default());
    let dst = b.pd.alloc_mr(4096, access::LOCAL_WRITE).expect("dst");
    let own = qb
        .post_recv(&[RecvWr {
            wr_id: 99,
            sg_list: &[dst.sge(0, 64)],
        }])
        .expect_err("the QP's receives are the SRQ's");
    assert_eq!(own.errno(), libc::EINVAL);
    for i in 0..5u64 {
        srq.post_recv(&[RecvWr {
            wr_id: 10 + i,
            sg_list: &[dst.sge(64 * i, 64)],
        }])
        .expect("post_srq_recv");
    }
    let src = a.pd.alloc_mr(4096, access::LOCAL_WRITE).expect("src");
    let sge = [src.sge(0, 8)];
    for i in 0..3u64 {
        let mut wr = SendWr::new(i, SendOpcode::Send, SendPayload::Sges(&sge));
        wr.flags = vrdma_spec::ring::send_flags::SIGNALED;
        qa.post_send(&[wr]).expect("send");
    }
    assert_eq!(
        statuses(&a.cq, 3),
        (0..3).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    assert_eq!(
        statuses(&b.cq, 3),
        (10..13).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>(),
        "the SRQ's receives in posting order"
    );
    // 5 posted, 3 taken: 2 < 3 fired the limit once, and disarmed it.
    let event = b.ctx.get_event(0, Some(std::time::Duration::from_secs(10)));
    assert_eq!(
        event.expect("event"),
        Some(DeviceEvent::SrqLimit { srqn: srq.srqn() })
    );
    assert_eq!(srq.query().expect("query").srq_limit.get(), 0);
    // The QP goes to ERR: the SRQ's other receives stay the SRQ's.
    let err = QpAttr {
        qp_state: QpState::Err.into(),
        ..QpAttr::default()
    };
    qb.modify(&err, mask::STATE).expect("to ERR");
    let event = b.ctx.get_event(0, Some(std::time::Duration::from_secs(10)));
    assert_eq!(
        event.expect("event"),
        Some(DeviceEvent::LastWqeReached { qpn: qb.qp_num() })
    );
    assert_eq!(
        srq.destroy().map_err(|e| e.errno()).unwrap_err(),
        libc::EBUSY
    );
}
