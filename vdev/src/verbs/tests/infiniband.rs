//! A device on an InfiniBand port (hostd's `[port] link_layer =
//! "infiniband"`): the port's LID and subnet manager, and address vectors
//! that name their destination by LID, without a GRH.

use vrdma_hostd_protocol::messages::{PortLinkLayer, SM_LID};
use vrdma_spec::verbs::LinkLayer;

use super::ud::create_ah;
use super::*;
use crate::verbs::qp::destination;

/// A brought-up device (memory, doorbell page) whose port is InfiniBand,
/// with LID 5.
fn ib_device() -> RdmaDevice {
    let identity = DeviceIdentity {
        link_layer: PortLinkLayer::Infiniband,
        ..identity()
    };
    let mut dev = RdmaDevice::new(identity, Limits::default());
    dev.update_memory(guest_memory());
    set_doorbell(&mut dev, DOORBELL).expect("doorbell page");
    dev
}

/// An address vector without a GRH towards LID `dlid`.
fn by_lid(dlid: u16) -> AhAttr {
    AhAttr {
        dlid: dlid.into(),
        is_global: 0,
        port_num: 1,
        ..AhAttr::default()
    }
}

/// Destination LIDs no port has: the reserved LID 0, multicast LIDs
/// (vrdma has no multicast) and the permissive LID.
const NOT_UNICAST: [u16; 4] = [0, 0xc000, 0xfffe, 0xffff];

#[test]
fn the_port_reports_infiniband_its_lid_and_the_subnet_manager() {
    let mut dev = ib_device();
    let req = QueryPortReq {
        port_num: 1,
        ..Default::default()
    };
    let port: vrdma_spec::config::PortAttr =
        run(&mut dev, Opcode::QueryPort, req.as_bytes()).expect("port");
    assert_eq!(port.link_layer, u8::from(LinkLayer::Infiniband));
    assert_eq!(
        (port.lid.get(), port.sm_lid.get(), port.lmc),
        (5, SM_LID, 0)
    );
    assert_eq!(port.state, 4, "ACTIVE");
    assert_eq!(dev.config().port, port, "the config space says the same");
    // GID 0 stays the device's GID, of type IB.
    let gid = query_gid0(&mut dev);
    assert_eq!(gid.gid, vrdma_spec::gid::loopback_gid(5));
    assert_eq!(gid.gid_type.get(), gid_type::IB);
}

#[test]
fn rtr_takes_a_unicast_lid_without_a_grh_and_still_checks_a_grh() {
    let mut dev = ib_device();
    let (_, _, qpn) = qp_fixture(&mut dev);
    modify(&mut dev, qpn, INIT_MASK, init_attr()).expect("INIT");
    let rtr = rtr_attr();
    let with = |ah_attr| QpAttr { ah_attr, ..rtr };
    for dlid in NOT_UNICAST {
        assert_eq!(
            modify(&mut dev, qpn, RTR_MASK, with(by_lid(dlid))),
            Err(libc::EINVAL),
            "dlid {dlid:#x}"
        );
    }
    let bad_grh = AhAttr {
        sgid_index: 1,
        ..rtr.ah_attr
    };
    assert_eq!(
        modify(&mut dev, qpn, RTR_MASK, with(bad_grh)),
        Err(libc::EINVAL),
        "a GRH is checked as on RoCE"
    );
    let bad_port = AhAttr {
        port_num: 2,
        ..by_lid(7)
    };
    assert_eq!(
        modify(&mut dev, qpn, RTR_MASK, with(bad_port)),
        Err(libc::EINVAL),
        "port 2"
    );
    assert_eq!(query_state(&mut dev, qpn), QpState::Init);
    modify(&mut dev, qpn, RTR_MASK, with(by_lid(0xbfff))).expect("the largest unicast LID");
    assert_eq!(query_state(&mut dev, qpn), QpState::Rtr);
}

#[test]
fn a_grh_is_optional_for_address_handles() {
    let mut dev = ib_device();
    let pdn = alloc_pd(&mut dev);
    for dlid in NOT_UNICAST {
        assert_eq!(
            create_ah(&mut dev, pdn, by_lid(dlid)).map(|_| ()),
            Err(libc::EINVAL),
            "dlid {dlid:#x}"
        );
    }
    let ah = create_ah(&mut dev, pdn, by_lid(2)).expect("AH by LID");
    assert_eq!(dev.ah(ah.ahn.get()).map(|a| a.attr), Some(by_lid(2)));
    let global = AhAttr {
        is_global: 1,
        dgid: vrdma_spec::gid::loopback_gid(2),
        ..by_lid(2)
    };
    create_ah(&mut dev, pdn, global).expect("AH with a GRH");
}

#[test]
fn hostd_is_told_the_lid_only_without_a_grh() {
    assert_eq!(destination(&by_lid(9)), ([0; 16], Some(9)));
    let global = AhAttr {
        is_global: 1,
        dgid: vrdma_spec::gid::loopback_gid(2),
        ..by_lid(9)
    };
    assert_eq!(
        destination(&global),
        (vrdma_spec::gid::loopback_gid(2), None),
        "a GRH names the peer by GID, whatever the LID"
    );
}

#[test]
fn on_ethernet_an_address_vector_without_a_grh_is_refused() {
    let mut dev = device();
    let pdn = alloc_pd(&mut dev);
    assert_eq!(
        create_ah(&mut dev, pdn, by_lid(2)).map(|_| ()),
        Err(libc::EINVAL)
    );
    let (_, _, qpn) = qp_fixture(&mut dev);
    modify(&mut dev, qpn, INIT_MASK, init_attr()).expect("INIT");
    let rtr = QpAttr {
        ah_attr: by_lid(2),
        ..rtr_attr()
    };
    assert_eq!(modify(&mut dev, qpn, RTR_MASK, rtr), Err(libc::EINVAL));
}
