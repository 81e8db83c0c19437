//! Queue pairs: creation, grants, doorbell indices, the RC state machine.

use vrdma_spec::limits::{QpGrant, MAX_INLINE_DATA, MAX_SGE};

use super::*;

/// CREATE_QP asking `cap`, its rings in the 64 KiB at `at`.
fn qp_with(
    dev: &mut RdmaDevice,
    pdn: u32,
    cqn: u32,
    cap: QpCap,
    at: u64,
) -> Result<CreateQpResp, i32> {
    create_qp_asking(dev, pdn, cqn, cap, at, at + 0x8000)
}

/// What [`QpGrant`] grants `cap` under `limits`, in wire form.
fn grant_of(cap: QpCap, limits: &Limits) -> QpCap {
    let grant = QpGrant::compute(
        crate::verbs::qp::caps_of(&cap),
        crate::verbs::qp::cap_limits(limits),
    )
    .expect("grantable");
    crate::verbs::qp::wire_caps(grant.caps)
}

#[test]
fn create_qp_validates_and_grants_caps() {
    let mut dev = device();
    let (pdn, cqn) = pd_and_cq(&mut dev);
    let (sq, rq) = (MEM_BASE + 0x10000, MEM_BASE + 0x20000);
    let mut create = |pdn, cqn, rq| create_qp(&mut dev, pdn, cqn, sq, rq);
    assert_refused(
        libc::EINVAL,
        [
            (create(pdn, cqn + 50, rq), "unknown CQ"),
            (create(pdn + 50, cqn, rq), "unknown PD"),
            (create(pdn, cqn, sq), "overlapping rings"),
            (create(pdn, cqn, rq + 0x40), "misaligned ring"),
        ],
    );
    let qp = create_qp(&mut dev, pdn, cqn, sq, rq).expect("qp");
    assert_eq!(qp.cap, grant_of(qp_cap(10, 2, 64), &Limits::default()));
    let geometry = ring::sq_geometry(10, 2, 64).expect("geometry");
    assert_eq!(qp.cap.max_send_wr.get(), geometry.depth);
    assert!(qp.qpn.get() > 1 && qp.qpn.get() <= 0xff_ffff);
    assert_eq!(qp.db_index.get(), 0, "the first QP's doorbell bit");
    let stored = dev.qp(qp.qpn.get()).expect("recorded");
    assert_eq!((stored.cap, stored.db_index), (qp.cap, 0));
    assert_eq!(stored.sq, (sq, geometry));

    let (ud_sq, ud_rq) = (MEM_BASE + 0x30000, MEM_BASE + 0x40000);
    let mut ud = CreateQpReq {
        qp_type: 5,
        cap: qp_cap(1, 0, 0),
        ..vmm::qp_req(pdn, cqn, ud_sq, ud_rq)
    };
    assert_eq!(
        run::<CreateQpResp>(&mut dev, Opcode::CreateQp, ud.as_bytes()).map(|_| ()),
        Err(libc::EINVAL),
        "no QP type 5"
    );
    ud.qp_type = 2;
    ud.cap.max_send_sge = 1000.into();
    assert_eq!(
        run::<CreateQpResp>(&mut dev, Opcode::CreateQp, ud.as_bytes()).map(|_| ()),
        Err(libc::EINVAL),
        "too many SGEs"
    );
}

