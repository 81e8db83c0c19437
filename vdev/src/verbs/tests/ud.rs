//! UD and UC QPs and address handles: types, state tables, the Q_Key, the
//! AH quota and checks, and what hostd is told.

use vrdma_hostd_protocol::messages::{AhSetup, QpModify, Request};

use vrdma_spec::verbs::QpType;

use super::hostd::attached;
use super::*;

pub(super) fn create_ah(dev: &mut RdmaDevice, pdn: u32, attr: AhAttr) -> Result<AhHandle, i32> {
    let req = CreateAhReq {
        pdn: pdn.into(),
        reserved: 0.into(),
        attr,
    };
    run(dev, Opcode::CreateAh, req.as_bytes())
}

/// A path towards `::ffff:10.200.0.7`, hop limit 64.
fn av() -> AhAttr {
    AhAttr {
        dgid: vrdma_spec::gid::ipv4_mapped([10, 200, 0, 7]),
        is_global: 1,
        port_num: 1,
        hop_limit: 64,
        traffic_class: 0x20,
        ..AhAttr::default()
    }
}

/// A QP of `qp_type` with its rings at `at`.
fn typed_qp(dev: &mut RdmaDevice, pdn: u32, cqn: u32, qp_type: QpType, at: u64) -> u32 {
    let req = CreateQpReq {
        qp_type: qp_type.into(),
        ..vmm::qp_req(pdn, cqn, at, at + 0x8000)
    };
    run::<CreateQpResp>(dev, Opcode::CreateQp, req.as_bytes())
        .expect("QP")
        .qpn
        .get()
}

#[test]
fn address_handles_are_checked_as_paths_and_counted() {
    let mut dev = device_with(Limits {
        max_ah: 2,
        ..Limits::default()
    });
    let pdn = alloc_pd(&mut dev);
    let a = create_ah(&mut dev, pdn, av()).expect("first");
    assert_eq!(dev.ah(a.ahn.get()).map(|ah| ah.attr), Some(av()));
    let ipv6 = AhAttr {
        dgid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        ..av()
    };
    assert_refused(
        libc::EINVAL,
        [
            (create_ah(&mut dev, 999, av()), "unknown PD"),
            (
                create_ah(
                    &mut dev,
                    pdn,
                    AhAttr {
                        is_global: 0,
                        ..av()
                    },
                ),
                "no GRH on a RoCE port",
            ),
            (
                create_ah(
                    &mut dev,
                    pdn,
                    AhAttr {
                        port_num: 2,
                        ..av()
                    },
                ),
                "port 2",
            ),
            (
                create_ah(
                    &mut dev,
                    pdn,
                    AhAttr {
                        sgid_index: 1,
                        ..av()
                    },
                ),
                "GID index 1",
            ),
            (create_ah(&mut dev, pdn, ipv6), "an IPv6 GID"),
        ],
    );
    create_ah(&mut dev, pdn, av()).expect("second");
    assert_eq!(
        create_ah(&mut dev, pdn, av()).map(|_| ()),
        Err(libc::ENOMEM)
    );
    assert_eq!(dev.config().device.max_ah.get(), 2);
    // An AH keeps its PD.
    assert_eq!(release(&mut dev, Opcode::DeallocPd, pdn), Err(libc::EBUSY));
    release(&mut dev, Opcode::DestroyAh, a.ahn.get()).expect("destroy");
    assert_eq!(
        release(&mut dev, Opcode::DestroyAh, a.ahn.get()),
        Err(libc::EINVAL)
    );
    create_ah(&mut dev, pdn, av()).expect("room again");
}

