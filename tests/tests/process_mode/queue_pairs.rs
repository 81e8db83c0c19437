//! Queue pairs: what creation grants and refuses, the RC state machine
//! with every refused transition, and CQs of another device.

use vrdma_guest_driver::{Context, QpCapabilities, QpInitAttr};
use vrdma_spec::control::{QpAttr, NO_SRQ};
use vrdma_spec::qp_state::mask;
use vrdma_spec::ring;
use vrdma_spec::verbs::{access, Mtu, QpState, QpType};
use vrdma_tests::daemon::Vdev;
use vrdma_tests::tenant::{mask_to, rc_qp};

use crate::*;

#[test]
fn queue_pair_creation_grants_and_refusals() {
    let (_vdev, ctx) = device("pm-qp-create", &[]);
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq = ctx.create_cq(64, 0).expect("create_cq");

    let qp = rc_qp(&pd, &cq, caps(100, 10, 3, 40)).expect("create_qp");
    let qpn = qp.qp_num();
    assert!(
        qpn > 1 && qpn <= 0xff_ffff,
        "24-bit QPN, not 0 or 1: {qpn:#x}"
    );
    // The grant is what the rings the spec computes hold.
    let sq = ring::sq_geometry(100, 3, 40).expect("geometry");
    let rq = ring::rq_geometry(10, 3).expect("geometry");
    let granted = qp.cap();
    assert_eq!(granted.max_send_wr, sq.depth);
    assert_eq!(granted.max_recv_wr, rq.depth);
    let fixed = std::mem::size_of::<ring::SendWqe>() as u32;
    assert_eq!(granted.max_send_sge, (sq.stride - fixed) / 16);
    assert_eq!(granted.max_recv_sge, (rq.stride - 16) / 16);
    assert_eq!(granted.max_inline_data, sq.stride - fixed);
    assert_eq!(
        (
            granted.max_send_wr,
            granted.max_recv_wr,
            granted.max_send_sge
        ),
        (128, 16, 5)
    );

    // A new QP: RESET, creation attributes, defaults.
    let q = qp.query(0).expect("query_qp");
    assert_eq!(q.attr.qp_state, u8::from(QpState::Reset));
    assert_eq!(q.attr.path_mtu, u8::from(Mtu::Mtu4096));
    assert_eq!(q.attr.port_num, 1);
    assert_eq!(QpCapabilities::from(q.attr.cap), granted);
    assert_eq!((q.send_cqn.get(), q.recv_cqn.get()), (cq.cqn(), cq.cqn()));
    assert_eq!(q.srqn.get(), NO_SRQ);
    assert_eq!(q.qp_type, u8::from(QpType::Rc));
    assert_eq!(q.sq_sig_all, 0);
    assert_eq!(q.attr.dest_qp_num.get(), 0);

    let second = pd
        .create_qp(&QpInitAttr {
            send_cq: &cq,
            recv_cq: &cq,
            cap: caps(1, 0, 1, 0),
            qp_type: QpType::Rc,
            sq_sig_all: true,
            srq: None,
        })
        .expect("a QP without receive WRs");
    assert_ne!(second.qp_num(), qpn);
    assert_eq!(second.query(0).expect("query").sq_sig_all, 1);
    assert_eq!(second.cap().max_recv_wr, 1, "a receive ring always exists");

    let with = |qp_type, cap| {
        pd.create_qp(&QpInitAttr {
            send_cq: &cq,
            recv_cq: &cq,
            cap,
            qp_type,
            sq_sig_all: false,
            srq: None,
        })
    };
    let ok = caps(4, 4, 1, 0);
    for qp_type in [QpType::Uc, QpType::Ud] {
        let qp = with(qp_type, ok).unwrap_or_else(|e| panic!("{qp_type:?}: {e}"));
        assert_eq!(qp.query(0).expect("query").qp_type, u8::from(qp_type));
        destroyed(qp.destroy());
    }
    for (qp_type, cap, errno, what) in [
        (QpType::Rc, caps(0, 0, 1, 0), EINVAL, "no queue"),
        (QpType::Rc, caps(8193, 4, 1, 0), EINVAL, "depth"),
        (QpType::Rc, caps(4, 4, 17, 0), EINVAL, "max_sge"),
        (QpType::Rc, caps(4, 4, 1, 257), EINVAL, "inline"),
    ] {
        assert_eq!(device_errno(with(qp_type, cap)), errno, "{what}");
    }
    assert_eq!(
        driver_errno(with(QpType::Rc, caps(u32::MAX, 4, 1, 0))),
        EINVAL
    );

    destroyed(second.destroy());
    destroyed(qp.destroy());
    destroyed(cq.destroy());
    destroyed(pd.destroy());
}