#[test]
fn the_rc_state_machine_runs_and_rejects_bad_attributes() {
    let mut dev = device();
    let (_, _, qpn) = qp_fixture(&mut dev);
    let init = init_attr();
    let bad_port = QpAttr {
        port_num: 2,
        ..init
    };
    let mut to = |attr_mask, attr| modify(&mut dev, qpn, attr_mask, attr);
    assert_refused(
        libc::EINVAL,
        [
            (to(RTR_MASK, rtr_attr()), "RESET->RTR skips INIT"),
            (to(INIT_MASK & !mask::PORT, init), "missing port"),
            (to(INIT_MASK, bad_port), "bad port"),
        ],
    );
    assert_eq!(
        query_state(&mut dev, qpn),
        QpState::Reset,
        "failed modify changes nothing"
    );
    modify(&mut dev, qpn, INIT_MASK, init).expect("INIT");

    let rtr = rtr_attr();
    let av = |change: &dyn Fn(&mut AhAttr)| {
        let mut ah_attr = rtr.ah_attr;
        change(&mut ah_attr);
        QpAttr { ah_attr, ..rtr }
    };
    let greedy = QpAttr {
        max_dest_rd_atomic: 200,
        ..rtr
    };
    let mut to_rtr = |attr| modify(&mut dev, qpn, RTR_MASK, attr);
    assert_refused(
        libc::EINVAL,
        [
            (to_rtr(QpAttr { path_mtu: 6, ..rtr }), "MTU beyond the enum"),
            (to_rtr(av(&|a| a.is_global = 0)), "no GRH on RoCE"),
            (to_rtr(av(&|a| a.sgid_index = 1)), "sgid_index 1"),
            (to_rtr(av(&|a| a.dgid[0] = 0xfe)), "an IPv6 GID"),
            (
                to_rtr(av(&|a| a.flow_label = 0x10_0000.into())),
                "flow label",
            ),
            (to_rtr(greedy), "rd_atomic above the limit"),
        ],
    );
    assert_eq!(
        modify(&mut dev, qpn, RTR_MASK | mask::ALT_PATH, rtr_attr()),
        Err(libc::EOPNOTSUPP),
        "APM"
    );
    // The LID is ignored on RoCE: a dlid of 0 is fine.
    modify(&mut dev, qpn, RTR_MASK, av(&|a| a.dlid = 0.into())).expect("RTR");

    let rts = QpAttr {
        sq_psn: 77.into(),
        ..rts_attr()
    };
    let (eight_retries, wide_psn) = (
        QpAttr {
            retry_cnt: 8,
            ..rts
        },
        QpAttr {
            sq_psn: 0x100_0000.into(),
            ..rts
        },
    );
    let mut to_rts = |attr| modify(&mut dev, qpn, RTS_MASK, attr);
    assert_refused(
        libc::EINVAL,
        [
            (to_rts(eight_retries), "retry_cnt 8"),
            (to_rts(wide_psn), "PSN above 24 bits"),
        ],
    );
    modify(&mut dev, qpn, RTS_MASK, rts).expect("RTS");
    let resp = query_qp(&mut dev, qpn).expect("query");
    assert_eq!(resp.attr.qp_state, u8::from(QpState::Rts));
    assert_eq!(resp.attr.dest_qp_num.get(), 0x1234);
    assert_eq!(resp.attr.sq_psn.get(), 77);
    assert_eq!(resp.attr.path_mtu, u8::from(Mtu::Mtu1024));
    assert_eq!(resp.attr.ah_attr.dgid, PEER_GID);
    assert_eq!(resp.attr.ah_attr.is_global, 1);

    let wrong_cur = QpAttr {
        qp_state: QpState::Sqd.into(),
        cur_qp_state: QpState::Init.into(),
        ..QpAttr::default()
    };
    assert_eq!(
        modify(&mut dev, qpn, mask::STATE | mask::CUR_STATE, wrong_cur),
        Err(libc::EINVAL),
        "cur_qp_state mismatch"
    );
    to_state(&mut dev, qpn, QpState::Sqd).expect("SQD");
    to_state(&mut dev, qpn, QpState::Rts).expect("back to RTS");
    to_state(&mut dev, qpn, QpState::Err).expect("ERR");
    assert_eq!(
        modify(&mut dev, qpn, RTS_MASK, rts),
        Err(libc::EINVAL),
        "ERR->RTS"
    );
    to_state(&mut dev, qpn, QpState::Reset).expect("RESET");
    assert_eq!(query_state(&mut dev, qpn), QpState::Reset);
    assert_eq!(
        modify(&mut dev, qpn + 1, INIT_MASK, init),
        Err(libc::EINVAL),
        "unknown QP"
    );
}

#[test]
fn a_refused_create_qp_writes_no_guest_memory() {
    let mut dev = device();
    let (pdn, cqn) = pd_and_cq(&mut dev);
    let sq = MEM_BASE + 0x10000;
    dev.mem
        .write_slice(&[0xabu8; 128], GuestAddress(sq))
        .expect("dirty");
    let beyond = MEM_BASE + MEM_SIZE as u64;
    assert_eq!(
        create_qp(&mut dev, pdn, cqn, sq, beyond).map(|_| ()),
        Err(libc::EINVAL)
    );
    let mut header = [0u8; 128];
    dev.mem
        .read_slice(&mut header, GuestAddress(sq))
        .expect("read");
    assert!(header.iter().all(|&b| b == 0xab), "SQ ring untouched");
}

#[test]
fn granted_depth_never_exceeds_the_limit() {
    let mut dev = device_with(Limits {
        max_qp_depth: 1000,
        ..Limits::default()
    });
    let (pdn, cqn) = pd_and_cq(&mut dev);
    let (sq, rq) = (MEM_BASE + 0x100000, MEM_BASE + 0x200000);
    let qp = create_qp_asking(&mut dev, pdn, cqn, qp_cap(1000, 0, 0), sq, rq).expect("qp");
    assert_eq!(qp.cap.max_send_wr.get(), 1000);
    assert_eq!(qp.cap.max_recv_wr.get(), 1000);
}