#[test]
fn ud_and_uc_qps_walk_their_own_state_tables() {
    let mut dev = device();
    let (pdn, cqn) = pd_and_cq(&mut dev);
    let ud = typed_qp(&mut dev, pdn, cqn, QpType::Ud, MEM_BASE + 0x4_0000);
    assert_eq!(query_qp(&mut dev, ud).expect("query").qp_type, 4);
    let init = QpAttr {
        qp_state: QpState::Init.into(),
        qkey: 0x1111_1111.into(),
        port_num: 1,
        ..QpAttr::default()
    };
    let init_mask = mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY;
    assert_eq!(
        modify(&mut dev, ud, init_mask & !mask::QKEY, init),
        Err(libc::EINVAL),
        "INIT needs a Q_Key"
    );
    let privileged = QpAttr {
        qkey: 0x8001_0000.into(),
        ..init
    };
    assert_eq!(
        modify(&mut dev, ud, init_mask, privileged),
        Err(libc::EPERM),
        "QP1's Q_Key (a controlled one) is privileged, as Linux has it"
    );
    modify(&mut dev, ud, init_mask, init).expect("INIT");
    assert_eq!(
        query_qp(&mut dev, ud).expect("query").attr.qkey.get(),
        0x1111_1111
    );
    let state = |s: QpState| QpAttr {
        qp_state: s.into(),
        ..QpAttr::default()
    };
    modify(&mut dev, ud, mask::STATE, state(QpState::Rtr)).expect("RTR: the state alone");
    assert_eq!(
        modify(&mut dev, ud, mask::STATE, state(QpState::Rts)),
        Err(libc::EINVAL),
        "RTS needs sq_psn"
    );
    modify(
        &mut dev,
        ud,
        mask::STATE | mask::SQ_PSN,
        state(QpState::Rts),
    )
    .expect("RTS");

    let uc = typed_qp(&mut dev, pdn, cqn, QpType::Uc, MEM_BASE + 0x6_0000);
    modify(&mut dev, uc, INIT_MASK, init_attr()).expect("INIT");
    let rtr_mask = mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN;
    assert_eq!(
        modify(&mut dev, uc, rtr_mask | mask::MIN_RNR_TIMER, rtr_attr()),
        Err(libc::EINVAL),
        "no RNR timer on UC"
    );
    modify(&mut dev, uc, rtr_mask, rtr_attr()).expect("RTR");
    modify(&mut dev, uc, mask::STATE | mask::SQ_PSN, rts_attr()).expect("RTS");
}

#[test]
fn hostd_is_told_the_qkey_and_each_address_handle() {
    let (hostd, mut dev, _fds) = attached("ud");
    set_doorbell(&mut dev, DOORBELL).expect("doorbell");
    let _ = hostd.next();
    let (pdn, cqn) = pd_and_cq(&mut dev);
    let _ = hostd.next_plain();
    let ud = typed_qp(&mut dev, pdn, cqn, QpType::Ud, MEM_BASE + 0x4_0000);
    match hostd.next_plain() {
        Request::CreateQp(s) => assert_eq!((s.vqpn, s.qp_type), (ud, 4)),
        other => panic!("{other:?}"),
    }
    let init = QpAttr {
        qp_state: QpState::Init.into(),
        qkey: 0x0000_0042.into(),
        port_num: 1,
        ..QpAttr::default()
    };
    let init_mask = mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY;
    modify(&mut dev, ud, init_mask, init).expect("INIT");
    assert_eq!(
        hostd.next_plain(),
        Request::ModifyQp(QpModify {
            vqpn: ud,
            state: QpState::Init.into(),
            connection: None,
            access: None,
            qkey: Some(0x0000_0042),
        })
    );
    let ahn = create_ah(&mut dev, pdn, av()).expect("AH").ahn.get();
    assert_eq!(
        hostd.next_plain(),
        Request::CreateAh(AhSetup {
            ahn,
            pd: pdn,
            dgid: av().dgid,
            dlid: None,
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0x20,
        })
    );
    release(&mut dev, Opcode::DestroyAh, ahn).expect("destroy");
    assert_eq!(hostd.next_plain(), Request::DestroyAh { ahn });
    hostd.assert_quiet("DestroyAh");
}
