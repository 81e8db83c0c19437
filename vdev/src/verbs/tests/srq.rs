//! Shared receive queues: quota, grant, limit, attachment and the busy
//! rules.

use super::*;

/// CREATE_SRQ of `max_wr` WRs of `max_sge` SGEs, limit `limit`, its ring at
/// `addr`.
fn create_srq(
    dev: &mut RdmaDevice,
    pdn: u32,
    (max_wr, max_sge, limit): (u32, u32, u32),
    addr: u64,
) -> Result<SrqAttr, i32> {
    let req = CreateSrqReq {
        pdn: pdn.into(),
        max_wr: max_wr.into(),
        max_sge: max_sge.into(),
        srq_limit: limit.into(),
        ring_addr: addr.into(),
    };
    run(dev, Opcode::CreateSrq, req.as_bytes())
}

fn modify_srq(
    dev: &mut RdmaDevice,
    srqn: u32,
    mask: u32,
    max_wr: u32,
    limit: u32,
) -> Result<(), i32> {
    let req = ModifySrqReq {
        srqn: srqn.into(),
        attr_mask: mask.into(),
        max_wr: max_wr.into(),
        srq_limit: limit.into(),
    };
    run_unit(dev, Opcode::ModifySrq, req.as_bytes())
}

fn query_srq(dev: &mut RdmaDevice, srqn: u32) -> Result<SrqAttr, i32> {
    let req = SrqHandle {
        srqn: srqn.into(),
        reserved: 0.into(),
    };
    run(dev, Opcode::QuerySrq, req.as_bytes())
}

/// Where the tests' SRQ rings go: 64 KiB apart, above the QP fixtures.
fn srq_ring(n: u64) -> u64 {
    MEM_BASE + 0x10_0000 + n * 0x1_0000
}

#[test]
fn create_srq_grants_a_receive_ring_and_checks_its_arguments() {
    let mut dev = device();
    let (pdn, _cqn) = pd_and_cq(&mut dev);
    let srq = create_srq(&mut dev, pdn, (100, 2, 10), srq_ring(0)).expect("srq");
    // A receive ring of rq_geometry(100, 2): 128 slots of 64 bytes, which
    // hold 3 SGEs.
    assert_eq!(
        (srq.max_wr.get(), srq.max_sge.get(), srq.srq_limit.get()),
        (128, 3, 10)
    );
    let q = query_srq(&mut dev, srq.srqn.get()).expect("query");
    assert_eq!(q, srq);
    let limits = Limits::default();
    assert_refused(
        libc::EINVAL,
        [
            (
                create_srq(&mut dev, 999, (16, 1, 0), srq_ring(1)),
                "unknown PD",
            ),
            (create_srq(&mut dev, pdn, (0, 1, 0), srq_ring(1)), "no WRs"),
            (
                create_srq(&mut dev, pdn, (limits.max_qp_depth + 1, 1, 0), srq_ring(1)),
                "deeper than max_qp_depth",
            ),
            (
                create_srq(&mut dev, pdn, (16, limits.max_sge + 1, 0), srq_ring(1)),
                "more SGEs than max_sge",
            ),
            (
                create_srq(&mut dev, pdn, (16, 1, 17), srq_ring(1)),
                "limit above the depth",
            ),
            (
                create_srq(&mut dev, pdn, (16, 1, 0), srq_ring(1) + 8),
                "misaligned ring",
            ),
            (
                create_srq(&mut dev, pdn, (16, 1, 0), MEM_BASE + MEM_SIZE as u64),
                "ring outside guest memory",
            ),
        ],
    );
}