/// Defect 1: a QP is granted exactly what [`QpGrant`] computes — what the
/// rings hold within the tenant's limits — so never more than hostd's
/// datapath carries, and a tenant allowed the format's ceilings gets them.
#[test]
fn granted_caps_are_the_grant_up_to_the_format_ceilings() {
    let ceilings = Limits {
        max_sge: MAX_SGE,
        max_inline_data: MAX_INLINE_DATA,
        ..Limits::default()
    };
    let mut dev = device_with(ceilings);
    let (pdn, cqn) = pd_and_cq(&mut dev);
    let widest = qp_with(
        &mut dev,
        pdn,
        cqn,
        qp_cap(1, MAX_SGE, MAX_INLINE_DATA),
        MEM_BASE + 0x40000,
    )
    .expect("the widest QP the format carries");
    assert_eq!(widest.cap.max_send_sge.get(), 64);
    assert_eq!(widest.cap.max_recv_sge.get(), 64);
    assert_eq!(widest.cap.max_inline_data.get(), 1024);
    assert_eq!(
        widest.cap,
        grant_of(qp_cap(1, MAX_SGE, MAX_INLINE_DATA), &ceilings)
    );
    for (cap, what) in [
        (qp_cap(1, MAX_SGE + 1, 0), "65 SGEs"),
        (qp_cap(1, 1, MAX_INLINE_DATA + 1), "1025 inline bytes"),
    ] {
        assert_eq!(
            qp_with(&mut dev, pdn, cqn, cap, MEM_BASE + 0x50000).map(|_| ()),
            Err(libc::EINVAL),
            "{what}"
        );
    }
    // 16 SGEs take a 512-byte slot, which holds 29: a tenant limited to
    // 16 is granted 16, one allowed 64 is granted what the slot holds.
    let sixteen =
        qp_with(&mut dev, pdn, cqn, qp_cap(4, 16, 0), MEM_BASE + 0x50000).expect("16 SGEs");
    assert_eq!(sixteen.cap.max_send_sge.get(), 29);
    let mut limited = device();
    let (pdn, cqn) = pd_and_cq(&mut limited);
    let qp =
        qp_with(&mut limited, pdn, cqn, qp_cap(4, 16, 0), MEM_BASE + 0x50000).expect("16 SGEs");
    assert_eq!(qp.cap.max_send_sge.get(), 16);
    assert_eq!(qp.cap.max_inline_data.get(), 256, "the default limit");
    assert_eq!(qp.cap, grant_of(qp_cap(4, 16, 0), &Limits::default()));
}

#[test]
fn doorbell_indices_are_dense_and_come_back() {
    let mut dev = device();
    let (pdn, cqn) = pd_and_cq(&mut dev);
    let at = |i: u64| MEM_BASE + 0x40000 + i * 0x10000;
    let mut qps: Vec<CreateQpResp> = (0..3)
        .map(|i| qp_with(&mut dev, pdn, cqn, qp_cap(8, 1, 0), at(i)).expect("qp"))
        .collect();
    let indexes: Vec<u32> = qps.iter().map(|q| q.db_index.get()).collect();
    assert_eq!(indexes, [0, 1, 2]);
    let middle = qps.remove(1);
    release(&mut dev, Opcode::DestroyQp, middle.qpn.get()).expect("destroy");
    let reused = qp_with(&mut dev, pdn, cqn, qp_cap(8, 1, 0), at(1)).expect("qp");
    assert_eq!(reused.db_index.get(), 1, "the freed bit is the lowest free");
    let next = qp_with(&mut dev, pdn, cqn, qp_cap(8, 1, 0), at(3)).expect("qp");
    assert_eq!(next.db_index.get(), 3);
    assert_eq!(
        dev.qp(next.qpn.get()).map(|qp| qp.db_index),
        Some(3),
        "recorded with the QP"
    );

    // A reset frees every bit: the next driver starts at 0 again.
    dev.release_all();
    set_doorbell(&mut dev, DOORBELL).expect("doorbell page");
    let (pdn, cqn) = pd_and_cq(&mut dev);
    let first = qp_with(&mut dev, pdn, cqn, qp_cap(8, 1, 0), at(0)).expect("qp");
    assert_eq!(first.db_index.get(), 0);
}