#[test]
fn queue_pair_walks_the_rc_state_machine() {
    let (_vdev, ctx) = device("pm-qp-states", &["--lid", "5"]);
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq = ctx.create_cq(16, 0).expect("create_cq");
    let qp = rc_qp(&pd, &cq, caps(16, 16, 1, 32)).expect("create_qp");
    let granted = qp.cap();
    let refuse = |attr: &QpAttr, mask: u32| device_errno(qp.modify(attr, mask));

    // RESET: no transition to RTR; a refused modify changes nothing.
    assert_eq!(state_of(&qp), QpState::Reset);
    assert_eq!(
        refuse(&rtr_attr(0x42, 7), mask_to(QpState::Rtr)),
        EINVAL,
        "RESET->RTR"
    );
    assert_eq!(
        refuse(&init_attr(), mask::STATE | mask::PORT),
        EINVAL,
        "missing attrs"
    );
    assert_eq!(state_of(&qp), QpState::Reset);

    // RESET -> INIT, with value checks first.
    let bad_port = QpAttr {
        port_num: 2,
        ..init_attr()
    };
    assert_eq!(refuse(&bad_port, mask_to(QpState::Init)), EINVAL, "port 2");
    let bad_access = QpAttr {
        qp_access_flags: access::LOCAL_WRITE.into(),
        ..init_attr()
    };
    assert_eq!(
        refuse(&bad_access, mask_to(QpState::Init)),
        EINVAL,
        "LOCAL_WRITE is no QP access"
    );
    let bad_pkey = QpAttr {
        pkey_index: 1.into(),
        ..init_attr()
    };
    assert_eq!(
        refuse(&bad_pkey, mask_to(QpState::Init)),
        EINVAL,
        "pkey_index 1"
    );
    assert_eq!(state_of(&qp), QpState::Reset);
    qp.modify(&init_attr(), mask_to(QpState::Init))
        .expect("RESET->INIT");
    let q = qp.query(0).expect("query");
    assert_eq!(q.attr.qp_state, u8::from(QpState::Init));
    assert_eq!(
        q.attr.qp_access_flags.get(),
        access::REMOTE_WRITE | access::REMOTE_READ
    );
    // INIT -> INIT changes an optional attribute.
    let remote_read = QpAttr {
        qp_access_flags: access::REMOTE_READ.into(),
        ..QpAttr::default()
    };
    qp.modify(&remote_read, mask::ACCESS_FLAGS)
        .expect("INIT->INIT");
    assert_eq!(
        qp.query(0).expect("query").attr.qp_access_flags.get(),
        access::REMOTE_READ
    );

    // INIT -> RTR: a bad attribute is refused and leaves INIT as it was.
    let before = qp.query(0).expect("query");
    let peer = 0xab_cdef;
    // The RTR attributes with one value changed.
    let with = |change: fn(&mut QpAttr)| {
        let mut attr = rtr_attr(peer, 7);
        change(&mut attr);
        attr
    };
    for (attr, what) in [
        (with(|a| a.path_mtu = 6), "path_mtu above the port's"),
        (with(|a| a.path_mtu = 0), "path_mtu 0"),
        (rtr_attr(0x100_0000, 7), "dest_qp_num wider than 24 bits"),
        (with(|a| a.ah_attr.is_global = 0), "no GRH on a RoCE port"),
        (with(|a| a.ah_attr.sgid_index = 1), "sgid_index 1"),
        (with(|a| a.ah_attr.dgid[0] = 0xfe), "an IPv6 dgid"),
        (
            with(|a| a.rq_psn = 0x100_0000.into()),
            "rq_psn wider than 24 bits",
        ),
        (with(|a| a.min_rnr_timer = 32), "min_rnr_timer 32"),
        (
            with(|a| a.max_dest_rd_atomic = 17),
            "max_dest_rd_atomic above max_qp_rd_atom",
        ),
    ] {
        assert_eq!(refuse(&attr, mask_to(QpState::Rtr)), EINVAL, "{what}");
        assert_eq!(
            qp.query(0).expect("query"),
            before,
            "{what}: nothing changed"
        );
    }
    assert_eq!(
        refuse(&rtr_attr(peer, 7), mask_to(QpState::Rtr) | mask::ALT_PATH),
        EOPNOTSUPP,
        "alternate paths"
    );
    assert_eq!(
        refuse(&rtr_attr(peer, 7), mask_to(QpState::Rtr) | mask::QKEY),
        EINVAL,
        "QKEY is not an RC attribute"
    );
    let wrong_cur = QpAttr {
        cur_qp_state: QpState::Rts.into(),
        ..rtr_attr(peer, 7)
    };
    assert_eq!(
        refuse(&wrong_cur, mask_to(QpState::Rtr) | mask::CUR_STATE),
        EINVAL,
        "cur_qp_state"
    );
    assert_eq!(
        refuse(&to_state(QpState::Rts), mask::STATE),
        EINVAL,
        "INIT->RTS"
    );
    assert_eq!(state_of(&qp), QpState::Init);
    qp.modify(&rtr_attr(peer, 7), mask_to(QpState::Rtr))
        .expect("INIT->RTR");
    let q = qp.query(0).expect("query");
    assert_eq!(q.attr.qp_state, u8::from(QpState::Rtr));
    assert_eq!(q.attr.dest_qp_num.get(), peer);
    assert_eq!(q.attr.rq_psn.get(), 0x1234);
    assert_eq!(q.attr.path_mtu, u8::from(Mtu::Mtu1024));
    assert_eq!(q.attr.ah_attr, rtr_attr(peer, 7).ah_attr);
    assert_eq!(q.attr.max_dest_rd_atomic, 4);
    assert_eq!(q.attr.min_rnr_timer, 12);
    assert_eq!(
        refuse(&rtr_attr(peer, 7), mask_to(QpState::Rtr)),
        EINVAL,
        "RTR->RTR"
    );

    // RTR -> RTS.
    let bad_retry = QpAttr {
        retry_cnt: 8,
        ..rts_attr()
    };
    assert_eq!(
        refuse(&bad_retry, mask_to(QpState::Rts)),
        EINVAL,
        "retry_cnt 8"
    );
    assert_eq!(
        refuse(&rts_attr(), mask_to(QpState::Rts) | mask::DEST_QPN),
        EINVAL
    );
    assert_eq!(state_of(&qp), QpState::Rtr);
    qp.modify(&rts_attr(), mask_to(QpState::Rts))
        .expect("RTR->RTS");
    let q = qp.query(0).expect("query");
    assert_eq!(q.attr.qp_state, u8::from(QpState::Rts));
    assert_eq!(q.attr.sq_psn.get(), 0x5678);
    assert_eq!(
        (q.attr.timeout, q.attr.retry_cnt, q.attr.rnr_retry),
        (14, 7, 6)
    );
    assert_eq!(q.attr.max_rd_atomic, 2);
    assert_eq!(q.attr.dest_qp_num.get(), peer, "RTR attributes kept");
    // RTS -> RTS with an optional attribute, guarded by the current state.
    let rnr = QpAttr {
        min_rnr_timer: 20,
        cur_qp_state: QpState::Rts.into(),
        ..QpAttr::default()
    };
    qp.modify(&rnr, mask::MIN_RNR_TIMER | mask::CUR_STATE)
        .expect("RTS->RTS");
    assert_eq!(qp.query(0).expect("query").attr.min_rnr_timer, 20);

    // RTS -> SQD -> RTS -> ERR.
    qp.modify(&to_state(QpState::Sqd), mask::STATE)
        .expect("RTS->SQD");
    assert_eq!(state_of(&qp), QpState::Sqd);
    qp.modify(&to_state(QpState::Rts), mask::STATE)
        .expect("SQD->RTS");
    assert_eq!(state_of(&qp), QpState::Rts);
    assert_eq!(
        refuse(&to_state(QpState::Sqe), mask::STATE),
        EINVAL,
        "to SQE"
    );
    assert_eq!(
        refuse(
            &QpAttr {
                qp_state: 7,
                ..QpAttr::default()
            },
            mask::STATE
        ),
        EINVAL,
        "no state 7"
    );
    qp.modify(&to_state(QpState::Err), mask::STATE)
        .expect("RTS->ERR");
    assert_eq!(state_of(&qp), QpState::Err);
    assert_eq!(
        refuse(&rts_attr(), mask_to(QpState::Rts)),
        EINVAL,
        "ERR->RTS"
    );
    assert_eq!(state_of(&qp), QpState::Err);

    // ERR -> RESET forgets every attribute.
    qp.modify(&to_state(QpState::Reset), mask::STATE)
        .expect("ERR->RESET");
    let q = qp.query(0).expect("query");
    assert_eq!(q.attr.qp_state, u8::from(QpState::Reset));
    assert_eq!(
        q.attr,
        QpAttr {
            qp_state: QpState::Reset.into(),
            cur_qp_state: QpState::Reset.into(),
            path_mtu: Mtu::Mtu4096.into(),
            port_num: 1,
            cap: granted.into(),
            ..QpAttr::default()
        },
        "a RESET QP looks new"
    );
    // And it can be connected again.
    connect(&qp, peer, 7);
    destroyed(qp.destroy());
    destroyed(cq.destroy());
    destroyed(pd.destroy());
}

// ---------------------------------------------------------------------------

#[test]
fn a_queue_pair_cannot_use_another_devices_cq() {
    let vdev_a = Vdev::start("cq-owner-a", &[]);
    let vdev_b = Vdev::start("cq-owner-b", &[]);
    let ctx_a = Context::open_vhost_user(&vdev_a.socket).expect("open a");
    let ctx_b = Context::open_vhost_user(&vdev_b.socket).expect("open b");
    let pd_a = ctx_a.alloc_pd().expect("pd");
    let cq_b = ctx_b.create_cq(16, 0).expect("cq on b");
    let _cq_a = ctx_a.create_cq(16, 0).expect("cq on a, same number as b's");
    assert_eq!(
        driver_errno(rc_qp(&pd_a, &cq_b, caps(4, 4, 1, 0))),
        libc::EINVAL
    );
}