#[test]
fn the_srq_quota_refuses_the_next_one_and_freeing_makes_room() {
    let mut dev = device_with(Limits {
        max_srq: 2,
        ..Limits::default()
    });
    let pdn = alloc_pd(&mut dev);
    let a = create_srq(&mut dev, pdn, (16, 1, 0), srq_ring(0)).expect("first");
    create_srq(&mut dev, pdn, (16, 1, 0), srq_ring(1)).expect("second");
    assert_eq!(
        create_srq(&mut dev, pdn, (16, 1, 0), srq_ring(2)),
        Err(libc::ENOMEM)
    );
    assert_eq!(dev.config().device.max_srq.get(), 2);
    release(&mut dev, Opcode::DestroySrq, a.srqn.get()).expect("destroy");
    create_srq(&mut dev, pdn, (16, 1, 0), srq_ring(2)).expect("room again");
    // A policy without SRQs.
    let mut none = device_with(Limits {
        max_srq: 0,
        ..Limits::default()
    });
    let pdn = alloc_pd(&mut none);
    assert_eq!(
        create_srq(&mut none, pdn, (16, 1, 0), srq_ring(0)),
        Err(libc::ENOMEM)
    );
}

#[test]
fn modify_srq_arms_the_limit_and_refuses_resizing() {
    let mut dev = device();
    let pdn = alloc_pd(&mut dev);
    let srqn = create_srq(&mut dev, pdn, (64, 1, 0), srq_ring(0))
        .expect("srq")
        .srqn
        .get();
    modify_srq(&mut dev, srqn, srq_mask::LIMIT, 0, 32).expect("arm");
    assert_eq!(
        query_srq(&mut dev, srqn).expect("query").srq_limit.get(),
        32
    );
    assert_refused(
        libc::EINVAL,
        [
            (
                modify_srq(&mut dev, srqn, srq_mask::MAX_WR, 128, 0),
                "resize",
            ),
            (
                modify_srq(&mut dev, srqn, srq_mask::LIMIT, 0, 65),
                "limit above depth",
            ),
            (modify_srq(&mut dev, srqn, 4, 0, 1), "unknown mask bit"),
            (
                modify_srq(&mut dev, srqn + 1000, srq_mask::LIMIT, 0, 1),
                "unknown SRQ",
            ),
            (
                query_srq(&mut dev, srqn + 1000).map(|_| ()),
                "query unknown SRQ",
            ),
        ],
    );
    assert_eq!(
        query_srq(&mut dev, srqn).expect("query").srq_limit.get(),
        32
    );
}

#[test]
fn a_qp_on_an_srq_has_no_receive_queue_and_keeps_the_srq_busy() {
    let mut dev = device();
    let (pdn, cqn) = pd_and_cq(&mut dev);
    let srqn = create_srq(&mut dev, pdn, (64, 1, 0), srq_ring(0))
        .expect("srq")
        .srqn
        .get();
    let on_srq = |srqn: u32| CreateQpReq {
        srqn: srqn.into(),
        ..vmm::qp_req(pdn, cqn, MEM_BASE + 0x4_0000, MEM_BASE + 0x4_8000)
    };
    let unknown = on_srq(srqn + 1000);
    assert_eq!(
        run::<CreateQpResp>(&mut dev, Opcode::CreateQp, unknown.as_bytes()).map(|_| ()),
        Err(libc::EINVAL),
        "unknown SRQ"
    );
    let qp: CreateQpResp =
        run(&mut dev, Opcode::CreateQp, on_srq(srqn).as_bytes()).expect("QP on the SRQ");
    let qpn = qp.qpn.get();
    // Its receives are the SRQ's: no receive queue of its own.
    assert_eq!(
        (qp.cap.max_recv_wr.get(), qp.cap.max_recv_sge.get()),
        (0, 0)
    );
    assert_eq!(dev.qp(qpn).and_then(|q| q.srqn), Some(srqn));
    assert_eq!(query_qp(&mut dev, qpn).expect("query").srqn.get(), srqn);
    assert_eq!(
        release(&mut dev, Opcode::DestroySrq, srqn),
        Err(libc::EBUSY)
    );
    assert_eq!(release(&mut dev, Opcode::DeallocPd, pdn), Err(libc::EBUSY));
    release(&mut dev, Opcode::DestroyQp, qpn).expect("destroy QP");
    release(&mut dev, Opcode::DestroySrq, srqn).expect("destroy SRQ");
    assert_eq!(
        release(&mut dev, Opcode::DestroySrq, srqn),
        Err(libc::EINVAL)
    );
}
